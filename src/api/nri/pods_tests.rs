//! Which containers become which jobs, from the messages a runtime sends.

use super::*;
use crate::api::nri::plugin::{events, runtime_sets_sched};
use crate::api::nri::proto::{
    CDIDevice, LinuxCPU, LinuxContainer, LinuxDevice, LinuxResources, OptionalInt64,
    OptionalUInt64, User,
};

fn pod(annotations: &[(&str, &str)]) -> PodSandbox {
    let mut p = PodSandbox::new();
    p.id = "sandbox1".into();
    p.name = "trainer-0".into();
    p.namespace = "ml".into();
    p.annotations = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    p
}

fn container(name: &str, cgroups_path: &str) -> Container {
    let mut c = Container::new();
    c.id = format!("{name}-id");
    c.pod_sandbox_id = "sandbox1".into();
    c.name = name.into();
    let mut linux = LinuxContainer::new();
    linux.cgroups_path = cgroups_path.into();
    c.linux = Some(linux).into();
    c
}

const CGROUPFS: &str = "/kubepods/burstable/pod1234/abc";

fn with_cpu(mut c: Container, quota: i64, period: u64, shares: u64) -> Container {
    let mut cpu = LinuxCPU::new();
    let mut q = OptionalInt64::new();
    q.value = quota;
    cpu.quota = Some(q).into();
    let mut p = OptionalUInt64::new();
    p.value = period;
    cpu.period = Some(p).into();
    let mut s = OptionalUInt64::new();
    s.value = shares;
    cpu.shares = Some(s).into();
    let mut r = LinuxResources::new();
    r.cpu = Some(cpu).into();
    if let Some(l) = c.linux.as_mut() {
        l.resources = Some(r).into();
    }
    c
}

fn decided(pod: &PodSandbox, c: &Container) -> Option<Decision> {
    decide(pod, c, &KubernetesConfig::default()).unwrap()
}

#[test]
fn the_annotation_decides_and_unannotated_containers_are_left_alone() {
    let c = container("main", CGROUPFS);
    assert_eq!(decided(&pod(&[]), &c), None);
    let d = decided(&pod(&[(KIND, "training")]), &c).unwrap();
    assert_eq!(d.spec.kind, JobKind::Training);
    assert_eq!(d.spec.cores, 1);
    assert_eq!(d.owner, None);
    let Target::Container(job) = &d.spec.target else {
        panic!("{:?}", d.spec.target)
    };
    assert_eq!(job.label(), "ml/trainer-0/main");
    assert_eq!(job.cgroup, CGROUPFS);
    assert_eq!(d.spec.label().as_deref(), Some("ml/trainer-0/main"));

    // Per container: the pod's `lodger.dev/kind.<name>` wins over its plain one.
    let p = pod(&[(KIND, "training"), ("lodger.dev/kind.sidecar", "none")]);
    assert_eq!(decided(&p, &container("sidecar", CGROUPFS)), None);
    assert!(decided(&p, &container("main", CGROUPFS)).is_some());
    // And the container's own annotation counts.
    let mut own = container("etl", CGROUPFS);
    own.annotations.insert(KIND.into(), "batch".into());
    let d = decided(&pod(&[]), &own).unwrap();
    assert_eq!((d.spec.kind, d.spec.cores), (JobKind::Batch, 0));

    // Inference containers: the pod is the instance, nothing to start.
    let online = decided(&pod(&[(KIND, "online"), (CORES, "2")]), &c).unwrap();
    assert_eq!((online.spec.kind, online.spec.cores), (JobKind::Online, 2));
    assert!(online.spec.inference.is_none());
    let offline = decided(&pod(&[(KIND, "offline")]), &c).unwrap();
    assert_eq!(
        (offline.spec.kind, offline.spec.cores),
        (JobKind::Offline, 0)
    );
}

#[test]
fn bad_annotations_are_refused_with_what_to_write() {
    let c = container("main", CGROUPFS);
    let err =
        |ann: &[(&str, &str)]| decide(&pod(ann), &c, &KubernetesConfig::default()).unwrap_err();
    assert!(err(&[(KIND, "gpu")]).contains("not a kind (training, online, offline, batch"));
    assert!(err(&[(KIND, "training"), (CORES, "0")]).contains("lodger.dev/cores"));
    assert!(err(&[(KIND, "training"), (CORES, "many")]).contains("lodger.dev/cores"));
    let bad = container("main", "relative/path");
    assert!(decide(
        &pod(&[(KIND, "training")]),
        &bad,
        &KubernetesConfig::default()
    )
    .unwrap_err()
    .contains("no usable cgroup path"));
}

#[test]
fn cores_come_from_the_annotation_then_the_limit_then_the_request() {
    let p = pod(&[(KIND, "training")]);
    let limited = with_cpu(container("main", CGROUPFS), 250_000, 100_000, 2048);
    assert_eq!(decided(&p, &limited).unwrap().spec.cores, 3);
    let requested = with_cpu(container("main", CGROUPFS), 0, 100_000, 4096);
    assert_eq!(decided(&p, &requested).unwrap().spec.cores, 4);
    let nothing = with_cpu(container("main", CGROUPFS), -1, 100_000, 2);
    assert_eq!(decided(&p, &nothing).unwrap().spec.cores, 1);
    let p = pod(&[(KIND, "training"), (CORES, "6")]);
    assert_eq!(decided(&p, &limited).unwrap().spec.cores, 6);
}

#[test]
fn gpus_are_found_however_the_runtime_gives_them() {
    let mut c = container("main", CGROUPFS);
    assert_eq!(gpus(&c), None);
    let mut dev = LinuxDevice::new();
    dev.path = "/dev/nvidia3".into();
    let mut ctl = LinuxDevice::new();
    ctl.path = "/dev/nvidiactl".into();
    if let Some(l) = c.linux.as_mut() {
        l.devices = vec![ctl, dev];
    }
    assert_eq!(gpus(&c), Some(vec![3]));
    let mut cdi = CDIDevice::new();
    cdi.name = "nvidia.com/gpu=1".into();
    c.CDI_devices = vec![cdi];
    assert_eq!(gpus(&c), Some(vec![1, 3]));

    let mut env = container("main", CGROUPFS);
    env.env = vec!["NVIDIA_VISIBLE_DEVICES=void".into()];
    assert_eq!(gpus(&env), None);
    env.env = vec!["NVIDIA_VISIBLE_DEVICES=2,0".into()];
    assert_eq!(gpus(&env), Some(vec![0, 2]));
    // By UUID: a GPU, which one unknown.
    env.env = vec!["NVIDIA_VISIBLE_DEVICES=GPU-8d2e4f1a-0c1b-4b7e-9b2f-2a1c3d4e5f60".into()];
    assert_eq!(gpus(&env), Some(vec![]));

    // A GPU container with no annotation is training, unless the node says leave.
    let d = decided(&pod(&[]), &c).unwrap();
    assert_eq!(
        (d.spec.kind, d.spec.gpus.clone()),
        (JobKind::Training, vec![1, 3])
    );
    let leave = KubernetesConfig {
        gpu_containers: crate::config::GpuContainers::Leave,
        ..KubernetesConfig::default()
    };
    assert_eq!(decide(&pod(&[]), &c, &leave).unwrap(), None);
    // A batch container's GPUs are not its job's.
    let d = decided(&pod(&[(KIND, "batch")]), &c).unwrap();
    assert!(d.spec.gpus.is_empty());
}

#[test]
fn the_owner_is_the_containers_user_where_the_runtime_says() {
    let mut c = container("main", CGROUPFS);
    let mut u = User::new();
    u.uid = 1000;
    c.user = Some(u).into();
    assert_eq!(
        decided(&pod(&[(KIND, "training")]), &c).unwrap().owner,
        Some(1000)
    );
}

#[test]
fn cgroup_paths_of_both_drivers_resolve() {
    assert_eq!(cgroup_path(CGROUPFS).as_deref(), Some(CGROUPFS));
    assert_eq!(
        cgroup_path("kubepods-besteffort-pod12_34.slice:cri-containerd:abc").as_deref(),
        Some(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12_34.slice/\
             cri-containerd-abc.scope"
        )
    );
    assert_eq!(
        cgroup_path("kubepods-pod9.slice:crio:def").as_deref(),
        Some("/kubepods.slice/kubepods-pod9.slice/crio-def.scope")
    );
    for bad in [
        "",
        "/",
        "relative",
        "/a/../b",
        "/a//b",
        "bad-.slice:cri-containerd:x",
        "kubepods.slice:cri-containerd:",
        "a:b",
        "x.slice:p:n:extra",
        "/a/\nb",
    ] {
        assert_eq!(cgroup_path(bad), None, "{bad:?}");
    }
}

#[test]
fn the_event_mask_and_the_scheduler_support_are_what_runtimes_take() {
    // create 4, start 6, stop 10, remove 11, remove pod 3: bits 3, 5, 9, 10, 2; nothing above
    // the 0x7ff NRI v0.6 to v0.8 accept.
    assert_eq!(events(), 0b110_0010_1100);
    assert_eq!(events() & !0x7ff, 0);
    assert!(runtime_sets_sched("containerd", "v2.2.0"));
    assert!(runtime_sets_sched("containerd", "2.3.1"));
    assert!(!runtime_sets_sched("containerd", "1.7.24~ds1"));
    assert!(!runtime_sets_sched("containerd", "v2.1.4"));
    assert!(runtime_sets_sched("cri-o", "1.34.0"));
    assert!(!runtime_sets_sched("cri-o", "1.33.2"));
    assert!(!runtime_sets_sched("podman", "5.0"));
    assert!(!runtime_sets_sched("containerd", "garbage"));
}

fn devices(mut c: Container, paths: &[&str]) -> Container {
    let list = paths
        .iter()
        .map(|p| {
            let mut d = LinuxDevice::new();
            d.path = (*p).into();
            d
        })
        .collect();
    if let Some(l) = c.linux.as_mut() {
        l.devices = list;
    }
    c
}

/// nvidia/cuda images set `ENV NVIDIA_VISIBLE_DEVICES=all` whether or not the pod asked for a
/// GPU: `all` (like `void` and `none`) asks for nothing, so such a container is left alone.
#[test]
fn nvidia_visible_devices_all_is_not_a_gpu_request() {
    let mut c = container("main", CGROUPFS);
    for v in ["all", "void", "none", ""] {
        c.env = vec![format!("NVIDIA_VISIBLE_DEVICES={v}")];
        assert_eq!(gpus(&c), None, "{v:?}");
        assert_eq!(decided(&pod(&[]), &c), None, "{v:?}");
    }
    // Annotated, it is what the annotation says, with no GPU locality.
    c.env = vec!["NVIDIA_VISIBLE_DEVICES=all".into()];
    let d = decided(&pod(&[(KIND, "training")]), &c).unwrap();
    assert_eq!((d.spec.kind, d.spec.gpus), (JobKind::Training, vec![]));
}

/// A privileged container is given every device node of the host, the GPUs' among them (as
/// lodgerd's own DaemonSet pod is): its device list asks for nothing, so unannotated it is
/// left alone, and annotated its GPUs are those it asked for by name only.
#[test]
fn a_privileged_containers_devices_are_not_a_gpu_request() {
    let host = [
        "/dev/null",
        "/dev/kmsg",
        "/dev/mem",
        "/dev/nvidia0",
        "/dev/nvidia1",
        "/dev/nvidiactl",
        "/dev/sda",
    ];
    let privileged = devices(container("lodgerd", CGROUPFS), &host);
    assert!(host_devices(&privileged));
    assert_eq!(gpus(&privileged), None);
    assert_eq!(decided(&pod(&[]), &privileged), None);
    // Either node is the host's set: /dev/mem is missing where the kernel has no devmem.
    let kmsg_only = devices(container("x", CGROUPFS), &["/dev/kmsg", "/dev/nvidia2"]);
    assert_eq!(decided(&pod(&[]), &kmsg_only), None);

    let annotated = decided(&pod(&[(KIND, "training")]), &privileged).unwrap();
    assert_eq!(annotated.spec.gpus, Vec::<u32>::new());
    let mut named = privileged.clone();
    named.env = vec!["NVIDIA_VISIBLE_DEVICES=1".into()];
    assert_eq!(gpus(&named), Some(vec![1]));
    assert_eq!(decided(&pod(&[]), &named), None);
    let d = decided(&pod(&[(KIND, "training")]), &named).unwrap();
    assert_eq!(d.spec.gpus, vec![1]);

    // A container given its GPUs' nodes and the usual few is a GPU container.
    let plain = devices(
        container("main", CGROUPFS),
        &[
            "/dev/nvidia3",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/null",
        ],
    );
    assert!(!host_devices(&plain));
    assert_eq!(decided(&pod(&[]), &plain).unwrap().spec.gpus, vec![3]);
}
