//! A family of synthetic CPU-inference performance models, for the layout search's benchmark
//! (`benches/layout.rs`) and tests: throughput and latency as functions of the layout, the
//! exhaustive best within an SLO, and noisy probes measured the way lodgerd measures them (a
//! window of batches, the p99 of every instance's batch latencies pooled). Kept apart from the
//! search ([`super::LayoutSearch`]), which sees only [`ProbeResult`]s, so a result is not tuned to
//! one curve. Plain arithmetic; touches nothing.
//!
//! # The model
//!
//! An instance of `c` logical CPUs serving batches of `b` requests takes on average
//!
//! ```text
//! mean(c, b) = (batch_ms + item_ms · b / (S(c) · E(b)) · F(b) · M(c, b)) · C(n, c, b)
//! ```
//!
//! - `S(c) = 1 / (serial + (1 − serial)/c)`: Amdahl scaling inside an instance (§III-A: one
//!   thread per core).
//! - `E(b) = b (1 + b0) / (b + b0)`: batching amortizes per-item work, so **IPC rises with batch**
//!   (Cloud Reamer §III-B, Fig. 5, DeepSpeech); 1 at batch 1, `1 + b0` for large batches.
//! - `F(b) = 1 + ipc_fall · log2 b`: **IPC falling with batch** without more cache misses (larger
//!   batches stall on memory bandwidth or synchronization).
//! - `M(c, b) = 1 + miss_penalty · overflow`: **cache misses rising with batch** (Fig. 5,
//!   ResNet101). The working set `weights_mb + act_mb · b` overflows the instance's cache share
//!   `cache_per_core_mb · c`; `overflow` is the fraction that does not fit. More cores per
//!   instance means more cache, so a cache-bound model may prefer larger instances.
//! - `C = 1 + bandwidth · overflow · n·c/free`: instances that miss load the shared memory
//!   bandwidth, more so the more of the machine they fill.
//!
//! Throughput of `n` instances is `n · b / mean`. A batch's latency is log-normal with mean
//! `mean(c, b)` and shape `lat_sigma`; the **true p99** is that distribution's 99th percentile.
//! Measured IPC is `0.8 · E / (F · M · C)`, the miss ratio `0.03 + 0.5 · overflow`.
//!
//! # A probe
//!
//! A probe runs the layout for `window_s` seconds. The whole window runs at a common speed
//! factor `1 + window_noise · N(0, 1)` (other tenants, frequency), each of the `n` instances
//! serves `window_s / mean` batches, and the probe's p99 is that of all `k` batches pooled (the
//! `⌈0.99·k⌉`-th of `k`, as lodgerd's weighted percentile over equal batches does, drawn
//! exactly as an order statistic), with their median and `k`. IPC and the miss ratio carry
//! `counter_noise`.
//!
//! # The family ([`Family`], [`PerfModel::random`])
//!
//! Every seed draws a shape from one family and every other parameter at random: the free CPUs
//! (8–192, log-uniform), the largest batch (16–128), an instance cap on a fifth of the seeds, the
//! per-item cost, the latency spread and window noise, whether counters exist (not in VMs), and
//! an SLO between 1.3× and 30× the batch-1 p99 of a 1-, 2-, 4- or 8-CPU instance.

use super::search::ProbeResult;
use super::types::LayoutConfig;
use crate::rng::Rng;

/// z of the 99th percentile of the standard normal.
const Z99: f64 = 2.326_347_874_040_841;

/// Which Cloud Reamer §III-B behaviour a random model stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Rising IPC and flat misses with batch (Fig. 5, DeepSpeech): strong batching gains, the
    /// working set fits the cache at every batch.
    ComputeBound,
    /// Falling IPC with batch, misses flat: little to gain from batching beyond overheads.
    FallingIpc,
    /// Rising misses with batch (Fig. 5, ResNet101): activations overflow the cache share past a
    /// small batch and load memory bandwidth.
    CacheBound,
    /// Every parameter drawn from the union of the ranges above.
    Mixed,
}

impl Family {
    pub const ALL: [Family; 4] = [
        Family::ComputeBound,
        Family::FallingIpc,
        Family::CacheBound,
        Family::Mixed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::ComputeBound => "compute-bound",
            Family::FallingIpc => "falling IPC",
            Family::CacheBound => "cache-bound",
            Family::Mixed => "mixed",
        }
    }
}

/// One model on one leftover; see the module documentation for the formula.
#[derive(Debug, Clone, Copy)]
pub struct PerfModel {
    pub name: &'static str,
    /// Free logical CPUs the search may use.
    pub free: u32,
    pub slo_ms: f64,
    pub max_batch: u32,
    pub max_instances: u32,
    /// One core's milliseconds per item at batch 1.
    pub item_ms: f64,
    /// Fixed cost per batch (framework overhead).
    pub batch_ms: f64,
    /// Amdahl serial fraction inside one instance.
    pub serial: f64,
    /// Batching gain `E(b) = b (1 + b0) / (b + b0)`: IPC rising with batch.
    pub b0: f64,
    /// IPC loss per doubling of the batch: `F(b) = 1 + ipc_fall · log2 b`.
    pub ipc_fall: f64,
    /// Cache (MB) per core, and an instance's working set: its copy of the weights plus the
    /// activations of each item of a batch.
    pub cache_per_core_mb: f64,
    pub weights_mb: f64,
    pub act_mb: f64,
    /// Slowdown per unit of working set overflowing the instance's cache share.
    pub miss_penalty: f64,
    /// Memory-bandwidth contention between missing instances.
    pub bandwidth: f64,
    /// Log-normal shape of one batch's latency.
    pub lat_sigma: f64,
    /// Relative standard deviation of a window's common speed factor.
    pub window_noise: f64,
    /// Relative noise (uniform ±) of IPC and the miss ratio.
    pub counter_noise: f64,
    /// A probe's measurement window, seconds.
    pub window_s: f64,
    /// Whether IPC and cache misses are measured (not in most VMs).
    pub counters: bool,
}

/// The noise-free behaviour of one layout.
#[derive(Debug, Clone, Copy)]
pub struct Truth {
    pub throughput: f64,
    /// Mean batch latency.
    pub mean_ms: f64,
    pub p99: f64,
    pub ipc: f64,
    pub miss: f64,
}

/// The exhaustive best: the highest true throughput among layouts whose true p99 meets the SLO.
#[derive(Debug, Clone, Copy)]
pub struct Best {
    pub config: LayoutConfig,
    pub throughput: f64,
    pub p99: f64,
    /// Layouts in the space (every cores per instance, instance count and batch).
    pub space: u64,
}

impl PerfModel {
    pub fn truth(&self, c: &LayoutConfig) -> Truth {
        let cores = f64::from(c.cores_per_instance.max(1));
        let n = f64::from(c.instances.max(1));
        let b = f64::from(c.batch.max(1));
        let speedup = 1.0 / (self.serial + (1.0 - self.serial) / cores);
        let eff = b * (1.0 + self.b0) / (b + self.b0);
        let fall = 1.0 + self.ipc_fall * b.log2();
        let ws = self.weights_mb + self.act_mb * b;
        let share = self.cache_per_core_mb * cores;
        let overflow = if ws > 0.0 {
            ((ws - share) / ws).max(0.0)
        } else {
            0.0
        };
        let slow = 1.0 + self.miss_penalty * overflow;
        let busy = n * cores / f64::from(self.free.max(1));
        let contention = 1.0 + self.bandwidth * overflow * busy;
        let mean_ms =
            (self.batch_ms + self.item_ms * b / (speedup * eff) * fall * slow) * contention;
        Truth {
            throughput: n * b / mean_ms * 1000.0,
            mean_ms,
            p99: mean_ms * self.tail(Z99),
            ipc: 0.8 * eff / (fall * slow * contention),
            miss: 0.03 + 0.5 * overflow,
        }
    }

    /// The latency quantile at standard-normal `z`, relative to the mean.
    fn tail(&self, z: f64) -> f64 {
        let s = self.lat_sigma;
        (s * z - s * s / 2.0).exp()
    }

    /// The best layout whose true p99 meets the SLO over every uniform layout: every cores per
    /// instance, every instance count that fits, every batch. None when none meets it.
    pub fn exhaustive(&self) -> Option<Best> {
        self.best_where(|_, t| t.p99 <= self.slo_ms)
    }

    /// [`PerfModel::exhaustive`] over the layouts `ok` accepts instead of those within the SLO.
    /// `ok` must hold for a smaller batch on the same rung whenever it holds for a larger one,
    /// as the SLO does (latency grows with batch): each rung's batches stop at the first refused.
    pub fn best_where(&self, ok: impl Fn(&LayoutConfig, &Truth) -> bool) -> Option<Best> {
        let mut best: Option<Best> = None;
        self.each_where(ok, |config, t| {
            if best.map_or(true, |x| t.throughput > x.throughput) {
                best = Some(Best {
                    config,
                    throughput: t.throughput,
                    p99: t.p99,
                    space: 0,
                });
            }
        });
        let rungs: u64 = (1..=self.free)
            .map(|c| u64::from((self.free / c).min(self.max_instances)))
            .sum();
        let space = rungs * u64::from(self.max_batch);
        best.map(|b| Best { space, ..b })
    }

    /// Calls `visit` with every uniform layout `ok` accepts (every cores per instance, instance
    /// count that fits and batch) and its truth, each rung's batches up to the first `ok`
    /// refuses (see [`PerfModel::best_where`]).
    pub fn each_where(
        &self,
        ok: impl Fn(&LayoutConfig, &Truth) -> bool,
        mut visit: impl FnMut(LayoutConfig, Truth),
    ) {
        for c in 1..=self.free {
            for n in 1..=(self.free / c).min(self.max_instances) {
                // Latency grows with batch (every factor of `mean` does): stop at the first miss.
                for b in 1..=self.max_batch {
                    let config = LayoutConfig {
                        cores_per_instance: c,
                        instances: n,
                        batch: b,
                    };
                    let t = self.truth(&config);
                    if !ok(&config, &t) {
                        break;
                    }
                    visit(config, t);
                }
            }
        }
    }

    /// A probe of `c` without noise: the true p99 and median, the window's batch count at the
    /// true mean, no counters. What a layout would show if measuring cost nothing but the window.
    pub fn exact_probe(&self, c: LayoutConfig) -> ProbeResult {
        let t = self.truth(&c);
        let batches = self.window_batches(t.mean_ms, c.instances);
        ProbeResult {
            config: c,
            throughput_per_s: t.throughput,
            p99_latency_ms: t.p99,
            ipc: None,
            cache_miss_ratio: None,
            latency_samples: batches,
            p50_latency_ms: Some(t.mean_ms * self.tail(0.0)),
        }
    }

    /// [`PerfModel::exact_probe`] with the counters too, where the model has them, noise-free:
    /// a probe whose every figure is the layout's truth, for telling what the search loses to
    /// window noise from what it loses to where it probes.
    pub fn noiseless_probe(&self, c: LayoutConfig) -> ProbeResult {
        let t = self.truth(&c);
        ProbeResult {
            ipc: self.counters.then_some(t.ipc),
            cache_miss_ratio: self.counters.then_some(t.miss),
            ..self.exact_probe(c)
        }
    }

    /// The batches `instances` instances serve in a window at a mean batch latency of
    /// `mean_ms`: what a probe's percentiles are taken from.
    fn window_batches(&self, mean_ms: f64, instances: u32) -> u32 {
        let each = ((self.window_s * 1000.0 / mean_ms).floor() as u32).max(1);
        each.saturating_mul(instances.max(1))
    }

    /// One noisy probe of `c`, as lodgerd measures it (see the module documentation).
    pub fn probe(&self, c: LayoutConfig, rng: &mut Rng) -> ProbeResult {
        let t = self.truth(&c);
        let speed = (1.0 + self.window_noise * rng.normal()).max(0.5);
        let mean = t.mean_ms * speed;
        let batches = self.window_batches(mean, c.instances);
        let k99 = (f64::from(batches) * 0.99).ceil().max(1.0) as u32;
        let k50 = (f64::from(batches) * 0.5).ceil().max(1.0) as u32;
        // Log-normal with this mean: median mean·exp(−σ²/2).
        let median = mean * self.tail(0.0);
        let value = |u: f64| median * (self.lat_sigma * inverse_normal(u)).exp();
        let p99 = value(order_statistic(k99, batches, rng));
        let p50 = value(order_statistic(k50, batches, rng));
        let jitter = |rng: &mut Rng| rng.jitter(self.counter_noise);
        let ipc = self.counters.then(|| t.ipc * jitter(rng));
        let miss = self.counters.then(|| t.miss * jitter(rng));
        ProbeResult {
            config: c,
            throughput_per_s: t.throughput / speed,
            p99_latency_ms: p99,
            ipc,
            cache_miss_ratio: miss,
            latency_samples: batches,
            p50_latency_ms: Some(p50),
        }
    }

    /// A random model of `family` (see the module documentation for the ranges).
    pub fn random(family: Family, seed: u64) -> PerfModel {
        let mut rng = Rng::splitmix(seed ^ 0x1a70_u64.wrapping_mul(0x9e37_79b9));
        let r = &mut rng;
        let log_uniform = |r: &mut Rng, lo: f64, hi: f64| (r.uniform(lo.ln(), hi.ln())).exp();
        let free = log_uniform(r, 8.0, 193.0).floor().clamp(8.0, 192.0) as u32;
        let max_batch = [16, 32, 64, 128][r.int(0, 3) as usize];
        let max_instances = if r.chance(0.2) {
            r.int(1, (free / 2).max(1))
        } else {
            free
        };
        let item_ms = log_uniform(r, 0.5, 50.0);
        let batch_ms = item_ms * r.uniform(0.05, 0.5);
        let (serial, b0, ipc_fall, weights_mb, act_mb, miss_penalty, bandwidth) = match family {
            Family::ComputeBound => (
                r.uniform(0.005, 0.15),
                r.uniform(4.0, 24.0),
                0.0,
                r.uniform(0.2, 1.0),
                r.uniform(0.0, 0.003),
                r.uniform(0.5, 2.0),
                r.uniform(0.2, 1.0),
            ),
            Family::FallingIpc => (
                r.uniform(0.005, 0.15),
                r.uniform(0.0, 1.0),
                r.uniform(0.05, 0.25),
                r.uniform(0.2, 1.0),
                r.uniform(0.0, 0.003),
                r.uniform(0.5, 2.0),
                r.uniform(0.2, 1.0),
            ),
            Family::CacheBound => (
                r.uniform(0.05, 0.3),
                r.uniform(0.5, 4.0),
                0.0,
                r.uniform(0.2, 4.0),
                r.uniform(0.2, 2.0),
                r.uniform(1.0, 3.0),
                r.uniform(0.2, 1.0),
            ),
            Family::Mixed => (
                r.uniform(0.005, 0.3),
                r.uniform(0.0, 24.0),
                if r.chance(0.5) {
                    r.uniform(0.0, 0.25)
                } else {
                    0.0
                },
                r.uniform(0.2, 4.0),
                if r.chance(0.5) {
                    r.uniform(0.0, 2.0)
                } else {
                    r.uniform(0.0, 0.003)
                },
                r.uniform(0.5, 3.0),
                r.uniform(0.2, 1.0),
            ),
        };
        let mut model = PerfModel {
            name: family.name(),
            free,
            slo_ms: 0.0,
            max_batch,
            max_instances,
            item_ms,
            batch_ms,
            serial,
            b0,
            ipc_fall,
            cache_per_core_mb: 1.5,
            weights_mb,
            act_mb,
            miss_penalty,
            bandwidth,
            lat_sigma: r.uniform(0.05, 0.3),
            window_noise: r.uniform(0.01, 0.05),
            counter_noise: 0.03,
            window_s: if r.chance(0.5) { 1.0 } else { 10.0 },
            counters: r.chance(0.85),
        };
        let reference = LayoutConfig {
            cores_per_instance: 1 << r.int(0, 3),
            instances: 1,
            batch: 1,
        };
        model.slo_ms = model.truth(&reference).p99 * log_uniform(r, 1.3, 30.0);
        model
    }
}

/// A uniform draw distributed as the `k`-th smallest of `n` uniforms: Beta(k, n + 1 − k), as the
/// ratio of two gamma draws.
fn order_statistic(k: u32, n: u32, rng: &mut Rng) -> f64 {
    let k = k.clamp(1, n.max(1));
    let a = gamma(f64::from(k), rng);
    let b = gamma(f64::from(n + 1 - k), rng);
    (a / (a + b)).clamp(1e-12, 1.0 - 1e-12)
}

/// Gamma(shape ≥ 1, 1) by Marsaglia and Tsang's method.
fn gamma(shape: f64, rng: &mut Rng) -> f64 {
    let d = shape.max(1.0) - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = rng.normal();
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = rng.unit();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// The standard normal quantile (Acklam's rational approximation, relative error < 1.2e-9).
fn inverse_normal(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// How one search went against a model.
#[derive(Debug, Clone)]
pub struct SimRun {
    pub outcome: super::SearchOutcome,
    pub probes: u32,
    pub truth: Truth,
}

/// How a simulated search's probes are measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probes {
    /// As lodgerd measures them ([`PerfModel::probe`]).
    Noisy,
    /// Every figure the layout's truth ([`PerfModel::noiseless_probe`]).
    Noiseless,
}

/// Drives `search` against `model` with noisy probes from `rng` to its end. Panics when the
/// search asks for more than 1,000 probes (it does not end).
pub fn run_search(model: &PerfModel, mut search: super::LayoutSearch, rng: &mut Rng) -> SimRun {
    run_with(model, rng, Probes::Noisy, |last| search.next(last))
}

/// [`run_search`] for any search driven the same way (`next` as a closure), such as a baseline,
/// with its probes measured as `probes` says.
pub fn run_with(
    model: &PerfModel,
    rng: &mut Rng,
    probes: Probes,
    mut next: impl FnMut(Option<ProbeResult>) -> super::SearchStep,
) -> SimRun {
    let mut last = None;
    for _ in 0..=1000 {
        match next(last.take()) {
            super::SearchStep::Probe(config) => {
                last = Some(match probes {
                    Probes::Noisy => model.probe(config, rng),
                    Probes::Noiseless => model.noiseless_probe(config),
                })
            }
            super::SearchStep::Done(outcome) => {
                return SimRun {
                    probes: outcome.probes,
                    truth: model.truth(&outcome.config),
                    outcome,
                }
            }
        }
    }
    panic!("{}: the search does not end", model.name);
}

/// A search for `model`'s question (its free CPUs, SLO and limits), with default options.
pub fn search_for(model: &PerfModel) -> super::LayoutSearch {
    super::LayoutSearch::new(
        model.free,
        model.slo_ms,
        model.max_batch,
        model.max_instances,
    )
}

/// DeepSpeech-like (Fig. 5): little activation data, strong batching gains, scales well.
pub const COMPUTE_BOUND: PerfModel = PerfModel {
    name: "compute-bound",
    free: 32,
    slo_ms: 800.0,
    max_batch: 64,
    max_instances: 64,
    item_ms: 60.0,
    batch_ms: 4.0,
    serial: 0.03,
    b0: 6.0,
    ipc_fall: 0.0,
    cache_per_core_mb: 1.5,
    weights_mb: 6.0,
    act_mb: 0.02,
    miss_penalty: 1.0,
    bandwidth: 0.5,
    lat_sigma: 0.1,
    window_noise: 0.02,
    counter_noise: 0.03,
    window_s: 10.0,
    counters: true,
};

/// ResNet101-like (Fig. 5): activations overflow the cache past a small batch, poor scaling
/// inside an instance.
pub const SMALL_CACHE: PerfModel = PerfModel {
    name: "small-cache",
    slo_ms: 300.0,
    item_ms: 25.0,
    batch_ms: 6.0,
    serial: 0.2,
    b0: 1.5,
    weights_mb: 0.5,
    act_mb: 1.2,
    miss_penalty: 2.5,
    ..COMPUTE_BOUND
};

/// BERT-like: in between.
pub const BALANCED: PerfModel = PerfModel {
    name: "balanced",
    slo_ms: 400.0,
    max_batch: 32,
    item_ms: 40.0,
    batch_ms: 5.0,
    serial: 0.08,
    b0: 3.0,
    weights_mb: 2.0,
    act_mb: 0.4,
    miss_penalty: 1.5,
    ..COMPUTE_BOUND
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Noise-free probes repeat the layout's truth, counters included where the model has them,
    /// so a search driven by them ends the same whatever the noise seed.
    #[test]
    fn noiseless_probes_are_the_truth_and_need_no_noise() {
        for seed in 0..8u64 {
            let model = PerfModel::random(Family::ALL[(seed % 4) as usize], seed);
            let config = LayoutConfig {
                cores_per_instance: 2,
                instances: 2,
                batch: 4,
            };
            let (t, p) = (model.truth(&config), model.noiseless_probe(config));
            assert_eq!(p.throughput_per_s, t.throughput);
            assert_eq!(p.p99_latency_ms, t.p99);
            assert_eq!(p.cache_miss_ratio, model.counters.then_some(t.miss));
            assert_eq!(p.ipc, model.counters.then_some(t.ipc));
            let run = |noise: u64| {
                let mut search = search_for(&model);
                let mut rng = Rng::splitmix(noise);
                run_with(&model, &mut rng, Probes::Noiseless, |last| {
                    search.next(last)
                })
            };
            let (a, b) = (run(1), run(2));
            assert_eq!(a.outcome.config, b.outcome.config, "seed {seed}");
            assert_eq!(a.probes, b.probes, "seed {seed}");
        }
    }
}
