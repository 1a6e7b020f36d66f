//! Random weights in the weight block formats ([`DType::BLOCK_FORMATS`],
//! made by [`kvjit_core::quant::random_blocks`]), and the exact bound of a
//! product against activations rounded per block of 32 (what the integer
//! GEMV costs).

use kvjit_core::{DType, Tensor};
use rand::Rng;

pub use kvjit_core::quant::random_block;

/// A random `[rows, k]` weight of `format` (`k` a multiple of its block):
/// [`kvjit_core::quant::random_blocks`].
pub fn random_blocks(format: DType, rows: usize, k: usize, rng: &mut impl Rng) -> Tensor {
    kvjit_core::quant::random_blocks(format, rows, k, rng).expect("whole blocks of rows")
}

/// The activation scale of the integer GEMV: a block of 32 values is held
/// as integers `Q = round(x/s)` with `s = max|x| / 32258` (16 bits as two
/// 8-bit parts, `kvjit_jit::quant::quantize_activations`).
pub const ACTIVATION_STEPS: f64 = 127.0 * 254.0;

/// The most a dot product of the row `x` with the weight row `w` (both
/// f32, `x.len()` a multiple of 32) can move when `x` is rounded as the
/// integer GEMV rounds it: half a step (`max|x_b| / 32258`) of each block's
/// scale times the block's `Σ|w|`.
pub fn activation_rounding_bound(x: &[f32], w: &[f32]) -> f64 {
    x.chunks(32)
        .zip(w.chunks(32))
        .map(|(xb, wb)| {
            let step = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / ACTIVATION_STEPS;
            step / 2.0 * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
        })
        .sum()
}
