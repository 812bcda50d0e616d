//! A compute-bound workload: each thread runs a tight integer ALU loop over registers (four
//! independent xorshift streams, so the core can issue several per cycle) and touches no memory.
//! Its IPC is high and its cache-miss count near zero: the opposite of `pointer_chase`, which the
//! perf sensing test and the demo compare it with.
//!
//! Output on stdout, one line each:
//!   ready pid=<pid> threads=<n>                     once every thread runs
//!   t=<s>s iterations/s=<x>                         every second
//!   final seconds=<x> iterations=<n> iterations/s=<x>   at the end (--seconds, SIGTERM or SIGINT)

mod support;

use std::hint::black_box;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use support::{
    flush_stdout, install_signal_handlers, per_second, run_counting, start_workers, STOP,
};

use clap::Parser;

/// Iterations between looks at the stop flag: long enough to keep the loop free of memory
/// traffic, short enough to stop within a millisecond.
const BATCH: u64 = 1 << 16;

#[derive(Parser, Debug)]
#[command(
    name = "busy_loop",
    about = "Spins integer arithmetic in registers on N threads and prints iterations per second."
)]
struct Args {
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    threads: u32,
    /// Seconds to run; 0 runs until SIGTERM or SIGINT.
    #[arg(long, default_value_t = 0)]
    seconds: u64,
}

#[inline(always)]
fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

fn spin(seed: u64, iterations: &AtomicU64, ready: &AtomicUsize) {
    let mut s = [
        seed | 1,
        seed ^ 0x9E37_79B9_7F4A_7C15,
        !seed,
        seed.rotate_left(32) | 2,
    ];
    ready.fetch_add(1, Ordering::SeqCst);
    while !STOP.load(Ordering::Relaxed) {
        for _ in 0..BATCH {
            // Four independent dependency chains keep several ALUs busy each cycle.
            s[0] = xorshift(s[0]);
            s[1] = xorshift(s[1]);
            s[2] = xorshift(s[2]);
            s[3] = xorshift(s[3]);
        }
        black_box(&mut s);
        iterations.fetch_add(BATCH, Ordering::Relaxed);
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("busy_loop: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    install_signal_handlers().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let iterations = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicUsize::new(0));
    let workers = start_workers(args.threads, "spin", &ready, |i| {
        let (iterations, ready) = (iterations.clone(), ready.clone());
        move || spin(u64::from(i) + 1, &iterations, &ready)
    })?;
    println!(
        "ready pid={} threads={}",
        std::process::id(),
        workers.threads
    );
    flush_stdout();
    let (elapsed, total) = run_counting(
        workers,
        &iterations,
        args.seconds,
        "a spinning thread",
        |t, n, over| println!("t={t:.0}s iterations/s={:.0}", per_second(n, over)),
    )?;
    println!(
        "final seconds={:.2} iterations={total} iterations/s={:.0}",
        elapsed.as_secs_f64(),
        per_second(total, elapsed)
    );
    flush_stdout();
    Ok(())
}
