//! The JIT kernel: its code (one work item per output row: the row of the
//! table its id names, copied with [`kvjit_op::rows::copy_row`], or for a
//! block-format table decoded by a call to [`decode_row`]) and the launch.

use std::sync::Arc;

use cranelift_frontend::FunctionBuilder;
use kvjit_core::{DType, KernelSpec, Result};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, types};
use kvjit_jit::ir::addr::element;
use kvjit_jit::ir::call_native;
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
        let key = self.key();
        let spec = *self;
        compile_or_fetch(&key, capture, || compile_kernel(&key, capture, |b, p| gather_kernel(b, p, &spec)))
    }

    /// `table` is `[V, H]`, `ids` `[B, S]` with every id below V (the
    /// check), `output` holds `B·S·H` elements.
    fn launch(&self, &[batch, seq]: &[usize; 2], call: Launch<'_, '_>) -> Result<()> {
        let ([table, ids], output) = (call.tensors(), call.output);
        let args = RowArgs::new(table, ids, output, seq);
        // SAFETY: the call was checked (the spec's contract: `table`
        // contiguous `[V, H]` of the table's dtype — whole blocks per row for
        // a block format — `ids` contiguous u32 `[B, S]` with every id below
        // V, `output` of B·S·H elements of the dtype); item r reads id r and
        // table row ids[r] and writes output row r only: disjoint writes,
        // all in bounds (`decode_row` reads one table row and writes one
        // output row of the spec's sizes).
        unsafe { kvjit_jit::launch(call.code, &args, batch * seq, call.ctx) };
        Ok(())
    }
}

/// Emit the body: for each row r of the items, output row r = table row
/// `ids[r]` (decoded by [`decode_row`] for a block table).
fn gather_kernel(b: &mut FunctionBuilder, p: KernelParams, spec: &GatherSpec) {
    let row_bytes = rows::row_bytes(spec.dtype, spec.hidden);
    let table_row_bytes = spec.table.storage_bytes(spec.hidden).expect("specialize checked H is whole blocks");
    rows::for_each_row(b, p, row_bytes, |b, row| {
        let src = element(b, row.source, row.pick, table_row_bytes);
        if !spec.table.is_block_format() {
            rows::copy_row(b, src, row.output, row_bytes);
            return;
        }
        let [format, dtype, hidden] =
            [dtype_code(spec.table), dtype_code(spec.dtype), spec.hidden].map(|v| b.ins().iconst(types::I64, v as i64));
        call_native(b, decode_row as *const () as usize, &[src, row.output, format, dtype, hidden]);
    });
}

/// The code of a dtype in [`decode_row`]'s arguments: its index in
/// [`DType::ALL`].
fn dtype_code(dtype: DType) -> usize {
    DType::ALL.iter().position(|&d| d == dtype).expect("ALL lists every dtype")
}

/// Decode one table row of `hidden` weights in block format `DType::ALL[format]`
/// at `src` into `hidden` values of the float `DType::ALL[dtype]` at `out`
/// (dequantized as [`kvjit_core::quant::dequantize`], rounded once). Called
/// by the generated code once per gathered row of a block table.
///
/// # Safety
/// `src` is readable for the row's whole blocks and `out` writable for
/// `hidden` elements of the output dtype; the codes name a block format and
/// a compute float, `hidden` a multiple of the block (what `specialize` and
/// the call's check establish).
unsafe extern "C" fn decode_row(src: *const u8, out: *mut u8, format: usize, dtype: usize, hidden: usize) {
    let (format, dtype) = (DType::ALL[format], DType::ALL[dtype]);
    let row_bytes = format.storage_bytes(hidden).expect("H is whole blocks");
    // SAFETY: the caller's bounds on `src` and `out`.
    let (src, out) = unsafe {
        (std::slice::from_raw_parts(src, row_bytes), std::slice::from_raw_parts_mut(out, hidden * dtype.size_bytes()))
    };
    let mut values = vec![0f32; hidden];
    kvjit_core::quant::dequantize(format, src, &mut values).expect("whole blocks of a block format");
    for (dst, &v) in out.chunks_exact_mut(dtype.size_bytes()).zip(&values) {
        match dtype {
            DType::F32 => dst.copy_from_slice(&v.to_le_bytes()),
            DType::BF16 => dst.copy_from_slice(&kvjit_core::bf16::from_f32(v).to_le_bytes()),
            _ => dst.copy_from_slice(&kvjit_core::f16::from_f32(v).to_le_bytes()),
        }
    }
}
