//! What can go wrong with an instance or its template, each error with the instance and the
//! path or value. Touches nothing.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::Signal;

use super::InstanceKey;
use crate::enforce::sched::SchedError;
use crate::job::JobId;
use crate::sys::cgroupfs::CgroupError;
use crate::sys::procfs::ProcError;

// ---------------------------------------------------------------------------------------------
// Errors

/// What is wrong with a command template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateProblem {
    Empty,
    UnknownPlaceholder {
        arg: usize,
        text: String,
        name: String,
    },
    UnmatchedBrace {
        arg: usize,
        text: String,
        brace: char,
    },
    ProgramNotFound {
        program: String,
        path: String,
    },
    NotExecutable {
        program: PathBuf,
        reason: String,
    },
}

pub(super) const KNOWN: &str = "{threads}, {batch}, {cpus}, {instance}, {job}";

impl fmt::Display for TemplateProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateProblem::Empty => f.write_str(
                "it is empty: give the command that starts one instance, e.g. \
                 `/usr/bin/my-server --threads {threads} --batch {batch}`",
            ),
            TemplateProblem::UnknownPlaceholder { arg, text, name } => write!(
                f,
                "unknown placeholder {{{name}}} in argument {arg} `{text}`: the placeholders are \
                 {KNOWN}; write {{{{ and }}}} for literal braces"
            ),
            TemplateProblem::UnmatchedBrace { arg, text, brace } => write!(
                f,
                "unmatched '{brace}' in argument {arg} `{text}`: placeholders are written \
                 {{name}} ({KNOWN}); write {{{{ and }}}} for literal braces"
            ),
            TemplateProblem::ProgramNotFound { program, path } => write!(
                f,
                "program `{program}` not found in lodgerd's PATH ({path}): install it or give \
                 its absolute path"
            ),
            TemplateProblem::NotExecutable { program, reason } => write!(
                f,
                "`{}` cannot be run ({reason}): give the path of an executable file",
                program.display()
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("job {job}: bad instance template `{template}`: {problem}")]
    Template {
        job: JobId,
        template: String,
        problem: TemplateProblem,
    },
    #[error("instance {key}: {problem}")]
    InvalidSpec { key: InstanceKey, problem: String },
    #[error("instance {key}: cannot create its report pipe: {source}")]
    Pipe { key: InstanceKey, source: io::Error },
    #[error("instance {key}: cannot open {path} for its output: {source}")]
    Output {
        key: InstanceKey,
        path: PathBuf,
        source: io::Error,
    },
    #[error("instance {key}: cannot open {path} to start it in its cgroup: {source}")]
    OpenProcs {
        key: InstanceKey,
        path: PathBuf,
        source: io::Error,
    },
    /// The owner it would run as cannot be resolved (no account, no groups), or systemd would not
    /// start its transient unit.
    #[error("instance {key}: {reason}")]
    Identity { key: InstanceKey, reason: String },
    /// A path the start needs (working directory, program, output) did not answer: forking
    /// now would leave lodgerd waiting on the child's `chdir` or `exec`.
    #[error("instance {key}: not started: {reason}")]
    Unanswered { key: InstanceKey, reason: String },
    #[error("instance {key}: cannot start `{program}`: {source}")]
    Spawn {
        key: InstanceKey,
        program: String,
        source: io::Error,
    },
    #[error("instance {key}: {source}")]
    Cgroup {
        key: InstanceKey,
        source: CgroupError,
    },
    #[error("instance {key}: {source}")]
    Sched {
        key: InstanceKey,
        source: SchedError,
    },
    #[error("instance {key}: cannot send {signal} to process {pid}: {errno}")]
    Signal {
        key: InstanceKey,
        pid: u32,
        signal: Signal,
        errno: Errno,
    },
    #[error("instance {key}: process {pid} is still there {waited:?} after SIGKILL")]
    Unkillable {
        key: InstanceKey,
        pid: u32,
        waited: Duration,
    },
    #[error("cannot kill leftover process {pid}: {errno}")]
    Leftover { pid: u32, errno: Errno },
    #[error(
        "adopt runs once at start, before the first reconcile: {running} instance(s) \
         are already managed"
    )]
    SweepWithInstances { running: usize },
    #[error(transparent)]
    Hierarchy(#[from] CgroupError),
    #[error(transparent)]
    Proc(#[from] ProcError),
}
