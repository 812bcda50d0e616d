//! Memory bounds of inference instances (issue 19): where each instance's limit goes on this
//! node, writing it before the instance runs, and telling an OOM kill apart from other deaths
//! by the `oom_kill` count of the memory cgroup it ran in. Touches cgroupfs: only cgroups lodger
//! created for its instances (never a job's, Slurm's or a container runtime's).
//!
//! - cgroup v1: the memory hierarchy (`<root>/memory`) gets a twin of the instance's cpuset
//!   cgroup, `<parent>/lodgers/<job>-<index>`, with `memory.limit_in_bytes` (the limit) and
//!   `memory.soft_limit_in_bytes` (reclaimed down to under memory pressure); the child joins it
//!   in `pre_exec` as it joins its cpuset cgroup. Its count is `memory.oom_control`'s `oom_kill`.
//! - cgroup v2, cgroup placement: the instance's own cgroup, `memory.max` and `memory.high`
//!   (throttled and reclaimed above it), the controller enabled in `<parent>` and
//!   `<parent>/lodgers` (only when `<parent>` has it delegated). Its count: `memory.events`.
//! - systemd starts the instances: `MemoryMax=` and `MemoryHigh=` on each unit ([`super::unit`]),
//!   counted in `memory.events` of lodger's instance slice (v2), which holds only instances.
//! - cgroup v2 with affinity placement: lodger owns no cgroup to put a limit on; said once.
//!
//! Every instance also gets `oom_score_adj` 1000 (`spawn`, `unit`): when the node itself runs
//! out of memory, the OOM killer takes a lodger before a training process.

use std::fs;
use std::path::{Path, PathBuf};

use super::host::Host;
use super::supervisor::Slot;
use super::unit;
use crate::enforce::PinMethod;
use crate::job::memory::{high_of, show_size};
use crate::sys::cgroupfs::{
    self as cgroup, dir_of, CgroupError, CgroupVersion, CGROUP_CONTROLLERS, CGROUP_PROCS,
    MEMORY_CONTROLLER, MEMORY_EVENTS, MEMORY_HIGH, MEMORY_MAX, MEMORY_OOM_CONTROL_V1,
};

/// Where instance memory limits go on this node (chosen once, by [`MemoryPlacement::choose`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryPlacement {
    /// cgroup v1: twins in the memory hierarchy mounted at this directory.
    V1 { root: PathBuf },
    /// cgroup v2: the instances' own cgroups.
    V2,
    /// Transient units' properties; OOM kills counted in the slice's `memory.events` at this
    /// path where the slice is on cgroup v2.
    Units { events: Option<PathBuf> },
    /// No limit can be applied here, and why.
    Off(String),
}

impl MemoryPlacement {
    /// From the node: systemd as PID 1 (`units`: the slices its instance units run in), the
    /// cgroup version, the instances' CPU placement and whether `<parent>` (at `parent_dir`,
    /// v2) has the memory controller.
    pub fn choose(
        cgroup_root: &Path,
        version: CgroupVersion,
        placement: PinMethod,
        parent_dir: &Path,
        units: Option<&unit::Slices>,
    ) -> MemoryPlacement {
        if let Some(slices) = units {
            let slice = cgroup_root.join(slices.cgroup()).join(MEMORY_EVENTS);
            let events = (version == CgroupVersion::V2).then_some(slice);
            return MemoryPlacement::Units { events };
        }
        match (version, placement) {
            (CgroupVersion::V1, _) => match cgroup::v1_memory_hierarchy(cgroup_root) {
                Some(root) => MemoryPlacement::V1 { root },
                None => MemoryPlacement::Off(format!(
                    "cgroup v1 without a memory hierarchy at {}",
                    cgroup_root.join(MEMORY_CONTROLLER).display()
                )),
            },
            (CgroupVersion::V2, PinMethod::Cgroup) => {
                let controllers = parent_dir.join(CGROUP_CONTROLLERS);
                if cgroup::lists_controller(&controllers, MEMORY_CONTROLLER) {
                    MemoryPlacement::V2
                } else {
                    MemoryPlacement::Off(format!(
                        "the memory controller is not delegated to lodger's cgroup ({} lacks \
                         'memory')",
                        controllers.display()
                    ))
                }
            }
            (CgroupVersion::V2, PinMethod::Affinity) => MemoryPlacement::Off(
                "instances are placed by CPU affinity on cgroup v2: lodger owns no cgroup of \
                 theirs to limit (delegate cpuset and memory to lodger's cgroup, or run under \
                 systemd)"
                    .to_string(),
            ),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            MemoryPlacement::V1 { root } => {
                format!("cgroup v1 memory hierarchy {}", root.display())
            }
            MemoryPlacement::V2 => "each instance's cgroup (memory.max, memory.high)".to_string(),
            MemoryPlacement::Units { .. } => "MemoryMax= and MemoryHigh= of each unit".to_string(),
            MemoryPlacement::Off(why) => format!("none: {why}"),
        }
    }
}

/// The `oom_kill` count in a memory cgroup's `memory.events` (v2) or `memory.oom_control`
/// (v1, Linux 4.13+): `None` when the file or the line is missing.
pub fn read_oom_kills(path: &Path) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

impl Host {
    /// The limit an instance with `spec_max` gets here: its own, else the node's; `None` where
    /// none can be applied.
    pub(super) fn memory_limit(&self, spec_max: Option<u64>) -> Option<u64> {
        if matches!(self.memory, MemoryPlacement::Off(_)) {
            return None;
        }
        spec_max.or(self.settings.memory_max)
    }

    /// Gives the instance's memory cgroup its limit before the instance starts. v1: creates the
    /// twin and returns its `cgroup.procs`, open for the child to join; v2: the cpuset cgroup
    /// `cg` exists already. Nothing to do without a limit (or under systemd: the unit's).
    pub(super) fn prepare_memory(
        &self,
        cg: &str,
        max: Option<u64>,
    ) -> Result<Option<fs::File>, CgroupError> {
        let Some(max) = max else { return Ok(None) };
        let high = high_of(max, self.settings.memory_high_percent);
        match &self.memory {
            MemoryPlacement::V1 { root } => {
                let chain = [self.parent.as_str(), self.lodgers.as_str(), cg];
                let dir = cgroup::v1_limited_memory_cgroup(root, &chain, max, high)?;
                let procs = dir.join(CGROUP_PROCS);
                fs::OpenOptions::new()
                    .write(true)
                    .open(&procs)
                    .map(Some)
                    .map_err(|source| CgroupError::Write {
                        path: procs,
                        value: "0".into(),
                        source,
                    })
            }
            MemoryPlacement::V2 => {
                for ancestor in [self.parent.as_str(), self.lodgers.as_str()] {
                    cgroup::enable_for_children(&self.cpusets.dir(ancestor), MEMORY_CONTROLLER)?;
                }
                let dir = self.cpusets.dir(cg);
                cgroup::write_value(&dir, MEMORY_MAX, max)?;
                cgroup::write_value(&dir, MEMORY_HIGH, high)?;
                Ok(None)
            }
            MemoryPlacement::Units { .. } | MemoryPlacement::Off(_) => Ok(None),
        }
    }

    /// The OOM kill count of the memory cgroup a slot's instance runs in: its own, or the
    /// instance slice's for a unit.
    pub(super) fn oom_kills_of(&self, slot: &Slot) -> Option<u64> {
        let by_unit = slot.run.as_ref().is_some_and(|r| r.unit.is_some());
        if by_unit {
            return self.oom_kills(None);
        }
        self.oom_kills(Some(&self.instance_cgroup(&slot.key())))
    }

    /// The OOM kill count of the memory cgroup `cg`, or of the instance slice (`None`).
    pub(super) fn oom_kills(&self, cg: Option<&str>) -> Option<u64> {
        match (&self.memory, cg) {
            (MemoryPlacement::V1 { root }, Some(cg)) => {
                read_oom_kills(&dir_of(root, cg).join(MEMORY_OOM_CONTROL_V1))
            }
            (MemoryPlacement::V2, Some(cg)) => {
                read_oom_kills(&self.cpusets.dir(cg).join(MEMORY_EVENTS))
            }
            (MemoryPlacement::Units { events: Some(path) }, None) => read_oom_kills(path),
            _ => None,
        }
    }

    /// How an exited instance ended, with the OOM killer named when its memory cgroup's count
    /// grew since the slot last looked (`slice` is the unit slice's count, read for this poll).
    /// A unit's baseline then moves on, so another instance's kill is never counted twice.
    pub(super) fn oom_verdict(&self, slot: &mut Slot, how: String, slice: Option<u64>) -> String {
        let by_unit = slot.run.as_ref().is_some_and(|r| r.unit.is_some());
        let now = if by_unit {
            slice
        } else {
            self.oom_kills_of(slot)
        };
        let grew = matches!((now, slot.oom_seen), (Some(n), Some(seen)) if n > seen);
        slot.oom_seen = now;
        if !grew {
            return how;
        }
        slot.oom_kills = slot.oom_kills.saturating_add(1);
        match slot.memory_max {
            Some(max) => format!(
                "killed by the OOM killer, memory limit {} ({how})",
                show_size(max)
            ),
            None => format!("killed by the OOM killer ({how})"),
        }
    }

    /// v1: removes the memory twins of `cgroups` (empty once their cpuset cgroups are: the same
    /// processes), best effort; nothing to do elsewhere.
    pub(super) fn remove_memory(&self, cgroups: &[&str]) {
        if let MemoryPlacement::V1 { root } = &self.memory {
            for cg in cgroups {
                let _ = cgroup::rmdir_if_unused(&dir_of(root, cg));
            }
        }
    }

    /// v1: the memory twins under `<parent>/lodgers` no slot in `kept` uses (left by an
    /// earlier lodgerd), removed with `lodgers` itself when nothing is kept.
    pub(super) fn sweep_memory(&self, kept: &[String]) {
        if let MemoryPlacement::V1 { root } = &self.memory {
            let mut children = Vec::new();
            if cgroup::list_children(&dir_of(root, &self.lodgers), &self.lodgers, &mut children)
                .is_ok()
            {
                for c in children.iter().filter(|c| !kept.contains(c)) {
                    let _ = cgroup::rmdir_if_unused(&dir_of(root, c));
                }
            }
            if kept.is_empty() {
                self.remove_memory(&[self.lodgers.as_str(), self.parent.as_str()]);
            }
        }
    }

    /// Says once, at start, where limits go, or why instances run without one.
    pub(super) fn log_memory(&self) {
        match (&self.memory, self.settings.memory_max) {
            (MemoryPlacement::Off(why), Some(_)) => tracing::warn!(
                "inference instances get no memory limit (inference.memory_max): {why}"
            ),
            (_, Some(max)) => tracing::info!(
                "inference instances' memory limit: {} each unless a job asks for less, in {}",
                show_size(max),
                self.memory.describe()
            ),
            (_, None) => tracing::info!(
                "inference instances get no memory limit (inference.memory_max = \"none\")"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kills_are_read_from_either_file() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("memory.events");
        fs::write(
            &v2,
            "low 0\nhigh 12\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n",
        )
        .unwrap();
        assert_eq!(read_oom_kills(&v2), Some(2));
        let v1 = dir.path().join("memory.oom_control");
        fs::write(&v1, "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n").unwrap();
        assert_eq!(read_oom_kills(&v1), Some(5));
        fs::write(&v1, "oom_kill_disable 0\nunder_oom 0\n").unwrap();
        assert_eq!(read_oom_kills(&v1), None, "before Linux 4.13");
        assert_eq!(read_oom_kills(&dir.path().join("gone")), None);
    }

    #[test]
    fn placement_follows_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let parent = root.join("lodger");
        fs::create_dir_all(&parent).unwrap();
        // v1 without a memory hierarchy, then with one.
        let p = MemoryPlacement::choose(root, CgroupVersion::V1, PinMethod::Cgroup, &parent, None);
        assert!(matches!(p, MemoryPlacement::Off(_)), "{p:?}");
        fs::create_dir_all(root.join("memory")).unwrap();
        fs::write(
            root.join("memory").join(cgroup::MEMORY_LIMIT_V1),
            "9223372036854771712\n",
        )
        .unwrap();
        let p =
            MemoryPlacement::choose(root, CgroupVersion::V1, PinMethod::Affinity, &parent, None);
        assert_eq!(
            p,
            MemoryPlacement::V1 {
                root: root.join("memory")
            }
        );
        // v2: only where memory is delegated to lodger's cgroup.
        fs::write(parent.join(CGROUP_CONTROLLERS), "cpuset cpu\n").unwrap();
        let p = MemoryPlacement::choose(root, CgroupVersion::V2, PinMethod::Cgroup, &parent, None);
        assert!(
            matches!(&p, MemoryPlacement::Off(why) if why.contains("not delegated")),
            "{p:?}"
        );
        fs::write(parent.join(CGROUP_CONTROLLERS), "cpuset cpu memory\n").unwrap();
        let p = MemoryPlacement::choose(root, CgroupVersion::V2, PinMethod::Cgroup, &parent, None);
        assert_eq!(p, MemoryPlacement::V2);
        let p =
            MemoryPlacement::choose(root, CgroupVersion::V2, PinMethod::Affinity, &parent, None);
        assert!(matches!(p, MemoryPlacement::Off(_)), "{p:?}");
        // Units: the slice's events on v2, none on v1.
        let slices = unit::Slices::of_parent("lodger");
        let units = Some(&slices);
        let p =
            MemoryPlacement::choose(root, CgroupVersion::V2, PinMethod::Affinity, &parent, units);
        assert_eq!(
            p,
            MemoryPlacement::Units {
                events: Some(root.join("lodger.slice/lodger-instances.slice/memory.events"))
            }
        );
        let p = MemoryPlacement::choose(root, CgroupVersion::V1, PinMethod::Cgroup, &parent, units);
        assert_eq!(p, MemoryPlacement::Units { events: None });
    }
}
