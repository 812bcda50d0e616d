//! What a tuner shows without changing: the count now, the best known, the settled one, its
//! history and settings.

use super::{Decision, Phase, Probe, Tuner, TunerSettings};

impl Tuner {
    /// The count the job should have now: the start, a probe, or the settled count.
    pub fn cores(&self) -> u32 {
        self.cores
    }

    /// The best count known so far: the settled count once settled; else the fewest cores
    /// measured that were enough, or, before any was shown to be, the best measured (the start
    /// until a probe has run).
    pub fn recommendation(&self) -> u32 {
        match self.phase {
            Phase::Settled(n) => n,
            _ => self.search.hi,
        }
    }

    /// Times the current window was measured on because it ended too noisy to judge (0 when
    /// none is running), at most [`MAX_EXTENSIONS`](super::MAX_EXTENSIONS).
    pub fn extended(&self) -> u32 {
        match self.phase {
            Phase::Measuring { extended, .. } => extended,
            _ => 0,
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
