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
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use support::{
    flush_stdout, install_signal_handlers, last_level_cache_bytes, per_second, run_counting,
    start_workers, STOP,
};

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
    let workers = start_workers(args.threads, "chase", &ready, |i| {
        let (buf, accesses, ready) = (buf.clone(), accesses.clone(), ready.clone());
        let start =
            u32::try_from(u64::from(i) * (nodes as u64) / u64::from(args.threads)).unwrap_or(0);
        move || chase(&buf, start, &accesses, &ready)
    })?;
    println!(
        "ready pid={} threads={} nodes={nodes} mib={mib}",
        std::process::id(),
        workers.threads
    );
    flush_stdout();
    let (elapsed, total) = run_counting(
        workers,
        &accesses,
        args.seconds,
        "a chasing thread",
        |t, n, over| println!("t={t:.0}s accesses/s={:.0}", per_second(n, over)),
    )?;
    println!(
        "final seconds={:.2} accesses={total} accesses/s={:.0}",
        elapsed.as_secs_f64(),
        per_second(total, elapsed)
    );
    flush_stdout();
    Ok(())
}
