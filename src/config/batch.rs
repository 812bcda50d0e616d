//! config::batch: `[batch]`: the scheduling class of batch jobs' threads and the memory limit
//! of the job cgroups lodger creates for them. Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{named_enum, one_of};
use super::{ConfigError, Cx};
use crate::job::memory::MemoryBound;

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
    /// `memory.max` of the cgroup lodger creates for a batch job (docs/memory.md: only pid jobs
    /// pinned by cgroup on cgroup v2 have one).
    pub memory_max: MemoryBound,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            policy: BatchPolicy::Other,
            memory_max: MemoryBound::Percent(25),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawBatch {
    policy: Option<Spanned<String>>,
    memory_max: Option<Spanned<String>>,
}

impl Cx<'_> {
    pub(super) fn batch(&mut self, raw: Option<RawBatch>) -> Result<BatchConfig, ConfigError> {
        let d = BatchConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(BatchConfig {
            policy: self.field("batch.policy", raw.policy, d.policy, |s| {
                one_of(&s, BatchPolicy::from_name, BatchPolicy::NAMES)
            })?,
            memory_max: self.field("batch.memory_max", raw.memory_max, d.memory_max, |v| {
                MemoryBound::parse(&v)
            })?,
        })
    }
}
