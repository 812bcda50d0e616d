//! The online jobs' layouts (Cloud Reamer §III-B): each job's core budget, which layout it runs
//! now within it (a probe of its search, the search's outcome or a cached one) and what a
//! finished probe measured. Part of the inference controller; touches only its searches and the
//! jobs lent by the tick.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tracing::{debug, info};

use super::inference::Inference;
use super::TickCx;
use crate::enforce::instances::{InstanceState, InstanceStats, Instances};
use crate::job::{JobId, JobKind, Target};
use crate::policy::contention::Throttles;
use crate::policy::inference::{
    online_budgets, LayoutConfig, LayoutSearch, OnlineJobView, ProbeResult, SearchStart, SearchStep,
};
use crate::store::{SearchUnderWay, StoredJob};

/// An online job's layout search between two probes.
pub(super) struct SearchRun {
    pub(super) search: LayoutSearch,
    pub(super) probe: LayoutConfig,
    since: Instant,
    /// The job's core budget the search runs within.
    budget: u32,
}

/// A probe's measurement once it is ready (see [`probe_result`]): the job, the layout probed
/// and how long it has been in force.
pub(super) type Measure<'a> = dyn Fn(&JobId, LayoutConfig, Duration) -> Option<ProbeResult> + 'a;

/// The online jobs' layout searches under way, and how long one probe is measured.
pub(super) struct Searches {
    runs: BTreeMap<JobId, SearchRun>,
    probe_window: Duration,
}

impl Inference {
    /// Every online job's layout this tick (Cloud Reamer §III-A/B), from the CPUs online
    /// inference may use (`usable`) and contention's core cuts; see [`online_views`].
    pub(super) fn online_jobs(
        &mut self,
        cx: &mut TickCx<'_>,
        usable: u32,
        throttles: &Throttles,
        stats: &[InstanceStats],
    ) -> Vec<OnlineJobView> {
        let runner = &self.runner;
        let window = self.searches.probe_window;
        let observations = cx.observations;
        let measure = |id: &JobId, probe: LayoutConfig, age: Duration| {
            probe_result(
                id,
                probe,
                stats,
                runner,
                observations.jobs.get(id),
                window,
                age,
            )
        };
        online_views(
            &mut self.searches,
            &mut cx.state.jobs,
            (usable, cx.topology.threads_per_core()),
            &throttles.cores,
            Instant::now(),
            &measure,
        )
    }
}

/// The online jobs' layouts this tick. An online container is one instance of the size its pod
/// asks for (docs/kubernetes.md), no search, its cores off the top (a throttle narrows its
/// instance, not what it takes off the top); the CPUs left of `usable` (a count, and the CPUs
/// of one core) are split into the other online jobs' core budgets ([`online_budgets`]), and each job's layout is its search's
/// within its own budget, so one job's probes never restart another's search. `cuts`:
/// contention's core cuts (a throttled job runs fewer instances).
pub(super) fn online_views(
    searches: &mut Searches,
    jobs: &mut BTreeMap<JobId, StoredJob>,
    (usable, core_width): (u32, u32),
    cuts: &BTreeMap<JobId, u32>,
    now: Instant,
    measure: &Measure<'_>,
) -> Vec<OnlineJobView> {
    let mut views = Vec::new();
    let mut searching = Vec::new();
    let mut left = usable;
    for stored in jobs.values() {
        if stored.job.spec.kind != JobKind::Online {
            continue;
        }
        let id = &stored.job.id;
        if !matches!(stored.job.spec.target, Target::Container(_)) {
            searching.push(id.clone());
            continue;
        }
        let cores = stored.job.spec.cores;
        left = left.saturating_sub(cores);
        let cores = cuts.get(id).map_or(cores, |&cut| cores.min(cut.max(1)));
        views.push(OnlineJobView {
            id: id.clone(),
            layout: LayoutConfig {
                cores_per_instance: cores,
                instances: 1,
                batch: 1,
            },
        });
    }
    for (id, budget) in online_budgets(left, core_width, &searching) {
        let Some(stored) = jobs.get_mut(&id) else {
            continue;
        };
        stored.job.core_budget = Some(budget);
        let Some(mut layout) = searches.online_layout(stored, &id, budget, now, measure) else {
            continue;
        };
        if let Some(&cores) = cuts.get(&id) {
            let per = layout.cores_per_instance.max(1);
            layout.instances = layout.instances.min((cores / per).max(1));
        }
        views.push(OnlineJobView { id, layout });
    }
    views
}

impl Searches {
    pub(super) fn new(probe_window: Duration) -> Self {
        Self {
            runs: BTreeMap::new(),
            probe_window,
        }
    }

    /// The search under way for a job, if any.
    pub(super) fn get(&self, id: &JobId) -> Option<&SearchRun> {
        self.runs.get(id)
    }

    /// Forgets a job's search.
    pub(super) fn remove(&mut self, id: &JobId) {
        self.runs.remove(id);
    }

    /// The layout an online job runs now within its core `budget`: a probe of its search, the
    /// search's outcome for this budget, or a cached one (Cloud Reamer §III-B).
    fn online_layout(
        &mut self,
        stored: &mut StoredJob,
        id: &JobId,
        budget: u32,
        now: Instant,
        measure: &Measure<'_>,
    ) -> Option<LayoutConfig> {
        // A search a previous lodgerd had under way resumes at the probe it ran (its instances
        // were adopted): nothing restarts because lodgerd did.
        if !self.runs.contains_key(id) {
            if let Some(kept) = stored.lodging.search.take() {
                if kept.free_cores == budget {
                    info!(job = %id, probe = %kept.probe, "layout search resumed");
                    self.runs.insert(
                        id.clone(),
                        SearchRun {
                            search: kept.search,
                            probe: kept.probe,
                            since: now,
                            budget,
                        },
                    );
                }
            }
        }
        let layout = self.layout_now(stored, id, budget, now, measure);
        // What a restart needs of the search under way (persisted with the plan it changes).
        stored.lodging.search = self.runs.get(id).map(|run| SearchUnderWay {
            search: run.search.clone(),
            probe: run.probe,
            free_cores: run.budget,
        });
        layout
    }

    fn layout_now(
        &mut self,
        stored: &mut StoredJob,
        id: &JobId,
        budget: u32,
        now: Instant,
        measure: &Measure<'_>,
    ) -> Option<LayoutConfig> {
        let inf = stored.job.spec.inference.as_ref()?;
        let slo = inf.slo_ms.unwrap_or(f64::MAX);
        let max_batch = inf.max_batch;
        let max_instances = inf.max_instances.unwrap_or(budget.max(1));
        if let Some(run) = self.runs.get_mut(id) {
            if run.budget == budget {
                let age = now.saturating_duration_since(run.since);
                let measured = measure(id, run.probe, age);
                let overdue = age > self.probe_window * 3;
                if measured.is_none() && !overdue {
                    return Some(run.probe);
                }
                match run.search.next(measured) {
                    SearchStep::Probe(cfg) => {
                        debug!(job = %id, probe = %cfg, probes = run.search.probes_used(), "layout probe");
                        run.probe = cfg;
                        run.since = now;
                        return Some(cfg);
                    }
                    SearchStep::Done(outcome) => {
                        info!(
                            job = %id,
                            layout = %outcome.config,
                            probes = outcome.probes,
                            meets_slo = outcome.meets_slo,
                            "layout search done"
                        );
                        self.runs.remove(id);
                        stored.lodging.cache.insert(outcome.clone());
                        let cfg = outcome.config;
                        stored.lodging.outcome = Some(outcome);
                        return Some(cfg);
                    }
                }
            }
            // The job's budget changed under the search: start again for the new count.
            self.runs.remove(id);
        }
        if let Some(o) = &stored.lodging.outcome {
            if o.free_cores == budget {
                return Some(o.config);
            }
        }
        match stored
            .lodging
            .cache
            .begin(budget, slo, max_batch, max_instances)
        {
            SearchStart::Cached(outcome) => {
                let cfg = outcome.config;
                stored.lodging.outcome = Some(outcome);
                Some(cfg)
            }
            SearchStart::Search(mut search) => match search.next(None) {
                SearchStep::Probe(cfg) => {
                    info!(job = %id, budget, "searching for the best layout");
                    self.runs.insert(
                        id.clone(),
                        SearchRun {
                            search,
                            probe: cfg,
                            since: now,
                            budget,
                        },
                    );
                    Some(cfg)
                }
                SearchStep::Done(outcome) => {
                    let cfg = outcome.config;
                    stored.lodging.outcome = Some(outcome);
                    Some(cfg)
                }
            },
        }
    }
}

/// The measurement of one layout probe of an online job: throughput summed over its instances,
/// the p99 and median of every instance's batches pooled (`Instances::pooled_latency`, asked
/// only once the probe is ready: the latency the job's requests see, from all the batches the
/// window holds), IPC and cache misses
/// from the sensor. `None` until every instance of the probed layout has run for most of a
/// window, and until the probe has been in force for a whole window (`age`), so that the
/// window holds nothing measured under the layout before it ([`probe_ready`]).
///
/// Pooled, not the worst instance's own p99: with many instances each holding a few dozen
/// batches, the worst of their p99s is near the largest of all the batches, well above the
/// requests' p99, and it held the search off the many-instance layouts (docs/benchmarks.md,
/// session 23).
fn probe_result(
    id: &JobId,
    probe: LayoutConfig,
    stats: &[InstanceStats],
    runner: &Instances,
    sensed: Option<&crate::sense::JobMetrics>,
    window: Duration,
    age: Duration,
) -> Option<ProbeResult> {
    let mine: Vec<&InstanceStats> = stats.iter().filter(|s| s.job == *id).collect();
    if !probe_ready(probe, &mine, age, window) {
        return None;
    }
    let pooled = runner.pooled_latency(id)?;
    Some(ProbeResult {
        config: probe,
        throughput_per_s: mine.iter().map(|s| s.items_per_s).sum(),
        p99_latency_ms: pooled.p99_ms,
        ipc: sensed.and_then(|m| m.ipc),
        cache_miss_ratio: sensed.and_then(|m| m.cache_miss_percent).map(|p| p / 100.0),
        latency_samples: u32::try_from(pooled.batches).unwrap_or(u32::MAX),
        p50_latency_ms: Some(pooled.p50_ms),
    })
}

/// Whether `mine` (the job's instances) measure `probe`, which has been in force for `age`:
/// exactly its instances, each running its threads and batch for most of a window, and the
/// probe for a whole window. The last matters when a probe runs fewer instances of the same
/// size and batch: the instances it keeps run on, their windows filled under the previous
/// layout with more instances beside them, and would be taken as this probe's measurement as
/// soon as the others are gone.
fn probe_ready(
    probe: LayoutConfig,
    mine: &[&InstanceStats],
    age: Duration,
    window: Duration,
) -> bool {
    probe.instances > 0
        && age >= window
        && u32::try_from(mine.len()).unwrap_or(0) == probe.instances
        && mine.iter().all(|s| {
            matches!(s.state, InstanceState::Running)
                && s.threads == probe.cores_per_instance
                && s.batch == probe.batch
                && s.span * 5 >= window * 4
        })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::cpuset::CpuSet;
    use crate::enforce::JobRecord;
    use crate::job::{ContainerJob, InferenceSpec, JobSpec};
    use crate::policy::inference::sim::{self, PerfModel};
    use crate::policy::inference::{place, InferencePlan};
    use crate::store::Lodging;
    use crate::topology::Topology;

    const WINDOW: Duration = Duration::from_secs(10);

    /// An online job `seq` lodger starts (`sim::BALANCED`'s SLO and most batch), or with `container`
    /// cores an online container.
    fn online(seq: u64, container: Option<u32>) -> (JobId, StoredJob) {
        let id = JobId::from_seq(seq);
        let target = match container {
            Some(_) => Target::Container(ContainerJob {
                id: format!("c{seq}"),
                pod: format!("default/p{seq}"),
                sandbox: None,
                name: "server".into(),
                cgroup: format!("/kubepods/p{seq}/c{seq}"),
            }),
            None => Target::Instances,
        };
        let mut spec = JobSpec::new(JobKind::Online, target, container.unwrap_or(0));
        spec.inference = Some(InferenceSpec {
            command: vec!["server".into()],
            slo_ms: Some(sim::BALANCED.slo_ms),
            rate_per_s: None,
            max_batch: sim::BALANCED.max_batch,
            max_instances: None,
            launch: Default::default(),
            memory_max: None,
        });
        let stored = StoredJob {
            job: super::super::registry::new_job(id.clone(), spec, 0),
            record: JobRecord::default(),
            lodging: Lodging::default(),
            tuning: None,
        };
        (id, stored)
    }

    /// What a probe of `layout` measures: a BERT-like model's (`sim::BALANCED`) exact probe.
    fn measured(layout: LayoutConfig) -> ProbeResult {
        let model = PerfModel {
            free: 16,
            ..sim::BALANCED
        };
        model.exact_probe(layout)
    }

    /// Ticks `online_views` over `usable` CPUs, 1 ms apart (well inside a probe window, so nothing
    /// is overdue), until every job `measures` lets measure has settled or `ticks` ran out;
    /// `each` sees every tick's layouts.
    fn run(
        searches: &mut Searches,
        jobs: &mut BTreeMap<JobId, StoredJob>,
        usable: u32,
        measures: impl Fn(&JobId) -> bool,
        ticks: u32,
        mut each: impl FnMut(&Searches, &BTreeMap<JobId, LayoutConfig>),
    ) -> Vec<OnlineJobView> {
        let start = Instant::now();
        let measure =
            |id: &JobId, probe: LayoutConfig, _age: Duration| measures(id).then(|| measured(probe));
        let mut views = Vec::new();
        for tick in 0..ticks {
            let now = start + Duration::from_millis(u64::from(tick));
            views = online_views(searches, jobs, (usable, 1), &BTreeMap::new(), now, &measure);
            let layouts = views.iter().map(|v| (v.id.clone(), v.layout)).collect();
            each(searches, &layouts);
            if jobs
                .keys()
                .filter(|id| measures(id))
                .all(|id| searches.get(id).is_none())
            {
                break;
            }
        }
        views
    }

    /// Review finding (online budgets): each online job searched over the CPUs the earlier
    /// jobs' current layouts left, so every probe of job 1 changed job 2's count, and job 2's
    /// search started over (its instances restarted) at every probe of job 1.
    #[test]
    fn one_online_jobs_probes_do_not_restart_anothers_search() {
        let (a, job_a) = online(1, None);
        let (b, job_b) = online(2, None);
        let mut jobs = BTreeMap::from([(a.clone(), job_a), (b.clone(), job_b)]);
        let mut searches = Searches::new(WINDOW);
        // Job 2's probe is never measured: its search stays at its first probe, unless restarted.
        let mut first: Option<(Instant, LayoutConfig)> = None;
        let mut a_cpus = BTreeSet::new();
        let mut budgets = BTreeSet::new();
        let mut ticks = 0;
        run(
            &mut searches,
            &mut jobs,
            14,
            |id| *id == a,
            100,
            |s, layouts| {
                ticks += 1;
                a_cpus.insert(layouts[&a].cpus());
                let Some(run) = s.get(&b) else {
                    panic!("tick {ticks}: job 2's search was dropped before it measured anything")
                };
                let now = (run.since, run.probe);
                assert_eq!(
                    *first.get_or_insert(now),
                    now,
                    "tick {ticks}: job 2's search restarted"
                );
                budgets.insert(run.budget);
            },
        );
        assert_eq!(budgets, BTreeSet::from([7]));
        // Shown on both (`lodgerctl show`'s "Budget").
        assert_eq!(jobs[&a].job.core_budget, Some(7));
        assert_eq!(jobs[&b].job.core_budget, Some(7));
        assert!(searches.get(&a).is_none(), "job 1's search settled");
        // Job 1's probes did change how many CPUs it held.
        assert!(a_cpus.len() > 1, "{a_cpus:?}");
        assert!(a_cpus.iter().all(|&c| c <= 7), "{a_cpus:?}");
    }

    /// Review finding (online budgets): job 1's layout took every CPU (most instances serve
    /// most), leaving job 2 none for as long as it held. Each now gets half, and both run.
    #[test]
    fn two_online_jobs_both_get_instances() {
        let (a, job_a) = online(1, None);
        let (b, job_b) = online(2, None);
        let mut jobs = BTreeMap::from([(a.clone(), job_a), (b.clone(), job_b)]);
        let mut searches = Searches::new(WINDOW);
        let views = run(&mut searches, &mut jobs, 14, |_| true, 200, |_, _| {});
        assert!(searches.get(&a).is_none() && searches.get(&b).is_none());
        let topo = Topology::synthetic(1, 1, 14, 1, 0);
        let none = CpuSet::new();
        let plan = place(&topo, &none, &none, &views, &[], &InferencePlan::default());
        for id in [&a, &b] {
            let instances = plan.online.get(id).map_or(0, |i| i.len());
            assert!(instances > 0, "{id} runs no instance: {plan:?}");
        }
        for id in [&a, &b] {
            let outcome = jobs[id].lodging.outcome.as_ref().expect("settled");
            assert_eq!(outcome.free_cores, 7, "{id}");
            let cpus: usize = plan.online[id].values().map(|i| i.cpus.len()).sum();
            assert_eq!(u32::try_from(cpus).unwrap(), outcome.config.cpus(), "{id}");
        }
        assert!(plan.shortfall.is_empty(), "{plan:?}");
    }

    /// A job alone searches over every usable CPU as before budgets; an online container's
    /// cores come off the top, whatever its id.
    #[test]
    fn a_lone_online_job_searches_every_cpu_but_a_containers() {
        let (a, job_a) = online(1, None);
        let (c, container) = online(2, Some(4));
        // Settles job 1 over 16 CPUs: its search and outcome at `budget`, every CPU used.
        let settle = |jobs: &mut BTreeMap<JobId, StoredJob>, budget: u32| {
            let mut searches = Searches::new(WINDOW);
            let views = run(
                &mut searches,
                jobs,
                16,
                |id| *id == a,
                200,
                |s, layouts| {
                    if let Some(layout) = layouts.get(&c) {
                        assert_eq!(layout.cpus(), 4);
                    }
                    if let Some(run) = s.get(&a) {
                        assert_eq!(run.budget, budget);
                    }
                },
            );
            let outcome = jobs[&a].lodging.outcome.as_ref();
            assert_eq!(outcome.map(|o| o.free_cores), Some(budget));
            assert_eq!(jobs[&a].job.core_budget, Some(budget));
            assert_eq!(views.iter().map(|v| v.layout.cpus()).sum::<u32>(), 16);
        };
        let mut jobs = BTreeMap::from([(a.clone(), job_a)]);
        settle(&mut jobs, 16);
        // A container of 4 cores registered after it: the job's budget is 12.
        jobs.insert(c.clone(), container);
        settle(&mut jobs, 12);
        // A container has no budget: its size is its own.
        assert_eq!(jobs[&c].job.core_budget, None);
    }

    /// A running instance of job 1 with `threads` threads and batch 8, whose window is full.
    fn inst(index: u32, threads: u32) -> InstanceStats {
        let cpus = (index * threads..(index + 1) * threads).collect();
        InstanceStats {
            uptime: WINDOW * 6,
            span: WINDOW,
            items_per_s: 100.0,
            latency_p50_ms: Some(10.0),
            latency_p99_ms: Some(20.0),
            latency_samples: 50,
            items_total: 5000,
            reports_total: 500,
            ..InstanceStats::running(JobId::from_seq(1), index, cpus, 8)
        }
    }

    fn layout(cores_per_instance: u32, instances: u32) -> LayoutConfig {
        LayoutConfig {
            cores_per_instance,
            instances,
            batch: 8,
        }
    }

    /// Review finding (placement): a probe of fewer instances of the same size and batch kept
    /// the first ones running, their windows full of what they served beside the others, and
    /// was judged on that as soon as the others were reaped, a tick or two into the probe.
    #[test]
    fn a_probe_is_measured_only_once_it_filled_a_window() {
        let stats = [inst(0, 2), inst(1, 2)];
        let mine: Vec<&InstanceStats> = stats.iter().collect();
        // 4 → 2 instances of 2 CPUs: the two kept ones look measured at once.
        let probe = layout(2, 2);
        assert!(!probe_ready(probe, &mine, Duration::from_secs(1), WINDOW));
        assert!(!probe_ready(probe, &mine, WINDOW * 4 / 5, WINDOW));
        assert!(probe_ready(probe, &mine, WINDOW, WINDOW));
        // Other instances than the probe's, or one still young: not yet, however long.
        assert!(!probe_ready(layout(2, 3), &mine, WINDOW * 2, WINDOW));
        assert!(!probe_ready(layout(1, 2), &mine, WINDOW * 2, WINDOW));
        let mut young = [inst(0, 2), inst(1, 2)];
        young[1].span = WINDOW / 2;
        let young: Vec<&InstanceStats> = young.iter().collect();
        assert!(!probe_ready(probe, &young, WINDOW * 2, WINDOW));
        assert!(!probe_ready(layout(2, 0), &[], WINDOW * 2, WINDOW));
    }
}
