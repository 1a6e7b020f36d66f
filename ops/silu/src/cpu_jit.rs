//! The JIT kernel's host side: its argument struct, its code (compiled
//! once per key, emitted by `emit.rs`), and the launch that splits the
//! elements into work items over the worker pool.

use std::sync::Arc;

use kvjit_core::{KernelSpec, Result};
use kvjit_jit::{CaptureText, JitError, JitFunction, KernelArgs, compile_kernel, compile_or_fetch};
use kvjit_op::{JitSpec, Launch};

use crate::SiluSpec;

/// Elements per work item (the last item takes what is left): items do
/// not depend on the thread count, so neither does any result.
pub const ELEMENTS_PER_ITEM: usize = 2048;

/// The kernel's argument struct, read by the emitter at `offset_of!`.
#[repr(C)]
pub(crate) struct SiluArgs {
    /// Address of `x`.
    pub x: u64,
    /// Address of the output.
    pub output: u64,
    /// Elements of `x` and of the output.
    pub elements: u64,
}

// SAFETY: `#[repr(C)]` with only u64 fields.
unsafe impl KernelArgs for SiluArgs {}

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]). Shapes are not
/// specialized further: a kernel with the element count left to run time
/// reads it once per work item.
pub type JitKernel = kvjit_op::Jit<SiluSpec>;

impl JitSpec for SiluSpec {
    fn compile(&self, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
        let (key, (dtype, elements)) = (self.key(), (self.dtype, self.elements));
        compile_or_fetch(&key, capture, || {
            compile_kernel(&key, capture, |b, p| crate::emit::silu_kernel(b, p, dtype, elements))
        })
    }

    /// `x` is contiguous of the spec's dtype and, if baked, element count;
    /// `output` holds its bytes.
    fn launch(&self, _: &Vec<usize>, call: Launch<'_, '_>) -> Result<()> {
        let ([x], output) = (call.tensors(), call.output);
        let elements = x.numel();
        let args =
            SiluArgs { x: x.as_bytes().as_ptr() as u64, output: output.as_mut_ptr() as u64, elements: elements as u64 };
        // SAFETY: the call was checked (the spec's contract: `x` contiguous,
        // of the dtype and, if baked, the element count the code was built
        // for; `output` of `x`'s byte length), the code touches element `i`
        // of both only for `i < elements`, and item `t` covers elements
        // `t·ELEMENTS_PER_ITEM..` up to the next item's: disjoint writes.
        unsafe { kvjit_jit::launch(call.code, &args, elements.div_ceil(ELEMENTS_PER_ITEM), call.ctx) };
        Ok(())
    }
}
