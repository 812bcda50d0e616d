//! lodger's resctrl MBA groups as contention control decided them (SODA §V-E): one control group
//! per MBA tier (`lodger-lodgers` for batch and offline jobs, `lodger-online` for online
//! inference), its MB values, and which threads are in it: each member's threads moved in, and
//! those of jobs that left the tier (or of any training job) given back. Touches resctrl through
//! `enforce::resctrl` and `/proc/PID/task`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::enforce::resctrl::{remove_stale_group, LodgerGroup, ResctrlError};
use crate::job::{JobId, JobKind};
use crate::policy::contention::{MbaGroup, Role, Throttles};
use crate::store::StoredJob;
use crate::sys::procfs::ProcReader;
use crate::sys::resctrlfs::MbaCaps;

/// The policy's role of a job kind.
pub(super) fn role_of(kind: JobKind) -> Role {
    match kind {
        JobKind::Training => Role::Training,
        JobKind::Online => Role::Online,
        JobKind::Offline => Role::Offline,
        JobKind::Batch => Role::Batch,
    }
}

/// resctrl MBA, when the node has it, and lodger's groups on it.
pub struct MbaTarget {
    pub root: PathBuf,
    pub caps: MbaCaps,
    groups: BTreeMap<MbaGroup, Applied>,
    /// The last problem per group, logged once until it changes.
    problems: BTreeMap<MbaGroup, String>,
}

/// One of lodger's groups, as this lodgerd holds it.
struct Applied {
    group: LodgerGroup,
    /// The threads put in the group, by job, as last seen.
    moved: BTreeMap<JobId, BTreeSet<u32>>,
    /// Taken up from an earlier lodgerd: what it moved is not known, so the first apply gives
    /// back every thread that is not a current member's.
    adopted: bool,
}

impl MbaTarget {
    pub fn new(root: PathBuf, caps: MbaCaps) -> Self {
        Self {
            root,
            caps,
            groups: BTreeMap::new(),
            problems: BTreeMap::new(),
        }
    }

    /// At start: takes up the group of each tier `holds` says still holds a throttle (an
    /// earlier lodgerd left it, issue 17), so this lodgerd can set, reconcile or remove it;
    /// removes the others' groups.
    pub(super) fn take_up(&mut self, holds: impl Fn(MbaGroup) -> bool) {
        for g in MbaGroup::ALL {
            if !holds(g) {
                self.remove_stale(g);
                continue;
            }
            match LodgerGroup::open(&self.root, g.default_name(), self.caps.clone()) {
                Ok(Some(group)) => {
                    self.groups.insert(
                        g,
                        Applied {
                            group,
                            moved: BTreeMap::new(),
                            adopted: true,
                        },
                    );
                }
                Ok(None) => {}
                Err(e) => warn!("cannot take up lodger's resctrl group {g}: {e}"),
            }
        }
    }

    /// Removes every group of lodger's an earlier lodgerd left, without a handle on it (at
    /// start, contention control off).
    pub(super) fn remove_stale_groups(&self) {
        for g in MbaGroup::ALL {
            self.remove_stale(g);
        }
    }

    fn remove_stale(&self, g: MbaGroup) {
        if let Err(e) = remove_stale_group(&self.root, g.default_name()) {
            warn!("cannot remove lodger's stale resctrl group {g}: {e}");
        }
    }

    /// Makes each group match `throttles`: a throttled tier's group made (or kept), at its MB
    /// values, with its members' threads (of `jobs`' current pids, the `ended` jobs' aside) in
    /// it and every other thread lodger put there given back; an unthrottled tier's group given
    /// back and removed.
    /// Returns the tiers whose group cannot be made, with why, for the eliminator to throttle
    /// otherwise.
    pub(super) fn apply(
        &mut self,
        proc_root: &Path,
        jobs: &BTreeMap<JobId, StoredJob>,
        ended: &BTreeSet<JobId>,
        throttles: &Throttles,
    ) -> Vec<(MbaGroup, String)> {
        let mut failed = Vec::new();
        for g in MbaGroup::ALL {
            let Some(values) = throttles.mba.get(&g) else {
                self.remove(g);
                continue;
            };
            let applied = match self.groups.entry(g) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    match LodgerGroup::create(&self.root, g.default_name(), self.caps.clone()) {
                        Ok((group, _)) => e.insert(Applied {
                            group,
                            moved: BTreeMap::new(),
                            adopted: false,
                        }),
                        Err(err) => {
                            let why = err.to_string();
                            note(&mut self.problems, g, Some(format!("cannot create: {why}")));
                            failed.push((g, why));
                            continue;
                        }
                    }
                }
            };
            let problem = applied
                .sync(proc_root, jobs, ended, g, values)
                .err()
                .map(|e| e.to_string());
            note(&mut self.problems, g, problem);
        }
        failed
    }

    /// Gives `g`'s throttled bandwidth and threads back and removes its group, if this lodgerd
    /// holds it. When giving back fails the group is removed anyway (its threads go back to
    /// the default group with it); when that fails too, the handle is kept to try again.
    fn remove(&mut self, g: MbaGroup) {
        let Some(applied) = self.groups.get(&g) else {
            return;
        };
        let restored = applied.group.restore().err();
        match applied.group.clone().remove() {
            Ok(_) => {
                self.groups.remove(&g);
                note(&mut self.problems, g, None);
            }
            Err(e) => {
                let why = match restored {
                    Some(r) => format!("cannot give back ({r}) or remove ({e})"),
                    None => format!("cannot remove: {e}"),
                };
                note(&mut self.problems, g, Some(why));
            }
        }
    }

    /// Every group given back and removed (contention off, drained, or stopping with no
    /// throttle held).
    pub(super) fn remove_all(&mut self) {
        for g in MbaGroup::ALL {
            self.remove(g);
        }
    }
}

impl Applied {
    /// The MB values, the members' threads in, every other thread lodger put here out.
    fn sync(
        &mut self,
        proc_root: &Path,
        jobs: &BTreeMap<JobId, StoredJob>,
        ended: &BTreeSet<JobId>,
        g: MbaGroup,
        values: &BTreeMap<u32, u32>,
    ) -> Result<(), ResctrlError> {
        self.group.set_mb(values)?;
        let mut proc = ProcReader::new(proc_root);
        // Training is never throttled: its threads never go in, and come out if found in.
        let mut training = Vec::new();
        let training_pids: Vec<u32> = jobs
            .values()
            .filter(|s| s.job.spec.kind == JobKind::Training)
            .flat_map(|s| s.job.pids.iter().copied())
            .collect();
        proc.threads_of(&training_pids, &mut training)?;
        let training: BTreeSet<u32> = training.into_iter().collect();
        let mut now: BTreeMap<JobId, BTreeSet<u32>> = BTreeMap::new();
        for s in jobs
            .values()
            .filter(|s| role_of(s.job.spec.kind).mba_group() == Some(g))
            .filter(|s| !ended.contains(&s.job.id))
        {
            let mut tids = Vec::new();
            proc.threads_of(&s.job.pids, &mut tids)?;
            let tids: BTreeSet<u32> = tids.into_iter().filter(|t| !training.contains(t)).collect();
            now.insert(s.job.id.clone(), tids);
        }
        let wanted: Vec<u32> = now.values().flatten().copied().collect();
        let moved = self.group.move_threads(&wanted)?;
        for t in &moved.gone {
            for tids in now.values_mut() {
                tids.remove(t);
            }
        }
        let keep: BTreeSet<u32> = now.values().flatten().copied().collect();
        let tasks: BTreeSet<u32> = self.group.tasks()?.into_iter().collect();
        let mut release: BTreeSet<u32> = self
            .moved
            .iter()
            .filter(|(id, _)| !now.contains_key(*id))
            .flat_map(|(_, tids)| tids.iter().copied())
            .collect();
        release.extend(training.iter().copied());
        if std::mem::take(&mut self.adopted) {
            release.extend(tasks.iter().copied());
        }
        let release: Vec<u32> = release
            .into_iter()
            .filter(|t| tasks.contains(t) && !keep.contains(t))
            .collect();
        if !release.is_empty() {
            let done = self.group.release_threads(&release)?;
            info!(
                "contention: {} thread(s) of jobs no longer in {g} given back: {:?}",
                done.moved.len(),
                done.moved
            );
        }
        self.moved = now;
        Ok(())
    }
}

/// Logs `problem` for `g` when it changes (and a recovery once).
fn note(problems: &mut BTreeMap<MbaGroup, String>, g: MbaGroup, problem: Option<String>) {
    match problem {
        Some(p) => {
            if problems.get(&g) != Some(&p) {
                warn!("contention: lodger's resctrl group {g}: {p}");
                problems.insert(g, p);
            }
        }
        None => {
            if problems.remove(&g).is_some() {
                info!("contention: lodger's resctrl group {g}: recovered");
            }
        }
    }
}
