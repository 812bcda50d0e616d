//! What the bundled workloads share: stopping cleanly on SIGTERM/SIGINT, and the size of the
//! last-level cache (to size working sets against it).
#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

/// Set by SIGTERM or SIGINT once [`install_signal_handlers`] ran.
pub static STOP: AtomicBool = AtomicBool::new(false);

pub extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

pub fn install_signal_handlers() -> nix::Result<()> {
    let stop = SigAction::new(
        SigHandler::Handler(on_stop),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to a lock-free static atomic, which is
    // async-signal-safe.
    unsafe {
        sigaction(Signal::SIGTERM, &stop)?;
        sigaction(Signal::SIGINT, &stop)?;
    }
    Ok(())
}

/// The largest data or unified cache of CPU 0, in bytes, if sysfs says.
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let read = |name: &str| std::fs::read_to_string(path.join(name)).ok();
        let Some(level) = read("level").and_then(|s| s.trim().parse::<u32>().ok()) else {
            continue;
        };
        if read("type").is_some_and(|t| t.trim() == "Instruction") {
            continue;
        }
        let Some(size) = read("size").and_then(|s| parse_cache_size(s.trim())) else {
            continue;
        };
        match best {
            Some((deepest, _)) if deepest >= level => {}
            _ => best = Some((level, size)),
        }
    }
    best.map(|(_, size)| size)
}

/// sysfs cache sizes read like `32768K` or `32M`.
pub fn parse_cache_size(text: &str) -> Option<u64> {
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(scale)
}
