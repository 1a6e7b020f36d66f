//! The op's own contract errors (carried as `kvjit_core::Error::Op`,
//! downcast with `Error::op_error::<AttentionError>()`). Shared checks
//! (dtypes, shapes, layer, valid lengths, page table) are core's variants.

use crate::OP_NAME;

/// A call this op's kernels refuse, beyond the shared argument checks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttentionError {
    /// Query heads not a multiple of KV heads.
    #[error("q: {num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads")]
    HeadGroups {
        /// Hq.
        num_heads: usize,
        /// Hkv.
        num_kv_heads: usize,
    },
    /// A sequence reads more keys in one call than the JIT kernel handles.
    #[error(
        "sequence {batch} reads {keys} keys in one call; the JIT kernel handles at most {max} per sequence (the \
         reference kernel serves more)"
    )]
    TooManyKeys {
        /// The sequence.
        batch: usize,
        /// Keys its valid queries read together.
        keys: usize,
        /// [`MAX_JIT_KEYS`](crate::cpu_jit::MAX_JIT_KEYS).
        max: usize,
    },
}

kvjit_op::op_error!(AttentionError, OP_NAME);
