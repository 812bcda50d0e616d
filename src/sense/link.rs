//! The channels between the sensing thread and whoever consumes its passes (the agent): what the
//! consumer holds. Touches only `std::sync` and the sense types.

use std::sync::{mpsc, Arc, Mutex};

use super::{Observations, SensedJob};

/// The sensor's newest pass, readable without the agent (read-only calls show it even while
/// the agent's loop is busy).
pub type LatestObservations = Arc<Mutex<Option<Arc<Observations>>>>;

/// The agent's ends of the channels to the sensing thread.
pub struct SensorLink {
    /// Passes the sensor finished.
    pub observations: mpsc::Receiver<Observations>,
    /// The jobs to measure, sent whenever they change.
    pub jobs: mpsc::Sender<Vec<SensedJob>>,
    /// The newest pass, also sent on `observations`.
    pub latest: LatestObservations,
}
