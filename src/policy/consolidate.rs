//! Consolidation of training jobs (Cloud Reamer §III-A): which CPUs a training job gets. Pure:
//! touches nothing.
//!
//! Cloud Reamer §III-A binds each training job to "a sufficient number of cores" taken in
//! sequence from the unallocated ones, so that the remaining cores are left whole for inference.
//! lodger keeps that rule and adds what a multi-socket GPU server needs: whole physical cores,
//! the NUMA node of the job's GPUs, and contiguity with the other training jobs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::cores::{pick_in_node, Held, Lean};
use crate::cpuset::CpuSet;
use crate::topology::Topology;

/// What a training job asks of the node.
#[derive(Debug, Clone, Copy)]
pub struct TrainingAsk<'a> {
    /// Logical CPUs wanted (SMT siblings count separately).
    pub cores: u32,
    /// GPU indices; unknown indices, or GPUs of unknown locality, express no preference.
    pub gpus: &'a [u32],
}

/// Why a training job cannot be placed: fewer free CPUs than it asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoCapacity {
    /// CPUs asked for.
    pub wanted: u32,
    /// Free (online, not reserved, not taken by training) CPUs of every NUMA node with CPUs.
    pub free_by_node: BTreeMap<u32, u32>,
    /// The NUMA nodes local to the job's GPUs, each with the GPUs it is local to.
    pub local_nodes: BTreeMap<u32, Vec<u32>>,
    /// Online CPUs reserved for housekeeping.
    pub reserved: u32,
}

impl NoCapacity {
    /// All free CPUs.
    pub fn free(&self) -> u32 {
        self.free_by_node.values().sum()
    }
}

impl fmt::Display for NoCapacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let free = self.free();
        write!(f, "needs {} but ", plural(self.wanted, "CPU", "CPUs"))?;
        if free == 0 {
            f.write_str("none are free")?;
        } else {
            write!(
                f,
                "only {free} {} free: ",
                if free == 1 { "is" } else { "are" }
            )?;
            let mut first = true;
            for (&node, &n) in &self.free_by_node {
                let gpus = self.local_nodes.get(&node);
                if n == 0 && gpus.is_none() {
                    continue;
                }
                if !first {
                    f.write_str(", ")?;
                }
                write!(f, "{n} on {}node {node}", if first { "NUMA " } else { "" })?;
                if let Some(gpus) = gpus {
                    let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
                    let noun = if gpus.len() == 1 { "GPU" } else { "GPUs" };
                    write!(f, " (local to {noun} {})", list.join(","))?;
                }
                first = false;
            }
        }
        if self.reserved > 0 {
            write!(
                f,
                "; {} reserved for housekeeping",
                plural(self.reserved, "CPU is", "CPUs are")
            )?;
        }
        f.write_str("; free cores by unregistering a job or ask for fewer")
    }
}

impl std::error::Error for NoCapacity {}

fn plural(n: u32, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Chooses `ask.cores` CPUs for a training job, from the online CPUs that are neither
/// `reserved` nor `taken` (by other training jobs). Deterministic; fails only when fewer than
/// `ask.cores` such CPUs exist.
///
/// In order of precedence:
/// - NUMA node: the nodes local to the job's GPUs first; spill to other nodes only when those
///   are full, preferring nodes in the same package, and otherwise as few nodes as possible.
/// - Whole physical cores: SMT siblings go to the same job. For an odd count one core is half
///   used; that half is taken first from a core whose other sibling is reserved, then by
///   splitting a free core, and only as a last resort next to another training job's thread.
/// - Contiguity: cores next to other training jobs' cores first, filling the smallest gap that
///   fits, so the free cores left for lodgers stay in one piece (Cloud Reamer §III-A: training
///   takes cores in sequence from the unallocated list, the rest go to inference).
pub fn place(
    topo: &Topology,
    reserved: &CpuSet,
    taken: &CpuSet,
    ask: &TrainingAsk,
) -> Result<CpuSet, NoCapacity> {
    place_beside(topo, reserved, taken, &CpuSet::new(), ask)
}

/// [`place`] for CPUs added to a placed job's `own` (which `taken` holds): an odd remainder
/// goes first to the sibling of the job's own half-used core, where [`place`] would take it
/// beside another job only as a last resort.
pub(crate) fn place_beside(
    topo: &Topology,
    reserved: &CpuSet,
    taken: &CpuSet,
    own: &CpuSet,
    ask: &TrainingAsk,
) -> Result<CpuSet, NoCapacity> {
    let free = topo.online().difference(reserved).difference(taken);
    let wanted = usize::try_from(ask.cores).unwrap_or(usize::MAX);
    if free.len() < wanted {
        return Err(shortfall(topo, reserved, taken, ask));
    }
    let local = local_nodes(topo, ask.gpus);
    let mut anchors: BTreeSet<u32> = local
        .keys()
        .flat_map(|&node| packages_of_node(topo, node))
        .collect();
    let mut picked = CpuSet::new();
    let mut chosen: BTreeSet<u32> = BTreeSet::new();
    let mut remaining = wanted;
    while remaining > 0 {
        let Some(node) = next_node(topo, &free, taken, &local, &anchors, &chosen, remaining) else {
            break; // unreachable: free holds at least `wanted` CPUs
        };
        let node_free = free.intersection(&node_cpus(topo, node));
        let k = remaining.min(node_free.len());
        picked = picked.union(&pick_in_node(
            topo,
            node,
            &free,
            taken,
            Held {
                own,
                others: &CpuSet::new(),
            },
            k,
            Lean::TowardTraining,
        ));
        remaining -= k;
        chosen.insert(node);
        anchors.extend(packages_of_node(topo, node));
    }
    Ok(picked)
}

/// The explanation `place` gives when the job does not fit: free CPUs per node, local nodes,
/// reserved count.
pub fn shortfall(
    topo: &Topology,
    reserved: &CpuSet,
    taken: &CpuSet,
    ask: &TrainingAsk,
) -> NoCapacity {
    let online = topo.online();
    let free = online.difference(reserved).difference(taken);
    let free_by_node = topo
        .numa_nodes
        .values()
        .filter(|n| !n.cpus.is_empty())
        .map(|n| (n.id, count(&n.cpus.intersection(&free))))
        .collect();
    NoCapacity {
        wanted: ask.cores,
        free_by_node,
        local_nodes: local_nodes(topo, ask.gpus),
        reserved: count(&reserved.intersection(&online)),
    }
}

fn count(set: &CpuSet) -> u32 {
    u32::try_from(set.len()).unwrap_or(u32::MAX)
}

/// NUMA nodes local to these GPUs, with the GPUs local to each. GPUs missing from the topology
/// or of unknown locality are left out: they express no preference.
fn local_nodes(topo: &Topology, gpus: &[u32]) -> BTreeMap<u32, Vec<u32>> {
    let mut local: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &index in gpus {
        if let Some(node) = topo.gpu(index).and_then(|g| g.numa_node) {
            let list = local.entry(node).or_default();
            if !list.contains(&index) {
                list.push(index);
            }
        }
    }
    for list in local.values_mut() {
        list.sort_unstable();
    }
    local
}

fn node_cpus(topo: &Topology, node: u32) -> CpuSet {
    topo.numa_nodes
        .get(&node)
        .map(|n| n.cpus.clone())
        .unwrap_or_default()
}

fn packages_of_node(topo: &Topology, node: u32) -> BTreeSet<u32> {
    node_cpus(topo, node)
        .iter()
        .filter_map(|cpu| topo.cpus.get(&cpu).map(|c| c.package))
        .collect()
}

/// The next NUMA node to take CPUs from. Tiers first: nodes local to the GPUs, then nodes in a
/// package already used (or local), then the rest. Within a tier, a node that holds all that
/// is still needed wins (the one with the job's most GPUs, then one already holding training,
/// then the tightest fit); if none does, the node with the most free CPUs, so the job spans as
/// few nodes as possible.
fn next_node(
    topo: &Topology,
    free: &CpuSet,
    taken: &CpuSet,
    local: &BTreeMap<u32, Vec<u32>>,
    anchors: &BTreeSet<u32>,
    chosen: &BTreeSet<u32>,
    remaining: usize,
) -> Option<u32> {
    topo.numa_nodes
        .values()
        .filter(|n| !chosen.contains(&n.id))
        .filter_map(|n| {
            let n_free = n.cpus.intersection(free).len();
            if n_free == 0 {
                return None;
            }
            let tier: u8 = if local.contains_key(&n.id) {
                0
            } else if !packages_of_node(topo, n.id).is_disjoint(anchors) {
                1
            } else {
                2
            };
            let gpus = local.get(&n.id).map_or(0, Vec::len);
            let training = !n.cpus.is_disjoint(taken);
            let key = if n_free >= remaining {
                (
                    tier,
                    0u8,
                    usize::MAX - gpus,
                    usize::from(!training),
                    n_free,
                    n.id,
                )
            } else {
                (tier, 1u8, usize::MAX - n_free, usize::MAX - gpus, 0, n.id)
            };
            Some(key)
        })
        .min()
        .map(|key| key.5)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use crate::topology::Core;
    use proptest::prelude::*;

    fn set(list: &str) -> CpuSet {
        CpuSet::parse(list).unwrap()
    }

    fn ask(cores: u32, gpus: &[u32]) -> TrainingAsk<'_> {
        TrainingAsk { cores, gpus }
    }

    /// 2 sockets × 16 cores × 2 threads, one node per socket, GPUs 0-3 on node 0, 4-7 on node 1.
    fn server64() -> Topology {
        Topology::synthetic(2, 1, 16, 2, 4)
    }

    struct Case {
        name: &'static str,
        topo: Topology,
        reserved: &'static str,
        taken: &'static str,
        cores: u32,
        gpus: &'static [u32],
        want: &'static str,
    }

    #[test]
    fn placement_table() {
        let cases = [
            Case {
                name: "GPUs 4-7 get node 1 as sibling pairs",
                topo: server64(),
                reserved: "0,32",
                taken: "",
                cores: 8,
                gpus: &[4, 5, 6, 7],
                want: "16-19,48-51",
            },
            Case {
                name: "a second job lands adjacent to the first",
                topo: server64(),
                reserved: "0,32",
                taken: "16-19,48-51",
                cores: 8,
                gpus: &[4, 5, 6, 7],
                want: "20-23,52-55",
            },
            Case {
                name: "reserved 0,32 never used; packed next to them",
                topo: server64(),
                reserved: "0,32",
                taken: "",
                cores: 8,
                gpus: &[0, 1, 2, 3],
                want: "1-4,33-36",
            },
            Case {
                name: "a hole left by a released job is filled first (best fit)",
                topo: server64(),
                reserved: "0,32",
                taken: "1-2,5-8,33-34,37-40",
                cores: 4,
                gpus: &[0],
                want: "3-4,35-36",
            },
            Case {
                name: "free cores before training are taken from the training end",
                topo: server64(),
                reserved: "",
                taken: "20-23,52-55",
                cores: 4,
                gpus: &[4],
                want: "18-19,50-51",
            },
            Case {
                name: "odd count: one whole core and half of the next",
                topo: server64(),
                reserved: "0,32",
                taken: "",
                cores: 3,
                gpus: &[0],
                want: "1-2,33",
            },
            Case {
                name: "odd count: the half core is one whose sibling is reserved",
                topo: server64(),
                reserved: "0",
                taken: "",
                cores: 3,
                gpus: &[0],
                want: "1,32-33",
            },
            Case {
                name: "odd count: not beside another training job's thread",
                topo: server64(),
                reserved: "0,32",
                taken: "1",
                cores: 1,
                gpus: &[0],
                want: "2",
            },
            Case {
                name: "odd count: beside training only when nothing else is free",
                topo: server64(),
                reserved: "0,32",
                taken: "1-31,48-63",
                cores: 1,
                gpus: &[0],
                want: "33",
            },
            Case {
                name: "a full local node spills to the other",
                topo: server64(),
                reserved: "0,32",
                taken: "16-29,48-61",
                cores: 8,
                gpus: &[4],
                want: "1-2,30-31,33-34,62-63",
            },
            Case {
                name: "spills stay in the package",
                topo: Topology::synthetic(2, 2, 4, 2, 1),
                reserved: "",
                taken: "",
                cores: 12,
                gpus: &[0],
                want: "0-5,16-21",
            },
            Case {
                name: "GPUs on two nodes: the node holding all of the job",
                topo: server64(),
                reserved: "0,32",
                taken: "1-10,33-42",
                cores: 12,
                gpus: &[0, 4],
                want: "16-21,48-53",
            },
            Case {
                name: "no GPUs: one node if any can hold the job",
                topo: Topology::synthetic(1, 4, 4, 1, 0),
                reserved: "",
                taken: "0",
                cores: 4,
                gpus: &[],
                want: "4-7",
            },
            Case {
                name: "no GPUs: the node that already holds training, if it fits",
                topo: Topology::synthetic(1, 4, 4, 1, 0),
                reserved: "",
                taken: "0",
                cores: 3,
                gpus: &[],
                want: "1-3",
            },
            Case {
                name: "no GPUs: as few nodes as possible",
                topo: Topology::synthetic(1, 4, 4, 1, 0),
                reserved: "",
                taken: "0-2,4,8-9",
                cores: 7,
                gpus: &[],
                want: "5-7,12-15",
            },
            Case {
                name: "unknown GPU index: no preference",
                topo: server64(),
                reserved: "0,32",
                taken: "",
                cores: 2,
                gpus: &[99],
                want: "1,33",
            },
            Case {
                name: "no SMT",
                topo: Topology::synthetic(1, 1, 32, 1, 2),
                reserved: "0-1",
                taken: "2-5",
                cores: 5,
                gpus: &[1],
                want: "6-10",
            },
        ];
        for c in cases {
            let got = place(
                &c.topo,
                &set(c.reserved),
                &set(c.taken),
                &ask(c.cores, c.gpus),
            )
            .unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert_eq!(got.to_string(), c.want, "{}", c.name);
        }
    }

    #[test]
    fn no_capacity_says_where_the_cpus_are() {
        let topo = server64();
        let err = place(&topo, &set("0,32"), &set("3-29,35-63"), &ask(8, &[0, 1])).unwrap_err();
        assert_eq!(err.wanted, 8);
        assert_eq!(err.free(), 6);
        assert_eq!(err.reserved, 2);
        assert_eq!(err.local_nodes, BTreeMap::from([(0, vec![0, 1])]));
        assert_eq!(
            err.to_string(),
            "needs 8 CPUs but only 6 are free: 4 on NUMA node 0 (local to GPUs 0,1), 2 on node 1; \
             2 CPUs are reserved for housekeeping; free cores by unregistering a job or ask for \
             fewer"
        );
    }

    #[test]
    fn no_capacity_wording_edges() {
        let topo = Topology::synthetic(1, 2, 2, 1, 1);
        let none = place(&topo, &CpuSet::new(), &set("0-3"), &ask(1, &[1])).unwrap_err();
        assert_eq!(
            none.to_string(),
            "needs 1 CPU but none are free; free cores by unregistering a job or ask for fewer"
        );
        let one = place(&topo, &set("0"), &set("1-2"), &ask(2, &[1])).unwrap_err();
        assert_eq!(
            one.to_string(),
            "needs 2 CPUs but only 1 is free: 1 on NUMA node 1 (local to GPU 1); 1 CPU is \
             reserved for housekeeping; free cores by unregistering a job or ask for fewer"
        );
        // A local node with nothing free is still named.
        let local_full = place(&topo, &CpuSet::new(), &set("2-3,0"), &ask(2, &[1])).unwrap_err();
        assert_eq!(
            local_full.to_string(),
            "needs 2 CPUs but only 1 is free: 1 on NUMA node 0, 0 on node 1 (local to GPU 1); \
             free cores by unregistering a job or ask for fewer"
        );
    }

    #[test]
    fn no_capacity_round_trips_through_json() {
        let err = place(&server64(), &set("0,32"), &set("1-31,33-63"), &ask(3, &[4])).unwrap_err();
        let json = serde_json::to_string(&err).unwrap();
        let back: NoCapacity = serde_json::from_str(&json).unwrap();
        assert_eq!(back, err);
    }

    #[test]
    fn zero_cores_is_the_empty_set() {
        assert_eq!(
            place(&server64(), &CpuSet::new(), &CpuSet::new(), &ask(0, &[0])).unwrap(),
            CpuSet::new()
        );
    }

    /// Synthetic topologies over the design's range: 2 to 256 CPUs, 1 to 8 NUMA nodes, SMT on or
    /// off, 0 to 8 GPUs, some of unknown locality.
    pub(crate) fn topologies() -> impl Strategy<Value = Topology> {
        (1u32..=4, 1u32..=4, 1u32..=2)
            .prop_filter("1 to 8 NUMA nodes", |(s, n, _)| s * n <= 8)
            .prop_flat_map(|(sockets, per_socket, threads)| {
                let nodes = sockets * per_socket;
                let min_cores = if nodes * threads >= 2 { 1 } else { 2 };
                let max_cores = (256 / (nodes * threads)).max(min_cores);
                (
                    Just((sockets, per_socket, threads)),
                    min_cores..=max_cores,
                    0..=8 / nodes,
                    proptest::collection::vec(proptest::bool::weighted(0.2), 8),
                )
            })
            .prop_map(|((sockets, per_socket, threads), cores, gpus, unknown)| {
                let mut topo = Topology::synthetic(sockets, per_socket, cores, threads, gpus);
                for (gpu, unknown) in topo.gpus.iter_mut().zip(unknown) {
                    if unknown {
                        gpu.numa_node = None;
                    }
                }
                topo
            })
    }

    /// CPUs picked by raw numbers: whole cores when `whole`, else single CPUs.
    fn pick(topo: &Topology, raw: &[u32], whole: bool) -> CpuSet {
        let mut out = CpuSet::new();
        let ncores = u32::try_from(topo.cores.len()).unwrap();
        let ncpus = u32::try_from(topo.cpus.len()).unwrap();
        for &r in raw {
            if whole {
                out = out.union(&topo.cores[(r % ncores) as usize].cpus);
            } else {
                out.insert(r % ncpus);
            }
        }
        out
    }

    fn local_cpus(topo: &Topology, gpus: &[u32]) -> CpuSet {
        local_nodes(topo, gpus)
            .keys()
            .fold(CpuSet::new(), |acc, &n| {
                acc.union(&topo.numa_nodes[&n].cpus)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn place_properties(
            topo in topologies(),
            reserved_raw in proptest::collection::vec(any::<u32>(), 0..3),
            taken_raw in proptest::collection::vec(any::<u32>(), 0..40),
            whole in any::<bool>(),
            cores_raw in any::<u32>(),
            gpu_mask in any::<u8>(),
        ) {
            let ncpus = u32::try_from(topo.cpus.len()).unwrap();
            let reserved = pick(&topo, &reserved_raw, whole);
            let taken = pick(&topo, &taken_raw, whole).difference(&reserved);
            let cores = cores_raw % ncpus + 1;
            let gpus: Vec<u32> = (0..8).filter(|i| gpu_mask & (1 << i) != 0).collect();
            let a = ask(cores, &gpus);
            let free = topo.online().difference(&reserved).difference(&taken);
            let result = place(&topo, &reserved, &taken, &a);
            prop_assert_eq!(&result, &place(&topo, &reserved, &taken, &a), "deterministic");
            let Ok(got) = result else {
                let err = result.unwrap_err();
                prop_assert!(
                    free.len() < cores as usize,
                    "refused with {} free: {}", free.len(), err
                );
                prop_assert_eq!(err.free() as usize, free.len());
                return Ok(());
            };
            prop_assert_eq!(got.len(), cores as usize, "exactly N CPUs");
            prop_assert!(got.is_subset(&free), "{} outside free {}", got, free);

            // The local nodes are used first: all of the job when they can hold it, else all of
            // their free CPUs.
            let local = local_cpus(&topo, &gpus);
            let local_free = free.intersection(&local);
            if !local.is_empty() {
                if local_free.len() >= cores as usize {
                    prop_assert!(got.is_subset(&local), "{} not within local {}", got, local);
                } else {
                    prop_assert!(
                        local_free.is_subset(&got),
                        "local {} left unused by {}", local_free, got
                    );
                }
            }

            // Whole cores when the free space is whole cores: the fewest cores, and for an
            // odd count exactly one half core whose other thread stays free.
            let threads = topo.cores[0].cpus.len();
            if whole && threads > 1 {
                let touched: Vec<&Core> =
                    topo.cores.iter().filter(|c| !c.cpus.is_disjoint(&got)).collect();
                prop_assert_eq!(touched.len(), (cores as usize).div_ceil(threads));
                let halves: Vec<&&Core> =
                    touched.iter().filter(|c| !c.cpus.is_subset(&got)).collect();
                prop_assert_eq!(halves.len(), usize::from(cores as usize % threads != 0));
                for half in halves {
                    prop_assert!(
                        half.cpus.is_disjoint(&taken),
                        "half core {} shares with training", half.cpus
                    );
                }
            }
        }
    }
}
