//! lodgerd as an NRI plugin (docs/kubernetes.md): the `Plugin` service the runtime calls — a
//! container created becomes a job (placed at once, its cpuset and scheduling class returned
//! as the container's adjustment), a container stopped or removed is unregistered, and the
//! runtime's list of containers at every (re)connection is what the jobs are reconciled to.
//! Touches the agent, through its handle; reads the node's RT limit and v1 cpu hierarchy (to
//! know whether the runtime may set SCHED_RR).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;

use async_trait::async_trait;
use tracing::{debug, info, warn};
use ttrpc::r#async::TtrpcContext;

use super::pods::{self, Decision};
use super::proto::api_ttrpc::Plugin;
use super::proto::*;
use crate::agent::{AgentHandle, Caller};
use crate::config::KubernetesConfig;
use crate::enforce::sched::unthrottled_rt_refused;
use crate::enforce::training::rtgroup::RtGroups;
use crate::job::{ContainerJob, Job, JobId, JobKind, Target};

/// The events lodger subscribes to: one bit per event, bit `event - 1` (NRI's mask). Runtimes
/// of NRI v0.6 to v0.8 refuse a plugin asking for any bit above `REMOVE_CONTAINER`'s (0x7ff).
pub fn events() -> i32 {
    [
        Event::CREATE_CONTAINER,
        Event::START_CONTAINER,
        Event::STOP_CONTAINER,
        Event::REMOVE_CONTAINER,
        Event::REMOVE_POD_SANDBOX,
    ]
    .iter()
    .fold(0, |m, e| m | 1 << (*e as i32 - 1))
}

/// The scheduling class lodger gives training containers through NRI, and what decides
/// whether the runtime may set it at creation (the rules of lodger's own sweep,
/// `enforce::training::rr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainingSched {
    /// SCHED_RR at this priority; `None`: training runs SCHED_OTHER (`training.policy`).
    pub rr_priority: Option<i32>,
    /// `training.allow_unthrottled_rt`: SCHED_RR even while `kernel.sched_rt_runtime_us` is -1.
    pub allow_unthrottled_rt: bool,
    /// Where the node's RT limit is read (`node.proc_root`).
    pub proc_root: PathBuf,
    /// The cgroup hierarchy's root (`cgroup.root`), where v1's RT groups would be.
    pub cgroup_root: PathBuf,
}

impl TrainingSched {
    /// Why the runtime is not asked for SCHED_RR now, lodger's sweep being left to set it (or
    /// to refuse it, saying why); `None` when it may be asked. Read at every container: the
    /// sysctl can change at run time.
    pub fn left_to_sweep(&self) -> Option<&'static str> {
        match unthrottled_rt_refused(self.allow_unthrottled_rt, &self.proc_root) {
            Ok(true) => {
                return Some(
                    "kernel.sched_rt_runtime_us is -1 and training.allow_unthrottled_rt is \
                     off: the sweep refuses SCHED_RR",
                )
            }
            Ok(false) => {}
            Err(_) => return Some("the node's RT limit cannot be read"),
        }
        // With RT group scheduling a container's group may have no RT budget: the runtime
        // would fail the container, where the sweep diagnoses the EPERM or grants a budget.
        if RtGroups::new(&self.cgroup_root).available() {
            return Some("cpu cgroups have RT budgets (RT group scheduling)");
        }
        None
    }
}

/// The `Plugin` service.
pub struct NriPlugin {
    agent: AgentHandle,
    config: KubernetesConfig,
    sched: TrainingSched,
    /// Whether the runtime applies NRI's scheduler adjustment (NRI v0.10: containerd 2.2,
    /// CRI-O 1.34); learnt at `Configure`. Elsewhere lodger's own sweep makes threads RR.
    runtime_sets_sched: Mutex<bool>,
    /// A `Synchronize` sent in parts (`more`): what came so far on this connection (emptied
    /// at `Configure`, which starts every connection).
    sync: Mutex<(Vec<PodSandbox>, Vec<Container>)>,
}

/// Who NRI registrations are made by: lodgerd itself, on the pod's behalf.
fn nri_caller() -> Caller {
    Caller {
        uid: 0,
        pid: Some(std::process::id()),
        comm: Some("nri".into()),
    }
}

impl NriPlugin {
    pub fn new(agent: AgentHandle, config: KubernetesConfig, sched: TrainingSched) -> Self {
        Self {
            agent,
            config,
            sched,
            runtime_sets_sched: Mutex::new(false),
            sync: Mutex::new((Vec::new(), Vec::new())),
        }
    }

    /// Registers `ctr` when lodger takes it on; the job, or `None` (left alone, or refused: the
    /// container then runs as the runtime made it, with one log line saying why).
    async fn take_on(&self, pod: &PodSandbox, ctr: &Container) -> Option<Job> {
        let Decision { spec, owner } = match pods::decide(pod, ctr, &self.config) {
            Ok(Some(d)) => d,
            Ok(None) => return None,
            Err(why) => {
                warn!("NRI: {why}");
                return None;
            }
        };
        let label = spec.label().unwrap_or_default();
        match self.agent.register(spec, owner, nri_caller()).await {
            Ok(job) => {
                info!(job = %job.id, cpus = %job.cpus, "NRI: container {label} registered as a {} job", job.spec.kind.as_str());
                Some(job)
            }
            Err(e) => {
                warn!("NRI: container {label} left alone: {e}");
                None
            }
        }
    }

    /// The registered containers, each with its job's id.
    async fn container_jobs(&self) -> Vec<(ContainerJob, JobId)> {
        let jobs = self.agent.list().await.unwrap_or_default();
        jobs.into_iter()
            .filter_map(|j| match j.spec.target {
                Target::Container(c) => Some((c, j.id)),
                _ => None,
            })
            .collect()
    }

    /// Unregisters container `c`'s job, saying `why`.
    async fn unregister(&self, c: &ContainerJob, job: &JobId, why: &str) {
        match self.agent.unregister(job.as_str(), nri_caller()).await {
            Ok(()) => info!(job = %job, "NRI: container {} {why}: unregistered", c.label()),
            Err(e) => debug!(job = %job, "NRI: container {} {why}: {e}", c.label()),
        }
    }

    /// Unregisters the jobs of the containers `which` picks, saying `why`.
    async fn forget(&self, which: impl Fn(&ContainerJob) -> bool, why: &str) {
        for (c, job) in self.container_jobs().await {
            if which(&c) {
                self.unregister(&c, &job, why).await;
            }
        }
    }

    /// Makes the jobs match the runtime's containers: jobs of containers it no longer lists
    /// are unregistered, containers lodger takes on and has no job for are registered.
    async fn reconcile(&self, pods: &[PodSandbox], containers: &[Container]) {
        let live: Vec<&Container> = containers
            .iter()
            .filter(|c| c.state.enum_value_or_default() != ContainerState::CONTAINER_STOPPED)
            .collect();
        let ids: HashSet<&str> = live.iter().map(|c| c.id.as_str()).collect();
        let mut known = HashSet::new();
        for (c, job) in self.container_jobs().await {
            if ids.contains(c.id.as_str()) {
                known.insert(c.id);
            } else {
                self.unregister(&c, &job, "is no longer in the runtime's list")
                    .await;
            }
        }
        for ctr in live {
            if known.contains(&ctr.id) {
                continue;
            }
            let Some(pod) = pods.iter().find(|p| p.id == ctr.pod_sandbox_id) else {
                continue;
            };
            self.take_on(pod, ctr).await;
        }
    }

    /// The adjustment that puts a container where its job is placed.
    fn adjustment(&self, job: &Job) -> ContainerAdjustment {
        let mut cpu = LinuxCPU::new();
        cpu.cpus = job.cpus.to_string();
        if !job.mems.is_empty() {
            cpu.mems = job.mems.to_string();
        }
        let mut resources = LinuxResources::new();
        resources.cpu = Some(cpu).into();
        let mut linux = LinuxContainerAdjustment::new();
        linux.resources = Some(resources).into();
        let runtime_sets = *self
            .runtime_sets_sched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let (JobKind::Training, Some(priority), true) =
            (job.spec.kind, self.sched.rr_priority, runtime_sets)
        {
            if let Some(why) = self.sched.left_to_sweep() {
                debug!(job = %job.id, "NRI: no SCHED_RR in the adjustment ({why}); left to lodger's sweep");
                return self.with_linux(linux);
            }
            let mut s = LinuxScheduler::new();
            s.policy = LinuxSchedulerPolicy::SCHED_RR.into();
            s.priority = priority;
            linux.scheduler = Some(s).into();
        }
        self.with_linux(linux)
    }

    fn with_linux(&self, linux: LinuxContainerAdjustment) -> ContainerAdjustment {
        let mut adjust = ContainerAdjustment::new();
        adjust.linux = Some(linux).into();
        adjust
    }

    async fn container_gone(&self, ctr: &Container, why: &str) {
        let id = ctr.id.clone();
        self.forget(move |c| c.id == id, why).await;
    }

    /// Unregisters the containers of sandbox `pod`. By its sandbox id, not its name: a pod
    /// re-created under the same name (a new sandbox of the same pod, a StatefulSet pod
    /// replaced on this node) runs on while the old sandbox is removed.
    async fn pod_gone(&self, pod: &PodSandbox) {
        let sandbox = pod.id.clone();
        let label = pods::pod_label(pod);
        self.forget(
            move |c| match c.sandbox.as_deref() {
                Some(s) if !sandbox.is_empty() => s == sandbox,
                // A record from before sandboxes were kept, or a runtime naming none.
                _ => c.pod == label,
            },
            "'s pod sandbox was removed",
        )
        .await;
    }
}

/// Whether a runtime applies NRI's `LinuxScheduler` adjustment (NRI v0.10 and later:
/// containerd 2.2 and CRI-O 1.34 onward).
pub fn runtime_sets_sched(name: &str, version: &str) -> bool {
    let v: Vec<u32> = version
        .trim_start_matches('v')
        .split(['.', '-', '+', '~'])
        .take(2)
        .map_while(|p| p.parse().ok())
        .collect();
    let at_least = |major: u32, minor: u32| matches!(v[..], [a, b] if (a, b) >= (major, minor));
    match name {
        "containerd" => at_least(2, 2),
        "cri-o" | "crio" | "CRI-O" => at_least(1, 34),
        _ => false,
    }
}

#[async_trait]
impl Plugin for NriPlugin {
    async fn configure(
        &self,
        _ctx: &TtrpcContext,
        req: ConfigureRequest,
    ) -> ttrpc::Result<ConfigureResponse> {
        // Every connection starts here: the parts of a `Synchronize` an earlier connection
        // left unfinished are of a list that no longer holds.
        let stale = std::mem::take(
            &mut *self
                .sync
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if !stale.0.is_empty() || !stale.1.is_empty() {
            info!(
                "NRI: dropping an unfinished synchronization ({} pods, {} containers) of the \
                 previous connection",
                stale.0.len(),
                stale.1.len()
            );
        }
        let sets = runtime_sets_sched(&req.runtime_name, &req.runtime_version);
        *self
            .runtime_sets_sched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = sets;
        let by = match (sets, self.sched.left_to_sweep()) {
            (false, _) => {
                "lodger's sweep (this runtime's NRI has no scheduler adjustment)".to_string()
            }
            (true, Some(why)) => format!("lodger's sweep, for now ({why})"),
            (true, None) => "the runtime (NRI scheduler adjustment) and lodger's sweep".into(),
        };
        info!(
            "NRI: configured by {} {}; training's scheduling class set by {by}",
            req.runtime_name, req.runtime_version,
        );
        let mut rsp = ConfigureResponse::new();
        rsp.events = events();
        Ok(rsp)
    }

    async fn synchronize(
        &self,
        _ctx: &TtrpcContext,
        req: SynchronizeRequest,
    ) -> ttrpc::Result<SynchronizeResponse> {
        let (pods, containers) = {
            let mut sync = self
                .sync
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            sync.0.extend(req.pods);
            sync.1.extend(req.containers);
            if req.more {
                let mut rsp = SynchronizeResponse::new();
                rsp.more = true;
                return Ok(rsp);
            }
            std::mem::take(&mut *sync)
        };
        info!(
            "NRI: synchronizing with the runtime's {} pods and {} containers",
            pods.len(),
            containers.len()
        );
        self.reconcile(&pods, &containers).await;
        Ok(SynchronizeResponse::new())
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, _req: Empty) -> ttrpc::Result<Empty> {
        info!("NRI: the runtime is shutting down");
        Ok(Empty::new())
    }

    async fn create_container(
        &self,
        _ctx: &TtrpcContext,
        req: CreateContainerRequest,
    ) -> ttrpc::Result<CreateContainerResponse> {
        let mut rsp = CreateContainerResponse::new();
        if let (Some(pod), Some(ctr)) = (req.pod.as_ref(), req.container.as_ref()) {
            if let Some(job) = self.take_on(pod, ctr).await {
                rsp.adjust = Some(self.adjustment(&job)).into();
            }
        }
        Ok(rsp)
    }

    async fn stop_container(
        &self,
        _ctx: &TtrpcContext,
        req: StopContainerRequest,
    ) -> ttrpc::Result<StopContainerResponse> {
        if let Some(ctr) = req.container.as_ref() {
            self.container_gone(ctr, "stopped").await;
        }
        Ok(StopContainerResponse::new())
    }

    async fn state_change(
        &self,
        _ctx: &TtrpcContext,
        req: StateChangeEvent,
    ) -> ttrpc::Result<Empty> {
        match (
            req.event.enum_value_or_default(),
            req.container.as_ref(),
            req.pod.as_ref(),
        ) {
            (Event::REMOVE_CONTAINER, Some(ctr), _) => self.container_gone(ctr, "removed").await,
            (Event::REMOVE_POD_SANDBOX, _, Some(pod)) => self.pod_gone(pod).await,
            // Started: lodger's next pass finds its cgroup and sweeps its threads.
            (e, _, _) => debug!("NRI: {e:?}"),
        }
        Ok(Empty::new())
    }

    async fn start_container(
        &self,
        _ctx: &TtrpcContext,
        _req: ContainerEvent,
    ) -> ttrpc::Result<Empty> {
        Ok(Empty::new())
    }

    async fn remove_container(
        &self,
        _ctx: &TtrpcContext,
        req: ContainerEvent,
    ) -> ttrpc::Result<Empty> {
        if let Some(ctr) = req.container.as_ref() {
            self.container_gone(ctr, "removed").await;
        }
        Ok(Empty::new())
    }

    async fn remove_pod_sandbox(&self, _ctx: &TtrpcContext, req: PodEvent) -> ttrpc::Result<Empty> {
        if let Some(pod) = req.pod.as_ref() {
            self.pod_gone(pod).await;
        }
        Ok(Empty::new())
    }
}

#[cfg(test)]
#[path = "plugin_tests.rs"]
mod tests;
