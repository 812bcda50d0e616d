//! signals: what SIGTERM, SIGINT and SIGHUP ask of lodgerd. The handlers are installed once, before
//! lodgerd says READY, and listened to until it stops, so no signal falls between two waits.
//! Touches only the process's signal dispositions.

use tokio::signal::unix::{signal, SignalKind};

/// What a signal asks of lodgerd.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Signal {
    /// SIGTERM, SIGINT.
    Stop,
    /// SIGHUP (`systemctl reload lodgerd`).
    Reload,
}

/// lodgerd's signal streams. A signal that arrives while nobody waits (during a reload) is kept
/// for the next [`Signals::next`]; streams made afresh for each wait missed it, and a SIGHUP
/// before the first wait took its default action, killing lodgerd.
pub(super) struct Signals {
    /// SIGTERM, SIGINT and SIGHUP; `None` when a handler could not be installed.
    streams: Option<[tokio::signal::unix::Signal; 3]>,
}

impl Signals {
    /// Installs the handlers. Must be called on the runtime.
    pub(super) fn new() -> Self {
        let streams = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(term), Ok(int), Ok(hup)) => Some([term, int, hup]),
            _ => None,
        };
        Self { streams }
    }

    /// The next signal, including one that arrived since the last call.
    pub(super) async fn next(&mut self) -> Signal {
        let Some([term, int, hup]) = &mut self.streams else {
            // Without signal handlers the default action (exit) still stops lodgerd.
            std::future::pending::<()>().await;
            return Signal::Stop;
        };
        tokio::select! {
            _ = term.recv() => Signal::Stop,
            _ = int.recv() => Signal::Stop,
            _ = hup.recv() => Signal::Reload,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A SIGTERM that comes while lodgerd is busy with a reload (nobody waiting) stops it at
    /// the next wait: it was lost, and lodgerd ran on until systemd's SIGKILL.
    #[tokio::test]
    async fn a_signal_between_two_waits_is_kept() {
        let mut signals = Signals::new();
        assert!(signals.streams.is_some(), "handlers installed");
        let raise = |s| nix::sys::signal::raise(s).expect("raise");
        raise(nix::sys::signal::Signal::SIGHUP);
        assert_eq!(signals.next().await, Signal::Reload);
        // The stop comes during the reload, and the runtime takes it in meanwhile (it runs the
        // bus and the reload's wait for the agent): `seen` shows when it has.
        let mut seen = signal(SignalKind::terminate()).expect("a second SIGTERM stream");
        raise(nix::sys::signal::Signal::SIGTERM);
        seen.recv().await;
        // A bound on a hang, not a measure of speed: the signal came before this wait.
        let next = tokio::time::timeout(Duration::from_secs(60), signals.next()).await;
        assert_eq!(next.ok(), Some(Signal::Stop), "the SIGTERM was lost");
    }
}
