//! Inference lodgers end to end, as root: lodgerd runs online and offline instances of the
//! bundled CPU inference worker beside a training job, on a private bus.

mod common;

use common::*;

fn worker() -> String {
    example("infer_worker").display().to_string()
}

fn instances(job: &serde_json::Value) -> Vec<serde_json::Value> {
    job["instances"].as_array().cloned().unwrap_or_default()
}

fn running_pids(job: &serde_json::Value) -> Vec<u32> {
    instances(job)
        .iter()
        .filter(|i| i["state"] == "running")
        .filter_map(|i| i["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
        .filter(|p| *p > 0)
        .collect()
}

/// Registers an offline job of the bundled worker with `model_mib` of weights (and at most
/// `max_batch`); its id.
fn register_offline(d: &Daemon, max_batch: Option<u32>, model_mib: u32) -> String {
    let (batch, model) = (max_batch.map(|b| b.to_string()), model_mib.to_string());
    let mut args = vec!["register", "offline"];
    if let Some(b) = &batch {
        args.extend(["--max-batch", b.as_str()]);
    }
    let worker = worker();
    args.extend([
        "--",
        worker.as_str(),
        "--quiet",
        "--model-mib",
        model.as_str(),
    ]);
    d.ctl_json(&args)["id"].as_str().expect("id").to_string()
}

#[test]
fn online_never_on_training_cpus_offline_shares_them_and_nothing_is_left_behind() {
    if !need_root("lodgers_end_to_end") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = lodgers_daemon(&bus, dir.path(), "");
    let w = Workload::light();
    let train = d.register_pid(w.pid(), 1);
    let training_cpus = d.job(&train)["cpus"].as_str().expect("cpus").to_string();
    // No CPU is reserved: offline runs one single-thread instance on each online CPU.
    let per_cpu = online_set().len();

    // Offline: single-thread instances on every CPU, the training CPU included, SCHED_OTHER.
    let off_id = register_offline(&d, Some(2), 1);
    let mut job = serde_json::Value::Null;
    wait_until(WAIT, "one offline instance per CPU running", || {
        job = d.job(&off_id);
        running_pids(&job).len() == per_cpu
    });
    let mut on_training = false;
    let mut cpus_seen = lodger::cpuset::CpuSet::new();
    // The instances' cgroups (pinned by cgroup): proved to exist now, checked gone at the end.
    let lodgers_cgroup = format!("/{}/lodgers/", d.parent);
    let mut instance_cgroups = Vec::new();
    for i in instances(&job) {
        let pid = i["pid"].as_u64().expect("pid") as u32;
        let cpus = i["cpus"].as_str().expect("cpus");
        assert_eq!(cpus_allowed(pid, pid).as_deref(), Some(cpus), "{i}");
        assert_eq!(sched_of(pid).map(|(p, _)| p), Some(libc::SCHED_OTHER));
        // The OOM killer takes a lodger first.
        assert_eq!(
            std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
                .expect("oom_score_adj")
                .trim(),
            "1000"
        );
        assert_eq!(i["threads"], 1);
        let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
        assert!(
            environ
                .split(|b| *b == 0)
                .any(|v| v == b"OMP_NUM_THREADS=1"),
            "OMP_NUM_THREADS not set"
        );
        on_training |= cpus == training_cpus;
        cpus_seen = cpus_seen.union(&common::cpus(cpus));
        let cgroup = cpuset_cgroup_of(pid).unwrap_or_default();
        if cgroup.starts_with(&lodgers_cgroup) {
            let path = cgroup_path(&cgroup);
            assert!(path.is_dir(), "{} does not exist", path.display());
            instance_cgroups.push(path);
        } else {
            assert_ne!(
                host_cgroup(),
                HostCgroup::V1,
                "on cgroup v1 instances are placed in cgroups under {lodgers_cgroup}: {cgroup}"
            );
        }
    }
    assert_eq!(cpus_seen, online_set(), "one instance on every CPU: {job}");
    assert!(
        on_training,
        "an offline instance shares the training CPU: {job}"
    );
    // Training is still SCHED_RR on its CPU, above the lodger, and keeps its OOM score.
    assert!(all_rr_on(w.pid(), 10, &training_cpus));
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{}/oom_score_adj", w.pid()))
            .expect("oom_score_adj")
            .trim(),
        "0"
    );

    // A killed instance is restarted.
    let victim = running_pids(&job)[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    wait_until(WAIT, "the killed instance to be restarted", || {
        let j = d.job(&off_id);
        let pids = running_pids(&j);
        pids.len() == per_cpu && !pids.contains(&victim)
    });

    // Online: only on the CPU training does not hold; offline moves off it.
    let on = d.ctl_json(&[
        "register",
        "online",
        "--slo-ms",
        "1000",
        "--max-batch",
        "4",
        "--",
        &worker(),
        "--quiet",
        "--model-mib",
        "1",
    ]);
    let on_id = on["id"].as_str().expect("id").to_string();
    wait_until(WAIT, "an online instance running", || {
        running_pids(&d.job(&on_id)).len() == 1
    });
    // The job's own latency (its instances' batches pooled): what its SLO is judged by.
    wait_until(WAIT, "the online job's pooled p99", || {
        let j = d.job(&on_id);
        let (p50, p99) = (j["latency_p50_ms"].as_f64(), j["latency_p99_ms"].as_f64());
        p50.zip(p99).is_some_and(|(a, b)| a > 0.0 && a <= b)
    });
    // Shown too, by a later call: a layout probe may restart the instances meanwhile (its
    // start waits for the stopped one to leave the CPUs), and a window without batches has no
    // p99 to show.
    wait_until(WAIT, "show to give the pooled p99", || {
        d.ctl_ok(&["show", &on_id]).contains("p99 ms:")
    });
    // An offline job has no SLO, and its instances' batches are not pooled each tick.
    assert!(d.job(&off_id)["latency_p99_ms"].is_null());
    for _ in 0..10 {
        // Through the probes of its layout search, never on the training CPU.
        for i in instances(&d.job(&on_id)) {
            let cpus = i["cpus"].as_str().unwrap_or("");
            assert!(
                lodger::cpuset::CpuSet::parse(cpus)
                    .expect("cpus")
                    .is_disjoint(&lodger::cpuset::CpuSet::parse(&training_cpus).expect("cpus")),
                "online instance on training CPU {training_cpus}: {i}"
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // Offline leaves the online instances' CPUs and keeps the training CPU (on two CPUs: one
    // instance, on the training CPU).
    let cpus_of = |job: &serde_json::Value| {
        instances(job)
            .iter()
            .filter_map(|i| i["cpus"].as_str().map(common::cpus))
            .fold(lodger::cpuset::CpuSet::new(), |a, b| a.union(&b))
    };
    wait_until(WAIT, "offline to leave the online CPUs", || {
        let online_held = cpus_of(&d.job(&on_id));
        let offline = d.job(&off_id);
        let offline_cpus = cpus_of(&offline);
        !online_held.is_empty()
            && offline_cpus.is_disjoint(&online_held)
            && instances(&offline)
                .iter()
                .any(|i| i["cpus"] == training_cpus.as_str())
    });

    // Unregistering leaves no instance process and no instance cgroup.
    let pids: Vec<u32> = running_pids(&d.job(&off_id))
        .into_iter()
        .chain(running_pids(&d.job(&on_id)))
        .collect();
    d.ctl_ok(&["unregister", &on_id]);
    d.ctl_ok(&["unregister", &off_id]);
    for pid in pids {
        wait_until(WAIT, "instances to be gone", || {
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|s| s.contains(") Z "))
                    .unwrap_or(true)
        });
    }
    // Unregistering starts the stops; the next ticks reap the instances and remove their
    // cgroups (issue 16: the agent's loop never waits out a stop).
    for path in &instance_cgroups {
        wait_until(WAIT, "the instance cgroups to be removed", || {
            !path.exists()
        });
    }
    let lodgers = cgroup_path(&d.parent).join("lodgers");
    let left = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&lodgers)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_until(WAIT, "no instance cgroup left", || left().is_empty());
    assert!(all_rr_on(w.pid(), 10, &training_cpus));
}

#[test]
fn a_bad_command_template_is_refused() {
    if !need_root("bad_command_template") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = lodgers_daemon(&bus, dir.path(), "");
    let out = d.ctl(&["register", "offline", "--", "/no/such/program", "{threads}"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/no/such/program"), "{err}");
    let out = d.ctl(&[
        "register",
        "offline",
        "--",
        &worker(),
        "--threads",
        "{thread}",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("{thread}"), "{err}");
    let out = d.ctl(&["register", "online", "--slo-ms", "0", "--", &worker()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(d
        .ctl_json(&["list"])
        .as_array()
        .is_some_and(|a| a.is_empty()));
}

#[test]
fn an_exclusive_training_jobs_cores_host_no_lodger() {
    if !need_root("an_exclusive_training_jobs_cores_host_no_lodger") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = lodgers_daemon(&bus, dir.path(), "");
    let w = Workload::light();
    let v = d.ctl_json(&[
        "register",
        "training",
        "--pid",
        &w.pid().to_string(),
        "--cores",
        "1",
        "--exclusive",
    ]);
    let train = v["id"].as_str().expect("id").to_string();
    let training_cpus = cpus(d.job(&train)["cpus"].as_str().expect("cpus"));
    assert_eq!(d.job(&train)["exclusive"], true);
    assert!(d.ctl_ok(&["show", &train]).contains("Exclusive: yes"));
    let lent = online_set().difference(&training_cpus);
    let off_id = register_offline(&d, None, 1);
    let mut job = serde_json::Value::Null;
    wait_until(WAIT, "one offline instance per lent CPU", || {
        job = d.job(&off_id);
        running_pids(&job).len() == lent.len()
    });
    let on: lodger::cpuset::CpuSet = instances(&job)
        .iter()
        .map(|i| cpus(i["cpus"].as_str().unwrap_or("")))
        .fold(lodger::cpuset::CpuSet::new(), |a, c| a.union(&c));
    assert_eq!(on, lent, "no instance on the exclusive job's CPUs: {job}");
    // Released, its core is lent again.
    d.ctl_ok(&["unregister", &train]);
    wait_until(WAIT, "an offline instance on every CPU", || {
        running_pids(&d.job(&off_id)).len() == online_set().len()
    });
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid"));
    nix::sys::signal::kill(pid, sig).expect("signal the instance");
}

/// The CPU time of a process (utime + stime), in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let text = std::fs::read(format!("/proc/{pid}/stat")).expect("stat");
    let (ticks, _) = lodger::sense::cpu::parse_pid_stat(&text).expect("parse stat");
    ticks as f64 / procfs::ticks_per_second() as f64
}

#[test]
fn lent_cpu_time_matches_the_instances_own_on_the_training_core() {
    if !need_root("lent_cpu_time_matches_the_instances_own_on_the_training_core") {
        return;
    }
    let _measuring = measuring();
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut d = lodgers_daemon(&bus, dir.path(), "");
    let w = Workload::light();
    let train = d.register_pid(w.pid(), 1);
    let training_cpus = d.job(&train)["cpus"].as_str().expect("cpus").to_string();
    let off_id = register_offline(&d, None, 1);
    // The instance on the training job's CPU.
    let mut lodger_pid = 0;
    wait_until(WAIT, "an offline instance on the training CPU", || {
        instances(&d.job(&off_id)).iter().any(|i| {
            let hit = i["state"] == "running" && i["cpus"] == training_cpus.as_str();
            if hit {
                lodger_pid = i["pid"].as_u64().unwrap_or(0) as u32;
            }
            hit && lodger_pid > 0
        })
    });
    let lent = |d: &Daemon| d.job(&train)["lent_cpu_s"].as_f64().expect("lent_cpu_s");
    // Both counts read while the instance is stopped (SIGSTOP) and lodgerd has ticked twice
    // since: neither moves meanwhile, so they compare without a tick's lag.
    let ticks = |d: &Daemon| d.ctl_json(&["status"])["ticks"].as_u64().expect("ticks");
    let settled = |d: &Daemon| {
        signal(lodger_pid, nix::sys::signal::Signal::SIGSTOP);
        let t = ticks(d);
        wait_until(WAIT, "two ticks of lodgerd", || ticks(d) >= t + 2);
        let counts = (lent(d), cpu_seconds(lodger_pid));
        signal(lodger_pid, nix::sys::signal::Signal::SIGCONT);
        counts
    };
    let (lent0, own0) = settled(&d);
    // Measured until the instance has used a CPU-second there (the training job and whatever
    // else runs on the machine decide how fast that comes), at most a minute.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while cpu_seconds(lodger_pid) - own0 < 1.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let (lent1, own1) = settled(&d);
    let (dl, dn) = (lent1 - lent0, own1 - own0);
    eprintln!("lent {dl:.2} CPU-s by lodgerd's count, the instance's own {dn:.2} CPU-s");
    assert!(
        dn >= 1.0,
        "the instance ran on the training CPU: {dn:.2} CPU-s in a minute"
    );
    assert!(
        (dl - dn).abs() <= 0.03 * dn + 0.02,
        "lent {dl:.2} against {dn:.2}\n{:#}\n{:#}\n{}",
        d.job(&train),
        d.job(&off_id),
        d.log()
    );
    let shown = d.ctl_ok(&["show", &train]);
    assert!(shown.contains("CPU-s to lodgers"), "{shown}");
    let lodged = d.job(&off_id)["lodged_on_training_cpu_s"]
        .as_f64()
        .expect("lodged_on_training_cpu_s");
    assert!(
        lodged >= dl,
        "the lodger's own count: {lodged:.2} >= {dl:.2}"
    );
    // Kept across a restart.
    let before = lent(&d);
    d.restart();
    assert!(lent(&d) >= before, "lent time survives a restart");
}

#[test]
fn offline_batches_on_the_training_core_are_cut_to_the_bound_once() {
    if !need_root("offline_batches_on_the_training_core_are_cut_to_the_bound_once") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // A 1 ms bound: a batch of 64 with 1 MiB of weights takes several ms of CPU (under
    // emulation seconds: each instance's probe window must hold a batch for the cut to be
    // measured).
    let d = lodgers_daemon(&bus, dir.path(), "training_core_batch_ms = 1\n");
    let w = Workload::light();
    let train = d.register_pid(w.pid(), 1);
    let training_cpus = d.job(&train)["cpus"].as_str().expect("cpus").to_string();
    let off_id = register_offline(&d, Some(64), 1);
    let mut job = serde_json::Value::Null;
    let on_training = |job: &serde_json::Value, yes: bool| -> Vec<serde_json::Value> {
        instances(job)
            .into_iter()
            .filter(|i| (i["cpus"] == training_cpus.as_str()) == yes)
            .collect()
    };
    // Three batches of 64 must complete first: a debug-built worker under emulation (the VM's
    // run of this suite) takes several seconds for one.
    wait_until_explained(
        3 * WAIT,
        "a smaller batch on the training CPU, running",
        || {
            job = d.job(&off_id);
            let there = on_training(&job, true);
            running_pids(&job).len() == online_set().len()
                && !there.is_empty()
                && there
                    .iter()
                    .all(|i| i["state"] == "running" && i["batch"].as_u64() < Some(64))
        },
        || format!("{:#}\n{}", d.job(&off_id), d.log()),
    );
    for i in on_training(&job, true) {
        assert!(i["batch"].as_u64() >= Some(1), "{i}");
    }
    for i in on_training(&job, false) {
        assert_eq!(i["batch"], 64, "the job's batch on idle CPUs: {i}");
    }
    let layout = job["layout"].as_str().unwrap_or("");
    eprintln!("layout: {layout}");
    assert!(
        layout.contains("on training cores") && layout.contains("training_core_batch_ms = 1"),
        "{layout}"
    );
    assert!(d.ctl_ok(&["show", &off_id]).contains("on training cores"));
    // Decided once: the instances keep their pids and batches over the next ticks.
    let ticks = |d: &Daemon| d.ctl_json(&["status"])["ticks"].as_u64().expect("ticks");
    let t = ticks(&d);
    wait_until(WAIT, "three more ticks", || ticks(&d) >= t + 3);
    let later = d.job(&off_id);
    let pids_batches = |j: &serde_json::Value| -> Vec<(serde_json::Value, serde_json::Value)> {
        instances(j)
            .iter()
            .map(|i| (i["pid"].clone(), i["batch"].clone()))
            .collect()
    };
    assert_eq!(pids_batches(&later), pids_batches(&job), "{later}");
}
