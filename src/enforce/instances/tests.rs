//! Tests of the instance runner that need no root: templates, finding programs, report lines and
//! windows, back-off, exit descriptions.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use super::error::{InstanceError, TemplateProblem};
use super::report::{parse_report, pooled, weighted_percentile, ReportLog};
use super::supervisor::{backoff_delay, describe_exit};
use super::template::{find_program, show_argv, validate_template, Placeholder, Template};
use super::*;
use crate::cpuset::CpuSet;
use crate::job::JobId;

fn job() -> JobId {
    JobId::parse("j7").expect("job id")
}

fn argv(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn spec(args: &[&str]) -> InstanceSpec {
    InstanceSpec {
        job: job(),
        index: 2,
        argv: argv(args),
        cpus: CpuSet::parse("1,3-4").expect("cpus"),
        mems: CpuSet::new(),
        threads: 3,
        batch: 16,
        offline: false,
        identity: Identity::default(),
        memory_max: None,
    }
}

fn problem(e: InstanceError) -> TemplateProblem {
    match e {
        InstanceError::Template { problem, .. } => problem,
        other => panic!("not a template error: {other}"),
    }
}

#[test]
fn templates_expand_placeholders() {
    let s = spec(&[
        "/bin/server",
        "--threads={threads}",
        "-b",
        "{batch}",
        "--cpus",
        "{cpus}",
        "{job}/{instance}",
        "{{literal}}",
    ]);
    let t = Template::parse(&s.job, &s.argv).expect("parses");
    assert_eq!(
        t.expand(&s),
        argv(&[
            "/bin/server",
            "--threads=3",
            "-b",
            "16",
            "--cpus",
            "1,3-4",
            "j7/2",
            "{literal}"
        ])
    );
    assert!(t.uses(Placeholder::Cpus));
    let plain = Template::parse(&s.job, &argv(&["x", "{threads}"])).expect("parses");
    assert!(!plain.uses(Placeholder::Cpus));
    // An empty argument stays an argument.
    let empty = Template::parse(&s.job, &argv(&["x", ""])).expect("parses");
    assert_eq!(empty.expand(&s), argv(&["x", ""]));
}

#[test]
fn bad_templates_say_what_is_wrong() {
    let j = job();
    assert_eq!(
        problem(Template::parse(&j, &[]).expect_err("empty")),
        TemplateProblem::Empty
    );
    assert_eq!(
        problem(Template::parse(&j, &argv(&["  "])).expect_err("blank")),
        TemplateProblem::Empty
    );
    let e = Template::parse(&j, &argv(&["srv", "--n={thread}"])).expect_err("unknown");
    let text = e.to_string();
    assert!(
        text.contains("{thread}") && text.contains("{threads}"),
        "{text}"
    );
    assert!(text.contains("srv --n={thread}"), "{text}");
    assert_eq!(
        problem(e),
        TemplateProblem::UnknownPlaceholder {
            arg: 1,
            text: "--n={thread}".into(),
            name: "thread".into()
        }
    );
    assert!(matches!(
        problem(Template::parse(&j, &argv(&["srv", "{batch"])).expect_err("open")),
        TemplateProblem::UnmatchedBrace {
            brace: '{',
            arg: 1,
            ..
        }
    ));
    assert!(matches!(
        problem(Template::parse(&j, &argv(&["srv", "a}b"])).expect_err("close")),
        TemplateProblem::UnmatchedBrace { brace: '}', .. }
    ));
}

#[test]
fn programs_are_found_like_execvp() {
    assert!(find_program("sh").is_ok());
    assert!(matches!(
        find_program("lodger-no-such-program-xyz"),
        Err(TemplateProblem::ProgramNotFound { .. })
    ));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("not-exec");
    fs::write(&file, "#!/bin/sh\n").expect("write");
    let p = file.to_str().expect("utf-8").to_string();
    assert!(matches!(
        find_program(&p),
        Err(TemplateProblem::NotExecutable { .. })
    ));
    fs::set_permissions(&file, fs::Permissions::from_mode(0o755)).expect("chmod");
    assert_eq!(find_program(&p).expect("found"), file);
    let dir_path = dir.path().to_str().expect("utf-8");
    assert!(matches!(
        find_program(dir_path),
        Err(TemplateProblem::NotExecutable { .. })
    ));
    let e = validate_template(&job(), &argv(&["lodger-no-such-program-xyz", "{batch}"]))
        .expect_err("missing");
    assert!(e.to_string().contains("absolute path"), "{e}");
    // A program given by a placeholder is checked at start, not here.
    assert!(validate_template(&job(), &argv(&["{job}"])).is_ok());
}

#[test]
fn shows_templates_quoted() {
    assert_eq!(
        show_argv(&argv(&["a", "b c", "it's", "--x={threads}"])),
        r"a 'b c' 'it'\''s' --x={threads}"
    );
}

#[test]
fn report_lines_parse_and_reject() {
    let r = parse_report(br#"{"items":8,"latency_ms":12.5,"queue_ms":3}"#).expect("ok");
    assert_eq!(r.items, 8);
    assert_eq!(r.latency_ms, 12.5);
    assert_eq!(r.queue_ms, Some(3.0));
    let r = parse_report(br#"{"latency_ms":1,"items":1,"extra":"ignored"}"#).expect("ok");
    assert_eq!(r.queue_ms, None);
    for bad in [
        &br#"{"items":-1,"latency_ms":1}"#[..],
        br#"{"items":1}"#,
        br#"{"items":1,"latency_ms":-2}"#,
        br#"items=1"#,
        b"",
    ] {
        assert!(
            parse_report(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn report_log_joins_partial_lines_and_counts_bad_ones() {
    let key = spec(&["x"]).key();
    let mut log = ReportLog::default();
    let t = Instant::now();
    assert_eq!(log.feed(&key, br#"{"items":2,"lat"#, t), 0);
    assert_eq!(log.feed(&key, b"ency_ms\":4}\n\n{\"items\":1,", t), 1);
    assert_eq!(log.feed(&key, b"\"latency_ms\":8}\r\nnot json\n", t), 1);
    assert_eq!(log.reports_total, 2);
    assert_eq!(log.items_total, 3);
    assert_eq!(log.bad_total, 1);
    // A line longer than the limit is dropped as one bad line, up to its end.
    let long = vec![b'x'; MAX_REPORT_LINE + 10];
    assert_eq!(log.feed(&key, &long, t), 0);
    assert_eq!(
        log.feed(&key, b"yyy\n{\"items\":5,\"latency_ms\":1}\n", t),
        1
    );
    assert_eq!(log.bad_total, 2);
    assert_eq!(log.items_total, 8);
}

#[test]
fn window_rates_and_percentiles_weigh_items() {
    let key = spec(&["x"]).key();
    let mut log = ReportLog::default();
    let start = Instant::now();
    let now = start + Duration::from_secs(20);
    // Outside the 10 s window.
    log.feed(
        &key,
        b"{\"items\":1000,\"latency_ms\":500}\n",
        start + Duration::from_secs(5),
    );
    // 98 items at 10 ms, 1 item at 50 ms, 1 at 100 ms, inside it.
    log.feed(
        &key,
        b"{\"items\":98,\"latency_ms\":10,\"queue_ms\":1}\n{\"items\":1,\"latency_ms\":50}\n",
        start + Duration::from_secs(15),
    );
    log.feed(
        &key,
        b"{\"items\":1,\"latency_ms\":100}\n",
        start + Duration::from_secs(16),
    );
    let w = log.summary(now, Duration::from_secs(10), Some(start));
    assert_eq!(w.span, Duration::from_secs(10));
    assert!((w.items_per_s - 10.0).abs() < 1e-9, "{}", w.items_per_s);
    assert_eq!(w.p50, Some(10.0));
    assert_eq!(w.p99, Some(50.0));
    assert_eq!(w.queue_p99, Some(1.0));
    // A process younger than the window: the rate is over its age.
    let young = log.summary(
        now,
        Duration::from_secs(10),
        Some(start + Duration::from_secs(15)),
    );
    assert_eq!(young.span, Duration::from_secs(5));
    assert!((young.items_per_s - 20.0).abs() < 1e-9);
    log.trim(now, Duration::from_secs(10));
    assert_eq!(log.recent.len(), 3);
    assert_eq!(weighted_percentile(&mut [], 990), None);
    assert_eq!(weighted_percentile(&mut [(3.0, 0)], 500), None);
}

/// A probe's latency over several instances pools their batches: one slow batch among an
/// instance's 21 is that instance's own p99, but one in 121 is above the job's p99. Batches
/// outside the window, or from before a younger process started, do not count.
#[test]
fn pooled_latency_counts_every_instance_batch() {
    let key = spec(&["x"]).key();
    let start = Instant::now();
    let now = start + Duration::from_secs(20);
    let window = Duration::from_secs(10);
    let batch = |ms: u32| format!("{{\"items\":1,\"latency_ms\":{ms}}}\n");
    let mut a = ReportLog::default();
    a.feed(
        &key,
        batch(10).repeat(20).as_bytes(),
        start + Duration::from_secs(15),
    );
    a.feed(&key, batch(80).as_bytes(), start + Duration::from_secs(16));
    let mut b = ReportLog::default();
    b.feed(&key, batch(500).as_bytes(), start + Duration::from_secs(5));
    b.feed(&key, batch(300).as_bytes(), start + Duration::from_secs(12));
    b.feed(
        &key,
        batch(10).repeat(100).as_bytes(),
        start + Duration::from_secs(14),
    );
    assert_eq!(a.summary(now, window, Some(start)).p99, Some(80.0));
    // b's process restarted at 13 s: the 300-ms batch was its predecessor's.
    let since_b = Some(start + Duration::from_secs(13));
    let p = pooled([(&a, Some(start)), (&b, since_b)], now, window).unwrap();
    assert_eq!((p.p50_ms, p.p99_ms, p.batches), (10.0, 10.0, 121));
    // Without the restart, its 300-ms batch is in the window too: 2 slow of 122.
    let p = pooled([(&a, Some(start)), (&b, Some(start))], now, window).unwrap();
    assert_eq!((p.p99_ms, p.batches), (80.0, 122));
    assert_eq!(pooled([], now, window), None);
    let idle = ReportLog::default();
    assert_eq!(pooled([(&idle, Some(start))], now, window), None);
}

#[test]
fn backoff_doubles_up_to_the_cap() {
    let one = Duration::from_secs(1);
    let cap = Duration::from_secs(60);
    let got: Vec<u64> = (1..=8)
        .map(|f| backoff_delay(f, one, cap).as_secs())
        .collect();
    assert_eq!(got, vec![1, 2, 4, 8, 16, 32, 60, 60]);
    assert_eq!(backoff_delay(u32::MAX, one, cap), cap);
    assert_eq!(backoff_delay(0, one, cap), one);
}

#[test]
fn exits_are_described() {
    assert_eq!(
        describe_exit(ExitStatus::from_raw(3 << 8)),
        "exited with status 3"
    );
    assert_eq!(describe_exit(ExitStatus::from_raw(9)), "killed by SIGKILL");
}

#[test]
fn the_oom_score_written_at_spawn_is_the_units() {
    assert_eq!(
        super::LODGER_OOM_SCORE_ADJ.to_string().as_bytes(),
        super::LODGER_OOM_SCORE_ADJ_TEXT
    );
}

/// Issue 17: on cgroup v2 without systemd as PID 1, affinity-placed instances start in lodger's
/// own subtree; everywhere else they have a place of their own already (a unit, a cgroup).
#[test]
fn own_subtree_is_lodgers_lodgers_cgroup_only_on_v2_by_affinity_without_systemd() {
    use super::supervisor::own_subtree;
    use crate::enforce::PinMethod;
    use crate::sys::cgroupfs::CgroupVersion;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("lodger/lodgers");
    for (version, placement, systemd) in [
        (CgroupVersion::V1, PinMethod::Cgroup, false),
        (CgroupVersion::V1, PinMethod::Affinity, false),
        (CgroupVersion::V2, PinMethod::Cgroup, false),
        (CgroupVersion::V2, PinMethod::Affinity, true),
    ] {
        assert_eq!(own_subtree(version, placement, systemd, &dir), None);
        assert!(!dir.exists(), "{version:?} {placement:?} {systemd}");
    }
    assert_eq!(
        own_subtree(CgroupVersion::V2, PinMethod::Affinity, false, &dir),
        Some(dir.clone())
    );
    assert!(dir.is_dir());
    // Not creatable (lodgerd confined to a delegated subtree): none, and they stay put.
    let file = root.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    assert_eq!(
        own_subtree(
            CgroupVersion::V2,
            PinMethod::Affinity,
            false,
            &file.join("lodgers")
        ),
        None
    );
}

/// Instance `index` of [`spec`]'s job on CPUs `list`.
fn spec_on(index: u32, list: &str) -> InstanceSpec {
    InstanceSpec {
        index,
        cpus: CpuSet::parse(list).expect("cpus"),
        ..spec(&["/bin/true"])
    }
}

/// A slot for [`spec_on`] in `state`, with a process (not a real one: nothing signals it).
fn slot_on(index: u32, list: &str, state: super::supervisor::SlotState) -> super::supervisor::Slot {
    use super::supervisor::{Run, Slot};
    let spec = spec_on(index, list);
    let template = Template::parse(&spec.job, &spec.argv).expect("template");
    let mut slot = Slot::new(spec, template, state);
    slot.run = Some(Run {
        child: None,
        unit: None,
        adopted: None,
        pid: 1000 + index,
        started: Instant::now(),
        report: None,
    });
    slot
}

/// A slot's state once SIGTERM was sent (SIGKILL not yet).
fn stopping() -> super::supervisor::SlotState {
    super::supervisor::SlotState::Stopping {
        kill_at: Instant::now(),
        killed_at: None,
        stuck: false,
        next: None,
    }
}

/// Which CPUs hold a start or move back: a stopping instance's (an online one's only), and those
/// an online instance waiting to move serves on (everyone's), in a chain; a swap of two moves
/// waits for nothing of its own, only for what one of them waits for.
#[test]
fn held_cpus_follow_waiting_moves_but_a_swap_alone_holds_nothing() {
    use super::hold::{held_cpus, must_wait, Held};
    use super::supervisor::{Slot, SlotState};
    let cpus = |list: &str| CpuSet::parse(list).expect("cpus");
    let (at, slot) = (spec_on, slot_on);
    let moving = |index: u32, list: &str| SlotState::Moving {
        to: at(index, list),
    };
    let offline = |index: u32, list: &str| InstanceSpec {
        offline: true,
        ..at(index, list)
    };
    // 0 stops on CPU 5; 1 moves from 1 to 2 and 5; 2 moves from 2 to 1 (a swap with 1).
    let mut slots = vec![
        slot(0, "5", stopping()),
        slot(1, "1", moving(1, "2,5")),
        slot(2, "2", moving(2, "1")),
    ];
    let waits = |slots: &[Slot], i: usize| {
        let SlotState::Moving { to } = &slots[i].state else {
            panic!("not moving");
        };
        must_wait(to, &held_cpus(slots, Some(i), &[]))
    };
    // 1 waits for 0; 2 for 1, which serves on CPU 1 until it moves.
    assert!(waits(&slots, 1) && waits(&slots, 2));
    let held = held_cpus(&slots, None, &[]);
    assert_eq!((&held.stopping, &held.serving), (&cpus("5"), &cpus("1,2")));
    // An offline instance waits for CPUs an online instance still serves on, not for a
    // stopping instance's.
    assert!(must_wait(&offline(3, "1"), &held));
    assert!(!must_wait(&offline(3, "5"), &held));
    assert!(must_wait(&at(3, "5"), &held));
    // 0 gone: the swap waits for nothing.
    slots.remove(0);
    assert!(!waits(&slots, 0) && !waits(&slots, 1));
    assert_eq!(held_cpus(&slots, None, &[]), Held::default());
    // A stuck stopping process (SIGKILL did not end it) holds nothing.
    let mut stuck = slot(3, "1", stopping());
    if let SlotState::Stopping { stuck, .. } = &mut stuck.state {
        *stuck = true;
    }
    slots.push(stuck);
    assert_eq!(held_cpus(&slots, None, &[]), Held::default());
}

/// With the node's cores known, an offline instance waits too for the SMT sibling of a CPU an
/// online instance still serves on while it waits to move (placement never puts an offline
/// instance beside an online thread); an online instance does not (its own job's cores are
/// whole cores, another job's sibling is a last resort placement chose), and without the cores
/// only the CPU itself holds.
#[test]
fn an_offline_instance_waits_for_the_sibling_of_a_serving_online_cpu() {
    use super::hold::{held_cpus, must_wait};
    use super::supervisor::SlotState;
    let cpus = |list: &str| CpuSet::parse(list).expect("cpus");
    let offline = |index: u32, list: &str| InstanceSpec {
        offline: true,
        ..spec_on(index, list)
    };
    // Two-thread cores: 0/4, 1/5, 2/6, 3/7. 0 stops on CPU 2; 1 serves on CPU 1 and waits to
    // move onto 2.
    let cores = [cpus("0,4"), cpus("1,5"), cpus("2,6"), cpus("3,7")];
    let slots = vec![
        slot_on(0, "2", stopping()),
        slot_on(
            1,
            "1",
            SlotState::Moving {
                to: spec_on(1, "2"),
            },
        ),
    ];
    let held = held_cpus(&slots, None, &cores);
    assert_eq!(
        (&held.serving, &held.serving_cores),
        (&cpus("1"), &cpus("1,5"))
    );
    assert!(
        must_wait(&offline(3, "5"), &held),
        "beside the serving thread"
    );
    assert!(!must_wait(&offline(3, "3"), &held));
    assert!(
        !must_wait(&spec_on(3, "5"), &held),
        "an online one does not"
    );
    let unknown = held_cpus(&slots, None, &[]);
    assert!(!must_wait(&offline(3, "5"), &unknown));
    assert!(must_wait(&offline(3, "1"), &unknown));
}

/// An instance whose back-off is over but whose CPUs a stopping instance still runs on waits
/// (`poll` starts it once they are free): shown `waiting`, not `backing-off` with a 0-s retry,
/// its restarts and last exit kept, and still backing off underneath (what makes its job's
/// state Error). Before its back-off is over, or once nothing holds its CPUs, it is backing off.
#[test]
fn an_instance_past_its_back_off_waiting_for_held_cpus_is_shown_waiting() {
    use super::supervisor::{stats_of, SlotState};
    let now = Instant::now();
    let mut crashed = slot_on(1, "5", SlotState::BackingOff { at: now });
    crashed.run = None;
    crashed.restarts = 2;
    crashed.last_exit = Some("exited with status 1".into());
    let mut slots = vec![slot_on(0, "5", stopping()), crashed];
    let shown = |slots: &[super::supervisor::Slot]| {
        stats_of(slots, now, Duration::from_secs(10), &[])
            .into_iter()
            .find(|s| s.index == 1)
            .expect("instance 1")
    };
    let held = shown(&slots);
    assert_eq!(held.state.as_str(), "waiting", "{:?}", held.state);
    assert_eq!(
        held.state,
        InstanceState::BackingOff {
            retry_in: Duration::ZERO,
            waits: true
        }
    );
    assert_eq!(held.restarts, 2);
    assert_eq!(held.last_exit.as_deref(), Some("exited with status 1"));
    // Its back-off not over yet: backing off, held or not.
    slots[1].state = SlotState::BackingOff {
        at: now + Duration::from_secs(3),
    };
    let early = shown(&slots);
    assert_eq!(early.state.as_str(), "backing-off");
    assert_eq!(
        early.state,
        InstanceState::BackingOff {
            retry_in: Duration::from_secs(3),
            waits: false
        }
    );
    // Over, and the stopping instance gone: the next poll starts it.
    slots[1].state = SlotState::BackingOff { at: now };
    slots.remove(0);
    assert_eq!(shown(&slots).state.as_str(), "backing-off");
}
