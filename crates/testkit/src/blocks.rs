//! Random weights in the weight block formats ([`DType::BLOCK_FORMATS`],
//! made by [`kvjit_core::quant::random_blocks`]), and the exact bound of a product against activations quantized per
//! block of 32 (what the integer GEMV costs).

use kvjit_core::{DType, Tensor};
use rand::Rng;

pub use kvjit_core::quant::random_block;

/// A random `[rows, k]` weight of `format` (`k` a multiple of its block):
/// [`kvjit_core::quant::random_blocks`].
pub fn random_blocks(format: DType, rows: usize, k: usize, rng: &mut impl Rng) -> Tensor {
    kvjit_core::quant::random_blocks(format, rows, k, rng).expect("whole blocks of rows")
}

/// The most a dot product of the row `x` with the weight row `w` (both
/// f32, `x.len()` a multiple of 32) can move when `x` is quantized to 8
/// bits per block of 32 (scale `max|x|/127`, round to nearest): half a
/// step of each block's scale times the block's `Σ|w|`.
pub fn activation_rounding_bound(x: &[f32], w: &[f32]) -> f64 {
    x.chunks(32)
        .zip(w.chunks(32))
        .map(|(xb, wb)| {
            let step = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / 127.0;
            step / 2.0 * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
        })
        .sum()
}
