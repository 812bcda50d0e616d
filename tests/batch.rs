//! Batch jobs end to end, as root, on real kernel interfaces (issue 18): a CPU-bound process
//! lodger did not start, registered with `lodgerctl register batch`, runs on the CPUs training
//! leaves in the configured class, grows when training goes, and is given back as it was.

mod common;

use std::process::{Command, Stdio};

use common::*;

fn all_batch(pid: u32) -> bool {
    let t = tids(pid);
    !t.is_empty()
        && t.iter()
            .all(|&t| matches!(sched_of(t), Some((libc::SCHED_BATCH, 0))))
}

#[test]
fn a_batch_job_runs_beside_training_in_its_class_and_is_given_back() {
    let test = "a_batch_job_runs_beside_training_in_its_class_and_is_given_back";
    if !need_root(test) {
        return;
    }
    let Some((reserved, [a, b])) = two_job_cpus(test) else {
        return;
    };
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            reserved,
            extra: "[batch]\npolicy = \"batch\"\n".into(),
            ..DaemonOptions::default()
        },
    );
    let w = Workload::train(2);
    let train = d.register_pid(w.pid(), 1);
    let train_cpus = cpus(d.job(&train)["cpus"].as_str().expect("cpus"));

    let mut hog = Command::new(example("busy_loop"))
        .args(["--threads", "2", "--seconds", "600"])
        .stdout(Stdio::null())
        .spawn()
        .expect("busy_loop");
    let before = cpus_allowed(hog.id(), hog.id()).expect("mask");
    let v = d.ctl_json(&["register", "batch", "--pid", &hog.id().to_string()]);
    let id = v["id"].as_str().expect("id").to_string();
    let job = d.job(&id);
    assert_eq!(job["kind"], "batch", "{job}");
    assert_eq!(job["sched_policy"], "SCHED_BATCH", "{job}");
    let on = cpus(job["cpus"].as_str().expect("cpus"));
    let both = cpus(&format!("{a},{b}"));
    assert_eq!(
        on,
        both.difference(&train_cpus),
        "the CPU training leaves: {job}"
    );
    wait_until(
        WAIT,
        "the batch job's threads SCHED_BATCH on its CPU",
        || {
            all_batch(hog.id())
                && tids(hog.id())
                    .iter()
                    .all(|&t| cpus_allowed(hog.id(), t).as_deref() == Some(on.to_list().as_str()))
        },
    );
    let oom = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
            .expect("oom_score_adj")
            .trim()
            .to_string()
    };
    assert_eq!(oom(hog.id()), "1000", "the OOM killer takes a lodger first");
    assert_eq!(oom(w.pid()), "0", "and never prefers training");
    let listed = d.ctl_ok(&["list"]);
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with(&id) && l.contains("batch")),
        "{listed}"
    );

    let shown = d.ctl_ok(&["show", &id]);
    assert!(
        shown.contains("- batch job")
            && shown.contains("In class:")
            && shown.contains("Policy: SCHED_BATCH")
            && !shown.contains("RR threads"),
        "{shown}"
    );

    // Training goes: the batch job gets both CPUs at the next tick.
    d.ctl_ok(&["unregister", &train]);
    wait_until(WAIT, "the batch job grown to both CPUs", || {
        cpus(d.job(&id)["cpus"].as_str().unwrap_or("")) == both
            && cpus_allowed(hog.id(), hog.id()).as_deref() == Some(both.to_list().as_str())
    });

    d.ctl_ok(&["unregister", &id]);
    assert!(all_other(hog.id()), "SCHED_OTHER again");
    assert_eq!(oom(hog.id()), "0", "its OOM score given back");
    assert_eq!(cpus_allowed(hog.id(), hog.id()), Some(before));
    let _ = hog.kill();
    let _ = hog.wait();
}
