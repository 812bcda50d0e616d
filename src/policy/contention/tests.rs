//! Tests of contention elimination: detection, escalation, give-back and the MBA ladder.

use std::collections::BTreeMap;

use super::*;
use crate::job::JobId;
use proptest::prelude::*;

fn id(seq: u64) -> JobId {
    JobId::from_seq(seq)
}

pub(super) fn intel_caps() -> MbaCaps {
    // As tests/fixtures/resctrl/intel-mba-mbm reads.
    MbaCaps {
        unit: MbaUnit::Percent,
        bandwidth_gran: 10,
        min_bandwidth: 10,
        num_closids: 8,
        delay_linear: true,
        default_schemata: BTreeMap::from([(0, 100), (1, 100)]),
    }
}

pub(super) fn amd_caps() -> MbaCaps {
    // As tests/fixtures/resctrl/amd reads.
    MbaCaps {
        unit: MbaUnit::AmdEighthGigabytesPerSecond,
        bandwidth_gran: 1,
        min_bandwidth: 0,
        num_closids: 16,
        delay_linear: false,
        default_schemata: BTreeMap::from([(0, 2048), (1, 2048), (2, 2048), (3, 2048)]),
    }
}

pub(super) fn training(seq: u64) -> JobObservation {
    JobObservation::new(id(seq), Role::Training, 8)
}

pub(super) fn lodger(seq: u64, role: Role, cores: u32, bw: Option<f64>) -> JobObservation {
    let mut j = JobObservation::new(id(seq), role, cores);
    j.membw_bytes_per_s = bw;
    if role == Role::Online {
        j.slo_met = Some(true);
    }
    j
}

fn membw(fraction: f64) -> Option<NodeMembw> {
    Some(NodeMembw {
        bytes_per_s: fraction * 100e9,
        fraction_of_peak: fraction,
        domain_fractions: BTreeMap::new(),
    })
}

pub(super) fn obs(fraction: Option<f64>, jobs: Vec<JobObservation>) -> ContentionObservations {
    ContentionObservations {
        membw: fraction.and_then(membw),
        jobs,
    }
}

pub(super) fn config(pressure: u32, calm: u32) -> ContentionConfig {
    ContentionConfig {
        pressure_ticks: pressure,
        calm_ticks: calm,
        ..ContentionConfig::default()
    }
}

/// Runs `ticks` ticks of the same observations; returns every action.
pub(super) fn run(
    c: &mut ContentionEliminator,
    ticks: u32,
    o: &ContentionObservations,
) -> Vec<ThrottleAction> {
    let mut all = Vec::new();
    for _ in 0..ticks {
        all.extend(c.step(0, o));
    }
    all
}

#[test]
fn default_config_is_soda_and_valid() {
    let c = ContentionConfig::default();
    assert_eq!(c.membw_threshold, 0.75);
    assert_eq!(c.mode, Mode::Enforce);
    c.validate().unwrap();
    let bad = ContentionConfig {
        membw_calm: 0.8,
        ..ContentionConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "membw_calm");
    let bad = ContentionConfig {
        pressure_ticks: 0,
        ..ContentionConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "pressure_ticks");
    let bad = ContentionConfig {
        membw_threshold: f64::NAN,
        ..ContentionConfig::default()
    };
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("membw_threshold"));
    let bad = ContentionConfig {
        max_calm_ticks: 2,
        ..ContentionConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "max_calm_ticks");
    let toml: ContentionConfig =
        toml::from_str("mode = \"advise\"\nmembw_threshold = 0.8\npressure_ticks = 5\n").unwrap();
    assert_eq!(toml.mode, Mode::Advise);
    assert_eq!(toml.pressure_ticks, 5);
    assert_eq!(toml.calm_ticks, 10);
    assert!(toml::from_str::<ContentionConfig>("threshold = 1\n").is_err());
}

#[test]
fn intel_mba_ladder_steps_by_granularity_to_min_bandwidth() {
    let c = ContentionConfig::default();
    let ladder = MbaLadder::new(intel_caps(), &c).unwrap();
    let values: Vec<u32> = (0..=ladder.max_level(0))
        .map(|l| ladder.value(0, l))
        .collect();
    assert_eq!(values, [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]);
    assert_eq!(ladder.max_level(0), 9);
    assert_eq!(ladder.value(0, 50), 10, "never below the floor");

    // A step finer than bandwidth_gran rounds up to it; a coarse floor stops early.
    let mut caps = intel_caps();
    caps.bandwidth_gran = 20;
    caps.min_bandwidth = 20;
    let c = ContentionConfig {
        mba_step_percent: 5,
        mba_floor_percent: 30,
        ..ContentionConfig::default()
    };
    let ladder = MbaLadder::new(caps, &c).unwrap();
    let values: Vec<u32> = (0..=ladder.max_level(1))
        .map(|l| ladder.value(1, l))
        .collect();
    // 30% rounds up to 40 (a multiple of 20).
    assert_eq!(values, [100, 80, 60, 40]);
    for v in values {
        assert_eq!(v % 20, 0);
    }
}

#[test]
fn amd_mba_ladder_is_absolute_per_domain() {
    let mut caps = amd_caps();
    caps.default_schemata.insert(3, 1024);
    let ladder = MbaLadder::new(caps, &ContentionConfig::default()).unwrap();
    let values: Vec<u32> = (0..=ladder.max_level(0))
        .map(|l| ladder.value(0, l))
        .collect();
    assert_eq!(
        values,
        [2048, 1844, 1639, 1434, 1229, 1024, 820, 615, 410, 205]
    );
    // min_bandwidth 0 on AMD: the configured floor keeps a job from being starved.
    assert_eq!(ladder.floor(0), 205);
    assert_eq!(ladder.value(3, 1), 922);
    assert_eq!(ladder.floor(3), 103);
}

#[test]
fn mba_mbps_mount_falls_back_to_cores() {
    let mut caps = intel_caps();
    caps.unit = MbaUnit::MegabytesPerSecond;
    let mut c = ContentionEliminator::new(config(1, 5), Some(caps));
    assert!(c.mba_ladder().is_none());
    let o = obs(
        Some(0.9),
        vec![training(1), lodger(2, Role::Batch, 8, Some(5e9))],
    );
    let a = c.step(0, &o);
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
    assert!(c
        .detection()
        .unwrap()
        .mba_unused
        .as_ref()
        .unwrap()
        .contains("mba_MBps"));
}

#[test]
fn halving_sequence_and_floors() {
    assert_eq!(
        (0..=max_halvings(6, 1))
            .map(|l| halved_cores(6, l, 1))
            .collect::<Vec<_>>(),
        [6, 3, 2, 1]
    );
    assert_eq!(
        (0..=max_halvings(16, 2))
            .map(|l| halved_cores(16, l, 2))
            .collect::<Vec<_>>(),
        [16, 8, 4, 2]
    );
    assert_eq!(max_halvings(1, 1), 0);
    assert_eq!(
        max_halvings(2, 4),
        0,
        "a job at or under the floor is not cut"
    );
    assert_eq!(halved_cores(2, 3, 4), 2);
    assert_eq!(halved_cores(5, 40, 1), 1);
}

#[test]
fn threshold_needs_k_consecutive_ticks_and_the_band_resets_the_run() {
    let mut c = ContentionEliminator::new(config(3, 10), Some(intel_caps()));
    let jobs = vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))];
    let hot = obs(Some(0.80), jobs.clone());
    let band = obs(Some(0.70), jobs.clone());
    assert!(run(&mut c, 2, &hot).is_empty());
    // A tick in the band (between calm 0.60 and threshold 0.75) breaks the run.
    assert!(c.step(0, &band).is_empty());
    assert!(run(&mut c, 2, &hot).is_empty());
    let a = c.step(0, &hot);
    assert_eq!(a.len(), 2, "one action per L3 domain: {a:?}");
    assert_eq!(
        a[0].mechanism,
        Mechanism::Mba {
            group: MbaGroup::Lodgers,
            domain: 0,
            value: 90
        }
    );
    assert_eq!(a[1].level, 1);
    assert!(
        a[0].evidence.contains("80% of peak, threshold 75%"),
        "{}",
        a[0].evidence
    );
    assert!(
        a[0].evidence.contains("j2 (batch 4.00 GB/s)"),
        "{}",
        a[0].evidence
    );
    assert!(a[0].evidence.contains("protecting j1"), "{}", a[0].evidence);
    // Exactly at the threshold counts as pressure.
    assert!(run(&mut c, 2, &obs(Some(0.75), jobs.clone())).is_empty());
    assert_eq!(c.step(0, &obs(Some(0.75), jobs)).len(), 2);
    assert_eq!(
        c.throttles().mba[&MbaGroup::Lodgers],
        BTreeMap::from([(0, 80), (1, 80)])
    );
}

#[test]
fn mba_steps_down_to_min_then_halves_then_online_last() {
    let mut c = ContentionEliminator::new(config(1, 10), Some(intel_caps()));
    let jobs = vec![
        training(1),
        lodger(2, Role::Batch, 4, Some(1e9)),
        lodger(3, Role::Offline, 8, Some(3e9)),
        lodger(4, Role::Online, 2, Some(9e9)),
    ];
    let hot = obs(Some(0.95), jobs.clone());
    for expected in [90, 80, 70, 60, 50, 40, 30, 20, 10] {
        let a = c.step(0, &hot);
        // Two members × two domains.
        assert_eq!(a.len(), 4, "{a:?}");
        assert!(a.iter().all(|x| matches!(
            x.mechanism,
            Mechanism::Mba { group: MbaGroup::Lodgers, value, .. } if value == expected
        )));
    }
    // MBA at min_bandwidth: core halving of the top-ranked lodger (j3 by bandwidth, although
    // the online j4 uses more), until the floor, then the next.
    let cores: Vec<(String, u32)> = (0..5)
        .map(|_| {
            let a = c.step(0, &hot);
            assert_eq!(a.len(), 1, "{a:?}");
            let Mechanism::Cores { count } = a[0].mechanism else {
                panic!("{a:?}")
            };
            (a[0].job.to_string(), count)
        })
        .collect();
    assert_eq!(
        cores,
        [
            ("j3".into(), 4),
            ("j3".into(), 2),
            ("j3".into(), 1),
            ("j2".into(), 2),
            ("j2".into(), 1)
        ]
    );
    // Only now online inference, whose SLO holds.
    let a = c.step(0, &hot);
    assert!(a.iter().all(|x| x.job == id(4)));
    assert!(matches!(
        a[0].mechanism,
        Mechanism::Mba {
            group: MbaGroup::Online,
            value: 90,
            ..
        }
    ));
    let t = c.throttles();
    assert_eq!(t.cores[&id(3)], 1);
    assert!(!t.cores.contains_key(&id(1)));
    assert!(c.detection().unwrap().pressured);
}

#[test]
fn online_is_throttled_only_while_its_slo_holds() {
    let mut c = ContentionEliminator::new(config(1, 10), None);
    let mut online = lodger(4, Role::Online, 4, Some(9e9));
    let hot = |online: &JobObservation| obs(Some(0.9), vec![training(1), online.clone()]);
    // SLO unknown: not throttled.
    online.slo_met = None;
    assert!(c.step(0, &hot(&online)).is_empty());
    assert!(c.detection().unwrap().exhausted);
    online.slo_met = Some(true);
    let a = c.step(0, &hot(&online));
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 2 });
    // The SLO breaks: the step comes back at once, although pressure stays, and no new one.
    online.slo_met = Some(false);
    let a = c.step(0, &hot(&online));
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
    assert!(
        a[0].evidence.contains("SLO of j4 not met"),
        "{}",
        a[0].evidence
    );
    assert_eq!(a[1].mechanism, Mechanism::Release);
    assert!(c.throttles().is_empty());
    assert!(c.step(0, &hot(&online)).is_empty());
}

#[test]
fn gives_back_stepwise_after_calm_and_backs_off_on_relapse() {
    let mut c = ContentionEliminator::new(config(2, 4), Some(intel_caps()));
    let jobs = vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))];
    let hot = obs(Some(0.9), jobs.clone());
    let cool = obs(Some(0.3), jobs.clone());
    run(&mut c, 4, &hot);
    assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 80);
    // Three calm ticks: nothing; the fourth gives one step back.
    assert!(run(&mut c, 3, &cool).is_empty());
    let a = c.step(0, &cool);
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|x| x.level == 1));
    assert!(
        a[0].evidence.contains("calm for 4 ticks"),
        "{}",
        a[0].evidence
    );
    assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 90);
    // Pressure returns at once: a relapse. The step is taken again and the next give-back
    // needs twice the calm.
    run(&mut c, 2, &hot);
    assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 80);
    assert_eq!(c.detection().unwrap().calm_needed, 8);
    assert!(run(&mut c, 7, &cool).is_empty());
    assert_eq!(c.step(0, &cool).len(), 2);
    // The last step back releases the job.
    assert!(run(&mut c, 7, &cool).is_empty());
    let a = c.step(0, &cool);
    assert_eq!(a.len(), 3, "{a:?}");
    assert_eq!(a[2].mechanism, Mechanism::Release);
    assert_eq!(a[2].job, id(2));
    assert!(c.throttles().is_empty());
    // Calm with nothing held forgives the relapse.
    run(&mut c, 8, &cool);
    assert_eq!(c.detection().unwrap().calm_needed, 4);
}

#[test]
fn oscillating_pressure_does_not_flap() {
    // Pressure for 2 ticks, calm for 4, over and over: without backoff this would throttle
    // and release every 6 ticks.
    let mut c = ContentionEliminator::new(config(2, 4), Some(intel_caps()));
    let jobs = vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))];
    let hot = obs(Some(0.9), jobs.clone());
    let cool = obs(Some(0.3), jobs.clone());
    let mut give_backs = 0;
    for _ in 0..40 {
        run(&mut c, 2, &hot);
        if !run(&mut c, 4, &cool).is_empty() {
            give_backs += 1;
        }
    }
    // The first give-back is followed by a relapse; from then on 4 calm ticks are too few:
    // the step is kept, and the throttle deepens while pressure keeps coming back.
    assert_eq!(give_backs, 1);
    assert!(c.detection().unwrap().calm_needed >= 8);
    assert!(c.throttles().mba[&MbaGroup::Lodgers][&0] <= 50);
}

#[test]
fn pressured_domains_only_when_known() {
    let mut c = ContentionEliminator::new(config(1, 10), Some(amd_caps()));
    let mut o = obs(
        Some(0.8),
        vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
    );
    if let Some(m) = o.membw.as_mut() {
        m.domain_fractions = BTreeMap::from([(0, 0.2), (1, 0.95), (2, 0.9), (3, 0.1)]);
    }
    let a = c.step(0, &o);
    let domains: Vec<u32> = a
        .iter()
        .map(|x| match x.mechanism {
            Mechanism::Mba { domain, .. } => domain,
            _ => panic!("{x:?}"),
        })
        .collect();
    assert_eq!(domains, [1, 2]);
    assert_eq!(
        c.throttles().mba[&MbaGroup::Lodgers],
        BTreeMap::from([(0, 2048), (1, 1844), (2, 1844), (3, 2048)])
    );
}

#[test]
fn ranking_by_bandwidth_else_cache_misses() {
    let mut c = ContentionEliminator::new(config(1, 10), None);
    let mut a = lodger(2, Role::Batch, 8, None);
    let mut b = lodger(3, Role::Batch, 8, None);
    a.cache_misses_per_s = Some(1e6);
    b.cache_misses_per_s = Some(5e7);
    let acts = c.step(0, &obs(Some(0.9), vec![training(1), a.clone(), b.clone()]));
    assert_eq!(c.detection().unwrap().ranked_by, RankedBy::CacheMisses);
    assert_eq!(acts[0].job, id(3), "most misses halved first");
    assert!(acts[0].evidence.contains("misses/s"));
    a.membw_bytes_per_s = Some(8e9);
    b.membw_bytes_per_s = Some(1e9);
    c.step(0, &obs(Some(0.9), vec![training(1), a.clone(), b.clone()]));
    let d = c.detection().unwrap();
    assert_eq!(d.ranked_by, RankedBy::MemoryBandwidth);
    assert_eq!(d.suspects[0].job, id(2));
    // Nothing measured: batch before offline before online, then by id.
    let x = lodger(9, Role::Offline, 8, None);
    let y = lodger(10, Role::Batch, 8, None);
    let z = lodger(8, Role::Online, 8, None);
    let mut c = ContentionEliminator::new(config(1, 10), None);
    c.step(0, &obs(Some(0.9), vec![training(1), x, y, z]));
    let d = c.detection().unwrap();
    assert_eq!(d.ranked_by, RankedBy::Unranked);
    let order: Vec<&str> = d.suspects.iter().map(|s| s.job.as_str()).collect();
    assert_eq!(order, ["j10", "j9", "j8"]);
}

#[test]
fn gpu_drop_detection_with_learnt_baseline() {
    let mut c = ContentionEliminator::new(config(3, 5), None);
    let train = |p: f64| {
        let mut t = training(1);
        t.progress = Some(p);
        t
    };
    // Alone: learns 10 ticks of ~100 it/s, noise max(3σ, 5%) = 5.
    for p in [
        100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 100.0, 100.0, 101.0, 99.0,
    ] {
        assert!(c.step(0, &obs(None, vec![train(p)])).is_empty());
    }
    let b = c.status().baselines[&id(1)];
    assert!((b.level - 100.0).abs() < 1e-9);
    assert!((b.noise - 5.0).abs() < 1e-9, "{b:?}");
    let hog = lodger(2, Role::Batch, 8, None);
    // Within the noise: nothing.
    assert!(run(&mut c, 5, &obs(None, vec![train(96.0), hog.clone()])).is_empty());
    // A drop beyond the noise for 3 ticks: halve the hog.
    let slow = obs(None, vec![train(80.0), hog.clone()]);
    assert!(run(&mut c, 2, &slow).is_empty());
    let a = c.step(0, &slow);
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
    assert!(
        a[0].evidence
            .contains("j1 progress 80.0 below its stable 100.0"),
        "{}",
        a[0].evidence
    );
    match &c.detection().unwrap().signal {
        Signal::TrainingProgress { dropped } => assert_eq!(dropped[0].job, id(1)),
        s => panic!("{s:?}"),
    }
    // Recovered (because of the throttle): calm, then the cores come back.
    let ok = obs(None, vec![train(99.0), hog.clone()]);
    assert!(run(&mut c, 4, &ok).is_empty());
    let a = c.step(0, &ok);
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 8 });
    assert_eq!(a[1].mechanism, Mechanism::Release);
    // A slowdown with no lodger running is not contention.
    let mut c = ContentionEliminator::new(config(1, 5), None);
    let mut t = train(50.0);
    t.baseline = Some(Baseline {
        level: 100.0,
        noise: 5.0,
    });
    assert!(run(&mut c, 3, &obs(None, vec![t.clone()])).is_empty());
    assert!(!c.detection().unwrap().pressured);
    assert_eq!(c.step(0, &obs(None, vec![t, hog])).len(), 1);
}

/// A job's first samples are its start-up: learnt from a window that slides while the job
/// is alone, they age out, and a drop that matters is still seen.
#[test]
fn a_start_up_transient_ages_out_of_the_learnt_level() {
    let mut c = ContentionEliminator::new(config(3, 5), None);
    let train = |p: f64| {
        let mut t = training(1);
        t.progress = Some(p);
        t
    };
    // Two records of start-up, repeated as sensing passes repeat a record, then steady.
    let alone: Vec<f64> = [30.0; 5]
        .into_iter()
        .chain([60.0; 5])
        .chain([100.0, 99.0, 101.0, 100.0, 100.0].repeat(2))
        .collect();
    for p in alone {
        assert!(c.step(0, &obs(None, vec![train(p)])).is_empty());
    }
    let b = c.status().baselines[&id(1)];
    assert!((b.level - 100.0).abs() < 1e-9, "{b:?}");
    assert!((b.noise - 5.0).abs() < 1e-9, "{b:?}");
    // 80 is a 20 % drop: pressure (a level learnt from the first ten samples, 45 with a
    // noise of 3 x 15.8, would have hidden it).
    let hog = lodger(2, Role::Offline, 2, None);
    let a = run(&mut c, 3, &obs(None, vec![train(80.0), hog.clone()]));
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
    // While a lodger runs nothing is learnt: the level stays.
    assert_eq!(c.status().baselines[&id(1)], b);
    // Alone again, a new steady level replaces it, window by window.
    for _ in 0..10 {
        c.step(0, &obs(None, vec![train(90.0)]));
    }
    assert!((c.status().baselines[&id(1)].level - 90.0).abs() < 1e-9);
}

#[test]
fn advise_mode_reports_and_applies_nothing() {
    let mut cfg = config(1, 10);
    cfg.mode = Mode::Advise;
    let mut c = ContentionEliminator::new(cfg, Some(intel_caps()));
    let a = c.step(
        0,
        &obs(
            Some(0.9),
            vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
        ),
    );
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|x| x.advisory));
    assert!(c.throttles().is_empty());
    assert_eq!(c.decided().mba[&MbaGroup::Lodgers][&0], 90);
    c.set_mode(Mode::Enforce);
    assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&1], 90);
}

#[test]
fn departures_joiners_and_no_training() {
    let mut c = ContentionEliminator::new(config(1, 10), Some(intel_caps()));
    let hot = |jobs| obs(Some(0.9), jobs);
    c.step(
        0,
        &hot(vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))]),
    );
    // j5 joins the throttled group: it is told.
    let a = c.step(
        0,
        &obs(
            Some(0.7),
            vec![
                training(1),
                lodger(2, Role::Batch, 8, Some(4e9)),
                lodger(5, Role::Offline, 8, Some(1e9)),
            ],
        ),
    );
    assert_eq!(a.len(), 2, "{a:?}");
    assert!(a.iter().all(|x| x.job == id(5) && x.level == 1));
    assert!(a[0].evidence.contains("joined lodger-lodgers"));
    // j2 leaves: released; j5 stays throttled.
    let a = c.step(
        0,
        &obs(
            Some(0.7),
            vec![training(1), lodger(5, Role::Offline, 8, Some(1e9))],
        ),
    );
    assert_eq!(a.len(), 1);
    assert_eq!(
        (a[0].job.clone(), a[0].mechanism.clone()),
        (id(2), Mechanism::Release)
    );
    assert!(a[0].evidence.contains("job gone"));
    // The training job leaves: every throttle lifted at once.
    let a = c.step(
        0,
        &obs(Some(0.9), vec![lodger(5, Role::Offline, 8, Some(1e9))]),
    );
    assert_eq!(a.len(), 3, "{a:?}");
    assert_eq!(a[2].mechanism, Mechanism::Release);
    assert!(a[0].evidence.contains("no training job"));
    assert!(c.throttles().is_empty());
    assert!(c.detection().is_none());
}

#[test]
fn a_lodger_re_registered_as_training_is_released_at_once() {
    let mut c = ContentionEliminator::new(config(1, 10), None);
    c.step(
        0,
        &obs(
            Some(0.9),
            vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
        ),
    );
    assert_eq!(c.throttles().cores[&id(2)], 4);
    let mut now_training = training(2);
    now_training.cores = 8;
    let a = c.step(0, &obs(Some(0.9), vec![training(1), now_training]));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].mechanism, Mechanism::Release);
    assert!(c.throttles().is_empty());
}

/// The agent enforces a core cut by capping the job's instances, and then observes the job
/// on the capped count. That observation is the throttle's own doing: it must neither lift
/// the cut (flapping: cut, released next tick, cut again) nor be halved again (a spiral to
/// the floor in one pressured stretch).
#[test]
fn a_cut_job_observed_at_its_capped_allocation_keeps_its_throttle() {
    let mut c = ContentionEliminator::new(config(2, 3), None);
    let hot = |cores| {
        obs(
            Some(0.9),
            vec![training(1), lodger(2, Role::Offline, cores, None)],
        )
    };
    let cool = |cores| {
        obs(
            Some(0.3),
            vec![training(1), lodger(2, Role::Offline, cores, None)],
        )
    };
    // Halved 8 -> 4 after two pressured ticks; the enforcer then shows 4 cores.
    let a = run(&mut c, 2, &hot(8));
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 4 });
    assert!(a[0].evidence.contains("halved 8 -> 4"), "{}", a[0].evidence);
    // The capped allocation: no action, the cut holds at level 1 (not released, not cut
    // again from 4).
    let a = c.step(0, &hot(4));
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(c.throttles().cores[&id(2)], 4);
    assert_eq!(c.status().core_levels[&id(2)], 1);
    // The next step halves from the job's own allocation, 8: level 2 = 2 cores.
    let a = c.step(0, &hot(4));
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(
        (a[0].mechanism.clone(), a[0].level),
        (Mechanism::Cores { count: 2 }, 2)
    );
    assert!(a[0].evidence.contains("halved 4 -> 2"), "{}", a[0].evidence);
    // Down to the floor (1 core, level 3), counted from 8 though the job shows 2.
    let a = run(&mut c, 2, &hot(2));
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
    assert_eq!(a[0].level, 3);
    assert!(run(&mut c, 4, &hot(1)).is_empty(), "at the floor");
    assert!(c.detection().unwrap().exhausted);
    // Calm: the steps come back one by one, while the job shows each capped count.
    let mut counts = Vec::new();
    let mut shown = 1;
    for _ in 0..40 {
        for a in c.step(0, &cool(shown)) {
            if let Mechanism::Cores { count } = a.mechanism {
                counts.push(count);
                shown = count;
            }
        }
    }
    assert_eq!(counts, [2, 4, 8]);
    assert!(c.throttles().is_empty());
}

/// Two cores halved to one, as on a two-CPU node: the cut holds while the enforcer shows
/// one core, and comes back after the calm ticks.
#[test]
fn two_cores_halved_to_one_hold_until_calm() {
    let mut c = ContentionEliminator::new(config(3, 5), None);
    let hot = |cores| {
        obs(
            Some(0.9),
            vec![training(1), lodger(2, Role::Offline, cores, None)],
        )
    };
    let a = run(&mut c, 3, &hot(2));
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
    let a = run(&mut c, 20, &hot(1));
    assert!(a.is_empty(), "held at the floor without flapping: {a:?}");
    assert_eq!(c.throttles().cores[&id(2)], 1);
    let cool = obs(
        Some(0.3),
        vec![training(1), lodger(2, Role::Offline, 1, None)],
    );
    assert!(run(&mut c, 4, &cool).is_empty());
    let a = c.step(0, &cool);
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 2 });
    assert_eq!(a[1].mechanism, Mechanism::Release);
}

#[test]
fn allocation_change_keeps_the_level() {
    let mut c = ContentionEliminator::new(config(1, 10), None);
    c.step(
        0,
        &obs(
            Some(0.9),
            vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
        ),
    );
    let a = c.step(
        0,
        &obs(
            Some(0.7),
            vec![training(1), lodger(2, Role::Batch, 16, Some(4e9))],
        ),
    );
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 8 });
    assert_eq!(a[0].level, 1);
    assert_eq!(c.throttles().cores[&id(2)], 8);
}

// -----------------------------------------------------------------------------------------
// Properties.

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![
        Just(Role::Training),
        Just(Role::Batch),
        Just(Role::Offline),
        Just(Role::Online)
    ]
}

/// One generated job: seq, role, cores, bandwidth, progress, SLO met.
type JobInput = (u64, Role, u32, Option<f64>, Option<f64>, Option<bool>);

#[derive(Debug, Clone)]
struct TickInput {
    fraction: Option<f64>,
    jobs: Vec<JobInput>,
}

fn ticks() -> impl Strategy<Value = Vec<TickInput>> {
    let job = (
        1u64..8,
        role(),
        0u32..40,
        proptest::option::of(0.0f64..2e10),
        proptest::option::of(0.0f64..200.0),
        proptest::option::of(any::<bool>()),
    );
    let tick = (
        proptest::option::of(0.0f64..1.2),
        proptest::collection::vec(job, 0..6),
    )
        .prop_map(|(fraction, jobs)| TickInput { fraction, jobs });
    proptest::collection::vec(tick, 1..60)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn never_throttles_training_and_stays_in_bounds(
        inputs in ticks(),
        mba in proptest::option::of(any::<bool>()),
        advise in any::<bool>(),
        pressure in 1u32..4,
        calm in 1u32..6,
        min_cores in 1u32..4,
    ) {
        let caps = mba.map(|intel| if intel { intel_caps() } else { amd_caps() });
        let cfg = ContentionConfig {
            mode: if advise { Mode::Advise } else { Mode::Enforce },
            pressure_ticks: pressure,
            calm_ticks: calm,
            min_cores,
            ..ContentionConfig::default()
        };
        let mut c = ContentionEliminator::new(cfg, caps.clone());
        // The most cores each job has shown: a cut counts from a count it showed (a cut job
        // may show fewer, capped by its own throttle).
        let mut most_cores: BTreeMap<JobId, u32> = BTreeMap::new();
        for (n, input) in inputs.iter().enumerate() {
            let jobs: Vec<JobObservation> = input
                .jobs
                .iter()
                .map(|&(seq, role, cores, bw, progress, slo)| {
                    let mut j = JobObservation::new(id(seq), role, cores);
                    j.membw_bytes_per_s = bw;
                    // Per domain as the sensor gives it: split over two of the four.
                    if let Some(bw) = bw.filter(|_| seq % 2 == 0) {
                        j.membw_domains = BTreeMap::from([(0, bw * 0.75), (seq as u32 % 4, bw * 0.25)]);
                    }
                    j.progress = progress;
                    j.slo_met = slo;
                    j
                })
                .collect();
            let o = obs(input.fraction, jobs.clone());
            let before = c.status();
            let actions = c.step(u64::try_from(n).unwrap(), &o);
            // The role each job has this tick (first listing wins, as in step).
            let mut roles: BTreeMap<JobId, &JobObservation> = BTreeMap::new();
            for j in &jobs {
                roles.entry(j.id.clone()).or_insert(j);
            }
            for j in roles.values() {
                let most = most_cores.entry(j.id.clone()).or_insert(0);
                *most = (*most).max(j.cores);
            }
            for a in &actions {
                prop_assert_eq!(a.advisory, advise);
                if a.mechanism != Mechanism::Release {
                    let j = roles.get(&a.job);
                    prop_assert!(j.is_some(), "action for absent {}", a.job);
                    prop_assert!(j.unwrap().role != Role::Training, "training throttled: {:?}", a);
                }
            }
            let t = c.decided();
            if advise {
                prop_assert!(c.throttles().is_empty());
            }
            for (job, &count) in &t.cores {
                let j = roles.get(job);
                prop_assert!(j.is_some(), "cut for absent {}", job);
                let j = j.unwrap();
                prop_assert!(j.role != Role::Training);
                let most = most_cores.get(job).copied().unwrap_or(0);
                prop_assert!(count >= min_cores, "{} cut to {} below the floor", job, count);
                prop_assert!(count < most, "{} cut to {} of at most {} shown", job, count, most);
            }
            if let Some(caps) = &caps {
                let ladder = MbaLadder::new(caps.clone(), c.config()).unwrap();
                for (group, values) in &t.mba {
                    prop_assert!(roles.values().any(|j| j.role.mba_group() == Some(*group)));
                    for (&d, &v) in values {
                        let base = c.mba_base(*group, d);
                        prop_assert!(v >= ladder.floor_at(d, base) && v <= ladder.unthrottled(d));
                        prop_assert!(base.is_none() || caps.unit == MbaUnit::AmdEighthGigabytesPerSecond);
                        prop_assert_eq!(caps.valid_value(v), v);
                    }
                }
            } else {
                prop_assert!(t.mba.is_empty());
            }
            // An online job whose SLO does not hold is never throttled further.
            let after = c.status();
            for j in roles.values() {
                if j.role != Role::Online || j.slo_met == Some(true) {
                    continue;
                }
                let was = before.core_levels.get(&j.id).copied().unwrap_or(0);
                let is = after.core_levels.get(&j.id).copied().unwrap_or(0);
                prop_assert!(is <= was, "{} cut deeper with a failing SLO", j.id);
                let online = |s: &ContentionStatus, d: u32| {
                    s.mba_levels.get(&MbaGroup::Online).and_then(|l| l.get(&d)).copied()
                };
                for d in 0..4 {
                    prop_assert!(
                        online(&after, d).unwrap_or(0) <= online(&before, d).unwrap_or(0),
                        "online group throttled deeper with {} failing its SLO", j.id
                    );
                }
            }
            // Without training nothing is throttled.
            if !roles.values().any(|j| j.role == Role::Training) {
                prop_assert!(t.is_empty());
            }
        }
    }
}
