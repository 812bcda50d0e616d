//! Instances started, reporting, restarted with back-off, changed, stopped; an online one waiting
//! for a stopping one to leave its CPUs.

use super::*;

#[test]
fn instances_run_on_their_cpus_with_their_threads_and_report() {
    let Some(mut f) = Fixture::new(
        "instances_run_on_their_cpus_with_their_threads_and_report",
        cgroup_placement(),
    ) else {
        return;
    };
    assert_eq!(f.inst().placement(), cgroup_pin());
    let desired = [
        spec("j1", 0, worker(&[]), "0", 1),
        spec("j1", 1, worker(&[]), "1", 2),
    ];
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.started.len(), 2);
    let stats = f.poll_until("both instances to report", |s| {
        s.len() == 2 && s.iter().all(|i| running_with_reports(i, 3))
    });

    for (index, cpus, threads) in [(0, "0", 1u32), (1, "1", 2)] {
        let st = stat_of(&stats, "j1", index);
        let pid = pid_of(&stats, "j1", index);
        if instances_are_units() {
            assert_eq!(st.cgroup, None);
            assert_own_cgroup(&mut f, pid, &format!("j1-{index}"));
        } else {
            let cg = format!("{}/j1-{index}", f.lodgers());
            assert_eq!(st.cgroup.as_deref(), Some(cg.as_str()));
            assert_eq!(cpuset_cgroup_of(pid).as_deref(), Some(cg.as_str()));
            assert_eq!(procs_of(&cg), vec![pid]);
            let cg_cpus =
                std::fs::read_to_string(cgroup_dir(&cg).join("cpuset.cpus")).expect("cpuset.cpus");
            assert_eq!(cg_cpus.trim(), cpus);
        }
        // The worker sized its pool from lodger's environment: one thread per planned thread.
        let t = tids(pid);
        assert_eq!(t.len(), threads as usize, "threads of {pid}");
        for tid in &t {
            assert_eq!(cpus_allowed(pid, *tid).as_deref(), Some(cpus), "tid {tid}");
        }
        assert!(all_other(pid), "instances run SCHED_OTHER");
        let want = threads.to_string();
        for var in [
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "OPENBLAS_NUM_THREADS",
            "LODGER_THREADS",
        ] {
            assert_eq!(
                environ_var(pid, var).as_deref(),
                Some(want.as_str()),
                "{var}"
            );
        }
        assert_eq!(environ_var(pid, "LODGER_BATCH").as_deref(), Some("2"));
        assert_eq!(
            environ_var(pid, "LODGER_INSTANCE").as_deref(),
            Some(index.to_string().as_str())
        );
        assert_eq!(environ_var(pid, "LODGER_CPUS").as_deref(), Some(cpus));
        assert_eq!(environ_var(pid, "LODGER_REPORT_FD").as_deref(), Some("3"));
        // Reports were read and turned into rates and percentiles.
        assert!(st.items_per_s > 0.0, "{st:#?}");
        assert!(st.latency_p50_ms.is_some() && st.latency_p99_ms.is_some());
        assert!(st.queue_p99_ms.is_some());
        assert_eq!(st.bad_reports, 0);
        assert_eq!(st.restarts, 0);
    }
    // The job's latency pools both instances' batches (each had at least 3 when polled).
    let pooled = f.inst().pooled_latency(&job("j1")).expect("pooled latency");
    assert!(pooled.batches >= 6, "{pooled:?}");
    assert!(pooled.p50_ms <= pooled.p99_ms, "{pooled:?}");
    assert_eq!(f.inst().pooled_latency(&job("j2")), None);
    // The same plan again changes nothing.
    let again = f.inst().reconcile(&desired).expect("reconcile");
    assert!(!again.changed, "{again:?}");
}

#[test]
fn a_killed_instance_restarts_with_backoff() {
    let Some(mut f) = Fixture::new(
        "a_killed_instance_restarts_with_backoff",
        cgroup_placement(),
    ) else {
        return;
    };
    f.inst()
        .reconcile(&[spec("j3", 0, worker(&[]), "1", 1)])
        .expect("reconcile");
    let stats = f.poll_until("the instance to report", |s| running_with_reports(&s[0], 1));
    let first = pid_of(&stats, "j3", 0);

    let mut previous = first;
    for (round, backoff_ms) in [(1u32, 300u64), (2, 600)] {
        // Where systemd is PID 1, the transient unit it runs in.
        let unit = f.inst().stats()[0].unit.clone();
        kill(
            Pid::from_raw(i32::try_from(previous).expect("pid")),
            Signal::SIGKILL,
        )
        .expect("kill");
        let seen = f.poll_until("the exit to be noticed", |s| s[0].failures == round);
        let exited_at = Instant::now();
        let st = &seen[0];
        assert!(
            matches!(st.state, InstanceState::BackingOff { .. }),
            "{st:#?}"
        );
        assert_eq!(st.backoff, Duration::from_millis(backoff_ms), "{st:#?}");
        match &unit {
            // Not lodgerd's child: how it ended is systemd's to tell.
            Some(unit) => assert_eq!(
                st.last_exit.as_deref(),
                Some(format!("exited (unit {unit}; how: journalctl -u {unit})").as_str())
            ),
            None => assert_eq!(st.last_exit.as_deref(), Some("killed by SIGKILL")),
        }
        assert_eq!(st.pid, None);
        let back = f.poll_until("the restart", |s| {
            s[0].restarts == round && s[0].state == InstanceState::Running
        });
        // Not before its back-off (the exit was seen within one poll of it happening).
        assert!(
            exited_at.elapsed() + Duration::from_millis(50) >= Duration::from_millis(backoff_ms),
            "restarted after {:?}, back-off {backoff_ms} ms",
            exited_at.elapsed()
        );
        let pid = pid_of(&back, "j3", 0);
        assert_ne!(pid, previous);
        assert_own_cgroup(&mut f, pid, "j3-0");
        assert_eq!(cpus_allowed(pid, pid).as_deref(), Some("1"));
        previous = pid;
    }
    let st = f.poll_until("reports from the restarted instance", |s| reporting(&s[0]));
    assert_eq!(st[0].pid, Some(previous));
    assert!(!alive(first));
}

#[test]
fn a_changed_spec_restarts_only_that_instance() {
    let Some(mut f) = Fixture::new(
        "a_changed_spec_restarts_only_that_instance",
        cgroup_placement(),
    ) else {
        return;
    };
    let pinned = |cpus: &str| {
        // `{cpus}` in the template: the program may pin threads itself, so a CPU change restarts.
        let mut argv = strings(&["/usr/bin/env", "PINNED={cpus}"]);
        argv.extend(worker(&[]));
        spec("j5", 0, argv, cpus, 1)
    };
    let mut desired = vec![
        spec("j4", 0, worker(&[]), "0", 1),
        spec("j4", 1, worker(&[]), "1", 1),
        pinned("0"),
    ];
    f.inst().reconcile(&desired).expect("reconcile");
    let stats = f.poll_until("three running instances", |s| {
        s.len() == 3 && s.iter().all(|i| running_with_reports(i, 1))
    });
    let (p0, p1, p5) = (
        pid_of(&stats, "j4", 0),
        pid_of(&stats, "j4", 1),
        pid_of(&stats, "j5", 0),
    );

    // A new batch size: that instance restarts, after the old process is gone.
    desired[1].batch = 4;
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(
        out.restarting
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>(),
        vec!["j4-1"]
    );
    assert!(out.started.is_empty() && out.moved.is_empty());
    // Until its environment reads: a unit's main process is a shell until it execs the worker,
    // and /proc/PID/environ reads empty during the exec.
    let stats = f.poll_until("j4-1 to restart", |s| {
        let i = stat_of(s, "j4", 1);
        i.state == InstanceState::Running
            && i.pid
                .is_some_and(|p| p != p1 && environ_var(p, "LODGER_BATCH").is_some())
    });
    let new1 = pid_of(&stats, "j4", 1);
    assert_eq!(environ_var(new1, "LODGER_BATCH").as_deref(), Some("4"));
    assert_eq!(stat_of(&stats, "j4", 1).restarts, 0, "not a crash restart");
    assert_eq!(pid_of(&stats, "j4", 0), p0, "j4-0 untouched");
    assert_eq!(pid_of(&stats, "j5", 0), p5, "j5-0 untouched");
    assert!(!alive(p1));

    // CPUs alone: moved in place, same process.
    desired[0].cpus = set("1");
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(
        out.moved.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
        vec!["j4-0"]
    );
    assert!(out.restarting.is_empty());
    let stats = f.inst().stats();
    assert_eq!(pid_of(&stats, "j4", 0), p0);
    assert_eq!(cpus_allowed(p0, p0).as_deref(), Some("1"));
    if !instances_are_units() {
        let cg = format!("{}/j4-0", f.lodgers());
        let cg_cpus = std::fs::read_to_string(cgroup_dir(&cg).join("cpuset.cpus")).expect("cpus");
        assert_eq!(cg_cpus.trim(), "1");
    }

    // CPUs of a template that takes {cpus}: restarted.
    desired[2] = pinned("1");
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(
        out.restarting
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>(),
        vec!["j5-0"]
    );
    // Reports: `env` has exec'd the worker.
    let stats = f.poll_until("j5-0 to restart and report", |s| {
        let i = stat_of(s, "j5", 0);
        reporting(i) && i.pid.is_some_and(|p| p != p5)
    });
    let new5 = pid_of(&stats, "j5", 0);
    assert_eq!(environ_var(new5, "PINNED").as_deref(), Some("1"));
    assert_eq!(cpus_allowed(new5, new5).as_deref(), Some("1"));
    assert_eq!(pid_of(&stats, "j4", 0), p0);
    assert_eq!(pid_of(&stats, "j4", 1), new1);

    // Nothing new: nothing done.
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert!(!out.changed, "{out:?}");

    // Dropping one instance from the plan stops it (and its cgroup, there until now); the
    // others stay.
    let j4_1 = format!("{}/j4-1", f.lodgers());
    assert_own_cgroup(&mut f, new1, "j4-1");
    assert_eq!(cgroup_dir(&j4_1).is_dir(), !instances_are_units());
    desired.remove(1);
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(out.stopping.len(), 1);
    let stats = f.poll_until("j4-1 to be gone", |s| s.len() == 2);
    assert_eq!(pid_of(&stats, "j4", 0), p0);
    assert!(!alive(new1));
    assert!(!cgroup_dir(&format!("{}/j4-1", f.lodgers())).exists());
}

#[test]
fn stop_leaves_no_process_and_no_cgroup() {
    if !cgroups_of_lodgers_own("stop_leaves_no_process_and_no_cgroup") {
        return;
    }
    let Some(mut f) = Fixture::new("stop_leaves_no_process_and_no_cgroup", cgroup_placement())
    else {
        return;
    };
    let mut s = f.settings(cgroup_placement());
    s.stop_grace = Duration::from_millis(700);
    f.inst = Some(Instances::new(s).expect("Instances"));
    // j6-1 ignores SIGTERM (and so does its child): only SIGKILL ends it.
    let stubborn = strings(&["/bin/sh", "-c", "trap '' TERM; sleep 300 & wait"]);
    f.inst()
        .reconcile(&[
            spec("j6", 0, worker(&[]), "0", 1),
            spec("j6", 1, stubborn, "1", 1),
            spec("j7", 0, wrapped_worker(), "1", 1),
        ])
        .expect("reconcile");
    let lodgers = f.lodgers();
    let stats = f.poll_until("all running, with the children started", |s| {
        s.len() == 3
            && running_with_reports(stat_of(s, "j6", 0), 1)
            && running_with_reports(stat_of(s, "j7", 0), 1)
            && procs_of(&format!("{lodgers}/j6-1")).len() == 2
    });
    let j6: Vec<u32> = procs_of(&format!("{lodgers}/j6-0"))
        .into_iter()
        .chain(procs_of(&format!("{lodgers}/j6-1")))
        .collect();
    let j7 = procs_of(&format!("{lodgers}/j7-0"));
    assert_eq!(j6.len(), 3, "{j6:?}");
    assert_eq!(j7.len(), 2, "sh and its worker: {j7:?}");
    // The cgroups checked gone below exist now.
    for cg in ["j6-0", "j6-1", "j7-0"] {
        let dir = cgroup_dir(&format!("{lodgers}/{cg}"));
        assert!(dir.is_dir(), "{} does not exist", dir.display());
    }

    // One job: SIGTERM, and SIGKILL for the one that ignores it.
    let t0 = Instant::now();
    let out = f.inst().stop_job(&job("j6"));
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.stopped.len(), 2, "{out:?}");
    assert_eq!(
        out.killed.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
        vec!["j6-1"]
    );
    assert!(t0.elapsed() >= Duration::from_millis(700));
    for pid in &j6 {
        assert!(!alive(*pid), "pid {pid} of j6 survived");
    }
    assert!(!cgroup_dir(&format!("{lodgers}/j6-0")).exists());
    assert!(!cgroup_dir(&format!("{lodgers}/j6-1")).exists());
    let stats_after = f.inst().stats();
    assert_eq!(stats_after.len(), 1);
    assert_eq!(pid_of(&stats_after, "j7", 0), pid_of(&stats, "j7", 0));

    // Everything: the wrapper's child goes too, and so do lodger's cgroups.
    let out = f.inst().stop_all();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert!(
        out.killed.is_empty(),
        "the worker stops on SIGTERM: {out:?}"
    );
    for pid in &j7 {
        assert!(!alive(*pid), "pid {pid} of j7 survived");
    }
    assert!(f.inst().stats().is_empty());
    assert!(!cgroup_dir(&lodgers).exists(), "{lodgers} left behind");
    assert!(
        !cgroup_dir(&f.parent).exists(),
        "the parent lodger created is removed"
    );
}

/// Online cores are exclusive (Cloud Reamer §III-A), also while an instance stops: an online
/// instance does not start on a CPU where a stopping one still runs (for up to `stop_grace`,
/// then SIGKILL), neither another job's new instance nor a re-layout's restart; an offline one
/// starts at once. The stopping instances here ignore SIGTERM, so they hold their CPU for the
/// whole grace period.
#[test]
fn an_online_instance_waits_for_a_stopping_instance_to_leave_its_cpus() {
    const TEST: &str = "an_online_instance_waits_for_a_stopping_instance_to_leave_its_cpus";
    let Some(mut f) = Fixture::new(TEST, InstancePlacement::Affinity) else {
        return;
    };
    let mut s = f.settings(InstancePlacement::Affinity);
    s.stop_grace = Duration::from_millis(700);
    f.inst = Some(Instances::new(s).expect("Instances"));
    let stubborn = || strings(&["/bin/sh", "-c", "trap '' TERM; sleep 300 & wait"]);
    let up = |s: &InstanceStats| s.state == InstanceState::Running && s.pid.is_some();
    // The shell ignores SIGTERM once it has started its child, not before.
    let trapped = |s: &[InstanceStats], j: &str, i: u32| {
        s.iter()
            .find(|x| x.job == job(j) && x.index == i)
            .and_then(|x| x.pid)
            .is_some_and(|p| !children(p).is_empty())
    };
    let find = |s: &[InstanceStats], j: &str, i: u32| {
        s.iter().find(|x| x.job == job(j) && x.index == i).cloned()
    };
    // Polls until `key` runs; fails if it was started while `holder` was still listed, and
    // says whether it was seen waiting.
    let start_after = |f: &mut Fixture, key: (&str, u32), holder: (&str, u32)| {
        let mut waited = false;
        let deadline = Instant::now() + WAIT;
        loop {
            let out = f.inst().poll();
            assert!(out.errors.is_empty(), "poll errors: {:?}", out.errors);
            let stats = f.inst().stats();
            let it = find(&stats, key.0, key.1).expect("still wanted");
            waited |= it.state == InstanceState::Waiting;
            if find(&stats, holder.0, holder.1).is_some() {
                assert_ne!(
                    it.state,
                    InstanceState::Running,
                    "started beside a stopping instance: {stats:#?}"
                );
            } else if up(&it) {
                return waited;
            }
            assert!(
                Instant::now() < deadline,
                "{key:?} never started: {stats:#?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    f.inst()
        .reconcile(&[
            spec("j10", 0, stubborn(), "0", 1),
            spec("j10", 1, worker(&[]), "1", 1),
        ])
        .expect("reconcile");
    f.poll_until("both running, j10-0 ignoring SIGTERM", |s| {
        s.len() == 2 && s.iter().all(up) && trapped(s, "j10", 0)
    });

    // Another job's online instance, and an offline one, on j10-0's CPU as it stops.
    let mut offline = spec("j12", 0, worker(&[]), "0", 1);
    offline.offline = true;
    let mut desired = vec![
        spec("j10", 1, worker(&[]), "1", 1),
        spec("j11", 0, stubborn(), "0", 1),
        offline,
    ];
    let out = f.inst().reconcile(&desired).expect("reconcile");
    let keys = |k: &[lodger::enforce::instances::InstanceKey]| {
        k.iter().map(|k| k.to_string()).collect::<Vec<_>>()
    };
    assert_eq!(keys(&out.stopping), ["j10-0"], "{out:?}");
    assert_eq!(keys(&out.waiting), ["j11-0"], "{out:?}");
    assert_eq!(keys(&out.started), ["j12-0"], "{out:?}");
    assert!(start_after(&mut f, ("j11", 0), ("j10", 0)));
    f.poll_until("j11-0 ignoring SIGTERM", |s| trapped(s, "j11", 0));

    // A re-layout: j11-0 goes (it ignores SIGTERM too), j10-1 restarts with two threads on
    // both CPUs once its old process is gone, and then waits for j11-0.
    desired[0] = spec("j10", 1, worker(&[]), "0-1", 2);
    desired.remove(1);
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(keys(&out.stopping), ["j11-0"], "{out:?}");
    assert_eq!(keys(&out.restarting), ["j10-1"], "{out:?}");
    assert!(start_after(&mut f, ("j10", 1), ("j11", 0)));
    let stats = f.inst().stats();
    assert_eq!(find(&stats, "j10", 1).map(|s| s.threads), Some(2));
}

/// The same for an online instance moved in place (its CPUs changed alone, so the supervisor
/// re-pins it rather than restarting it): onto a CPU a stopping instance still runs on, it waits
/// (state "moving"), serving on its old CPU, and moves once that instance is gone: the same
/// process, never beside it. A new instance on the CPU it leaves waits for the move, an offline
/// one too (the supervisor does not check the plan: one online and one offline instance on the
/// same CPU here stand for two such starts).
#[test]
fn an_online_instance_moved_in_place_waits_for_a_stopping_instance_to_leave_its_cpus() {
    const TEST: &str =
        "an_online_instance_moved_in_place_waits_for_a_stopping_instance_to_leave_its_cpus";
    let Some(mut f) = Fixture::new(TEST, InstancePlacement::Affinity) else {
        return;
    };
    let mut s = f.settings(InstancePlacement::Affinity);
    s.stop_grace = Duration::from_millis(700);
    f.inst = Some(Instances::new(s).expect("Instances"));
    let stubborn = strings(&["/bin/sh", "-c", "trap '' TERM; sleep 300 & wait"]);
    let find = |s: &[InstanceStats], j: &str, i: u32| {
        s.iter().find(|x| x.job == job(j) && x.index == i).cloned()
    };
    f.inst()
        .reconcile(&[
            spec("j10", 0, stubborn, "0", 1),
            spec("j10", 1, worker(&[]), "1", 1),
        ])
        .expect("reconcile");
    // The shell ignores SIGTERM once it has started its child, not before.
    let stats = f.poll_until("both running, j10-0 ignoring SIGTERM", |s| {
        s.len() == 2
            && s.iter().all(|x| x.state == InstanceState::Running)
            && s[0].pid.is_some_and(|p| !children(p).is_empty())
    });
    let pid = pid_of(&stats, "j10", 1);
    // Every thread of the moved instance is allowed exactly `cpus`.
    let on = |cpus: &str| {
        let t = tids(pid);
        !t.is_empty()
            && t.iter()
                .all(|&tid| cpus_allowed(pid, tid).as_deref() == Some(cpus))
    };
    assert!(on("1"));

    // A re-layout: j10-0 goes, j10-1 moves to its CPU, other jobs' instances take CPU 1.
    let mut offline = spec("j12", 0, worker(&[]), "1", 1);
    offline.offline = true;
    let desired = [
        spec("j10", 1, worker(&[]), "0", 1),
        spec("j11", 0, worker(&[]), "1", 1),
        offline,
    ];
    let out = f.inst().reconcile(&desired).expect("reconcile");
    let keys = |k: &[lodger::enforce::instances::InstanceKey]| {
        k.iter().map(|k| k.to_string()).collect::<Vec<_>>()
    };
    assert_eq!(keys(&out.stopping), ["j10-0"], "{out:?}");
    assert_eq!(keys(&out.waiting), ["j10-1", "j11-0", "j12-0"], "{out:?}");
    assert!(out.moved.is_empty() && out.started.is_empty(), "{out:?}");
    let mut moved = Vec::new();
    let deadline = Instant::now() + WAIT;
    loop {
        let out = f.inst().poll();
        assert!(out.errors.is_empty(), "poll errors: {:?}", out.errors);
        moved.extend(keys(&out.moved));
        let stats = f.inst().stats();
        let mover = find(&stats, "j10", 1).expect("still wanted");
        let new = find(&stats, "j11", 0).expect("still wanted");
        let offline = find(&stats, "j12", 0).expect("still wanted");
        assert_eq!(mover.pid, Some(pid), "moved, not restarted: {stats:#?}");
        if find(&stats, "j10", 0).is_some() {
            assert_eq!(mover.state, InstanceState::Moving, "{stats:#?}");
            assert_eq!(mover.cpus, set("1"), "shown where it runs: {stats:#?}");
            assert!(on("1"), "moved beside a stopping instance: {stats:#?}");
            assert_eq!(new.state, InstanceState::Waiting, "{stats:#?}");
            assert_eq!(offline.state, InstanceState::Waiting, "{stats:#?}");
        } else if mover.state == InstanceState::Running
            && new.pid.is_some()
            && offline.pid.is_some()
        {
            break;
        }
        assert!(Instant::now() < deadline, "never moved: {stats:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(moved, ["j10-1"]);
    assert!(on("0"));
    let stats = f.inst().stats();
    assert_eq!(
        find(&stats, "j10", 1).map(|s| (s.cpus, s.restarts)),
        Some((set("0"), 0))
    );
    assert_eq!(find(&stats, "j11", 0).map(|s| s.cpus), Some(set("1")));
}

/// A process of the instance left on the old CPUs by a move by affinity (as one is whose fork
/// began before its parent moved and ended after the move's last pass) is moved by the poll
/// that follows. Made here by putting the instance's child back on the old CPU after the move.
#[test]
fn a_process_a_move_by_affinity_left_behind_is_moved_at_the_next_poll() {
    const TEST: &str = "a_process_a_move_by_affinity_left_behind_is_moved_at_the_next_poll";
    let Some(mut f) = Fixture::new(TEST, InstancePlacement::Affinity) else {
        return;
    };
    let parent = strings(&["/bin/sh", "-c", "sleep 1000 & wait"]);
    let mut desired = [spec("j15", 0, parent, "0", 1)];
    f.inst().reconcile(&desired).expect("reconcile");
    let stats = f.poll_until("the shell running", |s| s[0].pid.is_some());
    let sh = pid_of(&stats, "j15", 0);
    let mut child = None;
    wait_until(WAIT, "the shell's child", || {
        child = children(sh).first().copied();
        child.is_some()
    });
    let child = child.expect("child");
    desired[0].cpus = set("1");
    let out = f.inst().reconcile(&desired).expect("reconcile");
    assert_eq!(out.moved.len(), 1, "{out:?}");
    assert_eq!(cpus_allowed(child, child).as_deref(), Some("1"));
    let mut old = nix::sched::CpuSet::new();
    old.set(0).expect("cpu 0");
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(child as i32), &old)
        .expect("the child back on CPU 0");
    assert_eq!(cpus_allowed(child, child).as_deref(), Some("0"));
    let polled = f.inst().poll();
    assert!(polled.errors.is_empty(), "{:?}", polled.errors);
    assert_eq!(
        cpus_allowed(child, child).as_deref(),
        Some("1"),
        "the poll after the move left the child on CPU 0"
    );
}

/// A move by CPU affinity reaches every process of the instance, also one forked while the move
/// is made: it inherits the CPUs of its parent, which may not have been moved yet when the
/// instance's processes were listed, and one whose fork began before its parent moved and ended
/// after the move's last pass is found by the walks at the polls that follow. The instance here
/// forks all the time.
#[test]
fn a_move_by_affinity_reaches_processes_forked_while_it_is_made() {
    const TEST: &str = "a_move_by_affinity_reaches_processes_forked_while_it_is_made";
    let Some(mut f) = Fixture::new(TEST, InstancePlacement::Affinity) else {
        return;
    };
    let forker = strings(&["/bin/sh", "-c", "while :; do sleep 0.5 & done"]);
    let mut desired = [spec("j14", 0, forker, "0", 1)];
    f.inst().reconcile(&desired).expect("reconcile");
    let stats = f.poll_until("the forker running", |s| s[0].pid.is_some());
    let sh = pid_of(&stats, "j14", 0);
    // The shell and every process it started that has not exited (a zombie runs nowhere), with
    // the CPUs each may run on.
    let zombie = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| {
            s.lines()
                .any(|l| l.starts_with("State:") && l.contains('Z'))
        })
    };
    let tree = || {
        let mut all = vec![sh];
        let mut i = 0;
        while i < all.len() {
            all.extend(children(all[i]));
            i += 1;
        }
        all.into_iter()
            .filter(|&p| !zombie(p))
            .filter_map(|p| Some((p, cpus_allowed(p, p)?)))
            .collect::<Vec<_>>()
    };
    for round in 0..20 {
        let cpus = if round % 2 == 0 { "1" } else { "0" };
        desired[0].cpus = set(cpus);
        let out = f.inst().reconcile(&desired).expect("reconcile");
        assert!(out.errors.is_empty(), "{out:?}");
        assert_eq!(out.moved.len(), 1, "round {round}: {out:?}");
        let mut first = true;
        f.poll_until(
            &format!("round {round}: every process of the instance on {cpus}"),
            |_| {
                let astray: Vec<(u32, String)> =
                    tree().into_iter().filter(|(_, c)| c != cpus).collect();
                if !astray.is_empty() {
                    eprintln!(
                        "round {round}: left off {cpus} ({}): {astray:?}",
                        if first {
                            "after the move"
                        } else {
                            "after a poll"
                        }
                    );
                }
                first = false;
                astray.is_empty()
            },
        );
    }
    assert_eq!(pid_of(&f.inst().stats(), "j14", 0), sh);
}
