//! Re-adopting what a previous lodgerd left running (a restart, an upgrade, a crash): each wanted
//! instance whose process still runs is found by the marks its environment carries
//! (`LODGER_PARENT`, `LODGER_JOB`, `LODGER_INSTANCE`, and the threads and batch it was started
//! with), followed through a pidfd from then on and heard again through its report FIFO; anything
//! else a previous lodgerd left (an instance no longer wanted, or started with other settings,
//! the processes it started, its cgroup and FIFO) is killed and removed. Touches /proc, signals,
//! lodger's instance cgroups and the report directory through [`Host`](super::host::Host).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::time::Instant;

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use tracing::{info, warn};

use super::error::InstanceError;
use super::spawn::{open_report_fifo, pidfd_open, report_path};
use super::supervisor::{exited, pid_of, Instances, Run, Slot, SlotState};
use super::template::validate_template;
use super::unit;
use super::{
    InstanceKey, InstanceSpec, ENV_BATCH, ENV_INSTANCE, ENV_JOB, ENV_PARENT, ENV_THREADS,
    KILL_WAIT, STEP,
};
use crate::enforce::PinMethod;
use crate::sys::procfs;

/// What [`Instances::adopt`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AdoptOutcome {
    /// Instances supervised again, with their processes' pids.
    pub adopted: Vec<(InstanceKey, u32)>,
    /// Processes killed: left by instances no longer wanted, or started with other settings.
    pub killed: Vec<u32>,
    /// Instance cgroups removed, relative to the cpuset hierarchy.
    pub removed_cgroups: Vec<String>,
}

/// A process carrying this lodger's mark.
#[derive(Debug)]
struct Marked {
    pid: u32,
    pgrp: u32,
    job: String,
    index: Option<u32>,
    threads: Option<u32>,
    batch: Option<u32>,
    /// Its unit, when it runs in one of lodger's transient units.
    unit: Option<String>,
    start_time: u64,
    /// Its uid, when its real and effective uids agree (as in every process lodger starts: all
    /// of them are set to the owner's).
    uid: Option<u32>,
}

impl Instances {
    /// Supervises again the instances in `desired` (what the persisted plan wants) whose
    /// processes a previous lodgerd left running, and removes every other leftover: processes
    /// marked with this lodger's `LODGER_PARENT`, lodger's instance cgroups and report FIFOs.
    /// An adopted instance keeps its process (nothing is restarted); its CPUs are set again to
    /// what `desired` says, once the leftovers are killed and gone (up to `KILL_WAIT`), so
    /// that an online instance's cores are its own from then on. Run once at start, before the
    /// first `reconcile`.
    pub fn adopt(&mut self, desired: &[InstanceSpec]) -> Result<AdoptOutcome, InstanceError> {
        if !self.slots.is_empty() {
            return Err(InstanceError::SweepWithInstances {
                running: self.slots.len(),
            });
        }
        let now = Instant::now();
        let marked = self.host.marked()?;
        let mut out = AdoptOutcome::default();
        // The instances to adopt: each wanted one whose process still runs.
        let mut chosen: Vec<(&InstanceSpec, &Marked)> = Vec::new();
        for spec in desired {
            let key = spec.key();
            // The marks are environment variables anyone can set: only a process of the
            // instance's owner may be taken for it, so nobody gets another user's instance
            // killed and their own process placed on its CPUs in its stead.
            let Some(m) = marked.iter().find(|m| {
                m.pid == m.pgrp
                    && m.uid == Some(spec.identity.uid)
                    && m.job == spec.job.as_str()
                    && m.index == Some(spec.index)
                    && m.threads == Some(spec.threads)
                    && m.batch == Some(spec.batch)
            }) else {
                continue;
            };
            if chosen.iter().any(|(s, _)| s.key() == key) {
                continue;
            }
            chosen.push((spec, m));
        }
        // The leftovers go first, and are waited for: an adopted online instance set on its
        // CPUs again while a killed leftover still ran there was two holders on one core.
        let groups = chosen.iter().map(|(_, m)| m.pid).collect();
        let kept = chosen
            .iter()
            .filter_map(|(spec, m)| self.host.adopted_cgroup(&spec.key(), m))
            .collect();
        let mut first = self.kill_unadopted(&marked, &groups, &kept, &mut out).err();
        for &(spec, m) in &chosen {
            let key = spec.key();
            match self.adopt_one(spec, m, now) {
                Ok(slot) => {
                    info!(instance = %key, pid = m.pid, "instance adopted from a previous lodgerd");
                    out.adopted.push((key, m.pid));
                    let pos = self
                        .slots
                        .binary_search_by(|s| s.key().cmp(&slot.key()))
                        .unwrap_or_else(|p| p);
                    self.slots.insert(pos, slot);
                }
                Err(e) => {
                    warn!(instance = %key, "cannot adopt pid {}: {e}; starting it again", m.pid)
                }
            }
        }
        if out.adopted.len() < chosen.len() {
            // Those not adopted after all are leftovers too.
            let groups = out.adopted.iter().map(|(_, pid)| *pid).collect();
            let kept = self.slots.iter().filter_map(|s| s.cgroup.clone()).collect();
            let again = self.kill_unadopted(&marked, &groups, &kept, &mut out);
            first = first.or(again.err());
        }
        let rest = self.remove_unadopted(&mut out);
        first.or(rest.err()).map_or(Ok(out), Err)
    }

    fn adopt_one(
        &mut self,
        spec: &InstanceSpec,
        m: &Marked,
        now: Instant,
    ) -> Result<Slot, InstanceError> {
        let key = spec.key();
        let template = validate_template(&spec.job, &spec.argv)?;
        let spawn_err = |source| InstanceError::Spawn {
            key: key.clone(),
            program: spec.argv.first().cloned().unwrap_or_default(),
            source,
        };
        let pidfd = pidfd_open(m.pid).map_err(spawn_err)?;
        // Still the process that was marked (not a reused pid).
        let stat = self.host.reader.stat(m.pid).ok().flatten();
        if stat.map(|s| s.start_time) != Some(m.start_time) {
            return Err(spawn_err(std::io::Error::from_raw_os_error(libc::ESRCH)));
        }
        let report = match &self.host.settings.report_dir {
            Some(dir) => Some(File::from(
                open_report_fifo(&report_path(dir, &key)).map_err(|source| {
                    InstanceError::Pipe {
                        key: key.clone(),
                        source,
                    }
                })?,
            )),
            None => None,
        };
        let cgroup = self
            .host
            .adopted_cgroup(&key, m)
            .filter(|cg| self.host.cpusets.exists(cg));
        let (unit, adopted) = match &m.unit {
            Some(name) => (Some((name.clone(), pidfd)), None),
            None => (None, Some(pidfd)),
        };
        let mut slot = Slot::new(spec.clone(), template, SlotState::Running);
        slot.cgroup = cgroup;
        slot.run = Some(Run {
            child: None,
            unit,
            adopted,
            pid: m.pid,
            started: now,
            report,
        });
        slot.reports.restart();
        // The limit it was started with, unless the node's changed meanwhile.
        slot.memory_max = self.host.memory_limit(spec.memory_max);
        slot.oom_seen = self.host.oom_kills_of(&slot);
        // Where the plan wants it now (the plan may have changed just before the restart).
        self.host.place_again(&slot)?;
        Ok(slot)
    }

    /// Kills every marked process that is not an adopted instance's (`groups`: their process
    /// groups), and every instance cgroup but `kept` with what runs in it, and waits for them to
    /// be gone (up to `KILL_WAIT`). An adopted instance's processes are those in its process
    /// group, and those carrying its mark (its job and index) that started no earlier than it
    /// did: a child that left the group (`setsid`) is still the instance's, a process of an
    /// earlier start of it is not. Goes on past a failure, so one leftover that cannot be
    /// killed or removed does not keep the others; the first failure is returned.
    fn kill_unadopted(
        &mut self,
        marked: &[Marked],
        groups: &BTreeSet<u32>,
        kept: &BTreeSet<String>,
        out: &mut AdoptOutcome,
    ) -> Result<(), InstanceError> {
        let mut first: Option<InstanceError> = None;
        let mut failed = |e: InstanceError| {
            warn!("removing the leftovers of a previous lodgerd: {e}");
            first.get_or_insert(e);
        };
        // Each adopted instance's job, index, start time and uid.
        let adopted: Vec<(&str, Option<u32>, u64, Option<u32>)> = marked
            .iter()
            .filter(|m| groups.contains(&m.pid) && m.pid == m.pgrp)
            .map(|m| (m.job.as_str(), m.index, m.start_time, m.uid))
            .collect();
        let of_adopted = |m: &Marked| {
            groups.contains(&m.pgrp)
                || adopted.iter().any(|&(job, index, t, uid)| {
                    m.job == job && m.index == index && m.start_time >= t && m.uid == uid
                })
        };
        let h = &self.host;
        let mut cgroups = Vec::new();
        if h.cpusets.exists(&h.lodgers) {
            match h.cpusets.children(&h.lodgers, &mut cgroups) {
                Ok(()) => {}
                Err(e) if e.is_gone() => {}
                Err(e) => failed(e.into()),
            }
        }
        cgroups.retain(|cg| !kept.contains(cg));
        for cg in &cgroups {
            match h.kill_cgroup(cg) {
                Ok(killed) => out.killed.extend(killed),
                Err(e) => failed(e),
            }
        }
        // A pidfd on each before it is killed, to see it gone.
        let mut dying = Vec::new();
        for m in marked {
            if of_adopted(m) {
                continue;
            }
            let Some(p) = pid_of(m.pid) else { continue };
            // Killed whether or not a pidfd opens (a kernel before 5.3 has none): then it is
            // not waited for, as before the wait.
            let pidfd = pidfd_open(m.pid).ok();
            match kill(p, Signal::SIGKILL) {
                Ok(()) => {
                    out.killed.push(m.pid);
                    dying.extend(pidfd);
                }
                Err(nix::errno::Errno::ESRCH) => {}
                Err(errno) => failed(InstanceError::Leftover { pid: m.pid, errno }),
            }
        }
        out.killed.sort_unstable();
        out.killed.dedup();
        let deadline = Instant::now() + KILL_WAIT;
        while !dying.iter().all(exited) && Instant::now() < deadline {
            std::thread::sleep(STEP);
        }
        if !dying.iter().all(exited) {
            // Stuck in the kernel, not computing (as `hold::held_cpus` takes it).
            warn!("leftovers of a previous lodgerd still there {KILL_WAIT:?} after SIGKILL");
        }
        for cg in &cgroups {
            match self.host.remove_cgroup(cg, KILL_WAIT) {
                Ok(true) => out.removed_cgroups.push(cg.clone()),
                Ok(false) => {}
                Err(e) => failed(e.into()),
            }
        }
        // Reap the ones that were our own children (a lodger-like parent that is this process).
        for &pid in &out.killed {
            if let Ok(p) = i32::try_from(pid) {
                let _ = waitpid(Pid::from_raw(p), Some(WaitPidFlag::WNOHANG));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Once the adopted instances are supervised: removes the report FIFOs and memory cgroups
    /// none of them uses, and lodger's instance cgroup and slices when none was adopted.
    fn remove_unadopted(&mut self, out: &mut AdoptOutcome) -> Result<(), InstanceError> {
        let mut first: Option<InstanceError> = None;
        let mut failed = |e: InstanceError| {
            warn!("removing the leftovers of a previous lodgerd: {e}");
            first.get_or_insert(e);
        };
        if let Some(dir) = self.host.settings.report_dir.clone() {
            let kept: BTreeSet<std::path::PathBuf> = self
                .slots
                .iter()
                .map(|s| report_path(&dir, &s.key()))
                .collect();
            if let Ok(entries) = fs::read_dir(&dir) {
                for entry in entries.flatten() {
                    let path = entry.path();
                    if path.extension().is_some_and(|e| e == "report") && !kept.contains(&path) {
                        let _ = fs::remove_file(&path);
                    }
                }
            }
        }
        self.host
            .sweep_memory(&kept_cgroups_now(&self.slots, &self.host));
        if self.slots.is_empty() {
            let h = &self.host;
            if h.cpusets.exists(&h.lodgers) {
                match h.cpusets.remove_if_unused(&h.lodgers) {
                    Ok(true) => out.removed_cgroups.push(h.lodgers.clone()),
                    Ok(false) => {}
                    Err(e) => failed(e.into()),
                }
            }
            // Instance units an earlier lodgerd started, none adopted: their slices go.
            unit::stop_slices(&h.slices);
        }
        if !out.killed.is_empty() || !out.removed_cgroups.is_empty() {
            warn!(
                "removed leftovers of a previous lodgerd: killed processes {:?}, removed cgroups \
                 {:?}",
                out.killed, out.removed_cgroups
            );
        }
        first.map_or(Ok(()), Err)
    }
}

impl super::host::Host {
    /// The instance cgroup `key`, adopted with process `m`, runs in (cgroup placement, `m` not
    /// in a unit), whether or not it exists.
    fn adopted_cgroup(&self, key: &InstanceKey, m: &Marked) -> Option<String> {
        (self.placement == PinMethod::Cgroup && m.unit.is_none()).then(|| self.instance_cgroup(key))
    }

    /// Every process whose environment holds `LODGER_PARENT=<parent>` (this lodger's instances
    /// and whatever they started), with the instance it belongs to.
    fn marked(&mut self) -> Result<Vec<Marked>, InstanceError> {
        let mark = format!("{ENV_PARENT}={}", self.parent);
        let me = std::process::id();
        let root = self.settings.proc_root.clone();
        let mut unit_env: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
        let instances_slice = format!("/{}/", self.slices.instances);
        let mut found = Vec::new();
        for pid in procfs::list_pids(&root)? {
            if pid == me {
                continue;
            }
            let dir = root.join(pid.to_string());
            // Gone, a kernel thread, a zombie: nothing to read.
            let Some(stat) = self.reader.stat(pid).ok().flatten() else {
                continue;
            };
            let unit = fs::read_to_string(dir.join("cgroup")).ok().and_then(|t| {
                t.lines().find_map(|l| {
                    let path = l.strip_prefix("0::")?;
                    let (_, rest) = path.split_once(&instances_slice)?;
                    Some(rest.split('/').next()?.to_string())
                })
            });
            // Its environment; for a process of one of lodger's units without the mark, what
            // systemd gave the unit: lodgerd's sandbox may not read the process's own, or systemd
            // has forked it and not yet executed the wrapper (it still holds PID 1's).
            let environ = fs::read(dir.join("environ")).unwrap_or_default();
            let mut vars: Vec<String> = environ
                .split(|&b| b == 0)
                .filter_map(|v| std::str::from_utf8(v).ok())
                .filter(|v| !v.is_empty())
                .map(str::to_string)
                .collect();
            if !vars.contains(&mark) {
                if let (Some(name), Some(systemd)) = (&unit, unit::systemd()) {
                    vars = unit_env
                        .entry(name.clone())
                        .or_insert_with(|| systemd.environment(name))
                        .clone()
                        .unwrap_or_default();
                }
            }
            if !vars.contains(&mark) {
                continue;
            }
            let var = |name: &str| -> Option<String> {
                let prefix = format!("{name}=");
                vars.iter()
                    .find_map(|v| v.strip_prefix(prefix.as_str()).map(str::to_string))
            };
            let number = |name: &str| var(name).and_then(|v| v.parse().ok());
            found.push(Marked {
                pid,
                pgrp: stat.pgrp,
                job: var(ENV_JOB).unwrap_or_default(),
                index: number(ENV_INSTANCE),
                threads: number(ENV_THREADS),
                batch: number(ENV_BATCH),
                unit,
                start_time: stat.start_time,
                uid: procfs::uids(&root, pid).and_then(|(real, eff)| (real == eff).then_some(real)),
            });
        }
        Ok(found)
    }
}

/// The instance cgroup names (and v1 memory twins) the adopted slots use.
fn kept_cgroups_now(slots: &[Slot], host: &super::host::Host) -> Vec<String> {
    slots
        .iter()
        .map(|s| host.instance_cgroup(&s.key()))
        .collect()
}
