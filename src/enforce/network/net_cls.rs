//! cgroup v1 `net_cls` groups: where CPU jobs' processes go so their sockets carry the CPU-jobs
//! class id, and the one way lodger dissolves a cgroup it made (processes back, then rmdir).
//! Touches the `net_cls` hierarchy it is given.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::{TcError, NET_CLS_CLASSID};
use crate::sys::cgroupfs::CGROUP_PROCS;

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

/// Dissolves lodger's CPU-jobs group `<hierarchy>/<relative>` (its processes back to the
/// hierarchy's root) and its parent, lodger's, when that is left empty. `Ok(false)` when the
/// group was not there.
pub fn remove_group(hierarchy: &Path, relative: &str) -> Result<bool, TcError> {
    let removed = match NetClsGroup::open(hierarchy, relative) {
        Some(group) => group.remove()?,
        None => false,
    };
    if let Some(parent) = Path::new(relative).parent() {
        if !parent.as_os_str().is_empty() {
            // Only when empty: rmdir refuses a cgroup with children.
            let _ = fs::remove_dir(hierarchy.join(parent));
        }
    }
    Ok(removed)
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
