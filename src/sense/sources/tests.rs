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
