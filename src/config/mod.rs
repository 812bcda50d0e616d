//! config: the schema of `/etc/lodger/lodger.toml`, its defaults and its validation, with errors
//! that name the file, the line and the key. Touches nothing but the one file it is asked to load.
//!
//! `config/lodger.toml` in the source tree is the documented default; `Config::default()` must
//! equal parsing it (a test holds the two together). Loading happens in two steps: the TOML is
//! deserialized into private `Raw*` structs whose values keep their byte spans, then each value
//! is checked and turned into the public, plain types. Checks that need the node (which CPUs and
//! NUMA nodes exist) run later, once the topology is read: `Config::resolve_reserved` and
//! `Config::check_gpu_overrides`.
//!
//! One file per section: `node`, `training`, `cgroup`, `daemon` (`[agent]`, `[api]`, `[log]`,
//! `[metrics]`), `sense`, `inference`, `rightsize`, `contention`, `network`, `batch`, `slurm`, `kubernetes`; each holds the
//! section's public type, its defaults, its `Raw*` form and its check. `value` holds the checks
//! they share, `error` the errors and how parser messages become them. Everything public is
//! re-exported here: `lodger::config::X` is the one path.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::de::DeTable;
use toml::Spanned;

mod batch;
mod cgroup;
mod contention;
mod daemon;
mod error;
mod inference;
mod kubernetes;
mod network;
mod node;
mod reload;
mod rightsize;
mod sense;
mod slurm;
#[cfg(test)]
mod tests;
mod training;
mod value;

pub use crate::job::memory::MemoryBound;
pub use batch::{BatchConfig, BatchPolicy};
pub use cgroup::{CgroupConfig, CgroupDriver, PidJobs};
pub use contention::ContentionSection;
pub use daemon::{
    AgentConfig, ApiConfig, BusKind, LogConfig, LogLevel, MetricsConfig, INTERVAL_MS_RANGE,
};
pub use error::{ConfigError, Location};
pub use inference::InferenceConfig;
pub use kubernetes::{GpuContainers, KubernetesConfig};
pub use network::{NetSteering, NetworkSection};
pub use node::{GpuOverride, NodeConfig, ReservedCpus};
pub use reload::{reload, Reload};
pub use rightsize::{RightsizeConfig, RightsizeMode};
pub use sense::{GpuSourceChoice, SenseConfig, PERF_MAX_FDS_RANGE, SENSE_INTERVAL_MS_RANGE};
pub use slurm::{SlurmConfig, SlurmKind, SlurmRule};
pub use training::{
    TrainingConfig, TrainingPolicy, RT_BUDGET_US_RANGE, RT_PERIOD_US, RT_PRIORITY_RANGE,
};

use batch::RawBatch;
use cgroup::RawCgroup;
use contention::RawContention;
use daemon::{RawAgent, RawApi, RawLog, RawMetrics};
use inference::RawInference;
use kubernetes::RawKubernetes;
use network::RawNetwork;
use node::RawNode;
use rightsize::RawRightsize;
use sense::RawSense;
use slurm::RawSlurm;
use training::RawTraining;

/// Where lodgerd looks for its config unless told otherwise.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/lodger/lodger.toml";

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
    pub batch: BatchConfig,
    pub slurm: SlurmConfig,
    pub kubernetes: KubernetesConfig,
    /// Where each value came from, so later checks can point at the line.
    #[serde(skip)]
    source: Source,
}

/// Keys lodger no longer reads, still accepted so that the files that set them keep loading
/// (`deny_unknown_fields` would refuse them, and lodgerd would not start after an upgrade that
/// kept an edited lodger.toml), with why.
pub const OBSOLETE_KEYS: &[(&str, &str)] = &[(
    "sense.history",
    "ignored: no sensing history is kept (the key never had an effect)",
)];

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
            batch,
            slurm,
            kubernetes,
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
            && *batch == other.batch
            && *slurm == other.slurm
            && *kubernetes == other.kubernetes
    }
}

impl Eq for Config {}

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

    /// What the file sets that does nothing, one line each, naming the line: the keys in
    /// [`OBSOLETE_KEYS`]. lodgerd logs them at start and `--check-config` prints them.
    pub fn warnings(&self) -> Vec<String> {
        OBSOLETE_KEYS
            .iter()
            .filter_map(|(key, why)| {
                let at = self.location_of(key);
                at.line.map(|_| format!("{at}: {key}: {why}; remove it"))
            })
            .collect()
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
    batch: Option<RawBatch>,
    slurm: Option<RawSlurm>,
    kubernetes: Option<RawKubernetes>,
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
        let batch = self.batch(raw.batch)?;
        let slurm = self.slurm(raw.slurm)?;
        let kubernetes = self.kubernetes(raw.kubernetes)?;
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
            batch,
            slurm,
            kubernetes,
            source: Source {
                path: Some(self.path.to_path_buf()),
                lines: self.lines,
            },
        })
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
}
