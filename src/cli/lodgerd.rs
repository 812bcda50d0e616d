//! `lodgerd`'s command line.

use std::path::PathBuf;

use clap::Parser;

/// The lodger daemon: consolidates GPU training jobs onto dedicated cores with SCHED_RR and
/// serves the org.lodger1 D-Bus API. Usually started by systemd (lodgerd.service).
#[derive(Parser, Debug)]
#[command(name = "lodgerd", version, after_help = AFTER_HELP)]
pub struct Cli {
    /// Configuration file (default /etc/lodger/lodger.toml; built-in defaults when that is absent).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Check the configuration against this node, print the result and exit.
    #[arg(long)]
    pub check_config: bool,
    /// Simulate enforcement: decide and report placements, but change no cgroup and no
    /// scheduling policy (for trying lodger out and for benchmarks on fixture topologies).
    #[arg(long)]
    pub sim: bool,
}

const AFTER_HELP: &str = "\
Exit status:
  0  stopped by SIGTERM or SIGINT, or --check-config found the configuration valid
  1  could not start: enforcement unavailable, the state file unreadable, another lodgerd
     running on the same state directory, the bus name taken
  2  the configuration or the node's topology is invalid

Environment:
  LODGER_LOG               a tracing filter overriding log.level (e.g. debug, lodger=trace)
  DBUS_SYSTEM_BUS_ADDRESS  serve on this bus instead of the system bus (tests, the demo)

Files:
  /etc/lodger/lodger.toml  the configuration
  /var/lib/lodger/         the state (registered jobs and what was changed for them); its
                           lodgerd.lock keeps a second lodgerd off it (agent.state_dir)";
