//! GGML's weight block formats ([`DType::BLOCK_FORMATS`]) and their
//! dequantization to f32, bit for bit as gguf-py's numpy reference
//! (`gguf/quants.py`) and ggml's `dequantize_row_*` compute it: every
//! product and sum rounded to f32 in the same order, no fused multiply-add.
//! (kvjit's own q8_min and q8_kmin, which GGML does not have, are defined
//! here.) This is the one definition of what a block means; kernels that decode
//! blocks in registers are tested against it.
//!
//! | format | block | elements |
//! |--------|-------|----------|
//! | Q8_0 | f16 `d`, 32 × i8 `q` | `q[j]·d` |
//! | Q4_0 | f16 `d`, 16 bytes | element `j < 16`: `d·((b[j] & 15) − 8)`; `j ≥ 16`: `d·((b[j−16] >> 4) − 8)` |
//! | Q4_1 | f16 `d`, f16 `m`, 16 bytes | `d·q + m`, nibbles as Q4_0 |
//! | Q5_0 | f16 `d`, 32 high bits, 16 bytes | `d·(q − 16)`, low nibbles as Q4_0, bit j of the high bits on element j |
//! | Q5_1 | f16 `d`, f16 `m`, 32 high bits, 16 bytes | `d·q + m`, 5-bit `q` as Q5_0 |
//! | IQ4_NL | f16 `d`, 16 bytes | `d·T[q]`, `T` the 16 levels [`IQ4_NL_LEVELS`], nibbles as Q4_0 |
//! | Q8_MIN (kvjit's) | f16 `d`, f16 `m`, 32 × u8 `q` | `d·q + m` |
//! | Q4_K | f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 bytes | per 32 elements: `(d·sc)·q − dmin·m` |
//! | Q5_K | Q4_K's header, 32 bytes of fifth bits, 128 bytes | per 32 elements: `(d·sc)·q − dmin·m`, bit `s` of high byte `l` the fifth bit of element `l` of sub-block `s` |
//! | Q6_K | 128 bytes low 4 bits, 64 bytes high 2 bits, 16 × i8 scales, f16 `d` | per 16 elements: `(d·sc)·(q − 32)` |
//! | Q8_KMIN (kvjit's) | f16 `d`, f16 `dmin`, 16 × i8 `sc`, 16 × i16 `m`, 256 × u8 `q` | per 16 elements: `(d·sc)·q − dmin·m`, one rounding (a fused multiply-add) |

use half::f16;
use rand::Rng;

use crate::{DType, Error, Result, Tensor};

/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;

/// The f16 at byte `at` of `bytes`, as f32.
pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Dequantize whole blocks of the block format `format` from `bytes` into
/// `out`, which must hold exactly the elements of those blocks.
pub fn dequantize(format: DType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let (block, size) = format.block();
    if !format.is_block_format() {
        return Err(Error::NotFloat { what: "dequantize (a weight block format)".into(), dtype: format });
    }
    if !bytes.len().is_multiple_of(size) || bytes.len() / size * block != out.len() {
        return Err(Error::ByteCount {
            dtype: format,
            shape: vec![out.len()],
            expected: out.len() / block * size,
            got: bytes.len(),
        });
    }
    let blocks = bytes.chunks_exact(size).zip(out.chunks_exact_mut(block));
    match format {
        DType::Q8_0 => blocks.for_each(|(b, o)| q8_0(b, o)),
        DType::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
        DType::Q4_1 => blocks.for_each(|(b, o)| q4_1(b, o)),
        DType::Q5_0 => blocks.for_each(|(b, o)| q5::<false>(b, o)),
        DType::Q5_1 => blocks.for_each(|(b, o)| q5::<true>(b, o)),
        DType::Iq4Nl => blocks.for_each(|(b, o)| iq4_nl(b, o)),
        DType::Q8Min => blocks.for_each(|(b, o)| q8_min(b, o)),
        DType::Q4K => blocks.for_each(|(b, o)| q4_k(b, o)),
        DType::Q5K => blocks.for_each(|(b, o)| q5_k(b, o)),
        DType::Q6K => blocks.for_each(|(b, o)| q6_k(b, o)),
        DType::Q8KMin => blocks.for_each(|(b, o)| q8_kmin(b, o)),
        _ => unreachable!("checked a block format above"),
    }
    Ok(())
}

/// One Q8_0 block (34 bytes) into 32 elements.
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// One Q4_0 block (18 bytes) into 32 elements.
fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (low, high) = out.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        low[j] = d * f32::from((q & 0x0f) as i8 - 8);
        high[j] = d * f32::from((q >> 4) as i8 - 8);
    }
}

/// One Q4_1 block (20 bytes) into 32 elements.
fn q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let (low, high) = out.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        low[j] = d * f32::from(q & 0x0f) + m;
        high[j] = d * f32::from(q >> 4) + m;
    }
}

/// One Q5_0 (`MIN = false`: `d·(q − 16)`, 22 bytes) or Q5_1 (`d·q + m`,
/// 24 bytes) block into 32 elements: element `j < 16` is the low nibble of
/// quant byte `j`, `j ≥ 16` the high nibble of byte `j − 16`, and bit `j`
/// of the little-endian u32 before the quants is its fifth bit.
fn q5<const MIN: bool>(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (m, at) = if MIN { (f16_at(b, 2), 4) } else { (0.0, 2) };
    let high = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let qs = &b[at + 4..at + 20];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 };
        let q = low | (((high >> j) & 1) as u8) << 4;
        *o = if MIN { d * f32::from(q) + m } else { d * f32::from(q as i8 - 16) };
    }
}

/// IQ4_NL's (and IQ4_XS's) 16 levels, by 4-bit code (GGML's
/// `kvalues_iq4nl`).
pub const IQ4_NL_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// One IQ4_NL block (18 bytes) into 32 elements: `d·T[q]`, the codes as
/// Q4_0's nibbles.
fn iq4_nl(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (low, high) = out.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        low[j] = d * f32::from(IQ4_NL_LEVELS[usize::from(q & 0x0f)]);
        high[j] = d * f32::from(IQ4_NL_LEVELS[usize::from(q >> 4)]);
    }
}

/// One q8_min block (36 bytes) into 32 elements: `d·q + m`, the product
/// rounded before the sum (Q4_1's arithmetic).
fn q8_min(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (o, &q) in out.iter_mut().zip(&b[4..36]) {
        *o = d * f32::from(q) + m;
    }
}

/// Bytes of a q8_kmin super-block before its quants: `d`, `dmin`, 16 i8
/// scales and 16 i16 minimums.
pub const Q8_KMIN_HEADER: usize = 52;

/// One q8_kmin super-block (308 bytes) into 256 elements: per 16, `S·q −
/// M` rounded once, `S = d·sc` and `M = dmin·m` (each exact in f32 for
/// the scales and minimums that GGML's K-quants give: 11 × 8 and 11 × 13
/// bits).
fn q8_kmin(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for (i, o) in out.chunks_exact_mut(16).enumerate() {
        let scale = d * f32::from(b[4 + i] as i8);
        let min = dmin * f32::from(i16::from_le_bytes([b[20 + 2 * i], b[21 + 2 * i]]));
        let quants = &b[Q8_KMIN_HEADER + 16 * i..Q8_KMIN_HEADER + 16 * i + 16];
        for (o, &q) in o.iter_mut().zip(quants) {
            *o = scale.mul_add(f32::from(q), -min);
        }
    }
}

/// Scale and min `j` (0–7) of a K-quant's 12 packed bytes: 6 bits each
/// (GGML's `get_scale_min_k4`, shared by Q4_K and Q5_K).
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// One Q4_K super-block (144 bytes) into 256 elements.
fn q4_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let (low, high) = o.split_at_mut(32);
        for l in 0..32 {
            low[l] = d1 * f32::from(q[l] & 0x0f) - min1;
            high[l] = d2 * f32::from(q[l] >> 4) - min2;
        }
    }
}

/// One Q5_K super-block (176 bytes) into 256 elements: per 32-element
/// sub-block `s`, Q4_K's scale and min and nibble (`s % 2`) of quant bytes
/// `32·(s / 2)..`, with bit `s` of high-bit byte `l` as the fifth bit.
fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (high, qs) = b[16..].split_at(QK_K / 8);
    for (s, o) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(s, scales);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let q = &qs[32 * (s / 2)..][..32];
        for ((o, &q), &h) in o.iter_mut().zip(q).zip(high) {
            let q = ((q >> (4 * (s % 2))) & 0x0f) | ((h >> s) & 1) << 4;
            *o = dl * f32::from(q) - ml;
        }
    }
}

/// One Q6_K super-block (210 bytes) into 256 elements.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, rest) = b.split_at(QK_K / 2);
    let (qh, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(QK_K / 16);
    let d = f16_at(d, 0);
    for half in 0..2 {
        let ql = &ql[64 * half..64 * half + 64];
        let qh = &qh[32 * half..32 * half + 32];
        let sc = &scales[8 * half..8 * half + 8];
        let y = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            let scale = |k: usize| d * f32::from(sc[is + k] as i8);
            y[l] = scale(0) * f32::from(q1);
            y[l + 32] = scale(2) * f32::from(q2);
            y[l + 64] = scale(4) * f32::from(q3);
            y[l + 96] = scale(6) * f32::from(q4);
        }
    }
}

/// An f16 scale of magnitude in `[low, high)` (random sign when `signed`),
/// as its bytes.
fn random_scale(rng: &mut impl Rng, low: f32, high: f32, signed: bool) -> [u8; 2] {
    let magnitude = rng.gen_range(low..high);
    let value = if signed && rng.gen_bool(0.5) { -magnitude } else { magnitude };
    f16::from_f32(value).to_bits().to_le_bytes()
}

/// One random block of the block format `format`: every quant byte random,
/// the scales finite f16 of a size that keeps weights near ±1 (so a wrong
/// decode shows as a wrong value, not a NaN that hides it).
///
/// # Panics
/// If `format` is not a block format.
pub fn random_block(format: DType, rng: &mut impl Rng) -> Vec<u8> {
    let (_, bytes) = format.block();
    let mut block: Vec<u8> = (0..bytes).map(|_| rng.r#gen()).collect();
    match format {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::Iq4Nl => {
            block[..2].copy_from_slice(&random_scale(rng, 0.002, 0.02, true))
        }
        DType::Q4_1 | DType::Q5_1 => {
            block[..2].copy_from_slice(&random_scale(rng, 0.002, 0.02, true));
            block[2..4].copy_from_slice(&random_scale(rng, 0.0, 0.1, true));
        }
        DType::Q8Min => {
            block[..2].copy_from_slice(&random_scale(rng, 0.001, 0.01, true));
            block[2..4].copy_from_slice(&random_scale(rng, 0.0, 1.0, true));
        }
        DType::Q4K | DType::Q5K => {
            // d and dmin: the 6-bit scales and mins multiply them.
            block[..2].copy_from_slice(&random_scale(rng, 0.0002, 0.002, false));
            block[2..4].copy_from_slice(&random_scale(rng, 0.0, 0.002, false));
        }
        DType::Q8KMin => {
            // d and dmin: the i8 scales and i16 minimums multiply them.
            block[..2].copy_from_slice(&random_scale(rng, 0.000003, 0.00003, true));
            block[2..4].copy_from_slice(&random_scale(rng, 0.0, 0.00003, true));
        }
        DType::Q6K => {
            // d last; the 16 i8 scales before it multiply it.
            block[bytes - 2..].copy_from_slice(&random_scale(rng, 0.00002, 0.0002, true));
        }
        other => panic!("{other} is not a weight block format"),
    }
    block
}

/// A random `[rows, k]` weight of the block format `format` ([`random_block`]
/// per block; `k` a multiple of its block, else [`Error::BlockShape`]).
pub fn random_blocks(format: DType, rows: usize, k: usize, rng: &mut impl Rng) -> Result<Tensor> {
    let bytes = Tensor::storage_bytes(format, &[rows, k])?;
    let blocks = bytes / format.block().1;
    let data: Vec<u8> = (0..blocks).flat_map(|_| random_block(format, rng)).collect();
    Tensor::from_le_bytes(format, &[rows, k], &data)
}
