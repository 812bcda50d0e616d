//! Jobs Slurm registered through lodger's prolog (docs/slurm.md): their cgroup found as it
//! appears (`[slurm] cgroup_paths`), their processes pinned by CPU affinity inside the cpuset
//! Slurm gave the job, and Slurm's cgroup files never written: Slurm's task/cgroup plugin
//! rewrites `cpuset.cpus` at every step. A process the user or Slurm bound more narrowly than
//! the job's cpuset (`--cpu-bind`, task/affinity) keeps its binding and only gets the class.
//! Touches cgroupfs (reads only), /proc and sched_setaffinity.

use super::{EnforceError, Enforcer, Outcome, RrSweep, Scratch, SlurmJobRecord, TrackedProcess};
use crate::cpuset::CpuSet;
use crate::enforce::sched::CpuMask;
use crate::job::SlurmJob;
use crate::sys::cgroupfs::{self as cgroup, CgroupVersion};

/// Where a Slurm job's cgroup is, once it exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmCgroup {
    /// Relative to the cpuset hierarchy (v1) or the unified root (v2).
    pub path: String,
    /// The CPUs Slurm gave the job (its effective cpuset); `None` where the cgroup has no cpuset
    /// (task/cgroup without `ConstrainCores`): the job may run anywhere.
    pub cpus: Option<CpuSet>,
}

/// The cgroup paths `templates` name for `job`: `{job}` the job id, `{uid}` the owner's uid,
/// `{node}` the Slurm node name (the job's, else `host`). A template that is not an absolute
/// path, or climbs with `..`, names nothing.
pub fn candidates(templates: &[String], job: &SlurmJob, host: &str) -> Vec<String> {
    let node = job.node.as_deref().unwrap_or(host);
    templates
        .iter()
        .filter_map(|t| {
            if t.contains("{node}") && !crate::job::valid_node_name(node) {
                return None;
            }
            let p = t
                .replace("{job}", &job.job_id.to_string())
                .replace("{uid}", &job.uid.to_string())
                .replace("{node}", node);
            let ok = p.starts_with('/')
                && !p.contains('{')
                && !p.split('/').any(|c| c == ".." || c == ".");
            ok.then(|| cgroup::normalize(&p).ok()).flatten()
        })
        .filter(|p| p != "/")
        .collect()
}

/// The host's name up to the first dot (`hostname -s`): Slurm's node name unless slurm.conf
/// says otherwise.
pub fn short_hostname() -> String {
    // The UTS name, as gethostname(2) gives it.
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().split('.').next().unwrap_or("").to_string())
        .unwrap_or_default()
}

/// Slurm's own step daemon, which Slurm puts in the job's cgroups (v2: `step_<n>/slurm`): not the
/// job's work, never given the job's class or CPUs.
fn slurm_daemon(proc_root: &std::path::Path, pid: u32) -> bool {
    std::fs::read(proc_root.join(pid.to_string()).join("comm"))
        .is_ok_and(|c| c.strip_suffix(b"\n").unwrap_or(&c) == b"slurmstepd")
}

impl Enforcer {
    /// The job's cgroup if it exists now: the recorded one, else the first of the configured
    /// paths that does.
    pub fn find_slurm(&self, job: &SlurmJob, rec: Option<&SlurmJobRecord>) -> Option<SlurmCgroup> {
        let h = &*self.cpusets;
        let recorded = rec.and_then(|r| r.cgroup.clone());
        let path = match recorded {
            Some(p) => h.exists(&p).then_some(p)?,
            None => candidates(&self.settings.slurm_cgroups, job, &short_hostname())
                .into_iter()
                .find(|p| h.exists(p))?,
        };
        let cpus = match self.mode.version {
            CgroupVersion::V1 => h.read(&path, crate::enforce::cpusets::CpusetFile::Cpus),
            CgroupVersion::V2 => h.effective_cpus(&path),
        }
        .ok()
        .filter(|c| !c.is_empty());
        Some(SlurmCgroup { path, cpus })
    }

    /// Pins every process of the job's cgroup (and its steps') to `cpus` within the job's cpuset
    /// and sweeps the class over their threads. Before the cgroup exists the job waits
    /// (`out.waiting`); once it existed, its removal ends the job.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_slurm(
        &self,
        job: &SlurmJob,
        cpus: &CpuSet,
        slot: &mut Option<SlurmJobRecord>,
        s: &mut Scratch,
        rr: &mut RrSweep<'_>,
        out: &mut Outcome,
    ) -> Result<(), EnforceError> {
        let h = &*self.cpusets;
        let rec = slot.get_or_insert_with(SlurmJobRecord::default);
        let Some(found) = self.find_slurm(job, Some(rec)) else {
            if rec.cgroup.is_some() {
                // Slurm removed it: the job ended (its epilog may never run).
                out.alive = false;
            } else {
                out.alive = true;
                out.waiting = Some(format!(
                    "waiting for Slurm's cgroup of job {} (looked for {})",
                    job.job_id,
                    candidates(&self.settings.slurm_cgroups, job, &short_hostname()).join(", ")
                ));
            }
            return Ok(());
        };
        rec.cgroup = Some(found.path.clone());
        // Only ever inside what Slurm gave the job.
        let job_cpus = found.cpus.clone().unwrap_or_else(|| cpus.clone());
        let mut want = cpus.intersection(&job_cpus);
        if want.is_empty() {
            want = job_cpus.clone();
        }

        s.cgroups.clear();
        s.cgroups.push(found.path.clone());
        let mut i = 0;
        while i < s.cgroups.len() {
            let parent = s.cgroups[i].clone();
            // A step removed meanwhile is normal; the job's own cgroup is looked for again.
            let _ = h.children(&parent, &mut s.cgroups);
            i += 1;
        }
        let mut pids = Vec::new();
        for c in &s.cgroups {
            let _ = h.procs(c, &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();

        // Track them: a new process inherits its tracked parent's binding (a child of a pinned
        // process carries lodger's mask); any other is bound when its mask is narrower than the
        // job's cpuset (the user's --cpu-bind, or Slurm's task/affinity).
        let mut tracked: Vec<TrackedProcess> = Vec::with_capacity(pids.len());
        for &pid in &pids {
            let Ok(Some(st)) = s.reader.stat(pid) else {
                continue;
            };
            if !st.running {
                continue;
            }
            if let Some(p) = rec
                .processes
                .iter()
                .find(|p| p.pid == pid && p.start_time == st.start_time)
            {
                tracked.push(p.clone());
                continue;
            }
            if slurm_daemon(&self.settings.proc_root, pid) {
                continue;
            }
            let Ok(mask) = CpuMask::of_thread(pid) else {
                continue;
            };
            let now = mask.to_cpuset();
            let parent = rec
                .processes
                .iter()
                .chain(tracked.iter())
                .find(|p| p.pid == st.ppid)
                .cloned();
            let (bound, original) = match parent {
                Some(p) => (p.bound, p.original_affinity.clone().or(Some(now))),
                None => (now.is_subset(&job_cpus) && now != job_cpus, Some(now)),
            };
            tracked.push(TrackedProcess {
                pid,
                start_time: st.start_time,
                ppid: st.ppid,
                original_cgroup: None,
                original_memory_cgroup: None,
                original_affinity: original,
                bound,
            });
        }
        tracked.sort_unstable_by_key(|p| p.pid);
        rec.processes = tracked;

        let mask = CpuMask::from_cpuset(&want);
        let pinned: Vec<u32> = rec
            .processes
            .iter()
            .filter(|p| !p.bound)
            .map(|p| p.pid)
            .collect();
        let bound: Vec<u32> = rec
            .processes
            .iter()
            .filter(|p| p.bound)
            .map(|p| p.pid)
            .collect();
        let mut alive = self.sweep_threads(s, &pinned, Some(&mask), rr);
        alive.extend(self.sweep_threads(s, &bound, None, rr));
        alive.sort_unstable();
        rec.processes
            .retain(|p| alive.binary_search(&p.pid).is_ok());
        out.pids = alive;
        out.bound = u32::try_from(bound.len()).unwrap_or(u32::MAX);
        // The job lives as long as its cgroup: between steps it may hold no process.
        out.alive = true;
        Ok(())
    }

    /// Threads back to SCHED_OTHER and every pinned process back to the mask it had (or to the
    /// job's whole cpuset); Slurm's cgroup files were never written, so nothing else to undo.
    pub(super) fn release_slurm(
        &self,
        rec: &SlurmJobRecord,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) {
        let h = &*self.cpusets;
        let job_cpus = rec.cgroup.as_deref().and_then(|p| match self.mode.version {
            CgroupVersion::V1 => h.read(p, crate::enforce::cpusets::CpusetFile::Cpus).ok(),
            CgroupVersion::V2 => h.effective_cpus(p).ok(),
        });
        for p in &rec.processes {
            match s.reader.stat(p.pid) {
                Ok(Some(st)) if st.running && st.start_time == p.start_time => {}
                _ => continue,
            }
            let mask = if p.bound {
                None
            } else {
                p.original_affinity
                    .clone()
                    .or_else(|| job_cpus.clone())
                    .map(|c| CpuMask::from_cpuset(&c))
            };
            self.revert_threads(s, &[p.pid], mask.as_ref(), errors);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn job(id: u64, uid: u32) -> SlurmJob {
        SlurmJob {
            job_id: id,
            uid,
            node: None,
        }
    }

    #[test]
    fn the_default_templates_name_slurms_v1_and_v2_job_cgroups() {
        let t: Vec<String> = crate::enforce::DEFAULT_SLURM_CGROUPS
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            candidates(&t, &job(42, 1000), "gpu7"),
            [
                "/system.slice/slurmstepd.scope/job_42",
                "/system.slice/gpu7_slurmstepd.scope/job_42",
                "/slurm/uid_1000/job_42",
                "/slurm_gpu7/uid_1000/job_42",
            ]
        );
        // The prolog's SLURMD_NODENAME wins over the host name; a name that could climb out of
        // the hierarchy drops the templates that use it.
        let mut named = job(42, 1000);
        named.node = Some("node-3".into());
        assert_eq!(
            candidates(&t, &named, "gpu7")[1],
            "/system.slice/node-3_slurmstepd.scope/job_42"
        );
        assert_eq!(candidates(&t, &job(42, 1000), "..").len(), 2);
    }

    #[test]
    fn templates_that_escape_or_name_the_root_name_nothing() {
        let t: Vec<String> = [
            "/slurm/../etc/job_{job}",
            "relative/job_{job}",
            "/",
            "/slurm/{unknown}/job_{job}",
            "/slurm_node7//uid_{uid}/job_{job}/",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            candidates(&t, &job(7, 0), "h"),
            ["/slurm_node7/uid_0/job_7"]
        );
    }
}
