//! Contention elimination (SODA §V-E): detects memory-bandwidth contention that slows training,
//! names the suspected antagonists, and decides throttle steps for the lodgers (MBA, else core
//! halving) and when to give them back. Pure: observations and the time are arguments; no I/O.
//!
//! One [`ContentionEliminator`] per node is a small state machine driven once per tick by
//! [`ContentionEliminator::step`]. It returns the changes as [`ThrottleAction`]s (for signals,
//! logs and counters) and keeps the whole throttle state, [`ContentionEliminator::throttles`],
//! for an idempotent enforcer to make true.
//!
//! Detection (SODA §V-E):
//! - with MBM, the node's memory bandwidth at or above `membw_threshold` of its peak (75%, from
//!   §IV-C-1: 5 of 8 models lose 8.1% at 50% bandwidth pressure) for `pressure_ticks`
//!   consecutive ticks;
//! - without MBM, a training job's progress (GPU utilization, or the emulator's iteration rate)
//!   below its stable level by more than its noise, for `pressure_ticks` consecutive ticks,
//!   while a lodger runs. The stable level is given (profiled offline, as SODA does) or learnt
//!   here while no lodger runs;
//! - either way, and beyond SODA (issue 19), a training job stalled on memory (PSI `some` of its
//!   own cgroup, else the node's) for `memory_pressure_percent` of a pass while a lodger runs;
//!   calm needs every training job below `memory_pressure_calm_percent` as well.
//!
//! Escalation, one step per `pressure_ticks` of pressure, in this order:
//! 1. batch and offline inference: their MBA group one MBA step down (where MBA exists), else
//!    (and once MBA is at its floor) halve the top-ranked antagonist's cores, down to a floor;
//! 2. online inference, last, and only jobs whose latency SLO holds: the same on their group;
//! 3. training: never.
//!
//! Steps are given back one at a time, last taken first, after `calm_ticks` calm ticks. A
//! relapse (pressure soon after a give-back) doubles the calm needed for the next give-back, up
//! to `max_calm_ticks`, so a throttle that is needed is not flapped on and off.
//!
//! A restart changes none of it: [`HeldContention`] is what the state file keeps (issue 17).

use crate::sys::resctrlfs::{MbaCaps, MbaUnit};

#[cfg(test)]
mod amd_tests;
mod config;
mod detect;
mod eliminator;
mod held;
#[cfg(test)]
mod held_tests;
mod ladder;
mod mba;
#[cfg(test)]
mod pressure_tests;
#[cfg(test)]
mod tests;
mod types;

pub use config::{ContentionConfig, ContentionConfigError, Mode};
pub use eliminator::{ContentionEliminator, ContentionStatus};
pub use held::HeldContention;
pub use ladder::{halved_cores, max_halvings, MbaLadder};
pub use types::{
    Baseline, ContentionObservations, Detection, JobObservation, MbaGroup, Mechanism, MemoryStall,
    NodeMembw, RankedBy, Role, Signal, Slowdown, Suspect, ThrottleAction, Throttles,
};
