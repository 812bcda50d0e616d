//! Affinity-placed inference instances join lodger's own cgroup2 subtree before their program
//! runs (issue 17: on cgroup v2 without systemd as PID 1 they live outside lodgerd's cgroup, so
//! whatever stops or kills lodgerd's cgroup leaves them running). As root on the real kernel:
//! this host's cgroup2 mount (the unified hierarchy of a hybrid host, or the v2 root), in a
//! cgroup named for the test and removed after it. Which directory lodgerd picks on such a host
//! (`<parent>/lodgers`) is the unit test `instances::tests::own_subtree_*`.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use lodger::cpuset::CpuSet;
use lodger::enforce::instances::{
    Identity, InstanceOutput, InstancePlacement, InstanceSettings, InstanceSpec, InstanceState,
    Instances,
};
use lodger::job::JobId;

const TEST: &str = "an_affinity_placed_instance_runs_in_lodgers_subtree_and_outlives_lodgerd";

/// The cgroup2 mount point, from /proc/self/mountinfo.
fn cgroup2_mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let point = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(point))
    })
}

/// A process's cgroup2 path (the `0::` line of /proc/PID/cgroup).
fn cgroup2_of(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
}

/// The test's cgroup2 directory: whatever is left in it killed, then removed.
struct Cleanup {
    top: PathBuf,
    pids: Vec<u32>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for &pid in &self.pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let procs = self.top.join("lodgers/cgroup.procs");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&procs).is_ok_and(|t| !t.trim().is_empty())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(self.top.join("lodgers"));
        let _ = std::fs::remove_dir(&self.top);
    }
}

#[test]
fn an_affinity_placed_instance_runs_in_lodgers_subtree_and_outlives_lodgerd() {
    if !need_root(TEST) {
        return;
    }
    let Some(mount) = cgroup2_mount() else {
        lodger::privileged::not_applicable(TEST, "this host has no cgroup2 mount");
        return;
    };
    if instances_are_units() {
        // Its counterpart there: tests/instances.rs, whose instances are then units.
        lodger::privileged::not_applicable(
            TEST,
            "systemd is PID 1: instances are its transient units, not lodgerd's children \
             joining lodger's subtree",
        );
        return;
    }
    let name = unique("lodger-it-subtree");
    let mut cleanup = Cleanup {
        top: mount.join(&name),
        pids: Vec::new(),
    };
    let dir = cleanup.top.join("lodgers");
    let logs = tempfile::tempdir().expect("tempdir");
    let mut inst = Instances::new(InstanceSettings {
        parent: unique("lodger-it-subtree-parent"),
        placement: InstancePlacement::Affinity,
        start_cgroup: Some(dir.clone()),
        output: InstanceOutput::Directory(logs.path().to_path_buf()),
        ..InstanceSettings::default()
    })
    .expect("Instances");
    assert_eq!(inst.start_cgroup(), Some(dir.as_path()));
    let cpu = online_set().iter().next_back().expect("a CPU");
    let spec = InstanceSpec {
        job: JobId::parse("j7").expect("id"),
        index: 0,
        argv: vec!["sleep".into(), "600".into()],
        cpus: CpuSet::parse(&cpu.to_string()).expect("cpus"),
        mems: CpuSet::new(),
        threads: 1,
        batch: 1,
        offline: true,
        identity: Identity {
            uid: nix::unistd::getuid().as_raw(),
            ..Identity::default()
        },
        memory_max: None,
    };
    inst.reconcile(std::slice::from_ref(&spec))
        .expect("reconcile");
    let mut pid = None;
    wait_until(WAIT, "the instance to run", || {
        inst.poll();
        pid = inst
            .stats()
            .first()
            .filter(|s| s.state == InstanceState::Running)
            .and_then(|s| s.pid);
        pid.is_some()
    });
    let pid = pid.expect("pid");
    cleanup.pids.push(pid);

    // In lodger's subtree from its first instruction on (it joined before exec), not in the
    // cgroup of the process that supervises it.
    let want = format!("/{name}/lodgers");
    assert_eq!(cgroup2_of(pid).as_deref(), Some(want.as_str()));
    assert_ne!(cgroup2_of(pid), cgroup2_of(std::process::id()));
    assert!(std::fs::read_to_string(dir.join("cgroup.procs"))
        .expect("cgroup.procs")
        .split_whitespace()
        .any(|p| p == pid.to_string()));
    assert_eq!(
        cpus_allowed(pid, pid).as_deref(),
        Some(cpu.to_string().as_str())
    );

    // The supervisor goes as a stopping lodgerd does: the instance runs on where it was.
    assert_eq!(inst.leave_running(), 1);
    drop(inst);
    assert!(alive(pid), "the instance outlived its supervisor");
    assert_eq!(cgroup2_of(pid).as_deref(), Some(want.as_str()));
    assert!(Path::new(&dir).is_dir());
}
