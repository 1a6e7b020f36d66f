//! The JIT kernel against the f64 reference (and both against an
//! independent model of the contract): random shapes over every dtype pair,
//! both layouts, the head sizes, GQA ratios, page sizes 1..256,
//! contexts crossing pages, zero cache and valid lengths; outputs poisoned
//! with NaN between canary guards; the whole cache checked element by
//! element (only this step's valid K slots of the given layer may change).

mod common;

use common::{Case, assert_matches, draw, jit_kernel, run_jit, run_reference};
use kvjit_core::DType;
use kvjit_runtime::DeviceContextPtr;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn check(case: &Case, threads: usize) {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let call = case.build(&mut rng);
    let reference = run_reference(case, &call);
    let kernel = jit_kernel(case);
    let jit = run_jit(case, &call, &kernel, &DeviceContextPtr::cpu(threads).unwrap());
    assert_matches(case, &call, &jit, &reference);
}

fn cases() -> usize {
    std::env::var("KVJIT_ROPE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(120)
}

#[test]
fn random_cases_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0001);
    let mut seen = std::collections::HashSet::new();
    for i in 0..cases() {
        let case = draw(&mut rng);
        seen.insert((case.dtype, case.cache_dtype, case.interleaved));
        check(&case, 1 + i % 2);
    }
    assert_eq!(seen.len(), 18, "every dtype pair in both layouts");
}

#[test]
fn every_dtype_pair_and_layout_on_a_fixed_shape() {
    for dtype in DType::FLOATS {
        for cache_dtype in DType::FLOATS {
            for interleaved in [false, true] {
                for d in [8, 24, 64, 72, 80, 128, 256] {
                    let case = Case { d, ..Case::base(dtype, cache_dtype, interleaved) };
                    check(&case, 2);
                }
            }
        }
    }
}

#[test]
fn contexts_crossing_pages_and_empty_sequences() {
    for interleaved in [false, true] {
        // Sequence 0 starts mid-page and crosses two page boundaries;
        // sequence 1 has no valid tokens; sequence 2 starts at 0.
        let case = Case {
            batch: 3,
            seq: 7,
            hq: 8,
            hkv: 2,
            d: 64,
            page_size: 3,
            layers: 3,
            layer: 2,
            cache_lengths: vec![2, 5, 0],
            valid: vec![7, 0, 4],
            ..Case::base(DType::BF16, DType::F16, interleaved)
        };
        check(&case, 2);
        // Nothing valid at all: the output is all zero, the cache unchanged.
        let empty = Case { valid: vec![0, 0, 0], extra_positions: 0, ..case.clone() };
        check(&empty, 2);
        // Page size 1 (every token its own page) and 256 (all in one).
        for page_size in [1, 256] {
            check(&Case { page_size, ..case.clone() }, 1);
        }
    }
}

/// A batch of no sequences and a step of no tokens are no-ops: nothing
/// written, on every dtype pair and layout, with 1 and 3 threads.
#[test]
fn empty_batch_and_empty_step() {
    for dtype in DType::FLOATS {
        for cache_dtype in DType::FLOATS {
            for interleaved in [false, true] {
                let base = Case::base(dtype, cache_dtype, interleaved);
                let no_sequences = Case { batch: 0, cache_lengths: vec![], valid: vec![], ..base.clone() };
                let no_tokens = Case { batch: 2, seq: 0, cache_lengths: vec![3, 0], valid: vec![0, 0], ..base };
                for threads in [1, 3] {
                    check(&no_sequences, threads);
                    check(&no_tokens, threads);
                }
            }
        }
    }
}

#[test]
fn any_thread_count_gives_identical_bytes() {
    let case = Case {
        batch: 3,
        seq: 5,
        hq: 8,
        hkv: 4,
        d: 128,
        page_size: 4,
        cache_lengths: vec![3, 0, 9],
        valid: vec![5, 2, 4],
        ..Case::base(DType::F16, DType::BF16, false)
    };
    let mut rng = StdRng::seed_from_u64(3);
    let call = case.build(&mut rng);
    let kernel = jit_kernel(&case);
    let one = run_jit(&case, &call, &kernel, &DeviceContextPtr::cpu(1).unwrap());
    for threads in [2, 3, 8] {
        let many = run_jit(&case, &call, &kernel, &DeviceContextPtr::cpu(threads).unwrap());
        assert!(one.output == many.output, "{threads} threads: output");
        assert!(one.cache.blocks().as_bytes() == many.cache.blocks().as_bytes(), "{threads} threads: cache");
    }
}
