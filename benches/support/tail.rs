//! (e) Training's tail beside offline inference (issue 14): the training emulator's step-time
//! distribution (mean, p50, p99, max; p99.9 from 1,000 steps) in two configurations, one that
//! leaves its CPU ~50 % idle and one that keeps it >95 % busy, under every arrangement in the
//! same run: alone (SCHED_OTHER and SCHED_RR 10, CPU 1), default scheduling with an offline
//! instance on the same CPU (both SCHED_OTHER), and under lodgerd with each mechanism:
//!
//! - `rr plain`: SCHED_RR for every thread at one priority, instance SCHED_OTHER (lodger before
//!   issue 14);
//! - `rr roles` (the default): the dispatch thread one RT priority above the loader, instance
//!   SCHED_OTHER;
//! - `rr roles, instance IDLE`: the same with `lodgers_sched_idle = true`;
//! - `rr roles, rt_runtime -1`: the same with the kernel's RT throttling off (the opt-in
//!   `kernel.sched_rt_runtime_us = -1`, set by the benchmark and restored by [`Sysctl`]'s Drop);
//! - `other`: training SCHED_OTHER at nice -10, instance SCHED_IDLE;
//! - `rr roles, a free core`: CPU 0 not reserved, so the RT guard may grow the job by a core when
//!   it nears the RT limit (offline instances then run on both CPUs);
//! - a batch job (issue 18's kind: `membw_hog`, a memory-bandwidth hog) beside training, under
//!   default scheduling on CPU 1, and registered with lodger with no CPU reserved, where it gets
//!   the CPU training leaves (its CPU share is reported instead of an instance's rate).
//!
//! Beside each: the training threads' run-queue wait (`/proc/PID/task/*/schedstat`), stalls
//! (inferred RT throttling: spans of >= 10 ms in which some training thread was runnable at every
//! sample and none ran, sampled every 2 ms from CPU 0), and the offline instance's throughput
//! against the leftover limit (the instance's rate alone on a whole CPU times the share of CPU 1
//! training leaves idle alone, both measured in this run).
//!
//! `LODGER_BENCH_TAIL_STEPS` (default 400) steps per window, so ~9 s; the long mode is 10000
//! (p99.9 from 10,000 steps; about an hour). `LODGER_BENCH_ONLY=tail` runs only this part.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;

/// GPU step of both configurations; the loader's CPU per batch sets how busy the CPU is.
const TAIL_GPU_MS: u64 = 20;
const MILD_BATCH_MS: u64 = 10;
/// Above the GPU step: the loader never waits, so the job keeps its CPU ~100 % busy (a 19-ms
/// batch, calibrated the same way, left it at 65 % here).
const BUSY_BATCH_MS: u64 = 30;
/// The stall sampler's period and the shortest stall it counts.
const STALL_POLL: Duration = Duration::from_millis(2);
const STALL_MIN: Duration = Duration::from_millis(10);
const SCHED_RT_RUNTIME: &str = "/proc/sys/kernel/sched_rt_runtime_us";

/// A sysctl set for the benchmark and put back when dropped (also when a panic unwinds).
struct Sysctl {
    path: &'static str,
    old: String,
}

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Sysctl {
        let old = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("read {path}: {e}"))
            .trim()
            .to_string();
        std::fs::write(path, value).unwrap_or_else(|e| panic!("write {value} to {path}: {e}"));
        Sysctl { path, old }
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(self.path, &self.old) {
            eprintln!("CANNOT RESTORE {} to {}: {e}", self.path, self.old);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arr {
    AloneOther,
    AloneRr,
    Default,
    RrPlain,
    RrRoles,
    RrRolesIdle,
    RrUnthrottled,
    Other,
    RrFreeCore,
    DefaultBatch,
    RrBatch,
}

const ARRS: [(Arr, &str); 11] = [
    (Arr::AloneOther, "alone, SCHED_OTHER"),
    (Arr::AloneRr, "alone, SCHED_RR 10"),
    (Arr::Default, "default scheduling (both SCHED_OTHER)"),
    (
        Arr::RrPlain,
        "lodger rr plain (one RT priority, instance OTHER)",
    ),
    (
        Arr::RrRoles,
        "lodger rr roles (default: dispatch +1, instance OTHER)",
    ),
    (Arr::RrRolesIdle, "lodger rr roles, instance IDLE"),
    (
        Arr::RrUnthrottled,
        "lodger rr roles, sched_rt_runtime_us=-1 (opt-in)",
    ),
    (Arr::Other, "lodger other (nice -10, instance IDLE)"),
    (
        Arr::RrFreeCore,
        "lodger rr roles, CPU 0 free (RT guard may grow)",
    ),
    (
        Arr::DefaultBatch,
        "default scheduling, batch job beside (membw_hog, both SCHED_OTHER, CPU 1)",
    ),
    (
        Arr::RrBatch,
        "lodger rr roles, batch job (membw_hog) on the leftover CPU",
    ),
];

impl Arr {
    /// The `[training]` table lodgerd runs with, and its reserved CPUs.
    fn lodgerd(self) -> Option<(&'static str, &'static str)> {
        match self {
            Arr::AloneOther | Arr::AloneRr | Arr::Default | Arr::DefaultBatch => None,
            Arr::RrPlain => Some(("role_priorities = false\nlodgers_sched_idle = false\n", "0")),
            Arr::RrRoles => Some(("", "0")),
            Arr::RrRolesIdle => Some(("lodgers_sched_idle = true\n", "0")),
            Arr::RrUnthrottled => Some(("allow_unthrottled_rt = true\n", "0")),
            Arr::Other => Some(("policy = \"other\"\n", "0")),
            Arr::RrFreeCore | Arr::RrBatch => Some(("", "")),
        }
    }
}

/// One window's figures.
#[derive(Default, Clone)]
struct Window {
    steps: Vec<f64>,
    /// Training's CPU share of one CPU.
    busy: f64,
    runq_ms_per_s: f64,
    stalls: u32,
    stalled_ms: f64,
    offline_items_per_s: Option<f64>,
    /// A batch job's CPU share of one CPU, where one ran beside.
    batch_busy: Option<f64>,
    cpus: String,
}

/// `(on cpu ns, waiting ns)` summed over a process's threads, and whether any of them is
/// runnable (state `R` in `/proc/PID/task/TID/stat`).
fn thread_sums(pid: u32) -> (u64, u64, bool) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0, false);
    };
    let mut sum = (0u64, 0u64, false);
    for t in tasks.flatten() {
        let text = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
        let v: Vec<u64> = text
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        sum.0 += v.first().copied().unwrap_or(0);
        sum.1 += v.get(1).copied().unwrap_or(0);
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        if let Some(close) = stat.rfind(')') {
            sum.2 |= stat[close + 1..].trim_start().starts_with('R');
        }
    }
    sum
}

/// Samples the training threads every [`STALL_POLL`] on CPU 0 until stopped: counts spans of at
/// least [`STALL_MIN`] in which a thread of the job was runnable at every sample and none ran.
/// (schedstat's wait time is only added when a thread gets the CPU, so it cannot show a stall
/// while it lasts; the running thread's CPU time is brought up to date at least every tick, so
/// a span several ticks long without progress is a stall.)
fn stall_sampler(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u32, f64)> {
    std::thread::spawn(move || {
        let mut cpu0 = nix::sched::CpuSet::new();
        let _ = cpu0.set(0);
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpu0);
        let mut last = (thread_sums(pid), Instant::now());
        let mut run = Duration::ZERO;
        let (mut events, mut total) = (0u32, 0.0f64);
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(STALL_POLL);
            let now = (thread_sums(pid), Instant::now());
            let dt = now.1.duration_since(last.1);
            let ran = now.0 .0.saturating_sub(last.0 .0);
            let stalled = ran == 0 && now.0 .2 && last.0 .2;
            if stalled {
                run += dt;
            } else {
                if run >= STALL_MIN {
                    events += 1;
                    total += run.as_secs_f64() * 1e3;
                }
                run = Duration::ZERO;
            }
            last = now;
        }
        if run >= STALL_MIN {
            events += 1;
            total += run.as_secs_f64() * 1e3;
        }
        (events, total)
    })
}

/// The training emulator with `units` of work per batch, on `cpus` (None: anywhere), RR or not.
fn train(b: &mut Bench, units: f64, cpus: Option<&str>, rr: bool) -> Proc {
    let report = b.path("tail-train.jsonl");
    let mut child = command(&example("train_emulator"), cpus, rr)
        .args(["--workers", "1", "--gpu-step-ms", &TAIL_GPU_MS.to_string()])
        .args(["--work-per-batch", &units.to_string()])
        .arg("--report")
        .arg(&report)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn train_emulator");
    wait_ready(&mut child, "train_emulator");
    Proc {
        child,
        out: Some(report),
    }
}

/// A memory-bandwidth hog as a user's CPU-only batch job (issue 18's kind), on `cpus` or
/// unpinned.
fn batch_hog(cpus: Option<&str>) -> Proc {
    let mut child = command(&example("membw_hog"), cpus, false)
        .args(["--mib", "256"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn membw_hog");
    wait_ready(&mut child, "membw_hog");
    Proc { child, out: None }
}

/// Measures the window: steps, CPU, run-queue wait and stalls of `t`, `offline` (lodgerd's
/// figure for a job id, or a pinned worker's report lines) and the CPU share of `batch`.
fn measure(
    t: &Proc,
    window: Duration,
    offline: Option<(&Daemon, &str)>,
    worker: Option<&Proc>,
    batch: Option<&Proc>,
) -> Window {
    std::thread::sleep(WARMUP);
    let a = mark(&[t]);
    let w0 = worker.map(|w| mark(&[w]));
    let batch0 = batch.map(|p| proc_ticks(p.pid()));
    let ticks0 = proc_ticks(t.pid());
    let sums0 = thread_sums(t.pid());
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = stall_sampler(t.pid(), stop.clone());
    let offline_rate = match offline {
        Some((d, id)) => Some(sampled_items_per_s(d, id, window)),
        None => {
            std::thread::sleep(window);
            None
        }
    };
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let (stalls, stalled_ms) = sampler.join().unwrap_or((0, 0.0));
    let sums1 = thread_sums(t.pid());
    let ticks = proc_ticks(t.pid()).saturating_sub(ticks0) as f64;
    let z = mark(&[t]);
    let lines = between(&[t], &a, &z).remove(0);
    let worker_rate = worker.zip(w0).map(|(w, w0)| {
        let w1 = mark(&[w]);
        items_per_s(&between(&[w], &w0, &w1)[0], start.elapsed())
    });
    let batch_busy = batch.zip(batch0).map(|(p, t0)| {
        proc_ticks(p.pid()).saturating_sub(t0) as f64 / ticks_per_second() / elapsed
    });
    Window {
        steps: lines.iter().filter_map(|l| field(l, "iter_ms")).collect(),
        busy: ticks / ticks_per_second() / elapsed,
        runq_ms_per_s: sums1.1.saturating_sub(sums0.1) as f64 / 1e6 / elapsed,
        stalls,
        stalled_ms,
        offline_items_per_s: offline_rate.or(worker_rate),
        batch_busy,
        cpus: String::new(),
    }
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf takes an integer and returns one.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Waits until lodgerd reports every thread of the job in its class, on its cpuset.
fn wait_enforced(d: &Daemon, id: &str) -> String {
    wait_until(WAIT, "training job enforced", || {
        let j = d.job(id);
        j["state"] == "running"
            && j["threads"].as_u64().is_some_and(|n| n > 0)
            && j["rr_threads"] == j["threads"]
    });
    d.job(id)["cpus"].as_str().unwrap_or("").to_string()
}

fn one(b: &mut Bench, bus: &PrivateBus, arr: Arr, units: f64, window: Duration) -> Window {
    match arr {
        Arr::AloneOther | Arr::AloneRr => {
            let t = train(b, units, Some(TRAIN_CPU), arr == Arr::AloneRr);
            measure(&t, window, None, None, None)
        }
        Arr::Default => {
            let inf = b.offline_worker(Some(TRAIN_CPU), MODEL_MIB, 1, OFFLINE_BATCH);
            let t = train(b, units, Some(TRAIN_CPU), false);
            measure(&t, window, None, Some(&inf), None)
        }
        Arr::DefaultBatch => {
            let hog = batch_hog(Some(TRAIN_CPU));
            let t = train(b, units, Some(TRAIN_CPU), false);
            measure(&t, window, None, None, Some(&hog))
        }
        Arr::RrBatch => {
            let dir = tempfile::tempdir().expect("tempdir");
            let d = Daemon::start(
                bus,
                dir.path(),
                DaemonOptions {
                    reserved: "",
                    ..DaemonOptions::default()
                },
            );
            let t = train(b, units, None, false);
            let id = d.register_pid(t.pid(), 1);
            wait_enforced(&d, &id);
            let hog = batch_hog(None);
            let v = d.ctl_json(&["register", "batch", "--pid", &hog.pid().to_string()]);
            let batch = v["id"].as_str().expect("batch id").to_string();
            wait_until(WAIT, "the batch job placed", || {
                d.job(&batch)["state"] == "running"
            });
            let mut w = measure(&t, window, None, None, Some(&hog));
            w.cpus = format!(
                "{} (batch job on {})",
                d.job(&id)["cpus"].as_str().unwrap_or(""),
                d.job(&batch)["cpus"].as_str().unwrap_or("")
            );
            d.ctl_ok(&["unregister", &batch]);
            d.ctl_ok(&["unregister", &id]);
            w
        }
        _ => {
            let (training, reserved) = arr.lodgerd().expect("a lodgerd arrangement");
            let _unthrottled =
                (arr == Arr::RrUnthrottled).then(|| Sysctl::set(SCHED_RT_RUNTIME, "-1"));
            let dir = tempfile::tempdir().expect("tempdir");
            let d = Daemon::start(
                bus,
                dir.path(),
                DaemonOptions {
                    reserved,
                    extra: format!(
                        "[inference]\nprobe_seconds = 1\nstop_grace_seconds = 2\n\n[training]\n{training}"
                    ),
                    ..DaemonOptions::default()
                },
            );
            let t = train(b, units, None, false);
            let id = d.register_pid(t.pid(), 1);
            wait_enforced(&d, &id);
            let n = if reserved.is_empty() { 2 } else { 1 };
            let off = register_offline(&d, n);
            let inst: Vec<String> = running(&d.job(&off))
                .iter()
                .filter_map(|i| i["pid"].as_u64())
                .map(|p| {
                    let p = u32::try_from(p).unwrap_or(0);
                    let cpu_group = std::fs::read_to_string(format!("/proc/{p}/cgroup"))
                        .unwrap_or_default()
                        .lines()
                        .find(|l| l.contains(":cpu,") || l.contains(":cpu:"))
                        .unwrap_or("")
                        .to_string();
                    format!("instance {p}: policy {:?}, {cpu_group}", sched_of(p))
                })
                .collect();
            let nice: Vec<String> = tids(t.pid())
                .iter()
                .map(|&tid| format!("{:?}", sched_of(tid)))
                .collect();
            println!(
                "(e)   {arr:?}: training threads (policy, prio) {}; {}",
                nice.join(" "),
                inst.join("; ")
            );
            let mut w = measure(&t, window, Some((&d, &off)), None, None);
            w.cpus = d.job(&id)["cpus"].as_str().unwrap_or("").to_string();
            let rt = d.job(&id)["rt"].as_str().unwrap_or("").to_string();
            if !rt.is_empty() {
                w.cpus = format!("{} [{rt}]", w.cpus);
            }
            d.ctl_ok(&["unregister", &off]);
            d.ctl_ok(&["unregister", &id]);
            w
        }
    }
}

fn stats(xs: &[f64]) -> String {
    let p999 = if xs.len() >= 1000 {
        format!(", p99.9 {:.1}", percentile(xs, 0.999))
    } else {
        String::new()
    };
    format!(
        "mean {:.2}, p50 {:.1}, p99 {:.1}, max {:.1}{p999} ms ({} steps)",
        mean(xs),
        percentile(xs, 0.5),
        percentile(xs, 0.99),
        xs.iter().copied().fold(f64::NAN, f64::max),
        xs.len()
    )
}

pub(super) fn scenario_e(b: &mut Bench, bus: &PrivateBus) -> Vec<(String, String)> {
    let steps = env_u64("LODGER_BENCH_TAIL_STEPS", 400);
    let rounds = u32::try_from(env_u64("LODGER_BENCH_TAIL_ROUNDS", 1)).unwrap_or(1);
    let mut rows = Vec::new();
    // The instance alone on CPU 1: its rate on a whole CPU, for the leftover limit.
    let solo = {
        let inf = b.offline_worker(Some(TRAIN_CPU), MODEL_MIB, 1, OFFLINE_BATCH);
        std::thread::sleep(WARMUP);
        let a = mark(&[&inf]);
        let win = Duration::from_secs(4);
        std::thread::sleep(win);
        let z = mark(&[&inf]);
        items_per_s(&between(&[&inf], &a, &z)[0], win)
    };
    println!("(e) offline instance alone on CPU 1: {solo:.0} items/s");
    for (cfg, batch_ms) in [("~50% busy", MILD_BATCH_MS), (">95% busy", BUSY_BATCH_MS)] {
        let units = calibrate(TRAIN_CPU, batch_ms, &[]);
        // The step is at least the GPU step; the window holds `steps` of them.
        let window = Duration::from_millis(steps * (TAIL_GPU_MS + 1));
        let mut all: BTreeMap<usize, Window> = BTreeMap::new();
        for round in 1..=rounds {
            for k in order(ARRS.len(), round) {
                let (arr, name) = ARRS[k];
                let w = one(b, bus, arr, units, window);
                println!(
                    "(e) {cfg} round {round}: {name}: {}; busy {:.0}%; run-queue wait {:.1} ms/s; stalls {} ({:.0} ms){}{}; load {}",
                    stats(&w.steps),
                    w.busy * 100.0,
                    w.runq_ms_per_s,
                    w.stalls,
                    w.stalled_ms,
                    w.offline_items_per_s
                        .map(|r| format!("; offline {r:.0} items/s"))
                        .or(w.batch_busy.map(|c| format!("; batch job {:.0}% of a CPU", c * 100.0)))
                        .unwrap_or_default(),
                    if w.cpus.is_empty() {
                        String::new()
                    } else {
                        format!("; training on CPUs {}", w.cpus)
                    },
                    load_average()
                );
                let e = all.entry(k).or_default();
                e.steps.extend(w.steps);
                e.busy += w.busy / f64::from(rounds);
                e.runq_ms_per_s += w.runq_ms_per_s / f64::from(rounds);
                e.stalls += w.stalls;
                e.stalled_ms += w.stalled_ms;
                e.offline_items_per_s = match (e.offline_items_per_s, w.offline_items_per_s) {
                    (Some(a), Some(r)) => Some(a + r / f64::from(rounds)),
                    (None, Some(r)) => Some(r / f64::from(rounds)),
                    (a, None) => a,
                };
                e.batch_busy = match (e.batch_busy, w.batch_busy) {
                    (Some(a), Some(c)) => Some(a + c / f64::from(rounds)),
                    (None, Some(c)) => Some(c / f64::from(rounds)),
                    (a, None) => a,
                };
                e.cpus = w.cpus;
            }
        }
        let alone = &all[&0];
        let (alone_mean, alone_p99) = (mean(&alone.steps), percentile(&alone.steps, 0.99));
        let leftover = (1.0 - alone.busy).max(0.0) * solo;
        println!(
            "(e) {cfg}: training alone uses {:.0}% of CPU 1; leftover limit {leftover:.0} items/s ({:.0}% of the instance's {solo:.0} items/s alone)",
            alone.busy * 100.0,
            (1.0 - alone.busy).max(0.0) * 100.0
        );
        for (k, (_, name)) in ARRS.iter().enumerate() {
            let w = &all[&k];
            let m = mean(&w.steps);
            let p99 = percentile(&w.steps, 0.99);
            let offline = w
                .offline_items_per_s
                .map(|r| {
                    format!(
                        "; offline {r:.0} items/s = {:.0}% of the leftover limit",
                        r / leftover.max(1e-9) * 100.0
                    )
                })
                .or(w
                    .batch_busy
                    .map(|c| format!("; batch job {:.0}% of a CPU", c * 100.0)))
                .unwrap_or_default();
            let summary = format!(
                "{}; mean {:+.1}% / p99 {:.2}x vs alone OTHER; run-queue wait {:.1} ms/s; stalls >=10 ms: {} ({:.0} ms){offline}",
                stats(&w.steps),
                (m / alone_mean - 1.0) * 100.0,
                p99 / alone_p99,
                w.runq_ms_per_s,
                w.stalls,
                w.stalled_ms,
            );
            println!("(e) {cfg}: {name}: {summary}");
            rows.push((format!("(e) {cfg}: {name}"), summary));
        }
    }
    rows
}
