//! config::batch: `[batch]`: the scheduling class of batch jobs' threads. Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{named_enum, one_of};
use super::{ConfigError, Cx};

named_enum! {
    /// `batch.policy`: the scheduling class of batch jobs' threads.
    BatchPolicy {
        /// SCHED_OTHER, as the job ran before (a real-time thread is put back to it).
        Other => "other",
        /// SCHED_BATCH: CFS treats the threads as CPU-bound (no wake-up preemption).
        Batch => "batch",
    }
}

/// `[batch]`: how lodger runs the CPU batch jobs registered with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BatchConfig {
    pub policy: BatchPolicy,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            policy: BatchPolicy::Other,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawBatch {
    policy: Option<Spanned<String>>,
}

impl Cx<'_> {
    pub(super) fn batch(&mut self, raw: Option<RawBatch>) -> Result<BatchConfig, ConfigError> {
        let d = BatchConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(BatchConfig {
            policy: self.field("batch.policy", raw.policy, d.policy, |s| {
                one_of(&s, BatchPolicy::from_name, BatchPolicy::NAMES)
            })?,
        })
    }
}
