//! Inference instances: the child processes lodger starts for online and offline inference jobs
//! (Cloud Reamer §III-A/B), each on the CPUs the plan gives it with its thread count and batch size
//! passed on, supervised (restart with capped exponential back-off, SIGTERM then SIGKILL), and
//! heard through the report protocol of `docs/instance-protocol.md`. Touches cgroupfs (lodger's
//! `<parent>/lodgers` subtree of the cpuset hierarchy), /proc, fork/exec, signals and the
//! instances' report pipes.
//!
//! Where an instance runs ([`PinMethod`], chosen once by [`Instances::new`]):
//! - cgroup v1: in its own cpuset cgroup `<cpuset root>/<parent>/lodgers/<job>-<index>`. Its mems
//!   and then its cpus are written before any task is attached, and the child attaches itself in
//!   `pre_exec` (it writes `0`, "the writer", to the cgroup's `cgroup.procs`), so not one
//!   instruction of the program runs outside its cpuset.
//! - cgroup v2: a cgroup only inside lodger's own cgroup `<parent>`, and only when the cpuset
//!   controller was delegated to it (listed in `<parent>/cgroup.controllers`): everywhere else the
//!   tree belongs to systemd, which moves or kills what it did not create. Otherwise the child sets
//!   its own CPU affinity in `pre_exec`; memory nodes are then not enforced, and a CPU change is
//!   applied to every thread of the instance's process tree.
//!
//! Instances never outlive lodger: each child asks for `PR_SET_PDEATHSIG = SIGKILL` in `pre_exec`.
//! The kernel sends it when the *thread* that spawned the child exits, so [`Instances`] must be
//! driven from one long-lived thread (the agent's), never from a pool thread that may be retired
//! (tokio's `spawn_blocking`). The death signal does not reach an instance's own children, so at
//! start lodgerd calls [`Instances::sweep_leftovers`], which kills every process left in lodger's
//! instance cgroups or carrying lodger's `LODGER_PARENT` in its environment, and removes the
//! cgroups. Dropping [`Instances`] kills what it runs (SIGKILL, no grace).
//!
//! Each instance is its own process group: SIGTERM and SIGKILL go to the group, and after an
//! instance exits whatever it left in its group and cgroup is killed before it starts again.

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

use super::cpusets::{self, CpusetFile, CpusetHierarchy, CpusetTarget};
use super::procs::{self, ProcError, ProcReader, ProcessTable};
use super::sched::{self, AffinityState, CpuMask, SchedError};
use super::{PinMethod, DEFAULT_PARENT};
use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::sys::cgroupfs::{self as cgroup, child_of, CgroupDriver, CgroupError, CgroupVersion};

/// The cgroup under lodger's parent that holds one cgroup per instance.
pub const LODGERS_CGROUP: &str = "lodgers";
/// The descriptor an instance writes its report lines to.
pub const REPORT_FD: RawFd = 3;
pub const ENV_REPORT_FD: &str = "LODGER_REPORT_FD";
pub const ENV_THREADS: &str = "LODGER_THREADS";
pub const ENV_BATCH: &str = "LODGER_BATCH";
pub const ENV_INSTANCE: &str = "LODGER_INSTANCE";
pub const ENV_CPUS: &str = "LODGER_CPUS";
pub const ENV_JOB: &str = "LODGER_JOB";
/// lodger's parent cgroup: marks the processes of this lodgerd's instances for
/// [`Instances::sweep_leftovers`].
pub const ENV_PARENT: &str = "LODGER_PARENT";
/// The thread-count variables of the common math libraries, all set to the instance's threads.
pub const THREAD_ENV: [&str; 3] = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"];
/// The longest report line read; longer ones are dropped and counted as bad. Lines up to
/// `PIPE_BUF` (4096 bytes) are written atomically by the kernel.
pub const MAX_REPORT_LINE: usize = 4096;
/// v2: writing `1` kills every process of the cgroup (Linux 5.14+).
const CGROUP_KILL: &str = "cgroup.kill";
/// Asked of the kernel for each report pipe, so a burst of short batches does not block the
/// instance between two polls (the kernel caps it at `fs.pipe-max-size`).
const REPORT_PIPE_BYTES: libc::c_int = 1 << 20;
/// How long SIGKILLed processes get to be gone before lodger reports them.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long removing a cgroup waits for killed processes to leave it before retrying later.
const REMOVE_WAIT: Duration = Duration::from_millis(200);
const STEP: Duration = Duration::from_millis(10);

/// Which placement [`Instances`] uses (resolved to a [`PinMethod`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstancePlacement {
    /// v1: a cgroup per instance. v2: a cgroup per instance when lodger's parent cgroup exists
    /// with the cpuset controller delegated to it, else CPU affinity.
    #[default]
    Auto,
    Cgroup,
    Affinity,
}

/// Where an instance's stdout and stderr go.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum InstanceOutput {
    /// lodgerd's own (the journal under systemd).
    #[default]
    Inherit,
    Null,
    /// Appended to `<dir>/<job>-<index>.log`.
    Directory(PathBuf),
}

#[derive(Debug, Clone)]
pub struct InstanceSettings {
    /// Where the cgroup hierarchies are mounted (`/sys/fs/cgroup`).
    pub cgroup_root: PathBuf,
    /// Where procfs is mounted (`/proc`).
    pub proc_root: PathBuf,
    pub driver: CgroupDriver,
    /// lodger's own cgroup (relative to the cpuset hierarchy); instances live in
    /// `<parent>/lodgers`.
    pub parent: String,
    pub placement: InstancePlacement,
    /// Between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// The first restart delay after an instance exits on its own or fails to start; doubled for
    /// each further failure in a row, up to `backoff_max`.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// A run at least this long ends a series of failures: the next restart waits
    /// `backoff_initial` again.
    pub stable_after: Duration,
    /// The span that throughput and latency percentiles cover.
    pub window: Duration,
    pub output: InstanceOutput,
}

impl Default for InstanceSettings {
    fn default() -> Self {
        Self {
            cgroup_root: PathBuf::from(cgroup::DEFAULT_CGROUP_ROOT),
            proc_root: PathBuf::from(procs::DEFAULT_PROC_ROOT),
            driver: CgroupDriver::Auto,
            parent: DEFAULT_PARENT.to_string(),
            placement: InstancePlacement::Auto,
            stop_grace: Duration::from_secs(10),
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            stable_after: Duration::from_secs(60),
            window: Duration::from_secs(10),
            output: InstanceOutput::Inherit,
        }
    }
}

impl InstanceSettings {
    /// The roots, driver and parent of the training enforcer, the rest default.
    pub fn with_enforce(e: &super::EnforceSettings) -> Self {
        Self {
            cgroup_root: e.cgroup_root.clone(),
            proc_root: e.proc_root.clone(),
            driver: e.driver,
            parent: e.parent.clone(),
            ..Self::default()
        }
    }
}

/// One instance as the plan wants it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceSpec {
    pub job: JobId,
    /// 0, 1, ... within the job.
    pub index: u32,
    /// The job's command template: argv with `{threads}`, `{batch}`, `{cpus}`, `{instance}`,
    /// `{job}` (`{{` and `}}` are literal braces).
    pub argv: Vec<String>,
    pub cpus: CpuSet,
    /// Memory nodes; empty: those of lodger's parent cgroup. Not enforced with affinity.
    pub mems: CpuSet,
    pub threads: u32,
    pub batch: u32,
}

impl InstanceSpec {
    pub fn key(&self) -> InstanceKey {
        InstanceKey {
            job: self.job.clone(),
            index: self.index,
        }
    }

    fn same_instance(&self, other: &InstanceSpec) -> bool {
        self.index == other.index && self.job == other.job
    }

    fn cmp_instance(&self, other: &InstanceSpec) -> std::cmp::Ordering {
        (&self.job, self.index).cmp(&(&other.job, other.index))
    }
}

/// Names one instance: `<job>-<index>`, also the name of its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InstanceKey {
    pub job: JobId,
    pub index: u32,
}

impl fmt::Display for InstanceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.job, self.index)
    }
}

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

const KNOWN: &str = "{threads}, {batch}, {cpus}, {instance}, {job}";

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

// ---------------------------------------------------------------------------------------------
// Templates

/// A template placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholder {
    Threads,
    Batch,
    Cpus,
    Instance,
    Job,
}

impl Placeholder {
    pub const ALL: [Placeholder; 5] = [
        Placeholder::Threads,
        Placeholder::Batch,
        Placeholder::Cpus,
        Placeholder::Instance,
        Placeholder::Job,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Placeholder::Threads => "threads",
            Placeholder::Batch => "batch",
            Placeholder::Cpus => "cpus",
            Placeholder::Instance => "instance",
            Placeholder::Job => "job",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Value(Placeholder),
}

/// A parsed command template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    args: Vec<Vec<Piece>>,
}

impl Template {
    /// Parses `argv`, refusing an empty one, unknown placeholders and unmatched braces.
    pub fn parse(job: &JobId, argv: &[String]) -> Result<Template, InstanceError> {
        let fail = |problem| InstanceError::Template {
            job: job.clone(),
            template: show_argv(argv),
            problem,
        };
        if argv.is_empty() || argv.iter().all(|a| a.trim().is_empty()) {
            return Err(fail(TemplateProblem::Empty));
        }
        let mut args = Vec::with_capacity(argv.len());
        for (i, arg) in argv.iter().enumerate() {
            args.push(parse_arg(arg).map_err(|p| fail(p.at(i, arg)))?);
        }
        Ok(Template { args })
    }

    pub fn uses(&self, p: Placeholder) -> bool {
        self.args
            .iter()
            .flatten()
            .any(|piece| *piece == Piece::Value(p))
    }

    /// The argv for one instance.
    pub fn expand(&self, spec: &InstanceSpec) -> Vec<String> {
        self.args
            .iter()
            .map(|pieces| {
                let mut out = String::new();
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => out.push_str(t),
                        Piece::Value(p) => out.push_str(&placeholder_value(*p, spec)),
                    }
                }
                out
            })
            .collect()
    }
}

fn placeholder_value(p: Placeholder, spec: &InstanceSpec) -> String {
    match p {
        Placeholder::Threads => spec.threads.to_string(),
        Placeholder::Batch => spec.batch.to_string(),
        Placeholder::Cpus => spec.cpus.to_string(),
        Placeholder::Instance => spec.index.to_string(),
        Placeholder::Job => spec.job.to_string(),
    }
}

/// A problem in one argument, before it knows which.
enum ArgProblem {
    Unknown(String),
    Unmatched(char),
}

impl ArgProblem {
    fn at(self, arg: usize, text: &str) -> TemplateProblem {
        match self {
            ArgProblem::Unknown(name) => TemplateProblem::UnknownPlaceholder {
                arg,
                text: text.to_string(),
                name,
            },
            ArgProblem::Unmatched(brace) => TemplateProblem::UnmatchedBrace {
                arg,
                text: text.to_string(),
                brace,
            },
        }
    }
}

fn parse_arg(arg: &str) -> Result<Vec<Piece>, ArgProblem> {
    let bytes = arg.as_bytes();
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut lit = 0;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'{' | b'}' if bytes.get(i + 1) == Some(&b) => {
                text.push_str(&arg[lit..i]);
                text.push(char::from(b));
                i += 2;
                lit = i;
            }
            b'{' => {
                text.push_str(&arg[lit..i]);
                let rest = &arg[i + 1..];
                let close = rest.find('}').ok_or(ArgProblem::Unmatched('{'))?;
                let name = &rest[..close];
                let p = Placeholder::from_name(name)
                    .ok_or_else(|| ArgProblem::Unknown(name.to_string()))?;
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                pieces.push(Piece::Value(p));
                i += close + 2;
                lit = i;
            }
            b'}' => return Err(ArgProblem::Unmatched('}')),
            _ => i += 1,
        }
    }
    text.push_str(&arg[lit..]);
    if !text.is_empty() || pieces.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

/// The template as a shell would show it, for messages.
pub fn show_argv(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,{}+@%".contains(&b))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The PATH lodgerd searches, as its children's `execvp` will.
fn search_path() -> String {
    std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".to_string())
}

fn executable(path: &Path) -> Result<(), String> {
    let meta = fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_string());
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err("no execute permission".to_string());
    }
    Ok(())
}

/// Finds the program an instance would run, as `execvp` does: a name with a `/` is a path, any
/// other name is searched in PATH.
pub fn find_program(program: &str) -> Result<PathBuf, TemplateProblem> {
    if program.contains('/') {
        let path = PathBuf::from(program);
        return match executable(&path) {
            Ok(()) => Ok(path),
            Err(reason) => Err(TemplateProblem::NotExecutable {
                program: path,
                reason,
            }),
        };
    }
    let path = search_path();
    if !program.is_empty() {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(program);
            if executable(&candidate).is_ok() {
                return Ok(candidate);
            }
        }
    }
    Err(TemplateProblem::ProgramNotFound {
        program: program.to_string(),
        path,
    })
}

/// Checks a job's template before any instance is planned (the API calls this at registration):
/// it parses, and its program exists (when the program is not itself a placeholder).
pub fn validate_template(job: &JobId, argv: &[String]) -> Result<Template, InstanceError> {
    let template = Template::parse(job, argv)?;
    if let Some([Piece::Text(program)]) = template.args.first().map(Vec::as_slice) {
        find_program(program).map_err(|problem| InstanceError::Template {
            job: job.clone(),
            template: show_argv(argv),
            problem,
        })?;
    }
    Ok(template)
}

// ---------------------------------------------------------------------------------------------
// Reports

/// One report line: what one batch served.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Report {
    pub items: u64,
    /// The batch's latency (its slowest request, or a percentile inside the batch).
    pub latency_ms: f64,
    /// How long the batch's requests waited before it started.
    #[serde(default)]
    pub queue_ms: Option<f64>,
}

/// Parses one report line (`{"items":N,"latency_ms":X}`, optional `"queue_ms"`; unknown fields
/// are ignored, so the protocol can grow).
pub fn parse_report(line: &[u8]) -> Result<Report, String> {
    let r: Report = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    let bad = |x: f64| !x.is_finite() || x < 0.0;
    if bad(r.latency_ms) || r.queue_ms.is_some_and(bad) {
        return Err("latency_ms and queue_ms must be finite and not negative".to_string());
    }
    Ok(r)
}

/// An instance's reports: the recent ones (for rates and percentiles) and totals.
#[derive(Debug, Default)]
struct ReportLog {
    recent: VecDeque<(Instant, Report)>,
    items_total: u64,
    reports_total: u64,
    bad_total: u64,
    /// The start of a line whose end has not arrived.
    partial: Vec<u8>,
    /// The current line grew past [`MAX_REPORT_LINE`]: skip to its end.
    discarding: bool,
    /// A bad line was logged (once per instance run: a broken client would flood the log).
    warned: bool,
}

impl ReportLog {
    /// Takes bytes read from the pipe; returns the number of good lines.
    fn feed(&mut self, key: &InstanceKey, bytes: &[u8], now: Instant) -> u64 {
        let mut good = 0;
        let mut rest = bytes;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(nl);
            rest = tail.get(1..).unwrap_or_default();
            if self.discarding {
                self.discarding = false;
                self.partial.clear();
                continue;
            }
            let line: &[u8] = if self.partial.is_empty() {
                head
            } else {
                self.partial.extend_from_slice(head);
                &self.partial
            };
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.iter().all(u8::is_ascii_whitespace) {
                self.partial.clear();
                continue;
            }
            match parse_report(line) {
                Ok(r) => {
                    self.recent.push_back((now, r));
                    self.items_total = self.items_total.saturating_add(r.items);
                    self.reports_total += 1;
                    good += 1;
                }
                Err(e) => {
                    self.bad_total += 1;
                    if !self.warned {
                        self.warned = true;
                        warn!(
                            instance = %key,
                            "bad report line '{}': {e} (see docs/instance-protocol.md; further \
                             bad lines are only counted)",
                            String::from_utf8_lossy(line)
                        );
                    }
                }
            }
            self.partial.clear();
        }
        if !self.discarding {
            self.partial.extend_from_slice(rest);
            if self.partial.len() > MAX_REPORT_LINE {
                self.partial.clear();
                self.discarding = true;
                self.bad_total += 1;
            }
        }
        good
    }

    fn trim(&mut self, now: Instant, window: Duration) {
        while let Some((at, _)) = self.recent.front() {
            if now.saturating_duration_since(*at) > window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }

    /// A new process: its measurements start afresh (totals are kept).
    fn restart(&mut self) {
        self.recent.clear();
        self.partial.clear();
        self.discarding = false;
        self.warned = false;
    }

    fn summary(&self, now: Instant, window: Duration, since: Option<Instant>) -> WindowSummary {
        let from = now.checked_sub(window).unwrap_or(now);
        let from = since.map_or(from, |s| s.max(from));
        let span = now.saturating_duration_since(from);
        let mut items = 0u64;
        let mut latency = Vec::new();
        let mut queue = Vec::new();
        for (at, r) in &self.recent {
            if *at < from {
                continue;
            }
            items = items.saturating_add(r.items);
            latency.push((r.latency_ms, r.items));
            if let Some(q) = r.queue_ms {
                queue.push((q, r.items));
            }
        }
        let secs = span.as_secs_f64();
        WindowSummary {
            span,
            items_per_s: if secs > 0.0 { items as f64 / secs } else { 0.0 },
            p50: weighted_percentile(&mut latency, 500),
            p99: weighted_percentile(&mut latency, 990),
            queue_p99: weighted_percentile(&mut queue, 990),
        }
    }
}

struct WindowSummary {
    span: Duration,
    items_per_s: f64,
    p50: Option<f64>,
    p99: Option<f64>,
    queue_p99: Option<f64>,
}

/// The per-mille percentile of values each standing for `weight` items (a batch's latency is
/// the latency of each of its items).
fn weighted_percentile(samples: &mut [(f64, u64)], permille: u64) -> Option<f64> {
    let total: u128 = samples.iter().map(|&(_, w)| u128::from(w)).sum();
    if total == 0 {
        return None;
    }
    samples.sort_by(|a, b| a.0.total_cmp(&b.0));
    let rank = (total * u128::from(permille)).div_ceil(1000).max(1);
    let mut seen = 0u128;
    for &(v, w) in samples.iter() {
        seen += u128::from(w);
        if seen >= rank {
            return Some(v);
        }
    }
    samples.last().map(|&(v, _)| v)
}

// ---------------------------------------------------------------------------------------------
// State, stats and outcomes

/// Where an instance is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceState {
    Running,
    /// It exited on its own or could not start: it starts again after `retry_in`.
    BackingOff {
        retry_in: Duration,
    },
    /// SIGTERM was sent; `restarting`: it starts again with a new spec once gone.
    Stopping {
        restarting: bool,
    },
}

impl InstanceState {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Running => "running",
            InstanceState::BackingOff { .. } => "backing-off",
            InstanceState::Stopping { .. } => "stopping",
        }
    }
}

/// What `stats` shows about one instance.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceStats {
    pub job: JobId,
    pub index: u32,
    /// The running process, if any.
    pub pid: Option<u32>,
    pub cpus: CpuSet,
    pub threads: u32,
    pub batch: u32,
    /// Its cgroup, relative to the cpuset hierarchy (cgroup placement).
    pub cgroup: Option<String>,
    pub state: InstanceState,
    /// Restarts after it exited on its own or failed to start.
    pub restarts: u32,
    /// Failures in a row (exits, failed starts); reset by a run of `stable_after`.
    pub failures: u32,
    /// The delay chosen at the last failure (zero before any).
    pub backoff: Duration,
    /// How its last process ended, e.g. "killed by SIGKILL".
    pub last_exit: Option<String>,
    /// Why its last start failed.
    pub last_error: Option<String>,
    /// Age of the running process.
    pub uptime: Duration,
    /// The span the rates and percentiles below cover: the window, or less for a young process.
    pub span: Duration,
    pub items_per_s: f64,
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    pub queue_p99_ms: Option<f64>,
    /// Totals over all its processes.
    pub items_total: u64,
    pub reports_total: u64,
    /// Lines that were not valid reports.
    pub bad_reports: u64,
}

/// What one `reconcile` did. Start failures are in `errors`; those instances back off and retry.
#[derive(Debug, Default)]
pub struct ReconcileOutcome {
    /// Something was started, signalled, moved or removed.
    pub changed: bool,
    pub started: Vec<InstanceKey>,
    /// Moved to new CPUs (or memory nodes) in place.
    pub moved: Vec<InstanceKey>,
    /// Asked to stop, to start again with their new spec (by `poll`, once gone).
    pub restarting: Vec<InstanceKey>,
    /// Asked to stop, not wanted any more (gone after `poll`).
    pub stopping: Vec<InstanceKey>,
    /// Not wanted any more and not running: removed at once.
    pub removed: Vec<InstanceKey>,
    pub errors: Vec<InstanceError>,
}

/// What one `poll` found and did.
#[derive(Debug, Default)]
pub struct PollOutcome {
    /// Instances that exited on their own, with how.
    pub exited: Vec<(InstanceKey, String)>,
    /// (Re)started after a back-off or a spec change.
    pub started: Vec<InstanceKey>,
    /// Finished stopping.
    pub stopped: Vec<InstanceKey>,
    /// Did not stop within the grace period: SIGKILL sent.
    pub killed: Vec<InstanceKey>,
    /// Report lines read.
    pub reports: u64,
    pub errors: Vec<InstanceError>,
}

/// What `stop_job` or `stop_all` did.
#[derive(Debug, Default)]
pub struct StopOutcome {
    pub stopped: Vec<InstanceKey>,
    /// Needed SIGKILL after the grace period.
    pub killed: Vec<InstanceKey>,
    pub errors: Vec<InstanceError>,
}

/// What `sweep_leftovers` found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    /// Processes killed, sorted.
    pub killed: Vec<u32>,
    /// Cgroups removed, relative to the cpuset hierarchy.
    pub removed_cgroups: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// The supervisor

/// The live process of an instance.
#[derive(Debug)]
struct Run {
    child: Child,
    pid: u32,
    started: Instant,
    /// The read end of the report pipe, non-blocking; `None` after end of file.
    report: Option<File>,
}

impl Run {
    /// If the process exited: kills what it left in its process group, then reaps it and says
    /// how it ended. The group is killed before the reap: until then the zombie holds the
    /// group's id, so no other process can have come to own it.
    fn reap(&mut self) -> Option<String> {
        if let Some(pid) = pid_of(self.pid) {
            let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
            match waitid(Id::Pid(pid), flags) {
                Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => return None,
                Ok(_) => {
                    let _ = killpg(pid, Signal::SIGKILL);
                }
                // ECHILD: reaped elsewhere (SIGCHLD ignored); `try_wait` says so.
                Err(_) => {}
            }
        }
        match self.child.try_wait() {
            Ok(status) => status.map(describe_exit),
            Err(e) => Some(format!("gone ({e})")),
        }
    }
}

#[derive(Debug)]
enum SlotState {
    Running,
    BackingOff {
        at: Instant,
    },
    Stopping {
        kill_at: Instant,
        killed_at: Option<Instant>,
        /// `Unkillable` was reported (once).
        stuck: bool,
        next: Option<(InstanceSpec, Template)>,
    },
}

#[derive(Debug)]
struct Slot {
    spec: InstanceSpec,
    template: Template,
    /// Its cgroup once created (cgroup placement).
    cgroup: Option<String>,
    run: Option<Run>,
    state: SlotState,
    restarts: u32,
    failures: u32,
    backoff: Duration,
    last_exit: Option<String>,
    last_error: Option<String>,
    reports: ReportLog,
}

impl Slot {
    fn key(&self) -> InstanceKey {
        self.spec.key()
    }

    fn stats(&self, now: Instant, window: Duration) -> InstanceStats {
        let since = self.run.as_ref().map(|r| r.started);
        let w = self.reports.summary(now, window, since);
        let state = match &self.state {
            SlotState::Running => InstanceState::Running,
            SlotState::BackingOff { at } => InstanceState::BackingOff {
                retry_in: at.saturating_duration_since(now),
            },
            SlotState::Stopping { next, .. } => InstanceState::Stopping {
                restarting: next.is_some(),
            },
        };
        InstanceStats {
            job: self.spec.job.clone(),
            index: self.spec.index,
            pid: self.run.as_ref().map(|r| r.pid),
            cpus: self.spec.cpus.clone(),
            threads: self.spec.threads,
            batch: self.spec.batch,
            cgroup: self.cgroup.clone(),
            state,
            restarts: self.restarts,
            failures: self.failures,
            backoff: self.backoff,
            last_exit: self.last_exit.clone(),
            last_error: self.last_error.clone(),
            uptime: since.map_or(Duration::ZERO, |s| now.saturating_duration_since(s)),
            span: w.span,
            items_per_s: w.items_per_s,
            latency_p50_ms: w.p50,
            latency_p99_ms: w.p99,
            queue_p99_ms: w.queue_p99,
            items_total: self.reports.items_total,
            reports_total: self.reports.reports_total,
            bad_reports: self.reports.bad_total,
        }
    }
}

/// The delay before restart number `failures` in a row: `initial`, doubled per failure, capped.
pub fn backoff_delay(failures: u32, initial: Duration, max: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(30);
    initial.saturating_mul(1u32 << doublings).min(max)
}

/// Everything that touches the node, apart from the slots.
#[derive(Debug)]
struct Host {
    settings: InstanceSettings,
    version: CgroupVersion,
    placement: PinMethod,
    cpusets: Box<dyn CpusetHierarchy>,
    /// Normalized `settings.parent`.
    parent: String,
    /// `<parent>/lodgers`.
    lodgers: String,
    /// The CPUs of the node (the cpuset hierarchy's root).
    node: CpuSet,
    reader: ProcReader,
    table: ProcessTable,
    /// lodger's parent cgroup was created here (not by the training enforcer): remove it with the
    /// last instance.
    created_parent: bool,
    /// Instance cgroups whose killed processes had not left yet: removal is retried.
    pending_removal: Vec<String>,
    buf: Vec<u8>,
}

/// Starts, supervises and stops inference instances. One per lodgerd; drive it from one
/// long-lived thread (see the module documentation).
#[derive(Debug)]
pub struct Instances {
    host: Host,
    /// Sorted by key.
    slots: Vec<Slot>,
}

impl Instances {
    /// Detects the cgroup mode and chooses the placement (logged with its reason).
    pub fn new(settings: InstanceSettings) -> Result<Instances, InstanceError> {
        let parent = cgroup::normalize(&settings.parent)?;
        if parent == "/" {
            return Err(CgroupError::BadPath(settings.parent.clone()).into());
        }
        let version = cgroup::detect(&settings.cgroup_root, settings.driver)?;
        let cpusets = cpusets::open(&settings.cgroup_root, version);
        let node = match version {
            CgroupVersion::V1 => cpusets.read("/", CpusetFile::Cpus)?,
            CgroupVersion::V2 => cpusets.effective_cpus("/")?,
        };
        let (placement, why) = match (settings.placement, version) {
            (InstancePlacement::Cgroup, _) => (PinMethod::Cgroup, "configured"),
            (InstancePlacement::Affinity, _) => (PinMethod::Affinity, "configured"),
            (InstancePlacement::Auto, CgroupVersion::V1) => (PinMethod::Cgroup, "cgroup v1"),
            (InstancePlacement::Auto, CgroupVersion::V2) => {
                let controllers = cpusets.dir(&parent).join(cgroup::CGROUP_CONTROLLERS);
                let delegated = fs::read_to_string(&controllers).is_ok_and(|text| {
                    text.split_whitespace()
                        .any(|c| c == cgroup::CPUSET_CONTROLLER)
                });
                if delegated {
                    (
                        PinMethod::Cgroup,
                        "cgroup v2, cpuset delegated to lodger's cgroup",
                    )
                } else {
                    (
                        PinMethod::Affinity,
                        "cgroup v2 without cpuset delegated to lodger's cgroup (memory nodes are \
                         not enforced)",
                    )
                }
            }
        };
        let lodgers = child_of(&parent, LODGERS_CGROUP);
        info!(
            "inference instances are placed by {} ({why}){}",
            placement.as_str(),
            match placement {
                PinMethod::Cgroup => format!(", in {}", cpusets.dir(&lodgers).display()),
                PinMethod::Affinity => String::new(),
            }
        );
        let reader = ProcReader::new(&settings.proc_root);
        Ok(Instances {
            host: Host {
                version,
                placement,
                cpusets,
                parent,
                lodgers,
                node,
                reader,
                table: ProcessTable::default(),
                created_parent: false,
                pending_removal: Vec::new(),
                buf: vec![0; 64 * 1024],
                settings,
            },
            slots: Vec::new(),
        })
    }

    pub fn placement(&self) -> PinMethod {
        self.host.placement
    }

    pub fn cgroup_version(&self) -> CgroupVersion {
        self.host.version
    }

    /// The directory of an instance cgroup named in [`InstanceStats::cgroup`].
    pub fn cgroup_dir(&self, cgroup: &str) -> PathBuf {
        self.host.cpusets.dir(cgroup)
    }

    pub fn settings(&self) -> &InstanceSettings {
        &self.host.settings
    }

    /// Makes the running instances match `desired` (all instances of all jobs): starts missing
    /// ones, stops unwanted ones, restarts changed ones. A change of CPUs or memory nodes alone
    /// is applied in place, unless the template passes `{cpus}` on (the program may have pinned
    /// its threads itself); anything else restarts the instance once the old process is gone.
    /// Stops are asynchronous: SIGTERM here, the rest in `poll`. Idempotent.
    ///
    /// Every spec is checked first; a bad one (template, threads, batch, CPUs, a duplicate) fails
    /// the whole call before anything is done.
    pub fn reconcile(
        &mut self,
        desired: &[InstanceSpec],
    ) -> Result<ReconcileOutcome, InstanceError> {
        let now = Instant::now();
        let mut templates: Vec<Template> = Vec::with_capacity(desired.len());
        for (i, spec) in desired.iter().enumerate() {
            if desired[..i].iter().any(|d| d.same_instance(spec)) {
                return Err(invalid(&spec.key(), "listed twice".to_string()));
            }
            self.host.check_spec(spec)?;
            let template = match self.slot(spec) {
                Some(slot) if slot.spec.argv == spec.argv => slot.template.clone(),
                // A new or changed template: its program must exist now.
                _ => validate_template(&spec.job, &spec.argv)?,
            };
            templates.push(template);
        }

        let mut out = ReconcileOutcome::default();
        // Unwanted first: their CPUs may be wanted by the others.
        let mut i = 0;
        while i < self.slots.len() {
            if desired.iter().any(|d| d.same_instance(&self.slots[i].spec)) {
                i += 1;
                continue;
            }
            let slot = &mut self.slots[i];
            let key = slot.key();
            match &mut slot.state {
                SlotState::Running => {
                    self.host.terminate(slot, now, None);
                    out.stopping.push(key);
                    out.changed = true;
                }
                SlotState::Stopping { next, .. } => {
                    if next.take().is_some() {
                        out.stopping.push(key);
                        out.changed = true;
                    }
                }
                SlotState::BackingOff { .. } => {
                    let slot = self.slots.remove(i);
                    self.host.discard(&slot, &mut out.errors);
                    out.removed.push(key);
                    out.changed = true;
                    continue;
                }
            }
            i += 1;
        }

        for (spec, template) in desired.iter().zip(templates) {
            let key = spec.key();
            let pos = match self.slots.binary_search_by(|s| s.spec.cmp_instance(spec)) {
                Ok(pos) => pos,
                Err(pos) => {
                    let mut slot = Slot {
                        spec: spec.clone(),
                        template,
                        cgroup: None,
                        run: None,
                        state: SlotState::BackingOff { at: now },
                        restarts: 0,
                        failures: 0,
                        backoff: Duration::ZERO,
                        last_exit: None,
                        last_error: None,
                        reports: ReportLog::default(),
                    };
                    out.changed = true;
                    match self.host.start(&mut slot, now) {
                        Ok(()) => out.started.push(key),
                        Err(e) => out.errors.push(e),
                    }
                    self.slots.insert(pos, slot);
                    continue;
                }
            };
            let slot = &mut self.slots[pos];
            match &mut slot.state {
                SlotState::Stopping { next, .. } => {
                    let same = next.as_ref().is_some_and(|(s, _)| s == spec);
                    if !same {
                        *next = Some((spec.clone(), template));
                        out.restarting.push(key);
                        out.changed = true;
                    }
                }
                SlotState::BackingOff { .. } => {
                    if slot.spec != *spec {
                        // The new spec may be what fixes it: try at once.
                        slot.spec = spec.clone();
                        slot.template = template;
                        out.changed = true;
                        match self.host.start(slot, now) {
                            Ok(()) => out.started.push(key),
                            Err(e) => out.errors.push(e),
                        }
                    }
                }
                SlotState::Running => {
                    if slot.spec == *spec {
                        continue;
                    }
                    let in_place = slot.spec.argv == spec.argv
                        && slot.spec.threads == spec.threads
                        && slot.spec.batch == spec.batch
                        && !slot.template.uses(Placeholder::Cpus);
                    if in_place {
                        match self.host.move_in_place(slot, spec) {
                            Ok(changed) => {
                                slot.spec = spec.clone();
                                if changed {
                                    out.moved.push(key);
                                    out.changed = true;
                                }
                            }
                            Err(e) => out.errors.push(e),
                        }
                    } else {
                        self.host
                            .terminate(slot, now, Some((spec.clone(), template)));
                        out.restarting.push(key);
                        out.changed = true;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Reaps exited instances (killing what they left behind), restarts them after their
    /// back-off, finishes stops (SIGKILL after the grace period), reads report lines. Call it
    /// often (every tick); it never blocks for long.
    pub fn poll(&mut self) -> PollOutcome {
        let now = Instant::now();
        let mut out = PollOutcome::default();
        self.host.retry_removals();
        let mut i = 0;
        while i < self.slots.len() {
            let slot = &mut self.slots[i];
            out.reports += self.host.read_reports(slot, now);
            slot.reports.trim(now, self.host.settings.window);
            let key = slot.key();
            let exited = slot.run.as_mut().and_then(Run::reap);
            match &mut slot.state {
                SlotState::Running => {
                    if let Some(how) = exited {
                        self.host.on_exit(slot, now, &how, &mut out.errors);
                        warn!(
                            instance = %key,
                            "exited on its own ({how}); restarting in {:?}",
                            slot.backoff
                        );
                        out.exited.push((key, how));
                    }
                }
                SlotState::BackingOff { at } => {
                    if now >= *at {
                        match self.host.start(slot, now) {
                            Ok(()) => {
                                slot.restarts += 1;
                                out.started.push(key);
                            }
                            Err(e) => out.errors.push(e),
                        }
                    }
                }
                SlotState::Stopping {
                    kill_at,
                    killed_at,
                    stuck,
                    next,
                } => {
                    if let Some(how) = exited {
                        debug!(instance = %key, "stopped ({how})");
                        slot.last_exit = Some(how);
                        let next = next.take();
                        self.host.finish_run(slot, now, &mut out.errors);
                        out.stopped.push(key.clone());
                        match next {
                            Some((spec, template)) => {
                                // Measurements start afresh with the new process.
                                slot.spec = spec;
                                slot.template = template;
                                match self.host.start(slot, now) {
                                    Ok(()) => out.started.push(key),
                                    Err(e) => out.errors.push(e),
                                }
                            }
                            None => {
                                let slot = self.slots.remove(i);
                                self.host.discard(&slot, &mut out.errors);
                                continue;
                            }
                        }
                    } else if killed_at.is_none() && now >= *kill_at {
                        warn!(
                            instance = %key,
                            "still running {:?} after SIGTERM: SIGKILL",
                            self.host.settings.stop_grace
                        );
                        self.host.kill_run(slot, &mut out.errors);
                        if let SlotState::Stopping { killed_at, .. } = &mut slot.state {
                            *killed_at = Some(now);
                        }
                        out.killed.push(key);
                    } else if let (Some(at), Some(run), false) = (*killed_at, &slot.run, *stuck) {
                        if now.saturating_duration_since(at) > KILL_WAIT {
                            *stuck = true;
                            out.errors.push(InstanceError::Unkillable {
                                key,
                                pid: run.pid,
                                waited: now.saturating_duration_since(at),
                            });
                        }
                    }
                }
            }
            i += 1;
        }
        out
    }

    /// Per instance, sorted by job and index.
    pub fn stats(&self) -> Vec<InstanceStats> {
        let now = Instant::now();
        self.slots
            .iter()
            .map(|s| s.stats(now, self.host.settings.window))
            .collect()
    }

    /// Stops every instance of `job` and waits for them (SIGTERM, SIGKILL after the grace
    /// period), then removes their cgroups. They start again if a later `reconcile` wants them.
    pub fn stop_job(&mut self, job: &JobId) -> StopOutcome {
        self.stop_where(|k| k.job == *job)
    }

    /// Stops every instance and waits for them, then removes their cgroups (and lodger's
    /// `lodgers` cgroup, and its parent if it was created here and is unused).
    pub fn stop_all(&mut self) -> StopOutcome {
        self.stop_where(|_| true)
    }

    fn stop_where(&mut self, pick: impl Fn(&InstanceKey) -> bool) -> StopOutcome {
        let mut out = StopOutcome::default();
        let start = Instant::now();
        for slot in self.slots.iter_mut().filter(|s| pick(&s.key())) {
            match &mut slot.state {
                SlotState::Running => self.host.terminate(slot, start, None),
                SlotState::Stopping { next, .. } => *next = None,
                SlotState::BackingOff { .. } => {}
            }
        }
        loop {
            let now = Instant::now();
            let mut waiting = false;
            for slot in self.slots.iter_mut().filter(|s| pick(&s.key())) {
                self.host.read_reports(slot, now);
                let Some(run) = slot.run.as_mut() else {
                    continue;
                };
                if let Some(how) = run.reap() {
                    slot.last_exit = Some(how);
                    self.host.finish_run(slot, now, &mut out.errors);
                    continue;
                }
                let SlotState::Stopping {
                    kill_at,
                    killed_at,
                    stuck,
                    ..
                } = &mut slot.state
                else {
                    continue;
                };
                match *killed_at {
                    None if now >= *kill_at => {
                        *killed_at = Some(now);
                        out.killed.push(slot.spec.key());
                        self.host.kill_run(slot, &mut out.errors);
                        waiting = true;
                    }
                    Some(_) if *stuck => {}
                    Some(at) if now.saturating_duration_since(at) > KILL_WAIT => {
                        *stuck = true;
                        out.errors.push(InstanceError::Unkillable {
                            key: slot.spec.key(),
                            pid: run.pid,
                            waited: now.saturating_duration_since(at),
                        });
                    }
                    _ => waiting = true,
                }
            }
            if !waiting {
                break;
            }
            std::thread::sleep(STEP);
        }
        let mut i = 0;
        while i < self.slots.len() {
            let slot = &self.slots[i];
            // An unkillable process stays supervised: `poll` reaps it if it ever goes.
            if pick(&slot.key()) && slot.run.is_none() {
                let slot = self.slots.remove(i);
                self.host.discard(&slot, &mut out.errors);
                out.stopped.push(slot.key());
            } else {
                i += 1;
            }
        }
        self.host.retry_removals();
        if self.slots.is_empty() {
            self.host.remove_lodgers(&mut out.errors);
        }
        out
    }

    /// Kills what a previous lodgerd left behind and removes its instance cgroups: every process
    /// in `<parent>/lodgers/*`, and every process whose environment carries this lodger's
    /// `LODGER_PARENT` (instances placed by affinity, and children that left their cgroup). Run
    /// once at start, before the first `reconcile`.
    pub fn sweep_leftovers(&mut self) -> Result<SweepOutcome, InstanceError> {
        if !self.slots.is_empty() {
            return Err(InstanceError::SweepWithInstances {
                running: self.slots.len(),
            });
        }
        let h = &self.host;
        let mut out = SweepOutcome::default();
        let mut cgroups = Vec::new();
        if h.cpusets.exists(&h.lodgers) {
            match h.cpusets.children(&h.lodgers, &mut cgroups) {
                Ok(()) => {}
                Err(e) if e.is_gone() => {}
                Err(e) => return Err(e.into()),
            }
        }
        for cg in &cgroups {
            out.killed.extend(h.kill_cgroup(cg)?);
        }
        out.killed.extend(self.host.kill_marked()?);
        out.killed.sort_unstable();
        out.killed.dedup();
        for cg in &cgroups {
            if self.host.remove_cgroup(cg, KILL_WAIT)? {
                out.removed_cgroups.push(cg.clone());
            }
        }
        // Reap the ones that were our own children (a lodger-like parent that is this process).
        for &pid in &out.killed {
            if let Ok(p) = i32::try_from(pid) {
                let _ = waitpid(Pid::from_raw(p), Some(WaitPidFlag::WNOHANG));
            }
        }
        let h = &self.host;
        if h.cpusets.exists(&h.lodgers) && h.cpusets.remove_if_unused(&h.lodgers)? {
            out.removed_cgroups.push(h.lodgers.clone());
        }
        if !out.killed.is_empty() || !out.removed_cgroups.is_empty() {
            warn!(
                "removed leftovers of a previous lodgerd: killed processes {:?}, removed cgroups \
                 {:?}",
                out.killed, out.removed_cgroups
            );
        }
        Ok(out)
    }

    fn slot(&self, spec: &InstanceSpec) -> Option<&Slot> {
        self.slots
            .binary_search_by(|s| s.spec.cmp_instance(spec))
            .ok()
            .and_then(|i| self.slots.get(i))
    }
}

impl Drop for Instances {
    /// The last line of "never leave an instance behind": whatever still runs is killed.
    fn drop(&mut self) {
        let running = self.slots.iter().filter(|s| s.run.is_some()).count();
        if running == 0 && self.slots.is_empty() {
            return;
        }
        if running > 0 {
            warn!(
                "{running} inference instance(s) still running when their supervisor went \
                 away: killing them"
            );
        }
        let mut errors = Vec::new();
        for slot in &mut self.slots {
            if slot.run.is_some() {
                self.host.kill_run(slot, &mut errors);
            }
        }
        let deadline = Instant::now() + KILL_WAIT;
        for slot in &mut self.slots {
            while let Some(run) = slot.run.as_mut() {
                if run.reap().is_some() {
                    self.host.finish_run(slot, Instant::now(), &mut errors);
                } else if Instant::now() < deadline {
                    std::thread::sleep(STEP);
                } else {
                    break;
                }
            }
        }
        for slot in std::mem::take(&mut self.slots) {
            self.host.discard(&slot, &mut errors);
        }
        self.host.remove_lodgers(&mut errors);
        for e in errors {
            warn!("while killing instances: {e}");
        }
    }
}

fn invalid(key: &InstanceKey, problem: String) -> InstanceError {
    InstanceError::InvalidSpec {
        key: key.clone(),
        problem,
    }
}

fn describe_exit(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    if let Some(sig) = status.signal() {
        let name = Signal::try_from(sig).map_or("an unknown signal", |s| s.as_str());
        let core = if status.core_dumped() {
            " (core dumped)"
        } else {
            ""
        };
        return format!("killed by {name}{core}");
    }
    status.to_string()
}

fn pid_of(pid: u32) -> Option<Pid> {
    i32::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .map(Pid::from_raw)
}

impl Host {
    fn check_spec(&self, spec: &InstanceSpec) -> Result<(), InstanceError> {
        let key = spec.key();
        if spec.threads == 0 {
            return Err(invalid(&key, "threads must be at least 1".to_string()));
        }
        if spec.batch == 0 {
            return Err(invalid(&key, "batch must be at least 1".to_string()));
        }
        if spec.cpus.is_empty() {
            return Err(invalid(&key, "it has no CPU".to_string()));
        }
        if !self.node.is_empty() && !spec.cpus.is_subset(&self.node) {
            return Err(invalid(
                &key,
                format!(
                    "CPUs {} are not all on this node (it has {})",
                    spec.cpus, self.node
                ),
            ));
        }
        Ok(())
    }

    fn instance_cgroup(&self, key: &InstanceKey) -> String {
        child_of(&self.lodgers, &key.to_string())
    }

    /// Creates `<parent>`, `<parent>/lodgers` and the instance's cgroup as needed, and gives it
    /// `cpus` and `mems` (mems first; v1: the ancestors grow first, they never shrink).
    fn ensure_cgroup(
        &mut self,
        cg: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
    ) -> Result<bool, CgroupError> {
        let h = &*self.cpusets;
        let mut changed = false;
        if !h.exists(&self.parent) {
            h.create(&self.parent)?;
            self.created_parent = true;
            changed = true;
        }
        for c in [self.lodgers.as_str(), cg] {
            if !h.exists(c) {
                // v2: the cgroup gets cpuset files only if its parent enables the controller,
                // which lodger may do inside its own cgroup only.
                h.enable_cpuset(c, &self.parent)?;
                h.create(c)?;
                changed = true;
            }
            if !h.cpuset_enabled(c)? {
                h.enable_cpuset(c, &self.parent)?;
                changed = true;
            }
        }
        changed |= self.set_cpuset(cg, cpus, mems)?;
        Ok(changed)
    }

    fn set_cpuset(&self, cg: &str, cpus: &CpuSet, mems: &CpuSet) -> Result<bool, CgroupError> {
        let h = &*self.cpusets;
        let cur_cpus = h.read(cg, CpusetFile::Cpus)?;
        let cur_mems = h.read(cg, CpusetFile::Mems)?;
        let want_mems = (!mems.is_empty()).then(|| mems.clone());
        if cur_cpus == *cpus && want_mems.as_ref().map_or(true, |m| *m == cur_mems) {
            return Ok(false);
        }
        let mut entries = vec![CpusetTarget {
            cgroup: cg.to_string(),
            current_cpus: cur_cpus,
            current_mems: cur_mems,
            cpus: Some(cpus.clone()),
            mems: want_mems.clone(),
        }];
        if h.nested_subsets() {
            // Other instances (and, for the parent, training jobs) live below: only grow.
            for a in [self.parent.as_str(), self.lodgers.as_str()] {
                let a_cpus = h.read(a, CpusetFile::Cpus)?;
                let a_mems = h.read(a, CpusetFile::Mems)?;
                let grow_mems = want_mems.as_ref().filter(|m| !m.is_subset(&a_mems));
                if !cpus.is_subset(&a_cpus) || grow_mems.is_some() {
                    entries.push(CpusetTarget {
                        cgroup: a.to_string(),
                        cpus: Some(a_cpus.union(cpus)),
                        mems: grow_mems.map(|m| a_mems.union(m)),
                        current_cpus: a_cpus,
                        current_mems: a_mems,
                    });
                }
            }
        }
        cpusets::write_nested(h, &entries)
    }

    /// Starts the slot's process (its state becomes `Running`); on failure the slot backs off.
    fn start(&mut self, slot: &mut Slot, now: Instant) -> Result<(), InstanceError> {
        match self.spawn(slot, now) {
            Ok(run) => {
                info!(
                    instance = %slot.key(),
                    pid = run.pid,
                    cpus = %slot.spec.cpus,
                    threads = slot.spec.threads,
                    batch = slot.spec.batch,
                    "instance started"
                );
                slot.run = Some(run);
                slot.state = SlotState::Running;
                slot.last_error = None;
                slot.reports.restart();
                Ok(())
            }
            Err(e) => {
                slot.failures = slot.failures.saturating_add(1);
                slot.backoff = backoff_delay(
                    slot.failures,
                    self.settings.backoff_initial,
                    self.settings.backoff_max,
                );
                slot.state = SlotState::BackingOff {
                    at: now + slot.backoff,
                };
                slot.last_error = Some(e.to_string());
                warn!(instance = %slot.key(), "cannot start: {e}; retrying in {:?}", slot.backoff);
                Err(e)
            }
        }
    }

    fn spawn(&mut self, slot: &mut Slot, now: Instant) -> Result<Run, InstanceError> {
        let key = slot.key();
        let spec = &slot.spec;
        let argv = slot.template.expand(spec);
        let Some((program, args)) = argv.split_first() else {
            return Err(InstanceError::Template {
                job: spec.job.clone(),
                template: show_argv(&spec.argv),
                problem: TemplateProblem::Empty,
            });
        };

        let mut procs_file = None;
        let mut mask = None;
        match self.placement {
            PinMethod::Cgroup => {
                let cg = self.instance_cgroup(&key);
                let cgroup_err = |source| InstanceError::Cgroup {
                    key: key.clone(),
                    source,
                };
                self.ensure_cgroup(&cg, &spec.cpus, &spec.mems)
                    .map_err(cgroup_err)?;
                slot.cgroup = Some(cg.clone());
                // Whatever is still in it was left by an earlier process of this instance.
                let mut left = Vec::new();
                self.cpusets.procs(&cg, &mut left).map_err(cgroup_err)?;
                if !left.is_empty() {
                    // Usually what an earlier process left, killed and not yet gone.
                    debug!(instance = %key, "killing leftover processes {left:?} in its cgroup");
                    self.kill_cgroup(&cg).map_err(|e| match e {
                        InstanceError::Hierarchy(source) => cgroup_err(source),
                        e => e,
                    })?;
                }
                let path = self.cpusets.dir(&cg).join(cgroup::CGROUP_PROCS);
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|source| InstanceError::OpenProcs {
                        key: key.clone(),
                        path: path.clone(),
                        source,
                    })?;
                procs_file = Some(file);
            }
            PinMethod::Affinity => mask = Some(CpuMask::from_cpuset(&spec.cpus)),
        }

        let (report_read, report_write) = report_pipe().map_err(|source| InstanceError::Pipe {
            key: key.clone(),
            source,
        })?;

        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .env(ENV_REPORT_FD, REPORT_FD.to_string())
            .env(ENV_THREADS, spec.threads.to_string())
            .env(ENV_BATCH, spec.batch.to_string())
            .env(ENV_INSTANCE, spec.index.to_string())
            .env(ENV_CPUS, spec.cpus.to_string())
            .env(ENV_JOB, spec.job.as_str())
            .env(ENV_PARENT, &self.parent)
            .process_group(0);
        for var in THREAD_ENV {
            cmd.env(var, spec.threads.to_string());
        }
        match &self.settings.output {
            InstanceOutput::Inherit => {}
            InstanceOutput::Null => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
            InstanceOutput::Directory(dir) => {
                let path = dir.join(format!("{key}.log"));
                let open = || OpenOptions::new().create(true).append(true).open(&path);
                let (out, err) =
                    open()
                        .and_then(|f| Ok((f.try_clone()?, f)))
                        .map_err(|source| InstanceError::Output {
                            key: key.clone(),
                            path: path.clone(),
                            source,
                        })?;
                cmd.stdout(out).stderr(err);
            }
        }
        let setup = ChildSetup {
            parent_pid: nix::unistd::getpid().as_raw(),
            death_signal: libc::c_ulong::try_from(libc::SIGKILL).unwrap_or(9),
            // SAFETY: sched_param is plain integers (one on glibc, padding on musl): all-zero is
            // valid, and is priority 0.
            param: unsafe { std::mem::zeroed() },
            procs_fd: procs_file.as_ref().map(AsRawFd::as_raw_fd),
            mask,
            report_fd: report_write.as_raw_fd(),
        };
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls (prctl, getppid, sched_setscheduler, write,
        // sched_setaffinity, dup2, fcntl) on values prepared before the fork: it allocates
        // nothing, takes no lock and touches no state shared with other threads.
        unsafe {
            cmd.pre_exec(move || setup.apply());
        }
        let child = cmd.spawn().map_err(|source| InstanceError::Spawn {
            key: key.clone(),
            program: program.clone(),
            source,
        })?;
        // The child has its own copies (or has exec'd): without ours, the pipe ends when the
        // instance and its children are gone.
        drop(report_write);
        drop(procs_file);
        Ok(Run {
            pid: child.id(),
            child,
            started: now,
            report: Some(File::from(report_read)),
        })
    }

    /// CPUs (and memory nodes) changed alone: move the running instance. Returns whether
    /// anything was written.
    fn move_in_place(&mut self, slot: &Slot, spec: &InstanceSpec) -> Result<bool, InstanceError> {
        let key = slot.key();
        match (self.placement, &slot.cgroup) {
            (PinMethod::Cgroup, Some(cg)) => self
                .set_cpuset(cg, &spec.cpus, &spec.mems)
                .map_err(|source| InstanceError::Cgroup { key, source }),
            (PinMethod::Cgroup, None) => Ok(false),
            (PinMethod::Affinity, _) => {
                let Some(run) = &slot.run else {
                    return Ok(false);
                };
                if slot.spec.cpus == spec.cpus {
                    return Ok(false);
                }
                let mask = CpuMask::from_cpuset(&spec.cpus);
                self.table.rescan(&mut self.reader)?;
                let mut pids = vec![run.pid];
                self.table.descendants(&[run.pid], &mut pids);
                let mut changed = false;
                let mut tids = Vec::new();
                for pid in pids {
                    tids.clear();
                    self.reader.threads(pid, &mut tids)?;
                    for &tid in &tids {
                        match sched::ensure_affinity(tid, &mask) {
                            Ok(AffinityState::Changed) => changed = true,
                            Ok(_) => {}
                            Err(source) => {
                                return Err(InstanceError::Sched {
                                    key: key.clone(),
                                    source,
                                })
                            }
                        }
                    }
                }
                Ok(changed)
            }
        }
    }

    /// SIGTERM to the instance's process group; the slot starts stopping.
    fn terminate(&self, slot: &mut Slot, now: Instant, next: Option<(InstanceSpec, Template)>) {
        if let Some(run) = &slot.run {
            if let Some(pgid) = pid_of(run.pid) {
                // ESRCH: it exited meanwhile; `poll` reaps it.
                let _ = killpg(pgid, Signal::SIGTERM);
            }
        }
        slot.state = SlotState::Stopping {
            kill_at: now + self.settings.stop_grace,
            killed_at: None,
            stuck: false,
            next,
        };
    }

    /// SIGKILL to the instance's process group and everything in its cgroup.
    fn kill_run(&self, slot: &Slot, errors: &mut Vec<InstanceError>) {
        if let Some(run) = &slot.run {
            if let Some(pgid) = pid_of(run.pid) {
                match killpg(pgid, Signal::SIGKILL) {
                    Ok(()) | Err(Errno::ESRCH) => {}
                    Err(errno) => errors.push(InstanceError::Signal {
                        key: slot.key(),
                        pid: run.pid,
                        signal: Signal::SIGKILL,
                        errno,
                    }),
                }
            }
        }
        if let Some(cg) = &slot.cgroup {
            if let Err(e) = self.kill_cgroup(cg) {
                errors.push(e);
            }
        }
    }

    /// The process is gone (reaped, its group killed by [`Run::reap`]): kill what it left in its
    /// cgroup, read its last reports.
    fn finish_run(&mut self, slot: &mut Slot, now: Instant, errors: &mut Vec<InstanceError>) {
        self.read_reports(slot, now);
        if let Some(cg) = &slot.cgroup {
            if let Err(e) = self.kill_cgroup(cg) {
                errors.push(e);
            }
        }
        slot.run = None;
    }

    /// An instance exited on its own: back off before the restart.
    fn on_exit(
        &mut self,
        slot: &mut Slot,
        now: Instant,
        how: &str,
        errors: &mut Vec<InstanceError>,
    ) {
        let ran = slot
            .run
            .as_ref()
            .map_or(Duration::ZERO, |r| now.saturating_duration_since(r.started));
        self.finish_run(slot, now, errors);
        if ran >= self.settings.stable_after {
            slot.failures = 0;
        }
        slot.failures = slot.failures.saturating_add(1);
        slot.backoff = backoff_delay(
            slot.failures,
            self.settings.backoff_initial,
            self.settings.backoff_max,
        );
        slot.last_exit = Some(how.to_string());
        slot.state = SlotState::BackingOff {
            at: now + slot.backoff,
        };
    }

    /// A slot leaves for good: its cgroup goes.
    fn discard(&mut self, slot: &Slot, errors: &mut Vec<InstanceError>) {
        if let Some(cg) = &slot.cgroup {
            if let Err(source) = self.remove_cgroup(cg, REMOVE_WAIT) {
                errors.push(InstanceError::Cgroup {
                    key: slot.key(),
                    source,
                });
            }
        }
        info!(instance = %slot.key(), "instance removed");
    }

    /// Reads what the instance wrote since the last call; returns the good lines.
    fn read_reports(&mut self, slot: &mut Slot, now: Instant) -> u64 {
        let key = slot.key();
        let Some(run) = slot.run.as_mut() else {
            return 0;
        };
        let Some(pipe) = run.report.as_mut() else {
            return 0;
        };
        let mut good = 0;
        loop {
            match pipe.read(&mut self.buf) {
                Ok(0) => {
                    run.report = None;
                    break;
                }
                Ok(n) => {
                    let bytes = self.buf.get(..n).unwrap_or_default();
                    good += slot.reports.feed(&key, bytes, now);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!(instance = %key, "cannot read its report pipe: {e}");
                    run.report = None;
                    break;
                }
            }
        }
        good
    }

    /// SIGKILL to every process of a cgroup; returns their pids.
    fn kill_cgroup(&self, cg: &str) -> Result<Vec<u32>, InstanceError> {
        let h = &*self.cpusets;
        let mut pids = Vec::new();
        match h.procs(cg, &mut pids) {
            Ok(()) => {}
            Err(e) if e.is_gone() => return Ok(pids),
            Err(e) => return Err(e.into()),
        }
        if pids.is_empty() {
            return Ok(pids);
        }
        let kill_file = h.dir(cg).join(CGROUP_KILL);
        if self.version == CgroupVersion::V2
            && kill_file.is_file()
            && fs::write(&kill_file, "1").is_ok()
        {
            return Ok(pids);
        }
        for &pid in &pids {
            let Some(p) = pid_of(pid) else { continue };
            match kill(p, Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(errno) => return Err(InstanceError::Leftover { pid, errno }),
            }
        }
        Ok(pids)
    }

    /// Waits up to `wait` for the cgroup to empty, then removes it. `Ok(false)`: still in use, to
    /// be retried by `poll`.
    fn remove_cgroup(&mut self, cg: &str, wait: Duration) -> Result<bool, CgroupError> {
        let h = &*self.cpusets;
        let deadline = Instant::now() + wait;
        loop {
            match h.remove_if_unused(cg) {
                Ok(true) => {
                    self.pending_removal.retain(|c| c != cg);
                    return Ok(true);
                }
                Ok(false) if Instant::now() < deadline => std::thread::sleep(STEP),
                Ok(false) => {
                    if !self.pending_removal.iter().any(|c| c == cg) {
                        self.pending_removal.push(cg.to_string());
                    }
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn retry_removals(&mut self) {
        for cg in std::mem::take(&mut self.pending_removal) {
            let _ = self.kill_cgroup(&cg);
            match self.remove_cgroup(&cg, Duration::ZERO) {
                Ok(_) => {}
                Err(e) => warn!("cannot remove instance cgroup {cg}: {e}"),
            }
        }
    }

    /// Removes `<parent>/lodgers` when no instance cgroup is left, and `<parent>` if it was
    /// created here and nothing else uses it.
    fn remove_lodgers(&mut self, errors: &mut Vec<InstanceError>) {
        if !self.pending_removal.is_empty() {
            return;
        }
        let h = &*self.cpusets;
        match h.remove_if_unused(&self.lodgers) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                errors.push(e.into());
                return;
            }
        }
        if self.created_parent {
            match h.remove_if_unused(&self.parent) {
                Ok(true) => self.created_parent = false,
                Ok(false) => {}
                Err(e) => errors.push(e.into()),
            }
        }
    }

    /// SIGKILL to every process whose environment holds `LODGER_PARENT=<parent>`.
    fn kill_marked(&mut self) -> Result<Vec<u32>, InstanceError> {
        let mark = format!("{ENV_PARENT}={}", self.parent).into_bytes();
        let me = std::process::id();
        let root = self.settings.proc_root.clone();
        let entries = fs::read_dir(&root).map_err(|source| ProcError::Read {
            path: root.clone(),
            source,
        })?;
        let mut killed = Vec::new();
        for entry in entries {
            let Ok(entry) = entry else { continue };
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == me {
                continue;
            }
            // Gone, a kernel thread, a zombie: nothing to read, nothing to kill.
            let Ok(environ) = fs::read(entry.path().join("environ")) else {
                continue;
            };
            if !environ.split(|&b| b == 0).any(|var| var == mark.as_slice()) {
                continue;
            }
            let Some(p) = pid_of(pid) else { continue };
            match kill(p, Signal::SIGKILL) {
                Ok(()) => killed.push(pid),
                Err(Errno::ESRCH) => {}
                Err(errno) => return Err(InstanceError::Leftover { pid, errno }),
            }
        }
        Ok(killed)
    }
}

/// A pipe for one instance's reports: (read end, non-blocking; write end), both close-on-exec.
/// The write end is never one of the standard descriptors (the child's stdio is set up before
/// `pre_exec` moves the write end to [`REPORT_FD`]).
fn report_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds: [RawFd; 2] = [-1, -1];
    // SAFETY: `fds` is a writable array of two descriptors, as pipe2 requires.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded: both descriptors are open and owned by nobody else.
    let (read, mut write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    if write.as_raw_fd() < REPORT_FD {
        // SAFETY: F_DUPFD_CLOEXEC on an open descriptor; the result is checked.
        let dup = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_DUPFD_CLOEXEC, REPORT_FD + 1) };
        if dup < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fcntl returned a new open descriptor nobody else owns.
        write = unsafe { OwnedFd::from_raw_fd(dup) };
    }
    // SAFETY: fcntl on an open descriptor we own; F_GETFL/F_SETFL take and return plain flags.
    unsafe {
        let flags = libc::fcntl(read.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(read.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
        // Best effort: the default 64 KiB also works, with an earlier block for a chatty instance.
        libc::fcntl(read.as_raw_fd(), libc::F_SETPIPE_SZ, REPORT_PIPE_BYTES);
    }
    Ok((read, write))
}

/// What the forked child does before exec. Built before the fork: `apply` allocates nothing.
struct ChildSetup {
    parent_pid: libc::pid_t,
    death_signal: libc::c_ulong,
    /// Priority 0, for SCHED_OTHER.
    param: libc::sched_param,
    /// Cgroup placement: `cgroup.procs` of the instance's cgroup, open for writing.
    procs_fd: Option<RawFd>,
    /// Affinity placement: the instance's CPUs.
    mask: Option<CpuMask>,
    report_fd: RawFd,
}

impl ChildSetup {
    /// Runs in the child between fork and exec: async-signal-safe system calls only.
    fn apply(&self) -> io::Result<()> {
        let fail = || Err(io::Error::last_os_error());
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, self.death_signal) } != 0 {
            return fail();
        }
        // lodgerd died between fork and prctl: the death signal was missed, do not start.
        // SAFETY: getppid has no arguments and cannot fail.
        if unsafe { libc::getppid() } != self.parent_pid {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        // A child inherits the spawning thread's policy: instances are always SCHED_OTHER, the
        // class training's SCHED_RR pre-empts (Cloud Reamer §III-A).
        // SAFETY: `self.param` is a valid sched_param that outlives the call.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &self.param) } != 0 {
            return fail();
        }
        if let Some(fd) = self.procs_fd {
            // "0" moves the writing process: the child joins its cgroup before the program runs.
            // SAFETY: writes one byte from a static buffer to an open descriptor.
            if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                return fail();
            }
        }
        if let Some(mask) = &self.mask {
            // One sched_setaffinity system call on the calling thread (tid 0).
            if let Err(errno) = mask.apply_to(0) {
                return Err(io::Error::from_raw_os_error(errno as i32));
            }
        }
        if self.report_fd == REPORT_FD {
            // dup2 onto itself keeps close-on-exec: clear it instead.
            // SAFETY: fcntl on an open descriptor with an integer argument.
            if unsafe { libc::fcntl(REPORT_FD, libc::F_SETFD, 0) } != 0 {
                return fail();
            }
        } else {
            // SAFETY: dup2 between descriptors; the new one does not have close-on-exec.
            if unsafe { libc::dup2(self.report_fd, REPORT_FD) } != REPORT_FD {
                return fail();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobId {
        JobId::parse("j7").expect("job id")
    }

    fn argv(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    fn spec(args: &[&str]) -> InstanceSpec {
        InstanceSpec {
            job: job(),
            index: 2,
            argv: argv(args),
            cpus: CpuSet::parse("1,3-4").expect("cpus"),
            mems: CpuSet::new(),
            threads: 3,
            batch: 16,
        }
    }

    fn problem(e: InstanceError) -> TemplateProblem {
        match e {
            InstanceError::Template { problem, .. } => problem,
            other => panic!("not a template error: {other}"),
        }
    }

    #[test]
    fn templates_expand_placeholders() {
        let s = spec(&[
            "/bin/server",
            "--threads={threads}",
            "-b",
            "{batch}",
            "--cpus",
            "{cpus}",
            "{job}/{instance}",
            "{{literal}}",
        ]);
        let t = Template::parse(&s.job, &s.argv).expect("parses");
        assert_eq!(
            t.expand(&s),
            argv(&[
                "/bin/server",
                "--threads=3",
                "-b",
                "16",
                "--cpus",
                "1,3-4",
                "j7/2",
                "{literal}"
            ])
        );
        assert!(t.uses(Placeholder::Cpus));
        let plain = Template::parse(&s.job, &argv(&["x", "{threads}"])).expect("parses");
        assert!(!plain.uses(Placeholder::Cpus));
        // An empty argument stays an argument.
        let empty = Template::parse(&s.job, &argv(&["x", ""])).expect("parses");
        assert_eq!(empty.expand(&s), argv(&["x", ""]));
    }

    #[test]
    fn bad_templates_say_what_is_wrong() {
        let j = job();
        assert_eq!(
            problem(Template::parse(&j, &[]).expect_err("empty")),
            TemplateProblem::Empty
        );
        assert_eq!(
            problem(Template::parse(&j, &argv(&["  "])).expect_err("blank")),
            TemplateProblem::Empty
        );
        let e = Template::parse(&j, &argv(&["srv", "--n={thread}"])).expect_err("unknown");
        let text = e.to_string();
        assert!(
            text.contains("{thread}") && text.contains("{threads}"),
            "{text}"
        );
        assert!(text.contains("srv --n={thread}"), "{text}");
        assert_eq!(
            problem(e),
            TemplateProblem::UnknownPlaceholder {
                arg: 1,
                text: "--n={thread}".into(),
                name: "thread".into()
            }
        );
        assert!(matches!(
            problem(Template::parse(&j, &argv(&["srv", "{batch"])).expect_err("open")),
            TemplateProblem::UnmatchedBrace {
                brace: '{',
                arg: 1,
                ..
            }
        ));
        assert!(matches!(
            problem(Template::parse(&j, &argv(&["srv", "a}b"])).expect_err("close")),
            TemplateProblem::UnmatchedBrace { brace: '}', .. }
        ));
    }

    #[test]
    fn programs_are_found_like_execvp() {
        assert!(find_program("sh").is_ok());
        assert!(matches!(
            find_program("lodger-no-such-program-xyz"),
            Err(TemplateProblem::ProgramNotFound { .. })
        ));
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("not-exec");
        fs::write(&file, "#!/bin/sh\n").expect("write");
        let p = file.to_str().expect("utf-8").to_string();
        assert!(matches!(
            find_program(&p),
            Err(TemplateProblem::NotExecutable { .. })
        ));
        fs::set_permissions(&file, fs::Permissions::from_mode(0o755)).expect("chmod");
        assert_eq!(find_program(&p).expect("found"), file);
        let dir_path = dir.path().to_str().expect("utf-8");
        assert!(matches!(
            find_program(dir_path),
            Err(TemplateProblem::NotExecutable { .. })
        ));
        let e = validate_template(&job(), &argv(&["lodger-no-such-program-xyz", "{batch}"]))
            .expect_err("missing");
        assert!(e.to_string().contains("absolute path"), "{e}");
        // A program given by a placeholder is checked at start, not here.
        assert!(validate_template(&job(), &argv(&["{job}"])).is_ok());
    }

    #[test]
    fn shows_templates_quoted() {
        assert_eq!(
            show_argv(&argv(&["a", "b c", "it's", "--x={threads}"])),
            r"a 'b c' 'it'\''s' --x={threads}"
        );
    }

    #[test]
    fn report_lines_parse_and_reject() {
        let r = parse_report(br#"{"items":8,"latency_ms":12.5,"queue_ms":3}"#).expect("ok");
        assert_eq!(r.items, 8);
        assert_eq!(r.latency_ms, 12.5);
        assert_eq!(r.queue_ms, Some(3.0));
        let r = parse_report(br#"{"latency_ms":1,"items":1,"extra":"ignored"}"#).expect("ok");
        assert_eq!(r.queue_ms, None);
        for bad in [
            &br#"{"items":-1,"latency_ms":1}"#[..],
            br#"{"items":1}"#,
            br#"{"items":1,"latency_ms":-2}"#,
            br#"items=1"#,
            b"",
        ] {
            assert!(
                parse_report(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn report_log_joins_partial_lines_and_counts_bad_ones() {
        let key = spec(&["x"]).key();
        let mut log = ReportLog::default();
        let t = Instant::now();
        assert_eq!(log.feed(&key, br#"{"items":2,"lat"#, t), 0);
        assert_eq!(log.feed(&key, b"ency_ms\":4}\n\n{\"items\":1,", t), 1);
        assert_eq!(log.feed(&key, b"\"latency_ms\":8}\r\nnot json\n", t), 1);
        assert_eq!(log.reports_total, 2);
        assert_eq!(log.items_total, 3);
        assert_eq!(log.bad_total, 1);
        // A line longer than the limit is dropped as one bad line, up to its end.
        let long = vec![b'x'; MAX_REPORT_LINE + 10];
        assert_eq!(log.feed(&key, &long, t), 0);
        assert_eq!(
            log.feed(&key, b"yyy\n{\"items\":5,\"latency_ms\":1}\n", t),
            1
        );
        assert_eq!(log.bad_total, 2);
        assert_eq!(log.items_total, 8);
    }

    #[test]
    fn window_rates_and_percentiles_weigh_items() {
        let key = spec(&["x"]).key();
        let mut log = ReportLog::default();
        let start = Instant::now();
        let now = start + Duration::from_secs(20);
        // Outside the 10 s window.
        log.feed(
            &key,
            b"{\"items\":1000,\"latency_ms\":500}\n",
            start + Duration::from_secs(5),
        );
        // 98 items at 10 ms, 1 item at 50 ms, 1 at 100 ms, inside it.
        log.feed(
            &key,
            b"{\"items\":98,\"latency_ms\":10,\"queue_ms\":1}\n{\"items\":1,\"latency_ms\":50}\n",
            start + Duration::from_secs(15),
        );
        log.feed(
            &key,
            b"{\"items\":1,\"latency_ms\":100}\n",
            start + Duration::from_secs(16),
        );
        let w = log.summary(now, Duration::from_secs(10), Some(start));
        assert_eq!(w.span, Duration::from_secs(10));
        assert!((w.items_per_s - 10.0).abs() < 1e-9, "{}", w.items_per_s);
        assert_eq!(w.p50, Some(10.0));
        assert_eq!(w.p99, Some(50.0));
        assert_eq!(w.queue_p99, Some(1.0));
        // A process younger than the window: the rate is over its age.
        let young = log.summary(
            now,
            Duration::from_secs(10),
            Some(start + Duration::from_secs(15)),
        );
        assert_eq!(young.span, Duration::from_secs(5));
        assert!((young.items_per_s - 20.0).abs() < 1e-9);
        log.trim(now, Duration::from_secs(10));
        assert_eq!(log.recent.len(), 3);
        assert_eq!(weighted_percentile(&mut [], 990), None);
        assert_eq!(weighted_percentile(&mut [(3.0, 0)], 500), None);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let one = Duration::from_secs(1);
        let cap = Duration::from_secs(60);
        let got: Vec<u64> = (1..=8)
            .map(|f| backoff_delay(f, one, cap).as_secs())
            .collect();
        assert_eq!(got, vec![1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(backoff_delay(u32::MAX, one, cap), cap);
        assert_eq!(backoff_delay(0, one, cap), one);
    }

    #[test]
    fn exits_are_described() {
        assert_eq!(
            describe_exit(ExitStatus::from_raw(3 << 8)),
            "exited with status 3"
        );
        assert_eq!(describe_exit(ExitStatus::from_raw(9)), "killed by SIGKILL");
    }
}
