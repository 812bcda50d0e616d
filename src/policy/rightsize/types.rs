//! What the tuner is asked and answers (SODA §V-B-2): its settings, the action after each step,
//! why it holds, and each window's decision as `lodgerctl show` prints it. Plain data.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::start::CoreLimits;

/// Time a job is left alone after it starts before the first window: SODA §VI-H notes that a
/// training job's launch and context preparation "may take more than 3 minutes".
pub const DEFAULT_WARMUP: Duration = Duration::from_secs(180);
/// One measurement window: SODA §VI-H profiles each core count for 60 s (20 to 170 training
/// iterations of the Table I models).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);
/// Cores of error accepted around the best-fit count: the search stops once it has narrowed the
/// count down to `tolerance + 1` candidates and keeps the largest (the one known to be enough).
pub const DEFAULT_TOLERANCE: u32 = 1;

/// How a [`Tuner`](super::Tuner) searches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TunerSettings {
    /// The count the job runs at from the start ([`start_cores`](super::start_cores)).
    pub start: u32,
    /// Never fewer ([`default_floor`](super::default_floor)).
    pub floor: u32,
    /// Never more: the CPUs the job could get.
    pub max: u32,
    /// Left alone after the start before the first window ([`DEFAULT_WARMUP`]).
    pub warmup: Duration,
    /// Length of each measurement window ([`DEFAULT_WINDOW`]).
    pub window: Duration,
    /// Cores of error accepted ([`DEFAULT_TOLERANCE`]).
    pub tolerance: u32,
    /// The smallest difference in utilization (percentage points) that counts as a change,
    /// however small the noise: a floor under every noise threshold and under the fit's band
    /// of the plateau. 0 (the default): any difference the noise shows counts, SODA §V-B's
    /// "the fewest cores at the maximum". Absent from older state files: 0.
    #[serde(default)]
    pub min_change: f64,
    /// `start` is the owner's history (SODA §V-B-1: the largest count the owner's earlier jobs
    /// of the category settled on), not a category default or the requested count: the search
    /// then tries fewer cores first, else more (see [`Tuner`](super::Tuner)). Absent from older state files:
    /// false.
    #[serde(default)]
    pub from_history: bool,
    /// The job's GPUs (0: not known). A start from the owner's history is first stepped from
    /// by 2 cores per GPU (see `Tuner::gallop`). Absent from older state files: 0.
    #[serde(default)]
    pub gpus: u32,
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
            min_change: 0.0,
            from_history: false,
            gpus: 0,
        }
    }

    pub(super) fn limits(&self) -> CoreLimits {
        CoreLimits {
            floor: self.floor,
            max: self.max,
        }
    }
}

/// What the caller should do after a [`Tuner::step`](super::Tuner::step). In every case the job's count should be
/// [`Tuner::cores`](super::Tuner::cores) afterwards; the action says why.
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

/// Why a [`Tuner`](super::Tuner) is not measuring.
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
    /// The window stayed short of samples for two window lengths (at least two minutes): the
    /// job is back at the best count known, and the window starts again with the next sample.
    NoSamples,
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
            HoldReason::NoSamples => f.write_str(
                "no GPU utilization samples for two windows: back at the best count known until \
                 they come",
            ),
        }
    }
}

/// One measurement window, for `lodgerctl show`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    pub cores: u32,
    /// Mean GPU utilization over the window, in the samples' unit.
    pub mean_util: f64,
    /// Standard error of `mean_util`, estimated from the window's samples (batch means, and
    /// at least the estimate for independent samples).
    pub noise: f64,
    pub samples: usize,
    pub decision: Decision,
}

/// What a window showed. `threshold` is the smallest difference that counts as a change: the
/// two windows' standard errors combined (Welch), each at least what all the job's windows so
/// far say it is for its number of samples, times the two-sided 95% Student t quantile for
/// their degrees of freedom. It comes from the measured noise alone: no fixed percentage.
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
