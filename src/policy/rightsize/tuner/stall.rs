//! A window whose samples stopped coming (the job's GPU utilization can no longer be
//! attributed, a GPU was lost, the GPU source went stale): the search goes back to the best
//! count known and waits there for samples, instead of holding the job at a probe for good.

use std::time::Duration;

use super::{Phase, Tuner};
use crate::policy::rightsize::types::{HoldReason, TunerAction};

/// A window still short of samples this many window lengths after it began has stalled.
const STALL_WINDOWS: u32 = 2;
/// ... and never sooner than this: a short window (the tests' zero-length ones) is filled by a
/// few sensing passes, and a pass that brings no sample is not yet a stall.
const STALL_MIN: Duration = Duration::from_secs(120);

/// How long a window of `length` may stay short of samples before it has stalled.
pub(super) fn stall_after(length: Duration) -> Duration {
    length.saturating_mul(STALL_WINDOWS).max(STALL_MIN)
}

impl Tuner {
    /// The window has had too few samples for [`stall_after`] its length: its samples are
    /// dropped, the job goes back to the best count known (as under a contention throttle: a
    /// probe below it would leave the job short for as long as the samples stay away), and the
    /// window at the probed count starts again with the next sample.
    pub(super) fn stall(&mut self) -> TunerAction {
        let Phase::Measuring { cores, purpose, .. } = self.phase else {
            return TunerAction::Hold(HoldReason::NoSamples);
        };
        self.phase = Phase::Throttled {
            cores,
            purpose,
            stalled: true,
        };
        let safe = self.search.hi.min(self.settings.max);
        if self.cores != safe {
            self.cores = safe;
            return TunerAction::Resize(safe);
        }
        TunerAction::Hold(HoldReason::NoSamples)
    }

    /// Whether the search waits for samples that stopped coming (see `Tuner::stall`): it
    /// measures nothing until they come back, so it does not own the job's count meanwhile.
    pub fn stalled(&self) -> bool {
        matches!(self.phase, Phase::Throttled { stalled: true, .. })
    }
}
