//! Slurm jobs: how a job's cgroup and cpuset are found (a v2 fixture tree), and on the real
//! kernel (root, cgroup v1) a job cgroup made as Slurm's task/cgroup makes it
//! (`<prepend>/uid_U/job_J`), and what release gives back read from /proc.

use super::*;
use crate::job::SlurmJob;

/// Slurm job `id`'s cgroup as task/cgroup makes it, on every CPU (`<top>/uid_0/job_<id>`, removed
/// with the guard), and an enforcer that finds Slurm's cgroups there: the guard, `<top>`, the
/// CPUs, the job's cgroup directory and the enforcer.
fn slurm_job(id: u64) -> (CgroupGuard, String, String, PathBuf, Enforcer) {
    let top = unique("slurm");
    let guard = CgroupGuard::new(CPUSET_V1, &top);
    let whole = unpinned();
    make_cpuset(&top, &whole, "0");
    make_cpuset(&format!("{top}/uid_0"), &whole, "0");
    let job_dir = make_cpuset(&format!("{top}/uid_0/job_{id}"), &whole, "0");
    let e = enforcer(EnforceSettings {
        slurm_cgroups: vec![format!("/{top}/uid_{{uid}}/job_{{job}}")],
        ..settings(&unique("slurmparent"), PidPinning::Affinity)
    });
    (guard, top, whole, job_dir, e)
}

/// A process forked after the last apply inherited SCHED_RR and lodger's mask from its pinned
/// parent without lodger ever tracking it: release finds it in the job's cgroup and gives it
/// back its parent's standing (SCHED_OTHER, the mask its parent had), not left real-time.
#[test]
fn release_gives_back_a_slurm_process_forked_since_the_last_apply() {
    let test = "release_gives_back_a_slurm_process_forked_since_the_last_apply";
    if !need_root(test) || !crate::privileged::need_cgroup_v1(test) {
        return;
    }
    let (_guard, top, whole, job_dir, e) = slurm_job(77);
    let mut w = Workload::start(2);
    fs::write(job_dir.join("cgroup.procs"), w.pid.to_string()).expect("join the job's cgroup");
    let target = Target::Slurm(SlurmJob {
        job_id: 77,
        uid: 0,
        node: None,
    });
    let id = job(77);
    let mut record = JobRecord::default();
    let out = e
        .apply(&id, &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert_eq!(out.pids, [w.pid]);
    assert_threads(&[w.pid], Some(7), "1");

    let late = w.spawn_child();
    assert_eq!(cpuset_cgroup_of(late), format!("/{top}/uid_0/job_77"));
    assert_threads(&[late], Some(7), "1");
    e.release(&id, &target, &record).expect("release");
    assert_threads(&[w.pid], None, &whole);
    assert_threads(&[late], None, &whole);
}

/// A process with lodger's mask and no parent lodger tracks (its pinned parent forked it and
/// exited before lodger looked: a daemonizing tool) is not a task the user bound: it follows
/// the job's placement when that changes, like the pinned process it descends from.
#[test]
fn an_orphan_with_lodgers_mask_follows_the_job() {
    let test = "an_orphan_with_lodgers_mask_follows_the_job";
    if !need_root(test) || !crate::privileged::need_cgroup_v1(test) {
        return;
    }
    /// Killed and reaped however the test ends.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let (_guard, _, whole, job_dir, e) = slurm_job(78);
    let w = Workload::start(1);
    fs::write(job_dir.join("cgroup.procs"), w.pid.to_string()).expect("join the job's cgroup");
    let target = Target::Slurm(SlurmJob {
        job_id: 78,
        uid: 0,
        node: None,
    });
    let id = job(78);
    let mut record = JobRecord::default();
    e.apply(&id, &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert_threads(&[w.pid], Some(7), "1");
    // On lodger's mask, its parent (this test) not the job's.
    let orphan = Reaped(
        std::process::Command::new("taskset")
            .args(["-c", "1", "sleep", "600"])
            .spawn()
            .expect("taskset"),
    );
    let pid = orphan.0.id();
    // taskset sets the mask, then execs sleep.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep") {
        assert!(std::time::Instant::now() < deadline, "taskset did not exec");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    fs::write(job_dir.join("cgroup.procs"), pid.to_string()).expect("into the job");
    e.apply(&id, &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    e.apply(&id, &target, &set("0"), &set("0"), &mut record)
        .expect("apply, moved");
    assert_threads(&[w.pid], Some(7), "0");
    assert_threads(&[pid], Some(7), "0");
    e.release(&id, &target, &record).expect("release");
    assert_threads(&[pid], None, &whole);
}

/// A job's cgroup is found with its cpuset; a cgroup with no cpuset file has none (the job may
/// run anywhere); one whose cpuset cannot be read is an error, never taken for either of those.
#[test]
fn a_slurm_cpuset_is_read_as_there_absent_or_unreadable() {
    let v2 = v2_fixture();
    let e = enforcer(EnforceSettings {
        slurm_cgroups: vec!["/system.slice/slurmstepd.scope/job_{job}".into()],
        ..v2_settings(v2.path())
    });
    let job = |job_id| SlurmJob {
        job_id,
        uid: 1000,
        node: None,
    };
    let found = e.find_slurm(&job(42), None).expect("readable");
    assert_eq!(
        found.map(|f| (f.path, f.cpus)),
        Some((
            "/system.slice/slurmstepd.scope/job_42".to_string(),
            Some(set("0-3"))
        ))
    );
    assert!(matches!(e.find_slurm(&job(7), None), Ok(None)), "no cgroup");

    let file = v2
        .path()
        .join("system.slice/slurmstepd.scope/job_42/cpuset.cpus.effective");
    fs::remove_file(&file).expect("remove");
    let found = e
        .find_slurm(&job(42), None)
        .expect("no cpuset is not an error");
    assert_eq!(found.and_then(|f| f.cpus), None);

    fs::write(&file, "not a cpu list\n").expect("write");
    let err = e.find_slurm(&job(42), None).expect_err("unreadable");
    assert!(err.to_string().contains("not a cpu list"), "{err}");
}
