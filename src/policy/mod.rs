//! Pure decisions: plain data in, a `Plan` out. No I/O, no clock; time and observations are
//! arguments.

pub mod batch;
pub mod consolidate;
pub mod contention;
mod cores;
pub mod inference;
pub mod rightsize;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::topology::Topology;

use consolidate::{NoCapacity, TrainingAsk};

/// What the node should look like: where each training job runs, and why the others do not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub training: BTreeMap<JobId, Placement>,
    pub unplaced: BTreeMap<JobId, NoCapacity>,
}

/// A training job's cpuset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub cpus: CpuSet,
    /// The NUMA nodes of `cpus` (its `cpuset.mems`).
    pub mems: CpuSet,
}

/// What the policy needs to know about a registered training job.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingJobView {
    pub id: JobId,
    /// Logical CPUs wanted.
    pub cores: u32,
    /// GPU indices (PCI bus order).
    pub gpus: Vec<u32>,
    /// The CPUs someone else confines the job to (a Slurm job's cpuset): its placement is
    /// taken from them only. `None`: anywhere on the node.
    pub within: Option<CpuSet>,
}

/// The plan [`decide`] last left unchanged, and the jobs it did so for: while the training jobs
/// stay the same and the plan is still that one, deciding again would give it back, so a steady
/// tick skips the work (issue 21: deciding for 60 training jobs on 192 CPUs was a tenth of an
/// idle tick). Only a plan `decide` was seen to return unchanged is remembered, so a skip never
/// relies on anything but `decide` being pure.
#[derive(Debug, Default)]
pub struct SteadyPlan {
    seen: Option<(Vec<TrainingJobView>, Plan)>,
}

impl SteadyPlan {
    /// `decide(topo, reserved, jobs, previous)`, skipped (returning `None`: keep `previous`)
    /// when it would give `previous` back for these jobs, as it did last time.
    pub fn decide(
        &mut self,
        topo: &Topology,
        reserved: &CpuSet,
        jobs: Vec<TrainingJobView>,
        previous: &Plan,
    ) -> Option<Plan> {
        if let Some((seen_jobs, seen_plan)) = &self.seen {
            if *seen_jobs == jobs && seen_plan == previous {
                return None;
            }
        }
        let plan = decide(topo, reserved, &jobs, previous);
        self.seen = (plan == *previous).then(|| (jobs, plan.clone()));
        Some(plan)
    }
}

/// Cloud Reamer §III-A: consolidates each training job onto its own set of cores, keeping the
/// core allocation table (the previous plan) and taking cores for new jobs from the unallocated
/// ones.
///
/// Keeps every previous placement that is still valid (inside online CPUs minus reserved,
/// disjoint from the others kept), then places the others in id order (`JobId::seq`). A
/// running training job is never moved to make room: moving its cpuset costs it more than a
/// newcomer waiting. Jobs absent from `jobs` are dropped, which frees their CPUs.
///
/// A placed job that asks for fewer keeps part of its CPUs (whole cores, next to the other
/// training jobs, as a new placement of that size would choose among them). A placed job that
/// asks for more (a right-sizing probe, an RT guard core) keeps its CPUs through the pass, so no
/// other job takes them, and gets the most it asked for that fits beside them: its own CPUs and
/// free ones, else it stays where it is. Resizing never moves a job's threads off the CPUs it
/// keeps, and asking for more never un-places it.
///
/// Pure and idempotent: `decide(.., &decide(..)) == decide(..)`.
pub fn decide(
    topo: &Topology,
    reserved: &CpuSet,
    jobs: &[TrainingJobView],
    previous: &Plan,
) -> Plan {
    let usable = topo.online().difference(reserved);
    let mut ordered: Vec<&TrainingJobView> = jobs.iter().collect();
    ordered.sort_by(|a, b| (a.id.seq(), &a.id).cmp(&(b.id.seq(), &b.id)));
    // A job listed twice is placed once (the first listing wins).
    ordered.dedup_by(|later, earlier| later.id == earlier.id);

    let mut plan = Plan::default();
    let mut taken = CpuSet::new();
    // Placed jobs that ask for more, each holding its CPUs until its turn.
    let mut growing: BTreeMap<&JobId, &CpuSet> = BTreeMap::new();
    for job in &ordered {
        let Some(prev) = previous.training.get(&job.id) else {
            continue;
        };
        let had = u32::try_from(prev.cpus.len()).unwrap_or(u32::MAX);
        let inside = job.within.as_ref().map_or(true, |w| prev.cpus.is_subset(w));
        if !(inside && prev.cpus.is_subset(&usable) && prev.cpus.is_disjoint(&taken)) {
            continue;
        }
        if had > job.cores {
            // Shrunk (a right-sizing probe, a core the RT guard gives back): the part of its
            // CPUs a placement of the new size would take, so its threads stay where they ran
            // and nothing else moves for it. Placed afresh it could land anywhere free, on an
            // online instance's cores among them.
            let outside =
                off_limits(topo, reserved, job).union(&topo.online().difference(&prev.cpus));
            let ask = TrainingAsk {
                cores: job.cores,
                gpus: &job.gpus,
            };
            if let Ok(cpus) = consolidate::place(topo, &outside, &taken, &ask) {
                taken = taken.union(&cpus);
                plan.training.insert(job.id.clone(), placement(topo, cpus));
            }
            continue;
        }
        taken = taken.union(&prev.cpus);
        if had == job.cores {
            plan.training
                .insert(job.id.clone(), placement(topo, prev.cpus.clone()));
        } else {
            growing.insert(&job.id, &prev.cpus);
        }
    }

    let mut failed = Vec::new();
    for job in &ordered {
        if plan.training.contains_key(&job.id) {
            continue;
        }
        let ask = TrainingAsk {
            cores: job.cores,
            gpus: &job.gpus,
        };
        if let Some(held) = growing.get(&job.id) {
            // Its own CPUs and the free ones: the most it can have. It keeps its own and gets
            // the rest beside them (a new placement would move its threads, and could take an
            // online instance's cores it did not need). Where nothing is free, it stays.
            let free = topo
                .online()
                .difference(&off_limits(topo, reserved, job))
                .difference(&taken);
            let had = held.len();
            let more = u32::try_from(free.len()).unwrap_or(u32::MAX).min(
                job.cores
                    .saturating_sub(u32::try_from(had).unwrap_or(u32::MAX)),
            );
            let mut cpus = (*held).clone();
            if more > 0 {
                let extra = TrainingAsk {
                    cores: more,
                    gpus: &job.gpus,
                };
                let off = off_limits(topo, reserved, job);
                if let Ok(added) = consolidate::place_beside(topo, &off, &taken, held, &extra) {
                    cpus = cpus.union(&added);
                }
            }
            taken = taken.union(&cpus);
            plan.training.insert(job.id.clone(), placement(topo, cpus));
            continue;
        }
        match consolidate::place(topo, &off_limits(topo, reserved, job), &taken, &ask) {
            Ok(cpus) => {
                taken = taken.union(&cpus);
                plan.training.insert(job.id.clone(), placement(topo, cpus));
            }
            Err(_) => failed.push(*job),
        }
    }
    // Explain each refusal against the final allocation, not the one at its turn: free space
    // only shrinks during a pass, so the job still does not fit, and the explanation is then the
    // same when the plan is decided again from itself (idempotence).
    for job in failed {
        let ask = TrainingAsk {
            cores: job.cores,
            gpus: &job.gpus,
        };
        plan.unplaced.insert(
            job.id.clone(),
            consolidate::shortfall(topo, &off_limits(topo, reserved, job), &taken, &ask),
        );
    }
    plan
}

/// The CPUs a job may not be placed on: the reserved ones, and those outside its confinement.
fn off_limits(topo: &Topology, reserved: &CpuSet, job: &TrainingJobView) -> CpuSet {
    match &job.within {
        Some(w) => reserved.union(&topo.online().difference(w)),
        None => reserved.clone(),
    }
}

fn placement(topo: &Topology, cpus: CpuSet) -> Placement {
    Placement {
        mems: topo.numa_nodes_of(&cpus),
        cpus,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(list: &str) -> CpuSet {
        CpuSet::parse(list).unwrap()
    }

    fn job(seq: u64, cores: u32, gpus: &[u32]) -> TrainingJobView {
        TrainingJobView {
            id: JobId::from_seq(seq),
            cores,
            gpus: gpus.to_vec(),
            within: None,
        }
    }

    fn cpus_of(plan: &Plan, seq: u64) -> String {
        plan.training[&JobId::from_seq(seq)].cpus.to_string()
    }

    fn server64() -> Topology {
        Topology::synthetic(2, 1, 16, 2, 4)
    }

    /// Issue 21: a tick whose training jobs did not change keeps the plan without deciding;
    /// any change to the jobs, or a plan changed by someone else, decides again.
    #[test]
    fn a_steady_plan_is_decided_once() {
        let topo = server64();
        let reserved = set("0,32");
        let jobs = vec![job(1, 4, &[0]), job(2, 2, &[1])];
        let mut steady = SteadyPlan::default();
        let first = steady
            .decide(&topo, &reserved, jobs.clone(), &Plan::default())
            .expect("nothing seen: decided");
        assert_eq!(first, decide(&topo, &reserved, &jobs, &Plan::default()));
        // The first plan differs from the empty one it started from, so it is not yet known
        // to be steady: decided once more, and it comes back unchanged.
        let again = steady.decide(&topo, &reserved, jobs.clone(), &first);
        assert_eq!(again.as_ref(), Some(&first));
        assert_eq!(steady.decide(&topo, &reserved, jobs.clone(), &first), None);
        // A job's cores change: decided again.
        let mut grown = jobs.clone();
        grown[1].cores = 3;
        let regrown = steady
            .decide(&topo, &reserved, grown.clone(), &first)
            .expect("changed jobs: decided");
        assert_eq!(regrown, decide(&topo, &reserved, &grown, &first));
        // The plan it is given is not the one it saw steady: decided again.
        let _ = steady.decide(&topo, &reserved, grown.clone(), &regrown);
        assert_eq!(
            steady.decide(&topo, &reserved, grown.clone(), &regrown),
            None
        );
        assert!(steady
            .decide(&topo, &reserved, grown, &Plan::default())
            .is_some());
    }

    #[test]
    fn places_in_id_order_and_keeps_placements() {
        let topo = server64();
        let reserved = set("0,32");
        // Listed out of order: j2 is placed before j10.
        let jobs = [job(10, 4, &[4]), job(2, 4, &[4])];
        let plan = decide(&topo, &reserved, &jobs, &Plan::default());
        assert_eq!(cpus_of(&plan, 2), "16-17,48-49");
        assert_eq!(cpus_of(&plan, 10), "18-19,50-51");
        assert_eq!(plan.training[&JobId::from_seq(2)].mems.to_string(), "1");
        assert!(plan.unplaced.is_empty());

        // A new job with a lower id does not move the running ones.
        let jobs = [job(10, 4, &[4]), job(2, 4, &[4]), job(1, 4, &[4])];
        let next = decide(&topo, &reserved, &jobs, &plan);
        assert_eq!(cpus_of(&next, 2), "16-17,48-49");
        assert_eq!(cpus_of(&next, 10), "18-19,50-51");
        assert_eq!(cpus_of(&next, 1), "20-21,52-53");
    }

    #[test]
    fn invalid_previous_placements_are_redone() {
        let topo = server64();
        let previous = Plan {
            training: BTreeMap::from([
                // Shrunk to 4: keeps 4 of these.
                (
                    JobId::from_seq(1),
                    Placement {
                        cpus: set("20-22,52-54"),
                        mems: set("1"),
                    },
                ),
                // On a CPU that is now reserved.
                (
                    JobId::from_seq(2),
                    Placement {
                        cpus: set("0-1,32-33"),
                        mems: set("0"),
                    },
                ),
                // Overlaps j3, which has the lower id and is kept.
                (
                    JobId::from_seq(3),
                    Placement {
                        cpus: set("8-9,40-41"),
                        mems: set("0"),
                    },
                ),
                (
                    JobId::from_seq(4),
                    Placement {
                        cpus: set("9-10,41-42"),
                        mems: set("0"),
                    },
                ),
            ]),
            unplaced: BTreeMap::new(),
        };
        let jobs = [
            job(1, 4, &[4]),
            job(2, 4, &[0]),
            job(3, 4, &[0]),
            job(4, 4, &[0]),
        ];
        let plan = decide(&topo, &set("0,32"), &jobs, &previous);
        assert_eq!(cpus_of(&plan, 3), "8-9,40-41");
        // Whole cores of its own; the rest freed.
        assert_eq!(cpus_of(&plan, 1), "20-21,52-53");
        // Beside j3, in the smaller of the two gaps around it.
        assert_eq!(cpus_of(&plan, 2), "10-11,42-43");
        assert_eq!(cpus_of(&plan, 4), "12-13,44-45");
    }

    #[test]
    fn unplaced_jobs_are_explained_and_stable() {
        let topo = Topology::synthetic(1, 1, 4, 2, 1);
        let jobs = [job(1, 6, &[0]), job(2, 4, &[0]), job(3, 2, &[0])];
        let plan = decide(&topo, &CpuSet::new(), &jobs, &Plan::default());
        assert_eq!(cpus_of(&plan, 1), "0-2,4-6");
        assert_eq!(cpus_of(&plan, 3), "3,7");
        let why = &plan.unplaced[&JobId::from_seq(2)];
        // Explained against the final allocation (after j3), so deciding again says the same.
        assert_eq!(why.free(), 0);
        assert_eq!(decide(&topo, &CpuSet::new(), &jobs, &plan), plan);

        // Releasing j1 lets j2 in, without moving j3.
        let plan = decide(&topo, &CpuSet::new(), &jobs[1..], &plan);
        assert!(plan.unplaced.is_empty());
        assert_eq!(cpus_of(&plan, 3), "3,7");
        assert_eq!(cpus_of(&plan, 2), "1-2,5-6");
    }

    #[test]
    fn plan_round_trips_through_json() {
        let topo = server64();
        let jobs = [job(1, 8, &[0]), job(2, 80, &[4])];
        let plan = decide(&topo, &set("0,32"), &jobs, &Plan::default());
        assert_eq!(plan.unplaced.len(), 1);
        let json = serde_json::to_string(&plan).unwrap();
        let back: Plan = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plan);
    }

    /// Finding 1 (review at cc00f65): a placed job whose probe asks for more than its CPUs and
    /// the free ones keeps its placement and gets what fits, and keeps it when decided again.
    /// It used to be un-placed, its CPUs left to others while its threads ran on.
    #[test]
    fn a_placed_job_that_asks_for_more_than_fits_keeps_its_cpus_and_gets_the_free_ones() {
        // 16 CPUs, 0 and 8 reserved: 14 usable.
        let topo = Topology::synthetic(2, 1, 4, 2, 0);
        let reserved = set("0,8");
        let jobs = [job(1, 4, &[]), job(2, 8, &[])];
        let plan = decide(&topo, &reserved, &jobs, &Plan::default());
        let (a, b) = (cpus_of(&plan, 1), cpus_of(&plan, 2));
        // A's probe asks for all 14.
        let grown = [job(1, 14, &[]), job(2, 8, &[])];
        let next = decide(&topo, &reserved, &grown, &plan);
        assert!(next.unplaced.is_empty(), "{:?}", next.unplaced);
        assert_eq!(cpus_of(&next, 2), b, "B is not moved");
        let a_now = &next.training[&JobId::from_seq(1)].cpus;
        assert_eq!(a_now.len(), 6, "its 4 and the 2 free: {a_now} (had {a})");
        assert_eq!(decide(&topo, &reserved, &grown, &next), next, "idempotent");
        // Nothing free: it stays where it is.
        let full = [job(1, 6, &[]), job(2, 8, &[]), job(3, 0, &[])];
        let tight = decide(&topo, &reserved, &full, &next);
        let more = [job(1, 9, &[]), job(2, 8, &[]), job(3, 0, &[])];
        let kept = decide(&topo, &reserved, &more, &tight);
        assert_eq!(
            kept.training[&JobId::from_seq(1)],
            tight.training[&JobId::from_seq(1)]
        );
    }

    /// Review finding (placement): a placed job that was resized was placed afresh, so a
    /// right-sizing probe or an RT guard core moved its threads to other CPUs (in 582 of 1,080
    /// resizes of a three-job node), onto cores online instances held among them. It now keeps
    /// what it had: a shrink keeps part of its CPUs, a growth adds beside them (the sibling of
    /// its half-used core first).
    #[test]
    fn a_resized_job_keeps_its_cpus() {
        let topo = server64();
        let reserved = set("0,32");
        let mut jobs = vec![job(1, 1, &[0]), job(2, 1, &[0]), job(3, 4, &[0])];
        let plan = decide(&topo, &reserved, &jobs, &Plan::default());
        assert_eq!(cpus_of(&plan, 1), "1");
        assert_eq!(cpus_of(&plan, 3), "3-4,35-36");
        // Grows by one: the sibling of its own CPU (placed afresh: 5-6,37 for three).
        jobs[0].cores = 2;
        let grown = decide(&topo, &reserved, &jobs, &plan);
        assert_eq!(cpus_of(&grown, 1), "1,33");
        // Grows to 6, then shrinks to 3: inside what it had.
        jobs[0].cores = 6;
        let six = decide(&topo, &reserved, &jobs, &grown);
        let had = six.training[&JobId::from_seq(1)].cpus.clone();
        assert_eq!(had.len(), 6);
        assert!(grown.training[&JobId::from_seq(1)].cpus.is_subset(&had));
        jobs[0].cores = 3;
        let shrunk = decide(&topo, &reserved, &jobs, &six);
        let now = &shrunk.training[&JobId::from_seq(1)].cpus;
        assert_eq!(now.len(), 3);
        assert!(now.is_subset(&had), "{now} not inside {had}");
        // The others never move.
        for p in [&grown, &six, &shrunk] {
            assert_eq!(cpus_of(p, 2), "2");
            assert_eq!(cpus_of(p, 3), "3-4,35-36");
        }
        assert_eq!(
            decide(&topo, &reserved, &jobs, &shrunk),
            shrunk,
            "idempotent"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add {
            cores: u32,
            gpu_mask: u8,
        },
        Remove(usize),
        /// A placed job asks for more cores (a probe, an RT guard core).
        Grow {
            job: usize,
            by: u32,
        },
        /// A placed job asks for fewer (a probe, a guard core given back).
        Shrink {
            job: usize,
            by: u32,
        },
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                3 => (any::<u32>(), any::<u8>())
                    .prop_map(|(cores, gpu_mask)| Op::Add { cores, gpu_mask }),
                1 => any::<usize>().prop_map(Op::Remove),
                1 => (any::<usize>(), any::<u32>())
                    .prop_map(|(job, by)| Op::Grow { job, by }),
                1 => (any::<usize>(), any::<u32>())
                    .prop_map(|(job, by)| Op::Shrink { job, by }),
            ],
            1..16,
        )
    }

    /// Whether `id` was placed in `previous` on fewer CPUs than it asks for: a job that asked
    /// for more than fitted, which may get more as CPUs come free.
    fn short(previous: &Plan, jobs: &[TrainingJobView], id: &JobId) -> bool {
        let asked = jobs.iter().find(|j| &j.id == id).map_or(0, |j| j.cores);
        previous
            .training
            .get(id)
            .is_some_and(|p| p.cpus.len() < asked as usize)
    }

    /// Checks what every plan must satisfy. `previous`: the plan it was decided from.
    fn check_plan(
        topo: &Topology,
        reserved: &CpuSet,
        jobs: &[TrainingJobView],
        previous: &Plan,
        plan: &Plan,
    ) -> Result<(), TestCaseError> {
        let usable = topo.online().difference(reserved);
        let mut all = CpuSet::new();
        let mut cut_short = false;
        for (id, p) in &plan.training {
            let job = jobs.iter().find(|j| &j.id == id);
            prop_assert!(job.is_some(), "{} placed but not registered", id);
            let asked = job.unwrap().cores as usize;
            match previous.training.get(id) {
                // Asked for more than it had: at least what it had, at most what it asked.
                Some(prev) if prev.cpus.len() < asked && p.cpus.len() < asked => {
                    prop_assert!(p.cpus.len() >= prev.cpus.len(), "{} shrank", id);
                    cut_short = true;
                }
                _ => prop_assert_eq!(p.cpus.len(), asked, "{} size", id),
            }
            prop_assert!(
                p.cpus.is_subset(&usable),
                "{} on reserved/offline CPUs: {}",
                id,
                p.cpus
            );
            prop_assert!(p.cpus.is_disjoint(&all), "{} overlaps: {}", id, p.cpus);
            prop_assert_eq!(&p.mems, &topo.numa_nodes_of(&p.cpus));
            all = all.union(&p.cpus);
        }
        let free = usable.difference(&all).len();
        // A job short of what it asked for got every free CPU.
        prop_assert!(
            !cut_short || free == 0,
            "{} CPUs free beside a job cut short",
            free
        );
        for job in jobs {
            let placed = plan.training.contains_key(&job.id);
            let unplaced = plan.unplaced.get(&job.id);
            prop_assert!(
                placed != unplaced.is_some(),
                "{} must be placed xor unplaced",
                job.id
            );
            if let Some(no) = unplaced {
                prop_assert!(
                    free < job.cores as usize,
                    "{} refused with {} free",
                    job.id,
                    free
                );
                prop_assert_eq!(no.free() as usize, free);
            }
        }
        prop_assert_eq!(plan.training.len() + plan.unplaced.len(), jobs.len());
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn decide_properties(
            topo in consolidate::tests::topologies(),
            reserved_raw in proptest::collection::vec(any::<u32>(), 0..3),
            ops in ops(),
        ) {
            let ncpus = u32::try_from(topo.cpus.len()).unwrap();
            let reserved: CpuSet = reserved_raw.iter().map(|r| r % ncpus).collect();
            let mut jobs: Vec<TrainingJobView> = Vec::new();
            let mut plan = Plan::default();
            let mut seq = 0;
            for op in ops {
                match op {
                    Op::Add { cores, gpu_mask } => {
                        seq += 1;
                        let gpus: Vec<u32> = (0..8).filter(|i| gpu_mask & (1 << i) != 0).collect();
                        jobs.push(job(seq, cores % (ncpus / 2 + 1) + 1, &gpus));
                        let next = decide(&topo, &reserved, &jobs, &plan);
                        check_plan(&topo, &reserved, &jobs, &plan, &next)?;
                        // Running jobs stay where they are.
                        for (id, p) in &plan.training {
                            prop_assert_eq!(Some(p), next.training.get(id), "{} moved", id);
                        }
                        plan = next;
                    }
                    Op::Remove(i) if !jobs.is_empty() => {
                        let gone = jobs.remove(i % jobs.len());
                        let next = decide(&topo, &reserved, &jobs, &plan);
                        check_plan(&topo, &reserved, &jobs, &plan, &next)?;
                        if let Some(old) = plan.training.get(&gone.id) {
                            // Its CPUs go only to jobs that were waiting for CPUs.
                            for (id, p) in &next.training {
                                if !p.cpus.is_disjoint(&old.cpus) {
                                    prop_assert!(
                                        plan.unplaced.contains_key(id) || short(&plan, &jobs, id),
                                        "{} took released CPUs", id
                                    );
                                }
                            }
                            // With no one waiting, a job of the same shape fits in its place.
                            let waiting = plan.training.keys().any(|id| short(&plan, &jobs, id));
                            let was_short = old.cpus.len() < gone.cores as usize;
                            if plan.unplaced.is_empty() && !waiting && !was_short {
                                let mut with = jobs.clone();
                                with.push(job(seq + 1_000, gone.cores, &gone.gpus));
                                let refill = decide(&topo, &reserved, &with, &next);
                                prop_assert!(
                                    refill.unplaced.is_empty(),
                                    "released CPUs not reusable"
                                );
                            }
                        }
                        plan = next;
                    }
                    Op::Remove(_) => {}
                    Op::Grow { job: i, by } if !jobs.is_empty() => {
                        let i = i % jobs.len();
                        jobs[i].cores = jobs[i].cores.saturating_add(by % ncpus + 1);
                        let id = jobs[i].id.clone();
                        let next = decide(&topo, &reserved, &jobs, &plan);
                        check_plan(&topo, &reserved, &jobs, &plan, &next)?;
                        prop_assert!(
                            !plan.training.contains_key(&id) || next.training.contains_key(&id),
                            "{} un-placed for asking more", id
                        );
                        // It keeps the CPUs it had: growing adds beside them.
                        if let (Some(before), Some(after)) = (plan.training.get(&id), next.training.get(&id)) {
                            prop_assert!(
                                before.cpus.is_subset(&after.cpus),
                                "{} moved to grow: {} -> {}", id, before.cpus, after.cpus
                            );
                        }
                        // The others placed stay where they are.
                        for (other, p) in plan.training.iter().filter(|(o, _)| **o != id) {
                            if !short(&plan, &jobs, other) {
                                prop_assert_eq!(Some(p), next.training.get(other), "{} moved", other);
                            }
                        }
                        plan = next;
                    }
                    Op::Grow { .. } => {}
                    Op::Shrink { job: i, by } if !jobs.is_empty() => {
                        let i = i % jobs.len();
                        let id = jobs[i].id.clone();
                        let Some(before) = plan.training.get(&id).map(|p| p.cpus.clone()) else {
                            continue;
                        };
                        // Below what it holds now (a job cut short holds less than it asks).
                        let had = u32::try_from(before.len()).unwrap();
                        let fewer = had.saturating_sub(by % had + 1).max(1);
                        if fewer >= had {
                            continue;
                        }
                        jobs[i].cores = fewer;
                        let next = decide(&topo, &reserved, &jobs, &plan);
                        check_plan(&topo, &reserved, &jobs, &plan, &next)?;
                        let after = &next.training[&id].cpus;
                        prop_assert!(
                            after.is_subset(&before),
                            "{} moved to shrink: {} -> {}", id, before, after
                        );
                        for (other, p) in plan.training.iter().filter(|(o, _)| **o != id) {
                            if !short(&plan, &jobs, other) {
                                prop_assert_eq!(Some(p), next.training.get(other), "{} moved", other);
                            }
                        }
                        plan = next;
                    }
                    Op::Shrink { .. } => {}
                }
                prop_assert_eq!(&decide(&topo, &reserved, &jobs, &plan), &plan, "idempotent");
            }
        }
    }
}
