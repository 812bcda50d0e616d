//! SODA §V-E's contention eliminator: the state machine that escalates throttle steps under
//! pressure and gives them back after calm. Pure: observations and the time are arguments.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::config::{ContentionConfig, Mode};
use super::detect::{Learner, Tick};
use super::ladder::{halved_cores, max_halvings, MbaLadder};
use super::types::{
    Baseline, ContentionObservations, Detection, JobObservation, MbaGroup, Mechanism, RankedBy,
    Role, ThrottleAction, Throttles,
};
use super::MbaCaps;
use crate::job::JobId;

// ---------------------------------------------------------------------------------------------
// The state machine.

/// One step taken, remembered so steps are given back last-first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Step {
    Mba { group: MbaGroup, domains: Vec<u32> },
    Cores { job: JobId },
}

/// A job's core cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct CoreCut {
    pub(super) nominal: u32,
    pub(super) level: u32,
}

/// A snapshot of everything throttled and why, for status output.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContentionStatus {
    pub mode: Mode,
    /// In force (advise mode: what would be).
    pub throttles: Throttles,
    /// MBA steps per group and domain.
    pub mba_levels: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    /// Halvings per job.
    pub core_levels: BTreeMap<JobId, u32>,
    /// Learnt (or given) stable levels of training jobs.
    pub baselines: BTreeMap<JobId, Baseline>,
    pub detection: Option<Detection>,
}

/// SODA §V-E's contention eliminator for one node.
#[derive(Debug, Clone)]
pub struct ContentionEliminator {
    pub(super) config: ContentionConfig,
    pub(super) ladder: Option<MbaLadder>,
    mba_unused: Option<String>,
    /// MBA groups the enforcer could not apply (see [`Self::mba_failed`]), with why.
    mba_failed: BTreeMap<MbaGroup, String>,
    tick: u64,
    pressure_run: u32,
    calm_run: u32,
    pub(super) calm_needed: u32,
    last_give_back: Option<u64>,
    pub(super) mba_levels: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    /// Where each group's steps count down from per domain, while it has a step there (AMD:
    /// what it used at its first step, [`MbaLadder::base_for`]; absent: the unthrottled value).
    pub(super) mba_bases: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    pub(super) cuts: BTreeMap<JobId, CoreCut>,
    pub(super) steps: Vec<Step>,
    pub(super) learners: BTreeMap<JobId, Learner>,
    pub(super) given_baselines: BTreeMap<JobId, Baseline>,
    /// Each MBA group's members at the last tick, to notice jobs joining a throttled group.
    pub(super) members: BTreeMap<MbaGroup, BTreeSet<JobId>>,
    /// Jobs throttled by anything at the end of the last tick.
    pub(super) throttled: BTreeSet<JobId>,
    detection: Option<Detection>,
}

impl ContentionEliminator {
    /// `mba`: the node's MBA capabilities ([`MbaCaps::read`]), `None` where it has none.
    /// `config` should have passed [`ContentionConfig::validate`]; out-of-range values are
    /// clamped to work.
    pub fn new(config: ContentionConfig, mba: Option<MbaCaps>) -> Self {
        let (ladder, mba_unused) = match mba.map(|caps| MbaLadder::new(caps, &config)) {
            Some(Ok(ladder)) => (Some(ladder), None),
            Some(Err(why)) => (None, Some(why)),
            None => (None, None),
        };
        let calm_needed = config.calm_ticks.max(1);
        Self {
            config,
            ladder,
            mba_unused,
            mba_failed: BTreeMap::new(),
            tick: 0,
            pressure_run: 0,
            calm_run: 0,
            calm_needed,
            last_give_back: None,
            mba_levels: BTreeMap::new(),
            mba_bases: BTreeMap::new(),
            cuts: BTreeMap::new(),
            steps: Vec::new(),
            learners: BTreeMap::new(),
            given_baselines: BTreeMap::new(),
            members: BTreeMap::new(),
            throttled: BTreeSet::new(),
            detection: None,
        }
    }

    pub fn config(&self) -> &ContentionConfig {
        &self.config
    }

    /// The MBA ladder in use; `None` without MBA (core halving only).
    pub fn mba_ladder(&self) -> Option<&MbaLadder> {
        self.ladder.as_ref()
    }

    /// Switches between enforce and advise. Going to advise, the enforcer's next
    /// [`throttles`](Self::throttles) is empty, which lifts what was applied.
    pub fn set_mode(&mut self, mode: Mode) {
        self.config.mode = mode;
    }

    /// New thresholds, tick counts and mode, from the next [`step`](Self::step) on (a config
    /// reload). What the eliminator holds is kept: throttles in force, learnt stable levels,
    /// the runs of pressured and calm ticks; the calm a give-back needs is brought within the
    /// new `calm_ticks ..= max_calm_ticks`. The MBA ladder stays as built at the start
    /// (`mba_step_percent` and `mba_floor_percent` keep their running values).
    pub fn reconfigure(&mut self, config: ContentionConfig) {
        let calm = config.calm_ticks.max(1);
        self.calm_needed = self
            .calm_needed
            .clamp(calm, config.max_calm_ticks.max(calm));
        self.config = ContentionConfig {
            mba_step_percent: self.config.mba_step_percent,
            mba_floor_percent: self.config.mba_floor_percent,
            ..config
        };
    }

    /// The enforcer cannot apply MBA to `group` (its resctrl group cannot be made: no free
    /// CLOSID, ...): the group's MBA steps are dropped (the next [`step`](Self::step) releases
    /// its members), and escalation halves the members' cores instead until every step has
    /// been given back; then MBA is tried again. `why` shows as the detection's `mba_unused`.
    pub fn mba_failed(&mut self, group: MbaGroup, why: String) {
        self.mba_levels.remove(&group);
        self.steps
            .retain(|s| !matches!(s, Step::Mba { group: g, .. } if *g == group));
        self.mba_failed.insert(group, why);
    }

    /// The last tick's detection.
    pub fn detection(&self) -> Option<&Detection> {
        self.detection.as_ref()
    }

    /// What the enforcer must make true now: empty in advise mode.
    pub fn throttles(&self) -> Throttles {
        match self.config.mode {
            Mode::Enforce => self.decided(),
            Mode::Advise => Throttles::default(),
        }
    }

    /// The throttles decided, whatever the mode (in advise mode: what would be in force).
    pub fn decided(&self) -> Throttles {
        let mut t = Throttles::default();
        if let Some(ladder) = &self.ladder {
            for (&group, levels) in &self.mba_levels {
                if levels.values().all(|&l| l == 0) {
                    continue;
                }
                let values = ladder
                    .domains()
                    .map(|d| {
                        let level = levels.get(&d).copied().unwrap_or(0);
                        (d, self.mba_value(ladder, group, d, level))
                    })
                    .collect();
                t.mba.insert(group, values);
            }
        }
        for (job, cut) in &self.cuts {
            if cut.level > 0 {
                t.cores.insert(
                    job.clone(),
                    halved_cores(cut.nominal, cut.level, self.config.min_cores),
                );
            }
        }
        t
    }

    pub fn status(&self) -> ContentionStatus {
        let mut baselines = self.given_baselines.clone();
        for (job, learner) in &self.learners {
            if let Some(b) = learner.baseline(&self.config) {
                baselines.entry(job.clone()).or_insert(b);
            }
        }
        ContentionStatus {
            mode: self.config.mode,
            throttles: self.decided(),
            mba_levels: self.mba_levels.clone(),
            core_levels: self
                .cuts
                .iter()
                .map(|(job, cut)| (job.clone(), cut.level))
                .collect(),
            baselines,
            detection: self.detection.clone(),
        }
    }

    /// One tick: takes this tick's observations, returns what changed. `now_ms` stamps the
    /// detection; hysteresis counts ticks.
    pub fn step(&mut self, now_ms: u64, obs: &ContentionObservations) -> Vec<ThrottleAction> {
        self.tick += 1;
        let mut actions = Vec::new();
        let mut jobs = BTreeMap::new();
        for job in &obs.jobs {
            // A job listed twice counts once (the first listing wins).
            jobs.entry(&job.id).or_insert(job);
        }
        let mut tick = Tick {
            now_ms,
            jobs,
            membw: obs.membw.as_ref(),
            suspects: Vec::new(),
            ranked_by: RankedBy::Unranked,
            victims: Vec::new(),
            why: String::new(),
        };

        self.forget_departed(&tick, &mut actions);
        self.refresh_cuts(&tick, &mut actions);
        self.notice_joiners(&tick, &mut actions);

        let training: Vec<&JobObservation> = tick
            .jobs
            .values()
            .copied()
            .filter(|j| j.role == Role::Training)
            .collect();
        let lodgers_run = tick.jobs.values().any(|j| j.role != Role::Training);
        self.learn(&training, lodgers_run);

        if training.is_empty() {
            // Nothing to protect: every throttle goes at once.
            if !self.steps.is_empty() || !self.cuts.is_empty() || !self.mba_levels.is_empty() {
                let why = "no training job on the node: every throttle lifted".to_string();
                self.lift_all(&tick, &why, &mut actions);
            }
            self.pressure_run = 0;
            self.calm_run = 0;
            self.calm_needed = self.config.calm_ticks.max(1);
            self.mba_failed.clear();
            self.detection = None;
            self.finish(&tick, &mut actions);
            return actions;
        }

        let (signal, pressured, calm) = self.detect(&mut tick, &training, lodgers_run);
        self.rank(&mut tick);

        if pressured {
            self.pressure_run += 1;
            self.calm_run = 0;
        } else if calm {
            self.calm_run += 1;
            self.pressure_run = 0;
        } else {
            // The hysteresis band: neither run goes on.
            self.pressure_run = 0;
            self.calm_run = 0;
        }

        // An online job throttled while its SLO fails gets a step back at once.
        self.guard_slo(&tick, &mut actions);

        let mut exhausted = false;
        if self.pressure_run >= self.config.pressure_ticks.max(1) {
            self.pressure_run = 0;
            let relapse = self
                .last_give_back
                .is_some_and(|at| self.tick - at <= u64::from(self.calm_needed));
            if relapse {
                self.calm_needed = self
                    .calm_needed
                    .saturating_mul(2)
                    .min(self.config.max_calm_ticks.max(self.config.calm_ticks))
                    .max(1);
                self.last_give_back = None;
            }
            exhausted = !self.escalate(&tick, &mut actions);
        } else if self.calm_run >= self.calm_needed {
            self.calm_run = 0;
            if self.steps.is_empty() {
                // Calm with nothing held: relapses are forgiven, and MBA that could not be
                // applied is tried again at the next pressure.
                self.calm_needed = self.config.calm_ticks.max(1);
                self.mba_failed.clear();
            } else {
                let why = format!(
                    "calm for {} ticks ({}): one step given back",
                    self.calm_needed, tick.why
                );
                self.give_back(&tick, &why, &mut actions);
                self.last_give_back = Some(self.tick);
            }
        }

        self.detection = Some(Detection {
            now_ms: tick.now_ms,
            signal,
            pressured,
            calm,
            pressure_run: self.pressure_run,
            calm_run: self.calm_run,
            calm_needed: self.calm_needed,
            suspects: tick.suspects.clone(),
            ranked_by: tick.ranked_by,
            victims: tick.victims.clone(),
            exhausted,
            mba_unused: self.mba_unused.clone().or_else(|| {
                (!self.mba_failed.is_empty()).then(|| {
                    self.mba_failed
                        .iter()
                        .map(|(g, why)| format!("{g}: {why}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                })
            }),
        });
        self.finish(&tick, &mut actions);
        actions
    }

    // -----------------------------------------------------------------------------------------
    // Bookkeeping.

    /// Drops the state of jobs that left or became training (which is never throttled).
    fn forget_departed(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let gone: Vec<JobId> = self
            .cuts
            .keys()
            .filter(|id| tick.jobs.get(id).map_or(true, |j| j.role == Role::Training))
            .cloned()
            .collect();
        for id in gone {
            self.cuts.remove(&id);
            self.steps
                .retain(|s| !matches!(s, Step::Cores { job } if *job == id));
        }
        // A job that left or was re-registered as training is released; the others' releases
        // follow from `finish`.
        let departed: Vec<JobId> = self
            .throttled
            .iter()
            .filter(|id| tick.jobs.get(id).map_or(true, |j| j.role == Role::Training))
            .cloned()
            .collect();
        for id in departed {
            self.throttled.remove(&id);
            let evidence = match tick.jobs.get(&id) {
                None => "job gone: its throttles are dropped",
                Some(_) => "job is training now: training is never throttled",
            };
            actions.push(self.action(id, Mechanism::Release, 0, evidence.to_string()));
        }
        // An MBA group with no members has nothing to throttle.
        for group in MbaGroup::ALL {
            let has_members = tick
                .jobs
                .values()
                .any(|j| j.role.mba_group() == Some(group));
            if !has_members {
                self.mba_levels.remove(&group);
                self.steps
                    .retain(|s| !matches!(s, Step::Mba { group: g, .. } if *g == group));
            }
        }
        self.learners.retain(|id, _| tick.jobs.contains_key(id));
        self.given_baselines
            .retain(|id, _| tick.jobs.contains_key(id));
    }

    /// A cut job whose allocation grew keeps its level, counted from the new allocation.
    ///
    /// Fewer cores than the cut counts from say nothing: the enforcer shows the job capped (a
    /// cut to 4 of 8 cores shows 4). Taking that for the allocation would lift the cut the
    /// next tick (2 cores halved to 1 show 1, which cannot be cut) or halve the halved count
    /// again, down to the floor.
    fn refresh_cuts(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let floor = self.config.min_cores;
        let mut changed = Vec::new();
        for (id, cut) in &mut self.cuts {
            let Some(job) = tick.jobs.get(id) else {
                continue;
            };
            if job.cores <= cut.nominal {
                continue;
            }
            let before = halved_cores(cut.nominal, cut.level, floor);
            cut.nominal = job.cores;
            cut.level = cut.level.min(max_halvings(cut.nominal, floor));
            let after = halved_cores(cut.nominal, cut.level, floor);
            if after != before {
                changed.push((id.clone(), after, cut.level));
            }
        }
        for (id, count, level) in changed {
            let evidence = format!("allocation changed: {count} cores at the same throttle level");
            actions.push(self.action(id, Mechanism::Cores { count }, level, evidence));
        }
        self.cuts.retain(|_, cut| cut.level > 0);
        let cuts = &self.cuts;
        self.steps
            .retain(|s| !matches!(s, Step::Cores { job } if !cuts.contains_key(job)));
    }

    // -----------------------------------------------------------------------------------------
    // Steps.

    /// Takes one step; false when nothing is left to throttle.
    fn escalate(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) -> bool {
        let evidence = self.evidence(tick);
        for tier in [MbaGroup::Lodgers, MbaGroup::Online] {
            let members: Vec<&JobObservation> = tick
                .jobs
                .values()
                .copied()
                .filter(|j| j.role.mba_group() == Some(tier))
                .collect();
            // Online inference only while every SLO of the group holds: the group is
            // throttled as one.
            let eligible: Vec<&JobObservation> = members
                .iter()
                .copied()
                .filter(|j| tier == MbaGroup::Lodgers || j.slo_met == Some(true))
                .collect();
            if eligible.is_empty() {
                continue;
            }
            let failed = self.mba_failed.get(&tier).cloned();
            if eligible.len() == members.len()
                && failed.is_none()
                && self.step_mba(tick, tier, &evidence, actions)
            {
                return true;
            }
            let no_mba = match (&self.ladder, failed) {
                (None, _) => " (no MBA)".to_string(),
                (Some(_), Some(why)) => format!(" (MBA cannot be applied to {tier}: {why})"),
                (Some(_), None) => " (its MBA group is at its floor)".to_string(),
            };
            if self.halve(tick, &eligible, &evidence, &no_mba, actions) {
                return true;
            }
        }
        false
    }

    /// Halves the cores of the most suspect of `eligible` that is above its floor.
    fn halve(
        &mut self,
        tick: &Tick<'_>,
        eligible: &[&JobObservation],
        evidence: &str,
        no_mba: &str,
        actions: &mut Vec<ThrottleAction>,
    ) -> bool {
        let floor = self.config.min_cores;
        // A cut job counts from the allocation its cut does (it shows the capped count).
        let pick = tick.suspects.iter().find_map(|s| {
            let job = eligible.iter().find(|j| j.id == s.job)?;
            let (nominal, level) = self
                .cuts
                .get(&job.id)
                .map_or((job.cores, 0), |c| (c.nominal, c.level));
            (level < max_halvings(nominal, floor)).then_some(*job)
        });
        let Some(job) = pick else {
            return false;
        };
        let cut = self.cuts.entry(job.id.clone()).or_insert(CoreCut {
            nominal: job.cores,
            level: 0,
        });
        let before = halved_cores(cut.nominal, cut.level, floor);
        cut.level += 1;
        let (count, level) = (halved_cores(cut.nominal, cut.level, floor), cut.level);
        self.steps.push(Step::Cores {
            job: job.id.clone(),
        });
        let why = format!(
            "{evidence}; {} cores halved {before} -> {count}{no_mba}",
            job.id
        );
        actions.push(self.action(job.id.clone(), Mechanism::Cores { count }, level, why));
        true
    }

    /// Gives back the last step taken.
    fn give_back(&mut self, tick: &Tick<'_>, why: &str, actions: &mut Vec<ThrottleAction>) {
        let Some(step) = self.steps.pop() else {
            return;
        };
        self.undo(tick, step, why, actions);
    }

    fn undo(&mut self, tick: &Tick<'_>, step: Step, why: &str, actions: &mut Vec<ThrottleAction>) {
        match step {
            Step::Mba { group, domains } => self.undo_mba(tick, group, domains, why, actions),
            Step::Cores { job } => {
                let floor = self.config.min_cores;
                let Some(cut) = self.cuts.get_mut(&job) else {
                    return;
                };
                cut.level = cut.level.saturating_sub(1);
                let (count, level) = (halved_cores(cut.nominal, cut.level, floor), cut.level);
                if level == 0 {
                    self.cuts.remove(&job);
                }
                actions.push(self.action(job, Mechanism::Cores { count }, level, why.to_string()));
            }
        }
    }

    /// Online jobs whose SLO does not hold get their group's or their own last step back.
    fn guard_slo(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let failing: Vec<&JobObservation> = tick
            .jobs
            .values()
            .copied()
            .filter(|j| j.role == Role::Online && j.slo_met != Some(true))
            .collect();
        if failing.is_empty() {
            return;
        }
        let names: Vec<&str> = failing.iter().map(|j| j.id.as_str()).collect();
        let why = format!(
            "SLO of {} not met: its throttle eased one step",
            names.join(", ")
        );
        let pos = self.steps.iter().rposition(|s| match s {
            Step::Mba { group, .. } => *group == MbaGroup::Online,
            Step::Cores { job } => failing.iter().any(|j| j.id == *job),
        });
        if let Some(pos) = pos {
            let step = self.steps.remove(pos);
            self.undo(tick, step, &why, actions);
        }
    }

    /// Gives back every step.
    fn lift_all(&mut self, tick: &Tick<'_>, why: &str, actions: &mut Vec<ThrottleAction>) {
        while let Some(step) = self.steps.pop() {
            self.undo(tick, step, why, actions);
        }
        self.mba_levels.clear();
        self.mba_bases.clear();
        self.cuts.clear();
    }

    /// Appends a `Release` for every job that was throttled and no longer is, and remembers
    /// who is throttled.
    fn finish(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let now: BTreeSet<JobId> = tick
            .jobs
            .values()
            .filter(|j| self.is_throttled(j))
            .map(|j| j.id.clone())
            .collect();
        for id in self.throttled.difference(&now) {
            actions.push(self.action(
                id.clone(),
                Mechanism::Release,
                0,
                "no throttle left on the job".to_string(),
            ));
        }
        self.throttled = now;
    }

    fn is_throttled(&self, job: &JobObservation) -> bool {
        let by_cores = self.cuts.get(&job.id).is_some_and(|c| c.level > 0);
        let by_mba = job.role.mba_group().is_some_and(|g| {
            self.mba_levels
                .get(&g)
                .is_some_and(|levels| levels.values().any(|&l| l > 0))
        });
        by_cores || by_mba
    }

    pub(super) fn action(
        &self,
        job: JobId,
        mechanism: Mechanism,
        level: u32,
        evidence: String,
    ) -> ThrottleAction {
        ThrottleAction {
            job,
            mechanism,
            level,
            advisory: self.config.mode == Mode::Advise,
            evidence,
        }
    }
}
