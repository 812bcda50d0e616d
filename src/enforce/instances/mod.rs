//! Inference instances: the child processes lodger starts for online and offline inference jobs
//! (Cloud Reamer §III-A/B), each on the CPUs the plan gives it with its thread count and batch size
//! passed on, supervised (restart with capped exponential back-off, SIGTERM then SIGKILL), and
//! heard through the report protocol of `docs/instance-protocol.md`. Touches cgroupfs (lodger's
//! `<parent>/lodgers` subtree of the cpuset hierarchy), /proc, fork/exec, signals and the
//! instances' report pipes.
//!
//! Where an instance runs ([`PinMethod`](crate::enforce::PinMethod), chosen once by [`Instances::new`]):
//! - cgroup v1: in its own cpuset cgroup `<cpuset root>/<parent>/lodgers/<job>-<index>`. Its mems
//!   and then its cpus are written before any task is attached, and the child attaches itself in
//!   `pre_exec` (it writes `0`, "the writer", to the cgroup's `cgroup.procs`), so not one
//!   instruction of the program runs outside its cpuset.
//! - cgroup v2: a cgroup only inside lodger's own cgroup `<parent>`, and only when the cpuset
//!   controller was delegated to it (listed in `<parent>/cgroup.controllers`): everywhere else the
//!   tree belongs to systemd, which moves or kills what it did not create. Otherwise the child sets
//!   its own CPU affinity in `pre_exec`; memory nodes are then not enforced, and a CPU change is
//!   applied to every thread of the instance's process tree. Without systemd as PID 1 the child
//!   also joins `<parent>/lodgers` before exec ([`InstanceSettings::start_cgroup`]), lodger's own
//!   subtree rather than lodgerd's cgroup, so a stop of lodgerd's cgroup leaves it running.
//!
//! Where systemd is PID 1 no instance is forked: systemd starts each as a transient unit in
//! `lodger-instances.slice` ([`unit`](mod@unit), docs/security.md), as its owner, placed by CPU affinity and
//! followed through a pidfd; stopping lodgerd's own unit leaves it running.
//!
//! Instances outlive lodgerd (issue 17: a restart, an upgrade or a crash is no outage): no death
//! signal, and lodgerd stopping calls [`Instances::leave_running`]. Each instance's report channel
//! is a FIFO under [`InstanceSettings::report_dir`] that the instance holds open for reading and
//! writing, so its writes never fail while lodgerd is away and are read by the next one. At start
//! lodgerd calls [`Instances::adopt`] with what its persisted plan wants: an instance whose process
//! still runs (found by the `LODGER_*` marks in its environment) is supervised again through a
//! pidfd, and everything else left behind (processes carrying lodger's `LODGER_PARENT`, instance
//! cgroups, FIFOs) is killed and removed. Dropping [`Instances`] otherwise kills what it runs
//! (SIGKILL, no grace). Drive it from one long-lived thread (the agent's).
//!
//! Each instance is its own process group: SIGTERM and SIGKILL go to the group, and after an
//! instance exits whatever it left in its group and cgroup is killed before it starts again.
//!
//! Rooms: [`template`] (command templates and finding the program), [`report`] (the report
//! protocol and per-window rates), `supervisor` (the slots and [`Instances`]' reconcile and
//! poll), `hold` (online cores stay exclusive while instances stop or move), `stop` (stopping,
//! the start-up sweep, `Drop`), `host` (cgroups and signals),
//! `spawn` (fork/exec and the child's setup), `identity` (the owner it runs as), [`unit`](mod@unit) (transient units of systemd), [`error`]. May touch `sys/`,
//! `enforce::{cpusets, sched, procs}`; nothing above enforce.

mod adopt;
pub mod error;
mod hold;
mod host;
mod identity;
pub mod memory;
pub mod report;
mod spawn;
mod stop;
mod supervisor;
pub mod template;
pub mod unit;

#[cfg(test)]
mod tests;

pub use self::adopt::AdoptOutcome;
pub use self::error::{InstanceError, TemplateProblem};
pub use self::identity::{check_launch, Identity};
pub use self::report::{parse_report, PooledLatency, Report};
pub use self::supervisor::{backoff_delay, Instances};
pub use self::template::{find_program, show_argv, validate_template, Placeholder, Template};

use std::fmt;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cpuset::CpuSet;
use crate::enforce::DEFAULT_PARENT;
use crate::job::JobId;
use crate::sys::cgroupfs::{self as cgroup, CgroupDriver};
use crate::sys::procfs as procs;

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
/// lodger's parent cgroup: marks the processes of this lodger's instances for
/// [`Instances::adopt`].
pub const ENV_PARENT: &str = "LODGER_PARENT";
/// The thread-count variables of the common math libraries, all set to the instance's threads.
pub const THREAD_ENV: [&str; 3] = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"];
/// The longest report line read; longer ones are dropped and counted as bad. Lines up to
/// `PIPE_BUF` (4096 bytes) are written atomically by the kernel.
pub const MAX_REPORT_LINE: usize = 4096;
/// The most of an instance's report lines read at one poll; the rest waits in its pipe, so an
/// instance writing faster than lodgerd parses blocks (back-pressure) instead of holding the
/// agent's thread in the read loop. 256 KiB: thousands of lines, far more batches than a real
/// instance serves between two polls.
pub const MAX_REPORT_BYTES_PER_POLL: usize = 256 * 1024;
/// The most reports an instance's window keeps (the oldest go first): a bound on lodgerd's
/// memory whatever an instance writes.
pub const MAX_RECENT_REPORTS: usize = 16 * 1024;
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

/// Which placement [`Instances`] uses (resolved to a [`PinMethod`](crate::enforce::PinMethod)).
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
    /// Affinity placement only: a cgroup2 directory (created if missing) each instance joins in
    /// `pre_exec`, before the program runs. [`Instances::new`] makes it `<parent>/lodgers` on
    /// cgroup v2 without systemd as PID 1 (issue 17: outside lodgerd's cgroup), and network
    /// shaping matches CPU jobs by it there (a socket keeps the cgroup its process was in when it
    /// was created, so an instance moved there later would keep its earlier connections
    /// unshaped). Where lodger's subtree cannot be made, lodgerd sets a child of its own cgroup
    /// for shaping ([`Instances::start_in_cgroup`]). `None`: instances stay in lodgerd's cgroup.
    pub start_cgroup: Option<PathBuf>,
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
    /// Offline instances run SCHED_IDLE (`training.lodgers_sched_idle`): they yield even to
    /// SCHED_OTHER training threads (`training.policy = "other"`).
    pub offline_idle: bool,
    /// Where each instance's report channel is a FIFO (`<dir>/<job>-<index>.report`, lodgerd's
    /// `<state_dir>/instances`): the instance's descriptor 3 is opened on it for reading and
    /// writing, so its writes never fail because lodgerd is gone, and the next lodgerd opens the
    /// same path to hear it again. `None`: an anonymous pipe, which ends with lodgerd.
    pub report_dir: Option<PathBuf>,
    /// Each instance's memory limit in bytes unless its spec names one (`inference.memory_max`;
    /// `None`: unbounded), applied as [`memory`] says.
    pub memory_max: Option<u64>,
    /// `memory.high` (v2, units) or the soft limit (v1) in percent of the limit.
    pub memory_high_percent: u8,
    /// The node's physical cores, each its SMT threads (lodgerd's topology; empty: not known):
    /// an offline instance waits while an online instance waiting to move still serves on the
    /// other thread of its core.
    pub cores: Vec<CpuSet>,
}

impl Default for InstanceSettings {
    fn default() -> Self {
        Self {
            cgroup_root: PathBuf::from(cgroup::DEFAULT_CGROUP_ROOT),
            proc_root: PathBuf::from(procs::DEFAULT_PROC_ROOT),
            driver: CgroupDriver::Auto,
            parent: DEFAULT_PARENT.to_string(),
            placement: InstancePlacement::Auto,
            start_cgroup: None,
            stop_grace: Duration::from_secs(10),
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            stable_after: Duration::from_secs(60),
            window: Duration::from_secs(10),
            output: InstanceOutput::Inherit,
            offline_idle: false,
            report_dir: None,
            memory_max: None,
            memory_high_percent: 90,
            cores: Vec::new(),
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
    /// An offline (throughput) instance: SCHED_IDLE when `InstanceSettings::offline_idle`.
    #[serde(default)]
    pub offline: bool,
    /// Who it runs as, where, with what environment and output.
    #[serde(default)]
    pub identity: Identity,
    /// Its memory limit in bytes, when its job names one (else `InstanceSettings::memory_max`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
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
// State, stats and outcomes

/// Where an instance is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceState {
    Running,
    /// It exited on its own or could not start: it starts again after `retry_in`. `waits`: its
    /// back-off is over (`retry_in` zero) but CPUs it is to have are still held, as for a
    /// [`InstanceState::Waiting`] start; it starts once they are free, and is shown `waiting`
    /// (its restarts and the exit that brought it here stand).
    BackingOff {
        retry_in: Duration,
        waits: bool,
    },
    /// SIGTERM was sent; `restarting`: it starts again with a new spec once gone.
    Stopping {
        restarting: bool,
    },
    /// Not started yet: an online instance waiting to move still serves on some of its CPUs,
    /// or it is online and a stopping instance still runs there (for up to `stop_grace`); it
    /// starts once they are free.
    Waiting,
    /// An online instance running and serving where its `cpus` say, to move in place to the
    /// CPUs the plan now gives it once a stopping instance has left them (up to `stop_grace`).
    Moving,
}

impl InstanceState {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Running => "running",
            InstanceState::BackingOff { waits: true, .. } => "waiting",
            InstanceState::BackingOff { .. } => "backing-off",
            InstanceState::Stopping { .. } => "stopping",
            InstanceState::Waiting => "waiting",
            InstanceState::Moving => "moving",
        }
    }
}

/// Every instance's `oom_score_adj` (the unit property `OOMScoreAdjust`): a lodger's.
pub use crate::enforce::sched::LODGER_OOM_SCORE_ADJ;
/// The same, as written to `/proc/self/oom_score_adj` between fork and exec.
const LODGER_OOM_SCORE_ADJ_TEXT: &[u8] = b"1000";

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
    /// The transient unit it runs in, where systemd started it.
    pub unit: Option<String>,
    pub state: InstanceState,
    /// Restarts after it exited on its own or failed to start.
    pub restarts: u32,
    /// Failures in a row (exits, failed starts); reset by a run of `stable_after`.
    pub failures: u32,
    /// The delay chosen at the last failure (zero before any).
    pub backoff: Duration,
    /// How its last process ended, e.g. "killed by SIGKILL".
    pub last_exit: Option<String>,
    /// Its memory limit in bytes, where one is applied.
    pub memory_max: Option<u64>,
    /// Times the OOM killer took it (its own limit, or the node out of memory).
    pub oom_kills: u32,
    /// Why its last start failed.
    pub last_error: Option<String>,
    /// Age of the running process.
    pub uptime: Duration,
    /// The span the rates and percentiles below cover: the window, or less for a young process.
    pub span: Duration,
    pub items_per_s: f64,
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    /// Reports (batches) in the window the percentiles above were taken from.
    pub latency_samples: u64,
    pub queue_p99_ms: Option<f64>,
    /// Totals over all its processes.
    pub items_total: u64,
    pub reports_total: u64,
    /// Lines that were not valid reports.
    pub bad_reports: u64,
}

#[cfg(test)]
impl InstanceStats {
    /// A running instance of `job` on `cpus` with `batch`, nothing measured yet: the policy
    /// tests' starting point, the fields they are about set on top.
    pub(crate) fn running(job: JobId, index: u32, cpus: CpuSet, batch: u32) -> Self {
        Self {
            job,
            index,
            pid: Some(1000 + index),
            threads: u32::try_from(cpus.len()).unwrap_or(u32::MAX),
            cpus,
            batch,
            cgroup: None,
            unit: None,
            state: InstanceState::Running,
            restarts: 0,
            failures: 0,
            backoff: Duration::ZERO,
            last_exit: None,
            memory_max: None,
            oom_kills: 0,
            last_error: None,
            uptime: Duration::ZERO,
            span: Duration::ZERO,
            items_per_s: 0.0,
            latency_p50_ms: None,
            latency_p99_ms: None,
            latency_samples: 0,
            queue_p99_ms: None,
            items_total: 0,
            reports_total: 0,
            bad_reports: 0,
        }
    }
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
    /// Instances not started, or not moved in place, yet: an online instance waiting to move
    /// still serves on their CPUs, or they are online and a stopping instance still runs there
    /// (`poll` starts or moves them once the CPUs are free; a moving one serves on its old CPUs
    /// meanwhile).
    pub waiting: Vec<InstanceKey>,
    pub errors: Vec<InstanceError>,
}

/// What one `poll` found and did.
#[derive(Debug, Default)]
pub struct PollOutcome {
    /// Instances that exited on their own, with how.
    pub exited: Vec<(InstanceKey, String)>,
    /// (Re)started after a back-off or a spec change.
    pub started: Vec<InstanceKey>,
    /// Moved in place after waiting for their new CPUs to be free.
    pub moved: Vec<InstanceKey>,
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
