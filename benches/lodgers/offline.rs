//! Lodgers benchmark part (c), offline throughput: many small instances against one large one (see
//! `benches/lodgers.rs` for the whole and its method).

use super::*;

pub(super) fn scenario_c(b: &mut Bench, d: &Daemon) -> Vec<(String, String)> {
    let t = b.train(None, false);
    let (train_id, tcpu) = register_training(d, &t);
    println!("(c) training placed by lodgerd on CPU {tcpu}, SCHED_RR 10");
    let arrs = [
        format!("lodger's layout run by lodgerd (2 x 1 thread, batch {OFFLINE_BATCH}; lodgerd's sampled items/s)"),
        format!("lodger's layout by hand (2 x 1 thread on CPUs 0 and 1, batch {OFFLINE_BATCH})"),
        format!("one large instance (2 threads on CPUs 0-1, batch {OFFLINE_BATCH})"),
        format!("one large instance (2 threads on CPUs 0-1, batch {})", 2 * OFFLINE_BATCH),
    ];
    let mut tp: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut train: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut notes: BTreeMap<usize, String> = BTreeMap::new();
    for round in 1..=b.rounds {
        for k in order(arrs.len(), round) {
            let name = &arrs[k];
            let label = format!("(c) round {round}: {name}");
            let ((items, ms), _, note) = guarded(&label, || match k {
                0 => {
                    let off = register_offline(d, 2);
                    let job = d.job(&off);
                    let on_training = running(&job)
                        .iter()
                        .filter(|i| i["cpus"] == tcpu.as_str() && i["threads"] == 1)
                        .count();
                    assert_eq!(
                        on_training, 1,
                        "no single-thread instance on the training CPU"
                    );
                    std::thread::sleep(WARMUP);
                    let a = mark(&[&t]);
                    let meter = Meter::start(&[]);
                    let items = sampled_items_per_s(d, &off, b.window);
                    let cpu = meter.stop();
                    let z = mark(&[&t]);
                    let w = between(&[&t], &a, &z);
                    d.ctl_ok(&["unregister", &off]);
                    ((items, iter_ms(&w[0])), cpu)
                }
                1 => {
                    let i0 = b.offline_worker(Some("0"), MODEL_MIB, 1, OFFLINE_BATCH);
                    let i1 = b.offline_worker(Some("1"), MODEL_MIB, 1, OFFLINE_BATCH);
                    let (w, cpu) = window_cpu(&[&i0, &i1, &t], WARMUP, b.window);
                    let items = items_per_s(&w[0], b.window) + items_per_s(&w[1], b.window);
                    ((items, iter_ms(&w[2])), cpu)
                }
                _ => {
                    let batch = if k == 2 {
                        OFFLINE_BATCH
                    } else {
                        2 * OFFLINE_BATCH
                    };
                    let big = b.offline_worker(Some("0-1"), MODEL_MIB, 2, batch);
                    let (w, cpu) = window_cpu(&[&big, &t], WARMUP, b.window);
                    ((items_per_s(&w[0], b.window), iter_ms(&w[1])), cpu)
                }
            });
            notes.entry(k).or_default().push_str(&note);
            println!("{label}: {items:.0} items/s; training iteration {ms:.2} ms{note}");
            tp.entry(k).or_default().push(items);
            train.entry(k).or_default().push(ms);
        }
    }
    d.ctl_ok(&["unregister", &train_id]);
    drop(t);
    let mut rows = Vec::new();
    for (k, name) in arrs.iter().enumerate() {
        let rounds: Vec<String> = tp[&k].iter().map(|v| format!("{v:.0}")).collect();
        let summary = format!(
            "{:.0} items/s ({}); training iteration {:.2} ms{}",
            mean(&tp[&k]),
            rounds.join(" / "),
            mean(&train[&k]),
            notes.get(&k).map(String::as_str).unwrap_or("")
        );
        println!("(c) {name}: {summary}");
        rows.push((format!("(c) offline throughput: {name}"), summary));
    }
    let line = format!(
        "lodger's layout / one large instance: {:.2}x (batch {OFFLINE_BATCH}), {:.2}x (large at batch {}); lodgerd-run layout / large: {:.2}x",
        mean(&tp[&1]) / mean(&tp[&2]),
        mean(&tp[&1]) / mean(&tp[&3]),
        2 * OFFLINE_BATCH,
        mean(&tp[&0]) / mean(&tp[&2]),
    );
    println!("(c) {line}");
    rows.push(("(c) ratio".into(), line));
    rows
}
