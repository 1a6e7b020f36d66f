//! The reference kernel: [`reference::mha`](crate::reference::mha) as an
//! [`OpKernel`], for one spec.

use kvjit_core::Result;
use kvjit_op::{Call, OpKernel};
use kvjit_runtime::DeviceContextPtr;

use crate::call::{AttentionConfig, CallShape};
use crate::{MhaSpec, reference};

/// The reference implementation as a CPU kernel, for one spec (wrap it in
/// [`Compiled`](kvjit_op::Compiled) to run it).
///
/// Tensor inputs, in order: `q`, `layer_idx`, `valid_lengths`; one cache;
/// one output.
pub struct ReferenceKernel {
    spec: MhaSpec,
}

impl ReferenceKernel {
    /// The reference kernel for `spec`.
    pub fn new(spec: MhaSpec) -> Self {
        Self { spec }
    }
}

impl OpKernel for ReferenceKernel {
    type Spec = MhaSpec;
    const IMPLEMENTATION: &'static str = "reference";

    fn spec(&self) -> &MhaSpec {
        &self.spec
    }

    fn run(&self, _shape: CallShape, call: Call<'_, '_>, _ctx: &DeviceContextPtr) -> Result<()> {
        let [q, layer_idx, valid_lengths] = call.tensors();
        let config = AttentionConfig::from(&self.spec);
        reference::mha(q, call.caches[0], layer_idx, valid_lengths, &config, &mut call.outputs[0])?;
        Ok(())
    }
}
