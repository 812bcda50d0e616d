//! Lent CPU time (issue 19): what lodgers ran on a training job's cores, and where a lodger ran.
//! Plain data, kept with the job across lodgerd restarts; the agent's `lending` fills it.

use serde::{Deserialize, Serialize};

/// CPU-seconds, since the job was registered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CpuAccount {
    /// Training: CPU time lodgers (offline inference instances) used on its cores.
    pub lent_s: f64,
    /// Training: time its cores were idle (nobody ran), so that `lent_s / (lent_s + idle_s)`
    /// is the share of its idle time that was lent.
    pub idle_s: f64,
    /// A lodger: the CPU time its instances used.
    pub used_s: f64,
    /// A lodger: the part of `used_s` on training jobs' cores.
    pub on_training_s: f64,
}

impl CpuAccount {
    /// The share of the training job's idle core time lodgers used, if any was measured.
    pub fn lent_share(&self) -> Option<f64> {
        let total = self.lent_s + self.idle_s;
        (total > 0.0).then(|| self.lent_s / total)
    }

    pub fn is_empty(&self) -> bool {
        *self == CpuAccount::default()
    }
}
