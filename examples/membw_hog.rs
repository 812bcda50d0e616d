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
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use support::{
    flush_stdout, install_signal_handlers, last_level_cache_bytes, per_second, run_counting,
    start_workers, STOP,
};

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
    let workers = start_workers(args.threads, "stream", &ready, |_| {
        let (bytes, ready) = (bytes.clone(), ready.clone());
        move || stream(elements, &bytes, &ready)
    })?;
    println!(
        "ready pid={} threads={}",
        std::process::id(),
        workers.threads
    );
    flush_stdout();
    let (elapsed, total) = run_counting(
        workers,
        &bytes,
        args.seconds,
        "a streaming thread",
        |t, n, over| {
            let rate = per_second(n, over) / 1e9;
            println!("t={t:.0}s GB/s={rate:.2} threads={}", args.threads);
        },
    )?;
    println!(
        "final seconds={:.2} GB/s={:.2} bytes={total}",
        elapsed.as_secs_f64(),
        per_second(total, elapsed) / 1e9
    );
    flush_stdout();
    Ok(())
}
