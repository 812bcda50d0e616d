//! Between full sweeps (issue 21): which jobs an apply may skip because nothing they depend on
//! changed since their last full sweep. Learns of forks, execs and exits from the kernel's
//! process events (`sys::procevents`) instead of listing every job's threads every tick, and
//! keeps the process table for pid jobs' descendants in step with them; keeps a slow full
//! sweep ([`FULL_SWEEP_EVERY`]) as the safety net. Touches the events socket, /proc (every
//! process's `stat` for the table), the job cgroups' `cgroup.procs` (through the hierarchy it
//! is handed), the processes' `/proc/PID/task` (listed or counted, `Quiet::threads`) and, with
//! thread roles, the latency threads' schedstat (through `roles`).
//!
//! A job is swept in full when any of these holds, and skipped otherwise (its last outcome
//! stands):
//! - no process events are available (no CAP_NET_ADMIN, or a kernel without the connector);
//! - it was never swept, or its placement (CPUs, memory nodes, memory limit) differs;
//! - a process of the job forked (a thread or a child), exec'd or exited since;
//! - events were lost (the socket overflowed, a datagram arrived cut short, or the kernel's
//!   watch of the jobs' processes was lost or loaded again with an empty map): every job;
//! - a cgroup job's `cgroup.procs` differs (a process attached from outside: `kubectl exec`,
//!   a Slurm step), read each tick (one file);
//! - with thread roles, one of its latency threads started computing, or the job was placed
//!   less than [`ROLES_SETTLE`] ago. Checked each tick: first the job's processes' CPU time
//!   (one clock read a process); only when they used at least `roles::WORKER_ABOVE` of a CPU
//!   since the last tick could a latency thread have, and then each latency thread's schedstat
//!   is read;
//! - its safety-net sweep is due: what no event reports (an owner who set a thread back to
//!   SCHED_OTHER, changed its affinity) is put right within [`FULL_SWEEP_EVERY`]. Each job has
//!   one of [`SWEEP_SLOTS`] slots of that period (`next_sweep`), the least used when it was
//!   first swept, and is due at its slot's first instant after its last sweep. Jobs swept
//!   together (lodgerd starting, events lost, many registered at once) were otherwise swept
//!   together every period after: one tick listing every thread of every job while commands
//!   wait (12-18 ms for 10 jobs of 200 threads, `scripts/bench-spine`), where a tick now lists a
//!   tenth of them.
//!
//! Slurm jobs are always swept: their processes are found in cgroups lodger does not own and
//! pinned by affinity (`slurm_jobs`).
//!
//! Where eBPF can be loaded, only the jobs' processes' events are read (`sys::procwatch`, issue
//! 21: a node forking outside every job cost lodgerd 2.2 µs a process): every process a sweep
//! finds is watched (`Quiet::watch`; a cgroup job's in `Quiet::threads`, a pid job's
//! before anything is pinned), and the kernel watches a watched process's new children itself.
//! A process's forks from before it was watched were not reported: the caller walks its tree.
//!
//! A sweep need not list a process's threads again (`Quiet::threads`): the last listing
//! stands while no event touched the process since (a new thread is a fork, which is
//! reported) and the kernel counts as many threads as it listed (a thread's end is not
//! reported, but lowers the count). Listing `/proc/PID/task` was most of the safety net's
//! cost (issue 21: 40 % of an idle 100-job lodgerd's agent thread); the count is one `stat`.
//!
//! The process table pid jobs' descendants are found in (`Quiet::table`) follows the same
//! events: a fork adds a process and a leader's exit removes it. What no event says is read
//! from /proc (a `stat` each) before the table is next used: the new parent of an exited
//! process's children (the kernel gives them to a subreaper, another thread of the process or
//! init), the children of a process whose last thread was not its leader, and a process whose
//! leader a thread's `execve` ended (an exit event for the pid, then an exec event: it goes on
//! under the pid). Every pending event is read before the table is used, so a child forked a
//! moment before is in it, as in a read of /proc. The table is kept in step only while it is
//! fresh; /proc is read in full the first time, when events were lost or failed, once the table
//! is [`FULL_SWEEP_EVERY`] old (the safety net) or [`MAX_UNSETTLED`] processes wait to be read
//! again; without events, whenever a task was created on the node since the last read
//! (`/proc/loadavg`), as before: on a busy node (a CI runner, a data loader forking workers)
//! that was every sweep of a pid job reading every process's `stat`. With only the jobs'
//! processes' events, the table is kept in step for the jobs' trees alone, and the rest of it
//! stays as /proc was at the last full read: no job's descendants depend on it, since a process
//! joins a job's tree only by a fork the kernel reports (or a walk finds) or, given to a
//! subreaper, from within that tree.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::{debug, info};

use super::training::roles::{Role, ThreadRoles, WORKER_ABOVE};
use super::Outcome;
use crate::cpuset::CpuSet;
use crate::enforce::cpusets::CpusetHierarchy;
use crate::job::{JobId, Target};
use crate::sys::procevents::{Drained, Event, ProcEvents, Source, REWATCH_AFTER};
use crate::sys::procfs::{processes_cpu_ns, ProcError, ProcReader, ProcessTable};

/// The safety net: every job is swept in full at least this often.
pub const FULL_SWEEP_EVERY: Duration = Duration::from_secs(10);
/// With thread roles, a job is swept every tick for this long after it is placed, so that its
/// threads' roles are measured before sweeps become rare (a role is measured over at least
/// `roles::MIN_WINDOW`).
pub const ROLES_SETTLE: Duration = Duration::from_secs(5);
/// The events are drained at most this often (see `Quiet::drain`).
pub const DRAIN_EVERY: Duration = Duration::from_millis(5);
/// The process table is read from /proc in full rather than settled process by process once
/// this many wait to be read again (a node ending thousands of processes between two uses).
pub const MAX_UNSETTLED: usize = 4096;
/// How many parts of [`FULL_SWEEP_EVERY`] the jobs' safety-net sweeps are spread over: one a
/// tick at the default 1-s interval.
pub const SWEEP_SLOTS: u32 = 10;

/// What a job's last full sweep found and depended on.
#[derive(Debug)]
struct Swept {
    cpus: CpuSet,
    mems: CpuSet,
    memory_max: Option<u64>,
    outcome: Outcome,
    at: Instant,
    /// When the safety net sweeps the job again: its slot's next instant after `at`.
    due: Instant,
    /// When the job was first swept at this placement.
    since: Instant,
    /// Threads in the latency role, `(pid, tid)`.
    latency: Vec<(u32, u32)>,
    /// A cgroup job's processes, sorted.
    procs: Option<Vec<u32>>,
    /// The job's processes' CPU time at the last check, and when.
    cpu: Option<(u64, Instant)>,
}

/// See the module doc.
#[derive(Debug)]
pub(crate) struct Quiet {
    /// The kernel's process events ([`ProcEvents`]; a script in the unit tests).
    events: Option<Box<dyn Source>>,
    /// Processes touched by an event, and when lodger read it.
    touched: HashMap<u32, Instant>,
    /// When `touched` was last pruned.
    pruned: Option<Instant>,
    /// When the events were last drained.
    drained: Option<Instant>,
    swept: HashMap<JobId, Swept>,
    /// Each job's sweep slot (see the module doc), kept while its sweeps are forgotten for lost
    /// events, dropped with [`Quiet::forget`].
    slots: HashMap<JobId, u32>,
    /// Where the slots are counted from.
    epoch: Instant,
    /// Each process's threads as last listed, and when (see [`Quiet::threads`]).
    listed: HashMap<u32, (Vec<u32>, Instant)>,
    /// Every process's parent, for pid jobs' descendants (see [`Quiet::table`]).
    table: ProcessTable,
    /// With events: when `table` was last read from /proc, the events since applied to it;
    /// `None`: it must be read again (never read, events lost or failing).
    scanned: Option<Instant>,
    /// Without events: `/proc/loadavg`'s last pid when `table` was read; `None`: read again.
    table_key: Option<u32>,
    /// The table is read as without events even with them (the spine benchmark's baseline).
    keyed: bool,
    /// Whether the log has said that events arrive cut short (once).
    said_cut: bool,
    /// Listings made, for the tests.
    #[cfg(test)]
    listings: u64,
    /// Full reads of /proc for the table, for the tests.
    #[cfg(test)]
    rescans: u64,
    /// Process events read, for the tests.
    #[cfg(test)]
    events_read: u64,
    /// Why every job was swept again ([`Quiet::start_over`]), for the tests.
    #[cfg(test)]
    started_over: Vec<&'static str>,
    /// How many times every job was swept again (the spine benchmark says so beside a figure).
    start_overs: u64,
}

/// The placement an apply was asked for.
pub(crate) struct Asked<'a> {
    pub(crate) cpus: &'a CpuSet,
    pub(crate) mems: &'a CpuSet,
    pub(crate) memory_max: Option<u64>,
}

impl Quiet {
    /// With `events`, skipping is on; without, every apply sweeps (one log line says why).
    /// With `watch` too, only the events of the jobs' processes are read ([`Quiet::watch`]):
    /// the caller must then look for a newly watched process's children itself, since its
    /// forks before it was watched were not reported.
    pub(crate) fn new(events: bool, watch: bool) -> Quiet {
        let events = if events {
            match ProcEvents::open() {
                Ok(mut e) => {
                    if watch {
                        match e.watch_jobs() {
                            Ok(()) => debug!("process events: only the jobs' processes' are read"),
                            Err(e) => info!(
                                "process events: every process's are read, not only the jobs' \
                                 (the kernel filter could not be loaded: {e})"
                            ),
                        }
                    }
                    Some(Box::new(e) as Box<dyn Source>)
                }
                Err(e) => {
                    info!(
                        "process events unavailable ({e}): every job's threads are listed \
                         every tick instead"
                    );
                    None
                }
            }
        } else {
            None
        };
        Quiet::with_source(events)
    }

    /// Skipping on with `events` as the source of process events, off without.
    fn with_source(events: Option<Box<dyn Source>>) -> Quiet {
        Quiet {
            events,
            touched: HashMap::new(),
            pruned: None,
            drained: None,
            swept: HashMap::new(),
            slots: HashMap::new(),
            epoch: Instant::now(),
            listed: HashMap::new(),
            table: ProcessTable::default(),
            scanned: None,
            table_key: None,
            keyed: false,
            said_cut: false,
            #[cfg(test)]
            listings: 0,
            #[cfg(test)]
            rescans: 0,
            #[cfg(test)]
            events_read: 0,
            #[cfg(test)]
            started_over: Vec::new(),
            start_overs: 0,
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Reads the pending events: before an apply, since the kernel queues a fork's event before
    /// the fork returns, so an apply after it knows. At most once per [`DRAIN_EVERY`], though:
    /// a tick applies every job in well under that, and draining before each was one `recv` per
    /// job and tick (issue 21: 7 % of an idle 100-job tick). A fork between a drain and an apply
    /// a moment later is then seen at the next tick's drain, stamped after the job's last sweep,
    /// exactly as a fork just after the apply would be: the job is swept one tick later.
    fn drain(&mut self, now: Instant) {
        // Kept in step only while fresh: one older than FULL_SWEEP_EVERY is read in full at its
        // next use anyway, and one nobody uses (no pid job looks for descendants) would gather
        // the processes to read again for ever.
        if !self.table_fresh(now) {
            self.scanned = None;
        }
        let Some(events) = &mut self.events else {
            return;
        };
        if self
            .drained
            .is_some_and(|d| now.saturating_duration_since(d) < DRAIN_EVERY)
        {
            return;
        }
        self.drained = Some(now);
        let (touched, listed) = (&mut self.touched, &mut self.listed);
        let mut table = self.scanned.is_some().then_some(&mut self.table);
        let drained =
            events.drain(&mut |event| on_event(touched, listed, table.as_deref_mut(), event, now));
        #[cfg(test)]
        if let Ok(d) = &drained {
            self.events_read += d.events;
        }
        match drained {
            Ok(d) => {
                if d.lost {
                    self.lost(d);
                }
                if d.rewatched {
                    info!(
                        "process events: the kernel's map of the jobs' processes is loaded \
                         again; only the jobs' processes' events are read"
                    );
                    // The new map is empty: every job's processes are watched at its next sweep,
                    // and a pid job's trees walked, as at a first apply.
                    self.start_over("the watch loaded again");
                }
            }
            Err(e) => {
                info!("process events failed ({e}): every job's threads are listed every tick from now on");
                self.events = None;
                self.start_over("events failed");
            }
        }
        self.prune(now);
    }

    /// Events were lost, the watch lost, or a datagram arrived cut short: every job is swept.
    fn lost(&mut self, d: Drained) {
        if d.unwatched {
            info!(
                "process events: the kernel's map of the jobs' processes could not take a new \
                 process (full at {} processes, or the kernel short of memory): every process's \
                 events are read until it is loaded again ({} s at first, longer if this keeps \
                 happening)",
                crate::sys::procwatch::MAX_WATCHED,
                REWATCH_AFTER.as_secs()
            );
        }
        if d.cut && !self.said_cut {
            self.said_cut = true;
            info!(
                "process events arrive cut short (another program's socket filter on the \
                 kernel's process connector cuts them for every listener): every job is swept \
                 when one does"
            );
        }
        debug!("process events were lost: every job is swept, /proc read again");
        self.start_over(if d.unwatched {
            "a fork the watch could not follow"
        } else if d.cut {
            "events cut short"
        } else {
            "events lost"
        });
    }

    /// After events were lost: every job is swept and the table read from /proc again. `why`
    /// is kept for the tests.
    fn start_over(&mut self, why: &'static str) {
        #[cfg(test)]
        self.started_over.push(why);
        let _ = why;
        self.start_overs += 1;
        self.swept.clear();
        self.listed.clear();
        self.scanned = None;
    }

    /// Reads every process's events from now on, as before they were narrowed to the jobs'
    /// (the spine benchmark's comparison).
    pub(crate) fn read_every_process_event(&mut self) {
        if let Some(events) = &mut self.events {
            if events.unwatch().is_err() {
                self.events = None;
            }
            self.start_over("every event asked for");
        }
    }

    /// Whether only watched processes' events are read.
    pub(crate) fn watching(&self) -> bool {
        self.events.as_ref().is_some_and(|e| e.watching())
    }

    /// Watches `pids` (a job's processes, seen at `now`) and appends to `new` those not watched
    /// before: their forks until now were not reported, so the caller looks for their children
    /// in /proc. Nothing where every process's events are read. If the kernel cannot watch one
    /// (its map is full), every process's events are read for [`REWATCH_AFTER`], and every job
    /// is swept.
    pub(crate) fn watch(&mut self, pids: &[u32], now: Instant, new: &mut Vec<u32>) {
        let Some(events) = self.events.as_mut().filter(|e| e.watching()) else {
            return;
        };
        for &pid in pids {
            match events.watch(pid, now) {
                Ok(true) => new.push(pid),
                Ok(false) => {}
                Err(e) => {
                    info!(
                        "process events: the kernel cannot watch the jobs' processes ({e}): \
                         every process's events are read until the watch is loaded again ({} s \
                         at first, longer if this keeps happening)",
                        REWATCH_AFTER.as_secs()
                    );
                    self.start_over("a watch refused");
                    return;
                }
            }
        }
    }

    /// Forgets what no sweep can need any more, at most once a second, so a node forking
    /// thousands of processes does not pay it per apply. An event's record may go before the
    /// listing it outdated would have: that listing went with the event ([`touch`]).
    fn prune(&mut self, now: Instant) {
        // No job's last sweep is older than FULL_SWEEP_EVERY: older entries can go.
        let due = self.pruned.map_or(true, |p| {
            now.saturating_duration_since(p) >= Duration::from_secs(1)
        });
        if self.touched.len() > 4096 && due {
            self.pruned = Some(now);
            self.touched
                .retain(|_, at| now.saturating_duration_since(*at) <= FULL_SWEEP_EVERY);
        }
        // Every job's processes are listed or counted at least once a period: a listing older
        // than two is of a process no job has any more.
        if self.listed.len() > 64 && due {
            self.pruned = Some(now);
            self.listed
                .retain(|_, (_, at)| now.saturating_duration_since(*at) <= 2 * FULL_SWEEP_EVERY);
        }
    }

    /// `pid`'s threads into `tids` (cleared first) for a sweep that began at `now`: its last
    /// listing when no process event touched it since and `/proc/PID/task` still counts as
    /// many threads, else listed again (see the module doc). Without events, always listed.
    /// `Ok(false)`: the process is gone.
    pub(crate) fn threads(
        &mut self,
        reader: &mut ProcReader,
        pid: u32,
        tids: &mut Vec<u32>,
        now: Instant,
    ) -> Result<bool, ProcError> {
        tids.clear();
        self.drain(now);
        // A cgroup job's process is first seen here; a pid job's were watched when found.
        self.watch(&[pid], now, &mut Vec::new());
        if self.events.is_some() {
            if let Some((known, at)) = self.listing(pid) {
                match reader.thread_count(pid)? {
                    None => return Ok(false),
                    Some(n) if n == known.len() as u64 => {
                        tids.extend_from_slice(known);
                        *at = now;
                        return Ok(true);
                    }
                    Some(_) => {}
                }
            }
        }
        #[cfg(test)]
        {
            self.listings += 1;
        }
        if !reader.threads(pid, tids)? {
            self.listed.remove(&pid);
            return Ok(false);
        }
        if self.events.is_some() {
            self.listed.insert(pid, (tids.clone(), now));
        }
        Ok(true)
    }

    /// `pid`'s last listing and when it was made, if no event touched `pid` since.
    fn listing(&mut self, pid: u32) -> Option<&mut (Vec<u32>, Instant)> {
        let touched = self.touched.get(&pid).copied();
        self.listed
            .get_mut(&pid)
            .filter(|(_, at)| touched.map_or(true, |t| t <= *at))
    }

    /// Every process's parent as it is now, for a pid job's descendants, in an apply that
    /// began at `now`. With events: every pending event read first (not at most once per
    /// [`DRAIN_EVERY`]: a child forked a moment ago must be found, as a read of /proc would),
    /// the table kept in step by them, and /proc read again only when events were lost or
    /// failed, and every [`FULL_SWEEP_EVERY`] as the safety net. Without: /proc read again
    /// whenever a task was created on the node since the last read (`/proc/loadavg`).
    pub(crate) fn table(
        &mut self,
        reader: &mut ProcReader,
        now: Instant,
    ) -> Result<&ProcessTable, ProcError> {
        if self.events.is_some() {
            self.drained = None;
            self.drain(now);
        }
        if self.events.is_some() && !self.keyed {
            if self.table_fresh(now) {
                self.table.settle(reader)?;
                return Ok(&self.table);
            }
            self.scanned = None;
            self.rescan(reader)?;
            self.scanned = Some(now);
        } else {
            let key = reader.last_pid();
            if key.is_some() && key == self.table_key {
                return Ok(&self.table);
            }
            self.table_key = None;
            self.rescan(reader)?;
            self.table_key = key;
        }
        Ok(&self.table)
    }

    /// Whether [`Quiet::table`] at `now` would use the table kept in step by the events rather
    /// than read /proc in full first (see [`Quiet::table_fresh`]). False without events.
    pub(crate) fn table_is_fresh(&self, now: Instant) -> bool {
        self.events.is_some() && !self.keyed && self.table_fresh(now)
    }

    /// Whether the table, kept in step by the events, may be used at `now` without reading /proc
    /// in full: read less than [`FULL_SWEEP_EVERY`] ago, and fewer than [`MAX_UNSETTLED`]
    /// processes waiting to be read again.
    fn table_fresh(&self, now: Instant) -> bool {
        self.scanned
            .is_some_and(|at| now.saturating_duration_since(at) < FULL_SWEEP_EVERY)
            && self.table.unsettled() <= MAX_UNSETTLED
    }

    /// With `true`, [`Quiet::table`] reads /proc again whenever a task was created on the node,
    /// as it did before it followed the events: the spine benchmark's baseline.
    pub(crate) fn keep_table_by_last_pid(&mut self, keyed: bool) {
        self.keyed = keyed;
        self.scanned = None;
        self.table_key = None;
    }

    fn rescan(&mut self, reader: &mut ProcReader) -> Result<(), ProcError> {
        #[cfg(test)]
        {
            self.rescans += 1;
        }
        self.table.rescan(reader)
    }

    /// How many times [`Quiet::table`] read /proc in full.
    #[cfg(test)]
    pub(crate) fn rescans(&self) -> u64 {
        self.rescans
    }

    /// How many times every job was swept again since this was made.
    pub(crate) fn start_overs(&self) -> u64 {
        self.start_overs
    }

    /// Why every job was swept again, in order.
    #[cfg(test)]
    pub(crate) fn started_over(&self) -> Vec<&'static str> {
        self.started_over.clone()
    }

    /// How many process events were read.
    #[cfg(test)]
    pub(crate) fn events_read(&self) -> u64 {
        self.events_read
    }

    /// How many times [`Quiet::threads`] listed a process's threads.
    #[cfg(test)]
    pub(crate) fn listings(&self) -> u64 {
        self.listings
    }

    /// The job's last outcome, when it may be skipped now (see the module doc); an apply reports
    /// it [`Outcome::again`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn settled(
        &mut self,
        id: &JobId,
        target: &Target,
        asked: &Asked<'_>,
        cgroups: Option<&dyn CpusetHierarchy>,
        roles: Option<&mut ThreadRoles>,
        buf: &mut Vec<u32>,
        now: Instant,
    ) -> Option<&Outcome> {
        self.drain(now);
        self.events.as_ref()?;
        let swept = self.swept.get_mut(id)?;
        if swept.cpus != *asked.cpus
            || swept.mems != *asked.mems
            || swept.memory_max != asked.memory_max
            || now >= swept.due
        {
            return None;
        }
        // Events read by the apply that swept (at its start, `swept.at`) were before its sweep.
        let touched_at = swept.at;
        let touched = |pid: &u32| self.touched.get(pid).is_some_and(|t| *t > touched_at);
        if swept.outcome.pids.iter().any(touched) {
            return None;
        }
        if let Some(procs) = &swept.procs {
            let (cg, cgroups) = (cgroup_of(target)?, cgroups?);
            buf.clear();
            cgroups.procs(&cg, buf).ok()?;
            buf.sort_unstable();
            if buf != procs {
                return None;
            }
        }
        if let Some(roles) = roles {
            if now.saturating_duration_since(swept.since) < ROLES_SETTLE {
                return None;
            }
            if !swept.latency.is_empty() {
                let cpu = processes_cpu_ns(&swept.outcome.pids);
                // Below WORKER_ABOVE of one CPU in all, no thread of the job can have used more.
                let calm = swept.cpu.is_some_and(|(before, at)| {
                    let wall = now.saturating_duration_since(at).as_nanos() as f64;
                    (cpu.saturating_sub(before) as f64) < WORKER_ABOVE * wall
                });
                swept.cpu = Some((cpu, now));
                if !calm {
                    roles.begin(now);
                    for &(pid, tid) in &swept.latency {
                        if roles.role(pid, tid, now) != Role::Latency {
                            return None;
                        }
                    }
                }
            }
        }
        Some(&swept.outcome)
    }

    /// Records a full sweep that succeeded. `at`: when it began (events read after it count).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn remember(
        &mut self,
        id: &JobId,
        target: &Target,
        asked: &Asked<'_>,
        outcome: &Outcome,
        latency: Vec<(u32, u32)>,
        cgroups: Option<&dyn CpusetHierarchy>,
        at: Instant,
    ) {
        if self.events.is_none() || matches!(target, Target::Slurm(_) | Target::Instances) {
            return;
        }
        let procs = match (cgroup_of(target), cgroups) {
            (Some(cg), Some(cgroups)) => {
                let mut procs = Vec::new();
                if cgroups.procs(&cg, &mut procs).is_err() {
                    self.swept.remove(id);
                    return;
                }
                procs.sort_unstable();
                Some(procs)
            }
            // Simulated enforcement: a cgroup job is taken to be alive, nothing is read.
            (Some(_), None) => None,
            (None, _) => None,
        };
        let since = match self.swept.get(id) {
            Some(s) if s.cpus == *asked.cpus && s.mems == *asked.mems => s.since,
            _ => at,
        };
        // The processes' CPU time as the sweep found them, for the next tick's check that no
        // latency thread started computing (see `settled`): without it, that tick read every
        // latency thread's schedstat again right after the sweep had (issue 21: half the cost
        // of a tick sweeping one job of 50 idle threads, `scripts/bench-spine`).
        let cpu = (!latency.is_empty()).then(|| (processes_cpu_ns(&outcome.pids), at));
        let slot = match self.slots.get(id) {
            Some(slot) => *slot,
            None => {
                let slot = least_used(self.slots.values());
                self.slots.insert(id.clone(), slot);
                slot
            }
        };
        self.swept.insert(
            id.clone(),
            Swept {
                cpus: asked.cpus.clone(),
                mems: asked.mems.clone(),
                memory_max: asked.memory_max,
                outcome: outcome.clone(),
                at,
                due: next_sweep(self.epoch, slot, at),
                since,
                latency,
                procs,
                cpu,
            },
        );
    }

    pub(crate) fn forget(&mut self, id: &JobId) {
        self.swept.remove(id);
        self.slots.remove(id);
    }
}

/// One event read at `now`: each process it touched is recorded ([`touch`]), and the table,
/// when there is one to keep in step, follows a new process and a process's end.
fn on_event(
    touched: &mut HashMap<u32, Instant>,
    listed: &mut HashMap<u32, (Vec<u32>, Instant)>,
    table: Option<&mut ProcessTable>,
    event: Event,
    now: Instant,
) {
    for tgid in event.touched().into_iter().flatten() {
        touch(touched, listed, tgid, now);
    }
    let Some(table) = table else {
        return;
    };
    match event {
        Event::Fork {
            parent_tgid,
            child_pid,
            child_tgid,
        } if child_pid == child_tgid => table.fork(parent_tgid, child_tgid),
        Event::Fork { .. } => {}
        Event::Exit { pid, tgid } if pid == tgid => table.exit(tgid),
        Event::Exit { tgid, .. } => table.thread_exit(tgid),
        Event::Exec { tgid } => table.exec(tgid),
    }
}

/// Records an event of process `tgid` read at `now`, and drops its threads' listing: the
/// process forked, exec'd or exited, and a listing kept past the event's record (pruned after
/// [`FULL_SWEEP_EVERY`], a listing after twice that) would be handed to a process reusing the
/// pid with as many threads: the dead process's thread ids.
fn touch(
    touched: &mut HashMap<u32, Instant>,
    listed: &mut HashMap<u32, (Vec<u32>, Instant)>,
    tgid: u32,
    now: Instant,
) {
    touched.insert(tgid, now);
    listed.remove(&tgid);
}

/// The slot fewest jobs have (the lowest of those), for a job swept for the first time.
fn least_used<'a>(taken: impl Iterator<Item = &'a u32>) -> u32 {
    let mut count = [0usize; SWEEP_SLOTS as usize];
    for &slot in taken {
        if let Some(c) = count.get_mut(slot as usize) {
            *c += 1;
        }
    }
    (0..SWEEP_SLOTS)
        .min_by_key(|&s| count[s as usize])
        .unwrap_or(0)
}

/// When a job in `slot` that was swept at `at` is next due: the first instant after `at` that
/// is `slot` parts of [`FULL_SWEEP_EVERY`] past a whole number of periods since `epoch`. Never
/// later than one period after `at`, so the safety net's bound holds; jobs swept at the same
/// instant fall due in their own slots.
pub(crate) fn next_sweep(epoch: Instant, slot: u32, at: Instant) -> Instant {
    let period = FULL_SWEEP_EVERY.as_nanos();
    let offset = period / u128::from(SWEEP_SLOTS) * u128::from(slot % SWEEP_SLOTS);
    let since = at.saturating_duration_since(epoch).as_nanos();
    // The slot's instants are epoch + offset + k·period, k ≥ 0; the first one after `at`.
    let k = if since < offset {
        0
    } else {
        (since - offset) / period + 1
    };
    let ahead = u64::try_from(offset + k * period - since).unwrap_or(u64::MAX);
    at + Duration::from_nanos(ahead)
}

/// The cgroup whose processes make a cgroup job (normalized), `None` for other targets.
fn cgroup_of(target: &Target) -> Option<String> {
    let path = match target {
        Target::Cgroup(p) => p,
        Target::Container(c) => &c.cgroup,
        _ => return None,
    };
    crate::sys::cgroupfs::normalize(path).ok()
}

#[cfg(test)]
#[path = "quiet_tests.rs"]
mod tests;
