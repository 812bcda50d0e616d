//! Lodgers benchmark part (a), training's slowdown beside an offline instance (see
//! `benches/lodgers.rs` for the whole and its method).

use super::*;

pub(super) fn scenario_a(b: &mut Bench, d: &Daemon) -> Vec<(String, String)> {
    #[derive(Clone, Copy, PartialEq)]
    enum Arr {
        Alone,
        AloneRr,
        Default,
        Lodger,
    }
    let arrs = [
        (Arr::Alone, "alone (SCHED_OTHER, CPU 1)"),
        (Arr::AloneRr, "alone (SCHED_RR 10, CPU 1)"),
        (
            Arr::Default,
            "+ offline instance, default scheduling (both SCHED_OTHER, CPU 1)",
        ),
        (
            Arr::Lodger,
            "+ offline instance, lodger (lodgerd: training SCHED_RR on CPU 1, instance SCHED_OTHER there)",
        ),
    ];
    let mut iter: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut infer: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    let mut others: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut notes: BTreeMap<usize, String> = BTreeMap::new();
    for round in 1..=b.rounds {
        for k in order(arrs.len(), round) {
            let (arr, name) = arrs[k];
            // (iteration ms, offline items/s and CPU share, other tenants' share of CPU 1)
            let label = format!("(a) round {round}: {name}");
            let ((ms, tp, other), _, note) = guarded(&label, || match arr {
                Arr::Alone | Arr::AloneRr => {
                    let t = b.train(Some(TRAIN_CPU), arr == Arr::AloneRr);
                    let (w, cpu) = window_cpu(&[&t], WARMUP, b.window);
                    ((iter_ms(&w[0]), None, cpu.foreign(1, &[0])), cpu)
                }
                Arr::Default => {
                    let inf = b.offline_worker(Some(TRAIN_CPU), MODEL_MIB, 1, OFFLINE_BATCH);
                    let t = b.train(Some(TRAIN_CPU), false);
                    let (w, cpu) = window_cpu(&[&t, &inf], WARMUP, b.window);
                    (
                        (
                            iter_ms(&w[0]),
                            Some((items_per_s(&w[1], b.window), cpu.ours[1])),
                            cpu.foreign(1, &[0, 1]),
                        ),
                        cpu,
                    )
                }
                Arr::Lodger => {
                    let t = b.train(None, false);
                    let (train_id, cpus) = register_training(d, &t);
                    assert_eq!(cpus, TRAIN_CPU, "lodgerd placed training elsewhere");
                    let off = register_offline(d, 1);
                    let job = d.job(&off);
                    let inst = &running(&job)[0];
                    assert_eq!(
                        inst["cpus"].as_str(),
                        Some(TRAIN_CPU),
                        "offline instance not on the training CPU"
                    );
                    let inst_pid = inst["pid"].as_u64().expect("pid") as u32;
                    std::thread::sleep(WARMUP);
                    let a = mark(&[&t]);
                    let meter = Meter::start(&[t.pid(), inst_pid]);
                    let tp = sampled_items_per_s(d, &off, b.window);
                    let cpu = meter.stop();
                    let z = mark(&[&t]);
                    let w = between(&[&t], &a, &z);
                    d.ctl_ok(&["unregister", &off]);
                    d.ctl_ok(&["unregister", &train_id]);
                    (
                        (
                            iter_ms(&w[0]),
                            Some((tp, cpu.ours[1])),
                            cpu.foreign(1, &[0, 1]),
                        ),
                        cpu,
                    )
                }
            });
            println!(
                "{label}: mean iteration {ms:.2} ms{}; other tenants took {:.0}% of CPU 1{note}",
                tp.map(|(t, c)| format!(
                    ", offline instance {t:.0} items/s on {:.0}% of CPU 1",
                    c * 100.0
                ))
                .unwrap_or_default(),
                other * 100.0
            );
            notes.entry(k).or_default().push_str(&note);
            iter.entry(k).or_default().push(ms);
            others.entry(k).or_default().push(other);
            if let Some((t, c)) = tp {
                infer.entry(k).or_default().push((t, c));
            }
        }
    }
    let alone = mean(&iter[&0]);
    let alone_rr = mean(&iter[&1]);
    let slow = |k: usize, base: f64| (mean(&iter[&k]) / base - 1.0) * 100.0;
    let mut rows = Vec::new();
    for (k, (_, name)) in arrs.iter().enumerate() {
        let per_round: Vec<String> = iter[&k].iter().map(|v| format!("{v:.2}")).collect();
        let offline = infer
            .get(&k)
            .map(|v| {
                let t: Vec<f64> = v.iter().map(|x| x.0).collect();
                let c: Vec<f64> = v.iter().map(|x| x.1).collect();
                format!(
                    "; offline instance {:.0} items/s on {:.0}% of CPU 1",
                    mean(&t),
                    mean(&c) * 100.0
                )
            })
            .unwrap_or_default();
        let summary = format!(
            "{:.2} ms ({}); {:+.1}% vs alone, {:+.1}% vs alone RR{offline}; other tenants {:.0}% of CPU 1{}",
            mean(&iter[&k]),
            per_round.join(" / "),
            slow(k, alone),
            slow(k, alone_rr),
            mean(&others[&k]) * 100.0,
            notes.get(&k).map(String::as_str).unwrap_or("")
        );
        println!("(a) {name}: {summary}");
        rows.push((format!("(a) training iteration: {name}"), summary));
    }
    let line = format!(
        "slowdown vs alone: default scheduling {:+.1}%, lodger {:+.1}% (vs alone RR: {:+.1}% and {:+.1}%); iteration time default / lodger {:.2}x; paper Fig. 11: +81% vs +3.2%",
        slow(2, alone),
        slow(3, alone),
        slow(2, alone_rr),
        slow(3, alone_rr),
        mean(&iter[&2]) / mean(&iter[&3]),
    );
    println!("(a) {line}");
    rows.push(("(a) ratio".into(), line));
    rows
}
