//! The reference implementation as the op's reference kernel.

/// The f64 reference ([`reference::fused_qk_rope`](crate::reference::fused_qk_rope))
/// as a CPU kernel, for one spec (wrap it in [`kvjit_op::Compiled`] to run
/// it).
///
/// Tensor inputs, in order: `q_proj`, `freqs_cis`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub type ReferenceKernel = kvjit_op::Reference<crate::RopeSpec>;
