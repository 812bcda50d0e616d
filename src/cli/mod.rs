//! The command lines of `lodgerd` and `lodgerctl` as clap definitions, kept in the library so that
//! the binaries stay thin and the shell completions and man pages (`examples/gen_docs.rs`, run by
//! `scripts/package`) are generated from the very definitions the binaries parse. Touches nothing.

pub mod lodgerctl;
pub mod lodgerd;
