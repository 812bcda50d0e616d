//! The plugin's answers to a runtime's calls, against an agent on a fake node.

use std::thread::JoinHandle;

use super::*;
use crate::agent::tests::Rig;
use crate::job::JobSpec;

/// A plugin in front of a running agent on the fake node of [`Rig`].
struct Bench {
    plugin: NriPlugin,
    rt: tokio::runtime::Runtime,
    join: Option<JoinHandle<()>>,
    _rig: Rig,
    _roots: tempfile::TempDir,
}

/// SCHED_RR at priority 10, the node's `/proc` and cgroup hierarchy under `roots` (empty: no
/// RT limit read, no RT groups).
fn sched_at(roots: &std::path::Path, allow_unthrottled_rt: bool) -> TrainingSched {
    TrainingSched {
        rr_priority: Some(10),
        allow_unthrottled_rt,
        proc_root: roots.join("proc"),
        cgroup_root: roots.join("cgroup"),
    }
}

impl Bench {
    fn new() -> Bench {
        let roots = tempfile::tempdir().expect("tempdir");
        Bench::with(sched_at(roots.path(), false), roots)
    }

    /// A plugin giving training `sched` (its roots in `roots`, kept as long as the bench).
    fn with(sched: TrainingSched, roots: tempfile::TempDir) -> Bench {
        let rig = Rig::new();
        let (agent, join) = rig.agent().spawn().expect("agent thread");
        let plugin = NriPlugin::new(agent, KubernetesConfig::default(), sched);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        Bench {
            plugin,
            rt,
            join: Some(join),
            _rig: rig,
            _roots: roots,
        }
    }

    /// The registered containers' ids.
    fn jobs(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .rt
            .block_on(self.plugin.container_jobs())
            .into_iter()
            .map(|(c, _)| c.id)
            .collect();
        ids.sort();
        ids
    }

    /// The adjustment the plugin answers a new container with.
    fn create(&self, pod: &PodSandbox, ctr: &Container) -> Option<ContainerAdjustment> {
        let mut req = CreateContainerRequest::new();
        req.pod = Some(pod.clone()).into();
        req.container = Some(ctr.clone()).into();
        let rsp = self
            .rt
            .block_on(self.plugin.create_container(&TtrpcContext::default(), req))
            .expect("CreateContainer");
        rsp.adjust.into_option()
    }

    fn stop(&self, ctr: &Container) {
        let mut req = StopContainerRequest::new();
        req.container = Some(ctr.clone()).into();
        self.rt
            .block_on(self.plugin.stop_container(&TtrpcContext::default(), req))
            .expect("StopContainer");
    }

    fn remove_pod(&self, pod: &PodSandbox) {
        let mut req = PodEvent::new();
        req.pod = Some(pod.clone()).into();
        self.rt
            .block_on(
                self.plugin
                    .remove_pod_sandbox(&TtrpcContext::default(), req),
            )
            .expect("RemovePodSandbox");
    }

    fn configure(&self) {
        let mut req = ConfigureRequest::new();
        req.runtime_name = "containerd".into();
        req.runtime_version = "v2.2.0".into();
        self.rt
            .block_on(self.plugin.configure(&TtrpcContext::default(), req))
            .expect("Configure");
    }

    fn synchronize(&self, pods: Vec<PodSandbox>, containers: Vec<Container>, more: bool) {
        let mut req = SynchronizeRequest::new();
        req.pods = pods;
        req.containers = containers;
        req.more = more;
        let rsp = self
            .rt
            .block_on(self.plugin.synchronize(&TtrpcContext::default(), req))
            .expect("Synchronize");
        assert_eq!(rsp.more, more, "{rsp:?}");
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.plugin.agent.stop();
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

fn training_pod(id: &str, name: &str) -> PodSandbox {
    let mut p = PodSandbox::new();
    p.id = id.into();
    p.name = name.into();
    p.namespace = "ml".into();
    p.annotations.insert(pods::KIND.into(), "training".into());
    p
}

fn container(id: &str, pod: &PodSandbox) -> Container {
    let mut c = Container::new();
    c.id = id.into();
    c.pod_sandbox_id = pod.id.clone();
    c.name = "main".into();
    c.state = ContainerState::CONTAINER_RUNNING.into();
    let mut linux = LinuxContainer::new();
    linux.cgroups_path = format!("/kubepods/pod-{}/{id}", pod.id);
    c.linux = Some(linux).into();
    c
}

/// kubelet re-creates a pod's sandbox under the same namespace and name (or a StatefulSet
/// pod is replaced on this node): removing the old, dead sandbox leaves the new one's running
/// containers registered.
#[test]
fn removing_an_old_sandbox_leaves_a_new_pod_of_the_same_name_alone() {
    let bench = Bench::new();
    let old = training_pod("p1", "t-0");
    let c1 = container("c1", &old);
    assert!(bench.create(&old, &c1).is_some());
    bench.stop(&c1);
    assert!(bench.jobs().is_empty());
    let new = training_pod("p2", "t-0");
    let c2 = container("c2", &new);
    assert!(bench.create(&new, &c2).is_some());
    bench.remove_pod(&old);
    assert_eq!(bench.jobs(), ["c2"]);
    bench.remove_pod(&new);
    assert!(bench.jobs().is_empty());
}

/// A container registered by a lodgerd that kept no sandbox id (its state file's record has
/// none) still goes with its pod, matched by name.
#[test]
fn a_record_without_a_sandbox_id_goes_with_its_pods_name() {
    let bench = Bench::new();
    let pod = training_pod("p1", "t-0");
    let old: ContainerJob = serde_json::from_value(serde_json::json!({
        "id": "c1",
        "pod": "ml/t-0",
        "name": "main",
        "cgroup": "/kubepods/pod-p1/c1",
    }))
    .expect("an older lodgerd's record");
    assert_eq!(old.sandbox, None);
    let spec = JobSpec::new(JobKind::Training, Target::Container(old), 1);
    bench
        .rt
        .block_on(bench.plugin.agent.register(spec, None, nri_caller()))
        .expect("registered");
    assert_eq!(bench.jobs(), ["c1"]);
    bench.remove_pod(&pod);
    assert!(bench.jobs().is_empty());
}

/// A `Synchronize` in parts cut short by the runtime going away: its first part (here naming a
/// container that is gone by the next connection) is not part of the next connection's list,
/// which always starts with `Configure`.
#[test]
fn a_synchronize_cut_short_is_forgotten_at_the_next_configure() {
    let bench = Bench::new();
    let ghost_pod = training_pod("p1", "ghost-0");
    let ghost = container("g", &ghost_pod);
    let pod = training_pod("p2", "t-0");
    let live = container("c2", &pod);
    bench.configure();
    bench.synchronize(vec![ghost_pod], vec![ghost], true);
    bench.configure();
    bench.synchronize(vec![pod], vec![live], false);
    assert_eq!(bench.jobs(), ["c2"]);
}

/// The scheduler adjustment of a training container (policy, priority), if any.
fn sched_of(adjust: &ContainerAdjustment) -> Option<(LinuxSchedulerPolicy, i32)> {
    let s = adjust.linux.as_ref()?.scheduler.as_ref()?;
    Some((s.policy.enum_value_or_default(), s.priority))
}

/// The runtime is asked for SCHED_RR only where lodger's sweep would set it: not while
/// `kernel.sched_rt_runtime_us` is -1 (unless `training.allow_unthrottled_rt`), and not where
/// v1 cpu cgroups have RT budgets (a container's group may have none: the runtime would fail
/// the container, where the sweep diagnoses it or grants one). The cpuset is given anyway.
#[test]
fn sched_rr_is_asked_of_the_runtime_only_where_the_sweep_would_set_it() {
    let roots = tempfile::tempdir().expect("tempdir");
    let path = roots.path().to_path_buf();
    let sysctl = path.join("proc/sys/kernel/sched_rt_runtime_us");
    std::fs::create_dir_all(sysctl.parent().expect("a parent")).expect("mkdir");
    std::fs::write(&sysctl, "950000\n").expect("the RT limit");
    let bench = Bench::with(sched_at(&path, false), roots);
    bench.configure();
    let pod = training_pod("p1", "t-0");
    let rr = Some((LinuxSchedulerPolicy::SCHED_RR, 10));
    let adjust = bench.create(&pod, &container("c1", &pod)).expect("placed");
    assert_eq!(sched_of(&adjust), rr);

    std::fs::write(&sysctl, "-1\n").expect("unthrottled");
    let adjust = bench.create(&pod, &container("c2", &pod)).expect("placed");
    assert_eq!(sched_of(&adjust), None);
    assert!(adjust
        .linux
        .as_ref()
        .and_then(|l| l.resources.as_ref())
        .is_some());
    let allowed_roots = tempfile::tempdir().expect("tempdir");
    let allowed_path = allowed_roots.path().to_path_buf();
    let allowed = Bench::with(sched_at(&allowed_path, true), allowed_roots);
    let allowed_sysctl = allowed_path.join("proc/sys/kernel/sched_rt_runtime_us");
    std::fs::create_dir_all(allowed_sysctl.parent().expect("a parent")).expect("mkdir");
    std::fs::write(&allowed_sysctl, "-1\n").expect("unthrottled");
    allowed.configure();
    let adjust = allowed
        .create(&pod, &container("c3", &pod))
        .expect("placed");
    assert_eq!(sched_of(&adjust), rr);

    std::fs::write(&sysctl, "950000\n").expect("the RT limit");
    let cpu = path.join("cgroup/cpu");
    std::fs::create_dir_all(&cpu).expect("a v1 cpu hierarchy");
    std::fs::write(cpu.join("cpu.rt_runtime_us"), "950000\n").expect("RT groups");
    let adjust = bench.create(&pod, &container("c4", &pod)).expect("placed");
    assert_eq!(sched_of(&adjust), None);
}
