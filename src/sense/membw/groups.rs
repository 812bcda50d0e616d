//! Per-job monitoring groups (the only writes of memory-bandwidth sensing): [`MonGroup`]
//! (create, move threads in, remove) and [`JobMonGroups`], which keeps one group per job
//! (`lodger-<job>`) in step with the job's threads each sensing pass and turns the groups'
//! counters into bandwidth per job and per L3 domain; [`sweep_job_groups`] removes the groups of
//! an earlier lodgerd. Touches `[<control>/]mon_groups/lodger-*` under the resctrl root it is
//! given, and reads `/proc/PID/task`.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{Bandwidth, GroupId, MbmRates};
use crate::job::JobId;
use crate::sys::procfs::{ProcError, ProcReader};
use crate::sys::resctrlfs::{
    check_group_name, check_mounted, control_groups, read_optional_u32, read_tasks, remove_group,
    subdirs, write_tasks, GroupKind, ResctrlfsError, TaskMove, MON_GROUPS, NUM_RMIDS, TASKS,
};

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
    root: PathBuf,
    id: GroupId,
    path: PathBuf,
}

impl MonGroup {
    /// Makes `mon_groups/<name>` under `control` (`None`: the default group), or adopts it if
    /// it exists. `name` is a plain directory name (ASCII letters, digits, `-`, `_`, `.`).
    pub fn create(root: &Path, control: Option<&str>, name: &str) -> Result<Self, ResctrlfsError> {
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
        Ok(Self {
            root: root.to_path_buf(),
            id,
            path,
        })
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
    pub fn move_threads(&self, tids: &[u32]) -> Result<TaskMove, ResctrlfsError> {
        write_tasks(&self.root, &self.path.join(TASKS), GroupKind::Monitor, tids)
    }

    /// Moves every current thread of each process (from `<proc_root>/<pid>/task`). Threads
    /// started after this call inherit the group from the thread that creates them.
    pub fn move_processes(
        &self,
        proc_root: &Path,
        pids: &[u32],
    ) -> Result<TaskMove, ResctrlfsError> {
        let mut tids = Vec::new();
        let gone = ProcReader::new(proc_root)
            .threads_of(pids, &mut tids)
            .map_err(|e| match e {
                ProcError::Read { path, source } => ResctrlfsError::Io { path, source },
            })?;
        let mut done = self.move_threads(&tids)?;
        done.gone.extend(gone);
        Ok(done)
    }

    /// Makes sure each of `tids` is in the group, writing only those its `tasks` does not list,
    /// so a second call with the same threads writes nothing. `Ok(None)` when the group is gone
    /// (removed with its control group).
    pub fn keep_threads(&self, tids: &[u32]) -> Result<Option<TaskMove>, ResctrlfsError> {
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
    pub fn remove(self) -> Result<bool, ResctrlfsError> {
        remove_group(&self.path)
    }
}

/// A failed mkdir of a monitoring group, saying so when the kernel ran out of RMIDs (ENOSPC).
pub fn create_error(root: &Path, path: PathBuf, source: io::Error) -> ResctrlfsError {
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
    ResctrlfsError::Create { path, source, hint }
}

/// Removes `[<control>/]mon_groups/<name>` under `root`; `Ok(false)` when it does not exist.
pub fn remove_job_mon_group(
    root: &Path,
    control: Option<&str>,
    name: &str,
) -> Result<bool, ResctrlfsError> {
    check_group_name(name)?;
    if let Some(control) = control {
        check_group_name(control)?;
    }
    remove_group(&root.join(GroupId::monitor(control, name).relative_path()))
}

/// The TIDs listed in a group's `tasks` file, sorted; `None` when the group's directory is gone.
fn read_tids(path: &Path) -> Result<Option<Vec<u32>>, ResctrlfsError> {
    match read_tasks(path) {
        Ok(mut tids) => {
            tids.sort_unstable();
            Ok(Some(tids))
        }
        Err(ResctrlfsError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
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
    pub failed: Vec<ResctrlfsError>,
}

/// Removes every `lodger-*` monitoring group, under the default group and under each control
/// group: the groups of a lodgerd that stopped without removing them (killed, crashed). Their
/// threads go back to the control group they are in. Other monitoring groups are left alone.
pub fn sweep_job_groups(root: &Path) -> Result<Swept, ResctrlfsError> {
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
            match remove_group(&root.join(id.relative_path())) {
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
fn thread_controls(root: &Path) -> Result<BTreeMap<u32, String>, ResctrlfsError> {
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
    Box<dyn FnMut(&Path, Option<&str>, &str) -> Result<MonGroup, ResctrlfsError> + Send>;

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
fn control_vanished(root: &Path, control: Option<&str>, err: &ResctrlfsError) -> bool {
    matches!(err, ResctrlfsError::Create { source, .. } if source.kind() == io::ErrorKind::NotFound)
        && control.is_some_and(|c| !root.join(c).is_dir())
}
