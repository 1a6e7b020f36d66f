//! The 256-bit tier's decode micro-kernel (and the Cranelift tier on the
//! same calls) against the f64 reference: f32, bf16 and FP8 (E4M3) caches,
//! GQA groups 1, 4 and 8, head sizes 64 and 128, batch 1 (one sequence
//! split into many key chunks) and 8, contexts crossing several chunks and
//! page boundaries (odd page sizes), random inputs (never zeros); outputs
//! NaN-poisoned and guarded, bit-identical on pools of 1, 2, 3 and 5
//! threads.

mod common;

use common::{Case, assert_same_bits_on_every_pool, check_against_reference, jit, tiers};
use kvjit_core::{CodeTier, DType};
use kvjit_op_attention::Mask;
use kvjit_op_attention::cpu_jit::{MIN_CHUNK, runs_native};

fn decode_case(cache_dtype: DType, group: usize, head_size: usize, batch: usize, seed: u64) -> Case {
    // Batch 1: 2100 keys, ~8 chunks of MIN_CHUNK+ (FP8: ~4 of twice that); batch 8: uneven
    // lengths, a few chunks each, one sequence idle (valid 0).
    let cache_lengths: Vec<u32> = match batch {
        1 => vec![2100],
        _ => (0..batch as u32).map(|b| 131 + b * 197).collect(),
    };
    let valid_lengths: Vec<u32> = (0..batch).map(|b| u32::from(batch == 1 || b != 3)).collect();
    let granularity = (cache_dtype == DType::F8E4M3).then_some(if seed.is_multiple_of(2) { head_size } else { 32 });
    Case {
        dtype: if seed.is_multiple_of(3) { DType::F32 } else { DType::BF16 },
        cache_dtype,
        batch,
        seq: 1,
        num_heads: 2 * group,
        num_kv_heads: 2,
        head_size,
        page_size: [16, 7, 33][seed as usize % 3],
        num_layers: 2,
        layer: 1,
        scale_granularity: granularity,
        cache_lengths,
        valid_lengths,
        mask: Mask::Causal,
        window: None,
        scale: 1.0 / (head_size as f32).sqrt(),
        seed,
        tier: CodeTier::Cranelift,
    }
}

#[test]
fn avx2_decode_matches_the_reference_on_every_pool() {
    let mut seed = 100;
    let mut native = 0;
    for cache_dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
        for group in [1, 3, 4, 8] {
            for head_size in [64, 128] {
                for batch in [1, 8] {
                    seed += 1;
                    let base = decode_case(cache_dtype, group, head_size, batch, seed);
                    assert!(
                        base.cache_lengths.iter().any(|&c| c as usize > 3 * MIN_CHUNK),
                        "the contexts cross several chunks"
                    );
                    for tier in tiers() {
                        let case = Case { tier, ..base.clone() };
                        assert_eq!(runs_native(&case.spec()), tier == CodeTier::Avx2, "{case:?}");
                        native += usize::from(tier == CodeTier::Avx2);
                        let kernel = jit(&case);
                        let got = assert_same_bits_on_every_pool(&kernel, &case);
                        check_against_reference(&case, &got);
                    }
                }
            }
        }
    }
    if native == 0 {
        eprintln!("the 256-bit tier was not tested: this CPU has no AVX2/FMA/F16C");
    }
}

/// FP8 caches whose scale blocks split a 16-element pair (g = 8), fall on
/// its edges (g = 16) or cover a head (g = D), for D a multiple of 16 (codes
/// widened 16 at a time) and not (D = 40), on every pool and tier.
#[test]
fn avx2_decode_fp8_scale_blocks() {
    for tier in tiers() {
        for (head_size, granularity) in [(64, 8), (48, 16), (48, 48), (40, 8), (40, 40)] {
            let base = decode_case(DType::F8E4M3, 4, head_size, 8, 11);
            let case = Case { tier, scale_granularity: Some(granularity), ..base };
            assert_eq!(runs_native(&case.spec()), tier == CodeTier::Avx2, "{case:?}");
            let got = assert_same_bits_on_every_pool(&jit(&case), &case);
            check_against_reference(&case, &got);
        }
    }
}

/// Decode on the 256-bit tier with a sliding window, the null mask and
/// head sizes that are multiples of 8 but not of 16 (D = 24, 40: bf16 then
/// widens 8 elements at a time instead of in 16-element pairs).
#[test]
fn avx2_decode_windows_and_odd_heads() {
    for tier in tiers() {
        for (cache_dtype, head_size, window) in [
            (DType::BF16, 64, Some(300)),
            (DType::F8E4M3, 128, Some(129)),
            (DType::F32, 24, None),
            (DType::BF16, 40, None),
            (DType::BF16, 24, Some(200)),
        ] {
            let base = decode_case(cache_dtype, 4, head_size, 8, 7);
            let case = Case { tier, window, mask: Mask::Null, ..base };
            let native = tier == CodeTier::Avx2 && head_size.is_multiple_of(8);
            assert_eq!(runs_native(&case.spec()), native, "{case:?}");
            let got = assert_same_bits_on_every_pool(&jit(&case), &case);
            check_against_reference(&case, &got);
        }
    }
}

/// Short batch-1 decodes, cut into chunks of a block or a few (MIN_ITEMS
/// items where the keys allow), GQA group 3 as SmolLM2's: every chunk's
/// partial merged, on every pool and tier, against the reference.
#[test]
fn short_decodes_split_into_block_chunks() {
    let mut seed = 300;
    for tier in tiers() {
        for cache_dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
            for context in [1, 31, 100, 300] {
                seed += 1;
                let base = decode_case(cache_dtype, 3, 64, 1, seed);
                let case = Case { tier, cache_lengths: vec![context], ..base };
                let got = assert_same_bits_on_every_pool(&jit(&case), &case);
                check_against_reference(&case, &got);
            }
        }
    }
}
