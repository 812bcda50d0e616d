//! Tests of the cpuset hierarchy: the nested write order (a property test of the v1 subset rule) and restoring saved values on a cgroup v2 fixture tree.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::fs;

fn set(s: &str) -> CpuSet {
    CpuSet::parse(s).expect("test cpulist")
}

#[test]
fn grows_parents_first_and_shrinks_children_first() {
    // parent 0 → 1, child 0 → 1: grow parent to 0-1, grow child to 0-1, shrink child, shrink
    // parent.
    let changes = vec![
        NestedChange {
            cgroup: "/p/c".into(),
            current: set("0"),
            target: set("1"),
        },
        NestedChange {
            cgroup: "/p".into(),
            current: set("0"),
            target: set("1"),
        },
    ];
    let order = nested_write_order(&changes);
    let got: Vec<(String, String)> = order.into_iter().map(|(c, v)| (c, v.to_string())).collect();
    assert_eq!(
        got,
        vec![
            ("/p".to_string(), "0-1".to_string()),
            ("/p/c".to_string(), "0-1".to_string()),
            ("/p/c".to_string(), "1".to_string()),
            ("/p".to_string(), "1".to_string()),
        ]
    );
    // Nothing to do writes nothing.
    let same = vec![NestedChange {
        cgroup: "/p".into(),
        current: set("0-1"),
        target: set("0-1"),
    }];
    assert!(nested_write_order(&same).is_empty());
}

/// A chain `/c0/c1/...` whose values nest (each a subset of the one above), below a root that
/// holds all 8 CPUs.
fn nested_chain() -> impl Strategy<Value = Vec<CpuSet>> {
    (1usize..5).prop_flat_map(|n| {
        proptest::collection::vec(proptest::collection::btree_set(0u32..8, 1..8), n).prop_map(
            |sets| {
                let mut out: Vec<CpuSet> = Vec::new();
                for s in sets {
                    let mut v: CpuSet = s.into_iter().collect();
                    if let Some(parent) = out.last() {
                        v = v.intersection(parent);
                        if v.is_empty() {
                            v = parent.clone();
                        }
                    }
                    out.push(v);
                }
                out
            },
        )
    })
}

proptest! {
    /// Every write the order makes is accepted by the v1 kernel rule (the new value is within
    /// the parent's current value and covers every child's), and the end state is the target.
    #[test]
    fn nested_order_never_breaks_the_subset_rule(
        (current, target) in (1usize..5).prop_flat_map(|_| (nested_chain(), nested_chain()))
    ) {
        let n = current.len().min(target.len());
        let names: Vec<String> = (0..n)
            .map(|i| (0..=i).map(|k| format!("/c{k}")).collect::<String>())
            .collect();
        let changes: Vec<NestedChange> = (0..n)
            .map(|i| NestedChange {
                cgroup: names[i].clone(),
                current: current[i].clone(),
                target: target[i].clone(),
            })
            .collect();
        let all: CpuSet = (0u32..8).collect();
        let mut state: BTreeMap<String, CpuSet> = changes
            .iter()
            .map(|c| (c.cgroup.clone(), c.current.clone()))
            .collect();
        for (cg, value) in nested_write_order(&changes) {
            let parent = parent_of(&cg).unwrap_or("/");
            let parent_value = state.get(parent).cloned().unwrap_or_else(|| all.clone());
            prop_assert!(value.is_subset(&parent_value), "{cg} := {value} outside parent {parent_value}");
            for (other, v) in &state {
                if parent_of(other) == Some(cg.as_str()) {
                    prop_assert!(v.is_subset(&value), "{cg} := {value} leaves child {other} = {v} outside");
                }
            }
            state.insert(cg, value);
        }
        for c in &changes {
            prop_assert_eq!(&state[&c.cgroup], &c.target);
        }
    }
}

// -----------------------------------------------------------------------------------------
// Restoring saved values on a v2 fixture tree.

const SLURM: &str = "/system.slice/slurmstepd.scope/job_42/step_0/slurm";

fn v2_copy() -> tempfile::TempDir {
    crate::testutil::copy_of(&crate::testutil::fixture("cgroup/v2-systemd-slurm"))
}

/// The v2 hierarchy of a fixture tree with the kernel's refusals that plain files lack:
/// before Linux 7.0 a cpuset whose cgroup (or a descendant) has tasks cannot be made empty
/// (ENOSPC, `validate_change`); optionally an exclusive sibling partition refuses the node's
/// whole CPU list (EINVAL), and some cgroups refuse every write (EACCES).
#[derive(Debug)]
struct KernelRules {
    inner: V2Cpuset,
    exclusive_sibling: bool,
    refuse_all: Vec<&'static str>,
}

impl KernelRules {
    fn new(root: &Path) -> Self {
        Self {
            inner: V2Cpuset::new(root.to_path_buf()),
            exclusive_sibling: false,
            refuse_all: Vec::new(),
        }
    }

    fn populated(&self, cgroup: &str) -> bool {
        let mut procs = Vec::new();
        let mut cgroups = vec![cgroup.to_string()];
        let mut i = 0;
        while i < cgroups.len() {
            let c = cgroups[i].clone();
            let _ = self.inner.procs(&c, &mut procs);
            let _ = self.inner.children(&c, &mut cgroups);
            i += 1;
        }
        !procs.is_empty()
    }
}

impl CpusetHierarchy for KernelRules {
    fn version(&self) -> CgroupVersion {
        self.inner.version()
    }
    fn root(&self) -> &Path {
        self.inner.root()
    }
    fn nested_subsets(&self) -> bool {
        self.inner.nested_subsets()
    }
    fn read(&self, cgroup: &str, file: CpusetFile) -> Result<CpuSet, CgroupError> {
        self.inner.read(cgroup, file)
    }
    fn write(&self, cgroup: &str, file: CpusetFile, value: &CpuSet) -> Result<(), CgroupError> {
        let refuse = |errno| {
            Err(CgroupError::Write {
                path: self.inner.dir(cgroup).join(file.name()),
                value: value.to_string(),
                source: io::Error::from_raw_os_error(errno),
            })
        };
        if self.refuse_all.contains(&cgroup) {
            return refuse(libc::EACCES);
        }
        let current = self.inner.read(cgroup, file)?;
        if value.is_empty() && !current.is_empty() && self.populated(cgroup) {
            return refuse(libc::ENOSPC);
        }
        let node = self.inner.effective_cpus("/")?;
        if self.exclusive_sibling && file == CpusetFile::Cpus && *value == node {
            return refuse(libc::EINVAL);
        }
        self.inner.write(cgroup, file, value)
    }
    fn effective_cpus(&self, cgroup: &str) -> Result<CpuSet, CgroupError> {
        self.inner.effective_cpus(cgroup)
    }
    fn procs(&self, cgroup: &str, out: &mut Vec<u32>) -> Result<(), CgroupError> {
        self.inner.procs(cgroup, out)
    }
    fn children(&self, cgroup: &str, out: &mut Vec<String>) -> Result<(), CgroupError> {
        self.inner.children(cgroup, out)
    }
    fn create(&self, cgroup: &str) -> Result<(), CgroupError> {
        self.inner.create(cgroup)
    }
    fn create_empty(&self, cgroup: &str) -> Result<(), CgroupError> {
        self.inner.create_empty(cgroup)
    }
    fn remove(&self, cgroup: &str) -> Result<(), CgroupError> {
        self.inner.remove(cgroup)
    }
    fn remove_if_unused(&self, cgroup: &str) -> Result<bool, CgroupError> {
        self.inner.remove_if_unused(cgroup)
    }
    fn attach(&self, cgroup: &str, pid: u32) -> Result<(), CgroupError> {
        self.inner.attach(cgroup, pid)
    }
    fn cpuset_enabled(&self, cgroup: &str) -> Result<bool, CgroupError> {
        self.inner.cpuset_enabled(cgroup)
    }
    fn enable_cpuset(&self, cgroup: &str, delegated: &str) -> Result<bool, CgroupError> {
        self.inner.enable_cpuset(cgroup, delegated)
    }
    fn cgroup_of(&self, proc_root: &Path, pid: u32) -> Result<Option<String>, CgroupError> {
        self.inner.cgroup_of(proc_root, pid)
    }
}

fn restore_to(cgroup: &str, h: &dyn CpusetHierarchy, cpus: &str, mems: &str) -> CpusetTarget {
    CpusetTarget {
        cgroup: cgroup.to_string(),
        current_cpus: h.read(cgroup, CpusetFile::Cpus).expect("cpus"),
        current_mems: h.read(cgroup, CpusetFile::Mems).expect("mems"),
        cpus: Some(set(cpus)),
        mems: Some(set(mems)),
    }
}

fn bytes(dir: &Path, cgroup: &str, file: &str) -> String {
    fs::read_to_string(dir.join(cgroup.trim_start_matches('/')).join(file)).expect("read")
}

#[test]
fn an_empty_set_is_written_as_one_newline() {
    let tree = v2_copy();
    let h = V2Cpuset::new(tree.path().to_path_buf());
    h.write(SLURM, CpusetFile::Cpus, &set("1")).expect("write");
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_CPUS), "1");
    // Not zero bytes: write_all makes no system call for them, and a zero-length write(2)
    // does not reach cpuset. The kernel strips the newline and takes the empty value.
    h.write(SLURM, CpusetFile::Cpus, &CpuSet::default())
        .expect("write empty");
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_CPUS), "\n");
    assert_eq!(
        h.read(SLURM, CpusetFile::Cpus).expect("read"),
        CpuSet::default()
    );
}

#[test]
fn an_inherited_value_the_kernel_refuses_is_replaced_by_the_whole_node() {
    let tree = v2_copy();
    let h = KernelRules::new(tree.path());
    // lodger's values, on a cgroup with a task: the pre-7.0 kernel refuses to empty it.
    h.write(SLURM, CpusetFile::Cpus, &set("1")).expect("cpus");
    h.write(SLURM, CpusetFile::Mems, &set("0")).expect("mems");
    fs::write(
        tree.path()
            .join(SLURM.trim_start_matches('/'))
            .join(CGROUP_PROCS),
        "4242\n",
    )
    .expect("a task");
    let restored = restore_nested(&h, &[restore_to(SLURM, &h, "", "")]);
    assert!(restored.errors.is_empty(), "{:?}", restored.errors);
    assert!(restored.wrote);
    // The root's effective values: v2 intersects them with the parent's, so the cgroup
    // gets what inheriting gives and keeps following its parent.
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_MEMS), "0");
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_CPUS), "0-3");
    let [mems, cpus] = &restored.substituted[..] else {
        panic!("{:?}", restored.substituted);
    };
    assert!(mems.path.ends_with("slurm/cpuset.mems") && mems.follows_parent);
    assert_eq!(cpus.written, set("0-3"));
    assert_eq!(cpus.refused.raw_os_error(), Some(libc::ENOSPC));
    let text = cpus.to_string();
    assert!(
        text.contains("slurm/cpuset.cpus was empty (inherit the parent's)"),
        "{text}"
    );
    assert!(
        text.contains("holds 0-3") && text.contains("still follows its parent"),
        "{text}"
    );
    assert!(
        text.contains("write an empty line to it once it has no tasks"),
        "{text}"
    );

    // Without tasks the kernel takes the empty value itself.
    fs::write(
        tree.path()
            .join(SLURM.trim_start_matches('/'))
            .join(CGROUP_PROCS),
        "",
    )
    .expect("no task");
    let restored = restore_nested(&h, &[restore_to(SLURM, &h, "", "")]);
    assert!(restored.substituted.is_empty() && restored.errors.is_empty());
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_CPUS), "\n");
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_MEMS), "\n");
}

#[test]
fn when_the_whole_node_is_refused_too_the_parents_effective_value_is_written() {
    let tree = v2_copy();
    let mut h = KernelRules::new(tree.path());
    h.exclusive_sibling = true;
    let step = tree.path().join(SLURM.trim_start_matches('/')).join("..");
    fs::write(step.join(CPUSET_CPUS_EFFECTIVE_V2), "2-3").expect("parent effective");
    h.write(SLURM, CpusetFile::Cpus, &set("3")).expect("cpus");
    fs::write(step.join("slurm").join(CGROUP_PROCS), "4242\n").expect("a task");
    let restored = restore_nested(&h, &[restore_to(SLURM, &h, "", "")]);
    assert!(restored.errors.is_empty(), "{:?}", restored.errors);
    let [cpus] = &restored.substituted[..] else {
        panic!("{:?}", restored.substituted);
    };
    assert_eq!(cpus.written, set("2-3"));
    assert!(!cpus.follows_parent);
    assert!(
        cpus.to_string().contains("will not grow with its parent"),
        "{cpus}"
    );
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_CPUS), "2-3");
}

#[test]
fn a_failed_restore_is_reported_and_the_others_still_happen() {
    let tree = v2_copy();
    let mut h = KernelRules::new(tree.path());
    let step = "/system.slice/slurmstepd.scope/job_42/step_0";
    h.write(step, CpusetFile::Cpus, &set("2")).expect("cpus");
    h.write(SLURM, CpusetFile::Cpus, &set("2")).expect("cpus");
    h.write(SLURM, CpusetFile::Mems, &set("0")).expect("mems");
    h.refuse_all = vec![step];
    let restored = restore_nested(
        &h,
        &[
            restore_to(step, &h, "0-3", "0"),
            restore_to(SLURM, &h, "1", ""),
        ],
    );
    // The step refused; its sibling entry, mems and cpus, went back all the same.
    assert_eq!(bytes(tree.path(), step, CPUSET_CPUS), "2");
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_CPUS), "1");
    assert_eq!(bytes(tree.path(), SLURM, CPUSET_MEMS), "\n");
    let [err] = &restored.errors[..] else {
        panic!("{:?}", restored.errors);
    };
    let text = err.to_string();
    assert!(
        text.contains("cannot restore")
            && text.contains("step_0/cpuset.cpus to '0-3' (its value before lodger)")
            && text.contains("Permission denied")
            && text.contains("it keeps lodger's value"),
        "{text}"
    );

    // An empty value refused, with nothing accepted in its place: both refusals are said.
    h.refuse_all.clear();
    h.write(SLURM, CpusetFile::Mems, &set("0")).expect("mems");
    h.refuse_all = vec![SLURM];
    let restored = restore_nested(&h, &[restore_to(SLURM, &h, "0-3", "")]);
    let text: Vec<String> = restored.errors.iter().map(ToString::to_string).collect();
    assert_eq!(text.len(), 2, "{text:?}");
    assert!(
        text[0].contains("slurm/cpuset.mems to empty (inherit the parent's)")
            && text[0].contains("nor to what inheriting gives"),
        "{text:?}"
    );
}
