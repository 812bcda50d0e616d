//! Layout-search benchmark (`cargo bench --bench layout`, about a minute and a half): the online
//! layout search (Cloud Reamer §III-B, `policy::inference::LayoutSearch`) against the exhaustive
//! best on the simulated model family of `policy::inference::sim` (issue 21 item 3).
//!
//! Seeds F..F+N (`LAYOUT_BENCH_FIRST_SEED`, default 0; `LAYOUT_BENCH_SEEDS`, default 2,000)
//! each draw one model: seed mod 4 picks the family (compute-bound: IPC rising with batch,
//! misses flat; falling IPC; cache-bound: misses rising with batch; mixed), every other
//! parameter is drawn from the seed, on a leftover of 8–192 CPUs. A change found on the default
//! seeds is checked on others (`LAYOUT_BENCH_FIRST_SEED=2000 LAYOUT_BENCH_SEEDS=4000`): the
//! p95 moves by about half a point from one set of 2,000 seeds to another. Probes are noisy as
//! lodgerd's are: a 1- or 10-s window of batches, the p99 of every instance's batch latencies
//! pooled, a window-wide speed factor, noisy counters.
//!
//! Printed per family and over all seeds, for the current search (default options) and the
//! baseline (the search before issue 21, `layout/baseline.rs`, 12 probes) on the same models and
//! noise seeds:
//! - gap: how far the chosen layout's true throughput falls short of the exhaustive best (the
//!   highest true throughput among layouts whose true p99 meets the SLO), in percent; a chosen
//!   layout whose true p99 misses the SLO counts as 100 %;
//! - probes used (mean, p95);
//! - SLO violations on re-measurement: the share of searches whose chosen layout's true p99 is
//!   over the SLO, and the share whose fresh probe (one more noisy window) measures over it.
//!
//! Targets (issue 21): at most 8 probes, p95 gap ≤ 3 %, violations on re-measurement < 5 %; the
//! summary says which the current search meets, and beside them the p95 gap the SLO rule alone
//! leaves any search (`rule_gap`: the best layout the rule accepts when every layout is probed
//! exactly) and the same over only the rungs each search probed (`probed_rungs_gap`: how much of
//! the gap is the batch on rungs it measured rather than rungs it never measured), and the p95
//! gap of the best layout each search measured, by its truth (`measured_gap`: what the search's
//! probes found, before its final choice from noisy windows). Searches whose choice falls more
//! than a point below that layout are counted by why (`Choice`): the rule refuses that layout
//! even measured exactly, its measured p99 was judged over, or its measured throughput ranked
//! below the chosen one's.
//!
//! Beside them, the same search handed the exhaustive best as its first probe (`with_traits`, its
//! batch trend unknown) on the same noise: what choosing from noisy windows under the SLO rule
//! leaves once exploration has nothing left to find (its p95 gap and fresh probes over the SLO).
//!
//! And what the two targets leave a search that knew every layout's true throughput
//! and p99 (`layout/oracle.rs`): the p95 gap it reaches while fewer than 5 % of its layouts
//! measure over the SLO on a fresh probe. `LAYOUT_BENCH_Z=Z` runs the search (and the rule
//! bounds) with `confidence_z` Z instead of the default, to see what the rule's margin costs;
//! `LAYOUT_BENCH_BUDGET=N` with a probe budget of N instead of 8, to see what more probes buy.
//!
//! Also printed: the wall time of a search step (`LayoutSearch::next`: the surrogate's fit and
//! the candidates) on the seeds with 128–192 free CPUs, p50 and p95; lodgerd takes one step per
//! probe window.
//!
//! `LAYOUT_BENCH_NOISELESS=1` measures every probe of both searches noise-free (each figure the
//! layout's truth, `sim::PerfModel::noiseless_probe`; the fresh probe after the search stays
//! noisy): what is left of the gap is where the search probes, not the window noise.
//!
//! `LAYOUT_BENCH_DUMP=FILE` also writes one tab-separated line per seed (its family, the
//! current search's gap, the two rule bounds and the measured gap above, the gap of the search
//! started on the best, probes, the chosen and the best layout): where a change's tail comes
//! from, read per seed.

#[path = "layout/baseline.rs"]
mod baseline;
#[path = "layout/oracle.rs"]
mod oracle;

use lodger::policy::inference::sim::{run_with, search_for, Family, PerfModel, Probes};
use lodger::policy::inference::{
    BatchTrend, LayoutConfig, LayoutSearch, ModelTraits, ProbeResult, SearchOptions,
};
use lodger::rng::Rng;

/// Targets of issue 21.
const TARGET_PROBES: f64 = 8.0;
const TARGET_P95_GAP: f64 = 3.0;
const TARGET_VIOLATIONS: f64 = 5.0;

#[derive(Default)]
struct Tally {
    gaps: Vec<f64>,
    probes: Vec<f64>,
    true_violations: u32,
    fresh_violations: u32,
    said_no: u32,
}

impl Tally {
    fn n(&self) -> usize {
        self.gaps.len()
    }

    fn pct(&self, count: u32) -> f64 {
        f64::from(count) * 100.0 / self.n().max(1) as f64
    }

    fn row(&self) -> String {
        format!(
            "{:>6.2} {:>6.2} {:>6.1} | {:>5.2} {:>4.0} | {:>5.1} {:>5.1}",
            quantile(&self.gaps, 0.5),
            quantile(&self.gaps, 0.95),
            quantile(&self.gaps, 1.0),
            mean(&self.probes),
            quantile(&self.probes, 0.95),
            self.pct(self.true_violations),
            self.pct(self.fresh_violations),
        )
    }

    fn extend(&mut self, other: &Tally) {
        self.gaps.extend_from_slice(&other.gaps);
        self.probes.extend_from_slice(&other.probes);
        self.true_violations += other.true_violations;
        self.fresh_violations += other.fresh_violations;
        self.said_no += other.said_no;
    }
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

/// The `q` quantile (nearest rank).
fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Records one finished search against `model`'s exhaustive best.
fn record(
    t: &mut Tally,
    model: &PerfModel,
    best_tp: f64,
    run: &lodger::policy::inference::sim::SimRun,
    rng: &mut Rng,
) {
    let violates = run.truth.p99 > model.slo_ms;
    let gap = if violates {
        100.0
    } else {
        (best_tp - run.truth.throughput) / best_tp * 100.0
    };
    t.gaps.push(gap);
    t.probes.push(f64::from(run.probes));
    t.true_violations += u32::from(violates);
    let fresh = model.probe(run.outcome.config, rng);
    t.fresh_violations += u32::from(fresh.p99_latency_ms > model.slo_ms);
    t.said_no += u32::from(!run.outcome.meets_slo);
}

/// What the uncertainty rule alone leaves any search: the gap, in percent, between the
/// exhaustive best and the best layout the search's rule judges within the SLO when every layout
/// is probed exactly (true p99 and median, the window's batch count at the true mean: a probe
/// without the window's noise, but with the rule's margin for the batches it holds). A search
/// ends on a layout the rule accepts, so no search of the same rule does better than this on a
/// model, whatever it knows; 100 when the rule accepts nothing. Only the layouts `keep` holds
/// for count.
fn rule_gap(model: &PerfModel, best: f64, keep: impl Fn(&LayoutConfig) -> bool) -> f64 {
    let rule = tuned(search_for(model));
    model
        .best_where(|c, _| keep(c) && rule.judges_within_slo(&model.exact_probe(*c)))
        .map_or(100.0, |b| (best - b.throughput) / best * 100.0)
}

/// Where the search's gap comes from: [`rule_gap`] over only the rungs (cores per instance with
/// its instance count) the search probed, every batch on them probed exactly. When this is small
/// and the search's gap is not, the search measured the right rungs at the wrong batches; when it
/// is large, it never measured the right rung.
fn probed_rungs_gap(model: &PerfModel, best: f64, probed: &[LayoutConfig]) -> f64 {
    let rung = |c: &LayoutConfig| (c.cores_per_instance, c.instances);
    rule_gap(model, best, |c| probed.iter().any(|p| rung(p) == rung(c)))
}

/// `search` with `LAYOUT_BENCH_Z` as its `confidence_z` and `LAYOUT_BENCH_BUDGET` as its probe
/// budget where they are set (the rule's margin, for the rule and the search alike), else as it
/// is (the default options).
fn tuned(search: LayoutSearch) -> LayoutSearch {
    let z = std::env::var("LAYOUT_BENCH_Z")
        .ok()
        .and_then(|v| v.parse::<f64>().ok());
    let budget = std::env::var("LAYOUT_BENCH_BUDGET")
        .ok()
        .and_then(|v| v.parse::<u32>().ok());
    if z.is_none() && budget.is_none() {
        return search;
    }
    let default = SearchOptions::default();
    search.with_options(SearchOptions {
        confidence_z: z.unwrap_or(default.confidence_z),
        probe_budget: budget.unwrap_or(default.probe_budget),
        ..default
    })
}

/// The best layout among `measured` by its truth: the highest true throughput among those whose
/// true p99 meets the SLO. None when none does.
fn truly_best(model: &PerfModel, measured: &[LayoutConfig]) -> Option<(LayoutConfig, f64)> {
    measured
        .iter()
        .map(|c| (*c, model.truth(c)))
        .filter(|(_, t)| t.p99 <= model.slo_ms)
        .map(|(c, t)| (c, t.throughput))
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// The gap, in percent, of [`truly_best`] among the layouts the search measured: what the
/// probes found, before the search's choice among them from noisy windows. 100 when none it
/// measured is truly within the SLO.
fn measured_gap(model: &PerfModel, best: f64, measured: &[LayoutConfig]) -> f64 {
    truly_best(model, measured).map_or(100.0, |(_, tp)| (best - tp) / best * 100.0)
}

/// Why a search chose a layout more than a point (of the exhaustive best) below the best it
/// measured (by truth).
#[derive(Default)]
struct Choice {
    /// The rule refuses that layout even probed exactly (its margin).
    rule: u32,
    /// Its measured windows were judged over the SLO, though the rule accepts it exactly.
    noisy_p99: u32,
    /// Judged within the SLO, but its measured throughput ranked below the chosen layout's.
    ranked_below: u32,
}

impl Choice {
    /// Counts one search that ended on `chosen` after measuring the windows `results`, judged by
    /// `search`'s rule, against the exhaustive best's throughput `best`. A chosen layout over the
    /// SLO in truth is not counted here (the gap counts it as 100 %).
    fn count(
        &mut self,
        model: &PerfModel,
        best: f64,
        search: &LayoutSearch,
        chosen: &LayoutConfig,
        results: &[ProbeResult],
    ) {
        let measured: Vec<LayoutConfig> = results.iter().map(|r| r.config).collect();
        let Some((better, better_tp)) = truly_best(model, &measured) else {
            return;
        };
        let t_chosen = model.truth(chosen);
        if t_chosen.p99 > model.slo_ms || (better_tp - t_chosen.throughput) / best * 100.0 <= 1.0 {
            return;
        }
        if !search.judges_within_slo(&model.exact_probe(better)) {
            self.rule += 1;
        } else if results
            .iter()
            .any(|r| r.config == better && !search.judges_within_slo(r))
        {
            self.noisy_p99 += 1;
        } else {
            self.ranked_below += 1;
        }
    }
}

fn main() {
    let seeds: u64 = std::env::var("LAYOUT_BENCH_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let first: u64 = std::env::var("LAYOUT_BENCH_FIRST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let started = std::time::Instant::now();
    let mut new = vec![(); 4]
        .into_iter()
        .map(|_| Tally::default())
        .collect::<Vec<_>>();
    let mut old = vec![(); 4]
        .into_iter()
        .map(|_| Tally::default())
        .collect::<Vec<_>>();
    // The current search handed the exhaustive best as its first probe (`with_traits`): what
    // choosing from noisy windows under the SLO rule costs once exploration has nothing to find.
    let mut found = Tally::default();
    let mut no_best = 0;
    // Per seed: how far below the exhaustive best the best layout the search's rule accepts on
    // exact probes lies (see `rule_gap`).
    let mut rule_gaps = Vec::new();
    // Per seed: the same over only the rungs the search probed (see `probed_rungs_gap`).
    let mut probed_gaps = Vec::new();
    let mut measured_gaps = Vec::new();
    let mut choice = Choice::default();
    // Wall time of each `LayoutSearch::next` on leftovers of at least 128 CPUs, ms: what a
    // search step costs the agent's thread once per probe window.
    let mut step_times: Vec<f64> = Vec::new();
    let mut space = 0u64;
    // Per seed: the oracle's lowest fresh-probe risk at each gap threshold (see `oracle`).
    let mut oracle_risks = Vec::new();
    let probes = if std::env::var_os("LAYOUT_BENCH_NOISELESS").is_some_and(|v| v == "1") {
        println!("probes measured noise-free (LAYOUT_BENCH_NOISELESS=1)");
        Probes::Noiseless
    } else {
        Probes::Noisy
    };
    let trace: Option<u64> = std::env::var("LAYOUT_BENCH_TRACE")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut dump = std::env::var_os("LAYOUT_BENCH_DUMP")
        .filter(|p| !p.is_empty())
        .map(|p| {
            let head = "seed\tfamily\tgap\trule_gap\tprobed_rungs_gap\tmeasured_gap\tfound_gap\tprobes\tchosen\tbest\n";
            (p, String::from(head))
        });
    for seed in first..first.saturating_add(seeds) {
        let fi = (seed % 4) as usize;
        let model = PerfModel::random(Family::ALL[fi], seed);
        let Some(best) = model.exhaustive() else {
            no_best += 1;
            continue;
        };
        space += best.space;
        rule_gaps.push(rule_gap(&model, best.throughput, |_| true));
        oracle_risks.push(oracle::lowest_fresh_risk(&model, best.throughput, seed));
        let noise = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x1a40;
        let mut rng = Rng::splitmix(noise);
        let mut search = tuned(search_for(&model));
        // Every window the search measured, in order.
        let mut results: Vec<ProbeResult> = Vec::new();
        let run = run_with(&model, &mut rng, probes, |last| {
            if let (Some(r), true) = (&last, trace == Some(seed)) {
                let t = model.truth(&r.config);
                println!(
                    "probe {}: {:.0}/s p99 {:.2} (n {}) miss {:?}; true {:.0}/s p99 {:.2} miss {:.3}",
                    r.config,
                    r.throughput_per_s,
                    r.p99_latency_ms,
                    r.latency_samples,
                    r.cache_miss_ratio.map(|m| (m * 1000.0).round() / 1000.0),
                    t.throughput,
                    t.p99,
                    t.miss
                );
            }
            results.extend(last.iter().cloned());
            let timer = std::time::Instant::now();
            let step = search.next(last);
            if model.free >= 128 {
                step_times.push(timer.elapsed().as_secs_f64() * 1000.0);
            }
            step
        });
        let probed: Vec<LayoutConfig> = results.iter().map(|r| r.config).collect();
        probed_gaps.push(probed_rungs_gap(&model, best.throughput, &probed));
        measured_gaps.push(measured_gap(&model, best.throughput, &probed));
        choice.count(
            &model,
            best.throughput,
            &search,
            &run.outcome.config,
            &results,
        );
        record(&mut new[fi], &model, best.throughput, &run, &mut rng);
        if trace == Some(seed) {
            println!(
                "{model:?}\nbest {} {:.0} p99 {:.1}\nnew {} {:.0} p99 {:.1} probes {}",
                best.config,
                best.throughput,
                best.p99,
                run.outcome.config,
                run.truth.throughput,
                run.truth.p99,
                run.probes
            );
        }
        // The same search handed the exhaustive best as its first probe, on the same noise.
        let mut rng = Rng::splitmix(noise);
        let mut search = tuned(search_for(&model)).with_traits(ModelTraits {
            min_cores_per_instance: best.config.cores_per_instance,
            trend: BatchTrend::Unknown,
            feasible_batch: best.config.batch,
        });
        let found_run = run_with(&model, &mut rng, probes, |last| search.next(last));
        record(&mut found, &model, best.throughput, &found_run, &mut rng);
        if let Some((_, out)) = dump.as_mut() {
            out.push_str(&format!(
                "{seed}\t{}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{}\t{}\t{}\n",
                model.name,
                new[fi].gaps.last().copied().unwrap_or(f64::NAN),
                rule_gaps.last().copied().unwrap_or(f64::NAN),
                probed_gaps.last().copied().unwrap_or(f64::NAN),
                measured_gaps.last().copied().unwrap_or(f64::NAN),
                found.gaps.last().copied().unwrap_or(f64::NAN),
                run.probes,
                run.outcome.config,
                best.config,
            ));
        }
        let mut rng = Rng::splitmix(noise);
        let mut search = baseline::BaselineSearch::new(
            model.free,
            model.slo_ms,
            model.max_batch,
            model.max_instances,
        );
        let run = run_with(&model, &mut rng, probes, |last| search.next(last));
        record(&mut old[fi], &model, best.throughput, &run, &mut rng);
    }
    let frontier = oracle::frontier(&oracle_risks);
    if let Some((path, out)) = &dump {
        if let Err(e) = std::fs::write(path, out) {
            eprintln!("layout bench: cannot write {}: {e}", path.to_string_lossy());
        }
    }
    println!(
        "layout search benchmark: {seeds} seeds from {first} (seed mod 4 picks the family), 8-192 free CPUs, {:.0} layouts per model on average, {no_best} seeds without a layout within the SLO skipped; {:.1} s",
        space as f64 / (seeds - no_best).max(1) as f64,
        started.elapsed().as_secs_f64()
    );
    println!(
        "{:<15} {:>5} | {:^49} | {:^49}",
        "", "", "current search (default options)", "baseline (before issue 21, 12 probes)"
    );
    let head = format!(
        "{:>6} {:>6} {:>6} | {:>5} {:>4} | {:>5} {:>5}",
        "gap50", "gap95", "worst", "probe", "p95", "viol", "fresh"
    );
    println!("{:<15} {:>5} | {head} | {head}", "family", "seeds");
    let mut all_new = Tally::default();
    let mut all_old = Tally::default();
    for (fi, family) in Family::ALL.iter().enumerate() {
        println!(
            "{:<15} {:>5} | {} | {}",
            family.name(),
            new[fi].n(),
            new[fi].row(),
            old[fi].row()
        );
        all_new.extend(&new[fi]);
        all_old.extend(&old[fi]);
    }
    println!(
        "{:<15} {:>5} | {} | {}",
        "all",
        all_new.n(),
        all_new.row(),
        all_old.row()
    );
    println!("(gap: % below the exhaustive best's true throughput, 100 when the chosen layout's true p99 misses the SLO; probe: mean probes; viol: % of chosen layouts whose true p99 misses the SLO; fresh: % whose one fresh probe measures over it)");
    println!("\nsummary, beside the targets of issue 21:");
    // `goal`: the target as text and whether the current figure meets it (None: no target).
    let line = |what: &str, now: f64, goal: Option<(String, bool)>, base: f64| {
        let (target, met) = match goal {
            Some((t, ok)) => (t, if ok { "met" } else { "**missed**" }),
            None => ("-".to_string(), "-"),
        };
        let base = if base.is_nan() {
            "-".to_string()
        } else {
            format!("{base:.2}")
        };
        println!("| {what} | {now:.2} | {target} | {met} | {base} |");
    };
    let at_most = |now: f64, t: f64| Some((format!("<= {t}"), now <= t));
    let below = |now: f64, t: f64| Some((format!("< {t}"), now < t));
    println!("| figure | current | target | met | baseline |");
    println!("|---|---|---|---|---|");
    let gap95 = quantile(&all_new.gaps, 0.95);
    let probes = mean(&all_new.probes);
    let probes95 = quantile(&all_new.probes, 0.95);
    let true_viol = all_new.pct(all_new.true_violations);
    let fresh_viol = all_new.pct(all_new.fresh_violations);
    line(
        "median gap %",
        quantile(&all_new.gaps, 0.5),
        None,
        quantile(&all_old.gaps, 0.5),
    );
    line(
        "p95 gap %",
        gap95,
        at_most(gap95, TARGET_P95_GAP),
        quantile(&all_old.gaps, 0.95),
    );
    line(
        "p95 gap % the rule allows (its best layout on exact probes)",
        quantile(&rule_gaps, 0.95),
        None,
        f64::NAN,
    );
    line(
        "p95 gap % the rule allows on the rungs the search probed (their best batch)",
        quantile(&probed_gaps, 0.95),
        None,
        f64::NAN,
    );
    line(
        "p95 gap % of the best layout the search measured (by its truth, before the choice)",
        quantile(&measured_gaps, 0.95),
        None,
        f64::NAN,
    );
    line(
        "p95 gap % of the search started on the exhaustive best (exploration solved: the rule and the windows' noise left)",
        quantile(&found.gaps, 0.95),
        None,
        f64::NAN,
    );
    line(
        "fresh probe over the SLO % of the search started on the exhaustive best",
        found.pct(found.fresh_violations),
        None,
        f64::NAN,
    );
    let reach = oracle::GAPS
        .iter()
        .zip(&frontier)
        .find(|(_, v)| **v < TARGET_VIOLATIONS)
        .map_or(f64::NAN, |(g, _)| *g);
    line(
        "p95 gap % an oracle reaches with fresh probes over the SLO < 5 % (true figures, no probes)",
        reach,
        None,
        f64::NAN,
    );
    line(
        "mean probes",
        probes,
        at_most(probes, TARGET_PROBES),
        mean(&all_old.probes),
    );
    line(
        "p95 probes",
        probes95,
        at_most(probes95, TARGET_PROBES),
        quantile(&all_old.probes, 0.95),
    );
    line(
        "true p99 over the SLO %",
        true_viol,
        below(true_viol, TARGET_VIOLATIONS),
        all_old.pct(all_old.true_violations),
    );
    line(
        "fresh probe over the SLO %",
        fresh_viol,
        below(fresh_viol, TARGET_VIOLATIONS),
        all_old.pct(all_old.fresh_violations),
    );
    line(
        "searches ending without a layout judged within the SLO %",
        all_new.pct(all_new.said_no),
        None,
        all_old.pct(all_old.said_no),
    );
    println!(
        "\na search step (`LayoutSearch::next`, wall time on this host) at 128-192 free CPUs: p50 {:.2} ms, p95 {:.2} ms over {} steps (once per probe window of 1-10 s)",
        quantile(&step_times, 0.5),
        quantile(&step_times, 0.95),
        step_times.len()
    );
    println!(
        "\nsearches choosing more than a point below the best layout they measured: {} (the rule refuses it even exactly: {}; its measured p99 judged over: {}; its measured throughput ranked below the chosen's: {})",
        choice.rule + choice.noisy_p99 + choice.ranked_below,
        choice.rule,
        choice.noisy_p99,
        choice.ranked_below
    );
    println!(
        "\nwhat the two targets leave a search that knew every layout's truth (`layout/oracle.rs`):"
    );
    println!("| gap within, on 95 % of seeds | fresh probes over the SLO % |");
    println!("|---|---|");
    for (g, v) in oracle::GAPS.iter().zip(&frontier) {
        println!("| {g:.1} % | {v:.2} |");
    }
}
