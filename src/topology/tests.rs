//! Tests of the topology reader: fixture trees written here and the recorded machine shapes.

#![allow(clippy::unwrap_used)]

use super::*;
use std::path::Path;
use tempfile::TempDir;

/// Writes `content` at `root/rel`, creating directories (below's `create_file_with_content`).
fn write(root: &Path, rel: &str, content: &str) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

fn cpu(root: &Path, id: u32, package: u32, siblings: &str) {
    let t = format!("devices/system/cpu/cpu{id}/topology");
    write(
        root,
        &format!("{t}/physical_package_id"),
        &format!("{package}\n"),
    );
    write(root, &format!("{t}/core_id"), &format!("{id}\n"));
    write(
        root,
        &format!("{t}/thread_siblings_list"),
        &format!("{siblings}\n"),
    );
}

fn gpu(root: &Path, addr: &str, vendor: &str, class: &str, node: &str, local: &str) {
    let d = format!("bus/pci/devices/{addr}");
    write(root, &format!("{d}/vendor"), &format!("{vendor}\n"));
    write(root, &format!("{d}/class"), &format!("{class}\n"));
    write(root, &format!("{d}/numa_node"), &format!("{node}\n"));
    write(root, &format!("{d}/local_cpulist"), &format!("{local}\n"));
}

/// 4 CPUs, 2 cores (0,2 and 1,3), 2 nodes, one GPU on node 1.
fn small_tree() -> TempDir {
    let dir = TempDir::new().unwrap();
    let r = dir.path();
    write(r, "devices/system/cpu/online", "0-3\n");
    cpu(r, 0, 0, "0,2");
    cpu(r, 1, 0, "1,3");
    cpu(r, 2, 0, "0,2");
    cpu(r, 3, 0, "1,3");
    write(r, "devices/system/node/node0/cpulist", "0,2\n");
    write(r, "devices/system/node/node1/cpulist", "1,3\n");
    write(r, "devices/system/node/online", "0-1\n");
    gpu(r, "0000:3b:00.0", "0x10de", "0x030200", "1", "1,3");
    dir
}

fn err_of(dir: &TempDir) -> TopologyError {
    Topology::read(dir.path()).unwrap_err()
}

fn assert_names(err: &TopologyError, file: &str, value: Option<&str>) {
    let text = err.to_string();
    assert!(text.contains(file), "error {text:?} does not name {file}");
    if let Some(v) = value {
        assert!(text.contains(v), "error {text:?} does not show {v:?}");
    }
}

#[test]
fn reads_a_small_tree() {
    let dir = small_tree();
    let t = Topology::read(dir.path()).unwrap();
    assert_eq!(t.online().to_string(), "0-3");
    assert_eq!(t.cores.len(), 2);
    assert_eq!(t.siblings(2).unwrap().to_string(), "0,2");
    assert_eq!(t.siblings(7), None);
    assert!(t.has_smt());
    assert_eq!(t.cpus[&3].numa_node, 1);
    assert_eq!(t.cpus[&3].core, 1);
    assert_eq!(t.numa_nodes[&1].cpus.to_string(), "1,3");
    assert_eq!(
        t.numa_nodes_of(&CpuSet::parse("0-1").unwrap()).to_string(),
        "0-1"
    );
    assert_eq!(t.gpus.len(), 1);
    let g = t.gpu(0).unwrap();
    assert_eq!(g.pci_address, "0000:3b:00.0");
    assert_eq!(g.numa_node, Some(1));
    assert_eq!(g.local_cpus.to_string(), "1,3");
}

#[test]
fn prefers_core_cpus_list_over_the_old_name() {
    let dir = small_tree();
    // A kernel that has both must agree; make the new name the only correct one.
    write(
        dir.path(),
        "devices/system/cpu/cpu0/topology/thread_siblings_list",
        "garbage\n",
    );
    write(
        dir.path(),
        "devices/system/cpu/cpu0/topology/core_cpus_list",
        "0,2\n",
    );
    let t = Topology::read(dir.path()).unwrap();
    assert_eq!(t.siblings(0).unwrap().to_string(), "0,2");
}

#[test]
fn falls_back_to_core_id_without_sibling_lists() {
    let dir = small_tree();
    for c in 0..4 {
        fs::remove_file(dir.path().join(format!(
            "devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        )))
        .unwrap();
    }
    write(
        dir.path(),
        "devices/system/cpu/cpu2/topology/core_id",
        "0\n",
    );
    write(
        dir.path(),
        "devices/system/cpu/cpu3/topology/core_id",
        "1\n",
    );
    let t = Topology::read(dir.path()).unwrap();
    assert_eq!(t.siblings(0).unwrap().to_string(), "0,2");
    assert_eq!(t.siblings(3).unwrap().to_string(), "1,3");
}

#[test]
fn missing_files_name_their_path() {
    let dir = TempDir::new().unwrap();
    let err = err_of(&dir);
    assert!(matches!(err, TopologyError::Io { .. }), "{err:?}");
    assert_names(&err, "devices/system/cpu/online", None);

    let dir = small_tree();
    fs::remove_file(
        dir.path()
            .join("devices/system/cpu/cpu1/topology/physical_package_id"),
    )
    .unwrap();
    assert_names(&err_of(&dir), "cpu1/topology/physical_package_id", None);

    let dir = small_tree();
    let t = dir.path().join("devices/system/cpu/cpu1/topology");
    fs::remove_file(t.join("thread_siblings_list")).unwrap();
    fs::remove_file(t.join("core_id")).unwrap();
    let err = err_of(&dir);
    assert!(matches!(err, TopologyError::Io { .. }), "{err:?}");
    assert_names(&err, "cpu1/topology/thread_siblings_list", None);

    let dir = small_tree();
    fs::remove_file(dir.path().join("devices/system/node/node1/cpulist")).unwrap();
    assert_names(&err_of(&dir), "node1/cpulist", None);

    let dir = small_tree();
    fs::remove_file(
        dir.path()
            .join("bus/pci/devices/0000:3b:00.0/local_cpulist"),
    )
    .unwrap();
    assert_names(&err_of(&dir), "0000:3b:00.0/local_cpulist", None);

    let dir = small_tree();
    fs::remove_file(dir.path().join("bus/pci/devices/0000:3b:00.0/class")).unwrap();
    assert_names(&err_of(&dir), "0000:3b:00.0/class", None);
}

#[test]
fn bad_values_name_path_and_value() {
    let cases: &[(&str, &str, &str)] = &[
        ("devices/system/cpu/online", "0-x\n", "0-x"),
        ("devices/system/cpu/online", "3-1\n", "3-1"),
        (
            "devices/system/cpu/cpu2/topology/physical_package_id",
            "zero\n",
            "zero",
        ),
        (
            "devices/system/cpu/cpu2/topology/physical_package_id",
            "-7\n",
            "-7",
        ),
        (
            "devices/system/cpu/cpu2/topology/thread_siblings_list",
            "0;2\n",
            "0;2",
        ),
        ("devices/system/node/node0/cpulist", "0,,2\n", "0,,2"),
        ("bus/pci/devices/0000:3b:00.0/vendor", "nvidia\n", "nvidia"),
        (
            "bus/pci/devices/0000:3b:00.0/class",
            "0x03zz00\n",
            "0x03zz00",
        ),
        ("bus/pci/devices/0000:3b:00.0/numa_node", "one\n", "one"),
        ("bus/pci/devices/0000:3b:00.0/local_cpulist", "1-\n", "1-"),
    ];
    for &(file, content, value) in cases {
        let dir = small_tree();
        write(dir.path(), file, content);
        let err = err_of(&dir);
        assert!(
            matches!(err, TopologyError::Parse { .. }),
            "{file}: {err:?}"
        );
        assert_names(&err, file, Some(value));
    }
}

#[test]
fn empty_files() {
    let dir = small_tree();
    write(dir.path(), "devices/system/cpu/online", "");
    assert!(matches!(err_of(&dir), TopologyError::NoCpus { .. }));

    let dir = small_tree();
    write(
        dir.path(),
        "devices/system/cpu/cpu0/topology/physical_package_id",
        "",
    );
    assert!(matches!(err_of(&dir), TopologyError::Parse { .. }));

    // An empty sibling list does not even hold the CPU itself.
    let dir = small_tree();
    write(
        dir.path(),
        "devices/system/cpu/cpu0/topology/thread_siblings_list",
        "\n",
    );
    let err = err_of(&dir);
    assert_names(&err, "cpu0/topology/thread_siblings_list", Some("cpu 0"));

    // An empty node cpulist is a memory-only node.
    let dir = small_tree();
    write(dir.path(), "devices/system/node/node2/cpulist", "\n");
    let t = Topology::read(dir.path()).unwrap();
    assert!(t.numa_nodes[&2].cpus.is_empty());
    assert_eq!(t.numa_nodes.len(), 3);
}

#[test]
fn inconsistent_files_are_refused() {
    // cpu 2 disagrees with cpu 0 about their core.
    let dir = small_tree();
    write(
        dir.path(),
        "devices/system/cpu/cpu2/topology/thread_siblings_list",
        "2\n",
    );
    let err = err_of(&dir);
    assert!(matches!(err, TopologyError::Inconsistent { .. }), "{err:?}");

    // cpu 3 in no node.
    let dir = small_tree();
    write(dir.path(), "devices/system/node/node1/cpulist", "1\n");
    let err = err_of(&dir);
    assert!(matches!(err, TopologyError::Inconsistent { .. }), "{err:?}");
    assert!(err.to_string().contains("cpu 3"), "{err}");

    // cpu 1 in two nodes.
    let dir = small_tree();
    write(dir.path(), "devices/system/node/node0/cpulist", "0-2\n");
    assert!(matches!(err_of(&dir), TopologyError::Inconsistent { .. }));

    // Siblings in different packages.
    let dir = small_tree();
    write(
        dir.path(),
        "devices/system/cpu/cpu2/topology/physical_package_id",
        "1\n",
    );
    assert!(matches!(err_of(&dir), TopologyError::Inconsistent { .. }));
}

#[test]
fn no_node_directory_means_one_node() {
    let dir = small_tree();
    fs::remove_dir_all(dir.path().join("devices/system/node")).unwrap();
    let t = Topology::read(dir.path()).unwrap();
    assert_eq!(t.numa_nodes.len(), 1);
    assert_eq!(t.numa_nodes[&0].cpus.to_string(), "0-3");
    assert!(t.cpus.values().all(|c| c.numa_node == 0));
}

#[test]
fn offline_cpus_are_skipped() {
    let dir = small_tree();
    write(dir.path(), "devices/system/cpu/online", "0-2\n");
    fs::remove_dir_all(dir.path().join("devices/system/cpu/cpu3")).unwrap();
    let t = Topology::read(dir.path()).unwrap();
    assert_eq!(t.online().to_string(), "0-2");
    assert_eq!(t.siblings(1).unwrap().to_string(), "1");
    assert_eq!(t.numa_nodes[&1].cpus.to_string(), "1");
    assert_eq!(t.gpus[0].local_cpus.to_string(), "1");
}

#[test]
fn gpus_in_pci_order_and_filtered() {
    let dir = small_tree();
    let r = dir.path();
    gpu(r, "0000:1a:00.0", "0x10de", "0x030000", "-1", "0-3");
    gpu(r, "0000:1a:00.1", "0x10de", "0x040300", "-1", "0-3"); // HDMI audio
    gpu(r, "0000:05:00.0", "0x1a03", "0x030000", "0", "0,2"); // BMC VGA
    gpu(r, "0000:c1:00.0", "0x10de", "0x068000", "1", "1,3"); // NVSwitch
    gpu(r, "0000:c2:00.0", "0x10de", "0x030200", "0", "0,2");
    let t = Topology::read(r).unwrap();
    let addrs: Vec<&str> = t.gpus.iter().map(|g| g.pci_address.as_str()).collect();
    assert_eq!(addrs, ["0000:1a:00.0", "0000:3b:00.0", "0000:c2:00.0"]);
    let indices: Vec<u32> = t.gpus.iter().map(|g| g.index).collect();
    assert_eq!(indices, [0, 1, 2]);
    assert_eq!(t.gpu(0).unwrap().numa_node, None);
    assert_eq!(t.gpu(2).unwrap().numa_node, Some(0));
}

/// A GPU bound to another driver than `nvidia` (passed through to a VM) is not the host's: NVML
/// does not count it, so neither does the topology, and the GPUs after it keep NVML's indices.
/// Bound to `nvidia`, or to nothing yet, it counts.
#[test]
fn gpus_bound_to_another_driver_are_not_counted() {
    let dir = small_tree();
    let r = dir.path();
    gpu(r, "0000:1a:00.0", "0x10de", "0x030200", "0", "0,2");
    gpu(r, "0000:c2:00.0", "0x10de", "0x030200", "1", "1,3");
    let bind = |addr: &str, driver: &str| {
        std::os::unix::fs::symlink(
            format!("../../../bus/pci/drivers/{driver}"),
            r.join("bus/pci/devices").join(addr).join("driver"),
        )
        .unwrap();
    };
    bind("0000:1a:00.0", "vfio-pci");
    bind("0000:3b:00.0", "nvidia");
    let t = Topology::read(r).unwrap();
    let addrs: Vec<&str> = t.gpus.iter().map(|g| g.pci_address.as_str()).collect();
    assert_eq!(addrs, ["0000:3b:00.0", "0000:c2:00.0"]);
    assert_eq!(t.gpu(0).unwrap().numa_node, Some(1));
    assert_eq!(t.gpu(1).unwrap().pci_address, "0000:c2:00.0");
}

#[test]
fn no_pci_bus_means_no_gpus() {
    let dir = small_tree();
    fs::remove_dir_all(dir.path().join("bus")).unwrap();
    assert!(Topology::read(dir.path()).unwrap().gpus.is_empty());
}

#[test]
fn override_gpu_sets_or_adds() {
    let dir = small_tree();
    let mut t = Topology::read(dir.path()).unwrap();
    t.override_gpu(0, 0).unwrap();
    assert_eq!(t.gpu(0).unwrap().numa_node, Some(0));
    assert_eq!(t.gpu(0).unwrap().local_cpus.to_string(), "0,2");
    assert_eq!(t.gpu(0).unwrap().pci_address, "0000:3b:00.0");
    t.override_gpu(3, 1).unwrap();
    let g = t.gpu(3).unwrap();
    assert_eq!(
        (g.numa_node, g.local_cpus.to_string()),
        (Some(1), "1,3".into())
    );
    assert_eq!(g.pci_address, "");
    assert!(matches!(
        t.override_gpu(1, 9),
        Err(TopologyError::BadGpuOverride { .. })
    ));
    write(dir.path(), "devices/system/node/node2/cpulist", "\n");
    let mut t = Topology::read(dir.path()).unwrap();
    let err = t.override_gpu(0, 2).unwrap_err();
    assert!(err.to_string().contains("memory-only"), "{err}");
}

#[test]
fn isolated_cpus_are_read_and_a_missing_or_empty_file_means_none() {
    let dir = small_tree();
    assert!(
        Topology::read(dir.path()).unwrap().isolated.is_empty(),
        "no file"
    );
    write(dir.path(), "devices/system/cpu/isolated", "\n");
    assert!(
        Topology::read(dir.path()).unwrap().isolated.is_empty(),
        "empty"
    );
    // isolcpus=1,3,9: CPU 9 is not online here.
    write(dir.path(), "devices/system/cpu/isolated", "1,3,9\n");
    let t = Topology::read(dir.path()).unwrap();
    assert_eq!(t.isolated.to_string(), "1,3");
    assert_eq!(t.online().to_string(), "0-3", "still online CPUs");
    write(dir.path(), "devices/system/cpu/isolated", "1-x\n");
    assert_names(&err_of(&dir), "cpu/isolated", Some("1-x"));
}

#[test]
fn synthetic_shapes() {
    let t = Topology::synthetic(2, 1, 16, 2, 4);
    assert_eq!(t.cpus.len(), 64);
    assert_eq!(t.cores.len(), 32);
    assert_eq!(t.siblings(0).unwrap().to_string(), "0,32");
    assert_eq!(t.siblings(47).unwrap().to_string(), "15,47");
    assert_eq!(t.numa_nodes[&1].cpus.to_string(), "16-31,48-63");
    assert_eq!(t.cpus[&48].package, 1);
    assert!(t.has_smt());
    assert_eq!(t.gpus.len(), 8);
    assert_eq!(t.gpu(5).unwrap().numa_node, Some(1));
    assert_eq!(t.gpu(5).unwrap().local_cpus.to_string(), "16-31,48-63");
    let mut addrs: Vec<&str> = t.gpus.iter().map(|g| g.pci_address.as_str()).collect();
    let unsorted = addrs.clone();
    addrs.sort_unstable();
    assert_eq!(addrs, unsorted, "index order is PCI order");

    let t = Topology::synthetic(1, 4, 2, 1, 0);
    assert_eq!(t.online().to_string(), "0-7");
    assert!(!t.has_smt());
    assert_eq!(t.numa_nodes.len(), 4);
    assert_eq!(t.numa_nodes[&3].cpus.to_string(), "6-7");
    for (id, c) in &t.cpus {
        assert!(t.cores[c.core].cpus.contains(*id));
    }
}
