//! Spine benchmark (run as root: `scripts/bench-spine`; it builds the examples first).
//!
//! 1. Registration latency: 200 registrations of a 16-thread training emulator through D-Bus;
//!    for each, the time until `RegisterJob` returns and until every thread is seen SCHED_RR on
//!    its cpuset (read from /proc by this process), p50/p99.
//! 2. Steady-state enforcement cost, real kernel: 50 jobs (50 real processes, 200 threads) held
//!    by one `Enforcer`, CPU time per tick of applying all 50, against a baseline of 1 job.
//! 3. lodgerd idle over 60 s: CPU time and RSS with 50 registered jobs (simulated enforcement on
//!    the 64-CPU fixture topology, since this 2-CPU machine cannot host 50 placements) against the
//!    same lodgerd with no job.
#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use lodger::cpuset::CpuSet;
use lodger::enforce::{EnforceSettings, Enforcer, JobRecord};
use lodger::job::{JobId, Target};
use zbus::zvariant::Value;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// utime + stime of a process, in clock ticks, and its VmRSS in KiB.
fn cpu_and_rss(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let cpu = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    (cpu, rss)
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

fn registration_latency() {
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(14);
    let pid = w.pid();
    let threads = tids(pid).len();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let conn = rt
        .block_on(
            zbus::connection::Builder::address(bus.address.as_str())
                .expect("address")
                .build(),
        )
        .expect("connect");
    let proxy = rt
        .block_on(lodger::api::proxy::ManagerProxy::new(&conn))
        .expect("proxy");
    let mut to_return = Vec::new();
    let mut to_all_rr = Vec::new();
    for _ in 0..200 {
        let mut spec: HashMap<&str, Value<'_>> = HashMap::new();
        spec.insert("kind", Value::from("training"));
        spec.insert("pids", Value::from(vec![pid]));
        spec.insert("cores", Value::from(1u32));
        let t0 = Instant::now();
        let (id, _) = rt.block_on(proxy.register_job(spec)).expect("register");
        let t1 = Instant::now();
        while !all_rr_on(pid, 10, "1") {
            assert!(t0.elapsed() < WAIT, "threads never became RR");
            std::hint::spin_loop();
        }
        let t2 = Instant::now();
        to_return.push(t1 - t0);
        to_all_rr.push(t2 - t0);
        rt.block_on(proxy.unregister_job(&id)).expect("unregister");
        assert!(all_other(pid), "unregister did not revert");
    }
    to_return.sort();
    to_all_rr.sort();
    println!(
        "registration of a {threads}-thread process, 200 runs: RegisterJob returned p50 {:.2} ms p99 {:.2} ms; every thread RR on its cpuset p50 {:.2} ms p99 {:.2} ms (after return: p50 {:.3} ms)",
        ms(percentile(&to_return, 0.5)),
        ms(percentile(&to_return, 0.99)),
        ms(percentile(&to_all_rr, 0.5)),
        ms(percentile(&to_all_rr, 0.99)),
        ms(percentile(&to_all_rr, 0.5).saturating_sub(percentile(&to_return, 0.5))),
    );
    drop(d);
}

fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn steady_enforcement_cost() {
    let parent = unique("lodger-bench");
    let enforcer = Enforcer::new(EnforceSettings {
        parent: parent.clone(),
        ..EnforceSettings::default()
    })
    .expect("enforcer");
    let cpus = CpuSet::parse("1").expect("cpus");
    let mems = CpuSet::parse("0").expect("mems");
    let workloads: Vec<Workload> = (0..50).map(|_| Workload::train(2)).collect();
    let mut jobs: Vec<(JobId, Target, JobRecord)> = workloads
        .iter()
        .enumerate()
        .map(|(i, w)| {
            (
                JobId::from_seq(i as u64 + 1),
                Target::Pids(vec![w.pid()]),
                JobRecord::default(),
            )
        })
        .collect();
    let mut measure = |n: usize, ticks: u32| -> Duration {
        // First applies register; the steady state comes after.
        for (id, t, r) in jobs.iter_mut().take(n) {
            enforcer.apply(id, t, &cpus, &mems, r).expect("apply");
        }
        let c0 = thread_cpu_time();
        for _ in 0..ticks {
            for (id, t, r) in jobs.iter_mut().take(n) {
                let o = enforcer.apply(id, t, &cpus, &mems, r).expect("apply");
                assert!(o.alive);
            }
        }
        (thread_cpu_time() - c0) / ticks
    };
    let one = measure(1, 200);
    let fifty = measure(50, 50);
    let threads: usize = workloads.iter().map(|w| tids(w.pid()).len()).sum();
    println!(
        "steady enforcement (real cgroup v1 + SCHED_RR sweep): 1 job {:.1} us/tick, 50 jobs ({threads} threads) {:.1} us/tick = {:.3}% of one CPU at a 1 s interval; per job {:.1} us ({:.1}x the 1-job figure per job)",
        one.as_secs_f64() * 1e6,
        fifty.as_secs_f64() * 1e6,
        fifty.as_secs_f64() * 100.0,
        fifty.as_secs_f64() * 1e6 / 50.0,
        fifty.as_secs_f64() / 50.0 / one.as_secs_f64(),
    );
    for (id, t, r) in &jobs {
        enforcer.release(id, t, r).expect("release");
    }
}

fn lodgerd_idle(seconds: u64) {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sysfs/server-2s-64cpu-8gpu");
    let run = |jobs: usize| -> (f64, u64) {
        let bus = PrivateBus::start();
        let dir = tempfile::tempdir().expect("tempdir");
        let d = Daemon::start(
            &bus,
            dir.path(),
            DaemonOptions {
                reserved: "auto",
                interval_ms: 1000,
                sysfs_root: Some(fixture.clone()),
                sim: true,
                ..DaemonOptions::default()
            },
        );
        let workloads: Vec<Workload> = (0..jobs).map(|_| Workload::train(2)).collect();
        for w in &workloads {
            d.register_pid(w.pid(), 1);
        }
        let pid = d.pid();
        let (c0, _) = cpu_and_rss(pid);
        std::thread::sleep(Duration::from_secs(seconds));
        let (c1, rss) = cpu_and_rss(pid);
        let cpu_pct = (c1 - c0) as f64 / clk_tck() / seconds as f64 * 100.0;
        (cpu_pct, rss)
    };
    let (base_cpu, base_rss) = run(0);
    let (cpu, rss) = run(50);
    println!(
        "lodgerd idle over {seconds} s (1 s interval, simulated enforcement, 64-CPU fixture): 0 jobs {base_cpu:.3}% CPU {base_rss} KiB RSS; 50 jobs {cpu:.3}% CPU {rss} KiB RSS (RSS {:.2}x)",
        rss as f64 / base_rss.max(1) as f64
    );
}

fn main() {
    if !lodger::privileged::need_root("bench spine") {
        return;
    }
    let seconds = std::env::var("LODGER_BENCH_IDLE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    registration_latency();
    steady_enforcement_cost();
    lodgerd_idle(seconds);
}
