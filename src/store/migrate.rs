//! Upgrading a state file written by an older lodgerd, one version at a time, on its JSON
//! before it is read as a [`State`](super::State): an upgrade keeps every job. Each step takes
//! version N's shape to N+1's and says what it changed; `to_current` runs them in order.
//! Touches nothing: text in, value out.

use serde_json::{Map, Value};

use super::{ParseError, STATE_VERSION};

/// One step: version `from` to `from + 1`.
type Step = fn(Value) -> Result<Value, String>;

/// `STEPS[i]` upgrades version `i + 1` to `i + 2`.
const STEPS: &[Step] = &[v1_to_v2];

/// Upgrades `value`, written in version `from` (1 ≤ `from` ≤ [`STATE_VERSION`]), to the
/// current version.
pub(super) fn to_current(mut value: Value, from: u32) -> Result<Value, ParseError> {
    let mut version = from;
    while version < STATE_VERSION {
        let step = usize::try_from(version - 1)
            .ok()
            .and_then(|i| STEPS.get(i))
            .ok_or_else(|| ParseError::Migrate {
                from: version,
                to: version + 1,
                why: "this lodgerd has no step for it".into(),
            })?;
        let to = version + 1;
        value = step(value)
            .and_then(|mut v| {
                object(&mut v, "the state")?.insert("version".into(), Value::from(to));
                Ok(v)
            })
            .map_err(|why| ParseError::Migrate {
                from: version,
                to,
                why,
            })?;
        version = to;
    }
    Ok(value)
}

fn object<'a>(value: &'a mut Value, what: &str) -> Result<&'a mut Map<String, Value>, String> {
    value
        .as_object_mut()
        .ok_or_else(|| format!("{what} is not an object"))
}

/// 1 → 2: right-sizing's per-sample figures leave the file. Each training job's `tuning` loses
/// `last_sample_ms` (the passes after a restart are new ones) and its tuner's window under way
/// loses its `samples` (the window starts again at the tuner's next step, as after any
/// restart). Everything else, the search, its windows and every job, is kept as it was.
fn v1_to_v2(mut value: Value) -> Result<Value, String> {
    let state = object(&mut value, "the state")?;
    let Some(jobs) = state.get_mut("jobs") else {
        return Ok(value);
    };
    for (id, job) in object(jobs, "'jobs'")? {
        let job = object(job, &format!("job {id}"))?;
        let Some(tuning) = job.get_mut("tuning") else {
            continue;
        };
        if tuning.is_null() {
            continue;
        }
        let tuning = object(tuning, &format!("job {id}'s 'tuning'"))?;
        tuning.remove("last_sample_ms");
        let window = tuning
            .get_mut("tuner")
            .and_then(|t| t.get_mut("phase"))
            .and_then(|p| p.get_mut("Measuring"))
            .and_then(Value::as_object_mut);
        if let Some(window) = window {
            window.remove("samples");
        }
    }
    Ok(value)
}
