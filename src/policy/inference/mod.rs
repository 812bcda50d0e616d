//! Inference lodgers (Cloud Reamer §III-A, §III-B, §III-C): which CPUs each online and offline
//! inference instance gets, how an online job's layout (instances × cores per instance × batch)
//! is found from measured probes, and whether that layout serves the job's rate. Pure: touches
//! nothing; measurements are arguments, the caller runs the probes.
//!
//! - [`place`]: per-instance cpusets, placed again from the previous plan whenever training,
//!   the reserved CPUs or the jobs change. Online instances get exclusive leftover cores;
//!   offline instances are single-thread and fill every other non-reserved CPU, the training
//!   jobs' included; on a training job's CPUs with a smaller batch when the job's batches take
//!   long ([`batch_within`]).
//! - [`LayoutSearch`]: the §III-B search as a state machine driven by measurements, guided by a
//!   surrogate latency model fitted to the probes, with a [`SearchCache`] per job so a re-plan
//!   reuses what was measured for the same core count.
//! - [`online_budgets`]: how many CPUs each online job's search may use: the CPUs left for
//!   online inference split equally between the online jobs, whatever the others' layouts.
//! - [`sim`]: a family of synthetic performance models with noisy probes, to measure the search
//!   against (benchmark and tests), kept apart from it.
//! - [`check_capacity`]: the CR-Agent's rate check (§III-C), behind the `CapacityExceeded` signal.

mod budget;
mod cache;
mod capacity;
mod curvature;
mod edge;
mod guide;
mod place;
#[cfg(test)]
mod place_properties;
mod search;
#[cfg(test)]
mod search_tests;
mod shared_batch;
pub mod sim;
mod surrogate;
#[cfg(test)]
mod tests;
mod types;

pub use budget::online_budgets;
pub use cache::{SearchCache, SearchStart};
pub use capacity::{check_capacity, CapacityCheck};
pub use place::place;
pub use search::{
    BatchTrend, LayoutSearch, ModelTraits, ProbeResult, SearchOptions, SearchOutcome, SearchStep,
    DEFAULT_CONFIDENCE_Z, DEFAULT_MARGIN, DEFAULT_PROBE_BUDGET,
};
pub use shared_batch::batch_within;
pub use types::{
    training_cpus, InferencePlan, Instance, JobInstances, LayoutConfig, OfflineJobView,
    OnlineJobView, Shortfall,
};
