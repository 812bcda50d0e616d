//! lodger: a node-level colocation agent for GPU training servers.
//!
//! The loop (see `docs/design.md`): `sense` → `policy` (pure) → `enforce` (idempotent), driven by
//! the `agent`, which alone owns the state; `api` turns D-Bus calls into agent commands.
//! `daemon` wires the `config` into all of them and runs lodgerd.

pub mod agent;
pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod cpuset;
pub mod daemon;
pub mod enforce;
pub mod job;
pub mod policy;
pub mod privileged;
pub mod rng;
pub mod sense;
pub mod slurm;
pub mod store;
pub mod sys;
pub mod topology;

#[cfg(test)]
mod testutil;
