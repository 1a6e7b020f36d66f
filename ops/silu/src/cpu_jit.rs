//! The JIT kernel's host side: its argument struct, its code (compiled
//! once per key, emitted by `emit.rs`), and the launch that splits the
//! elements into work items over the worker pool.

use std::sync::Arc;

use kvjit_core::{Error, KernelSpec, Result, Tensor};
use kvjit_jit::{CaptureText, JitError, JitFunction, KernelArgs, compile_kernel, compile_or_fetch};
use kvjit_op::{Call, CallContract, OpKernel};
use kvjit_runtime::{CodeInfo, DeviceContextPtr};

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

/// The Cranelift kernel of one spec.
pub struct JitKernel {
    spec: SiluSpec,
    code: Arc<JitFunction>,
}

impl JitKernel {
    /// Compile (or fetch from the process-wide registry) the code for `spec`.
    pub fn new(spec: SiluSpec, capture: CaptureText) -> Result<Self, JitError> {
        let key = spec.key();
        let build = || compile_kernel(&key, capture, |b, p| crate::emit::silu_kernel(b, p, spec.dtype, spec.elements));
        Ok(Self { spec, code: compile_or_fetch(&key, capture, build)? })
    }

    /// Run on `x`, writing the output's elements into `output` (bytes the
    /// caller owns, such as a test's guarded buffer), checked like a call:
    /// nothing is written unless `x` passes and `output` holds exactly its
    /// element count.
    pub fn run_into(&self, x: &Tensor, output: &mut [u8], ctx: &DeviceContextPtr) -> Result<()> {
        kvjit_core::expect_arg("x", x, self.spec.dtype)?;
        let shape = self.spec.check(&[x], &[])?;
        let expected = x.numel() * self.spec.dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount { dtype: self.spec.dtype, shape, expected, got: output.len() });
        }
        self.launch(x, output, ctx);
        Ok(())
    }

    /// Run a checked call: `x` contiguous of the spec's dtype and element
    /// count, `output` its byte length.
    fn launch(&self, x: &Tensor, output: &mut [u8], ctx: &DeviceContextPtr) {
        let elements = x.numel();
        let args =
            SiluArgs { x: x.as_bytes().as_ptr() as u64, output: output.as_mut_ptr() as u64, elements: elements as u64 };
        // SAFETY: the call was checked (the spec's contract: `x` contiguous,
        // of the dtype and, if baked, the element count the code was built
        // for; `output` of `x`'s byte length), the code touches element `i`
        // of both only for `i < elements`, and item `t` covers elements
        // `t·ELEMENTS_PER_ITEM..` up to the next item's: disjoint writes.
        unsafe { kvjit_jit::launch(&self.code, &args, elements.div_ceil(ELEMENTS_PER_ITEM), ctx) }
    }
}

impl OpKernel for JitKernel {
    type Spec = SiluSpec;
    const IMPLEMENTATION: &'static str = "jit";

    fn spec(&self) -> &SiluSpec {
        &self.spec
    }

    fn run(&self, _shape: Vec<usize>, call: Call<'_, '_>, ctx: &DeviceContextPtr) -> Result<()> {
        let [x] = call.tensors();
        self.launch(x, call.outputs[0].as_bytes_mut(), ctx);
        Ok(())
    }

    fn code_info(&self) -> CodeInfo {
        self.code.code_info()
    }
}
