//! The curve SODA describes (§IV-B-1, §V-B), fitted to all of a job's windows: where the knee
//! is, within what the noise allows, and whether a window should be measured on. Pure
//! arithmetic: touches nothing.
//!
//! SODA finds that a training job's cores affect it "like the traditional multithreading job"
//! up to the best-fit count, and that above it utilization "does not change or drop slightly"
//! (§IV-B-1, §V-B). Amdahl's speedup in the cores per GPU, `1 / ((1 - p) + p g / c)`, is
//! proportional to `c / (c + beta)` with `beta = p g / (1 - p)` in cores, so below the knee
//! utilization is `scale * c / (c + beta)` (the fit needs neither the GPU count nor `p`), and
//! above it `plateau - drop * (c - first)`, `first` the first count on the plateau, `drop >= 0`.
//!
//! The fit is weighted least squares (weights: the windows' inverse variances) over a grid of
//! `beta` and every split of the windows into "below the knee" and "on the plateau". Each fit
//! within [`PROFILE_CHI2`] of the best is plausible (a profile likelihood over `beta` and the
//! split). A split with no window below the knee, or none on the plateau, is plausible too when
//! it fits: the knee is then not bounded on that side, and the tuner goes on stepping. The knee
//! the targets ask for (issue 21) is the fewest cores whose utilization is within the measured
//! noise of the best: [`KNEE_BAND_Z`] standard errors of one window's mean below the plateau,
//! or the settings' `min_change` (percentage points) where that is wider.

use super::noise::WindowStats;
use super::start::CoreLimits;
use super::types::{Decision, Probe};

/// How much worse (in chi-square: the sum of squared residuals in standard errors) than the
/// best fit a fit may be and still be plausible. 6 is about 2.4 standard errors on one
/// parameter: 4 (two) was overconfident in simulation, as each window's noise is itself
/// estimated from ten batches.
const PROFILE_CHI2: f64 = 6.0;
/// `beta` (cores) is searched over this many values evenly spaced in its logarithm, from
/// [`BETA_MIN`] to [`BETA_MAX`], and infinite (utilization in proportion to the cores). Fine
/// enough that the grid's own error is small beside the noise of a window of a steep curve.
const BETA_STEPS: usize = 400;
const BETA_MIN: f64 = 0.25;
const BETA_MAX: f64 = 4096.0;
/// The measured noise in issue 21's definition of the knee: the two-sided 95 % half-width of
/// one window's mean (1.96 of its standard errors), the window's noise pooled over all of the
/// job's windows.
pub(super) const KNEE_BAND_Z: f64 = 1.96;
/// A window whose mean is within this many of its standard errors of the level that decides
/// whether a count is on the knee (the plateau less the band) is measured on: judged now, it
/// could fall either side by chance (a sequential test).
const MEASURE_ON_Z: f64 = 1.0;
/// A window on the plateau is measured on until the plateau has this many windows' worth of
/// samples: every count is judged against the plateau, whose noise adds to its own.
const PLATEAU_WINDOWS: usize = 3;
/// A window is measured on when the knee's interval is at most this many counts wider than
/// the tolerance and the window is at most a core outside it: a few more samples there may
/// settle the search without another probe.
const ALMOST_NARROW: u32 = 2;

/// Where the knee is, as far as the windows tell: the fewest cores whose utilization is within
/// the band of the best lies in `(lo, hi]` by every plausible fit. `lo` is `None` when a
/// plausible fit has no window below the knee (it may be anywhere below the windows), `hi` is
/// `None` when one has no window on the plateau (it may be anywhere above).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Edge {
    pub(super) lo: Option<f64>,
    pub(super) hi: Option<f64>,
    /// The best fit's plateau at its knee; NaN when the best fit has no window on it.
    pub(super) plateau: f64,
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    chi2: f64,
    /// The fewest cores within the band of the plateau: `None` below every window (nothing
    /// below the knee), infinite above every window (nothing on the plateau).
    edge: Option<f64>,
    plateau: f64,
}

/// The windows with their standard errors floored by the pooled estimate (the noise of a job's
/// utilization is much the same at every count; see `Tuner::change_threshold`), and the
/// pooled standard error of one window's mean (of the shortest window: an unextended one).
pub(super) fn pooled(measured: &[WindowStats]) -> (Vec<WindowStats>, f64) {
    let (mut weighted, mut df) = (0.0, 0.0);
    for w in measured {
        weighted += w.df * w.se * w.se * w.n as f64;
        df += w.df;
    }
    let per_sample = if df > 0.0 { weighted / df } else { 0.0 };
    let floored = measured
        .iter()
        .map(|w| WindowStats {
            se: w.se.max((per_sample / w.n.max(1) as f64).sqrt()),
            ..*w
        })
        .collect();
    let shortest = measured.iter().map(|w| w.n).min().unwrap_or(1).max(1);
    (floored, (per_sample / shortest as f64).sqrt())
}

/// The count to settle on, when every plausible fit puts the knee within the tolerance of it:
/// the largest count the plausible knees round up to (more cores are within the tolerance;
/// fewer could be short). It may not have been measured, but lies between the fewest and the
/// most cores measured (each fit's knee is at or below its first window on the plateau; a
/// knee below every window measured is left to the search, which looks there). Never a count
/// a comparison in `history` found starved, though the fit's plateau, pooled over windows,
/// may put it within the noise: the search goes on and decides.
pub(super) fn settle_count(
    measured: &[WindowStats],
    history: &[Probe],
    limits: CoreLimits,
    tolerance: u32,
    min_change: f64,
) -> Option<u32> {
    let (lo, hi) = counts(measured, limits, min_change)?;
    let fewest = measured.iter().map(|w| w.cores).min()?;
    let starved = |p: &Probe| p.cores == hi && matches!(p.decision, Decision::Starved { .. });
    (hi - lo <= tolerance && hi >= fewest && !history.iter().any(starved)).then_some(hi)
}

/// Whether the window just ended (`current`, not yet in `measured`) should be measured on (see
/// [`MEASURE_ON_Z`], [`PLATEAU_WINDOWS`], [`ALMOST_NARROW`]).
pub(super) fn measure_on(
    measured: &[WindowStats],
    current: &WindowStats,
    limits: CoreLimits,
    tolerance: u32,
    min_change: f64,
) -> bool {
    let mut all: Vec<WindowStats> = measured
        .iter()
        .filter(|w| w.cores != current.cores)
        .copied()
        .collect();
    all.push(*current);
    let (ws, se1) = pooled(&all);
    let band = (KNEE_BAND_Z * se1).max(min_change);
    let Some(edge) = edge(&ws, band) else {
        return false;
    };
    let Some(w) = ws.iter().find(|w| w.cores == current.cores) else {
        return false;
    };
    let counts = to_counts(edge, limits);
    if counts.is_some_and(|(lo, hi)| hi - lo <= tolerance) {
        // Settled by the fit as it is.
        return false;
    }
    if edge.plateau.is_finite() {
        let level = edge.plateau - band;
        if (w.mean - level).abs() < MEASURE_ON_Z * w.se {
            return true;
        }
        let shortest = ws.iter().map(|w| w.n).min().unwrap_or(1);
        let on_plateau: usize = ws.iter().filter(|w| w.mean >= level).map(|w| w.n).sum();
        if w.mean >= level && on_plateau < PLATEAU_WINDOWS * shortest {
            return true;
        }
    }
    let Some((lo, hi)) = counts else {
        return false;
    };
    hi - lo > tolerance
        && hi - lo <= tolerance + ALMOST_NARROW
        && current.cores.saturating_add(1) >= lo
        && current.cores <= hi.saturating_add(1)
}

/// The knee's interval in counts, `lo..=hi`, from the windows measured, the band of the
/// plateau at least `min_change`.
fn counts(measured: &[WindowStats], limits: CoreLimits, min_change: f64) -> Option<(u32, u32)> {
    let (ws, se1) = pooled(measured);
    to_counts(edge(&ws, (KNEE_BAND_Z * se1).max(min_change))?, limits)
}

fn to_counts(edge: Edge, limits: CoreLimits) -> Option<(u32, u32)> {
    // Saturating float-to-int conversion; a NaN becomes 0 (then the floor).
    let count = |x: f64| limits.clamp(x.ceil().clamp(0.0, f64::from(u32::MAX)) as u32);
    Some((count(edge.lo?), count(edge.hi?)))
}

/// The interval the knee lies in (see [`Edge`]), or `None` with fewer than two windows or a
/// window without a noise estimate. `band`: how far below the plateau still counts as on it.
pub(super) fn edge(windows: &[WindowStats], band: f64) -> Option<Edge> {
    let unusable = |w: &WindowStats| w.se.is_nan() || w.se <= 0.0 || !w.mean.is_finite();
    if windows.len() < 2 || windows.iter().any(unusable) {
        return None;
    }
    let mut ws: Vec<(f64, f64, f64)> = windows
        .iter()
        .map(|w| (f64::from(w.cores), w.mean, 1.0 / (w.se * w.se)))
        .collect();
    ws.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut candidates = Vec::new();
    for split in 0..=ws.len() {
        let (below, above) = ws.split_at(split);
        let Some(line) = fit_plateau(above) else {
            // Nothing on the plateau: the knee is above every window, if the rise fits.
            let chi2 = betas()
                .filter_map(|beta| fit_rise(below, beta).map(|(_, chi2)| chi2))
                .fold(f64::INFINITY, f64::min);
            if chi2.is_finite() {
                candidates.push(Candidate {
                    chi2,
                    edge: Some(f64::INFINITY),
                    plateau: f64::NAN,
                });
            }
            continue;
        };
        if below.is_empty() {
            candidates.push(Candidate {
                chi2: line.chi2,
                edge: None,
                plateau: line.at_first,
            });
            continue;
        }
        let first = above[0].0;
        let last_below = below[below.len() - 1].0;
        for beta in betas() {
            let Some((scale, rise_chi2)) = fit_rise(below, beta) else {
                continue;
            };
            // The rise must meet the plateau between the last window below and the first on
            // it: the knee, where `scale * c / (c + beta)` reaches the plateau.
            let mut knee = knee_of(scale, beta, line.at_first);
            if !(knee > last_below && knee <= first) {
                continue;
            }
            // With a drop above the knee the best is at the knee, on the plateau's line there.
            let mut top = line.at_first;
            for _ in 0..3 {
                top = line.at_first + line.drop * (first - knee).max(0.0);
                knee = knee_of(scale, beta, top).min(first);
            }
            let level = top - band;
            let edge = if level <= 0.0 {
                0.0
            } else {
                knee_of(scale, beta, level).min(knee)
            };
            candidates.push(Candidate {
                chi2: rise_chi2 + line.chi2,
                edge: Some(edge),
                plateau: top,
            });
        }
    }
    let best = candidates
        .iter()
        .copied()
        .min_by(|a, b| a.chi2.total_cmp(&b.chi2))?;
    let (mut lo, mut hi) = (Some(f64::INFINITY), Some(f64::NEG_INFINITY));
    for c in candidates
        .iter()
        .filter(|c| c.chi2 <= best.chi2 + PROFILE_CHI2)
    {
        match c.edge {
            None => lo = None,
            Some(e) => {
                lo = lo.map(|l| l.min(e));
                hi = hi.map(|h| h.max(e));
            }
        }
    }
    Some(Edge {
        lo: lo.filter(|l| l.is_finite()),
        hi: hi.filter(|h| h.is_finite()),
        plateau: best.plateau,
    })
}

fn betas() -> impl Iterator<Item = f64> {
    let step = (BETA_MAX / BETA_MIN).ln() / (BETA_STEPS - 1) as f64;
    (0..BETA_STEPS)
        .map(move |i| BETA_MIN * (step * i as f64).exp())
        .chain(std::iter::once(f64::INFINITY))
}

/// `c` where `scale * rise(c)` reaches `level` (infinite when it never does).
fn knee_of(scale: f64, beta: f64, level: f64) -> f64 {
    if beta.is_infinite() {
        return level / scale;
    }
    if scale <= level {
        return f64::INFINITY;
    }
    beta * level / (scale - level)
}

/// Amdahl's speedup up to a constant factor; `beta` infinite: in proportion to the cores.
fn rise(c: f64, beta: f64) -> f64 {
    if beta.is_infinite() {
        c
    } else {
        c / (c + beta)
    }
}

/// Weighted least squares of `scale * rise(c)` through the windows: the scale and the
/// chi-square. `None` without windows.
fn fit_rise(ws: &[(f64, f64, f64)], beta: f64) -> Option<(f64, f64)> {
    let (mut num, mut den) = (0.0, 0.0);
    for &(c, m, w) in ws {
        let f = rise(c, beta);
        num += w * m * f;
        den += w * f * f;
    }
    if ws.is_empty() || den <= 0.0 {
        return None;
    }
    let scale = num / den;
    let chi2 = ws
        .iter()
        .map(|&(c, m, w)| w * (m - scale * rise(c, beta)).powi(2))
        .sum();
    Some((scale, chi2))
}

/// The plateau's line through its windows.
struct Line {
    /// Utilization at the first window on the plateau.
    at_first: f64,
    /// Utilization lost per core above it, at least 0.
    drop: f64,
    chi2: f64,
}

/// Weighted least squares of `at_first - drop * (c - first)`, `drop >= 0`, through the
/// windows. `None` without windows.
fn fit_plateau(ws: &[(f64, f64, f64)]) -> Option<Line> {
    let first = ws.first()?.0;
    let sw: f64 = ws.iter().map(|x| x.2).sum();
    let flat = ws.iter().map(|&(_, m, w)| w * m).sum::<f64>() / sw;
    let (mut at_first, mut drop) = (flat, 0.0);
    let mx = ws.iter().map(|&(c, _, w)| w * (c - first)).sum::<f64>() / sw;
    let sxx: f64 = ws
        .iter()
        .map(|&(c, _, w)| w * (c - first - mx).powi(2))
        .sum();
    let sxy: f64 = ws
        .iter()
        .map(|&(c, m, w)| w * (c - first - mx) * (m - flat))
        .sum();
    if sxx > 0.0 && sxy < 0.0 {
        drop = -sxy / sxx;
        at_first = flat + drop * mx;
    }
    let chi2 = ws
        .iter()
        .map(|&(c, m, w)| w * (m - (at_first - drop * (c - first))).powi(2))
        .sum();
    Some(Line {
        at_first,
        drop,
        chi2,
    })
}

#[cfg(test)]
mod tests {
    use super::super::model::Curve;
    use super::*;

    fn curve(gpus: u32, knee_per_gpu: u32, drop_above: f64) -> Curve {
        Curve {
            gpus,
            knee_per_gpu,
            parallel: 0.9,
            peak: 85.0,
            drop_above,
            sigma: 1.0,
            rho: 0.0,
        }
    }

    /// Noise-free windows at `counts` with standard error `se`.
    fn windows(c: &Curve, counts: &[u32], se: f64) -> Vec<WindowStats> {
        counts
            .iter()
            .map(|&cores| WindowStats {
                cores,
                n: 60,
                mean: c.util(cores),
                se,
                df: 9.0,
            })
            .collect()
    }

    /// The fewest cores within `band` of the best, by the curve itself.
    fn true_edge(c: &Curve, band: f64) -> u32 {
        let best = c.util(c.knee());
        (1..=c.knee())
            .find(|&n| c.util(n) >= best - band)
            .unwrap_or(c.knee())
    }

    #[test]
    fn windows_either_side_of_the_knee_place_it() {
        for (gpus, knee, drop) in [(1, 6, 0.0), (2, 5, 0.2), (4, 8, 0.0), (1, 12, 0.3)] {
            let c = curve(gpus, knee, drop);
            let k = c.knee();
            let ws = windows(&c, &[k / 3, k * 2 / 3, k + 2, k * 2], 0.05);
            let e = edge(&ws, KNEE_BAND_Z * 0.05).expect("a fit");
            let (lo, hi) = (e.lo.expect("bounded below"), e.hi.expect("bounded above"));
            let want = f64::from(true_edge(&c, KNEE_BAND_Z * 0.05));
            assert!(
                lo <= want && want - 1.0 <= hi && hi - lo < 2.0,
                "{gpus} GPUs, knee {k}: edge in ({lo:.2}, {hi:.2}], want {want}"
            );
            let limits = CoreLimits {
                floor: 1,
                max: 4 * k,
            };
            let n = settle_count(&ws, &[], limits, 1, 0.0).expect("narrow enough to settle");
            assert!(
                f64::from(n) >= want && f64::from(n) <= want + 1.0,
                "{gpus} GPUs, knee {k}: settles on {n}, want {want} or one more"
            );
        }
    }

    #[test]
    fn a_flat_curve_is_not_bounded_below() {
        let c = curve(1, 1, 0.0);
        let ws = windows(&c, &[4, 6, 9], 0.3);
        let e = edge(&ws, KNEE_BAND_Z * 0.3).expect("a fit");
        assert_eq!(e.lo, None, "{e:?}");
        let limits = CoreLimits { floor: 1, max: 24 };
        assert_eq!(settle_count(&ws, &[], limits, 1, 0.0), None);
    }

    #[test]
    fn a_rising_curve_is_not_bounded_above() {
        let c = curve(1, 16, 0.0);
        let ws = windows(&c, &[2, 5, 9, 14], 0.2);
        let e = edge(&ws, KNEE_BAND_Z * 0.2).expect("a fit");
        assert_eq!(e.hi, None, "{e:?}");
        let limits = CoreLimits { floor: 1, max: 24 };
        assert_eq!(settle_count(&ws, &[], limits, 1, 0.0), None);
    }

    #[test]
    fn too_few_or_noiseless_windows_give_no_fit() {
        let c = curve(1, 4, 0.0);
        assert_eq!(edge(&windows(&c, &[2], 0.5), 1.0), None);
        assert_eq!(edge(&windows(&c, &[2, 8], 0.0), 1.0), None);
    }

    #[test]
    fn a_window_at_the_deciding_level_is_measured_on() {
        let c = curve(1, 8, 0.0);
        let limits = CoreLimits { floor: 1, max: 24 };
        let (se, ws) = (0.5, windows(&c, &[2, 12, 16], 0.5));
        let plateau = c.util(8);
        let at = |mean| WindowStats {
            cores: 7,
            n: 60,
            mean,
            se,
            df: 9.0,
        };
        assert!(measure_on(
            &ws,
            &at(plateau - KNEE_BAND_Z * se),
            limits,
            1,
            0.0
        ));
        assert!(!measure_on(&ws, &at(plateau - 20.0), limits, 1, 0.0));
    }
}
