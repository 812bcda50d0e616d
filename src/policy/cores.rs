//! Picking CPUs inside one NUMA node in whole physical cores, shared by training consolidation
//! (`consolidate`) and inference placement (`inference`): the two differ only in which way
//! they lean, toward the training cores or away from them. Pure: touches nothing.

use crate::cpuset::CpuSet;
use crate::topology::{Core, Topology};

/// Which way a pick leans relative to the CPUs training already holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lean {
    /// A training job: next to other training, so the free cores stay in one piece for lodgers
    /// (Cloud Reamer §III-A: training takes cores in sequence from the unallocated list).
    TowardTraining,
    /// An inference instance: away from training, which consolidation grows toward.
    AwayFromTraining,
}

/// Whose the CPUs a pick must not take are, for which half-free cores it prefers (see
/// [`pick_in_node`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held<'a> {
    /// The job's own CPUs (its other instances, or what it held before).
    pub(crate) own: &'a CpuSet,
    /// Another online job's instances: their SMT siblings are a last resort.
    pub(crate) others: &'a CpuSet,
}

/// One core of a node as the placement sees it.
struct Slot<'t> {
    core: &'t Core,
    /// Its CPUs that are available.
    free: CpuSet,
    /// Some of its CPUs are training's.
    training: bool,
}

impl Slot<'_> {
    fn whole(&self) -> bool {
        !self.free.is_empty() && self.free == self.core.cpus
    }

    fn fragment(&self) -> bool {
        !self.free.is_empty() && self.free != self.core.cpus
    }

    /// How welcome this half-free core is for part of a pick: beside `own` threads (the job's
    /// own) best, then beside reserved threads, then beside `others` (another online job's
    /// instances), beside training last. SMT siblings share the core's execution units and
    /// caches: another job's instance there costs both jobs latency (Cloud Reamer §III-A: an
    /// online job's cores are its own), and training's bursts would slow the threads beside them.
    fn fragment_rank(&self, own: &CpuSet, others: &CpuSet) -> u8 {
        let missing = self.core.cpus.difference(&self.free);
        if missing.is_subset(own) {
            0
        } else if self.training {
            3
        } else if !missing.is_disjoint(others) {
            2
        } else {
            1
        }
    }
}

/// A maximal sequence of adjacent whole available cores of a node.
struct Run {
    start: usize,
    end: usize,
    cpus: usize,
    training_left: bool,
    training_right: bool,
}

/// Takes `k` CPUs (at most the node's available count) of node `node` out of `avail`, which
/// holds none of `training`: whole cores from one run of adjacent available cores (see
/// [`whole_core_order`]), and an odd remainder from a half-available core beside the job's
/// `own` threads or a reserved thread (that half could not be lent as a whole core anyway):
/// with [`Lean::AwayFromTraining`] the best-ranked such core, then the smallest; with
/// [`Lean::TowardTraining`] the first beside `own`, else the first. Half-available cores
/// beside `others` (another online job's instances), then beside training, are used only as a
/// last resort, when whole cores run out: an odd remainder splits a whole core rather than
/// share one with another job.
pub(crate) fn pick_in_node(
    topo: &Topology,
    node: u32,
    avail: &CpuSet,
    training: &CpuSet,
    held: Held<'_>,
    k: usize,
    lean: Lean,
) -> CpuSet {
    let Held { own, others } = held;
    // Cores are ordered by their lowest CPU id, which is their physical order on every machine
    // in the fixtures; within a node that order is what "adjacent" means.
    let slots: Vec<Slot> = topo
        .cores
        .iter()
        .filter(|c| c.numa_node == node)
        .map(|core| Slot {
            core,
            free: core.cpus.intersection(avail),
            training: !core.cpus.is_disjoint(training),
        })
        .collect();
    let threads = slots.iter().map(|s| s.core.cpus.len()).max().unwrap_or(1);
    let mut picked = CpuSet::new();
    let mut need = k;

    // The odd remainder first.
    let remainder = if threads > 1 { k % threads } else { 0 };
    if remainder > 0 {
        let fits = slots.iter().filter(|s| {
            s.fragment() && s.free.len() >= remainder && s.fragment_rank(own, others) < 2
        });
        let best = match lean {
            // The first core in order, beside the job's own threads before any other.
            Lean::TowardTraining => fits.min_by_key(|s| s.fragment_rank(own, others)),
            Lean::AwayFromTraining => {
                fits.min_by_key(|s| (s.fragment_rank(own, others), s.free.len(), s.free.first()))
            }
        };
        if let Some(slot) = best {
            picked.extend(slot.free.iter().take(remainder));
            need -= remainder;
        }
    }

    // Whole cores, in the order of the runs they lie in; the last may be split.
    for i in whole_core_order(&slots, need, lean) {
        if need == 0 {
            break;
        }
        let take = need.min(slots[i].free.len());
        picked.extend(slots[i].free.iter().take(take));
        need -= take;
    }

    // Not enough whole cores: half-available cores, best ranked first.
    if need > 0 {
        let mut halves: Vec<&Slot> = slots.iter().filter(|s| s.fragment()).collect();
        halves.sort_by_key(|s| s.fragment_rank(own, others));
        for slot in halves {
            if need == 0 {
                break;
            }
            let left = slot.free.difference(&picked);
            let take = need.min(left.len());
            picked.extend(left.iter().take(take));
            need -= take;
        }
    }
    picked
}

/// Positions of the node's whole available cores in the order to take them. Runs of adjacent
/// whole cores large enough for `need` CPUs come first, the smallest of them first (best fit
/// keeps large runs for larger jobs and instances); if none is large enough, the largest first.
/// Leaning toward training, a run beside training goes before one that is not (within each of
/// those two tiers), and cores are taken from the end that touches training. Leaning away,
/// cores are taken from the end away from training: consolidation grows training jobs from the
/// end next to training and reserved cores, so a lodger there would be the first to be moved.
fn whole_core_order(slots: &[Slot], need: usize, lean: Lean) -> Vec<usize> {
    let mut runs: Vec<Run> = Vec::new();
    let mut i = 0;
    while i < slots.len() {
        if !slots[i].whole() {
            i += 1;
            continue;
        }
        let start = i;
        let mut cpus = 0;
        while i < slots.len() && slots[i].whole() {
            cpus += slots[i].free.len();
            i += 1;
        }
        let end = i - 1;
        runs.push(Run {
            start,
            end,
            cpus,
            training_left: start > 0 && slots[start - 1].training,
            training_right: end + 1 < slots.len() && slots[end + 1].training,
        });
    }
    runs.sort_by_key(|r| {
        let away = match lean {
            Lean::TowardTraining => usize::from(!(r.training_left || r.training_right)),
            Lean::AwayFromTraining => 0,
        };
        if r.cpus >= need {
            (0u8, away, r.cpus, r.start)
        } else {
            (1u8, usize::MAX - r.cpus, away, r.start)
        }
    });
    let mut order = Vec::new();
    for run in runs {
        let toward_right = run.training_right && !run.training_left;
        let descending = match lean {
            Lean::TowardTraining => toward_right,
            Lean::AwayFromTraining => !toward_right,
        };
        if descending {
            order.extend((run.start..=run.end).rev());
        } else {
            order.extend(run.start..=run.end);
        }
    }
    order
}
