//! The kernel vocabularies shared by sense and enforce: one module per interface, each taking its
//! root (or program) as an argument. Imports nothing above itself (no sense, policy, enforce or
//! agent).

pub mod cgroupfs;
pub mod command;
