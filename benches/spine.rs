//! Spine benchmark (run as root: `scripts/bench-spine`; it builds the examples first).
//!
//! 1. Registration latency: 200 registrations of a 16-thread training emulator through D-Bus;
//!    for each, the time until `RegisterJob` returns and until every thread is seen SCHED_RR on
//!    its cpuset (read from /proc by this process), p50/p99, beside 200 `GetStatus` round trips
//!    and lodgerd's own phases (its debug log); then the same with 50 jobs registered, on the
//!    64-CPU fixture under `--sim` (this machine cannot place 50 training jobs). The bus daemon
//!    and the caller run on the reserved CPU, as a node's system services do (`Housekeeping`);
//!    one more run leaves them anywhere, for comparison.
//! 2. Enforcement cost per tick, real kernel: 50 jobs of 4 threads, 10 of 50 and 10 of 200, held
//!    by one `Enforcer`, with every thread listed every tick (the baseline) and with the kernel's
//!    process events (issue 21), in the same run; then, with events, 12 ticks 1 s apart (every
//!    job's safety-net sweep falls in one of them): their mean and the worst tick, beside the
//!    baseline's tick, which is what a tick sweeping every job at once costs.
//! 3. A pid job's descendants on a busy node (issue 21 item 2): the CPU time of an apply that
//!    sweeps a pid job pinned by affinity (4 jobs, each a shell forking a `sleep` every 50 ms,
//!    so that every 100-ms tick sweeps it), on a quiet node and beside a shell forking
//!    `/bin/true` back to back outside every job (stopped and let go between ticks, so the quiet
//!    and busy ticks alternate in one run): with the process table read again from /proc
//!    whenever a task was created on the node (the baseline, the way before) and with the table
//!    kept from the process events, in the same run, and what lodgerd spends per process created
//!    outside every job (the processes created counted from /proc/stat). The node is filled up to
//!    `LODGER_BENCH_NODE_PROCS` processes (default 500) with sleeping ones, since a rescan's
//!    cost grows with them. Then an inference instance's move by affinity (a shell and its two
//!    children) on the same node: its descendants from every process's parent read from /proc
//!    on each pass (the baseline, before) and from its threads' children, in the same run; and
//!    a pid job's first apply (a registration) by an enforcer whose process table is not fresh,
//!    with the table read from /proc in full first (the baseline) and walking the job's tree.
//! 4. lodgerd idle over 60 s: CPU time and RSS with 50 registered jobs (simulated enforcement on
//!    the 64-CPU fixture topology, since this 2-CPU machine cannot host 50 placements) against the
//!    same lodgerd with no job.
//!
//! `LODGER_BENCH_ONLY=registration|enforcement|descendants|idle` runs one part.
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "spine/descendants.rs"]
mod descendants;
#[path = "support/sleeper.rs"]
mod sleeper;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use lodger::cpuset::CpuSet;
use lodger::enforce::quiet::FULL_SWEEP_EVERY;
use lodger::enforce::{EnforceSettings, Enforcer, JobRecord};
use lodger::job::{JobId, Target};
use sleeper::Sleeper;
use zbus::zvariant::Value;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Jobs j1, j2, ... of one root process each, with empty records, for an enforcer to hold.
fn held_jobs(roots: impl Iterator<Item = u32>) -> Vec<(JobId, Target, JobRecord)> {
    roots
        .enumerate()
        .map(|(i, pid)| {
            (
                JobId::from_seq(i as u64 + 1),
                Target::Pids(vec![pid]),
                JobRecord::default(),
            )
        })
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// utime + stime of a process, in clock ticks, and its VmRSS in KiB.
fn cpu_and_rss(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let cpu = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    (cpu, rss)
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// p50 and p99 of `xs`, in ms.
fn p50_p99(xs: &mut [Duration]) -> (f64, f64) {
    xs.sort();
    (ms(percentile(xs, 0.5)), ms(percentile(xs, 0.99)))
}

/// 200 registrations and unregistrations of one 16-thread process, with `others` jobs of 10
/// sleeping threads registered first (on the 64-CPU fixture under `--sim` when there are any:
/// this machine cannot place 50 training jobs), against 200 `GetStatus` round trips in the same
/// run; then where lodgerd's own time went, from its debug log.
/// `light`: the registered process's 14 loaders do 2 ms of CPU per 100-ms step (0.3 CPU in
/// all) instead of the emulator's default 10 ms per 20-ms step; the default keeps both of this
/// machine's CPUs busy enough that the bus and lodgerd wait behind its loaders now and then,
/// which the `GetStatus` baseline shows too.
fn registration_latency(others: usize, light: bool, housekeeping: bool) {
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = others > 0;
    let d = Daemon::start(
        &bus,
        dir.path(),
        if sim {
            DaemonOptions {
                reserved: "auto",
                sysfs_root: Some(
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("tests/fixtures/sysfs/server-2s-64cpu-8gpu"),
                ),
                sim: true,
                ..DaemonOptions::default()
            }
        } else {
            DaemonOptions::default()
        },
    );
    let sleepers: Vec<Sleeper> = (0..others).map(|_| Sleeper::start(10)).collect();
    let w = if light {
        Workload::train_with(14, LIGHT)
    } else {
        Workload::train(14)
    };
    let pid = w.pid();
    let threads = tids(pid).len();
    let (rt, proxy) = bus.manager();
    // After the workload started, so its threads keep every CPU.
    let _confined = housekeeping.then(|| Housekeeping::confine(&[bus.pid()]));
    let spec = |pid: u32| {
        let mut spec: HashMap<&str, Value<'_>> = HashMap::new();
        spec.insert("kind", Value::from("training"));
        spec.insert("pids", Value::from(vec![pid]));
        spec.insert("cores", Value::from(1u32));
        spec
    };
    for s in &sleepers {
        rt.block_on(proxy.register_job(spec(s.pid())))
            .expect("register one of the others");
    }
    let mut status = Vec::new();
    for _ in 0..200 {
        let t0 = Instant::now();
        rt.block_on(proxy.get_status()).expect("GetStatus");
        status.push(t0.elapsed());
    }
    let mut to_return = Vec::new();
    let mut to_all_rr = Vec::new();
    for _ in 0..200 {
        let t0 = Instant::now();
        let (id, _) = rt
            .block_on(proxy.register_job(spec(pid)))
            .expect("register");
        let t1 = Instant::now();
        to_return.push(t1 - t0);
        if !sim {
            while !all_rr_on(pid, 10, "1") {
                assert!(t0.elapsed() < WAIT, "threads never became RR");
                std::hint::spin_loop();
            }
            to_all_rr.push(t0.elapsed());
        }
        rt.block_on(proxy.unregister_job(&id)).expect("unregister");
        if !sim {
            assert!(all_other(pid), "unregister did not revert");
        }
    }
    let (s50, s99) = p50_p99(&mut status);
    let (r50, r99) = p50_p99(&mut to_return);
    let shape = if sim {
        format!("{others} other jobs registered (64-CPU fixture, --sim: placement, state and D-Bus real, kernel writes not made)")
    } else {
        "no other job (this machine, real kernel)".to_string()
    };
    let load = if light {
        "light: 0.3 CPU"
    } else {
        "the emulator's default load"
    };
    let placed = if housekeeping {
        "bus daemon and caller on the reserved CPU 0"
    } else {
        "bus daemon and caller on any CPU"
    };
    println!("registration of a {threads}-thread process ({load}), 200 runs, {shape}, {placed}:");
    println!("  GetStatus round trip p50 {s50:.2} ms p99 {s99:.2} ms (the baseline)");
    print!("  RegisterJob returned p50 {r50:.2} ms p99 {r99:.2} ms ({:.1}x GetStatus's p99; targets p99 <= 5 ms: {}, <= 10x: {})",
        r99 / s99,
        if r99 <= 5.0 { "met" } else { "MISSED" },
        if r99 <= 10.0 * s99 { "met" } else { "MISSED" },
    );
    if sim {
        println!();
    } else {
        let (a50, a99) = p50_p99(&mut to_all_rr);
        println!(
            "; every thread RR on its cpuset p50 {a50:.2} ms p99 {a99:.2} ms ({:.1}x GetStatus's p99: {})",
            a99 / s99,
            if a99 <= 10.0 * s99 { "met" } else { "MISSED" }
        );
    }
    // lodgerd's own phases: `registration timing: plan A us, pending B us, enforce C us, commit D us`,
    // and the D-Bus method around them: `register call timing: check A us, agent B us, export C us`.
    let log = d.log();
    let inside = phase_figures(
        &log,
        "registration timing: ",
        &[
            "plan",
            "intent file",
            "enforcement",
            "commit to the intent file",
        ],
    );
    println!("  inside lodgerd: {inside}");
    let call = phase_figures(
        &log,
        "register call timing: ",
        &["caller check", "agent", "object export"],
    );
    println!("  the D-Bus method: {call}");
    let command = phase_figures(&log, "register command timing: ", &["queued", "handled"]);
    println!("  the agent's command: {command}");
    drop(d);
}

/// p50 and p99 of each phase of lodgerd's debug lines `<marker>name A us, name B us, ...`.
fn phase_figures(log: &str, marker: &str, names: &[&str]) -> String {
    let mut phases: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    for line in log.lines() {
        let Some(rest) = line.split(marker).nth(1) else {
            continue;
        };
        let nums: Vec<u64> = rest
            .split(',')
            .filter_map(|p| p.split_whitespace().nth(1)?.parse().ok())
            .collect();
        if nums.len() == names.len() {
            for (v, n) in phases.iter_mut().zip(nums) {
                v.push(Duration::from_micros(n));
            }
        }
    }
    let parts: Vec<String> = names
        .iter()
        .zip(phases.iter_mut())
        .filter(|(_, v)| !v.is_empty())
        .map(|(n, v)| {
            let (a, b) = p50_p99(v);
            format!("{n} p50 {a:.2} p99 {b:.2} ms")
        })
        .collect();
    parts.join(", ")
}

/// The bus daemon and every thread of this process on CPU 0, lodgerd's reserved CPU here, as a
/// node keeps its system services on its housekeeping CPUs (`reserved_cpus`); put back as they
/// were when dropped. Without it, a training job made SCHED_RR on CPU 1 with the emulator's
/// default load (about 0.95 of CPU 1 at real-time priority) holds off whichever of the bus
/// daemon and the caller the scheduler left there, until the load balancer moves it.
struct Housekeeping {
    before: Vec<(nix::unistd::Pid, nix::sched::CpuSet)>,
}

impl Housekeeping {
    fn confine(pids: &[u32]) -> Housekeeping {
        use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
        use nix::unistd::Pid;
        let own = std::fs::read_dir("/proc/self/task")
            .expect("own tasks")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok());
        let all: Vec<Pid> = own
            .chain(pids.iter().filter_map(|p| i32::try_from(*p).ok()))
            .map(Pid::from_raw)
            .collect();
        let mut zero = CpuSet::new();
        zero.set(0).expect("CPU 0");
        let mut before = Vec::new();
        for pid in all {
            let was = sched_getaffinity(pid).expect("affinity");
            sched_setaffinity(pid, &zero).expect("pin to CPU 0");
            before.push((pid, was));
        }
        Housekeeping { before }
    }
}

impl Drop for Housekeeping {
    fn drop(&mut self) {
        for (pid, was) in &self.before {
            let _ = nix::sched::sched_setaffinity(*pid, was);
        }
    }
}

fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time of enforcement ticks over real jobs.
struct TickCost {
    /// One tick, back to back (no safety-net sweep falls due).
    steady: Duration,
    /// With process events: ticks a second apart for a safety-net period and a bit, so every
    /// job's sweep falls in one of them; their mean and the worst.
    paced: Option<(Duration, Duration)>,
}

/// CPU time of one enforcement tick over `jobs` real jobs of `threads` sleeping threads each,
/// all on CPU 1: with every thread listed every tick (`events: false`, the way before issue
/// 21), or with the kernel's process events: the steady figure (nothing happened to the jobs),
/// and ticks at the default 1-s interval, the safety net's sweeps included.
fn enforcement_tick(jobs: usize, threads: usize, events: bool) -> TickCost {
    let parent = unique("lodger-bench");
    let enforcer = Enforcer::new(EnforceSettings {
        parent: parent.clone(),
        process_events: events,
        ..EnforceSettings::default()
    })
    .expect("enforcer");
    assert_eq!(
        enforcer.event_driven(),
        events,
        "process events unavailable"
    );
    let cpus = CpuSet::parse("1").expect("cpus");
    let mems = CpuSet::parse("0").expect("mems");
    let workloads: Vec<Sleeper> = (0..jobs).map(|_| Sleeper::start(threads)).collect();
    let mut held = held_jobs(workloads.iter().map(Sleeper::pid));
    // First applies register; roles settle (quiet::ROLES_SETTLE) before the steady state.
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(6) {
        for (id, t, r) in held.iter_mut() {
            enforcer.apply(id, t, &cpus, &mems, r).expect("apply");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let ticks = 30;
    let c0 = thread_cpu_time();
    for _ in 0..ticks {
        for (id, t, r) in held.iter_mut() {
            let o = enforcer.apply(id, t, &cpus, &mems, r).expect("apply");
            assert!(o.alive && o.threads as usize == threads, "{o:?}");
        }
    }
    let steady = (thread_cpu_time() - c0) / ticks;
    let paced = events.then(|| {
        let mut costs = Vec::new();
        let start = Instant::now();
        while start.elapsed() < FULL_SWEEP_EVERY + Duration::from_secs(2) {
            std::thread::sleep(Duration::from_secs(1));
            let c0 = thread_cpu_time();
            for (id, t, r) in held.iter_mut() {
                enforcer.apply(id, t, &cpus, &mems, r).expect("apply");
            }
            costs.push(thread_cpu_time() - c0);
        }
        let mean = costs.iter().sum::<Duration>() / costs.len().max(1) as u32;
        (mean, costs.iter().copied().max().unwrap_or_default())
    });
    for (id, t, r) in &held {
        enforcer.release(id, t, r).expect("release");
    }
    enforcer.tidy();
    TickCost { steady, paced }
}

fn steady_enforcement_cost() {
    println!(
        "enforcement tick, real kernel (cgroup pinning, SCHED_RR, sleeping threads on CPU 1):"
    );
    for (jobs, threads) in [(50usize, 4usize), (10, 50), (10, 200)] {
        let full = enforcement_tick(jobs, threads, false).steady;
        let with_events = enforcement_tick(jobs, threads, true);
        let steady = with_events.steady;
        let every = FULL_SWEEP_EVERY.as_secs_f64();
        // At a 1-s tick, one tick in `every` is a full sweep.
        let amortized = steady.as_secs_f64() + full.as_secs_f64() / every;
        println!(
            "  {jobs} jobs x {threads} threads: every thread every tick {:.1} us/tick (baseline); with process events {:.1} us/tick steady, {:.1} us/tick with a full sweep every {every:.0} s at a 1-s tick ({:.1}x less than the baseline); per thread {:.2} -> {:.2} us",
            full.as_secs_f64() * 1e6,
            steady.as_secs_f64() * 1e6,
            amortized * 1e6,
            full.as_secs_f64() / amortized,
            full.as_secs_f64() * 1e6 / (jobs * threads) as f64,
            amortized * 1e6 / (jobs * threads) as f64,
        );
        if let Some((mean, worst)) = with_events.paced {
            // Jobs swept at once were swept together every period after, one tick costing
            // about the baseline's; each now falls due in its own slot (quiet::SWEEP_SLOTS).
            println!(
                "    ticks 1 s apart over {:.0} s: mean {:.1} us/tick, worst {:.1} us (a tick sweeping every job: the baseline's {:.1} us; worst / baseline {:.2})",
                every + 2.0,
                mean.as_secs_f64() * 1e6,
                worst.as_secs_f64() * 1e6,
                full.as_secs_f64() * 1e6,
                worst.as_secs_f64() / full.as_secs_f64()
            );
        }
    }
}

fn lodgerd_idle(seconds: u64) {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sysfs/server-2s-64cpu-8gpu");
    let run = |jobs: usize| -> (f64, u64) {
        let bus = PrivateBus::start();
        let dir = tempfile::tempdir().expect("tempdir");
        let d = Daemon::start(
            &bus,
            dir.path(),
            DaemonOptions {
                reserved: "auto",
                interval_ms: 1000,
                sysfs_root: Some(fixture.clone()),
                sim: true,
                ..DaemonOptions::default()
            },
        );
        let workloads: Vec<Workload> = (0..jobs).map(|_| Workload::train(2)).collect();
        for w in &workloads {
            d.register_pid(w.pid(), 1);
        }
        let pid = d.pid();
        let (c0, _) = cpu_and_rss(pid);
        std::thread::sleep(Duration::from_secs(seconds));
        let (c1, rss) = cpu_and_rss(pid);
        let cpu_pct = (c1 - c0) as f64 / clk_tck() / seconds as f64 * 100.0;
        (cpu_pct, rss)
    };
    let (base_cpu, base_rss) = run(0);
    let (cpu, rss) = run(50);
    println!(
        "lodgerd idle over {seconds} s (1 s interval, simulated enforcement, 64-CPU fixture): 0 jobs {base_cpu:.3}% CPU {base_rss} KiB RSS; 50 jobs {cpu:.3}% CPU {rss} KiB RSS (RSS {:.2}x)",
        rss as f64 / base_rss.max(1) as f64
    );
}

fn main() {
    sleeper::serve_if_asked();
    if !lodger::privileged::need_root("bench spine") {
        return;
    }
    let seconds = std::env::var("LODGER_BENCH_IDLE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    // LODGER_BENCH_ONLY: one part (registration, enforcement, descendants or idle); all by
    // default.
    let only = std::env::var("LODGER_BENCH_ONLY").unwrap_or_default();
    let part = |name: &str| only.is_empty() || only == name;
    if part("registration") {
        for light in [false, true] {
            registration_latency(0, light, true);
            registration_latency(50, light, true);
        }
        // The comparison: the bus daemon and the caller left anywhere.
        registration_latency(0, false, false);
    }
    if part("enforcement") {
        steady_enforcement_cost();
    }
    if part("descendants") {
        descendants::descendants_on_a_busy_node();
    }
    if part("idle") {
        lodgerd_idle(seconds);
    }
}
