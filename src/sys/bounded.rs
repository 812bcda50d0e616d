//! Blocking work that may never return (a `stat` on a hung network or FUSE mount, an NSS look-up
//! while the directory server is down) run on a thread of its own and waited for at most a
//! bound, with a cap on how many such threads may still be running: [`BoundedThreads`], waited
//! for from a plain thread ([`BoundedThreads::run`]) or from a task ([`BoundedThreads::run_async`]).
//! Hand-written: no crate bounds a blocking system call's wait; a thread stuck in one cannot be
//! stopped, only left, and the cap keeps such threads from piling up.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use tokio::sync::oneshot;

/// Why work run by [`BoundedThreads`] gave no answer.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BoundedError {
    /// It did not return within the bound; it runs on, and its answer is dropped.
    #[error("it did not finish within {0:?}")]
    TimedOut(Duration),
    /// As many earlier runs as the cap allows are still running, past their bound.
    #[error("{}", busy(*.0))]
    Busy(u32),
    #[error("cannot start a thread for it: {0}")]
    Spawn(String),
    #[error("it panicked")]
    Panicked,
}

fn busy(cap: u32) -> String {
    if cap == 1 {
        "the one before is still running, past its bound".to_string()
    } else {
        format!("{cap} started before are still running, past their bound")
    }
}

/// Runs blocking work on threads of its own (named `name`), at most `cap` of them at once.
/// Threads rather than tokio's `spawn_blocking`: work that never returns would also keep the
/// runtime from shutting down, as dropping it waits for its blocking tasks. A thread counts
/// until its work returns, whether or not anyone still waits for it: while `cap` of them hang,
/// new work is refused ([`BoundedError::Busy`]) rather than stacking threads up.
#[derive(Debug)]
pub struct BoundedThreads {
    name: &'static str,
    cap: u32,
    running: Arc<AtomicU32>,
}

impl BoundedThreads {
    pub fn new(name: &'static str, cap: u32) -> Self {
        Self {
            name,
            cap,
            running: Arc::new(AtomicU32::new(0)),
        }
    }

    /// Threads whose work has not returned yet (hung ones among them).
    pub fn running(&self) -> u32 {
        self.running.load(Ordering::Acquire)
    }

    /// Starts `work` on a thread of its own if fewer than the cap run; `answer` gets its result
    /// on that thread, after the thread has stopped counting (whoever gets the answer may start
    /// the next run at once). A panic in `work` gives `answer` nothing.
    fn start<T>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
        answer: impl FnOnce(T) + Send + 'static,
    ) -> Result<(), BoundedError> {
        let cap = self.cap;
        if self
            .running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .is_err()
        {
            return Err(BoundedError::Busy(cap));
        }
        let running = self.running.clone();
        let spawned = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || {
                let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
                running.fetch_sub(1, Ordering::AcqRel);
                if let Ok(value) = done {
                    answer(value);
                }
            });
        spawned.map(drop).map_err(|e| {
            self.running.fetch_sub(1, Ordering::AcqRel);
            BoundedError::Spawn(e.to_string())
        })
    }

    /// `work`'s result, or why there is none within `bound`, blocking the calling thread for at
    /// most `bound`. `work` that outlives the bound runs on; its result is dropped.
    pub fn run<T: Send + 'static>(
        &self,
        bound: Duration,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, BoundedError> {
        let (tx, rx) = mpsc::channel();
        // The receiver is gone once the bound passed: nobody wants the result.
        self.start(work, move |value| drop(tx.send(value)))?;
        match rx.recv_timeout(bound) {
            Ok(value) => Ok(value),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(BoundedError::Panicked),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(BoundedError::TimedOut(bound)),
        }
    }

    /// [`Self::run`] for a task: it waits on tokio's clock and holds no runtime worker.
    pub async fn run_async<T: Send + 'static>(
        &self,
        bound: Duration,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, BoundedError> {
        let (tx, rx) = oneshot::channel();
        self.start(work, move |value| drop(tx.send(value)))?;
        match tokio::time::timeout(bound, rx).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) => Err(BoundedError::Panicked),
            Err(_) => Err(BoundedError::TimedOut(bound)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work that hangs past its bound keeps its thread counted: with the cap reached, more work
    /// is refused without starting a thread, and once the hung work returns there is room again.
    /// A panic is an answer of its own and frees its thread.
    #[test]
    fn hung_work_holds_its_place_until_it_returns() {
        let threads = BoundedThreads::new("lodger-test", 2);
        let mut releases = Vec::new();
        let (ended_tx, ended) = mpsc::channel::<()>();
        for _ in 0..2 {
            let (release, hung) = mpsc::channel::<()>();
            releases.push(release);
            let ended_tx = ended_tx.clone();
            let err = threads.run(Duration::from_millis(1), move || {
                let _ = hung.recv();
                let _ = ended_tx.send(());
            });
            assert_eq!(err, Err(BoundedError::TimedOut(Duration::from_millis(1))));
        }
        assert_eq!(threads.running(), 2);
        let err = threads.run(Duration::from_secs(30), || 7);
        assert_eq!(err, Err(BoundedError::Busy(2)));
        assert_eq!(
            err.map_err(|e| e.to_string()),
            Err("2 started before are still running, past their bound".to_string())
        );

        drop(releases);
        for _ in 0..2 {
            ended.recv().expect("the hung work ends");
        }
        while threads.running() > 0 {
            // Each thread stops counting right after its work: wait for that, not for time.
            std::thread::yield_now();
        }
        assert_eq!(threads.run(Duration::from_secs(30), || 7), Ok(7));
        let panics = threads.run(Duration::from_secs(30), || -> u32 { panic!("work bug") });
        assert_eq!(panics, Err(BoundedError::Panicked));
        assert_eq!(threads.running(), 0);
    }
}
