//! The reference kernel.

/// The reference implementation as a CPU kernel, for one spec (wrap it in
/// [`kvjit_op::Compiled`] for the runtime's `Kernel` interface).
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub type ReferenceKernel = kvjit_op::Reference<crate::FusedQkvSpec>;
