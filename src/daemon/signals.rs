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

/// Where signals come from: lodgerd's handlers ([`Signals`]), or a test's script.
pub(super) trait SignalSource {
    /// The next signal, including one that arrived since the last call. Cancel-safe: a wait
    /// dropped unfinished loses no signal.
    async fn next(&mut self) -> Signal;
}

impl SignalSource for Signals {
    async fn next(&mut self) -> Signal {
        Signals::next(self).await
    }
}

/// What became of work done while signals were listened to ([`unless_stopped`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum During<T> {
    /// The work finished; `reload_again`: a SIGHUP came meanwhile, asking for another reload.
    Done { value: T, reload_again: bool },
    /// A SIGTERM or SIGINT came first: the work was dropped unfinished.
    Stopped,
}

/// Runs `work` (a reload) until it finishes or a stop is asked: a SIGTERM during a reload whose
/// file read hangs (a dead mount, a name service that does not answer) stops lodgerd at once,
/// not once the read's bound has passed. A SIGHUP meanwhile is kept for one more reload.
pub(super) async fn unless_stopped<T>(
    work: impl std::future::Future<Output = T>,
    signals: &mut impl SignalSource,
) -> During<T> {
    tokio::pin!(work);
    let mut reload_again = false;
    loop {
        // Signals first: one that came by the time the work finished is not left for later.
        tokio::select! {
            biased;
            signal = signals.next() => match signal {
                Signal::Stop => return During::Stopped,
                Signal::Reload => reload_again = true,
            },
            value = &mut work => return During::Done { value, reload_again },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;

    /// Signals a test sends; none more once the sender is dropped.
    impl SignalSource for mpsc::UnboundedReceiver<Signal> {
        async fn next(&mut self) -> Signal {
            match self.recv().await {
                Some(s) => s,
                None => std::future::pending().await,
            }
        }
    }

    /// A stop during work that never finishes (a reload's read on a hung mount) ends the wait.
    #[tokio::test]
    async fn a_stop_during_a_hung_reload_ends_it() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(Signal::Stop).expect("send");
        // A bound on a hang, not a measure of speed: the stop is already there.
        let during = tokio::time::timeout(
            Duration::from_secs(60),
            unless_stopped(std::future::pending::<()>(), &mut rx),
        )
        .await;
        assert_eq!(during.ok(), Some(During::Stopped));
    }

    /// A SIGHUP during a reload is kept for one more; work that finishes with no signal says so.
    #[tokio::test]
    async fn a_reload_asked_during_a_reload_is_kept() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<u32>();
        let work = async { done_rx.await.unwrap_or(0) };
        let during = async {
            tx.send(Signal::Reload).expect("send");
            tokio::task::yield_now().await;
            done_tx.send(7).expect("finish");
        };
        let (result, ()) = tokio::join!(unless_stopped(work, &mut rx), during);
        assert_eq!(
            result,
            During::Done {
                value: 7,
                reload_again: true
            }
        );
        let quiet = unless_stopped(async { 8 }, &mut rx).await;
        assert_eq!(
            quiet,
            During::Done {
                value: 8,
                reload_again: false
            }
        );
    }

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
