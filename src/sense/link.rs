//! The channels between the sensing thread and whoever consumes its passes (the agent): what the
//! consumer holds. Touches only `std::sync::mpsc` and the sense types.

use std::sync::mpsc;

use super::{Observations, SensedJob};

/// The agent's ends of the channels to the sensing thread.
pub struct SensorLink {
    /// Passes the sensor finished.
    pub observations: mpsc::Receiver<Observations>,
    /// The jobs to measure, sent whenever they change.
    pub jobs: mpsc::Sender<Vec<SensedJob>>,
}
