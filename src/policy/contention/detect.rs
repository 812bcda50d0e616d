//! Contention detection (SODA §V-E): learning training jobs' stable progress, the pressure
//! signal (node memory bandwidth, else progress drops; training's memory stalls on top), ranking
//! the suspects, and the evidence in words. Pure: touches nothing.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;

use super::config::ContentionConfig;
use super::eliminator::ContentionEliminator;
use super::types::{
    Baseline, JobObservation, MemoryStall, NodeMembw, RankedBy, Role, Signal, Slowdown, Suspect,
};
use crate::job::JobId;

// ---------------------------------------------------------------------------------------------
// Baseline learning.

/// The last `baseline_ticks` progress samples of a training job running alone.
///
/// A window that slides, not the first samples kept for good: a job's first samples are often
/// its start-up (the emulator's first record covers the seconds before its first iteration; a
/// real job loads its data), and a level learnt from them would be low and its noise so wide
/// that no drop would ever exceed it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Learner {
    samples: VecDeque<f64>,
}

impl Learner {
    /// A learner that has seen `samples` (the newest last), as a state file keeps them.
    pub(super) fn from_samples(samples: Vec<f64>, config: &ContentionConfig) -> Self {
        let mut l = Learner::default();
        for x in samples.into_iter().filter(|x| x.is_finite()) {
            l.observe(x, config);
        }
        l
    }

    /// The samples it holds, oldest first.
    pub(super) fn samples(&self) -> Vec<f64> {
        self.samples.iter().copied().collect()
    }

    pub(super) fn observe(&mut self, x: f64, config: &ContentionConfig) {
        let keep = usize::try_from(config.baseline_ticks.max(1)).unwrap_or(usize::MAX);
        self.samples.push_back(x);
        while self.samples.len() > keep {
            self.samples.pop_front();
        }
    }

    pub(super) fn baseline(&self, config: &ContentionConfig) -> Option<Baseline> {
        let n = self.samples.len();
        if n == 0 || n < usize::try_from(config.baseline_ticks).unwrap_or(usize::MAX) {
            return None;
        }
        let count = f64::from(u32::try_from(n).unwrap_or(u32::MAX));
        let mean = self.samples.iter().sum::<f64>() / count;
        let sd = if n > 1 {
            let squares: f64 = self.samples.iter().map(|x| (x - mean) * (x - mean)).sum();
            (squares / (count - 1.0)).max(0.0).sqrt()
        } else {
            0.0
        };
        Some(Baseline {
            level: mean,
            noise: (config.noise_sigmas * sd).max(config.min_noise_fraction * mean.abs()),
        })
    }
}

/// What one tick knows while it decides.
pub(super) struct Tick<'a> {
    pub(super) now_ms: u64,
    pub(super) jobs: BTreeMap<&'a JobId, &'a JobObservation>,
    pub(super) membw: Option<&'a NodeMembw>,
    pub(super) suspects: Vec<Suspect>,
    pub(super) ranked_by: RankedBy,
    pub(super) victims: Vec<JobId>,
    /// The detection in words, for evidence.
    pub(super) why: String,
}

impl ContentionEliminator {
    /// Records the progress of training jobs running alone, and baselines given by the caller.
    pub(super) fn learn(&mut self, training: &[&JobObservation], lodgers_run: bool) {
        for job in training {
            if let Some(b) = job.baseline {
                self.given_baselines.insert(job.id.clone(), b);
            }
            let learner = self.learners.entry(job.id.clone()).or_default();
            let Some(p) = job.progress.filter(|p| p.is_finite()) else {
                continue;
            };
            // SODA §V-E records the stable level of a job running alone; a lodger beside it
            // would record a level already lowered by contention.
            if !lodgers_run {
                learner.observe(p, &self.config);
            }
        }
    }

    pub(super) fn baseline(&self, id: &JobId) -> Option<Baseline> {
        self.given_baselines
            .get(id)
            .copied()
            .or_else(|| self.learners.get(id).and_then(|l| l.baseline(&self.config)))
    }

    /// The signal, and whether this tick is pressured and whether it is calm: memory bandwidth
    /// or training progress, and training jobs' memory stalls (PSI) on top.
    pub(super) fn detect(
        &self,
        tick: &mut Tick<'_>,
        training: &[&JobObservation],
        lodgers_run: bool,
    ) -> (Signal, bool, bool) {
        let (signal, pressured, calm) =
            self.detect_bandwidth_or_progress(tick, training, lodgers_run);
        let c = &self.config;
        if c.memory_pressure_percent <= 0.0 {
            return (signal, pressured, calm);
        }
        let stalled: Vec<MemoryStall> = training
            .iter()
            .filter_map(|j| {
                let p = j.memory_pressure_percent.filter(|p| p.is_finite())?;
                (p >= c.memory_pressure_percent).then(|| MemoryStall {
                    job: j.id.clone(),
                    percent: p,
                })
            })
            .collect();
        let memory_calm = training.iter().all(|j| {
            !matches!(j.memory_pressure_percent,
                Some(p) if p.is_finite() && p >= c.memory_pressure_calm_percent)
        });
        if pressured || !lodgers_run || stalled.is_empty() {
            return (signal, pressured, calm && memory_calm);
        }
        tick.victims = stalled.iter().map(|s| s.job.clone()).collect();
        tick.why = stalled
            .iter()
            .map(|s| {
                format!(
                    "{} stalled on memory {:.1}% of the time (PSI), threshold {:.1}%",
                    s.job, s.percent, c.memory_pressure_percent
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let signal = Signal::MemoryPressure {
            stalled,
            threshold: c.memory_pressure_percent,
        };
        (signal, true, false)
    }

    /// SODA §V-E's signal: node memory bandwidth where MBM exists, else training progress.
    fn detect_bandwidth_or_progress(
        &self,
        tick: &mut Tick<'_>,
        training: &[&JobObservation],
        lodgers_run: bool,
    ) -> (Signal, bool, bool) {
        let c = &self.config;
        if let Some(m) = tick.membw {
            let fraction = m.fraction_of_peak;
            tick.victims = training.iter().map(|j| j.id.clone()).collect();
            tick.why = format!(
                "node memory bandwidth {} = {:.0}% of peak, threshold {:.0}%",
                gb(m.bytes_per_s),
                fraction * 100.0,
                c.membw_threshold * 100.0
            );
            let signal = Signal::MemoryBandwidth {
                fraction,
                threshold: c.membw_threshold,
            };
            let pressured = fraction.is_finite() && fraction >= c.membw_threshold;
            let calm = fraction.is_finite() && fraction < c.membw_calm;
            return (signal, pressured, calm);
        }
        let mut dropped = Vec::new();
        for job in training {
            let (Some(progress), Some(baseline)) = (job.progress, self.baseline(&job.id)) else {
                continue;
            };
            if progress.is_finite() && baseline.level - progress > baseline.noise {
                dropped.push(Slowdown {
                    job: job.id.clone(),
                    progress,
                    baseline,
                });
            }
        }
        tick.victims = dropped.iter().map(|s| s.job.clone()).collect();
        tick.why = if dropped.is_empty() {
            "training progress within its noise".to_string()
        } else {
            let mut why = String::new();
            for (i, s) in dropped.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let _ = write!(
                    why,
                    "{sep}{} progress {:.1} below its stable {:.1} by more than its noise {:.1}",
                    s.job, s.progress, s.baseline.level, s.baseline.noise
                );
            }
            why
        };
        let pressured = lodgers_run && !dropped.is_empty();
        let calm = dropped.is_empty();
        (Signal::TrainingProgress { dropped }, pressured, calm)
    }

    /// Ranks the lodgers by their own bandwidth, else cache misses (SODA §V-E names MBM;
    /// misses stand in where it is absent).
    pub(super) fn rank(&self, tick: &mut Tick<'_>) {
        let lodgers: Vec<&JobObservation> = tick
            .jobs
            .values()
            .copied()
            .filter(|j| j.role != Role::Training)
            .collect();
        let key: fn(&JobObservation) -> Option<f64> =
            if lodgers.iter().any(|j| j.membw_bytes_per_s.is_some()) {
                tick.ranked_by = RankedBy::MemoryBandwidth;
                |j| j.membw_bytes_per_s
            } else if lodgers.iter().any(|j| j.cache_misses_per_s.is_some()) {
                tick.ranked_by = RankedBy::CacheMisses;
                |j| j.cache_misses_per_s
            } else {
                tick.ranked_by = RankedBy::Unranked;
                |_| None
            };
        let mut suspects: Vec<Suspect> = lodgers
            .iter()
            .map(|j| Suspect {
                job: j.id.clone(),
                role: j.role,
                value: key(j).filter(|v| v.is_finite()),
            })
            .collect();
        suspects.sort_by(|a, b| {
            let va = a.value.unwrap_or(f64::NEG_INFINITY);
            let vb = b.value.unwrap_or(f64::NEG_INFINITY);
            vb.total_cmp(&va)
                .then(a.role.cmp(&b.role))
                .then(a.job.seq().cmp(&b.job.seq()))
                .then(a.job.cmp(&b.job))
        });
        tick.suspects = suspects;
    }

    /// The detection in words: signal, threshold, suspects, victims.
    pub(super) fn evidence(&self, tick: &Tick<'_>) -> String {
        let mut s = format!(
            "{} for {} ticks",
            tick.why,
            self.config.pressure_ticks.max(1)
        );
        if !tick.suspects.is_empty() {
            s.push_str("; suspects ");
            for (i, suspect) in tick.suspects.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let value = match (tick.ranked_by, suspect.value) {
                    (RankedBy::MemoryBandwidth, Some(v)) => format!(" {}", gb(v)),
                    (RankedBy::CacheMisses, Some(v)) => format!(" {:.3e} misses/s", v),
                    _ => String::new(),
                };
                let _ = write!(s, "{sep}{} ({}{value})", suspect.job, suspect.role.as_str());
            }
        }
        if !tick.victims.is_empty() {
            let names: Vec<&str> = tick.victims.iter().map(JobId::as_str).collect();
            let _ = write!(s, "; protecting {}", names.join(", "));
        }
        s
    }
}

/// Bytes/s in GB/s, for evidence.
pub(super) fn gb(bytes_per_s: f64) -> String {
    format!("{:.2} GB/s", bytes_per_s / 1e9)
}
