//! A source that blocks forever: the others keep their cadence, the stuck one is stale with a
//! growing age and its figures are left out.

use std::sync::mpsc;
use std::time::Duration;

use super::*;

/// Bounds a failure only (a coordinator that stopped would never send); no assertion is about
/// time.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// Counts its passes into the node's CPU figure.
struct Counting(f64);

impl Source for Counting {
    fn set_jobs(&mut self, _jobs: Vec<SensedJob>) {}
    fn sample(&mut self) -> Observations {
        self.0 += 1.0;
        let mut obs = Observations::default();
        obs.node.cpu_percent = Some(self.0);
        obs.sources.cpu = "fake".into();
        obs
    }
}

/// Answers once, then blocks in its next pass until the test lets go (a hung NVML call).
struct Hangs {
    passes: u32,
    release: mpsc::Receiver<()>,
}

impl Source for Hangs {
    fn set_jobs(&mut self, _jobs: Vec<SensedJob>) {}
    fn sample(&mut self) -> Observations {
        self.passes += 1;
        if self.passes > 1 {
            let _ = self.release.recv();
        }
        let mut obs = Observations::default();
        obs.node.gpus = vec![crate::sense::GpuMetrics::default()];
        obs.sources.gpu = "fake nvml".into();
        obs
    }
}

#[test]
fn a_source_that_blocks_goes_stale_with_its_age_and_the_others_keep_their_cadence() {
    let (release_tx, release_rx) = mpsc::channel();
    let sources: Vec<(SourceKind, OpenSource)> = vec![
        (
            SourceKind::Cpu,
            Box::new(|| Box::new(Counting(0.0)) as Box<dyn Source>),
        ),
        (
            SourceKind::Gpu,
            Box::new(move || {
                Box::new(Hangs {
                    passes: 0,
                    release: release_rx,
                }) as Box<dyn Source>
            }),
        ),
    ];
    let interval = Duration::from_millis(20);
    let deadline = Duration::from_millis(300);
    let (link, join) = spawn_sources(sources, Pace::new(interval, deadline)).expect("spawn");
    let next = || link.observations.recv_timeout(HANG_GUARD).expect("a pass");

    // Until the GPU source is past its deadline, its one pass is shown.
    let mut obs = next();
    while !obs.is_stale("gpu") {
        obs = next();
    }
    let mut seen = Vec::new();
    for _ in 0..10 {
        seen.push(obs);
        obs = next();
    }
    for o in &seen {
        assert!(o.is_stale("gpu"), "{:?}", o.ages);
        assert!(!o.is_stale("cpu"), "{:?}", o.ages);
        assert!(
            o.node.gpus.is_empty(),
            "a stale source's figures are left out"
        );
        assert!(
            o.sources
                .gpu
                .starts_with("stale: no new sample within 0.3 s")
                && o.sources.gpu.ends_with("(last: fake nvml)"),
            "{}",
            o.sources.gpu
        );
        assert_eq!(o.sources.cpu, "fake");
        assert!(o.ages["gpu"].age_s > o.ages["cpu"].age_s);
    }
    // The stuck one ages; the other goes on sampling.
    let first = &seen[0];
    let last = &seen[seen.len() - 1];
    assert!(last.ages["gpu"].age_s > first.ages["gpu"].age_s);
    let count = |o: &Observations| o.node.cpu_percent.expect("cpu figure");
    assert!(
        count(last) > count(first),
        "the CPU source kept sampling: {} then {}",
        count(first),
        count(last)
    );
    for w in seen.windows(2) {
        assert!(w[1].unix_ms >= w[0].unix_ms);
    }

    // A reload that gives sources longer (sense.deadline_ms) counts the stuck one fresh from
    // the next merge on (passes merged before the change may still be queued), and back.
    let within = |stale: bool, what: &str| {
        let found = (0..5000).any(|_| next().is_stale("gpu") == stale);
        assert!(found, "{what}");
    };
    link.pace.set(interval, Duration::from_secs(600));
    within(false, "fresh under the longer deadline");
    link.pace.set(interval, deadline);
    within(true, "stale again under the first deadline");

    // Once it answers, it is fresh again.
    release_tx.send(()).expect("release");
    let mut obs = next();
    while obs.is_stale("gpu") {
        let _ = release_tx.send(());
        obs = next();
    }
    assert_eq!(obs.sources.gpu, "fake nvml");
    assert_eq!(obs.node.gpus.len(), 1);

    drop(release_tx);
    drop(link);
    join.join().expect("coordinator");
}

/// A source that could not be opened: counts its passes and the job lists it was given.
struct Unavailable {
    passes: std::sync::Arc<std::sync::atomic::AtomicU32>,
    jobs: mpsc::Sender<usize>,
}

impl Source for Unavailable {
    fn set_jobs(&mut self, jobs: Vec<SensedJob>) {
        let _ = self.jobs.send(jobs.len());
    }
    fn sample(&mut self) -> Observations {
        self.passes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut obs = Observations::default();
        obs.sources.perf = "unavailable: no PMU".into();
        obs
    }
    fn constant(&self) -> bool {
        true
    }
}

/// A source that measures nothing until `until` (NVML to be opened again then): counts its
/// passes.
struct Reopening {
    passes: std::sync::Arc<std::sync::atomic::AtomicU32>,
    until: Instant,
}

impl Source for Reopening {
    fn set_jobs(&mut self, _: Vec<SensedJob>) {}
    fn sample(&mut self) -> Observations {
        self.passes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut obs = Observations::default();
        obs.sources.gpu = "unavailable: the NVIDIA kernel driver is not loaded".into();
        obs
    }
    fn quiet_until(&self) -> Option<Instant> {
        (Instant::now() < self.until).then_some(self.until)
    }
}

/// A worker whose source will only try again later sleeps until then, and its pass does not
/// go stale meanwhile; it was sampled every interval (issue 21's idle cost). Then it wakes.
#[test]
fn a_source_that_tries_again_later_sleeps_until_then_and_does_not_go_stale() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let run = |until: Instant| {
        let passes = std::sync::Arc::new(AtomicU32::new(0));
        let counted = passes.clone();
        let sources: Vec<(SourceKind, OpenSource)> = vec![
            (
                SourceKind::Cpu,
                Box::new(|| Box::new(Counting(0.0)) as Box<dyn Source>),
            ),
            (
                SourceKind::Gpu,
                Box::new(move || {
                    Box::new(Reopening {
                        passes: counted,
                        until,
                    }) as Box<dyn Source>
                }),
            ),
        ];
        let pace = Pace::new(Duration::from_millis(10), Duration::from_millis(30));
        let (link, join) = spawn_sources(sources, pace).expect("spawn");
        (passes, link, join)
    };
    // Far off: one pass over merges spanning many intervals and deadlines.
    let (passes, link, join) = run(Instant::now() + Duration::from_secs(3600));
    let next = || link.observations.recv_timeout(HANG_GUARD).expect("a pass");
    let first = next();
    let mut last = next();
    while last.unix_ms < first.unix_ms + 200 {
        last = next();
    }
    assert!(!last.is_stale("gpu"), "{:?}", last.ages);
    assert_eq!(
        passes.load(Ordering::SeqCst),
        1,
        "sampled once until it tries again"
    );
    drop(link);
    join.join().expect("coordinator");
    // Soon: it wakes then and is sampled every interval again.
    let (passes, link, join) = run(Instant::now() + Duration::from_millis(50));
    let deadline = Instant::now() + HANG_GUARD;
    while passes.load(Ordering::SeqCst) < 3 {
        assert!(Instant::now() < deadline, "it never woke");
        let _ = link.observations.recv_timeout(HANG_GUARD);
    }
    drop(link);
    join.join().expect("coordinator");
}

#[test]
fn a_source_that_cannot_measure_is_sampled_once_and_never_goes_stale() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let passes = std::sync::Arc::new(AtomicU32::new(0));
    let (jobs_tx, jobs_rx) = mpsc::channel();
    let counted = passes.clone();
    let sources: Vec<(SourceKind, OpenSource)> = vec![
        (
            SourceKind::Cpu,
            Box::new(|| Box::new(Counting(0.0)) as Box<dyn Source>),
        ),
        (
            SourceKind::Perf,
            Box::new(move || {
                Box::new(Unavailable {
                    passes: counted,
                    jobs: jobs_tx,
                }) as Box<dyn Source>
            }),
        ),
    ];
    // A deadline far shorter than the merges below span: a source sampled once would be stale
    // after it, were it not constant.
    let interval = Duration::from_millis(10);
    let deadline = Duration::from_millis(30);
    let (link, join) = spawn_sources(sources, Pace::new(interval, deadline)).expect("spawn");
    let next = || link.observations.recv_timeout(HANG_GUARD).expect("a pass");
    let first = next();
    let mut last = next();
    while last.unix_ms < first.unix_ms + 200 {
        last = next();
    }
    for o in [&first, &last] {
        assert!(!o.is_stale("perf"), "{:?}", o.ages);
        assert_eq!(o.sources.perf, "unavailable: no PMU");
        assert_eq!(o.ages["perf"].age_s, 0.0);
    }
    let count = |o: &Observations| o.node.cpu_percent.expect("cpu figure");
    assert!(count(&last) > count(&first), "the CPU source kept sampling");
    assert_eq!(passes.load(Ordering::SeqCst), 1, "sampled once");
    // It still takes the jobs (a source keeps no figures for them, but is told).
    link.jobs
        .send(vec![SensedJob {
            id: crate::job::JobId::from_seq(1),
            pids: vec![1],
            cgroup: None,
            gpus: Vec::new(),
        }])
        .expect("send jobs");
    assert_eq!(jobs_rx.recv_timeout(HANG_GUARD), Ok(1));
    assert_eq!(passes.load(Ordering::SeqCst), 1, "taking jobs is no pass");
    drop(link);
    join.join().expect("coordinator");
}
