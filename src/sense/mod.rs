//! Sensing: one module per signal, each a small trait with a real implementation that takes its
//! root (`/proc`, `/sys`, `/sys/fs/resctrl`) as an argument. Readers return raw samples
//! (monotonic counters with their timestamps); rates are derived purely from two samples.
//! May touch /proc, /sys, perf_event_open and libnvidia-ml, read-only.

pub mod cpu;
pub mod gpu;
pub mod membw;
pub mod net;
pub mod perf;
