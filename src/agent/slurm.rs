//! Slurm jobs' cgroups as one tick sees them (docs/slurm.md): found with their cpuset, still
//! awaited after the prolog registered them, gone (the job ended, even if its epilog never
//! ran), or there with a cpuset that cannot be read (the last tick's view kept). Read once a
//! tick, before placement, through enforcement's `find_slurm` (handed in); changes nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use tracing::{info, warn};

use crate::cpuset::CpuSet;
use crate::enforce::{JobRecord, SlurmCgroup};
use crate::job::{JobId, JobKind, SlurmJob, Target};
use crate::store::State;
use crate::sys::cgroupfs::CgroupError;

/// One Slurm job's cgroup this tick.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Found(SlurmCgroup),
    /// Not there yet: why, or (after `slurm.appear_timeout_seconds`) why the job is dropped.
    Awaited(Result<String, String>),
    /// Found before, gone now: the job ended.
    Gone(String),
    /// There, but its cpuset could not be read: why, and the cgroup as last found (placed by
    /// that meanwhile), or None when it never was (the job waits).
    Unreadable(String, Option<SlurmCgroup>),
}

/// Every registered Slurm job's cgroup as seen this tick; jobs of other targets are absent.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlurmSeen(BTreeMap<JobId, Seen>);

impl SlurmSeen {
    /// Looks for every Slurm job's cgroup with `find` (the enforcer's). `now_s` and `timeout`
    /// decide when an awaited cgroup is given up on; `last` is the previous tick's view, kept for
    /// a job whose cpuset cannot be read now (a passing read error neither ends the job nor
    /// moves it).
    pub(super) fn look(
        find: impl Fn(&SlurmJob, &JobRecord) -> Result<Option<SlurmCgroup>, CgroupError>,
        state: &State,
        last: &SlurmSeen,
        now_s: u64,
        timeout: Duration,
    ) -> Self {
        let mut seen = BTreeMap::new();
        for s in state.jobs.values() {
            let Target::Slurm(job) = &s.job.spec.target else {
                continue;
            };
            let id = &s.job.id;
            let found_before = s.record.slurm.as_ref().is_some_and(|r| r.cgroup.is_some());
            let this = match find(job, &s.record) {
                // A training job needs a count to be placed by where Slurm confines no cores; a
                // batch job takes the leftover cores and needs none (the prolog sends none).
                Ok(Some(cg))
                    if cg.cpus.is_none()
                        && s.job.spec.kind == JobKind::Training
                        && s.job.spec.cores == 0 =>
                {
                    Seen::Awaited(Ok(format!(
                        "Slurm job {}'s cgroup {} has no cpuset (task/cgroup without \
                         ConstrainCores) and the prolog named no core count: nothing to place by",
                        job.job_id, cg.path
                    )))
                }
                Ok(Some(cg)) => {
                    if matches!(last.0.get(id), Some(Seen::Unreadable(..))) {
                        info!(job = %id, "Slurm job {}'s cpuset is readable again", job.job_id);
                    }
                    Seen::Found(cg)
                }
                Ok(None) if found_before => Seen::Gone(format!(
                    "Slurm removed job {}'s cgroup (the job ended on this node)",
                    job.job_id
                )),
                Ok(None) => {
                    let waited = now_s.saturating_sub(s.job.registered_at);
                    Seen::Awaited(if waited > timeout.as_secs() {
                        Err(format!(
                            "Slurm job {}'s cgroup did not appear within {} s \
                             (slurm.appear_timeout_seconds)",
                            job.job_id,
                            timeout.as_secs()
                        ))
                    } else {
                        Ok(format!(
                            "waiting for Slurm job {}'s cgroup to appear ({waited} s)",
                            job.job_id
                        ))
                    })
                }
                Err(e) => {
                    let kept = match last.0.get(id) {
                        Some(Seen::Found(cg)) | Some(Seen::Unreadable(_, Some(cg))) => {
                            Some(cg.clone())
                        }
                        _ => None,
                    };
                    let why = format!(
                        "cannot read Slurm job {}'s cpuset ({e}); {}, and tried again every tick",
                        job.job_id,
                        if kept.is_some() {
                            "the job stays where it was"
                        } else {
                            "the job waits"
                        }
                    );
                    if !matches!(last.0.get(id), Some(Seen::Unreadable(..))) {
                        warn!(job = %id, "{why}");
                    }
                    Seen::Unreadable(why, kept)
                }
            };
            seen.insert(id.clone(), this);
        }
        Self(seen)
    }

    /// A Slurm job that cannot be placed this tick: `Ok(why it waits)`, or `Err(why it is
    /// over)` (its cgroup is gone, or never came).
    pub(crate) fn waiting(&self, id: &JobId) -> Option<Result<String, String>> {
        match self.0.get(id)? {
            Seen::Found(_) | Seen::Unreadable(_, Some(_)) => None,
            Seen::Awaited(r) => Some(r.clone()),
            Seen::Unreadable(why, None) => Some(Ok(why.clone())),
            Seen::Gone(why) => Some(Err(why.clone())),
        }
    }

    /// Whether the job is a Slurm job not placed this tick.
    pub(crate) fn waits(&self, id: &JobId) -> bool {
        self.waiting(id).is_some()
    }

    /// The job's cgroup as found this tick, or as last found when its cpuset cannot be read now.
    fn found(&self, id: &JobId) -> Option<&SlurmCgroup> {
        match self.0.get(id)? {
            Seen::Found(cg) | Seen::Unreadable(_, Some(cg)) => Some(cg),
            _ => None,
        }
    }

    /// The cpuset Slurm confines the job to, when it is a Slurm job with one.
    pub(crate) fn cpus(&self, id: &JobId) -> Option<CpuSet> {
        self.found(id)?.cpus.clone()
    }

    /// The job's cgroup, once found (for sensing and network shaping).
    pub(crate) fn cgroup(&self, id: &JobId) -> Option<&str> {
        Some(&self.found(id)?.path)
    }
}
