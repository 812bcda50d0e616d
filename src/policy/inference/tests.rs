//! Tests of inference placement and capacity (the layout search's are in `search_tests`).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use super::place::fair_shares;
use super::types::union_of;
use super::*;
use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::policy::Plan;
use crate::topology::Topology;

// -----------------------------------------------------------------------------------------
// Placement

fn set(list: &str) -> CpuSet {
    CpuSet::parse(list).unwrap()
}

pub(super) fn id(seq: u64) -> JobId {
    JobId::from_seq(seq)
}

pub(super) fn layout(cores: u32, instances: u32, batch: u32) -> LayoutConfig {
    LayoutConfig {
        cores_per_instance: cores,
        instances,
        batch,
    }
}

pub(super) fn online_job(seq: u64, cores: u32, instances: u32, batch: u32) -> OnlineJobView {
    OnlineJobView {
        id: id(seq),
        layout: layout(cores, instances, batch),
    }
}

pub(super) fn offline_job(seq: u64, max: Option<u32>) -> OfflineJobView {
    OfflineJobView {
        id: id(seq),
        batch: 4,
        training_batch: None,
        max_instances: max,
    }
}

/// 2 sockets × 16 cores × 2 threads, one node per socket; cpu i and i+32 are siblings.
fn server64() -> Topology {
    Topology::synthetic(2, 1, 16, 2, 4)
}

/// Instances of one online job as cpulists, by instance number.
fn online_lists(plan: &InferencePlan, seq: u64) -> Vec<String> {
    plan.online
        .get(&id(seq))
        .map(|j| j.values().map(|i| i.cpus.to_string()).collect())
        .unwrap_or_default()
}

/// Places from an empty plan (nothing running yet) and checks the result with [`check_plan`].
fn place_fresh(
    topo: &Topology,
    reserved: &CpuSet,
    training: &CpuSet,
    online: &[OnlineJobView],
    offline: &[OfflineJobView],
) -> InferencePlan {
    let plan = place(
        topo,
        reserved,
        training,
        online,
        offline,
        &InferencePlan::default(),
    );
    check_plan(topo, reserved, training, online, offline, &plan).unwrap();
    plan
}

/// Checks what every plan must satisfy; returns a description of the first violation.
pub(super) fn check_plan(
    topo: &Topology,
    reserved: &CpuSet,
    training: &CpuSet,
    online: &[OnlineJobView],
    offline: &[OfflineJobView],
    plan: &InferencePlan,
) -> Result<(), String> {
    let free = topo.online().difference(reserved).difference(training);
    let mut online_all = CpuSet::new();
    for (job, instances) in &plan.online {
        let view = online
            .iter()
            .find(|j| &j.id == job)
            .ok_or(format!("{job} placed but not registered online"))?;
        let k = view.layout.cores_per_instance as usize;
        if instances.len() > view.layout.instances as usize {
            return Err(format!("{job}: {} instances", instances.len()));
        }
        for (index, inst) in instances {
            let what = format!("{job}/{index} on {}", inst.cpus);
            if inst.cpus.len() != k || inst.threads as usize != k {
                return Err(format!("{what}: wants {k} CPUs"));
            }
            if inst.batch != view.layout.batch {
                return Err(format!("{what}: batch {}", inst.batch));
            }
            if !inst.cpus.is_subset(&free) {
                return Err(format!("{what}: on training/reserved/offline CPUs"));
            }
            if !inst.cpus.is_disjoint(&online_all) {
                return Err(format!("{what}: shares CPUs with another instance"));
            }
            if inst.mems != topo.numa_nodes_of(&inst.cpus) {
                return Err(format!("{what}: mems {}", inst.mems));
            }
            online_all = online_all.union(&inst.cpus);
        }
    }
    let left = free.difference(&online_all).len();
    for job in online {
        let placed = plan.online.get(&job.id).map_or(0, BTreeMap::len);
        let want = job.layout.instances as usize;
        let k = job.layout.cores_per_instance as usize;
        match plan.shortfall.get(&job.id) {
            Some(short) => {
                if placed >= want || left >= k || short.free as usize != left {
                    return Err(format!("{}: shortfall {short} with {left} free", job.id));
                }
                if short.placed as usize != placed {
                    return Err(format!("{}: shortfall says {}", job.id, short.placed));
                }
            }
            None if k > 0 && placed < want => {
                return Err(format!("{}: {placed} of {want} and no shortfall", job.id));
            }
            None => {}
        }
    }

    let mut shadow = online_all.clone();
    for cpu in &online_all {
        shadow = shadow.union(topo.siblings(cpu).unwrap());
    }
    let pool = topo.online().difference(reserved).difference(&shadow);
    let mut offline_all = CpuSet::new();
    let mut on_training = false;
    for (job, instances) in &plan.offline {
        let view = offline
            .iter()
            .find(|j| &j.id == job)
            .ok_or(format!("{job} placed but not registered offline"))?;
        if let Some(max) = view.max_instances {
            if instances.len() > max as usize {
                return Err(format!("{job}: {} instances over {max}", instances.len()));
            }
        }
        for (index, inst) in instances {
            let what = format!("offline {job}/{index} on {}", inst.cpus);
            let batch = match view.training_batch {
                Some(b) if b > 0 && !inst.cpus.is_disjoint(training) => b.min(view.batch),
                _ => view.batch,
            };
            if inst.batch != batch {
                return Err(format!("{what}: batch {} instead of {batch}", inst.batch));
            }
            if inst.cpus.len() != 1 || inst.threads != 1 {
                return Err(format!("{what}: not one single-thread instance"));
            }
            if !inst.cpus.is_subset(&pool) {
                return Err(format!("{what}: on a reserved or online core"));
            }
            if !inst.cpus.is_disjoint(&offline_all) {
                return Err(format!("{what}: two offline instances on one CPU"));
            }
            on_training |= !inst.cpus.is_disjoint(training);
            offline_all = offline_all.union(&inst.cpus);
        }
    }
    let mut ids: Vec<&JobId> = offline.iter().map(|j| &j.id).collect();
    ids.sort();
    ids.dedup();
    let caps: usize = ids
        .iter()
        .map(|i| {
            let job = offline.iter().find(|j| &&j.id == i).unwrap();
            job.max_instances.map_or(usize::MAX, |m| m as usize)
        })
        .fold(0usize, usize::saturating_add);
    if offline_all.len() != pool.len().min(caps) {
        return Err(format!(
            "offline uses {} of {} CPUs (caps {caps})",
            offline_all.len(),
            pool.len()
        ));
    }
    let idle = pool.difference(training);
    if on_training && !idle.is_subset(&offline_all) {
        return Err(format!(
            "offline on training CPUs while idle {} unused",
            idle.difference(&offline_all)
        ));
    }
    Ok(())
}

struct Case {
    name: &'static str,
    topo: Topology,
    reserved: &'static str,
    training: &'static str,
    online: Vec<OnlineJobView>,
    /// Per online job in id order, its instances' CPUs.
    want: Vec<Vec<&'static str>>,
}

#[test]
fn online_placement_table() {
    let cases = [
        Case {
            name: "whole cores in the tightest node, far from where training grows",
            topo: server64(),
            reserved: "0,32",
            training: "",
            online: vec![online_job(1, 4, 3, 8)],
            want: vec![vec!["14-15,46-47", "12-13,44-45", "10-11,42-43"]],
        },
        Case {
            name: "never on training or reserved CPUs",
            topo: server64(),
            reserved: "0,32",
            training: "16-27,48-59",
            online: vec![online_job(1, 4, 3, 8)],
            want: vec![vec!["30-31,62-63", "28-29,60-61", "14-15,46-47"]],
        },
        Case {
            name: "1-CPU instances pair up on cores, the reserved core's half first",
            topo: server64(),
            reserved: "0",
            training: "1-31,33-47,49-63",
            online: vec![online_job(1, 1, 3, 1)],
            want: vec![vec!["32", "48"]],
        },
        Case {
            name: "odd sizes: one half core, beside the job's own instance",
            topo: server64(),
            reserved: "",
            training: "0-15,32-47",
            online: vec![online_job(1, 3, 2, 1)],
            want: vec![vec!["30-31,63", "29,61-62"]],
        },
        Case {
            name: "an instance larger than any node's free CPUs spans two",
            topo: server64(),
            reserved: "",
            training: "0-11,32-43,16-27,48-59",
            online: vec![online_job(1, 12, 1, 1)],
            want: vec![vec!["12-15,30-31,44-47,62-63"]],
        },
        Case {
            name: "jobs in id order: j2 before j10",
            topo: server64(),
            reserved: "0,32",
            training: "1-15,33-47",
            online: vec![online_job(10, 4, 2, 1), online_job(2, 8, 1, 1)],
            want: vec![vec!["28-31,60-63"], vec!["26-27,58-59", "24-25,56-57"]],
        },
        Case {
            name: "the tightest node that holds the instance",
            topo: Topology::synthetic(1, 4, 4, 1, 0),
            reserved: "",
            training: "0-2,4,8-9",
            online: vec![online_job(1, 2, 2, 1)],
            want: vec![vec!["10-11", "6-7"]],
        },
        Case {
            name: "no SMT; the third instance does not fit",
            topo: Topology::synthetic(1, 1, 8, 1, 1),
            reserved: "0",
            training: "1-2",
            online: vec![online_job(1, 2, 3, 1)],
            want: vec![vec!["6-7", "4-5"]],
        },
    ];
    for c in cases {
        let reserved = set(c.reserved);
        let training = set(c.training);
        let plan = place(
            &c.topo,
            &reserved,
            &training,
            &c.online,
            &[],
            &InferencePlan::default(),
        );
        check_plan(&c.topo, &reserved, &training, &c.online, &[], &plan)
            .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let mut ids: Vec<u64> = c.online.iter().map(|j| j.id.seq()).collect();
        ids.sort_unstable();
        for (seq, want) in ids.iter().zip(&c.want) {
            assert_eq!(&online_lists(&plan, *seq), want, "{}: j{seq}", c.name);
        }
    }
}

#[test]
fn shortfall_is_explained_and_stable() {
    let topo = server64();
    let reserved = set("0,32");
    let training = set("1-23,33-55");
    // 16 free CPUs: j1 takes 12, j2 wants 2 × 4 and gets one.
    let online = [online_job(1, 4, 3, 1), online_job(2, 4, 2, 1)];
    let plan = place(
        &topo,
        &reserved,
        &training,
        &online,
        &[],
        &InferencePlan::default(),
    );
    assert_eq!(online_lists(&plan, 1).len(), 3);
    assert_eq!(online_lists(&plan, 2).len(), 1);
    let short = &plan.shortfall[&id(2)];
    assert_eq!((short.wanted, short.placed, short.free), (2, 1, 0));
    assert_eq!(
        short.to_string(),
        "1 of 2 instances placed: each needs 4 CPUs and 0 are free"
    );
    assert!(!plan.shortfall.contains_key(&id(1)));
    assert_eq!(
        place(&topo, &reserved, &training, &online, &[], &plan),
        plan,
        "idempotent"
    );
}

#[test]
fn offline_fills_idle_cpus_then_training_cpus() {
    let topo = server64();
    let reserved = set("0,32");
    let training = set("1-8,33-40");
    let online = [online_job(1, 4, 2, 1)];
    // Uncapped: every non-reserved CPU outside the online cores, training's included.
    let offline = [offline_job(2, None)];
    let plan = place_fresh(&topo, &reserved, &training, &online, &offline);
    assert_eq!(plan.online_cpus().to_string(), "12-15,44-47");
    assert_eq!(
        plan.offline_cpus().to_string(),
        "1-11,16-31,33-43,48-63",
        "training CPUs included, online cores excluded"
    );
    assert!(plan.offline[&id(2)].values().all(|i| i.threads == 1));

    // Capped at 10: idle CPUs only, whole cores in order.
    let offline = [offline_job(2, Some(10))];
    let plan = place(
        &topo,
        &reserved,
        &training,
        &online,
        &offline,
        &InferencePlan::default(),
    );
    check_plan(&topo, &reserved, &training, &online, &offline, &plan).unwrap();
    assert_eq!(plan.offline_cpus().to_string(), "9-11,16-17,41-43,48-49");

    // More than the idle CPUs: the rest on training CPUs.
    let idle = 64 - 2 - 16 - 8;
    let offline = [offline_job(2, Some(idle + 3))];
    let plan = place_fresh(&topo, &reserved, &training, &online, &offline);
    assert_eq!(
        plan.offline_cpus().intersection(&training).to_string(),
        "1-2,33"
    );
}

#[test]
fn offline_instances_on_training_cpus_get_the_smaller_batch() {
    let topo = server64();
    let reserved = set("0,32");
    let training = set("1-8,33-40");
    let mut job = offline_job(2, None);
    job.batch = 64;
    job.training_batch = Some(6);
    let offline = [job.clone()];
    let plan = place(
        &topo,
        &reserved,
        &training,
        &[],
        &offline,
        &InferencePlan::default(),
    );
    check_plan(&topo, &reserved, &training, &[], &offline, &plan).unwrap();
    let instances = &plan.offline[&id(2)];
    let on_training: Vec<u32> = instances
        .values()
        .filter(|i| !i.cpus.is_disjoint(&training))
        .map(|i| i.batch)
        .collect();
    let idle: Vec<u32> = instances
        .values()
        .filter(|i| i.cpus.is_disjoint(&training))
        .map(|i| i.batch)
        .collect();
    assert_eq!(on_training, vec![6; 16]);
    assert_eq!(idle, vec![64; 64 - 2 - 16]);
    // Placed again from itself: nothing moves, no batch changes (no instance restarts).
    let again = place(&topo, &reserved, &training, &[], &offline, &plan);
    assert_eq!(again, plan);

    // The smaller batch decided later: the instances on training CPUs keep their CPU and
    // number and only their batch changes; never above the job's batch, 0 meaning none.
    let before = place(
        &topo,
        &reserved,
        &training,
        &[],
        &[offline_job(2, None)],
        &InferencePlan::default(),
    );
    let after = place(&topo, &reserved, &training, &[], &offline, &before);
    assert_eq!(after, plan);
    for (index, inst) in &after.offline[&id(2)] {
        assert_eq!(inst.cpus, before.offline[&id(2)][index].cpus);
    }
    for (tb, want) in [(Some(100), 64), (Some(0), 64)] {
        let mut j = job.clone();
        j.training_batch = tb;
        let p = place(
            &topo,
            &reserved,
            &training,
            &[],
            &[j],
            &InferencePlan::default(),
        );
        assert!(
            p.offline[&id(2)].values().all(|i| i.batch == want),
            "{tb:?}"
        );
    }
}

#[test]
fn training_core_batch_keeps_one_batch_within_the_bound() {
    // 30 ms an item, 100 ms bound: 3 items (90 ms), not 4 (120 ms).
    assert_eq!(batch_within(30.0, 100, 64), 3);
    assert_eq!(batch_within(25.0, 100, 64), 4, "exactly at the bound fits");
    // Fast items: the job's own batch, never more.
    assert_eq!(batch_within(0.5, 100, 64), 64);
    assert_eq!(batch_within(1.0, 100, 64), 64);
    // An item alone above the bound: still one, never 0.
    assert_eq!(batch_within(2500.0, 100, 64), 1);
    assert_eq!(batch_within(f64::MAX, 1, 64), 1);
    // Off, or nothing to go by: the job's batch.
    assert_eq!(batch_within(30.0, 0, 64), 64);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(batch_within(bad, 100, 64), 64, "{bad}");
    }
    assert_eq!(batch_within(30.0, 100, 1), 1);
    // Monotone: a slower item never gets a larger batch.
    let mut last = u32::MAX;
    for tenth in 1..5000u32 {
        let b = batch_within(f64::from(tenth) / 10.0, 100, 64);
        assert!((1..=64).contains(&b) && b <= last, "{tenth}: {b}");
        last = b;
    }
}

#[test]
fn offline_never_beside_an_online_thread() {
    let topo = server64();
    // One 1-CPU online instance takes half of core 16/48.
    let training = set("0-15,32-47,17-31,49-63");
    let online = [online_job(1, 1, 1, 1)];
    let offline = [offline_job(2, None)];
    let plan = place(
        &topo,
        &CpuSet::new(),
        &training,
        &online,
        &offline,
        &InferencePlan::default(),
    );
    assert_eq!(plan.online_cpus().to_string(), "16");
    assert!(
        !plan.offline_cpus().contains(48),
        "the online core's sibling stays empty"
    );
    assert_eq!(plan.offline_cpus().len(), 62);
}

/// The online jobs (by id) whose instances hold a CPU of each physical core, for the cores
/// held by more than one.
pub(super) fn cores_shared_between_online_jobs(
    topo: &Topology,
    plan: &InferencePlan,
) -> Vec<String> {
    topo.cores
        .iter()
        .filter_map(|core| {
            let jobs: Vec<String> = plan
                .online
                .iter()
                .filter(|(_, j)| j.values().any(|i| !i.cpus.is_disjoint(&core.cpus)))
                .map(|(id, _)| id.to_string())
                .collect();
            (jobs.len() > 1).then(|| format!("core {}: {}", core.cpus, jobs.join(" and ")))
        })
        .collect()
}

/// Odd layouts of two online jobs on an SMT host: each job's odd CPU splits a whole core of its
/// own rather than take the sibling of the other job's (Cloud Reamer §III-A: an online job's
/// cores are its own); the half-cores left stay empty (no offline instance beside an online
/// thread). When whole cores run out, a sibling of another job's instance is still taken
/// rather than leave an instance unplaced.
#[test]
fn odd_online_layouts_do_not_share_a_core_between_jobs() {
    // 8 cores × 2 threads: cpu i and i+8 are siblings.
    let topo = Topology::synthetic(1, 1, 8, 2, 0);
    let online = [
        online_job(1, 1, 3, 1),
        online_job(2, 1, 3, 1),
        online_job(3, 3, 1, 1),
    ];
    let offline = [offline_job(4, None)];
    let none = CpuSet::new();
    let plan = place_fresh(&topo, &none, &none, &online, &offline);
    assert_eq!(
        cores_shared_between_online_jobs(&topo, &plan),
        Vec::<String>::new()
    );
    assert_eq!(plan.online_cpus().len(), 9);
    // Idempotent, like every plan.
    assert_eq!(place(&topo, &none, &none, &online, &offline, &plan), plan);

    // 3 cores: 3 + 3 one-CPU instances need every thread, so job 2 takes the sibling of job
    // 1's odd CPU rather than fall one short.
    let topo = Topology::synthetic(1, 1, 3, 2, 0);
    let online = [online_job(1, 1, 3, 1), online_job(2, 1, 3, 1)];
    let plan = place_fresh(&topo, &none, &none, &online, &[]);
    assert!(plan.shortfall.is_empty(), "{:?}", plan.shortfall);
    assert_eq!(plan.online_cpus().len(), 6);
}

#[test]
fn offline_jobs_share_fairly_with_caps() {
    assert_eq!(fair_shares(10, &[usize::MAX, usize::MAX]), [5, 5]);
    assert_eq!(fair_shares(11, &[usize::MAX, usize::MAX]), [6, 5]);
    assert_eq!(fair_shares(10, &[2, usize::MAX, usize::MAX]), [2, 4, 4]);
    assert_eq!(fair_shares(3, &[0, 5]), [0, 3]);
    assert_eq!(fair_shares(0, &[5]), [0]);
    assert_eq!(fair_shares(5, &[]), Vec::<usize>::new());

    let topo = Topology::synthetic(1, 1, 8, 1, 0);
    let training = set("0-3");
    let offline = [offline_job(1, Some(3)), offline_job(2, None)];
    let plan = place(
        &topo,
        &CpuSet::new(),
        &training,
        &[],
        &offline,
        &InferencePlan::default(),
    );
    check_plan(&topo, &CpuSet::new(), &training, &[], &offline, &plan).unwrap();
    let cpus = |seq| union_of(plan.offline[&id(seq)].values()).to_string();
    // 4 idle CPUs split 2/2, then the training CPUs: j1 has room for 1 more, j2 the rest.
    assert_eq!(cpus(1), "0,4-5");
    assert_eq!(cpus(2), "1-3,6-7");
}

#[test]
fn placement_after_a_training_job_arrives_and_leaves() {
    use crate::policy::{decide, TrainingJobView};
    let topo = server64();
    let reserved = set("0,32");
    let online = [online_job(1, 4, 4, 8)];
    let offline = [offline_job(2, None)];
    let before = place(
        &topo,
        &reserved,
        &CpuSet::new(),
        &online,
        &offline,
        &InferencePlan::default(),
    );
    let count = |p: &InferencePlan| -> usize {
        p.online
            .values()
            .chain(p.offline.values())
            .map(|j| j.len())
            .sum()
    };
    assert_eq!(count(&before), 4 + 64 - 2 - 16);
    assert_eq!(
        online_lists(&before, 1),
        ["14-15,46-47", "12-13,44-45", "10-11,42-43", "8-9,40-41"]
    );

    // A small training job lands next to the reserved core: the lodgers were placed away
    // from there, so nothing online moves.
    let small = [TrainingJobView {
        id: id(7),
        cores: 8,
        gpus: vec![0],
        within: None,
    }];
    let training = training_cpus(&decide(&topo, &reserved, &small, &Plan::default()));
    assert_eq!(training.to_string(), "1-4,33-36");
    let r = place(&topo, &reserved, &training, &online, &offline, &before);
    assert_eq!(r.online, before.online);

    // A large one (decide knows nothing of lodgers) takes cores under three instances.
    let large = [TrainingJobView {
        id: id(7),
        cores: 24,
        gpus: vec![0],
        within: None,
    }];
    let training = training_cpus(&decide(&topo, &reserved, &large, &Plan::default()));
    assert_eq!(training.to_string(), "1-12,33-44");
    let after = &place(&topo, &reserved, &training, &online, &offline, &before);
    check_plan(&topo, &reserved, &training, &online, &offline, after).unwrap();
    assert!(after.online_cpus().is_disjoint(&training));
    assert_eq!(
        online_lists(after, 1),
        ["14-15,46-47", "30-31,62-63", "28-29,60-61", "26-27,58-59"]
    );
    // Instance 0 stays; the three under training move.
    let (b, a) = (&before.online[&id(1)], &after.online[&id(1)]);
    assert_eq!(a.keys().collect::<Vec<_>>(), [&0, &1, &2, &3]);
    assert_eq!(a[&0], b[&0]);
    assert!((1..4).all(|i| a[&i].cpus != b[&i].cpus));
    // Offline instances run on the training CPUs too (idle first, and all are used).
    assert!(training.is_subset(&after.offline_cpus()));
    assert_eq!(
        &place(&topo, &reserved, &training, &online, &offline, after),
        after,
        "nothing to do the second time"
    );

    // The training job leaves: the online instances stay where they are.
    let left = place(&topo, &reserved, &CpuSet::new(), &online, &offline, after);
    check_plan(&topo, &reserved, &CpuSet::new(), &online, &offline, &left).unwrap();
    assert_eq!(left.online, after.online);
    assert_eq!(left.offline_cpus(), after.offline_cpus());
}

#[test]
fn placement_without_room_drops_online_instances_rather_than_share() {
    let topo = Topology::synthetic(1, 1, 8, 1, 0);
    let online = [online_job(1, 2, 3, 1)];
    let before = place(
        &topo,
        &CpuSet::new(),
        &CpuSet::new(),
        &online,
        &[],
        &InferencePlan::default(),
    );
    assert_eq!(online_lists(&before, 1), ["6-7", "4-5", "2-3"]);
    let training = set("2-5");
    let r = place(&topo, &CpuSet::new(), &training, &online, &[], &before);
    assert_eq!(online_lists(&r, 1), ["6-7", "0-1"]);
    // Instance 0 stays, 1 moves off training, 2 goes.
    let (b, a) = (&before.online[&id(1)], &r.online[&id(1)]);
    assert_eq!(a.keys().collect::<Vec<_>>(), [&0, &1]);
    assert_eq!(a[&0], b[&0]);
    assert_ne!(a[&1].cpus, b[&1].cpus);
    assert_eq!(r.shortfall[&id(1)].placed, 2);
}

#[test]
fn layout_changes_keep_or_relay_instances() {
    let topo = server64();
    let before = place(
        &topo,
        &CpuSet::new(),
        &CpuSet::new(),
        &[online_job(1, 2, 2, 4)],
        &[],
        &InferencePlan::default(),
    );
    let b = &before.online[&id(1)];
    let relaid =
        |job: OnlineJobView| place(&topo, &CpuSet::new(), &CpuSet::new(), &[job], &[], &before);
    // New batch: both stay in place with the new batch.
    let r = relaid(online_job(1, 2, 2, 8));
    let a = &r.online[&id(1)];
    assert_eq!(a.len(), 2);
    assert!(a
        .iter()
        .all(|(i, inst)| inst.cpus == b[i].cpus && inst.batch == 8));
    // One more instance: the two stay, instance 2 is new.
    let r = relaid(online_job(1, 2, 3, 4));
    let a = &r.online[&id(1)];
    assert_eq!(a.keys().collect::<Vec<_>>(), [&0, &1, &2]);
    assert!((0..2).all(|i| a[&i] == b[&i]));
    // Other cores per instance: everything is re-laid-out; instance 0 has 4 threads on new
    // CPUs, instance 1 goes.
    let r = relaid(online_job(1, 4, 1, 4));
    let a = &r.online[&id(1)];
    assert_eq!(a.keys().collect::<Vec<_>>(), [&0]);
    assert_eq!(a[&0].threads, 4);
    assert_ne!(a[&0].cpus, b[&0].cpus);
    // Unregistered: none left.
    let r = place(&topo, &CpuSet::new(), &CpuSet::new(), &[], &[], &before);
    assert!(r.online.is_empty());
}

#[test]
fn fixture_topologies() {
    use crate::policy::{decide, TrainingJobView};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysfs");
    for (name, reserved, train_cores, online, want_first) in [
        (
            "server-2s-64cpu-8gpu",
            "0,32",
            16,
            online_job(2, 4, 4, 8),
            "30-31,62-63",
        ),
        (
            "server-1s-32cpu-2gpu",
            "0",
            8,
            online_job(2, 2, 6, 8),
            "30-31",
        ),
        ("vm-2cpu", "", 1, online_job(2, 1, 1, 1), "1"),
    ] {
        let topo = Topology::read(&root.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let reserved = set(reserved);
        let jobs = [TrainingJobView {
            id: id(1),
            cores: train_cores,
            gpus: vec![4.min(u32::try_from(topo.gpus.len()).unwrap().saturating_sub(1))],
            within: None,
        }];
        let training_plan = decide(&topo, &reserved, &jobs, &Plan::default());
        let training = training_cpus(&training_plan);
        assert_eq!(training.len(), train_cores as usize, "{name}");
        let online = [online];
        let offline = [offline_job(3, None)];
        let plan = place(
            &topo,
            &reserved,
            &training,
            &online,
            &offline,
            &InferencePlan::default(),
        );
        check_plan(&topo, &reserved, &training, &online, &offline, &plan)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(online_lists(&plan, 2)[0], want_first, "{name}");
        assert!(plan.online_cpus().is_disjoint(&training), "{name}");
        assert!(
            training.is_subset(&plan.offline_cpus()),
            "{name}: offline on the training CPUs"
        );
        // The training job leaves: the online instances stay.
        let r = place(&topo, &reserved, &CpuSet::new(), &online, &offline, &plan);
        assert_eq!(r.online, plan.online, "{name}");
    }
}

#[test]
fn plan_round_trips_through_json() {
    let topo = server64();
    let plan = place(
        &topo,
        &set("0,32"),
        &set("1-4,33-36"),
        &[online_job(1, 4, 2, 8)],
        &[offline_job(2, Some(5))],
        &InferencePlan::default(),
    );
    let json = serde_json::to_string(&plan).unwrap();
    let back: InferencePlan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, plan);
}

// -----------------------------------------------------------------------------------------
// Capacity

#[test]
fn capacity_table() {
    let l = layout(2, 4, 8);
    // (throughput, placed, expected, measured demand) → (capacity, serves expected, exceeded)
    let cases = [
        (400.0, 4, 300.0, None, 400.0, true, false),
        (400.0, 4, 300.0, Some(450.0), 400.0, true, true),
        (400.0, 2, 300.0, None, 200.0, false, true),
        (400.0, 2, 300.0, Some(150.0), 200.0, false, false),
        (400.0, 9, 300.0, None, 400.0, true, false),
        (f64::NAN, 4, 10.0, None, 0.0, false, true),
        (400.0, 4, -1.0, Some(f64::INFINITY), 400.0, true, false),
    ];
    for (tp, placed, expected, demand, cap, serves, exceeded) in cases {
        let c = check_capacity(&l, tp, placed, expected, demand);
        assert_eq!(
            (c.capacity_per_s, c.serves_expected, c.exceeded),
            (cap, serves, exceeded),
            "{tp} {placed} {expected} {demand:?}"
        );
    }
    let none = check_capacity(&layout(2, 0, 1), 100.0, 0, 1.0, None);
    assert!(none.exceeded && none.capacity_per_s == 0.0);
}
