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
