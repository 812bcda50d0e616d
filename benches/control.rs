//! The control surface during a slow stop (issue 16): the latency of `GetStatus` and `ListJobs`
//! over D-Bus while lodgerd stops an offline instance that ignores SIGTERM (it ends only at
//! SIGKILL, after `inference.stop_grace_seconds`), beside an idle baseline from the same run
//! (the same job running, nothing stopping). Run as root: `cargo bench --bench control`.
//!
//! Calls are paced every `LODGER_BENCH_PACE_MS` (default 10) in both windows, alternating status
//! and list; the idle window lasts `LODGER_BENCH_IDLE_S` (default 5), the stop window until the
//! instances are gone (about the grace, `LODGER_BENCH_GRACE_S`, default 10). Target: p99 under
//! 20 ms during the stop.
#[path = "../tests/common/mod.rs"]
mod common;
#[allow(dead_code)] // The helpers the workload benchmarks use.
mod support;

use std::time::{Duration, Instant};

use common::*;
use lodger::api::proxy::ManagerProxy;
use support::*;
use zbus::zvariant::Value;

const TARGET_P99_MS: f64 = 20.0;

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn percentile(sorted_ms: &[f64], p: f64) -> f64 {
    if sorted_ms.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted_ms.len() as f64).ceil() as usize;
    sorted_ms[rank.clamp(1, sorted_ms.len()) - 1]
}

struct Window {
    status_ms: Vec<f64>,
    list_ms: Vec<f64>,
}

impl Window {
    fn line(&mut self, what: &str) -> (f64, String) {
        let mut all: Vec<f64> = self
            .status_ms
            .iter()
            .chain(&self.list_ms)
            .copied()
            .collect();
        for v in [&mut self.status_ms, &mut self.list_ms, &mut all] {
            v.sort_by(f64::total_cmp);
        }
        let p99 = percentile(&all, 99.0);
        (
            p99,
            format!(
                "{what}: {} calls, status p50 {:.2} ms p99 {:.2} ms, list p50 {:.2} ms p99 {:.2} ms, \
                 both p99 {p99:.2} ms max {:.2} ms",
                all.len(),
                percentile(&self.status_ms, 50.0),
                percentile(&self.status_ms, 99.0),
                percentile(&self.list_ms, 50.0),
                percentile(&self.list_ms, 99.0),
                all.last().copied().unwrap_or(f64::NAN),
            ),
        )
    }
}

/// Calls status and list in turn every `pace` while `go` holds.
fn measure(
    rt: &tokio::runtime::Runtime,
    proxy: &ManagerProxy<'_>,
    pace: Duration,
    mut go: impl FnMut() -> bool,
) -> Window {
    let mut w = Window {
        status_ms: Vec::new(),
        list_ms: Vec::new(),
    };
    let mut turn = 0u64;
    while go() {
        let next = Instant::now() + pace;
        let t = Instant::now();
        if turn % 2 == 0 {
            rt.block_on(proxy.get_status()).expect("GetStatus");
            w.status_ms.push(t.elapsed().as_secs_f64() * 1e3);
        } else {
            rt.block_on(proxy.list_jobs()).expect("ListJobs");
            w.list_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        turn += 1;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    w
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not.
    if !std::env::args().any(|a| a == "--bench") {
        println!("control benchmark: run it with `cargo bench --bench control`");
        return;
    }
    if !need_root("control benchmark") {
        return;
    }
    let pace = Duration::from_millis(env_u64("LODGER_BENCH_PACE_MS", 10));
    let idle = Duration::from_secs(env_u64("LODGER_BENCH_IDLE_S", 5));
    let grace = env_u64("LODGER_BENCH_GRACE_S", 10);
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: format!("[inference]\nstop_grace_seconds = {grace}\n"),
            ..DaemonOptions::default()
        },
    );
    let (rt, proxy) = bus.manager();

    // An offline job whose instances ignore SIGTERM (and so do their children).
    let command: Vec<&str> = vec!["/bin/sh", "-c", "trap '' TERM; sleep 300 & wait"];
    let mut spec = std::collections::HashMap::new();
    spec.insert("kind", Value::from("offline"));
    spec.insert("command", Value::from(command));
    spec.insert("max_batch", Value::from(1u32));
    let (id, _) = rt.block_on(proxy.register_job(spec)).expect("RegisterJob");
    let mut pids: Vec<u32> = Vec::new();
    wait_until(WAIT, "the instances running", || {
        pids = d.job(&id)["instances"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|i| i["state"] == "running")
                    .filter_map(|i| i["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
                    .filter(|p| *p > 0)
                    .collect()
            })
            .unwrap_or_default();
        !pids.is_empty()
    });

    let load_before = load_average();
    let start = Instant::now();
    let mut idle_w = measure(&rt, &proxy, pace, || start.elapsed() < idle);

    let t = Instant::now();
    rt.block_on(proxy.unregister_job(&id))
        .expect("UnregisterJob");
    let unregister_ms = t.elapsed().as_secs_f64() * 1e3;
    let stopping = Instant::now();
    let mut stop_w = measure(&rt, &proxy, pace, || pids.iter().any(|p| alive(*p)));
    let stop_s = stopping.elapsed().as_secs_f64();
    let load_after = load_average();

    let (idle_p99, idle_line) = idle_w.line("idle (the job running, nothing stopping)");
    let (stop_p99, stop_line) = stop_w.line(&format!(
        "during the slow stop ({:.1} s until SIGKILL ended it; grace {grace} s)",
        stop_s
    ));
    println!(
        "control surface during a slow stop (GetStatus / ListJobs over D-Bus, every {pace:?})"
    );
    println!("  {idle_line}");
    println!("  {stop_line}");
    println!("  UnregisterJob returned in {unregister_ms:.2} ms (the stop goes on in later ticks)");
    println!(
        "  p99 during the stop {stop_p99:.2} ms (target < {TARGET_P99_MS} ms: {}), {:.2}x the idle p99",
        if stop_p99 < TARGET_P99_MS { "met" } else { "MISSED" },
        stop_p99 / idle_p99
    );
    println!("  load average before {load_before}, after {load_after}");
}
