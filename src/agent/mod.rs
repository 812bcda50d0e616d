//! The agent: the loop and the node's state. It is the only place that calls decide, enforce and
//! store, and the only owner of the jobs; the D-Bus API talks to it through [`AgentHandle`]
//! (a mutating command with a oneshot reply; a read-only call reads the snapshot the loop
//! publishes after every tick and command, `published`, and never waits on the loop) and hears
//! about changes through [`Event`]s.
//!
//! It runs on its own OS thread, not on the tokio runtime: enforcement is blocking I/O and system
//! calls (cgroupfs, /proc, sched_setscheduler), and keeping it off the runtime means a slow cgroupfs
//! never stalls the bus. Commands are handled between ticks, one at a time, so a registration and
//! a sweep can never interleave.
//!
//! A small core (the registry of jobs, the store, the loop: `registry`, `run`) and one controller
//! per concern, each owning its state and stepped once a tick through a `TickCx` that lends it
//! the jobs, the observations, the topology and an event buffer: `training`, `rightsize`,
//! `contention`, `inference` (with `layout`), `network`. What one concern hands another
//! (contention's throttles, the instances' processes) is passed as a value by `run::tick`.
//! May touch everything below it (sense, policy, enforce, store); nothing below imports it.

mod batch;
mod contention;
mod handle;
mod inference;
mod layout;
mod lending;
mod mba;
mod network;
mod published;
mod registry;
mod reload;
mod rightsize;
mod rtguard;
mod run;
mod shared_batch;
mod slurm;
mod training;
mod trust;

#[cfg(test)]
mod batch_tests;
#[cfg(test)]
mod contention_tests;
#[cfg(test)]
mod published_tests;
#[cfg(test)]
mod registry_tests;
#[cfg(test)]
mod restart_tests;
#[cfg(test)]
mod steady_tests;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;
use tracing::{info, warn};

pub use self::contention::MbaTarget;
pub use self::handle::{
    AgentError, AgentHandle, Caller, Event, NetworkReload, NodeStatus, Snapshot,
};
pub use self::training::Enforce;
pub use self::trust::TrustSettings;
pub use crate::sense::link::SensorLink;

use self::batch::Batch;
use self::contention::Contention;
use self::inference::Inference;
use self::lending::Lending;
use self::network::Network;
use self::published::Published;
use self::rightsize::Rightsize;
use self::rtguard::RtGuard;
use self::slurm::SlurmSeen;
use self::training::Training;
use crate::cpuset::CpuSet;
use crate::enforce::instances::Instances;
use crate::enforce::network::node::NetworkControl;
use crate::job::{Job, JobId, Target};
use crate::policy::contention::{ContentionConfig, HeldContention};
use crate::policy::{Plan, TrainingJobView};
use crate::sense::{Observations, SensedJob};
use crate::store::{Loaded, State, Store, StoreError, StoredJob, STATE_VERSION};
use crate::topology::Topology;

/// The agent's own settings, taken from the config by lodgerd.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    pub interval: Duration,
    pub rt_priority: i32,
    pub proc_root: PathBuf,
    pub rightsize: RightsizeSettings,
    /// Contention control (SODA §V-E); None: off.
    pub contention: Option<ContentionConfig>,
    /// The RT guard's headroom under the kernel's RT limit, points of a CPU
    /// (`training.rt_headroom_percent`); None: off (training is not SCHED_RR).
    pub rt_headroom_percent: Option<u32>,
    /// Who may register what, and the per-owner caps (`[api]`).
    pub trust: TrustSettings,
    /// How long a Slurm job registered by the prolog may wait for its cgroup
    /// (`slurm.appear_timeout_seconds`).
    pub slurm_appear_timeout: Duration,
    /// The CPUs lodgers may use (`node.lendable_cpus`, resolved); None: every CPU but the
    /// reserved ones.
    pub lendable: Option<CpuSet>,
    /// The longest an offline batch on a training core may take, in ms
    /// (`inference.training_core_batch_ms`, issue 14 item 3); 0: off.
    pub training_core_batch_ms: u32,
}

/// The part of [`AgentSettings`] a reload may change while jobs run (`config::reload`).
#[derive(Debug, Clone)]
pub struct LiveSettings {
    pub interval: Duration,
    pub rightsize: RightsizeSettings,
    pub contention: Option<ContentionConfig>,
    pub rt_headroom_percent: Option<u32>,
    pub trust: TrustSettings,
    /// The sensing thread's new interval and staleness deadline (`sense.interval_ms`,
    /// `sense.deadline_ms`); None: as they are.
    pub sense_pace: Option<(Duration, Duration)>,
}

impl AgentSettings {
    /// What a reload may change of these settings.
    pub fn live(&self) -> LiveSettings {
        LiveSettings {
            interval: self.interval,
            rightsize: self.rightsize.clone(),
            contention: self.contention.clone(),
            rt_headroom_percent: self.rt_headroom_percent,
            trust: self.trust.clone(),
            sense_pace: None,
        }
    }
}

/// Right-sizing of training jobs (SODA §V-B), from `[rightsize]`.
#[derive(Debug, Clone)]
pub struct RightsizeSettings {
    /// None: off. Some(true): resize; Some(false): advise only.
    pub enforce: Option<bool>,
    pub warmup: Duration,
    pub window: Duration,
    pub shrink: bool,
    pub tolerance: u32,
    /// `rightsize.min_change_percent`: see `TunerSettings::min_change`.
    pub min_change: f64,
}

impl Default for RightsizeSettings {
    fn default() -> Self {
        Self {
            enforce: None,
            warmup: Duration::from_secs(180),
            window: Duration::from_secs(60),
            shrink: true,
            tolerance: 1,
            min_change: 0.0,
        }
    }
}

/// What one tick lends each controller: the node, the latest observations, the jobs (with the
/// plans and histories persisted beside them) and a buffer for the events it raises (sent in
/// order once the tick is done).
pub(crate) struct TickCx<'a> {
    pub(crate) topology: &'a Topology,
    pub(crate) reserved: &'a CpuSet,
    pub(crate) proc_root: &'a Path,
    pub(crate) observations: &'a Observations,
    pub(crate) state: &'a mut State,
    pub(crate) events: Vec<Event>,
    /// Slurm jobs' cgroups as this tick found them.
    pub(crate) slurm: &'a SlurmSeen,
    /// `node.lendable_cpus`, resolved (None: all but the reserved).
    pub(crate) lendable: Option<&'a CpuSet>,
}

impl TickCx<'_> {
    /// The CPUs no lodger (inference instance, batch job) may use this tick: the reserved ones,
    /// those outside `node.lendable_cpus`, and the cores of exclusive training jobs as the plan
    /// places them.
    pub(crate) fn closed_to_lodgers(&self) -> CpuSet {
        let mut closed = self.reserved.clone();
        if let Some(lendable) = self.lendable {
            closed = closed.union(&self.topology.online().difference(lendable));
        }
        for (id, p) in &self.state.plan.training {
            if self
                .state
                .jobs
                .get(id)
                .is_some_and(|s| s.job.spec.exclusive)
            {
                closed = closed.union(&p.cpus);
            }
        }
        closed
    }
}

pub struct Agent {
    /// The tick's plan while its training jobs stay the same (`policy::SteadyPlan`).
    steady_plan: crate::policy::SteadyPlan,
    settings: AgentSettings,
    topology: Topology,
    reserved: CpuSet,
    store: Store,
    state: State,
    events: broadcast::Sender<Event>,
    ticks: Arc<AtomicU64>,
    /// The sensor's latest pass, and the channels to it (absent in tests and `--sim` without
    /// sensing).
    observations: Arc<Observations>,
    sensor: Option<SensorLink>,
    // The controllers, in the order a tick steps them (see `run::tick`).
    rightsize: Rightsize,
    /// Contention control (SODA §V-E); absent when off.
    contention: Option<Contention>,
    /// resctrl MBA kept while contention control is off, for a reload that turns it on.
    idle_mba: Option<MbaTarget>,
    /// Keeps SCHED_RR training jobs under the RT limit; absent when training is not RR.
    rt_guard: Option<RtGuard>,
    training: Training,
    /// Batch jobs, with their own enforcer (their class); absent: batch jobs are refused.
    batch: Option<Batch>,
    /// Slurm jobs' cgroups as the last tick found them.
    slurm: SlurmSeen,
    /// Lent CPU time accounting.
    lending: Lending,
    /// Runs inference instances; absent in `--sim` and unit tests (inference jobs are refused).
    inference: Option<Inference>,
    /// Network shaping while multi-node training runs (SODA §V-E); absent when no interface
    /// is configured.
    network: Option<Network>,
    /// What the read-only calls answer from; replaced after every tick and command.
    published: Published<Snapshot>,
    /// lodgerd and its ancestors as last read (`trust::own_ancestry`), which nobody may
    /// register: read again only when it refuses something (see `authorize`).
    ancestry: std::cell::RefCell<Vec<u32>>,
    /// A training job the command under way registered, announced (the sensor told, `JobAdded`
    /// emitted) once its caller is answered: both wake other lodgerd threads, which on its
    /// housekeeping CPU ran before the answer did (issue 21 item 1).
    unannounced: Option<JobId>,
}

/// Everything the agent is wired to, gathered before it starts so it never ticks half-wired.
pub struct AgentBuilder {
    settings: AgentSettings,
    topology: Topology,
    reserved: CpuSet,
    enforcer: Box<dyn Enforce>,
    batch: Option<Box<dyn Enforce>>,
    store: Store,
    runner: Option<(Instances, Duration)>,
    network: Option<NetworkControl>,
    mba: Option<MbaTarget>,
    sensor: Option<SensorLink>,
}

impl AgentBuilder {
    /// The enforcer of batch jobs: placement as training's, their own scheduling class
    /// (`batch.policy`). Without one, batch registrations are refused.
    pub fn batch(mut self, enforcer: Box<dyn Enforce>) -> Self {
        self.batch = Some(enforcer);
        self
    }

    /// The inference instance runner. `probe_window` is how long each layout probe of an online
    /// job is measured. Instances left behind by a previous lodgerd (killed before it could stop
    /// them) are swept at the start.
    pub fn runner(mut self, runner: Instances, probe_window: Duration) -> Self {
        self.runner = Some((runner, probe_window));
        self
    }

    /// Network shaping (SODA §V-E). The first tick applies it if a multi-node training job runs,
    /// and otherwise removes anything a previous lodgerd left.
    pub fn network(mut self, network: NetworkControl) -> Self {
        self.network = Some(network);
        self
    }

    /// resctrl MBA for contention control to throttle with (SODA §V-E: MBA first, core halving
    /// only where MBA is absent).
    pub fn mba(mut self, mba: MbaTarget) -> Self {
        self.mba = Some(mba);
        self
    }

    /// The sensing thread: the agent tells it which jobs to measure and keeps its latest
    /// observations.
    pub fn sensor(mut self, link: SensorLink) -> Self {
        self.sensor = Some(link);
        self
    }

    /// Loads the state file and re-adopts the jobs it lists: a job with a live process is enforced
    /// again, one whose processes died while lodgerd was down is cleaned up and forgotten.
    pub fn start(self) -> Result<Agent, StoreError> {
        let training_core_batch_ms = self.settings.training_core_batch_ms;
        let mut store = self.store;
        store.ensure_dir()?;
        let mut migrated = false;
        let state = match store.load()? {
            Loaded::Fresh(s) => s,
            Loaded::Found(s) => {
                info!(jobs = s.jobs.len(), path = %store.path().display(), "read state");
                s
            }
            Loaded::Migrated { state, from } => {
                info!(
                    jobs = state.jobs.len(),
                    path = %store.path().display(),
                    "read state of version {from}; migrated to version {STATE_VERSION}"
                );
                migrated = true;
                state
            }
            Loaded::SetAside {
                state,
                set_aside,
                reason,
            } => {
                warn!(
                    "state file {} set aside as {}: {reason}; starting with no jobs",
                    store.path().display(),
                    set_aside.display()
                );
                state
            }
        };
        let mut state = state;
        if self.settings.contention.is_none() {
            // Switched off since: nothing is held any more.
            state.contention = HeldContention::default();
        }
        let (events, _) = broadcast::channel(256);
        // With contention control on, it takes up the groups of what it still holds and
        // removes the others' (`Contention::new`).
        let (contention, idle_mba) = match self.settings.contention.clone() {
            Some(c) => (Some(Contention::new(c, self.mba, &state.contention)), None),
            None => {
                if let Some(mba) = &self.mba {
                    mba.remove_stale_groups();
                }
                (None, self.mba)
            }
        };
        let mut agent = Agent {
            steady_plan: crate::policy::SteadyPlan::default(),
            rightsize: Rightsize::new(self.settings.rightsize.clone()),
            contention,
            idle_mba,
            rt_guard: self.settings.rt_headroom_percent.map(RtGuard::new),
            training: Training::new(self.enforcer),
            batch: self.batch.map(Batch::new),
            slurm: SlurmSeen::default(),
            lending: Lending::new(&self.settings.proc_root),
            ancestry: std::cell::RefCell::new(trust::own_ancestry(&self.settings.proc_root)),
            unannounced: None,
            inference: self.runner.map(|(runner, probe_window)| {
                Inference::new(runner, probe_window, training_core_batch_ms, &state)
            }),
            network: self.network.map(Network::new),
            settings: self.settings,
            topology: self.topology,
            reserved: self.reserved,
            store,
            state,
            events,
            ticks: Arc::new(AtomicU64::new(0)),
            observations: Arc::default(),
            sensor: self.sensor,
            published: Published::new(Snapshot {
                jobs: Arc::default(),
                observations: Arc::default(),
                status: NodeStatus::default(),
            }),
        };
        agent.undo_interrupted_registration();
        agent.release_orphans();
        let adopted = agent.state.jobs.len();
        agent.tick();
        if migrated {
            // The file is rewritten in the current version once, now, rather than migrated again
            // at every start until something changes.
            if let Err(e) = agent.store.save(&agent.state) {
                warn!("state file not rewritten in version {STATE_VERSION}: {e}");
            }
        }
        if adopted > 0 {
            info!(
                "re-adopted {} of {} job(s) from the state file",
                agent.state.jobs.len(),
                adopted
            );
        }
        agent.send_jobs_to_sensor();
        Ok(agent)
    }
}

impl Agent {
    /// Gathers what the agent is wired to; [`AgentBuilder::start`] starts it.
    pub fn builder(
        settings: AgentSettings,
        topology: Topology,
        reserved: CpuSet,
        enforcer: Box<dyn Enforce>,
        store: Store,
    ) -> AgentBuilder {
        AgentBuilder {
            settings,
            topology,
            reserved,
            enforcer,
            batch: None,
            store,
            runner: None,
            network: None,
            mba: None,
            sensor: None,
        }
    }

    fn send_jobs_to_sensor(&self) {
        if let Some(link) = &self.sensor {
            let jobs = self
                .state
                .jobs
                .values()
                .map(|s| SensedJob {
                    id: s.job.id.clone(),
                    pids: s.job.pids.clone(),
                    cgroup: match &s.job.spec.target {
                        Target::Cgroup(c) => Some(c.clone()),
                        Target::Container(c) => Some(c.cgroup.clone()),
                        Target::Pids(_) => s.record.pids.as_ref().and_then(|p| p.cgroup.clone()),
                        Target::Slurm(_) => s.record.slurm.as_ref().and_then(|r| r.cgroup.clone()),
                        Target::Instances => None,
                    },
                    gpus: s.job.spec.gpus.clone(),
                })
                .collect();
            let _ = link.jobs.send(jobs);
        }
    }

    /// Keeps the newest of the passes the sensor finished since the last look.
    fn take_observations(&mut self) {
        if let Some(link) = &self.sensor {
            while let Ok(obs) = link.observations.try_recv() {
                self.observations = obs;
            }
        }
    }

    fn find(&self, id: &str) -> Result<&StoredJob, AgentError> {
        JobId::parse(id)
            .and_then(|jid| self.state.jobs.get(&jid))
            .ok_or_else(|| AgentError::NotFound(id.to_string()))
    }

    fn views(&self) -> Vec<TrainingJobView> {
        training::views(&self.state, self.rightsize.enforce(), &self.slurm)
    }

    /// Announces the training job the last command registered, if any (see `unannounced`).
    fn announce(&mut self) {
        if let Some(id) = self.unannounced.take() {
            self.send_jobs_to_sensor();
            self.emit(Event::JobAdded(id));
        }
    }

    fn emit(&self, event: Event) {
        // No receiver (no D-Bus yet, or tests) is fine.
        let _ = self.events.send(event);
    }

    /// The jobs, for tests and the simulator.
    pub fn jobs(&self) -> BTreeMap<JobId, Job> {
        self.state
            .jobs
            .iter()
            .map(|(k, v)| (k.clone(), v.job.clone()))
            .collect()
    }

    pub fn plan(&self) -> &Plan {
        &self.state.plan
    }
}
