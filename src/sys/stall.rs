//! Looking at a path without waiting on a filesystem that does not answer (a hard NFS mount
//! whose server is down, a FUSE daemon that hangs): a `stat` there blocks uninterruptibly, and
//! would block the thread that asked, here lodgerd's agent loop. Hand-written: no crate bounds a
//! blocking system call's wait; this runs it on a thread of its own and stops waiting for it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// How long a path may take to answer before it counts as hung.
pub const PATH_PATIENCE: Duration = Duration::from_secs(2);

/// Probes still waiting on a hung filesystem, at most [`MAX_STUCK`]: each holds a thread that
/// returns only when the filesystem answers (or its mount is aborted).
static STUCK: AtomicU32 = AtomicU32::new(0);
const MAX_STUCK: u32 = 8;

/// Probes stuck now: they return when their filesystems answer.
pub fn stuck() -> u32 {
    STUCK.load(Ordering::SeqCst)
}

/// Looks up every path of `paths` (`stat`, following links) on a thread of its own, and waits
/// up to `patience` for it. `Err` names the path that did not answer, or says that too many
/// earlier probes are still stuck to start another; a path that answers with an error (missing,
/// not permitted) is not this function's business and passes.
pub fn answers_within(paths: &[&Path], patience: Duration) -> Result<(), String> {
    if paths.is_empty() {
        return Ok(());
    }
    if STUCK.load(Ordering::SeqCst) >= MAX_STUCK {
        return Err(format!(
            "{MAX_STUCK} earlier looks at paths are still waiting on a filesystem that does not \
             answer (a hung network or FUSE mount?); not looking at {} until they return",
            paths[0].display()
        ));
    }
    let owned: Vec<PathBuf> = paths.iter().map(|p| p.to_path_buf()).collect();
    let (tx, rx) = mpsc::channel();
    STUCK.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name("lodger-stat".into())
        .spawn(move || {
            for p in &owned {
                // Report each path before looking at it: the receiver names the one that hangs.
                if tx.send(Some(p.clone())).is_err() {
                    break;
                }
                let _ = std::fs::metadata(p);
            }
            let _ = tx.send(None);
            STUCK.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        STUCK.fetch_sub(1, Ordering::SeqCst);
        return Err(format!("cannot start a thread to look at paths: {e}"));
    }
    let deadline = std::time::Instant::now() + patience;
    let mut looking = None;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(Some(p)) => looking = Some(p),
            Ok(None) => return Ok(()),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let path = looking.unwrap_or_else(|| paths[0].to_path_buf());
                return Err(format!(
                    "{} did not answer within {} s (a hung network or FUSE mount?)",
                    path.display(),
                    patience.as_secs_f64()
                ));
            }
        }
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
