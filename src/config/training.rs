//! config::training: `[training]`: the SCHED_RR priority of training jobs and the real-time
//! budget rules. Touches no file.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::in_range;
use super::{ConfigError, Cx};

/// Valid `training.rt_priority`: the kernel's SCHED_RR range.
pub const RT_PRIORITY_RANGE: RangeInclusive<i64> = 1..=99;

/// The kernel's default `cpu.rt_period_us`; an RT budget must stay below it.
pub const RT_PERIOD_US: u64 = 1_000_000;

/// Valid `training.grant_rt_budget_us`: 0 (never grant) up to just below the period.
pub const RT_BUDGET_US_RANGE: RangeInclusive<i64> = 0..=999_999;

/// `[training]`: how training jobs are run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrainingConfig {
    /// SCHED_RR priority, 1..=99 (an `i32` because that is what `sched_param` takes).
    pub rt_priority: i32,
    /// Use SCHED_RR even when `kernel.sched_rt_runtime_us` is -1.
    pub allow_unthrottled_rt: bool,
    /// As written in the file: 0 means never; see [`TrainingConfig::grant_rt_budget_us`].
    pub grant_rt_budget_us: u64,
}

impl TrainingConfig {
    /// The `cpu.rt_runtime_us` to grant a v1 cpu cgroup whose budget is 0, or `None` if lodger
    /// must never grant one.
    pub fn grant_rt_budget_us(&self) -> Option<u64> {
        (self.grant_rt_budget_us != 0).then_some(self.grant_rt_budget_us)
    }
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            rt_priority: 10,
            allow_unthrottled_rt: false,
            grant_rt_budget_us: 0,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawTraining {
    rt_priority: Option<Spanned<i64>>,
    allow_unthrottled_rt: Option<Spanned<bool>>,
    grant_rt_budget_us: Option<Spanned<i64>>,
}

impl Cx<'_> {
    pub(super) fn training(
        &mut self,
        raw: Option<RawTraining>,
    ) -> Result<TrainingConfig, ConfigError> {
        let d = TrainingConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(TrainingConfig {
            rt_priority: self.field(
                "training.rt_priority",
                raw.rt_priority,
                d.rt_priority,
                |v| in_range(v, &RT_PRIORITY_RANGE),
            )?,
            allow_unthrottled_rt: self.field(
                "training.allow_unthrottled_rt",
                raw.allow_unthrottled_rt,
                d.allow_unthrottled_rt,
                Ok,
            )?,
            grant_rt_budget_us: self.field(
                "training.grant_rt_budget_us",
                raw.grant_rt_budget_us,
                d.grant_rt_budget_us,
                |v| {
                    in_range(v, &RT_BUDGET_US_RANGE).map_err(|e| {
                        format!(
                            "{e}; 0 = never grant, otherwise below the {RT_PERIOD_US} us period"
                        )
                    })
                },
            )?,
        })
    }
}
