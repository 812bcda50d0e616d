//! Reloading the config (SIGHUP, what `systemctl reload lodgerd` sends) under a registered job,
//! as root: the live keys change, the others are refused and kept, a broken file changes
//! nothing, and the job is never dropped.

mod common;

use common::*;

#[test]
fn a_reload_applies_live_keys_refuses_the_rest_and_keeps_the_jobs() {
    if !need_root("a_reload_applies_live_keys_refuses_the_rest_and_keeps_the_jobs") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(&bus, dir.path(), DaemonOptions::default());
    let w = Workload::train(1);
    let id = d.register_pid(w.pid(), 1);
    let before = d.job(&id);
    let status = d.ctl_json(&["status"]);
    assert_eq!(status["interval_ms"], 100);
    assert!(
        status["contention"]
            .as_str()
            .is_some_and(|c| c.starts_with("enforce")),
        "{status}"
    );

    // A live key (the tick), live sections, and a key that needs a restart.
    let text = std::fs::read_to_string(&d.config).expect("config");
    let changed = text
        .replace("interval_ms = 100", "interval_ms = 250")
        .replace("level = \"debug\"", "level = \"info\"")
        + "\n[rightsize]\nmode = \"advise\"\n\n[contention]\nmode = \"advise\"\n\
           membw_threshold = 0.8\n";
    assert_ne!(changed, text);
    std::fs::write(&d.config, changed).expect("write config");
    d.hup();
    wait_until(WAIT, "the reload to be logged", || {
        d.log().contains("reloaded ")
    });
    let log = d.log();
    assert!(
        log.contains("applied agent.interval_ms = 250 (was 100), [rightsize], [contention]"),
        "{log}"
    );
    assert!(log.contains("refused (they need a restart"), "{log}");
    assert!(log.contains("[log]"), "{log}");
    let status = d.ctl_json(&["status"]);
    assert_eq!(status["interval_ms"], 250, "{status}");
    assert_eq!(status["jobs"], 1, "{status}");
    assert!(
        status["contention"]
            .as_str()
            .is_some_and(|c| c.starts_with("advise")),
        "{status}"
    );
    let after = d.job(&id);
    assert_eq!(after["state"], before["state"], "{after}");
    assert_eq!(after["cpus"], before["cpus"], "{after}");
    assert!(all_rr_on(
        w.pid(),
        10,
        before["cpus"].as_str().expect("cpus")
    ));

    // A file that does not parse changes nothing.
    std::fs::write(&d.config, "[agent]\ninterval_ms = \"fast\"\n").expect("write config");
    d.hup();
    wait_until(WAIT, "the refusal to be logged", || {
        d.log()
            .contains("reload refused, the running config is kept")
    });
    let status = d.ctl_json(&["status"]);
    assert_eq!(status["interval_ms"], 250, "{status}");
    assert_eq!(status["jobs"], 1, "{status}");
    assert_eq!(d.job(&id)["cpus"], before["cpus"]);
    // Still serving and ticking after both reloads.
    let ticks = status["ticks"].as_u64().expect("ticks");
    wait_until(WAIT, "the loop to go on ticking", || {
        d.ctl_json(&["status"])["ticks"].as_u64() > Some(ticks)
    });
}

/// A SIGTERM (`systemctl stop lodgerd`) while a reload's read hangs (here the config file is a
/// FIFO nobody writes, as a dead mount would hang it) stops lodgerd then, not once the read's
/// 10-s bound has passed and the reload was refused.
#[test]
fn a_stop_during_a_hung_reload_is_not_held_back() {
    if !need_root("a_stop_during_a_hung_reload_is_not_held_back") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            sim: true,
            ..DaemonOptions::default()
        },
    );
    std::fs::remove_file(&d.config).expect("remove the config");
    nix::unistd::mkfifo(&d.config, nix::sys::stat::Mode::from_bits_truncate(0o600))
        .expect("a FIFO in the config's place");
    d.hup();
    // The reload's read runs on a thread of its own, named for it: once it is there, the read
    // is under way (its open of the FIFO does not return until a writer comes).
    let pid = d.pid();
    wait_until(WAIT, "the reload's read to start", || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "lodgerd-reload")
            })
    });
    d.stop();
    let log = d.log();
    assert!(
        log.contains("asked to stop during a reload"),
        "lodgerd did not stop during the reload:\n{log}"
    );
    assert!(!log.contains("reload refused"), "{log}");
}
