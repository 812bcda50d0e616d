//! What a previous lodgerd's network control left on the node, removed by a lodgerd that starts
//! with it off: lodger's HTB tree on any interface, its nftables tables, its policy-routing
//! rule and table, its v1 `net_cls` group; and by one that starts with another configuration,
//! all of that but its own. Runs the tools through a [`TcRunner`]; touches nothing else.

use std::path::Path;

use super::nft::NftSteering;
use super::route::{CpuJobsRoute, SlowNetwork};
use super::{
    argv, ClassId, TcError, TcRunner, CPU_JOBS_MARK, DEFAULT_HANDLE, DEFAULT_NFT_TABLE, TC,
};

/// Removes lodger's shaping and routing wherever a previous lodgerd left them (stopping lodgerd
/// leaves them for the jobs that still run, and a config that then drops `[[network.link]]` or
/// `cpu_jobs_interface`, or an interface renamed, leaves no control to remove them): every
/// interface's root HTB qdisc with lodger's handle (`4c44:`; any other root qdisc is left
/// alone), the nftables table `inet lodger`, and the routing of `network.cpu_jobs_interface`
/// (its table, rule and nft table), and on cgroup v1 the `net_cls` group CPU jobs were moved
/// into (`net_cls`: the hierarchy and the group's path in it; its processes go back to the
/// root). Returns what was removed, in words, and the errors met on the way (all are tried). A
/// tool that is not installed, or one this lodgerd has not the rights to run, means nothing of
/// lodger's it could remove is there.
pub fn remove_leftovers(
    runner: &mut dyn TcRunner,
    net_cls: Option<(&Path, &str)>,
) -> (Vec<String>, Vec<TcError>) {
    remove_leftovers_but(runner, Own::default(), net_cls)
}

/// What a starting network control takes as its own of what an earlier lodgerd left (it
/// adopts it for a multi-node job that still runs, or removes it itself), rather than a
/// leftover of another configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct Own<'a> {
    /// Interfaces it shapes: lodger's HTB root on them is its own.
    pub interfaces: &'a [String],
    /// The shaping nftables table `inet lodger`.
    pub shaping_table: bool,
    /// The CPU jobs' route to the slow network.
    pub route: bool,
}

/// [`remove_leftovers`], but for what `own` names: what a configuration that shapes other
/// interfaces, or routes instead of shaping (or the reverse), left.
pub fn remove_leftovers_but(
    runner: &mut dyn TcRunner,
    own: Own<'_>,
    net_cls: Option<(&Path, &str)>,
) -> (Vec<String>, Vec<TcError>) {
    let mut removed = Vec::new();
    let mut errors = Vec::new();
    let mut said = |what: Result<bool, TcError>, words: &str| match what {
        Ok(true) => removed.push(words.to_string()),
        Ok(false) => {}
        Err(e) if nothing_here(&e) => {}
        Err(e) => errors.push(e),
    };
    // One `tc qdisc show` for every interface (a Kubernetes node has hundreds of veths), rather
    // than `Shaper::root` on each.
    match runner.run(&argv(TC, "qdisc show")) {
        Ok(out) => {
            for dev in lodgers_roots(&out) {
                if own.interfaces.iter().any(|i| i == dev) {
                    continue;
                }
                let del = runner.run(&argv(TC, &format!("qdisc del dev {dev} root")));
                said(del.map(|_| true), &format!("the HTB tree on {dev}"));
            }
        }
        Err(e) => said(Err(e), ""),
    }
    if !own.shaping_table {
        let nft = NftSteering::new(DEFAULT_NFT_TABLE).remove(runner);
        said(nft, &format!("the nftables table inet {DEFAULT_NFT_TABLE}"));
    }
    if !own.route {
        // The route's removal names no interface; any valid name builds it.
        let slow = SlowNetwork {
            interface: "lo".to_string(),
            gateway: None,
        };
        let route = CpuJobsRoute::new(slow, CPU_JOBS_MARK).and_then(|r| r.remove(runner));
        said(route, "the CPU jobs' route to the slow network");
    }
    if let Some((hierarchy, relative)) = net_cls {
        let group = super::net_cls::remove_group(hierarchy, relative);
        said(group, &format!("the net_cls group {relative}"));
    }
    (removed, errors)
}

/// The interfaces whose root qdisc `tc qdisc show` lists as lodger's HTB (`qdisc htb 4c44: dev
/// eth0 root ...`).
fn lodgers_roots(shown: &str) -> Vec<&str> {
    shown
        .lines()
        .filter_map(|line| {
            let w: Vec<&str> = line.split_whitespace().collect();
            let ours = ClassId::parse(w.get(2)?).is_some_and(|h| h.major == DEFAULT_HANDLE);
            (w.first() == Some(&"qdisc")
                && w.get(1) == Some(&"htb")
                && ours
                && w.get(3) == Some(&"dev")
                && w.get(5) == Some(&"root"))
            .then(|| w[4])
        })
        .collect()
}

/// A tool that is not installed, or that this lodgerd may not run: nothing of lodger's it
/// could remove is there.
fn nothing_here(e: &TcError) -> bool {
    match e {
        TcError::Spawn { .. } => true,
        TcError::Failed { stderr, .. } => stderr.contains("Operation not permitted"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lodgers_root_htb_is_lodgers() {
        let shown = "qdisc noqueue 0: dev lo root refcnt 2\n\
                     qdisc htb 4c44: dev eth0 root refcnt 2 r2q 10 default 0x10\n\
                     qdisc htb 1: dev eth1 root refcnt 2\n\
                     qdisc htb 4c44: dev eth2 parent 1:1\n\
                     qdisc fq_codel 0: dev eth0 parent 4c44:10 limit 10240p\n";
        assert_eq!(lodgers_roots(shown), ["eth0"]);
        assert!(lodgers_roots("").is_empty());
    }
}
