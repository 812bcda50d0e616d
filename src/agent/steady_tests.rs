//! The steady tick (issue 21): a job that enforcement says is settled, and that shows what
//! enforcement found, is left as it is without an apply; a change on either side applies it
//! again, and the job shows the new outcome.

use super::tests::{spec, Rig};
use crate::enforce::EnforceError;
use crate::job::JobState;

#[test]
fn a_settled_job_is_not_applied_again_until_something_changes() {
    let rig = Rig::new();
    rig.spawn(100);
    rig.spawn(101);
    rig.node.lock().unwrap().quiet = true;
    let mut agent = rig.agent();
    let job = agent.register(spec(vec![100, 101], 2), 0).unwrap();
    let applies = || rig.node.lock().unwrap().applies;
    agent.tick();
    let settled = applies();
    for _ in 0..3 {
        agent.tick();
    }
    assert_eq!(applies(), settled, "a settled job is left as it is");
    let shown = &agent.jobs()[&job.id];
    assert_eq!(shown.state, JobState::Running);
    assert_eq!(shown.pids, [100, 101]);

    // A process exits: enforcement is no longer settled; the job is applied and shows it.
    rig.kill(101);
    agent.tick();
    assert_eq!(applies(), settled + 1);
    assert_eq!(agent.jobs()[&job.id].pids, [100]);
    agent.tick();
    assert_eq!(applies(), settled + 1, "settled again");

    // An apply that fails leaves the job in error: though enforcement is settled, the job does
    // not show a clean outcome, so the next tick applies it again and it recovers.
    rig.node.lock().unwrap().quiet = false;
    rig.node.lock().unwrap().fail_next_apply = Some(EnforceError::EmptyPlacement);
    agent.tick();
    assert_eq!(agent.jobs()[&job.id].state, JobState::Error);
    rig.node.lock().unwrap().quiet = true;
    let failed = applies();
    agent.tick();
    assert_eq!(applies(), failed + 1, "a job in error is applied");
    assert_eq!(agent.jobs()[&job.id].state, JobState::Running);
    agent.tick();
    assert_eq!(applies(), failed + 1);

    // Without settling (no process events): every tick applies, as before.
    rig.node.lock().unwrap().quiet = false;
    agent.tick();
    agent.tick();
    assert_eq!(applies(), failed + 3);
}
