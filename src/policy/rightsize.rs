//! Right-sizing a training job's cores from its GPU utilization: SODA's adaptive CPU allocator
//! (§V-B). Pure: no I/O, no clock; time and utilization samples are arguments.
//!
//! Two parts. [`start_cores`] picks the count a job starts at (§V-B-1) from its owner's
//! [`OwnerHistory`] or its category. A [`Tuner`] then searches, one measurement window at a
//! time, for the fewest cores at which the job's GPU utilization is at its maximum (§V-B-2):
//! the job's best-fit count, which SODA defines as the minimum count giving the maximal speed
//! and finds at the same count as the maximal GPU utilization (§IV-B-1).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::job::Category;

/// Time a job is left alone after it starts before the first window: SODA §VI-H notes that a
/// training job's launch and context preparation "may take more than 3 minutes".
pub const DEFAULT_WARMUP: Duration = Duration::from_secs(180);
/// One measurement window: SODA §VI-H profiles each core count for 60 s (20 to 170 training
/// iterations of the Table I models).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);
/// Cores of error accepted around the best-fit count: the search stops once it has narrowed the
/// count down to `tolerance + 1` candidates and keeps the largest (the one known to be enough).
pub const DEFAULT_TOLERANCE: u32 = 1;
/// Fewest utilization samples a window needs before it is judged; below that its noise cannot
/// be estimated. A window that ends with fewer stays open until it has them.
pub const MIN_WINDOW_SAMPLES: usize = 6;
/// A window's noise is estimated from the means of this many consecutive batches of its
/// samples, not from the samples themselves: GPU utilization sampled once a second is
/// correlated over an iteration (a Wavenet iteration takes about 3 s, §VI-H), and treating
/// correlated samples as independent would understate the noise.
const NOISE_BATCHES: usize = 10;
/// Least proportional change of a starved job's utilization with its cores, for sizing steps
/// (see `Tuner::gallop`): Amdahl's law with a parallel fraction of 0.85 gives 0.5 up to 5 cores
/// per GPU and less above, where the curve is flatter and a missed knee costs less.
const STARVED_ELASTICITY: f64 = 0.5;
/// A galloping step is long enough for a starved job to change by this many noise thresholds.
const POWER_MARGIN: f64 = 2.0;
/// Settled counts remembered per (owner, category): the start is the largest of the recent ones,
/// so one odd job does not raise every later start for ever.
const HISTORY_PER_KEY: usize = 8;
/// (owner, category) pairs remembered; the least recently recorded is forgotten first.
const HISTORY_MAX_KEYS: usize = 4096;

// ---------------------------------------------------------------------------------------------
// Start point (§V-B-1).

/// What the job's owner says about it, beyond its category (SODA §V-B-1, from the factors of
/// §IV-B-2). Each moves the start by one core per GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartHints {
    /// Input loading is pipelined with GPU compute: one core fewer per GPU.
    pub pipelined_loader: bool,
    /// The model has a large number of weights: one core fewer per GPU.
    pub large_model: bool,
    /// Preprocessing between iterations is heavy: one core more per GPU.
    pub heavy_preprocessing: bool,
}

/// The counts a job may be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoreLimits {
    /// Never fewer (see [`default_floor`]).
    pub floor: u32,
    /// Never more: the CPUs the job could get (its own plus the free ones and those lent to
    /// lodgers, which give them back).
    pub max: u32,
}

impl CoreLimits {
    /// `n` within the limits. When `floor > max` (the node cannot give the floor), `max` wins.
    pub fn clamp(self, n: u32) -> u32 {
        let max = self.max.max(1);
        n.clamp(self.floor.clamp(1, max), max)
    }
}

/// The floor a job is never shrunk below: one core per GPU when shrinking is allowed (the
/// default), else the count it asked for.
pub fn default_floor(gpus: u32, requested: u32, shrink_allowed: bool) -> u32 {
    if shrink_allowed {
        gpus.max(1)
    } else {
        requested.max(1)
    }
}

/// SODA §V-B-1: the start for a tenant's first job of a category, per GPU ("3 for CV models, 5
/// for NLP models, and 5 for SPEECH models", from §IV-B). `None` for `Other`, which starts at
/// the requested count.
pub fn category_default_per_gpu(category: Category) -> Option<u32> {
    match category {
        Category::Cv => Some(3),
        Category::Nlp | Category::Speech => Some(5),
        Category::Other => None,
    }
}

/// SODA §V-B-1, N_start: the largest count the owner's earlier jobs of the same category settled
/// on (per GPU, times this job's GPUs), else the category default (per GPU), else (`Other`) the
/// requested count; then one core per GPU fewer for a pipelined loader, one fewer for a large
/// model and one more for heavy preprocessing; clamped to `limits`.
///
/// A job with no GPU listed counts as one GPU.
pub fn start_cores(
    history: &OwnerHistory,
    owner: u32,
    category: Category,
    requested: u32,
    gpus: u32,
    hints: StartHints,
    limits: CoreLimits,
) -> u32 {
    let gpus = i64::from(gpus.max(1));
    let base = match history.largest_per_gpu(owner, category) {
        Some(per_gpu) => i64::from(per_gpu) * gpus,
        None => match category_default_per_gpu(category) {
            Some(per_gpu) => i64::from(per_gpu) * gpus,
            None => i64::from(requested),
        },
    };
    let per_gpu_adjust = i64::from(hints.heavy_preprocessing)
        - i64::from(hints.pipelined_loader)
        - i64::from(hints.large_model);
    let total = (base + per_gpu_adjust * gpus).max(0);
    limits.clamp(u32::try_from(total).unwrap_or(u32::MAX))
}

/// The counts owners' jobs settled on, by category: SODA §V-B-1 assumes "a user tends to submit
/// similar training jobs". The agent keeps it in the state directory across restarts.
///
/// Counts are kept per GPU, so a 4-GPU job's history gives a 1-GPU job of the same owner a
/// quarter of its count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerHistory {
    /// Least recently recorded first.
    records: Vec<OwnerRecord>,
}

/// One owner's settled counts for one category.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    pub owner: u32,
    pub category: Category,
    /// Settled cores per GPU (rounded up) of the owner's most recent jobs, oldest first.
    pub settled_per_gpu: Vec<u32>,
}

impl OwnerHistory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Remembers that a job of `owner` in `category` with `gpus` GPUs (0 counts as 1) settled
    /// on `settled_cores`.
    pub fn record(&mut self, owner: u32, category: Category, settled_cores: u32, gpus: u32) {
        let per_gpu = settled_cores.div_ceil(gpus.max(1));
        let mut record = match self
            .records
            .iter()
            .position(|r| r.owner == owner && r.category == category)
        {
            Some(i) => self.records.remove(i),
            None => OwnerRecord {
                owner,
                category,
                settled_per_gpu: Vec::new(),
            },
        };
        record.settled_per_gpu.push(per_gpu);
        if record.settled_per_gpu.len() > HISTORY_PER_KEY {
            record.settled_per_gpu.remove(0);
        }
        self.records.push(record);
        if self.records.len() > HISTORY_MAX_KEYS {
            self.records.remove(0);
        }
    }

    /// The largest settled count per GPU remembered for `owner`'s jobs of `category`.
    pub fn largest_per_gpu(&self, owner: u32, category: Category) -> Option<u32> {
        self.records
            .iter()
            .find(|r| r.owner == owner && r.category == category)
            .and_then(|r| r.settled_per_gpu.iter().copied().max())
    }

    pub fn records(&self) -> &[OwnerRecord] {
        &self.records
    }
}

// ---------------------------------------------------------------------------------------------
// Tuning (§V-B-2).

/// How a [`Tuner`] searches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunerSettings {
    /// The count the job runs at from the start ([`start_cores`]).
    pub start: u32,
    /// Never fewer ([`default_floor`]).
    pub floor: u32,
    /// Never more: the CPUs the job could get.
    pub max: u32,
    /// Left alone after the start before the first window ([`DEFAULT_WARMUP`]).
    pub warmup: Duration,
    /// Length of each measurement window ([`DEFAULT_WINDOW`]).
    pub window: Duration,
    /// Cores of error accepted ([`DEFAULT_TOLERANCE`]).
    pub tolerance: u32,
}

impl TunerSettings {
    /// Default warm-up, window and tolerance.
    pub fn new(start: u32, limits: CoreLimits) -> Self {
        Self {
            start,
            floor: limits.floor,
            max: limits.max,
            warmup: DEFAULT_WARMUP,
            window: DEFAULT_WINDOW,
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    fn limits(&self) -> CoreLimits {
        CoreLimits {
            floor: self.floor,
            max: self.max,
        }
    }
}

/// What the caller should do after a [`Tuner::step`]. In every case the job's count should be
/// [`Tuner::cores`] afterwards; the action says why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TunerAction {
    /// Warming up, or the current window is still running: keep the count.
    Wait,
    /// Resize the job to this many cores (in place: same cpuset, fewer or more CPUs) and keep
    /// sampling. A probe; or, when a contention throttle interrupts a probe below the best
    /// count known, the return to that count.
    Resize(u32),
    /// Done: the best-fit count. Resize to it if the job is not there; tuning is over.
    Settle(u32),
    /// Not measuring, for this reason; keep the count.
    Hold(HoldReason),
}

impl fmt::Display for TunerAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TunerAction::Wait => f.write_str("wait"),
            TunerAction::Resize(n) => write!(f, "resize to {n}"),
            TunerAction::Settle(n) => write!(f, "settle at {n}"),
            TunerAction::Hold(why) => write!(f, "hold: {why}"),
        }
    }
}

/// Why a [`Tuner`] is not measuring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldReason {
    /// A contention throttle is active on the node (SODA §V-E): utilization measured now says
    /// more about the contention than about the job's cores, so no window runs and no probe
    /// starts. The window restarts when the throttle ends.
    Throttled,
    /// The window has ended with too few utilization samples to estimate its noise; it stays
    /// open until it has them.
    TooFewSamples { have: usize, need: usize },
}

impl fmt::Display for HoldReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HoldReason::Throttled => f.write_str("a contention throttle is active"),
            HoldReason::TooFewSamples { have, need } => {
                write!(
                    f,
                    "{have} GPU utilization samples in the window, {need} needed"
                )
            }
        }
    }
}

/// One measurement window, for `lodgerctl show`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    pub cores: u32,
    /// Mean GPU utilization over the window, in the samples' unit.
    pub mean_util: f64,
    /// Standard error of `mean_util`, estimated from the window's samples.
    pub noise: f64,
    pub samples: usize,
    pub decision: Decision,
}

/// What a window showed. `threshold` is the smallest difference that counts as a change: the
/// two windows' standard errors combined, times a Student t quantile for their degrees of
/// freedom (two-sided 95%).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The first window, at the start count.
    Baseline,
    /// Lower than at `than` (more) cores by more than the noise: too few cores.
    Starved { than: u32, threshold: f64 },
    /// Not lower than at `than` (more) cores by more than the noise: enough cores.
    Enough { than: u32, threshold: f64 },
    /// Higher than at `than` (fewer) cores by more than the noise: `than` was too few.
    Better { than: u32, threshold: f64 },
    /// Not higher than at `than` (fewer) cores by more than the noise: `than` was enough.
    NoBetter { than: u32, threshold: f64 },
    /// A contention throttle began during the window: its samples were dropped.
    Interrupted,
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Baseline => f.write_str("baseline"),
            Decision::Starved { than, threshold } => {
                write!(
                    f,
                    "starved: lower than at {than} by more than {threshold:.2}"
                )
            }
            Decision::Enough { than, threshold } => {
                write!(f, "enough: within {threshold:.2} of {than}")
            }
            Decision::Better { than, threshold } => {
                write!(
                    f,
                    "better: higher than at {than} by more than {threshold:.2}; {than} too few"
                )
            }
            Decision::NoBetter { than, threshold } => {
                write!(
                    f,
                    "no better: within {threshold:.2} of {than}; {than} enough"
                )
            }
            Decision::Interrupted => f.write_str("interrupted by a contention throttle"),
        }
    }
}

/// SODA §V-B-2 as a state machine: finds the fewest cores at which the job's GPU utilization is
/// at its maximum, one window at a time.
///
/// From the start count it first probes a smaller count. If utilization does not drop, it keeps
/// shrinking until it drops, then steps back by bisection between the last count that was
/// enough and the first that was not. If it drops, it probes larger counts until utilization
/// stops rising, then bisects back the same way. Steps away from the start double (galloping:
/// `max(tolerance + 1, start / 8)`, then twice that, ...), so a start near the best count, as
/// the owner's history gives (§V-B-1), costs few probes and a start far from it not many more.
/// It settles when fewer cores would starve the job and more would not help, to within
/// `tolerance` cores.
///
/// A change counts only when it exceeds the noise measured in the two windows compared (see
/// [`Decision`]); no fixed percentage is involved. The search assumes what SODA observed
/// (§IV-B-1, §V-B): utilization rises with cores like a multithreaded job up to the best-fit
/// count and stays flat, or drops slightly, above it.
///
/// The caller keeps the job at [`Tuner::cores`] (or, in an advisory mode, only reports
/// [`Tuner::recommendation`]) and calls [`Tuner::step`] as samples arrive.
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
        samples: Vec<f64>,
    },
    /// A throttle stopped the window measuring `cores`; it restarts when the throttle ends.
    Throttled {
        cores: u32,
        purpose: Purpose,
    },
    Settled(u32),
}

/// What a window is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Purpose {
    Baseline,
    /// A smaller count than `reference`: is it starved?
    Below {
        reference: u32,
    },
    /// A larger count than `from`: does it help?
    Above {
        from: u32,
    },
}

/// The bracket around the best-fit count: `lo` is starved, `hi` is enough (or, unconfirmed, the
/// best measured so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Search {
    /// The largest count known to be too few; `None`: none yet (the floor may be enough).
    lo: Option<u32>,
    /// The smallest count believed enough.
    hi: u32,
    /// Whether `hi` is known to be enough: fewer cores did as well, or more did no better, or
    /// it is the most the job can have.
    confirmed: bool,
    /// The last step taken away from the start while galloping (0: none yet in this
    /// direction); the next is at least twice as long.
    stride: u32,
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
            history: Vec::new(),
        }
    }

    /// Advances the tuner to `now`.
    ///
    /// `samples`: the job's GPU utilization samples taken since the previous call (or since
    /// [`Tuner::new`]), in any one unit (lodger passes percent); non-finite ones are ignored.
    /// Call it at every sample, every tick or only at window ends: a window is judged at the
    /// first call at least `settings.window` after it began. `throttle_active`: a contention
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
                    samples: Vec::new(),
                };
                TunerAction::Wait
            }
            Phase::Throttled { cores, purpose } => {
                let (cores, purpose) = (*cores, *purpose);
                self.phase = Phase::Measuring {
                    cores,
                    purpose,
                    started: now,
                    samples: Vec::new(),
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
                samples: window,
            } => {
                // A clock stepped back restarts the window rather than stretching it.
                if now < *started {
                    *started = now;
                    window.clear();
                }
                window.extend(samples.iter().copied().filter(|s| s.is_finite()));
                if now - *started < self.settings.window {
                    return TunerAction::Wait;
                }
                if window.len() < MIN_WINDOW_SAMPLES {
                    return TunerAction::Hold(HoldReason::TooFewSamples {
                        have: window.len(),
                        need: MIN_WINDOW_SAMPLES,
                    });
                }
                let stats = WindowStats::of(*cores, window);
                let purpose = *purpose;
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
        let partial = WindowStats::of(cores, samples);
        self.history.push(Probe {
            cores,
            mean_util: partial.mean,
            noise: partial.se,
            samples: partial.n,
            decision: Decision::Interrupted,
        });
        self.phase = Phase::Throttled { cores, purpose };
        // A probe below the best count known would leave the job short of cores for as long as
        // the contention lasts: go back to that count until the window can be run again.
        let safe = self.search.hi;
        if self.cores < safe {
            self.cores = safe;
            return TunerAction::Resize(safe);
        }
        held
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
            Purpose::Below { reference } => {
                let r = self.stats_at(reference);
                let threshold = stats.change_threshold(&r);
                if stats.mean < r.mean - threshold {
                    if self.search.lo.is_none() {
                        // Galloping turns round: growth starts with a short step again.
                        self.search.stride = 0;
                    }
                    self.search.lo = Some(c);
                    Decision::Starved {
                        than: reference,
                        threshold,
                    }
                } else {
                    // Flat from `c` up to the reference: by the shape of the curve, `c` is at or
                    // past the knee.
                    self.search.hi = c;
                    self.search.confirmed = true;
                    Decision::Enough {
                        than: reference,
                        threshold,
                    }
                }
            }
            Purpose::Above { from } => {
                let f = self.stats_at(from);
                let threshold = stats.change_threshold(&f);
                if stats.mean > f.mean + threshold {
                    self.search.lo = Some(from);
                    self.search.hi = c;
                    self.search.confirmed = c >= self.settings.max;
                    Decision::Better {
                        than: from,
                        threshold,
                    }
                } else {
                    self.search.hi = from;
                    self.search.confirmed = true;
                    Decision::NoBetter {
                        than: from,
                        threshold,
                    }
                }
            }
        };
        self.history.push(Probe {
            cores: c,
            mean_util: stats.mean,
            noise: stats.se,
            samples: stats.n,
            decision,
        });
        self.measured.retain(|m| m.cores != c);
        self.measured.push(stats);
    }

    fn stats_at(&self, cores: u32) -> WindowStats {
        self.measured
            .iter()
            .find(|m| m.cores == cores)
            .copied()
            .expect("a window is only compared with a count already measured")
    }

    /// The next probe, or the end.
    fn next(&mut self, now: Duration) -> TunerAction {
        let Search {
            lo, hi, confirmed, ..
        } = self.search;
        let floor = self.settings.floor;
        // Below the floor counts as starved: the search never goes there.
        let lower = lo.map_or(i64::from(floor) - 1, i64::from);
        let width = i64::from(hi) - lower;
        let narrow = width <= i64::from(self.settings.tolerance) + 1;
        if narrow && confirmed {
            return self.settle(hi);
        }
        if !narrow && lo.is_none() {
            // §V-B-2: smaller first, and on while utilization does not drop. Each probe is
            // compared with the start, not with the previous probe, so that drops too small to
            // see one at a time cannot add up unseen.
            let start = self.settings.start;
            let below = hi.saturating_sub(self.gallop(start)).max(floor);
            return self.probe(below, Purpose::Below { reference: start }, now);
        }
        if !narrow && confirmed {
            // Step back: bisect between the last count that was enough and the first that
            // was not.
            let below = i64::from(hi) - width / 2;
            let below = u32::try_from(below).unwrap_or(floor).max(floor);
            return self.probe(below, Purpose::Below { reference: hi }, now);
        }
        // §V-B-2: fewer cores starved the job and `hi` is not shown to be enough: try more
        // until utilization stops rising.
        let above = hi.saturating_add(self.gallop(hi)).min(self.settings.max);
        if above <= hi {
            return self.settle(hi);
        }
        self.probe(above, Purpose::Above { from: hi }, now)
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
    fn gallop(&mut self, reference: u32) -> u32 {
        let r = self.stats_at(reference);
        let first = (self.settings.start / 8).max(self.settings.tolerance.saturating_add(1));
        let threshold = r.change_threshold(&r);
        let visible = if r.mean > 0.0 {
            let cores =
                POWER_MARGIN * threshold / (STARVED_ELASTICITY * r.mean) * f64::from(r.cores);
            // Saturating float-to-int conversion; a NaN becomes 0.
            cores.ceil().min(f64::from(u32::MAX)) as u32
        } else {
            // No utilization at all: no step is too large.
            u32::MAX
        };
        let step = first.max(self.search.stride.saturating_mul(2)).max(visible);
        self.search.stride = step;
        step
    }

    fn probe(&mut self, cores: u32, purpose: Purpose, now: Duration) -> TunerAction {
        self.cores = cores;
        self.phase = Phase::Measuring {
            cores,
            purpose,
            started: now,
            samples: Vec::new(),
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

    /// The count the job should have now: the start, a probe, or the settled count.
    pub fn cores(&self) -> u32 {
        self.cores
    }

    /// The best count known so far: the settled count once settled; else the fewest cores
    /// measured that were enough, or, before any was shown to be, the best measured (the start
    /// until a probe has run). This is what an advisory mode reports.
    pub fn recommendation(&self) -> u32 {
        match self.phase {
            Phase::Settled(n) => n,
            _ => self.search.hi,
        }
    }

    /// The settled count, once tuning is over.
    pub fn settled(&self) -> Option<u32> {
        match self.phase {
            Phase::Settled(n) => Some(n),
            _ => None,
        }
    }

    /// Every window judged or interrupted, oldest first.
    pub fn history(&self) -> &[Probe] {
        &self.history
    }

    /// Probes run to the end: windows at counts other than the start (the baseline window is
    /// not a probe; interrupted windows are not counted).
    pub fn probes(&self) -> usize {
        self.history
            .iter()
            .filter(|p| !matches!(p.decision, Decision::Baseline | Decision::Interrupted))
            .count()
    }

    pub fn settings(&self) -> &TunerSettings {
        &self.settings
    }
}

// ---------------------------------------------------------------------------------------------
// Noise.

/// One window's mean and the standard error of that mean.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct WindowStats {
    cores: u32,
    n: usize,
    mean: f64,
    se: f64,
    /// Degrees of freedom of `se`.
    df: f64,
}

impl WindowStats {
    /// With enough samples, `se` comes from the means of [`NOISE_BATCHES`] consecutive batches
    /// (batch means: correlation within a batch does not shrink it); with fewer, from the
    /// samples as if independent.
    fn of(cores: u32, samples: &[f64]) -> Self {
        let n = samples.len();
        let avg = mean(samples);
        let (se, df) = if n >= 2 * NOISE_BATCHES {
            let batches: Vec<f64> = (0..NOISE_BATCHES)
                .map(|i| mean(&samples[i * n / NOISE_BATCHES..(i + 1) * n / NOISE_BATCHES]))
                .collect();
            (
                std_dev(&batches) / (NOISE_BATCHES as f64).sqrt(),
                (NOISE_BATCHES - 1) as f64,
            )
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

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Sample standard deviation.
fn std_dev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// The 97.5% quantile of Student's t with `df` degrees of freedom, interpolated in 1/df between
/// tabulated values (exact at the table's points, within 0.5% between them).
fn t_975(df: f64) -> f64 {
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
