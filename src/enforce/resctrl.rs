//! Memory-bandwidth throttling through resctrl MBA (SODA §V-E): lodger's own control group (by
//! default `lodger-lodgers`), its `MB:` schemata line per L3 domain, the threads in it, and
//! restoring and removing it. Touches only `<resctrl root>/<group>/` and the default group's
//! `tasks` (to give threads back), through `sys::resctrlfs`; the root is an argument
//! (`DEFAULT_RESCTRL_ROOT` at the top).
//!
//! resctrl semantics that a fixture tree cannot show: `mkdir` makes the kernel populate the
//! group (`schemata` at the unthrottled values, `tasks`, `cpus`, `mon_data/...`) and take a
//! CLOSID (ENOSPC when none is free); writing `MB:0=50;1=50` to `schemata` changes only those
//! MB domains and leaves the other resources' lines alone; writing a TID to `tasks` moves that
//! thread (threads created later join their creator's group); `rmdir` of a group with files in
//! it succeeds and gives its tasks back to the default group. A failed write leaves the reason
//! in `info/last_cmd_status`, which the error carries.
//!
//! Every write is preceded by a read: [`LodgerGroup::set_mb`] writes only when a value differs,
//! and [`LodgerGroup::move_threads`] writes only TIDs not already in the group, so running the
//! same throttle twice changes nothing the second time.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::sys::procfs::{ProcError, ProcReader};
use crate::sys::resctrlfs::{
    check_mba, format_mb_schemata, group_name_problem, parse_mb_schemata, read_tasks, remove_group,
    write_line, write_tasks, GroupKind, MbaCaps, ResctrlfsError, TaskMove, MB_NUM_CLOSIDS,
    SCHEMATA, TASKS,
};

/// The control group lodger throttles batch and offline jobs in.
pub const DEFAULT_CONTROL_GROUP: &str = "lodger-lodgers";

#[derive(Debug, thiserror::Error)]
pub enum ResctrlError {
    /// resctrl or MBA is missing (see [`ResctrlError::is_unavailable`]), or reading, writing or
    /// removing a resctrl file failed (the error carries the path and the value).
    #[error(transparent)]
    Resctrlfs(#[from] ResctrlfsError),
    #[error("'{name}' cannot be a resctrl control group name: {reason}")]
    BadGroupName { name: String, reason: &'static str },
    #[error("{path}: MB domain {domain} does not exist (this node's domains: {known})")]
    UnknownDomain {
        path: PathBuf,
        domain: u32,
        known: String,
    },
    #[error("cannot create resctrl group {path}: {source}{hint}")]
    Create {
        path: PathBuf,
        source: io::Error,
        /// Why the kernel said no, when it is known (ENOSPC: no free CLOSID).
        hint: String,
    },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Proc(#[from] ProcError),
}

impl ResctrlError {
    /// True when resctrl or MBA is absent (as opposed to present but failing): throttling by
    /// MBA is off and core halving takes over.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ResctrlError::Resctrlfs(e) if e.is_unavailable())
    }
}

/// What [`LodgerGroup::restore`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Whether the schemata was changed back to the defaults.
    pub schemata_changed: bool,
    /// Threads given back to the default group (and those that had exited).
    pub tasks: TaskMove,
}

/// lodger's resctrl control group: a CTRL_MON group with its own `MB:` schemata, holding the
/// threads of the jobs it throttles.
///
/// Monitoring a job inside it needs its monitoring group under this one
/// (`MonGroup::create(root, Some(name), job)`): resctrl moves a thread into a monitoring group
/// only from the monitoring group's parent control group, so threads go here first, then there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LodgerGroup {
    root: PathBuf,
    name: String,
    path: PathBuf,
    caps: MbaCaps,
}

impl LodgerGroup {
    /// Makes `<root>/<name>`, or adopts it when it exists (after a restart). Returns the group and
    /// whether it was created. `caps` is the node's MBA ([`MbaCaps::read`]); on a node without
    /// resctrl or MBA this fails with [`ResctrlError::is_unavailable`].
    pub fn create(root: &Path, name: &str, caps: MbaCaps) -> Result<(Self, bool), ResctrlError> {
        let group = Self::at(root, name, caps)?;
        let created = match fs::create_dir(&group.path) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && group.path.is_dir() => false,
            Err(source) => {
                let hint = if source.raw_os_error() == Some(libc::ENOSPC) {
                    let n = fs::read_to_string(root.join(MB_NUM_CLOSIDS))
                        .map(|s| s.trim().to_string())
                        .unwrap_or_else(|_| "num_closids".to_string());
                    format!(" (no free CLOSID: {n} control groups, the default one included, are the most this CPU has)")
                } else {
                    String::new()
                };
                return Err(ResctrlError::Create {
                    path: group.path,
                    source,
                    hint,
                });
            }
        };
        Ok((group, created))
    }

    /// The group at `<root>/<name>` if it exists (re-adoption after a restart), without creating
    /// it.
    pub fn open(root: &Path, name: &str, caps: MbaCaps) -> Result<Option<Self>, ResctrlError> {
        let group = Self::at(root, name, caps)?;
        Ok(group.path.is_dir().then_some(group))
    }

    fn at(root: &Path, name: &str, caps: MbaCaps) -> Result<Self, ResctrlError> {
        check_group_name(name)?;
        check_mba(root)?;
        Ok(Self {
            root: root.to_path_buf(),
            name: name.to_string(),
            path: root.join(name),
            caps,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn caps(&self) -> &MbaCaps {
        &self.caps
    }

    /// The group's `MB:` values per L3 domain.
    pub fn mb(&self) -> Result<BTreeMap<u32, u32>, ResctrlError> {
        let path = self.path.join(SCHEMATA);
        let text = fs::read_to_string(&path).map_err(|source| ResctrlError::Read {
            path: path.clone(),
            source,
        })?;
        Ok(parse_mb_schemata(&path, &text)?)
    }

    /// Sets the `MB:` values of the domains in `values` (others keep theirs), each made valid
    /// first as the kernel would ([`MbaCaps::valid_value`]: Intel rounds up to
    /// `bandwidth_gran`, not below `min_bandwidth`; AMD takes absolute values). Writes one full
    /// `MB:` line, and only when a value differs. Returns whether it wrote.
    pub fn set_mb(&self, values: &BTreeMap<u32, u32>) -> Result<bool, ResctrlError> {
        let path = self.path.join(SCHEMATA);
        for &domain in values.keys() {
            if !self.caps.default_schemata.contains_key(&domain) {
                return Err(ResctrlError::UnknownDomain {
                    path,
                    domain,
                    known: join(self.caps.default_schemata.keys()),
                });
            }
        }
        let current = self.mb()?;
        let mut desired = current.clone();
        for (&domain, &value) in values {
            desired.insert(domain, self.caps.valid_value(value));
        }
        if desired == current {
            return Ok(false);
        }
        write_line(&self.root, &path, &format_mb_schemata(&desired))?;
        Ok(true)
    }

    /// Sets every domain back to the default group's value: unthrottled.
    pub fn unthrottle(&self) -> Result<bool, ResctrlError> {
        let defaults = self.caps.default_schemata.clone();
        self.set_mb(&defaults)
    }

    /// The TIDs in the group.
    pub fn tasks(&self) -> Result<Vec<u32>, ResctrlError> {
        Ok(read_tasks(&self.path.join(TASKS))?)
    }

    /// Moves threads into the group, one write per TID not already in it. resctrl moves single
    /// threads: pass every TID of a process, or use [`LodgerGroup::move_processes`].
    pub fn move_threads(&self, tids: &[u32]) -> Result<TaskMove, ResctrlError> {
        // A set: a throttled tier can hold a thousand threads, and a list's `contains` per TID
        // made every pass quadratic in them.
        let present: std::collections::HashSet<u32> = self.tasks()?.into_iter().collect();
        let wanted: Vec<u32> = tids
            .iter()
            .copied()
            .filter(|t| !present.contains(t))
            .collect();
        Ok(write_tasks(
            &self.root,
            &self.path.join(TASKS),
            GroupKind::Control,
            &wanted,
        )?)
    }

    /// Moves every current thread of each process (from `<proc_root>/<pid>/task`).
    pub fn move_processes(&self, proc_root: &Path, pids: &[u32]) -> Result<TaskMove, ResctrlError> {
        let mut tids = Vec::new();
        let gone = ProcReader::new(proc_root).threads_of(pids, &mut tids)?;
        let mut done = self.move_threads(&tids)?;
        done.gone.extend(gone);
        Ok(done)
    }

    /// Gives threads back to the default group (a job left the lodgers, or was unregistered).
    pub fn release_threads(&self, tids: &[u32]) -> Result<TaskMove, ResctrlError> {
        Ok(write_tasks(
            &self.root,
            &self.root.join(TASKS),
            GroupKind::Control,
            tids,
        )?)
    }

    /// Unthrottles the group and gives every thread in it back to the default group; the
    /// group stays (empty, at the defaults).
    pub fn restore(&self) -> Result<Restored, ResctrlError> {
        let schemata_changed = self.unthrottle()?;
        let tids = self.tasks()?;
        let tasks = self.release_threads(&tids)?;
        Ok(Restored {
            schemata_changed,
            tasks,
        })
    }

    /// Removes the group (its tasks go back to the default group). `Ok(false)` when it was
    /// already gone.
    pub fn remove(self) -> Result<bool, ResctrlError> {
        Ok(remove_group(&self.path)?)
    }

    /// Restores the group ([`LodgerGroup::restore`]), then removes it: no throttle in force any
    /// more, or lodgerd stopping. `Ok(false)` when it was already gone.
    pub fn restore_and_remove(self) -> Result<bool, ResctrlError> {
        self.restore()?;
        self.remove()
    }
}

/// Removes `<root>/<name>`, lodger's group from an earlier run, without knowing the node's MBA
/// (cleanup at start or stop). `Ok(false)` when there is none.
pub fn remove_stale_group(root: &Path, name: &str) -> Result<bool, ResctrlError> {
    check_group_name(name)?;
    Ok(remove_group(&root.join(name))?)
}

fn join<'a>(ids: impl Iterator<Item = &'a u32>) -> String {
    let ids: Vec<String> = ids.map(u32::to_string).collect();
    if ids.is_empty() {
        "none".to_string()
    } else {
        ids.join(", ")
    }
}

fn check_group_name(name: &str) -> Result<(), ResctrlError> {
    match group_name_problem(name) {
        Some(reason) => Err(ResctrlError::BadGroupName {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{
        copy_of as copy_tree_of, resctrl_fixture as fixture, simulate_kernel_rmdir,
    };

    fn copy_of(name: &str) -> tempfile::TempDir {
        copy_tree_of(&fixture(name))
    }
    use crate::sys::resctrlfs::CpuVendor;

    fn read(path: &Path) -> String {
        fs::read_to_string(path).expect("read")
    }

    #[test]
    fn intel_create_throttle_move_restore_remove() {
        let tmp = copy_of("intel-mba-mbm");
        let root = tmp.path();
        let caps = MbaCaps::read(root, &CpuVendor::Intel).expect("caps");
        let root_tasks_before = read(&root.join(TASKS));

        let (group, created) =
            LodgerGroup::create(root, "lodger-test", caps.clone()).expect("create");
        assert!(created);
        assert_eq!(group.path(), root.join("lodger-test"));
        // What mkdir makes the kernel write: the unthrottled schemata, an empty tasks file.
        fs::write(
            group.path().join(SCHEMATA),
            "    L3:0=7ff;1=7ff\n    MB:0=100;1=100\n",
        )
        .expect("simulate kernel");
        fs::write(group.path().join(TASKS), "").expect("simulate kernel");

        // Intel: 35 is rounded up to 40 (bandwidth_gran 10), 5 to min_bandwidth 10.
        let changed = group
            .set_mb(&BTreeMap::from([(0, 35), (1, 5)]))
            .expect("set");
        assert!(changed);
        assert_eq!(read(&group.path().join(SCHEMATA)), "MB:0=40;1=10\n");
        // The same values again, before or after rounding: no write.
        fs::write(
            group.path().join(SCHEMATA),
            "    L3:0=7ff;1=7ff\n    MB:0=40;1=10\n",
        )
        .expect("kernel shows both lines");
        assert!(!group
            .set_mb(&BTreeMap::from([(0, 40), (1, 10)]))
            .expect("same"));
        assert!(!group
            .set_mb(&BTreeMap::from([(0, 31)]))
            .expect("rounds to same"));
        assert_eq!(
            read(&group.path().join(SCHEMATA)),
            "    L3:0=7ff;1=7ff\n    MB:0=40;1=10\n",
            "untouched"
        );
        // One domain changes: the full line is written, the other domain keeps its value.
        assert!(group
            .set_mb(&BTreeMap::from([(1, 50)]))
            .expect("one domain"));
        assert_eq!(read(&group.path().join(SCHEMATA)), "MB:0=40;1=50\n");
        assert_eq!(group.mb().expect("mb"), BTreeMap::from([(0, 40), (1, 50)]));

        let moved = group.move_threads(&[4100, 4101]).expect("move");
        assert_eq!(moved.moved, [4100, 4101]);
        let again = group.move_threads(&[4101, 4102]).expect("move again");
        assert_eq!(
            again.moved,
            [4102],
            "threads already in the group are not written"
        );
        assert_eq!(read(&group.path().join(TASKS)), "4100\n4101\n4102\n");
        assert_eq!(group.tasks().expect("tasks"), [4100, 4101, 4102]);

        let restored = group.restore().expect("restore");
        assert!(restored.schemata_changed);
        assert_eq!(restored.tasks.moved, [4100, 4101, 4102]);
        assert_eq!(read(&group.path().join(SCHEMATA)), "MB:0=100;1=100\n");
        assert_eq!(
            read(&root.join(TASKS)),
            format!("{root_tasks_before}4100\n4101\n4102\n")
        );
        // The default group's schemata is never written.
        assert_eq!(
            read(&root.join(SCHEMATA)),
            read(&fixture("intel-mba-mbm").join(SCHEMATA))
        );

        simulate_kernel_rmdir(group.path());
        assert!(group.clone().remove().expect("remove"));
        assert!(!root.join("lodger-test").exists());
        assert!(!group.remove().expect("already gone"));
    }

    #[test]
    fn intel_adopts_the_existing_group() {
        let tmp = copy_of("intel-mba-mbm");
        let root = tmp.path();
        let caps = MbaCaps::read(root, &CpuVendor::Intel).expect("caps");
        // The policy's name for the batch/offline group is this one.
        assert_eq!(
            DEFAULT_CONTROL_GROUP,
            crate::policy::contention::MbaGroup::Lodgers.default_name()
        );
        let (group, created) =
            LodgerGroup::create(root, DEFAULT_CONTROL_GROUP, caps.clone()).expect("adopt");
        assert!(!created);
        // The fixture's group is throttled to 50: asking for 50 again writes nothing.
        assert_eq!(group.mb().expect("mb"), BTreeMap::from([(0, 50), (1, 50)]));
        assert!(!group
            .set_mb(&BTreeMap::from([(0, 50), (1, 50)]))
            .expect("same"));
        assert_eq!(
            read(&group.path().join(SCHEMATA)),
            read(&fixture("intel-mba-mbm").join("lodger-lodgers/schemata"))
        );
        assert!(group.unthrottle().expect("unthrottle"));
        assert_eq!(read(&group.path().join(SCHEMATA)), "MB:0=100;1=100\n");
        assert!(!group.unthrottle().expect("twice"));
        let opened = LodgerGroup::open(root, DEFAULT_CONTROL_GROUP, caps.clone())
            .expect("open")
            .expect("exists");
        assert_eq!(opened, group);
        assert!(LodgerGroup::open(root, "lodger-none", caps)
            .expect("open")
            .is_none());
    }

    #[test]
    fn amd_values_are_absolute_and_existing_tasks_are_given_back() {
        let tmp = copy_of("amd");
        let root = tmp.path();
        let caps = MbaCaps::read(root, &CpuVendor::Amd).expect("caps");
        let root_tasks_before = read(&root.join(TASKS));
        let (group, created) =
            LodgerGroup::create(root, DEFAULT_CONTROL_GROUP, caps).expect("adopt");
        assert!(!created);
        assert_eq!(group.tasks().expect("tasks"), [31870, 31871]);
        // Absolute values pass as given (gran 1, min 0); above the default is clamped.
        assert!(group
            .set_mb(&BTreeMap::from([(0, 1536), (1, 1024), (2, 205), (3, 9999)]))
            .expect("set"));
        assert_eq!(
            read(&group.path().join(SCHEMATA)),
            "MB:0=1536;1=1024;2=205;3=2048\n"
        );
        let err = group
            .set_mb(&BTreeMap::from([(4, 100)]))
            .expect_err("no domain 4");
        assert!(
            matches!(err, ResctrlError::UnknownDomain { domain: 4, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("0, 1, 2, 3"), "{err}");

        let restored = group.restore().expect("restore");
        assert_eq!(restored.tasks.moved, [31870, 31871]);
        assert_eq!(
            read(&group.path().join(SCHEMATA)),
            "MB:0=2048;1=2048;2=2048;3=2048\n"
        );
        assert_eq!(
            read(&root.join(TASKS)),
            format!("{root_tasks_before}31870\n31871\n")
        );
        // Restoring twice: the schemata is not written again. (The fixture's tasks file does
        // not empty itself the way the kernel's would, so the tasks are listed again.)
        assert!(!group.restore().expect("again").schemata_changed);

        simulate_kernel_rmdir(group.path());
        assert!(remove_stale_group(root, DEFAULT_CONTROL_GROUP).expect("remove"));
        assert!(!remove_stale_group(root, DEFAULT_CONTROL_GROUP).expect("gone"));
    }

    #[test]
    fn no_resctrl_is_unavailable() {
        let caps = MbaCaps::read(&fixture("intel-mba-mbm"), &CpuVendor::Intel).expect("caps");
        let err = LodgerGroup::create(&fixture("none"), DEFAULT_CONTROL_GROUP, caps.clone())
            .expect_err("none");
        assert!(err.is_unavailable(), "{err}");
        assert!(err.to_string().contains("not mounted"), "{err}");
        let err = LodgerGroup::create(Path::new("/nonexistent/resctrl"), "g", caps.clone())
            .expect_err("missing");
        assert!(err.is_unavailable(), "{err}");
        // MBA absent although resctrl is mounted (a CPU with CAT and MBM only).
        let tmp = copy_of("intel-mba-mbm");
        fs::remove_dir_all(tmp.path().join("info/MB")).expect("drop MBA");
        let err = LodgerGroup::create(tmp.path(), "g", caps).expect_err("no MBA");
        assert!(err.is_unavailable(), "{err}");
        assert!(err.to_string().contains("MBA"), "{err}");
        assert!(!tmp.path().join("g").exists(), "nothing created");
    }

    #[test]
    fn bad_names_and_failures_carry_the_path() {
        let tmp = copy_of("intel-mba-mbm");
        let root = tmp.path();
        let caps = MbaCaps::read(root, &CpuVendor::Intel).expect("caps");
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "info",
            "mon_groups",
            "mon_data",
            "x y",
        ] {
            let err = LodgerGroup::create(root, bad, caps.clone()).expect_err(bad);
            assert!(
                matches!(err, ResctrlError::BadGroupName { .. }),
                "{bad}: {err}"
            );
        }
        // A group whose schemata is garbage: a parse error naming the file and the line.
        let (group, _) = LodgerGroup::create(root, "lodger-bad", caps.clone()).expect("create");
        fs::write(group.path().join(SCHEMATA), "MB:0=lots\n").expect("garbage");
        let err = group
            .set_mb(&BTreeMap::from([(0, 50)]))
            .expect_err("garbage");
        assert!(err.to_string().contains("lodger-bad/schemata"), "{err}");
        assert!(err.to_string().contains("MB:0=lots"), "{err}");
        // No schemata at all (not populated): a read error with the path.
        fs::remove_file(group.path().join(SCHEMATA)).expect("rm");
        let err = group.mb().expect_err("missing");
        assert!(matches!(err, ResctrlError::Read { .. }), "{err}");
        // Garbage in tasks.
        fs::write(group.path().join(TASKS), "12\nabc\n").expect("garbage tasks");
        let err = group.tasks().expect_err("garbage");
        assert!(err.to_string().contains("'abc'"), "{err}");
    }

    #[test]
    fn move_processes_reads_proc() {
        let tmp = copy_of("intel-mba-mbm");
        let root = tmp.path();
        let caps = MbaCaps::read(root, &CpuVendor::Intel).expect("caps");
        let (group, _) = LodgerGroup::create(root, "lodger-p", caps).expect("create");
        let me = std::process::id();
        let moved = group
            .move_processes(Path::new("/proc"), &[me, u32::MAX])
            .expect("move self");
        assert!(moved.moved.contains(&me), "{moved:?}");
        assert_eq!(moved.gone, [u32::MAX]);
        // Twice: nothing new to write.
        let again = group
            .move_processes(Path::new("/proc"), &[me])
            .expect("again");
        assert!(
            again.moved.iter().all(|t| !moved.moved.contains(t)),
            "{again:?}"
        );
    }
}
