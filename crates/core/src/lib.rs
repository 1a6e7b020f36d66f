//! Core types of kvjit: element types ([`DType`]), host tensors ([`Tensor`]),
//! the paged KV cache ([`PagedKVCacheCollection`]), the canonical kernel name
//! ([`KernelKey`]) and the one error enum shared by every layer that touches
//! tensors or caches ([`Error`]).
//!
//! Start with [`PagedKVCacheCollection::new`] to allocate a cache and
//! [`Tensor::random`] / [`Tensor::from_f32`] to make inputs. This crate depends
//! on no other kvjit crate; everything else builds on it.

mod dtype;
mod error;
pub mod fp8;
pub mod json;
mod kernel_key;
mod kv_cache;
pub mod quant;
mod safetensors_io;
mod tensor;

pub use dtype::{Backend, CodeTier, CpuTier, DType, Element, Target};
pub use error::{Error, Result};
pub use fp8::F8E4M3;
pub use kernel_key::{KernelKey, KernelSpec, KeyField};
pub use kv_cache::{CacheElement, KvCacheParams, PagedKVCacheCollection, UNASSIGNED_PAGE};
pub use safetensors_io::{
    LoadedTensors, SafetensorsHeader, WeightLoad, copy_to_anonymous, load_safetensors, map_file, open_regular_file,
    read_regular_file, read_safetensors, read_safetensors_header, tensors_from_safetensors, tensors_to_safetensors,
    write_safetensors,
};
pub use tensor::{MappedBytes, PreparedConstant, Storable, Tensor, TensorData, expect_arg, shape_mismatch};

/// Re-exported so users name the same `bf16`/`f16` types kvjit uses.
pub use half::{bf16, f16};
