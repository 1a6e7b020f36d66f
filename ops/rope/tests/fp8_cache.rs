//! RoPE on an FP8 (`f8e4m3`) cache: every rotated K head is dequantized,
//! rotated and requantized per g-block with a fresh scale. The JIT against
//! the reference (and both against an exact f64 model of the dequantized
//! input), over both layouts, every activation dtype, g = D and g < D,
//! several B/S/valid lengths; the cache holds random codes and scales
//! everywhere, and every byte of the blocks and every scale outside the
//! rotated K heads must be bit-identical afterwards (only the scale slots of
//! the rotated tokens' K heads change). Also: rotations that are exact give
//! identical bytes on both kernels, the Q output does not depend on the
//! cache dtype, NaN codes stay NaN without setting their block's scale,
//! zero blocks store scale 0 and zeros, the reference serves any g, and
//! kernels refuse an FP8 cache of another granularity writing nothing.

mod common;

use std::collections::HashSet;

use common::{
    Call, Case, Expected, Model, Ran, assert_metadata_unchanged, assert_output_matches, draw, expected, jit_kernel,
    run_jit, run_reference,
};
use kvjit_core::fp8::{E4M3_MAX, E4M3_NAN, quantize_block};
use kvjit_core::{CacheElement, DType, Error, PagedKVCacheCollection, Tensor};
use kvjit_jit::{CaptureText, JitError};
use kvjit_op::Compiled;
use kvjit_op_rope::{JitKernel, ReferenceKernel, RopeSpec};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::tolerance::ulp;
use kvjit_testkit::{Guarded, unravel};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// 2⁻²⁴: f32's unit roundoff.
const F32_U: f64 = 1.0 / (1u64 << 24) as f64;

/// `base` with an FP8 cache of head size `d` and granularity `g`.
fn fp8(base: Case, d: usize, g: usize) -> Case {
    Case { cache_dtype: DType::F8E4M3, granularity: Some(g), d, ..base }
}

/// Half an E4M3 step at a block's `scale`, for an element whose exact value
/// is `exact` and whose stored value reads back as `got`:
/// `0.5 · ulp_e4m3(a / scale) · scale` with `a = max(|exact|, |got|)`.
/// The code rounds `q = fl(y / scale)` to nearest, and the step of the
/// binade q lies in is no larger than that at the larger of `|exact|/scale`
/// and `|got|/scale` (rounding is monotone and binade bounds are codes).
fn half_step(scale: f64, exact: f64, got: f64) -> f64 {
    0.5 * ulp(DType::F8E4M3, exact.abs().max(got.abs()) / scale) * scale
}

/// The f32 roundings around the E4M3 one, `4·2⁻²⁴·(magnitude + |exact| +
/// |got|)`: the rotated value `y` in f32 (the JIT's product and fma are
/// within `2·2⁻²⁴·magnitude` of the exact value, the reference's single
/// rounding within `2⁻²⁴·|exact|`), the quotient `y / scale` (relative
/// 2⁻²⁴) and the read-back product `code · scale` (relative 2⁻²⁴).
fn f32_slack(m: &Model, got: f64) -> f64 {
    4.0 * F32_U * (m.magnitude + m.exact.abs() + got.abs())
}

/// Requantization accuracy: a requantized element read back
/// (`code · scale`, `scale` its block's new scale) lies within half an E4M3
/// step of the exact (f64) rotation of the dequantized input, at that
/// scale, plus the f32 roundings around it:
///
/// `|dequant(out) − exact| ≤ 0.5·ulp_e4m3(|exact| / scale)·scale + 4·2⁻²⁴·(magnitude + |exact| + |dequant(out)|)`
///
/// (see [`half_step`] for which |·| the ulp is taken at, [`f32_slack`] for
/// the slack). A zero scale (a block of exact zeros) must read back as
/// zero. NaN stays NaN.
fn assert_within_half_a_step(what: &dyn Fn() -> String, m: &Model, got: f64, scale: f64) {
    if m.exact.is_nan() {
        assert!(got.is_nan(), "{}: {got}, expected NaN", what());
        return;
    }
    let bound = if scale == 0.0 { 0.0 } else { half_step(scale, m.exact, got) } + f32_slack(m, got);
    assert!(
        got.is_finite() && (got - m.exact).abs() <= bound,
        "{}: {got} vs exact {} at scale {scale:e} (bound {bound:e})",
        what(),
        m.exact
    );
}

/// A run's K heads read back: its scales and dequantized blocks.
struct ReadBack {
    codes: Vec<u8>,
    scales: Vec<f32>,
    values: Vec<f64>,
}

fn read_back(cache: &PagedKVCacheCollection) -> ReadBack {
    let g = cache.params().scale_granularity().expect("an FP8 cache");
    let codes = cache.blocks().as_bytes().to_vec();
    let scales = cache.scales().expect("an FP8 cache").as_slice::<f32>().unwrap().to_vec();
    // Element i reads `code · scale[i / g]` (the cache's `[…, d / g]`).
    let values =
        codes.iter().enumerate().map(|(i, &c)| f64::from(kvjit_core::fp8::e4m3_to_f32(c) * scales[i / g])).collect();
    ReadBack { codes, scales, values }
}

/// What the comparison of one JIT run with the reference found.
#[derive(Debug, Default)]
struct Stats {
    elements: usize,
    codes_differing: usize,
    scales: usize,
    scales_differing: usize,
}

/// Check an FP8 run of the JIT against the reference's and the model:
///
/// - output: as for every cache (padded rows +0; the JIT within f32
///   rounding of the reference);
/// - the reference's codes and scales are exactly `quantize_block` of the
///   exact rotation rounded to f32, per g-block (the contract, bit for bit);
/// - both kernels' rotated elements within half an E4M3 step of the exact
///   rotation ([`assert_within_half_a_step`]);
/// - JIT vs reference, per element: `|jit − ref| ≤ half_step(jit) +
///   half_step(ref) + both slacks` — one E4M3 step at the block scale plus
///   f32 rounding, as the f32 rotation may differ from the reference's by
///   an ulp and move a code across a rounding boundary; per block, the
///   scales within `4·2⁻²⁴·max magnitude / 448 + 2⁻²³·scale` of each other;
///   NaN exactly where the reference has NaN;
/// - every other byte of the blocks and every scale outside the rotated K
///   heads bit-identical to before the call, in both.
fn assert_fp8_matches(case: &Case, call: &Call, jit: &Ran, reference: &Ran) -> Stats {
    let g = case.granularity.expect("an FP8 case");
    let model = expected(case, call);
    assert_output_matches(case, &model, jit, reference);
    assert_metadata_unchanged(call, jit, reference);
    let before = read_back(&call.cache);
    let (got, want) = (read_back(&jit.cache), read_back(&reference.cache));
    let shape = call.cache.blocks().shape();
    let at = |i: usize| format!("{case:?}: blocks{:?}", unravel(shape, i));
    let mut stats = Stats::default();

    // Per rotated g-block: the model's elements, in order.
    let mut blocks: Vec<usize> = model.cache.keys().map(|&i| i / g).collect::<HashSet<_>>().into_iter().collect();
    blocks.sort_unstable();
    for &block in &blocks {
        let elements: Vec<(usize, Model)> = (block * g..(block + 1) * g).map(|i| (i, model.cache[&i])).collect();
        // The reference is the contract: quantize_block of the exact
        // rotation rounded once to f32.
        let rounded: Vec<f32> = elements.iter().map(|(_, m)| m.exact as f32).collect();
        let mut codes = vec![0u8; g];
        let scale = quantize_block(&rounded, &mut codes);
        let what = || format!("{}: block {block}", at(block * g));
        assert_eq!(want.scales[block].to_bits(), scale.to_bits(), "{}: reference scale", what());
        assert_eq!(want.codes[block * g..(block + 1) * g], codes, "{}: reference codes", what());

        let (s_jit, s_ref) = (f64::from(got.scales[block]), f64::from(want.scales[block]));
        let max_magnitude = elements.iter().fold(0f64, |m, (_, e)| m.max(e.magnitude));
        let scale_tol = 4.0 * F32_U * max_magnitude / f64::from(E4M3_MAX) + 2.0 * F32_U * s_ref;
        assert!(
            (s_jit - s_ref).abs() <= scale_tol,
            "{}: jit scale {s_jit:e} vs reference {s_ref:e} (tol {scale_tol:e})",
            what()
        );
        stats.scales += 1;
        stats.scales_differing += usize::from(s_jit != s_ref);
        for (i, m) in &elements {
            let (j, r) = (got.values[*i], want.values[*i]);
            assert_within_half_a_step(&|| format!("{}: reference", at(*i)), m, r, s_ref);
            assert_within_half_a_step(&|| format!("{}: jit", at(*i)), m, j, s_jit);
            if m.exact.is_nan() {
                continue;
            }
            let tol = half_step(s_jit, m.exact, j) + half_step(s_ref, m.exact, r) + f32_slack(m, j) + f32_slack(m, r);
            assert!((j - r).abs() <= tol, "{}: jit {j} vs reference {r} (tol {tol:e})", at(*i));
            stats.elements += 1;
            stats.codes_differing += usize::from(got.codes[*i] != want.codes[*i]);
        }
    }

    // Nothing else changed: other bytes of the blocks, other scales.
    let rotated_scales: HashSet<usize> = blocks.into_iter().collect();
    for (i, &b) in before.codes.iter().enumerate() {
        if !model.cache.contains_key(&i) {
            assert_eq!(got.codes[i], b, "{}: jit wrote it", at(i));
            assert_eq!(want.codes[i], b, "{}: reference wrote it", at(i));
        }
    }
    let scales_shape = call.cache.scales().unwrap().shape();
    for (i, &s) in before.scales.iter().enumerate() {
        if !rotated_scales.contains(&i) {
            let where_ = || format!("{case:?}: scales{:?}", unravel(scales_shape, i));
            assert_eq!(got.scales[i].to_bits(), s.to_bits(), "{}: jit wrote it", where_());
            assert_eq!(want.scales[i].to_bits(), s.to_bits(), "{}: reference wrote it", where_());
        }
    }
    stats
}

/// Run both kernels on `case` (built from its seed) and check them.
fn check(case: &Case, threads: usize) -> Stats {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let call = case.build(&mut rng);
    check_call(case, &call, threads)
}

fn check_call(case: &Case, call: &Call, threads: usize) -> Stats {
    let reference = run_reference(case, call);
    let kernel = jit_kernel(case);
    let jit = run_jit(case, call, &kernel, &DeviceContextPtr::cpu(threads).unwrap());
    assert_fp8_matches(case, call, &jit, &reference)
}

/// Granularities the JIT serves for head size `d`: multiples of 4 dividing it.
fn jit_granularities(d: usize) -> Vec<usize> {
    (1..=d).filter(|g| g.is_multiple_of(4) && d.is_multiple_of(*g)).collect()
}

/// Assert that rounding differences stayed rare: the JIT rotates in f32,
/// the reference in f64, so a code differs only where the quotient lies
/// within an f32 ulp or so of an E4M3 rounding boundary.
fn assert_rarely_differs(stats: &Stats) {
    assert!(stats.elements > 0, "{stats:?}: nothing rotated");
    assert!(stats.codes_differing * 100 <= stats.elements, "{stats:?}: too many codes differ");
}

#[test]
fn random_fp8_cases_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(0x5eed_f8e4);
    let cases = std::env::var("KVJIT_ROPE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(120usize) / 2;
    let mut total = Stats::default();
    let mut seen = HashSet::new();
    for i in 0..cases {
        let base = draw(&mut rng);
        // g = D (one scale per head) a third of the time.
        let g = if rng.gen_bool(1.0 / 3.0) { base.d } else { *jit_granularities(base.d).choose(&mut rng).unwrap() };
        let case = fp8(base.clone(), base.d, g);
        seen.insert((case.dtype, case.interleaved, g == case.d));
        let stats = check(&case, 1 + i % 2);
        total.elements += stats.elements;
        total.codes_differing += stats.codes_differing;
        total.scales += stats.scales;
        total.scales_differing += stats.scales_differing;
    }
    assert_rarely_differs(&total);
    assert_eq!(seen.len(), 12, "every dtype, both layouts, g = D and g < D");
}

#[test]
fn the_issues_head_sizes_and_granularities() {
    for dtype in DType::FLOATS {
        for interleaved in [false, true] {
            for (d, g) in
                [(8, 4), (8, 8), (24, 12), (64, 16), (64, 32), (64, 64), (128, 32), (128, 128), (256, 128), (1024, 256)]
            {
                let base = Case {
                    batch: 3,
                    seq: 4,
                    hq: 8,
                    hkv: 2,
                    page_size: 3,
                    layers: 2,
                    layer: 1,
                    cache_lengths: vec![2, 0, 5],
                    valid: vec![4, 1, 0],
                    seed: (d * 1000 + g) as u64,
                    ..Case::base(dtype, DType::F8E4M3, interleaved)
                };
                let stats = check(&fp8(base, d, g), 2);
                assert!(stats.elements > 0);
            }
        }
    }
}

#[test]
fn several_batches_sequence_lengths_and_valid_lengths() {
    let base =
        Case { hq: 4, hkv: 2, page_size: 4, layers: 3, layer: 2, ..Case::base(DType::BF16, DType::F8E4M3, false) };
    for interleaved in [false, true] {
        for (batch, seq, cache_lengths, valid) in [
            (1, 1, vec![0], vec![1]),
            (1, 1, vec![37], vec![1]),
            (1, 9, vec![3], vec![9]),
            (2, 5, vec![4, 11], vec![5, 3]),
            (3, 3, vec![0, 0, 0], vec![0, 0, 0]),
            (4, 2, vec![7, 0, 1, 2], vec![2, 0, 1, 2]),
        ] {
            let case = fp8(Case { batch, seq, cache_lengths, valid, interleaved, ..base.clone() }, 64, 32);
            check(&case, 2);
        }
    }
}

#[test]
fn the_reference_is_within_half_a_step_for_any_granularity() {
    // The JIT needs g to be a multiple of 4; the reference takes every g
    // dividing D. Check it alone against the exact model.
    for (d, g) in [(8, 1), (8, 2), (24, 3), (24, 6), (80, 5), (80, 10), (72, 36)] {
        for interleaved in [false, true] {
            let case = fp8(Case::base(DType::F32, DType::F8E4M3, interleaved), d, g);
            let mut rng = StdRng::seed_from_u64(case.seed);
            let call = case.build(&mut rng);
            let reference = run_reference(&case, &call);
            let model = expected(&case, &call);
            let got = read_back(&reference.cache);
            for (&i, m) in &model.cache {
                let what = || format!("{case:?}: blocks{:?}", unravel(call.cache.blocks().shape(), i));
                assert_within_half_a_step(&what, m, got.values[i], f64::from(got.scales[i / g]));
            }
        }
    }
}

/// The freqs table `[positions, d]` whose row p rotates every pair by
/// `ROWS[p % 4]`: rotations by 0°, 90°, 180°, 270° — exact in f32 and f64.
fn exact_rotations(dtype: DType, positions: usize, d: usize) -> Tensor {
    const ROWS: [(f32, f32); 4] = [(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0)];
    let values: Vec<f32> =
        (0..positions).flat_map(|p| (0..d / 2).flat_map(move |_| [ROWS[p % 4].0, ROWS[p % 4].1])).collect();
    Tensor::from_f32(dtype, &[positions, d], &values).unwrap()
}

#[test]
fn exact_rotations_give_identical_bytes() {
    // Rotations by multiples of 90° only move and negate values: the f32
    // rotation is exact, so both kernels requantize the very same values
    // and must store the very same codes and scales.
    for interleaved in [false, true] {
        for (d, g) in [(16, 4), (64, 16), (128, 128)] {
            let base = Case {
                batch: 2,
                seq: 5,
                cache_lengths: vec![1, 6],
                valid: vec![5, 4],
                ..Case::base(DType::F16, DType::F8E4M3, interleaved)
            };
            let case = fp8(base, d, g);
            let mut rng = StdRng::seed_from_u64(case.seed);
            let mut call = case.build(&mut rng);
            call.freqs = exact_rotations(case.dtype, case.max_seq(), d);
            let reference = run_reference(&case, &call);
            let jit = run_jit(&case, &call, &jit_kernel(&case), &DeviceContextPtr::cpu(2).unwrap());
            let stats = assert_fp8_matches(&case, &call, &jit, &reference);
            assert_eq!(stats.codes_differing, 0, "{case:?}");
            assert!(jit.cache.blocks().as_bytes() == reference.cache.blocks().as_bytes(), "{case:?}: blocks");
            let (a, b) = (jit.cache.scales().unwrap().as_bytes(), reference.cache.scales().unwrap().as_bytes());
            assert!(a == b, "{case:?}: scales");
            assert!(jit.output == reference.output, "{case:?}: output");
        }
    }
}

#[test]
fn the_q_output_does_not_depend_on_the_cache_dtype() {
    // The Q path is the same code whatever the cache: the JIT's output
    // with an FP8 cache is byte-identical to its output with an f32 cache.
    for dtype in DType::FLOATS {
        for interleaved in [false, true] {
            let case = fp8(Case { hq: 8, ..Case::base(dtype, DType::F8E4M3, interleaved) }, 64, 32);
            let mut rng = StdRng::seed_from_u64(case.seed);
            let call = case.build(&mut rng);
            let ctx = DeviceContextPtr::cpu(2).unwrap();
            let with_fp8 = run_jit(&case, &call, &jit_kernel(&case), &ctx);
            let f32_case = Case { cache_dtype: DType::F32, granularity: None, ..case.clone() };
            let f32_call = f32_case.build(&mut StdRng::seed_from_u64(case.seed));
            let f32_call = Call { q: call.q.clone(), freqs: call.freqs.clone(), ..f32_call };
            let with_f32 = run_jit(&f32_case, &f32_call, &jit_kernel(&f32_case), &ctx);
            assert!(with_fp8.output == with_f32.output, "{case:?}");
        }
    }
}

#[test]
fn any_thread_count_gives_identical_bytes() {
    let base = Case {
        batch: 3,
        seq: 5,
        hq: 8,
        hkv: 4,
        page_size: 4,
        cache_lengths: vec![3, 0, 9],
        valid: vec![5, 2, 4],
        ..Case::base(DType::BF16, DType::F8E4M3, false)
    };
    let case = fp8(base, 128, 64);
    let call = case.build(&mut StdRng::seed_from_u64(3));
    let kernel = jit_kernel(&case);
    let one = run_jit(&case, &call, &kernel, &DeviceContextPtr::cpu(1).unwrap());
    for threads in [2, 3, 8] {
        let many = run_jit(&case, &call, &kernel, &DeviceContextPtr::cpu(threads).unwrap());
        assert!(one.output == many.output, "{threads} threads: output");
        assert!(one.cache.blocks().as_bytes() == many.cache.blocks().as_bytes(), "{threads} threads: blocks");
        let (a, b) = (one.cache.scales().unwrap().as_bytes(), many.cache.scales().unwrap().as_bytes());
        assert!(a == b, "{threads} threads: scales");
    }
}

#[test]
fn nan_codes_stay_nan_and_do_not_set_the_scale() {
    // A few NaN codes (both signs) in the K heads this call rotates: the
    // rotation spreads each to its pair partner; every block's new scale
    // comes from its other values (NaN counts as 0, like f32::max), so the
    // rest of the head stays within half a step.
    for interleaved in [false, true] {
        let case = fp8(Case::base(DType::F32, DType::F8E4M3, interleaved), 32, 8);
        let mut rng = StdRng::seed_from_u64(case.seed);
        let mut call = case.build(&mut rng);
        let rotated: Vec<usize> = {
            let mut keys: Vec<usize> = expected(&case, &call).cache.keys().copied().collect();
            keys.sort_unstable();
            keys
        };
        let mut codes = call.cache.blocks().as_bytes().to_vec();
        for _ in 0..6 {
            let i = *rotated.choose(&mut rng).unwrap();
            codes[i] = if rng.gen_bool(0.5) { E4M3_NAN } else { 0x80 | E4M3_NAN };
        }
        let shape = call.cache.blocks().shape().to_vec();
        call.cache.set_blocks(Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap()).unwrap();
        let Expected { cache, .. } = expected(&case, &call);
        assert!(cache.values().filter(|m| m.exact.is_nan()).count() >= 2, "the NaNs reached the model");
        check_call(&case, &call, 2);
    }
}

#[test]
fn zero_blocks_store_scale_zero_and_zero_codes() {
    // Sequence 1 starts at position 0 (cos 1, sin 0: the identity), so a
    // zero block of its first token stays zero after the rotation; a whole
    // zero head stays zero at any position. Such blocks store scale 0 and
    // zero codes (x · 0, keeping the sign), not 0/0.
    for interleaved in [false, true] {
        let case = fp8(Case { cache_lengths: vec![3, 0], ..Case::base(DType::F32, DType::F8E4M3, interleaved) }, 32, 8);
        let mut call = case.build(&mut StdRng::seed_from_u64(case.seed));
        let shape = call.cache.blocks().shape().to_vec();
        let (first, later) = (k_head(&case, &call.cache, 1, 0, 0), k_head(&case, &call.cache, 0, 4, 1));
        let mut codes = call.cache.blocks().as_bytes().to_vec();
        // Sequence 1, position 0: head 0's second block; sequence 0,
        // position 4: all of head 1 (half of it −0).
        codes[first + 8..][..8].fill(0);
        codes[later..][..16].fill(0);
        codes[later + 16..][..16].fill(0x80);
        call.cache.set_blocks(Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap()).unwrap();
        let reference = run_reference(&case, &call);
        let jit = run_jit(&case, &call, &jit_kernel(&case), &DeviceContextPtr::cpu(2).unwrap());
        assert_fp8_matches(&case, &call, &jit, &reference);
        let scales = jit.cache.scales().unwrap().as_slice::<f32>().unwrap();
        for (at, blocks) in [(first + 8, 1), (later, 4)] {
            for (block, scale) in scales.iter().enumerate().skip(at / 8).take(blocks) {
                assert_eq!(scale.to_bits(), 0, "{case:?}: scale {block}");
                let codes = &jit.cache.blocks().as_bytes()[block * 8..][..8];
                let reference_codes = &reference.cache.blocks().as_bytes()[block * 8..][..8];
                assert!(codes.iter().all(|&c| c & 0x7f == 0), "{case:?}: codes of block {block}: {codes:?}");
                assert_eq!(codes, reference_codes, "{case:?}: block {block}, signs of zero");
            }
        }
    }
}

/// The blocks index of the first code of K head `h` of sequence `b`'s
/// token at position `pos`.
fn k_head(case: &Case, cache: &PagedKVCacheCollection, b: usize, pos: usize, h: usize) -> usize {
    let page = cache.lookup_table()[b * cache.max_pages_per_seq() + pos / case.page_size] as usize;
    common::block_index(cache.blocks().shape(), [page, 0, case.layer, pos % case.page_size, h, 0])
}

#[test]
fn a_rotation_overflowing_to_infinity_saturates_and_leaves_its_g_block_finite() {
    // Every pair rotated by the identity (c, s) = (1, 0) but pair 1, by
    // (1, 1): a' = a − b, b' = a + b, exact in f32 and f64 unless it
    // overflows. Two K heads of the first token hold that pair's a = b =
    // 448·S with S = 3e38 / 448, so b' = 6e38 is +∞ in both kernels: head
    // 0 among random finite values (its block keeps the scale of its
    // finite values), head 1 with the rest of b's block zero (scale 0). The
    // ∞ stores 0x7e in both; everything else is exact, so the kernels'
    // bytes are identical.
    let (d, g) = (16, 4);
    for interleaved in [false, true] {
        let case = fp8(Case::base(DType::F32, DType::F8E4M3, interleaved), d, g);
        let mut call = case.build(&mut StdRng::seed_from_u64(case.seed));
        let positions = case.max_seq();
        let freqs: Vec<f32> =
            (0..positions * d / 2).flat_map(|i| [1.0, if i % (d / 2) == 1 { 1.0 } else { 0.0 }]).collect();
        call.freqs = Tensor::from_f32(case.dtype, &[positions, d], &freqs).unwrap();
        let (a, b) = if interleaved { (2, 3) } else { (1, 1 + d / 2) };
        let block = b / g * g..(b / g + 1) * g;
        let big = 3e38f32 / E4M3_MAX;
        let first = case.cache_lengths[0] as usize; // sequence 0's first rotated position
        let heads = [0, 1].map(|h| k_head(&case, &call.cache, 0, first, h));
        let mut codes = call.cache.blocks().as_bytes().to_vec();
        let mut scales = call.cache.scales().unwrap().to_f32_vec().unwrap();
        for (i, &head) in heads.iter().enumerate() {
            if i == 1 {
                codes[head + block.start..head + block.end].fill(0);
            }
            codes[head + a] = 0x7e;
            codes[head + b] = 0x7e;
            scales[head / g..(head + d) / g].fill(big);
        }
        let shape = call.cache.blocks().shape().to_vec();
        call.cache.set_blocks(Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap()).unwrap();
        let scales_shape = call.cache.scales().unwrap().shape().to_vec();
        call.cache.set_scales(Tensor::from_f32(DType::F32, &scales_shape, &scales).unwrap()).unwrap();

        let reference = run_reference(&case, &call);
        let jit = run_jit(&case, &call, &jit_kernel(&case), &DeviceContextPtr::cpu(2).unwrap());
        assert!(jit.cache.blocks().as_bytes() == reference.cache.blocks().as_bytes(), "{case:?}: blocks");
        let (jit_scales, ref_scales) =
            (jit.cache.scales().unwrap().as_bytes(), reference.cache.scales().unwrap().as_bytes());
        assert!(jit_scales == ref_scales, "{case:?}: scales");
        assert!(jit.output == reference.output, "{case:?}: output");

        let got_codes = reference.cache.blocks().as_bytes();
        let got_scales = reference.cache.scales().unwrap().to_f32_vec().unwrap();
        for (i, &head) in heads.iter().enumerate() {
            let what = format!("{case:?}: head {i}");
            // The block's values after the rotation: b' = +∞, a' = 0, the rest as they were.
            let finite_max = block
                .clone()
                .filter(|&e| e != a && e != b)
                .fold(0f32, |m, e| m.max(kvjit_core::fp8::e4m3_to_f32(codes[head + e]).abs() * big));
            assert_eq!(got_scales[(head + b) / g], finite_max / E4M3_MAX, "{what}: the scale of b's block");
            assert_eq!(got_codes[head + b], 0x7e, "{what}: b' = +∞ saturates to 448");
            for e in block.clone() {
                assert_ne!(got_codes[head + e] & 0x7f, E4M3_NAN, "{what}: element {e} is NaN");
            }
            if i == 1 {
                assert_eq!(got_scales[(head + b) / g].to_bits(), 0, "{what}: only +∞ and zeros: scale 0");
            } else {
                assert!(finite_max > 0.0, "{what}: random codes are nonzero");
            }
        }
    }
}

/// A spec for `case` with another cache layout.
fn spec_with(case: &Case, f: impl FnOnce(&mut RopeSpec)) -> RopeSpec {
    let mut spec = case.spec();
    f(&mut spec);
    spec
}

#[test]
fn kernels_refuse_an_fp8_cache_of_another_granularity_writing_nothing() {
    let case = fp8(Case::base(DType::F32, DType::F8E4M3, false), 32, 16);
    let call = case.build(&mut StdRng::seed_from_u64(case.seed));
    let ctx = DeviceContextPtr::cpu(2).unwrap();
    for (spec, what) in [
        (spec_with(&case, |s| s.cache.element = CacheElement::F8E4M3 { scale_granularity: 32 }), "scale_granularity"),
        (spec_with(&case, |s| s.cache.element = CacheElement::F8E4M3 { scale_granularity: 8 }), "scale_granularity"),
        (spec_with(&case, |s| s.cache.element = CacheElement::BF16), "dtype"),
    ] {
        let jit = Compiled::new(JitKernel::new(spec, CaptureText::default()).unwrap());
        for kernel in [&Compiled::new(ReferenceKernel::new(spec)) as &dyn Kernel, &jit] {
            let mut cache = call.cache.clone();
            let mut out = [Tensor::zeros(case.dtype, &[case.batch, case.seq, case.hq, case.d]).unwrap()];
            let inputs = [&call.q, &call.freqs, &call.layer_idx, &call.valid];
            let checked = kernel.check(&inputs, &[&cache]);
            let ran = kernel.run(&inputs, &mut [&mut cache], &mut out, &ctx);
            for result in [checked.map(|_| ()), ran] {
                let err = result.expect_err("refused");
                assert!(
                    matches!(err, Error::CacheLayout { what: w, .. } if w == what),
                    "{}: {err}",
                    kernel.implementation()
                );
            }
            assert!(out[0].as_bytes().iter().all(|&b| b == 0), "output written");
            assert_unchanged(&call.cache, &cache);
        }
        // run_into, with its output between guards.
        let mut cache = call.cache.clone();
        let bytes = vec![0x5a; case.batch * case.seq * case.hq * case.d * 4];
        let mut out = Guarded::new(32, &bytes, 32);
        let tensors = [&call.q, &call.freqs, &call.layer_idx, &call.valid];
        let err = jit.kernel().run_into(&tensors, &mut [&mut cache], out.body_mut(), &ctx).expect_err("refused");
        assert!(matches!(err, Error::CacheLayout { what: w, .. } if w == what), "run_into: {err}");
        out.assert_guards("run_into");
        assert!(out.body() == bytes, "run_into wrote its output");
        assert_unchanged(&call.cache, &cache);
    }
    // The message names the field and both values.
    let spec = spec_with(&case, |s| s.cache.element = CacheElement::F8E4M3 { scale_granularity: 32 });
    let err = Compiled::new(ReferenceKernel::new(spec))
        .check(&[&call.q, &call.freqs, &call.layer_idx, &call.valid], &[&call.cache]);
    assert_eq!(err.unwrap_err().to_string(), "kv_collection: scale_granularity is 16, but the op was built for 32");
}

/// The cache's blocks and scales are byte-identical to `before`'s.
fn assert_unchanged(before: &PagedKVCacheCollection, cache: &PagedKVCacheCollection) {
    assert!(cache.blocks().as_bytes() == before.blocks().as_bytes(), "blocks written");
    assert!(cache.scales().unwrap().as_bytes() == before.scales().unwrap().as_bytes(), "scales written");
}

#[test]
fn the_jit_refuses_granularities_it_cannot_vectorize() {
    let case = fp8(Case::base(DType::F32, DType::F8E4M3, false), 24, 6);
    for g in [1, 2, 6, 10] {
        let spec = spec_with(&case, |s| s.cache.element = CacheElement::F8E4M3 { scale_granularity: g });
        let err = JitKernel::new(spec, CaptureText::default()).err().expect("refused");
        assert!(matches!(err, JitError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("scale_granularity"), "{err}");
    }
    // An FP8 cache without a granularity, or one for a cache without
    // scales, cannot be written down.
    assert!(CacheElement::new(DType::F8E4M3, None).is_err());
    assert!(CacheElement::new(DType::BF16, Some(8)).unwrap_err().to_string().contains("f8e4m3 caches only"));
}
