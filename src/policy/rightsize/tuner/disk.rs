//! What of a tuner the state file keeps: comparing two tuners as they would be written, to
//! persist one only when that changes.

use super::{Phase, Tuner};

impl Tuner {
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
                    extended,
                },
                Phase::Measuring {
                    cores: other_cores,
                    purpose: other_purpose,
                    started: other_started,
                    samples: _,
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
