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

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

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
const CGROUP_PROCS: &str = "cgroup.procs";
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
// Running commands.

/// Runs one command given as an argv vector and returns its standard output. A non-zero exit is
/// [`TcError::Failed`] with the standard error.
pub trait TcRunner: Send {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError>;
}

/// Runs commands for real, optionally behind a prefix (`ip netns exec NAME`).
#[derive(Debug, Clone, Default)]
pub struct CommandRunner {
    prefix: Vec<String>,
}

impl CommandRunner {
    /// Runs in lodgerd's own network namespace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs every command inside the named network namespace (`ip netns exec NAME ...`).
    pub fn in_netns(name: &str) -> Self {
        Self {
            prefix: ["ip", "netns", "exec", name]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        }
    }
}

impl TcRunner for CommandRunner {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError> {
        let full: Vec<&String> = self.prefix.iter().chain(argv).collect();
        let shown = full
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(" ");
        let Some((program, args)) = full.split_first() else {
            return Err(TcError::Spawn {
                argv: shown,
                source: io::Error::new(io::ErrorKind::InvalidInput, "empty command"),
            });
        };
        let out = Command::new(program)
            .args(args)
            // tc's and nft's messages are matched below: keep them in English.
            .env("LC_ALL", "C")
            .output()
            .map_err(|source| TcError::Spawn {
                argv: shown.clone(),
                source,
            })?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        Err(TcError::Failed {
            argv: show_argv(argv),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// A fake runner for tests: records every argv and answers from scripted replies (the last
/// reply whose prefix matches wins; otherwise empty output).
#[derive(Debug, Clone, Default)]
pub struct RecordingRunner {
    pub calls: Vec<Vec<String>>,
    replies: Vec<(Vec<String>, Result<String, String>)>,
}

impl RecordingRunner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Commands starting with `prefix` print `stdout`.
    pub fn reply(&mut self, prefix: &[&str], stdout: &str) -> &mut Self {
        self.replies.push((owned(prefix), Ok(stdout.to_string())));
        self
    }

    /// Commands starting with `prefix` fail with `stderr`.
    pub fn fail(&mut self, prefix: &[&str], stderr: &str) -> &mut Self {
        self.replies.push((owned(prefix), Err(stderr.to_string())));
        self
    }

    /// The recorded commands, each joined with spaces.
    pub fn lines(&self) -> Vec<String> {
        self.calls.iter().map(|c| c.join(" ")).collect()
    }

    /// The recorded commands that change something (not `show` or `list`).
    pub fn changes(&self) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| !l.contains(" show ") && !l.contains(" list "))
            .collect()
    }
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

impl TcRunner for RecordingRunner {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError> {
        self.calls.push(argv.to_vec());
        let reply = self
            .replies
            .iter()
            .rev()
            .find(|(prefix, _)| argv.starts_with(prefix))
            .map(|(_, r)| r.clone());
        match reply {
            None => Ok(String::new()),
            Some(Ok(out)) => Ok(out),
            Some(Err(stderr)) => Err(TcError::Failed {
                argv: show_argv(argv),
                status: "exit status: 2".to_string(),
                stderr,
            }),
        }
    }
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
// One interface.

/// How CPU jobs' packets reach their class on an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcFilter {
    /// No filter: nftables sets the packets' priority to the class (or nothing is classified).
    None,
    /// cgroup v1: the `cgroup` classifier reads the socket's `net_cls.classid`.
    Cgroup,
    /// The `fw` classifier maps this packet mark to the CPU jobs' class.
    Fw { mark: u32 },
}

/// What an interface's root qdisc is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootQdisc {
    /// lodger's HTB.
    Lodger,
    /// One the kernel attached by itself (handle `0:`: `noqueue`, `pfifo_fast`, `mq`,
    /// `fq_codel`, ...), replaced freely.
    KernelDefault { kind: String },
    /// One someone configured.
    Foreign { kind: String, handle: String },
}

/// One HTB class as `tc class show` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedClass {
    pub id: ClassId,
    /// `None`: attached at the root.
    pub parent: Option<ClassId>,
    pub rate_bits: u64,
    pub ceil_bits: u64,
}

/// One filter line of `tc filter show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedFilter {
    pub pref: u32,
    pub kind: String,
    pub handle: Option<String>,
    pub classid: Option<ClassId>,
}

/// An HTB class lodger wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WantedClass {
    id: ClassId,
    parent: Option<ClassId>,
    rate_bits: u64,
    ceil_bits: u64,
}

/// The HTB tree on one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shaper {
    link: Link,
    training_percent: u32,
    cpu_jobs_percent: u32,
    cpu_jobs_ceil_percent: u32,
    handle: u16,
    replace_foreign_root: bool,
}

impl Shaper {
    pub fn new(link: Link, config: &ShapingConfig) -> Result<Self, TcError> {
        check_interface(&link.interface)?;
        Ok(Self {
            link,
            training_percent: config.training_percent,
            cpu_jobs_percent: config.cpu_jobs_percent,
            cpu_jobs_ceil_percent: config.cpu_jobs_ceil_percent,
            handle: config.handle,
            replace_foreign_root: config.replace_foreign_root,
        })
    }

    pub fn interface(&self) -> &str {
        &self.link.interface
    }

    fn class(&self, minor: u16) -> ClassId {
        ClassId {
            major: self.handle,
            minor,
        }
    }

    pub fn training_class(&self) -> ClassId {
        self.class(TRAINING_MINOR)
    }

    pub fn cpu_jobs_class(&self) -> ClassId {
        self.class(CPU_JOBS_MINOR)
    }

    fn qdisc_handle(&self) -> String {
        format!("{:x}:", self.handle)
    }

    fn wanted_classes(&self) -> [WantedClass; 3] {
        let line = self.link.line_rate_mbit.saturating_mul(1_000_000);
        let share = |p: u32| line / 100 * u64::from(p) + line % 100 * u64::from(p) / 100;
        let parent = self.class(PARENT_MINOR);
        [
            WantedClass {
                id: parent,
                parent: None,
                rate_bits: line,
                ceil_bits: line,
            },
            WantedClass {
                id: self.training_class(),
                parent: Some(parent),
                rate_bits: share(self.training_percent),
                ceil_bits: line,
            },
            WantedClass {
                id: self.cpu_jobs_class(),
                parent: Some(parent),
                rate_bits: share(self.cpu_jobs_percent),
                ceil_bits: share(self.cpu_jobs_ceil_percent),
            },
        ]
    }

    /// `tc` and `line` split at whitespace. Every word lodger puts in a line is validated to
    /// have none (interface names, handles, numbers).
    fn tc(&self, line: &str) -> Vec<String> {
        argv(TC, line)
    }

    /// `tc qdisc replace dev IF root handle H: htb default 10`
    fn root_argv(&self) -> Vec<String> {
        self.tc(&format!(
            "qdisc replace dev {} root handle {} htb default {TRAINING_MINOR:x}",
            self.interface(),
            self.qdisc_handle()
        ))
    }

    fn class_argv(&self, c: &WantedClass) -> Vec<String> {
        let parent = c
            .parent
            .map_or_else(|| self.qdisc_handle(), |p| p.to_string());
        // HTB derives the quantum from rate / r2q and warns when it falls outside what it
        // accepts: give it one in range, at least a full frame.
        let quantum = (c.rate_bits / 8 / 10).clamp(MIN_QUANTUM, HTB_MAX_QUANTUM);
        self.tc(&format!(
            "class replace dev {} parent {parent} classid {} htb rate {}bit ceil {}bit quantum {quantum}",
            self.interface(),
            c.id,
            c.rate_bits,
            c.ceil_bits
        ))
    }

    fn filter_argv(&self, filter: TcFilter) -> Option<Vec<String>> {
        let head = format!(
            "filter add dev {} parent {} protocol all",
            self.interface(),
            self.qdisc_handle()
        );
        match filter {
            TcFilter::None => None,
            TcFilter::Cgroup => Some(self.tc(&format!(
                "{head} prio {CGROUP_FILTER_PREF} handle 1: cgroup"
            ))),
            TcFilter::Fw { mark } => Some(self.tc(&format!(
                "{head} prio {FW_FILTER_PREF} handle {mark:#x} fw classid {}",
                self.cpu_jobs_class()
            ))),
        }
    }

    /// The commands that build the tree from nothing: what `apply` runs on a fresh interface,
    /// and what advise mode shows.
    pub fn build_argv(&self, filter: TcFilter) -> Vec<Vec<String>> {
        let mut all = vec![self.root_argv()];
        for c in self.wanted_classes() {
            all.push(self.class_argv(&c));
        }
        all.extend(self.filter_argv(filter));
        all
    }

    /// The interface's root qdisc.
    pub fn root(&self, runner: &mut dyn TcRunner) -> Result<RootQdisc, TcError> {
        let argv = self.tc(&format!("qdisc show dev {}", self.interface()));
        let out = runner.run(&argv)?;
        for line in out.lines() {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"qdisc") || !tokens.contains(&"root") {
                continue;
            }
            let (Some(kind), Some(handle)) = (tokens.get(1), tokens.get(2)) else {
                return Err(TcError::Unparsed {
                    argv: show_argv(&argv),
                    line: line.to_string(),
                    reason: "no kind and handle".to_string(),
                });
            };
            let ours = ClassId::parse(handle).is_some_and(|h| h.major == self.handle);
            return Ok(if *kind == "htb" && ours {
                RootQdisc::Lodger
            } else if ClassId::parse(handle).is_some_and(|h| h.major == 0) {
                RootQdisc::KernelDefault {
                    kind: kind.to_string(),
                }
            } else {
                RootQdisc::Foreign {
                    kind: kind.to_string(),
                    handle: handle.to_string(),
                }
            });
        }
        // No root line: a device with no queue at all, as good as a default.
        Ok(RootQdisc::KernelDefault {
            kind: "none".to_string(),
        })
    }

    /// The HTB classes under lodger's qdisc.
    pub fn classes(&self, runner: &mut dyn TcRunner) -> Result<Vec<ObservedClass>, TcError> {
        let argv = self.tc(&format!("class show dev {}", self.interface()));
        let out = runner.run(&argv)?;
        let mut classes = Vec::new();
        for line in out.lines() {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"class") || tokens.get(1) != Some(&"htb") {
                continue;
            }
            let bad = |reason: &str| TcError::Unparsed {
                argv: show_argv(&argv),
                line: line.to_string(),
                reason: reason.to_string(),
            };
            let id = tokens
                .get(2)
                .and_then(|t| ClassId::parse(t))
                .ok_or_else(|| bad("no class id"))?;
            if id.major != self.handle {
                continue;
            }
            let after = |key: &str| {
                tokens
                    .iter()
                    .position(|t| *t == key)
                    .and_then(|i| tokens.get(i + 1))
                    .copied()
            };
            let parent = match after("parent") {
                Some(p) => Some(ClassId::parse(p).ok_or_else(|| bad("bad parent"))?),
                None => None,
            };
            let rate = after("rate")
                .and_then(parse_rate)
                .ok_or_else(|| bad("no rate"))?;
            let ceil = after("ceil")
                .and_then(parse_rate)
                .ok_or_else(|| bad("no ceil"))?;
            classes.push(ObservedClass {
                id,
                parent,
                rate_bits: rate,
                ceil_bits: ceil,
            });
        }
        Ok(classes)
    }

    /// The filters attached to lodger's qdisc.
    pub fn filters(&self, runner: &mut dyn TcRunner) -> Result<Vec<ObservedFilter>, TcError> {
        let argv = self.tc(&format!(
            "filter show dev {} parent {}",
            self.interface(),
            self.qdisc_handle()
        ));
        let out = runner.run(&argv)?;
        let mut filters = Vec::new();
        for line in out.lines() {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"filter") {
                continue;
            }
            let Some(i) = tokens.iter().position(|t| *t == "pref") else {
                continue;
            };
            let pref = tokens.get(i + 1).and_then(|p| p.parse().ok());
            let (Some(pref), Some(kind)) = (pref, tokens.get(i + 2)) else {
                return Err(TcError::Unparsed {
                    argv: show_argv(&argv),
                    line: line.to_string(),
                    reason: "no pref and kind".to_string(),
                });
            };
            let after = |key: &str| {
                tokens
                    .iter()
                    .position(|t| *t == key)
                    .and_then(|i| tokens.get(i + 1))
                    .copied()
            };
            filters.push(ObservedFilter {
                pref,
                kind: kind.to_string(),
                handle: after("handle").map(str::to_string),
                classid: after("classid").and_then(ClassId::parse),
            });
        }
        Ok(filters)
    }

    /// Makes the interface carry lodger's tree with `filter`; returns whether anything changed.
    pub fn apply(&self, runner: &mut dyn TcRunner, filter: TcFilter) -> Result<bool, TcError> {
        let fresh = match self.root(runner)? {
            RootQdisc::Lodger => false,
            RootQdisc::KernelDefault { .. } => true,
            RootQdisc::Foreign { kind, handle } => {
                if !self.replace_foreign_root {
                    return Err(TcError::ForeignRoot {
                        interface: self.interface().to_string(),
                        kind,
                        handle,
                    });
                }
                true
            }
        };
        if fresh {
            for argv in self.build_argv(filter) {
                run_filter_aware(runner, &argv, filter)?;
            }
            return Ok(true);
        }
        let mut changed = false;
        let observed = self.classes(runner)?;
        let wanted = self.wanted_classes();
        for w in &wanted {
            let same = observed.iter().any(|o| {
                o.id == w.id
                    && o.parent == w.parent
                    && close(o.rate_bits, w.rate_bits)
                    && close(o.ceil_bits, w.ceil_bits)
            });
            if !same {
                runner.run(&self.class_argv(w))?;
                changed = true;
            }
        }
        // Classes lodger did not make under its qdisc: children before root-level ones.
        let mut extra: Vec<&ObservedClass> = observed
            .iter()
            .filter(|o| !wanted.iter().any(|w| w.id == o.id))
            .collect();
        extra.sort_by_key(|o| o.parent.is_none());
        for o in extra {
            runner.run(&self.tc(&format!(
                "class del dev {} classid {}",
                self.interface(),
                o.id
            )))?;
            changed = true;
        }
        let filters = self.filters(runner)?;
        if !self.filters_match(&filters, filter) {
            let mut prefs: Vec<u32> = filters.iter().map(|f| f.pref).collect();
            prefs.sort_unstable();
            prefs.dedup();
            for pref in prefs {
                runner.run(&self.tc(&format!(
                    "filter del dev {} parent {} prio {pref}",
                    self.interface(),
                    self.qdisc_handle()
                )))?;
            }
            if let Some(argv) = self.filter_argv(filter) {
                run_filter_aware(runner, &argv, filter)?;
            }
            changed = true;
        }
        Ok(changed)
    }

    fn filters_match(&self, observed: &[ObservedFilter], filter: TcFilter) -> bool {
        match filter {
            TcFilter::None => observed.is_empty(),
            TcFilter::Cgroup => {
                !observed.is_empty()
                    && observed
                        .iter()
                        .all(|f| f.pref == CGROUP_FILTER_PREF && f.kind == "cgroup")
            }
            TcFilter::Fw { mark } => {
                let handle = format!("{mark:#x}");
                let class = self.cpu_jobs_class();
                observed
                    .iter()
                    .all(|f| f.pref == FW_FILTER_PREF && f.kind == "fw")
                    && observed.iter().any(|f| {
                        f.handle.as_deref() == Some(handle.as_str()) && f.classid == Some(class)
                    })
            }
        }
    }

    /// Removes lodger's tree (the kernel puts its default qdisc back). Leaves any other root
    /// qdisc alone; `Ok(false)` when there was nothing of lodger's.
    pub fn remove(&self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        if self.root(runner)? != RootQdisc::Lodger {
            return Ok(false);
        }
        runner.run(&self.tc(&format!("qdisc del dev {} root", self.interface())))?;
        Ok(true)
    }
}

/// Runs a command, turning "no such classifier" into [`TcError::ClassifierMissing`].
fn run_filter_aware(
    runner: &mut dyn TcRunner,
    argv: &[String],
    filter: TcFilter,
) -> Result<String, TcError> {
    match runner.run(argv) {
        Err(TcError::Failed {
            argv: shown,
            stderr,
            ..
        }) if argv.get(1).map(String::as_str) == Some("filter") && classifier_missing(&stderr) => {
            Err(TcError::ClassifierMissing {
                argv: shown,
                kind: match filter {
                    TcFilter::Fw { .. } => "fw",
                    _ => "cgroup",
                },
                stderr,
            })
        }
        other => other,
    }
}

/// tc's words when the kernel lacks a classifier ("TC classifier not found", the kernel's
/// extack) or tc itself does ("Unknown filter").
fn classifier_missing(stderr: &str) -> bool {
    stderr.contains("classifier not found") || stderr.contains("Unknown filter")
}

/// Rates as tc prints them are truncated to three significant digits at most: equal within
/// 0.1% (and a byte).
fn close(observed: u64, wanted: u64) -> bool {
    observed.abs_diff(wanted) <= (wanted / 1000).max(8)
}

/// `75Mbit`, `1600bit`, `2Gbit`, `10Kibit` → bits per second.
pub fn parse_rate(s: &str) -> Option<u64> {
    let number_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(number_end);
    let value: f64 = number.parse().ok()?;
    let unit = unit.strip_suffix("bit")?;
    let (prefix, iec) = match unit.strip_suffix('i') {
        Some(p) => (p, true),
        None => (unit, false),
    };
    let base: f64 = if iec { 1024.0 } else { 1000.0 };
    let exp = match prefix {
        "" => 0,
        "K" | "k" => 1,
        "M" => 2,
        "G" => 3,
        "T" => 4,
        _ => return None,
    };
    let bits = (value * base.powi(exp)).round();
    // A rate is far below 2^63: the conversion cannot wrap.
    (0.0..9.0e18).contains(&bits).then_some(bits as u64)
}

// ---------------------------------------------------------------------------------------------
// nftables.

/// Which cgroup marks a CPU job's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuJobMatch {
    /// cgroup v1: the socket's `net_cls.classid`.
    NetClsClassid(u32),
    /// cgroup v2: the socket's cgroup is this one or below it (path relative to the cgroup2
    /// root, e.g. `lodger/j3`). nft resolves the path when the rule is added, under
    /// `/sys/fs/cgroup`: add the rule after the cgroup exists, and again if it is recreated.
    CgroupV2(String),
}

impl CpuJobMatch {
    /// The match in nft's language.
    pub fn expression(&self) -> String {
        match self {
            CpuJobMatch::NetClsClassid(id) => format!("meta cgroup {id}"),
            CpuJobMatch::CgroupV2(path) => {
                let level = path.split('/').filter(|p| !p.is_empty()).count();
                format!("socket cgroupv2 level {level} \"{path}\"")
            }
        }
    }
}

/// What a matching packet gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NftAction {
    /// A mark, for a `fw` filter.
    Mark(u32),
    /// `skb->priority` = the class, which HTB takes directly.
    Priority(ClassId),
}

/// One rule of lodger's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule {
    pub matches: CpuJobMatch,
    pub action: NftAction,
}

impl NftRule {
    /// The rule in nft's language, without its comment.
    pub fn statement(&self) -> String {
        let m = self.matches.expression();
        let a = match self.action {
            NftAction::Mark(mark) => format!("meta mark set {mark:#010x}"),
            NftAction::Priority(class) => format!("meta priority set {class}"),
        };
        format!("{m} {a}")
    }

    /// The comment lodger tags the rule with: a digest of the statement, so an existing rule is
    /// recognised without parsing nft's rendering of it (rule comments are at most 128 bytes;
    /// cgroup paths can be longer).
    pub fn fingerprint(&self) -> String {
        format!("lodger:{:016x}", fnv1a(self.statement().as_bytes()))
    }
}

/// FNV-1a, 64 bit: stable across builds, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// lodger's nftables table (`inet <table>`, one `output` chain): rules that mark or classify
/// CPU jobs' packets. One per network namespace, shared by every shaped interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftSteering {
    table: String,
}

/// lodger's table as `nft -j list table` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedTable {
    /// The `output` chain exists with lodger's type, hook and priority.
    pub chain_ok: bool,
    /// The rules' comments, in order.
    pub comments: Vec<String>,
}

impl NftSteering {
    pub fn new(table: &str) -> Self {
        Self {
            table: table.to_string(),
        }
    }

    /// `nft` and `line` split at whitespace (the table name, cgroup paths and comments are
    /// validated to have none).
    fn nft(&self, line: &str) -> Vec<String> {
        argv(NFT, line)
    }

    /// lodger's table, or `None` when there is none.
    pub fn observe(&self, runner: &mut dyn TcRunner) -> Result<Option<ObservedTable>, TcError> {
        let argv = self.nft(&format!("-j list table {NFT_FAMILY} {}", self.table));
        let out = match runner.run(&argv) {
            Ok(out) => out,
            Err(TcError::Failed { stderr, .. }) if stderr.contains("No such file or directory") => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let bad = |reason: String| TcError::Unparsed {
            argv: show_argv(&argv),
            line: out.chars().take(200).collect(),
            reason,
        };
        let json: serde_json::Value =
            serde_json::from_str(&out).map_err(|e| bad(format!("not JSON: {e}")))?;
        let items = json
            .get("nftables")
            .and_then(|v| v.as_array())
            .ok_or_else(|| bad("no \"nftables\" array".to_string()))?;
        let mut table = ObservedTable {
            chain_ok: false,
            comments: Vec::new(),
        };
        for item in items {
            if let Some(chain) = item.get("chain") {
                let is =
                    |key: &str, want: &str| chain.get(key).and_then(|v| v.as_str()) == Some(want);
                if is("name", NFT_CHAIN) {
                    table.chain_ok = is("type", "filter")
                        && is("hook", "output")
                        && chain.get("prio").and_then(|v| v.as_i64()) == Some(NFT_CHAIN_PRIO);
                }
            }
            if let Some(rule) = item.get("rule") {
                if rule.get("chain").and_then(|v| v.as_str()) == Some(NFT_CHAIN) {
                    let comment = rule.get("comment").and_then(|v| v.as_str()).unwrap_or("");
                    table.comments.push(comment.to_string());
                }
            }
        }
        Ok(Some(table))
    }

    /// The one nft invocation that (re)creates the table with `rules`, atomically: nft applies a
    /// command line as one transaction.
    pub fn build_argv(&self, rules: &[NftRule]) -> Vec<String> {
        let t = format!("{NFT_FAMILY} {}", self.table);
        // add-then-delete empties a table that exists and is harmless when it does not.
        let mut script = format!(
            "add table {t} ; delete table {t} ; add table {t} ; \
             add chain {t} {NFT_CHAIN} {{ type filter hook output priority mangle ; policy accept ; }}"
        );
        for rule in rules {
            script.push_str(&format!(
                " ; add rule {t} {NFT_CHAIN} {} comment \"{}\"",
                rule.statement(),
                rule.fingerprint()
            ));
        }
        self.nft(&script)
    }

    /// Makes lodger's table hold exactly `rules` (none: no table). Returns whether it changed.
    pub fn apply(&self, runner: &mut dyn TcRunner, rules: &[NftRule]) -> Result<bool, TcError> {
        for rule in rules {
            if let CpuJobMatch::CgroupV2(path) = &rule.matches {
                check_cgroup_path(path)?;
            }
        }
        if rules.is_empty() {
            return self.remove(runner);
        }
        let wanted: Vec<String> = rules.iter().map(NftRule::fingerprint).collect();
        if let Some(table) = self.observe(runner)? {
            if table.chain_ok && table.comments == wanted {
                return Ok(false);
            }
        }
        runner.run(&self.build_argv(rules))?;
        Ok(true)
    }

    /// Deletes lodger's table; `Ok(false)` when there was none.
    pub fn remove(&self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        if self.observe(runner)?.is_none() {
            return Ok(false);
        }
        runner.run(&self.nft(&format!("delete table {NFT_FAMILY} {}", self.table)))?;
        Ok(true)
    }
}

pub(crate) fn check_cgroup_path(path: &str) -> Result<(), TcError> {
    let ok = !path.is_empty()
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
        && path
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\' && b != b';');
    if ok {
        Ok(())
    } else {
        Err(TcError::config(
            "cgroup",
            format!("'{path}' is not a relative cgroup2 path nft can take"),
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

// ---------------------------------------------------------------------------------------------
// cgroup v1 net_cls.

/// The mount point of the v1 `net_cls` hierarchy in a `/proc/self/mountinfo` text, if mounted.
pub fn find_net_cls_mount(mountinfo: &str) -> Option<PathBuf> {
    for line in mountinfo.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let mut post = after.split_whitespace();
        let (Some(fstype), Some(_source), Some(options)) = (post.next(), post.next(), post.next())
        else {
            continue;
        };
        if fstype != "cgroup" || !options.split(',').any(|o| o == "net_cls") {
            continue;
        }
        if let Some(mount_point) = before.split_whitespace().nth(4) {
            return Some(PathBuf::from(unescape_mountinfo(mount_point)));
        }
    }
    None
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        if let (b'\\', Some(d)) = (bytes[i], octal) {
            let value = d.iter().fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            if let Ok(b) = u8::try_from(value) {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A v1 `net_cls` cgroup whose sockets carry a class id: where a CPU job's processes go so the
/// `cgroup` classifier (or nftables `meta cgroup`) finds their packets. The class id sticks to a
/// socket when it is created and when its process moves in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetClsGroup {
    hierarchy: PathBuf,
    path: PathBuf,
}

impl NetClsGroup {
    /// Makes `<hierarchy>/<relative>` (parents too) or adopts it, and sets its class id if it
    /// differs. Returns the group and whether anything changed.
    pub fn create(hierarchy: &Path, relative: &str, classid: u32) -> Result<(Self, bool), TcError> {
        if relative.is_empty()
            || relative.starts_with('/')
            || relative
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(TcError::config(
                "net_cls cgroup",
                format!("'{relative}' is not a relative cgroup path"),
            ));
        }
        if !hierarchy.join(CGROUP_PROCS).is_file() {
            return Err(TcError::config(
                "net_cls cgroup",
                format!("{} is not a mounted cgroup hierarchy", hierarchy.display()),
            ));
        }
        let path = hierarchy.join(relative);
        let mut changed = false;
        if !path.is_dir() {
            fs::create_dir_all(&path).map_err(|source| TcError::Create {
                path: path.clone(),
                source,
            })?;
            changed = true;
        }
        let group = Self {
            hierarchy: hierarchy.to_path_buf(),
            path,
        };
        if group.classid()? != classid {
            write_value(&group.path.join(NET_CLS_CLASSID), &classid.to_string())?;
            changed = true;
        }
        Ok((group, changed))
    }

    /// The group at `<hierarchy>/<relative>` if it exists (to remove one a previous lodgerd
    /// made), without changing anything.
    pub fn open(hierarchy: &Path, relative: &str) -> Option<Self> {
        let path = hierarchy.join(relative);
        path.is_dir().then(|| Self {
            hierarchy: hierarchy.to_path_buf(),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The class id its sockets carry (0: none).
    pub fn classid(&self) -> Result<u32, TcError> {
        let path = self.path.join(NET_CLS_CLASSID);
        let text = fs::read_to_string(&path).map_err(|source| TcError::Read {
            path: path.clone(),
            source,
        })?;
        text.trim().parse().map_err(|_| TcError::Unparsed {
            argv: path.display().to_string(),
            line: text.trim().to_string(),
            reason: "not a class id".to_string(),
        })
    }

    /// The processes in it.
    pub fn procs(&self) -> Result<Vec<u32>, TcError> {
        read_pids(&self.path.join(CGROUP_PROCS))
    }

    /// Moves a process (all its threads) in; its existing sockets take the class id too.
    pub fn add_process(&self, pid: u32) -> Result<(), TcError> {
        write_value(&self.path.join(CGROUP_PROCS), &pid.to_string())
    }

    /// Moves its processes back to the hierarchy's root and removes it. `Ok(false)` when it
    /// was already gone.
    pub fn remove(self) -> Result<bool, TcError> {
        dissolve_cgroup(&self.path, &self.hierarchy)
    }
}

/// Moves the processes of the cgroup `dir` into the cgroup `back` (one that exits meanwhile is
/// skipped; a few rounds, for processes forking while it runs) and removes `dir`. `Ok(false)`
/// when it was already gone.
pub(crate) fn dissolve_cgroup(dir: &Path, back: &Path) -> Result<bool, TcError> {
    if !dir.is_dir() {
        return Ok(false);
    }
    for _ in 0..4 {
        let procs = read_pids(&dir.join(CGROUP_PROCS))?;
        if procs.is_empty() {
            break;
        }
        for pid in procs {
            match write_value(&back.join(CGROUP_PROCS), &pid.to_string()) {
                Ok(()) => {}
                // Exited meanwhile.
                Err(TcError::Write { source, .. })
                    if source.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(TcError::Remove {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

pub(crate) fn write_value(path: &Path, value: &str) -> Result<(), TcError> {
    let mut file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|source| TcError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        })?;
    file.write_all(value.as_bytes())
        .map_err(|source| TcError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        })
}

pub(crate) fn read_pids(path: &Path) -> Result<Vec<u32>, TcError> {
    let text = fs::read_to_string(path).map_err(|source| TcError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_TABLE: &str = "Error: No such file or directory\nlist table inet lodger\n";
    const DEFAULT_ROOT: &str = "qdisc noqueue 0: root refcnt 2 \n";
    const OUR_ROOT: &str =
        "qdisc htb 4c44: root refcnt 3 r2q 10 default 0x10 direct_packets_stat 0 direct_qlen 1000\n";
    // As iproute2 6.1 prints the tree lodger builds at 100 Mbit/s (recorded in a netns).
    const OUR_CLASSES: &str = "\
class htb 4c44:10 parent 4c44:1 prio 0 rate 75Mbit ceil 100Mbit burst 1584b cburst 1600b 
class htb 4c44:1 root rate 100Mbit ceil 100Mbit burst 1600b cburst 1600b 
class htb 4c44:20 parent 4c44:1 prio 0 rate 25Mbit ceil 25Mbit burst 1600b cburst 1600b 
";
    const CGROUP_FILTER: &str = "\
filter parent 4c44: protocol all pref 10 cgroup chain 0 
filter parent 4c44: protocol all pref 10 cgroup chain 0 handle 0x1 
";
    const FW_FILTER: &str = "\
filter parent 4c44: protocol all pref 20 fw chain 0 
filter parent 4c44: protocol all pref 20 fw chain 0 handle 0x4c440020 classid 4c44:20 
";

    fn config(interfaces: &[&str]) -> ShapingConfig {
        ShapingConfig {
            links: interfaces
                .iter()
                .map(|i| Link {
                    interface: i.to_string(),
                    line_rate_mbit: 100,
                })
                .collect(),
            ..ShapingConfig::default()
        }
    }

    /// An nft -j listing of lodger's table holding rules with these comments.
    fn table_json(comments: &[String]) -> String {
        let mut items = vec![
            r#"{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}"#.to_string(),
            r#"{"table": {"family": "inet", "name": "lodger", "handle": 1}}"#.to_string(),
            r#"{"chain": {"family": "inet", "table": "lodger", "name": "output", "handle": 1, "type": "filter", "hook": "output", "prio": -150, "policy": "accept"}}"#.to_string(),
        ];
        for (i, c) in comments.iter().enumerate() {
            items.push(format!(
                r#"{{"rule": {{"family": "inet", "table": "lodger", "chain": "output", "handle": {}, "comment": "{c}", "expr": []}}}}"#,
                i + 2
            ));
        }
        format!("{{\"nftables\": [{}]}}\n", items.join(", "))
    }

    fn fresh() -> RecordingRunner {
        let mut r = RecordingRunner::new();
        r.reply(&["tc", "qdisc", "show"], DEFAULT_ROOT)
            .fail(&["nft", "-j", "list"], NO_TABLE);
        r
    }

    fn shaped(filters: &str) -> RecordingRunner {
        let mut r = RecordingRunner::new();
        r.reply(&["tc", "qdisc", "show"], OUR_ROOT)
            .reply(&["tc", "class", "show"], OUR_CLASSES)
            .reply(&["tc", "filter", "show"], filters)
            .fail(&["nft", "-j", "list"], NO_TABLE);
        r
    }

    #[test]
    fn v1_cgroup_filter_on_a_fresh_interface() {
        let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::TcFilter).expect("new");
        let mut r = fresh();
        let applied = shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
        assert_eq!(
            applied,
            Applied {
                changed: true,
                steering: Steering::TcFilter
            }
        );
        assert_eq!(
            r.lines(),
            [
                "nft -j list table inet lodger",
                "tc qdisc show dev eth0",
                "tc qdisc replace dev eth0 root handle 4c44: htb default 10",
                "tc class replace dev eth0 parent 4c44: classid 4c44:1 htb rate 100000000bit ceil 100000000bit quantum 200000",
                "tc class replace dev eth0 parent 4c44:1 classid 4c44:10 htb rate 75000000bit ceil 100000000bit quantum 200000",
                "tc class replace dev eth0 parent 4c44:1 classid 4c44:20 htb rate 25000000bit ceil 25000000bit quantum 200000",
                "tc filter add dev eth0 parent 4c44: protocol all prio 10 handle 1: cgroup",
            ]
        );
        // The class id a CPU job's net_cls cgroup gets: 4c44:20.
        assert_eq!(shaping.net_cls_classid(), 0x4c44_0020);
        assert_eq!(shaping.net_cls_classid(), 1_279_524_896);
    }

    #[test]
    fn an_interface_already_shaped_is_only_read() {
        let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::TcFilter).expect("new");
        let mut r = shaped(CGROUP_FILTER);
        let applied = shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
        assert!(!applied.changed);
        assert!(r.changes().is_empty(), "{:?}", r.changes());
        assert_eq!(
            r.lines(),
            [
                "nft -j list table inet lodger",
                "tc qdisc show dev eth0",
                "tc class show dev eth0",
                "tc filter show dev eth0 parent 4c44:",
            ]
        );
    }

    #[test]
    fn drift_is_repaired_in_place() {
        let shaper = Shaper::new(
            Link {
                interface: "ib0".to_string(),
                line_rate_mbit: 100,
            },
            &ShapingConfig::default(),
        )
        .expect("shaper");
        let mut r = RecordingRunner::new();
        // Someone changed the CPU jobs' ceil, added a class and a filter of their own.
        let classes = OUR_CLASSES.replace("rate 25Mbit ceil 25Mbit", "rate 25Mbit ceil 50Mbit")
            + "class htb 4c44:30 parent 4c44:1 prio 0 rate 1Mbit ceil 1Mbit burst 1600b cburst 1600b\n";
        r.reply(&["tc", "qdisc", "show"], OUR_ROOT)
            .reply(&["tc", "class", "show"], &classes)
            .reply(
                &["tc", "filter", "show"],
                &format!(
                    "{CGROUP_FILTER}filter parent 4c44: protocol ip pref 49152 u32 chain 0 \n"
                ),
            );
        assert!(shaper.apply(&mut r, TcFilter::Cgroup).expect("apply"));
        assert_eq!(
            r.changes(),
            [
                "tc class replace dev ib0 parent 4c44:1 classid 4c44:20 htb rate 25000000bit ceil 25000000bit quantum 200000",
                "tc class del dev ib0 classid 4c44:30",
                "tc filter del dev ib0 parent 4c44: prio 10",
                "tc filter del dev ib0 parent 4c44: prio 49152",
                "tc filter add dev ib0 parent 4c44: protocol all prio 10 handle 1: cgroup",
            ]
        );
    }

    #[test]
    fn v2_nft_mark_and_fw_filter() {
        let mut shaping =
            NetworkShaping::new(&config(&["eth0", "ib0"]), Steering::TcFilter).expect("new");
        let jobs = CpuJobs::CgroupV2(vec![
            "lodger/j3".to_string(),
            "system.slice/batch.service".to_string(),
        ]);
        let mut r = fresh();
        assert!(shaping.apply(&mut r, &jobs).expect("apply").changed);
        let (_, rules) = shaping.classification(&jobs, Steering::TcFilter);
        assert_eq!(
            rules[0].statement(),
            "socket cgroupv2 level 2 \"lodger/j3\" meta mark set 0x4c440020"
        );
        let changes = r.changes();
        assert_eq!(
            changes[0],
            format!(
                "nft add table inet lodger ; delete table inet lodger ; add table inet lodger ; \
                 add chain inet lodger output {{ type filter hook output priority mangle ; policy accept ; }} ; \
                 add rule inet lodger output socket cgroupv2 level 2 \"lodger/j3\" meta mark set 0x4c440020 comment \"{}\" ; \
                 add rule inet lodger output socket cgroupv2 level 2 \"system.slice/batch.service\" meta mark set 0x4c440020 comment \"{}\"",
                rules[0].fingerprint(),
                rules[1].fingerprint()
            )
        );
        // One nft invocation: nft applies it as one transaction.
        assert_eq!(r.calls[1].first().map(String::as_str), Some("nft"));
        for dev in ["eth0", "ib0"] {
            let fw = format!(
                "tc filter add dev {dev} parent 4c44: protocol all prio 20 handle 0x4c440020 fw classid 4c44:20"
            );
            assert!(changes.contains(&fw), "{changes:?}");
        }
        assert_eq!(changes.len(), 1 + 2 * 5);

        // Applied again over what it made: nothing changes.
        let comments: Vec<String> = rules.iter().map(NftRule::fingerprint).collect();
        let mut r = shaped(FW_FILTER);
        r.reply(&["nft", "-j", "list"], &table_json(&comments));
        assert!(!shaping.apply(&mut r, &jobs).expect("again").changed);
        assert!(r.changes().is_empty(), "{:?}", r.changes());

        // A job's cgroup goes: the table is rebuilt without it.
        let fewer = CpuJobs::CgroupV2(vec!["lodger/j3".to_string()]);
        let mut r = shaped(FW_FILTER);
        r.reply(&["nft", "-j", "list"], &table_json(&comments));
        assert!(shaping.apply(&mut r, &fewer).expect("fewer").changed);
        assert_eq!(r.changes().len(), 1);
        assert!(!r.changes()[0].contains("batch.service"));

        // No CPU job left: no rules, no table; the fw filter stays for the next one.
        let mut r = shaped(FW_FILTER);
        r.reply(&["nft", "-j", "list"], &table_json(&comments));
        assert!(
            shaping
                .apply(&mut r, &CpuJobs::CgroupV2(Vec::new()))
                .expect("none")
                .changed
        );
        assert_eq!(r.changes(), ["nft delete table inet lodger"]);
    }

    #[test]
    fn nft_priority_steering_needs_no_filter() {
        let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::Nft).expect("new");
        let mut r = fresh();
        shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
        let changes = r.changes();
        assert!(
            changes[0].ends_with(&format!(
                "add rule inet lodger output meta cgroup 1279524896 meta priority set 4c44:20 comment \"{}\"",
                NftRule {
                    matches: CpuJobMatch::NetClsClassid(1_279_524_896),
                    action: NftAction::Priority(shaping.cpu_jobs_class()),
                }
                .fingerprint()
            )),
            "{changes:?}"
        );
        assert!(
            !changes.iter().any(|c| c.contains("filter add")),
            "{changes:?}"
        );
        let v2 = CpuJobs::CgroupV2(vec!["lodger/j9".to_string()]);
        let (filter, rules) = shaping.classification(&v2, Steering::Nft);
        assert_eq!(filter, TcFilter::None);
        assert_eq!(
            rules[0].statement(),
            "socket cgroupv2 level 2 \"lodger/j9\" meta priority set 4c44:20"
        );
    }

    #[test]
    fn auto_falls_back_to_nft_when_the_kernel_lacks_the_classifier() {
        let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::Auto).expect("new");
        let mut r = fresh();
        r.fail(
            &["tc", "filter", "add"],
            "Error: TC classifier not found.\nWe have an error talking to the kernel",
        );
        let applied = shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
        assert_eq!(applied.steering, Steering::Nft);
        assert!(applied.changed);
        assert_eq!(shaping.steering(), Steering::Nft);
        let lines = r.lines();
        assert!(
            lines
                .iter()
                .any(|l| l.contains("meta cgroup 1279524896 meta priority set 4c44:20")),
            "{lines:?}"
        );
        // Steering is remembered: the next apply does not try the filter again.
        let mut r = shaped("");
        let rules = shaping.classification(&CpuJobs::NetCls, Steering::Nft).1;
        r.reply(
            &["nft", "-j", "list"],
            &table_json(&[rules[0].fingerprint()]),
        );
        assert!(
            !shaping
                .apply(&mut r, &CpuJobs::NetCls)
                .expect("again")
                .changed
        );
        assert!(r.changes().is_empty(), "{:?}", r.changes());

        // Asked for filters explicitly, a missing classifier is an error that says so.
        let mut strict = NetworkShaping::new(&config(&["eth0"]), Steering::TcFilter).expect("new");
        let mut r = fresh();
        r.fail(&["tc", "filter", "add"], "Error: TC classifier not found.");
        let err = strict
            .apply(&mut r, &CpuJobs::NetCls)
            .expect_err("no cls_cgroup");
        assert!(
            matches!(err, TcError::ClassifierMissing { kind: "cgroup", .. }),
            "{err}"
        );
    }

    #[test]
    fn foreign_root_is_refused_unless_allowed() {
        let shaper = Shaper::new(
            Link {
                interface: "eth0".to_string(),
                line_rate_mbit: 1000,
            },
            &ShapingConfig::default(),
        )
        .expect("shaper");
        let mut r = RecordingRunner::new();
        r.reply(
            &["tc", "qdisc", "show"],
            "qdisc tbf 8001: root refcnt 2 rate 500Mbit burst 64Kb lat 50ms \n",
        );
        let err = shaper.apply(&mut r, TcFilter::Cgroup).expect_err("foreign");
        assert!(err.to_string().contains("tbf 8001:"), "{err}");
        assert!(r.changes().is_empty());
        // Removal leaves it alone too.
        assert!(!shaper.remove(&mut r).expect("remove"));
        assert!(r.changes().is_empty());

        let allowed = ShapingConfig {
            replace_foreign_root: true,
            ..ShapingConfig::default()
        };
        let shaper = Shaper::new(
            Link {
                interface: "eth0".to_string(),
                line_rate_mbit: 1000,
            },
            &allowed,
        )
        .expect("shaper");
        assert!(shaper.apply(&mut r, TcFilter::None).expect("replace"));
        assert_eq!(
            r.changes()[0],
            "tc qdisc replace dev eth0 root handle 4c44: htb default 10"
        );
        assert!(r.changes()[1].contains("rate 1000000000bit"));
        assert_eq!(r.changes().len(), 4);
    }

    #[test]
    fn remove_and_reconcile() {
        let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::Nft).expect("new");
        let mut r = shaped("");
        r.reply(
            &["nft", "-j", "list"],
            &table_json(&["lodger:0".to_string()]),
        );
        let applied = shaping
            .reconcile(&mut r, false, &CpuJobs::NetCls)
            .expect("off");
        assert!(applied.changed);
        assert_eq!(
            r.changes(),
            ["tc qdisc del dev eth0 root", "nft delete table inet lodger"]
        );
        // Nothing of lodger's: nothing to do.
        let mut r = fresh();
        assert!(!shaping.remove(&mut r).expect("nothing"));
        assert!(r.changes().is_empty());
        // Errors are reported after trying everything.
        let mut r = RecordingRunner::new();
        r.reply(&["tc", "qdisc", "show"], OUR_ROOT)
            .fail(
                &["tc", "qdisc", "del"],
                "RTNETLINK answers: Operation not permitted",
            )
            .reply(&["nft", "-j", "list"], &table_json(&[]));
        let err = shaping.remove(&mut r).expect_err("eperm");
        assert!(err.to_string().contains("Operation not permitted"), "{err}");
        assert!(r
            .lines()
            .contains(&"nft delete table inet lodger".to_string()));
        // On: the same as apply.
        let mut r = fresh();
        assert!(
            shaping
                .reconcile(&mut r, true, &CpuJobs::NetCls)
                .expect("on")
                .changed
        );
    }

    #[test]
    fn unparsable_output_is_an_error_with_the_line() {
        let shaper = Shaper::new(
            Link {
                interface: "eth0".to_string(),
                line_rate_mbit: 100,
            },
            &ShapingConfig::default(),
        )
        .expect("shaper");
        let mut r = RecordingRunner::new();
        r.reply(&["tc", "qdisc", "show"], OUR_ROOT).reply(
            &["tc", "class", "show"],
            "class htb 4c44:10 parent 4c44:1 prio 0 rate fast ceil 100Mbit\n",
        );
        let err = shaper.apply(&mut r, TcFilter::None).expect_err("garbage");
        assert!(err.to_string().contains("rate fast"), "{err}");
        let nft = NftSteering::new("lodger");
        let mut r = RecordingRunner::new();
        r.reply(&["nft"], "not json");
        let err = nft.observe(&mut r).expect_err("garbage");
        assert!(err.to_string().contains("not JSON"), "{err}");
        let mut r = RecordingRunner::new();
        r.fail(&["nft"], "Error: Operation not permitted");
        assert!(matches!(
            nft.observe(&mut r).expect_err("eperm"),
            TcError::Failed { .. }
        ));
    }

    #[test]
    fn config_validation() {
        assert!(config(&["eth0"]).validate().is_ok());
        assert!(ShapingConfig::default().validate().is_err(), "no links");
        let bad = |f: &dyn Fn(&mut ShapingConfig)| {
            let mut c = config(&["eth0"]);
            f(&mut c);
            c.validate().expect_err("invalid")
        };
        assert!(bad(&|c| c.cpu_jobs_percent = 30)
            .to_string()
            .contains("more than the line rate"));
        assert!(bad(&|c| c.cpu_jobs_ceil_percent = 10)
            .to_string()
            .contains("cpu_jobs_ceil_percent"));
        assert!(bad(&|c| c.handle = 0).to_string().contains("handle"));
        assert!(bad(&|c| c.links[0].line_rate_mbit = 0)
            .to_string()
            .contains("positive"));
        assert!(bad(&|c| c.links[0].interface = "a b".into())
            .to_string()
            .contains("'a b'"));
        assert!(bad(&|c| c.links[0].interface = "x".repeat(16))
            .to_string()
            .contains("interface"));
        assert!(bad(&|c| c.links.push(c.links[0].clone()))
            .to_string()
            .contains("twice"));
        assert!(bad(&|c| c.nft_table = "x;y".into())
            .to_string()
            .contains("nft_table"));
        let c: ShapingConfig = toml::from_str(
            "links = [{ interface = \"ib0\", line_rate_mbit = 100000 }]\ncpu_jobs_ceil_percent = 50\n",
        )
        .expect("toml");
        assert_eq!(c.training_percent, 75);
        assert_eq!(c.cpu_jobs_ceil_percent, 50);
        assert!(toml::from_str::<ShapingConfig>("share = 3\n").is_err());
        // Bad cgroup2 paths never reach nft.
        let nft = NftSteering::new("lodger");
        for path in ["", "/abs", "a/../b", "a b", "x\"y", "a;b"] {
            let rule = NftRule {
                matches: CpuJobMatch::CgroupV2(path.to_string()),
                action: NftAction::Mark(1),
            };
            let mut r = RecordingRunner::new();
            assert!(nft.apply(&mut r, &[rule]).is_err(), "{path}");
            assert!(r.calls.is_empty());
        }
    }

    #[test]
    fn rates_class_ids_and_quanta() {
        for (s, bits) in [
            ("75Mbit", 75_000_000),
            ("1600bit", 1_600),
            ("2Gbit", 2_000_000_000),
            ("133333Kbit", 133_333_000),
            ("10Kibit", 10_240),
            ("1.5Mbit", 1_500_000),
        ] {
            assert_eq!(parse_rate(s), Some(bits), "{s}");
        }
        for s in ["", "fast", "10", "10Xbit", "Mbit"] {
            assert_eq!(parse_rate(s), None, "{s}");
        }
        assert!(close(133_333_000, 133_333_333));
        assert!(!close(50_000_000, 25_000_000));
        let c = ClassId::parse("4c44:20").expect("parse");
        assert_eq!(c.as_u32(), 0x4c44_0020);
        assert_eq!(c.to_string(), "4c44:20");
        assert_eq!(
            ClassId::parse("4c44:"),
            Some(ClassId {
                major: 0x4c44,
                minor: 0
            })
        );
        assert_eq!(ClassId::parse("x"), None);
        // A slow link: the quantum follows the rate (rate / 8 / r2q 10); shares of a huge line
        // rate are computed without overflow.
        let shaper = Shaper::new(
            Link {
                interface: "eth1".to_string(),
                line_rate_mbit: 1,
            },
            &ShapingConfig::default(),
        )
        .expect("shaper");
        let argv = shaper.build_argv(TcFilter::None);
        assert_eq!(
            argv[3].join(" "),
            "tc class replace dev eth1 parent 4c44:1 classid 4c44:20 htb rate 250000bit ceil 250000bit quantum 3125"
        );
        let big = Shaper::new(
            Link {
                interface: "ib0".to_string(),
                line_rate_mbit: u64::MAX / 1_000,
            },
            &ShapingConfig::default(),
        )
        .expect("shaper");
        assert_eq!(big.build_argv(TcFilter::None).len(), 4);
    }

    #[test]
    fn net_cls_mount_from_mountinfo() {
        let mountinfo = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec,relatime shared:13 - cgroup cgroup rw,cpuset
36 25 0:31 / /sys/fs/cgroup/net_cls,net_prio rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,net_cls,net_prio
";
        assert_eq!(
            find_net_cls_mount(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/net_cls,net_prio"))
        );
        assert_eq!(
            find_net_cls_mount("40 25 0:40 / /tmp/a\\040b rw - cgroup lodger-net_cls rw,net_cls\n"),
            Some(PathBuf::from("/tmp/a b"))
        );
        assert_eq!(find_net_cls_mount(&mountinfo[..160]), None);
        assert_eq!(unescape_mountinfo("a\\134b\\04"), "a\\b\\04");
    }

    #[test]
    fn net_cls_group_on_a_plain_tree() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        fs::write(root.join(CGROUP_PROCS), "1\n").expect("root procs");
        // What the kernel puts in a new cgroup.
        let group_dir = root.join("lodger/j4");
        fs::create_dir_all(&group_dir).expect("mkdir");
        fs::write(group_dir.join(NET_CLS_CLASSID), "0\n").expect("classid");
        fs::write(group_dir.join(CGROUP_PROCS), "").expect("procs");
        let (group, changed) = NetClsGroup::create(root, "lodger/j4", 0x4c44_0020).expect("create");
        assert!(changed);
        assert_eq!(group.classid().expect("classid"), 1_279_524_896);
        let (_, changed) = NetClsGroup::create(root, "lodger/j4", 0x4c44_0020).expect("again");
        assert!(!changed, "same class id: nothing written");
        for bad in ["", "/x", "a/../b", "a//b"] {
            assert!(NetClsGroup::create(root, bad, 1).is_err(), "{bad}");
        }
        let err = NetClsGroup::create(&root.join("nowhere"), "x", 1).expect_err("no hierarchy");
        assert!(
            err.to_string().contains("not a mounted cgroup hierarchy"),
            "{err}"
        );
        // rmdir of a plain directory with files fails, with the path: on cgroupfs it works.
        let err = group.clone().remove().expect_err("plain dir");
        assert!(err.to_string().contains("lodger/j4"), "{err}");
        fs::remove_file(group_dir.join(NET_CLS_CLASSID)).expect("simulate kernel");
        fs::remove_file(group_dir.join(CGROUP_PROCS)).expect("simulate kernel");
        // procs cannot be read any more: removal reports it.
        assert!(group.clone().remove().is_err());
        fs::remove_dir(&group_dir).expect("rmdir");
        assert!(!group.remove().expect("gone"));
    }
}
