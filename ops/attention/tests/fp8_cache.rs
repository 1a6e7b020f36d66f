//! Attention on an FP8 (E4M3) cache: the JIT kernel against the f64
//! reference (which reads the dequantized `code · scale` values) on random
//! calls of every shape class, outputs poisoned and guarded, the cache and
//! its scales checked byte-identical afterwards; NaN codes; and the output
//! against the same step on an f32 cache holding the unquantized values.

mod common;

use common::{
    Case, assert_same_bits_on_every_pool, check_against_reference, check_against_reference_on, jit, run_jit, run_jit_on,
};
use kvjit_core::fp8::quantize_block;
use kvjit_core::{DType, PagedKVCacheCollection, Tensor};
use kvjit_op_attention::Mask;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn run_random(decode: bool, cases: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut worst = 0f64;
    for _ in 0..cases {
        let case = Case::random_fp8(&mut rng, decode);
        // Every tier this CPU runs, on the same call.
        for tier in common::tiers() {
            let case = Case { tier, ..case.clone() };
            let got = run_jit(&jit(&case), &case, 2);
            worst = worst.max(check_against_reference(&case, &got));
        }
    }
    println!("worst error / bound: {worst:.4}");
}

/// Random decode calls (D 24…256, g = D or a smaller multiple of 4, GQA 1/4/8,
/// page sizes 1…256, ragged and zero lengths, both masks, windows).
#[test]
fn fp8_decode_random_cases_match_the_reference() {
    run_random(true, 50, 21);
}

#[test]
fn fp8_prefill_random_cases_match_the_reference() {
    run_random(false, 35, 22);
}

fn llama(g: usize, seq: usize, cache_lengths: Vec<u32>, valid: u32, window: Option<usize>) -> Case {
    Case {
        dtype: DType::BF16,
        cache_dtype: DType::F8E4M3,
        batch: cache_lengths.len(),
        seq,
        num_heads: 32,
        num_kv_heads: 8,
        head_size: 128,
        page_size: 16,
        num_layers: 2,
        layer: 1,
        scale_granularity: Some(g),
        valid_lengths: vec![valid; cache_lengths.len()],
        cache_lengths,
        mask: Mask::Causal,
        window,
        scale: 1.0 / 128f32.sqrt(),
        seed: 31,
        tier: common::default_tier(),
    }
}

/// Llama-3-8B heads (GQA 4, 8 KV heads, D 128, page 16) with g = 128, 32
/// and 8: decode split into key chunks over the pool (B 1, 2 or 5 threads)
/// or not (B 3, uneven lengths), a long context, causal prefill over
/// several query blocks, a sliding window.
#[test]
fn fp8_llama_shapes_match_the_reference() {
    for g in [128, 32, 8] {
        for (case, threads) in [
            (llama(g, 1, vec![1229], 1, None), 2),
            (llama(g, 1, vec![1229], 1, None), 5),
            (llama(g, 1, vec![300, 0, 77], 1, None), 2),
            (llama(g, 19, vec![45], 19, None), 2),
            (llama(g, 12, vec![70, 3], 11, Some(37)), 3),
        ] {
            let got = run_jit(&jit(&case), &case, threads);
            check_against_reference(&case, &got);
        }
    }
    // A context of 4100 keys over 257 pages; D 64 with g = 64, 16 and 4.
    let long = llama(128, 1, vec![4099, 2100], 1, None);
    check_against_reference(&long, &run_jit(&jit(&long), &long, 2));
    for g in [64, 16, 4] {
        let case =
            Case { head_size: 64, num_heads: 16, num_kv_heads: 2, scale: 0.125, ..llama(g, 1, vec![600, 33], 1, None) };
        check_against_reference(&case, &run_jit(&jit(&case), &case, 2));
        let prefill = Case { seq: 9, valid_lengths: vec![9, 4], mask: Mask::Null, ..case };
        check_against_reference(&prefill, &run_jit(&jit(&prefill), &prefill, 2));
    }
}

/// Bit-identical outputs on pools of 1, 2, 3 and 5 threads, random FP8
/// calls (contexts up to 700 keys: several key chunks).
#[test]
fn fp8_results_do_not_depend_on_the_thread_count() {
    let mut rng = StdRng::seed_from_u64(23);
    for decode in [true, false] {
        for _ in 0..4 {
            let case = Case::random_fp8(&mut rng, decode);
            assert_same_bits_on_every_pool(&jit(&case), &case);
        }
    }
}

/// A NaN code in V makes exactly that element of the rows that read the
/// key NaN; a NaN code in K makes the whole rows NaN — as in the reference
/// (decode, null mask: every row reads every key, so no masked-out key's
/// NaN reaches a row through a zero weight). Scale blocks of 32 and whole
/// rows (g = D: the f16 products where the CPU has AVX512-FP16).
#[test]
fn fp8_nan_codes_propagate_like_the_reference() {
    for (g, chunks_threads, cache_lengths) in
        [(32, 1, vec![40, 300]), (32, 4, vec![700, 1300]), (128, 1, vec![40, 300]), (128, 4, vec![700, 1300])]
    {
        let case = Case { mask: Mask::Null, seq: 1, ..llama(g, 1, cache_lengths, 1, None) };
        let (inputs, mut cache) = case.inputs();
        let (page, slot) = cache.locate(0, 17).unwrap();
        let v_at = cache.element_offset(page as usize, 1, case.layer, slot, 3, 70);
        let (page, slot) = cache.locate(1, 250).unwrap();
        let k_at = cache.element_offset(page as usize, 0, case.layer, slot, 6, 5);
        let (blocks, _) = cache.blocks_and_scales_mut();
        blocks[v_at] = 0x7f;
        blocks[k_at] = 0xff;
        let got = run_jit_on(&jit(&case), &case, &inputs, &cache, chunks_threads);
        check_against_reference_on(&case, &inputs, &cache, &got);
        let d = case.head_size;
        let nans = |b: usize, h: usize| got[(b * case.num_heads + h) * d..][..d].iter().filter(|x| x.is_nan()).count();
        assert_eq!(nans(0, 12), 1, "V NaN: one element of each query head of KV head 3");
        assert_eq!(nans(0, 11), 0, "KV head 2 reads no NaN");
        assert_eq!(nans(1, 24), d, "K NaN: the whole row of each query head of KV head 6");
    }
}

/// The FP8 cache made from an f32 cache: every g-block of `blocks`
/// quantized with [`quantize_block`] (NaN poison stays NaN: scale 0, NaN
/// codes).
fn quantized(cache: &PagedKVCacheCollection, g: usize) -> PagedKVCacheCollection {
    let values = cache.blocks().to_f32_vec().unwrap();
    let mut codes = vec![0u8; values.len()];
    let scales: Vec<f32> =
        values.chunks_exact(g).zip(codes.chunks_exact_mut(g)).map(|(v, c)| quantize_block(v, c)).collect();
    let shape = cache.blocks().shape().to_vec();
    let mut scales_shape = shape.clone();
    scales_shape[5] /= g;
    PagedKVCacheCollection::from_parts_with_scales(
        Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap(),
        Some(Tensor::from_f32(DType::F32, &scales_shape, &scales).unwrap()),
        cache.cache_lengths().to_vec(),
        cache.lookup_table().to_vec(),
        cache.max_pages_per_seq(),
    )
    .unwrap()
}

/// The same step on an FP8 cache (g = 128, D = 128) and on an f32 cache
/// holding the unquantized K/V (uniform in [-1, 1), q in [-2, 2]), both
/// JIT, every row reading at least 100 keys.
///
/// **Quantization.** Each K/V element x of a g-block with scale `s =
/// max|x|/448` reads back as `x̂ = rne(x/s)·s`: off by at most half an E4M3
/// step, `|x̂ − x| ≤ 2⁻⁴·|x| + 2⁻¹⁰·s` (3 mantissa bits: a half ulp is at
/// most 2⁻⁴ of the magnitude for normals; subnormal steps are 2⁻⁹·s), plus
/// one f32 rounding (asserted first, on every element).
///
/// **Bound (rigorous, per row).** With `δ = max_j |scale · q·(k̂_j − k_j)|`
/// (score errors, computed from the actual errors), `ε_V = max |v̂ − v|`
/// over the row's keys and `V = max|v|`: `out = Σ p_j v_j` is a convex
/// combination, the perturbed weights satisfy `p̂_j/p_j ∈ [e^{−2δ}, e^{2δ}]`,
/// so `Σ|p̂_j − p_j| ≤ e^{2δ} − 1` and `|ôut − out| ≤ ε_V + (e^{2δ} − 1)·V`,
/// plus both kernels' f32 error (the JIT-vs-reference tolerance each).
///
/// **Bound (a-priori, asserted too).** `|ôut − out| ≤ 2⁻⁴·V`: the V term
/// is a weighted mean of errors each ≤ 2⁻⁴·|v| (worst case 2⁻⁴·V), and the
/// score term is a sum of independent rounding errors over D = 128
/// products (rms ≈ scale·0.036·√(D·E[q²]·E[k²]) ≈ 0.024 here) whose effect
/// on a mean over ≥ 100 keys is ≈ 0.024·rms|v − out|/√T ≈ 10⁻³. Observed
/// (`--nocapture`): the worst error is 0.17 of this bound and 0.07 of the
/// rigorous one.
#[test]
fn fp8_cache_output_stays_close_to_the_f32_cache() {
    let g = 128;
    let mut worst_rigorous = 0f64;
    let mut worst_a_priori = 0f64;
    for (seq, cache_lengths, valid, mask) in [
        (1, vec![1500, 100, 700], 1, Mask::Causal),
        (1, vec![2047], 1, Mask::Null),
        (16, vec![120, 400], 16, Mask::Causal),
    ] {
        let f32_case = Case {
            dtype: DType::F32,
            cache_dtype: DType::F32,
            scale_granularity: None,
            mask,
            ..llama(g, seq, cache_lengths, valid, None)
        };
        let fp8_case = Case { cache_dtype: DType::F8E4M3, scale_granularity: Some(g), ..f32_case.clone() };
        let (inputs, cache32) = f32_case.inputs();
        let cache8 = quantized(&cache32, g);
        let out32 = run_jit_on(&jit(&f32_case), &f32_case, &inputs, &cache32, 2);
        let out8 = run_jit_on(&jit(&fp8_case), &fp8_case, &inputs, &cache8, 2);
        // The FP8 step is itself right for its cache.
        check_against_reference_on(&fp8_case, &inputs, &cache8, &out8);

        let q = inputs[0].to_f32_vec().unwrap();
        let (hq, d, group) = (f32_case.num_heads, f32_case.head_size, f32_case.num_heads / f32_case.num_kv_heads);
        let scale = f64::from(f32_case.scale);
        for b in 0..f32_case.batch {
            let (cl, v) = (f32_case.cache_lengths[b] as usize, f32_case.valid_lengths[b] as usize);
            // Every key's (K, V) rows of the layer, both caches, in f64.
            let rows = |cache: &PagedKVCacheCollection, p: usize| {
                let (page, slot) = cache.locate(b, p).unwrap();
                let read = |kv| cache.read_slot(page as usize, kv, f32_case.layer, slot).unwrap();
                (read(0), read(1))
            };
            let keys: Vec<_> = (0..cl + v).map(|p| (rows(&cache32, p), rows(&cache8, p))).collect();
            for ((k, vv), (k8, v8)) in &keys {
                for (x, x8, what) in [(k, k8, "K"), (vv, v8, "V")] {
                    for (block, block8) in x.chunks_exact(g).zip(x8.chunks_exact(g)) {
                        let s = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
                        for (&a, &a8) in block.iter().zip(block8) {
                            let half_step = 2f32.powi(-4) * a.abs() + 2f32.powi(-10) * s + 2f32.powi(-23) * a.abs();
                            assert!((a8 - a).abs() <= half_step, "{what}: {a} read back as {a8}");
                        }
                    }
                }
            }
            for s in 0..v {
                let (lo, hi) = f32_case.config().key_range(cl, v, s);
                assert!(hi - lo >= 100, "every row reads at least 100 keys");
                for h in 0..hq {
                    let kvh = h / group;
                    let head = kvh * d..(kvh + 1) * d;
                    let at = ((b * f32_case.seq + s) * hq + h) * d;
                    let qrow = &q[at..at + d];
                    let (mut delta, mut eps_v, mut vmax) = (0f64, 0f64, 0f64);
                    for ((k, vv), (k8, v8)) in &keys[lo..hi] {
                        let dot: f64 = qrow
                            .iter()
                            .zip(&k[head.clone()])
                            .zip(&k8[head.clone()])
                            .map(|((&x, &a), &a8)| f64::from(x) * (f64::from(a8) - f64::from(a)))
                            .sum();
                        delta = delta.max((scale * dot).abs());
                        for (&a, &a8) in vv[head.clone()].iter().zip(&v8[head.clone()]) {
                            eps_v = eps_v.max((f64::from(a8) - f64::from(a)).abs());
                            vmax = vmax.max(f64::from(a).abs());
                        }
                    }
                    for i in 0..d {
                        let err = (f64::from(out8[at + i]) - f64::from(out32[at + i])).abs();
                        let f32_error = common::tolerance(&f32_case, hi - lo, f64::from(out32[at + i]))
                            + common::tolerance(&fp8_case, hi - lo, f64::from(out8[at + i]));
                        let rigorous = eps_v + ((2.0 * delta).exp() - 1.0) * vmax + f32_error;
                        let a_priori = 2f64.powi(-4) * vmax;
                        assert!(err <= rigorous, "(b {b}, s {s}, h {h}, d {i}): error {err:e} > {rigorous:e}");
                        assert!(err <= a_priori, "(b {b}, s {s}, h {h}, d {i}): error {err:e} > {a_priori:e}");
                        worst_rigorous = worst_rigorous.max(err / rigorous);
                        worst_a_priori = worst_a_priori.max(err / a_priori);
                    }
                }
            }
        }
    }
    println!("worst error / rigorous bound {worst_rigorous:.4}, / a-priori bound {worst_a_priori:.4}");
}
