//! Inference instances for real, as root on this machine's cpuset hierarchy (v1 or v2): the bundled
//! inference worker (and the Python client of docs/) started by `enforce::instances`, checked from
//! /proc and cgroupfs. Each test has its own parent cgroup.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use lodger::cpuset::CpuSet;
use lodger::enforce::instances::{
    Identity, InstanceError, InstanceOutput, InstancePlacement, InstanceSettings, InstanceSpec,
    InstanceState, InstanceStats, Instances, TemplateProblem,
};
use lodger::enforce::PinMethod;
use lodger::job::JobId;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn job(id: &str) -> JobId {
    JobId::parse(id).expect("job id")
}

fn set(list: &str) -> CpuSet {
    CpuSet::parse(list).expect("cpulist")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// The worker, online at a low rate with a small model: real work, little CPU. Threads and batch
/// come from lodger's environment.
fn worker(extra: &[&str]) -> Vec<String> {
    let mut argv = vec![
        example("infer_worker").to_string_lossy().into_owned(),
        "--mode".into(),
        "online".into(),
        "--rate".into(),
        "40".into(),
        "--model-mib".into(),
        "1".into(),
        "--quiet".into(),
    ];
    argv.extend(strings(extra));
    argv
}

/// `worker(&[])` as one line for `sh -c`, each argument quoted.
fn worker_line() -> String {
    worker(&[])
        .iter()
        .map(|a| format!("'{a}'"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `sh -c '<worker> & wait'`: an instance whose real work runs in a child of the instance.
fn wrapped_worker() -> Vec<String> {
    strings(&["/bin/sh", "-c", &format!("{} & wait", worker_line())])
}

fn spec(job_id: &str, index: u32, argv: Vec<String>, cpus: &str, threads: u32) -> InstanceSpec {
    InstanceSpec {
        job: job(job_id),
        index,
        argv,
        cpus: set(cpus),
        mems: CpuSet::new(),
        threads,
        batch: 2,
        offline: false,
        // The test's own uid: no change of user, as for root's own jobs.
        identity: Identity {
            uid: nix::unistd::getuid().as_raw(),
            ..Identity::default()
        },
        memory_max: None,
    }
}

fn settings(parent: &str, logs: &Path, placement: InstancePlacement) -> InstanceSettings {
    InstanceSettings {
        parent: parent.to_string(),
        placement,
        stop_grace: Duration::from_secs(3),
        backoff_initial: Duration::from_millis(300),
        backoff_max: Duration::from_secs(5),
        stable_after: Duration::from_secs(60),
        window: Duration::from_secs(5),
        output: InstanceOutput::Directory(logs.to_path_buf()),
        ..InstanceSettings::default()
    }
}

/// A cgroup's directory in this host's cpuset hierarchy (v1: /sys/fs/cgroup/cpuset, v2:
/// /sys/fs/cgroup), as lodger finds it.
fn cgroup_dir(cgroup: &str) -> PathBuf {
    cgroup_path(cgroup)
}

/// The placement that puts instances in cgroups on this host: `auto` on cgroup v1 (which picks
/// cgroups there), `cgroup` on v2 (where `auto` picks affinity unless cpuset is delegated to the
/// test's parent, which does not exist yet).
fn cgroup_placement() -> InstancePlacement {
    match host_cgroup() {
        HostCgroup::V2 if !instances_are_units() => InstancePlacement::Cgroup,
        _ => InstancePlacement::Auto,
    }
}

/// The placement [`cgroup_placement`] gets: affinity where every instance is a transient unit
/// of its own, pinned by affinity in a cgroup systemd makes, whatever was asked.
fn cgroup_pin() -> PinMethod {
    if instances_are_units() {
        PinMethod::Affinity
    } else {
        PinMethod::Cgroup
    }
}

/// A test of instance cgroups under lodger's own, which a host where systemd is PID 1 has not
/// (its instances are units: the VM suite and the daemon tests check those): not applicable
/// there, saying so.
fn cgroups_of_lodgers_own(test: &str) -> bool {
    if instances_are_units() {
        lodger::privileged::not_applicable(
            test,
            "systemd is PID 1: instances are its transient units, in cgroups systemd makes",
        );
        return false;
    }
    true
}

/// `pid`, instance `key` (`j3-0`), is in its own cgroup: `<lodgers>/<key>` with cgroup
/// placement; where systemd is PID 1, its transient unit's, in lodger's instances' slice.
fn assert_own_cgroup(f: &mut Fixture, pid: u32, key: &str) {
    let cg = cpuset_cgroup_of(pid);
    if instances_are_units() {
        let stats = f.inst().stats();
        let unit = stats
            .iter()
            .find(|s| s.pid == Some(pid))
            .and_then(|s| s.unit.clone())
            .expect("the instance's unit");
        let want = format!("-instances.slice/{unit}");
        assert!(cg.as_deref().is_some_and(|c| c.ends_with(&want)), "{cg:?}");
    } else {
        assert_eq!(cg, Some(format!("{}/{key}", f.lodgers())));
    }
}

/// A variable of a process's (initial) environment.
fn environ_var(pid: u32, name: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    env.split(|&b| b == 0).find_map(|var| {
        std::str::from_utf8(var)
            .ok()?
            .strip_prefix(&prefix)
            .map(str::to_string)
    })
}

fn procs_of(cgroup: &str) -> Vec<u32> {
    std::fs::read_to_string(cgroup_dir(cgroup).join("cgroup.procs"))
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

fn stat_of<'a>(stats: &'a [InstanceStats], job_id: &str, index: u32) -> &'a InstanceStats {
    stats
        .iter()
        .find(|s| s.job.as_str() == job_id && s.index == index)
        .unwrap_or_else(|| panic!("no instance {job_id}-{index} in {stats:#?}"))
}

fn pid_of(stats: &[InstanceStats], job_id: &str, index: u32) -> u32 {
    stat_of(stats, job_id, index)
        .pid
        .unwrap_or_else(|| panic!("{job_id}-{index} has no process: {stats:#?}"))
}

fn running_with_reports(s: &InstanceStats, reports: u64) -> bool {
    s.state == InstanceState::Running && s.pid.is_some() && s.reports_total >= reports
}

/// Running, and its current process has reported (the window starts afresh with each process;
/// the totals do not).
fn reporting(s: &InstanceStats) -> bool {
    s.state == InstanceState::Running && s.pid.is_some() && s.latency_p50_ms.is_some()
}

/// One test's supervisor, parent cgroup and log directory; cleans up even when the test fails.
struct Fixture {
    inst: Option<Instances>,
    parent: String,
    logs: tempfile::TempDir,
}

impl Fixture {
    fn new(test: &str, placement: InstancePlacement) -> Option<Fixture> {
        if !need_root(test) {
            return None;
        }
        // Instance cgroups under a parent of the test's own, directly under the root.
        if matches!(placement, InstancePlacement::Cgroup)
            && !lodger::privileged::need_v2_root_cpuset(test)
        {
            return None;
        }
        let parent = unique("lodger-it-inst");
        let logs = tempfile::tempdir().expect("tempdir");
        let inst = Instances::new(settings(&parent, logs.path(), placement)).expect("Instances");
        Some(Fixture {
            inst: Some(inst),
            parent,
            logs,
        })
    }

    fn settings(&self, placement: InstancePlacement) -> InstanceSettings {
        settings(&self.parent, self.logs.path(), placement)
    }

    fn inst(&mut self) -> &mut Instances {
        self.inst.as_mut().expect("instances")
    }

    /// Reconciles to `wanted` on a thread of its own, so that a reconcile that never returns
    /// fails the test (`holder`: what would hold it) instead of hanging it; then asserts the one
    /// instance backs off with an error containing `why`.
    fn start_backs_off(&mut self, wanted: InstanceSpec, holder: &str, why: &str) {
        let mut inst = self.inst.take().expect("instances");
        let (tx, rx) = mpsc::channel();
        let starter = std::thread::spawn(move || {
            let _ = inst.reconcile(&[wanted]);
            let _ = tx.send(());
            inst
        });
        assert!(
            rx.recv_timeout(WAIT).is_ok(),
            "reconcile did not return within {WAIT:?}: {holder} holds it"
        );
        self.inst = Some(starter.join().expect("starter"));
        let stats = self.inst().stats();
        let error = stats[0].last_error.as_deref().unwrap_or("");
        assert!(
            matches!(stats[0].state, InstanceState::BackingOff { .. }) && error.contains(why),
            "{:#?}",
            stats[0]
        );
    }

    /// The instances' own output, for failure messages.
    fn logs(&self) -> String {
        let mut out = String::new();
        if let Ok(dir) = std::fs::read_dir(self.logs.path()) {
            for entry in dir.flatten() {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                out.push_str(&format!("--- {} ---\n", entry.path().display()));
                for l in tail.into_iter().rev() {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
        out
    }

    /// Polls until `cond` holds on the stats; fails with the stats and the instances' logs.
    fn poll_until(
        &mut self,
        what: &str,
        mut cond: impl FnMut(&[InstanceStats]) -> bool,
    ) -> Vec<InstanceStats> {
        let deadline = Instant::now() + WAIT;
        loop {
            let out = self.inst().poll();
            assert!(out.errors.is_empty(), "poll errors: {:?}", out.errors);
            let stats = self.inst().stats();
            if cond(&stats) {
                return stats;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}: {stats:#?}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn lodgers(&self) -> String {
        format!("/{}/lodgers", self.parent)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(mut inst) = self.inst.take() {
            inst.stop_all();
        }
        let parent = cgroup_dir(&self.parent);
        if let Ok(dir) = std::fs::read_dir(parent.join("lodgers")) {
            for e in dir.flatten() {
                if e.path().is_dir() {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
        }
        let _ = std::fs::remove_dir(parent.join("lodgers"));
        let _ = std::fs::remove_dir(parent);
    }
}

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
            .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")).ok())
            .is_some_and(|c| !c.trim().is_empty())
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
            child = std::fs::read_to_string(format!("/proc/{sh}/task/{sh}/children"))
                .ok()
                .and_then(|t| t.split_whitespace().next()?.parse::<u32>().ok());
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
