//! Slurm's prolog and epilog end to end, as root, on real kernel interfaces (issue 18): a fake
//! Slurm cgroup tree made as Slurm's task/cgroup plugin makes it (v1: `<prepend>/uid_U/job_J/
//! step_S`; v2 alike, with cpuset enabled), `lodgerctl slurm prolog|epilog` run with slurmd's
//! environment, and the result read back from /proc and the cgroup files. The VM suite runs
//! the same against a real slurmd (tests/e2e).

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

const PRIO: i32 = 10;
/// The owner the prolog registers for (nobody): lodger records it, the processes stay root's.
const OWNER: u32 = 65534;

/// A fake Slurm job cgroup with one step, confined to `cpus`; removed on drop (its processes
/// killed first).
struct SlurmCgroup {
    /// The prepend directory (one per test).
    root: String,
    job: String,
    step: String,
    pids: Vec<u32>,
}

impl SlurmCgroup {
    fn create(root: &str, job_id: u32, cpus: &str) -> SlurmCgroup {
        let job = format!("{root}/uid_{OWNER}/job_{job_id}");
        let step = format!("{job}/step_0");
        let mems =
            std::fs::read_to_string(cpuset_root().join(mems_file())).unwrap_or_else(|_| "0".into());
        let v2 = host_cgroup() == HostCgroup::V2;
        let mut rel = String::new();
        for part in step.trim_start_matches('/').split('/') {
            let parent = cgroup_path(&rel);
            if v2 {
                // As Slurm does: cpuset enabled down to the job's cgroups.
                let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+cpuset");
            }
            rel = format!("{rel}/{part}");
            let dir = cgroup_path(&rel);
            std::fs::create_dir_all(&dir).expect("create the fake Slurm cgroup");
            std::fs::write(dir.join("cpuset.mems"), mems.trim()).expect("cpuset.mems");
            std::fs::write(dir.join("cpuset.cpus"), cpus).expect("cpuset.cpus");
        }
        SlurmCgroup {
            root: root.to_string(),
            job,
            step,
            pids: Vec::new(),
        }
    }

    /// Moves `pid` into the step, as slurmstepd does with a task.
    fn attach(&mut self, pid: u32) {
        std::fs::write(
            cgroup_path(&self.step).join("cgroup.procs"),
            pid.to_string(),
        )
        .expect("attach to the step");
        self.pids.push(pid);
    }

    fn cpus_file(&self, rel: &str) -> String {
        std::fs::read_to_string(cgroup_path(rel).join("cpuset.cpus"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// Ends the job as Slurm does: its processes killed, its cgroups removed. Returns whether
    /// the job's cgroup is gone.
    fn end(&mut self) -> bool {
        for pid in self.pids.drain(..) {
            if let Ok(p) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        wait_until(
            Duration::from_secs(10),
            "the job's processes to exit",
            || {
                std::fs::read_to_string(cgroup_path(&self.step).join("cgroup.procs"))
                    .map(|s| s.trim().is_empty())
                    .unwrap_or(true)
            },
        );
        remove_cgroup_tree(&self.job)
    }
}

impl Drop for SlurmCgroup {
    fn drop(&mut self) {
        self.end();
        let _ = remove_cgroup_tree(&self.root);
    }
}

/// Runs `lodgerctl slurm <what>` as slurmd would, with `env`, giving lodgerd ten seconds (not
/// the default 1.5: the tests that run beside this one load both CPUs, and a prolog that gives
/// up exits 0 having said nothing was done, which is right on a node and a failure here).
fn slurm(d: &Daemon, what: &str, env: &[(&str, String)]) -> Output {
    slurm_within(d, what, env, Some("10000"))
}

/// [`slurm`] with `--deadline-ms deadline_ms`, or lodgerctl's default (None).
fn slurm_within(
    d: &Daemon,
    what: &str,
    env: &[(&str, String)],
    deadline_ms: Option<&str>,
) -> Output {
    let mut cmd = Command::new(bin("lodgerctl"));
    cmd.args(["slurm", what]);
    if let Some(ms) = deadline_ms {
        cmd.args(["--deadline-ms", ms]);
    }
    cmd.arg("--config")
        .arg(&d.config)
        .env_clear()
        .env("DBUS_SYSTEM_BUS_ADDRESS", &d.bus_address)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .expect("run lodgerctl slurm")
}

fn job_env(job_id: u32, extra: &[(&str, &str)]) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = vec![
        ("SLURM_JOB_ID", job_id.to_string()),
        ("SLURM_JOB_UID", OWNER.to_string()),
        ("SLURM_JOB_USER", "nobody".into()),
        ("SLURM_JOB_NUM_NODES", "1".into()),
        ("SLURMD_NODENAME", "testnode".into()),
        ("SLURM_SCRIPT_CONTEXT", "prolog_slurmd".into()),
    ];
    for (k, v) in extra {
        let k: &'static str = Box::leak(k.to_string().into_boxed_str());
        env.push((k, v.to_string()));
    }
    env
}

/// The lodger job registered for Slurm job `slurm_id`, if any.
fn registered(d: &Daemon, slurm_id: u32) -> Option<serde_json::Value> {
    let jobs = d.ctl_json(&["list"]);
    jobs.as_array()?
        .iter()
        .find(|j| j["slurm_job"].as_u64() == Some(u64::from(slurm_id)))
        .cloned()
}

fn daemon(test: &str) -> Option<(PrivateBus, tempfile::TempDir, Daemon, String, [u32; 2])> {
    if !need_root(test) {
        return None;
    }
    let (reserved, two) = two_job_cpus(test)?;
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let root = format!("/{}", unique("slurm-test"));
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            reserved,
            extra: format!(
                "[slurm]\ncgroup_paths = [\"{root}/uid_{{uid}}/job_{{job}}\"]\n\n\
                 [[slurm.rule]]\npartition = \"gpu\"\nkind = \"training\"\n\n\
                 [batch]\npolicy = \"batch\"\n"
            ),
            ..DaemonOptions::default()
        },
    );
    Some((bus, dir, d, root, two))
}

fn stdout_and_err(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn a_slurm_training_job_is_pinned_inside_slurms_cpuset_and_released_by_the_epilog() {
    let test = "a_slurm_training_job_is_pinned_inside_slurms_cpuset_and_released_by_the_epilog";
    let Some((_bus, _dir, d, root, [a, b])) = daemon(test) else {
        return;
    };
    let slurm_id = 4201;
    // The partition rule makes it training (this machine has no GPU to name).
    let env = job_env(
        slurm_id,
        &[
            ("SLURM_JOB_PARTITION", "gpu"),
            ("SLURM_JOB_CPUS_PER_NODE", "1"),
        ],
    );
    let out = slurm(&d, "prolog", &env);
    assert!(out.status.success(), "{}", stdout_and_err(&out));
    let said = stdout_and_err(&out);
    assert!(said.contains("registered as training job"), "{said}");
    let job = registered(&d, slurm_id).expect("registered");
    assert_eq!(job["kind"], "training");
    assert_eq!(job["state"], "pending", "no cgroup yet: {job}");
    assert_eq!(job["owner_uid"].as_u64(), Some(u64::from(OWNER)), "{job}");

    // slurmstepd creates the job's cgroup and starts its tasks: one unbound, one the user
    // bound to CPU b (--cpu-bind).
    let both = format!("{a}-{b}");
    let mut cg = SlurmCgroup::create(&root, slurm_id, &both);
    let mut w = Workload::train(3);
    cg.attach(w.pid());
    // In the step and bound before the task's exec, in that order, as slurmstepd does
    // (task/cgroup, then task/affinity): before Linux 6.2, joining a cpuset cgroup resets a
    // task's affinity to the cgroup's CPUs. Until the task's exec it is slurmstepd's child, a
    // program file named slurmstepd, which lodger leaves alone: here a root-owned copy of sh
    // named slurmstepd joins the step, then execs a copy of taskset named slurmstepd, which
    // binds and execs the task. A child of this test binary doing the same was not: a tick
    // between its join and its binding took it for an unbound task and pinned it (once in the
    // VM suite), which Slurm's own child never shows lodger.
    let bind_dir = tempfile::tempdir().expect("tempdir");
    let copy = |from: &str, to: &std::path::Path| {
        std::fs::create_dir(to.parent().expect("dir")).expect("mkdir");
        // By `cp`, another process: a copy this process wrote could be held open for writing
        // by a child another test forked meanwhile, failing the exec with ETXTBSY.
        let copied = Command::new("cp").arg(from).arg(to).status().expect("cp");
        assert!(copied.success(), "cp {from} {}", to.display());
    };
    let (sh, taskset) = (
        bind_dir.path().join("sh").join("slurmstepd"),
        bind_dir.path().join("taskset").join("slurmstepd"),
    );
    copy("/bin/sh", &sh);
    copy("/usr/bin/taskset", &taskset);
    let procs = cgroup_path(&cg.step).join("cgroup.procs");
    let mut bound = Command::new(&sh)
        .arg("-c")
        .arg(format!(
            "echo 0 > '{}' && exec '{}' -c {b} sleep 600",
            procs.display(),
            taskset.display()
        ))
        .spawn()
        .expect("bound sleep");
    cg.pids.push(bound.id());
    // Slurm's step daemon lives in the job's cgroups too (v2: step_<n>/slurm): not the job's.
    // Root's program file named slurmstepd, copied by `cp` (another process): a copy this
    // process wrote could be held open for writing by a child another test forked meanwhile,
    // failing the exec with ETXTBSY (seen once in the VM suite).
    let stepd_dir = tempfile::tempdir().expect("tempdir");
    let stepd_bin = stepd_dir.path().join("slurmstepd");
    let copied = Command::new("cp")
        .arg("/bin/sleep")
        .arg(&stepd_bin)
        .status()
        .expect("cp");
    assert!(copied.success(), "cp /bin/sleep {}", stepd_bin.display());
    let mut stepd = Command::new(&stepd_bin)
        .arg("600")
        .spawn()
        .expect("fake slurmstepd");
    cg.attach(stepd.id());
    // A job's process calling itself slurmstepd (a link of its own by that name: its comm is
    // "slurmstepd") is the job's all the same.
    let posing_bin = stepd_dir.path().join("posing").join("slurmstepd");
    std::fs::create_dir(posing_bin.parent().expect("dir")).expect("mkdir");
    std::os::unix::fs::symlink("/bin/sleep", &posing_bin).expect("link sleep");
    let mut posing = Command::new(&posing_bin)
        .arg("600")
        .spawn()
        .expect("posing slurmstepd");
    cg.attach(posing.id());
    let slurm_files = (cg.cpus_file(&cg.job), cg.cpus_file(&cg.step));

    let mut placed = String::new();
    wait_until(WAIT, "the Slurm job pinned SCHED_RR", || {
        let Some(job) = registered(&d, slurm_id) else {
            return false;
        };
        placed = job["cpus"].as_str().unwrap_or("").to_string();
        // Every task of the cgroup, the bound one too: a tick may come between attaching the
        // workload and attaching the bound task.
        job["state"] == "running"
            && !placed.is_empty()
            && all_rr_on(w.pid(), PRIO, &placed)
            && matches!(sched_of(bound.id()), Some((libc::SCHED_RR, _)))
            && all_rr_on(posing.id(), PRIO, &placed)
    });
    let placed_set = cpus(&placed);
    assert_eq!(placed_set.len(), 1, "SLURM_JOB_CPUS_PER_NODE=1: {placed}");
    assert!(
        placed_set.is_subset(&cpus(&both)),
        "inside Slurm's cpuset: {placed}"
    );
    // The bound task keeps its CPU and gets the class.
    assert_eq!(
        cpus_allowed(bound.id(), bound.id()).as_deref(),
        Some(b.to_string().as_str())
    );
    assert!(matches!(sched_of(bound.id()), Some((libc::SCHED_RR, _))));
    assert!(
        matches!(sched_of(stepd.id()), Some((libc::SCHED_OTHER, 0))),
        "slurmstepd"
    );
    assert_eq!(
        cpus_allowed(stepd.id(), stepd.id()).as_deref(),
        Some(both.as_str())
    );
    let shown = d.ctl_ok(&["show", job["id"].as_str().expect("id")]);
    assert!(shown.contains(&format!("Slurm job: {slurm_id}")), "{shown}");
    // Slurm's files are Slurm's.
    assert_eq!((cg.cpus_file(&cg.job), cg.cpus_file(&cg.step)), slurm_files);

    let out = slurm(&d, "epilog", &env);
    assert!(out.status.success(), "{}", stdout_and_err(&out));
    assert!(
        stdout_and_err(&out).contains("unregistered"),
        "{}",
        stdout_and_err(&out)
    );
    assert!(registered(&d, slurm_id).is_none());
    assert!(all_other(w.pid()), "threads back to SCHED_OTHER");
    assert_eq!(
        cpus_allowed(w.pid(), w.pid()).as_deref(),
        Some(both.as_str())
    );
    assert!(all_other(bound.id()));
    assert_eq!(
        cpus_allowed(bound.id(), bound.id()).as_deref(),
        Some(b.to_string().as_str())
    );
    // A second epilog (slurmd retries) has nothing to undo and still succeeds.
    let out = slurm(&d, "epilog", &env);
    assert!(out.status.success());
    assert!(
        stdout_and_err(&out).contains("not registered"),
        "{}",
        stdout_and_err(&out)
    );
    w.kill();
    for c in [&mut bound, &mut stepd, &mut posing] {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[test]
fn a_cpu_only_slurm_job_is_batch_and_forgotten_when_its_cgroup_goes() {
    let test = "a_cpu_only_slurm_job_is_batch_and_forgotten_when_its_cgroup_goes";
    let Some((_bus, _dir, d, root, [a, b])) = daemon(test) else {
        return;
    };
    let slurm_id = 4202;
    let env = job_env(slurm_id, &[("SLURM_JOB_PARTITION", "cpu")]);
    let out = slurm(&d, "prolog", &env);
    assert!(
        stdout_and_err(&out).contains("registered as batch job"),
        "{}",
        stdout_and_err(&out)
    );
    let both = format!("{a}-{b}");
    let mut cg = SlurmCgroup::create(&root, slurm_id, &both);
    let mut hog = Command::new(example("busy_loop"))
        .args(["--threads", "2", "--seconds", "600"])
        .stdout(Stdio::null())
        .spawn()
        .expect("busy_loop");
    cg.attach(hog.id());
    wait_until(WAIT, "the batch job running SCHED_BATCH", || {
        registered(&d, slurm_id).is_some_and(|j| j["state"] == "running")
            && tids(hog.id())
                .iter()
                .all(|&t| matches!(sched_of(t), Some((libc::SCHED_BATCH, 0))))
    });
    let job = registered(&d, slurm_id).expect("job");
    assert_eq!(job["kind"], "batch");
    assert_eq!(job["sched_policy"], "SCHED_BATCH");
    let on = cpus(job["cpus"].as_str().unwrap_or(""));
    assert!(on.is_subset(&cpus(&both)) && !on.is_empty(), "{job}");

    // No epilog: Slurm ends the job and removes its cgroup; lodger notices.
    let removed = cg.end();
    let _ = hog.wait();
    assert!(
        removed,
        "the test could not remove Slurm job {slurm_id}'s cgroup"
    );
    wait_until_explained(
        WAIT,
        "the job forgotten once its cgroup is gone",
        || registered(&d, slurm_id).is_none(),
        || format!("lodgerd's log:\n{}", d.log()),
    );
    assert!(
        d.log()
            .lines()
            .any(|l| l.contains("job ended") && l.contains("kind=\"batch\"")),
        "{}",
        d.log()
    );
}

#[test]
fn the_prolog_exits_0_when_lodgerd_is_stalled_or_down_so_no_node_is_drained() {
    let test = "the_prolog_exits_0_when_lodgerd_is_stalled_or_down_so_no_node_is_drained";
    let Some((_bus, _dir, mut d, _root, _)) = daemon(test) else {
        return;
    };
    let env = job_env(4203, &[]);
    // Stalled: lodgerd holds its bus name but answers nothing.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(d.pid()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let out = slurm_within(&d, "prolog", &env, None);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    assert!(out.status.success(), "{}", stdout_and_err(&out));
    assert!(
        stdout_and_err(&out).contains("did not answer within 1500 ms"),
        "{}",
        stdout_and_err(&out)
    );
    // Down.
    d.stop();
    for what in ["prolog", "epilog"] {
        let out = slurm(&d, what, &env);
        assert!(out.status.success(), "{what}: {}", stdout_and_err(&out));
        assert!(
            stdout_and_err(&out).contains("nothing done"),
            "{what}: {}",
            stdout_and_err(&out)
        );
    }
    // Not run by slurmd at all: still 0, and says why.
    let out = slurm(&d, "prolog", &[]);
    assert!(out.status.success());
    assert!(stdout_and_err(&out).contains("SLURM_JOB_ID is not set"));
    d.restart();
}

/// A prolog slurm.conf passes an option lodgerctl refuses (here a deadline out of its range)
/// still exits 0 and says what was wrong, before ever reaching lodgerd: clap's own exit code
/// 2 would drain the node. No lodgerd is needed (none is on the empty bus).
#[test]
fn a_prolog_with_a_bad_option_exits_0_and_says_what_was_wrong() {
    for (what, args) in [
        ("prolog", &["slurm", "prolog", "--deadline-ms", "20000"][..]),
        (
            "epilog",
            &["--session", "slurm", "epilog", "--no-such-option"][..],
        ),
    ] {
        let out = Command::new(bin("lodgerctl"))
            .args(args)
            .env_clear()
            .env(
                "DBUS_SYSTEM_BUS_ADDRESS",
                "unix:path=/nonexistent/lodger-test-bus",
            )
            .env(
                "DBUS_SESSION_BUS_ADDRESS",
                "unix:path=/nonexistent/lodger-test-bus",
            )
            .env("SLURM_JOB_ID", "4204")
            .env("SLURM_JOB_UID", OWNER.to_string())
            .stdin(Stdio::null())
            .output()
            .expect("run lodgerctl slurm");
        let text = stdout_and_err(&out);
        assert_eq!(out.status.code(), Some(0), "{what}: {text}");
        assert!(
            text.contains(&format!("lodger slurm {what}: job 4204: nothing done"))
                && text.contains("bad command line"),
            "{what}: {text}"
        );
    }
    let out = Command::new(bin("lodgerctl"))
        .args(["slurm", "prolog", "--deadline-ms", "20000"])
        .env_clear()
        .output()
        .expect("run lodgerctl slurm");
    assert!(
        stdout_and_err(&out).contains("20000 is not in 100..=10000"),
        "{}",
        stdout_and_err(&out)
    );
}
