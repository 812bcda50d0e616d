//! What can go wrong with an instance or its template, each error with the instance and the
//! path or value. Touches nothing.

use std::collections::VecDeque;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::host::Host;
use super::report::{parse_report, weighted_percentile, Report, ReportLog, WindowSummary};
use super::spawn::{report_pipe, ChildSetup};
use super::supervisor::{
    backoff_delay, describe_exit, invalid, pid_of, Instances, Run, Slot, SlotState,
};
use super::template::{
    executable, find_program, parse_arg, placeholder_value, search_path, show_argv,
    validate_template, ArgProblem, Piece, Placeholder, Template,
};
use super::{
    InstanceKey, InstanceOutput, InstancePlacement, InstanceSettings, InstanceSpec, InstanceState,
    InstanceStats, PollOutcome, ReconcileOutcome, StopOutcome, SweepOutcome, CGROUP_KILL,
    ENV_BATCH, ENV_CPUS, ENV_INSTANCE, ENV_JOB, ENV_PARENT, ENV_REPORT_FD, ENV_THREADS, KILL_WAIT,
    LODGERS_CGROUP, MAX_REPORT_LINE, REMOVE_WAIT, REPORT_FD, REPORT_PIPE_BYTES, STEP, THREAD_ENV,
};
use crate::cpuset::CpuSet;
use crate::enforce::cpusets::{self, CpusetFile, CpusetHierarchy, CpusetTarget};
use crate::enforce::procs::{self, ProcError, ProcReader, ProcessTable};
use crate::enforce::sched::{self, AffinityState, CpuMask, SchedError};
use crate::enforce::{EnforceSettings, PinMethod, DEFAULT_PARENT};
use crate::job::JobId;
use crate::sys::cgroupfs::{self as cgroup, child_of, CgroupDriver, CgroupError, CgroupVersion};

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
        "sweep_leftovers runs once at start, before the first reconcile: {running} instance(s) \
         are already managed"
    )]
    SweepWithInstances { running: usize },
    #[error(transparent)]
    Hierarchy(#[from] CgroupError),
    #[error(transparent)]
    Proc(#[from] ProcError),
}
