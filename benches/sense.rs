//! Sensing cost benchmark (`cargo bench --bench sense`; run as root for the cgroup parts).
//!
//! Measures the CPU time one sampling tick costs the reading thread, for 1, 10 and 50 jobs:
//! 1. perf, jobs counted by cgroup (one group per CPU): grouped and ungrouped reads of idle
//!    cgroups, and of a cgroup whose task is running on another CPU at that moment (the kernel
//!    then interrupts that CPU to read the live count: the expensive case).
//! 2. perf, jobs counted by process (one group per thread), idle and running.
//! 3. /proc and cgroupfs CPU readers: /proc/stat, per-process CPU time (clocks, and /proc/PID/stat
//!    as the baseline), cgroup usage.
//!
//! From the measured cost per group read and per fd it extrapolates the per-tick CPU time on a
//! 192-CPU host. Counters are software events (task-clock, ...) when the host has no PMU, as
//! this build VM: their read path (syscall, group walk, cross-CPU read of an active event) is
//! the hardware events' except for the PMU register read itself.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{example, online_cpus, unique, wait_ready};
use lodger::cpuset::CpuSet;
use lodger::job::JobId;
use lodger::sense::cpu::{CgroupCpuReader, CpuReader};
use lodger::sense::perf::{
    perf_cgroup_root, Counters, EventSource, FdBudget, Grouping, PerfCounters, PerfSettings,
    PerfTarget,
};
use lodger::sys::cgroupfs::CgroupVersion;

const JOB_COUNTS: [usize; 3] = [1, 10, 50];
const BIG_HOST_CPUS: usize = 192;
const EVENTS: usize = 4;
/// Measure each configuration this many times for about this long each: the median is reported,
/// and the largest too, since reads of running events vary a lot in a VM (each is an IPI, which
/// the hypervisor delivers).
const ROUNDS: usize = 5;
const MEASURE: Duration = Duration::from_millis(200);

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// Average CPU time per call of `tick` over about `MEASURE`: (median, max) of `ROUNDS` rounds.
fn per_tick(mut tick: impl FnMut()) -> (Duration, Duration) {
    tick(); // warm up buffers
    let mut rounds: Vec<Duration> = (0..ROUNDS)
        .map(|_| {
            let wall = Instant::now();
            let start = thread_cpu();
            let mut n = 0u32;
            while wall.elapsed() < MEASURE || n < 20 {
                tick();
                n += 1;
            }
            (thread_cpu() - start) / n
        })
        .collect();
    rounds.sort_unstable();
    (rounds[ROUNDS / 2], rounds[ROUNDS - 1])
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn pin_self(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

fn pin(pid: u32, cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    let Ok(pid) = i32::try_from(pid) else { return };
    if set.set(cpu).is_ok() {
        for tid in common::tids(u32::try_from(pid).unwrap_or(0)) {
            let Ok(tid) = i32::try_from(tid) else {
                continue;
            };
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set);
        }
    }
}

struct Kill(Vec<Child>);

impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Cgroups(Vec<PathBuf>);

impl Drop for Cgroups {
    fn drop(&mut self) {
        for d in self.0.iter().rev() {
            // Processes moved in are killed first (Kill is dropped before Cgroups).
            for _ in 0..100 {
                if std::fs::remove_dir(d).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn counters(grouping: Grouping) -> PerfCounters {
    let mut probe = PerfSettings::new(Path::new("/proc"));
    probe.grouping = grouping;
    let hw = PerfCounters::new(probe.clone()).expect("perf setup");
    if hw.status().available() {
        return hw;
    }
    probe.source = EventSource::Software;
    PerfCounters::new(probe).expect("perf setup")
}

fn spawn_busy() -> Child {
    let mut child = Command::new(example("busy_loop"))
        .args(["--seconds", "600"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("busy_loop");
    wait_ready(&mut child, "busy_loop");
    child
}

fn spawn_sleeper() -> Child {
    Command::new("sleep")
        .arg("600")
        .stdout(Stdio::null())
        .spawn()
        .expect("sleep")
}

struct Row {
    what: String,
    jobs: usize,
    groups: usize,
    fds: usize,
    /// Median and largest CPU time per tick.
    tick: (Duration, Duration),
}

impl Row {
    /// (median, max) per group read.
    fn per_group(&self) -> (Duration, Duration) {
        let n = u32::try_from(self.groups.max(1)).unwrap_or(u32::MAX);
        (self.tick.0 / n, self.tick.1 / n)
    }
    /// (median, max) per fd.
    fn per_fd(&self) -> (Duration, Duration) {
        let n = u32::try_from(self.fds.max(1)).unwrap_or(u32::MAX);
        (self.tick.0 / n, self.tick.1 / n)
    }
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<42} {:>4} {:>6} {:>5} {:>18} {:>18} {:>16}",
        "configuration (median / max of rounds)",
        "jobs",
        "groups",
        "fds",
        "CPU/tick µs",
        "per group µs",
        "per fd µs"
    );
    let pair = |(a, b): (Duration, Duration)| format!("{:.3} / {:.3}", us(a), us(b));
    for r in rows {
        println!(
            "{:<42} {:>4} {:>6} {:>5} {:>18} {:>18} {:>16}",
            r.what,
            r.jobs,
            r.groups,
            r.fds,
            pair(r.tick),
            pair(r.per_group()),
            pair(r.per_fd())
        );
    }
}

/// Jobs counted by cgroup on every online CPU, the cgroups idle.
fn perf_cgroup_idle(perf_root: &Path, cpus: &CpuSet, grouping: Grouping, rows: &mut Vec<Row>) {
    for jobs in JOB_COUNTS {
        let mut c = counters(grouping);
        let mut dirs = Cgroups(Vec::new());
        let mut fds = 0;
        let mut groups = 0;
        for j in 0..jobs {
            let dir = perf_root.join(unique("lodger-bench"));
            std::fs::create_dir(&dir).expect("create cgroup");
            dirs.0.push(dir.clone());
            let a = c
                .attach(
                    &JobId::from_seq(j as u64 + 1),
                    &PerfTarget::Cgroup {
                        dir,
                        cpus: cpus.clone(),
                    },
                )
                .expect("attach");
            fds += a.fds as usize;
            groups += a.groups as usize;
        }
        let tick = per_tick(|| {
            std::hint::black_box(c.read());
        });
        rows.push(Row {
            what: format!("perf cgroup, idle, {grouping:?}"),
            jobs,
            groups,
            fds,
            tick,
        });
    }
}

/// One job counted by cgroup on CPU 1 only, where its busy task runs: every read interrupts it.
fn perf_cgroup_active(perf_root: &Path, grouping: Grouping, rows: &mut Vec<Row>) {
    let dir = perf_root.join(unique("lodger-bench"));
    std::fs::create_dir(&dir).expect("create cgroup");
    let _dirs = Cgroups(vec![dir.clone()]);
    let busy = Kill(vec![spawn_busy()]);
    let pid = busy.0[0].id();
    std::fs::write(dir.join("cgroup.procs"), pid.to_string()).expect("move busy loop");
    pin(pid, 1);
    let mut c = counters(grouping);
    let a = c
        .attach(
            &JobId::from_seq(1),
            &PerfTarget::Cgroup {
                dir,
                cpus: CpuSet::parse("1").expect("cpu 1"),
            },
        )
        .expect("attach");
    let tick = per_tick(|| {
        std::hint::black_box(c.read());
    });
    rows.push(Row {
        what: format!("perf cgroup, running on CPU 1, {grouping:?}"),
        jobs: 1,
        groups: a.groups as usize,
        fds: a.fds as usize,
        tick,
    });
    drop(c);
    drop(busy);
}

/// Jobs counted by process (one thread each): sleeping, or one spinning on CPU 1.
fn perf_processes(grouping: Grouping, rows: &mut Vec<Row>, running: bool) {
    let counts: &[usize] = if running { &[1] } else { &JOB_COUNTS };
    for &jobs in counts {
        let mut kids = Kill(Vec::new());
        let mut c = counters(grouping);
        let mut fds = 0;
        let mut groups = 0;
        for j in 0..jobs {
            let child = if running {
                spawn_busy()
            } else {
                spawn_sleeper()
            };
            let pid = child.id();
            kids.0.push(child);
            if running {
                pin(pid, 1);
            }
            // busy_loop has a main thread and a spinning one; sleep has one.
            let a = c
                .attach(
                    &JobId::from_seq(j as u64 + 1),
                    &PerfTarget::Processes(vec![pid]),
                )
                .expect("attach");
            fds += a.fds as usize;
            groups += a.groups as usize;
        }
        let tick = per_tick(|| {
            std::hint::black_box(c.read());
        });
        rows.push(Row {
            what: format!(
                "perf threads, {}, {grouping:?}",
                if running {
                    "running on CPU 1"
                } else {
                    "sleeping"
                }
            ),
            jobs,
            groups,
            fds,
            tick,
        });
    }
}

fn cpu_readers(cgroup_root: &Path, rows: &mut Vec<Row>) {
    // The node's files through descriptors kept open (lodgerd), and opened at every read (before
    // issue 21), measured alternately.
    let mut r = CpuReader::new(Path::new("/proc"));
    let mut opened = CpuReader::new(Path::new("/proc")).without_kept_files();
    for (reader, how) in [(&mut r, "kept open"), (&mut opened, "opened every read")] {
        for file in ["/proc/stat (node, per CPU)", "/proc/pressure/cpu"] {
            let tick = per_tick(|| {
                if file.starts_with("/proc/stat") {
                    std::hint::black_box(reader.stat().expect("/proc/stat"));
                } else {
                    std::hint::black_box(reader.pressure().expect("psi"));
                }
            });
            rows.push(Row {
                what: format!("{file}, {how}"),
                jobs: 0,
                groups: 1,
                fds: 1,
                tick,
            });
        }
    }
    // Per-job CPU time as the sampler reads it (the processes' CPU-time clocks, the stat file
    // for start times only) beside the stat file alone (before issue 21), same processes.
    let mut stat_only = CpuReader::new(Path::new("/proc")).without_clocks();
    for jobs in JOB_COUNTS {
        let kids = Kill((0..jobs).map(|_| spawn_sleeper()).collect());
        let pids: Vec<u32> = kids.0.iter().map(|c| c.id()).collect();
        for (what, reader) in [
            ("per-process CPU clock, one process per job", &mut r),
            ("/proc/PID/stat, one process per job", &mut stat_only),
        ] {
            let tick = per_tick(|| {
                for &p in &pids {
                    std::hint::black_box(reader.processes(&[p]).expect("pid stat"));
                }
            });
            rows.push(Row {
                what: what.into(),
                jobs,
                groups: jobs,
                fds: jobs,
                tick,
            });
        }
    }
    let v2 = cgroup_root.join("cgroup.controllers").is_file();
    let hierarchy = if v2 {
        Some((cgroup_root.to_path_buf(), CgroupVersion::V2))
    } else if cgroup_root.join("cpuacct/cpuacct.usage").is_file() {
        Some((cgroup_root.to_path_buf(), CgroupVersion::V1))
    } else {
        None
    };
    if let Some((root, version)) = hierarchy {
        let mut cg = CgroupCpuReader::new(&root, version);
        let tick = per_tick(|| {
            std::hint::black_box(cg.usage("/").expect("usage"));
        });
        rows.push(Row {
            what: format!("cgroup usage ({version})"),
            jobs: 1,
            groups: 1,
            fds: 1,
            tick,
        });
    }
}

/// A whole sensing pass of lodgerd's sampler (every source this host has) for N jobs of
/// one real process each: what one tick of the sensing thread costs.
fn sampler_pass(rows: &mut Vec<Row>) {
    use lodger::sense::sampler::{GpuChoice, Sampler, SamplerSettings};
    use lodger::sense::SensedJob;
    for jobs in JOB_COUNTS {
        let mut children: Vec<Child> = (0..jobs).map(|_| spawn_sleeper()).collect();
        let mut sampler = Sampler::open(SamplerSettings {
            interval: Duration::from_secs(1),
            proc_root: PathBuf::from("/proc"),
            sysfs_root: PathBuf::from("/sys"),
            gpu: GpuChoice::Auto,
            emulated_gpu_dir: PathBuf::from("/nonexistent"),
            perf: true,
            perf_max_fds: 65536,
            resctrl_root: PathBuf::from("/sys/fs/resctrl"),
            membw_peak_bytes_per_s: 0,
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
        });
        sampler.set_jobs(
            children
                .iter()
                .enumerate()
                .map(|(i, c)| SensedJob {
                    id: JobId::from_seq(i as u64 + 1),
                    pids: vec![c.id()],
                    cgroup: None,
                    gpus: vec![],
                })
                .collect(),
        );
        let tick = per_tick(|| {
            std::hint::black_box(sampler.pass());
        });
        rows.push(Row {
            what: "lodgerd sampler pass (all sources this host has)".into(),
            jobs,
            groups: jobs,
            fds: 0,
            tick,
        });
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn main() {
    let cpus = CpuSet::parse(&online_cpus()).expect("online cpus");
    let root = lodger::privileged::is_root();
    let cgroup_root = Path::new("/sys/fs/cgroup");
    pin_self(0);
    let probe = counters(Grouping::Auto);
    let status = probe.status();
    drop(probe);
    println!(
        "sense benchmark: {} online CPUs, events: {}, grouped reads {}",
        cpus.len(),
        if status.software {
            "software stand-ins (no PMU on this host)"
        } else {
            "hardware"
        },
        if status.grouped {
            "supported"
        } else {
            "refused"
        }
    );

    let mut rows = Vec::new();
    let perf_root = perf_cgroup_root(cgroup_root);
    match (&perf_root, root) {
        (Some(perf_root), true) => {
            for grouping in [Grouping::Auto, Grouping::Ungrouped] {
                perf_cgroup_idle(perf_root, &cpus, grouping, &mut rows);
                if cpus.len() > 1 {
                    perf_cgroup_active(perf_root, grouping, &mut rows);
                }
            }
        }
        _ => println!("(cgroup perf parts skipped: need root and a perf_event cgroup hierarchy)"),
    }
    for grouping in [Grouping::Auto, Grouping::Ungrouped] {
        perf_processes(grouping, &mut rows, false);
        if cpus.len() > 1 {
            perf_processes(grouping, &mut rows, true);
        }
    }
    let v2_or_v1 = perf_root
        .as_deref()
        .filter(|p| p.join("cgroup.controllers").is_file())
        .unwrap_or(cgroup_root)
        .to_path_buf();
    cpu_readers(&v2_or_v1, &mut rows);
    sampler_pass(&mut rows);
    println!();
    print_rows(&rows);

    // Extrapolation: per-cgroup counting on a 192-CPU host, one group per CPU per job. At most
    // one cgroup is running on a CPU at a time, so at most 192 of a tick's reads hit a running
    // event (the costly cross-CPU read); the rest read stored counts.
    let cost = |what: &str| {
        rows.iter()
            .filter(|r| r.what == what)
            .max_by_key(|r| r.jobs)
            .map(|r| (r.per_group(), r.per_fd()))
    };
    println!();
    println!("extrapolation to a {BIG_HOST_CPUS}-CPU host, jobs counted by cgroup on every CPU:");
    for grouping in [Grouping::Auto, Grouping::Ungrouped] {
        let (Some((idle_group, idle_fd)), Some((active_group, active_fd))) = (
            cost(&format!("perf cgroup, idle, {grouping:?}")),
            cost(&format!("perf cgroup, running on CPU 1, {grouping:?}")),
        ) else {
            println!("  ({grouping:?}: not measured)");
            continue;
        };
        let (idle, active, reads_per_unit) = match grouping {
            Grouping::Auto => (idle_group.0, active_group, 1),
            Grouping::Ungrouped => (idle_fd.0, active_fd, EVENTS),
        };
        let times = |d: Duration, n: usize| d * u32::try_from(n).unwrap_or(u32::MAX);
        for jobs in JOB_COUNTS {
            let reads = jobs * BIG_HOST_CPUS * reads_per_unit;
            let active_reads = BIG_HOST_CPUS * reads_per_unit;
            let idle_reads = reads.saturating_sub(active_reads);
            let best = times(idle, reads);
            let busy = times(active.0, active_reads) + times(idle, idle_reads);
            let worst = times(active.1, active_reads) + times(idle, idle_reads);
            println!(
                "  {grouping:?}: {jobs:>2} jobs: {:>6} fds, {:>6} reads/tick, CPU/tick \
                 {:>6.2} ms all idle, {:>6.2} ms every CPU running a counted job (median), \
                 {:>6.2} ms (slowest round) = {:.2}% / {:.2}% / {:.2}% of one CPU at 1 tick/s",
                jobs * BIG_HOST_CPUS * EVENTS,
                reads,
                best.as_secs_f64() * 1e3,
                busy.as_secs_f64() * 1e3,
                worst.as_secs_f64() * 1e3,
                best.as_secs_f64() * 100.0,
                busy.as_secs_f64() * 100.0,
                worst.as_secs_f64() * 100.0,
            );
        }
    }
    let per_job = BIG_HOST_CPUS * EVENTS;
    for limit in [1024u64, 65_536, 1_048_576] {
        let cap = FdBudget::for_limit(Some(limit)).cap;
        println!(
            "  fds: with RLIMIT_NOFILE {limit} the perf budget is {cap} fds: {} jobs counted by \
             cgroup on {BIG_HOST_CPUS} CPUs ({per_job} fds each)",
            cap / per_job
        );
    }
}
