//! Instances as systemd transient units, where systemd is PID 1 (docs/security.md): the
//! property list for `StartTransientUnit` (a pure function of what the instance needs), and the
//! few Manager calls lodgerd makes (start, find the main pid, signal, stop), as `systemd-run
//! --uid` does. systemd switches the uid outside lodgerd's sandbox; lodgerd keeps
//! `CAP_SETUID`/`CAP_SETGID` out of its unit. Touches the system bus.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use zbus::zvariant::{Fd, OwnedObjectPath, OwnedValue, Value};

use crate::cpuset::CpuSet;

/// The slices of one lodgerd's instance units, named after its cgroup parent (`[cgroup]
/// parent`, escaped as `systemd-escape` escapes a unit name): `<parent>.slice` and in it
/// `<parent>-instances.slice` (a `-` in a slice's name nests it), which every instance unit
/// runs in. With the default parent, `lodger.slice` and `lodger-instances.slice`. lodgerds
/// with different parents (the tests' daemons, run side by side) never stop each other's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slices {
    pub outer: String,
    pub instances: String,
}

impl Slices {
    pub fn of_parent(parent: &str) -> Slices {
        let name = escape(parent.trim_matches('/'));
        Slices {
            outer: format!("{name}.slice"),
            instances: format!("{name}-instances.slice"),
        }
    }

    /// The instances' slice's cgroup, relative to the cgroup2 root.
    pub fn cgroup(&self) -> std::path::PathBuf {
        Path::new(&self.outer).join(&self.instances)
    }
}

/// `text` as one component of a unit name (`systemd-escape`, unit names in `systemd.unit(5)`):
/// ASCII letters, digits, `:`, `_` and `.` (not leading) stay; `/` becomes `-`; every other
/// byte, `-` included, becomes `\xNN`.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, b) in text.bytes().enumerate() {
        match b {
            b'/' => out.push('-'),
            b'.' if i > 0 => out.push('.'),
            b if b.is_ascii_alphanumeric() || b == b':' || b == b'_' => out.push(char::from(b)),
            b => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out
}
const DEST: &str = "org.freedesktop.systemd1";
/// The system bus's well-known socket (the D-Bus specification's default).
const SYSTEM_BUS: &str = "unix:path=/var/run/dbus/system_bus_socket";
const PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
/// How long a started unit may take to show its main pid.
const START_WAIT: Duration = Duration::from_secs(10);
const STEP: Duration = Duration::from_millis(10);

/// The shell line every unit runs: the report pipe arrives as stdin and moves to descriptor 3
/// (so the instance sees the protocol of `docs/instance-protocol.md` unchanged), stdin becomes
/// /dev/null, the caller's `--output` file (`$1`, may be empty) is opened as the owner, and the
/// instance's own command replaces the shell. systemd 252 has no `OpenFile=`; a descriptor given
/// as `StandardInputFileDescriptor` works on every systemd lodger supports.
pub const WRAPPER: &str =
    "exec 3>&0 </dev/null; if [ -n \"$1\" ]; then exec >>\"$1\" 2>&1; fi; shift; exec \"$@\"";
/// `$0` of the wrapper, as `ps` shows it until the exec.
const WRAPPER_NAME: &str = "lodger-instance";
const SHELL: &str = "/bin/sh";

/// Where the unit's stdout and stderr go when the caller named no file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitOutput {
    Journal,
    Null,
    /// A descriptor lodgerd opened (the operator's `[inference]` output directory).
    Descriptor,
}

/// What one instance unit needs: built from the spec and the resolved identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSpec {
    pub name: String,
    pub description: String,
    /// The instance key, for the journal field.
    pub instance: String,
    pub job: String,
    /// lodger's slices: it runs in [`Slices::instances`].
    pub slices: Slices,
    pub user: String,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub cwd: String,
    /// The instance's whole environment (`NAME=value`).
    pub env: Vec<String>,
    /// Program (absolute) and arguments.
    pub argv: Vec<String>,
    /// The caller's `--output` file, opened by the wrapper as the owner.
    pub output_file: Option<String>,
    pub output: UnitOutput,
    pub cpus: CpuSet,
    pub stop_grace: Duration,
    /// `MemoryMax=` in bytes, with `MemoryHigh=` at `memory_high_percent` of it.
    pub memory_max: Option<u64>,
    pub memory_high_percent: u8,
    /// `NetworkNamespacePath=`: lodgerd's own network namespace when it is not PID 1's
    /// (lodgerd run in one, as the network tests do), so that an instance reaches what lodgerd
    /// reaches, as a forked one would. `None` on a host daemon.
    pub netns: Option<String>,
}

/// `/proc/<lodgerd>/ns/net` when lodgerd's network namespace is not PID 1's (see
/// [`UnitSpec::netns`]); `None` when they are the same or either cannot be read.
pub fn own_netns() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let mine = std::fs::metadata("/proc/self/ns/net").ok()?;
    let init = std::fs::metadata("/proc/1/ns/net").ok()?;
    ((mine.dev(), mine.ino()) != (init.dev(), init.ino()))
        .then(|| format!("/proc/{}/ns/net", std::process::id()))
}

/// A property value as `StartTransientUnit` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prop {
    Str(String),
    Bool(bool),
    Strs(Vec<String>),
    Bytes(Vec<u8>),
    /// `aay` (`LogExtraFields`: `FIELD=value` as bytes).
    ByteStrs(Vec<Vec<u8>>),
    U64(u64),
    I32(i32),
    /// `a(sasb)`: path, argv, ignore failure.
    Exec(Vec<(String, Vec<String>, bool)>),
    /// A descriptor passed with the call (the report pipe, or lodgerd's output file).
    Fd(FdRole),
}

/// Which descriptor a [`Prop::Fd`] stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdRole {
    Report,
    Output,
}

/// The bit mask `CPUAffinity=` takes: byte i, bit j is CPU 8i+j.
pub fn cpu_mask(cpus: &CpuSet) -> Vec<u8> {
    let mut mask = Vec::new();
    for cpu in cpus.iter() {
        let byte = (cpu / 8) as usize;
        if mask.len() <= byte {
            mask.resize(byte + 1, 0);
        }
        mask[byte] |= 1 << (cpu % 8);
    }
    mask
}

/// `arg` as systemd passes it on unchanged: its `ExecStart` substitutes the unit's environment
/// into the arguments (a word `$X`, `${X}` in a word) and reads `$$` as `$`, where a forked
/// instance gets its arguments as they are; every `$` doubled undoes that. (`ExecStartEx` with
/// `no-env-expand` would too, from systemd 243 on.)
fn literal_for_exec(arg: &str) -> String {
    arg.replace('$', "$$")
}

/// The properties of an instance's transient service (pure: spec in, list out).
pub fn properties(spec: &UnitSpec) -> Vec<(&'static str, Prop)> {
    let s = |v: &str| Prop::Str(v.to_string());
    let argv: Vec<String> = [
        SHELL,
        "-c",
        WRAPPER,
        WRAPPER_NAME,
        spec.output_file.as_deref().unwrap_or_default(),
    ]
    .into_iter()
    .chain(spec.argv.iter().map(String::as_str))
    .map(literal_for_exec)
    .collect();
    let mut props = vec![
        ("Description", s(&spec.description)),
        ("Type", s("exec")),
        ("Slice", s(&spec.slices.instances)),
        ("User", s(&spec.user)),
        ("Group", Prop::Str(spec.gid.to_string())),
        (
            "SupplementaryGroups",
            Prop::Strs(spec.groups.iter().map(u32::to_string).collect()),
        ),
        ("WorkingDirectory", s(&spec.cwd)),
        ("Environment", Prop::Strs(spec.env.clone())),
        ("NoNewPrivileges", Prop::Bool(true)),
        // The OOM killer takes a lodger before any training process.
        ("OOMScoreAdjust", Prop::I32(super::LODGER_OOM_SCORE_ADJ)),
        ("CPUAffinity", Prop::Bytes(cpu_mask(&spec.cpus))),
        (
            "ExecStart",
            Prop::Exec(vec![(SHELL.to_string(), argv, false)]),
        ),
        ("StandardInputFileDescriptor", Prop::Fd(FdRole::Report)),
        ("CollectMode", s("inactive-or-failed")),
        ("KillMode", s("control-group")),
        ("SendSIGKILL", Prop::Bool(true)),
        (
            "TimeoutStopUSec",
            Prop::U64(u64::try_from(spec.stop_grace.as_micros()).unwrap_or(u64::MAX)),
        ),
        (
            "LogExtraFields",
            Prop::ByteStrs(vec![
                format!("LODGER_JOB={}", spec.job).into_bytes(),
                format!("LODGER_INSTANCE={}", spec.instance).into_bytes(),
            ]),
        ),
        (
            "SyslogIdentifier",
            Prop::Str(format!("lodger-{}", spec.job)),
        ),
    ];
    if let Some(path) = &spec.netns {
        props.push(("NetworkNamespacePath", s(path)));
    }
    if let Some(max) = spec.memory_max {
        props.push(("MemoryMax", Prop::U64(max)));
        props.push((
            "MemoryHigh",
            Prop::U64(crate::job::memory::high_of(max, spec.memory_high_percent)),
        ));
    }
    match spec.output {
        UnitOutput::Journal => {
            props.push(("StandardOutput", s("journal")));
            props.push(("StandardError", s("journal")));
        }
        UnitOutput::Null => {
            props.push(("StandardOutput", s("null")));
            props.push(("StandardError", s("null")));
        }
        UnitOutput::Descriptor => {
            props.push(("StandardOutputFileDescriptor", Prop::Fd(FdRole::Output)));
            props.push(("StandardErrorFileDescriptor", Prop::Fd(FdRole::Output)));
        }
    }
    props
}

/// A unit name for one start of instance `key` (`lodger-<key>-<lodgerd pid>-<n>.service`): a
/// new name per start, so a restart never meets the previous unit still being collected.
/// Characters a unit name may not hold become `_`.
pub fn unit_name(key: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let safe: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("lodger-{safe}-{}-{n}.service", std::process::id())
}

/// A connection to systemd on the system bus, with its own small runtime: the instance
/// supervisor is driven from a plain thread.
pub struct Systemd {
    rt: tokio::runtime::Runtime,
    conn: zbus::Connection,
    /// How long a start may take ([`START_WAIT`]; shorter in tests).
    start_wait: Duration,
}

static SYSTEMD: OnceLock<Option<Systemd>> = OnceLock::new();

/// systemd, if this process has already connected to it (an instance unit was asked for).
pub fn connected() -> Option<&'static Systemd> {
    SYSTEMD.get().and_then(Option::as_ref)
}

/// systemd, when it is PID 1 (`/run/systemd/system` exists) and its bus answers; looked up
/// once. `None`: instances are forked by lodgerd.
pub fn systemd() -> Option<&'static Systemd> {
    SYSTEMD
        .get_or_init(|| {
            if !Path::new("/run/systemd/system").is_dir() {
                return None;
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            // systemd answers on the real system bus, whatever bus lodgerd serves its own API on
            // (`DBUS_SYSTEM_BUS_ADDRESS` may name a private one: the tests, the demo).
            let connect = || async {
                zbus::connection::Builder::address(SYSTEM_BUS)?
                    .build()
                    .await
            };
            match outside_runtime(|| rt.block_on(connect())) {
                Ok(conn) => Some(Systemd {
                    rt,
                    conn,
                    start_wait: START_WAIT,
                }),
                Err(e) => {
                    tracing::warn!("systemd is PID 1 but its bus does not answer ({e}): lodgerd forks instances itself");
                    // Dropping a runtime may panic inside another runtime; this may not.
                    rt.shutdown_background();
                    None
                }
            }
        })
        .as_ref()
}

/// Runs `f` on this thread, or on a short-lived one if this thread is inside a tokio runtime
/// (where `block_on` may not be called).
fn outside_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|s| match s.spawn(f).join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

fn to_value<'a>(
    prop: &'a Prop,
    report: BorrowedFd<'a>,
    output: Option<BorrowedFd<'a>>,
) -> Value<'a> {
    match prop {
        Prop::Str(v) => Value::from(v.as_str()),
        Prop::Bool(v) => Value::from(*v),
        Prop::Strs(v) => Value::from(v.clone()),
        Prop::Bytes(v) => Value::from(v.clone()),
        Prop::ByteStrs(v) => Value::from(v.clone()),
        Prop::U64(v) => Value::from(*v),
        Prop::I32(v) => Value::from(*v),
        Prop::Exec(v) => Value::from(v.clone()),
        Prop::Fd(FdRole::Report) => Value::from(Fd::from(report)),
        Prop::Fd(FdRole::Output) => match output {
            Some(fd) => Value::from(Fd::from(fd)),
            None => Value::from(Fd::from(report)),
        },
    }
}

impl Systemd {
    /// A client of the systemd at `address` (a test's fake on a private bus) that waits
    /// `start_wait` for a start.
    #[cfg(test)]
    pub(super) fn at(address: &str, start_wait: Duration) -> zbus::Result<Systemd> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let conn = outside_runtime(|| {
            rt.block_on(async { zbus::connection::Builder::address(address)?.build().await })
        })?;
        Ok(Systemd {
            rt,
            conn,
            start_wait,
        })
    }

    fn call<B, R>(&self, iface: &str, path: &str, method: &str, body: &B) -> zbus::Result<R>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType + Sync,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d> + Send,
    {
        outside_runtime(|| {
            self.rt.block_on(async {
                let reply = self
                    .conn
                    .call_method(Some(DEST), path, Some(iface), method, body)
                    .await?;
                reply.body().deserialize::<R>()
            })
        })
    }

    /// Starts the unit and waits until it has a main process: its pid. Mode `replace`: a stop
    /// of lodger's slices still queued (the last instance went a moment ago, see
    /// [`stop_slices`]) gives way to the start instead of refusing it
    /// (`TransactionIsDestructive`).
    pub fn start(
        &self,
        spec: &UnitSpec,
        report: &OwnedFd,
        output: Option<&OwnedFd>,
    ) -> Result<u32, String> {
        self.wait_for_slice_jobs(&spec.slices);
        let props = properties(spec);
        let body: Vec<(&str, Value<'_>)> = props
            .iter()
            .map(|(k, p)| (*k, to_value(p, report.as_fd(), output.map(AsFd::as_fd))))
            .collect();
        let aux: Vec<(&str, Vec<(&str, Value<'_>)>)> = Vec::new();
        let _job: OwnedObjectPath = self
            .call(
                MANAGER,
                PATH,
                "StartTransientUnit",
                &(spec.name.as_str(), "replace", body, aux),
            )
            .map_err(|e| format!("systemd refused to start {}: {e}", spec.name))?;
        let started = self.main_pid(&spec.name);
        if started.is_err() {
            // Not lodger's instance, since no slot holds it: a unit that comes up late (a slow
            // start, past START_WAIT) would run untracked beside the one started next.
            self.abandon(&spec.name);
        }
        started
    }

    /// Waits (at most [`START_WAIT`]) until the unit just started has a main process: its pid.
    fn main_pid(&self, name: &str) -> Result<u32, String> {
        let deadline = Instant::now() + self.start_wait;
        loop {
            let unit: OwnedObjectPath = self
                .call(MANAGER, PATH, "GetUnit", &(name,))
                .map_err(|e| format!("{} is gone at start: {e}", name))?;
            // `Type=exec`: the unit is activating until the wrapper has been executed. systemd
            // names the main pid as soon as it has forked, while that process still carries
            // PID 1's environment (not yet lodger's marks, which a restarted lodgerd adopts by):
            // the pid is handed on only once the exec is done.
            let state = self.active_state(&unit);
            if state != "activating" {
                let pid = self.property(&unit, "org.freedesktop.systemd1.Service", "MainPID");
                if let Some(pid) = pid.and_then(|v| u32::try_from(v).ok()).filter(|&p| p != 0) {
                    return Ok(pid);
                }
                // Inactive with its start job still queued (a busy manager) is not over yet.
                let queued = self
                    .pending_job(&unit)
                    .is_some_and(|id| id != 0 && state == "inactive");
                // Over only if the state read after the job still says so: a slow manager may
                // have run the whole start job between the reads above (seen in the VM suite).
                if (state == "failed" || state == "inactive")
                    && !queued
                    && self.active_state(&unit) == state
                {
                    return Err(format!(
                        "{} did not start ({state}; `journalctl -u {}` says why)",
                        name, name
                    ));
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} has no main process after {:?}",
                    name, self.start_wait
                ));
            }
            std::thread::sleep(STEP);
        }
    }

    /// Waits (at most [`START_WAIT`]) until neither of lodger's slices has a job pending: a
    /// stop of them issued when the last instance went ([`stop_slices`]) is finished before a
    /// new unit is started in them. Started while that stop was still running, the new unit was
    /// stopped with the slice (seen in the VM suite: a restarted instance that "did not start
    /// (inactive)").
    fn wait_for_slice_jobs(&self, slices: &Slices) {
        let deadline = Instant::now() + self.start_wait;
        for slice in [&slices.instances, &slices.outer] {
            // Not loaded: nothing pending.
            let Ok(unit) =
                self.call::<_, OwnedObjectPath>(MANAGER, PATH, "GetUnit", &(slice.as_str(),))
            else {
                continue;
            };
            while Instant::now() < deadline {
                match self.pending_job(&unit) {
                    Some(id) if id != 0 => std::thread::sleep(STEP),
                    _ => break,
                }
            }
        }
    }

    fn active_state(&self, unit: &OwnedObjectPath) -> String {
        self.property(unit, "org.freedesktop.systemd1.Unit", "ActiveState")
            .and_then(|v| String::try_from(v).ok())
            .unwrap_or_default()
    }

    /// The id of the job queued for the unit (0: none), if systemd says.
    fn pending_job(&self, unit: &OwnedObjectPath) -> Option<u32> {
        self.property(unit, "org.freedesktop.systemd1.Unit", "Job")
            .and_then(|v| <(u32, OwnedObjectPath)>::try_from(v).ok())
            .map(|(id, _)| id)
    }

    fn property(&self, unit: &OwnedObjectPath, iface: &str, name: &str) -> Option<OwnedValue> {
        self.call(
            "org.freedesktop.DBus.Properties",
            unit.as_str(),
            "Get",
            &(iface, name),
        )
        .ok()
    }

    /// The unit's `Environment=`: what an instance unit's processes got from lodgerd, for a
    /// lodgerd whose sandbox may not read their `/proc/PID/environ` (another uid, or root with
    /// capabilities lodgerd's unit lacks: reading it takes ptrace rights). `None` when the unit
    /// is gone or has none.
    pub fn environment(&self, name: &str) -> Option<Vec<String>> {
        let unit: OwnedObjectPath = self.call(MANAGER, PATH, "GetUnit", &(name,)).ok()?;
        let env = self.property(&unit, "org.freedesktop.systemd1.Service", "Environment")?;
        Vec::<String>::try_from(env).ok()
    }

    /// Sends `signal` to every process of the unit.
    pub fn kill(&self, name: &str, signal: i32) -> zbus::Result<()> {
        self.call(MANAGER, PATH, "KillUnit", &(name, "all", signal))
    }

    /// Kills and stops a unit that will not be supervised (its start failed after systemd
    /// took it), best effort.
    pub fn abandon(&self, name: &str) {
        let _ = self.kill(name, libc::SIGKILL);
        let _ = self.stop(name);
    }

    /// Stops the unit: systemd sends SIGTERM, then SIGKILL after `TimeoutStopUSec`.
    pub fn stop(&self, name: &str) -> zbus::Result<()> {
        let _job: OwnedObjectPath = self.call(MANAGER, PATH, "StopUnit", &(name, "replace"))?;
        Ok(())
    }
}

/// Stops lodger's slices (every instance unit in them, SIGTERM then SIGKILL after their grace):
/// at lodgerd's start (what an earlier one left) and when no instance is left, so no cgroup of
/// lodger's outlives it. Slices that were never started are not an error.
pub fn stop_slices(slices: &Slices) {
    stop_slices_of(systemd(), slices);
}

fn stop_slices_of(systemd: Option<&Systemd>, slices: &Slices) {
    if let Some(systemd) = systemd {
        for slice in [&slices.instances, &slices.outer] {
            let _ = systemd.stop(slice);
        }
    }
}

/// [`stop_slices`], only if this process has talked to systemd (when its supervisor goes away).
pub fn stop_slices_if_connected(slices: &Slices) {
    stop_slices_of(connected(), slices);
}

#[cfg(test)]
#[path = "unit_fake_tests.rs"]
mod fake_tests;

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn spec() -> UnitSpec {
        UnitSpec {
            name: unit_name("job/1-0"),
            description: "lodger instance job-0".into(),
            instance: "job-0".into(),
            job: "job".into(),
            slices: Slices::of_parent("lodger"),
            user: "alice".into(),
            gid: 1001,
            groups: vec![1001, 27],
            cwd: "/home/alice".into(),
            env: vec!["PATH=/usr/bin".into(), "LODGER_REPORT_FD=3".into()],
            argv: vec!["/usr/bin/serve".into(), "--threads".into(), "4".into()],
            output_file: None,
            output: UnitOutput::Journal,
            cpus: [0, 1, 9].into_iter().collect(),
            stop_grace: Duration::from_secs(10),
            memory_max: Some(1 << 30),
            memory_high_percent: 90,
            netns: None,
        }
    }

    fn get<'a>(props: &'a [(&str, Prop)], key: &str) -> Vec<&'a Prop> {
        props
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, p)| p)
            .collect()
    }

    /// The default parent gives the slices docs/security.md names; another parent, slices of
    /// its own, outside `lodger.slice` (a `-` would nest them in it), escaped as systemd does.
    #[test]
    fn slices_are_named_after_the_cgroup_parent() {
        let default = Slices::of_parent("lodger");
        assert_eq!(default.outer, "lodger.slice");
        assert_eq!(default.instances, "lodger-instances.slice");
        assert_eq!(
            default.cgroup(),
            Path::new("lodger.slice/lodger-instances.slice")
        );
        let test = Slices::of_parent("/lodger-test-70-1/");
        assert_eq!(test.outer, "lodger\\x2dtest\\x2d70\\x2d1.slice");
        assert_eq!(
            test.instances,
            "lodger\\x2dtest\\x2d70\\x2d1-instances.slice"
        );
        assert_eq!(escape("a/b c.d"), "a-b\\x20c.d");
        assert_eq!(escape(".x"), "\\x2ex");
    }

    /// systemd substitutes the unit's environment into `ExecStart` (a word `$X`, `${X}`) and
    /// reads `$$` as `$`: every `$` of the owner's arguments (and the wrapper's) is doubled, so
    /// the instance gets them as written, as a forked one does.
    #[test]
    fn dollars_in_an_instances_arguments_reach_it_as_written() {
        let mut spec = spec();
        spec.argv = vec!["/usr/bin/serve".into(), "$HOME".into(), "a$$b${X}".into()];
        spec.output_file = Some("/srv/$out".into());
        let props = properties(&spec);
        let [Prop::Exec(exec)] = get(&props, "ExecStart").as_slice() else {
            panic!("one ExecStart");
        };
        let [(_, argv, _)] = exec.as_slice() else {
            panic!("{exec:?}");
        };
        assert_eq!(argv[4], "/srv/$$out");
        assert_eq!(argv[5..], ["/usr/bin/serve", "$$HOME", "a$$$$b$${X}"]);
        assert!(!argv[2].replace("$$", "").contains('$'), "{}", argv[2]);
    }

    #[test]
    fn an_instance_unit_runs_as_its_owner_in_lodgers_slice() {
        let spec = spec();
        let props = properties(&spec);
        let str_of = |k: &str| match get(&props, k).as_slice() {
            [Prop::Str(v)] => v.clone(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(str_of("User"), "alice");
        assert_eq!(str_of("Group"), "1001");
        assert_eq!(str_of("Slice"), "lodger-instances.slice");
        assert_eq!(str_of("WorkingDirectory"), "/home/alice");
        assert_eq!(str_of("CollectMode"), "inactive-or-failed");
        assert_eq!(str_of("StandardOutput"), "journal");
        assert_eq!(
            get(&props, "SupplementaryGroups"),
            [&Prop::Strs(vec!["1001".into(), "27".into()])]
        );
        assert_eq!(get(&props, "NoNewPrivileges"), [&Prop::Bool(true)]);
        assert_eq!(get(&props, "Environment"), [&Prop::Strs(spec.env.clone())]);
        // CPUs 0, 1 and 9: bits 0 and 1 of byte 0, bit 1 of byte 1.
        assert_eq!(get(&props, "CPUAffinity"), [&Prop::Bytes(vec![0b11, 0b10])]);
        assert_eq!(get(&props, "TimeoutStopUSec"), [&Prop::U64(10_000_000)]);
        assert_eq!(get(&props, "OOMScoreAdjust"), [&Prop::I32(1000)]);
        assert_eq!(get(&props, "MemoryMax"), [&Prop::U64(1 << 30)]);
        assert_eq!(
            get(&props, "MemoryHigh"),
            [&Prop::U64(966_365_184)],
            "90%, down to a whole page"
        );
        assert_eq!(
            get(&props, "LogExtraFields"),
            [&Prop::ByteStrs(vec![
                b"LODGER_JOB=job".to_vec(),
                b"LODGER_INSTANCE=job-0".to_vec()
            ])]
        );
        assert_eq!(
            get(&props, "StandardInputFileDescriptor"),
            [&Prop::Fd(FdRole::Report)]
        );
        let [Prop::Exec(exec)] = get(&props, "ExecStart").as_slice() else {
            panic!("one ExecStart");
        };
        let [(path, argv, false)] = exec.as_slice() else {
            panic!("{exec:?}");
        };
        assert_eq!(path, SHELL);
        let wrapper = WRAPPER.replace('$', "$$");
        assert_eq!(argv[..5], [SHELL, "-c", &wrapper, WRAPPER_NAME, ""]);
        assert_eq!(argv[5..], spec.argv[..]);
        let names: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(
            unique.len(),
            names.len(),
            "a property given twice: {names:?}"
        );
    }

    #[test]
    fn output_goes_to_the_callers_file_lodgerds_descriptor_or_nowhere() {
        let mut spec = spec();
        spec.output_file = Some("/home/alice/out.log".into());
        spec.output = UnitOutput::Descriptor;
        let props = properties(&spec);
        let [Prop::Exec(exec)] = get(&props, "ExecStart").as_slice() else {
            panic!("one ExecStart");
        };
        assert_eq!(exec[0].1[4], "/home/alice/out.log");
        assert_eq!(
            get(&props, "StandardOutputFileDescriptor"),
            [&Prop::Fd(FdRole::Output)]
        );
        assert!(get(&props, "StandardOutput").is_empty());
        spec.output = UnitOutput::Null;
        let props = properties(&spec);
        assert_eq!(get(&props, "StandardError"), [&Prop::Str("null".into())]);
    }

    #[test]
    fn every_property_has_the_signature_systemd_takes() {
        // org.freedesktop.systemd1(5): the types StartTransientUnit accepts for these names.
        let want = [
            ("Description", "s"),
            ("Type", "s"),
            ("Slice", "s"),
            ("User", "s"),
            ("Group", "s"),
            ("SupplementaryGroups", "as"),
            ("WorkingDirectory", "s"),
            ("Environment", "as"),
            ("NoNewPrivileges", "b"),
            ("OOMScoreAdjust", "i"),
            ("MemoryMax", "t"),
            ("MemoryHigh", "t"),
            ("CPUAffinity", "ay"),
            ("ExecStart", "a(sasb)"),
            ("StandardInputFileDescriptor", "h"),
            ("StandardOutputFileDescriptor", "h"),
            ("StandardErrorFileDescriptor", "h"),
            ("CollectMode", "s"),
            ("KillMode", "s"),
            ("SendSIGKILL", "b"),
            ("TimeoutStopUSec", "t"),
            ("LogExtraFields", "aay"),
            ("SyslogIdentifier", "s"),
            ("NetworkNamespacePath", "s"),
        ];
        let mut spec = spec();
        spec.output = UnitOutput::Descriptor;
        spec.netns = Some("/proc/70/ns/net".into());
        let (read, write) = crate::enforce::instances::spawn::report_pipe().unwrap();
        for (name, prop) in properties(&spec) {
            let value = to_value(&prop, write.as_fd(), Some(read.as_fd()));
            let sig = value.value_signature().to_string();
            let expected = want.iter().find(|(n, _)| *n == name).map(|(_, s)| *s);
            assert_eq!(Some(sig.as_str()), expected, "{name}");
        }
    }

    #[test]
    fn unit_names_are_valid_and_new_for_every_start() {
        let a = unit_name("train/x y-0");
        let b = unit_name("train/x y-0");
        assert_ne!(a, b);
        assert!(a.starts_with("lodger-train_x_y-0-"), "{a}");
        assert!(a.ends_with(".service"));
        assert!(a
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c)));
    }

    #[test]
    fn the_wrapper_hands_the_report_pipe_to_descriptor_3_and_runs_the_command() {
        // The wrapper as systemd runs it, with stdin standing in for the report pipe.
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let report = dir.path().join("report");
        let status = std::process::Command::new(SHELL)
            .args(["-c", WRAPPER, WRAPPER_NAME])
            .arg(&out)
            .args(["/bin/sh", "-c", "echo report >&3; echo hello; cat"])
            .stdin(std::fs::File::create(&report).unwrap())
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(std::fs::read_to_string(&report).unwrap(), "report\n");
        // `cat` read /dev/null, not the report pipe.
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "hello\n");
    }
}
