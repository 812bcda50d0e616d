//! A memory-latency-bound workload: follows a random cyclic permutation through a buffer much
//! larger than the last-level cache, one 64-byte node per step, so nearly every step is a cache
//! (and TLB) miss that the next step depends on. Its IPC is low and its cache-miss ratio high:
//! the opposite of `busy_loop`, which the perf sensing test and the demo compare it with.
//!
//! Output on stdout, one line each:
//!   ready pid=<pid> threads=<n> nodes=<n> mib=<n>   once the cycle is built and being chased
//!   t=<s>s accesses/s=<x>                           every second
//!   final seconds=<x> accesses=<n> accesses/s=<x>   at the end (--seconds, SIGTERM or SIGINT)

mod support;

use std::hint::black_box;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{install_signal_handlers, last_level_cache_bytes, STOP};

use clap::Parser;

const MIB: u64 = 1 << 20;
/// Steps between looks at the stop flag.
const BATCH: u64 = 1 << 14;
/// Buffer size when sysfs does not give the last-level cache size.
const FALLBACK_MIB: u64 = 1024;
/// Auto-sizing: this many times the last-level cache, within these bounds.
const LLC_FACTOR: u64 = 4;
const MIN_AUTO_MIB: u64 = 256;
const MAX_AUTO_MIB: u64 = 2048;

/// One cache line: the next node's index and padding, so each step touches a new line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Node {
    next: u32,
    _pad: [u32; 15],
}

#[derive(Parser, Debug)]
#[command(
    name = "pointer_chase",
    about = "Chases a random cycle through a buffer larger than the last-level cache and prints \
             accesses per second."
)]
struct Args {
    /// Buffer size in MiB; 0 picks four times the last-level cache sysfs reports (256 to 2048).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=262_144))]
    mib: u64,
    /// Threads chasing the same cycle from different starting nodes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    threads: u32,
    /// Seconds to run; 0 runs until SIGTERM or SIGINT.
    #[arg(long, default_value_t = 0)]
    seconds: u64,
}

/// splitmix64: a small, good-enough generator; no dependency for a shuffle.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..=bound (Lemire's multiply-shift; the bias is negligible for a workload).
    fn below_or_eq(&mut self, bound: usize) -> usize {
        let span = u128::from(u64::try_from(bound).unwrap_or(u64::MAX)) + 1;
        let r = (u128::from(self.next()) * span) >> 64;
        usize::try_from(r).unwrap_or(0)
    }
}

/// Links every node into one cycle in a random order: shuffling the visiting order and linking
/// consecutive entries gives a single cycle through all nodes, with no short loops.
fn build_cycle(nodes: usize, seed: u64) -> Vec<Node> {
    let mut order: Vec<u32> = (0..u32::try_from(nodes).unwrap_or(u32::MAX)).collect();
    let mut rng = SplitMix(seed);
    for i in (1..order.len()).rev() {
        let j = rng.below_or_eq(i);
        order.swap(i, j);
    }
    let mut buf = vec![
        Node {
            next: 0,
            _pad: [0; 15]
        };
        order.len()
    ];
    for (k, &from) in order.iter().enumerate() {
        let to = order[(k + 1) % order.len()];
        buf[from as usize].next = to;
    }
    buf
}

fn chase(buf: &[Node], start: u32, accesses: &AtomicU64, ready: &AtomicUsize) {
    let mut at = start;
    ready.fetch_add(1, Ordering::SeqCst);
    while !STOP.load(Ordering::Relaxed) {
        for _ in 0..BATCH {
            // Each load's address is the previous load's value: no overlap, no prefetch.
            at = buf[at as usize].next;
        }
        black_box(at);
        accesses.fetch_add(BATCH, Ordering::Relaxed);
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pointer_chase: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    install_signal_handlers().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let llc = last_level_cache_bytes();
    let mib = match (args.mib, llc) {
        (0, Some(llc)) => (llc * LLC_FACTOR / MIB).clamp(MIN_AUTO_MIB, MAX_AUTO_MIB),
        (0, None) => FALLBACK_MIB,
        (m, _) => m,
    };
    if let Some(llc) = llc {
        if mib * MIB < 2 * llc {
            eprintln!(
                "pointer_chase: warning: {mib} MiB is less than twice the {} MiB last-level \
                 cache sysfs reports; part of the cycle may be served from cache",
                llc / MIB
            );
        }
    }
    let nodes = usize::try_from(mib * MIB / 64).map_err(|e| e.to_string())?;
    if nodes < 2 || u32::try_from(nodes).is_err() {
        return Err(format!("{mib} MiB gives {nodes} nodes; need 2 to 2^32"));
    }
    let buf = Arc::new(build_cycle(nodes, 0x5EED ^ u64::from(std::process::id())));

    let accesses = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for i in 0..args.threads {
        let (buf, accesses, ready) = (buf.clone(), accesses.clone(), ready.clone());
        let start =
            u32::try_from(u64::from(i) * (nodes as u64) / u64::from(args.threads)).unwrap_or(0);
        let handle = thread::Builder::new()
            .name(format!("chase-{i}"))
            .spawn(move || chase(&buf, start, &accesses, &ready))
            .map_err(|e| format!("cannot start thread: {e}"))?;
        workers.push(handle);
    }
    let want = workers.len();
    while ready.load(Ordering::SeqCst) < want {
        if STOP.load(Ordering::SeqCst) || workers.iter().any(|w| w.is_finished()) {
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    let thread_count = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(want + 1);
    println!(
        "ready pid={} threads={thread_count} nodes={nodes} mib={mib}",
        std::process::id()
    );
    flush_stdout();

    let start = Instant::now();
    let base = accesses.load(Ordering::Relaxed);
    let limit = (args.seconds > 0).then(|| Duration::from_secs(args.seconds));
    let mut last = (start, base);
    let mut next_report = start + Duration::from_secs(1);
    while !STOP.load(Ordering::SeqCst) {
        thread::sleep(Duration::from_millis(20));
        let now = Instant::now();
        if limit.is_some_and(|l| now.duration_since(start) >= l) {
            break;
        }
        if now >= next_report {
            next_report += Duration::from_secs(1);
            let total = accesses.load(Ordering::Relaxed);
            println!(
                "t={:.0}s accesses/s={:.0}",
                now.duration_since(start).as_secs_f64(),
                per_second(total - last.1, now.duration_since(last.0))
            );
            flush_stdout();
            last = (now, total);
        }
    }
    STOP.store(true, Ordering::SeqCst);
    for worker in workers {
        if worker.join().is_err() {
            return Err("a chasing thread panicked".to_string());
        }
    }
    let elapsed = start.elapsed();
    let total = accesses.load(Ordering::Relaxed) - base;
    println!(
        "final seconds={:.2} accesses={total} accesses/s={:.0}",
        elapsed.as_secs_f64(),
        per_second(total, elapsed)
    );
    flush_stdout();
    Ok(())
}

fn per_second(n: u64, over: Duration) -> f64 {
    let secs = over.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    n as f64 / secs
}

fn flush_stdout() {
    // Tests read these lines through a pipe; a closed pipe is not an error worth dying for.
    let _ = std::io::stdout().flush();
}
