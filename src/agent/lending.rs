//! Lent CPU time (issue 19): each tick, the CPU time every inference instance (and inference
//! container's process) used since the last (utime + stime, `/proc/PID/stat`) is charged to its
//! job and, where its CPUs are
//! a training job's, to that training job as lent time; the training jobs' cores' idle time comes
//! from `/proc/stat`. Kept in each job's [`CpuAccount`] (persisted with the state). Batch jobs
//! never run on training cores and online instances never do: what is lent is offline
//! inference's. Reads /proc; changes nothing on the node.

use std::collections::BTreeMap;
use std::path::Path;

use super::TickCx;
use crate::cpuset::CpuSet;
use crate::enforce::instances::InstanceStats;
use crate::job::{JobId, Target};
use crate::sense::cpu::{parse_pid_stat, CpuReader, CpuTimes};

/// How often lent time alone is worth a write of the state file.
const PERSIST_EVERY_S: u64 = 60;

/// One instance's CPU time this tick: its job, its CPUs, ticks since the last look.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Used {
    pub job: JobId,
    pub cpus: CpuSet,
    pub ticks: u64,
}

/// Charges `used` to the lodgers and, by the share of each instance's CPUs that are a training
/// job's, to the training jobs: (lent ticks per training job, (used, on training) per lodger).
/// Pure.
pub(super) fn attribute(
    used: &[Used],
    training: &BTreeMap<JobId, CpuSet>,
) -> (BTreeMap<JobId, f64>, BTreeMap<JobId, (f64, f64)>) {
    let mut lent: BTreeMap<JobId, f64> = BTreeMap::new();
    let mut lodgers: BTreeMap<JobId, (f64, f64)> = BTreeMap::new();
    for u in used {
        let ticks = u.ticks as f64;
        let entry = lodgers.entry(u.job.clone()).or_default();
        entry.0 += ticks;
        let n = u.cpus.len().max(1) as f64;
        for (t, cpus) in training {
            let shared = u.cpus.intersection(cpus).len() as f64;
            if shared > 0.0 {
                let part = ticks * shared / n;
                *lent.entry(t.clone()).or_default() += part;
                entry.1 += part;
            }
        }
    }
    (lent, lodgers)
}

/// The accounting's memory between ticks.
pub(super) struct Lending {
    /// Each instance process's CPU ticks at the last look, by (pid, start time).
    last: BTreeMap<(u32, u64), u64>,
    /// `/proc/stat` per CPU at the last look.
    cpus: BTreeMap<u32, CpuTimes>,
    reader: CpuReader,
    ticks_per_s: f64,
    /// Seconds since the epoch of the last tick whose accounting asked for a write.
    persisted_s: u64,
}

impl Lending {
    pub(super) fn new(proc_root: &Path) -> Self {
        Self {
            last: BTreeMap::new(),
            cpus: BTreeMap::new(),
            reader: CpuReader::new(proc_root),
            ticks_per_s: procfs::ticks_per_second().max(1) as f64,
            persisted_s: crate::clock::now_secs(),
        }
    }

    /// Charges this tick's CPU time: the instances' (`stats`) and the inference containers'
    /// processes (their jobs' last seen pids, on their jobs' CPUs). Returns whether the state
    /// file should be written for it (at most once a minute: a killed lodgerd loses at most that
    /// much).
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>, stats: &[InstanceStats]) -> bool {
        let mut used = Vec::new();
        let mut seen = BTreeMap::new();
        let instances = stats
            .iter()
            .filter_map(|st| Some((st.pid?, &st.job, &st.cpus)));
        let containers = cx
            .state
            .jobs
            .values()
            .filter(|s| {
                s.job.spec.kind.is_inference() && matches!(s.job.spec.target, Target::Container(_))
            })
            .flat_map(|s| {
                s.job
                    .pids
                    .iter()
                    .map(move |&pid| (pid, &s.job.id, &s.job.cpus))
            });
        for (pid, job, cpus) in instances.chain(containers) {
            let Ok(text) = std::fs::read(cx.proc_root.join(pid.to_string()).join("stat")) else {
                continue;
            };
            let Some((ticks, start)) = parse_pid_stat(&text) else {
                continue;
            };
            // A process first seen is charged from now on: what it used before is unknown.
            if let Some(&before) = self.last.get(&(pid, start)) {
                used.push(Used {
                    job: job.clone(),
                    cpus: cpus.clone(),
                    ticks: ticks.saturating_sub(before),
                });
            }
            seen.insert((pid, start), ticks);
        }
        self.last = seen;
        let training: BTreeMap<JobId, CpuSet> = cx
            .state
            .plan
            .training
            .iter()
            .map(|(id, p)| (id.clone(), p.cpus.clone()))
            .collect();
        let (lent, lodgers) = attribute(&used, &training);
        let idle = self.idle_ticks(&training);
        let per_s = self.ticks_per_s;
        let mut any = false;
        for stored in cx.state.jobs.values_mut() {
            let a = &mut stored.job.account;
            let id = &stored.job.id;
            if let Some(t) = lent.get(id) {
                a.lent_s += t / per_s;
                any |= *t > 0.0;
            }
            if let Some(t) = idle.get(id) {
                a.idle_s += t / per_s;
            }
            if let Some((u, on)) = lodgers.get(id) {
                a.used_s += u / per_s;
                a.on_training_s += on / per_s;
                any |= *u > 0.0;
            }
        }
        let now = crate::clock::now_secs();
        if any && now.saturating_sub(self.persisted_s) >= PERSIST_EVERY_S {
            self.persisted_s = now;
            return true;
        }
        false
    }

    /// Idle ticks of each training job's CPUs since the last look.
    fn idle_ticks(&mut self, training: &BTreeMap<JobId, CpuSet>) -> BTreeMap<JobId, f64> {
        let Ok(sample) = self.reader.stat() else {
            return BTreeMap::new();
        };
        let now: BTreeMap<u32, CpuTimes> = sample.cpus.into_iter().collect();
        let mut out = BTreeMap::new();
        for (id, cpus) in training {
            let mut idle = 0u64;
            for cpu in cpus.iter() {
                if let (Some(a), Some(b)) = (self.cpus.get(&cpu), now.get(&cpu)) {
                    idle += b.idle.saturating_sub(a.idle) + b.iowait.saturating_sub(a.iowait);
                }
            }
            out.insert(id.clone(), idle as f64);
        }
        self.cpus = now;
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn set(list: &str) -> CpuSet {
        CpuSet::parse(list).unwrap()
    }

    #[test]
    fn an_instance_on_a_training_core_is_lent_time_and_elsewhere_only_used_time() {
        let (t1, t2, off) = (JobId::from_seq(1), JobId::from_seq(2), JobId::from_seq(3));
        let training = BTreeMap::from([(t1.clone(), set("0-1")), (t2.clone(), set("4"))]);
        let used = [
            Used {
                job: off.clone(),
                cpus: set("0"),
                ticks: 100,
            },
            Used {
                job: off.clone(),
                cpus: set("2"),
                ticks: 50,
            },
            // Two CPUs, one of them training's: half of it lent.
            Used {
                job: off.clone(),
                cpus: set("3-4"),
                ticks: 40,
            },
        ];
        let (lent, lodgers) = attribute(&used, &training);
        assert_eq!(lent[&t1], 100.0);
        assert_eq!(lent[&t2], 20.0);
        assert_eq!(lodgers[&off], (190.0, 120.0));
    }
}
