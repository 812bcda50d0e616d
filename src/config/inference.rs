//! config::inference: `[inference]`: how long a layout probe of an online inference job lasts
//! and how long an instance has to stop. Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::in_range;
use super::{ConfigError, Cx};

/// `[inference]`: how lodger runs inference instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InferenceConfig {
    /// How long each layout probe of an online job is measured, in seconds.
    pub probe_seconds: u64,
    /// Between SIGTERM and SIGKILL when an instance is stopped, in seconds.
    pub stop_grace_seconds: u64,
}

impl Default for InferenceConfig {
    fn default() -> Self {
        Self {
            probe_seconds: 10,
            stop_grace_seconds: 10,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawInference {
    probe_seconds: Option<Spanned<i64>>,
    stop_grace_seconds: Option<Spanned<i64>>,
}

impl Cx<'_> {
    pub(super) fn inference(
        &mut self,
        raw: Option<RawInference>,
    ) -> Result<InferenceConfig, ConfigError> {
        let d = InferenceConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(InferenceConfig {
            probe_seconds: self.field(
                "inference.probe_seconds",
                raw.probe_seconds,
                d.probe_seconds,
                |v| in_range(v, &(1..=600)),
            )?,
            stop_grace_seconds: self.field(
                "inference.stop_grace_seconds",
                raw.stop_grace_seconds,
                d.stop_grace_seconds,
                |v| in_range(v, &(1..=300)),
            )?,
        })
    }
}
