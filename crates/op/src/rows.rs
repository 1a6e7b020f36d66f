//! Row-wise ops, written once:
//!
//! - **Row-wise inputs** `[..., H]` (RMSNorm's `x`, a matmul's `a`): the
//!   row width H a kernel bakes in (static, ≥ 1), the row count when every
//!   leading dim is static ([`Rows`], [`input`]), and a call's tensor
//!   checked against both ([`expect_rows`]).
//! - **Row selection**, for the ops whose output rows are whole rows of an
//!   input, each picked by a u32 and copied bit for bit or zeroed
//!   (`mo.gather`: a table row per id; `kvjit.last_valid_token`: a
//!   sequence's last valid row): the node check of such an input
//!   ([`float_rows`]), the kernels' argument struct ([`RowArgs`]), the loop
//!   over output rows as work items ([`for_each_row`]), the emitters that
//!   copy or zero one row with 16-byte vector moves ([`copy_row`],
//!   [`zero_row`]), and the plain-Rust reference ([`copy_rows`]).

use std::mem::offset_of;

use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::{DType, Error, KernelSpec, Result, Tensor};
use kvjit_graph::{GraphError, TensorType, ValueType, input_error, tensor_input};
use kvjit_jit::ir::addr::element;
use kvjit_jit::ir::{counted_loop, mem, splat_u32};
use kvjit_jit::{KernelParams, cranelift_codegen, cranelift_frontend};

/// The rows of a `[..., H]` tensor as a kernel bakes them: width H, and
/// the row count (the product of the leading dims) when it is static.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rows {
    /// Elements per row, H (the last dim).
    pub width: usize,
    /// Rows, if every leading dim is static (`None`: taken from each call).
    pub rows: Option<usize>,
}

/// Input `i` (named `arg`) as an f32, bf16 or f16 tensor `[..., H]` of
/// rank ≥ 1 with H static and ≥ 1, and its [`Rows`]; refused with one line
/// naming `arg` otherwise (also when the row count overflows a usize).
pub fn input<'a>(inputs: &[&'a ValueType], i: usize, arg: &str) -> Result<(&'a TensorType, Rows), GraphError> {
    let ty = tensor_input(inputs, i);
    let refuse = |why: &str| input_error(arg, format!("an f32, bf16 or f16 tensor [..., H] {why}"), ty);
    if !ty.dtype.is_compute_float() {
        return Err(refuse("(a float dtype)"));
    }
    let Some((last, leading)) = ty.shape.split_last() else { return Err(refuse("of rank ≥ 1")) };
    let width = match last.as_static() {
        Some(h) if h >= 1 => h,
        _ => return Err(refuse("with H static and ≥ 1")),
    };
    let rows = match leading.iter().map(|d| d.as_static()).collect::<Option<Vec<usize>>>() {
        None => None,
        Some(dims) => {
            let rows = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let fits = rows.and_then(|r| r.checked_mul(width)).is_some();
            if !fits {
                return Err(refuse("of at most usize::MAX elements"));
            }
            rows
        }
    };
    Ok((ty, Rows { width, rows }))
}

/// Check a call's `tensor` (named `arg`) against the rows `spec` baked in:
/// rank ≥ 1, last dim H, and the baked row count if there is one
/// ([`Error::NotBuiltFor`], naming the key). Returns its row count.
pub fn expect_rows(arg: &'static str, tensor: &Tensor, baked: Rows, spec: &impl KernelSpec) -> Result<usize> {
    let shape = tensor.shape();
    let rows = match shape.split_last() {
        Some((&width, leading)) if width == baked.width => leading.iter().product::<usize>(),
        _ => usize::MAX,
    };
    if rows == usize::MAX || baked.rows.is_some_and(|r| r != rows) {
        let rows = baked.rows.map_or("any number of".to_string(), |r| r.to_string());
        return Err(Error::NotBuiltFor {
            arg,
            expected: format!("[..., {}] with {rows} rows (baked into {})", baked.width, spec.key()),
            got: shape.to_vec(),
        });
    }
    Ok(rows)
}

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

/// Bytes of one row of `hidden` elements of `dtype`.
pub fn row_bytes(dtype: DType, hidden: usize) -> usize {
    hidden * dtype.size_bytes()
}

crate::kernel_args! {
    /// The argument struct of a row-selecting kernel, read by
    /// [`for_each_row`] (and by the op's emitter at `offset_of!`, for `seq`).
    #[derive(Debug)]
    pub struct RowArgs {
        /// Address of the rows the output's are picked from.
        source,
        /// Address of the picks: one u32 per output row.
        picks,
        /// Address of the output.
        output,
        /// A size the op's emitter may read (the padded sequence length S).
        seq,
    }
}

impl RowArgs {
    /// The arguments of a call: `source` rows, one u32 pick per output row
    /// in `picks`, the `output` bytes, and `seq`.
    pub fn new(source: &Tensor, picks: &Tensor, output: &mut [u8], seq: usize) -> Self {
        Self {
            source: source.as_bytes().as_ptr() as u64,
            picks: picks.as_bytes().as_ptr() as u64,
            output: output.as_mut_ptr() as u64,
            seq: seq as u64,
        }
    }
}

/// One output row of a row-selecting kernel, as [`for_each_row`] hands it
/// to the op's emitter (all `I64`).
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// Its index r (the work item).
    pub index: Value,
    /// Its pick: the u32 at `picks[r]`, zero-extended.
    pub pick: Value,
    /// Address of the source rows.
    pub source: Value,
    /// Address of output row r.
    pub output: Value,
}

/// Emit the loop over this invocation's work items `[begin, end)` of a
/// kernel taking [`RowArgs`], one output row (of `row_bytes` bytes) each:
/// `row` emits the body for each [`Row`].
pub fn for_each_row(
    b: &mut FunctionBuilder,
    p: KernelParams,
    row_bytes: usize,
    row: impl FnOnce(&mut FunctionBuilder, Row),
) {
    let source = p.field(b, offset_of!(RowArgs, source));
    let picks = p.field(b, offset_of!(RowArgs, picks));
    let output = p.field(b, offset_of!(RowArgs, output));
    counted_loop(b, p.begin, p.end, 1, &[], |b, index, _| {
        let at = element(b, picks, index, 4);
        let pick = b.ins().uload32(mem(), at, 0);
        let output = element(b, output, index, row_bytes);
        row(b, Row { index, pick, source, output });
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
    pieces.extend([8, 4, 2, 1].into_iter().filter(|&piece| (rest % VECTOR_BYTES) & piece != 0));
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

/// The reference of a row-selecting op: output row `r` is the input's row
/// `sources[r]` (rows of the output's length), or zeroes where it is
/// `None`. Always `Ok`: the `Result` is the reference kernel's.
///
/// # Panics
/// When `output` does not hold one row per source, its dtype is not the
/// input's, or a source row is outside `input` (the op's check rules all
/// three out).
pub fn copy_rows(input: &Tensor, sources: &[Option<usize>], output: &mut Tensor) -> kvjit_core::Result<()> {
    assert_eq!(input.dtype(), output.dtype(), "rows are copied into their own dtype");
    let row_bytes = output.numel().checked_div(sources.len()).unwrap_or(0) * output.dtype().size_bytes();
    let (input, output) = (input.as_bytes(), output.as_bytes_mut());
    assert_eq!(output.len(), sources.len() * row_bytes, "one output row per source");
    for (row, source) in output.chunks_exact_mut(row_bytes.max(1)).zip(sources) {
        match source {
            Some(s) => row.copy_from_slice(&input[s * row_bytes..(s + 1) * row_bytes]),
            None => row.fill(0),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kvjit_core::{DType, KernelKey, Target};
    use kvjit_graph::Dim;

    use super::*;

    #[test]
    fn float_rows_needs_a_float_of_the_rank_with_a_static_nonzero_h() {
        let ty = |dtype, shape: &[Dim]| TensorType::new(dtype, shape.iter().cloned());
        let (s, n) = (Dim::Static, Dim::from("n"));
        assert_eq!(float_rows("x", &ty(DType::BF16, &[n.clone(), s(8)]), &["V", "H"]).unwrap(), (DType::BF16, 8));
        for bad in [
            ty(DType::U32, &[s(2), s(8)]),
            ty(DType::F32, &[s(2), n.clone()]),
            ty(DType::F32, &[s(2), s(0)]),
            ty(DType::F32, &[s(16)]),
        ] {
            let err = float_rows("x", &bad, &["V", "H"]).unwrap_err().to_string();
            assert!(err.contains("f32, bf16 or f16 [V, H] with H static and above 0"), "{bad}: {err}");
        }
    }

    #[test]
    fn copy_rows_copies_picked_rows_and_zeroes_the_rest() {
        let input = Tensor::from_f32(DType::F16, &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let mut output = Tensor::from_f32(DType::F16, &[4, 2], &[9.0; 8]).unwrap();
        copy_rows(&input, &[Some(2), None, Some(0), Some(2)], &mut output).unwrap();
        assert_eq!(output.to_f32_vec().unwrap(), [5.0, 6.0, 0.0, 0.0, 1.0, 2.0, 5.0, 6.0]);
    }

    #[derive(Clone, Debug)]
    struct Spec;

    impl KernelSpec for Spec {
        fn key_name(&self) -> KernelKey {
            KernelKey::new("test", Target::Cpu, DType::F32)
        }
    }

    fn ty(dtype: DType, shape: Vec<Dim>) -> ValueType {
        ValueType::Tensor(TensorType::new(dtype, shape))
    }

    #[test]
    fn widths_rows_and_refusals() {
        let static_x = ty(DType::BF16, vec![Dim::Static(2), Dim::Static(3), Dim::Static(8)]);
        assert_eq!(input(&[&static_x], 0, "x").unwrap().1, Rows { width: 8, rows: Some(6) });
        let symbolic = ty(DType::F32, vec![Dim::from("batch"), Dim::Static(8)]);
        assert_eq!(input(&[&symbolic], 0, "x").unwrap().1, Rows { width: 8, rows: None });
        assert_eq!(input(&[&ty(DType::F16, vec![Dim::Static(5)])], 0, "x").unwrap().1.rows, Some(1));
        for (bad, why) in [
            (ty(DType::U32, vec![Dim::Static(8)]), "a float dtype"),
            (ty(DType::F32, vec![]), "rank ≥ 1"),
            (ty(DType::F32, vec![Dim::Static(2), Dim::from("h")]), "H static"),
            (ty(DType::F32, vec![Dim::Static(0)]), "H static and ≥ 1"),
            (ty(DType::F32, vec![Dim::Static(usize::MAX), Dim::Static(2)]), "usize::MAX"),
        ] {
            let err = input(&[&bad], 0, "x").unwrap_err().to_string();
            assert!(err.contains(why) && err.contains("x"), "{err}");
        }

        let t = Tensor::zeros(DType::F32, &[2, 3, 8]).unwrap();
        assert_eq!(expect_rows("x", &t, Rows { width: 8, rows: Some(6) }, &Spec).unwrap(), 6);
        assert_eq!(expect_rows("x", &t, Rows { width: 8, rows: None }, &Spec).unwrap(), 6);
        let err = expect_rows("x", &t, Rows { width: 8, rows: Some(5) }, &Spec).unwrap_err().to_string();
        assert!(err.contains("[..., 8] with 5 rows (baked into test.cpu.f32)") && err.contains("[2, 3, 8]"), "{err}");
        assert!(expect_rows("x", &t, Rows { width: 4, rows: None }, &Spec).is_err());
        let scalar = Tensor::zeros(DType::F32, &[]).unwrap();
        assert!(expect_rows("x", &scalar, Rows { width: 1, rows: None }, &Spec).is_err());
    }
}
