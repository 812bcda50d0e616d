//! Right-sizing end to end (SODA §V-B), as root: the training emulator publishes its emulated
//! GPU's busy fraction, lodgerd reads it (`sense.gpu = "emulated"`) and resizes the job's
//! consolidated cpuset toward the fewest cores at which that utilization is at its maximum.

mod common;

use common::*;

/// lodgerd with two CPUs for jobs whatever the host has (the others reserved): the figures
/// below (shrink 2 -> 1, grow 1 -> 2) are about two cores.
fn daemon(
    bus: &PrivateBus,
    dir: &std::path::Path,
    gpu_dir: &std::path::Path,
    reserved: &'static str,
) -> Daemon {
    Daemon::start(
        bus,
        dir,
        DaemonOptions {
            reserved,
            extra: format!(
                "[sense]\ninterval_ms = 1000\ngpu = \"emulated\"\nemulated_gpu_dir = \"{}\"\n\n\
                 [rightsize]\nwarmup_seconds = 2\nwindow_seconds = 6\ntolerance_cores = 0\n\
                 min_change_percent = {MIN_CHANGE_PERCENT}\n\n\
                 [inference]\nprobe_seconds = 1\n",
                gpu_dir.display()
            ),
            ..DaemonOptions::default()
        },
    )
}

/// The shrink test's training load: 12 ms of CPU per 20-ms GPU step, 60 % of one core. Enough
/// for lodger's RR sweep to take the loader for a worker and put the dispatch thread one
/// priority above it (`enforce::training::roles`), so on one core the dispatch thread still runs
/// the moment its GPU step ends, and one core keeps the GPU exactly as busy as two. A lighter
/// loader (2 ms per step) is taken for a latency thread at the dispatch thread's priority; on
/// one core the dispatch thread then waits behind its batches now and then, and measured 0.5 %
/// less GPU busy than on two, which lodger (tolerance 0) rightly called starved. The emulator
/// calibrates its work to the row (1/64 of a unit), so the load costs 12 ms per batch in the VM
/// suite's emulated guest too, where one whole unit takes 18-28 ms; a machine whose CPUs were
/// too slow for it while lodger measured is told apart by the baseline check below.
const SHRINK_LOAD: &[&str] = &["--batch-cpu-ms", "12"];

/// The emulated GPU's busy share (%) below which the shrink test's two-core baseline shows the
/// CPUs too slow, while it ran, for its premise (one core keeps the GPU busy): on a machine
/// that runs this load at speed it is about 97 % (here, `--workers 1`, a debug build; the rest is
/// the dispatch thread's own work and its wake-ups).
const SHRINK_BASELINE_MIN_PERCENT: f64 = 90.0;

/// `rightsize.min_change_percent` here: the smallest difference in GPU busy (points) that
/// lodger counts as a change, and the margin within which the shrink test's premise check
/// takes one core as keeping the GPU as busy as two. At 0, lodger's 6-s windows tell apart
/// differences of 0.6 points, finer than the 4-s premise check can: a CI run measured one
/// core 0.7 points below two (98.0 against 98.7 %), rightly called starved at 0, which the
/// premise check could neither confirm nor refute. The grow tests' gains are 40 points.
const MIN_CHANGE_PERCENT: f64 = 2.0;

const TUNING: std::time::Duration = std::time::Duration::from_secs(120);

/// The two job CPUs as a cpulist.
fn both(two: [u32; 2]) -> String {
    cpus(&format!("{},{}", two[0], two[1])).to_list()
}

fn settled(d: &Daemon, id: &str) -> serde_json::Value {
    let mut job = serde_json::Value::Null;
    wait_until(TUNING, "right-sizing to settle", || {
        job = d.job(id);
        job["rightsize"]
            .as_str()
            .is_some_and(|s| s.starts_with("settled"))
    });
    job
}

#[test]
fn a_job_with_too_many_cores_is_shrunk_and_the_core_is_lent_to_inference() {
    if !need_root("rightsize_shrinks") {
        return;
    }
    let Some((reserved, two)) = two_job_cpus("rightsize_shrinks") else {
        return;
    };
    let _measuring = measuring();
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu_dir = dir.path().join("gpu");
    let d = daemon(&bus, dir.path(), &gpu_dir, reserved);
    // Light CPU side: one loader easily keeps the emulated GPU busy on one core.
    let mut args = SHRINK_LOAD.to_vec();
    args.extend(["--publish-dir", gpu_dir.to_str().expect("utf-8")]);
    let w = Workload::train_with(1, &args);
    let id = d.register_pid(w.pid(), 2);
    assert_eq!(d.job(&id)["cpus"], both(two).as_str());
    let job = settled(&d, &id);
    if job["cpus"].as_str().map(|c| cpus(c).len()) != Some(1) {
        // Shrinking is right only where one core really keeps the GPU as busy. Where even two
        // did not while lodger measured them (its baseline window), the CPUs were too slow for
        // the premise then; else, if one core does not for the same workload without lodger
        // (checked now, the job gone), this machine is too slow for it; if it does, lodger
        // failed.
        let baseline = job["tuning"]
            .as_array()
            .and_then(|t| t.iter().find(|w| w["decision"] == "baseline"))
            .and_then(|w| w["gpu_percent"].as_f64())
            .unwrap_or(0.0);
        if baseline < SHRINK_BASELINE_MIN_PERCENT {
            lodger::privileged::skip_hardware(
                "rightsize_shrinks",
                &format!(
                    "the shrink test's load kept its emulated GPU only {baseline:.1} % busy on \
                     two cores while lodger measured them (about 97 % where the CPUs run it at \
                     speed, {SHRINK_BASELINE_MIN_PERCENT} % needed): this machine's CPUs were \
                     too slow for the test's premise then; windows: {}",
                    job["tuning"]
                ),
            );
            return;
        }
        drop(w);
        if let Err(why) = one_core_suffices(1, SHRINK_LOAD, two, MIN_CHANGE_PERCENT) {
            lodger::privileged::skip_hardware("rightsize_shrinks", &why);
            return;
        }
        panic!(
            "one core keeps this load's GPU as busy as two here, yet the job settled on CPUs \
             {}: {job}",
            job["cpus"]
        );
    }
    let probes = job["tuning"].as_array().map(|a| a.len()).unwrap_or(0);
    assert!((2..=6).contains(&probes), "windows: {job}");
    let cpus = job["cpus"].as_str().expect("cpus").to_string();
    assert!(
        all_rr_on(w.pid(), 10, &cpus),
        "still SCHED_RR on its new cpuset"
    );
    // The freed core goes to an online lodger.
    let worker = example("infer_worker").display().to_string();
    let on = d.ctl_json(&[
        "register",
        "online",
        "--slo-ms",
        "1000",
        "--",
        &worker,
        "--quiet",
        "--model-mib",
        "1",
    ]);
    let on_id = on["id"].as_str().expect("id").to_string();
    wait_until(WAIT, "an online instance on the freed core", || {
        let j = d.job(&on_id);
        j["instances"][0]["state"] == "running" && j["instances"][0]["cpus"] != cpus.as_str()
    });
    // lodgerctl show displays the tuning history.
    let text = d.ctl_ok(&["show", &id]);
    assert!(text.contains("Right-sizing: settled at 1 cores"), "{text}");
    assert!(text.contains("DECISION"), "{text}");
}

#[test]
fn a_job_with_too_few_cores_is_grown() {
    if !need_root("rightsize_grows") {
        return;
    }
    let Some((reserved, two)) = two_job_cpus("rightsize_grows") else {
        return;
    };
    let _measuring = measuring();
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu_dir = dir.path().join("gpu");
    let d = daemon(&bus, dir.path(), &gpu_dir, reserved);
    // Heavy CPU side: two loaders of STARVING_BATCH_CPU_MS per batch feed a 20 ms GPU step;
    // one core starves the emulated GPU, two keep it busier.
    let w = Workload::train_with(
        2,
        &[
            "--batch-cpu-ms",
            STARVING_BATCH_CPU_MS,
            "--publish-dir",
            gpu_dir.to_str().expect("utf-8"),
        ],
    );
    let id = d.register_pid(w.pid(), 1);
    assert_eq!(d.job(&id)["cpus"].as_str().map(|c| cpus(c).len()), Some(1));
    let job = settled(&d, &id);
    if job["cpus"] != both(two).as_str() {
        // Growing only pays where the second core is real CPU time: if it does not speed the
        // same workload up without lodger (checked now, the job gone), the machine lacks what
        // this test is about; if it does, lodger failed.
        drop(w);
        if let Err(why) = second_core_speeds_up(2, &["--batch-cpu-ms", STARVING_BATCH_CPU_MS], two)
        {
            lodger::privileged::skip_hardware("rightsize_grows", &why);
            return;
        }
    }
    assert_eq!(job["cpus"], both(two).as_str(), "{job}");
}

#[test]
fn no_rightsize_keeps_the_requested_cores() {
    if !need_root("no_rightsize") {
        return;
    }
    let Some((reserved, two)) = two_job_cpus("no_rightsize") else {
        return;
    };
    let _measuring = measuring();
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu_dir = dir.path().join("gpu");
    let d = daemon(&bus, dir.path(), &gpu_dir, reserved);
    let w = Workload::train_with(1, &["--publish-dir", gpu_dir.to_str().expect("utf-8")]);
    let v = d.ctl_json(&[
        "register",
        "training",
        "--pid",
        &w.pid().to_string(),
        "--cores",
        "2",
        "--no-rightsize",
    ]);
    let id = v["id"].as_str().expect("id").to_string();
    std::thread::sleep(std::time::Duration::from_secs(4));
    let job = d.job(&id);
    assert_eq!(job["cpus"], both(two).as_str());
    assert!(job.get("rightsize").is_none(), "{job}");
}
