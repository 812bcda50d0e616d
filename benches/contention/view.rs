//! The contention benchmark's view of lodgerd over D-Bus (see `benches/contention.rs`): what it
//! senses and decides, polled, and the reaction times measured from it.

use super::*;

/// A blocking D-Bus view of lodgerd: what it senses and decides, as often as the poll asks.
pub(super) struct View {
    rt: tokio::runtime::Runtime,
    proxy: ManagerProxy<'static>,
}

pub(super) fn f64_of(d: &HashMap<String, OwnedValue>, key: &str) -> Option<f64> {
    match d.get(key).map(|v| &**v) {
        Some(Value::F64(x)) => Some(*x),
        _ => None,
    }
}

pub(super) fn str_of(d: &HashMap<String, OwnedValue>, key: &str) -> Option<String> {
    match d.get(key).map(|v| &**v) {
        Some(Value::Str(s)) => Some(s.to_string()),
        _ => None,
    }
}

pub(super) fn u64_of(d: &HashMap<String, OwnedValue>, key: &str) -> Option<u64> {
    match d.get(key).map(|v| &**v) {
        Some(Value::U64(x)) => Some(*x),
        _ => None,
    }
}

impl View {
    pub(super) fn connect(bus: &PrivateBus) -> View {
        let (rt, proxy) = bus.manager();
        View { rt, proxy }
    }

    /// The job's GPU utilization as lodgerd last sensed it.
    pub(super) fn gpu_percent(&self, job: &str) -> Option<f64> {
        let (_, jobs, _) = self.rt.block_on(self.proxy.get_observations()).ok()?;
        f64_of(jobs.get(job)?, "gpu_percent")
    }

    pub(super) fn throttle(&self, job: &str) -> Option<String> {
        let d = self.rt.block_on(self.proxy.get_job(job)).ok()?;
        str_of(&d, "throttle")
    }

    pub(super) fn throttle_actions(&self) -> u64 {
        self.rt
            .block_on(self.proxy.get_status())
            .ok()
            .and_then(|s| u64_of(&s, "throttle_actions"))
            .unwrap_or(0)
    }
}

pub(super) fn lodgerd(bus: &PrivateBus, dir: &Path, gpu_dir: &Path) -> Daemon {
    common::contention::daemon(bus, dir, gpu_dir, "")
}

pub(super) fn running_instances(job: &serde_json::Value) -> Vec<serde_json::Value> {
    job["instances"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|i| i["state"] == "running" && i["pid"].as_u64().is_some_and(|p| p > 0))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// The stable level and noise an evidence string states ("... below its stable 95.3 by more
/// than its noise 4.8 ...").
pub(super) fn level_and_noise(evidence: &str) -> Option<(f64, f64)> {
    let number_after = |key: &str| -> Option<f64> {
        let rest = &evidence[evidence.find(key)? + key.len()..];
        rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()?
            .parse()
            .ok()
    };
    Some((
        number_after("below its stable ")?,
        number_after("its noise ")?,
    ))
}

/// One reaction measurement, in sensing passes.
pub(super) struct Reaction {
    /// First pass showing the drop -> throttle.
    pub(super) pressure_to_throttle: f64,
    /// Antagonist start -> throttle.
    pub(super) start_to_throttle: f64,
    /// First pass back within the noise -> cores given back.
    pub(super) calm_to_give_back: f64,
    pub(super) evidence: String,
}

/// Polls until `done` holds; returns the (time, GPU %) samples seen and when `done` held.
pub(super) fn poll_until(
    view: &View,
    d: &Daemon,
    train: &str,
    what: &str,
    mut done: impl FnMut() -> bool,
    diagnose: &dyn Fn() -> String,
) -> (Vec<(Instant, f64)>, Instant) {
    let deadline = Instant::now() + REACT;
    let mut seen = Vec::new();
    let mut unseen = 0u32;
    loop {
        let now = Instant::now();
        match view.gpu_percent(train) {
            Some(g) => seen.push((now, g)),
            None => unseen += 1,
        }
        if done() {
            return (seen, now);
        }
        assert!(
            now < deadline,
            "timed out after {REACT:?} waiting for {what}; GPU % lodgerd showed (last 40 of \
             {}, {unseen} polls without): {:?}; status: {}\n{}\nlodgerd's log (end):\n{}",
            seen.len(),
            seen.iter()
                .rev()
                .take(40)
                .map(|(_, g)| format!("{g:.0}"))
                .collect::<Vec<_>>(),
            d.ctl_json(&["status"]),
            diagnose(),
            log_tail(d)
        );
        std::thread::sleep(POLL);
    }
}

pub(super) fn passes(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0 / SENSE_MS as f64
}

/// The last 40 lines of lodgerd's log.
pub(super) fn log_tail(d: &Daemon) -> String {
    let log = d.log();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

pub(super) fn reaction(
    view: &View,
    d: &Daemon,
    (train, training_pid): (&str, u32),
    hog: &str,
    cpu: u32,
) -> Reaction {
    // With no reserved CPU, lodgerd and the benchmark move to the other CPU first, as lodgerd
    // keeps to the reserved CPUs on a real node: the antagonist and training leave ordinary
    // threads on training's CPU almost no time.
    let other = 1 - cpu.min(1);
    pin_threads(d.pid(), &[other]);
    pin_threads(std::process::id(), &[other]);
    let start = Instant::now();
    let antagonist = RtAntagonist::start(cpu, ANTAGONIST_RT, ANTAGONIST_BUSY_PERCENT);
    let threads = || {
        let mut s = format!(
            "antagonist {}",
            thread_state(std::process::id(), antagonist.tid)
        );
        for tid in tids(training_pid) {
            s.push_str(&format!("; training {}", thread_state(training_pid, tid)));
        }
        for tid in tids(d.pid()) {
            s.push_str(&format!("; lodgerd {}", thread_state(d.pid(), tid)));
        }
        s
    };
    let (pressured, throttled_at) = poll_until(
        view,
        d,
        train,
        "the throttle",
        || view.throttle(hog).is_some(),
        &threads,
    );
    let evidence = view.throttle(hog).unwrap_or_default();
    let (level, noise) = level_and_noise(&evidence)
        .unwrap_or_else(|| panic!("no stable level and noise in the evidence: {evidence}"));
    let onset = pressured
        .iter()
        .find(|(_, g)| level - g > noise)
        .map_or(throttled_at, |(t, _)| *t);
    drop(antagonist);
    let stopped = Instant::now();
    pin_threads(d.pid(), &[0, 1]);
    pin_threads(std::process::id(), &[0, 1]);
    let (calm, given_back_at) = poll_until(
        view,
        d,
        train,
        "the give-back",
        || view.throttle(hog).is_none(),
        &String::new,
    );
    let calm_from = calm
        .iter()
        .find(|(t, g)| *t >= stopped && level - g <= noise)
        .map_or(given_back_at, |(t, _)| *t);
    Reaction {
        pressure_to_throttle: passes(throttled_at - onset),
        start_to_throttle: passes(throttled_at - start),
        calm_to_give_back: passes(given_back_at - calm_from),
        evidence,
    }
}
