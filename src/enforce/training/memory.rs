//! The memory files of the job cgroups lodger creates for pid jobs on cgroup v2 (issue 19):
//! `memory.low` for training, `memory.max` and `memory.high` for batch jobs
//! ([`JobMemory`](crate::enforce::JobMemory)), written once when the cgroup is created, and only
//! where `<parent>` has the memory controller delegated. Best effort: a refusal is logged and the
//! job is enforced as before. Touches cgroupfs.

use std::fs;

use tracing::warn;

use super::Enforcer;
use crate::enforce::JobMemory;
use crate::sys::cgroupfs::{read_words, CgroupVersion, CGROUP_CONTROLLERS, CGROUP_SUBTREE_CONTROL};

const MEMORY: &str = "memory";

impl Enforcer {
    /// Gives a job cgroup lodger just created (`cg`, under `parent`) its memory settings.
    pub(super) fn set_job_memory(&self, cg: &str, parent: &str) {
        let writes: Vec<(&str, String)> = match self.settings.job_memory {
            JobMemory::Untouched => return,
            JobMemory::Protect => vec![("memory.low", "max".to_string())],
            JobMemory::Limit { max, high } => vec![
                ("memory.max", max.to_string()),
                ("memory.high", high.to_string()),
            ],
        };
        if self.mode.version != CgroupVersion::V2 {
            return;
        }
        let h = &*self.cpusets;
        let parent_dir = h.dir(parent);
        let delegated = read_words(&parent_dir.join(CGROUP_CONTROLLERS))
            .is_ok_and(|c| c.iter().any(|c| c == MEMORY));
        if !delegated {
            return;
        }
        let subtree = parent_dir.join(CGROUP_SUBTREE_CONTROL);
        let enabled = read_words(&subtree).is_ok_and(|c| c.iter().any(|c| c == MEMORY));
        if !enabled {
            if let Err(e) = fs::write(&subtree, "+memory") {
                warn!(
                    cgroup = cg,
                    "memory settings not applied: cannot write +memory to {}: {e}",
                    subtree.display()
                );
                return;
            }
        }
        let dir = h.dir(cg);
        for (file, value) in writes {
            let path = dir.join(file);
            if let Err(e) = fs::write(&path, &value) {
                warn!(
                    cgroup = cg,
                    "cannot write {value} to {}: {e}",
                    path.display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::enforce::EnforceSettings;
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
            high: (1 << 30) / 100 * 90,
        };
        enforcer(t.path(), limit).set_job_memory("/lodger/j1", "/lodger");
        assert_eq!(read(job.join("memory.max")).as_deref(), Some("1073741824"));
        assert_eq!(read(job.join("memory.high")).as_deref(), Some("966367620"));
        assert_eq!(read(job.join("memory.low")), None);
        // The controller was enabled for lodger's children (the fake file keeps the write).
        assert_eq!(
            read(t.path().join("lodger").join(CGROUP_SUBTREE_CONTROL)).as_deref(),
            Some("+memory")
        );

        let t = tree("cpuset cpu memory\n");
        let job = t.path().join("lodger/j1");
        enforcer(t.path(), JobMemory::Protect).set_job_memory("/lodger/j1", "/lodger");
        assert_eq!(read(job.join("memory.low")).as_deref(), Some("max"));
        assert_eq!(read(job.join("memory.max")), None);
    }

    #[test]
    fn nothing_is_written_without_memory_delegated_or_anything_to_write() {
        let t = tree("cpuset cpu\n");
        let job = t.path().join("lodger/j1");
        enforcer(t.path(), JobMemory::Protect).set_job_memory("/lodger/j1", "/lodger");
        assert_eq!(read(job.join("memory.low")), None);
        assert_eq!(
            read(t.path().join("lodger").join(CGROUP_SUBTREE_CONTROL)).as_deref(),
            Some("cpuset"),
            "lodger's cgroup untouched"
        );
        let t = tree("cpuset cpu memory\n");
        enforcer(t.path(), JobMemory::Untouched).set_job_memory("/lodger/j1", "/lodger");
        assert!(fs::read_dir(t.path().join("lodger/j1"))
            .expect("dir")
            .next()
            .is_none());
    }
}
