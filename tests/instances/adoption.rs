//! Instances outliving their supervisor: adopted or swept after a crash, affinity placement without
//! cgroups, the supervisor dropped or panicking, arguments passed as written.

use super::*;

/// Issue 17: a supervisor that goes away without stopping anything (a crashed or restarted
/// lodgerd) leaves its instances running; the next one adopts the instance its plan still wants
/// (same process, heard again through its report FIFO, nothing restarted) and kills and removes
/// the one it does not want, with the process that instance started and its cgroup.
#[test]
fn a_crashed_supervisors_instances_are_adopted_or_swept() {
    if !cgroups_of_lodgers_own("a_crashed_supervisors_instances_are_adopted_or_swept") {
        return;
    }
    let Some(f) = Fixture::new(
        "a_crashed_supervisors_instances_are_adopted_or_swept",
        cgroup_placement(),
    ) else {
        return;
    };
    let fifos = tempfile::tempdir().expect("tempdir");
    let with_fifos = || InstanceSettings {
        report_dir: Some(fifos.path().to_path_buf()),
        ..f.settings(cgroup_placement())
    };
    let s = with_fifos();
    let lodgers = f.lodgers();
    // j8-0 starts a child in a session of its own (out of its process group), then becomes
    // the worker: the child is still j8-0's, and stays when j8-0 is adopted.
    let kept = spec(
        "j8",
        0,
        strings(&[
            "/bin/sh",
            "-c",
            &format!("setsid sleep 300 & exec {}", worker_line()),
        ]),
        "0",
        1,
    );
    let (tx, rx) = mpsc::channel();
    let first = kept.clone();
    let crashed = {
        let lodgers = lodgers.clone();
        std::thread::spawn(move || {
            let mut inst = Instances::new(s).expect("Instances");
            inst.reconcile(&[first, spec("j8", 1, wrapped_worker(), "1", 1)])
                .expect("reconcile");
            wait_until(
                WAIT,
                "the wrapped worker to start and j8-0 to report",
                || {
                    let _ = inst.poll();
                    let reported = inst
                        .stats()
                        .iter()
                        .any(|s| s.index == 0 && s.reports_total > 0);
                    reported
                        && procs_of(&format!("{lodgers}/j8-1")).len() == 2
                        && procs_of(&format!("{lodgers}/j8-0")).len() == 2
                },
            );
            let direct: Vec<u32> = inst.stats().iter().filter_map(|s| s.pid).collect();
            tx.send((
                direct,
                procs_of(&format!("{lodgers}/j8-1")),
                procs_of(&format!("{lodgers}/j8-0")),
            ))
            .expect("send");
            // Gone without stopping anything, as a killed lodgerd.
            std::mem::forget(inst);
        })
    };
    crashed.join().expect("thread");
    let (direct, wrapped, first) = rx.recv().expect("pids");
    assert_eq!(direct.len(), 2, "{direct:?}");
    let sleeper = first
        .iter()
        .copied()
        .find(|&p| p != direct[0])
        .expect("j8-0's child");
    // No death signal: everything runs on without its supervisor.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        direct.iter().chain(&wrapped).all(|&p| alive(p)),
        "{direct:?} {wrapped:?}"
    );

    // The next supervisor wants j8-0 only.
    let mut next = Instances::new(with_fifos()).expect("Instances");
    let out = next.adopt(std::slice::from_ref(&kept)).expect("adopt");
    assert_eq!(out.adopted.len(), 1, "{out:?}");
    assert_eq!(out.adopted[0].1, direct[0], "the same process");
    let mut killed = wrapped.clone();
    killed.sort_unstable();
    assert_eq!(out.killed, killed, "j8-1's shell and the worker it started");
    assert_eq!(out.removed_cgroups, vec![format!("{lodgers}/j8-1")]);
    assert!(
        alive(sleeper),
        "j8-0's child left its group, and is still j8-0's"
    );
    wait_until(WAIT, "j8-1's processes to die", || {
        wrapped.iter().all(|&p| !alive(p))
    });
    assert!(!cgroup_dir(&format!("{lodgers}/j8-1")).exists());
    assert!(!fifos.path().join("j8-1.report").exists());
    // Supervised again: nothing restarted, and its reports reach the new supervisor.
    let started = next
        .reconcile(std::slice::from_ref(&kept))
        .expect("reconcile");
    assert!(
        started.started.is_empty() && !started.changed,
        "{started:?}"
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let _ = next.poll();
        let stats = next.stats();
        if stats[0].reports_total > 0 {
            assert_eq!(stats[0].pid, Some(direct[0]));
            assert_eq!(stats[0].restarts, 0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no report after adoption: {stats:#?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // And it refuses to adopt under running instances.
    assert!(matches!(
        next.adopt(&[kept]),
        Err(InstanceError::SweepWithInstances { running: 1 })
    ));
    next.stop_all();
    assert!(!alive(direct[0]));
    wait_until(WAIT, "j8-0's child to end with it", || !alive(sleeper));
    drop(f);
}

#[test]
fn affinity_placement_pins_moves_and_sweeps_without_cgroups() {
    let Some(mut f) = Fixture::new(
        "affinity_placement_pins_moves_and_sweeps_without_cgroups",
        InstancePlacement::Affinity,
    ) else {
        return;
    };
    assert_eq!(f.inst().placement(), PinMethod::Affinity);
    let mine = cpuset_cgroup_of(std::process::id());
    let mut desired = [spec("j9", 0, worker(&[]), "1", 2)];
    f.inst().reconcile(&desired).expect("reconcile");
    let stats = f.poll_until("the instance to report", |s| running_with_reports(&s[0], 1));
    let pid = pid_of(&stats, "j9", 0);
    assert_eq!(stats[0].cgroup, None);
    match &stats[0].unit {
        // Where systemd is PID 1: in the cgroup of the transient unit systemd started it as.
        Some(unit) => assert!(
            cpuset_cgroup_of(pid)
                .is_some_and(|cg| cg.ends_with(&format!("-instances.slice/{unit}"))),
            "in its unit's cgroup: {:?}",
            cpuset_cgroup_of(pid)
        ),
        None => assert_eq!(
            cpuset_cgroup_of(pid),
            mine,
            "stays in lodger's own cpuset cgroup"
        ),
    }
    assert!(!cgroup_dir(&f.parent).exists());
    let t = tids(pid);
    assert_eq!(t.len(), 2);
    assert!(t
        .iter()
        .all(|&tid| cpus_allowed(pid, tid).as_deref() == Some("1")));

    // A CPU change moves every thread.
    desired[0].cpus = set("0");
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(out.moved.len(), 1, "{out:?}");
    assert_eq!(pid_of(&f.inst().stats(), "j9", 0), pid);
    assert!(t
        .iter()
        .all(|&tid| cpus_allowed(pid, tid).as_deref() == Some("0")));
    f.inst().stop_all();
    assert!(!alive(pid));

    // A crash with a wrapped worker, whose job is then gone.
    let s = f.settings(InstancePlacement::Affinity);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut inst = Instances::new(s).expect("Instances");
        inst.reconcile(&[spec("j9", 1, wrapped_worker(), "1", 1)])
            .expect("reconcile");
        let sh = inst.stats()[0].pid.expect("pid");
        let mut child = None;
        wait_until(WAIT, "the wrapped worker to start", || {
            child = children(sh).first().copied();
            child.is_some()
        });
        tx.send((sh, child.expect("child"))).expect("send");
        std::mem::forget(inst);
    })
    .join()
    .expect("thread");
    let (sh, orphan) = rx.recv().expect("pids");
    assert!(alive(sh) && alive(orphan));
    assert_eq!(cpus_allowed(orphan, orphan).as_deref(), Some("1"));
    // Not wanted any more: the shell and its child are found by their LODGER_PARENT.
    let mut next = Instances::new(f.settings(InstancePlacement::Affinity)).expect("Instances");
    let swept = next.adopt(&[]).expect("adopt");
    let mut both = vec![sh, orphan];
    both.sort_unstable();
    assert_eq!(swept.killed, both);
    assert!(swept.adopted.is_empty() && swept.removed_cgroups.is_empty());
    wait_until(WAIT, "the leftovers to die", || {
        !alive(sh) && !alive(orphan)
    });
}

#[test]
fn dropping_the_supervisor_kills_its_instances() {
    if !cgroups_of_lodgers_own("dropping_the_supervisor_kills_its_instances") {
        return;
    }
    let Some(mut f) = Fixture::new(
        "dropping_the_supervisor_kills_its_instances",
        cgroup_placement(),
    ) else {
        return;
    };
    f.inst()
        .reconcile(&[spec("j10", 0, wrapped_worker(), "0", 1)])
        .expect("reconcile");
    let lodgers = f.lodgers();
    f.poll_until("the wrapped worker to run", |s| {
        running_with_reports(&s[0], 1) && procs_of(&format!("{lodgers}/j10-0")).len() == 2
    });
    let procs = procs_of(&format!("{lodgers}/j10-0"));
    assert!(cgroup_dir(&lodgers).is_dir());
    drop(f.inst.take());
    for pid in &procs {
        assert!(!alive(*pid), "{pid} survived its supervisor");
    }
    assert!(!cgroup_dir(&lodgers).exists());
}

/// An instance gets its arguments as written, `$` included: a transient unit's `ExecStart`
/// would otherwise substitute the unit's environment into them (a word `$HOME`) and read `$$`
/// as `$` (the VM suite, where systemd is PID 1, runs this on units; here, forked).
#[test]
fn dollars_in_an_instances_arguments_reach_it_as_written() {
    let name = "dollars_in_an_instances_arguments_reach_it_as_written";
    let Some(mut f) = Fixture::new(name, cgroup_placement()) else {
        return;
    };
    let out = f.logs.path().join("argv.txt");
    let script = format!(
        "printf '%s|%s' \"$1\" \"$2\" > '{}'; exec sleep 300",
        out.display()
    );
    let argv = strings(&["/bin/sh", "-c", &script, "sh", "$HOME", "a$$b"]);
    f.inst()
        .reconcile(&[spec("j13", 0, argv, "0", 1)])
        .expect("reconcile");
    f.poll_until("the instance to write its arguments", |_| {
        std::fs::read_to_string(&out).is_ok_and(|t| t.contains('|'))
    });
    assert_eq!(
        std::fs::read_to_string(&out).expect("argv.txt"),
        "$HOME|a$$b"
    );
}

/// A panic on the supervisor's thread (a bug in lodgerd) is a crash, not a stop: unwinding drops
/// the supervisor, and its instances run on for the next lodgerd to adopt, as after a kill.
#[test]
fn a_panic_on_the_supervisors_thread_leaves_its_instances_running() {
    let name = "a_panic_on_the_supervisors_thread_leaves_its_instances_running";
    let Some(mut f) = Fixture::new(name, cgroup_placement()) else {
        return;
    };
    let wanted = spec("j12", 0, worker(&[]), "0", 1);
    f.inst()
        .reconcile(std::slice::from_ref(&wanted))
        .expect("reconcile");
    let stats = f.poll_until("the instance to report", |s| running_with_reports(&s[0], 1));
    let pid = pid_of(&stats, "j12", 0);
    let inst = f.inst.take().expect("instances");
    let crashed = std::thread::spawn(move || {
        let _owned = inst;
        panic!("a bug in lodgerd (this test's own panic)");
    });
    assert!(crashed.join().is_err(), "the thread panicked");
    assert!(
        alive(pid),
        "instance {pid} died with its supervisor's panic"
    );
    // The next supervisor, wanting nothing, sweeps it.
    let mut next = Instances::new(f.settings(cgroup_placement())).expect("Instances");
    let out = next.adopt(&[]).expect("adopt");
    assert!(out.killed.contains(&pid), "{out:?}");
    f.inst = Some(next);
}

/// After a restart the leftovers go first: an adopted instance is set on its CPUs again only
/// once every leftover killed is gone, not while one may still run there (two holders on an
/// online core). Seen with the leftover frozen (the cgroup v1 freezer: a SIGKILL waits for the
/// thaw): while its SIGKILL is pending, the adopted instance is still where it was left.
#[test]
fn adoption_places_the_adopted_only_once_the_leftovers_are_gone() {
    let name = "adoption_places_the_adopted_only_once_the_leftovers_are_gone";
    let freezer = Path::new("/sys/fs/cgroup/freezer");
    let Some(f) = Fixture::new(name, InstancePlacement::Affinity) else {
        return;
    };
    if !freezer.join("cgroup.procs").is_file()
        && lodger::privileged::host_cgroup() == lodger::privileged::HostCgroup::V2
    {
        // The v2 freezer lets a fatal signal through: a killed leftover cannot be held there.
        lodger::privileged::not_applicable(
            name,
            "needs the cgroup v1 freezer to hold a killed leftover (the v2 freezer lets SIGKILL through)",
        );
        return;
    }
    if !freezer.join("cgroup.procs").is_file() {
        assert!(
            std::env::var_os("LODGER_REQUIRE_PRIVILEGED").is_none(),
            "{name}: no cgroup v1 freezer"
        );
        eprintln!("{name}: skipped (no cgroup v1 freezer)");
        return;
    }
    let old = spec("j14", 0, worker(&[]), "1", 1);
    let s = f.settings(InstancePlacement::Affinity);
    let first = old.clone();
    let (kept, left) = std::thread::spawn(move || {
        let mut inst = Instances::new(s).expect("Instances");
        inst.reconcile(&[first, spec("j14", 1, worker(&[]), "0", 1)])
            .expect("reconcile");
        let stats = inst.stats();
        let pids = (pid_of(&stats, "j14", 0), pid_of(&stats, "j14", 1));
        // Gone without stopping anything, as a killed lodgerd.
        std::mem::forget(inst);
        pids
    })
    .join()
    .expect("thread");
    assert_eq!(cpus_allowed(kept, kept).as_deref(), Some("1"));
    let frozen = Frozen::new(&freezer.join(unique("lodger-it-freeze")), left);
    // The next lodgerd wants j14-0 on CPU 0, where the leftover j14-1 runs.
    let wanted = InstanceSpec {
        cpus: set("0"),
        ..old
    };
    let mut next = Instances::new(f.settings(InstancePlacement::Affinity)).expect("Instances");
    let adopting = std::thread::spawn(move || {
        let out = next.adopt(&[wanted]);
        (next, out)
    });
    wait_until(WAIT, "the leftover's SIGKILL", || sigkill_pending(left));
    assert_eq!(
        cpus_allowed(kept, kept).as_deref(),
        Some("1"),
        "adopted onto CPU 0 while the killed leftover {left} still ran there"
    );
    drop(frozen);
    let (mut next, out) = adopting.join().expect("adopt thread");
    let out = out.expect("adopt");
    assert_eq!(out.adopted.len(), 1, "{out:?}");
    assert_eq!(out.adopted[0].1, kept);
    assert_eq!(out.killed, vec![left]);
    assert!(!alive(left));
    assert_eq!(cpus_allowed(kept, kept).as_deref(), Some("0"));
    next.stop_all();
    assert!(!alive(kept));
    drop(f);
}

/// Whether a SIGKILL is pending for `pid` (sent, not yet acted on).
fn sigkill_pending(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status.lines().any(|l| {
        let mask = l
            .strip_prefix("SigPnd:")
            .or_else(|| l.strip_prefix("ShdPnd:"));
        mask.and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|m| m & (1 << (libc::SIGKILL - 1)) != 0)
    })
}

/// A cgroup v1 freezer group holding one of the test's processes, frozen; thawed and removed
/// when dropped, even when the test fails.
struct Frozen {
    dir: PathBuf,
}

impl Frozen {
    fn new(dir: &Path, pid: u32) -> Frozen {
        std::fs::create_dir(dir).expect("freezer group");
        let frozen = Frozen {
            dir: dir.to_path_buf(),
        };
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).expect("into the freezer");
        std::fs::write(dir.join("freezer.state"), "FROZEN").expect("freeze");
        wait_until(WAIT, "the leftover to freeze", || {
            std::fs::read_to_string(dir.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
        });
        frozen
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
        let root = self.dir.parent().map(|p| p.join("cgroup.procs"));
        if let (Ok(procs), Some(root)) =
            (std::fs::read_to_string(self.dir.join("cgroup.procs")), root)
        {
            for pid in procs.split_whitespace() {
                let _ = std::fs::write(&root, pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
