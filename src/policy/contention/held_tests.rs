//! Tests of what the eliminator keeps across a restart ([`HeldContention`]): restored through
//! JSON, as the state file keeps it, a new eliminator goes on exactly as the old one would have.

use std::collections::BTreeMap;

use super::tests::intel_caps as caps;
use super::*;
use crate::job::JobId;

fn id(seq: u64) -> JobId {
    JobId::from_seq(seq)
}

fn config() -> ContentionConfig {
    ContentionConfig {
        pressure_ticks: 3,
        calm_ticks: 5,
        ..ContentionConfig::default()
    }
}

fn train(p: f64) -> JobObservation {
    let mut t = JobObservation::new(id(1), Role::Training, 8);
    t.progress = Some(p);
    t
}

fn hog() -> JobObservation {
    JobObservation::new(id(2), Role::Batch, 8)
}

fn progress(p: f64, lodger: bool) -> ContentionObservations {
    let mut jobs = vec![train(p)];
    if lodger {
        jobs.push(hog());
    }
    ContentionObservations { membw: None, jobs }
}

/// Through the state file's form.
fn through_json(held: &HeldContention) -> HeldContention {
    let text = serde_json::to_string(held).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_restored_eliminator_goes_on_as_the_old_one_would() {
    let mut old = ContentionEliminator::new(config(), None);
    // Alone: a stable level of 100 learnt; then a drop with the hog beside: one halving.
    for p in [
        100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 100.0, 100.0, 101.0, 99.0,
    ] {
        old.step(0, &progress(p, false));
    }
    for _ in 0..3 {
        old.step(0, &progress(80.0, true));
    }
    assert_eq!(old.throttles().cores[&id(2)], 4, "{:?}", old.throttles());

    let held = through_json(&old.held());
    let mut new = ContentionEliminator::new(config(), None);
    // What a lodgerd that forgot would start with: nothing throttled, nothing learnt.
    assert!(new.throttles().is_empty());
    new.restore(held);
    assert_eq!(new.throttles(), old.throttles());
    assert_eq!(new.status().baselines, old.status().baselines);
    assert_eq!(new.status().core_levels, old.status().core_levels);

    // The same pressure, then calm: the same actions from both, step for step (the restored
    // one escalates from the cut it holds and detects from the level it did not learn again).
    let mut sequence = vec![progress(80.0, true); 3];
    sequence.extend(vec![progress(99.0, true); 12]);
    let mut escalated = false;
    for o in &sequence {
        let (a, b) = (old.step(0, o), new.step(0, o));
        assert_eq!(a, b);
        escalated |= b
            .iter()
            .any(|x| x.mechanism == Mechanism::Cores { count: 2 });
        assert_eq!(new.throttles(), old.throttles());
    }
    assert!(escalated, "the restored eliminator took the next halving");
    assert_eq!(new.held(), old.held());
}

#[test]
fn what_the_node_cannot_hold_is_dropped_not_trusted() {
    // MBA steps held on a node with MBA on domains 0 and 1.
    let mut old = ContentionEliminator::new(config(), Some(caps()));
    let o = ContentionObservations {
        membw: Some(NodeMembw {
            bytes_per_s: 90e9,
            fraction_of_peak: 0.9,
            domain_fractions: BTreeMap::new(),
        }),
        jobs: vec![JobObservation::new(id(1), Role::Training, 8), hog()],
    };
    for _ in 0..3 {
        old.step(0, &o);
    }
    let held = through_json(&old.held());
    assert!(held.holds_mba(), "{held:?}");
    assert!(!old.throttles().mba.is_empty());

    // The same node: held as it was.
    let mut same = ContentionEliminator::new(config(), Some(caps()));
    same.restore(held.clone());
    assert_eq!(same.throttles(), old.throttles());

    // A node without MBA (the file came from elsewhere, or resctrl is gone): no MBA step.
    let mut none = ContentionEliminator::new(config(), None);
    none.restore(held.clone());
    assert!(none.throttles().is_empty());
    assert!(!none.held().holds_mba());

    // A node with other domains: only the known ones.
    let mut other_caps = caps();
    other_caps.default_schemata = BTreeMap::from([(0, 100)]);
    let mut other = ContentionEliminator::new(config(), Some(other_caps));
    other.restore(held);
    for values in other.throttles().mba.values() {
        assert_eq!(values.keys().copied().collect::<Vec<_>>(), [0]);
    }

    // A calm the config no longer allows is brought within it.
    let held: HeldContention = serde_json::from_str(r#"{"calm_needed": 100000}"#).unwrap();
    let mut c = ContentionEliminator::new(config(), None);
    c.restore(held);
    assert_eq!(c.held().calm_needed, config().max_calm_ticks);
    assert!(c.throttles().is_empty());
}

#[test]
fn nothing_held_is_empty_and_an_old_state_reads_as_nothing_held() {
    let c = ContentionEliminator::new(config(), None);
    let held = c.held();
    assert!(held.is_empty(), "{held:?}");
    // The state file then has nothing of it, and one without it reads as nothing held.
    assert_eq!(serde_json::to_string(&held).unwrap(), "{}");
    let from_old: HeldContention = serde_json::from_str("{}").unwrap();
    assert!(from_old.is_empty());
    let mut restored = ContentionEliminator::new(config(), None);
    restored.restore(from_old);
    assert_eq!(restored.held(), held);
}
