//! The JIT kernel: its argument struct, its code (one work item per
//! output row: the row of the table its id names, copied with
//! [`kvjit_op::rows::copy_row`]) and the launch.

use std::mem::offset_of;
use std::sync::Arc;

use cranelift_codegen::ir::InstBuilder;
use cranelift_frontend::FunctionBuilder;
use kvjit_core::{KernelSpec, Result};
use kvjit_jit::ir::addr::element;
use kvjit_jit::ir::mem;
use kvjit_jit::{
    CaptureText, JitError, JitFunction, KernelArgs, KernelParams, compile_kernel, compile_or_fetch, cranelift_codegen,
    cranelift_frontend,
};
use kvjit_op::{JitSpec, Launch, rows};

use crate::GatherSpec;

/// The kernel's argument struct, read by the emitter at `offset_of!`.
#[repr(C)]
struct GatherArgs {
    /// Address of the table.
    table: u64,
    /// Address of `ids`.
    ids: u64,
    /// Address of the output.
    output: u64,
}

// SAFETY: `#[repr(C)]` with only u64 fields.
unsafe impl KernelArgs for GatherArgs {}

/// The Cranelift kernel of one spec ([`kvjit_op::Jit`]); one code serves
/// any B and S.
pub type JitKernel = kvjit_op::Jit<GatherSpec>;

impl JitSpec for GatherSpec {
    fn compile(&self, capture: CaptureText) -> std::result::Result<Arc<JitFunction>, JitError> {
        let (key, row_bytes) = (self.key(), self.row_bytes());
        compile_or_fetch(&key, capture, || compile_kernel(&key, capture, |b, p| gather_kernel(b, p, row_bytes)))
    }

    /// `table` is `[V, H]`, `ids` `[B, S]` with every id below V (the
    /// check), `output` holds `B·S·H` elements.
    fn launch(&self, &[batch, seq]: &[usize; 2], call: Launch<'_, '_>) -> Result<()> {
        let ([table, ids], output) = (call.tensors(), call.output);
        let args = GatherArgs {
            table: table.as_bytes().as_ptr() as u64,
            ids: ids.as_bytes().as_ptr() as u64,
            output: output.as_mut_ptr() as u64,
        };
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
    let table = p.field(b, offset_of!(GatherArgs, table));
    let ids = p.field(b, offset_of!(GatherArgs, ids));
    let output = p.field(b, offset_of!(GatherArgs, output));
    rows::for_each_row(b, p, |b, r| {
        let at = element(b, ids, r, 4);
        let id = b.ins().uload32(mem(), at, 0);
        let src = b.ins().imul_imm_s(id, row_bytes as i64);
        let src = b.ins().iadd(table, src);
        let dst = b.ins().imul_imm_s(r, row_bytes as i64);
        let dst = b.ins().iadd(output, dst);
        rows::copy_row(b, src, dst, row_bytes);
    });
}
