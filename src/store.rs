//! store (being written)
