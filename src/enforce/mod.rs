//! Making the node match the plan: `training/` (training jobs' cpusets or affinity and SCHED_RR
//! on every thread), `instances/` (inference instances: start, supervise, stop), `network/` (HTB,
//! nftables, `net_cls`, routes), `resctrl` (MBA groups), the cpuset hierarchy those write
//! (`cpusets`) and per-thread scheduling (`sched`), and a simulated enforcer for `--sim`. This file
//! is the index and the settings the rooms share. May touch `sys/` and the kernel through it;
//! never the sense or agent rooms.

pub mod cpusets;
pub mod instances;
pub mod network;
pub mod quiet;
pub mod resctrl;
pub mod sched;
pub mod sim;
pub mod training;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use self::cpusets::CpusetHierarchy;
pub use self::sched::SchedError;
pub use self::training::rtgroup::{RtGrant, RtGroupError};
pub use self::training::{
    slurm_job_cgroup, CgroupJobRecord, CgroupMode, EnforceError, Enforcer, JobRecord, Outcome,
    PidJobRecord, RootProcess, SavedCpuset, SlurmCgroup, SlurmJobRecord, TrackedProcess,
};
pub use crate::sys::cgroupfs::{CgroupDriver, CgroupError, CgroupVersion};

/// Default name of lodger's own parent cgroup.
pub const DEFAULT_PARENT: &str = "lodger";
/// Default SCHED_RR priority: above every normal thread, below the kernel's own RT threads
/// (watchdog, migration at 99; threaded IRQs at 50).
pub const DEFAULT_RT_PRIORITY: i32 = 10;

/// How lodger pins a job registered by pids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PidPinning {
    /// `Cgroup` on v1, `Affinity` on v2 (where lodger must not pull processes out of their
    /// systemd unit).
    #[default]
    Auto,
    Cgroup,
    Affinity,
}

/// The pinning method in use for a pid job (`PidPinning` resolved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinMethod {
    /// The job's processes move into `<cpuset root>/<parent>/<job id>`.
    Cgroup,
    /// Every thread gets a CPU affinity mask; memory nodes are not enforced.
    Affinity,
}

impl PinMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            PinMethod::Cgroup => "cgroup",
            PinMethod::Affinity => "affinity",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EnforceSettings {
    /// Where the cgroup hierarchies are mounted (`/sys/fs/cgroup`).
    pub cgroup_root: PathBuf,
    /// Where procfs is mounted (`/proc`).
    pub proc_root: PathBuf,
    pub driver: CgroupDriver,
    /// lodger's own cgroup, parent of the per-job cgroups of pid jobs (relative to the cpuset
    /// hierarchy). v2: the only subtree where lodger enables controllers.
    pub parent: String,
    pub pid_jobs: PidPinning,
    /// SCHED_RR priority of training threads.
    pub rt_priority: i32,
    /// Allow SCHED_RR when `kernel.sched_rt_runtime_us` is -1 (`training.allow_unthrottled_rt`).
    pub allow_unthrottled_rt: bool,
    /// Grant this RT budget to v1 cpu cgroups that have none (`training.grant_rt_budget_us`).
    pub grant_rt_budget_us: Option<u64>,
    /// The scheduling class the job's threads get (`training.policy`; a batch enforcer's
    /// `batch.policy`).
    pub class: TrainingClass,
    /// Where Slurm jobs' cgroups are (`slurm.cgroup_paths`): `{job}` and `{uid}` templates.
    pub slurm_cgroups: Vec<String>,
    /// What lodger writes to the memory files of the job cgroups it creates itself.
    pub job_memory: JobMemory,
    /// Learn of forks, execs and exits from the kernel's process events and skip, between full
    /// sweeps, the jobs nothing happened to (`training::quiet`; issue 21). Off: every apply
    /// lists every thread, as before (the benchmark's baseline).
    pub process_events: bool,
}

/// What lodger writes to the memory files of a job cgroup it creates (`<parent>/<job>`, pid jobs
/// pinned by cgroup on cgroup v2, with the memory controller delegated to `<parent>`; issue
/// 19). A job's own cgroup, Slurm's or a container runtime's is never touched, nor is anything
/// on cgroup v1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JobMemory {
    #[default]
    Untouched,
    /// Training: `memory.low` = max, so its memory is reclaimed after unprotected memory (the
    /// ancestors' protection bounds what it gets).
    Protect,
    /// Batch jobs: `memory.max`, with `memory.high` below it.
    Limit { max: u64, high: u64 },
}

/// Where Slurm's task/cgroup plugin puts a job: cgroup v2 (Slurm 22.05 to 26.05 alike, under the
/// slurmstepd scope), then v1's cpuset hierarchy; each as upstream builds name it, then as
/// Debian's do (built for several slurmd per host, they put the node's name in: `{node}`).
/// Job directories are named by the numeric job id in every version, SLUID-era ones included.
pub const DEFAULT_SLURM_CGROUPS: &[&str] = &[
    "/system.slice/slurmstepd.scope/job_{job}",
    "/system.slice/{node}_slurmstepd.scope/job_{job}",
    "/slurm/uid_{uid}/job_{job}",
    "/slurm_{node}/uid_{uid}/job_{job}",
];

/// The scheduling class of training threads (`training.policy`, `training.role_priorities`,
/// `training.other_nice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainingClass {
    /// SCHED_RR at `rt_priority`; with `roles`, threads that mostly wait (dispatch, main) one
    /// priority above the busy ones (loaders), so a waking dispatch thread pre-empts a loader
    /// instead of queueing behind its 100 ms slice.
    Rr { roles: bool },
    /// SCHED_OTHER at this nice value.
    Other { nice: i32 },
    /// A lodger (batch jobs): never real-time; SCHED_BATCH when `sched_batch`, else the
    /// SCHED_OTHER it runs at (a real-time thread is put back to it).
    Lodger { sched_batch: bool },
}

impl Default for TrainingClass {
    fn default() -> Self {
        TrainingClass::Rr { roles: true }
    }
}

impl Default for EnforceSettings {
    fn default() -> Self {
        Self {
            cgroup_root: PathBuf::from(crate::sys::cgroupfs::DEFAULT_CGROUP_ROOT),
            proc_root: PathBuf::from(crate::sys::procfs::DEFAULT_PROC_ROOT),
            driver: CgroupDriver::Auto,
            parent: DEFAULT_PARENT.to_string(),
            pid_jobs: PidPinning::Auto,
            rt_priority: DEFAULT_RT_PRIORITY,
            allow_unthrottled_rt: false,
            grant_rt_budget_us: None,
            class: TrainingClass::default(),
            slurm_cgroups: DEFAULT_SLURM_CGROUPS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            job_memory: JobMemory::Untouched,
            process_events: true,
        }
    }
}
