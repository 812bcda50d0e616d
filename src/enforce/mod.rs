//! Making the node match the plan: cgroups, scheduling policy.

pub mod cgroup;
pub mod sched;
