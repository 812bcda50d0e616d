//! config::rightsize: `[rightsize]` (SODA §V-B): whether and how training jobs' core counts
//! are tuned; its mode vocabulary is shared with `[contention]`. Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{in_range, named_enum, one_of, within};
use super::{ConfigError, Cx};

/// `[rightsize]`: SODA §V-B, the core count of training jobs from their GPU utilization.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RightsizeConfig {
    pub mode: RightsizeMode,
    /// Left alone after registration before the first measurement window, in seconds.
    pub warmup_seconds: u64,
    /// One measurement window, in seconds.
    pub window_seconds: u64,
    /// May a job get fewer cores than it asked for (never fewer than one per GPU)?
    pub shrink: bool,
    /// Cores of error accepted: tuning stops once the best count is known within this many.
    pub tolerance_cores: u32,
    /// The smallest difference in GPU utilization (percentage points) that counts as a change,
    /// however clearly the noise allows a smaller one: below it, fewer cores are enough.
    pub min_change_percent: f64,
}

impl Default for RightsizeConfig {
    fn default() -> Self {
        Self {
            mode: RightsizeMode::Enforce,
            warmup_seconds: 180,
            window_seconds: 60,
            shrink: true,
            tolerance_cores: 1,
            min_change_percent: 0.0,
        }
    }
}

named_enum! {
    /// `rightsize.mode`.
    RightsizeMode {
        /// Resize training jobs' cpusets as the tuning decides.
        Enforce => "enforce",
        /// Compute and show the recommendation; change nothing.
        Advise => "advise",
        Off => "off",
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawRightsize {
    mode: Option<Spanned<String>>,
    warmup_seconds: Option<Spanned<i64>>,
    window_seconds: Option<Spanned<i64>>,
    shrink: Option<Spanned<bool>>,
    tolerance_cores: Option<Spanned<i64>>,
    min_change_percent: Option<Spanned<f64>>,
}

impl Cx<'_> {
    pub(super) fn rightsize(
        &mut self,
        raw: Option<RawRightsize>,
    ) -> Result<RightsizeConfig, ConfigError> {
        let d = RightsizeConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(RightsizeConfig {
            mode: self.field("rightsize.mode", raw.mode, d.mode, |s| {
                one_of(&s, RightsizeMode::from_name, RightsizeMode::NAMES)
            })?,
            warmup_seconds: self.field(
                "rightsize.warmup_seconds",
                raw.warmup_seconds,
                d.warmup_seconds,
                |v| in_range(v, &(0..=86_400)),
            )?,
            window_seconds: self.field(
                "rightsize.window_seconds",
                raw.window_seconds,
                d.window_seconds,
                |v| in_range(v, &(1..=3_600)),
            )?,
            shrink: self.field("rightsize.shrink", raw.shrink, d.shrink, Ok)?,
            tolerance_cores: self.field(
                "rightsize.tolerance_cores",
                raw.tolerance_cores,
                d.tolerance_cores,
                |v| in_range(v, &(0..=64)),
            )?,
            min_change_percent: self.field(
                "rightsize.min_change_percent",
                raw.min_change_percent,
                d.min_change_percent,
                |v| within(v, 0.0..=50.0, "percentage points of GPU utilization"),
            )?,
        })
    }
}
