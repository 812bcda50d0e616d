//! The layout search as it was before issue 21 (commit bfcd741, `src/policy/inference/search.rs`),
//! kept as the benchmark's baseline: the same hill climb with a 12-probe budget, judging a probe's
//! p99 against the SLO as measured, without its uncertainty. Only the pub vocabulary of
//! `lodger::policy::inference` is shared with the current search.

#![allow(dead_code)]

use std::collections::BTreeMap;

use lodger::policy::inference::{
    BatchTrend, LayoutConfig, ModelTraits, ProbeResult, SearchOutcome, SearchStep,
};

const BASELINE_BUDGET: u32 = 12;
const DEFAULT_MARGIN: f64 = 0.03;
const TREND_BATCH: u32 = 8;
const IPC_TREND: f64 = 0.10;
const MISS_RISE_ABS: f64 = 0.02;
const MISS_RISE_REL: f64 = 0.15;

/// Hill-climbing moves around the current layout. "Cores" steps move along the ladder of
/// cores-per-instance values that keep the free cores used (see [`BaselineSearch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    BatchUp,
    /// Towards the next larger batch measured on the same rung, which was worse: where latency
    /// is estimated to meet the SLO when that batch missed it, else halfway.
    BatchBetween,
    BatchDown,
    CoresUp,
    CoresDown,
    CoresUpBatchUp,
    CoresDownBatchDown,
}

/// One measured layout (several windows averaged).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    throughput: f64,
    p99: f64,
    ipc: Option<f64>,
    miss: Option<f64>,
    windows: u32,
}

/// A failed probe (the caller could not measure it, e.g. the instance crashed): no throughput,
/// a latency no SLO accepts.
const FAILED: Sample = Sample {
    throughput: 0.0,
    p99: f64::MAX,
    ipc: None,
    miss: None,
    windows: 1,
};

/// Raised by the search when it needs a layout that has not been measured.
struct Need(LayoutConfig);

/// The online layout search of Cloud Reamer §III-B, as a state machine: each [`next`] call hands
/// in the last measurement and gets the next layout to measure, or the result.
///
/// - Phase 1: the fewest CPUs per instance meeting the SLO at batch 1, one instance, starting at
///   1 CPU and growing. Growth doubles and then bisects (latency falls with cores), so a model
///   needing 8 CPUs costs 5 probes rather than 8. If even every free CPU misses the SLO, the
///   search ends there (`meets_slo` false).
/// - Trend: one more probe at that core count with batch [`TREND_BATCH`]; IPC and cache-miss
///   ratio against batch 1 classify the model ([`BatchTrend`]), and the two latencies estimate
///   the largest batch within the SLO.
/// - Phase 2: hill climbing over layouts from where the trend says: compute-bound models start
///   from one large instance with a large batch, cache-bound ones from the most instances of
///   the phase-1 size, unknown ones in the middle. Cores per instance move along a ladder
///   that keeps the free cores used: for each instance count n, the largest per-instance size
///   `free / n` (32 free CPUs: 1, 2, 3, 4, 5, 6, 8, 10, 16, 32 CPUs per instance), not below the
///   phase-1 size and with at most `max_instances` instances. Neighbours are batch ×2 and ÷2,
///   one rung up or down, the two diagonals, and halfway to a larger batch that failed. The
///   first neighbour better by the margin is taken (the last successful move is tried first);
///   the climb stops at a layout with no better neighbour, or when the budget runs out. The
///   whole space (267,168 layouts for 32 cores, §II-B) is never enumerated.
///
/// Within the SLO means p99 ≤ `slo_ms`. A layout measured twice is averaged; a result for a
/// layout not asked for is recorded under its own layout; `next(None)` while a probe is pending
/// records that probe as failed. Every result counts against the budget.
///
/// A search is plain data: the agent keeps the one under way in the state file, so a restart of
/// lodgerd resumes it at the probe that runs rather than start over (and restart the instances).
///
/// [`next`]: BaselineSearch::next
#[derive(Debug, Clone, PartialEq)]
pub struct BaselineSearch {
    free_cores: u32,
    slo_ms: f64,
    max_batch: u32,
    max_instances: u32,
    hint: Option<ModelTraits>,
    samples: BTreeMap<LayoutConfig, Sample>,
    pending: Option<LayoutConfig>,
    probes: u32,
    done: Option<SearchOutcome>,
}

impl BaselineSearch {
    /// A search over `free_cores` logical CPUs for a job with this p99 SLO, batches of at most
    /// `max_batch` and at most `max_instances` instances (both at least 1).
    pub fn new(free_cores: u32, slo_ms: f64, max_batch: u32, max_instances: u32) -> Self {
        Self {
            free_cores,
            slo_ms,
            max_batch: max_batch.max(1),
            max_instances: max_instances.max(1),
            hint: None,
            samples: BTreeMap::new(),
            pending: None,
            probes: 0,
            done: None,
        }
    }

    /// Skips phase 1 and the trend probe with what a search at another core count learnt
    /// (ignored when its phase-1 size exceeds `free_cores`).
    pub fn with_traits(mut self, traits: ModelTraits) -> Self {
        self.hint = Some(traits);
        self
    }

    /// Results received so far.
    pub fn probes_used(&self) -> u32 {
        self.probes
    }

    /// Hands in the measurement of the last probe (None on the first call) and returns the next
    /// step.
    pub fn next(&mut self, last: Option<ProbeResult>) -> SearchStep {
        if let Some(done) = &self.done {
            return SearchStep::Done(done.clone());
        }
        match last {
            Some(result) => {
                self.probes += 1;
                if self.valid(&result.config) {
                    self.record(result.config, sample_of(&result));
                }
            }
            None => {
                if let Some(pending) = self.pending {
                    self.probes += 1;
                    self.record(pending, FAILED);
                }
            }
        }
        self.pending = None;
        let mut traits = None;
        let ran = self.run(&mut traits);
        match ran {
            Err(Need(config)) if self.probes < BASELINE_BUDGET => {
                self.pending = Some(config);
                SearchStep::Probe(config)
            }
            _ => {
                let outcome = self.finish(traits);
                self.done = Some(outcome.clone());
                SearchStep::Done(outcome)
            }
        }
    }

    fn valid(&self, c: &LayoutConfig) -> bool {
        c.cores_per_instance >= 1
            && c.instances >= 1
            && c.instances <= self.max_instances
            && c.batch >= 1
            && c.batch <= self.max_batch
            && c.cpus() <= self.free_cores
    }

    fn record(&mut self, config: LayoutConfig, s: Sample) {
        let entry = self
            .samples
            .entry(config)
            .or_insert(Sample { windows: 0, ..s });
        let n = f64::from(entry.windows);
        let avg = |old: f64, new: f64| (old * n + new) / (n + 1.0);
        let avg_opt = |old: Option<f64>, new: Option<f64>| match (old, new) {
            (Some(o), Some(v)) => Some(avg(o, v)),
            (o, v) => v.or(o),
        };
        if entry.windows > 0 {
            entry.throughput = avg(entry.throughput, s.throughput);
            entry.p99 = avg(entry.p99, s.p99);
            entry.ipc = avg_opt(entry.ipc, s.ipc);
            entry.miss = avg_opt(entry.miss, s.miss);
        }
        entry.windows += 1;
    }

    fn measure(&self, config: LayoutConfig) -> Result<Sample, Need> {
        self.samples.get(&config).copied().ok_or(Need(config))
    }

    fn feasible(&self, s: &Sample) -> bool {
        s.p99 <= self.slo_ms
    }

    /// Whether `s` is better than `cur` by the margin: within the SLO beats over it; within,
    /// higher throughput; over, lower latency.
    fn better(&self, s: &Sample, cur: &Sample) -> bool {
        let m = DEFAULT_MARGIN;
        match (self.feasible(s), self.feasible(cur)) {
            (true, false) => true,
            (false, true) => false,
            (true, true) => s.throughput > cur.throughput * (1.0 + m),
            (false, false) => s.p99 < cur.p99 * (1.0 - m).max(0.0),
        }
    }

    /// The whole search, replayed from the measurements so far; stops at the first layout not
    /// yet measured. `traits` is set once phase 1 and the trend are known.
    fn run(&self, traits: &mut Option<ModelTraits>) -> Result<(), Need> {
        if self.free_cores == 0 {
            return Ok(());
        }
        let known = match self.hint {
            Some(t)
                if t.min_cores_per_instance >= 1 && t.min_cores_per_instance <= self.free_cores =>
            {
                t
            }
            _ => {
                let Some(min) = self.min_cores()? else {
                    return Ok(());
                };
                let (trend, feasible_batch) = self.trend(min)?;
                ModelTraits {
                    min_cores_per_instance: min,
                    trend,
                    feasible_batch,
                }
            }
        };
        *traits = Some(known);
        let ladder = self.ladder(known.min_cores_per_instance);
        let mut cur = self.start(&ladder, &known);
        let mut cur_s = self.measure(cur)?;
        let mut momentum = None;
        loop {
            let mut moved = false;
            for mv in move_order(known.trend, momentum, self.feasible(&cur_s)) {
                let Some(next) = self.neighbour(&ladder, cur, &cur_s, mv) else {
                    continue;
                };
                let s = self.measure(next)?;
                if self.better(&s, &cur_s) {
                    (cur, cur_s, momentum, moved) = (next, s, Some(mv), true);
                    break;
                }
            }
            // Every move raises the score by the margin over a fixed set of measurements, so
            // the climb cannot cycle.
            if !moved {
                return Ok(());
            }
        }
    }

    /// Phase 1 (Cloud Reamer §III-B: "starts by creating a single instance on one core,
    /// gradually increasing the number of cores until the latency constraint is satisfied").
    /// None when even all free CPUs miss the SLO.
    fn min_cores(&self) -> Result<Option<u32>, Need> {
        let probe = |c: u32| LayoutConfig {
            cores_per_instance: c,
            instances: 1,
            batch: 1,
        };
        let mut fail = 0;
        let mut c = 1;
        let pass = loop {
            if self.feasible(&self.measure(probe(c))?) {
                break c;
            }
            fail = c;
            if c >= self.free_cores {
                return Ok(None);
            }
            c = c.saturating_mul(2).min(self.free_cores);
        };
        let (mut lo, mut hi) = (fail, pass);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.feasible(&self.measure(probe(mid))?) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(Some(hi))
    }

    /// The IPC and cache-miss trend with batch (Cloud Reamer §III-B, Fig. 5), and the largest
    /// batch estimated to meet the SLO at `min` CPUs (latency taken as linear in batch).
    fn trend(&self, min: u32) -> Result<(BatchTrend, u32), Need> {
        let tb = TREND_BATCH.min(self.max_batch);
        if tb <= 1 {
            return Ok((BatchTrend::Unknown, 1));
        }
        let config = |batch| LayoutConfig {
            cores_per_instance: min,
            instances: 1,
            batch,
        };
        let small = self.measure(config(1))?;
        let large = self.measure(config(tb))?;
        let trend = classify(&small, &large);
        let slope = (large.p99 - small.p99) / f64::from(tb - 1);
        let feasible_batch = if !slope.is_finite() || slope <= 0.0 {
            self.max_batch
        } else {
            floor_batch(1.0 + (self.slo_ms - small.p99) / slope, self.max_batch)
        };
        Ok((trend, feasible_batch))
    }

    /// Rungs `(cores per instance, instances)`, by cores: for each instance count up to
    /// `max_instances` and `free / min`, the largest equal share of the free CPUs.
    fn ladder(&self, min: u32) -> Vec<(u32, u32)> {
        let most = (self.free_cores / min.max(1))
            .min(self.max_instances)
            .max(1);
        let mut rungs: BTreeMap<u32, u32> = BTreeMap::new();
        for n in 1..=most {
            let c = self.free_cores / n;
            let entry = rungs.entry(c).or_insert(n);
            *entry = (*entry).max(n);
        }
        rungs.into_iter().collect()
    }

    /// Where phase 2 starts (Cloud Reamer §III-B: "the search starts from a large number of
    /// instances, each with a single CPU core or a single instance with the maximum batch size").
    fn start(&self, ladder: &[(u32, u32)], t: &ModelTraits) -> LayoutConfig {
        let min = f64::from(t.min_cores_per_instance.max(1));
        let fb = t.feasible_batch.clamp(1, self.max_batch);
        // The batch estimate was made at `min` CPUs; an instance with more CPUs gets through a
        // batch faster. Scaling by the square root assumes a middling parallel efficiency: the
        // climb corrects either way.
        let scaled = |cores: u32| {
            let x = 1.0 + f64::from(fb - 1) * (f64::from(cores) / min).sqrt();
            floor_batch(x, self.max_batch)
        };
        let last = ladder.len().saturating_sub(1);
        let (i, batch) = match t.trend {
            // Rising IPC, stable misses: one large instance with a large batch.
            BatchTrend::ComputeBound => (last, scaled(ladder[last].0)),
            // Falling IPC or rising misses: many small instances, small batches.
            BatchTrend::CacheBound => (0, fb.min(2)),
            BatchTrend::Unknown => {
                let mid = ladder.len() / 2;
                let geometric = floor_batch(f64::from(self.max_batch).sqrt(), self.max_batch);
                (mid, scaled(ladder[mid].0).min(geometric))
            }
        };
        let (cores_per_instance, instances) = ladder[i];
        LayoutConfig {
            cores_per_instance,
            instances,
            batch,
        }
    }

    /// The layout `mv` leads to from `cur`, or None when it leaves the space or cannot help.
    fn neighbour(
        &self,
        ladder: &[(u32, u32)],
        cur: LayoutConfig,
        cur_s: &Sample,
        mv: Move,
    ) -> Option<LayoutConfig> {
        let pos = ladder
            .iter()
            .position(|&(c, _)| c == cur.cores_per_instance)?;
        let b = cur.batch;
        let up = (b < self.max_batch).then(|| b.saturating_mul(2).min(self.max_batch));
        let down = (b > 1).then_some(b / 2);
        let at = |i: usize, batch: u32| {
            ladder.get(i).map(|&(c, n)| LayoutConfig {
                cores_per_instance: c,
                instances: n,
                batch,
            })
        };
        // Measured batches on this rung, above the current one.
        let above = || {
            self.samples.iter().filter(move |(c, _)| {
                c.cores_per_instance == cur.cores_per_instance
                    && c.instances == cur.instances
                    && c.batch > b
            })
        };
        match mv {
            Move::BatchUp => {
                let target = up?;
                // Latency grows with batch: past a batch that missed the SLO there is no need
                // to look.
                let blocked = self.feasible(cur_s)
                    && above().any(|(c, s)| c.batch <= target && !self.feasible(s));
                if blocked {
                    None
                } else {
                    at(pos, target)
                }
            }
            Move::BatchBetween => {
                let (hi, hi_s) = above().min_by_key(|(c, _)| c.batch)?;
                if hi.batch - b < 2 {
                    return None;
                }
                let target = if self.feasible(cur_s) && !self.feasible(hi_s) {
                    // A secant step to where latency meets the SLO, rather than bisection:
                    // one probe instead of log2(batch).
                    let slope = (hi_s.p99 - cur_s.p99) / f64::from(hi.batch - b);
                    if slope.is_nan() || slope <= 0.0 {
                        return None;
                    }
                    let reach = floor_batch((self.slo_ms - cur_s.p99) / slope, hi.batch);
                    b + reach.min(hi.batch - b - 1)
                } else {
                    b + (hi.batch - b) / 2
                };
                // Throughput grows at most in proportion to batch: a step of less than an
                // eighth is not worth a probe.
                (target >= b + (b / 8).max(1))
                    .then(|| at(pos, target))
                    .flatten()
            }
            Move::BatchDown => at(pos, down?),
            Move::CoresUp => at(pos + 1, b),
            Move::CoresDown => at(pos.checked_sub(1)?, b),
            Move::CoresUpBatchUp => at(pos + 1, up?),
            Move::CoresDownBatchDown => at(pos.checked_sub(1)?, down?),
        }
    }

    /// The outcome from the measurements so far.
    fn finish(&self, traits: Option<ModelTraits>) -> SearchOutcome {
        let best_within = self
            .samples
            .iter()
            .filter(|(_, s)| self.feasible(s))
            .max_by(|(ca, a), (cb, b)| {
                a.throughput
                    .total_cmp(&b.throughput)
                    .then(b.p99.total_cmp(&a.p99))
                    .then(cb.cmp(ca))
            });
        let lowest_latency = || {
            self.samples
                .iter()
                .min_by(|(ca, a), (cb, b)| a.p99.total_cmp(&b.p99).then(ca.cmp(cb)))
        };
        let meets_slo = best_within.is_some();
        let chosen = best_within.or_else(lowest_latency);
        let (config, measured) = match chosen {
            Some((c, s)) => (
                *c,
                Some(ProbeResult {
                    config: *c,
                    throughput_per_s: s.throughput,
                    p99_latency_ms: s.p99,
                    ipc: s.ipc,
                    cache_miss_ratio: s.miss,
                    latency_samples: 0,
                    p50_latency_ms: None,
                }),
            ),
            None => (
                LayoutConfig {
                    cores_per_instance: self.free_cores,
                    instances: u32::from(self.free_cores > 0),
                    batch: 1,
                },
                None,
            ),
        };
        SearchOutcome {
            free_cores: self.free_cores,
            slo_ms: self.slo_ms,
            max_batch: self.max_batch,
            max_instances: self.max_instances,
            config,
            meets_slo,
            measured,
            probes: self.probes,
            traits,
        }
    }
}

fn sample_of(r: &ProbeResult) -> Sample {
    let finite = |x: Option<f64>| x.filter(|v| v.is_finite() && *v >= 0.0);
    Sample {
        throughput: if r.throughput_per_s.is_finite() && r.throughput_per_s > 0.0 {
            r.throughput_per_s
        } else {
            0.0
        },
        p99: if r.p99_latency_ms.is_nan() || r.p99_latency_ms < 0.0 {
            f64::MAX
        } else {
            r.p99_latency_ms.min(f64::MAX)
        },
        ipc: finite(r.ipc),
        miss: finite(r.cache_miss_ratio),
        windows: 1,
    }
}

/// `x` rounded down to a batch in `1..=max`.
fn floor_batch(x: f64, max: u32) -> u32 {
    if x.is_nan() || x < 1.0 {
        return 1;
    }
    if x >= f64::from(max) {
        return max;
    }
    // In range 1..max here, so the conversion neither truncates nor saturates.
    let floored = x.floor() as u32;
    floored.clamp(1, max)
}

/// Classifies the batch trend from the batch-1 and larger-batch probes of one instance
/// (Cloud Reamer §III-B: "for models with a stable cache miss rate and increasing IPC as batch
/// size increases, creating a single large instance ... can enhance throughput. Conversely, for
/// models that show increasing cache miss rates and declining IPC ..., creating multiple
/// instances"). Either signal alone suffices for cache-bound; compute-bound needs rising IPC
/// and misses that do not rise (or are not measured).
fn classify(small: &Sample, large: &Sample) -> BatchTrend {
    let miss_rise = match (small.miss, large.miss) {
        (Some(a), Some(b)) => b - a > MISS_RISE_ABS && b > a * (1.0 + MISS_RISE_REL),
        _ => false,
    };
    let ipc_change = match (small.ipc, large.ipc) {
        (Some(a), Some(b)) if a > 0.0 => Some((b - a) / a),
        _ => None,
    };
    match ipc_change {
        Some(d) if d <= -IPC_TREND => BatchTrend::CacheBound,
        _ if miss_rise => BatchTrend::CacheBound,
        Some(d) if d >= IPC_TREND => BatchTrend::ComputeBound,
        _ => BatchTrend::Unknown,
    }
}

/// Neighbours in the order to try them: the last successful move first, then what the trend
/// suggests; over the SLO, the moves that lower latency.
fn move_order(trend: BatchTrend, momentum: Option<Move>, feasible: bool) -> Vec<Move> {
    use Move::*;
    let base: &[Move] = if !feasible {
        &[
            BatchDown,
            CoresUp,
            CoresDownBatchDown,
            CoresUpBatchUp,
            CoresDown,
        ]
    } else {
        match trend {
            BatchTrend::ComputeBound => &[
                BatchUp,
                BatchBetween,
                CoresUpBatchUp,
                CoresUp,
                BatchDown,
                CoresDown,
                CoresDownBatchDown,
            ],
            BatchTrend::CacheBound => &[
                BatchUp,
                BatchBetween,
                CoresDown,
                CoresDownBatchDown,
                BatchDown,
                CoresUp,
                CoresUpBatchUp,
            ],
            BatchTrend::Unknown => &[
                BatchUp,
                BatchBetween,
                CoresDown,
                CoresUp,
                BatchDown,
                CoresUpBatchUp,
                CoresDownBatchDown,
            ],
        }
    };
    let mut order = Vec::with_capacity(base.len());
    if let Some(m) = momentum.filter(|m| base.contains(m)) {
        order.push(m);
    }
    order.extend(base.iter().copied().filter(|m| Some(*m) != momentum));
    order
}
