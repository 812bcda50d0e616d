//! config::daemon: the daemon's own sections: `[agent]` (the loop's interval, the state
//! directory), `[api]` (the D-Bus bus and the group allowed to change things), `[log]` and
//! `[metrics]`. Touches no file.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{absolute, in_range, named_enum, one_of};
use super::{Config, ConfigError, Cx};

/// Valid `agent.interval_ms`. Below 10 ms the agent would spend its time sensing; above a
/// minute it would react to nothing.
pub const INTERVAL_MS_RANGE: RangeInclusive<i64> = 10..=60_000;

/// Valid `agent.command_timeout_ms`: long enough for `tc`/`nft` on a busy node, short enough
/// that a hung one is noticed within the watchdog's patience. Commands run inside the agent's
/// tick: the watchdog stops pinging after 2 ticks and 15 s of no progress (the default 1 s tick:
/// 17 s) and systemd kills lodgerd 30 s (`WatchdogSec=`) after the last ping, which restarts it
/// into the same hung command. 10 s leaves room for a second command in the same tick.
pub const COMMAND_TIMEOUT_MS_RANGE: RangeInclusive<i64> = 100..=10_000;

/// `api.group`'s default: the group the packages create (packaging/sysusers.d) and the shipped
/// D-Bus policy names.
pub const DEFAULT_GROUP: &str = "lodger";

/// Longest group name accepted (shadow-utils' default limit).
const GROUP_NAME_MAX: usize = 32;

/// `[agent]`: the loop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AgentConfig {
    pub interval_ms: u64,
    pub state_dir: PathBuf,
    /// How long an external command (`tc`, `ip`, `nft`) may run before it is killed, reported
    /// and retried at the next tick.
    pub command_timeout_ms: u64,
}

impl AgentConfig {
    /// The agent's tick.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// The deadline of every external command.
    pub fn command_timeout(&self) -> Duration {
        Duration::from_millis(self.command_timeout_ms)
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1000,
            state_dir: PathBuf::from("/var/lib/lodger"),
            command_timeout_ms: 5000,
        }
    }
}

/// `[api]`: the D-Bus surface and who may do what through it (docs/security.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiConfig {
    /// Root and members of this group may make mutating calls.
    pub group: String,
    pub bus: BusKind,
    /// Cgroup subtrees under `/system.slice` that members may register cgroups in (a Slurm or
    /// container runtime root), as paths from the hierarchy root.
    pub cgroup_roots: Vec<String>,
    /// Most jobs one owner may have registered (root's own direct calls are not counted).
    pub max_jobs_per_owner: u32,
    /// Most inference instances one owner's jobs may run together.
    pub max_instances_per_owner: u32,
}

/// Valid per-owner caps: at least one, at most what one node could ever hold.
pub const OWNER_CAP_RANGE: RangeInclusive<i64> = 1..=100_000;

named_enum! {
    /// `api.bus`: which D-Bus bus lodgerd serves on.
    BusKind {
        System => "system",
        /// For tests and development.
        Session => "session",
    }
}

impl Config {
    /// `api.group` against the node's group database, as `exists` answers for a name (`Err`: the
    /// database cannot say). A missing group is refused at the line that names it: a typo would
    /// lock every member out while lodgerd reports nothing wrong. Only warned about (`Ok(Some)`):
    /// a missing default group, which means lodger is not set up yet (started from source, or
    /// before the packages' scripts ran; those create it before lodgerd is ever started) and
    /// refusing would keep root out too; and a lookup that failed (NSS unavailable).
    pub fn check_group(
        &self,
        exists: impl FnOnce(&str) -> Result<bool, String>,
    ) -> Result<Option<String>, ConfigError> {
        let group = &self.api.group;
        match exists(group) {
            Ok(true) => Ok(None),
            Ok(false) if group == DEFAULT_GROUP => Ok(Some(format!(
                "api.group: no group \"{group}\" on this node: only root may register or \
                 unregister jobs until it is created (groupadd --system {group})"
            ))),
            Ok(false) => Err(self.error_at(
                "api.group",
                format!("no such group \"{group}\" on this node (getent group {group})"),
            )),
            Err(e) => Ok(Some(format!(
                "api.group: cannot look up group \"{group}\": {e}; members are checked at \
                 each call"
            ))),
        }
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            group: DEFAULT_GROUP.to_string(),
            bus: BusKind::System,
            // Slurm's jobs on cgroup v2 (docs/slurm.md).
            cgroup_roots: vec!["/system.slice/slurmstepd.scope".to_string()],
            max_jobs_per_owner: 32,
            max_instances_per_owner: 128,
        }
    }
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogConfig {
    pub level: LogLevel,
}

named_enum! {
    /// `log.level`. `as_str` is also a valid `tracing` filter directive.
    LogLevel {
        Error => "error",
        Warn => "warn",
        Info => "info",
        Debug => "debug",
        Trace => "trace",
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: LogLevel::Info,
        }
    }
}

/// `[metrics]`: the Prometheus endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MetricsConfig {
    /// `host:port` to serve `/metrics` on; empty: off.
    pub listen: String,
}

impl MetricsConfig {
    /// The address to listen on, when the endpoint is on (checked at load).
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        self.listen.parse().ok()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawAgent {
    interval_ms: Option<Spanned<i64>>,
    state_dir: Option<Spanned<String>>,
    command_timeout_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawApi {
    group: Option<Spanned<String>>,
    bus: Option<Spanned<String>>,
    cgroup_roots: Option<Spanned<Vec<String>>>,
    max_jobs_per_owner: Option<Spanned<i64>>,
    max_instances_per_owner: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawLog {
    level: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawMetrics {
    listen: Option<Spanned<String>>,
}

impl Cx<'_> {
    pub(super) fn agent(&mut self, raw: Option<RawAgent>) -> Result<AgentConfig, ConfigError> {
        let d = AgentConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(AgentConfig {
            interval_ms: self.field("agent.interval_ms", raw.interval_ms, d.interval_ms, |v| {
                in_range(v, &INTERVAL_MS_RANGE)
            })?,
            state_dir: self.field("agent.state_dir", raw.state_dir, d.state_dir, absolute)?,
            command_timeout_ms: self.field(
                "agent.command_timeout_ms",
                raw.command_timeout_ms,
                d.command_timeout_ms,
                |v| {
                    in_range(v, &COMMAND_TIMEOUT_MS_RANGE).map_err(|e| {
                        format!(
                            "{e}; a command runs inside the agent's tick, and a longer stall \
                             gets lodgerd killed by systemd's watchdog"
                        )
                    })
                },
            )?,
        })
    }

    pub(super) fn api(&mut self, raw: Option<RawApi>) -> Result<ApiConfig, ConfigError> {
        let d = ApiConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(ApiConfig {
            group: self.field("api.group", raw.group, d.group, group_name)?,
            bus: self.field("api.bus", raw.bus, d.bus, |s| {
                one_of(&s, BusKind::from_name, BusKind::NAMES)
            })?,
            cgroup_roots: self.field(
                "api.cgroup_roots",
                raw.cgroup_roots,
                d.cgroup_roots,
                |roots| roots.into_iter().map(cgroup_root).collect(),
            )?,
            max_jobs_per_owner: self.field(
                "api.max_jobs_per_owner",
                raw.max_jobs_per_owner,
                d.max_jobs_per_owner,
                |v| in_range(v, &OWNER_CAP_RANGE),
            )?,
            max_instances_per_owner: self.field(
                "api.max_instances_per_owner",
                raw.max_instances_per_owner,
                d.max_instances_per_owner,
                |v| in_range(v, &OWNER_CAP_RANGE),
            )?,
        })
    }

    pub(super) fn log(&mut self, raw: Option<RawLog>) -> Result<LogConfig, ConfigError> {
        let d = LogConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(LogConfig {
            level: self.field("log.level", raw.level, d.level, |s| {
                one_of(&s, LogLevel::from_name, LogLevel::NAMES)
            })?,
        })
    }

    pub(super) fn metrics(
        &mut self,
        raw: Option<RawMetrics>,
    ) -> Result<MetricsConfig, ConfigError> {
        let d = MetricsConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(MetricsConfig {
            listen: self.field("metrics.listen", raw.listen, d.listen, |s| {
                if s.is_empty() || s.parse::<std::net::SocketAddr>().is_ok() {
                    Ok(s)
                } else {
                    Err(format!(
                        "must be empty (off) or an address and port such as \"127.0.0.1:9464\" (got \"{s}\")"
                    ))
                }
            })?,
        })
    }
}

/// One `api.cgroup_roots` entry: an absolute cgroup path below `/system.slice`, without `.` or
/// `..` components (anything outside `/system.slice` needs no allowing).
fn cgroup_root(value: String) -> Result<String, String> {
    let trimmed = value.trim_end_matches('/');
    let valid = trimmed.starts_with("/system.slice/")
        && !trimmed.split('/').any(|c| c == "." || c == "..")
        && !trimmed.contains("//")
        && !trimmed.contains('\0');
    if valid {
        Ok(trimmed.to_string())
    } else {
        Err(format!(
            "\"{value}\" is not a cgroup below /system.slice (e.g. \"/system.slice/slurmstepd.scope\")"
        ))
    }
}

/// A POSIX-portable group name, as `groupadd` accepts by default: letters, digits, `_` and `-`,
/// not starting with a digit or `-`, an optional trailing `$`.
pub(super) fn group_name(value: String) -> Result<String, String> {
    let body = value.strip_suffix('$').unwrap_or(&value);
    let valid = !body.is_empty()
        && value.len() <= GROUP_NAME_MAX
        && body
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && body
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if valid {
        Ok(value)
    } else {
        Err(format!(
            "\"{value}\" is not a valid group name (up to {GROUP_NAME_MAX} letters, digits, '_' \
             or '-', starting with a letter or '_')"
        ))
    }
}
