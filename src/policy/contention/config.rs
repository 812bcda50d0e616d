//! Contention elimination's settings (SODA §V-E): mode, thresholds, tick counts and floors,
//! and their validation. Plain data; touches nothing.

use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// Configuration.

/// Whether throttles are enforced or only reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Decide and have the enforcer apply.
    #[default]
    Enforce,
    /// Decide and report what would be done ([`ThrottleAction::advisory`](super::ThrottleAction::advisory)), apply nothing:
    /// [`ContentionEliminator::throttles`](super::ContentionEliminator::throttles) stays empty.
    Advise,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Advise => "advise",
        }
    }
}

/// `[contention]` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContentionConfig {
    pub mode: Mode,
    /// Node memory bandwidth at or above this fraction of the peak is pressure (SODA §V-E: 0.75).
    pub membw_threshold: f64,
    /// Node memory bandwidth below this fraction of the peak is calm. Between the two, neither:
    /// the hysteresis band.
    pub membw_calm: f64,
    /// Consecutive pressured ticks before a throttle step (and between steps).
    pub pressure_ticks: u32,
    /// Consecutive calm ticks before one step is given back.
    pub calm_ticks: u32,
    /// Ceiling of the calm needed once relapses have doubled it.
    pub max_calm_ticks: u32,
    /// One MBA step, in percent of the unthrottled value (rounded up to `bandwidth_gran` on
    /// Intel).
    pub mba_step_percent: u32,
    /// MBA never goes below this percent of the unthrottled value (nor below `min_bandwidth`).
    pub mba_floor_percent: u32,
    /// Core halving never leaves a job fewer cores than this.
    pub min_cores: u32,
    /// The last this many ticks of a training job's progress while no lodger runs make its
    /// stable level (a sliding window, so a start-up transient ages out while the job is alone).
    pub baseline_ticks: u32,
    /// A learnt level's noise: this many standard deviations of the recorded samples ...
    pub noise_sigmas: f64,
    /// ... and at least this fraction of the level.
    pub min_noise_fraction: f64,
    /// A training job stalled on memory (PSI `some`) for at least this percent of a pass, while
    /// lodgers run, is pressure (issue 19); 0 switches the signal off.
    #[serde(default = "default_memory_pressure")]
    pub memory_pressure_percent: f64,
    /// ... and below this percent (every training job) is calm.
    #[serde(default = "default_memory_calm")]
    pub memory_pressure_calm_percent: f64,
}

fn default_memory_pressure() -> f64 {
    10.0
}

fn default_memory_calm() -> f64 {
    default_memory_pressure() / 2.0
}

impl Default for ContentionConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Enforce,
            membw_threshold: 0.75,
            membw_calm: 0.60,
            pressure_ticks: 3,
            calm_ticks: 10,
            max_calm_ticks: 160,
            mba_step_percent: 10,
            mba_floor_percent: 10,
            min_cores: 1,
            baseline_ticks: 10,
            noise_sigmas: 3.0,
            min_noise_fraction: 0.05,
            memory_pressure_percent: default_memory_pressure(),
            memory_pressure_calm_percent: default_memory_calm(),
        }
    }
}

/// A `[contention]` value that cannot work, by field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("contention.{field}: {reason}")]
pub struct ContentionConfigError {
    pub field: &'static str,
    pub reason: String,
}

impl ContentionConfig {
    /// Checks the values; returns the first that is wrong.
    pub fn validate(&self) -> Result<(), ContentionConfigError> {
        let bad = |field, reason: String| Err(ContentionConfigError { field, reason });
        let fraction = |v: f64| v.is_finite() && v > 0.0 && v <= 1.0;
        if !fraction(self.membw_threshold) {
            return bad(
                "membw_threshold",
                format!("{} is not a fraction in (0, 1]", self.membw_threshold),
            );
        }
        if !fraction(self.membw_calm) || self.membw_calm >= self.membw_threshold {
            return bad(
                "membw_calm",
                format!(
                    "{} must be a fraction below membw_threshold ({})",
                    self.membw_calm, self.membw_threshold
                ),
            );
        }
        for (field, v) in [
            ("pressure_ticks", self.pressure_ticks),
            ("calm_ticks", self.calm_ticks),
            ("baseline_ticks", self.baseline_ticks),
            ("min_cores", self.min_cores),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".to_string());
            }
        }
        if self.max_calm_ticks < self.calm_ticks {
            return bad(
                "max_calm_ticks",
                format!(
                    "{} is below calm_ticks ({})",
                    self.max_calm_ticks, self.calm_ticks
                ),
            );
        }
        if self.mba_step_percent == 0 || self.mba_step_percent > 100 {
            return bad(
                "mba_step_percent",
                format!("{} is not in 1..=100", self.mba_step_percent),
            );
        }
        if self.mba_floor_percent == 0 || self.mba_floor_percent > 100 {
            return bad(
                "mba_floor_percent",
                format!("{} is not in 1..=100", self.mba_floor_percent),
            );
        }
        let percent = |v: f64| v.is_finite() && (0.0..=100.0).contains(&v);
        if !percent(self.memory_pressure_percent) {
            return bad(
                "memory_pressure_percent",
                format!(
                    "{} is not a percent in [0, 100]",
                    self.memory_pressure_percent
                ),
            );
        }
        if self.memory_pressure_percent > 0.0
            && !(percent(self.memory_pressure_calm_percent)
                && self.memory_pressure_calm_percent < self.memory_pressure_percent)
        {
            return bad(
                "memory_pressure_calm_percent",
                format!(
                    "{} must be a percent below memory_pressure_percent ({})",
                    self.memory_pressure_calm_percent, self.memory_pressure_percent
                ),
            );
        }
        if !(self.noise_sigmas.is_finite() && self.noise_sigmas >= 0.0) {
            return bad(
                "noise_sigmas",
                format!("{} is not a non-negative number", self.noise_sigmas),
            );
        }
        if !(self.min_noise_fraction.is_finite() && (0.0..1.0).contains(&self.min_noise_fraction)) {
            return bad(
                "min_noise_fraction",
                format!("{} is not a fraction in [0, 1)", self.min_noise_fraction),
            );
        }
        Ok(())
    }
}
