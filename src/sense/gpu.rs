//! GPU sensing: per-GPU and per-process utilization from one of two sources behind
//! [`GpuSource`]: NVML (`libnvidia-ml.so.1`, loaded at run time through `nvml-wrapper`), or the
//! bundled training emulator's published busy fraction ([`EmulatedSource`]), which lets a host
//! without GPUs drive the same code path. Every snapshot names its source, and the emulated one
//! says "emulated" wherever it is shown, so the two cannot be mistaken for each other.
//!
//! May touch libnvidia-ml (read-only queries), the emulator's publish directory and
//! `<proc_root>/<pid>` (read). The only writes are [`write_emulated_record`] and
//! [`remove_emulated_record`], which the emulator (not lodgerd) calls.
//!
//! SODA §V-B right-sizes a training job's cores from its GPU utilization; [`job_utilization`]
//! attributes utilization to a job by the pids of its processes.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::clock::unix_ms;
use nvml_wrapper::enum_wrappers::device::{Clock, PcieUtilCounter};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use serde::{Deserialize, Serialize};

/// The library NVML lives in; the driver package installs it.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// How often to sample by default.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// NVML refreshes utilization every 1/6 s to 1 s depending on the GPU: sampling more often
/// returns the same numbers, so [`NvmlSource`] hands back its previous snapshot when asked
/// sooner than this. Per-process utilization is the stricter limit: a query covering less than
/// the GPU's own sampling period may hold no sample for a busy process, which then reads 0;
/// hence the 1 s default.
pub const MIN_SAMPLE_INTERVAL: Duration = Duration::from_millis(167);
/// Where the training emulator publishes, unless configured otherwise.
pub const DEFAULT_EMULATED_GPU_DIR: &str = "/run/lodger/emulated-gpu";
/// The environment variable the emulator reads for its publish directory when `--publish-dir`
/// is not given.
pub const EMULATED_GPU_DIR_ENV: &str = "LODGER_EMULATED_GPU_DIR";
/// An emulator record older than this is ignored: its writer stopped or hangs. The emulator
/// rewrites its record about once a second.
pub const DEFAULT_EMULATED_STALE_AFTER: Duration = Duration::from_secs(5);
/// Longest record file read; a real one is under 150 bytes.
const EMULATED_RECORD_MAX_BYTES: u64 = 4096;
/// How an emulated device names itself in status output.
pub const EMULATED_DEVICE_NAME: &str = "emulated GPU (train_emulator)";

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// NVML cannot be used on this host; lodgerd logs `GPU sensing off: <this error>` once.
    /// `lasting`: the library is absent or too old, so opening it again fails the same way;
    /// otherwise (the kernel driver not loaded yet, its device files not made yet) it may pass.
    #[error("NVML unavailable ({library}): {reason}")]
    NvmlUnavailable {
        library: String,
        reason: String,
        lasting: bool,
    },
    #[error("NVML {call}{} failed: {source}", gpu_suffix(*.gpu))]
    Nvml {
        gpu: Option<u32>,
        call: &'static str,
        source: NvmlError,
    },
    #[error("cannot read emulated GPU directory {path}: {source}")]
    EmulatedDir { path: PathBuf, source: io::Error },
    #[error("'{value}' is not a GPU source (expected \"nvml\" or \"emulated\")")]
    UnknownSource { value: String },
}

impl GpuError {
    /// Whether opening the source again later may succeed: NVML failed for a reason other than
    /// a missing or too old library.
    pub fn may_pass(&self) -> bool {
        matches!(self, GpuError::NvmlUnavailable { lasting: false, .. })
    }
}

fn gpu_suffix(gpu: Option<u32>) -> String {
    gpu.map(|i| format!(" on GPU {i}")).unwrap_or_default()
}

/// Which source a snapshot came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuSourceKind {
    /// Real GPUs, through NVML.
    Nvml,
    /// The training emulator's published busy fraction: no GPU is involved.
    Emulated,
}

impl GpuSourceKind {
    /// The word used in config (`gpu.source`), status output and metric labels (`source=`).
    pub fn as_str(self) -> &'static str {
        match self {
            GpuSourceKind::Nvml => "nvml",
            GpuSourceKind::Emulated => "emulated",
        }
    }

    pub fn parse(value: &str) -> Result<Self, GpuError> {
        match value {
            "nvml" => Ok(GpuSourceKind::Nvml),
            "emulated" => Ok(GpuSourceKind::Emulated),
            _ => Err(GpuError::UnknownSource {
                value: value.to_string(),
            }),
        }
    }
}

impl fmt::Display for GpuSourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A source of GPU snapshots. `sample` may block (NVML's PCIe counters take 20 ms each per
/// GPU): call it off the agent loop's critical path and hand the snapshot over.
pub trait GpuSource: Send {
    fn kind(&self) -> GpuSourceKind;
    fn sample(&mut self) -> Result<GpuSnapshot, GpuError>;
}

/// Opens the configured source: NVML from its default library, or the emulator's directory.
pub fn open_source(
    kind: GpuSourceKind,
    emulated_dir: &Path,
    proc_root: &Path,
) -> Result<Box<dyn GpuSource>, GpuError> {
    Ok(match kind {
        GpuSourceKind::Nvml => Box::new(NvmlSource::open()?),
        GpuSourceKind::Emulated => Box::new(EmulatedSource::new(emulated_dir, proc_root)),
    })
}

/// Every GPU and every GPU process at one time, from one source. Utilizations are fractions
/// (0 to 1); a field is `None` when the source does not report it (the emulator reports only
/// utilization; NVML answers NotSupported for some fields on some GPUs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuSnapshot {
    pub source: GpuSourceKind,
    pub taken_unix_ms: u64,
    pub devices: Vec<GpuDevice>,
    pub processes: Vec<GpuProcess>,
    /// GPUs that did not answer this pass, each with why (NVML: one fallen off the bus, Xid
    /// 79): left out, the others' figures kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<(u32, String)>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuDevice {
    pub index: u32,
    pub name: Option<String>,
    pub uuid: Option<String>,
    /// Fraction of the last sample period in which a kernel ran (the emulator: in which its
    /// emulated GPU step ran).
    pub util_gpu: Option<f64>,
    /// Fraction of the last sample period in which device memory was read or written.
    pub util_memory: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_mw: Option<u32>,
    /// PCIe throughput as NVML gives it: KB/s over a 20 ms window.
    pub pcie_tx_kb_per_s: Option<u32>,
    pub pcie_rx_kb_per_s: Option<u32>,
}

impl GpuDevice {
    /// PCIe transmit in bytes/s (NVML's KB are 1024 bytes).
    pub fn pcie_tx_bytes_per_s(&self) -> Option<f64> {
        self.pcie_tx_kb_per_s.map(|kb| f64::from(kb) * 1024.0)
    }

    pub fn pcie_rx_bytes_per_s(&self) -> Option<f64> {
        self.pcie_rx_kb_per_s.map(|kb| f64::from(kb) * 1024.0)
    }

    pub fn power_watts(&self) -> Option<f64> {
        self.power_mw.map(|mw| f64::from(mw) / 1000.0)
    }

    fn bare(index: u32) -> Self {
        Self {
            index,
            name: None,
            uuid: None,
            util_gpu: None,
            util_memory: None,
            sm_clock_mhz: None,
            memory_used_bytes: None,
            memory_total_bytes: None,
            power_mw: None,
            pcie_tx_kb_per_s: None,
            pcie_rx_kb_per_s: None,
        }
    }
}

/// One process on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub gpu: u32,
    /// Share of the GPU's SM time this process had over the sample period. `Some(0.0)` for a
    /// compute process with no utilization sample (NVML only reports processes that were busy);
    /// `None` when the GPU cannot report per-process utilization at all.
    pub sm_util: Option<f64>,
    pub mem_util: Option<f64>,
    pub used_memory_bytes: Option<u64>,
    /// Training iterations per second (emulated source only).
    pub iters_per_s: Option<f64>,
}

impl GpuSnapshot {
    pub fn status(&self) -> GpuStatus {
        GpuStatus::On {
            source: self.source,
            devices: self.devices.len(),
            failed: self.failed.clone(),
        }
    }
}

/// GPU sensing as shown in `lodgerctl status`/`top` and on D-Bus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "state")]
pub enum GpuStatus {
    /// No source: NVML absent (or the configured source failed to open).
    Unavailable { reason: String },
    On {
        source: GpuSourceKind,
        devices: usize,
        /// GPUs that did not answer the last pass, with why.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        failed: Vec<(u32, String)>,
    },
}

impl GpuStatus {
    pub fn unavailable(error: &GpuError) -> Self {
        GpuStatus::Unavailable {
            reason: error.to_string(),
        }
    }
}

impl fmt::Display for GpuStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuStatus::Unavailable { reason } => write!(f, "unavailable: {reason}"),
            GpuStatus::On {
                source: GpuSourceKind::Nvml,
                devices,
                failed,
            } => {
                write!(f, "nvml: {devices} GPU(s)")?;
                for (index, why) in failed {
                    write!(f, "; GPU {index} left out: {why}")?;
                }
                Ok(())
            }
            GpuStatus::On {
                source: GpuSourceKind::Emulated,
                devices,
                ..
            } => write!(
                f,
                "emulated (train_emulator, no real GPU): {devices} emulated GPU(s)"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attribution.

/// A job's share of the GPUs, from the processes it owns.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobGpuUtilization {
    pub source: GpuSourceKind,
    /// Per GPU the job has a process on: the sum of its processes' SM shares, at most 1.
    pub per_gpu: BTreeMap<u32, f64>,
    /// Mean of `per_gpu`; `None` when nothing could be attributed.
    pub mean: Option<f64>,
    /// GPUs the job has processes on whose utilization cannot be attributed to it: no
    /// per-process utilization, and other jobs' processes share the GPU.
    pub unattributed: Vec<u32>,
    /// Sum of the job's processes' iteration rates (emulated source only).
    pub iters_per_s: Option<f64>,
}

/// Attributes GPU utilization to the job whose processes are `pids`. Pure.
///
/// Per GPU, the job's share is the sum of its processes' SM shares. Where the GPU cannot report
/// per-process utilization, the device's utilization counts as the job's only if every process
/// on that GPU is the job's (the usual one-training-job-per-GPU case); otherwise the GPU is
/// listed as unattributed rather than guessed at.
pub fn job_utilization(snapshot: &GpuSnapshot, pids: &BTreeSet<u32>) -> JobGpuUtilization {
    let mut on_gpu: BTreeMap<u32, Vec<&GpuProcess>> = BTreeMap::new();
    for p in snapshot.processes.iter().filter(|p| pids.contains(&p.pid)) {
        on_gpu.entry(p.gpu).or_default().push(p);
    }
    let mut per_gpu = BTreeMap::new();
    let mut unattributed = Vec::new();
    for (&gpu, procs) in &on_gpu {
        let shares: Option<Vec<f64>> = procs.iter().map(|p| p.sm_util).collect();
        let share = match shares {
            Some(shares) => Some(shares.iter().sum::<f64>()),
            None => {
                let sole_owner = snapshot
                    .processes
                    .iter()
                    .filter(|p| p.gpu == gpu)
                    .all(|p| pids.contains(&p.pid));
                let device = snapshot.devices.iter().find(|d| d.index == gpu);
                device.and_then(|d| d.util_gpu).filter(|_| sole_owner)
            }
        };
        match share {
            Some(share) => {
                per_gpu.insert(gpu, share.clamp(0.0, 1.0));
            }
            None => unattributed.push(gpu),
        }
    }
    let mean = (!per_gpu.is_empty()).then(|| per_gpu.values().sum::<f64>() / per_gpu.len() as f64);
    let rates: Vec<f64> = on_gpu
        .values()
        .flatten()
        .filter_map(|p| p.iters_per_s)
        .collect();
    JobGpuUtilization {
        source: snapshot.source,
        per_gpu,
        mean,
        unattributed,
        iters_per_s: (!rates.is_empty()).then(|| rates.iter().sum()),
    }
}

// ---------------------------------------------------------------------------------------------
// NVML.

/// Real GPUs through NVML.
pub struct NvmlSource {
    nvml: Nvml,
    library: String,
    /// Per GPU, the newest process-utilization sample timestamp seen (µs), so each query
    /// returns only samples taken since the previous one.
    last_seen_us: BTreeMap<u32, u64>,
    pcie: bool,
    last: Option<(Instant, GpuSnapshot)>,
}

impl fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlSource")
            .field("library", &self.library)
            .field("pcie", &self.pcie)
            .finish_non_exhaustive()
    }
}

impl NvmlSource {
    /// Loads [`NVML_LIBRARY`] and initializes NVML. Without the driver this is
    /// [`GpuError::NvmlUnavailable`] with the reason, never a panic.
    pub fn open() -> Result<Self, GpuError> {
        Self::open_library(NVML_LIBRARY)
    }

    /// As [`NvmlSource::open`], from a library path (a non-default install, or a test).
    pub fn open_library(library: impl AsRef<OsStr>) -> Result<Self, GpuError> {
        let library = library.as_ref();
        let name = library.to_string_lossy().into_owned();
        let nvml = Nvml::builder()
            .lib_path(library)
            .init()
            .map_err(|e| nvml_unavailable(&name, e))?;
        Ok(Self {
            nvml,
            library: name,
            last_seen_us: BTreeMap::new(),
            pcie: true,
            last: None,
        })
    }

    /// Turns the PCIe counters on or off (on by default). Each takes NVML 20 ms per GPU and
    /// direction, which dominates a sample's cost on an 8-GPU host.
    pub fn with_pcie(mut self, pcie: bool) -> Self {
        self.pcie = pcie;
        self
    }

    fn read(&mut self) -> Result<GpuSnapshot, GpuError> {
        let count = self
            .nvml
            .device_count()
            .map_err(nvml_err(None, "nvmlDeviceGetCount"))?;
        let read: Vec<(u32, Result<Device, GpuError>)> = (0..count)
            .map(|index| (index, self.read_device(index)))
            .collect();
        assemble(GpuSourceKind::Nvml, unix_ms(), read)
    }

    /// One GPU's figures and its processes'.
    fn read_device(&mut self, index: u32) -> Result<Device, GpuError> {
        let dev = self
            .nvml
            .device_by_index(index)
            .map_err(nvml_err(Some(index), "nvmlDeviceGetHandleByIndex"))?;
        let at = |call| move |e| nvml_err(Some(index), call)(e);
        let util = optional(dev.utilization_rates()).map_err(at("utilization_rates"))?;
        let memory = optional(dev.memory_info()).map_err(at("memory_info"))?;
        let (tx, rx) = if self.pcie {
            (
                optional(dev.pcie_throughput(PcieUtilCounter::Send))
                    .map_err(at("pcie_throughput"))?,
                optional(dev.pcie_throughput(PcieUtilCounter::Receive))
                    .map_err(at("pcie_throughput"))?,
            )
        } else {
            (None, None)
        };
        let device = GpuDevice {
            index,
            name: optional(dev.name()).map_err(at("name"))?,
            uuid: optional(dev.uuid()).map_err(at("uuid"))?,
            util_gpu: util.as_ref().map(|u| percent(u.gpu)),
            util_memory: util.as_ref().map(|u| percent(u.memory)),
            sm_clock_mhz: optional(dev.clock_info(Clock::SM)).map_err(at("clock_info"))?,
            memory_used_bytes: memory.as_ref().map(|m| m.used),
            memory_total_bytes: memory.as_ref().map(|m| m.total),
            power_mw: optional(dev.power_usage()).map_err(at("power_usage"))?,
            pcie_tx_kb_per_s: tx,
            pcie_rx_kb_per_s: rx,
        };

        let running = optional(dev.running_compute_processes())
            .map_err(at("running_compute_processes"))?
            .unwrap_or_default();
        let since = self.last_seen_us.get(&index).copied();
        // NotFound means "no samples in the period": an empty answer, not a failure.
        let samples = match dev.process_utilization_stats(since) {
            Ok(samples) => Some(samples),
            Err(NvmlError::NotFound) => Some(Vec::new()),
            Err(e) if not_reported(&e) => None,
            Err(e) => return Err(at("process_utilization_stats")(e)),
        };
        if let Some(newest) = samples
            .as_ref()
            .and_then(|s| s.iter().map(|s| s.timestamp).max())
        {
            self.last_seen_us.insert(index, newest);
        }
        let used: Vec<(u32, Option<u64>)> = running
            .iter()
            .map(|p| {
                let bytes = match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                };
                (p.pid, bytes)
            })
            .collect();
        let util: Option<Vec<UtilSample>> = samples.map(|s| {
            s.iter()
                .map(|s| UtilSample {
                    pid: s.pid,
                    sm_percent: s.sm_util,
                    mem_percent: s.mem_util,
                })
                .collect()
        });
        Ok((device, merge_processes(index, &used, util.as_deref())))
    }
}

/// One GPU as read: its figures and its processes'.
type Device = (GpuDevice, Vec<GpuProcess>);

/// The snapshot from every GPU's reading: a GPU that did not answer is left out (its error kept
/// in `failed`) and the others' figures kept, so one GPU fallen off the bus does not blind the
/// jobs on the rest. An error only when no GPU answered.
fn assemble(
    source: GpuSourceKind,
    taken_unix_ms: u64,
    read: Vec<(u32, Result<Device, GpuError>)>,
) -> Result<GpuSnapshot, GpuError> {
    let mut snapshot = GpuSnapshot {
        source,
        taken_unix_ms,
        devices: Vec::new(),
        processes: Vec::new(),
        failed: Vec::new(),
    };
    let mut first_error = None;
    for (index, r) in read {
        match r {
            Ok((device, processes)) => {
                snapshot.devices.push(device);
                snapshot.processes.extend(processes);
            }
            Err(e) => {
                snapshot.failed.push((index, e.to_string()));
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if snapshot.devices.is_empty() => Err(e),
        _ => Ok(snapshot),
    }
}

impl GpuSource for NvmlSource {
    fn kind(&self) -> GpuSourceKind {
        GpuSourceKind::Nvml
    }

    fn sample(&mut self) -> Result<GpuSnapshot, GpuError> {
        if let Some((at, snapshot)) = &self.last {
            if at.elapsed() < MIN_SAMPLE_INTERVAL {
                return Ok(snapshot.clone());
            }
        }
        let snapshot = self.read()?;
        self.last = Some((Instant::now(), snapshot.clone()));
        Ok(snapshot)
    }
}

/// One process-utilization sample as NVML gives it: percentages over one sampling interval.
#[derive(Debug, Clone, Copy)]
struct UtilSample {
    pid: u32,
    sm_percent: u32,
    mem_percent: u32,
}

/// What NVML said about one pid on one GPU during a query.
#[derive(Debug, Default)]
struct PidSeen {
    used_memory_bytes: Option<u64>,
    sm_percent: Vec<u32>,
    mem_percent: Vec<u32>,
}

/// Joins NVML's two per-process answers for one GPU: the running compute processes (pid, memory)
/// and the utilization samples since the last query (several per pid when the period spans
/// several of NVML's sampling intervals: they are averaged). `util` is `None` when the GPU
/// cannot report per-process utilization. Pure.
fn merge_processes(
    gpu: u32,
    running: &[(u32, Option<u64>)],
    util: Option<&[UtilSample]>,
) -> Vec<GpuProcess> {
    let mut by_pid: BTreeMap<u32, PidSeen> = BTreeMap::new();
    for &(pid, bytes) in running {
        by_pid.entry(pid).or_default().used_memory_bytes = bytes;
    }
    for sample in util.unwrap_or_default() {
        let seen = by_pid.entry(sample.pid).or_default();
        seen.sm_percent.push(sample.sm_percent);
        seen.mem_percent.push(sample.mem_percent);
    }
    let mean = |v: &[u32]| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        let sum: u64 = v.iter().map(|&x| u64::from(x)).sum();
        (sum as f64 / v.len() as f64 / 100.0).min(1.0)
    };
    by_pid
        .into_iter()
        .map(|(pid, seen)| GpuProcess {
            pid,
            gpu,
            sm_util: util.map(|_| mean(&seen.sm_percent)),
            mem_util: util.map(|_| mean(&seen.mem_percent)),
            used_memory_bytes: seen.used_memory_bytes,
            iters_per_s: None,
        })
        .collect()
}

/// NVML percent → fraction, clamped (some drivers briefly report more than 100).
fn percent(value: u32) -> f64 {
    (f64::from(value) / 100.0).min(1.0)
}

/// Errors that mean "this GPU or driver does not report that": the field becomes `None`.
fn not_reported(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::NotSupported
            | NvmlError::NoPermission
            | NvmlError::NotFound
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_)
    )
}

fn optional<T>(result: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(e) if not_reported(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

fn nvml_err(gpu: Option<u32>, call: &'static str) -> impl FnOnce(NvmlError) -> GpuError {
    move |source| GpuError::Nvml { gpu, call, source }
}

fn nvml_unavailable(library: &str, e: NvmlError) -> GpuError {
    let lasting = matches!(
        e,
        NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_)
    );
    let reason = match e {
        NvmlError::LibloadingError(e) => {
            format!("cannot load the NVML library ({e}); the NVIDIA driver is not installed")
        }
        NvmlError::FailedToLoadSymbol(e) => {
            format!("the NVML library lacks a function lodger needs ({e}); the driver is too old")
        }
        NvmlError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded".to_string(),
        NvmlError::NoPermission => {
            "no permission to talk to the NVIDIA driver (/dev/nvidia*)".to_string()
        }
        other => format!("initialization failed: {other}"),
    };
    GpuError::NvmlUnavailable {
        library: library.to_string(),
        reason,
        lasting,
    }
}

mod emulated;
pub use emulated::*;

#[cfg(test)]
mod tests;
