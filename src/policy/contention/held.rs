//! What the contention eliminator keeps across a lodgerd restart (issue 17): the throttles in
//! force and the order they were taken in, the calm the next give-back needs, each MBA group's
//! members, and the training jobs' learnt progress. A restarted lodgerd restores it before its
//! first plan, so a restart neither gives a throttle back nor forgets a stable level (which it
//! could not learn again while lodgers run beside the job, SODA §V-E).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::detect::Learner;
use super::eliminator::{ContentionEliminator, CoreCut, Step};
use super::types::MbaGroup;
use crate::job::JobId;

/// The eliminator's state worth a state file, as [`ContentionEliminator::held`] gives it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HeldContention {
    /// MBA steps per group and L3 domain.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) mba_levels: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    /// Where those steps count down from per group and domain (AMD: what the group used at its
    /// first step); absent: the unthrottled value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) mba_bases: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    /// Core cuts per job.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) cuts: BTreeMap<JobId, CoreCut>,
    /// The steps taken, oldest first (given back last-first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) steps: Vec<Step>,
    /// Calm ticks the next give-back needs (doubled by relapses). 0: the configured start.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(super) calm_needed: u32,
    /// Each MBA group's members at the last tick.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) members: BTreeMap<MbaGroup, BTreeSet<JobId>>,
    /// Jobs throttled by anything at the last tick.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub(super) throttled: BTreeSet<JobId>,
    /// Each training job's last progress samples while it ran alone.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) learnt: BTreeMap<JobId, Vec<f64>>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl HeldContention {
    /// Nothing held: no throttle, nothing learnt.
    pub fn is_empty(&self) -> bool {
        *self == HeldContention::default()
    }

    /// Whether an MBA step is held (lodger's resctrl group then outlives lodgerd).
    pub fn holds_mba(&self) -> bool {
        self.mba_levels
            .values()
            .any(|levels| levels.values().any(|&l| l > 0))
    }

    /// Whether an MBA step is held for `group`.
    pub fn holds_mba_in(&self, group: MbaGroup) -> bool {
        self.mba_levels
            .get(&group)
            .is_some_and(|levels| levels.values().any(|&l| l > 0))
    }

    /// The throttles only, not what was learnt: two states with the same throttles in force.
    pub fn same_throttles(&self, other: &HeldContention) -> bool {
        self.mba_levels == other.mba_levels
            && self.mba_bases == other.mba_bases
            && self.cuts == other.cuts
            && self.steps == other.steps
    }
}

impl ContentionEliminator {
    /// What a restarted lodgerd needs to go on where this one is (see [`HeldContention`]).
    pub fn held(&self) -> HeldContention {
        HeldContention {
            mba_levels: self.mba_levels.clone(),
            mba_bases: self.mba_bases.clone(),
            cuts: self.cuts.clone(),
            steps: self.steps.clone(),
            calm_needed: if self.calm_needed == self.config.calm_ticks.max(1) {
                0
            } else {
                self.calm_needed
            },
            members: self.members.clone(),
            throttled: self.throttled.clone(),
            learnt: self
                .learners
                .iter()
                .map(|(id, l)| (id.clone(), l.samples()))
                .filter(|(_, s)| !s.is_empty())
                .collect(),
        }
    }

    /// Takes up what an earlier lodgerd held. What this one cannot hold is dropped, not
    /// trusted: MBA steps on a node without MBA (or on domains it does not have, or beyond its
    /// floor), and anything out of the configured ranges. Jobs that are gone are forgotten by
    /// the next [`step`](Self::step), as at any tick.
    pub fn restore(&mut self, held: HeldContention) {
        let HeldContention {
            mba_levels,
            mba_bases,
            cuts,
            steps,
            calm_needed,
            members,
            throttled,
            learnt,
        } = held;
        // A base only where a step is held, in a domain this node has, on a ladder that counts
        // from one (AMD), bounded as a measured base is.
        self.mba_bases = match &self.ladder {
            Some(ladder) if ladder.is_absolute() => mba_bases
                .into_iter()
                .map(|(group, bases)| {
                    let held = mba_levels.get(&group);
                    let bases = bases
                        .into_iter()
                        .filter(|(d, _)| held.is_some_and(|l| l.get(d).is_some_and(|&l| l > 0)))
                        .filter(|(d, _)| ladder.domains().any(|known| known == *d))
                        .filter_map(|(d, b)| Some((d, ladder.held_base(b)?)))
                        .collect::<BTreeMap<_, _>>();
                    (group, bases)
                })
                .filter(|(_, bases)| !bases.is_empty())
                .collect(),
            _ => BTreeMap::new(),
        };
        let bases = &self.mba_bases;
        self.mba_levels = match &self.ladder {
            Some(ladder) => mba_levels
                .into_iter()
                .map(|(group, levels)| {
                    let levels = levels
                        .into_iter()
                        .filter(|(d, _)| ladder.domains().any(|known| known == *d))
                        .map(|(d, l)| {
                            let base = bases.get(&group).and_then(|b| b.get(&d)).copied();
                            (d, l.min(ladder.max_level_at(d, base)))
                        })
                        .collect::<BTreeMap<_, _>>();
                    (group, levels)
                })
                .filter(|(_, levels)| !levels.is_empty())
                .collect(),
            None => BTreeMap::new(),
        };
        self.cuts = cuts.into_iter().filter(|(_, c)| c.level > 0).collect();
        self.steps = steps
            .into_iter()
            .filter(|s| match s {
                Step::Mba { group, .. } => self.mba_levels.contains_key(group),
                Step::Cores { job } => self.cuts.contains_key(job),
            })
            .collect();
        // A cut with no step to give it back by would never be given back.
        let steps = &self.steps;
        self.cuts.retain(|id, _| {
            steps
                .iter()
                .any(|s| matches!(s, Step::Cores { job } if job == id))
        });
        let calm = self.config.calm_ticks.max(1);
        self.calm_needed = calm_needed.clamp(calm, self.config.max_calm_ticks.max(calm));
        self.members = members;
        self.throttled = throttled;
        self.learners = learnt
            .into_iter()
            .map(|(id, samples)| (id, Learner::from_samples(samples, &self.config)))
            .collect();
    }
}
