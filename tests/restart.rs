//! Issue 17, a restart never interrupts inference, as root on a private bus: lodgerd killed
//! (SIGKILL) or stopped (SIGTERM, what `systemctl stop` sends) leaves its inference instances
//! running; the next lodgerd adopts them (the same processes, nothing restarted) and hears their
//! reports again through their FIFOs; `lodgerctl drain` undoes everything on purpose. A second
//! lodgerd on the same state directory stops at start, before it touches anything.

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

/// Runs another lodgerd (`--sim`: it changes nothing on the node) with `config` on `d`'s bus
/// until it exits, killed when the test fails meanwhile: its exit code and what it logged.
/// A second lodgerd (`--sim`) with `config` on `d`'s bus, its stderr in `log`.
fn spawn_second(d: &Daemon, config: &std::path::Path, log: &std::path::Path) -> Workload {
    let child = std::process::Command::new(bin("lodgerd"))
        .arg("--config")
        .arg(config)
        .arg("--sim")
        .env("DBUS_SYSTEM_BUS_ADDRESS", &d.bus_address)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).expect("its log"))
        .spawn()
        .expect("spawn a second lodgerd");
    Workload::adopt(child)
}

/// `d`'s config with a state directory of its own: a second lodgerd with it meets the first
/// only on the bus.
fn config_beside(d: &Daemon) -> std::path::PathBuf {
    let state = d.dir.join("state").display().to_string();
    let config = d.dir.join("second.toml");
    let text = std::fs::read_to_string(&d.config).expect("config");
    assert!(text.contains(&state), "{text}");
    std::fs::write(&config, text.replace(&state, &format!("{state}-second"))).expect("config");
    config
}

fn second_lodgerd(d: &Daemon, config: &std::path::Path) -> (Option<i32>, String) {
    let log = d.dir.join("second-lodgerd.log");
    let mut second = spawn_second(d, config, &log);
    let mut status = None;
    wait_until_explained(
        WAIT,
        "the second lodgerd to exit",
        || {
            status = second.child.try_wait().expect("wait");
            status.is_some()
        },
        || std::fs::read_to_string(&log).unwrap_or_default(),
    );
    (
        status.and_then(|s| s.code()),
        std::fs::read_to_string(&log).expect("its log"),
    )
}

/// A stop while lodgerd waits for the bus (here: the name held by a running lodgerd, which it
/// waits up to 5 s for) is honoured then: the handlers installed before serving held it back
/// until the wait ended.
#[test]
fn a_stop_while_waiting_for_the_bus_name_is_honoured_at_once() {
    if !need_root("a_stop_while_waiting_for_the_bus_name_is_honoured_at_once") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let config = config_beside(&d);
    let log = d.dir.join("stopped-lodgerd.log");
    let mut second = spawn_second(&d, &config, &log);
    let pid = second.pid();
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_until_explained(
        WAIT,
        "the second lodgerd to wait for the name",
        || read().contains("is held by another connection"),
        read,
    );
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let mut status = None;
    wait_until_explained(
        WAIT,
        "the second lodgerd to exit",
        || {
            status = second.child.try_wait().expect("wait");
            status.is_some()
        },
        read,
    );
    let log = read();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(log.contains("stopping before serving"), "{log}");
    assert!(
        !log.contains("name already taken"),
        "it waited the 5 s out: {log}"
    );
}

/// A second lodgerd on a running one's state directory (started by hand beside the service, or
/// `--sim` to try a setting out) exits at once with why, having read nothing. It used to
/// re-adopt the running one's jobs and tick, then wait in the bus's queue for the name, its
/// agent running on the same jobs as the first one's.
#[test]
fn a_second_lodgerd_on_the_same_state_dir_stops_before_touching_anything() {
    if !need_root("a_second_lodgerd_on_the_same_state_dir_stops_before_touching_anything") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::light();
    let id = d.register_pid(w.pid(), 1);
    let cpus = d.job(&id)["cpus"].as_str().expect("cpus").to_string();

    let (code, err) = second_lodgerd(&d, &d.config);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "another lodgerd (pid {}) is running on the state directory",
            d.pid()
        )),
        "{err}"
    );
    assert!(
        !err.contains("re-adopted") && !err.contains("read state"),
        "it read the running lodgerd's jobs: {err}"
    );
    // The running lodgerd and its job are as they were.
    let job = d.job(&id);
    assert_eq!(job["state"], "running");
    assert_eq!(job["cpus"].as_str(), Some(cpus.as_str()));
    assert!(all_rr_on(w.pid(), 10, &cpus), "the job's threads left RR");
}

/// A second lodgerd on a bus where org.lodger1 is owned (another state directory) fails to
/// start, saying so, and the first one keeps the name. It used to take a place in the bus's
/// queue for the name, report itself started and wait, serving nothing.
#[test]
fn a_second_lodgerd_on_the_same_bus_fails_to_start() {
    if !need_root("a_second_lodgerd_on_the_same_bus_fails_to_start") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let config = config_beside(&d);

    let (code, err) = second_lodgerd(&d, &config);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot serve org.lodger1") && err.contains("name already taken"),
        "{err}"
    );
    // The first one still answers.
    let status = d.ctl_json(&["status"]);
    assert_eq!(status["jobs"].as_u64(), Some(0), "{status}");
}
