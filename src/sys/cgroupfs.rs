//! The cgroupfs vocabulary shared by sense and enforce: the cgroup version and its detection
//! (`detect`), kernel file names as constants, cgroup paths within a hierarchy (normalized,
//! parents, ancestors), the hand-written readers of cgroup files, and where the v1 `net_cls`
//! hierarchy is mounted. Touches cgroupfs (read, and `rmdir`) under the root it is given, and
//! /proc/PID/cgroup; writing cpusets is `enforce::cpusets`'.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cpuset::CpuSet;
use crate::sys::read_small;

/// Default mount point of the cgroup hierarchies.
pub const DEFAULT_CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// v1: the directory of the cpuset hierarchy under the cgroup root.
pub const V1_CPUSET_DIR: &str = "cpuset";
/// v1: the directory of the cpu hierarchy under the cgroup root (RT budgets).
pub const V1_CPU_DIR: &str = "cpu";
pub const CPUSET_CPUS: &str = "cpuset.cpus";
pub const CPUSET_MEMS: &str = "cpuset.mems";
/// v1 name of the effective CPUs.
pub const CPUSET_EFFECTIVE_CPUS_V1: &str = "cpuset.effective_cpus";
/// v2 name of the effective CPUs.
pub const CPUSET_CPUS_EFFECTIVE_V2: &str = "cpuset.cpus.effective";
/// v2 name of the effective memory nodes.
pub const CPUSET_MEMS_EFFECTIVE_V2: &str = "cpuset.mems.effective";
pub const CGROUP_PROCS: &str = "cgroup.procs";
/// v2: the controllers available to a cgroup (its parent enabled them).
pub const CGROUP_CONTROLLERS: &str = "cgroup.controllers";
/// v2: the controllers a cgroup enables for its children.
pub const CGROUP_SUBTREE_CONTROL: &str = "cgroup.subtree_control";
/// The controller name in `cgroup.controllers` and `/proc/PID/cgroup`.
pub const CPUSET_CONTROLLER: &str = "cpuset";
/// The memory controller's name, and v1's memory hierarchy directory under the cgroup root.
pub const MEMORY_CONTROLLER: &str = "memory";
/// v1 memory files: the limit, the line reclaim aims under under pressure, the OOM state.
pub const MEMORY_LIMIT_V1: &str = "memory.limit_in_bytes";
pub const MEMORY_SOFT_LIMIT_V1: &str = "memory.soft_limit_in_bytes";
pub const MEMORY_OOM_CONTROL_V1: &str = "memory.oom_control";
/// v2 memory files.
pub const MEMORY_MAX: &str = "memory.max";
pub const MEMORY_HIGH: &str = "memory.high";
pub const MEMORY_LOW: &str = "memory.low";
pub const MEMORY_EVENTS: &str = "memory.events";

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroup {path} no longer exists")]
    Gone { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write '{value}' to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    /// A saved value could not be written back: the file keeps the value lodger set.
    #[error("cannot restore {path} to {} (its value before lodger): {source}{also}; it keeps lodger's value", shown(.value))]
    Restore {
        path: PathBuf,
        value: String,
        source: io::Error,
        /// What else was tried, when something was.
        also: String,
    },
    #[error("cannot create cgroup {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot remove cgroup {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
    #[error("{path}: unexpected content '{content}'")]
    Parse { path: PathBuf, content: String },
    #[error("'{0}' is not a cgroup path (components '.' and '..' are refused)")]
    BadPath(String),
    #[error(
        "no cpuset hierarchy under {root}: neither {v2} (cgroup v2) nor {v1} (cgroup v1) exists"
    )]
    NoHierarchy {
        root: PathBuf,
        v2: PathBuf,
        v1: PathBuf,
    },
    #[error(
        "the cpuset controller is not available in the cgroup v2 hierarchy at {root}: it is not \
         listed in {file} (is it bound to a v1 hierarchy?)"
    )]
    CpusetUnavailable { root: PathBuf, file: PathBuf },
    #[error(
        "the cpuset controller is not enabled for cgroup {cgroup}: write '+cpuset' to {file} \
         (and to each cgroup.subtree_control below it down to the cgroup's parent); lodger only \
         enables controllers inside its own cgroup"
    )]
    CpusetNotEnabled { cgroup: PathBuf, file: PathBuf },
}

/// A cpuset value as a message shows it: an empty one is named for what it means.
fn shown(value: &str) -> String {
    if value.is_empty() {
        "empty (inherit the parent's)".to_string()
    } else {
        format!("'{value}'")
    }
}

impl CgroupError {
    /// True when the cgroup (or the process being moved) no longer exists.
    pub fn is_gone(&self) -> bool {
        matches!(self, CgroupError::Gone { .. })
    }
}

/// Which cgroup version serves the cpuset controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    V1,
    V2,
}

impl CgroupVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

impl fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which cgroup version to use: found from the hierarchy (`Auto`) or forced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    #[default]
    Auto,
    V1,
    V2,
}

/// Finds the cgroup version from the files under `cgroup_root`: v2 has `cgroup.controllers` at its
/// root, v1 has `cpuset/cpuset.cpus`. A forced driver is checked the same way.
pub fn detect(cgroup_root: &Path, driver: CgroupDriver) -> Result<CgroupVersion, CgroupError> {
    let v2_marker = cgroup_root.join(CGROUP_CONTROLLERS);
    let v1_marker = cgroup_root.join(V1_CPUSET_DIR).join(CPUSET_CPUS);
    let no_hierarchy = || CgroupError::NoHierarchy {
        root: cgroup_root.to_path_buf(),
        v2: v2_marker.clone(),
        v1: v1_marker.clone(),
    };
    let version = match driver {
        CgroupDriver::Auto if v2_marker.is_file() => CgroupVersion::V2,
        CgroupDriver::Auto if v1_marker.is_file() => CgroupVersion::V1,
        CgroupDriver::V2 if v2_marker.is_file() => CgroupVersion::V2,
        CgroupDriver::V1 if v1_marker.is_file() => CgroupVersion::V1,
        _ => return Err(no_hierarchy()),
    };
    if version == CgroupVersion::V2 {
        let available = read_words(&v2_marker)?;
        if !available.iter().any(|c| c == CPUSET_CONTROLLER) {
            return Err(CgroupError::CpusetUnavailable {
                root: cgroup_root.to_path_buf(),
                file: v2_marker,
            });
        }
    }
    Ok(version)
}

// ---------------------------------------------------------------------------------------------
// Cgroup paths

/// Normalizes a cgroup path within a hierarchy to `/a/b` form (`/` is the root), refusing `.`,
/// `..` and NUL so a path can never leave the hierarchy.
pub fn normalize(cgroup: &str) -> Result<String, CgroupError> {
    let mut out = String::with_capacity(cgroup.len() + 1);
    for comp in cgroup.split('/') {
        if comp.is_empty() {
            continue;
        }
        if comp == "." || comp == ".." || comp.contains('\0') {
            return Err(CgroupError::BadPath(cgroup.to_string()));
        }
        out.push('/');
        out.push_str(comp);
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// The parent of a normalized cgroup path; `None` for the root.
pub fn parent_of(cgroup: &str) -> Option<&str> {
    if cgroup == "/" {
        return None;
    }
    match cgroup.rfind('/') {
        Some(0) => Some("/"),
        Some(i) => Some(&cgroup[..i]),
        None => Some("/"),
    }
}

/// `parent/name` for a normalized parent.
pub fn child_of(parent: &str, name: &str) -> String {
    if parent == "/" {
        format!("/{name}")
    } else {
        format!("{parent}/{name}")
    }
}

/// Number of components: the root is 0, `/a/b` is 2.
pub fn depth(cgroup: &str) -> usize {
    if cgroup == "/" {
        0
    } else {
        cgroup.matches('/').count()
    }
}

/// True when `cgroup` is `top` or below it.
pub fn is_within(cgroup: &str, top: &str) -> bool {
    top == "/"
        || cgroup == top
        || (cgroup.starts_with(top) && cgroup.as_bytes().get(top.len()) == Some(&b'/'))
}

/// The proper ancestors of a normalized path, from the root down.
pub fn ancestors(cgroup: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut cur = cgroup;
    while let Some(p) = parent_of(cur) {
        out.push(p);
        cur = p;
    }
    out.reverse();
    out
}

/// The directory of `cgroup` (normalized) in the hierarchy whose root directory is `root`.
pub fn dir_of(root: &Path, cgroup: &str) -> PathBuf {
    let rel = cgroup.trim_start_matches('/');
    if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    }
}

// ---------------------------------------------------------------------------------------------
// Reading cgroup files (hand-written: cgroups-rs readers turn read errors into defaults, so a
// vanished cgroup would look like an empty one)

/// `err`, or [`CgroupError::Gone`] when the cgroup directory `dir` no longer exists.
pub fn gone_or(dir: &Path, err: CgroupError) -> CgroupError {
    if dir.is_dir() {
        err
    } else {
        CgroupError::Gone {
            path: dir.to_path_buf(),
        }
    }
}

/// Reads a cgroup file; a missing file in a missing directory is `Gone`.
///
/// Hand-written: cgroups-rs readers turn errors into defaults.
pub fn read_file(dir: &Path, name: &str) -> Result<String, CgroupError> {
    let path = dir.join(name);
    // `read_small`, not `fs::read_to_string`: a cgroup file has no size to ask for first.
    let mut buf = Vec::new();
    let read = read_small(&path, &mut buf).and_then(|()| {
        String::from_utf8(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    });
    read.map_err(|source| {
        let missing = source.kind() == io::ErrorKind::NotFound;
        let err = CgroupError::Read { path, source };
        if missing {
            gone_or(dir, err)
        } else {
            err
        }
    })
}

/// The whitespace-separated words of a file (`cgroup.controllers`, `cgroup.subtree_control`).
pub fn read_words(path: &Path) -> Result<Vec<String>, CgroupError> {
    let text = fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text.split_whitespace().map(str::to_string).collect())
}

/// Whether the controller file `path` (`cgroup.controllers`, `cgroup.subtree_control`) lists
/// `controller`; false when it cannot be read.
pub fn lists_controller(path: &Path, controller: &str) -> bool {
    read_words(path).is_ok_and(|words| words.iter().any(|w| w == controller))
}

/// v2: enables `controller` for the children of the cgroup directory `dir` unless it is already.
pub fn enable_for_children(dir: &Path, controller: &str) -> Result<(), CgroupError> {
    let path = dir.join(CGROUP_SUBTREE_CONTROL);
    if lists_controller(&path, controller) {
        return Ok(());
    }
    let value = format!("+{controller}");
    fs::write(&path, &value).map_err(|source| CgroupError::Write {
        path,
        value,
        source,
    })
}

/// Writes `value` to the file `name` of the cgroup directory `dir`.
pub fn write_value(dir: &Path, name: &str, value: impl fmt::Display) -> Result<(), CgroupError> {
    let path = dir.join(name);
    let value = value.to_string();
    fs::write(&path, &value).map_err(|source| CgroupError::Write {
        path,
        value,
        source,
    })
}

/// v1: the memory hierarchy under `cgroup_root`, where it is mounted there.
pub fn v1_memory_hierarchy(cgroup_root: &Path) -> Option<PathBuf> {
    let root = cgroup_root.join(MEMORY_CONTROLLER);
    root.join(MEMORY_LIMIT_V1).is_file().then_some(root)
}

/// v1: creates the memory cgroups of `chain` (each the parent of the next, paths from `root`,
/// the v1 memory hierarchy) that are missing, and gives the last its limit and soft limit.
/// Returns the last one's directory.
pub fn v1_limited_memory_cgroup(
    root: &Path,
    chain: &[&str],
    limit: u64,
    soft_limit: u64,
) -> Result<PathBuf, CgroupError> {
    let mut dir = root.to_path_buf();
    for cgroup in chain {
        dir = dir_of(root, cgroup);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(CgroupError::Create { path: dir, source }),
        }
    }
    write_value(&dir, MEMORY_LIMIT_V1, limit)?;
    write_value(&dir, MEMORY_SOFT_LIMIT_V1, soft_limit)?;
    Ok(dir)
}

/// Reads a cpulist file (`cpuset.cpus`, `cpuset.mems`, ...) of the cgroup directory `dir`.
pub fn read_cpulist(dir: &Path, name: &str) -> Result<CpuSet, CgroupError> {
    let text = read_file(dir, name)?;
    CpuSet::parse(&text).map_err(|_| CgroupError::Parse {
        path: dir.join(name),
        content: text.trim().to_string(),
    })
}

/// Appends the pids in `dir`'s `cgroup.procs` to `out`.
pub fn read_procs(dir: &Path, out: &mut Vec<u32>) -> Result<(), CgroupError> {
    // Hand-written: cgroups-rs `procs()` returns an empty list when the file cannot be read,
    // which would make a vanished cgroup look like an empty one.
    let text = read_file(dir, CGROUP_PROCS)?;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let pid = line.parse::<u32>().map_err(|_| CgroupError::Parse {
            path: dir.join(CGROUP_PROCS),
            content: line.to_string(),
        })?;
        out.push(pid);
    }
    Ok(())
}

/// Appends the child cgroups of `cgroup` (whose directory is `dir`) to `out`.
pub fn list_children(dir: &Path, cgroup: &str, out: &mut Vec<String>) -> Result<(), CgroupError> {
    let entries = fs::read_dir(dir).map_err(|source| {
        let missing = source.kind() == io::ErrorKind::NotFound;
        let err = CgroupError::Read {
            path: dir.to_path_buf(),
            source,
        };
        if missing {
            gone_or(dir, err)
        } else {
            err
        }
    })?;
    for entry in entries {
        // A child removed while listing is simply not listed.
        let Ok(entry) = entry else { continue };
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if !is_dir {
            continue;
        }
        if let Some(name) = entry.file_name().to_str() {
            out.push(child_of(cgroup, name));
        }
    }
    Ok(())
}

/// rmdir, treating "still in use" as `Ok(false)`.
///
/// Hand-written: cgroups-rs `delete` also removes child cgroups (another job's, for lodger's shared
/// parent) and sleeps between retries.
pub fn rmdir_if_unused(dir: &Path) -> Result<bool, CgroupError> {
    match fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EBUSY) | Some(libc::ENOTEMPTY) | Some(libc::EEXIST)
            ) =>
        {
            Ok(false)
        }
        Err(source) => Err(CgroupError::Remove {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Reads `/proc/PID/cgroup` (procfs crate) and picks the line `pick` selects.
pub fn proc_cgroup(
    proc_root: &Path,
    pid: u32,
    pick: impl Fn(&procfs::ProcessCGroup) -> bool,
) -> Result<Option<String>, CgroupError> {
    use procfs::FromRead;
    let path = proc_root.join(pid.to_string()).join("cgroup");
    match procfs::ProcessCGroups::from_file(&path) {
        Ok(groups) => Ok(groups
            .0
            .iter()
            .find(|g| pick(g))
            .map(|g| g.pathname.clone())),
        Err(procfs::ProcError::NotFound(_)) => Ok(None),
        Err(procfs::ProcError::Io(e, _)) if e.raw_os_error() == Some(libc::ESRCH) => Ok(None),
        Err(e) => Err(CgroupError::Read {
            path,
            source: io::Error::other(e.to_string()),
        }),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_normalize_and_refuse_escapes() {
        assert_eq!(normalize("").expect("valid path"), "/");
        assert_eq!(normalize("/").expect("valid path"), "/");
        assert_eq!(normalize("a/b/").expect("valid path"), "/a/b");
        assert_eq!(normalize("//a//b").expect("valid path"), "/a/b");
        for bad in ["/a/../b", "..", "/./a", "a\0b"] {
            assert!(
                matches!(normalize(bad), Err(CgroupError::BadPath(_))),
                "{bad}"
            );
        }
        assert_eq!(parent_of("/a/b"), Some("/a"));
        assert_eq!(parent_of("/a"), Some("/"));
        assert_eq!(parent_of("/"), None);
        assert_eq!(ancestors("/a/b/c"), vec!["/", "/a", "/a/b"]);
        assert_eq!(depth("/"), 0);
        assert_eq!(depth("/a/b"), 2);
        assert!(is_within("/lodger/j1", "/lodger"));
        assert!(is_within("/lodger", "/lodger"));
        assert!(!is_within("/lodgers", "/lodger"));
        assert!(is_within("/x", "/"));
        assert_eq!(child_of("/", "a"), "/a");
        assert_eq!(child_of("/a", "b"), "/a/b");
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
}
