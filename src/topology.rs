//! The node's CPUs, SMT siblings, cores, NUMA nodes and GPUs, read from a sysfs root (injectable,
//! so fixtures and recorded machines can stand in for `/sys`). May touch: sysfs, read-only.
//!
//! Read once at start (and again on CPU hotplug). Everything the placement policy needs about the
//! machine's shape comes from here; nothing else reads these files.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::cpuset::CpuSet;

/// Where sysfs is mounted on a real host. Used only at the top (the daemon's start-up).
pub const DEFAULT_SYSFS: &str = "/sys";

const CPU_DIR: &str = "devices/system/cpu";
const CPU_ONLINE: &str = "devices/system/cpu/online";
/// The CPUs the kernel keeps out of load balancing (`isolcpus=` on the boot line); absent on
/// kernels before 4.x, empty when none are.
const CPU_ISOLATED: &str = "devices/system/cpu/isolated";
const NODE_DIR: &str = "devices/system/node";
const PCI_DEVICES: &str = "bus/pci/devices";
/// Newer kernels (5.x+) name the SMT sibling list `core_cpus_list`; `thread_siblings_list` is the
/// older name, still present everywhere.
const CORE_CPUS_LIST: &str = "core_cpus_list";
const THREAD_SIBLINGS_LIST: &str = "thread_siblings_list";
const CORE_ID: &str = "core_id";
const PHYSICAL_PACKAGE_ID: &str = "physical_package_id";
const NODE_CPULIST: &str = "cpulist";
const PCI_VENDOR: &str = "vendor";
const PCI_CLASS: &str = "class";
const PCI_NUMA_NODE: &str = "numa_node";
const PCI_LOCAL_CPULIST: &str = "local_cpulist";
/// A symlink to the driver bound to the device (`bus/pci/drivers/<name>`); absent when none is.
const PCI_DRIVER: &str = "driver";
/// The driver that makes a GPU NVML's (and `nvidia-smi`'s, and CUDA's).
const NVIDIA_DRIVER: &str = "nvidia";

const NVIDIA_VENDOR: u32 = 0x10de;
/// PCI class codes (base class, sub-class) of a GPU: VGA-compatible controller (0x0300, most
/// consumer and workstation boards) and 3D controller (0x0302, data-centre boards such as A100).
const GPU_CLASSES: [u32; 2] = [0x0300, 0x0302];

/// The machine's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Online CPUs by id.
    pub cpus: BTreeMap<u32, Cpu>,
    /// Physical cores, ordered by their lowest CPU id.
    pub cores: Vec<Core>,
    /// NUMA nodes by id, including memory-only nodes (with no CPUs).
    pub numa_nodes: BTreeMap<u32, NumaNode>,
    /// NVIDIA GPUs, ordered by index.
    pub gpus: Vec<Gpu>,
    /// Online CPUs the kernel does not load-balance (`isolcpus=`): a process allowed several of
    /// them runs every thread on one, so lodger places no job there (as on reserved CPUs).
    pub isolated: CpuSet,
}

/// One online logical CPU (a hardware thread).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cpu {
    pub id: u32,
    /// Index into `Topology::cores`.
    pub core: usize,
    pub package: u32,
    pub numa_node: u32,
}

/// One physical core: the online SMT siblings that share it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Core {
    pub package: u32,
    pub numa_node: u32,
    /// All online SMT siblings, this core's CPUs.
    pub cpus: CpuSet,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    pub id: u32,
    /// Online CPUs of the node; empty for memory-only nodes (CXL, HBM, some SNC layouts).
    pub cpus: CpuSet,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Position in PCI bus order among the GPUs the host can use (see [`Topology::read`]): the
    /// index NVML and `nvidia-smi` use with `CUDA_DEVICE_ORDER=PCI_BUS_ID`.
    pub index: u32,
    /// `domain:bus:device.function`, e.g. `0000:18:00.0`; empty for a GPU declared only by
    /// configuration (`override_gpu`) and not found on the PCI bus.
    pub pci_address: String,
    /// None when the firmware does not say (`numa_node` is -1: VMs, single-node hosts).
    pub numa_node: Option<u32>,
    /// Online CPUs the kernel reports as local to the device.
    pub local_cpus: CpuSet,
}

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: '{value}' {reason}")]
    Parse {
        path: PathBuf,
        value: String,
        reason: String,
    },
    #[error("{path} lists no online CPUs")]
    NoCpus { path: PathBuf },
    /// Files that each parse but disagree with one another (sibling lists that differ between
    /// siblings, a CPU in two NUMA nodes or in none).
    #[error("{path}: {reason}")]
    Inconsistent { path: PathBuf, reason: String },
    #[error("cannot declare GPU {index} local to NUMA node {numa_node}: {reason}")]
    BadGpuOverride {
        index: u32,
        numa_node: u32,
        reason: String,
    },
}

impl Topology {
    /// Reads the topology from `sysfs_root`, the directory mounted at `/sys` (or a fixture tree
    /// of the same layout). A GPU is an NVIDIA display or 3D controller on the PCI bus that is
    /// bound to the `nvidia` driver, or to none yet (a host booting, or without the driver): one
    /// bound to another driver (`vfio-pci`, passed through to a VM; `nouveau`) is not this host's
    /// to use, NVML does not count it, and counting it would shift every later GPU's index.
    pub fn read(sysfs_root: &Path) -> Result<Topology, TopologyError> {
        let online_path = sysfs_root.join(CPU_ONLINE);
        let online = read_cpulist(&online_path)?;
        if online.is_empty() {
            return Err(TopologyError::NoCpus { path: online_path });
        }

        let mut cpu_info: BTreeMap<u32, CpuRecord> = BTreeMap::new();
        for cpu in &online {
            cpu_info.insert(cpu, read_cpu(sysfs_root, cpu, &online)?);
        }
        let numa_nodes = read_numa_nodes(sysfs_root, &online)?;
        let node_of = node_of_cpu(sysfs_root, &numa_nodes, &online)?;

        // Cores are identified by their sibling set. Every sibling must report the same set, else
        // the files are inconsistent and placement by whole cores would be wrong.
        let mut owner: BTreeMap<u32, &CpuSet> = BTreeMap::new();
        for (&cpu, rec) in &cpu_info {
            for sib in &rec.siblings {
                match owner.insert(sib, &rec.siblings) {
                    Some(prev) if prev != &rec.siblings => {
                        return Err(TopologyError::Inconsistent {
                            path: rec.siblings_path.clone(),
                            reason: format!(
                                "cpu {cpu} lists siblings {} but cpu {sib} belongs to {prev}",
                                rec.siblings
                            ),
                        });
                    }
                    _ => {}
                }
            }
        }
        // The sets are disjoint and non-empty, so their order is the order of their lowest CPU.
        let core_sets: BTreeSet<&CpuSet> = owner.values().copied().collect();

        let mut cores: Vec<Core> = Vec::with_capacity(core_sets.len());
        let mut cpus = BTreeMap::new();
        for set in core_sets {
            let Some(first) = set.first() else { continue };
            let (package, numa_node) = (cpu_info[&first].package, node_of[&first]);
            for sib in set {
                let rec = &cpu_info[&sib];
                if rec.package != package {
                    return Err(TopologyError::Inconsistent {
                        path: rec.package_path.clone(),
                        reason: format!(
                            "cpu {sib} is in package {} but its sibling cpu {first} is in \
                             package {package}",
                            rec.package
                        ),
                    });
                }
                if node_of[&sib] != numa_node {
                    return Err(TopologyError::Inconsistent {
                        path: sysfs_root.join(NODE_DIR),
                        reason: format!("SMT siblings {set} are split across NUMA nodes"),
                    });
                }
                cpus.insert(
                    sib,
                    Cpu {
                        id: sib,
                        core: cores.len(),
                        package,
                        numa_node,
                    },
                );
            }
            cores.push(Core {
                package,
                numa_node,
                cpus: set.clone(),
            });
        }

        let gpus = read_gpus(sysfs_root, &online)?;
        let isolated = read_optional_cpulist(&sysfs_root.join(CPU_ISOLATED))?
            .unwrap_or_default()
            .intersection(&online);
        Ok(Topology {
            cpus,
            cores,
            numa_nodes,
            gpus,
            isolated,
        })
    }

    /// The online CPUs.
    pub fn online(&self) -> CpuSet {
        self.cpus.keys().copied().collect()
    }

    /// The SMT siblings of `cpu` (including itself), or None for an unknown or offline CPU.
    pub fn siblings(&self, cpu: u32) -> Option<&CpuSet> {
        let c = self.cpus.get(&cpu)?;
        self.cores.get(c.core).map(|core| &core.cpus)
    }

    /// The NUMA node ids of these CPUs (unknown CPUs are ignored), for `cpuset.mems`.
    pub fn numa_nodes_of(&self, cpus: &CpuSet) -> CpuSet {
        cpus.iter()
            .filter_map(|cpu| self.cpus.get(&cpu).map(|c| c.numa_node))
            .collect()
    }

    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// The most online threads any core has: 2 on most SMT hosts, 1 without SMT (or no core).
    pub fn threads_per_core(&self) -> u32 {
        let most = self.cores.iter().map(|c| c.cpus.len()).max().unwrap_or(1);
        u32::try_from(most).unwrap_or(1).max(1)
    }

    /// True when some core has more than one online thread.
    pub fn has_smt(&self) -> bool {
        self.cores.iter().any(|c| c.cpus.len() > 1)
    }

    /// Config override for hosts where sysfs cannot tell GPU locality (VMs, odd firmware):
    /// declare GPU `index` local to `numa_node` (local_cpus = that node's CPUs); adds the GPU if
    /// absent.
    pub fn override_gpu(&mut self, index: u32, numa_node: u32) -> Result<(), TopologyError> {
        let bad = |reason: String| TopologyError::BadGpuOverride {
            index,
            numa_node,
            reason,
        };
        let node = self.numa_nodes.get(&numa_node).ok_or_else(|| {
            let known: CpuSet = self.numa_nodes.keys().copied().collect();
            bad(format!("this host's NUMA nodes are {known}"))
        })?;
        if node.cpus.is_empty() {
            return Err(bad("that node has no CPUs (memory-only)".to_string()));
        }
        let local_cpus = node.cpus.clone();
        match self.gpus.iter_mut().find(|g| g.index == index) {
            Some(gpu) => {
                gpu.numa_node = Some(numa_node);
                gpu.local_cpus = local_cpus;
            }
            None => {
                self.gpus.push(Gpu {
                    index,
                    pci_address: String::new(),
                    numa_node: Some(numa_node),
                    local_cpus,
                });
                self.gpus.sort_by_key(|g| g.index);
            }
        }
        Ok(())
    }

    /// Synthetic shapes for tests and the simulator: `sockets` × `nodes_per_socket` NUMA nodes,
    /// each with `cores_per_node` cores of `threads` SMT threads, CPU numbering like Linux on
    /// Intel (all first threads first, then siblings: cpu i and i+ncores are siblings), and
    /// `gpus_per_node` GPUs per NUMA node.
    pub fn synthetic(
        sockets: u32,
        nodes_per_socket: u32,
        cores_per_node: u32,
        threads: u32,
        gpus_per_node: u32,
    ) -> Topology {
        let nnodes = sockets * nodes_per_socket;
        let ncores = nnodes * cores_per_node;
        let mut cpus = BTreeMap::new();
        let mut cores = Vec::new();
        let mut numa_nodes = BTreeMap::new();
        let mut gpus = Vec::new();
        for node in 0..nnodes {
            let package = node / nodes_per_socket;
            let mut node_cpus = CpuSet::new();
            for k in 0..cores_per_node {
                let core_no = node * cores_per_node + k;
                let core_cpus: CpuSet = (0..threads).map(|t| core_no + t * ncores).collect();
                let index = cores.len();
                for id in &core_cpus {
                    cpus.insert(
                        id,
                        Cpu {
                            id,
                            core: index,
                            package,
                            numa_node: node,
                        },
                    );
                }
                node_cpus = node_cpus.union(&core_cpus);
                cores.push(Core {
                    package,
                    numa_node: node,
                    cpus: core_cpus,
                });
            }
            for _ in 0..gpus_per_node {
                // Bus numbers rise with the index so PCI order and index order agree.
                let index = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
                let bus = index + 1;
                gpus.push(Gpu {
                    index,
                    pci_address: format!("{:04x}:{:02x}:00.0", bus / 256, bus % 256),
                    numa_node: Some(node),
                    local_cpus: node_cpus.clone(),
                });
            }
            numa_nodes.insert(
                node,
                NumaNode {
                    id: node,
                    cpus: node_cpus,
                },
            );
        }
        Topology {
            cpus,
            cores,
            numa_nodes,
            gpus,
            isolated: CpuSet::new(),
        }
    }
}

/// What one CPU's `topology/` directory says.
struct CpuRecord {
    package: u32,
    siblings: CpuSet,
    siblings_path: PathBuf,
    package_path: PathBuf,
}

fn read_cpu(root: &Path, cpu: u32, online: &CpuSet) -> Result<CpuRecord, TopologyError> {
    let dir = root
        .join(CPU_DIR)
        .join(format!("cpu{cpu}"))
        .join("topology");
    let package_path = dir.join(PHYSICAL_PACKAGE_ID);
    // Some platforms (s390, a few ARM and VM firmwares) report -1: no package information,
    // which for placement is the same as one package.
    let package = match read_i64(&package_path)? {
        -1 => 0,
        v => u32::try_from(v).map_err(|_| TopologyError::Parse {
            path: package_path.clone(),
            value: v.to_string(),
            reason: "is not a package id".to_string(),
        })?,
    };

    let mut siblings_path = dir.join(CORE_CPUS_LIST);
    let mut siblings = read_optional_cpulist(&siblings_path)?;
    if siblings.is_none() {
        siblings_path = dir.join(THREAD_SIBLINGS_LIST);
        siblings = read_optional_cpulist(&siblings_path)?;
    }
    let siblings = match siblings {
        Some(set) => set,
        None => siblings_from_core_id(root, cpu, online, &siblings_path)?,
    };
    if !siblings.contains(cpu) {
        return Err(TopologyError::Parse {
            path: siblings_path,
            value: siblings.to_string(),
            reason: format!("does not contain cpu {cpu} itself"),
        });
    }
    // Offline siblings cannot be placed on; a core is what is online of it.
    let siblings = siblings.intersection(online);
    Ok(CpuRecord {
        package,
        siblings,
        siblings_path,
        package_path,
    })
}

/// Fallback for kernels or platforms that give no sibling list: CPUs of the same package with the
/// same `core_id` are siblings. If `core_id` is missing too, the error names the classic
/// sibling list, the file every Linux since 2.6 has.
fn siblings_from_core_id(
    root: &Path,
    cpu: u32,
    online: &CpuSet,
    siblings_path: &Path,
) -> Result<CpuSet, TopologyError> {
    let core_id_of = |c: u32| -> Result<Option<(i64, i64)>, TopologyError> {
        let dir = root.join(CPU_DIR).join(format!("cpu{c}")).join("topology");
        let core_path = dir.join(CORE_ID);
        if !core_path.exists() {
            return Ok(None);
        }
        Ok(Some((
            read_i64(&dir.join(PHYSICAL_PACKAGE_ID))?,
            read_i64(&core_path)?,
        )))
    };
    let Some(mine) = core_id_of(cpu)? else {
        return Err(TopologyError::Io {
            path: siblings_path.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::NotFound,
                "no core_cpus_list, thread_siblings_list or core_id",
            ),
        });
    };
    let mut set = CpuSet::new();
    for other in online {
        if core_id_of(other)? == Some(mine) {
            set.insert(other);
        }
    }
    Ok(set)
}

/// The NUMA node of each online CPU; each must be in exactly one node.
fn node_of_cpu(
    root: &Path,
    nodes: &BTreeMap<u32, NumaNode>,
    online: &CpuSet,
) -> Result<BTreeMap<u32, u32>, TopologyError> {
    let mut of_cpu = BTreeMap::new();
    for node in nodes.values() {
        for cpu in &node.cpus {
            if let Some(other) = of_cpu.insert(cpu, node.id) {
                return Err(TopologyError::Inconsistent {
                    path: root.join(NODE_DIR),
                    reason: format!("cpu {cpu} is listed in node{other} and node{}", node.id),
                });
            }
        }
    }
    if let Some(missing) = online.iter().find(|c| !of_cpu.contains_key(c)) {
        return Err(TopologyError::Inconsistent {
            path: root.join(NODE_DIR),
            reason: format!("online cpu {missing} is in no node's cpulist"),
        });
    }
    Ok(of_cpu)
}

/// NUMA nodes and their online CPUs. A kernel without NUMA support has no `node` directory:
/// then all CPUs are node 0.
fn read_numa_nodes(root: &Path, online: &CpuSet) -> Result<BTreeMap<u32, NumaNode>, TopologyError> {
    let dir = root.join(NODE_DIR);
    let mut nodes = BTreeMap::new();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            nodes.insert(
                0,
                NumaNode {
                    id: 0,
                    cpus: online.clone(),
                },
            );
            return Ok(nodes);
        }
        Err(source) => return Err(TopologyError::Io { path: dir, source }),
    };
    for entry in entries {
        let entry = entry.map_err(|source| TopologyError::Io {
            path: dir.clone(),
            source,
        })?;
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue; // has_cpu, online, possible, power, uevent, ...
        };
        let cpus = read_cpulist(&entry.path().join(NODE_CPULIST))?.intersection(online);
        nodes.insert(id, NumaNode { id, cpus });
    }
    if nodes.is_empty() {
        return Err(TopologyError::Inconsistent {
            path: dir,
            reason: "exists but holds no node<N> directories".to_string(),
        });
    }
    Ok(nodes)
}

/// NVIDIA GPUs on the PCI bus, indexed in PCI address order. A tree without `bus/pci` has none.
fn read_gpus(root: &Path, online: &CpuSet) -> Result<Vec<Gpu>, TopologyError> {
    let dir = root.join(PCI_DEVICES);
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(TopologyError::Io { path: dir, source }),
    };
    let mut addresses = BTreeSet::new();
    for entry in entries {
        let entry = entry.map_err(|source| TopologyError::Io {
            path: dir.clone(),
            source,
        })?;
        addresses.insert(entry.file_name().to_string_lossy().into_owned());
    }
    // Addresses are fixed-width lowercase hex (`dddd:bb:dd.f`), so string order is bus order.
    let mut gpus = Vec::new();
    for address in addresses {
        let dev = dir.join(&address);
        if read_hex(&dev.join(PCI_VENDOR))? != NVIDIA_VENDOR {
            continue;
        }
        // `class` is 0xBBSSPP (base class, sub-class, programming interface).
        if !GPU_CLASSES.contains(&(read_hex(&dev.join(PCI_CLASS))? >> 8)) {
            continue; // audio function, NVSwitch, USB-C controller of the same board
        }
        if bound_elsewhere(&dev) {
            continue;
        }
        let node_path = dev.join(PCI_NUMA_NODE);
        let numa_node = if node_path.exists() {
            match read_i64(&node_path)? {
                v if v < 0 => None,
                v => Some(u32::try_from(v).map_err(|_| TopologyError::Parse {
                    path: node_path.clone(),
                    value: v.to_string(),
                    reason: "is not a NUMA node id".to_string(),
                })?),
            }
        } else {
            None
        };
        // With numa_node -1 the kernel reports every possible CPU as local; keep what is online.
        let local_cpus = read_cpulist(&dev.join(PCI_LOCAL_CPULIST))?.intersection(online);
        let index = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
        gpus.push(Gpu {
            index,
            pci_address: address,
            numa_node,
            local_cpus,
        });
    }
    Ok(gpus)
}

/// Whether the PCI device at `dev` is bound to a driver other than `nvidia`.
fn bound_elsewhere(dev: &Path) -> bool {
    fs::read_link(dev.join(PCI_DRIVER))
        .ok()
        .and_then(|target| target.file_name().map(|n| n != NVIDIA_DRIVER))
        .unwrap_or(false)
}

fn read_string(path: &Path) -> Result<String, TopologyError> {
    fs::read_to_string(path).map_err(|source| TopologyError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_cpulist(path: &Path) -> Result<CpuSet, TopologyError> {
    let text = read_string(path)?;
    CpuSet::parse(&text).map_err(|e| TopologyError::Parse {
        path: path.to_path_buf(),
        value: text.trim().to_string(),
        reason: format!("is not a cpu list ({e})"),
    })
}

/// Like `read_cpulist`, but a missing file is `None` (for files that newer kernels renamed).
fn read_optional_cpulist(path: &Path) -> Result<Option<CpuSet>, TopologyError> {
    match fs::read_to_string(path) {
        Ok(text) => CpuSet::parse(&text)
            .map(Some)
            .map_err(|e| TopologyError::Parse {
                path: path.to_path_buf(),
                value: text.trim().to_string(),
                reason: format!("is not a cpu list ({e})"),
            }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TopologyError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn read_i64(path: &Path) -> Result<i64, TopologyError> {
    let text = read_string(path)?;
    let value = text.trim();
    value.parse().map_err(|_| TopologyError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        reason: "is not an integer".to_string(),
    })
}

/// Reads a `0x`-prefixed hexadecimal value such as a PCI `vendor` (`0x10de`) or `class`.
fn read_hex(path: &Path) -> Result<u32, TopologyError> {
    let text = read_string(path)?;
    let value = text.trim();
    value
        .strip_prefix("0x")
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| TopologyError::Parse {
            path: path.to_path_buf(),
            value: value.to_string(),
            reason: "is not a hexadecimal number such as 0x10de".to_string(),
        })
}

#[cfg(test)]
mod tests;
