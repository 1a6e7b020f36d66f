//! The reference kernel, and what the op's kernels share.

use kvjit_core::Tensor;

/// The reference implementation as a CPU kernel, for one spec (wrap it in
/// [`kvjit_op::Compiled`] for the runtime's `Kernel` interface).
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub type ReferenceKernel = kvjit_op::Reference<crate::FusedQkvSpec>;

/// Whether `given` is the very tensor a kernel was built with (the same
/// allocation, dtype and shape), so a copy made from the constant at build —
/// packed panels, a device upload — may stand in for it. Equal contents in
/// another allocation do not count: a caller may change its own tensor
/// between calls.
pub(crate) fn same_data(constant: &Tensor, given: &Tensor) -> bool {
    constant.dtype() == given.dtype()
        && constant.shape() == given.shape()
        && std::ptr::eq(constant.as_bytes(), given.as_bytes())
}
