//! Inference instances for real, as root on this machine's cpuset hierarchy (v1 or v2): the bundled
//! inference worker (and the Python client of docs/) started by `enforce::instances`, checked from
//! /proc and cgroupfs. Each test has its own parent cgroup.

mod common;
// The tests, by what they are about (a crate root's modules are looked for beside it).
#[path = "instances/adoption.rs"]
mod adoption;
#[path = "instances/lifecycle.rs"]
mod lifecycle;
#[path = "instances/refusals.rs"]
mod refusals;

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
