//! Who each caller on lodgerd's bus connection is, remembered per connection (issue 21).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Who each caller on lodgerd's bus connection is (uid, pid), as the bus daemon said. A
/// connection's credentials are fixed when it connects (the bus reads them from the socket) and
/// a bus never gives a unique name to a second connection, so the first answer serves every
/// later call from that name (issue 21: asking was a bus round trip on every mutating call,
/// 0.2 ms of a registration's 1.8 ms p50). Held per lodgerd connection, since another bus may
/// give the same names to others. At most [`Peers::KEPT`] names, the oldest forgotten first.
#[derive(Default)]
pub struct Peers {
    known: Mutex<KnownPeers>,
}

/// A peer's uid and pid.
type Who = (u32, Option<u32>);

#[derive(Default)]
struct KnownPeers {
    by_name: HashMap<String, Who>,
    /// The names in the order they were first seen.
    order: VecDeque<String>,
}

impl Peers {
    pub const KEPT: usize = 256;

    pub(super) fn get(&self, name: &str) -> Option<Who> {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.by_name.get(name).copied()
    }

    pub(super) fn insert(&self, name: &str, who: Who) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.by_name.insert(name.to_string(), who).is_none() {
            known.order.push_back(name.to_string());
        }
        while known.order.len() > Self::KEPT {
            if let Some(oldest) = known.order.pop_front() {
                known.by_name.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_answered_as_the_bus_first_said() {
        let peers = Peers::default();
        assert_eq!(peers.get(":1.7"), None);
        peers.insert(":1.7", (1000, Some(42)));
        peers.insert(":1.8", (0, None));
        assert_eq!(peers.get(":1.7"), Some((1000, Some(42))));
        assert_eq!(peers.get(":1.8"), Some((0, None)));
        assert_eq!(peers.get(":1.9"), None);
    }

    #[test]
    fn at_most_kept_names_are_held_and_the_oldest_go_first() {
        let peers = Peers::default();
        for i in 0..Peers::KEPT + 10 {
            peers.insert(&format!(":1.{i}"), (u32::try_from(i).unwrap_or(0), None));
        }
        // A name seen again keeps its place rather than taking a second one.
        peers.insert(&format!(":1.{}", Peers::KEPT + 9), (7, None));
        let known = peers.known.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(known.by_name.len(), Peers::KEPT);
        assert_eq!(known.order.len(), Peers::KEPT);
        drop(known);
        for i in 0..10 {
            assert_eq!(
                peers.get(&format!(":1.{i}")),
                None,
                "name {i} was not forgotten"
            );
        }
        assert_eq!(peers.get(":1.10"), Some((10, None)));
        assert_eq!(
            peers.get(&format!(":1.{}", Peers::KEPT + 9)),
            Some((7, None))
        );
    }
}
