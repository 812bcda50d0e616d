//! config: the schema of `/etc/lodger/lodger.toml`, its defaults and its validation, with errors
//! that name the file, the line and the key. Touches nothing but the one file it is asked to load.
//!
//! `config/lodger.toml` in the source tree is the documented default; `Config::default()` must
//! equal parsing it (a test holds the two together). Loading happens in two steps: the TOML is
//! deserialized into private `Raw*` structs whose values keep their byte spans, then each value
//! is checked and turned into the public, plain types. Checks that need the node (which CPUs and
//! NUMA nodes exist) run later, once the topology is read: `Config::resolve_reserved` and
//! `Config::check_gpu_overrides`.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Range, RangeInclusive};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::cpuset::CpuSet;

/// Where lodgerd looks for its config unless told otherwise.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/lodger/lodger.toml";

/// Valid `training.rt_priority`: the kernel's SCHED_RR range.
pub const RT_PRIORITY_RANGE: RangeInclusive<i64> = 1..=99;
/// Valid `agent.interval_ms`. Below 10 ms the agent would spend its time sensing; above a
/// minute it would react to nothing.
pub const INTERVAL_MS_RANGE: RangeInclusive<i64> = 10..=60_000;
/// The kernel's default `cpu.rt_period_us`; an RT budget must stay below it.
pub const RT_PERIOD_US: u64 = 1_000_000;
/// Valid `training.grant_rt_budget_us`: 0 (never grant) up to just below the period.
pub const RT_BUDGET_US_RANGE: RangeInclusive<i64> = 0..=999_999;
/// Longest group name accepted (shadow-utils' default limit).
const GROUP_NAME_MAX: usize = 32;
/// Longest cgroup directory name (NAME_MAX).
const CGROUP_NAME_MAX: usize = 255;
/// GPU indices and NUMA node ids accepted in `[[node.gpu]]` before the node is known. The
/// kernel's MAX_NUMNODES is at most 1024.
const GPU_INDEX_RANGE: RangeInclusive<i64> = 0..=255;
const NUMA_NODE_RANGE: RangeInclusive<i64> = 0..=1023;
/// Valid `sense.interval_ms`: NVML refreshes at most every 1/6 s, so faster is no use.
pub const SENSE_INTERVAL_MS_RANGE: RangeInclusive<i64> = 200..=60_000;
/// Valid `sense.perf_max_fds`.
pub const PERF_MAX_FDS_RANGE: RangeInclusive<i64> = 0..=1_048_576;
/// Valid `sense.history`.
pub const HISTORY_RANGE: RangeInclusive<i64> = 1..=86_400;

// ---------------------------------------------------------------------------------------------
// The typed configuration.

/// The whole configuration. Build it with [`Config::load`], [`Config::parse`] or
/// [`Config::default`]. Equality compares the settings only, not where they were read from.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Config {
    pub node: NodeConfig,
    pub training: TrainingConfig,
    pub agent: AgentConfig,
    pub api: ApiConfig,
    pub cgroup: CgroupConfig,
    pub log: LogConfig,
    pub sense: SenseConfig,
    pub metrics: MetricsConfig,
    pub inference: InferenceConfig,
    pub rightsize: RightsizeConfig,
    pub contention: ContentionSection,
    pub network: NetworkSection,
    /// Where each value came from, so later checks can point at the line.
    #[serde(skip)]
    source: Source,
}

/// `[node]`: what lodger must know about the machine beyond what it reads from sysfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeConfig {
    pub reserved_cpus: ReservedCpus,
    pub sysfs_root: PathBuf,
    pub proc_root: PathBuf,
    /// `[[node.gpu]]`: GPU locality overrides, each index at most once.
    pub gpu: Vec<GpuOverride>,
}

/// `node.reserved_cpus`: CPUs no job is ever placed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReservedCpus {
    /// CPU 0 and its SMT siblings; see [`Config::resolve_reserved`].
    Auto,
    /// Exactly these CPUs (possibly none).
    List(CpuSet),
}

/// One `[[node.gpu]]` table: the NUMA node GPU `index` is attached to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GpuOverride {
    pub index: u32,
    pub numa_node: u32,
}

/// `[training]`: how training jobs are run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrainingConfig {
    /// SCHED_RR priority, 1..=99 (an `i32` because that is what `sched_param` takes).
    pub rt_priority: i32,
    /// Use SCHED_RR even when `kernel.sched_rt_runtime_us` is -1.
    pub allow_unthrottled_rt: bool,
    /// As written in the file: 0 means never; see [`TrainingConfig::grant_rt_budget_us`].
    pub grant_rt_budget_us: u64,
}

/// `[agent]`: the loop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AgentConfig {
    pub interval_ms: u64,
    pub state_dir: PathBuf,
}

/// `[api]`: the D-Bus surface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiConfig {
    /// Root and members of this group may make mutating calls.
    pub group: String,
    pub bus: BusKind,
}

/// `[cgroup]`: where and how lodger makes its cgroups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CgroupConfig {
    pub driver: CgroupDriver,
    pub root: PathBuf,
    /// A single path component under `root` (in each v1 hierarchy, or in the v2 tree).
    pub parent: String,
    pub pid_jobs: PidJobs,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogConfig {
    pub level: LogLevel,
}

/// `[sense]`: what lodger measures and how often.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SenseConfig {
    /// How often the sensing thread samples, in milliseconds.
    pub interval_ms: u64,
    pub gpu: GpuSourceChoice,
    /// Where the bundled training emulator publishes its emulated GPU's busy fraction.
    pub emulated_gpu_dir: PathBuf,
    /// Hardware counters (IPC, cache misses) per job.
    pub perf: bool,
    /// Most perf file descriptors lodger may hold; jobs beyond the budget go unmeasured.
    pub perf_max_fds: u64,
    pub resctrl_root: PathBuf,
    /// Node memory-bandwidth peak in bytes/s; 0: unknown (use the highest seen).
    pub membw_peak_bytes_per_s: u64,
    /// Sensing passes kept in memory (per node; `lodgerctl top` and the API show the latest).
    pub history: u64,
}

/// `[inference]`: how lodger runs inference instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InferenceConfig {
    /// How long each layout probe of an online job is measured, in seconds.
    pub probe_seconds: u64,
    /// Between SIGTERM and SIGKILL when an instance is stopped, in seconds.
    pub stop_grace_seconds: u64,
}

impl Default for InferenceConfig {
    fn default() -> Self {
        Self {
            probe_seconds: 10,
            stop_grace_seconds: 10,
        }
    }
}

/// `[rightsize]`: SODA §V-B, the core count of training jobs from their GPU utilization.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RightsizeConfig {
    pub mode: RightsizeMode,
    /// Left alone after registration before the first measurement window, in seconds.
    pub warmup_seconds: u64,
    /// One measurement window, in seconds.
    pub window_seconds: u64,
    /// May a job get fewer cores than it asked for (never fewer than one per GPU)?
    pub shrink: bool,
    /// Cores of error accepted: tuning stops once the best count is known within this many.
    pub tolerance_cores: u32,
}

impl Default for RightsizeConfig {
    fn default() -> Self {
        Self {
            mode: RightsizeMode::Enforce,
            warmup_seconds: 180,
            window_seconds: 60,
            shrink: true,
            tolerance_cores: 1,
        }
    }
}

/// `[contention]`: SODA §V-E, throttling CPU jobs that slow training.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContentionSection {
    pub mode: RightsizeMode,
    /// Node memory bandwidth at or above this fraction of the peak is pressure.
    pub membw_threshold: f64,
    /// Consecutive pressured sensing passes before a throttle step.
    pub pressure_ticks: u32,
    /// Consecutive calm sensing passes before a step is given back.
    pub calm_ticks: u32,
}

impl Eq for ContentionSection {}

impl Default for ContentionSection {
    fn default() -> Self {
        Self {
            mode: RightsizeMode::Enforce,
            membw_threshold: 0.75,
            pressure_ticks: 3,
            calm_ticks: 10,
        }
    }
}

/// `[network]`: SODA §V-E network shaping while a multi-node training job runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkSection {
    /// The interfaces to shape (`[[network.link]]`); none: shaping is off.
    pub link: Vec<crate::enforce::tc::Link>,
    pub training_percent: u32,
    pub cpu_jobs_percent: u32,
    pub cpu_jobs_ceil_percent: u32,
    pub steering: NetSteering,
    pub replace_foreign_root: bool,
    /// The two-network option: CPU jobs' traffic goes out this (slower) interface while
    /// multi-node training runs, instead of being shaped; empty: off.
    pub cpu_jobs_interface: String,
    /// The next hop on that network; `None`: destinations are on its link.
    pub cpu_jobs_gateway: Option<std::net::Ipv4Addr>,
}

impl Default for NetworkSection {
    fn default() -> Self {
        let d = crate::enforce::tc::ShapingConfig::default();
        Self {
            link: Vec::new(),
            training_percent: d.training_percent,
            cpu_jobs_percent: d.cpu_jobs_percent,
            cpu_jobs_ceil_percent: d.cpu_jobs_ceil_percent,
            steering: NetSteering::Auto,
            replace_foreign_root: d.replace_foreign_root,
            cpu_jobs_interface: String::new(),
            cpu_jobs_gateway: None,
        }
    }
}

impl NetworkSection {
    /// The two-network option's slower network, when `cpu_jobs_interface` is set.
    pub fn slow_network(&self) -> Option<crate::enforce::route::SlowNetwork> {
        (!self.cpu_jobs_interface.is_empty()).then(|| crate::enforce::route::SlowNetwork {
            interface: self.cpu_jobs_interface.clone(),
            gateway: self.cpu_jobs_gateway,
        })
    }

    /// The shaping settings, or `None` when no interface is configured (shaping off).
    pub fn shaping(&self) -> Option<crate::enforce::tc::ShapingConfig> {
        if self.link.is_empty() {
            return None;
        }
        Some(crate::enforce::tc::ShapingConfig {
            links: self.link.clone(),
            training_percent: self.training_percent,
            cpu_jobs_percent: self.cpu_jobs_percent,
            cpu_jobs_ceil_percent: self.cpu_jobs_ceil_percent,
            replace_foreign_root: self.replace_foreign_root,
            ..crate::enforce::tc::ShapingConfig::default()
        })
    }
}

/// `[metrics]`: the Prometheus endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MetricsConfig {
    /// `host:port` to serve `/metrics` on; empty: off.
    pub listen: String,
}

impl SenseConfig {
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
}

impl MetricsConfig {
    /// The address to listen on, when the endpoint is on (checked at load).
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        self.listen.parse().ok()
    }
}

/// Declares a config enum whose TOML spelling is given per variant, with `NAMES`, `as_str`,
/// `from_name`, `Display` and serde in that spelling.
macro_rules! named_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every accepted spelling, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($text => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

named_enum! {
    /// `api.bus`: which D-Bus bus lodgerd serves on.
    BusKind {
        System => "system",
        /// For tests and development.
        Session => "session",
    }
}

named_enum! {
    /// `cgroup.driver`: which cgroup hierarchy lodger drives.
    CgroupDriver {
        /// Detect at start.
        Auto => "auto",
        V1 => "v1",
        V2 => "v2",
    }
}

named_enum! {
    /// `cgroup.pid_jobs`: how a job registered by pid is pinned to its CPUs.
    PidJobs {
        /// `Cgroup` on v1, `Affinity` on v2; see [`PidJobs::effective`].
        Auto => "auto",
        /// Move its processes into a cgroup lodger creates.
        Cgroup => "cgroup",
        /// Leave them where they are and set every thread's CPU affinity.
        Affinity => "affinity",
    }
}

named_enum! {
    /// `sense.gpu`: where GPU utilization comes from.
    GpuSourceChoice {
        /// NVML when the driver loads, else off (one log line says why).
        Auto => "auto",
        Nvml => "nvml",
        /// The bundled training emulator's published busy fraction (no real GPU).
        Emulated => "emulated",
        Off => "off",
    }
}

named_enum! {
    /// `network.steering`: how CPU jobs' packets reach their HTB class.
    NetSteering {
        /// tc filters where the kernel has the classifier, else nftables.
        Auto => "auto",
        /// v1: `cgroup` filter on `net_cls.classid`; v2: nftables mark + `fw` filter.
        TcFilter => "tc-filter",
        /// nftables sets the packets' priority to the class; no tc filter.
        Nft => "nft",
    }
}

impl NetSteering {
    pub fn to_steering(self) -> crate::enforce::tc::Steering {
        match self {
            NetSteering::Auto => crate::enforce::tc::Steering::Auto,
            NetSteering::TcFilter => crate::enforce::tc::Steering::TcFilter,
            NetSteering::Nft => crate::enforce::tc::Steering::Nft,
        }
    }
}

named_enum! {
    /// `rightsize.mode`.
    RightsizeMode {
        /// Resize training jobs' cpusets as the tuning decides.
        Enforce => "enforce",
        /// Compute and show the recommendation; change nothing.
        Advise => "advise",
        Off => "off",
    }
}

named_enum! {
    /// `log.level`. `as_str` is also a valid `tracing` filter directive.
    LogLevel {
        Error => "error",
        Warn => "warn",
        Info => "info",
        Debug => "debug",
        Trace => "trace",
    }
}

impl PidJobs {
    /// Resolves `Auto` for the hierarchy in use. On v2 a process belongs to its systemd unit's
    /// cgroup, and moving it out would break the unit's accounting and stop logic, so lodger
    /// pins by affinity there; on v1 the cpuset hierarchy is lodger's to arrange.
    pub fn effective(self, cgroup_v2: bool) -> PidJobs {
        match self {
            PidJobs::Auto if cgroup_v2 => PidJobs::Affinity,
            PidJobs::Auto => PidJobs::Cgroup,
            other => other,
        }
    }
}

impl TrainingConfig {
    /// The `cpu.rt_runtime_us` to grant a v1 cpu cgroup whose budget is 0, or `None` if lodger
    /// must never grant one.
    pub fn grant_rt_budget_us(&self) -> Option<u64> {
        (self.grant_rt_budget_us != 0).then_some(self.grant_rt_budget_us)
    }
}

impl AgentConfig {
    /// The agent's tick.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
}

impl NodeConfig {
    /// The NUMA node `[[node.gpu]]` declares for GPU `index`, if any.
    pub fn gpu_numa_node(&self, index: u32) -> Option<u32> {
        self.gpu
            .iter()
            .find(|g| g.index == index)
            .map(|g| g.numa_node)
    }
}

impl ReservedCpus {
    /// Reads the TOML spelling: `auto`, a cpulist, or the empty string for none.
    pub fn parse(text: &str) -> Result<Self, crate::cpuset::CpuListError> {
        if text.trim() == "auto" {
            Ok(ReservedCpus::Auto)
        } else {
            CpuSet::parse(text).map(ReservedCpus::List)
        }
    }
}

impl fmt::Display for ReservedCpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReservedCpus::Auto => f.write_str("auto"),
            ReservedCpus::List(set) => write!(f, "{set}"),
        }
    }
}

/// Serialized in its TOML spelling, so a dumped config reads like the file.
impl Serialize for ReservedCpus {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            reserved_cpus: ReservedCpus::Auto,
            sysfs_root: PathBuf::from("/sys"),
            proc_root: PathBuf::from("/proc"),
            gpu: Vec::new(),
        }
    }
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            rt_priority: 10,
            allow_unthrottled_rt: false,
            grant_rt_budget_us: 0,
        }
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1000,
            state_dir: PathBuf::from("/var/lib/lodger"),
        }
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            group: "lodger".to_string(),
            bus: BusKind::System,
        }
    }
}

impl Default for CgroupConfig {
    fn default() -> Self {
        Self {
            driver: CgroupDriver::Auto,
            root: PathBuf::from("/sys/fs/cgroup"),
            parent: "lodger".to_string(),
            pid_jobs: PidJobs::Auto,
        }
    }
}

impl Default for SenseConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1000,
            gpu: GpuSourceChoice::Auto,
            emulated_gpu_dir: PathBuf::from("/run/lodger/emulated-gpu"),
            perf: true,
            perf_max_fds: 65536,
            resctrl_root: PathBuf::from("/sys/fs/resctrl"),
            membw_peak_bytes_per_s: 0,
            history: 300,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: LogLevel::Info,
        }
    }
}

/// Settings only: two configs with the same values are equal wherever they were read from.
impl PartialEq for Config {
    fn eq(&self, other: &Self) -> bool {
        // Destructured so that a new section cannot be forgotten here.
        let Config {
            node,
            training,
            agent,
            api,
            cgroup,
            log,
            sense,
            metrics,
            inference,
            rightsize,
            contention,
            network,
            source: _,
        } = self;
        *node == other.node
            && *training == other.training
            && *agent == other.agent
            && *api == other.api
            && *cgroup == other.cgroup
            && *log == other.log
            && *sense == other.sense
            && *metrics == other.metrics
            && *inference == other.inference
            && *rightsize == other.rightsize
            && *contention == other.contention
            && *network == other.network
    }
}

impl Eq for Config {}

// ---------------------------------------------------------------------------------------------
// Errors.

/// A place in a config file. `path` is `None` for the built-in defaults; `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub path: Option<PathBuf>,
    pub line: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.path, self.line) {
            (Some(path), Some(line)) => write!(f, "{}:{line}", path.display()),
            (Some(path), None) => write!(f, "{}", path.display()),
            (None, _) => f.write_str("built-in defaults"),
        }
    }
}

/// Everything that can be wrong with a config. Each displays as one line starting with
/// `file:line:`, e.g. `/etc/lodger/lodger.toml:12: training.rt_priority: must be between 1 and
/// 99 (got 0)`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read config file: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Not valid TOML.
    #[error("{at}: invalid TOML: {message}")]
    Syntax { at: Location, message: String },
    /// A key (or table) given twice. `key` is the dotted path.
    #[error("{at}: {key}: duplicate key")]
    DuplicateKey { at: Location, key: String },
    /// A key the schema does not have. `table` is `[agent]`, `[[node.gpu]]`, or empty for the
    /// top level.
    #[error("{at}: unknown key '{key}' {}; expected one of {}", in_table(.table), .expected.join(", "))]
    UnknownKey {
        at: Location,
        table: String,
        key: String,
        expected: Vec<String>,
    },
    /// A value of the wrong type or out of its range. `key` is the dotted path, with array
    /// indices (`node.gpu[1].numa_node`).
    #[error("{at}: {key}: {message}")]
    Invalid {
        at: Location,
        key: String,
        message: String,
    },
}

fn in_table(table: &str) -> String {
    if table.is_empty() {
        "at the top level".to_string()
    } else {
        format!("in {table}")
    }
}

impl ConfigError {
    /// Where the error is, if it is inside a file that was read.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Syntax { at, .. }
            | ConfigError::DuplicateKey { at, .. }
            | ConfigError::UnknownKey { at, .. }
            | ConfigError::Invalid { at, .. } => Some(at),
        }
    }

    /// The 1-based line the error points at.
    pub fn line(&self) -> Option<usize> {
        self.location().and_then(|at| at.line)
    }

    /// The dotted path of the offending key, e.g. `agent.intervall`.
    pub fn key(&self) -> Option<String> {
        match self {
            ConfigError::Read { .. } | ConfigError::Syntax { .. } => None,
            ConfigError::DuplicateKey { key, .. } | ConfigError::Invalid { key, .. } => {
                Some(key.clone())
            }
            ConfigError::UnknownKey { table, key, .. } => {
                let table = table.trim_matches(|c| c == '[' || c == ']');
                Some(if table.is_empty() {
                    key.clone()
                } else {
                    format!("{table}.{key}")
                })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Loading.

/// Where a config came from: the file and the line of every key it set. Keys not in the map
/// took their default.
#[derive(Debug, Clone, Default)]
struct Source {
    path: Option<PathBuf>,
    lines: BTreeMap<String, usize>,
}

impl Config {
    /// Reads and checks the config file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Checks `text` as a config file; `origin` is the path errors name.
    pub fn parse(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        let cx = Cx {
            path: origin,
            text,
            lines: BTreeMap::new(),
        };
        let tree = DeTable::parse(text).map_err(|e| cx.parse_error(&e))?;
        let raw = RawConfig::deserialize(toml::Deserializer::from(tree.clone()))
            .map_err(|e| cx.serde_error(&e, tree.get_ref()))?;
        cx.build(raw)
    }

    /// The agent's tick (`agent.interval_ms`).
    pub fn interval(&self) -> Duration {
        self.agent.interval()
    }

    /// The file this config was read from; `None` for the built-in defaults.
    pub fn origin(&self) -> Option<&Path> {
        self.source.path.as_deref()
    }

    /// Where `key` (a dotted path such as `api.group`) was set: its file and line, or just the
    /// file if the key took its default.
    pub fn location_of(&self, key: &str) -> Location {
        Location {
            path: self.source.path.clone(),
            line: self.source.lines.get(key).copied(),
        }
    }

    /// An error about `key` found after loading (e.g. `api.group` names no group), pointing
    /// at the line that set it.
    pub fn error_at(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            at: self.location_of(key),
            key: key.to_string(),
            message: message.into(),
        }
    }

    /// The CPUs to keep free of jobs on this node. `online` is the node's online CPUs and
    /// `cpu0_siblings` CPU 0's SMT siblings (with or without CPU 0 itself).
    ///
    /// A list must name only online CPUs and leave at least one for jobs. `auto` adapts
    /// instead of failing: CPU 0 and its siblings, or just CPU 0 if they are every online CPU
    /// (a 2-thread VM), or nothing on a single-CPU node.
    pub fn resolve_reserved(
        &self,
        online: &CpuSet,
        cpu0_siblings: &CpuSet,
    ) -> Result<CpuSet, ConfigError> {
        const KEY: &str = "node.reserved_cpus";
        match &self.node.reserved_cpus {
            ReservedCpus::Auto => {
                let mut core0 = cpu0_siblings.clone();
                core0.insert(0);
                let core0 = core0.intersection(online);
                if core0.len() < online.len() {
                    Ok(core0)
                } else if online.len() > 1 {
                    Ok(core0.first().into_iter().collect())
                } else {
                    Ok(CpuSet::new())
                }
            }
            ReservedCpus::List(wanted) => {
                let missing = wanted.difference(online);
                if !missing.is_empty() {
                    let (noun, verb) = if missing.len() == 1 {
                        ("CPU", "is")
                    } else {
                        ("CPUs", "are")
                    };
                    return Err(self.error_at(
                        KEY,
                        format!(
                            "{noun} {missing} {verb} not online on this node (online: {online})"
                        ),
                    ));
                }
                if !online.is_empty() && online.is_subset(wanted) {
                    return Err(self.error_at(
                        KEY,
                        format!(
                            "reserves every online CPU ({online}); leave at least one for jobs"
                        ),
                    ));
                }
                Ok(wanted.clone())
            }
        }
    }

    /// Refuses a `[[node.gpu]]` whose `numa_node` is not one of the node's `numa_nodes`.
    pub fn check_gpu_overrides(&self, numa_nodes: &CpuSet) -> Result<(), ConfigError> {
        for (i, gpu) in self.node.gpu.iter().enumerate() {
            if !numa_nodes.contains(gpu.numa_node) {
                return Err(self.error_at(
                    &format!("node.gpu[{i}].numa_node"),
                    format!(
                        "NUMA node {} does not exist on this node (nodes: {numa_nodes})",
                        gpu.numa_node
                    ),
                ));
            }
        }
        Ok(())
    }
}

// The file as written: every key optional, every value with its span. `expecting` makes a
// section given as a plain value read "expected a table".

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawConfig {
    node: Option<RawNode>,
    training: Option<RawTraining>,
    agent: Option<RawAgent>,
    api: Option<RawApi>,
    cgroup: Option<RawCgroup>,
    log: Option<RawLog>,
    sense: Option<RawSense>,
    metrics: Option<RawMetrics>,
    inference: Option<RawInference>,
    rightsize: Option<RawRightsize>,
    contention: Option<RawContention>,
    network: Option<RawNetwork>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawNetwork {
    link: Option<Vec<Spanned<RawLink>>>,
    training_percent: Option<Spanned<i64>>,
    cpu_jobs_percent: Option<Spanned<i64>>,
    cpu_jobs_ceil_percent: Option<Spanned<i64>>,
    steering: Option<Spanned<String>>,
    replace_foreign_root: Option<Spanned<bool>>,
    cpu_jobs_interface: Option<Spanned<String>>,
    cpu_jobs_gateway: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawLink {
    interface: Option<Spanned<String>>,
    line_rate_mbit: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawContention {
    mode: Option<Spanned<String>>,
    membw_threshold: Option<Spanned<f64>>,
    pressure_ticks: Option<Spanned<i64>>,
    calm_ticks: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawRightsize {
    mode: Option<Spanned<String>>,
    warmup_seconds: Option<Spanned<i64>>,
    window_seconds: Option<Spanned<i64>>,
    shrink: Option<Spanned<bool>>,
    tolerance_cores: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawInference {
    probe_seconds: Option<Spanned<i64>>,
    stop_grace_seconds: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawNode {
    reserved_cpus: Option<Spanned<String>>,
    sysfs_root: Option<Spanned<String>>,
    proc_root: Option<Spanned<String>>,
    gpu: Option<Vec<Spanned<RawGpu>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawGpu {
    index: Option<Spanned<i64>>,
    numa_node: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawTraining {
    rt_priority: Option<Spanned<i64>>,
    allow_unthrottled_rt: Option<Spanned<bool>>,
    grant_rt_budget_us: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawAgent {
    interval_ms: Option<Spanned<i64>>,
    state_dir: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawApi {
    group: Option<Spanned<String>>,
    bus: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawCgroup {
    driver: Option<Spanned<String>>,
    root: Option<Spanned<String>>,
    parent: Option<Spanned<String>>,
    pid_jobs: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawLog {
    level: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawSense {
    interval_ms: Option<Spanned<i64>>,
    gpu: Option<Spanned<String>>,
    emulated_gpu_dir: Option<Spanned<String>>,
    perf: Option<Spanned<bool>>,
    perf_max_fds: Option<Spanned<i64>>,
    resctrl_root: Option<Spanned<String>>,
    membw_peak_bytes_per_s: Option<Spanned<i64>>,
    history: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawMetrics {
    listen: Option<Spanned<String>>,
}

/// The file being checked.
struct Cx<'a> {
    path: &'a Path,
    text: &'a str,
    lines: BTreeMap<String, usize>,
}

impl Cx<'_> {
    fn line(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn at(&self, span: Option<Range<usize>>) -> Location {
        Location {
            path: Some(self.path.to_path_buf()),
            line: span.map(|s| self.line(s.start)),
        }
    }

    /// Checks one value with `check`, or takes `default` if the key is absent; remembers the
    /// key's line either way it was given.
    fn field<T, U>(
        &mut self,
        key: &str,
        raw: Option<Spanned<T>>,
        default: U,
        check: impl FnOnce(T) -> Result<U, String>,
    ) -> Result<U, ConfigError> {
        let Some(raw) = raw else {
            return Ok(default);
        };
        let span = raw.span();
        self.lines.insert(key.to_string(), self.line(span.start));
        check(raw.into_inner()).map_err(|message| ConfigError::Invalid {
            at: self.at(Some(span)),
            key: key.to_string(),
            message,
        })
    }

    fn build(mut self, raw: RawConfig) -> Result<Config, ConfigError> {
        let node = self.node(raw.node)?;
        let training = self.training(raw.training)?;
        let agent = self.agent(raw.agent)?;
        let api = self.api(raw.api)?;
        let cgroup = self.cgroup(raw.cgroup)?;
        let log = self.log(raw.log)?;
        let sense = self.sense(raw.sense)?;
        let metrics = self.metrics(raw.metrics)?;
        let inference = self.inference(raw.inference)?;
        let rightsize = self.rightsize(raw.rightsize)?;
        let contention = self.contention(raw.contention)?;
        let network = self.network(raw.network)?;
        Ok(Config {
            node,
            training,
            agent,
            api,
            cgroup,
            log,
            sense,
            metrics,
            inference,
            rightsize,
            contention,
            network,
            source: Source {
                path: Some(self.path.to_path_buf()),
                lines: self.lines,
            },
        })
    }

    fn node(&mut self, raw: Option<RawNode>) -> Result<NodeConfig, ConfigError> {
        let d = NodeConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(NodeConfig {
            reserved_cpus: self.field(
                "node.reserved_cpus",
                raw.reserved_cpus,
                d.reserved_cpus,
                |s| {
                    ReservedCpus::parse(&s).map_err(|e| {
                        format!("must be \"auto\", \"\" (none) or a cpulist such as \"0,32\": {e}")
                    })
                },
            )?,
            sysfs_root: self.field("node.sysfs_root", raw.sysfs_root, d.sysfs_root, absolute)?,
            proc_root: self.field("node.proc_root", raw.proc_root, d.proc_root, absolute)?,
            gpu: self.gpus(raw.gpu.unwrap_or_default())?,
        })
    }

    fn gpus(&mut self, raw: Vec<Spanned<RawGpu>>) -> Result<Vec<GpuOverride>, ConfigError> {
        let mut gpus = Vec::with_capacity(raw.len());
        // GPU index → line of the entry that first gave it.
        let mut seen: BTreeMap<u32, usize> = BTreeMap::new();
        for (i, entry) in raw.into_iter().enumerate() {
            let entry_key = format!("node.gpu[{i}]");
            let entry_span = entry.span();
            self.lines
                .insert(entry_key.clone(), self.line(entry_span.start));
            let entry = entry.into_inner();
            let (index, numa_node) = match (entry.index, entry.numa_node) {
                (Some(index), Some(numa_node)) => (index, numa_node),
                (index, numa_node) => {
                    let absent: Vec<&str> = [
                        ("index", index.is_none()),
                        ("numa_node", numa_node.is_none()),
                    ]
                    .into_iter()
                    .filter_map(|(name, absent)| absent.then_some(name))
                    .collect();
                    return Err(ConfigError::Invalid {
                        at: self.at(Some(entry_span)),
                        key: entry_key,
                        message: format!(
                            "missing {} {}; each [[node.gpu]] needs index and numa_node",
                            if absent.len() == 1 { "key" } else { "keys" },
                            absent.join(" and ")
                        ),
                    });
                }
            };
            let index_line = self.line(index.span().start);
            let index = self.field(&format!("{entry_key}.index"), Some(index), 0, |v| {
                in_range(v, &GPU_INDEX_RANGE)
            })?;
            if let Some(first) = seen.insert(index, index_line) {
                return Err(ConfigError::Invalid {
                    at: Location {
                        path: Some(self.path.to_path_buf()),
                        line: Some(index_line),
                    },
                    key: format!("{entry_key}.index"),
                    message: format!("GPU {index} is already given at line {first}"),
                });
            }
            let numa_node =
                self.field(&format!("{entry_key}.numa_node"), Some(numa_node), 0, |v| {
                    in_range(v, &NUMA_NODE_RANGE)
                })?;
            gpus.push(GpuOverride { index, numa_node });
        }
        Ok(gpus)
    }

    fn training(&mut self, raw: Option<RawTraining>) -> Result<TrainingConfig, ConfigError> {
        let d = TrainingConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(TrainingConfig {
            rt_priority: self.field(
                "training.rt_priority",
                raw.rt_priority,
                d.rt_priority,
                |v| in_range(v, &RT_PRIORITY_RANGE),
            )?,
            allow_unthrottled_rt: self.field(
                "training.allow_unthrottled_rt",
                raw.allow_unthrottled_rt,
                d.allow_unthrottled_rt,
                Ok,
            )?,
            grant_rt_budget_us: self.field(
                "training.grant_rt_budget_us",
                raw.grant_rt_budget_us,
                d.grant_rt_budget_us,
                |v| {
                    in_range(v, &RT_BUDGET_US_RANGE).map_err(|e| {
                        format!(
                            "{e}; 0 = never grant, otherwise below the {RT_PERIOD_US} us period"
                        )
                    })
                },
            )?,
        })
    }

    fn agent(&mut self, raw: Option<RawAgent>) -> Result<AgentConfig, ConfigError> {
        let d = AgentConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(AgentConfig {
            interval_ms: self.field("agent.interval_ms", raw.interval_ms, d.interval_ms, |v| {
                in_range(v, &INTERVAL_MS_RANGE)
            })?,
            state_dir: self.field("agent.state_dir", raw.state_dir, d.state_dir, absolute)?,
        })
    }

    fn api(&mut self, raw: Option<RawApi>) -> Result<ApiConfig, ConfigError> {
        let d = ApiConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(ApiConfig {
            group: self.field("api.group", raw.group, d.group, group_name)?,
            bus: self.field("api.bus", raw.bus, d.bus, |s| {
                one_of(&s, BusKind::from_name, BusKind::NAMES)
            })?,
        })
    }

    fn cgroup(&mut self, raw: Option<RawCgroup>) -> Result<CgroupConfig, ConfigError> {
        let d = CgroupConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(CgroupConfig {
            driver: self.field("cgroup.driver", raw.driver, d.driver, |s| {
                one_of(&s, CgroupDriver::from_name, CgroupDriver::NAMES)
            })?,
            root: self.field("cgroup.root", raw.root, d.root, absolute)?,
            parent: self.field("cgroup.parent", raw.parent, d.parent, cgroup_name)?,
            pid_jobs: self.field("cgroup.pid_jobs", raw.pid_jobs, d.pid_jobs, |s| {
                one_of(&s, PidJobs::from_name, PidJobs::NAMES)
            })?,
        })
    }

    fn log(&mut self, raw: Option<RawLog>) -> Result<LogConfig, ConfigError> {
        let d = LogConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(LogConfig {
            level: self.field("log.level", raw.level, d.level, |s| {
                one_of(&s, LogLevel::from_name, LogLevel::NAMES)
            })?,
        })
    }

    fn sense(&mut self, raw: Option<RawSense>) -> Result<SenseConfig, ConfigError> {
        let d = SenseConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(SenseConfig {
            interval_ms: self.field("sense.interval_ms", raw.interval_ms, d.interval_ms, |v| {
                in_range(v, &SENSE_INTERVAL_MS_RANGE)
            })?,
            gpu: self.field("sense.gpu", raw.gpu, d.gpu, |s| {
                one_of(&s, GpuSourceChoice::from_name, GpuSourceChoice::NAMES)
            })?,
            emulated_gpu_dir: self.field(
                "sense.emulated_gpu_dir",
                raw.emulated_gpu_dir,
                d.emulated_gpu_dir,
                absolute,
            )?,
            perf: self.field("sense.perf", raw.perf, d.perf, Ok)?,
            perf_max_fds: self.field(
                "sense.perf_max_fds",
                raw.perf_max_fds,
                d.perf_max_fds,
                |v| in_range(v, &PERF_MAX_FDS_RANGE),
            )?,
            resctrl_root: self.field(
                "sense.resctrl_root",
                raw.resctrl_root,
                d.resctrl_root,
                absolute,
            )?,
            membw_peak_bytes_per_s: self.field(
                "sense.membw_peak_bytes_per_s",
                raw.membw_peak_bytes_per_s,
                d.membw_peak_bytes_per_s,
                |v| in_range(v, &(0..=i64::MAX)),
            )?,
            history: self.field("sense.history", raw.history, d.history, |v| {
                in_range(v, &HISTORY_RANGE)
            })?,
        })
    }

    fn inference(&mut self, raw: Option<RawInference>) -> Result<InferenceConfig, ConfigError> {
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
        })
    }

    fn rightsize(&mut self, raw: Option<RawRightsize>) -> Result<RightsizeConfig, ConfigError> {
        let d = RightsizeConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(RightsizeConfig {
            mode: self.field("rightsize.mode", raw.mode, d.mode, |s| {
                one_of(&s, RightsizeMode::from_name, RightsizeMode::NAMES)
            })?,
            warmup_seconds: self.field(
                "rightsize.warmup_seconds",
                raw.warmup_seconds,
                d.warmup_seconds,
                |v| in_range(v, &(0..=86_400)),
            )?,
            window_seconds: self.field(
                "rightsize.window_seconds",
                raw.window_seconds,
                d.window_seconds,
                |v| in_range(v, &(1..=3_600)),
            )?,
            shrink: self.field("rightsize.shrink", raw.shrink, d.shrink, Ok)?,
            tolerance_cores: self.field(
                "rightsize.tolerance_cores",
                raw.tolerance_cores,
                d.tolerance_cores,
                |v| in_range(v, &(0..=64)),
            )?,
        })
    }

    fn network(&mut self, raw: Option<RawNetwork>) -> Result<NetworkSection, ConfigError> {
        let d = NetworkSection::default();
        let Some(raw) = raw else { return Ok(d) };
        let percent = |v| in_range(v, &(1..=100));
        let mut link = Vec::new();
        for (i, entry) in raw.link.unwrap_or_default().into_iter().enumerate() {
            let key = format!("network.link[{i}]");
            let span = entry.span();
            self.lines.insert(key.clone(), self.line(span.start));
            let entry = entry.into_inner();
            let (Some(interface), Some(rate)) = (entry.interface, entry.line_rate_mbit) else {
                return Err(ConfigError::Invalid {
                    at: self.at(Some(span)),
                    key,
                    message: "each [[network.link]] needs interface and line_rate_mbit".into(),
                });
            };
            let interface = self.field(
                &format!("{key}.interface"),
                Some(interface),
                String::new(),
                |s| {
                    if crate::enforce::tc::check_interface(&s).is_ok() {
                        Ok(s)
                    } else {
                        Err(format!("'{s}' is not an interface name"))
                    }
                },
            )?;
            if link
                .iter()
                .any(|l: &crate::enforce::tc::Link| l.interface == interface)
            {
                return Err(self.error_here(
                    &format!("{key}.interface"),
                    format!("{interface} is listed twice"),
                ));
            }
            let line_rate_mbit =
                self.field(&format!("{key}.line_rate_mbit"), Some(rate), 0, |v| {
                    in_range(v, &(1..=10_000_000))
                })?;
            link.push(crate::enforce::tc::Link {
                interface,
                line_rate_mbit,
            });
        }
        let section = NetworkSection {
            link,
            training_percent: self.field(
                "network.training_percent",
                raw.training_percent,
                d.training_percent,
                percent,
            )?,
            cpu_jobs_percent: self.field(
                "network.cpu_jobs_percent",
                raw.cpu_jobs_percent,
                d.cpu_jobs_percent,
                percent,
            )?,
            cpu_jobs_ceil_percent: self.field(
                "network.cpu_jobs_ceil_percent",
                raw.cpu_jobs_ceil_percent,
                d.cpu_jobs_ceil_percent,
                percent,
            )?,
            steering: self.field("network.steering", raw.steering, d.steering, |s| {
                one_of(&s, NetSteering::from_name, NetSteering::NAMES)
            })?,
            replace_foreign_root: self.field(
                "network.replace_foreign_root",
                raw.replace_foreign_root,
                d.replace_foreign_root,
                Ok,
            )?,
            cpu_jobs_interface: self.field(
                "network.cpu_jobs_interface",
                raw.cpu_jobs_interface,
                d.cpu_jobs_interface,
                |s| {
                    if s.is_empty() || crate::enforce::tc::check_interface(&s).is_ok() {
                        Ok(s)
                    } else {
                        Err(format!("'{s}' is not an interface name"))
                    }
                },
            )?,
            cpu_jobs_gateway: self.field(
                "network.cpu_jobs_gateway",
                raw.cpu_jobs_gateway,
                d.cpu_jobs_gateway,
                |s| {
                    if s.is_empty() {
                        return Ok(None);
                    }
                    s.parse::<std::net::Ipv4Addr>()
                        .map(Some)
                        .map_err(|_| format!("'{s}' is not an IPv4 address (empty: none)"))
                },
            )?,
        };
        if !section.cpu_jobs_interface.is_empty() && !section.link.is_empty() {
            return Err(self.error_here(
                "network.cpu_jobs_interface",
                "moves CPU jobs to another network instead of shaping: remove either it or \
                 the [[network.link]] tables"
                    .into(),
            ));
        }
        if section.cpu_jobs_gateway.is_some() && section.cpu_jobs_interface.is_empty() {
            return Err(self.error_here(
                "network.cpu_jobs_gateway",
                "is set without network.cpu_jobs_interface".into(),
            ));
        }
        if section.training_percent + section.cpu_jobs_percent > 100 {
            return Err(self.error_here(
                "network.cpu_jobs_percent",
                format!(
                    "training {}% + CPU jobs {}% is more than the line rate",
                    section.training_percent, section.cpu_jobs_percent
                ),
            ));
        }
        if section.cpu_jobs_ceil_percent < section.cpu_jobs_percent {
            return Err(self.error_here(
                "network.cpu_jobs_ceil_percent",
                format!(
                    "{} is below cpu_jobs_percent ({}): CPU jobs could not use their own share",
                    section.cpu_jobs_ceil_percent, section.cpu_jobs_percent
                ),
            ));
        }
        Ok(section)
    }

    /// An error at `key`'s line (or, when it took its default, the file).
    fn error_here(&self, key: &str, message: String) -> ConfigError {
        ConfigError::Invalid {
            at: Location {
                path: Some(self.path.to_path_buf()),
                line: self.lines.get(key).copied(),
            },
            key: key.to_string(),
            message,
        }
    }

    fn contention(&mut self, raw: Option<RawContention>) -> Result<ContentionSection, ConfigError> {
        let d = ContentionSection::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(ContentionSection {
            mode: self.field("contention.mode", raw.mode, d.mode, |s| {
                one_of(&s, RightsizeMode::from_name, RightsizeMode::NAMES)
            })?,
            membw_threshold: self.field(
                "contention.membw_threshold",
                raw.membw_threshold,
                d.membw_threshold,
                |v| {
                    if v.is_finite() && v > 0.0 && v <= 1.0 {
                        Ok(v)
                    } else {
                        Err(format!(
                            "must be a fraction above 0 and at most 1 (got {v})"
                        ))
                    }
                },
            )?,
            pressure_ticks: self.field(
                "contention.pressure_ticks",
                raw.pressure_ticks,
                d.pressure_ticks,
                |v| in_range(v, &(1..=1000)),
            )?,
            calm_ticks: self.field("contention.calm_ticks", raw.calm_ticks, d.calm_ticks, |v| {
                in_range(v, &(1..=10_000))
            })?,
        })
    }

    fn metrics(&mut self, raw: Option<RawMetrics>) -> Result<MetricsConfig, ConfigError> {
        let d = MetricsConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(MetricsConfig {
            listen: self.field("metrics.listen", raw.listen, d.listen, |s| {
                if s.is_empty() || s.parse::<std::net::SocketAddr>().is_ok() {
                    Ok(s)
                } else {
                    Err(format!(
                        "must be empty (off) or an address and port such as \"127.0.0.1:9464\" (got \"{s}\")"
                    ))
                }
            })?,
        })
    }

    /// The document is not valid TOML (or repeats a key, which the parser reports).
    fn parse_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span();
        let at = self.at(span.clone());
        match span {
            Some(span) if e.message() == "duplicate key" => ConfigError::DuplicateKey {
                at,
                key: self.duplicate_key_path(span),
            },
            _ => ConfigError::Syntax {
                at,
                message: e.message().to_string(),
            },
        }
    }

    /// The parser stops at a repeated key without saying which table it is in, so the table
    /// is recovered from the nearest header above it. Best effort: only the key name is
    /// affected if this guesses wrong, never the line.
    fn duplicate_key_path(&self, span: Range<usize>) -> String {
        let key = self
            .text
            .get(span.clone())
            .unwrap_or("")
            .trim()
            .trim_matches(|c| c == '"' || c == '\'')
            .to_string();
        let line_start = self.text[..span.start.min(self.text.len())]
            .rfind('\n')
            .map_or(0, |i| i + 1);
        let here = self.text[line_start..].lines().next().unwrap_or("");
        if let Some(header) = table_header(here) {
            // The repeated thing is a table header: its name is the whole path.
            return header;
        }
        match self.text[..line_start].lines().rev().find_map(table_header) {
            Some(table) => format!("{table}.{key}"),
            None => key,
        }
    }

    /// The document is TOML but does not fit the schema: an unknown key or a value of the
    /// wrong type. Serde reports the span but not the key path, so the path is found by
    /// looking the span up in the parsed tree.
    fn serde_error(&self, e: &toml::de::Error, tree: &DeTable<'_>) -> ConfigError {
        let span = e.span();
        let at = self.at(span.clone());
        let path = span.and_then(|s| locate(tree, s.start)).unwrap_or_default();
        let message = e.message();
        if let Some((key, expected)) = unknown_field(message) {
            let table = path.split_last().map_or(&[][..], |(_, t)| t);
            return ConfigError::UnknownKey {
                at,
                table: table_display(table),
                key,
                expected,
            };
        }
        if path.is_empty() {
            return ConfigError::Syntax {
                at,
                message: message.to_string(),
            };
        }
        ConfigError::Invalid {
            at,
            key: key_display(&path),
            message: type_message(message),
        }
    }
}

/// One step of a key path: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

fn key_display(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// `[agent]`, or `[[node.gpu]]` for a table inside an array of tables; empty for the top.
fn table_display(table: &[Seg]) -> String {
    if table.is_empty() {
        return String::new();
    }
    let keys: Vec<&str> = table
        .iter()
        .filter_map(|s| match s {
            Seg::Key(k) => Some(k.as_str()),
            Seg::Index(_) => None,
        })
        .collect();
    if matches!(table.last(), Some(Seg::Index(_))) {
        format!("[[{}]]", keys.join("."))
    } else {
        format!("[{}]", keys.join("."))
    }
}

fn span_holds(span: &Range<usize>, offset: usize) -> bool {
    span.contains(&offset) || (span.is_empty() && span.start == offset)
}

/// The path of the innermost key whose key or value span holds `offset`.
fn locate(table: &DeTable<'_>, offset: usize) -> Option<Vec<Seg>> {
    for (key, value) in table.iter() {
        let here = Seg::Key(key.get_ref().to_string());
        if let Some(mut inner) = locate_in(value, offset) {
            inner.insert(0, here);
            return Some(inner);
        }
        if span_holds(&key.span(), offset) || span_holds(&value.span(), offset) {
            return Some(vec![here]);
        }
    }
    None
}

fn locate_in(value: &Spanned<DeValue<'_>>, offset: usize) -> Option<Vec<Seg>> {
    match value.get_ref() {
        DeValue::Table(table) => locate(table, offset),
        DeValue::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            if let Some(mut inner) = locate_in(item, offset) {
                inner.insert(0, Seg::Index(i));
                Some(inner)
            } else if span_holds(&item.span(), offset) {
                Some(vec![Seg::Index(i)])
            } else {
                None
            }
        }),
        _ => None,
    }
}

/// `[a.b]` or `[[a.b]]` (with an optional trailing comment) → `a.b`.
fn table_header(line: &str) -> Option<String> {
    let line = line.trim();
    let inner = line.strip_prefix('[')?;
    let inner = inner.strip_prefix('[').unwrap_or(inner);
    let end = inner.find(']')?;
    let name: String = inner[..end]
        .split('.')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(".");
    (!name.is_empty()).then_some(name)
}

/// Serde's "unknown field `x`, expected one of `a`, `b`" → (x, [a, b]).
fn unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    Some((key.to_string(), expected))
}

/// Serde's "invalid type: string \"x\", expected i64" → "expected an integer, got string \"x\"".
fn type_message(message: &str) -> String {
    let Some(rest) = message.strip_prefix("invalid type: ") else {
        return message.to_string();
    };
    let Some((got, expected)) = rest.rsplit_once(", expected ") else {
        return message.to_string();
    };
    let expected = match expected {
        "i64" => "an integer",
        "a sequence" => "an array",
        other => other,
    };
    if expected == "an integer" && got.starts_with("integer") {
        // An integer beyond i64 (toml reports it as i128).
        let digits = got.split('`').nth(1).unwrap_or(got);
        return format!("integer {digits} is out of range");
    }
    let got = match got {
        "sequence" => "an array",
        "map" => "a table",
        other => other,
    };
    format!("expected {expected}, got {got}")
}

fn in_range<T: TryFrom<i64>>(value: i64, range: &RangeInclusive<i64>) -> Result<T, String> {
    let out_of_range = || {
        format!(
            "must be between {} and {} (got {value})",
            range.start(),
            range.end()
        )
    };
    if !range.contains(&value) {
        return Err(out_of_range());
    }
    T::try_from(value).map_err(|_| out_of_range())
}

fn absolute(value: String) -> Result<PathBuf, String> {
    let path = PathBuf::from(&value);
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(format!("must be an absolute path (got \"{value}\")"))
    }
}

fn one_of<T>(value: &str, from_name: fn(&str) -> Option<T>, names: &[&str]) -> Result<T, String> {
    from_name(value).ok_or_else(|| format!("must be one of {} (got \"{value}\")", names.join(", ")))
}

/// A POSIX-portable group name, as `groupadd` accepts by default: letters, digits, `_` and `-`,
/// not starting with a digit or `-`, an optional trailing `$`.
fn group_name(value: String) -> Result<String, String> {
    let body = value.strip_suffix('$').unwrap_or(&value);
    let valid = !body.is_empty()
        && value.len() <= GROUP_NAME_MAX
        && body
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && body
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if valid {
        Ok(value)
    } else {
        Err(format!(
            "\"{value}\" is not a valid group name (up to {GROUP_NAME_MAX} letters, digits, '_' \
             or '-', starting with a letter or '_')"
        ))
    }
}

/// One directory name under the cgroup root: no `/`, not `.` or `..`, and none of the
/// characters that would need quoting in cgroupfs or systemd unit names.
fn cgroup_name(value: String) -> Result<String, String> {
    let valid = !value.is_empty()
        && value.len() <= CGROUP_NAME_MAX
        && value != "."
        && value != ".."
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '@' | ':'));
    if valid {
        Ok(value)
    } else {
        Err(format!(
            "must be a single cgroup name of letters, digits, '_', '-', '.', '@' or ':' \
             (got \"{value}\")"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORIGIN: &str = "/etc/lodger/lodger.toml";
    const SHIPPED: &str = include_str!("../config/lodger.toml");

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new(ORIGIN))
    }

    /// The one-line message for a text that must be refused.
    fn refused(text: &str) -> String {
        match parse(text) {
            Ok(config) => panic!("accepted {text:?} as {config:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn cpus(list: &str) -> CpuSet {
        CpuSet::parse(list).expect("test cpulist")
    }

    #[test]
    fn default_equals_the_shipped_file() {
        let shipped = parse(SHIPPED).expect("config/lodger.toml must parse");
        assert_eq!(shipped, Config::default());
    }

    #[test]
    fn empty_file_is_the_default() {
        assert_eq!(parse("").expect("empty"), Config::default());
        assert_eq!(parse("# nothing\n\n").expect("comments"), Config::default());
    }

    #[test]
    fn every_default() {
        let c = Config::default();
        assert_eq!(c.node.reserved_cpus, ReservedCpus::Auto);
        assert_eq!(c.node.sysfs_root, Path::new("/sys"));
        assert_eq!(c.node.proc_root, Path::new("/proc"));
        assert!(c.node.gpu.is_empty());
        assert_eq!(c.training.rt_priority, 10);
        assert!(!c.training.allow_unthrottled_rt);
        assert_eq!(c.training.grant_rt_budget_us, 0);
        assert_eq!(c.training.grant_rt_budget_us(), None);
        assert_eq!(c.agent.interval_ms, 1000);
        assert_eq!(c.agent.interval(), Duration::from_secs(1));
        assert_eq!(c.interval(), Duration::from_secs(1));
        assert_eq!(c.agent.state_dir, Path::new("/var/lib/lodger"));
        assert_eq!(c.api.group, "lodger");
        assert_eq!(c.api.bus, BusKind::System);
        assert_eq!(c.cgroup.driver, CgroupDriver::Auto);
        assert_eq!(c.cgroup.root, Path::new("/sys/fs/cgroup"));
        assert_eq!(c.cgroup.parent, "lodger");
        assert_eq!(c.cgroup.pid_jobs, PidJobs::Auto);
        assert_eq!(c.log.level, LogLevel::Info);
        assert_eq!(c.sense.interval(), Duration::from_secs(1));
        assert_eq!(c.sense.gpu, GpuSourceChoice::Auto);
        assert_eq!(
            c.sense.emulated_gpu_dir,
            Path::new("/run/lodger/emulated-gpu")
        );
        assert!(c.sense.perf);
        assert_eq!(c.sense.perf_max_fds, 65536);
        assert_eq!(c.sense.resctrl_root, Path::new("/sys/fs/resctrl"));
        assert_eq!(c.sense.membw_peak_bytes_per_s, 0);
        assert_eq!(c.sense.history, 300);
        assert_eq!(c.metrics.listen, "");
        assert_eq!(c.metrics.address(), None);
        assert_eq!(c.origin(), None);
    }

    /// The shipped file documents every key the schema has: for each table, the keys the
    /// parser says it expects are exactly the keys the file sets.
    #[test]
    fn shipped_file_lists_every_key() {
        let tree = DeTable::parse(SHIPPED).expect("shipped file parses");
        let keys_of = |table: &DeTable<'_>| -> Vec<String> {
            let mut keys: Vec<String> = table.keys().map(|k| k.get_ref().to_string()).collect();
            keys.sort();
            keys
        };
        let expected_by_schema = |text: &str| -> Vec<String> {
            match parse(text) {
                Err(ConfigError::UnknownKey { mut expected, .. }) => {
                    expected.sort();
                    expected
                }
                other => panic!("{text:?}: expected an unknown-key error, got {other:?}"),
            }
        };
        assert_eq!(keys_of(tree.get_ref()), expected_by_schema("zzz = 1\n"));
        for (section, value) in tree.get_ref().iter() {
            let DeValue::Table(table) = value.get_ref() else {
                panic!("{} is not a table", section.get_ref());
            };
            let mut want = expected_by_schema(&format!("[{}]\nzzz = 1\n", section.get_ref()));
            if section.get_ref() == "node" {
                // [[node.gpu]] has no default entries; the file shows it commented out.
                want.retain(|k| k != "gpu");
                assert!(SHIPPED.contains("# [[node.gpu]]\n# index = 0\n# numa_node = "));
                assert_eq!(
                    expected_by_schema("[[node.gpu]]\nzzz = 1\n"),
                    ["index", "numa_node"]
                );
            }
            if section.get_ref() == "network" {
                // [[network.link]] likewise.
                want.retain(|k| k != "link");
                assert!(SHIPPED
                    .contains("# [[network.link]]\n# interface = \"eth0\"\n# line_rate_mbit = "));
                assert_eq!(
                    expected_by_schema("[[network.link]]\nzzz = 1\n"),
                    ["interface", "line_rate_mbit"]
                );
            }
            assert_eq!(keys_of(table), want, "[{}]", section.get_ref());
        }
    }

    #[test]
    fn the_commented_network_example_parses_and_bad_links_are_refused() {
        let text = SHIPPED.replace(
            "# [[network.link]]\n# interface = \"eth0\"\n# line_rate_mbit = 25000",
            "[[network.link]]\ninterface = \"eth0\"\nline_rate_mbit = 25000",
        );
        let c = parse(&text).expect("uncommented example");
        let shaping = c.network.shaping().expect("shaping on");
        assert_eq!(shaping.links.len(), 1);
        assert_eq!(shaping.links[0].interface, "eth0");
        assert_eq!(shaping.links[0].line_rate_mbit, 25_000);
        assert!(shaping.validate().is_ok());
        assert_eq!(Config::default().network.shaping(), None);

        let err = |text: &str| parse(text).expect_err(text).to_string();
        assert!(err("[network]\n[[network.link]]\ninterface = \"eth0\"\n")
            .contains("network.link[0]: each [[network.link]] needs interface and line_rate_mbit"),);
        assert!(
            err("[[network.link]]\ninterface = \"a/b\"\nline_rate_mbit = 1\n")
                .contains(":2: network.link[0].interface: 'a/b' is not an interface name")
        );
        assert!(err(
            "[[network.link]]\ninterface = \"e\"\nline_rate_mbit = 1\n[[network.link]]\ninterface = \"e\"\nline_rate_mbit = 2\n"
        )
        .contains(":5: network.link[1].interface: e is listed twice"));
        assert!(
            err("[[network.link]]\ninterface = \"e\"\nline_rate_mbit = 0\n")
                .contains(":3: network.link[0].line_rate_mbit: must be between 1 and")
        );
        assert!(err("[network]\ntraining_percent = 80\ncpu_jobs_percent = 30\n")
            .contains(":3: network.cpu_jobs_percent: training 80% + CPU jobs 30% is more than the line rate"));
        let e = err("[network]\ntraining_percent = 60\ncpu_jobs_percent = 30\n");
        assert!(
            e.ends_with("lodger.toml: network.cpu_jobs_ceil_percent: 25 is below cpu_jobs_percent (30): CPU jobs could not use their own share"),
            "{e}"
        );
        assert!(err("[network]\nsteering = \"ebpf\"\n")
            .contains("network.steering: must be one of auto, tc-filter, nft"));
        // The two-network option.
        let c =
            parse("[network]\ncpu_jobs_interface = \"eth1\"\ncpu_jobs_gateway = \"10.1.0.1\"\n")
                .expect("two networks");
        let slow = c.network.slow_network().expect("slow network");
        assert_eq!(slow.interface, "eth1");
        assert_eq!(slow.gateway, Some(std::net::Ipv4Addr::new(10, 1, 0, 1)));
        assert_eq!(c.network.shaping(), None);
        assert!(
            err("[network]\ncpu_jobs_interface = \"eth1\"\ncpu_jobs_gateway = \"10.1.0\"\n")
                .contains(":3: network.cpu_jobs_gateway: '10.1.0' is not an IPv4 address")
        );
        assert!(err("[network]\ncpu_jobs_gateway = \"10.1.0.1\"\n")
            .contains("network.cpu_jobs_gateway: is set without network.cpu_jobs_interface"));
        assert!(err("[network]\ncpu_jobs_interface = \"eth1\"\n[[network.link]]\ninterface = \"eth0\"\nline_rate_mbit = 1\n")
            .contains(":2: network.cpu_jobs_interface: moves CPU jobs to another network instead of shaping"));
    }

    #[test]
    fn the_commented_gpu_example_parses() {
        let text = SHIPPED.replace(
            "# [[node.gpu]]\n# index = 0\n# numa_node = 1",
            "[[node.gpu]]\nindex = 0\nnuma_node = 1",
        );
        let c = parse(&text).expect("uncommented example");
        assert_eq!(
            c.node.gpu,
            [GpuOverride {
                index: 0,
                numa_node: 1
            }]
        );
        assert_eq!(c.node.gpu_numa_node(0), Some(1));
        assert_eq!(c.node.gpu_numa_node(1), None);
    }

    #[test]
    fn every_key_can_be_set() {
        let c = parse(
            r#"
[node]
reserved_cpus = "0,32"
sysfs_root = "/tmp/sys"
proc_root = "/tmp/proc"
[[node.gpu]]
index = 1
numa_node = 0
[[node.gpu]]
index = 0
numa_node = 1
[training]
rt_priority = 99
allow_unthrottled_rt = true
grant_rt_budget_us = 950000
[agent]
interval_ms = 10
state_dir = "/srv/lodger"
[api]
group = "gpu-admins"
bus = "session"
[cgroup]
driver = "v1"
root = "/cg"
parent = "lodger.slice"
pid_jobs = "affinity"
[log]
level = "trace"
"#,
        )
        .expect("all keys set");
        assert_eq!(c.node.reserved_cpus, ReservedCpus::List(cpus("0,32")));
        assert_eq!(c.node.sysfs_root, Path::new("/tmp/sys"));
        assert_eq!(c.node.proc_root, Path::new("/tmp/proc"));
        assert_eq!(
            c.node.gpu,
            [
                GpuOverride {
                    index: 1,
                    numa_node: 0
                },
                GpuOverride {
                    index: 0,
                    numa_node: 1
                }
            ]
        );
        assert_eq!(c.training.rt_priority, 99);
        assert!(c.training.allow_unthrottled_rt);
        assert_eq!(c.training.grant_rt_budget_us(), Some(950_000));
        assert_eq!(c.agent.interval(), Duration::from_millis(10));
        assert_eq!(c.agent.state_dir, Path::new("/srv/lodger"));
        assert_eq!(c.api.group, "gpu-admins");
        assert_eq!(c.api.bus, BusKind::Session);
        assert_eq!(c.cgroup.driver, CgroupDriver::V1);
        assert_eq!(c.cgroup.root, Path::new("/cg"));
        assert_eq!(c.cgroup.parent, "lodger.slice");
        assert_eq!(c.cgroup.pid_jobs, PidJobs::Affinity);
        assert_eq!(c.log.level, LogLevel::Trace);
        assert_eq!(c.origin(), Some(Path::new(ORIGIN)));
        assert_eq!(c.location_of("agent.state_dir").line, Some(18));
        assert_eq!(c.location_of("log.level").line, Some(28));
        // A key left out has a file but no line.
        let d = parse("").expect("empty");
        assert_eq!(d.location_of("log.level").to_string(), ORIGIN);
    }

    #[test]
    fn empty_reserved_cpus_is_none() {
        let c = parse("[node]\nreserved_cpus = \"\"\n").expect("empty list");
        assert_eq!(c.node.reserved_cpus, ReservedCpus::List(CpuSet::new()));
        let got = c
            .resolve_reserved(&cpus("0-3"), &cpus("0,2"))
            .expect("none reserved");
        assert!(got.is_empty());
    }

    /// (text, the whole expected message). Each names file, line and key.
    #[test]
    fn bad_input_names_file_line_and_key() {
        let cases: &[(&str, &str)] = &[
            (
                "[sense]\ninterval_ms = 50\n",
                "/etc/lodger/lodger.toml:2: sense.interval_ms: must be between 200 and 60000 (got 50)",
            ),
            (
                "[sense]\ngpu = \"cuda\"\n",
                "/etc/lodger/lodger.toml:2: sense.gpu: must be one of auto, nvml, emulated, off (got \"cuda\")",
            ),
            (
                "[metrics]\nlisten = \"localhost\"\n",
                "/etc/lodger/lodger.toml:2: metrics.listen: must be empty (off) or an address and port such as \"127.0.0.1:9464\" (got \"localhost\")",
            ),
            // Unknown keys, top level and nested.
            (
                "foo = 1\n",
                "/etc/lodger/lodger.toml:1: unknown key 'foo' at the top level; expected one of \
                 node, training, agent, api, cgroup, log, sense, metrics, inference, rightsize, contention, network",
            ),
            (
                "[agent]\ninterval_ms = 100\n\n[agnet]\n",
                "/etc/lodger/lodger.toml:4: unknown key 'agnet' at the top level; expected one \
                 of node, training, agent, api, cgroup, log, sense, metrics, inference, rightsize, contention, network",
            ),
            (
                "[agent]\nstate_dir = \"/x\"\nintervall = 5\n",
                "/etc/lodger/lodger.toml:3: unknown key 'intervall' in [agent]; expected one of \
                 interval_ms, state_dir",
            ),
            (
                "[[node.gpu]]\nindex = 0\nnuma_node = 0\n\n[[node.gpu]]\nindex = 1\nnuma = 0\n",
                "/etc/lodger/lodger.toml:7: unknown key 'numa' in [[node.gpu]]; expected one of \
                 index, numa_node",
            ),
            (
                "[cgroup.extra]\nx = 1\n",
                "/etc/lodger/lodger.toml:1: unknown key 'extra' in [cgroup]; expected one of \
                 driver, root, parent, pid_jobs",
            ),
            // Wrong types.
            (
                "[training]\nrt_priority = \"high\"\n",
                "/etc/lodger/lodger.toml:2: training.rt_priority: expected an integer, got \
                 string \"high\"",
            ),
            (
                "[training]\nallow_unthrottled_rt = 1\n",
                "/etc/lodger/lodger.toml:2: training.allow_unthrottled_rt: expected a boolean, \
                 got integer `1`",
            ),
            (
                "[agent]\ninterval_ms = 2.5\n",
                "/etc/lodger/lodger.toml:2: agent.interval_ms: expected an integer, got \
                 floating point `2.5`",
            ),
            (
                "[cgroup]\ndriver = 2\n",
                "/etc/lodger/lodger.toml:2: cgroup.driver: expected a string, got integer `2`",
            ),
            (
                "[agent]\nstate_dir = [\"/x\"]\n",
                "/etc/lodger/lodger.toml:2: agent.state_dir: expected a string, got an array",
            ),
            (
                "\nagent = 5\n",
                "/etc/lodger/lodger.toml:2: agent: expected a table, got integer `5`",
            ),
            (
                "[node]\ngpu = 0\n",
                "/etc/lodger/lodger.toml:2: node.gpu: expected an array, got integer `0`",
            ),
            (
                "[node]\ngpu = [{ index = 0, numa_node = 0 }, 7]\n",
                "/etc/lodger/lodger.toml:2: node.gpu[1]: expected a table, got integer `7`",
            ),
            (
                "[agent]\ninterval_ms = 99999999999999999999\n",
                "/etc/lodger/lodger.toml:2: agent.interval_ms: integer 99999999999999999999 is \
                 out of range",
            ),
            // Ranges.
            (
                "[training]\n\nrt_priority = 0\n",
                "/etc/lodger/lodger.toml:3: training.rt_priority: must be between 1 and 99 (got 0)",
            ),
            (
                "[training]\nrt_priority = 100\n",
                "/etc/lodger/lodger.toml:2: training.rt_priority: must be between 1 and 99 (got \
                 100)",
            ),
            (
                "[training]\nrt_priority = -1\n",
                "/etc/lodger/lodger.toml:2: training.rt_priority: must be between 1 and 99 (got \
                 -1)",
            ),
            (
                "[agent]\ninterval_ms = 0\n",
                "/etc/lodger/lodger.toml:2: agent.interval_ms: must be between 10 and 60000 (got \
                 0)",
            ),
            (
                "[agent]\ninterval_ms = 60001\n",
                "/etc/lodger/lodger.toml:2: agent.interval_ms: must be between 10 and 60000 (got \
                 60001)",
            ),
            (
                "[training]\ngrant_rt_budget_us = 1000000\n",
                "/etc/lodger/lodger.toml:2: training.grant_rt_budget_us: must be between 0 and \
                 999999 (got 1000000); 0 = never grant, otherwise below the 1000000 us period",
            ),
            // Paths and names.
            (
                "[agent]\nstate_dir = \"var/lib/lodger\"\n",
                "/etc/lodger/lodger.toml:2: agent.state_dir: must be an absolute path (got \
                 \"var/lib/lodger\")",
            ),
            (
                "[node]\nsysfs_root = \"\"\n",
                "/etc/lodger/lodger.toml:2: node.sysfs_root: must be an absolute path (got \"\")",
            ),
            (
                "[cgroup]\nroot = \"sys/fs/cgroup\"\n",
                "/etc/lodger/lodger.toml:2: cgroup.root: must be an absolute path (got \
                 \"sys/fs/cgroup\")",
            ),
            (
                "[cgroup]\nparent = \"a/b\"\n",
                "/etc/lodger/lodger.toml:2: cgroup.parent: must be a single cgroup name of \
                 letters, digits, '_', '-', '.', '@' or ':' (got \"a/b\")",
            ),
            (
                "[api]\ngroup = \"1admins\"\n",
                "/etc/lodger/lodger.toml:2: api.group: \"1admins\" is not a valid group name (up \
                 to 32 letters, digits, '_' or '-', starting with a letter or '_')",
            ),
            // A cpulist that does not parse.
            (
                "[node]\nreserved_cpus = \"0-x\"\n",
                "/etc/lodger/lodger.toml:2: node.reserved_cpus: must be \"auto\", \"\" (none) or \
                 a cpulist such as \"0,32\": '0-x' in cpu list '0-x' is not a number or a range \
                 such as 2-5",
            ),
            (
                "[node]\nreserved_cpus = \"3-1\"\n",
                "/etc/lodger/lodger.toml:2: node.reserved_cpus: must be \"auto\", \"\" (none) or \
                 a cpulist such as \"0,32\": range '3-1' in cpu list '3-1' runs backwards",
            ),
            // Enum strings.
            (
                "[cgroup]\ndriver = \"v3\"\n",
                "/etc/lodger/lodger.toml:2: cgroup.driver: must be one of auto, v1, v2 (got \"v3\")",
            ),
            (
                "[cgroup]\npid_jobs = \"Cgroup\"\n",
                "/etc/lodger/lodger.toml:2: cgroup.pid_jobs: must be one of auto, cgroup, \
                 affinity (got \"Cgroup\")",
            ),
            (
                "[api]\nbus = \"user\"\n",
                "/etc/lodger/lodger.toml:2: api.bus: must be one of system, session (got \"user\")",
            ),
            (
                "[log]\nlevel = \"verbose\"\n",
                "/etc/lodger/lodger.toml:2: log.level: must be one of error, warn, info, debug, \
                 trace (got \"verbose\")",
            ),
            // [[node.gpu]] entries.
            (
                "[[node.gpu]]\nindex = 0\nnuma_node = 0\n[[node.gpu]]\nindex = 0\nnuma_node = 1\n",
                "/etc/lodger/lodger.toml:5: node.gpu[1].index: GPU 0 is already given at line 2",
            ),
            (
                "[[node.gpu]]\nindex = 0\nnuma_node = -1\n",
                "/etc/lodger/lodger.toml:3: node.gpu[0].numa_node: must be between 0 and 1023 \
                 (got -1)",
            ),
            // Duplicates and syntax.
            (
                "[training]\nrt_priority = 10\nrt_priority = 20\n",
                "/etc/lodger/lodger.toml:3: training.rt_priority: duplicate key",
            ),
            (
                "[agent]\ninterval_ms = 100\n\n[agent]\n",
                "/etc/lodger/lodger.toml:4: agent: duplicate key",
            ),
            (
                "[agent\ninterval_ms = 100\n",
                "/etc/lodger/lodger.toml:1: invalid TOML: unclosed table, expected `]`",
            ),
            (
                "[agent]\ninterval_ms = \n",
                "/etc/lodger/lodger.toml:2: invalid TOML: string values must be quoted, expected \
                 literal string",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(&refused(text), want, "input {text:?}");
        }
    }

    #[test]
    fn the_brief_examples_read_exactly() {
        let text = SHIPPED.replace("rt_priority = 10", "rt_priority = 0");
        let line = SHIPPED
            .lines()
            .position(|l| l == "rt_priority = 10")
            .expect("shipped rt_priority line")
            + 1;
        let e = parse(&text).expect_err("rt_priority 0");
        assert_eq!(
            e.to_string(),
            format!("/etc/lodger/lodger.toml:{line}: training.rt_priority: must be between 1 and 99 (got 0)")
        );
        assert_eq!(e.line(), Some(line));
        assert_eq!(e.key().as_deref(), Some("training.rt_priority"));

        let e = parse("\n\n[agent]\nintervall = 5\n").expect_err("typo");
        assert_eq!(e.line(), Some(4));
        assert_eq!(e.key().as_deref(), Some("agent.intervall"));
    }

    #[test]
    fn missing_gpu_keys_are_named() {
        let e = parse("[[node.gpu]]\nindex = 0\n").expect_err("no numa_node");
        let msg = e.to_string();
        assert!(
            msg.starts_with("/etc/lodger/lodger.toml:1: node.gpu[0]: missing key"),
            "{msg}"
        );
        assert!(msg.contains("numa_node"), "{msg}");
    }

    #[test]
    fn missing_file_names_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("absent.toml");
        let e = Config::load(&path).expect_err("missing file");
        assert!(matches!(e, ConfigError::Read { .. }));
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("{}: cannot read config file: ", path.display())),
            "{msg}"
        );
    }

    #[test]
    fn load_reads_and_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lodger.toml");
        std::fs::write(&path, "[agent]\ninterval_ms = 250\n").expect("write");
        let c = Config::load(&path).expect("load");
        assert_eq!(c.agent.interval(), Duration::from_millis(250));
        assert_eq!(c.origin(), Some(path.as_path()));

        std::fs::write(&path, "[log]\n\nlevel = 3\n").expect("write");
        let e = Config::load(&path).expect_err("bad level");
        assert_eq!(
            e.to_string(),
            format!(
                "{}:3: log.level: expected a string, got integer `3`",
                path.display()
            )
        );
    }

    #[test]
    fn reserved_list_must_exist_and_leave_cpus() {
        let c = parse("\n[node]\nreserved_cpus = \"0,64-65\"\n").expect("parses");
        let e = c
            .resolve_reserved(&cpus("0-63"), &cpus("0,32"))
            .expect_err("64-65 absent");
        assert_eq!(
            e.to_string(),
            "/etc/lodger/lodger.toml:3: node.reserved_cpus: CPUs 64-65 are not online on this \
             node (online: 0-63)"
        );

        let c = parse("[node]\nreserved_cpus = \"0-1\"\n").expect("parses");
        let e = c
            .resolve_reserved(&cpus("0-1"), &cpus("0"))
            .expect_err("all reserved");
        assert_eq!(
            e.to_string(),
            "/etc/lodger/lodger.toml:2: node.reserved_cpus: reserves every online CPU (0-1); \
             leave at least one for jobs"
        );

        let got = c.resolve_reserved(&cpus("0-3"), &cpus("0")).expect("fits");
        assert_eq!(got, cpus("0-1"));
    }

    #[test]
    fn reserved_auto_adapts_to_the_node() {
        let c = Config::default();
        // CPU 0 and its SMT sibling.
        assert_eq!(
            c.resolve_reserved(&cpus("0-63"), &cpus("0,32"))
                .expect("auto"),
            cpus("0,32")
        );
        // Siblings given without CPU 0 itself.
        assert_eq!(
            c.resolve_reserved(&cpus("0-63"), &cpus("32"))
                .expect("auto"),
            cpus("0,32")
        );
        // No SMT.
        assert_eq!(
            c.resolve_reserved(&cpus("0-1"), &cpus("0")).expect("auto"),
            cpus("0")
        );
        // One core with two threads: keep just CPU 0.
        assert_eq!(
            c.resolve_reserved(&cpus("0-1"), &cpus("0-1"))
                .expect("auto"),
            cpus("0")
        );
        // A single CPU: nothing.
        assert!(c
            .resolve_reserved(&cpus("0"), &cpus("0"))
            .expect("auto")
            .is_empty());
    }

    #[test]
    fn errors_on_defaults_say_so() {
        let mut c = Config::default();
        c.node.reserved_cpus = ReservedCpus::List(cpus("5"));
        let e = c
            .resolve_reserved(&cpus("0-3"), &cpus("0"))
            .expect_err("absent");
        assert_eq!(
            e.to_string(),
            "built-in defaults: node.reserved_cpus: CPU 5 is not online on this node (online: 0-3)"
        );
    }

    #[test]
    fn gpu_overrides_must_name_existing_nodes() {
        let c = parse(
            "[[node.gpu]]\nindex = 0\nnuma_node = 0\n\n[[node.gpu]]\nindex = 1\nnuma_node = 3\n",
        )
        .expect("parses");
        c.check_gpu_overrides(&cpus("0-3")).expect("all exist");
        let e = c
            .check_gpu_overrides(&cpus("0-1"))
            .expect_err("node 3 absent");
        assert_eq!(
            e.to_string(),
            "/etc/lodger/lodger.toml:7: node.gpu[1].numa_node: NUMA node 3 does not exist on \
             this node (nodes: 0-1)"
        );
        Config::default()
            .check_gpu_overrides(&cpus("0"))
            .expect("no overrides");
    }

    #[test]
    fn error_at_points_at_the_key() {
        let c = parse("[api]\n\ngroup = \"trainers\"\n").expect("parses");
        assert_eq!(
            c.error_at("api.group", "no such group").to_string(),
            "/etc/lodger/lodger.toml:3: api.group: no such group"
        );
    }

    #[test]
    fn pid_jobs_auto_follows_the_hierarchy() {
        assert_eq!(PidJobs::Auto.effective(false), PidJobs::Cgroup);
        assert_eq!(PidJobs::Auto.effective(true), PidJobs::Affinity);
        assert_eq!(PidJobs::Cgroup.effective(true), PidJobs::Cgroup);
        assert_eq!(PidJobs::Affinity.effective(false), PidJobs::Affinity);
    }

    #[test]
    fn group_names() {
        for ok in ["lodger", "_svc", "gpu-admins", "Trainers", "machine$", "a"] {
            assert!(group_name(ok.to_string()).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "$",
            "-x",
            "9x",
            "a b",
            "a:b",
            "ünicode",
            &"x".repeat(33),
        ] {
            assert!(group_name(bad.to_string()).is_err(), "{bad}");
        }
    }

    #[test]
    fn serializes_in_toml_spelling() {
        let json = serde_json::to_value(Config::default()).expect("serialize");
        assert_eq!(json["node"]["reserved_cpus"], "auto");
        assert_eq!(json["cgroup"]["pid_jobs"], "auto");
        assert_eq!(json["log"]["level"], "info");
        assert_eq!(json["api"]["bus"], "system");
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        const VOCABULARY: &[&str] = &[
            "[node]",
            "[training]",
            "[agent]",
            "[api]",
            "[cgroup]",
            "[log]",
            "[[node.gpu]]",
            "[bogus]",
            "[agent.sub]",
            "",
            "# comment",
            "rt_priority = 0",
            "rt_priority = 50",
            "interval_ms = 0",
            "interval_ms = 500",
            "interval_ms = \"x\"",
            "state_dir = \"rel\"",
            "state_dir = \"/abs\"",
            "index = 0",
            "index = 1",
            "numa_node = 1",
            "level = \"info\"",
            "level = 3",
            "bus = \"system\"",
            "zzz = 1",
            "reserved_cpus = \"0-x\"",
            "reserved_cpus = \"0\"",
            "driver = \"v1\"",
            "group = \"9\"",
            "parent = \"a/b\"",
        ];

        proptest! {
            /// Any text is either a config or one error whose line lies inside the text.
            #[test]
            fn never_panics_and_lines_are_in_the_text(text in "(\\PC|\n|\\[|\\]|=|\"){0,200}") {
                if let Err(e) = parse(&text) {
                    let lines = text.split('\n').count();
                    if let Some(line) = e.line() {
                        prop_assert!(line >= 1 && line <= lines, "{e} for {text:?}");
                    }
                    prop_assert!(!e.to_string().contains('\n'), "multi-line: {e}");
                }
            }

            /// Files made of schema-shaped lines, valid or not: whenever an error names a key,
            /// the line it names is the one that holds that key.
            #[test]
            fn errors_point_at_the_line_of_their_key(
                lines in proptest::collection::vec(proptest::sample::select(VOCABULARY), 0..24)
            ) {
                let text = lines.join("\n");
                if let Err(e) = parse(&text) {
                    if let (Some(key), Some(line)) = (e.key(), e.line()) {
                        let last = key.rsplit('.').next().unwrap_or(&key);
                        let last = last.split('[').next().unwrap_or(last);
                        let held = text.split('\n').nth(line - 1).unwrap_or("");
                        prop_assert!(held.contains(last), "{e}\nline {line} is {held:?} in\n{text}");
                    }
                }
            }

            #[test]
            fn rt_priority_range(p in -200i64..300) {
                let result = parse(&format!("[training]\nrt_priority = {p}\n"));
                if (1..=99).contains(&p) {
                    prop_assert_eq!(result.expect("in range").training.rt_priority, i32::try_from(p).expect("small"));
                } else {
                    let e = result.expect_err("out of range");
                    prop_assert_eq!(e.line(), Some(2));
                    prop_assert_eq!(e.key(), Some("training.rt_priority".to_string()));
                }
            }
        }
    }
}
