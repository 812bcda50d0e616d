//! What the agent's loop publishes for the read-only calls: a snapshot of the jobs, the latest
//! observations and the node's status (`handle::Snapshot`), replaced whole after every tick and
//! every command.
//! Readers (`status`, `list`, `show`, `top`, properties, Prometheus) take the current one and never
//! wait on the loop, so a slow enforcement step (an instance ignoring SIGTERM, a hung `tc`) never
//! stalls the control surface. Touches only a lock held for a pointer swap.

use std::sync::{Arc, RwLock};

/// The latest published value (the agent's `Snapshot`), shared by the agent (the only writer)
/// and its handles. Generic so that this file needs nothing of what it holds.
pub(crate) struct Published<T>(Arc<RwLock<Arc<T>>>);

// Not derived: a derived `Clone` would ask `T: Clone`, and only the pointer is cloned.
impl<T> Clone for Published<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> Published<T> {
    pub(crate) fn new(first: T) -> Self {
        Self(Arc::new(RwLock::new(Arc::new(first))))
    }

    /// The snapshot as last published. The lock is held only to clone the pointer.
    pub(crate) fn current(&self) -> Arc<T> {
        match self.0.read() {
            Ok(g) => Arc::clone(&g),
            // A writer never panics while holding the lock (it only swaps a pointer); should one
            // have, the last value is still whole.
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Replaces the snapshot (built outside the lock).
    pub(crate) fn publish(&self, next: T) {
        let next = Arc::new(next);
        match self.0.write() {
            Ok(mut g) => *g = next,
            Err(poisoned) => *poisoned.into_inner() = next,
        }
    }
}
