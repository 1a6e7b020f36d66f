//! Graph builders for model families: a typed config per family and the
//! graphs kvjit builds from it. [`llama`] is the first (and today the
//! only) family; its builders make the example graphs under `examples/`.
//! Inputs to run them on come from [`scenario`](crate::scenario).

pub mod llama;
