//! The JIT kernel: its code (one work item per sequence: its last valid
//! row of `x` copied with [`kvjit_op::rows::copy_row`], or zeros) and the
//! launch.

use std::mem::offset_of;
use std::sync::Arc;

use cranelift_codegen::ir::InstBuilder;
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_frontend::FunctionBuilder;
use kvjit_core::{KernelSpec, Result};
use kvjit_jit::ir::addr::{Size, element};
use kvjit_jit::ir::if_else;
use kvjit_jit::{
    CaptureText, JitError, JitFunction, KernelParams, compile_kernel, compile_or_fetch, cranelift_codegen,
    cranelift_frontend,
};
use kvjit_op::rows::{self, RowArgs};
use kvjit_op::{JitSpec, Launch};

use crate::LastTokenSpec;

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]).
pub type JitKernel = kvjit_op::Jit<LastTokenSpec>;

impl JitSpec for LastTokenSpec {
    fn compile(&self, capture: CaptureText) -> std::result::Result<Arc<JitFunction>, JitError> {
        let (key, row_bytes, seq) = (self.key(), rows::row_bytes(self.dtype, self.hidden), self.step.seq);
        compile_or_fetch(&key, capture, || {
            compile_kernel(&key, capture, |b, p| last_token_kernel(b, p, row_bytes, seq))
        })
    }

    /// `x` is `[B, S, H]`, `valid_lengths` `[B]` each `≤ S` (the check),
    /// `output` holds `B·H` elements.
    fn launch(&self, &[batch, seq]: &[usize; 2], call: Launch<'_, '_>) -> Result<()> {
        let ([x, valid_lengths], output) = (call.tensors(), call.output);
        let args = RowArgs::new(x, valid_lengths, output, seq);
        // SAFETY: the call was checked (the spec's contract: `x` contiguous
        // `[B, S, H]` of the dtype with S as baked if it is, `valid_lengths`
        // contiguous u32 `[B]` with each ≤ S, `output` of B·H elements);
        // item b reads `valid_lengths[b]` and, when it is v > 0, row
        // `b·S + v − 1 < B·S` of `x`, and writes output row b only:
        // disjoint writes, all in bounds.
        unsafe { kvjit_jit::launch(call.code, &args, batch, call.ctx) };
        Ok(())
    }
}

/// Emit the body: for each sequence b of the items, output row b = row
/// `b·S + valid_lengths[b] − 1` of `x`, or zeros when the length is 0 (S
/// baked in when `Some`).
fn last_token_kernel(b: &mut FunctionBuilder, p: KernelParams, row_bytes: usize, seq: Option<usize>) {
    let seq = match seq {
        Some(s) => Size::Known(s),
        None => Size::Runtime(p.field(b, offset_of!(RowArgs, seq))),
    };
    rows::for_each_row(b, p, row_bytes, |b, row| {
        let empty = b.ins().icmp_imm_s(IntCC::Equal, row.pick, 0);
        if_else(
            b,
            empty,
            |b| rows::zero_row(b, row.output, row_bytes),
            |b| {
                let first = seq.times(b, row.index, 1);
                let last = b.ins().iadd(first, row.pick);
                let last = b.ins().iadd_imm_s(last, -1);
                let src = element(b, row.source, last, row_bytes);
                rows::copy_row(b, src, row.output, row_bytes);
            },
        );
    });
}
