//! The Prometheus text endpoint (`metrics.listen`, off by default): `GET /metrics` renders the
//! agent's latest observations with `prometheus-client`. Metric names are documented in
//! `docs/metrics.md`. Touches only the agent's command channel and its listening socket.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::agent::{AgentHandle, Snapshot};

type Labels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Adds a gauge family, sets one value per label set, and registers it.
struct Builder {
    registry: Registry,
}

impl Builder {
    fn family(&mut self, name: &str, help: &str, values: Vec<(Labels, f64)>) {
        let family = Family::<Labels, FloatGauge>::default();
        for (labels, v) in values {
            if v.is_finite() {
                family.get_or_create(&labels).set(v);
            }
        }
        self.registry.register(name, help, family);
    }
}

/// Renders a snapshot in the Prometheus text format (OpenMetrics flavour).
pub fn render(snap: &Snapshot) -> String {
    let mut b = Builder {
        registry: Registry::with_prefix("lodger"),
    };
    let job_labels = |id: &str, name: &Option<String>| -> Labels {
        vec![
            ("job", id.to_string()),
            ("name", name.clone().unwrap_or_default()),
        ]
    };
    let jobs = &snap.jobs;
    b.family(
        "job_cpus",
        "CPUs held by the job (its cpuset)",
        jobs.iter()
            .map(|j| {
                (
                    job_labels(j.id.as_str(), &j.spec.label()),
                    j.cpus.len() as f64,
                )
            })
            .collect(),
    );
    b.family(
        "job_threads",
        "Threads of the job's processes",
        jobs.iter()
            .map(|j| {
                (
                    job_labels(j.id.as_str(), &j.spec.label()),
                    f64::from(j.threads),
                )
            })
            .collect(),
    );
    b.family(
        "job_rr_threads",
        "Threads of the job running SCHED_RR at the configured priority",
        jobs.iter()
            .map(|j| {
                (
                    job_labels(j.id.as_str(), &j.spec.label()),
                    f64::from(j.rr_threads),
                )
            })
            .collect(),
    );
    let rt_jobs = |f: fn(&crate::job::RtStanding) -> f64| -> Vec<(Labels, f64)> {
        jobs.iter()
            .filter_map(|j| {
                Some((
                    job_labels(j.id.as_str(), &j.spec.label()),
                    f(j.rt.as_ref()?),
                ))
            })
            .collect()
    };
    b.family(
        "job_rt_share_percent",
        "SCHED_RR training job: CPU time per CPU of its cpuset, percent (the kernel throttles \
         RT tasks above sched_rt_runtime_us / sched_rt_period_us)",
        rt_jobs(|r| r.share_percent),
    );
    b.family(
        "job_rt_near_limit",
        "1 while the SCHED_RR training job is within training.rt_headroom_percent of the RT limit",
        rt_jobs(|r| if r.near_limit { 1.0 } else { 0.0 }),
    );
    b.family(
        "job_rt_extra_cores",
        "Cores the RT guard added to the training job to keep it under the RT limit",
        rt_jobs(|r| f64::from(r.extra_cores)),
    );
    b.family(
        "job_runq_wait_ms_per_second",
        "Time the training job's threads spent runnable but not running, ms per second",
        rt_jobs(|r| r.runq_wait_ms_per_s),
    );
    let per_job = |f: fn(&crate::sense::JobMetrics) -> Option<f64>| -> Vec<(Labels, f64)> {
        jobs.iter()
            .filter_map(|j| {
                let m = snap.observations.jobs.get(&j.id)?;
                Some((job_labels(j.id.as_str(), &j.spec.label()), f(m)?))
            })
            .collect()
    };
    b.family(
        "job_cpu_percent",
        "CPU time used by the job, percent of one CPU",
        per_job(|m| m.cpu_percent),
    );
    b.family("job_ipc", "Instructions per cycle", per_job(|m| m.ipc));
    b.family(
        "job_cache_miss_percent",
        "Cache misses per cache reference, percent",
        per_job(|m| m.cache_miss_percent),
    );
    b.family(
        "job_gpu_percent",
        "The job's GPU utilization, percent (see lodger_source_info for nvml vs emulated)",
        per_job(|m| m.gpu_percent),
    );
    b.family(
        "job_membw_bytes_per_second",
        "The job's memory bandwidth (resctrl MBM)",
        per_job(|m| m.membw_bytes_per_s),
    );
    b.family(
        "job_net_rx_bytes_per_second",
        "Traffic received in the job's own network namespace (not measured for jobs in the host's)",
        per_job(|m| m.net_rx_bytes_per_s),
    );
    b.family(
        "job_net_tx_bytes_per_second",
        "Traffic sent from the job's own network namespace (not measured for jobs in the host's)",
        per_job(|m| m.net_tx_bytes_per_s),
    );
    b.family(
        "job_membw_domain_bytes_per_second",
        "The job's memory bandwidth per L3 domain (resctrl MBM)",
        jobs.iter()
            .filter_map(|j| Some((j, snap.observations.jobs.get(&j.id)?)))
            .flat_map(|(j, m)| {
                m.membw_domains.iter().map(move |(domain, v)| {
                    let mut labels = job_labels(j.id.as_str(), &j.spec.label());
                    labels.push(("domain", domain.to_string()));
                    (labels, *v)
                })
            })
            .collect(),
    );

    let node = &snap.observations.node;
    let scalar = |v: Option<f64>| v.map(|v| vec![(Labels::new(), v)]).unwrap_or_default();
    b.family(
        "node_cpu_percent",
        "Busy percent of all online CPUs together",
        scalar(node.cpu_percent),
    );
    b.family(
        "cpu_busy_percent",
        "Busy percent per CPU",
        node.per_cpu_percent
            .iter()
            .map(|(cpu, v)| (vec![("cpu", cpu.to_string())], *v))
            .collect(),
    );
    b.family(
        "node_cpu_pressure_percent",
        "PSI cpu some avg10: percent of time some task waited for a CPU",
        scalar(node.cpu_pressure_percent),
    );
    b.family(
        "node_memory_pressure_percent",
        "PSI memory some over the last pass: percent of time some task was stalled on memory",
        scalar(node.memory_pressure_percent),
    );
    b.family(
        "node_membw_bytes_per_second",
        "Memory bandwidth of the node (resctrl MBM)",
        scalar(node.membw_bytes_per_s),
    );
    let gpu = |f: fn(&crate::sense::GpuMetrics) -> Option<f64>| -> Vec<(Labels, f64)> {
        node.gpus
            .iter()
            .filter_map(|g| {
                Some((
                    vec![("gpu", g.index.to_string()), ("source", g.source.clone())],
                    f(g)?,
                ))
            })
            .collect()
    };
    b.family(
        "gpu_util_percent",
        "GPU utilization",
        gpu(|g| g.util_percent),
    );
    b.family(
        "gpu_memory_util_percent",
        "GPU memory controller utilization",
        gpu(|g| g.mem_util_percent),
    );
    b.family(
        "gpu_memory_used_bytes",
        "GPU memory in use",
        gpu(|g| g.mem_used_bytes.map(|v| v as f64)),
    );
    b.family("gpu_power_watts", "GPU power draw", gpu(|g| g.power_watts));
    b.family(
        "gpu_sm_clock_mhz",
        "GPU SM clock",
        gpu(|g| g.sm_clock_mhz.map(f64::from)),
    );
    b.family(
        "gpu_pcie_tx_bytes_per_second",
        "PCIe transmit throughput",
        gpu(|g| g.pcie_tx_bytes_per_s),
    );
    b.family(
        "gpu_pcie_rx_bytes_per_second",
        "PCIe receive throughput",
        gpu(|g| g.pcie_rx_bytes_per_s),
    );
    b.family(
        "net_rx_bytes_per_second",
        "Bytes received per second, per interface",
        node.net
            .iter()
            .map(|n| (vec![("interface", n.interface.clone())], n.rx_bytes_per_s))
            .collect(),
    );
    b.family(
        "net_tx_bytes_per_second",
        "Bytes sent per second, per interface",
        node.net
            .iter()
            .map(|n| (vec![("interface", n.interface.clone())], n.tx_bytes_per_s))
            .collect(),
    );
    let s = &snap.observations.sources;
    b.family(
        "source_info",
        "1 for each signal source, labelled with what it is doing (nvml, emulated, unavailable: ...)",
        [
            ("gpu", &s.gpu),
            ("perf", &s.perf),
            ("cpu", &s.cpu),
            ("membw", &s.membw),
            ("net", &s.net),
        ]
        .into_iter()
        .map(|(k, v)| (vec![("source", k.to_string()), ("state", v.clone())], 1.0))
        .collect(),
    );
    b.family(
        "sample_age_seconds",
        "Age of each signal source's newest sample; past sense.interval_ms + sense.deadline_ms the source is stale and its figures are left out",
        snap.observations
            .ages
            .iter()
            .map(|(k, a)| (vec![("source", k.clone())], a.age_s))
            .collect(),
    );
    b.family(
        "source_stale",
        "1 while a signal source is stale (its newest sample is past its deadline), else 0",
        snap.observations
            .ages
            .iter()
            .map(|(k, a)| (vec![("source", k.clone())], if a.stale { 1.0 } else { 0.0 }))
            .collect(),
    );
    // Lent CPU time and OOM kills (issue 19): counters per job, the lent time kept across
    // lodgerd restarts with the jobs. `value` picks a job's figure, `None` leaving it out.
    let counter_family =
        |b: &mut Builder,
         name: &str,
         help: &str,
         value: &dyn Fn(&crate::job::Job) -> Option<f64>| {
            let family = Family::<Labels, Counter<f64, AtomicU64>>::default();
            for j in jobs.iter() {
                if let Some(v) = value(j).filter(|v| v.is_finite() && *v >= 0.0) {
                    family
                        .get_or_create(&job_labels(j.id.as_str(), &j.spec.label()))
                        .inc_by(v);
                }
            }
            b.registry.register(name, help, family);
        };
    let training = |j: &crate::job::Job| j.spec.kind.role() == crate::job::Role::Training;
    let inference = |j: &crate::job::Job| j.spec.kind.is_inference();
    counter_family(
        &mut b,
        "job_lent_cpu_seconds",
        "CPU time lodgers used on a training job's cores",
        &|j| training(j).then_some(j.account.lent_s),
    );
    counter_family(
        &mut b,
        "job_idle_cpu_seconds",
        "Time a training job's cores were idle (nobody ran)",
        &|j| training(j).then_some(j.account.idle_s),
    );
    counter_family(
        &mut b,
        "job_lodged_cpu_seconds",
        "CPU time a lodger's instances used",
        &|j| inference(j).then_some(j.account.used_s),
    );
    counter_family(
        &mut b,
        "job_lodged_on_training_cpu_seconds",
        "The part of a lodger's CPU time on training jobs' cores",
        &|j| inference(j).then_some(j.account.on_training_s),
    );
    counter_family(
        &mut b,
        "job_instance_oom_kills",
        "Times the OOM killer took one of an inference job's instances (its memory limit, or \
         the node out of memory), since lodgerd started",
        &|j| inference(j).then(|| f64::from(j.instances.iter().map(|i| i.oom_kills).sum::<u32>())),
    );
    let throttles = Counter::<u64>::default();
    throttles.inc_by(snap.status.throttle_actions);
    b.registry.register(
        "throttle_actions",
        "Contention throttle steps and releases decided (SODA §V-E)",
        throttles,
    );
    let ticks = Counter::<u64>::default();
    ticks.inc_by(snap.status.ticks);
    b.registry
        .register("agent_ticks", "Agent loop passes completed", ticks);

    let mut out = String::new();
    if encode(&mut out, &b.registry).is_err() {
        // Encoding into a String cannot fail; keep the endpoint answering regardless.
        out = "# encoding failed\n".into();
    }
    out
}

/// Serves `GET /metrics` on `listen` until the process ends. Minimal HTTP/1.0: the endpoint is
/// meant for a local scraper, and a full HTTP stack for one read-only page is not worth its
/// weight in the daemon.
/// Reads until the blank line that ends the request head, the buffer is full or the client
/// stops sending: a request may arrive in several segments (a client writing the request line
/// piecewise), and answering the first of them would close the connection under the rest.
async fn read_request_head(
    sock: &mut (impl AsyncReadExt + Unpin),
    buf: &mut [u8],
) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let read = sock.read(&mut buf[n..]).await?;
        if read == 0 {
            break;
        }
        n += read;
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    Ok(n)
}

/// How one listener serves: at most `connections` at once (one more is closed at once), each
/// within `deadline`, request and reply together (a client that stops reading, or never sends
/// its request, is dropped then, not served forever), and `accept_retry` between failed
/// accepts (out of descriptors: the connection stays in the backlog, and trying again at once
/// would spin on it).
#[derive(Debug, Clone, Copy)]
struct Limits {
    connections: usize,
    deadline: std::time::Duration,
    accept_retry: std::time::Duration,
}

const LIMITS: Limits = Limits {
    connections: 64,
    deadline: std::time::Duration::from_secs(10),
    accept_retry: std::time::Duration::from_secs(1),
};

pub async fn serve(listen: SocketAddr, agent: AgentHandle) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    tracing::info!("Prometheus metrics on http://{listen}/metrics");
    let accept = || async {
        let (sock, peer) = listener.accept().await?;
        Ok((sock, peer.to_string()))
    };
    let page = move || {
        let agent = agent.clone();
        async move {
            match agent.snapshot().await {
                Ok(snap) => ("200 OK", render(&snap)),
                Err(e) => ("503 Service Unavailable", format!("{e}\n")),
            }
        }
    };
    accept_loop(accept, LIMITS, page).await;
    Ok(())
}

/// Accepts connections with `accept` for ever and answers each with `page` (the status and body
/// of `/metrics`) on a task of its own, within `limits`.
async fn accept_loop<S, A, AF, P, PF>(mut accept: A, limits: Limits, page: P)
where
    S: AsyncReadExt + AsyncWriteExt + Unpin + Send + 'static,
    A: FnMut() -> AF,
    AF: std::future::Future<Output = std::io::Result<(S, String)>>,
    P: Fn() -> PF + Clone + Send + 'static,
    PF: std::future::Future<Output = (&'static str, String)> + Send,
{
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.connections));
    loop {
        let (sock, peer) = match accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(
                    "metrics: accept failed: {e}; trying again in {:?}",
                    limits.accept_retry
                );
                tokio::time::sleep(limits.accept_retry).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(
                %peer,
                "metrics: {} connections open already: closed", limits.connections
            );
            continue;
        };
        let page = page.clone();
        tokio::spawn(async move {
            serve_connection(sock, &peer, limits.deadline, page).await;
            drop(slot);
        });
    }
}

/// Answers one connection (`page`: the status and body of `/metrics`), all of it within
/// `deadline`.
async fn serve_connection<S, F, Fut>(
    mut sock: S,
    peer: &str,
    deadline: std::time::Duration,
    page: F,
) where
    S: AsyncReadExt + AsyncWriteExt + Unpin,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = (&'static str, String)>,
{
    let answered = tokio::time::timeout(deadline, async {
        let mut buf = [0u8; 2048];
        let n = read_request_head(&mut sock, &mut buf).await?;
        let request = String::from_utf8_lossy(&buf[..n]);
        let path = request.split_whitespace().nth(1).unwrap_or("");
        debug!(%peer, path, "metrics request");
        let (status, body) = if !request.starts_with("GET ") {
            ("405 Method Not Allowed", "only GET\n".to_string())
        } else if path != "/metrics" {
            ("404 Not Found", "try /metrics\n".to_string())
        } else {
            page().await
        };
        let head = format!(
            "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        sock.write_all(head.as_bytes()).await?;
        sock.write_all(body.as_bytes()).await?;
        sock.shutdown().await
    })
    .await;
    if answered.is_err() {
        debug!(%peer, "metrics: connection dropped after {deadline:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that sends its request and then never reads the reply (a page larger than the
    /// connection's buffers) holds its connection no longer than the deadline.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_reads_is_dropped_at_the_deadline() {
        let (mut client, server) = tokio::io::duplex(64);
        client
            .write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            .await
            .expect("request");
        let served = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            serve_connection(server, "test", LIMITS.deadline, || async {
                ("200 OK", "x".repeat(100_000))
            }),
        )
        .await;
        assert!(served.is_ok(), "the connection outlived its deadline");
        drop(client);
    }

    /// Past the connection cap a connection is closed unanswered, and a connection that ends
    /// frees its slot for the next.
    #[tokio::test]
    async fn connections_past_the_cap_are_closed_until_one_ends() {
        use tokio::net::TcpStream;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let limits = Limits {
            connections: 2,
            deadline: std::time::Duration::from_secs(3600),
            ..LIMITS
        };
        let server = tokio::spawn(async move {
            let accept = || async {
                let (sock, peer) = listener.accept().await?;
                Ok((sock, peer.to_string()))
            };
            accept_loop(accept, limits, || async { ("200 OK", "ok\n".to_string()) }).await;
        });
        // What a client that sends its request gets back: the reply, or nothing when closed.
        async fn ask(addr: SocketAddr) -> String {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            let _ = c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await;
            let mut reply = Vec::new();
            let _ = c.read_to_end(&mut reply).await;
            String::from_utf8_lossy(&reply).into_owned()
        }
        assert!(ask(addr).await.starts_with("HTTP/1.0 200 OK"));
        // Two clients that never send their request hold both slots...
        let first = TcpStream::connect(addr).await.expect("connect");
        let _second = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(ask(addr).await, "", "a third is closed unanswered");
        // ...until one goes; the server may take a moment to notice.
        drop(first);
        let mut served = false;
        for _ in 0..500 {
            if ask(addr).await.starts_with("HTTP/1.0 200 OK") {
                served = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(served, "the slot the first client held was never freed");
        server.abort();
    }

    /// A failing accept (out of descriptors) is tried again after a wait, not in a spin.
    #[tokio::test(start_paused = true)]
    async fn a_failing_accept_is_retried_after_a_wait() {
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = calls.clone();
        let server = tokio::spawn(async move {
            let accept = move || {
                let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    if n >= 50 {
                        // A spinning loop stops here, having called 50 times at once.
                        std::future::pending::<()>().await;
                    }
                    Err::<(tokio::io::DuplexStream, String), _>(std::io::Error::from_raw_os_error(
                        libc::EMFILE,
                    ))
                }
            };
            accept_loop(accept, LIMITS, || async { ("200 OK", String::new()) }).await;
        });
        tokio::time::sleep(std::time::Duration::from_millis(10_500)).await;
        let n = calls.load(std::sync::atomic::Ordering::SeqCst);
        assert!((10..=12).contains(&n), "{n} accepts in 10.5 s");
        server.abort();
    }

    #[tokio::test]
    async fn a_request_head_sent_in_pieces_is_read_whole() {
        let (mut client, mut server) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            for piece in ["GET ", "/metrics", " HTTP/1.0\r\n", "\r\n"] {
                client.write_all(piece.as_bytes()).await.expect("write");
                tokio::task::yield_now().await;
            }
            client
        });
        let mut buf = [0u8; 2048];
        let n = read_request_head(&mut server, &mut buf)
            .await
            .expect("read");
        assert_eq!(&buf[..n], b"GET /metrics HTTP/1.0\r\n\r\n");
        // A client that stops sending early gets what it sent.
        drop(writer.await.expect("writer"));
        let (mut client, mut server) = tokio::io::duplex(64);
        client.write_all(b"GET /x").await.expect("write");
        drop(client);
        let n = read_request_head(&mut server, &mut buf)
            .await
            .expect("read");
        assert_eq!(&buf[..n], b"GET /x");
    }

    #[test]
    fn sample_ages_and_stale_sources_are_exported() {
        let mut observations = crate::sense::Observations::default();
        for (source, age_s, stale) in [("cpu", 0.25, false), ("gpu", 12.5, true)] {
            observations
                .ages
                .insert(source.into(), crate::sense::SourceAge { age_s, stale });
        }
        let snap = Snapshot {
            jobs: std::sync::Arc::default(),
            observations: std::sync::Arc::new(observations),
            status: crate::agent::NodeStatus::default(),
        };
        let text = render(&snap);
        for line in [
            "lodger_sample_age_seconds{source=\"cpu\"} 0.25",
            "lodger_sample_age_seconds{source=\"gpu\"} 12.5",
            "lodger_source_stale{source=\"cpu\"} 0",
            "lodger_source_stale{source=\"gpu\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(line)),
                "{line} not in\n{text}"
            );
        }
    }

    #[test]
    fn lent_cpu_time_is_exported_as_counters() {
        // A container registered through NRI is named by its pod (docs/kubernetes.md).
        let job: crate::job::Job = serde_json::from_value(serde_json::json!({
            "id": "j1",
            "spec": {
                "kind": "training",
                "name": null,
                "target": {"container": {"id": "c1", "pod": "ml/trainer-0", "name": "main",
                                         "cgroup": "/kubepods/pod1/c1"}},
                "gpus": [],
                "cores": 2,
            },
            "owner_uid": 0,
            "state": "running",
            "cpus": "1-2",
            "mems": "0",
            "pids": [],
            "threads": 0,
            "rr_threads": 0,
            "last_error": null,
            "registered_at": 0,
            "account": {"lent_s": 12.5, "idle_s": 2.5},
        }))
        .expect("job");
        let offline: crate::job::Job = serde_json::from_value(serde_json::json!({
            "id": "j2",
            "spec": {
                "kind": "offline",
                "name": null,
                "target": "instances",
                "gpus": [],
                "cores": 0,
            },
            "owner_uid": 0,
            "state": "running",
            "cpus": "1",
            "mems": "0",
            "pids": [],
            "threads": 0,
            "rr_threads": 0,
            "last_error": null,
            "registered_at": 0,
            "instances": [
                {"index": 0, "pid": 7, "cpus": "1", "threads": 1, "batch": 1, "state": "running",
                 "restarts": 2, "oom_kills": 2, "items_per_s": 0.0, "p50_ms": null, "p99_ms": null},
                {"index": 1, "pid": 8, "cpus": "2", "threads": 1, "batch": 1, "state": "running",
                 "restarts": 1, "oom_kills": 1, "items_per_s": 0.0, "p50_ms": null, "p99_ms": null},
            ],
        }))
        .expect("offline job");
        let snap = Snapshot {
            jobs: std::sync::Arc::new(vec![job, offline]),
            observations: std::sync::Arc::default(),
            status: crate::agent::NodeStatus::default(),
        };
        let text = render(&snap);
        for line in [
            "# TYPE lodger_job_lent_cpu_seconds counter",
            "lodger_job_lent_cpu_seconds_total{job=\"j1\",name=\"ml/trainer-0/main\"} 12.5",
            "lodger_job_idle_cpu_seconds_total{job=\"j1\",name=\"ml/trainer-0/main\"} 2.5",
            "lodger_job_instance_oom_kills_total{job=\"j2\",name=\"\"} 3",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(line)),
                "{line} not in\n{text}"
            );
        }
    }
}
