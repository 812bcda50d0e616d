//! Slurm jobs on the real kernel (root, cgroup v1): a job cgroup made as Slurm's task/cgroup
//! makes it (`<prepend>/uid_U/job_J`), and what release gives back read from /proc.

use super::*;
use crate::job::SlurmJob;

/// A process forked after the last apply inherited SCHED_RR and lodger's mask from its pinned
/// parent without lodger ever tracking it: release finds it in the job's cgroup and gives it
/// back its parent's standing (SCHED_OTHER, the mask its parent had), not left real-time.
#[test]
fn release_gives_back_a_slurm_process_forked_since_the_last_apply() {
    let test = "release_gives_back_a_slurm_process_forked_since_the_last_apply";
    if !need_root(test) || !crate::privileged::need_cgroup_v1(test) {
        return;
    }
    let top = unique("slurm");
    let _guard = CgroupGuard::new(CPUSET_V1, &top);
    let whole = unpinned();
    make_cpuset(&top, &whole, "0");
    make_cpuset(&format!("{top}/uid_0"), &whole, "0");
    let job_dir = make_cpuset(&format!("{top}/uid_0/job_77"), &whole, "0");
    let e = enforcer(EnforceSettings {
        slurm_cgroups: vec![format!("/{top}/uid_{{uid}}/job_{{job}}")],
        ..settings(&unique("slurmparent"), PidPinning::Affinity)
    });
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
