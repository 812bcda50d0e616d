//! The NRI messages and ttrpc service code, generated at build time from proto/nri/api.proto
//! (lodger's own definitions of the part of NRI it speaks) by `ttrpc-codegen`.

/// Messages and enums.
#[allow(warnings, clippy::all, clippy::pedantic, clippy::unwrap_used)]
pub mod api {
    include!(concat!(env!("OUT_DIR"), "/nri/api.rs"));
}

/// The `Runtime` client and the `Plugin` service (and the other way round, for the tests' fake
/// runtime).
#[allow(warnings, clippy::all, clippy::pedantic, clippy::unwrap_used)]
pub mod api_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/nri/api_ttrpc.rs"));
}

pub use api::*;
