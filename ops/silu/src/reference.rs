//! The reference: [`silu`] of every element in f64, rounded once to the
//! dtype ([`kvjit_op::store_f64`]). The JIT is tested against it.

use kvjit_core::Result;
use kvjit_op::{Call, OpKernel};
use kvjit_runtime::DeviceContextPtr;

use crate::SiluSpec;

/// `x / (1 + e^−x)`, and its limit −0 at `x = −∞` (where the formula
/// gives NaN); `+∞` gives `+∞`, NaN gives NaN.
pub fn silu(x: f64) -> f64 {
    if x == f64::NEG_INFINITY { -0.0 } else { x / (1.0 + (-x).exp()) }
}

/// The reference kernel of a spec.
#[derive(Clone, Debug)]
pub struct ReferenceKernel(pub SiluSpec);

impl OpKernel for ReferenceKernel {
    type Spec = SiluSpec;
    const IMPLEMENTATION: &'static str = "reference";

    fn spec(&self) -> &SiluSpec {
        &self.0
    }

    fn run(&self, _shape: Vec<usize>, call: Call<'_, '_>, _ctx: &DeviceContextPtr) -> Result<()> {
        let [x] = call.tensors();
        let y: Vec<f64> = x.to_f32_vec()?.into_iter().map(|v| silu(f64::from(v))).collect();
        kvjit_op::store_f64(&mut call.outputs[0], &y)
    }
}
