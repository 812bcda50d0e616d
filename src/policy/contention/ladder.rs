//! MBA and core-halving arithmetic: the MB values one MBA step after another per L3 domain,
//! and the core counts of successive halvings. Pure: touches nothing.

use super::config::ContentionConfig;
use super::{MbaCaps, MbaUnit};

/// The largest number of steps any ladder has (bounds loops on odd configurations).
pub(super) const MAX_LEVEL: u32 = 64;

// ---------------------------------------------------------------------------------------------
// MBA arithmetic.

/// The MB values one MBA step after another, per L3 domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MbaLadder {
    caps: MbaCaps,
    step_percent: u32,
    floor_percent: u32,
}

impl MbaLadder {
    /// The ladder for `caps`; `Err` with the reason where MBA cannot be stepped in percent of
    /// an unthrottled value (the `mba_MBps` software controller, whose unthrottled value is
    /// "no limit").
    pub fn new(caps: MbaCaps, config: &ContentionConfig) -> Result<Self, String> {
        if caps.unit == MbaUnit::MegabytesPerSecond {
            return Err(
                "resctrl is mounted with mba_MBps: MB values are MB/s limits with no \
                        unthrottled reference, so core halving is used instead"
                    .to_string(),
            );
        }
        if caps.default_schemata.is_empty() {
            return Err("the default group has no MB values".to_string());
        }
        let mut step_percent = config.mba_step_percent.max(1);
        if caps.unit == MbaUnit::Percent && caps.bandwidth_gran > 1 {
            // Intel: a step smaller than the granularity would round back up to no change.
            step_percent = step_percent.div_ceil(caps.bandwidth_gran) * caps.bandwidth_gran;
        }
        Ok(Self {
            caps,
            step_percent,
            floor_percent: config.mba_floor_percent,
        })
    }

    /// The L3 domains.
    pub fn domains(&self) -> impl Iterator<Item = u32> + '_ {
        self.caps.default_schemata.keys().copied()
    }

    /// The unthrottled value of `domain`: 100 (percent), or the default group's (AMD).
    pub fn unthrottled(&self, domain: u32) -> u32 {
        match self.caps.unit {
            MbaUnit::Percent => self.caps.max_value(),
            _ => self
                .caps
                .default_schemata
                .get(&domain)
                .copied()
                .unwrap_or_else(|| self.caps.max_value()),
        }
    }

    /// The lowest value: `mba_floor_percent` of unthrottled, not below `min_bandwidth`.
    pub fn floor(&self, domain: u32) -> u32 {
        let base = u64::from(self.unthrottled(domain));
        let floor = (base * u64::from(self.floor_percent)).div_ceil(100);
        self.caps
            .valid_value(u32::try_from(floor).unwrap_or(u32::MAX))
    }

    /// The value after `level` steps: `100 - level × step` percent of unthrottled, rounded the
    /// way the kernel would (up to `bandwidth_gran`, at least `min_bandwidth`), not below the
    /// floor.
    pub fn value(&self, domain: u32, level: u32) -> u32 {
        let base = u64::from(self.unthrottled(domain));
        let percent = 100u64.saturating_sub(u64::from(level) * u64::from(self.step_percent));
        let wanted = (base * percent).div_ceil(100);
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        self.caps.valid_value(wanted).max(self.floor(domain))
    }

    /// Steps until the floor: levels run from 0 (unthrottled) to this.
    pub fn max_level(&self, domain: u32) -> u32 {
        let floor = self.floor(domain);
        let mut level = 0;
        while level < MAX_LEVEL && self.value(domain, level) > floor {
            level += 1;
        }
        level
    }
}

/// Cores left after `level` halvings of `nominal`: `ceil(nominal / 2^level)`, not below `floor`.
/// A job with `floor` cores or fewer is not cut.
pub fn halved_cores(nominal: u32, level: u32, floor: u32) -> u32 {
    if nominal <= floor {
        return nominal;
    }
    let cores = u64::from(nominal).div_ceil(1u64 << level.min(32));
    u32::try_from(cores).unwrap_or(u32::MAX).max(floor)
}

/// Halvings until `floor`: levels run from 0 to this (0 when the job has `floor` cores or fewer).
pub fn max_halvings(nominal: u32, floor: u32) -> u32 {
    let mut level = 0;
    while level < MAX_LEVEL && halved_cores(nominal, level, floor) > floor {
        level += 1;
    }
    level
}
