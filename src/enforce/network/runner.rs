//! The seam every `tc`, `ip` and `nft` command goes through: [`TcRunner`], run for real by
//! `sys::command::CommandRunner` and recorded by [`RecordingRunner`] in tests. Touches nothing
//! itself.

use super::{show_argv, TcError};
use crate::sys::command::{CommandError, CommandRunner};

/// Runs one command given as an argv vector and returns its standard output. A non-zero exit is
/// [`TcError::Failed`] with the standard error.
pub trait TcRunner: Send {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError>;
}

impl TcRunner for CommandRunner {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError> {
        CommandRunner::run(self, argv).map_err(TcError::from)
    }
}

impl From<CommandError> for TcError {
    fn from(e: CommandError) -> Self {
        match e {
            CommandError::Spawn { argv, source } => TcError::Spawn { argv, source },
            CommandError::Failed {
                argv,
                status,
                stderr,
            } => TcError::Failed {
                argv,
                status,
                stderr,
            },
            CommandError::TimedOut { argv, deadline } => TcError::TimedOut { argv, deadline },
        }
    }
}

/// A fake runner for tests: records every argv and answers from scripted replies (the last
/// reply whose prefix matches wins; otherwise empty output).
#[derive(Debug, Clone, Default)]
pub struct RecordingRunner {
    pub calls: Vec<Vec<String>>,
    replies: Vec<(Vec<String>, Result<String, String>)>,
}

impl RecordingRunner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Commands starting with `prefix` print `stdout`.
    pub fn reply(&mut self, prefix: &[&str], stdout: &str) -> &mut Self {
        self.replies.push((owned(prefix), Ok(stdout.to_string())));
        self
    }

    /// Commands starting with `prefix` fail with `stderr`.
    pub fn fail(&mut self, prefix: &[&str], stderr: &str) -> &mut Self {
        self.replies.push((owned(prefix), Err(stderr.to_string())));
        self
    }

    /// The recorded commands, each joined with spaces.
    pub fn lines(&self) -> Vec<String> {
        self.calls.iter().map(|c| c.join(" ")).collect()
    }

    /// The recorded commands that change something (not `show` or `list`).
    pub fn changes(&self) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| !l.split(' ').any(|w| w == "show" || w == "list"))
            .collect()
    }
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

impl TcRunner for RecordingRunner {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError> {
        self.calls.push(argv.to_vec());
        let reply = self
            .replies
            .iter()
            .rev()
            .find(|(prefix, _)| argv.starts_with(prefix))
            .map(|(_, r)| r.clone());
        match reply {
            None => Ok(String::new()),
            Some(Ok(out)) => Ok(out),
            Some(Err(stderr)) => Err(TcError::Failed {
                argv: show_argv(argv),
                status: "exit status: 2".to_string(),
                stderr,
            }),
        }
    }
}
