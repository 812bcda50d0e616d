//! What the bundled workloads share: stopping cleanly on SIGTERM/SIGINT, the counting
//! workloads' run (worker threads started and waited for, a rate reported every second, the
//! total at the end), and the size of the last-level cache (to size working sets against it).
#![allow(dead_code)]

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

/// Set by SIGTERM or SIGINT once [`install_signal_handlers`] ran.
pub static STOP: AtomicBool = AtomicBool::new(false);

pub extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub fn install_signal_handlers() -> nix::Result<()> {
    let stop = SigAction::new(
        SigHandler::Handler(on_stop),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to a lock-free static atomic, which is
    // async-signal-safe.
    unsafe {
        sigaction(Signal::SIGTERM, &stop)?;
        sigaction(Signal::SIGINT, &stop)?;
    }
    Ok(())
}

/// A counting workload's worker threads, started by [`start_workers`].
pub struct Workers {
    handles: Vec<JoinHandle<()>>,
    /// The process's threads once the workers were ready (theirs and the main thread), as
    /// /proc/self/task lists them: what the tests' thread sweeps should find.
    pub threads: usize,
}

/// Starts `count` threads named `{name}-{i}`, each running `work(i)`, and waits until `ready`
/// counts every one of them (each work adds one when it starts its loop), a stop signal comes,
/// or one has ended early (its panic is reported by [`run_counting`]).
pub fn start_workers<W>(
    count: u32,
    name: &str,
    ready: &AtomicUsize,
    work: impl Fn(u32) -> W,
) -> Result<Workers, String>
where
    W: FnOnce() + Send + 'static,
{
    let mut handles = Vec::new();
    for i in 0..count {
        let handle = thread::Builder::new()
            .name(format!("{name}-{i}"))
            .spawn(work(i))
            .map_err(|e| format!("cannot start thread: {e}"))?;
        handles.push(handle);
    }
    let want = handles.len();
    while ready.load(Ordering::SeqCst) < want {
        if STOP.load(Ordering::SeqCst) || handles.iter().any(|w| w.is_finished()) {
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(want + 1);
    Ok(Workers { handles, threads })
}

/// Runs `workers` until a stop signal or `seconds` (0: until a signal), counting what `counter`
/// adds from now (what the workers did before they were all ready does not count). About every
/// second, `report(seconds since the start, counted since the last report, over how long)`
/// prints a line; stdout is flushed after it. Then stops and joins the workers: the time run
/// and the count over it, or an error naming `what` ("a spinning thread") when one panicked.
pub fn run_counting(
    workers: Workers,
    counter: &AtomicU64,
    seconds: u64,
    what: &str,
    mut report: impl FnMut(f64, u64, Duration),
) -> Result<(Duration, u64), String> {
    let start = Instant::now();
    let base = counter.load(Ordering::Relaxed);
    let limit = (seconds > 0).then(|| Duration::from_secs(seconds));
    let mut last = (start, base);
    let mut next_report = start + Duration::from_secs(1);
    // The main thread only watches the clock; the workers do the work.
    while !STOP.load(Ordering::SeqCst) {
        thread::sleep(Duration::from_millis(20));
        let now = Instant::now();
        if limit.is_some_and(|l| now.duration_since(start) >= l) {
            break;
        }
        if now >= next_report {
            next_report += Duration::from_secs(1);
            let total = counter.load(Ordering::Relaxed);
            report(
                now.duration_since(start).as_secs_f64(),
                total - last.1,
                now.duration_since(last.0),
            );
            flush_stdout();
            last = (now, total);
        }
    }
    STOP.store(true, Ordering::SeqCst);
    for worker in workers.handles {
        if worker.join().is_err() {
            return Err(format!("{what} panicked"));
        }
    }
    Ok((start.elapsed(), counter.load(Ordering::Relaxed) - base))
}

/// `n` per second over `over` (0 over no time).
pub fn per_second(n: u64, over: Duration) -> f64 {
    let secs = over.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    n as f64 / secs
}

pub fn flush_stdout() {
    // Tests read these lines through a pipe; a closed pipe is not an error worth dying for.
    let _ = std::io::stdout().flush();
}

/// The largest data or unified cache of CPU 0, in bytes, if sysfs says.
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let read = |name: &str| std::fs::read_to_string(path.join(name)).ok();
        let Some(level) = read("level").and_then(|s| s.trim().parse::<u32>().ok()) else {
            continue;
        };
        if read("type").is_some_and(|t| t.trim() == "Instruction") {
            continue;
        }
        let Some(size) = read("size").and_then(|s| parse_cache_size(s.trim())) else {
            continue;
        };
        match best {
            Some((deepest, _)) if deepest >= level => {}
            _ => best = Some((level, size)),
        }
    }
    best.map(|(_, size)| size)
}

/// sysfs cache sizes read like `32768K` or `32M`.
pub fn parse_cache_size(text: &str) -> Option<u64> {
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(scale)
}
