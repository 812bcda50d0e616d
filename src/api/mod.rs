//! The D-Bus control surface: `org.lodger1.Manager` at `/org/lodger1` and one
//! `org.lodger1.Job` object per job at `/org/lodger1/job/<id>`. Methods are thin: they check the
//! caller, turn the call into an agent command and map the reply. Touches only the agent's
//! command channel and the bus.

pub mod error;
pub mod metrics;
pub mod nri;
mod peers;
pub mod proxy;
pub mod spec;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use tokio::sync::broadcast::error::RecvError;
use tracing::{debug, info, warn};
use zbus::fdo::{RequestNameFlags, RequestNameReply};
use zbus::message::Header;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, OwnedValue, Value};
use zbus::{interface, Connection};

use crate::agent::{AgentHandle, Caller, Event};
use crate::job::JobId;
pub use error::ApiError;
use peers::Peers;
use spec::SchedLabels;

pub const BUS_NAME: &str = "org.lodger1";
pub const MANAGER_PATH: &str = "/org/lodger1";
pub const MANAGER_INTERFACE: &str = "org.lodger1.Manager";
pub const JOB_INTERFACE: &str = "org.lodger1.Job";

pub fn job_path(id: &JobId) -> OwnedObjectPath {
    // A JobId is `j<digits>`, always a valid path element.
    OwnedObjectPath::try_from(format!("{MANAGER_PATH}/job/{id}"))
        .unwrap_or_else(|_| OwnedObjectPath::from(ObjectPath::from_static_str_unchecked("/")))
}

/// Which bus lodgerd serves on. Both honour the usual environment variables
/// (`DBUS_SYSTEM_BUS_ADDRESS`, `DBUS_SESSION_BUS_ADDRESS`), which is how the tests and the demo
/// use a private `dbus-daemon`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bus {
    System,
    Session,
}

/// Who may make mutating calls: root, and members of a group (`api.group`). Clones share the
/// group, so a config reload ([`Authority::set_group`]) reaches the serving objects.
#[derive(Debug, Clone)]
pub struct Authority {
    group: Arc<RwLock<String>>,
}

/// Where the caller's command name is read (`<root>/<pid>/comm`).
const DEFAULT_PROC_ROOT: &str = "/proc";

impl Authority {
    pub fn new(group: String) -> Self {
        Self {
            group: Arc::new(RwLock::new(group)),
        }
    }

    /// The group whose members may make mutating calls.
    pub fn group(&self) -> String {
        match self.group.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A reload's new `api.group`: from the next call on.
    pub fn set_group(&self, group: String) {
        match self.group.write() {
            Ok(mut g) => *g = group,
            Err(poisoned) => *poisoned.into_inner() = group,
        }
    }

    /// Asks the bus daemon who the sender is (`GetConnectionCredentials`: never anything in the
    /// message; once per connection, see [`Peers`]) and whether that user is root or in the
    /// configured group. The pid and its command name describe the caller in the audit record;
    /// they never decide. A refusal here is audited here, since the call never reaches the agent.
    async fn check(
        &self,
        conn: &Connection,
        peers: &Peers,
        hdr: &Header<'_>,
        action: &str,
    ) -> Result<Caller, ApiError> {
        let sender = hdr
            .sender()
            .ok_or_else(|| ApiError::AccessDenied("the call has no sender".into()))?;
        let (uid, pid) = match peers.get(sender.as_str()) {
            Some(known) => known,
            None => {
                let dbus = zbus::fdo::DBusProxy::new(conn).await?;
                let creds = dbus
                    .get_connection_credentials(sender.clone().into())
                    .await
                    .map_err(|e| {
                        ApiError::AccessDenied(format!("cannot tell who the caller is: {e}"))
                    })?;
                let uid = creds.unix_user_id().ok_or_else(|| {
                    ApiError::AccessDenied("the bus did not say which user the caller is".into())
                })?;
                let pid = creds.process_id();
                peers.insert(sender.as_str(), (uid, pid));
                (uid, pid)
            }
        };
        let caller = Caller {
            uid,
            pid,
            comm: pid.and_then(|p| command_name(std::path::Path::new(DEFAULT_PROC_ROOT), p)),
        };
        if uid != 0 {
            let group = self.group();
            let asked = group.clone();
            let member = tokio::task::spawn_blocking(move || user_in_group(uid, &asked))
                .await
                .unwrap_or(false);
            if !member {
                let e = ApiError::AccessDenied(format!(
                    "uid {uid} may not change lodger's jobs: run as root or add the user to the '{group}' group"
                ));
                audit_refused(&caller, action, &e);
                return Err(e);
            }
        }
        Ok(caller)
    }
}

/// The audit record of a mutating call refused before it reached the agent (which records
/// the others): the same fields as the agent's (`target=lodger::audit`).
fn audit_refused(caller: &Caller, action: &str, e: &ApiError) {
    warn!(
        target: "lodger::audit",
        caller_uid = caller.uid,
        caller_pid = caller.pid.unwrap_or(0),
        caller_comm = caller.comm.as_deref().unwrap_or(""),
        action,
        outcome = "refused",
        reason = %e,
        "{action} by uid {} refused: {e}",
        caller.uid
    );
}

/// A process's command name (`<proc_root>/<pid>/comm`), if it can be read.
fn command_name(proc_root: &std::path::Path, pid: u32) -> Option<String> {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join("comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// NSS lookups (may block on LDAP/SSSD, hence `spawn_blocking`).
fn user_in_group(uid: u32, group: &str) -> bool {
    use nix::unistd::{Group, Uid, User};
    let Ok(Some(g)) = Group::from_name(group) else {
        return false;
    };
    let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid)) else {
        return false;
    };
    if user.gid == g.gid || g.mem.contains(&user.name) {
        return true;
    }
    let Ok(name) = std::ffi::CString::new(user.name.clone()) else {
        return false;
    };
    nix::unistd::getgrouplist(&name, user.gid)
        .map(|gs| gs.contains(&g.gid))
        .unwrap_or(false)
}

pub struct Manager {
    agent: AgentHandle,
    auth: Authority,
    peers: Peers,
    sched: SchedLabels,
}

#[interface(name = "org.lodger1.Manager")]
impl Manager {
    /// Registers a job described by `spec` (keys in docs/dbus-api.md); returns its id and object.
    async fn register_job(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        spec: HashMap<String, OwnedValue>,
    ) -> Result<(String, OwnedObjectPath), ApiError> {
        // Where the call's time goes (issue 21), for the spine benchmark and the debug log.
        let t0 = std::time::Instant::now();
        let caller = self.auth.check(conn, &self.peers, &hdr, "register").await?;
        let t_check = t0.elapsed();
        let parsed = spec::owner_from_dict(&spec)
            .and_then(|owner| Ok((owner, spec::spec_from_dict(&spec)?)))
            .map_err(ApiError::InvalidSpec);
        let (owner, spec) = parsed.inspect_err(|e| audit_refused(&caller, "register", e))?;
        let job = self.agent.register(spec, owner, caller).await?;
        let t_agent = t0.elapsed();
        let path = job_path(&job.id);
        add_job_object(conn, &self.agent, &job.id, &self.sched).await;
        debug!(
            "register call timing: check {} us, agent {} us, export {} us",
            t_check.as_micros(),
            (t_agent - t_check).as_micros(),
            (t0.elapsed() - t_agent).as_micros(),
        );
        Ok((job.id.to_string(), path))
    }

    /// Releases a job: its threads go back to SCHED_OTHER, its cgroups are restored and its CPUs
    /// freed.
    async fn unregister_job(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        id: String,
    ) -> Result<(), ApiError> {
        let caller = self
            .auth
            .check(conn, &self.peers, &hdr, "unregister")
            .await?;
        Ok(self.agent.unregister(&id, caller).await?)
    }

    /// (id, kind, state, object path) of every job.
    async fn list_jobs(&self) -> Result<Vec<(String, String, String, OwnedObjectPath)>, ApiError> {
        Ok(self
            .agent
            .list()
            .await?
            .into_iter()
            .map(|j| {
                (
                    j.id.to_string(),
                    j.spec.kind.as_str().to_string(),
                    j.state.as_str().to_string(),
                    job_path(&j.id),
                )
            })
            .collect())
    }

    async fn get_job(&self, id: String) -> Result<HashMap<String, Value<'static>>, ApiError> {
        let job = self.agent.get(&id).await?;
        Ok(spec::job_to_dict(&job, &self.sched))
    }

    /// The node as a dictionary (the same fields as the properties, plus counts).
    async fn get_status(&self) -> Result<HashMap<String, Value<'static>>, ApiError> {
        let s = self.agent.status().await?;
        let sensing = s.sensing();
        let mut d: HashMap<String, Value<'static>> = HashMap::new();
        d.insert("version".into(), Value::from(s.version));
        d.insert("cpus".into(), Value::from(s.cpus.to_string()));
        d.insert("reserved".into(), Value::from(s.reserved.to_string()));
        d.insert("training_cpus".into(), Value::from(s.training.to_string()));
        d.insert("free".into(), Value::from(s.free.to_string()));
        d.insert("numa_nodes".into(), Value::from(s.numa_nodes));
        d.insert("gpus".into(), Value::from(s.gpus));
        d.insert("smt".into(), Value::from(s.smt));
        d.insert("jobs".into(), Value::from(s.jobs));
        d.insert("instances".into(), Value::from(s.instances));
        d.insert("enforcement".into(), Value::from(s.enforcement));
        d.insert("rt_priority".into(), Value::from(s.rt_priority));
        d.insert("interval_ms".into(), Value::from(s.interval_ms));
        d.insert("ticks".into(), Value::from(s.ticks));
        d.insert("throttle_actions".into(), Value::from(s.throttle_actions));
        d.insert("contention".into(), Value::from(s.contention));
        d.insert("sensing".into(), Value::from(sensing));
        let ages: HashMap<String, f64> = s
            .sample_ages
            .iter()
            .map(|(k, a)| (k.clone(), a.age_s))
            .collect();
        let stale: Vec<String> = s
            .sample_ages
            .iter()
            .filter(|(_, a)| a.stale)
            .map(|(k, _)| k.clone())
            .collect();
        d.insert("network".into(), Value::from(s.network));
        d.insert("sample_age_seconds".into(), Value::from(ages));
        d.insert("stale_sources".into(), Value::from(stale));
        Ok(d)
    }

    /// The latest measurements: the node (`a{sv}`), each job by id (`a{sa{sv}}`), and what each
    /// signal source is doing (`a{ss}`: gpu, perf, cpu, membw, net). Keys appear only when
    /// measured. `lodgerctl top` is built on this.
    #[allow(clippy::type_complexity)]
    async fn get_observations(
        &self,
    ) -> Result<
        (
            HashMap<String, Value<'static>>,
            HashMap<String, HashMap<String, Value<'static>>>,
            HashMap<String, String>,
        ),
        ApiError,
    > {
        let snap = self.agent.snapshot().await?;
        let obs = &snap.observations;
        let jobs = snap
            .jobs
            .iter()
            .map(|j| {
                let m = obs.jobs.get(&j.id).cloned().unwrap_or_default();
                (j.id.to_string(), spec::job_metrics_to_dict(&m))
            })
            .collect();
        let s = &obs.sources;
        let sources = [
            ("gpu", &s.gpu),
            ("perf", &s.perf),
            ("cpu", &s.cpu),
            ("membw", &s.membw),
            ("net", &s.net),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
        Ok((spec::node_metrics_to_dict(&obs.node), jobs, sources))
    }

    #[zbus(property)]
    async fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_string()
    }

    #[zbus(property)]
    async fn cpus(&self) -> zbus::fdo::Result<String> {
        self.status_field(|s| s.cpus.to_string()).await
    }

    #[zbus(property)]
    async fn reserved(&self) -> zbus::fdo::Result<String> {
        self.status_field(|s| s.reserved.to_string()).await
    }

    #[zbus(property)]
    async fn free(&self) -> zbus::fdo::Result<String> {
        self.status_field(|s| s.free.to_string()).await
    }

    #[zbus(property)]
    async fn training_cpus(&self) -> zbus::fdo::Result<String> {
        self.status_field(|s| s.training.to_string()).await
    }

    /// Emitted when a job is registered, changes state, or ends (`exited`).
    #[zbus(signal)]
    async fn job_changed(emitter: &SignalEmitter<'_>, id: &str, state: &str) -> zbus::Result<()>;

    /// Emitted for each contention throttle step or release (SODA §V-E): the job, the mechanism
    /// (`mba`, `cores`, `release`) and the level (steps taken).
    #[zbus(signal)]
    async fn throttled(
        emitter: &SignalEmitter<'_>,
        job: &str,
        mechanism: &str,
        level: &str,
    ) -> zbus::Result<()>;

    /// Emitted when an online job's demand (requests/s) passes what its layout on this node
    /// serves, so a cluster scheduler can move it (Cloud Reamer §III-C).
    #[zbus(signal)]
    async fn capacity_exceeded(
        emitter: &SignalEmitter<'_>,
        id: &str,
        demand_per_s: f64,
        capacity_per_s: f64,
    ) -> zbus::Result<()>;
}

impl Manager {
    async fn status_field(
        &self,
        f: impl FnOnce(&crate::agent::NodeStatus) -> String,
    ) -> Result<String, zbus::fdo::Error> {
        self.agent
            .status()
            .await
            .map(|s| f(&s))
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))
    }
}

/// `/org/lodger1/job/<id>`: one job's properties, read live from the agent.
pub struct JobObject {
    id: JobId,
    agent: AgentHandle,
    sched: SchedLabels,
}

impl JobObject {
    async fn job(&self) -> zbus::fdo::Result<crate::job::Job> {
        self.agent
            .get(self.id.as_str())
            .await
            .map_err(|e| zbus::fdo::Error::UnknownObject(e.to_string()))
    }
}

#[interface(name = "org.lodger1.Job")]
impl JobObject {
    #[zbus(property)]
    async fn id(&self) -> String {
        self.id.to_string()
    }
    #[zbus(property)]
    async fn name(&self) -> zbus::fdo::Result<String> {
        Ok(self.job().await?.spec.name.unwrap_or_default())
    }
    #[zbus(property)]
    async fn kind(&self) -> zbus::fdo::Result<String> {
        Ok(self.job().await?.spec.kind.as_str().to_string())
    }
    #[zbus(property)]
    async fn state(&self) -> zbus::fdo::Result<String> {
        Ok(self.job().await?.state.as_str().to_string())
    }
    #[zbus(property)]
    async fn pids(&self) -> zbus::fdo::Result<Vec<u32>> {
        Ok(self.job().await?.pids)
    }
    #[zbus(property)]
    async fn cpus(&self) -> zbus::fdo::Result<String> {
        Ok(self.job().await?.cpus.to_string())
    }
    #[zbus(property)]
    async fn mems(&self) -> zbus::fdo::Result<String> {
        Ok(self.job().await?.mems.to_string())
    }
    #[zbus(property)]
    async fn gpus(&self) -> zbus::fdo::Result<Vec<u32>> {
        Ok(self.job().await?.spec.gpus)
    }
    #[zbus(property)]
    async fn threads(&self) -> zbus::fdo::Result<u32> {
        Ok(self.job().await?.threads)
    }
    #[zbus(property)]
    async fn rr_threads(&self) -> zbus::fdo::Result<u32> {
        Ok(self.job().await?.rr_threads)
    }
    #[zbus(property)]
    async fn sched_policy(&self) -> zbus::fdo::Result<String> {
        Ok(self.sched.of(self.job().await?.spec.kind).to_string())
    }
    #[zbus(property)]
    async fn last_error(&self) -> zbus::fdo::Result<String> {
        Ok(self.job().await?.last_error.unwrap_or_default())
    }
    /// The job's latest measurements (cpu_percent, ipc, cache_miss_percent, gpu_percent,
    /// gpu_source, membw_bytes_per_s, membw_domains, membw_unavailable); a key is present only
    /// when measured.
    #[zbus(property)]
    async fn metrics(&self) -> zbus::fdo::Result<HashMap<String, Value<'static>>> {
        let snap = self
            .agent
            .snapshot()
            .await
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?;
        let m = snap
            .observations
            .jobs
            .get(&self.id)
            .cloned()
            .unwrap_or_default();
        Ok(spec::job_metrics_to_dict(&m))
    }
}

async fn add_job_object(conn: &Connection, agent: &AgentHandle, id: &JobId, sched: &SchedLabels) {
    let obj = JobObject {
        id: id.clone(),
        agent: agent.clone(),
        sched: sched.clone(),
    };
    // `at` returns false when the object is already there (the event forwarder may have won).
    if let Err(e) = conn.object_server().at(job_path(id), obj).await {
        warn!(job = %id, "cannot export the job object: {e}");
    }
}

/// How long [`own_name`] waits for `org.lodger1` held by another connection.
const NAME_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// How often it asks again meanwhile.
const NAME_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// Takes `org.lodger1`, or fails with `NameTaken` when another connection keeps it for
/// [`NAME_WAIT`]. Not the connection builder's `name`: it asks without DoNotQueue (zbus 5.19,
/// whatever its docs say) and takes a place in the queue for success, so a second lodgerd said
/// READY and waited, serving nothing, to take over the name when the first one stopped. Asked
/// again for a while because a lodgerd started as soon as its predecessor died finds the name
/// held until the bus daemon has seen the old connection close.
async fn own_name(conn: &Connection) -> zbus::Result<()> {
    let deadline = std::time::Instant::now() + NAME_WAIT;
    let mut said = false;
    loop {
        match conn
            .request_name_with_flags(BUS_NAME, RequestNameFlags::DoNotQueue.into())
            .await
        {
            Ok(RequestNameReply::PrimaryOwner | RequestNameReply::AlreadyOwner) => return Ok(()),
            Ok(RequestNameReply::Exists | RequestNameReply::InQueue)
            | Err(zbus::Error::NameTaken) => {
                if std::time::Instant::now() >= deadline {
                    return Err(zbus::Error::NameTaken);
                }
                if !std::mem::replace(&mut said, true) {
                    info!(
                        "{BUS_NAME} is held by another connection: waiting up to {} s for it",
                        NAME_WAIT.as_secs()
                    );
                }
                tokio::time::sleep(NAME_RETRY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Connects to the bus, exports the manager and the existing jobs, owns `org.lodger1`, and starts
/// forwarding agent events as signals. Returns once the name is owned.
pub async fn serve(
    bus: Bus,
    agent: AgentHandle,
    auth: Authority,
    sched: SchedLabels,
) -> zbus::Result<Connection> {
    let manager = Manager {
        agent: agent.clone(),
        auth,
        peers: Peers::default(),
        sched: sched.clone(),
    };
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system()?,
        Bus::Session => zbus::connection::Builder::session()?,
    };
    // Subscribe before exporting so no event between the two is lost.
    let events = agent.subscribe();
    let conn = builder.serve_at(MANAGER_PATH, manager)?.build().await?;
    own_name(&conn).await?;
    if let Ok(jobs) = agent.list().await {
        for job in jobs {
            add_job_object(&conn, &agent, &job.id, &sched).await;
        }
    }
    tokio::spawn(forward_events(conn.clone(), agent, events, sched));
    Ok(conn)
}

async fn forward_events(
    conn: Connection,
    agent: AgentHandle,
    mut events: tokio::sync::broadcast::Receiver<Event>,
    sched: SchedLabels,
) {
    let Ok(emitter) = SignalEmitter::new(&conn, MANAGER_PATH) else {
        return;
    };
    loop {
        let event = match events.recv().await {
            Ok(e) => e,
            Err(RecvError::Lagged(n)) => {
                warn!("missed {n} job events; job objects may be stale until the next change");
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        debug!(?event, "forwarding");
        let result = match &event {
            Event::JobAdded(id) => {
                add_job_object(&conn, &agent, id, &sched).await;
                Manager::job_changed(&emitter, id.as_str(), "running").await
            }
            Event::JobChanged(id, state) => {
                let r = Manager::job_changed(&emitter, id.as_str(), state.as_str()).await;
                if let Ok(iface) = conn
                    .object_server()
                    .interface::<_, JobObject>(job_path(id))
                    .await
                {
                    let _ = iface
                        .get()
                        .await
                        .state_changed(iface.signal_emitter())
                        .await;
                }
                r
            }
            Event::CapacityExceeded {
                id,
                demand_per_s,
                capacity_per_s,
            } => {
                Manager::capacity_exceeded(&emitter, id.as_str(), *demand_per_s, *capacity_per_s)
                    .await
            }
            Event::Throttled {
                id,
                mechanism,
                level,
            } => Manager::throttled(&emitter, id.as_str(), mechanism, level).await,
            Event::JobRemoved(id) => conn
                .object_server()
                .remove::<JobObject, _>(job_path(id))
                .await
                .map(|_| ()),
        };
        if let Err(e) = result {
            warn!(?event, "cannot emit signal: {e}");
        }
    }
}
