//! The batch of an offline job's instances on training cores (issue 14 item 3): measures the
//! job's CPU time per item from its instances' reports, decides the smaller batch once
//! (`policy::inference::batch_within`), keeps the decision in the job's lodging and logs it.
//! Touches nothing but the job's lodging.

use tracing::info;

use crate::cpuset::CpuSet;
use crate::enforce::instances::{InstanceState, InstanceStats};
use crate::job::JobId;
use crate::policy::inference::batch_within;
use crate::store::{Lodging, TrainingBatch};

/// Batches a job's measured instances must have completed, in all, before its time per item is
/// taken: a batch that takes seconds leaves one or two in a probe window, and one alone may be
/// a cold start.
pub(super) const MIN_BATCHES: u64 = 3;

/// The job's CPU time per item in ms: the median over its running instances of the p50 batch
/// latency over the items a batch carried (the window's mean; the instance's batch when the
/// window has none). Only instances on idle CPUs (outside `training`) count when the job has
/// any there: on a training core training pre-empts the batch, and its latency is not its CPU
/// time. None until those instances have completed [`MIN_BATCHES`] batches in all.
pub(super) fn ms_per_item(stats: &[InstanceStats], id: &JobId, training: &CpuSet) -> Option<f64> {
    let mine: Vec<&InstanceStats> = stats.iter().filter(|s| s.job == *id).collect();
    let any_idle = mine.iter().any(|s| s.cpus.is_disjoint(training));
    let measured: Vec<&InstanceStats> = mine
        .into_iter()
        .filter(|s| !any_idle || s.cpus.is_disjoint(training))
        .filter(|s| matches!(s.state, InstanceState::Running) && s.latency_samples > 0)
        .collect();
    let batches: u64 = measured.iter().map(|s| s.reports_total).sum();
    if batches < MIN_BATCHES {
        return None;
    }
    let mut per_item: Vec<f64> = measured
        .iter()
        .filter_map(|s| {
            let p50 = s.latency_p50_ms.filter(|p| p.is_finite() && *p > 0.0)?;
            let items = s.items_per_s * s.span.as_secs_f64() / s.latency_samples as f64;
            let items = if items.is_finite() && items >= 1.0 {
                items
            } else {
                f64::from(s.batch.max(1))
            };
            Some(p50 / items)
        })
        .collect();
    if per_item.is_empty() {
        return None;
    }
    per_item.sort_by(f64::total_cmp);
    // The upper median: between two, the slower (the smaller batch).
    per_item.get(per_item.len() / 2).copied()
}

/// The batch of the job's instances on training CPUs for placement (None: the job's `batch`).
/// Decided once, when [`ms_per_item`] first has a figure, and kept in `lodging` (across
/// restarts too, so the plan a restarted lodgerd makes restarts no instance); decided again only
/// when the job's batch or `bound_ms` differ from those it was decided for, the old batch held
/// meanwhile. `bound_ms` 0: off.
pub(super) fn training_batch(
    lodging: &mut Lodging,
    id: &JobId,
    batch: u32,
    bound_ms: u32,
    stats: &[InstanceStats],
    training: &CpuSet,
) -> Option<u32> {
    if bound_ms == 0 || batch <= 1 {
        return None;
    }
    let held = match &lodging.training_batch {
        Some(d) if d.job_batch == batch && d.bound_ms == bound_ms => return Some(d.batch),
        Some(d) => Some(d.batch.min(batch)),
        None => None,
    };
    let Some(ms) = ms_per_item(stats, id, training) else {
        return held;
    };
    let smaller = batch_within(ms, bound_ms, batch);
    if smaller < batch {
        info!(
            job = %id,
            "offline instances on training cores run batch {smaller} instead of {batch}: a batch \
             of {batch} takes ~{:.0} ms of CPU ({ms:.1} ms an item), over \
             inference.training_core_batch_ms = {bound_ms}, and would hold the training cores' \
             caches that long",
            ms * f64::from(batch)
        );
    }
    lodging.training_batch = Some(TrainingBatch {
        batch: smaller,
        job_batch: batch,
        bound_ms,
        ms_per_item: ms,
    });
    Some(smaller)
}

/// What `lodgerctl show` says about the decision, after the job's layout (empty when the batch
/// on training cores is the job's).
pub(super) fn describe(lodging: &Lodging, bound_ms: u32) -> String {
    match &lodging.training_batch {
        Some(d) if bound_ms != 0 && d.batch < d.job_batch => format!(
            "; batch {} on training cores (a batch of {} takes ~{:.0} ms, over \
             inference.training_core_batch_ms = {})",
            d.batch,
            d.job_batch,
            d.ms_per_item * f64::from(d.job_batch),
            d.bound_ms
        ),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn id(seq: u64) -> JobId {
        JobId::from_seq(seq)
    }

    /// A running instance of job 1 on `cpu` with batch `batch` whose window holds `batches`
    /// full batches of `ms` each over 10 s.
    fn inst(cpu: u32, batch: u32, ms: f64, batches: u64) -> InstanceStats {
        let span = Duration::from_secs(10);
        InstanceStats {
            uptime: span,
            span,
            items_per_s: (batches * u64::from(batch)) as f64 / span.as_secs_f64(),
            latency_p50_ms: (batches > 0).then_some(ms),
            latency_p99_ms: (batches > 0).then_some(ms),
            latency_samples: batches,
            items_total: batches * u64::from(batch),
            reports_total: batches,
            ..InstanceStats::running(id(1), cpu, [cpu].into_iter().collect(), batch)
        }
    }

    #[test]
    fn time_per_item_comes_from_idle_cores_once_enough_batches_are_in() {
        let training: CpuSet = [2, 3].into_iter().collect();
        // Idle CPUs 0 and 1: 640 ms and 700 ms batches of 64 (10 ms an item, 10.9 ms).
        // Training CPUs 2 and 3: pre-empted, 3 s a batch; not counted while idle ones exist.
        let mut stats = vec![
            inst(0, 64, 640.0, 1),
            inst(1, 64, 700.0, 1),
            inst(2, 64, 3000.0, 4),
            inst(3, 64, 3000.0, 4),
        ];
        assert_eq!(ms_per_item(&stats, &id(1), &training), None, "2 batches");
        stats[1] = inst(1, 64, 700.0, 2);
        let ms = ms_per_item(&stats, &id(1), &training).unwrap();
        assert!((ms - 700.0 / 64.0).abs() < 1e-9, "{ms}");
        // Another job's instances do not count.
        assert_eq!(ms_per_item(&stats, &id(2), &training), None);
        // Only training CPUs: their figures are all there is.
        let all: CpuSet = (0..4).collect();
        let ms = ms_per_item(&stats, &id(1), &all).unwrap();
        assert!((ms - 3000.0 / 64.0).abs() < 1e-9, "{ms}");
        // Partial batches: per item of what a batch carried (16 items in 160 ms: 10 ms).
        let mut partial = inst(0, 64, 160.0, 5);
        partial.items_per_s = 5.0 * 16.0 / 10.0;
        let ms = ms_per_item(&[partial], &id(1), &training).unwrap();
        assert!((ms - 10.0).abs() < 1e-9, "{ms}");
        // An instance not running is not measured.
        let mut gone = inst(0, 64, 640.0, 5);
        gone.state = InstanceState::Stopping { restarting: false };
        assert_eq!(ms_per_item(&[gone], &id(1), &training), None);
    }

    #[test]
    fn the_batch_on_training_cores_is_decided_once_and_kept() {
        let training: CpuSet = [1].into_iter().collect();
        let mut lodging = Lodging::default();
        // Nothing measured yet: the job's batch.
        let none = [inst(0, 64, 640.0, 0)];
        assert_eq!(
            training_batch(&mut lodging, &id(1), 64, 100, &none, &training),
            None
        );
        // 10 ms an item, 100 ms bound: 10 items.
        let slow = [inst(0, 64, 640.0, 3)];
        assert_eq!(
            training_batch(&mut lodging, &id(1), 64, 100, &slow, &training),
            Some(10)
        );
        let d = lodging.training_batch.clone().unwrap();
        assert_eq!((d.batch, d.job_batch, d.bound_ms), (10, 64, 100));
        assert!(describe(&lodging, 100).contains("batch 10 on training cores"));
        // Later figures (faster, or none at all) change nothing: no flapping, no restarts.
        let fast = [inst(0, 64, 64.0, 30)];
        for stats in [&fast[..], &none[..], &[]] {
            assert_eq!(
                training_batch(&mut lodging, &id(1), 64, 100, stats, &training),
                Some(10)
            );
        }
        // Off: the job's batch everywhere, and show says nothing of it.
        assert_eq!(
            training_batch(&mut lodging, &id(1), 64, 0, &slow, &training),
            None
        );
        assert_eq!(describe(&lodging, 0), "");
        // Another bound: the old batch held until measured, then decided again.
        assert_eq!(
            training_batch(&mut lodging, &id(1), 64, 200, &none, &training),
            Some(10)
        );
        assert_eq!(
            training_batch(&mut lodging, &id(1), 64, 200, &slow, &training),
            Some(20)
        );
        // Fast items: decided, equal to the job's batch; show adds nothing.
        let mut quick = Lodging::default();
        assert_eq!(
            training_batch(&mut quick, &id(1), 64, 100, &fast, &training),
            Some(64)
        );
        assert_eq!(describe(&quick, 100), "");
        // A batch of 1 cannot shrink.
        assert_eq!(
            training_batch(&mut Lodging::default(), &id(1), 1, 100, &slow, &training),
            None
        );
    }
}
