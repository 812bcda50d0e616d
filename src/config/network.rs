//! config::network: `[network]` and `[[network.link]]` (SODA §V-E): shaping or the
//! two-network option while a multi-node training job runs. Uses the shaping vocabulary of
//! `enforce::network` and `enforce::network::route` (interface names, links, settings); touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{in_range, named_enum, one_of};
use super::{ConfigError, Cx};

/// `[network]`: SODA §V-E network shaping while a multi-node training job runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkSection {
    /// The interfaces to shape (`[[network.link]]`); none: shaping is off.
    pub link: Vec<crate::enforce::network::Link>,
    pub training_percent: u32,
    pub cpu_jobs_percent: u32,
    pub cpu_jobs_ceil_percent: u32,
    pub steering: NetSteering,
    pub replace_foreign_root: bool,
    /// The two-network option: CPU jobs' traffic goes out this (slower) interface while
    /// multi-node training runs, instead of being shaped; empty: off.
    pub cpu_jobs_interface: String,
    /// The next hop on that network; `None`: destinations are on its link.
    pub cpu_jobs_gateway: Option<std::net::Ipv4Addr>,
}

impl Default for NetworkSection {
    fn default() -> Self {
        let d = crate::enforce::network::ShapingConfig::default();
        Self {
            link: Vec::new(),
            training_percent: d.training_percent,
            cpu_jobs_percent: d.cpu_jobs_percent,
            cpu_jobs_ceil_percent: d.cpu_jobs_ceil_percent,
            steering: NetSteering::Auto,
            replace_foreign_root: d.replace_foreign_root,
            cpu_jobs_interface: String::new(),
            cpu_jobs_gateway: None,
        }
    }
}

impl NetworkSection {
    /// The two-network option's slower network, when `cpu_jobs_interface` is set.
    pub fn slow_network(&self) -> Option<crate::enforce::network::route::SlowNetwork> {
        (!self.cpu_jobs_interface.is_empty()).then(|| crate::enforce::network::route::SlowNetwork {
            interface: self.cpu_jobs_interface.clone(),
            gateway: self.cpu_jobs_gateway,
        })
    }

    /// The shaping settings, or `None` when no interface is configured (shaping off).
    pub fn shaping(&self) -> Option<crate::enforce::network::ShapingConfig> {
        if self.link.is_empty() {
            return None;
        }
        Some(crate::enforce::network::ShapingConfig {
            links: self.link.clone(),
            training_percent: self.training_percent,
            cpu_jobs_percent: self.cpu_jobs_percent,
            cpu_jobs_ceil_percent: self.cpu_jobs_ceil_percent,
            replace_foreign_root: self.replace_foreign_root,
            ..crate::enforce::network::ShapingConfig::default()
        })
    }
}

named_enum! {
    /// `network.steering`: how CPU jobs' packets reach their HTB class.
    NetSteering {
        /// tc filters where the kernel has the classifier, else nftables.
        Auto => "auto",
        /// v1: `cgroup` filter on `net_cls.classid`; v2: nftables mark + `fw` filter.
        TcFilter => "tc-filter",
        /// nftables sets the packets' priority to the class; no tc filter.
        Nft => "nft",
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawNetwork {
    link: Option<Vec<Spanned<RawLink>>>,
    training_percent: Option<Spanned<i64>>,
    cpu_jobs_percent: Option<Spanned<i64>>,
    cpu_jobs_ceil_percent: Option<Spanned<i64>>,
    steering: Option<Spanned<String>>,
    replace_foreign_root: Option<Spanned<bool>>,
    cpu_jobs_interface: Option<Spanned<String>>,
    cpu_jobs_gateway: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawLink {
    interface: Option<Spanned<String>>,
    line_rate_mbit: Option<Spanned<i64>>,
}

impl Cx<'_> {
    pub(super) fn network(
        &mut self,
        raw: Option<RawNetwork>,
    ) -> Result<NetworkSection, ConfigError> {
        let d = NetworkSection::default();
        let Some(raw) = raw else { return Ok(d) };
        let percent = |v| in_range(v, &(1..=100));
        let mut link = Vec::new();
        for (i, entry) in raw.link.unwrap_or_default().into_iter().enumerate() {
            let key = format!("network.link[{i}]");
            let span = entry.span();
            self.lines.insert(key.clone(), self.line(span.start));
            let entry = entry.into_inner();
            let (Some(interface), Some(rate)) = (entry.interface, entry.line_rate_mbit) else {
                return Err(ConfigError::Invalid {
                    at: self.at(Some(span)),
                    key,
                    message: "each [[network.link]] needs interface and line_rate_mbit".into(),
                });
            };
            let interface = self.field(
                &format!("{key}.interface"),
                Some(interface),
                String::new(),
                |s| {
                    if crate::enforce::network::check_interface(&s).is_ok() {
                        Ok(s)
                    } else {
                        Err(format!("'{s}' is not an interface name"))
                    }
                },
            )?;
            if link
                .iter()
                .any(|l: &crate::enforce::network::Link| l.interface == interface)
            {
                return Err(self.error_here(
                    &format!("{key}.interface"),
                    format!("{interface} is listed twice"),
                ));
            }
            let line_rate_mbit =
                self.field(&format!("{key}.line_rate_mbit"), Some(rate), 0, |v| {
                    in_range(v, &(1..=10_000_000))
                })?;
            link.push(crate::enforce::network::Link {
                interface,
                line_rate_mbit,
            });
        }
        let section = NetworkSection {
            link,
            training_percent: self.field(
                "network.training_percent",
                raw.training_percent,
                d.training_percent,
                percent,
            )?,
            cpu_jobs_percent: self.field(
                "network.cpu_jobs_percent",
                raw.cpu_jobs_percent,
                d.cpu_jobs_percent,
                percent,
            )?,
            cpu_jobs_ceil_percent: self.field(
                "network.cpu_jobs_ceil_percent",
                raw.cpu_jobs_ceil_percent,
                d.cpu_jobs_ceil_percent,
                percent,
            )?,
            steering: self.field("network.steering", raw.steering, d.steering, |s| {
                one_of(&s, NetSteering::from_name, NetSteering::NAMES)
            })?,
            replace_foreign_root: self.field(
                "network.replace_foreign_root",
                raw.replace_foreign_root,
                d.replace_foreign_root,
                Ok,
            )?,
            cpu_jobs_interface: self.field(
                "network.cpu_jobs_interface",
                raw.cpu_jobs_interface,
                d.cpu_jobs_interface,
                |s| {
                    if s.is_empty() || crate::enforce::network::check_interface(&s).is_ok() {
                        Ok(s)
                    } else {
                        Err(format!("'{s}' is not an interface name"))
                    }
                },
            )?,
            cpu_jobs_gateway: self.field(
                "network.cpu_jobs_gateway",
                raw.cpu_jobs_gateway,
                d.cpu_jobs_gateway,
                |s| {
                    if s.is_empty() {
                        return Ok(None);
                    }
                    s.parse::<std::net::Ipv4Addr>()
                        .map(Some)
                        .map_err(|_| format!("'{s}' is not an IPv4 address (empty: none)"))
                },
            )?,
        };
        if !section.cpu_jobs_interface.is_empty() && !section.link.is_empty() {
            return Err(self.error_here(
                "network.cpu_jobs_interface",
                "moves CPU jobs to another network instead of shaping: remove either it or \
                 the [[network.link]] tables"
                    .into(),
            ));
        }
        if section.cpu_jobs_gateway.is_some() && section.cpu_jobs_interface.is_empty() {
            return Err(self.error_here(
                "network.cpu_jobs_gateway",
                "is set without network.cpu_jobs_interface".into(),
            ));
        }
        if section.training_percent + section.cpu_jobs_percent > 100 {
            return Err(self.error_here(
                "network.cpu_jobs_percent",
                format!(
                    "training {}% + CPU jobs {}% is more than the line rate",
                    section.training_percent, section.cpu_jobs_percent
                ),
            ));
        }
        if section.cpu_jobs_ceil_percent < section.cpu_jobs_percent {
            return Err(self.error_here(
                "network.cpu_jobs_ceil_percent",
                format!(
                    "{} is below cpu_jobs_percent ({}): CPU jobs could not use their own share",
                    section.cpu_jobs_ceil_percent, section.cpu_jobs_percent
                ),
            ));
        }
        Ok(section)
    }
}
