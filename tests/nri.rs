//! lodgerd as an NRI plugin against a fake container runtime written from NRI's protocol (issue
//! 20): a ttrpc server on a socket in a temporary directory plays the runtime's side over
//! lodger's multiplexer — it takes lodger's registration, configures it, synchronizes it,
//! replays pods' and containers' lifecycle events and checks the adjustments lodger returns; it
//! restarts, and lodger connects again and reconciles its jobs to the new list. As root, the
//! adjustment is also made real: a process in the container's cgroup runs SCHED_RR on the
//! cpuset lodger gave, and is given back when the container stops.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream;
use lodger::api::nri::mux::{Mux, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN};
use lodger::api::nri::proto::api_ttrpc::{create_runtime, PluginClient, Runtime};
use lodger::api::nri::proto::*;
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use ttrpc::r#async::transport::{Listener, Socket};
use ttrpc::r#async::{Client, Server, TtrpcContext};

use common::*;

const WAIT: Duration = Duration::from_secs(20);

/// The runtime's `Runtime` service: hands each registration to the test.
struct RuntimeService {
    registered: mpsc::UnboundedSender<RegisterPluginRequest>,
}

#[async_trait]
impl Runtime for RuntimeService {
    async fn register_plugin(
        &self,
        _ctx: &TtrpcContext,
        req: RegisterPluginRequest,
    ) -> ttrpc::Result<Empty> {
        let _ = self.registered.send(req);
        Ok(Empty::new())
    }
}

/// One accepted plugin connection, from the runtime's side.
struct PluginConn {
    plugin: PluginClient,
    registered: RegisterPluginRequest,
    _server: Server,
    _mux: Mux,
}

/// The fake runtime: listens where lodgerd is told NRI is.
struct FakeRuntime {
    socket: PathBuf,
    listener: Option<UnixListener>,
}

impl FakeRuntime {
    fn listen(socket: &Path) -> FakeRuntime {
        let _ = std::fs::remove_file(socket);
        FakeRuntime {
            socket: socket.to_path_buf(),
            listener: Some(UnixListener::bind(socket).expect("bind the NRI socket")),
        }
    }

    /// Waits for lodgerd to connect and register, as a runtime accepts an external plugin.
    async fn accept(&self) -> PluginConn {
        let listener = self.listener.as_ref().expect("listening");
        let (trunk, _) = tokio::time::timeout(WAIT, listener.accept())
            .await
            .expect("lodgerd connects to the NRI socket")
            .expect("accept");
        let mut mux = Mux::new(trunk, &[PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN]);
        let to_plugin = mux.take(PLUGIN_SERVICE_CONN).expect("plugin connection");
        let ours = mux.take(RUNTIME_SERVICE_CONN).expect("runtime connection");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut server = Server::new()
            .register_service(create_runtime(Arc::new(RuntimeService { registered: tx })))
            .add_listener(Listener::new(stream::StreamExt::chain(
                stream::once(async move { Ok(ours) }),
                stream::pending(),
            )));
        server.start().await.expect("serve the Runtime service");
        let registered = tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("lodgerd registers")
            .expect("a registration");
        PluginConn {
            plugin: PluginClient::new(Client::new(Socket::new(to_plugin))),
            registered,
            _server: server,
            _mux: mux,
        }
    }

    /// The runtime going down: the socket is removed and every connection dropped.
    fn stop(&mut self) {
        self.listener = None;
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(10_000_000_000)
}

fn pod(id: &str, name: &str, annotations: &[(&str, &str)]) -> PodSandbox {
    let mut p = PodSandbox::new();
    p.id = id.into();
    p.name = name.into();
    p.namespace = "ml".into();
    p.uid = format!("uid-{id}");
    p.annotations = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    p
}

fn container(id: &str, pod: &PodSandbox, name: &str, cgroup: &str) -> Container {
    let mut c = Container::new();
    c.id = id.into();
    c.pod_sandbox_id = pod.id.clone();
    c.name = name.into();
    c.state = ContainerState::CONTAINER_RUNNING.into();
    let mut linux = LinuxContainer::new();
    linux.cgroups_path = cgroup.into();
    c.linux = Some(linux).into();
    c
}

async fn configure(conn: &PluginConn, runtime: &str, version: &str) -> i32 {
    let mut req = ConfigureRequest::new();
    req.runtime_name = runtime.into();
    req.runtime_version = version.into();
    conn.plugin
        .configure(ctx(), &req)
        .await
        .expect("Configure")
        .events
}

async fn synchronize(conn: &PluginConn, pods: Vec<PodSandbox>, containers: Vec<Container>) {
    // In two parts, as NRI v0.8 sends a long list.
    let mut first = SynchronizeRequest::new();
    first.pods = pods;
    first.more = true;
    let rsp = conn
        .plugin
        .synchronize(ctx(), &first)
        .await
        .expect("Synchronize");
    assert!(rsp.more && rsp.update.is_empty(), "{rsp:?}");
    let mut last = SynchronizeRequest::new();
    last.containers = containers;
    let rsp = conn
        .plugin
        .synchronize(ctx(), &last)
        .await
        .expect("Synchronize");
    assert!(!rsp.more, "{rsp:?}");
}

/// The adjustment lodger returns for a new container: (cpus, mems, scheduler), or `None`.
async fn create(
    conn: &PluginConn,
    pod: &PodSandbox,
    ctr: &Container,
) -> Option<(String, String, Option<(LinuxSchedulerPolicy, i32)>)> {
    let mut req = CreateContainerRequest::new();
    req.pod = Some(pod.clone()).into();
    req.container = Some(ctr.clone()).into();
    let rsp = conn
        .plugin
        .create_container(ctx(), &req)
        .await
        .expect("CreateContainer");
    let linux = rsp.adjust.as_ref()?.linux.as_ref()?;
    let cpu = linux.resources.as_ref()?.cpu.as_ref()?;
    let sched = linux
        .scheduler
        .as_ref()
        .map(|s| (s.policy.enum_value_or_default(), s.priority));
    Some((cpu.cpus.clone(), cpu.mems.clone(), sched))
}

async fn state_change(conn: &PluginConn, event: Event, pod: &PodSandbox, ctr: Option<&Container>) {
    let mut req = StateChangeEvent::new();
    req.event = event.into();
    req.pod = Some(pod.clone()).into();
    req.container = ctr.cloned().into();
    conn.plugin
        .state_change(ctx(), &req)
        .await
        .expect("StateChange");
}

async fn stop(conn: &PluginConn, pod: &PodSandbox, ctr: &Container) {
    let mut req = StopContainerRequest::new();
    req.pod = Some(pod.clone()).into();
    req.container = Some(ctr.clone()).into();
    conn.plugin
        .stop_container(ctx(), &req)
        .await
        .expect("StopContainer");
}

/// lodgerd's jobs by name (a container's is `namespace/pod/container`).
fn jobs_by_name(d: &Daemon) -> HashMap<String, serde_json::Value> {
    let list = d.ctl_json(&["list"]);
    list.as_array()
        .expect("a list")
        .iter()
        .map(|j| {
            (
                j["name"].as_str().unwrap_or_default().to_string(),
                j.clone(),
            )
        })
        .collect()
}

/// Whether `cond` holds within `timeout`.
fn within(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

fn nri_config(socket: &Path) -> String {
    format!(
        "[kubernetes]\nnri = true\nnri_socket = \"{}\"\n",
        socket.display()
    )
}

#[test]
fn pods_become_jobs_through_nri_and_survive_a_runtime_restart() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysfs/server-2s-64cpu-8gpu");
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nri.sock");
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    let mut runtime = rt.block_on(async { FakeRuntime::listen(&socket) });
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            reserved: "0",
            sysfs_root: Some(fixture),
            sim: true,
            extra: format!("{}\n[api]\nmax_jobs_per_owner = 1\n", nri_config(&socket)),
            ..DaemonOptions::default()
        },
    );
    let old = pod("p0", "old-0", &[("lodger.dev/kind", "training")]);
    let old_ctr = container("c0", &old, "main", "/kubepods/pod0/c0");
    let plain = pod("p1", "web-0", &[]);
    let plain_ctr = container("c1", &plain, "nginx", "/kubepods/pod1/c1");
    let train = pod(
        "p2",
        "trainer-0",
        &[("lodger.dev/kind", "training"), ("lodger.dev/cores", "4")],
    );
    let train_ctr = container(
        "c2",
        &train,
        "main",
        "kubepods-pod2.slice:cri-containerd:c2",
    );
    let gpu = pod("p3", "gpu-0", &[]);
    let mut gpu_ctr = container("c3", &gpu, "cuda", "/kubepods/pod3/c3");
    let mut dev = LinuxDevice::new();
    dev.path = "/dev/nvidia5".into();
    if let Some(l) = gpu_ctr.linux.as_mut() {
        l.devices = vec![dev];
    }
    let online = pod("p4", "serve-0", &[("lodger.dev/kind", "online")]);
    let online_ctr = container("c4", &online, "server", "/kubepods/pod4/c4");

    rt.block_on(async {
        let conn = runtime.accept().await;
        assert_eq!(conn.registered.plugin_name, "lodger");
        assert_eq!(conn.registered.plugin_idx, "50");
        // create, start, stop, remove container and remove pod; nothing NRI v0.6 refuses.
        assert_eq!(
            configure(&conn, "containerd", "v2.2.0").await,
            0b110_0010_1100
        );
        // A container that ran before lodger joined is taken on at synchronization; an
        // unannotated one is not.
        synchronize(
            &conn,
            vec![old.clone(), plain.clone()],
            vec![old_ctr.clone(), plain_ctr.clone()],
        )
        .await;
        let jobs = jobs_by_name(&d);
        assert!(jobs.contains_key("ml/old-0/main"), "{jobs:?}");
        assert_eq!(jobs.len(), 1, "{jobs:?}");

        // A training container gets its cpuset and SCHED_RR before it starts; SCHED_RR only
        // where lodger's sweep would set it (the plugin's unit tests try each case): not on a
        // node with RT group scheduling or unthrottled RT, which this one may be.
        let (cpus, mems, sched) = create(&conn, &train, &train_ctr)
            .await
            .expect("an adjustment");
        assert_eq!(common::cpus(&cpus).len(), 4, "{cpus}");
        assert!(!mems.is_empty());
        let sweep_only = Path::new("/sys/fs/cgroup/cpu/cpu.rt_runtime_us").is_file()
            || std::fs::read_to_string("/proc/sys/kernel/sched_rt_runtime_us")
                .is_ok_and(|v| v.trim() == "-1");
        let rr = (!sweep_only).then_some((LinuxSchedulerPolicy::SCHED_RR, 10));
        assert_eq!(sched, rr);
        let job = &jobs_by_name(&d)["ml/trainer-0/main"];
        assert_eq!(job["cpus"], cpus.as_str(), "{job}");
        assert_eq!(job["kind"], "training");
        assert_eq!(
            job["cgroup"],
            "/kubepods.slice/kubepods-pod2.slice/cri-containerd-c2.scope"
        );
        let show = d.ctl_ok(&["show", job["id"].as_str().unwrap_or_default()]);
        assert!(show.contains("ml/trainer-0/main"), "{show}");

        // A GPU container with no annotation is training near its GPU; an unannotated one gets
        // nothing, nor an online one here (simulated enforcement enforces no inference
        // container; the root test below places them).
        let (gpu_cpus, _, _) = create(&conn, &gpu, &gpu_ctr).await.expect("an adjustment");
        assert_eq!(
            jobs_by_name(&d)["ml/gpu-0/cuda"]["gpus"],
            serde_json::json!([5])
        );
        assert!(!common::cpus(&gpu_cpus).is_empty());
        assert_eq!(create(&conn, &plain, &plain_ctr).await, None);
        assert_eq!(create(&conn, &online, &online_ctr).await, None);
        assert_eq!(jobs_by_name(&d).len(), 3);

        // A container run as a user is that user's job, and counts against its caps: the
        // second one of uid 1000 is over `api.max_jobs_per_owner = 1` and left alone.
        let mut user = User::new();
        user.uid = 1000;
        let batch = pod("p6", "etl-0", &[("lodger.dev/kind", "training")]);
        let mut first = container("c6", &batch, "a", "/kubepods/pod6/c6");
        first.user = Some(user.clone()).into();
        let mut second = container("c7", &batch, "b", "/kubepods/pod6/c7");
        second.user = Some(user).into();
        assert!(create(&conn, &batch, &first).await.is_some());
        assert_eq!(jobs_by_name(&d)["ml/etl-0/a"]["owner_uid"], 1000);
        assert_eq!(create(&conn, &batch, &second).await, None);
        assert_eq!(jobs_by_name(&d).len(), 4);

        // Started: nothing to answer. Stopped and removed: unregistered.
        state_change(&conn, Event::START_CONTAINER, &train, Some(&train_ctr)).await;
        stop(&conn, &train, &train_ctr).await;
        state_change(&conn, Event::REMOVE_POD_SANDBOX, &gpu, None).await;
        let jobs = jobs_by_name(&d);
        assert!(!jobs.contains_key("ml/trainer-0/main"), "{jobs:?}");
        assert!(!jobs.contains_key("ml/gpu-0/cuda"), "{jobs:?}");
        assert!(jobs.contains_key("ml/old-0/main"), "{jobs:?}");
    });

    // The runtime restarts: lodgerd connects again, and the new list (the old container is
    // gone, the trainer runs again) is what its jobs become.
    runtime.stop();
    rt.block_on(async {
        runtime = FakeRuntime::listen(&socket);
        let conn = runtime.accept().await;
        // An older runtime: no scheduler adjustment, lodger's sweep does it.
        configure(&conn, "containerd", "1.7.24~ds1").await;
        synchronize(&conn, vec![train.clone()], vec![train_ctr.clone()]).await;
        let jobs = jobs_by_name(&d);
        assert!(!jobs.contains_key("ml/old-0/main"), "{jobs:?}");
        assert!(jobs.contains_key("ml/trainer-0/main"), "{jobs:?}");
        let again = container("c5", &train, "second", "/kubepods/pod2/c5");
        let (_, _, sched) = create(&conn, &train, &again).await.expect("an adjustment");
        assert_eq!(sched, None);
    });
    let log = d.log();
    assert!(log.contains("runs no inference instances"), "{log}");
    assert!(log.contains("connecting again"), "{log}");
    assert!(log.contains("api.max_jobs_per_owner"), "{log}");
}

/// A container's cgroup as a runtime with the cgroupfs driver makes it, under a directory of
/// the test's own; removed (after its processes) on drop.
struct ContainerCgroup {
    root: String,
    path: String,
}

impl ContainerCgroup {
    fn create(root: &str, rel: &str, cpus: &str) -> ContainerCgroup {
        let path = format!("{root}/{rel}");
        let mems =
            std::fs::read_to_string(cpuset_root().join(mems_file())).unwrap_or_else(|_| "0".into());
        let v2 = host_cgroup() == HostCgroup::V2;
        let mut at = String::new();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let all = online_cpus();
        for (i, part) in parts.iter().enumerate() {
            // The pod's and other parents' hold every CPU: containers of several pods share them.
            let cpus = if i + 1 == parts.len() {
                cpus
            } else {
                all.as_str()
            };
            if v2 {
                let _ = std::fs::write(cgroup_path(&at).join("cgroup.subtree_control"), "+cpuset");
            }
            at = format!("{at}/{part}");
            let dir = cgroup_path(&at);
            std::fs::create_dir_all(&dir).expect("create the container's cgroup");
            std::fs::write(dir.join("cpuset.mems"), mems.trim()).expect("cpuset.mems");
            std::fs::write(dir.join("cpuset.cpus"), cpus).expect("cpuset.cpus");
        }
        ContainerCgroup {
            root: root.to_string(),
            path,
        }
    }

    /// Moves `pid` in, as the runtime starts the container's process there.
    fn attach(&self, pid: u32) {
        std::fs::write(
            cgroup_path(&self.path).join("cgroup.procs"),
            pid.to_string(),
        )
        .expect("move the process into the container's cgroup");
    }
}

impl Drop for ContainerCgroup {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.root);
    }
}

/// A root test's node: lodgerd enforcing for real on two job CPUs (`cpus`), joined by the fake
/// runtime, configured as containerd 1.7 (no scheduler adjustment) and synchronized empty.
/// Fields drop in order: lodgerd first, the bus and directory last.
struct RootNode {
    d: Daemon,
    conn: PluginConn,
    _runtime: FakeRuntime,
    rt: tokio::runtime::Runtime,
    reserved: &'static str,
    cpus: [u32; 2],
    /// The test's own cgroup directory for its containers.
    root: String,
    _bus: PrivateBus,
    _dir: tempfile::TempDir,
}

impl RootNode {
    fn start(test: &str) -> Option<RootNode> {
        if !need_root(test) {
            return None;
        }
        let (reserved, cpus) = two_job_cpus(test)?;
        let bus = PrivateBus::start();
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nri.sock");
        let rt = tokio::runtime::Runtime::new().expect("tokio");
        let runtime = rt.block_on(async { FakeRuntime::listen(&socket) });
        let d = Daemon::start(
            &bus,
            dir.path(),
            DaemonOptions {
                reserved,
                extra: nri_config(&socket),
                ..DaemonOptions::default()
            },
        );
        let conn = rt.block_on(async {
            let conn = runtime.accept().await;
            configure(&conn, "containerd", "1.7.24~ds1").await;
            synchronize(&conn, vec![], vec![]).await;
            conn
        });
        Some(RootNode {
            d,
            conn,
            _runtime: runtime,
            rt,
            reserved,
            cpus,
            root: unique("/lodger-nri"),
            _bus: bus,
            _dir: dir,
        })
    }
}

#[test]
fn an_annotated_container_runs_rr_on_the_cpuset_lodger_gave_and_is_given_back() {
    let Some(node) = RootNode::start(
        "an_annotated_container_runs_rr_on_the_cpuset_lodger_gave_and_is_given_back",
    ) else {
        return;
    };
    let (d, rt, conn, reserved, root) = (&node.d, &node.rt, &node.conn, node.reserved, &node.root);
    let train = pod("p1", "trainer-0", &[("lodger.dev/kind", "training")]);
    let train_ctr = container("c1", &train, "main", &format!("{root}/kubepods/pod1/c1"));
    let plain = pod("p2", "web-0", &[]);
    let plain_ctr = container("c2", &plain, "nginx", &format!("{root}/kubepods/pod2/c2"));
    let all = job_cpus(reserved).to_string();
    let (cpus, _, _) = rt
        .block_on(create(conn, &train, &train_ctr))
        .expect("an adjustment");
    assert!(common::cpus(&cpus).is_subset(&job_cpus(reserved)), "{cpus}");
    assert_eq!(rt.block_on(create(conn, &plain, &plain_ctr)), None);

    // The runtime makes the cgroups as adjusted and starts the containers' processes there.
    let train_cg = ContainerCgroup::create(root, "kubepods/pod1/c1", &cpus);
    let plain_cg = ContainerCgroup::create(&format!("{root}-plain"), "kubepods/pod2/c2", &all);
    let trainer = Workload::train(2);
    let web = Workload::train(1);
    train_cg.attach(trainer.pid());
    plain_cg.attach(web.pid());
    rt.block_on(state_change(
        conn,
        Event::START_CONTAINER,
        &train,
        Some(&train_ctr),
    ));

    // The threads are changed during a pass, the job's view published at its end: wait for both.
    let running = || jobs_by_name(d)["ml/trainer-0/main"]["state"] == "running";
    if !within(WAIT, || all_rr_on(trainer.pid(), 10, &cpus) && running()) {
        panic!(
            "the trainer's threads are not SCHED_RR on {cpus}: {:?}\njob: {}\n{}",
            tids(trainer.pid())
                .iter()
                .map(|&t| sched_of(t))
                .collect::<Vec<_>>(),
            d.ctl_ok(&["list"]),
            d.log()
        );
    }
    assert!(
        all_other(web.pid()),
        "an unannotated container is left alone"
    );
    let job = &jobs_by_name(d)["ml/trainer-0/main"];
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(job["pids"], serde_json::json!([trainer.pid()]), "{job}");

    // Stopped: its threads are given back, and its cpuset is no longer lodger's adjustment
    // but what it has without lodger: its parent's (the runtime made it on the adjustment).
    rt.block_on(stop(conn, &train, &train_ctr));
    wait_until(WAIT, "the trainer's threads back to SCHED_OTHER", || {
        all_other(trainer.pid())
    });
    assert!(!jobs_by_name(d).contains_key("ml/trainer-0/main"));
    let effective = |rel: &str| {
        let file = match host_cgroup() {
            HostCgroup::V2 => "cpuset.cpus.effective",
            _ => "cpuset.cpus",
        };
        std::fs::read_to_string(cgroup_path(rel).join(file))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let pod_cg = train_cg
        .path
        .rsplit_once('/')
        .map_or("/", |(p, _)| p)
        .to_string();
    assert_eq!(
        common::cpus(&effective(&train_cg.path)),
        common::cpus(&effective(&pod_cg)),
        "the container's CPUs are its pod's again, not the adjustment's {cpus}"
    );
    drop(trainer);
    drop(web);
}

#[test]
fn inference_containers_get_the_cpus_the_inference_policy_plans() {
    let Some(node) =
        RootNode::start("inference_containers_get_the_cpus_the_inference_policy_plans")
    else {
        return;
    };
    let (d, rt, conn, root, [a, b]) = (&node.d, &node.rt, &node.conn, &node.root, node.cpus);
    let train = pod("p1", "trainer-0", &[("lodger.dev/kind", "training")]);
    let train_ctr = container("c1", &train, "main", &format!("{root}/kubepods/pod1/c1"));
    let online = pod(
        "p2",
        "serve-0",
        &[("lodger.dev/kind", "online"), ("lodger.dev/cores", "1")],
    );
    let online_ctr = container("c2", &online, "server", &format!("{root}/kubepods/pod2/c2"));
    let offline = pod("p3", "batch-infer-0", &[("lodger.dev/kind", "offline")]);
    let offline_ctr = container(
        "c3",
        &offline,
        "worker",
        &format!("{root}/kubepods/pod3/c3"),
    );
    let (train_cpus, _, _) = rt
        .block_on(create(conn, &train, &train_ctr))
        .expect("training's adjustment");
    let (online_cpus, _, online_sched) = rt
        .block_on(create(conn, &online, &online_ctr))
        .expect("online's adjustment");
    let (offline_cpus, _, _) = rt
        .block_on(create(conn, &offline, &offline_ctr))
        .expect("offline's adjustment");
    // The inference policy's rules (Cloud Reamer §III-A): an online instance on a leftover core
    // of its own; offline on every core no online instance holds, training's included.
    assert_eq!(train_cpus, a.to_string());
    assert_eq!(online_cpus, b.to_string());
    assert_eq!(online_sched, None, "no real-time class for a lodger");
    assert_eq!(offline_cpus, a.to_string());

    let cg = |rel: &str, cpus: &str| ContainerCgroup::create(root, rel, cpus);
    let (train_cg, online_cg, offline_cg) = (
        cg("kubepods/pod1/c1", &train_cpus),
        cg("kubepods/pod2/c2", &online_cpus),
        cg("kubepods/pod3/c3", &offline_cpus),
    );
    let trainer = Workload::train(2);
    let server = Workload::train(1);
    let worker = Workload::train(1);
    train_cg.attach(trainer.pid());
    online_cg.attach(server.pid());
    offline_cg.attach(worker.pid());
    wait_until(
        WAIT,
        "the trainer SCHED_RR, the inference containers running",
        || {
            let jobs = jobs_by_name(d);
            all_rr_on(trainer.pid(), 10, &train_cpus)
                && jobs["ml/serve-0/server"]["state"] == "running"
                && jobs["ml/batch-infer-0/worker"]["state"] == "running"
        },
    );
    let jobs = jobs_by_name(d);
    assert_eq!(jobs["ml/serve-0/server"]["kind"], "online");
    assert_eq!(jobs["ml/serve-0/server"]["cpus"], online_cpus.as_str());
    assert_eq!(jobs["ml/batch-infer-0/worker"]["kind"], "offline");
    assert_eq!(
        jobs["ml/batch-infer-0/worker"]["pids"],
        serde_json::json!([worker.pid()])
    );
    assert!(
        all_other(server.pid()) && all_other(worker.pid()),
        "lodgers stay SCHED_OTHER"
    );
    for (w, cpus) in [(&server, &online_cpus), (&worker, &offline_cpus)] {
        assert_eq!(
            cpus_allowed(w.pid(), w.pid()).as_deref(),
            Some(cpus.as_str())
        );
    }
    // What the offline container uses on training's CPU is counted as lent.
    wait_until(
        WAIT,
        "the offline container's CPU time on training's CPU counted",
        || {
            let jobs = jobs_by_name(d);
            let on = |name: &str, key: &str| jobs[name][key].as_f64().unwrap_or(0.0);
            on("ml/batch-infer-0/worker", "lodged_on_training_cpu_s") > 0.0
                && on("ml/trainer-0/main", "lent_cpu_s") > 0.0
        },
    );
    // Nothing was started for them.
    let show = d.ctl_ok(&[
        "show",
        jobs["ml/serve-0/server"]["id"].as_str().unwrap_or_default(),
    ]);
    assert!(!show.contains("Instances"), "{show}");

    rt.block_on(stop(conn, &online, &online_ctr));
    rt.block_on(stop(conn, &offline, &offline_ctr));
    rt.block_on(stop(conn, &train, &train_ctr));
    assert!(jobs_by_name(d).is_empty());
    drop((trainer, server, worker));
}
