//! What an inference job runs (`InferenceSpec`), how its instances start for their owner
//! (`Launch`) and how an instance is shown (`InstanceView`). Pure data and validation.

use serde::{Deserialize, Serialize};

use super::SpecError;
use crate::cpuset::CpuSet;

/// What an inference job runs and what it must meet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferenceSpec {
    /// argv template of one instance, with placeholders `{threads}`, `{batch}`, `{cpus}`,
    /// `{instance}`, `{job}` (see docs/instance-protocol.md).
    pub command: Vec<String>,
    /// Online: the p99 latency the job's requests must stay under (every instance's batches
    /// together), in milliseconds.
    pub slo_ms: Option<f64>,
    /// Online: the expected request rate of the whole job, per second.
    pub rate_per_s: Option<f64>,
    /// Largest batch an instance may be given.
    pub max_batch: u32,
    /// Most instances the job may run (none: as many as fit).
    pub max_instances: Option<u32>,
    /// Where and how the instances start on their owner's behalf.
    #[serde(default)]
    pub launch: Launch,
    /// Each instance's memory limit in bytes (none: the node's `inference.memory_max`, which
    /// also caps it for every caller but root registering for root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
}

/// How lodger starts an inference job's instances for their owner (docs/security.md): as the
/// owner, in `cwd`, with a clean environment plus `env`, the output appended to `output`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Launch {
    /// Absolute working directory (lodgerctl sends its own); None: the owner's home, or `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Extra environment, `NAME=value` each (never `LODGER_*` or the thread variables).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Absolute file the instances' stdout and stderr are appended to, opened as the owner;
    /// None: where lodgerd's `[inference]` output setting sends them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

/// Most `env` entries one job may pass.
pub const MAX_LAUNCH_ENV: usize = 256;

/// Variables lodger sets itself, which a caller's `env` may not override.
fn reserved_env(name: &str) -> bool {
    name.starts_with("LODGER_")
        || matches!(
            name,
            "OMP_NUM_THREADS" | "MKL_NUM_THREADS" | "OPENBLAS_NUM_THREADS"
        )
}

impl Launch {
    pub(super) fn validate(&self) -> Result<(), SpecError> {
        for (key, path) in [("cwd", &self.cwd), ("output", &self.output)] {
            if let Some(p) = path {
                if !p.starts_with('/') || p.contains('\0') || p.len() > super::MAX_PATH_LEN {
                    return Err(SpecError::BadLaunchPath {
                        key,
                        path: p.clone(),
                    });
                }
            }
        }
        if self.env.len() > MAX_LAUNCH_ENV {
            return Err(SpecError::BadEnv(format!(
                "{} entries (at most {MAX_LAUNCH_ENV})",
                self.env.len()
            )));
        }
        for entry in &self.env {
            if entry.len() > super::MAX_ARG_LEN {
                return Err(SpecError::BadEnv(format!(
                    "an entry of {} bytes (at most {})",
                    entry.len(),
                    super::MAX_ARG_LEN
                )));
            }
            let name = entry.split_once('=').map(|(n, _)| n).unwrap_or("");
            let valid = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !entry.contains('\0');
            if !valid {
                return Err(SpecError::BadEnv(format!(
                    "'{entry}' is not NAME=value (NAME: letters, digits and '_')"
                )));
            }
            if reserved_env(name) {
                return Err(SpecError::BadEnv(format!(
                    "{name} is set by lodger itself (LODGER_* and the thread-count variables)"
                )));
            }
        }
        Ok(())
    }
}

/// Default `max_batch` when the caller gives none.
pub const DEFAULT_MAX_BATCH: u32 = 64;

/// An inference job's request latency over the last window, every instance's batches pooled.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct JobLatency {
    pub p50: f64,
    pub p99: f64,
}

/// One inference instance as `lodgerctl show` displays it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InstanceView {
    pub index: u32,
    pub pid: Option<u32>,
    pub cpus: CpuSet,
    pub threads: u32,
    pub batch: u32,
    /// running, backing-off, stopping, waiting (for a stopping instance, or a moving one, to
    /// leave its CPUs; offline: for a moving one only; also one restarting after its back-off),
    /// moving (online, serving on `cpus` until a stopping instance leaves the CPUs the plan now
    /// gives it).
    pub state: String,
    pub restarts: u32,
    /// Times the OOM killer took it (since this lodgerd started supervising it).
    #[serde(default)]
    pub oom_kills: u32,
    /// Its memory limit in bytes, where one is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// Requests served per second over the last window.
    pub items_per_s: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}
