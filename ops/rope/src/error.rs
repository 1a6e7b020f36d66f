//! The op's own contract errors: what only this op checks. The checks every
//! paged op shares (tensor dtypes and shapes, `layer_idx < L`, valid lengths,
//! page tables, slot collisions, lengths overflowing) are `kvjit_core::Error`
//! variants raised by core's functions; these are carried as
//! `kvjit_core::Error::Op` (downcast with `Error::op_error::<RopeError>()`).

use crate::OP_NAME;

/// A call this op's kernels refuse, beyond the shared argument checks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RopeError {
    /// An odd head size: RoPE rotates pairs of elements.
    #[error("head_size {head_size} is odd: rotary embedding rotates pairs of elements")]
    OddHeadSize {
        /// The cache's (and q_proj's) head size.
        head_size: usize,
    },
    /// A valid token's position has no row in `freqs_cis`.
    #[error(
        "sequence {batch}: position {position} (cache_length {cache_length} + token {token}) \
         has no row in freqs_cis, which holds {max_seq} positions"
    )]
    PositionOutOfRange {
        /// Sequence index.
        batch: usize,
        /// The position `cache_lengths[b] + s`.
        position: u64,
        /// `cache_lengths[b]`.
        cache_length: u32,
        /// The token `s`.
        token: usize,
        /// Rows of `freqs_cis`.
        max_seq: usize,
    },
}

kvjit_op::op_error!(RopeError, OP_NAME);
