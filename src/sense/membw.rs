//! Memory-bandwidth sensing through resctrl: MBM byte counters per resctrl group and per L3
//! domain (`mon_data/mon_L3_XX/mbm_total_bytes`), turned into bytes/s from two samples, and the
//! MBA capabilities (`info/MB/*`, the default group's `schemata`) that throttling needs
//! (SODA §V-E). Everything takes the resctrl root (`DEFAULT_RESCTRL_ROOT`) as an argument.
//!
//! Reads only, except the monitoring groups lodger makes for jobs: [`MonGroup`] (create, move
//! threads in, remove) and [`JobMonGroups`], which keeps one group per job (`lodger-<job>`) in
//! step with the job's threads each sensing pass and turns the groups' counters into bandwidth per
//! job and per L3 domain. These are the only writes, kept next to the reader that consumes them.
//!
//! Where resctrl or MBM is missing, [`MbmReader::open`] and [`MbaCaps::read`] answer
//! [`MembwError::Unavailable`] with the reason; the caller logs it once and reports bandwidth as
//! unavailable. Nothing here estimates bandwidth from other signals.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::job::JobId;
use crate::sys::procfs::ProcReader;

/// Where the kernel mounts resctrl.
pub const DEFAULT_RESCTRL_ROOT: &str = "/sys/fs/resctrl";

const INFO: &str = "info";
const L3_MON: &str = "info/L3_MON";
const MON_FEATURES: &str = "info/L3_MON/mon_features";
const NUM_RMIDS: &str = "info/L3_MON/num_rmids";
const MB_INFO: &str = "info/MB";
const MB_BANDWIDTH_GRAN: &str = "info/MB/bandwidth_gran";
const MB_MIN_BANDWIDTH: &str = "info/MB/min_bandwidth";
const MB_NUM_CLOSIDS: &str = "info/MB/num_closids";
const MB_DELAY_LINEAR: &str = "info/MB/delay_linear";
const MON_DATA: &str = "mon_data";
const MON_GROUPS: &str = "mon_groups";
const MBM_TOTAL_BYTES: &str = "mbm_total_bytes";
const SCHEMATA: &str = "schemata";
const TASKS: &str = "tasks";
/// Prefix of an L3 monitoring domain directory: `mon_L3_00`, `mon_L3_01`, ...
const L3_DOMAIN_PREFIX: &str = "mon_L3_";
/// Resource name of memory-bandwidth allocation in `schemata`.
const MB_RESOURCE: &str = "MB";
/// Longest resctrl group name (a directory name: NAME_MAX).
const GROUP_NAME_MAX: usize = 255;
/// Default-group MB value of Intel's software controller (`mount -o mba_MBps`): U32_MAX.
const MBA_MBPS_MAX: u32 = u32::MAX;
/// The largest percentage an Intel MB schemata value can be.
const PERCENT_MAX: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum MembwError {
    /// resctrl, its monitoring, MBM or MBA is not there: sensing (or throttling) is off.
    #[error("{path}: {reason}")]
    Unavailable { path: PathBuf, reason: String },
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: '{value}' {reason}")]
    Parse {
        path: PathBuf,
        value: String,
        reason: String,
    },
    #[error("'{name}' cannot be a resctrl group name: {reason}")]
    BadGroupName { name: String, reason: &'static str },
    #[error("cannot create resctrl group {path}: {source}{hint}")]
    Create {
        path: PathBuf,
        source: io::Error,
        /// Why the kernel said no, when it is known (ENOSPC: no free RMID or CLOSID).
        hint: String,
    },
    #[error("cannot write '{value}' to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("cannot remove resctrl group {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

impl MembwError {
    /// True when the feature is absent (as opposed to present but failing).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, MembwError::Unavailable { .. })
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> MembwError + '_ {
    move |source| MembwError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn unavailable(path: &Path, reason: impl Into<String>) -> MembwError {
    MembwError::Unavailable {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Groups and samples.

/// A resctrl group, by where it sits under the root: the default (root) group, a control group
/// (`<control>/`, a CTRL_MON group with its own schemata) or a monitoring group
/// (`[<control>/]mon_groups/<monitor>/`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct GroupId {
    pub control: Option<String>,
    pub monitor: Option<String>,
}

impl GroupId {
    /// The default group: every task no other group claims.
    pub fn root() -> Self {
        Self {
            control: None,
            monitor: None,
        }
    }

    pub fn control(name: &str) -> Self {
        Self {
            control: Some(name.to_string()),
            monitor: None,
        }
    }

    /// A monitoring group under `control` (`None`: under the default group).
    pub fn monitor(control: Option<&str>, name: &str) -> Self {
        Self {
            control: control.map(str::to_string),
            monitor: Some(name.to_string()),
        }
    }

    /// A CTRL_MON group (the root or a control group). The kernel's counts for such a group
    /// include those of its monitoring groups, so node totals add up only these.
    pub fn is_control(&self) -> bool {
        self.monitor.is_none()
    }

    /// The group's directory relative to the resctrl root (empty for the root group).
    pub fn relative_path(&self) -> PathBuf {
        let mut path = PathBuf::new();
        if let Some(control) = &self.control {
            path.push(control);
        }
        if let Some(monitor) = &self.monitor {
            path.push(MON_GROUPS);
            path.push(monitor);
        }
        path
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.control, &self.monitor) {
            (None, None) => f.write_str("/"),
            (Some(c), None) => write!(f, "{c}"),
            (None, Some(m)) => write!(f, "{MON_GROUPS}/{m}"),
            (Some(c), Some(m)) => write!(f, "{c}/{MON_GROUPS}/{m}"),
        }
    }
}

/// One `mbm_total_bytes` file's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MbmReading {
    /// Bytes read from and written to memory by the group's tasks in this L3 domain since the
    /// group's RMID was allocated. The kernel widens the hardware counter; it only starts over
    /// when the group is recreated or the domain comes back online.
    Bytes(u64),
    /// The hardware has no count right now: a freshly allocated RMID, or (AMD, and newer
    /// kernels' counter assignment) no hardware counter assigned to this RMID
    /// (the kernel prints `Unavailable` or `Unassigned`).
    Unavailable,
    /// The read failed in the kernel (`Error`).
    Error,
}

impl MbmReading {
    /// Parses a counter file's content; `None` when it is none of the kernel's forms.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "Unavailable" | "Unassigned" => Some(Self::Unavailable),
            "Error" => Some(Self::Error),
            value => value.parse().ok().map(Self::Bytes),
        }
    }
}

/// One group's counters at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSample {
    /// Inode of the group's directory: a change means the group was removed and made again
    /// under the same name (new RMID, counters from zero), so no delta spans it.
    pub inode: u64,
    /// Per L3 domain id (the `XX` of `mon_L3_XX`, as in `schemata`).
    pub domains: BTreeMap<u32, MbmReading>,
}

/// Every group's counters, read at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MbmSample {
    pub at: Instant,
    pub groups: BTreeMap<GroupId, GroupSample>,
}

// ---------------------------------------------------------------------------------------------
// The reader.

/// What `info/L3_MON` says about monitoring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MonInfo {
    /// `mon_features`, one event per line (`llc_occupancy`, `mbm_total_bytes`, ...).
    pub features: Vec<String>,
    /// RMIDs: the most groups that can be monitored at once (root included).
    pub num_rmids: Option<u32>,
}

/// A source of MBM samples: [`MbmReader`], or a fake in the agent's tests.
pub trait MbmSource: Send {
    fn sample(&mut self) -> Result<MbmSample, MembwError>;
}

impl MbmSource for MbmReader {
    fn sample(&mut self) -> Result<MbmSample, MembwError> {
        MbmReader::sample(self)
    }
}

/// Reads MBM counters under a mounted resctrl with `mbm_total_bytes`.
#[derive(Debug, Clone)]
pub struct MbmReader {
    root: PathBuf,
    mon: MonInfo,
}

impl MbmReader {
    /// Checks that resctrl is mounted at `root` with L3 monitoring of total bandwidth.
    /// [`MembwError::Unavailable`] says which part is missing.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, MembwError> {
        let root = root.into();
        check_mounted(&root)?;
        let l3_mon = root.join(L3_MON);
        if !l3_mon.is_dir() {
            return Err(unavailable(
                &l3_mon,
                "resctrl has no L3 monitoring: the CPU lacks RDT monitoring (CMT/MBM), or it \
                 is turned off (rdt= boot option)",
            ));
        }
        let features_path = root.join(MON_FEATURES);
        let features: Vec<String> = read_text(&features_path)?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        if !features.iter().any(|f| f == MBM_TOTAL_BYTES) {
            let listed = if features.is_empty() {
                "nothing".to_string()
            } else {
                features.join(", ")
            };
            return Err(unavailable(
                &features_path,
                format!(
                    "the CPU does not count memory bandwidth (MBM): mon_features lists {listed}"
                ),
            ));
        }
        let num_rmids = read_optional_u32(&root.join(NUM_RMIDS))?;
        let mon_data = root.join(MON_DATA);
        if !mon_data.is_dir() {
            return Err(unavailable(
                &mon_data,
                "resctrl lists MBM but the default group has no mon_data",
            ));
        }
        Ok(Self {
            root,
            mon: MonInfo {
                features,
                num_rmids,
            },
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn mon_info(&self) -> &MonInfo {
        &self.mon
    }

    /// Reads `mbm_total_bytes` of every group: the default group, each control group, and the
    /// monitoring groups under each. A group removed while it is read is left out.
    pub fn sample(&self) -> Result<MbmSample, MembwError> {
        let mut groups = BTreeMap::new();
        let mut read = |id: GroupId| -> Result<(), MembwError> {
            if let Some(sample) = read_group(&self.root.join(id.relative_path()))? {
                groups.insert(id, sample);
            }
            Ok(())
        };
        read(GroupId::root())?;
        for name in subdirs(&self.root.join(MON_GROUPS))? {
            read(GroupId::monitor(None, &name))?;
        }
        for control in control_groups(&self.root)? {
            read(GroupId::control(&control))?;
            let mon_groups = self.root.join(&control).join(MON_GROUPS);
            for name in subdirs(&mon_groups)? {
                read(GroupId::monitor(Some(&control), &name))?;
            }
        }
        Ok(MbmSample {
            at: Instant::now(),
            groups,
        })
    }
}

/// resctrl is mounted when its root holds `info`; an unmounted mount point is an empty
/// directory, and a kernel without resctrl support has no mount point at all.
fn check_mounted(root: &Path) -> Result<(), MembwError> {
    if !root.is_dir() {
        return Err(unavailable(
            root,
            "no resctrl: the kernel lacks CONFIG_X86_CPU_RESCTRL or the CPU lacks RDT",
        ));
    }
    if !root.join(INFO).is_dir() {
        return Err(unavailable(
            root,
            format!(
                "resctrl is not mounted (mount -t resctrl resctrl {})",
                root.display()
            ),
        ));
    }
    Ok(())
}

/// The control groups: directories at the root other than `info`, `mon_data` and `mon_groups`.
fn control_groups(root: &Path) -> Result<Vec<String>, MembwError> {
    Ok(subdirs(root)?
        .into_iter()
        .filter(|name| ![INFO, MON_DATA, MON_GROUPS].contains(&name.as_str()))
        .collect())
}

/// Names of the directories in `dir`, sorted; empty when `dir` does not exist.
fn subdirs(dir: &Path) -> Result<Vec<String>, MembwError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(io_err(dir)(source)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(dir))?;
        // file_type does not follow symlinks; resctrl has none, a fixture should not either.
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if let (true, Ok(name)) = (is_dir, entry.file_name().into_string()) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// One group's counters; `None` when the group vanished while being read.
fn read_group(dir: &Path) -> Result<Option<GroupSample>, MembwError> {
    let inode = match fs::metadata(dir) {
        Ok(meta) => meta.ino(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(io_err(dir)(source)),
    };
    let mon_data = dir.join(MON_DATA);
    let mut domains = BTreeMap::new();
    for name in subdirs(&mon_data)? {
        let Some(id) = parse_l3_domain(&name) else {
            continue;
        };
        let path = mon_data.join(&name).join(MBM_TOTAL_BYTES);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound && !dir.exists() => return Ok(None),
            Err(source) => return Err(io_err(&path)(source)),
        };
        let reading = MbmReading::parse(&text).ok_or_else(|| MembwError::Parse {
            path: path.clone(),
            value: text.trim().to_string(),
            reason: "is not a byte count, 'Unavailable' or 'Error'".to_string(),
        })?;
        domains.insert(id, reading);
    }
    if domains.is_empty() && !dir.exists() {
        return Ok(None);
    }
    Ok(Some(GroupSample { inode, domains }))
}

/// `mon_L3_01` → 1.
fn parse_l3_domain(name: &str) -> Option<u32> {
    name.strip_prefix(L3_DOMAIN_PREFIX)?.parse().ok()
}

fn read_text(path: &Path) -> Result<String, MembwError> {
    fs::read_to_string(path).map_err(io_err(path))
}

fn parse_u32(path: &Path, text: &str) -> Result<u32, MembwError> {
    let value = text.trim();
    value.parse().map_err(|_| MembwError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        reason: "is not a non-negative integer".to_string(),
    })
}

fn read_u32(path: &Path) -> Result<u32, MembwError> {
    parse_u32(path, &read_text(path)?)
}

fn read_optional_u32(path: &Path) -> Result<Option<u32>, MembwError> {
    match fs::read_to_string(path) {
        Ok(text) => parse_u32(path, &text).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(io_err(path)(source)),
    }
}

// ---------------------------------------------------------------------------------------------
// Rates.

/// A sum of per-domain rates, with a count of the readings that could not be turned into a
/// rate and are therefore not in it (then the sum is a lower bound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Bandwidth {
    pub bytes_per_s: f64,
    /// Readings left out: `Unavailable` or `Error` at either end, a counter that went
    /// backwards, a domain or group not in the older sample, or a recreated group.
    pub missing: u32,
}

impl Bandwidth {
    /// True when nothing was left out of the sum.
    pub fn is_complete(&self) -> bool {
        self.missing == 0
    }

    fn add(&mut self, rate: Option<f64>) {
        match rate {
            Some(r) => self.bytes_per_s += r,
            None => self.missing += 1,
        }
    }

    fn empty() -> Self {
        Self {
            bytes_per_s: 0.0,
            missing: 0,
        }
    }
}

/// One group's bandwidth between two samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupRate {
    /// Per L3 domain; `None` where no honest rate exists (see [`Bandwidth::missing`]).
    pub domains: BTreeMap<u32, Option<f64>>,
    pub total: Bandwidth,
}

/// Bandwidth per group, per L3 domain and for the node, between two samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MbmRates {
    pub interval: Duration,
    pub groups: BTreeMap<GroupId, GroupRate>,
    /// The node per L3 domain: the sum over CTRL_MON groups (root and control groups), whose
    /// counts already include their monitoring groups.
    pub domains: BTreeMap<u32, Bandwidth>,
    pub node: Bandwidth,
}

impl MbmRates {
    /// The node's bandwidth as a fraction of `peak_bytes_per_s` (configured, or measured once,
    /// e.g. with `examples/membw_hog`, or the highest seen: [`ObservedPeak`]). A lower bound when
    /// `node` is incomplete; `None` for a peak that is not a positive number.
    pub fn node_fraction(&self, peak_bytes_per_s: f64) -> Option<f64> {
        (peak_bytes_per_s.is_finite() && peak_bytes_per_s > 0.0)
            .then(|| self.node.bytes_per_s / peak_bytes_per_s)
    }
}

/// Rates between two samples, for every group of `cur`. Pure. A domain's delta is dropped when
/// either reading is not a byte count, the counter went backwards (the RMID was reused or the
/// domain went offline and back), the group's directory inode changed (removed and made again),
/// or the group or domain is new; a zero interval drops them all.
pub fn rates(prev: &MbmSample, cur: &MbmSample) -> MbmRates {
    let interval = cur.at.saturating_duration_since(prev.at);
    let secs = interval.as_secs_f64();
    let mut groups = BTreeMap::new();
    let mut domains: BTreeMap<u32, Bandwidth> = BTreeMap::new();
    for (id, now) in &cur.groups {
        let before = prev
            .groups
            .get(id)
            .filter(|before| before.inode == now.inode && secs > 0.0);
        let mut total = Bandwidth::empty();
        let mut per_domain = BTreeMap::new();
        for (&domain, &reading) in &now.domains {
            let old = before.and_then(|b| b.domains.get(&domain)).copied();
            let rate = match (old, reading) {
                (Some(MbmReading::Bytes(old)), MbmReading::Bytes(new)) => {
                    new.checked_sub(old).map(|delta| delta as f64 / secs)
                }
                _ => None,
            };
            total.add(rate);
            per_domain.insert(domain, rate);
            if id.is_control() {
                domains
                    .entry(domain)
                    .or_insert_with(Bandwidth::empty)
                    .add(rate);
            }
        }
        groups.insert(
            id.clone(),
            GroupRate {
                domains: per_domain,
                total,
            },
        );
    }
    let mut node = Bandwidth::empty();
    for d in domains.values() {
        node.bytes_per_s += d.bytes_per_s;
        node.missing += d.missing;
    }
    MbmRates {
        interval,
        groups,
        domains,
        node,
    }
}

/// The highest complete node bandwidth seen: a measured peak for hosts whose config gives none.
/// It only ever rises, so it understates the true peak until the node has been driven hard
/// (by a benchmark such as `examples/membw_hog`, at install).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ObservedPeak {
    pub bytes_per_s: f64,
}

impl ObservedPeak {
    /// Takes in one interval's rates; incomplete node sums are ignored (they may be low).
    pub fn observe(&mut self, rates: &MbmRates) {
        if rates.node.is_complete() && rates.node.bytes_per_s > self.bytes_per_s {
            self.bytes_per_s = rates.node.bytes_per_s;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// MBA capabilities.

/// The CPU vendor, which decides what an MB schemata value means.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum CpuVendor {
    Intel,
    /// AMD, and Hygon (whose resctrl support is AMD's).
    Amd,
    Other(String),
}

impl CpuVendor {
    /// From a `vendor_id` value of `/proc/cpuinfo`.
    pub fn from_vendor_id(vendor_id: &str) -> Self {
        match vendor_id.trim() {
            "GenuineIntel" => Self::Intel,
            "AuthenticAMD" | "HygonGenuine" => Self::Amd,
            other => Self::Other(other.to_string()),
        }
    }

    /// Reads the first `vendor_id` line of `<proc_root>/cpuinfo`.
    pub fn from_cpuinfo(proc_root: &Path) -> Result<Self, MembwError> {
        let path = proc_root.join("cpuinfo");
        let text = read_text(&path)?;
        text.lines()
            .filter_map(|line| line.split_once(':'))
            .find(|(key, _)| key.trim() == "vendor_id")
            .map(|(_, value)| Self::from_vendor_id(value))
            .ok_or_else(|| MembwError::Parse {
                path,
                value: String::new(),
                reason: "has no vendor_id line".to_string(),
            })
    }
}

/// What an MB schemata value means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MbaUnit {
    /// Intel: a percentage of full bandwidth, a multiple of `bandwidth_gran`, at least
    /// `min_bandwidth`; 100 is unthrottled.
    Percent,
    /// Intel with resctrl mounted `-o mba_MBps`: a limit in MB/s that the kernel's software
    /// controller enforces using MBM; U32_MAX is unthrottled.
    MegabytesPerSecond,
    /// AMD: absolute bandwidth in multiples of 1/8 GB/s; the default group's value (2048 on
    /// Zen 2 to 4, 256 GB/s) is unthrottled.
    AmdEighthGigabytesPerSecond,
}

/// Memory-bandwidth allocation as this node offers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MbaCaps {
    pub unit: MbaUnit,
    /// `info/MB/bandwidth_gran`: values are rounded up to a multiple of this.
    pub bandwidth_gran: u32,
    /// `info/MB/min_bandwidth`: the smallest value accepted.
    pub min_bandwidth: u32,
    /// `info/MB/num_closids`: control groups possible, the default group included.
    pub num_closids: u32,
    /// `info/MB/delay_linear`: whether the throttle delay scales linearly with the value
    /// (Intel usually yes, AMD no).
    pub delay_linear: bool,
    /// The default group's `MB:` values per domain: the unthrottled setting.
    pub default_schemata: BTreeMap<u32, u32>,
}

impl MbaCaps {
    /// Reads MBA's capabilities under `root`. `vendor` (from [`CpuVendor::from_cpuinfo`] or
    /// given) selects the unit; on Intel, a default value above 100 means the `mba_MBps`
    /// mount option. A vendor other than Intel or AMD is [`MembwError::Unavailable`]: the meaning
    /// of its values is not known here, and guessing could throttle a job to nothing.
    pub fn read(root: &Path, vendor: &CpuVendor) -> Result<Self, MembwError> {
        check_mounted(root)?;
        let info = root.join(MB_INFO);
        if !info.is_dir() {
            return Err(unavailable(
                &info,
                "no memory-bandwidth allocation (MBA): the CPU lacks it or it is turned off",
            ));
        }
        let schemata_path = root.join(SCHEMATA);
        let default_schemata = parse_mb_schemata(&schemata_path, &read_text(&schemata_path)?)?;
        if default_schemata.is_empty() {
            return Err(MembwError::Parse {
                path: schemata_path,
                value: String::new(),
                reason: "has no MB line although info/MB exists".to_string(),
            });
        }
        let max = default_schemata
            .values()
            .copied()
            .max()
            .unwrap_or(PERCENT_MAX);
        let unit = match vendor {
            CpuVendor::Intel if max > PERCENT_MAX => MbaUnit::MegabytesPerSecond,
            CpuVendor::Intel => MbaUnit::Percent,
            CpuVendor::Amd => MbaUnit::AmdEighthGigabytesPerSecond,
            CpuVendor::Other(name) => {
                return Err(unavailable(
                    &info,
                    format!("MB schemata units are not known for CPU vendor '{name}'"),
                ))
            }
        };
        let delay_linear_path = root.join(MB_DELAY_LINEAR);
        let delay_linear = match read_optional_u32(&delay_linear_path)? {
            None | Some(0) => false,
            Some(1) => true,
            Some(other) => {
                return Err(MembwError::Parse {
                    path: delay_linear_path,
                    value: other.to_string(),
                    reason: "is not 0 or 1".to_string(),
                })
            }
        };
        Ok(Self {
            unit,
            bandwidth_gran: read_u32(&root.join(MB_BANDWIDTH_GRAN))?,
            min_bandwidth: read_u32(&root.join(MB_MIN_BANDWIDTH))?,
            num_closids: read_u32(&root.join(MB_NUM_CLOSIDS))?,
            delay_linear,
            default_schemata,
        })
    }

    /// The unthrottled value: 100 for percent, otherwise the default group's largest value.
    pub fn max_value(&self) -> u32 {
        match self.unit {
            MbaUnit::Percent => PERCENT_MAX,
            MbaUnit::MegabytesPerSecond => MBA_MBPS_MAX,
            MbaUnit::AmdEighthGigabytesPerSecond => {
                self.default_schemata.values().copied().max().unwrap_or(0)
            }
        }
    }

    /// The value the kernel would apply for `wanted`: at least `min_bandwidth`, rounded up to a
    /// multiple of `bandwidth_gran` (Intel; the kernel rounds up the same way), at most
    /// [`MbaCaps::max_value`].
    pub fn valid_value(&self, wanted: u32) -> u32 {
        let max = self.max_value();
        let mut value = wanted.max(self.min_bandwidth);
        if self.unit == MbaUnit::Percent && self.bandwidth_gran > 1 {
            value = value.div_ceil(self.bandwidth_gran) * self.bandwidth_gran;
        }
        value.min(max)
    }
}

/// The `MB:` line of a `schemata` file: domain id → value. The kernel pads resource names with
/// spaces (`    MB:0=100;1=100`). Empty when there is no MB line.
pub fn parse_mb_schemata(path: &Path, text: &str) -> Result<BTreeMap<u32, u32>, MembwError> {
    let mut values = BTreeMap::new();
    let bad = |value: &str, reason: &str| MembwError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        reason: reason.to_string(),
    };
    for line in text.lines() {
        let Some((resource, domains)) = line.split_once(':') else {
            continue;
        };
        if resource.trim() != MB_RESOURCE {
            continue;
        }
        for item in domains.trim().split(';').filter(|s| !s.is_empty()) {
            let (id, value) = item
                .split_once('=')
                .ok_or_else(|| bad(line.trim(), "has an MB entry that is not <domain>=<value>"))?;
            let id = id
                .trim()
                .parse()
                .map_err(|_| bad(line.trim(), "has an MB domain that is not a number"))?;
            let value = value
                .trim()
                .parse()
                .map_err(|_| bad(line.trim(), "has an MB value that is not a number"))?;
            values.insert(id, value);
        }
    }
    Ok(values)
}

// ---------------------------------------------------------------------------------------------
// A job's monitoring group (writes).

/// A monitoring group made for one job: `[<control>/]mon_groups/<name>`.
///
/// resctrl semantics that a fixture tree cannot show: `mkdir` makes the kernel populate the
/// directory (`tasks`, `cpus`, `mon_data/...`) and allocate an RMID (ENOSPC when none is free);
/// writing a TID to `tasks` moves that one thread, and threads created later join their
/// creator's group; a thread can only move into a monitoring group of the control group it is
/// in (EINVAL otherwise), and moving it to another control group takes it out of its monitoring
/// group; `rmdir` of a group with files in it succeeds and gives its tasks back to the parent,
/// and `rmdir` of a control group removes its monitoring groups with it. On a plain directory
/// these behave differently (the tests say where).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MonGroup {
    id: GroupId,
    path: PathBuf,
}

/// What moving tasks into a group did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskMove {
    pub moved: Vec<u32>,
    /// TIDs that exited before they could be moved (ESRCH).
    pub gone: Vec<u32>,
    /// TIDs a monitoring group refused because they are in another control group now (EINVAL,
    /// "Can't move task to different control group"): lodger's contention control moved them
    /// meanwhile. Only [`MonGroup::move_threads`] reports these.
    pub elsewhere: Vec<u32>,
}

impl MonGroup {
    /// Makes `mon_groups/<name>` under `control` (`None`: the default group), or adopts it if
    /// it exists. `name` is a plain directory name (ASCII letters, digits, `-`, `_`, `.`).
    pub fn create(root: &Path, control: Option<&str>, name: &str) -> Result<Self, MembwError> {
        check_group_name(name)?;
        if let Some(control) = control {
            check_group_name(control)?;
        }
        check_mounted(root)?;
        let id = GroupId::monitor(control, name);
        let path = root.join(id.relative_path());
        match fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => {}
            Err(source) => return Err(create_error(root, path, source)),
        }
        Ok(Self { id, path })
    }

    pub fn id(&self) -> &GroupId {
        &self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves threads into the group, one write per TID (older kernels take one id per write).
    /// resctrl moves single threads: pass every TID of a process, or use
    /// [`MonGroup::move_processes`].
    pub fn move_threads(&self, tids: &[u32]) -> Result<TaskMove, MembwError> {
        let path = self.path.join(TASKS);
        // `create` only matters on a fixture tree: on resctrl the kernel made the file with the
        // directory, and append is ignored.
        let mut file = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|source| MembwError::Write {
                path: path.clone(),
                value: String::new(),
                source,
            })?;
        let mut done = TaskMove::default();
        for &tid in tids {
            let value = format!("{tid}\n");
            match file.write_all(value.as_bytes()) {
                Ok(()) => done.moved.push(tid),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => done.gone.push(tid),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => done.elsewhere.push(tid),
                Err(source) => {
                    return Err(MembwError::Write {
                        path: path.clone(),
                        value: tid.to_string(),
                        source,
                    })
                }
            }
        }
        Ok(done)
    }

    /// Moves every current thread of each process (from `<proc_root>/<pid>/task`). Threads
    /// started after this call inherit the group from the thread that creates them.
    pub fn move_processes(&self, proc_root: &Path, pids: &[u32]) -> Result<TaskMove, MembwError> {
        let mut reader = ProcReader::new(proc_root);
        let mut tids = Vec::new();
        let mut gone = Vec::new();
        for &pid in pids {
            let before = tids.len();
            let alive = reader.threads(pid, &mut tids).map_err(|e| match e {
                crate::sys::procfs::ProcError::Read { path, source } => {
                    MembwError::Io { path, source }
                }
            })?;
            if !alive || tids.len() == before {
                gone.push(pid);
            }
        }
        let mut done = self.move_threads(&tids)?;
        done.gone.extend(gone);
        Ok(done)
    }

    /// Makes sure each of `tids` is in the group, writing only those its `tasks` does not list,
    /// so a second call with the same threads writes nothing. `Ok(None)` when the group is gone
    /// (removed with its control group).
    pub fn keep_threads(&self, tids: &[u32]) -> Result<Option<TaskMove>, MembwError> {
        let Some(present) = read_tids(&self.path.join(TASKS))? else {
            return Ok(None);
        };
        let missing: Vec<u32> = tids
            .iter()
            .copied()
            .filter(|t| present.binary_search(t).is_err())
            .collect();
        if missing.is_empty() {
            return Ok(Some(TaskMove::default()));
        }
        match self.move_threads(&missing) {
            Ok(done) => Ok(Some(done)),
            Err(_) if !self.path.is_dir() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes the group (its tasks return to the parent group). `Ok(false)` when it was
    /// already gone.
    pub fn remove(self) -> Result<bool, MembwError> {
        remove_mon_group(&self.path)
    }
}

/// A failed mkdir of a monitoring group, saying so when the kernel ran out of RMIDs (ENOSPC).
pub fn create_error(root: &Path, path: PathBuf, source: io::Error) -> MembwError {
    let hint = if source.raw_os_error() == Some(libc::ENOSPC) {
        format!(
            " (no free RMID: {} monitoring groups are the most this CPU can count)",
            read_optional_u32(&root.join(NUM_RMIDS))
                .ok()
                .flatten()
                .map_or_else(|| "num_rmids".to_string(), |n| n.to_string())
        )
    } else {
        String::new()
    };
    MembwError::Create { path, source, hint }
}

/// Removes `[<control>/]mon_groups/<name>` under `root`; `Ok(false)` when it does not exist.
pub fn remove_job_mon_group(
    root: &Path,
    control: Option<&str>,
    name: &str,
) -> Result<bool, MembwError> {
    check_group_name(name)?;
    if let Some(control) = control {
        check_group_name(control)?;
    }
    remove_mon_group(&root.join(GroupId::monitor(control, name).relative_path()))
}

fn remove_mon_group(path: &Path) -> Result<bool, MembwError> {
    // rmdir, never a recursive delete: resctrl removes the files itself, and refuses unlink.
    match fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(MembwError::Remove {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The TIDs listed in a `tasks` file, sorted; `None` when the group's directory is gone. A fixture
/// group made by `mkdir` has no `tasks` file until something is written: empty.
fn read_tids(path: &Path) -> Result<Option<Vec<u32>>, MembwError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(path.parent().is_some_and(Path::is_dir).then(Vec::new));
        }
        Err(source) => return Err(io_err(path)(source)),
    };
    let mut tids = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.parse().map_err(|_| MembwError::Parse {
                path: path.to_path_buf(),
                value: l.to_string(),
                reason: "is not a thread id".to_string(),
            })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    tids.sort_unstable();
    Ok(Some(tids))
}

// ---------------------------------------------------------------------------------------------
// Per-job monitoring groups (writes).

/// Prefix of the monitoring groups lodger makes for jobs (`lodger-j7`). The sweep at start
/// removes groups with this prefix only: other monitoring groups belong to other tools.
pub const JOB_GROUP_PREFIX: &str = "lodger-";

/// Sensing passes between two attempts to create a job's group after the kernel refused one: no
/// free RMID (one frees up when a job leaves; on Intel only once the freed RMID's cache
/// occupancy has drained), or another error that may pass.
pub const CREATE_RETRY_PASSES: u32 = 30;

/// The monitoring group of a job: `lodger-<job id>`.
pub fn job_group_name(job: &JobId) -> String {
    format!("{JOB_GROUP_PREFIX}{job}")
}

/// Something per-job monitoring has to say, each said once (the caller logs it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobGroupNote {
    /// Per-job bandwidth is unavailable for this job: the kernel refused its group (ENOSPC: no
    /// free RMID). Creation is tried again every [`CREATE_RETRY_PASSES`] passes, quietly.
    Unavailable { job: JobId, reason: String },
    /// A group could be made after an earlier refusal: the job is measured again.
    Measured { job: JobId },
    /// Reading or writing a group failed; it is tried again next pass. A failure that repeats
    /// is said once.
    Failed { job: JobId, error: String },
}

/// What [`sweep_job_groups`] did.
#[derive(Debug, Default)]
pub struct Swept {
    pub removed: Vec<GroupId>,
    pub failed: Vec<MembwError>,
}

/// Removes every `lodger-*` monitoring group, under the default group and under each control
/// group: the groups of a lodgerd that stopped without removing them (killed, crashed). Their
/// threads go back to the control group they are in. Other monitoring groups are left alone.
pub fn sweep_job_groups(root: &Path) -> Result<Swept, MembwError> {
    check_mounted(root)?;
    let mut swept = Swept::default();
    let mut controls = vec![None];
    controls.extend(control_groups(root)?.into_iter().map(Some));
    for control in controls {
        let mon_groups = match &control {
            Some(c) => root.join(c).join(MON_GROUPS),
            None => root.join(MON_GROUPS),
        };
        for name in subdirs(&mon_groups)? {
            if !name.starts_with(JOB_GROUP_PREFIX) {
                continue;
            }
            let id = GroupId::monitor(control.as_deref(), &name);
            match remove_mon_group(&root.join(id.relative_path())) {
                Ok(true) => swept.removed.push(id),
                Ok(false) => {}
                Err(e) => swept.failed.push(e),
            }
        }
    }
    Ok(swept)
}

/// Which control group each thread outside the default group is in, from every control group's
/// `tasks` (the kernel lists there the threads of the control group's monitoring groups too).
fn thread_controls(root: &Path) -> Result<BTreeMap<u32, String>, MembwError> {
    let mut controls = BTreeMap::new();
    for control in control_groups(root)? {
        // A control group removed since it was listed holds nobody.
        let Some(tids) = read_tids(&root.join(&control).join(TASKS))? else {
            continue;
        };
        for tid in tids {
            controls.entry(tid).or_insert_with(|| control.clone());
        }
    }
    Ok(controls)
}

/// Makes a monitoring group: [`MonGroup::create`], or in tests a stand-in that refuses as the
/// kernel does when RMIDs run out (ENOSPC), which a plain directory cannot.
pub type CreateMonGroup =
    Box<dyn FnMut(&Path, Option<&str>, &str) -> Result<MonGroup, MembwError> + Send>;

/// One monitoring group per job, `[<control>/]mon_groups/lodger-<job>`, kept in step with the
/// job's threads each pass, and the job's bandwidth from the groups' counters.
///
/// Which control group: a thread's monitoring group belongs to the control group it is in, and
/// moving a thread to another control group takes it out of its monitoring group. lodger's
/// contention control moves offline jobs into its own control group (`lodger-lodgers`, for MBA)
/// and back, so a job's group lives under the control group its threads are in, read each pass
/// from the control groups' `tasks` files. A job whose threads are in two control groups has a
/// group under each and its bandwidth is their sum; when its threads move, the group under the new
/// control group gives its first rate a pass later and the one left empty is removed.
pub struct JobMonGroups {
    root: PathBuf,
    procs: ProcReader,
    create: CreateMonGroup,
    jobs: BTreeMap<JobId, JobGroups>,
}

#[derive(Debug, Default)]
struct JobGroups {
    /// By control group (`None`: the default group).
    groups: BTreeMap<Option<String>, MonGroup>,
    /// Set while the kernel refuses the job a group.
    refused: Option<Refusal>,
    /// The failure said last, so that one that repeats is said once.
    failure: Option<String>,
}

#[derive(Debug)]
struct Refusal {
    reason: String,
    /// Passes left before the next attempt.
    retry_in: u32,
}

/// A job's memory bandwidth between two samples, from its monitoring groups.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct JobBandwidth {
    /// Per L3 domain, summed over the job's groups; only domains where a rate exists.
    pub domains: BTreeMap<u32, f64>,
    /// The sum over the job's groups and domains, with the readings left out (`Unavailable` or
    /// `Error`, a counter that reset, a group or domain new since the older sample): a lower
    /// bound when `missing` is not 0.
    pub total: Bandwidth,
    /// Why the job is not measured: the kernel refused its group (no free RMID, ...).
    pub unavailable: Option<String>,
}

impl JobBandwidth {
    /// Bytes/s, when the job is measured and at least one reading gave a rate.
    pub fn bytes_per_s(&self) -> Option<f64> {
        (self.unavailable.is_none() && !self.domains.is_empty()).then_some(self.total.bytes_per_s)
    }
}

impl JobMonGroups {
    /// Per-job groups under the resctrl mounted at `root`; each job's threads are listed from
    /// `<proc_root>/<pid>/task`.
    pub fn new(root: impl Into<PathBuf>, proc_root: &Path) -> Self {
        Self {
            root: root.into(),
            procs: ProcReader::new(proc_root),
            create: Box::new(|root: &Path, control: Option<&str>, name: &str| {
                MonGroup::create(root, control, name)
            }),
            jobs: BTreeMap::new(),
        }
    }

    /// Replaces how groups are made (tests: a kernel out of RMIDs).
    pub fn with_create(mut self, create: CreateMonGroup) -> Self {
        self.create = create;
        self
    }

    /// The groups `job` has now.
    pub fn groups(&self, job: &JobId) -> Vec<GroupId> {
        self.jobs
            .get(job)
            .map(|j| j.groups.values().map(|g| g.id().clone()).collect())
            .unwrap_or_default()
    }

    /// One pass. For each job and its processes: every current thread is put in the job's
    /// group under the control group the thread is in (made when missing; only threads not
    /// already listed are written, so a second pass writes nothing), and a group whose control
    /// group holds none of the job's threads any more is removed. A process or thread that
    /// exited is skipped, not an error. Jobs not listed lose their groups.
    pub fn sync<'a>(
        &mut self,
        jobs: impl IntoIterator<Item = (&'a JobId, &'a [u32])>,
    ) -> Vec<JobGroupNote> {
        let jobs: Vec<(&JobId, &[u32])> = jobs.into_iter().collect();
        let mut notes = Vec::new();
        let left: Vec<JobId> = self
            .jobs
            .keys()
            .filter(|id| !jobs.iter().any(|(j, _)| j == id))
            .cloned()
            .collect();
        for id in left {
            notes.extend(self.forget(&id));
        }
        if jobs.is_empty() {
            return notes;
        }
        let controls = match thread_controls(&self.root) {
            Ok(controls) => controls,
            Err(e) => {
                // Without it a thread could be written into the wrong control group's group.
                let error = format!("cannot tell which control group threads are in: {e}");
                for (id, _) in jobs {
                    let job = self.jobs.entry(id.clone()).or_default();
                    say_failure(id, job, Some(error.clone()), &mut notes);
                }
                return notes;
            }
        };
        for (id, pids) in jobs {
            self.sync_job(id, pids, &controls, &mut notes);
        }
        notes
    }

    fn sync_job(
        &mut self,
        id: &JobId,
        pids: &[u32],
        controls: &BTreeMap<u32, String>,
        notes: &mut Vec<JobGroupNote>,
    ) {
        let mut problem: Option<String> = None;
        let mut tids = Vec::new();
        for &pid in pids {
            // A process that exited lists no threads; only a failed read is a problem.
            if let Err(e) = self.procs.threads(pid, &mut tids) {
                problem.get_or_insert(e.to_string());
            }
        }
        tids.sort_unstable();
        tids.dedup();
        let mut by_control: BTreeMap<Option<String>, Vec<u32>> = BTreeMap::new();
        for tid in tids {
            by_control
                .entry(controls.get(&tid).cloned())
                .or_default()
                .push(tid);
        }
        let name = job_group_name(id);
        let job = self.jobs.entry(id.clone()).or_default();
        let emptied: Vec<Option<String>> = job
            .groups
            .keys()
            .filter(|c| !by_control.contains_key(*c))
            .cloned()
            .collect();
        for control in emptied {
            if let Some(group) = job.groups.remove(&control) {
                if let Err(e) = group.remove() {
                    problem.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(refused) = &mut job.refused {
            refused.retry_in = refused.retry_in.saturating_sub(1);
        }
        for (control, tids) in &by_control {
            if !job.groups.contains_key(control) {
                if job.refused.as_ref().is_some_and(|r| r.retry_in > 0) {
                    continue;
                }
                match (self.create)(&self.root, control.as_deref(), &name) {
                    Ok(group) => {
                        job.groups.insert(control.clone(), group);
                        if job.refused.take().is_some() {
                            notes.push(JobGroupNote::Measured { job: id.clone() });
                        }
                    }
                    // Contention control removed its control group since `tasks` was read: the
                    // threads are back in the default group, and found there next pass.
                    Err(e) if control_vanished(&self.root, control.as_deref(), &e) => {}
                    Err(e) => {
                        let reason = e.to_string();
                        if job.refused.is_none() {
                            notes.push(JobGroupNote::Unavailable {
                                job: id.clone(),
                                reason: reason.clone(),
                            });
                        }
                        job.refused = Some(Refusal {
                            reason,
                            retry_in: CREATE_RETRY_PASSES,
                        });
                    }
                }
            }
            let Some(group) = job.groups.get(control) else {
                continue;
            };
            // Threads that moved to another control group meanwhile (`elsewhere`) are put in the
            // group there next pass.
            match group.keep_threads(tids) {
                Ok(Some(_)) => {}
                // The group went with its control group: as above.
                Ok(None) => {
                    job.groups.remove(control);
                }
                Err(e) => {
                    problem.get_or_insert(e.to_string());
                }
            }
        }
        say_failure(id, job, problem, notes);
    }

    /// Removes a job's groups (the job left). Notes say what failed.
    pub fn forget(&mut self, job: &JobId) -> Vec<JobGroupNote> {
        let mut notes = Vec::new();
        if let Some(groups) = self.jobs.remove(job) {
            for group in groups.groups.into_values() {
                if let Err(e) = group.remove() {
                    notes.push(JobGroupNote::Failed {
                        job: job.clone(),
                        error: e.to_string(),
                    });
                }
            }
        }
        notes
    }

    /// Removes every job's groups (the sampler stops).
    pub fn remove_all(&mut self) -> Vec<JobGroupNote> {
        let jobs: Vec<JobId> = self.jobs.keys().cloned().collect();
        jobs.iter().flat_map(|id| self.forget(id)).collect()
    }

    /// Each job's bandwidth from `rates`, the rates between two samples taken after [`sync`]
    /// (so they include the job's groups). Without rates (the first pass) only refusals are
    /// reported.
    ///
    /// [`sync`]: JobMonGroups::sync
    pub fn bandwidth(&self, rates: Option<&MbmRates>) -> BTreeMap<JobId, JobBandwidth> {
        let mut out = BTreeMap::new();
        for (id, job) in &self.jobs {
            let mut bw = JobBandwidth::default();
            if let Some(refused) = &job.refused {
                bw.unavailable = Some(refused.reason.clone());
            } else if let Some(rates) = rates {
                for group in job.groups.values() {
                    let Some(rate) = rates.groups.get(group.id()) else {
                        bw.total.missing += 1;
                        continue;
                    };
                    for (&domain, &r) in &rate.domains {
                        bw.total.add(r);
                        if let Some(r) = r {
                            *bw.domains.entry(domain).or_insert(0.0) += r;
                        }
                    }
                }
            }
            out.insert(id.clone(), bw);
        }
        out
    }
}

/// Says a job's failure unless it is the one said last; a pass without one clears it.
fn say_failure(
    id: &JobId,
    job: &mut JobGroups,
    problem: Option<String>,
    notes: &mut Vec<JobGroupNote>,
) {
    if let Some(error) = &problem {
        if job.failure.as_ref() != Some(error) {
            notes.push(JobGroupNote::Failed {
                job: id.clone(),
                error: error.clone(),
            });
        }
    }
    job.failure = problem;
}

/// mkdir failed because the control group it was under is no longer there.
fn control_vanished(root: &Path, control: Option<&str>, err: &MembwError) -> bool {
    matches!(err, MembwError::Create { source, .. } if source.kind() == io::ErrorKind::NotFound)
        && control.is_some_and(|c| !root.join(c).is_dir())
}

/// Why `name` cannot be a resctrl group directory, or `None` when it can. Shared with
/// `enforce::resctrl`, which creates control groups under the same rules.
pub fn group_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("it is empty")
    } else if name.len() > GROUP_NAME_MAX {
        Some("it is longer than 255 bytes")
    } else if name == "." || name == ".." {
        Some("it is a relative path")
    } else if [INFO, MON_DATA, MON_GROUPS].contains(&name) {
        Some("resctrl uses that name itself")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        Some("only ASCII letters, digits, '-', '_' and '.' are allowed")
    } else {
        None
    }
}

fn check_group_name(name: &str) -> Result<(), MembwError> {
    match group_name_problem(name) {
        Some(reason) => Err(MembwError::BadGroupName {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{copy_tree, resctrl_fixture as fixture, simulate_kernel_rmdir};

    fn write(path: &Path, content: &str) {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create parent");
        }
        fs::write(path, content).expect("write file");
    }

    /// A minimal mounted resctrl with MBM and the given default-group counter contents.
    fn minimal(root: &Path, domains: &[(&str, &str)]) {
        write(
            &root.join(MON_FEATURES),
            "llc_occupancy\nmbm_total_bytes\nmbm_local_bytes\n",
        );
        write(&root.join(NUM_RMIDS), "224\n");
        for (domain, content) in domains {
            write(
                &root.join(MON_DATA).join(domain).join(MBM_TOTAL_BYTES),
                content,
            );
        }
    }

    fn counter(root: &Path, group: &str, domain: &str) -> PathBuf {
        root.join(group)
            .join(MON_DATA)
            .join(domain)
            .join(MBM_TOTAL_BYTES)
    }

    /// `s`, stamped exactly `secs` after `first`, so rates are exact.
    fn later(first: &MbmSample, mut s: MbmSample, secs: u64) -> MbmSample {
        s.at = first.at + Duration::from_secs(secs);
        s
    }

    fn bytes(sample: &MbmSample, id: &GroupId, domain: u32) -> MbmReading {
        sample.groups[id].domains[&domain]
    }

    #[test]
    fn intel_fixture_is_mbm_with_every_group() {
        let reader = MbmReader::open(fixture("intel-mba-mbm")).expect("open intel fixture");
        assert_eq!(reader.mon_info().num_rmids, Some(224));
        assert!(reader
            .mon_info()
            .features
            .contains(&"mbm_local_bytes".to_string()));
        let s = reader.sample().expect("sample intel fixture");
        let ids: Vec<String> = s.groups.keys().map(ToString::to_string).collect();
        assert_eq!(
            ids,
            [
                "/",
                "mon_groups/j1",
                "lodger-lodgers",
                "lodger-lodgers/mon_groups/j3"
            ]
        );
        assert_eq!(
            bytes(&s, &GroupId::root(), 0),
            MbmReading::Bytes(41_797_419_466_752)
        );
        assert_eq!(s.groups[&GroupId::root()].domains.len(), 2);
        let j3 = GroupId::monitor(Some("lodger-lodgers"), "j3");
        assert_eq!(s.groups[&j3].domains.len(), 2);
    }

    #[test]
    fn amd_fixture_has_four_l3_domains() {
        let reader = MbmReader::open(fixture("amd")).expect("open amd fixture");
        let s = reader.sample().expect("sample amd fixture");
        let root = &s.groups[&GroupId::root()];
        assert_eq!(
            root.domains.keys().copied().collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert!(s.groups.contains_key(&GroupId::monitor(None, "j2")));
    }

    #[test]
    fn none_fixture_is_unavailable_not_mounted() {
        let err = MbmReader::open(fixture("none")).expect_err("none fixture");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("not mounted"), "{err}");
        let err = MbaCaps::read(&fixture("none"), &CpuVendor::Intel).expect_err("none fixture");
        assert!(err.to_string().contains("not mounted"), "{err}");
    }

    #[test]
    fn missing_root_is_unavailable_no_resctrl() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let err = MbmReader::open(tmp.path().join("resctrl")).expect_err("absent");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("CONFIG_X86_CPU_RESCTRL"), "{err}");
    }

    #[test]
    fn no_l3_mon_or_no_mbm_is_unavailable() {
        let tmp = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(tmp.path().join("info/L3")).expect("info");
        let err = MbmReader::open(tmp.path()).expect_err("no L3_MON");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("no L3 monitoring"), "{err}");

        write(&tmp.path().join(MON_FEATURES), "llc_occupancy\n");
        let err = MbmReader::open(tmp.path()).expect_err("no mbm");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("lists llc_occupancy"), "{err}");

        write(&tmp.path().join(MON_FEATURES), "");
        let err = MbmReader::open(tmp.path()).expect_err("empty features");
        assert!(err.to_string().contains("lists nothing"), "{err}");
    }

    #[test]
    fn unavailable_error_and_unassigned_readings() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(
            tmp.path(),
            &[
                ("mon_L3_00", "Unavailable\n"),
                ("mon_L3_01", "Error\n"),
                ("mon_L3_02", "Unassigned\n"),
                ("mon_L3_03", "12345\n"),
            ],
        );
        let s = MbmReader::open(tmp.path())
            .expect("open")
            .sample()
            .expect("sample");
        let root = GroupId::root();
        assert_eq!(bytes(&s, &root, 0), MbmReading::Unavailable);
        assert_eq!(bytes(&s, &root, 1), MbmReading::Error);
        assert_eq!(bytes(&s, &root, 2), MbmReading::Unavailable);
        assert_eq!(bytes(&s, &root, 3), MbmReading::Bytes(12345));
    }

    #[test]
    fn garbage_counter_names_path_and_value() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(tmp.path(), &[("mon_L3_00", "lots\n")]);
        let err = MbmReader::open(tmp.path())
            .expect("open")
            .sample()
            .expect_err("garbage");
        let msg = err.to_string();
        assert!(msg.contains("mon_L3_00/mbm_total_bytes"), "{msg}");
        assert!(msg.contains("'lots'"), "{msg}");
    }

    #[test]
    fn empty_counter_file_is_a_parse_error() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(tmp.path(), &[("mon_L3_00", "")]);
        let err = MbmReader::open(tmp.path())
            .expect("open")
            .sample()
            .expect_err("empty");
        assert!(matches!(err, MembwError::Parse { ref value, .. } if value.is_empty()));
    }

    #[test]
    fn garbage_num_rmids_is_a_parse_error() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(tmp.path(), &[("mon_L3_00", "1\n")]);
        write(&tmp.path().join(NUM_RMIDS), "many\n");
        let err = MbmReader::open(tmp.path()).expect_err("garbage num_rmids");
        assert!(err.to_string().contains("num_rmids: 'many'"), "{err}");
    }

    #[test]
    fn rates_per_group_domain_and_node_from_the_intel_fixture() {
        let tmp = tempfile::tempdir().expect("tempdir");
        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        let reader = MbmReader::open(tmp.path()).expect("open copy");
        let first = reader.sample().expect("first sample");
        let add = |group: &str, domain: &str, delta: u64| {
            let path = counter(tmp.path(), group, domain);
            let old: u64 = fs::read_to_string(&path)
                .expect("read counter")
                .trim()
                .parse()
                .expect("fixture counter is a number");
            write(&path, &format!("{}\n", old + delta));
        };
        // Two seconds: the root group moves 4 GB on domain 0 and 2 GB on domain 1, of which
        // j1 accounts for 1 GB on domain 0; the lodgers' control group moves 6 GB on domain 1,
        // all of it j3's.
        add("", "mon_L3_00", 4_000_000_000);
        add("", "mon_L3_01", 2_000_000_000);
        add("mon_groups/j1", "mon_L3_00", 1_000_000_000);
        add("lodger-lodgers", "mon_L3_01", 6_000_000_000);
        add("lodger-lodgers/mon_groups/j3", "mon_L3_01", 6_000_000_000);
        let second = later(&first, reader.sample().expect("second sample"), 2);
        let r = rates(&first, &second);
        let root = &r.groups[&GroupId::root()];
        assert_eq!(root.domains[&0], Some(2e9));
        assert_eq!(root.domains[&1], Some(1e9));
        assert_eq!(root.total.bytes_per_s, 3e9);
        assert!(root.total.is_complete());
        assert_eq!(
            r.groups[&GroupId::monitor(None, "j1")].total.bytes_per_s,
            0.5e9
        );
        assert_eq!(
            r.groups[&GroupId::monitor(Some("lodger-lodgers"), "j3")]
                .total
                .bytes_per_s,
            3e9
        );
        // The node counts CTRL_MON groups only: their counts include their mon groups.
        assert_eq!(r.domains[&0].bytes_per_s, 2e9);
        assert_eq!(r.domains[&1].bytes_per_s, 4e9);
        assert_eq!(r.node.bytes_per_s, 6e9);
        assert!(r.node.is_complete());
        assert_eq!(r.node_fraction(12e9), Some(0.5));
        assert_eq!(r.node_fraction(0.0), None);
        let mut peak = ObservedPeak::default();
        peak.observe(&r);
        assert_eq!(peak.bytes_per_s, 6e9);
    }

    #[test]
    fn unavailable_reading_is_left_out_and_counted() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(
            tmp.path(),
            &[("mon_L3_00", "1000\n"), ("mon_L3_01", "1000\n")],
        );
        let reader = MbmReader::open(tmp.path()).expect("open");
        let first = reader.sample().expect("first");
        write(&counter(tmp.path(), "", "mon_L3_00"), "3000\n");
        write(&counter(tmp.path(), "", "mon_L3_01"), "Unavailable\n");
        let second = later(&first, reader.sample().expect("second"), 1);
        let r = rates(&first, &second);
        assert_eq!(r.groups[&GroupId::root()].domains[&1], None);
        assert_eq!(r.node.bytes_per_s, 2000.0);
        assert_eq!(r.node.missing, 1);
        assert!(!r.node.is_complete());
        // An incomplete sum does not raise the observed peak.
        let mut peak = ObservedPeak::default();
        peak.observe(&r);
        assert_eq!(peak.bytes_per_s, 0.0);
    }

    #[test]
    fn counter_reset_drops_the_delta() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(
            tmp.path(),
            &[("mon_L3_00", "9000000\n"), ("mon_L3_01", "10\n")],
        );
        let reader = MbmReader::open(tmp.path()).expect("open");
        let first = reader.sample().expect("first");
        write(&counter(tmp.path(), "", "mon_L3_00"), "500\n");
        write(&counter(tmp.path(), "", "mon_L3_01"), "110\n");
        let second = later(&first, reader.sample().expect("second"), 1);
        let root = &rates(&first, &second).groups[&GroupId::root()];
        assert_eq!(root.domains[&0], None);
        assert_eq!(root.domains[&1], Some(100.0));
        assert_eq!(root.total.missing, 1);
    }

    #[test]
    fn recreated_group_drops_every_delta() {
        let id = GroupId::monitor(None, "j1");
        let group = |inode, count| GroupSample {
            inode,
            domains: BTreeMap::from([(0, MbmReading::Bytes(count))]),
        };
        let t0 = Instant::now();
        let prev = MbmSample {
            at: t0,
            groups: BTreeMap::from([(id.clone(), group(10, 100))]),
        };
        let cur = MbmSample {
            at: t0 + Duration::from_secs(1),
            groups: BTreeMap::from([(id.clone(), group(11, 5_000))]),
        };
        assert_eq!(rates(&prev, &cur).groups[&id].domains[&0], None);
        let same = MbmSample {
            at: t0 + Duration::from_secs(1),
            groups: BTreeMap::from([(id.clone(), group(10, 5_000))]),
        };
        assert_eq!(rates(&prev, &same).groups[&id].domains[&0], Some(4_900.0));
        // Zero interval: nothing.
        let now = MbmSample { at: t0, ..same };
        assert_eq!(rates(&prev, &now).groups[&id].domains[&0], None);
    }

    #[test]
    fn intel_mba_caps_are_percent() {
        let caps = MbaCaps::read(&fixture("intel-mba-mbm"), &CpuVendor::Intel).expect("caps");
        assert_eq!(caps.unit, MbaUnit::Percent);
        assert_eq!(caps.bandwidth_gran, 10);
        assert_eq!(caps.min_bandwidth, 10);
        assert_eq!(caps.num_closids, 8);
        assert!(caps.delay_linear);
        assert_eq!(caps.default_schemata, BTreeMap::from([(0, 100), (1, 100)]));
        assert_eq!(caps.max_value(), 100);
        assert_eq!(caps.valid_value(0), 10);
        assert_eq!(caps.valid_value(35), 40);
        assert_eq!(caps.valid_value(250), 100);
    }

    #[test]
    fn amd_mba_caps_are_absolute() {
        let caps = MbaCaps::read(&fixture("amd"), &CpuVendor::Amd).expect("caps");
        assert_eq!(caps.unit, MbaUnit::AmdEighthGigabytesPerSecond);
        assert_eq!(caps.bandwidth_gran, 1);
        assert_eq!(caps.min_bandwidth, 0);
        assert_eq!(caps.num_closids, 16);
        assert!(!caps.delay_linear);
        assert_eq!(caps.max_value(), 2048);
        assert_eq!(caps.valid_value(1000), 1000);
        assert_eq!(caps.valid_value(5000), 2048);
    }

    #[test]
    fn intel_mba_mbps_mount_and_unknown_vendor() {
        let tmp = tempfile::tempdir().expect("tempdir");
        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        write(
            &tmp.path().join(SCHEMATA),
            "    L3:0=7ff;1=7ff\n    MB:0=4294967295;1=4294967295\n",
        );
        let caps = MbaCaps::read(tmp.path(), &CpuVendor::Intel).expect("caps");
        assert_eq!(caps.unit, MbaUnit::MegabytesPerSecond);
        assert_eq!(caps.valid_value(5000), 5000);
        let err = MbaCaps::read(tmp.path(), &CpuVendor::from_vendor_id("CentaurHauls"))
            .expect_err("unknown vendor");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("CentaurHauls"), "{err}");
    }

    #[test]
    fn no_mb_info_is_unavailable_and_bad_files_are_parse_errors() {
        let tmp = tempfile::tempdir().expect("tempdir");
        minimal(tmp.path(), &[("mon_L3_00", "1\n")]);
        let err = MbaCaps::read(tmp.path(), &CpuVendor::Intel).expect_err("no info/MB");
        assert!(err.is_unavailable());
        assert!(err.to_string().contains("MBA"), "{err}");

        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        write(&tmp.path().join(MB_BANDWIDTH_GRAN), "ten\n");
        let err = MbaCaps::read(tmp.path(), &CpuVendor::Intel).expect_err("garbage gran");
        assert!(err.to_string().contains("bandwidth_gran: 'ten'"), "{err}");
        write(&tmp.path().join(MB_BANDWIDTH_GRAN), "");
        let err = MbaCaps::read(tmp.path(), &CpuVendor::Intel).expect_err("empty gran");
        assert!(matches!(err, MembwError::Parse { .. }), "{err}");
        write(&tmp.path().join(MB_BANDWIDTH_GRAN), "10\n");
        write(
            &tmp.path().join(SCHEMATA),
            "    L3:0=7ff;1=7ff\n    MB:0=x;1=100\n",
        );
        let err = MbaCaps::read(tmp.path(), &CpuVendor::Intel).expect_err("garbage schemata");
        assert!(err.to_string().contains("MB:0=x;1=100"), "{err}");
        write(&tmp.path().join(SCHEMATA), "    L3:0=7ff;1=7ff\n");
        let err = MbaCaps::read(tmp.path(), &CpuVendor::Intel).expect_err("no MB line");
        assert!(err.to_string().contains("no MB line"), "{err}");
    }

    #[test]
    fn vendor_from_cpuinfo() {
        let tmp = tempfile::tempdir().expect("tempdir");
        write(
            &tmp.path().join("cpuinfo"),
            "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n",
        );
        assert_eq!(
            CpuVendor::from_cpuinfo(tmp.path()).expect("amd"),
            CpuVendor::Amd
        );
        write(&tmp.path().join("cpuinfo"), "processor\t: 0\n");
        assert!(CpuVendor::from_cpuinfo(tmp.path()).is_err());
        write(&tmp.path().join("cpuinfo"), "");
        assert!(CpuVendor::from_cpuinfo(tmp.path()).is_err());
        assert_eq!(CpuVendor::from_vendor_id("GenuineIntel"), CpuVendor::Intel);
        assert_eq!(CpuVendor::from_vendor_id("HygonGenuine"), CpuVendor::Amd);
    }

    #[test]
    fn mon_group_create_move_and_remove_on_a_fixture_tree() {
        let tmp = tempfile::tempdir().expect("tempdir");
        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        let group = MonGroup::create(tmp.path(), None, "j9").expect("create");
        assert_eq!(group.path(), tmp.path().join("mon_groups/j9"));
        assert_eq!(group.id().to_string(), "mon_groups/j9");
        // Idempotent: a second create adopts the existing directory.
        let again = MonGroup::create(tmp.path(), None, "j9").expect("adopt");
        assert_eq!(again, group);
        let moved = group.move_threads(&[100, 101]).expect("move");
        assert_eq!(moved.moved, [100, 101]);
        // This process's threads, found through the real /proc.
        let me = std::process::id();
        let moved = group
            .move_processes(Path::new("/proc"), &[me, u32::MAX])
            .expect("move self");
        assert!(moved.moved.contains(&me), "{moved:?}");
        assert_eq!(moved.gone, [u32::MAX]);
        let tasks = fs::read_to_string(group.path().join(TASKS)).expect("tasks");
        assert!(tasks.starts_with("100\n101\n"), "{tasks}");
        // On resctrl, rmdir succeeds with the kernel's files inside; a plain directory needs
        // them gone first, as the kernel would do.
        fs::remove_file(group.path().join(TASKS)).expect("simulate kernel");
        assert!(group.remove().expect("remove"));
        assert!(!tmp.path().join("mon_groups/j9").exists());
        assert!(!remove_job_mon_group(tmp.path(), None, "j9").expect("already gone"));

        let nested =
            MonGroup::create(tmp.path(), Some("lodger-lodgers"), "j10").expect("nested create");
        assert_eq!(
            nested.path(),
            tmp.path().join("lodger-lodgers/mon_groups/j10")
        );
        assert!(remove_job_mon_group(tmp.path(), Some("lodger-lodgers"), "j10").expect("rm"));
    }

    #[test]
    fn mon_group_refuses_bad_names_and_unmounted_roots() {
        let tmp = tempfile::tempdir().expect("tempdir");
        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "mon_groups",
            "info",
            "j 1",
            &"x".repeat(256),
        ] {
            let err = MonGroup::create(tmp.path(), None, bad).expect_err(bad);
            assert!(
                matches!(err, MembwError::BadGroupName { .. }),
                "{bad}: {err}"
            );
        }
        let err = MonGroup::create(tmp.path(), Some("../etc"), "j1").expect_err("bad control");
        assert!(matches!(err, MembwError::BadGroupName { .. }), "{err}");
        let err = MonGroup::create(&fixture("none"), None, "j1").expect_err("not mounted");
        assert!(err.is_unavailable(), "{err}");
        // A control group that does not exist: mkdir fails, with the path.
        let err = MonGroup::create(tmp.path(), Some("nosuch"), "j1").expect_err("no parent");
        assert!(err.to_string().contains("nosuch/mon_groups/j1"), "{err}");
    }

    #[test]
    fn this_machine_resctrl_state_is_reported_not_guessed() {
        // Whatever this host has, open either works or says why not; it never panics.
        match MbmReader::open(DEFAULT_RESCTRL_ROOT) {
            Ok(reader) => {
                reader.sample().expect("sample the real resctrl");
            }
            Err(e) => {
                // What lodgerd logs once at start.
                eprintln!("memory bandwidth sensing off: {e}");
                assert!(
                    e.is_unavailable() || matches!(e, MembwError::Io { .. }),
                    "{e}"
                );
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Per-job monitoring groups.

    fn job(n: u64) -> JobId {
        JobId::from_seq(n)
    }

    /// A fake `/proc` with `<pid>/task/<tid>` for each process and its threads.
    fn fake_proc(root: &Path, processes: &[(u32, &[u32])]) {
        for (pid, tids) in processes {
            for tid in *tids {
                fs::create_dir_all(
                    root.join(pid.to_string())
                        .join("task")
                        .join(tid.to_string()),
                )
                .expect("fake task dir");
            }
        }
    }

    /// What the kernel does on mkdir of a monitoring group: it fills `mon_data` with a counter
    /// per L3 domain.
    fn simulate_kernel_mkdir(group: &Path, counters: &[(&str, &str)]) {
        for (domain, value) in counters {
            write(
                &group.join(MON_DATA).join(domain).join(MBM_TOTAL_BYTES),
                value,
            );
        }
    }

    fn tasks_of(dir: &Path) -> String {
        fs::read_to_string(dir.join(TASKS)).unwrap_or_default()
    }

    fn sync(groups: &mut JobMonGroups, jobs: &[(JobId, Vec<u32>)]) -> Vec<JobGroupNote> {
        groups.sync(jobs.iter().map(|(id, pids)| (id, pids.as_slice())))
    }

    #[test]
    fn job_groups_are_made_and_follow_new_threads() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
        copy_tree(&fixture("intel-mba-mbm"), &root);
        fake_proc(&proc_root, &[(100, &[100, 101]), (200, &[200])]);
        let mut groups = JobMonGroups::new(&root, &proc_root);
        // Job 3 lists a process that has exited: skipped, not an error.
        let jobs = vec![(job(1), vec![100]), (job(2), vec![200, 999])];
        assert_eq!(sync(&mut groups, &jobs), []);
        let j1 = root.join("mon_groups/lodger-j1");
        assert_eq!(tasks_of(&j1), "100\n101\n");
        assert_eq!(tasks_of(&root.join("mon_groups/lodger-j2")), "200\n");
        assert_eq!(
            groups.groups(&job(1)),
            [GroupId::monitor(None, "lodger-j1")]
        );
        // Other monitoring groups are not touched.
        assert_eq!(
            tasks_of(&root.join("mon_groups/j1")),
            "48211\n48230\n48231\n48232\n48233\n"
        );

        // A second pass writes nothing: every thread is listed already.
        assert_eq!(sync(&mut groups, &jobs), []);
        assert_eq!(tasks_of(&j1), "100\n101\n");

        // A thread started before the group existed (or by a process the job gained) is added.
        fake_proc(&proc_root, &[(100, &[102])]);
        sync(&mut groups, &jobs);
        assert_eq!(tasks_of(&j1), "100\n101\n102\n");

        // The job's process exits: its group is left empty and removed.
        fs::remove_dir_all(proc_root.join("100")).expect("exit");
        simulate_kernel_rmdir(&j1);
        assert_eq!(sync(&mut groups, &jobs), []);
        assert!(!j1.exists());
        assert!(groups.groups(&job(1)).is_empty());
    }

    #[test]
    fn job_bandwidth_per_domain_with_unavailable_and_reset_readings() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
        copy_tree(&fixture("amd"), &root);
        fake_proc(&proc_root, &[(100, &[100]), (200, &[200])]);
        let mut groups = JobMonGroups::new(&root, &proc_root);
        let jobs = vec![(job(1), vec![100]), (job(2), vec![200])];
        sync(&mut groups, &jobs);
        let (j1, j2) = (
            root.join("mon_groups/lodger-j1"),
            root.join("mon_groups/lodger-j2"),
        );
        let domains = ["mon_L3_00", "mon_L3_01", "mon_L3_02", "mon_L3_03"];
        simulate_kernel_mkdir(&j1, &domains.map(|d| (d, "1000\n")));
        // A fresh RMID: the AMD kernel says Unavailable until the hardware has a count.
        simulate_kernel_mkdir(&j2, &domains.map(|d| (d, "Unavailable\n")));
        let reader = MbmReader::open(&root).expect("open");
        let first = reader.sample().expect("first");
        // No rates from a single sample.
        let bw = groups.bandwidth(None);
        assert_eq!(bw[&job(1)].bytes_per_s(), None);

        // Two seconds: j1 moves 4 GB on domain 0 and 2 GB on domain 3; domain 1 reads Error and
        // domain 2's counter went backwards (the domain went offline and back).
        write(
            &counter(&root, "mon_groups/lodger-j1", "mon_L3_00"),
            "4000001000\n",
        );
        write(
            &counter(&root, "mon_groups/lodger-j1", "mon_L3_01"),
            "Error\n",
        );
        write(&counter(&root, "mon_groups/lodger-j1", "mon_L3_02"), "10\n");
        write(
            &counter(&root, "mon_groups/lodger-j1", "mon_L3_03"),
            "2000001000\n",
        );
        write(
            &counter(&root, "mon_groups/lodger-j2", "mon_L3_00"),
            "5000\n",
        );
        assert_eq!(sync(&mut groups, &jobs), []);
        let second = later(&first, reader.sample().expect("second"), 2);
        let r = rates(&first, &second);
        let bw = groups.bandwidth(Some(&r));
        let b1 = &bw[&job(1)];
        assert_eq!(b1.domains, BTreeMap::from([(0, 2e9), (3, 1e9)]));
        assert_eq!(b1.total.bytes_per_s, 3e9);
        assert_eq!(b1.total.missing, 2);
        assert_eq!(b1.bytes_per_s(), Some(3e9));
        // j2 has no count anywhere yet: unmeasured, not zero.
        assert_eq!(bw[&job(2)].bytes_per_s(), None);
        assert!(bw[&job(2)].domains.is_empty());

        // The next interval is clean for j1 and j2 starts counting.
        write(
            &counter(&root, "mon_groups/lodger-j1", "mon_L3_01"),
            "3000\n",
        );
        write(
            &counter(&root, "mon_groups/lodger-j2", "mon_L3_00"),
            "1005000\n",
        );
        let third = later(&second, reader.sample().expect("third"), 1);
        let bw = groups.bandwidth(Some(&rates(&second, &third)));
        assert_eq!(bw[&job(1)].bytes_per_s(), Some(0.0));
        assert_eq!(bw[&job(1)].total.missing, 1, "domain 1 was Error before");
        assert_eq!(bw[&job(2)].domains, BTreeMap::from([(0, 1e6)]));
    }

    #[test]
    fn job_group_follows_its_threads_into_lodgers_control_group_and_back() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
        copy_tree(&fixture("intel-mba-mbm"), &root);
        fake_proc(&proc_root, &[(300, &[300, 301])]);
        let mut groups = JobMonGroups::new(&root, &proc_root);
        let jobs = vec![(job(3), vec![300])];
        sync(&mut groups, &jobs);
        let in_default = root.join("mon_groups/lodger-j3");
        assert_eq!(tasks_of(&in_default), "300\n301\n");

        // Contention control moves the job into lodger's control group for MBA: the kernel
        // lists the threads there, and takes them out of their monitoring group.
        let control = root.join("lodger-lodgers");
        fs::write(control.join(TASKS), "300\n301\n").expect("move to control group");
        simulate_kernel_rmdir(&in_default);
        assert_eq!(sync(&mut groups, &jobs), []);
        let in_control = control.join("mon_groups/lodger-j3");
        assert_eq!(tasks_of(&in_control), "300\n301\n");
        assert!(!in_default.exists(), "the emptied group is removed");
        assert_eq!(
            groups.groups(&job(3)),
            [GroupId::monitor(Some("lodger-lodgers"), "lodger-j3")]
        );
        // The other job's group under the control group is not touched.
        assert_eq!(tasks_of(&control.join("mon_groups/j3")), "51002\n51003\n");

        // A thread started meanwhile in the default group: the job has a group under each, and
        // its bandwidth is their sum.
        fake_proc(&proc_root, &[(300, &[302])]);
        sync(&mut groups, &jobs);
        assert_eq!(tasks_of(&in_default), "302\n");
        simulate_kernel_mkdir(&in_default, &[("mon_L3_00", "0\n"), ("mon_L3_01", "0\n")]);
        simulate_kernel_mkdir(&in_control, &[("mon_L3_00", "0\n"), ("mon_L3_01", "0\n")]);
        let reader = MbmReader::open(&root).expect("open");
        let first = reader.sample().expect("first");
        write(
            &in_default.join("mon_data/mon_L3_00/mbm_total_bytes"),
            "100\n",
        );
        write(
            &in_control.join("mon_data/mon_L3_00/mbm_total_bytes"),
            "200\n",
        );
        write(
            &in_control.join("mon_data/mon_L3_01/mbm_total_bytes"),
            "50\n",
        );
        let second = later(&first, reader.sample().expect("second"), 1);
        let bw = &groups.bandwidth(Some(&rates(&first, &second)))[&job(3)];
        assert_eq!(bw.domains, BTreeMap::from([(0, 300.0), (1, 50.0)]));
        assert!(bw.total.is_complete());

        // Throttling ends and the control group is removed with its monitoring groups: the
        // threads are back in the default group.
        simulate_kernel_rmdir(&control);
        fs::remove_dir(&control).expect("rmdir control group");
        assert_eq!(sync(&mut groups, &jobs), []);
        assert_eq!(tasks_of(&in_default), "302\n300\n301\n");
        assert_eq!(
            groups.groups(&job(3)),
            [GroupId::monitor(None, "lodger-j3")]
        );
    }

    #[test]
    fn job_groups_go_when_the_job_leaves_and_when_everything_stops() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
        copy_tree(&fixture("intel-mba-mbm"), &root);
        fake_proc(&proc_root, &[(100, &[100]), (200, &[200])]);
        let mut groups = JobMonGroups::new(&root, &proc_root);
        sync(&mut groups, &[(job(1), vec![100]), (job(2), vec![200])]);
        let (j1, j2) = (
            root.join("mon_groups/lodger-j1"),
            root.join("mon_groups/lodger-j2"),
        );
        simulate_kernel_rmdir(&j1);
        assert_eq!(sync(&mut groups, &[(job(2), vec![200])]), []);
        assert!(!j1.exists() && j2.exists());
        assert_eq!(groups.bandwidth(None).keys().collect::<Vec<_>>(), [&job(2)]);

        // A removal that fails is said, with the path.
        let notes = groups.remove_all();
        assert!(
            matches!(&notes[..], [JobGroupNote::Failed { job: failed, error }]
                if *failed == job(2) && error.contains("mon_groups/lodger-j2")),
            "{notes:?}"
        );
        // The job is forgotten either way; the kernel would have removed the group.
        assert!(groups.bandwidth(None).is_empty());
        simulate_kernel_rmdir(&j2);
        fs::remove_dir(&j2).expect("rmdir");

        sync(&mut groups, &[(job(1), vec![100])]);
        simulate_kernel_rmdir(&j1);
        assert_eq!(groups.forget(&job(1)), []);
        assert!(!j1.exists());
    }

    #[test]
    fn stale_sweep_removes_only_lodgers_groups() {
        let tmp = tempfile::tempdir().expect("tempdir");
        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        for dir in [
            "mon_groups/lodger-j9",
            "lodger-lodgers/mon_groups/lodger-j4",
        ] {
            fs::create_dir_all(tmp.path().join(dir)).expect("stale group");
        }
        let swept = sweep_job_groups(tmp.path()).expect("sweep");
        assert!(swept.failed.is_empty(), "{:?}", swept.failed);
        let removed: Vec<String> = swept.removed.iter().map(ToString::to_string).collect();
        assert_eq!(
            removed,
            [
                "mon_groups/lodger-j9",
                "lodger-lodgers/mon_groups/lodger-j4"
            ]
        );
        assert!(tmp.path().join("mon_groups/j1").is_dir());
        assert!(tmp.path().join("lodger-lodgers/mon_groups/j3").is_dir());
        // Nothing left: nothing to do.
        assert!(sweep_job_groups(tmp.path())
            .expect("again")
            .removed
            .is_empty());
        // A stale group the kernel will not remove is reported, not fatal.
        write(&tmp.path().join("mon_groups/lodger-j5/tasks"), "1\n");
        let swept = sweep_job_groups(tmp.path()).expect("sweep");
        assert_eq!(swept.failed.len(), 1);
        assert!(
            swept.failed[0].to_string().contains("lodger-j5"),
            "{:?}",
            swept.failed
        );
        // No resctrl: unavailable, as for reading.
        assert!(sweep_job_groups(&fixture("none"))
            .expect_err("none")
            .is_unavailable());
    }

    #[test]
    fn out_of_rmids_makes_one_job_unavailable_with_one_note_and_a_quiet_retry() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::Arc;
        let tmp = tempfile::tempdir().expect("tempdir");
        let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
        copy_tree(&fixture("intel-mba-mbm"), &root);
        fake_proc(&proc_root, &[(100, &[100]), (200, &[200])]);
        // The kernel's RMID allocator, which a plain directory lacks: one RMID is free.
        let free = Arc::new(AtomicU32::new(1));
        let attempts = Arc::new(AtomicU32::new(0));
        let (f, a) = (free.clone(), attempts.clone());
        let mut groups = JobMonGroups::new(&root, &proc_root).with_create(Box::new(
            move |root: &Path, control: Option<&str>, name: &str| {
                a.fetch_add(1, Ordering::SeqCst);
                if f.load(Ordering::SeqCst) == 0 {
                    let path = root.join(GroupId::monitor(control, name).relative_path());
                    return Err(create_error(
                        root,
                        path,
                        io::Error::from_raw_os_error(libc::ENOSPC),
                    ));
                }
                f.fetch_sub(1, Ordering::SeqCst);
                MonGroup::create(root, control, name)
            },
        ));
        let jobs = vec![(job(1), vec![100]), (job(2), vec![200])];
        let notes = sync(&mut groups, &jobs);
        let [JobGroupNote::Unavailable {
            job: refused,
            reason,
        }] = &notes[..]
        else {
            panic!("one note: {notes:?}");
        };
        assert_eq!(*refused, job(2));
        assert!(reason.contains("no free RMID: 224"), "{reason}");
        assert!(reason.contains("mon_groups/lodger-j2"), "{reason}");
        assert!(!root.join("mon_groups/lodger-j2").exists());
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        let bw = groups.bandwidth(None);
        assert_eq!(bw[&job(2)].unavailable.as_deref(), Some(reason.as_str()));
        assert_eq!(bw[&job(2)].bytes_per_s(), None);
        assert_eq!(bw[&job(1)].unavailable, None);

        // No error loop: the next passes say nothing and do not try again at once.
        for _ in 1..CREATE_RETRY_PASSES {
            assert_eq!(sync(&mut groups, &jobs), []);
        }
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        // Still none free at the retry: tried once, quietly.
        assert_eq!(sync(&mut groups, &jobs), []);
        assert_eq!(attempts.load(Ordering::SeqCst), 3);

        // Job 1 leaves and its RMID is free again: job 2 gets a group at the next retry.
        simulate_kernel_rmdir(&root.join("mon_groups/lodger-j1"));
        let jobs = vec![(job(2), vec![200])];
        sync(&mut groups, &jobs);
        free.fetch_add(1, Ordering::SeqCst);
        let mut notes = Vec::new();
        for _ in 0..CREATE_RETRY_PASSES {
            notes.extend(sync(&mut groups, &jobs));
        }
        assert_eq!(notes, [JobGroupNote::Measured { job: job(2) }]);
        assert_eq!(tasks_of(&root.join("mon_groups/lodger-j2")), "200\n");
        assert_eq!(groups.bandwidth(None)[&job(2)].unavailable, None);
    }

    #[test]
    fn a_failure_that_repeats_is_said_once() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
        copy_tree(&fixture("intel-mba-mbm"), &root);
        fake_proc(&proc_root, &[(100, &[100])]);
        let mut groups = JobMonGroups::new(&root, &proc_root);
        let jobs = vec![(job(1), vec![100])];
        write(&root.join("lodger-lodgers/tasks"), "garbage\n");
        let notes = sync(&mut groups, &jobs);
        assert!(
            matches!(&notes[..], [JobGroupNote::Failed { error, .. }]
                if error.contains("lodger-lodgers/tasks") && error.contains("'garbage'")),
            "{notes:?}"
        );
        assert_eq!(sync(&mut groups, &jobs), []);
        // Nothing was written while the control groups could not be read.
        assert!(!root.join("mon_groups/lodger-j1").exists());
        write(&root.join("lodger-lodgers/tasks"), "");
        assert_eq!(sync(&mut groups, &jobs), []);
        assert_eq!(tasks_of(&root.join("mon_groups/lodger-j1")), "100\n");
    }

    #[test]
    fn keep_threads_writes_only_missing_threads_and_sees_a_vanished_group() {
        let tmp = tempfile::tempdir().expect("tempdir");
        copy_tree(&fixture("intel-mba-mbm"), tmp.path());
        let group = MonGroup::create(tmp.path(), None, "lodger-j1").expect("create");
        let done = group.keep_threads(&[5, 6]).expect("keep").expect("present");
        assert_eq!(done.moved, [5, 6]);
        let done = group
            .keep_threads(&[5, 6, 7])
            .expect("keep")
            .expect("present");
        assert_eq!(done.moved, [7]);
        assert_eq!(tasks_of(group.path()), "5\n6\n7\n");
        simulate_kernel_rmdir(group.path());
        fs::remove_dir(group.path()).expect("rmdir");
        assert_eq!(group.keep_threads(&[5]).expect("gone"), None);
    }
}
