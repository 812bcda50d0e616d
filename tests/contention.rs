//! Contention control end to end (SODA §V-E), as root, without MBM or MBA (this machine has
//! neither): lodgerd watches the training emulator's published progress (`sense.gpu =
//! "emulated"`), and when it falls below the level it learnt while the job ran alone, by more
//! than the noise, while an offline job of memory-bandwidth hogs runs beside it, it halves the
//! hog job's cores (inference placement runs fewer instances) and gives them back once training
//! has been calm for `calm_ticks` sensing passes.
//!
//! On this two-vCPU VM the hog's memory traffic does not slow the emulator measurably
//! (`docs/benchmarks.md`, contention): the host's memory system is not saturated by one core,
//! and SCHED_RR keeps the hog's CPU time off training's core. So the drop is made real another
//! way: a periodic real-time thread above training's priority on training's CPU, which lodger
//! does not control (an IRQ thread or a clock-sync daemon can be one). SODA's detection cannot
//! tell causes apart; it throttles the lodgers, which is what is checked here. The emulator
//! publishes its records on tmpfs, as in /run on a real node (`tmpfs_dir`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::contention::{PRESSURE_TICKS, SENSE_MS};
use common::*;

/// The eliminator's default: passes of a training job alone that make its stable level.
const BASELINE_TICKS: u64 = 10;
/// Training's RT priority (the default `training.rt_priority`) and the antagonist's, above it.
const TRAINING_RT: i32 = 10;
const ANTAGONIST_RT: i32 = TRAINING_RT + 1;
/// Share of training's CPU the antagonist takes: training keeps 20 % of it, a third of the 60 %
/// its loader needs.
const ANTAGONIST_BUSY_PERCENT: u32 = 80;
const REACT: Duration = Duration::from_secs(30);

fn daemon(
    bus: &PrivateBus,
    dir: &std::path::Path,
    gpu_dir: &std::path::Path,
    reserved: &'static str,
) -> Daemon {
    // Two CPUs for jobs whatever the host has (the others reserved): the offline job gets one
    // instance per CPU, two to halve.
    common::contention::daemon(bus, dir, gpu_dir, reserved)
}

/// The offline job's running instances and its throttle line, if any.
fn hog_state(d: &Daemon, id: &str) -> (usize, Option<String>, serde_json::Value) {
    let j = d.job(id);
    let running = j["instances"]
        .as_array()
        .map(|a| a.iter().filter(|i| i["state"] == "running").count())
        .unwrap_or(0);
    let throttle = j["throttle"].as_str().map(str::to_string);
    (running, throttle, j)
}

fn throttle_actions(d: &Daemon) -> u64 {
    let s = d.ctl_json(&["status"]);
    s["throttle_actions"]
        .as_u64()
        .unwrap_or_else(|| panic!("no throttle_actions in status: {s}"))
}

/// The training job's GPU utilization (emulated) as lodgerd last sensed it.
fn gpu_percent(d: &Daemon, id: &str) -> Option<f64> {
    let top = d.ctl_json(&["top", "--once"]);
    top["jobs"].as_array()?.iter().find(|j| j["id"] == id)?["metrics"]["gpu_percent"].as_f64()
}

/// Mean of the GPU utilization lodgerd shows over `span`, polled every 100 ms.
fn mean_gpu_over(d: &Daemon, id: &str, span: Duration) -> f64 {
    let end = Instant::now() + span;
    let mut seen = Vec::new();
    while Instant::now() < end {
        if let Some(g) = gpu_percent(d, id) {
            seen.push(g);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!seen.is_empty(), "no GPU utilization in {span:?}");
    seen.iter().sum::<f64>() / seen.len() as f64
}

/// Collects the `Throttled` signals lodgerd sends, from a thread of its own.
struct ThrottledSignals {
    seen: Arc<Mutex<Vec<(String, String, String)>>>,
}

impl ThrottledSignals {
    fn subscribe(bus: &PrivateBus) -> ThrottledSignals {
        use futures_util::StreamExt;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let address = bus.address.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let conn = zbus::connection::Builder::address(address.as_str())
                    .expect("address")
                    .build()
                    .await
                    .expect("connect");
                let proxy = lodger::api::proxy::ManagerProxy::new(&conn)
                    .await
                    .expect("proxy");
                let mut stream = proxy.receive_throttled().await.expect("subscribe");
                let _ = ready_tx.send(());
                // Ends when the bus goes away at the end of the test.
                while let Some(signal) = stream.next().await {
                    if let Ok(a) = signal.args() {
                        sink.lock().expect("signals").push((
                            a.job().clone(),
                            a.mechanism().clone(),
                            a.level().clone(),
                        ));
                    }
                }
            });
        });
        ready_rx.recv().expect("signal subscription");
        ThrottledSignals { seen }
    }

    fn for_job(&self, job: &str) -> Vec<(String, String)> {
        self.seen
            .lock()
            .expect("signals")
            .iter()
            .filter(|(j, ..)| j == job)
            .map(|(_, m, l)| (m.clone(), l.clone()))
            .collect()
    }
}

#[test]
fn slowed_training_halves_the_offline_hogs_beside_it_until_it_is_calm_again() {
    if !need_root("contention_halves_offline_hogs") {
        return;
    }
    let Some((reserved, two)) = two_job_cpus("contention_halves_offline_hogs") else {
        return;
    };
    let _measuring = measuring();
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu = tmpfs_dir();
    let gpu_dir = gpu.path().join("gpu");
    let mut d = daemon(&bus, dir.path(), &gpu_dir, reserved);
    let signals = ThrottledSignals::subscribe(&bus);

    // Training: one loader with 6 ms of CPU per 20 ms emulated GPU step, on one core: 30 %,
    // which the antagonist's 80 % below still starves. (With 12 ms, under emulation in the VM
    // suite the job measured over 90 % of its CPU and the RT guard grew it to both job CPUs, so
    // the antagonist on one of them no longer slowed it.)
    let w = Workload::train_with(
        1,
        &[
            "--batch-cpu-ms",
            "6",
            "--publish-dir",
            gpu_dir.to_str().expect("utf-8"),
        ],
    );
    let v = d.ctl_json(&[
        "register",
        "training",
        "--pid",
        &w.pid().to_string(),
        "--cores",
        "1",
        "--no-rightsize",
    ]);
    let train = v["id"].as_str().expect("id").to_string();
    let cpu: u32 = d.job(&train)["cpus"]
        .as_str()
        .and_then(|c| c.parse().ok())
        .expect("training on one CPU");

    // Alone: lodgerd learns its stable level from BASELINE_TICKS passes. The learning is not
    // visible from outside, so give it half as long again once the first record is sensed.
    wait_until(WAIT, "lodgerd to sense the emulated GPU", || {
        gpu_percent(&d, &train).is_some()
    });
    let alone = mean_gpu_over(
        &d,
        &train,
        Duration::from_millis(SENSE_MS * BASELINE_TICKS * 3 / 2),
    );
    // Alone, the loader (30 % of a CPU) keeps the emulated GPU busy most of the time (about 90 %
    // here). Where it cannot (29 % measured under emulation in the VM suite, vCPUs oversubscribed
    // by their host), training's progress is set by the machine, not by its CPU share, and the
    // drop the antagonist causes below cannot be told from that noise.
    if alone < 60.0 {
        lodger::privileged::skip_hardware(
            "contention_halves_offline_hogs",
            &format!(
                "training alone kept its emulated GPU {alone:.1} % busy (about 90 % on a machine \
                 that runs it at speed): this machine's CPUs do not run it at speed \
                 (oversubscribed or emulated vCPUs)"
            ),
        );
        return;
    }

    // The hogs, as an offline job: one single-thread instance per CPU, training's included
    // (where SCHED_RR pre-empts it). membw_hog does not report; the runner does not need it to.
    // Throttle actions are counted from before they start: lodger may act while they start (and
    // give the core back before both run again).
    let before = throttle_actions(&d);
    let hog_bin = example("membw_hog").display().to_string();
    let v = d.ctl_json(&["register", "offline", "--", &hog_bin, "--mib", "512"]);
    let hog = v["id"].as_str().expect("id").to_string();
    // Both run, unless lodger halves them as they start (on CPUs that do not run independently,
    // their start alone slows training): then the test ends below, where it says so.
    let deadline = Instant::now() + WAIT;
    while hog_state(&d, &hog).0 != 2 && throttle_actions(&d) == before {
        assert!(
            Instant::now() < deadline,
            "two hog instances never ran and lodger did not throttle them: {:?}",
            hog_state(&d, &hog)
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Beside the hogs under lodger: either training holds its level or lodger throttles.
    let beside = mean_gpu_over(&d, &train, Duration::from_secs(3));
    let throttled_beside = throttle_actions(&d) > before;
    eprintln!(
        "training GPU % alone {alone:.1}, beside the hogs under lodger {beside:.1} ({:.3}x); \
         throttled meanwhile: {throttled_beside}",
        beside / alone
    );
    if throttled_beside || beside < 0.9 * alone {
        // The rest of this test needs CPUs on which hogs beside SCHED_RR training leave it
        // alone, as on the two-vCPU CI VM; where they slow it (vCPUs oversubscribed by their
        // host, as under emulation, or a memory system one core saturates), the drop the
        // antagonist makes cannot be told from theirs, and whether lodger acts on theirs depends
        // on the noise it learnt alone.
        lodger::privileged::skip_hardware(
            "contention_halves_offline_hogs",
            &format!(
                "hogs on other CPUs slowed SCHED_RR training to {beside:.1} % from {alone:.1} % \
                 (lodger throttled them: {throttled_beside}): this machine's CPUs do not run \
                 independently (oversubscribed vCPUs, or a saturated memory system)"
            ),
        );
        return;
    }

    // A real-time antagonist on training's CPU: training's progress drops for real. With no
    // reserved CPU, lodgerd and this test move to the other CPU first, as lodgerd keeps to the
    // reserved CPUs on a real node: the antagonist and training leave ordinary threads on
    // training's CPU almost no time.
    assert!(two.contains(&cpu), "training on {cpu}, not one of {two:?}");
    let other = if cpu == two[0] { two[1] } else { two[0] };
    pin_threads(d.pid(), &[other]);
    pin_threads(std::process::id(), &[other]);
    let antagonist = RtAntagonist::start(cpu, ANTAGONIST_RT, ANTAGONIST_BUSY_PERCENT);
    let deadline = Instant::now() + REACT;
    let last = loop {
        let (running, throttle, last) = hog_state(&d, &hog);
        if running == 1 && throttle.is_some_and(|t| t.contains("cores=1")) {
            break last;
        }
        if Instant::now() > deadline {
            let mut threads = format!(
                "antagonist {}",
                thread_state(std::process::id(), antagonist.tid)
            );
            for (who, pid) in [("training", w.pid()), ("lodgerd", d.pid())] {
                for tid in tids(pid) {
                    threads.push_str(&format!("\n{who} {}", thread_state(pid, tid)));
                }
            }
            panic!(
                "timed out after {REACT:?} waiting for the hog job halved to one instance; \
                 training GPU % now {:?}; hog job {last}\n{threads}\n{}",
                gpu_percent(&d, &train),
                d.log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let throttle = last["throttle"].as_str().expect("throttle").to_string();
    assert!(
        throttle.contains(&format!("{train} progress")) && throttle.contains("below its stable"),
        "the evidence names training's drop: {throttle}"
    );
    assert!(throttle.contains("halved 2 -> 1"), "{throttle}");
    // The instance left is the one on the other CPU: the one training's core had is gone.
    let left = last["instances"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["state"] == "running"))
        .and_then(|i| i["cpus"].as_str())
        .expect("a running instance")
        .to_string();
    assert_ne!(left, cpu.to_string(), "{last}");
    let text = d.ctl_ok(&["show", &hog]);
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("Throttled:") && l.contains("cores=1")),
        "{text}"
    );
    let status = d.ctl_json(&["status"]);
    assert!(
        status["contention"]
            .as_str()
            .is_some_and(|c| c.contains("1 job(s) on fewer cores")),
        "{status}"
    );

    // Pressure goes on (the antagonist is still there), the hogs are at their floor: the cut
    // holds, with no action at all (a cut lifted and retaken would count two).
    let held_from = throttle_actions(&d);
    std::thread::sleep(Duration::from_millis(
        SENSE_MS * u64::from(3 * (PRESSURE_TICKS + 1)),
    ));
    let (running, throttle, j) = hog_state(&d, &hog);
    assert_eq!(running, 1, "{j}");
    assert!(throttle.is_some(), "{j}");
    assert_eq!(
        throttle_actions(&d),
        held_from,
        "the cut flapped while held:\n{}",
        d.log()
    );

    // A restart changes nothing (issue 17): lodgerd killed and started again holds the cut from
    // its first answer on, the instance left runs on as the same process, and the cut keeps
    // holding under the same pressure (the stable level it learnt alone was kept: with lodgers
    // running it could not learn it again) with no action taken.
    let instance_pid = |j: &serde_json::Value| {
        j["instances"]
            .as_array()
            .and_then(|a| a.iter().find(|i| i["state"] == "running"))
            .and_then(|i| i["pid"].as_u64())
    };
    let pid_before = instance_pid(&j).expect("the running instance's pid");
    d.kill();
    d.restart();
    pin_threads(d.pid(), &[other]);
    let (running, throttle, j) = hog_state(&d, &hog);
    assert_eq!(running, 1, "at once after the restart: {j}");
    assert!(
        throttle.as_deref().is_some_and(|t| t.contains("cores=1")),
        "{j}"
    );
    assert_eq!(instance_pid(&j), Some(pid_before), "{j}");
    std::thread::sleep(Duration::from_millis(
        SENSE_MS * u64::from(3 * (PRESSURE_TICKS + 1)),
    ));
    let (running, throttle, j) = hog_state(&d, &hog);
    assert_eq!(running, 1, "{j}");
    assert!(throttle.is_some(), "{j}");
    assert_eq!(instance_pid(&j), Some(pid_before), "{j}");
    assert_eq!(
        throttle_actions(&d),
        0,
        "the restarted lodgerd changed a throttle:\n{}",
        d.log()
    );

    // The antagonist leaves: after `calm_ticks` (common::contention::CALM_TICKS) calm passes the core comes back.
    drop(antagonist);
    wait_until(REACT, "the hog job back on two instances", || {
        let (running, throttle, _) = hog_state(&d, &hog);
        running == 2 && throttle.is_none()
    });
    assert!(
        d.log().contains("one step given back"),
        "the give-back is logged with its reason"
    );
    wait_until(WAIT, "the Throttled signals", || {
        signals.for_job(&hog).last() == Some(&("release".to_string(), "0".to_string()))
    });
    let seen = signals.for_job(&hog);
    assert_eq!(
        seen,
        [
            ("cores".to_string(), "1".to_string()),
            ("cores".to_string(), "0".to_string()),
            ("release".to_string(), "0".to_string())
        ],
        "one step, given back, released"
    );
    assert!(
        signals.for_job(&train).is_empty(),
        "training is never throttled"
    );
}
