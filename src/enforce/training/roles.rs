//! Thread roles of a training job for the RR sweep: a thread that used less than
//! [`LATENCY_BELOW`] of a CPU since the last sweep mostly waits (the dispatch or main thread,
//! which must run as soon as its wait ends), one above [`WORKER_ABOVE`] is a worker (a data
//! loader). Between the two a thread keeps its role, so a role does not flip every sweep. Reads
//! `/proc/PID/task/TID/schedstat` (time on CPU, in ns) under the proc root it is given.
//!
//! Why: SCHED_RR threads of equal priority do not pre-empt each other, and a thread's 100 ms
//! slice is not refilled when it blocks, so a dispatch thread waking from the GPU step waits
//! behind a loader until the loader blocks or its slice runs out (measured: step p99 36 ms under
//! RR against 27 ms under SCHED_OTHER, docs/benchmarks.md (e)). One priority above the loaders
//! it pre-empts them at once. A latency thread that starts spinning becomes a worker at the next
//! sweep, so it can never hold a core from its peers longer than one interval.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::sys::read_small;

/// Below this share of a CPU since the last sweep, a thread is latency-critical.
pub const LATENCY_BELOW: f64 = 0.3;
/// Above it, a worker.
pub const WORKER_ABOVE: f64 = 0.5;
/// The shortest span a role is measured over: two applies closer than this (a registration and
/// the next tick, or a retry) see the same roles, so applying twice changes nothing.
pub const MIN_WINDOW: Duration = Duration::from_millis(500);
/// Entries not seen for this long are forgotten (the thread exited).
const FORGET_AFTER: Duration = Duration::from_secs(30);

/// What a thread does for its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Mostly waits; runs one RT priority above the workers.
    Latency,
    /// Mostly computes (or not measured yet).
    Worker,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    on_cpu_ns: u64,
    at: Instant,
    role: Role,
}

/// Per-thread CPU time between sweeps, and the role it gives.
#[derive(Debug)]
pub struct ThreadRoles {
    proc_root: PathBuf,
    seen: HashMap<u32, Seen>,
    /// The schedstat file's bytes, kept between reads.
    buf: Vec<u8>,
}

impl ThreadRoles {
    pub fn new(proc_root: &Path) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            seen: HashMap::new(),
            buf: Vec::new(),
        }
    }

    /// Starts a sweep: forgets threads not seen for a while.
    pub fn begin(&mut self, now: Instant) {
        self.seen
            .retain(|_, s| now.saturating_duration_since(s.at) <= FORGET_AFTER);
    }

    /// The role of `tid` (of process `pid`) now; `Worker` until it has been seen twice.
    pub fn role(&mut self, pid: u32, tid: u32, now: Instant) -> Role {
        let path = self.proc_root.join(format!("{pid}/task/{tid}/schedstat"));
        let on_cpu = read_small(&path, &mut self.buf)
            .ok()
            .and_then(|()| parse_on_cpu_ns(std::str::from_utf8(&self.buf).ok()?));
        let Some(on_cpu_ns) = on_cpu else {
            return Role::Worker;
        };
        let role = match self.seen.get(&tid) {
            Some(prev) if now.saturating_duration_since(prev.at) < MIN_WINDOW => return prev.role,
            Some(prev) => {
                let wall = now.duration_since(prev.at).as_nanos();
                let used = u128::from(on_cpu_ns.saturating_sub(prev.on_cpu_ns));
                decide(prev.role, used, wall)
            }
            None => Role::Worker,
        };
        self.seen.insert(
            tid,
            Seen {
                on_cpu_ns,
                at: now,
                role,
            },
        );
        role
    }
}

/// The role after a thread used `used_ns` of CPU in `wall_ns`, given the one it had.
pub fn decide(previous: Role, used_ns: u128, wall_ns: u128) -> Role {
    if wall_ns == 0 {
        return previous;
    }
    // Ratios of u128 nanoseconds over a sweep interval: far inside f64's exact range.
    let share = used_ns as f64 / wall_ns as f64;
    if share < LATENCY_BELOW {
        Role::Latency
    } else if share > WORKER_ABOVE {
        Role::Worker
    } else {
        previous
    }
}

/// The first field of a schedstat line: time on CPU, ns.
pub fn parse_on_cpu_ns(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_cpu_share_with_hysteresis() {
        let ms = 1_000_000u128;
        assert_eq!(decide(Role::Worker, 100 * ms, 1000 * ms), Role::Latency);
        assert_eq!(decide(Role::Latency, 900 * ms, 1000 * ms), Role::Worker);
        // Between the thresholds the previous role holds.
        assert_eq!(decide(Role::Latency, 400 * ms, 1000 * ms), Role::Latency);
        assert_eq!(decide(Role::Worker, 400 * ms, 1000 * ms), Role::Worker);
        assert_eq!(decide(Role::Latency, 5, 0), Role::Latency);
    }

    #[test]
    fn schedstat_first_field_is_on_cpu_time() {
        assert_eq!(parse_on_cpu_ns("123456 789 10\n"), Some(123_456));
        assert_eq!(parse_on_cpu_ns(""), None);
        assert_eq!(parse_on_cpu_ns("x 1 2"), None);
    }

    #[test]
    fn a_fake_thread_becomes_latency_once_measured_idle() {
        let dir = tempfile::tempdir().expect("tempdir");
        let task = dir.path().join("7/task/8");
        std::fs::create_dir_all(&task).expect("mkdir");
        std::fs::write(task.join("schedstat"), "1000 0 1\n").expect("write");
        let mut roles = ThreadRoles::new(dir.path());
        let t0 = Instant::now();
        roles.begin(t0);
        assert_eq!(roles.role(7, 8, t0), Role::Worker, "first sight");
        std::fs::write(task.join("schedstat"), "1500 0 2\n").expect("write");
        assert_eq!(
            roles.role(7, 8, t0 + MIN_WINDOW / 2),
            Role::Worker,
            "too soon to measure"
        );
        // 1 us of CPU over 1 s: mostly waiting.
        let t1 = t0 + std::time::Duration::from_secs(1);
        std::fs::write(task.join("schedstat"), "2000 0 2\n").expect("write");
        assert_eq!(roles.role(7, 8, t1), Role::Latency);
        // A whole CPU over the next second: a worker again.
        std::fs::write(task.join("schedstat"), "1000002000 0 3\n").expect("write");
        let t2 = t1 + std::time::Duration::from_secs(1);
        roles.begin(t2);
        assert_eq!(roles.role(7, 8, t2), Role::Worker);
        assert_eq!(roles.role(7, 99, t2), Role::Worker, "unreadable thread");
    }
}
