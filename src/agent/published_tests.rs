//! The read-only calls answer from the published snapshot while the loop is stuck in
//! enforcement (issue: never block the control surface); what a command's answer carries and
//! what follows it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

use super::tests::Rig;
use super::{Agent, AgentError, AgentSettings, Caller, Enforce, RightsizeSettings};
use crate::cpuset::CpuSet;
use crate::enforce::{EnforceError, JobRecord, Outcome};
use crate::job::{JobId, JobKind, JobSpec, Target};
use crate::policy::Placement;
use crate::store::Store;
use crate::topology::Topology;

/// Guards against a hang only (a read that waits on the stuck tick would never return); no
/// assertion is about time.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// An enforcer whose `apply` can be made to stop until released, the way a cgroup write on a
/// stuck cgroupfs or an instance ignoring SIGTERM once held the loop.
#[derive(Clone)]
struct Stalling {
    hold: Arc<(Mutex<bool>, Condvar)>,
    entered: Arc<Mutex<Option<mpsc::Sender<()>>>>,
    returned: Arc<AtomicBool>,
}

impl Stalling {
    fn release(&self) {
        let (lock, cv) = &*self.hold;
        *lock.lock().expect("hold") = false;
        cv.notify_all();
    }
}

impl Enforce for Stalling {
    fn apply(
        &mut self,
        _id: &JobId,
        target: &Target,
        _placement: &Placement,
        _record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError> {
        let (lock, cv) = &*self.hold;
        let mut held = lock.lock().expect("hold");
        if *held {
            self.returned.store(false, Ordering::SeqCst);
            if let Some(tx) = self.entered.lock().expect("entered").take() {
                let _ = tx.send(());
            }
            while *held {
                held = cv.wait(held).expect("hold");
            }
            self.returned.store(true, Ordering::SeqCst);
        }
        let pids = match target {
            Target::Pids(p) => p.clone(),
            _ => vec![1],
        };
        Ok(Outcome {
            alive: true,
            threads: 1,
            rr_threads: 1,
            pids,
            ..Outcome::default()
        })
    }

    fn release(
        &mut self,
        _id: &JobId,
        _target: &Target,
        _record: &JobRecord,
    ) -> Result<(), EnforceError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "stalling".into()
    }
}

#[test]
fn status_list_and_show_answer_while_a_tick_is_stuck_in_enforcement() {
    let dir = tempfile::tempdir().expect("tempdir");
    let proc_root = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(proc_root.path().join("100")).expect("pid dir");
    let (entered_tx, entered_rx) = mpsc::channel();
    let enforcer = Stalling {
        hold: Arc::new((Mutex::new(false), Condvar::new())),
        entered: Arc::new(Mutex::new(Some(entered_tx))),
        returned: Arc::new(AtomicBool::new(true)),
    };
    let settings = AgentSettings {
        interval: Duration::from_millis(20),
        rt_priority: 10,
        proc_root: proc_root.path().to_path_buf(),
        rightsize: RightsizeSettings::default(),
        contention: None,
        rt_headroom_percent: None,
        trust: Default::default(),
        slurm_appear_timeout: Duration::from_secs(600),
        lendable: None,
        training_core_batch_ms: 100,
    };
    let mut agent = Agent::builder(
        settings,
        Topology::synthetic(1, 1, 4, 1, 0),
        CpuSet::parse("0").expect("cpus"),
        Box::new(enforcer.clone()),
        Store::new(dir.path()),
    )
    .start()
    .expect("agent");
    let job = agent
        .register(
            JobSpec {
                name: Some("stuck".into()),
                ..JobSpec::new(JobKind::Training, Target::Pids(vec![100]), 2)
            },
            0,
        )
        .expect("registered");
    let (handle, join) = agent.spawn().expect("agent thread");
    *enforcer.hold.0.lock().expect("hold") = true;
    entered_rx
        .recv_timeout(HANG_GUARD)
        .expect("the next tick reaches apply");

    // The loop is now inside `apply` and stays there until released.
    let reader = handle.clone();
    let id = job.id.to_string();
    let (answers_tx, answers_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let answers = rt.block_on(async {
            (
                reader.status().await,
                reader.list().await,
                reader.get(&id).await,
                reader.snapshot().await,
                reader.get("j999").await,
            )
        });
        let _ = answers_tx.send(answers);
    });
    let answers = answers_rx.recv_timeout(HANG_GUARD);
    let stuck_meanwhile = !enforcer.returned.load(Ordering::SeqCst);
    enforcer.release();
    let (status, list, show, snapshot, missing) =
        answers.expect("read-only calls answered while the tick was stuck");
    assert!(
        stuck_meanwhile,
        "the tick returned before the reads were answered"
    );
    let status = status.expect("status");
    assert_eq!(status.jobs, 1);
    assert_eq!(status.training, job.cpus);
    let list = list.expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].id, job.id);
    assert_eq!(show.expect("show").cpus, job.cpus);
    assert_eq!(snapshot.expect("snapshot").jobs.len(), 1);
    assert!(matches!(missing, Err(super::AgentError::NotFound(_))));

    handle.stop();
    join.join().expect("agent thread");
}

/// A registration's spec is checked before the caller's rights to what it names: a member's
/// list of more pids than a job may have (here pid 1, which nobody may register, 5,000 times) is
/// refused as too many at once, without a look at any of them.
#[test]
fn a_registration_too_large_is_refused_before_its_pids_are_looked_at() {
    let rig = Rig::new();
    let agent = rig.agent();
    let (handle, join) = agent.spawn().expect("agent thread");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let many = JobSpec::new(JobKind::Batch, Target::Pids(vec![1; 5000]), 0);
    let answer = rt.block_on(handle.register(many, None, Caller::uid(1000)));
    match answer {
        Err(AgentError::InvalidSpec(why)) => assert!(why.contains("too many pids"), "{why}"),
        other => panic!("expected too many pids, got {other:?}"),
    }
    let few = JobSpec::new(JobKind::Batch, Target::Pids(vec![1]), 0);
    let answer = rt.block_on(handle.register(few, None, Caller::uid(1000)));
    assert!(
        matches!(answer, Err(AgentError::AccessDenied(_))),
        "{answer:?}"
    );
    handle.stop();
    join.join().expect("agent thread ends");
}

/// A training job registered through the loop is announced (`JobAdded`, once) after its caller
/// is answered, no longer before (issue 21 item 1: the announcement woke other threads on
/// lodgerd's CPU ahead of the answer); a refused registration announces nothing.
#[test]
fn a_registered_training_job_is_announced_once_after_the_answer() {
    let rig = Rig::new();
    rig.spawn(100);
    let agent = rig.agent();
    let (handle, join) = agent.spawn().expect("agent thread");
    let mut events = handle.subscribe();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let training = |pids| JobSpec::new(JobKind::Training, Target::Pids(pids), 1);
    let job = rt
        .block_on(handle.register(training(vec![100]), None, Caller::uid(0)))
        .expect("registered");
    let again = rt.block_on(handle.register(training(vec![100]), None, Caller::uid(0)));
    assert!(matches!(again, Err(AgentError::Conflict(_))), "{again:?}");
    handle.stop();
    join.join().expect("agent thread ends");
    let mut added = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let super::Event::JobAdded(id) = event {
            added.push(id);
        }
    }
    assert_eq!(added, vec![job.id]);
}
