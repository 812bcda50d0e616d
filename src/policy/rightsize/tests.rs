//! Tests of right-sizing: start points, owner history, the tuner against modelled jobs.

use super::model::Curve;
use std::time::Duration;

use super::noise::{mean, std_dev, t_975, WindowStats};
use super::start::{HISTORY_MAX_KEYS, HISTORY_PER_KEY};
use super::*;
use crate::job::Category;
use proptest::prelude::*;

const SEC: Duration = Duration::from_secs(1);

use crate::rng::Rng;

impl Curve {
    /// The same job with utilization independent of its cores.
    fn flat(peak: f64, sigma: f64, rho: f64) -> Self {
        Self {
            gpus: 1,
            knee_per_gpu: 1,
            parallel: 0.9,
            peak,
            drop_above: 0.0,
            sigma,
            rho,
        }
    }

    fn clean(knee: u32) -> Self {
        Self {
            gpus: 1,
            knee_per_gpu: knee,
            parallel: 0.95,
            peak: 90.0,
            drop_above: 0.0,
            sigma: 0.5,
            rho: 0.0,
        }
    }
}

fn curve_strategy(knees: std::ops::RangeInclusive<u32>) -> impl Strategy<Value = Curve> {
    (
        prop_oneof![Just(1u32), Just(2), Just(4)],
        knees,
        0.85f64..0.99,
        70.0f64..100.0,
        prop_oneof![Just(0.0f64), 0.0f64..0.3],
        0.5f64..5.0,
        0.0f64..0.6,
    )
        .prop_map(
            |(gpus, knee_per_gpu, parallel, peak, drop_above, sigma, rho)| Curve {
                gpus,
                knee_per_gpu,
                parallel,
                peak,
                drop_above,
                sigma,
                rho,
            },
        )
}

fn settings(start: u32, floor: u32, max: u32, tolerance: u32) -> TunerSettings {
    TunerSettings {
        warmup: Duration::from_secs(30),
        tolerance,
        ..TunerSettings::new(start, CoreLimits { floor, max })
    }
}

/// As `settings`, for a start taken from the owner's history (§V-B-1).
fn from_history(start: u32, floor: u32, max: u32, tolerance: u32) -> TunerSettings {
    TunerSettings {
        from_history: true,
        ..settings(start, floor, max, tolerance)
    }
}

/// What a simulated tuning run did.
#[derive(Debug)]
struct Run {
    settled: u32,
    probes: usize,
    windows: usize,
    /// The count the job had, each time it changed (the start first).
    counts: Vec<u32>,
    history: Vec<Probe>,
}

/// Runs a tuner against `curve` with one sample a second, `throttled(second)` saying when
/// a contention throttle is active. Checks on the way that no Resize moves the job while
/// throttled, except back up to a count already measured.
fn run(curve: &Curve, settings: TunerSettings, seed: u64, throttled: &dyn Fn(u64) -> bool) -> Run {
    let mut rng = Rng::scrambled(seed);
    let mut tuner = Tuner::new(settings.clone(), Duration::ZERO);
    let mut counts = vec![tuner.cores()];
    let mut noise = 0.0;
    let mut t = Duration::ZERO;
    loop {
        t += SEC;
        assert!(t.as_secs() < 48 * 3600, "no settling: {tuner:?}");
        let before = tuner.cores();
        noise =
            curve.rho * noise + (1.0 - curve.rho * curve.rho).sqrt() * curve.sigma * rng.normal();
        let sample = (curve.util(before) + noise).clamp(0.0, 100.0).round();
        let throttle = throttled(t.as_secs());
        // A step said to keep what is written must keep it (the agent then keeps no copy).
        let kept = tuner.step_keeps_disk(t, throttle).then(|| tuner.clone());
        let action = tuner.step(t, &[sample], throttle);
        if let Some(kept) = kept {
            assert!(
                tuner.same_on_disk(&kept),
                "a step said to keep the state file changed it at {t:?}: {kept:?} -> {tuner:?}"
            );
        }
        let after = tuner.cores();
        assert!(
            (settings.floor..=settings.max).contains(&after),
            "{after} outside [{}, {}]",
            settings.floor,
            settings.max
        );
        match action {
            TunerAction::Resize(n) | TunerAction::Settle(n) => assert_eq!(n, after),
            TunerAction::Wait | TunerAction::Hold(_) => assert_eq!(before, after),
        }
        if throttle {
            if let TunerAction::Resize(n) = action {
                let measured = tuner
                    .history()
                    .iter()
                    .any(|p| p.cores == n && !matches!(p.decision, Decision::Interrupted));
                assert!(measured && n > before, "probe to {n} while throttled");
            }
        }
        if after != before {
            counts.push(after);
        }
        if let TunerAction::Settle(n) = action {
            return Run {
                settled: n,
                probes: tuner.probes(),
                windows: tuner
                    .history()
                    .iter()
                    .filter(|p| p.decision != Decision::Interrupted)
                    .count(),
                counts,
                history: tuner.history().to_vec(),
            };
        }
    }
}

fn never(_: u64) -> bool {
    false
}

fn describe(history: &[Probe]) -> String {
    history
        .iter()
        .map(|p| {
            format!(
                "{} {:.1}±{:.2} {}",
                p.cores, p.mean_util, p.noise, p.decision
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

// -----------------------------------------------------------------------------------------
// Start point.

#[test]
fn start_cores_table() {
    let mut history = OwnerHistory::new();
    // Owner 1000's CV jobs settled on 6 cores with 1 GPU and on 10 with 2 (5 per GPU).
    history.record(1000, Category::Cv, 6, 1);
    history.record(1000, Category::Cv, 10, 2);
    let wide = CoreLimits { floor: 1, max: 64 };
    let none = StartHints::default();
    let pipelined = StartHints {
        pipelined_loader: true,
        ..none
    };
    let lean = StartHints {
        pipelined_loader: true,
        large_model: true,
        ..none
    };
    let heavy = StartHints {
        heavy_preprocessing: true,
        ..none
    };
    struct Case {
        name: &'static str,
        owner: u32,
        category: Category,
        requested: u32,
        gpus: u32,
        hints: StartHints,
        limits: CoreLimits,
        want: u32,
    }
    let case = |name, owner, category, requested, gpus, hints, limits, want| Case {
        name,
        owner,
        category,
        requested,
        gpus,
        hints,
        limits,
        want,
    };
    let cases = [
        case("cv default", 1, Category::Cv, 1, 1, none, wide, 3),
        case("nlp default", 1, Category::Nlp, 1, 1, none, wide, 5),
        case("speech default", 1, Category::Speech, 1, 1, none, wide, 5),
        case("other: requested", 1, Category::Other, 7, 1, none, wide, 7),
        case("per GPU", 1, Category::Cv, 1, 4, none, wide, 12),
        case(
            "pipelined, per GPU",
            1,
            Category::Cv,
            1,
            4,
            pipelined,
            wide,
            8,
        ),
        case("pipelined and large", 1, Category::Nlp, 1, 2, lean, wide, 6),
        case(
            "heavy preprocessing",
            1,
            Category::Speech,
            1,
            2,
            heavy,
            wide,
            12,
        ),
        case("other, adjusted", 1, Category::Other, 9, 2, heavy, wide, 11),
        case(
            "no GPU counts as one",
            1,
            Category::Nlp,
            1,
            0,
            none,
            wide,
            5,
        ),
        case(
            "history: largest per GPU",
            1000,
            Category::Cv,
            1,
            2,
            none,
            wide,
            12,
        ),
        case(
            "history, adjusted",
            1000,
            Category::Cv,
            1,
            1,
            pipelined,
            wide,
            5,
        ),
        case(
            "history is per category",
            1000,
            Category::Nlp,
            1,
            1,
            none,
            wide,
            5,
        ),
        case(
            "history is per owner",
            1001,
            Category::Cv,
            1,
            1,
            none,
            wide,
            3,
        ),
        case(
            "clamped to the floor",
            1,
            Category::Other,
            2,
            2,
            lean,
            CoreLimits { floor: 2, max: 64 },
            2,
        ),
        case(
            "clamped to the max",
            1,
            Category::Nlp,
            1,
            8,
            none,
            CoreLimits { floor: 8, max: 24 },
            24,
        ),
        case(
            "the max wins over the floor",
            1,
            Category::Cv,
            1,
            1,
            none,
            CoreLimits { floor: 6, max: 2 },
            2,
        ),
    ];
    for c in cases {
        let got = start_cores(
            &history,
            c.owner,
            c.category,
            c.requested,
            c.gpus,
            c.hints,
            c.limits,
        );
        assert_eq!(got, c.want, "{}", c.name);
    }
}

#[test]
fn floors() {
    assert_eq!(default_floor(4, 2, true), 4);
    assert_eq!(default_floor(0, 2, true), 1);
    assert_eq!(default_floor(4, 10, false), 10);
    assert_eq!(default_floor(1, 0, false), 1);
}

#[test]
fn owner_history_keeps_recent_counts_and_round_trips() {
    let mut history = OwnerHistory::new();
    history.record(7, Category::Nlp, 40, 1);
    for n in 1..=HISTORY_PER_KEY {
        history.record(7, Category::Nlp, u32::try_from(n).unwrap(), 1);
    }
    // The odd 40-core job has been forgotten.
    assert_eq!(
        history.largest_per_gpu(7, Category::Nlp),
        Some(u32::try_from(HISTORY_PER_KEY).unwrap())
    );
    // Per GPU, rounded up.
    history.record(8, Category::Speech, 9, 4);
    assert_eq!(history.largest_per_gpu(8, Category::Speech), Some(3));
    assert_eq!(history.largest_per_gpu(8, Category::Cv), None);

    let json = serde_json::to_string(&history).unwrap();
    assert!(json.contains("\"category\":\"speech\""), "{json}");
    let back: OwnerHistory = serde_json::from_str(&json).unwrap();
    assert_eq!(back, history);

    // Bounded: the least recently recorded owner goes first.
    for owner in 0..u32::try_from(HISTORY_MAX_KEYS).unwrap() {
        history.record(100 + owner, Category::Cv, 3, 1);
    }
    assert_eq!(history.records().len(), HISTORY_MAX_KEYS);
    assert_eq!(history.largest_per_gpu(7, Category::Nlp), None);
    assert_eq!(history.largest_per_gpu(100, Category::Cv), Some(3));
}

// -----------------------------------------------------------------------------------------
// Noise.

#[test]
fn t_quantiles() {
    assert!((t_975(1.0) - 12.706).abs() < 1e-9);
    assert!((t_975(10.0) - 2.228).abs() < 1e-9);
    assert!((t_975(9.0) - 2.262).abs() < 0.01);
    assert!((t_975(1e9) - 1.96).abs() < 1e-3);
    assert!((t_975(f64::INFINITY) - 1.96).abs() < 1e-9);
    let mut last = f64::INFINITY;
    for df in 1..500 {
        let t = t_975(f64::from(df) / 2.0);
        assert!(t <= last && t >= 1.96, "df {}: {t}", f64::from(df) / 2.0);
        last = t;
    }
}

/// The noise a window reports is the noise of its mean, also when its samples are
/// correlated (batch means), which the samples' own spread would understate.
#[test]
fn window_noise_tracks_the_signal() {
    for (rho, tolerance) in [(0.0, 0.25), (0.6, 0.3)] {
        let mut rng = Rng::scrambled(1);
        let sigma = 3.0;
        let n = 60;
        let mut means = Vec::new();
        let mut ses = Vec::new();
        let mut iid = Vec::new();
        let mut noise = 0.0;
        for _ in 0..400 {
            let samples: Vec<f64> = (0..n)
                .map(|_| {
                    noise = rho * noise + (1.0f64 - rho * rho).sqrt() * sigma * rng.normal();
                    50.0 + noise
                })
                .collect();
            let w = WindowStats::of(4, &samples);
            means.push(w.mean);
            ses.push(w.se);
            iid.push(std_dev(&samples) / (n as f64).sqrt());
        }
        let actual = std_dev(&means);
        let reported = mean(&ses);
        assert!(
            (reported / actual - 1.0).abs() < tolerance,
            "rho {rho}: reported {reported:.3}, actual {actual:.3}"
        );
        if rho > 0.0 {
            assert!(mean(&iid) < 0.7 * actual, "the naive estimate understates");
        }
    }
    let few = WindowStats::of(1, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(few.df, 5.0);
    assert!((few.se - std_dev(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) / 6f64.sqrt()).abs() < 1e-12);
}

// -----------------------------------------------------------------------------------------
// Tuning: table tests.

#[test]
fn search_table() {
    struct Case {
        name: &'static str,
        curve: Curve,
        start: u32,
        floor: u32,
        max: u32,
        want: u32,
        max_probes: usize,
    }
    let c = |name, curve, start, floor, max, want, max_probes| Case {
        name,
        curve,
        start,
        floor,
        max,
        want,
        max_probes,
    };
    let cases = [
        c("at the knee", Curve::clean(5), 5, 1, 32, 5, 3),
        c("one too many", Curve::clean(4), 5, 1, 32, 4, 3),
        c("far too many", Curve::clean(3), 24, 1, 32, 3, 6),
        c("one too few", Curve::clean(6), 5, 1, 32, 6, 4),
        c("far too few", Curve::clean(14), 2, 1, 32, 14, 9),
        c("the floor is enough", Curve::clean(1), 3, 1, 32, 1, 3),
        c("not above the max", Curve::clean(12), 3, 1, 8, 8, 5),
        c("not below the floor", Curve::clean(2), 8, 6, 32, 6, 2),
        c("nowhere to go", Curve::clean(4), 4, 4, 4, 4, 0),
        c(
            "four GPUs",
            Curve {
                gpus: 4,
                ..Curve::clean(5)
            },
            12,
            4,
            64,
            20,
            9,
        ),
    ];
    // Each case from a guessed start and from the owner's history: the same count either way.
    for case in cases {
        for history in [false, true] {
            let settings = TunerSettings {
                from_history: history,
                ..settings(case.start, case.floor, case.max, 0)
            };
            let r = run(&case.curve, settings, 7, &never);
            let name = format!("{} (history: {history})", case.name);
            assert_eq!(r.settled, case.want, "{name}: {}", describe(&r.history));
            assert!(
                r.probes <= case.max_probes,
                "{name}: {} probes: {}",
                r.probes,
                describe(&r.history)
            );
            // §V-B-2: from the owner's history, the first probe is a smaller count; from a
            // guess, a larger one (unless the start is the max already).
            if case.start > case.floor && history {
                assert!(r.counts[1] < case.start, "{name}: {:?}", r.counts);
            }
            if case.start < case.max && !history {
                assert!(r.counts[1] > case.start, "{name}: {:?}", r.counts);
            }
        }
    }
}

/// Found by `tuning_invariants`: when the floor and the max are both nearer the start than
/// a step that could show a change (a noisy, low signal), every step is cut short, and the
/// search used to go round max → floor → max for ever.
#[test]
fn steps_cut_short_at_both_ends_do_not_go_round_in_circles() {
    let curve = Curve::flat(20.0, 5.0, 0.5);
    for seed in 0..20 {
        let r = run(&curve, settings(7, 5, 7, 0), seed, &never);
        assert!((5..=7).contains(&r.settled));
        assert!(r.windows <= 5, "{}", describe(&r.history));
    }
}

#[test]
fn tolerance_stops_one_core_early() {
    // Knee 9 from 2: with tolerance 1 the search may stop at 9 or 10, and needs fewer
    // probes than exactly.
    let exact = run(&Curve::clean(9), settings(2, 1, 32, 0), 3, &never);
    let loose = run(&Curve::clean(9), settings(2, 1, 32, 1), 3, &never);
    assert_eq!(exact.settled, 9, "{}", describe(&exact.history));
    assert!(
        (9..=10).contains(&loose.settled),
        "{}",
        describe(&loose.history)
    );
    assert!(loose.probes <= exact.probes);
}

#[test]
fn warmup_and_windows() {
    let mut t = Tuner::new(from_history(4, 1, 8, 0), Duration::ZERO);
    assert_eq!(t.cores(), 4);
    assert_eq!(t.recommendation(), 4);
    // Warm-up: samples are ignored, however wild.
    assert_eq!(
        t.step(Duration::from_secs(10), &[0.0; 10], false),
        TunerAction::Wait
    );
    assert_eq!(
        t.step(Duration::from_secs(30), &[0.0; 20], false),
        TunerAction::Wait
    );
    // The baseline window runs from 30 s to 90 s; the caller may hand its samples over at
    // any pace, here all at the end.
    assert_eq!(
        t.step(Duration::from_secs(89), &[], false),
        TunerAction::Wait
    );
    let samples: Vec<f64> = (0..60).map(|i| 80.0 + f64::from(i * i % 7) / 3.0).collect();
    let action = t.step(Duration::from_secs(90), &samples, false);
    assert!(
        matches!(action, TunerAction::Resize(n) if n < 4),
        "{action:?}"
    );
    let baseline = &t.history()[0];
    assert_eq!(baseline.decision, Decision::Baseline);
    assert_eq!(baseline.cores, 4);
    assert_eq!(baseline.samples, 60);
    assert!((baseline.mean_util - mean(&samples)).abs() < 1e-9);
    assert!(baseline.noise > 0.0);
    // Non-finite samples are ignored. (The probe is clearly starved: a window on the plateau
    // would be measured on, see `a_plateau_measured_once_is_measured_on`.)
    let mut samples = vec![f64::NAN, f64::INFINITY];
    samples.extend((0..60).map(|i| 40.0 + f64::from(i % 3)));
    let action = t.step(Duration::from_secs(150), &samples, false);
    assert_eq!(t.history()[1].samples, 60);
    assert!(!matches!(action, TunerAction::Wait | TunerAction::Hold(_)));
}

#[test]
fn too_few_samples_hold_the_window_open() {
    let mut t = Tuner::new(settings(4, 1, 8, 0), Duration::ZERO);
    t.step(Duration::from_secs(30), &[], false);
    let need = MIN_WINDOW_SAMPLES;
    assert_eq!(
        t.step(Duration::from_secs(90), &[50.0, 51.0], false),
        TunerAction::Hold(HoldReason::TooFewSamples { have: 2, need })
    );
    assert_eq!(t.cores(), 4);
    assert!(t.history().is_empty());
    let action = t.step(Duration::from_secs(95), &[50.0, 52.0, 51.0, 50.0], false);
    assert!(matches!(action, TunerAction::Resize(_)), "{action:?}");
    assert_eq!(t.history()[0].samples, 6);
}

#[test]
fn a_clock_stepped_back_restarts_the_window() {
    let mut t = Tuner::new(settings(4, 1, 8, 0), Duration::from_secs(1000));
    t.step(Duration::from_secs(1030), &[], false);
    t.step(Duration::from_secs(1060), &[50.0; 30], false);
    // The clock goes back 500 s: the window starts again there and lasts a full window.
    assert_eq!(
        t.step(Duration::from_secs(560), &[50.0; 5], false),
        TunerAction::Wait
    );
    assert_eq!(
        t.step(Duration::from_secs(619), &[50.0; 50], false),
        TunerAction::Wait
    );
    assert!(matches!(
        t.step(Duration::from_secs(620), &[50.0; 5], false),
        TunerAction::Resize(_)
    ));
    assert_eq!(t.history()[0].samples, 60);
}

/// Feeds `secs` seconds of samples from `util` (with a small alternation, so the noise is
/// not zero) one second at a time, and returns the actions.
fn feed(
    t: &mut Tuner,
    from: u64,
    secs: u64,
    util: impl Fn(u32) -> f64,
    throttled: bool,
) -> Vec<TunerAction> {
    (from + 1..=from + secs)
        .map(|s| {
            let u = util(t.cores()) + if s % 2 == 0 { 0.4 } else { -0.4 };
            t.step(Duration::from_secs(s), &[u], throttled)
        })
        .collect()
}

/// The grow test's tuner (tests/rightsize.rs): one core or two, 6-s windows after a 2-s warm-up,
/// the warm-up over.
fn one_or_two_cores() -> Tuner {
    let s = TunerSettings {
        warmup: Duration::from_secs(2),
        window: Duration::from_secs(6),
        tolerance: 0,
        ..TunerSettings::new(1, CoreLimits { floor: 1, max: 2 })
    };
    let mut t = Tuner::new(s, Duration::ZERO);
    t.step(Duration::from_secs(2), &[], false);
    t
}

/// The figures of a CI run where the grow test failed: one core starved the job (62 % busy,
/// steady), two made it busier (80 %) but so noisily that six samples could not tell; judged
/// then, two cores were "no better". The window is measured on instead, and its twelve
/// samples show the rise.
#[test]
fn a_window_too_noisy_to_judge_is_measured_on() {
    let mut t = one_or_two_cores();
    let mut now = 2;
    let mut at = |t: &mut Tuner, samples: &[f64]| {
        let mut last = TunerAction::Wait;
        for x in samples {
            now += 1;
            last = t.step(Duration::from_secs(now), &[*x], false);
        }
        last
    };
    let baseline = [61.0, 62.0, 63.0, 62.0, 61.0, 63.0];
    assert_eq!(at(&mut t, &baseline), TunerAction::Resize(2));
    let noisy = [98.0, 62.0, 98.0, 62.0, 98.0, 62.0];
    assert_eq!(
        at(&mut t, &noisy),
        TunerAction::Wait,
        "{}",
        describe(t.history())
    );
    assert_eq!(t.extended(), 1);
    assert_eq!(t.cores(), 2);
    // Judged once the rise clears the noise, or measured on while the fitted curve still
    // wants samples of it (see `fit::measure_on`), at most `MAX_EXTENSIONS` times in all.
    let mut windows = 2;
    let mut last = at(&mut t, &noisy);
    while last == TunerAction::Wait && windows <= MAX_EXTENSIONS {
        windows += 1;
        last = at(&mut t, &noisy);
    }
    assert_eq!(last, TunerAction::Settle(2), "{}", describe(t.history()));
    let judged = t.history().last().expect("a probe");
    assert!(
        matches!(judged.decision, Decision::Better { than: 1, .. }),
        "{}",
        describe(t.history())
    );
    assert_eq!(judged.samples, 6 * windows as usize);
    assert_eq!(t.extended(), 0);
}

/// The figures of a CI run of the shrink test (tests/rightsize.rs): two cores 98.7 % busy,
/// one 98.0 %, each steady within a few tenths. The noise clears 0.7 points, so at
/// `min_change` 0 one core is starved and the job keeps two; with `min_change` 2 the drop is
/// too small to count, and one core is enough, said with the floor as the threshold. A drop of
/// 1.4 points, clearly below the floor, is judged after one window: more samples could not
/// carry it over 2, so it is not measured on as undecided.
#[test]
fn a_change_below_min_change_does_not_count() {
    let settle_at = |min_change: f64, one_core: f64| {
        let s = TunerSettings {
            warmup: Duration::from_secs(2),
            window: Duration::from_secs(6),
            tolerance: 0,
            min_change,
            ..TunerSettings::new(2, CoreLimits { floor: 1, max: 2 })
        };
        let mut t = Tuner::new(s, Duration::ZERO);
        t.step(Duration::from_secs(2), &[], false);
        let mut now = 2;
        let mut last = TunerAction::Wait;
        while !matches!(last, TunerAction::Settle(_)) && now < 200 {
            now += 1;
            let at = if t.cores() == 2 { 98.7 } else { one_core };
            let wobble = [0.2, -0.1, 0.0, -0.2, 0.1, 0.0][now as usize % 6];
            last = t.step(Duration::from_secs(now), &[at + wobble], false);
        }
        (last, t.history().to_vec())
    };
    let settle = |min_change| settle_at(min_change, 98.0);
    let (strict, history) = settle(0.0);
    assert_eq!(strict, TunerAction::Settle(2), "{}", describe(&history));
    assert!(
        matches!(
            history.last().map(|p| p.decision),
            Some(Decision::Starved { than: 2, .. })
        ),
        "{}",
        describe(&history)
    );
    let (floored, history) = settle(2.0);
    assert_eq!(floored, TunerAction::Settle(1), "{}", describe(&history));
    assert_eq!(
        history.last().map(|p| p.decision.to_string()).as_deref(),
        Some("enough: within 2.00 of 2"),
        "{}",
        describe(&history)
    );
    let (floored, history) = settle_at(2.0, 97.3);
    assert_eq!(floored, TunerAction::Settle(1), "{}", describe(&history));
    assert_eq!(
        history.last().map(|p| p.samples),
        Some(6),
        "one window, not measured on: {}",
        describe(&history)
    );
}

/// A noisy window that does not lean toward a change is not measured on as undecided: that
/// is for evidence that points one way without clearing the noise, not for every noisy
/// window. (The fitted curve may still ask for more samples of a plateau measured once, see
/// `fit::measure_on`; here the window's own noise is so large that it does, and the window is
/// then judged no better than one core.)
#[test]
fn a_noisy_window_with_no_lean_is_judged_no_better() {
    let mut t = one_or_two_cores();
    let mut now = 2;
    let mut last = TunerAction::Wait;
    let baseline = [61.0, 62.0, 63.0, 62.0, 61.0, 63.0];
    let noisy = [80.0, 44.0, 80.0, 44.0, 80.0, 44.0];
    for x in baseline {
        now += 1;
        last = t.step(Duration::from_secs(now), &[x], false);
    }
    assert_eq!(last, TunerAction::Resize(2));
    let windows = 1 + MAX_EXTENSIONS as usize;
    for x in noisy.iter().cycle().take(6 * windows) {
        now += 1;
        last = t.step(Duration::from_secs(now), &[*x], false);
        if last != TunerAction::Wait {
            break;
        }
    }
    assert_eq!(last, TunerAction::Settle(1), "{}", describe(t.history()));
    let judged = t.history().last().expect("a probe");
    assert!(
        matches!(judged.decision, Decision::NoBetter { than: 1, .. }),
        "{}",
        describe(t.history())
    );
}

/// A window on the plateau, when the plateau has been measured only once, is measured on:
/// every count is judged against the plateau, and its noise adds to theirs
/// (`fit::PLATEAU_WINDOWS`). It costs time, not a probe.
#[test]
fn a_plateau_measured_once_is_measured_on() {
    let util = |c: u32| 90.0 * f64::from(c.min(4)) / 4.0;
    let mut t = Tuner::new(settings(2, 1, 16, 1), Duration::ZERO);
    feed(&mut t, 0, 30, util, false);
    // The baseline at 2 cores (45 %), then a step up onto the plateau.
    let actions = feed(&mut t, 30, 60, util, false);
    let up = t.cores();
    assert!(up > 4, "{actions:?}");
    let actions = feed(&mut t, 90, 60, util, false);
    assert!(
        actions.iter().all(|a| *a == TunerAction::Wait),
        "{actions:?}"
    );
    assert_eq!(t.extended(), 1);
    assert_eq!(t.cores(), up);
    assert_eq!(t.probes(), 0);
}

#[test]
fn a_throttle_stops_the_window_and_undoes_a_smaller_probe() {
    let util = |c: u32| 90.0 * f64::from(c.min(6)) / 6.0;
    let mut t = Tuner::new(from_history(8, 1, 16, 0), Duration::ZERO);
    feed(&mut t, 0, 30, util, false);
    let actions = feed(&mut t, 30, 60, util, false);
    let probe = t.cores();
    assert!(probe < 8, "{actions:?}");
    feed(&mut t, 90, 20, util, false);

    // A throttle begins: the job goes back to the count it had, measured, and stays.
    let actions = feed(&mut t, 110, 1, util, true);
    assert_eq!(actions, [TunerAction::Resize(8)]);
    let actions = feed(&mut t, 111, 300, util, true);
    assert!(actions
        .iter()
        .all(|a| *a == TunerAction::Hold(HoldReason::Throttled)));
    assert_eq!(t.recommendation(), 8);
    // It comes and goes: one history entry, not one per flap.
    for k in 0..5 {
        feed(&mut t, 411 + 2 * k, 1, util, false);
        feed(&mut t, 412 + 2 * k, 1, util, true);
    }
    let interrupted = t
        .history()
        .iter()
        .filter(|p| p.decision == Decision::Interrupted)
        .count();
    assert_eq!(interrupted, 1, "{}", describe(t.history()));

    // It ends: the probe is made again, and its window starts afresh.
    let actions = feed(&mut t, 500, 1, util, false);
    assert_eq!(actions, [TunerAction::Resize(probe)]);
    let actions = feed(&mut t, 501, 59, util, false);
    assert!(
        actions.iter().all(|a| *a == TunerAction::Wait),
        "{actions:?}"
    );
    // Judged at its end, or measured on (at most `MAX_EXTENSIONS` windows more).
    let actions = feed(&mut t, 560, 60 * u64::from(MAX_EXTENSIONS) + 1, util, false);
    assert!(actions.iter().any(|a| *a != TunerAction::Wait));
    let judged = t
        .history()
        .iter()
        .rev()
        .find(|p| p.decision != Decision::Interrupted)
        .unwrap();
    assert_eq!(judged.cores, probe);
    assert!(judged.samples >= 60 && judged.samples % 60 == 0);
}

#[test]
fn a_throttle_in_warmup_or_baseline_holds_without_resizing() {
    let util = |_: u32| 50.0;
    let mut t = Tuner::new(settings(4, 1, 8, 0), Duration::ZERO);
    let actions = feed(&mut t, 0, 40, util, true);
    assert!(actions
        .iter()
        .all(|a| *a == TunerAction::Hold(HoldReason::Throttled)));
    // Released after the warm-up: the baseline window starts then.
    feed(&mut t, 40, 30, util, false);
    let actions = feed(&mut t, 70, 10, util, true);
    assert!(actions
        .iter()
        .all(|a| *a == TunerAction::Hold(HoldReason::Throttled)));
    assert_eq!(t.cores(), 4);
}

#[test]
fn settling_is_final_and_stop_settles_at_the_recommendation() {
    let r = run(&Curve::clean(3), settings(6, 1, 16, 0), 11, &never);
    assert_eq!(r.settled, 3, "{}", describe(&r.history));

    let util = |c: u32| 90.0 * f64::from(c.min(3)) / 3.0;
    let mut t = Tuner::new(settings(6, 1, 16, 0), Duration::ZERO);
    feed(&mut t, 0, 200, util, false);
    assert!(t.settled().is_none());
    let n = t.stop();
    assert_eq!(t.settled(), Some(n));
    assert_eq!(t.cores(), n);
    assert_eq!(
        t.step(Duration::from_secs(500), &[1.0], true),
        TunerAction::Settle(n)
    );
    assert_eq!(
        t.step(Duration::from_secs(600), &[], false),
        TunerAction::Settle(n)
    );
}

/// Finding 4 (review at cc00f65): a job's samples stop mid-probe (its utilization can no longer
/// be attributed, a GPU is lost, the source goes stale). The tuner used to hold at the probe,
/// below the knee perhaps, for good; after two windows it goes back to the best count known and
/// waits there, and the probe's window starts again when samples come back.
/// A window that fills slowly (one sample per 30-s sensing pass: six take three minutes, past
/// the two-window stall bound) has not stalled: samples keep coming, and the search goes on.
#[test]
fn a_window_filled_by_slow_sensing_passes_is_not_a_stall() {
    let mut t = Tuner::new(from_history(8, 1, 16, 1), Duration::ZERO);
    let mut now = 0;
    let mut actions = Vec::new();
    while now < 3 * 3600 && t.settled().is_none() {
        now += 30;
        let u = if t.cores() >= 4 { 80.0 } else { 40.0 };
        actions.push(t.step(Duration::from_secs(now), &[u], false));
        assert!(!t.stalled(), "stalled at {now} s: {:?}", actions.last());
    }
    assert!(
        !actions.contains(&TunerAction::Hold(HoldReason::NoSamples)),
        "{actions:?}"
    );
    assert!(t.history().len() > 1, "{}", describe(t.history()));
}

#[test]
fn samples_that_stop_send_a_probe_back_to_the_best_count_known() {
    let mut t = Tuner::new(from_history(8, 1, 16, 1), Duration::ZERO);
    let mut now = 0;
    while t.cores() >= 8 && now < 600 {
        feed(&mut t, now, 1, |_| 80.0, false);
        now += 1;
    }
    let probe = t.cores();
    assert!(probe < 8, "{}", describe(t.history()));
    let mut actions = Vec::new();
    for _ in 0..10 * 60 {
        now += 1;
        actions.push(t.step(Duration::from_secs(now), &[], false));
    }
    assert_eq!(t.cores(), 8, "last: {:?}", actions.last());
    assert!(t.stalled());
    assert_eq!(
        actions.last(),
        Some(&TunerAction::Hold(HoldReason::NoSamples))
    );
    assert_eq!(
        actions
            .iter()
            .filter(|a| **a == TunerAction::Resize(8))
            .count(),
        1
    );
    // Samples again: the probe is made again and measured afresh.
    assert_eq!(
        t.step(Duration::from_secs(now + 1), &[80.0], false),
        TunerAction::Resize(probe)
    );
    assert!(!t.stalled());
    feed(&mut t, now + 1, 400, |_| 80.0, false);
    assert!(
        t.settled().is_some() || t.history().len() > 1,
        "{}",
        describe(t.history())
    );
}

/// Finding 1 (review at cc00f65): the most cores a job can have changes as other jobs come.
/// A probe is never sized beyond it; one made before it shrank is cut to it and measured
/// there, not judged on samples taken at another count; a count above it starts over there.
#[test]
fn a_probe_beyond_the_cores_the_job_can_have_is_cut_to_them() {
    let util = |c: u32| (10.0 * f64::from(c)).min(100.0);
    // Limited before the first probe: the step up from 40 % stops at 6.
    let mut t = Tuner::new(settings(4, 1, 14, 1), Duration::ZERO);
    assert!(t.limit_max(6, Duration::ZERO));
    assert!(!t.limit_max(6, Duration::ZERO), "nothing new");
    assert_eq!(t.cores(), 4);
    let actions = feed(&mut t, 0, 91, util, false);
    assert!(actions.contains(&TunerAction::Resize(6)), "{actions:?}");
    feed(&mut t, 91, 300, util, false);
    assert_eq!(t.settled(), Some(6), "{}", describe(t.history()));

    // Limited after the probe to 14 began: cut to 6, measured there, settled there.
    let mut t = Tuner::new(settings(4, 1, 14, 1), Duration::ZERO);
    let actions = feed(&mut t, 0, 91, util, false);
    assert!(actions.contains(&TunerAction::Resize(14)), "{actions:?}");
    assert!(t.limit_max(6, Duration::from_secs(91)));
    assert_eq!(t.cores(), 6);
    feed(&mut t, 91, 300, util, false);
    assert_eq!(t.settled(), Some(6), "{}", describe(t.history()));
    let judged: Vec<u32> = t.history().iter().map(|p| p.cores).collect();
    assert_eq!(judged, [4, 6], "{}", describe(t.history()));

    // A baseline above the ceiling starts over at it.
    let mut t = Tuner::new(settings(8, 1, 14, 1), Duration::ZERO);
    feed(&mut t, 0, 40, util, false);
    assert!(t.limit_max(5, Duration::from_secs(40)));
    assert_eq!((t.cores(), t.recommendation()), (5, 5));
    feed(&mut t, 40, 120, util, false);
    assert_eq!(t.history()[0].cores, 5, "{}", describe(t.history()));

    // A settled tuner keeps its count.
    let mut t = Tuner::new(settings(4, 1, 14, 1), Duration::ZERO);
    t.stop();
    assert!(!t.limit_max(2, Duration::ZERO));
    assert_eq!(t.cores(), 4);
}

/// The state file keeps the search, not the samples of the window under way: a tuner read
/// back is the same on disk, starts that window again at its next step (judging a whole
/// window, not part of one), and ends where the original does.
#[test]
fn tuner_round_trips_through_json_mid_search() {
    let util = |c: u32| 90.0 * f64::from(c.min(5)) / 5.0;
    let mut t = Tuner::new(settings(9, 1, 16, 0), Duration::ZERO);
    feed(&mut t, 0, 170, util, false);
    let json = serde_json::to_value(&t).unwrap();
    assert!(
        json["phase"]["Measuring"].is_object() && json["phase"]["Measuring"]["samples"].is_null(),
        "{json}"
    );
    let mut back: Tuner = serde_json::from_value(json).unwrap();
    assert!(back.same_on_disk(&t));
    assert_ne!(back, t, "the window's samples stay in memory");
    let judged = t.history().len();
    let a = feed(&mut t, 170, 1200, util, false);
    let b = feed(&mut back, 170, 1200, util, false);
    let first_decision = |actions: &[TunerAction]| {
        actions
            .iter()
            .position(|a| *a != TunerAction::Wait)
            .unwrap()
    };
    assert!(first_decision(&a) < first_decision(&b), "{a:?}\n{b:?}");
    assert!(
        back.history()[judged].samples >= 60,
        "{}",
        describe(back.history())
    );
    assert_eq!(t.settled(), Some(5), "{}", describe(t.history()));
    assert_eq!(back.settled(), Some(5), "{}", describe(back.history()));
}

#[test]
fn a_restored_tuner_missing_its_reference_starts_over() {
    let util = |c: u32| 90.0 * f64::from(c.min(5)) / 5.0;
    let mut t = Tuner::new(settings(9, 1, 16, 0), Duration::ZERO);
    feed(&mut t, 0, 100, util, false);
    assert_eq!(t.history().len(), 1);
    let mut json = serde_json::to_value(&t).unwrap();
    json["measured"] = serde_json::json!([]);
    let mut t: Tuner = serde_json::from_value(json).unwrap();
    // The restored window starts again at 101 and is judged at 161.
    feed(&mut t, 100, 61, util, false);
    assert_eq!(t.history().len(), 2, "{}", describe(t.history()));
    assert_eq!(t.history().last().unwrap().decision, Decision::Baseline);
    feed(&mut t, 161, 900, util, false);
    assert_eq!(t.settled(), Some(5), "{}", describe(t.history()));
}

/// What a sensing pass changes inside a window (its samples) is not a change on disk; a
/// window's start and its judgement are.
#[test]
fn only_decisions_change_a_tuner_on_disk() {
    let util = |c: u32| 90.0 * f64::from(c.min(5)) / 5.0;
    let mut t = Tuner::new(settings(9, 1, 16, 0), Duration::ZERO);
    let mut changes = Vec::new();
    let mut unsure = Vec::new();
    for s in 1..=300u64 {
        let before = t.clone();
        if !t.step_keeps_disk(Duration::from_secs(s), false) {
            unsure.push(s);
        }
        feed(&mut t, s - 1, 1, util, false);
        if !t.same_on_disk(&before) {
            changes.push(s);
        }
    }
    // `step_keeps_disk` is false exactly where a step changed what is written: a copy is kept
    // only for the steps that need one.
    assert_eq!(unsure, changes);
    // The warm-up ends at 30 (the baseline window starts), the baseline is judged at 90
    // and each probe's window a minute later: nothing in between.
    assert_eq!(
        changes,
        [30, 90, 150, 210, 270],
        "{}",
        describe(t.history())
    );
}

/// The inference from the curve's shape (`Tuner::infer`): a job whose utilization is
/// proportional to its cores up to a knee (Amdahl's law with a parallel fraction near 1) is
/// known too few at every count below the knee once one starved window and the plateau are
/// measured: the search never probes below the knee (but one core, the tolerance of the
/// inference's rounding) after that. Without noise (the windows' spread is the feed's
/// alternation only).
#[test]
fn one_starved_window_and_the_plateau_place_the_knee() {
    struct Case {
        knee: u32,
        start: u32,
        history: bool,
        max_probes: usize,
    }
    let cases = [
        // From history above the knee: smaller (starved), then the knee itself.
        Case {
            knee: 10,
            start: 12,
            history: true,
            max_probes: 3,
        },
        Case {
            knee: 6,
            start: 7,
            history: true,
            max_probes: 3,
        },
        // A guess below the knee: larger (the plateau, sized from the start's level), then
        // bisection from one core below the knee, known from the start's window alone.
        Case {
            knee: 12,
            start: 3,
            history: false,
            max_probes: 5,
        },
        Case {
            knee: 20,
            start: 5,
            history: false,
            max_probes: 5,
        },
    ];
    for c in cases {
        let knee = c.knee;
        let util = move |n: u32| 95.0 * f64::from(n.min(knee)) / f64::from(knee);
        let s = TunerSettings {
            from_history: c.history,
            ..settings(c.start, 1, 32, 0)
        };
        let mut t = Tuner::new(s, Duration::ZERO);
        feed(&mut t, 0, 3600, util, false);
        let name = format!("knee {knee} from {}", c.start);
        assert_eq!(t.settled(), Some(knee), "{name}: {}", describe(t.history()));
        assert!(
            t.probes() <= c.max_probes,
            "{name}: {}",
            describe(t.history())
        );
        let first_too_few = t
            .history()
            .iter()
            .position(|p| {
                matches!(
                    p.decision,
                    Decision::Starved { .. } | Decision::Better { .. }
                )
            })
            .expect("a count found too few");
        let later_below = t.history()[first_too_few + 1..]
            .iter()
            .filter(|p| p.cores + 1 < knee)
            .count();
        assert_eq!(later_below, 0, "{name}: {}", describe(t.history()));
    }
}

/// A state file written before `from_history` existed loads, as a guessed start.
#[test]
fn settings_without_from_history_load() {
    let s = settings(4, 1, 8, 1);
    let mut json = serde_json::to_value(&s).unwrap();
    json.as_object_mut().unwrap().remove("from_history");
    json.as_object_mut().unwrap().remove("gpus");
    let back: TunerSettings = serde_json::from_value(json).unwrap();
    assert_eq!(back, s);
    assert!(!back.from_history);
    assert_eq!(back.gpus, 0);
}

/// From the owner's history (§V-B-1: an owner submits similar jobs; the benchmark models that as
/// knees within 2 cores per GPU of the owner's typical one, a spread the paper does not give)
/// the first probe is 2 cores per GPU below the start when the GPUs are known; else the
/// shorter step from the start alone.
#[test]
fn a_history_start_first_steps_two_cores_per_gpu() {
    let first_probe = |gpus| {
        let s = TunerSettings {
            gpus,
            ..from_history(24, 4, 96, 1)
        };
        let mut t = Tuner::new(s, Duration::ZERO);
        feed(&mut t, 0, 90, |_| 80.0, false)
            .into_iter()
            .find_map(|a| match a {
                TunerAction::Resize(n) => Some(n),
                _ => None,
            })
    };
    assert_eq!(first_probe(4), Some(16));
    assert_eq!(first_probe(0), Some(21));
}

#[test]
fn decisions_read_well() {
    let d = Decision::Starved {
        than: 8,
        threshold: 1.234,
    };
    assert_eq!(d.to_string(), "starved: lower than at 8 by more than 1.23");
    assert_eq!(
        TunerAction::Hold(HoldReason::TooFewSamples { have: 2, need: 6 }).to_string(),
        "hold: 2 GPU utilization samples in the window, 6 needed"
    );
    assert_eq!(TunerAction::Settle(3).to_string(), "settle at 3");
}

// -----------------------------------------------------------------------------------------
// Tuning: modelled jobs.

/// Outcome figures over many seeded jobs.
struct Tally {
    jobs: usize,
    probes: usize,
    within_one: usize,
}

impl Tally {
    fn mean_probes(&self) -> f64 {
        self.probes as f64 / self.jobs as f64
    }

    fn share_within_one(&self) -> f64 {
        self.within_one as f64 / self.jobs as f64
    }
}

fn tally(
    jobs: impl Iterator<Item = (Curve, u32, CoreLimits)>,
    tolerance: u32,
    history: bool,
) -> Tally {
    let mut t = Tally {
        jobs: 0,
        probes: 0,
        within_one: 0,
    };
    for (i, (curve, start, limits)) in jobs.enumerate() {
        let s = TunerSettings {
            from_history: history,
            ..settings(start, limits.floor, limits.max, tolerance)
        };
        let r = run(&curve, s, i as u64, &never);
        let best = curve.knee().clamp(limits.floor, limits.max);
        t.jobs += 1;
        t.probes += r.probes;
        t.within_one += usize::from(r.settled.abs_diff(best) <= 1);
    }
    t
}

fn limits_for(curve: &Curve) -> CoreLimits {
    CoreLimits {
        floor: curve.gpus,
        max: 24 * curve.gpus,
    }
}

fn random_curve(rng: &mut Rng, knee_per_gpu: u32) -> Curve {
    let gpus = [1, 1, 1, 2, 4][rng.int(0, 4) as usize];
    Curve {
        gpus,
        knee_per_gpu,
        parallel: rng.uniform(0.85, 0.99),
        peak: rng.uniform(70.0, 100.0),
        drop_above: if rng.unit() < 0.5 {
            0.0
        } else {
            rng.uniform(0.0, 0.3)
        },
        sigma: rng.uniform(0.5, 5.0),
        rho: rng.uniform(0.0, 0.6),
    }
}

/// The paper's model types (Table I: CV, NLP and SPEECH models, trained 1N1G to 1N4G)
/// starting from the category defaults of §V-B-1, which SODA drew from these models
/// (§IV-B): best-fit counts around the default of their category (2–6 cores per GPU for
/// CV, 3–8 for NLP and SPEECH; the figure with the measured counts, Fig. 6, is not in the
/// text). SODA finds each best count within 4 profiling steps (Table V); lodger, on average,
/// within 3 (issue 21's target; 2.65 here), within one core.
#[test]
fn paper_model_types_settle_within_one_core_in_three_probes_on_average() {
    let mut rng = Rng::scrambled(2023);
    let jobs: Vec<(Curve, u32, CoreLimits)> = (0..400)
        .map(|i| {
            let (category, knees) = match i % 8 {
                0..=3 => (Category::Cv, (2, 6)),
                4 | 5 => (Category::Nlp, (3, 8)),
                _ => (Category::Speech, (3, 8)),
            };
            let knee = rng.int(knees.0, knees.1);
            let curve = random_curve(&mut rng, knee);
            let limits = limits_for(&curve);
            let start = start_cores(
                &OwnerHistory::new(),
                1000,
                category,
                1,
                curve.gpus,
                StartHints::default(),
                limits,
            );
            (curve, start, limits)
        })
        .collect();
    let t = tally(jobs.into_iter(), DEFAULT_TOLERANCE, false);
    assert!(t.mean_probes() <= 3.0, "{:.2} probes", t.mean_probes());
    assert!(
        t.share_within_one() >= 0.9,
        "{:.3} within ±1",
        t.share_within_one()
    );
}

/// SODA §V-B-1's premise: an owner's jobs are alike, so the owner's history puts the start
/// near the best count (here within 2 cores per GPU of it, over knees of 1–16 per GPU), and
/// the search tries fewer cores first. 2.83 probes here (the previous search, larger steps
/// first, needed 3.3 in the benchmark; issue 21's target of 2 is not met).
#[test]
fn a_start_from_history_settles_within_one_core_in_three_probes_on_average() {
    let mut rng = Rng::scrambled(17);
    let jobs: Vec<(Curve, u32, CoreLimits)> = (0..400)
        .map(|_| {
            let knee = rng.int(1, 16);
            let curve = random_curve(&mut rng, knee);
            let limits = limits_for(&curve);
            let per_gpu = (knee + rng.int(0, 4)).saturating_sub(2).max(1);
            (curve, limits.clamp(per_gpu * curve.gpus), limits)
        })
        .collect();
    let t = tally(jobs.into_iter(), DEFAULT_TOLERANCE, true);
    assert!(t.mean_probes() <= 3.0, "{:.2} probes", t.mean_probes());
    assert!(
        t.share_within_one() >= 0.9,
        "{:.3} within ±1",
        t.share_within_one()
    );
}

/// No prior at all: knees of 1–16 per GPU, starts anywhere. More probes, but still close.
/// (The search now tries more cores first from such a start, and 4.4 probes here against 5.5
/// before; one comparison more on the way up lets noise mislead it a little more often: 87 %
/// within one core, 88 % before.)
#[test]
fn an_uninformed_start_still_settles_close() {
    let mut rng = Rng::scrambled(99);
    let jobs: Vec<(Curve, u32, CoreLimits)> = (0..300)
        .map(|_| {
            let knee = rng.int(1, 16);
            let curve = random_curve(&mut rng, knee);
            let limits = limits_for(&curve);
            let start = rng.int(limits.floor, limits.max);
            (curve, start, limits)
        })
        .collect();
    let t = tally(jobs.into_iter(), DEFAULT_TOLERANCE, false);
    assert!(t.mean_probes() <= 4.5, "{:.2} probes", t.mean_probes());
    assert!(
        t.share_within_one() >= 0.85,
        "{:.3} within ±1",
        t.share_within_one()
    );
}

// -----------------------------------------------------------------------------------------
// Tuning: properties.

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the curve, the limits and the throttles: the job stays within its floor and
    /// max, no probe starts while a throttle is active (checked in `run`), the search
    /// ends, in a bounded number of windows, at a count it measured or between two it measured
    /// (where the fitted curve places the knee, see `fit::settle_count`).
    #[test]
    fn tuning_invariants(
        curve in curve_strategy(1..=16),
        start_raw in 1u32..64,
        floor_raw in 1u32..8,
        max_raw in 1u32..96,
        tolerance in 0u32..3,
        history in any::<bool>(),
        throttle_mask in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let max = max_raw.max(1);
        let floor = floor_raw.min(max);
        // Throttles switch on and off by the minute, after the first hour clear.
        let throttled = move |s: u64| {
            let minute = s / 60;
            minute < 64 && throttle_mask & (1 << minute) != 0
        };
        let s = TunerSettings {
            from_history: history,
            ..settings(start_raw, floor, max, tolerance)
        };
        let r = run(&curve, s, seed, &throttled);
        prop_assert!((floor..=max).contains(&r.settled));
        let judged = || r.history.iter().filter(|p| p.decision != Decision::Interrupted);
        let measured = judged().any(|p| p.cores == r.settled)
            || (judged().any(|p| p.cores < r.settled) && judged().any(|p| p.cores > r.settled));
        prop_assert!(measured, "settled outside the counts measured: {}", describe(&r.history));
        let span = f64::from(max - floor + 2);
        let bound = 3 * (span.log2().ceil() as usize) + 4;
        prop_assert!(r.windows <= bound, "{} windows > {bound}: {}", r.windows, describe(&r.history));
    }

    /// A signal with no dependence on cores, only noise: the tuner does not wander. It
    /// ends within a few windows (logarithmic in the span of counts), not on a count shown
    /// to be starved, and above the start only after a measured rise: a higher count that
    /// measured better (`Better`), or a lower one that measured worse than a higher one
    /// (`Starved`; autocorrelated noise can do that, about once in 50,000 cases). (That it gives the
    /// cores back is a statistical claim, over many seeds: `noise_only_ends_at_the_floor`.)
    #[test]
    fn noise_only_settles_without_wandering(
        peak in 5.0f64..100.0,
        sigma in 0.5f64..5.0,
        rho in 0.0f64..0.6,
        start_raw in 1u32..48,
        seed in any::<u64>(),
    ) {
        let (floor, max) = (1, 48);
        let start = start_raw.clamp(floor, max);
        let r = run(&Curve::flat(peak, sigma, rho), settings(start, floor, max, 1), seed, &never);
        let span = f64::from(max - floor + 2).log2().ceil() as usize;
        prop_assert!(r.windows <= 2 * span + 2, "{}", describe(&r.history));
        let starved = r.history.iter().any(|p| {
            p.cores == r.settled && matches!(p.decision, Decision::Starved { .. })
        });
        prop_assert!(!starved, "{}", describe(&r.history));
        if r.settled > start {
            let rose = r
                .history
                .iter()
                .any(|p| matches!(p.decision, Decision::Better { .. } | Decision::Starved { .. }));
            prop_assert!(rose, "{}", describe(&r.history));
        }
    }
}

/// Noise only, over many seeds: the tuner nearly always gives back every core it can. From a
/// guessed start it first tries more cores, one comparison more than a search that goes down
/// first, and each comparison has a 2.5 % chance of a false rise at the 95 % threshold: 175 of
/// 200 here (the previous search: at least 180).
#[test]
fn noise_only_ends_at_the_floor() {
    let mut rng = Rng::scrambled(5);
    let mut at_floor = 0;
    let runs = 200;
    for i in 0..runs {
        let curve = Curve::flat(
            rng.uniform(30.0, 100.0),
            rng.uniform(0.5, 5.0),
            rng.uniform(0.0, 0.6),
        );
        let start = rng.int(1, 32);
        let r = run(&curve, settings(start, 1, 48, 1), i, &never);
        at_floor += usize::from(r.settled <= 1 + DEFAULT_TOLERANCE);
    }
    assert!(
        at_floor * 100 >= runs as usize * 85,
        "{at_floor}/{runs} at the floor"
    );
}
