//! CPU sensing: per-CPU utilization from `/proc/stat`, per-job CPU time (its processes' utime +
//! stime from `/proc/PID/stat`, or its cgroup's `cpuacct.usage` on v1 / `cpu.stat` `usage_usec`
//! on v2) and run-queue pressure from PSI (`/proc/pressure/cpu`, and `cpu.pressure` of a cgroup
//! where the kernel has it). Reads the proc and cgroup roots it is given, nothing else.
//!
//! Parsed by hand rather than with the procfs crate: its `KernelStats` keeps per-CPU times as a
//! list without the CPU number (wrong as soon as a CPU is offline), its `CpuPressure` requires the
//! `full` line that kernels before 5.13 do not write for cpu, and `/proc/PID/stat` is read for
//! every process of every job each tick, where a reused buffer beats a fifty-field struct (the
//! reasoning of `enforce::procs`). The crate is used for `ticks_per_second`.
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

/// Relative to the proc root.
pub const PROC_STAT: &str = "stat";
pub const PROC_PRESSURE_CPU: &str = "pressure/cpu";
/// The v1 hierarchy holding `cpuacct.usage`, relative to the cgroup root (a symlink to
/// `cpu,cpuacct` where the two are co-mounted).
pub const V1_CPUACCT_DIR: &str = "cpuacct";
pub const CPUACCT_USAGE: &str = "cpuacct.usage";
pub const CPU_STAT: &str = "cpu.stat";
pub const CPU_STAT_USAGE: &str = "usage_usec";
pub const CPU_PRESSURE: &str = "cpu.pressure";

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
    /// utime + stime of all its threads, live and exited, in nanoseconds.
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
    match File::open(path).and_then(|mut f| f.read_to_end(buf)) {
        Ok(_) => Ok(true),
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
}

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
        }
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
        read_into(&self.path, &mut self.buf, |_| false)?;
        let at = Instant::now();
        let text = text_of(&self.path, &self.buf)?;
        parse_proc_stat(text, at).map_err(|value| CpuError::Parse {
            path: self.path.clone(),
            value,
        })
    }

    /// `/proc/pressure/cpu`; `None` on kernels without PSI or with it switched off.
    pub fn pressure(&mut self) -> Result<Option<PressureSample>, CpuError> {
        self.set_path(&[PROC_PRESSURE_CPU]);
        if !read_into(&self.path, &mut self.buf, is_absent)? {
            return Ok(None);
        }
        parse_psi_file(&self.path, &self.buf, Instant::now()).map(Some)
    }

    /// The CPU time of each of these processes; processes that are gone are left out.
    pub fn processes(&mut self, pids: &[u32]) -> Result<JobCpuSample, CpuError> {
        let at = Instant::now();
        let mut out = Vec::with_capacity(pids.len());
        for &pid in pids {
            let pid_s = pid.to_string();
            self.set_path(&[&pid_s, "stat"]);
            if !read_into(&self.path, &mut self.buf, is_gone)? {
                continue;
            }
            let (ticks, start_time) = parse_pid_stat(&self.buf).ok_or_else(|| CpuError::Parse {
                path: self.path.clone(),
                value: String::from_utf8_lossy(&self.buf).into_owned(),
            })?;
            out.push(ProcessCpu {
                pid,
                start_time,
                cpu_ns: ticks.saturating_mul(self.ns_per_tick),
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
        let path = self.dir(cgroup)?.join(CPU_PRESSURE);
        if !read_into(&path, &mut self.buf, is_absent)? {
            return Ok(None);
        }
        parse_psi_file(&path, &self.buf, Instant::now()).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const STAT: &str = "cpu  164344 10 22506 161090 1482 0 279 33 0 0\n\
cpu0 80507 5 10790 82964 525 0 31 15 0 0\n\
cpu2 83837 5 11716 78126 957 0 248 18 0 0\n\
intr 1476172 0 0\n\
ctxt 3140420\n\
btime 1700000000\n\
processes 4242\n\
procs_running 3\n\
procs_blocked 0\n";

    fn write(dir: &Path, rel: &str, content: &str) -> PathBuf {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(&path, content).expect("write");
        path
    }

    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn proc_stat_keeps_cpu_numbers() {
        let s = parse_proc_stat(STAT, t0()).expect("parses");
        assert_eq!(s.all.user, 164344);
        assert_eq!(s.all.nice, 10);
        assert_eq!(s.all.steal, 33);
        assert_eq!(s.cpus.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(s.procs_running, Some(3));
        // A 2.4-era line with only four fields.
        let old = parse_proc_stat("cpu 1 2 3 4\n", t0()).expect("parses");
        assert_eq!(old.all.idle, 4);
        assert_eq!(old.all.iowait, 0);
    }

    #[test]
    fn proc_stat_fixture_success_failure_empty_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = CpuReader::with_ticks_per_second(dir.path(), 100);
        assert!(matches!(r.stat(), Err(CpuError::Read { .. })), "missing");
        assert!(r.stat().unwrap_err().is_not_found());
        write(dir.path(), PROC_STAT, "");
        assert!(matches!(r.stat(), Err(CpuError::Empty { .. })), "empty");
        write(dir.path(), PROC_STAT, "cpu 1 2 x 4\n");
        match r.stat() {
            Err(CpuError::Parse { path, value }) => {
                assert_eq!(path, dir.path().join(PROC_STAT));
                assert_eq!(value, "cpu 1 2 x 4");
            }
            other => panic!("{other:?}"),
        }
        write(dir.path(), PROC_STAT, "cpu0 1 2 3 4\n");
        assert!(matches!(r.stat(), Err(CpuError::Parse { .. })), "no total");
        write(dir.path(), PROC_STAT, "cpuX 1 2 3 4\ncpu 1 2 3 4\n");
        assert!(matches!(r.stat(), Err(CpuError::Parse { .. })), "bad id");
        write(dir.path(), PROC_STAT, STAT);
        let s = r.stat().expect("reads");
        assert_eq!(s.cpus.len(), 2);
        assert_eq!(s.procs_running, Some(3));
    }

    #[test]
    fn utilization_from_two_samples() {
        let at = t0();
        let prev = StatSample {
            at,
            all: CpuTimes {
                user: 100,
                idle: 100,
                ..Default::default()
            },
            cpus: vec![
                (0, CpuTimes::default()),
                (1, CpuTimes::default()),
                (5, CpuTimes::default()),
            ],
            procs_running: Some(1),
        };
        let cur = StatSample {
            at: at + Duration::from_secs(1),
            all: CpuTimes {
                user: 150,
                system: 20,
                idle: 120,
                iowait: 0,
                steal: 10,
                ..Default::default()
            },
            cpus: vec![
                (
                    0,
                    CpuTimes {
                        user: 75,
                        idle: 25,
                        ..Default::default()
                    },
                ),
                (1, CpuTimes::default()),
                // CPU 5 went offline, CPU 7 came online.
                (7, CpuTimes::default()),
            ],
            procs_running: Some(4),
        };
        let r = NodeCpuRates::between(&prev, &cur).expect("ordered");
        let all = r.all.expect("ticks elapsed");
        // Δ: user 50, system 20, idle 20, steal 10 → 100 ticks.
        assert!((all.busy - 0.7).abs() < 1e-9);
        assert!((all.user - 0.5).abs() < 1e-9);
        assert!((all.system - 0.2).abs() < 1e-9);
        assert!((all.steal - 0.1).abs() < 1e-9);
        assert_eq!(r.cpus.len(), 2);
        assert_eq!(r.cpus[0].0, 0);
        assert!((r.cpus[0].1.expect("cpu0").busy - 0.75).abs() < 1e-9);
        // No tick elapsed on CPU 1: unknown, not NaN.
        assert_eq!(r.cpus[1], (1, None));
        assert_eq!(r.procs_running, Some(4));
        assert!(NodeCpuRates::between(&cur, &prev).is_none());
        assert!(NodeCpuRates::between(&prev, &prev).is_none());
    }

    #[test]
    fn utilization_survives_iowait_going_backwards() {
        let prev = CpuTimes {
            user: 10,
            idle: 100,
            iowait: 50,
            ..Default::default()
        };
        let cur = CpuTimes {
            user: 20,
            idle: 110,
            iowait: 40,
            ..Default::default()
        };
        let u = utilization(&prev, &cur).expect("ticks");
        assert!((u.busy - 0.5).abs() < 1e-9);
        assert_eq!(u.iowait, 0.0);
    }

    #[test]
    fn pid_stat_fields() {
        // utime 1000, stime 234, starttime 98765; the name has spaces and parentheses.
        let line = b"1234 (a) b (c)) S 77 1234 1234 0 -1 4194560 100 0 0 0 1000 234 7 8 20 0 3 0 98765 1000 10";
        assert_eq!(parse_pid_stat(line), Some((1234, 98765)));
        assert_eq!(parse_pid_stat(b""), None);
        assert_eq!(parse_pid_stat(b"1 (x) S 1 2 3"), None);
        assert_eq!(
            parse_pid_stat(b"1 (x) S 77 1 1 0 -1 0 0 0 0 0 x 234 0 0 20 0 3 0 5"),
            None
        );
    }

    #[test]
    fn process_cpu_fixture() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "10/stat",
            "10 (train er) R 1 10 10 0 -1 0 0 0 0 0 300 100 0 0 20 0 4 0 555 0 0\n",
        );
        write(
            dir.path(),
            "11/stat",
            "11 (w) S 10 10 10 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 556 0 0\n",
        );
        let mut r = CpuReader::with_ticks_per_second(dir.path(), 100);
        // 12 is gone: left out, not an error.
        let s = r.processes(&[11, 10, 12, 10]).expect("reads");
        let JobCpuUsage::Processes(ps) = &s.usage else {
            panic!("kind")
        };
        assert_eq!(
            ps,
            &vec![
                ProcessCpu {
                    pid: 10,
                    start_time: 555,
                    cpu_ns: 4_000_000_000
                },
                ProcessCpu {
                    pid: 11,
                    start_time: 556,
                    cpu_ns: 20_000_000
                },
            ]
        );
        write(dir.path(), "13/stat", "13 (broken");
        match r.processes(&[13]) {
            Err(CpuError::Parse { path, .. }) => assert_eq!(path, dir.path().join("13/stat")),
            other => panic!("{other:?}"),
        }
        write(dir.path(), "14/stat", "");
        assert!(matches!(r.processes(&[14]), Err(CpuError::Parse { .. })));
    }

    fn procs(at: Instant, list: &[(u32, u64, u64)]) -> JobCpuSample {
        JobCpuSample {
            at,
            usage: JobCpuUsage::Processes(
                list.iter()
                    .map(|&(pid, start_time, cpu_ns)| ProcessCpu {
                        pid,
                        start_time,
                        cpu_ns,
                    })
                    .collect(),
            ),
        }
    }

    #[test]
    fn job_cpu_rate_from_processes() {
        let at = t0();
        let s = Duration::from_secs(2);
        let prev = procs(at, &[(10, 1, 1_000_000_000), (11, 1, 0), (12, 1, 5)]);
        // 10 used 3 s; 11 was replaced by a new process with the same pid; 12 exited; 13 is new.
        let cur = procs(
            at + s,
            &[
                (10, 1, 4_000_000_000),
                (11, 9, 7_000_000_000),
                (13, 1, 9_000),
            ],
        );
        let r = JobCpuRate::between(&prev, &cur).expect("rate");
        assert_eq!(r.cpu, Duration::from_secs(3));
        assert!((r.cores - 1.5).abs() < 1e-9);
        // Nothing in common: unknown.
        let other = procs(at + s, &[(20, 1, 1)]);
        assert!(JobCpuRate::between(&prev, &other).is_none());
        // Zero time: unknown, not infinite.
        assert!(JobCpuRate::between(&prev, &prev).is_none());
        // A counter going back within one process is a zero delta, not a wrap.
        let back = procs(at + s, &[(10, 1, 0)]);
        assert_eq!(JobCpuRate::between(&prev, &back).expect("rate").cores, 0.0);
    }

    #[test]
    fn job_cpu_rate_from_cgroup() {
        let at = t0();
        let s = Duration::from_secs(1);
        let cg = |at, usage_ns, inode| JobCpuSample {
            at,
            usage: JobCpuUsage::Cgroup { usage_ns, inode },
        };
        let r = JobCpuRate::between(&cg(at, 1_000, 7), &cg(at + s, 500_001_000, 7)).expect("rate");
        assert!((r.cores - 0.5).abs() < 1e-9);
        // Recreated cgroup (new inode) or a reset counter: dropped.
        assert!(JobCpuRate::between(&cg(at, 1_000, 7), &cg(at + s, 5_000, 8)).is_none());
        assert!(JobCpuRate::between(&cg(at, 9_000, 7), &cg(at + s, 5_000, 7)).is_none());
        // Mixed kinds: dropped.
        assert!(JobCpuRate::between(&cg(at, 0, 7), &procs(at + s, &[])).is_none());
    }

    #[test]
    fn pressure_parsing() {
        let p = parse_pressure(
            "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\n\
             full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        )
        .expect("parses");
        assert_eq!(p.some.total_us, 123456);
        assert!((p.some.avg10 - 1.5).abs() < 1e-9);
        assert_eq!(p.full.map(|f| f.total_us), Some(0));
        // Before 5.13 the cpu file had only the some line.
        let old = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=42\n").expect("old");
        assert_eq!(old.full, None);
        assert!(parse_pressure("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n").is_err());
        assert!(parse_pressure("some avg10=x avg60=0.00 avg300=0.00 total=1\n").is_err());
        assert!(parse_pressure("some avg10=0.00 avg60=0.00 total=1\n").is_err());
        assert!(parse_pressure("weird avg10=0 avg60=0 avg300=0 total=1\n").is_err());
    }

    #[test]
    fn pressure_fixture_success_failure_empty_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = CpuReader::with_ticks_per_second(dir.path(), 100);
        assert!(r.pressure().expect("absent is fine").is_none());
        write(dir.path(), PROC_PRESSURE_CPU, "");
        assert!(matches!(r.pressure(), Err(CpuError::Empty { .. })));
        write(dir.path(), PROC_PRESSURE_CPU, "some total=1\n");
        match r.pressure() {
            Err(CpuError::Parse { path, .. }) => {
                assert_eq!(path, dir.path().join(PROC_PRESSURE_CPU))
            }
            other => panic!("{other:?}"),
        }
        write(
            dir.path(),
            PROC_PRESSURE_CPU,
            "some avg10=99.53 avg60=79.35 avg300=57.35 total=479046187\n\
             full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        );
        let s = r.pressure().expect("reads").expect("present");
        assert_eq!(s.pressure.some.total_us, 479046187);
    }

    #[test]
    fn stall_rates() {
        let at = t0();
        let sample = |at, some, full: Option<u64>| PressureSample {
            at,
            pressure: Pressure {
                some: PsiLine {
                    total_us: some,
                    ..Default::default()
                },
                full: full.map(|total_us| PsiLine {
                    total_us,
                    ..Default::default()
                }),
            },
        };
        let r = StallRates::between(
            &sample(at, 1_000_000, Some(0)),
            &sample(at + Duration::from_secs(2), 1_500_000, Some(200_000)),
        )
        .expect("rate");
        assert!((r.some - 0.25).abs() < 1e-9);
        assert!((r.full.expect("full") - 0.1).abs() < 1e-9);
        let none_full = StallRates::between(
            &sample(at, 0, None),
            &sample(at + Duration::from_secs(1), 3_000_000, None),
        )
        .expect("rate");
        assert_eq!(none_full.some, 1.0, "clamped");
        assert_eq!(none_full.full, None);
        assert!(StallRates::between(
            &sample(at, 5, None),
            &sample(at + Duration::from_secs(1), 4, None)
        )
        .is_none());
        assert!(StallRates::between(&sample(at, 0, None), &sample(at, 1, None)).is_none());
    }

    #[test]
    fn cgroup_v1_fixture() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = CgroupCpuReader::new(dir.path(), CgroupVersion::V1);
        let err = r.usage("/slurm/job_1").unwrap_err();
        assert!(err.is_not_found(), "{err}");
        let file = write(dir.path(), "cpuacct/slurm/job_1/cpuacct.usage", "");
        assert!(matches!(
            r.usage("/slurm/job_1"),
            Err(CpuError::Empty { .. })
        ));
        fs::write(&file, "12x\n").expect("write");
        match r.usage("slurm/job_1") {
            Err(CpuError::Parse { path, value }) => {
                assert_eq!(path, file);
                assert_eq!(value, "12x\n");
            }
            other => panic!("{other:?}"),
        }
        fs::write(&file, "123456789\n").expect("write");
        let s = r.usage("/slurm/job_1").expect("reads");
        assert!(matches!(
            s.usage,
            JobCpuUsage::Cgroup {
                usage_ns: 123456789,
                ..
            }
        ));
        // v1 has no per-cgroup PSI here.
        assert!(r.pressure("/slurm/job_1").expect("absent").is_none());
        assert!(matches!(r.usage("/a/../b"), Err(CpuError::BadCgroup(_))));
    }

    #[test]
    fn cgroup_v2_fixture() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = CgroupCpuReader::new(dir.path(), CgroupVersion::V2);
        assert!(r.usage("/job").unwrap_err().is_not_found());
        let stat = write(dir.path(), "job/cpu.stat", "");
        assert!(matches!(r.usage("/job"), Err(CpuError::Empty { .. })));
        fs::write(&stat, "user_usec 5\nsystem_usec 6\n").expect("write");
        assert!(matches!(r.usage("/job"), Err(CpuError::Parse { .. })));
        fs::write(
            &stat,
            "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\nnr_periods 0\n",
        )
        .expect("write");
        let s = r.usage("/job").expect("reads");
        assert!(matches!(
            s.usage,
            JobCpuUsage::Cgroup {
                usage_ns: 2_500_000,
                ..
            }
        ));
        assert!(r.pressure("/job").expect("absent").is_none());
        let psi = write(dir.path(), "job/cpu.pressure", "");
        assert!(matches!(r.pressure("/job"), Err(CpuError::Empty { .. })));
        fs::write(&psi, "garbage\n").expect("write");
        assert!(matches!(r.pressure("/job"), Err(CpuError::Parse { .. })));
        fs::write(
            &psi,
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=77\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n",
        )
        .expect("write");
        let p = r.pressure("/job").expect("reads").expect("present");
        assert_eq!(p.pressure.full.map(|f| f.total_us), Some(7));
    }

    #[test]
    fn reads_this_machine() {
        let mut r = CpuReader::new(Path::new("/proc"));
        let a = r.stat().expect("/proc/stat");
        assert!(!a.cpus.is_empty());
        let me = std::process::id();
        let p1 = r.processes(&[me]).expect("own stat");
        // Burn a little CPU so the window has some.
        let mut x = 0u64;
        let until = Instant::now() + Duration::from_millis(60);
        while Instant::now() < until {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let p2 = r.processes(&[me]).expect("own stat");
        let rate = JobCpuRate::between(&p1, &p2).expect("rate");
        assert!(rate.cores >= 0.0);
        let b = r.stat().expect("/proc/stat");
        assert!(NodeCpuRates::between(&a, &b).is_some());
        // PSI may or may not exist; either answer is fine, an error is not.
        r.pressure().expect("psi read");
    }
}
