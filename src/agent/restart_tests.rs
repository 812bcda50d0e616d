//! The agent across its own restarts: registrations interrupted or answered before their save,
//! state files set aside, saves that fail. A fake node, and one real cgroup v1 test (root).

use super::tests::{spec, Rig};
use crate::cpuset::CpuSet;
use crate::job::{JobId, Target};
use crate::policy::Placement;
use crate::store::Store;

/// Issue 17: lodgerd killed between a training registration's first change to the node and
/// the state file that records it leaves `registering.json`; the next start takes the processes
/// over once more and releases them, records nothing, and never gives the id to another job.
#[test]
fn a_registration_interrupted_by_a_crash_is_undone_at_the_next_start() {
    let rig = Rig::new();
    rig.spawn(100);
    let store = Store::new(rig.dir.path());
    let id = JobId::from_seq(1);
    store
        .write_pending(&crate::store::Pending {
            id: id.clone(),
            target: Target::Pids(vec![100]),
            placement: Placement {
                cpus: CpuSet::parse("1").unwrap(),
                mems: CpuSet::parse("0").unwrap(),
            },
            job: None,
            authorized: vec![crate::enforce::RootProcess {
                pid: 100,
                start_time: 4242,
            }],
            cpusets: None,
        })
        .unwrap();
    let mut agent = rig.agent();
    assert!(agent.jobs().is_empty(), "nothing recorded");
    {
        let node = rig.node.lock().unwrap();
        assert_eq!(
            node.authorized.get(&id),
            Some(&vec![(100, 4242)]),
            "undone on the processes the registration was checked on only"
        );
        assert!(node.released.contains(&id), "released: {:?}", node.released);
        assert!(!node.applied.contains_key(&id), "still applied");
    }
    assert!(!rig.dir.path().join(crate::store::PENDING_FILE).exists());
    let job = agent.register(spec(vec![100], 1), 0).unwrap();
    assert_eq!(
        job.id.as_str(),
        "j2",
        "the interrupted registration's id is not reused"
    );
    // A completed registration leaves no pending file behind.
    assert!(!rig.dir.path().join(crate::store::PENDING_FILE).exists());
}

/// The ids in the rig's state file (none when there is no file).
fn saved_jobs(rig: &Rig) -> Vec<JobId> {
    match std::fs::read_to_string(rig.dir.path().join(crate::store::STATE_FILE)) {
        Ok(text) => crate::store::parse(&text)
            .unwrap()
            .state
            .jobs
            .into_keys()
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Issue 21: a training registration is answered once the pending file holds the job, before
/// the state file is saved. lodgerd killed in between: the next start records the job from the
/// pending file, as the caller was told, keeps its placement and leaves it enforced.
#[test]
fn a_registration_answered_before_its_save_is_recorded_at_the_next_start() {
    let rig = Rig::new();
    rig.spawn(100);
    let mut agent = rig.agent();
    let job = agent.register_unsaved(spec(vec![100], 1), 0).unwrap();
    let pending = rig.dir.path().join(crate::store::PENDING_FILE);
    assert!(pending.exists(), "the answered job is in the pending file");
    assert!(
        !saved_jobs(&rig).contains(&job.id),
        "the state file is not written before the answer"
    );
    // Killed before `save_answered`: nothing of the agent runs again.
    std::mem::forget(agent);
    let agent = rig.agent();
    let jobs = agent.jobs();
    let again = jobs.get(&job.id).expect("the answered job is recorded");
    assert_eq!(again.cpus, job.cpus, "its placement is kept");
    assert!(!pending.exists(), "the pending file is superseded");
    {
        let node = rig.node.lock().unwrap();
        assert!(
            !node.released.contains(&job.id),
            "released: {:?}",
            node.released
        );
        assert!(node.applied.contains_key(&job.id), "not enforced");
    }
    let mut agent = agent;
    rig.spawn(101);
    let next = agent.register(spec(vec![101], 1), 0).unwrap();
    assert_eq!(
        next.id.as_str(),
        "j2",
        "the recorded job's id is not reused"
    );
}

/// The answered record survives a start whose save fails: it is written back, and the first
/// tick that can save removes it.
#[test]
fn an_answered_record_is_kept_until_a_save_succeeds() {
    let rig = Rig::new();
    rig.spawn(100);
    let mut agent = rig.agent();
    let job = agent.register_unsaved(spec(vec![100], 1), 0).unwrap();
    std::mem::forget(agent);
    // The state file's temporary name taken by a directory: every save fails, even as root.
    let blocker = rig
        .dir
        .path()
        .join(format!(".{}.tmp", crate::store::STATE_FILE));
    std::fs::create_dir(&blocker).unwrap();
    let mut agent = rig.agent();
    assert!(agent.jobs().contains_key(&job.id), "recorded in memory");
    let pending = rig.dir.path().join(crate::store::PENDING_FILE);
    assert!(pending.exists(), "written back while no save succeeds");
    std::fs::remove_dir(&blocker).unwrap();
    agent.tick();
    assert!(!pending.exists(), "superseded by the tick's save");
    assert!(
        saved_jobs(&rig).contains(&job.id),
        "the state file lists the job"
    );
}

/// A state file set aside (here unreadable) leaves its jobs enforced with nobody to own them:
/// the next lodgerd releases them before its first tick, and gives no new job an id they had
/// (whose processes a new job of that id would otherwise adopt).
#[test]
fn jobs_a_set_aside_state_file_held_are_released_and_their_ids_not_reused() {
    let rig = Rig::new();
    rig.spawn(100);
    rig.spawn(200);
    let mut agent = rig.agent();
    let old = agent.register(spec(vec![100], 1), 0).unwrap();
    std::mem::forget(agent);
    let state = rig.dir.path().join(crate::store::STATE_FILE);
    std::fs::write(&state, b"{ not json").unwrap();
    let mut agent = rig.agent();
    assert!(agent.jobs().is_empty());
    assert!(rig.node.lock().unwrap().released.contains(&old.id));
    let new = agent.register(spec(vec![200], 1), 0).unwrap();
    assert_ne!(new.id, old.id);
    assert!(new.id.seq() > old.id.seq(), "{} after {}", new.id, old.id);
}

/// An unregistration whose save fails is done all the same (the job was released): the job is
/// gone from memory at once, and the state file catches up at the first tick a save succeeds,
/// though nothing else changed.
#[test]
fn an_unregistration_whose_save_fails_is_saved_at_the_next_tick() {
    let rig = Rig::new();
    rig.spawn(100);
    let mut agent = rig.agent();
    let job = agent.register(spec(vec![100], 1), 0).unwrap();
    agent.tick();
    let blocker = rig
        .dir
        .path()
        .join(format!(".{}.tmp", crate::store::STATE_FILE));
    std::fs::create_dir(&blocker).unwrap();
    agent.unregister(job.id.as_str()).expect("released: done");
    assert!(!agent.jobs().contains_key(&job.id), "gone from memory");
    assert!(rig.node.lock().unwrap().released.contains(&job.id));
    assert!(saved_jobs(&rig).contains(&job.id), "the save failed");
    agent.tick();
    assert!(saved_jobs(&rig).contains(&job.id), "still blocked");
    std::fs::remove_dir(&blocker).unwrap();
    agent.tick();
    assert!(
        !saved_jobs(&rig).contains(&job.id),
        "the tick saved the unregistration"
    );
}

/// The state file is saved after the answer: once it is, it lists the job and no pending file
/// is left.
#[test]
fn the_answered_registration_is_saved_after_the_answer() {
    let rig = Rig::new();
    rig.spawn(100);
    let mut agent = rig.agent();
    let job = agent.register_unsaved(spec(vec![100], 1), 0).unwrap();
    agent.save_answered().unwrap();
    let pending = rig.dir.path().join(crate::store::PENDING_FILE);
    assert!(!pending.exists(), "superseded by the saved state file");
    assert!(
        saved_jobs(&rig).contains(&job.id),
        "the state file lists the job"
    );
}

/// An interrupted registration of a cgroup job, on real cgroup v1 (root): the killed lodgerd
/// had already written the job's cpuset and widened its parent. The undo at the next start
/// restores both to what they were before the registration (the pending file's `cpusets`), not
/// to what the killed lodgerd wrote, and leaves the job's thread SCHED_OTHER.
#[test]
fn an_interrupted_cgroup_registration_gives_the_cgroup_back_its_cpusets() {
    use crate::enforce::{EnforceSettings, Enforcer};
    use crate::privileged::{need_cgroup_v1, need_cpus, need_root};
    use std::path::Path;
    let name = "an_interrupted_cgroup_registration_gives_the_cgroup_back_its_cpusets";
    if !need_root(name) || !need_cgroup_v1(name) || !need_cpus(name, 2) {
        return;
    }
    /// The test's cgroups and process, removed and killed however the test ends.
    struct Cleanup(std::path::PathBuf, std::process::Child);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = self.1.kill();
            let _ = self.1.wait();
            let _ = std::fs::remove_dir(self.0.join("job"));
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let top = format!("lodger-test-{}-undo-cgroup", std::process::id());
    let root = Path::new("/sys/fs/cgroup/cpuset");
    let make = |rel: &str| {
        let dir = root.join(rel);
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join("cpuset.mems"), "0").expect("mems");
        std::fs::write(dir.join("cpuset.cpus"), "0").expect("cpus");
        dir
    };
    let top_dir = make(&top);
    let sleeper = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("sleep");
    let cleanup = Cleanup(top_dir.clone(), sleeper);
    let job_dir = make(&format!("{top}/job"));
    std::fs::write(job_dir.join("cgroup.procs"), cleanup.1.id().to_string()).expect("attach");
    let read = |dir: &Path| {
        std::fs::read_to_string(dir.join("cpuset.cpus"))
            .expect("cpuset.cpus")
            .trim()
            .to_string()
    };
    let enforcer = || {
        Enforcer::new(EnforceSettings {
            parent: format!("lodger-test-{}-undo-parent", std::process::id()),
            rt_priority: 7,
            ..EnforceSettings::default()
        })
        .expect("enforcer")
    };

    // The killed lodgerd: the pending file written (with the cpusets as they were), then its
    // first writes; the record that held what to restore died with it.
    let id = JobId::from_seq(1);
    let target = Target::Cgroup(format!("/{top}/job"));
    let placement = Placement {
        cpus: CpuSet::parse("1").unwrap(),
        mems: CpuSet::parse("0").unwrap(),
    };
    let first = enforcer();
    let rig = Rig::new();
    Store::new(rig.dir.path())
        .write_pending(&crate::store::Pending {
            id: id.clone(),
            target: target.clone(),
            placement: placement.clone(),
            job: None,
            authorized: Vec::new(),
            cpusets: first.cpusets_now(&format!("/{top}/job")),
        })
        .unwrap();
    first
        .apply(
            &id,
            &target,
            &placement.cpus,
            &placement.mems,
            &mut crate::enforce::JobRecord::default(),
        )
        .expect("apply");
    assert_eq!(read(&job_dir), "1");
    assert_eq!(read(&top_dir), "0-1", "the parent widened");
    drop(first);

    let agent = rig.builder_with(Box::new(enforcer())).start().unwrap();
    assert!(agent.jobs().is_empty(), "nothing recorded");
    assert_eq!(
        read(&job_dir),
        "0",
        "the job's cgroup as before the registration"
    );
    assert_eq!(read(&top_dir), "0", "the parent as before the registration");
    let pid = cleanup.1.id();
    assert_eq!(
        crate::enforce::sched::policy_of(pid)
            .ok()
            .map(|(policy, _)| policy),
        Some(libc::SCHED_OTHER),
        "thread {pid} back to SCHED_OTHER"
    );
}
