//! The CPU kernel, its code in `emit.rs` until the split that follows.

mod emit;

pub use emit::*;
