//! The JIT kernel's host side: its argument struct, its code (compiled
//! once per key, emitted by `emit.rs`), and the launch that splits the
//! rows into work items over the worker pool.

use std::sync::Arc;

use kvjit_core::{KernelSpec, Result};
use kvjit_jit::{CaptureText, JitError, JitFunction, compile_kernel, compile_or_fetch};
use kvjit_op::{JitSpec, Launch};

use crate::RmsNormSpec;

/// About how many elements a work item covers: whole rows, at least one,
/// `max(1, ROW_ELEMENTS_PER_ITEM / H)` of them (the last item takes what
/// is left). Items depend on H alone, never on the thread count, so
/// neither does any result.
pub const ROW_ELEMENTS_PER_ITEM: usize = 4096;

/// Rows per work item for rows of `width` elements.
pub(crate) fn rows_per_item(width: usize) -> usize {
    (ROW_ELEMENTS_PER_ITEM / width).max(1)
}

kvjit_op::kernel_args! {
    /// The kernel's argument struct, read by the emitter at `offset_of!`.
    pub(crate) struct RmsNormArgs {
        /// Address of `x`.
        x,
        /// Address of `weight`.
        weight,
        /// Address of the output.
        output,
        /// Rows of `x` and of the output.
        rows,
    }
}

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]). A kernel with the
/// row count left to run time reads it from its arguments.
pub type JitKernel = kvjit_op::Jit<RmsNormSpec>;

impl JitSpec for RmsNormSpec {
    fn compile(&self, capture: CaptureText) -> Result<Arc<JitFunction>, JitError> {
        let (key, spec) = (self.key(), *self);
        compile_or_fetch(&key, capture, || {
            compile_kernel(&key, capture, |b, p| crate::emit::rms_norm_kernel(b, p, &spec))
        })
    }

    /// `x` is contiguous `[..., H]` of the spec's dtype and, if baked, row
    /// count; `weight` contiguous `[H]`; `output` holds `x`'s bytes.
    fn launch(&self, (_, rows): &(Vec<usize>, usize), call: Launch<'_, '_>) -> Result<()> {
        let ([x, weight], output) = (call.tensors(), call.output);
        let args = RmsNormArgs {
            x: x.as_bytes().as_ptr() as u64,
            weight: weight.as_bytes().as_ptr() as u64,
            output: output.as_mut_ptr() as u64,
            rows: *rows as u64,
        };
        let items = rows.div_ceil(rows_per_item(self.rows.width));
        // SAFETY: the call was checked (the spec's contract: `x` contiguous
        // `[rows, H]` of the dtype and, if baked, the row count the code was
        // built for; `weight` contiguous `[H]` of the dtype; `output` of
        // `x`'s byte length), the code reads row `r` of `x` and writes row
        // `r` of the output only for `r < rows`, reads `weight[..H]`, and
        // item `t` covers rows `t·rows_per_item(H)..` up to the next item's:
        // disjoint writes.
        unsafe { kvjit_jit::launch(call.code, &args, items, call.ctx) };
        Ok(())
    }
}
