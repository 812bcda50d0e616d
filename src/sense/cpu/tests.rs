//! Tests of CPU sensing: /proc/stat, per-job CPU time and PSI parsing, and rates between samples.

use super::*;
use std::fs;

const STAT: &str = "cpu  164344 10 22506 161090 1482 0 279 33 0 0\n\
cpu0 80507 5 10790 82964 525 0 31 15 0 0\n\
cpu2 83837 5 11716 78126 957 0 248 18 0 0\n\
intr 1476172 0 0\n\
ctxt 3140420\n\
btime 1700000000\n\
processes 4242\n\
procs_running 3\n\
procs_blocked 0\n";

fn write(dir: &Path, rel: &str, content: &str) -> PathBuf {
    let path = dir.join(rel);
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(&path, content).expect("write");
    path
}

fn t0() -> Instant {
    Instant::now()
}

#[test]
fn proc_stat_keeps_cpu_numbers() {
    let s = parse_proc_stat(STAT, t0()).expect("parses");
    assert_eq!(s.all.user, 164344);
    assert_eq!(s.all.nice, 10);
    assert_eq!(s.all.steal, 33);
    assert_eq!(s.cpus.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 2]);
    assert_eq!(s.procs_running, Some(3));
    // A 2.4-era line with only four fields.
    let old = parse_proc_stat("cpu 1 2 3 4\n", t0()).expect("parses");
    assert_eq!(old.all.idle, 4);
    assert_eq!(old.all.iowait, 0);
}

#[test]
fn proc_stat_fixture_success_failure_empty_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = CpuReader::with_ticks_per_second(dir.path(), 100);
    assert!(matches!(r.stat(), Err(CpuError::Read { .. })), "missing");
    assert!(r.stat().unwrap_err().is_not_found());
    write(dir.path(), PROC_STAT, "");
    assert!(matches!(r.stat(), Err(CpuError::Empty { .. })), "empty");
    write(dir.path(), PROC_STAT, "cpu 1 2 x 4\n");
    match r.stat() {
        Err(CpuError::Parse { path, value }) => {
            assert_eq!(path, dir.path().join(PROC_STAT));
            assert_eq!(value, "cpu 1 2 x 4");
        }
        other => panic!("{other:?}"),
    }
    write(dir.path(), PROC_STAT, "cpu0 1 2 3 4\n");
    assert!(matches!(r.stat(), Err(CpuError::Parse { .. })), "no total");
    write(dir.path(), PROC_STAT, "cpuX 1 2 3 4\ncpu 1 2 3 4\n");
    assert!(matches!(r.stat(), Err(CpuError::Parse { .. })), "bad id");
    write(dir.path(), PROC_STAT, STAT);
    let s = r.stat().expect("reads");
    assert_eq!(s.cpus.len(), 2);
    assert_eq!(s.procs_running, Some(3));
}

#[test]
fn utilization_from_two_samples() {
    let at = t0();
    let prev = StatSample {
        at,
        all: CpuTimes {
            user: 100,
            idle: 100,
            ..Default::default()
        },
        cpus: vec![
            (0, CpuTimes::default()),
            (1, CpuTimes::default()),
            (5, CpuTimes::default()),
        ],
        procs_running: Some(1),
    };
    let cur = StatSample {
        at: at + Duration::from_secs(1),
        all: CpuTimes {
            user: 150,
            system: 20,
            idle: 120,
            iowait: 0,
            steal: 10,
            ..Default::default()
        },
        cpus: vec![
            (
                0,
                CpuTimes {
                    user: 75,
                    idle: 25,
                    ..Default::default()
                },
            ),
            (1, CpuTimes::default()),
            // CPU 5 went offline, CPU 7 came online.
            (7, CpuTimes::default()),
        ],
        procs_running: Some(4),
    };
    let r = NodeCpuRates::between(&prev, &cur).expect("ordered");
    let all = r.all.expect("ticks elapsed");
    // Δ: user 50, system 20, idle 20, steal 10 → 100 ticks.
    assert!((all.busy - 0.7).abs() < 1e-9);
    assert!((all.user - 0.5).abs() < 1e-9);
    assert!((all.system - 0.2).abs() < 1e-9);
    assert!((all.steal - 0.1).abs() < 1e-9);
    assert_eq!(r.cpus.len(), 2);
    assert_eq!(r.cpus[0].0, 0);
    assert!((r.cpus[0].1.expect("cpu0").busy - 0.75).abs() < 1e-9);
    // No tick elapsed on CPU 1: unknown, not NaN.
    assert_eq!(r.cpus[1], (1, None));
    assert_eq!(r.procs_running, Some(4));
    assert!(NodeCpuRates::between(&cur, &prev).is_none());
    assert!(NodeCpuRates::between(&prev, &prev).is_none());
}

#[test]
fn utilization_survives_iowait_going_backwards() {
    let prev = CpuTimes {
        user: 10,
        idle: 100,
        iowait: 50,
        ..Default::default()
    };
    let cur = CpuTimes {
        user: 20,
        idle: 110,
        iowait: 40,
        ..Default::default()
    };
    let u = utilization(&prev, &cur).expect("ticks");
    assert!((u.busy - 0.5).abs() < 1e-9);
    assert_eq!(u.iowait, 0.0);
}

#[test]
fn pid_stat_fields() {
    // utime 1000, stime 234, starttime 98765; the name has spaces and parentheses.
    let line = b"1234 (a) b (c)) S 77 1234 1234 0 -1 4194560 100 0 0 0 1000 234 7 8 20 0 3 0 98765 1000 10";
    assert_eq!(parse_pid_stat(line), Some((1234, 98765)));
    assert_eq!(parse_pid_stat(b""), None);
    assert_eq!(parse_pid_stat(b"1 (x) S 1 2 3"), None);
    assert_eq!(
        parse_pid_stat(b"1 (x) S 77 1 1 0 -1 0 0 0 0 0 x 234 0 0 20 0 3 0 5"),
        None
    );
}

#[test]
fn process_cpu_fixture() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(
        dir.path(),
        "10/stat",
        "10 (train er) R 1 10 10 0 -1 0 0 0 0 0 300 100 0 0 20 0 4 0 555 0 0\n",
    );
    write(
        dir.path(),
        "11/stat",
        "11 (w) S 10 10 10 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 556 0 0\n",
    );
    let mut r = CpuReader::with_ticks_per_second(dir.path(), 100);
    // 12 is gone: left out, not an error.
    let s = r.processes(&[11, 10, 12, 10]).expect("reads");
    let JobCpuUsage::Processes(ps) = &s.usage else {
        panic!("kind")
    };
    assert_eq!(
        ps,
        &vec![
            ProcessCpu {
                pid: 10,
                start_time: 555,
                cpu_ns: 4_000_000_000
            },
            ProcessCpu {
                pid: 11,
                start_time: 556,
                cpu_ns: 20_000_000
            },
        ]
    );
    write(dir.path(), "13/stat", "13 (broken");
    match r.processes(&[13]) {
        Err(CpuError::Parse { path, .. }) => assert_eq!(path, dir.path().join("13/stat")),
        other => panic!("{other:?}"),
    }
    write(dir.path(), "14/stat", "");
    assert!(matches!(r.processes(&[14]), Err(CpuError::Parse { .. })));
}

fn procs(at: Instant, list: &[(u32, u64, u64)]) -> JobCpuSample {
    JobCpuSample {
        at,
        usage: JobCpuUsage::Processes(
            list.iter()
                .map(|&(pid, start_time, cpu_ns)| ProcessCpu {
                    pid,
                    start_time,
                    cpu_ns,
                })
                .collect(),
        ),
    }
}

#[test]
fn job_cpu_rate_from_processes() {
    let at = t0();
    let s = Duration::from_secs(2);
    let prev = procs(at, &[(10, 1, 1_000_000_000), (11, 1, 0), (12, 1, 5)]);
    // 10 used 3 s; 11 was replaced by a new process with the same pid; 12 exited; 13 is new.
    let cur = procs(
        at + s,
        &[
            (10, 1, 4_000_000_000),
            (11, 9, 7_000_000_000),
            (13, 1, 9_000),
        ],
    );
    let r = JobCpuRate::between(&prev, &cur).expect("rate");
    assert_eq!(r.cpu, Duration::from_secs(3));
    assert!((r.cores - 1.5).abs() < 1e-9);
    // Nothing in common: unknown.
    let other = procs(at + s, &[(20, 1, 1)]);
    assert!(JobCpuRate::between(&prev, &other).is_none());
    // Zero time: unknown, not infinite.
    assert!(JobCpuRate::between(&prev, &prev).is_none());
    // A counter going back within one process is a zero delta, not a wrap.
    let back = procs(at + s, &[(10, 1, 0)]);
    assert_eq!(JobCpuRate::between(&prev, &back).expect("rate").cores, 0.0);
}

#[test]
fn job_cpu_rate_from_cgroup() {
    let at = t0();
    let s = Duration::from_secs(1);
    let cg = |at, usage_ns, inode| JobCpuSample {
        at,
        usage: JobCpuUsage::Cgroup { usage_ns, inode },
    };
    let r = JobCpuRate::between(&cg(at, 1_000, 7), &cg(at + s, 500_001_000, 7)).expect("rate");
    assert!((r.cores - 0.5).abs() < 1e-9);
    // Recreated cgroup (new inode) or a reset counter: dropped.
    assert!(JobCpuRate::between(&cg(at, 1_000, 7), &cg(at + s, 5_000, 8)).is_none());
    assert!(JobCpuRate::between(&cg(at, 9_000, 7), &cg(at + s, 5_000, 7)).is_none());
    // Mixed kinds: dropped.
    assert!(JobCpuRate::between(&cg(at, 0, 7), &procs(at + s, &[])).is_none());
}

#[test]
fn pressure_parsing() {
    let p = parse_pressure(
        "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\n\
         full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    )
    .expect("parses");
    assert_eq!(p.some.total_us, 123456);
    assert!((p.some.avg10 - 1.5).abs() < 1e-9);
    assert_eq!(p.full.map(|f| f.total_us), Some(0));
    // Before 5.13 the cpu file had only the some line.
    let old = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=42\n").expect("old");
    assert_eq!(old.full, None);
    assert!(parse_pressure("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n").is_err());
    assert!(parse_pressure("some avg10=x avg60=0.00 avg300=0.00 total=1\n").is_err());
    assert!(parse_pressure("some avg10=0.00 avg60=0.00 total=1\n").is_err());
    assert!(parse_pressure("weird avg10=0 avg60=0 avg300=0 total=1\n").is_err());
}

#[test]
fn pressure_fixture_success_failure_empty_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = CpuReader::with_ticks_per_second(dir.path(), 100);
    assert!(r.pressure().expect("absent is fine").is_none());
    write(dir.path(), PROC_PRESSURE_CPU, "");
    assert!(matches!(r.pressure(), Err(CpuError::Empty { .. })));
    write(dir.path(), PROC_PRESSURE_CPU, "some total=1\n");
    match r.pressure() {
        Err(CpuError::Parse { path, .. }) => {
            assert_eq!(path, dir.path().join(PROC_PRESSURE_CPU))
        }
        other => panic!("{other:?}"),
    }
    write(
        dir.path(),
        PROC_PRESSURE_CPU,
        "some avg10=99.53 avg60=79.35 avg300=57.35 total=479046187\n\
         full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    );
    let s = r.pressure().expect("reads").expect("present");
    assert_eq!(s.pressure.some.total_us, 479046187);
}

#[test]
fn stall_rates() {
    let at = t0();
    let sample = |at, some, full: Option<u64>| PressureSample {
        at,
        pressure: Pressure {
            some: PsiLine {
                total_us: some,
                ..Default::default()
            },
            full: full.map(|total_us| PsiLine {
                total_us,
                ..Default::default()
            }),
        },
    };
    let r = StallRates::between(
        &sample(at, 1_000_000, Some(0)),
        &sample(at + Duration::from_secs(2), 1_500_000, Some(200_000)),
    )
    .expect("rate");
    assert!((r.some - 0.25).abs() < 1e-9);
    assert!((r.full.expect("full") - 0.1).abs() < 1e-9);
    let none_full = StallRates::between(
        &sample(at, 0, None),
        &sample(at + Duration::from_secs(1), 3_000_000, None),
    )
    .expect("rate");
    assert_eq!(none_full.some, 1.0, "clamped");
    assert_eq!(none_full.full, None);
    assert!(StallRates::between(
        &sample(at, 5, None),
        &sample(at + Duration::from_secs(1), 4, None)
    )
    .is_none());
    assert!(StallRates::between(&sample(at, 0, None), &sample(at, 1, None)).is_none());
}

#[test]
fn cgroup_v1_fixture() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = CgroupCpuReader::new(dir.path(), CgroupVersion::V1);
    let err = r.usage("/slurm/job_1").unwrap_err();
    assert!(err.is_not_found(), "{err}");
    let file = write(dir.path(), "cpuacct/slurm/job_1/cpuacct.usage", "");
    assert!(matches!(
        r.usage("/slurm/job_1"),
        Err(CpuError::Empty { .. })
    ));
    fs::write(&file, "12x\n").expect("write");
    match r.usage("slurm/job_1") {
        Err(CpuError::Parse { path, value }) => {
            assert_eq!(path, file);
            assert_eq!(value, "12x\n");
        }
        other => panic!("{other:?}"),
    }
    fs::write(&file, "123456789\n").expect("write");
    let s = r.usage("/slurm/job_1").expect("reads");
    assert!(matches!(
        s.usage,
        JobCpuUsage::Cgroup {
            usage_ns: 123456789,
            ..
        }
    ));
    // v1 has no per-cgroup PSI here.
    assert!(r.pressure("/slurm/job_1").expect("absent").is_none());
    assert!(matches!(r.usage("/a/../b"), Err(CpuError::BadCgroup(_))));
}

#[test]
fn cgroup_v2_fixture() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = CgroupCpuReader::new(dir.path(), CgroupVersion::V2);
    assert!(r.usage("/job").unwrap_err().is_not_found());
    let stat = write(dir.path(), "job/cpu.stat", "");
    assert!(matches!(r.usage("/job"), Err(CpuError::Empty { .. })));
    fs::write(&stat, "user_usec 5\nsystem_usec 6\n").expect("write");
    assert!(matches!(r.usage("/job"), Err(CpuError::Parse { .. })));
    fs::write(
        &stat,
        "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\nnr_periods 0\n",
    )
    .expect("write");
    let s = r.usage("/job").expect("reads");
    assert!(matches!(
        s.usage,
        JobCpuUsage::Cgroup {
            usage_ns: 2_500_000,
            ..
        }
    ));
    assert!(r.pressure("/job").expect("absent").is_none());
    let psi = write(dir.path(), "job/cpu.pressure", "");
    assert!(matches!(r.pressure("/job"), Err(CpuError::Empty { .. })));
    fs::write(&psi, "garbage\n").expect("write");
    assert!(matches!(r.pressure("/job"), Err(CpuError::Parse { .. })));
    fs::write(
        &psi,
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=77\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n",
    )
    .expect("write");
    let p = r.pressure("/job").expect("reads").expect("present");
    assert_eq!(p.pressure.full.map(|f| f.total_us), Some(7));
}

#[test]
fn reads_this_machine() {
    let mut r = CpuReader::new(Path::new("/proc"));
    let a = r.stat().expect("/proc/stat");
    assert!(!a.cpus.is_empty());
    let me = std::process::id();
    let p1 = r.processes(&[me]).expect("own stat");
    // Burn 60 ms of this thread's CPU time (not of wall time: the machine may be busy).
    let thread_ns = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write to.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    let start = thread_ns();
    let mut x = 0u64;
    while thread_ns() < start + 60_000_000 {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
    }
    let p2 = r.processes(&[me]).expect("own stat");
    let rate = JobCpuRate::between(&p1, &p2).expect("rate");
    // Read from the process's clock (nanoseconds), not in 10-ms ticks: the 60 ms burnt show.
    let after = crate::sys::procfs::process_cpu_ns(me).expect("own clock");
    let JobCpuUsage::Processes(two) = &p2.usage else {
        panic!("per process");
    };
    assert!(two[0].cpu_ns <= after, "{} > {after}", two[0].cpu_ns);
    assert!(rate.cpu >= Duration::from_millis(60), "{:?}", rate.cpu);
    let b = r.stat().expect("/proc/stat");
    assert!(NodeCpuRates::between(&a, &b).is_some());
    // PSI may or may not exist; either answer is fine, an error is not.
    r.pressure().expect("psi read");
}
