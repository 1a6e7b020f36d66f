//! The op's own contract errors (carried as `kvjit_core::Error::Op`,
//! downcast with `Error::op_error::<AttentionError>()`). Shared checks
//! (dtypes, shapes, layer, valid lengths, page table) are core's variants.

use crate::OP_NAME;

/// A call this op's kernels refuse, beyond the shared argument checks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttentionError {
    /// Not the op's argument list: 3 tensors, 1 cache (and 1 output).
    #[error("arguments: expected {expected}, got {got:?}")]
    Arguments {
        /// What the kernel takes.
        expected: &'static str,
        /// Tensors, caches (and outputs) it was handed.
        got: Vec<usize>,
    },
    /// The cache's layout is not the one the kernel was built for.
    #[error("kv_collection: {what} is {got}, but the op was built for {expected}")]
    CacheLayout {
        /// Which parameter.
        what: &'static str,
        /// The kernel's value.
        expected: String,
        /// The cache's value.
        got: String,
    },
    /// A dim the kernel's key baked in differs in this call.
    #[error("{arg}: expected shape {expected}, got {got:?}")]
    NotBuiltFor {
        /// Argument name.
        arg: &'static str,
        /// The shape the kernel was built for.
        expected: String,
        /// The call's shape.
        got: Vec<usize>,
    },
    /// Query heads not a multiple of KV heads.
    #[error("q: {num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads")]
    HeadGroups {
        /// Hq.
        num_heads: usize,
        /// Hkv.
        num_kv_heads: usize,
    },
    /// `cache_lengths[b] + valid_lengths[b]` overflows u32.
    #[error("sequence {batch}: cache length {cache_length} + valid length {valid_length} overflows u32")]
    LengthOverflow {
        /// Sequence.
        batch: usize,
        /// Its cache length.
        cache_length: u32,
        /// Its valid length.
        valid_length: u32,
    },
}

impl From<AttentionError> for kvjit_core::Error {
    fn from(error: AttentionError) -> Self {
        kvjit_core::Error::op(OP_NAME, error)
    }
}
