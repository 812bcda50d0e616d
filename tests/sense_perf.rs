//! perf and CPU sensing against the real kernel, with the bundled workloads.
//!
//! - `hardware_counters_tell_pointer_chase_from_busy_loop`: real PMU counters on a busy loop and a
//!   pointer chaser; the chaser must show the higher cache-miss ratio and the lower IPC. Skips
//!   (fails under LODGER_REQUIRE_PRIVILEGED=1) where the PMU is missing, as in VMs without a
//!   virtual PMU.
//! - The other tests drive the same machinery with software events, which every kernel with perf
//!   has: inherit across new threads and exec, cgroup counting on every CPU, grouped and ungrouped
//!   reads, cross-checked against the CPU time `sense::cpu` reads from /proc and cgroupfs.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::Duration;

use common::*;
use lodger::cpuset::CpuSet;
use lodger::job::JobId;
use lodger::privileged::skip;
use lodger::sense::cpu::{CgroupCpuReader, CpuReader, JobCpuRate, StallRates};
use lodger::sense::perf::{
    perf_cgroup_root, Counters, EventSource, Grouping, PerfCounters, PerfError, PerfRates,
    PerfSample, PerfSettings, PerfTarget,
};
use lodger::sys::cgroupfs::CgroupVersion;

/// A workload child that has printed its `ready` line; killed on drop.
struct Running(Child);

impl Running {
    fn start(cmd: &mut Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn workload");
        wait_ready(&mut child, &format!("{cmd:?}"));
        Running(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn counters(source: EventSource, grouping: Grouping) -> PerfCounters {
    let mut settings = PerfSettings::new(Path::new("/proc"));
    settings.source = source;
    settings.grouping = grouping;
    PerfCounters::new(settings).expect("perf setup")
}

fn one(samples: Vec<(JobId, PerfSample)>, job: &JobId) -> PerfSample {
    samples
        .into_iter()
        .find(|(id, _)| id == job)
        .map(|(_, s)| s)
        .expect("a sample for the job")
}

fn online() -> CpuSet {
    CpuSet::parse(&online_cpus()).expect("online cpus")
}

#[test]
fn hardware_counters_tell_pointer_chase_from_busy_loop() {
    let name = "hardware_counters_tell_pointer_chase_from_busy_loop";
    let _serial = measuring(); // sensors are compared on CPU time
    let mut c = counters(EventSource::Hardware, Grouping::Auto);
    let status = c.status();
    let missing: Vec<String> = status
        .events
        .iter()
        .filter_map(|e| Some(format!("{}: {}", e.event, e.unavailable.as_ref()?)))
        .collect();
    if !missing.is_empty() {
        // A missing PMU is missing hardware, not a missing privilege: it skips even in CI
        // (LODGER_REQUIRE_HARDWARE=1 makes it fail on machines that have one).
        lodger::privileged::skip_hardware(
            name,
            &format!(
                "hardware counters unavailable ({}); a VM without a virtual PMU logs \
                 'no PMU driver, software events only' at boot",
                missing.join("; ")
            ),
        );
        return;
    }
    if !status.access.can_count_processes() {
        skip(name, &status.problems.join("; "));
        return;
    }
    let busy = Running::start(Command::new(example("busy_loop")).args(["--seconds", "60"]));
    let chase = Running::start(Command::new(example("pointer_chase")).args(["--seconds", "60"]));
    let (jb, jc) = (JobId::from_seq(1), JobId::from_seq(2));
    c.attach(&jb, &PerfTarget::Processes(vec![busy.pid()]))
        .expect("attach busy loop");
    c.attach(&jc, &PerfTarget::Processes(vec![chase.pid()]))
        .expect("attach pointer chase");
    let first = c.read();
    sleep(Duration::from_secs(2));
    let second = c.read();
    let rb = PerfRates::between(&one(first.clone(), &jb), &one(second.clone(), &jb))
        .expect("busy window");
    let rc = PerfRates::between(&one(first, &jc), &one(second, &jc)).expect("chase window");
    eprintln!("busy loop:     {rb:?}");
    eprintln!("pointer chase: {rc:?}");
    let ipc_b = rb.ipc.expect("busy loop IPC");
    let ipc_c = rc.ipc.expect("pointer chase IPC");
    assert!(ipc_c < ipc_b, "IPC: chase {ipc_c} not below busy {ipc_b}");
    let miss_c = rc
        .cache_miss_ratio
        .expect("pointer chase references the cache");
    // A loop that touches no memory may make no cache reference at all: ratio 0, not unknown.
    let miss_b = rb.cache_miss_ratio.unwrap_or(0.0);
    assert!(
        miss_c > miss_b,
        "miss ratio: chase {miss_c} not above busy {miss_b}"
    );
    assert!(rc.mpki > rb.mpki.or(Some(0.0)), "MPKI: {rc:?} vs {rb:?}");
}

/// Task-clock (the Instructions slot with software events) of `sh` that later execs a two-thread
/// busy loop: counted through inherit (exec and new threads), and close to the CPU time /proc
/// reports for the same process.
#[test]
fn software_counters_follow_exec_and_new_threads() {
    let _serial = measuring(); // sensors are compared on CPU time
    for grouping in [Grouping::Auto, Grouping::Ungrouped] {
        let mut c = counters(EventSource::Software, grouping);
        if !c.status().available() {
            skip(
                "software_counters_follow_exec_and_new_threads",
                &format!("software perf events unavailable: {:?}", c.status()),
            );
            return;
        }
        let script = format!(
            "read _ready; exec {} --threads 2 --seconds 20",
            example("busy_loop").display()
        );
        // sh waits on its stdin until counters are attached, so the threads all start after.
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn sh");
        let pid = child.id();
        let job = JobId::from_seq(3);
        let attached = c
            .attach(&job, &PerfTarget::Processes(vec![pid]))
            .expect("attach");
        assert_eq!(attached.groups, 1, "sh has one thread: {attached:?}");
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().expect("stdin");
            stdin.write_all(b"go\n").expect("release sh");
        }
        sleep(Duration::from_millis(500));
        let mut cpu = CpuReader::new(Path::new("/proc"));
        // Seen once before the window, as the sensor sees a job's processes: the window's two
        // readings are then a CPU-time clock each, read just after the sample's timestamp. A
        // first reading walks the stat file first, and a pause of this thread between the
        // timestamp and the clock (an emulated guest with more vCPUs than the host's CPUs: the
        // VM suite) shortens the window's CPU time by the pause times two cores: the likely
        // cause of 1.54 cores against perf's 1.99 there once. The window is 3 s so that a
        // pause weighs less.
        cpu.processes(&[pid]).expect("proc stat");
        let p1 = one(c.read(), &job);
        let c1 = cpu.processes(&[pid]).expect("proc stat");
        sleep(Duration::from_millis(3000));
        let p2 = one(c.read(), &job);
        let c2 = cpu.processes(&[pid]).expect("proc stat");
        let _ = child.kill();
        let _ = child.wait();

        let perf = PerfRates::between(&p1, &p2).expect("window");
        let task_clock_cores = perf.per_second(perf.instructions).expect("task-clock") / 1e9;
        let proc_cores = JobCpuRate::between(&c1, &c2).expect("cpu rate").cores;
        eprintln!(
            "{grouping:?}: perf task-clock {task_clock_cores:.2} cores, /proc {proc_cores:.2} \
             cores, running fraction {:?}",
            perf.running_fraction
        );
        // Both spinning threads were started after attaching: without inherit perf would see
        // only the main thread, which sleeps. /proc counts every thread in 10 ms ticks.
        assert!(task_clock_cores > 0.2, "{grouping:?}: {task_clock_cores}");
        assert!(
            (task_clock_cores - proc_cores).abs() < 0.1 + 0.15 * proc_cores,
            "{grouping:?}: perf {task_clock_cores} vs /proc {proc_cores}"
        );
        assert_eq!(
            perf.running_fraction,
            Some(1.0),
            "software events never multiplex"
        );
    }
}

/// Removes the directories on drop (after moving nothing: the workload is killed first).
struct TempCgroups(Vec<PathBuf>);

impl Drop for TempCgroups {
    fn drop(&mut self) {
        for d in self.0.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// A busy loop in a new cgroup of the perf_event hierarchy (and of v1 cpuacct where mounted):
/// cgroup counters on every online CPU see one core's worth of task-clock, and cgroupfs usage
/// agrees.
#[test]
fn software_counters_count_a_cgroup_on_every_cpu() {
    let name = "software_counters_count_a_cgroup_on_every_cpu";
    let _serial = measuring(); // sensors are compared on CPU time
    if !need_root(name) {
        return;
    }
    let cgroup_root = Path::new("/sys/fs/cgroup");
    let Some(perf_root) = perf_cgroup_root(cgroup_root) else {
        skip(
            name,
            "no cgroup hierarchy serves perf_event under /sys/fs/cgroup",
        );
        return;
    };
    // A v1 hierarchy without perf_event (this build machine's cpuset) is refused with a
    // message that says so, not taken for a missing PMU event.
    let cpuset = cgroup_root.join("cpuset");
    if cpuset.join("cgroup.procs").is_file() && cpuset != perf_root {
        let mut c = counters(EventSource::Software, Grouping::Auto);
        let target = PerfTarget::Cgroup {
            dir: cpuset,
            cpus: online(),
        };
        match c.attach(&JobId::from_seq(9), &target) {
            Err(PerfError::NotPerfCgroup { .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(c.status().available(), "the events stay enabled");
    }
    let leaf = unique("lodger-sense");
    let perf_dir = perf_root.join(&leaf);
    std::fs::create_dir(&perf_dir).expect("create perf cgroup");
    let mut dirs = TempCgroups(vec![perf_dir.clone()]);
    let cpuacct = cgroup_root.join("cpuacct");
    let v1_usage = cpuacct.join("cpuacct.usage").is_file();
    if v1_usage {
        std::fs::create_dir(cpuacct.join(&leaf)).expect("create cpuacct cgroup");
        dirs.0.push(cpuacct.join(&leaf));
    }

    let busy = Running::start(Command::new(example("busy_loop")).args(["--seconds", "30"]));
    for dir in &dirs.0 {
        std::fs::write(dir.join("cgroup.procs"), busy.pid().to_string()).expect("move busy loop");
    }
    let v2_root = if perf_root.join("cgroup.controllers").is_file() {
        Some(perf_root.clone())
    } else {
        None
    };

    for grouping in [Grouping::Auto, Grouping::Ungrouped] {
        let mut c = counters(EventSource::Software, grouping);
        let job = JobId::from_seq(4);
        let cpus = online();
        let attached = c
            .attach(
                &job,
                &PerfTarget::Cgroup {
                    dir: perf_dir.clone(),
                    cpus: cpus.clone(),
                },
            )
            .expect("attach cgroup");
        assert_eq!(attached.groups as usize, cpus.len());
        assert_eq!(attached.fds as usize, cpus.len() * 4);

        let mut v1 = CgroupCpuReader::new(cgroup_root, CgroupVersion::V1);
        let mut v2 = v2_root
            .as_deref()
            .map(|r| CgroupCpuReader::new(r, CgroupVersion::V2));
        // The cgroup files are read just before and just after each perf read, so perf's CPU
        // time over its window lies between theirs over the inner and the outer window,
        // however long the reads take on a loaded machine (a comparison of rates read a
        // moment apart failed CI: cpuacct 0.92 cores against perf 1.03).
        let cgroup_reads = |v1: &mut CgroupCpuReader, v2: &mut Option<CgroupCpuReader>| {
            (
                v1_usage.then(|| v1.usage(&leaf).expect("cpuacct.usage")),
                v2.as_mut().map(|r| r.usage(&leaf).expect("cpu.stat")),
            )
        };
        let lost_before = lost_cpu_seconds();
        let before_p1 = cgroup_reads(&mut v1, &mut v2);
        let p1 = one(c.read(), &job);
        let after_p1 = cgroup_reads(&mut v1, &mut v2);
        let s1 = v2
            .as_mut()
            .and_then(|r| r.pressure(&leaf).expect("cpu.pressure"));
        sleep(Duration::from_millis(1500));
        let before_p2 = cgroup_reads(&mut v1, &mut v2);
        let p2 = one(c.read(), &job);
        let after_p2 = cgroup_reads(&mut v1, &mut v2);
        let lost = lost_cpu_seconds() - lost_before;
        let s2 = v2
            .as_mut()
            .and_then(|r| r.pressure(&leaf).expect("cpu.pressure"));

        let perf = PerfRates::between(&p1, &p2).expect("window");
        let perf_cpu = perf.instructions.expect("task-clock") / 1e9;
        let cores = perf_cpu / perf.window.as_secs_f64();
        eprintln!("{grouping:?}: cgroup task-clock {cores:.2} cores");
        // One spinning thread: at most one core, and something even on a loaded machine.
        assert!(cores > 0.1 && cores < 1.1, "{grouping:?}: {cores}");
        // perf's CPU seconds against the cgroup's over the inner and outer windows, with 3 %
        // and 20 ms of slack for the clocks' granularity. perf's cgroup clock runs while the
        // cgroup is on a CPU, so it also counts the interrupts served and the time a VM's host
        // stole meanwhile, which the cgroup's usage leaves out (a VM here measured 1.504 s
        // against cpuacct's 1.421): up to the node's whole irq, softirq and steal time.
        let within = |file: &str, inner: Option<JobCpuRate>, outer: Option<JobCpuRate>| {
            let (inner, outer) = (
                inner.expect("inner window").cpu.as_secs_f64(),
                outer.expect("outer window").cpu.as_secs_f64(),
            );
            eprintln!(
                "{file}: {inner:.3}-{outer:.3} s of CPU, perf {perf_cpu:.3} s, node irq and \
                 steal {lost:.3} s"
            );
            assert!(
                perf_cpu >= inner * 0.97 - 0.02 && perf_cpu <= (outer + lost) * 1.03 + 0.02,
                "{grouping:?}: perf counted {perf_cpu:.3} s of CPU, {file} between {inner:.3} \
                 and {outer:.3} s over the same window, the node's irq and steal {lost:.3} s"
            );
        };
        if let ((Some(w), _), (Some(x), _), (Some(y), _), (Some(z), _)) =
            (&before_p1, &after_p1, &before_p2, &after_p2)
        {
            within(
                "cpuacct.usage",
                JobCpuRate::between(x, y),
                JobCpuRate::between(w, z),
            );
        }
        if let ((_, Some(w)), (_, Some(x)), (_, Some(y)), (_, Some(z))) =
            (&before_p1, &after_p1, &before_p2, &after_p2)
        {
            within(
                "cpu.stat usage_usec",
                JobCpuRate::between(x, y),
                JobCpuRate::between(w, z),
            );
        }
        if let (Some(a), Some(b)) = (s1, s2) {
            let stall = StallRates::between(&a, &b).expect("psi window");
            eprintln!("cpu.pressure some: {:.3}", stall.some);
            assert!((0.0..=1.0).contains(&stall.some));
        } else {
            // Say which branch ran: the stall check needs a v2 perf hierarchy with PSI.
            eprintln!(
                "{name}: cpu.pressure not checked ({})",
                if v2.is_some() {
                    "the kernel reports no PSI (CONFIG_PSI off or psi=0)"
                } else {
                    "perf_event is on a v1 hierarchy, which has no cpu.pressure"
                }
            );
        }
        assert!(c.detach(&job));
    }
    drop(busy);
    // The busy loop is dead; give the kernel a moment to empty the cgroups before rmdir.
    wait_until(WAIT, "cgroups to empty", || {
        dirs.0.iter().all(|d| {
            std::fs::read_to_string(d.join("cgroup.procs")).is_ok_and(|s| s.trim().is_empty())
        })
    });
}

/// The node's irq, softirq and steal time so far, in seconds (/proc/stat's first line, in
/// USER_HZ ticks of 1/100 s on every Linux architecture lodger runs on).
fn lost_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let cpu = stat.lines().next().expect("the cpu line");
    // cpu user nice system idle iowait irq softirq steal ...
    let ticks: u64 = cpu
        .split_whitespace()
        .skip(6)
        .take(3)
        .map(|t| t.parse::<u64>().expect("a tick count"))
        .sum();
    ticks as f64 / 100.0
}
