//! Inference lodgers (Cloud Reamer §III-A, §III-B, §III-C): which CPUs each online and offline
//! inference instance gets, how an online job's layout (instances × cores per instance × batch)
//! is found from measured probes, and whether that layout serves the job's rate. Pure: touches
//! nothing; measurements are arguments, the caller runs the probes.
//!
//! - [`place`]: per-instance cpusets, placed again from the previous plan whenever training,
//!   the reserved CPUs or the jobs change. Online instances get exclusive leftover cores;
//!   offline instances are single-thread and fill every other non-reserved CPU, the training
//!   jobs' included.
//! - [`LayoutSearch`]: the §III-B quick search as a state machine driven by measurements, with a
//!   [`SearchCache`] per job so a re-plan reuses what was measured for the same free-core count.
//! - [`check_capacity`]: the CR-Agent's rate check (§III-C), behind the `CapacityExceeded` signal.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::cores::{pick_in_node, Lean};
use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::policy::Plan;
use crate::topology::Topology;

// ---------------------------------------------------------------------------------------------
// Layouts and placement

/// An online job's layout (Cloud Reamer §III-B): `instances` instances of `cores_per_instance`
/// logical CPUs each, each serving batches of up to `batch` requests. An instance runs one
/// thread per CPU (§III-A: "the number of threads is same as the number of CPU cores").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayoutConfig {
    /// Logical CPUs per instance (SMT siblings count separately, as for training jobs).
    pub cores_per_instance: u32,
    pub instances: u32,
    pub batch: u32,
}

impl LayoutConfig {
    /// Logical CPUs the whole layout occupies.
    pub fn cpus(&self) -> u32 {
        self.cores_per_instance.saturating_mul(self.instances)
    }
}

impl fmt::Display for LayoutConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} × {} CPU{}, batch {}",
            self.instances,
            self.cores_per_instance,
            if self.cores_per_instance == 1 {
                ""
            } else {
                "s"
            },
            self.batch
        )
    }
}

/// What placement needs to know about a registered online inference job.
#[derive(Debug, Clone)]
pub struct OnlineJobView {
    pub id: JobId,
    /// The layout chosen for it (by [`LayoutSearch`], a cached outcome, or the job's spec).
    pub layout: LayoutConfig,
}

/// What placement needs to know about a registered offline inference job.
#[derive(Debug, Clone)]
pub struct OfflineJobView {
    pub id: JobId,
    /// Batch size each instance is started with.
    pub batch: u32,
    /// At most this many instances (one per CPU); None: as many as there are CPUs.
    pub max_instances: Option<u32>,
}

/// One instance: a child process in its own cgroup on `cpus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub cpus: CpuSet,
    /// The NUMA nodes of `cpus` (its `cpuset.mems`).
    pub mems: CpuSet,
    /// Threads to start it with (`OMP_NUM_THREADS`, `{threads}`): its CPU count online, 1 offline.
    pub threads: u32,
    pub batch: u32,
}

/// Instances of one job by instance number. Numbers are stable identities (the `{instance}`
/// placeholder), not positions: an instance keeps its number while it lives, so the numbers of a
/// job may have gaps after a re-plan; a new instance takes the lowest free number.
pub type JobInstances = BTreeMap<u32, Instance>;

/// Why an online job runs fewer instances than its layout asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shortfall {
    /// Instances in the layout.
    pub wanted: u32,
    /// Instances placed.
    pub placed: u32,
    pub cores_per_instance: u32,
    /// Free CPUs (not reserved, not training, not another online instance's) left after placement.
    pub free: u32,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} instances placed: each needs {} CPU{} and {} {} free",
            self.placed,
            self.wanted,
            self.cores_per_instance,
            if self.cores_per_instance == 1 {
                ""
            } else {
                "s"
            },
            self.free,
            if self.free == 1 { "is" } else { "are" }
        )
    }
}

/// Where every inference instance runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferencePlan {
    pub online: BTreeMap<JobId, JobInstances>,
    pub offline: BTreeMap<JobId, JobInstances>,
    /// Online jobs placed with fewer instances than their layout (absent when all fit).
    pub shortfall: BTreeMap<JobId, Shortfall>,
}

impl InferencePlan {
    /// CPUs held by online instances.
    pub fn online_cpus(&self) -> CpuSet {
        union_of(self.online.values().flat_map(|j| j.values()))
    }

    /// CPUs used by offline instances.
    pub fn offline_cpus(&self) -> CpuSet {
        union_of(self.offline.values().flat_map(|j| j.values()))
    }
}

fn union_of<'a>(instances: impl Iterator<Item = &'a Instance>) -> CpuSet {
    let mut all = CpuSet::new();
    for inst in instances {
        all.extend(inst.cpus.iter());
    }
    all
}

/// The CPUs of every placed training job in `plan`.
pub fn training_cpus(plan: &Plan) -> CpuSet {
    let mut all = CpuSet::new();
    for p in plan.training.values() {
        all.extend(p.cpus.iter());
    }
    all
}

/// Places every inference instance. `training` is the union of the training jobs' cpusets
/// ([`training_cpus`]); `previous` is the last plan (the empty plan at start).
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
///   training) and within the job's share.
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
fn in_id_order<T>(jobs: &[T], id: impl Fn(&T) -> &JobId) -> Vec<&T> {
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
            let Some(cpus) = pick_instance(topo, &avail, training, &own, k) else {
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
/// possible, staying in one package when it can.
fn pick_instance(
    topo: &Topology,
    avail: &CpuSet,
    training: &CpuSet,
    own: &CpuSet,
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
            own,
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
            &mine,
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
            placed[i].insert(index, offline_instance(topo, cpu, job.batch));
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
        for (order, want) in [
            (&idle_order, idle_share[i] - n_idle),
            (&busy_order, busy_share[i] - n_busy),
        ] {
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
                placed[i].insert(index, offline_instance(topo, cpu, job.batch));
            }
        }
    }
    for (job, instances) in jobs.iter().zip(placed) {
        if !instances.is_empty() {
            plan.offline.insert(job.id.clone(), instances);
        }
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
fn fair_shares(total: usize, caps: &[usize]) -> Vec<usize> {
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

// ---------------------------------------------------------------------------------------------
// Capacity

/// Whether an online job's layout serves its rate (Cloud Reamer §III-C: the CR-Agent watches
/// the incoming rate and alerts the cluster scheduler when it passes what the instance was
/// configured for).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CapacityCheck {
    /// What the placed instances can serve, requests/s.
    pub capacity_per_s: f64,
    /// The rate the job was registered with.
    pub expected_per_s: f64,
    /// The rate compared with capacity: the measured arrival rate when there is one, else the
    /// expected rate.
    pub demand_per_s: f64,
    /// Capacity covers the expected rate.
    pub serves_expected: bool,
    /// Demand exceeds capacity: emit `CapacityExceeded`.
    pub exceeded: bool,
}

/// Checks an online job's capacity. `layout_throughput_per_s` is what `layout` served when it
/// was measured with all its instances (the search's measurement of it); `placed_instances` is
/// how many run now (fewer when the job has a [`Shortfall`]), capacity scaling with them.
/// Non-finite or negative rates count as 0. Pure: the caller debounces the signal.
pub fn check_capacity(
    layout: &LayoutConfig,
    layout_throughput_per_s: f64,
    placed_instances: u32,
    expected_per_s: f64,
    measured_demand_per_s: Option<f64>,
) -> CapacityCheck {
    let rate = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
    let capacity_per_s = if layout.instances == 0 {
        0.0
    } else {
        let placed = placed_instances.min(layout.instances);
        rate(layout_throughput_per_s) * f64::from(placed) / f64::from(layout.instances)
    };
    let expected_per_s = rate(expected_per_s);
    let demand_per_s = measured_demand_per_s.map_or(expected_per_s, rate);
    CapacityCheck {
        capacity_per_s,
        expected_per_s,
        demand_per_s,
        serves_expected: capacity_per_s >= expected_per_s,
        exceeded: demand_per_s > capacity_per_s,
    }
}

// ---------------------------------------------------------------------------------------------
// Layout search

/// Probes a search may use unless told otherwise. Each probe is a measurement window of a few
/// seconds; twelve keeps a search to about a minute (the paper's searches took 10-13 minutes
/// for three core counts and several SLOs, §IV-A).
pub const DEFAULT_PROBE_BUDGET: u32 = 12;
/// A move counts only if it is better by this fraction (measurement noise).
pub const DEFAULT_MARGIN: f64 = 0.03;
/// The batch whose IPC and cache misses are compared with batch 1's (Cloud Reamer Fig. 5).
pub const TREND_BATCH: u32 = 8;
/// Relative IPC change that counts as rising or falling: above a few percent of window-to-window
/// noise.
const IPC_TREND: f64 = 0.10;
/// A rise of the cache-miss ratio counts when it is both this much absolute (two percentage
/// points) and [`MISS_RISE_REL`] relative: a high ratio that wobbles by a few percent is stable.
const MISS_RISE_ABS: f64 = 0.02;
const MISS_RISE_REL: f64 = 0.15;

/// How the search spends its probes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SearchOptions {
    /// Most probes asked for; at least 1.
    pub probe_budget: u32,
    /// A hill-climbing move counts only if better by this fraction.
    pub margin: f64,
}

impl Default for SearchOptions {
    fn default() -> Self {
        Self {
            probe_budget: DEFAULT_PROBE_BUDGET,
            margin: DEFAULT_MARGIN,
        }
    }
}

/// How a model's IPC and cache misses move as the batch grows (Cloud Reamer §III-B, Fig. 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BatchTrend {
    /// Rising IPC with stable misses (DeepSpeech in Fig. 5): few large instances, large batches.
    ComputeBound,
    /// Falling IPC or rising misses (ResNet101 in Fig. 5): many small instances.
    CacheBound,
    /// No counters (VMs), a flat trend, or batch fixed at 1: start in the middle.
    Unknown,
}

/// What a search learnt about the model that does not depend on the free-core count, so a
/// search at another core count can skip those probes ([`LayoutSearch::with_traits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelTraits {
    /// Fewest CPUs per instance meeting the SLO at batch 1 (phase 1).
    pub min_cores_per_instance: u32,
    pub trend: BatchTrend,
    /// Largest batch estimated to meet the SLO at `min_cores_per_instance`.
    pub feasible_batch: u32,
}

/// One measurement window of a layout, as the caller observed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// The layout measured (the one the search asked for).
    pub config: LayoutConfig,
    /// Requests served per second by all instances together, under saturating load.
    pub throughput_per_s: f64,
    /// 99th-percentile request latency.
    pub p99_latency_ms: f64,
    /// Instructions per cycle over the window; None when counters are unavailable.
    pub ipc: Option<f64>,
    /// Cache misses / cache references over the window; None when unavailable.
    pub cache_miss_ratio: Option<f64>,
}

/// How a search ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchOutcome {
    /// The search's inputs, so a cached outcome is reused only for the same question.
    pub free_cores: u32,
    pub slo_ms: f64,
    pub max_batch: u32,
    pub max_instances: u32,
    /// The layout to run: the best measured throughput within the SLO, or when nothing met the
    /// SLO the lowest measured p99 (`meets_slo` false).
    pub config: LayoutConfig,
    pub meets_slo: bool,
    /// The measurement of `config` (averaged when measured more than once); None when nothing
    /// was measured (no free cores, or a budget of nothing).
    pub measured: Option<ProbeResult>,
    /// Probes used.
    pub probes: u32,
    /// What was learnt about the model; None when phase 1 did not finish or found no core count
    /// meeting the SLO.
    pub traits: Option<ModelTraits>,
}

/// What the caller does next.
#[derive(Debug, Clone, PartialEq)]
pub enum SearchStep {
    /// Run this layout for a measurement window and pass the result to the next call.
    Probe(LayoutConfig),
    /// The search is over. Further calls return the same outcome.
    Done(SearchOutcome),
}

/// Hill-climbing moves around the current layout. "Cores" steps move along the ladder of
/// cores-per-instance values that keep the free cores used (see [`LayoutSearch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    BatchUp,
    /// Towards the next larger batch measured on the same rung, which was worse: where latency
    /// is estimated to meet the SLO when that batch missed it, else halfway.
    BatchBetween,
    BatchDown,
    CoresUp,
    CoresDown,
    CoresUpBatchUp,
    CoresDownBatchDown,
}

/// One measured layout (several windows averaged).
#[derive(Debug, Clone, Copy)]
struct Sample {
    throughput: f64,
    p99: f64,
    ipc: Option<f64>,
    miss: Option<f64>,
    windows: u32,
}

/// A failed probe (the caller could not measure it, e.g. the instance crashed): no throughput,
/// a latency no SLO accepts.
const FAILED: Sample = Sample {
    throughput: 0.0,
    p99: f64::MAX,
    ipc: None,
    miss: None,
    windows: 1,
};

/// Raised by the search when it needs a layout that has not been measured.
struct Need(LayoutConfig);

/// The online layout search of Cloud Reamer §III-B, as a state machine: each [`next`] call hands
/// in the last measurement and gets the next layout to measure, or the result.
///
/// - Phase 1: the fewest CPUs per instance meeting the SLO at batch 1, one instance, starting at
///   1 CPU and growing. Growth doubles and then bisects (latency falls with cores), so a model
///   needing 8 CPUs costs 5 probes rather than 8. If even every free CPU misses the SLO, the
///   search ends there (`meets_slo` false).
/// - Trend: one more probe at that core count with batch [`TREND_BATCH`]; IPC and cache-miss
///   ratio against batch 1 classify the model ([`BatchTrend`]), and the two latencies estimate
///   the largest batch within the SLO.
/// - Phase 2: hill climbing over layouts from where the trend says: compute-bound models start
///   from one large instance with a large batch, cache-bound ones from the most instances of
///   the phase-1 size, unknown ones in the middle. Cores per instance move along a ladder
///   that keeps the free cores used: for each instance count n, the largest per-instance size
///   `free / n` (32 free CPUs: 1, 2, 3, 4, 5, 6, 8, 10, 16, 32 CPUs per instance), not below the
///   phase-1 size and with at most `max_instances` instances. Neighbours are batch ×2 and ÷2,
///   one rung up or down, the two diagonals, and halfway to a larger batch that failed. The
///   first neighbour better by the margin is taken (the last successful move is tried first);
///   the climb stops at a layout with no better neighbour, or when the budget runs out. The
///   whole space (267,168 layouts for 32 cores, §II-B) is never enumerated.
///
/// Within the SLO means p99 ≤ `slo_ms`. A layout measured twice is averaged; a result for a
/// layout not asked for is recorded under its own layout; `next(None)` while a probe is pending
/// records that probe as failed. Every result counts against the budget.
///
/// [`next`]: LayoutSearch::next
#[derive(Debug, Clone)]
pub struct LayoutSearch {
    free_cores: u32,
    slo_ms: f64,
    max_batch: u32,
    max_instances: u32,
    options: SearchOptions,
    hint: Option<ModelTraits>,
    samples: BTreeMap<LayoutConfig, Sample>,
    pending: Option<LayoutConfig>,
    probes: u32,
    done: Option<SearchOutcome>,
}

impl LayoutSearch {
    /// A search over `free_cores` logical CPUs for a job with this p99 SLO, batches of at most
    /// `max_batch` and at most `max_instances` instances (both at least 1).
    pub fn new(free_cores: u32, slo_ms: f64, max_batch: u32, max_instances: u32) -> Self {
        Self {
            free_cores,
            slo_ms,
            max_batch: max_batch.max(1),
            max_instances: max_instances.max(1),
            options: SearchOptions::default(),
            hint: None,
            samples: BTreeMap::new(),
            pending: None,
            probes: 0,
            done: None,
        }
    }

    pub fn with_options(mut self, options: SearchOptions) -> Self {
        self.options = options;
        self
    }

    /// Skips phase 1 and the trend probe with what a search at another core count learnt
    /// (ignored when its phase-1 size exceeds `free_cores`).
    pub fn with_traits(mut self, traits: ModelTraits) -> Self {
        self.hint = Some(traits);
        self
    }

    /// Results received so far.
    pub fn probes_used(&self) -> u32 {
        self.probes
    }

    /// Hands in the measurement of the last probe (None on the first call) and returns the next
    /// step.
    pub fn next(&mut self, last: Option<ProbeResult>) -> SearchStep {
        if let Some(done) = &self.done {
            return SearchStep::Done(done.clone());
        }
        match last {
            Some(result) => {
                self.probes += 1;
                if self.valid(&result.config) {
                    self.record(result.config, sample_of(&result));
                }
            }
            None => {
                if let Some(pending) = self.pending {
                    self.probes += 1;
                    self.record(pending, FAILED);
                }
            }
        }
        self.pending = None;
        let mut traits = None;
        let ran = self.run(&mut traits);
        match ran {
            Err(Need(config)) if self.probes < self.options.probe_budget.max(1) => {
                self.pending = Some(config);
                SearchStep::Probe(config)
            }
            _ => {
                let outcome = self.finish(traits);
                self.done = Some(outcome.clone());
                SearchStep::Done(outcome)
            }
        }
    }

    fn valid(&self, c: &LayoutConfig) -> bool {
        c.cores_per_instance >= 1
            && c.instances >= 1
            && c.instances <= self.max_instances
            && c.batch >= 1
            && c.batch <= self.max_batch
            && c.cpus() <= self.free_cores
    }

    fn record(&mut self, config: LayoutConfig, s: Sample) {
        let entry = self
            .samples
            .entry(config)
            .or_insert(Sample { windows: 0, ..s });
        let n = f64::from(entry.windows);
        let avg = |old: f64, new: f64| (old * n + new) / (n + 1.0);
        let avg_opt = |old: Option<f64>, new: Option<f64>| match (old, new) {
            (Some(o), Some(v)) => Some(avg(o, v)),
            (o, v) => v.or(o),
        };
        if entry.windows > 0 {
            entry.throughput = avg(entry.throughput, s.throughput);
            entry.p99 = avg(entry.p99, s.p99);
            entry.ipc = avg_opt(entry.ipc, s.ipc);
            entry.miss = avg_opt(entry.miss, s.miss);
        }
        entry.windows += 1;
    }

    fn measure(&self, config: LayoutConfig) -> Result<Sample, Need> {
        self.samples.get(&config).copied().ok_or(Need(config))
    }

    fn feasible(&self, s: &Sample) -> bool {
        s.p99 <= self.slo_ms
    }

    /// Whether `s` is better than `cur` by the margin: within the SLO beats over it; within,
    /// higher throughput; over, lower latency.
    fn better(&self, s: &Sample, cur: &Sample) -> bool {
        let m = self.options.margin.max(0.0);
        match (self.feasible(s), self.feasible(cur)) {
            (true, false) => true,
            (false, true) => false,
            (true, true) => s.throughput > cur.throughput * (1.0 + m),
            (false, false) => s.p99 < cur.p99 * (1.0 - m).max(0.0),
        }
    }

    /// The whole search, replayed from the measurements so far; stops at the first layout not
    /// yet measured. `traits` is set once phase 1 and the trend are known.
    fn run(&self, traits: &mut Option<ModelTraits>) -> Result<(), Need> {
        if self.free_cores == 0 {
            return Ok(());
        }
        let known = match self.hint {
            Some(t)
                if t.min_cores_per_instance >= 1 && t.min_cores_per_instance <= self.free_cores =>
            {
                t
            }
            _ => {
                let Some(min) = self.min_cores()? else {
                    return Ok(());
                };
                let (trend, feasible_batch) = self.trend(min)?;
                ModelTraits {
                    min_cores_per_instance: min,
                    trend,
                    feasible_batch,
                }
            }
        };
        *traits = Some(known);
        let ladder = self.ladder(known.min_cores_per_instance);
        let mut cur = self.start(&ladder, &known);
        let mut cur_s = self.measure(cur)?;
        let mut momentum = None;
        loop {
            let mut moved = false;
            for mv in move_order(known.trend, momentum, self.feasible(&cur_s)) {
                let Some(next) = self.neighbour(&ladder, cur, &cur_s, mv) else {
                    continue;
                };
                let s = self.measure(next)?;
                if self.better(&s, &cur_s) {
                    (cur, cur_s, momentum, moved) = (next, s, Some(mv), true);
                    break;
                }
            }
            // Every move raises the score by the margin over a fixed set of measurements, so
            // the climb cannot cycle.
            if !moved {
                return Ok(());
            }
        }
    }

    /// Phase 1 (Cloud Reamer §III-B: "starts by creating a single instance on one core,
    /// gradually increasing the number of cores until the latency constraint is satisfied").
    /// None when even all free CPUs miss the SLO.
    fn min_cores(&self) -> Result<Option<u32>, Need> {
        let probe = |c: u32| LayoutConfig {
            cores_per_instance: c,
            instances: 1,
            batch: 1,
        };
        let mut fail = 0;
        let mut c = 1;
        let pass = loop {
            if self.feasible(&self.measure(probe(c))?) {
                break c;
            }
            fail = c;
            if c >= self.free_cores {
                return Ok(None);
            }
            c = c.saturating_mul(2).min(self.free_cores);
        };
        let (mut lo, mut hi) = (fail, pass);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.feasible(&self.measure(probe(mid))?) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(Some(hi))
    }

    /// The IPC and cache-miss trend with batch (Cloud Reamer §III-B, Fig. 5), and the largest
    /// batch estimated to meet the SLO at `min` CPUs (latency taken as linear in batch).
    fn trend(&self, min: u32) -> Result<(BatchTrend, u32), Need> {
        let tb = TREND_BATCH.min(self.max_batch);
        if tb <= 1 {
            return Ok((BatchTrend::Unknown, 1));
        }
        let config = |batch| LayoutConfig {
            cores_per_instance: min,
            instances: 1,
            batch,
        };
        let small = self.measure(config(1))?;
        let large = self.measure(config(tb))?;
        let trend = classify(&small, &large);
        let slope = (large.p99 - small.p99) / f64::from(tb - 1);
        let feasible_batch = if !slope.is_finite() || slope <= 0.0 {
            self.max_batch
        } else {
            floor_batch(1.0 + (self.slo_ms - small.p99) / slope, self.max_batch)
        };
        Ok((trend, feasible_batch))
    }

    /// Rungs `(cores per instance, instances)`, by cores: for each instance count up to
    /// `max_instances` and `free / min`, the largest equal share of the free CPUs.
    fn ladder(&self, min: u32) -> Vec<(u32, u32)> {
        let most = (self.free_cores / min.max(1))
            .min(self.max_instances)
            .max(1);
        let mut rungs: BTreeMap<u32, u32> = BTreeMap::new();
        for n in 1..=most {
            let c = self.free_cores / n;
            let entry = rungs.entry(c).or_insert(n);
            *entry = (*entry).max(n);
        }
        rungs.into_iter().collect()
    }

    /// Where phase 2 starts (Cloud Reamer §III-B: "the search starts from a large number of
    /// instances, each with a single CPU core or a single instance with the maximum batch size").
    fn start(&self, ladder: &[(u32, u32)], t: &ModelTraits) -> LayoutConfig {
        let min = f64::from(t.min_cores_per_instance.max(1));
        let fb = t.feasible_batch.clamp(1, self.max_batch);
        // The batch estimate was made at `min` CPUs; an instance with more CPUs gets through a
        // batch faster. Scaling by the square root assumes a middling parallel efficiency: the
        // climb corrects either way.
        let scaled = |cores: u32| {
            let x = 1.0 + f64::from(fb - 1) * (f64::from(cores) / min).sqrt();
            floor_batch(x, self.max_batch)
        };
        let last = ladder.len().saturating_sub(1);
        let (i, batch) = match t.trend {
            // Rising IPC, stable misses: one large instance with a large batch.
            BatchTrend::ComputeBound => (last, scaled(ladder[last].0)),
            // Falling IPC or rising misses: many small instances, small batches.
            BatchTrend::CacheBound => (0, fb.min(2)),
            BatchTrend::Unknown => {
                let mid = ladder.len() / 2;
                let geometric = floor_batch(f64::from(self.max_batch).sqrt(), self.max_batch);
                (mid, scaled(ladder[mid].0).min(geometric))
            }
        };
        let (cores_per_instance, instances) = ladder[i];
        LayoutConfig {
            cores_per_instance,
            instances,
            batch,
        }
    }

    /// The layout `mv` leads to from `cur`, or None when it leaves the space or cannot help.
    fn neighbour(
        &self,
        ladder: &[(u32, u32)],
        cur: LayoutConfig,
        cur_s: &Sample,
        mv: Move,
    ) -> Option<LayoutConfig> {
        let pos = ladder
            .iter()
            .position(|&(c, _)| c == cur.cores_per_instance)?;
        let b = cur.batch;
        let up = (b < self.max_batch).then(|| b.saturating_mul(2).min(self.max_batch));
        let down = (b > 1).then_some(b / 2);
        let at = |i: usize, batch: u32| {
            ladder.get(i).map(|&(c, n)| LayoutConfig {
                cores_per_instance: c,
                instances: n,
                batch,
            })
        };
        // Measured batches on this rung, above the current one.
        let above = || {
            self.samples.iter().filter(move |(c, _)| {
                c.cores_per_instance == cur.cores_per_instance
                    && c.instances == cur.instances
                    && c.batch > b
            })
        };
        match mv {
            Move::BatchUp => {
                let target = up?;
                // Latency grows with batch: past a batch that missed the SLO there is no need
                // to look.
                let blocked = self.feasible(cur_s)
                    && above().any(|(c, s)| c.batch <= target && !self.feasible(s));
                if blocked {
                    None
                } else {
                    at(pos, target)
                }
            }
            Move::BatchBetween => {
                let (hi, hi_s) = above().min_by_key(|(c, _)| c.batch)?;
                if hi.batch - b < 2 {
                    return None;
                }
                let target = if self.feasible(cur_s) && !self.feasible(hi_s) {
                    // A secant step to where latency meets the SLO, rather than bisection:
                    // one probe instead of log2(batch).
                    let slope = (hi_s.p99 - cur_s.p99) / f64::from(hi.batch - b);
                    if slope.is_nan() || slope <= 0.0 {
                        return None;
                    }
                    let reach = floor_batch((self.slo_ms - cur_s.p99) / slope, hi.batch);
                    b + reach.min(hi.batch - b - 1)
                } else {
                    b + (hi.batch - b) / 2
                };
                // Throughput grows at most in proportion to batch: a step of less than an
                // eighth is not worth a probe.
                (target >= b + (b / 8).max(1))
                    .then(|| at(pos, target))
                    .flatten()
            }
            Move::BatchDown => at(pos, down?),
            Move::CoresUp => at(pos + 1, b),
            Move::CoresDown => at(pos.checked_sub(1)?, b),
            Move::CoresUpBatchUp => at(pos + 1, up?),
            Move::CoresDownBatchDown => at(pos.checked_sub(1)?, down?),
        }
    }

    /// The outcome from the measurements so far.
    fn finish(&self, traits: Option<ModelTraits>) -> SearchOutcome {
        let best_within = self
            .samples
            .iter()
            .filter(|(_, s)| self.feasible(s))
            .max_by(|(ca, a), (cb, b)| {
                a.throughput
                    .total_cmp(&b.throughput)
                    .then(b.p99.total_cmp(&a.p99))
                    .then(cb.cmp(ca))
            });
        let lowest_latency = || {
            self.samples
                .iter()
                .min_by(|(ca, a), (cb, b)| a.p99.total_cmp(&b.p99).then(ca.cmp(cb)))
        };
        let meets_slo = best_within.is_some();
        let chosen = best_within.or_else(lowest_latency);
        let (config, measured) = match chosen {
            Some((c, s)) => (
                *c,
                Some(ProbeResult {
                    config: *c,
                    throughput_per_s: s.throughput,
                    p99_latency_ms: s.p99,
                    ipc: s.ipc,
                    cache_miss_ratio: s.miss,
                }),
            ),
            None => (
                LayoutConfig {
                    cores_per_instance: self.free_cores,
                    instances: u32::from(self.free_cores > 0),
                    batch: 1,
                },
                None,
            ),
        };
        SearchOutcome {
            free_cores: self.free_cores,
            slo_ms: self.slo_ms,
            max_batch: self.max_batch,
            max_instances: self.max_instances,
            config,
            meets_slo,
            measured,
            probes: self.probes,
            traits,
        }
    }
}

fn sample_of(r: &ProbeResult) -> Sample {
    let finite = |x: Option<f64>| x.filter(|v| v.is_finite() && *v >= 0.0);
    Sample {
        throughput: if r.throughput_per_s.is_finite() && r.throughput_per_s > 0.0 {
            r.throughput_per_s
        } else {
            0.0
        },
        p99: if r.p99_latency_ms.is_nan() || r.p99_latency_ms < 0.0 {
            f64::MAX
        } else {
            r.p99_latency_ms.min(f64::MAX)
        },
        ipc: finite(r.ipc),
        miss: finite(r.cache_miss_ratio),
        windows: 1,
    }
}

/// `x` rounded down to a batch in `1..=max`.
fn floor_batch(x: f64, max: u32) -> u32 {
    if x.is_nan() || x < 1.0 {
        return 1;
    }
    if x >= f64::from(max) {
        return max;
    }
    // In range 1..max here, so the conversion neither truncates nor saturates.
    let floored = x.floor() as u32;
    floored.clamp(1, max)
}

/// Classifies the batch trend from the batch-1 and larger-batch probes of one instance
/// (Cloud Reamer §III-B: "for models with a stable cache miss rate and increasing IPC as batch
/// size increases, creating a single large instance ... can enhance throughput. Conversely, for
/// models that show increasing cache miss rates and declining IPC ..., creating multiple
/// instances"). Either signal alone suffices for cache-bound; compute-bound needs rising IPC
/// and misses that do not rise (or are not measured).
fn classify(small: &Sample, large: &Sample) -> BatchTrend {
    let miss_rise = match (small.miss, large.miss) {
        (Some(a), Some(b)) => b - a > MISS_RISE_ABS && b > a * (1.0 + MISS_RISE_REL),
        _ => false,
    };
    let ipc_change = match (small.ipc, large.ipc) {
        (Some(a), Some(b)) if a > 0.0 => Some((b - a) / a),
        _ => None,
    };
    match ipc_change {
        Some(d) if d <= -IPC_TREND => BatchTrend::CacheBound,
        _ if miss_rise => BatchTrend::CacheBound,
        Some(d) if d >= IPC_TREND => BatchTrend::ComputeBound,
        _ => BatchTrend::Unknown,
    }
}

/// Neighbours in the order to try them: the last successful move first, then what the trend
/// suggests; over the SLO, the moves that lower latency.
fn move_order(trend: BatchTrend, momentum: Option<Move>, feasible: bool) -> Vec<Move> {
    use Move::*;
    let base: &[Move] = if !feasible {
        &[
            BatchDown,
            CoresUp,
            CoresDownBatchDown,
            CoresUpBatchUp,
            CoresDown,
        ]
    } else {
        match trend {
            BatchTrend::ComputeBound => &[
                BatchUp,
                BatchBetween,
                CoresUpBatchUp,
                CoresUp,
                BatchDown,
                CoresDown,
                CoresDownBatchDown,
            ],
            BatchTrend::CacheBound => &[
                BatchUp,
                BatchBetween,
                CoresDown,
                CoresDownBatchDown,
                BatchDown,
                CoresUp,
                CoresUpBatchUp,
            ],
            BatchTrend::Unknown => &[
                BatchUp,
                BatchBetween,
                CoresDown,
                CoresUp,
                BatchDown,
                CoresUpBatchUp,
                CoresDownBatchDown,
            ],
        }
    };
    let mut order = Vec::with_capacity(base.len());
    if let Some(m) = momentum.filter(|m| base.contains(m)) {
        order.push(m);
    }
    order.extend(base.iter().copied().filter(|m| Some(*m) != momentum));
    order
}

/// Search outcomes of one online job by free-core count, so that a re-plan after a training job
/// arrives or leaves reuses what was measured for that count (issue: "the layout search result
/// for the new core count is reused where it was measured"). Per job: outcomes depend on the
/// model. An outcome is reused only for the same SLO, max batch and max instances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SearchCache {
    by_free_cores: BTreeMap<u32, SearchOutcome>,
}

/// A cached outcome, or a search to run.
#[derive(Debug, Clone)]
pub enum SearchStart {
    Cached(SearchOutcome),
    Search(LayoutSearch),
}

impl SearchCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The outcome measured for these inputs, if any.
    pub fn get(
        &self,
        free_cores: u32,
        slo_ms: f64,
        max_batch: u32,
        max_instances: u32,
    ) -> Option<&SearchOutcome> {
        self.by_free_cores.get(&free_cores).filter(|o| {
            o.slo_ms == slo_ms
                && o.max_batch == max_batch.max(1)
                && o.max_instances == max_instances.max(1)
        })
    }

    /// Remembers an outcome under its free-core count, replacing any older one.
    pub fn insert(&mut self, outcome: SearchOutcome) {
        self.by_free_cores.insert(outcome.free_cores, outcome);
    }

    /// The cached outcome for these inputs, or a new search; a new search skips phase 1 and the
    /// trend probe when an outcome for another core count with the same SLO and max batch knows
    /// them (the nearest core count's).
    pub fn begin(
        &self,
        free_cores: u32,
        slo_ms: f64,
        max_batch: u32,
        max_instances: u32,
    ) -> SearchStart {
        if let Some(hit) = self.get(free_cores, slo_ms, max_batch, max_instances) {
            return SearchStart::Cached(hit.clone());
        }
        let search = LayoutSearch::new(free_cores, slo_ms, max_batch, max_instances);
        let traits = self
            .by_free_cores
            .values()
            .filter(|o| o.slo_ms == slo_ms && o.max_batch == max_batch.max(1))
            .filter_map(|o| o.traits.map(|t| (o.free_cores.abs_diff(free_cores), t)))
            .filter(|(_, t)| t.min_cores_per_instance <= free_cores)
            .min_by_key(|(d, _)| *d)
            .map(|(_, t)| t);
        SearchStart::Search(match traits {
            Some(t) => search.with_traits(t),
            None => search,
        })
    }

    pub fn len(&self) -> usize {
        self.by_free_cores.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_free_cores.is_empty()
    }

    /// Forgets everything (the job's SLO or model changed).
    pub fn clear(&mut self) {
        self.by_free_cores.clear();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use proptest::prelude::*;

    // -----------------------------------------------------------------------------------------
    // A synthetic performance model for the search

    /// Throughput and latency of a CPU inference model as functions of the layout: Amdahl
    /// scaling inside an instance, batching amortizing per-item cost (IPC rising with batch),
    /// and a cache knee: an instance's activations (∝ batch) overflowing its share of the cache
    /// (∝ its cores) slow it down, cut IPC and raise misses, and load memory bandwidth shared
    /// by all instances.
    #[derive(Debug, Clone, Copy)]
    struct PerfModel {
        name: &'static str,
        free: u32,
        slo_ms: f64,
        max_batch: u32,
        max_instances: u32,
        /// One core's milliseconds per item at batch 1.
        item_ms: f64,
        /// Fixed cost per batch (framework overhead).
        batch_ms: f64,
        /// Amdahl serial fraction inside one instance.
        serial: f64,
        /// Per-item efficiency gain from batching: efficiency b(1+b0)/(b+b0), 1 at batch 1.
        b0: f64,
        /// Cache (MB) per core; an instance's working set: its copy of the weights plus the
        /// activations (MB) of each item in a batch.
        cache_per_core_mb: f64,
        weights_mb: f64,
        act_mb: f64,
        /// Slowdown per unit of working set overflowing the instance's cache share.
        miss_penalty: f64,
        /// Relative measurement noise (uniform ±).
        noise: f64,
        counters: bool,
    }

    struct Truth {
        throughput: f64,
        p99: f64,
        ipc: f64,
        miss: f64,
    }

    impl PerfModel {
        fn truth(&self, c: &LayoutConfig) -> Truth {
            let cores = f64::from(c.cores_per_instance);
            let n = f64::from(c.instances);
            let b = f64::from(c.batch);
            let speedup = 1.0 / (self.serial + (1.0 - self.serial) / cores);
            let eff = b * (1.0 + self.b0) / (b + self.b0);
            let ws = self.weights_mb + self.act_mb * b;
            let share = self.cache_per_core_mb * cores;
            let overflow = ((ws - share) / ws).max(0.0);
            let slow = 1.0 + self.miss_penalty * overflow;
            // Memory bandwidth: instances that miss load each other.
            let busy = n * cores / f64::from(self.free);
            let contention = 1.0 + 0.5 * overflow * busy;
            let batch_latency =
                (self.batch_ms + self.item_ms * b / (speedup * eff) * slow) * contention;
            Truth {
                throughput: n * b / batch_latency * 1000.0,
                p99: batch_latency * 1.15,
                ipc: 0.8 * eff / slow / contention,
                miss: 0.03 + 0.5 * overflow,
            }
        }

        /// The best layout within the SLO over every uniform layout: every cores per instance,
        /// every instance count that fits, every batch.
        fn exhaustive(&self) -> Option<(LayoutConfig, f64, usize)> {
            let mut best: Option<(LayoutConfig, f64)> = None;
            let mut evaluated = 0;
            for c in 1..=self.free {
                for n in 1..=(self.free / c).min(self.max_instances) {
                    for b in 1..=self.max_batch {
                        let config = LayoutConfig {
                            cores_per_instance: c,
                            instances: n,
                            batch: b,
                        };
                        evaluated += 1;
                        let t = self.truth(&config);
                        if t.p99 <= self.slo_ms && best.is_none_or(|(_, tp)| t.throughput > tp) {
                            best = Some((config, t.throughput));
                        }
                    }
                }
            }
            best.map(|(c, tp)| (c, tp, evaluated))
        }
    }

    struct SearchRun {
        found: SearchOutcome,
        probes: u32,
        true_throughput: f64,
        true_p99: f64,
    }

    fn drive(model: &PerfModel, seed: u64, search: LayoutSearch) -> SearchRun {
        let mut rng = Rng::splitmix(seed);
        let mut search = search;
        let mut last = None;
        let mut asked = 0;
        loop {
            match search.next(last.take()) {
                SearchStep::Probe(config) => {
                    asked += 1;
                    if std::env::var("TRACE")
                        .ok()
                        .and_then(|v| v.parse::<u64>().ok())
                        == Some(seed)
                    {
                        let t = model.truth(&config);
                        println!(
                            "   probe {asked}: {config}  tp {:.0} p99 {:.0} ipc {:.2} miss {:.2}",
                            t.throughput, t.p99, t.ipc, t.miss
                        );
                    }
                    assert!(asked <= 100, "{}: the search does not end", model.name);
                    let t = model.truth(&config);
                    last = Some(ProbeResult {
                        config,
                        throughput_per_s: t.throughput * rng.jitter(model.noise),
                        p99_latency_ms: t.p99 * rng.jitter(model.noise),
                        ipc: model.counters.then(|| t.ipc * rng.jitter(model.noise)),
                        cache_miss_ratio: model.counters.then(|| t.miss * rng.jitter(model.noise)),
                    });
                }
                SearchStep::Done(found) => {
                    let t = model.truth(&found.config);
                    return SearchRun {
                        probes: found.probes,
                        true_throughput: t.throughput,
                        true_p99: t.p99,
                        found,
                    };
                }
            }
        }
    }

    fn search_for(model: &PerfModel) -> LayoutSearch {
        LayoutSearch::new(
            model.free,
            model.slo_ms,
            model.max_batch,
            model.max_instances,
        )
    }

    /// DeepSpeech-like (Fig. 5): little activation data, strong batching gains, scales well.
    const COMPUTE_BOUND: PerfModel = PerfModel {
        name: "compute-bound",
        free: 32,
        slo_ms: 800.0,
        max_batch: 64,
        max_instances: 64,
        item_ms: 60.0,
        batch_ms: 4.0,
        serial: 0.03,
        b0: 6.0,
        cache_per_core_mb: 1.5,
        weights_mb: 6.0,
        act_mb: 0.02,
        miss_penalty: 1.0,
        noise: 0.03,
        counters: true,
    };

    /// ResNet101-like (Fig. 5): activations overflow the cache past a small batch, poor
    /// scaling inside an instance.
    const SMALL_CACHE: PerfModel = PerfModel {
        name: "small-cache",
        free: 32,
        slo_ms: 300.0,
        max_batch: 64,
        max_instances: 64,
        item_ms: 25.0,
        batch_ms: 6.0,
        serial: 0.2,
        b0: 1.5,
        cache_per_core_mb: 1.5,
        weights_mb: 0.5,
        act_mb: 1.2,
        miss_penalty: 2.5,
        noise: 0.03,
        counters: true,
    };

    /// BERT-like: in between.
    const BALANCED: PerfModel = PerfModel {
        name: "balanced",
        free: 32,
        slo_ms: 400.0,
        max_batch: 32,
        max_instances: 64,
        item_ms: 40.0,
        batch_ms: 5.0,
        serial: 0.08,
        b0: 3.0,
        cache_per_core_mb: 1.5,
        weights_mb: 2.0,
        act_mb: 0.4,
        miss_penalty: 1.5,
        noise: 0.03,
        counters: true,
    };

    fn model_shapes() -> Vec<PerfModel> {
        vec![
            COMPUTE_BOUND,
            SMALL_CACHE,
            BALANCED,
            PerfModel {
                name: "balanced, no counters",
                counters: false,
                ..BALANCED
            },
            PerfModel {
                name: "small-cache, tight SLO",
                slo_ms: 40.0,
                ..SMALL_CACHE
            },
            PerfModel {
                name: "compute-bound, 16 CPUs",
                free: 16,
                ..COMPUTE_BOUND
            },
            PerfModel {
                name: "small-cache, 64 CPUs",
                free: 64,
                ..SMALL_CACHE
            },
            PerfModel {
                name: "balanced, 8 CPUs, noisy",
                free: 8,
                noise: 0.08,
                ..BALANCED
            },
            PerfModel {
                name: "compute-bound, ≤2 inst.",
                max_instances: 2,
                ..COMPUTE_BOUND
            },
            PerfModel {
                name: "small-cache, 24 CPUs",
                free: 24,
                slo_ms: 120.0,
                max_batch: 32,
                ..SMALL_CACHE
            },
        ]
    }

    /// Gap to the exhaustive optimum, in percent of it, of each of `seeds` noisy searches; a
    /// result that truly misses the SLO counts as a 100% gap.
    fn gaps(model: &PerfModel, opt_tp: f64, budget: u32, seeds: u64) -> (Vec<f64>, Vec<u32>) {
        let options = SearchOptions {
            probe_budget: budget,
            ..SearchOptions::default()
        };
        (0..seeds)
            .map(|seed| {
                let run = drive(model, seed, search_for(model).with_options(options));
                let gap = if run.true_p99 <= model.slo_ms {
                    (opt_tp - run.true_throughput) / opt_tp * 100.0
                } else {
                    100.0
                };
                (gap, run.probes)
            })
            .unzip()
    }

    /// The search against the exhaustive optimum on the synthetic model (issue benchmark (d),
    /// simulated). `cargo test --lib simulated_search -- --nocapture` prints the table.
    #[test]
    fn simulated_search_reaches_near_the_exhaustive_optimum() {
        const SEEDS: u64 = 20;
        println!(
            "{:<24} {:>4} {:>6} {:>21} {:>7} | {:>21} {:>5} {:>5} {:>6} | {:>5} {:>5} {:>6}",
            "model",
            "CPUs",
            "space",
            "exhaustive best",
            "req/s",
            "search (seed 0)",
            "gap%",
            "worst",
            "probes",
            "gap16",
            "worst",
            "probes"
        );
        for model in model_shapes() {
            let (opt, opt_tp, space) = model.exhaustive().unwrap();
            let seed0 = drive(&model, 0, search_for(&model));
            let (g12, p12) = gaps(&model, opt_tp, DEFAULT_PROBE_BUDGET, SEEDS);
            let (g16, p16) = gaps(&model, opt_tp, 16, SEEDS);
            let mean = |g: &[f64]| g.iter().sum::<f64>() / g.len() as f64;
            let worst = |g: &[f64]| g.iter().copied().fold(0.0, f64::max);
            let avg = |p: &[u32]| f64::from(p.iter().sum::<u32>()) / p.len() as f64;
            println!(
                "{:<24} {:>4} {:>6} {:>21} {:>7.0} | {:>21} {:>5.1} {:>5.1} {:>6.1} | {:>5.1} {:>5.1} {:>6.1}",
                model.name,
                model.free,
                space,
                opt.to_string(),
                opt_tp,
                seed0.found.config.to_string(),
                mean(&g12),
                worst(&g12),
                avg(&p12),
                mean(&g16),
                worst(&g16),
                avg(&p16),
            );
            assert!(
                p12.iter().all(|&p| p <= DEFAULT_PROBE_BUDGET),
                "{}",
                model.name
            );
            assert!(p16.iter().all(|&p| p <= 16), "{}", model.name);
            assert!(
                worst(&g12) <= 15.0 && mean(&g12) <= 10.0,
                "{}: {:.1}% mean, {:.1}% worst with {} probes",
                model.name,
                mean(&g12),
                worst(&g12),
                DEFAULT_PROBE_BUDGET
            );
            assert!(
                worst(&g16) <= 10.0 && mean(&g16) <= 5.0,
                "{}: {:.1}% mean, {:.1}% worst with 16 probes",
                model.name,
                mean(&g16),
                worst(&g16)
            );
        }
    }

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
                if inst.cpus.len() != 1 || inst.threads != 1 || inst.batch != view.batch {
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
        let plan = place(
            &topo,
            &reserved,
            &training,
            &online,
            &offline,
            &InferencePlan::default(),
        );
        check_plan(&topo, &reserved, &training, &online, &offline, &plan).unwrap();
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
        let plan = place(
            &topo,
            &reserved,
            &training,
            &online,
            &offline,
            &InferencePlan::default(),
        );
        check_plan(&topo, &reserved, &training, &online, &offline, &plan).unwrap();
        assert_eq!(
            plan.offline_cpus().intersection(&training).to_string(),
            "1-2,33"
        );
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

    /// Drives a search with a noiseless model; returns the probes asked and the outcome.
    fn run_model(model: &PerfModel, search: LayoutSearch) -> (Vec<LayoutConfig>, SearchOutcome) {
        let model = PerfModel {
            noise: 0.0,
            ..*model
        };
        let mut search = search;
        let mut asked = Vec::new();
        let mut last = None;
        loop {
            match search.next(last.take()) {
                SearchStep::Probe(c) => {
                    asked.push(c);
                    let t = model.truth(&c);
                    last = Some(ProbeResult {
                        config: c,
                        throughput_per_s: t.throughput,
                        p99_latency_ms: t.p99,
                        ipc: model.counters.then_some(t.ipc),
                        cache_miss_ratio: model.counters.then_some(t.miss),
                    });
                }
                SearchStep::Done(o) => return (asked, o),
            }
        }
    }

    #[test]
    fn phase1_grows_from_one_core_and_bisects() {
        // A tight SLO: batch 1 needs 3 CPUs (1 and 2 miss it).
        let model = PerfModel {
            slo_ms: 21.0,
            ..SMALL_CACHE
        };
        let (asked, out) = run_model(&model, search_for(&model));
        let phase1: Vec<u32> = asked
            .iter()
            .take_while(|c| c.instances == 1 && c.batch == 1)
            .map(|c| c.cores_per_instance)
            .collect();
        assert_eq!(phase1, [1, 2, 4, 3]);
        let traits = out.traits.unwrap();
        assert_eq!(traits.min_cores_per_instance, 3);
        assert_eq!(traits.trend, BatchTrend::CacheBound);
        assert!(out.meets_slo);
        assert!(out.config.cores_per_instance >= 3);
        assert!(out.measured.unwrap().p99_latency_ms <= 21.0);
    }

    #[test]
    fn starts_where_the_trend_says() {
        for (model, want) in [
            (COMPUTE_BOUND, layout(32, 1, 0)),
            (SMALL_CACHE, layout(1, 32, 0)),
            (
                PerfModel {
                    counters: false,
                    ..BALANCED
                },
                layout(6, 5, 0),
            ),
        ] {
            let (asked, out) = run_model(&model, search_for(&model));
            // Phase 1 found 1 CPU at once; the trend probe is second; phase 2 starts third.
            assert_eq!(asked[1], layout(1, 1, TREND_BATCH), "{}", model.name);
            let start = asked[2];
            assert_eq!(
                (start.cores_per_instance, start.instances),
                (want.cores_per_instance, want.instances),
                "{}: {start}",
                model.name
            );
            let want_trend = match model.name {
                "compute-bound" => BatchTrend::ComputeBound,
                "small-cache" => BatchTrend::CacheBound,
                _ => BatchTrend::Unknown,
            };
            assert_eq!(out.traits.unwrap().trend, want_trend, "{}", model.name);
        }
    }

    #[test]
    fn no_layout_meets_the_slo() {
        let model = PerfModel {
            slo_ms: 1.0,
            ..BALANCED
        };
        let (asked, out) = run_model(&model, search_for(&model));
        // 1, 2, 4, 8, 16, 32 CPUs at batch 1 all miss it: nothing else is tried.
        assert_eq!(asked.len(), 6);
        assert!(!out.meets_slo);
        assert_eq!(out.traits, None);
        assert_eq!(out.config, layout(32, 1, 1), "the lowest latency measured");
    }

    #[test]
    fn budget_bounds_the_probes() {
        for budget in [1, 3, 5, 12] {
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
        assert_eq!(first, layout(1, 1, 1));
        // The caller could not measure it: counted as failed, the search grows.
        let SearchStep::Probe(second) = s.next(None) else {
            panic!("asks for a probe")
        };
        assert_eq!(second, layout(2, 1, 1));
        assert_eq!(s.probes_used(), 1);
        // A result for a layout outside the space is counted but ignored; the pending probe is
        // asked again.
        let bogus = ProbeResult {
            config: layout(4, 4, 1),
            throughput_per_s: 1e9,
            p99_latency_ms: 0.0,
            ipc: None,
            cache_miss_ratio: None,
        };
        assert_eq!(s.next(Some(bogus)), SearchStep::Probe(layout(2, 1, 1)));
        assert_eq!(s.probes_used(), 2);
        // NaN latency never meets the SLO.
        let nan = ProbeResult {
            config: layout(2, 1, 1),
            throughput_per_s: f64::NAN,
            p99_latency_ms: f64::NAN,
            ipc: Some(f64::NAN),
            cache_miss_ratio: None,
        };
        assert_eq!(s.next(Some(nan)), SearchStep::Probe(layout(4, 1, 1)));
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
        // A training job took 8 CPUs: a new search, without phase 1 and the trend probe.
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
        assert_ne!(asked[0], layout(1, 1, 1), "phase 1 skipped");
        assert!(out24.meets_slo);
        assert!(asked.len() < first_asked.len() || asked.len() == 12);
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
                .map(|(i, &c)| TrainingJobView { id: id(i as u64 + 1), cores: 2 * c, gpus: vec![0] })
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
                cache_per_core_mb: 1.5,
                weights_mb,
                act_mb,
                miss_penalty: 2.0,
                noise,
                counters,
            };
            let options = SearchOptions { probe_budget: budget, ..SearchOptions::default() };
            let run = drive(&model, seed, search_for(&model).with_options(options));
            let out = &run.found;
            prop_assert!(run.probes <= budget, "{} probes over {}", run.probes, budget);
            let c = out.config;
            prop_assert!(c.cores_per_instance >= 1 && c.instances >= 1, "{}", c);
            prop_assert!(c.cpus() <= free && c.instances <= max_instances, "{}", c);
            prop_assert!(c.batch >= 1 && c.batch <= max_batch, "{}", c);
            let measured = out.measured.as_ref().unwrap();
            prop_assert_eq!(measured.config, c);
            prop_assert_eq!(out.meets_slo, measured.p99_latency_ms <= slo_ms);
            if let Some(t) = out.traits {
                prop_assert!(t.min_cores_per_instance <= c.cores_per_instance || !out.meets_slo
                    || c.instances == 1);
            }
        }
    }
}
