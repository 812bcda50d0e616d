//! The state file (`/var/lib/lodger/state.json`), as lodgerd reads it at start: any text is a
//! state (current, or migrated from an older version) or an error with a message, never a panic.
//! A state that reads is then used as lodgerd would: each right-sizing tuner read back is
//! stepped through a window (its search goes on from whatever the file says).
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use lodger::store;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match store::parse(text) {
        Ok(parsed) => {
            assert_eq!(parsed.state.version, store::STATE_VERSION);
            let mut state = parsed.state;
            for stored in state.jobs.values_mut() {
                if let Some(tuning) = &mut stored.tuning {
                    let tuner = &mut tuning.tuner;
                    let start = Duration::from_secs(1_800_000_000);
                    for s in 0..8u64 {
                        let now = start + Duration::from_secs(s * 3600);
                        let _ =
                            tuner.step(now, &[50.0, 51.0, 49.0, 50.5, 49.5, 50.0, 50.2], s == 5);
                        let _ = tuner.cores();
                    }
                }
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
