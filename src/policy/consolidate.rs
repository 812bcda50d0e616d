//! consolidate (being written)
