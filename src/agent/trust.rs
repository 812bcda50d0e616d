//! The trust boundary's rules for what a registration may name (docs/security.md): the
//! processes and cgroups a caller owns, what nobody may hand to lodger (pid 1, kernel threads,
//! lodgerd and its ancestors, lodger's own cgroups), and the per-owner caps. Reads `/proc` and
//! cgroupfs; changes nothing.

use std::path::{Path, PathBuf};

use super::{AgentError, Caller};
use crate::job::{Job, JobSpec, Target};

/// `PF_KTHREAD` in `/proc/PID/stat`'s flags (field 9): the task is a kernel thread.
const PF_KTHREAD: u64 = 0x0020_0000;
/// kthreadd: the parent of every kernel thread.
const KTHREADD: u32 = 2;
/// How deep a cgroup subtree is walked when looking for whose processes it holds.
const MAX_CGROUP_DEPTH: usize = 32;
/// How many processes of a cgroup subtree are looked at, at most (a bound on the work one
/// registration can ask for; a subtree with more is refused).
const MAX_CGROUP_PROCS: usize = 65_536;
/// How many cgroups of a subtree are looked at, at most: empty ones cost a listing each, and a
/// member may make thousands in a subtree delegated to them.
const MAX_CGROUP_DIRS: usize = 4_096;

/// What the operator decides about trust (`[api]`), and where lodger's own cgroups are.
#[derive(Debug, Clone)]
pub struct TrustSettings {
    /// The directory a job's cgroup path is relative to (the v2 root, or v1's cpuset hierarchy).
    pub cgroup_dir: PathBuf,
    /// `api.cgroup_roots`: subtrees of `/system.slice` members may register cgroups in.
    pub cgroup_roots: Vec<String>,
    /// lodger's own cgroup (`/` + `cgroup.parent`): never a job.
    pub lodger_cgroup: String,
    /// `api.max_jobs_per_owner`.
    pub max_jobs_per_owner: u32,
    /// `api.max_instances_per_owner`.
    pub max_instances_per_owner: u32,
    /// `inference.memory_max` resolved on this node: each instance's memory limit, and the most
    /// a job may ask for (`None`: unbounded).
    pub instance_memory_max: Option<u64>,
    /// `batch.memory_max` resolved on this node: a batch job's memory limit, and the most one
    /// may ask for (`None`: batch jobs get none, so none may ask for one).
    pub batch_memory_max: Option<u64>,
    /// `slurm.cgroup_paths`: where Slurm's job cgroups are (`{job}`, `{uid}`, `{node}`).
    pub slurm_cgroups: Vec<String>,
}

impl Default for TrustSettings {
    fn default() -> Self {
        Self {
            cgroup_dir: PathBuf::from("/sys/fs/cgroup"),
            cgroup_roots: Vec::new(),
            lodger_cgroup: "/lodger".into(),
            max_jobs_per_owner: 32,
            max_instances_per_owner: 128,
            instance_memory_max: None,
            batch_memory_max: None,
            slurm_cgroups: crate::enforce::DEFAULT_SLURM_CGROUPS
                .iter()
                .map(|t| t.to_string())
                .collect(),
        }
    }
}

/// The Slurm jobs registered now: their Slurm job id and the cgroup lodger found them in.
pub(super) type SlurmCgroups = [(u64, String)];

/// One process as the rules see it.
struct ProcFacts {
    real_uid: u32,
    kernel_thread: bool,
}

fn proc_facts(proc_root: &Path, pid: u32) -> Option<ProcFacts> {
    let (ppid, flags) = parent_and_flags(proc_root, pid)?;
    let (real_uid, _) = crate::sys::procfs::uids(proc_root, pid)?;
    Some(ProcFacts {
        real_uid,
        kernel_thread: flags & PF_KTHREAD != 0 || pid == KTHREADD || ppid == KTHREADD,
    })
}

/// `pid`'s parent and flags, from its `stat` alone.
fn parent_and_flags(proc_root: &Path, pid: u32) -> Option<(u32, u64)> {
    let stat = std::fs::read(proc_root.join(pid.to_string()).join("stat")).ok()?;
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 1..)?).ok()?;
    // After the name: state (3), ppid (4), pgrp, session, tty_nr, tpgid, flags (9).
    let mut fields = rest.split_ascii_whitespace();
    let ppid: u32 = fields.nth(1)?.parse().ok()?;
    let flags: u64 = fields.nth(4)?.parse().ok()?;
    Some((ppid, flags))
}

/// lodgerd and every ancestor up to pid 1, as `<proc_root>` shows them (empty when lodgerd is
/// not in it: a test's fake `/proc`). One `stat` read per ancestor: their uids do not matter.
/// The agent keeps it and reads it again only before it refuses a process as lodgerd's
/// ancestor (issue 21: where lodgerd runs under a deep process tree, as in the spine benchmark,
/// walking it at every registration was 15 % of the agent thread's time; under systemd the
/// chain is lodgerd and pid 1).
pub(super) fn own_ancestry(proc_root: &Path) -> Vec<u32> {
    let mut chain = Vec::new();
    let mut pid = std::process::id();
    while pid != 0 && !chain.contains(&pid) {
        let Some((ppid, _)) = parent_and_flags(proc_root, pid) else {
            break;
        };
        chain.push(pid);
        pid = ppid;
    }
    chain
}

/// Why nobody, root included, may hand this process to lodger; None if it may be.
fn untouchable(pid: u32, facts: &ProcFacts, ancestry: &[u32]) -> Option<String> {
    if pid == 1 {
        Some(format!("process {pid} is the init process"))
    } else if facts.kernel_thread {
        Some(format!("process {pid} is a kernel thread"))
    } else if ancestry.first() == Some(&pid) {
        Some(format!("process {pid} is lodgerd itself"))
    } else if ancestry.contains(&pid) {
        Some(format!("process {pid} is an ancestor of lodgerd"))
    } else {
        None
    }
}

/// Checks one process a job names: refused for everyone when [`untouchable`] or in a Slurm
/// job's cgroup ([`slurm_job_of`]), and for a caller other than root when its real uid is not
/// the caller's. A process that does not exist is left to the spec check, which says so.
pub(super) fn check_pid(
    trust: &TrustSettings,
    proc_root: &Path,
    pid: u32,
    caller: &Caller,
    ancestry: &[u32],
    slurm: &SlurmCgroups,
) -> Result<(), AgentError> {
    let Some(facts) = proc_facts(proc_root, pid) else {
        if pid == 1 {
            return Err(refused("process 1 is the init process"));
        }
        return Ok(());
    };
    if let Some(why) = untouchable(pid, &facts, ancestry) {
        return Err(refused(&why));
    }
    // Lodger would pin it against Slurm's placement and, where it pins pid jobs by cgroup (v1),
    // move it out of Slurm's cpuset and memory limit (docs/slurm.md).
    if let Some((job, cgroup)) =
        cgroup_of(proc_root, pid).and_then(|own| slurm_job_of(&own, trust, slurm))
    {
        return Err(AgentError::AccessDenied(format!(
            "refused: process {pid} is in Slurm job {job}'s cgroup {cgroup}: register the \
             Slurm job (lodgerctl slurm prolog) instead"
        )));
    }
    if !caller.is_root() && facts.real_uid != caller.uid {
        return Err(refused(&format!(
            "process {pid} belongs to uid {}, not to the caller (uid {})",
            facts.real_uid, caller.uid
        )));
    }
    Ok(())
}

fn refused(why: &str) -> AgentError {
    AgentError::AccessDenied(format!(
        "refused: {why}; lodger never changes it for this caller"
    ))
}

/// Whether cgroup `path` is `base` or below it.
fn within(path: &str, base: &str) -> bool {
    let base = base.trim_end_matches('/');
    path == base || path.strip_prefix(base).is_some_and(|r| r.starts_with('/'))
}

/// lodgerd's own cgroup in the hierarchy jobs' cgroups are named in, if it can tell.
fn own_cgroup(proc_root: &Path) -> Option<String> {
    cgroup_of(proc_root, std::process::id())
}

/// Process `pid`'s cgroup in the hierarchy jobs' cgroups are named in (v1's cpuset line of
/// `/proc/PID/cgroup`, or v2's `0::` line), if it can tell.
fn cgroup_of(proc_root: &Path, pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    text.lines().find_map(|l| {
        let mut fields = l.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        (controllers.is_empty() || controllers.split(',').any(|c| c == "cpuset"))
            .then(|| path.trim().to_string())
    })
}

/// The Slurm job whose cgroup holds cgroup `path`, and that cgroup: a registered Slurm job's
/// (`slurm`), or one of `slurm.cgroup_paths` for any job. The job is named by its id, or `?`
/// where a template does not name it.
fn slurm_job_of(
    path: &str,
    trust: &TrustSettings,
    slurm: &SlurmCgroups,
) -> Option<(String, String)> {
    if let Some((job, cgroup)) = slurm.iter().find(|(_, cg)| within(path, cg)) {
        return Some((job.to_string(), cgroup.clone()));
    }
    crate::enforce::slurm_job_cgroup(&trust.slurm_cgroups, path)
}

/// Checks a cgroup a job names (`path`: from the hierarchy root, already validated as an
/// absolute path without `.` or `..`). Refused for everyone: lodger's own cgroups, lodgerd's
/// cgroup and its ancestors, and a subtree holding an untouchable process. Refused for a caller
/// other than root: the root cgroup, `init.scope`, `/system.slice` outside `api.cgroup_roots`,
/// and a subtree holding another user's process.
pub(super) fn check_cgroup(
    trust: &TrustSettings,
    proc_root: &Path,
    path: &str,
    caller: &Caller,
    ancestry: &[u32],
    slurm: &SlurmCgroups,
) -> Result<(), AgentError> {
    let path = path.trim_end_matches('/');
    let deny = |why: String| Err(refused(&format!("cgroup {path} {why}")));
    if within(path, &trust.lodger_cgroup) {
        return deny("is one of lodger's own cgroups".into());
    }
    // A Slurm job lodger manages: lodger never writes its cgroups (docs/slurm.md).
    if let Some((job, cgroup)) = slurm
        .iter()
        .find(|(_, cg)| within(path, cg) || within(cg, path))
    {
        return Err(AgentError::AccessDenied(format!(
            "refused: cgroup {path} holds or is in registered Slurm job {job}'s cgroup \
             {cgroup}: lodger already manages it, and never writes Slurm's cgroup files"
        )));
    }
    if let Some(own) = own_cgroup(proc_root) {
        if own != "/" && (own == path || within(&own, path)) {
            return deny(format!("holds lodgerd itself (its cgroup is {own})"));
        }
    }
    if !caller.is_root() {
        if path.is_empty() || path == "/" {
            return deny("is the root cgroup".into());
        }
        if within(path, "/init.scope") {
            return deny("is the init process's cgroup".into());
        }
        if within(path, "/system.slice") && !trust.cgroup_roots.iter().any(|r| within(path, r)) {
            return deny(
                "is a system service's cgroup (under /system.slice and not in api.cgroup_roots)"
                    .into(),
            );
        }
    }
    let dir = trust.cgroup_dir.join(path.trim_start_matches('/'));
    let mut pids = Vec::new();
    let mut dirs = 0;
    if !subtree_pids(&dir, 0, &mut dirs, &mut pids) {
        return deny(format!(
            "holds more than {MAX_CGROUP_PROCS} processes or {MAX_CGROUP_DIRS} cgroups, or nests \
             deeper than {MAX_CGROUP_DEPTH}"
        ));
    }
    for pid in pids {
        let Some(facts) = proc_facts(proc_root, pid) else {
            continue; // Gone since it was listed.
        };
        if let Some(why) = untouchable(pid, &facts, ancestry) {
            return deny(format!("holds a process lodger never changes ({why})"));
        }
        if !caller.is_root() && facts.real_uid != caller.uid {
            return deny(format!(
                "holds process {pid} of uid {}, not only the caller's (uid {})",
                facts.real_uid, caller.uid
            ));
        }
    }
    Ok(())
}

/// Every pid in `dir`'s `cgroup.procs` and those of its descendants. False when the subtree is
/// past the bounds (`dirs`: the cgroups looked at so far). A cgroup that does not exist holds
/// nothing (enforcement then says it is gone).
fn subtree_pids(dir: &Path, depth: usize, dirs: &mut usize, out: &mut Vec<u32>) -> bool {
    *dirs += 1;
    if depth > MAX_CGROUP_DEPTH || *dirs > MAX_CGROUP_DIRS {
        return false;
    }
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        if out.len() > MAX_CGROUP_PROCS {
            return false;
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return true;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir())
            && !subtree_pids(&entry.path(), depth + 1, dirs, out)
        {
            return false;
        }
    }
    true
}

/// Applies the per-owner caps to a registration for `owner` and returns the spec to register:
/// an inference job without `max_instances` gets what is left of its owner's instance cap.
/// Root's own direct calls (root registering for root) are not capped; a registration root
/// makes on a user's behalf counts against that user.
pub(super) fn within_caps<'a>(
    trust: &TrustSettings,
    caller: &Caller,
    owner: u32,
    mut spec: JobSpec,
    jobs: impl Iterator<Item = &'a Job>,
) -> Result<JobSpec, AgentError> {
    if caller.is_root() && owner == 0 {
        return Ok(spec);
    }
    let (mut count, mut instances) = (0u32, 0u32);
    for job in jobs.filter(|j| j.owner_uid == owner) {
        count = count.saturating_add(1);
        if let Some(inf) = &job.spec.inference {
            instances = instances
                .saturating_add(inf.max_instances.unwrap_or(trust.max_instances_per_owner));
        }
    }
    if count >= trust.max_jobs_per_owner {
        return Err(AgentError::Conflict(format!(
            "uid {owner} already has {count} jobs, the most api.max_jobs_per_owner allows; \
             unregister one first"
        )));
    }
    if let (Some(asked), Some(most)) = (
        spec.inference.as_ref().and_then(|i| i.memory_max),
        trust.instance_memory_max,
    ) {
        if asked > most {
            return Err(AgentError::Conflict(format!(
                "memory_max {} per instance is above this node's inference.memory_max ({}); \
                 ask for at most that, or have the operator raise it",
                crate::job::memory::show_size(asked),
                crate::job::memory::show_size(most)
            )));
        }
    }
    if let Some(inf) = &mut spec.inference {
        let left = trust.max_instances_per_owner.saturating_sub(instances);
        match inf.max_instances {
            _ if left == 0 => {
                return Err(AgentError::Conflict(format!(
                    "uid {owner}'s jobs may already run {instances} instances, the most \
                     api.max_instances_per_owner allows; unregister an inference job first"
                )))
            }
            Some(n) if n > left => {
                return Err(AgentError::Conflict(format!(
                    "uid {owner} may run {left} more instance(s) (api.max_instances_per_owner \
                     = {}), not {n}; ask for fewer with --max-instances",
                    trust.max_instances_per_owner
                )))
            }
            Some(_) => {}
            None => inf.max_instances = Some(left),
        }
    }
    Ok(spec)
}

/// A batch job's own memory limit (issue 19): only on a cgroup lodger makes (a job registered by
/// pids), and at most the node's `batch.memory_max`.
pub(super) fn check_batch_memory(
    spec: &JobSpec,
    asked: u64,
    most: Option<u64>,
) -> Result<(), AgentError> {
    use crate::job::memory::show_size;
    if !matches!(spec.target, Target::Pids(_)) {
        return Err(AgentError::InvalidSpec(
            "memory_max applies to a batch job registered by its pids, in the cgroup lodger makes \
             for it; lodger never writes the memory settings of a cgroup it did not make (set \
             memory.max there, or have Slurm's cgroup.conf do it)"
                .into(),
        ));
    }
    match most {
        None => Err(AgentError::Conflict(
            "this node gives batch jobs no memory limit (batch.memory_max = \"none\", pid jobs \
             pinned by affinity, or no cgroup v1 memory hierarchy), so none can be asked for"
                .into(),
        )),
        Some(most) if asked > most => Err(AgentError::Conflict(format!(
            "memory_max {} is above this node's batch.memory_max ({}); ask for at most that, \
             or have the operator raise it",
            show_size(asked),
            show_size(most)
        ))),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_proc(dir: &Path, pid: u32, ppid: u32, uid: u32, flags: u64) {
        let p = dir.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(
            p.join("stat"),
            format!("{pid} (some (name)) S {ppid} {pid} {pid} 0 -1 {flags} 0 0 0 0 1 1 0 0 20 0 1 0 100 0 0\n"),
        )
        .unwrap();
        std::fs::write(
            p.join("status"),
            format!("Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
        )
        .unwrap();
    }

    #[test]
    fn pids_are_checked_against_the_caller_and_the_untouchables() {
        let proc = tempfile::tempdir().unwrap();
        fake_proc(proc.path(), 1, 0, 0, 0);
        fake_proc(proc.path(), 2, 0, 0, PF_KTHREAD);
        fake_proc(proc.path(), 40, 2, 0, PF_KTHREAD);
        fake_proc(proc.path(), 500, 1, 1000, 0);
        fake_proc(proc.path(), 600, 1, 1001, 0);
        fake_proc(proc.path(), 700, 1, 0, 0);
        let ancestry = [700, 1];
        let member = Caller::uid(1000);
        let root = Caller::uid(0);
        let msg = |r: Result<(), AgentError>| r.unwrap_err().to_string();
        assert_eq!(
            check_pid(
                &TrustSettings::default(),
                proc.path(),
                500,
                &member,
                &ancestry,
                &[]
            )
            .ok(),
            Some(())
        );
        assert!(msg(check_pid(
            &TrustSettings::default(),
            proc.path(),
            600,
            &member,
            &ancestry,
            &[]
        ))
        .contains("process 600 belongs to uid 1001, not to the caller (uid 1000)"));
        assert_eq!(
            check_pid(
                &TrustSettings::default(),
                proc.path(),
                600,
                &root,
                &ancestry,
                &[]
            )
            .ok(),
            Some(())
        );
        for (pid, why) in [
            (1, "process 1 is the init process"),
            (2, "process 2 is a kernel thread"),
            (40, "process 40 is a kernel thread"),
            (700, "process 700 is lodgerd itself"),
        ] {
            for caller in [&member, &root] {
                let m = msg(check_pid(
                    &TrustSettings::default(),
                    proc.path(),
                    pid,
                    caller,
                    &ancestry,
                    &[],
                ));
                assert!(m.contains(why), "{m}");
            }
        }
    }

    #[test]
    fn cgroups_are_checked_for_place_and_for_whose_processes_they_hold() {
        let proc = tempfile::tempdir().unwrap();
        let cg = tempfile::tempdir().unwrap();
        fake_proc(proc.path(), 500, 1, 1000, 0);
        fake_proc(proc.path(), 600, 1, 1001, 0);
        let mk = |path: &str, procs: &[u32]| {
            let d = cg.path().join(path);
            std::fs::create_dir_all(&d).unwrap();
            let text: String = procs.iter().map(|p| format!("{p}\n")).collect();
            std::fs::write(d.join("cgroup.procs"), text).unwrap();
        };
        mk("user.slice/mine", &[500]);
        mk("user.slice/mixed", &[500]);
        mk("user.slice/mixed/child", &[600]);
        mk("system.slice/slurmstepd.scope/job_1", &[500]);
        mk("system.slice/cron.service", &[500]);
        let trust = TrustSettings {
            cgroup_dir: cg.path().to_path_buf(),
            cgroup_roots: vec!["/system.slice/slurmstepd.scope".into()],
            ..TrustSettings::default()
        };
        let member = Caller::uid(1000);
        let root = Caller::uid(0);
        let check = |path: &str, caller: &Caller| {
            check_cgroup(&trust, proc.path(), path, caller, &[], &[]).map_err(|e| e.to_string())
        };
        assert_eq!(check("/user.slice/mine", &member), Ok(()));
        assert_eq!(
            check("/system.slice/slurmstepd.scope/job_1", &member),
            Ok(())
        );
        for (path, why) in [
            ("/user.slice/mixed", "holds process 600 of uid 1001"),
            ("/system.slice/cron.service", "not in api.cgroup_roots"),
            ("/init.scope", "init process's cgroup"),
            ("/", "root cgroup"),
            ("/lodger/lodgers", "lodger's own cgroups"),
        ] {
            let m = check(path, &member).unwrap_err();
            assert!(m.contains(why) && m.contains("cgroup"), "{path}: {m}");
        }
        assert_eq!(check("/user.slice/mixed", &root), Ok(()));
        assert_eq!(check("/system.slice/cron.service", &root), Ok(()));
        assert!(check("/lodger", &root).is_err());
        // Many empty cgroups (a member may make them in a subtree delegated to them): the walk
        // stops at MAX_CGROUP_DIRS and the registration is refused, for root too.
        for n in 0..MAX_CGROUP_DIRS {
            std::fs::create_dir_all(cg.path().join(format!("user.slice/wide/c{n}"))).unwrap();
        }
        for caller in [&member, &root] {
            let m = check("/user.slice/wide", caller).unwrap_err();
            assert!(m.contains("4096 cgroups"), "{m}");
        }
    }

    /// Issue 19: a batch job's own memory limit only on a cgroup lodger makes, and within the
    /// node's.
    #[test]
    fn a_batch_jobs_own_memory_limit_is_bounded_and_only_for_pid_jobs() {
        let mut spec = crate::agent::tests::spec(vec![10], 0);
        spec.kind = crate::job::JobKind::Batch;
        assert!(check_batch_memory(&spec, 1 << 20, Some(1 << 30)).is_ok());
        let high = check_batch_memory(&spec, 2 << 30, Some(1 << 30)).unwrap_err();
        assert!(
            high.to_string()
                .contains("above this node's batch.memory_max"),
            "{high}"
        );
        let none = check_batch_memory(&spec, 1 << 20, None).unwrap_err();
        assert!(none.to_string().contains("no memory limit"), "{none}");
        spec.target = Target::Cgroup("/user.slice/job".into());
        let theirs = check_batch_memory(&spec, 1 << 20, Some(1 << 30)).unwrap_err();
        assert!(matches!(theirs, AgentError::InvalidSpec(_)), "{theirs}");
        assert!(
            theirs
                .to_string()
                .contains("never writes the memory settings"),
            "{theirs}"
        );
    }
}
