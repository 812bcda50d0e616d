//! CPU sensing: per-CPU utilization from `/proc/stat`, per-job CPU time (its processes' CPU-time
//! clocks, with start times from `/proc/PID/stat`: [`clocks`]; or its cgroup's `cpuacct.usage` on v1 / `cpu.stat` `usage_usec`
//! on v2) and run-queue pressure from PSI (`/proc/pressure/cpu`, and `cpu.pressure` of a cgroup
//! where the kernel has it). Reads the proc and cgroup roots it is given, nothing else.
//!
//! Parsed by hand rather than with the procfs crate: its `KernelStats` keeps per-CPU times as a
//! list without the CPU number (wrong as soon as a CPU is offline), its `CpuPressure` requires the
//! `full` line that kernels before 5.13 do not write for cpu, and `/proc/PID/stat` is read for
//! every process of every job each tick, where a reused buffer beats a fifty-field struct (the
//! reasoning of `sys::procfs`). The crate is used for `ticks_per_second`.
//!
//! Samples are raw monotonic counters with the instant they were taken; rates are pure functions
//! of two samples.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::sys::cgroupfs::CgroupVersion;
use crate::sys::procfs::KeptFile;

pub mod clocks;

/// Relative to the proc root.
pub const PROC_STAT: &str = "stat";
pub const PROC_PRESSURE_CPU: &str = "pressure/cpu";
/// Memory pressure (issue 19: contention): tasks stalled on reclaim, refaults or swap-in.
pub const PROC_PRESSURE_MEMORY: &str = "pressure/memory";
/// The v1 hierarchy holding `cpuacct.usage`, relative to the cgroup root (a symlink to
/// `cpu,cpuacct` where the two are co-mounted).
pub const V1_CPUACCT_DIR: &str = "cpuacct";
pub const CPUACCT_USAGE: &str = "cpuacct.usage";
pub const CPU_STAT: &str = "cpu.stat";
pub const CPU_STAT_USAGE: &str = "usage_usec";
pub const CPU_PRESSURE: &str = "cpu.pressure";
pub const MEMORY_PRESSURE: &str = "memory.pressure";

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} is empty")]
    Empty { path: PathBuf },
    #[error("unexpected content in {path}: {value:?}")]
    Parse { path: PathBuf, value: String },
    #[error("cgroup path {0:?} is not a path inside the hierarchy")]
    BadCgroup(String),
}

impl CpuError {
    /// The file does not exist (a cgroup that is gone, or absent from this hierarchy).
    pub fn is_not_found(&self) -> bool {
        matches!(self, CpuError::Read { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

// ---------------------------------------------------------------------------------------------
// /proc/stat

/// One `cpu` line of `/proc/stat`, in clock ticks. `guest` and `guest_nice` are left out: the
/// kernel already counts them in `user` and `nice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CpuTimes {
    pub user: u64,
    pub nice: u64,
    pub system: u64,
    pub idle: u64,
    pub iowait: u64,
    pub irq: u64,
    pub softirq: u64,
    pub steal: u64,
}

impl CpuTimes {
    /// Time spent running something.
    pub fn busy(&self) -> u64 {
        [self.user, self.nice, self.system, self.irq, self.softirq]
            .into_iter()
            .fold(0u64, u64::saturating_add)
    }

    pub fn total(&self) -> u64 {
        [self.busy(), self.idle, self.iowait, self.steal]
            .into_iter()
            .fold(0u64, u64::saturating_add)
    }

    /// Field-wise delta. Saturating: `iowait` and `idle` can step backwards on NO_HZ kernels, and
    /// a field that does must not make the window negative.
    fn delta(&self, prev: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(prev.user),
            nice: self.nice.saturating_sub(prev.nice),
            system: self.system.saturating_sub(prev.system),
            idle: self.idle.saturating_sub(prev.idle),
            iowait: self.iowait.saturating_sub(prev.iowait),
            irq: self.irq.saturating_sub(prev.irq),
            softirq: self.softirq.saturating_sub(prev.softirq),
            steal: self.steal.saturating_sub(prev.steal),
        }
    }
}

/// `/proc/stat` at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct StatSample {
    pub at: Instant,
    /// The aggregate `cpu` line.
    pub all: CpuTimes,
    /// `cpuN` lines by CPU number; offline CPUs are absent.
    pub cpus: Vec<(u32, CpuTimes)>,
    /// Tasks runnable right now (the run queue, node-wide).
    pub procs_running: Option<u32>,
}

/// The parts of `/proc/stat` lodger uses, as a sample taken at `at`; `Err` holds the offending
/// line.
pub fn parse_proc_stat(text: &str, at: Instant) -> Result<StatSample, String> {
    let mut all = None;
    let mut cpus = Vec::new();
    let mut procs_running = None;
    for line in text.lines() {
        let mut words = line.split_ascii_whitespace();
        let Some(key) = words.next() else { continue };
        if let Some(id) = key.strip_prefix("cpu") {
            let mut fields = [0u64; 8];
            let mut n = 0;
            for (slot, w) in fields.iter_mut().zip(words) {
                *slot = w.parse().map_err(|_| line.to_string())?;
                n += 1;
            }
            // user nice system idle are in every kernel since 2.4; the rest came later.
            if n < 4 {
                return Err(line.to_string());
            }
            let [user, nice, system, idle, iowait, irq, softirq, steal] = fields;
            let times = CpuTimes {
                user,
                nice,
                system,
                idle,
                iowait,
                irq,
                softirq,
                steal,
            };
            if id.is_empty() {
                all = Some(times);
            } else {
                let id: u32 = id.parse().map_err(|_| line.to_string())?;
                cpus.push((id, times));
            }
        } else if key == "procs_running" {
            procs_running = words.next().and_then(|w| w.parse().ok());
        }
    }
    let all = all.ok_or_else(|| "no aggregate 'cpu' line".to_string())?;
    cpus.sort_unstable_by_key(|&(id, _)| id);
    Ok(StatSample {
        at,
        all,
        cpus,
        procs_running,
    })
}

/// Where a CPU's (or all CPUs') time went over a window, as fractions of it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct CpuUtil {
    /// user + nice + system + irq + softirq.
    pub busy: f64,
    pub user: f64,
    pub system: f64,
    pub iowait: f64,
    /// Taken by the hypervisor: a VM's CPU that was not there to use.
    pub steal: f64,
}

/// The utilization between two readings of one CPU; `None` when no tick elapsed.
pub fn utilization(prev: &CpuTimes, cur: &CpuTimes) -> Option<CpuUtil> {
    let d = cur.delta(prev);
    let total = d.total();
    if total == 0 {
        return None;
    }
    let frac = |x: u64| ticks_f64(x) / ticks_f64(total);
    Some(CpuUtil {
        busy: frac(d.busy()),
        user: frac(d.user.saturating_add(d.nice)),
        system: frac(d.system.saturating_add(d.irq).saturating_add(d.softirq)),
        iowait: frac(d.iowait),
        steal: frac(d.steal),
    })
}

/// u64 → f64 for tick and time counts: exact below 2^53.
fn ticks_f64(x: u64) -> f64 {
    x as f64
}

/// Node CPU use over a window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeCpuRates {
    pub window: Duration,
    pub all: Option<CpuUtil>,
    /// CPUs present in both samples (a CPU that went offline or came online is left out).
    pub cpus: Vec<(u32, Option<CpuUtil>)>,
    /// Run queue length at the second sample.
    pub procs_running: Option<u32>,
}

impl NodeCpuRates {
    /// `None` when the samples are not in time order.
    pub fn between(prev: &StatSample, cur: &StatSample) -> Option<NodeCpuRates> {
        if cur.at <= prev.at {
            return None;
        }
        let cpus = cur
            .cpus
            .iter()
            .filter_map(|(id, c)| {
                let i = prev.cpus.binary_search_by_key(id, |&(p, _)| p).ok()?;
                let (_, p) = prev.cpus.get(i)?;
                Some((*id, utilization(p, c)))
            })
            .collect();
        Some(NodeCpuRates {
            window: cur.at.duration_since(prev.at),
            all: utilization(&prev.all, &cur.all),
            cpus,
            procs_running: cur.procs_running,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// PSI

/// One line of a PSI file: the kernel's running averages (percent) and the total stall time.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PsiLine {
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    pub total_us: u64,
}

/// `/proc/pressure/cpu` or a cgroup's `cpu.pressure`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Pressure {
    /// Some runnable task waited for a CPU.
    pub some: PsiLine,
    /// Every non-idle task waited at once; absent before 5.13 (and always 0 node-wide).
    pub full: Option<PsiLine>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PressureSample {
    pub at: Instant,
    pub pressure: Pressure,
}

fn parse_psi_line(rest: &str) -> Option<PsiLine> {
    let mut line = PsiLine::default();
    let mut seen = 0u8;
    for kv in rest.split_ascii_whitespace() {
        let (k, v) = kv.split_once('=')?;
        match k {
            "avg10" => line.avg10 = v.parse().ok()?,
            "avg60" => line.avg60 = v.parse().ok()?,
            "avg300" => line.avg300 = v.parse().ok()?,
            "total" => line.total_us = v.parse().ok()?,
            _ => continue,
        }
        seen += 1;
    }
    (seen == 4).then_some(line)
}

/// Parses a PSI file; `Err` holds the offending line.
pub fn parse_pressure(text: &str) -> Result<Pressure, String> {
    let mut some = None;
    let mut full = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (kind, rest) = line.split_once(' ').ok_or_else(|| line.to_string())?;
        let parsed = parse_psi_line(rest).ok_or_else(|| line.to_string())?;
        match kind {
            "some" => some = Some(parsed),
            "full" => full = Some(parsed),
            _ => return Err(line.to_string()),
        }
    }
    let some = some.ok_or_else(|| "no 'some' line".to_string())?;
    Ok(Pressure { some, full })
}

/// Fraction of a window in which tasks waited for a CPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StallRates {
    pub window: Duration,
    pub some: f64,
    pub full: Option<f64>,
}

impl StallRates {
    /// `None` when the samples are out of order or the total went backwards (the cgroup was
    /// recreated).
    pub fn between(prev: &PressureSample, cur: &PressureSample) -> Option<StallRates> {
        if cur.at <= prev.at {
            return None;
        }
        let window = cur.at.duration_since(prev.at);
        let window_us = window.as_secs_f64() * 1e6;
        let frac = |p: &PsiLine, c: &PsiLine| {
            let d = c.total_us.checked_sub(p.total_us)?;
            // Clamped: the kernel's clock and ours differ by the read latency.
            Some((ticks_f64(d) / window_us).min(1.0))
        };
        let some = frac(&prev.pressure.some, &cur.pressure.some)?;
        let full = match (&prev.pressure.full, &cur.pressure.full) {
            (Some(p), Some(c)) => frac(p, c),
            _ => None,
        };
        Some(StallRates { window, some, full })
    }
}

// ---------------------------------------------------------------------------------------------
// Per-job CPU time

/// A process's CPU time, with its start time to tell it from a later process reusing the pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessCpu {
    pub pid: u32,
    pub start_time: u64,
    /// The CPU time of all its threads, live and exited, in nanoseconds: its CPU-time clock, or
    /// utime + stime from its stat file where there is no clock.
    pub cpu_ns: u64,
}

/// Where a job's CPU time was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobCpuUsage {
    /// Per process, sorted by pid.
    Processes(Vec<ProcessCpu>),
    /// The cgroup's cumulative usage, and its directory's inode to notice a recreated cgroup.
    Cgroup { usage_ns: u64, inode: u64 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobCpuSample {
    pub at: Instant,
    pub usage: JobCpuUsage,
}

/// A job's CPU use over a window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct JobCpuRate {
    pub window: Duration,
    pub cpu: Duration,
    /// CPU seconds per second: 2.0 is two CPUs' worth.
    pub cores: f64,
}

impl JobCpuRate {
    /// Per process: only processes present in both samples with the same start time count, so a
    /// process that exited or appeared in the window adds nothing (rather than a spike or a
    /// negative step). Per cgroup: `None` when the cgroup was recreated or its usage went back.
    /// Also `None` for samples of different kinds, out of order, or with no process in common.
    pub fn between(prev: &JobCpuSample, cur: &JobCpuSample) -> Option<JobCpuRate> {
        if cur.at <= prev.at {
            return None;
        }
        let cpu_ns = match (&prev.usage, &cur.usage) {
            (JobCpuUsage::Processes(p), JobCpuUsage::Processes(c)) => {
                let mut matched = false;
                let mut sum = 0u64;
                for now in c {
                    let Ok(i) = p.binary_search_by_key(&now.pid, |x| x.pid) else {
                        continue;
                    };
                    let Some(before) = p.get(i) else { continue };
                    if before.start_time != now.start_time {
                        continue;
                    }
                    matched = true;
                    sum = sum.saturating_add(now.cpu_ns.saturating_sub(before.cpu_ns));
                }
                matched.then_some(sum)?
            }
            (
                JobCpuUsage::Cgroup {
                    usage_ns: p,
                    inode: pi,
                },
                JobCpuUsage::Cgroup {
                    usage_ns: c,
                    inode: ci,
                },
            ) if pi == ci => c.checked_sub(*p)?,
            _ => return None,
        };
        let window = cur.at.duration_since(prev.at);
        Some(JobCpuRate {
            window,
            cpu: Duration::from_nanos(cpu_ns),
            cores: ticks_f64(cpu_ns) / 1e9 / window.as_secs_f64(),
        })
    }
}

/// (utime + stime in ticks, starttime) from `/proc/PID/stat`. Fields are counted from the last
/// `)`: the command name may hold spaces and parentheses.
pub fn parse_pid_stat(text: &[u8]) -> Option<(u64, u64)> {
    let close = text.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(text.get(close + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    // After the name: state is field 3, utime 14, stime 15, starttime 22.
    let utime: u64 = fields.nth(14 - 3)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let start_time = fields.nth(22 - 16)?.parse().ok()?;
    Some((utime.saturating_add(stime), start_time))
}

fn is_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// PSI files that exist but are switched off (`psi=0`) answer EOPNOTSUPP.
fn is_absent(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::EOPNOTSUPP)
}

/// Reads into `buf` (cleared first); `Ok(false)` when the file is absent per `absent`.
fn read_into(
    path: &Path,
    buf: &mut Vec<u8>,
    absent: fn(&io::Error) -> bool,
) -> Result<bool, CpuError> {
    buf.clear();
    judged(
        File::open(path).and_then(|mut f| f.read_to_end(buf).map(drop)),
        path,
        absent,
    )
}

/// A read's result as [`read_into`] reports it: `Ok(false)` when the file is absent per `absent`.
fn judged(
    read: io::Result<()>,
    path: &Path,
    absent: fn(&io::Error) -> bool,
) -> Result<bool, CpuError> {
    match read {
        Ok(()) => Ok(true),
        Err(e) if absent(&e) => Ok(false),
        Err(source) => Err(CpuError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn text_of<'a>(path: &Path, buf: &'a [u8]) -> Result<&'a str, CpuError> {
    let text = std::str::from_utf8(buf).map_err(|_| CpuError::Parse {
        path: path.to_path_buf(),
        value: String::from_utf8_lossy(buf).into_owned(),
    })?;
    if text.trim().is_empty() {
        return Err(CpuError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

fn parse_psi_file(path: &Path, buf: &[u8], at: Instant) -> Result<PressureSample, CpuError> {
    let text = text_of(path, buf)?;
    let pressure = parse_pressure(text).map_err(|value| CpuError::Parse {
        path: path.to_path_buf(),
        value,
    })?;
    Ok(PressureSample { at, pressure })
}

/// Reads CPU state from a proc root, keeping its buffers between calls.
#[derive(Debug)]
pub struct CpuReader {
    root: PathBuf,
    path: PathBuf,
    buf: Vec<u8>,
    ns_per_tick: u64,
    /// The real `/proc` only: processes' CPU time from their clocks.
    clocks: Option<clocks::ProcessClocks>,
    /// The real `/proc` only: `/proc/stat` and the PSI files, kept open between passes
    /// (`KeptFile`), by [`NODE_FILES`]. A fixture tree's files are opened every read, as a test
    /// may replace one between reads.
    kept: Option<Vec<KeptFile>>,
}

/// The node-wide files read every pass, in [`CpuReader::kept`]'s order.
const NODE_FILES: [&str; 3] = [PROC_STAT, PROC_PRESSURE_CPU, PROC_PRESSURE_MEMORY];

impl CpuReader {
    /// Clock ticks per second from `sysconf(_SC_CLK_TCK)` (USER_HZ: 100 on every mainstream
    /// architecture).
    pub fn new(proc_root: &Path) -> Self {
        Self::with_ticks_per_second(proc_root, procfs::ticks_per_second())
    }

    pub fn with_ticks_per_second(proc_root: &Path, ticks_per_second: u64) -> Self {
        Self {
            root: proc_root.to_path_buf(),
            path: PathBuf::with_capacity(proc_root.as_os_str().len() + 32),
            buf: Vec::with_capacity(4096),
            ns_per_tick: 1_000_000_000 / ticks_per_second.max(1),
            clocks: (proc_root == Path::new("/proc")).then(clocks::ProcessClocks::new),
            kept: (proc_root == Path::new("/proc")).then(|| {
                NODE_FILES
                    .iter()
                    .map(|f| KeptFile::new(proc_root.join(f)))
                    .collect()
            }),
        }
    }

    /// Reads every process's CPU time from its stat file even on the real `/proc` (the
    /// benchmark's baseline for [`clocks`]).
    pub fn without_clocks(mut self) -> Self {
        self.clocks = None;
        self
    }

    /// Opens `/proc/stat` and the PSI files at every read even on the real `/proc` (the
    /// benchmark's baseline for `KeptFile`).
    pub fn without_kept_files(mut self) -> Self {
        self.kept = None;
        self
    }

    fn set_path(&mut self, parts: &[&str]) {
        self.path.clear();
        self.path.push(&self.root);
        for p in parts {
            self.path.push(p);
        }
    }

    /// `/proc/stat`.
    pub fn stat(&mut self) -> Result<StatSample, CpuError> {
        self.set_path(&[PROC_STAT]);
        self.read_node(PROC_STAT, |_| false)?;
        let at = Instant::now();
        let text = text_of(&self.path, &self.buf)?;
        parse_proc_stat(text, at).map_err(|value| CpuError::Parse {
            path: self.path.clone(),
            value,
        })
    }

    /// `/proc/pressure/cpu`; `None` on kernels without PSI or with it switched off.
    pub fn pressure(&mut self) -> Result<Option<PressureSample>, CpuError> {
        self.psi(PROC_PRESSURE_CPU)
    }

    /// `/proc/pressure/memory`; `None` as for [`CpuReader::pressure`].
    pub fn memory_pressure(&mut self) -> Result<Option<PressureSample>, CpuError> {
        self.psi(PROC_PRESSURE_MEMORY)
    }

    /// A node-wide file into `buf`, through its kept descriptor on the real `/proc`; `self.path`
    /// must name it. As [`read_into`].
    fn read_node(&mut self, file: &str, absent: fn(&io::Error) -> bool) -> Result<bool, CpuError> {
        let kept = self
            .kept
            .as_mut()
            .and_then(|k| Some(&mut k[NODE_FILES.iter().position(|f| *f == file)?]));
        match kept {
            Some(kept) => judged(kept.read_into(&mut self.buf), &self.path, absent),
            None => read_into(&self.path, &mut self.buf, absent),
        }
    }

    fn psi(&mut self, file: &str) -> Result<Option<PressureSample>, CpuError> {
        self.set_path(&[file]);
        if !self.read_node(file, is_absent)? {
            return Ok(None);
        }
        parse_psi_file(&self.path, &self.buf, Instant::now()).map(Some)
    }

    /// The CPU time of each of these processes; processes that are gone are left out. On the
    /// real `/proc` a process's stat file is read only to learn its start time ([`clocks`]).
    pub fn processes(&mut self, pids: &[u32]) -> Result<JobCpuSample, CpuError> {
        let at = Instant::now();
        let mut out = Vec::with_capacity(pids.len());
        for &pid in pids {
            if let Some(p) = self.clocks.as_mut().and_then(|c| c.cached(pid, at)) {
                out.push(p);
                continue;
            }
            let pid_s = pid.to_string();
            self.set_path(&[&pid_s, "stat"]);
            if !read_into(&self.path, &mut self.buf, is_gone)? {
                continue;
            }
            let (ticks, start_time) = parse_pid_stat(&self.buf).ok_or_else(|| CpuError::Parse {
                path: self.path.clone(),
                value: String::from_utf8_lossy(&self.buf).into_owned(),
            })?;
            let clocked = self
                .clocks
                .as_mut()
                .and_then(|c| c.record(pid, start_time, at));
            out.push(ProcessCpu {
                pid,
                start_time,
                cpu_ns: clocked.unwrap_or_else(|| ticks.saturating_mul(self.ns_per_tick)),
            });
        }
        out.sort_unstable_by_key(|p| p.pid);
        out.dedup_by_key(|p| p.pid);
        Ok(JobCpuSample {
            at,
            usage: JobCpuUsage::Processes(out),
        })
    }
}

/// Reads cgroups' CPU usage and pressure from one hierarchy.
#[derive(Debug)]
pub struct CgroupCpuReader {
    /// v1: the cpuacct hierarchy; v2: the unified one.
    hierarchy: PathBuf,
    version: CgroupVersion,
    buf: Vec<u8>,
}

impl CgroupCpuReader {
    /// `cgroup_root` is where the hierarchies are mounted (`/sys/fs/cgroup`); on v1 usage comes
    /// from its `cpuacct/` hierarchy.
    pub fn new(cgroup_root: &Path, version: CgroupVersion) -> Self {
        let hierarchy = match version {
            CgroupVersion::V1 => cgroup_root.join(V1_CPUACCT_DIR),
            CgroupVersion::V2 => cgroup_root.to_path_buf(),
        };
        Self {
            hierarchy,
            version,
            buf: Vec::with_capacity(1024),
        }
    }

    /// The directory of a cgroup given relative to the hierarchy (`/slurm/job_1`).
    pub fn dir(&self, cgroup: &str) -> Result<PathBuf, CpuError> {
        let mut dir = self.hierarchy.clone();
        for comp in cgroup.split('/').filter(|c| !c.is_empty()) {
            if comp == "." || comp == ".." || comp.contains('\0') {
                return Err(CpuError::BadCgroup(cgroup.to_string()));
            }
            dir.push(comp);
        }
        Ok(dir)
    }

    /// The cgroup's cumulative CPU usage. A cgroup missing from this hierarchy is an error for
    /// which [`CpuError::is_not_found`] holds.
    pub fn usage(&mut self, cgroup: &str) -> Result<JobCpuSample, CpuError> {
        let dir = self.dir(cgroup)?;
        let inode = std::fs::metadata(&dir)
            .map_err(|source| CpuError::Read {
                path: dir.clone(),
                source,
            })?
            .ino();
        let path = dir.join(match self.version {
            CgroupVersion::V1 => CPUACCT_USAGE,
            CgroupVersion::V2 => CPU_STAT,
        });
        read_into(&path, &mut self.buf, |_| false)?;
        let at = Instant::now();
        let text = text_of(&path, &self.buf)?;
        let bad = || CpuError::Parse {
            path: path.clone(),
            value: text.to_string(),
        };
        let usage_ns = match self.version {
            CgroupVersion::V1 => text.trim().parse::<u64>().map_err(|_| bad())?,
            CgroupVersion::V2 => text
                .lines()
                .find_map(|l| l.strip_prefix(CPU_STAT_USAGE)?.trim().parse::<u64>().ok())
                .ok_or_else(bad)?
                .saturating_mul(1000),
        };
        Ok(JobCpuSample {
            at,
            usage: JobCpuUsage::Cgroup { usage_ns, inode },
        })
    }

    /// The cgroup's `cpu.pressure`; `None` where the kernel has none (v1, PSI off, before 5.2).
    pub fn pressure(&mut self, cgroup: &str) -> Result<Option<PressureSample>, CpuError> {
        self.psi(cgroup, CPU_PRESSURE)
    }

    /// The cgroup's `memory.pressure`; `None` as for [`CgroupCpuReader::pressure`].
    pub fn memory_pressure(&mut self, cgroup: &str) -> Result<Option<PressureSample>, CpuError> {
        self.psi(cgroup, MEMORY_PRESSURE)
    }

    fn psi(&mut self, cgroup: &str, file: &str) -> Result<Option<PressureSample>, CpuError> {
        let path = self.dir(cgroup)?.join(file);
        if !read_into(&path, &mut self.buf, is_absent)? {
            return Ok(None);
        }
        parse_psi_file(&path, &self.buf, Instant::now()).map(Some)
    }
}

#[cfg(test)]
mod tests;
