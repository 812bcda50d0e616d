//! Simulated enforcement (`lodgerd --sim`): reads the job's processes from /proc like the real
//! enforcer, but writes nothing: no cgroup, no affinity, no scheduling policy. For trying lodger
//! on a fixture topology without root, and for measuring the agent's own cost at scales this
//! machine cannot host (placement on a 64-CPU fixture with real processes to sweep).

use std::path::Path;

use crate::enforce::{EnforceError, Outcome};
use crate::job::Target;
use crate::sys::procfs::ProcReader;

pub struct SimulatedEnforcer {
    reader: ProcReader,
    tids: Vec<u32>,
}

impl SimulatedEnforcer {
    pub fn new(proc_root: impl AsRef<Path>) -> Self {
        Self {
            reader: ProcReader::new(proc_root.as_ref()),
            tids: Vec::new(),
        }
    }

    /// What enforcement would find: the live registered processes and their threads, every one
    /// counted as if it had been made SCHED_RR. A cgroup target is taken to be alive.
    pub fn observe(&mut self, target: &Target) -> Result<Outcome, EnforceError> {
        let mut out = Outcome::default();
        match target {
            Target::Pids(pids) => {
                for &pid in pids {
                    self.tids.clear();
                    if self.reader.threads(pid, &mut self.tids)? {
                        out.pids.push(pid);
                        out.threads += u32::try_from(self.tids.len()).unwrap_or(u32::MAX);
                    }
                }
                out.alive = !out.pids.is_empty();
            }
            Target::Cgroup(_) | Target::Slurm(_) | Target::Container(_) | Target::Instances => {
                out.alive = true
            }
        }
        out.rr_threads = out.threads;
        Ok(out)
    }
}
