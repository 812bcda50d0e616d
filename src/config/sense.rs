//! config::sense: `[sense]`: what lodger measures (GPU source, perf counters, memory
//! bandwidth) and how often. Touches no file.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{absolute, in_range, named_enum, one_of};
use super::{ConfigError, Cx};

/// Valid `sense.interval_ms`: NVML refreshes at most every 1/6 s, so faster is no use.
pub const SENSE_INTERVAL_MS_RANGE: RangeInclusive<i64> = 200..=60_000;

/// Valid `sense.deadline_ms`.
pub const SENSE_DEADLINE_MS_RANGE: RangeInclusive<i64> = 100..=600_000;

/// Valid `sense.perf_max_fds`.
pub const PERF_MAX_FDS_RANGE: RangeInclusive<i64> = 0..=1_048_576;

/// Valid `sense.history`, a key that was never read: still accepted (with a warning, see
/// [`super::OBSOLETE_KEYS`]) so that the files that set it keep loading.
const HISTORY_RANGE: RangeInclusive<i64> = 1..=86_400;

/// `[sense]`: what lodger measures and how often.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SenseConfig {
    /// How often the sensing thread samples, in milliseconds.
    pub interval_ms: u64,
    pub gpu: GpuSourceChoice,
    /// Where the bundled training emulator publishes its emulated GPU's busy fraction.
    pub emulated_gpu_dir: PathBuf,
    /// Hardware counters (IPC, cache misses) per job.
    pub perf: bool,
    /// Most perf file descriptors lodger may hold; jobs beyond the budget go unmeasured.
    pub perf_max_fds: u64,
    pub resctrl_root: PathBuf,
    /// Node memory-bandwidth peak in bytes/s; 0: unknown (no fraction of peak is reported).
    pub membw_peak_bytes_per_s: u64,
    /// How much older than the interval a source's newest pass may be before it is stale.
    pub deadline_ms: u64,
}

named_enum! {
    /// `sense.gpu`: where GPU utilization comes from.
    GpuSourceChoice {
        /// NVML when the driver loads, else off (one log line says why).
        Auto => "auto",
        Nvml => "nvml",
        /// The bundled training emulator's published busy fraction (no real GPU).
        Emulated => "emulated",
        Off => "off",
    }
}

impl SenseConfig {
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// A source whose newest pass is older than the interval plus this is stale.
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }
}

impl Default for SenseConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1000,
            gpu: GpuSourceChoice::Auto,
            emulated_gpu_dir: PathBuf::from("/run/lodger/emulated-gpu"),
            perf: true,
            perf_max_fds: 65536,
            resctrl_root: PathBuf::from("/sys/fs/resctrl"),
            membw_peak_bytes_per_s: 0,
            deadline_ms: 5000,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawSense {
    interval_ms: Option<Spanned<i64>>,
    gpu: Option<Spanned<String>>,
    emulated_gpu_dir: Option<Spanned<String>>,
    perf: Option<Spanned<bool>>,
    perf_max_fds: Option<Spanned<i64>>,
    resctrl_root: Option<Spanned<String>>,
    membw_peak_bytes_per_s: Option<Spanned<i64>>,
    /// Obsolete: accepted and ignored.
    history: Option<Spanned<i64>>,
    deadline_ms: Option<Spanned<i64>>,
}

impl Cx<'_> {
    pub(super) fn sense(&mut self, raw: Option<RawSense>) -> Result<SenseConfig, ConfigError> {
        let d = SenseConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        // Checked as before and recorded (its line, for the warning), but not kept.
        self.field::<i64, u64>("sense.history", raw.history, 0, |v| {
            in_range(v, &HISTORY_RANGE)
        })?;
        Ok(SenseConfig {
            interval_ms: self.field("sense.interval_ms", raw.interval_ms, d.interval_ms, |v| {
                in_range(v, &SENSE_INTERVAL_MS_RANGE)
            })?,
            gpu: self.field("sense.gpu", raw.gpu, d.gpu, |s| {
                one_of(&s, GpuSourceChoice::from_name, GpuSourceChoice::NAMES)
            })?,
            emulated_gpu_dir: self.field(
                "sense.emulated_gpu_dir",
                raw.emulated_gpu_dir,
                d.emulated_gpu_dir,
                absolute,
            )?,
            perf: self.field("sense.perf", raw.perf, d.perf, Ok)?,
            perf_max_fds: self.field(
                "sense.perf_max_fds",
                raw.perf_max_fds,
                d.perf_max_fds,
                |v| in_range(v, &PERF_MAX_FDS_RANGE),
            )?,
            resctrl_root: self.field(
                "sense.resctrl_root",
                raw.resctrl_root,
                d.resctrl_root,
                absolute,
            )?,
            membw_peak_bytes_per_s: self.field(
                "sense.membw_peak_bytes_per_s",
                raw.membw_peak_bytes_per_s,
                d.membw_peak_bytes_per_s,
                |v| in_range(v, &(0..=i64::MAX)),
            )?,
            deadline_ms: self.field("sense.deadline_ms", raw.deadline_ms, d.deadline_ms, |v| {
                in_range(v, &SENSE_DEADLINE_MS_RANGE)
            })?,
        })
    }
}
