//! config::inference: `[inference]`: how long a layout probe of an online inference job lasts,
//! how long an instance has to stop, each instance's memory bound, and how long an offline
//! batch on a training core may take. Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::in_range;
use super::{ConfigError, Cx};
use crate::job::memory::MemoryBound;

/// `[inference]`: how lodger runs inference instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InferenceConfig {
    /// How long each layout probe of an online job is measured, in seconds.
    pub probe_seconds: u64,
    /// Between SIGTERM and SIGKILL when an instance is stopped, in seconds.
    pub stop_grace_seconds: u64,
    /// Each instance's memory limit (issue 19), and the most a job may ask for.
    pub memory_max: MemoryBound,
    /// `memory.high` (v2) or the soft limit (v1), in percent of the limit.
    pub memory_high_percent: u8,
    /// The longest an offline instance's batch on a training job's core may take, in ms: the
    /// batch there is cut to fit it (issue 14 item 3). 0: off, the job's batch everywhere.
    pub training_core_batch_ms: u32,
}

/// `inference.training_core_batch_ms`'s default: one SCHED_RR time slice
/// (`sched_rr_timeslice_ms`), what a training thread itself may run uninterrupted.
pub const DEFAULT_TRAINING_CORE_BATCH_MS: u32 = 100;

/// `inference.memory_max`'s default: a tenth of the node's memory per instance.
pub const DEFAULT_INSTANCE_MEMORY_PERCENT: u8 = 10;

impl Default for InferenceConfig {
    fn default() -> Self {
        Self {
            probe_seconds: 10,
            stop_grace_seconds: 10,
            memory_max: MemoryBound::Percent(DEFAULT_INSTANCE_MEMORY_PERCENT),
            memory_high_percent: 90,
            training_core_batch_ms: DEFAULT_TRAINING_CORE_BATCH_MS,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawInference {
    probe_seconds: Option<Spanned<i64>>,
    stop_grace_seconds: Option<Spanned<i64>>,
    memory_max: Option<Spanned<String>>,
    memory_high_percent: Option<Spanned<i64>>,
    training_core_batch_ms: Option<Spanned<i64>>,
}

impl Cx<'_> {
    pub(super) fn inference(
        &mut self,
        raw: Option<RawInference>,
    ) -> Result<InferenceConfig, ConfigError> {
        let d = InferenceConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(InferenceConfig {
            probe_seconds: self.field(
                "inference.probe_seconds",
                raw.probe_seconds,
                d.probe_seconds,
                |v| in_range(v, &(1..=600)),
            )?,
            stop_grace_seconds: self.field(
                "inference.stop_grace_seconds",
                raw.stop_grace_seconds,
                d.stop_grace_seconds,
                |v| in_range(v, &(1..=300)),
            )?,
            memory_max: self.field("inference.memory_max", raw.memory_max, d.memory_max, |v| {
                MemoryBound::parse(&v)
            })?,
            memory_high_percent: self.field(
                "inference.memory_high_percent",
                raw.memory_high_percent,
                d.memory_high_percent,
                |v| in_range(v, &(50..=100)),
            )?,
            training_core_batch_ms: self.field(
                "inference.training_core_batch_ms",
                raw.training_core_batch_ms,
                d.training_core_batch_ms,
                |v| {
                    in_range(v, &(0..=600_000)).map_err(|e| {
                        format!("{e}; milliseconds one offline batch on a training core may take, 0 = off")
                    })
                },
            )?,
        })
    }
}
