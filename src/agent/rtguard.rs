//! The RT guard: keeps SCHED_RR training jobs under the kernel's RT limit. Each tick it measures
//! every running training job's CPU time per CPU of its cpuset (its processes' CPU-time clocks:
//! one syscall a process) and, every [`DETAIL_PERIOD`] while it uses at least 1 % of them or
//! every tick while the job is close to the limit, its threads' run-queue wait (a schedstat file
//! a thread: the costly part at 1,000 threads, issue 21) (`sense::rtlimit`), records them on the
//! job (`lodgerctl show`, metrics), and when a job stays
//! within `training.rt_headroom_percent` of the limit for [`GROW_AFTER`] measurements (each over
//! at least [`RATE_WINDOW`]) it grows the job
//! by one core if the plan can place it, or says once that it cannot. Touches /proc (read) and
//! the jobs lent by the tick.
//!
//! A job the sensing pass saw idle (under 1 % of its CPUs) is shown with that figure and not
//! read at all.
//!
//! Why: a job whose threads keep each of its CPUs busier than `sched_rt_runtime_us /
//! sched_rt_period_us` (95 %) is stopped by the kernel for the rest of each period, up to 50 ms a
//! second (issue 14: step p99 58 ms against 30 ms under SCHED_OTHER). Consolidation and
//! right-sizing (SODA §V-B: fewest cores at full speed) push a job exactly there; one more core
//! brings it back under the limit without leaving SCHED_RR (Cloud Reamer §III-A).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::training::{view_cores, views};
use super::TickCx;
use crate::job::{JobId, JobState, Role, RtStanding};
use crate::policy;
use crate::sense::rtlimit::{self, CpuClock, CpuSample, ThreadTimes};
use crate::store::{StoredJob, Tuning};

/// Measurements in a row near the limit before the job is grown (one is noisy).
pub const GROW_AFTER: u32 = 3;
/// A job's CPU share is measured over at least this long: a shorter tick reuses the last
/// figure, so a 50-ms tick reads no more clocks than a 1-s one.
pub const RATE_WINDOW: Duration = Duration::from_secs(1);
/// The node's RT limit (two sysctls) is read again this often.
const LIMIT_EVERY: Duration = Duration::from_secs(10);
/// A job's threads' run-queue wait is read at least this often (and every tick while the job is
/// within twice the headroom of the limit).
pub const DETAIL_PERIOD: Duration = Duration::from_secs(10);
/// Below this share of its CPUs a job's threads are not read at all (see [`DETAIL_PERIOD`]), and
/// a job the sensing pass saw below it is not measured by the guard either.
const DETAIL_MIN_SHARE: f64 = 0.01;

#[derive(Debug)]
struct Watch {
    cpu: CpuSample,
    /// The last per-thread reading, and the wait it gave against the one before.
    detail: ThreadTimes,
    runq_wait_ms_per_s: f64,
    near_ticks: u32,
    /// The "cannot grow" line was logged for this episode.
    told: bool,
}

/// See the module doc.
#[derive(Debug)]
pub(super) struct RtGuard {
    /// `training.rt_headroom_percent` as a share of a CPU.
    headroom: f64,
    watches: HashMap<JobId, Watch>,
    /// The processes' CPU-time clocks; a fake proc tree's schedstat files in tests.
    pub(super) clock: CpuClock,
    /// The node's RT limit and when it was read.
    limit: Option<(Option<f64>, Instant)>,
    /// [`RATE_WINDOW`]; zero in tests that tick faster than a clock would move.
    pub(super) rate_window: Duration,
}

impl RtGuard {
    pub(super) fn new(headroom_percent: u32) -> Self {
        Self {
            headroom: f64::from(headroom_percent) / 100.0,
            watches: HashMap::new(),
            clock: rtlimit::kernel_clock,
            limit: None,
            rate_window: RATE_WINDOW,
        }
    }

    /// A reload's new `training.rt_headroom_percent`: applies from the next tick; the jobs
    /// watched and the cores already added are kept.
    pub(super) fn set_headroom(&mut self, headroom_percent: u32) {
        self.headroom = f64::from(headroom_percent) / 100.0;
    }

    /// Measures every running training job; grows those that stayed near the limit. Returns
    /// whether a job's core count changed (the plan must be made again).
    pub(super) fn tick(&mut self, cx: &mut TickCx<'_>, rightsize_enforce: Option<bool>) -> bool {
        let now = Instant::now();
        let limit = match self.limit {
            Some((limit, at)) if now.saturating_duration_since(at) < LIMIT_EVERY => limit,
            _ => {
                let limit = rtlimit::rt_limit(cx.proc_root);
                self.limit = Some((limit, now));
                limit
            }
        };
        let guarded = |s: &StoredJob| {
            s.job.spec.kind.role() == Role::Training && s.job.state == JobState::Running
        };
        let running: Vec<JobId> = cx
            .state
            .jobs
            .values()
            .filter(|s| guarded(s) && !s.job.pids.is_empty())
            .map(|s| s.job.id.clone())
            .collect();
        let jobs = &cx.state.jobs;
        self.watches
            .retain(|id, _| jobs.get(id).is_some_and(&guarded));
        let mut changed = false;
        for id in running {
            let Some(stored) = cx.state.jobs.get_mut(&id) else {
                continue;
            };
            if self
                .watches
                .get(&id)
                .is_some_and(|w| now.saturating_duration_since(w.cpu.at) < self.rate_window)
            {
                continue;
            }
            let cpus = stored.job.cpus.len();
            // The sensing pass measured the job's CPU time over the same second: a job it saw
            // idle is not read again (one clock read a process: most of the guard's cost at 100
            // idle jobs, issue 21). Its watch goes, so a job that wakes is measured afresh.
            let sensed = cx.observations.jobs.get(&id).and_then(|m| m.cpu_percent);
            if let Some(sensed) = sensed.filter(|p| *p / 100.0 < DETAIL_MIN_SHARE * cpus as f64) {
                self.watches.remove(&id);
                let share = sensed / 100.0 / cpus.max(1) as f64;
                record_standing(stored, share, limit, 0.0, false);
                continue;
            }
            let cur = rtlimit::cpu_sample(self.clock, cx.proc_root, &stored.job.pids);
            let Some(watch) = self.watches.get_mut(&id) else {
                self.watches.insert(
                    id,
                    Watch {
                        cpu: cur,
                        detail: rtlimit::thread_times(cx.proc_root, &stored.job.pids),
                        runq_wait_ms_per_s: 0.0,
                        near_ticks: 0,
                        told: false,
                    },
                );
                continue;
            };
            let share = rtlimit::share_per_cpu(&watch.cpu, &cur, cpus);
            let at = cur.at;
            watch.cpu = cur;
            let Some(share) = share else { continue };
            let near = limit.is_some_and(|l| share >= l - self.headroom);
            let close = limit.is_some_and(|l| share >= l - 2.0 * self.headroom);
            let due = at.saturating_duration_since(watch.detail.at) >= DETAIL_PERIOD;
            if due && share < DETAIL_MIN_SHARE && !close {
                // Idle: its threads hardly asked to run, so they hardly waited. Not read (a
                // thousand files at 100 idle jobs, issue 21), and shown without a wait.
                watch.runq_wait_ms_per_s = 0.0;
            } else if close || due {
                let detail = rtlimit::thread_times(cx.proc_root, &stored.job.pids);
                if let Some(wait) = rtlimit::runq_wait_ms_per_s(&watch.detail, &detail) {
                    watch.runq_wait_ms_per_s = wait;
                }
                watch.detail = detail;
            }
            watch.near_ticks = if near { watch.near_ticks + 1 } else { 0 };
            if !near {
                watch.told = false;
            }
            record_standing(stored, share, limit, watch.runq_wait_ms_per_s, near);
            // Right-sizing can search only on this job's own GPU figures: the node senses GPUs,
            // its newest pass is fresh and gave the job a figure (finding 4: a job whose figures
            // stopped was held throttled for good). Before the first pass that is not known
            // yet, and the guard waits.
            let obs = cx.observations;
            let figures = obs.unix_ms == 0
                || (!obs.sources.gpu.starts_with("unavailable")
                    && !obs.is_stale("gpu")
                    && obs.jobs.get(&id).and_then(|m| m.gpu_percent).is_some());
            if holds_for_rightsizing(stored.tuning.as_ref(), rightsize_enforce, figures) {
                watch.near_ticks = 0;
                // The right-sizer owns the count while it searches: a core added before a new
                // search began goes back, so each probe measures the count it chose.
                if let Some(rt) = stored.job.rt.as_mut().filter(|r| r.extra_cores > 0) {
                    rt.extra_cores = 0;
                    changed = true;
                }
                continue;
            }
            if watch.near_ticks < GROW_AFTER {
                continue;
            }
            watch.near_ticks = 0;
            let share = share * 100.0;
            let limit_pct = limit.unwrap_or(1.0) * 100.0;
            let cap = grow_cap(stored.job.spec.cores, cx.slurm.cpus(&id).as_ref());
            let extra = stored.job.rt.as_ref().map_or(0, |r| r.extra_cores);
            if extra < cap && try_grow(cx, &id, rightsize_enforce) {
                info!(
                    job = %id,
                    "uses {share:.0}% of each of its {cpus} CPU(s), near the RT limit \
                     ({limit_pct:.0}% = sched_rt_runtime_us / sched_rt_period_us): the kernel would \
                     stop its threads for the rest of each period; grown by one core"
                );
                changed = true;
            } else if !watch.told {
                watch.told = true;
                warn!(
                    job = %id,
                    "uses {share:.0}% of each of its {cpus} CPU(s), near the RT limit \
                     ({limit_pct:.0}%): its SCHED_RR threads are throttled up to \
                     {:.0} ms a second and no core is free to grow it (or its Slurm cpuset has \
                     none left); free a core, or run training as SCHED_OTHER \
                     (training.policy = \"other\")",
                    (1.0 - limit_pct / 100.0) * 1000.0
                );
            }
        }
        changed
    }
}

/// Shows the job's standing against the RT limit (`share` and `limit` as shares of a CPU),
/// keeping the cores the guard already added.
fn record_standing(
    stored: &mut StoredJob,
    share: f64,
    limit: Option<f64>,
    runq_wait_ms_per_s: f64,
    near_limit: bool,
) {
    let extra_cores = stored.job.rt.as_ref().map_or(0, |r| r.extra_cores);
    stored.job.rt = Some(RtStanding {
        share_percent: share * 100.0,
        limit_percent: limit.map(|l| l * 100.0),
        runq_wait_ms_per_s,
        near_limit,
        extra_cores,
    });
}

/// Whether the guard leaves the job to the right-sizer: right-sizing resizes, has not settled
/// the job's core count, and can search (`figures`: the node senses GPU utilization; before its
/// first sensing pass that is not known yet, and the guard waits). A core added under a probe
/// would make the tuner measure another count than it chose (seen as searches that never
/// settled, and as a starved job settled at too few cores when the guard grew it before the
/// first GPU figure came), and the search itself sees a throttled count as a slower one (SODA
/// §V-B). Once the search settles, where right-sizing is off or advises only, or where the node
/// has no GPU sensing (the search would wait for figures that never come: lodgers benchmark (e),
/// session 8, a job above the RT limit left throttled for good), or for this job (its
/// utilization not attributed, its GPU lost, the source stale: `figures` is per job), or where
/// the search waits for samples that stopped (`Tuner::stalled`), the guard acts. The job's
/// standing is measured and shown either way.
fn holds_for_rightsizing(
    tuning: Option<&Tuning>,
    rightsize_enforce: Option<bool>,
    figures: bool,
) -> bool {
    rightsize_enforce == Some(true)
        && figures
        && tuning.is_some_and(|t| t.tuner.settled().is_none() && !t.tuner.stalled())
}

/// The most cores the guard adds to a job that asked for `cores`: at most doubling it (a job
/// that keeps every core it gets busy is not held back by the RT limit but by its own demand).
/// A Slurm job that asked for none asked for its whole cpuset (`within`): up to that size, of
/// which [`try_grow`] adds only what the cpuset still has.
fn grow_cap(cores: u32, within: Option<&crate::cpuset::CpuSet>) -> u32 {
    match within {
        Some(w) if cores == 0 => u32::try_from(w.len()).unwrap_or(u32::MAX).max(1),
        _ => cores.max(1),
    }
}

/// Gives `id` one more core if that adds a core (a Slurm job never grows beyond its cpuset) and
/// the plan then still places every job it placed.
fn try_grow(cx: &mut TickCx<'_>, id: &JobId, rightsize_enforce: Option<bool>) -> bool {
    let within = cx.slurm.cpus(id);
    let Some(stored) = cx.state.jobs.get_mut(id) else {
        return false;
    };
    let before = view_cores(stored, rightsize_enforce, within.as_ref());
    let rt = stored.job.rt.get_or_insert_with(RtStanding::default);
    rt.extra_cores += 1;
    if view_cores(stored, rightsize_enforce, within.as_ref()) <= before {
        if let Some(rt) = stored.job.rt.as_mut() {
            rt.extra_cores -= 1;
        }
        return false;
    }
    let plan = policy::decide(
        cx.topology,
        cx.reserved,
        &views(cx.state, rightsize_enforce, cx.slurm),
        &cx.state.plan,
    );
    let placed_before = cx.state.plan.training.len();
    // A job that asks for more keeps its CPUs where no more fit (`policy::decide`): grown
    // only if its placement did grow.
    let had = cx.state.plan.training.get(id).map_or(0, |p| p.cpus.len());
    let fits = plan.training.get(id).is_some_and(|p| p.cpus.len() > had)
        && plan.training.len() >= placed_before;
    if !fits {
        if let Some(rt) = cx.state.jobs.get_mut(id).and_then(|s| s.job.rt.as_mut()) {
            rt.extra_cores -= 1;
        }
    }
    fits
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{grow_cap, holds_for_rightsizing};
    use crate::cpuset::CpuSet;
    use crate::policy::rightsize::{Tuner, TunerSettings};
    use crate::store::Tuning;

    fn tuning(tuner: Tuner) -> Tuning {
        Tuning {
            tuner,
            last_sample_ms: 0,
            recorded: false,
        }
    }

    /// A whole-cpuset Slurm job (no count asked) may be grown within its cpuset, not by one
    /// core only; a job that asked for a count, by at most that count.
    #[test]
    fn the_guard_grows_a_whole_cpuset_job_within_its_cpuset() {
        let cpuset = CpuSet::parse("2-4,10-12").unwrap();
        assert_eq!(grow_cap(0, Some(&cpuset)), 6);
        assert_eq!(grow_cap(2, Some(&cpuset)), 2);
        assert_eq!(grow_cap(0, None), 1);
        assert_eq!(grow_cap(4, None), 4);
    }

    /// The guard waits for a search that can run, never for figures that cannot come.
    #[test]
    fn the_guard_waits_only_for_a_search_that_can_run() {
        let settings = |start| TunerSettings {
            start,
            floor: 1,
            max: 8,
            warmup: Duration::ZERO,
            window: Duration::from_secs(1),
            tolerance: 5,
            min_change: 0.0,
            from_history: false,
            gpus: 0,
        };
        let fresh = tuning(Tuner::new(settings(4), Duration::ZERO));
        // Right-sizing on, not settled: held where the node senses GPUs, not where it cannot.
        assert!(holds_for_rightsizing(Some(&fresh), Some(true), true));
        assert!(!holds_for_rightsizing(Some(&fresh), Some(true), false));
        // Advising, off, or no tuner: never held.
        assert!(!holds_for_rightsizing(Some(&fresh), Some(false), true));
        assert!(!holds_for_rightsizing(Some(&fresh), None, true));
        assert!(!holds_for_rightsizing(None, Some(true), true));
        // Settled: the guard acts.
        let mut settled = Tuner::new(settings(2), Duration::ZERO);
        settled.stop();
        assert!(!holds_for_rightsizing(
            Some(&tuning(settled)),
            Some(true),
            true
        ));
    }
}
