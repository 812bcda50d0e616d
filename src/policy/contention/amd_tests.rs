//! Tests of AMD's MBA ladder counting down from what a group used (`MbaLadder::base_for`): the
//! values, the eliminator's steps and give-backs, and what a restart keeps.

use super::tests::{amd_caps, config, intel_caps, lodger, obs, run, training};
use super::*;

const GIB: f64 = (1u64 << 30) as f64;

/// A lodger of `role` using `domains` (L3 domain, GiB/s) of memory bandwidth.
fn hog(seq: u64, role: Role, domains: &[(u32, f64)]) -> JobObservation {
    let total = domains.iter().map(|(_, g)| g * GIB).sum();
    let mut j = lodger(seq, role, 8, Some(total));
    j.membw_domains = domains.iter().map(|&(d, g)| (d, g * GIB)).collect();
    j
}

fn lodgers_values(c: &ContentionEliminator) -> Vec<u32> {
    c.throttles()
        .mba
        .get(&MbaGroup::Lodgers)
        .map(|v| v.values().copied().collect())
        .unwrap_or_default()
}

#[test]
fn an_amd_ladder_counts_down_from_what_the_group_used() {
    let ladder = MbaLadder::new(amd_caps(), &ContentionConfig::default()).unwrap();
    // 40 GiB/s is 320 eighths of a GiB/s.
    let base = ladder.base_for(Some(40.0 * GIB));
    assert_eq!(base, Some(320));
    let values: Vec<u32> = (0..=ladder.max_level_at(0, base))
        .map(|l| ladder.value_at(0, base, l))
        .collect();
    // Level 0 is no limit (the default group's value); every step bites.
    assert_eq!(values, [2048, 288, 256, 224, 192, 160, 128, 96, 64, 32]);
    assert_eq!(ladder.floor_at(0, base), 32);
    // Counted from 2048, as before, no step goes below 205 (25.6 GB/s): a group using 20 GiB/s
    // in a domain (160 units) was never held back, one using 40 GiB/s only at the last step.
    assert!((1..=ladder.max_level(0)).all(|l| ladder.value(0, l) > 160));
    assert_eq!(
        (1..=ladder.max_level(0)).find(|&l| ladder.value(0, l) < 320),
        Some(9)
    );
    // Rounded up, not below 2 GB/s (a group using less is not the hog, and counted from what
    // it used its floor would starve it); above the unthrottled value it counts from that.
    assert_eq!(ladder.base_for(Some(40.0 * GIB + 1.0)), Some(321));
    assert_eq!(ladder.base_for(Some(1.0)), Some(16));
    assert_eq!(ladder.base_for(Some(0.5 * GIB)), Some(16));
    assert_eq!(ladder.base_for(Some(2.5 * GIB)), Some(20));
    assert_eq!(ladder.held_base(3), Some(16));
    let huge = ladder.base_for(Some(1e15));
    assert_eq!(ladder.value_at(0, huge, 1), ladder.value(0, 1));
    assert_eq!(ladder.value(0, 1), 1844);
    // Nothing measured: the unthrottled value, as before.
    for nothing in [None, Some(0.0), Some(-1.0), Some(f64::NAN)] {
        assert_eq!(ladder.base_for(nothing), None, "{nothing:?}");
    }
    // Intel's percent steps are relative already.
    let intel = MbaLadder::new(intel_caps(), &ContentionConfig::default()).unwrap();
    assert_eq!(intel.base_for(Some(40.0 * GIB)), None);
    assert_eq!(intel.held_base(320), None);
}

#[test]
fn the_first_amd_step_bites_at_once_and_a_give_back_to_no_limit_forgets_the_base() {
    let mut c = ContentionEliminator::new(config(2, 3), Some(amd_caps()));
    let batch = hog(2, Role::Batch, &[(0, 20.0), (1, 5.0)]);
    let offline = hog(3, Role::Offline, &[(0, 1.0), (2, 1.0)]);
    let hot = obs(Some(0.9), vec![training(1), batch, offline]);
    let a = run(&mut c, 2, &hot);
    // The group's busiest domain is 0, with 21 GiB/s (168 units): 90 % of it everywhere
    // (no per-domain pressure known, so every domain steps), where the unthrottled ladder's
    // first step would be 1844 (230 GB/s), above anything a CCX uses.
    assert_eq!(c.mba_base(MbaGroup::Lodgers, 0), Some(168));
    assert_eq!(lodgers_values(&c), [152; 4]);
    let step = a
        .iter()
        .find(|x| matches!(x.mechanism, Mechanism::Mba { .. }))
        .expect("an MBA step");
    assert!(
        step.evidence.contains(
            "MBA one step down from 21.0 GB/s (it used 21.0 GB/s in its busiest L3 domain)"
        ),
        "{}",
        step.evidence
    );
    // The next step counts from the same base, whatever the group uses now.
    let calmer = obs(
        Some(0.9),
        vec![training(1), hog(2, Role::Batch, &[(0, 2.0)])],
    );
    let a = run(&mut c, 2, &calmer);
    assert_eq!(lodgers_values(&c), [135; 4], "80 % of 168, rounded up");
    assert!(
        a.iter().all(|x| !x.evidence.contains("busiest L3 domain")),
        "{a:?}"
    );
    // Calm gives the steps back one at a time; at no limit the base is forgotten.
    let cool = obs(
        Some(0.3),
        vec![training(1), hog(2, Role::Batch, &[(0, 2.0)])],
    );
    run(&mut c, 3, &cool);
    assert_eq!(lodgers_values(&c), [152; 4]);
    run(&mut c, 3, &cool);
    assert!(c.throttles().is_empty());
    assert_eq!(c.mba_base(MbaGroup::Lodgers, 0), None);
    // Pressure again: the base is what the group uses now, here the least a base may be
    // (2 GiB/s, 16 units), which the evidence tells apart from what it used.
    let hot_again = obs(
        Some(0.9),
        vec![training(1), hog(2, Role::Batch, &[(0, 0.5)])],
    );
    let a = run(&mut c, 2, &hot_again);
    let step = a
        .iter()
        .find(|x| matches!(x.mechanism, Mechanism::Mba { .. }))
        .expect("an MBA step");
    assert!(
        step.evidence
            .contains("from 2.0 GB/s (it used 0.5 GB/s in its busiest L3 domain)"),
        "{}",
        step.evidence
    );
    assert_eq!(c.mba_base(MbaGroup::Lodgers, 3), Some(16));
    assert_eq!(lodgers_values(&c), [15; 4]);
}

#[test]
fn without_per_domain_bandwidth_an_amd_ladder_counts_from_no_limit_and_says_so() {
    let mut c = ContentionEliminator::new(config(2, 3), Some(amd_caps()));
    let hot = obs(
        Some(0.9),
        vec![training(1), lodger(2, Role::Batch, 8, Some(4e9))],
    );
    let a = run(&mut c, 2, &hot);
    assert_eq!(lodgers_values(&c), [1844; 4]);
    assert_eq!(c.mba_base(MbaGroup::Lodgers, 0), None);
    assert!(
        a[0].evidence
            .contains("from the unthrottled value (no bandwidth of its own measured"),
        "{}",
        a[0].evidence
    );
    // Intel says nothing of a base.
    let mut c = ContentionEliminator::new(config(2, 3), Some(intel_caps()));
    let a = run(
        &mut c,
        2,
        &obs(
            Some(0.9),
            vec![training(1), hog(2, Role::Batch, &[(0, 20.0)])],
        ),
    );
    assert_eq!(c.throttles().mba[&MbaGroup::Lodgers][&0], 90);
    assert!(
        a[0].evidence.ends_with("MBA one step down"),
        "{}",
        a[0].evidence
    );
}

#[test]
fn a_restart_keeps_the_base_and_a_node_without_one_drops_it() {
    let mut c = ContentionEliminator::new(config(2, 3), Some(amd_caps()));
    let hot = obs(
        Some(0.9),
        vec![training(1), hog(2, Role::Batch, &[(1, 40.0)])],
    );
    run(&mut c, 2, &hot);
    let held = c.held();
    assert_eq!(held.mba_bases[&MbaGroup::Lodgers][&1], 320);
    // Through the state file's JSON.
    let text = serde_json::to_string(&held).unwrap();
    let back: HeldContention = serde_json::from_str(&text).unwrap();
    let mut again = ContentionEliminator::new(config(2, 3), Some(amd_caps()));
    again.restore(back.clone());
    assert_eq!(again.throttles(), c.throttles());
    assert_eq!(lodgers_values(&again), [288; 4]);
    // A base for a domain this node does not have is not taken up.
    let mut elsewhere = back.clone();
    elsewhere
        .mba_bases
        .entry(MbaGroup::Lodgers)
        .or_default()
        .insert(9, 320);
    elsewhere
        .mba_levels
        .entry(MbaGroup::Lodgers)
        .or_default()
        .insert(9, 1);
    let mut here = ContentionEliminator::new(config(2, 3), Some(amd_caps()));
    here.restore(elsewhere);
    assert_eq!(here.mba_base(MbaGroup::Lodgers, 9), None);
    assert_eq!(here.held().mba_bases, back.mba_bases);
    // A state file from before bases (no such key): the steps count from no limit, as they
    // were taken.
    let mut before = back.clone();
    before.mba_bases.clear();
    let text = serde_json::to_string(&before).unwrap();
    assert!(!text.contains("bases"), "{text}");
    let old: HeldContention = serde_json::from_str(&text).unwrap();
    let mut older = ContentionEliminator::new(config(2, 3), Some(amd_caps()));
    older.restore(old);
    assert_eq!(lodgers_values(&older), [1844; 4]);
    // Restored where MBA is in percent (another node's file): levels kept, no base.
    let mut intel = ContentionEliminator::new(config(2, 3), Some(intel_caps()));
    intel.restore(back);
    assert_eq!(intel.mba_base(MbaGroup::Lodgers, 0), None);
    assert_eq!(intel.throttles().mba[&MbaGroup::Lodgers][&0], 90);
}
