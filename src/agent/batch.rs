//! Batch jobs (a user's CPU-only work lodger did not start: data preparation, feature
//! extraction; SODA §V-E's noisy neighbours): placed each tick on the cores training and online
//! inference leave, inside a Slurm job's own cpuset, cut when contention control halves their
//! cores, their threads SCHED_OTHER or SCHED_BATCH through a second enforcer. Inference
//! containers (Kubernetes pods that are their own instance) go through the same enforcer, on the
//! CPUs the inference plan gives them. Touches enforcement (through [`Enforce`]) and the jobs
//! lent by the tick.

use super::training::{at_rest, reap, record_outcome, release_quietly, Enforce, Enforced, Gone};
use super::TickCx;
use crate::cpuset::CpuSet;
use crate::enforce::network::node::CpuJob;
use crate::job::{JobId, JobKind, JobState, Target};
use crate::policy::batch::{self, BatchJobView, BatchPlan};
use crate::policy::contention::Throttles;
use crate::policy::inference::{training_cpus, InferencePlan};
use crate::policy::Placement;

/// Keeps batch jobs on the leftover cores, in their class.
pub(super) struct Batch {
    pub(super) enforcer: Box<dyn Enforce>,
    /// The last placement and what it was made from: `batch::place` is pure, so a tick with the
    /// same leftover cores and jobs takes it as it is (issue 21: placing 40 jobs on 192 CPUs
    /// every idle tick).
    placed: Option<(CpuSet, Vec<BatchJobView>, BatchPlan)>,
}

impl Batch {
    pub(super) fn new(enforcer: Box<dyn Enforce>) -> Self {
        Self {
            enforcer,
            placed: None,
        }
    }

    /// The cores batch jobs may use: the node's lendable ones, minus training's and online
    /// instances' cores (offline instances share them): `batch::leftover`.
    pub(super) fn leftover(cx: &TickCx<'_>) -> CpuSet {
        batch::leftover(
            cx.topology,
            &cx.closed_to_lodgers(),
            &training_cpus(&cx.state.plan),
            &cx.state.inference,
        )
    }

    /// Places every batch job and makes its processes match. Returns whether anything persisted
    /// changed, and the jobs that ended.
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>, throttles: &Throttles) -> (bool, Gone) {
        let leftover = Self::leftover(cx);
        let views: Vec<BatchJobView> = cx
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind == JobKind::Batch && !cx.slurm.waits(&s.job.id))
            .map(|s| {
                let own = (s.job.spec.cores > 0).then_some(s.job.spec.cores);
                let cut = throttles.cores.get(&s.job.id).copied();
                BatchJobView {
                    id: s.job.id.clone(),
                    within: cx.slurm.cpus(&s.job.id),
                    cap: match (own, cut) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    },
                }
            })
            .collect();
        let placed = match self.placed.take() {
            Some(last) if last.0 == leftover && last.1 == views => last,
            _ => {
                let plan = batch::place(cx.topology, &leftover, &views);
                (leftover, views, plan)
            }
        };
        let plan = &self.placed.insert(placed).2;
        let ids: Vec<JobId> = cx
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind == JobKind::Batch)
            .map(|s| s.job.id.clone())
            .collect();
        let mut dirty = false;
        let mut gone = Vec::new();
        for id in ids {
            let waiting = cx.slurm.waiting(&id);
            let Some(stored) = cx.state.jobs.get_mut(&id) else {
                continue;
            };
            if let (None, Some(Ok(p))) = (&waiting, plan.get(&id)) {
                if stored.record.memory_max == stored.job.spec.memory_max
                    && at_rest(&mut *self.enforcer, &id, stored, p)
                {
                    continue;
                }
            }
            let before = Enforced::of(stored);
            match (waiting, plan.get(&id)) {
                (Some(Ok(why)), _) => {
                    stored.job.state = JobState::Pending;
                    stored.job.last_error = Some(why);
                }
                (Some(Err(why)), _) => gone.push((id.clone(), why)),
                (None, Some(Ok(p))) => {
                    stored.job.cpus = p.cpus.clone();
                    stored.job.mems = p.mems.clone();
                    // Its own memory limit, for the cgroup lodger makes for it (issue 19).
                    stored.record.memory_max = stored.job.spec.memory_max;
                    let result =
                        self.enforcer
                            .apply(&id, &stored.job.spec.target, p, &mut stored.record);
                    if let Some(why) = record_outcome(stored, &id, result, true) {
                        gone.push((id.clone(), why));
                    }
                }
                (None, Some(Err(why))) => {
                    // Left where it runs, which may now be training's cores (training's
                    // SCHED_RR pre-empts it there): a known limit, docs/design.md.
                    stored.job.state = JobState::Error;
                    stored.job.last_error = Some(format!("not placed: {why}"));
                }
                (None, None) => {}
            }
            dirty |= before.settle(stored, &mut cx.events);
        }
        // Inference containers (docs/kubernetes.md): the pod is the instance, on the CPUs the
        // inference plan gives it, in the class of the jobs lodger did not start.
        let containers: Vec<JobId> = cx
            .state
            .jobs
            .values()
            .filter(|s| {
                s.job.spec.kind.is_inference() && matches!(s.job.spec.target, Target::Container(_))
            })
            .map(|s| s.job.id.clone())
            .collect();
        for id in containers {
            let placed = container_placement(&cx.state.inference, &id);
            let shortfall = cx.state.inference.shortfall.get(&id).map(|s| s.to_string());
            let Some(stored) = cx.state.jobs.get_mut(&id) else {
                continue;
            };
            let before = Enforced::of(stored);
            if let Some(p) = placed {
                stored.job.cpus = p.cpus.clone();
                stored.job.mems = p.mems.clone();
                let result =
                    self.enforcer
                        .apply(&id, &stored.job.spec.target, &p, &mut stored.record);
                if let Some(why) = record_outcome(stored, &id, result, true) {
                    gone.push((id.clone(), why));
                }
            } else {
                stored.job.state = JobState::Pending;
                stored.job.last_error = Some(format!(
                    "not placed: {}",
                    shortfall.unwrap_or_else(|| "no CPU is free for it".into())
                ));
            }
            dirty |= before.settle(stored, &mut cx.events);
        }
        (dirty, gone)
    }

    /// Forgets the batch jobs (and inference containers) that ended and gives their processes
    /// back. Returns whether any was.
    pub(super) fn reap(&mut self, cx: &mut TickCx<'_>, gone: Gone) -> bool {
        reap(&mut *self.enforcer, cx, gone)
    }

    pub(super) fn release_quietly(
        &mut self,
        id: &JobId,
        target: &Target,
        record: &crate::enforce::JobRecord,
    ) {
        release_quietly(&mut *self.enforcer, id, target, record);
    }

    /// Batch jobs' and inference containers' processes for network shaping: their traffic goes
    /// in the CPU jobs' class.
    pub(super) fn cpu_jobs(cx: &TickCx<'_>) -> Vec<CpuJob> {
        cx.state
            .jobs
            .values()
            .filter(|s| {
                s.job.spec.kind == JobKind::Batch
                    || (s.job.spec.kind.is_inference()
                        && matches!(s.job.spec.target, Target::Container(_)))
            })
            .map(|s| CpuJob {
                job: s.job.id.clone(),
                pids: s.job.pids.clone(),
                // Not lodger's to move out of their cgroup (v2): matched by their own cgroup.
                instances: false,
                cgroups: match &s.job.spec.target {
                    Target::Cgroup(c) => vec![c.clone()],
                    Target::Container(c) => vec![c.cgroup.clone()],
                    Target::Slurm(_) => cx
                        .slurm
                        .cgroup(&s.job.id)
                        .map(String::from)
                        .into_iter()
                        .collect(),
                    _ => s
                        .record
                        .pids
                        .as_ref()
                        .and_then(|p| p.cgroup.clone())
                        .into_iter()
                        .collect(),
                },
            })
            .collect()
    }
}

/// An inference container's CPUs and memory nodes: its instances' in the inference plan (one
/// online instance, or one offline instance per CPU); `None` when the plan gives it none.
fn container_placement(plan: &InferencePlan, id: &JobId) -> Option<Placement> {
    let instances = plan.online.get(id).or_else(|| plan.offline.get(id))?;
    let cpus = instances
        .values()
        .fold(CpuSet::new(), |acc, i| acc.union(&i.cpus));
    let mems = instances
        .values()
        .fold(CpuSet::new(), |acc, i| acc.union(&i.mems));
    (!cpus.is_empty()).then_some(Placement { cpus, mems })
}
