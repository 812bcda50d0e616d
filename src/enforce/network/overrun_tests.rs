//! A command that overruns its deadline (`agent.command_timeout_ms`): reported in the status and
//! retried at the next reconcile, with nothing else held up.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::node::{Classifier, CpuJob, NetworkControl, NetworkWant};
use super::{Link, RecordingRunner, ShapingConfig, Steering, TcError, TcRunner};
use crate::job::JobId;

/// Answers like a node with nothing of lodger's, except that the first `tc qdisc replace`
/// overruns its deadline (as `CommandRunner` reports a killed command).
#[derive(Clone)]
struct HangsOnce {
    inner: Arc<Mutex<RecordingRunner>>,
    hung: Arc<Mutex<u32>>,
}

impl TcRunner for HangsOnce {
    fn run(&mut self, argv: &[String]) -> Result<String, TcError> {
        if argv.starts_with(&["tc".to_string(), "qdisc".into(), "replace".into()]) {
            let mut hung = self.hung.lock().expect("count");
            if *hung == 0 {
                *hung += 1;
                return Err(TcError::TimedOut {
                    argv: argv.join(" "),
                    deadline: Duration::from_millis(5000),
                });
            }
        }
        self.inner.lock().expect("runner").run(argv)
    }
}

fn job(s: &str) -> JobId {
    JobId::parse(s).expect("id")
}

#[test]
fn an_overrunning_command_is_reported_and_retried_at_the_next_tick() {
    let mut recording = RecordingRunner::new();
    recording
        .reply(
            &["tc", "qdisc", "show"],
            "qdisc noqueue 0: root refcnt 2 \n",
        )
        .fail(
            &["nft", "-j", "list"],
            "Error: No such file or directory\nlist table inet lodger\n",
        );
    let runner = HangsOnce {
        inner: Arc::new(Mutex::new(recording)),
        hung: Arc::new(Mutex::new(0)),
    };
    let config = ShapingConfig {
        links: vec![Link {
            interface: "eth0".into(),
            line_rate_mbit: 1000,
        }],
        ..ShapingConfig::default()
    };
    let mut ctl = NetworkControl::new(
        &config,
        Steering::Nft,
        Box::new(runner.clone()),
        Classifier::CgroupV2,
    )
    .expect("control");
    let want = NetworkWant {
        multi_node: vec![job("j1")],
        cpu_jobs: vec![CpuJob {
            job: job("j2"),
            pids: Vec::new(),
            instances: true,
            cgroups: vec!["lodger/lodgers".into()],
        }],
    };
    assert!(ctl.reconcile(&want).is_empty());
    let status = ctl.status();
    assert!(
        status.starts_with("not shaping:") && status.contains("did not finish within 5s: killed"),
        "{status}"
    );
    assert_eq!(*runner.hung.lock().expect("count"), 1);
    // The next tick tries again and shapes.
    assert_eq!(ctl.reconcile(&want).len(), 1);
    assert!(ctl.status().starts_with("shaping eth0"), "{}", ctl.status());
}
