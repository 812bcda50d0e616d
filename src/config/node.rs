//! config::node: `[node]` and `[[node.gpu]]`: the reserved CPUs, where sysfs and procfs are,
//! GPU locality overrides; and the checks that need the node itself (which CPUs and NUMA nodes
//! exist), run once the topology is read. Touches no file.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use serde::{Deserialize, Serialize, Serializer};
use toml::Spanned;

use super::value::{absolute, in_range};
use super::{Config, ConfigError, Cx, Location};
use crate::cpuset::CpuSet;

/// GPU indices and NUMA node ids accepted in `[[node.gpu]]` before the node is known. The
/// kernel's MAX_NUMNODES is at most 1024.
const GPU_INDEX_RANGE: RangeInclusive<i64> = 0..=255;

const NUMA_NODE_RANGE: RangeInclusive<i64> = 0..=1023;

/// `[node]`: what lodger must know about the machine beyond what it reads from sysfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeConfig {
    pub reserved_cpus: ReservedCpus,
    /// `node.lendable_cpus`: the CPUs lodgers (inference instances, batch jobs) may use; `None`
    /// (`"all"`): every CPU but the reserved ones.
    #[serde(serialize_with = "lendable_spelling")]
    pub lendable_cpus: Option<CpuSet>,
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

/// `node.lendable_cpus` in its TOML spelling.
fn lendable_spelling<S: Serializer>(v: &Option<CpuSet>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        None => s.serialize_str("all"),
        Some(set) => s.collect_str(set),
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            reserved_cpus: ReservedCpus::Auto,
            lendable_cpus: None,
            sysfs_root: PathBuf::from("/sys"),
            proc_root: PathBuf::from("/proc"),
            gpu: Vec::new(),
        }
    }
}

impl Config {
    /// The CPUs to keep free of jobs on this node, where lodgerd keeps its own threads. `online`
    /// is the node's online CPUs, `cpu0_siblings` CPU 0's SMT siblings (with or without CPU 0
    /// itself) and `isolated` the online CPUs the kernel does not load-balance (`isolcpus=`),
    /// which no job is placed on either: the caller keeps them off with the reserved ones.
    ///
    /// A list must name only online CPUs and leave at least one that is not isolated for jobs.
    /// `auto` adapts instead of failing: CPU 0 and its siblings, or just CPU 0 if they are every
    /// CPU left (a 2-thread VM), or nothing on a single-CPU node; isolated CPUs are not counted.
    pub fn resolve_reserved(
        &self,
        online: &CpuSet,
        cpu0_siblings: &CpuSet,
        isolated: &CpuSet,
    ) -> Result<CpuSet, ConfigError> {
        const KEY: &str = "node.reserved_cpus";
        let usable = online.difference(isolated);
        if usable.is_empty() && !online.is_empty() {
            return Err(self.error_at(
                KEY,
                format!(
                    "every online CPU ({online}) is isolated by the kernel (isolcpus=), and \
                     lodger places no job on isolated CPUs; leave some out of isolcpus="
                ),
            ));
        }
        match &self.node.reserved_cpus {
            ReservedCpus::Auto => {
                let mut core0 = cpu0_siblings.clone();
                core0.insert(0);
                let core0 = core0.intersection(&usable);
                if core0.len() < usable.len() {
                    Ok(core0)
                } else if usable.len() > 1 {
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
                if usable.is_subset(wanted) {
                    return Err(self.error_at(
                        KEY,
                        format!(
                            "reserves every online CPU ({online}) but the isolated ones \
                             ({isolated}, isolcpus=), where lodger places no job; leave at \
                             least one for jobs"
                        ),
                    ));
                }
                Ok(wanted.clone())
            }
        }
    }

    /// The CPUs lodgers may use on this node: `node.lendable_cpus` (every CPU of it online)
    /// less `reserved`, or every online CPU but the reserved ones.
    pub fn resolve_lendable(
        &self,
        online: &CpuSet,
        reserved: &CpuSet,
    ) -> Result<CpuSet, ConfigError> {
        let Some(wanted) = &self.node.lendable_cpus else {
            return Ok(online.difference(reserved));
        };
        let missing = wanted.difference(online);
        if !missing.is_empty() {
            return Err(self.error_at(
                "node.lendable_cpus",
                format!("CPUs {missing} are not online on this node (online: {online})"),
            ));
        }
        Ok(wanted.difference(reserved))
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawNode {
    reserved_cpus: Option<Spanned<String>>,
    lendable_cpus: Option<Spanned<String>>,
    sysfs_root: Option<Spanned<String>>,
    proc_root: Option<Spanned<String>>,
    gpu: Option<Vec<Spanned<RawGpu>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawGpu {
    index: Option<Spanned<i64>>,
    numa_node: Option<Spanned<i64>>,
}

impl Cx<'_> {
    pub(super) fn node(&mut self, raw: Option<RawNode>) -> Result<NodeConfig, ConfigError> {
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
            lendable_cpus: self.field(
                "node.lendable_cpus",
                raw.lendable_cpus,
                d.lendable_cpus,
                |s| match s.trim() {
                    "all" => Ok(None),
                    list => CpuSet::parse(list).map(Some).map_err(|e| {
                        format!("must be \"all\" or a cpulist such as \"2-31,34-63\": {e}")
                    }),
                },
            )?,
            sysfs_root: self.field("node.sysfs_root", raw.sysfs_root, d.sysfs_root, absolute)?,
            proc_root: self.field("node.proc_root", raw.proc_root, d.proc_root, absolute)?,
            gpu: self.gpus(raw.gpu.unwrap_or_default())?,
        })
    }

    pub(super) fn gpus(
        &mut self,
        raw: Vec<Spanned<RawGpu>>,
    ) -> Result<Vec<GpuOverride>, ConfigError> {
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
}
