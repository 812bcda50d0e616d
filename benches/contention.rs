//! Contention benchmark (issue 7, SODA §V-E), with the bundled workloads and a real lodgerd on a
//! private bus. Run as root: `cargo bench --bench contention` (it builds the release examples
//! itself first; about two minutes).
//!
//! Every figure is measured in this run and every ratio is between figures of this run. Each
//! arrangement is measured `LODGER_BENCH_ROUNDS` times (default 2), arrangements interleaved
//! within a round (reversed in even rounds), each for a `LODGER_BENCH_WINDOW_S` window (default
//! 6 s) after 1 s of warm-up.
//!
//! Training: `train_emulator --workers 1 --gpu-step-ms 20 --loader-mib 256`, ~15 ms of CPU per
//! batch (calibrated once, then fixed), so its memory-bound loader keeps one CPU ~75 % busy and
//! the emulated GPU is the bottleneck, as for a right-sized job: a slowdown of the loader shows
//! in the iteration time only once it passes a third. So each arrangement also reports
//! training's CPU time per iteration, which memory contention lengthens one to one. The hog:
//! `membw_hog --mib 1024` (STREAM triad, one thread).
//!
//! The machine is shared. The benchmark raises its own session's autogroup to nice -20 for the
//! run (as the lodgers benchmark does: every arrangement runs in that one group, so it changes
//! what other sessions take, not how arrangements compare) and prints the CPU other processes
//! used in each window.
//!
//! Iteration time (the emulator's mean `iter_ms`) and training's CPU time per iteration of:
//! - alone: training on CPU 1, SCHED_OTHER; and alone with SCHED_RR 10 (what lodger gives it);
//! - memory only: training on CPU 1, one hog on CPU 0, both SCHED_OTHER: nothing is shared but
//!   the memory system, so this is what the hog's bandwidth alone does to training;
//! - unmanaged: training and one hog per CPU (CPUs 0 and 1), all SCHED_OTHER, as they would run
//!   without lodger on the CPUs lodger would use;
//! - under lodger: lodgerd (`reserved_cpus = ""`, emulated GPU, `[contention]` enforcing with
//!   `pressure_ticks = 3`, `calm_ticks = 10` over 200 ms sensing passes) places training on one
//!   CPU, SCHED_RR, and runs the hogs as an offline job, one instance per CPU; the window also
//!   counts the throttle steps lodgerd took.
//!
//! Reaction, in each round after the lodger window: a real-time thread at RR 11 takes 80 % of
//! training's CPU (see `RtAntagonist`: the hog cannot slow SCHED_RR training on this machine,
//! so the drop is made this way). lodgerd's view is polled over D-Bus every 25 ms: the training
//! job's GPU utilization and the hog job's throttle. Reported in sensing passes (time over the
//! pass interval): from the first pass showing the drop (below the stable level by more than
//! the noise, both as the throttle's evidence states them) to the throttle (expected:
//! `pressure_ticks` - 1, since the pressured pass that completes the run throttles), from the
//! antagonist's start to the throttle (adds the emulator's 1 s publishing window), and, once
//! the antagonist stops, from the first calm pass to the give-back (expected: `calm_ticks` - 1).
#[path = "../tests/common/mod.rs"]
mod common;
mod support;
#[path = "contention/view.rs"]
mod view;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::contention::{CALM_TICKS, PRESSURE_TICKS, SENSE_MS};
use common::*;
use lodger::api::proxy::ManagerProxy;
use support::*;
use view::*;
use zbus::zvariant::{OwnedValue, Value};

const TRAIN_WORKERS: u32 = 1;
const GPU_STEP_MS: u64 = 20;
const BATCH_CPU_MS: u64 = 15;
const LOADER_MIB: u64 = 256;
const HOG_MIB: u64 = 1024;
const TRAIN_CPU: &str = "1";
const OTHER_CPU: &str = "0";
const ANTAGONIST_RT: i32 = 11;
const ANTAGONIST_BUSY_PERCENT: u32 = 80;
const WARMUP: Duration = Duration::from_secs(1);
const POLL: Duration = Duration::from_millis(25);
const REACT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Processes

struct Bench {
    dir: tempfile::TempDir,
    seq: u32,
    work_units: f64,
    window: Duration,
}

impl Bench {
    fn path(&mut self, what: &str) -> PathBuf {
        self.seq += 1;
        self.dir.path().join(format!("{what}-{}", self.seq))
    }

    /// The training emulator, running until stopped; its per-iteration report in a file.
    fn train(&mut self, cpus: Option<&str>, rr: bool, publish: Option<&Path>) -> Proc {
        let report = self.path("train.jsonl");
        let mut cmd = command(&example("train_emulator"), cpus, rr);
        cmd.args(["--workers", &TRAIN_WORKERS.to_string()])
            .args(["--gpu-step-ms", &GPU_STEP_MS.to_string()])
            .args(["--work-per-batch", &self.work_units.to_string()])
            .args(["--loader-mib", &LOADER_MIB.to_string()])
            .arg("--report")
            .arg(&report);
        if let Some(dir) = publish {
            cmd.arg("--publish-dir").arg(dir);
        }
        let mut child = cmd
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

    /// A hog on `cpu`, SCHED_OTHER; waits until it streams.
    fn hog(&mut self, cpu: &str) -> Proc {
        let out = self.path("hog.out");
        let child = command(&example("membw_hog"), Some(cpu), false)
            .args(["--mib", &HOG_MIB.to_string()])
            .stdout(File::create(&out).expect("hog out"))
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn membw_hog");
        let p = Proc {
            child,
            out: Some(out),
        };
        wait_until(WAIT, "the hog to stream", || {
            p.lines().iter().any(|l| l.starts_with("ready"))
        });
        p
    }
}

/// Mean iteration time (ms) of the emulator's report lines.
fn iter_ms(lines: &[String]) -> f64 {
    mean(
        &lines
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["iter_ms"].as_f64())
            .collect::<Vec<_>>(),
    )
}

/// Mean GB/s of a hog's per-second lines (`t=3s GB/s=14.2 threads=1`).
fn hog_gbps(lines: &[String]) -> f64 {
    mean(
        &lines
            .iter()
            .filter(|l| l.starts_with("t="))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("GB/s="))
                    .and_then(|v| v.parse().ok())
            })
            .collect::<Vec<_>>(),
    )
}

/// What a measurement window saw.
struct Window {
    /// Lines each process printed in the window.
    lines: Vec<Vec<String>>,
    /// CPUs' worth each measured pid used (processes first, then `extra` pids).
    cpu: Vec<f64>,
    /// CPUs' worth everything else used.
    others: f64,
    seconds: f64,
}

impl Window {
    /// Training's (the first process's) CPU time per iteration, in ms: the loader's work per
    /// batch, which memory contention lengthens even when the GPU step hides it.
    fn cpu_ms_per_iteration(&self) -> f64 {
        let iterations = self.lines[0].len().max(1) as f64;
        self.cpu[0] * self.seconds * 1000.0 / iterations
    }
}

/// Runs `WARMUP`, then measures a window of `length`: the lines `procs` print and the CPU time
/// they and `extra` pids use.
fn window(procs: &[&Proc], extra: &[u32], length: Duration) -> Window {
    std::thread::sleep(WARMUP);
    let mut pids: Vec<u32> = procs.iter().map(|p| p.pid()).collect();
    pids.extend(extra);
    let from: Vec<usize> = procs.iter().map(|p| p.lines().len()).collect();
    let meter = Meter::start(&pids);
    let started = Instant::now();
    std::thread::sleep(length);
    let (cpu, others) = meter.stop();
    let seconds = started.elapsed().as_secs_f64();
    let lines = procs
        .iter()
        .zip(from)
        .map(|(p, a)| {
            let lines = p.lines();
            lines[a.min(lines.len())..].to_vec()
        })
        .collect();
    Window {
        lines,
        cpu,
        others,
        seconds,
    }
}

/// CPUs' worth used by `pids` and by everything else over a span.
struct Meter {
    cpus: Vec<(u64, u64)>,
    pids: Vec<(u32, u64)>,
}

impl Meter {
    fn start(pids: &[u32]) -> Meter {
        Meter {
            cpus: cpu_ticks(),
            pids: pids.iter().map(|&p| (p, proc_ticks(p))).collect(),
        }
    }

    /// (each pid's CPUs' worth, everything else's CPUs' worth).
    fn stop(&self) -> (Vec<f64>, f64) {
        let now = cpu_ticks();
        let elapsed = self
            .cpus
            .first()
            .zip(now.first())
            .map(|(a, b)| (b.0 + b.1).saturating_sub(a.0 + a.1) as f64)
            .unwrap_or(1.0)
            .max(1.0);
        let busy: f64 = self
            .cpus
            .iter()
            .zip(&now)
            .map(|(a, b)| b.0.saturating_sub(a.0) as f64)
            .sum::<f64>()
            / elapsed;
        let ours: Vec<f64> = self
            .pids
            .iter()
            .map(|&(p, t)| proc_ticks(p).saturating_sub(t) as f64 / elapsed)
            .collect();
        let others = (busy - ours.iter().sum::<f64>()).max(0.0);
        (ours, others)
    }
}

// ---------------------------------------------------------------------------------------------
// Arrangements

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Arr {
    Alone,
    AloneRr,
    MemoryOnly,
    Unmanaged,
    Lodger,
}

const ARRS: [(Arr, &str); 5] = [
    (Arr::Alone, "alone (SCHED_OTHER, CPU 1)"),
    (Arr::AloneRr, "alone (SCHED_RR 10, CPU 1)"),
    (
        Arr::MemoryOnly,
        "memory only: + hog on CPU 0 (training SCHED_OTHER on CPU 1)",
    ),
    (
        Arr::Unmanaged,
        "unmanaged: + one hog per CPU (CPUs 0, 1), all SCHED_OTHER",
    ),
    (
        Arr::Lodger,
        "under lodger: training placed SCHED_RR, hogs as an offline job (one instance per CPU)",
    ),
];

/// One arrangement's window: training's mean iteration ms and CPU ms per iteration, a note,
/// and (lodger only) a reaction.
struct Measured {
    ms: f64,
    cpu_ms: f64,
    note: String,
    reaction: Option<Reaction>,
}

fn measure(b: &mut Bench, arr: Arr, lodger: &LodgerRig) -> Measured {
    let (w, note) = match arr {
        Arr::Alone | Arr::AloneRr => {
            let t = b.train(Some(TRAIN_CPU), arr == Arr::AloneRr, None);
            let w = window(&[&t], &[], b.window);
            let note = format!("others {:.0}% of a CPU", w.others * 100.0);
            (w, note)
        }
        Arr::MemoryOnly => {
            let h = b.hog(OTHER_CPU);
            let t = b.train(Some(TRAIN_CPU), false, None);
            let w = window(&[&t, &h], &[], b.window);
            let note = format!(
                "hog {:.1} GB/s on {:.0}% of a CPU; others {:.0}%",
                hog_gbps(&w.lines[1]),
                w.cpu[1] * 100.0,
                w.others * 100.0
            );
            (w, note)
        }
        Arr::Unmanaged => {
            let h0 = b.hog(OTHER_CPU);
            let h1 = b.hog(TRAIN_CPU);
            let t = b.train(Some(TRAIN_CPU), false, None);
            let w = window(&[&t, &h0, &h1], &[], b.window);
            let note = format!(
                "training on {:.0}% of a CPU; hogs {:.1} + {:.1} GB/s; others {:.0}%",
                w.cpu[0] * 100.0,
                hog_gbps(&w.lines[1]),
                hog_gbps(&w.lines[2]),
                w.others * 100.0
            );
            (w, note)
        }
        Arr::Lodger => return measure_lodger(b, lodger),
    };
    Measured {
        ms: iter_ms(&w.lines[0]),
        cpu_ms: w.cpu_ms_per_iteration(),
        note,
        reaction: None,
    }
}

struct LodgerRig {
    d: Daemon,
    view: View,
    gpu_dir: PathBuf,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

fn measure_lodger(b: &mut Bench, rig: &LodgerRig) -> Measured {
    let d = &rig.d;
    let t = b.train(None, false, Some(&rig.gpu_dir));
    let v = d.ctl_json(&[
        "register",
        "training",
        "--pid",
        &t.pid().to_string(),
        "--cores",
        "1",
        "--no-rightsize",
    ]);
    let train = v["id"].as_str().expect("id").to_string();
    let cpus = d.job(&train)["cpus"].as_str().expect("cpus").to_string();
    wait_until(WAIT, "training SCHED_RR on its CPU", || {
        all_rr_on(t.pid(), 10, &cpus)
    });
    // lodgerd learns training's stable level from the last 10 passes with no lodger beside it.
    wait_until(WAIT, "lodgerd to sense the emulated GPU", || {
        rig.view.gpu_percent(&train).is_some()
    });
    let learning = Instant::now() + Duration::from_millis(SENSE_MS * 15);
    let mut alone = Vec::new();
    while Instant::now() < learning {
        if let Some(g) = rig.view.gpu_percent(&train) {
            if alone.last() != Some(&g) {
                alone.push(g);
            }
        }
        std::thread::sleep(POLL);
    }
    println!("lodger: training alone while lodgerd learns its level: GPU % {alone:.1?}");
    let hog_bin = example("membw_hog").display().to_string();
    let v = d.ctl_json(&[
        "register",
        "offline",
        "--",
        &hog_bin,
        "--mib",
        &HOG_MIB.to_string(),
    ]);
    let hog = v["id"].as_str().expect("id").to_string();
    wait_until(WAIT, "two hog instances streaming", || {
        running_instances(&d.job(&hog)).len() == 2
    });
    // First-touch of the hogs' buffers.
    std::thread::sleep(Duration::from_secs(2));
    let instance_pids: Vec<u32> = running_instances(&d.job(&hog))
        .iter()
        .filter_map(|i| i["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
        .collect();
    let actions = rig.view.throttle_actions();
    let w = window(&[&t], &instance_pids, b.window);
    let actions = rig.view.throttle_actions() - actions;
    let mut note = format!(
        "training alone showed GPU % {alone:.1?}; training on CPU {cpus}, {:.0}% of a CPU; hog instances {:.0}% of a CPU; {actions} \
         throttle action(s) in the window; others {:.0}%",
        w.cpu[0] * 100.0,
        w.cpu[1..].iter().sum::<f64>() * 100.0,
        w.others * 100.0
    );
    if let Some(t) = rig.view.throttle(&hog) {
        // The hogs slowed training by themselves: the reaction is measured from unthrottled.
        note.push_str(&format!("; throttled beside training: {t}"));
        poll_until(
            &rig.view,
            d,
            &train,
            "the give-back before the reaction",
            || rig.view.throttle(&hog).is_none(),
            &String::new,
        );
    }
    let cpu: u32 = cpus.parse().expect("training on one CPU");
    let r = reaction(&rig.view, d, (&train, t.pid()), &hog, cpu);
    d.ctl_ok(&["unregister", &hog]);
    d.ctl_ok(&["unregister", &train]);
    Measured {
        ms: iter_ms(&w.lines[0]),
        cpu_ms: w.cpu_ms_per_iteration(),
        note,
        reaction: Some(r),
    }
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not, and must not start a
    // two-minute benchmark.
    if !std::env::args().any(|a| a == "--bench") {
        println!("contention benchmark: run it with `cargo bench --bench contention`");
        return;
    }
    if !need_root("contention benchmark") {
        return;
    }
    let cpus = online_cpus();
    if cpus != "0-1" {
        println!(
            "note: written for CPUs 0-1; this machine has {cpus} (only CPUs 0 and 1 are used)"
        );
    }
    build_examples();
    let total = Instant::now();
    let window = Duration::from_secs(env_u64("LODGER_BENCH_WINDOW_S", 6));
    let rounds = u32::try_from(env_u64("LODGER_BENCH_ROUNDS", 2)).unwrap_or(2);
    let (_boost, boost_note) = AutogroupNice::raise();
    let work_units = calibrate(
        TRAIN_CPU,
        BATCH_CPU_MS,
        &["--loader-mib", &LOADER_MIB.to_string()],
    );
    let mut b = Bench {
        dir: tempfile::tempdir().expect("tempdir"),
        seq: 0,
        work_units,
        window,
    };
    println!(
        "contention benchmark: {rounds} rounds, {}-s windows after 1 s warm-up; training \
         emulator --workers {TRAIN_WORKERS} --gpu-step-ms {GPU_STEP_MS} --loader-mib {LOADER_MIB} \
         --work-per-batch {work_units} (~{BATCH_CPU_MS} ms CPU per batch); membw_hog --mib \
         {HOG_MIB}; {boost_note}; load average at start {}",
        window.as_secs(),
        load_average()
    );
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu = tmpfs_dir();
    let gpu_dir = gpu.path().join("gpu");
    let rig = LodgerRig {
        d: lodgerd(&bus, dir.path(), &gpu_dir),
        view: View::connect(&bus),
        gpu_dir,
        _dirs: (dir, gpu),
    };
    let mut ms: BTreeMap<Arr, Vec<f64>> = BTreeMap::new();
    let mut cpu_ms: BTreeMap<Arr, Vec<f64>> = BTreeMap::new();
    let mut reactions = Vec::new();
    for round in 1..=rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..ARRS.len()).rev().collect()
        } else {
            (0..ARRS.len()).collect()
        };
        for k in order {
            let (arr, name) = ARRS[k];
            let m = measure(&mut b, arr, &rig);
            println!(
                "round {round}: {name}: mean iteration {:.2} ms, training CPU {:.2} ms per \
                 iteration; {}",
                m.ms, m.cpu_ms, m.note
            );
            if let Some(r) = &m.reaction {
                println!(
                    "round {round}: reaction: drop -> throttle {:.1} passes, antagonist start -> \
                     throttle {:.1} passes, calm -> give-back {:.1} passes; evidence: {}",
                    r.pressure_to_throttle, r.start_to_throttle, r.calm_to_give_back, r.evidence
                );
            }
            ms.entry(arr).or_default().push(m.ms);
            cpu_ms.entry(arr).or_default().push(m.cpu_ms);
            reactions.extend(m.reaction);
        }
    }
    let avg = |a: Arr| mean(&ms[&a]);
    let rounds_of = |a: Arr| {
        ms[&a]
            .iter()
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "\nsummary (load average at end {}, {:.0} s in all):",
        load_average(),
        total.elapsed().as_secs_f64()
    );
    let cpu_avg = |a: Arr| mean(&cpu_ms[&a]);
    println!(
        "| arrangement | mean iteration ms (per round) | vs alone | vs alone RR | training CPU \
         ms per iteration | vs alone |"
    );
    println!("|---|---|---|---|---|---|");
    for (arr, name) in ARRS {
        println!(
            "| {name} | {:.2} ({}) | {:.2}x | {:.2}x | {:.2} | {:.2}x |",
            avg(arr),
            rounds_of(arr),
            avg(arr) / avg(Arr::Alone),
            avg(arr) / avg(Arr::AloneRr),
            cpu_avg(arr),
            cpu_avg(arr) / cpu_avg(Arr::Alone)
        );
    }
    let list = |f: fn(&Reaction) -> f64| {
        reactions
            .iter()
            .map(|r| format!("{:.1}", f(r)))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "| reaction, in {SENSE_MS} ms sensing passes (per round) | first pressured pass -> \
         throttle {} (expected {}); antagonist start -> throttle {}; first calm pass -> \
         give-back {} (expected {}) | | | | |",
        list(|r| r.pressure_to_throttle),
        PRESSURE_TICKS - 1,
        list(|r| r.start_to_throttle),
        list(|r| r.calm_to_give_back),
        CALM_TICKS - 1
    );
}
