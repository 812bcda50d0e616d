//! gpu sensing (being written)
