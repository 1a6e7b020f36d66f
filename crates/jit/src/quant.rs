//! Weight block formats in GEMM panels (placeholder scalar kernels, to be
//! replaced by the AVX2 ones): the packed layout, activations quantized for
//! the integer GEMV, and the kernels.

use kvjit_core::DType;

use crate::microkernel::{GemmTile, TILE_COLUMNS, WidenBlock, avx2_available};

/// Bytes of one quantized activation block of 32 values: 32 × i8, f32
/// scale, i32 sum.
pub const Q8_ACTIVATION_BLOCK_BYTES: usize = 40;

/// Bytes of a packed panel of 16 columns over `k`.
pub fn panel_bytes(format: DType, k: usize) -> usize {
    let (block, bytes) = format.block();
    k / block * bytes * TILE_COLUMNS
}

/// Pack the columns' GGML blocks into a panel (placeholder layout: per k
/// group, the 16 columns' blocks in order).
pub fn pack_panel(format: DType, columns: &[&[u8]], k: usize, out: &mut [u8]) {
    let (block, bytes) = format.block();
    assert!(columns.len() <= TILE_COLUMNS && out.len() == panel_bytes(format, k));
    out.fill(0);
    for g in 0..k / block {
        for (c, column) in columns.iter().enumerate() {
            out[(g * TILE_COLUMNS + c) * bytes..][..bytes].copy_from_slice(&column[g * bytes..][..bytes]);
        }
    }
}

/// Quantize activations per block of 32.
pub fn quantize_activations(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(Q8_ACTIVATION_BLOCK_BYTES)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (o, &v) in ob.iter_mut().zip(xb) {
            let q = (v * inv).round() as i8;
            sum += i32::from(q);
            *o = q as u8;
        }
        ob[32..36].copy_from_slice(&d.to_le_bytes());
        ob[36..40].copy_from_slice(&sum.to_le_bytes());
    }
}

unsafe extern "C" fn dequant_generic<const F: usize>(w: *const u8, count: usize, out: *mut f32) {
    let format = DType::BLOCK_FORMATS[F];
    let (block, bytes) = format.block();
    let kc = count / TILE_COLUMNS;
    // SAFETY: the caller passes kc·16 weights of whole blocks at w and kc·16 f32 at out.
    let (w, out) = unsafe {
        (std::slice::from_raw_parts(w, kc / block * bytes * TILE_COLUMNS), std::slice::from_raw_parts_mut(out, count))
    };
    let mut values = vec![0f32; block];
    for g in 0..kc / block {
        for c in 0..TILE_COLUMNS {
            kvjit_core::quant::dequantize(format, &w[(g * TILE_COLUMNS + c) * bytes..][..bytes], &mut values).unwrap();
            for (j, &v) in values.iter().enumerate() {
                out[(g * block + j) * TILE_COLUMNS + c] = v;
            }
        }
    }
}

unsafe extern "C" fn gemv_generic<const F: usize>(x: *const f32, _x_step: usize, w: *const u8, k: usize, c: *mut f32) {
    let format = DType::BLOCK_FORMATS[F];
    let (block, bytes) = format.block();
    // SAFETY: the caller passes K/32 activation blocks, a panel over K and 16 outputs.
    let (x, w, c) = unsafe {
        (
            std::slice::from_raw_parts(x.cast::<u8>(), k / 32 * Q8_ACTIVATION_BLOCK_BYTES),
            std::slice::from_raw_parts(w, k / block * bytes * TILE_COLUMNS),
            std::slice::from_raw_parts_mut(c, TILE_COLUMNS),
        )
    };
    let mut values = vec![0f32; block];
    for g in 0..k / block {
        let xb = &x[g * Q8_ACTIVATION_BLOCK_BYTES..][..Q8_ACTIVATION_BLOCK_BYTES];
        let d = f32::from_le_bytes(xb[32..36].try_into().unwrap());
        for (col, out) in c.iter_mut().enumerate() {
            kvjit_core::quant::dequantize(format, &w[(g * TILE_COLUMNS + col) * bytes..][..bytes], &mut values)
                .unwrap();
            let dot: f32 = values.iter().zip(&xb[..32]).map(|(&v, &q)| v * f32::from(q as i8)).sum();
            *out += dot * d;
        }
    }
}

/// The integer GEMV of a 32-weight block format.
pub fn quant_gemv(format: DType) -> Option<GemmTile> {
    if !avx2_available() {
        return None;
    }
    Some(match format {
        DType::Q8_0 => gemv_generic::<0>,
        DType::Q4_0 => gemv_generic::<1>,
        DType::Q4_1 => gemv_generic::<2>,
        _ => return None,
    })
}

/// Dequantize a panel block to f32 `[k][16]`.
pub fn dequantize_block(format: DType) -> Option<WidenBlock> {
    if !avx2_available() {
        return None;
    }
    Some(match format {
        DType::Q8_0 => dequant_generic::<0>,
        DType::Q4_0 => dequant_generic::<1>,
        DType::Q4_1 => dequant_generic::<2>,
        DType::Q4K => dequant_generic::<3>,
        DType::Q6K => dequant_generic::<4>,
        _ => return None,
    })
}
