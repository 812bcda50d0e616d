//! The lodgerd that the contention test (tests/contention.rs) and benchmark
//! (benches/contention.rs) both run: the emulated GPU sensed every [`SENSE_MS`], contention
//! enforced after [`PRESSURE_TICKS`] pressured passes and given back after [`CALM_TICKS`] calm
//! ones, instances stopped within a second.

use std::path::Path;

use super::{Daemon, DaemonOptions, PrivateBus};

/// `sense.interval_ms`.
pub const SENSE_MS: u64 = 200;
/// `contention.pressure_ticks`.
pub const PRESSURE_TICKS: u32 = 3;
/// `contention.calm_ticks`.
pub const CALM_TICKS: u32 = 10;

/// lodgerd with the CPUs in `reserved` kept from jobs, reading emulated GPUs from `gpu_dir`.
pub fn daemon(bus: &PrivateBus, dir: &Path, gpu_dir: &Path, reserved: &'static str) -> Daemon {
    Daemon::start(
        bus,
        dir,
        DaemonOptions {
            reserved,
            interval_ms: 100,
            extra: format!(
                "[sense]\ninterval_ms = {SENSE_MS}\ngpu = \"emulated\"\nemulated_gpu_dir = \"{}\"\n\n\
                 [contention]\nmode = \"enforce\"\npressure_ticks = {PRESSURE_TICKS}\n\
                 calm_ticks = {CALM_TICKS}\n\n[inference]\nstop_grace_seconds = 1\n",
                gpu_dir.display()
            ),
            ..DaemonOptions::default()
        },
    )
}
