//! Tests of inference placement, capacity and the layout search.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::place::fair_shares;
use super::search::{classify, Sample};
use super::sim::*;
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

fn id(seq: u64) -> JobId {
    JobId::from_seq(seq)
}

fn layout(cores: u32, instances: u32, batch: u32) -> LayoutConfig {
    LayoutConfig {
        cores_per_instance: cores,
        instances,
        batch,
    }
}

fn online_job(seq: u64, cores: u32, instances: u32, batch: u32) -> OnlineJobView {
    OnlineJobView {
        id: id(seq),
        layout: layout(cores, instances, batch),
    }
}

fn offline_job(seq: u64, max: Option<u32>) -> OfflineJobView {
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
fn check_plan(
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
fn cores_shared_between_online_jobs(topo: &Topology, plan: &InferencePlan) -> Vec<String> {
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

// -----------------------------------------------------------------------------------------
// Search

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
    let trend = classify(&sample_of_probe(&first), &sample_of_probe(&second));
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
        &sample_of_probe(&measure(&model, asked[0])),
        &sample_of_probe(&measure(&model, asked[1])),
    );
    assert_eq!(trend, BatchTrend::ComputeBound);
    let middle = (f64::from(asked[1].batch)).sqrt().round() as u32;
    assert_ne!(asked[2], layout(8, 4, middle), "no cache probe");
}

fn sample_of_probe(r: &ProbeResult) -> Sample {
    Sample {
        throughput: r.throughput_per_s,
        p99: r.p99_latency_ms,
        ipc: r.ipc,
        miss: r.cache_miss_ratio,
        windows: 1,
        n: r.latency_samples,
        p50: r.p50_latency_ms,
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

// -----------------------------------------------------------------------------------------
// Properties

#[derive(Debug, Clone)]
enum Op {
    AddTraining {
        cores: u32,
        gpu: u8,
    },
    RemoveTraining(usize),
    Relayout {
        job: usize,
        cores: u8,
        instances: u8,
        batch: u8,
    },
    Reserve(u32),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            3 => (any::<u32>(), any::<u8>())
                .prop_map(|(cores, gpu)| Op::AddTraining { cores, gpu }),
            2 => any::<usize>().prop_map(Op::RemoveTraining),
            2 => (any::<usize>(), 1u8..=8, 1u8..=8, 1u8..=32).prop_map(
                |(job, cores, instances, batch)| Op::Relayout { job, cores, instances, batch }
            ),
            1 => any::<u32>().prop_map(Op::Reserve),
        ],
        1..12,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn placement_properties(
        topo in crate::policy::consolidate::tests::topologies(),
        online_raw in proptest::collection::vec((1u8..=8, 1u8..=8, 1u8..=32), 0..3),
        offline_caps in proptest::collection::vec(proptest::option::of(0u32..40), 0..3),
        ops in ops(),
    ) {
        use crate::policy::{decide, TrainingJobView};
        let ncpus = u32::try_from(topo.cpus.len()).unwrap();
        let mut reserved = CpuSet::new();
        let mut online: Vec<OnlineJobView> = online_raw
            .iter()
            .enumerate()
            .map(|(i, &(c, n, b))| online_job(100 + i as u64, c.into(), n.into(), b.into()))
            .collect();
        let offline: Vec<OfflineJobView> = offline_caps
            .iter()
            .enumerate()
            .map(|(i, &cap)| offline_job(200 + i as u64, cap))
            .collect();
        let mut training_jobs: Vec<TrainingJobView> = Vec::new();
        let mut training_plan = Plan::default();
        let mut plan = InferencePlan::default();
        let mut seq = 0;
        for op in ops {
            match op {
                Op::AddTraining { cores, gpu } => {
                    seq += 1;
                    training_jobs.push(TrainingJobView {
                        id: id(seq),
                        cores: cores % (ncpus / 2 + 1) + 1,
                        gpus: vec![u32::from(gpu % 8)],
                        within: None,
                    });
                }
                Op::RemoveTraining(i) if !training_jobs.is_empty() => {
                    training_jobs.remove(i % training_jobs.len());
                }
                Op::RemoveTraining(_) => {}
                Op::Relayout { job, cores, instances, batch } if !online.is_empty() => {
                    let n = online.len();
                    online[job % n].layout = layout(cores.into(), instances.into(), batch.into());
                }
                Op::Relayout { .. } => {}
                Op::Reserve(cpu) => {
                    reserved.insert(cpu % ncpus);
                }
            }
            training_plan = decide(&topo, &reserved, &training_jobs, &training_plan);
            let training = training_cpus(&training_plan);
            let next = place(&topo, &reserved, &training, &online, &offline, &plan);
            if let Err(e) = check_plan(&topo, &reserved, &training, &online, &offline, &next) {
                return Err(TestCaseError::fail(e));
            }
            // Online instances that are still valid stay where they were.
            let free = topo.online().difference(&reserved).difference(&training);
            for job in &online {
                let Some(prev) = plan.online.get(&job.id) else { continue };
                for (index, inst) in prev {
                    let valid = inst.cpus.len() == job.layout.cores_per_instance as usize
                        && inst.cpus.is_subset(&free);
                    let kept_all = prev.len() <= job.layout.instances as usize;
                    if valid && kept_all {
                        let now = next.online.get(&job.id).and_then(|j| j.get(index));
                        prop_assert_eq!(
                            now.map(|i| &i.cpus), Some(&inst.cpus),
                            "{}/{} moved", job.id, index
                        );
                    }
                }
            }
            // Idempotent: placing again from the result changes nothing.
            let again = place(&topo, &reserved, &training, &online, &offline, &next);
            prop_assert_eq!(&again, &next);
            plan = next;
        }
    }

    /// Online jobs of any layouts whose CPUs, rounded up to whole cores job by job, fit the
    /// free cores of one node: no physical core holds instances of two jobs, and every instance
    /// is placed.
    #[test]
    fn online_jobs_never_share_a_core_while_whole_cores_last(
        cores in 2u32..=24,
        layouts in proptest::collection::vec((1u32..=5, 1u32..=6), 1..5),
    ) {
        let topo = Topology::synthetic(1, 1, cores, 2, 0);
        let online: Vec<OnlineJobView> = layouts
            .iter()
            .enumerate()
            .map(|(i, &(k, n))| online_job(i as u64 + 1, k, n, 1))
            .collect();
        let need: u32 = layouts.iter().map(|&(k, n)| (k * n).div_ceil(2)).sum();
        prop_assume!(need <= cores);
        let none = CpuSet::new();
        let plan = place(&topo, &none, &none, &online, &[], &InferencePlan::default());
        prop_assert!(plan.shortfall.is_empty(), "{:?}", plan.shortfall);
        let shared = cores_shared_between_online_jobs(&topo, &plan);
        prop_assert!(shared.is_empty(), "{shared:?}");
    }

    #[test]
    fn online_instances_take_whole_cores_and_one_node(
        sockets in 1u32..=2,
        nodes in 1u32..=2,
        cores_per_node in 2u32..=24,
        train_cores in proptest::collection::vec(1u32..=12, 0..3),
        half_cores in 1u32..=4,
        instances in 1u32..=8,
    ) {
        use crate::policy::{decide, TrainingJobView};
        let topo = Topology::synthetic(sockets, nodes, cores_per_node, 2, 1);
        // Training in whole cores, so the free CPUs are whole cores.
        let jobs: Vec<TrainingJobView> = train_cores
            .iter()
            .enumerate()
            .map(|(i, &c)| TrainingJobView { id: id(i as u64 + 1), cores: 2 * c, gpus: vec![0], within: None })
            .collect();
        let training = training_cpus(&decide(&topo, &CpuSet::new(), &jobs, &Plan::default()));
        let k = 2 * half_cores;
        let online = [online_job(50, k, instances, 1)];
        let plan = place(&topo, &CpuSet::new(), &training, &online, &[], &InferencePlan::default());
        let mut avail = topo.online().difference(&training);
        for inst in plan.online.get(&id(50)).map(|j| j.values()).into_iter().flatten() {
            for cpu in &inst.cpus {
                prop_assert!(
                    topo.siblings(cpu).unwrap().is_subset(&inst.cpus),
                    "{} splits a core", inst.cpus
                );
            }
            // One NUMA node whenever one could hold it at its turn.
            let could = topo
                .numa_nodes
                .values()
                .any(|n| n.cpus.intersection(&avail).len() >= k as usize);
            if could {
                prop_assert_eq!(inst.mems.len(), 1, "{} spans nodes", inst.cpus);
            }
            avail = avail.difference(&inst.cpus);
        }
    }

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
