//! Issue 17, a restart never interrupts inference, as root on a private bus: lodgerd killed
//! (SIGKILL) or stopped (SIGTERM, what `systemctl stop` sends) leaves its inference instances
//! running; the next lodgerd adopts them (the same processes, nothing restarted) and hears their
//! reports again through their FIFOs; `lodgerctl drain` undoes everything on purpose.

mod common;

use common::*;

/// (pid, restarts, items per second) of each running instance of `job`.
fn running(job: &serde_json::Value) -> Vec<(u32, u64, f64)> {
    job["instances"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|i| i["state"] == "running")
        .filter_map(|i| {
            let pid = u32::try_from(i["pid"].as_u64()?).ok()?;
            Some((
                pid,
                i["restarts"].as_u64().unwrap_or(0),
                i["items_per_s"].as_f64().unwrap_or(0.0),
            ))
        })
        .collect()
}

#[test]
fn instances_outlive_lodgerd_are_adopted_and_drain_undoes_everything() {
    if !need_root("restart_adopts_instances") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut d = lodgers_daemon(&bus, dir.path(), "");
    let worker = example("infer_worker").display().to_string();
    let off = d.ctl_json(&[
        "register",
        "offline",
        "--max-instances",
        "1",
        "--max-batch",
        "2",
        "--",
        &worker,
        "--quiet",
        "--model-mib",
        "1",
    ]);
    let id = off["id"].as_str().expect("id").to_string();
    let mut pid = 0;
    wait_until(WAIT, "the instance to run and report", || {
        match running(&d.job(&id)).as_slice() {
            [(p, _, rate)] if *rate > 0.0 => {
                pid = *p;
                true
            }
            _ => false,
        }
    });
    let fifo = dir.path().join(format!("state/instances/{id}-0.report"));
    assert!(fifo.exists(), "{} missing", fifo.display());

    for (how, down) in [
        ("SIGKILL", Daemon::kill as fn(&mut Daemon)),
        ("SIGTERM", Daemon::stop),
    ] {
        down(&mut d);
        assert!(alive(pid), "{how}: the instance {pid} died with lodgerd");
        // It goes on reporting into its FIFO while nobody reads: its writes neither fail nor
        // block (it still runs, the check above and below).
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert!(
            alive(pid),
            "{how}: the instance {pid} died while lodgerd was down"
        );
        d.restart();
        let mut seen = Vec::new();
        wait_until(WAIT, "the same instance adopted and heard again", || {
            seen = running(&d.job(&id));
            matches!(seen.as_slice(), [(p, 0, rate)] if *p == pid && *rate > 0.0)
        });
        assert_eq!(d.job(&id)["state"], "running", "{how}");
    }
    let log = d.log();
    assert!(
        log.contains("instance adopted from a previous lodgerd"),
        "{log}"
    );
    assert_eq!(
        log.matches("instance started").count(),
        1,
        "started again: {log}"
    );

    // On purpose: drain stops it and leaves nothing.
    let out = d.ctl_ok(&["drain"]);
    assert!(out.contains("drained: 1 job(s) released"), "{out}");
    assert!(!alive(pid), "drained, yet {pid} runs");
    let status = d.ctl_json(&["status"]);
    assert_eq!(
        (status["jobs"].as_u64(), status["instances"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(!fifo.exists(), "{} left behind", fifo.display());
    assert!(
        !cgroup_path(&format!("/{}/lodgers", d.parent)).exists(),
        "instance cgroups left behind"
    );
    assert!(
        kill_marked(&d.parent).is_empty(),
        "a marked process outlived the drain"
    );
}
