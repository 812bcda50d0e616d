//! Properties of inference placement over random operation sequences and machine shapes
//! (proptest): what every plan must satisfy, idempotence, whole cores and one node, no core
//! shared between online jobs.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;

use super::tests::{
    check_plan, cores_shared_between_online_jobs, id, layout, offline_job, online_job,
};
use super::*;
use crate::cpuset::CpuSet;
use crate::policy::Plan;
use crate::topology::Topology;

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

}
