//! Contention control through the agent (SODA §V-E): throttles from training progress and from
//! memory bandwidth (MBA on a recorded resctrl tree), and a config reload that reconfigures or
//! switches it off. Uses the fake node of `tests`.

use super::tests::{spec, Rig};
use super::{Agent, Event, MbaTarget};
use crate::cpuset::CpuSet;
use crate::enforce::JobRecord;
use crate::job::{JobId, JobKind, Target};
use crate::policy::contention::ContentionConfig;
use crate::sense::Observations;
use crate::store::{Lodging, StoredJob};

/// One sensing pass in which training job `train` has `gpu` percent GPU utilization.
fn gpu_pass(agent: &mut Agent, train: &JobId, ms: u64, gpu: f64) {
    let mut obs = Observations {
        unix_ms: ms,
        ..Observations::default()
    };
    obs.jobs.insert(
        train.clone(),
        crate::sense::JobMetrics {
            gpu_percent: Some(gpu),
            ..Default::default()
        },
    );
    agent.observations = std::sync::Arc::new(obs);
    agent.tick();
}

/// An offline lodger shaped like `like`, changed by `shape`, inserted directly (no instance
/// runner here).
fn insert_lodger(
    agent: &mut Agent,
    like: &JobId,
    shape: impl FnOnce(&mut crate::job::Job),
) -> JobId {
    let lodger = JobId::from_seq(99);
    let mut job = agent.state.jobs[like].job.clone();
    job.id = lodger.clone();
    job.spec.kind = JobKind::Offline;
    job.spec.target = Target::Instances;
    shape(&mut job);
    agent.state.jobs.insert(
        lodger.clone(),
        StoredJob {
            job,
            record: JobRecord::default(),
            lodging: Lodging::default(),
            tuning: None,
        },
    );
    lodger
}

/// SODA §V-E without MBM: a training job's GPU utilization falls below its learnt level while
/// an offline lodger runs; the lodger's cores are halved, the step is signalled with its
/// evidence, and right-sizing would hold meanwhile.
#[test]
fn contention_halves_an_offline_lodger_when_training_progress_drops() {
    let rig = Rig::new();
    rig.spawn(100);
    let mut agent = rig.agent();
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    let mut events = agent.events.subscribe();
    let pass = |agent: &mut Agent, ms: u64, gpu: f64| gpu_pass(agent, &train.id, ms, gpu);
    // The stable level is learnt while no lodger runs.
    for (i, gpu) in [90.0, 91.0, 89.5, 90.5].into_iter().enumerate() {
        pass(&mut agent, 1000 + i as u64, gpu);
    }
    // An offline lodger on 4 CPUs arrives (inserted directly: no instance runner here).
    let lodger = insert_lodger(&mut agent, &train.id, |job| {
        job.cpus = CpuSet::parse("2-5").unwrap();
    });
    // Issue 16: low passes while the GPU source is stale are not evidence: nothing is
    // throttled, and they do not count towards pressure_ticks below.
    for i in 0..5u64 {
        let mut obs = Observations {
            unix_ms: 1500 + i,
            ..Observations::default()
        };
        obs.jobs.insert(
            train.id.clone(),
            crate::sense::JobMetrics {
                gpu_percent: Some(45.0),
                ..Default::default()
            },
        );
        obs.ages.insert(
            "gpu".into(),
            crate::sense::SourceAge {
                age_s: 30.0,
                stale: true,
            },
        );
        agent.observations = std::sync::Arc::new(obs);
        agent.tick();
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert!(
        throttles.cores.is_empty(),
        "held while stale: {throttles:?}"
    );
    // pressure_ticks = 2: halved after two low passes, and again after two more.
    for i in 0..2u64 {
        pass(&mut agent, 2000 + i, 45.0);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert_eq!(throttles.cores.get(&lodger), Some(&2), "{throttles:?}");
    for i in 2..4u64 {
        pass(&mut agent, 2000 + i, 45.0);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert_eq!(throttles.cores.get(&lodger), Some(&1), "{throttles:?}");
    assert!(
        !throttles.cores.contains_key(&train.id),
        "training is never throttled"
    );
    let text = agent.state.jobs[&lodger].job.throttle.clone().unwrap();
    assert!(text.contains("cores"), "{text}");
    let mut levels = Vec::new();
    while let Ok(e) = events.try_recv() {
        if let Event::Throttled {
            id,
            mechanism,
            level,
        } = e
        {
            assert_eq!(id, lodger);
            assert_eq!(mechanism, "cores");
            levels.push(level);
        }
    }
    assert_eq!(levels, ["1", "2"], "a Throttled event per step");
    assert!(agent
        .status()
        .contention
        .contains("1 job(s) on fewer cores"));
    assert_eq!(agent.status().throttle_actions, 2);
    // Training recovers: after calm passes the steps are given back one at a time.
    for i in 0..40u64 {
        pass(&mut agent, 3000 + i, 90.0);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert!(throttles.cores.is_empty(), "{throttles:?}");
}

/// SODA §V-E with MBA, through the agent, on a copy of the recorded Intel resctrl tree:
/// node bandwidth over the threshold lowers lodger's group's MB schemata step by step with
/// the offline lodger's threads in it, and calm gives the bandwidth back.
#[test]
fn contention_throttles_offline_lodgers_with_mba_on_an_intel_tree() {
    use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
    let schemata = resctrl.path().join("lodger-lodgers/schemata");
    let tasks = resctrl.path().join("lodger-lodgers/tasks");
    // The recorded group was left throttled by an earlier run; start from unthrottled.
    std::fs::write(&schemata, "MB:0=100;1=100\n").unwrap();
    std::fs::write(&tasks, "").unwrap();
    let caps = MbaCaps::read(resctrl.path(), &CpuVendor::Intel).unwrap();

    let rig = Rig::new();
    rig.spawn(100);
    // The offline lodger's process, with two threads.
    for tid in [300, 301] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("300/task/{tid}"))).unwrap();
    }
    let mut agent = mba_agent(&rig, resctrl.path(), &caps);
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    let lodger = insert_lodger(&mut agent, &train.id, |job| job.pids = vec![300]);
    let mut events = agent.events.subscribe();
    let pass = pressure_pass;
    let mb = || std::fs::read_to_string(&schemata).unwrap();
    pass(&mut agent, 1000, 0.5);
    assert_eq!(mb(), "MB:0=100;1=100\n", "no pressure, no throttle");
    // Two pressured passes (pressure_ticks = 2): one step down, the lodger's threads moved.
    pass(&mut agent, 1001, 0.95);
    pass(&mut agent, 1002, 0.95);
    let first = mb();
    assert_ne!(first, "MB:0=100;1=100\n");
    let moved = std::fs::read_to_string(&tasks).unwrap();
    // In the order the directory lists them, which depends on the filesystem.
    let mut tids = moved.split_whitespace().collect::<Vec<_>>();
    tids.sort_unstable();
    assert_eq!(tids, ["300", "301"], "{moved}");
    // Still pressured: a further step, values multiples of the granularity (10 here).
    pass(&mut agent, 1003, 0.95);
    pass(&mut agent, 1004, 0.95);
    let second = mb();
    let values = |s: &str| -> Vec<u32> {
        s.trim()
            .trim_start_matches("MB:")
            .split(';')
            .map(|d| d.split('=').nth(1).unwrap().parse().unwrap())
            .collect()
    };
    assert!(values(&second) < values(&first), "{first} -> {second}");
    assert!(
        values(&second).iter().all(|v| v % 10 == 0 && *v >= 10),
        "{second}"
    );
    assert!(agent.state.jobs[&lodger]
        .job
        .throttle
        .as_deref()
        .is_some_and(|t| t.contains(" MB:")));
    assert!(
        agent.state.jobs[&train.id].job.throttle.is_none(),
        "training never"
    );
    let mut mechanisms = Vec::new();
    while let Ok(e) = events.try_recv() {
        if let Event::Throttled { id, mechanism, .. } = e {
            assert_eq!(id, lodger);
            mechanisms.push(mechanism);
        }
    }
    // One per L3 domain per step: two domains, two steps.
    assert_eq!(mechanisms, ["mba"; 4]);
    // A restart (issue 17): the stopping agent leaves lodger's group as it is, and the next one
    // holds the throttle from the state file, at its first tick before any new sensing pass.
    agent.shutdown();
    drop(agent);
    assert_eq!(mb(), second, "a stop gave the bandwidth back");
    let mut agent = mba_agent(&rig, resctrl.path(), &caps);
    assert!(agent.state.contention.holds_mba());
    agent.tick();
    assert_eq!(mb(), second, "the restarted agent gave the bandwidth back");
    // Still pressured: it goes on from the step it holds, not from the top of the ladder.
    pass(&mut agent, 1005, 0.95);
    pass(&mut agent, 1006, 0.95);
    assert!(values(&mb()) < values(&second), "{second} -> {}", mb());
    // Calm for long enough: every step given back, the schemata unthrottled.
    for i in 0..60u64 {
        pass(&mut agent, 2000 + i, 0.3);
    }
    assert_eq!(mb(), "MB:0=100;1=100\n");
    assert!(agent.state.jobs[&lodger].job.throttle.is_none());
}

/// A config reload (issue 16): thresholds and the mode change in place, keeping the throttles
/// decided (advise lifts what is applied); switched off, every throttle is given back at once
/// and the jobs no longer show one; switched on again, control starts with none; the per-owner
/// caps and the RT headroom follow the reload.
#[test]
fn a_reload_reconfigures_contention_or_switches_it_off_giving_throttles_back() {
    let rig = Rig::new();
    rig.spawn(100);
    let mut agent = rig.agent();
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    for (i, gpu) in [90.0, 91.0, 89.5, 90.5].into_iter().enumerate() {
        gpu_pass(&mut agent, &train.id, 1000 + i as u64, gpu);
    }
    let lodger = insert_lodger(&mut agent, &train.id, |job| {
        job.cpus = CpuSet::parse("2-5").unwrap();
    });
    for i in 0..2u64 {
        gpu_pass(&mut agent, &train.id, 2000 + i, 45.0);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert_eq!(throttles.cores.get(&lodger), Some(&2), "{throttles:?}");

    // Advise, a higher threshold: the decision is kept, nothing is applied.
    let mut live = agent.settings.live();
    live.contention = Some(ContentionConfig {
        mode: crate::policy::contention::Mode::Advise,
        pressure_ticks: 5,
        ..live.contention.clone().unwrap()
    });
    agent.reload(live.clone());
    let c = agent.contention.as_ref().unwrap();
    assert!(c.throttles().cores.is_empty(), "advise applies nothing");
    assert!(c.throttling(), "the decision is kept");
    assert!(
        agent.status().contention.starts_with("advise: "),
        "{}",
        agent.status().contention
    );

    // Off: everything given back, the job's throttle line gone.
    live.contention = None;
    agent.reload(live.clone());
    assert!(agent.contention.is_none());
    assert_eq!(agent.status().contention, "off");
    assert!(agent.state.jobs[&lodger].job.throttle.is_none());
    gpu_pass(&mut agent, &train.id, 3000, 45.0);
    assert!(agent.contention.is_none(), "off stays off");

    // On again, with the caps and headroom of the same reload: starts with no throttle.
    live.contention = Some(ContentionConfig::default());
    live.trust.max_jobs_per_owner = 7;
    live.rt_headroom_percent = Some(12);
    agent.reload(live);
    assert_eq!(agent.status().contention, "enforce: no throttle");
    assert_eq!(agent.settings.trust.max_jobs_per_owner, 7);
    assert_eq!(agent.settings.rt_headroom_percent, Some(12));
    assert!(agent.rt_guard.is_some());
    assert_eq!(agent.jobs().len(), 2, "no job dropped");
}

/// Issue 18: a batch job is a first throttle target: training's drop halves its cores, and its
/// placement (the enforcer's CPUs) follows the cut; calm gives them back.
#[test]
fn contention_halves_a_batch_job_and_its_placement_follows() {
    let rig = Rig::new();
    rig.spawn(100);
    rig.spawn(200);
    let mut agent = rig.agent();
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    for (i, gpu) in [90.0, 91.0, 89.5, 90.5].into_iter().enumerate() {
        gpu_pass(&mut agent, &train.id, 1000 + i as u64, gpu);
    }
    let batch = agent
        .register(
            crate::job::JobSpec {
                kind: JobKind::Batch,
                ..spec(vec![200], 0)
            },
            1000,
        )
        .unwrap();
    let full = agent.jobs()[&batch.id].cpus.len();
    assert_eq!(full, 12, "16 CPUs less reserved 2 and training's 2");
    for i in 0..2u64 {
        gpu_pass(&mut agent, &train.id, 2000 + i, 45.0);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert_eq!(throttles.cores.get(&batch.id), Some(&6), "{throttles:?}");
    // The next tick places it on the cut (the throttle is decided after placement).
    gpu_pass(&mut agent, &train.id, 2002, 45.0);
    let on = rig.node.lock().unwrap().applied[&batch.id].clone();
    assert_eq!(on.len(), 6, "{on}");
    assert!(on.is_disjoint(&agent.jobs()[&train.id].cpus));
    let text = agent.state.jobs[&batch.id].job.throttle.clone().unwrap();
    assert!(text.contains("cores"), "{text}");
    // Calm: the cut is given back.
    for i in 0..40u64 {
        gpu_pass(&mut agent, &train.id, 3000 + i, 90.0);
    }
    assert!(agent
        .contention
        .as_ref()
        .unwrap()
        .throttles()
        .cores
        .is_empty());
    assert_eq!(rig.node.lock().unwrap().applied[&batch.id].len(), full);
}

/// Issue 18: with MBA, a registered batch job's processes are moved into lodger's lodgers group
/// and throttled there (SODA §V-E: MBA first).
#[test]
fn contention_throttles_a_batch_job_with_mba() {
    use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
    let schemata = resctrl.path().join("lodger-lodgers/schemata");
    let tasks = resctrl.path().join("lodger-lodgers/tasks");
    std::fs::write(&schemata, "MB:0=100;1=100\n").unwrap();
    std::fs::write(&tasks, "").unwrap();
    let caps = MbaCaps::read(resctrl.path(), &CpuVendor::Intel).unwrap();
    let rig = Rig::new();
    rig.spawn(100);
    rig.spawn(400);
    for tid in [400, 401] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("400/task/{tid}"))).unwrap();
    }
    let mut agent = rig
        .builder()
        .mba(MbaTarget::new(resctrl.path().to_path_buf(), caps))
        .start()
        .unwrap();
    agent.register(spec(vec![100], 2), 0).unwrap();
    let batch = agent
        .register(
            crate::job::JobSpec {
                kind: JobKind::Batch,
                ..spec(vec![400], 0)
            },
            1000,
        )
        .unwrap();
    let pass = pressure_pass;
    let mb = || std::fs::read_to_string(&schemata).unwrap();
    for (i, fraction) in [0.5, 0.95, 0.95].into_iter().enumerate() {
        pass(&mut agent, 1000 + i as u64, fraction);
    }
    assert_ne!(mb(), "MB:0=100;1=100\n");
    let moved = std::fs::read_to_string(&tasks).unwrap();
    // In the order the fake task directory lists them, which its filesystem decides (the VM
    // suite listed 401 first).
    let mut tids = moved.split_whitespace().collect::<Vec<_>>();
    tids.sort_unstable();
    assert_eq!(tids, ["400", "401"], "{moved}");
    assert!(agent.state.jobs[&batch.id]
        .job
        .throttle
        .as_deref()
        .is_some_and(|t| t.contains(" MB:")));

    // Finding 6: an offline lodger keeps the group throttled; the batch job is unregistered
    // while its processes run on: its threads are given back to the default group (the
    // fixture's tasks files only grow: the release is the write to the root's).
    for tid in [300, 301] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("300/task/{tid}"))).unwrap();
    }
    let train = agent.jobs().keys().next().unwrap().clone();
    insert_lodger(&mut agent, &train, |job| job.pids = vec![300]);
    pass(&mut agent, 1003, 0.95);
    let root_tasks = resctrl.path().join("tasks");
    assert!(!std::fs::read_to_string(&root_tasks)
        .unwrap()
        .ends_with("400\n401\n"));
    agent.unregister(batch.id.as_str()).unwrap();
    pass(&mut agent, 1004, 0.95);
    assert_ne!(
        mb(),
        "MB:0=100;1=100\n",
        "still throttled for the offline job"
    );
    let root = std::fs::read_to_string(&root_tasks).unwrap();
    assert!(root.ends_with("400\n401\n"), "{root}");
}

/// Finding 6 (B): after a restart, a pid from the state file is not trusted before enforcement
/// has looked at it: the batch job's process exited meanwhile and its pid now names another
/// process, which must not be moved into the throttled group.
#[test]
fn a_restart_moves_no_reused_pid_into_the_mba_group() {
    use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
    let schemata = resctrl.path().join("lodger-lodgers/schemata");
    let tasks = resctrl.path().join("lodger-lodgers/tasks");
    std::fs::write(&schemata, "MB:0=100;1=100\n").unwrap();
    std::fs::write(&tasks, "").unwrap();
    let caps = MbaCaps::read(resctrl.path(), &CpuVendor::Intel).unwrap();
    let rig = Rig::new();
    rig.spawn(100);
    rig.spawn(400);
    for tid in [400, 401] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("400/task/{tid}"))).unwrap();
    }
    let mut agent = rig
        .builder()
        .mba(MbaTarget::new(resctrl.path().to_path_buf(), caps.clone()))
        .start()
        .unwrap();
    agent.register(spec(vec![100], 2), 0).unwrap();
    agent
        .register(
            crate::job::JobSpec {
                kind: JobKind::Batch,
                ..spec(vec![400], 0)
            },
            1000,
        )
        .unwrap();
    for (i, fraction) in [0.5, 0.95, 0.95].into_iter().enumerate() {
        pressure_pass(&mut agent, 1000 + i as u64, fraction);
    }
    assert!(agent.state.contention.holds_mba());
    agent.shutdown();
    drop(agent);
    // The job's process exits (the kernel empties the group's tasks); pid 400 is reused by
    // a process that is not the job's (the enforcer's start-time check says so).
    rig.kill(400);
    std::fs::write(&tasks, "").unwrap();
    for tid in [400, 401] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("400/task/{tid}"))).unwrap();
    }
    let mut agent = rig
        .builder()
        .mba(MbaTarget::new(resctrl.path().to_path_buf(), caps))
        .start()
        .unwrap();
    agent.tick();
    assert_eq!(std::fs::read_to_string(&tasks).unwrap(), "");
}

/// One sensing pass with the node's memory bandwidth at `fraction` of its peak.
fn pressure_pass(agent: &mut Agent, ms: u64, fraction: f64) {
    pressure_pass_with(agent, ms, fraction, &[]);
}

/// [`pressure_pass`] with `jobs`' own metrics.
fn pressure_pass_with(
    agent: &mut Agent,
    ms: u64,
    fraction: f64,
    jobs: &[(JobId, crate::sense::JobMetrics)],
) {
    let mut obs = Observations {
        unix_ms: ms,
        ..Observations::default()
    };
    obs.node.membw_bytes_per_s = Some(fraction * 100e9);
    obs.node.membw_fraction_of_peak = Some(fraction);
    obs.jobs.extend(jobs.iter().cloned());
    agent.observations = std::sync::Arc::new(obs);
    agent.tick();
}

/// An agent on `rig` that throttles through the resctrl tree at `resctrl`.
fn mba_agent(rig: &Rig, resctrl: &std::path::Path, caps: &crate::sys::resctrlfs::MbaCaps) -> Agent {
    rig.builder()
        .mba(MbaTarget::new(resctrl.to_path_buf(), caps.clone()))
        .start()
        .unwrap()
}

/// Finding 5: a restart in advise mode gives back the MBA throttle an earlier lodgerd held:
/// the restarted agent holds lodger's group, so it can restore and remove it.
#[test]
fn a_restart_in_advise_mode_gives_a_held_mba_throttle_back() {
    use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
    let schemata = resctrl.path().join("lodger-lodgers/schemata");
    let tasks = resctrl.path().join("lodger-lodgers/tasks");
    std::fs::write(&schemata, "MB:0=100;1=100\n").unwrap();
    std::fs::write(&tasks, "").unwrap();
    let caps = MbaCaps::read(resctrl.path(), &CpuVendor::Intel).unwrap();
    let rig = Rig::new();
    rig.spawn(100);
    for tid in [300, 301] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("300/task/{tid}"))).unwrap();
    }
    let mut agent = rig
        .builder()
        .mba(MbaTarget::new(resctrl.path().to_path_buf(), caps.clone()))
        .start()
        .unwrap();
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    insert_lodger(&mut agent, &train.id, |job| job.pids = vec![300]);
    for (i, fraction) in [0.5, 0.95, 0.95].into_iter().enumerate() {
        pressure_pass(&mut agent, 1000 + i as u64, fraction);
    }
    let mb = || std::fs::read_to_string(&schemata).unwrap();
    assert_ne!(mb(), "MB:0=100;1=100\n");
    agent.shutdown();
    drop(agent);
    assert_ne!(mb(), "MB:0=100;1=100\n", "a stop leaves the throttle");

    let mut builder = rig
        .builder()
        .mba(MbaTarget::new(resctrl.path().to_path_buf(), caps));
    let config = builder.settings.contention.clone().unwrap();
    builder.settings.contention = Some(ContentionConfig {
        mode: crate::policy::contention::Mode::Advise,
        ..config
    });
    let mut agent = builder.start().unwrap();
    agent.tick();
    assert_eq!(mb(), "MB:0=100;1=100\n", "advise applies nothing");
    let root = std::fs::read_to_string(resctrl.path().join("tasks")).unwrap();
    assert!(root.ends_with("300\n301\n"), "threads given back: {root}");
}

/// An online inference job (SLO met, pid 300 with two threads) inserted beside the training
/// job, on the Intel fixture at `resctrl`.
fn online_beside_training(
    rig: &Rig,
    resctrl: &std::path::Path,
    cpus: &str,
) -> (Agent, JobId, JobId) {
    use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
    let caps = MbaCaps::read(resctrl, &CpuVendor::Intel).unwrap();
    rig.spawn(100);
    for tid in [300, 301] {
        std::fs::create_dir_all(rig.proc_root.path().join(format!("300/task/{tid}"))).unwrap();
    }
    let mut agent = rig
        .builder()
        .mba(MbaTarget::new(resctrl.to_path_buf(), caps))
        .start()
        .unwrap();
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    let online = insert_lodger(&mut agent, &train.id, |job| {
        job.spec.kind = JobKind::Online;
        job.spec.inference = Some(crate::job::InferenceSpec {
            command: vec!["serve".into()],
            slo_ms: Some(100.0),
            rate_per_s: None,
            max_batch: 1,
            max_instances: None,
            launch: Default::default(),
            memory_max: None,
        });
        job.latency_ms = Some(crate::job::JobLatency {
            p50: 10.0,
            p99: 20.0,
        });
        job.pids = vec![300];
        job.cpus = CpuSet::parse(cpus).unwrap();
    });
    (agent, train.id, online)
}

/// Finding 3: an MBA step for online inference (the only lodger here) is applied: lodger's
/// `lodger-online` group gets the values and the job's threads.
#[test]
fn contention_throttles_online_inference_in_its_own_mba_group() {
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
    let group = resctrl.path().join("lodger-online");
    // What mkdir makes the kernel write (a fixture directory stays as it is made).
    std::fs::create_dir_all(&group).unwrap();
    std::fs::write(group.join("schemata"), "MB:0=100;1=100\n").unwrap();
    std::fs::write(group.join("tasks"), "").unwrap();
    let rig = Rig::new();
    let (mut agent, train, online) = online_beside_training(&rig, resctrl.path(), "2-5");
    for (i, fraction) in [0.5, 0.95, 0.95].into_iter().enumerate() {
        pressure_pass(&mut agent, 1000 + i as u64, fraction);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert!(throttles.cores.is_empty(), "{throttles:?}");
    assert_ne!(
        std::fs::read_to_string(group.join("schemata")).unwrap(),
        "MB:0=100;1=100\n"
    );
    let tasks = std::fs::read_to_string(group.join("tasks")).unwrap();
    let mut tids = tasks.split_whitespace().collect::<Vec<_>>();
    tids.sort_unstable();
    assert_eq!(tids, ["300", "301"], "{tasks}");
    assert!(agent.state.jobs[&online]
        .job
        .throttle
        .as_deref()
        .is_some_and(|t| t.contains("lodger-online")));
    assert!(agent.state.jobs[&train].job.throttle.is_none());
    // The batch/offline group was never made for it.
    assert_eq!(
        std::fs::read_to_string(resctrl.path().join("lodger-lodgers/tasks")).unwrap(),
        std::fs::read_to_string(
            crate::testutil::resctrl_fixture("intel-mba-mbm").join("lodger-lodgers/tasks")
        )
        .unwrap()
    );
}

/// Finding 3: where the online group cannot be made, the eliminator is told: no MBA step is
/// believed in force, and the next pressure halves the online job's cores instead.
#[test]
fn an_mba_group_that_cannot_be_made_is_throttled_by_halving() {
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("intel-mba-mbm"));
    // Something in the way: mkdir fails.
    std::fs::write(resctrl.path().join("lodger-online"), "").unwrap();
    let rig = Rig::new();
    let (mut agent, _train, online) = online_beside_training(&rig, resctrl.path(), "2-5");
    for (i, fraction) in [0.5, 0.95, 0.95].into_iter().enumerate() {
        pressure_pass(&mut agent, 1000 + i as u64, fraction);
    }
    let c = agent.contention.as_ref().unwrap();
    assert!(c.throttles().mba.is_empty(), "{:?}", c.throttles());
    assert!(!agent.state.contention.holds_mba());
    for i in 3..5u64 {
        pressure_pass(&mut agent, 1000 + i, 0.95);
    }
    let throttles = agent.contention.as_ref().unwrap().throttles();
    assert!(throttles.mba.is_empty(), "{throttles:?}");
    assert_eq!(throttles.cores.get(&online), Some(&2), "{throttles:?}");
    let text = agent.state.jobs[&online].job.throttle.clone().unwrap();
    assert!(
        text.contains("MBA cannot be applied to lodger-online"),
        "{text}"
    );
}

/// On AMD, MB values are absolute (1/8 GB/s per L3 domain) and the default group's 2048 is no
/// limit: the first step counts down from what the lodgers used in their busiest domain (their
/// jobs' MBM per domain, as sensing gives it), so it bites at once; a restart keeps the base.
#[test]
fn contention_on_an_amd_tree_counts_down_from_what_the_lodgers_used() {
    use crate::sys::resctrlfs::{CpuVendor, MbaCaps};
    const GIB: f64 = (1u64 << 30) as f64;
    let resctrl = crate::testutil::copy_of(&crate::testutil::resctrl_fixture("amd"));
    let schemata = resctrl.path().join("lodger-lodgers/schemata");
    std::fs::write(&schemata, "MB:0=2048;1=2048;2=2048;3=2048\n").unwrap();
    std::fs::write(resctrl.path().join("lodger-lodgers/tasks"), "").unwrap();
    let caps = MbaCaps::read(resctrl.path(), &CpuVendor::Amd).unwrap();

    let rig = Rig::new();
    rig.spawn(100);
    std::fs::create_dir_all(rig.proc_root.path().join("300/task/300")).unwrap();
    let mut agent = mba_agent(&rig, resctrl.path(), &caps);
    let train = agent.register(spec(vec![100], 2), 0).unwrap();
    let lodger = insert_lodger(&mut agent, &train.id, |job| job.pids = vec![300]);
    // The lodger's own bandwidth, as sensing gives it: 20 GiB/s in L3 domain 0, 4 in 1.
    let used = [(
        lodger.clone(),
        crate::sense::JobMetrics {
            membw_bytes_per_s: Some(24.0 * GIB),
            membw_domains: [(0, 20.0 * GIB), (1, 4.0 * GIB)].into_iter().collect(),
            ..Default::default()
        },
    )];
    let pass = |agent: &mut Agent, ms: u64, fraction: f64| {
        pressure_pass_with(agent, ms, fraction, &used);
    };
    let mb = || std::fs::read_to_string(&schemata).unwrap();
    pass(&mut agent, 1000, 0.95);
    pass(&mut agent, 1001, 0.95);
    // 20 GiB/s is 160 eighths; one step of 10 %: 144 in every domain. Counted from 2048 it
    // would have been 1844 (230 GB/s), more than any CCX uses.
    assert_eq!(mb().trim(), "MB:0=144;1=144;2=144;3=144");
    assert!(agent.state.jobs[&lodger]
        .job
        .throttle
        .as_deref()
        .is_some_and(|t| t.contains("MB:3=144")
            && t.contains("from 20.0 GB/s (it used 20.0 GB/s in its busiest L3 domain)")));
    // A restart holds the step where it was, counted from the same base.
    agent.shutdown();
    drop(agent);
    let mut agent = mba_agent(&rig, resctrl.path(), &caps);
    agent.tick();
    assert_eq!(mb().trim(), "MB:0=144;1=144;2=144;3=144");
    pass(&mut agent, 1002, 0.95);
    pass(&mut agent, 1003, 0.95);
    assert_eq!(mb().trim(), "MB:0=128;1=128;2=128;3=128", "80 % of 160");
    for i in 0..60u64 {
        pass(&mut agent, 2000 + i, 0.3);
    }
    assert_eq!(mb().trim(), "MB:0=2048;1=2048;2=2048;3=2048");
}
