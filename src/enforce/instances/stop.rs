//! Stopping instances (one job's without waiting, or one job's or all and waiting; SIGTERM then
//! SIGKILL after the grace period), the start-up sweep of what a previous lodgerd left, and
//! `Drop`, which kills whatever still runs.
//! Touches signals and lodger's instance cgroups through [`Host`](super::host::Host).

use std::time::Instant;

use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use tracing::warn;

use super::error::InstanceError;
use super::supervisor::{Instances, SlotState};
use super::{InstanceKey, StopOutcome, SweepOutcome, KILL_WAIT, STEP};
use crate::job::JobId;

impl Instances {
    /// Stops every instance of `job` and waits for them (SIGTERM, SIGKILL after the grace
    /// period), then removes their cgroups. They start again if a later `reconcile` wants them.
    pub fn stop_job(&mut self, job: &JobId) -> StopOutcome {
        self.stop_where(|k| k.job == *job)
    }

    /// Starts stopping every instance of `job` and returns at once: SIGTERM now, and `poll`
    /// (every tick) sends SIGKILL after the grace period, reaps them and removes their cgroups.
    /// What the agent uses, so an instance that ignores SIGTERM never holds up its loop.
    pub fn begin_stop_job(&mut self, job: &JobId) -> Vec<InstanceError> {
        let now = Instant::now();
        let mut errors = Vec::new();
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i].key().job != *job {
                i += 1;
                continue;
            }
            let slot = &mut self.slots[i];
            match &mut slot.state {
                SlotState::Running => self.host.terminate(slot, now, None),
                SlotState::Stopping { next, .. } => *next = None,
                SlotState::BackingOff { .. } => {
                    let slot = self.slots.remove(i);
                    self.host.discard(&slot, &mut errors);
                    continue;
                }
            }
            i += 1;
        }
        errors
    }

    /// Stops every instance and waits for them, then removes their cgroups (and lodger's
    /// `lodgers` cgroup, and its parent if it was created here and is unused).
    pub fn stop_all(&mut self) -> StopOutcome {
        self.stop_where(|_| true)
    }

    pub(super) fn stop_where(&mut self, pick: impl Fn(&InstanceKey) -> bool) -> StopOutcome {
        let mut out = StopOutcome::default();
        let start = Instant::now();
        for slot in self.slots.iter_mut().filter(|s| pick(&s.key())) {
            match &mut slot.state {
                SlotState::Running => self.host.terminate(slot, start, None),
                SlotState::Stopping { next, .. } => *next = None,
                SlotState::BackingOff { .. } => {}
            }
        }
        loop {
            let now = Instant::now();
            let mut waiting = false;
            for slot in self.slots.iter_mut().filter(|s| pick(&s.key())) {
                self.host.read_reports(slot, now);
                let Some(run) = slot.run.as_mut() else {
                    continue;
                };
                if let Some(how) = run.reap() {
                    slot.last_exit = Some(how);
                    self.host.finish_run(slot, now, &mut out.errors);
                    continue;
                }
                let SlotState::Stopping {
                    kill_at,
                    killed_at,
                    stuck,
                    ..
                } = &mut slot.state
                else {
                    continue;
                };
                match *killed_at {
                    None if now >= *kill_at => {
                        *killed_at = Some(now);
                        out.killed.push(slot.spec.key());
                        self.host.kill_run(slot, &mut out.errors);
                        waiting = true;
                    }
                    Some(_) if *stuck => {}
                    Some(at) if now.saturating_duration_since(at) > KILL_WAIT => {
                        *stuck = true;
                        out.errors.push(InstanceError::Unkillable {
                            key: slot.spec.key(),
                            pid: run.pid,
                            waited: now.saturating_duration_since(at),
                        });
                    }
                    _ => waiting = true,
                }
            }
            if !waiting {
                break;
            }
            std::thread::sleep(STEP);
        }
        let mut i = 0;
        while i < self.slots.len() {
            let slot = &self.slots[i];
            // An unkillable process stays supervised: `poll` reaps it if it ever goes.
            if pick(&slot.key()) && slot.run.is_none() {
                let slot = self.slots.remove(i);
                self.host.discard(&slot, &mut out.errors);
                out.stopped.push(slot.key());
            } else {
                i += 1;
            }
        }
        self.host.retry_removals();
        if self.slots.is_empty() {
            self.host.remove_lodgers(&mut out.errors);
            super::unit::stop_slices();
        }
        out
    }

    /// Kills what a previous lodgerd left behind and removes its instance cgroups: every process
    /// in `<parent>/lodgers/*`, and every process whose environment carries this lodger's
    /// `LODGER_PARENT` (instances placed by affinity, and children that left their cgroup). Run
    /// once at start, before the first `reconcile`.
    pub fn sweep_leftovers(&mut self) -> Result<SweepOutcome, InstanceError> {
        if !self.slots.is_empty() {
            return Err(InstanceError::SweepWithInstances {
                running: self.slots.len(),
            });
        }
        let h = &self.host;
        let mut out = SweepOutcome::default();
        let mut cgroups = Vec::new();
        if h.cpusets.exists(&h.lodgers) {
            match h.cpusets.children(&h.lodgers, &mut cgroups) {
                Ok(()) => {}
                Err(e) if e.is_gone() => {}
                Err(e) => return Err(e.into()),
            }
        }
        for cg in &cgroups {
            out.killed.extend(h.kill_cgroup(cg)?);
        }
        // Instance units an earlier lodgerd started.
        super::unit::stop_slices();
        out.killed.extend(self.host.kill_marked()?);
        out.killed.sort_unstable();
        out.killed.dedup();
        for cg in &cgroups {
            if self.host.remove_cgroup(cg, KILL_WAIT)? {
                out.removed_cgroups.push(cg.clone());
            }
        }
        // Reap the ones that were our own children (a lodger-like parent that is this process).
        for &pid in &out.killed {
            if let Ok(p) = i32::try_from(pid) {
                let _ = waitpid(Pid::from_raw(p), Some(WaitPidFlag::WNOHANG));
            }
        }
        let h = &self.host;
        if h.cpusets.exists(&h.lodgers) && h.cpusets.remove_if_unused(&h.lodgers)? {
            out.removed_cgroups.push(h.lodgers.clone());
        }
        if !out.killed.is_empty() || !out.removed_cgroups.is_empty() {
            warn!(
                "removed leftovers of a previous lodgerd: killed processes {:?}, removed cgroups \
                 {:?}",
                out.killed, out.removed_cgroups
            );
        }
        Ok(out)
    }
}

impl Drop for Instances {
    /// The last line of "never leave an instance behind": whatever still runs is killed.
    fn drop(&mut self) {
        let running = self.slots.iter().filter(|s| s.run.is_some()).count();
        if running == 0 && self.slots.is_empty() {
            // Instance units that ran and were stopped earlier leave their slices behind.
            super::unit::stop_slices_if_connected();
            return;
        }
        if running > 0 {
            warn!(
                "{running} inference instance(s) still running when their supervisor went \
                 away: killing them"
            );
        }
        let mut errors = Vec::new();
        for slot in &mut self.slots {
            if slot.run.is_some() {
                self.host.kill_run(slot, &mut errors);
            }
        }
        let deadline = Instant::now() + KILL_WAIT;
        for slot in &mut self.slots {
            while let Some(run) = slot.run.as_mut() {
                if run.reap().is_some() {
                    self.host.finish_run(slot, Instant::now(), &mut errors);
                } else if Instant::now() < deadline {
                    std::thread::sleep(STEP);
                } else {
                    break;
                }
            }
        }
        for slot in std::mem::take(&mut self.slots) {
            self.host.discard(&slot, &mut errors);
        }
        self.host.remove_lodgers(&mut errors);
        // Also when an instance unit ran and its slots were removed earlier.
        super::unit::stop_slices_if_connected();
        for e in errors {
            warn!("while killing instances: {e}");
        }
    }
}
