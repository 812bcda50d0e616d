//! daemon::settings: the config's sections turned into the settings of the rooms below
//! (enforce, instances, sense, agent, trust), with the node's memory for the bounds given as a
//! share of it. Reads `/proc/meminfo`; touches nothing else.

use std::time::Duration;

use tracing::warn;

use crate::agent::{AgentSettings, RightsizeSettings, TrustSettings};
use crate::api::Bus;
use crate::config::{self, Config};
use crate::enforce::instances::InstanceSettings;
use crate::enforce::network::Steering;
use crate::enforce::{CgroupDriver, EnforceSettings, JobMemory, PidPinning, TrainingClass};
use crate::policy::contention::{ContentionConfig, Mode as ContentionMode};
use crate::sense::sampler::{GpuChoice, SamplerSettings};

// ---------------------------------------------------------------------------------------------
// Config → settings. The config's enums carry the file's spelling; these are the types the
// rooms below take.

impl From<config::CgroupDriver> for CgroupDriver {
    fn from(driver: config::CgroupDriver) -> Self {
        match driver {
            config::CgroupDriver::Auto => CgroupDriver::Auto,
            config::CgroupDriver::V1 => CgroupDriver::V1,
            config::CgroupDriver::V2 => CgroupDriver::V2,
        }
    }
}

impl From<config::PidJobs> for PidPinning {
    fn from(pid_jobs: config::PidJobs) -> Self {
        match pid_jobs {
            config::PidJobs::Auto => PidPinning::Auto,
            config::PidJobs::Cgroup => PidPinning::Cgroup,
            config::PidJobs::Affinity => PidPinning::Affinity,
        }
    }
}

impl From<config::GpuSourceChoice> for GpuChoice {
    fn from(gpu: config::GpuSourceChoice) -> Self {
        match gpu {
            config::GpuSourceChoice::Auto => GpuChoice::Auto,
            config::GpuSourceChoice::Nvml => GpuChoice::Nvml,
            config::GpuSourceChoice::Emulated => GpuChoice::Emulated,
            config::GpuSourceChoice::Off => GpuChoice::Off,
        }
    }
}

impl From<config::NetSteering> for Steering {
    fn from(steering: config::NetSteering) -> Self {
        match steering {
            config::NetSteering::Auto => Steering::Auto,
            config::NetSteering::TcFilter => Steering::TcFilter,
            config::NetSteering::Nft => Steering::Nft,
        }
    }
}

impl From<config::BusKind> for Bus {
    fn from(bus: config::BusKind) -> Self {
        match bus {
            config::BusKind::System => Bus::System,
            config::BusKind::Session => Bus::Session,
        }
    }
}

/// `[cgroup]` and `[training]`: how training jobs are pinned and scheduled.
pub(super) fn enforce_settings(config: &Config) -> EnforceSettings {
    EnforceSettings {
        cgroup_root: config.cgroup.root.clone(),
        proc_root: config.node.proc_root.clone(),
        driver: config.cgroup.driver.into(),
        parent: config.cgroup.parent.clone(),
        pid_jobs: config.cgroup.pid_jobs.into(),
        rt_priority: config.training.rt_priority,
        allow_unthrottled_rt: config.training.allow_unthrottled_rt,
        grant_rt_budget_us: config.training.grant_rt_budget_us(),
        class: match config.training.policy {
            config::TrainingPolicy::Rr => TrainingClass::Rr {
                roles: config.training.role_priorities,
            },
            config::TrainingPolicy::Other => TrainingClass::Other {
                nice: config.training.other_nice,
            },
        },
        slurm_cgroups: config.slurm.cgroup_paths.clone(),
        job_memory: JobMemory::Protect,
        process_events: true,
    }
}

/// `[batch]`: batch jobs are placed as training jobs are, in their own class.
pub(super) fn batch_settings(config: &Config) -> EnforceSettings {
    EnforceSettings {
        class: TrainingClass::Lodger {
            sched_batch: config.batch.policy == config::BatchPolicy::Batch,
        },
        job_memory: match memory_of_node(config, config.batch.memory_max, "batch.memory_max") {
            Some(max) => JobMemory::Limit {
                max,
                high: crate::job::memory::high_of(
                    max,
                    crate::job::memory::BATCH_MEMORY_HIGH_PERCENT,
                ),
            },
            None => JobMemory::Untouched,
        },
        ..enforce_settings(config)
    }
}

/// `[inference]`: the instance runner's settings and the layout probe's length.
/// Under `agent.state_dir`: the instances' report FIFOs.
pub(super) const INSTANCE_REPORT_DIR: &str = "instances";

pub(super) fn instance_settings(
    config: &Config,
    enforce: &EnforceSettings,
) -> (InstanceSettings, Duration) {
    let probe = Duration::from_secs(config.inference.probe_seconds);
    let settings = InstanceSettings {
        stop_grace: Duration::from_secs(config.inference.stop_grace_seconds),
        window: probe,
        // Under "other" training is SCHED_OTHER too: only SCHED_IDLE keeps lodgers below it.
        offline_idle: config.training.lodgers_sched_idle
            || config.training.policy == config::TrainingPolicy::Other,
        // Report FIFOs outlive lodgerd with the instances (issue 17).
        report_dir: Some(config.agent.state_dir.join(INSTANCE_REPORT_DIR)),
        memory_max: instance_memory_max(config),
        memory_high_percent: config.inference.memory_high_percent,
        ..InstanceSettings::with_enforce(enforce)
    };
    (settings, probe)
}

/// What lodgerd's enforcers turned out able to do on this node at start. The settings from
/// the config are adjusted to it at start and on every reload alike ([`agent_settings_on`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Enforceable {
    /// The batch enforcer writes memory limits. Without, batch jobs get none, so none may ask
    /// for one (`batch.memory_max` is not applied).
    pub batch_memory: bool,
}

/// The agent loop's settings from `config` ([`agent_settings`]) on a node whose enforcers can do
/// what `node` says: start and reload both come here.
pub(super) fn agent_settings_on(config: &Config, node: Enforceable) -> AgentSettings {
    let mut settings = agent_settings(config);
    if !node.batch_memory {
        settings.trust.batch_memory_max = None;
    }
    settings
}

/// `[agent]`, `[rightsize]` and `[contention]`: the agent loop's settings, as the config asks
/// (see [`agent_settings_on`] for this node's).
pub(super) fn agent_settings(config: &Config) -> AgentSettings {
    AgentSettings {
        interval: config.interval(),
        slurm_appear_timeout: Duration::from_secs(config.slurm.appear_timeout_seconds),
        // Resolved against the node in `prepare` (see `run`).
        lendable: None,
        training_core_batch_ms: config.inference.training_core_batch_ms,
        rt_priority: config.training.rt_priority,
        proc_root: config.node.proc_root.clone(),
        rt_headroom_percent: match config.training.policy {
            config::TrainingPolicy::Rr => Some(config.training.rt_headroom_percent),
            config::TrainingPolicy::Other => None,
        },
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
            min_change: config.rightsize.min_change_percent,
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
                memory_pressure_percent: config.contention.memory_pressure_percent,
                memory_pressure_calm_percent: config.contention.memory_pressure_percent / 2.0,
                ..ContentionConfig::default()
            }),
        },
        trust: trust_settings(config),
    }
}

/// `[api]`'s trust settings, with the directory job cgroups are relative to (v2's root, or
/// v1's cpuset hierarchy).
pub(super) fn trust_settings(config: &Config) -> TrustSettings {
    let root = &config.cgroup.root;
    let cgroup_dir = if root.join("cgroup.controllers").exists() {
        root.clone()
    } else {
        root.join("cpuset")
    };
    TrustSettings {
        cgroup_dir,
        cgroup_roots: config.api.cgroup_roots.clone(),
        lodger_cgroup: format!("/{}", config.cgroup.parent),
        max_jobs_per_owner: config.api.max_jobs_per_owner,
        max_instances_per_owner: config.api.max_instances_per_owner,
        instance_memory_max: instance_memory_max(config),
        batch_memory_max: memory_of_node(config, config.batch.memory_max, "batch.memory_max"),
        slurm_cgroups: config.slurm.cgroup_paths.clone(),
    }
}

/// `inference.memory_max` in bytes on this node (see [`memory_of_node`]).
pub(super) fn instance_memory_max(config: &Config) -> Option<u64> {
    memory_of_node(config, config.inference.memory_max, "inference.memory_max")
}

/// A memory bound in bytes on this node (a share is of `MemTotal`); `None`: no limit, or a
/// share where `/proc/meminfo` cannot be read (said in the log, naming `key`).
pub(super) fn memory_of_node(
    config: &Config,
    bound: config::MemoryBound,
    key: &str,
) -> Option<u64> {
    use procfs::FromRead;
    let total = match bound {
        config::MemoryBound::Percent(_) => {
            let path = config.node.proc_root.join("meminfo");
            match procfs::Meminfo::from_file(&path) {
                Ok(m) => m.mem_total,
                Err(e) => {
                    warn!(
                        "{key} = {} is not applied: a share needs the node's memory from {}: {e}",
                        bound.spelling(),
                        path.display()
                    );
                    return None;
                }
            }
        }
        _ => 0,
    };
    bound.resolve(total)
}

/// `[sense]`: the sensing thread's settings.
pub(super) fn sampler_settings(config: &Config) -> SamplerSettings {
    SamplerSettings {
        interval: config.sense.interval(),
        proc_root: config.node.proc_root.clone(),
        sysfs_root: config.node.sysfs_root.clone(),
        gpu: config.sense.gpu.into(),
        emulated_gpu_dir: config.sense.emulated_gpu_dir.clone(),
        perf: config.sense.perf,
        perf_max_fds: usize::try_from(config.sense.perf_max_fds).unwrap_or(usize::MAX),
        resctrl_root: config.sense.resctrl_root.clone(),
        membw_peak_bytes_per_s: config.sense.membw_peak_bytes_per_s,
        cgroup_root: config.cgroup.root.clone(),
    }
}
