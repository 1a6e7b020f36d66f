//! kvjit
