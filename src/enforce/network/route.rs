//! The two-network alternative to shaping (SODA §V-E): on a node with a second, slower network,
//! CPU jobs' traffic is moved onto it while a multi-node training job runs, leaving the fast
//! network to training, instead of holding CPU jobs to a share of it.
//!
//! Policy routing, through `ip` (iproute2) and `nft`, all of it lodger's own and removed as a
//! whole:
//!
//! ```text
//! nft table inet lodger_route
//!   chain output       type route hook output priority mangle:   <CPU job> meta mark set M
//!   chain postrouting  type nat hook postrouting priority srcnat:
//!                      meta mark M oifname "<slow>" masquerade
//! ip rule  fwmark M lookup T priority P
//! ip route default dev <slow> [via <gateway>] table T
//! ```
//!
//! A `route` chain makes the kernel look the route up again once the mark is set, so marked
//! packets leave by table T. Their source address was chosen on the fast network's route when
//! the socket connected, hence the masquerade: a connection made while the route is in place
//! leaves with the slow interface's address and its replies come back on the slow network.
//! Connections already open when routing starts keep their source address (NAT is decided on
//! a connection's first packet): their packets leave by the slow interface too, and their
//! replies still arrive on the fast one. IPv4 only (`ip -6 rule` is not set): IPv6 traffic of
//! CPU jobs stays where it was.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::{argv, CpuJobMatch, TcError, TcRunner};

/// lodger's routing table and rule priority; the mark is the CPU jobs' class id, as shaping's.
pub const ROUTE_TABLE: u32 = 0x4c44;
pub const RULE_PRIORITY: u32 = 0x4c44;
pub const NFT_ROUTE_TABLE: &str = "lodger_route";

/// `[network] cpu_jobs_interface` / `cpu_jobs_gateway`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlowNetwork {
    pub interface: String,
    /// The next hop on the slow network; `None`: the destination is on its link.
    pub gateway: Option<Ipv4Addr>,
}

/// Puts CPU jobs' IPv4 traffic on the slow network.
#[derive(Debug, Clone)]
pub struct CpuJobsRoute {
    slow: SlowNetwork,
    mark: u32,
}

impl CpuJobsRoute {
    /// `mark` is what CPU jobs' packets carry (shaping's class id, so one value means "CPU
    /// job" everywhere).
    pub fn new(slow: SlowNetwork, mark: u32) -> Result<Self, TcError> {
        super::check_interface(&slow.interface)?;
        Ok(Self { slow, mark })
    }

    pub fn interface(&self) -> &str {
        &self.slow.interface
    }

    fn rule_line(&self) -> String {
        format!(
            "rule add fwmark {:#x} lookup {ROUTE_TABLE} priority {RULE_PRIORITY}",
            self.mark
        )
    }

    fn route_line(&self) -> String {
        match self.slow.gateway {
            Some(gw) => format!(
                "route replace default via {gw} dev {} table {ROUTE_TABLE}",
                self.slow.interface
            ),
            None => format!(
                "route replace default dev {} table {ROUTE_TABLE}",
                self.slow.interface
            ),
        }
    }

    /// The nft script (one transaction) that (re)creates lodger's routing table with `matches`.
    pub fn nft_argv(&self, matches: &[CpuJobMatch]) -> Vec<String> {
        let t = format!("inet {NFT_ROUTE_TABLE}");
        let mut script = format!(
            "add table {t} ; delete table {t} ; add table {t} ; \
             add chain {t} output {{ type route hook output priority mangle ; policy accept ; }} ; \
             add chain {t} postrouting {{ type nat hook postrouting priority srcnat ; policy accept ; }}"
        );
        for m in matches {
            script.push_str(&format!(
                " ; add rule {t} output {} meta mark set {:#010x}",
                m.expression(),
                self.mark
            ));
        }
        script.push_str(&format!(
            " ; add rule {t} postrouting meta mark {:#010x} oifname \"{}\" masquerade",
            self.mark, self.slow.interface
        ));
        argv("nft", &script)
    }

    /// Whether lodger's rule is in `ip rule show`'s output.
    fn rule_present(&self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        let out = runner.run(&argv("ip", "-4 rule show"))?;
        let mark = format!("fwmark {:#x}", self.mark);
        Ok(out.lines().any(|l| {
            l.trim_start().starts_with(&format!("{RULE_PRIORITY}:"))
                && l.contains(&mark)
                && l.contains(&format!("lookup {ROUTE_TABLE}"))
        }))
    }

    /// Routes CPU jobs (`matches`) onto the slow network. Rewrites the nft table and the route
    /// each time (both idempotent, one transaction each); adds the rule only when missing.
    pub fn apply(
        &self,
        runner: &mut dyn TcRunner,
        matches: &[CpuJobMatch],
    ) -> Result<bool, TcError> {
        for m in matches {
            if let CpuJobMatch::CgroupV2(path) = m {
                super::check_cgroup_path(path)?;
            }
        }
        let mut changed = false;
        runner.run(&argv("ip", &self.route_line()))?;
        if !self.rule_present(runner)? {
            runner.run(&argv("ip", &self.rule_line()))?;
            changed = true;
        }
        runner.run(&self.nft_argv(matches))?;
        Ok(changed)
    }

    /// Removes the nft table, the rule and the table's routes. `Ok(true)` if anything was there.
    pub fn remove(&self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        let mut changed = false;
        let list = argv("nft", &format!("list table inet {NFT_ROUTE_TABLE}"));
        match runner.run(&list) {
            Ok(_) => {
                runner.run(&argv(
                    "nft",
                    &format!("delete table inet {NFT_ROUTE_TABLE}"),
                ))?;
                changed = true;
            }
            Err(TcError::Failed { stderr, .. }) if stderr.contains("No such file or directory") => {
            }
            Err(e) => return Err(e),
        }
        // A rule added twice (by hand, or by an older lodger) is deleted as often as it shows.
        for _ in 0..8 {
            if !self.rule_present(runner)? {
                break;
            }
            runner.run(&argv(
                "ip",
                &self.rule_line().replacen("rule add", "rule del", 1),
            ))?;
            changed = true;
        }
        // A table never made is not there to flush (newer kernels say so rather than list it
        // empty).
        let routes = match runner.run(&argv("ip", &format!("-4 route show table {ROUTE_TABLE}"))) {
            Ok(routes) => routes,
            Err(TcError::Failed { stderr, .. }) if stderr.contains("does not exist") => {
                String::new()
            }
            Err(e) => return Err(e),
        };
        if !routes.trim().is_empty() {
            runner.run(&argv("ip", &format!("-4 route flush table {ROUTE_TABLE}")))?;
            changed = true;
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enforce::network::RecordingRunner;

    fn route(gateway: Option<Ipv4Addr>) -> CpuJobsRoute {
        CpuJobsRoute::new(
            SlowNetwork {
                interface: "eth1".into(),
                gateway,
            },
            0x4c44_0020,
        )
        .expect("route")
    }

    #[test]
    fn apply_routes_marks_and_masquerades() {
        let mut r = RecordingRunner::new();
        r.reply(&["ip", "-4", "rule", "show"], "0:\tfrom all lookup local\n");
        let changed = route(Some(Ipv4Addr::new(10, 0, 1, 1)))
            .apply(
                &mut r,
                &[CpuJobMatch::CgroupV2("lodger.slice/lodgers".into())],
            )
            .expect("apply");
        assert!(changed);
        let lines = r.lines();
        assert_eq!(
            lines[0],
            "ip route replace default via 10.0.1.1 dev eth1 table 19524"
        );
        assert_eq!(lines[1], "ip -4 rule show");
        assert_eq!(
            lines[2],
            "ip rule add fwmark 0x4c440020 lookup 19524 priority 19524"
        );
        assert!(lines[3].starts_with("nft add table inet lodger_route ; delete table"));
        assert!(lines[3].contains(
            "add rule inet lodger_route output socket cgroupv2 level 2 \"lodger.slice/lodgers\" meta mark set 0x4c440020"
        ));
        assert!(lines[3].ends_with(
            "add rule inet lodger_route postrouting meta mark 0x4c440020 oifname \"eth1\" masquerade"
        ));
    }

    #[test]
    fn a_present_rule_is_not_added_twice_and_remove_takes_everything() {
        let mut r = RecordingRunner::new();
        r.reply(
            &["ip", "-4", "rule", "show"],
            "0:\tfrom all lookup local\n19524:\tfrom all fwmark 0x4c440020 lookup 19524\n",
        );
        let changed = route(None)
            .apply(&mut r, &[CpuJobMatch::NetClsClassid(0x4c44_0020)])
            .expect("apply");
        assert!(!changed);
        assert_eq!(
            r.lines()[0],
            "ip route replace default dev eth1 table 19524"
        );
        assert!(!r.lines().iter().any(|l| l.starts_with("ip rule add")));
        assert!(r.lines()[2].contains("meta cgroup 1279524896 meta mark set 0x4c440020"));

        let mut r = RecordingRunner::new();
        r.reply(&["nft", "list"], "table inet lodger_route {}\n")
            .reply(
                &["ip", "-4", "rule", "show"],
                "19524:\tfrom all fwmark 0x4c440020 lookup 19524\n",
            )
            .reply(
                &["ip", "-4", "route", "show"],
                "default dev eth1 scope link\n",
            );
        assert!(route(None).remove(&mut r).is_ok());
        let changes = r.changes().join("\n");
        assert!(
            changes.contains("nft delete table inet lodger_route"),
            "{changes}"
        );
        assert!(changes.contains("ip rule del fwmark 0x4c440020 lookup 19524 priority 19524"));
        assert!(changes.contains("ip -4 route flush table 19524"));
    }

    #[test]
    fn remove_on_a_clean_node_changes_nothing() {
        let mut r = RecordingRunner::new();
        r.fail(
            &["nft", "list"],
            "Error: No such file or directory\nlist table inet lodger_route",
        )
        .reply(&["ip", "-4", "rule", "show"], "0:\tfrom all lookup local\n");
        assert!(!route(None).remove(&mut r).expect("remove"));
        assert!(r
            .changes()
            .iter()
            .all(|l| !l.contains(" del") && !l.contains("flush")));
    }
}
