//! End to end, as root, on real kernel interfaces: a private dbus-daemon, lodgerd, the bundled
//! training emulator registered with lodgerctl, and the result read back from /proc.

mod common;

use std::process::Command;

use common::*;
use nix::sys::signal::Signal;

const PRIO: i32 = 10;

/// lodgerd's reserved CPUs in these tests (the default of `DaemonOptions`).
const RESERVED: &str = "0";

/// The CPUs a job may get here: the online CPUs less the reserved one.
fn for_jobs() -> lodger::cpuset::CpuSet {
    job_cpus(RESERVED)
}

/// The CPUs lodgerd gave job `id`; asserts they are `cores` of the CPUs jobs may use.
fn cpus_of(d: &Daemon, id: &str, cores: usize) -> String {
    let job = d.job(id);
    let list = job["cpus"].as_str().expect("cpus").to_string();
    let got = cpus(&list);
    assert_eq!(got.len(), cores, "{job}");
    assert!(
        got.is_subset(&for_jobs()),
        "job on {list}, outside the CPUs for jobs {}: {job}",
        for_jobs()
    );
    list
}

/// What `status` shows as free once jobs hold `taken`.
fn free_after(taken: &str) -> String {
    for_jobs().difference(&cpus(taken)).to_list()
}

fn setup(test: &str) -> Option<(PrivateBus, tempfile::TempDir)> {
    if !need_root(test) {
        return None;
    }
    Some((PrivateBus::start(), tempfile::tempdir().expect("tempdir")))
}

#[test]
fn register_pins_every_thread_and_unregister_reverts() {
    let Some((bus, dir)) = setup("register_pins_every_thread_and_unregister_reverts") else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(3);
    let pid = w.pid();
    let before = cpus_allowed(pid, pid).expect("cpus");
    let cgroup_before = cpuset_cgroup_of(pid);
    assert!(all_other(pid));

    let id = d.register_pid(pid, 1);
    let job = d.job(&id);
    // Reserved CPU 0 is never given out: one of the others.
    let cpus = cpus_of(&d, &id, 1);
    assert_eq!(job["state"], "running");
    let job_cgroup = d.prove_job_cgroup(&id, pid, &cgroup_before);
    // RegisterJob returns after enforcement: no waiting needed.
    assert!(all_rr_on(pid, PRIO, &cpus), "threads not RR on {cpus}");
    let threads = tids(pid).len();
    assert_eq!(job["threads"].as_u64(), Some(threads as u64), "{job}");
    assert_eq!(job["rr_threads"].as_u64(), Some(threads as u64), "{job}");

    // A thread created after registration is caught by the next sweep.
    w.signal(Signal::SIGUSR1);
    wait_until(WAIT, "the new thread to appear", || {
        tids(pid).len() > threads
    });
    wait_until(WAIT, "the new thread to be swept", || {
        all_rr_on(pid, PRIO, &cpus)
    });

    d.ctl_ok(&["unregister", &id]);
    assert!(all_other(pid), "threads still RT after unregister");
    assert_eq!(cpus_allowed(pid, pid).as_deref(), Some(before.as_str()));
    let list = d.ctl_json(&["list"]);
    assert_eq!(list.as_array().map(|a| a.len()), Some(0), "{list}");
    // lodger's cgroup for the job (proved to exist above, when it pins by cgroup) is gone, and
    // the process is back where it was.
    if let Some(path) = job_cgroup {
        assert!(!path.exists(), "job cgroup {} left behind", path.display());
    }
    assert_eq!(cpuset_cgroup_of(pid), cgroup_before);
}

#[test]
fn killing_the_job_frees_its_cores() {
    let Some((bus, dir)) = setup("killing_the_job_frees_its_cores") else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let mut w = Workload::train(2);
    let cgroup_before = cpuset_cgroup_of(w.pid());
    let id = d.register_pid(w.pid(), 1);
    let taken = cpus_of(&d, &id, 1);
    let job_cgroup = d.prove_job_cgroup(&id, w.pid(), &cgroup_before);
    let status = d.ctl_json(&["status"]);
    assert_eq!(status["free"], free_after(&taken).as_str(), "{status}");
    assert_eq!(status["training_cpus"], taken.as_str(), "{status}");
    w.kill();
    wait_until(WAIT, "the job to be forgotten", || {
        d.ctl_json(&["list"])
            .as_array()
            .is_some_and(|a| a.is_empty())
    });
    let status = d.ctl_json(&["status"]);
    assert_eq!(status["free"], for_jobs().to_list().as_str(), "{status}");
    let out = d.ctl(&["show", &id]);
    assert_eq!(out.status.code(), Some(1));
    if let Some(path) = job_cgroup {
        wait_until(WAIT, "the job cgroup to be removed", || {
            !path.exists() && !cgroup_path(&d.parent).exists()
        });
    }
    assert!(
        !cgroup_path(&d.parent).join(&id).exists(),
        "no job cgroup is left"
    );
}

#[test]
fn bad_requests_are_refused_with_a_clear_error_and_change_nothing() {
    let Some((bus, dir)) = setup("bad_requests_are_refused") else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(1);
    let pid = w.pid().to_string();
    // More cores than the host has, whatever it has.
    let too_many = (online_set().len() + 1).to_string();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["register", "training", "--pid", "999999999", "--cores", "1"],
            1,
            "does not exist",
        ),
        (
            vec!["register", "training", "--pid", &pid, "--cores", "0"],
            1,
            "cores must be at least 1",
        ),
        (
            vec!["register", "training", "--pid", &pid, "--cores", &too_many],
            1,
            "free",
        ),
        (
            vec![
                "register", "training", "--pid", &pid, "--cores", "1", "--gpus", "999",
            ],
            1,
            // No host has a thousand GPUs.
            "GPU 999 does not exist",
        ),
        (
            vec![
                "register",
                "training",
                "--cgroup",
                "/no-such-cgroup-here",
                "--cores",
                "1",
            ],
            1,
            "no-such-cgroup-here",
        ),
        (vec!["unregister", "j999"], 1, "no job 'j999'"),
        (vec!["show", "../etc"], 1, "no job"),
        (vec!["register", "training", "--cores", "1"], 2, "--pid"),
    ];
    for (args, code, needle) in cases {
        let out = d.ctl(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: '{err}' lacks '{needle}'");
        // One plain sentence, not a debug dump.
        assert!(!err.contains("MethodError"), "{err}");
    }
    // Nothing was registered and nothing changed on the process.
    assert!(d
        .ctl_json(&["list"])
        .as_array()
        .is_some_and(|a| a.is_empty()));
    assert!(all_other(w.pid()));
    assert_eq!(
        d.ctl_json(&["status"])["free"],
        for_jobs().to_list().as_str()
    );

    // The same process twice is a conflict.
    let id = d.register_pid(w.pid(), 1);
    let out = d.ctl(&["register", "training", "--pid", &pid, "--cores", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&id));
}

#[test]
fn a_caller_that_is_not_root_nor_in_the_group_is_refused() {
    let Some((bus, dir)) = setup("non_root_refused") else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(1);
    let nobody = 65534;
    let out = d.ctl_as(
        Some(nobody),
        &[
            "register",
            "training",
            "--pid",
            &w.pid().to_string(),
            "--cores",
            "1",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("uid 65534 may not"), "{err}");
    assert!(all_other(w.pid()));
    // Reading is open to everyone.
    let out = d.ctl_as(Some(nobody), &["list"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // And a job registered by root cannot be unregistered by them.
    let id = d.register_pid(w.pid(), 1);
    let out = d.ctl_as(Some(nobody), &["unregister", &id]);
    assert_eq!(out.status.code(), Some(1));
    let taken = cpus_of(&d, &id, 1);
    assert!(all_rr_on(w.pid(), PRIO, &taken));
}

#[test]
fn busctl_calls_as_documented() {
    let Some((bus, dir)) = setup("busctl_calls_as_documented") else {
        return;
    };
    let daemon = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(1);
    let busctl = |args: &[&str]| {
        Command::new("busctl")
            .arg("--address")
            .arg(&bus.address)
            .args(args)
            .output()
            .expect("busctl")
    };
    let pid = w.pid().to_string();
    let out = busctl(&[
        "call",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "RegisterJob",
        "a{sv}",
        "3",
        "kind",
        "s",
        "training",
        "pids",
        "au",
        "1",
        &pid,
        "cores",
        "u",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("so \"j1\" \"/org/lodger1/job/j1\""),
        "{stdout}"
    );
    let taken = cpus_of(&daemon, "j1", 1);
    assert!(all_rr_on(w.pid(), PRIO, &taken));

    let out = busctl(&[
        "get-property",
        "org.lodger1",
        "/org/lodger1/job/j1",
        "org.lodger1.Job",
        "Cpus",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("s \"{taken}\"")
    );
    let out = busctl(&[
        "get-property",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "Free",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("s \"{}\"", free_after(&taken))
    );

    // A wrong type is a named error naming the key.
    let out = busctl(&[
        "call",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "RegisterJob",
        "a{sv}",
        "3",
        "kind",
        "s",
        "training",
        "pids",
        "au",
        "1",
        &pid,
        "cores",
        "s",
        "one",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("cores"), "{err}");

    let out = busctl(&[
        "call",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "UnregisterJob",
        "s",
        "j1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all_other(w.pid()));
    let out = busctl(&[
        "call",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "UnregisterJob",
        "s",
        "j1",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job"));
}

#[test]
fn jobs_survive_a_restart_and_dead_ones_are_cleaned_up() {
    let Some((bus, dir)) = setup("jobs_survive_a_restart") else {
        return;
    };
    let mut d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let mut w = Workload::train(2);
    let cgroup_before = cpuset_cgroup_of(w.pid());
    let id = d.register_pid(w.pid(), 1);
    let taken = cpus_of(&d, &id, 1);
    let job_cgroup = d.prove_job_cgroup(&id, w.pid(), &cgroup_before);
    d.stop();
    // While lodgerd is down the job keeps its cpuset and policy.
    assert!(all_rr_on(w.pid(), PRIO, &taken));
    d.restart();
    let job = d.job(&id);
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(job["cpus"], taken.as_str());
    // Threads created while it was down are caught after the restart.
    w.signal(Signal::SIGUSR1);
    wait_until(WAIT, "the new thread to be swept", || {
        all_rr_on(w.pid(), PRIO, &taken)
    });

    // A job that dies while lodgerd is down is cleaned up at the next start.
    d.stop();
    w.kill();
    d.restart();
    assert!(d
        .ctl_json(&["list"])
        .as_array()
        .is_some_and(|a| a.is_empty()));
    assert_eq!(
        d.ctl_json(&["status"])["free"],
        for_jobs().to_list().as_str()
    );
    if let Some(path) = job_cgroup {
        assert!(!path.exists(), "job cgroup {} left behind", path.display());
    }
    assert!(!cgroup_path(&d.parent).join(&id).exists());
    // Ids are never reused.
    let w2 = Workload::train(1);
    let id2 = d.register_pid(w2.pid(), 1);
    assert_ne!(id, id2);
}

#[test]
fn a_bad_config_is_refused_at_start_with_file_line_and_key() {
    if !need_root("a_bad_config_is_refused") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        ("[training]\nrt_priority = 0\n", 2, "training.rt_priority"),
        ("[agent]\ninterval_ms = 0\n", 2, "agent.interval_ms"),
        (
            "[node]\nreserved_cpus = \"4000\"\n",
            2,
            "node.reserved_cpus",
        ),
        ("[agent]\nintervall = 5\n", 2, "intervall"),
        ("\n\n[training]\nrt_priority = \"high\"\n", 4, "rt_priority"),
    ];
    for (text, line, key) in cases {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).expect("write");
        let out = Command::new(bin("lodgerd"))
            .arg("--config")
            .arg(&path)
            .arg("--check-config")
            .output()
            .expect("lodgerd");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {err}");
        let want = format!("{}:{line}", path.display());
        assert!(err.contains(&want), "{text}: '{err}' lacks '{want}'");
        assert!(err.contains(key), "{text}: '{err}' lacks '{key}'");
    }
}

#[test]
fn affinity_pinning_leaves_the_cgroup_alone_and_sweeps_escapes() {
    let Some((bus, dir)) = setup("affinity_pinning") else {
        return;
    };
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            pid_jobs: "affinity",
            ..DaemonOptions::default()
        },
    );
    let w = Workload::train(2);
    let pid = w.pid();
    let cgroup_before = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let id = d.register_pid(pid, 1);
    let taken = cpus_of(&d, &id, 1);
    assert!(all_rr_on(pid, PRIO, &taken));
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup"),
        cgroup_before,
        "affinity pinning must not move the process"
    );
    let status = d.ctl_json(&["status"]);
    let version = match host_cgroup() {
        HostCgroup::V2 => "v2",
        _ => "v1",
    };
    assert_eq!(
        status["enforcement"],
        format!("cgroup {version}, pid jobs pinned by affinity").as_str()
    );
    assert!(!cgroup_path(&d.parent).join(&id).exists());
    // A thread that widens its own affinity and drops RR is put back by the sweep.
    let n = tids(pid).len();
    w.signal(Signal::SIGUSR2);
    wait_until(WAIT, "the escaping thread to appear", || {
        tids(pid).len() > n
    });
    wait_until(WAIT, "the escaping thread to be swept", || {
        all_rr_on(pid, PRIO, &taken)
    });
    d.ctl_ok(&["unregister", &id]);
    assert!(all_other(pid));
    assert_eq!(
        cpus_allowed(pid, pid).as_deref(),
        Some(online_cpus().as_str())
    );
}

/// A cpuset cgroup holding a process, as a Slurm step would, in this host's hierarchy (v1:
/// under /sys/fs/cgroup/cpuset with its own cpus and mems; v2: under /sys/fs/cgroup, with the
/// cpuset controller enabled at the root); removed on drop.
struct StepCgroup {
    path: std::path::PathBuf,
    rel: String,
}

impl StepCgroup {
    fn new(pid: u32) -> StepCgroup {
        let rel = format!("/{}", unique("slurm-step"));
        let path = cgroup_path(&rel);
        if host_cgroup() == HostCgroup::V2 {
            let control = cpuset_root().join("cgroup.subtree_control");
            let enabled = std::fs::read_to_string(&control).unwrap_or_default();
            if !enabled.split_whitespace().any(|c| c == "cpuset") {
                std::fs::write(&control, "+cpuset").expect("enable cpuset at the v2 root");
            }
        }
        std::fs::create_dir(&path).expect("mkdir cgroup");
        if host_cgroup() == HostCgroup::V1 {
            std::fs::write(path.join("cpuset.mems"), "0").expect("mems");
            std::fs::write(path.join("cpuset.cpus"), online_cpus()).expect("cpus");
        }
        std::fs::write(path.join("cgroup.procs"), pid.to_string()).expect("attach");
        StepCgroup { path, rel }
    }

    fn cpus(&self) -> String {
        read_trimmed(&self.path.join("cpuset.cpus"))
    }

    fn effective(&self) -> String {
        read_trimmed(&self.path.join("cpuset.cpus.effective"))
    }
}

fn read_trimmed(path: &std::path::Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_string()
}

impl Drop for StepCgroup {
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.path.join("cgroup.procs")) {
            for p in procs.lines() {
                let _ = std::fs::write(cpuset_root().join("cgroup.procs"), p);
            }
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Registers the step cgroup as a job and checks its cpuset is set, then restored.
fn cgroup_job_gets_its_cpuset_set_and_restored(test: &str) {
    let Some((bus, dir)) = setup(test) else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(2);
    let step = StepCgroup::new(w.pid());
    assert_eq!(
        cpuset_cgroup_of(w.pid()).as_deref(),
        Some(step.rel.as_str())
    );
    let before = step.cpus();
    let out = d.ctl_json(&[
        "register", "training", "--cgroup", &step.rel, "--cores", "1",
    ]);
    let id = out["id"].as_str().expect("id").to_string();
    assert_eq!(out["cgroup"], step.rel.as_str());
    let taken = cpus_of(&d, &id, 1);
    assert_eq!(step.cpus(), taken);
    assert!(all_rr_on(w.pid(), PRIO, &taken));
    assert_eq!(out["pids"], serde_json::json!([w.pid()]));
    d.ctl_ok(&["unregister", &id]);
    if before.is_empty() {
        // v2, inherited from the parent (empty cpuset.cpus): the kernel (before Linux 7.0)
        // refuses to write the empty value back into a populated cgroup, so lodger restores the
        // whole node's CPUs, which follows the parent just the same.
        let after = step.cpus();
        assert!(
            after.is_empty() || after == online_cpus(),
            "the step's inherited cpuset was restored as '{after}'"
        );
        assert_eq!(
            step.effective(),
            read_trimmed(&cpuset_root().join("cpuset.cpus.effective")),
            "the step's effective CPUs follow its parent again"
        );
    } else {
        assert_eq!(step.cpus(), before, "the step's cpuset was not restored");
    }
    assert!(all_other(w.pid()));
    // The step's cgroup is the job's: lodger leaves it (and the process in it) where it was.
    assert!(step.path.is_dir());
    assert_eq!(
        cpuset_cgroup_of(w.pid()).as_deref(),
        Some(step.rel.as_str())
    );
}

#[test]
fn a_cgroup_job_gets_its_cpuset_set_and_restored() {
    let test = "a_cgroup_job_v1";
    if need_cgroup_v1(test) {
        cgroup_job_gets_its_cpuset_set_and_restored(test);
    }
}

#[test]
fn a_v2_cgroup_job_gets_its_cpuset_set_and_restored() {
    let test = "a_cgroup_job_v2";
    if need_cgroup_v2(test) {
        cgroup_job_gets_its_cpuset_set_and_restored(test);
    }
}

#[test]
fn rt_group_scheduling_without_budget_is_refused_with_the_file_to_change() {
    // A kernel without RT group scheduling is a shape this test does not apply to, not a
    // missing privilege.
    if !need_rt_group_sched("rt_group_budget") {
        return;
    }
    let Some((bus, dir)) = setup("rt_group_budget") else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(1);
    // A v1 cpu cgroup has no RT budget until someone grants one.
    let name = unique("no-rt-budget");
    let cg = std::path::Path::new("/sys/fs/cgroup/cpu").join(&name);
    std::fs::create_dir(&cg).expect("mkdir");
    std::fs::write(cg.join("cgroup.procs"), w.pid().to_string()).expect("attach");
    let out = d.ctl(&[
        "register",
        "training",
        "--pid",
        &w.pid().to_string(),
        "--cores",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    std::fs::write("/sys/fs/cgroup/cpu/cgroup.procs", w.pid().to_string()).expect("move back");
    std::fs::remove_dir(&cg).expect("rmdir");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("{name}/cpu.rt_runtime_us")), "{err}");
    assert!(err.contains("grant_rt_budget_us"), "{err}");
    // Refused means nothing changed: no job, no cgroup, still SCHED_OTHER on every CPU.
    assert!(d
        .ctl_json(&["list"])
        .as_array()
        .is_some_and(|a| a.is_empty()));
    assert!(all_other(w.pid()));
    assert_eq!(
        cpus_allowed(w.pid(), w.pid()).as_deref(),
        Some(online_cpus().as_str())
    );
}

#[test]
fn job_changed_signals_follow_the_job() {
    use futures_util::StreamExt;
    let Some((bus, dir)) = setup("job_changed_signals") else {
        return;
    };
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let mut w = Workload::train(1);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let seen: Vec<(String, String)> = rt.block_on(async {
        let conn = zbus::connection::Builder::address(bus.address.as_str())
            .expect("address")
            .build()
            .await
            .expect("connect");
        let proxy = lodger::api::proxy::ManagerProxy::new(&conn)
            .await
            .expect("proxy");
        let mut changes = proxy.receive_job_changed().await.expect("subscribe");
        let id = d.register_pid(w.pid(), 1);
        w.kill();
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let next = tokio::time::timeout(WAIT, changes.next())
                .await
                .expect("a JobChanged signal in time")
                .expect("signal stream");
            let args = next.args().expect("args");
            assert_eq!(args.id(), &id);
            seen.push((args.id().to_string(), args.state().to_string()));
        }
        seen
    });
    assert_eq!(
        seen,
        vec![
            ("j1".to_string(), "running".to_string()),
            ("j1".to_string(), "exited".to_string())
        ]
    );
}
