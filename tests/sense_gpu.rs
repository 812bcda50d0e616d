//! The emulated GPU source against the real training emulator: it publishes, lodger's
//! `EmulatedSource` reads it, and the busy fraction it reports falls when the emulator's CPU side
//! is starved of its core. Needs no privileges: CPU affinity of one's own processes is enough.

mod common;

use common::wait_ready;
use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use lodger::sense::gpu::{
    emulated_record_path, job_utilization, EmulatedSource, GpuSource, GpuSourceKind, Ignored,
    EMULATED_DEVICE_NAME, EMULATED_GPU_DIR_ENV,
};
use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A train_emulator child whose output is drained, killed on drop.
struct Emulator {
    child: Child,
}

impl Emulator {
    /// Starts the emulator with `args`, optionally pinned (all its threads) to one CPU, and
    /// waits for its `ready` line.
    fn start(args: &[&str], env_dir: Option<&Path>, cpu: Option<usize>) -> Emulator {
        let mut cmd = Command::new(common::example("train_emulator"));
        cmd.args(args)
            .env_remove(EMULATED_GPU_DIR_ENV)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(dir) = env_dir {
            cmd.env(EMULATED_GPU_DIR_ENV, dir);
        }
        if let Some(cpu) = cpu {
            let mut set = CpuSet::new();
            set.set(cpu).expect("cpu id within CpuSet");
            // SAFETY: between fork and exec the closure only makes the sched_setaffinity
            // syscall on the child itself with a set built before the fork; it allocates
            // nothing and takes no locks.
            unsafe {
                cmd.pre_exec(move || {
                    sched_setaffinity(Pid::from_raw(0), &set).map_err(std::io::Error::from)
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn train_emulator");
        wait_ready(&mut child, "train_emulator");
        Emulator { child }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: Signal) {
        let pid = i32::try_from(self.pid()).expect("pid fits i32");
        kill(Pid::from_raw(pid), sig).expect("signal emulator");
    }

    fn wait(&mut self) {
        let _ = self.child.wait();
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Threads spinning on one CPU until dropped.
struct CpuHog {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl CpuHog {
    fn start(cpu: usize, threads: usize) -> CpuHog {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                thread::spawn(move || {
                    let mut set = CpuSet::new();
                    set.set(cpu).expect("cpu id within CpuSet");
                    // Pid 0: the calling thread only.
                    sched_setaffinity(Pid::from_raw(0), &set).expect("pin hog thread");
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        CpuHog { stop, threads }
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The last CPU this test may run on.
fn last_allowed_cpu() -> usize {
    let set = sched_getaffinity(Pid::from_raw(0)).expect("own affinity");
    (0..CpuSet::count())
        .rev()
        .find(|&c| set.is_set(c).unwrap_or(false))
        .expect("at least one allowed CPU")
}

/// Reads the emulator's busy fraction through `EmulatedSource` once a second, `n` times; returns
/// the median.
fn median_busy(source: &mut EmulatedSource, pid: u32, n: usize) -> f64 {
    let mut values = Vec::new();
    for _ in 0..n {
        thread::sleep(Duration::from_secs(1));
        let s = source.sample().expect("sample emulated source");
        assert_eq!(s.source, GpuSourceKind::Emulated);
        let job = job_utilization(&s, &BTreeSet::from([pid]));
        if let Some(busy) = job.per_gpu.get(&0) {
            values.push(*busy);
        }
    }
    assert!(
        values.len() * 2 > n,
        "the emulator's record was missing from most samples: {values:?}"
    );
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[test]
fn emulated_busy_drops_when_the_cpu_side_is_starved() {
    let _measuring = common::measuring();
    let dir = tempfile::tempdir().expect("tempdir");
    let cpu = last_allowed_cpu();
    // One loader needing 40 ms of CPU per batch feeding a 10 ms GPU step: data-bound, so the
    // emulated GPU's busy fraction follows how much CPU the loader gets.
    let publish = dir.path().to_str().expect("utf-8 tempdir").to_string();
    let emulator = Emulator::start(
        &[
            "--workers",
            "1",
            "--batch-cpu-ms",
            "40",
            "--gpu-step-ms",
            "10",
            "--publish-dir",
            &publish,
        ],
        None,
        Some(cpu),
    );
    let pid = emulator.pid();
    let mut source = EmulatedSource::new(dir.path(), "/proc");
    common::wait_until(common::WAIT, "the emulator's first record", || {
        emulated_record_path(dir.path(), pid).exists()
    });
    let first = source.sample().expect("sample");
    assert_eq!(first.devices.len(), 1);
    assert_eq!(first.devices[0].name.as_deref(), Some(EMULATED_DEVICE_NAME));
    assert!(first.status().to_string().starts_with("emulated"));

    // Settle one window, then measure alone.
    thread::sleep(Duration::from_secs(1));
    let alone = median_busy(&mut source, pid, 5);
    // Two spinning threads on the same CPU leave the loader about a third of it.
    let starved = {
        let _hog = CpuHog::start(cpu, 2);
        thread::sleep(Duration::from_secs(2));
        median_busy(&mut source, pid, 5)
    };
    eprintln!("emulated GPU busy on CPU {cpu}: alone {alone:.3}, starved {starved:.3}");
    assert!(alone > 0.0, "the emulator made no progress alone");
    assert!(
        starved < alone * 0.75,
        "busy did not fall when the CPU side was starved: alone {alone:.3}, starved {starved:.3}"
    );

    // SIGTERM: the emulator removes its record on the way out.
    let mut emulator = emulator;
    emulator.signal(Signal::SIGTERM);
    emulator.wait();
    assert!(!emulated_record_path(dir.path(), pid).exists());
    let after = source.sample().expect("sample after exit");
    assert!(after.processes.is_empty());
}

#[test]
fn env_dir_gpu_index_and_a_killed_emulator() {
    let _measuring = common::measuring();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut emulator = Emulator::start(
        &["--workers", "1", "--gpu-step-ms", "5", "--gpu", "3"],
        Some(dir.path()),
        None,
    );
    let pid = emulator.pid();
    let record = emulated_record_path(dir.path(), pid);
    common::wait_until(common::WAIT, "a record in $LODGER_EMULATED_GPU_DIR", || {
        record.exists()
    });
    let mut source = EmulatedSource::new(dir.path(), "/proc");
    let s = source.sample().expect("sample");
    assert_eq!(s.processes.len(), 1);
    assert_eq!(s.processes[0].pid, pid);
    assert_eq!(s.processes[0].gpu, 3);
    assert_eq!(s.devices[0].index, 3);

    // SIGKILL leaves the record behind; the reader sees the pid is gone and ignores it.
    emulator.signal(Signal::SIGKILL);
    emulator.wait();
    assert!(record.exists(), "SIGKILL cannot clean up");
    let s = source.sample().expect("sample after kill");
    assert!(s.processes.is_empty());
    assert_eq!(source.ignored().len(), 1);
    assert_eq!(source.ignored()[0].why, Ignored::ProcessGone { pid });
}
