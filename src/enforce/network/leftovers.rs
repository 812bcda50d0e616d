//! What a previous lodgerd's network control left on the node, removed by a lodgerd that starts
//! with it off: lodger's HTB tree on any interface, its nftables tables, its policy-routing
//! rule and table. Runs the tools through a [`TcRunner`]; touches nothing else.

use super::route::{CpuJobsRoute, SlowNetwork};
use super::{TcError, TcRunner, CPU_JOBS_MARK, DEFAULT_HANDLE, DEFAULT_NFT_TABLE};

/// Removes lodger's shaping and routing wherever a previous lodgerd left them (stopping lodgerd
/// leaves them for the jobs that still run, and a config that then drops `[[network.link]]` or
/// `cpu_jobs_interface`, or an interface renamed, leaves no control to remove them): every
/// interface's root HTB qdisc with lodger's handle (`4c44:`; any other root qdisc is left
/// alone), the nftables table `inet lodger`, and the routing of `network.cpu_jobs_interface`
/// (its table, rule and nft table). Returns what was removed, in words, and the errors met on
/// the way (all are tried). A tool that is not installed, or a table this lodgerd has not the
/// rights to list, means nothing of lodger's it could remove is there.
pub fn remove_leftovers(runner: &mut dyn TcRunner) -> (Vec<String>, Vec<TcError>) {
    let mut removed = Vec::new();
    let mut errors = Vec::new();
    let run = |runner: &mut dyn TcRunner, line: &str| {
        let argv: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        runner.run(&argv)
    };
    match run(runner, "tc qdisc show") {
        Ok(out) => {
            let ours = format!("qdisc htb {DEFAULT_HANDLE:x}: dev ");
            for line in out.lines() {
                let Some(rest) = line.strip_prefix(&ours) else {
                    continue;
                };
                let mut words = rest.split_whitespace();
                let (Some(dev), Some("root")) = (words.next(), words.next()) else {
                    continue;
                };
                match run(runner, &format!("tc qdisc del dev {dev} root")) {
                    Ok(_) => removed.push(format!("the HTB tree on {dev}")),
                    Err(e) => errors.push(e),
                }
            }
        }
        Err(TcError::Spawn { .. }) => {}
        Err(e) => errors.push(e),
    }
    match run(runner, &format!("nft list table inet {DEFAULT_NFT_TABLE}")) {
        Ok(_) => match run(
            runner,
            &format!("nft delete table inet {DEFAULT_NFT_TABLE}"),
        ) {
            Ok(_) => removed.push(format!("the nftables table inet {DEFAULT_NFT_TABLE}")),
            Err(e) => errors.push(e),
        },
        Err(TcError::Spawn { .. }) => {}
        // Not there, or not for this lodgerd to see (one without the rights made none).
        Err(TcError::Failed { stderr, .. })
            if stderr.contains("No such file or directory")
                || stderr.contains("Operation not permitted") => {}
        Err(e) => errors.push(e),
    }
    // The route's removal names no interface; any valid name builds it.
    let slow = SlowNetwork {
        interface: "lo".to_string(),
        gateway: None,
    };
    match CpuJobsRoute::new(slow, CPU_JOBS_MARK).map(|r| r.remove(runner)) {
        Ok(Ok(true)) => removed.push("the CPU jobs' route to the slow network".to_string()),
        Ok(Ok(false)) | Ok(Err(TcError::Spawn { .. })) => {}
        Ok(Err(TcError::Failed { stderr, .. })) if stderr.contains("Operation not permitted") => {}
        Ok(Err(e)) | Err(e) => errors.push(e),
    }
    (removed, errors)
}
