//! Workloads the tests run beside lodgerd: the training emulator, a real-time antagonist, and the
//! right-size tests' premise checks (how busy the emulator is on one core and on two, here, now).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{example, pin_threads, tids, wait_ready};

/// The emulator's arguments for a light loader: 2 ms of CPU per 100-ms GPU step
/// ([`Workload::light`]).
pub const LIGHT: &[&str] = &["--batch-cpu-ms", "2", "--gpu-step-ms", "100"];

/// A running training emulator with `workers` preprocessing threads.
pub struct Workload {
    pub child: Child,
}

impl Workload {
    pub fn train(workers: u32) -> Workload {
        Self::train_with(workers, &[])
    }

    /// One loader thread whose batches cost 2 ms of CPU per 100-ms GPU step: far below the RT
    /// limit even on a slow host. Under emulation (the VM's run of this suite) the default
    /// workload measures 90-95 % of its CPU, and the RT guard then grows the job by a core
    /// (tests/rt_guard.rs), moving the CPUs a test watches.
    pub fn light() -> Workload {
        Self::train_with(1, LIGHT)
    }

    /// The emulator with more arguments (e.g. `--publish-dir DIR`); a 20-ms GPU step unless
    /// they name one.
    pub fn train_with(workers: u32, extra: &[&str]) -> Workload {
        let step: &[&str] = if extra.contains(&"--gpu-step-ms") {
            &[]
        } else {
            &["--gpu-step-ms", "20"]
        };
        let mut child = Command::new(example("train_emulator"))
            .args(["--workers", &workers.to_string()])
            .args(step)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn train_emulator");
        wait_ready(&mut child, "train_emulator");
        Workload { child }
    }

    /// A process the test spawned itself, killed and reaped when dropped like any workload (a
    /// failed assertion included), so that a failing test leaves nothing running.
    pub fn adopt(child: std::process::Child) -> Workload {
        Workload { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = i32::try_from(self.pid()).expect("pid");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).expect("kill");
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A real-time thread outside lodger's control that takes `busy_percent` of one CPU at an RT
/// priority above training's: it spins (integer arithmetic, real work) for that share of every
/// 10 ms and sleeps the rest, as a periodic RT task (an IRQ thread, a clock-sync daemon) would.
/// SCHED_RR protects training from lodgers but not from this, so it slows a training job for
/// real. Stopped (and joined) on drop.
pub struct RtAntagonist {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Its thread id, for diagnostics (`thread_state`).
    pub tid: u32,
}

impl RtAntagonist {
    pub fn start(cpu: u32, priority: i32, busy_percent: u32) -> RtAntagonist {
        use std::sync::atomic::AtomicBool;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("rt-antagonist".into())
            .spawn(move || {
                let mut set = nix::sched::CpuSet::new();
                let placed = usize::try_from(cpu)
                    .map_err(|e| e.to_string())
                    .and_then(|c| set.set(c).map_err(|e| e.to_string()))
                    .and_then(|()| {
                        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                            .map_err(|e| e.to_string())
                    });
                let param = libc::sched_param {
                    sched_priority: priority,
                };
                // SAFETY: sets the calling thread's (tid 0) policy with a valid sched_param.
                let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_RR, &param) };
                let result = placed.and_then(|()| {
                    if rc == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error().to_string())
                    }
                });
                let ok = result.is_ok();
                let _ = ready_tx.send(result.map(|()| nix::unistd::gettid().as_raw()));
                if !ok {
                    return;
                }
                let period = Duration::from_millis(10);
                let busy = period * busy_percent.min(100) / 100;
                let mut x: u64 = 1;
                while !flag.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    while start.elapsed() < busy {
                        for _ in 0..1000 {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                    }
                    if let Some(rest) = period.checked_sub(start.elapsed()) {
                        std::thread::sleep(rest);
                    }
                }
            })
            .expect("spawn the RT antagonist");
        let tid = ready_rx
            .recv()
            .expect("RT antagonist thread")
            .unwrap_or_else(|e| panic!("RT antagonist on CPU {cpu} at RR {priority}: {e}"));
        RtAntagonist {
            stop,
            thread: Some(thread),
            tid: u32::try_from(tid).expect("tid"),
        }
    }
}

impl Drop for RtAntagonist {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// CPU per batch (ms, `--batch-cpu-ms`) of the grow tests' two loaders: one core gives the
/// 20 ms GPU step about 20/45 of its time, two about 20/22.5. At 30 ms (two-thirds against
/// full) a CI run's emulator, calibrated while its host was slow, did 22 ms batches and showed
/// 89.5 % on one core: within the right-sizer's noise of two.
pub const STARVING_BATCH_CPU_MS: &str = "45";

/// The training emulator's (`workers` loaders, `args`) published GPU busy fraction on this
/// machine now, without lodger: SCHED_RR, as lodger runs training, so other load on the machine
/// does not count; pinned by affinity to `cpus[0]` for a few seconds, then to both. The right-size
/// tests check their premise with it when lodger's answer disagrees with the test's, so that a
/// machine where the premise does not hold is a hardware skip with the figures, and one where it
/// holds is a failure. Stop SCHED_RR work on `cpus` first.
pub fn busy_on_one_and_two(workers: u32, args: &[&str], cpus: [u32; 2]) -> (f64, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut all: Vec<&str> = args.to_vec();
    let publish = dir.path().display().to_string();
    all.extend(["--publish-dir", publish.as_str()]);
    let w = Workload::train_with(workers, &all);
    let record = dir.path().join(format!("{}.json", w.pid()));
    for tid in tids(w.pid()) {
        let param = libc::sched_param { sched_priority: 10 };
        // SAFETY: sched_setscheduler with a valid sched_param that outlives the call; a thread
        // that exited meanwhile only makes it fail.
        unsafe { libc::sched_setscheduler(tid as libc::pid_t, libc::SCHED_RR, &param) };
    }
    let busy_on = |on: &[u32]| -> f64 {
        pin_threads(w.pid(), on);
        std::thread::sleep(Duration::from_secs(4));
        std::fs::read_to_string(&record)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["busy"].as_f64())
            .unwrap_or(0.0)
    };
    let one = busy_on(&cpus[..1]);
    let two = busy_on(&cpus);
    (one, two)
}

/// Whether a second core makes the emulator busier here now (`busy_on_one_and_two`): `Err` with
/// the figures when two CPUs do not make it at least 1.35 times as busy (the grow tests'
/// workload can gain about 2 times: two cores make it nearly GPU-bound; at 30 ms batches this
/// 2-CPU host, loaded, measured 0.60 -> 0.94), as on an emulated guest whose vCPUs share fewer,
/// loaded host CPUs: there the gain is within the noise a right-sizer must ignore, and one core
/// is rightly enough.
pub fn second_core_speeds_up(workers: u32, args: &[&str], cpus: [u32; 2]) -> Result<(), String> {
    let (one, two) = busy_on_one_and_two(workers, args, cpus);
    if two >= 1.35 * one && two > 0.0 {
        Ok(())
    } else {
        Err(format!(
            "a second CPU barely speeds the emulator up here ({}, under 1.35x): this machine's \
             CPUs do not run independently (an emulated guest's vCPUs sharing fewer host CPUs)",
            busy_figures(one, two, cpus)
        ))
    }
}

/// Whether one core keeps the emulator as busy as two here now (`busy_on_one_and_two`): `Err`
/// with the figures when one CPU leaves it more than `points` percentage points less busy (the
/// smallest change the daemon under test counts, `rightsize.min_change_percent`), as where the
/// CPUs are too slow for the workload: there a second core is rightly kept.
pub fn one_core_suffices(
    workers: u32,
    args: &[&str],
    cpus: [u32; 2],
    points: f64,
) -> Result<(), String> {
    let (one, two) = busy_on_one_and_two(workers, args, cpus);
    if 100.0 * (two - one) <= points && one > 0.0 {
        Ok(())
    } else {
        Err(format!(
            "one CPU is too slow for the emulator's light load here ({}, more than {points} \
             points apart): a second core is rightly kept on this machine",
            busy_figures(one, two, cpus)
        ))
    }
}

/// `busy_on_one_and_two`'s figures in words, for a premise check's reason.
fn busy_figures(one: f64, two: f64, cpus: [u32; 2]) -> String {
    format!(
        "without lodger: GPU busy {:.1} % on CPU {}, {:.1} % on CPUs {} and {}",
        100.0 * one,
        cpus[0],
        100.0 * two,
        cpus[0],
        cpus[1]
    )
}
