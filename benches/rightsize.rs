//! Right-sizing simulation benchmark (`cargo bench --bench rightsize`): SODA §V-B's adaptive
//! CPU allocator, as `policy::rightsize`, run against 1,000 simulated training jobs.
//!
//! Each job's GPU utilization follows a multithreaded job's curve (SODA §IV-B-1): Amdahl's law in
//! the cores per GPU, capped where the CPU side keeps up with the GPU (the knee, the best-fit
//! count), flat or dropping slightly above it (§V-B), sampled once a second with Gaussian noise
//! (AR(1)-correlated, rounded to whole percent as NVML reports it). Ranges: knees 1–16 cores per
//! GPU, noise 0.5–5 %, peak utilization 70–100 %, 1/2/4 GPUs, requested counts as in SODA §III-B
//! (76 % ask for 1–2 cores, 15 % for more than 10). Deterministic: a fixed xorshift seed.
//!
//! Scenarios: cold start (no history: the §V-B-1 category defaults, or the requested count for
//! `other`; knees independent of them), the same with tolerance 0 (settle on the exact knee),
//! and owner history (§V-B-1's premise: each owner's jobs of a category have knees within 2
//! cores per GPU of that owner's typical one; jobs run in sequence, each recording its settled
//! count for the next).
//!
//! Printed per scenario: probes per job (mean, p95; the baseline window at the start count is
//! not a probe), windows per job, error of the settled count against the knee in cores (mean
//! absolute, share within ±1, share below the knee), GPU-utilization loss during tuning (the
//! area between the best utilization and the one the job had, from the end of the warm-up to
//! settling, as a percentage of the best), and against keeping the requested count: cores
//! wasted (above the knee) and utilization lost (below it), over a 1-hour job.

use lodger::policy::rightsize::model::Curve;
use lodger::rng::Rng;
use std::time::Duration;

use lodger::job::Category;
use lodger::policy::rightsize::{
    start_cores, CoreLimits, OwnerHistory, StartHints, Tuner, TunerAction, TunerSettings,
};

const JOBS: usize = 1000;
const SEED: u64 = 0x5eed_50da_2023_0001;
const OWNERS: u32 = 40;
/// Job length for the lifetime comparison: SODA §VI-H, 68.5 % of jobs run longer than an hour.
const JOB_SECS: u64 = 3600;
const SAMPLE_PERIOD: Duration = Duration::from_secs(1);
/// A runaway guard: no job should need this long.
const MAX_SIM_SECS: u64 = 6 * 3600;

struct Job {
    curve: Curve,
    owner: u32,
    category: Category,
    requested: u32,
    hints: StartHints,
}

fn draw_category(rng: &mut Rng) -> Category {
    match rng.unit() {
        x if x < 0.35 => Category::Cv,
        x if x < 0.60 => Category::Nlp,
        x if x < 0.80 => Category::Speech,
        _ => Category::Other,
    }
}

/// SODA §III-B, Fig. 3(b): 76.1 % of GPU jobs request 1 or 2 CPUs, 15.3 % more than 10.
fn draw_requested(rng: &mut Rng) -> u32 {
    match rng.unit() {
        x if x < 0.761 => rng.int(1, 2),
        x if x < 0.761 + 0.153 => rng.int(11, 32),
        _ => rng.int(3, 10),
    }
}

fn draw_curve(rng: &mut Rng, knee_per_gpu: u32) -> Curve {
    let gpus = match rng.unit() {
        x if x < 0.70 => 1,
        x if x < 0.85 => 2,
        _ => 4,
    };
    Curve {
        gpus,
        knee_per_gpu,
        parallel: rng.uniform(0.85, 0.99),
        peak: rng.uniform(70.0, 100.0),
        drop_above: if rng.chance(0.5) {
            0.0
        } else {
            rng.uniform(0.0, 0.3)
        },
        sigma: rng.uniform(0.5, 5.0),
        rho: rng.uniform(0.0, 0.6),
    }
}

fn draw_hints(rng: &mut Rng) -> StartHints {
    StartHints {
        pipelined_loader: rng.chance(0.25),
        large_model: rng.chance(0.25),
        heavy_preprocessing: rng.chance(0.25),
    }
}

/// Knees uniform in 1–16 per GPU, independent of the owner.
fn cold_jobs(rng: &mut Rng) -> Vec<Job> {
    (0..JOBS)
        .map(|_| {
            let knee = rng.int(1, 16);
            Job {
                curve: draw_curve(rng, knee),
                owner: rng.int(0, OWNERS - 1),
                category: draw_category(rng),
                requested: draw_requested(rng),
                hints: draw_hints(rng),
            }
        })
        .collect()
}

/// SODA §V-B-1's premise, "a user tends to submit similar training jobs": each owner has a
/// typical knee per category (1–16), and each job's knee is within 2 of it.
fn owner_jobs(rng: &mut Rng) -> Vec<Job> {
    let typical: Vec<[u32; 4]> = (0..OWNERS)
        .map(|_| {
            [
                rng.int(1, 16),
                rng.int(1, 16),
                rng.int(1, 16),
                rng.int(1, 16),
            ]
        })
        .collect();
    (0..JOBS)
        .map(|_| {
            let owner = rng.int(0, OWNERS - 1);
            let category = draw_category(rng);
            let slot = match category {
                Category::Cv => 0,
                Category::Nlp => 1,
                Category::Speech => 2,
                Category::Other => 3,
            };
            let base = typical[owner as usize][slot];
            let knee = (base + rng.int(0, 4)).saturating_sub(2).clamp(1, 16);
            Job {
                curve: draw_curve(rng, knee),
                owner,
                category,
                requested: draw_requested(rng),
                hints: draw_hints(rng),
            }
        })
        .collect()
}

fn limits_of(curve: &Curve) -> CoreLimits {
    CoreLimits {
        floor: curve.gpus,
        max: (24 * curve.gpus).min(96),
    }
}

struct Outcome {
    probes: usize,
    windows: usize,
    settled: u32,
    /// Knee capped at what the job could get.
    best: u32,
    /// Percent of the best utilization lost from the end of warm-up to settling.
    tuning_loss: f64,
    tuning_secs: u64,
    /// Percent of the best utilization lost over a 1-hour job (warm-up excluded), tuning
    /// included.
    hour_loss: f64,
}

fn simulate(
    job: &Job,
    start: u32,
    settings_of: &dyn Fn(u32, CoreLimits) -> TunerSettings,
    rng: &mut Rng,
) -> Outcome {
    let curve = &job.curve;
    let limits = limits_of(curve);
    let settings = settings_of(start, limits);
    let warmup = settings.warmup;
    let mut tuner = Tuner::new(settings, Duration::ZERO);
    let best = curve.knee().min(limits.max);
    let u_best = curve.util(best);
    let mut noise = 0.0;
    let mut t = Duration::ZERO;
    let mut lost_area = 0.0;
    let mut tuning_secs = 0;
    let settled = loop {
        t += SAMPLE_PERIOD;
        assert!(
            t.as_secs() < MAX_SIM_SECS,
            "tuner did not settle: {tuner:?}"
        );
        let cores = tuner.cores();
        noise =
            curve.rho * noise + (1.0 - curve.rho * curve.rho).sqrt() * curve.sigma * rng.normal();
        let sample = (curve.util(cores) + noise).clamp(0.0, 100.0).round();
        if t > warmup {
            lost_area += u_best - curve.util(cores);
            tuning_secs += 1;
        }
        if let TunerAction::Settle(n) = tuner.step(t, &[sample], false) {
            break n;
        }
    };
    let windows = tuner.history().len();
    let after = JOB_SECS.saturating_sub(tuning_secs) as f64;
    let hour_area = lost_area + after * (u_best - curve.util(settled));
    Outcome {
        probes: tuner.probes(),
        windows,
        settled,
        best,
        tuning_loss: 100.0 * lost_area / (u_best * tuning_secs.max(1) as f64),
        tuning_secs,
        hour_loss: 100.0 * hour_area / (u_best * JOB_SECS as f64),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    sum / n.max(1) as f64
}

struct Row {
    name: &'static str,
    jobs: Vec<(Outcome, u32)>,
}

fn report(rows: &[Row], jobs: &[Job]) {
    println!(
        "{:<34} {:>6} {:>4} {:>7} {:>6} {:>7} {:>6} {:>7} {:>8} {:>7}",
        "scenario",
        "probes",
        "p95",
        "windows",
        "|err|",
        "±1",
        "below",
        "tune s",
        "tune loss",
        "1h loss"
    );
    for row in rows {
        let n = row.jobs.len() as f64;
        let mut probes: Vec<f64> = row.jobs.iter().map(|(o, _)| o.probes as f64).collect();
        probes.sort_by(f64::total_cmp);
        let err = |o: &Outcome| (i64::from(o.settled) - i64::from(o.best)).abs() as f64;
        let within = row.jobs.iter().filter(|(o, _)| err(o) <= 1.0).count() as f64 / n;
        let below = row.jobs.iter().filter(|(o, _)| o.settled < o.best).count() as f64 / n;
        println!(
            "{:<34} {:>6.2} {:>4.0} {:>7.2} {:>6.2} {:>6.1}% {:>5.1}% {:>7.0} {:>8.2}% {:>6.2}%",
            row.name,
            mean(probes.iter().copied()),
            percentile(&probes, 0.95),
            mean(row.jobs.iter().map(|(o, _)| o.windows as f64)),
            mean(row.jobs.iter().map(|(o, _)| err(o))),
            100.0 * within,
            100.0 * below,
            mean(row.jobs.iter().map(|(o, _)| o.tuning_secs as f64)),
            mean(row.jobs.iter().map(|(o, _)| o.tuning_loss)),
            mean(row.jobs.iter().map(|(o, _)| o.hour_loss)),
        );
    }
    // The "keep the requested count" baseline, on the same jobs.
    let wasted = mean(jobs.iter().map(|j| {
        let best = j.curve.knee().min(limits_of(&j.curve).max);
        f64::from(j.requested.saturating_sub(best))
    }));
    let lost = mean(jobs.iter().map(|j| {
        let best = j.curve.knee().min(limits_of(&j.curve).max);
        100.0 * (1.0 - j.curve.util(j.requested) / j.curve.util(best))
    }));
    let starved = jobs
        .iter()
        .filter(|j| j.requested < j.curve.knee().min(limits_of(&j.curve).max))
        .count() as f64
        / jobs.len() as f64;
    println!(
        "{:<34} cores wasted {wasted:.2}/job, 1h loss {lost:.2}%, {:.1}% of jobs starved",
        "keep requested (baseline)",
        100.0 * starved
    );
    for row in rows {
        let wasted = mean(
            row.jobs
                .iter()
                .map(|(o, _)| f64::from(o.settled.saturating_sub(o.best))),
        );
        let starved = row.jobs.iter().filter(|(o, _)| o.settled < o.best).count() as f64
            / row.jobs.len() as f64;
        println!(
            "{:<34} cores wasted {wasted:.2}/job, {:.1}% of jobs below the knee",
            row.name,
            100.0 * starved
        );
    }
}

fn run(
    name: &'static str,
    jobs: &[Job],
    use_history: bool,
    settings_of: &dyn Fn(u32, CoreLimits) -> TunerSettings,
    seed: u64,
) -> Row {
    let mut rng = Rng::new(seed);
    let mut history = OwnerHistory::new();
    let empty = OwnerHistory::new();
    let outcomes = jobs
        .iter()
        .map(|job| {
            let limits = limits_of(&job.curve);
            let start = start_cores(
                if use_history { &history } else { &empty },
                job.owner,
                job.category,
                job.requested,
                job.curve.gpus,
                job.hints,
                limits,
            );
            let outcome = simulate(job, start, settings_of, &mut rng);
            history.record(job.owner, job.category, outcome.settled, job.curve.gpus);
            (outcome, start)
        })
        .collect();
    Row {
        name,
        jobs: outcomes,
    }
}

fn main() {
    let mut rng = Rng::new(SEED);
    let cold = cold_jobs(&mut rng);
    let owned = owner_jobs(&mut rng);
    let default = |start, limits| TunerSettings::new(start, limits);
    let exact = |start, limits| TunerSettings {
        tolerance: 0,
        ..TunerSettings::new(start, limits)
    };
    println!(
        "right-sizing simulation: {JOBS} jobs per scenario, seed {SEED:#x}, 60 s windows, 180 s warm-up, 1 sample/s"
    );
    let rows = [
        run(
            "cold start (category defaults)",
            &cold,
            false,
            &default,
            SEED ^ 1,
        ),
        run("cold start, tolerance 0", &cold, false, &exact, SEED ^ 1),
        run(
            "owner history (similar jobs)",
            &owned,
            true,
            &default,
            SEED ^ 2,
        ),
    ];
    report(&rows[..2], &cold);
    println!();
    report(&rows[2..], &owned);
}
