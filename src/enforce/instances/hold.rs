//! Online cores stay exclusive while instances change (Cloud Reamer §III-A): which CPUs are still
//! held (by a stopping instance, or by an online instance that waits to move off them), whether
//! an instance's start or move in place must wait for them, and the start or move of those that
//! need not. Part of the supervisor; touches the node only through
//! [`Host`](super::host::Host).

use std::time::Instant;

use tracing::debug;

use super::error::InstanceError;
use super::host::Host;
use super::supervisor::{Instances, Slot, SlotState};
use super::{InstanceSpec, ReconcileOutcome};
use crate::cpuset::CpuSet;

impl Instances {
    /// `reconcile`'s last step, once every instance it stops or restarts has been signalled:
    /// starts each new instance and moves each instance moved in place, unless a CPU it is to
    /// have is still held for it ([`must_wait`]); those are reported in `waiting`, and `poll`
    /// starts or moves them once the CPUs are free.
    pub(super) fn start_or_move_held(&mut self, now: Instant, out: &mut ReconcileOutcome) {
        for i in 0..self.slots.len() {
            if !matches!(
                self.slots[i].state,
                SlotState::Waiting | SlotState::Moving { .. }
            ) {
                continue;
            }
            let held = held_cpus(&self.slots, Some(i), &self.host.settings.cores);
            let slot = &mut self.slots[i];
            let key = slot.key();
            let wanted = match &slot.state {
                SlotState::Moving { to } => to,
                _ => &slot.spec,
            };
            if must_wait(wanted, &held) {
                debug!(instance = %key, "waits for a stopping instance to leave its CPUs");
                out.waiting.push(key);
                continue;
            }
            let done = match slot.state {
                SlotState::Moving { .. } => self.host.finish_move(slot).map(|moved| {
                    if moved {
                        out.moved.push(key);
                    }
                }),
                _ => self.host.start(slot, now).map(|()| out.started.push(key)),
            };
            if let Err(e) = done {
                out.errors.push(e);
            }
        }
    }
}

impl Host {
    /// Moves a `Moving` slot's process in place to the CPUs (and memory nodes) it is wanted on;
    /// returns whether anything was written. On failure it stays `Running` where it was, its
    /// spec unchanged, so the next `reconcile` tries again (as for a move that never waited).
    pub(super) fn finish_move(&mut self, slot: &mut Slot) -> Result<bool, InstanceError> {
        let SlotState::Moving { to } = std::mem::replace(&mut slot.state, SlotState::Running)
        else {
            return Ok(false);
        };
        let moved = self.move_in_place(slot, &to)?;
        slot.spec = to;
        Ok(moved)
    }
}

/// The CPUs another instance's process still runs on though the plan gave them away.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Held {
    /// A stopping instance's, for up to `stop_grace` (SIGKILL after it): an online instance
    /// waits for them; an offline one does not (it shares its cores anyway, training's included,
    /// and the stopping instance is on its way out).
    pub(super) stopping: CpuSet,
    /// An online instance's that waits to move in place and serves there meanwhile: every
    /// instance waits for them, an offline one too (an online instance's cores are its own
    /// while it serves on them).
    pub(super) serving: CpuSet,
    /// The whole physical cores of `serving` (their SMT siblings too, where the node's cores
    /// are known): an offline instance waits for these, as placement never puts one beside an
    /// online thread.
    pub(super) serving_cores: CpuSet,
}

/// What is [`Held`], `except`'s CPUs aside (a slot deciding its own start or move); `cores`:
/// the node's physical cores (`InstanceSettings::cores`; empty: none known). A stopping
/// process that SIGKILL did not end within `KILL_WAIT` (reported `Unkillable`) no longer
/// counts: it is stuck in the kernel, not computing, and would hold its CPUs' next instance off
/// for good. Waits to move chain (an instance waits to move onto the CPUs of one that waits
/// for a stopping instance); a cycle of moves alone (a swap) waits for nothing, as every
/// instance in it is running.
pub(super) fn held_cpus(slots: &[Slot], except: Option<usize>, cores: &[CpuSet]) -> Held {
    let mut held = Held::default();
    for (i, slot) in slots.iter().enumerate() {
        let stopping = matches!(slot.state, SlotState::Stopping { stuck: false, .. });
        if stopping && slot.run.is_some() && Some(i) != except {
            held.stopping = held.stopping.union(&slot.spec.cpus);
        }
    }
    // The waiting moves: those whose new CPUs are held, until no more are found.
    let mut waits: Vec<usize> = Vec::new();
    loop {
        let before = waits.len();
        for (i, slot) in slots.iter().enumerate() {
            let SlotState::Moving { to } = &slot.state else {
                continue;
            };
            if Some(i) == except || slot.run.is_none() || waits.contains(&i) {
                continue;
            }
            if must_wait(to, &held) {
                if !slot.spec.offline {
                    held.serving = held.serving.union(&slot.spec.cpus);
                    for core in cores.iter().filter(|c| !c.is_disjoint(&slot.spec.cpus)) {
                        held.serving_cores = held.serving_cores.union(core);
                    }
                }
                waits.push(i);
            }
        }
        if waits.len() == before {
            return held;
        }
    }
}

/// Whether `spec` must wait before it starts or moves: on a CPU an online instance waiting to
/// move still serves on, or, for an online instance (exclusive cores, Cloud Reamer §III-A), on
/// a CPU a stopping instance still runs on, or, for an offline one, on that serving CPU's SMT
/// sibling ([`Held`]).
pub(super) fn must_wait(spec: &InstanceSpec, held: &Held) -> bool {
    !spec.cpus.is_disjoint(&held.serving)
        || (!spec.offline && !spec.cpus.is_disjoint(&held.stopping))
        || (spec.offline && !spec.cpus.is_disjoint(&held.serving_cores))
}
