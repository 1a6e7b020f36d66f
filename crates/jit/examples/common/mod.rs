//! Random weight matrices the GEMV examples time.

use kvjit_core::DType;
use kvjit_jit::microkernel::TILE_COLUMNS;
use kvjit_jit::quant::{pack_panel, panel_bytes};
use rand::Rng;
use rand::rngs::SmallRng;

/// K·N random bf16 values in ±0.1 (any panel layout: the values are
/// random either way).
pub fn bf16_matrix(k: usize, n: usize, rng: &mut SmallRng) -> Vec<u8> {
    (0..k * n).flat_map(|_| half::bf16::from_f32(rng.gen_range(-0.1..0.1)).to_bits().to_le_bytes()).collect()
}

/// N/16 packed panels of random blocks with sane f16 scales.
pub fn quant_matrix(format: DType, k: usize, n: usize, rng: &mut SmallRng) -> Vec<u8> {
    let (block, size) = format.block();
    let column_bytes = k / block * size;
    let panel = panel_bytes(format, k);
    let mut out = vec![0u8; n / TILE_COLUMNS * panel];
    let mut columns = vec![vec![0u8; column_bytes]; TILE_COLUMNS];
    let scale = |rng: &mut SmallRng| half::f16::from_f32(rng.gen_range(1e-3..1e-2)).to_bits().to_le_bytes();
    for p in 0..n / TILE_COLUMNS {
        for column in &mut columns {
            rng.fill(&mut column[..]);
            for b in column.chunks_exact_mut(size) {
                let at = if format == DType::Q6K { 208 } else { 0 };
                b[at..at + 2].copy_from_slice(&scale(rng));
                if matches!(format, DType::Q4_1 | DType::Q4K) {
                    b[2..4].copy_from_slice(&scale(rng));
                }
            }
        }
        let refs: Vec<&[u8]> = columns.iter().map(Vec::as_slice).collect();
        pack_panel(format, &refs, k, &mut out[p * panel..(p + 1) * panel]);
    }
    out
}
