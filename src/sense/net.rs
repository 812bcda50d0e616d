//! net sensing (being written)
