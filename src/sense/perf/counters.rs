//! The `perf_event_open` implementation of [`Counters`]: counter groups per thread (with
//! `inherit`) or per CPU on a cgroup, opened within the fd budget, read as groups where the
//! kernel allows it. Touches `perf_event_open` and `/proc/PID/task` under the proc root it is
//! given.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::time::{Duration, Instant};

use perf_event::{Builder, Counter, ReadFormat};

use super::*;
use crate::job::JobId;
use crate::sys::procfs::ProcReader;

/// One thread's or one CPU's counters: the group leader first when grouped.
#[derive(Debug)]
struct EventGroup {
    counters: Vec<(PerfEvent, Counter)>,
    /// The last successful reading, used when a read fails so sums never go backwards.
    last: [Option<RawCount>; 4],
}

#[derive(Debug)]
struct JobCounters {
    groups: Vec<EventGroup>,
    generation: u64,
    fds: usize,
}

/// Times a thread's group is opened again after EINVAL before it counts as refused (see
/// `try_attach`).
const EINVAL_TRIES: u32 = 10;

/// Why opening a group stopped.
enum OpenFailure {
    /// The thread exited between listing and opening (or the CPU is offline).
    Gone,
    Fatal(PerfError),
}

/// Whether thread `tid` is gone or exiting (`PF_EXITING` in the flags of `/proc/TID/stat`).
fn thread_exiting(proc_root: &Path, tid: u32) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Ok(text) = std::fs::read(proc_root.join(tid.to_string()).join("stat")) else {
        return true;
    };
    // After the name (which may hold spaces): state (field 3) ... flags (field 9).
    let Some(close) = text.iter().rposition(|&b| b == b')') else {
        return false;
    };
    let rest = String::from_utf8_lossy(&text[close + 1..]);
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next().unwrap_or("");
    let flags: u64 = fields.nth(5).and_then(|f| f.parse().ok()).unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

/// The perf_event_open implementation of [`Counters`].
#[derive(Debug)]
pub struct PerfCounters {
    settings: PerfSettings,
    access: PerfAccess,
    /// `None` when counted, else why not.
    disabled: [Option<String>; 4],
    grouped: bool,
    pub(super) budget: FdBudget,
    jobs: HashMap<JobId, JobCounters>,
    next_generation: u64,
    procs: ProcReader,
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT) | Some(libc::EOPNOTSUPP) | Some(libc::ENODEV)
    )
}

fn is_permission(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM))
}

fn nanos(d: Option<Duration>) -> u64 {
    d.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl PerfCounters {
    /// Checks access, probes which events the PMU has (a missing one is logged at debug level and reported in
    /// `status()`, for the caller to summarise) and whether
    /// groups work with `inherit`. Never fails for a missing PMU: the events are then reported
    /// unavailable and jobs attach with nothing to count.
    pub fn new(settings: PerfSettings) -> Result<PerfCounters, PerfError> {
        let access = PerfAccess::read(&settings.proc_root)?;
        for problem in access.problems(settings.include_kernel) {
            tracing::warn!("perf: {problem}");
        }
        let budget = match settings.fd_cap {
            Some(cap) => FdBudget { cap, used: 0 },
            None => FdBudget::from_proc(&settings.proc_root)?,
        };
        let procs = ProcReader::new(&settings.proc_root);
        let mut me = PerfCounters {
            access,
            disabled: Default::default(),
            grouped: settings.grouping == Grouping::Auto,
            budget,
            jobs: HashMap::new(),
            next_generation: 1,
            procs,
            settings,
        };
        me.probe();
        Ok(me)
    }

    /// Opens each event on this process once to learn which the PMU has, then a two-event
    /// inherited group to learn whether the kernel groups inherited counters.
    fn probe(&mut self) {
        if self.access.paranoid.is_none() {
            for e in PerfEvent::ALL {
                self.disable(e, "the kernel has no perf events".to_string());
            }
            return;
        }
        for e in PerfEvent::ALL {
            let mut b = self.builder(e, false);
            b.observe_self().any_cpu();
            if let Err(err) = b.build() {
                let why = if is_unsupported(&err) {
                    format!("the PMU does not count it ({err})")
                } else {
                    format!("perf_event_open refused it ({err})")
                };
                self.disable(e, why);
            }
        }
        if !self.grouped {
            return;
        }
        let enabled: Vec<PerfEvent> = self.enabled_events().collect();
        if let [first, second, ..] = enabled[..] {
            let mut lb = self.builder(first, true);
            lb.observe_self().any_cpu().inherit(true);
            let ok = lb.build().and_then(|mut leader| {
                let mut mb = self.builder(second, true);
                mb.observe_self().any_cpu().inherit(true);
                mb.build_with_group(&mut leader).map(drop)
            });
            if let Err(e) = ok {
                tracing::info!(
                    "perf: inherited counter groups refused ({e}; kernels before 4.13 do): \
                     reading each event on its own"
                );
                self.grouped = false;
            }
        }
    }

    fn disable(&mut self, event: PerfEvent, why: String) {
        let slot = &mut self.disabled[event.index()];
        if slot.is_none() {
            // The caller says it once for all events (one log line per missing feature).
            tracing::debug!("perf: {event} disabled: {why}; the metrics using it are unavailable");
            *slot = Some(why);
        }
    }

    fn enabled_events(&self) -> impl Iterator<Item = PerfEvent> + '_ {
        PerfEvent::ALL
            .into_iter()
            .filter(|e| self.disabled[e.index()].is_none())
    }

    /// The settings every counter shares; `group` adds the group read format.
    fn builder(&self, event: PerfEvent, group: bool) -> Builder<'static> {
        let mut b = match self.settings.source {
            EventSource::Hardware => Builder::new(event.hardware()),
            EventSource::Software => Builder::new(event.software_stand_in()),
        };
        let mut format = ReadFormat::TOTAL_TIME_ENABLED | ReadFormat::TOTAL_TIME_RUNNING;
        if group {
            format |= ReadFormat::GROUP | ReadFormat::ID;
        }
        b.read_format(format)
            .enabled(false)
            .exclude_kernel(!self.settings.include_kernel)
            .exclude_hv(true);
        b
    }

    /// The fds a target would take now with the events this host counts.
    pub fn fds_for(&mut self, target: &PerfTarget) -> Result<usize, PerfError> {
        let units = match target {
            PerfTarget::Processes(pids) => self.threads_of(pids)?.len(),
            PerfTarget::Cgroup { cpus, .. } => cpus.len(),
        };
        Ok(FdBudget::fds_for(units, self.enabled_events().count()))
    }

    fn threads_of(&mut self, pids: &[u32]) -> Result<Vec<u32>, PerfError> {
        let mut tids = Vec::new();
        for &pid in pids {
            self.procs.threads(pid, &mut tids)?;
        }
        tids.sort_unstable();
        tids.dedup();
        Ok(tids)
    }

    /// Opens one group on a thread (`pid` = tid, inherit) or a CPU of a cgroup.
    fn open_group(
        &self,
        events: &[PerfEvent],
        tid: Option<u32>,
        cgroup: Option<(&File, u32)>,
        target: &PerfTarget,
    ) -> Result<EventGroup, OpenFailure> {
        let mut counters: Vec<(PerfEvent, Counter)> = Vec::with_capacity(events.len());
        for &event in events {
            let mut b = self.builder(event, self.grouped);
            match (tid, cgroup) {
                (Some(tid), _) => {
                    let pid = i32::try_from(tid).map_err(|_| OpenFailure::Gone)?;
                    b.observe_pid(pid).any_cpu().inherit(true);
                }
                (None, Some((file, cpu))) => {
                    let cpu = usize::try_from(cpu).unwrap_or(usize::MAX);
                    b.observe_cgroup(file).one_cpu(cpu);
                }
                (None, None) => return Err(OpenFailure::Gone),
            }
            let opened = match counters.first_mut() {
                Some((_, leader)) if self.grouped => b.build_with_group(leader),
                _ => b.build(),
            };
            match opened {
                Ok(c) => counters.push((event, c)),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(OpenFailure::Gone),
                // A group member on a thread that began exiting after its leader opened: the
                // kernel has taken the leader out of the thread's context and answers EINVAL
                // (leader and member in different contexts), not ESRCH.
                Err(e)
                    if e.raw_os_error() == Some(libc::EINVAL)
                        && !counters.is_empty()
                        && tid.is_some_and(|t| thread_exiting(&self.settings.proc_root, t)) =>
                {
                    return Err(OpenFailure::Gone)
                }
                // A CPU that went offline since the target was made.
                Err(e) if cgroup.is_some() && e.raw_os_error() == Some(libc::ENODEV) => {
                    return Err(OpenFailure::Gone)
                }
                // Events were probed at start, so ENOENT here is about the target: the kernel
                // answers it for a directory outside the perf_event hierarchy.
                Err(source) if cgroup.is_some() && is_unsupported(&source) => {
                    let path = match target {
                        PerfTarget::Cgroup { dir, .. } => dir.clone(),
                        PerfTarget::Processes(_) => PathBuf::new(),
                    };
                    return Err(OpenFailure::Fatal(PerfError::NotPerfCgroup {
                        path,
                        source,
                    }));
                }
                Err(source) if is_permission(&source) => {
                    let hint = self
                        .access
                        .problems(self.settings.include_kernel)
                        .join("; ");
                    let hint = if hint.is_empty() {
                        "the target may belong to another user and lodgerd lacks ptrace access to it"
                            .to_string()
                    } else {
                        hint
                    };
                    return Err(OpenFailure::Fatal(PerfError::Permission {
                        event,
                        target: target.to_string(),
                        source,
                        hint,
                    }));
                }
                Err(source) => {
                    return Err(OpenFailure::Fatal(PerfError::Open {
                        event,
                        target: target.to_string(),
                        source,
                    }))
                }
            }
        }
        let enable = |c: &mut Counter| {
            if self.grouped {
                c.enable_group()
            } else {
                c.enable()
            }
        };
        let enabled = if self.grouped {
            counters.first_mut().map_or(Ok(()), |(_, c)| enable(c))
        } else {
            counters.iter_mut().try_for_each(|(_, c)| enable(c))
        };
        match enabled {
            Ok(()) => Ok(EventGroup {
                counters,
                last: [None; 4],
            }),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(OpenFailure::Gone),
            Err(source) => Err(OpenFailure::Fatal(PerfError::Enable {
                target: target.to_string(),
                source,
            })),
        }
    }

    /// One attempt with the events enabled now.
    fn try_attach(
        &mut self,
        job: &JobId,
        target: &PerfTarget,
    ) -> Result<Vec<EventGroup>, OpenFailure> {
        let events: Vec<PerfEvent> = self.enabled_events().collect();
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let mut groups = Vec::new();
        match target {
            PerfTarget::Processes(pids) => {
                let tids = self.threads_of(pids).map_err(OpenFailure::Fatal)?;
                self.check_budget(job, target, tids.len(), events.len())?;
                for tid in tids {
                    // EINVAL can be a race, not a refusal: the kernel swaps the perf contexts of
                    // threads whose inherited contexts are clones when it switches between them,
                    // so a member can find its leader in another thread's context. Such a group
                    // is opened again, after a millisecond's pause from the fourth try on (a
                    // loaded emulated guest failed three quick tries in a row); a real refusal
                    // stays one.
                    let mut tries = 0;
                    let opened = loop {
                        match self.open_group(&events, Some(tid), None, target) {
                            Err(OpenFailure::Fatal(PerfError::Open { source, .. }))
                                if source.raw_os_error() == Some(libc::EINVAL)
                                    && tries < EINVAL_TRIES =>
                            {
                                tries += 1;
                                if tries >= 3 {
                                    std::thread::sleep(Duration::from_millis(1));
                                }
                            }
                            other => break other,
                        }
                    };
                    match opened {
                        Ok(g) => groups.push(g),
                        Err(OpenFailure::Gone) => continue,
                        Err(other) => return Err(other),
                    }
                }
                if groups.is_empty() {
                    return Err(OpenFailure::Fatal(PerfError::TargetGone {
                        job: job.clone(),
                        target: target.to_string(),
                    }));
                }
            }
            PerfTarget::Cgroup { dir, cpus } => {
                self.check_budget(job, target, cpus.len(), events.len())?;
                let file = File::open(dir).map_err(|source| {
                    OpenFailure::Fatal(PerfError::Cgroup {
                        path: dir.clone(),
                        source,
                    })
                })?;
                for cpu in cpus.iter() {
                    match self.open_group(&events, None, Some((&file, cpu)), target) {
                        Ok(g) => groups.push(g),
                        // An offline CPU: nothing runs there to count.
                        Err(OpenFailure::Gone) => continue,
                        Err(other) => return Err(other),
                    }
                }
            }
        }
        Ok(groups)
    }

    fn check_budget(
        &self,
        job: &JobId,
        target: &PerfTarget,
        units: usize,
        events: usize,
    ) -> Result<(), OpenFailure> {
        let needed = FdBudget::fds_for(units, events);
        // The job's current fds are released by the attach that replaces them.
        let held = self.jobs.get(job).map_or(0, |j| j.fds);
        let available = self.budget.available().saturating_add(held);
        if needed > available {
            return Err(OpenFailure::Fatal(PerfError::FdBudget {
                job: job.clone(),
                target: target.to_string(),
                needed,
                available,
                cap: self.budget.cap,
            }));
        }
        Ok(())
    }

    fn read_group(&self, g: &mut EventGroup) -> bool {
        let mut now: [Option<RawCount>; 4] = [None; 4];
        let ok = if self.grouped {
            match g.counters.first_mut() {
                Some((_, leader)) => match leader.read_group() {
                    Ok(data) => {
                        let (te, tr) = (nanos(data.time_enabled()), nanos(data.time_running()));
                        for (event, c) in &g.counters {
                            if let Some(entry) = data.get(c) {
                                now[event.index()] = Some(RawCount {
                                    value: entry.value(),
                                    time_enabled_ns: te,
                                    time_running_ns: tr,
                                });
                            }
                        }
                        true
                    }
                    Err(_) => false,
                },
                None => true,
            }
        } else {
            let mut all = true;
            for (event, c) in g.counters.iter_mut() {
                match c.read_full() {
                    Ok(d) => {
                        now[event.index()] = Some(RawCount {
                            value: d.count(),
                            time_enabled_ns: nanos(d.time_enabled()),
                            time_running_ns: nanos(d.time_running()),
                        })
                    }
                    Err(_) => all = false,
                }
            }
            all
        };
        for (slot, value) in g.last.iter_mut().zip(now) {
            if value.is_some() {
                *slot = value;
            }
        }
        ok
    }

    pub fn settings(&self) -> &PerfSettings {
        &self.settings
    }

    pub fn budget(&self) -> FdBudget {
        self.budget
    }
}

impl Counters for PerfCounters {
    fn attach(&mut self, job: &JobId, target: &PerfTarget) -> Result<Attached, PerfError> {
        let groups = match self.try_attach(job, target) {
            Ok(groups) => groups,
            Err(OpenFailure::Gone) => {
                return Err(PerfError::TargetGone {
                    job: job.clone(),
                    target: target.to_string(),
                })
            }
            Err(OpenFailure::Fatal(e)) => return Err(e),
        };
        self.detach(job);
        let fds: usize = groups.iter().map(|g| g.counters.len()).sum();
        let generation = self.next_generation;
        self.next_generation += 1;
        self.budget.used = self.budget.used.saturating_add(fds);
        let attached = Attached {
            groups: u32::try_from(groups.len()).unwrap_or(u32::MAX),
            fds: u32::try_from(fds).unwrap_or(u32::MAX),
            generation,
        };
        self.jobs.insert(
            job.clone(),
            JobCounters {
                groups,
                generation,
                fds,
            },
        );
        Ok(attached)
    }

    fn detach(&mut self, job: &JobId) -> bool {
        match self.jobs.remove(job) {
            Some(j) => {
                self.budget.used = self.budget.used.saturating_sub(j.fds);
                true
            }
            None => false,
        }
    }

    fn read(&mut self) -> Vec<(JobId, PerfSample)> {
        let mut jobs = std::mem::take(&mut self.jobs);
        let mut out = Vec::with_capacity(jobs.len());
        for (id, j) in jobs.iter_mut() {
            let at = Instant::now();
            let mut read_errors = 0u32;
            for g in j.groups.iter_mut() {
                if !self.read_group(g) {
                    read_errors = read_errors.saturating_add(1);
                }
            }
            let mut counts: [Option<RawCount>; 4] = [None; 4];
            for e in self.enabled_events() {
                let i = e.index();
                counts[i] = j
                    .groups
                    .iter()
                    .map(|g| g.last[i].unwrap_or_default())
                    .reduce(RawCount::saturating_add)
                    .or(Some(RawCount::default()));
            }
            if read_errors > 0 {
                tracing::debug!("perf: job {id}: {read_errors} counter group reads failed");
            }
            out.push((
                id.clone(),
                PerfSample {
                    at,
                    generation: j.generation,
                    counts,
                    groups: u32::try_from(j.groups.len()).unwrap_or(u32::MAX),
                    fds: u32::try_from(j.fds).unwrap_or(u32::MAX),
                    read_errors,
                },
            ));
        }
        self.jobs = jobs;
        out.sort_by_key(|a| a.0.seq());
        out
    }

    fn status(&self) -> PerfStatus {
        PerfStatus {
            access: self.access,
            problems: self.access.problems(self.settings.include_kernel),
            events: PerfEvent::ALL
                .iter()
                .map(|&event| EventStatus {
                    event,
                    unavailable: self.disabled[event.index()].clone(),
                })
                .collect(),
            grouped: self.grouped,
            software: self.settings.source == EventSource::Software,
            budget: self.budget,
            jobs: self.jobs.len(),
        }
    }
}
