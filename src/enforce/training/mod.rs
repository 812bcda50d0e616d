//! Making the node match the plan for training jobs: each job's placement (a cpuset cgroup, or CPU
//! affinity) and SCHED_RR on every thread, idempotently, with a [`JobRecord`] of everything changed
//! so that [`Enforcer::release`] can undo it, also after a lodgerd restart. Touches cgroupfs, /proc,
//! sched_setscheduler and sched_setaffinity, through the submodules.
//!
//! `apply` runs every tick for every job. Where the kernel's process events can be read, a job
//! none of whose processes forked, exec'd or exited since its last full sweep is skipped
//! (`enforce::quiet`: one full sweep per `quiet::FULL_SWEEP_EVERY` remains as the safety net).
//! Otherwise its steady path (nothing to change) only reads: the
//! job's cpuset files or thread masks, `/proc/PID/stat` of each known process, `/proc/PID/task`, two
//! scheduler queries per thread. A pid job's descendants come from the process table
//! (`quiet::Quiet::table`), looked in with affinity pinning at every sweep, with cgroup pinning
//! only after processes were moved (a child forked during the move stays outside). Where the
//! process events are read the table follows them, and /proc is read in full only when events
//! were lost and once per `quiet::FULL_SWEEP_EVERY`; without them, whenever a task was created
//! on the node since the last read (`/proc/loadavg`). Timing `apply` on an enforced job times
//! the sweep.
//!
//! Rooms: `cgroup_jobs` (jobs registered by cgroup), `pid_jobs` (jobs registered by pids),
//! `memory` (the memory files of the job cgroups lodger creates on v2),
//! `rr` (the SCHED_RR sweep over every thread), [`rtgroup`] (v1 RT budgets), [`record`] and
//! [`error`]. May touch `sys/`, `enforce::{cpusets, sched, procs}`; nothing above enforce.

mod cgroup_jobs;
pub mod error;
mod memory;
mod pid_jobs;
pub mod record;
pub(crate) mod roles;
mod rr;
pub mod rtgroup;
pub mod slurm_jobs;

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tracing::{debug, warn};

pub use self::error::EnforceError;
pub use self::record::{
    CgroupJobRecord, JobRecord, PidJobRecord, RootProcess, SavedCpuset, SlurmJobRecord,
    TrackedProcess,
};
use self::rr::RrSweep;
use self::rtgroup::RtGroups;
pub use self::slurm_jobs::{slurm_job_cgroup, SlurmCgroup};
use super::cpusets::{self, CpusetFile, CpusetHierarchy};
use super::quiet;
use super::sched;
use super::{EnforceSettings, PidPinning, PinMethod, TrainingClass};
use crate::cpuset::CpuSet;
use crate::job::{JobId, Target};
use crate::sys::cgroupfs::{self as cgroup, CgroupError, CgroupVersion};
use crate::sys::procfs::{ProcError, ProcReader};

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
    /// Threads in the configured class: SCHED_RR at the configured priority (or one above, by
    /// role), or SCHED_OTHER at the configured nice under `policy = "other"`.
    pub rr_threads: u32,
    /// False when no process of the job is left (a Slurm job: when its cgroup is gone).
    pub alive: bool,
    pub warnings: Vec<String>,
    /// A Slurm job whose cgroup does not exist yet: what it waits for.
    pub waiting: Option<String>,
    /// Processes bound more narrowly by their user, left on their CPUs (Slurm jobs).
    pub bound: u32,
}

impl Outcome {
    /// This outcome as an apply skipped by `enforce::quiet` reports it again: nothing written,
    /// and no warning said twice.
    pub fn again(&self) -> Outcome {
        Outcome {
            changed: false,
            warnings: Vec::new(),
            ..self.clone()
        }
    }
}

/// Buffers kept between applies, so the steady path does not allocate per process or thread.
#[derive(Debug)]
struct Scratch {
    reader: ProcReader,
    /// When the apply under way began (events read since count as after its sweep).
    began: std::time::Instant,
    tids: Vec<u32>,
    in_cgroup: Vec<u32>,
    cgroups: Vec<String>,
    roles: roles::ThreadRoles,
    quiet: quiet::Quiet,
    /// Where the kernel lists each thread's children: a pid job's descendants are walked through
    /// them when `quiet`'s process table would have to be read from /proc in full first (see
    /// `descendants`).
    walk_children: bool,
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
    /// v1 with a batch memory limit: the memory hierarchy job cgroups get twins in.
    memory_twins: Option<std::path::PathBuf>,
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
            if !settings.allow_unthrottled_rt && matches!(settings.class, TrainingClass::Rr { .. })
            {
                warn!(
                    "kernel.sched_rt_runtime_us is -1: SCHED_RR will be refused for training jobs \
                     (set training.allow_unthrottled_rt = true to allow it)"
                );
            }
        }
        let rt_groups = RtGroups::new(&settings.cgroup_root);
        let mut reader = ProcReader::new(&settings.proc_root);
        let walk_children = reader.lists_children();
        let scratch = Scratch {
            walk_children,
            reader,
            began: std::time::Instant::now(),
            tids: Vec::new(),
            in_cgroup: Vec::new(),
            cgroups: Vec::new(),
            roles: roles::ThreadRoles::new(&settings.proc_root),
            // Events speak of the node's processes: a fake proc tree (tests) has none.
            // Only the jobs' processes' events where their trees can be walked (see
            // `descendants`).
            quiet: quiet::Quiet::new(
                settings.process_events
                    && settings.proc_root.as_path()
                        == std::path::Path::new(crate::sys::procfs::DEFAULT_PROC_ROOT),
                walk_children,
            ),
        };
        Ok(Enforcer {
            mode: CgroupMode {
                version,
                pid_pinning,
            },
            cpusets,
            rt_groups,
            parent,
            memory_twins: memory::memory_twins(&settings, version),
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

    /// Whether an [`Self::apply`] now would be skipped (nothing the job depends on changed since
    /// its last sweep, `enforce::quiet`) with an outcome of which `shows` is true: the caller
    /// then has nothing to do for the job. Writes nothing.
    pub fn settled(
        &self,
        id: &JobId,
        target: &Target,
        cpus: &CpuSet,
        mems: &CpuSet,
        record: &JobRecord,
        shows: &dyn Fn(&Outcome) -> bool,
    ) -> bool {
        let mut guard = self.scratch();
        let now = std::time::Instant::now();
        self.quiet_outcome(&mut guard, id, target, cpus, mems, record, now)
            .is_some_and(shows)
    }

    /// The job's last outcome when `enforce::quiet` lets an apply skip it now.
    #[allow(clippy::too_many_arguments)]
    fn quiet_outcome<'s>(
        &self,
        s: &'s mut Scratch,
        id: &JobId,
        target: &Target,
        cpus: &CpuSet,
        mems: &CpuSet,
        record: &JobRecord,
        now: std::time::Instant,
    ) -> Option<&'s Outcome> {
        let asked = quiet::Asked {
            cpus,
            mems,
            memory_max: record.memory_max,
        };
        let roles = matches!(self.settings.class, TrainingClass::Rr { roles: true });
        s.quiet.settled(
            id,
            target,
            &asked,
            Some(&*self.cpusets),
            roles.then_some(&mut s.roles),
            &mut s.in_cgroup,
            now,
        )
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
        let now = std::time::Instant::now();
        if let Some(last) = self.quiet_outcome(s, id, target, cpus, mems, record, now) {
            return Ok(last.again());
        }
        s.began = now;
        let asked = quiet::Asked {
            cpus,
            mems,
            memory_max: record.memory_max,
        };
        let mut out = Outcome::default();
        let JobRecord {
            cgroup: cgroup_rec,
            pids: pid_rec,
            slurm: slurm_rec,
            rt_grants,
            memory_max,
            authorized,
        } = record;
        let mut rr = RrSweep::new(self, rt_grants);
        let placed = match target {
            Target::Cgroup(path) => {
                if pid_rec.is_some() {
                    return Err(mismatch(id, "pids", "cgroup"));
                }
                self.apply_cgroup(path, cpus, mems, cgroup_rec, s, &mut rr, &mut out)
            }
            Target::Container(c) => {
                if pid_rec.is_some() {
                    return Err(mismatch(id, "pids", "container"));
                }
                if cgroup_rec.is_none()
                    && !self
                        .cpusets
                        .exists(&crate::sys::cgroupfs::normalize(&c.cgroup)?)
                {
                    // Registered at creation (docs/kubernetes.md): the runtime makes the
                    // cgroup, on the cpuset lodger gave it, when it starts the container.
                    out.alive = true;
                    out.waiting = Some(format!(
                        "waiting for the runtime to start container {}",
                        c.label()
                    ));
                    Ok(())
                } else {
                    let first = cgroup_rec.is_none();
                    let applied =
                        self.apply_cgroup(&c.cgroup, cpus, mems, cgroup_rec, s, &mut rr, &mut out);
                    if let (true, Some(rec)) = (first, cgroup_rec.as_mut()) {
                        self.container_goes_back_to_its_parent(rec);
                    }
                    if applied.is_ok() && !out.alive {
                        // Made but not started, or between its processes: a container's end
                        // is its cgroup's removal (or the runtime's stop event), not a pause.
                        out.alive = true;
                        out.waiting =
                            Some(format!("container {} has no process running", c.label()));
                    }
                    applied
                }
            }
            Target::Instances => return Err(EnforceError::NotPinned),
            Target::Slurm(job) => self.apply_slurm(job, cpus, slurm_rec, s, &mut rr, &mut out),
            Target::Pids(roots) => {
                if cgroup_rec.is_some() {
                    return Err(mismatch(id, "cgroup", "pids"));
                }
                let memory_max = *memory_max;
                self.apply_pids(
                    id, roots, authorized, cpus, mems, memory_max, pid_rec, s, &mut rr, &mut out,
                )
            }
        };
        out.changed |= rr.changed;
        out.threads = rr.threads;
        out.rr_threads = rr.rr;
        let mut errors = rr.errors;
        let latency = rr.latency;
        if let Err(e) = placed {
            s.quiet.forget(id);
            if errors.is_empty() {
                return Err(e);
            }
            errors.insert(0, e);
        }
        if let Err(e) = EnforceError::collect(errors) {
            s.quiet.forget(id);
            return Err(e);
        }
        if out.alive && out.waiting.is_none() && out.bound == 0 {
            s.quiet
                .remember(id, target, &asked, &out, latency, Some(&*self.cpusets), now);
        } else {
            s.quiet.forget(id);
        }
        Ok(out)
    }

    /// For the spine benchmark's baseline only: with `true`, pid jobs' descendants are found as
    /// before the process table followed the process events, in a /proc read again whenever a
    /// task was created on the node since the last.
    #[doc(hidden)]
    pub fn descendants_by_last_pid(&self, on: bool) {
        let mut s = self.scratch();
        s.quiet.keep_table_by_last_pid(on);
        s.walk_children = !on && s.reader.lists_children();
    }

    /// For the spine benchmark's baseline only: with `true`, pid jobs' descendants always come
    /// from the process table, read from /proc in full when it is not fresh, as before the
    /// walk, even where the kernel lists each thread's children.
    #[doc(hidden)]
    pub fn descendants_from_table(&self, on: bool) {
        let mut s = self.scratch();
        s.walk_children = !on && s.reader.lists_children();
    }

    /// For the spine benchmark's comparison only: every process's events are read, as before
    /// they were narrowed to the jobs' processes in the kernel (`sys::procwatch`).
    #[doc(hidden)]
    pub fn read_every_process_event(&self) {
        self.scratch().quiet.read_every_process_event();
    }

    /// How many times every job was swept again since this enforcer was made (process events
    /// lost or cut short, the watch lost or loaded again), for the spine benchmark.
    #[doc(hidden)]
    pub fn events_started_over(&self) -> u64 {
        self.scratch().quiet.start_overs()
    }

    /// Whether only the jobs' processes' events are read (`sys::procwatch`).
    #[doc(hidden)]
    pub fn watches_jobs_in_the_kernel(&self) -> bool {
        self.scratch().quiet.watching()
    }

    /// Whether applies skip the jobs nothing happened to (the kernel's process events are read).
    pub fn event_driven(&self) -> bool {
        self.scratch().quiet.enabled()
    }

    /// lodger's cgroups for jobs (`<parent>/j<N>`) whose job `known` does not know, as a lost or
    /// set-aside state file leaves them (a corrupt one, or a newer lodgerd's after a downgrade):
    /// each is released as an interrupted registration is (its threads back to SCHED_OTHER, its
    /// processes to the hierarchy's root, whose cgroup lodger never recorded, the cgroup
    /// removed), so no process stays real-time or confined with no job, and no new job with the
    /// same id adopts them. Returns each one's id and what went wrong releasing it, if anything.
    pub fn release_orphans(
        &self,
        known: &dyn Fn(&JobId) -> bool,
    ) -> Vec<(JobId, Result<(), EnforceError>)> {
        let mut children = Vec::new();
        if let Err(e) = self.cpusets.children(&self.parent, &mut children) {
            if !e.is_gone() {
                tracing::warn!("cannot list lodger's cgroups under {}: {e}", self.parent);
            }
            return Vec::new();
        }
        let mut released = Vec::new();
        for cgroup in children {
            let Some(id) = cgroup.rsplit('/').next().and_then(JobId::parse) else {
                continue;
            };
            if known(&id) {
                continue;
            }
            let record = JobRecord {
                pids: Some(PidJobRecord {
                    pinning: PinMethod::Cgroup,
                    cgroup: Some(cgroup),
                    ..PidJobRecord::default()
                }),
                ..JobRecord::default()
            };
            let result = self.release(&id, &Target::Pids(Vec::new()), &record);
            released.push((id, result));
        }
        released
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
        s.quiet.forget(id);
        let mut errors = Vec::new();
        if let Some(rec) = &record.cgroup {
            self.release_cgroup(rec, s, &mut errors);
        }
        if let Some(rec) = &record.pids {
            self.release_pids(rec, s, &mut errors);
        }
        if let Some(rec) = &record.slurm {
            self.release_slurm(rec, s, &mut errors);
        }
        if record.cgroup.is_none() && record.pids.is_none() && record.slurm.is_none() {
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

/// Appends to `out` the descendants of `known` not in it yet, from the process table as it is
/// now (`quiet::Quiet::table`: kept in step by the process events where they are read, else
/// /proc read again whenever a task was created on the node since the last read). Where the
/// table would first have to be read from /proc in full (never read, or not fresh: a
/// registration after a quiet spell, when no sweep has used the table for
/// `quiet::FULL_SWEEP_EVERY`) for a one-off look (`once`: a job's first apply, its release)
/// and the kernel lists each thread's children, the job's tree is walked instead
/// (`ProcReader::descendants`): its own threads read, not every process of the node. The
/// sweeps of a job pinned by affinity, which look every time, keep using the table (and so
/// keep it fresh).
///
/// Where only the jobs' processes' events are read (`quiet::Quiet::watching`), the table knows
/// of a process's children only from the time it is watched: the job's processes are watched
/// here, before anything is pinned, and the trees of those not watched before (a job's first
/// apply, a process found by the safety net's read of /proc) are walked through /proc, each
/// process watched before its children are read. A child forked after its parent is watched is
/// reported (the kernel watches it as it forks); one forked before is found by the walk.
fn descendants(
    s: &mut Scratch,
    known: &[u32],
    out: &mut Vec<u32>,
    once: bool,
) -> Result<(), EnforceError> {
    let began = s.began;
    let mut new = Vec::new();
    s.quiet.watch(known, began, &mut new);
    if once && s.walk_children && !s.quiet.table_is_fresh(began) {
        return walk_watching(s, known, out);
    }
    let before = out.len();
    s.quiet.table(&mut s.reader, began)?.descendants(known, out);
    s.quiet.watch(&out[before..], began, &mut new);
    if !new.is_empty() && s.quiet.watching() {
        walk_watching(s, &new, out)?;
    }
    Ok(())
}

/// Appends to `out` the descendants of `roots` not in it yet, walked through /proc, each process
/// watched (`quiet::Quiet::watch`) before its children are read.
fn walk_watching(s: &mut Scratch, roots: &[u32], out: &mut Vec<u32>) -> Result<(), EnforceError> {
    let (began, quiet) = (s.began, &mut s.quiet);
    s.reader.walk_tree(roots, out, |pid, _| {
        quiet.watch(&[pid], began, &mut Vec::new());
        Ok::<(), EnforceError>(())
    })
}
