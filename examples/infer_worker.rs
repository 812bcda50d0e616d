//! A CPU inference worker for lodger's tests, demo and benchmarks: a "model" of layers doing real
//! f32 matrix work per batch, served online (open-loop Poisson arrivals, batched) or offline
//! (back-to-back batches), reporting each batch over lodger's instance protocol
//! (`docs/instance-protocol.md`).
//!
//! Models, chosen so that cache behaviour depends on the batch size (Cloud Reamer §III-B, Fig. 5):
//!   compute  `--layers` dense D×D layers holding `--model-mib` of weights in all (default 8 MiB,
//!            beyond a core's L2). A batch streams every weight once and uses it for each of its
//!            items, so a larger batch reuses weights from cache: IPC rises with the batch, misses
//!            stay flat (the kind for which one large instance is best).
//!   memory   `--layers` token-wise layers (small C×C weights) over per-item activations of
//!            `--act-kib` (default 512 KiB). A layer runs over the whole batch before the next
//!            one, so the batch's activations (2 × batch × act-kib) fall out of the cache as the
//!            batch grows: misses rise and IPC falls with the batch (the kind for which many
//!            small instances are best).
//! Threads: each layer is split among `--threads` threads (output columns for compute, tokens for
//! memory) that meet at a barrier after every layer, as intra-op parallel runtimes do, so one
//! slowed thread (its core shared with training) holds up the others (the straggler effect of
//! Cloud Reamer Fig. 6).
//!
//! Modes:
//!   online   requests arrive open-loop at `--rate` per second (Poisson, generated in-process);
//!            a batch starts when `--batch` requests wait or the oldest has waited
//!            `--batch-timeout-ms`. Latency is arrival to completion. Waiting for the next
//!            arrival is the only time the worker sleeps.
//!   offline  full batches back to back; latency is the batch's compute time.
//!
//! Defaults come from lodger's environment when the flags are absent: `--threads` from
//! LODGER_THREADS (else OMP_NUM_THREADS, else 1), `--batch` from LODGER_BATCH (else 1), the report
//! descriptor from LODGER_REPORT_FD (else stdout).
//!
//! Output: one report line per batch, `{"items":N,"latency_ms":X}` plus `"queue_ms"` online
//! (latency and queueing of the batch's slowest request); on stderr a summary every second
//! (unless `--quiet`) and at the end. Exits 0 after `--seconds` or on SIGTERM or SIGINT.

use std::collections::VecDeque;
use std::fs::File;
use std::hint::black_box;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use lodger::rng::Rng;
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
/// Channels per token of the memory model: its weights are C×C (256 bytes), its work per byte of
/// activation is small, so where the activations live (cache or DRAM) decides its speed.
const CHANNELS: usize = 8;
/// Online: requests beyond this many waiting are dropped (and counted), so an overloaded worker
/// does not grow without bound.
const MAX_QUEUE: usize = 100_000;
/// Online: the longest single sleep while waiting for an arrival, so SIGTERM is seen promptly.
const MAX_NAP: Duration = Duration::from_millis(20);
/// ReLU, bounded so values stay finite through any number of layers.
const ACT_MAX: f32 = 4.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    Compute,
    Memory,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Online,
    Offline,
}

#[derive(Parser, Debug)]
#[command(
    name = "infer_worker",
    about = "A CPU inference worker doing real matrix work per batch and reporting each batch \
             over lodger's instance protocol."
)]
struct Args {
    /// compute: dense layers whose weights outgrow L2 (IPC rises with batch); memory: large
    /// per-item activations (misses rise with batch).
    #[arg(long, value_enum, default_value_t = ModelKind::Compute)]
    model: ModelKind,
    /// compute: MiB of weights in all layers.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=16384))]
    model_mib: u64,
    /// Layers of the model.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    layers: u32,
    /// memory: KiB of activations per item.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(4..=1 << 20))]
    act_kib: u64,
    /// Threads per layer [default: LODGER_THREADS, else OMP_NUM_THREADS, else 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Largest batch [default: LODGER_BATCH, else 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    batch: Option<u32>,
    #[arg(long, value_enum, default_value_t = Mode::Offline)]
    mode: Mode,
    /// online: requests per second (Poisson arrivals).
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// online: the longest the oldest waiting request waits for its batch to fill.
    #[arg(long, default_value_t = 2.0)]
    batch_timeout_ms: f64,
    /// Seconds to run; 0 runs until SIGTERM or SIGINT.
    #[arg(long, default_value_t = 0.0)]
    seconds: f64,
    /// Descriptor for report lines [default: LODGER_REPORT_FD, else stdout].
    #[arg(long)]
    report_fd: Option<i32>,
    /// No summary on stderr every second (the final one is still printed).
    #[arg(long)]
    quiet: bool,
    /// Seed of the weights, inputs and arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() -> nix::Result<()> {
    let stop = SigAction::new(
        SigHandler::Handler(on_stop),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to a lock-free static atomic, which is async-signal-safe.
    unsafe {
        sigaction(Signal::SIGTERM, &stop)?;
        sigaction(Signal::SIGINT, &stop)?;
    }
    Ok(())
}

/// The gap between Poisson arrivals at `rate` per second.
fn exp_gap(rng: &mut Rng, rate: f64) -> Duration {
    Duration::from_secs_f64(rng.exponential(rate))
}

/// Splits `n` into `parts` contiguous ranges as even as possible.
fn split(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let base = n / parts;
    let extra = n % parts;
    let mut out = Vec::with_capacity(parts);
    let mut start = 0;
    for p in 0..parts {
        let len = base + usize::from(p < extra);
        out.push((start, start + len));
        start += len;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The model

/// What all threads share: the batch size of the current batch, the barrier they meet at, and
/// for the compute model the activations (each thread's output columns, double-buffered).
struct Shared {
    kind: ModelKind,
    layers: usize,
    threads: usize,
    /// compute: the layer width D; memory: tokens per item.
    width: usize,
    /// Each thread's share of `width`.
    parts: Vec<(usize, usize)>,
    /// compute: `[parity][thread]` = rows × (that thread's columns). Layer l reads parity l % 2
    /// and writes the other; the barrier after each layer orders the two.
    acts: [Vec<RwLock<Vec<f32>>>; 2],
    rows: AtomicUsize,
    barrier: Barrier,
    stop: AtomicBool,
    checksum: Mutex<f64>,
}

/// One thread's own part of the model.
struct Local {
    t: usize,
    /// compute: per layer, rows k = 0..D of this thread's columns (D × dt).
    /// memory: per layer, the C×C weights.
    weights: Vec<Vec<f32>>,
    /// memory: this thread's tokens of every item of the batch, double-buffered.
    acts: [Vec<f32>; 2],
    rng: Rng,
}

impl Local {
    fn new(shared: &Shared, t: usize, max_batch: usize, seed: u64) -> Local {
        let (c0, c1) = shared.parts[t];
        let mut rng = Rng::scrambled(seed ^ (t as u64).wrapping_mul(0xA076_1D64_78BD_642F));
        let (fan_in, per_layer) = match shared.kind {
            ModelKind::Compute => (shared.width, shared.width * (c1 - c0)),
            ModelKind::Memory => (CHANNELS, CHANNELS * CHANNELS),
        };
        // He-uniform for ReLU layers: activations keep their scale through the layers.
        let half_width = (6.0 / fan_in as f64).sqrt() as f32;
        let weights = (0..shared.layers)
            .map(|_| {
                (0..per_layer)
                    .map(|_| (rng.uniform(-1.0, 1.0) as f32) * half_width)
                    .collect()
            })
            .collect();
        let acts = match shared.kind {
            ModelKind::Compute => [Vec::new(), Vec::new()],
            ModelKind::Memory => {
                // Not zero: a zeroed vec is lazily mapped, and its page faults would land in
                // the first batches.
                let len = max_batch * (c1 - c0) * CHANNELS;
                [vec![0.5; len], vec![0.5; len]]
            }
        };
        Local {
            t,
            weights,
            acts,
            rng,
        }
    }

    /// This thread's share of one batch: every layer, with a barrier after each.
    fn run_batch(&mut self, shared: &Shared, rows: usize) {
        let mut sum = 0.0f64;
        match shared.kind {
            ModelKind::Compute => {
                for l in 0..shared.layers {
                    sum = self.dense_layer(shared, l, rows);
                    shared.barrier.wait();
                }
            }
            ModelKind::Memory => {
                self.fill_tokens(shared, rows);
                for l in 0..shared.layers {
                    sum = self.token_layer(shared, l, rows);
                    shared.barrier.wait();
                }
            }
        }
        let mut total = shared
            .checksum
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *total += black_box(sum);
    }

    /// Y[:, cols_t] = relu(X · W[:, cols_t]), X gathered from every thread's columns. Returns the
    /// sum of the outputs.
    fn dense_layer(&self, shared: &Shared, l: usize, rows: usize) -> f64 {
        let (j0, j1) = shared.parts[self.t];
        let dt = j1 - j0;
        let src = l % 2;
        let mut out = shared.acts[1 - src][self.t]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let out = &mut out[..rows * dt];
        out.fill(0.0);
        let w = &self.weights[l];
        for (s, &(k0, k1)) in shared.parts.iter().enumerate() {
            let input = shared.acts[src][s]
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            let ds = k1 - k0;
            for kl in 0..ds {
                let k = k0 + kl;
                // One row of this thread's weights, reused for every item of the batch: the
                // reuse that makes IPC rise with the batch.
                let w_row = &w[k * dt..(k + 1) * dt];
                for (b, y) in out.chunks_exact_mut(dt).enumerate() {
                    let x = input[b * ds + kl];
                    for (y, &w) in y.iter_mut().zip(w_row) {
                        *y += x * w;
                    }
                }
            }
        }
        let mut sum = 0.0f64;
        for y in out.iter_mut() {
            *y = y.clamp(0.0, ACT_MAX);
            sum += f64::from(*y);
        }
        sum
    }

    /// New inputs for this thread's tokens of every item.
    fn fill_tokens(&mut self, shared: &Shared, rows: usize) {
        let (t0, t1) = shared.parts[self.t];
        let len = rows * (t1 - t0) * CHANNELS;
        for x in &mut self.acts[0][..len] {
            *x = self.rng.unit() as f32;
        }
    }

    /// For every item and token: y = relu(x · W_l) over C channels. The whole batch passes one
    /// layer before the next, so its activations are re-read from wherever they were evicted to.
    fn token_layer(&mut self, shared: &Shared, l: usize, rows: usize) -> f64 {
        let (t0, t1) = shared.parts[self.t];
        let len = rows * (t1 - t0) * CHANNELS;
        let src = l % 2;
        let [a, b] = &mut self.acts;
        let (input, out) = if src == 0 { (&*a, b) } else { (&*b, a) };
        let w = &self.weights[l];
        let mut sum = 0.0f64;
        for (x, y) in input[..len]
            .chunks_exact(CHANNELS)
            .zip(out[..len].chunks_exact_mut(CHANNELS))
        {
            y.fill(0.0);
            for (&xk, w_row) in x.iter().zip(w.chunks_exact(CHANNELS)) {
                for (y, &w) in y.iter_mut().zip(w_row) {
                    *y += xk * w;
                }
            }
            for y in y.iter_mut() {
                *y = y.clamp(0.0, ACT_MAX);
                sum += f64::from(*y);
            }
        }
        sum
    }
}

/// The model and its threads; the calling thread is thread 0.
struct Engine {
    shared: Arc<Shared>,
    local: Local,
    workers: Vec<JoinHandle<()>>,
    input_rng: Rng,
}

impl Engine {
    fn start(args: &Args, threads: usize, max_batch: usize) -> Result<Engine, String> {
        let layers = usize::try_from(args.layers).map_err(|e| e.to_string())?;
        let width = match args.model {
            ModelKind::Compute => {
                // L·D² floats of weights.
                let floats = args.model_mib * MIB / 4 / u64::from(args.layers);
                let d = (floats as f64).sqrt() as usize;
                d.max(threads).max(16)
            }
            ModelKind::Memory => {
                let tokens = args.act_kib * KIB / 4 / CHANNELS as u64;
                usize::try_from(tokens)
                    .map_err(|e| e.to_string())?
                    .max(threads)
            }
        };
        let parts = split(width, threads);
        let acts = match args.model {
            ModelKind::Compute => [0, 1].map(|_| {
                parts
                    .iter()
                    .map(|&(a, b)| RwLock::new(vec![0.5f32; max_batch * (b - a)]))
                    .collect()
            }),
            ModelKind::Memory => [Vec::new(), Vec::new()],
        };
        let shared = Arc::new(Shared {
            kind: args.model,
            layers,
            threads,
            width,
            parts,
            acts,
            rows: AtomicUsize::new(0),
            barrier: Barrier::new(threads),
            stop: AtomicBool::new(false),
            checksum: Mutex::new(0.0),
        });
        let mut workers = Vec::with_capacity(threads.saturating_sub(1));
        for t in 1..threads {
            let shared = shared.clone();
            let seed = args.seed;
            let handle = thread::Builder::new()
                .name(format!("infer-{t}"))
                .spawn(move || {
                    // Built here, so the weights land on this thread's NUMA node (first touch).
                    let mut local = Local::new(&shared, t, max_batch, seed);
                    shared.barrier.wait();
                    loop {
                        shared.barrier.wait();
                        if shared.stop.load(Ordering::Acquire) {
                            return;
                        }
                        let rows = shared.rows.load(Ordering::Acquire);
                        local.run_batch(&shared, rows);
                    }
                })
                .map_err(|e| format!("cannot start thread {t}: {e}"))?;
            workers.push(handle);
        }
        let local = Local::new(&shared, 0, max_batch, args.seed);
        // Every thread has built its weights.
        shared.barrier.wait();
        Ok(Engine {
            shared,
            local,
            workers,
            input_rng: Rng::scrambled(args.seed ^ 0x5151),
        })
    }

    /// Runs one batch of `rows` items through every layer.
    fn run(&mut self, rows: usize) {
        let shared = &*self.shared;
        if shared.kind == ModelKind::Compute {
            for (s, &(a, b)) in shared.parts.iter().enumerate() {
                let mut input = shared.acts[0][s]
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                for x in &mut input[..rows * (b - a)] {
                    *x = self.input_rng.unit() as f32;
                }
            }
        }
        shared.rows.store(rows, Ordering::Release);
        shared.barrier.wait();
        self.local.run_batch(shared, rows);
    }

    fn describe(&self) -> String {
        let s = &*self.shared;
        match s.kind {
            ModelKind::Compute => format!(
                "compute model: {} dense layers of {}x{} ({:.1} MiB of weights)",
                s.layers,
                s.width,
                s.width,
                (s.layers * s.width * s.width * 4) as f64 / MIB as f64
            ),
            ModelKind::Memory => format!(
                "memory model: {} token layers, {} tokens x {} channels per item ({} KiB of \
                 activations per item)",
                s.layers,
                s.width,
                CHANNELS,
                s.width * CHANNELS * 4 / 1024
            ),
        }
    }

    fn stop(self) -> f64 {
        self.shared.stop.store(true, Ordering::Release);
        if self.shared.threads > 1 {
            self.shared.barrier.wait();
        }
        for w in self.workers {
            let _ = w.join();
        }
        let total = *self
            .shared
            .checksum
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        total
    }
}

// ---------------------------------------------------------------------------------------------
// Reporting

enum Sink {
    Fd(File),
    Stdout,
}

struct Reporter {
    sink: Sink,
    broken: bool,
}

impl Reporter {
    fn open(args: &Args) -> Result<Reporter, String> {
        let fd = match args.report_fd {
            Some(fd) => Some(fd),
            None => match std::env::var("LODGER_REPORT_FD") {
                Ok(v) if !v.trim().is_empty() => Some(
                    v.trim()
                        .parse()
                        .map_err(|_| format!("LODGER_REPORT_FD={v} is not a descriptor number"))?,
                ),
                _ => None,
            },
        };
        let sink = match fd {
            None => Sink::Stdout,
            Some(fd) => {
                // SAFETY: F_GETFD only asks whether the descriptor is open.
                if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                    return Err(format!("report descriptor {fd} is not open"));
                }
                // SAFETY: the descriptor is open and, by the protocol, handed to this process for
                // its reports alone: nothing else in it owns or closes it.
                Sink::Fd(unsafe { File::from_raw_fd(fd) })
            }
        };
        Ok(Reporter {
            sink,
            broken: false,
        })
    }

    /// One line, written with one call (lines under PIPE_BUF are atomic on a pipe).
    fn batch(&mut self, items: usize, latency_ms: f64, queue_ms: Option<f64>) {
        if self.broken {
            return;
        }
        let line = match queue_ms {
            Some(q) => format!(
                "{{\"items\":{items},\"latency_ms\":{latency_ms:.3},\"queue_ms\":{q:.3}}}\n"
            ),
            None => format!("{{\"items\":{items},\"latency_ms\":{latency_ms:.3}}}\n"),
        };
        let result = match &mut self.sink {
            Sink::Fd(f) => f.write_all(line.as_bytes()),
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(line.as_bytes()).and_then(|()| out.flush())
            }
        };
        if let Err(e) = result {
            eprintln!("infer_worker: cannot write report lines any more ({e}); still serving");
            self.broken = true;
        }
    }
}

/// What the last second served, for the summary on stderr.
struct Second {
    start: Instant,
    items: u64,
    latencies: Vec<f64>,
    dropped: u64,
}

impl Second {
    fn new(now: Instant) -> Self {
        Self {
            start: now,
            items: 0,
            latencies: Vec::new(),
            dropped: 0,
        }
    }

    fn percentile(sorted: &[f64], permille: usize) -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        let rank = (sorted.len() * permille).div_ceil(1000).max(1);
        sorted[rank.min(sorted.len()) - 1]
    }

    fn print(&mut self, label: &str, now: Instant, waiting: usize) {
        let secs = now.duration_since(self.start).as_secs_f64().max(1e-9);
        self.latencies.sort_by(f64::total_cmp);
        eprintln!(
            "infer_worker {label}: {:.1} items/s, latency p50 {:.2} ms p99 {:.2} ms, {waiting} \
             waiting, {} dropped",
            self.items as f64 / secs,
            Self::percentile(&self.latencies, 500),
            Self::percentile(&self.latencies, 990),
            self.dropped
        );
        *self = Second::new(now);
    }
}

// ---------------------------------------------------------------------------------------------
// Serving

fn env_u32(names: &[&str]) -> Option<u32> {
    names
        .iter()
        .find_map(|n| std::env::var(n).ok()?.trim().parse().ok())
        .filter(|&v| v > 0)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("infer_worker: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    install_signal_handlers().map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let threads = args
        .threads
        .or_else(|| env_u32(&["LODGER_THREADS", "OMP_NUM_THREADS"]))
        .unwrap_or(1);
    let batch = args
        .batch
        .or_else(|| env_u32(&["LODGER_BATCH"]))
        .unwrap_or(1);
    if args.mode == Mode::Online && !(args.rate.is_finite() && args.rate > 0.0) {
        return Err(format!("--rate {} must be a positive number", args.rate));
    }
    if !(args.batch_timeout_ms.is_finite() && args.batch_timeout_ms >= 0.0) {
        return Err("--batch-timeout-ms must be a number ≥ 0".to_string());
    }
    if !(args.seconds.is_finite() && args.seconds >= 0.0) {
        return Err("--seconds must be a number ≥ 0".to_string());
    }
    let threads_n = usize::try_from(threads).map_err(|e| e.to_string())?;
    let batch_n = usize::try_from(batch).map_err(|e| e.to_string())?;
    let mut reporter = Reporter::open(args)?;
    let mut engine = Engine::start(args, threads_n, batch_n)?;
    let instance = std::env::var("LODGER_JOB")
        .ok()
        .zip(std::env::var("LODGER_INSTANCE").ok())
        .map(|(j, i)| format!("{j}-{i} "))
        .unwrap_or_default();
    let label = format!(
        "{instance}pid {} {} batch={batch} threads={threads}",
        std::process::id(),
        match args.mode {
            Mode::Online => format!("online rate={}", args.rate),
            Mode::Offline => "offline".to_string(),
        }
    );
    eprintln!("infer_worker {label}: {}", engine.describe());

    let start = Instant::now();
    let limit = (args.seconds > 0.0).then(|| Duration::from_secs_f64(args.seconds));
    let mut second = Second::new(start);
    let mut items_total = 0u64;
    let mut batches = 0u64;
    let mut dropped_total = 0u64;
    let mut arrivals = Rng::scrambled(args.seed ^ u64::from(std::process::id()));
    let timeout = Duration::from_secs_f64(args.batch_timeout_ms / 1000.0);
    let mut next_arrival = start + exp_gap(&mut arrivals, args.rate.max(f64::MIN_POSITIVE));
    let mut queue: VecDeque<Instant> = VecDeque::new();

    while !STOP.load(Ordering::SeqCst) {
        let now = Instant::now();
        if limit.is_some_and(|l| now.duration_since(start) >= l) {
            break;
        }
        if now.duration_since(second.start) >= Duration::from_secs(1) {
            if !args.quiet {
                second.print(&label, now, queue.len());
            } else {
                second = Second::new(now);
            }
        }
        match args.mode {
            Mode::Offline => {
                let t0 = Instant::now();
                engine.run(batch_n);
                let ms = t0.elapsed().as_secs_f64() * 1000.0;
                reporter.batch(batch_n, ms, None);
                second.items += u64::from(batch);
                second.latencies.extend(std::iter::repeat(ms).take(batch_n));
                items_total += u64::from(batch);
                batches += 1;
            }
            Mode::Online => {
                while next_arrival <= now {
                    if queue.len() < MAX_QUEUE {
                        queue.push_back(next_arrival);
                    } else {
                        second.dropped += 1;
                        dropped_total += 1;
                    }
                    next_arrival += exp_gap(&mut arrivals, args.rate);
                }
                let oldest_due = queue.front().is_some_and(|&t| now >= t + timeout);
                if queue.len() >= batch_n || oldest_due {
                    let n = queue.len().min(batch_n);
                    let began = Instant::now();
                    engine.run(n);
                    let done = Instant::now();
                    let mut worst = 0.0f64;
                    let mut worst_queue = 0.0f64;
                    for arrived in queue.drain(..n) {
                        let ms = done.duration_since(arrived).as_secs_f64() * 1000.0;
                        worst = worst.max(ms);
                        worst_queue =
                            worst_queue.max(began.duration_since(arrived).as_secs_f64() * 1000.0);
                        second.latencies.push(ms);
                    }
                    reporter.batch(n, worst, Some(worst_queue));
                    let n64 = n as u64;
                    second.items += n64;
                    items_total += n64;
                    batches += 1;
                } else {
                    // The open-loop arrival clock: nothing to do until the next request arrives
                    // or the oldest one's batch timeout expires.
                    let mut wake = next_arrival;
                    if let Some(&t) = queue.front() {
                        wake = wake.min(t + timeout);
                    }
                    let nap = wake.saturating_duration_since(Instant::now()).min(MAX_NAP);
                    if !nap.is_zero() {
                        thread::sleep(nap);
                    }
                }
            }
        }
    }

    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    let checksum = engine.stop();
    eprintln!(
        "infer_worker {label}: final seconds={elapsed:.2} items={items_total} batches={batches} \
         items/s={:.1} dropped={dropped_total} checksum={checksum:.3e}",
        items_total as f64 / elapsed
    );
    Ok(())
}
