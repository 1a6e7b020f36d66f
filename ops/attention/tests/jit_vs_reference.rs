//! The JIT kernel against the f64 reference on random valid calls (decode
//! and prefill), outputs poisoned with NaN and guarded, the cache checked
//! byte-identical afterwards.

mod common;

use common::{
    Case, assert_same_bits_on_every_pool, check_against_reference, check_against_reference_on, jit, run_jit, run_jit_on,
};
use kvjit_core::DType;
use kvjit_op_attention::Mask;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn run_random(decode: bool, cases: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut worst = 0f64;
    for _ in 0..cases {
        let case = Case::random(&mut rng, decode);
        // Every tier this CPU runs, on the same call.
        for tier in common::tiers() {
            let case = Case { tier, ..case.clone() };
            let got = run_jit(&jit(&case), &case, 2);
            worst = worst.max(check_against_reference(&case, &got));
        }
    }
    println!("worst error / bound: {worst:.4}");
}

#[test]
fn decode_random_cases_match_the_reference() {
    run_random(true, 60, 1);
}

#[test]
fn prefill_random_cases_match_the_reference() {
    run_random(false, 40, 2);
}

#[test]
fn long_decode_context_splits_into_chunks() {
    for (dtype, cache_dtype, page_size) in [(DType::F32, DType::F32, 16), (DType::BF16, DType::BF16, 7)] {
        let case = Case {
            dtype,
            cache_dtype,
            batch: 2,
            seq: 1,
            num_heads: 8,
            num_kv_heads: 2,
            head_size: 128,
            page_size,
            num_layers: 1,
            layer: 0,
            scale_granularity: None,
            cache_lengths: vec![2100, 700],
            valid_lengths: vec![1, 1],
            mask: Mask::Causal,
            window: None,
            scale: 1.0 / 128f32.sqrt(),
            seed: 7,
            tier: common::default_tier(),
        };
        let got = run_jit(&jit(&case), &case, 2);
        check_against_reference(&case, &got);
    }
}

/// Llama-3-8B heads (GQA 4, 8 KV heads, D 128, page 16): decode split
/// into key chunks over the pool (B 1) or not (B 3, uneven lengths), blocks
/// with padded tails, both cache dtypes; and a causal prefill spanning
/// several query blocks and a sliding window.
#[test]
fn llama_shapes_match_the_reference() {
    let llama = |cache_dtype: DType, seq: usize, cache_lengths: Vec<u32>, valid: u32, window: Option<usize>| Case {
        dtype: DType::BF16,
        cache_dtype,
        batch: cache_lengths.len(),
        seq,
        num_heads: 32,
        num_kv_heads: 8,
        head_size: 128,
        page_size: 16,
        num_layers: 2,
        layer: 1,
        scale_granularity: None,
        valid_lengths: vec![valid; cache_lengths.len()],
        cache_lengths,
        mask: Mask::Causal,
        window,
        scale: 1.0 / 128f32.sqrt(),
        seed: 11,
        tier: common::default_tier(),
    };
    for cache_dtype in [DType::BF16, DType::F32] {
        for (case, threads) in [
            (llama(cache_dtype, 1, vec![1229], 1, None), 2),
            (llama(cache_dtype, 1, vec![1229], 1, None), 5),
            (llama(cache_dtype, 1, vec![300, 0, 77], 1, None), 2),
            (llama(cache_dtype, 19, vec![45], 19, None), 2),
            (llama(cache_dtype, 12, vec![70, 3], 11, Some(37)), 3),
        ] {
            let got = run_jit(&jit(&case), &case, threads);
            check_against_reference(&case, &got);
        }
    }
}

/// Bit-identical outputs on pools of 1, 2, 3 and 5 threads: random short
/// calls, and contexts long enough to be cut into many key chunks (3001 to
/// 4500 keys; decode at B 1 and 2, prefill over several query blocks;
/// f32, bf16 and FP8 caches), each long case also against the reference.
#[test]
fn results_do_not_depend_on_the_thread_count() {
    let mut rng = StdRng::seed_from_u64(3);
    for decode in [true, false] {
        for _ in 0..4 {
            let case = Case::random(&mut rng, decode);
            assert_same_bits_on_every_pool(&jit(&case), &case);
        }
    }
    let long = |cache_dtype: DType, seq: usize, cache_lengths: Vec<u32>, valid_lengths: Vec<u32>| Case {
        dtype: if cache_dtype == DType::F32 { DType::F32 } else { DType::BF16 },
        cache_dtype,
        batch: cache_lengths.len(),
        seq,
        num_heads: 8,
        num_kv_heads: 2,
        head_size: 32,
        page_size: 16,
        num_layers: 1,
        layer: 0,
        scale_granularity: (cache_dtype == DType::F8E4M3).then_some(16),
        cache_lengths,
        valid_lengths,
        mask: Mask::Causal,
        window: None,
        scale: 0.25,
        seed: 5,
        tier: common::default_tier(),
    };
    for cache_dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
        for case in [
            long(cache_dtype, 1, vec![3000], vec![1]),
            long(cache_dtype, 1, vec![4500, 2999], vec![1, 1]),
            long(cache_dtype, 9, vec![2992], vec![9]),
            long(cache_dtype, 12, vec![3001, 4000], vec![12, 5]),
        ] {
            let got = assert_same_bits_on_every_pool(&jit(&case), &case);
            check_against_reference(&case, &got);
        }
    }
}

#[test]
fn empty_batches_and_zero_lengths() {
    let mut rng = StdRng::seed_from_u64(4);
    let mut case = Case::random(&mut rng, false);
    case.valid_lengths.iter_mut().for_each(|v| *v = 0);
    let got = run_jit(&jit(&case), &case, 2);
    assert!(got.iter().all(|x| x.to_bits() == 0), "all rows padded: all zero");
    // Cache length 0 and one token: the output is that token's V.
    case.cache_lengths.iter_mut().for_each(|c| *c = 0);
    case.valid_lengths.iter_mut().for_each(|v| *v = 1);
    let got = run_jit(&jit(&case), &case, 2);
    check_against_reference(&case, &got);
}

/// Key positions past 2³¹, up to u32::MAX (a sliding window keeps the keys
/// read few; only their pages are assigned, so the caches stay small): the
/// JIT gives the reference's answer — key ranges straddling 2³¹ or ending
/// at it, near the top of u32, decode and prefill, both masks, bf16 and FP8
/// caches, 1 and 3 threads.
#[test]
fn positions_past_2_31_match_the_reference() {
    const TWO_31: u32 = 1 << 31;
    let case = |cache_dtype: DType, seq: usize, cache_lengths: Vec<u32>, valid_lengths: Vec<u32>, window: usize| Case {
        dtype: DType::BF16,
        cache_dtype,
        batch: cache_lengths.len(),
        seq,
        num_heads: 4,
        num_kv_heads: 2,
        head_size: 16,
        page_size: 4096,
        num_layers: 1,
        layer: 0,
        scale_granularity: (cache_dtype == DType::F8E4M3).then_some(8),
        cache_lengths,
        valid_lengths,
        mask: Mask::Causal,
        window: Some(window),
        scale: 0.3,
        seed: 9,
        tier: common::default_tier(),
    };
    for cache_dtype in [DType::BF16, DType::F8E4M3] {
        for case in [
            case(cache_dtype, 8, vec![TWO_31 - 4], vec![8], 300),
            case(cache_dtype, 1, vec![TWO_31 - 1], vec![1], 200),
            case(cache_dtype, 1, vec![TWO_31 + 100, u32::MAX - 1], vec![1, 1], 1000),
            Case { mask: Mask::Null, ..case(cache_dtype, 6, vec![u32::MAX - 6, TWO_31 - 3], vec![6, 4], 37) },
        ] {
            let (inputs, cache) = case.windowed_inputs();
            let kernel = jit(&case);
            for threads in [1, 3] {
                let got = run_jit_on(&kernel, &case, &inputs, &cache, threads);
                check_against_reference_on(&case, &inputs, &cache, &got);
            }
        }
    }
}
