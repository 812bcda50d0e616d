//! Batch and Slurm jobs through the agent (issue 18): leftover cores, caps, a Slurm job's cgroup
//! awaited, found, confined and gone, and who may register one. The fake enforcer and node are
//! `tests.rs`'s.

use super::registry::Change;
use super::tests::{spec, Rig};
use super::{AgentError, Caller};
use crate::cpuset::CpuSet;
use crate::enforce::SlurmCgroup;
use crate::job::{JobKind, JobSpec, JobState, SlurmJob, Target};

fn set(list: &str) -> CpuSet {
    CpuSet::parse(list).unwrap()
}

fn batch(pids: Vec<u32>, cores: u32) -> JobSpec {
    JobSpec {
        kind: JobKind::Batch,
        ..spec(pids, cores)
    }
}

fn slurm(kind: JobKind, job_id: u64) -> JobSpec {
    JobSpec {
        kind,
        target: Target::Slurm(SlurmJob {
            job_id,
            uid: 0,
            node: None,
        }),
        ..spec(vec![], 0)
    }
}

#[test]
fn batch_jobs_get_the_cores_training_leaves_and_grow_when_it_goes() {
    let rig = Rig::new();
    rig.spawn(100);
    rig.spawn(200);
    let mut agent = rig.agent();
    let training = agent.register(spec(vec![100], 4), 1000).unwrap();
    let b = agent.register(batch(vec![200], 0), 1000).unwrap();
    let jobs = agent.jobs();
    let (t_cpus, b_cpus) = (&jobs[&training.id].cpus, &jobs[&b.id].cpus);
    assert_eq!(jobs[&b.id].state, JobState::Running);
    assert!(t_cpus.is_disjoint(b_cpus), "{t_cpus} / {b_cpus}");
    assert!(
        !b_cpus.contains(0) && !b_cpus.contains(8),
        "reserved: {b_cpus}"
    );
    assert_eq!(b_cpus.len() + t_cpus.len(), 14, "every other CPU: {b_cpus}");
    assert_eq!(rig.node.lock().unwrap().applied[&b.id], *b_cpus);

    agent.unregister(training.id.as_str()).unwrap();
    agent.tick();
    assert_eq!(agent.jobs()[&b.id].cpus, set("1-7,9-15"));

    // Its last process gone, the batch job is released and forgotten.
    rig.kill(200);
    agent.tick();
    assert!(!agent.jobs().contains_key(&b.id));
    assert!(rig.node.lock().unwrap().released.contains(&b.id));
}

#[test]
fn a_batch_job_is_cut_to_its_cap_in_whole_cores() {
    let rig = Rig::new();
    rig.spawn(200);
    let mut agent = rig.agent();
    let b = agent.register(batch(vec![200], 2), 1000).unwrap();
    let cpus = agent.jobs()[&b.id].cpus.clone();
    assert_eq!(cpus.len(), 2);
    // One physical core: a CPU and its SMT sibling (CPU n and n + 8 here).
    let first = cpus.first().unwrap();
    assert_eq!(cpus, set(&format!("{first},{}", first + 8)));
}

#[test]
fn a_batch_job_needs_its_processes_and_names_no_gpu() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let err = agent.register(batch(vec![300], 0), 1000).unwrap_err();
    assert!(
        err.to_string().contains("process 300 does not exist"),
        "{err}"
    );
    rig.spawn(300);
    let mut with_gpu = batch(vec![300], 0);
    with_gpu.gpus = vec![0];
    let err = agent.register(with_gpu, 1000).unwrap_err();
    assert!(matches!(err, AgentError::InvalidSpec(_)), "{err}");
}

#[test]
fn a_slurm_training_job_waits_for_its_cgroup_then_runs_inside_its_cpuset_until_it_goes() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let job = agent.register(slurm(JobKind::Training, 42), 1000).unwrap();
    let seen = &agent.jobs()[&job.id];
    assert_eq!(seen.state, JobState::Pending);
    assert!(
        seen.last_error
            .as_deref()
            .unwrap_or("")
            .contains("waiting for Slurm job 42"),
        "{:?}",
        seen.last_error
    );
    // The owner's uid names the v1 cgroup.
    assert!(matches!(&seen.spec.target, Target::Slurm(j) if j.uid == 1000));

    rig.node.lock().unwrap().slurm.insert(
        42,
        SlurmCgroup {
            path: "/system.slice/slurmstepd.scope/job_42".into(),
            cpus: Some(set("4-7,12-15")),
        },
    );
    agent.tick();
    let seen = &agent.jobs()[&job.id];
    assert_eq!(seen.state, JobState::Running, "{:?}", seen.last_error);
    assert_eq!(
        seen.cpus,
        set("4-7,12-15"),
        "no count given: its whole cpuset"
    );

    rig.node.lock().unwrap().slurm.remove(&42);
    agent.tick();
    assert!(
        !agent.jobs().contains_key(&job.id),
        "its cgroup gone, the job is over"
    );
    assert!(rig.node.lock().unwrap().released.contains(&job.id));
}

#[test]
fn a_slurm_cpuset_that_cannot_be_read_neither_moves_nor_ends_the_job() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let job = agent.register(slurm(JobKind::Training, 42), 1000).unwrap();
    let never = agent.register(slurm(JobKind::Batch, 43), 1000).unwrap();
    {
        let mut node = rig.node.lock().unwrap();
        node.slurm.insert(
            42,
            SlurmCgroup {
                path: "/slurm/uid_1000/job_42".into(),
                cpus: Some(set("4-7")),
            },
        );
        // Job 43's cgroup is there from the start, its cpuset never readable.
        node.slurm_unreadable.insert(43);
    }
    agent.tick();
    assert_eq!(agent.jobs()[&job.id].cpus, set("4-7"));

    // Not "no cpuset" (which would place it by count, anywhere), not gone: the last view holds.
    rig.node.lock().unwrap().slurm_unreadable.insert(42);
    for _ in 0..3 {
        agent.tick();
    }
    let jobs = agent.jobs();
    let seen = &jobs[&job.id];
    assert_eq!(seen.cpus, set("4-7"), "{:?}", seen.last_error);
    // Still placed (its cores not handed to others), the enforcement error shown.
    assert_eq!(seen.state, JobState::Error, "{:?}", seen.last_error);
    assert!(
        seen.last_error
            .as_deref()
            .is_some_and(|e| e.contains("unexpected content")),
        "{:?}",
        seen.last_error
    );
    assert!(!rig.node.lock().unwrap().released.contains(&job.id));
    let waits = &jobs[&never.id];
    assert_eq!(waits.state, JobState::Pending);
    assert!(
        waits
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("cannot read Slurm job 43's cpuset")),
        "{:?}",
        waits.last_error
    );
    assert!(waits.cpus.is_empty(), "never placed: {}", waits.cpus);

    // Readable again, and then gone: the job ends as before.
    {
        let mut node = rig.node.lock().unwrap();
        node.slurm_unreadable.remove(&42);
        node.slurm.remove(&42);
    }
    agent.tick();
    assert!(!agent.jobs().contains_key(&job.id), "its cgroup gone");
}

#[test]
fn a_slurm_job_is_placed_on_part_of_its_cpuset_and_a_batch_one_beside_training() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let mut t = slurm(JobKind::Training, 1);
    t.cores = 2;
    let t = agent.register(t, 1000).unwrap();
    let b = agent.register(slurm(JobKind::Batch, 2), 1001).unwrap();
    {
        let mut node = rig.node.lock().unwrap();
        node.slurm.insert(
            1,
            SlurmCgroup {
                path: "/slurm/uid_1000/job_1".into(),
                cpus: Some(set("1-3,9-11")),
            },
        );
        // Slurm gave the batch job CPUs that overlap where training is placed.
        node.slurm.insert(
            2,
            SlurmCgroup {
                path: "/slurm/uid_1001/job_2".into(),
                cpus: Some(set("1-5,9-13")),
            },
        );
    }
    agent.tick();
    let jobs = agent.jobs();
    let (tc, bc) = (&jobs[&t.id].cpus, &jobs[&b.id].cpus);
    assert_eq!(tc.len(), 2);
    assert!(tc.is_subset(&set("1-3,9-11")), "{tc}");
    assert!(
        bc.is_subset(&set("1-5,9-13")),
        "inside its own cpuset: {bc}"
    );
    assert!(bc.is_disjoint(tc), "never on training's CPUs: {bc} / {tc}");
    assert_eq!(bc.len(), 8);
}

#[test]
fn a_slurm_job_whose_cgroup_never_appears_is_forgotten_after_the_timeout() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let job = agent.register(slurm(JobKind::Batch, 9), 1000).unwrap();
    agent.tick();
    assert!(agent.jobs().contains_key(&job.id));
    if let Some(s) = agent.state.jobs.get_mut(&job.id) {
        s.job.registered_at -= 601;
    }
    agent.tick();
    assert!(!agent.jobs().contains_key(&job.id));
}

#[test]
fn only_root_registers_slurm_jobs_and_each_once() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let s = slurm(JobKind::Training, 5);
    let change = Change::Register {
        owner: None,
        spec: &s,
    };
    let err = agent
        .authorize(&Caller::uid(1000), &change)
        .unwrap_err()
        .to_string();
    assert!(err.contains("only root (Slurm's prolog)"), "{err}");
    let root_for_user = Change::Register {
        owner: Some(1000),
        spec: &s,
    };
    assert_eq!(
        agent.authorize(&Caller::uid(0), &root_for_user).ok(),
        Some(1000)
    );
    agent.register(s.clone(), 1000).unwrap();
    let err = agent.register(s, 1000).unwrap_err();
    assert!(matches!(err, AgentError::Conflict(_)), "{err}");
}

#[test]
fn a_slurm_training_job_is_right_sized_within_its_cpuset_once_placed() {
    let rig = Rig::new();
    let mut builder = rig.builder();
    builder.settings.rightsize.enforce = Some(true);
    let mut agent = builder.start().unwrap();
    let job = agent.register(slurm(JobKind::Training, 77), 1000).unwrap();
    agent.tick();
    assert!(agent.state.jobs[&job.id].tuning.is_none(), "not placed yet");
    rig.node.lock().unwrap().slurm.insert(
        77,
        SlurmCgroup {
            path: "/slurm/uid_1000/job_77".into(),
            cpus: Some(set("2-4,10-12")),
        },
    );
    agent.tick();
    let tuning = agent.state.jobs[&job.id]
        .tuning
        .clone()
        .expect("a tuner once placed");
    assert_eq!(
        tuning.tuner.settings().max,
        6,
        "never beyond Slurm's cpuset"
    );
    agent.tick();
    let cpus = agent.jobs()[&job.id].cpus.clone();
    assert_eq!(
        u32::try_from(cpus.len()).unwrap(),
        tuning.tuner.cores().min(6),
        "placed at the tuner's count: {cpus}"
    );
    assert!(cpus.is_subset(&set("2-4,10-12")), "{cpus}");
}

#[test]
fn only_lendable_cpus_are_lent_to_batch_jobs() {
    let rig = Rig::new();
    rig.spawn(200);
    let mut builder = rig.builder();
    builder.settings.lendable = Some(set("1-3,9-11"));
    let mut agent = builder.start().unwrap();
    let b = agent.register(batch(vec![200], 0), 1000).unwrap();
    assert_eq!(agent.jobs()[&b.id].cpus, set("1-3,9-11"));
}

/// A batch job may wait for cores long after its registration: the start times of its
/// processes when the caller's right to them was checked are kept with it, so the enforcer
/// leaves a pid that another process holds by then alone (a reused pid is not the job's).
#[test]
fn a_batch_job_keeps_the_start_times_its_registration_was_checked_on() {
    let rig = Rig::new();
    rig.spawn(200);
    let stat = "200 (worker) S 1 200 200 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0";
    std::fs::write(rig.proc_root.path().join("200/stat"), stat).unwrap();
    let mut agent = rig.agent();
    let b = agent.register(batch(vec![200], 0), 1000).unwrap();
    let authorized = &agent.state.jobs[&b.id].record.authorized;
    assert_eq!(authorized.len(), 1, "{authorized:?}");
    assert_eq!((authorized[0].pid, authorized[0].start_time), (200, 4242));
}

/// Where Slurm confines no cores (its job cgroup has no cpuset) a batch Slurm job is placed on
/// the leftover cores: the prolog names no core count for a batch job, and none is needed.
#[test]
fn a_batch_slurm_job_without_a_slurm_cpuset_runs_on_the_leftover_cores() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let b = agent.register(slurm(JobKind::Batch, 3), 1000).unwrap();
    rig.node.lock().unwrap().slurm.insert(
        3,
        SlurmCgroup {
            path: "/slurm/uid_1000/job_3".into(),
            cpus: None,
        },
    );
    agent.tick();
    let seen = &agent.jobs()[&b.id];
    assert_eq!(seen.state, JobState::Running, "{:?}", seen.last_error);
    assert_eq!(seen.cpus, set("1-7,9-15"), "every CPU but the reserved");
}

/// A fake process `pid` of uid 1000 in cpuset cgroup `cgroup` (v1 hybrid: the cpuset line, then
/// the unified one).
fn in_cgroup(rig: &Rig, pid: u32, cgroup: &str) {
    rig.spawn(pid);
    let dir = rig.proc_root.path().join(pid.to_string());
    let stat =
        format!("{pid} (python3) S 1 {pid} {pid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 77 0 0");
    std::fs::write(dir.join("stat"), stat).unwrap();
    std::fs::write(
        dir.join("status"),
        "Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\n",
    )
    .unwrap();
    let lines = format!("12:cpuset:{cgroup}\n4:memory:{cgroup}\n0::/user.slice\n");
    std::fs::write(dir.join("cgroup"), lines).unwrap();
}

/// A process in a Slurm job's cgroup is the Slurm job's: registering it by pid would pin it
/// against Slurm's placement and (v1, cgroup pinning) move it out of Slurm's cpuset and memory
/// limit. Refused, whether the cgroup is where `slurm.cgroup_paths` puts any job or where a
/// registered Slurm job was found; a cgroup inside a registered Slurm job's likewise.
#[test]
fn a_process_or_cgroup_of_a_slurm_job_is_not_registered_apart_from_it() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let prolog = agent.register(slurm(JobKind::Batch, 43), 1000).unwrap();
    rig.node.lock().unwrap().slurm.insert(
        43,
        SlurmCgroup {
            path: "/site/job_43".into(),
            cpus: Some(set("1-3")),
        },
    );
    agent.tick();
    in_cgroup(&rig, 300, "/slurm/uid_1000/job_42/step_0");
    in_cgroup(&rig, 301, "/site/job_43/step_batch");
    in_cgroup(&rig, 302, "/user.slice/user-1000.slice/session-3.scope");
    let before = (agent.jobs().len(), rig.node.lock().unwrap().applies);
    let user = Caller::uid(1000);
    for (pid, job, cgroup) in [
        (300, 42, "/slurm/uid_1000/job_42"),
        (301, 43, "/site/job_43"),
    ] {
        let s = batch(vec![pid], 0);
        let change = Change::Register {
            owner: None,
            spec: &s,
        };
        let err = agent.authorize(&user, &change).unwrap_err();
        assert!(matches!(err, AgentError::AccessDenied(_)), "{err}");
        let want = format!(
            "process {pid} is in Slurm job {job}'s cgroup {cgroup}: register the Slurm job \
             (lodgerctl slurm prolog) instead"
        );
        assert!(err.to_string().contains(&want), "{err}");
        assert!(
            agent.authorize(&Caller::uid(0), &change).is_err(),
            "root too"
        );
    }
    let s = batch(vec![302], 0);
    let change = Change::Register {
        owner: None,
        spec: &s,
    };
    assert_eq!(agent.authorize(&user, &change).ok(), Some(1000));
    let step = JobSpec {
        target: Target::Cgroup("/site/job_43/step_batch".into()),
        ..batch(vec![], 0)
    };
    let change = Change::Register {
        owner: None,
        spec: &step,
    };
    let err = agent.authorize(&Caller::uid(0), &change).unwrap_err();
    assert!(
        err.to_string()
            .contains("Slurm job 43's cgroup /site/job_43"),
        "{err}"
    );
    assert_eq!(
        (agent.jobs().len(), rig.node.lock().unwrap().applies),
        before,
        "nothing registered or applied"
    );
    assert!(agent.jobs().contains_key(&prolog.id));
}

/// A Slurm job registered with no count runs on its whole cpuset; a core the RT guard adds keeps
/// it there (it cannot grow beyond Slurm's cpuset), never cuts it to that one core.
#[test]
fn an_rt_guard_core_keeps_a_whole_cpuset_slurm_job_on_its_whole_cpuset() {
    let rig = Rig::new();
    let mut agent = rig.agent();
    let job = agent.register(slurm(JobKind::Training, 77), 1000).unwrap();
    rig.node.lock().unwrap().slurm.insert(
        77,
        SlurmCgroup {
            path: "/slurm/uid_1000/job_77".into(),
            cpus: Some(set("2-4,10-12")),
        },
    );
    agent.tick();
    assert_eq!(agent.jobs()[&job.id].cpus, set("2-4,10-12"));
    agent.state.jobs.get_mut(&job.id).unwrap().job.rt = Some(crate::job::RtStanding {
        extra_cores: 1,
        ..Default::default()
    });
    agent.tick();
    assert_eq!(
        agent.jobs()[&job.id].cpus,
        set("2-4,10-12"),
        "the guard's core cut the job"
    );
}
