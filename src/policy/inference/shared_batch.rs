//! The batch of an offline instance on a training job's core (issue 14 item 3): small enough
//! that one batch does not hold the core's caches for long. Pure: touches nothing.
//!
//! An offline instance on a training core runs below training (SCHED_RR pre-empts it, or it is
//! SCHED_IDLE), so it never delays a training thread directly; but each batch it runs between
//! training's bursts fills the core's private caches with the model's weights and activations,
//! and a batch that takes seconds of CPU (a memory-heavy model) keeps doing so for seconds.
//! Cloud Reamer (§III-A, Fig. 6) sizes offline work as many single-thread instances so that none
//! is a straggler; this bounds each one's batch on the cores it shares with training the same
//! way.

/// The largest batch, at least 1 and at most `batch`, whose expected time (`ms_per_item` ×
/// items) stays within `bound_ms`; `batch` itself when the bound is off (0), the job's batch is
/// 0, or the measurement is not a positive finite number.
pub fn batch_within(ms_per_item: f64, bound_ms: u32, batch: u32) -> u32 {
    if bound_ms == 0 || batch == 0 || !ms_per_item.is_finite() || ms_per_item <= 0.0 {
        return batch;
    }
    let fit = (f64::from(bound_ms) / ms_per_item).floor();
    if fit >= f64::from(batch) {
        batch
    } else if fit < 1.0 {
        1
    } else {
        // 1 <= fit < batch <= u32::MAX: the cast is exact.
        fit as u32
    }
}
