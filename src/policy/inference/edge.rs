//! The layout search's phases (Cloud Reamer §III-B; the rules are documented on
//! [`LayoutSearch`]): phase 1 over rungs at batch 1, the edge batch of a rung, the walk over
//! rungs, and how a probe's p99 is judged with its uncertainty. Replayed from the measurements
//! on every step. Pure: touches nothing.

use std::collections::BTreeMap;

use super::search::{
    classify, floor_batch, BatchTrend, LayoutSearch, ModelTraits, Need, Sample, TREND_BATCH,
};
use super::types::LayoutConfig;

/// z of the 99th percentile, and the standard normal density there.
const Z99: f64 = 2.326_347_874_040_841;
const PHI_Z99: f64 = 0.026_652_097_3;
/// Relative window-to-window drift of latency a single window cannot show (other tenants,
/// frequency): the floor of a p99's standard error.
const DRIFT: f64 = 0.03;
/// Log-normal spread assumed when a probe reports no median, and the batch count assumed when it
/// reports none (results recorded before probes reported them).
const SIGMA_UNKNOWN: f64 = 0.25;
const SAMPLES_UNKNOWN: u32 = 30;
/// Latency taken as falling like cores^−ALPHA between rungs until two rungs are measured.
const ALPHA: f64 = 0.7;
/// A probe within the SLO that leaves more than this fraction of it unused is corrected upward.
const HEADROOM: f64 = 0.10;

/// A rung: cores per instance, instances.
type Rung = (u32, u32);

impl LayoutSearch {
    /// The relative standard error of `s`'s p99 (see [`LayoutSearch`]).
    pub(super) fn p99_error(&self, s: &Sample) -> f64 {
        let sigma = match s.p50 {
            Some(m) if m > 0.0 && s.p99.is_finite() && s.p99 >= m => (s.p99 / m).ln() / Z99,
            Some(_) => 0.0,
            None => SIGMA_UNKNOWN,
        }
        .clamp(0.02, 1.0);
        let n = if s.n == 0 { SAMPLES_UNKNOWN } else { s.n };
        let q = sigma * (0.99 * 0.01 / f64::from(n)).sqrt() / PHI_Z99;
        (q * q + DRIFT * DRIFT).sqrt()
    }

    /// `s`'s p99 with its uncertainty: what the SLO is judged against.
    pub(super) fn upper(&self, s: &Sample) -> f64 {
        if s.p99 >= f64::MAX / 4.0 {
            return f64::MAX;
        }
        let z = self.options.confidence_z.max(0.0);
        s.p99 * (z * self.p99_error(s)).exp()
    }

    pub(super) fn feasible(&self, s: &Sample) -> bool {
        self.upper(s) <= self.slo_ms
    }

    /// The measured p99 to aim for in a probe planned from `like`: one whose upper bound just
    /// meets the SLO, with the batch count scaled to the longer or shorter batches.
    fn aim(&self, like: &Sample) -> f64 {
        let z = self.options.confidence_z.max(0.0);
        let mut at = Sample {
            p99: self.slo_ms,
            n: if like.n == 0 || like.p99 <= 0.0 || !like.p99.is_finite() {
                0
            } else {
                let scaled = f64::from(like.n) * like.p99 / self.slo_ms;
                scaled.clamp(1.0, f64::from(u32::MAX)) as u32
            },
            ..*like
        };
        // The spread is a property of the model, not of the batch: keep the ratio.
        at.p50 = like
            .p50
            .filter(|_| like.p99.is_finite() && like.p99 > 0.0)
            .map(|m| m / like.p99 * self.slo_ms);
        self.slo_ms / (z * self.p99_error(&at)).exp()
    }

    fn config(&self, rung: Rung, batch: u32) -> LayoutConfig {
        LayoutConfig {
            cores_per_instance: rung.0,
            instances: rung.1,
            batch: batch.clamp(1, self.max_batch),
        }
    }

    /// The whole search, replayed from the measurements so far; stops at the first layout not
    /// yet measured. `traits` is set once phase 1 and the trend are known.
    pub(super) fn run(&self, traits: &mut Option<ModelTraits>) -> Result<(), Need> {
        if self.free_cores == 0 {
            return Ok(());
        }
        let ladder = self.ladder(1);
        let hinted = self.hint.filter(|t| {
            t.min_cores_per_instance >= 1 && t.min_cores_per_instance <= self.free_cores
        });
        let mut edges: BTreeMap<usize, Option<(u32, Sample)>> = BTreeMap::new();
        let first = match hinted {
            Some(t) => {
                let i = ladder
                    .iter()
                    .position(|&(c, _)| c >= t.min_cores_per_instance)
                    .unwrap_or(ladder.len() - 1);
                *traits = Some(t);
                edges.insert(i, self.edge(&ladder, i, t.feasible_batch, 1, &edges)?);
                i
            }
            None => {
                let Some(i) = self.first_rung(&ladder)? else {
                    return Ok(());
                };
                let small = self.measure(self.config(ladder[i], 1))?;
                let edge = self.edge(&ladder, i, 1, 2, &edges)?;
                let (trend, feasible_batch) = match edge {
                    Some((b, large)) if b > 1 => (classify(&small, &large), b),
                    _ => {
                        // No larger batch within the SLO: compare with the next one measured.
                        let above = self
                            .samples
                            .iter()
                            .find(|(c, _)| {
                                (c.cores_per_instance, c.instances) == ladder[i] && c.batch > 1
                            })
                            .map(|(_, s)| classify(&small, s));
                        (above.unwrap_or(BatchTrend::Unknown), 1)
                    }
                };
                *traits = Some(ModelTraits {
                    min_cores_per_instance: ladder[i].0,
                    trend,
                    feasible_batch,
                });
                edges.insert(i, edge);
                i
            }
        };
        self.walk(&ladder, first, &mut edges)
    }

    /// Phase 1: the smallest rung meeting the SLO at batch 1, or None when no rung does.
    fn first_rung(&self, ladder: &[Rung]) -> Result<Option<usize>, Need> {
        let last = ladder.len() - 1;
        let mut i = 0;
        let mut fail = None;
        let pass = loop {
            let s = self.measure(self.config(ladder[i], 1))?;
            if self.feasible(&s) {
                break i;
            }
            fail = Some(i);
            if i == last {
                return Ok(None);
            }
            let over = self.upper(&s) / self.slo_ms;
            let want = if s.p99 < f64::MAX / 4.0 && over.is_finite() {
                f64::from(ladder[i].0) * over.powf(1.0 / ALPHA)
            } else {
                f64::from(ladder[i].0) * 2.0
            };
            let jump = ladder
                .iter()
                .position(|&(c, _)| f64::from(c) >= want)
                .unwrap_or(last);
            i = jump.max(i + 1);
        };
        let mut hi = pass;
        while let Some(lo) = fail.filter(|&lo| hi - lo > 1) {
            let mid = lo + (hi - lo) / 2;
            if self.feasible(&self.measure(self.config(ladder[mid], 1))?) {
                hi = mid;
            } else {
                fail = Some(mid);
            }
        }
        Ok(Some(hi))
    }

    /// The best batch within the SLO on rung `i` and its sample: `first` measured, then at most
    /// `corrections` secant steps (see [`LayoutSearch`]). None when nothing measured on the rung
    /// meets the SLO.
    fn edge(
        &self,
        ladder: &[Rung],
        i: usize,
        first: u32,
        corrections: u32,
        edges: &BTreeMap<usize, Option<(u32, Sample)>>,
    ) -> Result<Option<(u32, Sample)>, Need> {
        let rung = ladder[i];
        let mut b = first.clamp(1, self.max_batch);
        for _ in 0..corrections {
            let s = self.measure(self.config(rung, b))?;
            let next = if self.feasible(&s) {
                if b >= self.max_batch || self.upper(&s) >= self.slo_ms * (1.0 - HEADROOM) {
                    break;
                }
                let (up, fitted) = self.predict(ladder, i, (b, &s), edges);
                // Without a fit, proportional latency is only a floor: look [`TREND_BATCH`]
                // times further, so that a miss gives the fit (Fig. 5's batch 8).
                let up = if fitted {
                    up
                } else {
                    up.max(b.saturating_mul(TREND_BATCH)).min(self.max_batch)
                };
                // Not worth a probe below an eighth more batch.
                if up < b + (b / 8).max(1) {
                    break;
                }
                // Not past a batch of this rung already over the SLO.
                match self.lowest_over(rung, b) {
                    Some(over) if up >= over => {
                        let mid = b + (over - b) / 2;
                        if mid <= b {
                            break;
                        }
                        mid
                    }
                    _ => up,
                }
            } else {
                if b == 1 {
                    break;
                }
                let down = self.predict(ladder, i, (b, &s), edges).0.min(b - 1);
                // Below a batch of this rung already within it, nothing is gained.
                if self.highest_within(rung, b).is_some_and(|w| down <= w) {
                    break;
                }
                down
            };
            b = next;
        }
        self.measure(self.config(rung, b))?;
        Ok(self.best_on(rung))
    }

    /// The batch on rung `i` predicted to meet the aim, from the rung's own fit or a measured
    /// rung's scaled to it, else latency taken as proportional to batch from `at` (a floor:
    /// latency grows slower than batch wherever a batch has a fixed cost or IPC rises with it),
    /// and whether a fit was used.
    fn predict(
        &self,
        ladder: &[Rung],
        i: usize,
        (at_batch, at): (u32, &Sample),
        edges: &BTreeMap<usize, Option<(u32, Sample)>>,
    ) -> (u32, bool) {
        let target = self.aim(at);
        let rung = ladder[i];
        let fit = self.fit(rung).or_else(|| {
            let alpha = self.alpha(ladder, edges);
            edges
                .keys()
                .filter(|&&j| j != i)
                .min_by_key(|&&j| j.abs_diff(i))
                .and_then(|&j| {
                    let (a, b) = self.fit(ladder[j])?;
                    let k = (f64::from(ladder[j].0) / f64::from(rung.0)).powf(alpha);
                    Some((a * k, b * k))
                })
        });
        let (batch, fitted) = match fit {
            Some((a, slope)) if slope > 0.0 => ((target - a) / slope, true),
            _ => (f64::from(at_batch) * target / at.p99, false),
        };
        (floor_batch(batch, self.max_batch), fitted)
    }

    /// Latency on a rung as `a + slope·batch`: the secant through the largest batch within the
    /// SLO and the smallest over it above that, else through the two largest batches measured.
    fn fit(&self, rung: Rung) -> Option<(f64, f64)> {
        let points: Vec<(f64, f64, bool)> = self
            .samples
            .iter()
            .filter(|(c, s)| (c.cores_per_instance, c.instances) == rung && s.p99 < f64::MAX / 4.0)
            .map(|(c, s)| (f64::from(c.batch), s.p99, self.feasible(s)))
            .collect();
        if points.len() < 2 {
            return None;
        }
        let within = points.iter().rfind(|p| p.2);
        let over = within.and_then(|w| points.iter().find(|p| !p.2 && p.0 > w.0));
        let (p, q) = match (within, over) {
            (Some(w), Some(o)) => (*w, *o),
            _ => (points[points.len() - 2], points[points.len() - 1]),
        };
        let slope = (q.1 - p.1) / (q.0 - p.0);
        if !slope.is_finite() || slope <= 0.0 {
            return None;
        }
        Some((p.1 - slope * p.0, slope))
    }

    /// How latency falls with cores between rungs: fitted between the first measured rung with a
    /// fit and another measured rung, else [`ALPHA`].
    fn alpha(&self, ladder: &[Rung], edges: &BTreeMap<usize, Option<(u32, Sample)>>) -> f64 {
        let mut fitted = edges
            .keys()
            .filter_map(|&j| Some((j, self.fit(ladder[j])?)));
        let Some((j, (a, slope))) = fitted.next() else {
            return ALPHA;
        };
        let other = self.samples.iter().find(|(c, s)| {
            c.cores_per_instance != ladder[j].0
                && edges
                    .keys()
                    .any(|&k| ladder[k] == (c.cores_per_instance, c.instances))
                && s.p99 < f64::MAX / 4.0
        });
        let Some((c, s)) = other else {
            return ALPHA;
        };
        let here = a + slope * f64::from(c.batch);
        let ratio = f64::from(c.cores_per_instance) / f64::from(ladder[j].0);
        let alpha = (here / s.p99).ln() / ratio.ln();
        if alpha.is_finite() {
            alpha.clamp(0.0, 1.2)
        } else {
            ALPHA
        }
    }

    fn lowest_over(&self, rung: Rung, above: u32) -> Option<u32> {
        self.samples
            .iter()
            .filter(|(c, s)| {
                (c.cores_per_instance, c.instances) == rung && c.batch > above && !self.feasible(s)
            })
            .map(|(c, _)| c.batch)
            .min()
    }

    fn highest_within(&self, rung: Rung, below: u32) -> Option<u32> {
        self.samples
            .iter()
            .filter(|(c, s)| {
                (c.cores_per_instance, c.instances) == rung && c.batch < below && self.feasible(s)
            })
            .map(|(c, _)| c.batch)
            .max()
    }

    /// The highest-throughput batch within the SLO measured on `rung`.
    fn best_on(&self, rung: Rung) -> Option<(u32, Sample)> {
        self.samples
            .iter()
            .filter(|(c, s)| (c.cores_per_instance, c.instances) == rung && self.feasible(s))
            .max_by(|a, b| a.1.throughput.total_cmp(&b.1.throughput))
            .map(|(c, s)| (c.batch, *s))
    }

    /// Phase 2: doubles the cores per instance from the first rung while the edge throughput
    /// improves, then bisects between the best rung and its nearest worse neighbours.
    fn walk(
        &self,
        ladder: &[Rung],
        first: usize,
        edges: &mut BTreeMap<usize, Option<(u32, Sample)>>,
    ) -> Result<(), Need> {
        let tp = |e: &Option<(u32, Sample)>| e.as_ref().map_or(0.0, |(_, s)| s.throughput);
        let m = self.options.margin.max(0.0);
        let mut best = first;
        let last = ladder.len() - 1;
        // Up by doubling.
        while best < last {
            let want = ladder[best].0.saturating_mul(2);
            let j = ladder
                .iter()
                .position(|&(c, _)| c >= want)
                .unwrap_or(last)
                .max(best + 1);
            if edges.contains_key(&j) {
                break;
            }
            let e = self.visit(ladder, j, best, edges)?;
            let better = tp(&e) > tp(&edges[&best]) * (1.0 + m);
            edges.insert(j, e);
            if !better {
                break;
            }
            best = j;
        }
        // Bisect towards the nearest visited rungs on either side.
        loop {
            let above = edges.range(best + 1..).next().map(|(&j, _)| j);
            let below = edges.range(..best).next_back().map(|(&j, _)| j);
            let gap = |a: usize, b: usize| {
                // The rung nearest the geometric middle of the two core counts.
                let mid = (f64::from(ladder[a].0) * f64::from(ladder[b].0)).sqrt();
                (a + 1..b)
                    .min_by(|&x, &y| {
                        let d = |k: usize| (f64::from(ladder[k].0).ln() - mid.ln()).abs();
                        d(x).total_cmp(&d(y))
                    })
                    .filter(|k| !edges.contains_key(k))
            };
            let cand = above
                .and_then(|a| gap(best, a))
                .or_else(|| below.and_then(|b| gap(b, best)));
            let Some(j) = cand else {
                return Ok(());
            };
            let e = self.visit(ladder, j, best, edges)?;
            let better = tp(&e) > tp(&edges[&best]) * (1.0 + m);
            edges.insert(j, e);
            if better {
                best = j;
            }
        }
    }

    /// The edge of rung `j`, its first batch predicted from the best rung's.
    fn visit(
        &self,
        ladder: &[Rung],
        j: usize,
        from: usize,
        edges: &BTreeMap<usize, Option<(u32, Sample)>>,
    ) -> Result<Option<(u32, Sample)>, Need> {
        let first = match &edges[&from] {
            Some((b, s)) => {
                let mut from_edges = edges.clone();
                from_edges.retain(|&k, _| k == from);
                let guess = self.predict(ladder, j, (*b, s), &from_edges).0;
                // More cores per instance get through a batch faster: never below the batch
                // that met the SLO with fewer.
                if ladder[j].0 > ladder[from].0 {
                    guess.max(*b)
                } else {
                    guess
                }
            }
            None => 1,
        };
        self.edge(ladder, j, first, 1, edges)
    }
}
