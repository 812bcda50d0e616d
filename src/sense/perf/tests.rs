//! Tests of perf sensing: the pure rate derivation, access and budget parsing, and counting
//! this process where the kernel allows it.

use super::*;

fn raw(value: u64, enabled: u64, running: u64) -> RawCount {
    RawCount {
        value,
        time_enabled_ns: enabled,
        time_running_ns: running,
    }
}

fn sample(at: Instant, generation: u64, counts: [Option<RawCount>; 4]) -> PerfSample {
    PerfSample {
        at,
        generation,
        counts,
        groups: 1,
        fds: 4,
        read_errors: 0,
    }
}

#[test]
fn scaling_for_multiplexing() {
    // On the PMU the whole window: the raw delta.
    assert_eq!(
        scaled_delta(raw(100, 1000, 1000), raw(300, 2000, 2000)),
        Some(200.0)
    );
    // On the PMU half of the window: twice the raw delta.
    assert_eq!(
        scaled_delta(raw(100, 1000, 1000), raw(200, 2000, 1500)),
        Some(200.0)
    );
    // Scaled by the window, not by the history: cumulative scaling would give
    // 200 × 2000/1500 − 100 ≈ 166.7 here.
    assert_eq!(
        scaled_delta(raw(100, 1000, 1000), raw(200, 2000, 1500)),
        Some(200.0)
    );
    // Enabled but never on the PMU in the window: unknown.
    assert_eq!(scaled_delta(raw(100, 1000, 500), raw(100, 2000, 500)), None);
    // Neither time moved (the task did not run, or the root cgroup): raw delta.
    assert_eq!(
        scaled_delta(raw(100, 1000, 500), raw(100, 1000, 500)),
        Some(0.0)
    );
    assert_eq!(scaled_delta(raw(0, 0, 0), raw(42, 0, 0)), Some(42.0));
    // running > enabled cannot happen; never scale below the raw count.
    assert_eq!(scaled_delta(raw(0, 0, 0), raw(10, 5, 8)), Some(10.0));
    // Huge values do not overflow.
    let big = u64::MAX / 2;
    let d = scaled_delta(raw(0, 0, 0), raw(big, big, 1)).expect("scaled");
    assert!(d.is_finite() && d > 1e30);
}

#[test]
fn counter_reset_or_wrap_is_dropped() {
    assert_eq!(
        scaled_delta(raw(500, 1000, 1000), raw(100, 2000, 2000)),
        None
    );
    assert_eq!(
        scaled_delta(raw(500, 3000, 1000), raw(600, 2000, 2000)),
        None
    );
    assert_eq!(
        scaled_delta(raw(500, 1000, 3000), raw(600, 2000, 2000)),
        None
    );
    let at = Instant::now();
    let s = Duration::from_secs(1);
    let all = |v| [Some(raw(v, v, v)); 4];
    // Reopened counters (a new generation) start from zero: no window across them.
    assert!(PerfRates::between(&sample(at, 1, all(1000)), &sample(at + s, 2, all(10))).is_none());
    // Out of order or the same instant: no window.
    assert!(PerfRates::between(&sample(at + s, 1, all(0)), &sample(at, 1, all(10))).is_none());
    assert!(PerfRates::between(&sample(at, 1, all(0)), &sample(at, 1, all(10))).is_none());
    // Same generation but a counter went back: that metric is unknown, not negative.
    let r =
        PerfRates::between(&sample(at, 1, all(1000)), &sample(at + s, 1, all(10))).expect("window");
    assert_eq!(r.instructions, None);
    assert_eq!(r.ipc, None);
}

#[test]
fn ipc_and_miss_ratio() {
    let at = Instant::now();
    let prev = sample(
        at,
        3,
        [
            Some(raw(1_000, 100, 100)),
            Some(raw(1_000, 100, 100)),
            Some(raw(100, 100, 100)),
            Some(raw(10, 100, 100)),
        ],
    );
    // Grouped counters share times; the group ran half the window.
    let cur = sample(
        at + Duration::from_millis(500),
        3,
        [
            Some(raw(3_001_000, 1100, 600)),
            Some(raw(1_001_000, 1100, 600)),
            Some(raw(10_100, 1100, 600)),
            Some(raw(2_010, 1100, 600)),
        ],
    );
    let r = PerfRates::between(&prev, &cur).expect("window");
    assert_eq!(r.window, Duration::from_millis(500));
    assert_eq!(r.instructions, Some(6_000_000.0));
    assert_eq!(r.cycles, Some(2_000_000.0));
    assert_eq!(r.ipc, Some(3.0));
    assert_eq!(r.cache_miss_ratio, Some(0.2));
    assert_eq!(r.mpki, Some(4_000.0 * 1000.0 / 6_000_000.0));
    assert_eq!(r.running_fraction, Some(0.5));
    assert_eq!(r.per_second(r.instructions), Some(12_000_000.0));
}

#[test]
fn zero_deltas_and_missing_events_are_none_not_nan() {
    let at = Instant::now();
    let idle = [Some(raw(7, 0, 0)); 4];
    let r = PerfRates::between(
        &sample(at, 1, idle),
        &sample(at + Duration::from_secs(1), 1, idle),
    )
    .expect("window");
    assert_eq!(r.instructions, Some(0.0));
    assert_eq!(r.ipc, None, "0/0");
    assert_eq!(r.cache_miss_ratio, None, "0/0");
    assert_eq!(r.mpki, None);
    assert_eq!(r.running_fraction, None);
    // A PMU without cache events: only the cache metrics go.
    let prev = [Some(raw(0, 0, 0)), Some(raw(0, 0, 0)), None, None];
    let cur = [Some(raw(300, 10, 10)), Some(raw(100, 10, 10)), None, None];
    let r = PerfRates::between(
        &sample(at, 1, prev),
        &sample(at + Duration::from_secs(1), 1, cur),
    )
    .expect("window");
    assert_eq!(r.ipc, Some(3.0));
    assert_eq!(r.cache_miss_ratio, None);
    assert_eq!(r.cache_references, None);
    // Nothing countable at all.
    let r = PerfRates::between(
        &sample(at, 1, [None; 4]),
        &sample(at + Duration::from_secs(1), 1, [None; 4]),
    )
    .expect("window");
    assert_eq!(r.ipc, None);
    assert_eq!(r.per_second(None), None);
    let json = serde_json::to_value(r).expect("serializes");
    assert!(json["ipc"].is_null());
}

#[test]
fn fd_budget() {
    // A 192-CPU host counting a job by cgroup: 4 events × 192 CPUs.
    assert_eq!(FdBudget::fds_for(192, 4), 768);
    assert_eq!(FdBudget::fds_for(usize::MAX, 4), usize::MAX);
    // systemd's default soft limit keeps half for everything else.
    assert_eq!(FdBudget::for_limit(Some(1024)).cap, 512);
    // A raised limit keeps FD_RESERVE.
    assert_eq!(
        FdBudget::for_limit(Some(1_048_576)).cap,
        1_048_576 - FD_RESERVE
    );
    assert!(FdBudget::for_limit(None).cap > 1 << 40);
    let b = FdBudget {
        cap: 1000,
        used: 800,
    };
    assert_eq!(b.available(), 200);
    let over = FdBudget { cap: 10, used: 20 };
    assert_eq!(over.available(), 0);
}

#[test]
fn limits_and_capabilities_parse() {
    let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max open files            20000                524288               files     \n";
    assert_eq!(parse_nofile_soft(limits), Some(Some(20000)));
    assert_eq!(
        parse_nofile_soft(
            "Max open files            unlimited            unlimited            files\n"
        ),
        Some(None)
    );
    assert_eq!(parse_nofile_soft("Max cpu time 1 1 seconds\n"), None);
    assert_eq!(parse_nofile_soft("Max open files x y files\n"), None);
    assert_eq!(
        parse_cap_eff("Name:\tx\nCapEff:\t000001fffeffffff\n"),
        Some(0x1fffeffffff)
    );
    assert_eq!(parse_cap_eff("CapEff:\tzz\n"), None);
    assert_eq!(parse_cap_eff("Name:\tx\n"), None);
}

fn proc_fixture(paranoid: Option<&str>, cap_eff: &str, limits: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("sys/kernel")).expect("mkdir");
    std::fs::create_dir_all(dir.path().join("self")).expect("mkdir");
    if let Some(p) = paranoid {
        std::fs::write(dir.path().join(PARANOID_FILE), p).expect("write");
    }
    std::fs::write(
        dir.path().join(SELF_STATUS),
        format!("Name:\tlodgerd\nCapEff:\t{cap_eff}\n"),
    )
    .expect("write");
    std::fs::write(dir.path().join(SELF_LIMITS), limits).expect("write");
    dir
}

#[test]
fn access_rules_and_advice() {
    let root = proc_fixture(Some("2\n"), "0000000000000000", "");
    let a = PerfAccess::read(root.path()).expect("reads");
    assert_eq!(a.paranoid, Some(2));
    assert!(a.can_count_processes());
    assert!(!a.can_count_other_users());
    assert!(!a.can_count_cgroups());
    assert!(!a.can_count_kernel());
    let problems = a.problems(true);
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(problems[0].contains("CAP_PERFMON"), "{problems:?}");
    assert!(
        problems[0].contains("kernel.perf_event_paranoid=0"),
        "{problems:?}"
    );

    // Root's full set: everything.
    let root = proc_fixture(Some("4"), "000001ffffffffff", "");
    let a = PerfAccess::read(root.path()).expect("reads");
    assert!(a.privileged() && a.can_count_cgroups() && a.can_count_other_users());
    assert!(a.problems(true).is_empty());

    // Debian's paranoid 3 without capabilities: nothing.
    let root = proc_fixture(Some("3"), "0", "");
    let a = PerfAccess::read(root.path()).expect("reads");
    assert!(!a.can_count_processes());
    assert_eq!(a.problems(false).len(), 1);
    assert!(a.problems(false)[0].contains("AmbientCapabilities"));

    // CAP_PERFMON alone (bit 38), as the packaged unit has it: lifts paranoid and, since
    // perf_check_permission takes it in place of ptrace access, other users' processes.
    let root = proc_fixture(Some("2"), &format!("{:x}", 1u64 << 38), "");
    let a = PerfAccess::read(root.path()).expect("reads");
    assert!(a.can_count_cgroups() && a.can_count_other_users());
    assert!(a.problems(true).is_empty(), "{:?}", a.problems(true));
    // CAP_SYS_PTRACE alone (bit 19): other users' processes, but paranoid still applies.
    let root = proc_fixture(Some("2"), &format!("{:x}", 1u64 << 19), "");
    let a = PerfAccess::read(root.path()).expect("reads");
    assert!(a.can_count_other_users() && !a.can_count_cgroups());

    // A kernel without perf events.
    let root = proc_fixture(None, "0", "");
    let a = PerfAccess::read(root.path()).expect("reads");
    assert_eq!(a.paranoid, None);
    assert!(!a.can_count_processes());
    assert!(a.problems(false)[0].contains("CONFIG_PERF_EVENTS"));

    // Garbage, empty and missing files name the file.
    for bad in ["", "two"] {
        let root = proc_fixture(Some(bad), "0", "");
        match PerfAccess::read(root.path()) {
            Err(PerfError::Parse { path, .. }) => assert!(path.ends_with(PARANOID_FILE)),
            other => panic!("{other:?}"),
        }
    }
    let root = proc_fixture(Some("2"), "xyz", "");
    assert!(matches!(
        PerfAccess::read(root.path()),
        Err(PerfError::Parse { .. })
    ));
    let empty = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(empty.path().join("sys/kernel")).expect("mkdir");
    std::fs::write(empty.path().join(PARANOID_FILE), "2").expect("write");
    match PerfAccess::read(empty.path()) {
        Err(PerfError::Read { path, .. }) => assert!(path.ends_with(SELF_STATUS)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn budget_from_proc_limits() {
    let root = proc_fixture(
        Some("2"),
        "0",
        "Max open files            1024                 524288               files\n",
    );
    assert_eq!(FdBudget::from_proc(root.path()).expect("reads").cap, 512);
    let root = proc_fixture(Some("2"), "0", "");
    assert!(matches!(
        FdBudget::from_proc(root.path()),
        Err(PerfError::Parse { .. })
    ));
    assert!(
        FdBudget::from_proc(Path::new("/proc"))
            .expect("own limits")
            .cap
            > 0
    );
}

#[test]
fn finds_the_perf_event_hierarchy() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert_eq!(perf_cgroup_root(dir.path()), None);
    // Hybrid: v2 under unified/.
    std::fs::create_dir_all(dir.path().join("unified")).expect("mkdir");
    std::fs::write(dir.path().join("unified/cgroup.controllers"), "").expect("write");
    assert_eq!(
        perf_cgroup_root(dir.path()),
        Some(dir.path().join("unified"))
    );
    // Pure v2.
    std::fs::write(dir.path().join("cgroup.controllers"), "cpuset cpu").expect("write");
    assert_eq!(perf_cgroup_root(dir.path()), Some(dir.path().to_path_buf()));
    // A v1 perf_event mount takes the controller away from v2.
    std::fs::create_dir_all(dir.path().join("perf_event")).expect("mkdir");
    std::fs::write(dir.path().join("perf_event/cgroup.procs"), "").expect("write");
    assert_eq!(
        perf_cgroup_root(dir.path()),
        Some(dir.path().join("perf_event"))
    );
}

#[test]
fn scripted_counters_record_and_replay() {
    let mut c = ScriptedCounters::default();
    let j = JobId::from_seq(1);
    let s = sample(Instant::now(), 1, [None; 4]);
    c.samples.insert(j.clone(), s.clone());
    assert!(c.read().is_empty(), "not attached");
    c.attach(&j, &PerfTarget::Processes(vec![1]))
        .expect("attach");
    assert_eq!(c.read(), vec![(j.clone(), s)]);
    assert!(c.detach(&j));
    assert!(!c.detach(&j));
}

fn software_counters(grouping: Grouping) -> Option<PerfCounters> {
    let mut settings = PerfSettings::new(Path::new("/proc"));
    settings.source = EventSource::Software;
    settings.grouping = grouping;
    let c = PerfCounters::new(settings).expect("probe");
    if !c.status().available() {
        crate::privileged::skip(
            "perf software counters",
            "perf_event_open refuses even software events here",
        );
        return None;
    }
    Some(c)
}

/// Counts this test's own threads with software events (present on every kernel with perf),
/// grouped and ungrouped: task-clock must follow the CPU burned, including by a thread
/// started after attaching (inherit).
#[test]
fn counts_own_threads_with_inherit() {
    for grouping in [Grouping::Auto, Grouping::Ungrouped] {
        let Some(mut c) = software_counters(grouping) else {
            return;
        };
        let job = JobId::from_seq(7);
        // A helper thread that exists before attaching and spins until told to stop.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = stop.clone();
        let early = std::thread::spawn(move || {
            let mut x = 0u64;
            while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        });
        let attached = c
            .attach(&job, &PerfTarget::Processes(vec![std::process::id()]))
            .expect("attach");
        assert!(attached.groups >= 2, "{attached:?}");
        assert_eq!(attached.fds, attached.groups * 4);
        assert_eq!(c.budget().used, usize::try_from(attached.fds).expect("fds"));
        let first = c.read();
        assert_eq!(first.len(), 1);
        // A thread started after attaching: counted through inherit.
        // It burns 300 ms of its own CPU time (not wall time: on a loaded machine it may
        // get less than the whole CPU).
        let late = std::thread::spawn(|| {
            let cpu_ns = || {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: `ts` is a valid, writable timespec.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
            };
            let until = cpu_ns() + 300_000_000;
            let mut x = 0u64;
            while cpu_ns() < until {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        });
        late.join().expect("late thread");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        early.join().expect("early thread");
        let second = c.read();
        let r = PerfRates::between(&first[0].1, &second[0].1).expect("window");
        // task-clock in ns, in the Instructions slot: the late thread alone burned 300 ms.
        let task_ns = r.instructions.expect("task-clock");
        assert!(task_ns >= 250e6, "{grouping:?}: task-clock {task_ns} ns");
        assert_eq!(c.status().grouped, grouping == Grouping::Auto);
        assert!(c.detach(&job));
        assert_eq!(c.budget().used, 0);
        assert!(c.read().is_empty());
    }
}

#[test]
fn budget_refuses_and_gone_targets_fail_cleanly() {
    let Some(mut c) = software_counters(Grouping::Auto) else {
        return;
    };
    c.budget.cap = 3;
    let job = JobId::from_seq(1);
    match c.attach(&job, &PerfTarget::Processes(vec![std::process::id()])) {
        Err(PerfError::FdBudget { needed, cap: 3, .. }) => assert!(needed >= 4),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.budget().used, 0);
    c.budget.cap = 1 << 20;
    // pid_max is never a pid.
    match c.attach(&job, &PerfTarget::Processes(vec![4_194_304])) {
        Err(PerfError::TargetGone { .. }) => {}
        other => panic!("{other:?}"),
    }
    // A directory that is not a cgroup of the perf_event hierarchy.
    let dir = tempfile::tempdir().expect("tempdir");
    let target = PerfTarget::Cgroup {
        dir: dir.path().to_path_buf(),
        cpus: CpuSet::parse("0").expect("cpus"),
    };
    assert!(c.attach(&job, &target).is_err());
    assert_eq!(c.budget().used, 0);
    assert!(c.read().is_empty());
}

#[test]
fn perf_counters_are_send() {
    fn send<T: Send>() {}
    send::<PerfCounters>();
    send::<Box<dyn Counters>>();
}
