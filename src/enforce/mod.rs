//! Making the node match the plan for training jobs: each job's placement (a cpuset cgroup, or CPU
//! affinity) and SCHED_RR on every thread, idempotently, with a [`JobRecord`] of everything changed
//! so that [`Enforcer::release`] can undo it, also after a lodgerd restart. Touches cgroupfs, /proc,
//! sched_setscheduler and sched_setaffinity, through the submodules.
//!
//! `apply` runs every tick for every job, so its steady path (nothing to change) only reads: the
//! job's cpuset files or thread masks, `/proc/PID/stat` of each known process, `/proc/PID/task`, two
//! scheduler queries per thread. A full /proc scan (for descendants) happens only when it can find
//! something: with affinity pinning when a task was created on the node since the last scan
//! (`/proc/loadavg`), with cgroup pinning only after processes were moved (a child forked during
//! the move stays outside). Timing `apply` on an enforced job times the sweep.

pub mod cpusets;
pub mod instances;
pub mod network;
pub mod procs;
pub mod resctrl;
pub mod rtgroup;
pub mod sched;
pub mod sim;

/// The old paths `src/config.rs` names inline (`crate::enforce::tc::Link`, ...), kept only until
/// the config rooms name `network` directly; nothing else uses them.
#[doc(hidden)]
pub mod tc {
    pub use super::network::{check_interface, Link, ShapingConfig, Steering};
}
/// See [`tc`]: `crate::enforce::route::SlowNetwork` as `src/config.rs` names it.
#[doc(hidden)]
pub mod route {
    pub use super::network::route::SlowNetwork;
}

#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::cpuset::CpuSet;
use crate::job::{JobId, Target};

pub use self::cpusets::CpusetHierarchy;
use self::cpusets::{CpusetFile, CpusetTarget};
pub use self::procs::ProcError;
use self::procs::{ProcReader, ProcStat, ProcessTable};
use self::rtgroup::RtGroups;
pub use self::rtgroup::{RtGrant, RtGroupError};
pub use self::sched::SchedError;
use self::sched::{AffinityState, CpuMask, RrState};
use crate::sys::cgroupfs::{self as cgroup, child_of, parent_of};
pub use crate::sys::cgroupfs::{CgroupDriver, CgroupError, CgroupVersion};

/// Default name of lodger's own parent cgroup.
pub const DEFAULT_PARENT: &str = "lodger";
/// Default SCHED_RR priority: above every normal thread, below the kernel's own RT threads
/// (watchdog, migration at 99; threaded IRQs at 50).
pub const DEFAULT_RT_PRIORITY: i32 = 10;

/// How lodger pins a job registered by pids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PidPinning {
    /// `Cgroup` on v1, `Affinity` on v2 (where lodger must not pull processes out of their
    /// systemd unit).
    #[default]
    Auto,
    Cgroup,
    Affinity,
}

/// The pinning method in use for a pid job (`PidPinning` resolved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinMethod {
    /// The job's processes move into `<cpuset root>/<parent>/<job id>`.
    Cgroup,
    /// Every thread gets a CPU affinity mask; memory nodes are not enforced.
    Affinity,
}

impl PinMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            PinMethod::Cgroup => "cgroup",
            PinMethod::Affinity => "affinity",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EnforceSettings {
    /// Where the cgroup hierarchies are mounted (`/sys/fs/cgroup`).
    pub cgroup_root: PathBuf,
    /// Where procfs is mounted (`/proc`).
    pub proc_root: PathBuf,
    pub driver: CgroupDriver,
    /// lodger's own cgroup, parent of the per-job cgroups of pid jobs (relative to the cpuset
    /// hierarchy). v2: the only subtree where lodger enables controllers.
    pub parent: String,
    pub pid_jobs: PidPinning,
    /// SCHED_RR priority of training threads.
    pub rt_priority: i32,
    /// Allow SCHED_RR when `kernel.sched_rt_runtime_us` is -1 (`training.allow_unthrottled_rt`).
    pub allow_unthrottled_rt: bool,
    /// Grant this RT budget to v1 cpu cgroups that have none (`training.grant_rt_budget_us`).
    pub grant_rt_budget_us: Option<u64>,
}

impl Default for EnforceSettings {
    fn default() -> Self {
        Self {
            cgroup_root: PathBuf::from(cgroup::DEFAULT_CGROUP_ROOT),
            proc_root: PathBuf::from(procs::DEFAULT_PROC_ROOT),
            driver: CgroupDriver::Auto,
            parent: DEFAULT_PARENT.to_string(),
            pid_jobs: PidPinning::Auto,
            rt_priority: DEFAULT_RT_PRIORITY,
            allow_unthrottled_rt: false,
            grant_rt_budget_us: None,
        }
    }
}

/// What status shows about enforcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupMode {
    pub version: CgroupVersion,
    pub pid_pinning: PinMethod,
}

impl fmt::Display for CgroupMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cgroup {}, pid jobs pinned by {}",
            self.version,
            self.pid_pinning.as_str()
        )
    }
}

/// What one `apply` found and did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Something on the node was written.
    pub changed: bool,
    /// The job's live processes, sorted.
    pub pids: Vec<u32>,
    pub threads: u32,
    /// Threads that are SCHED_RR at the configured priority.
    pub rr_threads: u32,
    /// False when no process of the job is left.
    pub alive: bool,
    pub warnings: Vec<String>,
}

/// Everything needed to undo what lodger did to a job; persisted by the store.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct JobRecord {
    /// A job registered by cgroup.
    pub cgroup: Option<CgroupJobRecord>,
    /// A job registered by pids.
    pub pids: Option<PidJobRecord>,
    /// RT budgets lodger granted to v1 cpu cgroups, in the order written.
    pub rt_grants: Vec<RtGrant>,
}

#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct CgroupJobRecord {
    /// The job's cgroup, normalized, relative to the cpuset hierarchy.
    pub cgroup: String,
    /// Values found before lodger's first write to each cgroup (the job's first).
    pub saved: Vec<SavedCpuset>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SavedCpuset {
    pub cgroup: String,
    pub cpus: CpuSet,
    pub mems: CpuSet,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct PidJobRecord {
    pub pinning: PinMethod,
    /// Cgroup pinning: lodger's cgroup for the job, once created.
    pub cgroup: Option<String>,
    /// The registered pids, with their start times when lodger first saw them.
    pub roots: Vec<RootProcess>,
    /// Registered pids that were not running when lodger first saw them: a process that gets
    /// such a pid later is not the job's.
    pub missing_roots: Vec<u32>,
    /// Every process of the job seen alive at the last apply, sorted by pid.
    pub processes: Vec<TrackedProcess>,
    /// Processes were moved at the last apply: scan /proc once more for children forked meanwhile.
    pub rescan: bool,
}

impl Default for PidJobRecord {
    fn default() -> Self {
        Self {
            pinning: PinMethod::Affinity,
            cgroup: None,
            roots: Vec::new(),
            missing_roots: Vec::new(),
            processes: Vec::new(),
            rescan: false,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootProcess {
    pub pid: u32,
    pub start_time: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TrackedProcess {
    pub pid: u32,
    /// From `/proc/PID/stat`: a reused pid has another start time.
    pub start_time: u64,
    pub ppid: u32,
    /// Cgroup pinning: its cpuset cgroup before lodger moved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_cgroup: Option<String>,
    /// Affinity pinning: its CPU mask before lodger set one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_affinity: Option<CpuSet>,
}

#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error("the job's cgroup {path} no longer exists")]
    CgroupGone { path: PathBuf },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Sched(#[from] SchedError),
    #[error(transparent)]
    Proc(#[from] ProcError),
    #[error(transparent)]
    RtGroup(#[from] RtGroupError),
    #[error("the placement has no CPU")]
    EmptyPlacement,
    #[error("inference instances are run by the instance runner, not pinned like a training job")]
    NotPinned,
    #[error("CPUs {cpus} are not all on this node (it has {node})")]
    CpusOutsideNode { cpus: CpuSet, node: CpuSet },
    #[error("'{0}' cannot be a job's cgroup: give a cgroup below the hierarchy root")]
    RootCgroup(String),
    #[error(
        "job {id}: its record is for a {recorded} target, not a {given} one; release it first"
    )]
    RecordMismatch {
        id: String,
        recorded: &'static str,
        given: &'static str,
    },
    #[error("{} problems: {}{}", .errors.len() + .more, join(.errors), and_more(*.more))]
    Several {
        errors: Vec<EnforceError>,
        /// Further distinct problems, not kept.
        more: usize,
    },
}

/// Distinct problems kept in [`EnforceError::Several`]; one per thread would flood the log.
const MAX_REPORTED: usize = 4;

fn and_more(more: usize) -> String {
    if more == 0 {
        String::new()
    } else {
        format!("; and {more} more")
    }
}

fn join(errors: &[EnforceError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

impl EnforceError {
    /// The job is gone (its cgroup vanished): forget it rather than retry.
    pub fn is_gone(&self) -> bool {
        matches!(self, EnforceError::CgroupGone { .. })
    }

    /// `Ok` when empty, the error itself when there is one kind, else `Several`.
    fn collect(errors: Vec<EnforceError>) -> Result<(), EnforceError> {
        let mut unique: Vec<EnforceError> = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        for e in errors {
            let text = e.to_string();
            if !seen.contains(&text) {
                seen.push(text);
                unique.push(e);
            }
        }
        match unique.len() {
            0 => Ok(()),
            1 => Err(unique.remove(0)),
            n => {
                unique.truncate(MAX_REPORTED);
                Err(EnforceError::Several {
                    errors: unique,
                    more: n.saturating_sub(MAX_REPORTED),
                })
            }
        }
    }
}

/// Buffers kept between applies, so the steady path does not allocate per process or thread.
#[derive(Debug)]
struct Scratch {
    reader: ProcReader,
    table: ProcessTable,
    /// `/proc/loadavg`'s last pid when `table` was read; `None`: no usable table.
    table_key: Option<u32>,
    tids: Vec<u32>,
    in_cgroup: Vec<u32>,
    cgroups: Vec<String>,
}

/// Enforces training jobs' placements and SCHED_RR. One per lodgerd; `Send` and `Sync`.
#[derive(Debug)]
pub struct Enforcer {
    settings: EnforceSettings,
    mode: CgroupMode,
    cpusets: Box<dyn CpusetHierarchy>,
    rt_groups: RtGroups,
    /// `settings.parent`, normalized.
    parent: String,
    scratch: Mutex<Scratch>,
}

impl Enforcer {
    /// Detects the cgroup mode and checks what can be checked before the first job: the
    /// priority, the parent name, that the cpuset hierarchy and /proc can be read. Warns (does not
    /// fail) when SCHED_RR will be refused because RT tasks are unthrottled.
    pub fn new(settings: EnforceSettings) -> Result<Enforcer, EnforceError> {
        sched::check_priority(settings.rt_priority)?;
        let parent = cgroup::normalize(&settings.parent)?;
        if parent == "/" {
            return Err(CgroupError::BadPath(settings.parent.clone()).into());
        }
        let version = cgroup::detect(&settings.cgroup_root, settings.driver)?;
        let cpusets = cpusets::open(&settings.cgroup_root, version);
        match version {
            CgroupVersion::V1 => cpusets.read("/", CpusetFile::Cpus).map(drop)?,
            CgroupVersion::V2 => {}
        }
        std::fs::read_dir(&settings.proc_root).map_err(|source| ProcError::Read {
            path: settings.proc_root.clone(),
            source,
        })?;
        let pid_pinning = match (settings.pid_jobs, version) {
            (PidPinning::Cgroup, _) | (PidPinning::Auto, CgroupVersion::V1) => PinMethod::Cgroup,
            (PidPinning::Affinity, _) | (PidPinning::Auto, CgroupVersion::V2) => {
                PinMethod::Affinity
            }
        };
        if let Ok(Some(-1)) = sched::node_rt_runtime_us(&settings.proc_root) {
            if !settings.allow_unthrottled_rt {
                warn!(
                    "kernel.sched_rt_runtime_us is -1: SCHED_RR will be refused for training jobs \
                     (set training.allow_unthrottled_rt = true to allow it)"
                );
            }
        }
        let rt_groups = RtGroups::new(&settings.cgroup_root);
        let scratch = Scratch {
            reader: ProcReader::new(&settings.proc_root),
            table: ProcessTable::default(),
            table_key: None,
            tids: Vec::new(),
            in_cgroup: Vec::new(),
            cgroups: Vec::new(),
        };
        Ok(Enforcer {
            mode: CgroupMode {
                version,
                pid_pinning,
            },
            cpusets,
            rt_groups,
            parent,
            scratch: Mutex::new(scratch),
            settings,
        })
    }

    pub fn mode(&self) -> CgroupMode {
        self.mode
    }

    pub fn settings(&self) -> &EnforceSettings {
        &self.settings
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        // The scratch holds only buffers: a panic while it was held leaves nothing inconsistent.
        self.scratch.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes the job's processes run on `cpus` (and memory nodes `mems`; empty = leave) with every
    /// thread SCHED_RR. Idempotent: with nothing new, it writes nothing and reports
    /// `changed = false`. `record` is updated before each change it describes, so it stays valid
    /// when this fails half-way. Errors on single threads do not stop the sweep: they are returned
    /// together at the end, after everything else was done.
    pub fn apply(
        &self,
        id: &JobId,
        target: &Target,
        cpus: &CpuSet,
        mems: &CpuSet,
        record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError> {
        if cpus.is_empty() {
            return Err(EnforceError::EmptyPlacement);
        }
        let mut guard = self.scratch();
        let s = &mut *guard;
        let mut out = Outcome::default();
        let JobRecord {
            cgroup: cgroup_rec,
            pids: pid_rec,
            rt_grants,
        } = record;
        let mut rr = RrSweep::new(self, rt_grants);
        let placed = match target {
            Target::Cgroup(path) => {
                if pid_rec.is_some() {
                    return Err(mismatch(id, "pids", "cgroup"));
                }
                self.apply_cgroup(path, cpus, mems, cgroup_rec, s, &mut rr, &mut out)
            }
            Target::Instances => return Err(EnforceError::NotPinned),
            Target::Pids(roots) => {
                if cgroup_rec.is_some() {
                    return Err(mismatch(id, "cgroup", "pids"));
                }
                self.apply_pids(id, roots, cpus, mems, pid_rec, s, &mut rr, &mut out)
            }
        };
        out.changed |= rr.changed;
        out.threads = rr.threads;
        out.rr_threads = rr.rr;
        let mut errors = rr.errors;
        match placed {
            Err(e) if errors.is_empty() => return Err(e),
            Err(e) => errors.insert(0, e),
            Ok(()) => {}
        }
        EnforceError::collect(errors)?;
        Ok(out)
    }

    /// Removes lodger's parent cgroup when nothing is left in it (the last job's release may
    /// have found it still holding the instances' cgroup). Harmless when it is in use or gone.
    pub fn tidy(&self) {
        if let Err(e) = self.cpusets.remove_if_unused(&self.parent) {
            tracing::debug!("lodger's parent cgroup {} not removed: {e}", self.parent);
        }
    }

    /// Undoes what `apply` did, for whatever still exists: threads back to SCHED_OTHER, cpusets to
    /// their saved values, processes back to their cgroups or masks, lodger's cgroup removed, RT
    /// budgets returned. A job whose cgroup or processes are gone has nothing left to undo. Goes on
    /// after errors and returns them together.
    pub fn release(
        &self,
        id: &JobId,
        target: &Target,
        record: &JobRecord,
    ) -> Result<(), EnforceError> {
        let mut guard = self.scratch();
        let s = &mut *guard;
        let mut errors = Vec::new();
        if let Some(rec) = &record.cgroup {
            self.release_cgroup(rec, s, &mut errors);
        }
        if let Some(rec) = &record.pids {
            self.release_pids(rec, s, &mut errors);
        }
        if record.cgroup.is_none() && record.pids.is_none() {
            debug!(job = %id, ?target, "nothing recorded to release");
        }
        for e in self.rt_groups.revert(&record.rt_grants) {
            // Expected while other RT tasks use the group: the kernel keeps the budget.
            warn!(job = %id, "real-time budget kept: {e}");
        }
        EnforceError::collect(errors)
    }

    /// Fails when `cpus` are not all CPUs of the node (the hierarchy root's effective CPUs).
    fn check_node_cpus(&self, cpus: &CpuSet) -> Result<(), EnforceError> {
        let node = match self.mode.version {
            CgroupVersion::V1 => self.cpusets.read("/", CpusetFile::Cpus),
            CgroupVersion::V2 => self.cpusets.effective_cpus("/"),
        };
        match node {
            Ok(node) if !node.is_empty() && !cpus.is_subset(&node) => {
                Err(EnforceError::CpusOutsideNode {
                    cpus: cpus.clone(),
                    node,
                })
            }
            _ => Ok(()),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Jobs registered by cgroup

    #[allow(clippy::too_many_arguments)]
    fn apply_cgroup(
        &self,
        path: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
        slot: &mut Option<CgroupJobRecord>,
        s: &mut Scratch,
        rr: &mut RrSweep<'_>,
        out: &mut Outcome,
    ) -> Result<(), EnforceError> {
        let h = &*self.cpusets;
        let cg = cgroup::normalize(path)?;
        if cg == "/" {
            return Err(EnforceError::RootCgroup(path.to_string()));
        }
        let gone = |e: CgroupError| -> EnforceError {
            if e.is_gone() {
                EnforceError::CgroupGone { path: h.dir(&cg) }
            } else {
                e.into()
            }
        };
        if !h.exists(&cg) {
            return Err(EnforceError::CgroupGone { path: h.dir(&cg) });
        }
        if !h.cpuset_enabled(&cg).map_err(gone)? {
            h.enable_cpuset(&cg, &self.parent).map_err(gone)?;
            out.changed = true;
            if !h.cpuset_enabled(&cg).map_err(gone)? {
                return Err(CgroupError::CpusetNotEnabled {
                    cgroup: h.dir(&cg),
                    file: h
                        .dir(parent_of(&cg).unwrap_or("/"))
                        .join(cgroup::CGROUP_SUBTREE_CONTROL),
                }
                .into());
            }
        }
        let rec = match slot {
            Some(rec) if rec.cgroup == cg => rec,
            Some(rec) => {
                return Err(CgroupError::BadPath(format!(
                    "{cg} (the record is for {}; release it first)",
                    rec.cgroup
                ))
                .into())
            }
            None => {
                let saved = SavedCpuset {
                    cgroup: cg.clone(),
                    cpus: h.read(&cg, CpusetFile::Cpus).map_err(gone)?,
                    mems: h.read(&cg, CpusetFile::Mems).map_err(gone)?,
                };
                slot.insert(CgroupJobRecord {
                    cgroup: cg.clone(),
                    saved: vec![saved],
                })
            }
        };

        // The job's cgroup and its descendants, parents before children.
        s.cgroups.clear();
        s.cgroups.push(cg.clone());
        let mut i = 0;
        while i < s.cgroups.len() {
            let parent = s.cgroups[i].clone();
            match h.children(&parent, &mut s.cgroups) {
                Ok(()) => {}
                // A descendant removed meanwhile (a finished Slurm task) is normal.
                Err(e) if e.is_gone() && i > 0 => {}
                Err(e) => return Err(gone(e)),
            }
            i += 1;
        }

        let want_mems = (!mems.is_empty()).then(|| mems.clone());
        let mut entries: Vec<CpusetTarget> = Vec::with_capacity(s.cgroups.len());
        for (i, c) in s.cgroups.iter().enumerate() {
            let read = |file| h.read(c, file);
            let (current_cpus, current_mems) =
                match (read(CpusetFile::Cpus), read(CpusetFile::Mems)) {
                    (Ok(a), Ok(b)) => (a, b),
                    (Err(e), _) | (_, Err(e)) if e.is_gone() && i > 0 => continue,
                    (Err(e), _) | (_, Err(e)) => return Err(gone(e)),
                };
            let (t_cpus, t_mems) = if i == 0 {
                (Some(cpus.clone()), want_mems.clone())
            } else if h.nested_subsets() {
                // v1: a descendant must stay within its parent's new value.
                let parent = parent_of(c).unwrap_or("/");
                let (p_cpus, p_mems) = entries
                    .iter()
                    .find(|e| e.cgroup == parent)
                    .map(|e| {
                        (
                            e.cpus.clone().unwrap_or_else(|| e.current_cpus.clone()),
                            e.mems.clone().unwrap_or_else(|| e.current_mems.clone()),
                        )
                    })
                    .unwrap_or_else(|| (cpus.clone(), mems.clone()));
                (
                    within(&current_cpus, &p_cpus),
                    within(&current_mems, &p_mems),
                )
            } else {
                // v2: a descendant's effective set is always within the job's.
                (None, None)
            };
            entries.push(CpusetTarget {
                cgroup: c.clone(),
                current_cpus,
                current_mems,
                cpus: t_cpus,
                mems: t_mems,
            });
        }
        let needs_write = entries.iter().any(|e| {
            e.cpus.as_ref().is_some_and(|t| *t != e.current_cpus)
                || e.mems.as_ref().is_some_and(|t| *t != e.current_mems)
        });
        if needs_write {
            self.check_node_cpus(cpus)?;
            if h.nested_subsets() {
                // v1: ancestors must hold the job's new value first.
                for a in cgroup::ancestors(&cg) {
                    if a == "/" {
                        continue;
                    }
                    let a_cpus = h.read(a, CpusetFile::Cpus)?;
                    let a_mems = h.read(a, CpusetFile::Mems)?;
                    let grow_cpus = !cpus.is_subset(&a_cpus);
                    let grow_mems = want_mems.as_ref().is_some_and(|m| !m.is_subset(&a_mems));
                    if grow_cpus || grow_mems {
                        entries.push(CpusetTarget {
                            cgroup: a.to_string(),
                            cpus: grow_cpus.then(|| a_cpus.union(cpus)),
                            mems: want_mems
                                .as_ref()
                                .filter(|_| grow_mems)
                                .map(|m| a_mems.union(m)),
                            current_cpus: a_cpus,
                            current_mems: a_mems,
                        });
                    }
                }
            }
            for e in &entries {
                let writes = e.cpus.as_ref().is_some_and(|t| *t != e.current_cpus)
                    || e.mems.as_ref().is_some_and(|t| *t != e.current_mems);
                if writes && !rec.saved.iter().any(|x| x.cgroup == e.cgroup) {
                    rec.saved.push(SavedCpuset {
                        cgroup: e.cgroup.clone(),
                        cpus: e.current_cpus.clone(),
                        mems: e.current_mems.clone(),
                    });
                }
            }
            out.changed |= cpusets::write_nested(h, &entries).map_err(gone)?;
            if h.version() == CgroupVersion::V2 {
                if let Ok(effective) = h.effective_cpus(&cg) {
                    if effective != *cpus {
                        out.warnings.push(format!(
                            "cgroup {cg} runs on CPUs {effective}, not {cpus}: its parent does not \
                             allow them all"
                        ));
                    }
                }
            }
        }

        let mut pids = Vec::new();
        for (i, c) in s.cgroups.iter().enumerate() {
            match h.procs(c, &mut pids) {
                Ok(()) => {}
                Err(e) if e.is_gone() && i > 0 => {}
                Err(e) => return Err(gone(e)),
            }
        }
        pids.sort_unstable();
        pids.dedup();
        out.pids = self.sweep_threads(s, &pids, None, rr);
        out.alive = !out.pids.is_empty();
        Ok(())
    }

    fn release_cgroup(
        &self,
        rec: &CgroupJobRecord,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) {
        let h = &*self.cpusets;
        let cg = &rec.cgroup;
        if !h.exists(cg) {
            debug!(cgroup = %cg, "job cgroup gone: nothing to restore");
            return;
        }
        s.cgroups.clear();
        s.cgroups.push(cg.clone());
        let mut i = 0;
        while i < s.cgroups.len() {
            let parent = s.cgroups[i].clone();
            if let Err(e) = h.children(&parent, &mut s.cgroups) {
                if !e.is_gone() {
                    errors.push(e.into());
                }
            }
            i += 1;
        }
        let mut pids = Vec::new();
        for c in &s.cgroups {
            if let Err(e) = h.procs(c, &mut pids) {
                if !e.is_gone() {
                    errors.push(e.into());
                }
            }
        }
        pids.sort_unstable();
        pids.dedup();
        self.revert_threads(s, &pids, None, errors);

        // The subtree first (ancestors are still grown), then the ancestors lodger grew. Each
        // file is restored on its own: one that fails is reported and the others still go back.
        let saved = |c: &str| rec.saved.iter().find(|x| x.cgroup == c);
        let mut subtree: Vec<CpusetTarget> = Vec::new();
        for c in s.cgroups.iter() {
            let mut read = |file| match h.read(c, file) {
                Ok(v) => Some(v),
                Err(e) => {
                    // A descendant removed meanwhile is normal; a file lodger wrote and can no
                    // longer read is not.
                    if !e.is_gone() && saved(c).is_some() {
                        errors.push(e.into());
                    }
                    None
                }
            };
            let (cur_cpus, cur_mems) = (read(CpusetFile::Cpus), read(CpusetFile::Mems));
            let (t_cpus, t_mems) = match (saved(c), &cur_cpus, &cur_mems) {
                (Some(x), _, _) => (
                    cur_cpus.as_ref().map(|_| x.cpus.clone()),
                    cur_mems.as_ref().map(|_| x.mems.clone()),
                ),
                (None, Some(cur_cpus), Some(cur_mems)) if h.nested_subsets() => {
                    let parent = parent_of(c).unwrap_or("/");
                    let Some(p) = subtree.iter().find(|e| e.cgroup == parent) else {
                        continue;
                    };
                    let p_cpus = p.cpus.clone().unwrap_or_else(|| p.current_cpus.clone());
                    let p_mems = p.mems.clone().unwrap_or_else(|| p.current_mems.clone());
                    (
                        Some(within(cur_cpus, &p_cpus).unwrap_or_else(|| cur_cpus.clone())),
                        Some(within(cur_mems, &p_mems).unwrap_or_else(|| cur_mems.clone())),
                    )
                }
                _ => continue,
            };
            subtree.push(CpusetTarget {
                cgroup: c.clone(),
                current_cpus: cur_cpus.unwrap_or_default(),
                current_mems: cur_mems.unwrap_or_default(),
                cpus: t_cpus,
                mems: t_mems,
            });
        }
        let restored = cpusets::restore_nested(h, &subtree);
        for s in &restored.substituted {
            warn!("{s}");
        }
        errors.extend(
            restored
                .errors
                .into_iter()
                .filter(|e| !e.is_gone())
                .map(EnforceError::from),
        );
        let mut above: Vec<CpusetTarget> = Vec::new();
        for x in &rec.saved {
            if cgroup::is_within(&x.cgroup, cg) {
                continue;
            }
            let (Ok(cur_cpus), Ok(cur_mems)) = (
                h.read(&x.cgroup, CpusetFile::Cpus),
                h.read(&x.cgroup, CpusetFile::Mems),
            ) else {
                continue;
            };
            above.push(CpusetTarget {
                cgroup: x.cgroup.clone(),
                current_cpus: cur_cpus,
                current_mems: cur_mems,
                cpus: Some(x.cpus.clone()),
                mems: Some(x.mems.clone()),
            });
        }
        let restored = cpusets::restore_nested(h, &above);
        for s in &restored.substituted {
            warn!("{s}");
        }
        for e in restored.errors.iter().filter(|e| !e.is_gone()) {
            // Another cgroup below may now use the CPUs lodger added: the kernel refuses the
            // shrink and the ancestor keeps them.
            warn!("cannot restore the cpuset of an ancestor of {cg}: {e}");
        }
    }

    // -----------------------------------------------------------------------------------------
    // Jobs registered by pids

    #[allow(clippy::too_many_arguments)]
    fn apply_pids(
        &self,
        id: &JobId,
        roots: &[u32],
        cpus: &CpuSet,
        mems: &CpuSet,
        slot: &mut Option<PidJobRecord>,
        s: &mut Scratch,
        rr: &mut RrSweep<'_>,
        out: &mut Outcome,
    ) -> Result<(), EnforceError> {
        let h = &*self.cpusets;
        let first = slot.is_none();
        let rec = slot.get_or_insert_with(|| PidJobRecord {
            pinning: self.mode.pid_pinning,
            ..PidJobRecord::default()
        });
        // Registered pids lodger has not seen yet (all of them at first; later, pids added by an
        // update).
        for &pid in roots {
            if rec.roots.iter().any(|r| r.pid == pid) || rec.missing_roots.contains(&pid) {
                continue;
            }
            match s.reader.stat(pid)? {
                Some(st) if st.running => rec.roots.push(RootProcess {
                    pid,
                    start_time: st.start_time,
                }),
                _ => {
                    out.warnings.push(format!("pid {pid} is not running"));
                    rec.missing_roots.push(pid);
                }
            }
        }
        if first && rec.pinning == PinMethod::Affinity && !mems.is_empty() {
            out.warnings.push(format!(
                "memory nodes {mems} are not enforced: pid jobs are pinned by affinity"
            ));
        }
        let job_cg = match rec.pinning {
            PinMethod::Cgroup => Some(
                rec.cgroup
                    .clone()
                    .unwrap_or_else(|| child_of(&self.parent, id.as_str())),
            ),
            PinMethod::Affinity => None,
        };

        // Processes lodger knows: live roots, processes tracked before (same start time: a reused
        // pid is another process), everything in lodger's cgroup.
        s.in_cgroup.clear();
        if let (Some(cg), Some(_)) = (&job_cg, &rec.cgroup) {
            match h.procs(cg, &mut s.in_cgroup) {
                Ok(()) => {}
                Err(e) if e.is_gone() => {
                    out.warnings
                        .push(format!("lodger's cgroup {cg} vanished: recreating it"));
                    rec.cgroup = None;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut members: Vec<(u32, ProcStat)> = Vec::new();
        let known = rec
            .roots
            .iter()
            .map(|r| (r.pid, Some(r.start_time)))
            .chain(rec.processes.iter().map(|p| (p.pid, Some(p.start_time))))
            .chain(s.in_cgroup.iter().map(|&p| (p, None)));
        for (pid, start) in known {
            if members.iter().any(|(p, _)| *p == pid) {
                continue;
            }
            if let Some(st) = s.reader.stat(pid)? {
                if st.running && start.map_or(true, |t| t == st.start_time) {
                    members.push((pid, st));
                }
            }
        }
        // Their descendants, from a /proc scan when one can find something new.
        let outside = job_cg.is_some() && members.iter().any(|(p, _)| !s.in_cgroup.contains(p));
        let scan = rec.pinning == PinMethod::Affinity || first || rec.rescan || outside;
        if scan && !members.is_empty() {
            refresh_table(s)?;
            let known: Vec<u32> = members.iter().map(|(p, _)| *p).collect();
            let mut found = Vec::new();
            s.table.descendants(&known, &mut found);
            for pid in found {
                if let Some(st) = s.reader.stat(pid)? {
                    if st.running {
                        members.push((pid, st));
                    }
                }
            }
        }
        members.sort_unstable_by_key(|(p, _)| *p);

        // Track them, remembering what to restore; forget the dead. In place: on the steady path
        // every member is already tracked and nothing is cloned.
        let want_mask = (rec.pinning == PinMethod::Affinity).then(|| CpuMask::from_cpuset(cpus));
        let mut keep = vec![false; rec.processes.len()];
        let mut added: Vec<TrackedProcess> = Vec::new();
        for &(pid, st) in &members {
            if let Ok(i) = rec.processes.binary_search_by_key(&pid, |p| p.pid) {
                if rec.processes[i].start_time == st.start_time {
                    keep[i] = true;
                    continue;
                }
            }
            let parent = |added: &[TrackedProcess]| -> Option<TrackedProcess> {
                added
                    .iter()
                    .chain(rec.processes.iter())
                    .find(|p| p.pid == st.ppid)
                    .cloned()
            };
            let mut p = TrackedProcess {
                pid,
                start_time: st.start_time,
                ppid: st.ppid,
                original_cgroup: None,
                original_affinity: None,
            };
            match rec.pinning {
                PinMethod::Cgroup => {
                    let now = h.cgroup_of(s.reader.root(), pid)?;
                    // Born inside lodger's cgroup: it belongs where its parent came from.
                    p.original_cgroup = if now.is_some() && now == job_cg {
                        parent(&added).and_then(|q| q.original_cgroup)
                    } else {
                        now
                    };
                }
                PinMethod::Affinity => {
                    let Ok(mask) = CpuMask::of_thread(pid) else {
                        continue;
                    };
                    let now = mask.to_cpuset();
                    // Forked after pinning: it inherited lodger's mask, not its own.
                    p.original_affinity = if &now == cpus {
                        parent(&added)
                            .and_then(|q| q.original_affinity)
                            .or(Some(now))
                    } else {
                        Some(now)
                    };
                }
            }
            added.push(p);
        }
        let mut keep = keep.into_iter();
        rec.processes.retain(|_| keep.next().unwrap_or(false));
        if !added.is_empty() {
            rec.processes.extend(added);
            rec.processes.sort_unstable_by_key(|p| p.pid);
        }
        if rec.processes.is_empty() {
            out.alive = false;
            return Ok(());
        }

        // Place them.
        if let Some(cg) = &job_cg {
            let created = self.ensure_job_cgroup(cg, cpus, mems)?;
            out.changed |= created;
            rec.cgroup = Some(cg.clone());
            let mut moved = false;
            for p in &rec.processes {
                if s.in_cgroup.contains(&p.pid) {
                    continue;
                }
                match h.attach(cg, p.pid) {
                    Ok(()) => moved = true,
                    Err(e) if e.is_gone() && h.exists(cg) => {}
                    Err(e) => rr.errors.push(e.into()),
                }
            }
            rec.rescan = moved;
            out.changed |= moved;
        }
        let pids: Vec<u32> = rec.processes.iter().map(|p| p.pid).collect();
        out.pids = self.sweep_threads(s, &pids, want_mask.as_ref(), rr);
        rec.processes
            .retain(|p| out.pids.binary_search(&p.pid).is_ok());
        out.alive = !out.pids.is_empty();
        Ok(())
    }

    /// Creates `<parent>/<job>` if needed and sets its mems, then cpus (v1: before any task is
    /// attached). Returns whether anything was written.
    fn ensure_job_cgroup(
        &self,
        cg: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
    ) -> Result<bool, EnforceError> {
        let h = &*self.cpusets;
        let parent = parent_of(cg).unwrap_or("/").to_string();
        let mut changed = false;
        if !h.exists(&parent) {
            self.check_node_cpus(cpus)?;
            h.create(&parent)?;
            changed = true;
        }
        if !h.exists(cg) {
            self.check_node_cpus(cpus)?;
            // v2: the job's cgroup gets cpuset files only if its parent enables the controller.
            h.enable_cpuset(cg, &parent)?;
            h.create(cg)?;
            changed = true;
        }
        if !h.cpuset_enabled(cg)? {
            changed |= h.enable_cpuset(cg, &parent)?;
        }
        let cur_cpus = h.read(cg, CpusetFile::Cpus)?;
        let cur_mems = h.read(cg, CpusetFile::Mems)?;
        let want_mems = (!mems.is_empty()).then(|| mems.clone());
        if cur_cpus == *cpus && want_mems.as_ref().map_or(true, |m| *m == cur_mems) {
            return Ok(changed);
        }
        self.check_node_cpus(cpus)?;
        let mut entries = vec![CpusetTarget {
            cgroup: cg.to_string(),
            current_cpus: cur_cpus,
            current_mems: cur_mems,
            cpus: Some(cpus.clone()),
            mems: want_mems.clone(),
        }];
        if h.nested_subsets() && parent != "/" {
            // lodger's parent only ever grows: other jobs' cgroups live in it.
            let p_cpus = h.read(&parent, CpusetFile::Cpus)?;
            let p_mems = h.read(&parent, CpusetFile::Mems)?;
            let grow_mems = want_mems.as_ref().filter(|m| !m.is_subset(&p_mems));
            if !cpus.is_subset(&p_cpus) || grow_mems.is_some() {
                entries.push(CpusetTarget {
                    cgroup: parent.clone(),
                    cpus: Some(p_cpus.union(cpus)),
                    mems: grow_mems.map(|m| p_mems.union(m)),
                    current_cpus: p_cpus,
                    current_mems: p_mems,
                });
            }
        }
        cpusets::write_nested(h, &entries)?;
        Ok(true)
    }

    fn release_pids(&self, rec: &PidJobRecord, s: &mut Scratch, errors: &mut Vec<EnforceError>) {
        let h = &*self.cpusets;
        // The same processes apply would find, without tracking new ones.
        s.in_cgroup.clear();
        if let Some(cg) = &rec.cgroup {
            if let Err(e) = h.procs(cg, &mut s.in_cgroup) {
                if !e.is_gone() {
                    errors.push(e.into());
                }
            }
        }
        let mut members: Vec<u32> = s.in_cgroup.clone();
        let known = rec
            .roots
            .iter()
            .map(|r| (r.pid, r.start_time))
            .chain(rec.processes.iter().map(|p| (p.pid, p.start_time)));
        for (pid, start) in known {
            if members.contains(&pid) {
                continue;
            }
            match s.reader.stat(pid) {
                Ok(Some(st)) if st.running && st.start_time == start => members.push(pid),
                Ok(_) => {}
                Err(e) => errors.push(e.into()),
            }
        }
        if !members.is_empty() {
            match refresh_table(s) {
                Ok(()) => {
                    let known = members.clone();
                    s.table.descendants(&known, &mut members);
                }
                Err(e) => errors.push(e),
            }
        }
        members.sort_unstable();
        members.dedup();

        // What each process goes back to: its own record, else its parent's (it was forked while
        // pinned), else the first root's.
        let origin = |pid: u32, ppid: Option<u32>| -> Option<&TrackedProcess> {
            let find = |p: u32| rec.processes.iter().find(|t| t.pid == p);
            find(pid)
                .or_else(|| ppid.and_then(find))
                .or_else(|| rec.roots.first().and_then(|r| find(r.pid)))
        };
        let mut ppids: Vec<(u32, Option<u32>)> = Vec::with_capacity(members.len());
        for &pid in &members {
            let ppid = s.reader.stat(pid).ok().flatten().map(|st| st.ppid);
            ppids.push((pid, ppid));
        }

        match rec.pinning {
            PinMethod::Affinity => {
                for &(pid, ppid) in &ppids {
                    let mask = origin(pid, ppid)
                        .and_then(|t| t.original_affinity.as_ref())
                        .map(CpuMask::from_cpuset);
                    if mask.is_none() {
                        warn!(pid, "no original CPU mask recorded: left on the job's CPUs");
                    }
                    self.revert_threads(s, &[pid], mask.as_ref(), errors);
                }
            }
            PinMethod::Cgroup => {
                self.revert_threads(s, &members, None, errors);
                if let Some(cg) = &rec.cgroup {
                    self.empty_job_cgroup(cg, &ppids, &origin, s, errors);
                }
            }
        }
    }

    /// Moves every process out of lodger's cgroup for a job back where it came from, then removes
    /// the cgroup, and lodger's parent if no other job uses it.
    fn empty_job_cgroup<'r>(
        &self,
        cg: &str,
        ppids: &[(u32, Option<u32>)],
        origin: &dyn Fn(u32, Option<u32>) -> Option<&'r TrackedProcess>,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) {
        let h = &*self.cpusets;
        if !h.exists(cg) {
            return;
        }
        // Processes forked while moving the others stay behind: look again, a few times.
        for _ in 0..4 {
            s.in_cgroup.clear();
            if let Err(e) = h.procs(cg, &mut s.in_cgroup) {
                if !e.is_gone() {
                    errors.push(e.into());
                }
                return;
            }
            if s.in_cgroup.is_empty() {
                break;
            }
            for &pid in &s.in_cgroup {
                let ppid = ppids
                    .iter()
                    .find(|(p, _)| *p == pid)
                    .and_then(|(_, pp)| *pp)
                    .or_else(|| s.reader.stat(pid).ok().flatten().map(|st| st.ppid));
                let mut dest = origin(pid, ppid)
                    .and_then(|t| t.original_cgroup.clone())
                    .unwrap_or_else(|| "/".to_string());
                // The original cgroup may be gone: its nearest existing ancestor.
                while dest != "/" && !h.exists(&dest) {
                    dest = parent_of(&dest).unwrap_or("/").to_string();
                }
                match h.attach(&dest, pid) {
                    Ok(()) => {}
                    Err(e) if e.is_gone() => {}
                    Err(e) => errors.push(e.into()),
                }
            }
        }
        if let Err(e) = h.remove(cg) {
            errors.push(e.into());
            return;
        }
        if let Some(parent) = parent_of(cg) {
            if parent != "/" {
                if let Err(e) = h.remove_if_unused(parent) {
                    errors.push(e.into());
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Threads

    /// Makes every thread of `pids` SCHED_RR (and, with `mask`, sets its affinity). Returns the
    /// pids that still exist.
    fn sweep_threads(
        &self,
        s: &mut Scratch,
        pids: &[u32],
        mask: Option<&CpuMask>,
        rr: &mut RrSweep<'_>,
    ) -> Vec<u32> {
        let mut alive = Vec::with_capacity(pids.len());
        for &pid in pids {
            s.tids.clear();
            match s.reader.threads(pid, &mut s.tids) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    rr.errors.push(e.into());
                    continue;
                }
            }
            let mut any = false;
            for &tid in &s.tids {
                if let Some(mask) = mask {
                    match sched::ensure_affinity(tid, mask) {
                        Ok(AffinityState::Changed) => rr.changed = true,
                        Ok(AffinityState::Already) => {}
                        Ok(AffinityState::Gone) => continue,
                        Err(e) => rr.errors.push(e.into()),
                    }
                }
                any |= rr.thread(pid, tid);
            }
            if any {
                alive.push(pid);
            }
        }
        alive
    }

    /// Returns the threads of `pids` to SCHED_OTHER (and, with `mask`, to that affinity).
    fn revert_threads(
        &self,
        s: &mut Scratch,
        pids: &[u32],
        mask: Option<&CpuMask>,
        errors: &mut Vec<EnforceError>,
    ) {
        for &pid in pids {
            s.tids.clear();
            match s.reader.threads(pid, &mut s.tids) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    errors.push(e.into());
                    continue;
                }
            }
            for &tid in &s.tids {
                if let Err(e) = sched::revert_rr(tid) {
                    errors.push(e.into());
                }
                if let Some(mask) = mask {
                    if let Err(e) = sched::ensure_affinity(tid, mask) {
                        errors.push(e.into());
                    }
                }
            }
        }
    }
}

fn mismatch(id: &JobId, recorded: &'static str, given: &'static str) -> EnforceError {
    EnforceError::RecordMismatch {
        id: id.to_string(),
        recorded,
        given,
    }
}

/// `current` if it is within `limit`; else what is left of it there, or all of `limit`.
fn within(current: &CpuSet, limit: &CpuSet) -> Option<CpuSet> {
    if current.is_subset(limit) {
        return None;
    }
    let kept = current.intersection(limit);
    Some(if kept.is_empty() { limit.clone() } else { kept })
}

/// Rescans /proc unless no task was created on the node since the last scan.
fn refresh_table(s: &mut Scratch) -> Result<(), EnforceError> {
    let key = s.reader.last_pid();
    if key.is_some() && key == s.table_key {
        return Ok(());
    }
    s.table_key = None;
    s.table.rescan(&mut s.reader)?;
    s.table_key = key;
    Ok(())
}

/// The SCHED_RR part of one apply: counts, errors, and what was learnt about RT budgets.
struct RrSweep<'a> {
    enforcer: &'a Enforcer,
    grants: &'a mut Vec<RtGrant>,
    /// `None` until a thread needs SCHED_RR; then whether the node refuses it.
    refused: Option<bool>,
    /// cpu cgroups found without an RT budget (and not granted one) in this apply.
    no_budget: Vec<String>,
    errors: Vec<EnforceError>,
    threads: u32,
    rr: u32,
    changed: bool,
}

impl<'a> RrSweep<'a> {
    fn new(enforcer: &'a Enforcer, grants: &'a mut Vec<RtGrant>) -> Self {
        Self {
            enforcer,
            grants,
            refused: None,
            no_budget: Vec::new(),
            errors: Vec::new(),
            threads: 0,
            rr: 0,
            changed: false,
        }
    }

    fn priority(&self) -> i32 {
        self.enforcer.settings.rt_priority
    }

    /// Read once per apply, and only when some thread needs changing: it can change at run time.
    fn refused(&mut self) -> bool {
        if let Some(r) = self.refused {
            return r;
        }
        let settings = &self.enforcer.settings;
        let r = !settings.allow_unthrottled_rt
            && match sched::node_rt_runtime_us(&settings.proc_root) {
                Ok(Some(-1)) => {
                    self.errors.push(
                        SchedError::RtUnthrottled {
                            file: settings.proc_root.join(sched::SCHED_RT_RUNTIME_SYSCTL),
                        }
                        .into(),
                    );
                    true
                }
                Ok(_) => false,
                Err(e) => {
                    self.errors.push(e.into());
                    false
                }
            };
        self.refused = Some(r);
        r
    }

    /// One thread; returns false when it is gone.
    fn thread(&mut self, pid: u32, tid: u32) -> bool {
        let priority = self.priority();
        match sched::needs_rr(tid, priority) {
            Ok(Some(RrState::Gone)) => return false,
            Ok(Some(_)) => {
                self.threads += 1;
                self.rr += 1;
                return true;
            }
            Ok(None) => {}
            Err(e) => {
                self.threads += 1;
                self.errors.push(e.into());
                return true;
            }
        }
        self.threads += 1;
        if self.refused() {
            return true;
        }
        match sched::set_rr(tid, priority) {
            Ok(RrState::Gone) => {
                self.threads -= 1;
                false
            }
            Ok(_) => {
                self.rr += 1;
                self.changed = true;
                true
            }
            Err(nix::errno::Errno::EPERM) => {
                self.on_eperm(pid, tid);
                true
            }
            Err(errno) => {
                self.errors.push(
                    SchedError::SetScheduler {
                        tid,
                        priority,
                        errno,
                        hint: "",
                    }
                    .into(),
                );
                true
            }
        }
    }

    /// EPERM with RT group scheduling means the thread's cpu cgroup has no RT budget: grant one
    /// when configured, else say which file to write.
    fn on_eperm(&mut self, pid: u32, tid: u32) {
        let priority = self.priority();
        let e = self.enforcer;
        let plain = |hint| -> EnforceError {
            SchedError::SetScheduler {
                tid,
                priority,
                errno: nix::errno::Errno::EPERM,
                hint,
            }
            .into()
        };
        let group = match e.rt_groups.group_of_thread(&e.settings.proc_root, pid, tid) {
            Ok(Some(g)) => g,
            Ok(None) => {
                self.errors
                    .push(plain(" (lodgerd needs CAP_SYS_NICE or root)"));
                return;
            }
            Err(err) => {
                self.errors.push(err.into());
                return;
            }
        };
        if self.no_budget.contains(&group) {
            return;
        }
        match e.rt_groups.budget(&group) {
            Ok(Some(0)) => {}
            Ok(_) => {
                self.errors.push(plain(
                    " (its cpu cgroup has an RT budget; lodgerd needs CAP_SYS_NICE or root)",
                ));
                return;
            }
            Err(err) => {
                self.errors.push(err.into());
                return;
            }
        }
        let Some(budget) = e.settings.grant_rt_budget_us else {
            self.errors.push(
                SchedError::RtGroupBudget {
                    file: e.rt_groups.budget_file(&group),
                }
                .into(),
            );
            self.no_budget.push(group);
            return;
        };
        let before = self.grants.len();
        let granted = e.rt_groups.grant(&group, budget, self.grants);
        if self.grants.len() > before {
            self.changed = true;
        }
        if let Err(err) = granted {
            self.errors.push(err.into());
            self.no_budget.push(group);
            return;
        }
        match sched::set_rr(tid, priority) {
            Ok(RrState::Gone) => self.threads -= 1,
            Ok(_) => {
                self.rr += 1;
                self.changed = true;
            }
            Err(errno) => self.errors.push(
                SchedError::SetScheduler {
                    tid,
                    priority,
                    errno,
                    hint: " (after granting an RT budget)",
                }
                .into(),
            ),
        }
    }
}
