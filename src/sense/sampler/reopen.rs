//! NVML opened again: a GPU worker whose NVML did not answer at start for a reason that may
//! pass (the kernel driver not loaded yet, its device files not made yet: lodgerd may neither
//! load modules nor make device files) tries again every [`GPU_REOPEN_EVERY`] and sleeps
//! meanwhile. Touches what opening NVML touches.

use std::time::{Duration, Instant};

use tracing::info;

use super::Sampler;
use crate::sense::gpu::{self, GpuSource};
use crate::sense::sources::SourceKind;

/// How often NVML is opened again after it failed for a reason that may pass
/// ([`gpu::GpuError::may_pass`]).
pub const GPU_REOPEN_EVERY: Duration = Duration::from_secs(30);

/// Opens the GPU source again (NVML; a stand-in in the tests).
pub(super) type OpenGpu = Box<dyn FnMut() -> Result<Box<dyn GpuSource>, gpu::GpuError> + Send>;

/// NVML to be opened again: when, how often, and how.
pub(super) struct GpuReopen {
    pub(super) next: Instant,
    pub(super) every: Duration,
    pub(super) open: OpenGpu,
}

impl Sampler {
    /// A GPU worker whose NVML did not answer and will be opened again: nothing to read
    /// until then ([`crate::sense::sources::Source::quiet_until`]), so its worker does not wake every
    /// interval meanwhile (issue 21's idle cost).
    pub fn quiet_until(&self) -> Option<Instant> {
        match (self.only, &self.gpu, &self.gpu_reopen) {
            (Some(SourceKind::Gpu), Err(_), Some(reopen)) => Some(reopen.next),
            _ => None,
        }
    }

    /// Opens NVML again when it failed for a reason that may pass and the time has come: said
    /// once when it answers, and once if it now fails for good; quiet otherwise.
    pub(super) fn reopen_gpu(&mut self) {
        let Some(reopen) = &mut self.gpu_reopen else {
            return;
        };
        let now = Instant::now();
        if now < reopen.next {
            return;
        }
        match (reopen.open)() {
            Ok(g) => {
                info!("GPU sensing: NVML (it answers now; it did not when lodgerd started)");
                self.gpu = Ok(g);
                self.gpu_reopen = None;
            }
            Err(e) if e.may_pass() => {
                reopen.next = now + reopen.every;
                self.gpu = Err(e.to_string());
            }
            Err(e) => {
                info!("GPU sensing off: {e}");
                self.gpu = Err(e.to_string());
                self.gpu_reopen = None;
            }
        }
    }

    /// Makes the GPU source be opened by `open`, every `every`, from the next pass on (the
    /// tests' stand-in for NVML answering late).
    #[cfg(test)]
    pub(super) fn reopen_gpu_with(&mut self, open: OpenGpu, every: Duration) {
        self.gpu_reopen = Some(GpuReopen {
            next: Instant::now(),
            every,
            open,
        });
    }
}
