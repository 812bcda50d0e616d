//! lock: one lodgerd per state directory. An exclusive `flock` on `<state_dir>/lodgerd.lock`,
//! taken before lodgerd touches the node, held until it exits. Touches only that file.

use std::fs::File;
use std::io::{Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use tracing::warn;

/// The lock file's name in `agent.state_dir`.
pub(super) const LOCK_FILE: &str = "lodgerd.lock";

/// How long lodgerd waits for a lock whose recorded holder no longer runs. A process lodgerd
/// forked shares the lock until it runs its program (close-on-exec drops it then): an instance
/// started just before lodgerd was killed holds it for as long as its start takes (joining a
/// cgroup v1 cpuset waits for an RCU grace period), and a lodgerd restarted at once finds it
/// held.
pub(super) const ORPHANED_LOCK_WAIT: Duration = Duration::from_secs(5);

/// The lock, held while this value lives (the kernel drops it when lodgerd exits, however it
/// exits; the file is opened close-on-exec, so instances lodgerd starts hold it only until they
/// run their program).
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
    #[error(
        "the state directory {}'s lock is still held after {waited:?}, though the lodgerd that \
         took it (pid {holder}) no longer runs: {holders} kept it (a process lodgerd started \
         holds it until it runs its program); see what keeps them (cat /proc/PID/stack) or \
         kill them, then start lodgerd again",
        dir.display()
    )]
    Orphaned {
        dir: PathBuf,
        holder: u32,
        waited: Duration,
        holders: String,
    },
    #[error("cannot lock {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Takes the lock of `state_dir` (made if missing, mode 0700 as the store makes it) for this
/// process, writing its pid into the file for the message another lodgerd gives. A lock whose
/// recorded lodgerd no longer runs is waited for, up to [`ORPHANED_LOCK_WAIT`].
pub(super) fn lock_state_dir(state_dir: &Path) -> Result<StateLock, LockError> {
    lock_waiting(state_dir, ORPHANED_LOCK_WAIT)
}

fn lock_waiting(state_dir: &Path, wait: Duration) -> Result<StateLock, LockError> {
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
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    let started = Instant::now();
    let mut told = false;
    let mut file = loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => break locked,
            Err((unlocked, nix::errno::Errno::EWOULDBLOCK)) => {
                let holder = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|text| text.trim().parse().ok());
                let Some(gone) = holder.filter(|pid| !running(*pid)) else {
                    return Err(LockError::Held {
                        dir: state_dir.to_path_buf(),
                        holder,
                    });
                };
                let waited = started.elapsed();
                if waited >= wait {
                    return Err(LockError::Orphaned {
                        dir: state_dir.to_path_buf(),
                        holder: gone,
                        waited,
                        holders: holders_of(&path),
                    });
                }
                if !told {
                    warn!(
                        "the state directory {}'s lock is held though the lodgerd that took it \
                         (pid {gone}) no longer runs: waiting up to {wait:?} for the processes \
                         it started to run their programs ({})",
                        state_dir.display(),
                        holders_of(&path)
                    );
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(10));
                file = unlocked;
            }
            Err((_, errno)) => return Err(io(std::io::Error::from(errno))),
        }
    };
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(StateLock { _file: file })
}

/// Whether `pid` is a lodgerd that runs: a process that exists (a zombie counts: its parent has
/// yet to reap it) running the program this one runs. A pid the kernel gave to another program
/// since the lodgerd that wrote it ended is not one; a process whose program cannot be read
/// (a zombie, another user's without the right) counts as one.
fn running(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None),
        Err(nix::errno::Errno::ESRCH)
    ) {
        return false;
    }
    // The file name alone: an upgraded lodgerd's predecessor runs a deleted file.
    let program = |who: &str| {
        let target = std::fs::read_link(Path::new("/proc").join(who).join("exe")).ok()?;
        let name = target.file_name()?.to_string_lossy().into_owned();
        Some(name.trim_end_matches(" (deleted)").to_string())
    };
    match (program(&pid.to_string()), program("self")) {
        (Some(theirs), Some(ours)) => theirs == ours,
        _ => true,
    }
}

/// The processes with `path` open, as "pid N (comm)", for the message.
fn holders_of(path: &Path) -> String {
    let proc_root = Path::new("/proc");
    let found: Vec<String> = crate::sys::procfs::holding_open(proc_root, path)
        .into_iter()
        .map(|pid| {
            let comm = std::fs::read_to_string(proc_root.join(pid.to_string()).join("comm"))
                .unwrap_or_default();
            format!("pid {pid} ({})", comm.trim())
        })
        .collect();
    if found.is_empty() {
        "no process found with it open".to_string()
    } else {
        found.join(", ")
    }
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

    /// The lock of `state` taken as a child of a killed lodgerd holds it: another open file
    /// description of the lock file (so this process conflicts with it), with the pid of a
    /// process that has ended written in it.
    fn held_for_a_dead_lodgerd(state: &Path) -> (Flock<File>, u32) {
        let mut ended = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let gone = ended.id();
        ended.wait().expect("wait for true");
        (held_naming(state, gone), gone)
    }

    /// The lock of `state` held by this process through another open file description, with
    /// `pid` written in it.
    fn held_naming(state: &Path, pid: u32) -> Flock<File> {
        std::fs::create_dir_all(state).expect("state dir");
        let path = state.join(LOCK_FILE);
        std::fs::write(&path, format!("{pid}\n")).expect("write the lock file");
        let file = File::open(&path).expect("open the lock file");
        Flock::lock(file, FlockArg::LockExclusiveNonblock).expect("take the lock")
    }

    /// A lock naming a pid that another program now has (the kernel reused the pid of the
    /// lodgerd that wrote it) is an orphaned lock, not another lodgerd: waited for, then refused
    /// naming who holds it.
    #[test]
    fn a_lock_naming_a_pid_another_program_now_has_is_not_another_lodgerd() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        // A spawn returns once the child's exec has let go of this process's memory, which can
        // be a moment before /proc shows the new program (seen on a slow emulated guest): until
        // then the child still runs this program, as a lodgerd's child would.
        let exe = format!("/proc/{}/exe", other.id());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(&exe).map_or(true, |p| !p.ends_with("sleep")) {
            assert!(std::time::Instant::now() < deadline, "sleep never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
        let _held = held_naming(&state, other.id());
        let taken = lock_waiting(&state, Duration::from_millis(50));
        let _ = other.kill();
        let _ = other.wait();
        let err = match taken {
            Ok(_) => panic!("locked a directory whose lock is held"),
            Err(e) => e,
        };
        assert!(
            matches!(&err, LockError::Orphaned { holder, .. } if *holder == other.id()),
            "{err:?}"
        );
    }

    /// A lock whose lodgerd has ended is waited for (a process it forked holds it until its
    /// exec), and taken once released.
    #[test]
    fn a_lock_a_dead_lodgerd_left_to_its_child_is_waited_for() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let (held, _) = held_for_a_dead_lodgerd(&state);
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        let taken = lock_waiting(&state, Duration::from_secs(20));
        release.join().expect("release thread");
        assert!(taken.is_ok(), "{:?}", taken.err());
        let text = std::fs::read_to_string(state.join(LOCK_FILE)).expect("read the lock file");
        assert_eq!(text.trim(), std::process::id().to_string());
    }

    /// A lock its dead lodgerd's child never lets go of ends the wait with an error naming the
    /// processes that hold it.
    #[test]
    fn a_lock_held_past_the_wait_names_who_holds_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let (_held, gone) = held_for_a_dead_lodgerd(&state);
        let err = match lock_waiting(&state, Duration::from_millis(50)) {
            Ok(_) => panic!("locked a directory whose lock is held"),
            Err(e) => e,
        };
        let me = format!("pid {} (", std::process::id());
        assert!(
            matches!(&err, LockError::Orphaned { holder, holders, .. }
                if *holder == gone && holders.contains(&me)),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(&format!(
                "the lodgerd that took it (pid {gone}) no longer runs"
            )),
            "{err}"
        );
    }
}
