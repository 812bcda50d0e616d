//! Looking at a path without waiting on a filesystem that does not answer (a hard NFS mount
//! whose server is down, a FUSE daemon that hangs): a `stat` there blocks uninterruptibly, and
//! would block the thread that asked, here lodgerd's agent loop. The look runs on a thread of its
//! own ([`super::bounded`]), which is waited for at most a bound.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, LazyLock};
use std::time::Duration;

use super::bounded::{BoundedError, BoundedThreads};

/// How long a path may take to answer before it counts as hung.
pub const PATH_PATIENCE: Duration = Duration::from_secs(2);

/// Looks still waiting on a hung filesystem, at most [`MAX_STUCK`]: each holds a thread that
/// returns only when the filesystem answers (or its mount is aborted).
static LOOKS: LazyLock<BoundedThreads> =
    LazyLock::new(|| BoundedThreads::new("lodger-stat", MAX_STUCK));
const MAX_STUCK: u32 = 8;

/// Probes stuck now: they return when their filesystems answer.
pub fn stuck() -> u32 {
    LOOKS.running()
}

/// Looks up every path of `paths` (`stat`, following links) on a thread of its own, and waits
/// up to `patience` for it. `Err` names the path that did not answer, or says that too many
/// earlier probes are still stuck to start another; a path that answers with an error (missing,
/// not permitted) is not this function's business and passes.
pub fn answers_within(paths: &[&Path], patience: Duration) -> Result<(), String> {
    let Some(first) = paths.first() else {
        return Ok(());
    };
    let owned: Vec<PathBuf> = paths.iter().map(|p| p.to_path_buf()).collect();
    // Each path is reported once it answered.
    let (at, looking) = mpsc::channel();
    let looked = LOOKS.run(patience, move || {
        for p in owned {
            let _ = std::fs::metadata(&p);
            let _ = at.send(());
        }
    });
    match looked {
        Ok(()) => Ok(()),
        Err(BoundedError::TimedOut(_)) => {
            // The first path not looked at yet is the one that hangs.
            let done = looking.try_iter().count();
            let path = paths.get(done).or(paths.last()).unwrap_or(first);
            Err(format!(
                "{} did not answer within {} s (a hung network or FUSE mount?)",
                path.display(),
                patience.as_secs_f64()
            ))
        }
        Err(BoundedError::Busy(_)) => Err(format!(
            "{MAX_STUCK} earlier looks at paths are still waiting on a filesystem that does not \
             answer (a hung network or FUSE mount?); not looking at {} until they return",
            first.display()
        )),
        Err(e) => Err(format!("looking at {}: {e}", first.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_that_answer_pass_whether_or_not_they_exist() {
        let dir = tempfile::tempdir().expect("tempdir");
        let none = dir.path().join("none");
        assert_eq!(
            answers_within(&[dir.path(), &none], Duration::from_secs(30)),
            Ok(())
        );
        assert_eq!(answers_within(&[], Duration::ZERO), Ok(()));
    }
}
