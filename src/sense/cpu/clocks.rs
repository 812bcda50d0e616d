//! Per-process CPU time from the kernel's process CPU-time clocks (`sys::procfs::process_cpu_ns`:
//! one `clock_gettime` a process) instead of `/proc/PID/stat` (a path walk, the kernel formatting
//! fifty fields, a read and a close). At 100 jobs that file was most of the sensing thread's
//! idle cost (issue 21). The clock carries no start time, which is how a rate tells a process from
//! a later one reusing its pid, so each pid's start time is read from its stat file when the pid
//! is first seen, again every [`START_RECHECK`], and whenever its clock goes back (the pid now
//! names another process). Only for the real `/proc`: a fake proc tree in the tests has no clocks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::ProcessCpu;

/// How long a pid's start time is trusted without reading its stat file again. A pid reused
/// within this window by a process whose CPU time is already past the old one's would go
/// unnoticed for one rate; with Linux's pid allocation (the next free number, wrapping at
/// `pid_max`, 4,194,304 on most servers) a pid comes back within seconds only on a node forking
/// millions of processes a minute.
pub const START_RECHECK: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
struct Clocked {
    start_time: u64,
    /// When the start time was read from the stat file.
    checked: Instant,
    /// The clock's last reading, to notice it going back.
    last_ns: u64,
    /// When the pid was last asked for, to forget pids no job has any more.
    seen: Instant,
}

/// Start times of the processes read through their clocks.
#[derive(Debug)]
pub struct ProcessClocks {
    known: HashMap<u32, Clocked>,
    pruned: Instant,
    read: fn(u32) -> Option<u64>,
}

impl ProcessClocks {
    pub fn new() -> Self {
        Self::with_clock(crate::sys::procfs::process_cpu_ns)
    }

    /// With another clock: the tests' way to play a pid's clock going back.
    pub fn with_clock(read: fn(u32) -> Option<u64>) -> Self {
        Self {
            known: HashMap::new(),
            pruned: Instant::now(),
            read,
        }
    }

    /// `pid`'s CPU time from its clock when its start time is known and fresh; `None` when the
    /// caller must read its stat file (and then [`ProcessClocks::record`] it).
    pub fn cached(&mut self, pid: u32, now: Instant) -> Option<ProcessCpu> {
        self.prune(now);
        let entry = self.known.get_mut(&pid)?;
        let ns = if now.saturating_duration_since(entry.checked) < START_RECHECK {
            (self.read)(pid).filter(|ns| *ns >= entry.last_ns)
        } else {
            None
        };
        let Some(ns) = ns else {
            self.known.remove(&pid);
            return None;
        };
        entry.last_ns = ns;
        entry.seen = now;
        Some(ProcessCpu {
            pid,
            start_time: entry.start_time,
            cpu_ns: ns,
        })
    }

    /// Reads `pid`'s clock just after its stat file gave `start_time`, and keeps both; `None`
    /// when the clock cannot be read (the process just exited, or `pid` is a thread that is not
    /// a process's leader), so the caller falls back to the stat file's figure.
    pub fn record(&mut self, pid: u32, start_time: u64, now: Instant) -> Option<u64> {
        let ns = (self.read)(pid)?;
        self.known.insert(
            pid,
            Clocked {
                start_time,
                checked: now,
                last_ns: ns,
                seen: now,
            },
        );
        Some(ns)
    }

    /// Forgets, at most once per [`START_RECHECK`], the pids not asked for in that long.
    fn prune(&mut self, now: Instant) {
        if now.saturating_duration_since(self.pruned) < START_RECHECK {
            return;
        }
        self.pruned = now;
        self.known
            .retain(|_, c| now.saturating_duration_since(c.seen) < START_RECHECK);
    }

    #[cfg(test)]
    pub fn known(&self) -> usize {
        self.known.len()
    }
}

impl Default for ProcessClocks {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    thread_local! {
        /// Pid 7's clock; each test runs on a thread of its own.
        static CLOCK: Cell<u64> = const { Cell::new(0) };
    }

    fn fake(pid: u32) -> Option<u64> {
        (pid == 7).then(|| CLOCK.with(Cell::get))
    }

    fn set(ns: u64) {
        CLOCK.with(|c| c.set(ns));
    }

    /// A known pid is read from its clock; a clock going back, a stale start time or a pid the
    /// clock cannot read sends the caller back to the stat file.
    #[test]
    fn the_clock_is_trusted_only_while_it_can_be() {
        let mut c = ProcessClocks::with_clock(fake);
        let t0 = Instant::now();
        assert_eq!(c.cached(7, t0), None, "unknown pid: read its stat file");
        set(1_000);
        assert_eq!(c.record(7, 55, t0), Some(1_000));
        set(3_000);
        let got = c
            .cached(7, t0 + Duration::from_secs(1))
            .expect("from the clock");
        assert_eq!((got.pid, got.start_time, got.cpu_ns), (7, 55, 3_000));
        // Back in time: another process has the pid now.
        set(2_000);
        assert_eq!(c.cached(7, t0 + Duration::from_secs(2)), None);
        assert_eq!(
            c.known(),
            0,
            "the pid is forgotten until its stat file is read"
        );
        c.record(7, 99, t0 + Duration::from_secs(2));
        // Past the recheck: the stat file again, even with the clock moving forward.
        set(9_000);
        assert_eq!(
            c.cached(7, t0 + Duration::from_secs(2) + START_RECHECK),
            None
        );
        // A pid the clock cannot read is never kept.
        assert_eq!(c.record(8, 1, t0), None);
        assert_eq!(c.cached(8, t0), None);
    }

    /// Pids nobody asks for are forgotten.
    #[test]
    fn unasked_pids_are_pruned() {
        set(10);
        let mut c = ProcessClocks::with_clock(fake);
        let t0 = Instant::now();
        c.record(7, 1, t0);
        assert_eq!(c.known(), 1);
        assert_eq!(c.cached(9, t0 + START_RECHECK * 2), None);
        assert_eq!(c.known(), 0);
    }
}
