//! What contention elimination observes (roles, baselines, per-job and node observations) and
//! what it decides (MBA groups, mechanisms, throttle actions, detections). Plain data; touches
//! nothing.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::job::JobId;

// ---------------------------------------------------------------------------------------------
// Observations.

/// What a job is, as contention sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The owner: protected, never throttled.
    Training,
    /// A CPU batch job: throttled first.
    Batch,
    /// Offline inference: throttled first, with batch.
    Offline,
    /// Online inference: throttled last, and only while its SLO holds.
    Online,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Training => "training",
            Role::Batch => "batch",
            Role::Offline => "offline",
            Role::Online => "online",
        }
    }

    /// The MBA group a lodger of this role lives in; `None` for training.
    pub fn mba_group(self) -> Option<MbaGroup> {
        match self {
            Role::Training => None,
            Role::Batch | Role::Offline => Some(MbaGroup::Lodgers),
            Role::Online => Some(MbaGroup::Online),
        }
    }
}

/// A training job's stable progress: its level and the noise around it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// Mean progress when running alone (GPU utilization percent, or iterations per second).
    pub level: f64,
    /// How far below `level` progress may fall before it counts as a drop.
    pub noise: f64,
}

/// One job this tick.
#[derive(Debug, Clone, PartialEq)]
pub struct JobObservation {
    pub id: JobId,
    pub role: Role,
    /// Cores the job has (its allocation); core halving counts from it. While the job is cut,
    /// an enforcer that caps it (inference placement) shows the capped count here: that is the
    /// throttle's own doing, so a cut job's allocation is only taken to have changed when it
    /// grows beyond the one the cut counts from.
    pub cores: u32,
    /// Its own memory bandwidth (MBM), bytes/s.
    pub membw_bytes_per_s: Option<f64>,
    /// The same per L3 domain, bytes/s (empty when not measured): where an AMD MBA ladder
    /// counts down from ([`super::MbaLadder::base_for`]).
    pub membw_domains: BTreeMap<u32, f64>,
    /// Its cache misses per second (perf), the ranking key where MBM is absent.
    pub cache_misses_per_s: Option<f64>,
    /// Training: progress, higher is better (GPU utilization percent, or the emulated source's
    /// iterations per second).
    pub progress: Option<f64>,
    /// Training: its recorded stable level, if one was profiled; else it is learnt.
    pub baseline: Option<Baseline>,
    /// Training: percent of the last pass some of its tasks were stalled on memory (PSI `some`
    /// of its own cgroup's `memory.pressure`, else the node's `/proc/pressure/memory`).
    pub memory_pressure_percent: Option<f64>,
    /// Online inference: whether its latency SLO is met now. `None` (unknown) counts as not met:
    /// an online job is never throttled blind.
    pub slo_met: Option<bool>,
}

impl JobObservation {
    /// A job with nothing measured.
    pub fn new(id: JobId, role: Role, cores: u32) -> Self {
        Self {
            id,
            role,
            cores,
            membw_bytes_per_s: None,
            membw_domains: BTreeMap::new(),
            cache_misses_per_s: None,
            progress: None,
            baseline: None,
            memory_pressure_percent: None,
            slo_met: None,
        }
    }
}

/// The node's memory bandwidth this tick (resctrl MBM).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeMembw {
    pub bytes_per_s: f64,
    /// `bytes_per_s` over the node's peak.
    pub fraction_of_peak: f64,
    /// Per L3 domain: its bandwidth over its share of the peak. Empty when not known; then
    /// every domain is throttled alike.
    pub domain_fractions: BTreeMap<u32, f64>,
}

/// What one tick of contention control looks at.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContentionObservations {
    /// `None`: no MBM on this node (or no complete sample this tick): detection falls back to
    /// training progress.
    pub membw: Option<NodeMembw>,
    /// Every job on the node, training included.
    pub jobs: Vec<JobObservation>,
}

// ---------------------------------------------------------------------------------------------
// Decisions.

/// The resctrl control groups lodgers are throttled in: one per escalation tier, so online
/// inference can stay unthrottled while batch work is held back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MbaGroup {
    /// Batch and offline inference.
    Lodgers,
    /// Online inference.
    Online,
}

impl MbaGroup {
    /// The resctrl directory name lodger uses for the group.
    pub fn default_name(self) -> &'static str {
        match self {
            MbaGroup::Lodgers => "lodger-lodgers",
            MbaGroup::Online => "lodger-online",
        }
    }

    /// Every group, in the order escalation throttles them.
    pub const ALL: [MbaGroup; 2] = [MbaGroup::Lodgers, MbaGroup::Online];
}

impl fmt::Display for MbaGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.default_name())
    }
}

/// How a job is throttled, or that it no longer is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mechanism {
    /// The job's MBA group gets `value` as its `MB:` schemata value in L3 domain `domain`.
    /// Every job of the group gets the same action: the group is one resctrl control group.
    Mba {
        group: MbaGroup,
        domain: u32,
        value: u32,
    },
    /// The job may use `count` cores (its cpuset shrinks to that many, or grows back).
    Cores { count: u32 },
    /// The job is no longer throttled by anything.
    Release,
}

impl Mechanism {
    /// `mba`, `cores` or `release`: the D-Bus signal's mechanism argument.
    pub fn as_str(&self) -> &'static str {
        match self {
            Mechanism::Mba { .. } => "mba",
            Mechanism::Cores { .. } => "cores",
            Mechanism::Release => "release",
        }
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mechanism::Mba {
                group,
                domain,
                value,
            } => write!(f, "{group} MB:{domain}={value}"),
            Mechanism::Cores { count } => write!(f, "cores={count}"),
            Mechanism::Release => f.write_str("release"),
        }
    }
}

/// One change: a throttle step, a step given back, or a release.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThrottleAction {
    pub job: JobId,
    pub mechanism: Mechanism,
    /// Steps taken on this mechanism (0: unthrottled). For MBA, in that L3 domain.
    pub level: u32,
    /// Decided in advise mode: reported, not applied.
    pub advisory: bool,
    /// Why, in words: the signal, the threshold, the suspects, the victims.
    pub evidence: String,
}

/// The throttles in force: what the enforcer makes true. Anything absent is unthrottled.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Throttles {
    /// Per MBA group with a step taken: the `MB:` value of every L3 domain (unthrottled domains
    /// at their default). A group not listed runs at its defaults.
    pub mba: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    /// Jobs whose cores are cut: the cores each may use.
    pub cores: BTreeMap<JobId, u32>,
}

impl Throttles {
    pub fn is_empty(&self) -> bool {
        self.mba.is_empty() && self.cores.is_empty()
    }
}

/// What a ranking is by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankedBy {
    /// Own memory bandwidth (MBM), bytes/s.
    MemoryBandwidth,
    /// Cache misses per second (perf).
    CacheMisses,
    /// Nothing measured: throttle order, then id.
    Unranked,
}

/// A suspected antagonist.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Suspect {
    pub job: JobId,
    pub role: Role,
    /// The ranking value (bytes/s or misses/s); `None` when it was not measured.
    pub value: Option<f64>,
}

/// What the signal says this tick.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Signal {
    /// MBM: the node's bandwidth as a fraction of the peak.
    MemoryBandwidth { fraction: f64, threshold: f64 },
    /// No MBM: training jobs whose progress dropped below their stable level by more than the
    /// noise (empty: none did).
    TrainingProgress { dropped: Vec<Slowdown> },
    /// Training jobs stalled on memory (PSI) at or above the threshold, in percent of the pass,
    /// while lodgers run (issue 19).
    MemoryPressure {
        stalled: Vec<MemoryStall>,
        threshold: f64,
    },
}

/// A training job stalled on memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryStall {
    pub job: JobId,
    /// Percent of the last pass some of its tasks (or, without its own cgroup, the node's) were
    /// stalled on memory.
    pub percent: f64,
}

/// A training job running below its stable level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Slowdown {
    pub job: JobId,
    pub progress: f64,
    pub baseline: Baseline,
}

/// The last tick's detection, for status output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Detection {
    pub now_ms: u64,
    pub signal: Signal,
    pub pressured: bool,
    pub calm: bool,
    /// Consecutive pressured ticks since the last step.
    pub pressure_run: u32,
    /// Consecutive calm ticks since the last step or give-back.
    pub calm_run: u32,
    /// Calm ticks now needed for a give-back (grows with relapses).
    pub calm_needed: u32,
    /// Lodgers, most suspect first.
    pub suspects: Vec<Suspect>,
    pub ranked_by: RankedBy,
    /// Training jobs affected: those that slowed (no MBM), or all (MBM).
    pub victims: Vec<JobId>,
    /// Pressure persists but every lodger that may be throttled is at its floor.
    pub exhausted: bool,
    /// Why MBA is not used, when the node has it but it cannot be (e.g. `mba_MBps` mounts).
    pub mba_unused: Option<String>,
}
