//! Network shaping for multi-node training (SODA §V-E, from §IV-C-2: a CPU job taking 80% of
//! the network slows 2-node training by 31.7% on average). While a multi-node training job runs,
//! each configured interface gets an HTB root that guarantees training traffic its share of
//! the line rate (75% by default) and holds CPU jobs to theirs (25%); when none runs, all of
//! it is removed. Touches the interfaces' qdiscs, classes and filters through the `tc` binary
//! (iproute2), an nftables table through `nft`, and v1 `net_cls` cgroups; commands run behind
//! [`TcRunner`] so that tests can record them.
//!
//! The tree on each interface (`H` is the handle major, `4c44` by default):
//!
//! ```text
//! H:   htb root, default H:10 (all traffic not from a CPU job is training's)
//! └─ H:1   rate = ceil = line rate
//!    ├─ H:10  training: rate 75%, ceil 100%
//!    └─ H:20  CPU jobs: rate 25%, ceil 25% (configurable)
//! ```
//!
//! CPU jobs' traffic reaches `H:20` by its cgroup ([`CpuJobs`]), steered one of two ways
//! ([`Steering`]):
//! - `tc` filters: cgroup v1 `net_cls.classid` = `H:20` and a `cgroup` filter; on cgroup v2 an
//!   nftables `socket cgroupv2` rule marks the packets and a `fw` filter maps the mark to `H:20`.
//!   Needs the kernel's `cls_cgroup` / `cls_fw`.
//! - nftables alone: a rule sets the packets' priority to `H:20` (`meta priority set`), which
//!   HTB takes as the class with no filter at all; matched by `meta cgroup` (the v1 classid) or
//!   `socket cgroupv2`. For kernels built without those classifiers.
//!
//! [`Steering::Auto`] tries the filters and falls back to nftables when `tc` reports the
//! classifier missing. nftables matches sockets of this network namespace in its output hook:
//! traffic a CPU job sends from its own network namespace (a bridged container) is not seen.
//!
//! Idempotent: each apply reads `tc qdisc/class/filter show` and `nft -j list table` first and
//! changes only what differs. Only lodger's own objects are touched or removed: the root qdisc
//! with lodger's handle and the nftables table named `lodger`; another root qdisc someone
//! configured is an error ([`TcError::ForeignRoot`]) unless `replace_foreign_root` is set.
//!
//! Rooms: [`htb`] (the HTB tree on one interface), [`nft`] (the nftables table), [`net_cls`] (v1
//! `net_cls` cgroups), [`route`] (the two-network alternative), [`node`] (what the agent drives
//! each tick); this file holds the whole node's shaping ([`NetworkShaping`]), its configuration
//! and errors, and the [`TcRunner`] seam every command goes through. May touch `sys::command`
//! and `sys::cgroupfs`; nothing above enforce.

pub mod htb;
mod leftovers;
pub mod net_cls;
pub mod nft;
pub mod node;
pub mod route;
mod runner;

#[cfg(test)]
mod overrun_tests;
#[cfg(test)]
mod tests;

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::htb::{parse_rate, ObservedClass, ObservedFilter, RootQdisc, Shaper, TcFilter};
pub use self::leftovers::{remove_leftovers, remove_leftovers_but, Own};
pub use self::net_cls::NetClsGroup;
pub(crate) use self::net_cls::{dissolve_cgroup, read_pids, write_value};
pub(crate) use self::nft::check_cgroup_path;
pub use self::nft::{CpuJobMatch, NftAction, NftRule, NftSteering, ObservedTable};
pub use self::node::{
    procs_of, Classifier, CpuJob, NetworkControl, NetworkEvent, NetworkWant, CPU_JOBS_MARK,
    NET_CLS_GROUP, VERIFY_TICKS,
};
pub use self::route::{CpuJobsRoute, SlowNetwork};
pub use self::runner::{RecordingRunner, TcRunner};

/// The `tc` binary (iproute2).
pub const TC: &str = "tc";
/// The `nft` binary (nftables).
pub const NFT: &str = "nft";
/// lodger's HTB handle major: `4c44:` ("LD").
pub const DEFAULT_HANDLE: u16 = 0x4c44;
/// lodger's nftables table (family `inet`).
pub const DEFAULT_NFT_TABLE: &str = "lodger";
/// The v1 file holding a cgroup's class id.
pub const NET_CLS_CLASSID: &str = "net_cls.classid";

const PARENT_MINOR: u16 = 0x1;
const TRAINING_MINOR: u16 = 0x10;
const CPU_JOBS_MINOR: u16 = 0x20;
/// Filter preferences lodger uses under its qdisc.
const CGROUP_FILTER_PREF: u32 = 10;
const FW_FILTER_PREF: u32 = 20;
const NFT_FAMILY: &str = "inet";
const NFT_CHAIN: &str = "output";
/// `priority mangle`: where packets are changed, before filtering.
const NFT_CHAIN_PRIO: i64 = -150;
/// HTB's own upper bound on a class quantum (it warns and clamps above it).
const HTB_MAX_QUANTUM: u64 = 200_000;
/// One full Ethernet frame: a class quantum below it would starve large packets.
const MIN_QUANTUM: u64 = 1_514;
const IFNAMSIZ: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum TcError {
    #[error("cannot run `{argv}`: {source}")]
    Spawn { argv: String, source: io::Error },
    #[error("`{argv}` failed ({status}): {stderr}")]
    Failed {
        argv: String,
        status: String,
        stderr: String,
    },
    /// The kernel (or `tc`) lacks the classifier: `cls_cgroup` or `cls_fw`.
    #[error("`{argv}`: the kernel has no '{kind}' tc classifier ({stderr})")]
    ClassifierMissing {
        argv: String,
        kind: &'static str,
        stderr: String,
    },
    #[error(
        "{interface}: the root qdisc is {kind} {handle}, not lodger's: remove it, or set \
         replace_foreign_root to let lodger replace it"
    )]
    ForeignRoot {
        interface: String,
        kind: String,
        handle: String,
    },
    #[error("`{argv}`: cannot understand '{line}': {reason}")]
    Unparsed {
        argv: String,
        line: String,
        reason: String,
    },
    /// A command overran the runner's deadline and was killed.
    #[error("`{argv}` did not finish within {deadline:?}: killed")]
    TimedOut { argv: String, deadline: Duration },
    #[error("network shaping: {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write '{value}' to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("cannot create cgroup {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot remove cgroup {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

impl TcError {
    fn config(field: &'static str, reason: impl Into<String>) -> Self {
        TcError::Config {
            field,
            reason: reason.into(),
        }
    }
}

/// `program` followed by the words of `line`.
fn argv(program: &str, line: &str) -> Vec<String> {
    std::iter::once(program)
        .chain(line.split_whitespace())
        .map(str::to_string)
        .collect()
}

fn show_argv(argv: &[String]) -> String {
    argv.join(" ")
}

// ---------------------------------------------------------------------------------------------
// Configuration.

/// A tc class id, `major:minor` in hex (`4c44:20`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ClassId {
    pub major: u16,
    pub minor: u16,
}

impl ClassId {
    /// As one number: what `net_cls.classid`, `skb->priority` and fw marks hold.
    pub fn as_u32(self) -> u32 {
        (u32::from(self.major) << 16) | u32::from(self.minor)
    }

    /// Parses `4c44:20` (either part may be empty, meaning 0).
    pub fn parse(s: &str) -> Option<Self> {
        let (major, minor) = s.split_once(':')?;
        let hex = |p: &str| {
            if p.is_empty() {
                Some(0)
            } else {
                u16::from_str_radix(p, 16).ok()
            }
        };
        Some(Self {
            major: hex(major)?,
            minor: hex(minor)?,
        })
    }
}

impl fmt::Display for ClassId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}:{:x}", self.major, self.minor)
    }
}

/// One interface to shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub interface: String,
    /// The line rate the shares are of, Mbit/s (the NIC's speed, or less when a switch port is
    /// the narrower part of the path).
    pub line_rate_mbit: u64,
}

/// `[network]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShapingConfig {
    pub links: Vec<Link>,
    /// Guaranteed to training traffic, percent of the line rate (SODA §V-E: 75).
    pub training_percent: u32,
    /// Guaranteed to CPU jobs, percent of the line rate (SODA §V-E: 25).
    pub cpu_jobs_percent: u32,
    /// The most CPU jobs may use, percent of the line rate. SODA holds them to their 25%;
    /// higher lets them borrow what training leaves idle.
    pub cpu_jobs_ceil_percent: u32,
    /// lodger's HTB handle major.
    pub handle: u16,
    /// Replace a root qdisc lodger did not make (a kernel default is always replaced).
    pub replace_foreign_root: bool,
    pub nft_table: String,
}

impl Default for ShapingConfig {
    fn default() -> Self {
        Self {
            links: Vec::new(),
            training_percent: 75,
            cpu_jobs_percent: 25,
            cpu_jobs_ceil_percent: 25,
            handle: DEFAULT_HANDLE,
            replace_foreign_root: false,
            nft_table: DEFAULT_NFT_TABLE.to_string(),
        }
    }
}

impl ShapingConfig {
    pub fn validate(&self) -> Result<(), TcError> {
        if self.links.is_empty() {
            return Err(TcError::config("links", "no interface to shape"));
        }
        for (i, link) in self.links.iter().enumerate() {
            check_interface(&link.interface)?;
            if link.line_rate_mbit == 0 {
                return Err(TcError::config(
                    "line_rate_mbit",
                    format!("{}: must be positive", link.interface),
                ));
            }
            if self.links[..i]
                .iter()
                .any(|l| l.interface == link.interface)
            {
                return Err(TcError::config(
                    "links",
                    format!("{} is listed twice", link.interface),
                ));
            }
        }
        if self.training_percent == 0 || self.cpu_jobs_percent == 0 {
            return Err(TcError::config(
                "training_percent",
                "both shares must be positive",
            ));
        }
        if self.training_percent + self.cpu_jobs_percent > 100 {
            return Err(TcError::config(
                "cpu_jobs_percent",
                format!(
                    "training {}% + CPU jobs {}% is more than the line rate",
                    self.training_percent, self.cpu_jobs_percent
                ),
            ));
        }
        if self.cpu_jobs_ceil_percent < self.cpu_jobs_percent || self.cpu_jobs_ceil_percent > 100 {
            return Err(TcError::config(
                "cpu_jobs_ceil_percent",
                format!(
                    "{} must be between cpu_jobs_percent ({}) and 100",
                    self.cpu_jobs_ceil_percent, self.cpu_jobs_percent
                ),
            ));
        }
        if self.handle == 0 || self.handle == 0xffff {
            return Err(TcError::config(
                "handle",
                "0 and ffff are reserved by the kernel",
            ));
        }
        if self.nft_table.is_empty()
            || !self
                .nft_table
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(TcError::config(
                "nft_table",
                format!("'{}' is not a plain name", self.nft_table),
            ));
        }
        Ok(())
    }
}

/// Refuses a name the kernel cannot have as an interface (empty, too long, `/`, `:`, blanks).
pub fn check_interface(name: &str) -> Result<(), TcError> {
    let ok = !name.is_empty()
        && name.len() < IFNAMSIZ
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
    if ok {
        Ok(())
    } else {
        Err(TcError::config(
            "interface",
            format!("'{name}' is not an interface name"),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// The whole node.

/// How CPU jobs are found: by their v1 `net_cls` class id, or by their cgroup2 paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuJobs {
    /// cgroup v1: CPU jobs' processes sit in `net_cls` cgroups whose `net_cls.classid` is
    /// [`NetworkShaping::net_cls_classid`] (see [`NetClsGroup`]).
    NetCls,
    /// cgroup v2: the CPU jobs' cgroups, relative to the cgroup2 root.
    CgroupV2(Vec<String>),
}

/// How CPU jobs' packets are steered into their class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Steering {
    /// `tc` filters where the kernel has them, else nftables.
    #[default]
    Auto,
    /// `cgroup` filter (v1) or nftables mark + `fw` filter (v2).
    TcFilter,
    /// nftables sets the packets' priority to the class; no tc filter.
    Nft,
}

/// What [`NetworkShaping::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub changed: bool,
    /// The steering in use (`Auto` resolved).
    pub steering: Steering,
}

/// Network shaping for the node: a [`Shaper`] per interface and lodger's nftables table.
#[derive(Debug, Clone)]
pub struct NetworkShaping {
    shapers: Vec<Shaper>,
    nft: NftSteering,
    handle: u16,
    steering: Steering,
    /// `Auto` resolved by a first apply.
    resolved: Option<Steering>,
}

impl NetworkShaping {
    pub fn new(config: &ShapingConfig, steering: Steering) -> Result<Self, TcError> {
        config.validate()?;
        let shapers = config
            .links
            .iter()
            .map(|l| Shaper::new(l.clone(), config))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            shapers,
            nft: NftSteering::new(&config.nft_table),
            handle: config.handle,
            steering,
            resolved: None,
        })
    }

    pub fn shapers(&self) -> &[Shaper] {
        &self.shapers
    }

    pub fn nft(&self) -> &NftSteering {
        &self.nft
    }

    /// The class CPU jobs' traffic goes to on every interface.
    pub fn cpu_jobs_class(&self) -> ClassId {
        ClassId {
            major: self.handle,
            minor: CPU_JOBS_MINOR,
        }
    }

    /// The value for a CPU job's v1 `net_cls.classid`.
    pub fn net_cls_classid(&self) -> u32 {
        self.cpu_jobs_class().as_u32()
    }

    /// The steering in use: `Auto` until an apply resolved it.
    pub fn steering(&self) -> Steering {
        self.resolved.unwrap_or(self.steering)
    }

    /// The tc filter and nftables rules for `cpu_jobs` under `steering` (not `Auto`).
    pub fn classification(
        &self,
        cpu_jobs: &CpuJobs,
        steering: Steering,
    ) -> (TcFilter, Vec<NftRule>) {
        let class = self.cpu_jobs_class();
        let mark = class.as_u32();
        match (cpu_jobs, steering) {
            (CpuJobs::NetCls, Steering::Nft) => (
                TcFilter::None,
                vec![NftRule {
                    matches: CpuJobMatch::NetClsClassid(class.as_u32()),
                    action: NftAction::Priority(class),
                }],
            ),
            (CpuJobs::NetCls, _) => (TcFilter::Cgroup, Vec::new()),
            (CpuJobs::CgroupV2(paths), Steering::Nft) => (
                TcFilter::None,
                paths
                    .iter()
                    .map(|p| NftRule {
                        matches: CpuJobMatch::CgroupV2(p.clone()),
                        action: NftAction::Priority(class),
                    })
                    .collect(),
            ),
            (CpuJobs::CgroupV2(paths), _) => (
                TcFilter::Fw { mark },
                paths
                    .iter()
                    .map(|p| NftRule {
                        matches: CpuJobMatch::CgroupV2(p.clone()),
                        action: NftAction::Mark(mark),
                    })
                    .collect(),
            ),
        }
    }

    /// Shapes every interface and steers `cpu_jobs` into their class. With `Auto`, a kernel
    /// without the tc classifier makes it fall back to nftables (and stay there).
    pub fn apply(
        &mut self,
        runner: &mut dyn TcRunner,
        cpu_jobs: &CpuJobs,
    ) -> Result<Applied, TcError> {
        let steering = match self.steering() {
            Steering::Auto => Steering::TcFilter,
            s => s,
        };
        match self.apply_with(runner, cpu_jobs, steering) {
            Err(TcError::ClassifierMissing { .. })
                if self.steering == Steering::Auto && steering == Steering::TcFilter =>
            {
                self.resolved = Some(Steering::Nft);
                let mut applied = self.apply_with(runner, cpu_jobs, Steering::Nft)?;
                // The failed attempt had already built the classes.
                applied.changed = true;
                Ok(applied)
            }
            Ok(applied) => {
                self.resolved = Some(steering);
                Ok(applied)
            }
            Err(e) => Err(e),
        }
    }

    fn apply_with(
        &self,
        runner: &mut dyn TcRunner,
        cpu_jobs: &CpuJobs,
        steering: Steering,
    ) -> Result<Applied, TcError> {
        let (filter, rules) = self.classification(cpu_jobs, steering);
        let mut changed = false;
        // Marks before the filters that read them; priorities before nothing.
        changed |= self.nft.apply(runner, &rules)?;
        for shaper in &self.shapers {
            changed |= shaper.apply(runner, filter)?;
        }
        Ok(Applied { changed, steering })
    }

    /// Removes every interface's tree and lodger's nftables table. Returns whether anything was
    /// there. Tries them all before reporting the first error.
    pub fn remove(&mut self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        let mut changed = false;
        let mut first_error = None;
        for shaper in &self.shapers {
            match shaper.remove(runner) {
                Ok(c) => changed |= c,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match self.nft.remove(runner) {
            Ok(c) => changed |= c,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(changed),
        }
    }

    /// SODA §V-E: shaping while a multi-node training job runs on the node, none otherwise.
    pub fn reconcile(
        &mut self,
        runner: &mut dyn TcRunner,
        multi_node_training: bool,
        cpu_jobs: &CpuJobs,
    ) -> Result<Applied, TcError> {
        if multi_node_training {
            self.apply(runner, cpu_jobs)
        } else {
            Ok(Applied {
                changed: self.remove(runner)?,
                steering: self.steering(),
            })
        }
    }
}
