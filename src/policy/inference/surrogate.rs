//! The layout search's surrogate latency model: mean batch latency as a function of cores per
//! instance and batch, fitted to the probes so far by least squares in log space with priors.
//! Generic (a fixed cost per batch, a power law in the batch, Amdahl scaling inside an
//! instance), deliberately not the simulator's model (`sim`), so the search is not tuned to one
//! curve. Pure arithmetic; touches nothing.

/// One measured layout, as the fit sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Point {
    /// Cores per instance.
    pub(super) cores: f64,
    pub(super) batch: f64,
    /// Mean batch latency, ms.
    pub(super) latency: f64,
}

/// `L(c, b) = k · (f + b^e · ((1 − p) + p / c))`: a fixed cost per batch that more cores do not
/// shorten (`k·f`: dispatch, framework overhead), and per-item work growing like `b^e`
/// (Cloud Reamer §III-B: latency grows about linearly with batch, `e` near 1; below 1 when IPC
/// rises with batch, above when it falls) that an instance's cores share with parallel fraction
/// `p` (Amdahl).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Surrogate {
    k: f64,
    f: f64,
    e: f64,
    p: f64,
}

/// What the fit assumes before the probes say otherwise: the batch exponent and its spread.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prior {
    pub(super) e: f64,
    pub(super) e_sd: f64,
}

/// Spread of one probe's log latency around the model (window noise and model error).
const RESIDUAL_SD: f64 = 0.05;
/// Serial fraction prior (log-normal around 5 %): most inference kernels parallelize well.
const SERIAL_PRIOR: f64 = 0.05;
const SERIAL_LOG_SD: f64 = 1.5;
/// Fixed cost per batch in units of one item's work on one core: prior 0.3, wide.
const FIXED_PRIOR: f64 = 0.3;
const FIXED_LOG_SD: f64 = 1.5;

/// The grids the non-linear parameters are searched on (`k` is solved in closed form).
const E_GRID: [f64; 14] = [
    0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.45, 1.6,
];
const SERIAL_GRID: [f64; 14] = [
    0.001, 0.003, 0.01, 0.02, 0.035, 0.05, 0.07, 0.1, 0.14, 0.2, 0.3, 0.45, 0.7, 1.0,
];
const FIXED_GRID: [f64; 12] = [0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 3.5, 6.0];

impl Surrogate {
    /// Predicted mean batch latency, ms.
    pub(super) fn latency(&self, cores: f64, batch: f64) -> f64 {
        let amdahl = (1.0 - self.p) + self.p / cores.max(1.0);
        self.k * (self.f + batch.max(1.0).powf(self.e) * amdahl)
    }

    /// The fit of `points` (those with a finite positive latency) under `prior`: the grid point
    /// minimizing the squared log residuals over [`RESIDUAL_SD`]² plus the priors' penalties,
    /// with `k` the geometric mean that fits best there. With one point the priors decide the
    /// shape and the point the scale. None without points.
    pub(super) fn fit(points: &[Point], prior: Prior) -> Option<Surrogate> {
        let points: Vec<Point> = points
            .iter()
            .copied()
            .filter(|p| p.latency.is_finite() && p.latency > 0.0)
            .collect();
        if points.is_empty() {
            return None;
        }
        let count = points.len() as f64;
        let ln_b: Vec<f64> = points.iter().map(|p| p.batch.max(1.0).ln()).collect();
        let ln_l: Vec<f64> = points.iter().map(|p| p.latency.ln()).collect();
        let e_sd = prior.e_sd.max(0.01);
        let mut best: Option<(f64, Surrogate)> = None;
        let mut shape = vec![0.0; points.len()];
        for &serial in &SERIAL_GRID {
            let p = 1.0 - serial;
            let js = ((serial / SERIAL_PRIOR).ln() / SERIAL_LOG_SD).powi(2);
            for &e in &E_GRID {
                let je = ((e - prior.e) / e_sd).powi(2);
                for &f in &FIXED_GRID {
                    let jf = (((f + 0.02) / (FIXED_PRIOR + 0.02)).ln() / FIXED_LOG_SD).powi(2);
                    let mut sum = 0.0;
                    for (i, pt) in points.iter().enumerate() {
                        let amdahl = (1.0 - p) + p / pt.cores.max(1.0);
                        shape[i] = (f + (e * ln_b[i]).exp() * amdahl).ln();
                        sum += ln_l[i] - shape[i];
                    }
                    let ln_k = sum / count;
                    let sse: f64 = (0..points.len())
                        .map(|i| (ln_l[i] - shape[i] - ln_k).powi(2))
                        .sum();
                    let j = sse / (RESIDUAL_SD * RESIDUAL_SD) + js + je + jf;
                    if best.map_or(true, |(bj, _)| j < bj) {
                        let fit = Surrogate {
                            k: ln_k.exp(),
                            f,
                            e,
                            p,
                        };
                        best = Some((j, fit));
                    }
                }
            }
        }
        best.map(|(_, s)| s)
    }
}
