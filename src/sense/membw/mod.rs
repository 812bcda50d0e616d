//! Memory-bandwidth sensing through resctrl: MBM byte counters per resctrl group and per L3
//! domain (`mon_data/mon_L3_XX/mbm_total_bytes`), turned into bytes/s from two samples
//! (SODA §V-E). Everything takes the resctrl root (`DEFAULT_RESCTRL_ROOT`) as an argument; the
//! resctrl files themselves (mount checks, names, `tasks`, MBA capabilities) are `sys::resctrlfs`.
//!
//! Reads only, except the monitoring groups lodger makes for jobs ([`groups`]: [`MonGroup`] and
//! [`JobMonGroups`], which keeps one group per job in step with the job's threads and turns the
//! groups' counters into bandwidth per job). These are the only writes, kept next to the reader
//! that consumes them.
//!
//! Where resctrl or MBM is missing, [`MbmReader::open`] answers [`ResctrlfsError::Unavailable`]
//! with the reason; the caller logs it once and reports bandwidth as unavailable. Nothing here
//! estimates bandwidth from other signals.

pub mod groups;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::sys::resctrlfs::{
    check_mounted, control_groups, io_err, read_optional_u32, read_text, subdirs, unavailable,
    ResctrlfsError, L3_DOMAIN_PREFIX, L3_MON, MBM_TOTAL_BYTES, MON_DATA, MON_FEATURES, MON_GROUPS,
    NUM_RMIDS,
};

pub use self::groups::{
    create_error, job_group_name, remove_job_mon_group, sweep_job_groups, CreateMonGroup,
    JobBandwidth, JobGroupNote, JobMonGroups, MonGroup, Swept, CREATE_RETRY_PASSES,
    JOB_GROUP_PREFIX,
};

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
    fn sample(&mut self) -> Result<MbmSample, ResctrlfsError>;
}

impl MbmSource for MbmReader {
    fn sample(&mut self) -> Result<MbmSample, ResctrlfsError> {
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
    /// [`ResctrlfsError::Unavailable`] says which part is missing.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, ResctrlfsError> {
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
    pub fn sample(&self) -> Result<MbmSample, ResctrlfsError> {
        let mut groups = BTreeMap::new();
        let mut read = |id: GroupId| -> Result<(), ResctrlfsError> {
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

/// One group's counters; `None` when the group vanished while being read.
fn read_group(dir: &Path) -> Result<Option<GroupSample>, ResctrlfsError> {
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
        let reading = MbmReading::parse(&text).ok_or_else(|| ResctrlfsError::Parse {
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
    /// The node's bandwidth as a fraction of `peak_bytes_per_s` (configured: measured once, e.g.
    /// with `examples/membw_hog`, or the platform's figure). A lower bound when `node` is
    /// incomplete; `None` for a peak that is not a positive number (none configured).
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
