//! Right-sizing of training jobs (SODA §V-B): a tuner per job, fed each new GPU utilization
//! sample; its state lives in `StoredJob::tuning` and the owners' history in `State`. Touches
//! only the jobs and observations lent by the tick.

use std::fmt::{self, Write as _};

use tracing::{debug, info};

use super::{RightsizeSettings, TickCx};
use crate::clock::wall_clock;
use crate::cpuset::CpuSet;
use crate::job::{Job, JobId, TuningView};
use crate::policy::rightsize::{
    self, CoreLimits, StartHints, Tuner, TunerAction, TunerSettings, MAX_EXTENSIONS,
};
use crate::policy::Plan;
use crate::store::{State, Tuning};
use crate::topology::Topology;

pub(super) struct Rightsize {
    settings: RightsizeSettings,
    /// A job's right-sizing in words, built here before it is compared with the job's.
    text: String,
}

/// Whether `text` reads as `value` displays, without building the string.
fn displays_as(text: &str, value: &impl fmt::Display) -> bool {
    struct Match<'a> {
        rest: &'a str,
        same: bool,
    }
    impl fmt::Write for Match<'_> {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            match self.rest.strip_prefix(s) {
                Some(rest) if self.same => self.rest = rest,
                _ => self.same = false,
            }
            Ok(())
        }
    }
    let mut m = Match {
        rest: text,
        same: true,
    };
    let _ = write!(m, "{value}");
    m.same && m.rest.is_empty()
}

impl Rightsize {
    pub(super) fn new(settings: RightsizeSettings) -> Self {
        Self {
            settings,
            text: String::new(),
        }
    }

    /// None: off. Some(true): resize; Some(false): advise only.
    pub(super) fn enforce(&self) -> Option<bool> {
        self.settings.enforce
    }

    /// A tuner for a new training job (SODA §V-B-1 start point), unless right-sizing is off or
    /// the job opted out. `plan` is the plan the job is placed in; `cap` the most cores it may
    /// ever have (a Slurm job's cpuset).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_tuning(
        &self,
        id: &JobId,
        job: &Job,
        plan: &Plan,
        state: &State,
        topology: &Topology,
        reserved: &CpuSet,
        cap: Option<u32>,
    ) -> Option<Tuning> {
        let rs = &self.settings;
        rs.enforce?;
        if !job.spec.rightsize {
            return None;
        }
        let others: CpuSet = plan
            .training
            .iter()
            .filter(|(jid, _)| *jid != id)
            .fold(CpuSet::new(), |acc, (_, p)| acc.union(&p.cpus));
        let could_have = topology
            .online()
            .difference(reserved)
            .difference(&others)
            .len();
        let gpus = u32::try_from(job.spec.gpus.len()).unwrap_or(u32::MAX);
        let could_have = u32::try_from(could_have).unwrap_or(u32::MAX);
        let limits = CoreLimits {
            floor: rightsize::default_floor(gpus, job.spec.cores, rs.shrink),
            // A Slurm job never beyond the cpuset Slurm gave it.
            max: cap.map_or(could_have, |c| c.min(could_have)),
        };
        let start = rightsize::start_cores(
            &state.owner_history,
            job.owner_uid,
            job.spec.category,
            job.spec.cores,
            gpus,
            StartHints {
                pipelined_loader: job.spec.pipeline,
                ..StartHints::default()
            },
            limits,
        );
        let settings = TunerSettings {
            warmup: rs.warmup,
            window: rs.window,
            tolerance: rs.tolerance,
            min_change: rs.min_change,
            from_history: state
                .owner_history
                .largest_per_gpu(job.owner_uid, job.spec.category)
                .is_some(),
            gpus,
            ..TunerSettings::new(start, limits)
        };
        Some(Tuning {
            tuner: Tuner::new(settings, wall_clock()),
            last_sample_ms: 0,
            recorded: false,
        })
    }

    /// Gives a Slurm training job its tuner once it is first placed (its core count is known
    /// only then: the cpuset Slurm gave it), never to grow beyond that cpuset. Returns whether
    /// any job got one.
    pub(super) fn adopt_slurm(&self, cx: &mut TickCx<'_>) -> bool {
        let mut changed = false;
        let ids: Vec<JobId> = cx
            .state
            .jobs
            .values()
            .filter(|s| {
                s.tuning.is_none()
                    && s.job.spec.kind == crate::job::JobKind::Training
                    && matches!(s.job.spec.target, crate::job::Target::Slurm(_))
                    && s.job.state == crate::job::JobState::Running
                    && !s.job.cpus.is_empty()
            })
            .map(|s| s.job.id.clone())
            .collect();
        for id in ids {
            let Some(stored) = cx.state.jobs.get(&id) else {
                continue;
            };
            let mut job = stored.job.clone();
            let placed = u32::try_from(job.cpus.len()).unwrap_or(u32::MAX);
            job.spec.cores = placed;
            let cap = cx
                .slurm
                .cpus(&id)
                .map(|c| u32::try_from(c.len()).unwrap_or(u32::MAX));
            let tuning = self.new_tuning(
                &id,
                &job,
                &cx.state.plan,
                cx.state,
                cx.topology,
                cx.reserved,
                cap,
            );
            if let (Some(t), Some(stored)) = (tuning, cx.state.jobs.get_mut(&id)) {
                // From SODA's start point, as any training job's tuner (§V-B-1).
                stored.tuning = Some(t);
                changed = true;
            }
        }
        changed
    }

    /// Tells each searching tuner the most cores its job can have in the plan now: its own CPUs
    /// and the free ones (online, not reserved, no other training job's), within a Slurm job's
    /// cpuset (`Tuner::limit_max`). Called before the tuners step, so no probe is sized beyond
    /// them, and after each decide, so a probe the plan could not give in full is measured at
    /// what it got. Returns whether any tuner changed.
    pub(super) fn limit_to_plan(&self, cx: &mut TickCx<'_>) -> bool {
        if self.settings.enforce != Some(true) {
            return false;
        }
        let state = &mut *cx.state;
        let searching =
            |t: &Option<Tuning>| t.as_ref().is_some_and(|t| t.tuner.settled().is_none());
        if !state.jobs.values().any(|s| searching(&s.tuning)) {
            return false;
        }
        let now = wall_clock();
        let free = state
            .plan
            .training
            .values()
            .fold(cx.topology.online().difference(cx.reserved), |free, p| {
                free.difference(&p.cpus)
            });
        let mut changed = false;
        for stored in state.jobs.values_mut() {
            if !searching(&stored.tuning) {
                continue;
            }
            let own = state.plan.training.get(&stored.job.id).map(|p| &p.cpus);
            let could_have = match cx.slurm.cpus(&stored.job.id) {
                Some(w) => {
                    free.intersection(&w).len() + own.map_or(0, |o| o.intersection(&w).len())
                }
                None => free.len() + own.map_or(0, CpuSet::len),
            };
            if let Some(t) = &mut stored.tuning {
                let n = u32::try_from(could_have).unwrap_or(u32::MAX);
                changed |= t.tuner.limit_max(n, now);
            }
        }
        changed
    }

    /// Feeds each right-sized training job's newest GPU utilization sample to its tuner
    /// (SODA §V-B-2). `throttled`: a contention throttle is active on the node (handed over by
    /// the contention controller). Returns whether any tuner changed what the state file holds.
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>, throttled: bool) -> bool {
        let Some(enforce) = self.settings.enforce else {
            return false;
        };
        let mut changed = self.limit_to_plan(cx);
        let now = wall_clock();
        let obs = cx.observations;
        // Issue 16: while GPU utilization (the tuner's one input) is stale, every search holds
        // where it is instead of judging a window on old or missing figures.
        if obs.is_stale("gpu") {
            return changed;
        }
        let state = &mut *cx.state;
        for stored in state.jobs.values_mut() {
            let Some(tuning) = &mut stored.tuning else {
                continue;
            };
            // A copy to tell whether the step changed what is written, only where it may have.
            let was_settled = tuning.tuner.settled();
            let before = (!tuning.tuner.step_keeps_disk(now, throttled)
                || (was_settled.is_some() && !tuning.recorded))
                .then(|| tuning.clone());
            let mut samples = Vec::new();
            if obs.unix_ms > tuning.last_sample_ms {
                if let Some(gpu) = obs.jobs.get(&stored.job.id).and_then(|m| m.gpu_percent) {
                    samples.push(gpu);
                }
                tuning.last_sample_ms = obs.unix_ms;
            }
            if !enforce {
                // Probing needs the job at the probed count: without resizing every window would
                // measure the same count and look like "no change". Advise mode reports the
                // SODA §V-B-1 start point, the one recommendation lodger can make honestly.
                stored.job.rightsize = Some(format!(
                    "advise: start at {} cores (SODA start point; probing needs rightsize.mode = \"enforce\")",
                    tuning.tuner.settings().start
                ));
                continue;
            }
            let action = tuning.tuner.step(now, &samples, throttled);
            if let TunerAction::Settle(n) = action {
                if !tuning.recorded {
                    let gpus = u32::try_from(stored.job.spec.gpus.len()).unwrap_or(u32::MAX);
                    state.owner_history.record(
                        stored.job.owner_uid,
                        stored.job.spec.category,
                        n,
                        gpus,
                    );
                    tuning.recorded = true;
                    info!(job = %stored.job.id, cores = n, probes = tuning.tuner.probes(), "right-sizing settled");
                }
            }
            if let TunerAction::Resize(n) = action {
                if Some(n) != was_settled {
                    debug!(job = %stored.job.id, cores = n, "right-sizing probe");
                }
            }
            let cores = tuning.tuner.cores();
            // Written into a kept buffer and copied only when the words change: a string and a
            // probe list built for every training job every tick were a tenth of an idle tick
            // (issue 21).
            let text = &mut self.text;
            text.clear();
            let probes = tuning.tuner.probes();
            let _ = match (tuning.tuner.settled(), action, enforce) {
                (Some(n), _, true) => write!(text, "settled at {n} cores after {probes} probes"),
                (Some(n), _, false) => write!(
                    text,
                    "advise: {n} cores (settled after {probes} probes; not applied)"
                ),
                (None, TunerAction::Hold(why), _) if obs.sources.gpu.starts_with("unavailable") => {
                    write!(
                        text,
                        "not tuned, at {cores} cores: no GPU utilization can be attributed to \
                         this job (GPU sensing {}); {why}",
                        obs.sources.gpu
                    )
                }
                (None, TunerAction::Hold(why), _) => {
                    write!(text, "at {cores} cores, not measuring: {why}")
                }
                (None, _, true) => match tuning.tuner.extended() {
                    0 => write!(text, "tuning: at {cores} cores, {probes} probes so far"),
                    n => write!(
                        text,
                        "tuning: at {cores} cores, {probes} probes so far; window measured on \
                         ({n} of at most {MAX_EXTENSIONS}): too noisy to judge, or near the knee"
                    ),
                },
                (None, _, false) => write!(text, "advise: tuning, would run {cores} cores"),
            };
            if stored.job.rightsize.as_deref() != Some(text.as_str()) {
                stored.job.rightsize = Some(text.clone());
            }
            let history = tuning.tuner.history();
            let shown = stored.job.tuning.len() == history.len()
                && stored.job.tuning.iter().zip(history).all(|(v, p)| {
                    v.cores == p.cores
                        && v.gpu_percent == p.mean_util
                        && v.noise == p.noise
                        && displays_as(&v.decision, &p.decision)
                });
            if !shown {
                stored.job.tuning = history
                    .iter()
                    .map(|p| TuningView {
                        cores: p.cores,
                        gpu_percent: p.mean_util,
                        noise: p.noise,
                        decision: p.decision.to_string(),
                    })
                    .collect();
            }
            // Samples within a window and their times stay in memory: only a decision (a
            // window begun or judged, a probe, settling) is worth a write.
            changed |= before.is_some_and(|b| !tuning.same_on_disk(&b));
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::displays_as;

    #[test]
    fn displays_as_compares_without_building_the_text() {
        assert!(displays_as("42 cores", &format_args!("{} cores", 42)));
        assert!(!displays_as("42 cores", &format_args!("{} cores", 4)));
        assert!(!displays_as("4 cores", &format_args!("{} cores", 42)));
        assert!(!displays_as(
            "42 cores and more",
            &format_args!("{} cores", 42)
        ));
        assert!(displays_as("", &""));
    }
}
