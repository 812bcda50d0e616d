//! config::training: `[training]`: the scheduling policy and SCHED_RR priority of training jobs,
//! the RT-limit guard's headroom, and the real-time budget rules. Touches no file.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{in_range, named_enum, one_of};
use super::{ConfigError, Cx};

/// Valid `training.rt_priority`: the kernel's SCHED_RR range.
pub const RT_PRIORITY_RANGE: RangeInclusive<i64> = 1..=99;

/// The kernel's default `cpu.rt_period_us`; an RT budget must stay below it.
pub const RT_PERIOD_US: u64 = 1_000_000;

/// Valid `training.grant_rt_budget_us`: 0 (never grant) up to just below the period.
pub const RT_BUDGET_US_RANGE: RangeInclusive<i64> = 0..=999_999;

/// Valid `training.rt_headroom_percent`: points of a CPU kept free under the kernel's RT limit.
pub const RT_HEADROOM_RANGE: RangeInclusive<i64> = 0..=50;

/// Valid `training.other_nice`: the nice value of training threads under `policy = "other"`.
pub const OTHER_NICE_RANGE: RangeInclusive<i64> = -20..=0;

named_enum! {
    /// `training.policy`: the scheduling class of training threads.
    TrainingPolicy {
        /// SCHED_RR (Cloud Reamer §III-A), kept under the RT limit by the RT guard; the default.
        Rr => "rr",
        /// SCHED_OTHER at `other_nice`, with offline instances SCHED_IDLE: no RT limit to meet,
        /// but lodgers' CFS share is not zero (SCHED_IDLE weight 3 against 1024 per nice step).
        Other => "other",
    }
}

/// `[training]`: how training jobs are run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrainingConfig {
    pub policy: TrainingPolicy,
    /// SCHED_RR: threads that mostly wait (the dispatch/main thread) one priority above the
    /// busy ones (loader workers).
    pub role_priorities: bool,
    /// Points of a CPU kept free under the RT limit before the job is grown by a core.
    pub rt_headroom_percent: u32,
    /// Nice value of training threads under `policy = "other"`.
    pub other_nice: i32,
    /// Offline inference instances run SCHED_IDLE (always under `policy = "other"`).
    pub lodgers_sched_idle: bool,
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
            policy: TrainingPolicy::Rr,
            role_priorities: true,
            rt_headroom_percent: 5,
            other_nice: -10,
            lodgers_sched_idle: false,
            rt_priority: 10,
            allow_unthrottled_rt: false,
            grant_rt_budget_us: 0,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawTraining {
    policy: Option<Spanned<String>>,
    role_priorities: Option<Spanned<bool>>,
    rt_headroom_percent: Option<Spanned<i64>>,
    other_nice: Option<Spanned<i64>>,
    lodgers_sched_idle: Option<Spanned<bool>>,
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
            policy: self.field("training.policy", raw.policy, d.policy, |s| {
                one_of(&s, TrainingPolicy::from_name, TrainingPolicy::NAMES)
            })?,
            role_priorities: self.field(
                "training.role_priorities",
                raw.role_priorities,
                d.role_priorities,
                Ok,
            )?,
            rt_headroom_percent: self.field(
                "training.rt_headroom_percent",
                raw.rt_headroom_percent,
                d.rt_headroom_percent,
                |v| in_range(v, &RT_HEADROOM_RANGE),
            )?,
            other_nice: self.field("training.other_nice", raw.other_nice, d.other_nice, |v| {
                in_range(v, &OTHER_NICE_RANGE)
            })?,
            lodgers_sched_idle: self.field(
                "training.lodgers_sched_idle",
                raw.lodgers_sched_idle,
                d.lodgers_sched_idle,
                Ok,
            )?,
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
