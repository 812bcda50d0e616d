//! Contention control (SODA §V-E): one eliminator step per new sensing pass, throttle steps
//! logged with their evidence and signalled, MBA applied through lodger's resctrl groups
//! ([`super::mba`]) once the tick has refreshed the jobs' processes. Core halving is handed to
//! inference placement as [`Throttles`]. Touches resctrl (through `super::mba`) and the jobs
//! lent by the tick.

use std::collections::{BTreeMap, BTreeSet};

use tracing::warn;

use super::mba::role_of;
pub use super::mba::MbaTarget;
use super::{Event, TickCx};
use crate::job::JobId;
use crate::policy::contention::{
    ContentionConfig, ContentionEliminator, ContentionObservations, HeldContention, JobObservation,
    Mechanism, NodeMembw, Role, Throttles,
};

/// Contention control and the sensing pass it last looked at.
pub(super) struct Contention {
    eliminator: ContentionEliminator,
    seen_ms: u64,
    /// Where MBA throttles are applied: resctrl's root and lodger's control group for lodgers.
    mba: Option<MbaTarget>,
    /// Throttle steps taken, for Prometheus.
    actions: u64,
    /// MBA is to be made to match the throttles at this tick's [`Contention::apply_mba`]: at
    /// the first tick (what an earlier lodgerd held), then after each new sensing pass.
    mba_due: bool,
}

impl Contention {
    /// With `mba`, throttles with resctrl MBA (SODA §V-E: MBA first, core halving only where MBA
    /// is absent). `held`: what an earlier lodgerd held (the state file's), taken up at once:
    /// the groups of what the eliminator could restore are taken up (set, reconciled, or given
    /// back at the first tick, in advise mode too), every other group of lodger's removed.
    pub(super) fn new(
        config: ContentionConfig,
        mut mba: Option<MbaTarget>,
        held: &HeldContention,
    ) -> Self {
        let mut eliminator =
            ContentionEliminator::new(config, mba.as_ref().map(|m| m.caps.clone()));
        eliminator.restore(held.clone());
        if let Some(mba) = &mut mba {
            let restored = eliminator.held();
            mba.take_up(|g| restored.holds_mba_in(g));
        }
        Self {
            eliminator,
            seen_ms: 0,
            mba,
            actions: 0,
            mba_due: true,
        }
    }

    /// A reload's new settings (see [`ContentionEliminator::reconfigure`]). Going to advise
    /// lifts what is applied at the next pass, as the mode says.
    pub(super) fn reconfigure(&mut self, config: ContentionConfig) {
        if config != *self.eliminator.config() {
            tracing::info!(
                mode = config.mode.as_str(),
                membw_threshold = config.membw_threshold,
                pressure_ticks = config.pressure_ticks,
                calm_ticks = config.calm_ticks,
                "contention control reconfigured"
            );
        }
        self.eliminator.reconfigure(config);
    }

    /// Contention control is switched off: every MBA throttle is given back and lodger's
    /// resctrl group removed; returns the MBA target for a later reload that switches it on.
    pub(super) fn into_mba(mut self) -> Option<MbaTarget> {
        self.shutdown();
        self.mba
    }

    /// The throttles in force, handed to inference placement (fewer cores for a throttled job).
    pub(super) fn throttles(&self) -> Throttles {
        self.eliminator.throttles()
    }

    /// Whether any throttle was decided (right-sizing never probes meanwhile, SODA §V-B).
    pub(super) fn throttling(&self) -> bool {
        self.eliminator.decided() != Throttles::default()
    }

    pub(super) fn actions(&self) -> u64 {
        self.actions
    }

    /// Contention control in words for status.
    pub(super) fn status(&self) -> String {
        let t = self.eliminator.decided();
        let mode = self.eliminator.config().mode.as_str();
        if t == Throttles::default() {
            format!("{mode}: no throttle")
        } else {
            format!(
                "{mode}: {} MBA group(s), {} job(s) on fewer cores",
                t.mba.len(),
                t.cores.len()
            )
        }
    }

    /// One step per new sensing pass: detection from memory bandwidth or training progress,
    /// throttle steps logged with their evidence and signalled, MBA applied here. Keeps
    /// `cx.state.contention` in step; returns whether a throttle changed (the state file must
    /// be written: what was learnt alone is written with the next write).
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>) -> bool {
        let obs = cx.observations;
        if obs.unix_ms <= self.seen_ms {
            return false;
        }
        // Issue 16: detection reads memory bandwidth and training progress (GPU utilization);
        // while either source is stale, throttles hold where they are.
        if obs.is_stale("membw") || obs.is_stale("gpu") {
            return false;
        }
        self.seen_ms = obs.unix_ms;
        self.mba_due = true;
        let membw = match (obs.node.membw_bytes_per_s, obs.node.membw_fraction_of_peak) {
            (Some(bytes_per_s), Some(fraction_of_peak)) => Some(NodeMembw {
                bytes_per_s,
                fraction_of_peak,
                domain_fractions: BTreeMap::new(),
            }),
            _ => None,
        };
        let jobs = cx
            .state
            .jobs
            .values()
            .map(|s| {
                let role = role_of(s.job.spec.kind);
                let cores = u32::try_from(s.job.cpus.len()).unwrap_or(u32::MAX);
                let m = obs.jobs.get(&s.job.id);
                let mut o = JobObservation::new(s.job.id.clone(), role, cores);
                o.membw_bytes_per_s = m.and_then(|m| m.membw_bytes_per_s);
                o.membw_domains = m.map(|m| m.membw_domains.clone()).unwrap_or_default();
                o.progress = m.and_then(|m| m.gpu_percent);
                if role == Role::Training {
                    // Its own cgroup's memory stalls where it has one (v2), else the node's.
                    o.memory_pressure_percent = m
                        .and_then(|m| m.memory_pressure_percent)
                        .or(obs.node.memory_pressure_percent);
                }
                if role == Role::Online {
                    let slo = s.job.spec.inference.as_ref().and_then(|i| i.slo_ms);
                    // The job's requests' p99, every instance's batches pooled, as the layout
                    // search judges it; unknown before any batch.
                    o.slo_met = slo.and_then(|slo| s.job.latency_ms.map(|l| l.p99 <= slo));
                }
                o
            })
            .collect();
        let actions = self
            .eliminator
            .step(obs.unix_ms, &ContentionObservations { membw, jobs });
        for a in &actions {
            self.actions += 1;
            let verb = if a.advisory {
                "would throttle"
            } else {
                "throttle"
            };
            warn!(
                job = %a.job,
                mechanism = %a.mechanism,
                level = a.level,
                "contention: {verb}: {}",
                a.evidence
            );
            if let Some(stored) = cx.state.jobs.get_mut(&a.job) {
                stored.job.throttle = match a.mechanism {
                    Mechanism::Release => None,
                    _ => Some(format!(
                        "{}{} (level {}): {}",
                        if a.advisory { "advise: " } else { "" },
                        a.mechanism,
                        a.level,
                        a.evidence
                    )),
                };
            }
        }
        cx.events.extend(actions.iter().map(|a| Event::Throttled {
            id: a.job.clone(),
            mechanism: a.mechanism.as_str().to_string(),
            level: a.level.to_string(),
        }));
        let held = self.eliminator.held();
        let changed = !held.same_throttles(&cx.state.contention);
        cx.state.contention = held;
        changed
    }

    /// Makes lodger's resctrl groups match the throttles in force (SODA §V-E: the lodgers
    /// throttled first, online inference last), after the tick's enforcement has refreshed the
    /// jobs' processes (a pid from the state file is not trusted before that: it may have been
    /// reused). A tier whose group cannot be made is throttled by halving instead. Returns
    /// whether a throttle changed. `ended`: jobs whose processes are gone this tick (reaped at
    /// its end), no members any more.
    pub(super) fn apply_mba(&mut self, cx: &mut TickCx<'_>, ended: &BTreeSet<JobId>) -> bool {
        if !std::mem::take(&mut self.mba_due) {
            return false;
        }
        let Some(mba) = &mut self.mba else {
            return false;
        };
        let throttles = self.eliminator.throttles();
        let failed = mba.apply(cx.proc_root, &cx.state.jobs, ended, &throttles);
        if failed.is_empty() {
            return false;
        }
        for (group, why) in failed {
            warn!("contention: {group} cannot be throttled by MBA: {why}; halving its members' cores instead");
            self.eliminator.mba_failed(group, why);
        }
        let held = self.eliminator.held();
        let changed = !held.same_throttles(&cx.state.contention);
        cx.state.contention = held;
        changed
    }

    /// Contention control is switched off or lodger drained: lodger's resctrl group goes.
    pub(super) fn shutdown(&mut self) {
        if let Some(mba) = &mut self.mba {
            mba.remove_all();
        }
    }

    /// lodgerd is stopping (a restart, an upgrade): an MBA throttle in force stays, in lodger's
    /// resctrl group, for the next lodgerd to take up with the state file (issue 17); without
    /// one the group goes.
    pub(super) fn stop(&mut self) {
        if !self.eliminator.held().holds_mba() {
            self.shutdown();
        }
    }
}
