//! The JIT kernel: its code (one work item per output row: the row of the
//! table its id names, copied with [`kvjit_op::rows::copy_row`]) and the
//! launch.

use std::sync::Arc;

use cranelift_frontend::FunctionBuilder;
use kvjit_core::{KernelSpec, Result};
use kvjit_jit::ir::addr::element;
use kvjit_jit::{
    CaptureText, JitError, JitFunction, KernelParams, compile_kernel, compile_or_fetch, cranelift_frontend,
};
use kvjit_op::rows::{self, RowArgs};
use kvjit_op::{JitSpec, Launch};

use crate::GatherSpec;

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]); one code serves
/// any B and S.
pub type JitKernel = kvjit_op::Jit<GatherSpec>;

impl JitSpec for GatherSpec {
    fn compile(&self, capture: CaptureText) -> std::result::Result<Arc<JitFunction>, JitError> {
        let (key, row_bytes) = (self.key(), rows::row_bytes(self.dtype, self.hidden));
        compile_or_fetch(&key, capture, || compile_kernel(&key, capture, |b, p| gather_kernel(b, p, row_bytes)))
    }

    /// `table` is `[V, H]`, `ids` `[B, S]` with every id below V (the
    /// check), `output` holds `B·S·H` elements.
    fn launch(&self, &[batch, seq]: &[usize; 2], call: Launch<'_, '_>) -> Result<()> {
        let ([table, ids], output) = (call.tensors(), call.output);
        let args = RowArgs::new(table, ids, output, seq);
        // SAFETY: the call was checked (the spec's contract: `table`
        // contiguous `[V, H]` of the dtype, `ids` contiguous u32 `[B, S]`
        // with every id below V, `output` of B·S·H elements); item r reads
        // id r and table row ids[r] and writes output row r only: disjoint
        // writes, all in bounds.
        unsafe { kvjit_jit::launch(call.code, &args, batch * seq, call.ctx) };
        Ok(())
    }
}

/// Emit the body: for each row r of the items, output row r = table row
/// `ids[r]`.
fn gather_kernel(b: &mut FunctionBuilder, p: KernelParams, row_bytes: usize) {
    rows::for_each_row(b, p, row_bytes, |b, row| {
        let src = element(b, row.source, row.pick, row_bytes);
        rows::copy_row(b, src, row.output, row_bytes);
    });
}
