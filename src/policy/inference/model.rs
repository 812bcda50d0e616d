//! A synthetic performance model of CPU inference (test-only): what the layout search's tests
//! measure against, with the exhaustive optimum to compare the search with.

#![allow(clippy::unwrap_used)]

use super::search::*;
use super::types::LayoutConfig;
use crate::rng::Rng;

// -----------------------------------------------------------------------------------------
// A synthetic performance model for the search

/// Throughput and latency of a CPU inference model as functions of the layout: Amdahl
/// scaling inside an instance, batching amortizing per-item cost (IPC rising with batch),
/// and a cache knee: an instance's activations (∝ batch) overflowing its share of the cache
/// (∝ its cores) slow it down, cut IPC and raise misses, and load memory bandwidth shared
/// by all instances.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PerfModel {
    pub(crate) name: &'static str,
    pub(crate) free: u32,
    pub(crate) slo_ms: f64,
    pub(crate) max_batch: u32,
    pub(crate) max_instances: u32,
    /// One core's milliseconds per item at batch 1.
    pub(crate) item_ms: f64,
    /// Fixed cost per batch (framework overhead).
    pub(crate) batch_ms: f64,
    /// Amdahl serial fraction inside one instance.
    pub(crate) serial: f64,
    /// Per-item efficiency gain from batching: efficiency b(1+b0)/(b+b0), 1 at batch 1.
    pub(crate) b0: f64,
    /// Cache (MB) per core; an instance's working set: its copy of the weights plus the
    /// activations (MB) of each item in a batch.
    pub(crate) cache_per_core_mb: f64,
    pub(crate) weights_mb: f64,
    pub(crate) act_mb: f64,
    /// Slowdown per unit of working set overflowing the instance's cache share.
    pub(crate) miss_penalty: f64,
    /// Relative measurement noise (uniform ±).
    pub(crate) noise: f64,
    pub(crate) counters: bool,
}

pub(crate) struct Truth {
    pub(crate) throughput: f64,
    pub(crate) p99: f64,
    pub(crate) ipc: f64,
    pub(crate) miss: f64,
}

impl PerfModel {
    pub(crate) fn truth(&self, c: &LayoutConfig) -> Truth {
        let cores = f64::from(c.cores_per_instance);
        let n = f64::from(c.instances);
        let b = f64::from(c.batch);
        let speedup = 1.0 / (self.serial + (1.0 - self.serial) / cores);
        let eff = b * (1.0 + self.b0) / (b + self.b0);
        let ws = self.weights_mb + self.act_mb * b;
        let share = self.cache_per_core_mb * cores;
        let overflow = ((ws - share) / ws).max(0.0);
        let slow = 1.0 + self.miss_penalty * overflow;
        // Memory bandwidth: instances that miss load each other.
        let busy = n * cores / f64::from(self.free);
        let contention = 1.0 + 0.5 * overflow * busy;
        let batch_latency =
            (self.batch_ms + self.item_ms * b / (speedup * eff) * slow) * contention;
        Truth {
            throughput: n * b / batch_latency * 1000.0,
            p99: batch_latency * 1.15,
            ipc: 0.8 * eff / slow / contention,
            miss: 0.03 + 0.5 * overflow,
        }
    }

    /// The best layout within the SLO over every uniform layout: every cores per instance,
    /// every instance count that fits, every batch.
    pub(crate) fn exhaustive(&self) -> Option<(LayoutConfig, f64, usize)> {
        let mut best: Option<(LayoutConfig, f64)> = None;
        let mut evaluated = 0;
        for c in 1..=self.free {
            for n in 1..=(self.free / c).min(self.max_instances) {
                for b in 1..=self.max_batch {
                    let config = LayoutConfig {
                        cores_per_instance: c,
                        instances: n,
                        batch: b,
                    };
                    evaluated += 1;
                    let t = self.truth(&config);
                    if t.p99 <= self.slo_ms && best.is_none_or(|(_, tp)| t.throughput > tp) {
                        best = Some((config, t.throughput));
                    }
                }
            }
        }
        best.map(|(c, tp)| (c, tp, evaluated))
    }
}

pub(crate) struct SearchRun {
    pub(crate) found: SearchOutcome,
    pub(crate) probes: u32,
    pub(crate) true_throughput: f64,
    pub(crate) true_p99: f64,
}

pub(crate) fn drive(model: &PerfModel, seed: u64, search: LayoutSearch) -> SearchRun {
    let mut rng = Rng::splitmix(seed);
    let mut search = search;
    let mut last = None;
    let mut asked = 0;
    loop {
        match search.next(last.take()) {
            SearchStep::Probe(config) => {
                asked += 1;
                if std::env::var("TRACE")
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    == Some(seed)
                {
                    let t = model.truth(&config);
                    println!(
                        "   probe {asked}: {config}  tp {:.0} p99 {:.0} ipc {:.2} miss {:.2}",
                        t.throughput, t.p99, t.ipc, t.miss
                    );
                }
                assert!(asked <= 100, "{}: the search does not end", model.name);
                let t = model.truth(&config);
                last = Some(ProbeResult {
                    config,
                    throughput_per_s: t.throughput * rng.jitter(model.noise),
                    p99_latency_ms: t.p99 * rng.jitter(model.noise),
                    ipc: model.counters.then(|| t.ipc * rng.jitter(model.noise)),
                    cache_miss_ratio: model.counters.then(|| t.miss * rng.jitter(model.noise)),
                });
            }
            SearchStep::Done(found) => {
                let t = model.truth(&found.config);
                return SearchRun {
                    probes: found.probes,
                    true_throughput: t.throughput,
                    true_p99: t.p99,
                    found,
                };
            }
        }
    }
}

pub(crate) fn search_for(model: &PerfModel) -> LayoutSearch {
    LayoutSearch::new(
        model.free,
        model.slo_ms,
        model.max_batch,
        model.max_instances,
    )
}

/// DeepSpeech-like (Fig. 5): little activation data, strong batching gains, scales well.
pub(crate) const COMPUTE_BOUND: PerfModel = PerfModel {
    name: "compute-bound",
    free: 32,
    slo_ms: 800.0,
    max_batch: 64,
    max_instances: 64,
    item_ms: 60.0,
    batch_ms: 4.0,
    serial: 0.03,
    b0: 6.0,
    cache_per_core_mb: 1.5,
    weights_mb: 6.0,
    act_mb: 0.02,
    miss_penalty: 1.0,
    noise: 0.03,
    counters: true,
};

/// ResNet101-like (Fig. 5): activations overflow the cache past a small batch, poor
/// scaling inside an instance.
pub(crate) const SMALL_CACHE: PerfModel = PerfModel {
    name: "small-cache",
    free: 32,
    slo_ms: 300.0,
    max_batch: 64,
    max_instances: 64,
    item_ms: 25.0,
    batch_ms: 6.0,
    serial: 0.2,
    b0: 1.5,
    cache_per_core_mb: 1.5,
    weights_mb: 0.5,
    act_mb: 1.2,
    miss_penalty: 2.5,
    noise: 0.03,
    counters: true,
};

/// BERT-like: in between.
pub(crate) const BALANCED: PerfModel = PerfModel {
    name: "balanced",
    free: 32,
    slo_ms: 400.0,
    max_batch: 32,
    max_instances: 64,
    item_ms: 40.0,
    batch_ms: 5.0,
    serial: 0.08,
    b0: 3.0,
    cache_per_core_mb: 1.5,
    weights_mb: 2.0,
    act_mb: 0.4,
    miss_penalty: 1.5,
    noise: 0.03,
    counters: true,
};

pub(crate) fn model_shapes() -> Vec<PerfModel> {
    vec![
        COMPUTE_BOUND,
        SMALL_CACHE,
        BALANCED,
        PerfModel {
            name: "balanced, no counters",
            counters: false,
            ..BALANCED
        },
        PerfModel {
            name: "small-cache, tight SLO",
            slo_ms: 40.0,
            ..SMALL_CACHE
        },
        PerfModel {
            name: "compute-bound, 16 CPUs",
            free: 16,
            ..COMPUTE_BOUND
        },
        PerfModel {
            name: "small-cache, 64 CPUs",
            free: 64,
            ..SMALL_CACHE
        },
        PerfModel {
            name: "balanced, 8 CPUs, noisy",
            free: 8,
            noise: 0.08,
            ..BALANCED
        },
        PerfModel {
            name: "compute-bound, ≤2 inst.",
            max_instances: 2,
            ..COMPUTE_BOUND
        },
        PerfModel {
            name: "small-cache, 24 CPUs",
            free: 24,
            slo_ms: 120.0,
            max_batch: 32,
            ..SMALL_CACHE
        },
    ]
}

/// Gap to the exhaustive optimum, in percent of it, of each of `seeds` noisy searches; a
/// result that truly misses the SLO counts as a 100% gap.
fn gaps(model: &PerfModel, opt_tp: f64, budget: u32, seeds: u64) -> (Vec<f64>, Vec<u32>) {
    let options = SearchOptions {
        probe_budget: budget,
        ..SearchOptions::default()
    };
    (0..seeds)
        .map(|seed| {
            let run = drive(model, seed, search_for(model).with_options(options));
            let gap = if run.true_p99 <= model.slo_ms {
                (opt_tp - run.true_throughput) / opt_tp * 100.0
            } else {
                100.0
            };
            (gap, run.probes)
        })
        .unzip()
}

/// The search against the exhaustive optimum on the synthetic model (issue benchmark (d),
/// simulated). `cargo test --lib simulated_search -- --nocapture` prints the table.
#[test]
fn simulated_search_reaches_near_the_exhaustive_optimum() {
    const SEEDS: u64 = 20;
    println!(
        "{:<24} {:>4} {:>6} {:>21} {:>7} | {:>21} {:>5} {:>5} {:>6} | {:>5} {:>5} {:>6}",
        "model",
        "CPUs",
        "space",
        "exhaustive best",
        "req/s",
        "search (seed 0)",
        "gap%",
        "worst",
        "probes",
        "gap16",
        "worst",
        "probes"
    );
    for model in model_shapes() {
        let (opt, opt_tp, space) = model.exhaustive().unwrap();
        let seed0 = drive(&model, 0, search_for(&model));
        let (g12, p12) = gaps(&model, opt_tp, DEFAULT_PROBE_BUDGET, SEEDS);
        let (g16, p16) = gaps(&model, opt_tp, 16, SEEDS);
        let mean = |g: &[f64]| g.iter().sum::<f64>() / g.len() as f64;
        let worst = |g: &[f64]| g.iter().copied().fold(0.0, f64::max);
        let avg = |p: &[u32]| f64::from(p.iter().sum::<u32>()) / p.len() as f64;
        println!(
            "{:<24} {:>4} {:>6} {:>21} {:>7.0} | {:>21} {:>5.1} {:>5.1} {:>6.1} | {:>5.1} {:>5.1} {:>6.1}",
            model.name,
            model.free,
            space,
            opt.to_string(),
            opt_tp,
            seed0.found.config.to_string(),
            mean(&g12),
            worst(&g12),
            avg(&p12),
            mean(&g16),
            worst(&g16),
            avg(&p16),
        );
        assert!(
            p12.iter().all(|&p| p <= DEFAULT_PROBE_BUDGET),
            "{}",
            model.name
        );
        assert!(p16.iter().all(|&p| p <= 16), "{}", model.name);
        assert!(
            worst(&g12) <= 15.0 && mean(&g12) <= 10.0,
            "{}: {:.1}% mean, {:.1}% worst with {} probes",
            model.name,
            mean(&g12),
            worst(&g12),
            DEFAULT_PROBE_BUDGET
        );
        assert!(
            worst(&g16) <= 10.0 && mean(&g16) <= 5.0,
            "{}: {:.1}% mean, {:.1}% worst with 16 probes",
            model.name,
            mean(&g16),
            worst(&g16)
        );
    }
}
