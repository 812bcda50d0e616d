//! The one runner for external programs (`tc`, `ip`, `nft`): an argv vector in, the standard output
//! back, a non-zero exit as an error with the standard error, and an optional deadline past which
//! the command (its whole process group) is killed and reported as [`CommandError::TimedOut`],
//! its reaping waited for at most 1 s more. Touches child processes only.

use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::LazyLock;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::bounded::BoundedThreads;

/// How long the deadline loop sleeps at most between looks at the child.
const MAX_POLL: Duration = Duration::from_millis(20);

/// How long a killed command's reaping is waited for before the run returns without it.
const REAP_WAIT: Duration = Duration::from_secs(1);

/// Killed commands still being reaped, at most 8: each that cannot be holds a thread until it
/// can (see [`super::bounded`]).
static REAPERS: LazyLock<BoundedThreads> = LazyLock::new(|| BoundedThreads::new("lodger-reap", 8));

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The program could not be started (not installed, not executable).
    #[error("cannot run `{argv}`: {source}")]
    Spawn { argv: String, source: io::Error },
    /// It ran and exited non-zero.
    #[error("`{argv}` failed ({status}): {stderr}")]
    Failed {
        argv: String,
        status: String,
        stderr: String,
    },
    /// It did not finish within the runner's deadline and was killed.
    #[error("`{argv}` did not finish within {deadline:?}: killed")]
    TimedOut { argv: String, deadline: Duration },
}

/// Runs commands for real, optionally behind a prefix (`ip netns exec NAME`) and under a deadline.
#[derive(Debug, Clone, Default)]
pub struct CommandRunner {
    prefix: Vec<String>,
    deadline: Option<Duration>,
}

impl CommandRunner {
    /// Runs in lodgerd's own network namespace, with no deadline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs every command inside the named network namespace (`ip netns exec NAME ...`).
    pub fn in_netns(name: &str) -> Self {
        Self {
            prefix: ["ip", "netns", "exec", name]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            deadline: None,
        }
    }

    /// The same runner, killing any command that runs longer than `deadline`.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Runs `argv` (behind the prefix) and returns its standard output. A non-zero exit is
    /// [`CommandError::Failed`], naming `argv` without the prefix.
    pub fn run(&self, argv: &[String]) -> Result<String, CommandError> {
        let full: Vec<&String> = self.prefix.iter().chain(argv).collect();
        let shown = full
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(" ");
        let Some((program, args)) = full.split_first() else {
            return Err(CommandError::Spawn {
                argv: shown,
                source: io::Error::new(io::ErrorKind::InvalidInput, "empty command"),
            });
        };
        let mut command = Command::new(program);
        command
            .args(args)
            // tc's and nft's messages are matched by callers: keep them in English.
            .env("LC_ALL", "C");
        let (status, stdout, stderr) = match self.deadline {
            None => {
                let out = command.output().map_err(|source| CommandError::Spawn {
                    argv: shown.clone(),
                    source,
                })?;
                (out.status, out.stdout, out.stderr)
            }
            Some(deadline) => run_until(&mut command, deadline).map_err(|e| match e {
                Overrun::Spawn(source) => CommandError::Spawn {
                    argv: shown.clone(),
                    source,
                },
                Overrun::Deadline => CommandError::TimedOut {
                    argv: shown.clone(),
                    deadline,
                },
            })?,
        };
        if status.success() {
            return Ok(String::from_utf8_lossy(&stdout).into_owned());
        }
        Err(CommandError::Failed {
            argv: argv.join(" "),
            status: status.to_string(),
            stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
        })
    }
}

enum Overrun {
    Spawn(io::Error),
    Deadline,
}

/// Runs `command` in a process group of its own, reading its output on two threads (a full pipe
/// must not stall it), and kills the group if it has not exited within `deadline`.
fn run_until(
    command: &mut Command,
    deadline: Duration,
) -> Result<(ExitStatus, Vec<u8>, Vec<u8>), Overrun> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(Overrun::Spawn)?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let end = Instant::now() + deadline;
    let mut pause = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            // Cannot look at the child: treat as overrun so it does not linger.
            Err(_) => break None,
        }
        let now = Instant::now();
        if now >= end {
            break None;
        }
        thread::sleep(pause.min(end - now));
        pause = (pause * 2).min(MAX_POLL);
    };
    let Some(status) = status else {
        kill_group(&mut child);
        // Reaped aside, waited for at most REAP_WAIT: a command stuck in the kernel (a hung
        // netlink lock: SIGKILL stays pending) would otherwise hold the caller, lodgerd's agent
        // loop, past the deadline. Past the cap of reapers still waiting, the child is left
        // unreaped. The readers are not waited for (dropping their handles detaches them): a
        // descendant that left the group (`setsid`) may hold the pipes for as long as it lives,
        // and a reaper joining them held its place under the cap as long; they end once every
        // process holding the pipes is gone.
        let _ = REAPERS.run(REAP_WAIT, move || {
            let _ = child.wait();
        });
        drop((stdout, stderr));
        return Err(Overrun::Deadline);
    };
    let out = stdout.join().unwrap_or_default();
    let err = stderr.join().unwrap_or_default();
    Ok((status, out, err))
}

/// Kills the child's process group (the child and whatever it started); the caller reaps it.
fn kill_group(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // The child is not reaped yet, so its pid (the group id) cannot have been reused.
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let _ = child.kill();
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        buf
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn output_and_failure_without_a_deadline() {
        let runner = CommandRunner::new();
        assert_eq!(runner.deadline(), None);
        let out = runner.run(&argv(&["echo", "hello"])).expect("echo runs");
        assert_eq!(out, "hello\n");
        match runner.run(&argv(&["sh", "-c", "echo oops >&2; exit 3"])) {
            Err(CommandError::Failed { argv, stderr, .. }) => {
                assert_eq!(argv, "sh -c echo oops >&2; exit 3");
                assert_eq!(stderr, "oops");
            }
            other => panic!("expected Failed, got {other:?}"),
        }
        assert!(matches!(runner.run(&[]), Err(CommandError::Spawn { .. })));
        assert!(matches!(
            runner.run(&argv(&["/nonexistent/lodger-no-such-program"])),
            Err(CommandError::Spawn { .. })
        ));
    }

    #[test]
    fn a_command_within_its_deadline_runs_as_without_one() {
        let runner = CommandRunner::new().with_deadline(Duration::from_secs(30));
        let out = runner.run(&argv(&["echo", "hello"])).expect("echo runs");
        assert_eq!(out, "hello\n");
        assert!(matches!(
            runner.run(&argv(&["sh", "-c", "exit 2"])),
            Err(CommandError::Failed { .. })
        ));
        assert!(matches!(
            runner.run(&argv(&["/nonexistent/lodger-no-such-program"])),
            Err(CommandError::Spawn { .. })
        ));
    }

    #[test]
    fn a_command_past_its_deadline_is_killed_and_named() {
        let runner = CommandRunner::new().with_deadline(Duration::from_millis(100));
        match runner.run(&argv(&["sleep", "30"])) {
            Err(CommandError::TimedOut { argv, deadline }) => {
                assert_eq!(argv, "sleep 30");
                assert_eq!(deadline, Duration::from_millis(100));
            }
            other => panic!("expected TimedOut, got {other:?}"),
        }
        // A child that keeps the output pipe open (a grandchild of the shell) is killed with it:
        // the run returns instead of waiting for the pipe to close.
        let err = runner
            .run(&argv(&["sh", "-c", "sleep 30 & sleep 30"]))
            .expect_err("past the deadline");
        assert!(matches!(err, CommandError::TimedOut { .. }), "{err}");
        assert!(
            err.to_string().contains("sh -c sleep 30 & sleep 30"),
            "{err}"
        );
    }

    /// A command that outlives its deadline and cannot be reaped at once (stuck in the kernel,
    /// SIGKILL pending; here a descendant that left the process group and keeps the output pipe
    /// open) held the caller, lodgerd's agent loop, until it let go: the run waited for the child
    /// and its pipes after the kill. Now it returns at the deadline; the reaping goes on aside.
    #[test]
    fn a_command_that_cannot_be_reaped_at_once_does_not_hold_the_run() {
        let dir = tempfile::tempdir().expect("tempdir");
        let escaped = dir.path().join("escaped");
        let runner = CommandRunner::new().with_deadline(Duration::from_millis(100));
        let script = format!(
            "setsid sleep 40 & echo $! > {}; sleep 40",
            escaped.display()
        );
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(runner.run(&argv(&["sh", "-c", &script])));
        });
        let outcome = rx.recv_timeout(Duration::from_secs(20));
        // The reaper is done once the killed child is reaped, though the escaped sleep still
        // holds the pipes: it held its place under the cap while the sleep lived (40 s).
        let reaped = (0..200).any(|_| {
            thread::sleep(Duration::from_millis(50));
            REAPERS.running() == 0
        });
        // The escaped sleep is this test's: it goes whatever the outcome.
        if let Some(pid) = std::fs::read_to_string(&escaped)
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let outcome = outcome.expect("the run did not return: the escaped sleep's pipe holds it");
        assert!(
            matches!(outcome, Err(CommandError::TimedOut { .. })),
            "{outcome:?}"
        );
        assert!(reaped, "the reaper waited for the escaped sleep's pipes");
    }
}
