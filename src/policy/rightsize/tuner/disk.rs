//! What of a tuner the state file keeps: whether a step may change it, and comparing two tuners
//! as they would be written, to persist one only when that changes.

use std::time::Duration;

use super::{Phase, Tuner};

impl Tuner {
    /// Whether [`Tuner::step`] at `now` leaves all that the state file holds as it is (it may
    /// add samples to the window, which are not written): settled; warming up before the end;
    /// measuring inside the window, unthrottled. A caller that persists a tuner when it changes
    /// need not keep a copy to compare with then (issue 21: a clone of every training job's
    /// tuner each tick was a tenth of an idle agent's tick). Conservative: false wherever `step`
    /// might change it.
    pub fn step_keeps_disk(&self, now: Duration, throttle_active: bool) -> bool {
        match &self.phase {
            Phase::Settled(_) => true,
            _ if throttle_active => false,
            Phase::WarmUp { until } => now < *until,
            Phase::Measuring {
                started,
                samples: Some(_),
                extended,
                ..
            } => {
                now >= *started
                    && now - *started < self.settings.window.saturating_mul(1 + *extended)
            }
            _ => false,
        }
    }

    /// Whether the two tuners would be written the same to the state file: everything but the
    /// current window's samples, which are kept in memory only. The caller persists a tuner
    /// when this turns false (a window began or was judged, a probe, a throttle, settling),
    /// not at every sample.
    pub fn same_on_disk(&self, other: &Tuner) -> bool {
        // Destructured in full, so a field added later must be decided on here.
        let Tuner {
            settings,
            cores,
            phase,
            search,
            measured,
            history,
        } = self;
        *settings == other.settings
            && *cores == other.cores
            && phase.same_on_disk(&other.phase)
            && *search == other.search
            && *measured == other.measured
            && *history == other.history
    }
}

impl Phase {
    /// Equal but for a window's samples (see [`Tuner::same_on_disk`]).
    fn same_on_disk(&self, other: &Phase) -> bool {
        match (self, other) {
            (
                Phase::Measuring {
                    cores,
                    purpose,
                    started,
                    samples: _,
                    last_sample: _,
                    extended,
                },
                Phase::Measuring {
                    cores: other_cores,
                    purpose: other_purpose,
                    started: other_started,
                    samples: _,
                    last_sample: _,
                    extended: other_extended,
                },
            ) => {
                cores == other_cores
                    && purpose == other_purpose
                    && started == other_started
                    && extended == other_extended
            }
            _ => self == other,
        }
    }
}
