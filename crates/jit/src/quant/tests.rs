use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::microkernel::TILE_COLUMNS;

const FORMATS: [DType; 11] = DType::BLOCK_FORMATS;
/// f32 unit roundoff.
#[cfg(target_arch = "x86_64")]
const U: f64 = 1.0 / (1u64 << 24) as f64;

fn skip() -> bool {
    let skip = !avx2_available();
    if skip {
        eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
    }
    skip
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// Byte offsets of a block's f16 scale and (Q4_1, Q4_K) minimum.
fn scale_offsets(format: DType) -> (usize, Option<usize>) {
    match format {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::Iq4Nl => (0, None),
        DType::Q4_1 | DType::Q5_1 | DType::Q8Min | DType::Q4K | DType::Q5K | DType::Q8KMin => (0, Some(2)),
        DType::Q6K => (208, None),
        other => unreachable!("{other}"),
    }
}

/// A block of random bytes whose f16 scales (and minimums) are finite, of
/// either sign, in a sane range.
fn random_block(format: DType, rng: &mut StdRng) -> Vec<u8> {
    let (_, size) = format.block();
    let mut b: Vec<u8> = (0..size).map(|_| rng.r#gen()).collect();
    let (d, m) = scale_offsets(format);
    let sign = |rng: &mut StdRng| if rng.gen_bool(0.5) { 1.0 } else { -1.0 };
    let scale = sign(rng) * rng.gen_range(1e-3f32..0.1);
    b[d..d + 2].copy_from_slice(&f16_bytes(scale));
    if let Some(m) = m {
        let min = sign(rng) * rng.gen_range(1e-3f32..1.0);
        b[m..m + 2].copy_from_slice(&f16_bytes(min));
    }
    b
}

/// The bytes of a block that hold its quants (Q5's fifth bits included).
fn quant_bytes(format: DType) -> std::ops::Range<usize> {
    let size = format.block().1;
    match format {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::Iq4Nl => 2..size,
        DType::Q4_1 | DType::Q5_1 | DType::Q8Min => 4..size,
        DType::Q4K | DType::Q5K => 16..size,
        DType::Q8KMin => kvjit_core::quant::Q8_KMIN_HEADER..size,
        _ => 0..192,
    }
}

/// Blocks at the edges: zero, negative-zero, infinite and NaN scales (and
/// minimums), extreme quants.
fn crafted_blocks(format: DType, rng: &mut StdRng) -> Vec<Vec<u8>> {
    let (d, m) = scale_offsets(format);
    let scales: [u16; 7] = [0x0000, 0x8000, 0x7e00, 0xfc01, 0x7c00, 0x3c00, 0xbc00]; // 0, −0, NaN, sNaN, ∞, 1, −1
    let fills: [u8; 5] = [0x00, 0xff, 0x0f, 0xf0, 0x80];
    let mut blocks = Vec::new();
    for (i, &s) in scales.iter().enumerate() {
        for (j, &fill) in fills.iter().enumerate() {
            let mut b = random_block(format, rng);
            let quants = quant_bytes(format);
            if j % 2 == 0 {
                b[quants].fill(fill);
            } else {
                // Alternate the fill with 0x7f (i8 127, nibbles 15 and 7).
                for (n, q) in b[quants].iter_mut().enumerate() {
                    *q = if n % 2 == 0 { fill } else { 0x7f };
                }
            }
            b[d..d + 2].copy_from_slice(&s.to_le_bytes());
            if let Some(m) = m {
                let other = scales[(i + j) % scales.len()];
                b[m..m + 2].copy_from_slice(&other.to_le_bytes());
            }
            blocks.push(b);
        }
    }
    if format == DType::Q6K {
        // i8 scales −128 and 127.
        let mut b = random_block(format, rng);
        for (n, s) in b[192..208].iter_mut().enumerate() {
            *s = if n % 2 == 0 { 0x80 } else { 0x7f };
        }
        blocks.push(b);
    }
    if format == DType::Q4K {
        // 6-bit scales and minimums at 63.
        let mut b = random_block(format, rng);
        b[4..16].fill(0xff);
        blocks.push(b);
    }
    blocks
}

/// Columns of `groups` blocks each, drawn from `pool` (cycled from `start`).
fn columns_from(pool: &[Vec<u8>], n: usize, groups: usize, start: usize) -> Vec<Vec<u8>> {
    (0..n).map(|c| (0..groups).flat_map(|g| pool[(start + c * groups + g) % pool.len()].clone()).collect()).collect()
}

fn pack(format: DType, columns: &[Vec<u8>], k: usize) -> Vec<u8> {
    let refs: Vec<&[u8]> = columns.iter().map(Vec::as_slice).collect();
    let mut panel = vec![0xa5u8; panel_bytes(format, k)];
    pack_panel(format, &refs, k, &mut panel);
    panel
}

fn reference(format: DType, column: &[u8], k: usize) -> Vec<f32> {
    let mut out = vec![0f32; k];
    kvjit_core::quant::dequantize(format, column, &mut out).expect("whole blocks");
    out
}

#[cfg(target_arch = "x86_64")]
#[test]
fn short_panels_read_as_one_stream() {
    // SmolLM2's K = 576 and 1536 panels, and Llama-3-8B's K = 4096 but for
    // Q8_0's 68 KiB panel, whose two streams each read 34 KiB.
    // (On AMD CPUs; elsewhere every one of these reads in two.)
    let amd = crate::microkernel::AMD_MIN_STREAM_BYTES;
    for (format, k, streams) in [
        (DType::Q4_1, 576, 1),
        (DType::Q8_0, 576, 1),
        (DType::Q4_1, 1536, 1),
        (DType::Q4_0, 4096, 1),
        (DType::Q4_1, 4096, 1),
        (DType::Q6K, 4096, 1),
        (DType::Q8_0, 4096, x86::STREAMS),
        (DType::Q4_1, 14336, x86::STREAMS),
    ] {
        let bytes = panel_bytes(format, k);
        assert_eq!(crate::microkernel::streams_for_min(bytes, x86::STREAMS, amd), streams, "{format} k {k}");
        let intel = crate::microkernel::INTEL_MIN_STREAM_BYTES;
        assert_eq!(crate::microkernel::streams_for_min(bytes, x86::STREAMS, intel), x86::STREAMS, "{format} k {k}");
    }
}

#[test]
fn panels_take_the_ggml_bytes() {
    assert_eq!(panel_bytes(DType::Q4_0, 64), 2 * 18 * 16);
    assert_eq!(panel_bytes(DType::Q4_1, 32), 320);
    assert_eq!(panel_bytes(DType::Q8_0, 4096), 128 * 34 * 16);
    assert_eq!(panel_bytes(DType::Q4K, 512), 2 * 144 * 16);
    assert_eq!(panel_bytes(DType::Q6K, 256), 210 * 16);
    assert_eq!(panel_bytes(DType::BF16, 8), 8 * 2 * 16);
    assert!(quant_gemv(DType::BF16, 4096).is_none() && quant_gemv_avx2(DType::F32, 4096).is_none());
    if avx2_available() {
        for format in FORMATS {
            assert!(quant_gemv(format, 4096).is_some() && has_quant_gemv(format), "{format}");
            assert!(quant_gemv_avx2(format, 256).is_some() && dequantize_block(format).is_some(), "{format}");
        }
    }
    assert!(dequantize_block(DType::F32).is_none());
}

/// Packing then decoding gives `kvjit_core::quant::dequantize` of the
/// original blocks bit for bit, for random and crafted blocks, every
/// format, full panels and padded ones (padding is +0.0), decoding all of
/// K or only its first k-groups, never writing past `count`.
#[test]
fn decoded_panels_are_the_reference_bit_for_bit() {
    if skip() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(11);
    for format in FORMATS {
        let decode = dequantize_block(format).expect("every block format decodes");
        let (block, _) = format.block();
        let mut pool: Vec<Vec<u8>> = (0..64).map(|_| random_block(format, &mut rng)).collect();
        pool.extend(crafted_blocks(format, &mut rng));
        for groups in [1, 2, 3, 9] {
            let k = groups * block;
            for n in [16, 15, 9, 8, 3, 1, 0] {
                // Enough panels that every pooled block lands in each column.
                let panels = pool.len().div_ceil(n.max(1) * groups).max(1);
                for p in 0..panels {
                    let columns = columns_from(&pool, n, groups, p * n * groups);
                    let panel = pack(format, &columns, k);
                    let want: Vec<Vec<f32>> = columns.iter().map(|c| reference(format, c, k)).collect();
                    for kc in [k, block].into_iter().take(if groups > 1 { 2 } else { 1 }) {
                        let count = kc * TILE_COLUMNS;
                        let mut out = vec![-7.5f32; count + 5];
                        // SAFETY: panel holds k ≥ kc values of K in whole
                        // k-groups; out holds count f32 and a guard.
                        unsafe { decode(panel.as_ptr(), count, out.as_mut_ptr()) };
                        for kk in 0..kc {
                            for j in 0..TILE_COLUMNS {
                                let got = out[kk * TILE_COLUMNS + j];
                                let expect = want.get(j).map_or(0.0, |w| w[kk]);
                                assert!(
                                    got.to_bits() == expect.to_bits(),
                                    "{format} k {k} n {n} p {p}: ({kk}, {j}) = {got:?} ({:#x}), not {expect:?} ({:#x})",
                                    got.to_bits(),
                                    expect.to_bits()
                                );
                            }
                        }
                        assert!(out[count..].iter().all(|&v| v == -7.5), "{format}: wrote past count");
                    }
                }
            }
        }
    }
}

#[test]
fn rounding_is_half_away_from_zero() {
    for v in [0.5f32, -0.5, 1.5, 2.5, -2.5, 0.49999997, -0.49999997, 126.5, -126.5, 127.0, 0.0, -0.0, 3.7, -3.2] {
        assert_eq!(round_half_away(v), v.round() as i32, "{v}");
    }
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..100_000 {
        let v: f32 = rng.gen_range(-128.0..128.0);
        assert_eq!(round_half_away(v), v.round() as i32, "{v}");
    }
}

/// Block `b` of quantized activations: the 16-bit quants `Q` (checked to
/// be `254·q_hi + q_lo` with `q_hi = round(Q / 254)`, `|q_lo| ≤ 127`), the
/// scale, `ΣQ` and `ΣQ` over the first 16 (checked against `Q`), and
/// `s·ΣQ` (checked against the scale and `ΣQ`).
fn block_of(out: &[u8], b: usize) -> ([i32; 32], f32, i32) {
    let o = &out[b * Q8_ACTIVATION_BLOCK_BYTES..(b + 1) * Q8_ACTIVATION_BLOCK_BYTES];
    let word = |at: usize| -> [u8; 4] { o[at..at + 4].try_into().unwrap() };
    let q: [i32; 32] = std::array::from_fn(|i| {
        let (hi, lo) = (i32::from(o[i] as i8), i32::from(o[32 + i] as i8));
        let q = 254 * hi + lo;
        assert!(lo.abs() <= 127 && hi == (q as f64 / 254.0).round() as i32, "block {b} value {i}: {hi}, {lo}");
        q
    });
    let (sum, first16) = (i32::from_le_bytes(word(68)), i32::from_le_bytes(word(72)));
    assert_eq!(first16, q[..16].iter().sum::<i32>(), "block {b}");
    assert_eq!(sum, q.iter().sum::<i32>(), "block {b}");
    let scale = f32::from_le_bytes(word(64));
    assert_eq!(f32::from_le_bytes(word(76)).to_bits(), (scale * sum as f32).to_bits(), "block {b}: s·ΣQ");
    (q, scale, sum)
}

#[test]
fn activations_quantize_to_two_parts() {
    // Block 0: max 32258, so s = 1 and Q = round(x): ties go away from
    // zero, and so do q_hi's (127 = 254·1 − 127).
    let mut x = vec![0f32; 96];
    let ties = [
        32258.0, -0.5, 0.5, 1.5, 2.5, -2.5, -126.5, 0.49999997, -3.7, 0.0, -0.0, 64.25, 127.0, -127.0, 381.0, -381.0,
        32257.0, -32258.0, 126.0,
    ];
    x[..ties.len()].copy_from_slice(&ties);
    // Block 1: all zero (s = 0, Q = 0). Block 2: negative max.
    for (i, v) in x[64..].iter_mut().enumerate() {
        *v = -2.54 + 0.08 * i as f32;
    }
    let mut out = vec![0xa5u8; 3 * Q8_ACTIVATION_BLOCK_BYTES];
    quantize_activations(&x, &mut out);

    let (q, s, sum) = block_of(&out, 0);
    assert_eq!(s, 1.0);
    let want = [32258, -1, 1, 2, 3, -3, -127, 0, -4, 0, 0, 64, 127, -127, 381, -381, 32257, -32258, 126];
    assert_eq!(&q[..ties.len()], &want);
    assert!(q[ties.len()..].iter().all(|&q| q == 0));
    assert_eq!(sum, want.iter().sum::<i32>());
    // The parts of the ties: 127 → (1, −127), 381 → (2, −127), 126 → (0, 126).
    let parts = |i: usize| (out[i] as i8, out[32 + i] as i8);
    assert_eq!(
        [parts(0), parts(12), parts(13), parts(14), parts(16), parts(18)],
        [(127, 0), (1, -127), (-1, 127), (2, -127), (127, -1), (0, 126)]
    );

    assert_eq!(block_of(&out, 1), ([0; 32], 0.0, 0));

    let (q, s, _) = block_of(&out, 2);
    assert_eq!(s, 2.54f32 / 32258.0);
    for (i, &q) in q.iter().enumerate() {
        let v = x[64 + i];
        assert_eq!(q as f32, (v / s).round(), "block 2 value {i}");
        assert!((v as f64 - s as f64 * q as f64).abs() <= s as f64 / 2.0 + v.abs() as f64 * 1e-7, "block 2 value {i}");
    }
    assert_eq!(q[0], -32258);
}

/// The AVX2 quantizer gives the plain Rust one's bytes: random blocks of
/// mixed scales, blocks of exact ties of `Q` (x = (n + ½)·s) and of
/// `q_hi` (Q = 254·n + 127), all-zero blocks, blocks of subnormals.
#[test]
#[cfg(target_arch = "x86_64")]
fn vector_quantizing_is_the_scalar_code_bit_for_bit() {
    if skip() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(13);
    let mut x = Vec::new();
    for b in 0..4000 {
        let scale = 10f32.powi(rng.gen_range(-6..4));
        match b % 6 {
            0 => x.extend([0.0; 32]),
            1 => {
                // Ties: with max 32258·s, the scale is s (when exact) and
                // x/s = n + 0.5.
                x.push(32258.0 * scale);
                x.extend((1..32).map(|_| (rng.gen_range(-32258..32258) as f32 + 0.5) * scale));
            }
            2 => {
                // Ties of q_hi: Q = 254·n ± 127.
                x.push(-32258.0 * scale);
                x.extend((1..32).map(|_| (254 * rng.gen_range(-126..127) + 127) as f32 * scale));
            }
            3 => x.extend((0..32).map(|_| f32::from_bits(rng.gen_range(0..0x0080_0000)) * scale.signum())),
            _ => x.extend((0..32).map(|_| rng.gen_range(-1.0f32..1.0) * scale)),
        }
    }
    let blocks = x.len() / 32;
    let mut vector = vec![0u8; blocks * Q8_ACTIVATION_BLOCK_BYTES];
    let mut scalar = vec![0x5au8; vector.len()];
    // SAFETY: the CPU has AVX2 (skip() checked); out holds x's blocks.
    unsafe { x86::quantize_activations(&x, &mut vector) };
    quantize_blocks(&x, &mut scalar);
    let size = Q8_ACTIVATION_BLOCK_BYTES;
    for (b, (v, s)) in vector.chunks(size).zip(scalar.chunks(size)).enumerate() {
        assert_eq!(v, s, "block {b}: {:?}", &x[32 * b..32 * b + 32]);
    }
    for b in 0..blocks {
        block_of(&scalar, b);
    }
}

/// A column's dequantized weights and, per 32 k, the minimum its values
/// are offset by (Q4_1's and Q5_1's `m`, Q4_K's `dmin·m`, else 0).
#[cfg(target_arch = "x86_64")]
fn column_values(format: DType, column: &[u8], k: usize) -> (Vec<f32>, Vec<f64>) {
    let w = reference(format, column, k);
    let f16_at = kvjit_core::quant::f16_at;
    let mins = column
        .chunks_exact(format.block().1)
        .flat_map(|b| match format {
            DType::Q4_1 | DType::Q5_1 | DType::Q8Min => vec![f16_at(b, 2) as f64],
            DType::Q4K | DType::Q5K => (0..8)
                .map(|s| {
                    let q = &b[4..16];
                    let m = if s < 4 { q[s + 4] & 63 } else { (q[s + 4] >> 4) | ((q[s] >> 6) << 4) };
                    f16_at(b, 2) as f64 * m as f64
                })
                .collect(),
            // Per 32 k, the larger of its two 16-k minimums dmin·m.
            DType::Q8KMin => (0..8)
                .map(|s| {
                    let m = |i: usize| i16::from_le_bytes([b[20 + 2 * i], b[21 + 2 * i]]) as f64;
                    f16_at(b, 2) as f64 * m(2 * s).abs().max(m(2 * s + 1).abs())
                })
                .collect(),
            _ => vec![0.0; format.block().0 / 32],
        })
        .collect();
    (w, mins)
}

/// The integer GEMV against the f64 product of the dequantized weights
/// within the documented bound (activation rounding `Σ_blocks (s/2)·Σ|w|`,
/// checked to be within 1/127 of 8-bit activations' `Σ_blocks
/// (max|x_b|/254)·Σ|w|`, + f32 error), and against the f64 product with
/// the represented activations `s·Q` within the f32 error alone; added
/// into random accumulators, never written past them. Besides random
/// blocks and activations, the largest sums the tiles' 16-bit partial sums
/// see: every quant byte 0xff (Q4's and Q5's largest quants) against equal
/// activations (every `q_hi` 127).
#[test]
#[cfg(target_arch = "x86_64")]
fn integer_gemv_is_within_its_bound() {
    if skip() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(7);
    // Every dot tier this CPU has, each `vpdpbusd` one also in the
    // measurement variants' stream counts (same bound).
    let tiers = x86::DotTier::ALL.into_iter().flat_map(|tier| {
        let streams: &[usize] = if tier == x86::DotTier::Avx2 { &[1, x86::STREAMS] } else { &[1, 2, 4] };
        streams.iter().map(move |&s| (tier, s))
    });
    for (format, (tier, streams)) in FORMATS.into_iter().flat_map(|f| tiers.clone().map(move |t| (f, t))) {
        if !tier.available() {
            eprintln!("{format}: this CPU lacks {tier:?}, its tile untested");
            continue;
        }
        let gemv = x86::gemv_with_streams_on(format, tier, streams).expect("an integer GEMV");
        let (block, _) = format.block();
        let ks = if block == 32 { [32, 64, 96, 4096 + 32] } else { [256, 512, 768, 4096 + 256] };
        for (k, extreme) in ks.into_iter().flat_map(|k| [(k, false), (k, true)]) {
            for n in [16, 11] {
                let groups = k / 32;
                let block_for = |rng: &mut StdRng| {
                    let mut b = random_block(format, rng);
                    if extreme {
                        b[quant_bytes(format)].fill(0xff);
                    }
                    b
                };
                let pool: Vec<Vec<u8>> = (0..n * k / block).map(|_| block_for(&mut rng)).collect();
                let columns = columns_from(&pool, n, k / block, 0);
                let panel = pack(format, &columns, k);
                let x: Vec<f32> = (0..k)
                    .map(|_| {
                        let v: f32 = if extreme { 1.5 } else { rng.gen_range(0.01..2.0) };
                        if !extreme && rng.gen_bool(0.5) { -v } else { v }
                    })
                    .collect();
                let mut xq = vec![0u8; groups * Q8_ACTIVATION_BLOCK_BYTES];
                quantize_activations(&x, &mut xq);
                let c0: Vec<f32> = (0..TILE_COLUMNS).map(|_| rng.gen_range(-4.0..4.0)).collect();
                let mut c = c0.clone();
                c.extend([f32::NAN; 8]);
                // SAFETY: xq holds K/32 activation blocks, the panel covers
                // K, c holds 16 f32 (and a guard).
                unsafe { gemv(xq.as_ptr().cast(), 1, panel.as_ptr(), k, c.as_mut_ptr()) };
                assert!(
                    c[TILE_COLUMNS..].iter().all(|v| v.is_nan()),
                    "{format} {tier:?} streams {streams} k {k}: wrote past c"
                );
                for j in 0..TILE_COLUMNS {
                    let got = c[j] as f64;
                    let Some(column) = columns.get(j) else {
                        assert_eq!(c[j], c0[j], "{format} k {k}: padding column {j} added to c");
                        continue;
                    };
                    let (w, mins) = column_values(format, column, k);
                    let (mut exact, mut quantized) = (c0[j] as f64, c0[j] as f64);
                    let (mut rounding, mut magnitude, mut terms) = (0.0, 0.0, (c0[j] as f64).abs());
                    let mut eight_bit = 0.0;
                    for b in 0..groups {
                        let (q, d, _) = block_of(&xq, b);
                        let mut w_abs = 0.0;
                        let mut x_max = 0f64;
                        for i in 0..32 {
                            let (xk, wk) = (x[32 * b + i] as f64, w[32 * b + i] as f64);
                            x_max = x_max.max(xk.abs());
                            let xhat = d as f64 * q[i] as f64;
                            exact += xk * wk;
                            quantized += xhat * wk;
                            w_abs += wk.abs();
                            magnitude += (xk * wk).abs();
                            terms += xhat.abs() * (wk.abs() + 2.0 * mins[b].abs());
                        }
                        rounding += d as f64 / 2.0 * w_abs;
                        eight_bit += x_max / 254.0 * w_abs;
                    }
                    assert!(rounding <= eight_bit / 127.0, "{format} k {k}: bound {rounding}, 8-bit {eight_bit}");
                    let f32_error = (2.0 * groups as f64 + 8.0) * U * terms;
                    let bound = rounding + U * magnitude + f32_error;
                    assert!(
                        (got - exact).abs() <= bound,
                        "{format} {tier:?} streams {streams} k {k} c[{j}] = {got}, exact {exact}, bound {bound} (rounding {rounding})"
                    );
                    assert!(
                        (got - quantized).abs() <= f32_error,
                        "{format} {tier:?} k {k} c[{j}] = {got}, with quantized x {quantized}, bound {f32_error}"
                    );
                }
            }
        }
    }
}

/// The zmm tiles compute the ymm tiles' sums and f32 steps lane for lane:
/// their output is bit for bit the AVX512-VNNI ymm tile's, for every
/// format (those without a zmm tile run the ymm one), stream count and K
/// tail, on random weights (extreme nibbles too) and activations.
#[cfg(target_arch = "x86_64")]
#[test]
fn zmm_tiles_are_the_ymm_tiles_bit_for_bit() {
    if skip() {
        return;
    }
    if !x86::DotTier::Avx512Zmm.available() {
        eprintln!("skipped: this CPU lacks AVX512-F, AVX512-VL or AVX512-VNNI");
        return;
    }
    let mut rng = StdRng::seed_from_u64(11);
    for format in FORMATS {
        let (block, _) = format.block();
        for k in [block, 2 * block, 3 * block, 4096 + block, 16384 + block] {
            let columns: Vec<Vec<u8>> = (0..TILE_COLUMNS)
                .map(|_| {
                    (0..k / block)
                        .flat_map(|_| {
                            let mut b = random_block(format, &mut rng);
                            if rng.gen_bool(0.1) {
                                b[quant_bytes(format)].fill(0xff);
                            }
                            b
                        })
                        .collect()
                })
                .collect();
            let panel = pack(format, &columns, k);
            let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mut xq = vec![0u8; k / 32 * Q8_ACTIVATION_BLOCK_BYTES];
            quantize_activations(&x, &mut xq);
            let c0: Vec<f32> = (0..TILE_COLUMNS).map(|_| rng.gen_range(-4.0..4.0)).collect();
            for streams in [1, 2, 4] {
                let run = |tier| {
                    let gemv = x86::gemv_with_streams_on(format, tier, streams).expect("an integer GEMV");
                    let mut c = c0.clone();
                    c.extend([f32::NAN; 8]);
                    // SAFETY: xq holds K/32 activation blocks, the panel
                    // covers K, c holds 16 f32 (and a guard).
                    unsafe { gemv(xq.as_ptr().cast(), 1, panel.as_ptr(), k, c.as_mut_ptr()) };
                    assert!(c[TILE_COLUMNS..].iter().all(|v| v.is_nan()), "{format} {tier:?}: wrote past c");
                    c
                };
                let (zmm, ymm) = (run(x86::DotTier::Avx512Zmm), run(x86::DotTier::Avx512Vnni));
                assert_ne!(zmm[..TILE_COLUMNS], c0[..], "{format} k {k}: nothing added");
                for j in 0..TILE_COLUMNS {
                    assert_eq!(
                        zmm[j].to_bits(),
                        ymm[j].to_bits(),
                        "{format} streams {streams} k {k} c[{j}]: zmm {} ymm {}",
                        zmm[j],
                        ymm[j]
                    );
                }
            }
        }
    }
}
