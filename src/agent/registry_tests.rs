//! Who may register what: the checks a container target gets although only lodgerd's NRI
//! plugin (as root) names one.

use super::registry::Change;
use super::tests::Rig;
use super::Caller;
use crate::job::{ContainerJob, JobKind, JobSpec, Target};

fn container_at(cgroup: &str) -> JobSpec {
    JobSpec::new(
        JobKind::Training,
        Target::Container(ContainerJob {
            id: "c1".into(),
            pod: "kube-system/lodgerd-x".into(),
            sandbox: Some("p1".into()),
            name: "lodgerd".into(),
            cgroup: cgroup.into(),
        }),
        1,
    )
}

/// The rules that bind root bind the NRI plugin's registrations too: a container whose cgroup
/// holds lodgerd (its DaemonSet pod, were it left unannotated) or is one of lodger's own is
/// refused, with the reason; any other is taken.
#[test]
fn a_container_in_lodgerds_own_cgroup_or_lodgers_is_refused() {
    let rig = Rig::new();
    let agent = rig.agent();
    // lodgerd's cgroup, as the agent's /proc shows it.
    let own = rig.proc_root.path().join(std::process::id().to_string());
    std::fs::create_dir_all(&own).expect("fake /proc/<lodgerd>");
    std::fs::write(own.join("cgroup"), "0::/kubepods/besteffort/podL/lodgerd\n")
        .expect("its cgroup");
    let root = Caller::uid(0);
    let check = |cgroup: &str| {
        let spec = container_at(cgroup);
        agent
            .authorize(
                &root,
                &Change::Register {
                    owner: None,
                    spec: &spec,
                },
            )
            .map_err(|e| e.to_string())
    };
    for (cgroup, why) in [
        ("/kubepods/besteffort/podL/lodgerd", "holds lodgerd itself"),
        ("/kubepods/besteffort/podL", "holds lodgerd itself"),
        ("/lodger/lodgers", "one of lodger's own cgroups"),
    ] {
        let err = check(cgroup).expect_err(cgroup);
        assert!(
            err.contains(why) && err.contains("refused"),
            "{cgroup}: {err}"
        );
    }
    assert_eq!(check("/kubepods/besteffort/podT/trainer"), Ok(0));
}

/// A process in the agent's fake /proc: its parent, and uid 0.
fn fake_process(proc_root: &std::path::Path, pid: u32, ppid: u32) {
    let dir = proc_root.join(pid.to_string());
    std::fs::create_dir_all(&dir).expect("fake /proc/<pid>");
    std::fs::write(
        dir.join("stat"),
        format!("{pid} (p{pid}) S {ppid} 0 0 0 0 0 0\n"),
    )
    .expect("stat");
    std::fs::write(dir.join("status"), "Uid:\t0\t0\t0\t0\n").expect("status");
}

/// lodgerd's ancestry is read once and kept (every registration asked for it): it names every
/// ancestor there is, since it only loses members, so a registration it lets through is not
/// read again. A pid it names that is no longer an ancestor (the parent exited, lodgerd went to
/// pid 1, the pid was reused) is read again before it is refused, and then taken.
#[test]
fn lodgerds_ancestry_is_read_again_only_before_a_refusal() {
    const PARENT: u32 = 4_000_001;
    const OTHER: u32 = 4_000_002;
    let rig = Rig::new();
    let proc_root = rig.proc_root.path();
    let me = std::process::id();
    fake_process(proc_root, 1, 0);
    fake_process(proc_root, PARENT, 1);
    fake_process(proc_root, me, PARENT);
    fake_process(proc_root, OTHER, 1);
    let agent = rig.agent();
    assert_eq!(*agent.ancestry.borrow(), vec![me, PARENT, 1]);
    let register = |pid: u32| {
        let spec = JobSpec::new(JobKind::Training, Target::Pids(vec![pid]), 1);
        agent
            .authorize(
                &Caller::uid(0),
                &Change::Register {
                    owner: None,
                    spec: &spec,
                },
            )
            .map_err(|e| e.to_string())
    };
    let err = register(PARENT).expect_err("lodgerd's parent");
    assert!(err.contains("an ancestor of lodgerd"), "{err}");
    // The parent exits: lodgerd goes to pid 1, and the pid is reused by another process.
    fake_process(proc_root, me, 1);
    fake_process(proc_root, PARENT, OTHER);
    assert_eq!(register(OTHER), Ok(0));
    assert_eq!(
        *agent.ancestry.borrow(),
        vec![me, PARENT, 1],
        "a registration let through reads nothing again"
    );
    assert_eq!(register(PARENT), Ok(0), "read again before refusing: taken");
    assert_eq!(*agent.ancestry.borrow(), vec![me, 1]);
    let err = register(me).expect_err("lodgerd itself");
    assert!(err.contains("lodgerd itself"), "{err}");
}
