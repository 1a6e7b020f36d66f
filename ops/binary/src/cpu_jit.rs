//! The JIT kernel: the platform's elementwise map
//! ([`kvjit_op::elementwise::compile_map`]) of two inputs, one `fadd` or
//! `fmul` per `F32X4` vector, and its launch over the worker pool.

use std::sync::Arc;

use kvjit_core::{KernelSpec, Result};
use kvjit_jit::cranelift_codegen::ir::InstBuilder;
use kvjit_jit::{CaptureText, JitError, JitFunction};
use kvjit_op::{JitSpec, Launch, elementwise};

use crate::{BinaryOperation, BinarySpec};

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]). Shapes are not
/// specialized further: a kernel with the element count left to run time
/// reads it once per work item.
pub type JitKernel = kvjit_op::Jit<BinarySpec>;

impl JitSpec for BinarySpec {
    fn compile(&self, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
        let operation = self.operation;
        elementwise::compile_map(&self.key(), capture, self.dtype, self.elements, |b, [x, y]| match operation {
            BinaryOperation::Add => b.ins().fadd(x, y),
            BinaryOperation::Mul => b.ins().fmul(x, y),
        })
    }

    /// `a` and `b` are contiguous of the spec's dtype and one shape (of the
    /// baked element count, if any); `output` holds `a`'s bytes.
    fn launch(&self, _: &Vec<usize>, call: Launch<'_, '_>) -> Result<()> {
        // SAFETY: `call.code` is this spec's `compile_map` kernel of two
        // inputs; the call was checked (the spec's contract: `a` and `b`
        // contiguous, of the dtype the code was built for, `b` of `a`'s
        // shape and `a` of the baked element count if there is one;
        // `output` of `a`'s byte length).
        unsafe { elementwise::launch_map::<2>(call) };
        Ok(())
    }
}
