//! What an instance cannot do to lodgerd: bad specs and commands, a report flood, an output FIFO
//! nobody reads, forged marks, a working directory on a hung mount; and the Python client under the
//! runner.

use super::*;

/// A plan's mistakes (batch, threads, CPUs, a duplicate) fail the whole call before anything
/// starts. A bad command (the owner's: a template lodger cannot run, a program deleted) fails
/// only its own instances, said in the outcome's errors: another job's instances are started
/// all the same (one job's missing program must not stop lodger from managing the others).
#[test]
fn bad_specs_are_refused_and_bad_commands_fail_only_their_instances() {
    let test = "bad_specs_are_refused_and_bad_commands_fail_only_their_instances";
    let parent = unique("lodger-it-inst");
    let logs = tempfile::tempdir().expect("tempdir");
    let mut inst = match Instances::new(settings(&parent, logs.path(), InstancePlacement::Auto)) {
        Ok(i) => i,
        Err(e) => {
            lodger::privileged::skip(test, &format!("no cpuset hierarchy to read: {e}"));
            return;
        }
    };
    let good = spec("j11", 0, worker(&[]), "0", 1);
    for (bad, says) in [
        (
            InstanceSpec {
                batch: 0,
                ..good.clone()
            },
            "batch must be at least 1",
        ),
        (
            InstanceSpec {
                threads: 0,
                ..good.clone()
            },
            "threads must be at least 1",
        ),
        (
            InstanceSpec {
                cpus: CpuSet::new(),
                ..good.clone()
            },
            "no CPU",
        ),
        (
            InstanceSpec {
                cpus: set("4000"),
                ..good.clone()
            },
            "not all on this node",
        ),
    ] {
        let e = inst.reconcile(&[bad]).expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    let e = inst
        .reconcile(&[good.clone(), good.clone()])
        .expect_err("duplicate");
    assert!(e.to_string().contains("listed twice"), "{e}");
    // All or nothing: the good spec next to a bad one was not started.
    assert!(inst.stats().is_empty());
    assert!(!cgroup_dir(&parent).exists());

    let not_exec = logs.path().join("model-server");
    std::fs::write(&not_exec, "#!/bin/sh\n").expect("write");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (Vec::new(), "empty"),
        (
            worker(&["--batch", "{batchsize}"]),
            "unknown placeholder {batchsize}",
        ),
        (worker(&["--batch", "{batch"]), "unmatched '{'"),
        (
            strings(&["lodger-no-such-server", "--threads", "{threads}"]),
            "not found in lodgerd's PATH",
        ),
        (
            vec![not_exec.to_string_lossy().into_owned()],
            "cannot be run",
        ),
    ];
    for (argv, says) in cases {
        let bad = [0, 1].map(|i| spec("j12", i, argv.clone(), "1", 1));
        let out = inst
            .reconcile(&[good.clone(), bad[0].clone(), bad[1].clone()])
            .expect("reconciled");
        assert_eq!(out.errors.len(), 1, "said once a job: {:?}", out.errors);
        let e = &out.errors[0];
        let text = e.to_string();
        assert!(
            matches!(e, InstanceError::Template { .. }),
            "{argv:?}: {text}"
        );
        assert!(text.contains(says), "{argv:?}: {text}");
        assert!(text.contains("job j12"), "{text}");
        if let InstanceError::Template {
            problem: TemplateProblem::ProgramNotFound { .. },
            ..
        } = e
        {
            assert!(text.contains("absolute path"), "{text}");
        }
        let jobs: Vec<String> = inst.stats().iter().map(|s| s.job.to_string()).collect();
        assert_eq!(jobs, ["j11"], "only the good job's instance");
    }
    // Dropping the supervisor ends the good job's instance and removes lodger's cgroups.
    drop(inst);
    assert!(!cgroup_dir(&parent).exists());
}

#[test]
fn python_client_reports_under_the_runner() {
    let Some(mut f) = Fixture::new(
        "python_client_reports_under_the_runner",
        InstancePlacement::Auto,
    ) else {
        return;
    };
    let python = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let Some(python) = python else {
        lodger::privileged::skip("python_client_reports_under_the_runner", "no python3");
        return;
    };
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/instance_client.py");
    let argv = vec![python, client.to_string_lossy().into_owned()];
    f.inst()
        .reconcile(&[spec("j13", 0, argv, "1", 1)])
        .expect("reconcile");
    let stats = f.poll_until("the Python client to report", |s| {
        running_with_reports(&s[0], 5)
    });
    let st = &stats[0];
    assert_eq!(st.bad_reports, 0, "{}", f.logs());
    assert!(st.items_per_s > 0.0);
    assert!(st.latency_p99_ms.is_some());
    let pid = pid_of(&stats, "j13", 0);
    assert_eq!(cpus_allowed(pid, pid).as_deref(), Some("1"));
    let out = f.inst().stop_all();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert!(out.killed.is_empty(), "the client stops on SIGTERM");
    let logs = f.logs();
    assert!(logs.contains("instance_client demo: served"), "{logs}");
    assert!(
        logs.contains("batch=2 cpus=[1] reporting to fd 3"),
        "{logs}"
    );
}

/// An instance that writes report lines faster than lodgerd can parse them (`yes`) cannot hold
/// the agent's thread in the read loop, nor grow lodgerd's memory: each poll reads at most
/// `MAX_REPORT_BYTES_PER_POLL` of its lines and returns (the rest waits in the pipe, and the
/// writer blocks), and its window keeps at most `MAX_RECENT_REPORTS` reports. The polls run on
/// a thread of their own, so a poll that never returns fails the test instead of hanging it.
#[test]
fn an_instance_flooding_its_report_pipe_cannot_hold_a_poll() {
    use lodger::enforce::instances::{MAX_RECENT_REPORTS, MAX_REPORT_BYTES_PER_POLL};
    let Some(mut f) = Fixture::new(
        "an_instance_flooding_its_report_pipe_cannot_hold_a_poll",
        cgroup_placement(),
    ) else {
        return;
    };
    let line = r#"{"items":1,"latency_ms":0.5}"#;
    // Braces would be template placeholders: the shell makes them.
    let flood = strings(&[
        "/bin/sh",
        "-c",
        r#"yes '("items":1,"latency_ms":0.5)' | tr '()' '\173\175' >&3"#,
    ]);
    let mut inst = f.inst.take().expect("instances");
    let started = inst
        .reconcile(&[spec("j9", 0, flood, "1", 1)])
        .expect("reconcile");
    assert!(started.errors.is_empty(), "{:?}", started.errors);
    let (tx, rx) = mpsc::channel();
    let poller = std::thread::spawn(move || {
        let mut most = 0;
        for _ in 0..20 {
            let out = inst.poll();
            most = most.max(out.reports);
            let _ = tx.send(());
            std::thread::sleep(Duration::from_millis(50));
        }
        (inst, most)
    });
    for n in 0..20 {
        assert!(
            rx.recv_timeout(WAIT).is_ok(),
            "poll {n} did not return within {WAIT:?}: the flood holds it"
        );
    }
    let (inst, most) = poller.join().expect("poller");
    f.inst = Some(inst);
    let per_poll = (MAX_REPORT_BYTES_PER_POLL / (line.len() + 1) + 1) as u64;
    assert!(
        most > 0,
        "the instance reported nothing: {:#?}\n{}",
        f.inst().stats(),
        f.logs()
    );
    assert!(
        most <= per_poll,
        "{most} lines read at one poll, more than {per_poll}"
    );
    let stats = f.inst().stats();
    assert!(
        stats[0].latency_samples <= MAX_RECENT_REPORTS as u64,
        "{} reports kept",
        stats[0].latency_samples
    );
}

/// An owner's output file that is a FIFO nobody reads (a forked instance, where lodgerd's
/// child opens it before exec, and lodgerd's spawn waits for that exec): the start fails at once
/// with the reason, instead of blocking lodgerd's thread in the open for good. The reconcile
/// runs on a thread of its own, so one that never returns fails the test instead of hanging it.
#[test]
fn an_output_fifo_nobody_reads_fails_the_start_instead_of_blocking_it() {
    let name = "an_output_fifo_nobody_reads_fails_the_start_instead_of_blocking_it";
    if instances_are_units() {
        lodger::privileged::not_applicable(
            name,
            "systemd is PID 1: a unit's wrapper opens the output after its exec, which lodgerd \
             does not wait for",
        );
        return;
    }
    let Some(mut f) = Fixture::new(name, cgroup_placement()) else {
        return;
    };
    let fifo = f.logs.path().join("out.fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    let mut wanted = spec("j8", 0, worker(&[]), "1", 1);
    wanted.identity.launch = Box::new(lodger::job::Launch {
        output: Some(fifo.display().to_string()),
        ..lodger::job::Launch::default()
    });
    f.start_backs_off(
        wanted,
        "the open of the FIFO",
        "is a FIFO or socket nobody reads",
    );
}

/// The marks adoption looks for are environment variables anyone can set: a process of another
/// user that carries an instance's marks (its job, index, threads and batch) is not taken for
/// that instance at a restart, so it cannot get the owner's instance killed and itself placed
/// on its CPUs in its stead. It is swept as any other marked leftover.
#[test]
fn another_users_process_forging_an_instances_marks_is_not_adopted() {
    use std::os::unix::process::CommandExt;
    let name = "another_users_process_forging_an_instances_marks_is_not_adopted";
    let Some(f) = Fixture::new(name, cgroup_placement()) else {
        return;
    };
    // Owned by the test's uid (root); the forger is nobody.
    let wanted = spec("j7", 0, worker(&[]), "1", 1);
    let forger = Workload::adopt(
        Command::new("sleep")
            .arg("300")
            .env("LODGER_PARENT", format!("/{}", f.parent))
            .env("LODGER_JOB", "j7")
            .env("LODGER_INSTANCE", "0")
            .env("LODGER_THREADS", "1")
            .env("LODGER_BATCH", "2")
            .uid(65534)
            .gid(65534)
            .process_group(0)
            .spawn()
            .expect("spawn the forger"),
    );
    let pid = forger.pid();
    wait_until(WAIT, "the forger to exec with its marks", || {
        environ_var(pid, "LODGER_JOB").as_deref() == Some("j7")
    });
    let mut next = Instances::new(f.settings(cgroup_placement())).expect("Instances");
    let out = next.adopt(&[wanted]).expect("adopt");
    assert!(out.adopted.is_empty(), "{out:?}");
    assert!(out.killed.contains(&pid), "swept: {out:?}");
    next.stop_all();
    drop(forger);
}

/// A working directory on a mount that does not answer (a hard NFS mount whose server is down):
/// the registration's check and a forked instance's start name it within a bound instead of
/// blocking lodgerd's thread in a `stat`, or in the spawn that waits for the child's `chdir`.
/// The reconcile runs on a thread of its own, so one that never returns fails the test instead
/// of hanging it; the looks left waiting return once the mount is aborted.
#[test]
fn a_working_directory_on_a_mount_that_never_answers_fails_the_start_instead_of_blocking_it() {
    let name =
        "a_working_directory_on_a_mount_that_never_answers_fails_the_start_instead_of_blocking_it";
    if instances_are_units() {
        lodger::privileged::not_applicable(
            name,
            "systemd is PID 1: systemd changes into a unit's directory, lodgerd does not wait",
        );
        return;
    }
    let Some(mut f) = Fixture::new(name, cgroup_placement()) else {
        return;
    };
    let hung = match fuse::HungMount::new() {
        Ok(m) => m,
        Err(why) => return lodger::privileged::skip(name, &why),
    };
    let cwd = hung.path().join("work").display().to_string();
    let launch = lodger::job::Launch {
        cwd: Some(cwd.clone()),
        ..lodger::job::Launch::default()
    };
    let me = nix::unistd::geteuid().as_raw();
    let (tx, rx) = mpsc::channel();
    let check = launch.clone();
    std::thread::spawn(move || {
        let _ = tx.send(lodger::enforce::instances::check_launch(me, &check));
    });
    let refused = rx
        .recv_timeout(WAIT)
        .expect("the registration's check did not return: a stat holds it");
    let why = refused.expect_err("a directory that never answers");
    assert!(
        why.contains(&cwd) && why.contains("did not answer"),
        "{why}"
    );

    let mut wanted = spec("j9", 0, worker(&[]), "1", 1);
    wanted.identity.launch = Box::new(launch);
    f.start_backs_off(wanted, "the child's chdir", "did not answer");

    // A program on the hung mount: the check that it is executable (at registration, and
    // before each start) names it instead of blocking in a stat.
    let mut wanted = spec(
        "j10",
        0,
        vec![hung.path().join("serve").display().to_string()],
        "1",
        1,
    );
    wanted.identity.launch = Box::new(lodger::job::Launch::default());
    let mut inst = f.inst.take().expect("instances");
    let (tx, rx) = mpsc::channel();
    let starter = std::thread::spawn(move || {
        let outcome = inst.reconcile(&[wanted]).map(|o| format!("{:?}", o.errors));
        let _ = tx.send(outcome);
        inst
    });
    let errors = rx
        .recv_timeout(WAIT)
        .expect("reconcile did not return: the program's stat holds it")
        .expect("reconcile");
    f.inst = Some(starter.join().expect("starter"));
    assert!(errors.contains("did not answer"), "{errors}");

    assert!(lodger::sys::stall::stuck() >= 1, "the looks still wait");
    drop(hung);
    wait_until(WAIT, "the looks at the aborted mount to return", || {
        lodger::sys::stall::stuck() == 0
    });
}
