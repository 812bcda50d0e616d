//! The host's cpuset hierarchy and CPUs as the tests see them: cgroup paths and removal, the
//! online CPUs, and the CPUs left to jobs by a reserved list.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lodger::privileged::{cpuset_root, host_cgroup, need_cpus, HostCgroup};

/// Removes the (empty) cgroup `rel` and the empty cgroups under it, deepest first, in the cpuset
/// hierarchy of this host's mode (v1: /sys/fs/cgroup/cpuset, v2: /sys/fs/cgroup). Returns whether
/// `rel` is gone.
///
/// A killed process leaves `cgroup.procs` before it has finished exiting (once its last thread
/// is past `exit_signals`), and its cgroup stays populated, so rmdir answers EBUSY, until
/// `cgroup_exit`: each rmdir that answers EBUSY is tried again for up to 10 s.
pub fn remove_cgroup_tree(rel: &str) -> bool {
    fn remove(dir: &Path, deadline: Instant) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    remove(&e.path(), deadline);
                }
            }
        }
        loop {
            match std::fs::remove_dir(dir) {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => return,
            }
        }
    }
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        return false;
    }
    let dir = cpuset_root().join(rel);
    remove(&dir, Instant::now() + Duration::from_secs(10));
    !dir.exists()
}

/// The cgroup of `pid` that holds its cpuset: the `cpuset` line of /proc/PID/cgroup on v1, the
/// `0::` line on v2. A path within the hierarchy (`/a/b`).
pub fn cpuset_cgroup_of(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let v2 = host_cgroup() == HostCgroup::V2;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let hit = if v2 {
            id == "0" && controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == "cpuset")
        };
        hit.then(|| path.to_string())
    })
}

/// The file at the hierarchy root that lists the node's memory nodes (what a new cpuset
/// cgroup's `cpuset.mems` is set to).
pub fn mems_file() -> &'static str {
    match host_cgroup() {
        HostCgroup::V2 => "cpuset.mems.effective",
        _ => "cpuset.mems",
    }
}

/// The directory of cgroup `rel` in this host's cpuset hierarchy.
pub fn cgroup_path(rel: &str) -> PathBuf {
    cpuset_root().join(rel.trim_start_matches('/'))
}

/// The online CPUs as a set.
pub fn online_set() -> lodger::cpuset::CpuSet {
    lodger::cpuset::CpuSet::parse(&online_cpus()).expect("online cpu list")
}

/// Parses a CPU list the test got from lodger or the kernel.
pub fn cpus(list: &str) -> lodger::cpuset::CpuSet {
    lodger::cpuset::CpuSet::parse(list).unwrap_or_else(|e| panic!("cpu list '{list}': {e}"))
}

/// The CPUs jobs may use given lodgerd's `reserved` list: the online CPUs less the reserved.
pub fn job_cpus(reserved: &str) -> lodger::cpuset::CpuSet {
    online_set().difference(&cpus(reserved))
}

/// A shape pinned to two CPUs for jobs whatever the host has: the reserved list that leaves
/// exactly the two highest online CPUs to jobs (empty on a 2-CPU host), and those two CPUs.
/// For tests whose figures (instances per CPU, halving 2 -> 1, right-sizing 1 <-> 2 cores) are
/// about two job CPUs. None (recorded as not applicable) on a host with fewer than two CPUs.
pub fn two_job_cpus(test: &str) -> Option<(&'static str, [u32; 2])> {
    if !need_cpus(test, 2) {
        return None;
    }
    let online: Vec<u32> = online_set().iter().collect();
    let (rest, two) = online.split_at(online.len() - 2);
    let mut reserved = lodger::cpuset::CpuSet::new();
    for &c in rest {
        reserved.insert(c);
    }
    // Leaked: one short string per test, for `DaemonOptions::reserved`.
    let reserved: &'static str = Box::leak(reserved.to_list().into_boxed_str());
    Some((reserved, [two[0], two[1]]))
}

pub fn online_cpus() -> String {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .expect("online cpus")
        .trim()
        .to_string()
}
