//! The inference vocabulary (Cloud Reamer §III-A, §III-B): layouts, the jobs as placement sees
//! them, instances and the plan of where every instance runs. Plain data; touches nothing.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::policy::Plan;
use crate::topology::Topology;

// ---------------------------------------------------------------------------------------------
// Layouts and placement

/// An online job's layout (Cloud Reamer §III-B): `instances` instances of `cores_per_instance`
/// logical CPUs each, each serving batches of up to `batch` requests. An instance runs one
/// thread per CPU (§III-A: "the number of threads is same as the number of CPU cores").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayoutConfig {
    /// Logical CPUs per instance (SMT siblings count separately, as for training jobs).
    pub cores_per_instance: u32,
    pub instances: u32,
    pub batch: u32,
}

impl LayoutConfig {
    /// Logical CPUs the whole layout occupies.
    pub fn cpus(&self) -> u32 {
        self.cores_per_instance.saturating_mul(self.instances)
    }
}

impl fmt::Display for LayoutConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} × {} CPU{}, batch {}",
            self.instances,
            self.cores_per_instance,
            if self.cores_per_instance == 1 {
                ""
            } else {
                "s"
            },
            self.batch
        )
    }
}

/// What placement needs to know about a registered online inference job.
#[derive(Debug, Clone)]
pub struct OnlineJobView {
    pub id: JobId,
    /// The layout chosen for it (by [`LayoutSearch`](super::LayoutSearch), a cached outcome, or the job's spec).
    pub layout: LayoutConfig,
}

/// What placement needs to know about a registered offline inference job.
#[derive(Debug, Clone)]
pub struct OfflineJobView {
    pub id: JobId,
    /// Batch size each instance is started with.
    pub batch: u32,
    /// Batch size of its instances on training CPUs, when smaller than `batch` (issue 14 item
    /// 3: [`batch_within`](super::batch_within)); None, 0 or more than `batch`: `batch`.
    pub training_batch: Option<u32>,
    /// At most this many instances (one per CPU); None: as many as there are CPUs.
    pub max_instances: Option<u32>,
}

/// One instance: a child process in its own cgroup on `cpus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub cpus: CpuSet,
    /// The NUMA nodes of `cpus` (its `cpuset.mems`).
    pub mems: CpuSet,
    /// Threads to start it with (`OMP_NUM_THREADS`, `{threads}`): its CPU count online, 1 offline.
    pub threads: u32,
    pub batch: u32,
}

/// Instances of one job by instance number. Numbers are stable identities (the `{instance}`
/// placeholder), not positions: an instance keeps its number while it lives, so the numbers of a
/// job may have gaps after a re-plan; a new instance takes the lowest free number.
pub type JobInstances = BTreeMap<u32, Instance>;

/// Why an online job runs fewer instances than its layout asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shortfall {
    /// Instances in the layout.
    pub wanted: u32,
    /// Instances placed.
    pub placed: u32,
    pub cores_per_instance: u32,
    /// Free CPUs (not reserved, not training, not another online instance's) left after placement.
    pub free: u32,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} instances placed: each needs {} CPU{} and {} {} free",
            self.placed,
            self.wanted,
            self.cores_per_instance,
            if self.cores_per_instance == 1 {
                ""
            } else {
                "s"
            },
            self.free,
            if self.free == 1 { "is" } else { "are" }
        )
    }
}

/// Where every inference instance runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferencePlan {
    pub online: BTreeMap<JobId, JobInstances>,
    pub offline: BTreeMap<JobId, JobInstances>,
    /// Online jobs placed with fewer instances than their layout (absent when all fit).
    pub shortfall: BTreeMap<JobId, Shortfall>,
}

impl InferencePlan {
    /// CPUs held by online instances.
    pub fn online_cpus(&self) -> CpuSet {
        union_of(self.online.values().flat_map(|j| j.values()))
    }

    /// The cores online instances hold: their CPUs and those CPUs' SMT siblings. An online
    /// instance's cores are its own (Cloud Reamer §III-A: predictable latency), so no other
    /// lodger, offline instance or batch job, runs on a sibling beside it.
    pub fn online_cores(&self, topo: &Topology) -> CpuSet {
        let cpus = self.online_cpus();
        let mut cores = cpus.clone();
        for cpu in &cpus {
            if let Some(siblings) = topo.siblings(cpu) {
                cores.extend(siblings.iter());
            }
        }
        cores
    }

    /// CPUs used by offline instances.
    pub fn offline_cpus(&self) -> CpuSet {
        union_of(self.offline.values().flat_map(|j| j.values()))
    }
}

pub(super) fn union_of<'a>(instances: impl Iterator<Item = &'a Instance>) -> CpuSet {
    let mut all = CpuSet::new();
    for inst in instances {
        all.extend(inst.cpus.iter());
    }
    all
}

/// The CPUs of every placed training job in `plan`.
pub fn training_cpus(plan: &Plan) -> CpuSet {
    let mut all = CpuSet::new();
    for p in plan.training.values() {
        all.extend(p.cpus.iter());
    }
    all
}
