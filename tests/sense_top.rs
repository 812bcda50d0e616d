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

/// `lodgerctl top | head -n 5`: the reader goes away while top refreshes. lodgerctl ends
/// quietly with status 0, not with print!'s panic (status 101) at its next write.
#[test]
fn top_into_a_pipe_whose_reader_went_away_ends_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    if !need_root("top_into_a_pipe_whose_reader_went_away_ends_quietly") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            sim: true,
            ..DaemonOptions::default()
        },
    );
    let mut top = Command::new(bin("lodgerctl"))
        .args(["top", "--refresh", "0.1"])
        .env("DBUS_SYSTEM_BUS_ADDRESS", &d.bus_address)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("lodgerctl top");
    // As head does: read the first line, then close the pipe.
    let mut reader = BufReader::new(top.stdout.take().expect("stdout"));
    let mut first = String::new();
    reader.read_line(&mut first).expect("top's first line");
    assert!(!first.is_empty(), "top printed nothing");
    drop(reader);
    let deadline = std::time::Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = top.try_wait().expect("wait for lodgerctl") {
            break Some(status);
        }
        if std::time::Instant::now() >= deadline {
            let _ = top.kill();
            let _ = top.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut stderr = String::new();
    top.stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    let status = status.unwrap_or_else(|| panic!("lodgerctl top went on writing: {stderr}"));
    assert!(!stderr.contains("panicked"), "{status}: {stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
}

#[test]
fn without_nvml_lodgerd_starts_and_says_gpu_sensing_is_off() {
    if !need_root("without_nvml") {
        return;
    }
    if std::path::Path::new("/dev/nvidiactl").exists() {
        // The host has the hardware this test is about the absence of: not a missing
        // privilege, and not missing hardware either (LODGER_REQUIRE_HARDWARE=1 is set on
        // exactly the hosts that have a GPU).
        lodger::privileged::not_applicable(
            "without_nvml",
            "this machine has an NVIDIA driver (/dev/nvidiactl)",
        );
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

/// Copies a resctrl fixture tree (plain files: lodgerd's writes land there, and the test plays
/// the kernel's part).
fn copy_tree(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).expect("create copy root");
    for entry in std::fs::read_dir(src).expect("read fixture dir") {
        let entry = entry.expect("fixture entry");
        let to = dst.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).expect("copy fixture file");
        }
    }
}

#[test]
fn per_job_memory_bandwidth_from_a_resctrl_fixture_tree() {
    if !need_root("per_job_memory_bandwidth") {
        return;
    }
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let resctrl = dir.path().join("resctrl");
    copy_tree(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/resctrl/intel-mba-mbm"),
        &resctrl,
    );
    // A group a killed lodgerd left behind, and another tool's group.
    let stale = resctrl.join("mon_groups/lodger-j77");
    std::fs::create_dir_all(&stale).expect("stale group");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: format!(
                "[sense]\ninterval_ms = 200\nresctrl_root = \"{}\"\n\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n",
                resctrl.display()
            ),
            ..DaemonOptions::default()
        },
    );
    wait_until(WAIT, "the stale group to be swept", || !stale.exists());
    assert!(
        resctrl.join("mon_groups/j1").is_dir(),
        "another tool's group stays"
    );
    // The sweep logs after it removed the group: wait for the line, not only the removal.
    wait_until(WAIT, "the sweep's log line", || {
        d.log()
            .contains("left by an earlier lodgerd: mon_groups/lodger-j77")
    });

    let w = Workload::train(2);
    let id = d.register_pid(w.pid(), 1);
    let group = resctrl.join(format!("mon_groups/lodger-{id}"));
    let listed = |group: &std::path::Path| -> bool {
        let tasks = std::fs::read_to_string(group.join("tasks")).unwrap_or_default();
        let tasks: Vec<u32> = tasks.lines().filter_map(|l| l.parse().ok()).collect();
        let threads = tids(w.pid());
        !threads.is_empty() && threads.iter().all(|t| tasks.contains(t))
    };
    wait_until(
        WAIT,
        "every thread of the job in its monitoring group",
        || listed(&group),
    );

    // The kernel's part: counters per L3 domain that grow, about 1 GB/s on domain 0 and
    // 2 GB/s on domain 1.
    let counter = |d: &str| group.join("mon_data").join(d).join("mbm_total_bytes");
    for d in ["mon_L3_00", "mon_L3_01"] {
        std::fs::create_dir_all(counter(d).parent().expect("parent")).expect("mon_data");
        std::fs::write(counter(d), "0\n").expect("counter");
    }
    let running = Arc::new(AtomicBool::new(true));
    let memory = {
        let running = running.clone();
        let (c0, c1) = (counter("mon_L3_00"), counter("mon_L3_01"));
        std::thread::spawn(move || {
            // Written whole, as the kernel's counters read: `fs::write` truncates before it
            // writes, and a read in between saw an empty file, a parse error that left the job
            // without a bandwidth for that pass (the metrics page then lacked its series).
            let set = |path: &std::path::Path, value: u64| {
                let next = path.with_extension("next");
                let _ = std::fs::write(&next, format!("{value}\n"))
                    .and_then(|()| std::fs::rename(&next, path));
            };
            // The counters follow the clock, 1 and 2 bytes a nanosecond, as the kernel's
            // count traffic: a writer held up by a loaded machine leaves them stale for a
            // moment but does not lower the rate they show over the next interval (counting
            // per wake-up did, and a loaded CI run read 0.75 GB/s).
            let start = std::time::Instant::now();
            while running.load(Ordering::SeqCst) {
                let n = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX / 2);
                set(&c0, n);
                set(&c1, 2 * n);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })
    };
    let deadline = std::time::Instant::now() + WAIT;
    let last = loop {
        let last = top_json(&d);
        let m = &last["jobs"][0]["metrics"];
        if m["membw_bytes_per_s"].as_f64().is_some_and(|b| b > 0.0)
            && m["membw_domains"]["1"].as_f64().is_some_and(|b| b > 0.0)
        {
            break last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "top never showed the job's memory bandwidth; last: {last}\n{}",
            d.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let m = &last["jobs"][0]["metrics"];
    let (d0, d1) = (
        m["membw_domains"]["0"].as_f64().expect("domain 0"),
        m["membw_domains"]["1"].as_f64().expect("domain 1"),
    );
    let total = m["membw_bytes_per_s"].as_f64().expect("total");
    assert!((total - (d0 + d1)).abs() < 1.0, "{m}");
    assert!((0.5e9..6e9).contains(&total), "about 3 GB/s: {m}");
    // The table's MEMBW column (the one before NET), and Prometheus, per job and per domain.
    // One sample may straddle a moment the counters' writer was held up, so the table is read
    // until it shows the rate in G/s.
    let membw_shown = || {
        d.ctl_ok(&["top", "--once"])
            .lines()
            .find(|l| l.starts_with(&id))
            .and_then(|row| row.split_whitespace().rev().nth(1))
            .is_some_and(|membw| membw.ends_with("G/s"))
    };
    wait_until_explained(
        WAIT,
        "the MEMBW column to show about 3 G/s",
        membw_shown,
        || d.ctl_ok(&["top", "--once"]),
    );
    let page = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        write!(s, "GET /metrics HTTP/1.0\r\n\r\n").expect("send");
        let mut body = String::new();
        s.read_to_string(&mut body).expect("read");
        body
    };
    assert!(
        page.contains(&format!(
            "lodger_job_membw_bytes_per_second{{job=\"{id}\",name=\"\"}}"
        )),
        "{page}"
    );
    assert!(
        page.contains(&format!(
            "lodger_job_membw_domain_bytes_per_second{{job=\"{id}\",name=\"\",domain=\"1\"}}"
        )),
        "{page}"
    );
    running.store(false, Ordering::SeqCst);
    memory.join().expect("counter thread");

    // lodgerd stops: it removes the job's group. On resctrl rmdir takes the kernel's files
    // with it; here they stay, and the attempt shows as a warning naming the group.
    let removal = format!("cannot remove resctrl group {}", group.display());
    assert!(!d.log().contains(&removal), "{}", d.log());
    d.stop();
    assert!(d.log().contains(&removal), "{}", d.log());

    // The next lodgerd finds the group a stale one (the kernel's files gone, as rmdir would
    // have taken them), sweeps it and makes a new one for the re-adopted job.
    std::fs::remove_dir_all(group.join("mon_data")).expect("kernel files");
    std::fs::remove_file(group.join("tasks")).expect("kernel files");
    d.restart();
    wait_until(WAIT, "the re-adopted job's new group", || listed(&group));
    assert!(
        d.log().contains(&format!(
            "left by an earlier lodgerd: mon_groups/lodger-{id}"
        )),
        "{}",
        d.log()
    );
}

#[test]
fn job_whose_monitoring_group_is_refused_is_shown_unavailable_and_said_once() {
    if !need_root("job_whose_monitoring_group_is_refused") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let resctrl = dir.path().join("resctrl");
    copy_tree(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/resctrl/amd"),
        &resctrl,
    );
    // The first job's group cannot be made: a file holds its name. The kernel's usual refusal
    // is ENOSPC (no free RMID), which a plain directory cannot give; lodgerd treats both alike.
    std::fs::write(resctrl.join("mon_groups/lodger-j1"), "").expect("squat the name");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: format!(
                "[sense]\ninterval_ms = 200\nresctrl_root = \"{}\"\n",
                resctrl.display()
            ),
            ..DaemonOptions::default()
        },
    );
    let w = Workload::train(1);
    let id = d.register_pid(w.pid(), 1);
    assert_eq!(id, "j1");
    let mut last = serde_json::Value::Null;
    wait_until(
        WAIT,
        "top to say the job's bandwidth is unavailable",
        || {
            last = top_json(&d);
            last["jobs"][0]["metrics"]["membw_unavailable"].is_string()
        },
    );
    let why = last["jobs"][0]["metrics"]["membw_unavailable"]
        .as_str()
        .expect("reason")
        .to_string();
    assert!(why.contains("mon_groups/lodger-j1"), "{why}");
    assert!(
        last["jobs"][0]["metrics"]["membw_bytes_per_s"].is_null(),
        "{last}"
    );
    // The node is still measured.
    assert_eq!(last["sources"]["membw"], "resctrl MBM", "{last}");
    let table = d.ctl_ok(&["top", "--once"]);
    let row = table.lines().find(|l| l.starts_with("j1")).expect("row");
    // MEMBW is the column before NET.
    assert_eq!(row.split_whitespace().rev().nth(1), Some("n/a"), "{table}");
    assert!(
        table.contains("j1: memory bandwidth unavailable: cannot create resctrl group"),
        "{table}"
    );
    // Many passes later: still one log line, no error loop.
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let log = d.log();
    assert_eq!(
        log.matches("per-job memory bandwidth unavailable for this job")
            .count(),
        1,
        "{log}"
    );
}

/// Per-job network traffic (issue: sensing, item 5): a job with a network namespace of its own
/// (as a container or pod has) gets its namespace's rx/tx rates; a job in the host's namespace
/// is said not to be attributable.
#[test]
fn per_job_network_of_a_job_in_its_own_namespace() {
    const TEST: &str = "per_job_network";
    if !need_root(TEST) {
        return;
    }
    let ok = |args: &[&str]| {
        std::process::Command::new("ip")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    };
    let ns = format!("lodger-net-{}", std::process::id());
    if !ok(&["netns", "add", &ns]) {
        lodger::privileged::skip(TEST, "cannot create a network namespace (ip netns add)");
        return;
    }
    struct Netns(String);
    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
        }
    }
    let _guard = Netns(ns.clone());
    // A veth pair inside the namespace: what the job sends out of one end is its traffic.
    assert!(ok(&[
        "-n", &ns, "link", "add", "ln0", "type", "veth", "peer", "name", "ln1"
    ]));
    assert!(ok(&[
        "-n",
        &ns,
        "addr",
        "add",
        "10.79.0.1/24",
        "dev",
        "ln0"
    ]));
    assert!(ok(&["-n", &ns, "link", "set", "ln0", "up"]));
    assert!(ok(&["-n", &ns, "link", "set", "ln1", "up"]));
    // A neighbour that is not there, with a static link-layer address so that every datagram
    // leaves ln0 (unresolved, only an ARP request would, about once a second: on a slow machine
    // the sensing passes could all miss it).
    assert!(ok(&[
        "-n",
        &ns,
        "neigh",
        "add",
        "10.79.0.2",
        "lladdr",
        "02:00:00:4c:4f:44",
        "dev",
        "ln0",
        "nud",
        "permanent"
    ]));
    // The job: UDP datagrams to that neighbour (sent all the same). Killed when the test ends,
    // however it ends.
    let mut job = Workload::adopt(
        std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns,
                "bash",
                "-c",
                "while true; do echo lodger-lodger-lodger > /dev/udp/10.79.0.2/9; sleep 0.01; done",
            ])
            .spawn()
            .expect("spawn the job"),
    );
    let host_job = Workload::train(1);

    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            reserved: "",
            extra: "[sense]\ninterval_ms = 200\n".to_string(),
            ..DaemonOptions::default()
        },
    );
    let id = d.register_pid(job.pid(), 1);
    let host_id = d.register_pid(host_job.pid(), 1);
    let deadline = std::time::Instant::now() + WAIT;
    let (own, host) = loop {
        let top = top_json(&d);
        let metrics = |id: &str| {
            top["jobs"]
                .as_array()
                .and_then(|jobs| jobs.iter().find(|j| j["id"] == id))
                .map(|j| j["metrics"].clone())
                .unwrap_or_default()
        };
        let (own, host) = (metrics(&id), metrics(&host_id));
        // Both jobs' metrics: the host job, registered after the other, can be a sensing pass
        // behind it (a VM run found its metrics still empty when the first job's traffic showed).
        if own["net_tx_bytes_per_s"]
            .as_f64()
            .is_some_and(|tx| tx > 0.0)
            && host.get("net_unavailable").is_some()
        {
            break (own, host);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no traffic measured for {id}, or no network figure said for {host_id}: {top}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    job.kill();
    // Each datagram is at least 42 bytes on the wire and the job sends tens per second.
    let tx = own["net_tx_bytes_per_s"].as_f64().unwrap_or(0.0);
    assert!(tx > 100.0, "{own}");
    assert!(own.get("net_unavailable").is_none(), "{own}");
    assert!(host["net_tx_bytes_per_s"].is_null(), "{host}");
    assert!(
        host["net_unavailable"]
            .as_str()
            .is_some_and(|w| w.contains("host's network namespace")),
        "{host}"
    );
}
