//! Jobs Slurm registered through lodger's prolog (docs/slurm.md): their cgroup found as it
//! appears (`[slurm] cgroup_paths`), their processes pinned by CPU affinity inside the cpuset
//! Slurm gave the job, and Slurm's cgroup files never written: Slurm's task/cgroup plugin
//! rewrites `cpuset.cpus` at every step. A process the user or Slurm bound more narrowly than
//! the job's cpuset (`--cpu-bind`, task/affinity) keeps its binding and only gets the class.
//! Touches cgroupfs (reads only), /proc and sched_setaffinity.

use super::{EnforceError, Enforcer, Outcome, RrSweep, Scratch, SlurmJobRecord, TrackedProcess};
use crate::cpuset::CpuSet;
use crate::enforce::sched::{self, CpuMask};
use crate::enforce::TrainingClass;
use crate::job::SlurmJob;
use crate::sys::cgroupfs::{self as cgroup, CgroupError, CgroupVersion};

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

/// The inverse of [`candidates`]: the Slurm job whose cgroup, as one of `templates` names it,
/// holds cgroup `path`, and that cgroup. The job is named by its id, or `?` where the template
/// does not name it.
pub fn slurm_job_cgroup(templates: &[String], path: &str) -> Option<(String, String)> {
    let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    templates.iter().find_map(|template| {
        let pattern: Vec<&str> = template.split('/').filter(|c| !c.is_empty()).collect();
        if pattern.is_empty() || pattern.len() > parts.len() {
            return None;
        }
        let mut caught = Vec::new();
        for (p, c) in pattern.iter().zip(&parts) {
            if !component_matches(p, c, &mut caught) {
                return None;
            }
        }
        let job = caught
            .iter()
            .find(|(name, _)| *name == "job")
            .map_or("?".to_string(), |(_, v)| v.to_string());
        Some((job, format!("/{}", parts[..pattern.len()].join("/"))))
    })
}

/// Whether one cgroup name matches one component of a `slurm.cgroup_paths` template, each
/// `{name}` standing for one or more characters (digits for `{job}` and `{uid}`); what each
/// stood for is appended to `caught`.
fn component_matches<'p, 't>(
    pattern: &'p str,
    text: &'t str,
    caught: &mut Vec<(&'p str, &'t str)>,
) -> bool {
    let Some(open) = pattern.find('{') else {
        return pattern == text;
    };
    let (literal, rest) = pattern.split_at(open);
    let (Some(text), Some(close)) = (text.strip_prefix(literal), rest.find('}')) else {
        return false;
    };
    let (name, after) = (&rest[1..close], &rest[close + 1..]);
    let numeric = name == "job" || name == "uid";
    for end in (1..=text.len()).filter(|&e| text.is_char_boundary(e)) {
        let value = &text[..end];
        if numeric && !value.bytes().all(|b| b.is_ascii_digit()) {
            break;
        }
        let before = caught.len();
        caught.push((name, value));
        if component_matches(after, &text[end..], caught) {
            return true;
        }
        caught.truncate(before);
    }
    false
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
/// job's work, never given the job's class or CPUs. Named `slurmstepd` (its `comm`: also the
/// child it forks for a task, before that child's exec), and, so that a job's process cannot
/// opt out of lodger by calling itself `slurmstepd` (prctl, or a link or copy of its own by that
/// name):
/// - where lodgerd may read its program file (`/proc/PID/exe`), that file is named `slurmstepd`
///   (replaced since by an upgrade under running jobs included), owned by root, and writable by
///   root alone;
/// - where it may not (the packaged unit has no CAP_SYS_PTRACE: another uid's process, or a root
///   one with more capabilities, is closed to it), it runs as root, or is the child such a
///   daemon forked for a task, before its exec. A task itself calling itself `slurmstepd` then
///   passes for one.
fn slurm_daemon(proc_root: &std::path::Path, pid: u32) -> bool {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let dir = proc_root.join(pid.to_string());
    let named = |name: &[u8]| name == b"slurmstepd";
    let comm = |dir: &std::path::Path| {
        std::fs::read(dir.join("comm")).is_ok_and(|c| named(c.strip_suffix(b"\n").unwrap_or(&c)))
    };
    if !comm(&dir) {
        return false;
    }
    let exe = dir.join("exe");
    match std::fs::read_link(&exe) {
        Ok(path) => {
            // A binary replaced by an upgrade while it runs reads `... (deleted)`.
            path.file_name().is_some_and(|n| {
                let n = n.as_bytes();
                named(n.strip_suffix(b" (deleted)").unwrap_or(n))
            }) && std::fs::metadata(&exe).is_ok_and(|m| m.uid() == 0 && m.mode() & 0o022 == 0)
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let roots = |pid: u32| {
                crate::sys::procfs::uids(proc_root, pid).map(|(real, _)| real) == Some(0)
            };
            let parent = std::fs::read(dir.join("stat"))
                .ok()
                .and_then(|text| crate::sys::procfs::parse_stat(&text))
                .map(|st| st.ppid);
            roots(pid) || parent.is_some_and(|p| roots(p) && comm(&proc_root.join(p.to_string())))
        }
        Err(_) => false,
    }
}

impl Enforcer {
    /// The job's cgroup if it exists now: the recorded one, else the first of the configured
    /// paths that does, with its cpuset. `Ok(None)` when there is none (not yet, or gone); an
    /// error when the cgroup is there but its cpuset cannot be read, which says nothing about
    /// where the job may run (a cgroup without cpuset files, v2 without the controller, has no
    /// cpuset: `cpus` None).
    pub fn find_slurm(
        &self,
        job: &SlurmJob,
        rec: Option<&SlurmJobRecord>,
    ) -> Result<Option<SlurmCgroup>, CgroupError> {
        let h = &*self.cpusets;
        let recorded = rec.and_then(|r| r.cgroup.clone());
        let found = match recorded {
            Some(p) => h.exists(&p).then_some(p),
            None => candidates(&self.settings.slurm_cgroups, job, &short_hostname())
                .into_iter()
                .find(|p| h.exists(p)),
        };
        let Some(path) = found else {
            return Ok(None);
        };
        let read = match self.mode.version {
            CgroupVersion::V1 => h.read(&path, crate::enforce::cpusets::CpusetFile::Cpus),
            CgroupVersion::V2 => h.effective_cpus(&path),
        };
        let cpus = match read {
            Ok(c) => Some(c).filter(|c| !c.is_empty()),
            // Removed since it was seen: as if not seen.
            Err(CgroupError::Gone { .. }) => return Ok(None),
            // The cgroup is there, its cpuset file is not.
            Err(CgroupError::Read { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                None
            }
            Err(e) => return Err(e),
        };
        Ok(Some(SlurmCgroup { path, cpus }))
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
        let Some(found) = self.find_slurm(job, Some(rec))? else {
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
                // Lodger's own mask with no tracked parent: a child of a pinned process whose
                // parent exited before lodger saw it (a daemonizing tool), not a task the user
                // bound; it follows the job, and goes back to the job's cpuset.
                None if rec.was_pinned(&now) => (false, Some(job_cpus.clone())),
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

        rec.note_pinned(&want);
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
    /// The job's cgroups are read again, as apply reads them: a process forked since the last
    /// apply inherited its parent's class and mask and is given back its tracked ancestor's
    /// standing; one with no tracked ancestor (an orphan, reparented) only loses what lodger
    /// set: SCHED_RR at lodger's priority, and lodger's mask (for the job's cpuset).
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
        let mut in_cgroups = self.slurm_members(rec, s, errors);
        in_cgroups.sort_unstable();
        in_cgroups.dedup();
        let mut members = in_cgroups.clone();
        members.extend(rec.processes.iter().map(|p| p.pid));
        members.sort_unstable();
        members.dedup();
        for pid in members {
            let st = match s.reader.stat(pid) {
                Ok(Some(st)) if st.running => st,
                _ => continue,
            };
            let tracked = rec
                .processes
                .iter()
                .find(|p| p.pid == pid && p.start_time == st.start_time);
            let standing = match tracked {
                Some(p) => Some(p),
                // A tracked pid some other process holds now is not the job's.
                None if in_cgroups.binary_search(&pid).is_err() => continue,
                None if slurm_daemon(&self.settings.proc_root, pid) => continue,
                None => tracked_ancestor(rec, st.ppid, s),
            };
            let Some(p) = standing else {
                self.release_untracked(pid, rec, job_cpus.as_ref(), s, errors);
                continue;
            };
            let mask = if p.bound {
                None
            } else {
                p.original_affinity
                    .clone()
                    .or_else(|| job_cpus.clone())
                    .map(|c| CpuMask::from_cpuset(&c))
            };
            self.revert_threads(s, &[pid], mask.as_ref(), errors);
        }
    }

    /// Every process in the job's recorded cgroup and the cgroups below it (its steps); Slurm
    /// removes a step's (or the job's) cgroup as it ends: nothing left there.
    fn slurm_members(
        &self,
        rec: &SlurmJobRecord,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) -> Vec<u32> {
        match &rec.cgroup {
            Some(cg) => self.subtree_procs(cg, s, errors),
            None => Vec::new(),
        }
    }

    /// A process of the job lodger never saw and that descends from none it tracked: its
    /// threads lose SCHED_RR at lodger's priority, and it loses lodger's mask, when it has
    /// either (it can only have got them from a process lodger set them on).
    fn release_untracked(
        &self,
        pid: u32,
        rec: &SlurmJobRecord,
        job_cpus: Option<&CpuSet>,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) {
        s.tids.clear();
        if !matches!(s.reader.threads(pid, &mut s.tids), Ok(true)) {
            return;
        }
        let base = self.settings.rt_priority;
        let lodgers_class = matches!(self.settings.class, TrainingClass::Rr { .. })
            && s.tids.iter().any(|&tid| {
                sched::policy_of(tid).is_ok_and(|st| {
                    sched::is_rr(st, base) || sched::is_rr(st, base.saturating_add(1))
                })
            });
        let lodgers_mask = s
            .tids
            .iter()
            .any(|&tid| CpuMask::of_thread(tid).is_ok_and(|m| rec.was_pinned(&m.to_cpuset())));
        if !lodgers_class && !lodgers_mask {
            return;
        }
        let mask = job_cpus.filter(|_| lodgers_mask).map(CpuMask::from_cpuset);
        self.revert_threads(s, &[pid], mask.as_ref(), errors);
    }
}

/// The closest ancestor of a process whose parent is `ppid` that the job tracks (its standing
/// is the process's: it was forked from it, or from a child of it, since the last apply).
fn tracked_ancestor<'r>(
    rec: &'r SlurmJobRecord,
    mut ppid: u32,
    s: &mut Scratch,
) -> Option<&'r TrackedProcess> {
    // A job's process tree is shallow; a bound keeps a pid loop (a racing reuse) finite.
    for _ in 0..MAX_ANCESTRY {
        if ppid <= 1 {
            return None;
        }
        let st = s.reader.stat(ppid).ok().flatten()?;
        let found = rec
            .processes
            .iter()
            .find(|p| p.pid == ppid && p.start_time == st.start_time);
        if found.is_some() {
            return found;
        }
        ppid = st.ppid;
    }
    None
}

/// How far up [`tracked_ancestor`] looks.
const MAX_ANCESTRY: usize = 64;

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
