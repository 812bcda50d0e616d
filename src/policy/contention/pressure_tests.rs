//! Tests of the memory-pressure signal (issue 19): training's memory stalls (PSI) while lodgers
//! run throttle the lodgers, calm gives them back, and the signal never acts alone on training.

use super::*;
use crate::job::JobId;

fn id(seq: u64) -> JobId {
    JobId::from_seq(seq)
}

/// Training job 1 stalled `stall` percent (None: PSI absent), an offline lodger with `cores`,
/// no MBM and no progress signal.
fn obs(stall: Option<f64>, lodger_cores: Option<u32>) -> ContentionObservations {
    let mut training = JobObservation::new(id(1), Role::Training, 1);
    training.memory_pressure_percent = stall;
    let mut jobs = vec![training];
    if let Some(cores) = lodger_cores {
        jobs.push(JobObservation::new(id(2), Role::Offline, cores));
    }
    ContentionObservations { membw: None, jobs }
}

fn config() -> ContentionConfig {
    ContentionConfig {
        pressure_ticks: 2,
        calm_ticks: 3,
        memory_pressure_percent: 10.0,
        memory_pressure_calm_percent: 5.0,
        ..ContentionConfig::default()
    }
}

#[test]
fn training_stalled_on_memory_throttles_the_lodgers_and_calm_gives_back() {
    let mut c = ContentionEliminator::new(config(), None);
    assert!(
        c.step(0, &obs(Some(25.0), Some(2))).is_empty(),
        "one tick is not enough"
    );
    let a = c.step(0, &obs(Some(25.0), Some(2)));
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].job, id(2));
    assert_eq!(a[0].mechanism, Mechanism::Cores { count: 1 });
    assert!(
        a[0].evidence
            .contains("j1 stalled on memory 25.0% of the time (PSI), threshold 10.0%"),
        "{}",
        a[0].evidence
    );
    let d = c.detection().expect("detection");
    assert!(matches!(&d.signal, Signal::MemoryPressure { stalled, .. } if stalled[0].job == id(1)));
    // Between calm (5%) and pressure (10%): held, neither cut further nor given back.
    for _ in 0..10 {
        assert!(c.step(0, &obs(Some(7.0), Some(1))).is_empty());
    }
    assert_eq!(c.throttles().cores[&id(2)], 1);
    // Calm for calm_ticks: given back.
    assert!(c.step(0, &obs(Some(1.0), Some(1))).is_empty());
    assert!(c.step(0, &obs(Some(1.0), Some(1))).is_empty());
    let a = c.step(0, &obs(Some(1.0), Some(1)));
    assert!(
        a.iter()
            .any(|a| a.mechanism == Mechanism::Cores { count: 2 }),
        "{a:?}"
    );
    assert!(c.throttles().is_empty());
}

#[test]
fn memory_stalls_without_lodgers_or_with_the_signal_off_throttle_nothing() {
    // Nobody to throttle: the training job's own stalls are its own.
    let mut c = ContentionEliminator::new(config(), None);
    for _ in 0..5 {
        assert!(c.step(0, &obs(Some(50.0), None)).is_empty());
    }
    // memory_pressure_percent = 0: the signal is off.
    let off = ContentionConfig {
        memory_pressure_percent: 0.0,
        ..config()
    };
    off.validate().expect("0 is off, and valid");
    let mut c = ContentionEliminator::new(off, None);
    for _ in 0..5 {
        assert!(c.step(0, &obs(Some(50.0), Some(2))).is_empty());
    }
    // No PSI (an old kernel, psi=0): nothing measured is no pressure.
    let mut c = ContentionEliminator::new(config(), None);
    for _ in 0..5 {
        assert!(c.step(0, &obs(None, Some(2))).is_empty());
    }
}

#[test]
fn memory_pressure_settings_are_checked() {
    let bad = ContentionConfig {
        memory_pressure_percent: 120.0,
        ..config()
    };
    assert_eq!(bad.validate().unwrap_err().field, "memory_pressure_percent");
    let bad = ContentionConfig {
        memory_pressure_calm_percent: 10.0,
        ..config()
    };
    assert_eq!(
        bad.validate().unwrap_err().field,
        "memory_pressure_calm_percent"
    );
}
