//! Tests of the sampler: per-job bandwidth through resctrl fixture trees, and memory pressure
//! (PSI) of the node and of a job's cgroup from fake trees.

use super::*;
use crate::testutil::{copy_tree, resctrl_fixture as fixture, simulate_kernel_rmdir};
use std::fs;
use std::path::Path;
use std::time::Instant;

fn settings(tmp: &Path, resctrl_root: PathBuf) -> SamplerSettings {
    SamplerSettings {
        interval: Duration::from_secs(1),
        proc_root: tmp.join("proc"),
        sysfs_root: tmp.join("sys"),
        gpu: GpuChoice::Off,
        emulated_gpu_dir: tmp.join("gpu"),
        perf: false,
        perf_max_fds: 0,
        resctrl_root,
        membw_peak_bytes_per_s: 0,
        cgroup_root: tmp.join("cgroup"),
    }
}

fn sensed(n: u64, pids: &[u32]) -> SensedJob {
    SensedJob {
        id: JobId::from_seq(n),
        pids: pids.to_vec(),
        cgroup: None,
        gpus: Vec::new(),
    }
}

/// One job through the sampler on a copy of `tree`: its group is made and filled, its
/// bandwidth per domain reaches its `JobMetrics`, the group goes when the job leaves and
/// when the sampler is dropped, and a group left by an earlier lodgerd is swept at start.
fn job_bandwidth_through_the_sampler(tree: &str, domains: &[&str]) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("resctrl");
    copy_tree(&fixture(tree), &root);
    for tid in [100, 101] {
        fs::create_dir_all(tmp.path().join(format!("proc/100/task/{tid}"))).expect("proc");
    }
    let stale = root.join("mon_groups/lodger-j7");
    fs::create_dir_all(&stale).expect("stale group");

    let mut sampler = Sampler::open(settings(tmp.path(), root.clone()));
    assert!(!stale.exists(), "swept at start");
    assert_eq!(sampler.sources.membw, "resctrl MBM");
    sampler.set_jobs(vec![sensed(1, &[100])]);
    let j1 = JobId::from_seq(1);
    let group = root.join("mon_groups/lodger-j1");

    let obs = sampler.pass();
    assert_eq!(
        fs::read_to_string(group.join("tasks")).expect("tasks"),
        "100\n101\n"
    );
    assert_eq!(
        obs.jobs[&j1].membw_bytes_per_s, None,
        "no rate from one sample"
    );
    assert!(obs.node.membw_bytes_per_s.is_none());

    // What the kernel does on mkdir: a counter per L3 domain.
    let counter = |d: &str| group.join("mon_data").join(d).join("mbm_total_bytes");
    for d in domains {
        fs::create_dir_all(counter(d).parent().expect("parent")).expect("mon_data");
        fs::write(counter(d), "0\n").expect("counter");
    }
    let before = Instant::now();
    sampler.pass();
    let after = Instant::now();
    // Domain i moves (i + 1) GB.
    for (i, d) in domains.iter().enumerate() {
        fs::write(counter(d), format!("{}\n", (i as u64 + 1) * 1_000_000_000)).expect("add");
    }
    let before_next = Instant::now();
    let obs = sampler.pass();
    let after_next = Instant::now();
    let m = &obs.jobs[&j1];
    let total: f64 = (1..=domains.len()).map(|i| i as f64 * 1e9).sum();
    // The samples were taken inside the passes: the interval lies between these bounds.
    let longest = (after_next - before).as_secs_f64();
    let shortest = (before_next - after).as_secs_f64();
    let bw = m.membw_bytes_per_s.expect("measured");
    assert!(
        bw >= total / longest && bw <= total / shortest,
        "{bw} not within {} ..= {}",
        total / longest,
        total / shortest
    );
    assert_eq!(m.membw_domains.len(), domains.len());
    let first = m.membw_domains[&0];
    for (i, d) in m.membw_domains.values().enumerate() {
        assert!(
            (d / first - (i + 1) as f64).abs() < 1e-9,
            "{:?}",
            m.membw_domains
        );
    }
    assert_eq!(m.membw_unavailable, None);

    // The job leaves: its group goes.
    simulate_kernel_rmdir(&group);
    sampler.set_jobs(Vec::new());
    assert!(!group.exists());
    assert!(!sampler.pass().jobs.contains_key(&j1));

    // lodgerd stops: the sampler's groups go with it.
    sampler.set_jobs(vec![sensed(1, &[100])]);
    sampler.pass();
    assert!(group.is_dir());
    simulate_kernel_rmdir(&group);
    drop(sampler);
    assert!(!group.exists());
}

#[test]
fn per_job_bandwidth_on_the_intel_fixture() {
    job_bandwidth_through_the_sampler("intel-mba-mbm", &["mon_L3_00", "mon_L3_01"]);
}

#[test]
fn per_job_bandwidth_on_the_amd_fixture() {
    job_bandwidth_through_the_sampler("amd", &["mon_L3_00", "mon_L3_01", "mon_L3_02", "mon_L3_03"]);
}

#[test]
fn without_resctrl_job_bandwidth_is_unavailable_and_nothing_is_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("resctrl");
    copy_tree(&fixture("none"), &root);
    fs::create_dir_all(tmp.path().join("proc/100/task/100")).expect("proc");
    let mut sampler = Sampler::open(settings(tmp.path(), root.clone()));
    assert!(
        sampler.sources.membw.starts_with("unavailable: ")
            && sampler.sources.membw.contains("not mounted"),
        "{}",
        sampler.sources.membw
    );
    sampler.set_jobs(vec![sensed(1, &[100])]);
    for _ in 0..2 {
        let obs = sampler.pass();
        let m = obs
            .jobs
            .get(&JobId::from_seq(1))
            .cloned()
            .unwrap_or_default();
        assert_eq!(m.membw_bytes_per_s, None);
        assert!(m.membw_domains.is_empty());
        assert_eq!(obs.node.membw_bytes_per_s, None);
    }
    assert!(!root.join("mon_groups").exists(), "nothing made");
}

/// A worker's sampler whose source is missing measures nothing more, ever (its worker stops
/// sampling); CPU and network are always read, as is a source that opened.
#[test]
fn a_worker_whose_source_is_missing_is_constant() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("resctrl");
    copy_tree(&fixture("none"), &root);
    let only = |kind| Sampler::open_only(settings(tmp.path(), root.clone()), kind);
    for kind in [SourceKind::Perf, SourceKind::Gpu, SourceKind::Membw] {
        assert!(only(kind).constant(), "{kind:?}");
    }
    for kind in [SourceKind::Cpu, SourceKind::Net] {
        assert!(!only(kind).constant(), "{kind:?}");
    }
    assert!(!Sampler::open(settings(tmp.path(), root.clone())).constant());
    let intel = tmp.path().join("intel");
    copy_tree(&fixture("intel-mba-mbm"), &intel);
    assert!(!Sampler::open_only(settings(tmp.path(), intel), SourceKind::Membw).constant());
}

/// Finding 1: without a configured peak the node's bandwidth has no fraction of peak. The
/// highest rate seen is no peak: a steady load (the same bytes every pass) was its own peak,
/// 1.0 every pass, so contention saw pressure forever.
#[test]
fn a_steady_node_without_a_configured_peak_has_no_fraction_of_peak() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("resctrl");
    copy_tree(&fixture("intel-mba-mbm"), &root);
    let counters: Vec<PathBuf> = ["mon_L3_00", "mon_L3_01"]
        .iter()
        .map(|d| root.join("mon_data").join(d).join("mbm_total_bytes"))
        .collect();
    let run = |peak: u64| {
        let mut s = settings(tmp.path(), root.clone());
        s.membw_peak_bytes_per_s = peak;
        let mut sampler = Sampler::open_only(s, SourceKind::Membw);
        let mut fractions = Vec::new();
        for pass in 0..4u64 {
            for c in &counters {
                let base: u64 = fs::read_to_string(c)
                    .expect("counter")
                    .trim()
                    .parse()
                    .expect("bytes");
                fs::write(c, format!("{}\n", base + 5_000_000)).expect("advance");
            }
            let obs = sampler.pass();
            if pass > 0 {
                assert!(obs.node.membw_bytes_per_s.is_some(), "pass {pass}");
                fractions.push(obs.node.membw_fraction_of_peak);
            }
        }
        fractions
    };
    assert_eq!(run(0), [None, None, None]);
    let configured = run(200_000_000_000);
    assert!(
        configured.iter().all(|f| f.is_some_and(|f| f > 0.0)),
        "{configured:?}"
    );
}

fn psi(total_us: u64) -> String {
    format!(
        "some avg10=0.00 avg60=0.00 avg300=0.00 total={total_us}\n\
         full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
}

/// Memory pressure (issue 19) from a fake proc and cgroup v2 tree: the node's from
/// `/proc/pressure/memory`, a job's from its own cgroup's `memory.pressure`, as the share of
/// the pass its `some` total grew by.
#[test]
fn memory_pressure_of_the_node_and_of_a_jobs_cgroup() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let proc = tmp.path().join("proc");
    let cgroup = tmp.path().join("cgroup");
    let job_cg = cgroup.join("slurm/job_1");
    fs::create_dir_all(proc.join("pressure")).expect("proc");
    fs::create_dir_all(proc.join("100")).expect("proc pid");
    fs::create_dir_all(&job_cg).expect("cgroup");
    fs::write(
        proc.join("stat"),
        "cpu  1 0 1 100 0 0 0 0 0 0\ncpu0 1 0 1 100 0 0 0 0 0 0\n",
    )
    .expect("stat");
    fs::write(cgroup.join("cgroup.controllers"), "cpuset cpu memory\n").expect("v2");
    let write = |node: u64, job: u64| {
        fs::write(proc.join("pressure/cpu"), psi(0)).expect("cpu psi");
        fs::write(proc.join("pressure/memory"), psi(node)).expect("memory psi");
        fs::write(job_cg.join("memory.pressure"), psi(job)).expect("job psi");
    };
    write(0, 0);
    let mut sampler = Sampler::open(SamplerSettings {
        interval: Duration::from_secs(1),
        proc_root: proc.clone(),
        sysfs_root: tmp.path().join("sys"),
        gpu: GpuChoice::Off,
        emulated_gpu_dir: tmp.path().join("gpu"),
        perf: false,
        perf_max_fds: 0,
        resctrl_root: tmp.path().join("resctrl"),
        membw_peak_bytes_per_s: 0,
        cgroup_root: cgroup.clone(),
    });
    let mut job = SensedJob {
        id: JobId::from_seq(1),
        pids: vec![100],
        cgroup: Some("/slurm/job_1".into()),
        gpus: Vec::new(),
    };
    sampler.set_jobs(vec![job.clone()]);
    let start = std::time::Instant::now();
    let first = sampler.pass();
    assert_eq!(
        first.node.memory_pressure_percent, None,
        "one sample: no rate"
    );
    std::thread::sleep(Duration::from_millis(200));
    // 40 ms of node stalls and 20 ms of the job's in a pass of at least 200 ms.
    write(40_000, 20_000);
    let obs = sampler.pass();
    let span = start.elapsed().as_secs_f64();
    let node = obs.node.memory_pressure_percent.expect("node");
    let own = obs.jobs[&JobId::from_seq(1)]
        .memory_pressure_percent
        .expect("job");
    assert!(node > 0.0 && node <= 20.0, "{node}");
    // Half the node's stall time over the job's own span: the node's file and the job's are
    // read at slightly different moments, so their spans (each between the 200 ms slept and
    // the whole `span`) may differ by that much and no more.
    let slack = span / 0.2;
    let ratio = own / (node / 2.0);
    assert!(
        ratio <= slack * (1.0 + 1e-6) && ratio >= (1.0 - 1e-6) / slack && own >= 2.0 / span - 1e-6,
        "{own} vs {node} over {span} s"
    );
    // A job without a cgroup of its own has no figure of its own.
    job.cgroup = None;
    sampler.set_jobs(vec![job]);
    write(80_000, 40_000);
    let obs = sampler.pass();
    assert_eq!(obs.jobs[&JobId::from_seq(1)].memory_pressure_percent, None);
}

/// Issue 21: an idle job's processes' CPU time is read every `IDLE_READ_EVERY` passes, the
/// passes between carrying its idle figure; a job that wakes is seen at the next read, a busy
/// job is read every pass, and a job whose processes change is read at once.
#[test]
fn an_idle_jobs_cpu_time_is_read_every_few_passes_and_a_busy_ones_every_pass() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let proc = tmp.path().join("proc");
    for pid in [100, 101] {
        fs::create_dir_all(proc.join(pid.to_string())).expect("proc pid");
    }
    fs::write(proc.join("stat"), "cpu  1 0 1 100 0 0 0 0 0 0\n").expect("stat");
    // utime `ticks`, stime 0, start time 555.
    let ticks = |pid: u32, ticks: u64| {
        fs::write(
            proc.join(format!("{pid}/stat")),
            format!("{pid} (w) S 1 {pid} {pid} 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0 555 0 0\n"),
        )
        .expect("pid stat");
    };
    ticks(100, 100);
    ticks(101, 100);
    let mut sampler = Sampler::open(settings(tmp.path(), tmp.path().join("resctrl")));
    let id = JobId::from_seq(1);
    sampler.set_jobs(vec![sensed(1, &[100])]);
    let pass = |sampler: &mut Sampler| {
        std::thread::sleep(Duration::from_millis(20));
        sampler.pass().jobs[&id].cpu_percent
    };
    assert_eq!(pass(&mut sampler), None, "one read: no rate");
    assert_eq!(pass(&mut sampler), Some(0.0), "idle");
    // It wakes: a tenth of a second of CPU time each pass from now on.
    let mut used = 100;
    let mut seen = Vec::new();
    for _ in 0..IDLE_READ_EVERY + 1 {
        used += 10;
        ticks(100, used);
        seen.push(pass(&mut sampler).expect("a figure every pass"));
    }
    const {
        assert!(
            IDLE_READ_EVERY > 1,
            "idle jobs are read less often than busy ones"
        )
    };
    let carried = (IDLE_READ_EVERY - 1) as usize;
    assert!(
        seen[..carried].iter().all(|p| *p == 0.0),
        "the idle figure is carried until the next read: {seen:?}"
    );
    assert!(
        seen[carried..].iter().all(|p| *p >= IDLE_PERCENT),
        "seen at the next read, and read every pass while busy: {seen:?}"
    );

    // Idle again (read, being busy), then its processes change: read at the next pass, not
    // carried.
    assert_eq!(pass(&mut sampler), Some(0.0), "idle again");
    sampler.set_jobs(vec![sensed(1, &[100, 101])]);
    used += 10;
    ticks(100, used);
    let after = pass(&mut sampler).expect("a figure");
    assert!(
        after >= IDLE_PERCENT,
        "read after its processes changed: {after}"
    );
}

/// NVML that did not answer at start (the driver not loaded yet) is opened again, and GPU
/// sensing comes on when it answers: the worker is not constant meanwhile. A stand-in opener
/// fails once the way a driver not yet loaded does, then gives an emulated source.
#[test]
fn nvml_that_answers_late_is_opened_again() {
    use crate::sense::gpu::{write_emulated_record, EmulatedGpuRecord, EmulatedSource, GpuError};
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("resctrl");
    let mut sampler = Sampler::open_only(settings(tmp.path(), root), SourceKind::Gpu);
    assert!(sampler.constant());
    let me = std::process::id();
    let dir = tmp.path().join("gpu");
    write_emulated_record(&dir, &EmulatedGpuRecord::now(me, 0, 0.5, 10.0)).expect("record");
    let mut tries = 0;
    sampler.reopen_gpu_with(
        Box::new(move || {
            tries += 1;
            if tries == 1 {
                return Err(GpuError::NvmlUnavailable {
                    library: "libnvidia-ml.so.1".into(),
                    reason: "the NVIDIA kernel driver is not loaded".into(),
                    lasting: false,
                });
            }
            Ok(Box::new(EmulatedSource::new(&dir, "/proc")) as Box<dyn GpuSource>)
        }),
        Duration::ZERO,
    );
    assert!(
        !sampler.constant(),
        "a source that may answer later is sampled on"
    );
    sampler.set_jobs(vec![sensed(1, &[me])]);

    let obs = sampler.pass();
    assert!(
        obs.sources.gpu.contains("driver is not loaded"),
        "{}",
        obs.sources.gpu
    );
    assert!(!sampler.constant());
    // Nothing to read until the next try: its worker sleeps until then.
    assert!(
        sampler.quiet_until().is_some(),
        "a worker waiting to open NVML again woke every interval"
    );

    let obs = sampler.pass();
    assert!(
        obs.sources.gpu.starts_with("emulated"),
        "{}",
        obs.sources.gpu
    );
    assert_eq!(obs.node.gpus.len(), 1);
    assert_eq!(obs.jobs[&JobId::from_seq(1)].gpu_percent, Some(50.0));
    assert!(!sampler.constant());
    assert_eq!(
        sampler.quiet_until(),
        None,
        "sampled every interval once it answers"
    );
}

/// Counters that refuse every attach with the error they hold.
struct Refusing(fn(&JobId) -> crate::sense::perf::PerfError);

impl Counters for Refusing {
    fn attach(
        &mut self,
        job: &JobId,
        _: &PerfTarget,
    ) -> Result<crate::sense::perf::Attached, crate::sense::perf::PerfError> {
        Err((self.0)(job))
    }
    fn detach(&mut self, _: &JobId) -> bool {
        false
    }
    fn read(&mut self) -> Vec<(JobId, PerfSample)> {
        Vec::new()
    }
    fn status(&self) -> crate::sense::perf::PerfStatus {
        crate::sense::perf::ScriptedCounters::default().status()
    }
}

#[test]
fn a_perf_refusal_is_logged_once_per_job_and_error_though_the_attach_is_tried_again() {
    use crate::sense::perf::{PerfError, ScriptedCounters};
    let mut job = Tracked::new(sensed(1, &[100]));
    let gone = |job: &JobId| PerfError::TargetGone {
        job: job.clone(),
        target: "pids 100".into(),
    };
    let mut refusing = Refusing(gone);
    let first = attach_perf(&mut job, &mut refusing).expect("the first refusal is logged");
    assert!(first.contains("no process"), "{first}");
    // The job list changed (another job came): the attach is tried again, the same refusal
    // is not logged again.
    for _ in 0..3 {
        assert_eq!(attach_perf(&mut job, &mut refusing), None);
    }
    let budget = |job: &JobId| PerfError::FdBudget {
        job: job.clone(),
        target: "pids 100".into(),
        needed: 8,
        available: 2,
        cap: 10,
    };
    let mut other = Refusing(budget);
    assert!(attach_perf(&mut job, &mut other).is_some(), "another error");
    assert_eq!(attach_perf(&mut job, &mut other), None);
    // Opened at last: a later refusal is news again.
    let mut scripted = ScriptedCounters::default();
    assert_eq!(attach_perf(&mut job, &mut scripted), None);
    assert_eq!(job.perf_pids, vec![100]);
    assert!(attach_perf(&mut job, &mut other).is_some());
}

/// A network pass that failed as a whole (no readable `class/net`, a counter that is not a
/// number) was dropped without a word and `sources.net` still said "sysfs". Now the status says
/// it is failing and why, each distinct error is logged once, and the recovery once.
#[test]
fn a_failing_network_pass_is_said_in_the_source_status() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut sampler = Sampler::open_only(
        settings(tmp.path(), tmp.path().join("resctrl")),
        SourceKind::Net,
    );
    let class_net = tmp.path().join("sys/class/net");
    let obs = sampler.pass();
    assert!(
        obs.sources.net.starts_with("failing: cannot read ")
            && obs.sources.net.contains("class/net"),
        "{}",
        obs.sources.net
    );
    let stats = class_net.join("eth0/statistics");
    fs::create_dir_all(&stats).expect("class/net/eth0");
    fs::write(stats.join("rx_bytes"), "1000\n").expect("rx_bytes");
    fs::write(stats.join("tx_bytes"), "2000\n").expect("tx_bytes");
    assert_eq!(sampler.pass().sources.net, "sysfs");
    fs::write(stats.join("rx_bytes"), "lots\n").expect("rx_bytes");
    let obs = sampler.pass();
    assert!(
        obs.sources.net.starts_with("failing: ") && obs.sources.net.contains("'lots'"),
        "{}",
        obs.sources.net
    );
    assert!(obs.node.net.is_empty());
    fs::write(stats.join("rx_bytes"), "3000\n").expect("rx_bytes");
    fs::write(stats.join("tx_bytes"), "4000\n").expect("tx_bytes");
    let obs = sampler.pass();
    assert_eq!(obs.sources.net, "sysfs");
    assert_eq!(
        obs.node.net.len(),
        1,
        "rates again, from the last good sample"
    );
}

/// The log lines of a failing network source: one per distinct error, one at the recovery.
#[test]
fn a_network_failure_is_news_once_per_error_and_once_when_over() {
    let unreadable = net::NetError::Io {
        path: PathBuf::from("/sys/class/net"),
        source: std::io::Error::from_raw_os_error(5),
    };
    let garbled = net::NetError::Parse {
        path: PathBuf::from("/sys/class/net/eth0/statistics/rx_bytes"),
        value: "lots".into(),
        reason: "is not a number".into(),
    };
    let mut failing = None;
    let first = net_news(&mut failing, Some(&unreadable));
    assert!(
        matches!(&first, Some(NetNews::Failing(e)) if e.contains("/sys/class/net")),
        "{first:?}"
    );
    assert_eq!(net_news(&mut failing, Some(&unreadable)), None);
    assert_eq!(net_news(&mut failing, Some(&unreadable)), None);
    assert!(matches!(
        net_news(&mut failing, Some(&garbled)),
        Some(NetNews::Failing(e)) if e.contains("'lots'")
    ));
    assert!(matches!(
        net_news(&mut failing, None),
        Some(NetNews::Recovered(e)) if e.contains("'lots'")
    ));
    assert_eq!(failing, None);
    assert_eq!(net_news(&mut failing, None), None);
}
