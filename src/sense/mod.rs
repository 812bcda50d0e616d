//! Sensing: one module per signal, each a small trait with a real implementation that takes its
//! root (`/proc`, `/sys`, `/sys/fs/resctrl`) as an argument. Readers return raw samples
//! (monotonic counters with their timestamps); rates are derived purely from two samples.
//! May touch /proc, /sys, perf_event_open and libnvidia-ml, read-only; and resctrl monitoring
//! groups named `lodger-<job>`, which measuring a job's memory bandwidth needs (`membw`).

pub mod cpu;
pub mod gpu;
pub mod link;
pub mod membw;
pub mod net;
pub mod perf;
pub mod rtlimit;
pub mod sampler;
pub mod sources;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::job::JobId;

/// One job's derived signals over the last sensing window. `None`: not measured (source absent,
/// metric unsupported by the PMU, no sample yet).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobMetrics {
    /// CPU time used, in percent of one CPU (200 = two CPUs busy).
    pub cpu_percent: Option<f64>,
    /// Instructions per cycle.
    pub ipc: Option<f64>,
    /// Cache misses per cache reference, in percent.
    pub cache_miss_percent: Option<f64>,
    /// The job's GPU utilization, in percent (NVML per-process SM utilization, or the emulator's
    /// busy fraction when `gpu_source` is `emulated`).
    pub gpu_percent: Option<f64>,
    /// Where `gpu_percent` came from: `nvml` or `emulated`.
    pub gpu_source: Option<String>,
    /// Memory bandwidth, bytes/s (resctrl MBM, the job's monitoring groups): a lower bound when
    /// some of its counters read `Unavailable` or `Error`.
    pub membw_bytes_per_s: Option<f64>,
    /// The same per L3 domain (the `XX` of `mon_L3_XX`), for the domains with a rate.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub membw_domains: BTreeMap<u32, f64>,
    /// Why the job's memory bandwidth is not measured while the node's is (the kernel refused
    /// its monitoring group: no free RMID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membw_unavailable: Option<String>,
    /// Network traffic of the job's own network namespace (a container or pod), bytes/s,
    /// summed over its interfaces but `lo`.
    pub net_rx_bytes_per_s: Option<f64>,
    pub net_tx_bytes_per_s: Option<f64>,
    /// Why the job's traffic is not attributed (it shares the host's network namespace).
    /// Shared: the same words for every such job, every pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_unavailable: Option<std::sync::Arc<str>>,
    /// PSI `some` of the job's own cgroup's `memory.pressure` over the last pass (cgroup v2,
    /// jobs with a cgroup): percent of time some of its tasks were stalled on memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_pressure_percent: Option<f64>,
}

/// One GPU's signals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuMetrics {
    pub index: u32,
    /// `nvml` or `emulated`.
    pub source: String,
    pub util_percent: Option<f64>,
    pub mem_util_percent: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_used_bytes: Option<u64>,
    pub mem_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub pcie_tx_bytes_per_s: Option<f64>,
    pub pcie_rx_bytes_per_s: Option<f64>,
}

/// One network interface's traffic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NetMetrics {
    pub interface: String,
    pub rx_bytes_per_s: f64,
    pub tx_bytes_per_s: f64,
    /// Link speed in Mbit/s, when the device reports one.
    pub speed_mbps: Option<u64>,
}

/// The node's signals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeMetrics {
    /// Busy percent of all online CPUs together (100 = every CPU busy).
    pub cpu_percent: Option<f64>,
    /// Busy percent per CPU.
    pub per_cpu_percent: BTreeMap<u32, f64>,
    /// PSI `some avg10` of `/proc/pressure/cpu`: percent of time some task waited for a CPU.
    pub cpu_pressure_percent: Option<f64>,
    /// PSI `some` of `/proc/pressure/memory` over the last pass: percent of time some task was
    /// stalled on memory (reclaim, refaults, swap-in).
    #[serde(default)]
    pub memory_pressure_percent: Option<f64>,
    /// Memory bandwidth of the whole node, bytes/s, and as a fraction of the configured peak
    /// (`None` without `sense.membw_peak_bytes_per_s`).
    pub membw_bytes_per_s: Option<f64>,
    pub membw_fraction_of_peak: Option<f64>,
    pub gpus: Vec<GpuMetrics>,
    pub net: Vec<NetMetrics>,
}

/// What each source is doing, in words, for status output: `nvml`, `emulated (...)`,
/// `unavailable: <why>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStatus {
    pub gpu: String,
    pub perf: String,
    pub cpu: String,
    pub membw: String,
    pub net: String,
}

/// One sensing pass: everything lodger measured, derived into rates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observations {
    /// Milliseconds since the epoch when the pass ended.
    pub unix_ms: u64,
    pub node: NodeMetrics,
    pub jobs: BTreeMap<JobId, JobMetrics>,
    pub sources: SourceStatus,
    /// How old each source's newest pass is, by source name (`sense::sources`); empty when the
    /// sources are not sampled apart (a bare [`sampler::Sampler::pass`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ages: BTreeMap<String, SourceAge>,
}

impl Observations {
    /// Whether `source`'s figures are left out of this pass because it overran its deadline.
    pub fn is_stale(&self, source: &str) -> bool {
        self.ages.get(source).is_some_and(|a| a.stale)
    }
}

/// A source's newest pass: its age, and whether that is past the deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceAge {
    pub age_s: f64,
    pub stale: bool,
}

/// What the sensor needs to know about a job to measure it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SensedJob {
    pub id: JobId,
    /// Its processes as last seen by enforcement.
    pub pids: Vec<u32>,
    /// Its cgroup (the registered one, or lodger's own for a pid job pinned by cgroup), relative
    /// to the hierarchy root.
    pub cgroup: Option<String>,
    pub gpus: Vec<u32>,
}
