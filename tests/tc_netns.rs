//! Network shaping for real (SODA §V-E, §IV-C-2), in network namespaces of its own:
//!
//! ```text
//!  node (ns a)                    wire (ns r)                       peer (ns b)
//!  lt0a 10.77.0.1 ── veth ── lt0r 10.77.0.2 | lt1r 10.77.1.1 ── veth ── lt1b 10.77.1.2
//!  senders; lodger's HTB           tbf 20 Mbit/s on lt1r             receiver (this process)
//! ```
//!
//! A "training" flow (one TCP connection) and a "CPU job" (four connections, from a process in
//! a v1 `net_cls` cgroup with lodger's class id) saturate the 20 Mbit/s wire. Before shaping
//! the CPU job takes most of it (SODA §IV-C-2 measures a CPU job at 80% of the network);
//! after `NetworkShaping::apply` on `lt0a` with a 20 Mbit/s line rate, the split must be
//! 75/25 within 10%. Then shaping is removed and everything made here is taken down: the
//! namespaces, the cgroup, and the `net_cls` mount if the test made it. Traffic stays inside
//! the namespaces, on addresses created there.
//!
//! Needs root, iproute2 (`ip`, `tc`), nftables (`nft`) where the kernel lacks the `cgroup`
//! classifier, bash (its `/dev/tcp`), coreutils, and the kernel's `net_cls` controller.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
#[path = "tc_netns/wire.rs"]
mod wire;

use lodger::enforce::network::{
    remove_leftovers, CpuJobs, Link, NetClsGroup, NetworkShaping, ShapingConfig, Steering,
};
use lodger::privileged::need_root;
use lodger::sys::command::CommandRunner;
use wire::*;

/// lodger's shaping of namespace a's `lt0a` (`LINK_MBIT`, the default shares and steering).
fn shaping_of_lt0a() -> NetworkShaping {
    let config = ShapingConfig {
        links: vec![Link {
            interface: "lt0a".to_string(),
            line_rate_mbit: LINK_MBIT,
        }],
        ..ShapingConfig::default()
    };
    NetworkShaping::new(&config, Steering::Auto).expect("shaping config")
}

#[test]
fn tc_shapes_training_and_cpu_job_traffic_75_25() {
    let _turn = one_at_a_time();
    if !need_root(TEST) {
        return;
    }
    // Throughput on a 2-CPU machine: not beside the other test here.
    let _measuring = common::measuring();
    let Some(mount) = prerequisites(TEST) else {
        return;
    };
    let ns = Namespaces::create("t");

    let mut shaping = shaping_of_lt0a();
    let mut runner = CommandRunner::in_netns(&ns.a);
    let group_path = format!("lodger-test-{}/cpu-job", std::process::id());
    let (group, _) = NetClsGroup::create(&mount.path, &group_path, shaping.net_cls_classid())
        .expect("net_cls cgroup");
    assert_eq!(group.classid().expect("classid"), 0x4c44_0020);

    let mut guard = CgroupGuard {
        group: Some(group.clone()),
        parent: mount
            .path
            .join(format!("lodger-test-{}", std::process::id())),
    };
    let mut receiver = Receiver::start(&ns.b);
    let mut training = Sender::spawn(&ns.a, TRAINING_PORT, 1);
    let mut cpu_job = Sender::spawn(&ns.a, CPU_JOB_PORT, 4);
    group
        .add_process(cpu_job.pid())
        .expect("CPU job into net_cls");
    assert_eq!(group.procs().expect("procs"), [cpu_job.pid()]);
    // Training connects first and the CPU job once training's connection is up, every run:
    // under the wire's tail-drop queue the flows that join last take the larger share for
    // seconds, so the order decides whether the wire is contended before shaping. Started
    // together, the two could connect in either order on a loaded machine: a host run measured
    // training at 70-73 % in three windows running, which no shaping could show anything on,
    // and the CPU job connecting first here gave training 63-73 % in two runs of three.
    training.go();
    let took = receiver.connected(1, 0);
    cpu_job.go();
    let took = took + receiver.connected(1, 4);
    eprintln!("{TEST}: all five connections accepted in {took:?}");

    std::thread::sleep(WARMUP);
    // Four connections take most of the wire once TCP has settled, which on a loaded machine
    // can take another window or two (a run here measured 53/47 in the first): measured until
    // the contention shows, at most three windows, the most contended of them kept (a CI run
    // measured 60.6 %, 63.5 % and then 68.7 % for training); asserted below.
    let mut before = receiver.measure(WINDOW);
    for _ in 0..2 {
        if before.training_share() < 0.5 {
            break;
        }
        eprintln!("{TEST}: unshaped, not yet contended: {before}");
        let next = receiver.measure(WINDOW);
        // Each window said, not only the most contended kept: a failure shows all three.
        eprintln!("{TEST}: unshaped, the next window: {next}");
        if next.training_share() < before.training_share() {
            before = next;
        }
    }
    eprintln!("{TEST}: before shaping: {before}");

    let applied = shaping
        .apply(&mut runner, &CpuJobs::NetCls)
        .expect("apply shaping");
    assert!(applied.changed);
    eprintln!("{TEST}: shaping applied, steering {:?}", applied.steering);
    // Idempotent on the real kernel: the second apply only reads.
    let again = shaping
        .apply(&mut runner, &CpuJobs::NetCls)
        .expect("apply again");
    assert!(!again.changed, "second apply changed something");
    let classes = runner
        .run(&["tc", "class", "show", "dev", "lt0a"].map(String::from))
        .expect("tc class show");
    eprintln!("{TEST}: classes:\n{}", classes.trim_end());

    std::thread::sleep(WARMUP);
    // Three windows: the senders stop after SEND_SECONDS.
    let after = receiver.measure_settled(TEST, 3);
    eprintln!("{TEST}: after shaping: {after}");

    let removed = shaping
        .reconcile(&mut runner, false, &CpuJobs::NetCls)
        .expect("remove shaping");
    assert!(removed.changed);
    let qdiscs = runner
        .run(&["tc", "qdisc", "show", "dev", "lt0a"].map(String::from))
        .expect("tc qdisc show");
    let nft_left = runner.run(&["nft", "list", "table", "inet", "lodger"].map(String::from));

    training.wait();
    cpu_job.wait();
    receiver.stop();
    guard.group = None;
    assert!(group.remove().expect("remove the net_cls cgroup"));
    let parent = guard.parent.clone();
    std::fs::remove_dir(&parent).expect("remove the test's parent cgroup");
    drop(guard);
    let ns_names = [ns.a.clone(), ns.r.clone(), ns.b.clone()];
    drop(ns);
    let mount_path = mount.path.clone();
    let mounted_here = mount.ours.is_some();
    drop(mount);

    // Nothing of lodger's is left.
    assert!(
        !qdiscs.contains("htb"),
        "an HTB qdisc is left on lt0a: {qdiscs}"
    );
    assert!(nft_left.is_err(), "lodger's nftables table is left");
    let listed = output("ip", &["netns", "list"]);
    for n in &ns_names {
        assert!(
            !listed.contains(n.as_str()),
            "namespace {n} is left: {listed}"
        );
    }
    assert!(!parent.exists(), "the net_cls cgroup is left");
    if mounted_here {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        assert!(
            !mountinfo.contains(&mount_path.display().to_string()),
            "the net_cls mount is left"
        );
    }

    // Unshaped, four connections against one take most of the wire: the contention SODA
    // §IV-C-2 measures. (The wire is slow enough for any machine's senders to fill it.) On a
    // loaded machine TCP does not always settle there within the windows above (a CI run
    // measured 55/45, 55/45, 60/40); what the shaping below must show needs only that the CPU
    // job took clearly more than the 25 % it is shaped to.
    assert!(
        before.total() > 0.8 * LINK_MBIT as f64,
        "the senders did not fill the {LINK_MBIT} Mbit/s wire unshaped: {before}"
    );
    assert!(
        before.training_share() < 0.65,
        "no contention to shape: {before}"
    );
    // Shaped: 75/25 within 10%, and the line still full.
    let share = after.training_share();
    assert!(
        (share - 0.75).abs() <= 0.075,
        "training share {:.1}% is not 75% within 10%: {after}",
        100.0 * share
    );
    assert!(
        after.total() > 0.8 * LINK_MBIT as f64,
        "shaping left the line idle: {after}"
    );
}

/// A lodgerd that starts with network control off removes what a previous one's shaping left
/// (stopping leaves it for the jobs that run on): lodger's HTB tree, its nftables table and its
/// net_cls group (the process in it back at the hierarchy's root), and nothing else (another
/// tool's root qdisc stays). A second pass finds nothing.
#[test]
fn shaping_a_previous_lodgerd_left_is_removed_and_nothing_else() {
    const NAME: &str = "shaping_a_previous_lodgerd_left_is_removed_and_nothing_else";
    let _turn = one_at_a_time();
    if !need_root(NAME) {
        return;
    }
    let Some(mount) = prerequisites(NAME) else {
        return;
    };
    let ns = Namespaces::create("l");
    let mut shaping = shaping_of_lt0a();
    let parent = format!("lodger-test-{}-leftover", std::process::id());
    let group_path = format!("{parent}/cpu-jobs");
    let (group, _) = NetClsGroup::create(&mount.path, &group_path, shaping.net_cls_classid())
        .expect("net_cls cgroup");
    let _guard = CgroupGuard {
        group: Some(group.clone()),
        parent: mount.path.join(&parent),
    };
    let mut cpu_job = common::Workload::adopt(
        std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .expect("sleep"),
    );
    let sleeper = cpu_job.pid();
    group.add_process(sleeper).expect("into the net_cls group");
    let mut runner = CommandRunner::in_netns(&ns.a);
    let applied = shaping
        .apply(&mut runner, &CpuJobs::NetCls)
        .expect("apply shaping");
    assert!(applied.changed);
    let tc = |runner: &mut CommandRunner, line: &str| {
        let argv: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        runner.run(&argv)
    };
    tc(&mut runner, "tc qdisc add dev lo root handle 1: htb").expect("another tool's qdisc");
    let nft_before = tc(&mut runner, "nft list table inet lodger").is_ok();

    let net_cls = Some((mount.path.as_path(), group_path.as_str()));
    let (removed, errors) = remove_leftovers(&mut runner, net_cls);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(
        removed.iter().any(|r| r.contains(&group_path)),
        "{removed:?}"
    );
    assert!(!mount.path.join(&parent).exists(), "group and parent gone");
    let root_procs =
        std::fs::read_to_string(mount.path.join("cgroup.procs")).expect("root cgroup.procs");
    assert!(
        root_procs.lines().any(|l| l == sleeper.to_string()),
        "the process is back at the root"
    );
    cpu_job.kill();
    assert!(
        removed.iter().any(|r| r == "the HTB tree on lt0a"),
        "{removed:?}"
    );
    assert_eq!(
        removed.iter().any(|r| r.contains("inet lodger")),
        nft_before,
        "{removed:?}"
    );
    let qdiscs = tc(&mut runner, "tc qdisc show").expect("tc qdisc show");
    assert!(!qdiscs.contains("htb 4c44:"), "{qdiscs}");
    assert!(qdiscs.contains("qdisc htb 1: dev lo root"), "{qdiscs}");
    assert!(tc(&mut runner, "nft list table inet lodger").is_err());
    let (again, errors) = remove_leftovers(&mut runner, net_cls);
    assert!(
        again.is_empty() && errors.is_empty(),
        "{again:?} {errors:?}"
    );
    drop(ns);
}

fn network_status(d: &common::Daemon) -> String {
    d.ctl_json(&["status"])["network"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Registers `pid` as a one-core multi-node training job; returns lodgerctl's JSON reply.
fn register_multi_node(d: &common::Daemon, pid: u32) -> serde_json::Value {
    d.ctl_json(&[
        "register",
        "training",
        "--pid",
        &pid.to_string(),
        "--cores",
        "1",
        "--multi-node",
    ])
}

/// What lodger keeps on the node's side while shaping: an HTB root on `lt0a`, its nftables table
/// (this kernel has no cls_cgroup, so `auto` steering uses nftables) and its net_cls cgroup.
#[derive(Debug, PartialEq, Eq)]
struct Left {
    htb: bool,
    nft_table: bool,
    net_cls_group: bool,
}

fn left(ns: &str, net_cls: &Path, parent: &str) -> Left {
    let qdiscs = output(
        "ip",
        &["netns", "exec", ns, "tc", "qdisc", "show", "dev", "lt0a"],
    );
    let nft = Command::new("ip")
        .args([
            "netns", "exec", ns, "nft", "list", "table", "inet", "lodger",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    Left {
        htb: qdiscs.contains("htb 4c44:"),
        nft_table: nft,
        net_cls_group: net_cls.join(parent).exists(),
    }
}

const NOTHING: Left = Left {
    htb: false,
    nft_table: false,
    net_cls_group: false,
};

/// lodgerd drives shaping itself (SODA §V-E): none while only a CPU job runs, 75/25 once a
/// multi-node training job is registered, re-adopted across a crash, and nothing left after
/// unregistering, a clean stop, or a crash followed by a restart that finds the job gone.
#[test]
fn lodgerd_shapes_while_a_multi_node_training_job_runs_and_cleans_up() {
    let _turn = one_at_a_time();
    const TEST: &str = "lodgerd_tc";
    if !need_root(TEST) {
        return;
    }
    let _measuring = common::measuring();
    let Some(mount) = prerequisites(TEST) else {
        return;
    };
    let ns = Namespaces::create("d");
    let mut receiver = Receiver::start(&ns.b);
    let bus = common::PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut d = common::Daemon::start(
        &bus,
        dir.path(),
        common::DaemonOptions {
            netns: Some(ns.a.clone()),
            // No reserved CPU: an offline instance on each CPU, so the CPU job's senders are
            // not confined to one CPU while the training flow has the other.
            reserved: "",
            extra: format!(
                "[network]\n[[network.link]]\ninterface = \"lt0a\"\nline_rate_mbit = {LINK_MBIT}\n"
            ),
            ..common::DaemonOptions::default()
        },
    );
    let parent = d.parent.clone();
    assert!(
        network_status(&d).starts_with("idle: no multi-node training job"),
        "{}",
        network_status(&d)
    );

    // A CPU job: an offline lodger whose instance keeps four connections busy.
    let script = format!(
        "for i in 1 2 3 4; do (while true; do cat /dev/zero > /dev/tcp/{PEER}/{CPU_JOB_PORT}; \
         sleep 0.2; done) & done; wait"
    );
    let cpu = d.ctl_json(&["register", "offline", "--", "bash", "-c", &script]);
    let cpu_id = cpu["id"].as_str().expect("id").to_string();
    common::wait_until(common::WAIT, "the CPU job's traffic", || {
        receiver.counts().1 > 0
    });
    // Alone, unshaped, the CPU job can fill the line: so the 25% it gets below is lodger's doing.
    std::thread::sleep(WARMUP);
    let alone = receiver.measure(WINDOW);
    eprintln!("{TEST}: CPU job alone: {alone}");
    let mut training = Sender::spawn_for(&ns.a, TRAINING_PORT, 1, 600);
    training.go();
    common::wait_until(common::WAIT, "both flows to carry traffic", || {
        let (t, c) = receiver.counts();
        t > 0 && c > 0
    });
    std::thread::sleep(WARMUP);
    let before = receiver.measure(WINDOW);
    // (How TCP splits the line between them unshaped varies from run to run: reported only.)
    eprintln!("{TEST}: CPU job and unregistered training: {before}");
    assert_eq!(
        left(&ns.a, &mount.path, &parent),
        NOTHING,
        "shaped with no multi-node job"
    );

    // The training flow's process becomes a multi-node training job.
    let t = register_multi_node(&d, training.pid());
    let t_id = t["id"].as_str().expect("id").to_string();
    common::wait_until_explained(
        common::WAIT,
        "lodgerd to shape lt0a",
        || network_status(&d).starts_with("shaping"),
        || format!("network: {}\n{}", network_status(&d), d.log()),
    );
    assert!(
        network_status(&d).starts_with(&format!(
            "shaping lt0a ({LINK_MBIT} Mbit/s): training 75%, CPU jobs 25% (ceil 25%)"
        )),
        "{}",
        network_status(&d)
    );
    let on = left(&ns.a, &mount.path, &parent);
    // The CPU jobs' traffic is told apart by a net_cls class id on cgroup v1, by the instances'
    // cgroup v2 directories (an nftables table) on v2.
    if common::host_cgroup() == common::HostCgroup::V2 {
        assert!(on.htb && on.nft_table, "{on:?}");
    } else {
        assert!(on.htb && on.net_cls_group, "{on:?}");
    }
    common::wait_until(common::WAIT, "the CPU job to be held", || {
        d.job(&cpu_id)["network"]
            .as_str()
            .is_some_and(|n| n.starts_with("held to 25%"))
    });
    assert!(d.job(&t_id)["network"]
        .as_str()
        .is_some_and(|n| n.starts_with("training traffic guaranteed 75%")));
    assert!(d
        .ctl_ok(&["show", &cpu_id])
        .contains("Network: held to 25%"));
    // And `top`: the node's line and the job's.
    let top = d.ctl_json(&["top", "--once"]);
    assert!(
        top["network"]
            .as_str()
            .is_some_and(|n| n.starts_with("shaping lt0a")),
        "{top}"
    );
    let held = top["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["id"] == cpu_id.as_str()))
        .map(|j| j["network"].clone())
        .unwrap_or_default();
    assert!(
        held.as_str().is_some_and(|n| n.starts_with("held to 25%")),
        "{top}"
    );
    let text = d.ctl_ok(&["top", "--once"]);
    assert!(
        text.contains("   network: shaping lt0a")
            && text.contains(&format!("{cpu_id}: network: held to 25%")),
        "{text}"
    );
    std::thread::sleep(WARMUP);
    // Up to five windows: lodgerd's tree replaces the root qdisc under the flows, and the
    // training flow, down to 1-2 Mbit/s before, can take a few seconds to grow into its 15
    // (host runs: 1.4, then 11.9 Mbit/s; 10.1 in the first window of another).
    let after = receiver.measure_settled(TEST, 5);
    eprintln!("{TEST}: shaped by lodgerd: {after}");

    // A reload (issue 16) with another line rate replaces the tree in place, jobs kept; and
    // back, so what follows sees the rate it expects.
    let text = std::fs::read_to_string(&d.config).expect("config");
    let rate = |mbit: u64| format!("line_rate_mbit = {mbit}");
    for mbit in [LINK_MBIT / 2, LINK_MBIT] {
        std::fs::write(&d.config, text.replace(&rate(LINK_MBIT), &rate(mbit))).expect("config");
        d.hup();
        common::wait_until(common::WAIT, "shaping at the reloaded rate", || {
            network_status(&d).starts_with(&format!("shaping lt0a ({mbit} Mbit/s)"))
        });
        let classes = output(
            "ip",
            &["netns", "exec", &ns.a, "tc", "class", "show", "dev", "lt0a"],
        );
        assert!(classes.contains(&format!("rate {mbit}Mbit")), "{classes}");
        common::wait_until(common::WAIT, "the CPU job held again", || {
            d.job(&cpu_id)["network"]
                .as_str()
                .is_some_and(|n| n.starts_with("held to 25%"))
        });
    }
    assert!(d.log().contains("applied [network]"), "{}", d.log());
    assert_eq!(d.ctl_json(&["list"]).as_array().map(Vec::len), Some(2));

    // A crash does not lose it: the restarted lodgerd re-adopts the job and the tree.
    d.kill();
    assert!(
        left(&ns.a, &mount.path, &parent).htb,
        "a killed lodgerd cannot clean up"
    );
    d.restart();
    common::wait_until(common::WAIT, "the restarted lodgerd to shape", || {
        network_status(&d).starts_with("shaping")
    });
    assert_eq!(
        left(&ns.a, &mount.path, &parent),
        on,
        "re-adopted as it was"
    );

    // The multi-node job leaves: everything goes; the CPU job is no longer held.
    d.ctl_ok(&["unregister", &t_id]);
    common::wait_until(common::WAIT, "shaping to be removed", || {
        left(&ns.a, &mount.path, &parent) == NOTHING
    });
    // The status says so at the reconcile after the removal (read once, it raced it in CI).
    common::wait_until(common::WAIT, "the network status to read idle", || {
        network_status(&d).starts_with("idle")
    });
    assert!(d.job(&cpu_id)["network"].is_null());

    // A clean stop (systemctl stop, restart, an upgrade) undoes nothing either: the multi-node
    // job and the CPU job's instance still run, and stay shaped.
    register_multi_node(&d, training.pid());
    common::wait_until(common::WAIT, "shaping again", || {
        left(&ns.a, &mount.path, &parent) == on
    });
    d.stop();
    assert_eq!(
        left(&ns.a, &mount.path, &parent),
        on,
        "a stopped lodgerd undid the shaping its jobs still want"
    );

    // A crash, then the job ends while lodgerd is down: the next lodgerd cleans up.
    d.restart();
    common::wait_until(common::WAIT, "shaping after the restart", || {
        left(&ns.a, &mount.path, &parent).htb
    });
    d.kill();
    drop(training);
    d.restart();
    let deadline = Instant::now() + common::WAIT;
    while left(&ns.a, &mount.path, &parent) != NOTHING {
        assert!(
            Instant::now() < deadline,
            "the stale tree was not removed: {:?}\n{}",
            left(&ns.a, &mount.path, &parent),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = d.log();
    drop(d);
    receiver.stop();
    drop(ns);
    drop(mount);

    // Unshaped and alone, the CPU job fills the line, or the 75/25 below would prove nothing
    // (a CPU-starved CPU job can land near 25% by itself).
    assert!(
        alone.cpu_job > 0.8 * LINK_MBIT as f64,
        "the CPU job could not fill the line by itself: {alone}"
    );
    let share = after.training_share();
    assert!(
        (share - 0.75).abs() <= 0.075,
        "training share {:.1}% is not 75% within 10%: {after}\n{log}",
        100.0 * share
    );
    assert!(
        after.total() > 0.8 * LINK_MBIT as f64,
        "shaping left the line idle: {after}"
    );
    assert!(log.contains("network shaping on"), "{log}");
}

/// The two-network option (`network.cpu_jobs_interface`): while a multi-node training job runs,
/// lodgerd moves the CPU job's traffic onto the slower network (`lt2a`), its connections still
/// reaching the peer, and puts everything back when the job leaves.
#[test]
fn lodgerd_moves_cpu_jobs_to_the_slower_network_while_multi_node_training_runs() {
    let _turn = one_at_a_time();
    const TEST: &str = "lodgerd_route";
    if !need_root(TEST) {
        return;
    }
    let _measuring = common::measuring();
    let Some(mount) = prerequisites(TEST) else {
        return;
    };
    let ns = Namespaces::create("r");
    ns.add_slow_network();
    let receiver = Receiver::start(&ns.b);
    let bus = common::PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = common::Daemon::start(
        &bus,
        dir.path(),
        common::DaemonOptions {
            netns: Some(ns.a.clone()),
            extra: "[network]\ncpu_jobs_interface = \"lt2a\"\ncpu_jobs_gateway = \"10.77.2.2\"\n"
                .to_string(),
            ..common::DaemonOptions::default()
        },
    );
    let script =
        format!("while true; do cat /dev/zero > /dev/tcp/{PEER}/{CPU_JOB_PORT}; sleep 0.2; done");
    let cpu = d.ctl_json(&["register", "offline", "--", "bash", "-c", &script]);
    let cpu_id = cpu["id"].as_str().expect("id").to_string();
    common::wait_until(common::WAIT, "the CPU job's traffic", || {
        receiver.counts().1 > 0
    });
    // Bytes sent on the fast and the slow network, and received from the CPU job, over a window.
    let window = |ns: &Namespaces| {
        let (f0, s0, c0) = (
            Namespaces::tx_bytes(&ns.a, "lt0a"),
            Namespaces::tx_bytes(&ns.a, "lt2a"),
            receiver.counts().1,
        );
        std::thread::sleep(WINDOW);
        (
            Namespaces::tx_bytes(&ns.a, "lt0a") - f0,
            Namespaces::tx_bytes(&ns.a, "lt2a") - s0,
            receiver.counts().1 - c0,
        )
    };
    let before = window(&ns);
    eprintln!(
        "{TEST}: unrouted: fast {} B, slow {} B, CPU job received {} B",
        before.0, before.1, before.2
    );

    let mut training = Sender::spawn_for(&ns.a, TRAINING_PORT, 1, 600);
    training.go();
    let t = register_multi_node(&d, training.pid());
    let t_id = t["id"].as_str().expect("id").to_string();
    common::wait_until_explained(
        common::WAIT,
        "lodgerd to route CPU jobs",
        || network_status(&d).starts_with("routing"),
        || format!("network: {}\n{}", network_status(&d), d.log()),
    );
    assert_eq!(
        network_status(&d),
        "routing CPU jobs' IPv4 traffic via lt2a (the slower network)"
    );
    let rules = output("ip", &["-n", &ns.a, "rule", "show"]);
    assert!(rules.contains("fwmark 0x4c440020 lookup 19524"), "{rules}");
    assert!(d.job(&cpu_id)["network"]
        .as_str()
        .is_some_and(|n| n.starts_with("IPv4 traffic routed via lt2a")));
    std::thread::sleep(WARMUP);
    let routed = window(&ns);
    eprintln!(
        "{TEST}: routed: fast {} B, slow {} B, CPU job received {} B",
        routed.0, routed.1, routed.2
    );

    d.ctl_ok(&["unregister", &t_id]);
    common::wait_until(common::WAIT, "routing to be removed", || {
        network_status(&d).starts_with("idle")
    });
    let rules_after = output("ip", &["-n", &ns.a, "rule", "show"]);
    let table_after = output("ip", &["-n", &ns.a, "route", "show", "table", "19524"]);
    let nft_after = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.a,
            "nft",
            "list",
            "table",
            "inet",
            "lodger_route",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let log = d.log();
    d.ctl_ok(&["unregister", &cpu_id]);
    drop(d);
    drop(training);
    drop(receiver);
    drop(ns);
    drop(mount);

    // Unrouted, the CPU job's bulk goes out the fast network; routed, out the slow one, and
    // the peer still receives it (replies find their way back through the masquerade).
    assert!(
        before.0 > 1_000_000 && before.1 < before.0 / 100,
        "{before:?}"
    );
    // (Both networks meet at the wire namespace's LINK_MBIT link to the peer, so the routed
    // CPU job's rate is whatever TCP leaves it beside training: the path is checked, not it.)
    assert!(
        routed.2 > 100_000,
        "the CPU job's traffic stopped arriving: {routed:?}\n{log}"
    );
    assert!(
        routed.1 as f64 >= 0.95 * routed.2 as f64,
        "the CPU job's traffic did not leave by the slow network: {routed:?}\n{log}"
    );
    assert!(!rules_after.contains("0x4c440020"), "{rules_after}");
    assert!(table_after.trim().is_empty(), "{table_after}");
    assert!(!nft_after, "lodger's route table is left in nftables");
}
