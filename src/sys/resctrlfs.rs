//! resctrl (`/sys/fs/resctrl`) as files, for `sense::membw` (monitoring) and `enforce::resctrl`
//! (MBA): whether it is mounted (and with MBA), the names a group may have, the MBA capabilities
//! (`info/MB/*`, the default group's `schemata`) and the `MB:` schemata line, a group's `tasks`
//! (read, and written to move threads in), one write of a control file, and removing a group.
//! Takes the resctrl root as an argument (`DEFAULT_RESCTRL_ROOT` at the top); errors carry the
//! path and the value. Touches nothing but the paths it is given.
//!
//! Where resctrl or MBA is missing, [`check_mounted`], [`check_mba`] and [`MbaCaps::read`] answer
//! [`ResctrlfsError::Unavailable`] with the reason; callers log it once and go without.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

/// Where the kernel mounts resctrl.
pub const DEFAULT_RESCTRL_ROOT: &str = "/sys/fs/resctrl";

pub const INFO: &str = "info";
pub const L3_MON: &str = "info/L3_MON";
pub const MON_FEATURES: &str = "info/L3_MON/mon_features";
pub const NUM_RMIDS: &str = "info/L3_MON/num_rmids";
pub const MB_INFO: &str = "info/MB";
pub const MB_BANDWIDTH_GRAN: &str = "info/MB/bandwidth_gran";
pub const MB_MIN_BANDWIDTH: &str = "info/MB/min_bandwidth";
pub const MB_NUM_CLOSIDS: &str = "info/MB/num_closids";
pub const MB_DELAY_LINEAR: &str = "info/MB/delay_linear";
pub const MON_DATA: &str = "mon_data";
pub const MON_GROUPS: &str = "mon_groups";
pub const MBM_TOTAL_BYTES: &str = "mbm_total_bytes";
pub const SCHEMATA: &str = "schemata";
pub const TASKS: &str = "tasks";
/// The kernel's reason for the last failed write to a resctrl file.
pub const LAST_CMD_STATUS: &str = "info/last_cmd_status";
/// Prefix of an L3 monitoring domain directory: `mon_L3_00`, `mon_L3_01`, ...
pub const L3_DOMAIN_PREFIX: &str = "mon_L3_";
/// Resource name of memory-bandwidth allocation in `schemata`.
const MB_RESOURCE: &str = "MB";
/// Longest resctrl group name (a directory name: NAME_MAX).
const GROUP_NAME_MAX: usize = 255;
/// Default-group MB value of Intel's software controller (`mount -o mba_MBps`): U32_MAX.
const MBA_MBPS_MAX: u32 = u32::MAX;
/// The largest percentage an Intel MB schemata value can be.
const PERCENT_MAX: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum ResctrlfsError {
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
    #[error("cannot write '{value}' to {path}: {source}{status}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
        /// The kernel's `info/last_cmd_status` after the failure, when it says more than "ok".
        status: String,
    },
    #[error("cannot remove resctrl group {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

impl ResctrlfsError {
    /// True when the feature is absent (as opposed to present but failing).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ResctrlfsError::Unavailable { .. })
    }
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ResctrlfsError + '_ {
    move |source| ResctrlfsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn unavailable(path: &Path, reason: impl Into<String>) -> ResctrlfsError {
    ResctrlfsError::Unavailable {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Mount and directories.

/// resctrl is mounted when its root holds `info`; an unmounted mount point is an empty
/// directory, and a kernel without resctrl support has no mount point at all.
pub fn check_mounted(root: &Path) -> Result<(), ResctrlfsError> {
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

/// resctrl with MBA mounted at `root`: mounted ([`check_mounted`]) and `info/MB` there.
pub fn check_mba(root: &Path) -> Result<(), ResctrlfsError> {
    check_mounted(root)?;
    let info = root.join(MB_INFO);
    if !info.is_dir() {
        return Err(unavailable(
            &info,
            "no memory-bandwidth allocation (MBA): the CPU lacks it or it is turned off",
        ));
    }
    Ok(())
}

/// The control groups: directories at the root other than `info`, `mon_data` and `mon_groups`.
pub fn control_groups(root: &Path) -> Result<Vec<String>, ResctrlfsError> {
    Ok(subdirs(root)?
        .into_iter()
        .filter(|name| ![INFO, MON_DATA, MON_GROUPS].contains(&name.as_str()))
        .collect())
}

/// Names of the directories in `dir`, sorted; empty when `dir` does not exist.
pub fn subdirs(dir: &Path) -> Result<Vec<String>, ResctrlfsError> {
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

pub(crate) fn read_text(path: &Path) -> Result<String, ResctrlfsError> {
    fs::read_to_string(path).map_err(io_err(path))
}

fn parse_u32(path: &Path, text: &str) -> Result<u32, ResctrlfsError> {
    let value = text.trim();
    value.parse().map_err(|_| ResctrlfsError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        reason: "is not a non-negative integer".to_string(),
    })
}

fn read_u32(path: &Path) -> Result<u32, ResctrlfsError> {
    parse_u32(path, &read_text(path)?)
}

pub(crate) fn read_optional_u32(path: &Path) -> Result<Option<u32>, ResctrlfsError> {
    match fs::read_to_string(path) {
        Ok(text) => parse_u32(path, &text).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(io_err(path)(source)),
    }
}

// ---------------------------------------------------------------------------------------------
// MBA capabilities and the schemata line.

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
    pub fn from_cpuinfo(proc_root: &Path) -> Result<Self, ResctrlfsError> {
        let path = proc_root.join("cpuinfo");
        let text = read_text(&path)?;
        text.lines()
            .filter_map(|line| line.split_once(':'))
            .find(|(key, _)| key.trim() == "vendor_id")
            .map(|(_, value)| Self::from_vendor_id(value))
            .ok_or_else(|| ResctrlfsError::Parse {
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
    /// mount option. A vendor other than Intel or AMD is [`ResctrlfsError::Unavailable`]: the meaning
    /// of its values is not known here, and guessing could throttle a job to nothing.
    pub fn read(root: &Path, vendor: &CpuVendor) -> Result<Self, ResctrlfsError> {
        check_mba(root)?;
        let info = root.join(MB_INFO);
        let schemata_path = root.join(SCHEMATA);
        let default_schemata = parse_mb_schemata(&schemata_path, &read_text(&schemata_path)?)?;
        if default_schemata.is_empty() {
            return Err(ResctrlfsError::Parse {
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
                return Err(ResctrlfsError::Parse {
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
pub fn parse_mb_schemata(path: &Path, text: &str) -> Result<BTreeMap<u32, u32>, ResctrlfsError> {
    let mut values = BTreeMap::new();
    let bad = |value: &str, reason: &str| ResctrlfsError::Parse {
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

/// `MB:0=50;1=50` plus a newline: the line [`parse_mb_schemata`] reads, for one write.
pub fn format_mb_schemata(values: &BTreeMap<u32, u32>) -> String {
    let items: Vec<String> = values.iter().map(|(d, v)| format!("{d}={v}")).collect();
    format!("MB:{}\n", items.join(";"))
}

// ---------------------------------------------------------------------------------------------
// Groups: names, tasks, control files, removal.

/// Why `name` cannot be a resctrl group directory (control or monitoring), or `None` when it can.
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

pub fn check_group_name(name: &str) -> Result<(), ResctrlfsError> {
    match group_name_problem(name) {
        Some(reason) => Err(ResctrlfsError::BadGroupName {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Which kind of group a `tasks` file belongs to; it decides what the kernel's EINVAL means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// The default group or a control (CTRL_MON) group: EINVAL is a failure.
    Control,
    /// A monitoring group: EINVAL is a thread that is in another control group now.
    Monitor,
}

/// What moving tasks into a group did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskMove {
    pub moved: Vec<u32>,
    /// TIDs that exited before they could be moved (ESRCH).
    pub gone: Vec<u32>,
    /// TIDs a monitoring group refused because they are in another control group now (EINVAL,
    /// "Can't move task to different control group"): lodger's contention control moved them
    /// meanwhile. Only a write into a monitoring group ([`GroupKind::Monitor`]) reports these.
    pub elsewhere: Vec<u32>,
}

/// The TIDs listed in the `tasks` file at `path`, in the kernel's order. A fixture group made by
/// `mkdir` has no `tasks` file until something is written: empty, while its directory exists.
/// When the directory is gone too, the error is [`ResctrlfsError::Io`] with `NotFound`.
pub fn read_tasks(path: &Path) -> Result<Vec<u32>, ResctrlfsError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e)
            if e.kind() == io::ErrorKind::NotFound && path.parent().is_some_and(Path::is_dir) =>
        {
            String::new()
        }
        Err(source) => return Err(io_err(path)(source)),
    };
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.parse().map_err(|_| ResctrlfsError::Parse {
                path: path.to_path_buf(),
                value: l.to_string(),
                reason: "is not a thread id".to_string(),
            })
        })
        .collect()
}

/// Moves threads into the group whose `tasks` file is `path` (under the resctrl mounted at
/// `root`), one write per TID (older kernels take one id per write). ESRCH means the thread
/// exited; EINVAL, in a monitoring group, that it is in another control group now. resctrl moves
/// single threads: pass every TID of a process.
pub fn write_tasks(
    root: &Path,
    path: &Path,
    kind: GroupKind,
    tids: &[u32],
) -> Result<TaskMove, ResctrlfsError> {
    let mut done = TaskMove::default();
    if tids.is_empty() {
        return Ok(done);
    }
    // `create` only matters on a fixture tree: on resctrl the kernel made the file with the
    // directory, and append is ignored.
    let mut file = OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|source| write_error(root, path, "", source))?;
    for &tid in tids {
        match file.write_all(format!("{tid}\n").as_bytes()) {
            Ok(()) => done.moved.push(tid),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => done.gone.push(tid),
            Err(e) if kind == GroupKind::Monitor && e.raw_os_error() == Some(libc::EINVAL) => {
                done.elsewhere.push(tid)
            }
            Err(source) => return Err(write_error(root, path, &tid.to_string(), source)),
        }
    }
    Ok(done)
}

/// Writes `value` to the resctrl file at `path` in one write(2): resctrl parses each write as a
/// unit (a whole `schemata` line).
pub fn write_line(root: &Path, path: &Path, value: &str) -> Result<(), ResctrlfsError> {
    let mut file = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|source| write_error(root, path, value.trim_end(), source))?;
    file.write_all(value.as_bytes())
        .map_err(|source| write_error(root, path, value.trim_end(), source))
}

/// A failed write, with the kernel's reason from `info/last_cmd_status` when it says more than
/// "ok".
pub fn write_error(root: &Path, path: &Path, value: &str, source: io::Error) -> ResctrlfsError {
    let status = fs::read_to_string(root.join(LAST_CMD_STATUS))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty() && s != "ok")
        .map_or_else(String::new, |s| format!(" (resctrl says: {s})"));
    ResctrlfsError::Write {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
        status,
    }
}

/// Removes the group at `path` (its tasks go back to the parent group; a control group takes its
/// monitoring groups with it). `Ok(false)` when it was already gone.
pub fn remove_group(path: &Path) -> Result<bool, ResctrlfsError> {
    // rmdir, never a recursive delete: resctrl removes the files itself, and refuses unlink.
    match fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ResctrlfsError::Remove {
            path: path.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::ResctrlfsError as MembwError;
    use super::*;
    use crate::testutil::{
        copy_of as copy_tree_of, copy_tree, minimal_resctrl as minimal, resctrl_fixture as fixture,
        write,
    };

    fn copy_of(name: &str) -> tempfile::TempDir {
        copy_tree_of(&fixture(name))
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
    fn write_errors_include_last_cmd_status() {
        let tmp = copy_of("intel-mba-mbm");
        let root = tmp.path();
        fs::write(
            root.join(LAST_CMD_STATUS),
            "MB value 5 out of range [10,100]\n",
        )
        .expect("status");
        // What a refused schemata write reports: the kernel's reason from last_cmd_status.
        let err = write_error(
            root,
            &root.join("lodger-lodgers/schemata"),
            "MB:0=5",
            io::Error::from_raw_os_error(libc::EINVAL),
        );
        let text = err.to_string();
        assert!(
            text.contains("resctrl says: MB value 5 out of range"),
            "{text}"
        );
        assert!(text.contains("'MB:0=5'"), "{text}");
        fs::write(root.join(LAST_CMD_STATUS), "ok\n").expect("status");
        let err = write_error(root, root, "x", io::Error::from_raw_os_error(libc::EINVAL));
        assert!(!err.to_string().contains("resctrl says"), "{err}");
    }
}
