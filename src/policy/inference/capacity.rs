//! The CR-Agent's capacity check (Cloud Reamer §III-C): whether an online job's layout serves
//! its rate. Pure: touches nothing.

use serde::{Deserialize, Serialize};

use super::types::LayoutConfig;

// ---------------------------------------------------------------------------------------------
// Capacity

/// Whether an online job's layout serves its rate (Cloud Reamer §III-C: the CR-Agent watches
/// the incoming rate and alerts the cluster scheduler when it passes what the instance was
/// configured for).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CapacityCheck {
    /// What the placed instances can serve, requests/s.
    pub capacity_per_s: f64,
    /// The rate the job was registered with.
    pub expected_per_s: f64,
    /// The rate compared with capacity: the measured arrival rate when there is one, else the
    /// expected rate.
    pub demand_per_s: f64,
    /// Capacity covers the expected rate.
    pub serves_expected: bool,
    /// Demand exceeds capacity: emit `CapacityExceeded`.
    pub exceeded: bool,
}

/// Checks an online job's capacity. `layout_throughput_per_s` is what `layout` served when it
/// was measured with all its instances (the search's measurement of it); `placed_instances` is
/// how many of them the plan keeps now, not counting instances stopping for good (fewer when the
/// job has a [`Shortfall`](super::Shortfall)), capacity scaling with them.
/// Non-finite or negative rates count as 0. Pure: the caller debounces the signal.
pub fn check_capacity(
    layout: &LayoutConfig,
    layout_throughput_per_s: f64,
    placed_instances: u32,
    expected_per_s: f64,
    measured_demand_per_s: Option<f64>,
) -> CapacityCheck {
    let rate = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
    let capacity_per_s = if layout.instances == 0 {
        0.0
    } else {
        let placed = placed_instances.min(layout.instances);
        rate(layout_throughput_per_s) * f64::from(placed) / f64::from(layout.instances)
    };
    let expected_per_s = rate(expected_per_s);
    let demand_per_s = measured_demand_per_s.map_or(expected_per_s, rate);
    CapacityCheck {
        capacity_per_s,
        expected_per_s,
        demand_per_s,
        serves_expected: capacity_per_s >= expected_per_s,
        exceeded: demand_per_s > capacity_per_s,
    }
}
