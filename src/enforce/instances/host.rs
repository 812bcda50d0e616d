//! Everything of the instance runner that touches the node apart from the slots: the cpuset
//! hierarchy (lodger's `<parent>/lodgers` subtree), moving and killing processes, removing
//! cgroups, reading report pipes. Touches cgroupfs, /proc and signals.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use tracing::{info, warn};

use super::error::InstanceError;
use super::supervisor::{backoff_delay, invalid, pid_of, Slot, SlotState};
use super::template::Template;
use super::unit;
use super::{
    InstanceKey, InstanceSettings, InstanceSpec, CGROUP_KILL, MAX_REPORT_BYTES_PER_POLL,
    REMOVE_WAIT, STEP,
};
use crate::cpuset::CpuSet;
use crate::enforce::cpusets::{self, CpusetHierarchy};
use crate::enforce::sched::{self, AffinityState, CpuMask};
use crate::enforce::PinMethod;
use crate::sys::cgroupfs::{child_of, CgroupError, CgroupVersion};
use crate::sys::procfs::{ProcReader, ProcessTable};

/// Most passes of a move by affinity ([`Host::pin_tree`]): the second finds what was created
/// during the first, and only an instance forking from processes created during each pass needs
/// more.
const PIN_PASSES: usize = 4;
/// How long after a move by affinity each poll walks the instance's tree again (see
/// [`Host::repin`]): two ticks at the default 1-s interval. A walk costs the instance's own
/// processes (tens of microseconds), not the node's.
pub(super) const REPIN_FOR: Duration = Duration::from_secs(2);

/// Everything that touches the node, apart from the slots.
#[derive(Debug)]
pub(super) struct Host {
    pub(super) settings: InstanceSettings,
    pub(super) version: CgroupVersion,
    pub(super) placement: PinMethod,
    pub(super) cpusets: Box<dyn CpusetHierarchy>,
    /// Normalized `settings.parent`.
    pub(super) parent: String,
    /// `<parent>/lodgers`.
    pub(super) lodgers: String,
    /// The CPUs of the node (the cpuset hierarchy's root).
    pub(super) node: CpuSet,
    pub(super) reader: ProcReader,
    /// Every process's parent, for an instance's descendants where the kernel does not list
    /// children (see [`Host::pin_pass`]).
    pub(super) table: ProcessTable,
    /// Whether the kernel lists each thread's children (`ProcReader::lists_children`).
    pub(super) lists_children: bool,
    /// lodger's parent cgroup was created here (not by the training enforcer): remove it with the
    /// last instance.
    pub(super) created_parent: bool,
    /// Instance cgroups whose killed processes had not left yet: removal is retried.
    pub(super) pending_removal: Vec<String>,
    /// Where instances' memory limits go.
    pub(super) memory: super::memory::MemoryPlacement,
    /// The slices of the instance units, where systemd starts them.
    pub(super) slices: super::unit::Slices,
    pub(super) buf: Vec<u8>,
}

impl Host {
    pub(super) fn check_spec(&self, spec: &InstanceSpec) -> Result<(), InstanceError> {
        let key = spec.key();
        if spec.threads == 0 {
            return Err(invalid(&key, "threads must be at least 1".to_string()));
        }
        if spec.batch == 0 {
            return Err(invalid(&key, "batch must be at least 1".to_string()));
        }
        if spec.cpus.is_empty() {
            return Err(invalid(&key, "it has no CPU".to_string()));
        }
        if !self.node.is_empty() && !spec.cpus.is_subset(&self.node) {
            return Err(invalid(
                &key,
                format!(
                    "CPUs {} are not all on this node (it has {})",
                    spec.cpus, self.node
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn instance_cgroup(&self, key: &InstanceKey) -> String {
        child_of(&self.lodgers, &key.to_string())
    }

    /// Creates `<parent>`, `<parent>/lodgers` and the instance's cgroup as needed, and gives it
    /// `cpus` and `mems` (mems first; v1: the ancestors grow first, they never shrink).
    pub(super) fn ensure_cgroup(
        &mut self,
        cg: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
    ) -> Result<bool, CgroupError> {
        let h = &*self.cpusets;
        let mut changed = false;
        if !h.exists(&self.parent) {
            h.create(&self.parent)?;
            self.created_parent = true;
            changed = true;
        }
        for c in [self.lodgers.as_str(), cg] {
            if !h.exists(c) {
                // v2: the cgroup gets cpuset files only if its parent enables the controller,
                // which lodger may do inside its own cgroup only.
                h.enable_cpuset(c, &self.parent)?;
                h.create(c)?;
                changed = true;
            }
            if !h.cpuset_enabled(c)? {
                h.enable_cpuset(c, &self.parent)?;
                changed = true;
            }
        }
        changed |= self.set_cpuset(cg, cpus, mems)?;
        Ok(changed)
    }

    pub(super) fn set_cpuset(
        &self,
        cg: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
    ) -> Result<bool, CgroupError> {
        let h = &*self.cpusets;
        // Other instances (and, for the parent, training jobs) live below the ancestors.
        let ancestors = [self.parent.as_str(), self.lodgers.as_str()];
        let entries = cpusets::set_with_ancestors(h, cg, cpus, mems, &ancestors, None)?;
        if entries.is_empty() {
            return Ok(false);
        }
        cpusets::write_nested(h, &entries)
    }

    /// Starts the slot's process (its state becomes `Running`); on failure the slot backs off.
    pub(super) fn start(&mut self, slot: &mut Slot, now: Instant) -> Result<(), InstanceError> {
        match self.spawn(slot, now) {
            Ok(run) => {
                info!(
                    instance = %slot.key(),
                    pid = run.pid,
                    cpus = %slot.spec.cpus,
                    threads = slot.spec.threads,
                    batch = slot.spec.batch,
                    "instance started"
                );
                slot.run = Some(run);
                slot.oom_seen = self.oom_kills_of(slot);
                slot.state = SlotState::Running;
                slot.last_error = None;
                slot.reports.restart();
                Ok(())
            }
            Err(e) => {
                slot.failures = slot.failures.saturating_add(1);
                slot.backoff = backoff_delay(
                    slot.failures,
                    self.settings.backoff_initial,
                    self.settings.backoff_max,
                );
                slot.state = SlotState::BackingOff {
                    at: now + slot.backoff,
                };
                slot.last_error = Some(e.to_string());
                warn!(instance = %slot.key(), "cannot start: {e}; retrying in {:?}", slot.backoff);
                Err(e)
            }
        }
    }

    /// CPUs (and memory nodes) changed alone: move the running instance. Returns whether
    /// anything was written. A move by affinity marks the slot for more walks of its tree at the
    /// polls that follow ([`Slot::repin_until`]).
    pub(super) fn move_in_place(
        &mut self,
        slot: &mut Slot,
        spec: &InstanceSpec,
    ) -> Result<bool, InstanceError> {
        let key = slot.key();
        // A transient unit's process is outside lodger's cgroups: moved by affinity.
        let by_unit = slot.run.as_ref().is_some_and(|r| r.unit.is_some());
        let placement = if by_unit {
            PinMethod::Affinity
        } else {
            self.placement
        };
        match (placement, &slot.cgroup) {
            (PinMethod::Cgroup, Some(cg)) => self
                .set_cpuset(cg, &spec.cpus, &spec.mems)
                .map_err(|source| InstanceError::Cgroup { key, source }),
            (PinMethod::Cgroup, None) => Ok(false),
            (PinMethod::Affinity, _) => {
                let Some(run) = &slot.run else {
                    return Ok(false);
                };
                if slot.spec.cpus == spec.cpus {
                    return Ok(false);
                }
                let moved = self.pin_tree(&key, run.pid, &spec.cpus)?;
                if moved {
                    slot.repin_until = Some(Instant::now() + REPIN_FOR);
                }
                Ok(moved)
            }
        }
    }

    /// The walks after a move by affinity ([`Slot::repin_until`]), at each poll for
    /// [`REPIN_FOR`]: a process whose fork began before its parent moved has the old CPUs, and
    /// is listed among its parent's children only once the fork is done, which on a loaded node
    /// can be after every pass of the move. Nothing when the slot is not marked or no longer
    /// runs.
    pub(super) fn repin(&mut self, slot: &mut Slot, now: Instant) -> Result<(), InstanceError> {
        match slot.repin_until {
            Some(until) if now <= until => {}
            _ => {
                slot.repin_until = None;
                return Ok(());
            }
        }
        match &slot.run {
            Some(run) => self
                .pin_tree(&slot.key(), run.pid, &slot.spec.cpus)
                .map(drop),
            None => Ok(()),
        }
    }

    /// An adopted instance: where its spec says, whatever the previous lodgerd last did (its
    /// cgroup's cpuset, or every thread of its process tree by affinity).
    pub(super) fn place_again(&mut self, slot: &Slot) -> Result<(), InstanceError> {
        let key = slot.key();
        match (&slot.cgroup, &slot.run) {
            (Some(cg), _) => self
                .set_cpuset(cg, &slot.spec.cpus, &slot.spec.mems)
                .map(|_| ())
                .map_err(|source| InstanceError::Cgroup { key, source }),
            (None, Some(run)) => self.pin_tree(&key, run.pid, &slot.spec.cpus).map(|_| ()),
            (None, None) => Ok(()),
        }
    }

    /// Every thread of `pid` and its descendants on `cpus`; returns whether one moved. A thread
    /// or process created while a pass runs, by one not moved yet, has the old CPUs and is not in
    /// the pass's list: passes repeat until one moves nothing (everything then created comes
    /// from a thread already moved), at most [`PIN_PASSES`].
    fn pin_tree(
        &mut self,
        key: &InstanceKey,
        pid: u32,
        cpus: &CpuSet,
    ) -> Result<bool, InstanceError> {
        let mask = CpuMask::from_cpuset(cpus);
        let mut changed = false;
        for _ in 0..PIN_PASSES {
            if !self.pin_pass(key, pid, &mask)? {
                return Ok(changed);
            }
            changed = true;
        }
        warn!(
            instance = %key,
            "its processes were still being created on other CPUs after {PIN_PASSES} passes"
        );
        Ok(changed)
    }

    /// One pass of [`Host::pin_tree`]: returns whether a thread moved. The instance's tree is
    /// walked through its threads' children (`ProcReader::walk_tree`), each process's threads
    /// moved before its children are read: the instance's own processes read, where the
    /// fall-back, on kernels that do not list children, reads every process's parent from /proc,
    /// on each pass.
    fn pin_pass(
        &mut self,
        key: &InstanceKey,
        pid: u32,
        mask: &CpuMask,
    ) -> Result<bool, InstanceError> {
        let mut changed = false;
        let mut pin = |_: u32, tids: &[u32]| -> Result<(), InstanceError> {
            for &tid in tids {
                match sched::ensure_affinity(tid, mask) {
                    Ok(AffinityState::Changed) => changed = true,
                    Ok(_) => {}
                    Err(source) => {
                        return Err(InstanceError::Sched {
                            key: key.clone(),
                            source,
                        })
                    }
                }
            }
            Ok(())
        };
        if self.lists_children {
            self.reader.walk_tree(&[pid], &mut Vec::new(), pin)?;
            return Ok(changed);
        }
        self.table.rescan(&mut self.reader)?;
        let mut pids = vec![pid];
        self.table.descendants(&[pid], &mut pids);
        let mut tids = Vec::new();
        for pid in pids {
            tids.clear();
            self.reader.threads(pid, &mut tids)?;
            pin(pid, &tids)?;
        }
        Ok(changed)
    }

    /// SIGTERM to the instance's process group; the slot starts stopping.
    pub(super) fn terminate(
        &self,
        slot: &mut Slot,
        now: Instant,
        next: Option<(InstanceSpec, Template)>,
    ) {
        if let Some(run) = &slot.run {
            let by_systemd = match (&run.unit, unit::systemd()) {
                // Every process of the unit, not only the group.
                (Some((name, _)), Some(systemd)) => systemd.kill(name, libc::SIGTERM).is_ok(),
                _ => false,
            };
            if let (false, Some(pgid)) = (by_systemd, pid_of(run.pid)) {
                // ESRCH: it exited meanwhile; `poll` reaps it.
                let _ = killpg(pgid, Signal::SIGTERM);
            }
        }
        slot.state = SlotState::Stopping {
            kill_at: now + self.settings.stop_grace,
            killed_at: None,
            stuck: false,
            next,
        };
    }

    /// SIGKILL to the instance's process group and everything in its cgroup.
    pub(super) fn kill_run(&self, slot: &Slot, errors: &mut Vec<InstanceError>) {
        if let Some(run) = &slot.run {
            if let (Some((name, _)), Some(systemd)) = (&run.unit, unit::systemd()) {
                // SIGKILL to the whole unit, then stop it (it is collected once inactive).
                let _ = systemd.kill(name, libc::SIGKILL);
                let _ = systemd.stop(name);
            }
            if let Some(pgid) = pid_of(run.pid) {
                match killpg(pgid, Signal::SIGKILL) {
                    Ok(()) | Err(Errno::ESRCH) => {}
                    Err(errno) => errors.push(InstanceError::Signal {
                        key: slot.key(),
                        pid: run.pid,
                        signal: Signal::SIGKILL,
                        errno,
                    }),
                }
            }
        }
        if let Some(cg) = &slot.cgroup {
            if let Err(e) = self.kill_cgroup(cg) {
                errors.push(e);
            }
        }
    }

    /// The process is gone (reaped, its group killed by [`Run::reap`]): kill what it left in its
    /// cgroup, read its last reports.
    pub(super) fn finish_run(
        &mut self,
        slot: &mut Slot,
        now: Instant,
        errors: &mut Vec<InstanceError>,
    ) {
        self.read_reports(slot, now);
        if let Some(cg) = &slot.cgroup {
            if let Err(e) = self.kill_cgroup(cg) {
                errors.push(e);
            }
        }
        slot.run = None;
        if let Some(dir) = &self.settings.report_dir {
            let _ = fs::remove_file(super::spawn::report_path(dir, &slot.key()));
        }
    }

    /// An instance exited on its own: back off before the restart.
    pub(super) fn on_exit(
        &mut self,
        slot: &mut Slot,
        now: Instant,
        how: &str,
        errors: &mut Vec<InstanceError>,
    ) {
        let ran = slot
            .run
            .as_ref()
            .map_or(Duration::ZERO, |r| now.saturating_duration_since(r.started));
        self.finish_run(slot, now, errors);
        if ran >= self.settings.stable_after {
            slot.failures = 0;
        }
        slot.failures = slot.failures.saturating_add(1);
        slot.backoff = backoff_delay(
            slot.failures,
            self.settings.backoff_initial,
            self.settings.backoff_max,
        );
        slot.last_exit = Some(how.to_string());
        slot.state = SlotState::BackingOff {
            at: now + slot.backoff,
        };
    }

    /// A slot leaves for good: its cgroup goes.
    pub(super) fn discard(&mut self, slot: &Slot, errors: &mut Vec<InstanceError>) {
        if slot.cgroup.is_none() {
            // Affinity placement on v1: its memory twin alone.
            self.remove_memory(&[&self.instance_cgroup(&slot.key())]);
        }
        if let Some(cg) = &slot.cgroup {
            if let Err(source) = self.remove_cgroup(cg, REMOVE_WAIT) {
                errors.push(InstanceError::Cgroup {
                    key: slot.key(),
                    source,
                });
            }
        }
        info!(instance = %slot.key(), "instance removed");
    }

    /// Reads what the instance wrote since the last call, up to [`MAX_REPORT_BYTES_PER_POLL`];
    /// returns the good lines.
    pub(super) fn read_reports(&mut self, slot: &mut Slot, now: Instant) -> u64 {
        let key = slot.key();
        let Some(run) = slot.run.as_mut() else {
            return 0;
        };
        let Some(pipe) = run.report.as_mut() else {
            return 0;
        };
        let mut good = 0;
        let mut read = 0;
        while read < MAX_REPORT_BYTES_PER_POLL {
            // Never past the cap: the last read is cut to what is left of it.
            let room = self.buf.len().min(MAX_REPORT_BYTES_PER_POLL - read);
            match pipe.read(&mut self.buf[..room]) {
                Ok(0) => {
                    run.report = None;
                    break;
                }
                Ok(n) => {
                    read += n;
                    let bytes = self.buf.get(..n).unwrap_or_default();
                    good += slot.reports.feed(&key, bytes, now);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!(instance = %key, "cannot read its report pipe: {e}");
                    run.report = None;
                    break;
                }
            }
        }
        good
    }

    /// SIGKILL to every process of a cgroup; returns their pids.
    pub(super) fn kill_cgroup(&self, cg: &str) -> Result<Vec<u32>, InstanceError> {
        let h = &*self.cpusets;
        let mut pids = Vec::new();
        match h.procs(cg, &mut pids) {
            Ok(()) => {}
            Err(e) if e.is_gone() => return Ok(pids),
            Err(e) => return Err(e.into()),
        }
        if pids.is_empty() {
            return Ok(pids);
        }
        let kill_file = h.dir(cg).join(CGROUP_KILL);
        if self.version == CgroupVersion::V2
            && kill_file.is_file()
            && fs::write(&kill_file, "1").is_ok()
        {
            return Ok(pids);
        }
        for &pid in &pids {
            let Some(p) = pid_of(pid) else { continue };
            match kill(p, Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(errno) => return Err(InstanceError::Leftover { pid, errno }),
            }
        }
        Ok(pids)
    }

    /// Waits up to `wait` for the cgroup to empty, then removes it. `Ok(false)`: still in use, to
    /// be retried by `poll`.
    pub(super) fn remove_cgroup(&mut self, cg: &str, wait: Duration) -> Result<bool, CgroupError> {
        let h = &*self.cpusets;
        let deadline = Instant::now() + wait;
        loop {
            match h.remove_if_unused(cg) {
                Ok(true) => {
                    self.pending_removal.retain(|c| c != cg);
                    self.remove_memory(&[cg]);
                    return Ok(true);
                }
                Ok(false) if Instant::now() < deadline => std::thread::sleep(STEP),
                Ok(false) => {
                    if !self.pending_removal.iter().any(|c| c == cg) {
                        self.pending_removal.push(cg.to_string());
                    }
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(super) fn retry_removals(&mut self) {
        for cg in std::mem::take(&mut self.pending_removal) {
            let _ = self.kill_cgroup(&cg);
            match self.remove_cgroup(&cg, Duration::ZERO) {
                Ok(_) => {}
                Err(e) => warn!("cannot remove instance cgroup {cg}: {e}"),
            }
        }
    }

    /// Removes `<parent>/lodgers` when no instance cgroup is left, and `<parent>` if it was
    /// created here and nothing else uses it.
    pub(super) fn remove_lodgers(&mut self, errors: &mut Vec<InstanceError>) {
        if !self.pending_removal.is_empty() {
            return;
        }
        self.remove_memory(&[self.lodgers.as_str(), self.parent.as_str()]);
        let h = &*self.cpusets;
        match h.remove_if_unused(&self.lodgers) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                errors.push(e.into());
                return;
            }
        }
        if self.created_parent {
            match h.remove_if_unused(&self.parent) {
                Ok(true) => self.created_parent = false,
                Ok(false) => {}
                Err(e) => errors.push(e.into()),
            }
        }
    }
}

/// The host as [`Instances`](super::Instances)' callers see it: how instances are placed, where
/// their cgroups are.
impl super::Instances {
    pub fn placement(&self) -> PinMethod {
        self.host.placement
    }

    /// The cgroup2 directory affinity-placed instances join before exec, if any (see
    /// [`InstanceSettings::start_cgroup`]).
    pub fn start_cgroup(&self) -> Option<&Path> {
        self.host.settings.start_cgroup.as_deref()
    }

    pub fn cgroup_version(&self) -> CgroupVersion {
        self.host.version
    }

    /// The directory of an instance cgroup named in [`InstanceStats::cgroup`](super::InstanceStats::cgroup).
    pub fn cgroup_dir(&self, cgroup: &str) -> PathBuf {
        self.host.cpusets.dir(cgroup)
    }

    pub fn settings(&self) -> &InstanceSettings {
        &self.host.settings
    }

    /// The cgroup (v2, from the hierarchy's root) of the instance unit named in
    /// [`InstanceStats::unit`](super::InstanceStats::unit).
    pub fn unit_cgroup(&self, unit: &str) -> String {
        format!("{}/{unit}", self.host.slices.cgroup().display())
    }

    /// Affinity placement: instances started from now on join the cgroup2 directory `dir`
    /// before exec ([`InstanceSettings::start_cgroup`]). No effect with cgroup placement, where
    /// each instance has its own cgroup from the start.
    pub fn start_in_cgroup(&mut self, dir: PathBuf) {
        self.host.settings.start_cgroup = Some(dir);
    }

    /// For the spine benchmark's baseline only: with `true`, a move by affinity finds an
    /// instance's descendants as before, from every process's parent read from /proc on each
    /// pass, rather than from each thread's children.
    #[doc(hidden)]
    pub fn descendants_from_proc(&mut self, on: bool) {
        self.host.lists_children = !on && self.host.reader.lists_children();
    }
}
