//! The eliminator's MBA steps (SODA §V-E): one step down per group in the pressured L3
//! domains, counted from a base on AMD ([`MbaLadder::base_for`]), given back one at a time, and
//! said to every member, joiners included. Pure: observations are arguments.

use std::collections::BTreeSet;

use super::detect::Tick;
use super::eliminator::{ContentionEliminator, Step};
use super::ladder::{group_peak, MbaLadder};
use super::types::{MbaGroup, Mechanism, ThrottleAction};
use crate::job::JobId;

impl ContentionEliminator {
    /// Where `group`'s steps in `domain` count down from ([`MbaLadder::base_for`]); `None`:
    /// the unthrottled value.
    pub fn mba_base(&self, group: MbaGroup, domain: u32) -> Option<u32> {
        self.mba_bases.get(&group)?.get(&domain).copied()
    }

    /// `group`'s MB value in `domain` at `level`.
    pub(super) fn mba_value(
        &self,
        ladder: &MbaLadder,
        group: MbaGroup,
        domain: u32,
        level: u32,
    ) -> u32 {
        ladder.value_at(domain, self.mba_base(group, domain), level)
    }

    /// A job that joins a throttled MBA group is throttled with it: say so.
    pub(super) fn notice_joiners(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        for group in MbaGroup::ALL {
            let now: BTreeSet<JobId> = tick
                .jobs
                .values()
                .filter(|j| j.role.mba_group() == Some(group))
                .map(|j| j.id.clone())
                .collect();
            let before = self.members.insert(group, now.clone()).unwrap_or_default();
            let Some(ladder) = &self.ladder else {
                continue;
            };
            let Some(levels) = self.mba_levels.get(&group) else {
                continue;
            };
            for id in now.difference(&before) {
                for (&domain, &level) in levels {
                    if level == 0 {
                        continue;
                    }
                    let value = self.mba_value(ladder, group, domain, level);
                    actions.push(self.action(
                        id.clone(),
                        Mechanism::Mba {
                            group,
                            domain,
                            value,
                        },
                        level,
                        format!("joined {group}, which is throttled"),
                    ));
                }
            }
        }
    }

    /// One MBA step down for `group`, in the pressured domains (all where unknown).
    pub(super) fn step_mba(
        &mut self,
        tick: &Tick<'_>,
        group: MbaGroup,
        evidence: &str,
        actions: &mut Vec<ThrottleAction>,
    ) -> bool {
        let Some(ladder) = &self.ladder else {
            return false;
        };
        let levels = self.mba_levels.get(&group).cloned().unwrap_or_default();
        // A domain's first step counts down from what the group uses now (AMD; see
        // `MbaLadder::base_for`); a domain already stepped keeps the base it started from.
        let peak = group_peak(
            tick.jobs
                .values()
                .copied()
                .filter(|j| j.role.mba_group() == Some(group)),
        );
        let fresh = ladder.base_for(peak);
        let level_of = |d: u32| levels.get(&d).copied().unwrap_or(0);
        let base_of = |d: u32| {
            if level_of(d) > 0 {
                self.mba_base(group, d)
            } else {
                fresh
            }
        };
        let open: Vec<(u32, Option<u32>)> = ladder
            .domains()
            .map(|d| (d, base_of(d)))
            .filter(|&(d, base)| level_of(d) < ladder.max_level_at(d, base))
            .collect();
        let pressured: Vec<(u32, Option<u32>)> = tick
            .membw
            .map(|m| {
                open.iter()
                    .copied()
                    .filter(|(d, _)| {
                        m.domain_fractions
                            .get(d)
                            .is_some_and(|f| *f >= self.config.membw_threshold)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let domains = if pressured.is_empty() {
            open
        } else {
            pressured
        };
        if domains.is_empty() {
            return false;
        }
        let first = domains.iter().any(|&(d, _)| level_of(d) == 0);
        let from = match fresh {
            // GB as the ladder reads AMD's unit: 2^30 bytes.
            Some(base) if first => format!(
                " from {:.1} GB/s (it used {:.1} GB/s in its busiest L3 domain)",
                f64::from(base) / 8.0,
                peak.unwrap_or(0.0) / f64::from(1u32 << 30)
            ),
            None if first && ladder.is_absolute() => {
                " from the unthrottled value (no bandwidth of its own measured per L3 domain)"
                    .to_string()
            }
            _ => String::new(),
        };
        let mut changes = Vec::new();
        let entry = self.mba_levels.entry(group).or_default();
        let bases = self.mba_bases.entry(group).or_default();
        for &(d, base) in &domains {
            let level = entry.entry(d).or_insert(0);
            if *level == 0 {
                match base {
                    Some(b) => bases.insert(d, b),
                    None => bases.remove(&d),
                };
            }
            *level += 1;
            changes.push((d, *level, ladder.value_at(d, base, *level)));
        }
        if bases.is_empty() {
            self.mba_bases.remove(&group);
        }
        let domains = domains.into_iter().map(|(d, _)| d).collect();
        self.steps.push(Step::Mba { group, domains });
        let why = format!("{evidence}; {group} MBA one step down{from}");
        self.mba_actions(tick, group, &changes, &why, actions);
        true
    }

    /// Emits one MBA action per member of `group` per changed domain.
    pub(super) fn mba_actions(
        &self,
        tick: &Tick<'_>,
        group: MbaGroup,
        changes: &[(u32, u32, u32)],
        why: &str,
        actions: &mut Vec<ThrottleAction>,
    ) {
        for job in tick.jobs.values() {
            if job.role.mba_group() != Some(group) {
                continue;
            }
            for &(domain, level, value) in changes {
                actions.push(self.action(
                    job.id.clone(),
                    Mechanism::Mba {
                        group,
                        domain,
                        value,
                    },
                    level,
                    why.to_string(),
                ));
            }
        }
    }

    /// Gives back one MBA step of `group` in `domains`.
    pub(super) fn undo_mba(
        &mut self,
        tick: &Tick<'_>,
        group: MbaGroup,
        domains: Vec<u32>,
        why: &str,
        actions: &mut Vec<ThrottleAction>,
    ) {
        let Some(ladder) = &self.ladder else {
            return;
        };
        let mut changes = Vec::new();
        let bases = self.mba_bases.get(&group);
        if let Some(levels) = self.mba_levels.get_mut(&group) {
            for d in domains {
                if let Some(level) = levels.get_mut(&d) {
                    *level = level.saturating_sub(1);
                    let base = bases.and_then(|b| b.get(&d)).copied();
                    changes.push((d, *level, ladder.value_at(d, base, *level)));
                }
            }
            levels.retain(|_, l| *l > 0);
            if levels.is_empty() {
                self.mba_levels.remove(&group);
            }
        }
        // A domain given back to no limit counts from what the group uses then, if it
        // is stepped again.
        let levels = self.mba_levels.get(&group);
        if let Some(bases) = self.mba_bases.get_mut(&group) {
            bases.retain(|d, _| levels.is_some_and(|l| l.contains_key(d)));
            if bases.is_empty() {
                self.mba_bases.remove(&group);
            }
        }
        self.mba_actions(tick, group, &changes, why, actions);
    }
}
