//! cgroup (being written)
