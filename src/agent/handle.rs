//! The agent's API types: the handle the D-Bus layer (and anything else) talks through, the
//! commands it sends, who sends them ([`Caller`]), the replies' errors, events and status.
//! Touches nothing but the channels to the agent's thread.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use serde::Serialize;
use tokio::sync::{broadcast, oneshot};

use crate::cpuset::CpuSet;
use crate::enforce::network::node::NetworkControl;
use crate::enforce::EnforceError;
use crate::job::{Job, JobId, JobSpec, JobState, SpecError};
use crate::policy::consolidate::NoCapacity;
use crate::sense::{Observations, SourceAge};
use crate::store::StoreError;

use super::published::Published;
use crate::sense::link::LatestObservations;

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
    /// The caller may not make this change (the registry's one check, `Agent::authorize`).
    #[error("{0}")]
    AccessDenied(String),
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

/// Who made a mutating call, as the bus daemon vouches for it (never taken from the message).
/// Carried by every command that changes jobs and checked in one place in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    /// The caller's process, when the bus could say.
    pub pid: Option<u32>,
    /// That process's command name (`/proc/<pid>/comm`), when it could be read.
    pub comm: Option<String>,
}

impl Caller {
    /// A caller known only by its uid (tests, the simulator, in-process callers).
    pub fn uid(uid: u32) -> Self {
        Self {
            uid,
            pid: None,
            comm: None,
        }
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
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
#[derive(Debug, Clone, Default, Serialize)]
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
    /// Inference instances supervised: running, backing off, or still stopping after their job
    /// was unregistered (`lodgerctl drain` waits for none).
    pub instances: u32,
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
    /// How old each sensing source's newest sample is, and whether it is stale (issue 16).
    pub sample_ages: BTreeMap<String, SourceAge>,
    /// The sensing pass `sample_ages` is from (its `unix_ms`).
    #[serde(skip)]
    pub sensed_ms: u64,
}

impl NodeStatus {
    /// The sources' sample ages in words: `cpu 0.4 s, gpu 12.3 s (stale), ...`.
    pub fn sensing(&self) -> String {
        if self.sample_ages.is_empty() {
            return "no sample yet".into();
        }
        self.sample_ages
            .iter()
            .map(|(source, a)| {
                let stale = if a.stale { " (stale)" } else { "" };
                format!("{source} {:.1} s{stale}", a.age_s)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Everything the read-only views (`lodgerctl top`, Prometheus) show, taken at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Shared between snapshots while no job changes: a tick that changed nothing shown
    /// publishes the same list rather than a copy of every job (issue 21: the copy was an
    /// eighth of an idle 100-job tick).
    pub jobs: Arc<Vec<Job>>,
    /// Shared with the agent and the sensor: a tick publishes without copying every job's figures.
    pub observations: Arc<Observations>,
    pub status: NodeStatus,
}

pub(super) enum Command {
    Register {
        spec: Box<JobSpec>,
        /// The uid the job is registered for; None: the caller's.
        owner: Option<u32>,
        caller: Caller,
        /// When the call was sent, for the timing in the debug log (issue 21).
        sent: std::time::Instant,
        reply: oneshot::Sender<Result<Job, AgentError>>,
    },
    Unregister {
        id: String,
        caller: Caller,
        reply: oneshot::Sender<Result<(), AgentError>>,
    },
    /// A config reload: the settings that can change live (`config::reload`).
    Reload {
        live: Box<super::LiveSettings>,
        network: NetworkReload,
        reply: oneshot::Sender<()>,
    },
    Stop,
}

/// What a reload does to network shaping.
pub enum NetworkReload {
    /// `[network]` did not change.
    Keep,
    /// `[network]` changed: what runs now is removed and this (none: shaping off) takes its
    /// place, applied at the next tick if a multi-node training job runs.
    Replace(Option<Box<NetworkControl>>),
}

/// The API's way in: cheap to clone, safe to use from any task.
#[derive(Clone)]
pub struct AgentHandle {
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) events: broadcast::Sender<Event>,
    pub(super) ticks: Arc<AtomicU64>,
    /// What the read-only calls answer from (see `published`): they never wait on the loop.
    pub(super) published: Published<Snapshot>,
    /// The sensor's newest pass, shown when newer than the published one (absent without a
    /// sensor).
    pub(super) sensed: Option<LatestObservations>,
}

impl AgentHandle {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).ok()?;
        rx.await.ok()
    }

    /// Registers `spec` for `owner` (None: the caller). Only root may name another owner.
    pub async fn register(
        &self,
        spec: JobSpec,
        owner: Option<u32>,
        caller: Caller,
    ) -> Result<Job, AgentError> {
        self.ask(|reply| Command::Register {
            spec: Box::new(spec),
            owner,
            caller,
            sent: std::time::Instant::now(),
            reply,
        })
        .await
        .unwrap_or(Err(AgentError::Stopped))
    }

    pub async fn unregister(&self, id: &str, caller: Caller) -> Result<(), AgentError> {
        self.ask(|reply| Command::Unregister {
            id: id.to_string(),
            caller,
            reply,
        })
        .await
        .unwrap_or(Err(AgentError::Stopped))
    }

    // The read-only calls answer from the snapshot the loop last published, never from the
    // loop itself: a tick stuck in enforcement delays none of them. They stay async so callers
    // need not care where the answer comes from.

    pub async fn list(&self) -> Result<Vec<Job>, AgentError> {
        Ok(self.published.current().jobs.to_vec())
    }

    pub async fn get(&self, id: &str) -> Result<Job, AgentError> {
        let snap = self.published.current();
        JobId::parse(id)
            .and_then(|jid| snap.jobs.iter().find(|j| j.id == jid))
            .cloned()
            .ok_or_else(|| AgentError::NotFound(id.to_string()))
    }

    pub async fn status(&self) -> Result<NodeStatus, AgentError> {
        let mut status = self.published.current().status.clone();
        status.ticks = self.ticks();
        if let Some(obs) = self.newer_observations(status.sensed_ms) {
            status.sample_ages = obs.ages.clone();
        }
        Ok(status)
    }

    pub async fn snapshot(&self) -> Result<Arc<Snapshot>, AgentError> {
        let snap = self.published.current();
        let Some(obs) = self.newer_observations(snap.observations.unix_ms) else {
            return Ok(snap);
        };
        let mut status = snap.status.clone();
        status.sample_ages = obs.ages.clone();
        status.sensed_ms = obs.unix_ms;
        Ok(Arc::new(Snapshot {
            jobs: Arc::clone(&snap.jobs),
            observations: obs,
            status,
        }))
    }

    /// The sensor's newest pass, if newer than the pass of `than_ms`: sensing goes on while the
    /// loop is busy, and the read-only calls show it.
    fn newer_observations(&self, than_ms: u64) -> Option<Arc<Observations>> {
        let latest = self.sensed.as_ref()?.lock().ok()?.clone()?;
        (latest.unix_ms > than_ms).then_some(latest)
    }

    /// Applies the settings a reload may change ([`super::LiveSettings`], and network shaping)
    /// between two ticks; registered jobs are kept as they are.
    pub async fn reload(
        &self,
        live: super::LiveSettings,
        network: NetworkReload,
    ) -> Result<(), AgentError> {
        self.ask(|reply| Command::Reload {
            live: Box::new(live),
            network,
            reply,
        })
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

    /// The tick length the loop uses now (`agent.interval_ms`, as a reload last set it).
    pub fn interval(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.published.current().status.interval_ms)
    }

    /// Asks the agent to finish its current work and stop. Jobs stay enforced (training keeps its
    /// cpuset and SCHED_RR while lodgerd is down) and are re-adopted at the next start.
    pub fn stop(&self) {
        let _ = self.tx.send(Command::Stop);
    }
}
