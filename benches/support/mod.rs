//! Helpers shared by the benchmarks that drive the bundled workloads (`lodgers`, `contention`):
//! building the examples, starting commands on CPUs and stopping them, reading /proc.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&v| v > 0)
        .unwrap_or(default)
}

/// `cmd` on `cpus` (taskset) and optionally SCHED_RR 10 (chrt); both exec, so the child's pid is
/// the workload's.
pub fn command(program: &Path, cpus: Option<&str>, rr: bool) -> Command {
    let mut argv: Vec<String> = Vec::new();
    if rr {
        argv.extend(["chrt", "-r", "10"].map(String::from));
    }
    if let Some(cpus) = cpus {
        argv.extend(["taskset".to_string(), "-c".to_string(), cpus.to_string()]);
    }
    argv.push(program.display().to_string());
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]);
    cmd
}

/// Builds the release examples the benchmark runs (cargo bench builds only the benchmark and the
/// binaries).
pub fn build_examples() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet", "--examples"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo build --release --examples");
    assert!(status.success(), "building the examples failed");
}

/// The complete (newline-terminated) lines of a file.
pub fn complete_lines(path: &Path) -> Vec<String> {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end].lines().map(str::to_string).collect()
}

/// utime + stime of a process (all its threads), in clock ticks.
pub fn proc_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0;
    };
    let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// `--work-per-batch` (units, to the row) that costs `batch_cpu_ms` of CPU on `cpu` with the
/// emulator's `extra` options (the emulator's own calibration, one iteration).
pub fn calibrate(cpu: &str, batch_cpu_ms: u64, extra: &[&str]) -> f64 {
    let out = Command::new("taskset")
        .args(["-c", cpu])
        .arg(crate::common::example("train_emulator"))
        .args(["--workers", "1", "--iterations", "1", "--gpu-step-ms", "1"])
        .args(["--batch-cpu-ms", &batch_cpu_ms.to_string()])
        .args(extra)
        .output()
        .expect("run train_emulator");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("work_per_batch="))
        .and_then(|v| v.parse().ok())
        .expect("calibrated work_per_batch= in the emulator's output")
}

/// The mean of `xs`; NaN for none.
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Busy and idle clock ticks of each CPU, from /proc/stat.
pub fn cpu_ticks() -> Vec<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal
            let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
            let busy: u64 = v.iter().take(8).sum::<u64>() - idle;
            (busy, idle)
        })
        .collect()
}

/// Raises the CPU weight of this session's autogroup (the benchmark, its workloads, lodgerd and
/// lodgerd's instances: one session) against the other tenants of a shared machine, and puts it
/// back when dropped. Every arrangement runs in the same group, so this changes what other
/// sessions take from the measurements, not how the arrangements compare; SCHED_RR is not
/// affected by nice at all. `LODGER_BENCH_AUTOGROUP_NICE` (default -20; `off` leaves it alone).
/// Used by the lodgers and contention benchmarks.
pub struct AutogroupNice {
    old: Option<i32>,
}

impl AutogroupNice {
    const PATH: &'static str = "/proc/self/autogroup";

    fn current() -> Option<i32> {
        // "/autogroup-26 nice 0"
        std::fs::read_to_string(Self::PATH)
            .ok()?
            .split_whitespace()
            .last()?
            .parse()
            .ok()
    }

    pub fn raise() -> (AutogroupNice, String) {
        let wanted = std::env::var("LODGER_BENCH_AUTOGROUP_NICE").unwrap_or_else(|_| "-20".into());
        if wanted.trim() == "off" {
            return (
                AutogroupNice { old: None },
                "autogroup nice left alone".into(),
            );
        }
        let Ok(nice) = wanted.trim().parse::<i32>() else {
            panic!("LODGER_BENCH_AUTOGROUP_NICE={wanted}: a nice value (-20..19) or off");
        };
        let enabled = std::fs::read_to_string("/proc/sys/kernel/sched_autogroup_enabled")
            .is_ok_and(|v| v.trim() == "1");
        let Some(old) = Self::current() else {
            return (
                AutogroupNice { old: None },
                "no autogroups on this kernel".into(),
            );
        };
        if let Err(e) = std::fs::write(Self::PATH, nice.to_string()) {
            return (
                AutogroupNice { old: None },
                format!("cannot set autogroup nice ({e})"),
            );
        }
        (
            AutogroupNice { old: Some(old) },
            format!(
                "session autogroup nice {old} -> {nice}{}",
                if enabled {
                    ""
                } else {
                    " (kernel.sched_autogroup_enabled is 0: no effect)"
                }
            ),
        )
    }
}

impl Drop for AutogroupNice {
    fn drop(&mut self) {
        if let Some(old) = self.old {
            let _ = std::fs::write(Self::PATH, old.to_string());
        }
    }
}

/// A workload process, stopped with SIGTERM (then SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    /// Its stdout (report lines) when redirected to a file.
    pub out: Option<PathBuf>,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Complete lines of its stdout file so far.
    pub fn lines(&self) -> Vec<String> {
        self.out.as_deref().map(complete_lines).unwrap_or_default()
    }

    /// SIGTERM, then waits (SIGKILL after 5 s).
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}
