//! A memory-bandwidth hog: each thread runs the STREAM triad (`a[i] = b[i] + s * c[i]`) over
//! arrays far larger than the last-level cache, so every pass goes to DRAM. It is the
//! colocated job that contention control (SODA §V-E: MBA, else core halving) exists for.
//!
//! Output on stdout, one line each:
//!   ready pid=<pid> threads=<n>                 once every thread has its buffers and runs
//!   t=<s>s GB/s=<x> threads=<n>                 every second
//!   final seconds=<x> GB/s=<x> bytes=<n>        at the end (--seconds, SIGTERM or SIGINT)
//! GB/s counts 24 bytes per element (two reads, one write) as STREAM does; with write-allocate
//! the real DRAM traffic is a third higher.

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
/// Elements per chunk between progress updates: 1 MiB of each array's f64s.
const CHUNK: usize = 1 << 17;
const TRIAD_SCALAR: f64 = 0.5;
/// Bytes STREAM counts per triad element: read b, read c, write a.
const BYTES_PER_ELEMENT: u64 = 24;

#[derive(Parser, Debug)]
#[command(
    name = "membw_hog",
    about = "Streams over buffers larger than the last-level cache (STREAM triad) and prints \
             the bandwidth it gets each second."
)]
struct Args {
    /// Threads, each streaming over its own buffers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    threads: u32,
    /// Memory per thread in MiB, split over the triad's three arrays.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(3..=1_048_576))]
    mib: u64,
    /// Seconds to run; 0 runs until SIGTERM or SIGINT.
    #[arg(long, default_value_t = 0)]
    seconds: u64,
}

/// One thread's work: allocate and first-touch its arrays (so they land on its NUMA node),
/// report readiness, then run the triad until told to stop.
fn stream(elements: usize, bytes: &AtomicU64, ready: &AtomicUsize) {
    // Not zero: a zeroed vec is lazily mapped, and its page faults would land in the first pass.
    let mut a = vec![3.0f64; elements];
    let b = vec![1.0f64; elements];
    let c = vec![2.0f64; elements];
    ready.fetch_add(1, Ordering::SeqCst);
    while !STOP.load(Ordering::Relaxed) {
        for ((a, b), c) in a
            .chunks_mut(CHUNK)
            .zip(b.chunks(CHUNK))
            .zip(c.chunks(CHUNK))
        {
            for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
                *a = b + TRIAD_SCALAR * c;
            }
            // Keeps the stores: the optimizer must assume the chunk is read.
            black_box(&mut *a);
            let len = u64::try_from(a.len()).unwrap_or(0);
            bytes.fetch_add(len * BYTES_PER_ELEMENT, Ordering::Relaxed);
            if STOP.load(Ordering::Relaxed) {
                return;
            }
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("membw_hog: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    install_signal_handlers().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let per_array = args.mib * MIB / 3;
    let elements = usize::try_from(per_array / 8).map_err(|e| e.to_string())?;
    if let Some(llc) = last_level_cache_bytes() {
        if args.mib * MIB < 2 * llc {
            eprintln!(
                "membw_hog: warning: {} MiB per thread is less than twice the {} MiB last-level \
                 cache sysfs reports; part of the stream may be served from cache",
                args.mib,
                llc / MIB
            );
        }
    }

    let bytes = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for i in 0..args.threads {
        let (bytes, ready) = (bytes.clone(), ready.clone());
        let handle = thread::Builder::new()
            .name(format!("stream-{i}"))
            .spawn(move || stream(elements, &bytes, &ready))
            .map_err(|e| format!("cannot start thread: {e}"))?;
        workers.push(handle);
    }
    let want = workers.len();
    while ready.load(Ordering::SeqCst) < want {
        if STOP.load(Ordering::SeqCst) || workers.iter().any(|w| w.is_finished()) {
            break;
        }
        thread::sleep(Duration::from_millis(5));
    }
    let thread_count = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(want + 1);
    println!("ready pid={} threads={thread_count}", std::process::id());
    flush_stdout();

    let start = Instant::now();
    // Bytes streamed before every thread was ready do not count.
    let base = bytes.load(Ordering::Relaxed);
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
            let total = bytes.load(Ordering::Relaxed);
            let rate = gb_per_s(total - last.1, now.duration_since(last.0));
            println!(
                "t={:.0}s GB/s={rate:.2} threads={}",
                now.duration_since(start).as_secs_f64(),
                args.threads
            );
            flush_stdout();
            last = (now, total);
        }
    }

    STOP.store(true, Ordering::SeqCst);
    for worker in workers {
        if worker.join().is_err() {
            return Err("a streaming thread panicked".to_string());
        }
    }
    let elapsed = start.elapsed();
    let total = bytes.load(Ordering::Relaxed) - base;
    println!(
        "final seconds={:.2} GB/s={:.2} bytes={total}",
        elapsed.as_secs_f64(),
        gb_per_s(total, elapsed)
    );
    flush_stdout();
    Ok(())
}

fn gb_per_s(bytes: u64, over: Duration) -> f64 {
    let secs = over.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    bytes as f64 / secs / 1e9
}

fn flush_stdout() {
    // Tests read these lines through a pipe; a closed pipe is not an error worth dying for.
    let _ = std::io::stdout().flush();
}
