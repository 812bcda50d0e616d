//! The channels between the sensing thread and whoever consumes its passes (the agent): what the
//! consumer holds. Touches only `std::sync` and the sense types.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::{Observations, SensedJob};

/// The sensor's newest pass, readable without the agent (read-only calls show it even while
/// the agent's loop is busy).
pub type LatestObservations = Arc<Mutex<Option<Arc<Observations>>>>;

/// How often the sensing thread samples (`sense.interval_ms`) and how late a source may be
/// before it is stale (`sense.deadline_ms`), shared with it so a config reload changes them
/// while it runs: each worker and the coordinator read them at every pass (a wait already
/// begun ends at its old time).
#[derive(Debug)]
pub struct Pace {
    interval_ms: AtomicU64,
    deadline_ms: AtomicU64,
}

impl Pace {
    pub fn new(interval: Duration, deadline: Duration) -> Arc<Self> {
        let pace = Arc::new(Self {
            interval_ms: AtomicU64::new(0),
            deadline_ms: AtomicU64::new(0),
        });
        pace.set(interval, deadline);
        pace
    }

    pub fn set(&self, interval: Duration, deadline: Duration) {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.interval_ms.store(ms(interval), Ordering::Relaxed);
        self.deadline_ms.store(ms(deadline), Ordering::Relaxed);
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms.load(Ordering::Relaxed))
    }

    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms.load(Ordering::Relaxed))
    }
}

/// The agent's ends of the channels to the sensing thread.
pub struct SensorLink {
    /// Passes the sensor finished.
    pub observations: mpsc::Receiver<Arc<Observations>>,
    /// The jobs to measure, sent whenever they change.
    pub jobs: mpsc::Sender<Vec<SensedJob>>,
    /// The newest pass, also sent on `observations`.
    pub latest: LatestObservations,
    /// The sampling interval and staleness deadline, changeable while sensing runs.
    pub pace: Arc<Pace>,
}
