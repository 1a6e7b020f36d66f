//! The `mo.reduce.rms_norm` emitter: for each work item, its block of
//! whole rows; per row, the sum of squares in `F32X4` lanes in a fixed
//! order ([`sum_of_squares`]), `1/sqrt(mean + epsilon)` with Cranelift's
//! `sqrt` and `fdiv` (no approximate rsqrt), then each element scaled by it
//! and by `weight + weight_offset`, rounded once on the store.
//!
//! Rows whose `mean(x²) + epsilon` leaves `[2^−100, f32::MAX]` (a sum of
//! squares that overflowed, or one small enough that squares lost bits to
//! underflow) are summed again with every element scaled by `s = 2^−100`
//! (large rows) or `2^100` (small ones) first — powers of two, so the
//! scaling itself is exact — and
//! `y = (x · s) · 1/sqrt(mean((s·x)²) + epsilon·s²)` for small rows,
//! `y = x · (s · 1/sqrt(mean((s·x)²) + epsilon·s²))` for large ones (where
//! `x · s` could underflow): no finite f32 row overflows or underflows.

use std::mem::offset_of;

use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::DType;
use kvjit_jit::KernelParams;
use kvjit_jit::ir::addr::{Size, element};
use kvjit_jit::ir::{self, counted_loop, splat_f32, when};
use kvjit_jit::{cranelift_codegen, cranelift_frontend};

use crate::RmsNormSpec;
use crate::cpu_jit::{RmsNormArgs, rows_per_item};

/// `mean(x²) + epsilon` in `[IN_RANGE_LOW, f32::MAX]` takes the plain path.
const IN_RANGE_LOW: f32 = 7.888_609e-31; // 2^−100

/// The scales of rows outside that range: 2^−100 (large), 2^100 (small).
const SCALE_DOWN: f32 = IN_RANGE_LOW;
const SCALE_UP: f32 = 1.267_650_6e30; // 2^100

/// Elements per iteration of the sum's main loop: four F32X4 accumulators.
const BLOCK: usize = 16;

/// One row's addresses and what the emitter knows of it.
struct Row {
    dtype: DType,
    width: usize,
    x: Value,
}

/// Emit the kernel body: items `[begin, end)`, each `rows_per_item(H)`
/// rows of `x` → `output`, with the row count baked in or read from the
/// arguments.
pub(crate) fn rms_norm_kernel(b: &mut FunctionBuilder, p: KernelParams, spec: &RmsNormSpec) {
    let (dtype, width) = (spec.dtype, spec.rows.width);
    let x = p.field(b, offset_of!(RmsNormArgs, x));
    let weight = p.field(b, offset_of!(RmsNormArgs, weight));
    let output = p.field(b, offset_of!(RmsNormArgs, output));
    let rows = match spec.rows.rows {
        Some(n) => Size::Known(n),
        None => Size::Runtime(p.field(b, offset_of!(RmsNormArgs, rows))),
    };
    let rows = rows.value(b);
    let per_item = rows_per_item(width) as i64;
    let row_bytes = (width * dtype.size_bytes()) as i64;
    counted_loop(b, p.begin, p.end, 1, &[], |b, item, _| {
        // This item's rows: [start, stop), stop = min(start + per_item, rows).
        let start = b.ins().imul_imm_s(item, per_item);
        let full = b.ins().iadd_imm_s(start, per_item);
        let stop = b.ins().smin(full, rows);
        counted_loop(b, start, stop, 1, &[], |b, r, _| {
            let at = b.ins().imul_imm_s(r, row_bytes);
            let x_row = b.ins().iadd(x, at);
            let out_row = b.ins().iadd(output, at);
            let row = Row { dtype, width, x: x_row };
            let (pre, post) = row_factors(b, &row, spec.epsilon);
            scale_row(b, &row, weight, out_row, [pre, post], spec.weight_offset);
            Vec::new()
        });
        Vec::new()
    });
}

/// The two f32 factors of a row, `y = ((x · pre) · post) · w'`: `pre = 1`,
/// `post = 1/sqrt(mean(x²) + epsilon)` on the plain path; the scaled ones
/// (see the module docs) where that total leaves the f32 range.
fn row_factors(b: &mut FunctionBuilder, row: &Row, epsilon: f32) -> (Value, Value) {
    let one = b.ins().f32const(1.0);
    let sum = sum_of_squares(b, row, None);
    let total = mean_plus_epsilon(b, row, sum, epsilon, None);
    let post = inverse_sqrt(b, total);
    let (pre_var, post_var) = (b.declare_var(types::F32), b.declare_var(types::F32));
    b.def_var(pre_var, one);
    b.def_var(post_var, post);

    let low = b.ins().f32const(IN_RANGE_LOW);
    let max = b.ins().f32const(f32::MAX);
    let below_low = b.ins().fcmp(FloatCC::UnorderedOrLessThan, total, low);
    let above_max = b.ins().fcmp(FloatCC::GreaterThan, total, max);
    let out_of_range = b.ins().bor(below_low, above_max);
    when(b, out_of_range, |b| {
        // Large (> 1: overflowed) or small (or NaN, which stays NaN).
        let large = b.ins().fcmp(FloatCC::GreaterThan, total, one);
        let (down, up) = (b.ins().f32const(SCALE_DOWN), b.ins().f32const(SCALE_UP));
        let scale = b.ins().select(large, down, up);
        let scale_lanes = b.ins().splat(types::F32X4, scale);
        let sum = sum_of_squares(b, row, Some(scale_lanes));
        let total = mean_plus_epsilon(b, row, sum, epsilon, Some(scale));
        let inverse = inverse_sqrt(b, total);
        let scaled_inverse = b.ins().fmul(scale, inverse);
        let pre = b.ins().select(large, one, scale);
        let post = b.ins().select(large, scaled_inverse, inverse);
        b.def_var(pre_var, pre);
        b.def_var(post_var, post);
    });
    (b.use_var(pre_var), b.use_var(post_var))
}

/// `sum / H + epsilon`, with epsilon times `scale²` (as `(epsilon · scale) ·
/// scale`, each step in range) when the squares were scaled.
fn mean_plus_epsilon(b: &mut FunctionBuilder, row: &Row, sum: Value, epsilon: f32, scale: Option<Value>) -> Value {
    let width = b.ins().f32const(row.width as f32);
    let mean = b.ins().fdiv(sum, width);
    let mut epsilon = b.ins().f32const(epsilon);
    if let Some(scale) = scale {
        let once = b.ins().fmul(epsilon, scale);
        epsilon = b.ins().fmul(once, scale);
    }
    b.ins().fadd(mean, epsilon)
}

/// `1 / sqrt(total)`, each step correctly rounded.
fn inverse_sqrt(b: &mut FunctionBuilder, total: Value) -> Value {
    let root = b.ins().sqrt(total);
    let one = b.ins().f32const(1.0);
    b.ins().fdiv(one, root)
}

/// `Σ (scale · x)²` over the row, as an F32, in a fixed order (so a row's
/// result depends on nothing but the row): four `F32X4` accumulators
/// `acc[k]` take the squares of elements `16j + 4k + lane` in order of `j`;
/// the 0–3 whole vectors left after the last full block of 16 go into
/// `acc[0]`, `acc[1]`, `acc[2]` in order; then `(acc[0] + acc[1]) +
/// (acc[2] + acc[3])`, its lanes as `(l0 + l1) + (l2 + l3)`, and last the
/// 0–3 elements past the last whole vector, one at a time in order.
fn sum_of_squares(b: &mut FunctionBuilder, row: &Row, scale: Option<Value>) -> Value {
    let bytes = row.dtype.size_bytes();
    let square = |b: &mut FunctionBuilder, v: Value| {
        let v = scale.map_or(v, |s| b.ins().fmul(v, s));
        b.ins().fmul(v, v)
    };
    let zero = splat_f32(b, 0.0);
    let blocks_end = (row.width / BLOCK * BLOCK) as i64;
    let start = b.ins().iconst(types::I64, 0);
    let end = b.ins().iconst(types::I64, blocks_end);
    let mut acc = counted_loop(b, start, end, BLOCK as i64, &[zero; 4], |b, i, acc| {
        let at = element(b, row.x, i, bytes);
        (0..4)
            .map(|k| {
                let v = ir::load_f32x4_raw(b, row.dtype, at, (4 * k * bytes) as i32);
                let s = square(b, v);
                b.ins().fadd(acc[k], s)
            })
            .collect()
    });
    let vectors_end = row.width / 4 * 4;
    for (k, i) in (blocks_end as usize..vectors_end).step_by(4).enumerate() {
        let at = b.ins().iadd_imm_s(row.x, (i * bytes) as i64);
        let v = ir::load_f32x4_raw(b, row.dtype, at, 0);
        let s = square(b, v);
        acc[k] = b.ins().fadd(acc[k], s);
    }
    let low = b.ins().fadd(acc[0], acc[1]);
    let high = b.ins().fadd(acc[2], acc[3]);
    let lanes = b.ins().fadd(low, high);
    let lane = |b: &mut FunctionBuilder, l: u8| b.ins().extractlane(lanes, l);
    let (l0, l1, l2, l3) = (lane(b, 0), lane(b, 1), lane(b, 2), lane(b, 3));
    let (low, high) = (b.ins().fadd(l0, l1), b.ins().fadd(l2, l3));
    let mut sum = b.ins().fadd(low, high);
    for i in vectors_end..row.width {
        let at = b.ins().iadd_imm_s(row.x, (i * bytes) as i64);
        let v = ir::load_splat_f32x4_raw(b, row.dtype, at, 0);
        let s = square(b, v);
        let s = b.ins().extractlane(s, 0);
        sum = b.ins().fadd(sum, s);
    }
    sum
}

/// Store `((x · pre) · post) · (weight + weight_offset)` for every element
/// of the row: `F32X4` vectors, then the 0–3 left over one at a time.
fn scale_row(b: &mut FunctionBuilder, row: &Row, weight: Value, out: Value, factors: [Value; 2], weight_offset: f32) {
    let (dtype, bytes) = (row.dtype, row.dtype.size_bytes());
    let [pre, post] = factors.map(|f| b.ins().splat(types::F32X4, f));
    let offset = splat_f32(b, weight_offset);
    let scaled = |b: &mut FunctionBuilder, x: Value, w: Value| {
        let w = b.ins().fadd(w, offset);
        let y = b.ins().fmul(x, pre);
        let y = b.ins().fmul(y, post);
        b.ins().fmul(y, w)
    };
    let start = b.ins().iconst(types::I64, 0);
    let vectors_end = b.ins().iconst(types::I64, (row.width / 4 * 4) as i64);
    counted_loop(b, start, vectors_end, 4, &[], |b, i, _| {
        let (src, w_at, dst) = (element(b, row.x, i, bytes), element(b, weight, i, bytes), element(b, out, i, bytes));
        let x = ir::load_f32x4_raw(b, dtype, src, 0);
        let w = ir::load_f32x4_raw(b, dtype, w_at, 0);
        let y = scaled(b, x, w);
        ir::store_f32x4(b, dtype, y, dst, 0);
        Vec::new()
    });
    for i in row.width / 4 * 4..row.width {
        let offset = (i * bytes) as i64;
        let (src, w_at, dst) =
            (b.ins().iadd_imm_s(row.x, offset), b.ins().iadd_imm_s(weight, offset), b.ins().iadd_imm_s(out, offset));
        let x = ir::load_splat_f32x4_raw(b, dtype, src, 0);
        let w = ir::load_splat_f32x4_raw(b, dtype, w_at, 0);
        let y = scaled(b, x, w);
        ir::store_lane(b, dtype, y, 0, dst, 0);
    }
}
