//! Stopping instances (one job's without waiting, or one job's or all and waiting; SIGTERM then
//! SIGKILL after the grace period), leaving them running for the next lodgerd, and `Drop`, which
//! kills whatever still runs unless they were left running on purpose.
//! Touches signals and lodger's instance cgroups through [`Host`](super::host::Host).

use std::time::Instant;

use tracing::warn;

use super::error::InstanceError;
use super::supervisor::{Instances, SlotState};
use super::{InstanceKey, StopOutcome, KILL_WAIT, STEP};
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
                SlotState::Running | SlotState::Moving { .. } => {
                    self.host.terminate(slot, now, None)
                }
                SlotState::Stopping { next, .. } => *next = None,
                SlotState::BackingOff { .. } | SlotState::Waiting => {
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
                SlotState::Running | SlotState::Moving { .. } => {
                    self.host.terminate(slot, start, None)
                }
                SlotState::Stopping { next, .. } => *next = None,
                SlotState::BackingOff { .. } | SlotState::Waiting => {}
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
            super::unit::stop_slices(&self.host.slices);
        }
        out
    }

    /// Stops supervising without stopping anything (lodgerd is stopping, for a restart or an
    /// upgrade): the instances run on, their report FIFOs hold what they write meanwhile, and
    /// the next lodgerd adopts them ([`Instances::adopt`]). Returns how many were running. An
    /// instance that was being stopped is left to the next lodgerd, which kills it if its job
    /// is gone. Dropping `Instances` afterwards touches nothing.
    pub fn leave_running(&mut self) -> usize {
        let running = self.slots.iter().filter(|s| s.run.is_some()).count();
        // Our children become init's (or a subreaper's) once lodgerd exits; nothing is signalled.
        self.slots.clear();
        self.left_running = true;
        running
    }
}

impl Drop for Instances {
    /// Whatever still runs is killed, unless lodgerd left it running on purpose
    /// ([`Instances::leave_running`]).
    fn drop(&mut self) {
        if self.left_running {
            return;
        }
        if std::thread::panicking() {
            // lodgerd's thread is unwinding from a bug: a crash, not a stop. The instances run
            // on, and the next lodgerd adopts them (docs/instance-protocol.md), as after a kill.
            warn!("the inference supervisor is unwinding from a panic: its instances run on");
            return;
        }
        let running = self.slots.iter().filter(|s| s.run.is_some()).count();
        if running == 0 && self.slots.is_empty() {
            // Instance units that ran and were stopped earlier leave their slices behind.
            super::unit::stop_slices_if_connected(&self.host.slices);
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
        super::unit::stop_slices_if_connected(&self.host.slices);
        for e in errors {
            warn!("while killing instances: {e}");
        }
    }
}
