//! The online jobs' layout search (Cloud Reamer §III-B): which layout a job runs now (a probe,
//! the search's outcome or a cached one) and what a finished probe measured. Part of the
//! inference controller; touches only its searches and the jobs lent by the tick.

use std::time::{Duration, Instant};

use tracing::{debug, info};

use super::inference::Inference;
use super::TickCx;
use crate::enforce::instances::{InstanceState, InstanceStats, Instances};
use crate::job::JobId;
use crate::policy::inference::{LayoutConfig, LayoutSearch, ProbeResult, SearchStart, SearchStep};
use crate::store::SearchUnderWay;

/// An online job's layout search between two probes.
pub(super) struct SearchRun {
    pub(super) search: LayoutSearch,
    pub(super) probe: LayoutConfig,
    since: Instant,
    free_cores: u32,
}

impl Inference {
    /// The layout an online job runs now: a probe of its search, the search's outcome for this
    /// many free cores, or a cached one (Cloud Reamer §III-B).
    pub(super) fn online_layout(
        &mut self,
        cx: &mut TickCx<'_>,
        id: &JobId,
        free_cores: u32,
        stats: &[InstanceStats],
    ) -> Option<LayoutConfig> {
        let stored = cx.state.jobs.get_mut(id)?;
        let now = Instant::now();
        // A search a previous lodgerd had under way resumes at the probe it ran (its instances
        // were adopted): nothing restarts because lodgerd did.
        if !self.searches.contains_key(id) {
            if let Some(kept) = stored.lodging.search.take() {
                if kept.free_cores == free_cores {
                    info!(job = %id, probe = %kept.probe, "layout search resumed");
                    self.searches.insert(
                        id.clone(),
                        SearchRun {
                            search: kept.search,
                            probe: kept.probe,
                            since: now,
                            free_cores,
                        },
                    );
                }
            }
        }
        let layout = self.layout_now(stored, id, free_cores, stats, cx.observations, now);
        // What a restart needs of the search under way (persisted with the plan it changes).
        stored.lodging.search = self.searches.get(id).map(|run| SearchUnderWay {
            search: run.search.clone(),
            probe: run.probe,
            free_cores: run.free_cores,
        });
        layout
    }

    fn layout_now(
        &mut self,
        stored: &mut crate::store::StoredJob,
        id: &JobId,
        free_cores: u32,
        stats: &[InstanceStats],
        observations: &crate::sense::Observations,
        now: Instant,
    ) -> Option<LayoutConfig> {
        let inf = stored.job.spec.inference.as_ref()?;
        let slo = inf.slo_ms.unwrap_or(f64::MAX);
        let max_batch = inf.max_batch;
        let max_instances = inf.max_instances.unwrap_or(free_cores.max(1));
        if let Some(run) = self.searches.get_mut(id) {
            if run.free_cores == free_cores {
                let measured = probe_result(
                    id,
                    run.probe,
                    stats,
                    &self.runner,
                    observations.jobs.get(id),
                    self.probe_window,
                    now.saturating_duration_since(run.since),
                );
                let overdue = now.duration_since(run.since) > self.probe_window * 3;
                if measured.is_none() && !overdue {
                    return Some(run.probe);
                }
                match run.search.next(measured) {
                    SearchStep::Probe(cfg) => {
                        debug!(job = %id, probe = %cfg, probes = run.search.probes_used(), "layout probe");
                        run.probe = cfg;
                        run.since = now;
                        return Some(cfg);
                    }
                    SearchStep::Done(outcome) => {
                        info!(
                            job = %id,
                            layout = %outcome.config,
                            probes = outcome.probes,
                            meets_slo = outcome.meets_slo,
                            "layout search done"
                        );
                        self.searches.remove(id);
                        stored.lodging.cache.insert(outcome.clone());
                        let cfg = outcome.config;
                        stored.lodging.outcome = Some(outcome);
                        return Some(cfg);
                    }
                }
            }
            // The free cores changed under the search: start again for the new count.
            self.searches.remove(id);
        }
        if let Some(o) = &stored.lodging.outcome {
            if o.free_cores == free_cores {
                return Some(o.config);
            }
        }
        match stored
            .lodging
            .cache
            .begin(free_cores, slo, max_batch, max_instances)
        {
            SearchStart::Cached(outcome) => {
                let cfg = outcome.config;
                stored.lodging.outcome = Some(outcome);
                Some(cfg)
            }
            SearchStart::Search(mut search) => match search.next(None) {
                SearchStep::Probe(cfg) => {
                    info!(job = %id, free_cores, "searching for the best layout");
                    self.searches.insert(
                        id.clone(),
                        SearchRun {
                            search,
                            probe: cfg,
                            since: now,
                            free_cores,
                        },
                    );
                    Some(cfg)
                }
                SearchStep::Done(outcome) => {
                    let cfg = outcome.config;
                    stored.lodging.outcome = Some(outcome);
                    Some(cfg)
                }
            },
        }
    }
}

/// The measurement of one layout probe of an online job: throughput summed over its instances,
/// the p99 and median of every instance's batches pooled (`Instances::pooled_latency`, asked
/// only once the probe is ready: the latency the job's requests see, from all the batches the
/// window holds), IPC and cache misses
/// from the sensor. `None` until every instance of the probed layout has run for most of a
/// window, and until the probe has been in force for a whole window (`age`), so that the
/// window holds nothing measured under the layout before it ([`probe_ready`]).
///
/// Pooled, not the worst instance's own p99: with many instances each holding a few dozen
/// batches, the worst of their p99s is near the largest of all the batches, well above the
/// requests' p99, and it held the search off the many-instance layouts (docs/benchmarks.md,
/// session 23).
fn probe_result(
    id: &JobId,
    probe: LayoutConfig,
    stats: &[InstanceStats],
    runner: &Instances,
    sensed: Option<&crate::sense::JobMetrics>,
    window: Duration,
    age: Duration,
) -> Option<ProbeResult> {
    let mine: Vec<&InstanceStats> = stats.iter().filter(|s| s.job == *id).collect();
    if !probe_ready(probe, &mine, age, window) {
        return None;
    }
    let pooled = runner.pooled_latency(id)?;
    Some(ProbeResult {
        config: probe,
        throughput_per_s: mine.iter().map(|s| s.items_per_s).sum(),
        p99_latency_ms: pooled.p99_ms,
        ipc: sensed.and_then(|m| m.ipc),
        cache_miss_ratio: sensed.and_then(|m| m.cache_miss_percent).map(|p| p / 100.0),
        latency_samples: u32::try_from(pooled.batches).unwrap_or(u32::MAX),
        p50_latency_ms: Some(pooled.p50_ms),
    })
}

/// Whether `mine` (the job's instances) measure `probe`, which has been in force for `age`:
/// exactly its instances, each running its threads and batch for most of a window, and the
/// probe for a whole window. The last matters when a probe runs fewer instances of the same
/// size and batch: the instances it keeps run on, their windows filled under the previous
/// layout with more instances beside them, and would be taken as this probe's measurement as
/// soon as the others are gone.
fn probe_ready(
    probe: LayoutConfig,
    mine: &[&InstanceStats],
    age: Duration,
    window: Duration,
) -> bool {
    probe.instances > 0
        && age >= window
        && u32::try_from(mine.len()).unwrap_or(0) == probe.instances
        && mine.iter().all(|s| {
            matches!(s.state, InstanceState::Running)
                && s.threads == probe.cores_per_instance
                && s.batch == probe.batch
                && s.span * 5 >= window * 4
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(10);

    /// A running instance of job 1 with `threads` threads and batch 8, whose window is full.
    fn inst(index: u32, threads: u32) -> InstanceStats {
        let cpus = (index * threads..(index + 1) * threads).collect();
        InstanceStats {
            uptime: WINDOW * 6,
            span: WINDOW,
            items_per_s: 100.0,
            latency_p50_ms: Some(10.0),
            latency_p99_ms: Some(20.0),
            latency_samples: 50,
            items_total: 5000,
            reports_total: 500,
            ..InstanceStats::running(JobId::from_seq(1), index, cpus, 8)
        }
    }

    fn layout(cores_per_instance: u32, instances: u32) -> LayoutConfig {
        LayoutConfig {
            cores_per_instance,
            instances,
            batch: 8,
        }
    }

    /// Review finding (placement): a probe of fewer instances of the same size and batch kept
    /// the first ones running, their windows full of what they served beside the others, and
    /// was judged on that as soon as the others were reaped, a tick or two into the probe.
    #[test]
    fn a_probe_is_measured_only_once_it_filled_a_window() {
        let stats = [inst(0, 2), inst(1, 2)];
        let mine: Vec<&InstanceStats> = stats.iter().collect();
        // 4 → 2 instances of 2 CPUs: the two kept ones look measured at once.
        let probe = layout(2, 2);
        assert!(!probe_ready(probe, &mine, Duration::from_secs(1), WINDOW));
        assert!(!probe_ready(probe, &mine, WINDOW * 4 / 5, WINDOW));
        assert!(probe_ready(probe, &mine, WINDOW, WINDOW));
        // Other instances than the probe's, or one still young: not yet, however long.
        assert!(!probe_ready(layout(2, 3), &mine, WINDOW * 2, WINDOW));
        assert!(!probe_ready(layout(1, 2), &mine, WINDOW * 2, WINDOW));
        let mut young = [inst(0, 2), inst(1, 2)];
        young[1].span = WINDOW / 2;
        let young: Vec<&InstanceStats> = young.iter().collect();
        assert!(!probe_ready(probe, &young, WINDOW * 2, WINDOW));
        assert!(!probe_ready(layout(2, 0), &[], WINDOW * 2, WINDOW));
    }
}
