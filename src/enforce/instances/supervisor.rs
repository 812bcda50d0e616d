//! The supervisor: one slot per wanted instance, its run and back-off, and [`Instances`]: create,
//! reconcile with what the plan wants, poll for exits and reports, stats. Touches the node only
//! through [`Host`](super::host::Host).

use std::fs::{self, File};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tracing::{debug, info, warn};

use super::error::InstanceError;
use super::hold::{held_cpus, must_wait, Held};
use super::host::Host;
use super::report::{PooledLatency, ReportLog};
use super::template::{validate_template, Placeholder, Template};
use super::{
    InstanceKey, InstancePlacement, InstanceSettings, InstanceSpec, InstanceState, InstanceStats,
    PollOutcome, ReconcileOutcome, KILL_WAIT, LODGERS_CGROUP,
};
use crate::cpuset::CpuSet;
use crate::enforce::cpusets::{self, CpusetFile};
use crate::enforce::PinMethod;
use crate::job::JobId;
use crate::sys::cgroupfs::{self as cgroup, child_of, CgroupError, CgroupVersion};
use crate::sys::procfs::{ProcReader, ProcessTable};

// ---------------------------------------------------------------------------------------------
// The supervisor

/// The live process of an instance.
#[derive(Debug)]
pub(super) struct Run {
    /// lodgerd's child (the fork path); `None` for a transient unit's process.
    pub(super) child: Option<Child>,
    /// The transient unit it runs in, and a pidfd on its main process.
    pub(super) unit: Option<(String, OwnedFd)>,
    /// A pidfd on a process started by an earlier lodgerd and adopted (neither our child nor a
    /// unit's).
    pub(super) adopted: Option<OwnedFd>,
    pub(super) pid: u32,
    pub(super) started: Instant,
    /// The read end of the report pipe, non-blocking; `None` after end of file.
    pub(super) report: Option<File>,
}

impl Run {
    /// If the process exited: kills what it left in its process group, then reaps it and says
    /// how it ended. The group is killed before the reap: until then the zombie holds the
    /// group's id, so no other process can have come to own it.
    pub(super) fn reap(&mut self) -> Option<String> {
        if let Some(pid) = pid_of(self.pid) {
            let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
            match waitid(Id::Pid(pid), flags) {
                Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => return None,
                Ok(_) => {
                    let _ = killpg(pid, Signal::SIGKILL);
                }
                // ECHILD: reaped elsewhere (SIGCHLD ignored); `try_wait` says so.
                Err(_) => {}
            }
        }
        if let Some((name, pidfd)) = &self.unit {
            // Not our child: its pidfd turns readable when it exits. systemd reaps it and
            // kills what it left in the unit's cgroup; how it ended is systemd's to tell (the
            // unit is collected once failed, its journal stays).
            return exited(pidfd)
                .then(|| format!("exited (unit {name}; how: journalctl -u {name})"));
        }
        if let Some(pidfd) = &self.adopted {
            // Started by an earlier lodgerd: init reaps it. What it left in its process group
            // keeps the group's id from being reused, so the group is still its own.
            if !exited(pidfd) {
                return None;
            }
            if let Some(pgid) = pid_of(self.pid) {
                let _ = killpg(pgid, Signal::SIGKILL);
            }
            return Some(
                "exited (adopted: how is known only to the lodgerd that started it)".into(),
            );
        }
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(status)) => status.map(describe_exit),
            Some(Err(e)) => Some(format!("gone ({e})")),
            None => Some("gone".to_string()),
        }
    }
}

/// Each slot's [`InstanceStats`] at `now`. What is held from a slot ([`held_cpus`], a pass
/// over every slot) is looked at only for one whose back-off is over: `poll` starts it unless
/// it must wait, and then it is shown waiting.
pub(super) fn stats_of(
    slots: &[Slot],
    now: Instant,
    window: Duration,
    cores: &[CpuSet],
) -> Vec<InstanceStats> {
    slots
        .iter()
        .enumerate()
        .map(|(i, slot)| {
            let over = matches!(slot.state, SlotState::BackingOff { at } if now >= at);
            let held = if over {
                held_cpus(slots, Some(i), cores)
            } else {
                Held::default()
            };
            slot.stats(now, window, &held)
        })
        .collect()
}

/// Whether the process a pidfd refers to has exited (the pidfd is readable).
pub(super) fn exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: one valid pollfd, timeout 0 (no wait).
    unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) > 0 }
}

#[derive(Debug)]
pub(super) enum SlotState {
    Running,
    BackingOff {
        at: Instant,
    },
    /// Wanted, not started: an online instance waiting to move off them still serves on some of
    /// its CPUs, or it is online and a stopping instance still runs there (an online instance
    /// has its cores to itself). Starts once they are free ([`must_wait`]).
    Waiting,
    /// Running on `spec`'s CPUs, wanted on `to`'s (CPUs or memory nodes alone changed: a move in
    /// place), which are held as for a start: it serves where it is until they are free, then
    /// moves ([`must_wait`]).
    Moving {
        to: InstanceSpec,
    },
    Stopping {
        kill_at: Instant,
        killed_at: Option<Instant>,
        /// `Unkillable` was reported (once).
        stuck: bool,
        next: Option<(InstanceSpec, Template)>,
    },
}

#[derive(Debug)]
pub(super) struct Slot {
    pub(super) spec: InstanceSpec,
    pub(super) template: Template,
    /// Its cgroup once created (cgroup placement).
    pub(super) cgroup: Option<String>,
    pub(super) run: Option<Run>,
    pub(super) state: SlotState,
    pub(super) restarts: u32,
    pub(super) failures: u32,
    pub(super) backoff: Duration,
    pub(super) last_exit: Option<String>,
    pub(super) last_error: Option<String>,
    pub(super) reports: ReportLog,
    /// The memory limit its running process got (`memory`).
    pub(super) memory_max: Option<u64>,
    /// The OOM kill count of its memory cgroup when last looked at (its start; every poll for
    /// a unit, whose count is the slice's).
    pub(super) oom_seen: Option<u64>,
    pub(super) oom_kills: u32,
    /// Moved by affinity: its tree is walked again at each poll until then (`Host::repin`).
    pub(super) repin_until: Option<Instant>,
}

impl Slot {
    /// A slot for `spec` with no history yet, in `state`.
    pub(super) fn new(spec: InstanceSpec, template: Template, state: SlotState) -> Self {
        Slot {
            spec,
            template,
            cgroup: None,
            run: None,
            state,
            restarts: 0,
            failures: 0,
            backoff: Duration::ZERO,
            last_exit: None,
            last_error: None,
            reports: ReportLog::default(),
            memory_max: None,
            oom_seen: None,
            oom_kills: 0,
            repin_until: None,
        }
    }

    pub(super) fn key(&self) -> InstanceKey {
        self.spec.key()
    }

    /// `held`: what is held from it ([`held_cpus`]), looked at only once its back-off is over.
    pub(super) fn stats(&self, now: Instant, window: Duration, held: &Held) -> InstanceStats {
        let since = self.run.as_ref().map(|r| r.started);
        let w = self.reports.summary(now, window, since);
        let state = match &self.state {
            SlotState::Running => InstanceState::Running,
            SlotState::BackingOff { at } => InstanceState::BackingOff {
                retry_in: at.saturating_duration_since(now),
                waits: now >= *at && must_wait(&self.spec, held),
            },
            SlotState::Waiting => InstanceState::Waiting,
            SlotState::Moving { .. } => InstanceState::Moving,
            SlotState::Stopping { next, .. } => InstanceState::Stopping {
                restarting: next.is_some(),
            },
        };
        InstanceStats {
            job: self.spec.job.clone(),
            index: self.spec.index,
            pid: self.run.as_ref().map(|r| r.pid),
            cpus: self.spec.cpus.clone(),
            threads: self.spec.threads,
            batch: self.spec.batch,
            cgroup: self.cgroup.clone(),
            unit: self
                .run
                .as_ref()
                .and_then(|r| r.unit.as_ref().map(|(name, _)| name.clone())),
            state,
            restarts: self.restarts,
            failures: self.failures,
            backoff: self.backoff,
            last_exit: self.last_exit.clone(),
            last_error: self.last_error.clone(),
            memory_max: self.memory_max,
            oom_kills: self.oom_kills,
            uptime: since.map_or(Duration::ZERO, |s| now.saturating_duration_since(s)),
            span: w.span,
            items_per_s: w.items_per_s,
            latency_p50_ms: w.p50,
            latency_p99_ms: w.p99,
            latency_samples: w.reports,
            queue_p99_ms: w.queue_p99,
            items_total: self.reports.items_total,
            reports_total: self.reports.reports_total,
            bad_reports: self.reports.bad_total,
        }
    }
}

/// The delay before restart number `failures` in a row: `initial`, doubled per failure, capped.
pub fn backoff_delay(failures: u32, initial: Duration, max: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(30);
    initial.saturating_mul(1u32 << doublings).min(max)
}

/// Starts, supervises and stops inference instances. One per lodgerd; drive it from one
/// long-lived thread (see the module documentation).
#[derive(Debug)]
pub struct Instances {
    pub(super) host: Host,
    /// Sorted by key.
    pub(super) slots: Vec<Slot>,
    /// [`Instances::leave_running`] was called: dropping touches nothing.
    pub(super) left_running: bool,
}
impl Instances {
    /// Detects the cgroup mode and chooses the placement (logged with its reason).
    pub fn new(settings: InstanceSettings) -> Result<Instances, InstanceError> {
        let parent = cgroup::normalize(&settings.parent)?;
        if parent == "/" {
            return Err(CgroupError::BadPath(settings.parent.clone()).into());
        }
        let version = cgroup::detect(&settings.cgroup_root, settings.driver)?;
        let cpusets = cpusets::open(&settings.cgroup_root, version);
        let node = match version {
            CgroupVersion::V1 => cpusets.read("/", CpusetFile::Cpus)?,
            CgroupVersion::V2 => cpusets.effective_cpus("/")?,
        };
        let systemd = super::unit::systemd().is_some();
        let (placement, why) = match (settings.placement, version) {
            // Every instance is a transient unit (see `spawn`), in a cgroup systemd makes.
            (InstancePlacement::Cgroup, _) if systemd => (
                PinMethod::Affinity,
                "systemd is PID 1: each instance is a transient unit pinned by CPUAffinity; the \
                 configured cgroup placement does not apply",
            ),
            (_, _) if systemd => (
                PinMethod::Affinity,
                "systemd is PID 1: each instance is a transient unit pinned by CPUAffinity",
            ),
            (InstancePlacement::Cgroup, _) => (PinMethod::Cgroup, "configured"),
            (InstancePlacement::Affinity, _) => (PinMethod::Affinity, "configured"),
            (InstancePlacement::Auto, CgroupVersion::V1) => (PinMethod::Cgroup, "cgroup v1"),
            (InstancePlacement::Auto, CgroupVersion::V2) => {
                let controllers = cpusets.dir(&parent).join(cgroup::CGROUP_CONTROLLERS);
                let delegated = fs::read_to_string(&controllers).is_ok_and(|text| {
                    text.split_whitespace()
                        .any(|c| c == cgroup::CPUSET_CONTROLLER)
                });
                if delegated {
                    (
                        PinMethod::Cgroup,
                        "cgroup v2, cpuset delegated to lodger's cgroup",
                    )
                } else {
                    (
                        PinMethod::Affinity,
                        "cgroup v2 without cpuset delegated to lodger's cgroup (memory nodes are \
                         not enforced)",
                    )
                }
            }
        };
        let lodgers = child_of(&parent, LODGERS_CGROUP);
        let mut settings = settings;
        if settings.start_cgroup.is_none() {
            settings.start_cgroup =
                own_subtree(version, placement, systemd, &cpusets.dir(&lodgers));
        }
        let slices = super::unit::Slices::of_parent(&parent);
        let memory = super::memory::MemoryPlacement::choose(
            &settings.cgroup_root,
            version,
            placement,
            &cpusets.dir(&parent),
            systemd.then_some(&slices),
        );
        info!(
            "inference instances are placed by {} ({why}){}",
            placement.as_str(),
            match placement {
                PinMethod::Cgroup => format!(", in {}", cpusets.dir(&lodgers).display()),
                PinMethod::Affinity => String::new(),
            }
        );
        let mut reader = ProcReader::new(&settings.proc_root);
        let lists_children = reader.lists_children();
        Ok(Instances {
            host: Host {
                version,
                placement,
                cpusets,
                parent,
                lodgers,
                node,
                reader,
                table: ProcessTable::default(),
                lists_children,
                created_parent: false,
                pending_removal: Vec::new(),
                memory,
                slices,
                buf: vec![0; 64 * 1024],
                settings,
            },
            slots: Vec::new(),
            left_running: false,
        })
        .inspect(|i| i.host.log_memory())
    }

    /// Makes the running instances match `desired` (all instances of all jobs): starts missing
    /// ones, stops unwanted ones, restarts changed ones. A change of CPUs or memory nodes alone
    /// is applied in place, unless the template passes `{cpus}` on (the program may have pinned
    /// its threads itself); anything else restarts the instance once the old process is gone.
    /// Stops are asynchronous: SIGTERM here, the rest in `poll`. An online instance to start or
    /// move on a CPU a stopping instance still runs on waits until it is gone (`poll` starts or
    /// moves it; one to move serves on its old CPUs meanwhile; see `must_wait`). Idempotent.
    ///
    /// Every spec is checked first; a bad one (threads, batch, CPUs, a duplicate: the plan's
    /// mistakes) fails the whole call before anything is done. A new or changed command whose
    /// program does not exist (the owner's doing: it was deleted or moved) fails that instance
    /// only, as a failed start does: it is not started (a running one of the old command is
    /// left as it is) and its error is in the outcome, and every other instance is reconciled.
    pub fn reconcile(
        &mut self,
        desired: &[InstanceSpec],
    ) -> Result<ReconcileOutcome, InstanceError> {
        let now = Instant::now();
        let mut templates: Vec<Option<Template>> = Vec::with_capacity(desired.len());
        let mut missing = Vec::new();
        let mut failed: Vec<(&JobId, &Vec<String>)> = Vec::new();
        for (i, spec) in desired.iter().enumerate() {
            if desired[..i].iter().any(|d| d.same_instance(spec)) {
                return Err(invalid(&spec.key(), "listed twice".to_string()));
            }
            self.host.check_spec(spec)?;
            let template = match self.slot(spec) {
                Some(slot) if slot.spec.argv == spec.argv => Some(slot.template.clone()),
                // A new or changed template: its program must exist now (said once a job).
                _ if failed.contains(&(&spec.job, &spec.argv)) => None,
                _ => validate_template(&spec.job, &spec.argv)
                    .map_err(|e| {
                        missing.push(e);
                        failed.push((&spec.job, &spec.argv));
                    })
                    .ok(),
            };
            templates.push(template);
        }

        let mut out = ReconcileOutcome {
            errors: missing,
            ..ReconcileOutcome::default()
        };
        // Unwanted first: their CPUs may be wanted by the others.
        let mut i = 0;
        while i < self.slots.len() {
            if desired.iter().any(|d| d.same_instance(&self.slots[i].spec)) {
                i += 1;
                continue;
            }
            let slot = &mut self.slots[i];
            let key = slot.key();
            match &mut slot.state {
                SlotState::Running | SlotState::Moving { .. } => {
                    self.host.terminate(slot, now, None);
                    out.stopping.push(key);
                    out.changed = true;
                }
                SlotState::Stopping { next, .. } => {
                    if next.take().is_some() {
                        out.stopping.push(key);
                        out.changed = true;
                    }
                }
                SlotState::BackingOff { .. } | SlotState::Waiting => {
                    let slot = self.slots.remove(i);
                    self.host.discard(&slot, &mut out.errors);
                    out.removed.push(key);
                    out.changed = true;
                    continue;
                }
            }
            i += 1;
        }

        for (spec, template) in desired.iter().zip(templates) {
            let Some(template) = template else {
                continue;
            };
            let key = spec.key();
            let pos = match self.slots.binary_search_by(|s| s.spec.cmp_instance(spec)) {
                Ok(pos) => pos,
                Err(pos) => {
                    // Started below, once every instance this call stops is stopping.
                    let slot = Slot::new(spec.clone(), template, SlotState::Waiting);
                    out.changed = true;
                    self.slots.insert(pos, slot);
                    continue;
                }
            };
            let slot = &mut self.slots[pos];
            match &mut slot.state {
                SlotState::Stopping { next, .. } => {
                    let same = next.as_ref().is_some_and(|(s, _)| s == spec);
                    if !same {
                        *next = Some((spec.clone(), template));
                        out.restarting.push(key);
                        out.changed = true;
                    }
                }
                SlotState::BackingOff { .. } => {
                    if slot.spec != *spec {
                        // The new spec may be what fixes it: try at once (below).
                        slot.spec = spec.clone();
                        slot.template = template;
                        slot.state = SlotState::Waiting;
                        out.changed = true;
                    }
                }
                SlotState::Waiting => {
                    if slot.spec != *spec {
                        slot.spec = spec.clone();
                        slot.template = template;
                        out.changed = true;
                    }
                }
                SlotState::Running | SlotState::Moving { .. } => {
                    let wanted = match &slot.state {
                        SlotState::Moving { to } => to,
                        _ => &slot.spec,
                    };
                    if wanted == spec {
                        continue;
                    }
                    if slot.spec == *spec {
                        // Wanted where it runs again: the move it waited for is off.
                        slot.state = SlotState::Running;
                        out.changed = true;
                        continue;
                    }
                    let in_place = slot.spec.argv == spec.argv
                        && slot.spec.threads == spec.threads
                        && slot.spec.batch == spec.batch
                        && !slot.template.uses(Placeholder::Cpus);
                    if in_place {
                        // Moved below, once every instance this call stops is stopping.
                        slot.state = SlotState::Moving { to: spec.clone() };
                        out.changed = true;
                    } else {
                        self.host
                            .terminate(slot, now, Some((spec.clone(), template)));
                        out.restarting.push(key);
                        out.changed = true;
                    }
                }
            }
        }
        // New instances and moves after the loop, not in it: an instance this call restarts
        // further down the list still runs on its old CPUs until it has been signalled.
        self.start_or_move_held(now, &mut out);
        Ok(out)
    }

    /// Reaps exited instances (killing what they left behind), restarts them after their
    /// back-off, finishes stops (SIGKILL after the grace period), reads report lines. Call it
    /// often (every tick); it never blocks for long.
    pub fn poll(&mut self) -> PollOutcome {
        let now = Instant::now();
        let mut out = PollOutcome::default();
        self.host.retry_removals();
        let had_slots = !self.slots.is_empty();
        // Units' OOM kills are counted in their shared slice: read once per poll.
        let slice_ooms = self.host.oom_kills(None);
        let mut i = 0;
        while i < self.slots.len() {
            // Only for a slot that may start now: it is a pass over every slot.
            let may_start = match &self.slots[i].state {
                SlotState::Running => false,
                SlotState::BackingOff { at } => now >= *at,
                SlotState::Waiting | SlotState::Moving { .. } => true,
                SlotState::Stopping { next, .. } => next.is_some(),
            };
            let held = if may_start {
                held_cpus(&self.slots, Some(i), &self.host.settings.cores)
            } else {
                Held::default()
            };
            let slot = &mut self.slots[i];
            out.reports += self.host.read_reports(slot, now);
            slot.reports.trim(now, self.host.settings.window);
            let key = slot.key();
            let exited = slot.run.as_mut().and_then(Run::reap);
            match &mut slot.state {
                SlotState::Running | SlotState::Moving { .. } => {
                    if let Some(how) = exited {
                        let how = self.host.oom_verdict(slot, how, slice_ooms);
                        let moving = std::mem::replace(&mut slot.state, SlotState::Running);
                        self.host.on_exit(slot, now, &how, &mut out.errors);
                        if let SlotState::Moving { to } = moving {
                            // It never moved: it starts again where the plan wants it.
                            slot.spec = to;
                        }
                        warn!(
                            instance = %key,
                            "exited on its own ({how}); restarting in {:?}",
                            slot.backoff
                        );
                        out.exited.push((key, how));
                    } else {
                        if slot.run.as_ref().is_some_and(|r| r.unit.is_some()) {
                            // A running unit's baseline follows the slice's count.
                            slot.oom_seen = slice_ooms;
                        }
                        if let Err(e) = self.host.repin(slot, now) {
                            out.errors.push(e);
                        }
                        let free = matches!(&slot.state, SlotState::Moving { to } if !must_wait(to, &held));
                        if free {
                            match self.host.finish_move(slot) {
                                Ok(true) => out.moved.push(key),
                                Ok(false) => {}
                                Err(e) => out.errors.push(e),
                            }
                        }
                    }
                }
                SlotState::BackingOff { at } => {
                    if now >= *at && !must_wait(&slot.spec, &held) {
                        match self.host.start(slot, now) {
                            Ok(()) => {
                                slot.restarts += 1;
                                out.started.push(key);
                            }
                            Err(e) => out.errors.push(e),
                        }
                    }
                }
                SlotState::Waiting => {
                    if !must_wait(&slot.spec, &held) {
                        match self.host.start(slot, now) {
                            Ok(()) => out.started.push(key),
                            Err(e) => out.errors.push(e),
                        }
                    }
                }
                SlotState::Stopping {
                    kill_at,
                    killed_at,
                    stuck,
                    next,
                } => {
                    if let Some(how) = exited {
                        debug!(instance = %key, "stopped ({how})");
                        slot.last_exit = Some(how);
                        let next = next.take();
                        self.host.finish_run(slot, now, &mut out.errors);
                        out.stopped.push(key.clone());
                        match next {
                            Some((spec, template)) => {
                                // Measurements start afresh with the new process.
                                slot.spec = spec;
                                slot.template = template;
                                if must_wait(&slot.spec, &held) {
                                    debug!(
                                        instance = %key,
                                        "waits for a stopping instance to leave its CPUs"
                                    );
                                    slot.state = SlotState::Waiting;
                                } else {
                                    match self.host.start(slot, now) {
                                        Ok(()) => out.started.push(key),
                                        Err(e) => out.errors.push(e),
                                    }
                                }
                            }
                            None => {
                                let slot = self.slots.remove(i);
                                self.host.discard(&slot, &mut out.errors);
                                continue;
                            }
                        }
                    } else if killed_at.is_none() && now >= *kill_at {
                        warn!(
                            instance = %key,
                            "still running {:?} after SIGTERM: SIGKILL",
                            self.host.settings.stop_grace
                        );
                        self.host.kill_run(slot, &mut out.errors);
                        if let SlotState::Stopping { killed_at, .. } = &mut slot.state {
                            *killed_at = Some(now);
                        }
                        out.killed.push(key);
                    } else if let (Some(at), Some(run), false) = (*killed_at, &slot.run, *stuck) {
                        if now.saturating_duration_since(at) > KILL_WAIT {
                            *stuck = true;
                            out.errors.push(InstanceError::Unkillable {
                                key,
                                pid: run.pid,
                                waited: now.saturating_duration_since(at),
                            });
                        }
                    }
                }
            }
            i += 1;
        }
        if had_slots && self.slots.is_empty() {
            // The last instance is gone (a drain, the last job unregistered): lodger's instance
            // cgroups and slices go with it, as lodgerd no longer removes them when it stops.
            self.host.remove_lodgers(&mut out.errors);
            super::unit::stop_slices_if_connected(&self.host.slices);
        }
        out
    }

    /// Per instance, sorted by job and index.
    pub fn stats(&self) -> Vec<InstanceStats> {
        let settings = &self.host.settings;
        stats_of(
            &self.slots,
            Instant::now(),
            settings.window,
            &settings.cores,
        )
    }

    /// `job`'s running instances' batch latencies pooled over the window (see
    /// [`PooledLatency`]): a layout probe's p99 as the job's requests see it. None when none of
    /// them reported a batch in the window.
    pub fn pooled_latency(&self, job: &JobId) -> Option<PooledLatency> {
        let logs = self
            .slots
            .iter()
            .filter(|s| s.spec.job == *job)
            .filter(|s| matches!(s.state, SlotState::Running | SlotState::Moving { .. }))
            .map(|s| (&s.reports, s.run.as_ref().map(|r| r.started)));
        super::report::pooled(logs, Instant::now(), self.host.settings.window)
    }

    pub(super) fn slot(&self, spec: &InstanceSpec) -> Option<&Slot> {
        self.slots
            .binary_search_by(|s| s.spec.cmp_instance(spec))
            .ok()
            .and_then(|i| self.slots.get(i))
    }
}

pub(super) fn invalid(key: &InstanceKey, problem: String) -> InstanceError {
    InstanceError::InvalidSpec {
        key: key.clone(),
        problem,
    }
}

pub(super) fn describe_exit(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    if let Some(sig) = status.signal() {
        let name = Signal::try_from(sig).map_or("an unknown signal", |s| s.as_str());
        let core = if status.core_dumped() {
            " (core dumped)"
        } else {
            ""
        };
        return format!("killed by {name}{core}");
    }
    status.to_string()
}

pub(super) fn pid_of(pid: u32) -> Option<Pid> {
    i32::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .map(Pid::from_raw)
}

/// Where affinity-placed instances live on cgroup v2 without systemd as PID 1 (issue 17): in
/// lodger's own subtree, `dir` (`<parent>/lodgers`, created here), not in lodgerd's cgroup, so a
/// supervisor that stops or kills lodgerd's cgroup leaves them running. Under systemd they are
/// transient units in lodger's slice instead, and with cgroup placement (v1, or v2 with cpuset
/// delegated) each has a cgroup of its own there already: `None`. Also `None`, after one log
/// line, when the directory cannot be made (lodgerd confined to a delegated subtree): the
/// instances then stay in lodgerd's cgroup.
pub(super) fn own_subtree(
    version: CgroupVersion,
    placement: PinMethod,
    systemd: bool,
    dir: &Path,
) -> Option<PathBuf> {
    if version != CgroupVersion::V2 || placement != PinMethod::Affinity || systemd {
        return None;
    }
    match fs::create_dir_all(dir) {
        Ok(()) => {
            info!(
                "inference instances start in {}, outside lodgerd's cgroup, so they outlive it",
                dir.display()
            );
            Some(dir.to_path_buf())
        }
        Err(e) => {
            warn!(
                "inference instances stay in lodgerd's cgroup (a stop of its cgroup stops them \
                 too): cannot create {}: {e}",
                dir.display()
            );
            None
        }
    }
}
