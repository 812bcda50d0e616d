//! Batch jobs' CPUs: the cores training and online inference leave (never one of theirs), shared
//! by every batch job (and offline inference), inside a Slurm job's own cpuset, cut to a cap or
//! to what contention control leaves a throttled job (SODA §V-E: halving its cores where MBA is
//! absent). Pure: touches nothing.

use std::collections::BTreeMap;

use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::topology::Topology;

use super::inference::InferencePlan;
use super::Placement;

/// What batch placement needs to know about one batch job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchJobView {
    pub id: JobId,
    /// The CPUs someone else confines the job to (a Slurm job's cpuset); `None`: the node.
    pub within: Option<CpuSet>,
    /// Most CPUs it may have: its own cap (`cores`, if any) or contention's cut, the lower.
    pub cap: Option<u32>,
}

/// Where each batch job runs, or why it cannot run anywhere lodger allows.
pub type BatchPlan = BTreeMap<JobId, Result<Placement, String>>;

/// The CPUs batch jobs may use: online CPUs not `closed` to lodgers (reserved, not lendable,
/// exclusive training jobs'), not training's, and not on a core an online instance holds (its
/// CPUs and their SMT siblings, as offline instances keep off them: a batch job beside an
/// online instance on one core would share its execution units and caches).
pub fn leftover(
    topo: &Topology,
    closed: &CpuSet,
    training: &CpuSet,
    inference: &InferencePlan,
) -> CpuSet {
    topo.online()
        .difference(closed)
        .difference(training)
        .difference(&inference.online_cores(topo))
}

/// Places every job on `leftover` (within its confinement), cut to its cap in whole cores.
pub fn place(topo: &Topology, leftover: &CpuSet, jobs: &[BatchJobView]) -> BatchPlan {
    jobs.iter()
        .map(|job| {
            let base = match &job.within {
                Some(w) => leftover.intersection(w),
                None => leftover.clone(),
            };
            let placed = if base.is_empty() {
                Err(match &job.within {
                    Some(w) => format!(
                        "no core of its cpuset ({w}) is left by training and online inference"
                    ),
                    None => "training and online inference hold every core".to_string(),
                })
            } else {
                let cpus = match job.cap {
                    Some(n) => take_whole_cores(topo, &base, n.max(1)),
                    None => base,
                };
                Ok(Placement {
                    mems: topo.numa_nodes_of(&cpus),
                    cpus,
                })
            };
            (job.id.clone(), placed)
        })
        .collect()
}

/// `n` CPUs of `from` (all of it when it has no more), whole physical cores first, then the
/// fragments of cores partly in `from`, each in the node's core order.
pub fn take_whole_cores(topo: &Topology, from: &CpuSet, n: u32) -> CpuSet {
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    if from.len() <= n {
        return from.clone();
    }
    let mut out = CpuSet::new();
    let whole = topo.cores.iter().filter(|c| c.cpus.is_subset(from));
    let partial = topo
        .cores
        .iter()
        .filter(|c| !c.cpus.is_subset(from) && !c.cpus.is_disjoint(from));
    for core in whole.chain(partial) {
        for cpu in core.cpus.intersection(from).iter() {
            if out.len() >= n {
                return out;
            }
            out.insert(cpu);
        }
    }
    // CPUs of `from` the topology does not know (offline meanwhile) are not placed on.
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn set(list: &str) -> CpuSet {
        CpuSet::parse(list).unwrap()
    }

    fn view(seq: u64, within: Option<&str>, cap: Option<u32>) -> BatchJobView {
        BatchJobView {
            id: JobId::from_seq(seq),
            within: within.map(set),
            cap,
        }
    }

    /// 2 sockets x 8 cores x 2 threads: core k is CPUs k and k+16.
    fn node() -> Topology {
        Topology::synthetic(2, 1, 8, 2, 0)
    }

    #[test]
    fn every_batch_job_shares_the_leftover_cores_within_its_confinement() {
        let topo = node();
        let leftover = set("4-15,20-31");
        let plan = place(
            &topo,
            &leftover,
            &[view(1, None, None), view(2, Some("0-7,16-23"), None)],
        );
        assert_eq!(plan[&JobId::from_seq(1)].as_ref().unwrap().cpus, leftover);
        let j2 = plan[&JobId::from_seq(2)].as_ref().unwrap();
        assert_eq!(j2.cpus.to_string(), "4-7,20-23");
        assert_eq!(j2.mems.to_string(), "0");
    }

    #[test]
    fn a_cut_takes_whole_cores_first() {
        let topo = node();
        // Core 4 (CPUs 4, 20) whole; core 5 only CPU 5; core 6 whole.
        let leftover = set("4-6,20,22");
        let plan = place(&topo, &leftover, &[view(1, None, Some(4))]);
        assert_eq!(
            plan[&JobId::from_seq(1)].as_ref().unwrap().cpus.to_string(),
            "4,6,20,22"
        );
        let plan = place(&topo, &leftover, &[view(1, None, Some(5))]);
        assert_eq!(plan[&JobId::from_seq(1)].as_ref().unwrap().cpus, leftover);
        // A cap of 0 still leaves the job one CPU.
        let plan = place(&topo, &leftover, &[view(1, None, Some(0))]);
        assert_eq!(plan[&JobId::from_seq(1)].as_ref().unwrap().cpus.len(), 1);
    }

    /// Review finding (placement): batch jobs were given the SMT sibling of an online
    /// instance's CPU (only the instance's CPUs were taken out), so a noisy batch job shared a
    /// core with latency-bound inference that offline instances keep off.
    #[test]
    fn leftover_keeps_off_training_and_online_instances_cores() {
        use crate::policy::inference::{Instance, JobInstances};
        let topo = node();
        let mut inference = InferencePlan::default();
        // One online instance on CPU 5 alone: core 5 is CPUs 5 and 21.
        let instance = Instance {
            cpus: set("5"),
            mems: set("0"),
            threads: 1,
            batch: 1,
        };
        inference.online.insert(
            JobId::from_seq(7),
            JobInstances::from([(0, instance.clone())]),
        );
        // An offline instance's CPU stays open to batch jobs.
        inference.offline.insert(
            JobId::from_seq(8),
            JobInstances::from([(
                0,
                Instance {
                    cpus: set("6"),
                    ..instance
                },
            )]),
        );
        let left = leftover(&topo, &set("0,16"), &set("1-2,17-18"), &inference);
        assert_eq!(left.to_string(), "3-4,6-15,19-20,22-31");
        assert!(!left.contains(21), "the online instance's sibling");
    }

    #[test]
    fn no_leftover_core_is_said_not_taken_from_training() {
        let topo = node();
        let plan = place(
            &topo,
            &set("8-9"),
            &[view(1, None, None), view(2, Some("0-3"), None)],
        );
        assert!(plan[&JobId::from_seq(1)].is_ok());
        let why = plan[&JobId::from_seq(2)].as_ref().unwrap_err();
        assert!(why.contains("0-3"), "{why}");
        let plan = place(&topo, &CpuSet::new(), &[view(1, None, None)]);
        assert!(plan[&JobId::from_seq(1)].is_err());
    }
}
