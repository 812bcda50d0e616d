//! Real-time budgets of v1 `cpu` cgroups (CONFIG_RT_GROUP_SCHED): a thread in a group whose
//! `cpu.rt_runtime_us` is 0 cannot become SCHED_RR (EPERM). Finds a thread's group, reads its
//! budget and, when the config allows, grants one. Touches `<cgroup root>/cpu` and
//! `/proc/PID/task/TID/cgroup`.
//!
//! Budgets are written through cgroups-rs (`CpuController::set_rt_runtime`); the crate has no
//! reader for `cpu.rt_runtime_us`, so that is read by hand.

use std::io;
use std::path::{Path, PathBuf};

use cgroups_rs::fs::cpu::CpuController;
use serde::{Deserialize, Serialize};

use crate::sys::cgroupfs::{ancestors, normalize, V1_CPU_DIR};

pub const CPU_RT_RUNTIME_US: &str = "cpu.rt_runtime_us";
/// The controller name in `/proc/PID/cgroup`.
pub const CPU_CONTROLLER: &str = "cpu";

/// A budget lodger wrote, so release can put the old value back.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct RtGrant {
    /// The group, within the v1 cpu hierarchy.
    pub cgroup: String,
    pub previous_us: i64,
    pub granted_us: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RtGroupError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: unexpected content '{content}'")]
    Parse { path: PathBuf, content: String },
    #[error("writing '{value}' to {path} failed: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
}

/// The v1 cpu hierarchy (`<cgroup root>/cpu`).
#[derive(Debug, Clone)]
pub struct RtGroups {
    root: PathBuf,
}

impl RtGroups {
    pub fn new(cgroup_root: &Path) -> Self {
        Self {
            root: cgroup_root.join(V1_CPU_DIR),
        }
    }

    /// True when the hierarchy exists and has RT group scheduling.
    pub fn available(&self) -> bool {
        self.root.join(CPU_RT_RUNTIME_US).is_file()
    }

    fn dir(&self, cgroup: &str) -> PathBuf {
        let rel = cgroup.trim_start_matches('/');
        if rel.is_empty() {
            self.root.clone()
        } else {
            self.root.join(rel)
        }
    }

    /// The `cpu.rt_runtime_us` file of a group.
    pub fn budget_file(&self, cgroup: &str) -> PathBuf {
        self.dir(cgroup).join(CPU_RT_RUNTIME_US)
    }

    /// The v1 cpu group of a thread; `None` when the thread is gone or not in a v1 cpu hierarchy.
    pub fn group_of_thread(
        &self,
        proc_root: &Path,
        pid: u32,
        tid: u32,
    ) -> Result<Option<String>, RtGroupError> {
        use procfs::FromRead;
        let path = proc_root
            .join(pid.to_string())
            .join("task")
            .join(tid.to_string())
            .join("cgroup");
        let groups = match procfs::ProcessCGroups::from_file(&path) {
            Ok(g) => g,
            Err(procfs::ProcError::NotFound(_)) => return Ok(None),
            Err(e) => {
                return Err(RtGroupError::Read {
                    path,
                    source: io::Error::other(e.to_string()),
                })
            }
        };
        let line = groups
            .0
            .iter()
            .find(|g| g.hierarchy != 0 && g.controllers.iter().any(|c| c == CPU_CONTROLLER));
        match line {
            Some(g) => normalize(&g.pathname)
                .map(Some)
                .map_err(|_| RtGroupError::Parse {
                    path,
                    content: g.pathname.clone(),
                }),
            None => Ok(None),
        }
    }

    /// A group's `cpu.rt_runtime_us`; `None` when the file does not exist.
    pub fn budget(&self, cgroup: &str) -> Result<Option<i64>, RtGroupError> {
        let path = self.budget_file(cgroup);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(RtGroupError::Read { path, source }),
        };
        text.trim()
            .parse()
            .map(Some)
            .map_err(|_| RtGroupError::Parse {
                path,
                content: text.trim().to_string(),
            })
    }

    fn write_budget(&self, cgroup: &str, us: i64) -> Result<(), RtGroupError> {
        let dir = self.dir(cgroup);
        let ctl = CpuController::new(dir.clone(), self.root.clone(), false);
        ctl.set_rt_runtime(us).map_err(|e| {
            use std::error::Error as _;
            let source = e
                .source()
                .and_then(|s| s.downcast_ref::<io::Error>())
                .and_then(io::Error::raw_os_error)
                .map(io::Error::from_raw_os_error)
                .unwrap_or_else(|| io::Error::other(e.to_string()));
            RtGroupError::Write {
                path: dir.join(CPU_RT_RUNTIME_US),
                value: us.to_string(),
                source,
            }
        })
    }

    /// Gives `cgroup` a budget of at least `us`: its ancestors first, top down (a parent's budget
    /// must cover its children's), then the group. Groups that already have `us` or more are left
    /// alone. Appends each write to `granted`, also when a later one fails.
    pub fn grant(
        &self,
        cgroup: &str,
        us: u64,
        granted: &mut Vec<RtGrant>,
    ) -> Result<(), RtGroupError> {
        let value = i64::try_from(us).unwrap_or(i64::MAX);
        let mut chain: Vec<&str> = ancestors(cgroup);
        // The root's budget is the node's (kernel.sched_rt_runtime_us): not lodger's to change.
        chain.retain(|c| *c != "/");
        if cgroup != "/" {
            chain.push(cgroup);
        }
        for group in chain {
            let current = self.budget(group)?.unwrap_or(0);
            if current >= value {
                continue;
            }
            self.write_budget(group, value)?;
            granted.push(RtGrant {
                cgroup: group.to_string(),
                previous_us: current,
                granted_us: us,
            });
        }
        Ok(())
    }

    /// Puts back budgets lodger granted, children first. The kernel refuses (EBUSY) to take the
    /// budget of a group that still has RT tasks or budgeted children: such groups keep theirs.
    /// Returns the refusals.
    pub fn revert(&self, grants: &[RtGrant]) -> Vec<RtGroupError> {
        let mut errors = Vec::new();
        for g in grants.iter().rev() {
            match self.budget(&g.cgroup) {
                // Changed by someone else since, or gone: leave it.
                Ok(Some(now)) if u64::try_from(now).ok() == Some(g.granted_us) => {}
                Ok(_) => continue,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            }
            if let Err(e) = self.write_budget(&g.cgroup, g.previous_us) {
                errors.push(e);
            }
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn grants_top_down_and_reverts_bottom_up_on_a_fixture() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cpu = dir.path().join(V1_CPU_DIR);
        for (rel, v) in [("", "950000"), ("a", "0"), ("a/b", "0")] {
            let d = cpu.join(rel);
            fs::create_dir_all(&d).expect("mkdir");
            fs::write(d.join(CPU_RT_RUNTIME_US), v).expect("write");
        }
        let groups = RtGroups::new(dir.path());
        assert!(groups.available());
        let mut granted = Vec::new();
        groups.grant("/a/b", 20000, &mut granted).expect("grant");
        assert_eq!(
            granted
                .iter()
                .map(|g| g.cgroup.as_str())
                .collect::<Vec<_>>(),
            vec!["/a", "/a/b"]
        );
        assert_eq!(groups.budget("/a").expect("read"), Some(20000));
        assert_eq!(groups.budget("/").expect("read"), Some(950000));
        // Idempotent: nothing more to grant.
        let mut again = Vec::new();
        groups.grant("/a/b", 20000, &mut again).expect("grant");
        assert!(again.is_empty());
        assert!(groups.revert(&granted).is_empty());
        assert_eq!(groups.budget("/a/b").expect("read"), Some(0));
        assert_eq!(groups.budget("/a").expect("read"), Some(0));
    }
}
