//! Random weights in the weight block formats ([`DType::BLOCK_FORMATS`]):
//! every byte of the quants random, the scales finite f16 of a sane size
//! (so a wrong decode shows as a wrong value, not a NaN that hides it),
//! and the exact bound of a product against activations quantized per
//! block of 32 (what the integer GEMV costs).

use half::f16;
use kvjit_core::{DType, Tensor};
use rand::Rng;

/// An f16 scale in ±[`low`, `high`) (random sign when `signed`), as bytes.
fn scale(rng: &mut impl Rng, low: f32, high: f32, signed: bool) -> [u8; 2] {
    let magnitude = rng.gen_range(low..high);
    let value = if signed && rng.gen_bool(0.5) { -magnitude } else { magnitude };
    f16::from_f32(value).to_bits().to_le_bytes()
}

/// One random block of `format`.
pub fn random_block(format: DType, rng: &mut impl Rng) -> Vec<u8> {
    let (_, bytes) = format.block();
    let mut block: Vec<u8> = (0..bytes).map(|_| rng.r#gen()).collect();
    match format {
        DType::Q8_0 | DType::Q4_0 => block[..2].copy_from_slice(&scale(rng, 0.002, 0.02, true)),
        DType::Q4_1 => {
            block[..2].copy_from_slice(&scale(rng, 0.002, 0.02, true));
            block[2..4].copy_from_slice(&scale(rng, 0.0, 0.1, true));
        }
        DType::Q4K => {
            // d and dmin: the 6-bit scales and mins multiply them.
            block[..2].copy_from_slice(&scale(rng, 0.0002, 0.002, false));
            block[2..4].copy_from_slice(&scale(rng, 0.0, 0.002, false));
        }
        DType::Q6K => {
            // d last; the 16 i8 scales before it multiply it.
            block[bytes - 2..].copy_from_slice(&scale(rng, 0.00002, 0.0002, true));
        }
        other => panic!("{other} is not a weight block format"),
    }
    block
}

/// A random `[rows, k]` weight of `format` (`k` a multiple of its block).
pub fn random_blocks(format: DType, rows: usize, k: usize, rng: &mut impl Rng) -> Tensor {
    let blocks = rows * k / format.block().0;
    let bytes: Vec<u8> = (0..blocks).flat_map(|_| random_block(format, rng)).collect();
    Tensor::from_le_bytes(format, &[rows, k], &bytes).expect("whole blocks of rows")
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
