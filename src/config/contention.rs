//! config::contention: `[contention]` (SODA §V-E): when CPU jobs that slow training are
//! throttled. Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{in_range, one_of, within};
use super::{ConfigError, Cx, RightsizeMode};

/// `[contention]`: SODA §V-E, throttling CPU jobs that slow training.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContentionSection {
    pub mode: RightsizeMode,
    /// Node memory bandwidth at or above this fraction of the peak is pressure.
    pub membw_threshold: f64,
    /// Consecutive pressured sensing passes before a throttle step.
    pub pressure_ticks: u32,
    /// Consecutive calm sensing passes before a step is given back.
    pub calm_ticks: u32,
    /// A training job stalled on memory (PSI) this percent of a pass is pressure; 0: off.
    pub memory_pressure_percent: f64,
}

impl Eq for ContentionSection {}

impl Default for ContentionSection {
    fn default() -> Self {
        Self {
            mode: RightsizeMode::Enforce,
            membw_threshold: 0.75,
            pressure_ticks: 3,
            calm_ticks: 10,
            memory_pressure_percent: 10.0,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawContention {
    mode: Option<Spanned<String>>,
    membw_threshold: Option<Spanned<f64>>,
    pressure_ticks: Option<Spanned<i64>>,
    calm_ticks: Option<Spanned<i64>>,
    memory_pressure_percent: Option<Spanned<f64>>,
}

impl Cx<'_> {
    pub(super) fn contention(
        &mut self,
        raw: Option<RawContention>,
    ) -> Result<ContentionSection, ConfigError> {
        let d = ContentionSection::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(ContentionSection {
            mode: self.field("contention.mode", raw.mode, d.mode, |s| {
                one_of(&s, RightsizeMode::from_name, RightsizeMode::NAMES)
            })?,
            membw_threshold: self.field(
                "contention.membw_threshold",
                raw.membw_threshold,
                d.membw_threshold,
                |v| {
                    if v.is_finite() && v > 0.0 && v <= 1.0 {
                        Ok(v)
                    } else {
                        Err(format!(
                            "must be a fraction above 0 and at most 1 (got {v})"
                        ))
                    }
                },
            )?,
            pressure_ticks: self.field(
                "contention.pressure_ticks",
                raw.pressure_ticks,
                d.pressure_ticks,
                |v| in_range(v, &(1..=1000)),
            )?,
            calm_ticks: self.field("contention.calm_ticks", raw.calm_ticks, d.calm_ticks, |v| {
                in_range(v, &(1..=10_000))
            })?,
            memory_pressure_percent: self.field(
                "contention.memory_pressure_percent",
                raw.memory_pressure_percent,
                d.memory_pressure_percent,
                |v| within(v, 0.0..=100.0, "a percent (0: off)"),
            )?,
        })
    }
}
