//! Inference (Cloud Reamer §III-A/B): places, starts and supervises the online and offline
//! jobs' instances each tick; an online job's layout comes from its search (`layout`). Touches
//! the instance runner (`enforce::instances`) and the jobs lent by the tick.

use std::collections::BTreeMap;
use std::time::Duration;

use tracing::{info, warn};

use super::layout::Searches;
use super::shared_batch;
use super::{Event, TickCx};
use crate::cpuset::CpuSet;
use crate::enforce::instances::{Identity, InstanceSpec, InstanceState, InstanceStats, Instances};
use crate::enforce::network::node::{instances_directory, procs_of, CpuJob};
use crate::job::{InstanceView, JobId, JobKind, JobLatency, JobState, Target};
use crate::policy::contention::Throttles;
use crate::policy::inference::{self, OfflineJobView};
use crate::store::State;

/// The instance runner and the online jobs' layout searches.
pub(super) struct Inference {
    pub(super) runner: Instances,
    /// The online jobs' layout searches under way, and how long a probe is measured.
    pub(super) searches: Searches,
    /// `inference.training_core_batch_ms` (issue 14 item 3); 0: off.
    training_core_batch_ms: u32,
}

impl Inference {
    /// Takes the runner after adopting the instances a previous lodgerd left running that
    /// `state`'s plan still wants (issue 17: a restart restarts no instance) and removing every
    /// other leftover. `probe_window` is how long each layout probe is measured;
    /// `training_core_batch_ms` bounds an offline batch on a training core (0: off).
    pub(super) fn new(
        mut runner: Instances,
        probe_window: Duration,
        training_core_batch_ms: u32,
        state: &State,
    ) -> Self {
        match runner.adopt(&desired_instances(state, &state.inference)) {
            Ok(out) => {
                if !out.adopted.is_empty() {
                    info!(
                        "adopted {} running inference instance(s) from a previous lodgerd",
                        out.adopted.len()
                    );
                }
            }
            Err(e) => warn!("cannot adopt or sweep the instances a previous lodgerd left: {e}"),
        }
        Self {
            runner,
            searches: Searches::new(probe_window),
            training_core_batch_ms,
        }
    }

    /// lodgerd is stopping: the instances run on for the next lodgerd to adopt.
    pub(super) fn leave_running(&mut self) {
        let running = self.runner.leave_running();
        if running > 0 {
            info!("leaving {running} inference instance(s) running for the next lodgerd");
        }
    }

    /// Starts stopping a job's instances (finished by later ticks' `poll`, so an instance that
    /// ignores SIGTERM holds up nothing) and forgets its search.
    pub(super) fn stop_job(&mut self, id: &JobId) {
        for e in self.runner.begin_stop_job(id) {
            warn!(job = %id, "stopping instances: {e}");
        }
        self.searches.remove(id);
    }

    /// The instances' processes by job, for network shaping: an instance and every process it
    /// started.
    pub(super) fn cpu_jobs(&self) -> Vec<CpuJob> {
        let mut cpu_jobs: BTreeMap<JobId, CpuJob> = BTreeMap::new();
        for st in self.runner.stats() {
            let entry = cpu_jobs.entry(st.job.clone()).or_insert_with(|| CpuJob {
                job: st.job.clone(),
                pids: Vec::new(),
                instances: true,
                cgroups: Vec::new(),
            });
            if let Some(cg) = &st.cgroup {
                // An instance and every process it started.
                entry.pids.extend(procs_of(&[self.runner.cgroup_dir(cg)]));
                // Network shaping (v2) matches the directory holding every instance's cgroup.
                entry.cgroups.extend(instances_directory(cg));
            }
            if let Some(name) = &st.unit {
                // A transient unit's cgroup (v2, from the hierarchy's root): network shaping
                // matches the slice that holds them all.
                entry
                    .cgroups
                    .extend(instances_directory(&self.runner.unit_cgroup(name)));
            }
            entry.pids.extend(st.pid);
        }
        for j in cpu_jobs.values_mut() {
            j.pids.sort_unstable();
            j.pids.dedup();
            j.cgroups.sort_unstable();
            j.cgroups.dedup();
        }
        cpu_jobs.into_values().collect()
    }

    /// Places inference instances (Cloud Reamer §III-A/B): online instances on exclusive
    /// leftover cores, each online job's layout within its core budget
    /// (`Inference::online_jobs`: the leftover split between the online jobs), offline ones on
    /// every non-reserved core, training's included, with a smaller batch there once a job's
    /// batches are measured to take long (`shared_batch`).
    /// `throttles` are contention's (a throttled job runs fewer instances). Returns the
    /// instances the plan wants and whether the plan changed: a changed plan is persisted before
    /// [`Inference::apply`] starts anything, so a lodgerd killed meanwhile finds every instance
    /// it started in the plan it reads at its next start, and adopts it.
    pub(super) fn plan(
        &mut self,
        cx: &mut TickCx<'_>,
        throttles: &Throttles,
    ) -> (Vec<InstanceSpec>, bool) {
        let training = inference::training_cpus(&cx.state.plan);
        // What is not lent (reserved, outside node.lendable_cpus, exclusive jobs' cores) is to
        // the placement as reserved CPUs are.
        let closed = cx.closed_to_lodgers();
        let usable = cx
            .topology
            .online()
            .difference(&closed)
            .difference(&training);
        let stats = self.runner.stats();
        let online = self.online_jobs(
            cx,
            u32::try_from(usable.len()).unwrap_or(u32::MAX),
            throttles,
            &stats,
        );
        let ids: Vec<(JobId, Option<u32>)> = cx
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind == JobKind::Offline)
            .map(|s| {
                let container = matches!(s.job.spec.target, Target::Container(_));
                (s.job.id.clone(), container.then_some(s.job.spec.cores))
            })
            .collect();
        let mut offline = Vec::new();
        // An offline job's batch on training cores was decided this tick (persist it).
        let mut decided = false;
        for (id, container) in &ids {
            let throttled = throttles.cores.get(id).copied();
            if let Some(cores) = *container {
                // A container is one instance of the size its pod asks for (docs/kubernetes.md):
                // nothing started; a throttle narrows it.
                let cores = throttled.map_or(cores, |cut| cores.min(cut.max(1)));
                offline.push(OfflineJobView {
                    id: id.clone(),
                    batch: 1,
                    training_batch: None,
                    max_instances: (cores > 0).then_some(cores),
                });
            } else if let Some(stored) = cx.state.jobs.get_mut(id) {
                let Some(inf) = stored.job.spec.inference.as_ref() else {
                    continue;
                };
                // SODA §V-E without MBA: a throttled job runs on fewer cores.
                let max_instances = match (inf.max_instances, throttled) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let batch = inf.max_batch;
                let before = stored.lodging.training_batch.clone();
                let training_batch = shared_batch::training_batch(
                    &mut stored.lodging,
                    id,
                    batch,
                    self.training_core_batch_ms,
                    &stats,
                    &training,
                );
                decided |= stored.lodging.training_batch != before;
                offline.push(OfflineJobView {
                    id: id.clone(),
                    batch,
                    training_batch,
                    max_instances,
                });
            }
        }
        let plan = inference::place(
            cx.topology,
            &closed,
            &training,
            &online,
            &offline,
            &cx.state.inference,
        );
        let desired = desired_instances(cx.state, &plan);
        let changed = plan != cx.state.inference || decided;
        cx.state.inference = plan;
        (desired, changed)
    }

    /// Starts and supervises the instances [`Inference::plan`] asked for, and shows them on
    /// their jobs. Returns whether anything persisted changed.
    pub(super) fn apply(&mut self, cx: &mut TickCx<'_>, desired: &[InstanceSpec]) -> bool {
        let mut dirty = false;
        match self.runner.reconcile(desired) {
            Ok(out) => {
                for key in &out.stopping {
                    info!(instance = %key, "stopping instance: the plan no longer wants it as it runs");
                }
                for e in out.errors {
                    warn!("inference instances: {e}");
                }
            }
            Err(e) => warn!("inference instances not reconciled: {e}"),
        }
        // The runner logs exits and restarts itself.
        let _ = self.runner.poll();
        let stats = self.runner.stats();
        let ids: Vec<JobId> = cx
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind.is_inference())
            // Containers are shown where they are enforced (`agent::batch`).
            .filter(|s| !matches!(s.job.spec.target, Target::Container(_)))
            .map(|s| s.job.id.clone())
            .collect();
        for id in &ids {
            dirty |= self.show(cx, id, &stats);
        }
        dirty
    }

    /// Brings one job's view up to date from its instances: pids, state, layout, online
    /// capacity (Cloud Reamer §III-C). Returns whether what persists across a restart changed.
    fn show(&self, cx: &mut TickCx<'_>, id: &JobId, stats: &[InstanceStats]) -> bool {
        let Some(stored) = cx.state.jobs.get_mut(id) else {
            return false;
        };
        let before = stored.clone();
        let mine: Vec<&InstanceStats> = stats.iter().filter(|s| s.job == *id).collect();
        stored.job.instances = mine
            .iter()
            .map(|s| InstanceView {
                index: s.index,
                pid: s.pid,
                cpus: s.cpus.clone(),
                threads: s.threads,
                batch: s.batch,
                state: s.state.as_str().to_string(),
                restarts: s.restarts,
                oom_kills: s.oom_kills,
                memory_max: s.memory_max,
                items_per_s: s.items_per_s,
                p50_ms: s.latency_p50_ms,
                p99_ms: s.latency_p99_ms,
            })
            .collect();
        // Online jobs only: their SLO is judged by it, and pooling sorts every batch of the
        // window (an offline job's hundreds of instances would pay that each tick for nothing).
        stored.job.latency_ms = (stored.job.spec.kind == JobKind::Online)
            .then(|| self.runner.pooled_latency(id))
            .flatten()
            .map(|p| JobLatency {
                p50: p.p50_ms,
                p99: p.p99_ms,
            });
        stored.job.pids = mine.iter().filter_map(|s| s.pid).collect();
        stored.job.threads = mine.iter().map(|s| s.threads).sum();
        stored.job.cpus = mine.iter().fold(CpuSet::new(), |acc, s| acc.union(&s.cpus));
        let running = mine
            .iter()
            .filter(|s| matches!(s.state, InstanceState::Running | InstanceState::Moving))
            .count();
        stored.job.state = if running > 0 {
            JobState::Running
        } else if mine
            .iter()
            .any(|s| s.last_error.is_some() || s.restarts > 0 || exited_and_waiting(s))
        {
            JobState::Error
        } else {
            JobState::Pending
        };
        stored.job.last_error = mine.iter().find_map(|s| {
            s.last_error.clone().or_else(|| {
                s.last_exit
                    .clone()
                    .filter(|_| s.restarts > 0 || exited_and_waiting(s))
            })
        });
        let searching = self.searches.get(id);
        stored.job.layout = match (searching, &stored.lodging.outcome) {
            (Some(run), _) => Some(format!(
                "searching: probe {} of at most {} ({})",
                run.search.probes_used() + 1,
                inference::DEFAULT_PROBE_BUDGET,
                run.probe
            )),
            (None, Some(o)) => Some(format!(
                "{}{}",
                o.config,
                if o.meets_slo {
                    ""
                } else {
                    " (no layout meets the SLO)"
                }
            )),
            (None, None) if stored.job.spec.kind == JobKind::Offline => Some(format!(
                "{} single-thread instance(s){}",
                mine.len(),
                shared_batch::describe(&stored.lodging, self.training_core_batch_ms)
            )),
            (None, None) => None,
        };
        let rate = stored
            .job
            .spec
            .inference
            .as_ref()
            .and_then(|inf| inf.rate_per_s);
        let outcome = stored.lodging.outcome.as_ref();
        if let Some(check) = capacity_check(rate, outcome, searching.is_some(), &mine) {
            let was = stored.lodging.capacity.map(|c| c.exceeded).unwrap_or(false);
            if check.exceeded && !was {
                warn!(
                    job = %id,
                    demand = check.demand_per_s,
                    capacity = check.capacity_per_s,
                    "online job's demand exceeds what this node serves"
                );
                cx.events.push(Event::CapacityExceeded {
                    id: id.clone(),
                    demand_per_s: check.demand_per_s,
                    capacity_per_s: check.capacity_per_s,
                });
            }
            stored.lodging.capacity = Some(check);
        }
        if stored.job.state != before.job.state {
            cx.events
                .push(Event::JobChanged(id.clone(), stored.job.state));
        }
        // Rates change every tick; persist only what matters across a restart.
        stored.lodging != before.lodging || stored.job.state != before.job.state
    }
}

/// The instances the inference plan asks for, with each job's command.
fn desired_instances(state: &State, plan: &inference::InferencePlan) -> Vec<InstanceSpec> {
    let mut desired = Vec::new();
    let online = plan.online.iter().map(|e| (e, false));
    let offline = plan.offline.iter().map(|e| (e, true));
    for ((id, instances), is_offline) in online.chain(offline) {
        let Some((owner, inf)) = state.jobs.get(id).and_then(|s| {
            s.job
                .spec
                .inference
                .as_ref()
                .map(|inf| (s.job.owner_uid, inf))
        }) else {
            continue;
        };
        for (index, inst) in instances {
            desired.push(InstanceSpec {
                job: id.clone(),
                index: *index,
                argv: inf.command.clone(),
                cpus: inst.cpus.clone(),
                mems: inst.mems.clone(),
                threads: inst.threads,
                batch: inst.batch,
                offline: is_offline,
                identity: Identity {
                    uid: owner,
                    launch: Box::new(inf.launch.clone()),
                },
                memory_max: inf.memory_max,
            });
        }
    }
    desired
}

/// An online job's capacity check (Cloud Reamer §III-C) from `mine`, its instances: its expected
/// `rate` against what `outcome`'s layout was measured to serve, scaled by the instances placed.
/// Placed are those the plan keeps (running, moving, waiting, restarting, backing off), not those
/// leaving it: a stopping instance serves only until SIGTERM ends it, up to `stop_grace` (for good
/// if SIGKILL cannot end it), and counting it made a shortfall's `CapacityExceeded` late or never.
/// None (the last check stands) without a rate or a measured layout, and while a layout search
/// is under way: its probe's instances are not the layout `outcome` measured.
fn capacity_check(
    rate: Option<f64>,
    outcome: Option<&inference::SearchOutcome>,
    searching: bool,
    mine: &[&InstanceStats],
) -> Option<inference::CapacityCheck> {
    let (rate, outcome) = (rate?, outcome?);
    let measured = outcome.measured.as_ref()?;
    if searching {
        return None;
    }
    let leaving = InstanceState::Stopping { restarting: false };
    let placed = mine.iter().filter(|s| s.state != leaving).count();
    Some(inference::check_capacity(
        &outcome.config,
        measured.throughput_per_s,
        u32::try_from(placed).unwrap_or(u32::MAX),
        rate,
        None,
    ))
}

/// An instance that exited on its own (killed by its memory limit, crashed) and waits out its
/// back-off before its first restart: its job says why, not "pending".
fn exited_and_waiting(s: &InstanceStats) -> bool {
    matches!(s.state, InstanceState::BackingOff { .. }) && s.last_exit.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::inference::{LayoutConfig, ProbeResult, SearchOutcome};

    /// A layout of 4 instances measured at 400 requests/s.
    fn outcome() -> SearchOutcome {
        let config = LayoutConfig {
            cores_per_instance: 2,
            instances: 4,
            batch: 8,
        };
        SearchOutcome {
            free_cores: 8,
            slo_ms: 100.0,
            max_batch: 8,
            max_instances: 8,
            config,
            meets_slo: true,
            measured: Some(ProbeResult {
                config,
                throughput_per_s: 400.0,
                p99_latency_ms: 50.0,
                ipc: None,
                cache_miss_ratio: None,
                latency_samples: 100,
                p50_latency_ms: None,
            }),
            probes: 3,
            traits: None,
        }
    }

    /// Instance `index` of job 1 in `state`.
    fn inst(index: u32, state: InstanceState) -> InstanceStats {
        let cpus = (index * 2..index * 2 + 2).collect();
        InstanceStats {
            state,
            ..InstanceStats::running(JobId::from_seq(1), index, cpus, 8)
        }
    }

    /// A re-layout leaves two of the four instances placed (a shortfall): the two it no longer
    /// wants serve only until SIGTERM ends them, and the capacity is already half. Instances
    /// restarting, moving or waiting are placed and count.
    #[test]
    fn capacity_counts_the_placed_instances_not_the_stopping_ones() {
        let check = |states: &[InstanceState], searching: bool| {
            let stats: Vec<InstanceStats> = (0..)
                .zip(states)
                .map(|(i, &state)| inst(i, state))
                .collect();
            let mine: Vec<&InstanceStats> = stats.iter().collect();
            capacity_check(Some(300.0), Some(&outcome()), searching, &mine)
                .map(|c| (c.capacity_per_s, c.exceeded))
        };
        let leaving = InstanceState::Stopping { restarting: false };
        let restarting = InstanceState::Stopping { restarting: true };
        let running = InstanceState::Running;
        assert_eq!(
            check(&[running, running, leaving, leaving], false),
            Some((200.0, true))
        );
        assert_eq!(
            check(
                &[
                    running,
                    restarting,
                    InstanceState::Moving,
                    InstanceState::Waiting
                ],
                false
            ),
            Some((400.0, false))
        );
        // A search under way runs a probe, not the measured layout: no check.
        assert_eq!(check(&[running], true), None);
        assert_eq!(check(&[running; 4], false), Some((400.0, false)));
    }
}
