//! The scheduling sweep: every thread of a training job made SCHED_RR at the configured priority
//! (Cloud Reamer §III-A), threads that mostly wait one priority higher ([`super::roles`]), or,
//! under `training.policy = "other"`, SCHED_OTHER at a high weight; re-swept each apply for
//! threads that did not inherit it, reverted on release; an EPERM from a v1 cpu cgroup without an
//! RT budget is diagnosed (and the budget granted when configured). Touches sched_setscheduler,
//! setpriority, sched_setaffinity and v1 cpu cgroups.

use std::time::Instant;

use super::roles::Role;
use super::rtgroup::RtGrant;
use super::{EnforceError, Enforcer, Scratch};
use crate::enforce::sched::{self, AffinityState, CpuMask, RrState, SchedError};
use crate::enforce::TrainingClass;

impl Enforcer {
    /// Makes every thread of `pids` SCHED_RR (and, with `mask`, sets its affinity). Returns the
    /// pids that still exist.
    pub(super) fn sweep_threads(
        &self,
        s: &mut Scratch,
        pids: &[u32],
        mask: Option<&CpuMask>,
        rr: &mut RrSweep<'_>,
    ) -> Vec<u32> {
        let mut alive = Vec::with_capacity(pids.len());
        let now = Instant::now();
        let roles = matches!(self.settings.class, TrainingClass::Rr { roles: true });
        s.roles.begin(now);
        let lodger = matches!(self.settings.class, TrainingClass::Lodger { .. });
        for &pid in pids {
            match s.quiet.threads(&mut s.reader, pid, &mut s.tids, now) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    rr.errors.push(e.into());
                    continue;
                }
            }
            if lodger {
                // A batch job is a lodger: the OOM killer takes it before training (issue 19).
                // Best effort: another user's /proc/PID/oom_score_adj needs CAP_DAC_OVERRIDE,
                // which the packaged unit does not give lodgerd; the job runs on regardless.
                match sched::ensure_oom_score(
                    &self.settings.proc_root,
                    pid,
                    sched::LODGER_OOM_SCORE_ADJ,
                ) {
                    Ok(Some(true)) => rr.changed = true,
                    Ok(_) => {}
                    Err(e) => tracing::debug!(pid, "oom_score_adj not raised: {e}"),
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
                let role = if roles {
                    s.roles.role(pid, tid, now)
                } else {
                    Role::Worker
                };
                if role == Role::Latency {
                    rr.latency.push((pid, tid));
                }
                any |= rr.thread(pid, tid, role);
            }
            if any {
                alive.push(pid);
            }
        }
        alive
    }

    /// Returns the threads of `pids` to SCHED_OTHER (and, with `mask`, to that affinity).
    pub(super) fn revert_threads(
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
            if matches!(self.settings.class, TrainingClass::Lodger { .. }) {
                if let Err(e) = sched::revert_oom_score(
                    &self.settings.proc_root,
                    pid,
                    sched::LODGER_OOM_SCORE_ADJ,
                ) {
                    tracing::debug!(pid, "oom_score_adj not given back: {e}");
                }
            }
            for &tid in &s.tids {
                if let Err(e) = sched::revert_rr(tid) {
                    errors.push(e.into());
                }
                if let TrainingClass::Lodger { sched_batch: true } = self.settings.class {
                    if let Err(e) = sched::revert_batch(tid) {
                        errors.push(e.into());
                    }
                }
                if let TrainingClass::Other { nice } = self.settings.class {
                    // Only the value lodger set: a nice the owner chose since is theirs.
                    if nice != 0 && sched::nice_of(tid) == Ok(nice) {
                        if let Err(errno) = sched::set_nice(tid, 0) {
                            errors.push(
                                SchedError::SetNice {
                                    tid,
                                    nice: 0,
                                    errno,
                                }
                                .into(),
                            );
                        }
                    }
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

/// The SCHED_RR part of one apply: counts, errors, and what was learnt about RT budgets.
pub(super) struct RrSweep<'a> {
    pub(super) enforcer: &'a Enforcer,
    pub(super) grants: &'a mut Vec<RtGrant>,
    /// `None` until a thread needs SCHED_RR; then whether the node refuses it.
    pub(super) refused: Option<bool>,
    /// cpu cgroups found without an RT budget (and not granted one) in this apply.
    pub(super) no_budget: Vec<String>,
    pub(super) errors: Vec<EnforceError>,
    pub(super) threads: u32,
    pub(super) rr: u32,
    pub(super) changed: bool,
    /// Threads swept in the latency role, `(pid, tid)`.
    pub(super) latency: Vec<(u32, u32)>,
}

impl<'a> RrSweep<'a> {
    pub(super) fn new(enforcer: &'a Enforcer, grants: &'a mut Vec<RtGrant>) -> Self {
        Self {
            enforcer,
            grants,
            refused: None,
            no_budget: Vec::new(),
            errors: Vec::new(),
            threads: 0,
            rr: 0,
            changed: false,
            latency: Vec::new(),
        }
    }

    /// The RR priority of a thread in `role`: latency threads one above the workers.
    fn priority(&self, role: Role) -> i32 {
        let base = self.enforcer.settings.rt_priority;
        match role {
            Role::Worker => base,
            Role::Latency => (base + 1).min(sched::rr_priority_range().1),
        }
    }

    /// `training.policy = "other"`: SCHED_OTHER at `nice`. Returns false when the thread is gone.
    fn other(&mut self, tid: u32, nice: i32) -> bool {
        self.threads += 1;
        match sched::revert_rr(tid) {
            Ok(true) => self.changed = true,
            Ok(false) => {}
            Err(e) => self.errors.push(e.into()),
        }
        match sched::nice_of(tid) {
            Ok(n) if n == nice => {}
            Ok(_) => match sched::set_nice(tid, nice) {
                Ok(()) => self.changed = true,
                Err(nix::errno::Errno::ESRCH) => {
                    self.threads -= 1;
                    return false;
                }
                Err(errno) => {
                    self.errors
                        .push(SchedError::SetNice { tid, nice, errno }.into());
                    return true;
                }
            },
            Err(nix::errno::Errno::ESRCH) => {
                self.threads -= 1;
                return false;
            }
            Err(errno) => {
                self.errors
                    .push(SchedError::SetNice { tid, nice, errno }.into());
                return true;
            }
        }
        self.rr += 1;
        true
    }

    /// A batch job's thread: SCHED_BATCH or SCHED_OTHER, never real-time. Returns false when it
    /// is gone.
    fn lodger(&mut self, tid: u32, sched_batch: bool) -> bool {
        match sched::ensure_lodger(tid, sched_batch) {
            Ok(None) => return false,
            Ok(Some(changed)) => self.changed |= changed,
            Err(e) => self.errors.push(e.into()),
        }
        self.threads += 1;
        self.rr += 1;
        true
    }

    /// Read once per apply, and only when some thread needs changing: it can change at run time.
    fn refused(&mut self) -> bool {
        if let Some(r) = self.refused {
            return r;
        }
        let settings = &self.enforcer.settings;
        let r =
            match sched::unthrottled_rt_refused(settings.allow_unthrottled_rt, &settings.proc_root)
            {
                Ok(true) => {
                    self.errors.push(
                        SchedError::RtUnthrottled {
                            file: settings.proc_root.join(sched::SCHED_RT_RUNTIME_SYSCTL),
                        }
                        .into(),
                    );
                    true
                }
                Ok(false) => false,
                Err(e) => {
                    self.errors.push(e.into());
                    false
                }
            };
        self.refused = Some(r);
        r
    }

    /// One thread; returns false when it is gone.
    fn thread(&mut self, pid: u32, tid: u32, role: Role) -> bool {
        match self.enforcer.settings.class {
            TrainingClass::Other { nice } => return self.other(tid, nice),
            TrainingClass::Lodger { sched_batch } => return self.lodger(tid, sched_batch),
            TrainingClass::Rr { .. } => {}
        }
        let priority = self.priority(role);
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
                self.on_eperm(pid, tid, priority);
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
    fn on_eperm(&mut self, pid: u32, tid: u32, priority: i32) {
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
