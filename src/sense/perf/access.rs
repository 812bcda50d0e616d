//! What the kernel lets lodgerd count (`perf_event_paranoid`, this process's capabilities) and
//! the file-descriptor budget perf counters may use (`self/limits`). Reads only the proc root it
//! is given.

use std::io;
use std::path::Path;

use serde::Serialize;

use super::{
    PerfError, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE, FD_RESERVE, PARANOID_FILE, SELF_LIMITS,
    SELF_STATUS,
};

/// What the kernel lets this process count, from `perf_event_paranoid` and its capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PerfAccess {
    /// `None`: the file is missing, the kernel has no perf events.
    pub paranoid: Option<i32>,
    pub cap_perfmon: bool,
    pub cap_sys_admin: bool,
    pub cap_sys_ptrace: bool,
}

impl PerfAccess {
    /// Reads `sys/kernel/perf_event_paranoid` and `self/status` under the proc root.
    pub fn read(proc_root: &Path) -> Result<PerfAccess, PerfError> {
        let paranoid_path = proc_root.join(PARANOID_FILE);
        let paranoid = match std::fs::read_to_string(&paranoid_path) {
            Ok(text) => Some(text.trim().parse::<i32>().map_err(|_| PerfError::Parse {
                path: paranoid_path.clone(),
                value: text.clone(),
            })?),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(PerfError::Read {
                    path: paranoid_path,
                    source,
                })
            }
        };
        let status_path = proc_root.join(SELF_STATUS);
        let status = std::fs::read_to_string(&status_path).map_err(|source| PerfError::Read {
            path: status_path.clone(),
            source,
        })?;
        let cap_eff = parse_cap_eff(&status).ok_or_else(|| PerfError::Parse {
            path: status_path,
            value: status
                .lines()
                .find(|l| l.starts_with("CapEff"))
                .unwrap_or("no CapEff line")
                .to_string(),
        })?;
        let has = |cap: u32| cap_eff & (1u64 << cap) != 0;
        Ok(PerfAccess {
            paranoid,
            cap_perfmon: has(CAP_PERFMON),
            cap_sys_admin: has(CAP_SYS_ADMIN),
            cap_sys_ptrace: has(CAP_SYS_PTRACE),
        })
    }

    /// CAP_PERFMON (5.8+) or CAP_SYS_ADMIN bypass `perf_event_paranoid`.
    pub fn privileged(&self) -> bool {
        self.cap_perfmon || self.cap_sys_admin
    }

    /// Counting this process's own user's threads (paranoid ≤ 2; Debian's 3 forbids it).
    pub fn can_count_processes(&self) -> bool {
        self.paranoid.is_some_and(|p| self.privileged() || p <= 2)
    }

    /// Other users' processes: `perf_check_permission` lets CAP_PERFMON (or CAP_SYS_ADMIN)
    /// through, else it needs ptrace read access to them (CAP_SYS_PTRACE).
    pub fn can_count_other_users(&self) -> bool {
        self.can_count_processes() && (self.privileged() || self.cap_sys_ptrace)
    }

    /// Cgroup events are CPU-wide events: paranoid ≤ 0 or privileged.
    pub fn can_count_cgroups(&self) -> bool {
        self.paranoid.is_some_and(|p| self.privileged() || p <= 0)
    }

    pub fn can_count_kernel(&self) -> bool {
        self.paranoid.is_some_and(|p| self.privileged() || p <= 1)
    }

    /// What is not possible and how to make it possible; empty when everything is.
    pub fn problems(&self, include_kernel: bool) -> Vec<String> {
        let Some(p) = self.paranoid else {
            return vec![format!(
                "/proc/{PARANOID_FILE} is missing: this kernel has no perf events \
                 (CONFIG_PERF_EVENTS); IPC and cache-miss sensing are off"
            )];
        };
        let mut out = Vec::new();
        if !self.can_count_processes() {
            out.push(format!(
                "kernel.perf_event_paranoid={p} forbids perf_event_open to unprivileged processes: \
                 run lodgerd as root, grant it CAP_PERFMON (AmbientCapabilities=CAP_PERFMON in \
                 the unit; kernel 5.8+), or `sysctl kernel.perf_event_paranoid=2`"
            ));
            return out;
        }
        if !self.can_count_cgroups() {
            out.push(format!(
                "kernel.perf_event_paranoid={p} without CAP_PERFMON/CAP_SYS_ADMIN: jobs registered \
                 by cgroup cannot be counted (cgroup events are CPU-wide); grant CAP_PERFMON \
                 (kernel 5.8+, CAP_SYS_ADMIN before) or `sysctl kernel.perf_event_paranoid=0`"
            ));
        }
        if !self.can_count_other_users() {
            out.push(
                "neither CAP_PERFMON nor CAP_SYS_PTRACE: processes of other users cannot be \
                 counted; run lodgerd as root or add CAP_PERFMON to AmbientCapabilities="
                    .to_string(),
            );
        }
        if include_kernel && !self.can_count_kernel() {
            out.push(format!(
                "kernel.perf_event_paranoid={p} without CAP_PERFMON: kernel-mode counting is \
                 refused; grant CAP_PERFMON or `sysctl kernel.perf_event_paranoid=1`"
            ));
        }
        out
    }
}

/// The effective capability mask from `/proc/PID/status`.
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// The soft "Max open files" limit from `/proc/PID/limits` (`None` for unlimited).
pub fn parse_nofile_soft(limits: &str) -> Option<Option<u64>> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    let soft = rest.split_ascii_whitespace().next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

/// Perf file descriptors allowed and held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FdBudget {
    pub cap: usize,
    pub used: usize,
}

impl FdBudget {
    /// The cap for a process whose soft RLIMIT_NOFILE is `soft` (`None`: unlimited).
    pub fn for_limit(soft: Option<u64>) -> FdBudget {
        let soft = soft.map_or(usize::MAX, |s| usize::try_from(s).unwrap_or(usize::MAX));
        let reserve = (soft / 2).min(FD_RESERVE);
        FdBudget {
            cap: soft - reserve,
            used: 0,
        }
    }

    /// Reads the soft RLIMIT_NOFILE from `self/limits` under the proc root.
    pub fn from_proc(proc_root: &Path) -> Result<FdBudget, PerfError> {
        let path = proc_root.join(SELF_LIMITS);
        let text = std::fs::read_to_string(&path).map_err(|source| PerfError::Read {
            path: path.clone(),
            source,
        })?;
        let soft = parse_nofile_soft(&text).ok_or_else(|| PerfError::Parse {
            path,
            value: text
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .unwrap_or("no 'Max open files' line")
                .to_string(),
        })?;
        Ok(FdBudget::for_limit(soft))
    }

    pub fn available(&self) -> usize {
        self.cap.saturating_sub(self.used)
    }

    /// Fds to count `units` threads or CPUs with `events` events each: one fd per event per unit
    /// (a group's leader is one of its events). The cgroup directory's fd is closed after opening.
    pub fn fds_for(units: usize, events: usize) -> usize {
        units.saturating_mul(events)
    }
}
