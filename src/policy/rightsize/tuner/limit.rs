//! The most cores a job can have now, handed to its tuner as other jobs come and go: the
//! search never asks for more, and a probe beyond it is cut to it.

use std::time::Duration;

use super::{Phase, Purpose, Search, Tuner};

impl Tuner {
    /// Sets the most cores the job can have now (`n`: its own CPUs and the free ones, which
    /// change as other jobs come, go and resize; never below the floor). Settings' `max` was the
    /// node's free CPUs when the job registered; a probe sized against that once placed the job
    /// nowhere (review finding 1). A probe above `n` not yet measured there is cut to it: a
    /// step up cut short is no longer conclusive unless still long enough for a starved job's
    /// change to show (see `Tuner::gallop`), and its window starts again at `now`; a step up
    /// that no longer leaves where it started, or any other count above `n`, starts the search
    /// over at `n` (the counts known too few are kept). A settled tuner is left as it is.
    /// Returns whether the tuner changed.
    pub fn limit_max(&mut self, n: u32, now: Duration) -> bool {
        if self.settled().is_some() {
            return false;
        }
        let max = n.max(self.settings.floor).max(1);
        let mut changed = self.settings.max != max;
        self.settings.max = max;
        if self.cores <= max {
            return changed;
        }
        changed = true;
        let purpose = match self.phase {
            Phase::Measuring { purpose, .. } | Phase::Throttled { purpose, .. } => Some(purpose),
            Phase::WarmUp { .. } | Phase::Settled(_) => None,
        };
        let purpose = match purpose {
            Some(Purpose::Above { from, conclusive }) if from < max => Purpose::Above {
                from,
                conclusive: conclusive && max - from >= self.visible(from),
            },
            _ => {
                // Measured again at the ceiling, as a baseline: the counts known too few stay.
                self.search = Search {
                    lo: self.search.lo.filter(|&lo| lo < max),
                    hi: max,
                    confirmed: false,
                    stride: 0,
                    origin: Some(max),
                };
                Purpose::Baseline
            }
        };
        self.cores = max;
        self.phase = match self.phase {
            Phase::WarmUp { until } => Phase::WarmUp { until },
            Phase::Throttled { stalled, .. } => Phase::Throttled {
                cores: max,
                purpose,
                stalled,
            },
            _ => Phase::Measuring {
                cores: max,
                purpose,
                started: now,
                samples: Some(Vec::new()),
                last_sample: None,
                extended: 0,
            },
        };
        changed
    }
}
