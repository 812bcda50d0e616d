//! The topology reader and the consolidation policy against whole machine shapes: the generated
//! fixtures in `tests/fixtures/sysfs/` and the trees recorded from real machines in
//! `$LODGER_FIXTURES/sysfs/` (default `../shared/fixtures/sysfs/`; unpacked into a temporary
//! directory).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use lodger::cpuset::CpuSet;
use lodger::job::JobId;
use lodger::policy::consolidate::{place, TrainingAsk};
use lodger::policy::{decide, Plan, TrainingJobView};
use lodger::privileged::skip;
use lodger::topology::{Topology, DEFAULT_SYSFS};
use tempfile::TempDir;

fn set(list: &str) -> CpuSet {
    CpuSet::parse(list).unwrap()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sysfs")
        .join(name)
}

fn read_fixture(name: &str) -> Topology {
    Topology::read(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every online CPU is in exactly one core and one NUMA node, and the indices agree.
fn assert_partitions(name: &str, t: &Topology) {
    let online = t.online();
    let mut in_cores = CpuSet::new();
    for (i, core) in t.cores.iter().enumerate() {
        assert!(!core.cpus.is_empty(), "{name}: core {i} is empty");
        assert!(
            core.cpus.is_disjoint(&in_cores),
            "{name}: core {} overlaps another",
            core.cpus
        );
        in_cores = in_cores.union(&core.cpus);
        for cpu in &core.cpus {
            let c = &t.cpus[&cpu];
            assert_eq!(c.core, i, "{name}: cpu {cpu} core index");
            assert_eq!(c.package, core.package, "{name}: cpu {cpu} package");
            assert_eq!(c.numa_node, core.numa_node, "{name}: cpu {cpu} node");
        }
    }
    assert_eq!(
        in_cores, online,
        "{name}: cores do not cover the online CPUs"
    );
    let mut in_nodes = CpuSet::new();
    for node in t.numa_nodes.values() {
        assert!(
            node.cpus.is_disjoint(&in_nodes),
            "{name}: node {} overlaps another",
            node.id
        );
        in_nodes = in_nodes.union(&node.cpus);
        for cpu in &node.cpus {
            assert_eq!(t.cpus[&cpu].numa_node, node.id, "{name}: cpu {cpu}");
        }
    }
    assert_eq!(
        in_nodes, online,
        "{name}: nodes do not cover the online CPUs"
    );
}

#[test]
fn vm_2cpu() {
    let t = read_fixture("vm-2cpu");
    assert_partitions("vm-2cpu", &t);
    assert_eq!(t.online(), set("0-1"));
    assert_eq!(t.cores.len(), 2);
    assert!(!t.has_smt());
    assert_eq!(t.siblings(0), Some(&set("0")));
    assert_eq!(t.numa_nodes.len(), 1);
    assert!(t.gpus.is_empty(), "virtio devices are not GPUs");
}

#[test]
fn server_2s_64cpu_8gpu() {
    let t = read_fixture("server-2s-64cpu-8gpu");
    assert_partitions("server-2s-64cpu-8gpu", &t);
    assert_eq!(t.cpus.len(), 64);
    assert_eq!(t.cores.len(), 32);
    assert!(t.has_smt());
    assert_eq!(t.siblings(0), Some(&set("0,32")));
    assert_eq!(t.siblings(63), Some(&set("31,63")));
    assert_eq!(t.numa_nodes[&1].cpus, set("16-31,48-63"));
    let packages: BTreeSet<u32> = t.cpus.values().map(|c| c.package).collect();
    assert_eq!(packages.len(), 2);

    // The BMC's VGA, the NICs and the NVSwitch are not GPUs; indices follow PCI order.
    let addrs: Vec<&str> = t.gpus.iter().map(|g| g.pci_address.as_str()).collect();
    assert_eq!(
        addrs,
        [
            "0000:18:00.0",
            "0000:19:00.0",
            "0000:3b:00.0",
            "0000:3c:00.0",
            "0000:86:00.0",
            "0000:87:00.0",
            "0000:af:00.0",
            "0000:b0:00.0"
        ]
    );
    for g in &t.gpus {
        let node = if g.index < 4 { 0 } else { 1 };
        assert_eq!(g.numa_node, Some(node), "GPU {}", g.index);
        assert_eq!(g.local_cpus, t.numa_nodes[&node].cpus, "GPU {}", g.index);
    }
    assert_eq!(t.numa_nodes_of(&set("1,17")), set("0-1"));

    // The generated tree is the shape `synthetic` describes.
    let mut synthetic = Topology::synthetic(2, 1, 16, 2, 4);
    for (s, r) in synthetic.gpus.iter_mut().zip(&t.gpus) {
        s.pci_address = r.pci_address.clone();
    }
    assert_eq!(synthetic, t);
}

#[test]
fn server_1s_32cpu_2gpu() {
    let t = read_fixture("server-1s-32cpu-2gpu");
    assert_partitions("server-1s-32cpu-2gpu", &t);
    assert_eq!(t.cpus.len(), 32);
    assert_eq!(t.cores.len(), 32);
    assert!(!t.has_smt());
    assert_eq!(t.numa_nodes.len(), 1);
    assert_eq!(t.gpus.len(), 2, "HDMI audio functions are not GPUs");
    assert_eq!(t.gpu(1).unwrap().pci_address, "0000:21:00.0");
    assert!(t.gpus.iter().all(|g| g.numa_node.is_none()));
    assert!(t.gpus.iter().all(|g| g.local_cpus == set("0-31")));
}

/// The scale benchmark's shape (benches/tick.rs): 2 sockets x 48 cores x 2 threads, 8 GPUs.
#[test]
fn server_2s_192cpu_8gpu() {
    let t = read_fixture("server-2s-192cpu-8gpu");
    assert_partitions("server-2s-192cpu-8gpu", &t);
    assert_eq!(t.cpus.len(), 192);
    assert_eq!(t.cores.len(), 96);
    assert!(t.has_smt());
    assert_eq!(t.gpus.len(), 8);
    assert_eq!(t.numa_nodes_of(&set("0,48")), set("0-1"));
    let mut synthetic = Topology::synthetic(2, 1, 48, 2, 4);
    for (s, r) in synthetic.gpus.iter_mut().zip(&t.gpus) {
        s.pci_address = r.pci_address.clone();
    }
    assert_eq!(synthetic, t);
}

#[test]
fn generate_sh_reproduces_the_fixtures() {
    const TEST: &str = "generate_sh_reproduces_the_fixtures";
    let out = TempDir::new().unwrap();
    let script = fixture("generate.sh");
    let status = match Command::new("bash").arg(&script).arg(out.path()).output() {
        Ok(o) => o,
        Err(e) => return skip(TEST, &format!("cannot run bash: {e}")),
    };
    assert!(
        status.status.success(),
        "generate.sh failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    for name in [
        "vm-2cpu",
        "server-2s-64cpu-8gpu",
        "server-1s-32cpu-2gpu",
        "server-2s-192cpu-8gpu",
    ] {
        let fresh = Topology::read(&out.path().join(name)).unwrap();
        assert_eq!(
            fresh,
            read_fixture(name),
            "{name}: committed fixture differs from generate.sh"
        );
        assert_eq!(
            list_files(&out.path().join(name)),
            list_files(&fixture(name)),
            "{name}: file lists differ"
        );
    }
}

/// Relative paths and contents of every file under `root` (following symlinks).
fn list_files(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                out.push((rel, format!("-> {}", target.display())));
            } else if meta.is_dir() {
                stack.push(path);
            } else {
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn this_host() {
    let root = Path::new(DEFAULT_SYSFS);
    if !root.join("devices/system/cpu/online").exists() {
        return skip(
            "this_host",
            "no /sys/devices/system/cpu/online (not Linux?)",
        );
    }
    let t = Topology::read(root).unwrap();
    assert_partitions("this host", &t);
    assert!(!t.cpus.is_empty());
}

/// Unpacks one recorded tree and returns the directory to read as `/sys`, or None (after a
/// printed skip) when tar cannot unpack it. The trees are fixtures: when they are missing
/// (`$LODGER_FIXTURES/sysfs`, by default `../shared/fixtures/sysfs`) the test fails.
fn real_tree(test: &str, archive: &str, name: &str) -> Option<(TempDir, PathBuf)> {
    let shared = lodger::privileged::fixture("sysfs");
    let tmp = TempDir::new().unwrap();
    let output = Command::new("tar")
        .arg("xjf")
        .arg(shared.join(archive))
        .arg("-C")
        .arg(tmp.path())
        .arg(format!("sysfs/{name}"))
        .output();
    match output {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            skip(
                test,
                &format!(
                    "tar could not unpack {archive} (is bzip2 installed?): {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ),
            );
            return None;
        }
        Err(e) => {
            skip(test, &format!("cannot run tar: {e}"));
            return None;
        }
    }
    let root = tmp.path().join("sysfs").join(name).join("sys");
    Some((tmp, root))
}

struct RealShape {
    archive: &'static str,
    name: &'static str,
    cpus: usize,
    nodes: usize,
    cpu_nodes: usize,
    packages: usize,
    cpu0_siblings: &'static str,
}

fn check_real(test: &str, shape: RealShape) -> Option<Topology> {
    let (_tmp, root) = real_tree(test, shape.archive, shape.name)?;
    let t = Topology::read(&root).unwrap_or_else(|e| panic!("{}: {e}", shape.name));
    let name = shape.name;
    assert_partitions(name, &t);
    assert_eq!(t.cpus.len(), shape.cpus, "{name}: CPUs");
    assert_eq!(t.numa_nodes.len(), shape.nodes, "{name}: NUMA nodes");
    let with_cpus = t.numa_nodes.values().filter(|n| !n.cpus.is_empty()).count();
    assert_eq!(with_cpus, shape.cpu_nodes, "{name}: nodes with CPUs");
    let packages: BTreeSet<u32> = t.cpus.values().map(|c| c.package).collect();
    assert_eq!(packages.len(), shape.packages, "{name}: packages");
    assert_eq!(
        t.siblings(0),
        Some(&set(shape.cpu0_siblings)),
        "{name}: cpu0 siblings"
    );
    assert_eq!(t.cores.len(), shape.cpus / 2, "{name}: 2 threads per core");
    assert!(t.gpus.is_empty(), "{name}: the recorded trees have no PCI");
    Some(t)
}

#[test]
fn real_desktop() {
    check_real(
        "real_desktop",
        RealShape {
            archive: "real-machines-a.tar.bz2",
            name: "desktop",
            cpus: 20,
            nodes: 1,
            cpu_nodes: 1,
            packages: 1,
            cpu0_siblings: "0,10",
        },
    );
}

#[test]
fn real_server_with_memory_only_nodes() {
    let Some(t) = check_real(
        "real_server_with_memory_only_nodes",
        RealShape {
            archive: "real-machines-a.tar.bz2",
            name: "server",
            cpus: 112,
            nodes: 6,
            cpu_nodes: 4,
            packages: 2,
            cpu0_siblings: "0,56",
        },
    ) else {
        return;
    };
    let mut t = t;
    assert!(t.numa_nodes[&4].cpus.is_empty());
    assert!(
        t.override_gpu(0, 4).is_err(),
        "a memory-only node cannot be a GPU's CPU side"
    );

    // Nodes interleave CPU ids (node 0 is 0,4,8,...): a job still gets sibling pairs of its
    // GPU's node, next to each other in that node's order.
    t.override_gpu(0, 2).unwrap();
    let got = place(
        &t,
        &CpuSet::new(),
        &CpuSet::new(),
        &TrainingAsk {
            cores: 4,
            gpus: &[0],
        },
    )
    .unwrap();
    assert_eq!(got, set("2,6,58,62"));
    assert_eq!(t.numa_nodes_of(&got), set("2"));
}

#[test]
fn real_4_socket_server() {
    let Some(mut t) = check_real(
        "real_4_socket_server",
        RealShape {
            archive: "real-machines-a.tar.bz2",
            name: "4-socket-server-nosnc",
            cpus: 144,
            nodes: 4,
            cpu_nodes: 4,
            packages: 4,
            cpu0_siblings: "0,72",
        },
    ) else {
        return;
    };
    for gpu in 0..4 {
        t.override_gpu(gpu, gpu).unwrap();
    }
    let jobs: Vec<TrainingJobView> = (0..4)
        .map(|g| TrainingJobView {
            id: JobId::from_seq(u64::from(g) + 1),
            cores: 10,
            gpus: vec![g],
            within: None,
        })
        .collect();
    let plan = decide(&t, &set("0,72"), &jobs, &Plan::default());
    assert!(plan.unplaced.is_empty());
    for (i, job) in jobs.iter().enumerate() {
        let p = &plan.training[&job.id];
        assert_eq!(p.mems, set(&i.to_string()), "job on GPU {i}");
        // Five whole cores.
        for cpu in &p.cpus {
            assert!(t.siblings(cpu).unwrap().is_subset(&p.cpus));
        }
    }
    assert_eq!(plan.training[&JobId::from_seq(1)].cpus, set("1-5,73-77"));
}

#[test]
fn real_sub_numa_clustering_spills_within_the_package() {
    let Some(mut t) = check_real(
        "real_sub_numa_clustering_spills_within_the_package",
        RealShape {
            archive: "real-machines-b.tar.bz2",
            name: "2-socket-4-node-40-core",
            cpus: 80,
            nodes: 4,
            cpu_nodes: 4,
            packages: 2,
            cpu0_siblings: "0,40",
        },
    ) else {
        return;
    };
    t.override_gpu(0, 0).unwrap();
    // Node 0 has 20 CPUs; 28 wanted: the other 8 come from node 1, the same package, not from
    // node 2 or 3 on the other socket.
    let got = place(
        &t,
        &CpuSet::new(),
        &CpuSet::new(),
        &TrainingAsk {
            cores: 28,
            gpus: &[0],
        },
    )
    .unwrap();
    assert!(t.numa_nodes[&0].cpus.is_subset(&got));
    assert_eq!(t.numa_nodes_of(&got), set("0-1"));
    for cpu in &got {
        assert!(t.siblings(cpu).unwrap().is_subset(&got), "cpu {cpu}");
    }
}

#[test]
fn fixture_placements() {
    let t = read_fixture("server-2s-64cpu-8gpu");
    let reserved = set("0,32");
    let jobs = vec![
        TrainingJobView {
            id: JobId::from_seq(1),
            cores: 8,
            gpus: vec![4, 5, 6, 7],
            within: None,
        },
        TrainingJobView {
            id: JobId::from_seq(2),
            cores: 8,
            gpus: vec![4, 5, 6, 7],
            within: None,
        },
        TrainingJobView {
            id: JobId::from_seq(3),
            cores: 6,
            gpus: vec![0, 1],
            within: None,
        },
    ];
    let plan = decide(&t, &reserved, &jobs, &Plan::default());
    let cpus = |seq| plan.training[&JobId::from_seq(seq)].cpus.to_string();
    assert_eq!(cpus(1), "16-19,48-51");
    assert_eq!(cpus(2), "20-23,52-55");
    assert_eq!(cpus(3), "1-3,33-35");

    // GPUs of unknown locality express no preference: the job packs next to the reserved CPU.
    let t = read_fixture("server-1s-32cpu-2gpu");
    let got = place(
        &t,
        &set("0"),
        &CpuSet::new(),
        &TrainingAsk {
            cores: 4,
            gpus: &[0, 1],
        },
    )
    .unwrap();
    assert_eq!(got, set("1-4"));
}
