//! Sensing end to end: lodgerd's sampler, `lodgerctl top`, the emulated GPU source, the
//! NVML-absent path and the Prometheus endpoint, on a private bus.

mod common;

use std::io::{Read, Write};

use common::*;

fn top_json(d: &Daemon) -> serde_json::Value {
    d.ctl_json(&["top", "--once"])
}

#[test]
fn top_shows_the_emulated_gpu_and_cpu_of_a_job() {
    if !need_root("top_shows_the_emulated_gpu") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu_dir = dir.path().join("gpu");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: format!(
                "[sense]\ninterval_ms = 200\ngpu = \"emulated\"\nemulated_gpu_dir = \"{}\"\n",
                gpu_dir.display()
            ),
            ..DaemonOptions::default()
        },
    );
    let w = Workload::train_with(2, &["--publish-dir", gpu_dir.to_str().expect("utf-8")]);
    let id = d.register_pid(w.pid(), 1);
    let deadline = std::time::Instant::now() + WAIT;
    let last = loop {
        let last = top_json(&d);
        let m = &last["jobs"][0]["metrics"];
        if m["gpu_percent"].is_number() && m["cpu_percent"].is_number() {
            break last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "top never showed the job's GPU and CPU use; last: {last}\n{}",
            d.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let job = &last["jobs"][0];
    assert_eq!(job["id"], id.as_str());
    assert_eq!(job["metrics"]["gpu_source"], "emulated", "{last}");
    let gpu = job["metrics"]["gpu_percent"].as_f64().expect("gpu");
    assert!((0.0..=100.0).contains(&gpu), "{gpu}");
    assert!(
        last["sources"]["gpu"]
            .as_str()
            .is_some_and(|s| s.starts_with("emulated")),
        "{last}"
    );
    assert_eq!(last["node"]["gpus"][0]["source"], "emulated", "{last}");
    // The table says "emulated" too: it cannot be mistaken for a real GPU.
    let table = d.ctl_ok(&["top", "--once"]);
    assert!(table.contains("(emulated)"), "{table}");
    assert!(table.contains("gpu: emulated"), "{table}");
}

#[test]
fn without_nvml_lodgerd_starts_and_says_gpu_sensing_is_off() {
    if !need_root("without_nvml") {
        return;
    }
    if std::path::Path::new("/dev/nvidiactl").exists() {
        lodger::privileged::skip("without_nvml", "this machine has an NVIDIA driver");
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let top = top_json(&d);
    let gpu = top["sources"]["gpu"].as_str().expect("gpu source");
    assert!(gpu.starts_with("unavailable:"), "{gpu}");
    assert!(gpu.contains("libnvidia-ml"), "{gpu}");
    let log = d.log();
    assert_eq!(
        log.matches("GPU sensing off").count(),
        1,
        "one log line for the missing driver:\n{log}"
    );
}

#[test]
fn prometheus_endpoint_serves_job_and_source_metrics() {
    if !need_root("prometheus_endpoint") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // A free port: bind, read it, release.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
            ..DaemonOptions::default()
        },
    );
    let w = Workload::train(1);
    let id = d.register_pid(w.pid(), 1);
    let get = |path: &str| -> String {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        write!(s, "GET {path} HTTP/1.0\r\n\r\n").expect("send");
        let mut body = String::new();
        s.read_to_string(&mut body).expect("read");
        body
    };
    let mut page = String::new();
    wait_until(WAIT, "the metrics endpoint", || {
        page = std::net::TcpStream::connect(("127.0.0.1", port))
            .map(|_| get("/metrics"))
            .unwrap_or_default();
        page.contains("lodger_job_cpus")
    });
    assert!(page.starts_with("HTTP/1.0 200 OK"), "{page}");
    assert!(
        page.contains(&format!("lodger_job_cpus{{job=\"{id}\",name=\"\"}} 1")),
        "{page}"
    );
    assert!(page.contains("lodger_source_info{source=\"gpu\""), "{page}");
    assert!(get("/nope").starts_with("HTTP/1.0 404"));
}
