//! Right-sizing simulation benchmark (`cargo bench --bench rightsize`): SODA §V-B's adaptive
//! CPU allocator, as `policy::rightsize`, run against 1,000 simulated training jobs per scenario,
//! beside the previous search (SODA §V-B-2 as lodger ran it before, `rightsize/soda.rs`) on the
//! same jobs with the same noise, and beside keeping the requested count.
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
//! owner history (§V-B-1's premise, "a user tends to submit similar training jobs", modelled here
//! as knees within 2 cores per GPU of the owner's typical one, a spread the paper does not give;
//! jobs run in sequence, each recording its settled count for the next), and SODA's model types
//! (Table I's CV, NLP and SPEECH models from the category defaults, with best-fit counts around
//! their category's default: 2–6 cores per GPU for CV, 3–8 for NLP and SPEECH, as the policy
//! tests model them).
//!
//! The knee, as the targets define it: the fewest cores (within the floor and the max) whose
//! noise-free utilization is within the measured noise of the best there, the noise being one
//! window's: 1.96 times the standard error of a 60-s window's mean for the job's noise process
//! (AR(1) with its σ and ρ, plus NVML's rounding to whole percent, variance 1/12 per sample).
//! Fewer cores lose more than that; more cannot gain more than that. A run "settles on the knee"
//! when its count is that knee or above it by at most the tuner's tolerance (the cores of error
//! it is configured to accept: 1 by default, 0 in the tolerance-0 row); "exact" counts the runs
//! that settle on it exactly. "±1" keeps the earlier figure: within one core of the curve's own
//! knee (where it stops rising). "starved" is the share settled where the noise-free utilization
//! is lower than the best by more than the noise.
//!
//! Printed per scenario and search: probes per job (mean, p95; the baseline window at the start
//! count is not a probe), windows judged per job (the baseline included; a window measured on
//! counts once, and its extensions show in the time tuning), the shares above, the mean
//! absolute error against the curve's knee, time tuning, GPU-utilization
//! loss during tuning (the area between the best utilization and the one the job had, from the
//! end of the warm-up to settling, as a percentage of the best), over a 1-hour job, and cores
//! wasted above the knee. Then each target (issue 21: probes ≤ 3 from a cold start, ≤ 2 from
//! history, ≥ 95 % on the knee) beside its figure, met or missed, the previous search's figure
//! in the same run, and the probes a search that knew each job's knee would still need to
//! settle on the evidence the tuner asks for (`evidence_floor`): what a target leaves a
//! search that must find the knee in noisy windows.

#[path = "rightsize/soda.rs"]
mod soda;

use lodger::policy::rightsize::model::Curve;
use lodger::rng::Rng;
use std::time::Duration;

use lodger::job::Category;
use lodger::policy::rightsize::{
    start_cores, CoreLimits, OwnerHistory, StartHints, Tuner, TunerAction, TunerSettings,
};
use soda::SodaTuner;

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

/// SODA's model types (Table I: CV, NLP and SPEECH models), started from the category defaults
/// SODA drew from them (§V-B-1, §IV-B), with best-fit counts around those defaults: 2–6 cores per
/// GPU for CV, 3–8 for NLP and SPEECH (Fig. 6, which has the measured counts, is not in the
/// text; the policy tests model them so too). No owner hints.
fn soda_jobs(rng: &mut Rng) -> Vec<Job> {
    (0..JOBS)
        .map(|i| {
            let (category, knees) = match i % 8 {
                0..=3 => (Category::Cv, (2, 6)),
                4 | 5 => (Category::Nlp, (3, 8)),
                _ => (Category::Speech, (3, 8)),
            };
            let knee = rng.int(knees.0, knees.1);
            Job {
                curve: draw_curve(rng, knee),
                owner: rng.int(0, OWNERS - 1),
                category,
                requested: draw_requested(rng),
                hints: StartHints::default(),
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

/// Samples in one window.
fn window_samples(settings: &TunerSettings) -> usize {
    (settings.window.as_secs() / SAMPLE_PERIOD.as_secs()).max(1) as usize
}

/// The measured noise of the best, for the knee's definition: 1.96 times the standard error of
/// one window's mean of `n` samples of the job's noise (AR(1): variance σ²/n² Σ ρ^|i−j|), with
/// the rounding to whole percent (variance 1/12 a sample) added as independent.
fn noise_of_best(curve: &Curve, n: usize) -> f64 {
    let nf = n as f64;
    let sum: f64 = (1..n)
        .map(|k| 2.0 * (nf - k as f64) * curve.rho.powi(k as i32))
        .sum();
    let var = curve.sigma * curve.sigma * (nf + sum) / (nf * nf) + 1.0 / 12.0 / nf;
    1.96 * var.sqrt()
}

/// The knee as the targets define it (see the module doc): the fewest cores within the limits
/// whose noise-free utilization is within `noise` of the best there.
fn noise_knee(curve: &Curve, limits: CoreLimits, noise: f64) -> u32 {
    let counts = limits.floor..=limits.max;
    let best = counts
        .clone()
        .map(|c| curve.util(c))
        .fold(f64::NEG_INFINITY, f64::max);
    counts
        .into_iter()
        .find(|&c| curve.util(c) >= best - noise)
        .unwrap_or(limits.max)
}

#[derive(Clone)]
struct Outcome {
    probes: usize,
    windows: usize,
    settled: u32,
    /// Knee capped at what the job could get.
    best: u32,
    /// The knee within the noise (see `noise_knee`).
    knee: u32,
    /// Settled where the noise-free utilization is lower than the best by more than the noise.
    starved: bool,
    tolerance: u32,
    /// Percent of the best utilization lost from the end of warm-up to settling.
    tuning_loss: f64,
    tuning_secs: u64,
    /// Percent of the best utilization lost over a 1-hour job (warm-up excluded), tuning
    /// included.
    hour_loss: f64,
    /// Started from the owner's history (§V-B-1), not a guess.
    from_history: bool,
    /// The probes a search that knew the knee would still need (see `evidence_floor`).
    floor_probes: usize,
    gpus: u32,
}

/// Which search a row runs.
#[derive(Clone, Copy, PartialEq)]
enum Search {
    /// `policy::rightsize::Tuner`.
    Lodger,
    /// The previous search (`soda.rs`).
    Previous,
}

enum Searcher {
    Lodger(Box<Tuner>),
    Previous(Box<SodaTuner>),
}

impl Searcher {
    fn cores(&self) -> u32 {
        match self {
            Searcher::Lodger(t) => t.cores(),
            Searcher::Previous(t) => t.cores(),
        }
    }

    fn step(&mut self, now: Duration, sample: f64) -> TunerAction {
        match self {
            Searcher::Lodger(t) => t.step(now, &[sample], false),
            Searcher::Previous(t) => t.step(now, &[sample]),
        }
    }

    /// Probes and windows judged.
    fn counts(&self) -> (usize, usize) {
        match self {
            Searcher::Lodger(t) => (t.probes(), t.history().len()),
            Searcher::Previous(t) => (t.probes(), t.windows()),
        }
    }
}

fn simulate(job: &Job, search: Search, settings: TunerSettings, rng: &mut Rng) -> Outcome {
    let curve = &job.curve;
    let limits = limits_of(curve);
    let warmup = settings.warmup;
    let tolerance = settings.tolerance;
    let from_history = settings.from_history;
    let start = settings.start;
    let window = window_samples(&settings);
    let mut tuner = match search {
        Search::Lodger => Searcher::Lodger(Box::new(Tuner::new(settings, Duration::ZERO))),
        Search::Previous => Searcher::Previous(Box::new(SodaTuner::new(settings, Duration::ZERO))),
    };
    let best = curve.knee().min(limits.max);
    let u_best = curve.util(best);
    let noise_best = noise_of_best(curve, window);
    let knee = noise_knee(curve, limits, noise_best);
    let u_top = (limits.floor..=limits.max)
        .map(|c| curve.util(c))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut noise = 0.0;
    let mut t = Duration::ZERO;
    let mut lost_area = 0.0;
    let mut tuning_secs = 0;
    let settled = loop {
        t += SAMPLE_PERIOD;
        assert!(t.as_secs() < MAX_SIM_SECS, "a tuner did not settle");
        let cores = tuner.cores();
        noise =
            curve.rho * noise + (1.0 - curve.rho * curve.rho).sqrt() * curve.sigma * rng.normal();
        let sample = (curve.util(cores) + noise).clamp(0.0, 100.0).round();
        if t > warmup {
            lost_area += u_best - curve.util(cores);
            tuning_secs += 1;
        }
        if let TunerAction::Settle(n) = tuner.step(t, sample) {
            break n;
        }
    };
    let (probes, windows) = tuner.counts();
    let floor_probes = evidence_floor(start, knee, tolerance, limits);
    let after = JOB_SECS.saturating_sub(tuning_secs) as f64;
    let hour_area = lost_area + after * (u_best - curve.util(settled));
    Outcome {
        probes,
        windows,
        settled,
        best,
        knee,
        starved: curve.util(settled) < u_top - noise_best,
        tolerance,
        tuning_loss: 100.0 * lost_area / (u_best * tuning_secs.max(1) as f64),
        tuning_secs,
        hour_loss: 100.0 * hour_area / (u_best * JOB_SECS as f64),
        from_history,
        floor_probes,
        gpus: curve.gpus,
    }
}

/// The fewest probes a search would need on a job even if it knew where the knee is, held to
/// the evidence the tuner settles on (see `Tuner`): the count `c` settled on measured, on the
/// knee (`knee ≤ c ≤ knee + tolerance`); something measured above `c`, to show that more does
/// not help (unless `c` is the max); and something measured at or below `c − tolerance − 1`,
/// to show that fewer starve the job (unless that is below the floor). The start's baseline
/// window is not a probe. Noise-free, so a floor no search reaches on noisy windows; the curve
/// fit (which may settle between two counts it measured) can now and then do with less, so it
/// is a guide to what a target asks for, not a proof.
fn evidence_floor(start: u32, knee: u32, tolerance: u32, limits: CoreLimits) -> usize {
    let last = knee.saturating_add(tolerance).min(limits.max).max(knee);
    (knee..=last)
        .map(|c| {
            let measure = c != start;
            let above = c < limits.max && start <= c;
            let below = c > limits.floor + tolerance && start + tolerance >= c;
            usize::from(measure) + usize::from(above) + usize::from(below)
        })
        .min()
        .unwrap_or(0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    sum / n.max(1) as f64
}

/// One scenario run by one search.
struct Row {
    name: &'static str,
    search: Search,
    jobs: Vec<Outcome>,
}

/// A row's headline figures.
struct Figures {
    probes: f64,
    p95: f64,
    on_knee: f64,
    /// Settled on the fewest cores within the noise of the best exactly (no tolerance above).
    exact: f64,
    within_one: f64,
    /// Mean `evidence_floor`.
    floor: f64,
    /// Jobs that needed fewer probes than their `evidence_floor` (the curve fit settled them).
    below_floor: usize,
}

impl Row {
    /// The same row, only the jobs that started from the owner's history.
    fn started_from_history(&self) -> Row {
        self.only(|o| o.from_history)
    }

    /// The same row, only the jobs `keep` keeps.
    fn only(&self, keep: impl Fn(&Outcome) -> bool) -> Row {
        Row {
            name: self.name,
            search: self.search,
            jobs: self.jobs.iter().filter(|o| keep(o)).cloned().collect(),
        }
    }

    fn share(&self, f: impl Fn(&Outcome) -> bool) -> f64 {
        100.0 * self.jobs.iter().filter(|o| f(o)).count() as f64 / self.jobs.len().max(1) as f64
    }

    fn figures(&self) -> Figures {
        let mut probes: Vec<f64> = self.jobs.iter().map(|o| o.probes as f64).collect();
        probes.sort_by(f64::total_cmp);
        Figures {
            probes: mean(probes.iter().copied()),
            p95: percentile(&probes, 0.95),
            on_knee: self.share(|o| o.settled >= o.knee && o.settled <= o.knee + o.tolerance),
            exact: self.share(|o| o.settled == o.knee),
            within_one: self.share(|o| o.settled.abs_diff(o.best) <= 1),
            floor: mean(self.jobs.iter().map(|o| o.floor_probes as f64)),
            below_floor: self
                .jobs
                .iter()
                .filter(|o| o.probes < o.floor_probes)
                .count(),
        }
    }
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<42} {:>6} {:>4} {:>7} {:>7} {:>6} {:>6} {:>7} {:>6} {:>6} {:>9} {:>7} {:>6}",
        "scenario / search",
        "probes",
        "p95",
        "windows",
        "on knee",
        "exact",
        "±1",
        "starved",
        "|err|",
        "tune s",
        "tune loss",
        "1h loss",
        "wasted"
    );
    for row in rows {
        let f = row.figures();
        let err = |o: &Outcome| f64::from(o.settled.abs_diff(o.best));
        let label = format!(
            "{}, {}",
            row.name,
            match row.search {
                Search::Lodger => "lodger",
                Search::Previous => "previous",
            }
        );
        println!(
            "{:<42} {:>6.2} {:>4.0} {:>7.2} {:>6.1}% {:>5.1}% {:>5.1}% {:>6.1}% {:>6.2} {:>6.0} {:>8.2}% {:>6.2}% {:>6.2}",
            label,
            f.probes,
            f.p95,
            mean(row.jobs.iter().map(|o| o.windows as f64)),
            f.on_knee,
            row.share(|o| o.settled == o.knee),
            f.within_one,
            row.share(|o| o.starved),
            mean(row.jobs.iter().map(err)),
            mean(row.jobs.iter().map(|o| o.tuning_secs as f64)),
            mean(row.jobs.iter().map(|o| o.tuning_loss)),
            mean(row.jobs.iter().map(|o| o.hour_loss)),
            mean(row.jobs.iter().map(|o| f64::from(o.settled.saturating_sub(o.best)))),
        );
    }
}

/// The "keep the requested count" baseline, on the same jobs.
fn print_requested(jobs: &[Job]) {
    let best = |j: &Job| j.curve.knee().min(limits_of(&j.curve).max);
    let wasted = mean(
        jobs.iter()
            .map(|j| f64::from(j.requested.saturating_sub(best(j)))),
    );
    let lost = mean(
        jobs.iter()
            .map(|j| 100.0 * (1.0 - j.curve.util(j.requested) / j.curve.util(best(j)))),
    );
    let starved = jobs.iter().filter(|j| j.requested < best(j)).count() as f64 / jobs.len() as f64;
    println!(
        "{:<42} cores wasted {wasted:.2}/job, 1h loss {lost:.2}%, {:.1}% of jobs below the knee",
        "keep the requested count (baseline)",
        100.0 * starved
    );
}

/// Each target beside the figure, met or missed, and the previous search's figure.
fn print_targets(name: &str, lodger: &Row, previous: &Row, max_probes: f64) {
    let (new, old) = (lodger.figures(), previous.figures());
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    println!(
        "{name}: probes {:.2} (target ≤ {max_probes}: {}; previous search {:.2}, {:.2}×; a search that knew the knee: {:.2}, jobs settled with fewer: {}); on the knee {:.1}% (target ≥ 95%: {}; previous {:.1}%); within ±1 core {:.1}% (previous {:.1}%)",
        new.probes,
        verdict(new.probes <= max_probes),
        old.probes,
        new.probes / old.probes,
        new.floor,
        new.below_floor,
        new.on_knee,
        verdict(new.on_knee >= 95.0),
        old.on_knee,
        new.within_one,
        old.within_one,
    );
}

fn run(
    name: &'static str,
    jobs: &[Job],
    use_history: bool,
    search: Search,
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
            let from_history =
                use_history && history.largest_per_gpu(job.owner, job.category).is_some();
            let settings = TunerSettings {
                from_history,
                gpus: job.curve.gpus,
                ..settings_of(start, limits)
            };
            let outcome = simulate(job, search, settings, &mut rng);
            history.record(job.owner, job.category, outcome.settled, job.curve.gpus);
            outcome
        })
        .collect();
    Row {
        name,
        search,
        jobs: outcomes,
    }
}

/// The scenario run by both searches, on the same jobs and noise.
fn both(
    name: &'static str,
    jobs: &[Job],
    use_history: bool,
    settings_of: &dyn Fn(u32, CoreLimits) -> TunerSettings,
    seed: u64,
) -> [Row; 2] {
    [Search::Lodger, Search::Previous]
        .map(|search| run(name, jobs, use_history, search, settings_of, seed))
}

fn main() {
    let mut rng = Rng::new(SEED);
    let cold = cold_jobs(&mut rng);
    let owned = owner_jobs(&mut rng);
    let modelled = soda_jobs(&mut rng);
    let default = |start, limits| TunerSettings::new(start, limits);
    let exact = |start, limits| TunerSettings {
        tolerance: 0,
        ..TunerSettings::new(start, limits)
    };
    println!(
        "right-sizing simulation: {JOBS} jobs per scenario, seed {SEED:#x}, 60 s windows, 180 s warm-up, 1 sample/s"
    );
    println!(
        "on knee: settled on the fewest cores within one window's noise (1.96 standard errors) of the best, or up to the tolerance above it"
    );
    let cold_rows = both("cold start", &cold, false, &default, SEED ^ 1);
    let exact_rows = both("cold start, tolerance 0", &cold, false, &exact, SEED ^ 1);
    let history_rows = both("owner history", &owned, true, &default, SEED ^ 2);
    let soda_rows = both(
        "SODA model types, cold",
        &modelled,
        false,
        &default,
        SEED ^ 3,
    );
    println!();
    print_rows(&cold_rows);
    print_rows(&exact_rows);
    print_requested(&cold);
    println!();
    print_rows(&history_rows);
    print_requested(&owned);
    println!();
    print_rows(&soda_rows);
    print_requested(&modelled);
    println!();
    println!("targets (issue 21), beside the previous search in the same run:");
    print_targets("cold start", &cold_rows[0], &cold_rows[1], 3.0);
    // The issue defines the knee as the fewest such cores: read with no tolerance above it, the
    // default tuner (tolerance_cores = 1) settles there less often, and one told to pin the
    // exact knee (tolerance_cores = 0) needs more probes.
    let (strict, pinned) = (cold_rows[0].figures(), exact_rows[0].figures());
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    println!(
        "  cold start read with no tolerance (settled on the fewest cores exactly): {:.1}% with tolerance_cores = 1 (target ≥ 95%: {}); with tolerance_cores = 0, probes {:.2} (target ≤ 3: {}), exactly on the knee {:.1}% (target ≥ 95%: {})",
        strict.exact,
        verdict(strict.exact >= 95.0),
        pinned.probes,
        verdict(pinned.probes <= 3.0),
        pinned.exact,
        verdict(pinned.exact >= 95.0),
    );
    // "From history" is the jobs that had one: the first job of each owner and category in the
    // scenario starts cold (a category default or the requested count).
    let [with, with_previous] = [&history_rows[0], &history_rows[1]].map(Row::started_from_history);
    print_targets(
        &format!(
            "owner history, the {} jobs started from it",
            with.jobs.len()
        ),
        &with,
        &with_previous,
        2.0,
    );
    // Where the probes go: the more GPUs, the wider the owner's spread of knees in cores (2 per
    // GPU) against the same 1-core tolerance.
    let by_gpus = [1, 2, 4].map(|g| {
        let f = with.only(|o| o.gpus == g).figures();
        format!(
            "{g} GPU{}: {:.2} probes (knowing the knee {:.2}), {:.1}% on the knee",
            if g == 1 { "" } else { "s" },
            f.probes,
            f.floor,
            f.on_knee
        )
    });
    println!("  by GPUs: {}", by_gpus.join("; "));
    let all = history_rows[0].figures();
    println!(
        "  (all {} jobs of the scenario, the first of each owner and category a cold start: probes {:.2}, on the knee {:.1}%)",
        history_rows[0].jobs.len(),
        all.probes,
        all.on_knee
    );
    print_targets("SODA model types, cold", &soda_rows[0], &soda_rows[1], 3.0);
}
