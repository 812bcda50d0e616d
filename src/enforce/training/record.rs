//! What lodger records about each training job so that it can undo what it did (persisted by the
//! store, also across a lodgerd restart). Plain data; touches nothing.

use serde::{Deserialize, Serialize};

use super::rtgroup::RtGrant;
use crate::cpuset::CpuSet;
use crate::enforce::PinMethod;

/// Everything needed to undo what lodger did to a job; persisted by the store.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct JobRecord {
    /// A job registered by cgroup.
    pub cgroup: Option<CgroupJobRecord>,
    /// A job registered by pids.
    pub pids: Option<PidJobRecord>,
    /// A Slurm job (registered by lodger's prolog).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slurm: Option<SlurmJobRecord>,
    /// RT budgets lodger granted to v1 cpu cgroups, in the order written.
    pub rt_grants: Vec<RtGrant>,
    /// A batch job's own memory limit (`JobSpec::memory_max`), for the cgroup lodger makes for
    /// it; `None`: the node's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// A job registered by pids and placed later (a batch job waits for free cores): its pids'
    /// start times when the registration was authorized. A registered pid that some other
    /// process holds by the time it is first placed (the pid was reused) is not the job's, as
    /// the caller's right to it was checked on the process that had it then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorized: Vec<RootProcess>,
}

#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct CgroupJobRecord {
    /// The job's cgroup, normalized, relative to the cpuset hierarchy.
    pub cgroup: String,
    /// Values found before lodger's first write to each cgroup (the job's first).
    pub saved: Vec<SavedCpuset>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SavedCpuset {
    pub cgroup: String,
    pub cpus: CpuSet,
    pub mems: CpuSet,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct PidJobRecord {
    pub pinning: PinMethod,
    /// Cgroup pinning: lodger's cgroup for the job, once created.
    pub cgroup: Option<String>,
    /// The registered pids, with their start times when lodger first saw them.
    pub roots: Vec<RootProcess>,
    /// Registered pids that were not running when lodger first saw them: a process that gets
    /// such a pid later is not the job's.
    pub missing_roots: Vec<u32>,
    /// Every process of the job seen alive at the last apply, sorted by pid.
    pub processes: Vec<TrackedProcess>,
    /// Processes were moved at the last apply: scan /proc once more for children forked meanwhile.
    pub rescan: bool,
    /// Affinity pinning: the mask lodger last pinned the job to. A child first seen with it
    /// inherited it, after a move too (absent from older state files: `None`).
    pub pinned: Option<CpuSet>,
    /// Affinity pinning: the masks lodger pinned the job to before `pinned` ([`PidJobRecord::was_pinned`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pinned_before: Vec<CpuSet>,
}

impl Default for PidJobRecord {
    fn default() -> Self {
        Self {
            pinning: PinMethod::Affinity,
            cgroup: None,
            roots: Vec::new(),
            missing_roots: Vec::new(),
            processes: Vec::new(),
            rescan: false,
            pinned: None,
            pinned_before: Vec::new(),
        }
    }
}

/// A Slurm job: where its cgroup was found and the processes pinned in it.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct SlurmJobRecord {
    /// The job's cgroup once found; its removal then ends the job.
    pub cgroup: Option<String>,
    /// Its processes at the last apply, sorted by pid, with the masks to give back.
    pub processes: Vec<TrackedProcess>,
    /// The CPUs its unbound processes were last pinned to: on release, a process lodger never
    /// saw that still has this mask got it from one it pinned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<CpuSet>,
    /// The masks its unbound processes were pinned to before `pinned` ([`SlurmJobRecord::was_pinned`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pinned_before: Vec<CpuSet>,
}

/// How many earlier masks a job's record keeps ([`PidJobRecord::was_pinned`]). A process carrying an
/// earlier mask was forked during the apply that moved the job away from it, from a thread not
/// yet moved, and is seen at the next apply (a fork is a process event; the safety-net sweep
/// finds it otherwise): a few moves back is enough, and a job right-sized for hours keeps a
/// bounded record.
pub const PINNED_KEPT: usize = 8;

/// The masks lodger pinned a job's processes to, by CPU affinity: the last (`pinned`) and the
/// ones before it (`before`, oldest first, at most [`PINNED_KEPT`]). A process first seen with
/// any of them got it from a process lodger pinned, not from its user: forked after a pin, or
/// during a move from a thread the move had not reached yet (it keeps the old mask until the
/// next apply). Such a process's own mask is its parent's, and at release it is given that
/// back, not a set of CPUs lodger once chose.
fn was_pinned(pinned: &Option<CpuSet>, before: &[CpuSet], mask: &CpuSet) -> bool {
    pinned.as_ref() == Some(mask) || before.contains(mask)
}

/// `mask` is what lodger pins the job to from now on; the mask it replaces is kept in `before`
/// (see [`was_pinned`]).
fn note_pinned(pinned: &mut Option<CpuSet>, before: &mut Vec<CpuSet>, mask: &CpuSet) {
    if pinned.as_ref() == Some(mask) {
        return;
    }
    before.retain(|m| m != mask);
    if let Some(old) = pinned.replace(mask.clone()) {
        before.push(old);
    }
    let excess = before.len().saturating_sub(PINNED_KEPT);
    before.drain(..excess);
}

impl PidJobRecord {
    /// Whether lodger pinned the job to `mask`, last or before: a process first seen with any
    /// of them got it from a process lodger pinned, not from its user.
    pub fn was_pinned(&self, mask: &CpuSet) -> bool {
        was_pinned(&self.pinned, &self.pinned_before, mask)
    }

    /// Lodger pins the job to `mask` from now on; the mask it replaces is kept (each once, at
    /// most [`PINNED_KEPT`]).
    pub fn note_pinned(&mut self, mask: &CpuSet) {
        note_pinned(&mut self.pinned, &mut self.pinned_before, mask);
    }
}

impl SlurmJobRecord {
    /// Whether lodger pinned the job's unbound processes to `mask`, last or before.
    pub fn was_pinned(&self, mask: &CpuSet) -> bool {
        was_pinned(&self.pinned, &self.pinned_before, mask)
    }

    /// Lodger pins the job's unbound processes to `mask` from now on.
    pub fn note_pinned(&mut self, mask: &CpuSet) {
        note_pinned(&mut self.pinned, &mut self.pinned_before, mask);
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootProcess {
    pub pid: u32,
    pub start_time: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TrackedProcess {
    pub pid: u32,
    /// From `/proc/PID/stat`: a reused pid has another start time.
    pub start_time: u64,
    pub ppid: u32,
    /// Cgroup pinning: its cpuset cgroup before lodger moved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_cgroup: Option<String>,
    /// v1 batch jobs with a memory limit: its memory cgroup before lodger moved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_memory_cgroup: Option<String>,
    /// Affinity pinning: its CPU mask before lodger set one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_affinity: Option<CpuSet>,
    /// Bound by its user (or Slurm's task/affinity) more narrowly than its job's cpuset: lodger
    /// keeps the binding and sets only the scheduling class.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bound: bool,
}
