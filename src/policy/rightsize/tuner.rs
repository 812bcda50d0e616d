//! The tuner (SODA §V-B-2): a search, one measurement window at a time, for the fewest cores
//! at which a job's GPU utilization is at its maximum. Pure: time and samples are arguments.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::fit;
use super::noise::WindowStats;
use super::types::{Decision, HoldReason, Probe, TunerAction, TunerSettings};
use stall::stall_after;

mod disk;
mod limit;
mod stall;
mod view;

/// Fewest utilization samples a window needs before it is judged; below that its noise cannot
/// be estimated. A window that ends with fewer stays open until it has them; a window measured
/// on `n` times, until it has `n + 1` times as many.
pub const MIN_WINDOW_SAMPLES: usize = 6;
/// Least proportional change of a starved job's utilization with its cores, for sizing steps
/// (see `Tuner::gallop`): Amdahl's law with a parallel fraction of 0.85 gives 0.5 up to 5 cores
/// per GPU and less above, where the curve is flatter and a missed knee costs less.
const STARVED_ELASTICITY: f64 = 0.5;
/// A galloping step is long enough for a starved job to change by this many noise thresholds.
const POWER_MARGIN: f64 = 2.0;
/// A window is measured on for another window's length at most this many times in all (more
/// samples shrink its noise; they cost time, not probes): when it ends undecided (see
/// `Tuner::undecided`; at most twice for that) or when the fitted curve wants more of it (see
/// `fit::measure_on`). Bounded, so a noisy job is still judged, on five windows' worth.
pub const MAX_EXTENSIONS: u32 = 4;
const UNDECIDED_EXTENSIONS: u32 = 2;
/// Utilization of a fully busy GPU, in the samples' unit (percent, as NVML reports it).
const FULL_UTILIZATION: f64 = 100.0;
/// Elasticity of utilization with cores assumed when a step up is sized from the utilization
/// (see `Tuner::level_step`): Amdahl's law with a parallel fraction of 0.9 at 4 cores per GPU.
const LEVEL_ELASTICITY: f64 = 0.7;

/// SODA §V-B-2 as a state machine: finds the fewest cores at which the job's GPU utilization is
/// at its maximum, one window at a time.
///
/// The first probe's direction depends on where the start came from. A start from the owner's
/// history ([`TunerSettings::from_history`], §V-B-1: the largest count the owner's similar jobs
/// settled on) usually sits at or just above the knee, and the search tries a smaller count
/// first, as §V-B-2 has it; if utilization does not drop it keeps shrinking until it drops,
/// with steps that double (galloping: `max(tolerance + 1, start / 8)`, and at least 2 cores per
/// GPU when [`TunerSettings::gpus`] is known, then twice that, ...).
/// Any other start (a category default, the requested count) is a guess that more often starves
/// the job than not (§III-B: most jobs ask for 1 or 2 cores), and the search tries a larger
/// count first. A step up is sized from the utilization measured (see `Tuner::level_step`):
/// the lower it is, the further the knee can be, so the step often reaches the plateau at once.
///
/// Between the last count known too few and the smallest known enough, it bisects. A count is
/// known too few when a comparison found it so, or by inference from the curve's shape (see
/// `Tuner::infer`, §IV-B-1: below the knee, utilization rises less than in proportion to the
/// cores), which from one starved window and the plateau rules out every count whose
/// utilization could not reach the plateau: the bracket often starts within a core or two of
/// the knee. After a step up that helped, the search looks below the new count before
/// confirming it from above: a count below that does as well shows the curve flat there, past
/// the knee. It settles when fewer cores would starve the job and more would not help, to
/// within `tolerance` cores, on a count it measured; or earlier, on a count between two it
/// measured, once SODA's curve fitted to every window (`fit`, §IV-B-1: Amdahl's law capped at
/// a plateau) places the knee within `tolerance` by every fit the noise allows.
///
/// A change counts only when it exceeds the noise measured in the windows compared (see
/// [`Decision`]); no fixed percentage is involved. "No change" counts only after a step long
/// enough for a starved job to have shown one (see `Tuner::gallop`): a step cut short by the
/// floor or the max proves nothing, and the search then checks from the other side. The
/// search assumes what SODA observed (§IV-B-1, §V-B): utilization rises with cores like a
/// multithreaded job up to the best-fit count and stays flat, or drops slightly, above it.
///
/// While a contention throttle is active (SODA §V-E) no window runs and no probe starts; a
/// probe below the best count known is undone until the throttle ends, then made again.
///
/// The caller keeps the job at [`Tuner::cores`] and calls [`Tuner::step`] as samples arrive.
/// Every window must be measured at the count the tuner asked for: a caller that does not
/// apply the resizes (an advisory mode) must not feed it, since every probe would then look
/// like "no change" and the search would walk down to the floor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tuner {
    settings: TunerSettings,
    /// The count the job should have now.
    cores: u32,
    phase: Phase,
    search: Search,
    /// The last window's figures at each count measured.
    measured: Vec<WindowStats>,
    history: Vec<Probe>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Phase {
    WarmUp {
        until: Duration,
    },
    Measuring {
        cores: u32,
        purpose: Purpose,
        started: Duration,
        /// The window's samples so far. Kept in memory only: the state file keeps decisions,
        /// not per-sample figures, so a sensing pass inside a window writes nothing. A tuner
        /// read back from the file has `None` and starts the window again at its next step
        /// rather than judging it on part of itself.
        #[serde(skip)]
        samples: Option<Vec<f64>>,
        /// When the window last got a sample (in memory only, as `samples`): a window whose
        /// samples stopped coming has stalled, one that fills slowly (long sensing intervals)
        /// has not.
        #[serde(skip)]
        last_sample: Option<Duration>,
        /// Times the window was measured on because it ended undecided; it lasts
        /// `window * (1 + extended)`.
        #[serde(default)]
        extended: u32,
    },
    /// A throttle stopped the window measuring `cores`; it restarts when the throttle ends.
    /// `stalled`: no throttle, but the window got too few samples for too long (see
    /// `Tuner::stall`); it restarts with the next sample.
    Throttled {
        cores: u32,
        purpose: Purpose,
        #[serde(default)]
        stalled: bool,
    },
    Settled(u32),
}

/// What a window is compared with. `conclusive`: the step from the compared count was long
/// enough that a starved job would have shown a change (see `Tuner::gallop`). A step cut short
/// by the floor or the max may not have been, and then "no change" proves nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Purpose {
    Baseline,
    /// A smaller count than `reference`: is it starved?
    Below {
        reference: u32,
        #[serde(default)]
        conclusive: bool,
    },
    /// A larger count than `from`: does it help?
    Above {
        from: u32,
        #[serde(default)]
        conclusive: bool,
    },
}

/// A galloping step: its length, and the length that a starved job's change would show in.
#[derive(Debug, Clone, Copy)]
struct Step {
    len: u32,
    visible: u32,
}

/// The bracket around the best-fit count: `lo` is starved, `hi` is enough (or, unconfirmed, the
/// best measured so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Search {
    /// The largest count known to be too few (or one below the floor, which stands for too
    /// few); `None`: none yet (the floor may be enough).
    lo: Option<u32>,
    /// The smallest count believed enough.
    hi: u32,
    /// Whether `hi` is known to be enough: fewer cores did as well, or more did no better, or
    /// it is the most the job can have.
    confirmed: bool,
    /// The last step taken away from the start while galloping (0: none yet in this
    /// direction); the next is at least twice as long.
    #[serde(default)]
    stride: u32,
    /// The count galloping starts from and shrinking probes are compared with: the start
    /// (`None`), or the count a search started over at.
    #[serde(default)]
    origin: Option<u32>,
}

impl Tuner {
    /// A tuner for a job that runs at `settings.start` (clamped to the floor and max) from
    /// `now`; the caller resizes the job to [`Tuner::cores`] at once. The first window starts
    /// after `settings.warmup`.
    pub fn new(settings: TunerSettings, now: Duration) -> Self {
        let limits = settings.limits();
        let start = limits.clamp(settings.start);
        let settings = TunerSettings {
            start,
            floor: limits.clamp(settings.floor),
            max: limits.clamp(settings.max),
            ..settings
        };
        Self {
            cores: start,
            phase: Phase::WarmUp {
                until: now.saturating_add(settings.warmup),
            },
            search: Search {
                lo: None,
                hi: start,
                confirmed: false,
                stride: 0,
                origin: None,
            },
            settings,
            measured: Vec::new(),
            history: Vec::new(),
        }
    }

    /// Advances the tuner to `now`.
    ///
    /// `samples`: the job's GPU utilization samples taken since the previous call (or since
    /// [`Tuner::new`]), in percent (as NVML reports it: a step up is sized from how far the
    /// utilization is from 100); non-finite ones are ignored.
    /// Call it at every sample, every tick or only at window ends: a window is judged at the
    /// first call at least `settings.window` after it began, and the next one begins then.
    /// Samples handed over during the warm-up or while throttled are dropped. `now` is any
    /// clock in step with the one given to [`Tuner::new`] (the agent uses the Unix time); if
    /// it steps back, the current window starts again. `throttle_active`: a contention
    /// throttle is active on the node (SODA §V-E); the tuner then never probes.
    pub fn step(&mut self, now: Duration, samples: &[f64], throttle_active: bool) -> TunerAction {
        if let Phase::Settled(n) = self.phase {
            return TunerAction::Settle(n);
        }
        if throttle_active {
            return self.throttle();
        }
        match &mut self.phase {
            Phase::Settled(_) => unreachable!("handled above"),
            Phase::WarmUp { until } => {
                if now < *until {
                    return TunerAction::Wait;
                }
                self.phase = Phase::Measuring {
                    cores: self.cores,
                    purpose: Purpose::Baseline,
                    started: now,
                    samples: Some(Vec::new()),
                    last_sample: None,
                    extended: 0,
                };
                TunerAction::Wait
            }
            Phase::Throttled {
                cores,
                purpose,
                stalled,
            } => {
                let (cores, purpose) = (*cores, *purpose);
                // A stalled window starts again with the sample that ended the stall.
                let fresh: Vec<f64> = match stalled {
                    true => samples.iter().copied().filter(|s| s.is_finite()).collect(),
                    false => Vec::new(),
                };
                if *stalled && fresh.is_empty() {
                    return TunerAction::Hold(HoldReason::NoSamples);
                }
                self.phase = Phase::Measuring {
                    cores,
                    purpose,
                    started: now,
                    samples: Some(fresh),
                    last_sample: Some(now),
                    extended: 0,
                };
                if self.cores == cores {
                    TunerAction::Wait
                } else {
                    self.cores = cores;
                    TunerAction::Resize(cores)
                }
            }
            Phase::Measuring {
                cores,
                purpose,
                started,
                samples: kept,
                last_sample,
                extended,
            } => {
                // A clock stepped back restarts the window rather than stretching it, and so
                // does a window whose samples were not kept (a tuner read back from the state
                // file).
                let window = match kept {
                    Some(window) if now >= *started => window,
                    _ => {
                        *started = now;
                        kept.insert(Vec::new())
                    }
                };
                let before = window.len();
                window.extend(samples.iter().copied().filter(|s| s.is_finite()));
                if window.len() > before {
                    *last_sample = Some(now);
                }
                let length = self.settings.window.saturating_mul(1 + *extended);
                if now - *started < length {
                    return TunerAction::Wait;
                }
                // A window measured on holds that many windows' worth of samples at least.
                let need = MIN_WINDOW_SAMPLES.saturating_mul(1 + *extended as usize);
                if window.len() < need {
                    // Stalled when no sample came for that long, not when the window fills
                    // slowly: one sample per sensing pass, and a pass may be 60 s.
                    let quiet_since = last_sample.unwrap_or(*started).max(*started);
                    if now.saturating_sub(quiet_since) >= stall_after(length) {
                        return self.stall();
                    }
                    return TunerAction::Hold(HoldReason::TooFewSamples {
                        have: window.len(),
                        need,
                    });
                }
                let stats = WindowStats::of(*cores, window);
                let (purpose, times) = (*purpose, *extended);
                let (limits, tolerance) = (self.settings.limits(), self.settings.tolerance);
                if (times < UNDECIDED_EXTENSIONS && self.undecided(&stats, purpose))
                    || (times < MAX_EXTENSIONS
                        && fit::measure_on(
                            &self.measured,
                            &stats,
                            limits,
                            tolerance,
                            self.settings.min_change,
                        ))
                {
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

    fn throttle(&mut self) -> TunerAction {
        let held = TunerAction::Hold(HoldReason::Throttled);
        let Phase::Measuring {
            cores,
            purpose,
            samples,
            ..
        } = &self.phase
        else {
            // Warming up (it goes on: it waits for the job's launch, not for quiet), or already
            // throttled.
            return held;
        };
        let (cores, purpose) = (*cores, *purpose);
        let partial = WindowStats::of(cores, samples.as_deref().unwrap_or_default());
        let interrupted = Probe {
            cores,
            mean_util: partial.mean,
            noise: partial.se,
            samples: partial.n,
            decision: Decision::Interrupted,
        };
        // A throttle that comes and goes must not grow the history without bound: one entry
        // per interrupted count in a row.
        match self.history.last_mut() {
            Some(last) if last.decision == Decision::Interrupted && last.cores == cores => {
                *last = interrupted;
            }
            _ => self.history.push(interrupted),
        }
        self.phase = Phase::Throttled {
            cores,
            purpose,
            stalled: false,
        };
        // A probe below the best count known would leave the job short of cores for as long as
        // the contention lasts: go back to that count until the window can be run again.
        let safe = self.search.hi.min(self.settings.max);
        if self.cores < safe {
            self.cores = safe;
            return TunerAction::Resize(safe);
        }
        held
    }

    /// Whether a window that ended is too noisy to judge yet: it points toward a starved job
    /// (utilization lower at fewer cores by more than the threshold less half the noise
    /// threshold) without clearing the threshold. Judged now, it would read "no change" where the evidence leans the other
    /// way; measured on, its noise shrinks (sequential testing). A baseline, or a window the
    /// evidence does not lean either way on, is not measured on for this (the fit may still
    /// want it: `fit::measure_on`). (Asking also that the step be too short to show a starved
    /// job's change failed in CI: 66 to 79 ± 5 for twice the cores was judged "no better".)
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
        // Within half the noise threshold below the threshold: more samples may carry it over.
        // Without a `min_change` floor that is the half-threshold above; with one, a rise
        // further below the floor stays below it however many samples are taken.
        let threshold = self.change_threshold(&fewer, &more);
        let rise = more.mean - fewer.mean;
        rise > threshold - self.noise_threshold(&fewer, &more) / 2.0 && rise <= threshold
    }

    /// Records the window and moves the bracket.
    fn judge(&mut self, stats: WindowStats, purpose: Purpose) {
        let c = stats.cores;
        let decision = match purpose {
            Purpose::Baseline => {
                self.search.hi = c;
                self.search.confirmed = c >= self.settings.max;
                Decision::Baseline
            }
            Purpose::Below {
                reference,
                conclusive,
            } => {
                let Some(r) = self.stats_at(reference) else {
                    return self.restart_at(stats);
                };
                let threshold = self.change_threshold(&stats, &r);
                if stats.mean < r.mean - threshold {
                    self.search.lo = Some(c);
                    Decision::Starved {
                        than: reference,
                        threshold,
                    }
                } else {
                    // Flat from `c` up to the reference: by the shape of the curve, `c` is at or
                    // past the knee. After a step too short to tell, `c` is only as good as
                    // known: growth will check it.
                    self.search.hi = c;
                    self.search.confirmed = conclusive;
                    Decision::Enough {
                        than: reference,
                        threshold,
                    }
                }
            }
            Purpose::Above { from, conclusive } => {
                let Some(f) = self.stats_at(from) else {
                    return self.restart_at(stats);
                };
                let threshold = self.change_threshold(&stats, &f);
                if stats.mean > f.mean + threshold {
                    self.search.lo = Some(from);
                    self.search.hi = c;
                    self.search.confirmed = c >= self.settings.max;
                    Decision::Better {
                        than: from,
                        threshold,
                    }
                } else if conclusive {
                    self.search.hi = from;
                    self.search.confirmed = true;
                    Decision::NoBetter {
                        than: from,
                        threshold,
                    }
                } else {
                    // After a step cut short by the max, `from` is not cleared: bisect from
                    // the max, the most the job can have, down to the last count known too few
                    // (or the floor; no more galloping, which could go round in a circle).
                    let below_floor = self.settings.floor.saturating_sub(1);
                    self.search.lo = Some(self.search.lo.unwrap_or(below_floor));
                    self.search.hi = c;
                    self.search.confirmed = true;
                    Decision::NoBetter {
                        than: from,
                        threshold,
                    }
                }
            }
        };
        self.record(stats, decision);
    }

    /// The window a comparison needs is missing (only a tuner restored from a damaged or older
    /// state can lack it): the search starts again from this window, as from a baseline.
    fn restart_at(&mut self, stats: WindowStats) {
        self.search = Search {
            lo: None,
            hi: stats.cores,
            confirmed: stats.cores >= self.settings.max,
            stride: 0,
            origin: Some(stats.cores),
        };
        self.record(stats, Decision::Baseline);
    }

    fn record(&mut self, stats: WindowStats, decision: Decision) {
        self.history.push(Probe {
            cores: stats.cores,
            mean_util: stats.mean,
            noise: stats.se,
            samples: stats.n,
            decision,
        });
        self.measured.retain(|m| m.cores != stats.cores);
        self.measured.push(stats);
    }

    fn stats_at(&self, cores: u32) -> Option<WindowStats> {
        self.measured.iter().find(|m| m.cores == cores).copied()
    }

    /// The smallest difference between windows `a` and `b` that counts as a change (see
    /// [`Decision`]). The noise of a job's utilization is much the same at every count, so a
    /// window's standard error is taken as at least what all the windows measured so far say
    /// it is for its number of samples: one window's estimate, from ten batches, can be low by
    /// chance, and a comparison with that window would then see changes in noise. Never below
    /// the settings' `min_change`.
    fn change_threshold(&self, a: &WindowStats, b: &WindowStats) -> f64 {
        self.noise_threshold(a, b).max(self.settings.min_change)
    }

    /// `change_threshold` from the noise alone.
    fn noise_threshold(&self, a: &WindowStats, b: &WindowStats) -> f64 {
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

    /// The next probe, or the end.
    fn next(&mut self, now: Duration) -> TunerAction {
        self.infer();
        // The curve fitted to every window (SODA §IV-B-1) may already place the knee within the
        // tolerance: then no more probes.
        let (limits, tolerance) = (self.settings.limits(), self.settings.tolerance);
        if let Some(n) = fit::settle_count(
            &self.measured,
            &self.history,
            limits,
            tolerance,
            self.settings.min_change,
        ) {
            self.search.hi = n;
            return self.settle(n);
        }
        let Search {
            lo, hi, confirmed, ..
        } = self.search;
        let floor = self.settings.floor;
        let tolerance = i64::from(self.settings.tolerance);
        // Below the floor counts as starved: the search never goes there.
        let lower = lo.map_or(i64::from(floor) - 1, i64::from);
        let width = i64::from(hi) - lower;
        let narrow = width <= tolerance + 1;
        if narrow && confirmed {
            return self.settle(hi);
        }
        let last = self
            .history
            .iter()
            .rev()
            .find(|p| p.decision != Decision::Interrupted)
            .map(|p| p.decision);
        // A start from the owner's history usually sits at or just above the knee (§V-B-1):
        // smaller first, as §V-B-2 has it. Any other start is a guess, and a job is more often
        // starved at it than not (§III-B: most jobs ask for 1 or 2 cores): larger first, by a
        // step sized from the start's utilization, which may find the plateau at once.
        let first = last == Some(Decision::Baseline) && !confirmed && !self.settings.from_history;
        if !narrow && lo.is_none() && !first {
            // §V-B-2: smaller, and on while utilization does not drop. Each probe is compared
            // with the start, not with the previous probe, so that drops too small to see one
            // at a time cannot add up unseen.
            let origin = self.search.origin.unwrap_or(self.settings.start);
            let step = self.gallop(origin);
            let below = hi.saturating_sub(step.len).max(floor);
            let purpose = Purpose::Below {
                reference: origin,
                conclusive: origin.saturating_sub(below) >= step.visible,
            };
            return self.probe(below, purpose, now);
        }
        let grew = matches!(last, Some(Decision::Better { .. }));
        if !narrow && (confirmed || grew) {
            // Between the last count known too few (measured, or inferred: see `infer`) and
            // `hi`: bisect, at least `tolerance + 1` above the former, so that a count found
            // enough there ends the search. After a step up that helped, this comes before
            // any confirmation from above: a count below the new one that does as well shows
            // the curve flat there, past the knee (§V-B), and `hi` was not needed.
            let off = (width + 1) / 2;
            let off = off.max(tolerance + 1).min(width - 1);
            let below = u32::try_from(lower + off).unwrap_or(floor).max(floor);
            let conclusive = confirmed || hi - below >= self.visible(hi);
            if conclusive {
                let purpose = Purpose::Below {
                    reference: hi,
                    conclusive,
                };
                return self.probe(below, purpose, now);
            }
        }
        // §V-B-2: fewer cores starved the job (or the start is a guess) and `hi` is not shown
        // to be enough: try more until utilization stops rising.
        if !grew {
            self.search.stride = 0;
        }
        let step = self.gallop(hi);
        let above = hi
            .saturating_add(step.len.max(self.level_step(hi)))
            .min(self.settings.max);
        if above <= hi {
            return self.settle(hi);
        }
        let purpose = Purpose::Above {
            from: hi,
            conclusive: above - hi >= step.visible,
        };
        self.probe(above, purpose, now)
    }

    /// A step up from `from` long enough, going by its utilization, to reach the knee if the
    /// job's utilization rose with elasticity [`LEVEL_ELASTICITY`] up to a fully busy GPU: the
    /// lower the utilization, the more starved the job can be. A plateau lower than 100 %, or
    /// a curve flatter than that, leaves the step short or long; the search goes on from
    /// there either way.
    fn level_step(&self, from: u32) -> u32 {
        let Some(w) = self.stats_at(from) else {
            return 0;
        };
        if w.mean <= 0.0 {
            return self.settings.max.saturating_sub(from);
        }
        let ratio = (FULL_UTILIZATION / w.mean).max(1.0);
        let target = f64::from(from) * ratio.powf(1.0 / LEVEL_ELASTICITY);
        // Saturating float-to-int conversion; a NaN becomes 0.
        let target = target.ceil().min(f64::from(u32::MAX)) as u32;
        target.saturating_sub(from)
    }

    /// Raises `lo`, the largest count known too few, by inference from the windows measured
    /// (SODA §IV-B-1: a training job's utilization rises with its cores like a multithreaded
    /// job's, by Amdahl's law, up to the knee). Amdahl's speedup grows less than in proportion
    /// to the cores, so below the knee `u(c') <= u(c) * c' / c` for `c' > c`. A window at `c`
    /// lower than the best window's mean `top` by more than the noise threshold `t` (starved)
    /// then shows every count `c' < c * (top - t) / u(c)` lower than `top` by more than `t`
    /// too: starved, without a probe. The threshold is the measured one, no fixed percentage;
    /// the inference is only as good as the model, and the search confirms from above what it
    /// settles on (a count is settled on only once measured to be enough).
    fn infer(&mut self) {
        let hi = self.search.hi;
        let Some(top) = self
            .measured
            .iter()
            .copied()
            .max_by(|a, b| a.mean.total_cmp(&b.mean))
        else {
            return;
        };
        // Only windows a comparison already found too few (at or below `lo`): the best window
        // is the highest of several, and compared with every window it would find some lower
        // by chance.
        let Some(mut lo) = self.search.lo else {
            return;
        };
        let known = lo;
        for w in self
            .measured
            .iter()
            .filter(|w| w.cores <= known && w.cores < hi && w.mean > 0.0)
        {
            let threshold = self.change_threshold(w, &top);
            let level = top.mean - threshold;
            if w.mean >= level {
                continue;
            }
            let reach = (f64::from(w.cores) * level / w.mean).ceil() - 1.0;
            // Saturating float-to-int conversion, below `hi`.
            let bound = (reach.min(f64::from(hi - 1)) as u32).max(w.cores);
            lo = lo.max(bound);
        }
        self.search.lo = Some(lo);
    }

    /// The step from `reference` that a starved job's change would show in (see `gallop`).
    fn visible(&self, reference: u32) -> u32 {
        match self.stats_at(reference) {
            Some(r) if r.mean > 0.0 => {
                let threshold = self.change_threshold(&r, &r);
                let cores =
                    POWER_MARGIN * threshold / (STARVED_ELASTICITY * r.mean) * f64::from(r.cores);
                // Saturating float-to-int conversion; a NaN becomes 0.
                cores.ceil().min(f64::from(u32::MAX)) as u32
            }
            // No utilization at all: no step is too large.
            Some(_) => u32::MAX,
            None => 0,
        }
    }

    /// The next step away from the start, in either direction, judged against the window at
    /// `reference`. Steps double (galloping): short near the start, which the owner's history
    /// makes a good guess (§V-B-1), and few to reach a best count far from it. And each is long
    /// enough for its outcome to mean something: if the job were starved, the step would change
    /// its utilization by twice the noise threshold, taking a starved job's utilization to
    /// change at least half in proportion to its cores (a multithreaded job's, §IV-B-1, with a
    /// parallel fraction of 0.85 or more up to a few cores per GPU). Without this, a small
    /// step in a noisy window would show no significant change and a starved job would be
    /// taken to have enough.
    ///
    /// From the owner's history the first step is at least 2 cores per GPU: §V-B-1 starts from
    /// the largest count the owner's earlier jobs of the category settled on ("a user tends to
    /// submit similar training jobs"), which usually lies above this job's knee; lodger's
    /// benchmark models "similar" as knees within 2 cores per GPU of the owner's typical one (a
    /// spread the paper does not give), and a shorter step there mostly finds the curve still
    /// flat.
    fn gallop(&mut self, reference: u32) -> Step {
        let prior = u32::from(self.settings.from_history).saturating_mul(self.settings.gpus);
        let first = (self.settings.start / 8)
            .max(self.settings.tolerance.saturating_add(1))
            .max(prior.saturating_mul(2));
        let visible = self.visible(reference);
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
            samples: Some(Vec::new()),
            last_sample: None,
            extended: 0,
        };
        TunerAction::Resize(cores)
    }

    fn settle(&mut self, cores: u32) -> TunerAction {
        self.cores = cores;
        self.phase = Phase::Settled(cores);
        TunerAction::Settle(cores)
    }

    /// Ends tuning now (the job is leaving, or the operator turned tuning off) at
    /// [`Tuner::recommendation`], and returns it.
    pub fn stop(&mut self) -> u32 {
        let n = self.recommendation();
        self.settle(n);
        n
    }
}
