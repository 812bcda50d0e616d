//! perf sensing (being written)
