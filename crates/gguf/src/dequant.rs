//! Dequantization of GGML block types into f32, bit for bit as gguf-py's
//! numpy reference (`gguf/quants.py`) and ggml's `dequantize_row_*` compute
//! it: every product and sum rounded to f32 in the same order, no fused
//! multiply-add.
//!
//! | type | block | elements |
//! |------|-------|----------|
//! | Q8_0 | f16 `d`, 32 × i8 `q` | `q[j]·d` |
//! | Q4_0 | f16 `d`, 16 bytes | element `j < 16`: `d·((b[j] & 15) − 8)`; `j ≥ 16`: `d·((b[j−16] >> 4) − 8)` |
//! | Q4_1 | f16 `d`, f16 `m`, 16 bytes | `d·q + m`, nibbles as Q4_0 |
//! | Q4_K | f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 bytes | per 32 elements: `(d·sc)·q − dmin·m` |
//! | Q6_K | 128 bytes low 4 bits, 64 bytes high 2 bits, 16 × i8 scales, f16 `d` | per 16 elements: `(d·sc)·(q − 32)` |

use crate::GgmlType;

use kvjit_core::quant::f16_at;

/// Dequantize whole blocks of `ty` from `bytes` into `out`, which must hold
/// exactly `bytes.len() / type_size × block_size` elements; `bytes` must be
/// whole blocks. F32, F16 and BF16 are widened. Other types, and lengths
/// that do not fit, are an error (a message).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let (block, size) = (ty.block_size(), ty.type_size());
    if !bytes.len().is_multiple_of(size) || bytes.len() / size * block != out.len() {
        return Err(format!(
            "{} bytes of {ty} are not {} elements of whole {block}-element blocks",
            bytes.len(),
            out.len()
        ));
    }
    let blocks = bytes.chunks_exact(size).zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, o) in blocks {
                o[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, o) in blocks {
                o[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q6K => {
            let format = ty.block_format().expect("the five block formats kvjit keeps");
            kvjit_core::quant::dequantize(format, bytes, out).map_err(|e| e.to_string())?;
        }
        other => {
            return Err(format!("kvjit cannot dequantize {other} (it reads {})", GgmlType::supported_names()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(d: &[u16], rest: &[u8], size: usize) -> Vec<u8> {
        let mut b: Vec<u8> = d.iter().flat_map(|v| v.to_le_bytes()).collect();
        b.extend_from_slice(rest);
        b.resize(size, 0);
        b
    }

    fn run(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![f32::NAN; bytes.len() / ty.type_size() * ty.block_size()];
        dequantize(ty, bytes, &mut out).unwrap();
        out
    }

    /// Bits, so that -0.0 and NaN compare as themselves.
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn q8_0_is_d_times_q() {
        // d = 1.5 (f16 0x3e00); q = -128, -1, 0, 1, 127, then zeros.
        let q = [0x80u8, 0xff, 0, 1, 127];
        let out = run(GgmlType::Q8_0, &block(&[0x3e00], &q, 34));
        assert_eq!(&out[..5], &[-192.0, -1.5, 0.0, 1.5, 190.5]);
        assert!(out[5..].iter().all(|&v| v.to_bits() == 0));
    }

    #[test]
    fn q8_0_zero_negative_zero_nan_and_infinite_scales() {
        let q = [0x80u8, 0, 1];
        // d = +0: q·0 keeps q's sign (−128·0 = −0).
        let out = run(GgmlType::Q8_0, &block(&[0x0000], &q, 34));
        assert_eq!(bits(&out[..3]), bits(&[-0.0, 0.0, 0.0]));
        // d = −0: the signs flip.
        let out = run(GgmlType::Q8_0, &block(&[0x8000], &q, 34));
        assert_eq!(bits(&out[..3]), bits(&[0.0, -0.0, -0.0]));
        // d = NaN: every element NaN.
        assert!(run(GgmlType::Q8_0, &block(&[0x7e00], &q, 34)).iter().all(|v| v.is_nan()));
        // d = +inf: ±inf, and 0·inf = NaN.
        let out = run(GgmlType::Q8_0, &block(&[0x7c00], &q, 34));
        assert_eq!(out[0], f32::NEG_INFINITY);
        assert!(out[1].is_nan());
        assert_eq!(out[2], f32::INFINITY);
    }

    #[test]
    fn q4_0_low_nibbles_are_the_first_half_and_extremes_map_to_minus_8_and_7() {
        // d = 2.0 (0x4000); byte 0 = 0xF0: element 0 = 2·(0−8), element 16 = 2·(15−8).
        let mut qs = [0x88u8; 16]; // every other element 2·(8−8) = 0
        qs[0] = 0xf0;
        qs[1] = 0x0f;
        qs[15] = 0x19;
        let out = run(GgmlType::Q4_0, &block(&[0x4000], &qs, 18));
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
        assert_eq!(out[1], 14.0);
        assert_eq!(out[17], -16.0);
        assert_eq!(out[15], 2.0 * (9.0 - 8.0));
        assert_eq!(out[31], 2.0 * (1.0 - 8.0));
        assert!(out.iter().enumerate().filter(|(i, _)| ![0, 1, 15, 16, 17, 31].contains(i)).all(|(_, &v)| v == 0.0));
        // d = −0: d·(q−8) is +0 for q < 8 and −0 for q ≥ 8.
        let out = run(GgmlType::Q4_0, &block(&[0x8000], &qs, 18));
        assert_eq!(out[0].to_bits(), 0.0f32.to_bits()); // −0 · −8 = +0
        assert_eq!(out[16].to_bits(), (-0.0f32).to_bits()); // −0 · 7
        assert!(run(GgmlType::Q4_0, &block(&[0xfe00], &qs, 18)).iter().all(|v| v.is_nan()));
    }

    #[test]
    fn q4_1_is_d_times_q_plus_m() {
        // d = 0.5 (0x3800), m = −1 (0xbc00).
        let mut qs = [0u8; 16];
        qs[0] = 0xf0;
        qs[3] = 0x7a;
        let out = run(GgmlType::Q4_1, &block(&[0x3800, 0xbc00], &qs, 20));
        assert_eq!(out[0], -1.0); // 0.5·0 − 1
        assert_eq!(out[16], 6.5); // 0.5·15 − 1
        assert_eq!(out[3], 4.0); // 0.5·10 − 1
        assert_eq!(out[19], 2.5); // 0.5·7 − 1
        assert_eq!(out[5], -1.0);
        // d = 0, m = −0: 0·q + −0 = +0 (IEEE: 0 + −0 = +0).
        let out = run(GgmlType::Q4_1, &block(&[0x0000, 0x8000], &qs, 20));
        assert!(out.iter().all(|v| v.to_bits() == 0));
        // NaN m poisons every element.
        assert!(run(GgmlType::Q4_1, &block(&[0x3800, 0x7e00], &qs, 20)).iter().all(|v| v.is_nan()));
    }

    #[test]
    fn q4_k_unpacks_6_bit_scales_and_mins() {
        // d = 1 (0x3c00), dmin = 0.5 (0x3800). Sub-block 0: sc 2, m 1;
        // sub-block 4: sc 63, m 33 (high bits in bytes 0 and 4, low bits
        // in byte 8); every other scale and min 0.
        let mut scales = [0u8; 12];
        scales[0] = 2 | (3 << 6); // sc0 = 2, sc4 >> 4 = 3
        scales[4] = 1 | (2 << 6); // m0 = 1, m4 >> 4 = 2
        scales[8] = 0x0f | (0x01 << 4); // sc4 & 15 = 15, m4 & 15 = 1
        let mut b = block(&[0x3c00, 0x3800], &scales, 16);
        let mut qs = [0u8; 128];
        qs[0] = 0x3f; // element 0: low 15 (sub 0); element 32: high 3 (sub 1)
        qs[64] = 0x05; // element 128: low 5 (sub 4)
        b.extend_from_slice(&qs);
        let out = run(GgmlType::Q4K, &b);
        assert_eq!(out[0], 2.0 * 15.0 - 0.5);
        assert_eq!(out[1], -0.5);
        assert_eq!(out[32], 0.0);
        assert_eq!(out[128], 63.0 * 5.0 - 16.5);
        assert_eq!(out[129], -16.5);
        assert_eq!(out[160], 0.0); // sub 5: sc 0, m 0
    }

    #[test]
    fn q6_k_combines_low_and_high_bits_with_signed_scales() {
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        let mut sc = [0u8; 16];
        ql[0] = 0x2f; // element 0 low 4 bits 15; element 64 low 4 bits 2
        ql[32] = 0x10; // element 32 low 0; element 96 low 1
        qh[0] = 0b11_00_01_10; // high bits: e0 2, e32 1, e64 0, e96 3
        sc[0] = (-3i8) as u8;
        sc[2] = 5;
        sc[4] = 7;
        sc[6] = (-1i8) as u8;
        sc[8] = 2;
        let mut b = ql.to_vec();
        b.extend_from_slice(&qh);
        b.extend_from_slice(&sc);
        b.extend_from_slice(&0x3400u16.to_le_bytes()); // d = 0.25
        let out = run(GgmlType::Q6K, &b);
        assert_eq!(out[0], -0.75 * 15.0); // q 47 − 32
        assert_eq!(out[32], 1.25 * -16.0); // q 16 − 32
        assert_eq!(out[64], 1.75 * -30.0); // q 2 − 32
        assert_eq!(out[96], -0.25 * 17.0); // q 49 − 32
        assert_eq!(out[1], -0.75 * -32.0);
        assert_eq!(out[16].to_bits(), (-0.0f32).to_bits()); // scale 0 · −32
        assert_eq!(out[128], 0.5 * -32.0);
    }

    #[test]
    fn plain_types_widen_exactly_and_sizes_are_checked() {
        let out = run(GgmlType::BF16, &[0x80, 0x3f, 0xc0, 0xff]);
        assert_eq!(out[0], 1.0);
        assert!(out[1].is_nan());
        assert_eq!(run(GgmlType::F16, &0x3c00u16.to_le_bytes()), vec![1.0]);
        assert_eq!(run(GgmlType::F32, &2.5f32.to_le_bytes()), vec![2.5]);
        let mut out = [0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0; 33], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0; 34], &mut out[..31]).is_err());
        let err = dequantize(GgmlType::Q5K, &[0; 176], &mut [0f32; 256]).unwrap_err();
        assert!(err.contains("cannot dequantize Q5_K"), "{err}");
    }
}
