//! The reference kernel, and what the op's kernels share.

use kvjit_core::{Result, Tensor};
use kvjit_op::{Call, OpKernel};
use kvjit_runtime::DeviceContextPtr;

use crate::{CheckedCall, FusedQkvSpec, reference};

/// The reference implementation as a CPU kernel, for one spec (wrap it in
/// [`kvjit_op::Compiled`] for the runtime's `Kernel` interface).
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct ReferenceKernel {
    spec: FusedQkvSpec,
}

impl ReferenceKernel {
    /// The reference kernel for `spec`.
    pub fn new(spec: FusedQkvSpec) -> Self {
        Self { spec }
    }
}

impl OpKernel for ReferenceKernel {
    type Spec = FusedQkvSpec;
    const IMPLEMENTATION: &'static str = "reference";

    fn spec(&self) -> &FusedQkvSpec {
        &self.spec
    }

    fn run(&self, checked: CheckedCall, call: Call<'_, '_>, _ctx: &DeviceContextPtr) -> Result<()> {
        let [hidden, weight, _, valid_lengths] = call.tensors();
        reference::write(&checked.shape, hidden, weight, call.caches[0], valid_lengths, &mut call.outputs[0])
    }
}

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
