//! Lane shuffles of `F32X4` vectors: picking lanes of two vectors
//! ([`f32x4`]) and the 4×4 transpose-add that sums four vectors' lanes
//! ([`transpose_sum`]).

use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;

use super::little;

/// Lanes `lanes` of the 8 f32 lanes of `x` (0..4) and `y` (4..8), as an
/// `F32X4` (one `shufps`, `pshufd` or `unpcklps`-style instruction for the
/// usual patterns).
pub fn f32x4(b: &mut FunctionBuilder, x: Value, y: Value, lanes: [u8; 4]) -> Value {
    let x = b.ins().bitcast(types::I8X16, little(), x);
    let y = b.ins().bitcast(types::I8X16, little(), y);
    let bytes: Vec<u8> = lanes.iter().flat_map(|&l| (0..4).map(move |i| 4 * l + i)).collect();
    let mask = b.func.dfg.immediates.push(bytes.into());
    let shuffled = b.ins().shuffle(x, y, mask);
    b.ins().bitcast(types::F32X4, little(), shuffled)
}

/// `[Σ a0, Σ a1, Σ a2, Σ a3]`: the sums of the lanes of four `F32X4`
/// vectors, as the lanes of one (a 4×4 transpose-add: 6 shuffles, 3 adds).
pub fn transpose_sum(b: &mut FunctionBuilder, a: [Value; 4]) -> Value {
    let pair = |b: &mut FunctionBuilder, x: Value, y: Value| {
        let lo = f32x4(b, x, y, [0, 4, 1, 5]);
        let hi = f32x4(b, x, y, [2, 6, 3, 7]);
        b.ins().fadd(lo, hi)
    };
    let x = pair(b, a[0], a[1]);
    let y = pair(b, a[2], a[3]);
    let lo = f32x4(b, x, y, [0, 1, 4, 5]);
    let hi = f32x4(b, x, y, [2, 3, 6, 7]);
    b.ins().fadd(lo, hi)
}
