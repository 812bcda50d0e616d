//! Search outcomes kept per job and free-core count, so a re-plan reuses what was measured.
//! Plain data; touches nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::search::{LayoutSearch, SearchOutcome};

/// Search outcomes of one online job by free-core count (the job's core budget, [`online_budgets`](super::online_budgets)),
/// so that a re-plan after a training or online job arrives or leaves reuses what was measured
/// for that count (issue: "the layout search result
/// for the new core count is reused where it was measured"). Per job: outcomes depend on the
/// model. An outcome is reused only for the same SLO, max batch and max instances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SearchCache {
    by_free_cores: BTreeMap<u32, SearchOutcome>,
}

/// A cached outcome, or a search to run.
#[derive(Debug, Clone)]
pub enum SearchStart {
    Cached(SearchOutcome),
    Search(LayoutSearch),
}

impl SearchCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The outcome measured for these inputs, if any.
    pub fn get(
        &self,
        free_cores: u32,
        slo_ms: f64,
        max_batch: u32,
        max_instances: u32,
    ) -> Option<&SearchOutcome> {
        self.by_free_cores.get(&free_cores).filter(|o| {
            o.slo_ms == slo_ms
                && o.max_batch == max_batch.max(1)
                && o.max_instances == max_instances.max(1)
        })
    }

    /// Remembers an outcome under its free-core count, replacing any older one.
    pub fn insert(&mut self, outcome: SearchOutcome) {
        self.by_free_cores.insert(outcome.free_cores, outcome);
    }

    /// The cached outcome for these inputs, or a new search; a new search starts from the best
    /// layout and trend of an outcome for another core count with the same SLO and max batch
    /// (the nearest core count's).
    pub fn begin(
        &self,
        free_cores: u32,
        slo_ms: f64,
        max_batch: u32,
        max_instances: u32,
    ) -> SearchStart {
        if let Some(hit) = self.get(free_cores, slo_ms, max_batch, max_instances) {
            return SearchStart::Cached(hit.clone());
        }
        let search = LayoutSearch::new(free_cores, slo_ms, max_batch, max_instances);
        let traits = self
            .by_free_cores
            .values()
            .filter(|o| o.slo_ms == slo_ms && o.max_batch == max_batch.max(1))
            .filter_map(|o| o.traits.map(|t| (o.free_cores.abs_diff(free_cores), t)))
            .filter(|(_, t)| t.min_cores_per_instance <= free_cores)
            .min_by_key(|(d, _)| *d)
            .map(|(_, t)| t);
        SearchStart::Search(match traits {
            Some(t) => search.with_traits(t),
            None => search,
        })
    }

    pub fn len(&self) -> usize {
        self.by_free_cores.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_free_cores.is_empty()
    }

    /// Forgets everything (the job's SLO or model changed).
    pub fn clear(&mut self) {
        self.by_free_cores.clear();
    }
}
