//! The reference implementation as one of the op's kernels.

use kvjit_core::Result;
use kvjit_op::{Call, OpKernel};
use kvjit_runtime::DeviceContextPtr;

use crate::{CallShape, RopeSpec, reference};

/// The f64 reference as a CPU kernel, for one spec (wrap it in
/// [`kvjit_op::Compiled`] to run it).
///
/// Tensor inputs, in order: `q_proj`, `freqs_cis`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct ReferenceKernel {
    spec: RopeSpec,
}

impl ReferenceKernel {
    /// The reference kernel for `spec`.
    pub fn new(spec: RopeSpec) -> Self {
        Self { spec }
    }
}

impl OpKernel for ReferenceKernel {
    type Spec = RopeSpec;
    const IMPLEMENTATION: &'static str = "reference";

    fn spec(&self) -> &RopeSpec {
        &self.spec
    }

    fn run(&self, _: CallShape, call: Call<'_, '_>, _: &DeviceContextPtr) -> Result<()> {
        let [q_proj, freqs_cis, layer_idx, valid_lengths] = call.tensors();
        let (cache, output) = (&mut *call.caches[0], &mut call.outputs[0]);
        reference::fused_qk_rope(q_proj, cache, freqs_cis, layer_idx, valid_lengths, self.spec.interleaved, output)?;
        Ok(())
    }
}
