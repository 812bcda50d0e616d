//! [`Systemd`] against a fake systemd on a private bus: what lodgerd does when an instance unit's
//! start is refused, fails or never gets a main process (the unit is killed and stopped, the
//! error says why), that a start is handed on with the unit's main pid, and that a start waits for
//! a pending stop of lodger's slices. The fake answers the Manager methods and the Unit and
//! Service properties lodgerd uses, with systemd's signatures (`org.freedesktop.systemd1(5)`), so
//! a call lodgerd makes with the wrong arguments fails here as it would against systemd. Needs
//! `dbus-daemon`, as the end-to-end tests do.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zbus::zvariant::{OwnedObjectPath, OwnedValue};

use super::tests::spec;
use super::*;

#[path = "../../../tests/common/bus.rs"]
mod bus;

/// What the fake's next started unit does.
#[derive(Debug, Clone, Copy)]
enum Start {
    /// StartTransientUnit is refused (as systemd refuses a bad property).
    Refuse,
    /// Active at once, then failed: its program could not be run.
    Fail,
    /// Activating for ever.
    Hang,
    /// Activating for this many looks, then active with this main pid.
    ActiveAfter(u32, u32),
    /// Inactive with its start job still queued (a busy manager) for this many looks, then
    /// active with this main pid.
    QueuedFor(u32, u32),
    /// Inactive at the first look, with no main pid yet, and then, the start job having run
    /// meanwhile (a slow manager), no job and active with this main pid.
    RanBetweenLooks(u32),
}

#[derive(Debug)]
struct Script {
    start: Start,
    /// Every Manager call, as `Method name args`.
    calls: Vec<String>,
    /// Looks at the started unit's state so far.
    looks: u32,
    /// Properties of the last StartTransientUnit, by name.
    properties: BTreeMap<String, String>,
    /// Looks at lodger's instances slice during which it still has a job queued.
    slice_busy_for: u32,
}

type Shared = Arc<Mutex<Script>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Script> {
    match s.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

const UNIT_PATH: &str = "/org/freedesktop/systemd1/unit/started";
const SLICE_PATH: &str = "/org/freedesktop/systemd1/unit/slice";

struct FakeManager {
    script: Shared,
    started: Mutex<Option<String>>,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Manager")]
impl FakeManager {
    async fn start_transient_unit(
        &self,
        #[zbus(object_server)] server: &zbus::ObjectServer,
        name: String,
        mode: String,
        properties: Vec<(String, OwnedValue)>,
        aux: Vec<(String, Vec<(String, OwnedValue)>)>,
    ) -> zbus::fdo::Result<OwnedObjectPath> {
        let start = {
            let mut s = lock(&self.script);
            s.calls.push(format!(
                "StartTransientUnit {name} {mode} aux={}",
                aux.len()
            ));
            s.properties = properties
                .iter()
                .map(|(k, v)| (k.clone(), format!("{v:?}")))
                .collect();
            s.start
        };
        if let Start::Refuse = start {
            return Err(zbus::fdo::Error::InvalidArgs(
                "Invalid unit name or type.".into(),
            ));
        }
        if let Ok(mut started) = self.started.lock() {
            *started = Some(name);
        }
        let unit = FakeUnit {
            script: self.script.clone(),
        };
        server.at(UNIT_PATH, unit.clone()).await?;
        server.at(UNIT_PATH, FakeService(unit)).await?;
        path("/org/freedesktop/systemd1/job/1")
    }

    async fn get_unit(&self, name: String) -> zbus::fdo::Result<OwnedObjectPath> {
        lock(&self.script).calls.push(format!("GetUnit {name}"));
        let started = self.started.lock().ok().and_then(|s| s.clone());
        if started.as_deref() == Some(name.as_str()) {
            return path(UNIT_PATH);
        }
        if name == Slices::of_parent("lodger").instances {
            return path(SLICE_PATH);
        }
        Err(zbus::fdo::Error::Failed(format!("Unit {name} not loaded.")))
    }

    async fn kill_unit(&self, name: String, whom: String, signal: i32) -> zbus::fdo::Result<()> {
        lock(&self.script)
            .calls
            .push(format!("KillUnit {name} {whom} {signal}"));
        Ok(())
    }

    async fn stop_unit(&self, name: String, mode: String) -> zbus::fdo::Result<OwnedObjectPath> {
        lock(&self.script)
            .calls
            .push(format!("StopUnit {name} {mode}"));
        path("/org/freedesktop/systemd1/job/2")
    }
}

fn path(p: &str) -> zbus::fdo::Result<OwnedObjectPath> {
    OwnedObjectPath::try_from(p).map_err(|e| zbus::fdo::Error::Failed(e.to_string()))
}

/// The started unit's `org.freedesktop.systemd1.Unit` side.
#[derive(Clone)]
struct FakeUnit {
    script: Shared,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Unit")]
impl FakeUnit {
    #[zbus(property)]
    fn active_state(&self) -> String {
        let mut s = lock(&self.script);
        s.looks += 1;
        match s.start {
            Start::Refuse | Start::Hang => "activating",
            Start::Fail => "failed",
            Start::ActiveAfter(n, _) if s.looks <= n => "activating",
            Start::QueuedFor(n, _) if s.looks <= n => "inactive",
            Start::RanBetweenLooks(_) if s.looks <= 1 => "inactive",
            Start::ActiveAfter(..) | Start::QueuedFor(..) | Start::RanBetweenLooks(_) => "active",
        }
        .to_string()
    }

    #[zbus(property)]
    fn job(&self) -> (u32, OwnedObjectPath) {
        let s = lock(&self.script);
        match s.start {
            Start::QueuedFor(n, _) if s.looks <= n => (
                5,
                OwnedObjectPath::try_from("/org/freedesktop/systemd1/job/5").unwrap_or_default(),
            ),
            _ => (0, OwnedObjectPath::default()),
        }
    }
}

/// The started unit's `org.freedesktop.systemd1.Service` side.
struct FakeService(FakeUnit);

#[zbus::interface(name = "org.freedesktop.systemd1.Service")]
impl FakeService {
    /// 0 until the unit is active, as systemd's is for a unit that has not run its process.
    #[zbus(property, name = "MainPID")]
    fn main_pid(&self) -> u32 {
        let s = lock(&self.0.script);
        match s.start {
            Start::ActiveAfter(n, pid) | Start::QueuedFor(n, pid) if s.looks > n => pid,
            Start::RanBetweenLooks(pid) if s.looks > 1 => pid,
            _ => 0,
        }
    }
}

/// lodger's instances slice, with a stop job queued for a while.
struct FakeSlice {
    script: Shared,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Unit")]
impl FakeSlice {
    #[zbus(property)]
    fn job(&self) -> (u32, OwnedObjectPath) {
        let mut s = lock(&self.script);
        s.calls.push("slice Job".to_string());
        if s.slice_busy_for > 0 {
            s.slice_busy_for -= 1;
            let job =
                OwnedObjectPath::try_from("/org/freedesktop/systemd1/job/9").unwrap_or_default();
            return (9, job);
        }
        (0, OwnedObjectPath::default())
    }
}

/// A private bus with the fake systemd on it, and a client of it.
struct Fake {
    _rt: tokio::runtime::Runtime,
    _server: zbus::Connection,
    script: Shared,
    client: Systemd,
    // Last: the bus outlives the connections to it.
    _bus: bus::PrivateBus,
}

impl Fake {
    fn start(start: Start, start_wait: Duration) -> Fake {
        let bus = bus::PrivateBus::start();
        let script = Arc::new(Mutex::new(Script {
            start,
            calls: Vec::new(),
            looks: 0,
            properties: BTreeMap::new(),
            slice_busy_for: 0,
        }));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let manager = FakeManager {
            script: script.clone(),
            started: Mutex::new(None),
        };
        let slice = FakeSlice {
            script: script.clone(),
        };
        let server = rt
            .block_on(async {
                zbus::connection::Builder::address(bus.address.as_str())?
                    .name(DEST)?
                    .serve_at(PATH, manager)?
                    .serve_at(SLICE_PATH, slice)?
                    .build()
                    .await
            })
            .expect("fake systemd");
        let client = Systemd::at(&bus.address, start_wait).expect("client");
        Fake {
            _rt: rt,
            _server: server,
            script,
            client,
            _bus: bus,
        }
    }

    /// Starts the usual unit spec; the report pipe as lodgerd passes it.
    fn start_unit(&self) -> (UnitSpec, Result<u32, String>) {
        let spec = spec();
        let (report, _writer) = nix::unistd::pipe().expect("pipe");
        let result = self.client.start(&spec, &report, None);
        (spec, result)
    }

    fn calls(&self) -> Vec<String> {
        lock(&self.script).calls.clone()
    }

    /// The Manager calls that change something (not the lookups).
    fn changes(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter(|c| !c.starts_with("GetUnit") && !c.starts_with("slice"))
            .collect()
    }
}

#[test]
fn a_start_systemd_refuses_says_so_and_leaves_nothing_to_stop() {
    let fake = Fake::start(Start::Refuse, Duration::from_secs(10));
    let (spec, result) = fake.start_unit();
    let err = result.expect_err("refused");
    assert!(
        err.starts_with(&format!("systemd refused to start {}:", spec.name))
            && err.contains("Invalid unit name or type."),
        "{err}"
    );
    // systemd took nothing: nothing killed or stopped.
    assert_eq!(
        fake.changes(),
        [format!("StartTransientUnit {} replace aux=0", spec.name)]
    );
}

#[test]
fn a_unit_that_failed_at_start_is_killed_and_stopped_and_the_error_names_its_journal() {
    let fake = Fake::start(Start::Fail, Duration::from_secs(10));
    let (spec, result) = fake.start_unit();
    let err = result.expect_err("failed");
    assert_eq!(
        err,
        format!(
            "{} did not start (failed; `journalctl -u {}` says why)",
            spec.name, spec.name
        )
    );
    assert_eq!(
        fake.changes(),
        [
            format!("StartTransientUnit {} replace aux=0", spec.name),
            format!("KillUnit {} all {}", spec.name, libc::SIGKILL),
            format!("StopUnit {} replace", spec.name),
        ]
    );
}

#[test]
fn a_unit_with_no_main_process_within_the_wait_is_given_up_killed_and_stopped() {
    let wait = Duration::from_millis(300);
    let fake = Fake::start(Start::Hang, wait);
    let t0 = std::time::Instant::now();
    let (spec, result) = fake.start_unit();
    let err = result.expect_err("gave up");
    assert_eq!(
        err,
        format!("{} has no main process after {wait:?}", spec.name)
    );
    assert!(t0.elapsed() >= wait, "gave up before its wait");
    // It was looked at more than once while it activated.
    assert!(lock(&fake.script).looks > 1);
    assert_eq!(
        fake.changes()[1..],
        [
            format!("KillUnit {} all {}", spec.name, libc::SIGKILL),
            format!("StopUnit {} replace", spec.name),
        ]
    );
}

#[test]
fn an_activated_unit_is_handed_on_with_its_main_pid_and_lodgers_properties() {
    let fake = Fake::start(Start::ActiveAfter(3, 4242), Duration::from_secs(10));
    let (spec, result) = fake.start_unit();
    assert_eq!(result, Ok(4242));
    assert!(lock(&fake.script).looks > 3, "handed on while activating");
    assert_eq!(
        fake.changes(),
        [format!("StartTransientUnit {} replace aux=0", spec.name)]
    );
    // What systemd received: lodger's slice, the owner, the CPUs, the report pipe as stdin
    // (a descriptor, passed through the bus).
    let props = lock(&fake.script).properties.clone();
    for key in [
        "Slice",
        "User",
        "CPUAffinity",
        "StandardInputFileDescriptor",
        "ExecStart",
    ] {
        assert!(props.contains_key(key), "{key} missing: {props:?}");
    }
    assert!(props["Slice"].contains(&spec.slices.instances), "{props:?}");
    assert!(props["User"].contains("alice"), "{props:?}");
    assert!(
        props["StandardInputFileDescriptor"].contains("Fd("),
        "{props:?}"
    );
}

#[test]
fn a_start_waits_for_a_pending_stop_of_lodgers_slice() {
    let fake = Fake::start(Start::ActiveAfter(0, 77), Duration::from_secs(10));
    lock(&fake.script).slice_busy_for = 3;
    let (spec, result) = fake.start_unit();
    assert_eq!(result, Ok(77));
    let calls = fake.calls();
    let started = calls
        .iter()
        .position(|c| c.starts_with("StartTransientUnit"))
        .expect("started");
    // Four looks at the slice's job (three busy, one clear) before the start, none after.
    let looks: Vec<usize> = calls
        .iter()
        .enumerate()
        .filter(|(_, c)| *c == "slice Job")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(looks.len(), 4, "{calls:?}");
    assert!(looks.iter().all(|&i| i < started), "{calls:?}");
    assert_eq!(lock(&fake.script).slice_busy_for, 0);
    assert!(calls.contains(&format!("GetUnit {}", spec.slices.instances)));
}

#[test]
fn an_inactive_unit_whose_start_is_still_queued_is_waited_for() {
    let fake = Fake::start(Start::QueuedFor(3, 99), Duration::from_secs(10));
    let (spec, result) = fake.start_unit();
    assert_eq!(result, Ok(99), "gave up on a queued start");
    assert_eq!(
        fake.changes(),
        [format!("StartTransientUnit {} replace aux=0", spec.name)]
    );
}

/// A start job that a slow manager runs between lodgerd's look at the unit's state (inactive,
/// the job queued) and its look at the job (gone): the unit started, and the state read again
/// says so. Taken for "did not start (inactive)" before, as a re-layout's restart in the VM
/// suite once was.
#[test]
fn a_start_job_run_between_two_looks_is_not_taken_for_a_unit_that_did_not_start() {
    let fake = Fake::start(Start::RanBetweenLooks(4243), Duration::from_secs(10));
    let (spec, result) = fake.start_unit();
    assert_eq!(result, Ok(4243));
    assert_eq!(
        fake.changes(),
        [format!("StartTransientUnit {} replace aux=0", spec.name)],
        "killed or stopped a unit that started"
    );
}
