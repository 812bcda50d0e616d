//! The kernel's real-time limit and what a job's threads get under it: the node's
//! `sched_rt_runtime_us / sched_rt_period_us` (the share of each CPU RT tasks may use before the
//! kernel throttles them for the rest of the period), and the job's threads' time on CPU and in
//! the run queue from `/proc/PID/task/TID/schedstat` (`<on cpu ns> <waiting ns> <slices>`), and
//! each process's CPU time from its POSIX CPU-time clock. Reads the proc root it is given and
//! those clocks, nothing else.
//!
//! The kernel keeps no throttling counter for RT tasks outside RT group scheduling (it logs
//! "sched: RT throttling activated" once per boot), so the guard works from the job's demand:
//! a job whose threads keep each of its CPUs busier than the limit is throttled by construction.

use std::path::Path;
use std::time::Instant;

/// `<proc>/` + these.
pub const SCHED_RT_RUNTIME: &str = "sys/kernel/sched_rt_runtime_us";
pub const SCHED_RT_PERIOD: &str = "sys/kernel/sched_rt_period_us";

/// The node's RT limit as a share of each CPU (0.95 by default); `None` when RT tasks are
/// unthrottled (runtime -1) or the files cannot be read.
pub fn rt_limit(proc_root: &Path) -> Option<f64> {
    let read = |f: &str| -> Option<i64> {
        std::fs::read_to_string(proc_root.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let runtime = read(SCHED_RT_RUNTIME)?;
    let period = read(SCHED_RT_PERIOD)?;
    limit_of(runtime, period)
}

/// `runtime / period`, `None` for -1 (unthrottled) or a period that is not positive.
pub fn limit_of(runtime_us: i64, period_us: i64) -> Option<f64> {
    if runtime_us < 0 || period_us <= 0 {
        return None;
    }
    // Microsecond sysctls below 2^31: exact in f64.
    Some((runtime_us as f64 / period_us as f64).min(1.0))
}

/// One thread's scheduler counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadTime {
    pub tid: u32,
    pub on_cpu_ns: u64,
    pub waiting_ns: u64,
}

/// The job's threads' scheduler counters, one entry a thread sorted by thread id, at an instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadTimes {
    pub threads: Vec<ThreadTime>,
    pub at: Instant,
}

impl ThreadTimes {
    /// Time on CPU over all the threads read.
    pub fn on_cpu_ns(&self) -> u64 {
        self.threads
            .iter()
            .fold(0, |sum, t| sum.saturating_add(t.on_cpu_ns))
    }
}

/// Reads `/proc/PID/task/TID/schedstat` for every thread of `pids`. Threads that exit between
/// the listing and the read are left out, as are entries whose name is not a thread id.
pub fn thread_times(proc_root: &Path, pids: &[u32]) -> ThreadTimes {
    let mut threads = Vec::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(proc_root.join(format!("{pid}/task"))) else {
            continue;
        };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
                continue;
            };
            if let Some((on_cpu_ns, waiting_ns)) = parse_schedstat(&text) {
                threads.push(ThreadTime {
                    tid,
                    on_cpu_ns,
                    waiting_ns,
                });
            }
        }
    }
    threads.sort_unstable_by_key(|t| t.tid);
    threads.dedup_by_key(|t| t.tid);
    ThreadTimes {
        threads,
        at: Instant::now(),
    }
}

/// Where a job's CPU time comes from: the processes' CPU-time clocks ([`kernel_clock`]) or, for
/// a fake proc tree in tests, the threads' schedstat files ([`schedstat_clock`]).
pub type CpuClock = fn(&Path, u32) -> Option<u64>;

/// A job's CPU time per process, at an instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuSample {
    /// (pid, its CPU time in ns), sorted by pid; a process whose clock cannot be read is absent.
    pub processes: Vec<(u32, u64)>,
    pub at: Instant,
}

/// The CPU time of the whole process `pid` from its POSIX CPU-time clock
/// ([`crate::sys::procfs::process_cpu_ns`]): one syscall per process, where summing
/// `/proc/PID/task/*/schedstat` opens a file per thread (at 100 jobs and 1,000 threads that was
/// 8 ms of every tick, issue 21).
pub fn kernel_clock(_proc_root: &Path, pid: u32) -> Option<u64> {
    crate::sys::procfs::process_cpu_ns(pid)
}

/// The on-CPU time of `pid`'s live threads from `<proc>/PID/task/*/schedstat`: the clock of a
/// fake proc tree.
pub fn schedstat_clock(proc_root: &Path, pid: u32) -> Option<u64> {
    let t = thread_times(proc_root, &[pid]);
    (!t.threads.is_empty()).then(|| t.on_cpu_ns())
}

/// The CPU time of each of `pids` by `clock`, now. A process that is gone is left out.
pub fn cpu_sample(clock: CpuClock, proc_root: &Path, pids: &[u32]) -> CpuSample {
    let mut processes: Vec<(u32, u64)> = pids
        .iter()
        .filter_map(|&pid| Some((pid, clock(proc_root, pid)?)))
        .collect();
    processes.sort_unstable();
    processes.dedup_by_key(|(pid, _)| *pid);
    CpuSample {
        processes,
        at: Instant::now(),
    }
}

/// CPU time per CPU of `cpus` between two samples, 0..; `None` when no time passed, no CPU, or
/// no process is in both. Per process, as `sense::cpu::JobCpuRate`: only processes in both
/// samples count, so one that left (a DataLoader worker re-created under a new pid) does not make
/// the share dip to 0, and one that joined with CPU time behind it does not make it spike.
pub fn share_per_cpu(prev: &CpuSample, cur: &CpuSample, cpus: usize) -> Option<f64> {
    let wall = cur.at.checked_duration_since(prev.at)?.as_secs_f64();
    if wall <= 0.0 || cpus == 0 {
        return None;
    }
    let mut matched = false;
    let mut run_ns = 0u64;
    for &(pid, now) in &cur.processes {
        let Ok(i) = prev.processes.binary_search_by_key(&pid, |&(p, _)| p) else {
            continue;
        };
        let Some(&(_, before)) = prev.processes.get(i) else {
            continue;
        };
        matched = true;
        run_ns = run_ns.saturating_add(now.saturating_sub(before));
    }
    matched.then(|| run_ns as f64 / 1e9 / wall / cpus as f64)
}

/// `<on cpu ns> <waiting ns> <slices>`: the first two.
pub fn parse_schedstat(text: &str) -> Option<(u64, u64)> {
    let mut it = text.split_whitespace();
    let run = it.next()?.parse().ok()?;
    let wait = it.next()?.parse().ok()?;
    Some((run, wait))
}

/// Time the job's threads spent runnable but waiting between two samples, ms per second summed
/// over threads; `None` when no time passed or no thread is in both. Per thread, as
/// [`share_per_cpu`] is per process: only threads in both samples count, so one that exited (a
/// DataLoader worker re-created) does not make the figure dip, and one that joined with waiting
/// time behind it does not make it spike.
pub fn runq_wait_ms_per_s(prev: &ThreadTimes, cur: &ThreadTimes) -> Option<f64> {
    let wall = cur.at.checked_duration_since(prev.at)?.as_secs_f64();
    if wall <= 0.0 {
        return None;
    }
    let mut matched = false;
    let mut wait_ns = 0u64;
    for now in &cur.threads {
        let Ok(i) = prev.threads.binary_search_by_key(&now.tid, |t| t.tid) else {
            continue;
        };
        let Some(before) = prev.threads.get(i) else {
            continue;
        };
        matched = true;
        wait_ns = wait_ns.saturating_add(now.waiting_ns.saturating_sub(before.waiting_ns));
    }
    matched.then(|| wait_ns as f64 / 1e9 / wall * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn limit_is_runtime_over_period() {
        assert_eq!(limit_of(950_000, 1_000_000), Some(0.95));
        assert_eq!(limit_of(-1, 1_000_000), None);
        assert_eq!(limit_of(5, 0), None);
        assert_eq!(limit_of(2_000_000, 1_000_000), Some(1.0));
    }

    #[test]
    fn reads_fake_sysctls_and_threads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::create_dir_all(root.join("sys/kernel")).expect("mkdir");
        assert_eq!(rt_limit(root), None, "missing files");
        std::fs::write(root.join(SCHED_RT_RUNTIME), "900000\n").expect("write");
        std::fs::write(root.join(SCHED_RT_PERIOD), "1000000\n").expect("write");
        assert_eq!(rt_limit(root), Some(0.9));
        std::fs::write(root.join(SCHED_RT_RUNTIME), "-1\n").expect("write");
        assert_eq!(rt_limit(root), None, "unthrottled");
        for (tid, line) in [(10, "500 20 3\n"), (11, "1500 30 4\n"), (12, "garbage\n")] {
            let d = root.join(format!("10/task/{tid}"));
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("schedstat"), line).expect("write");
        }
        let t = thread_times(root, &[10, 99]);
        assert_eq!(
            t.threads,
            [
                ThreadTime {
                    tid: 10,
                    on_cpu_ns: 500,
                    waiting_ns: 20
                },
                ThreadTime {
                    tid: 11,
                    on_cpu_ns: 1500,
                    waiting_ns: 30
                }
            ]
        );
        assert_eq!(t.on_cpu_ns(), 2000);
    }

    #[test]
    fn a_process_clock_counts_its_threads_cpu_time() {
        let me = std::process::id();
        let root = Path::new("/proc");
        let before = kernel_clock(root, me).expect("own process clock");
        // Until the thread itself has run 20 ms, by its own clock: no wall-time guess.
        let spin = std::thread::spawn(|| {
            let own = || {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: `ts` is a valid timespec to write to.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
            };
            let mut x = 0u64;
            while own() < Duration::from_millis(20) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        });
        spin.join().expect("spin");
        let after = kernel_clock(root, me).expect("own process clock");
        // The exited thread's CPU time stays in the process's clock.
        assert!(after - before >= 20_000_000, "{before} -> {after}");
        assert_eq!(kernel_clock(root, u32::MAX), None);
    }

    #[test]
    fn share_per_cpu_from_two_samples() {
        let at = Instant::now();
        let prev = CpuSample {
            processes: vec![(10, 0)],
            at,
        };
        let cur = CpuSample {
            processes: vec![(10, 1_900_000_000)],
            at: at + Duration::from_secs(1),
        };
        let share = share_per_cpu(&prev, &cur, 2).expect("share");
        assert!((share - 0.95).abs() < 1e-9);
        assert_eq!(share_per_cpu(&cur, &prev, 2), None, "time went backwards");
        assert_eq!(share_per_cpu(&prev, &cur, 0), None);
    }

    #[test]
    fn a_process_leaving_or_joining_makes_the_share_neither_dip_nor_spike() {
        let at = Instant::now();
        let second = |processes: Vec<(u32, u64)>| CpuSample {
            processes,
            at: at + Duration::from_secs(1),
        };
        // The trainer (10) and a DataLoader worker (11) with 5 s of CPU time behind it.
        let prev = CpuSample {
            processes: vec![(10, 20_000_000_000), (11, 5_000_000_000)],
            at,
        };
        // The worker is re-created as 12 within the second: the trainer ran 0.9 s of it.
        let cur = second(vec![(10, 20_900_000_000), (12, 50_000_000)]);
        let share = share_per_cpu(&prev, &cur, 1).expect("share");
        assert!((share - 0.9).abs() < 1e-9, "dipped: {share}");
        // A process that joins the job with 100 s behind it adds nothing this window.
        let cur = second(vec![
            (10, 20_900_000_000),
            (11, 5_000_000_000),
            (13, 100_000_000_000),
        ]);
        let share = share_per_cpu(&prev, &cur, 1).expect("share");
        assert!((share - 0.9).abs() < 1e-9, "spiked: {share}");
        // No process in both: no figure rather than 0.
        assert_eq!(share_per_cpu(&prev, &second(vec![(14, 1)]), 1), None);
    }

    #[test]
    fn a_sample_keeps_each_readable_process_once_in_pid_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        for (pid, line) in [(30, "300 0 1\n"), (20, "200 0 1\n")] {
            let d = root.join(format!("{pid}/task/{pid}"));
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("schedstat"), line).expect("write");
        }
        let s = cpu_sample(schedstat_clock, root, &[30, 99, 20, 30]);
        assert_eq!(s.processes, vec![(20, 200), (30, 300)]);
    }

    fn thread(tid: u32, waiting_ns: u64) -> ThreadTime {
        ThreadTime {
            tid,
            on_cpu_ns: 0,
            waiting_ns,
        }
    }

    #[test]
    fn runq_wait_from_two_samples() {
        let at = Instant::now();
        let prev = ThreadTimes {
            threads: vec![thread(10, 0), thread(11, 0)],
            at,
        };
        let cur = ThreadTimes {
            threads: vec![thread(10, 20_000_000), thread(11, 30_000_000)],
            at: at + Duration::from_secs(1),
        };
        let wait = runq_wait_ms_per_s(&prev, &cur).expect("wait");
        assert!((wait - 50.0).abs() < 1e-9, "{wait}");
        assert_eq!(runq_wait_ms_per_s(&cur, &prev), None, "time went backwards");
    }

    /// The wait figure was the summed waiting time of the threads read in each sample: a thread
    /// that exited between two samples took its waiting time out of the sum and the figure
    /// dipped to 0 for a window (or spiked when one joined with time behind it).
    #[test]
    fn a_thread_leaving_or_joining_makes_the_wait_neither_dip_nor_spike() {
        let at = Instant::now();
        let second = |threads: Vec<ThreadTime>| ThreadTimes {
            threads,
            at: at + Duration::from_secs(1),
        };
        // The trainer's thread (10) and a DataLoader worker's (11) with 4 s waited behind it.
        let prev = ThreadTimes {
            threads: vec![thread(10, 1_000_000_000), thread(11, 4_000_000_000)],
            at,
        };
        // The worker is re-created as 12 within the second; the trainer waited 30 ms of it.
        let cur = second(vec![thread(10, 1_030_000_000), thread(12, 1_000_000)]);
        let wait = runq_wait_ms_per_s(&prev, &cur).expect("wait");
        assert!((wait - 30.0).abs() < 1e-9, "dipped: {wait}");
        // A thread that joins with 100 s waited behind it adds nothing this window.
        let cur = second(vec![
            thread(10, 1_030_000_000),
            thread(11, 4_000_000_000),
            thread(13, 100_000_000_000),
        ]);
        let wait = runq_wait_ms_per_s(&prev, &cur).expect("wait");
        assert!((wait - 30.0).abs() < 1e-9, "spiked: {wait}");
        // No thread in both: no figure rather than 0.
        assert_eq!(
            runq_wait_ms_per_s(&prev, &second(vec![thread(14, 1)])),
            None
        );
    }
}
