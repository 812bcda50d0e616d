//! The agent's loop: its thread, the commands handled between ticks, the tick itself (which
//! only orchestrates the controllers, in a fixed order), status and shutdown.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Instant;

use tracing::{info, warn};

use super::batch::Batch;
use super::handle::Command;
use super::registry::Change;
use super::slurm::SlurmSeen;
use super::{training, Agent, AgentError, AgentHandle, Caller, NodeStatus, Snapshot, TickCx};
use crate::cpuset::CpuSet;
use crate::job::JobId;
use crate::policy::{self, contention::Throttles};

/// How many pids, and how many bytes of an instance's command, an audit record names.
const AUDIT_PIDS: usize = 16;
const AUDIT_COMMAND: usize = 512;

impl Agent {
    /// Starts the agent's thread. The handle is how everything else talks to it.
    pub fn spawn(self) -> std::io::Result<(AgentHandle, thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        // What was done to the agent before it got its thread (tests, the simulator) is seen.
        self.publish();
        let handle = AgentHandle {
            tx,
            events: self.events.clone(),
            ticks: self.ticks.clone(),
            published: self.published.clone(),
            sensed: self.sensor.as_ref().map(|l| l.latest.clone()),
        };
        let join = thread::Builder::new()
            .name("lodger-agent".into())
            .spawn(move || self.run(rx))?;
        Ok((handle, join))
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        let mut next_tick = Instant::now() + self.settings.interval;
        loop {
            let now = Instant::now();
            if now >= next_tick {
                self.tick();
                next_tick = Instant::now() + self.settings.interval;
                continue;
            }
            match rx.recv_timeout(next_tick - now) {
                Ok(Command::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Ok(cmd) => self.handle(cmd),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
        self.shutdown();
        info!(
            "agent stopped; {} job(s) stay enforced",
            self.state.jobs.len()
        );
    }

    /// lodgerd is stopping: a stop, restart or upgrade undoes nothing (issue 17). Training jobs
    /// stay enforced, inference instances run on and network shaping stays for the multi-node
    /// jobs that still run (the next lodgerd re-adopts all three, and removes shaping no job
    /// wants any more); `lodgerctl drain` undoes them on purpose. Contention throttles hold too
    /// (the state file keeps them and what was learnt; lodger's resctrl group stays while an MBA
    /// step is in force).
    pub(super) fn shutdown(&mut self) {
        if let Some(inference) = &mut self.inference {
            inference.leave_running();
        }
        // What changed since the last write without asking for one (lent CPU time), made
        // durable before lodgerd exits.
        if let Err(e) = self
            .store
            .save(&self.state)
            .and_then(|_| self.store.flush())
        {
            warn!("{e}");
        }
        if let Some(contention) = &mut self.contention {
            contention.stop();
        }
    }

    /// Handles one mutating command. The snapshot is published before the reply is sent, so a
    /// caller's next read-only call sees its own change.
    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Register {
                spec,
                owner,
                caller,
                sent,
                reply,
            } => {
                let started = Instant::now();
                let asked = describe(&spec, owner);
                // What the spec says is checked first: it is cheap and touches nothing, and
                // a caller's oversized list is refused before any of it is looked up.
                let result = spec
                    .validate()
                    .map_err(AgentError::from)
                    .and_then(|()| {
                        self.authorize(&caller, &Change::Register { owner, spec: &spec })
                    })
                    .and_then(|owner_uid| {
                        let spec = self.within_caps(&caller, owner_uid, *spec)?;
                        self.register_unsaved(spec, owner_uid)
                    });
                audit(
                    &caller,
                    "register",
                    &asked,
                    result
                        .as_ref()
                        .map(|j| format!("registered {} for uid {}", j.id, j.owner_uid)),
                );
                self.publish();
                let _ = reply.send(result);
                // The answer's way out (a tokio worker, the bus daemon, the caller) shares
                // lodgerd's housekeeping CPU; the work after the answer (the state file's save)
                // waits behind it rather than delay it: p99 1.03-1.25 -> 0.91-1.03 ms in the
                // spine benchmark (issue 21 item 1). A hint to the scheduler, nothing waits.
                std::thread::yield_now();
                let answered = started.elapsed();
                self.announce();
                // After the answer (see `store::Pending`).
                if let Err(e) = self.save_answered() {
                    warn!("{e}");
                }
                tracing::debug!(
                    "register command timing: queued {} us, handled {} us",
                    started.saturating_duration_since(sent).as_micros(),
                    answered.as_micros(),
                );
            }
            Command::Unregister { id, caller, reply } => {
                let result = self
                    .authorize(&caller, &Change::Unregister { id: &id })
                    .and_then(|_| self.unregister(&id));
                audit(
                    &caller,
                    "unregister",
                    &format!("job {id}"),
                    result.as_ref().map(|()| format!("unregistered {id}")),
                );
                self.publish();
                let _ = reply.send(result);
            }
            Command::Reload {
                live,
                network,
                reply,
            } => {
                self.reload(*live);
                self.reload_network(network);
                self.publish();
                let _ = reply.send(());
            }
            Command::Stop => {}
        }
    }

    /// Replaces what the read-only calls answer from (see `published`). The job list is the
    /// last one published when every job is as it shows (comparing costs no allocation;
    /// copying every job did).
    pub(super) fn publish(&self) {
        let last = self.published.current();
        let same = last.jobs.len() == self.state.jobs.len()
            && last
                .jobs
                .iter()
                .zip(self.state.jobs.values())
                .all(|(shown, stored)| *shown == stored.job);
        let jobs = if same {
            Arc::clone(&last.jobs)
        } else {
            Arc::new(self.state.jobs.values().map(|s| s.job.clone()).collect())
        };
        self.published.publish(Snapshot {
            jobs,
            observations: Arc::clone(&self.observations),
            status: self.status(),
        });
    }

    pub(super) fn status(&self) -> NodeStatus {
        let online = self.topology.online();
        let training: CpuSet = self
            .state
            .plan
            .training
            .values()
            .fold(CpuSet::new(), |acc, p| acc.union(&p.cpus));
        NodeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            free: online.difference(&self.reserved).difference(&training),
            cpus: online,
            reserved: self.reserved.clone(),
            training,
            numa_nodes: u32::try_from(self.topology.numa_nodes.len()).unwrap_or(u32::MAX),
            gpus: u32::try_from(self.topology.gpus.len()).unwrap_or(u32::MAX),
            smt: self.topology.has_smt(),
            jobs: u32::try_from(self.state.jobs.len()).unwrap_or(u32::MAX),
            instances: self.inference.as_ref().map_or(0, |i| {
                u32::try_from(i.runner.stats().len()).unwrap_or(u32::MAX)
            }),
            enforcement: self.training.enforcer.describe(),
            rt_priority: self.settings.rt_priority,
            interval_ms: u64::try_from(self.settings.interval.as_millis()).unwrap_or(u64::MAX),
            ticks: self.ticks.load(Ordering::Relaxed),
            throttle_actions: self.contention.as_ref().map_or(0, |c| c.actions())
                + self.network.as_ref().map_or(0, |n| n.actions()),
            network: match &self.network {
                None => "off (no [[network.link]] in the config)".into(),
                Some(n) => n.status(),
            },
            contention: match &self.contention {
                None => "off".into(),
                Some(c) => c.status(),
            },
            sample_ages: self.observations.ages.clone(),
            sensed_ms: self.observations.unix_ms,
        }
    }

    /// One pass of the loop: right-sizing, contention, decide, training enforcement, inference,
    /// network, then reap the jobs that ended, persist what changed and publish the snapshot the
    /// read-only calls answer from. Each concern is its controller's; this only orchestrates and
    /// hands one concern's output to the next.
    pub fn tick(&mut self) {
        self.take_observations();
        // SODA §V-B: never probe while a contention throttle is active on the node.
        let throttling = self.contention.as_ref().is_some_and(|c| c.throttling());
        let rightsize_enforce = self.rightsize.enforce();
        let enforcer = &self.training.enforcer;
        self.slurm = SlurmSeen::look(
            |job, record| enforcer.find_slurm(job, record),
            &self.state,
            &self.slurm,
            crate::clock::now_secs(),
            self.settings.slurm_appear_timeout,
        );
        let mut cx = TickCx {
            topology: &self.topology,
            reserved: &self.reserved,
            proc_root: &self.settings.proc_root,
            observations: &self.observations,
            state: &mut self.state,
            events: Vec::new(),
            slurm: &self.slurm,
            lendable: self.settings.lendable.as_ref(),
        };
        let tuned = self.rightsize.tick(&mut cx, throttling);
        let grown = self
            .rt_guard
            .as_mut()
            .is_some_and(|g| g.tick(&mut cx, rightsize_enforce));
        let mut throttled = false;
        let throttles = match &mut self.contention {
            Some(c) => {
                throttled = c.tick(&mut cx);
                c.throttles()
            }
            None => Throttles::default(),
        };
        let mut dirty = tuned || grown || throttled;
        if let Some(plan) = self.steady_plan.decide(
            cx.topology,
            cx.reserved,
            training::views(cx.state, rightsize_enforce, cx.slurm),
            &cx.state.plan,
        ) {
            dirty |= plan != cx.state.plan;
            cx.state.plan = plan;
            // A probe the plan could not give in full is measured at what it got.
            dirty |= self.rightsize.limit_to_plan(&mut cx);
        }
        let (changed, gone) = self.training.tick(&mut cx);
        dirty |= changed;
        dirty |= self.rightsize.adopt_slurm(&mut cx);
        if let Some(inference) = &mut self.inference {
            let (desired, replanned) = inference.plan(&mut cx, &throttles);
            if replanned {
                // Before anything starts (see `Inference::plan`).
                if let Err(e) = self.store.save(cx.state) {
                    warn!("{e}");
                }
                dirty = true;
            }
            dirty |= inference.apply(&mut cx, &desired);
            dirty |= self.lending.tick(&mut cx, &inference.runner.stats());
        }
        // After inference: batch jobs get what training and online inference leave.
        let batch_gone = match &mut self.batch {
            Some(b) => {
                let (changed, gone) = b.tick(&mut cx, &throttles);
                dirty |= changed;
                gone
            }
            None => Vec::new(),
        };
        // MBA once training, inference and batch enforcement have refreshed the jobs' pids;
        // the jobs that ended this tick (their pids no longer theirs) are not members.
        if let Some(c) = &mut self.contention {
            let ended: BTreeSet<JobId> = gone
                .iter()
                .chain(&batch_gone)
                .map(|(id, _)| id.clone())
                .collect();
            dirty |= c.apply_mba(&mut cx, &ended);
        }
        if let Some(network) = &mut self.network {
            let mut cpu_jobs = self
                .inference
                .as_ref()
                .map(|i| i.cpu_jobs())
                .unwrap_or_default();
            cpu_jobs.extend(Batch::cpu_jobs(&cx));
            dirty |= network.tick(&mut cx, cpu_jobs);
        }
        dirty |= self.training.reap(&mut cx, gone);
        if let Some(b) = &mut self.batch {
            dirty |= b.reap(&mut cx, batch_gone);
        }
        for event in cx.events {
            self.emit(event);
        }
        self.take_observations();
        // An answered registration whose save failed is saved now (see `save_answered`).
        dirty |= self.store.committed();
        if !dirty && self.store.behind() {
            // What a failed save left only in memory (an unregistration's, a tick's): written
            // again, without the re-plan a change asks for (a full disk can last many ticks).
            if let Err(e) = self.store.save(&self.state) {
                tracing::debug!("{e}");
            }
        }
        if dirty {
            self.send_jobs_to_sensor();
            self.state.plan = policy::decide(
                &self.topology,
                &self.reserved,
                &self.views(),
                &self.state.plan,
            );
            if let Err(e) = self.store.save(&self.state) {
                warn!("{e}");
            }
        }
        self.ticks.fetch_add(1, Ordering::Relaxed);
        self.publish();
    }
}

/// A registration request in words, for the audit record.
fn describe(spec: &crate::job::JobSpec, owner: Option<u32>) -> String {
    let target = match &spec.target {
        // The audit record names a few pids: the list is a caller's, of any length.
        crate::job::Target::Pids(p) if p.len() > AUDIT_PIDS => format!(
            "pids {:?} and {} more",
            &p[..AUDIT_PIDS],
            p.len() - AUDIT_PIDS
        ),
        crate::job::Target::Pids(p) => format!("pids {p:?}"),
        crate::job::Target::Cgroup(c) => format!("cgroup {c}"),
        crate::job::Target::Slurm(j) => format!("Slurm job {}", j.job_id),
        crate::job::Target::Container(c) => format!("container {} ({})", c.label(), c.id),
        crate::job::Target::Instances => {
            let mut argv = spec
                .inference
                .as_ref()
                .map(|i| i.command.join(" "))
                .unwrap_or_default();
            if argv.len() > AUDIT_COMMAND {
                let cut = (0..=AUDIT_COMMAND)
                    .rev()
                    .find(|&i| argv.is_char_boundary(i))
                    .unwrap_or(0);
                argv.truncate(cut);
                argv.push_str("...");
            }
            format!("instances of `{argv}`")
        }
    };
    let owner = owner.map(|o| format!(" for uid {o}")).unwrap_or_default();
    format!(
        "{} job, {target}, {} core(s){owner}",
        spec.kind.as_str(),
        spec.cores
    )
}

/// The audit record of one mutating call: who (as the bus vouches), what was asked, and what
/// lodgerd did or why it refused, as fields an operator can filter on (`target=lodger::audit`).
fn audit<T: AsRef<str>>(
    caller: &Caller,
    action: &str,
    asked: &str,
    result: Result<T, &AgentError>,
) {
    let comm = caller.comm.as_deref().unwrap_or("");
    let pid = caller.pid.unwrap_or(0);
    match result {
        Ok(done) => tracing::info!(
            target: "lodger::audit",
            caller_uid = caller.uid,
            caller_pid = pid,
            caller_comm = comm,
            action,
            asked,
            outcome = "done",
            done = done.as_ref(),
            "{action} by uid {}: {}", caller.uid, done.as_ref()
        ),
        Err(e) => tracing::warn!(
            target: "lodger::audit",
            caller_uid = caller.uid,
            caller_pid = pid,
            caller_comm = comm,
            action,
            asked,
            outcome = "refused",
            reason = %e,
            "{action} by uid {} refused: {e}", caller.uid
        ),
    }
}
