//! The memory settings of the job cgroups lodger creates for pid jobs pinned by cgroup (issue
//! 19; [`JobMemory`](crate::enforce::JobMemory)), written once when the cgroup is created. Best
//! effort: a refusal is logged and the job is enforced as before. Touches cgroupfs and
//! `/proc/PID/cgroup`.
//!
//! - cgroup v2, where `<parent>` has the memory controller delegated: `memory.low` for training,
//!   `memory.max` and `memory.high` for batch jobs, in the job's own cgroup.
//! - cgroup v1, batch jobs: a twin of the job's cpuset cgroup in the memory hierarchy with
//!   `memory.limit_in_bytes` and `memory.soft_limit_in_bytes`; each process joins it when it
//!   joins the cpuset cgroup, its memory cgroup before recorded, and goes back there on release.
//!   (v1 has no `memory.low`: training's memory is left as it is.)

use std::fs;
use std::path::{Path, PathBuf};

use tracing::{debug, warn};

use super::Enforcer;
use crate::enforce::{EnforceSettings, JobMemory};
use crate::sys::cgroupfs::{
    self as cgroup, dir_of, proc_cgroup, rmdir_if_unused, CgroupVersion, CGROUP_CONTROLLERS,
    CGROUP_PROCS, MEMORY_CONTROLLER, MEMORY_HIGH, MEMORY_LOW, MEMORY_MAX,
};

/// v1 with a batch limit: the memory hierarchy, where job cgroups get twins (decided once, at
/// the enforcer's start).
pub(super) fn memory_twins(settings: &EnforceSettings, version: CgroupVersion) -> Option<PathBuf> {
    let limited = matches!(settings.job_memory, JobMemory::Limit { .. });
    if version != CgroupVersion::V1 || !limited {
        return None;
    }
    cgroup::v1_memory_hierarchy(&settings.cgroup_root)
}

impl Enforcer {
    /// Whether jobs get a memory limit from this enforcer: limits are configured, pid jobs are
    /// moved into cgroups of lodger's (not pinned by affinity), and on v1 a memory hierarchy
    /// holds their twins. (On v2 the limit also needs memory delegated to lodger's cgroup, which
    /// is found when the job's cgroup is made, and logged there when it is not.)
    pub fn limits_job_memory(&self) -> bool {
        matches!(self.settings.job_memory, JobMemory::Limit { .. })
            && self.mode.pid_pinning == crate::enforce::PinMethod::Cgroup
            && (self.mode.version == CgroupVersion::V2 || self.memory_twins.is_some())
    }

    /// Gives a job cgroup lodger just created (`cg`, under `parent`) its memory settings: where
    /// jobs are limited, `memory_max` (the job's own, already checked against the node's) or
    /// the node's limit.
    pub(super) fn set_job_memory(&self, cg: &str, parent: &str, memory_max: Option<u64>) {
        let job_memory = match (self.settings.job_memory, memory_max) {
            (JobMemory::Limit { .. }, Some(max)) => JobMemory::Limit {
                max,
                high: crate::job::memory::high_of(
                    max,
                    crate::job::memory::BATCH_MEMORY_HIGH_PERCENT,
                ),
            },
            (node, _) => node,
        };
        let result = match (&self.memory_twins, job_memory) {
            (_, JobMemory::Untouched) => return,
            (Some(root), JobMemory::Limit { max, high }) => {
                cgroup::v1_limited_memory_cgroup(root, &[parent, cg], max, high).map(drop)
            }
            _ if self.mode.version != CgroupVersion::V2 => return,
            (_, memory) => {
                let h = &*self.cpusets;
                let parent_dir = h.dir(parent);
                if !cgroup::lists_controller(
                    &parent_dir.join(CGROUP_CONTROLLERS),
                    MEMORY_CONTROLLER,
                ) {
                    return;
                }
                let dir = h.dir(cg);
                cgroup::enable_for_children(&parent_dir, MEMORY_CONTROLLER).and_then(|()| {
                    match memory {
                        JobMemory::Limit { max, high } => {
                            cgroup::write_value(&dir, MEMORY_MAX, max)
                                .and_then(|()| cgroup::write_value(&dir, MEMORY_HIGH, high))
                        }
                        _ => cgroup::write_value(&dir, MEMORY_LOW, "max"),
                    }
                })
            }
        };
        if let Err(e) = result {
            warn!(cgroup = cg, "memory settings not applied: {e}");
        }
    }

    /// v1: the memory cgroup `pid` is in now (`None`: gone, or no twins here).
    pub(super) fn memory_cgroup_of(&self, pid: u32) -> Option<String> {
        self.memory_twins.as_ref()?;
        proc_cgroup(&self.settings.proc_root, pid, |g| {
            g.hierarchy != 0 && g.controllers.iter().any(|c| c == MEMORY_CONTROLLER)
        })
        .ok()
        .flatten()
    }

    /// v1: moves `pid` into the memory cgroup `cg` (a job's twin, or where it came from; a
    /// missing one: its nearest existing ancestor). Best effort.
    pub(super) fn move_memory(&self, cg: &str, pid: u32) {
        let Some(root) = &self.memory_twins else {
            return;
        };
        let mut dest = cg.to_string();
        while dest != "/" && !dir_of(root, &dest).is_dir() {
            dest = cgroup::parent_of(&dest).unwrap_or("/").to_string();
        }
        if let Err(e) = fs::write(dir_of(root, &dest).join(CGROUP_PROCS), pid.to_string()) {
            debug!(pid, "not moved to memory cgroup {dest}: {e}");
        }
    }

    /// v1: removes a job's twin (and lodger's parent there, when unused). Best effort.
    pub(super) fn remove_twin(&self, cg: &str, parent: &str) {
        let Some(root) = &self.memory_twins else {
            return;
        };
        remove_unused(root, &[cg, parent]);
    }
}

fn remove_unused(root: &Path, cgroups: &[&str]) {
    for c in cgroups.iter().filter(|c| **c != "/") {
        if let Err(e) = rmdir_if_unused(&dir_of(root, c)) {
            warn!("cannot remove memory cgroup {c}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::sys::cgroupfs::CGROUP_SUBTREE_CONTROL;
    use crate::testutil::copy_tree;

    const FIXTURE_V2: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cgroup/v2-systemd-slurm"
    );

    /// A recorded v2 tree with lodger's `parent` (its controllers as given) and a job cgroup.
    fn tree(parent_controllers: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        copy_tree(Path::new(FIXTURE_V2), dir.path());
        let parent = dir.path().join("lodger");
        fs::create_dir_all(parent.join("j1")).expect("job cgroup");
        fs::write(parent.join(CGROUP_CONTROLLERS), parent_controllers).expect("controllers");
        fs::write(parent.join(CGROUP_SUBTREE_CONTROL), "cpuset\n").expect("subtree");
        dir
    }

    fn enforcer(root: &Path, job_memory: JobMemory) -> Enforcer {
        Enforcer::new(EnforceSettings {
            cgroup_root: root.to_path_buf(),
            parent: "lodger".into(),
            job_memory,
            ..EnforceSettings::default()
        })
        .expect("enforcer on the fixture")
    }

    fn read(path: impl AsRef<Path>) -> Option<String> {
        fs::read_to_string(path).ok().map(|s| s.trim().to_string())
    }

    #[test]
    fn a_batch_jobs_cgroup_gets_its_limit_and_a_training_jobs_protection() {
        let t = tree("cpuset cpu memory\n");
        let job = t.path().join("lodger/j1");
        let limit = JobMemory::Limit {
            max: 1 << 30,
            high: 966_365_184,
        };
        enforcer(t.path(), limit).set_job_memory("/lodger/j1", "/lodger", None);
        assert_eq!(read(job.join("memory.max")).as_deref(), Some("1073741824"));
        assert_eq!(read(job.join("memory.high")).as_deref(), Some("966365184"));
        assert_eq!(read(job.join("memory.low")), None);
        // The controller was enabled for lodger's children (the fake file keeps the write).
        assert_eq!(
            read(t.path().join("lodger").join(CGROUP_SUBTREE_CONTROL)).as_deref(),
            Some("+memory")
        );

        // A batch job's own limit takes the node's place, with its memory.high below it.
        let t = tree("cpuset cpu memory\n");
        let job = t.path().join("lodger/j1");
        enforcer(t.path(), limit).set_job_memory("/lodger/j1", "/lodger", Some(256 << 20));
        assert_eq!(read(job.join("memory.max")).as_deref(), Some("268435456"));
        let high =
            crate::job::memory::high_of(256 << 20, crate::job::memory::BATCH_MEMORY_HIGH_PERCENT);
        assert_eq!(read(job.join("memory.high")), Some(high.to_string()));

        let t = tree("cpuset cpu memory\n");
        let job = t.path().join("lodger/j1");
        enforcer(t.path(), JobMemory::Protect).set_job_memory("/lodger/j1", "/lodger", None);
        assert_eq!(read(job.join("memory.low")).as_deref(), Some("max"));
        assert_eq!(read(job.join("memory.max")), None);
    }

    #[test]
    fn nothing_is_written_without_memory_delegated_or_anything_to_write() {
        let t = tree("cpuset cpu\n");
        let job = t.path().join("lodger/j1");
        enforcer(t.path(), JobMemory::Protect).set_job_memory("/lodger/j1", "/lodger", None);
        assert_eq!(read(job.join("memory.low")), None);
        assert_eq!(
            read(t.path().join("lodger").join(CGROUP_SUBTREE_CONTROL)).as_deref(),
            Some("cpuset"),
            "lodger's cgroup untouched"
        );
        let t = tree("cpuset cpu memory\n");
        enforcer(t.path(), JobMemory::Untouched).set_job_memory("/lodger/j1", "/lodger", None);
        assert!(fs::read_dir(t.path().join("lodger/j1"))
            .expect("dir")
            .next()
            .is_none());
    }
}
