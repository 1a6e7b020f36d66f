//! Row selection, written once for the ops whose output rows are whole
//! rows of an input, copied bit for bit or zeroed (`mo.gather`,
//! `kvjit.last_valid_token`): the node check of such an input, the
//! emitters that copy or zero one row with 16-byte vector moves, the loop
//! over output rows as work items, and the plain-Rust reference.

use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::DType;
use kvjit_graph::{GraphError, TensorType, input_error};
use kvjit_jit::ir::{counted_loop, mem, splat_u32};
use kvjit_jit::{KernelParams, cranelift_codegen, cranelift_frontend};

/// Bytes one vector move copies.
const VECTOR_BYTES: usize = 16;
/// Vector moves per iteration of a row's loop (rows longer than this many
/// vectors loop; the rest of a row is unrolled).
const VECTORS_PER_ITERATION: usize = 4;

/// An input whose rows an op copies (`table` `[V, H]`, `x` `[B, S, H]`):
/// a tensor of f32, bf16 or f16 whose rank is the number of `dims` (their
/// names, for the error) and whose last dim, the row length H, is static
/// (and not 0).
/// Returns its dtype and H.
pub fn float_rows(arg: &str, ty: &TensorType, dims: &[&str]) -> Result<(DType, usize), GraphError> {
    let hidden = match ty.shape.last() {
        Some(h) if ty.shape.len() == dims.len() && ty.dtype.is_compute_float() => h.as_static().filter(|&h| h > 0),
        _ => None,
    };
    let expected =
        || format!("f32, bf16 or f16 [{}] with {} static and above 0", dims.join(", "), dims[dims.len() - 1]);
    hidden.map(|h| (ty.dtype, h)).ok_or_else(|| input_error(arg, expected(), ty))
}

/// Emit the loop over this invocation's work items `[begin, end)`, one
/// output row each: `row` emits the body for row `r` (an `I64`).
pub fn for_each_row(b: &mut FunctionBuilder, p: KernelParams, row: impl FnOnce(&mut FunctionBuilder, Value)) {
    counted_loop(b, p.begin, p.end, 1, &[], |b, r, _| {
        row(b, r);
        Vec::new()
    });
}

/// Emit a copy of the `row_bytes` bytes at `src` to `dst`, bit for bit:
/// 16-byte vector moves, then 8-, 4-, 2- and 1-byte moves for the tail.
pub fn copy_row(b: &mut FunctionBuilder, src: Value, dst: Value, row_bytes: usize) {
    move_row(b, Some(src), dst, row_bytes);
}

/// Emit zeroes into the `row_bytes` bytes at `dst` (+0.0 in every float
/// dtype), with the moves of [`copy_row`].
pub fn zero_row(b: &mut FunctionBuilder, dst: Value, row_bytes: usize) {
    move_row(b, None, dst, row_bytes);
}

/// Store `row_bytes` bytes at `dst`: those at `src`, or zeroes.
fn move_row(b: &mut FunctionBuilder, src: Option<Value>, dst: Value, row_bytes: usize) {
    let step = VECTOR_BYTES * VECTORS_PER_ITERATION;
    let looped = row_bytes / step * step;
    if looped > 0 {
        let (start, stop) = (b.ins().iconst(types::I64, 0), b.ins().iconst(types::I64, looped as i64));
        counted_loop(b, start, stop, step as i64, &[], |b, at, _| {
            let (src, dst) = (src.map(|s| b.ins().iadd(s, at)), b.ins().iadd(dst, at));
            move_pieces(b, src, dst, &[VECTOR_BYTES; VECTORS_PER_ITERATION]);
            Vec::new()
        });
    }
    // The rest, below `step` bytes: whole vectors, then the tail by halves.
    let rest = row_bytes - looped;
    let mut pieces = vec![VECTOR_BYTES; rest / VECTOR_BYTES];
    pieces.extend([8, 4, 2, 1].into_iter().filter(|&piece| rest % VECTOR_BYTES & piece != 0));
    let src = src.map(|s| b.ins().iadd_imm_s(s, looped as i64));
    let dst = b.ins().iadd_imm_s(dst, looped as i64);
    move_pieces(b, src, dst, &pieces);
}

/// Move consecutive pieces of the given byte sizes (16, 8, 4, 2 or 1),
/// the first at `src`/`dst` (each under 64 bytes from them).
fn move_pieces(b: &mut FunctionBuilder, src: Option<Value>, dst: Value, pieces: &[usize]) {
    let mut at = 0i32;
    for &bytes in pieces {
        let ty = match bytes {
            16 => types::I32X4,
            8 => types::I64,
            4 => types::I32,
            2 => types::I16,
            _ => types::I8,
        };
        let value = match src {
            Some(src) => b.ins().load(ty, mem(), src, at),
            None if ty == types::I32X4 => splat_u32(b, 0),
            None => b.ins().iconst(ty, 0),
        };
        b.ins().store(mem(), value, dst, at);
        at += bytes as i32;
    }
}

/// The reference of a row-selecting op: output row `r` (of `row_bytes`
/// bytes) is the input's row `sources[r]`, or zeroes where it is `None`.
///
/// # Panics
/// When `output` does not hold one row per source or a source row is
/// outside `input` (the op's check rules both out).
pub fn copy_rows(input: &[u8], row_bytes: usize, sources: &[Option<usize>], output: &mut [u8]) {
    assert_eq!(output.len(), sources.len() * row_bytes, "one output row per source");
    for (row, source) in output.chunks_exact_mut(row_bytes).zip(sources) {
        match source {
            Some(s) => row.copy_from_slice(&input[s * row_bytes..(s + 1) * row_bytes]),
            None => row.fill(0),
        }
    }
}
