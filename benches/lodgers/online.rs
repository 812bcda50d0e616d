//! Lodgers benchmark part (b), online latency (see `benches/lodgers.rs` for the whole and its
//! method).

use super::*;

pub(super) fn scenario_b(b: &mut Bench, d: &Daemon) -> Vec<(String, String)> {
    let arrs = [
        "alone (CPU 0)",
        "shared (training and online on CPU 1, SCHED_OTHER)",
        "no consolidation (both free on CPUs 0-1, SCHED_OTHER)",
        "lodger (training SCHED_RR on CPU 1 by lodgerd, online on CPU 0)",
        "consolidated without RR (training SCHED_OTHER pinned to CPU 1, online on CPU 0)",
    ];
    let mut lat: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut p99s: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut train: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut others: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for round in 1..=b.rounds {
        for k in order(arrs.len(), round) {
            let name = arrs[k];
            // Other tenants' CPU use: per CPU where the workloads are pinned, else in all.
            let per_cpu = |cpu: &CpuUse, on0: &[usize], on1: &[usize]| {
                format!(
                    "CPU 0 {:.0}%, CPU 1 {:.0}%",
                    cpu.foreign(0, on0) * 100.0,
                    cpu.foreign(1, on1) * 100.0
                )
            };
            // The online worker's run-queue wait: the time it was ready but not running.
            let wait = |cpu: &CpuUse, n: usize| {
                let (ms, slices) = cpu.waits[0];
                format!(
                    "; online worker waited for a CPU {:.2} ms per request ({:.0} us per timeslice)",
                    ms / n.max(1) as f64,
                    ms * 1e3 / slices.max(1) as f64
                )
            };
            // (latencies, training ms), CpuUse, and the measured processes pinned to CPU 0 and
            // CPU 1 (None: not pinned).
            type Pins = Option<(Vec<usize>, Vec<usize>)>;
            let label = format!("(b) round {round}: {name}");
            let ((l, t, pins), cpu, note): ((Vec<f64>, Option<f64>, Pins), CpuUse, String) =
                guarded(&label, || match k {
                    0 => {
                        let on = b.online_worker(Some(OTHER_CPU));
                        let (w, cpu) = window_cpu(&[&on], WARMUP, b.window);
                        ((latencies(&w[0]), None, Some((vec![0], vec![]))), cpu)
                    }
                    1 => {
                        let t = b.train(Some(TRAIN_CPU), false);
                        let on = b.online_worker(Some(TRAIN_CPU));
                        let (w, cpu) = window_cpu(&[&on, &t], WARMUP, b.window);
                        let r = (
                            latencies(&w[0]),
                            Some(iter_ms(&w[1])),
                            Some((vec![], vec![0, 1])),
                        );
                        (r, cpu)
                    }
                    2 => {
                        let t = b.train(None, false);
                        let on = b.online_worker(None);
                        let (w, cpu) = window_cpu(&[&on, &t], WARMUP, b.window);
                        ((latencies(&w[0]), Some(iter_ms(&w[1])), None), cpu)
                    }
                    4 => {
                        let t = b.train(Some(TRAIN_CPU), false);
                        let on = b.online_worker(Some(OTHER_CPU));
                        let (w, cpu) = window_cpu(&[&on, &t], WARMUP, b.window);
                        let r = (
                            latencies(&w[0]),
                            Some(iter_ms(&w[1])),
                            Some((vec![0], vec![1])),
                        );
                        (r, cpu)
                    }
                    _ => {
                        let t = b.train(None, false);
                        let (train_id, cpus) = register_training(d, &t);
                        assert_eq!(cpus, TRAIN_CPU, "lodgerd placed training elsewhere");
                        let on = b.online_worker(Some(OTHER_CPU));
                        let (w, cpu) = window_cpu(&[&on, &t], WARMUP, b.window);
                        d.ctl_ok(&["unregister", &train_id]);
                        let r = (
                            latencies(&w[0]),
                            Some(iter_ms(&w[1])),
                            Some((vec![0], vec![1])),
                        );
                        (r, cpu)
                    }
                });
            let other = match pins {
                Some((on0, on1)) => per_cpu(&cpu, &on0, &on1),
                None => format!("{:.0}% of a CPU in all", cpu.foreign_total() * 100.0),
            } + &wait(&cpu, l.len())
                + &note;
            println!(
                "{label}: {} requests, p50 {:.3} ms p99 {:.3} ms stddev {:.3} ms max {:.2} ms{}; other tenants: {other}",
                l.len(),
                percentile(&l, 0.5),
                percentile(&l, 0.99),
                stddev(&l),
                percentile(&l, 1.0),
                t.map(|t| format!("; training iteration {t:.2} ms"))
                    .unwrap_or_default()
            );
            others.entry(k).or_default().push(other);
            p99s.entry(k).or_default().push(percentile(&l, 0.99));
            lat.entry(k).or_default().extend(l);
            if let Some(t) = t {
                train.entry(k).or_default().push(t);
            }
        }
    }
    let sd_alone = stddev(&lat[&0]);
    let mut rows = Vec::new();
    for (k, name) in arrs.iter().enumerate() {
        let l = &lat[&k];
        let rounds: Vec<String> = p99s[&k].iter().map(|v| format!("{v:.2}")).collect();
        let summary = format!(
            "{} requests: p50 {:.3} ms, p99 {:.3} ms (rounds: {}), stddev {:.3} ms ({:.1}x alone), max {:.2} ms{}; other tenants: {}",
            l.len(),
            percentile(l, 0.5),
            percentile(l, 0.99),
            rounds.join(" / "),
            stddev(l),
            stddev(l) / sd_alone,
            percentile(l, 1.0),
            train
                .get(&k)
                .map(|t| format!("; training iteration {:.2} ms", mean(t)))
                .unwrap_or_default(),
            others[&k].join(" / ")
        );
        println!("(b) {name}: {summary}");
        rows.push((format!("(b) online latency: {name}"), summary));
    }
    let sd = |k: usize| stddev(&lat[&k]);
    let p99 = |k: usize| percentile(&lat[&k], 0.99);
    let line = format!(
        "stddev shared / lodger {:.1}x, no consolidation / lodger {:.1}x, lodger / alone {:.1}x; p99 shared / lodger {:.1}x, no consolidation / lodger {:.1}x, lodger / alone {:.1}x",
        sd(1) / sd(3),
        sd(2) / sd(3),
        sd(3) / sd(0),
        p99(1) / p99(3),
        p99(2) / p99(3),
        p99(3) / p99(0),
    );
    println!("(b) {line}");
    rows.push(("(b) ratios".into(), line));
    rows
}
