//! Inference placement (Cloud Reamer §III-A): which CPUs every online and offline instance gets,
//! around training and the reserved CPUs. Pure: touches nothing.

use std::collections::BTreeSet;

use super::types::{
    union_of, InferencePlan, Instance, JobInstances, LayoutConfig, OfflineJobView, OnlineJobView,
    Shortfall,
};
use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::policy::cores::{pick_in_node, Held, Lean};
use crate::topology::Topology;

/// Places every inference instance. `training` is the union of the training jobs' cpusets
/// ([`training_cpus`](super::training_cpus)); `previous` is the last plan (the empty plan at start).
///
/// Online jobs (Cloud Reamer §III-A: online inference on the idle cores, for predictable
/// latency):
/// - only on online CPUs that are neither `reserved` nor `training`, and an instance's CPUs are
///   its own: no other instance, online or offline, of any job runs on them;
/// - every previous instance that still fits (same CPU count, CPUs still free, not claimed by
///   a lower-id job's kept instance) is kept where it is, up to the layout's instance count,
///   lowest numbers first; a running instance is never moved to make room;
/// - missing instances are then placed job by job in id order (`JobId::seq`), each on one NUMA
///   node when one can hold it (the tightest such node, whole cores first), spilling over as
///   few nodes as possible otherwise; inside a node, whole physical cores from one run of
///   adjacent free cores, an odd remainder from a half-free core beside the job's own instance
///   (or a reserved thread) before splitting a whole core, and beside training only as a last
///   resort;
/// - a job whose instances do not all fit runs those that do and gets a [`Shortfall`].
///
/// Offline jobs (§III-A and Fig. 6: many single-thread instances avoid the straggler effect,
/// and training's SCHED_RR pre-empts them):
/// - one single-thread instance per CPU, on every online CPU that is not reserved, not an online
///   instance's and not an SMT sibling of one (an online instance's cores are exclusive);
///   training CPUs included;
/// - idle CPUs first: the idle CPUs are shared out fairly between offline jobs (capped by
///   `max_instances`, the remainder to lower ids), then the training CPUs the same way;
/// - previous instances are kept on their CPU while it is still in the same part (idle or
///   training) and within the job's share;
/// - an instance on an idle CPU gets the job's `batch`, one on a training CPU its
///   `training_batch` (issue 14 item 3: a shorter stay in the training core's caches).
///
/// Pure and idempotent: `place(.., &place(..)) == place(..)`. A job listed twice is placed once
/// (the first listing wins); a job should not be listed both online and offline.
pub fn place(
    topo: &Topology,
    reserved: &CpuSet,
    training: &CpuSet,
    online: &[OnlineJobView],
    offline: &[OfflineJobView],
    previous: &InferencePlan,
) -> InferencePlan {
    let mut plan = InferencePlan::default();
    let online_taken = place_online(topo, reserved, training, online, previous, &mut plan);
    place_offline(
        topo,
        reserved,
        training,
        &online_taken,
        offline,
        previous,
        &mut plan,
    );
    plan
}

/// Jobs sorted by id (`j2` before `j10`), each once.
pub(super) fn in_id_order<T>(jobs: &[T], id: impl Fn(&T) -> &JobId) -> Vec<&T> {
    let mut ordered: Vec<&T> = jobs.iter().collect();
    ordered.sort_by(|a, b| (id(a).seq(), id(a)).cmp(&(id(b).seq(), id(b))));
    ordered.dedup_by(|later, earlier| id(later) == id(earlier));
    ordered
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn to_usize(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Places the online jobs into `plan`; returns the CPUs their instances hold.
fn place_online(
    topo: &Topology,
    reserved: &CpuSet,
    training: &CpuSet,
    jobs: &[OnlineJobView],
    previous: &InferencePlan,
    plan: &mut InferencePlan,
) -> CpuSet {
    let free = topo.online().difference(reserved).difference(training);
    let jobs = in_id_order(jobs, |j| &j.id);
    let mut taken = CpuSet::new();

    // Keep what still fits, before placing anything new: a newcomer never displaces a running
    // instance (restarting it would cost its warm caches and in-flight requests).
    for job in &jobs {
        let k = to_usize(job.layout.cores_per_instance);
        let want = to_usize(job.layout.instances);
        let Some(prev) = previous.online.get(&job.id) else {
            continue;
        };
        if k == 0 || want == 0 {
            continue;
        }
        let mut kept = JobInstances::new();
        for (&index, inst) in prev {
            if kept.len() == want {
                break;
            }
            if inst.cpus.len() == k && inst.cpus.is_subset(&free) && inst.cpus.is_disjoint(&taken) {
                taken = taken.union(&inst.cpus);
                kept.insert(index, online_instance(topo, inst.cpus.clone(), job.layout));
            }
        }
        if !kept.is_empty() {
            plan.online.insert(job.id.clone(), kept);
        }
    }

    let mut short = Vec::new();
    for job in &jobs {
        let k = to_usize(job.layout.cores_per_instance);
        let want = to_usize(job.layout.instances);
        if k == 0 || want == 0 {
            continue;
        }
        let mut instances = plan.online.remove(&job.id).unwrap_or_default();
        let mut own = union_of(instances.values());
        let mut index = 0;
        while instances.len() < want {
            let avail = free.difference(&taken);
            let others = taken.difference(&own);
            let Some(cpus) = pick_instance(topo, &avail, training, &own, &others, k) else {
                break;
            };
            while instances.contains_key(&index) {
                index += 1;
            }
            taken = taken.union(&cpus);
            own = own.union(&cpus);
            instances.insert(index, online_instance(topo, cpus, job.layout));
        }
        if instances.len() < want {
            short.push((*job, instances.len()));
        }
        if !instances.is_empty() {
            plan.online.insert(job.id.clone(), instances);
        }
    }
    // Explained against the final allocation (as `decide` does): free space only shrinks during
    // a pass, so the explanation is the same when the plan is placed again from itself.
    let left = to_u32(free.difference(&taken).len());
    for (job, placed) in short {
        plan.shortfall.insert(
            job.id.clone(),
            Shortfall {
                wanted: job.layout.instances,
                placed: to_u32(placed),
                cores_per_instance: job.layout.cores_per_instance,
                free: left,
            },
        );
    }
    taken
}

fn online_instance(topo: &Topology, cpus: CpuSet, layout: LayoutConfig) -> Instance {
    Instance {
        mems: topo.numa_nodes_of(&cpus),
        threads: to_u32(cpus.len()),
        batch: layout.batch,
        cpus,
    }
}

/// A NUMA node as instance placement sees it.
struct NodeFree {
    id: u32,
    package: u32,
    /// Its available CPUs.
    free: usize,
    /// Available CPUs in cores whose every thread is available.
    whole: usize,
}

/// `k` CPUs for one online instance out of `avail`, or None when fewer are available. One NUMA
/// node when one can hold them (nodes where whole cores suffice first, then the tightest fit,
/// which keeps large free nodes for larger instances); else spread over as few nodes as
/// possible, staying in one package when it can. The SMT siblings of `others` (another online
/// job's instances) are taken only when whole cores run out.
fn pick_instance(
    topo: &Topology,
    avail: &CpuSet,
    training: &CpuSet,
    own: &CpuSet,
    others: &CpuSet,
    k: usize,
) -> Option<CpuSet> {
    if k == 0 || avail.len() < k {
        return None;
    }
    let nodes: Vec<NodeFree> = topo
        .numa_nodes
        .values()
        .filter_map(|n| {
            let free = n.cpus.intersection(avail).len();
            if free == 0 {
                return None;
            }
            let whole = topo
                .cores
                .iter()
                .filter(|c| c.numa_node == n.id && c.cpus.is_subset(avail))
                .map(|c| c.cpus.len())
                .sum();
            let package = n
                .cpus
                .first()
                .and_then(|cpu| topo.cpus.get(&cpu))
                .map_or(0, |c| c.package);
            Some(NodeFree {
                id: n.id,
                package,
                free,
                whole,
            })
        })
        .collect();
    if let Some(node) = nodes
        .iter()
        .filter(|n| n.free >= k)
        .min_by_key(|n| (n.whole < k, n.free, n.id))
    {
        return Some(pick_in_node(
            topo,
            node.id,
            avail,
            training,
            Held { own, others },
            k,
            Lean::AwayFromTraining,
        ));
    }
    let mut picked = CpuSet::new();
    let mut need = k;
    let mut used: BTreeSet<u32> = BTreeSet::new();
    let mut packages: BTreeSet<u32> = BTreeSet::new();
    while need > 0 {
        let node = nodes
            .iter()
            .filter(|n| !used.contains(&n.id))
            .min_by_key(|n| {
                let other_package = !packages.is_empty() && !packages.contains(&n.package);
                (other_package, usize::MAX - n.free, n.id)
            })?;
        let take = need.min(node.free);
        let mine = own.union(&picked);
        picked = picked.union(&pick_in_node(
            topo,
            node.id,
            avail,
            training,
            Held { own: &mine, others },
            take,
            Lean::AwayFromTraining,
        ));
        need -= take;
        used.insert(node.id);
        packages.insert(node.package);
    }
    Some(picked)
}

/// Places the offline jobs into `plan`, around `online_taken`.
fn place_offline(
    topo: &Topology,
    reserved: &CpuSet,
    training: &CpuSet,
    online_taken: &CpuSet,
    jobs: &[OfflineJobView],
    previous: &InferencePlan,
    plan: &mut InferencePlan,
) {
    let jobs = in_id_order(jobs, |j| &j.id);
    if jobs.is_empty() {
        return;
    }
    // An online instance's cores are exclusive: its CPUs and their SMT siblings.
    let mut shadow = online_taken.clone();
    for cpu in online_taken {
        if let Some(siblings) = topo.siblings(cpu) {
            shadow.extend(siblings.iter());
        }
    }
    let pool = topo.online().difference(reserved).difference(&shadow);
    let idle = pool.difference(training);
    let busy = pool.intersection(training);
    let caps: Vec<usize> = jobs
        .iter()
        .map(|j| j.max_instances.map_or(usize::MAX, to_usize))
        .collect();
    let idle_share = fair_shares(idle.len(), &caps);
    let rest: Vec<usize> = caps.iter().zip(&idle_share).map(|(c, s)| c - s).collect();
    let busy_share = fair_shares(busy.len(), &rest);

    let mut taken = CpuSet::new();
    let mut placed: Vec<JobInstances> = vec![JobInstances::new(); jobs.len()];
    let mut counts = vec![(0usize, 0usize); jobs.len()];
    for (i, job) in jobs.iter().enumerate() {
        let Some(prev) = previous.offline.get(&job.id) else {
            continue;
        };
        for (&index, inst) in prev {
            let Some(cpu) = inst.cpus.first().filter(|_| inst.cpus.len() == 1) else {
                continue;
            };
            if taken.contains(cpu) {
                continue;
            }
            let (n_idle, n_busy) = &mut counts[i];
            if idle.contains(cpu) && *n_idle < idle_share[i] {
                *n_idle += 1;
            } else if busy.contains(cpu) && *n_busy < busy_share[i] {
                *n_busy += 1;
            } else {
                continue;
            }
            taken.insert(cpu);
            let batch = offline_batch(job, busy.contains(cpu));
            placed[i].insert(index, offline_instance(topo, cpu, batch));
        }
    }

    // CPUs in core order, so a job's instances fill whole cores before moving on.
    let in_core_order = |set: &CpuSet| -> Vec<u32> {
        topo.cores
            .iter()
            .flat_map(|c| c.cpus.iter())
            .filter(|cpu| set.contains(*cpu))
            .collect()
    };
    let idle_order = in_core_order(&idle);
    let busy_order = in_core_order(&busy);
    for (i, job) in jobs.iter().enumerate() {
        let (n_idle, n_busy) = counts[i];
        let mut index = 0;
        for (order, want, on_training) in [
            (&idle_order, idle_share[i] - n_idle, false),
            (&busy_order, busy_share[i] - n_busy, true),
        ] {
            let batch = offline_batch(job, on_training);
            let free: Vec<u32> = order
                .iter()
                .copied()
                .filter(|cpu| !taken.contains(*cpu))
                .take(want)
                .collect();
            for cpu in free {
                while placed[i].contains_key(&index) {
                    index += 1;
                }
                taken.insert(cpu);
                placed[i].insert(index, offline_instance(topo, cpu, batch));
            }
        }
    }
    for (job, instances) in jobs.iter().zip(placed) {
        if !instances.is_empty() {
            plan.offline.insert(job.id.clone(), instances);
        }
    }
}

/// The batch of `job`'s instances on an idle CPU or, `on_training`, on a training CPU.
fn offline_batch(job: &OfflineJobView, on_training: bool) -> u32 {
    match job.training_batch {
        Some(b) if on_training && b > 0 => b.min(job.batch),
        _ => job.batch,
    }
}

fn offline_instance(topo: &Topology, cpu: u32, batch: u32) -> Instance {
    let cpus: CpuSet = [cpu].into_iter().collect();
    Instance {
        mems: topo.numa_nodes_of(&cpus),
        cpus,
        threads: 1,
        batch,
    }
}

/// Splits `total` between jobs: equal shares, each capped, what a capped job cannot take going
/// to the others, an indivisible remainder to the first (lowest-id) jobs.
pub(super) fn fair_shares(total: usize, caps: &[usize]) -> Vec<usize> {
    let mut share = vec![0usize; caps.len()];
    let mut left = total;
    loop {
        let open: Vec<usize> = (0..caps.len()).filter(|&i| share[i] < caps[i]).collect();
        if open.is_empty() || left == 0 {
            return share;
        }
        let each = left / open.len();
        if each == 0 {
            for &i in open.iter().take(left) {
                share[i] += 1;
            }
            return share;
        }
        for &i in &open {
            let add = each.min(caps[i] - share[i]);
            share[i] += add;
            left -= add;
        }
    }
}
