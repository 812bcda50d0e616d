//! Training jobs registered by pids: every process of the job (the roots and their descendants,
//! told apart from reused pids by start time) pinned by lodger's own cgroup or by CPU affinity,
//! and put back as it was on release. Touches /proc, the cpuset hierarchy and sched_setaffinity.

use std::collections::HashSet;

use tracing::warn;

use super::{
    descendants, EnforceError, Enforcer, Outcome, PidJobRecord, RootProcess, RrSweep, Scratch,
    TrackedProcess,
};
use crate::cpuset::CpuSet;
use crate::enforce::cpusets::{self, CpusetFile};
use crate::enforce::sched::CpuMask;
use crate::enforce::PinMethod;
use crate::job::JobId;
use crate::sys::cgroupfs::{child_of, parent_of};
use crate::sys::procfs::ProcStat;

impl Enforcer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_pids(
        &self,
        id: &JobId,
        roots: &[u32],
        authorized: &[RootProcess],
        cpus: &CpuSet,
        mems: &CpuSet,
        memory_max: Option<u64>,
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
            let was = authorized
                .iter()
                .find(|r| r.pid == pid)
                .map(|r| r.start_time);
            match s.reader.stat(pid)? {
                Some(st) if was.is_some_and(|t| t != st.start_time) => {
                    out.warnings.push(format!(
                        "pid {pid} is another process than the one registered (the pid was \
                         reused): left alone"
                    ));
                    rec.missing_roots.push(pid);
                }
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
        // Sorted, so the membership tests below are binary searches rather than a scan per
        // member (a v1 pid job's cgroup can hold thousands of processes, checked every tick).
        s.in_cgroup.sort_unstable();
        s.in_cgroup.dedup();
        let mut members: Vec<(u32, ProcStat)> = Vec::new();
        let mut seen: HashSet<u32> = HashSet::new();
        let known = rec
            .roots
            .iter()
            .map(|r| (r.pid, Some(r.start_time)))
            .chain(rec.processes.iter().map(|p| (p.pid, Some(p.start_time))))
            .chain(s.in_cgroup.iter().map(|&p| (p, None)));
        for (pid, start) in known {
            if seen.contains(&pid) {
                continue;
            }
            if let Some(st) = s.reader.stat(pid)? {
                if st.running && start.map_or(true, |t| t == st.start_time) {
                    seen.insert(pid);
                    members.push((pid, st));
                }
            }
        }
        // Their descendants, from a /proc scan when one can find something new.
        let outside = job_cg.is_some()
            && members
                .iter()
                .any(|(p, _)| s.in_cgroup.binary_search(p).is_err());
        let scan = rec.pinning == PinMethod::Affinity || first || rec.rescan || outside;
        if scan && !members.is_empty() {
            let known: Vec<u32> = members.iter().map(|(p, _)| *p).collect();
            let mut found = Vec::new();
            // A sweep of a job pinned by affinity looks every time; the rest are one-off looks.
            let once = first || rec.pinning != PinMethod::Affinity;
            descendants(s, &known, &mut found, once)?;
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
                original_memory_cgroup: None,
                original_affinity: None,
                bound: false,
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
                    let memory = self.memory_cgroup_of(pid);
                    p.original_memory_cgroup = if memory.is_some() && memory == job_cg {
                        parent(&added).and_then(|q| q.original_memory_cgroup)
                    } else {
                        memory
                    };
                }
                PinMethod::Affinity => {
                    let Ok(mask) = CpuMask::of_thread(pid) else {
                        continue;
                    };
                    let now = mask.to_cpuset();
                    // Forked after pinning: it inherited lodger's mask, not its own (one
                    // lodger pinned to before a move too: forked during the move).
                    p.original_affinity = if &now == cpus || rec.was_pinned(&now) {
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
            let created = self.ensure_job_cgroup(cg, cpus, mems, memory_max)?;
            out.changed |= created;
            rec.cgroup = Some(cg.clone());
            let mut moved = false;
            for p in &rec.processes {
                if s.in_cgroup.binary_search(&p.pid).is_ok() {
                    continue;
                }
                match h.attach(cg, p.pid) {
                    Ok(()) => {
                        moved = true;
                        // v1 batch jobs: into the memory twin as well.
                        self.move_memory(cg, p.pid);
                    }
                    Err(e) if e.is_gone() && h.exists(cg) => {}
                    Err(e) => rr.errors.push(e.into()),
                }
            }
            rec.rescan = moved;
            out.changed |= moved;
        }
        let pids: Vec<u32> = rec.processes.iter().map(|p| p.pid).collect();
        out.pids = self.sweep_threads(s, &pids, want_mask.as_ref(), rr);
        if want_mask.is_some() {
            rec.note_pinned(cpus);
        }
        rec.processes
            .retain(|p| out.pids.binary_search(&p.pid).is_ok());
        out.alive = !out.pids.is_empty();
        Ok(())
    }

    /// Creates `<parent>/<job>` if needed and sets its mems, then cpus (v1: before any task is
    /// attached), and, when it creates it, its memory settings (`memory_max`: the job's own
    /// limit). Returns whether anything was written.
    pub(super) fn ensure_job_cgroup(
        &self,
        cg: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
        memory_max: Option<u64>,
    ) -> Result<bool, EnforceError> {
        let h = &*self.cpusets;
        let parent = parent_of(cg).unwrap_or("/").to_string();
        // The node's CPUs are read once, before the first change.
        let mut node_checked = false;
        let mut check_node = |cpus: &CpuSet| -> Result<(), EnforceError> {
            if !node_checked {
                self.check_node_cpus(cpus)?;
                node_checked = true;
            }
            Ok(())
        };
        let mut changed = false;
        if !h.exists(&parent) {
            check_node(cpus)?;
            h.create(&parent)?;
            changed = true;
        }
        // lodger's parent only ever grows: other jobs' cgroups live in it.
        let ancestors: &[&str] = if parent == "/" {
            &[]
        } else {
            &[parent.as_str()]
        };
        if !h.exists(cg) {
            check_node(cpus)?;
            // v2: the job's cgroup gets cpuset files only if its parent enables the controller.
            h.enable_cpuset(cg, &parent)?;
            self.create_job_cgroup(cg, &parent, ancestors, cpus, mems)?;
            self.set_job_memory(cg, &parent, memory_max);
            return Ok(true);
        }
        if !h.cpuset_enabled(cg)? {
            changed |= h.enable_cpuset(cg, &parent)?;
        }
        let entries = cpusets::set_with_ancestors(h, cg, cpus, mems, ancestors, None)?;
        if entries.is_empty() {
            return Ok(changed);
        }
        check_node(cpus)?;
        cpusets::write_nested(h, &entries)?;
        Ok(true)
    }

    /// Creates the job's cgroup empty and writes its values at once (v1: the parent grown
    /// first, then mems, then cpus, before any task), rather than giving it its parent's values
    /// and narrowing them (cgroups-rs's v1 create reads and writes both files of both cgroups):
    /// that was a third of a registration's enforcement (issue 21 item 1). A cgroup whose
    /// values could not be written is removed: an empty v1 cpuset takes no task.
    fn create_job_cgroup(
        &self,
        cg: &str,
        parent: &str,
        ancestors: &[&str],
        cpus: &CpuSet,
        mems: &CpuSet,
    ) -> Result<(), EnforceError> {
        let h = &*self.cpusets;
        h.create_empty(cg)?;
        let written = (|| {
            // v1: a cpuset with no memory node takes no task; the job names none, so it gets
            // its parent's.
            let mems = if mems.is_empty() && h.nested_subsets() {
                h.read(parent, CpusetFile::Mems)?
            } else {
                mems.clone()
            };
            let fresh = (CpuSet::new(), CpuSet::new());
            let entries = cpusets::set_with_ancestors(h, cg, cpus, &mems, ancestors, Some(fresh))?;
            cpusets::write_nested(h, &entries)
        })();
        if let Err(e) = written {
            if let Err(removed) = h.remove(cg) {
                warn!("{removed}");
            }
            return Err(e.into());
        }
        Ok(())
    }

    pub(super) fn release_pids(
        &self,
        rec: &PidJobRecord,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) {
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
            s.began = std::time::Instant::now();
            let known = members.clone();
            if let Err(e) = descendants(s, &known, &mut members, true) {
                errors.push(e);
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
    pub(super) fn empty_job_cgroup<'r>(
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
                let memory = origin(pid, ppid)
                    .and_then(|t| t.original_memory_cgroup.clone())
                    .unwrap_or_else(|| "/".to_string());
                self.move_memory(&memory, pid);
            }
        }
        if let Err(e) = h.remove(cg) {
            errors.push(e.into());
            return;
        }
        self.remove_twin(cg, parent_of(cg).unwrap_or("/"));
        if let Some(parent) = parent_of(cg) {
            if parent != "/" {
                if let Err(e) = h.remove_if_unused(parent) {
                    errors.push(e.into());
                }
            }
        }
    }
}
