//! The agent: the loop and the node's state. It is the only place that calls decide, enforce and
//! store, and the only owner of the jobs; the D-Bus API talks to it through [`AgentHandle`]
//! (a command with a oneshot reply) and hears about changes through [`Event`]s.
//!
//! It runs on its own OS thread, not on the tokio runtime: enforcement is blocking I/O and system
//! calls (cgroupfs, /proc, sched_setscheduler), and keeping it off the runtime means a slow cgroupfs
//! never stalls the bus. Commands are handled between ticks, one at a time, so a registration and
//! a sweep can never interleave.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::{broadcast, oneshot};
use tracing::{debug, info, warn};

use crate::cpuset::CpuSet;
use crate::enforce::instances::{InstanceSpec, InstanceState, InstanceStats, Instances};
use crate::enforce::network::node::{procs_of, CpuJob, NetworkControl, NetworkEvent, NetworkWant};
use crate::enforce::resctrl::LodgerGroup;
use crate::enforce::{EnforceError, JobRecord, Outcome};
use crate::job::{
    InstanceView, Job, JobId, JobKind, JobSpec, JobState, SpecError, Target, TuningView,
};
use crate::policy::consolidate::NoCapacity;
use crate::policy::contention::{
    ContentionConfig, ContentionEliminator, ContentionObservations, JobObservation, MbaGroup,
    Mechanism, NodeMembw, Role, Throttles,
};
use crate::policy::inference::{
    self, LayoutConfig, LayoutSearch, OfflineJobView, OnlineJobView, ProbeResult, SearchStart,
    SearchStep,
};
use crate::policy::rightsize::{self, CoreLimits, StartHints, Tuner, TunerAction, TunerSettings};
use crate::policy::{self, Placement, Plan, TrainingJobView};
use crate::sense::membw::MbaCaps;
use crate::sense::{Observations, SensedJob};
use crate::store::{Loaded, Lodging, State, Store, StoreError, StoredJob, Tuning};
use crate::topology::Topology;

/// What the agent needs from enforcement. [`crate::enforce::Enforcer`] is the real one;
/// [`crate::enforce::sim::SimulatedEnforcer`] records instead of touching the kernel (`--sim`).
pub trait Enforce: Send {
    /// Makes the job's processes match `placement`; idempotent. Sweeps for new threads.
    fn apply(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError>;
    /// Undoes everything `apply` did for the job, for whatever still exists.
    fn release(
        &mut self,
        id: &JobId,
        target: &Target,
        record: &JobRecord,
    ) -> Result<(), EnforceError>;
    /// One line for status: which cgroup mode and pinning method are in use.
    fn describe(&self) -> String;
    /// Removes what enforcement left that no job needs any more (lodger's empty parent cgroup).
    fn tidy(&mut self) {}
}

impl Enforce for crate::enforce::Enforcer {
    fn apply(
        &mut self,
        id: &JobId,
        target: &Target,
        placement: &Placement,
        record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError> {
        crate::enforce::Enforcer::apply(self, id, target, &placement.cpus, &placement.mems, record)
    }

    fn release(
        &mut self,
        id: &JobId,
        target: &Target,
        record: &JobRecord,
    ) -> Result<(), EnforceError> {
        crate::enforce::Enforcer::release(self, id, target, record)
    }

    fn describe(&self) -> String {
        self.mode().to_string()
    }

    fn tidy(&mut self) {
        crate::enforce::Enforcer::tidy(self)
    }
}

impl Enforce for crate::enforce::sim::SimulatedEnforcer {
    fn apply(
        &mut self,
        _id: &JobId,
        target: &Target,
        _placement: &Placement,
        _record: &mut JobRecord,
    ) -> Result<Outcome, EnforceError> {
        self.observe(target)
    }

    fn release(
        &mut self,
        _id: &JobId,
        _target: &Target,
        _record: &JobRecord,
    ) -> Result<(), EnforceError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "simulated (nothing on the node is changed)".into()
    }
}

/// Why a command was refused. Mapped to D-Bus errors in one place (`api::error`).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    InvalidSpec(String),
    #[error("cannot place the job: {0}")]
    NoCapacity(NoCapacity),
    #[error("no job '{0}'; `lodgerctl list` shows the registered jobs")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Enforce(#[from] EnforceError),
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("lodgerd is shutting down")]
    Stopped,
}

impl From<SpecError> for AgentError {
    fn from(e: SpecError) -> Self {
        AgentError::InvalidSpec(e.to_string())
    }
}

/// A change other parts of lodgerd (the D-Bus signals) want to hear about.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    JobAdded(JobId),
    JobChanged(JobId, JobState),
    JobRemoved(JobId),
    /// An online job's measured demand (or expected rate) passed what its layout serves
    /// (Cloud Reamer §III-C: the cluster scheduler may move it).
    CapacityExceeded {
        id: JobId,
        demand_per_s: f64,
        capacity_per_s: f64,
    },
    /// A contention throttle step or release (SODA §V-E).
    Throttled {
        id: JobId,
        mechanism: String,
        level: String,
    },
}

/// The node as `lodgerctl status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    pub version: String,
    pub cpus: CpuSet,
    pub reserved: CpuSet,
    pub training: CpuSet,
    pub free: CpuSet,
    pub numa_nodes: u32,
    pub gpus: u32,
    pub smt: bool,
    pub jobs: u32,
    pub enforcement: String,
    pub rt_priority: i32,
    pub interval_ms: u64,
    pub ticks: u64,
    /// Contention throttle steps and releases so far.
    pub throttle_actions: u64,
    /// Contention control in words (off, watching, throttling ...).
    pub contention: String,
    /// Network shaping in words (off, idle, shaping ...).
    pub network: String,
}

/// Everything the read-only views (`lodgerctl top`, Prometheus) show, taken at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub jobs: Vec<Job>,
    pub observations: Observations,
    pub status: NodeStatus,
}

/// The agent's own settings, taken from the config by lodgerd.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    pub interval: Duration,
    pub rt_priority: i32,
    pub proc_root: PathBuf,
    pub rightsize: RightsizeSettings,
    /// Contention control (SODA §V-E); None: off.
    pub contention: Option<ContentionConfig>,
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
}

impl Default for RightsizeSettings {
    fn default() -> Self {
        Self {
            enforce: None,
            warmup: Duration::from_secs(180),
            window: Duration::from_secs(60),
            shrink: true,
            tolerance: 1,
        }
    }
}

enum Command {
    Register {
        spec: JobSpec,
        caller_uid: u32,
        reply: oneshot::Sender<Result<Job, AgentError>>,
    },
    Unregister {
        id: String,
        reply: oneshot::Sender<Result<(), AgentError>>,
    },
    List {
        reply: oneshot::Sender<Vec<Job>>,
    },
    Get {
        id: String,
        reply: oneshot::Sender<Result<Job, AgentError>>,
    },
    Status {
        reply: oneshot::Sender<NodeStatus>,
    },
    Snapshot {
        reply: oneshot::Sender<Snapshot>,
    },
    Stop,
}

/// The API's way in: cheap to clone, safe to use from any task.
#[derive(Clone)]
pub struct AgentHandle {
    tx: mpsc::Sender<Command>,
    events: broadcast::Sender<Event>,
    ticks: Arc<AtomicU64>,
}

impl AgentHandle {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).ok()?;
        rx.await.ok()
    }

    pub async fn register(&self, spec: JobSpec, caller_uid: u32) -> Result<Job, AgentError> {
        self.ask(|reply| Command::Register {
            spec,
            caller_uid,
            reply,
        })
        .await
        .unwrap_or(Err(AgentError::Stopped))
    }

    pub async fn unregister(&self, id: &str) -> Result<(), AgentError> {
        self.ask(|reply| Command::Unregister {
            id: id.to_string(),
            reply,
        })
        .await
        .unwrap_or(Err(AgentError::Stopped))
    }

    pub async fn list(&self) -> Result<Vec<Job>, AgentError> {
        self.ask(|reply| Command::List { reply })
            .await
            .ok_or(AgentError::Stopped)
    }

    pub async fn get(&self, id: &str) -> Result<Job, AgentError> {
        self.ask(|reply| Command::Get {
            id: id.to_string(),
            reply,
        })
        .await
        .unwrap_or(Err(AgentError::Stopped))
    }

    pub async fn status(&self) -> Result<NodeStatus, AgentError> {
        self.ask(|reply| Command::Status { reply })
            .await
            .ok_or(AgentError::Stopped)
    }

    pub async fn snapshot(&self) -> Result<Snapshot, AgentError> {
        self.ask(|reply| Command::Snapshot { reply })
            .await
            .ok_or(AgentError::Stopped)
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Ticks completed so far: a health signal (the watchdog pings only while it advances).
    pub fn ticks(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }

    /// Asks the agent to finish its current work and stop. Jobs stay enforced (training keeps its
    /// cpuset and SCHED_RR while lodgerd is down) and are re-adopted at the next start.
    pub fn stop(&self) {
        let _ = self.tx.send(Command::Stop);
    }
}

pub struct Agent {
    settings: AgentSettings,
    topology: Topology,
    reserved: CpuSet,
    enforcer: Box<dyn Enforce>,
    store: Store,
    state: State,
    events: broadcast::Sender<Event>,
    ticks: Arc<AtomicU64>,
    /// The sensor's latest pass, and the channels to it (absent in tests and `--sim` without
    /// sensing).
    observations: Observations,
    sensor: Option<SensorLink>,
    /// Runs inference instances; absent in `--sim` and unit tests (inference jobs are refused).
    runner: Option<Instances>,
    /// How long one layout probe of an online job is measured.
    probe_window: Duration,
    /// Layout searches under way, by online job.
    searches: BTreeMap<JobId, SearchRun>,
    /// Contention control (SODA §V-E) and the sensing pass it last looked at.
    contention: Option<ContentionEliminator>,
    contention_seen_ms: u64,
    /// Where MBA throttles are applied: resctrl's root and lodger's control group for lodgers.
    mba: Option<MbaTarget>,
    /// Throttle steps taken, for Prometheus.
    throttle_actions: u64,
    /// Network shaping while multi-node training runs (SODA §V-E); absent when no interface
    /// is configured.
    network: Option<NetworkControl>,
}

/// resctrl MBA, when the node has it.
pub struct MbaTarget {
    pub root: PathBuf,
    pub caps: MbaCaps,
    group: Option<LodgerGroup>,
}

impl MbaTarget {
    pub fn new(root: PathBuf, caps: MbaCaps) -> Self {
        Self {
            root,
            caps,
            group: None,
        }
    }
}

/// An online job's layout search between two probes.
struct SearchRun {
    search: LayoutSearch,
    probe: LayoutConfig,
    since: Instant,
    free_cores: u32,
}

/// The agent's ends of the channels to the sensing thread.
pub struct SensorLink {
    /// Passes the sensor finished.
    pub observations: mpsc::Receiver<Observations>,
    /// The jobs to measure, sent whenever they change.
    pub jobs: mpsc::Sender<Vec<SensedJob>>,
}

/// Wall-clock time as a duration since the epoch: the right-sizing tuner's clock, which must
/// survive a lodgerd restart (its state is persisted).
fn wall_clock() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Agent {
    /// Loads the state file and re-adopts the jobs it lists: a job with a live process is enforced
    /// again, one whose processes died while lodgerd was down is cleaned up and forgotten.
    pub fn start(
        settings: AgentSettings,
        topology: Topology,
        reserved: CpuSet,
        enforcer: Box<dyn Enforce>,
        store: Store,
    ) -> Result<Agent, StoreError> {
        store.ensure_dir()?;
        let state = match store.load()? {
            Loaded::Fresh(s) => s,
            Loaded::Found(s) => {
                info!(jobs = s.jobs.len(), path = %store.path().display(), "read state");
                s
            }
            Loaded::SetAside {
                state,
                set_aside,
                reason,
            } => {
                warn!(
                    "state file {} could not be read ({reason}); kept it as {} and started with no jobs",
                    store.path().display(),
                    set_aside.display()
                );
                state
            }
        };
        let (events, _) = broadcast::channel(256);
        let mut agent = Agent {
            settings,
            topology,
            reserved,
            enforcer,
            store,
            state,
            events,
            ticks: Arc::new(AtomicU64::new(0)),
            observations: Observations::default(),
            sensor: None,
            runner: None,
            probe_window: Duration::from_secs(10),
            searches: BTreeMap::new(),
            contention: None,
            contention_seen_ms: 0,
            mba: None,
            throttle_actions: 0,
            network: None,
        };
        agent.contention = agent
            .settings
            .contention
            .clone()
            .map(|c| ContentionEliminator::new(c, None));
        let adopted = agent.state.jobs.len();
        agent.tick();
        if adopted > 0 {
            info!(
                "re-adopted {} of {} job(s) from the state file",
                agent.state.jobs.len(),
                adopted
            );
        }
        Ok(agent)
    }

    /// Gives the agent the inference instance runner. `probe_window` is how long each layout probe
    /// of an online job is measured. Instances left behind by a previous lodgerd (killed before it
    /// could stop them) are swept first.
    pub fn with_runner(mut self, mut runner: Instances, probe_window: Duration) -> Self {
        match runner.sweep_leftovers() {
            Ok(swept) if !swept.killed.is_empty() || !swept.removed_cgroups.is_empty() => info!(
                "removed leftover inference instances: killed {:?}, cgroups {:?}",
                swept.killed, swept.removed_cgroups
            ),
            Ok(_) => {}
            Err(e) => warn!("cannot sweep leftover inference instances: {e}"),
        }
        self.runner = Some(runner);
        self.probe_window = probe_window;
        self.tick();
        self
    }

    /// Gives the agent network shaping (SODA §V-E). The next tick applies it if a multi-node
    /// training job runs, and otherwise removes anything a previous lodgerd left.
    pub fn with_network(mut self, network: NetworkControl) -> Self {
        self.network = Some(network);
        self
    }

    /// Gives contention control resctrl MBA to throttle with (SODA §V-E: MBA first, core halving
    /// only where MBA is absent).
    pub fn with_mba(mut self, mba: MbaTarget) -> Self {
        if let Some(c) = &self.settings.contention {
            self.contention = Some(ContentionEliminator::new(c.clone(), Some(mba.caps.clone())));
        }
        // A group left by an earlier lodgerd holds no throttle any more.
        if let Err(e) = crate::enforce::resctrl::remove_stale_group(
            &mba.root,
            crate::enforce::resctrl::DEFAULT_CONTROL_GROUP,
        ) {
            warn!("cannot remove lodger's stale resctrl group: {e}");
        }
        self.mba = Some(mba);
        self
    }

    /// Connects the sensing thread: the agent tells it which jobs to measure and keeps its latest
    /// observations.
    pub fn with_sensor(mut self, link: SensorLink) -> Self {
        self.sensor = Some(link);
        self.send_jobs_to_sensor();
        self
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
                        Target::Pids(_) => s.record.pids.as_ref().and_then(|p| p.cgroup.clone()),
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

    /// Starts the agent's thread. The handle is how everything else talks to it.
    pub fn spawn(self) -> std::io::Result<(AgentHandle, thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let handle = AgentHandle {
            tx,
            events: self.events.clone(),
            ticks: self.ticks.clone(),
        };
        let join = thread::Builder::new()
            .name("lodger-agent".into())
            .spawn(move || self.run(rx))?;
        Ok((handle, join))
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        let mut next_tick = Instant::now() + self.settings.interval;
        loop {
            let now = Instant::now();
            if now >= next_tick {
                self.tick();
                next_tick = Instant::now() + self.settings.interval;
                continue;
            }
            match rx.recv_timeout(next_tick - now) {
                Ok(Command::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Ok(cmd) => self.handle(cmd),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
        self.shutdown();
        info!(
            "agent stopped; {} job(s) stay enforced",
            self.state.jobs.len()
        );
    }

    /// lodgerd is stopping: training jobs stay enforced (a restart re-adopts them), but what
    /// only lodgerd keeps in step goes: network shaping and lodger's resctrl group. The
    /// instances themselves are stopped when the runner is dropped.
    fn shutdown(&mut self) {
        if let Some(network) = &mut self.network {
            let events = network.shutdown();
            let events = self.network_events(events);
            for e in events {
                self.emit(e);
            }
        }
        if let Some(mba) = &mut self.mba {
            if let Some(group) = mba.group.take() {
                if let Err(e) = group.restore().and_then(|_| group.remove()) {
                    warn!("cannot remove lodger's resctrl group: {e}");
                }
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Register {
                spec,
                caller_uid,
                reply,
            } => {
                let _ = reply.send(self.register(spec, caller_uid));
            }
            Command::Unregister { id, reply } => {
                let _ = reply.send(self.unregister(&id));
            }
            Command::List { reply } => {
                let _ = reply.send(self.state.jobs.values().map(|s| s.job.clone()).collect());
            }
            Command::Get { id, reply } => {
                let _ = reply.send(self.find(&id).map(|s| s.job.clone()));
            }
            Command::Status { reply } => {
                let _ = reply.send(self.status());
            }
            Command::Snapshot { reply } => {
                self.take_observations();
                let _ = reply.send(Snapshot {
                    jobs: self.state.jobs.values().map(|s| s.job.clone()).collect(),
                    observations: self.observations.clone(),
                    status: self.status(),
                });
            }
            Command::Stop => {}
        }
    }

    fn find(&self, id: &str) -> Result<&StoredJob, AgentError> {
        JobId::parse(id)
            .and_then(|jid| self.state.jobs.get(&jid))
            .ok_or_else(|| AgentError::NotFound(id.to_string()))
    }

    fn views(&self) -> Vec<TrainingJobView> {
        self.state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind == JobKind::Training)
            .map(|s| TrainingJobView {
                id: s.job.id.clone(),
                cores: match (&s.tuning, self.settings.rightsize.enforce) {
                    (Some(t), Some(true)) => t.tuner.cores(),
                    _ => s.job.spec.cores,
                },
                gpus: s.job.spec.gpus.clone(),
            })
            .collect()
    }

    fn emit(&self, event: Event) {
        // No receiver (no D-Bus yet, or tests) is fine.
        let _ = self.events.send(event);
    }

    fn status(&self) -> NodeStatus {
        let online = self.topology.online();
        let training: CpuSet = self
            .state
            .plan
            .training
            .values()
            .fold(CpuSet::new(), |acc, p| acc.union(&p.cpus));
        NodeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            free: online.difference(&self.reserved).difference(&training),
            cpus: online,
            reserved: self.reserved.clone(),
            training,
            numa_nodes: u32::try_from(self.topology.numa_nodes.len()).unwrap_or(u32::MAX),
            gpus: u32::try_from(self.topology.gpus.len()).unwrap_or(u32::MAX),
            smt: self.topology.has_smt(),
            jobs: u32::try_from(self.state.jobs.len()).unwrap_or(u32::MAX),
            enforcement: self.enforcer.describe(),
            rt_priority: self.settings.rt_priority,
            interval_ms: u64::try_from(self.settings.interval.as_millis()).unwrap_or(u64::MAX),
            ticks: self.ticks.load(Ordering::Relaxed),
            throttle_actions: self.throttle_actions,
            network: match &self.network {
                None => "off (no [[network.link]] in the config)".into(),
                Some(n) => n.status(),
            },
            contention: match &self.contention {
                None => "off".into(),
                Some(c) => {
                    let t = c.decided();
                    let mode = c.config().mode.as_str();
                    if t == Throttles::default() {
                        format!("{mode}: no throttle")
                    } else {
                        format!(
                            "{mode}: {} MBA group(s), {} job(s) on fewer cores",
                            t.mba.len(),
                            t.cores.len()
                        )
                    }
                }
            },
        }
    }

    /// Checks a spec against the node and the other jobs, without changing anything.
    fn check_spec(&self, spec: &JobSpec) -> Result<(), AgentError> {
        spec.validate()?;
        for &gpu in &spec.gpus {
            if self.topology.gpu(gpu).is_none() {
                let known: CpuSet = self.topology.gpus.iter().map(|g| g.index).collect();
                return Err(AgentError::InvalidSpec(if known.is_empty() {
                    format!(
                        "GPU {gpu} does not exist: lodger sees no NVIDIA GPU on this node; \
                         leave gpus empty or declare the GPUs under [[node.gpu]] in the config"
                    )
                } else {
                    format!("GPU {gpu} does not exist on this node (GPUs: {known})")
                }));
            }
        }
        match &spec.target {
            Target::Pids(pids) => {
                for &pid in pids {
                    if !self.settings.proc_root.join(pid.to_string()).exists() {
                        return Err(AgentError::InvalidSpec(format!(
                            "process {pid} does not exist (has it exited?)"
                        )));
                    }
                    if let Some(other) =
                        self.state.jobs.values().find(|s| s.job.pids.contains(&pid))
                    {
                        return Err(AgentError::Conflict(format!(
                            "process {pid} already belongs to job {}; unregister it first",
                            other.job.id
                        )));
                    }
                }
            }
            Target::Cgroup(path) => {
                if let Some(other) = self
                    .state
                    .jobs
                    .values()
                    .find(|s| s.job.spec.target == Target::Cgroup(path.clone()))
                {
                    return Err(AgentError::Conflict(format!(
                        "cgroup {path} is already registered as job {}; unregister it first",
                        other.job.id
                    )));
                }
            }
            Target::Instances => {}
        }
        Ok(())
    }

    fn register(&mut self, spec: JobSpec, caller_uid: u32) -> Result<Job, AgentError> {
        self.check_spec(&spec)?;
        let id = JobId::from_seq(self.state.next_seq);
        if spec.kind.is_inference() {
            return self.register_inference(id, spec, caller_uid);
        }
        let mut views = self.views();
        views.push(TrainingJobView {
            id: id.clone(),
            cores: spec.cores,
            gpus: spec.gpus.clone(),
        });
        let plan = policy::decide(&self.topology, &self.reserved, &views, &self.state.plan);
        if let Some(no) = plan.unplaced.get(&id) {
            return Err(AgentError::NoCapacity(no.clone()));
        }
        let placement = plan.training.get(&id).cloned().ok_or_else(|| {
            AgentError::InvalidSpec("the policy gave the job no placement".into())
        })?;

        let mut record = JobRecord::default();
        let outcome = match self
            .enforcer
            .apply(&id, &spec.target, &placement, &mut record)
        {
            Ok(o) if o.alive => o,
            Ok(_) => {
                self.release_quietly(&id, &spec.target, &record);
                return Err(AgentError::InvalidSpec(
                    "the job has no running process (did it exit?)".into(),
                ));
            }
            Err(e) => {
                self.release_quietly(&id, &spec.target, &record);
                return Err(e.into());
            }
        };
        let job = Job {
            id: id.clone(),
            owner_uid: caller_uid,
            state: JobState::Running,
            cpus: placement.cpus.clone(),
            mems: placement.mems.clone(),
            pids: outcome.pids.clone(),
            threads: outcome.threads,
            rr_threads: outcome.rr_threads,
            last_error: None,
            registered_at: now_secs(),
            instances: Vec::new(),
            layout: None,
            rightsize: None,
            tuning: Vec::new(),
            throttle: None,
            network: None,
            spec,
        };
        let before = self.state.clone();
        self.state.next_seq += 1;
        self.state.plan = plan;
        self.state.jobs.insert(
            id.clone(),
            StoredJob {
                job: job.clone(),
                record: record.clone(),
                lodging: Lodging::default(),
                tuning: self.new_tuning(&id, &job),
            },
        );
        if let Err(e) = self.store.save(&self.state) {
            // Nothing may change when the registration cannot be remembered.
            self.state = before;
            self.release_quietly(&id, &job.spec.target, &record);
            return Err(e.into());
        }
        info!(job = %id, cpus = %job.cpus, pids = ?job.pids, threads = job.threads, "registered training job");
        self.send_jobs_to_sensor();
        self.emit(Event::JobAdded(id));
        Ok(job)
    }

    fn unregister(&mut self, id: &str) -> Result<(), AgentError> {
        let jid = self.find(id)?.job.id.clone();
        let Some(stored) = self.state.jobs.remove(&jid) else {
            return Err(AgentError::NotFound(id.to_string()));
        };
        if stored.job.spec.kind.is_inference() {
            self.stop_instances(&jid);
        } else {
            self.release_quietly(&jid, &stored.job.spec.target, &stored.record);
        }
        self.state.plan = policy::decide(
            &self.topology,
            &self.reserved,
            &self.views(),
            &self.state.plan,
        );
        self.store.save(&self.state)?;
        if self.state.jobs.is_empty() {
            self.enforcer.tidy();
        }
        info!(job = %jid, cpus = %stored.job.cpus, "unregistered; cores freed");
        self.send_jobs_to_sensor();
        self.emit(Event::JobChanged(jid.clone(), JobState::Exited));
        self.emit(Event::JobRemoved(jid));
        Ok(())
    }

    fn release_quietly(&mut self, id: &JobId, target: &Target, record: &JobRecord) {
        if let Err(e) = self.enforcer.release(id, target, record) {
            warn!(job = %id, "cleanup incomplete: {e}");
        }
    }

    /// One pass of the loop: decide, then make every job match the plan, then persist what
    /// changed.
    pub fn tick(&mut self) {
        let tuned = self.step_tuners();
        self.step_contention();
        let plan = policy::decide(
            &self.topology,
            &self.reserved,
            &self.views(),
            &self.state.plan,
        );
        let mut dirty = tuned || plan != self.state.plan;
        self.state.plan = plan;
        let ids: Vec<JobId> = self.state.jobs.keys().cloned().collect();
        let mut gone = Vec::new();
        let mut changed = Vec::new();
        for id in ids {
            let placement = self.state.plan.training.get(&id).cloned();
            let Some(stored) = self.state.jobs.get_mut(&id) else {
                continue;
            };
            if stored.job.spec.kind.is_inference() {
                continue;
            }
            let before = stored.clone();
            let result = match &placement {
                Some(p) => {
                    stored.job.cpus = p.cpus.clone();
                    stored.job.mems = p.mems.clone();
                    self.enforcer
                        .apply(&id, &stored.job.spec.target, p, &mut stored.record)
                }
                None => {
                    let why = self
                        .state
                        .plan
                        .unplaced
                        .get(&id)
                        .map(|n| n.to_string())
                        .unwrap_or_else(|| "no placement".into());
                    stored.job.state = JobState::Error;
                    stored.job.last_error = Some(format!("cannot place the job: {why}"));
                    Ok(Outcome {
                        alive: true,
                        ..Outcome::default()
                    })
                }
            };
            match result {
                Ok(o) if !o.alive => gone.push((id.clone(), "its last process exited".to_string())),
                Ok(o) => {
                    stored.job.pids = o.pids;
                    stored.job.threads = o.threads;
                    stored.job.rr_threads = o.rr_threads;
                    if placement.is_some() {
                        stored.job.state = JobState::Running;
                        stored.job.last_error = None;
                    }
                    for w in o.warnings {
                        debug!(job = %id, "{w}");
                    }
                }
                Err(e) if e.is_gone() => gone.push((id.clone(), e.to_string())),
                Err(e) => {
                    if stored.job.last_error.as_deref() != Some(&e.to_string()) {
                        warn!(job = %id, "enforcement failed: {e}");
                    }
                    stored.job.state = JobState::Error;
                    stored.job.last_error = Some(e.to_string());
                }
            }
            if *stored != before {
                dirty = true;
                if stored.job.state != before.job.state {
                    changed.push(Event::JobChanged(id.clone(), stored.job.state));
                }
            }
        }
        for event in changed {
            self.emit(event);
        }
        dirty |= self.tick_inference();
        dirty |= self.step_network();
        for (id, why) in gone {
            if let Some(stored) = self.state.jobs.remove(&id) {
                self.release_quietly(&id, &stored.job.spec.target, &stored.record);
                info!(job = %id, cpus = %stored.job.cpus, "job ended ({why}); cores freed");
                self.emit(Event::JobChanged(id.clone(), JobState::Exited));
                self.emit(Event::JobRemoved(id));
                dirty = true;
            }
        }
        self.take_observations();
        if dirty {
            self.send_jobs_to_sensor();
            self.state.plan = policy::decide(
                &self.topology,
                &self.reserved,
                &self.views(),
                &self.state.plan,
            );
            if let Err(e) = self.store.save(&self.state) {
                warn!("{e}");
            }
        }
        self.ticks.fetch_add(1, Ordering::Relaxed);
    }

    /// A tuner for a new training job (SODA §V-B-1 start point), unless right-sizing is off or
    /// the job opted out.
    fn new_tuning(&self, id: &JobId, job: &Job) -> Option<Tuning> {
        let rs = &self.settings.rightsize;
        rs.enforce?;
        if !job.spec.rightsize {
            return None;
        }
        let others: CpuSet = self
            .state
            .plan
            .training
            .iter()
            .filter(|(jid, _)| *jid != id)
            .fold(CpuSet::new(), |acc, (_, p)| acc.union(&p.cpus));
        let could_have = self
            .topology
            .online()
            .difference(&self.reserved)
            .difference(&others)
            .len();
        let gpus = u32::try_from(job.spec.gpus.len()).unwrap_or(u32::MAX);
        let limits = CoreLimits {
            floor: rightsize::default_floor(gpus, job.spec.cores, rs.shrink),
            max: u32::try_from(could_have).unwrap_or(u32::MAX),
        };
        let start = rightsize::start_cores(
            &self.state.owner_history,
            job.owner_uid,
            job.spec.category,
            job.spec.cores,
            gpus,
            StartHints {
                pipelined_loader: job.spec.pipeline,
                ..StartHints::default()
            },
            limits,
        );
        let settings = TunerSettings {
            warmup: rs.warmup,
            window: rs.window,
            tolerance: rs.tolerance,
            ..TunerSettings::new(start, limits)
        };
        Some(Tuning {
            tuner: Tuner::new(settings, wall_clock()),
            last_sample_ms: 0,
            recorded: false,
        })
    }

    /// Feeds each right-sized training job's newest GPU utilization sample to its tuner
    /// (SODA §V-B-2). Returns whether any tuner changed.
    fn step_tuners(&mut self) -> bool {
        self.take_observations();
        let Some(enforce) = self.settings.rightsize.enforce else {
            return false;
        };
        let now = wall_clock();
        let obs = &self.observations;
        // SODA §V-B: never probe while a contention throttle is active on the node.
        let throttled = self
            .contention
            .as_ref()
            .is_some_and(|c| c.decided() != Throttles::default());
        let mut changed = false;
        for stored in self.state.jobs.values_mut() {
            let Some(tuning) = &mut stored.tuning else {
                continue;
            };
            let before = tuning.clone();
            let mut samples = Vec::new();
            if obs.unix_ms > tuning.last_sample_ms {
                if let Some(gpu) = obs.jobs.get(&stored.job.id).and_then(|m| m.gpu_percent) {
                    samples.push(gpu);
                }
                tuning.last_sample_ms = obs.unix_ms;
            }
            if !enforce {
                // Probing needs the job at the probed count: without resizing every window would
                // measure the same count and look like "no change". Advise mode reports the
                // SODA §V-B-1 start point, the one recommendation lodger can make honestly.
                stored.job.rightsize = Some(format!(
                    "advise: start at {} cores (SODA start point; probing needs rightsize.mode = \"enforce\")",
                    tuning.tuner.settings().start
                ));
                continue;
            }
            let action = tuning.tuner.step(now, &samples, throttled);
            if let TunerAction::Settle(n) = action {
                if !tuning.recorded {
                    let gpus = u32::try_from(stored.job.spec.gpus.len()).unwrap_or(u32::MAX);
                    self.state.owner_history.record(
                        stored.job.owner_uid,
                        stored.job.spec.category,
                        n,
                        gpus,
                    );
                    tuning.recorded = true;
                    info!(job = %stored.job.id, cores = n, probes = tuning.tuner.probes(), "right-sizing settled");
                }
            }
            if let TunerAction::Resize(n) = action {
                if Some(n) != before.tuner.settled() {
                    debug!(job = %stored.job.id, cores = n, "right-sizing probe");
                }
            }
            let cores = tuning.tuner.cores();
            stored.job.rightsize = Some(match (tuning.tuner.settled(), action, enforce) {
                (Some(n), _, true) => format!(
                    "settled at {n} cores after {} probes",
                    tuning.tuner.probes()
                ),
                (Some(n), _, false) => format!(
                    "advise: {n} cores (settled after {} probes; not applied)",
                    tuning.tuner.probes()
                ),
                (None, TunerAction::Hold(why), _) if obs.sources.gpu.starts_with("unavailable") => {
                    format!(
                        "not tuned, at {cores} cores: no GPU utilization can be attributed to \
                         this job (GPU sensing {}); {why}",
                        obs.sources.gpu
                    )
                }
                (None, TunerAction::Hold(why), _) => {
                    format!("at {cores} cores, not measuring: {why}")
                }
                (None, _, true) => format!(
                    "tuning: at {cores} cores, {} probes so far",
                    tuning.tuner.probes()
                ),
                (None, _, false) => format!("advise: tuning, would run {cores} cores"),
            });
            stored.job.tuning = tuning
                .tuner
                .history()
                .iter()
                .map(|p| TuningView {
                    cores: p.cores,
                    gpu_percent: p.mean_util,
                    noise: p.noise,
                    decision: p.decision.to_string(),
                })
                .collect();
            changed |= *tuning != before;
        }
        changed
    }

    /// One contention-control step per new sensing pass (SODA §V-E): detection from memory
    /// bandwidth or training progress, throttle steps logged with their evidence and signalled,
    /// MBA applied here (core halving is applied by inference placement).
    fn step_contention(&mut self) {
        let Some(eliminator) = &mut self.contention else {
            return;
        };
        let obs = &self.observations;
        if obs.unix_ms <= self.contention_seen_ms {
            return;
        }
        self.contention_seen_ms = obs.unix_ms;
        let membw = match (obs.node.membw_bytes_per_s, obs.node.membw_fraction_of_peak) {
            (Some(bytes_per_s), Some(fraction_of_peak)) => Some(NodeMembw {
                bytes_per_s,
                fraction_of_peak,
                domain_fractions: BTreeMap::new(),
            }),
            _ => None,
        };
        let jobs = self
            .state
            .jobs
            .values()
            .map(|s| {
                let role = match s.job.spec.kind {
                    JobKind::Training => Role::Training,
                    JobKind::Online => Role::Online,
                    JobKind::Offline => Role::Offline,
                };
                let cores = u32::try_from(s.job.cpus.len()).unwrap_or(u32::MAX);
                let m = obs.jobs.get(&s.job.id);
                let mut o = JobObservation::new(s.job.id.clone(), role, cores);
                o.membw_bytes_per_s = m.and_then(|m| m.membw_bytes_per_s);
                o.progress = m.and_then(|m| m.gpu_percent);
                if role == Role::Online {
                    let slo = s.job.spec.inference.as_ref().and_then(|i| i.slo_ms);
                    o.slo_met = slo.map(|slo| {
                        s.job
                            .instances
                            .iter()
                            .all(|i| i.p99_ms.is_some_and(|p| p <= slo))
                    });
                }
                o
            })
            .collect();
        let actions = eliminator.step(obs.unix_ms, &ContentionObservations { membw, jobs });
        let throttles = eliminator.throttles();
        for a in &actions {
            self.throttle_actions += 1;
            let verb = if a.advisory {
                "would throttle"
            } else {
                "throttle"
            };
            warn!(
                job = %a.job,
                mechanism = %a.mechanism,
                level = a.level,
                "contention: {verb}: {}",
                a.evidence
            );
            if let Some(stored) = self.state.jobs.get_mut(&a.job) {
                stored.job.throttle = match a.mechanism {
                    Mechanism::Release => None,
                    _ => Some(format!(
                        "{}{} (level {}): {}",
                        if a.advisory { "advise: " } else { "" },
                        a.mechanism,
                        a.level,
                        a.evidence
                    )),
                };
            }
        }
        let events: Vec<Event> = actions
            .iter()
            .map(|a| Event::Throttled {
                id: a.job.clone(),
                mechanism: a.mechanism.as_str().to_string(),
                level: a.level.to_string(),
            })
            .collect();
        for e in events {
            self.emit(e);
        }
        self.apply_mba(&throttles);
    }

    /// Network shaping (SODA §V-E): on while a multi-node training job runs, CPU jobs' processes
    /// kept classified. Returns whether a job's view changed.
    fn step_network(&mut self) -> bool {
        let Some(network) = &mut self.network else {
            return false;
        };
        let multi_node: Vec<JobId> = self
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind == JobKind::Training && s.job.spec.multi_node)
            .map(|s| s.job.id.clone())
            .collect();
        let mut cpu_jobs: BTreeMap<JobId, CpuJob> = BTreeMap::new();
        if let Some(runner) = &self.runner {
            for st in runner.stats() {
                let entry = cpu_jobs.entry(st.job.clone()).or_insert_with(|| CpuJob {
                    job: st.job.clone(),
                    pids: Vec::new(),
                    cgroups: Vec::new(),
                });
                if let Some(cg) = &st.cgroup {
                    // An instance and every process it started.
                    entry.pids.extend(procs_of(&[runner.cgroup_dir(cg)]));
                    entry.cgroups.push(cg.clone());
                }
                entry.pids.extend(st.pid);
            }
        }
        for j in cpu_jobs.values_mut() {
            j.pids.sort_unstable();
            j.pids.dedup();
        }
        let want = NetworkWant {
            multi_node,
            cpu_jobs: cpu_jobs.into_values().collect(),
        };
        let events = network.reconcile(&want);
        let mut changed = false;
        for stored in self.state.jobs.values_mut() {
            let multi = stored.job.spec.kind == JobKind::Training && stored.job.spec.multi_node;
            let text = network.job_text(&stored.job.id, multi);
            if stored.job.network != text {
                stored.job.network = text;
                changed = true;
            }
        }
        let events = self.network_events(events);
        for e in events {
            self.emit(e);
        }
        changed
    }

    /// `Throttled` signals (and the Prometheus count) for network shaping steps.
    fn network_events(&mut self, events: Vec<NetworkEvent>) -> Vec<Event> {
        let level = self
            .network
            .as_ref()
            .map(|n| n.held_level())
            .unwrap_or_default();
        events
            .into_iter()
            .map(|e| {
                self.throttle_actions += 1;
                match e {
                    NetworkEvent::Held(id) => {
                        info!(job = %id, "network: CPU job held ({level}) while multi-node training runs");
                        Event::Throttled {
                            id,
                            mechanism: "tc".into(),
                            level: level.clone(),
                        }
                    }
                    NetworkEvent::Released(id) => {
                        info!(job = %id, "network: CPU job released");
                        Event::Throttled {
                            id,
                            mechanism: "release".into(),
                            level: "tc".into(),
                        }
                    }
                }
            })
            .collect()
    }

    /// Makes lodger's resctrl group hold the offline jobs' instances at the decided MB values, or
    /// removes it when no MBA throttle is in force.
    fn apply_mba(&mut self, throttles: &Throttles) {
        let Some(mba) = &mut self.mba else {
            return;
        };
        match throttles.mba.get(&MbaGroup::Lodgers) {
            Some(values) => {
                if mba.group.is_none() {
                    match LodgerGroup::create(
                        &mba.root,
                        crate::enforce::resctrl::DEFAULT_CONTROL_GROUP,
                        mba.caps.clone(),
                    ) {
                        Ok((g, _)) => mba.group = Some(g),
                        Err(e) => {
                            warn!("contention: cannot create lodger's resctrl group: {e}");
                            return;
                        }
                    }
                }
                let Some(group) = &mba.group else { return };
                if let Err(e) = group.set_mb(values) {
                    warn!("contention: cannot write the MB schemata: {e}");
                }
                let pids: Vec<u32> = self
                    .state
                    .jobs
                    .values()
                    .filter(|s| s.job.spec.kind == JobKind::Offline)
                    .flat_map(|s| s.job.pids.iter().copied())
                    .collect();
                if let Err(e) = group.move_processes(&self.settings.proc_root, &pids) {
                    warn!("contention: cannot move lodgers into the resctrl group: {e}");
                }
            }
            None => {
                if let Some(group) = mba.group.take() {
                    if let Err(e) = group.restore().and_then(|_| group.remove()) {
                        warn!("contention: cannot remove lodger's resctrl group: {e}");
                    }
                }
            }
        }
    }

    fn register_inference(
        &mut self,
        id: JobId,
        spec: JobSpec,
        caller_uid: u32,
    ) -> Result<Job, AgentError> {
        if self.runner.is_none() {
            return Err(AgentError::InvalidSpec(
                "this lodgerd runs no inference instances (simulated enforcement, or the instance \
                 runner could not start: see its log)"
                    .into(),
            ));
        }
        let command = spec
            .inference
            .as_ref()
            .map(|i| i.command.clone())
            .unwrap_or_default();
        crate::enforce::instances::validate_template(&id, &command)
            .map_err(|e| AgentError::InvalidSpec(e.to_string()))?;
        let job = Job {
            id: id.clone(),
            owner_uid: caller_uid,
            state: JobState::Pending,
            cpus: CpuSet::new(),
            mems: CpuSet::new(),
            pids: Vec::new(),
            threads: 0,
            rr_threads: 0,
            last_error: None,
            registered_at: now_secs(),
            instances: Vec::new(),
            layout: None,
            rightsize: None,
            tuning: Vec::new(),
            throttle: None,
            network: None,
            spec,
        };
        let before = self.state.clone();
        self.state.next_seq += 1;
        self.state.jobs.insert(
            id.clone(),
            StoredJob {
                job: job.clone(),
                record: JobRecord::default(),
                lodging: Lodging::default(),
                tuning: None,
            },
        );
        if let Err(e) = self.store.save(&self.state) {
            self.state = before;
            return Err(e.into());
        }
        info!(job = %id, kind = job.spec.kind.as_str(), "registered inference job");
        self.emit(Event::JobAdded(id.clone()));
        // Place and start its instances now rather than at the next tick.
        self.tick();
        Ok(self
            .state
            .jobs
            .get(&id)
            .map(|s| s.job.clone())
            .unwrap_or(job))
    }

    fn stop_instances(&mut self, id: &JobId) {
        if let Some(runner) = &mut self.runner {
            let out = runner.stop_job(id);
            for e in out.errors {
                warn!(job = %id, "stopping instances: {e}");
            }
        }
        self.searches.remove(id);
        self.state.inference.online.remove(id);
        self.state.inference.offline.remove(id);
    }

    /// The layout an online job runs now: a probe of its search, the search's outcome for this
    /// many free cores, or a cached one (Cloud Reamer §III-B).
    fn online_layout(
        &mut self,
        id: &JobId,
        free_cores: u32,
        stats: &[InstanceStats],
    ) -> Option<LayoutConfig> {
        let stored = self.state.jobs.get_mut(id)?;
        let inf = stored.job.spec.inference.as_ref()?;
        let slo = inf.slo_ms.unwrap_or(f64::MAX);
        let max_batch = inf.max_batch;
        let max_instances = inf.max_instances.unwrap_or(free_cores.max(1));
        let now = Instant::now();
        if let Some(run) = self.searches.get_mut(id) {
            if run.free_cores == free_cores {
                let measured = probe_result(
                    id,
                    run.probe,
                    stats,
                    self.observations.jobs.get(id),
                    self.probe_window,
                );
                let overdue = now.duration_since(run.since) > self.probe_window * 3;
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
                        self.searches.remove(id);
                        stored.lodging.cache.insert(outcome.clone());
                        let cfg = outcome.config;
                        stored.lodging.outcome = Some(outcome);
                        return Some(cfg);
                    }
                }
            }
            // The free cores changed under the search: start again for the new count.
            self.searches.remove(id);
        }
        if let Some(o) = &stored.lodging.outcome {
            if o.free_cores == free_cores {
                return Some(o.config);
            }
        }
        match stored
            .lodging
            .cache
            .begin(free_cores, slo, max_batch, max_instances)
        {
            SearchStart::Cached(outcome) => {
                let cfg = outcome.config;
                stored.lodging.outcome = Some(outcome);
                Some(cfg)
            }
            SearchStart::Search(mut search) => match search.next(None) {
                SearchStep::Probe(cfg) => {
                    info!(job = %id, free_cores, "searching for the best layout");
                    self.searches.insert(
                        id.clone(),
                        SearchRun {
                            search,
                            probe: cfg,
                            since: now,
                            free_cores,
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

    /// Places, starts and supervises inference instances (Cloud Reamer §III-A/B): online
    /// instances on exclusive leftover cores, offline ones on every non-reserved core, training's
    /// included. Returns whether anything persisted changed.
    fn tick_inference(&mut self) -> bool {
        if self.runner.is_none() {
            return false;
        }
        let training = inference::training_cpus(&self.state.plan);
        let usable = self
            .topology
            .online()
            .difference(&self.reserved)
            .difference(&training);
        let stats = self.runner.as_ref().map(|r| r.stats()).unwrap_or_default();
        let ids: Vec<(JobId, JobKind)> = self
            .state
            .jobs
            .values()
            .filter(|s| s.job.spec.kind.is_inference())
            .map(|s| (s.job.id.clone(), s.job.spec.kind))
            .collect();
        let mut online = Vec::new();
        let mut offline = Vec::new();
        let mut free = u32::try_from(usable.len()).unwrap_or(u32::MAX);
        for (id, kind) in &ids {
            if *kind == JobKind::Online {
                if let Some(mut layout) = self.online_layout(id, free, &stats) {
                    if let Some(cores) = self
                        .contention
                        .as_ref()
                        .and_then(|c| c.throttles().cores.get(id).copied())
                    {
                        let per = layout.cores_per_instance.max(1);
                        layout.instances = layout.instances.min((cores / per).max(1));
                    }
                    free = free.saturating_sub(layout.cpus());
                    online.push(OnlineJobView {
                        id: id.clone(),
                        layout,
                    });
                }
            } else if let Some(inf) = self
                .state
                .jobs
                .get(id)
                .and_then(|s| s.job.spec.inference.as_ref())
            {
                // SODA §V-E without MBA: a throttled job runs on fewer cores.
                let throttled = self
                    .contention
                    .as_ref()
                    .and_then(|c| c.throttles().cores.get(id).copied());
                let max_instances = match (inf.max_instances, throttled) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                offline.push(OfflineJobView {
                    id: id.clone(),
                    batch: inf.max_batch,
                    max_instances,
                });
            }
        }
        let plan = inference::place(
            &self.topology,
            &self.reserved,
            &training,
            &online,
            &offline,
            &self.state.inference,
        );
        let mut desired = Vec::new();
        for (id, instances) in plan.online.iter().chain(plan.offline.iter()) {
            let Some(inf) = self
                .state
                .jobs
                .get(id)
                .and_then(|s| s.job.spec.inference.as_ref())
            else {
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
                });
            }
        }
        let mut dirty = plan != self.state.inference;
        self.state.inference = plan;
        let Some(runner) = self.runner.as_mut() else {
            return dirty;
        };
        match runner.reconcile(&desired) {
            Ok(out) => {
                for e in out.errors {
                    warn!("inference instances: {e}");
                }
            }
            Err(e) => warn!("inference instances not reconciled: {e}"),
        }
        // The runner logs exits and restarts itself.
        let _ = runner.poll();
        let stats = runner.stats();

        // Per job: its instances, pids and state; online capacity.
        let mut events = Vec::new();
        for (id, _) in &ids {
            let Some(stored) = self.state.jobs.get_mut(id) else {
                continue;
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
                    items_per_s: s.items_per_s,
                    p50_ms: s.latency_p50_ms,
                    p99_ms: s.latency_p99_ms,
                })
                .collect();
            stored.job.pids = mine.iter().filter_map(|s| s.pid).collect();
            stored.job.threads = mine.iter().map(|s| s.threads).sum();
            stored.job.cpus = mine.iter().fold(CpuSet::new(), |acc, s| acc.union(&s.cpus));
            let running = mine
                .iter()
                .filter(|s| matches!(s.state, InstanceState::Running))
                .count();
            stored.job.state = if running > 0 {
                JobState::Running
            } else if mine
                .iter()
                .any(|s| s.last_error.is_some() || s.restarts > 0)
            {
                JobState::Error
            } else {
                JobState::Pending
            };
            stored.job.last_error = mine.iter().find_map(|s| {
                s.last_error
                    .clone()
                    .or_else(|| s.last_exit.clone().filter(|_| s.restarts > 0))
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
                (None, None) if stored.job.spec.kind == JobKind::Offline => {
                    Some(format!("{} single-thread instance(s)", mine.len()))
                }
                (None, None) => None,
            };
            if let (Some(inf), Some(outcome)) =
                (&stored.job.spec.inference, &stored.lodging.outcome)
            {
                if let (Some(rate), Some(measured)) = (inf.rate_per_s, &outcome.measured) {
                    let check = inference::check_capacity(
                        &outcome.config,
                        measured.throughput_per_s,
                        u32::try_from(mine.len()).unwrap_or(u32::MAX),
                        rate,
                        None,
                    );
                    let was = stored.lodging.capacity.map(|c| c.exceeded).unwrap_or(false);
                    if check.exceeded && !was {
                        warn!(
                            job = %id,
                            demand = check.demand_per_s,
                            capacity = check.capacity_per_s,
                            "online job's demand exceeds what this node serves"
                        );
                        events.push(Event::CapacityExceeded {
                            id: id.clone(),
                            demand_per_s: check.demand_per_s,
                            capacity_per_s: check.capacity_per_s,
                        });
                    }
                    stored.lodging.capacity = Some(check);
                }
            }
            if stored.job.state != before.job.state {
                events.push(Event::JobChanged(id.clone(), stored.job.state));
            }
            // Rates change every tick; persist only what matters across a restart.
            if stored.lodging != before.lodging || stored.job.state != before.job.state {
                dirty = true;
            }
        }
        for e in events {
            self.emit(e);
        }
        dirty
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

/// The measurement of one layout probe of an online job: throughput summed over its instances,
/// the worst instance's p99, IPC and cache misses from the sensor. `None` until every instance of
/// the probed layout has run for most of a window.
fn probe_result(
    id: &JobId,
    probe: LayoutConfig,
    stats: &[InstanceStats],
    sensed: Option<&crate::sense::JobMetrics>,
    window: Duration,
) -> Option<ProbeResult> {
    let mine: Vec<&InstanceStats> = stats.iter().filter(|s| s.job == *id).collect();
    let ready = u32::try_from(mine.len()).unwrap_or(0) == probe.instances
        && mine.iter().all(|s| {
            matches!(s.state, InstanceState::Running)
                && s.threads == probe.cores_per_instance
                && s.batch == probe.batch
                && s.span * 5 >= window * 4
        });
    if !ready || probe.instances == 0 {
        return None;
    }
    let p99 = mine
        .iter()
        .map(|s| s.latency_p99_ms)
        .try_fold(0.0f64, |acc, p| p.map(|p| acc.max(p)))?;
    Some(ProbeResult {
        config: probe,
        throughput_per_s: mine.iter().map(|s| s.items_per_s).sum(),
        p99_latency_ms: p99,
        ipc: sensed.and_then(|m| m.ipc),
        cache_miss_ratio: sensed.and_then(|m| m.cache_miss_percent).map(|p| p / 100.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{Category, JobKind};
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    /// What the fake node looks like: which pids live, and what was applied/released.
    #[derive(Default)]
    struct FakeNode {
        alive: BTreeSet<u32>,
        applied: BTreeMap<JobId, CpuSet>,
        released: Vec<JobId>,
        fail_next_apply: Option<EnforceError>,
    }

    struct FakeEnforcer(Arc<Mutex<FakeNode>>);

    impl Enforce for FakeEnforcer {
        fn apply(
            &mut self,
            id: &JobId,
            target: &Target,
            placement: &Placement,
            _record: &mut JobRecord,
        ) -> Result<Outcome, EnforceError> {
            let mut node = self.0.lock().unwrap();
            if let Some(e) = node.fail_next_apply.take() {
                return Err(e);
            }
            let pids: Vec<u32> = match target {
                Target::Pids(p) => p
                    .iter()
                    .copied()
                    .filter(|p| node.alive.contains(p))
                    .collect(),
                Target::Cgroup(_) | Target::Instances => vec![1],
            };
            node.applied.insert(id.clone(), placement.cpus.clone());
            Ok(Outcome {
                alive: !pids.is_empty(),
                threads: u32::try_from(pids.len()).unwrap(),
                rr_threads: u32::try_from(pids.len()).unwrap(),
                pids,
                ..Outcome::default()
            })
        }

        fn release(
            &mut self,
            id: &JobId,
            _target: &Target,
            _record: &JobRecord,
        ) -> Result<(), EnforceError> {
            let mut node = self.0.lock().unwrap();
            node.applied.remove(id);
            node.released.push(id.clone());
            Ok(())
        }

        fn describe(&self) -> String {
            "fake".into()
        }
    }

    fn spec(pids: Vec<u32>, cores: u32) -> JobSpec {
        JobSpec {
            kind: JobKind::Training,
            name: None,
            target: Target::Pids(pids),
            gpus: vec![],
            cores,
            category: Category::Other,
            pipeline: false,
            multi_node: false,
            inference: None,
            rightsize: true,
        }
    }

    struct Rig {
        node: Arc<Mutex<FakeNode>>,
        dir: tempfile::TempDir,
        proc_root: tempfile::TempDir,
    }

    impl Rig {
        fn new() -> Rig {
            Rig {
                node: Arc::new(Mutex::new(FakeNode::default())),
                dir: tempfile::tempdir().unwrap(),
                proc_root: tempfile::tempdir().unwrap(),
            }
        }

        fn spawn(&self, pid: u32) {
            std::fs::create_dir_all(self.proc_root.path().join(pid.to_string())).unwrap();
            self.node.lock().unwrap().alive.insert(pid);
        }

        fn kill(&self, pid: u32) {
            std::fs::remove_dir_all(self.proc_root.path().join(pid.to_string())).unwrap();
            self.node.lock().unwrap().alive.remove(&pid);
        }

        fn agent(&self) -> Agent {
            // 2 sockets x 1 node x 4 cores x 2 threads = 16 CPUs; reserve CPU 0 and its sibling 8.
            let topo = Topology::synthetic(2, 1, 4, 2, 0);
            let settings = AgentSettings {
                interval: Duration::from_millis(100),
                rt_priority: 10,
                proc_root: self.proc_root.path().to_path_buf(),
                rightsize: RightsizeSettings::default(),
                contention: Some(ContentionConfig {
                    baseline_ticks: 3,
                    pressure_ticks: 2,
                    ..ContentionConfig::default()
                }),
            };
            Agent::start(
                settings,
                topo,
                CpuSet::parse("0,8").unwrap(),
                Box::new(FakeEnforcer(self.node.clone())),
                Store::new(self.dir.path()),
            )
            .unwrap()
        }
    }

    #[test]
    fn register_places_enforces_and_persists() {
        let rig = Rig::new();
        rig.spawn(100);
        let mut agent = rig.agent();
        let job = agent.register(spec(vec![100], 2), 0).unwrap();
        assert_eq!(job.id.as_str(), "j1");
        assert_eq!(job.cpus.len(), 2);
        assert!(!job.cpus.contains(0) && !job.cpus.contains(8));
        assert_eq!(
            rig.node.lock().unwrap().applied.get(&job.id),
            Some(&job.cpus)
        );
        // A second agent on the same state dir sees the job.
        drop(agent);
        let agent = rig.agent();
        assert_eq!(agent.jobs().len(), 1);
        assert_eq!(agent.jobs()[&job.id].cpus, job.cpus);
    }

    #[test]
    fn refusals_change_nothing() {
        let rig = Rig::new();
        rig.spawn(100);
        let mut agent = rig.agent();
        let err = agent.register(spec(vec![101], 1), 0).unwrap_err();
        assert!(matches!(err, AgentError::InvalidSpec(_)), "{err}");
        let err = agent.register(spec(vec![100], 15), 0).unwrap_err();
        assert!(matches!(err, AgentError::NoCapacity(_)), "{err}");
        assert!(err.to_string().contains("14"), "{err}");
        let mut with_gpu = spec(vec![100], 1);
        with_gpu.gpus = vec![0];
        let err = agent.register(with_gpu, 0).unwrap_err();
        assert!(err.to_string().contains("GPU 0"), "{err}");
        rig.node.lock().unwrap().fail_next_apply = Some(EnforceError::EmptyPlacement);
        let err = agent.register(spec(vec![100], 1), 0).unwrap_err();
        assert!(matches!(err, AgentError::Enforce(_)), "{err}");
        assert!(agent.jobs().is_empty());
        assert!(agent.plan().training.is_empty());
        // The failed registration was undone.
        assert_eq!(rig.node.lock().unwrap().released.len(), 1);
        // And the ids were not consumed.
        assert_eq!(
            agent.register(spec(vec![100], 1), 0).unwrap().id.as_str(),
            "j1"
        );
        let err = agent.register(spec(vec![100], 1), 0).unwrap_err();
        assert!(matches!(err, AgentError::Conflict(_)), "{err}");
    }

    #[test]
    fn exit_and_unregister_free_cores_and_ids_are_not_reused() {
        let rig = Rig::new();
        rig.spawn(100);
        rig.spawn(200);
        let mut agent = rig.agent();
        let a = agent.register(spec(vec![100], 14), 0).unwrap();
        assert!(matches!(
            agent.register(spec(vec![200], 1), 0),
            Err(AgentError::NoCapacity(_))
        ));
        rig.kill(100);
        let mut events = agent.events.subscribe();
        agent.tick();
        assert!(agent.jobs().is_empty());
        assert_eq!(rig.node.lock().unwrap().released, vec![a.id.clone()]);
        assert_eq!(
            events.try_recv().unwrap(),
            Event::JobChanged(a.id.clone(), JobState::Exited)
        );
        assert_eq!(events.try_recv().unwrap(), Event::JobRemoved(a.id.clone()));
        let b = agent.register(spec(vec![200], 14), 0).unwrap();
        assert_eq!(b.id.as_str(), "j2");
        agent.unregister("j2").unwrap();
        assert!(agent.plan().training.is_empty());
        assert!(matches!(
            agent.unregister("j2"),
            Err(AgentError::NotFound(_))
        ));
        assert!(matches!(
            agent.unregister("../x"),
            Err(AgentError::NotFound(_))
        ));
    }

    #[test]
    fn restart_cleans_up_jobs_that_died_while_down() {
        let rig = Rig::new();
        rig.spawn(100);
        rig.spawn(200);
        let mut agent = rig.agent();
        agent.register(spec(vec![100], 2), 0).unwrap();
        let b = agent.register(spec(vec![200], 2), 0).unwrap();
        drop(agent);
        rig.kill(100);
        let agent = rig.agent();
        let jobs = agent.jobs();
        assert_eq!(jobs.keys().cloned().collect::<Vec<_>>(), vec![b.id.clone()]);
        assert_eq!(jobs[&b.id].cpus, b.cpus, "a re-adopted job keeps its CPUs");
        assert_eq!(rig.node.lock().unwrap().released.len(), 1);
    }

    #[test]
    fn ticks_are_idempotent_on_the_plan() {
        let rig = Rig::new();
        rig.spawn(100);
        let mut agent = rig.agent();
        agent.register(spec(vec![100], 3), 0).unwrap();
        let plan = agent.plan().clone();
        let before = std::fs::read(rig.dir.path().join(crate::store::STATE_FILE)).unwrap();
        agent.tick();
        agent.tick();
        assert_eq!(agent.plan(), &plan);
        let after = std::fs::read(rig.dir.path().join(crate::store::STATE_FILE)).unwrap();
        assert_eq!(
            before, after,
            "an idle tick must not rewrite the state file"
        );
    }

    /// SODA §V-E without MBM: a training job's GPU utilization falls below its learnt level while
    /// an offline lodger runs; the lodger's cores are halved, the step is signalled with its
    /// evidence, and right-sizing would hold meanwhile.
    #[test]
    fn contention_halves_an_offline_lodger_when_training_progress_drops() {
        let rig = Rig::new();
        rig.spawn(100);
        let mut agent = rig.agent();
        let train = agent.register(spec(vec![100], 2), 0).unwrap();
        let mut events = agent.events.subscribe();
        let pass = |agent: &mut Agent, ms: u64, gpu: f64| {
            let mut obs = Observations {
                unix_ms: ms,
                ..Observations::default()
            };
            obs.jobs.insert(
                train.id.clone(),
                crate::sense::JobMetrics {
                    gpu_percent: Some(gpu),
                    ..Default::default()
                },
            );
            agent.observations = obs;
            agent.tick();
        };
        // The stable level is learnt while no lodger runs.
        for (i, gpu) in [90.0, 91.0, 89.5, 90.5].into_iter().enumerate() {
            pass(&mut agent, 1000 + i as u64, gpu);
        }
        // An offline lodger on 4 CPUs arrives (inserted directly: no instance runner here).
        let lodger = JobId::from_seq(99);
        let mut job = agent.state.jobs[&train.id].job.clone();
        job.id = lodger.clone();
        job.spec.kind = JobKind::Offline;
        job.spec.target = Target::Instances;
        job.cpus = CpuSet::parse("2-5").unwrap();
        agent.state.jobs.insert(
            lodger.clone(),
            StoredJob {
                job,
                record: JobRecord::default(),
                lodging: Lodging::default(),
                tuning: None,
            },
        );
        // pressure_ticks = 2: halved after two low passes, and again after two more.
        for i in 0..2u64 {
            pass(&mut agent, 2000 + i, 45.0);
        }
        let throttles = agent.contention.as_ref().unwrap().throttles();
        assert_eq!(throttles.cores.get(&lodger), Some(&2), "{throttles:?}");
        for i in 2..4u64 {
            pass(&mut agent, 2000 + i, 45.0);
        }
        let throttles = agent.contention.as_ref().unwrap().throttles();
        assert_eq!(throttles.cores.get(&lodger), Some(&1), "{throttles:?}");
        assert!(
            !throttles.cores.contains_key(&train.id),
            "training is never throttled"
        );
        let text = agent.state.jobs[&lodger].job.throttle.clone().unwrap();
        assert!(text.contains("cores"), "{text}");
        let mut levels = Vec::new();
        while let Ok(e) = events.try_recv() {
            if let Event::Throttled {
                id,
                mechanism,
                level,
            } = e
            {
                assert_eq!(id, lodger);
                assert_eq!(mechanism, "cores");
                levels.push(level);
            }
        }
        assert_eq!(levels, ["1", "2"], "a Throttled event per step");
        assert!(agent
            .status()
            .contention
            .contains("1 job(s) on fewer cores"));
        assert_eq!(agent.status().throttle_actions, 2);
        // Training recovers: after calm passes the steps are given back one at a time.
        for i in 0..40u64 {
            pass(&mut agent, 3000 + i, 90.0);
        }
        let throttles = agent.contention.as_ref().unwrap().throttles();
        assert!(throttles.cores.is_empty(), "{throttles:?}");
    }

    /// SODA §V-E with MBA, through the agent, on a copy of the recorded Intel resctrl tree:
    /// node bandwidth over the threshold lowers lodger's group's MB schemata step by step with
    /// the offline lodger's threads in it, and calm gives the bandwidth back.
    #[test]
    fn contention_throttles_offline_lodgers_with_mba_on_an_intel_tree() {
        use crate::sense::membw::{CpuVendor, MbaCaps};
        let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
        let schemata = resctrl.path().join("lodger-lodgers/schemata");
        let tasks = resctrl.path().join("lodger-lodgers/tasks");
        // The recorded group was left throttled by an earlier run; start from unthrottled.
        std::fs::write(&schemata, "MB:0=100;1=100\n").unwrap();
        std::fs::write(&tasks, "").unwrap();
        let caps = MbaCaps::read(resctrl.path(), &CpuVendor::Intel).unwrap();

        let rig = Rig::new();
        rig.spawn(100);
        // The offline lodger's process, with two threads.
        for tid in [300, 301] {
            std::fs::create_dir_all(rig.proc_root.path().join(format!("300/task/{tid}"))).unwrap();
        }
        let mut agent = rig
            .agent()
            .with_mba(MbaTarget::new(resctrl.path().to_path_buf(), caps));
        let train = agent.register(spec(vec![100], 2), 0).unwrap();
        let lodger = JobId::from_seq(99);
        let mut job = agent.state.jobs[&train.id].job.clone();
        job.id = lodger.clone();
        job.spec.kind = JobKind::Offline;
        job.spec.target = Target::Instances;
        job.pids = vec![300];
        agent.state.jobs.insert(
            lodger.clone(),
            StoredJob {
                job,
                record: JobRecord::default(),
                lodging: Lodging::default(),
                tuning: None,
            },
        );
        let mut events = agent.events.subscribe();
        let pass = |agent: &mut Agent, ms: u64, fraction: f64| {
            let mut obs = Observations {
                unix_ms: ms,
                ..Observations::default()
            };
            obs.node.membw_bytes_per_s = Some(fraction * 100e9);
            obs.node.membw_fraction_of_peak = Some(fraction);
            agent.observations = obs;
            agent.tick();
        };
        let mb = || std::fs::read_to_string(&schemata).unwrap();
        pass(&mut agent, 1000, 0.5);
        assert_eq!(mb(), "MB:0=100;1=100\n", "no pressure, no throttle");
        // Two pressured passes (pressure_ticks = 2): one step down, the lodger's threads moved.
        pass(&mut agent, 1001, 0.95);
        pass(&mut agent, 1002, 0.95);
        let first = mb();
        assert_ne!(first, "MB:0=100;1=100\n");
        let moved = std::fs::read_to_string(&tasks).unwrap();
        assert_eq!(
            moved.split_whitespace().collect::<Vec<_>>(),
            ["300", "301"],
            "{moved}"
        );
        // Still pressured: a further step, values multiples of the granularity (10 here).
        pass(&mut agent, 1003, 0.95);
        pass(&mut agent, 1004, 0.95);
        let second = mb();
        let values = |s: &str| -> Vec<u32> {
            s.trim()
                .trim_start_matches("MB:")
                .split(';')
                .map(|d| d.split('=').nth(1).unwrap().parse().unwrap())
                .collect()
        };
        assert!(values(&second) < values(&first), "{first} -> {second}");
        assert!(
            values(&second).iter().all(|v| v % 10 == 0 && *v >= 10),
            "{second}"
        );
        assert!(agent.state.jobs[&lodger]
            .job
            .throttle
            .as_deref()
            .is_some_and(|t| t.contains(" MB:")));
        assert!(
            agent.state.jobs[&train.id].job.throttle.is_none(),
            "training never"
        );
        let mut mechanisms = Vec::new();
        while let Ok(e) = events.try_recv() {
            if let Event::Throttled { id, mechanism, .. } = e {
                assert_eq!(id, lodger);
                mechanisms.push(mechanism);
            }
        }
        // One per L3 domain per step: two domains, two steps.
        assert_eq!(mechanisms, ["mba"; 4]);
        // Calm for long enough: every step given back, the schemata unthrottled.
        for i in 0..60u64 {
            pass(&mut agent, 2000 + i, 0.3);
        }
        assert_eq!(mb(), "MB:0=100;1=100\n");
        assert!(agent.state.jobs[&lodger].job.throttle.is_none());
    }
}
