//! A sensing pass: owns signal sources (all of them, or one for a worker of
//! [`sources`](super::sources), which runs each source on its own thread under a deadline),
//! samples them, derives rates from consecutive samples and returns the pass as
//! [`Observations`]. It runs beside the agent's loop, not in it: NVML calls and perf reads on
//! many fds can block, and a slow source must never delay enforcement (STYLE §7).
//!
//! Each missing feature (no NVML, no PMU, no resctrl, no PSI) is said once, at start, with the
//! reason; afterwards it is reported as `unavailable: <why>` in [`SourceStatus`]. NVML that is
//! installed but does not answer at start (the kernel driver not loaded yet, its device files
//! not made yet: lodgerd may neither load modules nor make device files) is opened again every
//! [`GPU_REOPEN_EVERY`], quietly, and said once more when it answers.
//!
//! Where resctrl counts memory bandwidth, each job gets a monitoring group (`lodger-<job>`,
//! [`JobMonGroups`]) kept in step with its threads every pass; groups left by an earlier lodgerd
//! are swept at start, and a job's groups are removed when it leaves and when the sampler is
//! dropped (its thread ends when the agent's does).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::clock::unix_ms;
use crate::job::JobId;
use crate::sense::cpu::{
    CgroupCpuReader, CpuReader, JobCpuRate, JobCpuSample, NodeCpuRates, PressureSample, StallRates,
    StatSample,
};
use crate::sense::gpu::{self, GpuSource, GpuSourceKind, GpuStatus};
use crate::sense::membw::{self, JobGroupNote, JobMonGroups, MbmReader, MbmSample};
use crate::sense::net::{self, NetReader, NetSample};
use crate::sense::perf::{Counters, PerfCounters, PerfRates, PerfSample, PerfSettings, PerfTarget};
use crate::sense::sources::SourceKind;
use crate::sense::{
    GpuMetrics, JobMetrics, NetMetrics, NodeMetrics, Observations, SensedJob, SourceStatus,
};
use crate::sys::cgroupfs::CgroupVersion;

mod reopen;

use self::reopen::GpuReopen;
pub use self::reopen::GPU_REOPEN_EVERY;

impl Drop for Sampler {
    /// Removes the jobs' monitoring groups: resctrl's RMIDs are few, and a group lodger no longer
    /// keeps in step measures nothing useful.
    fn drop(&mut self) {
        if let Some(groups) = &mut self.job_groups {
            say(groups.remove_all());
        }
    }
}

/// Logs what per-job monitoring has to say (each note is said once by `JobMonGroups`).
fn say(notes: Vec<JobGroupNote>) {
    for note in notes {
        match note {
            JobGroupNote::Unavailable { job, reason } => {
                warn!(%job, "per-job memory bandwidth unavailable for this job: {reason}")
            }
            JobGroupNote::Measured { job } => {
                info!(%job, "per-job memory bandwidth measured again")
            }
            JobGroupNote::Failed { job, error } => {
                warn!(%job, "per-job memory bandwidth: {error}")
            }
        }
    }
}

/// Removes the `lodger-*` monitoring groups a lodgerd that was killed left behind.
fn sweep_stale_job_groups(root: &std::path::Path) {
    match membw::sweep_job_groups(root) {
        Ok(swept) => {
            if !swept.removed.is_empty() {
                let names: Vec<String> = swept.removed.iter().map(ToString::to_string).collect();
                info!(
                    "removed {} monitoring group(s) left by an earlier lodgerd: {}",
                    names.len(),
                    names.join(", ")
                );
            }
            for e in swept.failed {
                warn!("cannot remove a monitoring group left by an earlier lodgerd: {e}");
            }
        }
        Err(e) => warn!("cannot sweep monitoring groups left by an earlier lodgerd: {e}"),
    }
}

/// What a worker's sampler says of a source another worker reads (never shown: the merge takes
/// each source's words from its own worker).
/// A job whose traffic cannot be attributed (it is in the host's network namespace) is looked at
/// again this often, or when the process that told is no longer one of its own: two `readlink`s
/// a job every pass were a third of the sensing thread's idle cost at 100 jobs (issue 21). A
/// process that moves to a namespace of its own is measured from the next look.
const NETNS_RECHECK: Duration = Duration::from_secs(30);

/// A job whose processes used less than this (percent of one CPU) between their last two reads
/// is idle: its CPU time is read every [`IDLE_READ_EVERY`] passes only, and the passes between
/// carry its last figure. 100 idle jobs' process clocks every pass were most of the CPU worker's
/// cost and a third of an idle lodgerd's (issue 21: the kernel sums every thread of each
/// process). The price: a job that wakes is seen up to `IDLE_READ_EVERY - 1` passes later, by
/// `lodgerctl status` and by the RT guard, which does not read an idle job's threads
/// (`agent::rtguard`, whose idle share, 1 % of each CPU, is never below this). A job whose
/// processes change is read at the next pass.
pub const IDLE_PERCENT: f64 = 1.0;
/// See [`IDLE_PERCENT`].
pub const IDLE_READ_EVERY: u32 = 3;

const ANOTHER_WORKER: &str = "read by another sensing worker";

/// Where GPU utilization comes from (`sense.gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuChoice {
    Auto,
    Nvml,
    Emulated,
    Off,
}

#[derive(Debug, Clone)]
pub struct SamplerSettings {
    pub interval: Duration,
    pub proc_root: PathBuf,
    pub sysfs_root: PathBuf,
    pub gpu: GpuChoice,
    pub emulated_gpu_dir: PathBuf,
    pub perf: bool,
    pub perf_max_fds: usize,
    pub resctrl_root: PathBuf,
    /// 0: unknown; the node's bandwidth is then reported without a fraction of peak.
    pub membw_peak_bytes_per_s: u64,
    /// Where the cgroup hierarchies are mounted: on cgroup v2, jobs' `memory.pressure`.
    pub cgroup_root: PathBuf,
}

/// Opens a job's counters on its processes; the refusal to log, if it is not the one logged
/// last for this job.
fn attach_perf(entry: &mut Tracked, perf: &mut dyn Counters) -> Option<String> {
    let target = PerfTarget::Processes(entry.job.pids.clone());
    match perf.attach(&entry.job.id, &target) {
        Ok(_) => {
            entry.perf_pids = entry.job.pids.clone();
            entry.perf = None;
            entry.perf_error = None;
            None
        }
        Err(e) => {
            let e = e.to_string();
            (entry.perf_error.as_ref() != Some(&e)).then(|| {
                entry.perf_error = Some(e.clone());
                e
            })
        }
    }
}

/// A job as the sampler tracks it.
struct Tracked {
    job: SensedJob,
    cpu: Option<JobCpuSample>,
    /// Its figure from the last read of its processes' CPU time, and the passes since that read
    /// carried it (see [`IDLE_PERCENT`]); `None` until a rate, or after its processes changed.
    cpu_figure: Option<(f64, u32)>,
    perf: Option<PerfSample>,
    /// The pids the perf counters were opened on (inherit follows their children).
    perf_pids: Vec<u32>,
    /// Why its counters could not be opened, as last logged: the attach is tried again at every
    /// change of the job list, and the same refusal is not logged again.
    perf_error: Option<String>,
    /// Its own network namespace's counters at the last pass.
    netns: Option<net::NetnsSample>,
    /// Why its traffic cannot be attributed, which process told and when ([`NETNS_RECHECK`]).
    net_verdict: Option<(u32, Instant, std::sync::Arc<str>)>,
    /// Its cgroup's memory pressure at the last pass (cgroup v2).
    memory_pressure: Option<PressureSample>,
}

impl Tracked {
    fn new(job: SensedJob) -> Tracked {
        Tracked {
            job,
            cpu: None,
            cpu_figure: None,
            perf: None,
            perf_pids: Vec::new(),
            perf_error: None,
            netns: None,
            net_verdict: None,
            memory_pressure: None,
        }
    }
}

pub struct Sampler {
    settings: SamplerSettings,
    cpu: CpuReader,
    stat: Option<StatSample>,
    pressure: Option<PressureSample>,
    memory_pressure: Option<PressureSample>,
    psi_available: bool,
    /// cgroup v2: jobs' own `memory.pressure` (a v1 hierarchy has none).
    cgroups: Option<CgroupCpuReader>,
    gpu: Result<Box<dyn GpuSource>, String>,
    /// Set while NVML failed for a reason that may pass: it is opened again.
    gpu_reopen: Option<GpuReopen>,
    perf: Result<PerfCounters, String>,
    membw: Result<MbmReader, String>,
    mbm: Option<MbmSample>,
    /// Per-job monitoring groups, where `membw` is available.
    job_groups: Option<JobMonGroups>,
    net: NetReader,
    net_sample: Option<NetSample>,
    /// Why the last network pass failed as a whole (`class/net` unreadable, a counter that is
    /// not a number): logged once per distinct error, and said in `sources.net`.
    net_failing: Option<String>,
    jobs: BTreeMap<JobId, Tracked>,
    sources: SourceStatus,
    /// The one source this sampler reads (a worker of `sense::sources`); None: all of them.
    only: Option<SourceKind>,
}

impl Sampler {
    /// Opens every source, saying once for each one that is missing why it is.
    pub fn open(settings: SamplerSettings) -> Sampler {
        Self::open_for(settings, None)
    }

    /// Opens `kind` only, for the worker that samples it (`sense::sources`); the other sources
    /// are neither opened nor read.
    pub fn open_only(settings: SamplerSettings, kind: SourceKind) -> Sampler {
        Self::open_for(settings, Some(kind))
    }

    /// A worker's sampler whose one source could not be opened: its passes say why and nothing
    /// else, whatever the jobs (`sources::Source::constant`). CPU and network are always read.
    pub fn constant(&self) -> bool {
        match self.only {
            Some(SourceKind::Perf) => self.perf.is_err(),
            Some(SourceKind::Gpu) => self.gpu.is_err() && self.gpu_reopen.is_none(),
            Some(SourceKind::Membw) => self.membw.is_err(),
            Some(SourceKind::Cpu | SourceKind::Net) | None => false,
        }
    }

    fn reads(&self, kind: SourceKind) -> bool {
        self.only.map_or(true, |k| k == kind)
    }

    fn open_for(settings: SamplerSettings, only: Option<SourceKind>) -> Sampler {
        // A worker opens (and says why it cannot open) its own source only.
        let owns = |k: SourceKind| only.map_or(true, |o| o == k);
        let open_nvml = {
            let (dir, proc_root) = (
                settings.emulated_gpu_dir.clone(),
                settings.proc_root.clone(),
            );
            move || gpu::open_source(GpuSourceKind::Nvml, &dir, &proc_root)
        };
        let mut gpu_reopen = None;
        let gpu: Result<Box<dyn GpuSource>, String> = match settings.gpu {
            _ if !owns(SourceKind::Gpu) => Err(ANOTHER_WORKER.into()),
            GpuChoice::Off => Err("off (sense.gpu = \"off\")".into()),
            GpuChoice::Emulated => gpu::open_source(
                GpuSourceKind::Emulated,
                &settings.emulated_gpu_dir,
                &settings.proc_root,
            )
            .map_err(|e| e.to_string()),
            GpuChoice::Nvml | GpuChoice::Auto => open_nvml().map_err(|e| {
                if e.may_pass() {
                    gpu_reopen = Some(GpuReopen {
                        next: Instant::now() + GPU_REOPEN_EVERY,
                        every: GPU_REOPEN_EVERY,
                        open: Box::new(open_nvml),
                    });
                }
                e.to_string()
            }),
        };
        let again = if gpu_reopen.is_some() {
            format!(
                " (opened again every {} s until it answers)",
                GPU_REOPEN_EVERY.as_secs()
            )
        } else {
            String::new()
        };
        match (&gpu, settings.gpu) {
            _ if !owns(SourceKind::Gpu) => {}
            (Ok(g), _) if g.kind() == GpuSourceKind::Emulated => info!(
                "GPU sensing: emulated, from {} (the bundled training emulator; no real GPU is measured)",
                settings.emulated_gpu_dir.display()
            ),
            (Ok(_), _) => info!("GPU sensing: NVML"),
            (Err(e), GpuChoice::Nvml) => warn!("GPU sensing off: {e}{again}"),
            (Err(e), _) => info!("GPU sensing off: {e}{again}"),
        }

        let perf = if !owns(SourceKind::Perf) {
            Err(ANOTHER_WORKER.into())
        } else if settings.perf {
            let mut ps = PerfSettings::new(&settings.proc_root);
            ps.fd_cap = Some(settings.perf_max_fds);
            match PerfCounters::new(ps) {
                Ok(p) if p.status().available() => {
                    let st = p.status();
                    let off: Vec<String> = st
                        .events
                        .iter()
                        .filter_map(|e| Some(format!("{}: {}", e.event, e.unavailable.as_ref()?)))
                        .collect();
                    if !off.is_empty() {
                        info!("perf: some events unavailable ({})", off.join("; "));
                    }
                    Ok(p)
                }
                Ok(p) => {
                    let why = p
                        .status()
                        .events
                        .iter()
                        .filter_map(|e| e.unavailable.clone())
                        .next()
                        .unwrap_or_else(|| "no event can be counted".into());
                    let why = format!(
                        "no hardware counters: the PMU counts none of instructions, cycles, cache \
                         references, cache misses ({why}); VMs often expose none"
                    );
                    info!("perf sensing off (IPC and cache misses unavailable): {why}");
                    Err(why)
                }
                Err(e) => {
                    info!("perf sensing off (IPC and cache misses unavailable): {e}");
                    Err(e.to_string())
                }
            }
        } else {
            Err("off (sense.perf = false)".into())
        };

        let membw = if owns(SourceKind::Membw) {
            MbmReader::open(&settings.resctrl_root).map_err(|e| e.to_string())
        } else {
            Err(ANOTHER_WORKER.into())
        };
        let job_groups = match &membw {
            Err(_) if !owns(SourceKind::Membw) => None,
            Err(e) => {
                info!("memory-bandwidth sensing off: {e}");
                None
            }
            Ok(reader) => {
                if settings.membw_peak_bytes_per_s == 0 {
                    // The highest bandwidth seen is no peak: a steady load would be its own
                    // peak, always "pressure" (contention then uses training progress).
                    info!(
                        "memory bandwidth measured, but no fraction of peak: set \
                         sense.membw_peak_bytes_per_s to the node's peak (measured with \
                         examples/membw_hog, or the platform's figure) for contention to use it"
                    );
                }
                sweep_stale_job_groups(reader.root());
                Some(JobMonGroups::new(reader.root(), &settings.proc_root))
            }
        };
        let mut cpu = CpuReader::new(&settings.proc_root);
        let psi_available = owns(SourceKind::Cpu) && matches!(cpu.pressure(), Ok(Some(_)));
        if !psi_available && owns(SourceKind::Cpu) {
            info!(
                "CPU pressure (PSI) unavailable: no {}/pressure/cpu (kernel without CONFIG_PSI or booted with psi=0)",
                settings.proc_root.display()
            );
        }
        let net = NetReader::new(&settings.sysfs_root);
        let v2 = settings.cgroup_root.join("cgroup.controllers").is_file();
        let cgroups = (psi_available && v2)
            .then(|| CgroupCpuReader::new(&settings.cgroup_root, CgroupVersion::V2));
        let mut s = Sampler {
            cpu,
            stat: None,
            pressure: None,
            memory_pressure: None,
            psi_available,
            cgroups,
            gpu,
            gpu_reopen,
            perf,
            membw,
            mbm: None,
            job_groups,
            net,
            net_sample: None,
            net_failing: None,
            jobs: BTreeMap::new(),
            sources: SourceStatus::default(),
            settings,
            only,
        };
        s.sources = s.source_status(None);
        s
    }

    fn source_status(&self, gpu: Option<&GpuStatus>) -> SourceStatus {
        let unavailable = |e: &String| format!("unavailable: {e}");
        SourceStatus {
            gpu: match (&self.gpu, gpu) {
                (Err(e), _) => unavailable(e),
                (Ok(_), Some(st)) => st.to_string(),
                (Ok(g), None) => g.kind().to_string(),
            },
            perf: match &self.perf {
                Err(e) => unavailable(e),
                Ok(p) => {
                    let st = p.status();
                    let on: Vec<&str> = st
                        .events
                        .iter()
                        .filter(|e| e.unavailable.is_none())
                        .map(|e| e.event.name())
                        .collect();
                    format!(
                        "{}: {} ({} of {} fds)",
                        if st.software {
                            "software events"
                        } else {
                            "hardware counters"
                        },
                        on.join(", "),
                        st.budget.used,
                        st.budget.cap
                    )
                }
            },
            cpu: if self.psi_available {
                "procfs, PSI".into()
            } else {
                "procfs (no PSI)".into()
            },
            membw: match &self.membw {
                Err(e) => unavailable(e),
                Ok(_) => "resctrl MBM".into(),
            },
            net: match &self.net_failing {
                Some(e) => format!("failing: {e}"),
                None => "sysfs".into(),
            },
        }
    }

    /// Takes the agent's current job list: new jobs get counters, gone ones lose theirs.
    pub fn set_jobs(&mut self, jobs: Vec<SensedJob>) {
        let wanted: BTreeSet<JobId> = jobs.iter().map(|j| j.id.clone()).collect();
        let gone: Vec<JobId> = self
            .jobs
            .keys()
            .filter(|id| !wanted.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            self.jobs.remove(&id);
            if let Ok(p) = &mut self.perf {
                p.detach(&id);
            }
            if let Some(groups) = &mut self.job_groups {
                say(groups.forget(&id));
            }
        }
        for job in jobs {
            let entry = self
                .jobs
                .entry(job.id.clone())
                .or_insert_with(|| Tracked::new(job.clone()));
            if entry.job.pids != job.pids {
                entry.cpu_figure = None;
            }
            entry.job = job;
            // Counters opened with inherit follow children and new threads; reopen only when
            // every process they were opened on is gone (or none was yet).
            let still_counted = entry.perf_pids.iter().any(|p| entry.job.pids.contains(p));
            if !still_counted && !entry.job.pids.is_empty() {
                if let Ok(p) = &mut self.perf {
                    if let Some(e) = attach_perf(entry, p) {
                        warn!(job = %entry.job.id, "perf counters not opened: {e}");
                    }
                }
            }
        }
    }

    /// One pass over every source.
    pub fn pass(&mut self) -> Observations {
        let mut node = NodeMetrics::default();

        // CPU, node and per job.
        let cpu = self.reads(SourceKind::Cpu);
        if let Some(Ok(stat)) = cpu.then(|| self.cpu.stat()) {
            if let Some(r) = self
                .stat
                .as_ref()
                .and_then(|prev| NodeCpuRates::between(prev, &stat))
            {
                node.cpu_percent = r.all.map(|u| u.busy * 100.0);
                node.per_cpu_percent = r
                    .cpus
                    .iter()
                    .filter_map(|(id, u)| Some((*id, u.as_ref()?.busy * 100.0)))
                    .collect();
            }
            self.stat = Some(stat);
        }
        if cpu && self.psi_available {
            if let Ok(Some(p)) = self.cpu.pressure() {
                node.cpu_pressure_percent = stall_percent(&mut self.pressure, p);
            }
            if let Ok(Some(p)) = self.cpu.memory_pressure() {
                node.memory_pressure_percent = stall_percent(&mut self.memory_pressure, p);
            }
        }
        // Every job has an entry from the CPU source (the merge keeps them), none from the others'
        // workers unless they have a figure: 100 jobs' ids copied by five workers every pass
        // were a fifth of the idle cost (issue 21).
        // Built in the jobs' order and collected at once, not inserted one by one.
        let mut per_job = Vec::with_capacity(if cpu { self.jobs.len() } else { 0 });
        for t in self.jobs.values_mut().filter(|_| cpu) {
            let mut m = JobMetrics::default();
            match &mut t.cpu_figure {
                Some((percent, carried))
                    if *percent < IDLE_PERCENT && *carried + 1 < IDLE_READ_EVERY =>
                {
                    *carried += 1;
                    m.cpu_percent = Some(*percent);
                }
                _ => {
                    if let Ok(sample) = self.cpu.processes(&t.job.pids) {
                        if let Some(r) = t
                            .cpu
                            .as_ref()
                            .and_then(|prev| JobCpuRate::between(prev, &sample))
                        {
                            m.cpu_percent = Some(r.cores * 100.0);
                        }
                        t.cpu = Some(sample);
                    }
                    t.cpu_figure = m.cpu_percent.map(|p| (p, 0));
                }
            }
            // A job with a cgroup of its own on v2: its memory stalls, not the node's.
            if let (Some(reader), Some(cg)) = (self.cgroups.as_mut(), t.job.cgroup.as_deref()) {
                if let Ok(Some(p)) = reader.memory_pressure(cg) {
                    m.memory_pressure_percent = stall_percent(&mut t.memory_pressure, p);
                }
            }
            per_job.push((t.job.id.clone(), m));
        }
        let mut jobs: BTreeMap<JobId, JobMetrics> = per_job.into_iter().collect();

        // perf.
        if let Ok(p) = &mut self.perf {
            for (id, sample) in p.read() {
                let Some(t) = self.jobs.get_mut(&id) else {
                    continue;
                };
                if let Some(r) = t
                    .perf
                    .as_ref()
                    .and_then(|prev| PerfRates::between(prev, &sample))
                {
                    let m = jobs.entry(id.clone()).or_default();
                    m.ipc = r.ipc;
                    m.cache_miss_percent = r.cache_miss_ratio.map(|x| x * 100.0);
                }
                t.perf = Some(sample);
            }
        }

        // GPU.
        self.reopen_gpu();
        let mut gpu_status = None;
        if let Ok(g) = &mut self.gpu {
            match g.sample() {
                Ok(snap) => {
                    let source = snap.source.to_string();
                    node.gpus = snap
                        .devices
                        .iter()
                        .map(|d| GpuMetrics {
                            index: d.index,
                            source: source.clone(),
                            util_percent: d.util_gpu.map(|u| u * 100.0),
                            mem_util_percent: d.util_memory.map(|u| u * 100.0),
                            sm_clock_mhz: d.sm_clock_mhz,
                            mem_used_bytes: d.memory_used_bytes,
                            mem_total_bytes: d.memory_total_bytes,
                            power_watts: d.power_watts(),
                            pcie_tx_bytes_per_s: d.pcie_tx_bytes_per_s(),
                            pcie_rx_bytes_per_s: d.pcie_rx_bytes_per_s(),
                        })
                        .collect();
                    for t in self.jobs.values() {
                        let pids: BTreeSet<u32> = t.job.pids.iter().copied().collect();
                        let u = gpu::job_utilization(&snap, &pids);
                        if let Some(mean) = u.mean {
                            let m = jobs.entry(t.job.id.clone()).or_default();
                            m.gpu_percent = Some(mean * 100.0);
                            m.gpu_source = Some(source.clone());
                        }
                    }
                    gpu_status = Some(snap.status());
                }
                Err(e) => {
                    gpu_status = Some(GpuStatus::unavailable(&e));
                }
            }
        }

        // Memory bandwidth: the jobs' groups first, so the sample has them as they are now.
        if let Some(groups) = &mut self.job_groups {
            say(groups.sync(
                self.jobs
                    .values()
                    .map(|t| (&t.job.id, t.job.pids.as_slice())),
            ));
        }
        if let Ok(r) = &self.membw {
            let mut job_rates = None;
            if let Ok(sample) = r.sample() {
                if let Some(prev) = &self.mbm {
                    let rates = membw::rates(prev, &sample);
                    job_rates = self.job_groups.as_ref().map(|g| g.bandwidth(Some(&rates)));
                    node.membw_bytes_per_s = Some(rates.node.bytes_per_s);
                    // No configured peak (0): no fraction (`node_fraction` takes only a
                    // positive peak).
                    node.membw_fraction_of_peak =
                        rates.node_fraction(self.settings.membw_peak_bytes_per_s as f64);
                }
                self.mbm = Some(sample);
            }
            let job_rates =
                job_rates.or_else(|| self.job_groups.as_ref().map(|g| g.bandwidth(None)));
            for (id, bw) in job_rates.unwrap_or_default() {
                let m = jobs.entry(id).or_default();
                m.membw_bytes_per_s = bw.bytes_per_s();
                m.membw_unavailable = bw.unavailable;
                if m.membw_unavailable.is_none() {
                    m.membw_domains = bw.domains;
                }
            }
        }

        // Network, per job where it has a namespace of its own.
        let net = self.reads(SourceKind::Net);
        let now = Instant::now();
        for t in self.jobs.values_mut().filter(|_| net) {
            if let Some((pid, at, why)) = &t.net_verdict {
                if t.job.pids.contains(pid) && now.saturating_duration_since(*at) < NETNS_RECHECK {
                    jobs.entry(t.job.id.clone()).or_default().net_unavailable = Some(why.clone());
                    continue;
                }
            }
            t.net_verdict = None;
            match net::job_netns_sample(&self.settings.proc_root, &t.job.pids) {
                net::JobNet::Own(sample) => {
                    if let Some((rx, tx)) =
                        t.netns.as_ref().and_then(|p| net::netns_rates(p, &sample))
                    {
                        let m = jobs.entry(t.job.id.clone()).or_default();
                        m.net_rx_bytes_per_s = Some(rx);
                        m.net_tx_bytes_per_s = Some(tx);
                    }
                    t.netns = Some(sample);
                }
                net::JobNet::NotAttributable { pid, why } => {
                    let why: std::sync::Arc<str> = why.into();
                    jobs.entry(t.job.id.clone()).or_default().net_unavailable = Some(why.clone());
                    t.net_verdict = Some((pid, now, why));
                    t.netns = None;
                }
                net::JobNet::Gone => t.netns = None,
            }
        }
        let sample = net.then(|| self.net.sample()).and_then(|r| {
            match net_news(&mut self.net_failing, r.as_ref().err()) {
                Some(NetNews::Failing(e)) => warn!("network counters not read: {e}"),
                Some(NetNews::Recovered(e)) => info!("network counters read again (failed: {e})"),
                None => {}
            }
            r.ok()
        });
        if let Some(sample) = sample {
            if let Some(prev) = &self.net_sample {
                let rates = net::rates(prev, &sample);
                node.net = rates
                    .interfaces
                    .iter()
                    .filter(|(name, _)| name.as_str() != "lo")
                    .filter_map(|(name, r)| {
                        Some(NetMetrics {
                            interface: name.clone(),
                            rx_bytes_per_s: r.rx_bytes_per_s?,
                            tx_bytes_per_s: r.tx_bytes_per_s?,
                            speed_mbps: r.line_bytes_per_s.map(|b| (b * 8.0 / 1e6).round() as u64),
                        })
                    })
                    .collect();
            }
            self.net_sample = Some(sample);
        }

        self.sources = self.source_status(gpu_status.as_ref());
        Observations {
            unix_ms: unix_ms(),
            node,
            jobs,
            sources: self.sources.clone(),
            ages: BTreeMap::new(),
        }
    }
}

/// What a network pass has to say, once: a failure not seen last pass, or the end of one.
#[derive(Debug, PartialEq)]
enum NetNews {
    Failing(String),
    Recovered(String),
}

/// The news of a network pass that failed with `error` (`None`: it read), `failing` being why
/// the last one failed; keeps `failing` up to date.
fn net_news(failing: &mut Option<String>, error: Option<&net::NetError>) -> Option<NetNews> {
    match error.map(ToString::to_string) {
        Some(e) if failing.as_ref() == Some(&e) => None,
        Some(e) => Some(NetNews::Failing(failing.insert(e).clone())),
        None => failing.take().map(NetNews::Recovered),
    }
}

/// The percent of the time since `prev` that some task stalled (PSI `some`), and `now` kept as
/// the next `prev`; `None` from the first sample.
fn stall_percent(prev: &mut Option<PressureSample>, now: PressureSample) -> Option<f64> {
    let rate = prev
        .as_ref()
        .and_then(|p| StallRates::between(p, &now))
        .map(|r| r.some * 100.0);
    *prev = Some(now);
    rate
}

#[cfg(test)]
mod tests;
