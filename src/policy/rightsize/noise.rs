//! A measurement window's statistics: mean, a noise estimate from batch means (samples a
//! second apart are correlated), and the Student t quantile that turns it into a threshold.
//! Pure: touches nothing.

use serde::{Deserialize, Serialize};

/// A window's noise is estimated from the means of this many consecutive batches of its
/// samples, not from the samples themselves: GPU utilization sampled once a second is
/// correlated over an iteration (a Wavenet iteration takes about 3 s, §VI-H), and treating
/// correlated samples as independent would understate the noise.
pub(super) const NOISE_BATCHES: usize = 10;
/// One window's mean and the standard error of that mean.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) struct WindowStats {
    pub(super) cores: u32,
    pub(super) n: usize,
    pub(super) mean: f64,
    pub(super) se: f64,
    /// Degrees of freedom of `se`.
    pub(super) df: f64,
}

impl WindowStats {
    /// With enough samples, `se` comes from the means of [`NOISE_BATCHES`] consecutive batches
    /// (batch means: correlation within a batch does not shrink it); with fewer, from the
    /// samples as if independent.
    pub(super) fn of(cores: u32, samples: &[f64]) -> Self {
        let n = samples.len();
        let avg = mean(samples);
        let (se, df) = if n >= 2 * NOISE_BATCHES {
            let batches: Vec<f64> = (0..NOISE_BATCHES)
                .map(|i| mean(&samples[i * n / NOISE_BATCHES..(i + 1) * n / NOISE_BATCHES]))
                .collect();
            let batch_se = std_dev(&batches) / (NOISE_BATCHES as f64).sqrt();
            let iid_se = std_dev(samples) / (n as f64).sqrt();
            (batch_se.max(iid_se), (NOISE_BATCHES - 1) as f64)
        } else if n >= 2 {
            (std_dev(samples) / (n as f64).sqrt(), (n - 1) as f64)
        } else {
            (0.0, 0.0)
        };
        Self {
            cores,
            n,
            mean: avg,
            se,
            df,
        }
    }

    /// The smallest difference between this window's mean and `other`'s that is more than
    /// noise: Welch's combined standard error times the two-sided 95% Student t quantile for
    /// the Welch–Satterthwaite degrees of freedom.
    pub(super) fn change_threshold(&self, other: &WindowStats) -> f64 {
        let (a, b) = (self.se * self.se, other.se * other.se);
        let combined = a + b;
        if combined <= 0.0 {
            return 0.0;
        }
        let df = combined * combined
            / (a * a / self.df.max(1.0) + b * b / other.df.max(1.0)).max(f64::MIN_POSITIVE);
        t_975(df) * combined.sqrt()
    }
}

pub(super) fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Sample standard deviation.
pub(super) fn std_dev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// The 97.5% quantile of Student's t with `df` degrees of freedom, interpolated in 1/df between
/// tabulated values (exact at the table's points, within 0.5% between them).
pub(super) fn t_975(df: f64) -> f64 {
    const TABLE: [(f64, f64); 15] = [
        (1.0, 12.706),
        (2.0, 4.303),
        (3.0, 3.182),
        (4.0, 2.776),
        (5.0, 2.571),
        (6.0, 2.447),
        (7.0, 2.365),
        (8.0, 2.306),
        (10.0, 2.228),
        (12.0, 2.179),
        (15.0, 2.131),
        (20.0, 2.086),
        (30.0, 2.042),
        (60.0, 2.000),
        (120.0, 1.980),
    ];
    const Z: f64 = 1.960;
    if !df.is_finite() || df <= TABLE[0].0 {
        return if df.is_finite() { TABLE[0].1 } else { Z };
    }
    for pair in TABLE.windows(2) {
        let ((d0, t0), (d1, t1)) = (pair[0], pair[1]);
        if df <= d1 {
            let w = (1.0 / d0 - 1.0 / df) / (1.0 / d0 - 1.0 / d1);
            return t0 + w * (t1 - t0);
        }
    }
    let (d_last, t_last) = TABLE[TABLE.len() - 1];
    // Between 120 and infinity, linear in 1/df down to the normal quantile.
    Z + (t_last - Z) * d_last / df
}
