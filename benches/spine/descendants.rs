//! Part 3 of the spine benchmark: a pid job's descendants on a busy node (issue 21 item 2), a
//! pid job's first apply and an inference instance's move by affinity, each beside the way
//! before in the same run (see the module doc of `spine.rs`).

use std::time::{Duration, Instant};

use super::{held_jobs, percentile, thread_cpu_time};
use crate::common::{children, unique, wait_until, WAIT};
use crate::sleeper::Sleeper;
use lodger::cpuset::CpuSet;
use lodger::enforce::instances::{
    Identity, InstanceOutput, InstancePlacement, InstanceSettings, InstanceSpec, Instances,
};
use lodger::enforce::{EnforceSettings, Enforcer, JobRecord, PidPinning, TrainingClass};
use lodger::job::{JobId, Target};

/// A `sh -c` script in a process group of its own, killed with its group on drop.
struct Shell(std::process::Child);

impl Shell {
    /// Stops (`true`) or lets go (`false`) the shell's process group.
    fn pause(&self, stop: bool) {
        if let Ok(pgid) = libc::pid_t::try_from(self.0.id()) {
            let sig = if stop { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: plain killpg(2) on the group this Shell made.
            unsafe { libc::killpg(pgid, sig) };
        }
    }

    fn start(script: &str) -> Shell {
        use std::os::unix::process::CommandExt;
        let child = std::process::Command::new("sh")
            .args(["-c", script])
            .process_group(0)
            .spawn()
            .expect("spawn sh");
        Shell(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        if let Ok(pgid) = libc::pid_t::try_from(self.0.id()) {
            // SAFETY: plain killpg(2) on the group this Shell made.
            unsafe { libc::killpg(pgid, libc::SIGKILL) };
        }
        let _ = self.0.wait();
    }
}

fn processes_on_the_node() -> usize {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count()
        })
        .unwrap_or(0)
}

/// An enforcer that pins pid jobs by affinity, SCHED_RR without thread roles, reading the
/// kernel's process events, under a parent cgroup named from `prefix`.
fn affinity_enforcer(prefix: &str) -> Enforcer {
    Enforcer::new(EnforceSettings {
        parent: unique(prefix),
        pid_jobs: PidPinning::Affinity,
        class: TrainingClass::Rr { roles: false },
        process_events: true,
        ..EnforceSettings::default()
    })
    .expect("enforcer")
}

/// Processes created on the node since boot (`processes` in /proc/stat).
fn forks_since_boot() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("processes ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// What [`pid_job_sweep`] measured.
struct Sweep {
    /// CPU time of one apply: the median tick's, over the jobs.
    per_apply: Duration,
    /// Processes created on the node per second meanwhile (the jobs' own `sleep`s included).
    forks_per_s: f64,
    /// Times the enforcer swept every job again (events lost or cut short, the watch lost)
    /// after it was set up: such a run measures those sweeps too.
    start_overs: u64,
}

/// How a pid job sweep's table is kept.
#[derive(Clone, Copy, PartialEq)]
enum Table {
    /// Read from /proc again whenever a task was created on the node (before issue 21).
    ByLastPid,
    /// Kept by every process's events (before session 32).
    EveryEvent,
    /// Kept by the jobs' processes' events alone, filtered in the kernel.
    Watched,
}

/// CPU time of one apply of a pid job pinned by affinity that sweeps it, on a quiet node and
/// beside `forker` (a shell creating processes back to back outside every job), with the
/// process table kept as `table` says: 4 jobs, each a shell forking a `sleep` every 50 ms,
/// applied every 100 ms. The quiet and the busy ticks alternate in one run (the forker stopped
/// and let go for the 100 ms before each), so that a slower spell of this shared VM, which
/// lasts seconds, weighs on both alike rather than on whichever ran in it.
fn pid_job_sweep(table: Table, forker: &Shell) -> (Sweep, Sweep) {
    const JOBS: usize = 4;
    /// Of each kind.
    const TICKS: usize = 30;
    let enforcer = affinity_enforcer("lodger-bench");
    assert!(enforcer.event_driven(), "process events unavailable");
    assert!(
        enforcer.watches_jobs_in_the_kernel(),
        "the kernel did not take the eBPF watch filter"
    );
    if table != Table::Watched {
        enforcer.read_every_process_event();
    }
    enforcer.descendants_by_last_pid(table == Table::ByLastPid);
    // The table for every apply, the first included (which would otherwise walk the job's
    // tree and leave the table's first read to a measured tick): this part measures the table.
    enforcer.descendants_from_table(true);
    let cpus = CpuSet::parse("1").expect("cpus");
    let roots: Vec<Shell> = (0..JOBS)
        .map(|_| Shell::start("while :; do sleep 0.05; done"))
        .collect();
    let mut held = held_jobs(roots.iter().map(Shell::pid));
    let apply = |held: &mut Vec<(JobId, Target, JobRecord)>| {
        for (id, t, r) in held.iter_mut() {
            let o = enforcer
                .apply(id, t, &cpus, &CpuSet::new(), r)
                .expect("apply");
            assert!(o.alive, "{o:?}");
        }
    };
    forker.pause(true);
    apply(&mut held);
    let mut runs = [Run::default(), Run::default()];
    for i in 0..2 * TICKS {
        let busy = i % 2 == 1;
        forker.pause(!busy);
        let run = &mut runs[usize::from(busy)];
        let (forks0, t0, over0) = (
            forks_since_boot(),
            Instant::now(),
            enforcer.events_started_over(),
        );
        std::thread::sleep(Duration::from_millis(100));
        let c0 = thread_cpu_time();
        apply(&mut held);
        run.ticks.push(thread_cpu_time() - c0);
        run.forks += forks_since_boot().saturating_sub(forks0);
        run.elapsed += t0.elapsed();
        run.start_overs += enforcer.events_started_over() - over0;
    }
    forker.pause(false);
    for (id, t, r) in &held {
        enforcer.release(id, t, r).expect("release");
    }
    enforcer.tidy();
    let [quiet, busy] = runs.map(|r| r.sweep(JOBS));
    (quiet, busy)
}

/// The ticks of one kind in [`pid_job_sweep`].
#[derive(Default)]
struct Run {
    ticks: Vec<Duration>,
    forks: u64,
    elapsed: Duration,
    start_overs: u64,
}

impl Run {
    fn sweep(mut self, jobs: usize) -> Sweep {
        self.ticks.sort_unstable();
        Sweep {
            // The median tick: one a burst from another tenant slowed (steal time counts as
            // the thread's CPU time) would move a mean of 30 by itself.
            per_apply: percentile(&self.ticks, 0.5) / jobs as u32,
            forks_per_s: self.forks as f64 / self.elapsed.as_secs_f64().max(1e-9),
            start_overs: self.start_overs,
        }
    }
}

/// Mean CPU time of one move by affinity of an inference instance (a shell and its two
/// children) between the two CPUs: 40 moves. `from_proc`: the descendants found as before, from
/// every process's parent read from /proc on each pass (the baseline).
fn instance_move(from_proc: bool) -> Duration {
    const MOVES: u32 = 40;
    let mut inst = Instances::new(InstanceSettings {
        parent: unique("lodger-bench-inst"),
        placement: InstancePlacement::Affinity,
        output: InstanceOutput::Null,
        ..InstanceSettings::default()
    })
    .expect("instances");
    inst.descendants_from_proc(from_proc);
    let mut spec = InstanceSpec {
        job: JobId::from_seq(1),
        index: 0,
        argv: ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & wait"]
            .map(String::from)
            .to_vec(),
        cpus: CpuSet::parse("0").expect("cpus"),
        mems: CpuSet::new(),
        threads: 1,
        batch: 1,
        offline: false,
        identity: Identity {
            uid: nix::unistd::getuid().as_raw(),
            ..Identity::default()
        },
        memory_max: None,
    };
    inst.reconcile(std::slice::from_ref(&spec)).expect("start");
    // Setup, not measured: the shell runs and has forked both sleeps.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let pid = inst.stats().first().and_then(|s| s.pid);
        if pid.is_some_and(|p| children(p).len() == 2) {
            break;
        }
        assert!(Instant::now() < deadline, "the instance did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cost = Duration::ZERO;
    for i in 0..MOVES {
        spec.cpus = CpuSet::parse(if i % 2 == 0 { "1" } else { "0" }).expect("cpus");
        let c0 = thread_cpu_time();
        let out = inst.reconcile(std::slice::from_ref(&spec)).expect("move");
        cost += thread_cpu_time() - c0;
        assert_eq!(out.moved.len(), 1, "{out:?}");
    }
    cost / MOVES
}

/// Mean CPU time of a pid job's first apply (its registration's enforcement) by an enforcer
/// whose process table is not fresh (a new one: as after a quiet spell in which no sweep used
/// it), pinned by affinity: a shell and its two children, 20 times. `from_table`: the table read
/// from /proc in full first, as before (the baseline).
fn first_apply(from_table: bool) -> Duration {
    const SAMPLES: u32 = 20;
    let job = Shell::start("sleep 1000 & sleep 1000 & wait");
    wait_until(WAIT, "the shell's two children", || {
        children(job.pid()).len() == 2
    });
    let cpus = CpuSet::parse("1").expect("cpus");
    let mut cost = Duration::ZERO;
    for i in 0..SAMPLES {
        let enforcer = affinity_enforcer("lodger-bench-first");
        enforcer.descendants_from_table(from_table);
        let (id, target) = (
            JobId::from_seq(u64::from(i) + 1),
            Target::Pids(vec![job.pid()]),
        );
        let mut record = JobRecord::default();
        let c0 = thread_cpu_time();
        let out = enforcer
            .apply(&id, &target, &cpus, &CpuSet::new(), &mut record)
            .expect("apply");
        cost += thread_cpu_time() - c0;
        assert_eq!(out.pids.len(), 3, "{out:?}");
        enforcer.release(&id, &target, &record).expect("release");
        enforcer.tidy();
    }
    cost / SAMPLES
}

pub(super) fn descendants_on_a_busy_node() {
    let want = std::env::var("LODGER_BENCH_NODE_PROCS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500usize);
    let fill: Vec<Sleeper> = (processes_on_the_node()..want)
        .map(|_| Sleeper::start(1))
        .collect();
    let procs = processes_on_the_node();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let forker = Shell::start("while :; do /bin/true; done");
    let (_, baseline) = pid_job_sweep(Table::ByLastPid, &forker);
    let (quiet_every, busy_every) = pid_job_sweep(Table::EveryEvent, &forker);
    let (quiet, busy) = pid_job_sweep(Table::Watched, &forker);
    drop(forker);
    // What the busy node adds, per process created on it: the 4 jobs' applies of one 100-ms
    // tick cost (busy - quiet) × 4 more, while (busy - quiet forks/s) / 10 more were created.
    let ns_per_fork = |quiet: &Sweep, busy: &Sweep| {
        let added_per_tick =
            busy.per_apply.as_secs_f64() * 4.0 - quiet.per_apply.as_secs_f64() * 4.0;
        let added_forks_per_tick = (busy.forks_per_s - quiet.forks_per_s).max(1.0) / 10.0;
        added_per_tick / added_forks_per_tick * 1e9
    };
    let ratio = |busy: &Sweep, quiet: &Sweep| {
        busy.per_apply.as_secs_f64() / quiet.per_apply.as_secs_f64().max(1e-9)
    };
    let (every_ns, watched_ns) = (
        ns_per_fork(&quiet_every, &busy_every),
        ns_per_fork(&quiet, &busy),
    );
    let (every_ratio, watched_ratio) = (ratio(&busy_every, &quiet_every), ratio(&busy, &quiet));
    println!(
        "a pid job's sweep (affinity, 4 jobs forking a sleep every 50 ms, 100-ms ticks), {procs} processes on the node ({} sleeping ones added):",
        fill.len()
    );
    println!(
        "  quiet node: {:.1} us per apply; beside a shell forking /bin/true: {:.1} us with /proc read again on every new task (baseline), {:.1} us with the table from the jobs' process events ({:.1}x less; busy / quiet {:.2}, target <= 1.2: {})",
        us(quiet.per_apply),
        us(baseline.per_apply),
        us(busy.per_apply),
        baseline.per_apply.as_secs_f64() / busy.per_apply.as_secs_f64().max(1e-9),
        watched_ratio,
        if watched_ratio <= 1.2 { "met" } else { "MISSED" }
    );
    println!(
        "  every job swept again while measured (process events lost or cut short, the watch lost): quiet {} times, busy {} times{}",
        quiet.start_overs,
        busy.start_overs,
        if quiet.start_overs + busy.start_overs > 0 {
            " (those sweeps are in the figures above)"
        } else {
            ""
        }
    );
    println!(
        "  every process's events read (before the kernel filter, same run): quiet {:.1} us, busy {:.1} us per apply (busy / quiet {:.2})",
        us(quiet_every.per_apply),
        us(busy_every.per_apply),
        every_ratio
    );
    println!(
        "  the busy node created {:.0} processes/s against {:.0} on the quiet one: lodgerd's CPU per process created outside every job {:.0} ns with the jobs' events alone, {:.0} ns with every process's ({:.3}% and {:.3}% of one CPU at 1,000 processes/s, all jobs together)",
        busy.forks_per_s,
        quiet.forks_per_s,
        watched_ns,
        every_ns,
        watched_ns * 1000.0 / 1e9 * 100.0,
        every_ns * 1000.0 / 1e9 * 100.0
    );
    let (table, walked) = (first_apply(true), first_apply(false));
    println!(
        "a pid job's first apply (a registration; a shell and 2 children, pinned by affinity, the process table not fresh), {procs} processes on the node: {:.1} us with the table read from /proc in full first (baseline), {:.1} us walking the job's tree ({:.1}x less)",
        us(table),
        us(walked),
        table.as_secs_f64() / walked.as_secs_f64().max(1e-9)
    );
    let (from_proc, walked) = (instance_move(true), instance_move(false));
    println!(
        "an inference instance's move by affinity (a shell and 2 children), {procs} processes on the node: {:.1} us with every process's parent read from /proc on each pass (baseline), {:.1} us walking its threads' children ({:.1}x less)",
        us(from_proc),
        us(walked),
        from_proc.as_secs_f64() / walked.as_secs_f64().max(1e-9)
    );
}
