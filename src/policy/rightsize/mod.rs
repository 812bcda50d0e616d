//! Right-sizing a training job's cores from its GPU utilization: SODA's adaptive CPU allocator
//! (§V-B). Pure: no I/O, no clock; time and utilization samples are arguments.
//!
//! Two parts. [`start_cores`] picks the count a job starts at (§V-B-1) from its owner's
//! [`OwnerHistory`] or its category. A [`Tuner`] then searches, one measurement window at a
//! time, for the fewest cores at which the job's GPU utilization is at its maximum (§V-B-2):
//! the job's best-fit count, which SODA defines as the minimum count giving the maximal speed
//! and finds at the same count as the maximal GPU utilization (§IV-B-1).

mod fit;
pub mod model;
mod noise;
mod start;
#[cfg(test)]
mod tests;
mod tuner;
mod types;

pub use start::{
    category_default_per_gpu, default_floor, start_cores, CoreLimits, OwnerHistory, OwnerRecord,
    StartHints,
};
pub use tuner::{Tuner, MAX_EXTENSIONS, MIN_WINDOW_SAMPLES};
pub use types::{
    Decision, HoldReason, Probe, TunerAction, TunerSettings, DEFAULT_TOLERANCE, DEFAULT_WARMUP,
    DEFAULT_WINDOW,
};
