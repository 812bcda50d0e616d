//! Enforcement against the real kernel (root: real v1 cpuset and cpu cgroups, real SCHED_RR on a
//! real multi-threaded python3 process) and against cgroup v2 fixture trees copied to a tempdir.
//! Each test uses its own cgroups (named `lodger-test-<pid>-<n>`) and its own processes, so they
//! run in parallel; guards remove what a test created even when it fails.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use super::error::MAX_REPORTED;
use super::rtgroup::RtGrant;
use super::*;
use crate::enforce::sched::{CpuMask, SchedError};
use crate::privileged::need_root;
use crate::sys::cgroupfs::CgroupDriver;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const CPUSET_V1: &str = "/sys/fs/cgroup/cpuset";
const CPU_V1: &str = "/sys/fs/cgroup/cpu";
const FIXTURE_V2: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/cgroup/v2-systemd-slurm"
);
const STEP: &str = "/system.slice/slurmstepd.scope/job_42/step_0";

static SEQ: AtomicU32 = AtomicU32::new(0);

fn unique(tag: &str) -> String {
    format!(
        "lodger-test-{}-{}-{tag}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

fn set(list: &str) -> CpuSet {
    CpuSet::parse(list).expect("test cpulist")
}

fn job(n: u64) -> JobId {
    JobId::from_seq(n)
}

fn settings(parent: &str, pinning: PidPinning) -> EnforceSettings {
    EnforceSettings {
        parent: parent.to_string(),
        pid_jobs: pinning,
        rt_priority: 7,
        ..EnforceSettings::default()
    }
}

fn enforcer(settings: EnforceSettings) -> Enforcer {
    Enforcer::new(settings).expect("enforcer")
}

// ---------------------------------------------------------------------------------------------
// A real workload

/// python3 with idle threads, driven over stdin: `thread` starts a thread that puts itself back
/// to SCHED_OTHER on every CPU (a thread that did not inherit lodger's settings) and prints its
/// tid; `spawn` starts a `sleep` child and prints its pid. Killed with its process group on drop.
struct Workload {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pid: u32,
}

const WORKLOAD: &str = r#"
import os, sys, threading, subprocess, time
def idle():
    while True:
        time.sleep(3600)
for _ in range(int(sys.argv[1])):
    threading.Thread(target=idle, daemon=True).start()
print("ready", flush=True)
kids = []
briefs = []
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "thread":
        box, ev = [], threading.Event()
        def fresh():
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            os.sched_setaffinity(0, range(os.cpu_count()))
            box.append(threading.get_native_id())
            ev.set()
            idle()
        threading.Thread(target=fresh, daemon=True).start()
        ev.wait()
        print(box[0], flush=True)
    elif cmd == "spawn":
        kids.append(subprocess.Popen(["sleep", "3600"]))
        print(kids[-1].pid, flush=True)
    elif cmd == "execthread":
        # A child whose thread other than its main one calls execve: the kernel ends the
        # main thread first (an exit event for the pid), and the process goes on as sleep.
        code = "import os, threading, time\n" \
            "threading.Thread(target=lambda: os.execv('/bin/sleep', ['sleep', '3600'])).start()\n" \
            "time.sleep(3600)\n"
        kids.append(subprocess.Popen([sys.executable, "-c", code]))
        pid = kids[-1].pid
        while True:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "sleep":
                        break
            except OSError:
                pass
            time.sleep(0.01)
        print(pid, flush=True)
    elif cmd == "wide":
        # A child on every CPU, as one forked before its parent was pinned is.
        everywhere = lambda: os.sched_setaffinity(0, range(os.cpu_count()))
        kids.append(subprocess.Popen(["sleep", "3600"], preexec_fn=everywhere))
        print(kids[-1].pid, flush=True)
    elif cmd == "orphan":
        # This process becomes a subreaper; a child starts a grandchild and exits, so the
        # grandchild is given to this process: no event says so.
        import ctypes
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        mid = subprocess.run(["sh", "-c", "sleep 3600 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True)
        print(mid.stdout.strip(), flush=True)
    elif cmd == "end":
        # The oldest thread started by "brief" ends (its exit is no process event).
        t = briefs.pop(0)
        t[1].set()
        t[0].join()
        print(t[2], flush=True)
    elif cmd == "brief":
        box, ev, go = [], threading.Event(), threading.Event()
        def brief():
            box.append(threading.get_native_id())
            ev.set()
            go.wait()
        t = threading.Thread(target=brief, daemon=True)
        t.start()
        ev.wait()
        briefs.append((t, go, box[0]))
        print(box[0], flush=True)
"#;

impl Workload {
    fn start(threads: usize) -> Workload {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(WORKLOAD)
            .arg(threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("python3 runs");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let pid = child.id();
        let mut w = Workload {
            child,
            stdin,
            stdout,
            pid,
        };
        assert_eq!(w.line(), "ready");
        w
    }

    fn line(&mut self) -> String {
        let mut s = String::new();
        self.stdout.read_line(&mut s).expect("workload answers");
        s.trim().to_string()
    }

    fn ask(&mut self, cmd: &str) -> u32 {
        writeln!(self.stdin, "{cmd}").expect("workload listens");
        self.stdin.flush().expect("flush");
        self.line().parse().expect("a tid or pid")
    }

    fn new_thread(&mut self) -> u32 {
        self.ask("thread")
    }

    /// A thread that ends when told ([`Workload::end_thread`]).
    fn brief_thread(&mut self) -> u32 {
        self.ask("brief")
    }

    /// Ends the oldest brief thread; its tid.
    fn end_thread(&mut self) -> u32 {
        self.ask("end")
    }

    fn spawn_child(&mut self) -> u32 {
        self.ask("spawn")
    }

    /// A `sleep` child on every CPU, whatever the workload's own mask.
    /// A child that a thread other than its main one turned into `sleep` by `execve`; its pid
    /// once it is `sleep`.
    fn spawn_exec_from_thread(&mut self) -> u32 {
        self.ask("execthread")
    }

    fn spawn_wide_child(&mut self) -> u32 {
        self.ask("wide")
    }

    /// Makes the workload a subreaper and a `sleep` grandchild of it whose parent has exited:
    /// the grandchild's pid, now a child of the workload.
    fn spawn_orphan(&mut self) -> u32 {
        self.ask("orphan")
    }

    fn kill(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.pid as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.kill();
    }
}

fn tids(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) {
        for e in dir.flatten() {
            if let Some(t) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                out.push(t);
            }
        }
    }
    out.sort_unstable();
    out
}

fn cpus_allowed(pid: u32, tid: u32) -> String {
    let status = fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Every thread of `pids` is SCHED_RR at `rr` (or SCHED_OTHER when `None`) on exactly `cpus`.
/// The CPUs a thread may use when nothing pins it: this test process's own mask (all online CPUs
/// unless the harness itself was pinned), so expectations follow the host, not a 2-CPU shape.
fn unpinned() -> String {
    let status = fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_string())
        .expect("Cpus_allowed_list in /proc/self/status")
}

fn assert_threads(pids: &[u32], rr: Option<i32>, cpus: &str) {
    for &pid in pids {
        let ts = tids(pid);
        assert!(!ts.is_empty(), "pid {pid} has threads");
        for tid in ts {
            let (policy, prio) = sched::policy_of(tid).expect("policy");
            match rr {
                // Role priorities: threads that mostly wait run one above.
                Some(p) => assert!(
                    policy == libc::SCHED_RR && (prio == p || prio == p + 1),
                    "thread {tid} of {pid}: policy {policy} prio {prio}, want RR {p}"
                ),
                None => assert_eq!(policy, libc::SCHED_OTHER, "thread {tid} of {pid}"),
            }
            assert_eq!(cpus_allowed(pid, tid), cpus, "thread {tid} of {pid}");
        }
    }
}

fn thread_count(pids: &[u32]) -> u32 {
    pids.iter().map(|&p| tids(p).len() as u32).sum()
}

fn cpuset_cgroup_of(pid: u32) -> String {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup file");
    text.lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let _ = parts.next();
            let ctrls = parts.next()?;
            let path = parts.next()?;
            ctrls
                .split(',')
                .any(|c| c == "cpuset")
                .then(|| path.to_string())
        })
        .expect("a cpuset line")
}

// ---------------------------------------------------------------------------------------------
// Cleanup of real cgroups

/// Removes `<hierarchy>/<top>` and everything below on drop, moving leftover processes to the
/// hierarchy root first.
struct CgroupGuard {
    hierarchy: PathBuf,
    top: String,
}

impl CgroupGuard {
    fn new(hierarchy: &str, top: &str) -> Self {
        Self {
            hierarchy: PathBuf::from(hierarchy),
            top: top.trim_start_matches('/').to_string(),
        }
    }

    fn path(&self) -> PathBuf {
        self.hierarchy.join(&self.top)
    }

    fn remove(dir: &Path, root: &Path) {
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    Self::remove(&e.path(), root);
                }
            }
        }
        if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = fs::write(root.join("cgroup.procs"), pid);
            }
        }
        let _ = fs::remove_dir(dir);
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        let dir = self.path();
        if dir.exists() {
            Self::remove(&dir, &self.hierarchy);
        }
    }
}

/// Creates a v1 cpuset cgroup with values.
fn make_cpuset(rel: &str, cpus: &str, mems: &str) -> PathBuf {
    let dir = Path::new(CPUSET_V1).join(rel.trim_start_matches('/'));
    fs::create_dir(&dir).expect("mkdir cpuset cgroup");
    fs::write(dir.join("cpuset.mems"), mems).expect("mems");
    fs::write(dir.join("cpuset.cpus"), cpus).expect("cpus");
    dir
}

fn read_trim(path: impl AsRef<Path>) -> String {
    fs::read_to_string(path.as_ref())
        .unwrap_or_else(|e| panic!("read {}: {e}", path.as_ref().display()))
        .trim()
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// Fixtures

use crate::testutil::copy_tree;

fn v2_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_tree(Path::new(FIXTURE_V2), dir.path());
    dir
}

fn snapshot(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    let mut entries: Vec<_> = fs::read_dir(dir).expect("dir").flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        if e.file_type().expect("type").is_dir() {
            out.push((e.path(), String::new()));
            snapshot(&e.path(), out);
        } else {
            out.push((e.path(), fs::read_to_string(e.path()).expect("read")));
        }
    }
}

fn v2_settings(root: &Path) -> EnforceSettings {
    EnforceSettings {
        cgroup_root: root.to_path_buf(),
        rt_priority: 7,
        parent: unique("v2"),
        ..EnforceSettings::default()
    }
}

// =============================================================================================
// Mode detection and settings (no root needed)

#[test]
fn detects_the_mode_from_the_tree() {
    let v2 = v2_fixture();
    let e = enforcer(v2_settings(v2.path()));
    assert_eq!(e.mode().version, CgroupVersion::V2);
    assert_eq!(e.mode().pid_pinning, PinMethod::Affinity);
    assert_eq!(
        e.mode().to_string(),
        "cgroup v2, pid jobs pinned by affinity"
    );

    let v1 = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(v1.path().join("cpuset")).expect("mkdir");
    fs::write(v1.path().join("cpuset/cpuset.cpus"), "0-3\n").expect("write");
    let e = enforcer(EnforceSettings {
        cgroup_root: v1.path().to_path_buf(),
        ..EnforceSettings::default()
    });
    assert_eq!(e.mode().version, CgroupVersion::V1);
    assert_eq!(e.mode().pid_pinning, PinMethod::Cgroup);

    // Forced driver that does not match the tree.
    let err = Enforcer::new(EnforceSettings {
        cgroup_root: v1.path().to_path_buf(),
        driver: CgroupDriver::V2,
        ..EnforceSettings::default()
    })
    .expect_err("no v2 here");
    assert!(
        matches!(err, EnforceError::Cgroup(CgroupError::NoHierarchy { .. })),
        "{err}"
    );

    let empty = tempfile::tempdir().expect("tempdir");
    let err = Enforcer::new(EnforceSettings {
        cgroup_root: empty.path().to_path_buf(),
        ..EnforceSettings::default()
    })
    .expect_err("nothing here");
    assert!(err.to_string().contains("cgroup.controllers"), "{err}");

    // v2 whose cpuset controller is bound elsewhere.
    fs::write(v2.path().join("cgroup.controllers"), "cpu io memory pids\n").expect("write");
    let err = Enforcer::new(v2_settings(v2.path())).expect_err("no cpuset");
    assert!(
        matches!(
            err,
            EnforceError::Cgroup(CgroupError::CpusetUnavailable { .. })
        ),
        "{err}"
    );
}

#[test]
fn settings_are_checked() {
    let v2 = v2_fixture();
    for bad in [0, 100, -1] {
        let err = Enforcer::new(EnforceSettings {
            rt_priority: bad,
            ..v2_settings(v2.path())
        })
        .expect_err("bad priority");
        assert!(
            matches!(err, EnforceError::Sched(SchedError::BadPriority { .. })),
            "{err}"
        );
    }
    for bad in ["/", "", "a/../b", ".."] {
        let err = Enforcer::new(EnforceSettings {
            parent: bad.to_string(),
            ..v2_settings(v2.path())
        })
        .expect_err("bad parent");
        assert!(
            matches!(err, EnforceError::Cgroup(CgroupError::BadPath(_))),
            "{bad}: {err}"
        );
    }
    let e = enforcer(v2_settings(v2.path()));
    let err = e
        .apply(
            &job(1),
            &Target::Cgroup(STEP.into()),
            &CpuSet::new(),
            &set("0"),
            &mut JobRecord::default(),
        )
        .expect_err("empty placement");
    assert!(matches!(err, EnforceError::EmptyPlacement));
}

#[test]
fn record_survives_serialization() {
    let record = JobRecord {
        cgroup: None,
        slurm: None,
        memory_max: Some(48 << 20),
        authorized: vec![RootProcess {
            pid: 10,
            start_time: 99,
        }],
        pids: Some(PidJobRecord {
            pinning: PinMethod::Cgroup,
            cgroup: Some("/lodger/j3".into()),
            roots: vec![RootProcess {
                pid: 10,
                start_time: 99,
            }],
            missing_roots: vec![11],
            processes: vec![
                TrackedProcess {
                    pid: 10,
                    start_time: 99,
                    ppid: 1,
                    original_cgroup: Some("/".into()),
                    original_memory_cgroup: Some("/user.slice".into()),
                    original_affinity: None,
                    bound: false,
                },
                TrackedProcess {
                    pid: 12,
                    start_time: 120,
                    ppid: 10,
                    original_cgroup: None,
                    original_memory_cgroup: None,
                    original_affinity: Some(set("0-3,8")),
                    bound: false,
                },
            ],
            rescan: true,
            pinned: Some(set("2-3")),
            pinned_before: vec![set("0-1"), set("4")],
        }),
        rt_grants: vec![RtGrant {
            cgroup: "/a".into(),
            previous_us: 0,
            granted_us: 10000,
        }],
    };
    let json = serde_json::to_string(&record).expect("to json");
    assert!(json.contains("\"0-3,8\""), "{json}");
    let back: JobRecord = serde_json::from_str(&json).expect("from json");
    assert_eq!(back, record);
    let empty: JobRecord = serde_json::from_str("{}").expect("empty record");
    assert_eq!(empty, JobRecord::default());
}

#[test]
fn errors_are_collected_once_each_and_capped() {
    assert!(EnforceError::collect(Vec::new()).is_ok());
    let budget = || -> EnforceError {
        SchedError::RtGroupBudget {
            file: PathBuf::from("/sys/fs/cgroup/cpu/x/cpu.rt_runtime_us"),
        }
        .into()
    };
    // The same problem on many threads is one error, returned as itself.
    let one = EnforceError::collect(vec![budget(), budget(), budget()]).expect_err("one");
    assert!(matches!(
        one,
        EnforceError::Sched(SchedError::RtGroupBudget { .. })
    ));
    let many: Vec<EnforceError> = (0..10)
        .map(|tid| {
            SchedError::SetScheduler {
                tid,
                priority: 7,
                errno: nix::errno::Errno::EINVAL,
                hint: "",
            }
            .into()
        })
        .collect();
    match EnforceError::collect(many).expect_err("several") {
        EnforceError::Several { errors, more } => {
            assert_eq!(errors.len(), MAX_REPORTED);
            assert_eq!(more, 10 - MAX_REPORTED);
        }
        other => panic!("unexpected {other}"),
    }
    assert_eq!(within(&set("0-3"), &set("0-7")), None);
    assert_eq!(within(&set("0-3"), &set("2-7")), Some(set("2-3")));
    assert_eq!(within(&set("0-1"), &set("4-5")), Some(set("4-5")));
}

// =============================================================================================
// cgroup v2 fixture trees

#[test]
fn vanished_and_reused_pids_are_not_the_job() {
    if !need_root("vanished_and_reused_pids_are_not_the_job") {
        return;
    }
    let e = enforcer(settings(&unique("vanish"), PidPinning::Affinity));
    // A pid that cannot exist.
    let pid_max: u32 = read_trim("/proc/sys/kernel/pid_max")
        .parse()
        .expect("pid_max");
    let mut record = JobRecord::default();
    let out = e
        .apply(
            &job(15),
            &Target::Pids(vec![pid_max]),
            &set("1"),
            &set("0"),
            &mut record,
        )
        .expect("a missing pid is not an error");
    assert!(!out.alive && out.pids.is_empty());
    assert!(
        out.warnings.iter().any(|w| w.contains("not running")),
        "{:?}",
        out.warnings
    );
    e.release(&job(15), &Target::Pids(vec![pid_max]), &record)
        .expect("release");

    // The job's process exits between two applies.
    let mut w = Workload::start(1);
    let target = Target::Pids(vec![w.pid]);
    let mut record = JobRecord::default();
    let out = e
        .apply(&job(16), &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert!(out.alive);
    w.kill();
    let out = e
        .apply(&job(16), &target, &set("1"), &set("0"), &mut record)
        .expect("apply after exit");
    assert!(!out.alive && out.pids.is_empty(), "{out:?}");
    e.release(&job(16), &target, &record).expect("release");

    // The pid now belongs to another process (another start time): not touched.
    let other = Workload::start(1);
    let mut record = JobRecord {
        pids: Some(PidJobRecord {
            pinning: PinMethod::Affinity,
            roots: vec![RootProcess {
                pid: other.pid,
                start_time: 1,
            }],
            ..PidJobRecord::default()
        }),
        ..JobRecord::default()
    };
    let out = e
        .apply(
            &job(17),
            &Target::Pids(vec![other.pid]),
            &set("1"),
            &set("0"),
            &mut record,
        )
        .expect("apply");
    assert!(!out.alive);
    assert_threads(&[other.pid], None, &unpinned());

    // A job placed after it was registered (a batch job waiting for cores) whose pid another
    // process holds by then: the start time authorized at registration is not this one's, so
    // the process is left alone from the first apply on.
    let mut record = JobRecord {
        authorized: vec![RootProcess {
            pid: other.pid,
            start_time: 1,
        }],
        ..JobRecord::default()
    };
    let target = Target::Pids(vec![other.pid]);
    let out = e
        .apply(&job(18), &target, &set("1"), &set("0"), &mut record)
        .expect("apply");
    assert!(!out.alive && out.pids.is_empty(), "{out:?}");
    assert!(
        out.warnings.iter().any(|w| w.contains("reused")),
        "{:?}",
        out.warnings
    );
    assert_threads(&[other.pid], None, &unpinned());
    e.release(&job(18), &target, &record).expect("release");
}

#[test]
fn rt_group_without_budget_is_named_then_granted() {
    if !need_root("rt_group_without_budget_is_named_then_granted") {
        return;
    }
    if !crate::privileged::need_rt_group_sched("rt_group_without_budget_is_named_then_granted") {
        return;
    }
    if !Path::new(CPU_V1).join("cpu.rt_runtime_us").exists() {
        crate::privileged::not_applicable(
            "rt_group_without_budget_is_named_then_granted",
            "no v1 cpu controller with cpu.rt_runtime_us at /sys/fs/cgroup/cpu",
        );
        return;
    }
    let group = unique("rt");
    let _guard = CgroupGuard::new(CPU_V1, &group);
    let dir = Path::new(CPU_V1).join(&group);
    fs::create_dir(&dir).expect("mkdir cpu cgroup");
    assert_eq!(read_trim(dir.join("cpu.rt_runtime_us")), "0");
    let w = Workload::start(2);
    fs::write(dir.join("cgroup.procs"), w.pid.to_string()).expect("attach");
    let target = Target::Pids(vec![w.pid]);
    let mut record = JobRecord::default();

    let e = enforcer(settings(&unique("rt"), PidPinning::Affinity));
    let err = e
        .apply(&job(18), &target, &set("0-1"), &set("0"), &mut record)
        .expect_err("no RT budget");
    match &err {
        EnforceError::Sched(SchedError::RtGroupBudget { file }) => {
            assert_eq!(file, &dir.join("cpu.rt_runtime_us"));
        }
        other => panic!("unexpected {other}"),
    }
    let text = err.to_string();
    assert!(text.contains("training.grant_rt_budget_us"), "{text}");
    assert!(
        text.contains(&dir.join("cpu.rt_runtime_us").display().to_string()),
        "{text}"
    );
    assert_threads(&[w.pid], None, &unpinned());

    let e = enforcer(EnforceSettings {
        grant_rt_budget_us: Some(10_000),
        ..settings(&unique("rt"), PidPinning::Affinity)
    });
    let out = e
        .apply(&job(18), &target, &set("0-1"), &set("0"), &mut record)
        .expect("granted");
    assert!(out.changed);
    assert_eq!(out.rr_threads, out.threads);
    assert_threads(&[w.pid], Some(7), &unpinned());
    assert_eq!(read_trim(dir.join("cpu.rt_runtime_us")), "10000");
    assert_eq!(record.rt_grants.len(), 1, "{:?}", record.rt_grants);
    let again = e
        .apply(&job(18), &target, &set("0-1"), &set("0"), &mut record)
        .expect("apply");
    assert!(!again.changed);

    e.release(&job(18), &target, &record).expect("release");
    assert_threads(&[w.pid], None, &unpinned());
    assert_eq!(
        read_trim(dir.join("cpu.rt_runtime_us")),
        "0",
        "budget returned"
    );
}

#[test]
fn unthrottled_rt_is_refused_unless_allowed() {
    if !need_root("unthrottled_rt_is_refused_unless_allowed") {
        return;
    }
    let w = Workload::start(1);
    // A proc root whose sysctl says -1 and that shows the workload.
    let fake = tempfile::tempdir().expect("tempdir");
    let sysctl = fake.path().join(sched::SCHED_RT_RUNTIME_SYSCTL);
    fs::create_dir_all(sysctl.parent().expect("parent")).expect("mkdir");
    fs::write(&sysctl, "-1\n").expect("write");
    std::os::unix::fs::symlink(
        format!("/proc/{}", w.pid),
        fake.path().join(w.pid.to_string()),
    )
    .expect("symlink");
    let base = EnforceSettings {
        proc_root: fake.path().to_path_buf(),
        ..settings(&unique("unthrottled"), PidPinning::Affinity)
    };
    let target = Target::Pids(vec![w.pid]);
    let mut record = JobRecord::default();

    let e = enforcer(base.clone());
    let err = e
        .apply(&job(19), &target, &set("1"), &set("0"), &mut record)
        .expect_err("refused");
    assert!(
        matches!(err, EnforceError::Sched(SchedError::RtUnthrottled { .. })),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("training.allow_unthrottled_rt = true"),
        "{err}"
    );
    // The placement is still made; only RR is refused.
    assert_threads(&[w.pid], None, "1");

    let e = enforcer(EnforceSettings {
        allow_unthrottled_rt: true,
        ..base
    });
    let out = e
        .apply(&job(19), &target, &set("1"), &set("0"), &mut record)
        .expect("allowed");
    assert!(out.changed);
    assert_threads(&[w.pid], Some(7), "1");
    e.release(&job(19), &target, &record).expect("release");
    assert_threads(&[w.pid], None, &unpinned());
}

/// A steady apply (the sweep the agent runs every tick) changes nothing; what it costs is measured
/// by the spine benchmark (`scripts/bench-spine`), not asserted here.
#[test]
fn steady_apply_is_cheap() {
    if !need_root("steady_apply_is_cheap")
        || !crate::privileged::need_cgroup_v1("steady_apply_is_cheap")
    {
        return;
    }
    for pinning in [PidPinning::Cgroup, PidPinning::Affinity] {
        let parent = unique("steady");
        let _guard = CgroupGuard::new(CPUSET_V1, &parent);
        let e = enforcer(settings(&parent, pinning));
        let w = Workload::start(16);
        let target = Target::Pids(vec![w.pid]);
        let mut record = JobRecord::default();
        e.apply(&job(20), &target, &set("1"), &set("0"), &mut record)
            .expect("apply");
        // Role priorities are measured over at least MIN_WINDOW: let one pass, so the threads'
        // roles are settled before the steady applies.
        std::thread::sleep(super::roles::MIN_WINDOW);
        e.apply(&job(20), &target, &set("1"), &set("0"), &mut record)
            .expect("apply");
        let n = 200u32;
        let t0 = Instant::now();
        for _ in 0..n {
            let out = e
                .apply(&job(20), &target, &set("1"), &set("0"), &mut record)
                .expect("apply");
            assert!(!out.changed);
        }
        let per = t0.elapsed() / n;
        eprintln!(
            "steady apply, {pinning:?}, {} threads: {per:?} per apply",
            thread_count(&[w.pid])
        );
        e.release(&job(20), &target, &record).expect("release");
        drop(w);
    }
}

#[test]
fn real_hybrid_hierarchy_is_detected() {
    // The CI machine is v1 hybrid: cpuset under /sys/fs/cgroup/cpuset, and cgroup2 at
    // /sys/fs/cgroup/unified without cpuset, so a v2 driver pointed there must refuse.
    let unified = Path::new(CGROUP_ROOT).join("unified");
    if !Path::new(CPUSET_V1).join("cpuset.cpus").exists()
        || !unified.join("cgroup.controllers").exists()
    {
        crate::privileged::not_applicable(
            "real_hybrid_hierarchy_is_detected",
            "not a cgroup v1 hybrid machine",
        );
        return;
    }
    let real = enforcer(settings(&unique("mode"), PidPinning::Auto));
    assert_eq!(real.mode().version, CgroupVersion::V1);
    assert_eq!(real.mode().pid_pinning, PinMethod::Cgroup);
    let err = Enforcer::new(EnforceSettings {
        cgroup_root: unified,
        driver: CgroupDriver::V2,
        ..EnforceSettings::default()
    })
    .expect_err("no cpuset in the unified hierarchy here");
    assert!(
        matches!(
            err,
            EnforceError::Cgroup(CgroupError::CpusetUnavailable { .. })
        ),
        "{err}"
    );
}

#[test]
fn real_v2_hierarchy_is_detected() {
    // The hosts lodger's users run: cpuset in the unified hierarchy at /sys/fs/cgroup, pid jobs
    // pinned by affinity (a process is never pulled out of its systemd unit).
    if !crate::privileged::need_cgroup_v2("real_v2_hierarchy_is_detected") {
        return;
    }
    let real = enforcer(settings(&unique("mode"), PidPinning::Auto));
    assert_eq!(real.mode().version, CgroupVersion::V2);
    assert_eq!(real.mode().pid_pinning, PinMethod::Affinity);
}

mod quiet;
mod slurm;
mod v1;
mod v2;
