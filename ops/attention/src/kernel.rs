//! The reference kernel: [`reference::mha`](crate::reference::mha) as the
//! op's reference kernel, for one spec.

/// The reference implementation as a CPU kernel, for one spec (wrap it in
/// [`Compiled`](kvjit_op::Compiled) to run it).
///
/// Tensor inputs, in order: `q`, `layer_idx`, `valid_lengths`; one cache;
/// one output.
pub type ReferenceKernel = kvjit_op::Reference<crate::MhaSpec>;
