//! Jobs: what a caller registers (`JobSpec`), what lodger tracks (`Job`), ids and kinds.
//! Pure data and validation; touches nothing else.

mod account;
mod id;
mod inference;
pub mod memory;

use serde::{Deserialize, Serialize};

pub use self::account::CpuAccount;
pub use self::id::JobId;
pub use self::inference::{
    InferenceSpec, InstanceView, JobLatency, Launch, DEFAULT_MAX_BATCH, MAX_LAUNCH_ENV,
};

use crate::cpuset::CpuSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// A GPU training job: the owner of the node's CPUs it is given.
    Training,
    /// Online CPU inference: instances on exclusive leftover cores, held to a latency SLO
    /// (Cloud Reamer §III-B).
    Online,
    /// Offline CPU inference: many single-thread instances on every core, training's included,
    /// pre-empted by training's SCHED_RR (Cloud Reamer §III-A).
    Offline,
    /// A CPU batch job lodger did not start (data preparation, feature extraction, a user's
    /// CPU-only job; SODA §V-E's noisy neighbours): its processes or cgroup get the leftover cores
    /// (never a training or online-inference CPU), SCHED_OTHER or SCHED_BATCH, and are throttled
    /// first.
    Batch,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Training => "training",
            JobKind::Online => "online",
            JobKind::Offline => "offline",
            JobKind::Batch => "batch",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "training" => Some(JobKind::Training),
            "online" => Some(JobKind::Online),
            "offline" => Some(JobKind::Offline),
            "batch" => Some(JobKind::Batch),
            _ => None,
        }
    }

    /// Started by lodger's instance runner from a command (no pids or cgroup of its own).
    pub fn is_inference(self) -> bool {
        matches!(self, JobKind::Online | JobKind::Offline)
    }

    /// What the job is to the node: the training it exists for, or a lodger in what training
    /// leaves. The one place a new kind (batch) says which side it is on.
    pub fn role(self) -> Role {
        match self {
            JobKind::Training => Role::Training,
            JobKind::Online | JobKind::Offline | JobKind::Batch => Role::Lodger,
        }
    }

    /// Not training: placed around training, throttled first, never given SCHED_RR.
    pub fn is_lodger(self) -> bool {
        self.role() == Role::Lodger
    }
}

/// A job's side on the node (see [`JobKind::role`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The GPU training the node exists for: placed by the training policy, pinned, SCHED_RR.
    Training,
    /// A CPU job lodged in what training leaves (online or offline inference, batch).
    Lodger,
}

/// How lodger finds a job's processes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// These processes and every process they start. Other processes sharing their cgroup are
    /// left alone.
    Pids(Vec<u32>),
    /// Every process in this existing cgroup (a Slurm step, a container), given relative to the
    /// cgroup hierarchy root (e.g. `/slurm/uid_1000/job_42/step_0`).
    Cgroup(String),
    /// Processes lodger starts itself: the instances of an inference job.
    Instances,
    /// A Slurm job, registered by lodger's prolog (docs/slurm.md). lodger finds its cgroup as
    /// it appears and pins its threads by CPU affinity inside the cpuset Slurm gave it, never
    /// writing Slurm's cgroup files.
    Slurm(SlurmJob),
    /// A container a Kubernetes runtime is creating, registered by lodger's NRI plugin before
    /// the container exists (docs/kubernetes.md): placed at once, so the runtime creates it on
    /// that cpuset, then kept there as a `Cgroup` target once its cgroup appears.
    Container(ContainerJob),
}

/// Which container: what the NRI plugin was told of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerJob {
    /// The runtime's container id.
    pub id: String,
    /// Its pod, as `namespace/name`.
    pub pod: String,
    /// Its pod sandbox's id: what tells two sandboxes of one pod name apart (kubelet
    /// re-creating a sandbox, a StatefulSet pod replaced on the same node). `None` in the
    /// records of a lodgerd before it was kept; those are matched by `pod`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// The container's name in its pod.
    pub name: String,
    /// Its cgroup relative to the hierarchy root, where the runtime creates it.
    pub cgroup: String,
}

impl ContainerJob {
    fn validate(&self) -> Result<(), SpecError> {
        if !valid_cgroup_path(&self.cgroup) {
            return Err(SpecError::BadCgroup(self.cgroup.clone()));
        }
        let printable = |s: &str, max: usize| {
            !s.is_empty() && s.len() <= max && !s.chars().any(char::is_control)
        };
        if !printable(&self.id, 128)
            || !printable(&self.pod, 320)
            || !printable(&self.name, 253)
            || self.sandbox.as_deref().is_some_and(|s| !printable(s, 128))
        {
            return Err(SpecError::BadContainer(self.label()));
        }
        Ok(())
    }

    /// `namespace/pod/container`: how list, show, the metrics and the audit log name it.
    pub fn label(&self) -> String {
        format!("{}/{}", self.pod, self.name)
    }
}

/// Whether `path` can name a cgroup lodger acts on: absolute, not the root, no `..` or `.`,
/// and written one way only (no empty component: no doubled or trailing `/`), so the trust
/// rules and the duplicate check, which compare paths as written, see the cgroup the kernel
/// would ([`canonical_cgroup_path`] writes a caller's path so).
fn valid_cgroup_path(path: &str) -> bool {
    path.starts_with('/')
        && path.len() <= MAX_PATH_LEN
        && !path[1..]
            .split('/')
            .any(|c| c.is_empty() || c == ".." || c == ".")
        && !path.contains('\0')
}

/// An absolute `path` with doubled and trailing `/` dropped: how a caller's cgroup is recorded
/// and checked (`//a/b/` is `/a/b`). What else is wrong with it
/// (`valid_cgroup_path`) is left for validation to say.
pub fn canonical_cgroup_path(path: &str) -> String {
    if !path.starts_with('/') {
        return path.to_string();
    }
    let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    format!("/{}", parts.join("/"))
}

/// Which Slurm job: what lodger needs to find its cgroup (`[slurm] cgroup_paths`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlurmJob {
    /// `SLURM_JOB_ID`.
    pub job_id: u64,
    /// `SLURM_JOB_UID`: the submitting user (v1 cgroups are under `uid_<uid>`).
    pub uid: u32,
    /// `SLURMD_NODENAME`: Debian's Slurm (built for several slurmd per host) names its cgroups
    /// after the node (`<node>_slurmstepd.scope`, `slurm_<node>`). None: the host's short name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// Whether `name` can be a Slurm node name lodger puts in a cgroup path.
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != "."
        && name != ".."
}

/// SODA §III-B categories, recorded now so right-sizing history can use them later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Category {
    Cv,
    Nlp,
    Speech,
    #[default]
    Other,
}

impl Category {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cv" => Some(Self::Cv),
            "nlp" => Some(Self::Nlp),
            "speech" => Some(Self::Speech),
            "other" => Some(Self::Other),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cv => "cv",
            Self::Nlp => "nlp",
            Self::Speech => "speech",
            Self::Other => "other",
        }
    }
}

/// What a caller asks for when registering a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    pub kind: JobKind,
    pub name: Option<String>,
    pub target: Target,
    /// GPU indices in PCI bus order (the order `nvidia-smi` and NVML use).
    pub gpus: Vec<u32>,
    /// Logical CPUs requested (SMT siblings count separately, as Slurm's `--cpus-per-task`).
    /// 0: a batch job's "no cap"; a Slurm job's "its whole Slurm cpuset".
    pub cores: u32,
    #[serde(default)]
    pub category: Category,
    #[serde(default)]
    pub pipeline: bool,
    #[serde(default)]
    pub multi_node: bool,
    /// Inference jobs only: what to run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference: Option<InferenceSpec>,
    /// Training jobs: lodger may right-size the core count from GPU utilization (SODA §V-B).
    #[serde(default = "yes")]
    pub rightsize: bool,
    /// Training jobs: its cores host no lodger (a benchmark, a latency-critical job).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclusive: bool,
    /// Batch jobs registered by pids: the memory limit in bytes of the cgroup lodger makes for
    /// them (at most the node's `batch.memory_max`, which applies when not given; issue 19).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
}

impl JobSpec {
    /// A job of `kind` on `target` asking for `cores`, with every other choice at its default
    /// (no name, no GPU, category other, right-sized, not exclusive).
    pub fn new(kind: JobKind, target: Target, cores: u32) -> Self {
        Self {
            kind,
            name: None,
            target,
            gpus: Vec::new(),
            cores,
            category: Category::Other,
            pipeline: false,
            multi_node: false,
            inference: None,
            rightsize: true,
            exclusive: false,
            memory_max: None,
        }
    }

    /// The name list, show and the metrics give the job: its own, or a container's
    /// `namespace/pod/container` (docs/kubernetes.md).
    pub fn label(&self) -> Option<String> {
        match (&self.name, &self.target) {
            (Some(name), _) => Some(name.clone()),
            (None, Target::Container(c)) => Some(c.label()),
            (None, _) => None,
        }
    }
}

fn yes() -> bool {
    true
}

/// Largest `pids` list accepted in one registration.
pub const MAX_PIDS: usize = 4096;
pub const MAX_NAME_LEN: usize = 64;
/// Longest path a spec may hold (a cgroup, an instance's `cwd` or `output`): Linux's `PATH_MAX`.
pub const MAX_PATH_LEN: usize = 4096;
/// Most arguments of an instance's command, and the longest one (or environment entry), in
/// bytes: a spec is kept in the state file, rewritten at every save, and shown to every local
/// user, so what a caller may store in it is bounded.
pub const MAX_COMMAND_ARGS: usize = 1024;
pub const MAX_ARG_LEN: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("give either pids or a cgroup, not both")]
    BothTargets,
    #[error("give the job's processes: pids (e.g. --pid 1234) or an existing cgroup (e.g. --cgroup /slurm/job_1)")]
    NoTarget,
    #[error("pid {0} is not a valid process id")]
    BadPid(u32),
    #[error("too many pids ({0}); register the job by its cgroup instead")]
    TooManyPids(usize),
    #[error("cgroup path '{0}' must be absolute within the hierarchy (start with /), must not be the root, must not contain '..', '.' or '//' and must be at most {MAX_PATH_LEN} bytes")]
    BadCgroup(String),
    #[error("container {0:?} has an empty or overlong id, pod or name")]
    BadContainer(String),
    #[error("a container is its own inference instance: lodger starts no command for it")]
    CommandForContainer,
    #[error("cores must be at least 1 (got {0})")]
    ZeroCores(u32),
    #[error(
        "name '{0}' must be 1 to {MAX_NAME_LEN} characters of letters, digits, '.', '_' or '-'"
    )]
    BadName(String),
    #[error("GPU index {0} is listed twice")]
    DuplicateGpu(u32),
    #[error("an inference job needs a command (the argv of one instance), e.g. -- python3 serve.py --threads {{threads}}")]
    NoCommand,
    #[error("an online job needs a latency SLO in milliseconds greater than 0 (slo_ms), got {0}")]
    BadSlo(f64),
    #[error("rate_per_s must be a number greater than 0, got {0}")]
    BadRate(f64),
    #[error("max_batch must be between 1 and 65536, got {0}")]
    BadBatch(u32),
    #[error("max_instances must be at least 1")]
    BadMaxInstances,
    #[error("{kind} jobs are started by lodger from their command: give no pids or cgroup")]
    TargetForInference { kind: &'static str },
    #[error(
        "a training or batch job is not started by lodger: give its pids or cgroup, not a command"
    )]
    CommandForTraining,
    #[error("a Slurm job id must be at least 1")]
    BadSlurmJob,
    #[error("Slurm node name '{0}' must be 1 to 64 letters, digits, '-', '_' or '.'")]
    BadSlurmNode(String),
    #[error("a batch job uses no GPU (a job with GPUs is a training job)")]
    GpusForBatch,
    #[error("only a training job can be exclusive (its cores host no lodger)")]
    ExclusiveLodger,
    #[error("{key} '{path}' must be an absolute path of at most {MAX_PATH_LEN} bytes")]
    BadLaunchPath { key: &'static str, path: String },
    #[error("command: {0}")]
    BadCommand(String),
    #[error("env: {0}")]
    BadEnv(String),
}

impl JobSpec {
    /// Checks what can be checked without looking at the node (GPU existence and capacity are
    /// checked against the topology by the agent).
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.kind.is_inference() {
            return self.validate_inference();
        }
        if self.inference.is_some() || self.target == Target::Instances {
            return Err(SpecError::CommandForTraining);
        }
        match &self.target {
            Target::Pids(pids) => {
                if pids.is_empty() {
                    return Err(SpecError::NoTarget);
                }
                if pids.len() > MAX_PIDS {
                    return Err(SpecError::TooManyPids(pids.len()));
                }
                if let Some(&bad) = pids.iter().find(|&&p| p == 0 || p > i32::MAX as u32) {
                    return Err(SpecError::BadPid(bad));
                }
            }
            Target::Cgroup(path) => {
                if !valid_cgroup_path(path) {
                    return Err(SpecError::BadCgroup(path.clone()));
                }
            }
            Target::Container(c) => c.validate()?,
            Target::Slurm(job) => {
                if job.job_id == 0 {
                    return Err(SpecError::BadSlurmJob);
                }
                if let Some(node) = &job.node {
                    if !valid_node_name(node) {
                        return Err(SpecError::BadSlurmNode(node.clone()));
                    }
                }
            }
            Target::Instances => return Err(SpecError::CommandForTraining),
        }
        // A batch job takes what training and online inference leave; `cores` caps it (0: none).
        let whole_cpuset = matches!(self.target, Target::Slurm(_));
        if self.cores == 0 && self.kind != JobKind::Batch && !whole_cpuset {
            return Err(SpecError::ZeroCores(self.cores));
        }
        if self.kind == JobKind::Batch && !self.gpus.is_empty() {
            return Err(SpecError::GpusForBatch);
        }
        if self.exclusive && self.kind != JobKind::Training {
            return Err(SpecError::ExclusiveLodger);
        }
        if let Some(name) = &self.name {
            let ok = !name.is_empty()
                && name.len() <= MAX_NAME_LEN
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !ok {
                return Err(SpecError::BadName(name.clone()));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for &g in &self.gpus {
            if !seen.insert(g) {
                return Err(SpecError::DuplicateGpu(g));
            }
        }
        Ok(())
    }
}

impl JobSpec {
    fn validate_inference(&self) -> Result<(), SpecError> {
        if let Target::Container(c) = &self.target {
            // The pod is the instance (docs/kubernetes.md): lodger starts nothing and searches
            // no layout; an online container needs its CPU count, an offline one may take all.
            c.validate()?;
            if self.inference.is_some() {
                return Err(SpecError::CommandForContainer);
            }
            if self.kind == JobKind::Online && self.cores == 0 {
                return Err(SpecError::ZeroCores(0));
            }
            return Ok(());
        }
        if self.target != Target::Instances {
            return Err(SpecError::TargetForInference {
                kind: self.kind.as_str(),
            });
        }
        let Some(inf) = &self.inference else {
            return Err(SpecError::NoCommand);
        };
        if inf.command.is_empty() || inf.command[0].is_empty() {
            return Err(SpecError::NoCommand);
        }
        if inf.command.len() > MAX_COMMAND_ARGS {
            return Err(SpecError::BadCommand(format!(
                "{} arguments (at most {MAX_COMMAND_ARGS})",
                inf.command.len()
            )));
        }
        if let Some((i, arg)) = inf
            .command
            .iter()
            .enumerate()
            .find(|(_, a)| a.len() > MAX_ARG_LEN)
        {
            return Err(SpecError::BadCommand(format!(
                "argument {i} is {} bytes (at most {MAX_ARG_LEN})",
                arg.len()
            )));
        }
        if self.kind == JobKind::Online {
            match inf.slo_ms {
                Some(slo) if slo.is_finite() && slo > 0.0 => {}
                other => return Err(SpecError::BadSlo(other.unwrap_or(0.0))),
            }
        }
        if let Some(rate) = inf.rate_per_s {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(SpecError::BadRate(rate));
            }
        }
        if inf.max_batch == 0 || inf.max_batch > 65536 {
            return Err(SpecError::BadBatch(inf.max_batch));
        }
        if inf.max_instances == Some(0) {
            return Err(SpecError::BadMaxInstances);
        }
        inf.launch.validate()?;
        if let Some(name) = &self.name {
            let ok = !name.is_empty()
                && name.len() <= MAX_NAME_LEN
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !ok {
                return Err(SpecError::BadName(name.clone()));
            }
        }
        Ok(())
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Registered, not yet enforced.
    Pending,
    /// On its cpuset with every thread SCHED_RR.
    Running,
    /// Enforcement failed; `last_error` says why. Retried every tick.
    Error,
    /// Its last process exited; about to be forgotten.
    Exited,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Error => "error",
            JobState::Exited => "exited",
        }
    }
}

/// A registered job as lodger tracks it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    /// The uid of the D-Bus caller that registered it.
    pub owner_uid: u32,
    pub state: JobState,
    /// The CPUs the plan gives it (empty until placed).
    pub cpus: CpuSet,
    /// The NUMA nodes of those CPUs (its `cpuset.mems`).
    pub mems: CpuSet,
    /// Processes last seen in the job.
    pub pids: Vec<u32>,
    /// Threads last seen, and how many of them run SCHED_RR.
    pub threads: u32,
    pub rr_threads: u32,
    pub last_error: Option<String>,
    /// Seconds since the epoch at registration.
    pub registered_at: u64,
    /// Inference jobs: their instances as last seen.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceView>,
    /// Inference jobs: the layout in use or being measured, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// Online jobs lodger starts: the core budget their layout search runs within (the CPUs left
    /// for online inference split between the online jobs; `policy::inference::online_budgets`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_budget: Option<u32>,
    /// Online jobs: the p50 and p99 latency of the job's requests over the last window, every
    /// instance's batches pooled (its SLO is judged by the p99).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<JobLatency>,
    /// Training jobs: where right-sizing stands, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rightsize: Option<String>,
    /// Training jobs: the right-sizing windows so far (SODA §V-B-2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tuning: Vec<TuningView>,
    /// A contention throttle in force on this job, with its evidence (SODA §V-E).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<String>,
    /// Network shaping as it concerns this job (SODA §V-E), while it is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// Training jobs under SCHED_RR: where the job stands against the kernel's RT limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rt: Option<RtStanding>,
    /// Lent CPU time: given (training) or used (lodgers), kept across restarts.
    #[serde(default, skip_serializing_if = "CpuAccount::is_empty")]
    pub account: CpuAccount,
}

/// A SCHED_RR training job against the kernel's RT limit (`sched_rt_runtime_us /
/// sched_rt_period_us` of each CPU), as the RT guard last measured it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RtStanding {
    /// The job's CPU time per CPU of its cpuset, percent.
    pub share_percent: f64,
    /// The RT limit, percent of a CPU; `None` when RT tasks are unthrottled.
    pub limit_percent: Option<f64>,
    /// Its threads' time runnable but not running, ms per second (summed over threads).
    pub runq_wait_ms_per_s: f64,
    /// Within `training.rt_headroom_percent` of the limit (or above it).
    pub near_limit: bool,
    /// Cores added to what the job asked for (or right-sizing gave it) because it neared the
    /// limit; kept while the job runs.
    pub extra_cores: u32,
}

impl RtStanding {
    /// One line for `lodgerctl show`.
    pub fn describe(&self) -> String {
        let limit = self
            .limit_percent
            .map_or("unthrottled".to_string(), |l| format!("{l:.0}%"));
        format!(
            "{:.0}% of each CPU (RT limit {limit}){}; run-queue wait {:.1} ms/s{}",
            self.share_percent,
            if self.near_limit {
                ", NEAR THE LIMIT"
            } else {
                ""
            },
            self.runq_wait_ms_per_s,
            if self.extra_cores > 0 {
                format!("; grown by {} core(s) to stay under it", self.extra_cores)
            } else {
                String::new()
            }
        )
    }
}

/// One right-sizing window as `lodgerctl show` displays it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TuningView {
    pub cores: u32,
    /// Mean GPU utilization over the window, percent.
    pub gpu_percent: f64,
    /// Its standard error, percent.
    pub noise: f64,
    pub decision: String,
}

#[cfg(test)]
mod tests;
