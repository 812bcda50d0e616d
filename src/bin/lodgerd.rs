//! lodgerd: the lodger daemon's entry point. Parses the command line, reads the config and the
//! node (`--check-config` stops there), sets up logging and hands over to `lodger::daemon`,
//! which re-adopts the jobs in the state file, runs the agent loop and serves `org.lodger1` on
//! D-Bus until SIGTERM/SIGINT.

use std::process::ExitCode;

use clap::Parser;

use lodger::cli::lodgerd::Cli;
use lodger::daemon;

fn init_logging(level: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("LODGER_LOG").unwrap_or_else(|_| EnvFilter::new(level));
    // Under systemd, records go to the journal natively: each field (the audit record's
    // caller_uid, action, outcome ...) becomes a journal field an operator can filter on
    // (`journalctl CALLER_UID=1001`, docs/security.md). Elsewhere, or when the journal's
    // socket cannot be opened, as text on stderr.
    let under_journal = std::env::var_os("JOURNAL_STREAM").is_some();
    if under_journal {
        if let Ok(journal) = tracing_journald::layer() {
            tracing_subscriber::registry()
                .with(filter)
                .with(journal.with_syslog_identifier("lodgerd".into()))
                .init();
            return;
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!under_journal && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if under_journal {
        builder.without_time().with_target(false).init();
    } else {
        builder.with_target(false).init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let prepared = match daemon::prepare(cli.config.as_deref()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("lodgerd: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.check_config {
        println!("configuration OK: {}", prepared.summary());
        return ExitCode::SUCCESS;
    }
    init_logging(&prepared.config.log.level.to_string());
    daemon::run(prepared, cli.sim)
}
