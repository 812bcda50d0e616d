//! The state file (`/var/lib/lodger/state.json`), as lodgerd reads it at start: any text is a
//! state (current, or migrated from an older version) or an error with a message, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lodger::store;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        match store::parse(text) {
            Ok(parsed) => assert_eq!(parsed.state.version, store::STATE_VERSION),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
});
