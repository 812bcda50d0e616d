//! lodgerd: the lodger daemon. Reads the config and the node, re-adopts the jobs in its state
//! file, runs the agent loop and serves `org.lodger1` on D-Bus until SIGTERM/SIGINT.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tracing::{error, info, warn};

use lodger::agent::{Agent, AgentSettings, Enforce, MbaTarget, RightsizeSettings};
use lodger::api::{self, Authority, Bus};
use lodger::cli::lodgerd::Cli;
use lodger::config::{self, Config};
use lodger::cpuset::CpuSet;
use lodger::enforce::instances::{InstanceSettings, Instances};
use lodger::enforce::network::node::{Classifier, NetworkControl, CPU_JOBS_MARK, NET_CLS_GROUP};
use lodger::enforce::network::route::CpuJobsRoute;
use lodger::enforce::sim::SimulatedEnforcer;
use lodger::enforce::{CgroupDriver, EnforceSettings, Enforcer, PidPinning, PinMethod};
use lodger::policy::contention::{ContentionConfig, Mode as ContentionMode};
use lodger::sense::membw::{CpuVendor, MbaCaps};
use lodger::sense::sampler::{GpuChoice, Sampler, SamplerSettings};
use lodger::store::Store;
use lodger::sys::cgroupfs::{find_net_cls_mount, CgroupVersion};
use lodger::sys::command::CommandRunner;
use lodger::topology::Topology;

fn init_logging(level: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("LODGER_LOG").unwrap_or_else(|_| EnvFilter::new(level));
    // Under systemd the journal adds its own timestamps and has no terminal colours.
    let under_journal = std::env::var_os("JOURNAL_STREAM").is_some();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!under_journal && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if under_journal {
        builder.without_time().with_target(false).init();
    } else {
        builder.with_target(false).init();
    }
}

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

struct Prepared {
    config: Config,
    topology: Topology,
    reserved: CpuSet,
}

fn prepare(cli: &Cli) -> Result<Prepared, String> {
    let config = match &cli.config {
        Some(path) => Config::load(path).map_err(|e| e.to_string())?,
        None => {
            let path = PathBuf::from(config::DEFAULT_CONFIG_PATH);
            if path.exists() {
                Config::load(&path).map_err(|e| e.to_string())?
            } else {
                Config::default()
            }
        }
    };
    let mut topology = Topology::read(&config.node.sysfs_root).map_err(|e| {
        format!(
            "cannot read the node's topology under {}: {e}",
            config.node.sysfs_root.display()
        )
    })?;
    let nodes: CpuSet = topology.numa_nodes.keys().copied().collect();
    config
        .check_gpu_overrides(&nodes)
        .map_err(|e| e.to_string())?;
    for gpu in &config.node.gpu {
        topology
            .override_gpu(gpu.index, gpu.numa_node)
            .map_err(|e| e.to_string())?;
    }
    let cpu0_siblings = topology
        .online()
        .first()
        .and_then(|c| topology.siblings(c).cloned())
        .unwrap_or_default();
    let reserved = config
        .resolve_reserved(&topology.online(), &cpu0_siblings)
        .map_err(|e| e.to_string())?;
    Ok(Prepared {
        config,
        topology,
        reserved,
    })
}

/// Network shaping (SODA §V-E) when `[[network.link]]` names interfaces, with the way CPU
/// jobs' traffic is told apart on this node's cgroups.
fn network_control(
    config: &Config,
    runner: Option<&Instances>,
    sim: bool,
) -> Option<NetworkControl> {
    let shaping = config.network.shaping();
    let slow = config.network.slow_network();
    if shaping.is_none() && slow.is_none() {
        info!("network shaping off: no [[network.link]] (or network.cpu_jobs_interface) in the config");
        return None;
    }
    if sim {
        info!("network shaping off: --sim changes nothing on the node");
        return None;
    }
    let classifier = match runner {
        None => Classifier::Unavailable("inference instances are unavailable".into()),
        Some(r) => match (r.cgroup_version(), r.placement()) {
            (CgroupVersion::V1, _) => {
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
            (CgroupVersion::V2, PinMethod::Cgroup) => Classifier::CgroupV2,
            // Instances stay in lodgerd's own cgroup: shaping moves them into a child of it.
            (CgroupVersion::V2, PinMethod::Affinity) => {
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
    let runner = Box::new(CommandRunner::new());
    let control = match (shaping, slow) {
        (_, Some(slow)) => CpuJobsRoute::new(slow, CPU_JOBS_MARK)
            .map(|route| NetworkControl::routing(route, runner, classifier)),
        (Some(shaping), None) => NetworkControl::new(
            &shaping,
            config.network.steering.to_steering(),
            runner,
            classifier,
        ),
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let prepared = match prepare(&cli) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("lodgerd: {e}");
            return ExitCode::from(2);
        }
    };
    let Prepared {
        config,
        topology,
        reserved,
    } = prepared;
    if cli.check_config {
        println!(
            "configuration OK: {} CPUs, {} NUMA node(s), {} GPU(s), reserved CPUs {}",
            topology.online().len(),
            topology.numa_nodes.len(),
            topology.gpus.len(),
            if reserved.is_empty() {
                "none".to_string()
            } else {
                reserved.to_string()
            }
        );
        return ExitCode::SUCCESS;
    }
    init_logging(&config.log.level.to_string());
    pin_self(&reserved);

    let mut runner = None;
    let enforcer: Box<dyn Enforce> = if cli.sim {
        info!("simulated enforcement: no cgroup or scheduling policy will be changed");
        Box::new(SimulatedEnforcer::new(config.node.proc_root.clone()))
    } else {
        let settings = EnforceSettings {
            cgroup_root: config.cgroup.root.clone(),
            proc_root: config.node.proc_root.clone(),
            driver: match config.cgroup.driver {
                config::CgroupDriver::Auto => CgroupDriver::Auto,
                config::CgroupDriver::V1 => CgroupDriver::V1,
                config::CgroupDriver::V2 => CgroupDriver::V2,
            },
            parent: config.cgroup.parent.clone(),
            pid_jobs: match config.cgroup.pid_jobs {
                config::PidJobs::Auto => PidPinning::Auto,
                config::PidJobs::Cgroup => PidPinning::Cgroup,
                config::PidJobs::Affinity => PidPinning::Affinity,
            },
            rt_priority: config.training.rt_priority,
            allow_unthrottled_rt: config.training.allow_unthrottled_rt,
            grant_rt_budget_us: config.training.grant_rt_budget_us(),
        };
        let probe = Duration::from_secs(config.inference.probe_seconds);
        let instance_settings = InstanceSettings {
            stop_grace: Duration::from_secs(config.inference.stop_grace_seconds),
            window: probe,
            ..InstanceSettings::with_enforce(&settings)
        };
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

    let settings = AgentSettings {
        interval: config.interval(),
        rt_priority: config.training.rt_priority,
        proc_root: config.node.proc_root.clone(),
        rightsize: RightsizeSettings {
            enforce: match config.rightsize.mode {
                config::RightsizeMode::Enforce => Some(true),
                config::RightsizeMode::Advise => Some(false),
                config::RightsizeMode::Off => None,
            },
            warmup: Duration::from_secs(config.rightsize.warmup_seconds),
            window: Duration::from_secs(config.rightsize.window_seconds),
            shrink: config.rightsize.shrink,
            tolerance: config.rightsize.tolerance_cores,
        },
        contention: match config.contention.mode {
            config::RightsizeMode::Off => None,
            mode => Some(ContentionConfig {
                mode: if mode == config::RightsizeMode::Advise {
                    ContentionMode::Advise
                } else {
                    ContentionMode::Enforce
                },
                membw_threshold: config.contention.membw_threshold,
                membw_calm: (config.contention.membw_threshold - 0.15).max(0.05),
                pressure_ticks: config.contention.pressure_ticks,
                calm_ticks: config.contention.calm_ticks,
                ..ContentionConfig::default()
            }),
        },
    };
    let store = Store::new(config.agent.state_dir.clone());
    let agent = match Agent::start(settings, topology, reserved, enforcer, store) {
        Ok(a) => a,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };
    // MBA for contention control, where resctrl has it.
    let agent = match MbaCaps::read(
        &config.sense.resctrl_root,
        &CpuVendor::from_cpuinfo(&config.node.proc_root).unwrap_or(CpuVendor::Other(String::new())),
    ) {
        Ok(caps) if !cli.sim => {
            agent.with_mba(MbaTarget::new(config.sense.resctrl_root.clone(), caps))
        }
        Ok(_) => agent,
        Err(e) => {
            info!("memory-bandwidth allocation (MBA) unavailable, contention control halves cores instead: {e}");
            agent
        }
    };
    let network = network_control(&config, runner.as_ref().map(|(r, _)| r), cli.sim);
    let agent = match runner {
        Some((r, probe)) => agent.with_runner(r, probe),
        None => agent,
    };
    let agent = match network {
        Some(n) => agent.with_network(n),
        None => agent,
    };
    let sampler = Sampler::open(SamplerSettings {
        interval: config.sense.interval(),
        proc_root: config.node.proc_root.clone(),
        sysfs_root: config.node.sysfs_root.clone(),
        gpu: match config.sense.gpu {
            config::GpuSourceChoice::Auto => GpuChoice::Auto,
            config::GpuSourceChoice::Nvml => GpuChoice::Nvml,
            config::GpuSourceChoice::Emulated => GpuChoice::Emulated,
            config::GpuSourceChoice::Off => GpuChoice::Off,
        },
        emulated_gpu_dir: config.sense.emulated_gpu_dir.clone(),
        perf: config.sense.perf,
        perf_max_fds: usize::try_from(config.sense.perf_max_fds).unwrap_or(usize::MAX),
        resctrl_root: config.sense.resctrl_root.clone(),
        membw_peak_bytes_per_s: config.sense.membw_peak_bytes_per_s,
    });
    let mut sense_thread = None;
    let agent = match sampler.spawn() {
        Ok((link, join)) => {
            sense_thread = Some(join);
            agent.with_sensor(link)
        }
        Err(e) => {
            warn!("cannot start the sensing thread: {e}; running without measurements");
            agent
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
    let bus = match config.api.bus {
        config::BusKind::System => Bus::System,
        config::BusKind::Session => Bus::Session,
    };
    let auth = Authority {
        group: config.api.group.clone(),
    };
    let rt_priority = config.training.rt_priority;
    let code = rt.block_on(async {
        let conn = match api::serve(bus, handle.clone(), auth, rt_priority).await {
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
        if let Some(period) = sd_notify::watchdog_enabled() {
            tokio::spawn(watchdog(handle.clone(), period, config.interval()));
        }
        wait_for_signal().await;
        notify(&[sd_notify::NotifyState::Stopping]);
        info!("stopping");
        drop(conn);
        ExitCode::SUCCESS
    });
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

/// Tells systemd (Type=notify) about our state; a no-op when not started by systemd.
fn notify(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        warn!("cannot notify systemd: {e}");
    }
}

/// Pings systemd's watchdog only while the agent loop makes progress: a wedged agent (stuck in a
/// kernel call, deadlocked) stops the pings and systemd restarts lodgerd. Not a bare timer.
async fn watchdog(agent: lodger::agent::AgentHandle, period: Duration, interval: Duration) {
    let mut seen = agent.ticks();
    let mut last_progress = Instant::now();
    let mut every = tokio::time::interval(period / 2);
    loop {
        every.tick().await;
        let now = agent.ticks();
        if now != seen {
            seen = now;
            last_progress = Instant::now();
        }
        // A tick is due every `interval`; allow two to be late before going quiet.
        if last_progress.elapsed() <= interval * 2 + period / 2 {
            notify(&[sd_notify::NotifyState::Watchdog]);
        } else {
            warn!(
                "agent loop made no progress for {:?}; not pinging the watchdog",
                last_progress.elapsed()
            );
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the default action (exit) still stops lodgerd.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
