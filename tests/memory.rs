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

/// Whether lodgerd can put instances in a memory limit here; if not (v2 without memory
/// delegated to lodger's cgroup and without systemd: no cgroup of lodger's own, docs/memory.md),
/// the test is skipped with lodgerd's line saying why.
fn limits_apply(d: &Daemon, test: &str) -> bool {
    match d
        .log()
        .lines()
        .find(|l| l.contains("instances get no memory limit"))
    {
        Some(line) => {
            lodger::privileged::skip_as(lodger::privileged::SkipClass::NotApplicable, test, line);
            false
        }
        None => true,
    }
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
    // No reclaim before the limit: under memory.high (v2 units) the kernel throttles a leaking
    // instance for minutes before memory.max kills it.
    let d = lodgers_daemon(&bus, dir.path(), "memory_high_percent = 100\n");
    if !limits_apply(&d, test) {
        return;
    }
    let w = Workload::light();
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
    // lodger's subtree where lodgerd forks the instances, its instances' slice (named after the
    // daemon's cgroup parent) where systemd is PID 1 and starts them as units.
    assert!(
        cgroup.contains("/lodgers/") || cgroup.contains("-instances.slice/"),
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
    // Two starts, two fills of 64 MiB, a back-off between: some 20 s under emulation, and once
    // just over 60 s (the second kill was in the explanation): the bound only ends a failure.
    wait_until_explained(
        6 * WAIT,
        "two OOM kills of the leaking instance",
        || {
            job = d.job(&leaks);
            job["oom_kills"].as_u64().unwrap_or(0) >= 2
        },
        || format!("{:#}\n{}", d.job(&leaks), d.log()),
    );
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

/// Issue 19, memory pressure as contention: offline instances that thrash their page cache
/// inside their 32 MiB limits (each re-reads a 48 MiB file it wrote) stall on memory, which the
/// node's PSI shows; with a training job registered that is pressure, and contention control
/// cuts the lodgers' cores (one instance fewer). Once the instances stop thrashing (a file
/// tells them to, and every instance started after) the stalls end and the cut is given back.
/// The calm was a SIGSTOP of the instances then running, which leaves an instance started
/// after it (a second cut's give-back) thrashing: the likely cause, not seen, of the one
/// time-out in the VM suite.
#[test]
fn memory_pressure_while_lodgers_run_throttles_them_and_calm_gives_back() {
    let test = "memory_pressure_while_lodgers_run_throttles_them_and_calm_gives_back";
    if !need_root(test) {
        return;
    }
    if std::fs::read_to_string("/proc/pressure/memory").is_err() {
        lodger::privileged::skip_as(
            lodger::privileged::SkipClass::NotApplicable,
            test,
            "no /proc/pressure/memory: a kernel without CONFIG_PSI, or booted with psi=0",
        );
        return;
    }
    let _measuring = measuring();
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // The data files on a disk, never tmpfs: their page cache is what the instances thrash.
    let data = tempfile::tempdir_in("/var/tmp").expect("tempdir in /var/tmp");
    let d = lodgers_daemon(
        &bus,
        dir.path(),
        "[contention]\nmode = \"enforce\"\npressure_ticks = 2\ncalm_ticks = 3\n\
         memory_pressure_percent = 2\n",
    );
    if !limits_apply(&d, test) {
        return;
    }
    let w = Workload::train(1);
    let train = d.register_pid(w.pid(), 1);
    let calm = data.path().join("calm");
    let script = format!(
        "f={dir}/data-$LODGER_INSTANCE; c={dir}/calm; [ -e $c ] && exec sleep 3600; \
         head -c 48M /dev/urandom > $f; while [ ! -e $c ]; do cat $f > /dev/null; done; \
         rm -f $f; exec sleep 3600",
        dir = data.path().display()
    );
    let hog = d.ctl_json(&[
        "register",
        "offline",
        "--memory-max",
        "32M",
        "--",
        "/bin/sh",
        "-c",
        &script,
    ]);
    let hog = hog["id"].as_str().expect("id").to_string();
    let online = online_set().len();
    let running = |job: &serde_json::Value| {
        job["instances"]
            .as_array()
            .map_or(0, |v| v.iter().filter(|i| i["state"] == "running").count())
    };
    let mut job = serde_json::Value::Null;
    wait_until(WAIT, "an offline instance per CPU", || {
        job = d.job(&hog);
        running(&job) == online
    });
    wait_until(
        std::time::Duration::from_secs(60),
        "the lodgers throttled for training's memory stalls",
        || {
            job = d.job(&hog);
            job["throttle"].as_str().is_some_and(|t| !t.is_empty())
        },
    );
    let throttle = job["throttle"].as_str().unwrap_or("").to_string();
    eprintln!("throttled: {throttle}");
    assert!(throttle.contains("stalled on memory"), "{throttle}");
    assert!(
        throttle.contains(train.as_str()),
        "protecting {train}: {throttle}"
    );
    wait_until(WAIT, "one instance fewer", || {
        job = d.job(&hog);
        running(&job) < online
    });
    // Calm: every instance, running or started later, stops thrashing, so nothing stalls on
    // memory any more.
    std::fs::write(&calm, "").expect("the calm file");
    // It failed once in the VM suite (CI at 14d2745, when the calm was a SIGSTOP of the
    // instances then running), with no more said than the time-out: the job and the daemon's
    // contention lines say where the calm stuck.
    wait_until_explained(
        std::time::Duration::from_secs(60),
        "the cut given back on calm",
        || {
            let job = d.job(&hog);
            job["throttle"].is_null() || job["throttle"] == ""
        },
        || {
            let log = d.log();
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("throttl") || l.contains("contention") || l.contains("calm"))
                .collect();
            format!(
                "job: {}\ntraining: {}\nlog, contention lines (last 30 of {}):\n{}",
                d.job(&hog),
                d.job(&train),
                lines.len(),
                lines[lines.len().saturating_sub(30)..].join("\n")
            )
        },
    );
    assert!(d.log().contains("mechanism=release"), "{}", d.log());
    assert_eq!(d.job(&train)["state"], "running");
    d.ctl_ok(&["unregister", &hog]);
}

/// The v1 memory twin of a batch job (issue 19): a batch job registered by pid is moved into a
/// cpuset cgroup of lodger's on cgroup v1, and into a memory cgroup beside it limited to
/// `batch.memory_max`, or to the job's own lower limit (`--memory-max`); released, it goes back
/// to the memory cgroup it came from and the twin is removed. (cgroup v2 writes memory.max into
/// the job's own cgroup: fixture-tested in enforce::training::memory.)
#[test]
fn a_batch_job_on_cgroup_v1_runs_in_a_memory_cgroup_limited_to_batch_memory_max() {
    let test = "a_batch_job_on_cgroup_v1_runs_in_a_memory_cgroup_limited_to_batch_memory_max";
    if !need_root(test) || !lodger::privileged::need_cgroup_v1(test) {
        return;
    }
    if !std::path::Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() {
        lodger::privileged::skip_as(
            lodger::privileged::SkipClass::NotApplicable,
            test,
            "no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory",
        );
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = lodgers_daemon(&bus, dir.path(), "[batch]\nmemory_max = \"96M\"\n");
    let mut job = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("sleep");
    let pid = job.id();
    let (before, _) = memory_limit_of(pid).expect("its memory cgroup");
    let v = d.ctl_json(&["register", "batch", "--pid", &pid.to_string()]);
    let id = v["id"].as_str().expect("id").to_string();
    let mut now = None;
    wait_until(WAIT, "the batch job in its memory cgroup", || {
        now = memory_limit_of(pid);
        now.as_ref()
            .is_some_and(|(cg, _)| cg.ends_with(&format!("/{id}")))
    });
    let (cgroup, limit) = now.expect("memory cgroup");
    assert_eq!(limit, 96 << 20, "{cgroup}");
    let soft = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/memory{cgroup}/memory.soft_limit_in_bytes"
    ))
    .expect("soft limit");
    // 90% of it, down to a whole page.
    assert_eq!(soft.trim().parse::<u64>().ok(), Some(90_595_328));
    d.ctl_ok(&["unregister", &id]);
    assert_eq!(
        memory_limit_of(pid).map(|(cg, _)| cg),
        Some(before),
        "back where it came from"
    );
    assert!(!std::path::Path::new(&format!("/sys/fs/cgroup/memory{cgroup}")).exists());

    // A job's own limit, from its registration: above the node's it is refused and nothing is
    // registered; below, its twin gets it.
    let pid = pid.to_string();
    let out = d.ctl(&["register", "batch", "--pid", &pid, "--memory-max", "200M"]);
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("above this node's batch.memory_max"),
        "{said}"
    );
    assert_eq!(d.ctl_json(&["list"]).as_array().map(Vec::len), Some(0));
    let v = d.ctl_json(&["register", "batch", "--pid", &pid, "--memory-max", "48M"]);
    let id = v["id"].as_str().expect("id").to_string();
    assert_eq!(d.job(&id)["memory_max"].as_u64(), Some(48 << 20));
    wait_until(WAIT, "the batch job in its own limit", || {
        memory_limit_of(job.id())
            .is_some_and(|(cg, limit)| cg.ends_with(&format!("/{id}")) && limit == 48 << 20)
    });
    d.ctl_ok(&["unregister", &id]);
    let _ = job.kill();
    let _ = job.wait();
}
