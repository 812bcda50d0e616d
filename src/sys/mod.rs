//! The kernel vocabularies that sensing and enforcement share, one module per interface: how
//! `/proc`, cgroupfs and resctrl are laid out, read and written, the one runner for external
//! programs (`tc`, `ip`, `nft`), blocking work waited for within a bound, and a bounded look at
//! paths that may hang. Each takes its root (or program) as an argument; nothing here imports
//! `sense`, `policy`, `enforce` or `agent`.

pub mod bounded;
pub mod cgroupfs;
pub mod command;
pub mod procevents;
pub mod procfs;
pub mod procwatch;
pub mod resctrlfs;
pub mod stall;
