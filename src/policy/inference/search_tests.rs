//! Tests of the online layout search (Cloud Reamer §III-B, issue 21): its rungs, trend, probes
//! against the simulated models, persistence, and its properties.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;

use super::search::{classify, sample_of, Sample};
use super::sim::*;
use super::tests::layout;
use super::*;

#[test]
fn ladder_keeps_free_cores_used() {
    let s = LayoutSearch::new(32, 100.0, 8, 64);
    let cores: Vec<u32> = s.ladder(1).iter().map(|r| r.0).collect();
    assert_eq!(cores, [1, 2, 3, 4, 5, 6, 8, 10, 16, 32]);
    assert!(s.ladder(1).iter().all(|&(c, n)| n == 32 / c));
    let cores: Vec<u32> = s.ladder(5).iter().map(|r| r.0).collect();
    assert_eq!(cores, [5, 6, 8, 10, 16, 32]);
    // At most 3 instances.
    let s = LayoutSearch::new(32, 100.0, 8, 3);
    assert_eq!(s.ladder(1), [(10, 3), (16, 2), (32, 1)]);
}

fn sample(ipc: Option<f64>, miss: Option<f64>) -> Sample {
    Sample {
        throughput: 1.0,
        p99: 1.0,
        ipc,
        miss,
        windows: 1,
        n: 0,
        p50: None,
    }
}

#[test]
fn trend_table() {
    use BatchTrend::*;
    let cases = [
        (
            "rising IPC, stable misses",
            (1.0, 0.05),
            (1.5, 0.05),
            ComputeBound,
        ),
        (
            "rising IPC, stable high misses",
            (1.0, 0.41),
            (1.5, 0.43),
            ComputeBound,
        ),
        ("falling IPC", (1.0, 0.05), (0.8, 0.05), CacheBound),
        (
            "rising misses (Fig. 5 ResNet101)",
            (1.0, 0.10),
            (1.05, 0.25),
            CacheBound,
        ),
        (
            "rising IPC and misses",
            (1.0, 0.10),
            (1.5, 0.25),
            CacheBound,
        ),
        ("flat", (1.0, 0.10), (1.03, 0.11), Unknown),
    ];
    for (name, (ia, ma), (ib, mb), want) in cases {
        let got = classify(&sample(Some(ia), Some(ma)), &sample(Some(ib), Some(mb)));
        assert_eq!(got, want, "{name}");
    }
    assert_eq!(classify(&sample(None, None), &sample(None, None)), Unknown);
    assert_eq!(
        classify(&sample(Some(1.0), None), &sample(Some(1.5), None)),
        ComputeBound,
        "misses not counted: rising IPC alone"
    );
    assert_eq!(
        classify(&sample(None, Some(0.1)), &sample(None, Some(0.3))),
        CacheBound
    );
}

/// What `model` measures for layout `c`, without noise: its true p99 from a great many batches,
/// so only the window-drift floor of the uncertainty remains.
fn measure(model: &PerfModel, c: LayoutConfig) -> ProbeResult {
    let t = model.truth(&c);
    ProbeResult {
        config: c,
        throughput_per_s: t.throughput,
        p99_latency_ms: t.p99,
        ipc: model.counters.then_some(t.ipc),
        cache_miss_ratio: model.counters.then_some(t.miss),
        latency_samples: 1_000_000,
        p50_latency_ms: Some(t.mean_ms),
    }
}

/// Drives a search with a noiseless model; returns the probes asked and the outcome.
fn run_model(model: &PerfModel, search: LayoutSearch) -> (Vec<LayoutConfig>, SearchOutcome) {
    let mut search = search;
    let mut asked = Vec::new();
    let mut last = None;
    loop {
        match search.next(last.take()) {
            SearchStep::Probe(c) => {
                asked.push(c);
                last = Some(measure(model, c));
            }
            SearchStep::Done(o) => return (asked, o),
        }
    }
}

/// A search's rungs, as `LayoutSearch::ladder(1)` gives them.
fn rungs(model: &PerfModel) -> Vec<(u32, u32)> {
    search_for(model).ladder(1)
}

/// A tight SLO: the first probe (4 CPUs per instance, batch 1) is judged over it, and every
/// probe, over the SLO or not, feeds the surrogate; no batch at or past a miss on the same rung
/// is asked for again, and the result is a measured layout within the SLO.
#[test]
fn probes_over_the_slo_still_guide_the_search() {
    let model = PerfModel {
        slo_ms: 21.0,
        ..SMALL_CACHE
    };
    let (asked, out) = run_model(&model, search_for(&model));
    let ladder = rungs(&model);
    assert_eq!(asked[0], layout(4, 8, 1), "4 CPUs per instance at batch 1");
    assert!(asked
        .iter()
        .all(|c| ladder.contains(&(c.cores_per_instance, c.instances))));
    // Judged over: the noiseless p99 with the 3 % drift floor at the default confidence.
    let over =
        |c: &LayoutConfig| model.truth(c).p99 * (DEFAULT_CONFIDENCE_Z * 0.03).exp() > model.slo_ms;
    assert!(over(&asked[0]), "the first probe misses");
    for (i, miss) in asked.iter().enumerate().filter(|(_, c)| over(c)) {
        for later in &asked[i + 1..] {
            let same_rung = (later.cores_per_instance, later.instances)
                == (miss.cores_per_instance, miss.instances);
            assert!(
                !same_rung || later.batch < miss.batch,
                "{later} after {miss}"
            );
        }
    }
    assert!(out.meets_slo);
    assert!(!over(&out.config));
    assert!(asked.contains(&out.config), "a measured layout");
    assert!(out.measured.unwrap().p99_latency_ms <= 21.0);
}

/// Issue 21: a cache-bound model (Fig. 5's ResNet101: misses rising with the batch on the first
/// rung) gets its third probe on the rung with twice the cores per instance, at the geometric
/// middle of the first two batches; a compute-bound one does not (its third probe is the
/// surrogate's pick).
#[test]
fn a_cache_bound_models_third_probe_is_a_larger_instance_at_the_middle_batch() {
    let model = SMALL_CACHE;
    let (asked, out) = run_model(&model, search_for(&model));
    assert_eq!(asked[0], layout(4, 8, 1));
    let second = asked[1];
    assert_eq!((second.cores_per_instance, second.instances), (4, 8));
    let (first, second) = (measure(&model, asked[0]), measure(&model, second));
    let trend = classify(&sample_of(&first), &sample_of(&second));
    assert_eq!(
        trend,
        BatchTrend::CacheBound,
        "misses rise on the first rung"
    );
    let middle = (f64::from(asked[1].batch)).sqrt().round() as u32;
    assert_eq!(asked[2], layout(8, 4, middle));
    assert!(out.meets_slo);

    // Fig. 5's DeepSpeech: weights and batch fit a 4-CPU instance's cache share.
    let model = PerfModel {
        weights_mb: 2.0,
        ..COMPUTE_BOUND
    };
    let (asked, _) = run_model(&model, search_for(&model));
    let trend = classify(
        &sample_of(&measure(&model, asked[0])),
        &sample_of(&measure(&model, asked[1])),
    );
    assert_eq!(trend, BatchTrend::ComputeBound);
    let middle = (f64::from(asked[1].batch)).sqrt().round() as u32;
    assert_ne!(asked[2], layout(8, 4, middle), "no cache probe");
}

/// Issue 21 (session 35): a cache-bound model whose SLO does not bind, measured without noise.
/// On the first rung (14 × 4 CPUs) batch 16 beats batch 1, but throughput peaks at batch 7,
/// where the working set still fits the instance's cache, within 3 % of the exhaustive best.
/// The single best fit has no knee there; one of the fits that explain the probes about as well
/// has, and the search hopes for it, measures the peak and ends within 5 % of the best. (With
/// the best fit alone it ended on 4 × 14 CPUs at batch 16, 29 % below, never asking for it.)
#[test]
fn a_throughput_peak_between_two_measured_batches_is_measured() {
    let model = PerfModel {
        name: "cache peak",
        free: 56,
        slo_ms: 1170.0,
        max_batch: 16,
        max_instances: 56,
        item_ms: 42.0,
        batch_ms: 15.0,
        serial: 0.11,
        b0: 3.0,
        ipc_fall: 0.0,
        weights_mb: 2.14,
        act_mb: 0.566,
        miss_penalty: 1.08,
        bandwidth: 0.85,
        lat_sigma: 0.24,
        window_noise: 0.046,
        window_s: 1.0,
        ..SMALL_CACHE
    };
    let best = model.exhaustive().unwrap();
    let peak = model.truth(&layout(4, 14, 7)).throughput;
    assert!(peak > best.throughput * 0.97, "the peak is near the best");
    assert!(model.truth(&layout(4, 14, 16)).throughput > model.truth(&layout(4, 14, 1)).throughput);
    let (asked, out) = run_model(&model, search_for(&model));
    assert_eq!(&asked[..2], &[layout(4, 14, 1), layout(4, 14, 16)]);
    assert!(
        asked
            .iter()
            .any(|c| (c.cores_per_instance, c.instances) == (4, 14) && (5..=10).contains(&c.batch)),
        "{asked:?}"
    );
    let got = model.truth(&out.config).throughput;
    assert!(
        got > best.throughput * 0.95,
        "{} at {got:.0} against {} at {:.0}",
        out.config,
        best.config,
        best.throughput
    );
}

/// Issue 21's layout benchmark, seed 1363 (mixed family), noiseless: after three probes the best
/// fit has every layout that could beat the best measured just over the SLO, while a fit that
/// explains the probes about as well has 10 × 2 CPUs at batch 1 within it. With budget left
/// the search measures it (the exhaustive best) rather than ending on 6 × 3 CPUs, 31 % below.
#[test]
fn with_budget_left_a_layout_a_plausible_fit_holds_within_the_slo_is_measured() {
    let model = PerfModel {
        name: "mixed",
        free: 20,
        slo_ms: 5.17,
        max_batch: 32,
        max_instances: 20,
        item_ms: 3.52,
        batch_ms: 1.617,
        serial: 0.171,
        b0: 0.0487,
        ipc_fall: 0.0049,
        cache_per_core_mb: 1.5,
        weights_mb: 0.684,
        act_mb: 0.927,
        miss_penalty: 2.36,
        bandwidth: 0.684,
        lat_sigma: 0.114,
        window_noise: 0.021,
        counter_noise: 0.03,
        window_s: 1.0,
        counters: false,
    };
    let best = model.exhaustive().unwrap();
    assert_eq!(best.config, layout(2, 10, 1));
    let (asked, out) = run_model(&model, search_for(&model));
    assert!(asked.len() < DEFAULT_PROBE_BUDGET as usize, "{asked:?}");
    assert!(asked.contains(&layout(2, 10, 1)), "{asked:?}");
    assert_eq!(out.config, best.config, "{asked:?}");
}

/// Issue 21's layout benchmark, seed 966 (cache-bound), noiseless: 16 free CPUs, an SLO far
/// above the batches that fit the cache. On the first rung (4 × 4 CPUs) batch 16 is past the
/// knee (its misses rose) and slower than batch 1; the search ends on batch 4, the exhaustive
/// best, with budget left (since session 41 it measures it fifth; before, after batches 3 and
/// 5). Before the misses placed the knee it ended 20 % below; without counters it still ends
/// on batch 3 after eight probes.
#[test]
fn cache_misses_place_the_knee_the_search_measures_before() {
    let model = PerfModel {
        name: "cache-bound",
        free: 16,
        slo_ms: 61.82,
        max_batch: 16,
        max_instances: 16,
        item_ms: 2.535,
        batch_ms: 0.2922,
        serial: 0.2394,
        b0: 1.717,
        weights_mb: 1.862,
        act_mb: 0.928,
        miss_penalty: 2.494,
        bandwidth: 0.671,
        lat_sigma: 0.1535,
        window_noise: 0.0114,
        window_s: 1.0,
        ..SMALL_CACHE
    };
    let best = model.exhaustive().unwrap();
    assert_eq!(best.config, layout(4, 4, 4));
    let (asked, out) = run_model(&model, search_for(&model));
    assert!(asked.len() < DEFAULT_PROBE_BUDGET as usize, "{asked:?}");
    assert_eq!(out.config, best.config, "{asked:?}");
}

/// Issue 21: the last probe of a cache-bound search steps the best layout's batch by one
/// towards its instances' cache edge: down when its misses have risen, up when they have not.
/// With a budget of four (the first probe, the larger batch, the larger instances' probe, the
/// step), seed 470's model ends its third probe best at 2 × 7 CPUs, batch 11, past the edge
/// (misses risen): the step measures batch 10; seed 1862's at 2 × 9 CPUs, batch 6, before it:
/// the step measures batch 7. At the default budget both searches end on the exhaustive best
/// (before the surrogate's per-batch work, session 41, the step was what brought each there
/// from one batch off, 11.7 and 10.4 % below it; now the search measures the best before).
#[test]
fn a_cache_bound_searchs_last_probe_steps_the_best_batch_towards_the_cache_edge() {
    let up = PerfModel {
        name: "cache-bound",
        free: 14,
        slo_ms: 136.3,
        max_batch: 128,
        max_instances: 14,
        item_ms: 13.62,
        batch_ms: 2.223,
        serial: 0.2006,
        b0: 3.388,
        weights_mb: 3.0,
        act_mb: 1.467,
        miss_penalty: 2.623,
        bandwidth: 0.4287,
        lat_sigma: 0.1811,
        window_noise: 0.04366,
        ..SMALL_CACHE
    };
    let down = PerfModel {
        free: 18,
        slo_ms: 144.3,
        max_instances: 18,
        item_ms: 19.65,
        batch_ms: 7.004,
        serial: 0.1634,
        b0: 3.899,
        weights_mb: 0.997,
        act_mb: 1.532,
        miss_penalty: 1.825,
        bandwidth: 0.9015,
        lat_sigma: 0.2157,
        window_noise: 0.04981,
        ..up
    };
    for (model, third, step, best) in [
        (up, layout(7, 2, 11), layout(7, 2, 10), layout(7, 2, 5)),
        (down, layout(9, 2, 6), layout(9, 2, 7), layout(6, 3, 5)),
    ] {
        let four = SearchOptions {
            probe_budget: 4,
            ..SearchOptions::default()
        };
        let (asked, _) = run_model(&model, search_for(&model).with_options(four));
        assert_eq!(asked.len(), 4, "{asked:?}");
        assert_eq!(asked[2], third, "{asked:?}");
        assert_eq!(asked[3], step, "{asked:?}");
        assert_eq!(model.exhaustive().unwrap().config, best);
        let (asked, out) = run_model(&model, search_for(&model));
        assert_eq!(out.config, best, "{asked:?}");
    }
}

/// Issue 21: a search about to end on a layout one window measured just within the SLO (its
/// bound above 90 % of it) measures it once more, and judges it on both windows. On 2 CPUs with a
/// 25 ms SLO, 1 × 2 CPUs at batch 64 serves the most but measures 23 ms in its first window;
/// every other layout serves less, well within. When the second window measures 30 ms, the
/// two together are over and the search ends elsewhere, within the SLO; when it measures 23 ms
/// again, it ends there. (Two of 70 real runs of the lodgers benchmark ended on such a first
/// window, and that layout measured 27 and 35 ms again.)
#[test]
fn a_layout_just_within_the_slo_is_measured_again_before_it_is_chosen() {
    let edge = layout(2, 1, 64);
    for (again, chosen_there) in [(30.0, false), (23.0, true)] {
        let mut search = LayoutSearch::new(2, 25.0, 64, 2).with_options(SearchOptions {
            probe_budget: 30,
            ..SearchOptions::default()
        });
        let mut windows_of_edge = 0;
        let mut last = None;
        let outcome = loop {
            match search.next(last.take()) {
                SearchStep::Probe(c) => {
                    let (throughput, p99) = if c == edge {
                        windows_of_edge += 1;
                        (3000.0, if windows_of_edge == 1 { 23.0 } else { again })
                    } else {
                        let items = f64::from(c.batch * c.instances);
                        (1000.0 + items, 2.0 + 0.1 * f64::from(c.batch))
                    };
                    last = Some(ProbeResult {
                        config: c,
                        throughput_per_s: throughput,
                        p99_latency_ms: p99,
                        ipc: None,
                        cache_miss_ratio: None,
                        latency_samples: 45,
                        p50_latency_ms: Some(p99 / 1.1),
                    });
                }
                SearchStep::Done(o) => break o,
            }
        };
        assert_eq!(windows_of_edge, 2, "{outcome:?}");
        assert!(outcome.meets_slo, "{outcome:?}");
        assert_eq!(outcome.config == edge, chosen_there, "{outcome:?}");
    }
}

/// Issue 17: a search read back from the state file after every probe (a lodgerd restarted at
/// each one) asks the same probes and ends at the same outcome as one never interrupted.
#[test]
fn a_search_resumes_from_json_where_it_stopped() {
    let model = PerfModel {
        slo_ms: 21.0,
        ..SMALL_CACHE
    };
    let (asked, outcome) = run_model(&model, search_for(&model));
    let mut search = search_for(&model);
    let mut resumed = Vec::new();
    let mut last = None;
    let end = loop {
        let text = serde_json::to_string(&search).expect("serialize");
        search = serde_json::from_str(&text).expect("read back");
        match search.next(last.take()) {
            SearchStep::Probe(c) => {
                resumed.push(c);
                last = Some(measure(&model, c));
            }
            SearchStep::Done(o) => break o,
        }
    };
    assert_eq!(resumed, asked);
    assert_eq!(end, outcome);
}

/// Issue 21: state files written before probes reported their batch count and median load, and
/// their probes are judged with the assumed count (not as certain).
#[test]
fn searches_persisted_before_sample_counts_load() {
    let old_probe = r#"{"config":{"cores_per_instance":4,"instances":2,"batch":1},
        "throughput_per_s":100.0,"p99_latency_ms":80.0,"ipc":null,"cache_miss_ratio":null}"#;
    let p: ProbeResult = serde_json::from_str(old_probe).unwrap();
    assert_eq!((p.latency_samples, p.p50_latency_ms), (0, None));
    let mut s = LayoutSearch::new(8, 100.0, 16, 8);
    let mut json = serde_json::to_value(&s).unwrap();
    json["options"]
        .as_object_mut()
        .unwrap()
        .remove("confidence_z");
    s = serde_json::from_value(json).unwrap();
    assert_eq!(s.next(None), SearchStep::Probe(layout(4, 2, 1)));
    // 80 ms from an unknown number of batches is not safely within 100 ms: the rung is over
    // the SLO even at batch 1, so the search looks at larger instances.
    let SearchStep::Probe(next) = s.next(Some(p.clone())) else {
        panic!("asks for a probe")
    };
    assert!(next.cores_per_instance > 4, "judged over the SLO: {next}");
    let mut sure = LayoutSearch::new(8, 100.0, 16, 8);
    sure.next(None);
    let certain = ProbeResult {
        latency_samples: 1_000_000,
        p50_latency_ms: Some(75.0),
        ..p
    };
    // The same p99 from a million batches: within it, so the search looks at larger batches.
    assert!(matches!(sure.next(Some(certain)), SearchStep::Probe(c) if c.batch > 1));
}

/// The trend compares the smallest and largest batch measured on one rung. (The
/// compute-bound preset is left out: at 4 CPUs per instance its weights overflow the cache
/// share at large batches, so the rung the search measures twice is cache-bound there.)
#[test]
fn trend_is_classified_from_two_batches_of_a_rung() {
    for (model, want) in [
        (SMALL_CACHE, BatchTrend::CacheBound),
        (
            PerfModel {
                counters: false,
                ..BALANCED
            },
            BatchTrend::Unknown,
        ),
    ] {
        let (asked, out) = run_model(&model, search_for(&model));
        let t = out.traits.unwrap();
        assert_eq!(t.trend, want, "{}", model.name);
        let first = asked[0];
        assert!(
            asked.iter().any(|c| (c.cores_per_instance, c.instances)
                == (first.cores_per_instance, first.instances)
                && c.batch > first.batch),
            "{}",
            model.name
        );
    }
}

#[test]
fn no_layout_meets_the_slo() {
    let model = PerfModel {
        slo_ms: 1.0,
        ..BALANCED
    };
    let (asked, out) = run_model(&model, search_for(&model));
    // Every probe is a rung at batch 1, growing to the whole machine as one instance.
    assert!(asked.iter().all(|c| c.batch == 1));
    assert!(asked
        .windows(2)
        .all(|w| w[0].cores_per_instance < w[1].cores_per_instance));
    assert_eq!(asked.last(), Some(&layout(32, 1, 1)));
    assert!(!out.meets_slo);
    assert_eq!(out.traits, None);
    assert_eq!(out.config, layout(32, 1, 1), "the lowest latency measured");
}

#[test]
fn budget_bounds_the_probes() {
    for budget in [1, 3, 5, 8, 12] {
        let options = SearchOptions {
            probe_budget: budget,
            ..SearchOptions::default()
        };
        let (asked, out) = run_model(&BALANCED, search_for(&BALANCED).with_options(options));
        assert!(asked.len() <= budget as usize, "budget {budget}");
        assert_eq!(out.probes as usize, asked.len());
        assert!(
            out.meets_slo,
            "budget {budget}: the first probe already meets it"
        );
    }
}

#[test]
fn failed_probes_and_odd_results() {
    let mut s = LayoutSearch::new(8, 100.0, 16, 8);
    let SearchStep::Probe(first) = s.next(None) else {
        panic!("asks for a probe")
    };
    assert_eq!(first, layout(4, 2, 1));
    // The caller could not measure it: counted as failed, the search grows the instances.
    let SearchStep::Probe(second) = s.next(None) else {
        panic!("asks for a probe")
    };
    assert_eq!(second, layout(8, 1, 1));
    assert_eq!(s.probes_used(), 1);
    // A result for a layout outside the space is counted but ignored; the pending probe is
    // asked again.
    let bogus = ProbeResult {
        config: layout(4, 4, 1),
        throughput_per_s: 1e9,
        p99_latency_ms: 0.0,
        ipc: None,
        cache_miss_ratio: None,
        latency_samples: 10,
        p50_latency_ms: None,
    };
    assert_eq!(s.next(Some(bogus)), SearchStep::Probe(layout(8, 1, 1)));
    assert_eq!(s.probes_used(), 2);
    // NaN latency never meets the SLO: nothing measured, nothing larger to try.
    let nan = ProbeResult {
        config: layout(8, 1, 1),
        throughput_per_s: f64::NAN,
        p99_latency_ms: f64::NAN,
        ipc: Some(f64::NAN),
        cache_miss_ratio: None,
        latency_samples: 10,
        p50_latency_ms: Some(f64::NAN),
    };
    let SearchStep::Done(out) = s.next(Some(nan)) else {
        panic!("nothing left to try")
    };
    assert!(!out.meets_slo);
    assert_eq!(out.probes, 3);
}

#[test]
fn zero_free_cores_ends_at_once() {
    let mut s = LayoutSearch::new(0, 100.0, 16, 8);
    let SearchStep::Done(out) = s.next(None) else {
        panic!("nothing to search")
    };
    assert!(!out.meets_slo);
    assert_eq!(out.config.instances, 0);
    assert_eq!(out.probes, 0);
    assert_eq!(s.next(None), SearchStep::Done(out), "done stays done");
}

/// The simulated family (issue 21): no search over its budget, and over a hundred noisy seeds
/// no chosen layout whose true p99 misses the SLO by more than the window drift. The gap to the
/// exhaustive best is the benchmark's (`cargo bench --bench layout`), not pinned here.
#[test]
fn simulated_family_stays_within_budget_and_slo() {
    let mut over = 0;
    for seed in 0..100u64 {
        let model = PerfModel::random(Family::ALL[(seed % 4) as usize], seed);
        let mut rng = crate::rng::Rng::splitmix(seed);
        let run = run_search(&model, search_for(&model), &mut rng);
        assert!(run.probes <= DEFAULT_PROBE_BUDGET, "seed {seed}");
        let best = model.exhaustive().unwrap();
        assert!(run.truth.throughput <= best.throughput * 1.0001 || run.truth.p99 > model.slo_ms);
        over += u32::from(run.truth.p99 > model.slo_ms * 1.03);
    }
    assert!(over <= 2, "{over} of 100 chosen layouts miss the SLO");
}

/// The benchmark's "gap the rule allows" (`benches/layout.rs`, `rule_gap`): with no margin
/// (`confidence_z` 0) the rule on exact probes accepts exactly the layouts whose true p99 meets
/// the SLO, so its best is the exhaustive best; with the default margin it accepts fewer, never
/// a better one, and on some seeds a worse one.
#[test]
fn the_rule_on_exact_probes_bounds_the_best_layout() {
    let mut below = 0;
    for seed in 0..40u64 {
        let model = PerfModel::random(Family::ALL[(seed % 4) as usize], seed);
        let best = model.exhaustive().unwrap();
        let by = |z: f64| {
            let options = SearchOptions {
                confidence_z: z,
                ..SearchOptions::default()
            };
            let rule = search_for(&model).with_options(options);
            model.best_where(|c, _| rule.judges_within_slo(&model.exact_probe(*c)))
        };
        let plain = by(0.0).unwrap();
        assert_eq!(
            (plain.config, plain.throughput),
            (best.config, best.throughput),
            "seed {seed}"
        );
        let margin = by(DEFAULT_CONFIDENCE_Z).map_or(0.0, |b| b.throughput);
        assert!(margin <= best.throughput, "seed {seed}");
        below += u32::from(margin < best.throughput);
    }
    assert!(below > 0, "the margin never cost a layout");
}

#[test]
fn cache_reuses_results_and_traits() {
    let mut cache = SearchCache::new();
    let (first_asked, out) = run_model(&BALANCED, search_for(&BALANCED));
    cache.insert(out.clone());
    let m = &BALANCED;
    // Same core count: no probe at all.
    match cache.begin(m.free, m.slo_ms, m.max_batch, m.max_instances) {
        SearchStart::Cached(hit) => assert_eq!(hit, out),
        SearchStart::Search(_) => panic!("cache miss"),
    }
    // Another SLO: a full new search.
    assert!(matches!(
        cache.begin(m.free, m.slo_ms / 2.0, m.max_batch, m.max_instances),
        SearchStart::Search(s) if s.hint.is_none()
    ));
    // A training job took 8 CPUs: a new search, starting from the 32-CPU search's best layout.
    let smaller = PerfModel {
        free: 24,
        ..BALANCED
    };
    let SearchStart::Search(search) = cache.begin(24, m.slo_ms, m.max_batch, m.max_instances)
    else {
        panic!("no result for 24 CPUs yet")
    };
    let (asked, out24) = run_model(&smaller, search);
    assert!(asked.iter().all(|c| c.cpus() <= 24));
    assert!(asked[0].cores_per_instance >= out.config.cores_per_instance);
    assert_eq!(
        asked[0].batch, out.config.batch,
        "starts from the best layout"
    );
    assert!(out24.meets_slo);
    assert!(asked.len() < first_asked.len() || asked.len() == DEFAULT_PROBE_BUDGET as usize);
    cache.insert(out24);
    assert_eq!(cache.len(), 2);
    // The training job left again: the 32-CPU result is still there.
    assert!(matches!(
        cache.begin(32, m.slo_ms, m.max_batch, m.max_instances),
        SearchStart::Cached(_)
    ));
    let json = serde_json::to_string(&cache).unwrap();
    let back: SearchCache = serde_json::from_str(&json).unwrap();
    assert_eq!(back.len(), 2);
    assert_eq!(
        back.get(32, m.slo_ms, m.max_batch, m.max_instances)
            .map(|o| o.config),
        cache
            .get(32, m.slo_ms, m.max_batch, m.max_instances)
            .map(|o| o.config)
    );
}

proptest! {
    /// Issue 21: how a probe's p99 is judged. More batches behind the same p99 and median never
    /// turn a probe from within the SLO to over it; a wider spread never does the reverse; the
    /// bound is never below the p99; with z = 0 the p99 is judged as measured.
    #[test]
    fn p99_judged_with_its_uncertainty(
        p99 in 0.1f64..1000.0,
        spread in 1.0f64..4.0,
        n in 1u32..100_000,
        more in 1u32..100_000,
        wider in 1.0f64..2.0,
        slo in 0.1f64..2000.0,
        z in 0.0f64..3.0,
    ) {
        let options = SearchOptions { confidence_z: z, ..SearchOptions::default() };
        let search = LayoutSearch::new(8, slo, 16, 8).with_options(options);
        let at = |n: u32, spread: f64| Sample {
            throughput: 1.0,
            p99,
            ipc: None,
            miss: None,
            windows: 1,
            n,
            p50: Some(p99 / spread),
        };
        let base = at(n, spread);
        prop_assert!(search.upper(&base) >= p99);
        prop_assert!(search.upper(&at(n.saturating_add(more), spread)) <= search.upper(&base));
        prop_assert!(search.upper(&at(n, spread * wider)) >= search.upper(&base));
        if search.feasible(&base) {
            prop_assert!(search.feasible(&at(n.saturating_add(more), spread)));
        }
        let plain = LayoutSearch::new(8, slo, 16, 8)
            .with_options(SearchOptions { confidence_z: 0.0, ..SearchOptions::default() });
        prop_assert_eq!(plain.feasible(&base), p99 <= slo);
    }

    #[test]
    fn search_properties(
        free in 1u32..=48,
        slo_ms in 5.0f64..2000.0,
        max_batch in 1u32..=64,
        max_instances in 1u32..=64,
        serial in 0.0f64..0.5,
        b0 in 0.0f64..8.0,
        act_mb in 0.0f64..3.0,
        weights_mb in 0.0f64..8.0,
        noise in 0.0f64..0.1,
        ipc_fall in 0.0f64..0.3,
        lat_sigma in 0.0f64..0.4,
        window_s in 0.05f64..10.0,
        confidence_z in 0.0f64..3.0,
        counters in any::<bool>(),
        budget in 1u32..=20,
        seed in any::<u64>(),
    ) {
        let model = PerfModel {
            name: "random",
            free,
            slo_ms,
            max_batch,
            max_instances,
            item_ms: 30.0,
            batch_ms: 5.0,
            serial,
            b0,
            ipc_fall,
            cache_per_core_mb: 1.5,
            weights_mb,
            act_mb,
            miss_penalty: 2.0,
            bandwidth: 0.5,
            lat_sigma,
            window_noise: noise,
            counter_noise: noise,
            window_s,
            counters,
        };
        let options = SearchOptions { probe_budget: budget, confidence_z, ..SearchOptions::default() };
        let mut rng = crate::rng::Rng::splitmix(seed);
        let run = run_search(&model, search_for(&model).with_options(options), &mut rng);
        let out = &run.outcome;
        prop_assert!(run.probes <= budget, "{} probes over {}", run.probes, budget);
        let c = out.config;
        prop_assert!(c.cores_per_instance >= 1 && c.instances >= 1, "{}", c);
        prop_assert!(c.cpus() <= free && c.instances <= max_instances, "{}", c);
        prop_assert!(c.batch >= 1 && c.batch <= max_batch, "{}", c);
        let measured = out.measured.as_ref().unwrap();
        prop_assert_eq!(measured.config, c);
        // Within the SLO means with the uncertainty: never a measured p99 over it, and at
        // least the drift floor's margin when judged with any confidence.
        if out.meets_slo {
            let margin = (confidence_z * 0.03).exp();
            prop_assert!(measured.p99_latency_ms * margin <= slo_ms * (1.0 + 1e-9),
                "{} ms with z {}", measured.p99_latency_ms, confidence_z);
        }
        if let Some(t) = out.traits {
            prop_assert!(t.min_cores_per_instance <= c.cores_per_instance || !out.meets_slo
                || c.instances == 1);
        }
    }
}
