//! A training-step emulator: the CPU side of a GPU training job, for measuring interference.
//!
//! Data-loader threads do real work per batch (generate a pseudo-random image, normalize it,
//! run a 3x3 convolution over it) and push the result into a bounded queue, as a PyTorch
//! DataLoader with prefetching does. A dispatch thread takes one batch per step, does a little
//! host-side work (the kernel launches) and then waits for the emulated GPU step. That wait is
//! the one timed sleep here, and it is the thing being emulated: the GPU is busy, the CPU is not.
//! When loaders are slowed by colocated jobs, the dispatch thread waits for data, the GPU idles
//! and `gpu_busy` drops below 1.
//!
//! With `--loader-mib N` each loader works through a ring of N MiB of decoded samples instead of
//! generating its images: one unit augments a 1 MiB sample in place and shrinks it to the image,
//! so the work is memory-bound once the ring is larger than the caches, and a memory-bandwidth
//! hog beside it (`examples/membw_hog.rs`) can slow it as it would slow a real data loader.
//! Without it the work stays in the core's caches.
//!
//! Signals: SIGUSR1 starts one more loader thread (tests use it to check that lodger catches
//! threads created after registration); SIGUSR2 starts one that first puts itself back to
//! SCHED_OTHER with an affinity of every CPU, as some runtimes do for their own threads (tests
//! use it to check that lodger's sweep, not inheritance, keeps every thread in place); SIGTERM and SIGINT print a final summary and exit 0.
//!
//! Output on stdout, one line each:
//!   ready pid=<pid> threads=<n>                       once every thread is running
//!   worker added: workers=<w> threads=<n>             after each SIGUSR1
//!   t=<s>s iters/s=<x> mean_iter_ms=<x> gpu_busy=<x> workers=<w>   every second
//!   final iterations=<k> elapsed_s=<x> iters/s=<x> mean_iter_ms=<x> gpu_busy=<x> workers=<w>
//! With `--report PATH`, one JSON line per iteration is appended to PATH (truncated at start):
//!   {"iter":1,"iter_ms":20.123,"gpu_busy":0.981}
//! With `--publish-dir DIR` (or `LODGER_EMULATED_GPU_DIR=DIR` when the flag is absent), the
//! emulated GPU is published for lodger's `gpu.source = "emulated"`: DIR/<pid>.json is replaced
//! atomically every second and removed on exit (`lodger::sense::gpu::EmulatedGpuRecord`):
//!   {"pid":4242,"gpu":0,"busy":0.981,"iters_per_s":48.7,"updated_unix_ms":1764000000123}
//!
//! Build with `--release` for numbers worth comparing; a debug build does ~10x more CPU work
//! per unit. The work itself, and its calibration, are in `work.rs`.

use std::collections::VecDeque;
use std::fs::File;
use std::hint::black_box;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use clap::Parser;
use lodger::sense::gpu::{
    remove_emulated_record, write_emulated_record, EmulatedGpuRecord, EMULATED_GPU_DIR_ENV,
};
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

mod work;
use work::{Preprocessor, Work};

const MIB: usize = 1 << 20;
/// The window `gpu_busy` and the per-second summary are computed over.
const WINDOW: Duration = Duration::from_secs(1);
/// How often the main thread looks at signals and progress.
const POLL: Duration = Duration::from_millis(10);

#[derive(Parser, Debug)]
#[command(
    name = "train_emulator",
    about = "Emulates the CPU side of a GPU training job: loader threads doing real \
             preprocessing work, a dispatch thread waiting on an emulated GPU step."
)]
struct Args {
    /// Data-loader threads to start with (each SIGUSR1 adds one).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    workers: u32,
    /// CPU work per batch, in units; one unit generates, normalizes and convolves one 64x64
    /// image, a row at a time, so fractions down to one row (1/64) count. Default: calibrated
    /// at start so a batch costs --batch-cpu-ms of CPU time.
    #[arg(long, value_name = "UNITS", value_parser = work::parse_batch_units)]
    work_per_batch: Option<Work>,
    /// CPU time per batch to calibrate to when --work-per-batch is not given, in milliseconds.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    batch_cpu_ms: u64,
    /// Host-side work of the dispatch thread per step (kernel launches), in the same units.
    /// Default: calibrated at start so a step costs --dispatch-cpu-us of CPU time.
    #[arg(long, value_name = "UNITS", value_parser = work::parse_dispatch_units)]
    dispatch_work: Option<Work>,
    /// CPU time of the dispatch thread per step to calibrate to when --dispatch-work is not
    /// given, in microseconds (to the nearest row of work, so possibly none on a slow machine).
    #[arg(long, default_value_t = 150, value_parser = clap::value_parser!(u64).range(0..=60_000_000))]
    dispatch_cpu_us: u64,
    /// Duration of the emulated GPU step, in milliseconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    gpu_step_ms: u64,
    /// Iterations to run before exiting; 0 runs until SIGTERM or SIGINT.
    #[arg(long, default_value_t = 0)]
    iterations: u64,
    /// Batches the loaders may prepare ahead of the dispatch thread.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    queue_depth: u32,
    /// Append one JSON line per iteration to this file (truncated at start).
    #[arg(long, value_name = "PATH")]
    report: Option<PathBuf>,
    /// Publish the emulated GPU's busy fraction to DIR/<pid>.json every second for lodger's
    /// emulated GPU source (default: $LODGER_EMULATED_GPU_DIR, if set).
    #[arg(long, value_name = "DIR")]
    publish_dir: Option<PathBuf>,
    /// Index of the emulated GPU, as published.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Give each loader a ring of decoded samples of this many MiB: one unit then augments the
    /// next 1 MiB sample in place (every byte read and written back) and shrinks it to its
    /// image before normalizing and convolving it. Without it the work stays in the core's
    /// caches and a memory-bandwidth hog beside it cannot slow it; with a ring beyond the caches
    /// the unit is memory-bound and it can, as it slows a real data loader.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    loader_mib: Option<u64>,
}

/// Publishes the emulated GPU for lodger (`--publish-dir`); removes the record when dropped.
struct Publisher {
    dir: PathBuf,
    pid: u32,
    gpu: u32,
    warned: bool,
}

impl Publisher {
    fn from_args(args: &Args) -> Option<Self> {
        let dir = args.publish_dir.clone().or_else(|| {
            std::env::var_os(EMULATED_GPU_DIR_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })?;
        Some(Self {
            dir,
            pid: std::process::id(),
            gpu: args.gpu,
            warned: false,
        })
    }

    fn publish(&mut self, busy: f64, iters_per_s: f64) {
        let record = EmulatedGpuRecord::now(self.pid, self.gpu, busy, iters_per_s);
        match write_emulated_record(&self.dir, &record) {
            Ok(()) => self.warned = false,
            Err(e) if !self.warned => {
                eprintln!(
                    "train_emulator: cannot publish to {}: {e}; retrying every second",
                    self.dir.display()
                );
                self.warned = true;
            }
            Err(_) => {}
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Err(e) = remove_emulated_record(&self.dir, self.pid) {
            eprintln!(
                "train_emulator: cannot remove its record in {}: {e}",
                self.dir.display()
            );
        }
    }
}

// Set from signal handlers, read by the main thread.
static STOP: AtomicBool = AtomicBool::new(false);
static ADD_WORKERS: AtomicUsize = AtomicUsize::new(0);
static ADD_ESCAPING_WORKERS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

extern "C" fn on_usr1(_: libc::c_int) {
    ADD_WORKERS.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_usr2(_: libc::c_int) {
    ADD_ESCAPING_WORKERS.fetch_add(1, Ordering::SeqCst);
}

fn install_signal_handlers() -> nix::Result<()> {
    // SA_RESTART: a signal must not turn a loader's or the dispatcher's wait into an error.
    let flags = SaFlags::SA_RESTART;
    let stop = SigAction::new(SigHandler::Handler(on_stop), flags, SigSet::empty());
    let usr1 = SigAction::new(SigHandler::Handler(on_usr1), flags, SigSet::empty());
    let usr2 = SigAction::new(SigHandler::Handler(on_usr2), flags, SigSet::empty());
    // SAFETY: both handlers only store to or add to a lock-free static atomic, which is
    // async-signal-safe; they touch no other state.
    unsafe {
        sigaction(Signal::SIGTERM, &stop)?;
        sigaction(Signal::SIGINT, &stop)?;
        sigaction(Signal::SIGUSR1, &usr1)?;
        sigaction(Signal::SIGUSR2, &usr2)?;
    }
    Ok(())
}

/// A preprocessed batch, handed from a loader to the dispatch thread.
struct Batch {
    checksum: f32,
}

/// One finished iteration, as the dispatch thread saw it.
#[derive(Clone, Copy)]
struct Step {
    end: Instant,
    iter: Duration,
    gpu: Duration,
}

/// What the dispatch thread has done, shared with the main thread for the summaries.
struct Progress {
    started: Instant,
    iterations: u64,
    total_iter: Duration,
    total_gpu: Duration,
    window: VecDeque<Step>,
    /// The GPU step under way (its start and length), counted as busy for as long as it has
    /// run: without it a reading taken mid-step counted the step as idle, so the busy figure
    /// swung by up to one step per window with the phase of the reading (3 % between two
    /// right-sizing windows at 100-ms steps, which a right-sizer rightly takes for a loss).
    current: Option<(Instant, Duration)>,
}

impl Progress {
    fn new(started: Instant) -> Self {
        Self {
            started,
            iterations: 0,
            total_iter: Duration::ZERO,
            total_gpu: Duration::ZERO,
            window: VecDeque::new(),
            current: None,
        }
    }

    fn record(&mut self, step: Step) {
        self.current = None;
        self.iterations += 1;
        self.total_iter += step.iter;
        self.total_gpu += step.gpu;
        self.window.push_back(step);
        self.prune(step.end);
    }

    fn prune(&mut self, now: Instant) {
        while self
            .window
            .front()
            .is_some_and(|s| now.duration_since(s.end) > WINDOW)
        {
            self.window.pop_front();
        }
    }

    /// (iterations per second, mean iteration ms, GPU busy fraction) over the last window.
    /// The window's wall time runs from the start of its first iteration to `now`, and the GPU
    /// step under way counts for as long as it has run, so a dispatcher stalled on data right
    /// now shows up as falling GPU busy.
    fn recent(&mut self, now: Instant) -> (f64, f64, f64) {
        self.prune(now);
        let Some(first) = self.window.front() else {
            return (0.0, 0.0, 0.0);
        };
        let span = now.duration_since(first.end - first.iter).as_secs_f64();
        if span <= 0.0 {
            return (0.0, 0.0, 0.0);
        }
        let count = self.window.len() as f64;
        let iter: Duration = self.window.iter().map(|s| s.iter).sum();
        let under_way = self.current.map_or(Duration::ZERO, |(since, step)| {
            now.saturating_duration_since(since).min(step)
        });
        let gpu: Duration = self.window.iter().map(|s| s.gpu).sum::<Duration>() + under_way;
        (
            count / span,
            iter.as_secs_f64() * 1e3 / count,
            (gpu.as_secs_f64() / span).min(1.0),
        )
    }

    fn overall(&self, now: Instant) -> (f64, f64, f64, f64) {
        let elapsed = now.duration_since(self.started).as_secs_f64();
        let n = self.iterations as f64;
        if self.iterations == 0 || elapsed <= 0.0 {
            return (elapsed, 0.0, 0.0, 0.0);
        }
        (
            elapsed,
            n / elapsed,
            self.total_iter.as_secs_f64() * 1e3 / n,
            (self.total_gpu.as_secs_f64() / elapsed).min(1.0),
        )
    }
}

fn lock(progress: &Mutex<Progress>) -> MutexGuard<'_, Progress> {
    // A poisoned lock only means a thread panicked mid-update of plain counters; keep going.
    progress.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts the threads this process has running now.
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Puts the calling thread back to SCHED_OTHER on every CPU it may use, undoing what it inherited.
fn escape_placement() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscalls on the calling thread (tid 0) with a valid sched_param.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) };
    if rc != 0 {
        eprintln!(
            "train_emulator: sched_setscheduler: {}",
            std::io::Error::last_os_error()
        );
    }
    let mut all = nix::sched::CpuSet::new();
    for cpu in 0..nix::sched::CpuSet::count() {
        let _ = all.set(cpu);
    }
    // The kernel intersects the mask with the cpuset the thread is in.
    if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &all) {
        eprintln!("train_emulator: sched_setaffinity: {e}");
    }
}

fn spawn_loader(
    id: usize,
    work: Work,
    escape: bool,
    sample_bytes: Option<usize>,
    tx: SyncSender<Batch>,
    running: Arc<AtomicUsize>,
) -> std::io::Result<JoinHandle<()>> {
    thread::Builder::new()
        .name(format!("loader-{id}"))
        .spawn(move || {
            if escape {
                escape_placement();
            }
            // Its buffers first (a sample ring takes a moment to fill): "ready" means working.
            let mut pre = Preprocessor::new(u64::try_from(id).unwrap_or(0) + 1, sample_bytes);
            running.fetch_add(1, Ordering::SeqCst);
            while !STOP.load(Ordering::Relaxed) {
                let checksum = pre.work(work);
                // Blocks while the queue is full; fails once the dispatch thread is gone.
                if tx.send(Batch { checksum }).is_err() {
                    break;
                }
            }
        })
}

struct Dispatch {
    rx: Receiver<Batch>,
    gpu_step: Duration,
    dispatch_work: Work,
    iterations: u64,
    report: Option<(PathBuf, BufWriter<File>)>,
    progress: Arc<Mutex<Progress>>,
    done: Arc<AtomicBool>,
    running: Arc<AtomicUsize>,
}

impl Dispatch {
    fn run(mut self) {
        self.running.fetch_add(1, Ordering::SeqCst);
        let mut host = Preprocessor::new(0, None);
        let mut last_end = lock(&self.progress).started;
        let mut consumed = 0.0f32;
        let mut iter: u64 = 0;
        while !STOP.load(Ordering::Relaxed) {
            let batch = match self.rx.recv_timeout(Duration::from_millis(50)) {
                Ok(batch) => batch,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            consumed += batch.checksum;
            // Host-side part of the step: building and launching the kernels.
            consumed += host.work(self.dispatch_work);
            // The GPU step. The GPU is busy for exactly this long; any lateness in waking up
            // afterwards is CPU-side delay, during which a real GPU would sit idle.
            lock(&self.progress).current = Some((Instant::now(), self.gpu_step));
            if !gpu_wait(self.gpu_step) {
                // Stopped mid-step: the iteration did not finish.
                break;
            }
            let end = Instant::now();
            let step = Step {
                end,
                iter: end.duration_since(last_end),
                gpu: self.gpu_step,
            };
            last_end = end;
            iter += 1;
            let gpu_busy = {
                let mut progress = lock(&self.progress);
                progress.record(step);
                progress.recent(end).2
            };
            self.write_report(iter, step.iter, gpu_busy);
            if self.iterations != 0 && iter >= self.iterations {
                break;
            }
        }
        black_box(consumed);
        self.done.store(true, Ordering::SeqCst);
    }

    fn write_report(&mut self, iter: u64, iter_time: Duration, gpu_busy: f64) {
        let Some((path, out)) = &mut self.report else {
            return;
        };
        let line = format!(
            "{{\"iter\":{iter},\"iter_ms\":{:.3},\"gpu_busy\":{gpu_busy:.3}}}\n",
            iter_time.as_secs_f64() * 1e3
        );
        if let Err(e) = out.write_all(line.as_bytes()).and_then(|()| out.flush()) {
            eprintln!(
                "train_emulator: cannot write report {}: {e}; reporting stops",
                path.display()
            );
            self.report = None;
        }
    }
}

/// Waits out the GPU step: one sleep for ordinary steps, 50 ms slices for long ones so that
/// SIGTERM is not held up. False if stopped before the step finished.
fn gpu_wait(step: Duration) -> bool {
    let deadline = Instant::now() + step;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        if STOP.load(Ordering::Relaxed) {
            return false;
        }
        thread::sleep(left.min(Duration::from_millis(50)));
    }
}

fn wait_for(running: &AtomicUsize, want: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while running.load(Ordering::SeqCst) < want {
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(1));
    }
    true
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_emulator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    install_signal_handlers().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let report = match &args.report {
        Some(path) => {
            let file = File::create(path)
                .map_err(|e| format!("cannot create report {}: {e}", path.display()))?;
            Some((path.clone(), BufWriter::new(file)))
        }
        None => None,
    };

    let sample_bytes = match args.loader_mib {
        Some(mib) => Some(
            usize::try_from(mib)
                .ok()
                .and_then(|m| m.checked_mul(MIB))
                .ok_or_else(|| format!("--loader-mib {mib} does not fit in memory"))?,
        ),
        None => None,
    };
    let work_per_batch = work::given_or_calibrated(
        args.work_per_batch,
        "work_per_batch",
        Duration::from_millis(args.batch_cpu_ms),
        sample_bytes,
        1,
    );
    // The dispatcher's host-side work stays in the caches (no sample ring), and may be none.
    let dispatch_work = work::given_or_calibrated(
        args.dispatch_work,
        "dispatch_work",
        Duration::from_micros(args.dispatch_cpu_us),
        None,
        0,
    );

    let queue_depth = usize::try_from(args.queue_depth).map_err(|e| e.to_string())?;
    let (tx, rx) = mpsc::sync_channel::<Batch>(queue_depth);
    let running = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let progress = Arc::new(Mutex::new(Progress::new(started)));
    let done = Arc::new(AtomicBool::new(false));

    let mut loaders = Vec::new();
    for id in 0..args.workers {
        let id = usize::try_from(id).map_err(|e| e.to_string())?;
        loaders.push(
            spawn_loader(
                id,
                work_per_batch,
                false,
                sample_bytes,
                tx.clone(),
                running.clone(),
            )
            .map_err(|e| format!("cannot start loader thread: {e}"))?,
        );
    }
    let dispatch = Dispatch {
        rx,
        gpu_step: Duration::from_millis(args.gpu_step_ms),
        dispatch_work,
        iterations: args.iterations,
        report,
        progress: progress.clone(),
        done: done.clone(),
        running: running.clone(),
    };
    let dispatcher = thread::Builder::new()
        .name("dispatch".to_string())
        .spawn(move || dispatch.run())
        .map_err(|e| format!("cannot start dispatch thread: {e}"))?;

    if !wait_for(&running, loaders.len() + 1) {
        return Err("threads did not start within 10 s".to_string());
    }
    println!(
        "ready pid={} threads={}",
        std::process::id(),
        thread_count()
    );
    flush_stdout();

    let mut publisher = Publisher::from_args(args);
    let mut next_summary = Instant::now() + WINDOW;
    while !STOP.load(Ordering::SeqCst) && !done.load(Ordering::SeqCst) {
        thread::sleep(POLL);
        let plain = ADD_WORKERS.swap(0, Ordering::SeqCst);
        let escaping = ADD_ESCAPING_WORKERS.swap(0, Ordering::SeqCst);
        for n in 0..plain + escaping {
            let id = loaders.len();
            match spawn_loader(
                id,
                work_per_batch,
                n >= plain,
                sample_bytes,
                tx.clone(),
                running.clone(),
            ) {
                Ok(handle) => loaders.push(handle),
                Err(e) => {
                    eprintln!("train_emulator: cannot start loader thread: {e}");
                    continue;
                }
            }
            if !wait_for(&running, loaders.len() + 1) {
                return Err("a new loader did not start within 10 s".to_string());
            }
            println!(
                "worker added: workers={} threads={}",
                loaders.len(),
                thread_count()
            );
            flush_stdout();
        }
        let now = Instant::now();
        if now >= next_summary {
            next_summary += WINDOW;
            let (rate, mean_ms, busy) = lock(&progress).recent(now);
            if let Some(publisher) = &mut publisher {
                publisher.publish(busy, rate);
            }
            println!(
                "t={:.1}s iters/s={rate:.1} mean_iter_ms={mean_ms:.2} gpu_busy={busy:.3} workers={}",
                now.duration_since(started).as_secs_f64(),
                loaders.len()
            );
            flush_stdout();
        }
    }

    // Shutting down: the dispatcher sees STOP (or has finished); once it drops the queue's
    // receiver, loaders blocked on a full queue get an error and leave.
    STOP.store(true, Ordering::SeqCst);
    drop(tx);
    let _ = dispatcher.join();
    let workers = loaders.len();
    for loader in loaders {
        let _ = loader.join();
    }
    let (elapsed, rate, mean_ms, busy) = lock(&progress).overall(Instant::now());
    let iterations = lock(&progress).iterations;
    println!(
        "final iterations={iterations} elapsed_s={elapsed:.2} iters/s={rate:.1} \
         mean_iter_ms={mean_ms:.2} gpu_busy={busy:.3} workers={workers}"
    );
    flush_stdout();
    Ok(())
}

fn flush_stdout() {
    // Tests read these lines through a pipe; a failed flush (closed pipe) is not our problem.
    let _ = std::io::stdout().flush();
}
