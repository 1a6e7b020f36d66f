//! The op's own contract errors: what only this op checks. The checks every
//! paged op shares (tensor dtypes and shapes, `layer_idx < L`, valid lengths,
//! page tables, slot collisions) are `kvjit_core::Error` variants raised by
//! core's functions; these are carried as `kvjit_core::Error::Op` (downcast
//! with `Error::op_error::<FusedQkvError>()`).

use crate::OP_NAME;

/// A call this op's kernels refuse, beyond the shared argument checks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FusedQkvError {
    /// A prepared (packed) weight, from a compiled artifact, that is not in
    /// the layout this kernel packs.
    #[error("prepared weight: expected layout {expected}, got {got}")]
    PreparedWeight {
        /// The layout (and packed size) the kernel makes.
        expected: String,
        /// What the artifact holds.
        got: String,
    },
}

impl From<FusedQkvError> for kvjit_core::Error {
    fn from(error: FusedQkvError) -> Self {
        kvjit_core::Error::op(OP_NAME, error)
    }
}
