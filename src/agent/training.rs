//! Training placement: the [`Enforce`] seam and the controller that makes every training job's
//! processes match the plan each tick, and notices the jobs whose processes are gone. Touches
//! enforcement (through `Enforce`) and the jobs lent by the tick.

use tracing::{debug, info, warn};

use super::slurm::SlurmSeen;
use super::{Event, TickCx};
use crate::cpuset::CpuSet;
use crate::enforce::{CgroupJobRecord, EnforceError, JobRecord, Outcome, SlurmCgroup};
use crate::job::{JobId, JobState, Role, SlurmJob, Target};
use crate::policy::{Placement, TrainingJobView};
use crate::store::{State, StoredJob};
use crate::sys::cgroupfs::CgroupError;

/// What the agent needs from enforcement. [`crate::enforce::Enforcer`] is the real one;
/// [`crate::enforce::sim::SimulatedEnforcer`] records instead of touching the kernel (`--sim`).
pub trait Enforce: Send {
    /// Makes the job's processes match `placement`; idempotent. Sweeps for new threads.
    fn apply(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError>;
    /// Whether an `apply` now would change nothing and find an outcome of which `shows` is
    /// true (`enforce::quiet`), so the caller may leave the job as it is. False when unsure.
    fn settled(
        &mut self,
        _id: &JobId,
        _target: &Target,
        _placement: &Placement,
        _record: &JobRecord,
        _shows: &dyn Fn(&Outcome) -> bool,
    ) -> bool {
        false
    }
    /// Undoes everything `apply` did for the job, for whatever still exists.
    fn release(
        &mut self,
        id: &JobId,
        target: &Target,
        record: &JobRecord,
    ) -> Result<(), EnforceError>;
    /// One line for status: which cgroup mode and pinning method are in use.
    fn describe(&self) -> String;
    /// Removes what enforcement left that no job needs any more (lodger's empty parent cgroup).
    fn tidy(&mut self) {}
    /// Releases lodger's cgroups for jobs `known` does not know (see
    /// [`crate::enforce::Enforcer::release_orphans`]): each one's id and the outcome.
    fn release_orphans(
        &mut self,
        _known: &dyn Fn(&JobId) -> bool,
    ) -> Vec<(JobId, Result<(), EnforceError>)> {
        Vec::new()
    }
    /// A Slurm job's cgroup and cpuset, if it exists now (docs/slurm.md); an error when the
    /// cgroup is there but its cpuset cannot be read.
    fn find_slurm(
        &self,
        _job: &SlurmJob,
        _record: &JobRecord,
    ) -> Result<Option<SlurmCgroup>, CgroupError> {
        Ok(None)
    }
    /// A cgroup job's cpusets as they are now, before a registration writes any (see
    /// [`crate::enforce::Enforcer::cpusets_now`]); None for other targets.
    fn cpusets_now(&self, _target: &Target) -> Option<CgroupJobRecord> {
        None
    }
}

impl Enforce for crate::enforce::Enforcer {
    fn apply(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError> {
        crate::enforce::Enforcer::apply(self, id, target, &placement.cpus, &placement.mems, record)
    }

    fn release(
        &mut self,
        id: &JobId,
        target: &Target,
        record: &JobRecord,
    ) -> Result<(), EnforceError> {
        crate::enforce::Enforcer::release(self, id, target, record)
    }

    fn settled(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        record: &JobRecord,
        shows: &dyn Fn(&Outcome) -> bool,
    ) -> bool {
        crate::enforce::Enforcer::settled(
            self,
            id,
            target,
            &placement.cpus,
            &placement.mems,
            record,
            shows,
        )
    }

    fn describe(&self) -> String {
        self.mode().to_string()
    }

    fn tidy(&mut self) {
        crate::enforce::Enforcer::tidy(self)
    }

    fn release_orphans(
        &mut self,
        known: &dyn Fn(&JobId) -> bool,
    ) -> Vec<(JobId, Result<(), EnforceError>)> {
        crate::enforce::Enforcer::release_orphans(self, known)
    }

    fn find_slurm(
        &self,
        job: &SlurmJob,
        record: &JobRecord,
    ) -> Result<Option<SlurmCgroup>, CgroupError> {
        crate::enforce::Enforcer::find_slurm(self, job, record.slurm.as_ref())
    }

    fn cpusets_now(&self, target: &Target) -> Option<CgroupJobRecord> {
        match target {
            Target::Cgroup(path) => crate::enforce::Enforcer::cpusets_now(self, path),
            _ => None,
        }
    }
}

impl Enforce for crate::enforce::sim::SimulatedEnforcer {
    fn apply(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        _record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError> {
        self.observe_job(id, target, &placement.cpus, &placement.mems)
    }

    fn settled(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        _record: &JobRecord,
        shows: &dyn Fn(&Outcome) -> bool,
    ) -> bool {
        crate::enforce::sim::SimulatedEnforcer::settled(
            self,
            id,
            target,
            &placement.cpus,
            &placement.mems,
            shows,
        )
    }

    fn release(
        &mut self,
        id: &JobId,
        _target: &Target,
        _record: &JobRecord,
    ) -> Result<(), EnforceError> {
        self.forget(id);
        Ok(())
    }

    fn describe(&self) -> String {
        "simulated (nothing on the node is changed)".into()
    }
}

/// The training jobs as the placement policy sees them: their cores are the right-sizing tuner's
/// when it resizes (`rightsize_enforce == Some(true)`), else what they asked for, plus the RT
/// guard's headroom cores. A Slurm job is placed inside its cpuset, once its cgroup is seen.
pub(super) fn views(
    state: &State,
    rightsize_enforce: Option<bool>,
    slurm: &SlurmSeen,
) -> Vec<TrainingJobView> {
    state
        .jobs
        .values()
        .filter(|s| s.job.spec.kind.role() == Role::Training)
        .filter(|s| !slurm.waits(&s.job.id))
        .map(|s| {
            let within = slurm.cpus(&s.job.id);
            TrainingJobView {
                id: s.job.id.clone(),
                cores: view_cores(s, rightsize_enforce, within.as_ref()),
                gpus: s.job.spec.gpus.clone(),
                within,
            }
        })
        .collect()
}

/// The cores a training job is placed on: the tuner's or its own count (see [`views`]), its
/// whole cpuset for a Slurm job that asked for none (`within`), then the RT guard's extra
/// cores, never beyond that cpuset. The base is settled before the extra is added: a
/// whole-cpuset job's "0 + 1 core" is its cpuset, not one CPU.
pub(super) fn view_cores(
    s: &StoredJob,
    rightsize_enforce: Option<bool>,
    within: Option<&CpuSet>,
) -> u32 {
    let base = match (&s.tuning, rightsize_enforce) {
        (Some(t), Some(true)) => t.tuner.cores(),
        _ => s.job.spec.cores,
    };
    // The RT guard's extra cores keep a SCHED_RR job under the RT limit (agent::rtguard).
    let extra = s.job.rt.as_ref().map_or(0, |r| r.extra_cores);
    match within {
        // A Slurm job: its whole cpuset when it asked for none, never more.
        Some(w) => {
            let size = u32::try_from(w.len()).unwrap_or(u32::MAX);
            let base = if base == 0 { size } else { base.min(size) };
            base.saturating_add(extra).min(size)
        }
        None => base.saturating_add(extra),
    }
}

/// Whether the job is where `placement` puts it, shows what enforcement found at its last
/// sweep, and nothing happened to it since (`Enforce::settled`): an apply would change nothing
/// in it. The steady tick's path: no copy of the job to compare, no copy of the outcome
/// (issue 21).
pub(super) fn at_rest(
    enforcer: &mut dyn Enforce,
    id: &JobId,
    stored: &StoredJob,
    placement: &Placement,
) -> bool {
    let job = &stored.job;
    job.cpus == placement.cpus
        && job.mems == placement.mems
        && job.state == JobState::Running
        && job.last_error.is_none()
        && enforcer.settled(id, &job.spec.target, placement, &stored.record, &|o| {
            o.alive
                && o.waiting.is_none()
                && o.pids == job.pids
                && o.threads == job.threads
                && o.rr_threads == job.rr_threads
        })
}

/// Jobs whose processes are gone, with why; reaped at the end of the tick.
pub(super) type Gone = Vec<(JobId, String)>;

/// Keeps training jobs pinned where the plan puts them.
pub(super) struct Training {
    pub(super) enforcer: Box<dyn Enforce>,
}

impl Training {
    pub(super) fn new(enforcer: Box<dyn Enforce>) -> Self {
        Self { enforcer }
    }

    /// Makes every training job match `cx.state.plan`. Returns whether any job changed, and the
    /// jobs whose last process exited.
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>) -> (bool, Gone) {
        let ids: Vec<JobId> = cx.state.jobs.keys().cloned().collect();
        let mut dirty = false;
        let mut gone = Vec::new();
        let mut changed = Vec::new();
        for id in ids {
            let placement = cx.state.plan.training.get(&id);
            let Some(stored) = cx.state.jobs.get_mut(&id) else {
                continue;
            };
            if stored.job.spec.kind.is_lodger() {
                continue;
            }
            let waiting = cx.slurm.waiting(&id);
            if waiting.is_none()
                && placement.is_some_and(|p| at_rest(&mut *self.enforcer, &id, stored, p))
            {
                continue;
            }
            let before = Enforced::of(stored);
            if let Some(why) = waiting {
                // Registered by the prolog before the job's cgroup exists (docs/slurm.md).
                match why {
                    Ok(why) => {
                        stored.job.state = JobState::Pending;
                        stored.job.last_error = Some(why);
                    }
                    Err(why) => gone.push((id.clone(), why)),
                }
                dirty |= before.settle(stored, &mut changed);
                continue;
            }
            let result = match placement {
                Some(p) => {
                    stored.job.cpus = p.cpus.clone();
                    stored.job.mems = p.mems.clone();
                    self.enforcer
                        .apply(&id, &stored.job.spec.target, p, &mut stored.record)
                }
                None => {
                    let why = cx
                        .state
                        .plan
                        .unplaced
                        .get(&id)
                        .map(|n| n.to_string())
                        .unwrap_or_else(|| "no placement".into());
                    stored.job.state = JobState::Error;
                    stored.job.last_error = Some(format!("cannot place the job: {why}"));
                    Ok(Outcome {
                        alive: true,
                        ..Outcome::default()
                    })
                }
            };
            if let Some(why) = record_outcome(stored, &id, result, placement.is_some()) {
                gone.push((id.clone(), why));
            }
            dirty |= before.settle(stored, &mut changed);
        }
        cx.events.extend(changed);
        (dirty, gone)
    }

    /// Forgets the jobs whose processes are gone and releases what enforcement did for them.
    /// Returns whether any was reaped.
    pub(super) fn reap(&mut self, cx: &mut TickCx<'_>, gone: Gone) -> bool {
        reap(&mut *self.enforcer, cx, gone)
    }

    pub(super) fn release_quietly(&mut self, id: &JobId, target: &Target, record: &JobRecord) {
        release_quietly(&mut *self.enforcer, id, target, record);
    }
}

/// Releases what `enforcer` did for a job, logging what could not be undone.
pub(super) fn release_quietly(
    enforcer: &mut dyn Enforce,
    id: &JobId,
    target: &Target,
    record: &JobRecord,
) {
    if let Err(e) = enforcer.release(id, target, record) {
        warn!(job = %id, "cleanup incomplete: {e}");
    }
}

/// Forgets the jobs whose processes are gone and releases what `enforcer` did for them (training
/// jobs, or batch jobs with theirs). Returns whether any was reaped.
pub(super) fn reap(enforcer: &mut dyn Enforce, cx: &mut TickCx<'_>, gone: Gone) -> bool {
    let mut dirty = false;
    for (id, why) in gone {
        if let Some(stored) = cx.state.jobs.remove(&id) {
            release_quietly(enforcer, &id, &stored.job.spec.target, &stored.record);
            info!(job = %id, kind = stored.job.spec.kind.as_str(), cpus = %stored.job.cpus, "job ended ({why}); cores freed");
            cx.events
                .push(Event::JobChanged(id.clone(), JobState::Exited));
            cx.events.push(Event::JobRemoved(id));
            dirty = true;
        }
    }
    dirty
}

/// Shows what one `apply` found on the job. Returns why the job is over, if it is (its last
/// process exited, or its processes or cgroup are gone). `placed`: the job had a placement
/// this tick (without one its state was already set).
pub(super) fn record_outcome(
    stored: &mut StoredJob,
    id: &JobId,
    result: Result<Outcome, EnforceError>,
    placed: bool,
) -> Option<String> {
    match result {
        Ok(o) if !o.alive => Some("its last process exited".to_string()),
        Ok(o) => {
            stored.job.pids = o.pids;
            stored.job.threads = o.threads;
            stored.job.rr_threads = o.rr_threads;
            if let Some(why) = o.waiting {
                // A Slurm job's cgroup not there (gone since this tick looked, or never seen).
                stored.job.state = JobState::Pending;
                stored.job.last_error = Some(why);
            } else if placed {
                stored.job.state = JobState::Running;
                stored.job.last_error = None;
            }
            for w in o.warnings {
                debug!(job = %id, "{w}");
            }
            None
        }
        Err(e) if e.is_gone() => Some(e.to_string()),
        Err(e) => {
            if stored.job.last_error.as_deref() != Some(&e.to_string()) {
                warn!(job = %id, "enforcement failed: {e}");
            }
            stored.job.state = JobState::Error;
            stored.job.last_error = Some(e.to_string());
            None
        }
    }
}

/// What one pass of enforcement may change in a job (its state and error, placement,
/// processes and undo record), taken before the pass and compared after it. Cheaper than a copy
/// of the whole job (its spec, right-sizing and inference records): those copies were a tenth
/// of an idle 100-job tick (issue 21). Thread counts are left out: they are this pass's figures
/// (`lodgerctl show`), measured again next pass, and a change in them alone is not worth a write.
pub(super) struct Enforced {
    state: JobState,
    last_error: Option<String>,
    cpus: CpuSet,
    mems: CpuSet,
    pids: Vec<u32>,
    record: JobRecord,
}

impl Enforced {
    pub(super) fn of(s: &StoredJob) -> Self {
        Self {
            state: s.job.state,
            last_error: s.job.last_error.clone(),
            cpus: s.job.cpus.clone(),
            mems: s.job.mems.clone(),
            pids: s.job.pids.clone(),
            record: s.record.clone(),
        }
    }

    /// Whether the pass changed what the state file holds of the job; a change of its state is
    /// also an event.
    pub(super) fn settle(&self, after: &StoredJob, events: &mut Vec<Event>) -> bool {
        let job = &after.job;
        if job.state != self.state {
            events.push(Event::JobChanged(job.id.clone(), job.state));
        }
        job.state != self.state
            || job.last_error != self.last_error
            || job.cpus != self.cpus
            || job.mems != self.mems
            || job.pids != self.pids
            || after.record != self.record
    }
}
