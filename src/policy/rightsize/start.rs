//! Where a training job's core count starts (SODA §V-B-1): the floor and limits, the category
//! defaults, and each owner's history of settled counts. Pure: touches nothing.

use serde::{Deserialize, Serialize};

use crate::job::Category;

/// Settled counts remembered per (owner, category): the start is the largest of the recent ones,
/// so one odd job does not raise every later start for ever.
pub(super) const HISTORY_PER_KEY: usize = 8;
/// (owner, category) pairs remembered; the least recently recorded is forgotten first.
pub(super) const HISTORY_MAX_KEYS: usize = 4096;

// ---------------------------------------------------------------------------------------------
// Start point (§V-B-1).

/// What the job's owner says about it, beyond its category (SODA §V-B-1, from the factors of
/// §IV-B-2). Each moves the start by one core per GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartHints {
    /// Input loading is pipelined with GPU compute: one core fewer per GPU.
    pub pipelined_loader: bool,
    /// The model has a large number of weights: one core fewer per GPU.
    pub large_model: bool,
    /// Preprocessing between iterations is heavy: one core more per GPU.
    pub heavy_preprocessing: bool,
}

/// The counts a job may be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoreLimits {
    /// Never fewer (see [`default_floor`]).
    pub floor: u32,
    /// Never more: the CPUs the job could get (its own plus the free ones and those lent to
    /// lodgers, which give them back).
    pub max: u32,
}

impl CoreLimits {
    /// `n` within the limits. When `floor > max` (the node cannot give the floor), `max` wins.
    pub fn clamp(self, n: u32) -> u32 {
        let max = self.max.max(1);
        n.clamp(self.floor.clamp(1, max), max)
    }
}

/// The floor a job is never shrunk below: one core per GPU when shrinking is allowed (the
/// default), else the count it asked for.
pub fn default_floor(gpus: u32, requested: u32, shrink_allowed: bool) -> u32 {
    if shrink_allowed {
        gpus.max(1)
    } else {
        requested.max(1)
    }
}

/// SODA §V-B-1: the start for a tenant's first job of a category, per GPU ("3 for CV models, 5
/// for NLP models, and 5 for SPEECH models", from §IV-B). `None` for `Other`, which starts at
/// the requested count.
pub fn category_default_per_gpu(category: Category) -> Option<u32> {
    match category {
        Category::Cv => Some(3),
        Category::Nlp | Category::Speech => Some(5),
        Category::Other => None,
    }
}

/// SODA §V-B-1, N_start: the largest count the owner's earlier jobs of the same category settled
/// on (per GPU, times this job's GPUs), else the category default (per GPU), else (`Other`) the
/// requested count; then one core per GPU fewer for a pipelined loader, one fewer for a large
/// model and one more for heavy preprocessing; clamped to `limits`.
///
/// A job with no GPU listed counts as one GPU.
pub fn start_cores(
    history: &OwnerHistory,
    owner: u32,
    category: Category,
    requested: u32,
    gpus: u32,
    hints: StartHints,
    limits: CoreLimits,
) -> u32 {
    let gpus = i64::from(gpus.max(1));
    let base = match history.largest_per_gpu(owner, category) {
        Some(per_gpu) => i64::from(per_gpu) * gpus,
        None => match category_default_per_gpu(category) {
            Some(per_gpu) => i64::from(per_gpu) * gpus,
            None => i64::from(requested),
        },
    };
    let per_gpu_adjust = i64::from(hints.heavy_preprocessing)
        - i64::from(hints.pipelined_loader)
        - i64::from(hints.large_model);
    let total = (base + per_gpu_adjust * gpus).max(0);
    limits.clamp(u32::try_from(total).unwrap_or(u32::MAX))
}

/// The counts owners' jobs settled on, by category: SODA §V-B-1 assumes "a user tends to submit
/// similar training jobs". The agent keeps it in the state directory across restarts.
///
/// Counts are kept per GPU, so a 4-GPU job's history gives a 1-GPU job of the same owner a
/// quarter of its count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerHistory {
    /// Least recently recorded first.
    records: Vec<OwnerRecord>,
}

/// One owner's settled counts for one category.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    pub owner: u32,
    pub category: Category,
    /// Settled cores per GPU (rounded up) of the owner's most recent jobs, oldest first.
    pub settled_per_gpu: Vec<u32>,
}

impl OwnerHistory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Remembers that a job of `owner` in `category` with `gpus` GPUs (0 counts as 1) settled
    /// on `settled_cores`.
    pub fn record(&mut self, owner: u32, category: Category, settled_cores: u32, gpus: u32) {
        let per_gpu = settled_cores.div_ceil(gpus.max(1));
        let mut record = match self
            .records
            .iter()
            .position(|r| r.owner == owner && r.category == category)
        {
            Some(i) => self.records.remove(i),
            None => OwnerRecord {
                owner,
                category,
                settled_per_gpu: Vec::new(),
            },
        };
        record.settled_per_gpu.push(per_gpu);
        if record.settled_per_gpu.len() > HISTORY_PER_KEY {
            record.settled_per_gpu.remove(0);
        }
        self.records.push(record);
        if self.records.len() > HISTORY_MAX_KEYS {
            self.records.remove(0);
        }
    }

    /// The largest settled count per GPU remembered for `owner`'s jobs of `category`.
    pub fn largest_per_gpu(&self, owner: u32, category: Category) -> Option<u32> {
        self.records
            .iter()
            .find(|r| r.owner == owner && r.category == category)
            .and_then(|r| r.settled_per_gpu.iter().copied().max())
    }

    pub fn records(&self) -> &[OwnerRecord] {
        &self.records
    }
}
