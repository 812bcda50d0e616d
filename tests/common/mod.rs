//! Test harness for end-to-end tests: a private `dbus-daemon`, a `lodgerd` on it with its own
//! state directory and cgroup parent, `lodgerctl` runs, and the bundled workloads.
#![allow(dead_code)]

pub mod bus;
pub mod contention;
pub mod cpus;
pub mod fuse;
pub mod netcls;
pub mod procs;
pub mod workload;

#[allow(unused_imports)]
pub use bus::PrivateBus;
#[allow(unused_imports)]
pub use cpus::*;
#[allow(unused_imports)]
pub use procs::*;
#[allow(unused_imports)]
pub use workload::*;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

#[allow(unused_imports)]
pub use lodger::privileged::{
    cpuset_root, host_cgroup, need_cgroup_v1, need_cgroup_v2, need_cpus, need_root,
    need_rt_group_sched, not_applicable, HostCgroup,
};

static SEQ: AtomicU32 = AtomicU32::new(0);

static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Held by a test whose assertions depend on how much CPU its workloads get (right-sizing
/// probes, sensor agreement): such tests run one at a time within a test binary, because on a
/// small machine two of them would each place SCHED_RR training on the same CPUs and measure
/// one another instead of lodger. Other load can still slow them, so their assertions compare
/// figures taken in the same run rather than absolute speeds.
pub fn measuring() -> std::sync::MutexGuard<'static, ()> {
    MEASURING.lock().unwrap_or_else(|e| e.into_inner())
}

/// A name unique to this test process and call, for cgroups and directories.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn bin(name: &str) -> PathBuf {
    match name {
        // LODGER_TEST_LODGERD: another build of lodgerd, for an A/B benchmark run beside
        // this one (two lodgerds measured at the same time see the same machine).
        "lodgerd" => std::env::var_os("LODGER_TEST_LODGERD").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_lodgerd")),
            PathBuf::from,
        ),
        "lodgerctl" => PathBuf::from(env!("CARGO_BIN_EXE_lodgerctl")),
        _ => panic!("unknown binary {name}"),
    }
}

/// Path of a built example (cargo test builds examples before running tests).
pub fn example(name: &str) -> PathBuf {
    let lodgerd = bin("lodgerd");
    let dir = lodgerd.parent().expect("target dir");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build the examples first (cargo test builds them)",
        path.display()
    );
    path
}

/// Polls `cond` until it holds or `timeout` passes. A wait for the system to reach a state, not a
/// timing assertion: the timeout is generous and only bounds a failure.
pub fn wait_until(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// [`wait_until`], and on a time-out the panic also says what `explain` finds then (a status,
/// the daemon's log).
pub fn wait_until_explained(
    timeout: Duration,
    what: &str,
    cond: impl FnMut() -> bool,
    explain: impl FnOnce() -> String,
) {
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(timeout, what, cond)
    }));
    if waited.is_err() {
        panic!(
            "timed out after {timeout:?} waiting for {what}\n{}",
            explain()
        );
    }
}

pub const WAIT: Duration = Duration::from_secs(20);

/// Whether lodgerd starts inference instances as systemd transient units on this host (systemd
/// is PID 1 and its bus answers): lodgerd's own test, so the tests branch as it does.
pub fn instances_are_units() -> bool {
    lodger::enforce::instances::unit::systemd().is_some()
}

/// Waits for a bundled workload's `ready` line on its piped stdout, then keeps draining that pipe
/// on a thread so the workload never blocks on a full pipe. Panics (naming `what`) when the
/// workload exits first.
pub fn wait_ready(child: &mut Child, what: &str) {
    let stdout = child.stdout.take().expect("stdout piped");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("read workload output");
        assert!(n > 0, "{what} exited before it was ready");
        if line.starts_with("ready") {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = reader.read_to_end(&mut sink);
    });
}

impl PrivateBus {
    /// The bus daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A blocking client of lodgerd's manager on this bus: its own runtime and the proxy.
    pub fn manager(
        &self,
    ) -> (
        tokio::runtime::Runtime,
        lodger::api::proxy::ManagerProxy<'static>,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let conn = rt
            .block_on(
                zbus::connection::Builder::address(self.address.as_str())
                    .expect("address")
                    .build(),
            )
            .expect("connect");
        let proxy = rt
            .block_on(lodger::api::proxy::ManagerProxy::new(&conn))
            .expect("proxy");
        (rt, proxy)
    }
}

/// A lodgerd on a private bus, with its own config, state dir and cgroup parent.
pub struct Daemon {
    child: Option<Child>,
    pub bus_address: String,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub parent: String,
    log: PathBuf,
    netns: Option<String>,
    env: Vec<(String, String)>,
}

pub struct DaemonOptions {
    pub reserved: &'static str,
    pub interval_ms: u64,
    /// `node.sysfs_root`: a fixture topology (with `sim`, since its CPUs are not this machine's).
    pub sysfs_root: Option<PathBuf>,
    /// `cgroup.pid_jobs`.
    pub pid_jobs: &'static str,
    /// More TOML tables (not `[node]`, `[agent]`, `[cgroup]` or `[log]`).
    pub extra: String,
    pub sim: bool,
    /// Run lodgerd in this network namespace (`/run/netns/NAME`; only the network namespace,
    /// unlike `ip netns exec`, which would also hide the cgroup mounts under a new /sys).
    pub netns: Option<String>,
    /// More environment for lodgerd (e.g. `LD_LIBRARY_PATH` to a test's fake NVML).
    pub env: Vec<(String, String)>,
}

impl Default for DaemonOptions {
    fn default() -> Self {
        DaemonOptions {
            reserved: "0",
            interval_ms: 100,
            sysfs_root: None,
            pid_jobs: "auto",
            extra: String::new(),
            sim: false,
            netns: None,
            env: Vec::new(),
        }
    }
}

impl Daemon {
    /// Writes a config under `dir` and starts lodgerd; waits until it owns its bus name.
    pub fn start(bus: &PrivateBus, dir: &Path, opts: DaemonOptions) -> Daemon {
        let parent = unique("lodger-test");
        let config = dir.join("lodger.toml");
        // Offline batches on training cores stay the job's unless a test asks for the cut
        // (`inference.training_core_batch_ms`, its own test in tests/lodgers.rs): the cut
        // restarts an instance once, and a debug-built worker is slow enough to get it, which
        // tests counting an instance's CPU time or pids would see as the instance vanishing.
        let extra = if opts.extra.contains("training_core_batch_ms") {
            opts.extra.clone()
        } else if opts.extra.contains("[inference]\n") {
            opts.extra.replacen(
                "[inference]\n",
                "[inference]\ntraining_core_batch_ms = 0\n",
                1,
            )
        } else {
            format!("{}\n[inference]\ntraining_core_batch_ms = 0\n", opts.extra)
        };
        std::fs::write(
            &config,
            format!(
                "[node]\nreserved_cpus = \"{}\"\n{}\n[agent]\ninterval_ms = {}\nstate_dir = \"{}\"\n\n[cgroup]\nparent = \"{}\"\npid_jobs = \"{}\"\n\n[log]\nlevel = \"debug\"\n{}\n",
                opts.reserved,
                opts.sysfs_root
                    .as_ref()
                    .map(|p| format!("sysfs_root = \"{}\"\n", p.display()))
                    .unwrap_or_default(),
                opts.interval_ms,
                dir.join("state").display(),
                parent,
                opts.pid_jobs,
                extra
            ),
        )
        .expect("write config");
        let mut d = Daemon {
            child: None,
            bus_address: bus.address.clone(),
            dir: dir.to_path_buf(),
            config,
            parent,
            log: dir.join("lodgerd.log"),
            netns: opts.netns.clone(),
            env: opts.env.clone(),
        };
        d.restart_with(opts.sim);
        d
    }

    pub fn restart_with(&mut self, sim: bool) {
        self.stop();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let mut cmd = Command::new(bin("lodgerd"));
        cmd.arg("--config")
            .arg(&self.config)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &self.bus_address)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log);
        if sim {
            cmd.arg("--sim");
        }
        if let Some(ns) = &self.netns {
            use std::os::unix::process::CommandExt;
            let netns = std::fs::File::open(Path::new("/run/netns").join(ns)).expect("open netns");
            // SAFETY: setns is async-signal-safe; the file was opened before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(std::io::Error::from)
                });
            }
        }
        self.child = Some(cmd.spawn().expect("spawn lodgerd"));
        let bus = self.bus_address.clone();
        let child = self.child.as_mut().expect("child");
        let log = self.log.clone();
        let mut exited = None;
        wait_until_explained(
            WAIT,
            "lodgerd to own org.lodger1",
            || {
                if let Ok(Some(status)) = child.try_wait() {
                    exited = Some(status);
                    return true;
                }
                Command::new("busctl")
                    .args(["--address", &bus, "status", "org.lodger1"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            },
            // What the new lodgerd was doing instead of serving.
            || std::fs::read_to_string(&log).unwrap_or_default(),
        );
        if let Some(status) = exited {
            panic!(
                "lodgerd exited early ({status}):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
    }

    pub fn restart(&mut self) {
        self.restart_with(false)
    }

    /// SIGKILL and wait: lodgerd crashes, leaving whatever it had set up.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait, as systemd stops it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let _ = child.wait();
        }
    }

    /// SIGHUP, what `systemctl reload lodgerd` sends: re-read the config file.
    pub fn hup(&self) {
        let pid = i32::try_from(self.pid()).expect("pid");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGHUP,
        )
        .expect("SIGHUP lodgerd");
    }

    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .map(|c| c.id())
            .expect("lodgerd is running")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Runs lodgerctl against this daemon.
    pub fn ctl(&self, args: &[&str]) -> Output {
        self.ctl_as(None, args)
    }

    pub fn ctl_as(&self, uid: Option<u32>, args: &[&str]) -> Output {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(bin("lodgerctl"));
        cmd.args(args)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &self.bus_address);
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        cmd.output().expect("run lodgerctl")
    }

    /// Runs lodgerctl and returns its stdout, failing the test (with the daemon's log) when it
    /// does not exit 0.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "lodgerctl {args:?} failed ({}): {}\n--- lodgerd log ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn ctl_json(&self, args: &[&str]) -> serde_json::Value {
        let mut full = vec!["--json"];
        full.extend_from_slice(args);
        let out = self.ctl_ok(&full);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("bad JSON ({e}): {out}"))
    }

    /// Registers a training job by pid; returns its id.
    pub fn register_pid(&self, pid: u32, cores: u32) -> String {
        let v = self.ctl_json(&[
            "register",
            "training",
            "--pid",
            &pid.to_string(),
            "--cores",
            &cores.to_string(),
        ]);
        v["id"].as_str().expect("id").to_string()
    }

    pub fn job(&self, id: &str) -> serde_json::Value {
        self.ctl_json(&["show", id])
    }
}

impl Drop for Daemon {
    /// Leaves nothing behind: a stopped lodgerd keeps its jobs enforced and its instances
    /// running (by design), so the test daemon drains first (every job released, every instance
    /// stopped), then removes its (by then empty) parent cgroup. Should the drain fail, whatever
    /// still carries this lodgerd's mark is killed, so no test leaves a process behind.
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.ctl(&["drain", "--timeout", "30"]);
        }
        self.stop();
        kill_marked(&self.parent);
        remove_cgroup_tree(&self.parent);
    }
}

/// lodgerd for inference tests: no reserved CPU, 1-s layout probes, a 2-s stop grace, and
/// `extra` config lines.
pub fn lodgers_daemon(bus: &PrivateBus, dir: &Path, extra: &str) -> Daemon {
    Daemon::start(
        bus,
        dir,
        DaemonOptions {
            reserved: "",
            extra: format!("[inference]\nprobe_seconds = 1\nstop_grace_seconds = 2\n\n{extra}"),
            ..DaemonOptions::default()
        },
    )
}

/// A temporary directory on tmpfs (/dev/shm) where there is one, else in the default place: for
/// the emulated GPU records, which lodgerd reads every sensing pass. On a disk filesystem a
/// record's rename can wait on writeback that per-CPU kernel workers do, and a test that
/// saturates the emulator's CPU with real-time threads starves those workers, so lodgerd's
/// sensing stalls reading the directory. A real node keeps them in /run, a tmpfs.
pub fn tmpfs_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("lodger-test-")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("tempdir")
}

impl Daemon {
    /// True when lodgerd pins pid jobs by cgroup (its `status` says `pid jobs pinned by cgroup`),
    /// false when by affinity.
    pub fn pins_pid_jobs_by_cgroup(&self) -> bool {
        let status = self.ctl_json(&["status"]);
        let how = status["enforcement"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            how.ends_with("pinned by cgroup") || how.ends_with("pinned by affinity"),
            "unexpected enforcement '{how}'"
        );
        how.ends_with("pinned by cgroup")
    }

    /// The cgroup lodgerd gives pid job `id` when it pins by cgroup: `/PARENT/ID`.
    pub fn job_cgroup(&self, id: &str) -> String {
        format!("/{}/{id}", self.parent)
    }

    /// Proves where pid job `id` (process `pid`, which was in cgroup `before`) was put: pinned by
    /// cgroup, the process is in `/PARENT/ID` and that directory exists (returned, for the
    /// check that it is gone later); pinned by affinity, the process stayed in `before` and no
    /// job cgroup was made (None).
    pub fn prove_job_cgroup(&self, id: &str, pid: u32, before: &Option<String>) -> Option<PathBuf> {
        let job_cg = self.job_cgroup(id);
        let path = cgroup_path(&job_cg);
        if self.pins_pid_jobs_by_cgroup() {
            assert_eq!(
                cpuset_cgroup_of(pid).as_deref(),
                Some(job_cg.as_str()),
                "pinned by cgroup: the process is in the job's cgroup"
            );
            assert!(path.is_dir(), "{} does not exist", path.display());
            Some(path)
        } else {
            assert_eq!(
                &cpuset_cgroup_of(pid),
                before,
                "pinned by affinity: the process stays in its cgroup"
            );
            assert!(!path.exists(), "{} made under affinity", path.display());
            None
        }
    }
}
