//! Training enforcement on cgroup v2: cgroup jobs on a fixture tree (a recorded v2 hierarchy)
//! and on this host where it is v2, and pid jobs pinned by affinity.

use super::*;

#[test]
fn v2_cgroup_job_sets_and_restores_cpuset_files() {
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    let step = v2.path().join(STEP.trim_start_matches('/'));
    let target = Target::Cgroup(STEP.into());
    let mut record = JobRecord::default();

    let out = e
        .apply(&job(1), &target, &set("2-3"), &set("0"), &mut record)
        .expect("apply");
    assert!(out.changed);
    assert!(!out.alive, "no process in the fixture step");
    assert_eq!(read_trim(step.join("cpuset.cpus")), "2-3");
    assert_eq!(read_trim(step.join("cpuset.mems")), "0");
    // v2 leaves descendants alone: their effective CPUs follow the step.
    assert_eq!(read_trim(step.join("user/task_0/cpuset.cpus")), "");
    // The effective file is read by its v2 name; the fixture does not follow the write.
    assert!(
        out.warnings.iter().any(|w| w.contains("runs on CPUs 0-3")),
        "{:?}",
        out.warnings
    );
    let rec = record.cgroup.as_ref().expect("cgroup record");
    assert_eq!(rec.cgroup, STEP);
    assert_eq!(rec.saved[0].cpus, set("0-3"));

    let again = e
        .apply(&job(1), &target, &set("2-3"), &set("0"), &mut record)
        .expect("apply again");
    assert!(!again.changed);

    // A placement outside the node is refused before any write.
    let err = e
        .apply(&job(1), &target, &set("7"), &set("0"), &mut record)
        .expect_err("cpu 7 is not on the node");
    assert!(matches!(err, EnforceError::CpusOutsideNode { .. }), "{err}");
    assert_eq!(read_trim(step.join("cpuset.cpus")), "2-3");

    e.release(&job(1), &target, &record).expect("release");
    assert_eq!(read_trim(step.join("cpuset.cpus")), "0-3");
    assert_eq!(read_trim(step.join("cpuset.mems")), "0");

    // A cgroup that inherited its parent's CPUs (empty cpuset.cpus) inherits again after release.
    let slurm = Target::Cgroup(format!("{STEP}/slurm"));
    let mut record = JobRecord::default();
    e.apply(&job(6), &slurm, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert_eq!(read_trim(step.join("slurm/cpuset.cpus")), "1");
    e.release(&job(6), &slurm, &record).expect("release");
    assert_eq!(read_trim(step.join("slurm/cpuset.cpus")), "");
    assert_eq!(read_trim(step.join("slurm/cpuset.mems")), "");
}

#[test]
fn v2_release_reports_a_file_it_cannot_restore_and_restores_the_rest() {
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    let slurm = Target::Cgroup(format!("{STEP}/slurm"));
    let dir = v2.path().join(STEP.trim_start_matches('/')).join("slurm");
    let mut record = JobRecord::default();
    e.apply(&job(7), &slurm, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert_eq!(read_trim(dir.join("cpuset.mems")), "0");
    // The cpuset files vanish from under lodger (someone disabled the controller and enabled it
    // again half-way): cpuset.mems cannot be read, so it cannot be restored.
    fs::remove_file(dir.join("cpuset.mems")).expect("remove");
    let err = e
        .release(&job(7), &slurm, &record)
        .expect_err("mems cannot be restored");
    assert!(
        err.to_string().contains("slurm/cpuset.mems"),
        "the error names the file: {err}"
    );
    // cpuset.cpus went back to inheriting all the same.
    assert_eq!(
        fs::read_to_string(dir.join("cpuset.cpus")).expect("cpus"),
        "\n"
    );
}

#[test]
fn v2_cpuset_not_enabled_names_the_file_to_write() {
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    let mut before = Vec::new();
    snapshot(v2.path(), &mut before);
    let target = Target::Cgroup("/user.slice/user-1000.slice/session-3.scope".into());
    let err = e
        .apply(
            &job(2),
            &target,
            &set("1"),
            &set("0"),
            &mut JobRecord::default(),
        )
        .expect_err("cpuset is not enabled there");
    match &err {
        EnforceError::Cgroup(CgroupError::CpusetNotEnabled { file, .. }) => {
            assert_eq!(file, &v2.path().join("user.slice/cgroup.subtree_control"));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("+cpuset"), "{err}");
    let mut after = Vec::new();
    snapshot(v2.path(), &mut after);
    assert_eq!(before, after, "nothing written outside lodger's subtree");
}

#[test]
fn v2_enables_cpuset_only_inside_the_delegated_subtree() {
    let v2 = v2_fixture();
    let h = cpusets::V2Cpuset::new(v2.path().to_path_buf());
    for (rel, controllers) in [
        ("lodger", "cpuset cpu io memory pids"),
        ("lodger/inner", "cpu"),
    ] {
        let d = v2.path().join(rel);
        fs::create_dir_all(&d).expect("mkdir");
        fs::write(d.join("cgroup.controllers"), controllers).expect("write");
        fs::write(d.join("cgroup.subtree_control"), "").expect("write");
    }
    fs::create_dir_all(v2.path().join("lodger/inner/job")).expect("mkdir");
    // lodger/inner lacks cpuset in its controllers: lodger/ must enable it first, then inner.
    fs::write(
        v2.path().join("lodger/inner/cgroup.controllers"),
        "cpuset cpu",
    )
    .expect("write");
    assert!(h
        .enable_cpuset("/lodger/inner/job", "/lodger")
        .expect("enable"));
    assert_eq!(
        read_trim(v2.path().join("lodger/cgroup.subtree_control")),
        "+cpuset"
    );
    assert_eq!(
        read_trim(v2.path().join("lodger/inner/cgroup.subtree_control")),
        "+cpuset"
    );
    // The root already enables it and was not written.
    assert_eq!(
        read_trim(v2.path().join("cgroup.subtree_control")),
        "cpuset cpu io memory pids"
    );
    // Outside the delegated subtree: an error naming the file, no write.
    let err = h
        .enable_cpuset("/user.slice/user-1000.slice/session-3.scope", "/lodger")
        .expect_err("not lodger's");
    assert!(
        err.to_string()
            .contains("user.slice/cgroup.subtree_control"),
        "{err}"
    );
    assert_eq!(
        read_trim(v2.path().join("user.slice/cgroup.subtree_control")),
        "cpu io memory pids"
    );
}

#[test]
fn v2_cgroup_removed_under_the_job_is_gone() {
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    let target = Target::Cgroup("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0".into());
    let mut record = JobRecord::default();
    e.apply(&job(3), &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    fs::remove_dir_all(
        v2.path()
            .join("system.slice/slurmstepd.scope/job_42/step_0/user"),
    )
    .expect("rm");
    let err = e
        .apply(&job(3), &target, &set("1"), &set("0"), &mut record)
        .expect_err("gone");
    assert!(err.is_gone(), "{err}");
    match &err {
        EnforceError::CgroupGone { path } => assert!(path.ends_with("user/task_0"), "{path:?}"),
        other => panic!("unexpected {other}"),
    }
    e.release(&job(3), &target, &record)
        .expect("nothing left to release");
}

#[test]
fn v2_cgroup_job_with_a_real_process() {
    if !need_root("v2_cgroup_job_with_a_real_process") {
        return;
    }
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    let w = Workload::start(2);
    let task = v2
        .path()
        .join(STEP.trim_start_matches('/'))
        .join("user/task_0");
    fs::write(task.join("cgroup.procs"), format!("{}\n", w.pid)).expect("write procs");
    let target = Target::Cgroup(STEP.into());
    let mut record = JobRecord::default();
    let out = e
        .apply(&job(4), &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert!(out.alive);
    assert_eq!(out.pids, vec![w.pid]);
    assert_eq!(out.threads, thread_count(&[w.pid]));
    assert_eq!(out.rr_threads, out.threads);
    // The fixture cannot move CPUs: only the policy is real here.
    assert_threads(&[w.pid], Some(7), &unpinned());
    let again = e
        .apply(&job(4), &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert!(!again.changed);
    e.release(&job(4), &target, &record).expect("release");
    assert_threads(&[w.pid], None, &unpinned());
}

#[test]
fn v2_pid_job_is_pinned_by_affinity_without_touching_the_tree() {
    if !need_root("v2_pid_job_is_pinned_by_affinity_without_touching_the_tree") {
        return;
    }
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    assert_eq!(e.mode().pid_pinning, PinMethod::Affinity);
    let mut before = Vec::new();
    snapshot(v2.path(), &mut before);
    let w = Workload::start(2);
    let target = Target::Pids(vec![w.pid]);
    let mut record = JobRecord::default();
    let out = e
        .apply(&job(5), &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert!(out.changed && out.alive);
    assert!(
        out.warnings.iter().any(|w| w.contains("not enforced")),
        "{:?}",
        out.warnings
    );
    assert_threads(&[w.pid], Some(7), "1");
    let mut after = Vec::new();
    snapshot(v2.path(), &mut after);
    assert_eq!(before, after, "affinity pinning writes no cgroup file");
    e.release(&job(5), &target, &record).expect("release");
    assert_threads(&[w.pid], None, &unpinned());
}

// =============================================================================================
// Real cgroup v1 and SCHED_RR (root)
