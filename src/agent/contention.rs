//! Contention control (SODA §V-E): one eliminator step per new sensing pass, throttle steps
//! logged with their evidence and signalled, MBA applied through lodger's resctrl group. Core
//! halving is handed to inference placement as [`Throttles`]. Touches resctrl (through
//! `enforce::resctrl`) and the jobs lent by the tick.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tracing::warn;

use super::{Event, TickCx};
use crate::enforce::resctrl::{LodgerGroup, DEFAULT_CONTROL_GROUP};
use crate::job::JobKind;
use crate::policy::contention::{
    ContentionConfig, ContentionEliminator, ContentionObservations, HeldContention, JobObservation,
    MbaGroup, Mechanism, NodeMembw, Role, Throttles,
};
use crate::sys::resctrlfs::MbaCaps;

/// resctrl MBA, when the node has it.
pub struct MbaTarget {
    pub root: PathBuf,
    pub caps: MbaCaps,
    group: Option<LodgerGroup>,
}

impl MbaTarget {
    pub fn new(root: PathBuf, caps: MbaCaps) -> Self {
        Self {
            root,
            caps,
            group: None,
        }
    }

    /// Gives the throttled bandwidth back and removes lodger's group, if there is one.
    /// `context` starts the warning when that fails.
    fn remove_group(&mut self, context: &str) {
        if let Some(group) = self.group.take() {
            if let Err(e) = group.restore_and_remove() {
                warn!("{context}cannot remove lodger's resctrl group: {e}");
            }
        }
    }
}

/// Contention control and the sensing pass it last looked at.
pub(super) struct Contention {
    eliminator: ContentionEliminator,
    seen_ms: u64,
    /// Where MBA throttles are applied: resctrl's root and lodger's control group for lodgers.
    mba: Option<MbaTarget>,
    /// Throttle steps taken, for Prometheus.
    actions: u64,
    /// MBA throttles restored from an earlier lodgerd, applied at the first tick (not at the
    /// first new sensing pass).
    reapply_mba: bool,
}

impl Contention {
    /// With `mba`, throttles with resctrl MBA (SODA §V-E: MBA first, core halving only where MBA
    /// is absent). `held`: what an earlier lodgerd held (the state file's), taken up at once.
    pub(super) fn new(
        config: ContentionConfig,
        mba: Option<MbaTarget>,
        held: &HeldContention,
    ) -> Self {
        let mut eliminator =
            ContentionEliminator::new(config, mba.as_ref().map(|m| m.caps.clone()));
        eliminator.restore(held.clone());
        let reapply_mba = eliminator.held().holds_mba();
        Self {
            eliminator,
            seen_ms: 0,
            mba,
            actions: 0,
            reapply_mba,
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
        if std::mem::take(&mut self.reapply_mba) {
            let throttles = self.eliminator.throttles();
            self.apply_mba(cx, &throttles);
        }
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
                let role = match s.job.spec.kind {
                    JobKind::Training => Role::Training,
                    JobKind::Online => Role::Online,
                    JobKind::Offline => Role::Offline,
                    JobKind::Batch => Role::Batch,
                };
                let cores = u32::try_from(s.job.cpus.len()).unwrap_or(u32::MAX);
                let m = obs.jobs.get(&s.job.id);
                let mut o = JobObservation::new(s.job.id.clone(), role, cores);
                o.membw_bytes_per_s = m.and_then(|m| m.membw_bytes_per_s);
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
        let throttles = self.eliminator.throttles();
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
        self.apply_mba(cx, &throttles);
        let held = self.eliminator.held();
        let changed = !held.same_throttles(&cx.state.contention);
        cx.state.contention = held;
        changed
    }

    /// Makes lodger's resctrl group hold the offline and batch jobs' processes at the decided MB
    /// values (SODA §V-E: the lodgers throttled first), or
    /// removes it when no MBA throttle is in force.
    fn apply_mba(&mut self, cx: &TickCx<'_>, throttles: &Throttles) {
        let Some(mba) = &mut self.mba else {
            return;
        };
        match throttles.mba.get(&MbaGroup::Lodgers) {
            Some(values) => {
                if mba.group.is_none() {
                    match LodgerGroup::create(&mba.root, DEFAULT_CONTROL_GROUP, mba.caps.clone()) {
                        Ok((g, _)) => mba.group = Some(g),
                        Err(e) => {
                            warn!("contention: cannot create lodger's resctrl group: {e}");
                            return;
                        }
                    }
                }
                let Some(group) = &mba.group else { return };
                if let Err(e) = group.set_mb(values) {
                    warn!("contention: cannot write the MB schemata: {e}");
                }
                let pids: Vec<u32> = cx
                    .state
                    .jobs
                    .values()
                    .filter(|s| matches!(s.job.spec.kind, JobKind::Offline | JobKind::Batch))
                    .flat_map(|s| s.job.pids.iter().copied())
                    .collect();
                if let Err(e) = group.move_processes(cx.proc_root, &pids) {
                    warn!("contention: cannot move lodgers into the resctrl group: {e}");
                }
            }
            None => mba.remove_group("contention: "),
        }
    }

    /// Contention control is switched off or lodger drained: lodger's resctrl group goes.
    pub(super) fn shutdown(&mut self) {
        if let Some(mba) = &mut self.mba {
            mba.remove_group("");
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

/// A group left by an earlier lodgerd that holds no throttle any more.
pub(super) fn remove_stale_group(mba: &MbaTarget) {
    if let Err(e) = crate::enforce::resctrl::remove_stale_group(&mba.root, DEFAULT_CONTROL_GROUP) {
        warn!("cannot remove lodger's stale resctrl group: {e}");
    }
}
