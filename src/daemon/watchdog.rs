//! watchdog: systemd's watchdog pings, sent only while the agent loop makes progress at the tick
//! length in force now (a reload may change `agent.interval_ms`). Touches nothing but sd_notify.

use std::time::Duration;

use tokio::time::Instant;
use tracing::warn;

use crate::agent::AgentHandle;

/// Pings systemd's watchdog (period `period`, systemd's `WatchdogSec=`) while the agent loop
/// makes progress: a wedged agent (stuck in a kernel call, deadlocked) stops the pings and
/// systemd restarts lodgerd. Not a bare timer.
pub(super) async fn run(agent: AgentHandle, period: Duration) {
    watch(
        period,
        || (agent.ticks(), agent.interval()),
        || super::notify(&[sd_notify::NotifyState::Watchdog]),
    )
    .await;
}

/// Every `period / 2`: reads the loop's tick count and tick length from `progress`, and calls
/// `ping` unless the loop has been quiet for longer than [`Progress::allows`].
async fn watch(
    period: Duration,
    mut progress: impl FnMut() -> (u64, Duration),
    mut ping: impl FnMut(),
) {
    let (ticks, interval) = progress();
    let mut seen = Progress::new(ticks, interval, Instant::now());
    let mut every = tokio::time::interval(period / 2);
    loop {
        every.tick().await;
        let (ticks, interval) = progress();
        let now = Instant::now();
        if seen.observe(ticks, interval, now, period) {
            ping();
        } else {
            warn!(
                "agent loop made no progress for {:?}; not pinging the watchdog",
                now.duration_since(seen.at)
            );
        }
    }
}

/// What the watchdog knows of the agent loop's progress.
#[derive(Debug)]
struct Progress {
    /// Ticks completed at the last change seen.
    ticks: u64,
    /// When that change was seen.
    at: Instant,
    /// The longest tick length in force since then: the loop sleeps out the tick it started
    /// before a reload shortened it, and takes the new length from the next one.
    interval: Duration,
}

impl Progress {
    fn new(ticks: u64, interval: Duration, now: Instant) -> Self {
        Self {
            ticks,
            at: now,
            interval,
        }
    }

    /// Records what the loop shows at `now` (its tick count and current tick length) and says
    /// whether to ping: a tick is due every interval, and two may be late.
    fn observe(&mut self, ticks: u64, interval: Duration, now: Instant, period: Duration) -> bool {
        if ticks != self.ticks {
            *self = Self::new(ticks, interval, now);
        } else {
            self.interval = self.interval.max(interval);
        }
        now.duration_since(self.at) <= self.allows(period)
    }

    /// How long the loop may be quiet before the pings stop.
    fn allows(&self, period: Duration) -> Duration {
        self.interval.saturating_mul(2).saturating_add(period / 2)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    const PERIOD: Duration = Duration::from_secs(30);

    /// The loop the watchdog watches, as `agent::run` runs it: each tick's length is read when
    /// the tick before it ends, so a reload changes the length of the ticks after the one under
    /// way.
    struct Loop {
        ticks: u64,
        interval: Duration,
    }

    /// The longest gap between two pings (and from the start to the first) over `run_for` of
    /// paused time, with the loop starting at `start` and reloaded to `reload_to` during its
    /// `reload_after`-th tick.
    async fn longest_quiet(
        start: Duration,
        reload_after: u64,
        reload_to: Duration,
        run_for: Duration,
    ) -> Duration {
        let agent = Arc::new(Mutex::new(Loop {
            ticks: 0,
            interval: start,
        }));
        let looping = Arc::clone(&agent);
        tokio::spawn(async move {
            loop {
                let (tick_length, ticks) = {
                    let l = looping.lock().expect("test lock");
                    (l.interval, l.ticks)
                };
                if ticks == reload_after {
                    // A reload arriving a moment into this tick: this tick keeps its length.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    looping.lock().expect("test lock").interval = reload_to;
                    tokio::time::sleep(tick_length - Duration::from_millis(10)).await;
                } else {
                    tokio::time::sleep(tick_length).await;
                }
                looping.lock().expect("test lock").ticks += 1;
            }
        });
        let pings = Arc::new(Mutex::new(vec![Instant::now()]));
        let recorded = Arc::clone(&pings);
        let watching = Arc::clone(&agent);
        let watchdog = tokio::spawn(async move {
            watch(
                PERIOD,
                || {
                    let l = watching.lock().expect("test lock");
                    (l.ticks, l.interval)
                },
                || recorded.lock().expect("test lock").push(Instant::now()),
            )
            .await;
        });
        tokio::time::sleep(run_for).await;
        watchdog.abort();
        let mut pings = pings.lock().expect("test lock").clone();
        pings.push(Instant::now());
        pings
            .windows(2)
            .map(|w| w[1].duration_since(w[0]))
            .max()
            .unwrap_or_default()
    }

    /// Started at 1 s, reloaded to 60 s (in range, documented live): systemd hears a ping at
    /// least once per WatchdogSec. With the startup interval kept, the pings stopped 17 s after
    /// each tick and systemd killed lodgerd.
    #[tokio::test(start_paused = true)]
    async fn a_longer_interval_from_a_reload_keeps_the_pings_going() {
        let quiet = longest_quiet(
            Duration::from_secs(1),
            5,
            Duration::from_secs(60),
            Duration::from_secs(600),
        )
        .await;
        assert!(quiet <= PERIOD, "no ping for {quiet:?}");
    }

    /// Reloaded from 60 s to 1 s during a tick: the loop sleeps that tick out at 60 s, and the
    /// watchdog waits for it rather than going quiet 17 s after the reload.
    #[tokio::test(start_paused = true)]
    async fn a_shorter_interval_waits_for_the_tick_under_way() {
        let quiet = longest_quiet(
            Duration::from_secs(60),
            2,
            Duration::from_secs(1),
            Duration::from_secs(600),
        )
        .await;
        assert!(quiet <= PERIOD, "no ping for {quiet:?}");
    }

    /// A wedged loop still goes quiet: no tick for longer than two intervals and half a period.
    #[test]
    fn a_wedged_loop_is_not_pinged_for() {
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        let mut p = Progress::new(7, second, t0);
        assert!(p.observe(7, second, t0 + Duration::from_secs(17), PERIOD));
        assert!(!p.observe(7, second, t0 + Duration::from_secs(18), PERIOD));
        // A reload to 60 s widens the allowance of the quiet stretch under way.
        assert!(p.observe(7, 60 * second, t0 + Duration::from_secs(18), PERIOD));
        assert!(!p.observe(7, 60 * second, t0 + Duration::from_secs(136), PERIOD));
        // Progress resets it to the interval now in force.
        assert!(p.observe(8, second, t0 + Duration::from_secs(136), PERIOD));
        assert!(!p.observe(8, second, t0 + Duration::from_secs(154), PERIOD));
    }
}
