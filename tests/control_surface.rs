//! The control surface never waits on enforcement, as root: while lodgerd stops an instance that
//! ignores SIGTERM (it ends only at SIGKILL, after `inference.stop_grace_seconds`), `status`,
//! `list` and `show` are answered, and the stop still ends with nothing left.

mod common;

use common::*;

/// Long enough that the calls below are certainly made inside it; the test waits it out once.
const GRACE_SECONDS: u64 = 15;

/// An instance that ignores SIGTERM, and so does its child (an ignored signal stays ignored
/// across exec).
const STUBBORN: &[&str] = &["/bin/sh", "-c", "trap '' TERM; sleep 300 & wait"];

fn instance_pids(job: &serde_json::Value) -> Vec<u32> {
    job["instances"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|i| i["state"] == "running")
                .filter_map(|i| i["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
                .filter(|p| *p > 0)
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn status_and_list_answer_while_an_instance_ignoring_sigterm_is_stopped() {
    if !need_root("status_and_list_answer_while_an_instance_ignoring_sigterm_is_stopped") {
        return;
    }
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: format!("[inference]\nstop_grace_seconds = {GRACE_SECONDS}\n"),
            ..DaemonOptions::default()
        },
    );
    let mut args = vec!["register", "offline", "--max-batch", "1", "--"];
    args.extend_from_slice(STUBBORN);
    let id = d.ctl_json(&args)["id"].as_str().expect("id").to_string();
    let mut pids = Vec::new();
    wait_until(WAIT, "the stubborn instances running", || {
        pids = instance_pids(&d.job(&id));
        !pids.is_empty()
    });

    // Unregistering starts the stop; the instances outlive SIGTERM.
    d.ctl_ok(&["unregister", &id]);
    let status = d.ctl_json(&["status"]);
    let list = d.ctl_json(&["list"]);
    let shown = d.ctl(&["show", &id]);
    // Ordering, not duration: every answer came back while the stop was still under way.
    let stopping: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(
        !stopping.is_empty(),
        "the instances {pids:?} were gone before status and list returned: the calls waited \
         for the stop\n--- lodgerd log ---\n{}",
        d.log()
    );
    assert_eq!(status["jobs"], 0, "{status}");
    assert_eq!(list, serde_json::json!([]), "{list}");
    assert!(!shown.status.success(), "the unregistered job is not shown");

    // The stop still ends: SIGKILL after the grace period, reaped, nothing left.
    let grace = std::time::Duration::from_secs(GRACE_SECONDS);
    for pid in pids {
        wait_until(grace + WAIT, "the stubborn instance killed", || !alive(pid));
    }
    assert!(
        d.log().contains("after SIGTERM: SIGKILL"),
        "the stop ended by SIGKILL\n{}",
        d.log()
    );
}
