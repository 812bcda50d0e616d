//! Memory bounds of lodgers end to end, as root (issue 19): inference instances run inside a
//! memory limit of a cgroup lodger owns, an instance past it is taken by the OOM killer inside
//! its own limit (never the training process beside it) and restarted with back-off, and `show`
//! and the log say so.

mod common;

use common::*;

fn worker() -> String {
    example("infer_worker").display().to_string()
}

fn instance(job: &serde_json::Value) -> serde_json::Value {
    job["instances"][0].clone()
}

/// The memory limit of the memory cgroup `pid` is in (v1: the memory hierarchy's
/// `memory.limit_in_bytes`; v2: `memory.max`), with the cgroup's path.
fn memory_limit_of(pid: u32) -> Option<(String, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else if controllers.is_empty()
            && std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
        {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else {
            continue;
        };
        let value = std::fs::read_to_string(&file).ok()?;
        return Some((path.to_string(), value.trim().parse().ok()?));
    }
    None
}

fn oom_score_adj(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .ok()
        .map(|s| s.trim().to_string())
}

#[test]
fn an_instance_past_its_memory_limit_is_killed_inside_it_and_backs_off() {
    let test = "an_instance_past_its_memory_limit_is_killed_inside_it_and_backs_off";
    if !need_root(test) {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = lodgers_daemon(&bus, dir.path(), "");
    if let Some(line) = d
        .log()
        .lines()
        .find(|l| l.contains("instances get no memory limit"))
    {
        // v2 without memory delegated to lodger's cgroup and without systemd: nothing of
        // lodger's own to put a limit on (docs/memory.md).
        lodger::privileged::skip_as(lodger::privileged::SkipClass::NotApplicable, test, line);
        return;
    }
    let w = Workload::train(1);
    let train = d.register_pid(w.pid(), 1);

    // A well-behaved instance: 4 MiB of weights inside a 64 MiB limit.
    let fits = d.ctl_json(&[
        "register",
        "offline",
        "--max-instances",
        "1",
        "--memory-max",
        "64M",
        "--",
        &worker(),
        "--quiet",
        "--model-mib",
        "4",
    ]);
    let fits = fits["id"].as_str().expect("id").to_string();
    let mut pid = 0;
    wait_until(WAIT, "the fitting instance running", || {
        let i = instance(&d.job(&fits));
        pid = i["pid"].as_u64().unwrap_or(0) as u32;
        i["state"] == "running" && pid > 0
    });
    let (cgroup, limit) = memory_limit_of(pid).expect("the instance's memory cgroup");
    assert_eq!(limit, 64 << 20, "its memory cgroup {cgroup} has its limit");
    assert!(
        cgroup.contains("/lodgers/"),
        "a cgroup of lodger's own: {cgroup}"
    );
    assert_eq!(
        oom_score_adj(pid).as_deref(),
        Some("1000"),
        "a lodger first"
    );
    assert_eq!(
        oom_score_adj(w.pid()).as_deref(),
        Some("0"),
        "training untouched"
    );
    assert_eq!(
        instance(&d.job(&fits))["memory_max"].as_u64(),
        Some(64 << 20)
    );

    // A leaking one: 256 MiB of weights cannot fit 64 MiB.
    let leaks = d.ctl_json(&[
        "register",
        "offline",
        "--max-instances",
        "1",
        "--memory-max",
        "64M",
        "--",
        &worker(),
        "--quiet",
        "--model-mib",
        "256",
    ]);
    let leaks = leaks["id"].as_str().expect("id").to_string();
    let mut job = serde_json::Value::Null;
    wait_until(WAIT, "two OOM kills of the leaking instance", || {
        job = d.job(&leaks);
        job["oom_kills"].as_u64().unwrap_or(0) >= 2
    });
    let i = instance(&job);
    let error = job["last_error"].as_str().unwrap_or("");
    eprintln!(
        "leaking instance: {} OOM kills, {} restarts, last: {error}; fitting one in {cgroup}",
        job["oom_kills"], i["restarts"]
    );
    assert!(
        error.contains("killed by the OOM killer, memory limit 64 MiB"),
        "{job}"
    );
    // Back-off, not a tight loop: 1 s, 2 s, 4 s ... between starts (inference's defaults).
    let restarts = i["restarts"].as_u64().unwrap_or(0);
    assert!(
        (1..=4).contains(&restarts),
        "restarted with back-off: {job}"
    );
    let shown = d.ctl_ok(&["show", &leaks]);
    assert!(shown.contains("Memory: 64 MiB per instance"), "{shown}");
    assert!(shown.contains("OOM KILLS"), "{shown}");
    assert!(d.log().contains("killed by the OOM killer"), "{}", d.log());

    // The training process and the fitting instance lived through it.
    assert!(std::path::Path::new(&format!("/proc/{}", w.pid())).exists());
    assert_eq!(d.job(&train)["state"], "running");
    let i = instance(&d.job(&fits));
    assert_eq!(
        (i["state"].as_str(), i["restarts"].as_u64()),
        (Some("running"), Some(0))
    );
    assert_eq!(i["pid"].as_u64(), Some(u64::from(pid)));

    // Unregistered, its memory cgroup goes with it.
    d.ctl_ok(&["unregister", &leaks]);
    d.ctl_ok(&["unregister", &fits]);
    let dir = if cgroup_v2() {
        format!("/sys/fs/cgroup{cgroup}")
    } else {
        format!("/sys/fs/cgroup/memory{cgroup}")
    };
    wait_until(WAIT, "the instance's memory cgroup removed", || {
        !std::path::Path::new(&dir).exists()
    });
}

fn cgroup_v2() -> bool {
    std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}
