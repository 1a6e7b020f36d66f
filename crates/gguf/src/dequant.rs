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
//! | Q5_0 | f16 `d`, 32 high bits, 16 bytes | `d·(q − 16)`, low nibbles as Q4_0, bit j of the high bits on element j |
//! | Q5_1 | f16 `d`, f16 `m`, 32 high bits, 16 bytes | `d·q + m`, 5-bit `q` as Q5_0 |
//! | Q2_K | 16 bytes of 4-bit scale and min, 64 bytes of 2-bit quants, f16 `d`, f16 `dmin` | per 16 elements: `(d·sc)·q − dmin·m` |
//! | Q3_K | 32 bytes high-bit mask, 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, f16 `d` | per 16 elements: `(d·(sc − 32))·(q − 4·!h)` |
//! | Q5_K | f16 `d`, f16 `dmin`, Q4_K's 12 scale bytes, 32 bytes high bits, 128 bytes | per 32 elements: `(d·sc)·q − dmin·m`, 5-bit `q` |
//! | IQ4_NL | f16 `d`, 16 bytes | `d·T[q]`, `T` the 16 non-linear levels, nibbles as Q4_0 |
//! | IQ4_XS | f16 `d`, 16 bits high scale bits, 4 bytes low scale bits, 128 bytes | per 32 elements: `(d·(sc − 32))·T[q]` |
//!
//! Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K are also kvjit's weight
//! block formats (kept as stored, decoded in the kernels:
//! [`kvjit_core::quant`] is their definition); IQ4_NL is held as Q8_0
//! ([`to_q8_0`]); parts of one constant in different ones of the 32-blocks
//! types are held as kvjit's q8_min ([`to_q8_min`]), and in different
//! K-quants as its q8_kmin ([`to_q8_kmin`]); the others are dequantized
//! when a model loads.

use crate::GgmlType;

use kvjit_core::quant::{IQ4_NL_LEVELS as IQ4_LEVELS, Q8_KMIN_HEADER, QK_K, f16_at, scale_min_k4};

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
        GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Iq4Nl
        | GgmlType::Q4K
        | GgmlType::Q5K
        | GgmlType::Q6K => {
            let format = ty.block_format().expect("the nine block formats kvjit keeps");
            kvjit_core::quant::dequantize(format, bytes, out).map_err(|e| e.to_string())?;
        }
        GgmlType::Q2K => blocks.for_each(|(b, o)| q2_k(b, o)),
        GgmlType::Q3K => blocks.for_each(|(b, o)| q3_k(b, o)),
        GgmlType::Iq4Xs => blocks.for_each(|(b, o)| iq4_xs(b, o)),
        other => {
            return Err(format!("kvjit cannot dequantize {other} (it reads {})", GgmlType::supported_names()));
        }
    }
    Ok(())
}

/// One Q2_K super-block (84 bytes) into 256 elements. Group `g` (0..16)
/// of 16 elements is half `g / 8`'s 32 quant bytes, bytes `16·(g % 2)..`
/// shifted right by `2·(g % 8 / 2)`; its scale byte `g` holds the scale in
/// the low nibble and the min in the high one.
fn q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, rest) = b.split_at(QK_K / 16);
    let (qs, rest) = rest.split_at(QK_K / 4);
    let (d, dmin) = (f16_at(rest, 0), f16_at(rest, 2));
    for (g, o) in out.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(scales[g] & 0x0f);
        let ml = dmin * f32::from(scales[g] >> 4);
        let q = &qs[32 * (g / 8) + 16 * (g % 2)..][..16];
        let shift = 2 * (g % 8 / 2);
        for (o, &q) in o.iter_mut().zip(q) {
            *o = dl * f32::from((q >> shift) & 3) - ml;
        }
    }
}

/// One Q3_K super-block (110 bytes) into 256 elements. Group `g` of 16
/// takes its 2 low bits as Q2_K's group `g` does, its third bit (set: no
/// offset; clear: −4) from bit `g / 2` of mask bytes `16·(g % 2)..`, and a
/// 6-bit scale (minus 32): the low 4 bits from nibble `g / 8` of byte
/// `g % 8`, the high 2 from bits `2·(g / 4)..` of byte `8 + g % 4`.
fn q3_k(b: &[u8], out: &mut [f32]) {
    let (mask, rest) = b.split_at(QK_K / 8);
    let (qs, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(12);
    let d = f16_at(d, 0);
    for (g, o) in out.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(q3_k_scale(scales, g));
        let q = &qs[32 * (g / 8) + 16 * (g % 2)..][..16];
        let h = &mask[16 * (g % 2)..][..16];
        let shift = 2 * (g % 8 / 2);
        for ((o, &q), &h) in o.iter_mut().zip(q).zip(h) {
            let offset = if (h >> (g / 2)) & 1 == 1 { 0 } else { 4 };
            *o = dl * f32::from(((q >> shift) & 3) as i8 - offset);
        }
    }
}

/// 32 elements `d·T[code]` of the 16 code bytes `qs` (low nibbles first).
fn iq4_levels(d: f32, qs: &[u8], out: &mut [f32]) {
    let (low, high) = out.split_at_mut(16);
    for (j, &q) in qs.iter().enumerate() {
        low[j] = d * f32::from(IQ4_LEVELS[usize::from(q & 0x0f)]);
        high[j] = d * f32::from(IQ4_LEVELS[usize::from(q >> 4)]);
    }
}

/// One IQ4_XS super-block (136 bytes) into 256 elements: per 32-element
/// sub-block `s`, IQ4_NL's codes of bytes `16·s..` scaled by
/// `d·(sc − 32)`, the 6-bit `sc` from nibble `s % 2` of low byte `s / 2`
/// and bits `2s..2s + 2` of the 16-bit high field.
fn iq4_xs(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[4 + QK_K / 64..];
    for (s, o) in out.chunks_exact_mut(32).enumerate() {
        iq4_levels(d * f32::from(iq4_xs_scale(b, s)), &qs[16 * s..16 * s + 16], o);
    }
}

/// The 32 integers of a block of a 32-element type whose values are `d`
/// (its leading f16) times an integer, or `d·q + m`: Q8_0's `q`, Q4_0's
/// `q − 8`, Q5_0's `q − 16`, IQ4_NL's level `T[q]`, Q4_1's and Q5_1's
/// unsigned `q`. `None` for other types.
fn block_integers(ty: GgmlType, b: &[u8]) -> Option<[i16; 32]> {
    if !ty.exact_in_q8_min() {
        return None;
    }
    let nibble = |qs: &[u8], j: usize| if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 };
    let fifth = |at: usize, j: usize| ((u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) >> j) & 1) as u8;
    Some(std::array::from_fn(|j| match ty {
        GgmlType::Q8_0 => i16::from(b[2 + j] as i8),
        GgmlType::Q4_0 => i16::from(nibble(&b[2..], j)) - 8,
        GgmlType::Q4_1 => i16::from(nibble(&b[4..], j)),
        GgmlType::Q5_0 => i16::from(nibble(&b[6..], j) | fifth(2, j) << 4) - 16,
        GgmlType::Q5_1 => i16::from(nibble(&b[8..], j) | fifth(4, j) << 4),
        _ => i16::from(IQ4_LEVELS[usize::from(nibble(&b[2..], j))]),
    }))
}

/// Blocks of a type whose every element is an f16 scale times an integer
/// in −128..=127 per block of 32 ([`GgmlType::exact_in_q8_0`]: Q4_0, Q5_0,
/// IQ4_NL) rewritten as Q8_0 blocks (34 bytes: the same f16 `d`, then the
/// 32 integers `q − 8`, `q − 16` or `T[q]`), so that every element
/// dequantizes to the same f32 bits (`d` times the same integer). `None`
/// for other types (Q8_0 itself included) or bytes that are not whole
/// blocks.
pub fn to_q8_0(ty: GgmlType, bytes: &[u8]) -> Option<Vec<u8>> {
    let size = ty.type_size();
    if !matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Iq4Nl) || !bytes.len().is_multiple_of(size) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / size * 34);
    for b in bytes.chunks_exact(size) {
        out.extend_from_slice(&b[..2]);
        out.extend(block_integers(ty, b)?.map(|q| q as i8 as u8));
    }
    Some(out)
}

/// Blocks of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL ([`GgmlType::exact_in_q8_min`])
/// rewritten as kvjit's q8_min blocks (36 bytes: f16 `d`, f16 `m`, 32 × u8
/// `q`, worth `d·q + m`), every element the same f32 value: Q4_1 and Q5_1
/// keep `d`, `m` and `q`; the others, `d` times an integer `i` in
/// −128..=127, become `q = i + c`, `m = −c·d` with `c` = 128 (Q8_0, IQ4_NL),
/// 8 (Q4_0) or 16 (Q5_0) — `d·q` is exact in f32 (11 × 8 bits) and so is
/// `d·q − c·d = d·i`, the value the type gives, so the one rounding of the
/// sum leaves it as it is (a zero may change its sign). `None` for other
/// types, bytes that are not whole blocks, or a block whose `−c·d` is not
/// an f16 (`d` not finite, or `|c·d|` past f16's range).
pub fn to_q8_min(ty: GgmlType, bytes: &[u8]) -> Option<Vec<u8>> {
    let size = ty.type_size();
    if !ty.exact_in_q8_min() || !bytes.len().is_multiple_of(size) {
        return None;
    }
    let offset = q8_min_offset(ty);
    let mut out = Vec::with_capacity(bytes.len() / size * 36);
    for b in bytes.chunks_exact(size) {
        let integers = block_integers(ty, b)?;
        out.extend_from_slice(&b[..2]);
        out.extend_from_slice(&q8_min_minimum(ty, b)?);
        out.extend(integers.map(|i| u8::try_from(i + offset).expect("i + c is in 0..=255")));
    }
    Some(out)
}

/// The `c` of a type's q8_min rewrite: `q = i + c`, `m = −c·d`.
fn q8_min_offset(ty: GgmlType) -> i16 {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => 0,
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        _ => 128,
    }
}

/// The f16 minimum `m` of block `b` rewritten as q8_min: its own (Q4_1,
/// Q5_1) or `−c·d`; `None` where that is not an f16 (`d` not finite, or
/// `|c·d|` past f16's range).
fn q8_min_minimum(ty: GgmlType, b: &[u8]) -> Option<[u8; 2]> {
    match q8_min_offset(ty) {
        0 => Some([b[2], b[3]]),
        c => {
            let d = half::f16::from_le_bytes([b[0], b[1]]);
            // c·d is exact in f16 when finite: c is a power of two.
            let m = half::f16::from_f32(-f32::from(c) * d.to_f32());
            (d.is_finite() && m.is_finite()).then(|| m.to_le_bytes())
        }
    }
}

/// The f16 `d` and `dmin` of super-block `b` rewritten as q8_kmin; `None`
/// where either is not finite.
fn q8_kmin_scales(ty: GgmlType, b: &[u8]) -> Option<([u8; 2], [u8; 2])> {
    let (d, dmin) = match ty {
        GgmlType::Q6K => ([b[208], b[209]], [b[208], b[209]]),
        GgmlType::Q2K => ([b[80], b[81]], [b[82], b[83]]),
        GgmlType::Q3K => ([b[108], b[109]], [b[108], b[109]]),
        GgmlType::Iq4Xs => ([b[0], b[1]], [b[0], b[1]]),
        _ => ([b[0], b[1]], [b[2], b[3]]),
    };
    [d, dmin].iter().all(|x| half::f16::from_le_bytes(*x).is_finite()).then_some((d, dmin))
}

/// Whether `bytes` of `ty` rewrite exactly into `format` (Q8_0, q8_min or
/// q8_kmin) — what [`to_q8_0`], [`to_q8_min`] and [`to_q8_kmin`] would
/// return `Some` for — reading only the blocks' scales.
pub fn holds_in(ty: GgmlType, bytes: &[u8], format: kvjit_core::DType) -> bool {
    use kvjit_core::DType;
    let size = ty.type_size();
    let whole = bytes.len().is_multiple_of(size);
    let mut blocks = bytes.chunks_exact(size);
    match format {
        DType::Q8_0 => whole && matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Iq4Nl),
        DType::Q8Min => whole && ty.exact_in_q8_min() && blocks.all(|b| q8_min_minimum(ty, b).is_some()),
        DType::Q8KMin => whole && ty.exact_in_q8_kmin() && blocks.all(|b| q8_kmin_scales(ty, b).is_some()),
        _ => false,
    }
}

/// Super-blocks of Q4_K, Q5_K, Q6_K, Q2_K, Q3_K or IQ4_XS
/// ([`GgmlType::exact_in_q8_kmin`]) rewritten as kvjit's q8_kmin
/// super-blocks (308 bytes: f16 `d`, f16 `dmin`, per 16 elements an i8
/// `sc` and i16 `m`, 256 × u8 `q`, worth `(d·sc)·q − dmin·m` rounded once),
/// every element the same f32 value. Each type is `S·i − M` per 16 with
/// `S = d·sc` and `M = dmin·m` exact in f32 and one rounding:
/// - Q4_K, Q5_K and Q2_K are that form already (`S·i` exact, the one
///   rounding that of the difference): `d`, `dmin`, scales, minimums and
///   quants kept (Q4_K's and Q5_K's per 32 for both 16-halves);
/// - Q6_K, `(d·sc)·(q − 32)`, Q3_K, `(d·(sc − 32))·(q − o)`, and IQ4_XS,
///   `(d·(sc − 32))·T[code]`, are `S·(q − c)` for a constant `c` (32, 4,
///   128 with `q` = `T[code] + 128`): `dmin = d`, `m = c·sc` (the scale
///   less 32 for Q3_K and IQ4_XS), so `S·q − d·(c·sc)` is the same real
///   number rounded once.
///
/// `None` for other types, bytes that are not whole super-blocks, or a
/// super-block whose `d` or `dmin` is not finite.
pub fn to_q8_kmin(ty: GgmlType, bytes: &[u8]) -> Option<Vec<u8>> {
    let size = ty.type_size();
    if !ty.exact_in_q8_kmin() || !bytes.len().is_multiple_of(size) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / size * 308);
    for b in bytes.chunks_exact(size) {
        let mut block = [0u8; 308];
        let (d, dmin) = q8_kmin_scales(ty, b)?;
        block[..2].copy_from_slice(&d);
        block[2..4].copy_from_slice(&dmin);
        let (scales, quants) = block[4..].split_at_mut(Q8_KMIN_HEADER - 4);
        let (sc, m) = scales.split_at_mut(16);
        for i in 0..16 {
            let (scale, min): (i8, i16) = match ty {
                GgmlType::Q6K => (b[192 + i] as i8, 32 * i16::from(b[192 + i] as i8)),
                GgmlType::Q2K => ((b[i] & 0x0f) as i8, i16::from(b[i] >> 4)),
                GgmlType::Q3K => {
                    let scale = q3_k_scale(&b[96..108], i);
                    (scale, 4 * i16::from(scale))
                }
                GgmlType::Iq4Xs => {
                    let scale = iq4_xs_scale(b, i / 2);
                    (scale, 128 * i16::from(scale))
                }
                _ => {
                    let (scale, min) = scale_min_k4(i / 2, &b[4..16]);
                    (scale as i8, i16::from(min))
                }
            };
            sc[i] = scale as u8;
            m[2 * i..2 * i + 2].copy_from_slice(&min.to_le_bytes());
        }
        for (e, q) in quants.iter_mut().enumerate() {
            let (s, l) = (e / 32, e % 32);
            // Q2_K's and Q3_K's 2 low bits of element e: group g = e / 16.
            let two_bits = || {
                let g = e / 16;
                (b[if ty == GgmlType::Q2K { 16 } else { 32 } + 32 * (g / 8) + 16 * (g % 2) + e % 16]
                    >> (2 * (g % 8 / 2)))
                    & 3
            };
            *q = match ty {
                GgmlType::Q4K => (b[16 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f,
                GgmlType::Q5K => ((b[48 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f) | ((b[16 + l] >> s) & 1) << 4,
                GgmlType::Q6K => {
                    // Per 128, rows r = 0..4 of 32 from the low and high
                    // nibbles of ql and the 2-bit fields of qh.
                    let (half, r) = (e / 128, e % 128 / 32);
                    let low = (b[64 * half + 32 * (r % 2) + l] >> (4 * (r / 2))) & 0x0f;
                    low | ((b[128 + 32 * half + l] >> (2 * r)) & 3) << 4
                }
                GgmlType::Q2K => two_bits(),
                GgmlType::Q3K => {
                    // q − 4 with the third bit clear, q with it set: + 4.
                    let g = e / 16;
                    let high = (b[16 * (g % 2) + e % 16] >> (g / 2)) & 1;
                    two_bits() + 4 * high
                }
                _ => {
                    // IQ4_XS: the level + 128 (1..=241).
                    let code = (b[8 + 16 * s + l % 16] >> (4 * (l / 16))) & 0x0f;
                    (IQ4_LEVELS[usize::from(code)] as u8) ^ 0x80
                }
            };
        }
        out.extend_from_slice(&block);
    }
    Some(out)
}

/// Q3_K's scale of 16-element group `g`, less 32: the low 4 bits from
/// nibble `g / 8` of byte `g % 8`, the high 2 from bits `2·(g / 4)..` of
/// byte `8 + g % 4` of its 12 scale bytes.
fn q3_k_scale(scales: &[u8], g: usize) -> i8 {
    let low = (scales[g % 8] >> (4 * (g / 8))) & 0x0f;
    let high = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
    (low | high << 4) as i8 - 32
}

/// IQ4_XS's scale of 32-element sub-block `s`, less 32: nibble `s % 2` of
/// low byte `s / 2` and bits `2s..2s + 2` of the 16-bit high field.
fn iq4_xs_scale(b: &[u8], s: usize) -> i8 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = b[4 + s / 2];
    (((low >> (4 * (s % 2))) & 0x0f) | (((high >> (2 * s)) & 3) as u8) << 4) as i8 - 32
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
    fn q8_0_to_q8_min_by_hand() {
        // d = 1.5; q = -128, -1, 0, 1, 127 → q + 128 = 0, 127, 128, 129, 255,
        // m = −128·1.5 = −192 (f16 0xda00); the other 27 quants 0 → 128.
        let q = [0x80u8, 0xff, 0, 1, 127];
        let held = to_q8_min(GgmlType::Q8_0, &block(&[0x3e00], &q, 34)).unwrap();
        assert_eq!(&held[..9], &[0x00, 0x3e, 0x00, 0xda, 0, 127, 128, 129, 255]);
        assert!(held[9..].iter().all(|&b| b == 128) && held.len() == 36);
        let mut out = [f32::NAN; 32];
        kvjit_core::quant::dequantize(kvjit_core::DType::Q8Min, &held, &mut out).unwrap();
        assert_eq!(&out[..5], &[-192.0, -1.5, 0.0, 1.5, 190.5]);
        // Q4_1 keeps d, m and its nibbles: low nibbles first.
        let mut qs = [0u8; 16];
        qs[0] = 0xf3;
        let held = to_q8_min(GgmlType::Q4_1, &block(&[0x3e00, 0xbc00], &qs, 20)).unwrap();
        assert_eq!(&held[..5], &[0x00, 0x3e, 0x00, 0xbc, 3]);
        assert_eq!(held[4 + 16], 15);
        // Types q8_min does not hold, and bytes that are not whole blocks.
        assert!(to_q8_min(GgmlType::Q4K, &[0; 144]).is_none());
        assert!(to_q8_min(GgmlType::Q8_0, &[0; 35]).is_none());
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
        let err = dequantize(GgmlType::Iq2Xxs, &[0; 66], &mut [0f32; 256]).unwrap_err();
        assert!(err.contains("cannot dequantize IQ2_XXS"), "{err}");
        assert!(err.contains("Q5_K") && err.contains("IQ4_XS"), "{err}");
    }

    #[test]
    fn q5_0_and_q5_1_take_bit_j_of_the_high_word_as_element_j_fifth_bit() {
        // d = 2 (0x4000); high bits set for elements 0 and 31 only.
        let mut rest = (1u32 | 1 << 31).to_le_bytes().to_vec();
        let mut qs = [0u8; 16];
        qs[0] = 0x0f; // element 0: 15 | 16 = 31; element 16: 0
        qs[15] = 0xf0; // element 15: 0; element 31: 15 | 16 = 31
        rest.extend_from_slice(&qs);
        let out = run(GgmlType::Q5_0, &block(&[0x4000], &rest, 22));
        assert_eq!([out[0], out[16], out[15], out[31], out[1]], [30.0, -32.0, -32.0, 30.0, -32.0]);
        // Q5_1: d = 0.5 (0x3800), m = −4 (0xc400): 0.5·q − 4.
        let out = run(GgmlType::Q5_1, &block(&[0x3800, 0xc400], &rest, 24));
        assert_eq!([out[0], out[16], out[31], out[1]], [11.5, -4.0, 11.5, -4.0]);
    }

    #[test]
    fn q2_k_and_q3_k_groups_of_16_take_their_own_scales_and_shifts() {
        // Q2_K: d = 1, dmin = 0.5. Group 0 (bytes 0..16, shift 0): sc 3,
        // m 2; group 3 (bytes 16..32, shift 2): sc 5, m 0; group 9
        // (second half, bytes 48..64, shift 0): sc 1, m 15.
        let mut b = vec![0u8; 84];
        b[0] = 3 | 2 << 4;
        b[3] = 5;
        b[9] = 1 | 15 << 4;
        b[16] = 0b11; // element 0: q 3
        b[16 + 16] = 0b10_00; // group 3's element 0 (element 48): q 2
        b[16 + 48] = 0b01; // group 9's element 0 (element 144): q 1
        b[80..84].copy_from_slice(&[0x00, 0x3c, 0x00, 0x38]);
        let out = run(GgmlType::Q2K, &b);
        assert_eq!([out[0], out[1], out[48], out[144], out[145]], [8.0, -1.0, 10.0, -6.5, -7.5]);
        // Q3_K: d = 0.25; group 0's scale (4 | 0b10 << 4) − 32 = 4 (low
        // 4 bits from byte 0, high 2 from bits 0..2 of byte 8), group 1's
        // 0 − 32 = −32 (byte 1, byte 9). Mask bit 0 of
        // byte 0 set: element 0 has no −4; element 1 does.
        let mut b = vec![0u8; 110];
        b[0] = 1; // mask: element 0's third bit
        b[32] = 0b11; // element 0: q 3
        b[32 + 1] = 0b01; // element 1: q 1
        b[96] = 4;
        b[96 + 8] = 0b10;
        b[96 + 1] = 0;
        b[108..110].copy_from_slice(&0x3400u16.to_le_bytes());
        let out = run(GgmlType::Q3K, &b);
        assert_eq!(out[0], 0.25 * 4.0 * 3.0);
        assert_eq!(out[1], 0.25 * 4.0 * (1.0 - 4.0));
        assert_eq!(out[2], 0.25 * 4.0 * -4.0);
        assert_eq!(out[16], 0.25 * -32.0 * -4.0); // group 1, q 0, no mask bit
    }

    #[test]
    fn q5_k_iq4_nl_and_iq4_xs_decode_by_hand() {
        // Q5_K: d = 1, dmin = 1; sub-block 1 (high nibbles of bytes
        // 0..32, fifth bit = bit 1): sc 3, m 2.
        let mut b = vec![0u8; 176];
        b[0..4].copy_from_slice(&[0x00, 0x3c, 0x00, 0x3c]);
        b[4 + 1] = 3;
        b[4 + 5] = 2;
        b[16] = 0b10; // element 32's fifth bit
        b[48] = 0x70; // element 32: high nibble 7
        let out = run(GgmlType::Q5K, &b);
        assert_eq!(out[32], 3.0 * 23.0 - 2.0);
        assert_eq!(out[33], -2.0);
        assert_eq!(out[0].to_bits(), 0); // sub-block 0: sc 0, m 0
        // IQ4_NL: d = 0.5; codes 0 and 15 are the ends of the table.
        let mut qs = [0x88u8; 16];
        qs[0] = 0xf0;
        let out = run(GgmlType::Iq4Nl, &block(&[0x3800], &qs, 18));
        assert_eq!([out[0], out[16], out[1]], [-63.5, 56.5, 0.5]);
        // IQ4_XS: d = 1; sub-block 3's scale: high nibble of low byte 1
        // (5), bits 6..8 of the high field (0b11) → 53 − 32 = 21.
        let mut b = vec![0u8; 136];
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes());
        b[2..4].copy_from_slice(&(0b11u16 << 6).to_le_bytes());
        b[5] = 5 << 4;
        b[8 + 48] = 0x0f; // sub-block 3's element 0: code 15
        let out = run(GgmlType::Iq4Xs, &b);
        assert_eq!(out[96], 21.0 * 113.0);
        assert_eq!(out[97], 21.0 * -127.0);
        assert_eq!(out[0], -32.0 * -127.0); // sub-block 0: scale 0 − 32
    }
}
