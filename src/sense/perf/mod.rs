//! perf sensing: per-job hardware counters (instructions, cycles, cache references, cache misses)
//! through `perf_event_open`, from which IPC and the cache-miss ratio of a window are derived
//! (Cloud Reamer §III-B guides the inference instance search by them). Touches
//! `perf_event_open` and reads `/proc/<root>/sys/kernel/perf_event_paranoid`,
//! `/proc/<root>/self/{status,limits}` and `/proc/<root>/PID/task`; nothing else.
//!
//! Two ways to count a job:
//! - [`PerfTarget::Processes`]: one counter group per *thread* of each process, with `inherit`, so
//!   threads and child processes started after attaching are counted too. A counter opened on a pid
//!   counts only that thread and what it starts later, never its existing sibling threads, hence
//!   one group per thread rather than per process.
//! - [`PerfTarget::Cgroup`]: one counter group per CPU on the cgroup's directory in the perf_event
//!   hierarchy (the kernel only counts cgroups per CPU). It counts everything in the cgroup and its
//!   descendants; its cost is events × CPUs file descriptors, whatever the job's size.
//!
//! Counters are read as groups (one `read(2)` per thread or CPU returns all events with a shared
//! time_enabled/time_running). Kernels before 4.13 refuse `PERF_FORMAT_GROUP` with `inherit`
//! (EINVAL): there each event is opened and read on its own ([`Grouping::Ungrouped`]).
//!
//! Samples are raw sums; [`PerfRates::between`] derives the window's scaled counts, IPC and miss
//! ratio as a pure function of two samples. Reading many fds is slow on big hosts: call
//! [`Counters::read`] off the agent loop's critical path (`PerfCounters` is `Send`).

mod access;
mod counters;

#[cfg(test)]
mod tests;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use perf_event::events::{Hardware, Software};
use serde::Serialize;

use crate::cpuset::CpuSet;
use crate::job::JobId;

pub use self::access::{parse_cap_eff, parse_nofile_soft, FdBudget, PerfAccess};
pub use self::counters::PerfCounters;

/// `kernel.perf_event_paranoid`, relative to the proc root.
pub const PARANOID_FILE: &str = "sys/kernel/perf_event_paranoid";
/// This process's status (capabilities), relative to the proc root.
pub const SELF_STATUS: &str = "self/status";
/// This process's resource limits, relative to the proc root.
pub const SELF_LIMITS: &str = "self/limits";

/// Capability numbers from `linux/capability.h`.
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;

/// File descriptors kept out of the perf budget for everything else lodgerd opens (D-Bus, cgroup
/// and proc files, NVML, the state file): at most half the limit, at most this many.
pub const FD_RESERVE: usize = 4096;

/// The four counted events. Their order is the index into [`PerfSample::counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PerfEvent {
    Instructions,
    Cycles,
    CacheReferences,
    CacheMisses,
}

impl PerfEvent {
    pub const ALL: [PerfEvent; 4] = [
        PerfEvent::Instructions,
        PerfEvent::Cycles,
        PerfEvent::CacheReferences,
        PerfEvent::CacheMisses,
    ];

    /// perf's name for the event.
    pub fn name(self) -> &'static str {
        match self {
            PerfEvent::Instructions => "instructions",
            PerfEvent::Cycles => "cycles",
            PerfEvent::CacheReferences => "cache-references",
            PerfEvent::CacheMisses => "cache-misses",
        }
    }

    pub fn index(self) -> usize {
        match self {
            PerfEvent::Instructions => 0,
            PerfEvent::Cycles => 1,
            PerfEvent::CacheReferences => 2,
            PerfEvent::CacheMisses => 3,
        }
    }

    /// What the event stands for when the PMU is not used ([`EventSource::Software`]).
    fn software_stand_in(self) -> Software {
        match self {
            PerfEvent::Instructions => Software::TASK_CLOCK,
            PerfEvent::Cycles => Software::CPU_CLOCK,
            PerfEvent::CacheReferences => Software::CONTEXT_SWITCHES,
            PerfEvent::CacheMisses => Software::PAGE_FAULTS,
        }
    }

    fn hardware(self) -> Hardware {
        match self {
            PerfEvent::Instructions => Hardware::INSTRUCTIONS,
            PerfEvent::Cycles => Hardware::CPU_CYCLES,
            // The generic events, not the LL cache event: on Intel they map to the last-level
            // cache anyway, and VM PMUs often expose them while refusing `LL` (ENOENT).
            PerfEvent::CacheReferences => Hardware::CACHE_REFERENCES,
            PerfEvent::CacheMisses => Hardware::CACHE_MISSES,
        }
    }
}

impl fmt::Display for PerfEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventSource {
    /// The PMU's generic hardware events. The only source for decisions.
    #[default]
    Hardware,
    /// Software events in the same four slots (task-clock, cpu-clock, context-switches,
    /// page-faults, in [`PerfEvent::ALL`] order): they exercise the whole machinery (targets,
    /// inherit, groups, cgroups, fd budget, read cost) on hosts without a PMU, such as VMs. Their
    /// "IPC" and "miss ratio" mean nothing.
    Software,
}

/// Whether events of one thread or CPU are opened as one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Grouping {
    /// Groups where the kernel accepts them with `inherit` (4.13 and later), else ungrouped.
    #[default]
    Auto,
    /// One fd read per event: what kernels before 4.13 need. Forced in tests to cover that path.
    Ungrouped,
}

/// How [`PerfCounters`] counts.
#[derive(Debug, Clone)]
pub struct PerfSettings {
    pub proc_root: PathBuf,
    pub source: EventSource,
    pub grouping: Grouping,
    /// Count kernel-mode execution too. Off by default: the job's own code is what IPC is about,
    /// and kernel counting needs `perf_event_paranoid` ≤ 1 or CAP_PERFMON.
    pub include_kernel: bool,
    /// Most perf fds to hold; `None`: the soft RLIMIT_NOFILE minus [`FD_RESERVE`] (or half of it).
    pub fd_cap: Option<usize>,
}

impl PerfSettings {
    pub fn new(proc_root: &Path) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            source: EventSource::Hardware,
            grouping: Grouping::Auto,
            include_kernel: false,
            fd_cap: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("unexpected content in {path}: {value:?}")]
    Parse { path: PathBuf, value: String },
    #[error("perf_event_open({event}) on {target} was refused ({source}): {hint}")]
    Permission {
        event: PerfEvent,
        target: String,
        source: io::Error,
        hint: String,
    },
    #[error("perf_event_open({event}) on {target}: {source}")]
    Open {
        event: PerfEvent,
        target: String,
        source: io::Error,
    },
    #[error("cannot enable the counters on {target}: {source}")]
    Enable { target: String, source: io::Error },
    #[error("cannot open cgroup directory {path}: {source}")]
    Cgroup { path: PathBuf, source: io::Error },
    #[error(
        "job {job}: counting {target} needs {needed} perf file descriptors but only {available} \
         of the budget of {cap} are left; raise LimitNOFILE= in the unit, or count the job by \
         cgroup on fewer CPUs"
    )]
    FdBudget {
        job: JobId,
        target: String,
        needed: usize,
        available: usize,
        cap: usize,
    },
    #[error(
        "{path} is not a cgroup of the perf_event hierarchy ({source}): give its directory under \
         the v1 perf_event mount or the v2 hierarchy (see perf_cgroup_root)"
    )]
    NotPerfCgroup { path: PathBuf, source: io::Error },
    #[error("job {job}: no process of {target} is alive")]
    TargetGone { job: JobId, target: String },
    #[error(transparent)]
    Proc(#[from] crate::sys::procfs::ProcError),
}

// ---------------------------------------------------------------------------------------------
// Samples and the pure derivation of rates

/// One event's raw kernel values: the count and how long the event was enabled and actually on
/// the PMU (they differ when the kernel multiplexes more events than the PMU has counters).
/// Summed over a job's threads or CPUs, as perf stat aggregates before scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct RawCount {
    pub value: u64,
    pub time_enabled_ns: u64,
    pub time_running_ns: u64,
}

impl RawCount {
    fn saturating_add(self, o: RawCount) -> RawCount {
        RawCount {
            value: self.value.saturating_add(o.value),
            time_enabled_ns: self.time_enabled_ns.saturating_add(o.time_enabled_ns),
            time_running_ns: self.time_running_ns.saturating_add(o.time_running_ns),
        }
    }
}

/// A job's counters at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct PerfSample {
    pub at: Instant,
    /// Changes whenever the job's counters are (re)opened: counts of different generations are
    /// not comparable.
    pub generation: u64,
    /// Indexed by [`PerfEvent::index`]; `None` for an event this host cannot count.
    pub counts: [Option<RawCount>; 4],
    /// Threads or CPUs counted, and the fds they hold.
    pub groups: u32,
    pub fds: u32,
    /// Group reads that failed this time (their last values were used instead).
    pub read_errors: u32,
}

impl PerfSample {
    pub fn get(&self, event: PerfEvent) -> Option<RawCount> {
        self.counts[event.index()]
    }
}

/// The count of an event over a window, scaled for multiplexing:
/// Δvalue × Δtime_enabled / Δtime_running. `None` when the counter went backwards (it was reset or
/// reopened; a 64-bit wrap takes a century) or was enabled but never on the PMU in the window.
/// A window in which neither time advanced returns the raw delta (almost always 0; cgroup events
/// on the root cgroup count without advancing their times).
pub fn scaled_delta(prev: RawCount, cur: RawCount) -> Option<f64> {
    let dv = cur.value.checked_sub(prev.value)?;
    let de = cur.time_enabled_ns.checked_sub(prev.time_enabled_ns)?;
    let dr = cur.time_running_ns.checked_sub(prev.time_running_ns)?;
    if dr == 0 {
        return (de == 0).then_some(as_f64(dv));
    }
    if de <= dr {
        return Some(as_f64(dv));
    }
    Some(as_f64(dv) * (as_f64(de) / as_f64(dr)))
}

/// u64 → f64 for rates: exact below 2^53, which any per-window delta is.
fn as_f64(x: u64) -> f64 {
    x as f64
}

fn ratio(num: Option<f64>, den: Option<f64>) -> Option<f64> {
    let (n, d) = (num?, den?);
    if d > 0.0 {
        Some(n / d).filter(|r| r.is_finite())
    } else {
        None
    }
}

/// What a job's counters say about one window. Every value is `None` rather than NaN or
/// infinite when it cannot be known (event missing, nothing counted, counter reset).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PerfRates {
    pub window: Duration,
    /// Scaled counts over the window.
    pub instructions: Option<f64>,
    pub cycles: Option<f64>,
    pub cache_references: Option<f64>,
    pub cache_misses: Option<f64>,
    /// Instructions per cycle.
    pub ipc: Option<f64>,
    /// Cache misses per cache reference (may exceed 1 on PMUs whose two events count different
    /// things, or when ungrouped counters were multiplexed apart).
    pub cache_miss_ratio: Option<f64>,
    /// Cache misses per thousand instructions.
    pub mpki: Option<f64>,
    /// The smallest Δtime_running/Δtime_enabled over the events: 1.0 means no multiplexing.
    pub running_fraction: Option<f64>,
}

impl PerfRates {
    /// The window between two samples of the same job, or `None` when they come from different
    /// counter generations or are not in time order.
    pub fn between(prev: &PerfSample, cur: &PerfSample) -> Option<PerfRates> {
        if prev.generation != cur.generation || cur.at <= prev.at {
            return None;
        }
        let delta = |e: PerfEvent| scaled_delta(prev.get(e)?, cur.get(e)?);
        let instructions = delta(PerfEvent::Instructions);
        let cycles = delta(PerfEvent::Cycles);
        let cache_references = delta(PerfEvent::CacheReferences);
        let cache_misses = delta(PerfEvent::CacheMisses);
        let running_fraction = PerfEvent::ALL
            .iter()
            .filter_map(|&e| {
                let (p, c) = (prev.get(e)?, cur.get(e)?);
                let de = c.time_enabled_ns.checked_sub(p.time_enabled_ns)?;
                let dr = c.time_running_ns.checked_sub(p.time_running_ns)?;
                ratio(Some(as_f64(dr)), Some(as_f64(de))).map(|f| f.min(1.0))
            })
            .reduce(f64::min);
        Some(PerfRates {
            window: cur.at.duration_since(prev.at),
            instructions,
            cycles,
            cache_references,
            cache_misses,
            ipc: ratio(instructions, cycles),
            cache_miss_ratio: ratio(cache_misses, cache_references),
            mpki: ratio(cache_misses.map(|m| m * 1000.0), instructions),
            running_fraction,
        })
    }

    /// A windowed count per second.
    pub fn per_second(&self, count: Option<f64>) -> Option<f64> {
        ratio(count, Some(self.window.as_secs_f64()))
    }
}

// ---------------------------------------------------------------------------------------------
// Targets and the trait

/// What to count for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerfTarget {
    /// These processes: every thread each has now, with `inherit` for what they start later.
    Processes(Vec<u32>),
    /// A cgroup directory in the perf_event hierarchy (see [`perf_cgroup_root`]), counted on the
    /// given CPUs: the job's cpuset is enough and costs fewer fds than every online CPU, but a
    /// changed cpuset needs a new `attach`.
    Cgroup { dir: PathBuf, cpus: CpuSet },
}

impl fmt::Display for PerfTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PerfTarget::Processes(pids) => {
                write!(f, "pids ")?;
                for (i, p) in pids.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{p}")?;
                }
                Ok(())
            }
            PerfTarget::Cgroup { dir, cpus } => {
                write!(f, "cgroup {} on cpus {cpus}", dir.display())
            }
        }
    }
}

/// Where cgroup perf events find a job's cgroup under `cgroup_root` (e.g. `/sys/fs/cgroup`): the
/// v1 `perf_event` hierarchy if mounted (the controller is then unavailable on v2), else the v2
/// hierarchy at the root or, in hybrid mode, at `unified/`. `None`: no hierarchy serves it.
pub fn perf_cgroup_root(cgroup_root: &Path) -> Option<PathBuf> {
    let v1 = cgroup_root.join("perf_event");
    if v1.join("cgroup.procs").is_file() {
        return Some(v1);
    }
    [cgroup_root.to_path_buf(), cgroup_root.join("unified")]
        .into_iter()
        .find(|d| d.join("cgroup.controllers").is_file())
}

/// What one attach opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Attached {
    pub groups: u32,
    pub fds: u32,
    pub generation: u64,
}

/// Whether an event is counted on this host, and why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EventStatus {
    pub event: PerfEvent,
    /// `None` when counted; else why not (the kernel's answer).
    pub unavailable: Option<String>,
}

/// What status shows about perf sensing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PerfStatus {
    pub access: PerfAccess,
    pub problems: Vec<String>,
    pub events: Vec<EventStatus>,
    /// Counters read as groups (one read per thread or CPU).
    pub grouped: bool,
    /// Software stand-ins instead of the PMU's events.
    pub software: bool,
    pub budget: FdBudget,
    pub jobs: usize,
}

impl PerfStatus {
    /// True when at least one event is counted.
    pub fn available(&self) -> bool {
        self.events.iter().any(|e| e.unavailable.is_none())
    }
}

/// Per-job counters. The agent attaches a job when it is registered (and again when its
/// target changes), reads every tick and detaches when the job goes.
pub trait Counters: Send {
    /// Opens counters for a job, replacing any it had (which starts a new generation).
    fn attach(&mut self, job: &JobId, target: &PerfTarget) -> Result<Attached, PerfError>;
    /// Closes a job's counters; false when it had none.
    fn detach(&mut self, job: &JobId) -> bool;
    /// One sample per attached job, in job order.
    fn read(&mut self) -> Vec<(JobId, PerfSample)>;
    fn status(&self) -> PerfStatus;
}

/// A [`Counters`] for callers' tests: records attaches and returns the samples it is given.
#[derive(Debug, Default)]
pub struct ScriptedCounters {
    pub attached: std::collections::BTreeMap<JobId, PerfTarget>,
    /// Returned by `read` for attached jobs.
    pub samples: std::collections::BTreeMap<JobId, PerfSample>,
    pub status: Option<PerfStatus>,
}

impl Counters for ScriptedCounters {
    fn attach(&mut self, job: &JobId, target: &PerfTarget) -> Result<Attached, PerfError> {
        self.attached.insert(job.clone(), target.clone());
        Ok(Attached {
            groups: 0,
            fds: 0,
            generation: 0,
        })
    }

    fn detach(&mut self, job: &JobId) -> bool {
        self.attached.remove(job).is_some()
    }

    fn read(&mut self) -> Vec<(JobId, PerfSample)> {
        self.samples
            .iter()
            .filter(|(id, _)| self.attached.contains_key(*id))
            .map(|(id, s)| (id.clone(), s.clone()))
            .collect()
    }

    fn status(&self) -> PerfStatus {
        self.status.clone().unwrap_or(PerfStatus {
            access: PerfAccess {
                paranoid: None,
                cap_perfmon: false,
                cap_sys_admin: false,
                cap_sys_ptrace: false,
            },
            problems: Vec::new(),
            events: Vec::new(),
            grouped: false,
            software: false,
            budget: FdBudget { cap: 0, used: 0 },
            jobs: self.attached.len(),
        })
    }
}
