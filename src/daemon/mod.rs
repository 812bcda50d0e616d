//! daemon: lodgerd's body. Reads the config and the node, turns the config's sections into the
//! settings of enforce, sense, policy, agent and api, starts the agent and the sensing thread and
//! serves `org.lodger1` (and the metrics endpoint) until SIGTERM/SIGINT. The one room that may
//! import every other; `config` stays below it and knows nothing of the types it is wired into.
//! Rooms: `lock` (one lodgerd per state directory), `settings` (the config's sections turned
//! into each room's settings), `signals` (SIGTERM/SIGINT/SIGHUP, listened to from before READY
//! to the end), `watchdog` (systemd's watchdog pings, while the agent loop makes progress).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tracing::{error, info, warn};

mod lock;
mod reload;
mod settings;
mod signals;
mod status_line;
mod watchdog;

use self::settings::{
    agent_settings_on, batch_settings, enforce_settings, instance_settings, sampler_settings,
    Enforceable,
};
use self::signals::{unless_stopped, During, Signal, Signals};

use crate::agent::{Agent, AgentHandle, Enforce, MbaTarget};
use crate::api::{self, Authority, Bus};
use crate::config::{self, Config, ConfigError};
use crate::cpuset::CpuSet;
use crate::enforce::instances::Instances;
use crate::enforce::network::node::{Classifier, NetworkControl, CPU_JOBS_MARK, NET_CLS_GROUP};
use crate::enforce::network::route::CpuJobsRoute;
use crate::enforce::sim::SimulatedEnforcer;
use crate::enforce::{Enforcer, PinMethod};
use crate::store::Store;
use crate::sys::cgroupfs::find_net_cls_mount;
use crate::sys::cgroupfs::CgroupVersion;
use crate::sys::command::CommandRunner;
use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
use crate::topology::{Topology, TopologyError};

/// The config, checked against this node: what `--check-config` reports and [`run`] starts
/// from.
pub struct Prepared {
    pub config: Config,
    pub topology: Topology,
    /// The CPUs kept free of jobs: `node.reserved_cpus`, resolved on this node, and the CPUs
    /// the kernel isolates (`topology.isolated`).
    pub reserved: CpuSet,
    /// The CPUs lodgers may use (`node.lendable_cpus`, resolved, less the reserved).
    pub lendable: CpuSet,
    /// What is wrong but does not stop lodgerd (an obsolete key, a missing default
    /// `api.group`): logged at start, printed by `--check-config`.
    pub warnings: Vec<String>,
}

/// Why lodgerd cannot start on this node with this config (exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot read the node's topology under {}: {source}", root.display())]
    Topology {
        root: PathBuf,
        source: TopologyError,
    },
    /// A `[[node.gpu]]` override the topology refuses.
    #[error(transparent)]
    GpuOverride(TopologyError),
}

/// Loads the config (`path`, or the default file when it exists, else the built-in defaults),
/// reads the node's topology and checks the config against it.
pub fn prepare(path: Option<&Path>) -> Result<Prepared, PrepareError> {
    let config = match path {
        Some(path) => Config::load(path)?,
        None => {
            let path = PathBuf::from(config::DEFAULT_CONFIG_PATH);
            if path.exists() {
                Config::load(&path)?
            } else {
                Config::default()
            }
        }
    };
    let mut warnings = config.warnings();
    warnings.extend(config.check_group(group_exists)?);
    let mut topology =
        Topology::read(&config.node.sysfs_root).map_err(|source| PrepareError::Topology {
            root: config.node.sysfs_root.clone(),
            source,
        })?;
    let nodes: CpuSet = topology.numa_nodes.keys().copied().collect();
    config.check_gpu_overrides(&nodes)?;
    for gpu in &config.node.gpu {
        topology
            .override_gpu(gpu.index, gpu.numa_node)
            .map_err(PrepareError::GpuOverride)?;
    }
    let cpu0_siblings = topology
        .online()
        .first()
        .and_then(|c| topology.siblings(c).cloned())
        .unwrap_or_default();
    let reserved = config
        .resolve_reserved(&topology.online(), &cpu0_siblings, &topology.isolated)?
        .union(&topology.isolated);
    let lendable = config.resolve_lendable(&topology.online(), &reserved)?;
    Ok(Prepared {
        config,
        topology,
        reserved,
        lendable,
        warnings,
    })
}

/// Whether the node's group database (NSS) has a group `name`; `Err` when it cannot say.
fn group_exists(name: &str) -> Result<bool, String> {
    nix::unistd::Group::from_name(name)
        .map(|g| g.is_some())
        .map_err(|e| e.to_string())
}

impl Prepared {
    /// One line on what lodgerd found: CPUs, NUMA nodes, GPUs and the reserved CPUs.
    pub fn summary(&self) -> String {
        let list = |set: &CpuSet| {
            if set.is_empty() {
                "none".to_string()
            } else {
                set.to_string()
            }
        };
        format!(
            "{} CPUs, {} NUMA node(s), {} GPU(s), reserved CPUs {} (isolated by the kernel: {})",
            self.topology.online().len(),
            self.topology.numa_nodes.len(),
            self.topology.gpus.len(),
            list(&self.reserved),
            list(&self.topology.isolated)
        )
    }
}

/// Network shaping (SODA §V-E) when `[[network.link]]` names interfaces, with the way CPU
/// jobs' traffic is told apart on this node's cgroups (kept for a reload that changes
/// `[network]`; `None` when shaping is off at start). Where that is a cgroup of lodgerd's own
/// (v2, instances placed by affinity), instances start in it.
fn network_control(
    config: &Config,
    runner: Option<&mut Instances>,
    sim: bool,
) -> (Option<NetworkControl>, Option<Classifier>) {
    let shaping = config.network.shaping();
    let slow = config.network.slow_network();
    if sim {
        info!("network shaping off: --sim changes nothing on the node");
        return (None, None);
    }
    if shaping.is_none() && slow.is_none() {
        info!("network shaping off: no [[network.link]] (or network.cpu_jobs_interface) in the config");
        // What a previous lodgerd with shaping on left (stopping leaves it for the jobs that
        // run on) has no control now to remove it.
        let mut runner = CommandRunner::new().with_deadline(config.agent.command_timeout());
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let net_cls = find_net_cls_mount(&mountinfo)
            .map(|h| (h, format!("{}/{}", config.cgroup.parent, NET_CLS_GROUP)));
        let (removed, errors) = crate::enforce::network::remove_leftovers(
            &mut runner,
            net_cls.as_ref().map(|(h, r)| (h.as_path(), r.as_str())),
        );
        if !removed.is_empty() {
            warn!(
                "network shaping off: removed what an earlier lodgerd left: {}",
                removed.join(", ")
            );
        }
        for e in errors {
            warn!("network shaping off: cannot remove what an earlier lodgerd left: {e}");
        }
        return (None, None);
    }
    // Where instances start in lodger's own subtree, relative to the cgroup2 root (issue 17).
    let subtree = |r: &Instances| {
        r.start_cgroup()
            .and_then(|d| d.strip_prefix(&config.cgroup.root).ok())
            .map(|p| p.display().to_string())
    };
    let classifier = match runner.as_deref() {
        None => Classifier::Unavailable("inference instances are unavailable".into()),
        Some(r) => match (r.cgroup_version(), r.placement(), subtree(r)) {
            (CgroupVersion::V1, _, _) => {
                let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
                match find_net_cls_mount(&mountinfo) {
                    Some(hierarchy) => Classifier::NetCls {
                        hierarchy,
                        relative: format!("{}/{}", config.cgroup.parent, NET_CLS_GROUP),
                    },
                    None => Classifier::Unavailable(
                        "cgroup v1 without the net_cls controller mounted; mount it \
                         (mount -t cgroup -o net_cls net_cls /sys/fs/cgroup/net_cls) and restart lodgerd"
                            .into(),
                    ),
                }
            }
            (CgroupVersion::V2, PinMethod::Cgroup, _) => Classifier::CgroupV2,
            // Instances are transient units in lodger's slice: matched by their cgroups.
            (CgroupVersion::V2, PinMethod::Affinity, _)
                if crate::enforce::instances::unit::systemd().is_some() =>
            {
                Classifier::CgroupV2
            }
            // Instances start in lodger's own subtree (issue 17): matched there.
            (CgroupVersion::V2, PinMethod::Affinity, Some(relative)) => Classifier::OwnCgroupV2 {
                root: config.cgroup.root.clone(),
                relative,
            },
            // Instances stay in lodgerd's own cgroup (lodger's subtree could not be made):
            // shaping moves them into a child of it.
            (CgroupVersion::V2, PinMethod::Affinity, None) => {
                let own = std::fs::read_to_string("/proc/self/cgroup")
                    .ok()
                    .and_then(|t| {
                        t.lines()
                            .find_map(|l| l.strip_prefix("0::").map(|p| p.trim().to_string()))
                    });
                match own {
                    Some(own) => {
                        let own = own.trim_matches('/');
                        Classifier::OwnCgroupV2 {
                            root: config.cgroup.root.clone(),
                            relative: if own.is_empty() {
                                format!("lodger-{NET_CLS_GROUP}")
                            } else {
                                format!("{own}/{NET_CLS_GROUP}")
                            },
                        }
                    }
                    None => Classifier::Unavailable(
                        "instances have no cgroups of their own and lodgerd's cgroup2 path is \
                         not in /proc/self/cgroup"
                            .into(),
                    ),
                }
            }
        },
    };
    if let (Classifier::OwnCgroupV2 { root, relative }, Some(r)) = (&classifier, runner) {
        r.start_in_cgroup(root.join(relative));
    }
    let control = shaping_control(config, classifier.clone());
    (control, Some(classifier))
}

/// The shaping (or two-network) control `[network]` asks for, telling CPU jobs' traffic apart
/// with `classifier`; `None` when `[network]` names no interface or its settings cannot work
/// (logged).
fn shaping_control(config: &Config, classifier: Classifier) -> Option<NetworkControl> {
    let shaping = config.network.shaping();
    let slow = config.network.slow_network();
    // A hung `tc` or `nft` is killed at the deadline; shaping reports it in `status` and the
    // log and tries again at the next tick.
    let runner = Box::new(CommandRunner::new().with_deadline(config.agent.command_timeout()));
    let control = match (shaping, slow) {
        (_, Some(slow)) => CpuJobsRoute::new(slow, CPU_JOBS_MARK)
            .map(|route| NetworkControl::routing(route, runner, classifier)),
        (Some(shaping), None) => {
            NetworkControl::new(&shaping, config.network.steering.into(), runner, classifier)
        }
        (None, None) => return None,
    };
    match control {
        Ok(n) => {
            info!("{}", n.status());
            Some(n)
        }
        Err(e) => {
            warn!("network shaping off: {e}");
            None
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running.

/// Keeps lodgerd's own threads on the reserved (housekeeping) CPUs, so the training jobs'
/// SCHED_RR threads can never starve the agent. Set before any thread starts: threads inherit it.
fn pin_self(reserved: &CpuSet) {
    if reserved.is_empty() {
        return;
    }
    let mut set = nix::sched::CpuSet::new();
    for cpu in reserved {
        let Ok(cpu) = usize::try_from(cpu) else {
            continue;
        };
        if set.set(cpu).is_err() {
            return;
        }
    }
    if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
        warn!("cannot keep lodgerd on the reserved CPUs {reserved}: {e}");
    }
}

/// Runs lodgerd on a prepared node until SIGTERM/SIGINT: enforcement (simulated with `sim`),
/// the agent with its runner, MBA, network control and sensing thread, then D-Bus and metrics.
/// Logging must be set up first. Returns the exit status (1: could not start).
pub fn run(prepared: Prepared, sim: bool) -> ExitCode {
    let Prepared {
        config,
        topology,
        reserved,
        lendable,
        warnings,
    } = prepared;
    for w in warnings {
        warn!("{w}");
    }
    // Before anything touches the node: a second lodgerd (started by hand beside the service,
    // or `--sim` on the same state directory) would otherwise re-adopt the first one's jobs,
    // undo what it takes for an interrupted registration and run its loop on them beside the
    // first one's, then find the bus name taken.
    let _lock = match lock::lock_state_dir(&config.agent.state_dir) {
        Ok(l) => l,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };
    // Not on the isolated CPUs: the kernel would run every lodgerd thread on one of them.
    pin_self(&reserved.difference(&topology.isolated));
    if !topology.isolated.is_empty() {
        info!(
            "CPUs {} are isolated by the kernel (isolcpus=): no job is placed on them, as on \
             reserved CPUs",
            topology.isolated
        );
    }

    let mut runner = None;
    let mut batch: Option<Box<dyn Enforce>> = None;
    // Whether batch jobs get a memory limit here (and so may ask for their own).
    let mut batch_memory = false;
    let enforcer: Box<dyn Enforce> = if sim {
        info!("simulated enforcement: no cgroup or scheduling policy will be changed");
        // Batch jobs are placed and observed like training jobs, and changed as little.
        batch = Some(Box::new(SimulatedEnforcer::new(
            config.node.proc_root.clone(),
        )));
        Box::new(SimulatedEnforcer::new(config.node.proc_root.clone()))
    } else {
        match Enforcer::new(batch_settings(&config)) {
            Ok(e) => {
                batch_memory = e.limits_job_memory();
                batch = Some(Box::new(e));
            }
            Err(e) => warn!("batch jobs unavailable: {e}"),
        }
        let settings = enforce_settings(&config);
        let (mut instance_settings, probe) = instance_settings(&config, &settings);
        instance_settings.cores = topology.cores.iter().map(|c| c.cpus.clone()).collect();
        match Instances::new(instance_settings) {
            Ok(r) => runner = Some((r, probe)),
            Err(e) => warn!("inference instances unavailable: {e}"),
        }
        match Enforcer::new(settings) {
            Ok(e) => Box::new(e),
            Err(e) => {
                error!("{e}");
                eprintln!("lodgerd: {e}");
                return ExitCode::from(1);
            }
        }
    };
    info!(
        cpus = %topology.online(),
        reserved = %reserved,
        numa_nodes = topology.numa_nodes.len(),
        gpus = topology.gpus.len(),
        enforcement = %enforcer.describe(),
        "lodgerd {} starting",
        env!("CARGO_PKG_VERSION")
    );
    if topology.gpus.is_empty() {
        info!("no NVIDIA GPU found in sysfs: jobs get no GPU locality preference");
    }

    let enforceable = Enforceable { batch_memory };
    let mut settings = agent_settings_on(&config, enforceable);
    settings.lendable = Some(lendable);
    let store = Store::new(config.agent.state_dir.clone());
    let mut agent = Agent::builder(settings, topology, reserved, enforcer, store);
    if let Some(b) = batch {
        agent = agent.batch(b);
    }
    // MBA for contention control, where resctrl has it.
    match MbaCaps::read(
        &config.sense.resctrl_root,
        &CpuVendor::from_cpuinfo(&config.node.proc_root).unwrap_or(CpuVendor::Other(String::new())),
    ) {
        Ok(caps) if !sim => {
            agent = agent.mba(MbaTarget::new(config.sense.resctrl_root.clone(), caps));
        }
        Ok(_) => {}
        Err(e) => {
            info!("memory-bandwidth allocation (MBA) unavailable, contention control halves cores instead: {e}");
        }
    }
    let (network, classifier) = network_control(&config, runner.as_mut().map(|(r, _)| r), sim);
    if let Some(n) = network {
        agent = agent.network(n);
    }
    if let Some((r, probe)) = runner {
        agent = agent.runner(r, probe);
    }
    let mut sense_thread = None;
    match crate::sense::sources::spawn(sampler_settings(&config), config.sense.deadline()) {
        Ok((link, join)) => {
            sense_thread = Some(join);
            agent = agent.sensor(link);
        }
        Err(e) => {
            warn!("cannot start the sensing thread: {e}; running without measurements");
        }
    }
    let agent = match agent.start() {
        Ok(a) => a,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };
    let (handle, join) = match agent.spawn() {
        Ok(x) => x,
        Err(e) => {
            error!("cannot start the agent thread: {e}");
            return ExitCode::from(1);
        }
    };

    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = serve(&rt, &config, &handle, classifier, enforceable);
    handle.stop();
    if join.join().is_err() {
        error!("the agent thread panicked");
        return ExitCode::from(1);
    }
    // The sensing thread ends once the agent is gone, removing the jobs' resctrl monitoring
    // groups on its way out: wait for it (at most one sensing interval and a pass).
    if let Some(sense) = sense_thread {
        if sense.join().is_err() {
            error!("the sensing thread panicked");
        }
    }
    code
}

/// Serves `org.lodger1` on the configured bus (and metrics, and the systemd watchdog) on `rt`
/// until SIGTERM/SIGINT.
fn serve(
    rt: &tokio::runtime::Runtime,
    config: &Config,
    handle: &AgentHandle,
    classifier: Option<Classifier>,
    enforceable: Enforceable,
) -> ExitCode {
    let bus = Bus::from(config.api.bus);
    let auth = Authority::new(config.api.group.clone());
    let sched = api::spec::SchedLabels::new(&config.training).with_batch(&config.batch);
    rt.block_on(async {
        // Installed before READY and listened to until the end: a SIGHUP as soon as systemd
        // allows one, or a SIGTERM during a reload, is not lost.
        let mut signals = Signals::new();
        // A stop while connecting (the bus slow to answer, the name held for a while) is
        // honoured at once: the handlers installed above would otherwise hold it back until
        // the bus answered, and systemd's stop would end in SIGKILL.
        let serving = api::serve(bus, handle.clone(), auth.clone(), sched);
        tokio::pin!(serving);
        let served = loop {
            tokio::select! {
                served = &mut serving => break served,
                signal = signals.next() => match signal {
                    Signal::Stop => {
                        info!("stopping before serving {}: asked to stop", api::BUS_NAME);
                        return ExitCode::SUCCESS;
                    }
                    // The file was read at start, a moment ago.
                    Signal::Reload => info!("reload asked before lodgerd serves: nothing to re-read yet"),
                },
            }
        };
        let conn = match served {
            Ok(c) => c,
            Err(e) => {
                error!(
                    "cannot serve {} on the {:?} bus: {e} (is another lodgerd running, and does the D-Bus policy allow root to own the name?)",
                    api::BUS_NAME,
                    bus
                );
                return ExitCode::from(1);
            }
        };
        info!("serving {} on the {:?} bus", api::BUS_NAME, bus);
        // READY only now: the bus name is owned and the state file's jobs are re-adopted.
        notify(&[sd_notify::NotifyState::Ready]);
        if let Some(listen) = config.metrics.address() {
            let agent = handle.clone();
            tokio::spawn(async move {
                if let Err(e) = api::metrics::serve(listen, agent).await {
                    error!("cannot serve Prometheus metrics on {listen}: {e}");
                }
            });
        }
        if config.kubernetes.nri {
            let sched = api::nri::TrainingSched {
                rr_priority: (config.training.policy == crate::config::TrainingPolicy::Rr)
                    .then_some(config.training.rt_priority),
                allow_unthrottled_rt: config.training.allow_unthrottled_rt,
                proc_root: config.node.proc_root.clone(),
                cgroup_root: config.cgroup.root.clone(),
            };
            tokio::spawn(api::nri::run(
                handle.clone(),
                config.kubernetes.clone(),
                sched,
            ));
        }
        if let Some(period) = sd_notify::watchdog_enabled() {
            tokio::spawn(watchdog::run(handle.clone(), period));
        }
        // The line `systemctl status lodgerd` shows: only systemd reads it.
        if std::env::var_os("NOTIFY_SOCKET").is_some() {
            tokio::spawn(status_line::run(handle.clone()));
        }
        let mut running = config.clone();
        let reader = reload::reader();
        let mut next = signals.next().await;
        while next == Signal::Reload {
            notify(&[sd_notify::NotifyState::Reloading]);
            let reloading = reload::reload(
                &running,
                &reader,
                handle,
                &auth,
                classifier.as_ref(),
                enforceable,
            );
            match unless_stopped(reloading, &mut signals).await {
                During::Done {
                    value,
                    reload_again,
                } => {
                    running = value;
                    notify(&[sd_notify::NotifyState::Ready]);
                    next = if reload_again {
                        Signal::Reload
                    } else {
                        signals.next().await
                    };
                }
                During::Stopped => {
                    info!("asked to stop during a reload: the reload is left unfinished");
                    break;
                }
            }
        }
        notify(&[sd_notify::NotifyState::Stopping]);
        info!("stopping");
        drop(conn);
        ExitCode::SUCCESS
    })
}

/// Tells systemd (Type=notify) about our state; a no-op when not started by systemd.
fn notify(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        warn!("cannot notify systemd: {e}");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::settings::agent_settings;
    use super::*;
    use crate::enforce::network::Steering;
    use crate::enforce::{CgroupDriver, PidPinning};
    use crate::policy::contention::Mode as ContentionMode;
    use crate::sense::sampler::GpuChoice;

    /// The shipped defaults, wired: right-sizing and contention both enforce, contention's calm
    /// level 0.15 under its threshold, GPUs sensed with NVML when there.
    #[test]
    fn defaults_wire_through() {
        let defaults = Config::default();
        let agent = agent_settings(&defaults);
        assert_eq!(agent.interval, Duration::from_secs(1));
        assert_eq!(agent.rightsize.enforce, Some(true));
        assert_eq!(agent.rightsize.warmup, Duration::from_secs(180));
        let contention = agent.contention.expect("contention on by default");
        assert_eq!(contention.mode, ContentionMode::Enforce);
        assert!((contention.membw_calm - 0.60).abs() < 1e-9);
        let enforce = enforce_settings(&defaults);
        assert_eq!(enforce.driver, CgroupDriver::Auto);
        assert_eq!(enforce.pid_jobs, PidPinning::Auto);
        assert_eq!(enforce.grant_rt_budget_us, None);
        let sampler = sampler_settings(&defaults);
        assert_eq!(sampler.gpu, GpuChoice::Auto);
        assert_eq!(sampler.perf_max_fds, 65536);
    }

    #[test]
    fn modes_map_as_documented() {
        let mut c = Config::default();
        c.rightsize.mode = config::RightsizeMode::Advise;
        c.rightsize.min_change_percent = 1.5;
        c.contention.mode = config::RightsizeMode::Advise;
        let agent = agent_settings(&c);
        assert_eq!(agent.rightsize.enforce, Some(false));
        assert_eq!(agent.rightsize.min_change, 1.5);
        let contention = agent.contention.expect("advise keeps contention on");
        assert_eq!(contention.mode, ContentionMode::Advise);
        c.rightsize.mode = config::RightsizeMode::Off;
        c.contention.mode = config::RightsizeMode::Off;
        let agent = agent_settings(&c);
        assert_eq!(agent.rightsize.enforce, None);
        assert!(agent.contention.is_none());
        assert_eq!(Bus::from(config::BusKind::Session), Bus::Session);
        assert_eq!(
            Steering::from(config::NetSteering::TcFilter),
            Steering::TcFilter
        );
        assert_eq!(
            GpuChoice::from(config::GpuSourceChoice::Emulated),
            GpuChoice::Emulated
        );
    }

    /// The kernel's isolated CPUs (`isolcpus=`) are kept free of jobs with the reserved ones,
    /// and none is lent.
    #[test]
    fn prepare_keeps_isolated_cpus_free_of_jobs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sys = dir.path().join("sys");
        let cpu_dir = sys.join("devices/system/cpu");
        for cpu in 0..4 {
            let t = cpu_dir.join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&t).expect("cpu dir");
            std::fs::write(t.join("physical_package_id"), "0\n").expect("package");
            std::fs::write(t.join("thread_siblings_list"), format!("{cpu}\n")).expect("siblings");
        }
        std::fs::write(cpu_dir.join("online"), "0-3\n").expect("online");
        std::fs::write(cpu_dir.join("isolated"), "2-3\n").expect("isolated");
        let path = dir.path().join("lodger.toml");
        std::fs::write(
            &path,
            format!(
                "[api]\ngroup = \"root\"\n[node]\nreserved_cpus = \"0\"\nsysfs_root = \"{}\"\n",
                sys.display()
            ),
        )
        .expect("config");
        let prepared = match prepare(Some(&path)) {
            Ok(p) => p,
            Err(e) => panic!("prepare: {e}"),
        };
        assert_eq!(prepared.reserved.to_string(), "0,2-3");
        assert_eq!(prepared.lendable.to_string(), "1");
        assert!(prepared.summary().contains("isolated by the kernel: 2-3"));
    }

    /// A group the node does not have fails prepare (the start and `--check-config`) at the line
    /// that names it, before anything else is read.
    #[test]
    fn prepare_refuses_a_group_the_node_does_not_have() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lodger.toml");
        let group = "lodger-no-such-group";
        assert_eq!(
            group_exists(group),
            Ok(false),
            "{group} exists on this host"
        );
        std::fs::write(&path, format!("[api]\n\ngroup = \"{group}\"\n")).expect("config");
        let err = match prepare(Some(&path)) {
            Ok(_) => panic!("prepared with api.group = {group}"),
            Err(e) => e.to_string(),
        };
        assert_eq!(
            err,
            format!(
                "{}:3: api.group: no such group \"{group}\" on this node (getent group {group})",
                path.display()
            )
        );
    }
}
