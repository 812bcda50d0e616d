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

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use perf_event::events::{Hardware, Software};
use perf_event::{Builder, Counter, ReadFormat};
use serde::Serialize;

use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::sys::procfs::ProcReader;

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
// Access and the fd budget

/// What the kernel lets this process count, from `perf_event_paranoid` and its capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PerfAccess {
    /// `None`: the file is missing, the kernel has no perf events.
    pub paranoid: Option<i32>,
    pub cap_perfmon: bool,
    pub cap_sys_admin: bool,
    pub cap_sys_ptrace: bool,
}

impl PerfAccess {
    /// Reads `sys/kernel/perf_event_paranoid` and `self/status` under the proc root.
    pub fn read(proc_root: &Path) -> Result<PerfAccess, PerfError> {
        let paranoid_path = proc_root.join(PARANOID_FILE);
        let paranoid = match std::fs::read_to_string(&paranoid_path) {
            Ok(text) => Some(text.trim().parse::<i32>().map_err(|_| PerfError::Parse {
                path: paranoid_path.clone(),
                value: text.clone(),
            })?),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(PerfError::Read {
                    path: paranoid_path,
                    source,
                })
            }
        };
        let status_path = proc_root.join(SELF_STATUS);
        let status = std::fs::read_to_string(&status_path).map_err(|source| PerfError::Read {
            path: status_path.clone(),
            source,
        })?;
        let cap_eff = parse_cap_eff(&status).ok_or_else(|| PerfError::Parse {
            path: status_path,
            value: status
                .lines()
                .find(|l| l.starts_with("CapEff"))
                .unwrap_or("no CapEff line")
                .to_string(),
        })?;
        let has = |cap: u32| cap_eff & (1u64 << cap) != 0;
        Ok(PerfAccess {
            paranoid,
            cap_perfmon: has(CAP_PERFMON),
            cap_sys_admin: has(CAP_SYS_ADMIN),
            cap_sys_ptrace: has(CAP_SYS_PTRACE),
        })
    }

    /// CAP_PERFMON (5.8+) or CAP_SYS_ADMIN bypass `perf_event_paranoid`.
    pub fn privileged(&self) -> bool {
        self.cap_perfmon || self.cap_sys_admin
    }

    /// Counting this process's own user's threads (paranoid ≤ 2; Debian's 3 forbids it).
    pub fn can_count_processes(&self) -> bool {
        self.paranoid.is_some_and(|p| self.privileged() || p <= 2)
    }

    /// Other users' processes: `perf_check_permission` lets CAP_PERFMON (or CAP_SYS_ADMIN)
    /// through, else it needs ptrace read access to them (CAP_SYS_PTRACE).
    pub fn can_count_other_users(&self) -> bool {
        self.can_count_processes() && (self.privileged() || self.cap_sys_ptrace)
    }

    /// Cgroup events are CPU-wide events: paranoid ≤ 0 or privileged.
    pub fn can_count_cgroups(&self) -> bool {
        self.paranoid.is_some_and(|p| self.privileged() || p <= 0)
    }

    pub fn can_count_kernel(&self) -> bool {
        self.paranoid.is_some_and(|p| self.privileged() || p <= 1)
    }

    /// What is not possible and how to make it possible; empty when everything is.
    pub fn problems(&self, include_kernel: bool) -> Vec<String> {
        let Some(p) = self.paranoid else {
            return vec![format!(
                "/proc/{PARANOID_FILE} is missing: this kernel has no perf events \
                 (CONFIG_PERF_EVENTS); IPC and cache-miss sensing are off"
            )];
        };
        let mut out = Vec::new();
        if !self.can_count_processes() {
            out.push(format!(
                "kernel.perf_event_paranoid={p} forbids perf_event_open to unprivileged processes: \
                 run lodgerd as root, grant it CAP_PERFMON (AmbientCapabilities=CAP_PERFMON in \
                 the unit; kernel 5.8+), or `sysctl kernel.perf_event_paranoid=2`"
            ));
            return out;
        }
        if !self.can_count_cgroups() {
            out.push(format!(
                "kernel.perf_event_paranoid={p} without CAP_PERFMON/CAP_SYS_ADMIN: jobs registered \
                 by cgroup cannot be counted (cgroup events are CPU-wide); grant CAP_PERFMON \
                 (kernel 5.8+, CAP_SYS_ADMIN before) or `sysctl kernel.perf_event_paranoid=0`"
            ));
        }
        if !self.can_count_other_users() {
            out.push(
                "neither CAP_PERFMON nor CAP_SYS_PTRACE: processes of other users cannot be \
                 counted; run lodgerd as root or add CAP_PERFMON to AmbientCapabilities="
                    .to_string(),
            );
        }
        if include_kernel && !self.can_count_kernel() {
            out.push(format!(
                "kernel.perf_event_paranoid={p} without CAP_PERFMON: kernel-mode counting is \
                 refused; grant CAP_PERFMON or `sysctl kernel.perf_event_paranoid=1`"
            ));
        }
        out
    }
}

/// The effective capability mask from `/proc/PID/status`.
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// The soft "Max open files" limit from `/proc/PID/limits` (`None` for unlimited).
pub fn parse_nofile_soft(limits: &str) -> Option<Option<u64>> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    let soft = rest.split_ascii_whitespace().next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

/// Perf file descriptors allowed and held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FdBudget {
    pub cap: usize,
    pub used: usize,
}

impl FdBudget {
    /// The cap for a process whose soft RLIMIT_NOFILE is `soft` (`None`: unlimited).
    pub fn for_limit(soft: Option<u64>) -> FdBudget {
        let soft = soft.map_or(usize::MAX, |s| usize::try_from(s).unwrap_or(usize::MAX));
        let reserve = (soft / 2).min(FD_RESERVE);
        FdBudget {
            cap: soft - reserve,
            used: 0,
        }
    }

    /// Reads the soft RLIMIT_NOFILE from `self/limits` under the proc root.
    pub fn from_proc(proc_root: &Path) -> Result<FdBudget, PerfError> {
        let path = proc_root.join(SELF_LIMITS);
        let text = std::fs::read_to_string(&path).map_err(|source| PerfError::Read {
            path: path.clone(),
            source,
        })?;
        let soft = parse_nofile_soft(&text).ok_or_else(|| PerfError::Parse {
            path,
            value: text
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .unwrap_or("no 'Max open files' line")
                .to_string(),
        })?;
        Ok(FdBudget::for_limit(soft))
    }

    pub fn available(&self) -> usize {
        self.cap.saturating_sub(self.used)
    }

    /// Fds to count `units` threads or CPUs with `events` events each: one fd per event per unit
    /// (a group's leader is one of its events). The cgroup directory's fd is closed after opening.
    pub fn fds_for(units: usize, events: usize) -> usize {
        units.saturating_mul(events)
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

// ---------------------------------------------------------------------------------------------
// The real implementation

/// One thread's or one CPU's counters: the group leader first when grouped.
#[derive(Debug)]
struct EventGroup {
    counters: Vec<(PerfEvent, Counter)>,
    /// The last successful reading, used when a read fails so sums never go backwards.
    last: [Option<RawCount>; 4],
}

#[derive(Debug)]
struct JobCounters {
    groups: Vec<EventGroup>,
    generation: u64,
    fds: usize,
}

/// Why opening a group stopped.
enum OpenFailure {
    /// The thread exited between listing and opening (or the CPU is offline).
    Gone,
    Fatal(PerfError),
}

/// The perf_event_open implementation of [`Counters`].
#[derive(Debug)]
pub struct PerfCounters {
    settings: PerfSettings,
    access: PerfAccess,
    /// `None` when counted, else why not.
    disabled: [Option<String>; 4],
    grouped: bool,
    budget: FdBudget,
    jobs: HashMap<JobId, JobCounters>,
    next_generation: u64,
    procs: ProcReader,
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT) | Some(libc::EOPNOTSUPP) | Some(libc::ENODEV)
    )
}

fn is_permission(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM))
}

fn nanos(d: Option<Duration>) -> u64 {
    d.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl PerfCounters {
    /// Checks access, probes which events the PMU has (a missing one is logged at debug level and reported in
    /// `status()`, for the caller to summarise) and whether
    /// groups work with `inherit`. Never fails for a missing PMU: the events are then reported
    /// unavailable and jobs attach with nothing to count.
    pub fn new(settings: PerfSettings) -> Result<PerfCounters, PerfError> {
        let access = PerfAccess::read(&settings.proc_root)?;
        for problem in access.problems(settings.include_kernel) {
            tracing::warn!("perf: {problem}");
        }
        let budget = match settings.fd_cap {
            Some(cap) => FdBudget { cap, used: 0 },
            None => FdBudget::from_proc(&settings.proc_root)?,
        };
        let procs = ProcReader::new(&settings.proc_root);
        let mut me = PerfCounters {
            access,
            disabled: Default::default(),
            grouped: settings.grouping == Grouping::Auto,
            budget,
            jobs: HashMap::new(),
            next_generation: 1,
            procs,
            settings,
        };
        me.probe();
        Ok(me)
    }

    /// Opens each event on this process once to learn which the PMU has, then a two-event
    /// inherited group to learn whether the kernel groups inherited counters.
    fn probe(&mut self) {
        if self.access.paranoid.is_none() {
            for e in PerfEvent::ALL {
                self.disable(e, "the kernel has no perf events".to_string());
            }
            return;
        }
        for e in PerfEvent::ALL {
            let mut b = self.builder(e, false);
            b.observe_self().any_cpu();
            if let Err(err) = b.build() {
                let why = if is_unsupported(&err) {
                    format!("the PMU does not count it ({err})")
                } else {
                    format!("perf_event_open refused it ({err})")
                };
                self.disable(e, why);
            }
        }
        if !self.grouped {
            return;
        }
        let enabled: Vec<PerfEvent> = self.enabled_events().collect();
        if let [first, second, ..] = enabled[..] {
            let mut lb = self.builder(first, true);
            lb.observe_self().any_cpu().inherit(true);
            let ok = lb.build().and_then(|mut leader| {
                let mut mb = self.builder(second, true);
                mb.observe_self().any_cpu().inherit(true);
                mb.build_with_group(&mut leader).map(drop)
            });
            if let Err(e) = ok {
                tracing::info!(
                    "perf: inherited counter groups refused ({e}; kernels before 4.13 do): \
                     reading each event on its own"
                );
                self.grouped = false;
            }
        }
    }

    fn disable(&mut self, event: PerfEvent, why: String) {
        let slot = &mut self.disabled[event.index()];
        if slot.is_none() {
            // The caller says it once for all events (one log line per missing feature).
            tracing::debug!("perf: {event} disabled: {why}; the metrics using it are unavailable");
            *slot = Some(why);
        }
    }

    fn enabled_events(&self) -> impl Iterator<Item = PerfEvent> + '_ {
        PerfEvent::ALL
            .into_iter()
            .filter(|e| self.disabled[e.index()].is_none())
    }

    /// The settings every counter shares; `group` adds the group read format.
    fn builder(&self, event: PerfEvent, group: bool) -> Builder<'static> {
        let mut b = match self.settings.source {
            EventSource::Hardware => Builder::new(event.hardware()),
            EventSource::Software => Builder::new(event.software_stand_in()),
        };
        let mut format = ReadFormat::TOTAL_TIME_ENABLED | ReadFormat::TOTAL_TIME_RUNNING;
        if group {
            format |= ReadFormat::GROUP | ReadFormat::ID;
        }
        b.read_format(format)
            .enabled(false)
            .exclude_kernel(!self.settings.include_kernel)
            .exclude_hv(true);
        b
    }

    /// The fds a target would take now with the events this host counts.
    pub fn fds_for(&mut self, target: &PerfTarget) -> Result<usize, PerfError> {
        let units = match target {
            PerfTarget::Processes(pids) => self.threads_of(pids)?.len(),
            PerfTarget::Cgroup { cpus, .. } => cpus.len(),
        };
        Ok(FdBudget::fds_for(units, self.enabled_events().count()))
    }

    fn threads_of(&mut self, pids: &[u32]) -> Result<Vec<u32>, PerfError> {
        let mut tids = Vec::new();
        for &pid in pids {
            self.procs.threads(pid, &mut tids)?;
        }
        tids.sort_unstable();
        tids.dedup();
        Ok(tids)
    }

    /// Opens one group on a thread (`pid` = tid, inherit) or a CPU of a cgroup.
    fn open_group(
        &self,
        events: &[PerfEvent],
        tid: Option<u32>,
        cgroup: Option<(&File, u32)>,
        target: &PerfTarget,
    ) -> Result<EventGroup, OpenFailure> {
        let mut counters: Vec<(PerfEvent, Counter)> = Vec::with_capacity(events.len());
        for &event in events {
            let mut b = self.builder(event, self.grouped);
            match (tid, cgroup) {
                (Some(tid), _) => {
                    let pid = i32::try_from(tid).map_err(|_| OpenFailure::Gone)?;
                    b.observe_pid(pid).any_cpu().inherit(true);
                }
                (None, Some((file, cpu))) => {
                    let cpu = usize::try_from(cpu).unwrap_or(usize::MAX);
                    b.observe_cgroup(file).one_cpu(cpu);
                }
                (None, None) => return Err(OpenFailure::Gone),
            }
            let opened = match counters.first_mut() {
                Some((_, leader)) if self.grouped => b.build_with_group(leader),
                _ => b.build(),
            };
            match opened {
                Ok(c) => counters.push((event, c)),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(OpenFailure::Gone),
                // A CPU that went offline since the target was made.
                Err(e) if cgroup.is_some() && e.raw_os_error() == Some(libc::ENODEV) => {
                    return Err(OpenFailure::Gone)
                }
                // Events were probed at start, so ENOENT here is about the target: the kernel
                // answers it for a directory outside the perf_event hierarchy.
                Err(source) if cgroup.is_some() && is_unsupported(&source) => {
                    let path = match target {
                        PerfTarget::Cgroup { dir, .. } => dir.clone(),
                        PerfTarget::Processes(_) => PathBuf::new(),
                    };
                    return Err(OpenFailure::Fatal(PerfError::NotPerfCgroup {
                        path,
                        source,
                    }));
                }
                Err(source) if is_permission(&source) => {
                    let hint = self
                        .access
                        .problems(self.settings.include_kernel)
                        .join("; ");
                    let hint = if hint.is_empty() {
                        "the target may belong to another user and lodgerd lacks ptrace access to it"
                            .to_string()
                    } else {
                        hint
                    };
                    return Err(OpenFailure::Fatal(PerfError::Permission {
                        event,
                        target: target.to_string(),
                        source,
                        hint,
                    }));
                }
                Err(source) => {
                    return Err(OpenFailure::Fatal(PerfError::Open {
                        event,
                        target: target.to_string(),
                        source,
                    }))
                }
            }
        }
        let enable = |c: &mut Counter| {
            if self.grouped {
                c.enable_group()
            } else {
                c.enable()
            }
        };
        let enabled = if self.grouped {
            counters.first_mut().map_or(Ok(()), |(_, c)| enable(c))
        } else {
            counters.iter_mut().try_for_each(|(_, c)| enable(c))
        };
        match enabled {
            Ok(()) => Ok(EventGroup {
                counters,
                last: [None; 4],
            }),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(OpenFailure::Gone),
            Err(source) => Err(OpenFailure::Fatal(PerfError::Enable {
                target: target.to_string(),
                source,
            })),
        }
    }

    /// One attempt with the events enabled now.
    fn try_attach(
        &mut self,
        job: &JobId,
        target: &PerfTarget,
    ) -> Result<Vec<EventGroup>, OpenFailure> {
        let events: Vec<PerfEvent> = self.enabled_events().collect();
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let mut groups = Vec::new();
        match target {
            PerfTarget::Processes(pids) => {
                let tids = self.threads_of(pids).map_err(OpenFailure::Fatal)?;
                self.check_budget(job, target, tids.len(), events.len())?;
                for tid in tids {
                    match self.open_group(&events, Some(tid), None, target) {
                        Ok(g) => groups.push(g),
                        Err(OpenFailure::Gone) => continue,
                        Err(other) => return Err(other),
                    }
                }
                if groups.is_empty() {
                    return Err(OpenFailure::Fatal(PerfError::TargetGone {
                        job: job.clone(),
                        target: target.to_string(),
                    }));
                }
            }
            PerfTarget::Cgroup { dir, cpus } => {
                self.check_budget(job, target, cpus.len(), events.len())?;
                let file = File::open(dir).map_err(|source| {
                    OpenFailure::Fatal(PerfError::Cgroup {
                        path: dir.clone(),
                        source,
                    })
                })?;
                for cpu in cpus.iter() {
                    match self.open_group(&events, None, Some((&file, cpu)), target) {
                        Ok(g) => groups.push(g),
                        // An offline CPU: nothing runs there to count.
                        Err(OpenFailure::Gone) => continue,
                        Err(other) => return Err(other),
                    }
                }
            }
        }
        Ok(groups)
    }

    fn check_budget(
        &self,
        job: &JobId,
        target: &PerfTarget,
        units: usize,
        events: usize,
    ) -> Result<(), OpenFailure> {
        let needed = FdBudget::fds_for(units, events);
        // The job's current fds are released by the attach that replaces them.
        let held = self.jobs.get(job).map_or(0, |j| j.fds);
        let available = self.budget.available().saturating_add(held);
        if needed > available {
            return Err(OpenFailure::Fatal(PerfError::FdBudget {
                job: job.clone(),
                target: target.to_string(),
                needed,
                available,
                cap: self.budget.cap,
            }));
        }
        Ok(())
    }

    fn read_group(&self, g: &mut EventGroup) -> bool {
        let mut now: [Option<RawCount>; 4] = [None; 4];
        let ok = if self.grouped {
            match g.counters.first_mut() {
                Some((_, leader)) => match leader.read_group() {
                    Ok(data) => {
                        let (te, tr) = (nanos(data.time_enabled()), nanos(data.time_running()));
                        for (event, c) in &g.counters {
                            if let Some(entry) = data.get(c) {
                                now[event.index()] = Some(RawCount {
                                    value: entry.value(),
                                    time_enabled_ns: te,
                                    time_running_ns: tr,
                                });
                            }
                        }
                        true
                    }
                    Err(_) => false,
                },
                None => true,
            }
        } else {
            let mut all = true;
            for (event, c) in g.counters.iter_mut() {
                match c.read_full() {
                    Ok(d) => {
                        now[event.index()] = Some(RawCount {
                            value: d.count(),
                            time_enabled_ns: nanos(d.time_enabled()),
                            time_running_ns: nanos(d.time_running()),
                        })
                    }
                    Err(_) => all = false,
                }
            }
            all
        };
        for (slot, value) in g.last.iter_mut().zip(now) {
            if value.is_some() {
                *slot = value;
            }
        }
        ok
    }

    pub fn settings(&self) -> &PerfSettings {
        &self.settings
    }

    pub fn budget(&self) -> FdBudget {
        self.budget
    }
}

impl Counters for PerfCounters {
    fn attach(&mut self, job: &JobId, target: &PerfTarget) -> Result<Attached, PerfError> {
        let groups = match self.try_attach(job, target) {
            Ok(groups) => groups,
            Err(OpenFailure::Gone) => {
                return Err(PerfError::TargetGone {
                    job: job.clone(),
                    target: target.to_string(),
                })
            }
            Err(OpenFailure::Fatal(e)) => return Err(e),
        };
        self.detach(job);
        let fds: usize = groups.iter().map(|g| g.counters.len()).sum();
        let generation = self.next_generation;
        self.next_generation += 1;
        self.budget.used = self.budget.used.saturating_add(fds);
        let attached = Attached {
            groups: u32::try_from(groups.len()).unwrap_or(u32::MAX),
            fds: u32::try_from(fds).unwrap_or(u32::MAX),
            generation,
        };
        self.jobs.insert(
            job.clone(),
            JobCounters {
                groups,
                generation,
                fds,
            },
        );
        Ok(attached)
    }

    fn detach(&mut self, job: &JobId) -> bool {
        match self.jobs.remove(job) {
            Some(j) => {
                self.budget.used = self.budget.used.saturating_sub(j.fds);
                true
            }
            None => false,
        }
    }

    fn read(&mut self) -> Vec<(JobId, PerfSample)> {
        let mut jobs = std::mem::take(&mut self.jobs);
        let mut out = Vec::with_capacity(jobs.len());
        for (id, j) in jobs.iter_mut() {
            let at = Instant::now();
            let mut read_errors = 0u32;
            for g in j.groups.iter_mut() {
                if !self.read_group(g) {
                    read_errors = read_errors.saturating_add(1);
                }
            }
            let mut counts: [Option<RawCount>; 4] = [None; 4];
            for e in self.enabled_events() {
                let i = e.index();
                counts[i] = j
                    .groups
                    .iter()
                    .map(|g| g.last[i].unwrap_or_default())
                    .reduce(RawCount::saturating_add)
                    .or(Some(RawCount::default()));
            }
            if read_errors > 0 {
                tracing::debug!("perf: job {id}: {read_errors} counter group reads failed");
            }
            out.push((
                id.clone(),
                PerfSample {
                    at,
                    generation: j.generation,
                    counts,
                    groups: u32::try_from(j.groups.len()).unwrap_or(u32::MAX),
                    fds: u32::try_from(j.fds).unwrap_or(u32::MAX),
                    read_errors,
                },
            ));
        }
        self.jobs = jobs;
        out.sort_by_key(|a| a.0.seq());
        out
    }

    fn status(&self) -> PerfStatus {
        PerfStatus {
            access: self.access,
            problems: self.access.problems(self.settings.include_kernel),
            events: PerfEvent::ALL
                .iter()
                .map(|&event| EventStatus {
                    event,
                    unavailable: self.disabled[event.index()].clone(),
                })
                .collect(),
            grouped: self.grouped,
            software: self.settings.source == EventSource::Software,
            budget: self.budget,
            jobs: self.jobs.len(),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(value: u64, enabled: u64, running: u64) -> RawCount {
        RawCount {
            value,
            time_enabled_ns: enabled,
            time_running_ns: running,
        }
    }

    fn sample(at: Instant, generation: u64, counts: [Option<RawCount>; 4]) -> PerfSample {
        PerfSample {
            at,
            generation,
            counts,
            groups: 1,
            fds: 4,
            read_errors: 0,
        }
    }

    #[test]
    fn scaling_for_multiplexing() {
        // On the PMU the whole window: the raw delta.
        assert_eq!(
            scaled_delta(raw(100, 1000, 1000), raw(300, 2000, 2000)),
            Some(200.0)
        );
        // On the PMU half of the window: twice the raw delta.
        assert_eq!(
            scaled_delta(raw(100, 1000, 1000), raw(200, 2000, 1500)),
            Some(200.0)
        );
        // Scaled by the window, not by the history: cumulative scaling would give
        // 200 × 2000/1500 − 100 ≈ 166.7 here.
        assert_eq!(
            scaled_delta(raw(100, 1000, 1000), raw(200, 2000, 1500)),
            Some(200.0)
        );
        // Enabled but never on the PMU in the window: unknown.
        assert_eq!(scaled_delta(raw(100, 1000, 500), raw(100, 2000, 500)), None);
        // Neither time moved (the task did not run, or the root cgroup): raw delta.
        assert_eq!(
            scaled_delta(raw(100, 1000, 500), raw(100, 1000, 500)),
            Some(0.0)
        );
        assert_eq!(scaled_delta(raw(0, 0, 0), raw(42, 0, 0)), Some(42.0));
        // running > enabled cannot happen; never scale below the raw count.
        assert_eq!(scaled_delta(raw(0, 0, 0), raw(10, 5, 8)), Some(10.0));
        // Huge values do not overflow.
        let big = u64::MAX / 2;
        let d = scaled_delta(raw(0, 0, 0), raw(big, big, 1)).expect("scaled");
        assert!(d.is_finite() && d > 1e30);
    }

    #[test]
    fn counter_reset_or_wrap_is_dropped() {
        assert_eq!(
            scaled_delta(raw(500, 1000, 1000), raw(100, 2000, 2000)),
            None
        );
        assert_eq!(
            scaled_delta(raw(500, 3000, 1000), raw(600, 2000, 2000)),
            None
        );
        assert_eq!(
            scaled_delta(raw(500, 1000, 3000), raw(600, 2000, 2000)),
            None
        );
        let at = Instant::now();
        let s = Duration::from_secs(1);
        let all = |v| [Some(raw(v, v, v)); 4];
        // Reopened counters (a new generation) start from zero: no window across them.
        assert!(
            PerfRates::between(&sample(at, 1, all(1000)), &sample(at + s, 2, all(10))).is_none()
        );
        // Out of order or the same instant: no window.
        assert!(PerfRates::between(&sample(at + s, 1, all(0)), &sample(at, 1, all(10))).is_none());
        assert!(PerfRates::between(&sample(at, 1, all(0)), &sample(at, 1, all(10))).is_none());
        // Same generation but a counter went back: that metric is unknown, not negative.
        let r = PerfRates::between(&sample(at, 1, all(1000)), &sample(at + s, 1, all(10)))
            .expect("window");
        assert_eq!(r.instructions, None);
        assert_eq!(r.ipc, None);
    }

    #[test]
    fn ipc_and_miss_ratio() {
        let at = Instant::now();
        let prev = sample(
            at,
            3,
            [
                Some(raw(1_000, 100, 100)),
                Some(raw(1_000, 100, 100)),
                Some(raw(100, 100, 100)),
                Some(raw(10, 100, 100)),
            ],
        );
        // Grouped counters share times; the group ran half the window.
        let cur = sample(
            at + Duration::from_millis(500),
            3,
            [
                Some(raw(3_001_000, 1100, 600)),
                Some(raw(1_001_000, 1100, 600)),
                Some(raw(10_100, 1100, 600)),
                Some(raw(2_010, 1100, 600)),
            ],
        );
        let r = PerfRates::between(&prev, &cur).expect("window");
        assert_eq!(r.window, Duration::from_millis(500));
        assert_eq!(r.instructions, Some(6_000_000.0));
        assert_eq!(r.cycles, Some(2_000_000.0));
        assert_eq!(r.ipc, Some(3.0));
        assert_eq!(r.cache_miss_ratio, Some(0.2));
        assert_eq!(r.mpki, Some(4_000.0 * 1000.0 / 6_000_000.0));
        assert_eq!(r.running_fraction, Some(0.5));
        assert_eq!(r.per_second(r.instructions), Some(12_000_000.0));
    }

    #[test]
    fn zero_deltas_and_missing_events_are_none_not_nan() {
        let at = Instant::now();
        let idle = [Some(raw(7, 0, 0)); 4];
        let r = PerfRates::between(
            &sample(at, 1, idle),
            &sample(at + Duration::from_secs(1), 1, idle),
        )
        .expect("window");
        assert_eq!(r.instructions, Some(0.0));
        assert_eq!(r.ipc, None, "0/0");
        assert_eq!(r.cache_miss_ratio, None, "0/0");
        assert_eq!(r.mpki, None);
        assert_eq!(r.running_fraction, None);
        // A PMU without cache events: only the cache metrics go.
        let prev = [Some(raw(0, 0, 0)), Some(raw(0, 0, 0)), None, None];
        let cur = [Some(raw(300, 10, 10)), Some(raw(100, 10, 10)), None, None];
        let r = PerfRates::between(
            &sample(at, 1, prev),
            &sample(at + Duration::from_secs(1), 1, cur),
        )
        .expect("window");
        assert_eq!(r.ipc, Some(3.0));
        assert_eq!(r.cache_miss_ratio, None);
        assert_eq!(r.cache_references, None);
        // Nothing countable at all.
        let r = PerfRates::between(
            &sample(at, 1, [None; 4]),
            &sample(at + Duration::from_secs(1), 1, [None; 4]),
        )
        .expect("window");
        assert_eq!(r.ipc, None);
        assert_eq!(r.per_second(None), None);
        let json = serde_json::to_value(r).expect("serializes");
        assert!(json["ipc"].is_null());
    }

    #[test]
    fn fd_budget() {
        // A 192-CPU host counting a job by cgroup: 4 events × 192 CPUs.
        assert_eq!(FdBudget::fds_for(192, 4), 768);
        assert_eq!(FdBudget::fds_for(usize::MAX, 4), usize::MAX);
        // systemd's default soft limit keeps half for everything else.
        assert_eq!(FdBudget::for_limit(Some(1024)).cap, 512);
        // A raised limit keeps FD_RESERVE.
        assert_eq!(
            FdBudget::for_limit(Some(1_048_576)).cap,
            1_048_576 - FD_RESERVE
        );
        assert!(FdBudget::for_limit(None).cap > 1 << 40);
        let b = FdBudget {
            cap: 1000,
            used: 800,
        };
        assert_eq!(b.available(), 200);
        let over = FdBudget { cap: 10, used: 20 };
        assert_eq!(over.available(), 0);
    }

    #[test]
    fn limits_and_capabilities_parse() {
        let limits =
            "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max open files            20000                524288               files     \n";
        assert_eq!(parse_nofile_soft(limits), Some(Some(20000)));
        assert_eq!(
            parse_nofile_soft(
                "Max open files            unlimited            unlimited            files\n"
            ),
            Some(None)
        );
        assert_eq!(parse_nofile_soft("Max cpu time 1 1 seconds\n"), None);
        assert_eq!(parse_nofile_soft("Max open files x y files\n"), None);
        assert_eq!(
            parse_cap_eff("Name:\tx\nCapEff:\t000001fffeffffff\n"),
            Some(0x1fffeffffff)
        );
        assert_eq!(parse_cap_eff("CapEff:\tzz\n"), None);
        assert_eq!(parse_cap_eff("Name:\tx\n"), None);
    }

    fn proc_fixture(paranoid: Option<&str>, cap_eff: &str, limits: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("sys/kernel")).expect("mkdir");
        std::fs::create_dir_all(dir.path().join("self")).expect("mkdir");
        if let Some(p) = paranoid {
            std::fs::write(dir.path().join(PARANOID_FILE), p).expect("write");
        }
        std::fs::write(
            dir.path().join(SELF_STATUS),
            format!("Name:\tlodgerd\nCapEff:\t{cap_eff}\n"),
        )
        .expect("write");
        std::fs::write(dir.path().join(SELF_LIMITS), limits).expect("write");
        dir
    }

    #[test]
    fn access_rules_and_advice() {
        let root = proc_fixture(Some("2\n"), "0000000000000000", "");
        let a = PerfAccess::read(root.path()).expect("reads");
        assert_eq!(a.paranoid, Some(2));
        assert!(a.can_count_processes());
        assert!(!a.can_count_other_users());
        assert!(!a.can_count_cgroups());
        assert!(!a.can_count_kernel());
        let problems = a.problems(true);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].contains("CAP_PERFMON"), "{problems:?}");
        assert!(
            problems[0].contains("kernel.perf_event_paranoid=0"),
            "{problems:?}"
        );

        // Root's full set: everything.
        let root = proc_fixture(Some("4"), "000001ffffffffff", "");
        let a = PerfAccess::read(root.path()).expect("reads");
        assert!(a.privileged() && a.can_count_cgroups() && a.can_count_other_users());
        assert!(a.problems(true).is_empty());

        // Debian's paranoid 3 without capabilities: nothing.
        let root = proc_fixture(Some("3"), "0", "");
        let a = PerfAccess::read(root.path()).expect("reads");
        assert!(!a.can_count_processes());
        assert_eq!(a.problems(false).len(), 1);
        assert!(a.problems(false)[0].contains("AmbientCapabilities"));

        // CAP_PERFMON alone (bit 38), as the packaged unit has it: lifts paranoid and, since
        // perf_check_permission takes it in place of ptrace access, other users' processes.
        let root = proc_fixture(Some("2"), &format!("{:x}", 1u64 << 38), "");
        let a = PerfAccess::read(root.path()).expect("reads");
        assert!(a.can_count_cgroups() && a.can_count_other_users());
        assert!(a.problems(true).is_empty(), "{:?}", a.problems(true));
        // CAP_SYS_PTRACE alone (bit 19): other users' processes, but paranoid still applies.
        let root = proc_fixture(Some("2"), &format!("{:x}", 1u64 << 19), "");
        let a = PerfAccess::read(root.path()).expect("reads");
        assert!(a.can_count_other_users() && !a.can_count_cgroups());

        // A kernel without perf events.
        let root = proc_fixture(None, "0", "");
        let a = PerfAccess::read(root.path()).expect("reads");
        assert_eq!(a.paranoid, None);
        assert!(!a.can_count_processes());
        assert!(a.problems(false)[0].contains("CONFIG_PERF_EVENTS"));

        // Garbage, empty and missing files name the file.
        for bad in ["", "two"] {
            let root = proc_fixture(Some(bad), "0", "");
            match PerfAccess::read(root.path()) {
                Err(PerfError::Parse { path, .. }) => assert!(path.ends_with(PARANOID_FILE)),
                other => panic!("{other:?}"),
            }
        }
        let root = proc_fixture(Some("2"), "xyz", "");
        assert!(matches!(
            PerfAccess::read(root.path()),
            Err(PerfError::Parse { .. })
        ));
        let empty = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(empty.path().join("sys/kernel")).expect("mkdir");
        std::fs::write(empty.path().join(PARANOID_FILE), "2").expect("write");
        match PerfAccess::read(empty.path()) {
            Err(PerfError::Read { path, .. }) => assert!(path.ends_with(SELF_STATUS)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn budget_from_proc_limits() {
        let root = proc_fixture(
            Some("2"),
            "0",
            "Max open files            1024                 524288               files\n",
        );
        assert_eq!(FdBudget::from_proc(root.path()).expect("reads").cap, 512);
        let root = proc_fixture(Some("2"), "0", "");
        assert!(matches!(
            FdBudget::from_proc(root.path()),
            Err(PerfError::Parse { .. })
        ));
        assert!(
            FdBudget::from_proc(Path::new("/proc"))
                .expect("own limits")
                .cap
                > 0
        );
    }

    #[test]
    fn finds_the_perf_event_hierarchy() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(perf_cgroup_root(dir.path()), None);
        // Hybrid: v2 under unified/.
        std::fs::create_dir_all(dir.path().join("unified")).expect("mkdir");
        std::fs::write(dir.path().join("unified/cgroup.controllers"), "").expect("write");
        assert_eq!(
            perf_cgroup_root(dir.path()),
            Some(dir.path().join("unified"))
        );
        // Pure v2.
        std::fs::write(dir.path().join("cgroup.controllers"), "cpuset cpu").expect("write");
        assert_eq!(perf_cgroup_root(dir.path()), Some(dir.path().to_path_buf()));
        // A v1 perf_event mount takes the controller away from v2.
        std::fs::create_dir_all(dir.path().join("perf_event")).expect("mkdir");
        std::fs::write(dir.path().join("perf_event/cgroup.procs"), "").expect("write");
        assert_eq!(
            perf_cgroup_root(dir.path()),
            Some(dir.path().join("perf_event"))
        );
    }

    #[test]
    fn scripted_counters_record_and_replay() {
        let mut c = ScriptedCounters::default();
        let j = JobId::from_seq(1);
        let s = sample(Instant::now(), 1, [None; 4]);
        c.samples.insert(j.clone(), s.clone());
        assert!(c.read().is_empty(), "not attached");
        c.attach(&j, &PerfTarget::Processes(vec![1]))
            .expect("attach");
        assert_eq!(c.read(), vec![(j.clone(), s)]);
        assert!(c.detach(&j));
        assert!(!c.detach(&j));
    }

    fn software_counters(grouping: Grouping) -> Option<PerfCounters> {
        let mut settings = PerfSettings::new(Path::new("/proc"));
        settings.source = EventSource::Software;
        settings.grouping = grouping;
        let c = PerfCounters::new(settings).expect("probe");
        if !c.status().available() {
            crate::privileged::skip(
                "perf software counters",
                "perf_event_open refuses even software events here",
            );
            return None;
        }
        Some(c)
    }

    /// Counts this test's own threads with software events (present on every kernel with perf),
    /// grouped and ungrouped: task-clock must follow the CPU burned, including by a thread
    /// started after attaching (inherit).
    #[test]
    fn counts_own_threads_with_inherit() {
        for grouping in [Grouping::Auto, Grouping::Ungrouped] {
            let Some(mut c) = software_counters(grouping) else {
                return;
            };
            let job = JobId::from_seq(7);
            // A helper thread that exists before attaching and spins until told to stop.
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let s2 = stop.clone();
            let early = std::thread::spawn(move || {
                let mut x = 0u64;
                while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            });
            let attached = c
                .attach(&job, &PerfTarget::Processes(vec![std::process::id()]))
                .expect("attach");
            assert!(attached.groups >= 2, "{attached:?}");
            assert_eq!(attached.fds, attached.groups * 4);
            assert_eq!(c.budget().used, usize::try_from(attached.fds).expect("fds"));
            let first = c.read();
            assert_eq!(first.len(), 1);
            // A thread started after attaching: counted through inherit.
            // It burns 300 ms of its own CPU time (not wall time: on a loaded machine it may
            // get less than the whole CPU).
            let late = std::thread::spawn(|| {
                let cpu_ns = || {
                    let mut ts = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    };
                    // SAFETY: `ts` is a valid, writable timespec.
                    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
                };
                let until = cpu_ns() + 300_000_000;
                let mut x = 0u64;
                while cpu_ns() < until {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            });
            late.join().expect("late thread");
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            early.join().expect("early thread");
            let second = c.read();
            let r = PerfRates::between(&first[0].1, &second[0].1).expect("window");
            // task-clock in ns, in the Instructions slot: the late thread alone burned 300 ms.
            let task_ns = r.instructions.expect("task-clock");
            assert!(task_ns >= 250e6, "{grouping:?}: task-clock {task_ns} ns");
            assert_eq!(c.status().grouped, grouping == Grouping::Auto);
            assert!(c.detach(&job));
            assert_eq!(c.budget().used, 0);
            assert!(c.read().is_empty());
        }
    }

    #[test]
    fn budget_refuses_and_gone_targets_fail_cleanly() {
        let Some(mut c) = software_counters(Grouping::Auto) else {
            return;
        };
        c.budget.cap = 3;
        let job = JobId::from_seq(1);
        match c.attach(&job, &PerfTarget::Processes(vec![std::process::id()])) {
            Err(PerfError::FdBudget { needed, cap: 3, .. }) => assert!(needed >= 4),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.budget().used, 0);
        c.budget.cap = 1 << 20;
        // pid_max is never a pid.
        match c.attach(&job, &PerfTarget::Processes(vec![4_194_304])) {
            Err(PerfError::TargetGone { .. }) => {}
            other => panic!("{other:?}"),
        }
        // A directory that is not a cgroup of the perf_event hierarchy.
        let dir = tempfile::tempdir().expect("tempdir");
        let target = PerfTarget::Cgroup {
            dir: dir.path().to_path_buf(),
            cpus: CpuSet::parse("0").expect("cpus"),
        };
        assert!(c.attach(&job, &target).is_err());
        assert_eq!(c.budget().used, 0);
        assert!(c.read().is_empty());
    }

    #[test]
    fn perf_counters_are_send() {
        fn send<T: Send>() {}
        send::<PerfCounters>();
        send::<Box<dyn Counters>>();
    }
}
