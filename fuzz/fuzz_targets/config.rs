//! The config file (`/etc/lodger/lodger.toml`): any text is a config or a `ConfigError`, never
//! a panic.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use lodger::config::Config;

fuzz_target!(|data: &[u8]| {
    // lodgerd reads the file with `read_to_string`: text that is not UTF-8 never reaches the
    // parser.
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = Config::parse(text, Path::new("fuzz.toml")) {
            assert!(!e.to_string().is_empty());
        }
    }
});
