//! The errors of training enforcement, and how the many per-thread problems of one apply are
//! gathered into one. Touches nothing.

use std::path::PathBuf;

use super::rtgroup::RtGroupError;
use crate::cpuset::CpuSet;
use crate::enforce::sched::SchedError;
use crate::sys::cgroupfs::CgroupError;
use crate::sys::procfs::ProcError;

#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error("the job's cgroup {path} no longer exists")]
    CgroupGone { path: PathBuf },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Sched(#[from] SchedError),
    #[error(transparent)]
    Proc(#[from] ProcError),
    #[error(transparent)]
    RtGroup(#[from] RtGroupError),
    #[error("the placement has no CPU")]
    EmptyPlacement,
    #[error("inference instances are run by the instance runner, not pinned like a training job")]
    NotPinned,
    #[error("CPUs {cpus} are not all on this node (it has {node})")]
    CpusOutsideNode { cpus: CpuSet, node: CpuSet },
    #[error("'{0}' cannot be a job's cgroup: give a cgroup below the hierarchy root")]
    RootCgroup(String),
    #[error(
        "job {id}: its record is for a {recorded} target, not a {given} one; release it first"
    )]
    RecordMismatch {
        id: String,
        recorded: &'static str,
        given: &'static str,
    },
    #[error("{} problems: {}{}", .errors.len() + .more, join(.errors), and_more(*.more))]
    Several {
        errors: Vec<EnforceError>,
        /// Further distinct problems, not kept.
        more: usize,
    },
}

/// Distinct problems kept in [`EnforceError::Several`]; one per thread would flood the log.
pub(super) const MAX_REPORTED: usize = 4;

fn and_more(more: usize) -> String {
    if more == 0 {
        String::new()
    } else {
        format!("; and {more} more")
    }
}

fn join(errors: &[EnforceError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

impl EnforceError {
    /// The job is gone (its cgroup vanished): forget it rather than retry.
    pub fn is_gone(&self) -> bool {
        matches!(self, EnforceError::CgroupGone { .. })
    }

    /// `Ok` when empty, the error itself when there is one kind, else `Several`.
    pub(super) fn collect(errors: Vec<EnforceError>) -> Result<(), EnforceError> {
        let mut unique: Vec<EnforceError> = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        for e in errors {
            let text = e.to_string();
            if !seen.contains(&text) {
                seen.push(text);
                unique.push(e);
            }
        }
        match unique.len() {
            0 => Ok(()),
            1 => Err(unique.remove(0)),
            n => {
                unique.truncate(MAX_REPORTED);
                Err(EnforceError::Several {
                    errors: unique,
                    more: n.saturating_sub(MAX_REPORTED),
                })
            }
        }
    }
}
