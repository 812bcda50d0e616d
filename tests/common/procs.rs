//! Processes and threads the tests look at: whether one is alive, the processes lodgerd marked
//! as its instances', and each thread's scheduling policy, priority, affinity and state.

/// True while the process exists and is not a zombie (or dead) waiting to be reaped.
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x") | None)
}

/// A live process carrying the mark of the lodgerd whose parent cgroup is `parent`
/// (`LODGER_PARENT`): one of its instances or something an instance started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marked {
    pub pid: u32,
    pub pgrp: u32,
    /// `LODGER_JOB` and `LODGER_INSTANCE`.
    pub job: String,
    pub index: String,
}

/// Every live process marked for lodger cgroup `parent` (see [`Marked`]).
pub fn marked(parent: &str) -> Vec<Marked> {
    let want = parent.trim_matches('/');
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let (Ok(env), Ok(stat)) = (
            std::fs::read(entry.path().join("environ")),
            std::fs::read_to_string(entry.path().join("stat")),
        ) else {
            continue;
        };
        let var = |name: &str| {
            env.split(|&b| b == 0).find_map(|v| {
                let v = std::str::from_utf8(v).ok()?;
                v.strip_prefix(name)?.strip_prefix('=').map(str::to_string)
            })
        };
        if !var("LODGER_PARENT").is_some_and(|p| p.trim_matches('/') == want) {
            continue;
        }
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        if matches!(fields.first(), Some(&"Z" | &"X") | None) {
            continue;
        }
        out.push(Marked {
            pid,
            pgrp: fields.get(2).and_then(|p| p.parse().ok()).unwrap_or(0),
            job: var("LODGER_JOB").unwrap_or_default(),
            index: var("LODGER_INSTANCE").unwrap_or_default(),
        });
    }
    out
}

/// SIGKILL to every process [`marked`] for `parent`; returns their pids.
pub fn kill_marked(parent: &str) -> Vec<u32> {
    marked(parent)
        .into_iter()
        .map(|m| {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(m.pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            m.pid
        })
        .collect()
}

/// Thread ids of a process.
pub fn tids(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// (policy, rt priority) of a thread, from sched_getscheduler/sched_getparam.
pub fn sched_of(tid: u32) -> Option<(i32, i32)> {
    let tid = i32::try_from(tid).ok()?;
    // SAFETY: plain syscalls on a tid; a vanished tid returns -1.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy < 0 {
        return None;
    }
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, writable sched_param.
    if unsafe { libc::sched_getparam(tid, &mut param) } != 0 {
        return None;
    }
    Some((policy, param.sched_priority))
}

/// The children of process `pid`'s main thread (`/proc/PID/task/PID/children`); none when it
/// is gone.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect()
}

/// `Cpus_allowed_list` of a thread.
pub fn cpus_allowed(pid: u32, tid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|s| s.trim().to_string())
}

/// True when every thread of `pid` is SCHED_RR at `prio` on exactly `cpus` (a CPU list). With
/// `training.role_priorities` (the default) threads that mostly wait run at `prio + 1`: either
/// counts. System calls only (`sched_getaffinity`, not each thread's `status` file): the spine
/// benchmark times how soon after `RegisterJob` this holds, and its own reads are in that time.
pub fn all_rr_on(pid: u32, prio: i32, cpus: &str) -> bool {
    let Ok(want) = lodger::cpuset::CpuSet::parse(cpus) else {
        return false;
    };
    let tids = tids(pid);
    !tids.is_empty()
        && tids.iter().all(|&t| {
            matches!(sched_of(t), Some((libc::SCHED_RR, p)) if p == prio || p == prio + 1)
                && affinity(t).as_ref() == Some(&want)
        })
}

/// A thread's CPU affinity, from `sched_getaffinity`.
pub fn affinity(tid: u32) -> Option<lodger::cpuset::CpuSet> {
    let tid = i32::try_from(tid).ok()?;
    let mask = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(tid)).ok()?;
    let mut set = lodger::cpuset::CpuSet::new();
    for cpu in 0..nix::sched::CpuSet::count() {
        if mask.is_set(cpu).ok()? {
            set.insert(u32::try_from(cpu).ok()?);
        }
    }
    Some(set)
}

/// True when every thread of `pid` is SCHED_OTHER.
pub fn all_other(pid: u32) -> bool {
    tids(pid)
        .iter()
        .all(|&t| sched_of(t).map(|(p, _)| p) == Some(libc::SCHED_OTHER))
}

/// Pins every thread of `pid` to `cpus` (threads it starts later inherit it). For lodgerd run
/// with no reserved CPUs, where a test's real-time antagonist would otherwise starve it on the
/// CPU it shares: on a real node lodgerd keeps itself on the reserved CPUs.
pub fn pin_threads(pid: u32, cpus: &[u32]) {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        set.set(usize::try_from(cpu).expect("cpu"))
            .expect("cpu in range");
    }
    for tid in tids(pid) {
        let Ok(tid) = i32::try_from(tid) else {
            continue;
        };
        // A thread that exited meanwhile is fine.
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set);
    }
}

/// A thread's state for diagnostics: the CPU it last ran on, its policy and RT priority, and
/// its user and system time in clock ticks, from /proc/PID/task/TID/stat.
pub fn thread_state(pid: u32, tid: u32) -> String {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")) else {
        return format!("{tid}: gone");
    };
    let Some(close) = stat.rfind(')') else {
        return format!("{tid}: unreadable");
    };
    let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let at = |i: usize| f.get(i).copied().unwrap_or("?");
    let wchan =
        std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/wchan")).unwrap_or_default();
    format!(
        "{tid}{}: state {} (wchan {wchan}) cpu {} policy {} rt {} utime {} stime {}",
        &stat[stat.find('(').unwrap_or(0)..=close],
        at(0),
        at(36),
        at(38),
        at(37),
        at(11),
        at(12)
    )
}
