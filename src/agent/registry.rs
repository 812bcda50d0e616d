//! The registry of jobs: who may change it (one check, [`Agent::authorize`]), what a new job
//! must satisfy (`check_spec`), registration and unregistration, one way to build a new
//! [`Job`] and one save-or-rollback. Touches the store and, to admit or release a training job,
//! enforcement.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::{trust, Agent, AgentError, Caller, Event};
use crate::clock::now_secs;
use crate::cpuset::CpuSet;
use crate::enforce::{CgroupJobRecord, JobRecord, RootProcess};
use crate::job::{Job, JobId, JobKind, JobSpec, JobState, Target};
use crate::policy::{self, Plan, TrainingJobView};
use crate::store::{Lodging, Pending, StoredJob};

/// A mutating command, as the one caller check sees it.
pub(super) enum Change<'a> {
    /// Register `spec` for `owner` (None: for the caller).
    Register {
        owner: Option<u32>,
        spec: &'a JobSpec,
    },
    Unregister {
        id: &'a str,
    },
}

/// A job as registered, before it runs: `Pending`, no CPUs, no processes.
pub(super) fn new_job(id: JobId, spec: JobSpec, owner_uid: u32) -> Job {
    Job {
        id,
        owner_uid,
        state: JobState::Pending,
        cpus: CpuSet::new(),
        mems: CpuSet::new(),
        pids: Vec::new(),
        threads: 0,
        rr_threads: 0,
        last_error: None,
        registered_at: now_secs(),
        instances: Vec::new(),
        layout: None,
        core_budget: None,
        latency_ms: None,
        rightsize: None,
        tuning: Vec::new(),
        throttle: None,
        network: None,
        rt: None,
        account: Default::default(),
        spec,
    }
}

impl Agent {
    /// The one place a caller is checked against what it asks (docs/security.md). Returns the
    /// uid the change acts for. The API lets through only root and members of `api.group`;
    /// here a member may register only processes and cgroups it owns and change only its own
    /// jobs, root may do everything and act for another user, and nobody may hand lodger pid 1,
    /// a kernel thread, lodgerd's own ancestry or lodger's own cgroups.
    pub(super) fn authorize(
        &self,
        caller: &Caller,
        change: &Change<'_>,
    ) -> Result<u32, AgentError> {
        match change {
            Change::Register { owner, spec } => {
                let owner = match owner {
                    Some(owner) if *owner != caller.uid && !caller.is_root() => {
                        return Err(AgentError::AccessDenied(format!(
                            "uid {} may not register a job for uid {owner}: only root may act \
                             for another user (--user)",
                            caller.uid
                        )))
                    }
                    Some(owner) => *owner,
                    None => caller.uid,
                };
                let proc_root = &self.settings.proc_root;
                let slurm: Vec<(u64, String)> = self
                    .state
                    .jobs
                    .values()
                    .filter_map(|s| match (&s.job.spec.target, &s.record.slurm) {
                        (Target::Slurm(j), Some(r)) => Some((j.job_id, r.cgroup.clone()?)),
                        _ => None,
                    })
                    .collect();
                let trust = &self.settings.trust;
                let check = |ancestry: &[u32]| -> Result<(), AgentError> {
                    match &spec.target {
                        Target::Pids(pids) => {
                            for &pid in pids {
                                trust::check_pid(trust, proc_root, pid, caller, ancestry, &slurm)?;
                            }
                            Ok(())
                        }
                        Target::Cgroup(path) => {
                            trust::check_cgroup(trust, proc_root, path, caller, ancestry, &slurm)
                        }
                        // The rules that bind root bind lodgerd's NRI plugin too (checked
                        // below: only it names containers): not lodger's own cgroups, not
                        // lodgerd's (its DaemonSet pod), not one holding a process nobody may
                        // hand lodger. The plugin logs the refusal and the container runs as
                        // the runtime made it.
                        Target::Container(c) if caller.is_root() => trust::check_cgroup(
                            trust, proc_root, &c.cgroup, caller, ancestry, &slurm,
                        ),
                        _ => Ok(()),
                    }
                };
                // lodgerd's ancestry as read before: it only loses members (lodgerd and its
                // ancestors are given to an ancestor when a parent exits), so it names every
                // ancestor there is now, and perhaps a pid that exited and was reused. Read
                // again only when it refuses something, so a reused pid is not refused.
                let refused = check(&self.ancestry.borrow()).is_err();
                if refused {
                    let now = trust::own_ancestry(proc_root);
                    let checked = check(&now);
                    *self.ancestry.borrow_mut() = now;
                    checked?;
                }
                match &spec.target {
                    Target::Pids(_) | Target::Cgroup(_) => {}
                    Target::Container(c) => {
                        // Only lodgerd's own NRI plugin (docs/kubernetes.md) names containers:
                        // the cgroup is the container runtime's word, not a caller's.
                        if !caller.is_root() {
                            return Err(AgentError::AccessDenied(format!(
                                "uid {} may not register container {}: containers are \
                                 registered by lodgerd's NRI plugin",
                                caller.uid,
                                c.label()
                            )));
                        }
                    }
                    Target::Slurm(job) => {
                        // Only Slurm's prolog, run by slurmd as root, names Slurm jobs: the
                        // cgroup lodger then finds is Slurm's word, not the caller's.
                        if !caller.is_root() {
                            return Err(AgentError::AccessDenied(format!(
                                "uid {} may not register Slurm job {}: only root (Slurm's \
                                 prolog) registers Slurm jobs",
                                caller.uid, job.job_id
                            )));
                        }
                    }
                    Target::Instances => {
                        if let Some(inf) = &spec.inference {
                            crate::enforce::instances::check_launch(owner, &inf.launch)
                                .map_err(AgentError::AccessDenied)?;
                        }
                    }
                }
                Ok(owner)
            }
            Change::Unregister { id } => {
                let job = &self.find(id)?.job;
                if caller.is_root() || job.owner_uid == caller.uid {
                    Ok(job.owner_uid)
                } else {
                    Err(AgentError::AccessDenied(format!(
                        "job {} belongs to uid {}: only its owner or root may change it \
                         (you are uid {})",
                        job.id, job.owner_uid, caller.uid
                    )))
                }
            }
        }
    }

    /// The spec to register for `owner` within the per-owner caps (see `trust::within_caps`).
    pub(super) fn within_caps(
        &self,
        caller: &Caller,
        owner: u32,
        spec: JobSpec,
    ) -> Result<JobSpec, AgentError> {
        trust::within_caps(
            &self.settings.trust,
            caller,
            owner,
            spec,
            self.state.jobs.values().map(|s| &s.job),
        )
    }

    /// Checks a spec against the node and the other jobs, without changing anything.
    fn check_spec(&self, spec: &JobSpec) -> Result<(), AgentError> {
        spec.validate()?;
        if let Some(asked) = spec.memory_max {
            // Root's calls too: the bound is the node's, the cgroup rule everyone's.
            trust::check_batch_memory(spec, asked, self.settings.trust.batch_memory_max)?;
        }
        for &gpu in &spec.gpus {
            if self.topology.gpu(gpu).is_none() {
                let known: CpuSet = self.topology.gpus.iter().map(|g| g.index).collect();
                return Err(AgentError::InvalidSpec(if known.is_empty() {
                    format!(
                        "GPU {gpu} does not exist: lodger sees no NVIDIA GPU on this node; \
                         leave gpus empty or declare the GPUs under [[node.gpu]] in the config"
                    )
                } else {
                    format!("GPU {gpu} does not exist on this node (GPUs: {known})")
                }));
            }
        }
        match &spec.target {
            Target::Pids(pids) => {
                for &pid in pids {
                    if !self.settings.proc_root.join(pid.to_string()).exists() {
                        return Err(AgentError::InvalidSpec(format!(
                            "process {pid} does not exist (has it exited?)"
                        )));
                    }
                    if let Some(other) =
                        self.state.jobs.values().find(|s| s.job.pids.contains(&pid))
                    {
                        return Err(AgentError::Conflict(format!(
                            "process {pid} already belongs to job {}; unregister it first",
                            other.job.id
                        )));
                    }
                }
            }
            Target::Cgroup(path) => {
                if let Some(other) = self
                    .state
                    .jobs
                    .values()
                    .find(|s| s.job.spec.target == Target::Cgroup(path.clone()))
                {
                    return Err(AgentError::Conflict(format!(
                        "cgroup {path} is already registered as job {}; unregister it first",
                        other.job.id
                    )));
                }
            }
            Target::Container(c) => {
                if let Some(other) =
                    self.state.jobs.values().find(
                        |s| matches!(&s.job.spec.target, Target::Container(o) if o.id == c.id),
                    )
                {
                    return Err(AgentError::Conflict(format!(
                        "container {} is already registered as job {}",
                        c.label(),
                        other.job.id
                    )));
                }
            }
            Target::Slurm(job) => {
                if let Some(other) = self.state.jobs.values().find(
                    |s| matches!(&s.job.spec.target, Target::Slurm(o) if o.job_id == job.job_id),
                ) {
                    return Err(AgentError::Conflict(format!(
                        "Slurm job {} is already registered as job {}; unregister it first",
                        job.job_id, other.job.id
                    )));
                }
            }
            Target::Instances => {}
        }
        let container_lodger =
            spec.kind.is_inference() && matches!(spec.target, Target::Container(_));
        if (spec.kind == JobKind::Batch || container_lodger) && self.batch.is_none() {
            return Err(AgentError::InvalidSpec(
                "this lodgerd enforces no batch jobs or inference containers (its batch \
                 enforcer could not start: see its log)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Adds a job (with the plan it is placed in, for training) and remembers it. Nothing may
    /// change when the registration cannot be remembered: on a failed save the state is rolled
    /// back and the error returned.
    fn admit(&mut self, stored: StoredJob, plan: Option<Plan>) -> Result<(), AgentError> {
        let before = self.state.clone();
        self.state.next_seq += 1;
        if let Some(plan) = plan {
            self.state.plan = plan;
        }
        self.state.jobs.insert(stored.job.id.clone(), stored);
        if let Err(e) = self.store.save(&self.state) {
            self.state = before;
            return Err(e.into());
        }
        Ok(())
    }

    /// Adds an enforced training job and the plan it is placed in, and records it in the
    /// pending file ([`Store::commit_pending`]) rather than the state file, which
    /// [`Agent::save_answered`] writes once the caller has its answer. Nothing changes when the
    /// pending file cannot be written: the job and plan are taken back and the error returned.
    fn admit_committed(
        &mut self,
        stored: StoredJob,
        placement: crate::policy::Placement,
        plan: Plan,
    ) -> Result<(), AgentError> {
        let pending = Pending {
            id: stored.job.id.clone(),
            target: stored.job.spec.target.clone(),
            placement,
            // The job's record holds them.
            authorized: Vec::new(),
            cpusets: None,
            job: Some(Box::new(stored)),
        };
        self.store.commit_pending(&pending)?;
        // Moved in above to be written without a copy, and out again here: always `Some`.
        let Pending { id, job, .. } = pending;
        if let Some(stored) = job {
            self.state.next_seq += 1;
            self.state.plan = plan;
            self.state.jobs.insert(id, *stored);
        }
        Ok(())
    }

    /// Saves the state file if the pending file holds an answered registration (see
    /// [`Pending`]). After the answer the caller does not wait for it; a failure is logged
    /// there and retried here by the next mutating call, which refuses while the job cannot be
    /// recorded, and by every tick.
    pub(super) fn save_answered(&mut self) -> Result<(), AgentError> {
        if self.store.committed() {
            self.store.save(&self.state)?;
        }
        Ok(())
    }

    /// The start times of the processes a pid job names, as they are now (right after the
    /// caller's right to them was checked): a pid another process holds when the job is
    /// applied later is not the job's (`JobRecord::authorized`). Empty for other targets.
    fn start_times(&self, target: &Target) -> Vec<RootProcess> {
        let Target::Pids(pids) = target else {
            return Vec::new();
        };
        let mut reader = crate::sys::procfs::ProcReader::new(&self.settings.proc_root);
        pids.iter()
            .filter_map(|&pid| {
                let st = reader.stat(pid).ok()??;
                Some(RootProcess {
                    pid,
                    start_time: st.start_time,
                })
            })
            .collect()
    }

    /// lodger's job cgroups that no recorded job owns (a state file lost, or set aside as
    /// unreadable or a newer lodgerd's) are released before the first tick (see
    /// [`crate::enforce::Enforcer::release_orphans`]), one warning each, and no new job is given
    /// an id one of them had: its processes are not the new job's. Run at start, after an
    /// interrupted registration is undone.
    pub(super) fn release_orphans(&mut self) {
        let jobs = &self.state.jobs;
        let known = |id: &JobId| jobs.contains_key(id);
        let mut found = self.training.enforcer.release_orphans(&known);
        if let Some(batch) = &mut self.batch {
            found.extend(batch.enforcer.release_orphans(&known));
        }
        if found.is_empty() {
            return;
        }
        for (id, result) in &found {
            self.state.next_seq = self.state.next_seq.max(id.seq().saturating_add(1));
            match result {
                Ok(()) => warn!(
                    job = %id,
                    "lodger's cgroup for {id} belongs to no job in the state file (lost, or set \
                     aside): its threads are back to SCHED_OTHER, its processes in the \
                     hierarchy's root cgroup, and the cgroup removed"
                ),
                Err(e) => warn!(
                    job = %id,
                    "lodger's cgroup for {id} belongs to no job in the state file (lost, or set \
                     aside), and releasing it failed in part: {e}"
                ),
            }
        }
        if let Err(e) = self.store.save(&self.state) {
            warn!("{e}");
        }
    }

    /// A training registration a killed lodgerd left between touching the node and recording
    /// the job ([`Pending`]). Answered (the file holds the job): the job is recorded from it, as
    /// the caller was told. Not answered: its processes are taken over once more (to learn what
    /// is there) and released, so no thread stays real-time and no process in lodger's cgroup
    /// without a job; processes it had moved go back to the hierarchy's root, whose cgroup it did
    /// not get to record. Run at start, before the first tick (which re-adopts a recorded job as
    /// any other in the state file).
    pub(super) fn undo_interrupted_registration(&mut self) {
        let Some(p) = self.store.take_pending() else {
            return;
        };
        if self.state.jobs.contains_key(&p.id) {
            // Recorded after all: the state file has it.
            return;
        }
        if let Some(stored) = &p.job {
            let seq = p.id.seq();
            self.state.next_seq = self.state.next_seq.max(seq + 1);
            // Where it was placed: the first tick keeps a placement it can.
            self.state
                .plan
                .training
                .insert(p.id.clone(), p.placement.clone());
            self.state.jobs.insert(p.id.clone(), (**stored).clone());
            if let Err(e) = self.store.save(&self.state) {
                warn!("{e}");
                // Taken from disk above: written back until a save covers it (every tick
                // retries), so another end of lodgerd before then loses nothing either.
                if let Err(e) = self.store.commit_pending(&p) {
                    warn!("{e}");
                }
            }
            info!(
                job = %p.id,
                "the registration of {} was answered before lodgerd's end and is recorded now",
                p.id
            );
            return;
        }
        // Only the processes the registration was checked on: after a reboot or a long outage
        // its pids may be other processes' now. A cgroup's cpusets go back to what they were
        // before the registration: taking the job over again would save what the killed
        // lodgerd had already written as the values to restore.
        let mut record = JobRecord {
            authorized: p.authorized.clone(),
            cgroup: p
                .cpusets
                .as_ref()
                .map(|before| written_since(before, self.training.enforcer.cpusets_now(&p.target))),
            ..JobRecord::default()
        };
        let _ = self
            .training
            .enforcer
            .apply(&p.id, &p.target, &p.placement, &mut record);
        self.training.release_quietly(&p.id, &p.target, &record);
        // Its id is never given to another job (an id in a log means one job).
        let seq = p.id.seq();
        if seq >= self.state.next_seq {
            self.state.next_seq = seq + 1;
            if let Err(e) = self.store.save(&self.state) {
                warn!("{e}");
            }
        }
        tracing::warn!(
            job = %p.id,
            "the registration of {} was interrupted by lodgerd's end: its processes were \
             released (threads back to SCHED_OTHER); register them again",
            p.id
        );
    }

    /// Registers `spec` for `owner_uid` (already authorized) and saves the state file.
    #[cfg(test)]
    pub(super) fn register(&mut self, spec: JobSpec, owner_uid: u32) -> Result<Job, AgentError> {
        let job = self.register_unsaved(spec, owner_uid)?;
        self.announce();
        if let Err(e) = self.save_answered() {
            warn!("{e}");
        }
        Ok(job)
    }

    /// Registers `spec` for `owner_uid` (already authorized). A training job may be recorded
    /// only in the pending file on return, so the caller can be answered first:
    /// [`Agent::save_answered`] then writes the state file.
    pub(super) fn register_unsaved(
        &mut self,
        mut spec: JobSpec,
        owner_uid: u32,
    ) -> Result<Job, AgentError> {
        if let Target::Slurm(job) = &mut spec.target {
            // The v1 cgroup path names the job's owner.
            job.uid = owner_uid;
        }
        self.check_spec(&spec)?;
        let id = JobId::from_seq(self.state.next_seq);
        if spec.kind.is_inference()
            || spec.kind == JobKind::Batch
            || matches!(spec.target, Target::Slurm(_))
        {
            return self.register_deferred(id, spec, owner_uid);
        }
        // Where a registration's time goes (issue 21), for the spine benchmark and the debug log.
        let t0 = Instant::now();
        let mut views = self.views();
        views.push(TrainingJobView {
            id: id.clone(),
            cores: spec.cores,
            gpus: spec.gpus.clone(),
            within: None,
        });
        let plan = policy::decide(&self.topology, &self.reserved, &views, &self.state.plan);
        if let Some(no) = plan.unplaced.get(&id) {
            return Err(AgentError::NoCapacity(no.clone()));
        }
        let placement = plan.training.get(&id).cloned().ok_or_else(|| {
            AgentError::InvalidSpec("the policy gave the job no placement".into())
        })?;

        let t_plan = t0.elapsed();
        // The pending file may still hold the last registration, if its save failed.
        self.save_answered()?;
        // Undone at the next start if lodgerd dies before the job is committed below.
        let authorized = self.start_times(&spec.target);
        self.store.write_pending(&Pending {
            id: id.clone(),
            target: spec.target.clone(),
            placement: placement.clone(),
            job: None,
            authorized: authorized.clone(),
            cpusets: self.training.enforcer.cpusets_now(&spec.target),
        })?;
        let t_pending = t0.elapsed();
        let mut record = JobRecord {
            authorized,
            ..JobRecord::default()
        };
        let outcome = match self
            .training
            .enforcer
            .apply(&id, &spec.target, &placement, &mut record)
        {
            Ok(o) if o.alive => o,
            Ok(_) => {
                self.training.release_quietly(&id, &spec.target, &record);
                self.store.clear_pending();
                return Err(AgentError::InvalidSpec(
                    "the job has no running process (did it exit?)".into(),
                ));
            }
            Err(e) => {
                self.training.release_quietly(&id, &spec.target, &record);
                self.store.clear_pending();
                return Err(e.into());
            }
        };
        let job = Job {
            // A container registered at its creation waits for the runtime to start it.
            state: match outcome.waiting {
                Some(_) => JobState::Pending,
                None => JobState::Running,
            },
            last_error: outcome.waiting.clone(),
            cpus: placement.cpus.clone(),
            mems: placement.mems.clone(),
            pids: outcome.pids.clone(),
            threads: outcome.threads,
            rr_threads: outcome.rr_threads,
            ..new_job(id.clone(), spec, owner_uid)
        };
        let tuning = self.rightsize.new_tuning(
            &id,
            &job,
            &plan,
            &self.state,
            &self.topology,
            &self.reserved,
            None,
        );
        let stored = StoredJob {
            job: job.clone(),
            record: record.clone(),
            lodging: Lodging::default(),
            tuning,
        };
        let t_enforce = t0.elapsed();
        // Recorded in the pending file, not yet the state file: the caller's answer does not
        // wait for the state file's write (see `Pending`; `save_answered` follows the answer).
        if let Err(e) = self.admit_committed(stored, placement, plan) {
            self.training
                .release_quietly(&id, &job.spec.target, &record);
            self.store.clear_pending();
            return Err(e);
        }
        let us = |d: std::time::Duration| d.as_micros();
        debug!(
            "registration timing: plan {} us, pending {} us, enforce {} us, commit {} us",
            us(t_plan),
            us(t_pending - t_plan),
            us(t_enforce - t_pending),
            us(t0.elapsed() - t_enforce),
        );
        info!(job = %id, cpus = %job.cpus, pids = ?job.pids, threads = job.threads, "registered training job");
        // After the answer (see `Agent::unannounced`).
        self.unannounced = Some(id);
        Ok(job)
    }

    /// Registers a job the next tick places: an inference job (its instances are started
    /// then), a batch job (it takes what the tick leaves), a Slurm job (its cgroup may not exist
    /// yet). The tick runs at once, so the caller sees the job as it is placed.
    fn register_deferred(
        &mut self,
        id: JobId,
        spec: JobSpec,
        owner_uid: u32,
    ) -> Result<Job, AgentError> {
        if spec.kind.is_inference() && self.inference.is_none() {
            return Err(AgentError::InvalidSpec(
                "this lodgerd runs no inference instances (simulated enforcement, or the instance \
                 runner could not start: see its log)"
                    .into(),
            ));
        }
        if let Some(inf) = &spec.inference {
            crate::enforce::instances::validate_template(&id, &inf.command)
                .map_err(|e| AgentError::InvalidSpec(e.to_string()))?;
        }
        let authorized = self.start_times(&spec.target);
        let job = new_job(id.clone(), spec, owner_uid);
        let stored = StoredJob {
            job: job.clone(),
            record: JobRecord {
                authorized,
                ..JobRecord::default()
            },
            lodging: Lodging::default(),
            tuning: None,
        };
        self.admit(stored, None)?;
        info!(job = %id, kind = job.spec.kind.as_str(), target = ?job.spec.target, "registered job");
        self.send_jobs_to_sensor();
        self.emit(Event::JobAdded(id.clone()));
        // Place it (and start its instances) now rather than at the next tick.
        self.tick();
        Ok(self
            .state
            .jobs
            .get(&id)
            .map(|s| s.job.clone())
            .unwrap_or(job))
    }

    /// Unregisters a job (already authorized): its processes are released, or its instances
    /// stopped, and its cores freed.
    pub(super) fn unregister(&mut self, id: &str) -> Result<(), AgentError> {
        let jid = self.find(id)?.job.id.clone();
        // An answered registration's record is superseded by a saved state first.
        self.save_answered()?;
        let Some(stored) = self.state.jobs.remove(&jid) else {
            return Err(AgentError::NotFound(id.to_string()));
        };
        if stored.job.spec.kind.is_inference() {
            if let Some(inference) = &mut self.inference {
                inference.stop_job(&jid);
            }
            self.state.inference.online.remove(&jid);
            self.state.inference.offline.remove(&jid);
            if let (Target::Container(_), Some(batch)) = (&stored.job.spec.target, &mut self.batch)
            {
                // An inference container is enforced as batch jobs are (`agent::batch`).
                batch.release_quietly(&jid, &stored.job.spec.target, &stored.record);
            }
        } else if stored.job.spec.kind == JobKind::Batch {
            if let Some(batch) = &mut self.batch {
                batch.release_quietly(&jid, &stored.job.spec.target, &stored.record);
            }
        } else {
            self.training
                .release_quietly(&jid, &stored.job.spec.target, &stored.record);
        }
        self.state.plan = policy::decide(
            &self.topology,
            &self.reserved,
            &self.views(),
            &self.state.plan,
        );
        // Released already: what the owner asked for is done, and the job is gone from memory
        // either way. A failed save is retried at every tick (`Store::behind`).
        if let Err(e) = self.store.save(&self.state) {
            warn!(
                job = %jid,
                "job {jid} is unregistered, but the state file could not be written ({e}): \
                 lodgerd writes it again at every tick; a restart before it succeeds would \
                 bring the job back, to be unregistered again"
            );
        }
        if self.state.jobs.is_empty() {
            self.training.enforcer.tidy();
        }
        info!(job = %jid, cpus = %stored.job.cpus, "unregistered; cores freed");
        self.send_jobs_to_sensor();
        self.emit(Event::JobChanged(jid.clone(), JobState::Exited));
        self.emit(Event::JobRemoved(jid));
        Ok(())
    }
}

/// The cgroups of `before` (a registration's, see `Pending::cpusets`) whose cpusets differ
/// now: the ones the interrupted registration wrote, to be restored. Those equal to `before`
/// or gone are left out, so undoing the registration writes nothing it did not change.
fn written_since(before: &CgroupJobRecord, now: Option<CgroupJobRecord>) -> CgroupJobRecord {
    let now = now.map(|n| n.saved).unwrap_or_default();
    CgroupJobRecord {
        cgroup: before.cgroup.clone(),
        saved: before
            .saved
            .iter()
            .filter(|b| {
                now.iter()
                    .any(|n| n.cgroup == b.cgroup && (n.cpus != b.cpus || n.mems != b.mems))
            })
            .cloned()
            .collect(),
    }
}
