//! The cpuset hierarchy as lodger writes it, shared by training jobs and inference instances:
//! cgroup v1 and v2 behind one trait ([`CpusetHierarchy`], backends [`V1Cpuset`] and [`V2Cpuset`])
//! and the v1 rule that a child's cpuset is a subset of its parent's ([`nested_write_order`]).
//! Touches cgroupfs under the root it is given, nothing else; the vocabulary (version, paths, file
//! names, readers) is `sys::cgroupfs`.
//!
//! Writes go through cgroups-rs (`CpuSetController::set_cpus`/`set_mems`, `Controller::create`,
//! `add_task_by_tgid`, `delete`). Its controllers take any directory, so the same backends serve the
//! real hierarchy and the fixture trees of the tests; its `Cgroup`/`Hierarchy` types are not used
//! because they find the hierarchy from the fixed mount point `/sys/fs/cgroup`.
//! Written by hand, each with the reason at the spot: reads (the crate turns read errors into
//! defaults, so a vanished cgroup would look like an empty one), v2 `cpuset.cpus.effective` (the
//! crate reads the v1 name: upstream issue #156), `cgroup.subtree_control` (the crate's v2 creation
//! enables controllers all the way up from the root) and the removal of lodger's shared parent.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cgroups_rs::fs::cpuset::CpuSetController;
use cgroups_rs::fs::Controller;
use cgroups_rs::CgroupPid;

use crate::cpuset::CpuSet;
use crate::sys::cgroupfs::{
    ancestors, depth, dir_of, gone_or, is_within, list_children, parent_of, proc_cgroup,
    read_cpulist, read_procs, read_words, rmdir_if_unused, CgroupError, CgroupVersion,
    CGROUP_CONTROLLERS, CGROUP_PROCS, CGROUP_SUBTREE_CONTROL, CPUSET_CONTROLLER, CPUSET_CPUS,
    CPUSET_CPUS_EFFECTIVE_V2, CPUSET_EFFECTIVE_CPUS_V1, CPUSET_MEMS, CPUSET_MEMS_EFFECTIVE_V2,
    V1_CPUSET_DIR,
};

/// The two cpuset files lodger writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpusetFile {
    Cpus,
    Mems,
}

impl CpusetFile {
    pub fn name(self) -> &'static str {
        match self {
            CpusetFile::Cpus => CPUSET_CPUS,
            CpusetFile::Mems => CPUSET_MEMS,
        }
    }
}

/// Opens the cpuset hierarchy of the given version under `cgroup_root`.
pub fn open(cgroup_root: &Path, version: CgroupVersion) -> Box<dyn CpusetHierarchy> {
    match version {
        CgroupVersion::V1 => Box::new(V1Cpuset::new(cgroup_root.join(V1_CPUSET_DIR))),
        CgroupVersion::V2 => Box::new(V2Cpuset::new(cgroup_root.to_path_buf())),
    }
}

// ---------------------------------------------------------------------------------------------
// The trait

/// The cpuset hierarchy of one cgroup version. Cgroup paths are normalized (see [`normalize`](crate::sys::cgroupfs::normalize)),
/// relative to the hierarchy root.
pub trait CpusetHierarchy: Send + Sync + fmt::Debug {
    fn version(&self) -> CgroupVersion;
    /// The directory of the root cgroup.
    fn root(&self) -> &Path;
    /// v1 only: a cpuset must always be a subset of its parent's.
    fn nested_subsets(&self) -> bool;

    fn dir(&self, cgroup: &str) -> PathBuf {
        dir_of(self.root(), cgroup)
    }
    fn exists(&self, cgroup: &str) -> bool {
        self.dir(cgroup).is_dir()
    }
    /// The configured `cpuset.cpus` or `cpuset.mems` (empty in v2 means "inherit").
    fn read(&self, cgroup: &str, file: CpusetFile) -> Result<CpuSet, CgroupError>;
    fn write(&self, cgroup: &str, file: CpusetFile, value: &CpuSet) -> Result<(), CgroupError>;
    /// The CPUs the cgroup's tasks may actually use.
    fn effective_cpus(&self, cgroup: &str) -> Result<CpuSet, CgroupError>;
    /// The cgroup's processes (`cgroup.procs`), appended to `out`.
    fn procs(&self, cgroup: &str, out: &mut Vec<u32>) -> Result<(), CgroupError>;
    /// The cgroup's direct children, appended to `out`.
    fn children(&self, cgroup: &str, out: &mut Vec<String>) -> Result<(), CgroupError>;
    /// Creates a cgroup whose parent exists. v1: it starts with its parent's cpus and mems.
    fn create(&self, cgroup: &str) -> Result<(), CgroupError>;
    /// Creates `cgroup` with no values of its own: on v1 its cpus and mems stay empty, and it
    /// takes no task, until both are written; on v2 the same as [`create`](Self::create).
    fn create_empty(&self, cgroup: &str) -> Result<(), CgroupError>;
    /// Removes an empty cgroup lodger created.
    fn remove(&self, cgroup: &str) -> Result<(), CgroupError>;
    /// Removes the cgroup if it has neither processes nor children; `Ok(false)` if it is in use.
    fn remove_if_unused(&self, cgroup: &str) -> Result<bool, CgroupError>;
    /// Moves a process (all its threads) into the cgroup.
    fn attach(&self, cgroup: &str, pid: u32) -> Result<(), CgroupError>;
    /// v2: whether the cgroup has cpuset files (its parent enabled the controller). v1: true.
    fn cpuset_enabled(&self, cgroup: &str) -> Result<bool, CgroupError>;
    /// v2: enables `+cpuset` in the `cgroup.subtree_control` of the ancestors that lack it, top
    /// down, provided each of them is within `delegated`; otherwise fails naming the first file to
    /// write. Returns whether anything was written. v1: nothing to do.
    fn enable_cpuset(&self, cgroup: &str, delegated: &str) -> Result<bool, CgroupError>;
    /// The line of `/proc/PID/cgroup` for this hierarchy, or `None` if the process is gone.
    fn cgroup_of(&self, proc_root: &Path, pid: u32) -> Result<Option<String>, CgroupError>;
}

// ---------------------------------------------------------------------------------------------
// Shared file helpers

fn clone_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// The `io::Error` inside a cgroups-rs error, so callers can see the errno.
fn io_cause(err: &cgroups_rs::fs::error::Error) -> io::Error {
    use std::error::Error as _;
    err.source()
        .and_then(|s| s.downcast_ref::<io::Error>())
        .map(clone_io)
        .unwrap_or_else(|| io::Error::other(err.to_string()))
}

fn write_cpuset_file(
    version: CgroupVersion,
    root: &Path,
    dir: &Path,
    file: CpusetFile,
    value: &CpuSet,
) -> Result<(), CgroupError> {
    let ctl = CpuSetController::new(
        dir.to_path_buf(),
        root.to_path_buf(),
        version == CgroupVersion::V2,
    );
    // An empty set is written as a newline, which the kernel strips: the empty value (v2: "inherit
    // the parent's"). Not as nothing: cgroups-rs writes with `write_all`, which makes no system
    // call for an empty buffer, and a zero-length write(2) returns 0 without reaching cpuset
    // either (seen on Linux 6.1), so the file would silently keep lodger's value.
    let mut text = value.to_string();
    if text.is_empty() {
        text.push('\n');
    }
    let result = match file {
        CpusetFile::Cpus => ctl.set_cpus(&text),
        CpusetFile::Mems => ctl.set_mems(&text),
    };
    result.map_err(|e| {
        gone_or(
            dir,
            CgroupError::Write {
                path: dir.join(file.name()),
                value: value.to_string(),
                source: io_cause(&e),
            },
        )
    })
}

fn create_with(ctl: &CpuSetController, dir: &Path) -> Result<(), CgroupError> {
    ctl.create().map_err(|e| CgroupError::Create {
        path: dir.to_path_buf(),
        source: io_cause(&e),
    })
}

fn remove_with(ctl: &CpuSetController, dir: &Path) -> Result<(), CgroupError> {
    ctl.delete().map_err(|e| CgroupError::Remove {
        path: dir.to_path_buf(),
        source: io_cause(&e),
    })
}

fn attach_with(ctl: &CpuSetController, dir: &Path, pid: u32) -> Result<(), CgroupError> {
    ctl.add_task_by_tgid(&CgroupPid::from(u64::from(pid)))
        .map_err(|e| {
            let source = io_cause(&e);
            if source.raw_os_error() == Some(libc::ESRCH) {
                // The process exited: nothing to move.
                return CgroupError::Gone {
                    path: PathBuf::from(format!("/proc/{pid}")),
                };
            }
            gone_or(
                dir,
                CgroupError::Write {
                    path: dir.join(CGROUP_PROCS),
                    value: pid.to_string(),
                    source,
                },
            )
        })
}

// ---------------------------------------------------------------------------------------------
// v1

/// The v1 cpuset hierarchy (e.g. `/sys/fs/cgroup/cpuset`).
#[derive(Debug, Clone)]
pub struct V1Cpuset {
    root: PathBuf,
}

impl V1Cpuset {
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }

    fn controller(&self, dir: &Path) -> CpuSetController {
        CpuSetController::new(dir.to_path_buf(), self.root.clone(), false)
    }
}

impl CpusetHierarchy for V1Cpuset {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V1
    }
    fn root(&self) -> &Path {
        &self.root
    }
    fn nested_subsets(&self) -> bool {
        true
    }
    fn read(&self, cgroup: &str, file: CpusetFile) -> Result<CpuSet, CgroupError> {
        read_cpulist(&self.dir(cgroup), file.name())
    }
    fn write(&self, cgroup: &str, file: CpusetFile, value: &CpuSet) -> Result<(), CgroupError> {
        write_cpuset_file(
            CgroupVersion::V1,
            &self.root,
            &self.dir(cgroup),
            file,
            value,
        )
    }
    fn effective_cpus(&self, cgroup: &str) -> Result<CpuSet, CgroupError> {
        read_cpulist(&self.dir(cgroup), CPUSET_EFFECTIVE_CPUS_V1)
    }
    fn procs(&self, cgroup: &str, out: &mut Vec<u32>) -> Result<(), CgroupError> {
        read_procs(&self.dir(cgroup), out)
    }
    fn children(&self, cgroup: &str, out: &mut Vec<String>) -> Result<(), CgroupError> {
        list_children(&self.dir(cgroup), cgroup, out)
    }
    fn create(&self, cgroup: &str) -> Result<(), CgroupError> {
        // cgroups-rs copies the parent's cpus and mems into a new v1 cpuset, so it can take tasks.
        let dir = self.dir(cgroup);
        create_with(&self.controller(&dir), &dir)
    }
    fn create_empty(&self, cgroup: &str) -> Result<(), CgroupError> {
        // A plain mkdir: the kernel leaves a new v1 cpuset's cpus and mems empty.
        let dir = self.dir(cgroup);
        fs::create_dir(&dir).map_err(|source| CgroupError::Create { path: dir, source })
    }
    fn remove(&self, cgroup: &str) -> Result<(), CgroupError> {
        let dir = self.dir(cgroup);
        remove_with(&self.controller(&dir), &dir)
    }
    fn remove_if_unused(&self, cgroup: &str) -> Result<bool, CgroupError> {
        rmdir_if_unused(&self.dir(cgroup))
    }
    fn attach(&self, cgroup: &str, pid: u32) -> Result<(), CgroupError> {
        let dir = self.dir(cgroup);
        attach_with(&self.controller(&dir), &dir, pid)
    }
    fn cpuset_enabled(&self, cgroup: &str) -> Result<bool, CgroupError> {
        let dir = self.dir(cgroup);
        if dir.is_dir() {
            Ok(true)
        } else {
            Err(CgroupError::Gone { path: dir })
        }
    }
    fn enable_cpuset(&self, _cgroup: &str, _delegated: &str) -> Result<bool, CgroupError> {
        Ok(false)
    }
    fn cgroup_of(&self, proc_root: &Path, pid: u32) -> Result<Option<String>, CgroupError> {
        proc_cgroup(proc_root, pid, |g| {
            g.hierarchy != 0 && g.controllers.iter().any(|c| c == CPUSET_CONTROLLER)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// v2

/// The unified (v2) hierarchy (e.g. `/sys/fs/cgroup`).
#[derive(Debug, Clone)]
pub struct V2Cpuset {
    root: PathBuf,
}

impl V2Cpuset {
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }

    fn controller(&self, dir: &Path) -> CpuSetController {
        CpuSetController::new(dir.to_path_buf(), self.root.clone(), true)
    }
}

impl CpusetHierarchy for V2Cpuset {
    fn version(&self) -> CgroupVersion {
        CgroupVersion::V2
    }
    fn root(&self) -> &Path {
        &self.root
    }
    fn nested_subsets(&self) -> bool {
        false
    }
    fn read(&self, cgroup: &str, file: CpusetFile) -> Result<CpuSet, CgroupError> {
        read_cpulist(&self.dir(cgroup), file.name())
    }
    fn write(&self, cgroup: &str, file: CpusetFile, value: &CpuSet) -> Result<(), CgroupError> {
        let dir = self.dir(cgroup);
        // cgroups-rs opens with O_CREAT: on a fixture tree it would invent the file of a controller
        // that is not enabled. Refuse instead, as the kernel would.
        if !dir.join(file.name()).exists() {
            return Err(gone_or(
                &dir,
                CgroupError::CpusetNotEnabled {
                    cgroup: dir.clone(),
                    file: dir_of(&self.root, parent_of(cgroup).unwrap_or("/"))
                        .join(CGROUP_SUBTREE_CONTROL),
                },
            ));
        }
        write_cpuset_file(CgroupVersion::V2, &self.root, &dir, file, value)
    }
    fn effective_cpus(&self, cgroup: &str) -> Result<CpuSet, CgroupError> {
        // Hand-written: cgroups-rs reads the v1 name `cpuset.effective_cpus` on v2 too (issue #156).
        read_cpulist(&self.dir(cgroup), CPUSET_CPUS_EFFECTIVE_V2)
    }
    fn procs(&self, cgroup: &str, out: &mut Vec<u32>) -> Result<(), CgroupError> {
        read_procs(&self.dir(cgroup), out)
    }
    fn children(&self, cgroup: &str, out: &mut Vec<String>) -> Result<(), CgroupError> {
        list_children(&self.dir(cgroup), cgroup, out)
    }
    fn create(&self, cgroup: &str) -> Result<(), CgroupError> {
        // Through the controller, not `Cgroup::create`: the latter writes subtree_control in every
        // ancestor up from the root, which is not lodger's to change under systemd.
        let dir = self.dir(cgroup);
        create_with(&self.controller(&dir), &dir)
    }
    fn create_empty(&self, cgroup: &str) -> Result<(), CgroupError> {
        self.create(cgroup)
    }
    fn remove(&self, cgroup: &str) -> Result<(), CgroupError> {
        let dir = self.dir(cgroup);
        remove_with(&self.controller(&dir), &dir)
    }
    fn remove_if_unused(&self, cgroup: &str) -> Result<bool, CgroupError> {
        rmdir_if_unused(&self.dir(cgroup))
    }
    fn attach(&self, cgroup: &str, pid: u32) -> Result<(), CgroupError> {
        let dir = self.dir(cgroup);
        attach_with(&self.controller(&dir), &dir, pid)
    }
    fn cpuset_enabled(&self, cgroup: &str) -> Result<bool, CgroupError> {
        let dir = self.dir(cgroup);
        if !dir.is_dir() {
            return Err(CgroupError::Gone { path: dir });
        }
        Ok(dir.join(CPUSET_CPUS).is_file())
    }
    fn enable_cpuset(&self, cgroup: &str, delegated: &str) -> Result<bool, CgroupError> {
        // Hand-written: cgroups-rs enables controllers from the root down; lodger may only write
        // inside the subtree delegated to it.
        let mut wrote = false;
        let mut missing = false;
        for ancestor in ancestors(cgroup) {
            let dir = self.dir(ancestor);
            let subtree = dir.join(CGROUP_SUBTREE_CONTROL);
            if !missing {
                let enabled = read_words(&subtree)?;
                if enabled.iter().any(|c| c == CPUSET_CONTROLLER) {
                    continue;
                }
                missing = true;
            }
            if !is_within(ancestor, delegated) {
                return Err(CgroupError::CpusetNotEnabled {
                    cgroup: self.dir(cgroup),
                    file: subtree,
                });
            }
            let available = read_words(&dir.join(CGROUP_CONTROLLERS))?;
            if !available.iter().any(|c| c == CPUSET_CONTROLLER) {
                return Err(CgroupError::CpusetNotEnabled {
                    cgroup: self.dir(cgroup),
                    file: dir_of(&self.root, parent_of(ancestor).unwrap_or("/"))
                        .join(CGROUP_SUBTREE_CONTROL),
                });
            }
            fs::write(&subtree, "+cpuset").map_err(|source| CgroupError::Write {
                path: subtree.clone(),
                value: "+cpuset".to_string(),
                source,
            })?;
            wrote = true;
        }
        Ok(wrote)
    }
    fn cgroup_of(&self, proc_root: &Path, pid: u32) -> Result<Option<String>, CgroupError> {
        proc_cgroup(proc_root, pid, |g| {
            g.hierarchy == 0 && g.controllers.is_empty()
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Writing several nested cpusets

/// One cgroup's value before and after, for [`nested_write_order`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NestedChange {
    pub cgroup: String,
    pub current: CpuSet,
    pub target: CpuSet,
}

/// The writes that take every cgroup in `changes` from `current` to `target` without ever breaking
/// the v1 rule "a cpuset is a subset of its parent's": grow top-down to `current ∪ target`, then
/// shrink bottom-up to `target`. `changes` must hold every cgroup whose value has to move for the
/// targets to nest (the ancestors that must grow, the descendants that must shrink).
pub fn nested_write_order(changes: &[NestedChange]) -> Vec<(String, CpuSet)> {
    let mut order: Vec<usize> = (0..changes.len()).collect();
    order.sort_by_key(|&i| depth(&changes[i].cgroup));
    let mut now: Vec<CpuSet> = changes.iter().map(|c| c.current.clone()).collect();
    let mut writes = Vec::new();
    for &i in &order {
        let c = &changes[i];
        if !c.target.is_subset(&now[i]) {
            now[i] = now[i].union(&c.target);
            writes.push((c.cgroup.clone(), now[i].clone()));
        }
    }
    for &i in order.iter().rev() {
        let c = &changes[i];
        if now[i] != c.target {
            now[i] = c.target.clone();
            writes.push((c.cgroup.clone(), c.target.clone()));
        }
    }
    writes
}

/// The writes that set `cgroup` to `cpus` (and `mems`, unless empty) and, where the hierarchy
/// nests subsets (v1), grow each of `ancestors` to hold them: ancestors are never shrunk, other
/// cgroups live in them. In the order [`write_nested`] takes; empty when `cgroup` already holds
/// those values. `known`: `cgroup`'s cpus and mems when the caller knows them (both empty in a
/// cgroup it just made with [`CpusetHierarchy::create_empty`]); read otherwise.
pub fn set_with_ancestors(
    h: &dyn CpusetHierarchy,
    cgroup: &str,
    cpus: &CpuSet,
    mems: &CpuSet,
    ancestors: &[&str],
    known: Option<(CpuSet, CpuSet)>,
) -> Result<Vec<CpusetTarget>, CgroupError> {
    let (cur_cpus, cur_mems) = match known {
        Some(values) => values,
        None => (
            h.read(cgroup, CpusetFile::Cpus)?,
            h.read(cgroup, CpusetFile::Mems)?,
        ),
    };
    let want_mems = (!mems.is_empty()).then(|| mems.clone());
    if cur_cpus == *cpus && want_mems.as_ref().map_or(true, |m| *m == cur_mems) {
        return Ok(Vec::new());
    }
    let mut entries = vec![CpusetTarget {
        cgroup: cgroup.to_string(),
        current_cpus: cur_cpus,
        current_mems: cur_mems,
        cpus: Some(cpus.clone()),
        mems: want_mems.clone(),
    }];
    if h.nested_subsets() {
        for a in ancestors {
            let a_cpus = h.read(a, CpusetFile::Cpus)?;
            let a_mems = h.read(a, CpusetFile::Mems)?;
            let grow_mems = want_mems.as_ref().filter(|m| !m.is_subset(&a_mems));
            if !cpus.is_subset(&a_cpus) || grow_mems.is_some() {
                entries.push(CpusetTarget {
                    cgroup: a.to_string(),
                    cpus: Some(a_cpus.union(cpus)),
                    mems: grow_mems.map(|m| a_mems.union(m)),
                    current_cpus: a_cpus,
                    current_mems: a_mems,
                });
            }
        }
    }
    Ok(entries)
}

/// Takes each cgroup from its current values to its targets (`None` = leave) in an order the
/// hierarchy accepts: mems first, then cpus; on v1 nested by [`nested_write_order`]. The current
/// values must have been read just before. Returns whether anything was written.
pub fn write_nested(
    h: &dyn CpusetHierarchy,
    entries: &[CpusetTarget],
) -> Result<bool, CgroupError> {
    let mut wrote = false;
    for file in [CpusetFile::Mems, CpusetFile::Cpus] {
        for (cgroup, value) in nested_writes(h, entries, file) {
            h.write(&cgroup, file, &value)?;
            wrote = true;
        }
    }
    Ok(wrote)
}

/// What [`restore_nested`] did.
#[derive(Debug, Default)]
pub struct Restore {
    /// Whether anything was written.
    pub wrote: bool,
    /// Empty ("inherit") values the kernel refused, and what was written instead.
    pub substituted: Vec<Substitution>,
    /// Writes that failed ([`CgroupError::Restore`] for a refused value): those files keep
    /// lodger's value. Every other write was still made.
    pub errors: Vec<CgroupError>,
}

/// An empty cpuset value the kernel would not take back, and the value written in its place.
#[derive(Debug)]
pub struct Substitution {
    pub path: PathBuf,
    pub written: CpuSet,
    /// `written` is every CPU or node of the node, so the cgroup still follows its parent
    /// (v2 intersects a cgroup's value with its parent's); otherwise it is the parent's effective
    /// value at the time, which a parent that grows later leaves behind.
    pub follows_parent: bool,
    /// Why the empty value was refused.
    pub refused: io::Error,
}

impl fmt::Display for Substitution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} was empty (inherit the parent's) before lodger, but the kernel refused to empty it \
             ({}: before Linux 7.0 it refuses while the cgroup has tasks), so it now holds {}",
            self.path.display(),
            self.refused,
            self.written
        )?;
        if self.follows_parent {
            f.write_str(
                ", the whole node's: intersected with its parent's, it still follows its parent",
            )?;
        } else {
            f.write_str(", its parent's effective value now: it will not grow with its parent")?;
        }
        f.write_str("; write an empty line to it once it has no tasks to make it inherit again")
    }
}

/// Like [`write_nested`], for putting saved values back: every write is attempted even after
/// one fails, and the failures are returned together. On v2 an empty saved value means "inherit
/// the parent's", which kernels before Linux 7.0 refuse (ENOSPC) to write into a cgroup that has
/// tasks; then the node's effective value is written instead (v2 intersects it with the
/// parent's, so the cgroup goes on following its parent), or failing that the parent's effective
/// value, and [`Restore::substituted`] says so.
pub fn restore_nested(h: &dyn CpusetHierarchy, entries: &[CpusetTarget]) -> Restore {
    let mut done = Restore::default();
    for file in [CpusetFile::Mems, CpusetFile::Cpus] {
        for (cgroup, value) in nested_writes(h, entries, file) {
            let refused = match h.write(&cgroup, file, &value) {
                Ok(()) => {
                    done.wrote = true;
                    continue;
                }
                Err(e) => e,
            };
            let source = match refused {
                CgroupError::Write { source, .. } => source,
                other => {
                    done.errors.push(other);
                    continue;
                }
            };
            let path = h.dir(&cgroup).join(file.name());
            if !(value.is_empty() && h.version() == CgroupVersion::V2) {
                done.errors.push(CgroupError::Restore {
                    path,
                    value: value.to_string(),
                    source,
                    also: String::new(),
                });
                continue;
            }
            match write_inherited(h, &cgroup, file) {
                Ok((written, follows_parent)) => {
                    done.wrote = true;
                    done.substituted.push(Substitution {
                        path,
                        written,
                        follows_parent,
                        refused: source,
                    });
                }
                Err(e) => done.errors.push(CgroupError::Restore {
                    path,
                    value: String::new(),
                    source,
                    also: format!(", nor to what inheriting gives ({e})"),
                }),
            }
        }
    }
    done
}

/// v2: writes into `cgroup` what an empty ("inherit") value gives: the node's effective value
/// (all CPUs or nodes; intersected with the parent's, it follows the parent), else the parent's
/// effective value now (a sibling that is an exclusive partition may refuse the former). Returns
/// the value written and whether it was the node's.
fn write_inherited(
    h: &dyn CpusetHierarchy,
    cgroup: &str,
    file: CpusetFile,
) -> Result<(CpuSet, bool), CgroupError> {
    let effective = match file {
        CpusetFile::Cpus => CPUSET_CPUS_EFFECTIVE_V2,
        CpusetFile::Mems => CPUSET_MEMS_EFFECTIVE_V2,
    };
    let node = read_cpulist(h.root(), effective)?;
    let whole = h.write(cgroup, file, &node);
    if whole.is_ok() {
        return Ok((node, true));
    }
    let parent = read_cpulist(&h.dir(parent_of(cgroup).unwrap_or("/")), effective)?;
    if parent == node || parent.is_empty() {
        return whole.map(|()| (node, true));
    }
    h.write(cgroup, file, &parent)?;
    Ok((parent, false))
}

/// The writes that take `entries` from their current `file` values to their targets, in an
/// order the hierarchy accepts.
fn nested_writes(
    h: &dyn CpusetHierarchy,
    entries: &[CpusetTarget],
    file: CpusetFile,
) -> Vec<(String, CpuSet)> {
    let changes: Vec<NestedChange> = entries
        .iter()
        .filter_map(|e| {
            let (current, target) = match file {
                CpusetFile::Cpus => (&e.current_cpus, e.cpus.as_ref()?),
                CpusetFile::Mems => (&e.current_mems, e.mems.as_ref()?),
            };
            Some(NestedChange {
                cgroup: e.cgroup.clone(),
                current: current.clone(),
                target: target.clone(),
            })
        })
        .collect();
    if h.nested_subsets() {
        nested_write_order(&changes)
    } else {
        changes
            .into_iter()
            .filter(|c| c.current != c.target)
            .map(|c| (c.cgroup, c.target))
            .collect()
    }
}

/// A cgroup's current cpuset values and what they should become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpusetTarget {
    pub cgroup: String,
    pub current_cpus: CpuSet,
    pub current_mems: CpuSet,
    pub cpus: Option<CpuSet>,
    pub mems: Option<CpuSet>,
}

#[cfg(test)]
mod tests;
