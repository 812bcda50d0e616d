//! Each signal source on a thread of its own, under a deadline: a worker per source (cpu, perf,
//! gpu, membw, net) samples at `sense.interval_ms` and hands over its latest pass; a coordinator
//! merges the newest pass of every source into the [`Observations`] the agent receives, once per
//! interval. A source whose last pass is older than the interval plus `sense.deadline_ms` (a hung
//! NVML call, a slow /proc read) is marked stale with its age: its figures are left out instead of
//! being served as new, it is logged once (and once when it recovers), and its worker goes on
//! trying. The others keep their cadence. Touches only threads and channels; the sources are the
//! [`Sampler`]'s.

use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::link::{LatestObservations, Pace, SensorLink};
use super::sampler::{Sampler, SamplerSettings};
use super::{JobMetrics, Observations, SensedJob, SourceAge};
use crate::clock::unix_ms;

/// The signal sources, each sampled by its own worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SourceKind {
    Cpu,
    Perf,
    Gpu,
    Membw,
    Net,
}

impl SourceKind {
    pub const ALL: [SourceKind; 5] = [
        SourceKind::Cpu,
        SourceKind::Perf,
        SourceKind::Gpu,
        SourceKind::Membw,
        SourceKind::Net,
    ];

    /// The name in `status`, `top` and the metrics' `source` label.
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Cpu => "cpu",
            SourceKind::Perf => "perf",
            SourceKind::Gpu => "gpu",
            SourceKind::Membw => "membw",
            SourceKind::Net => "net",
        }
    }

    /// Copies this source's figures (and only those) from one of its passes into `into`.
    fn merge(self, into: &mut Observations, from: &Observations) {
        let (n, f) = (&mut into.node, &from.node);
        match self {
            SourceKind::Cpu => {
                n.cpu_percent = f.cpu_percent;
                n.per_cpu_percent = f.per_cpu_percent.clone();
                n.cpu_pressure_percent = f.cpu_pressure_percent;
                n.memory_pressure_percent = f.memory_pressure_percent;
                into.sources.cpu = from.sources.cpu.clone();
            }
            SourceKind::Perf => into.sources.perf = from.sources.perf.clone(),
            SourceKind::Gpu => {
                n.gpus = from.node.gpus.clone();
                into.sources.gpu = from.sources.gpu.clone();
            }
            SourceKind::Membw => {
                n.membw_bytes_per_s = f.membw_bytes_per_s;
                n.membw_fraction_of_peak = f.membw_fraction_of_peak;
                into.sources.membw = from.sources.membw.clone();
            }
            SourceKind::Net => {
                n.net = f.net.clone();
                into.sources.net = from.sources.net.clone();
            }
        }
        if into.jobs.is_empty() {
            // The first source's jobs, built at once from its sorted map rather than inserted one
            // by one (issue 21: the merge was a third of the coordinator's idle cost).
            into.jobs = from
                .jobs
                .iter()
                .map(|(id, m)| {
                    let mut j = JobMetrics::default();
                    self.merge_job(&mut j, m);
                    (id.clone(), j)
                })
                .collect();
            return;
        }
        for (id, m) in &from.jobs {
            self.merge_job(into.jobs.entry(id.clone()).or_default(), m);
        }
    }

    /// Copies this source's figures of one job.
    fn merge_job(self, j: &mut JobMetrics, m: &JobMetrics) {
        match self {
            SourceKind::Cpu => {
                j.cpu_percent = m.cpu_percent;
                j.memory_pressure_percent = m.memory_pressure_percent;
            }
            SourceKind::Perf => {
                j.ipc = m.ipc;
                j.cache_miss_percent = m.cache_miss_percent;
            }
            SourceKind::Gpu => {
                j.gpu_percent = m.gpu_percent;
                j.gpu_source = m.gpu_source.clone();
            }
            SourceKind::Membw => {
                j.membw_bytes_per_s = m.membw_bytes_per_s;
                j.membw_domains = m.membw_domains.clone();
                j.membw_unavailable = m.membw_unavailable.clone();
            }
            SourceKind::Net => {
                j.net_rx_bytes_per_s = m.net_rx_bytes_per_s;
                j.net_tx_bytes_per_s = m.net_tx_bytes_per_s;
                j.net_unavailable = m.net_unavailable.clone();
            }
        }
    }

    fn status(self, obs: &Observations) -> &str {
        let s = &obs.sources;
        match self {
            SourceKind::Cpu => &s.cpu,
            SourceKind::Perf => &s.perf,
            SourceKind::Gpu => &s.gpu,
            SourceKind::Membw => &s.membw,
            SourceKind::Net => &s.net,
        }
    }

    fn status_mut(self, obs: &mut Observations) -> &mut String {
        let s = &mut obs.sources;
        match self {
            SourceKind::Cpu => &mut s.cpu,
            SourceKind::Perf => &mut s.perf,
            SourceKind::Gpu => &mut s.gpu,
            SourceKind::Membw => &mut s.membw,
            SourceKind::Net => &mut s.net,
        }
    }
}

/// One source as its worker drives it: told the jobs, asked for a pass.
pub trait Source: Send {
    fn set_jobs(&mut self, jobs: Vec<SensedJob>);
    /// One pass; only this source's figures are read from it.
    fn sample(&mut self) -> Observations;
    /// Whether every pass from now on would be the last one: a source that could not be opened
    /// (no PMU, no NVML, no resctrl) says why and measures nothing, whatever the jobs. Its
    /// worker then samples no more and its pass never goes stale: three such workers waking
    /// every interval were a quarter of an idle lodgerd's CPU on a host without them (issue 21).
    fn constant(&self) -> bool {
        false
    }
    /// When a source that measures nothing now will try again (NVML that did not answer at
    /// start is opened again later): until then its passes would say the same, so its worker
    /// sleeps until that instant, taking the jobs, and its pass does not go stale meanwhile.
    /// `None`: sampled every interval.
    fn quiet_until(&self) -> Option<Instant> {
        None
    }
}

impl Source for Sampler {
    fn set_jobs(&mut self, jobs: Vec<SensedJob>) {
        Sampler::set_jobs(self, jobs);
    }
    fn sample(&mut self) -> Observations {
        self.pass()
    }
    fn constant(&self) -> bool {
        Sampler::constant(self)
    }
    fn quiet_until(&self) -> Option<Instant> {
        Sampler::quiet_until(self)
    }
}

/// Opens a source on its worker's thread (opening NVML can hang as well as sampling it).
pub type OpenSource = Box<dyn FnOnce() -> Box<dyn Source> + Send>;

/// How often the coordinator looks for the sources' first passes at start.
const FIRST_PASS_POLL: Duration = Duration::from_millis(5);

/// Where the coordinator's merged passes go: the agent's channel and the newest one.
struct Out {
    tx: mpsc::Sender<Arc<Observations>>,
    latest: LatestObservations,
}

/// A worker's newest pass and when it ended; shared, so that the merge takes it without copying
/// every job's figures (issue 21: a copy per source and job every interval).
type Latest = Arc<Mutex<Option<Pass>>>;

/// A worker's pass as the coordinator takes it.
#[derive(Clone)]
struct Pass {
    /// When it ended.
    at: Instant,
    obs: Arc<Observations>,
    /// The source's last pass ([`Source::constant`]), or its last until it tries again
    /// ([`Source::quiet_until`]): never stale.
    constant: bool,
}

struct Worker {
    kind: SourceKind,
    jobs: mpsc::Sender<Vec<SensedJob>>,
    latest: Latest,
    done: mpsc::Receiver<()>,
    /// Said stale (logged) and not yet recovered.
    stale: bool,
    /// The last status words the source gave, kept to show beside its age when stale.
    last_status: String,
}

/// Starts the sampler's sources, each on a worker of its own, and the coordinator that merges
/// them for the agent. `deadline`: how much longer than the interval a source's newest pass may
/// be before the source is stale.
pub fn spawn(
    settings: SamplerSettings,
    deadline: Duration,
) -> std::io::Result<(SensorLink, thread::JoinHandle<()>)> {
    let pace = Pace::new(settings.interval, deadline);
    let sources: Vec<(SourceKind, OpenSource)> = SourceKind::ALL
        .into_iter()
        .map(|kind| {
            let settings = settings.clone();
            let open: OpenSource =
                Box::new(move || Box::new(Sampler::open_only(settings, kind)) as Box<dyn Source>);
            (kind, open)
        })
        .collect();
    spawn_sources(sources, pace)
}

/// [`spawn`] with any sources (the tests' fakes), at `pace`.
pub fn spawn_sources(
    sources: Vec<(SourceKind, OpenSource)>,
    pace: Arc<Pace>,
) -> std::io::Result<(SensorLink, thread::JoinHandle<()>)> {
    let mut workers = Vec::new();
    for (kind, open) in sources {
        let (jobs_tx, jobs_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let latest: Latest = Arc::new(Mutex::new(None));
        let slot = latest.clone();
        let worker_pace = pace.clone();
        thread::Builder::new()
            .name(format!("lodger-sense-{}", kind.name()))
            .spawn(move || {
                work(open, jobs_rx, &slot, &worker_pace);
                let _ = done_tx.send(());
            })?;
        workers.push(Worker {
            kind,
            jobs: jobs_tx,
            latest,
            done: done_rx,
            stale: false,
            last_status: String::new(),
        });
    }
    let (obs_tx, obs_rx) = mpsc::channel();
    let (jobs_tx, jobs_rx) = mpsc::channel::<Vec<SensedJob>>();
    let latest: LatestObservations = Arc::new(Mutex::new(None));
    let out = Out {
        tx: obs_tx,
        latest: latest.clone(),
    };
    let coordinator_pace = pace.clone();
    let join = thread::Builder::new()
        .name("lodger-sense".into())
        .spawn(move || coordinate(workers, &jobs_rx, &out, &coordinator_pace))?;
    Ok((
        SensorLink {
            observations: obs_rx,
            jobs: jobs_tx,
            latest,
            pace,
        },
        join,
    ))
}

/// A worker: a pass every interval, the newest handed over; ends when the coordinator goes. A
/// [constant](Source::constant) source's worker only waits for the end, taking the jobs.
fn work(open: OpenSource, jobs: mpsc::Receiver<Vec<SensedJob>>, latest: &Latest, pace: &Pace) {
    let mut source = open();
    let mut next = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next {
            let obs = source.sample();
            let constant = source.constant();
            let quiet = (!constant).then(|| source.quiet_until()).flatten();
            if let Ok(mut l) = latest.lock() {
                *l = Some(Pass {
                    at: Instant::now(),
                    obs: Arc::new(obs),
                    constant: constant || quiet.is_some(),
                });
            }
            if constant {
                while let Ok(j) = jobs.recv() {
                    source.set_jobs(j);
                }
                return;
            }
            next = quiet.unwrap_or_else(|| Instant::now() + pace.interval());
            continue;
        }
        match jobs.recv_timeout(next - now) {
            Ok(j) => source.set_jobs(j),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The coordinator: hands the jobs to every worker, and once per interval the merge of their
/// newest passes to the agent. On leaving it waits (at most `deadline` each) for the workers to
/// end, so the sources' clean-up (the monitoring groups) runs; a stuck worker is left behind.
fn coordinate(
    mut workers: Vec<Worker>,
    jobs: &mpsc::Receiver<Vec<SensedJob>>,
    out: &Out,
    pace: &Pace,
) {
    let started = Instant::now();
    let deadline = pace.deadline();
    // The first merge as soon as every source has answered once (or the deadline passed), so
    // a fresh lodgerd shows its sources at once rather than after a whole interval.
    while started.elapsed() < deadline
        && workers
            .iter()
            .any(|w| w.latest.lock().is_ok_and(|l| l.is_none()))
    {
        thread::sleep(FIRST_PASS_POLL);
    }
    let mut next = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next {
            let obs = Arc::new(merge(
                &mut workers,
                started,
                pace.interval() + pace.deadline(),
            ));
            if let Ok(mut l) = out.latest.lock() {
                *l = Some(Arc::clone(&obs));
            }
            if out.tx.send(obs).is_err() {
                break;
            }
            next = Instant::now() + pace.interval();
            continue;
        }
        match jobs.recv_timeout(next - now) {
            Ok(j) => {
                for w in &workers {
                    let _ = w.jobs.send(j.clone());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let done: Vec<mpsc::Receiver<()>> = workers.into_iter().map(|w| w.done).collect();
    for d in done {
        let _ = d.recv_timeout(pace.deadline());
    }
}

/// The newest pass of every source, a stale one's figures left out and its age said.
fn merge(workers: &mut [Worker], started: Instant, stale_after: Duration) -> Observations {
    let now = Instant::now();
    let mut obs = Observations {
        unix_ms: unix_ms(),
        ..Observations::default()
    };
    for w in workers.iter_mut() {
        let latest = w.latest.lock().ok().and_then(|l| l.clone());
        let age = match &latest {
            Some(p) if p.constant => Duration::ZERO,
            Some(p) => now.saturating_duration_since(p.at),
            None => now.saturating_duration_since(started),
        };
        let stale = age > stale_after;
        let age_s = age.as_secs_f64();
        match (stale, w.stale) {
            (true, false) => warn!(
                source = w.kind.name(),
                "sensing: {} has no new sample for {age_s:.1} s (deadline {:.1} s): its figures \
                 are left out, and right-sizing and contention hold, until it answers",
                w.kind.name(),
                stale_after.as_secs_f64()
            ),
            (false, true) => info!(
                source = w.kind.name(),
                "sensing: {} answers again",
                w.kind.name()
            ),
            _ => {}
        }
        w.stale = stale;
        if let Some(pass) = &latest {
            w.last_status = w.kind.status(&pass.obs).to_string();
            if !stale {
                w.kind.merge(&mut obs, &pass.obs);
            }
        }
        if latest.is_none() && !stale {
            *w.kind.status_mut(&mut obs) = "starting: no sample yet".into();
        }
        if stale {
            let before = if w.last_status.is_empty() {
                "no sample yet".to_string()
            } else {
                w.last_status.clone()
            };
            // No age in the words: they label a Prometheus series (`lodger_source_info`);
            // the age is `ages` (status, top, `lodger_sample_age_seconds`).
            *w.kind.status_mut(&mut obs) = format!(
                "stale: no new sample within {:.1} s (last: {before})",
                stale_after.as_secs_f64()
            );
        }
        obs.ages
            .insert(w.kind.name().to_string(), SourceAge { age_s, stale });
    }
    obs
}

#[cfg(test)]
mod tests;
