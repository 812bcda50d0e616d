//! cpu sensing (being written)
