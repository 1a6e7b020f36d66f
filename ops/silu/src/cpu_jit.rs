//! The JIT kernel's host side: its code, the platform's elementwise map
//! ([`kvjit_op::elementwise::compile_map`]) with [`silu_f32x4`] on each
//! vector, and its launch over the worker pool.

use std::sync::Arc;

use kvjit_core::{KernelSpec, Result};
use kvjit_jit::{CaptureText, JitError, JitFunction};
use kvjit_op::{JitSpec, Launch, elementwise};

use crate::SiluSpec;
use crate::emit::silu_f32x4;

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]). Shapes are not
/// specialized further: a kernel with the element count left to run time
/// reads it once per work item.
pub type JitKernel = kvjit_op::Jit<SiluSpec>;

impl JitSpec for SiluSpec {
    fn compile(&self, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
        elementwise::compile_map(&self.key(), capture, self.dtype, self.elements, |b, [x]| silu_f32x4(b, x))
    }

    /// `x` is contiguous of the spec's dtype and, if baked, element count;
    /// `output` holds its bytes.
    fn launch(&self, _: &Vec<usize>, call: Launch<'_, '_>) -> Result<()> {
        // SAFETY: `call.code` is this spec's `compile_map` kernel of one
        // input; the call was checked (the spec's contract: `x` contiguous,
        // of the dtype and, if baked, the element count the code was built
        // for; `output` of `x`'s byte length).
        unsafe { elementwise::launch_map::<1>(call) };
        Ok(())
    }
}
