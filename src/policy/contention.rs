//! Contention elimination (SODA §V-E): detects memory-bandwidth contention that slows training,
//! names the suspected antagonists, and decides throttle steps for the lodgers (MBA, else core
//! halving) and when to give them back. Pure: observations and the time are arguments; no I/O.
//!
//! One [`ContentionEliminator`] per node is a small state machine driven once per tick by
//! [`ContentionEliminator::step`]. It returns the changes as [`ThrottleAction`]s (for signals,
//! logs and counters) and keeps the whole throttle state, [`ContentionEliminator::throttles`],
//! for an idempotent enforcer to make true.
//!
//! Detection (SODA §V-E):
//! - with MBM, the node's memory bandwidth at or above `membw_threshold` of its peak (75%, from
//!   §IV-C-1: 5 of 8 models lose 8.1% at 50% bandwidth pressure) for `pressure_ticks`
//!   consecutive ticks;
//! - without MBM, a training job's progress (GPU utilization, or the emulator's iteration rate)
//!   below its stable level by more than its noise, for `pressure_ticks` consecutive ticks,
//!   while a lodger runs. The stable level is given (profiled offline, as SODA does) or learnt
//!   here while no lodger runs.
//!
//! Escalation, one step per `pressure_ticks` of pressure, in this order:
//! 1. batch and offline inference: their MBA group one MBA step down (where MBA exists), else
//!    (and once MBA is at its floor) halve the top-ranked antagonist's cores, down to a floor;
//! 2. online inference, last, and only jobs whose latency SLO holds: the same on their group;
//! 3. training: never.
//!
//! Steps are given back one at a time, last taken first, after `calm_ticks` calm ticks. A
//! relapse (pressure soon after a give-back) doubles the calm needed for the next give-back, up
//! to `max_calm_ticks`, so a throttle that is needed is not flapped on and off.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::job::JobId;
use crate::sys::resctrlfs::{MbaCaps, MbaUnit};

/// The largest number of steps any ladder has (bounds loops on odd configurations).
const MAX_LEVEL: u32 = 64;

// ---------------------------------------------------------------------------------------------
// Configuration.

/// Whether throttles are enforced or only reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Decide and have the enforcer apply.
    #[default]
    Enforce,
    /// Decide and report what would be done ([`ThrottleAction::advisory`]), apply nothing:
    /// [`ContentionEliminator::throttles`] stays empty.
    Advise,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Advise => "advise",
        }
    }
}

/// `[contention]` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContentionConfig {
    pub mode: Mode,
    /// Node memory bandwidth at or above this fraction of the peak is pressure (SODA §V-E: 0.75).
    pub membw_threshold: f64,
    /// Node memory bandwidth below this fraction of the peak is calm. Between the two, neither:
    /// the hysteresis band.
    pub membw_calm: f64,
    /// Consecutive pressured ticks before a throttle step (and between steps).
    pub pressure_ticks: u32,
    /// Consecutive calm ticks before one step is given back.
    pub calm_ticks: u32,
    /// Ceiling of the calm needed once relapses have doubled it.
    pub max_calm_ticks: u32,
    /// One MBA step, in percent of the unthrottled value (rounded up to `bandwidth_gran` on
    /// Intel).
    pub mba_step_percent: u32,
    /// MBA never goes below this percent of the unthrottled value (nor below `min_bandwidth`).
    pub mba_floor_percent: u32,
    /// Core halving never leaves a job fewer cores than this.
    pub min_cores: u32,
    /// The last this many ticks of a training job's progress while no lodger runs make its
    /// stable level (a sliding window, so a start-up transient ages out while the job is alone).
    pub baseline_ticks: u32,
    /// A learnt level's noise: this many standard deviations of the recorded samples ...
    pub noise_sigmas: f64,
    /// ... and at least this fraction of the level.
    pub min_noise_fraction: f64,
}

impl Default for ContentionConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Enforce,
            membw_threshold: 0.75,
            membw_calm: 0.60,
            pressure_ticks: 3,
            calm_ticks: 10,
            max_calm_ticks: 160,
            mba_step_percent: 10,
            mba_floor_percent: 10,
            min_cores: 1,
            baseline_ticks: 10,
            noise_sigmas: 3.0,
            min_noise_fraction: 0.05,
        }
    }
}

/// A `[contention]` value that cannot work, by field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("contention.{field}: {reason}")]
pub struct ContentionConfigError {
    pub field: &'static str,
    pub reason: String,
}

impl ContentionConfig {
    /// Checks the values; returns the first that is wrong.
    pub fn validate(&self) -> Result<(), ContentionConfigError> {
        let bad = |field, reason: String| Err(ContentionConfigError { field, reason });
        let fraction = |v: f64| v.is_finite() && v > 0.0 && v <= 1.0;
        if !fraction(self.membw_threshold) {
            return bad(
                "membw_threshold",
                format!("{} is not a fraction in (0, 1]", self.membw_threshold),
            );
        }
        if !fraction(self.membw_calm) || self.membw_calm >= self.membw_threshold {
            return bad(
                "membw_calm",
                format!(
                    "{} must be a fraction below membw_threshold ({})",
                    self.membw_calm, self.membw_threshold
                ),
            );
        }
        for (field, v) in [
            ("pressure_ticks", self.pressure_ticks),
            ("calm_ticks", self.calm_ticks),
            ("baseline_ticks", self.baseline_ticks),
            ("min_cores", self.min_cores),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".to_string());
            }
        }
        if self.max_calm_ticks < self.calm_ticks {
            return bad(
                "max_calm_ticks",
                format!(
                    "{} is below calm_ticks ({})",
                    self.max_calm_ticks, self.calm_ticks
                ),
            );
        }
        if self.mba_step_percent == 0 || self.mba_step_percent > 100 {
            return bad(
                "mba_step_percent",
                format!("{} is not in 1..=100", self.mba_step_percent),
            );
        }
        if self.mba_floor_percent == 0 || self.mba_floor_percent > 100 {
            return bad(
                "mba_floor_percent",
                format!("{} is not in 1..=100", self.mba_floor_percent),
            );
        }
        if !(self.noise_sigmas.is_finite() && self.noise_sigmas >= 0.0) {
            return bad(
                "noise_sigmas",
                format!("{} is not a non-negative number", self.noise_sigmas),
            );
        }
        if !(self.min_noise_fraction.is_finite() && (0.0..1.0).contains(&self.min_noise_fraction)) {
            return bad(
                "min_noise_fraction",
                format!("{} is not a fraction in [0, 1)", self.min_noise_fraction),
            );
        }
        Ok(())
    }
}

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
    /// Its cache misses per second (perf), the ranking key where MBM is absent.
    pub cache_misses_per_s: Option<f64>,
    /// Training: progress, higher is better (GPU utilization percent, or the emulated source's
    /// iterations per second).
    pub progress: Option<f64>,
    /// Training: its recorded stable level, if one was profiled; else it is learnt.
    pub baseline: Option<Baseline>,
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
            cache_misses_per_s: None,
            progress: None,
            baseline: None,
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

    const ALL: [MbaGroup; 2] = [MbaGroup::Lodgers, MbaGroup::Online];
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

// ---------------------------------------------------------------------------------------------
// MBA arithmetic.

/// The MB values one MBA step after another, per L3 domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MbaLadder {
    caps: MbaCaps,
    step_percent: u32,
    floor_percent: u32,
}

impl MbaLadder {
    /// The ladder for `caps`; `Err` with the reason where MBA cannot be stepped in percent of
    /// an unthrottled value (the `mba_MBps` software controller, whose unthrottled value is
    /// "no limit").
    pub fn new(caps: MbaCaps, config: &ContentionConfig) -> Result<Self, String> {
        if caps.unit == MbaUnit::MegabytesPerSecond {
            return Err(
                "resctrl is mounted with mba_MBps: MB values are MB/s limits with no \
                        unthrottled reference, so core halving is used instead"
                    .to_string(),
            );
        }
        if caps.default_schemata.is_empty() {
            return Err("the default group has no MB values".to_string());
        }
        let mut step_percent = config.mba_step_percent.max(1);
        if caps.unit == MbaUnit::Percent && caps.bandwidth_gran > 1 {
            // Intel: a step smaller than the granularity would round back up to no change.
            step_percent = step_percent.div_ceil(caps.bandwidth_gran) * caps.bandwidth_gran;
        }
        Ok(Self {
            caps,
            step_percent,
            floor_percent: config.mba_floor_percent,
        })
    }

    /// The L3 domains.
    pub fn domains(&self) -> impl Iterator<Item = u32> + '_ {
        self.caps.default_schemata.keys().copied()
    }

    /// The unthrottled value of `domain`: 100 (percent), or the default group's (AMD).
    pub fn unthrottled(&self, domain: u32) -> u32 {
        match self.caps.unit {
            MbaUnit::Percent => self.caps.max_value(),
            _ => self
                .caps
                .default_schemata
                .get(&domain)
                .copied()
                .unwrap_or_else(|| self.caps.max_value()),
        }
    }

    /// The lowest value: `mba_floor_percent` of unthrottled, not below `min_bandwidth`.
    pub fn floor(&self, domain: u32) -> u32 {
        let base = u64::from(self.unthrottled(domain));
        let floor = (base * u64::from(self.floor_percent)).div_ceil(100);
        self.caps
            .valid_value(u32::try_from(floor).unwrap_or(u32::MAX))
    }

    /// The value after `level` steps: `100 - level × step` percent of unthrottled, rounded the
    /// way the kernel would (up to `bandwidth_gran`, at least `min_bandwidth`), not below the
    /// floor.
    pub fn value(&self, domain: u32, level: u32) -> u32 {
        let base = u64::from(self.unthrottled(domain));
        let percent = 100u64.saturating_sub(u64::from(level) * u64::from(self.step_percent));
        let wanted = (base * percent).div_ceil(100);
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        self.caps.valid_value(wanted).max(self.floor(domain))
    }

    /// Steps until the floor: levels run from 0 (unthrottled) to this.
    pub fn max_level(&self, domain: u32) -> u32 {
        let floor = self.floor(domain);
        let mut level = 0;
        while level < MAX_LEVEL && self.value(domain, level) > floor {
            level += 1;
        }
        level
    }
}

/// Cores left after `level` halvings of `nominal`: `ceil(nominal / 2^level)`, not below `floor`.
/// A job with `floor` cores or fewer is not cut.
pub fn halved_cores(nominal: u32, level: u32, floor: u32) -> u32 {
    if nominal <= floor {
        return nominal;
    }
    let cores = u64::from(nominal).div_ceil(1u64 << level.min(32));
    u32::try_from(cores).unwrap_or(u32::MAX).max(floor)
}

/// Halvings until `floor`: levels run from 0 to this (0 when the job has `floor` cores or fewer).
pub fn max_halvings(nominal: u32, floor: u32) -> u32 {
    let mut level = 0;
    while level < MAX_LEVEL && halved_cores(nominal, level, floor) > floor {
        level += 1;
    }
    level
}

// ---------------------------------------------------------------------------------------------
// Baseline learning.

/// The last `baseline_ticks` progress samples of a training job running alone.
///
/// A window that slides, not the first samples kept for good: a job's first samples are often
/// its start-up (the emulator's first record covers the seconds before its first iteration; a
/// real job loads its data), and a level learnt from them would be low and its noise so wide
/// that no drop would ever exceed it.
#[derive(Debug, Clone, Default, PartialEq)]
struct Learner {
    samples: VecDeque<f64>,
}

impl Learner {
    fn observe(&mut self, x: f64, config: &ContentionConfig) {
        let keep = usize::try_from(config.baseline_ticks.max(1)).unwrap_or(usize::MAX);
        self.samples.push_back(x);
        while self.samples.len() > keep {
            self.samples.pop_front();
        }
    }

    fn baseline(&self, config: &ContentionConfig) -> Option<Baseline> {
        let n = self.samples.len();
        if n == 0 || n < usize::try_from(config.baseline_ticks).unwrap_or(usize::MAX) {
            return None;
        }
        let count = f64::from(u32::try_from(n).unwrap_or(u32::MAX));
        let mean = self.samples.iter().sum::<f64>() / count;
        let sd = if n > 1 {
            let squares: f64 = self.samples.iter().map(|x| (x - mean) * (x - mean)).sum();
            (squares / (count - 1.0)).max(0.0).sqrt()
        } else {
            0.0
        };
        Some(Baseline {
            level: mean,
            noise: (config.noise_sigmas * sd).max(config.min_noise_fraction * mean.abs()),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The state machine.

/// One step taken, remembered so steps are given back last-first.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Mba { group: MbaGroup, domains: Vec<u32> },
    Cores { job: JobId },
}

/// A job's core cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CoreCut {
    nominal: u32,
    level: u32,
}

/// A snapshot of everything throttled and why, for status output.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContentionStatus {
    pub mode: Mode,
    /// In force (advise mode: what would be).
    pub throttles: Throttles,
    /// MBA steps per group and domain.
    pub mba_levels: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    /// Halvings per job.
    pub core_levels: BTreeMap<JobId, u32>,
    /// Learnt (or given) stable levels of training jobs.
    pub baselines: BTreeMap<JobId, Baseline>,
    pub detection: Option<Detection>,
}

/// SODA §V-E's contention eliminator for one node.
#[derive(Debug, Clone)]
pub struct ContentionEliminator {
    config: ContentionConfig,
    ladder: Option<MbaLadder>,
    mba_unused: Option<String>,
    tick: u64,
    pressure_run: u32,
    calm_run: u32,
    calm_needed: u32,
    last_give_back: Option<u64>,
    mba_levels: BTreeMap<MbaGroup, BTreeMap<u32, u32>>,
    cuts: BTreeMap<JobId, CoreCut>,
    steps: Vec<Step>,
    learners: BTreeMap<JobId, Learner>,
    given_baselines: BTreeMap<JobId, Baseline>,
    /// Each MBA group's members at the last tick, to notice jobs joining a throttled group.
    members: BTreeMap<MbaGroup, BTreeSet<JobId>>,
    /// Jobs throttled by anything at the end of the last tick.
    throttled: BTreeSet<JobId>,
    detection: Option<Detection>,
}

/// What one tick knows while it decides.
struct Tick<'a> {
    now_ms: u64,
    jobs: BTreeMap<&'a JobId, &'a JobObservation>,
    membw: Option<&'a NodeMembw>,
    suspects: Vec<Suspect>,
    ranked_by: RankedBy,
    victims: Vec<JobId>,
    /// The detection in words, for evidence.
    why: String,
}

impl ContentionEliminator {
    /// `mba`: the node's MBA capabilities ([`MbaCaps::read`]), `None` where it has none.
    /// `config` should have passed [`ContentionConfig::validate`]; out-of-range values are
    /// clamped to work.
    pub fn new(config: ContentionConfig, mba: Option<MbaCaps>) -> Self {
        let (ladder, mba_unused) = match mba.map(|caps| MbaLadder::new(caps, &config)) {
            Some(Ok(ladder)) => (Some(ladder), None),
            Some(Err(why)) => (None, Some(why)),
            None => (None, None),
        };
        let calm_needed = config.calm_ticks.max(1);
        Self {
            config,
            ladder,
            mba_unused,
            tick: 0,
            pressure_run: 0,
            calm_run: 0,
            calm_needed,
            last_give_back: None,
            mba_levels: BTreeMap::new(),
            cuts: BTreeMap::new(),
            steps: Vec::new(),
            learners: BTreeMap::new(),
            given_baselines: BTreeMap::new(),
            members: BTreeMap::new(),
            throttled: BTreeSet::new(),
            detection: None,
        }
    }

    pub fn config(&self) -> &ContentionConfig {
        &self.config
    }

    /// The MBA ladder in use; `None` without MBA (core halving only).
    pub fn mba_ladder(&self) -> Option<&MbaLadder> {
        self.ladder.as_ref()
    }

    /// Switches between enforce and advise. Going to advise, the enforcer's next
    /// [`throttles`](Self::throttles) is empty, which lifts what was applied.
    pub fn set_mode(&mut self, mode: Mode) {
        self.config.mode = mode;
    }

    /// The last tick's detection.
    pub fn detection(&self) -> Option<&Detection> {
        self.detection.as_ref()
    }

    /// What the enforcer must make true now: empty in advise mode.
    pub fn throttles(&self) -> Throttles {
        match self.config.mode {
            Mode::Enforce => self.decided(),
            Mode::Advise => Throttles::default(),
        }
    }

    /// The throttles decided, whatever the mode (in advise mode: what would be in force).
    pub fn decided(&self) -> Throttles {
        let mut t = Throttles::default();
        if let Some(ladder) = &self.ladder {
            for (&group, levels) in &self.mba_levels {
                if levels.values().all(|&l| l == 0) {
                    continue;
                }
                let values = ladder
                    .domains()
                    .map(|d| {
                        let level = levels.get(&d).copied().unwrap_or(0);
                        (d, ladder.value(d, level))
                    })
                    .collect();
                t.mba.insert(group, values);
            }
        }
        for (job, cut) in &self.cuts {
            if cut.level > 0 {
                t.cores.insert(
                    job.clone(),
                    halved_cores(cut.nominal, cut.level, self.config.min_cores),
                );
            }
        }
        t
    }

    pub fn status(&self) -> ContentionStatus {
        let mut baselines = self.given_baselines.clone();
        for (job, learner) in &self.learners {
            if let Some(b) = learner.baseline(&self.config) {
                baselines.entry(job.clone()).or_insert(b);
            }
        }
        ContentionStatus {
            mode: self.config.mode,
            throttles: self.decided(),
            mba_levels: self.mba_levels.clone(),
            core_levels: self
                .cuts
                .iter()
                .map(|(job, cut)| (job.clone(), cut.level))
                .collect(),
            baselines,
            detection: self.detection.clone(),
        }
    }

    /// One tick: takes this tick's observations, returns what changed. `now_ms` stamps the
    /// detection; hysteresis counts ticks.
    pub fn step(&mut self, now_ms: u64, obs: &ContentionObservations) -> Vec<ThrottleAction> {
        self.tick += 1;
        let mut actions = Vec::new();
        let mut jobs = BTreeMap::new();
        for job in &obs.jobs {
            // A job listed twice counts once (the first listing wins).
            jobs.entry(&job.id).or_insert(job);
        }
        let mut tick = Tick {
            now_ms,
            jobs,
            membw: obs.membw.as_ref(),
            suspects: Vec::new(),
            ranked_by: RankedBy::Unranked,
            victims: Vec::new(),
            why: String::new(),
        };

        self.forget_departed(&tick, &mut actions);
        self.refresh_cuts(&tick, &mut actions);
        self.notice_joiners(&tick, &mut actions);

        let training: Vec<&JobObservation> = tick
            .jobs
            .values()
            .copied()
            .filter(|j| j.role == Role::Training)
            .collect();
        let lodgers_run = tick.jobs.values().any(|j| j.role != Role::Training);
        self.learn(&training, lodgers_run);

        if training.is_empty() {
            // Nothing to protect: every throttle goes at once.
            if !self.steps.is_empty() || !self.cuts.is_empty() || !self.mba_levels.is_empty() {
                let why = "no training job on the node: every throttle lifted".to_string();
                self.lift_all(&tick, &why, &mut actions);
            }
            self.pressure_run = 0;
            self.calm_run = 0;
            self.calm_needed = self.config.calm_ticks.max(1);
            self.detection = None;
            self.finish(&tick, &mut actions);
            return actions;
        }

        let (signal, pressured, calm) = self.detect(&mut tick, &training, lodgers_run);
        self.rank(&mut tick);

        if pressured {
            self.pressure_run += 1;
            self.calm_run = 0;
        } else if calm {
            self.calm_run += 1;
            self.pressure_run = 0;
        } else {
            // The hysteresis band: neither run goes on.
            self.pressure_run = 0;
            self.calm_run = 0;
        }

        // An online job throttled while its SLO fails gets a step back at once.
        self.guard_slo(&tick, &mut actions);

        let mut exhausted = false;
        if self.pressure_run >= self.config.pressure_ticks.max(1) {
            self.pressure_run = 0;
            let relapse = self
                .last_give_back
                .is_some_and(|at| self.tick - at <= u64::from(self.calm_needed));
            if relapse {
                self.calm_needed = self
                    .calm_needed
                    .saturating_mul(2)
                    .min(self.config.max_calm_ticks.max(self.config.calm_ticks))
                    .max(1);
                self.last_give_back = None;
            }
            exhausted = !self.escalate(&tick, &mut actions);
        } else if self.calm_run >= self.calm_needed {
            self.calm_run = 0;
            if self.steps.is_empty() {
                // Calm with nothing held: relapses are forgiven.
                self.calm_needed = self.config.calm_ticks.max(1);
            } else {
                let why = format!(
                    "calm for {} ticks ({}): one step given back",
                    self.calm_needed, tick.why
                );
                self.give_back(&tick, &why, &mut actions);
                self.last_give_back = Some(self.tick);
            }
        }

        self.detection = Some(Detection {
            now_ms: tick.now_ms,
            signal,
            pressured,
            calm,
            pressure_run: self.pressure_run,
            calm_run: self.calm_run,
            calm_needed: self.calm_needed,
            suspects: tick.suspects.clone(),
            ranked_by: tick.ranked_by,
            victims: tick.victims.clone(),
            exhausted,
            mba_unused: self.mba_unused.clone(),
        });
        self.finish(&tick, &mut actions);
        actions
    }

    // -----------------------------------------------------------------------------------------
    // Bookkeeping.

    /// Drops the state of jobs that left or became training (which is never throttled).
    fn forget_departed(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let gone: Vec<JobId> = self
            .cuts
            .keys()
            .filter(|id| tick.jobs.get(id).map_or(true, |j| j.role == Role::Training))
            .cloned()
            .collect();
        for id in gone {
            self.cuts.remove(&id);
            self.steps
                .retain(|s| !matches!(s, Step::Cores { job } if *job == id));
        }
        // A job that left or was re-registered as training is released; the others' releases
        // follow from `finish`.
        let departed: Vec<JobId> = self
            .throttled
            .iter()
            .filter(|id| tick.jobs.get(id).map_or(true, |j| j.role == Role::Training))
            .cloned()
            .collect();
        for id in departed {
            self.throttled.remove(&id);
            let evidence = match tick.jobs.get(&id) {
                None => "job gone: its throttles are dropped",
                Some(_) => "job is training now: training is never throttled",
            };
            actions.push(self.action(id, Mechanism::Release, 0, evidence.to_string()));
        }
        // An MBA group with no members has nothing to throttle.
        for group in MbaGroup::ALL {
            let has_members = tick
                .jobs
                .values()
                .any(|j| j.role.mba_group() == Some(group));
            if !has_members {
                self.mba_levels.remove(&group);
                self.steps
                    .retain(|s| !matches!(s, Step::Mba { group: g, .. } if *g == group));
            }
        }
        self.learners.retain(|id, _| tick.jobs.contains_key(id));
        self.given_baselines
            .retain(|id, _| tick.jobs.contains_key(id));
    }

    /// A cut job whose allocation grew keeps its level, counted from the new allocation.
    ///
    /// Fewer cores than the cut counts from say nothing: the enforcer shows the job capped (a
    /// cut to 4 of 8 cores shows 4). Taking that for the allocation would lift the cut the
    /// next tick (2 cores halved to 1 show 1, which cannot be cut) or halve the halved count
    /// again, down to the floor.
    fn refresh_cuts(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let floor = self.config.min_cores;
        let mut changed = Vec::new();
        for (id, cut) in &mut self.cuts {
            let Some(job) = tick.jobs.get(id) else {
                continue;
            };
            if job.cores <= cut.nominal {
                continue;
            }
            let before = halved_cores(cut.nominal, cut.level, floor);
            cut.nominal = job.cores;
            cut.level = cut.level.min(max_halvings(cut.nominal, floor));
            let after = halved_cores(cut.nominal, cut.level, floor);
            if after != before {
                changed.push((id.clone(), after, cut.level));
            }
        }
        for (id, count, level) in changed {
            let evidence = format!("allocation changed: {count} cores at the same throttle level");
            actions.push(self.action(id, Mechanism::Cores { count }, level, evidence));
        }
        self.cuts.retain(|_, cut| cut.level > 0);
        let cuts = &self.cuts;
        self.steps
            .retain(|s| !matches!(s, Step::Cores { job } if !cuts.contains_key(job)));
    }

    /// A job that joins a throttled MBA group is throttled with it: say so.
    fn notice_joiners(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        for group in MbaGroup::ALL {
            let now: BTreeSet<JobId> = tick
                .jobs
                .values()
                .filter(|j| j.role.mba_group() == Some(group))
                .map(|j| j.id.clone())
                .collect();
            let before = self.members.insert(group, now.clone()).unwrap_or_default();
            let Some(ladder) = &self.ladder else {
                continue;
            };
            let Some(levels) = self.mba_levels.get(&group) else {
                continue;
            };
            for id in now.difference(&before) {
                for (&domain, &level) in levels {
                    if level == 0 {
                        continue;
                    }
                    let value = ladder.value(domain, level);
                    actions.push(self.action(
                        id.clone(),
                        Mechanism::Mba {
                            group,
                            domain,
                            value,
                        },
                        level,
                        format!("joined {group}, which is throttled"),
                    ));
                }
            }
        }
    }

    /// Records the progress of training jobs running alone, and baselines given by the caller.
    fn learn(&mut self, training: &[&JobObservation], lodgers_run: bool) {
        for job in training {
            if let Some(b) = job.baseline {
                self.given_baselines.insert(job.id.clone(), b);
            }
            let learner = self.learners.entry(job.id.clone()).or_default();
            let Some(p) = job.progress.filter(|p| p.is_finite()) else {
                continue;
            };
            // SODA §V-E records the stable level of a job running alone; a lodger beside it
            // would record a level already lowered by contention.
            if !lodgers_run {
                learner.observe(p, &self.config);
            }
        }
    }

    fn baseline(&self, id: &JobId) -> Option<Baseline> {
        self.given_baselines
            .get(id)
            .copied()
            .or_else(|| self.learners.get(id).and_then(|l| l.baseline(&self.config)))
    }

    /// The signal, and whether this tick is pressured and whether it is calm.
    fn detect(
        &self,
        tick: &mut Tick<'_>,
        training: &[&JobObservation],
        lodgers_run: bool,
    ) -> (Signal, bool, bool) {
        let c = &self.config;
        if let Some(m) = tick.membw {
            let fraction = m.fraction_of_peak;
            tick.victims = training.iter().map(|j| j.id.clone()).collect();
            tick.why = format!(
                "node memory bandwidth {} = {:.0}% of peak, threshold {:.0}%",
                gb(m.bytes_per_s),
                fraction * 100.0,
                c.membw_threshold * 100.0
            );
            let signal = Signal::MemoryBandwidth {
                fraction,
                threshold: c.membw_threshold,
            };
            let pressured = fraction.is_finite() && fraction >= c.membw_threshold;
            let calm = fraction.is_finite() && fraction < c.membw_calm;
            return (signal, pressured, calm);
        }
        let mut dropped = Vec::new();
        for job in training {
            let (Some(progress), Some(baseline)) = (job.progress, self.baseline(&job.id)) else {
                continue;
            };
            if progress.is_finite() && baseline.level - progress > baseline.noise {
                dropped.push(Slowdown {
                    job: job.id.clone(),
                    progress,
                    baseline,
                });
            }
        }
        tick.victims = dropped.iter().map(|s| s.job.clone()).collect();
        tick.why = if dropped.is_empty() {
            "training progress within its noise".to_string()
        } else {
            let mut why = String::new();
            for (i, s) in dropped.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let _ = write!(
                    why,
                    "{sep}{} progress {:.1} below its stable {:.1} by more than its noise {:.1}",
                    s.job, s.progress, s.baseline.level, s.baseline.noise
                );
            }
            why
        };
        let pressured = lodgers_run && !dropped.is_empty();
        let calm = dropped.is_empty();
        (Signal::TrainingProgress { dropped }, pressured, calm)
    }

    /// Ranks the lodgers by their own bandwidth, else cache misses (SODA §V-E names MBM;
    /// misses stand in where it is absent).
    fn rank(&self, tick: &mut Tick<'_>) {
        let lodgers: Vec<&JobObservation> = tick
            .jobs
            .values()
            .copied()
            .filter(|j| j.role != Role::Training)
            .collect();
        let key: fn(&JobObservation) -> Option<f64> =
            if lodgers.iter().any(|j| j.membw_bytes_per_s.is_some()) {
                tick.ranked_by = RankedBy::MemoryBandwidth;
                |j| j.membw_bytes_per_s
            } else if lodgers.iter().any(|j| j.cache_misses_per_s.is_some()) {
                tick.ranked_by = RankedBy::CacheMisses;
                |j| j.cache_misses_per_s
            } else {
                tick.ranked_by = RankedBy::Unranked;
                |_| None
            };
        let mut suspects: Vec<Suspect> = lodgers
            .iter()
            .map(|j| Suspect {
                job: j.id.clone(),
                role: j.role,
                value: key(j).filter(|v| v.is_finite()),
            })
            .collect();
        suspects.sort_by(|a, b| {
            let va = a.value.unwrap_or(f64::NEG_INFINITY);
            let vb = b.value.unwrap_or(f64::NEG_INFINITY);
            vb.total_cmp(&va)
                .then(a.role.cmp(&b.role))
                .then(a.job.seq().cmp(&b.job.seq()))
                .then(a.job.cmp(&b.job))
        });
        tick.suspects = suspects;
    }

    // -----------------------------------------------------------------------------------------
    // Steps.

    /// Takes one step; false when nothing is left to throttle.
    fn escalate(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) -> bool {
        let evidence = self.evidence(tick);
        for tier in [MbaGroup::Lodgers, MbaGroup::Online] {
            let members: Vec<&JobObservation> = tick
                .jobs
                .values()
                .copied()
                .filter(|j| j.role.mba_group() == Some(tier))
                .collect();
            // Online inference only while every SLO of the group holds: the group is
            // throttled as one.
            let eligible: Vec<&JobObservation> = members
                .iter()
                .copied()
                .filter(|j| tier == MbaGroup::Lodgers || j.slo_met == Some(true))
                .collect();
            if eligible.is_empty() {
                continue;
            }
            if eligible.len() == members.len() && self.step_mba(tick, tier, &evidence, actions) {
                return true;
            }
            if self.halve(tick, &eligible, &evidence, actions) {
                return true;
            }
        }
        false
    }

    /// One MBA step down for `group`, in the pressured domains (all where unknown).
    fn step_mba(
        &mut self,
        tick: &Tick<'_>,
        group: MbaGroup,
        evidence: &str,
        actions: &mut Vec<ThrottleAction>,
    ) -> bool {
        let Some(ladder) = &self.ladder else {
            return false;
        };
        let levels = self.mba_levels.get(&group).cloned().unwrap_or_default();
        let open: Vec<u32> = ladder
            .domains()
            .filter(|d| levels.get(d).copied().unwrap_or(0) < ladder.max_level(*d))
            .collect();
        let pressured: Vec<u32> = tick
            .membw
            .map(|m| {
                open.iter()
                    .copied()
                    .filter(|d| {
                        m.domain_fractions
                            .get(d)
                            .is_some_and(|f| *f >= self.config.membw_threshold)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let domains = if pressured.is_empty() {
            open
        } else {
            pressured
        };
        if domains.is_empty() {
            return false;
        }
        let mut changes = Vec::new();
        let entry = self.mba_levels.entry(group).or_default();
        for &d in &domains {
            let level = entry.entry(d).or_insert(0);
            *level += 1;
            changes.push((d, *level, ladder.value(d, *level)));
        }
        self.steps.push(Step::Mba { group, domains });
        let why = format!("{evidence}; {group} MBA one step down");
        self.mba_actions(tick, group, &changes, &why, actions);
        true
    }

    /// Halves the cores of the most suspect of `eligible` that is above its floor.
    fn halve(
        &mut self,
        tick: &Tick<'_>,
        eligible: &[&JobObservation],
        evidence: &str,
        actions: &mut Vec<ThrottleAction>,
    ) -> bool {
        let floor = self.config.min_cores;
        // A cut job counts from the allocation its cut does (it shows the capped count).
        let pick = tick.suspects.iter().find_map(|s| {
            let job = eligible.iter().find(|j| j.id == s.job)?;
            let (nominal, level) = self
                .cuts
                .get(&job.id)
                .map_or((job.cores, 0), |c| (c.nominal, c.level));
            (level < max_halvings(nominal, floor)).then_some(*job)
        });
        let Some(job) = pick else {
            return false;
        };
        let cut = self.cuts.entry(job.id.clone()).or_insert(CoreCut {
            nominal: job.cores,
            level: 0,
        });
        let before = halved_cores(cut.nominal, cut.level, floor);
        cut.level += 1;
        let (count, level) = (halved_cores(cut.nominal, cut.level, floor), cut.level);
        self.steps.push(Step::Cores {
            job: job.id.clone(),
        });
        let why = format!(
            "{evidence}; {} cores halved {before} -> {count}{}",
            job.id,
            if self.ladder.is_none() {
                " (no MBA)"
            } else {
                " (its MBA group is at its floor)"
            }
        );
        actions.push(self.action(job.id.clone(), Mechanism::Cores { count }, level, why));
        true
    }

    /// Gives back the last step taken.
    fn give_back(&mut self, tick: &Tick<'_>, why: &str, actions: &mut Vec<ThrottleAction>) {
        let Some(step) = self.steps.pop() else {
            return;
        };
        self.undo(tick, step, why, actions);
    }

    fn undo(&mut self, tick: &Tick<'_>, step: Step, why: &str, actions: &mut Vec<ThrottleAction>) {
        match step {
            Step::Mba { group, domains } => {
                let Some(ladder) = &self.ladder else {
                    return;
                };
                let mut changes = Vec::new();
                if let Some(levels) = self.mba_levels.get_mut(&group) {
                    for d in domains {
                        if let Some(level) = levels.get_mut(&d) {
                            *level = level.saturating_sub(1);
                            changes.push((d, *level, ladder.value(d, *level)));
                        }
                    }
                    levels.retain(|_, l| *l > 0);
                    if levels.is_empty() {
                        self.mba_levels.remove(&group);
                    }
                }
                self.mba_actions(tick, group, &changes, why, actions);
            }
            Step::Cores { job } => {
                let floor = self.config.min_cores;
                let Some(cut) = self.cuts.get_mut(&job) else {
                    return;
                };
                cut.level = cut.level.saturating_sub(1);
                let (count, level) = (halved_cores(cut.nominal, cut.level, floor), cut.level);
                if level == 0 {
                    self.cuts.remove(&job);
                }
                actions.push(self.action(job, Mechanism::Cores { count }, level, why.to_string()));
            }
        }
    }

    /// Online jobs whose SLO does not hold get their group's or their own last step back.
    fn guard_slo(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let failing: Vec<&JobObservation> = tick
            .jobs
            .values()
            .copied()
            .filter(|j| j.role == Role::Online && j.slo_met != Some(true))
            .collect();
        if failing.is_empty() {
            return;
        }
        let names: Vec<&str> = failing.iter().map(|j| j.id.as_str()).collect();
        let why = format!(
            "SLO of {} not met: its throttle eased one step",
            names.join(", ")
        );
        let pos = self.steps.iter().rposition(|s| match s {
            Step::Mba { group, .. } => *group == MbaGroup::Online,
            Step::Cores { job } => failing.iter().any(|j| j.id == *job),
        });
        if let Some(pos) = pos {
            let step = self.steps.remove(pos);
            self.undo(tick, step, &why, actions);
        }
    }

    /// Gives back every step.
    fn lift_all(&mut self, tick: &Tick<'_>, why: &str, actions: &mut Vec<ThrottleAction>) {
        while let Some(step) = self.steps.pop() {
            self.undo(tick, step, why, actions);
        }
        self.mba_levels.clear();
        self.cuts.clear();
    }

    /// Emits one MBA action per member of `group` per changed domain.
    fn mba_actions(
        &self,
        tick: &Tick<'_>,
        group: MbaGroup,
        changes: &[(u32, u32, u32)],
        why: &str,
        actions: &mut Vec<ThrottleAction>,
    ) {
        for job in tick.jobs.values() {
            if job.role.mba_group() != Some(group) {
                continue;
            }
            for &(domain, level, value) in changes {
                actions.push(self.action(
                    job.id.clone(),
                    Mechanism::Mba {
                        group,
                        domain,
                        value,
                    },
                    level,
                    why.to_string(),
                ));
            }
        }
    }

    /// Appends a `Release` for every job that was throttled and no longer is, and remembers
    /// who is throttled.
    fn finish(&mut self, tick: &Tick<'_>, actions: &mut Vec<ThrottleAction>) {
        let now: BTreeSet<JobId> = tick
            .jobs
            .values()
            .filter(|j| self.is_throttled(j))
            .map(|j| j.id.clone())
            .collect();
        for id in self.throttled.difference(&now) {
            actions.push(self.action(
                id.clone(),
                Mechanism::Release,
                0,
                "no throttle left on the job".to_string(),
            ));
        }
        self.throttled = now;
    }

    fn is_throttled(&self, job: &JobObservation) -> bool {
        let by_cores = self.cuts.get(&job.id).is_some_and(|c| c.level > 0);
        let by_mba = job.role.mba_group().is_some_and(|g| {
            self.mba_levels
                .get(&g)
                .is_some_and(|levels| levels.values().any(|&l| l > 0))
        });
        by_cores || by_mba
    }

    fn action(
        &self,
        job: JobId,
        mechanism: Mechanism,
        level: u32,
        evidence: String,
    ) -> ThrottleAction {
        ThrottleAction {
            job,
            mechanism,
            level,
            advisory: self.config.mode == Mode::Advise,
            evidence,
        }
    }

    /// The detection in words: signal, threshold, suspects, victims.
    fn evidence(&self, tick: &Tick<'_>) -> String {
        let mut s = format!(
            "{} for {} ticks",
            tick.why,
            self.config.pressure_ticks.max(1)
        );
        if !tick.suspects.is_empty() {
            s.push_str("; suspects ");
            for (i, suspect) in tick.suspects.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let value = match (tick.ranked_by, suspect.value) {
                    (RankedBy::MemoryBandwidth, Some(v)) => format!(" {}", gb(v)),
                    (RankedBy::CacheMisses, Some(v)) => format!(" {:.3e} misses/s", v),
                    _ => String::new(),
                };
                let _ = write!(s, "{sep}{} ({}{value})", suspect.job, suspect.role.as_str());
            }
        }
        if !tick.victims.is_empty() {
            let names: Vec<&str> = tick.victims.iter().map(JobId::as_str).collect();
            let _ = write!(s, "; protecting {}", names.join(", "));
        }
        s
    }
}

/// Bytes/s in GB/s, for evidence.
fn gb(bytes_per_s: f64) -> String {
    format!("{:.2} GB/s", bytes_per_s / 1e9)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(seq: u64) -> JobId {
        JobId::from_seq(seq)
    }

    fn intel_caps() -> MbaCaps {
        // As tests/fixtures/resctrl/intel-mba-mbm reads.
        MbaCaps {
            unit: MbaUnit::Percent,
            bandwidth_gran: 10,
            min_bandwidth: 10,
            num_closids: 8,
            delay_linear: true,
            default_schemata: BTreeMap::from([(0, 100), (1, 100)]),
        }
    }

    fn amd_caps() -> MbaCaps {
        // As tests/fixtures/resctrl/amd reads.
        MbaCaps {
            unit: MbaUnit::AmdEighthGigabytesPerSecond,
            bandwidth_gran: 1,
            min_bandwidth: 0,
            num_closids: 16,
            delay_linear: false,
            default_schemata: BTreeMap::from([(0, 2048), (1, 2048), (2, 2048), (3, 2048)]),
        }
    }

    fn training(seq: u64) -> JobObservation {
        JobObservation::new(id(seq), Role::Training, 8)
    }

    fn lodger(seq: u64, role: Role, cores: u32, bw: Option<f64>) -> JobObservation {
        let mut j = JobObservation::new(id(seq), role, cores);
        j.membw_bytes_per_s = bw;
        if role == Role::Online {
            j.slo_met = Some(true);
        }
        j
    }

    fn membw(fraction: f64) -> Option<NodeMembw> {
        Some(NodeMembw {
            bytes_per_s: fraction * 100e9,
            fraction_of_peak: fraction,
            domain_fractions: BTreeMap::new(),
        })
    }

    fn obs(fraction: Option<f64>, jobs: Vec<JobObservation>) -> ContentionObservations {
        ContentionObservations {
            membw: fraction.and_then(membw),
            jobs,
        }
    }

    fn config(pressure: u32, calm: u32) -> ContentionConfig {
        ContentionConfig {
            pressure_ticks: pressure,
            calm_ticks: calm,
            ..ContentionConfig::default()
        }
    }

    /// Runs `ticks` ticks of the same observations; returns every action.
    fn run(
        c: &mut ContentionEliminator,
        ticks: u32,
        o: &ContentionObservations,
    ) -> Vec<ThrottleAction> {
        let mut all = Vec::new();
        for _ in 0..ticks {
            all.extend(c.step(0, o));
        }
        all
    }

    #[test]
    fn default_config_is_soda_and_valid() {
        let c = ContentionConfig::default();
        assert_eq!(c.membw_threshold, 0.75);
        assert_eq!(c.mode, Mode::Enforce);
        c.validate().unwrap();
        let bad = ContentionConfig {
            membw_calm: 0.8,
            ..ContentionConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "membw_calm");
        let bad = ContentionConfig {
            pressure_ticks: 0,
            ..ContentionConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "pressure_ticks");
        let bad = ContentionConfig {
            membw_threshold: f64::NAN,
            ..ContentionConfig::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("membw_threshold"));
        let bad = ContentionConfig {
            max_calm_ticks: 2,
            ..ContentionConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "max_calm_ticks");
        let toml: ContentionConfig =
            toml::from_str("mode = \"advise\"\nmembw_threshold = 0.8\npressure_ticks = 5\n")
                .unwrap();
        assert_eq!(toml.mode, Mode::Advise);
        assert_eq!(toml.pressure_ticks, 5);
        assert_eq!(toml.calm_ticks, 10);
        assert!(toml::from_str::<ContentionConfig>("threshold = 1\n").is_err());
    }

    #[test]
    fn intel_mba_ladder_steps_by_granularity_to_min_bandwidth() {
        let c = ContentionConfig::default();
        let ladder = MbaLadder::new(intel_caps(), &c).unwrap();
        let values: Vec<u32> = (0..=ladder.max_level(0))
            .map(|l| ladder.value(0, l))
            .collect();
        assert_eq!(values, [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]);
        assert_eq!(ladder.max_level(0), 9);
        assert_eq!(ladder.value(0, 50), 10, "never below the floor");

        // A step finer than bandwidth_gran rounds up to it; a coarse floor stops early.
        let mut caps = intel_caps();
        caps.bandwidth_gran = 20;
        caps.min_bandwidth = 20;
        let c = ContentionConfig {
            mba_step_percent: 5,
            mba_floor_percent: 30,
            ..ContentionConfig::default()
        };
        let ladder = MbaLadder::new(caps, &c).unwrap();
        let values: Vec<u32> = (0..=ladder.max_level(1))
            .map(|l| ladder.value(1, l))
            .collect();
        // 30% rounds up to 40 (a multiple of 20).
        assert_eq!(values, [100, 80, 60, 40]);
        for v in values {
            assert_eq!(v % 20, 0);
        }
    }

    #[test]
    fn amd_mba_ladder_is_absolute_per_domain() {
        let mut caps = amd_caps();
        caps.default_schemata.insert(3, 1024);
        let ladder = MbaLadder::new(caps, &ContentionConfig::default()).unwrap();
        let values: Vec<u32> = (0..=ladder.max_level(0))
            .map(|l| ladder.value(0, l))
            .collect();
        assert_eq!(
            values,
            [2048, 1844, 1639, 1434, 1229, 1024, 820, 615, 410, 205]
        );
        // min_bandwidth 0 on AMD: the configured floor keeps a job from being starved.
        assert_eq!(ladder.floor(0), 205);
        assert_eq!(ladder.value(3, 1), 922);
        assert_eq!(ladder.floor(3), 103);
    }

    #[test]
    fn mba_mbps_mount_falls_back_to_cores() {
        let mut caps = intel_caps();
        caps.unit = MbaUnit::MegabytesPerSecond;
        let mut c = ContentionEliminator::new(config(1, 5), Some(caps));
        assert!(c.mba_ladder().is_none());
        let o = obs(
            Some(0.9),
            vec![training(1), lodger(2, Role::Batch, 8, Some(5e9))],
        );
        let a = c.step(0, &o);
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
        assert!(c
            .detection()
            .unwrap()
            .mba_unused
            .as_ref()
            .unwrap()
            .contains("mba_MBps"));
    }

    #[test]
    fn halving_sequence_and_floors() {
        assert_eq!(
            (0..=max_halvings(6, 1))
                .map(|l| halved_cores(6, l, 1))
                .collect::<Vec<_>>(),
            [6, 3, 2, 1]
        );
        assert_eq!(
            (0..=max_halvings(16, 2))
                .map(|l| halved_cores(16, l, 2))
                .collect::<Vec<_>>(),
            [16, 8, 4, 2]
        );
        assert_eq!(max_halvings(1, 1), 0);
        assert_eq!(
            max_halvings(2, 4),
            0,
            "a job at or under the floor is not cut"
        );
        assert_eq!(halved_cores(2, 3, 4), 2);
        assert_eq!(halved_cores(5, 40, 1), 1);
    }

    #[test]
    fn threshold_needs_k_consecutive_ticks_and_the_band_resets_the_run() {
        let mut c = ContentionEliminator::new(config(3, 10), Some(intel_caps()));
        let jobs = vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))];
        let hot = obs(Some(0.80), jobs.clone());
        let band = obs(Some(0.70), jobs.clone());
        assert!(run(&mut c, 2, &hot).is_empty());
        // A tick in the band (between calm 0.60 and threshold 0.75) breaks the run.
        assert!(c.step(0, &band).is_empty());
        assert!(run(&mut c, 2, &hot).is_empty());
        let a = c.step(0, &hot);
        assert_eq!(a.len(), 2, "one action per L3 domain: {a:?}");
        assert_eq!(
            a[0].mechanism,
            Mechanism::Mba {
                group: MbaGroup::Lodgers,
                domain: 0,
                value: 90
            }
        );
        assert_eq!(a[1].level, 1);
        assert!(
            a[0].evidence.contains("80% of peak, threshold 75%"),
            "{}",
            a[0].evidence
        );
        assert!(
            a[0].evidence.contains("j2 (batch 4.00 GB/s)"),
            "{}",
            a[0].evidence
        );
        assert!(a[0].evidence.contains("protecting j1"), "{}", a[0].evidence);
        // Exactly at the threshold counts as pressure.
        assert!(run(&mut c, 2, &obs(Some(0.75), jobs.clone())).is_empty());
        assert_eq!(c.step(0, &obs(Some(0.75), jobs)).len(), 2);
        assert_eq!(
            c.throttles().mba[&MbaGroup::Lodgers],
            BTreeMap::from([(0, 80), (1, 80)])
        );
    }

    #[test]
    fn mba_steps_down_to_min_then_halves_then_online_last() {
        let mut c = ContentionEliminator::new(config(1, 10), Some(intel_caps()));
        let jobs = vec![
            training(1),
            lodger(2, Role::Batch, 4, Some(1e9)),
            lodger(3, Role::Offline, 8, Some(3e9)),
            lodger(4, Role::Online, 2, Some(9e9)),
        ];
        let hot = obs(Some(0.95), jobs.clone());
        for expected in [90, 80, 70, 60, 50, 40, 30, 20, 10] {
            let a = c.step(0, &hot);
            // Two members × two domains.
            assert_eq!(a.len(), 4, "{a:?}");
            assert!(a.iter().all(|x| matches!(
                x.mechanism,
                Mechanism::Mba { group: MbaGroup::Lodgers, value, .. } if value == expected
            )));
        }
        // MBA at min_bandwidth: core halving of the top-ranked lodger (j3 by bandwidth, although
        // the online j4 uses more), until the floor, then the next.
        let cores: Vec<(String, u32)> = (0..5)
            .map(|_| {
                let a = c.step(0, &hot);
                assert_eq!(a.len(), 1, "{a:?}");
                let Mechanism::Cores { count } = a[0].mechanism else {
                    panic!("{a:?}")
                };
                (a[0].job.to_string(), count)
            })
            .collect();
        assert_eq!(
            cores,
            [
                ("j3".into(), 4),
                ("j3".into(), 2),
                ("j3".into(), 1),
                ("j2".into(), 2),
                ("j2".into(), 1)
            ]
        );
        // Only now online inference, whose SLO holds.
        let a = c.step(0, &hot);
        assert!(a.iter().all(|x| x.job == id(4)));
        assert!(matches!(
            a[0].mechanism,
            Mechanism::Mba {
                group: MbaGroup::Online,
                value: 90,
                ..
            }
        ));
        let t = c.throttles();
        assert_eq!(t.cores[&id(3)], 1);
        assert!(!t.cores.contains_key(&id(1)));
        assert!(c.detection().unwrap().pressured);
    }

    #[test]
    fn online_is_throttled_only_while_its_slo_holds() {
        let mut c = ContentionEliminator::new(config(1, 10), None);
        let mut online = lodger(4, Role::Online, 4, Some(9e9));
        let hot = |online: &JobObservation| obs(Some(0.9), vec![training(1), online.clone()]);
        // SLO unknown: not throttled.
        online.slo_met = None;
        assert!(c.step(0, &hot(&online)).is_empty());
        assert!(c.detection().unwrap().exhausted);
        online.slo_met = Some(true);
        let a = c.step(0, &hot(&online));
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 2 });
        // The SLO breaks: the step comes back at once, although pressure stays, and no new one.
        online.slo_met = Some(false);
        let a = c.step(0, &hot(&online));
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
        assert!(
            a[0].evidence.contains("SLO of j4 not met"),
            "{}",
            a[0].evidence
        );
        assert_eq!(a[1].mechanism, Mechanism::Release);
        assert!(c.throttles().is_empty());
        assert!(c.step(0, &hot(&online)).is_empty());
    }

    #[test]
    fn gives_back_stepwise_after_calm_and_backs_off_on_relapse() {
        let mut c = ContentionEliminator::new(config(2, 4), Some(intel_caps()));
        let jobs = vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))];
        let hot = obs(Some(0.9), jobs.clone());
        let cool = obs(Some(0.3), jobs.clone());
        run(&mut c, 4, &hot);
        assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 80);
        // Three calm ticks: nothing; the fourth gives one step back.
        assert!(run(&mut c, 3, &cool).is_empty());
        let a = c.step(0, &cool);
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|x| x.level == 1));
        assert!(
            a[0].evidence.contains("calm for 4 ticks"),
            "{}",
            a[0].evidence
        );
        assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 90);
        // Pressure returns at once: a relapse. The step is taken again and the next give-back
        // needs twice the calm.
        run(&mut c, 2, &hot);
        assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 80);
        assert_eq!(c.detection().unwrap().calm_needed, 8);
        assert!(run(&mut c, 7, &cool).is_empty());
        assert_eq!(c.step(0, &cool).len(), 2);
        // The last step back releases the job.
        assert!(run(&mut c, 7, &cool).is_empty());
        let a = c.step(0, &cool);
        assert_eq!(a.len(), 3, "{a:?}");
        assert_eq!(a[2].mechanism, Mechanism::Release);
        assert_eq!(a[2].job, id(2));
        assert!(c.throttles().is_empty());
        // Calm with nothing held forgives the relapse.
        run(&mut c, 8, &cool);
        assert_eq!(c.detection().unwrap().calm_needed, 4);
    }

    #[test]
    fn oscillating_pressure_does_not_flap() {
        // Pressure for 2 ticks, calm for 4, over and over: without backoff this would throttle
        // and release every 6 ticks.
        let mut c = ContentionEliminator::new(config(2, 4), Some(intel_caps()));
        let jobs = vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))];
        let hot = obs(Some(0.9), jobs.clone());
        let cool = obs(Some(0.3), jobs.clone());
        let mut give_backs = 0;
        for _ in 0..40 {
            run(&mut c, 2, &hot);
            if !run(&mut c, 4, &cool).is_empty() {
                give_backs += 1;
            }
        }
        // The first give-back is followed by a relapse; from then on 4 calm ticks are too few:
        // the step is kept, and the throttle deepens while pressure keeps coming back.
        assert_eq!(give_backs, 1);
        assert!(c.detection().unwrap().calm_needed >= 8);
        assert!(c.throttles().mba[&MbaGroup::Lodgers][&0] <= 50);
    }

    #[test]
    fn pressured_domains_only_when_known() {
        let mut c = ContentionEliminator::new(config(1, 10), Some(amd_caps()));
        let mut o = obs(
            Some(0.8),
            vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
        );
        if let Some(m) = o.membw.as_mut() {
            m.domain_fractions = BTreeMap::from([(0, 0.2), (1, 0.95), (2, 0.9), (3, 0.1)]);
        }
        let a = c.step(0, &o);
        let domains: Vec<u32> = a
            .iter()
            .map(|x| match x.mechanism {
                Mechanism::Mba { domain, .. } => domain,
                _ => panic!("{x:?}"),
            })
            .collect();
        assert_eq!(domains, [1, 2]);
        assert_eq!(
            c.throttles().mba[&MbaGroup::Lodgers],
            BTreeMap::from([(0, 2048), (1, 1844), (2, 1844), (3, 2048)])
        );
    }

    #[test]
    fn ranking_by_bandwidth_else_cache_misses() {
        let mut c = ContentionEliminator::new(config(1, 10), None);
        let mut a = lodger(2, Role::Batch, 8, None);
        let mut b = lodger(3, Role::Batch, 8, None);
        a.cache_misses_per_s = Some(1e6);
        b.cache_misses_per_s = Some(5e7);
        let acts = c.step(0, &obs(Some(0.9), vec![training(1), a.clone(), b.clone()]));
        assert_eq!(c.detection().unwrap().ranked_by, RankedBy::CacheMisses);
        assert_eq!(acts[0].job, id(3), "most misses halved first");
        assert!(acts[0].evidence.contains("misses/s"));
        a.membw_bytes_per_s = Some(8e9);
        b.membw_bytes_per_s = Some(1e9);
        c.step(0, &obs(Some(0.9), vec![training(1), a.clone(), b.clone()]));
        let d = c.detection().unwrap();
        assert_eq!(d.ranked_by, RankedBy::MemoryBandwidth);
        assert_eq!(d.suspects[0].job, id(2));
        // Nothing measured: batch before offline before online, then by id.
        let x = lodger(9, Role::Offline, 8, None);
        let y = lodger(10, Role::Batch, 8, None);
        let z = lodger(8, Role::Online, 8, None);
        let mut c = ContentionEliminator::new(config(1, 10), None);
        c.step(0, &obs(Some(0.9), vec![training(1), x, y, z]));
        let d = c.detection().unwrap();
        assert_eq!(d.ranked_by, RankedBy::Unranked);
        let order: Vec<&str> = d.suspects.iter().map(|s| s.job.as_str()).collect();
        assert_eq!(order, ["j10", "j9", "j8"]);
    }

    #[test]
    fn gpu_drop_detection_with_learnt_baseline() {
        let mut c = ContentionEliminator::new(config(3, 5), None);
        let train = |p: f64| {
            let mut t = training(1);
            t.progress = Some(p);
            t
        };
        // Alone: learns 10 ticks of ~100 it/s, noise max(3σ, 5%) = 5.
        for p in [
            100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 100.0, 100.0, 101.0, 99.0,
        ] {
            assert!(c.step(0, &obs(None, vec![train(p)])).is_empty());
        }
        let b = c.status().baselines[&id(1)];
        assert!((b.level - 100.0).abs() < 1e-9);
        assert!((b.noise - 5.0).abs() < 1e-9, "{b:?}");
        let hog = lodger(2, Role::Batch, 8, None);
        // Within the noise: nothing.
        assert!(run(&mut c, 5, &obs(None, vec![train(96.0), hog.clone()])).is_empty());
        // A drop beyond the noise for 3 ticks: halve the hog.
        let slow = obs(None, vec![train(80.0), hog.clone()]);
        assert!(run(&mut c, 2, &slow).is_empty());
        let a = c.step(0, &slow);
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
        assert!(
            a[0].evidence
                .contains("j1 progress 80.0 below its stable 100.0"),
            "{}",
            a[0].evidence
        );
        match &c.detection().unwrap().signal {
            Signal::TrainingProgress { dropped } => assert_eq!(dropped[0].job, id(1)),
            s => panic!("{s:?}"),
        }
        // Recovered (because of the throttle): calm, then the cores come back.
        let ok = obs(None, vec![train(99.0), hog.clone()]);
        assert!(run(&mut c, 4, &ok).is_empty());
        let a = c.step(0, &ok);
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 8 });
        assert_eq!(a[1].mechanism, Mechanism::Release);
        // A slowdown with no lodger running is not contention.
        let mut c = ContentionEliminator::new(config(1, 5), None);
        let mut t = train(50.0);
        t.baseline = Some(Baseline {
            level: 100.0,
            noise: 5.0,
        });
        assert!(run(&mut c, 3, &obs(None, vec![t.clone()])).is_empty());
        assert!(!c.detection().unwrap().pressured);
        assert_eq!(c.step(0, &obs(None, vec![t, hog])).len(), 1);
    }

    /// A job's first samples are its start-up: learnt from a window that slides while the job
    /// is alone, they age out, and a drop that matters is still seen.
    #[test]
    fn a_start_up_transient_ages_out_of_the_learnt_level() {
        let mut c = ContentionEliminator::new(config(3, 5), None);
        let train = |p: f64| {
            let mut t = training(1);
            t.progress = Some(p);
            t
        };
        // Two records of start-up, repeated as sensing passes repeat a record, then steady.
        let alone: Vec<f64> = [30.0; 5]
            .into_iter()
            .chain([60.0; 5])
            .chain([100.0, 99.0, 101.0, 100.0, 100.0].repeat(2))
            .collect();
        for p in alone {
            assert!(c.step(0, &obs(None, vec![train(p)])).is_empty());
        }
        let b = c.status().baselines[&id(1)];
        assert!((b.level - 100.0).abs() < 1e-9, "{b:?}");
        assert!((b.noise - 5.0).abs() < 1e-9, "{b:?}");
        // 80 is a 20 % drop: pressure (a level learnt from the first ten samples, 45 with a
        // noise of 3 x 15.8, would have hidden it).
        let hog = lodger(2, Role::Offline, 2, None);
        let a = run(&mut c, 3, &obs(None, vec![train(80.0), hog.clone()]));
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
        // While a lodger runs nothing is learnt: the level stays.
        assert_eq!(c.status().baselines[&id(1)], b);
        // Alone again, a new steady level replaces it, window by window.
        for _ in 0..10 {
            c.step(0, &obs(None, vec![train(90.0)]));
        }
        assert!((c.status().baselines[&id(1)].level - 90.0).abs() < 1e-9);
    }

    #[test]
    fn advise_mode_reports_and_applies_nothing() {
        let mut cfg = config(1, 10);
        cfg.mode = Mode::Advise;
        let mut c = ContentionEliminator::new(cfg, Some(intel_caps()));
        let a = c.step(
            0,
            &obs(
                Some(0.9),
                vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
            ),
        );
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|x| x.advisory));
        assert!(c.throttles().is_empty());
        assert_eq!(c.decided().mba[&MbaGroup::Lodgers][&0], 90);
        c.set_mode(Mode::Enforce);
        assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&1], 90);
    }

    #[test]
    fn departures_joiners_and_no_training() {
        let mut c = ContentionEliminator::new(config(1, 10), Some(intel_caps()));
        let hot = |jobs| obs(Some(0.9), jobs);
        c.step(
            0,
            &hot(vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))]),
        );
        // j5 joins the throttled group: it is told.
        let a = c.step(
            0,
            &obs(
                Some(0.7),
                vec![
                    training(1),
                    lodger(2, Role::Batch, 8, Some(4e9)),
                    lodger(5, Role::Offline, 8, Some(1e9)),
                ],
            ),
        );
        assert_eq!(a.len(), 2, "{a:?}");
        assert!(a.iter().all(|x| x.job == id(5) && x.level == 1));
        assert!(a[0].evidence.contains("joined lodger-lodgers"));
        // j2 leaves: released; j5 stays throttled.
        let a = c.step(
            0,
            &obs(
                Some(0.7),
                vec![training(1), lodger(5, Role::Offline, 8, Some(1e9))],
            ),
        );
        assert_eq!(a.len(), 1);
        assert_eq!(
            (a[0].job.clone(), a[0].mechanism.clone()),
            (id(2), Mechanism::Release)
        );
        assert!(a[0].evidence.contains("job gone"));
        // The training job leaves: every throttle lifted at once.
        let a = c.step(
            0,
            &obs(Some(0.9), vec![lodger(5, Role::Offline, 8, Some(1e9))]),
        );
        assert_eq!(a.len(), 3, "{a:?}");
        assert_eq!(a[2].mechanism, Mechanism::Release);
        assert!(a[0].evidence.contains("no training job"));
        assert!(c.throttles().is_empty());
        assert!(c.detection().is_none());
    }

    #[test]
    fn a_lodger_re_registered_as_training_is_released_at_once() {
        let mut c = ContentionEliminator::new(config(1, 10), None);
        c.step(
            0,
            &obs(
                Some(0.9),
                vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
            ),
        );
        assert_eq!(c.throttles().cores[&id(2)], 4);
        let mut now_training = training(2);
        now_training.cores = 8;
        let a = c.step(0, &obs(Some(0.9), vec![training(1), now_training]));
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].mechanism, Mechanism::Release);
        assert!(c.throttles().is_empty());
    }

    /// The agent enforces a core cut by capping the job's instances, and then observes the job
    /// on the capped count. That observation is the throttle's own doing: it must neither lift
    /// the cut (flapping: cut, released next tick, cut again) nor be halved again (a spiral to
    /// the floor in one pressured stretch).
    #[test]
    fn a_cut_job_observed_at_its_capped_allocation_keeps_its_throttle() {
        let mut c = ContentionEliminator::new(config(2, 3), None);
        let hot = |cores| {
            obs(
                Some(0.9),
                vec![training(1), lodger(2, Role::Offline, cores, None)],
            )
        };
        let cool = |cores| {
            obs(
                Some(0.3),
                vec![training(1), lodger(2, Role::Offline, cores, None)],
            )
        };
        // Halved 8 -> 4 after two pressured ticks; the enforcer then shows 4 cores.
        let a = run(&mut c, 2, &hot(8));
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
        assert!(a[0].evidence.contains("halved 8 -> 4"), "{}", a[0].evidence);
        // The capped allocation: no action, the cut holds at level 1 (not released, not cut
        // again from 4).
        let a = c.step(0, &hot(4));
        assert!(a.is_empty(), "{a:?}");
        assert_eq!(c.throttles().cores[&id(2)], 4);
        assert_eq!(c.status().core_levels[&id(2)], 1);
        // The next step halves from the job's own allocation, 8: level 2 = 2 cores.
        let a = c.step(0, &hot(4));
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(
            (a[0].mechanism.clone(), a[0].level),
            (Mechanism::Cores { count: 2 }, 2)
        );
        assert!(a[0].evidence.contains("halved 4 -> 2"), "{}", a[0].evidence);
        // Down to the floor (1 core, level 3), counted from 8 though the job shows 2.
        let a = run(&mut c, 2, &hot(2));
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
        assert_eq!(a[0].level, 3);
        assert!(run(&mut c, 4, &hot(1)).is_empty(), "at the floor");
        assert!(c.detection().unwrap().exhausted);
        // Calm: the steps come back one by one, while the job shows each capped count.
        let mut counts = Vec::new();
        let mut shown = 1;
        for _ in 0..40 {
            for a in c.step(0, &cool(shown)) {
                if let Mechanism::Cores { count } = a.mechanism {
                    counts.push(count);
                    shown = count;
                }
            }
        }
        assert_eq!(counts, [2, 4, 8]);
        assert!(c.throttles().is_empty());
    }

    /// Two cores halved to one, as on a two-CPU node: the cut holds while the enforcer shows
    /// one core, and comes back after the calm ticks.
    #[test]
    fn two_cores_halved_to_one_hold_until_calm() {
        let mut c = ContentionEliminator::new(config(3, 5), None);
        let hot = |cores| {
            obs(
                Some(0.9),
                vec![training(1), lodger(2, Role::Offline, cores, None)],
            )
        };
        let a = run(&mut c, 3, &hot(2));
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
        let a = run(&mut c, 20, &hot(1));
        assert!(a.is_empty(), "held at the floor without flapping: {a:?}");
        assert_eq!(c.throttles().cores[&id(2)], 1);
        let cool = obs(
            Some(0.3),
            vec![training(1), lodger(2, Role::Offline, 1, None)],
        );
        assert!(run(&mut c, 4, &cool).is_empty());
        let a = c.step(0, &cool);
        assert_eq!(a.len(), 2, "{a:?}");
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 2 });
        assert_eq!(a[1].mechanism, Mechanism::Release);
    }

    #[test]
    fn allocation_change_keeps_the_level() {
        let mut c = ContentionEliminator::new(config(1, 10), None);
        c.step(
            0,
            &obs(
                Some(0.9),
                vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
            ),
        );
        let a = c.step(
            0,
            &obs(
                Some(0.7),
                vec![training(1), lodger(2, Role::Batch, 16, Some(4e9))],
            ),
        );
        assert_eq!(a[0].mechanism, Mechanism::Cores { count: 8 });
        assert_eq!(a[0].level, 1);
        assert_eq!(c.throttles().cores[&id(2)], 8);
    }

    // -----------------------------------------------------------------------------------------
    // Properties.

    fn role() -> impl Strategy<Value = Role> {
        prop_oneof![
            Just(Role::Training),
            Just(Role::Batch),
            Just(Role::Offline),
            Just(Role::Online)
        ]
    }

    /// One generated job: seq, role, cores, bandwidth, progress, SLO met.
    type JobInput = (u64, Role, u32, Option<f64>, Option<f64>, Option<bool>);

    #[derive(Debug, Clone)]
    struct TickInput {
        fraction: Option<f64>,
        jobs: Vec<JobInput>,
    }

    fn ticks() -> impl Strategy<Value = Vec<TickInput>> {
        let job = (
            1u64..8,
            role(),
            0u32..40,
            proptest::option::of(0.0f64..2e10),
            proptest::option::of(0.0f64..200.0),
            proptest::option::of(any::<bool>()),
        );
        let tick = (
            proptest::option::of(0.0f64..1.2),
            proptest::collection::vec(job, 0..6),
        )
            .prop_map(|(fraction, jobs)| TickInput { fraction, jobs });
        proptest::collection::vec(tick, 1..60)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn never_throttles_training_and_stays_in_bounds(
            inputs in ticks(),
            mba in proptest::option::of(any::<bool>()),
            advise in any::<bool>(),
            pressure in 1u32..4,
            calm in 1u32..6,
            min_cores in 1u32..4,
        ) {
            let caps = mba.map(|intel| if intel { intel_caps() } else { amd_caps() });
            let cfg = ContentionConfig {
                mode: if advise { Mode::Advise } else { Mode::Enforce },
                pressure_ticks: pressure,
                calm_ticks: calm,
                min_cores,
                ..ContentionConfig::default()
            };
            let mut c = ContentionEliminator::new(cfg, caps.clone());
            // The most cores each job has shown: a cut counts from a count it showed (a cut job
            // may show fewer, capped by its own throttle).
            let mut most_cores: BTreeMap<JobId, u32> = BTreeMap::new();
            for (n, input) in inputs.iter().enumerate() {
                let jobs: Vec<JobObservation> = input
                    .jobs
                    .iter()
                    .map(|&(seq, role, cores, bw, progress, slo)| {
                        let mut j = JobObservation::new(id(seq), role, cores);
                        j.membw_bytes_per_s = bw;
                        j.progress = progress;
                        j.slo_met = slo;
                        j
                    })
                    .collect();
                let o = obs(input.fraction, jobs.clone());
                let before = c.status();
                let actions = c.step(u64::try_from(n).unwrap(), &o);
                // The role each job has this tick (first listing wins, as in step).
                let mut roles: BTreeMap<JobId, &JobObservation> = BTreeMap::new();
                for j in &jobs {
                    roles.entry(j.id.clone()).or_insert(j);
                }
                for j in roles.values() {
                    let most = most_cores.entry(j.id.clone()).or_insert(0);
                    *most = (*most).max(j.cores);
                }
                for a in &actions {
                    prop_assert_eq!(a.advisory, advise);
                    if a.mechanism != Mechanism::Release {
                        let j = roles.get(&a.job);
                        prop_assert!(j.is_some(), "action for absent {}", a.job);
                        prop_assert!(j.unwrap().role != Role::Training, "training throttled: {:?}", a);
                    }
                }
                let t = c.decided();
                if advise {
                    prop_assert!(c.throttles().is_empty());
                }
                for (job, &count) in &t.cores {
                    let j = roles.get(job);
                    prop_assert!(j.is_some(), "cut for absent {}", job);
                    let j = j.unwrap();
                    prop_assert!(j.role != Role::Training);
                    let most = most_cores.get(job).copied().unwrap_or(0);
                    prop_assert!(count >= min_cores, "{} cut to {} below the floor", job, count);
                    prop_assert!(count < most, "{} cut to {} of at most {} shown", job, count, most);
                }
                if let Some(caps) = &caps {
                    let ladder = MbaLadder::new(caps.clone(), c.config()).unwrap();
                    for (group, values) in &t.mba {
                        prop_assert!(roles.values().any(|j| j.role.mba_group() == Some(*group)));
                        for (&d, &v) in values {
                            prop_assert!(v >= ladder.floor(d) && v <= ladder.unthrottled(d));
                            prop_assert_eq!(caps.valid_value(v), v);
                        }
                    }
                } else {
                    prop_assert!(t.mba.is_empty());
                }
                // An online job whose SLO does not hold is never throttled further.
                let after = c.status();
                for j in roles.values() {
                    if j.role != Role::Online || j.slo_met == Some(true) {
                        continue;
                    }
                    let was = before.core_levels.get(&j.id).copied().unwrap_or(0);
                    let is = after.core_levels.get(&j.id).copied().unwrap_or(0);
                    prop_assert!(is <= was, "{} cut deeper with a failing SLO", j.id);
                    let online = |s: &ContentionStatus, d: u32| {
                        s.mba_levels.get(&MbaGroup::Online).and_then(|l| l.get(&d)).copied()
                    };
                    for d in 0..4 {
                        prop_assert!(
                            online(&after, d).unwrap_or(0) <= online(&before, d).unwrap_or(0),
                            "online group throttled deeper with {} failing its SLO", j.id
                        );
                    }
                }
                // Without training nothing is throttled.
                if !roles.values().any(|j| j.role == Role::Training) {
                    prop_assert!(t.is_empty());
                }
            }
        }
    }
}
