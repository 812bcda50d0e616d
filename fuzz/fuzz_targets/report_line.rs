//! One line of the instance report protocol (`docs/instance-protocol.md`), as an instance
//! writes it to its pipe: any bytes are a `Report` or an error with a message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lodger::enforce::instances::parse_report;

fuzz_target!(|data: &[u8]| {
    match parse_report(data) {
        Ok(r) => {
            assert!(r.latency_ms.is_finite() && r.latency_ms >= 0.0);
            assert!(r.queue_ms.is_none_or(|q| q.is_finite() && q >= 0.0));
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
