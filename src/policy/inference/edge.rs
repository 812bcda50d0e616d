//! Whether a probe is within the SLO (the rule is documented on [`LayoutSearch`]): a probe's
//! p99 judged with its uncertainty, and the p99 a planned probe must aim for. Pure: touches
//! nothing.

use super::search::{sample_of, LayoutSearch, ProbeResult, Sample};
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

/// A rung: cores per instance, instances.
pub(super) type Rung = (u32, u32);

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

    /// Whether this search's rule judges `r` within the SLO (its p99 with its uncertainty; see
    /// [`LayoutSearch`]). The benchmark asks it of exact probes, for the best layout the rule
    /// lets any search choose.
    pub fn judges_within_slo(&self, r: &ProbeResult) -> bool {
        self.feasible(&sample_of(r))
    }

    /// The measured p99 to aim for in a probe planned from `like`: one whose upper bound just
    /// meets the SLO, with the batch count scaled to the longer or shorter batches.
    pub(super) fn aim(&self, like: &Sample) -> f64 {
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

    pub(super) fn config(&self, rung: Rung, batch: u32) -> LayoutConfig {
        LayoutConfig {
            cores_per_instance: rung.0,
            instances: rung.1,
            batch: batch.clamp(1, self.max_batch),
        }
    }
}
