//! The FP8 E4M3 conversions in `kvjit_jit::ir`, checked bit for bit
//! against `kvjit_core::fp8` (itself checked against the OCP definition and
//! a brute-force nearest-even search): every code when widening, a million
//! random f32 patterns plus every tie and its neighbours when narrowing,
//! whole blocks when quantizing with a scale, and every code re-encoded as
//! bf16.

use cranelift_codegen::ir::{InstBuilder, types};
use kvjit_core::fp8::{E4M3_MAX, e4m3_from_f32, e4m3_to_f32, quantize_block};
use kvjit_core::{DType, KernelKey, Target};
use kvjit_jit::cranelift_codegen;
use kvjit_jit::ir::addr::Displacements;
use kvjit_jit::ir::e4m3::{self, ToBf16};
use kvjit_jit::ir::{counted_loop, load_f32x4, load_splat_f32x4, mem};
use kvjit_jit::{CaptureText, compile_function, pointer_type};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{kernel, run};

#[test]
fn widens_every_code_like_the_core_conversion() {
    let codes: Vec<u8> = (0..=255).collect();
    let vector = kernel("e4m3_widen", 4, 1, 4, |b, s, d| {
        let v = load_f32x4(b, DType::F8E4M3, s, 0);
        b.ins().store(mem(), v, d, 0);
    });
    let splat = kernel("e4m3_widen_splat", 1, 1, 16, |b, s, d| {
        let v = load_splat_f32x4(b, DType::F8E4M3, s, 0);
        b.ins().store(mem(), v, d, 0);
    });
    let mut out = vec![0u32; 256];
    run(&vector, &codes, &mut out, 256);
    let mut out_splat = vec![[0u32; 4]; 256];
    run(&splat, &codes, &mut out_splat, 256);
    for code in 0..=255u8 {
        let want = e4m3_to_f32(code).to_bits();
        assert_eq!(out[code as usize], want, "load_f32x4 of {code:#04x}");
        assert_eq!(out_splat[code as usize], [want; 4], "load_splat_f32x4 of {code:#04x}");
    }
}

/// Every tie between consecutive codes and one f32 ulp either side, the
/// codes themselves, values past 448, f32 subnormals, ±∞, NaNs, and a
/// million random patterns, of both signs.
fn narrowing_inputs() -> Vec<u32> {
    let mut v = Vec::new();
    for code in 0..0x7eu8 {
        let (a, c) = (e4m3_to_f32(code), e4m3_to_f32(code + 1));
        let mid = (a + c) / 2.0; // exact: a few significant bits
        for x in [a, mid, c] {
            v.extend([x.to_bits(), x.to_bits() + 1, x.to_bits().wrapping_sub(1)]);
        }
    }
    for x in [448.0f32, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY, 2f32.powi(-10), 2f32.powi(-11), 1e-45, 1e-39] {
        v.extend([x.to_bits(), x.to_bits() + 1, x.to_bits() - 1]);
    }
    v.extend([0x7fc0_0000, 0x7f80_0001, 0x7fbf_ffff]);
    let mut rng = StdRng::seed_from_u64(0x0e43);
    v.extend((0..1_000_000).map(|_| rng.r#gen::<u32>()));
    // Random values in the range a scaled block lands in.
    v.extend((0..200_000).map(|_| rng.gen_range(-460f32..460.0).to_bits()));
    let negatives: Vec<u32> = v.iter().map(|x| x ^ 0x8000_0000).collect();
    v.extend(negatives);
    while v.len() % 4 != 0 {
        v.push(0);
    }
    v
}

#[test]
fn narrows_every_tie_and_a_million_values_like_the_core_conversion() {
    let src = narrowing_inputs();
    let vector = kernel("e4m3_narrow", 4, 4, 1, |b, s, d| {
        let v = b.ins().load(types::F32X4, mem(), s, 0);
        let c = e4m3::narrow_i32x4(b, v);
        e4m3::store_codes(b, c, d, 0);
    });
    let lanes = kernel("e4m3_narrow_lanes", 4, 4, 1, |b, s, d| {
        let v = b.ins().load(types::F32X4, mem(), s, 0);
        let c = e4m3::narrow_i32x4(b, v);
        for lane in 0..4u8 {
            e4m3::store_code_lane(b, c, lane, d, i32::from(lane));
        }
    });
    let mut out = vec![0u8; src.len()];
    run(&vector, &src, &mut out, src.len());
    let mut out_lanes = vec![0u8; src.len()];
    run(&lanes, &src, &mut out_lanes, src.len());
    for (i, &x) in src.iter().enumerate() {
        let want = e4m3_from_f32(f32::from_bits(x));
        assert_eq!(out[i], want, "store_codes of {x:#010x} ({})", f32::from_bits(x));
        assert_eq!(out_lanes[i], want, "store_code_lane of {x:#010x}");
    }
}

/// A kernel quantizing `n / count` consecutive blocks of `count` values
/// with [`e4m3::quantize_block`]: codes into `dst`, scales after them.
fn quantize(values: &[f32], count: usize) -> (Vec<u8>, Vec<f32>) {
    let blocks = values.len() / count;
    let f = {
        let ptr = pointer_type();
        compile_function("e4m3_quantize", &[ptr, ptr, types::I64], &[], CaptureText::default(), |b, args| {
            let (src, dst, n) = (args[0], args[1], args[2]);
            let zero = b.ins().iconst(types::I64, 0);
            let count_v = b.ins().iconst(types::I64, count as i64);
            counted_loop(b, zero, n, 1, &[], |b, block, _| {
                let first = b.ins().imul_imm_s(block, count as i64);
                let src_at = b.ins().ishl_imm_u(first, 2);
                let src_at = b.ins().iadd(src, src_at);
                let codes = b.ins().iadd(dst, first);
                let scale_at = b.ins().ishl_imm_u(block, 2);
                let scale_at = b.ins().iadd_imm_s(scale_at, (blocks * count) as i64);
                let scale_at = b.ins().iadd(dst, scale_at);
                e4m3::quantize_block(b, src_at, count_v, codes, scale_at);
                vec![]
            });
            b.ins().return_(&[]);
        })
        .unwrap()
    };
    // Codes, then 4-byte scales, then a guard of 16 bytes.
    let mut out = vec![0xa5u8; blocks * count + blocks * 4 + 16];
    run(&f, values, &mut out, blocks);
    assert!(out[blocks * (count + 4)..].iter().all(|&g| g == 0xa5), "the guard after the scales was written");
    let scales = out[blocks * count..blocks * (count + 4)]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    out.truncate(blocks * count);
    (out, scales)
}

#[test]
fn quantizes_blocks_like_the_core_quantizer() {
    let mut rng = StdRng::seed_from_u64(0xb10c);
    for count in [1usize, 2, 3, 4, 5, 7, 8, 16, 31, 64, 128] {
        let blocks = 12;
        let mut values: Vec<f32> =
            (0..blocks * count).map(|_| rng.gen_range(-3.0f32..3.0) * 10f32.powi(rng.gen_range(-8..6))).collect();
        // Block 0 all zeros (signed), block 1 with a NaN, block 2 with an
        // infinity, block 3 tiny values (subnormal codes), block 4 one huge.
        values[..count].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { 0.0 } else { -0.0 });
        values[count + count / 2] = f32::NAN;
        values[2 * count] = f32::NEG_INFINITY;
        values[3 * count..4 * count].iter_mut().for_each(|v| *v *= 1e-30);
        values[4 * count + count - 1] = 3e38;
        let (codes, scales) = quantize(&values, count);
        for (block, scale) in scales.iter().enumerate() {
            let range = block * count..(block + 1) * count;
            let mut want = vec![0u8; count];
            let want_scale = quantize_block(&values[range.clone()], &mut want);
            assert_eq!(scale.to_bits(), want_scale.to_bits(), "scale of block {block}, g = {count}");
            assert_eq!(codes[range], want[..], "codes of block {block}, g = {count}");
        }
        // The scale is the block's largest magnitude over 448.
        let finite_max = values[5 * count..6 * count].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(scales[5], finite_max / E4M3_MAX);
    }
}

/// Blocks holding ±∞: beside finite values (one or several, both signs),
/// with NaN, with zeros only, ±∞ alone. Bit for bit the core quantizer,
/// and the rule itself: the scale is the finite values' absmax over 448
/// (0 when there is none), each ±∞ stores ±448 (0x7e / 0xfe), every finite
/// value a finite code, NaN a NaN code.
#[test]
fn infinities_saturate_and_leave_the_scale_to_the_finite_values() {
    let mut rng = StdRng::seed_from_u64(0x1f1f);
    for count in [1usize, 2, 3, 4, 5, 7, 8, 16, 31, 64, 128] {
        let blocks = 6;
        let mut values: Vec<f32> =
            (0..blocks * count).map(|_| rng.gen_range(-3.0f32..3.0) * 10f32.powi(rng.gen_range(-8..6))).collect();
        let at = |block: usize, rng: &mut StdRng| block * count + rng.gen_range(0..count);
        // 0: one +∞ among finite values; 1: −∞ and +∞ among them.
        let i = at(0, &mut rng);
        values[i] = f32::INFINITY;
        for inf in [f32::NEG_INFINITY, f32::INFINITY] {
            let i = at(1, &mut rng);
            values[i] = inf;
        }
        // 2: ±∞ and signed zeros only.
        for (i, v) in values[2 * count..3 * count].iter_mut().enumerate() {
            *v = [f32::INFINITY, 0.0, f32::NEG_INFINITY, -0.0][i % 4];
        }
        // 3: ∞ and NaN among finite values; 4: −∞ and NaN among zeros.
        for (block, fill) in [(3, None), (4, Some(0.0))] {
            if let Some(fill) = fill {
                values[block * count..(block + 1) * count].fill(fill);
            }
            let (i, j) = (at(block, &mut rng), at(block, &mut rng));
            values[i] = f32::NAN;
            values[j] = if block == 3 { f32::INFINITY } else { f32::NEG_INFINITY };
        }
        // 5: −∞ everywhere.
        values[5 * count..].fill(f32::NEG_INFINITY);

        let (codes, scales) = quantize(&values, count);
        for (block, &scale) in scales.iter().enumerate() {
            let range = block * count..(block + 1) * count;
            let what = format!("block {block}, g = {count}");
            let mut want = vec![0u8; count];
            let want_scale = quantize_block(&values[range.clone()], &mut want);
            assert_eq!(scale.to_bits(), want_scale.to_bits(), "scale of {what}");
            assert_eq!(codes[range.clone()], want[..], "codes of {what}");

            let finite_max = values[range.clone()].iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale.to_bits(), (finite_max / E4M3_MAX).to_bits(), "scale of {what}: finite absmax / 448");
            for (&value, &code) in values[range].iter().zip(&codes[block * count..]) {
                if value.is_nan() {
                    assert_eq!(code & 0x7f, 0x7f, "{what}: NaN codes as NaN");
                } else if value.is_infinite() {
                    let sign = if value > 0.0 { 0 } else { 0x80 };
                    assert_eq!(code, sign | 0x7e, "{what}: {value} saturates to ±448");
                } else {
                    assert_ne!(code & 0x7f, 0x7f, "{what}: {value} codes as NaN");
                }
            }
        }
    }
}

/// The bf16 words [`ToBf16::convert_row`] makes from `codes`, `count` codes
/// per call (16 at a time, then the 8- and 4-code tails).
fn to_bf16_words(codes: &[u8], count: usize) -> Vec<u16> {
    let name = format!("e4m3_to_bf16_{count}");
    let key = KernelKey::new(&name, Target::Cpu, DType::F32);
    let row = Displacements::up_to(&key, Some(2 * count)).unwrap();
    let convert = kernel(&name, count as i64, 1, 2, |b, s, d| {
        ToBf16::new(b, row).convert_row(b, s, 0, d, 0, count);
    });
    let n = codes.len().next_multiple_of(count);
    let mut src = codes.to_vec();
    src.resize(n, 0);
    // Guard words after the last row catch a store past it.
    let mut dst = vec![0xA5A5u16; n + 8];
    run(&convert, &src, &mut dst, n);
    assert!(dst[n..].iter().all(|&w| w == 0xA5A5), "count {count}: wrote past the last row");
    dst.truncate(codes.len());
    dst
}

#[test]
fn every_code_becomes_its_exact_bf16() {
    let codes: Vec<u8> = (0..=255).collect();
    for count in [256, 12, 4] {
        let words = to_bf16_words(&codes, count);
        for (&code, &word) in codes.iter().zip(&words) {
            let value = e4m3_to_f32(code);
            let widened = f32::from_bits(u32::from(word) << 16);
            if value.is_nan() {
                assert!(widened.is_nan(), "code {code:#04x} (count {count}): NaN, got {word:#06x}");
                assert_eq!(word >> 15, u16::from(code >> 7), "code {code:#04x}: NaN keeps its sign");
            } else {
                assert_eq!(value.to_bits() & 0xffff, 0, "E4M3 values fit bf16");
                assert_eq!(
                    widened.to_bits(),
                    value.to_bits(),
                    "code {code:#04x} (count {count}): want {value} ({:#010x}), got {word:#06x}",
                    value.to_bits()
                );
            }
        }
    }
}
