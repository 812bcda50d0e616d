//! MBA and core-halving arithmetic: the MB values one MBA step after another per L3 domain
//! (on AMD counting down from what the group used, [`MbaLadder::base_for`]), and the core counts
//! of successive halvings. Pure: touches nothing.

use super::config::ContentionConfig;
use super::types::JobObservation;
use super::{MbaCaps, MbaUnit};

/// Bytes per second in one AMD MB unit (1/8 GB/s; GB read as 2^30 bytes, so the default group's
/// 2048 is 256 GiB/s: read as 10^9 bytes a unit would be 7 % smaller, less than one step).
const AMD_UNIT_BYTES_PER_S: f64 = (1u64 << 30) as f64 / 8.0;
/// The lowest base an AMD ladder counts down from: 16 units, 2 GB/s. A group that used less in
/// its busiest domain is not what loads the memory bus; counted from what it used, its floor
/// would be a few hundred MB/s and would starve it should it need more before the steps are
/// given back.
const AMD_MIN_BASE: u32 = 16;

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

    /// Whether MB values are absolute bandwidth (AMD), so a group's steps count down from what
    /// it used ([`MbaLadder::base_for`]) rather than from the unthrottled value.
    pub fn is_absolute(&self) -> bool {
        self.caps.unit == MbaUnit::AmdEighthGigabytesPerSecond
    }

    /// Where a group's steps count down from, given `bytes_per_s`, the most it used in any one L3
    /// domain just before its first step (`group_peak`). On AMD that bandwidth in MB units,
    /// rounded up, at least 2 GB/s (`AMD_MIN_BASE`) and `min_bandwidth`, at most the unthrottled
    /// value: the first step (by `mba_step_percent`) then bites at once, where counted from the
    /// unthrottled 2048 (256 GB/s) no step went below 205 (25.6 GB/s), more than a CCX hog uses.
    /// One base for every domain, the busiest one's: a domain the group barely uses is capped no
    /// tighter than its busiest, so a member moved there later is not starved. `None` (count
    /// from the unthrottled value) on Intel, whose percent steps are relative already, and when
    /// nothing was measured.
    pub fn base_for(&self, bytes_per_s: Option<f64>) -> Option<u32> {
        if !self.is_absolute() {
            return None;
        }
        let bytes_per_s = bytes_per_s.filter(|b| b.is_finite() && *b > 0.0)?;
        // A ratio of bandwidths, rounded up; saturates far above any unthrottled value.
        let units = (bytes_per_s / AMD_UNIT_BYTES_PER_S)
            .ceil()
            .min(f64::from(u32::MAX)) as u32;
        Some(units.max(self.caps.min_bandwidth).max(AMD_MIN_BASE))
    }

    /// A base an earlier lodgerd kept, bounded as a measured one is; `None` where this ladder
    /// counts from none (Intel).
    pub fn held_base(&self, base: u32) -> Option<u32> {
        self.is_absolute()
            .then(|| base.max(self.caps.min_bandwidth).max(AMD_MIN_BASE))
    }

    /// The value `base` stands for in `domain`: `base`, at most the unthrottled value; the
    /// unthrottled value without one.
    fn top(&self, domain: u32, base: Option<u32>) -> u32 {
        let unthrottled = self.unthrottled(domain);
        base.map_or(unthrottled, |b| b.min(unthrottled))
    }

    /// The lowest value: `mba_floor_percent` of unthrottled, not below `min_bandwidth`.
    pub fn floor(&self, domain: u32) -> u32 {
        self.floor_at(domain, None)
    }

    /// The lowest value counting down from `base` ([`MbaLadder::base_for`]):
    /// `mba_floor_percent` of it, not below `min_bandwidth`.
    pub fn floor_at(&self, domain: u32, base: Option<u32>) -> u32 {
        let top = u64::from(self.top(domain, base));
        let floor = (top * u64::from(self.floor_percent)).div_ceil(100);
        self.caps
            .valid_value(u32::try_from(floor).unwrap_or(u32::MAX))
    }

    /// The value after `level` steps: `100 - level × step` percent of unthrottled, rounded the
    /// way the kernel would (up to `bandwidth_gran`, at least `min_bandwidth`), not below the
    /// floor.
    pub fn value(&self, domain: u32, level: u32) -> u32 {
        self.value_at(domain, None, level)
    }

    /// [`MbaLadder::value`] counting down from `base`; level 0 is the unthrottled value
    /// whatever the base (no limit).
    pub fn value_at(&self, domain: u32, base: Option<u32>, level: u32) -> u32 {
        if level == 0 {
            return self.caps.valid_value(self.unthrottled(domain));
        }
        let top = u64::from(self.top(domain, base));
        let percent = 100u64.saturating_sub(u64::from(level) * u64::from(self.step_percent));
        let wanted = (top * percent).div_ceil(100);
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        self.caps
            .valid_value(wanted)
            .max(self.floor_at(domain, base))
    }

    /// Steps until the floor: levels run from 0 (unthrottled) to this.
    pub fn max_level(&self, domain: u32) -> u32 {
        self.max_level_at(domain, None)
    }

    /// [`MbaLadder::max_level`] counting down from `base`.
    pub fn max_level_at(&self, domain: u32, base: Option<u32>) -> u32 {
        let floor = self.floor_at(domain, base);
        let mut level = 0;
        while level < MAX_LEVEL && self.value_at(domain, base, level) > floor {
            level += 1;
        }
        level
    }
}

/// The most bandwidth `members` used together in any one L3 domain (their MBM per domain
/// summed), bytes/s; `None` when none of them has a per-domain figure.
pub fn group_peak<'a>(members: impl Iterator<Item = &'a JobObservation>) -> Option<f64> {
    let mut per_domain = std::collections::BTreeMap::<u32, f64>::new();
    for job in members {
        for (&domain, &bytes_per_s) in &job.membw_domains {
            if bytes_per_s.is_finite() && bytes_per_s > 0.0 {
                *per_domain.entry(domain).or_insert(0.0) += bytes_per_s;
            }
        }
    }
    per_domain.into_values().reduce(f64::max)
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
