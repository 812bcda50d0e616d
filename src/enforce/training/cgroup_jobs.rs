//! Training jobs registered by cgroup: their cpusets (and, on v1, their ancestors', grown and
//! shrunk in the kernel's order) written and restored, values found before lodger saved once.
//! Touches the cpuset hierarchy through [`CpusetHierarchy`](crate::enforce::CpusetHierarchy).

use tracing::{debug, warn};

use super::{
    within, CgroupJobRecord, EnforceError, Enforcer, Outcome, RrSweep, SavedCpuset, Scratch,
};
use crate::cpuset::CpuSet;
use crate::enforce::cpusets::{self, CpusetFile, CpusetTarget};
use crate::sys::cgroupfs::{self as cgroup, parent_of, CgroupError, CgroupVersion};

impl Enforcer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_cgroup(
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
                let saved = |g: &str| rec.saved.iter().find(|x| x.cgroup == g);
                match (saved(c), saved(parent)) {
                    // Cut by lodger before: it follows its parent again, so a job that grows
                    // takes its descendants with it (the write order grows parents first).
                    (Some(own), Some(up)) => (
                        Some(follow(&own.cpus, &up.cpus, &p_cpus)),
                        Some(follow(&own.mems, &up.mems, &p_mems)),
                    ),
                    _ => (
                        within(&current_cpus, &p_cpus),
                        within(&current_mems, &p_mems),
                    ),
                }
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

    pub(super) fn release_cgroup(
        &self,
        rec: &CgroupJobRecord,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) {
        let h = &*self.cpusets;
        let cg = &rec.cgroup;
        if !h.exists(cg) {
            // Removed by someone else (a Slurm step or a container ended): nothing inside to
            // restore, but the ancestors lodger widened for it are narrowed back all the same.
            debug!(cgroup = %cg, "job cgroup gone: restoring only its ancestors");
            self.restore_ancestors(rec);
            return;
        }
        let pids = self.subtree_procs(cg, s, errors);
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
        self.restore_ancestors(rec);
    }

    /// A container's cgroup is the runtime's, made on the cpuset lodger's adjustment gave it
    /// (docs/kubernetes.md): what lodger found there at its first write is its own value, and
    /// restoring that at release would leave the container on cores lodger then counts free. It
    /// goes back instead to what it has without lodger: its parent's (v2: the empty value,
    /// which follows the parent; v1: the parent's CPUs and memory nodes as they are now). A
    /// kubelet whose CPU manager gave the container CPUs of its own sets them again.
    pub(super) fn container_goes_back_to_its_parent(&self, rec: &mut CgroupJobRecord) {
        let h = &*self.cpusets;
        let parent = parent_of(&rec.cgroup).unwrap_or("/").to_string();
        let Some(own) = rec.saved.iter_mut().find(|x| x.cgroup == rec.cgroup) else {
            return;
        };
        match h.version() {
            CgroupVersion::V2 => {
                own.cpus = CpuSet::new();
                own.mems = CpuSet::new();
            }
            CgroupVersion::V1 => {
                if let (Ok(cpus), Ok(mems)) = (
                    h.read(&parent, CpusetFile::Cpus),
                    h.read(&parent, CpusetFile::Mems),
                ) {
                    own.cpus = cpus;
                    own.mems = mems;
                }
            }
        }
    }

    /// The cpusets a cgroup job's registration may write, as they are now: the job's cgroup,
    /// its descendants and, where a parent must hold its child's CPUs (v1), its ancestors
    /// below the root. Taken before the first write and kept in the pending file, so undoing a
    /// registration lodgerd died in the middle of restores these rather than what that
    /// lodgerd had already written. None when the cgroup is not there (the registration then
    /// fails before writing anything) or cannot be read.
    pub fn cpusets_now(&self, path: &str) -> Option<CgroupJobRecord> {
        let h = &*self.cpusets;
        let cg = cgroup::normalize(path).ok().filter(|c| c != "/")?;
        let mut cgroups = vec![cg.clone()];
        let mut i = 0;
        while i < cgroups.len() {
            let parent = cgroups[i].clone();
            // A descendant removed meanwhile is not there to restore.
            if h.children(&parent, &mut cgroups).is_err() && i == 0 {
                return None;
            }
            i += 1;
        }
        if h.nested_subsets() {
            cgroups.extend(
                cgroup::ancestors(&cg)
                    .into_iter()
                    .filter(|a| *a != "/")
                    .map(str::to_string),
            );
        }
        let mut saved = Vec::with_capacity(cgroups.len());
        for c in cgroups {
            match (h.read(&c, CpusetFile::Cpus), h.read(&c, CpusetFile::Mems)) {
                (Ok(cpus), Ok(mems)) => saved.push(SavedCpuset {
                    cgroup: c,
                    cpus,
                    mems,
                }),
                _ if c == cg => return None,
                _ => {}
            }
        }
        Some(CgroupJobRecord { cgroup: cg, saved })
    }

    /// The processes of cgroup `cg` and every cgroup below it, sorted, with those cgroups left
    /// in `s.cgroups` (parents first). A cgroup removed meanwhile (a step or container that
    /// ended) has nothing left in it; any other failure to read one goes to `errors`.
    pub(super) fn subtree_procs(
        &self,
        cg: &str,
        s: &mut Scratch,
        errors: &mut Vec<EnforceError>,
    ) -> Vec<u32> {
        let h = &*self.cpusets;
        s.cgroups.clear();
        s.cgroups.push(cg.to_string());
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
        pids
    }

    /// Gives back the cpusets lodger widened above the job's cgroup (v1: a parent must hold its
    /// child's CPUs), from the values saved before its first write.
    fn restore_ancestors(&self, rec: &CgroupJobRecord) {
        let h = &*self.cpusets;
        let cg = &rec.cgroup;
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
}

/// A v1 descendant's value once lodger has written it: what it had before lodger (`saved`),
/// against its parent's then (`parent_saved`) and now (`parent_now`). One that had all its
/// parent had follows the parent; one with a part of its own keeps what remains of that part,
/// or takes the parent's when none remains.
fn follow(saved: &CpuSet, parent_saved: &CpuSet, parent_now: &CpuSet) -> CpuSet {
    if parent_saved.is_subset(saved) {
        return parent_now.clone();
    }
    let kept = saved.intersection(parent_now);
    if kept.is_empty() {
        parent_now.clone()
    } else {
        kept
    }
}
