//! The state file's tests: round trips, quiet saves, migration from each older version, and
//! what is set aside.

use super::*;

#[test]
fn fresh_then_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path().join("sub"));
    assert!(matches!(store.load().unwrap(), Loaded::Fresh(_)));
    let state = State {
        next_seq: 7,
        ..State::default()
    };
    assert!(store.save(&state).unwrap());
    match store.load().unwrap() {
        Loaded::Found(s) => assert_eq!(s, state),
        other => panic!("{other:?}"),
    }
    // No temp file is left behind.
    let names: Vec<_> = fs::read_dir(dir.path().join("sub"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from(STATE_FILE)]);
}

#[test]
fn corrupt_file_is_set_aside_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    fs::write(store.path(), "{ not json").unwrap();
    match store.load().unwrap() {
        Loaded::SetAside {
            state, set_aside, ..
        } => {
            assert_eq!(state, State::default());
            assert_eq!(fs::read_to_string(set_aside).unwrap(), "{ not json");
            assert!(!store.path().exists());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_version_is_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    let state = State {
        version: 99,
        ..State::default()
    };
    fs::write(store.path(), serde_json::to_vec(&state).unwrap()).unwrap();
    assert!(matches!(store.load().unwrap(), Loaded::SetAside { .. }));
}

#[test]
fn a_save_of_what_is_on_disk_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    let mut state = State::default();
    assert!(store.save(&state).unwrap());
    assert!(!store.save(&state).unwrap());
    assert_eq!(store.writes(), 1);
    state.next_seq = 2;
    assert!(store.save(&state).unwrap());
    assert_eq!(store.writes(), 2);
    // A store that read the current file back does not rewrite it either.
    let mut again = Store::new(dir.path());
    assert!(matches!(again.load().unwrap(), Loaded::Found(_)));
    assert!(!again.save(&state).unwrap());
    assert_eq!(again.writes(), 0);
}

#[test]
fn a_newer_version_is_set_aside_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    let text = format!("{{\"version\": {}, \"future\": true}}", STATE_VERSION + 1);
    fs::write(store.path(), &text).unwrap();
    match store.load().unwrap() {
        Loaded::SetAside {
            set_aside, reason, ..
        } => {
            assert!(reason.contains("newer"), "{reason}");
            assert_eq!(fs::read_to_string(set_aside).unwrap(), text);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn text_that_is_not_a_state_is_an_error_with_a_message() {
    for (text, expect) in [
        ("", "not JSON"),
        ("[1, 2]", "no \"version\""),
        ("{\"version\": \"2\"}", "no \"version\""),
        ("{\"version\": 0}", "never written"),
        ("{\"version\": 18446744073709551615}", "newer"),
        ("{\"version\": 2}", "shape"),
        ("{\"version\": 1, \"jobs\": []}", "migrate"),
        ("{\"version\": 1, \"jobs\": {\"j1\": 3}}", "job j1"),
        (
            "{\"version\": 1, \"jobs\": {\"j1\": {\"tuning\": 3}}}",
            "'tuning'",
        ),
        ("\u{feff}{}", "not JSON"),
    ] {
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains(expect), "{text:?}: {err}");
    }
}

/// A file written by lodgerd's first state version (`testdata/state-v1.json`, saved by that
/// version's agent with a training job mid-window, one not right-sized, and an owner's
/// history): migrated, every job kept, the window under way kept but for its samples.
#[test]
fn a_version_1_file_is_migrated_keeping_every_job() {
    let text = include_str!("testdata/state-v1.json");
    let v1: serde_json::Value = serde_json::from_str(text).unwrap();
    assert_eq!(v1["version"], 1);
    let parsed = parse(text).unwrap();
    assert_eq!(parsed.migrated_from, Some(1));
    let state = parsed.state;
    assert_eq!(state.version, STATE_VERSION);
    assert_eq!(state.next_seq, 3);
    let ids: Vec<&str> = state.jobs.keys().map(JobId::as_str).collect();
    assert_eq!(ids, ["j1", "j2"]);
    for (id, stored) in &state.jobs {
        let old = &v1["jobs"][id.as_str()];
        assert_eq!(
            serde_json::to_value(&stored.job).unwrap(),
            old["job"],
            "{id}"
        );
        assert_eq!(
            serde_json::to_value(&stored.record).unwrap(),
            old["record"],
            "{id}"
        );
    }
    let tuning = state.jobs[&JobId::from_seq(1)].tuning.as_ref().unwrap();
    assert_eq!(tuning.tuner.cores(), 4);
    assert_eq!(tuning.last_sample_ms, 0);
    assert!(state.jobs[&JobId::from_seq(2)].tuning.is_none());
    assert_eq!(state.plan.training.len(), 2);
    assert_eq!(
        state
            .owner_history
            .largest_per_gpu(1000, crate::job::Category::Cv),
        Some(3)
    );
    // Written back, it is a current file that reads as itself.
    let current = serde_json::to_string(&state).unwrap();
    let again = parse(&current).unwrap();
    assert_eq!(again.migrated_from, None);
    assert_eq!(again.state, state);
}

#[test]
fn a_store_loads_a_version_1_file_as_migrated_and_rewrites_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    fs::write(store.path(), include_str!("testdata/state-v1.json")).unwrap();
    let state = match store.load().unwrap() {
        Loaded::Migrated { state, from: 1 } => state,
        other => panic!("{other:?}"),
    };
    // Not the bytes on disk: the first save writes the current version.
    assert!(store.save(&state).unwrap());
    let on_disk: serde_json::Value =
        serde_json::from_slice(&fs::read(store.path()).unwrap()).unwrap();
    assert_eq!(on_disk["version"], STATE_VERSION);
    assert!(on_disk["jobs"]["j1"]["tuning"]
        .get("last_sample_ms")
        .is_none());
}

#[test]
fn a_file_that_is_not_utf8_is_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    fs::write(store.path(), b"\xff\xfe{}").unwrap();
    match store.load().unwrap() {
        Loaded::SetAside { reason, .. } => assert!(reason.contains("UTF-8"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

/// The intent of registering job `seq` for process `pid` (start time 4242) on `cpus`.
fn intent(seq: u64, pid: u32, cpus: &str) -> Pending {
    Pending {
        id: JobId::from_seq(seq),
        target: crate::job::Target::Pids(vec![pid]),
        placement: crate::policy::Placement {
            cpus: crate::cpuset::CpuSet::parse(cpus).unwrap(),
            mems: crate::cpuset::CpuSet::parse("0").unwrap(),
        },
        job: None,
        authorized: vec![crate::enforce::RootProcess {
            pid,
            start_time: 4242,
        }],
        cpusets: None,
    }
}

/// `intent` answered, with the v1 test file's job.
fn answered(intent: &Pending) -> Pending {
    Pending {
        job: Some(Box::new(
            parse(include_str!("testdata/state-v1.json"))
                .unwrap()
                .state
                .jobs
                .into_values()
                .next()
                .expect("a job in the v1 file"),
        )),
        ..intent.clone()
    }
}

/// An answered registration's pending file (issue 21) is read back with its job, and any
/// later save (a write, or a state the file already holds) supersedes and removes it.
#[test]
fn a_committed_pending_file_is_kept_until_a_save() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    let state = State::default();
    assert!(store.save(&state).unwrap());
    let pending = intent(1, 100, "1");
    store.write_pending(&pending).unwrap();
    assert!(
        !store.committed(),
        "an intent is not an answered registration"
    );
    assert!(!store.save(&state).unwrap());
    assert!(
        dir.path().join(PENDING_FILE).exists(),
        "a save does not remove an unanswered intent"
    );
    let answered = answered(&pending);
    store.commit_pending(&answered).unwrap();
    assert!(store.committed());
    let read = Store::new(dir.path())
        .take_pending()
        .expect("the pending file");
    assert_eq!(read, answered, "read back with its job");
    store.commit_pending(&answered).unwrap();
    // The state the file already holds: nothing written, the record superseded all the same.
    assert!(!store.save(&state).unwrap());
    assert!(!store.committed());
    assert!(!dir.path().join(PENDING_FILE).exists());
}

/// The pending file is written in place, a line per step (issue 21 item 1): an answer's record cut
/// short by a kill reads as the intent (the registration is undone, its caller got no answer),
/// a file left empty before the intent was whole reads as nothing under way, and a file of
/// lodger before (one record, no newline) reads as it did.
#[test]
fn a_pending_file_is_read_by_its_last_whole_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(PENDING_FILE);
    let intent = intent(7, 4321, "2-3");
    let answered = answered(&intent);
    let mut store = Store::new(dir.path());
    store.write_pending(&intent).unwrap();
    store.commit_pending(&answered).unwrap();
    let whole = std::fs::read(&path).unwrap();
    assert_eq!(
        whole.iter().filter(|&&b| b == b'\n').count(),
        2,
        "a line per step"
    );
    assert_eq!(
        Store::new(dir.path()).take_pending(),
        Some(answered.clone())
    );

    // Killed inside the answer's write: every cut of its record reads as the intent (one cut
    // only of its newline leaves the record whole, and it is read as answered).
    let first = whole.iter().position(|&b| b == b'\n').unwrap() + 1;
    for cut in [first, first + 1, first + 40, whole.len() - 2] {
        std::fs::write(&path, &whole[..cut]).unwrap();
        assert_eq!(
            Store::new(dir.path()).take_pending(),
            Some(intent.clone()),
            "cut at {cut} of {}",
            whole.len()
        );
        assert!(!path.exists(), "taken");
    }
    // Killed before the intent was written: nothing was touched, nothing is set aside.
    std::fs::write(&path, b"").unwrap();
    assert_eq!(Store::new(dir.path()).take_pending(), None);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // The file lodger wrote before: one record, renamed into place, no newline.
    std::fs::write(&path, serde_json::to_vec(&answered).unwrap()).unwrap();
    assert_eq!(Store::new(dir.path()).take_pending(), Some(answered));
    // A new intent replaces whatever a failed clear left.
    store.write_pending(&intent).unwrap();
    assert_eq!(Store::new(dir.path()).take_pending(), Some(intent));
}

/// A pending file that cannot be read is not undone, and not lost either: it is set aside
/// beside the state file, for the operator (its job's threads may still be real-time).
#[test]
fn an_unreadable_pending_file_is_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::new(dir.path());
    std::fs::write(dir.path().join(PENDING_FILE), b"{\"id\":\"j1\"}").unwrap();
    assert!(store.take_pending().is_none());
    assert!(!dir.path().join(PENDING_FILE).exists());
    let kept: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&format!("{PENDING_FILE}.unreadable-")))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
}
