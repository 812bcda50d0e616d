//! The previous search, kept for the benchmark's same-run comparison: lodger's tuner as it was
//! before the model-guided steps (commit bfcd741), SODA §V-B-2 literally: smaller first, then
//! galloping steps in either direction and bisection back, every decision a noise-aware
//! comparison of two windows. Only what the simulation uses (no throttles, no persistence).

use std::time::Duration;

use lodger::policy::rightsize::{TunerAction, TunerSettings, MIN_WINDOW_SAMPLES};

/// The previous search's bound on extensions (`MAX_EXTENSIONS` was 2 then).
const MAX_EXTENSIONS: u32 = 2;
const STARVED_ELASTICITY: f64 = 0.5;
const POWER_MARGIN: f64 = 2.0;
const NOISE_BATCHES: usize = 10;

#[derive(Debug, Clone, Copy, PartialEq)]
struct WindowStats {
    cores: u32,
    n: usize,
    mean: f64,
    se: f64,
    df: f64,
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

fn std_dev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// The 97.5 % Student t quantile, as the library's table.
pub fn t_975(df: f64) -> f64 {
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
    Z + (t_last - Z) * d_last / df
}

impl WindowStats {
    fn of(cores: u32, samples: &[f64]) -> Self {
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

    fn change_threshold(&self, other: &WindowStats) -> f64 {
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum Purpose {
    Baseline,
    Below { reference: u32, conclusive: bool },
    Above { from: u32, conclusive: bool },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    Baseline,
    Starved,
    Enough,
    Better,
    NoBetter,
}

#[derive(Debug)]
enum Phase {
    WarmUp {
        until: Duration,
    },
    Measuring {
        cores: u32,
        purpose: Purpose,
        started: Duration,
        samples: Vec<f64>,
        extended: u32,
    },
    Settled(u32),
}

struct Step {
    len: u32,
    visible: u32,
}

#[derive(Debug)]
struct Search {
    lo: Option<u32>,
    hi: u32,
    confirmed: bool,
    stride: u32,
}

/// The previous tuner (see the module doc).
#[derive(Debug)]
pub struct SodaTuner {
    settings: TunerSettings,
    cores: u32,
    phase: Phase,
    search: Search,
    measured: Vec<WindowStats>,
    verdicts: Vec<Verdict>,
}

impl SodaTuner {
    pub fn new(settings: TunerSettings, now: Duration) -> Self {
        let max = settings.max.max(1);
        let clamp = |n: u32| n.clamp(settings.floor.clamp(1, max), max);
        let start = clamp(settings.start);
        let settings = TunerSettings {
            start,
            floor: clamp(settings.floor),
            max: clamp(settings.max),
            ..settings
        };
        Self {
            cores: start,
            phase: Phase::WarmUp {
                until: now + settings.warmup,
            },
            search: Search {
                lo: None,
                hi: start,
                confirmed: false,
                stride: 0,
            },
            settings,
            measured: Vec::new(),
            verdicts: Vec::new(),
        }
    }

    pub fn cores(&self) -> u32 {
        self.cores
    }

    /// Windows judged.
    pub fn windows(&self) -> usize {
        self.verdicts.len()
    }

    /// Windows judged at counts other than the start.
    pub fn probes(&self) -> usize {
        self.verdicts
            .iter()
            .filter(|v| **v != Verdict::Baseline)
            .count()
    }

    pub fn step(&mut self, now: Duration, samples: &[f64]) -> TunerAction {
        match &mut self.phase {
            Phase::Settled(n) => TunerAction::Settle(*n),
            Phase::WarmUp { until } => {
                if now >= *until {
                    self.phase = Phase::Measuring {
                        cores: self.cores,
                        purpose: Purpose::Baseline,
                        started: now,
                        samples: Vec::new(),
                        extended: 0,
                    };
                }
                TunerAction::Wait
            }
            Phase::Measuring {
                cores,
                purpose,
                started,
                samples: window,
                extended,
            } => {
                window.extend(samples.iter().copied().filter(|s| s.is_finite()));
                if now - *started < self.settings.window * (1 + *extended)
                    || window.len() < MIN_WINDOW_SAMPLES
                {
                    return TunerAction::Wait;
                }
                let stats = WindowStats::of(*cores, window);
                let purpose = *purpose;
                if *extended < MAX_EXTENSIONS && self.undecided(&stats, purpose) {
                    if let Phase::Measuring { extended, .. } = &mut self.phase {
                        *extended += 1;
                    }
                    return TunerAction::Wait;
                }
                self.judge(stats, purpose);
                self.next(now)
            }
        }
    }

    fn undecided(&self, stats: &WindowStats, purpose: Purpose) -> bool {
        let (fewer, more) = match purpose {
            Purpose::Baseline => return false,
            Purpose::Below { reference, .. } => match self.stats_at(reference) {
                Some(r) => (*stats, r),
                None => return false,
            },
            Purpose::Above { from, .. } => match self.stats_at(from) {
                Some(f) => (f, *stats),
                None => return false,
            },
        };
        let threshold = self.change_threshold(&fewer, &more);
        let rise = more.mean - fewer.mean;
        rise > threshold / 2.0 && rise <= threshold
    }

    fn judge(&mut self, stats: WindowStats, purpose: Purpose) {
        let c = stats.cores;
        let verdict = match purpose {
            Purpose::Baseline => {
                self.search.hi = c;
                self.search.confirmed = c >= self.settings.max;
                Verdict::Baseline
            }
            Purpose::Below {
                reference,
                conclusive,
            } => {
                let r = self.stats_at(reference).unwrap_or(stats);
                let threshold = self.change_threshold(&stats, &r);
                if stats.mean < r.mean - threshold {
                    self.search.lo = Some(c);
                    Verdict::Starved
                } else {
                    self.search.hi = c;
                    self.search.confirmed = conclusive;
                    Verdict::Enough
                }
            }
            Purpose::Above { from, conclusive } => {
                let f = self.stats_at(from).unwrap_or(stats);
                let threshold = self.change_threshold(&stats, &f);
                if stats.mean > f.mean + threshold {
                    self.search.lo = Some(from);
                    self.search.hi = c;
                    self.search.confirmed = c >= self.settings.max;
                    Verdict::Better
                } else if conclusive {
                    self.search.hi = from;
                    self.search.confirmed = true;
                    Verdict::NoBetter
                } else {
                    let below_floor = self.settings.floor.saturating_sub(1);
                    self.search.lo = Some(self.search.lo.unwrap_or(below_floor));
                    self.search.hi = c;
                    self.search.confirmed = true;
                    Verdict::NoBetter
                }
            }
        };
        self.verdicts.push(verdict);
        self.measured.retain(|m| m.cores != stats.cores);
        self.measured.push(stats);
    }

    fn stats_at(&self, cores: u32) -> Option<WindowStats> {
        self.measured.iter().find(|m| m.cores == cores).copied()
    }

    fn change_threshold(&self, a: &WindowStats, b: &WindowStats) -> f64 {
        let (mut weighted, mut df) = (0.0, 0.0);
        let new = [a, b].into_iter().filter(|w| !self.measured.contains(w));
        for w in self.measured.iter().chain(new) {
            weighted += w.df * w.se * w.se * w.n as f64;
            df += w.df;
        }
        if df <= 0.0 {
            return a.change_threshold(b);
        }
        let per_sample = weighted / df;
        let floor = |w: &WindowStats| {
            let pooled = (per_sample / w.n.max(1) as f64).sqrt();
            if pooled > w.se {
                WindowStats {
                    se: pooled,
                    df,
                    ..*w
                }
            } else {
                *w
            }
        };
        floor(a).change_threshold(&floor(b))
    }

    fn next(&mut self, now: Duration) -> TunerAction {
        let Search {
            lo, hi, confirmed, ..
        } = self.search;
        let floor = self.settings.floor;
        let lower = lo.map_or(i64::from(floor) - 1, i64::from);
        let width = i64::from(hi) - lower;
        let narrow = width <= i64::from(self.settings.tolerance) + 1;
        if narrow && confirmed {
            return self.settle(hi);
        }
        if !narrow && lo.is_none() {
            let origin = self.settings.start;
            let step = self.gallop(origin);
            let below = hi.saturating_sub(step.len).max(floor);
            let purpose = Purpose::Below {
                reference: origin,
                conclusive: origin.saturating_sub(below) >= step.visible,
            };
            return self.probe(below, purpose, now);
        }
        if !narrow && confirmed {
            let below = i64::from(hi) - width / 2;
            let below = u32::try_from(below).unwrap_or(floor).max(floor);
            let purpose = Purpose::Below {
                reference: hi,
                conclusive: true,
            };
            return self.probe(below, purpose, now);
        }
        let growing = self.verdicts.last() == Some(&Verdict::Better);
        if !growing {
            self.search.stride = 0;
        }
        let step = self.gallop(hi);
        let above = hi.saturating_add(step.len).min(self.settings.max);
        if above <= hi {
            return self.settle(hi);
        }
        let purpose = Purpose::Above {
            from: hi,
            conclusive: above - hi >= step.visible,
        };
        self.probe(above, purpose, now)
    }

    fn gallop(&mut self, reference: u32) -> Step {
        let first = (self.settings.start / 8).max(self.settings.tolerance.saturating_add(1));
        let visible = match self.stats_at(reference) {
            Some(r) if r.mean > 0.0 => {
                let threshold = self.change_threshold(&r, &r);
                let cores =
                    POWER_MARGIN * threshold / (STARVED_ELASTICITY * r.mean) * f64::from(r.cores);
                cores.ceil().min(f64::from(u32::MAX)) as u32
            }
            Some(_) => u32::MAX,
            None => 0,
        };
        let len = first.max(self.search.stride.saturating_mul(2)).max(visible);
        self.search.stride = len;
        Step { len, visible }
    }

    fn probe(&mut self, cores: u32, purpose: Purpose, now: Duration) -> TunerAction {
        self.cores = cores;
        self.phase = Phase::Measuring {
            cores,
            purpose,
            started: now,
            samples: Vec::new(),
            extended: 0,
        };
        TunerAction::Resize(cores)
    }

    fn settle(&mut self, cores: u32) -> TunerAction {
        self.cores = cores;
        self.phase = Phase::Settled(cores);
        TunerAction::Settle(cores)
    }
}
