//! Per-thread scheduling: SCHED_RR (Cloud Reamer §III-A: training threads in the RT class pre-empt
//! the offline inference sharing their cores; round-robin so no training thread monopolizes a core),
//! CPU affinity masks, and the node's RT throttling sysctl. Touches sched_setscheduler,
//! sched_setaffinity and `<proc>/sys/kernel/sched_rt_runtime_us`.
//!
//! `sched_setscheduler` comes from libc (nix 0.31 has none). Affinity also goes through libc with
//! lodger's own mask: nix's `CpuSet` is a fixed 1024-bit `cpu_set_t`, and lodger accepts CPU ids up
//! to [`crate::cpuset::MAX_CPU_ID`].

use std::io;
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use crate::cpuset::{CpuSet, MAX_CPU_ID};

/// `<proc>/` + this: the RT throttling budget of the whole node, -1 when unthrottled.
pub const SCHED_RT_RUNTIME_SYSCTL: &str = "sys/kernel/sched_rt_runtime_us";
/// OR-ed into the policy `sched_getscheduler` returns when the thread's children start non-RT.
pub const SCHED_RESET_ON_FORK: i32 = 0x4000_0000;

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error(
        "kernel.sched_rt_runtime_us is -1 ({file}): SCHED_RR threads would not be throttled and \
         could starve the node, so lodger refuses SCHED_RR. Allow it with \
         `training.allow_unthrottled_rt = true`, or give RT tasks a budget again \
         (`sysctl kernel.sched_rt_runtime_us=950000`)"
    )]
    RtUnthrottled { file: PathBuf },
    #[error(
        "threads cannot become SCHED_RR: their cpu cgroup has no real-time budget ({file} is 0). \
         Write a budget to it (after its ancestors, whose budgets must cover it), e.g. \
         `echo 100000 > {file}`, or let lodger do it with `training.grant_rt_budget_us = 100000`"
    )]
    RtGroupBudget { file: PathBuf },
    #[error("cannot grant a real-time budget: writing '{value}' to {file} failed: {source}")]
    GrantBudget {
        file: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("cannot set SCHED_RR priority {priority} on thread {tid}: {errno}{hint}")]
    SetScheduler {
        tid: u32,
        priority: i32,
        errno: Errno,
        hint: &'static str,
    },
    #[error("cannot set nice {nice} on thread {tid}: {errno}")]
    SetNice { tid: u32, nice: i32, errno: Errno },
    #[error("cannot set SCHED_OTHER on thread {tid}: {errno}")]
    Revert { tid: u32, errno: Errno },
    #[error("cannot read the scheduling policy of thread {tid}: {errno}")]
    GetScheduler { tid: u32, errno: Errno },
    #[error("cannot set CPU affinity {cpus} on thread {tid}: {errno}")]
    SetAffinity {
        tid: u32,
        cpus: String,
        errno: Errno,
    },
    #[error("cannot read the CPU affinity of thread {tid}: {errno}")]
    GetAffinity { tid: u32, errno: Errno },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: unexpected content '{content}'")]
    Parse { path: PathBuf, content: String },
    #[error("rt_priority {priority} is outside SCHED_RR's range {min}..={max}")]
    BadPriority { priority: i32, min: i32, max: i32 },
    #[error("cannot write '{value}' to {path}: {source}")]
    SetOomScore {
        path: PathBuf,
        value: i32,
        source: io::Error,
    },
}

/// A lodger's `oom_score_adj` (issue 19): the OOM killer takes it before any training process.
pub const LODGER_OOM_SCORE_ADJ: i32 = 1000;

/// Makes process `pid`'s `oom_score_adj` `value` (under `proc_root`). `Ok(None)`: the process
/// is gone; else whether it was written.
pub fn ensure_oom_score(
    proc_root: &Path,
    pid: u32,
    value: i32,
) -> Result<Option<bool>, SchedError> {
    let path = proc_root.join(pid.to_string()).join("oom_score_adj");
    let current = match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse::<i32>().ok(),
        Err(e) if crate::sys::procfs::is_gone(&e) => return Ok(None),
        Err(source) => return Err(SchedError::Read { path, source }),
    };
    if current == Some(value) {
        return Ok(Some(false));
    }
    match std::fs::write(&path, value.to_string()) {
        Ok(()) => Ok(Some(true)),
        Err(e) if crate::sys::procfs::is_gone(&e) => Ok(None),
        Err(source) => Err(SchedError::SetOomScore {
            path,
            value,
            source,
        }),
    }
}

/// Gives back what [`ensure_oom_score`] set: 0 where the process still has `set` (a value
/// its owner chose since is theirs).
pub fn revert_oom_score(proc_root: &Path, pid: u32, set: i32) -> Result<(), SchedError> {
    let path = proc_root.join(pid.to_string()).join("oom_score_adj");
    match std::fs::read_to_string(&path) {
        Ok(text) if text.trim().parse::<i32>().ok() == Some(set) => {
            ensure_oom_score(proc_root, pid, 0).map(drop)
        }
        Ok(_) => Ok(()),
        Err(e) if crate::sys::procfs::is_gone(&e) => Ok(()),
        Err(source) => Err(SchedError::Read { path, source }),
    }
}

/// SCHED_RR's priority range on this kernel, asked once (it is fixed: a sweep asked for it for
/// every thread, two system calls each).
pub fn rr_priority_range() -> (i32, i32) {
    static RANGE: std::sync::OnceLock<(i32, i32)> = std::sync::OnceLock::new();
    *RANGE.get_or_init(|| {
        // SAFETY: plain system calls without pointers.
        let (min, max) = unsafe {
            (
                libc::sched_get_priority_min(libc::SCHED_RR),
                libc::sched_get_priority_max(libc::SCHED_RR),
            )
        };
        if min < 0 || max < 0 {
            (1, 99)
        } else {
            (min, max)
        }
    })
}

pub fn check_priority(priority: i32) -> Result<(), SchedError> {
    let (min, max) = rr_priority_range();
    if priority < min || priority > max {
        return Err(SchedError::BadPriority { priority, min, max });
    }
    Ok(())
}

/// `kernel.sched_rt_runtime_us` under `proc_root`; `None` when the file does not exist.
pub fn node_rt_runtime_us(proc_root: &Path) -> Result<Option<i64>, SchedError> {
    let path = proc_root.join(SCHED_RT_RUNTIME_SYSCTL);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(SchedError::Read { path, source }),
    };
    text.trim()
        .parse()
        .map(Some)
        .map_err(|_| SchedError::Parse {
            path,
            content: text.trim().to_string(),
        })
}

/// Whether lodger refuses SCHED_RR on this node now: RT throttling is off
/// (`kernel.sched_rt_runtime_us` is -1) and `training.allow_unthrottled_rt` (`allow`) is not
/// set. Lodger's sweep and the NRI adjustment judge by this one rule.
pub fn unthrottled_rt_refused(allow: bool, proc_root: &Path) -> Result<bool, SchedError> {
    Ok(!allow && node_rt_runtime_us(proc_root)? == Some(-1))
}

fn pid_t(tid: u32) -> Result<libc::pid_t, Errno> {
    libc::pid_t::try_from(tid).map_err(|_| Errno::ESRCH)
}

/// A thread's policy (without `SCHED_RESET_ON_FORK`) and RT priority.
pub fn policy_of(tid: u32) -> Result<(i32, i32), Errno> {
    let pid = pid_t(tid)?;
    // SAFETY: no pointers; the kernel checks the pid.
    let policy = unsafe { libc::sched_getscheduler(pid) };
    if policy < 0 {
        return Err(Errno::last());
    }
    let mut param = zeroed_param();
    // SAFETY: `param` is a valid, writable sched_param for the duration of the call.
    let rc = unsafe { libc::sched_getparam(pid, &mut param) };
    if rc < 0 {
        return Err(Errno::last());
    }
    Ok((policy & !SCHED_RESET_ON_FORK, param.sched_priority))
}

fn zeroed_param() -> libc::sched_param {
    // SAFETY: sched_param is plain integers (one on glibc, padding on musl): all-zero is valid.
    unsafe { std::mem::zeroed() }
}

fn set_policy(tid: u32, policy: i32, priority: i32) -> Result<(), Errno> {
    let pid = pid_t(tid)?;
    let mut param = zeroed_param();
    param.sched_priority = priority;
    // SAFETY: `param` is a valid sched_param that outlives the call; the kernel checks the pid.
    let rc = unsafe { libc::sched_setscheduler(pid, policy, &param) };
    if rc < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// What [`needs_rr`] or [`set_rr`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RrState {
    /// Already SCHED_RR at the priority: nothing written.
    Already,
    /// Switched to SCHED_RR.
    Changed,
    /// The thread exited.
    Gone,
}

/// True when `(policy, priority)` is SCHED_RR at `priority`.
pub fn is_rr(state: (i32, i32), priority: i32) -> bool {
    state.0 == libc::SCHED_RR && state.1 == priority
}

/// Whether a thread needs [`set_rr`]: `Ok(None)` when it does, `Some(Already)` when it is
/// SCHED_RR at `priority`, `Some(Gone)` when it exited.
pub fn needs_rr(tid: u32, priority: i32) -> Result<Option<RrState>, SchedError> {
    match policy_of(tid) {
        Ok(state) if is_rr(state, priority) => Ok(Some(RrState::Already)),
        Ok(_) => Ok(None),
        Err(Errno::ESRCH) => Ok(Some(RrState::Gone)),
        Err(errno) => Err(SchedError::GetScheduler { tid, errno }),
    }
}

/// `sched_setscheduler(SCHED_RR)`; `Err` is the errno (EPERM is for the caller to explain).
pub fn set_rr(tid: u32, priority: i32) -> Result<RrState, Errno> {
    match set_policy(tid, libc::SCHED_RR, priority) {
        Ok(()) => Ok(RrState::Changed),
        Err(Errno::ESRCH) => Ok(RrState::Gone),
        Err(e) => Err(e),
    }
}

/// Returns an RR thread to SCHED_OTHER (its nice value is kept). Threads under another policy
/// were not set by lodger and are left alone. `Ok(true)` when something was written.
pub fn revert_rr(tid: u32) -> Result<bool, SchedError> {
    match policy_of(tid) {
        Ok((policy, _)) if policy == libc::SCHED_RR => {}
        Ok(_) | Err(Errno::ESRCH) => return Ok(false),
        Err(errno) => return Err(SchedError::GetScheduler { tid, errno }),
    }
    match set_policy(tid, libc::SCHED_OTHER, 0) {
        Ok(()) => Ok(true),
        Err(Errno::ESRCH) => Ok(false),
        Err(errno) => Err(SchedError::Revert { tid, errno }),
    }
}

/// A lodger's thread: never real-time; with `sched_batch` SCHED_BATCH, else the SCHED_OTHER a
/// real-time or SCHED_BATCH thread is put back to (SCHED_IDLE, the owner's choice, is kept).
/// Nice values are kept. `Ok(None)` when the thread exited, else whether something was written.
pub fn ensure_lodger(tid: u32, sched_batch: bool) -> Result<Option<bool>, SchedError> {
    let policy = match policy_of(tid) {
        Ok((policy, _)) => policy,
        Err(Errno::ESRCH) => return Ok(None),
        Err(errno) => return Err(SchedError::GetScheduler { tid, errno }),
    };
    let want = if sched_batch {
        libc::SCHED_BATCH
    } else {
        libc::SCHED_OTHER
    };
    // SCHED_IDLE, and without `sched_batch` SCHED_BATCH, are the owner's own choice: lower
    // already than what lodger would give.
    let keep = policy == want
        || policy == libc::SCHED_IDLE
        || (policy == libc::SCHED_BATCH && !sched_batch);
    if keep {
        return Ok(Some(false));
    }
    match set_policy(tid, want, 0) {
        Ok(()) => Ok(Some(true)),
        Err(Errno::ESRCH) => Ok(None),
        Err(errno) => Err(SchedError::Revert { tid, errno }),
    }
}

/// Returns a SCHED_BATCH thread (set by [`ensure_lodger`]) to SCHED_OTHER, nice kept.
pub fn revert_batch(tid: u32) -> Result<bool, SchedError> {
    match policy_of(tid) {
        Ok((policy, _)) if policy == libc::SCHED_BATCH => {}
        Ok(_) | Err(Errno::ESRCH) => return Ok(false),
        Err(errno) => return Err(SchedError::GetScheduler { tid, errno }),
    }
    match set_policy(tid, libc::SCHED_OTHER, 0) {
        Ok(()) => Ok(true),
        Err(Errno::ESRCH) => Ok(false),
        Err(errno) => Err(SchedError::Revert { tid, errno }),
    }
}

/// A thread's nice value (`getpriority(PRIO_PROCESS, tid)`).
pub fn nice_of(tid: u32) -> Result<i32, Errno> {
    let id = libc::id_t::try_from(tid).map_err(|_| Errno::ESRCH)?;
    Errno::clear();
    // SAFETY: no pointers; the kernel checks the id. -1 is a valid nice value: errno tells.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, id) };
    if nice == -1 && Errno::last_raw() != 0 {
        return Err(Errno::last());
    }
    Ok(nice)
}

/// Sets a thread's nice value (`setpriority(PRIO_PROCESS, tid, nice)`).
pub fn set_nice(tid: u32, nice: i32) -> Result<(), Errno> {
    let id = libc::id_t::try_from(tid).map_err(|_| Errno::ESRCH)?;
    // SAFETY: no pointers; the kernel checks the id and the value.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, id, nice) };
    if rc < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Affinity

/// Words in a [`CpuMask`]: enough bits for every id a [`CpuSet`] accepts.
pub const MASK_WORDS: usize = (MAX_CPU_ID as usize + 1).div_ceil(64);

/// A thread's CPU affinity mask in the kernel's layout (bit n of word n/64 = CPU n).
#[derive(Clone, PartialEq, Eq)]
pub struct CpuMask([u64; MASK_WORDS]);

impl std::fmt::Debug for CpuMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuMask({})", self.to_cpuset())
    }
}

impl CpuMask {
    pub fn empty() -> Self {
        Self([0; MASK_WORDS])
    }

    pub fn from_cpuset(set: &CpuSet) -> Self {
        let mut m = Self::empty();
        for cpu in set {
            let (w, b) = ((cpu / 64) as usize, cpu % 64);
            if let Some(word) = m.0.get_mut(w) {
                *word |= 1u64 << b;
            }
        }
        m
    }

    pub fn to_cpuset(&self) -> CpuSet {
        let mut set = CpuSet::new();
        for (base, &word) in (0u32..).step_by(64).zip(self.0.iter()) {
            let mut bits = word;
            while bits != 0 {
                set.insert(base + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        set
    }

    /// The affinity of a thread; `Err(ESRCH)` when it is gone.
    pub fn of_thread(tid: u32) -> Result<Self, Errno> {
        let pid = pid_t(tid)?;
        let mut m = Self::empty();
        // SAFETY: the buffer is `size_of_val(&m.0)` writable bytes, u64-aligned (at least
        // cpu_set_t's alignment); glibc passes the size to the kernel, which writes at most that.
        let rc = unsafe {
            libc::sched_getaffinity(
                pid,
                std::mem::size_of_val(&m.0),
                m.0.as_mut_ptr().cast::<libc::cpu_set_t>(),
            )
        };
        if rc < 0 {
            return Err(Errno::last());
        }
        Ok(m)
    }

    /// Sets this mask as a thread's affinity.
    pub fn apply_to(&self, tid: u32) -> Result<(), Errno> {
        let pid = pid_t(tid)?;
        // SAFETY: the buffer is `size_of_val(&self.0)` readable bytes; the kernel reads at most
        // that many.
        let rc = unsafe {
            libc::sched_setaffinity(
                pid,
                std::mem::size_of_val(&self.0),
                self.0.as_ptr().cast::<libc::cpu_set_t>(),
            )
        };
        if rc < 0 {
            return Err(Errno::last());
        }
        Ok(())
    }
}

/// What [`ensure_affinity`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityState {
    Already,
    Changed,
    Gone,
}

/// Sets a thread's affinity to `want` unless it is already that. `Changed` only when the
/// thread's affinity changed: the kernel narrows a mask to the CPUs the thread's cpuset allows
/// (a Slurm step, a container), and a thread already on that narrower mask is `Already`, so a
/// caller that repeats until nothing changes (`Host::pin_tree`) or reports a change each sweep
/// does not take every such thread for a new move.
pub fn ensure_affinity(tid: u32, want: &CpuMask) -> Result<AffinityState, SchedError> {
    let before = match CpuMask::of_thread(tid) {
        Ok(m) if &m == want => return Ok(AffinityState::Already),
        Ok(m) => m,
        Err(Errno::ESRCH) => return Ok(AffinityState::Gone),
        Err(errno) => return Err(SchedError::GetAffinity { tid, errno }),
    };
    match want.apply_to(tid) {
        Ok(()) => match CpuMask::of_thread(tid) {
            Ok(now) if now == before => Ok(AffinityState::Already),
            // Gone meanwhile, or unreadable: it was set, so count it as a change.
            _ => Ok(AffinityState::Changed),
        },
        Err(Errno::ESRCH) => Ok(AffinityState::Gone),
        Err(errno) => Err(SchedError::SetAffinity {
            tid,
            cpus: want.to_cpuset().to_string(),
            errno,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_round_trips_cpusets() {
        for list in ["", "0", "0-1", "63-65", "0,8191", "5,100-130"] {
            let set = CpuSet::parse(list).expect("list");
            assert_eq!(CpuMask::from_cpuset(&set).to_cpuset(), set, "{list}");
        }
    }

    #[test]
    fn reads_own_policy_and_affinity() {
        let tid = nix::unistd::gettid().as_raw() as u32;
        let (policy, _) = policy_of(tid).expect("own policy");
        assert!(policy >= 0);
        let mask = CpuMask::of_thread(tid).expect("own affinity");
        assert!(!mask.to_cpuset().is_empty());
        assert_eq!(
            ensure_affinity(tid, &mask).expect("same"),
            AffinityState::Already
        );
    }

    /// A mask naming a CPU the machine does not have is narrowed by the kernel to the CPUs
    /// that exist: a thread already on what is left is not moved again (`Already`), so a
    /// caller repeating until nothing changes ends. On a thread of its own, so the test's
    /// affinity is not the harness's.
    #[test]
    fn a_mask_the_kernel_narrows_is_not_a_change_once_applied() {
        let result = std::thread::spawn(|| {
            let tid = nix::unistd::gettid().as_raw() as u32;
            let mine = CpuMask::of_thread(tid).expect("own affinity").to_cpuset();
            let first = mine.first().expect("a CPU");
            let one = CpuMask::from_cpuset(&CpuSet::parse(&first.to_string()).expect("cpu"));
            let first_state = ensure_affinity(tid, &one).expect("to one CPU");
            // 8191: the mask's last CPU, which no machine here has.
            let wide = CpuSet::parse(&format!("{first},8191")).expect("cpus");
            let wide_state = ensure_affinity(tid, &CpuMask::from_cpuset(&wide)).expect("wide");
            let now = CpuMask::of_thread(tid).expect("affinity").to_cpuset();
            (mine.len(), first_state, wide_state, now, first)
        })
        .join()
        .expect("thread");
        let (cpus, first_state, wide_state, now, first) = result;
        let expected = if cpus > 1 {
            AffinityState::Changed
        } else {
            AffinityState::Already
        };
        assert_eq!(first_state, expected);
        assert_eq!(wide_state, AffinityState::Already);
        assert_eq!(now.to_string(), first.to_string());
    }

    #[test]
    fn rt_runtime_sysctl_reads_fake_roots() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            node_rt_runtime_us(dir.path()).expect("missing is none"),
            None
        );
        let file = dir.path().join(SCHED_RT_RUNTIME_SYSCTL);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(&file, "-1\n").expect("write");
        assert_eq!(node_rt_runtime_us(dir.path()).expect("reads"), Some(-1));
        std::fs::write(&file, "lots\n").expect("write");
        assert!(matches!(
            node_rt_runtime_us(dir.path()),
            Err(SchedError::Parse { .. })
        ));
    }

    #[test]
    fn priority_range_is_checked() {
        assert!(check_priority(10).is_ok());
        assert!(check_priority(0).is_err());
        assert!(check_priority(100).is_err());
    }
}
