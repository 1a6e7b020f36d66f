//! Graph builders for model families: a typed config per family and the
//! graphs kvjit builds from it. [`llama`] is the first (and today the
//! only) family; its builders make the example graphs under `examples/`.
//! [`gguf`] builds a Llama-family model and its tokenizer from a GGUF
//! file. Inputs to run them on come from [`scenario`](crate::scenario) or
//! [`generate`](crate::generate).

pub mod gguf;
pub mod llama;
