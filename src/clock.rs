//! Wall-clock time for what must survive a restart or be compared across processes (the
//! right-sizing tuner's clock, registration times, sensing timestamps). Touches only the
//! system clock; loops and timeouts use `Instant` instead.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Wall-clock time as a duration since the epoch: the right-sizing tuner's clock, which must
/// survive a lodgerd restart (its state is persisted).
pub fn wall_clock() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Whole seconds since the epoch (0 if the clock is before it).
pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Milliseconds since the epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
