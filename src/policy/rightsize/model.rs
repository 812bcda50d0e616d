//! A modelled training job's GPU utilization against its cores, for simulations (the
//! right-sizing benchmark) and the tuner's tests: SODA §IV-B-1, §V-B describe it rising like a
//! multithreaded job (Amdahl's law in the cores per GPU) up to the best-fit count, where the CPU
//! side keeps up with the GPU, then flat or dropping slightly. Samples carry AR(1) Gaussian noise,
//! drawn by the caller from `sigma` and `rho`.
//! Plain arithmetic; touches nothing.

#[derive(Debug, Clone, Copy)]
pub struct Curve {
    pub gpus: u32,
    /// Best-fit cores per GPU.
    pub knee_per_gpu: u32,
    /// Amdahl parallel fraction of the CPU side.
    pub parallel: f64,
    /// Utilization at and above the knee, percent.
    pub peak: f64,
    /// Percentage points lost per core per GPU above the knee.
    pub drop_above: f64,
    /// Per-sample noise, percentage points.
    pub sigma: f64,
    /// Lag-1 autocorrelation of the noise.
    pub rho: f64,
}

impl Curve {
    pub fn speedup(&self, per_gpu: f64) -> f64 {
        1.0 / ((1.0 - self.parallel) + self.parallel / per_gpu)
    }

    /// Noise-free utilization at `cores`, percent.
    pub fn util(&self, cores: u32) -> f64 {
        let per_gpu = f64::from(cores) / f64::from(self.gpus);
        let knee = f64::from(self.knee_per_gpu);
        let fed = (self.speedup(per_gpu) / self.speedup(knee)).min(1.0);
        self.peak * fed - self.drop_above * (per_gpu - knee).max(0.0)
    }

    /// The best-fit core count.
    pub fn knee(&self) -> u32 {
        self.knee_per_gpu * self.gpus
    }
}
