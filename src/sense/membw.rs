//! membw sensing (being written)
