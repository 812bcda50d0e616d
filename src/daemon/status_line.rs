//! status_line: the one line `systemctl status lodgerd` shows under the unit (sd_notify
//! `STATUS=`), from the node status the agent publishes: jobs, instances, training's CPUs,
//! contention and shaping. Sent when it changes, read every [`EVERY`]. Touches nothing but
//! sd_notify.

use std::time::Duration;

use crate::agent::{AgentHandle, NodeStatus};

/// How often the line is made again (and sent if it changed): the published status is read,
/// never waited for, so this costs one clone of it.
pub(super) const EVERY: Duration = Duration::from_secs(10);

/// Sends `STATUS=` whenever the line changes, every [`EVERY`], for as long as lodgerd serves.
/// Only under systemd (`NOTIFY_SOCKET` set): elsewhere nobody reads it.
pub(super) async fn run(agent: AgentHandle) {
    let mut last = Changed::default();
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Ok(status) = agent.status().await else {
            continue;
        };
        if let Some(line) = last.update(line(&status)) {
            super::notify(&[sd_notify::NotifyState::Status(&line)]);
        }
    }
}

/// The last line sent; a new one only when it differs.
#[derive(Debug, Default)]
struct Changed(Option<String>);

impl Changed {
    fn update(&mut self, line: String) -> Option<String> {
        if self.0.as_deref() == Some(line.as_str()) {
            return None;
        }
        self.0 = Some(line.clone());
        Some(line)
    }
}

/// `3 jobs, 8 instances; training on CPUs 2-9 (8), 52 free; contention watching; network
/// idle`, as `systemctl status` shows a service's own line.
fn line(s: &NodeStatus) -> String {
    let plural = |n: u32, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let training = if s.training.is_empty() {
        "no training placed".to_string()
    } else {
        format!("training on CPUs {} ({})", s.training, s.training.len())
    };
    let text = format!(
        "{}, {}; {training}, {} free; contention {}; network {}",
        plural(s.jobs, "job"),
        plural(s.instances, "instance"),
        s.free.len(),
        s.contention,
        s.network
    );
    // One line: the notify message is newline-separated assignments, and the contention and
    // network words may carry a command's error text.
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpuset::CpuSet;

    fn status(jobs: u32, training: &str) -> NodeStatus {
        NodeStatus {
            training: if training.is_empty() {
                CpuSet::default()
            } else {
                training.parse().expect("training")
            },
            free: "10-15".parse().expect("free"),
            jobs,
            instances: 1,
            contention: "watching".into(),
            network: "off".into(),
            ..NodeStatus::default()
        }
    }

    #[test]
    fn the_line_says_jobs_instances_training_and_controls() {
        assert_eq!(
            line(&status(3, "2-9")),
            "3 jobs, 1 instance; training on CPUs 2-9 (8), 6 free; contention watching; \
             network off"
        );
        assert_eq!(
            line(&status(1, "")),
            "1 job, 1 instance; no training placed, 6 free; contention watching; network off"
        );
    }

    #[test]
    fn an_error_text_cannot_add_an_assignment_to_the_notify_message() {
        let mut s = status(1, "2");
        s.network = "not shaping: tc failed\nWATCHDOG=trigger".into();
        let l = line(&s);
        assert!(!l.contains('\n'), "{l}");
        assert!(
            l.ends_with("network not shaping: tc failed WATCHDOG=trigger"),
            "{l}"
        );
    }

    #[test]
    fn a_line_is_sent_only_when_it_changes() {
        let mut last = Changed::default();
        assert!(last.update(line(&status(1, "2"))).is_some(), "the first");
        assert_eq!(last.update(line(&status(1, "2"))), None, "unchanged");
        assert!(last.update(line(&status(2, "2-3"))).is_some(), "changed");
    }
}
