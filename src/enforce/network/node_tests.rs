//! Tests of the node's network control: shaping and routing decisions against a recorded runner.

use super::*;
use crate::enforce::network::{Link, RecordingRunner};
use std::sync::{Arc, Mutex};

/// A recording runner shared with the test, on a node with nothing of lodger's yet.
#[derive(Clone)]
struct Shared(Arc<Mutex<RecordingRunner>>);

impl Default for Shared {
    fn default() -> Self {
        let mut r = RecordingRunner::new();
        r.reply(
            &["tc", "qdisc", "show"],
            "qdisc noqueue 0: root refcnt 2 \n",
        )
        .fail(
            &["nft", "list"],
            "Error: No such file or directory\nlist table inet lodger_route\n",
        )
        .fail(
            &["nft", "-j", "list"],
            "Error: No such file or directory\nlist table inet lodger\n",
        );
        Shared(Arc::new(Mutex::new(r)))
    }
}

impl TcRunner for Shared {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError> {
        self.0.lock().expect("runner").run(argv)
    }
}

impl Shared {
    fn changes(&self) -> Vec<String> {
        self.0.lock().expect("runner").changes()
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().expect("runner").lines()
    }
}

fn job(s: &str) -> JobId {
    JobId::parse(s).expect("id")
}

fn config() -> ShapingConfig {
    ShapingConfig {
        links: vec![Link {
            interface: "eth0".into(),
            line_rate_mbit: 1000,
        }],
        ..ShapingConfig::default()
    }
}

fn control(runner: &Shared, classifier: Classifier) -> NetworkControl {
    NetworkControl::new(
        &config(),
        Steering::Nft,
        Box::new(runner.clone()),
        classifier,
    )
    .expect("control")
}

fn want(multi: &[&str], cpu: &[(&str, &[&str])]) -> NetworkWant {
    NetworkWant {
        multi_node: multi.iter().map(|j| job(j)).collect(),
        cpu_jobs: cpu
            .iter()
            .map(|(j, cgroups)| CpuJob {
                job: job(j),
                pids: Vec::new(),
                instances: true,
                cgroups: cgroups.iter().map(|c| c.to_string()).collect(),
            })
            .collect(),
    }
}

#[test]
fn v2_shapes_only_while_multi_node_training_runs_and_says_so() {
    let runner = Shared::default();
    let mut ctl = control(&runner, Classifier::CgroupV2);
    // Start: nothing wanted, stale state removed (reads only: there is none).
    assert!(ctl.reconcile(&want(&[], &[])).is_empty());
    assert!(runner.changes().is_empty(), "{:?}", runner.changes());
    assert!(ctl.status().starts_with("idle"), "{}", ctl.status());
    // Quiet while idle: no command at all.
    let before = runner.lines().len();
    ctl.reconcile(&want(&[], &[]));
    assert_eq!(runner.lines().len(), before);

    // Inference passes the directory holding its instances' cgroups.
    let w = want(&["j1"], &[("j2", &["lodger/lodgers"])]);
    assert_eq!(ctl.reconcile(&w), [NetworkEvent::Held(job("j2"))]);
    let changes = runner.changes().join("\n");
    assert!(
        changes.contains("qdisc replace dev eth0 root handle 4c44: htb default 10"),
        "{changes}"
    );
    assert!(
        changes.contains("socket cgroupv2 level 2 \"lodger/lodgers\" meta priority set 4c44:20"),
        "{changes}"
    );
    assert!(ctl
        .status()
        .starts_with("shaping eth0 (1000 Mbit/s): training 75%"));
    assert_eq!(
        ctl.job_text(&job("j2"), false).as_deref(),
        Some("held to 25% (ceil 25%) of eth0 (1000 Mbit/s) while multi-node training runs")
    );
    // Unchanged: no command until the verify tick.
    let before = runner.lines().len();
    for _ in 0..VERIFY_TICKS {
        assert!(ctl.reconcile(&w).is_empty());
    }
    assert_eq!(runner.lines().len(), before);
    ctl.reconcile(&w);
    assert!(
        runner.lines().len() > before,
        "verify tick re-reads the tree"
    );

    // The last multi-node job leaves: everything goes, the CPU job is told.
    assert_eq!(
        ctl.reconcile(&want(&[], &[("j2", &["lodger/lodgers/j2-0"])])),
        [NetworkEvent::Released(job("j2"))]
    );
    assert_eq!(ctl.job_text(&job("j2"), false), None);
    assert!(ctl.status().starts_with("idle"));
}

#[test]
fn unavailable_classification_is_reported_not_applied() {
    let runner = Shared::default();
    let mut ctl = control(
        &runner,
        Classifier::Unavailable("net_cls is not mounted".into()),
    );
    assert!(ctl.reconcile(&want(&["j1"], &[("j2", &[])])).is_empty());
    assert!(runner.changes().is_empty());
    assert_eq!(
        ctl.status(),
        "not shaping: cannot tell CPU jobs' traffic apart: net_cls is not mounted"
    );
}

#[test]
fn a_failed_apply_is_reported_and_retried() {
    let runner = Shared::default();
    runner.0.lock().expect("runner").fail(
        &["tc", "qdisc", "replace"],
        "RTNETLINK answers: Operation not permitted",
    );
    let mut ctl = control(&runner, Classifier::CgroupV2);
    let w = want(&["j1"], &[("j2", &["lodger/lodgers/j2-0"])]);
    assert!(ctl.reconcile(&w).is_empty());
    assert!(
        ctl.status().contains("Operation not permitted"),
        "{}",
        ctl.status()
    );
    let before = runner.lines().len();
    ctl.reconcile(&w);
    assert!(runner.lines().len() > before, "retried at the next tick");
}

/// A fake net_cls hierarchy at `root` (plain files stand in for the kernel's) with lodger's
/// CPU-jobs group, returned.
fn fake_net_cls(root: &std::path::Path) -> std::path::PathBuf {
    std::fs::write(root.join("cgroup.procs"), "").expect("root procs");
    let group = root.join("lodger/cpu-jobs");
    std::fs::create_dir_all(&group).expect("group");
    std::fs::write(group.join("cgroup.procs"), "").expect("procs");
    std::fs::write(group.join("net_cls.classid"), "0\n").expect("classid");
    group
}

fn net_cls(root: &std::path::Path) -> Classifier {
    Classifier::NetCls {
        hierarchy: root.to_path_buf(),
        relative: "lodger/cpu-jobs".into(),
    }
}

#[test]
fn v1_moves_cpu_job_processes_into_the_net_cls_group_and_removes_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let group = fake_net_cls(root);
    let runner = Shared::default();
    let mut ctl = control(&runner, net_cls(root));
    let mut w = want(&["j1"], &[("j2", &[])]);
    w.cpu_jobs[0].pids = vec![4242];
    assert_eq!(ctl.reconcile(&w), [NetworkEvent::Held(job("j2"))]);
    let classid = std::fs::read_to_string(group.join("net_cls.classid")).expect("classid");
    assert_eq!(classid, (0x4c44_0020u32).to_string());
    let procs = std::fs::read_to_string(group.join("cgroup.procs")).expect("procs");
    assert_eq!(procs, "4242");
    assert!(runner
        .changes()
        .join("\n")
        .contains("meta cgroup 1279524896 meta priority set 4c44:20"));
    // Off: its processes go back to the hierarchy's root before the group is removed (a
    // plain directory with files cannot be removed like a cgroup: the real kernel path is
    // tests/tc_netns.rs).
    assert_eq!(
        ctl.reconcile(&want(&[], &[])),
        [NetworkEvent::Released(job("j2"))]
    );
    let root_procs = std::fs::read_to_string(root.join("cgroup.procs")).expect("procs");
    assert_eq!(root_procs, "4242");
}

/// A removal that failed partway (the HTB tree deleted, the net_cls group not: a CPU job's
/// child forked into it meanwhile) left the control taking shaping as in place: a multi-node
/// job registered next was not shaped until the verify tick, and `status` said "shaping".
/// Now the next reconcile applies everything again.
#[test]
fn a_removal_that_failed_partway_is_applied_again_at_the_next_reconcile() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    // Its group, a directory with files, cannot be removed.
    fake_net_cls(root);
    let runner = Shared::default();
    let mut ctl = control(&runner, net_cls(root));
    let built = |runner: &Shared| {
        runner
            .changes()
            .iter()
            .filter(|l| l.contains("qdisc replace dev eth0 root"))
            .count()
    };
    let w = want(&["j1"], &[("j2", &[])]);
    ctl.reconcile(&w);
    assert_eq!(built(&runner), 1);
    // The tree is lodger's now; the last multi-node job goes: the tree is deleted, the group
    // stays.
    let shown = |runner: &Shared, line: &str| {
        runner
            .0
            .lock()
            .expect("runner")
            .reply(&["tc", "qdisc", "show"], line);
    };
    shown(
        &runner,
        "qdisc htb 4c44: root refcnt 2 r2q 10 default 0x10\n",
    );
    ctl.reconcile(&want(&[], &[]));
    assert!(runner
        .changes()
        .contains(&"tc qdisc del dev eth0 root".to_string()));
    assert!(
        ctl.status().contains("cannot remove shaping"),
        "{}",
        ctl.status()
    );
    // A multi-node job again: the tree is built at once, not at the verify tick.
    shown(&runner, "qdisc noqueue 0: root refcnt 2 \n");
    ctl.reconcile(&w);
    assert_eq!(built(&runner), 2, "{:?}", runner.changes());
    assert!(ctl.status().starts_with("shaping eth0"), "{}", ctl.status());
}

#[test]
fn v2_without_instance_cgroups_moves_cpu_jobs_into_a_cgroup_of_lodgerds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let own = dir.path().join("system.slice/lodgerd.service");
    std::fs::create_dir_all(&own).expect("own cgroup");
    std::fs::write(own.join("cgroup.procs"), "").expect("procs");
    let group = own.join("cpu-jobs");
    // A fake cgroup: mkdir by hand with its procs file, as the kernel would.
    std::fs::create_dir_all(&group).expect("group");
    std::fs::write(group.join("cgroup.procs"), "").expect("procs");
    let runner = Shared::default();
    let mut ctl = control(
        &runner,
        Classifier::OwnCgroupV2 {
            root: dir.path().to_path_buf(),
            relative: "system.slice/lodgerd.service/cpu-jobs".into(),
        },
    );
    let mut w = want(&["j1"], &[("j2", &[])]);
    w.cpu_jobs[0].pids = vec![4242];
    assert_eq!(ctl.reconcile(&w), [NetworkEvent::Held(job("j2"))]);
    assert_eq!(
        std::fs::read_to_string(group.join("cgroup.procs")).expect("procs"),
        "4242"
    );
    let changes = runner.changes().join("\n");
    assert!(
        changes.contains(
            "socket cgroupv2 level 3 \"system.slice/lodgerd.service/cpu-jobs\" meta priority set 4c44:20"
        ),
        "{changes}"
    );
    // Off: the processes stay (the sockets they made there match again next time)...
    ctl.reconcile(&want(&[], &[]));
    assert_eq!(
        std::fs::read_to_string(group.join("cgroup.procs")).expect("procs"),
        "4242"
    );
    assert_eq!(
        std::fs::read_to_string(own.join("cgroup.procs")).expect("procs"),
        ""
    );
    // ... until lodgerd stops: back to lodgerd's cgroup.
    ctl.shutdown();
    assert_eq!(
        std::fs::read_to_string(own.join("cgroup.procs")).expect("procs"),
        "4242"
    );
}

#[test]
fn shutdown_removes_even_while_wanted() {
    let runner = Shared::default();
    let mut ctl = control(&runner, Classifier::CgroupV2);
    ctl.reconcile(&want(&["j1"], &[("j2", &["p/l/j2-0"])]));
    // The recorded runner has no tree to show, so removal finds nothing to delete; what
    // matters here is that it looks, and tells the CPU job.
    let before = runner.lines().len();
    assert_eq!(ctl.shutdown(), [NetworkEvent::Released(job("j2"))]);
    assert!(runner.lines().len() > before);
}

#[test]
fn routing_moves_cpu_jobs_and_says_where() {
    let runner = Shared::default();
    runner
        .0
        .lock()
        .expect("runner")
        .fail(
            &["nft", "list"],
            "Error: No such file or directory\nlist table inet lodger_route\n",
        )
        .reply(&["ip", "-4", "rule", "show"], "0:\tfrom all lookup local\n");
    let route = CpuJobsRoute::new(
        crate::enforce::network::route::SlowNetwork {
            interface: "eth1".into(),
            gateway: None,
        },
        CPU_JOBS_MARK,
    )
    .expect("route");
    let mut ctl = NetworkControl::routing(route, Box::new(runner.clone()), Classifier::CgroupV2);
    ctl.reconcile(&want(&[], &[]));
    assert_eq!(
        ctl.status(),
        "idle: no multi-node training job (CPU jobs on their usual routes)"
    );
    let w = want(&["j1"], &[("j2", &["s/l"])]);
    assert_eq!(ctl.reconcile(&w), [NetworkEvent::Held(job("j2"))]);
    assert_eq!(ctl.held_level(), "via eth1");
    assert_eq!(
        ctl.status(),
        "routing CPU jobs' IPv4 traffic via eth1 (the slower network)"
    );
    let changes = runner.changes().join("\n");
    assert!(
        changes.contains("ip route replace default dev eth1 table 19524"),
        "{changes}"
    );
    assert!(changes.contains("socket cgroupv2 level 2 \"s/l\" meta mark set 0x4c440020"));
    assert_eq!(
        ctl.job_text(&job("j1"), true).as_deref(),
        Some("CPU jobs' traffic moved to eth1 (the slower network)")
    );
    assert_eq!(
        ctl.reconcile(&want(&[], &[])),
        [NetworkEvent::Released(job("j2"))]
    );
}

#[test]
fn v2_directories_are_matched_as_given() {
    let jobs = vec![
        CpuJob {
            job: job("j2"),
            pids: vec![],
            instances: true,
            cgroups: vec!["a/l".into(), "/a/l/".into()],
        },
        CpuJob {
            job: job("j3"),
            pids: vec![],
            instances: false,
            // A Slurm job's own cgroup: never widened to its parent, which holds every job.
            cgroups: vec!["system.slice/slurmstepd.scope/job_42".into(), "/".into()],
        },
    ];
    assert_eq!(
        v2_directories(&jobs),
        ["a/l", "system.slice/slurmstepd.scope/job_42"]
    );
}

#[test]
fn instances_are_matched_by_the_directory_holding_their_cgroups() {
    assert_eq!(
        instances_directory("/lodger/lodgers/j2-0").as_deref(),
        Some("lodger/lodgers")
    );
    assert_eq!(
        instances_directory("lodger.slice/lodger-instances.slice/j2-0.scope").as_deref(),
        Some("lodger.slice/lodger-instances.slice")
    );
    assert_eq!(instances_directory("top"), None);
}

#[test]
fn v2_shapes_a_batch_jobs_own_cgroup_not_its_parent() {
    let runner = Shared::default();
    let mut ctl = control(&runner, Classifier::CgroupV2);
    let w = want(
        &["j1"],
        &[("j2", &["system.slice/slurmstepd.scope/job_42"])],
    );
    assert_eq!(ctl.reconcile(&w), [NetworkEvent::Held(job("j2"))]);
    let changes = runner.changes().join("\n");
    assert!(
        changes.contains(
            "socket cgroupv2 level 3 \"system.slice/slurmstepd.scope/job_42\" meta priority set 4c44:20"
        ),
        "{changes}"
    );
    assert!(
        !changes.contains("\"system.slice/slurmstepd.scope\""),
        "every Slurm job, training's too, would be in the CPU jobs' class: {changes}"
    );
}

/// A batch job as `Batch::cpu_jobs` gives it: its processes, and its own cgroup if it has one.
fn batch_job(id: &str, pids: &[u32], cgroups: &[&str]) -> CpuJob {
    CpuJob {
        job: job(id),
        pids: pids.to_vec(),
        instances: false,
        cgroups: cgroups.iter().map(|c| c.to_string()).collect(),
    }
}

/// Finding 4 (a): on v2 a pid batch job pinned by affinity has no cgroup of its own, so no
/// rule covers its traffic: it is not told it is held, and `show` says it is not shaped.
#[test]
fn v2_a_batch_job_without_a_cgroup_is_not_held_and_says_so() {
    let runner = Shared::default();
    let mut ctl = control(&runner, Classifier::CgroupV2);
    let mut w = want(&["j1"], &[]);
    w.cpu_jobs = vec![
        batch_job("j2", &[4242], &[]),
        batch_job("j3", &[], &["system.slice/slurmstepd.scope/job_42"]),
    ];
    assert_eq!(ctl.reconcile(&w), [NetworkEvent::Held(job("j3"))]);
    assert_eq!(ctl.job_text(&job("j2"), false).as_deref(), Some(UNSHAPED));
    assert!(ctl
        .job_text(&job("j3"), false)
        .is_some_and(|t| t.starts_with("held to 25%")));
    assert!(
        ctl.status()
            .ends_with("; 1 CPU job(s) not shaped (no cgroup of their own)"),
        "{}",
        ctl.status()
    );
    // Off: nothing to release for the job that was never held.
    assert_eq!(
        ctl.reconcile(&want(&[], &[])),
        [NetworkEvent::Released(job("j3"))]
    );
    assert_eq!(ctl.job_text(&job("j2"), false), None);
}

/// Finding 4 (b): without systemd (`OwnCgroupV2`) only lodger's instances are moved into
/// lodger's cgroup; a batch job's processes stay in their cgroup (on v2 a move would take them
/// out of the Slurm job's memory limit and accounting), matched there when it has one.
#[test]
fn v2_without_systemd_moves_no_batch_process_out_of_its_cgroup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let group = dir.path().join("lodger/lodgers");
    std::fs::create_dir_all(&group).expect("group");
    std::fs::write(group.join("cgroup.procs"), "").expect("procs");
    let runner = Shared::default();
    let mut ctl = control(
        &runner,
        Classifier::OwnCgroupV2 {
            root: dir.path().to_path_buf(),
            relative: "lodger/lodgers".into(),
        },
    );
    let mut w = want(&["j1"], &[("j4", &[])]);
    w.cpu_jobs[0].pids = vec![4343];
    w.cpu_jobs.push(batch_job("j2", &[4242], &[]));
    w.cpu_jobs.push(batch_job(
        "j3",
        &[4444],
        &["system.slice/slurmstepd.scope/job_42"],
    ));
    let events = ctl.reconcile(&w);
    assert_eq!(
        std::fs::read_to_string(group.join("cgroup.procs")).expect("procs"),
        "4343",
        "only the instance was moved"
    );
    assert_eq!(
        events,
        [NetworkEvent::Held(job("j3")), NetworkEvent::Held(job("j4"))]
    );
    assert_eq!(ctl.job_text(&job("j2"), false).as_deref(), Some(UNSHAPED));
    let changes = runner.changes().join("\n");
    assert!(
        changes.contains("socket cgroupv2 level 3 \"system.slice/slurmstepd.scope/job_42\""),
        "{changes}"
    );
    assert!(
        changes.contains("socket cgroupv2 level 2 \"lodger/lodgers\""),
        "{changes}"
    );
}

/// Finding 7: a restart with another `[[network.link]]` list (eth9 → eth0) removes lodger's
/// tree from the interface no longer shaped at the first reconcile, and the other method's
/// route; the configured interface's tree is this control's own.
#[test]
fn the_first_reconcile_removes_what_another_configuration_left() {
    let runner = Shared::default();
    runner.0.lock().expect("runner").reply(
        &["tc", "qdisc", "show"],
        "qdisc htb 4c44: dev eth9 root refcnt 2 r2q 10 default 0x10\n\
         qdisc htb 4c44: dev eth0 root refcnt 2 r2q 10 default 0x10\n",
    );
    runner.0.lock().expect("runner").reply(
        &["nft", "list", "table", "inet", "lodger_route"],
        "table inet lodger_route {}\n",
    );
    let mut ctl = control(&runner, Classifier::CgroupV2);
    ctl.reconcile(&want(&[], &[]));
    let changes = runner.changes();
    assert!(
        changes.contains(&"tc qdisc del dev eth9 root".to_string()),
        "{changes:?}"
    );
    assert!(
        changes.contains(&"nft delete table inet lodger_route".to_string()),
        "{changes:?}"
    );
    // Once: a later reconcile looks no more.
    let before = runner.lines().len();
    ctl.reconcile(&want(&[], &[]));
    let later: Vec<String> = runner.lines()[before..].to_vec();
    assert!(!later.iter().any(|l| l.contains("eth9")), "{later:?}");
}
