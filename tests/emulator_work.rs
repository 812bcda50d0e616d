//! The training emulator's work in rows and its calibration (`examples/train_emulator/work.rs`):
//! its unit tests run here, since `cargo test` builds the examples but runs none of their tests
//! (and an example built as a test is no longer built as the program the other tests run).
#[allow(dead_code)]
#[path = "../examples/train_emulator/work.rs"]
mod work;
