//! Pure decisions: no I/O.

pub mod consolidate;
