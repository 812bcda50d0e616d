//! Which containers become jobs, and as what (docs/kubernetes.md): the `lodger.dev/kind`
//! annotation (for one container, `lodger.dev/kind.<container>`, on the pod or the container),
//! else the GPUs the container was given, else nothing; and the job's spec, owner and cgroup
//! from what the runtime says of the container. Pure: reads only the messages it is handed.

use super::proto::{Container, PodSandbox};
use crate::config::{GpuContainers, KubernetesConfig};
use crate::job::{ContainerJob, JobKind, JobSpec, Target};

/// The annotation naming a job's kind: `training`, `online`, `offline`, `batch`, or `none` (left
/// alone).
pub const KIND: &str = "lodger.dev/kind";
/// The annotation giving the logical CPUs a container asks for (else its CPU limit or request).
pub const CORES: &str = "lodger.dev/cores";

/// A container lodger takes on: the job to register, and for whom.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub spec: JobSpec,
    /// The container's user where the runtime says (NRI's `Container.user`); else root.
    pub owner: Option<u32>,
}

/// What becomes of `ctr` of `pod`: `Ok(None)` leaves it alone; `Err` says why an annotation
/// cannot be followed (the container is then left alone too, and the caller logs why).
pub fn decide(
    pod: &PodSandbox,
    ctr: &Container,
    config: &KubernetesConfig,
) -> Result<Option<Decision>, String> {
    let label = format!("{}/{}", pod_label(pod), ctr.name);
    let gpus = gpus(ctr);
    let kind = match annotation(pod, ctr, KIND) {
        Some(v) => match v.as_str() {
            "none" | "leave" => return Ok(None),
            "training" => JobKind::Training,
            "batch" => JobKind::Batch,
            // The pod is the instance: placed by the inference policy, nothing started.
            "online" => JobKind::Online,
            "offline" => JobKind::Offline,
            other => {
                return Err(format!(
                    "{label}: {KIND}={other:?} is not a kind (training, online, offline, batch \
                     or none); the container is left alone"
                ))
            }
        },
        // A privileged container's GPUs are the host's, not a request (lodgerd's own
        // DaemonSet pod, a node agent): only an annotation makes it a job.
        None if gpus.is_some()
            && !host_devices(ctr)
            && config.gpu_containers == GpuContainers::Training =>
        {
            JobKind::Training
        }
        None => return Ok(None),
    };
    let cgroup = cgroup_path(
        ctr.linux
            .as_ref()
            .map(|l| l.cgroups_path.as_str())
            .unwrap_or_default(),
    )
    .ok_or_else(|| {
        format!("{label}: the runtime gave no usable cgroup path; the container is left alone")
    })?;
    let cores = match annotation(pod, ctr, CORES) {
        Some(v) => v
            .parse::<u32>()
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| format!("{label}: {CORES}={v:?} is not a CPU count of 1 or more"))?,
        None => asked_cpus(ctr).unwrap_or(match kind {
            // A batch or offline container with no limit takes whatever is left.
            JobKind::Batch | JobKind::Offline => 0,
            _ => 1,
        }),
    };
    let target = Target::Container(ContainerJob {
        id: ctr.id.clone(),
        pod: pod_label(pod),
        sandbox: (!pod.id.is_empty()).then(|| pod.id.clone()),
        name: ctr.name.clone(),
        cgroup,
    });
    let spec = JobSpec {
        gpus: match kind {
            JobKind::Training => gpus.unwrap_or_default(),
            _ => Vec::new(),
        },
        ..JobSpec::new(kind, target, cores)
    };
    spec.validate().map_err(|e| format!("{label}: {e}"))?;
    Ok(Some(Decision {
        spec,
        owner: ctr.user.as_ref().map(|u| u.uid),
    }))
}

/// A pod as lodger names it: `namespace/name`.
pub fn pod_label(pod: &PodSandbox) -> String {
    format!("{}/{}", pod.namespace, pod.name)
}

/// `key.<container>` or `key` on the container, then on the pod.
fn annotation(pod: &PodSandbox, ctr: &Container, key: &str) -> Option<String> {
    let own = format!("{key}.{}", ctr.name);
    [&ctr.annotations, &pod.annotations]
        .iter()
        .find_map(|a| a.get(&own).or_else(|| a.get(key)))
        .map(|v| v.trim().to_string())
}

/// Device nodes a container is given only with the host's whole device set, as a privileged
/// container is: the kernel log and the memory devices. Any one of them is enough (`/dev/mem`
/// is missing where the kernel has no devmem); no GPU workload asks for one.
const HOST_ONLY_DEVICES: &[&str] = &["/dev/kmsg", "/dev/mem", "/dev/kmem", "/dev/port"];

/// Whether the container was given the host's device set (it is privileged): then its GPU
/// device nodes are every GPU of the host, not ones it asked for.
pub fn host_devices(ctr: &Container) -> bool {
    ctr.linux.as_ref().is_some_and(|l| {
        l.devices
            .iter()
            .any(|d| HOST_ONLY_DEVICES.contains(&d.path.as_str()))
    })
}

/// The GPUs the container asked for, if any: by index where the runtime says which (an
/// `/dev/nvidiaN` device, a CDI `nvidia.com/gpu=N`, `NVIDIA_VISIBLE_DEVICES=0,1`), else an
/// empty list (by UUID). `None`: no GPU asked for. Not requests: `NVIDIA_VISIBLE_DEVICES=all`
/// (nvidia/cuda images set it for every container made from them), `void` or `none`, and the
/// device nodes of a container given the host's device set ([`host_devices`]).
pub fn gpus(ctr: &Container) -> Option<Vec<u32>> {
    let mut found = false;
    let mut indices = Vec::new();
    if let Some(linux) = ctr.linux.as_ref().filter(|_| !host_devices(ctr)) {
        for d in &linux.devices {
            if let Some(n) = d.path.strip_prefix("/dev/nvidia") {
                if let Ok(i) = n.parse::<u32>() {
                    found = true;
                    indices.push(i);
                }
            }
        }
    }
    for d in &ctr.CDI_devices {
        if let Some(v) = d.name.strip_prefix("nvidia.com/gpu=") {
            found = true;
            indices.extend(v.parse::<u32>().ok());
        }
    }
    for e in &ctr.env {
        if let Some(v) = e.strip_prefix("NVIDIA_VISIBLE_DEVICES=") {
            if !matches!(v.trim(), "" | "all" | "void" | "none") {
                found = true;
                indices.extend(v.split(',').filter_map(|s| s.trim().parse::<u32>().ok()));
            }
        }
    }
    indices.sort_unstable();
    indices.dedup();
    found.then_some(indices)
}

/// Logical CPUs from the container's CPU limit (quota / period), else its request (shares /
/// 1024), rounded up.
fn asked_cpus(ctr: &Container) -> Option<u32> {
    let cpu = ctr.linux.as_ref()?.resources.as_ref()?.cpu.as_ref()?;
    let quota = cpu.quota.as_ref().map(|q| q.value).filter(|&q| q > 0);
    let period = cpu.period.as_ref().map(|p| p.value).filter(|&p| p > 0);
    let cpus = match (quota, period) {
        (Some(q), Some(p)) => (q as u64).div_ceil(p),
        // Kubernetes gives 2 shares to a container that asks for nothing.
        _ => cpu
            .shares
            .as_ref()
            .map(|s| s.value)
            .filter(|&s| s > 2)?
            .div_ceil(1024),
    };
    u32::try_from(cpus).ok().filter(|&c| c > 0)
}

/// The container's cgroup relative to the hierarchy root, from the runtime's `cgroups_path`:
/// the cgroupfs driver's `/kubepods/besteffort/pod<uid>/<id>` as it is; the systemd driver's
/// `<slice>:<prefix>:<name>` expanded as systemd does (`a-b.slice` is `a.slice/a-b.slice`) to
/// `/<slices>/<prefix>-<name>.scope`. `None` for anything else.
pub fn cgroup_path(raw: &str) -> Option<String> {
    let path = match raw.split(':').collect::<Vec<_>>()[..] {
        [path] if path.starts_with('/') => path.to_string(),
        [slice, prefix, name] if !name.is_empty() => {
            format!("{}/{prefix}-{name}.scope", expand_slice(slice)?)
        }
        _ => return None,
    };
    let ok = path.len() > 1
        && !path
            .split('/')
            .skip(1)
            .any(|c| c.is_empty() || c == "." || c == "..")
        && !path.chars().any(char::is_control);
    ok.then_some(path)
}

/// `kubepods-besteffort-pod1.slice` → `/kubepods.slice/kubepods-besteffort.slice/
/// kubepods-besteffort-pod1.slice`; the empty slice or `-.slice` is the root.
fn expand_slice(slice: &str) -> Option<String> {
    if slice.is_empty() || slice == "-.slice" {
        return Some(String::new());
    }
    let stem = slice.strip_suffix(".slice")?;
    if stem.is_empty()
        || stem.contains('/')
        || stem.starts_with('-')
        || stem.ends_with('-')
        || stem.contains("--")
    {
        return None;
    }
    let mut out = String::new();
    let mut prefix = String::new();
    for part in stem.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        out.push('/');
        out.push_str(&prefix);
        out.push_str(".slice");
    }
    Some(out)
}

#[cfg(test)]
#[path = "pods_tests.rs"]
mod tests;
