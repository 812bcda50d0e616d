//! lock: one lodgerd per state directory. An exclusive `flock` on `<state_dir>/lodgerd.lock`,
//! taken before lodgerd touches the node, held until it exits. Touches only that file.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// The lock file's name in `agent.state_dir`.
pub(super) const LOCK_FILE: &str = "lodgerd.lock";

/// The lock, held while this value lives (the kernel drops it when lodgerd exits, however it
/// exits; the file is opened close-on-exec, so instances lodgerd starts never hold it).
pub(super) struct StateLock {
    _file: Flock<File>,
}

/// Why lodgerd may not run on this state directory.
#[derive(Debug, thiserror::Error)]
pub(super) enum LockError {
    #[error(
        "another lodgerd{} is running on the state directory {}: stop it first \
         (`systemctl stop lodgerd`), or give this one another agent.state_dir",
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        dir.display()
    )]
    Held { dir: PathBuf, holder: Option<u32> },
    #[error("cannot lock {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Takes the lock of `state_dir` (made if missing, mode 0700 as the store makes it) for this
/// process, writing its pid into the file for the message another lodgerd gives.
pub(super) fn lock_state_dir(state_dir: &Path) -> Result<StateLock, LockError> {
    use std::os::unix::fs::DirBuilderExt;
    let path = state_dir.join(LOCK_FILE);
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(io)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(locked) => locked,
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            let holder = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(LockError::Held {
                dir: state_dir.to_path_buf(),
                holder,
            });
        }
        Err((_, errno)) => return Err(io(std::io::Error::from(errno))),
    };
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(StateLock { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second lock on the same state directory is refused, naming the holder; once the first
    /// is dropped, the directory can be locked again.
    #[test]
    fn one_lock_per_state_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let first = lock_state_dir(&state).expect("first lock");
        // flock locks belong to the open file, so a second open in this process conflicts as
        // another process's would.
        let err = match lock_state_dir(&state) {
            Ok(_) => panic!("locked {} twice", state.display()),
            Err(e) => e,
        };
        assert!(
            matches!(err, LockError::Held { holder: Some(p), .. } if p == std::process::id()),
            "{err:?}"
        );
        assert!(
            err.to_string().starts_with(&format!(
                "another lodgerd (pid {}) is running on the state directory {}",
                std::process::id(),
                state.display()
            )),
            "{err}"
        );
        drop(first);
        lock_state_dir(&state).expect("locked again once released");
    }
}
