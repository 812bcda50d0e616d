//! Simulated enforcement (`lodgerd --sim`): reads the job's processes from /proc like the real
//! enforcer, but writes nothing: no cgroup, no affinity, no scheduling policy. For trying lodger
//! on a fixture topology without root, and for measuring the agent's own cost at scales this
//! machine cannot host (placement on a fixture topology with real processes to sweep). Like the
//! real enforcer it skips, between full sweeps, the jobs the kernel's process events say nothing
//! happened to (`enforce::quiet`), so the agent's cost at scale is measured with the same rule.

use std::path::Path;
use std::time::Instant;

use crate::cpuset::CpuSet;
use crate::enforce::quiet::{Asked, Quiet};
use crate::enforce::{EnforceError, Outcome};
use crate::job::{JobId, Target};
use crate::sys::procfs::ProcReader;

pub struct SimulatedEnforcer {
    reader: ProcReader,
    tids: Vec<u32>,
    quiet: Quiet,
}

impl SimulatedEnforcer {
    pub fn new(proc_root: impl AsRef<Path>) -> Self {
        let real = proc_root.as_ref() == Path::new(crate::sys::procfs::DEFAULT_PROC_ROOT);
        Self {
            reader: ProcReader::new(proc_root.as_ref()),
            tids: Vec::new(),
            quiet: Quiet::new(real, real),
        }
    }

    /// [`Self::observe`], skipped while nothing happened to the job's processes since the last
    /// time (see `enforce::quiet`).
    pub fn observe_job(
        &mut self,
        id: &JobId,
        target: &Target,
        cpus: &CpuSet,
        mems: &CpuSet,
    ) -> Result<Outcome, EnforceError> {
        let now = Instant::now();
        let asked = Asked {
            cpus,
            mems,
            memory_max: None,
        };
        let mut buf = Vec::new();
        if let Some(last) = self
            .quiet
            .settled(id, target, &asked, None, None, &mut buf, now)
        {
            return Ok(last.again());
        }
        let out = self.observe(target)?;
        if out.alive {
            self.quiet
                .remember(id, target, &asked, &out, Vec::new(), None, now);
        }
        Ok(out)
    }

    /// Whether [`Self::observe_job`] now would be skipped with an outcome of which `shows` is
    /// true (as `Enforcer::settled`).
    pub fn settled(
        &mut self,
        id: &JobId,
        target: &Target,
        cpus: &CpuSet,
        mems: &CpuSet,
        shows: &dyn Fn(&Outcome) -> bool,
    ) -> bool {
        let asked = Asked {
            cpus,
            mems,
            memory_max: None,
        };
        self.quiet
            .settled(
                id,
                target,
                &asked,
                None,
                None,
                &mut Vec::new(),
                Instant::now(),
            )
            .is_some_and(shows)
    }

    /// Forgets what was observed of the job.
    pub fn forget(&mut self, id: &JobId) {
        self.quiet.forget(id);
    }

    /// What enforcement would find: the live registered processes and their threads, every one
    /// counted as if it had been made SCHED_RR. A cgroup target is taken to be alive.
    pub fn observe(&mut self, target: &Target) -> Result<Outcome, EnforceError> {
        let mut out = Outcome::default();
        match target {
            Target::Pids(pids) => {
                let now = Instant::now();
                for &pid in pids {
                    if self
                        .quiet
                        .threads(&mut self.reader, pid, &mut self.tids, now)?
                    {
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
