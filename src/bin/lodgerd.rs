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
    let under_journal = stderr_is_the_journal();
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

/// Whether stderr is the journal's stream: systemd sets `JOURNAL_STREAM` to its device and
/// inode (`systemd.exec(5)`), and a process that inherited the variable but whose stderr went
/// elsewhere (a test harness run by a systemd unit, a shell in a service redirecting to a file)
/// must not take it for the journal; the man page asks for this comparison.
fn stderr_is_the_journal() -> bool {
    use std::os::fd::AsFd;
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    nix::sys::stat::fstat(std::io::stderr().as_fd())
        .is_ok_and(|st| journal_stream_is(&value, st.st_dev, st.st_ino))
}

/// `JOURNAL_STREAM`'s `DEVICE:INODE` names the file `dev` and `ino` identify.
fn journal_stream_is(value: &std::ffi::OsStr, dev: libc::dev_t, ino: libc::ino_t) -> bool {
    value
        .to_str()
        .and_then(|v| v.split_once(':'))
        .is_some_and(|(d, i)| d.parse() == Ok(dev) && i.parse() == Ok(ino))
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
        for w in &prepared.warnings {
            eprintln!("lodgerd: warning: {w}");
        }
        println!("configuration OK: {}", prepared.summary());
        return ExitCode::SUCCESS;
    }
    init_logging(&prepared.config.log.level.to_string());
    daemon::run(prepared, cli.sim)
}

#[cfg(test)]
mod tests {
    use super::journal_stream_is;
    use std::ffi::OsStr;

    #[test]
    fn the_journal_stream_is_the_one_named_by_device_and_inode() {
        assert!(journal_stream_is(OsStr::new("8:1234"), 8, 1234));
        assert!(
            !journal_stream_is(OsStr::new("8:1234"), 8, 1235),
            "another inode"
        );
        assert!(
            !journal_stream_is(OsStr::new("9:1234"), 8, 1234),
            "another device"
        );
        assert!(!journal_stream_is(OsStr::new("8"), 8, 1234), "no inode");
        assert!(!journal_stream_is(OsStr::new(""), 8, 1234));
        assert!(!journal_stream_is(OsStr::new("x:y"), 8, 1234));
    }
}
