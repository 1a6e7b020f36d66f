//! Property tests: the JIT kernel against the reference implementation on
//! random shapes, dtypes, page sizes, cache and valid lengths and page
//! tables, every run inside guarded, poisoned buffers (see
//! [`kvjit_testkit::fused_qkv::differential`] for exactly what each case
//! asserts).
//!
//! Two generators:
//! - [`valid_problem`]: valid calls (scattered page tables from a shuffled
//!   page pool; padded-only pages unassigned, aliased or out of range), so
//!   nearly every case compares a JIT run with a reference run;
//! - [`any_problem`]: anything — random page tables (unassigned, out of
//!   range, colliding), lengths up to `u32::MAX`, and at most one broken
//!   shape, dtype, layout or spec — where the verdict must match an
//!   independent model of the contract and a rejected call must leave every
//!   buffer byte-identical.
//!
//! Each runs [`DEFAULT_CASES`] cases (a few seconds in the test profile);
//! `KVJIT_PROPTEST_CASES=N` runs N of each instead. Failures are shrunk
//! (no regression files are written); shrunk failures become named tests at
//! the end of this file.

use kvjit_core::{CpuTier, DType};
use kvjit_testkit::fused_qkv::differential::{Call, Entry, Page, SpecTweak, Tweak, Values, check};
use proptest::prelude::*;
use proptest::test_runner::Config;

/// Cases per property when `KVJIT_PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 256;

fn config() -> Config {
    let cases = std::env::var("KVJIT_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    Config { cases, failure_persistence: None, ..Config::default() }
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
}

fn values() -> impl Strategy<Value = Values> {
    prop_oneof![4 => Just(Values::Uniform), 1 => Just(Values::Dyadic), 1 => Just(Values::Special)]
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        3 => (1usize..=24, 1usize..=24).prop_map(|(front, back)| Entry::RunInto { front, back }),
        1 => Just(Entry::Run),
    ]
}

/// Sizes: (B, S, K, Hkv, D, q_dim, page_size, L). K reaches past the
/// micro-kernel's unroll and B·S past one row block (64) now and then.
fn sizes() -> impl Strategy<Value = (usize, usize, usize, usize, usize, usize, usize, usize)> {
    let k = prop_oneof![6 => 0usize..=20, 1 => 21usize..=140];
    let batch_seq = prop_oneof![6 => (0usize..=4, 0usize..=9), 1 => (1usize..=2, 30usize..=70)];
    (batch_seq, k, 1usize..=3, 1usize..=9, 1usize..=24, 1usize..=8, 1usize..=3)
        .prop_map(|((b, s), k, hkv, d, q, ps, l)| (b, s, k, hkv, d, q, ps, l))
}

/// Kernel flavour: (const weight, static B, static S, threads).
fn flavour() -> impl Strategy<Value = (bool, bool, bool, usize)> {
    (any::<bool>(), any::<bool>(), any::<bool>(), 1usize..=3)
}

/// Valid calls with scattered page tables.
fn valid_problem() -> impl Strategy<Value = Call> {
    (sizes(), dtype(), dtype(), any::<u64>(), values(), entry(), flavour()).prop_flat_map(
        |((b, s, k, hkv, d, q, ps, l), dt, cdt, seed, values, entry, flavour)| {
            let lengths = proptest::collection::vec((0u32..=(2 * ps as u32 + 3), 0u32..=s as u32), b);
            let extra = (0usize..=2, (0usize..=2, 0usize..=2), 0usize..=2, 0usize..3, 0u32..l as u32);
            (lengths, extra).prop_flat_map(move |(lengths, (extra_pages, guards, extra_width, padded, layer))| {
                let need: Vec<usize> = lengths.iter().map(|&(c, v)| (c + v) as usize).map(|t| t.div_ceil(ps)).collect();
                let span: Vec<usize> = lengths.iter().map(|&(c, _)| (c as usize + s).div_ceil(ps)).collect();
                let width = span.iter().copied().max().unwrap_or(0) + extra_width;
                let inner = need.iter().sum::<usize>() + extra_pages;
                let pool = Just((0..inner).collect::<Vec<usize>>()).prop_shuffle();
                let lengths = lengths.clone();
                pool.prop_map(move |pool| {
                    let mut table = vec![Page::Unassigned; b * width];
                    let mut next = pool.iter().copied();
                    for (bi, &n) in need.iter().enumerate() {
                        for l in 0..n {
                            table[bi * width + l] = Page::Inner(next.next().expect("enough pages"));
                        }
                        for l in n..span[bi] {
                            table[bi * width + l] = match padded {
                                0 => Page::Unassigned,
                                1 if !pool.is_empty() => Page::Inner(pool[(bi + l) % pool.len()]),
                                1 => Page::Unassigned,
                                _ => Page::Past(l as u32),
                            };
                        }
                    }
                    let (const_weight, static_batch, static_seq, threads) = flavour;
                    Call {
                        seed,
                        tier: if seed % 2 == 0 { CpuTier::Cranelift } else { CpuTier::Avx2 },
                        dtype: dt,
                        cache_dtype: cdt,
                        batch: b,
                        seq: s,
                        k,
                        num_kv_heads: hkv,
                        head_size: d,
                        q_dim: q,
                        page_size: ps,
                        num_layers: l,
                        layer_idx: layer,
                        inner_pages: inner,
                        guard_pages: guards,
                        max_pages_per_seq: width,
                        cache_lengths: lengths.iter().map(|&(c, _)| c).collect(),
                        lookup_table: table,
                        valid_lengths: lengths.iter().map(|&(_, v)| v).collect(),
                        values,
                        tweak: Tweak::None,
                        const_weight,
                        static_batch,
                        static_seq,
                        threads,
                        entry,
                    }
                })
            })
        },
    )
}

fn page_entry() -> impl Strategy<Value = Page> {
    prop_oneof![
        8 => (0usize..16).prop_map(Page::Inner),
        1 => Just(Page::Unassigned),
        1 => prop_oneof![0u32..3, Just(u32::MAX - 1)].prop_map(Page::Past),
    ]
}

fn length(common: u32) -> impl Strategy<Value = u32> {
    prop_oneof![12 => 0..common, 1 => Just(u32::MAX), 1 => any::<u32>()]
}

fn tweak() -> impl Strategy<Value = Tweak> {
    prop_oneof![
        3 => Just(Tweak::None),
        2 => (1..Tweak::COUNT, 0usize..3, any::<bool>()).prop_map(|(i, axis, grow)| Tweak::from_index(i, axis, grow)),
    ]
}

/// Anything: random tables and lengths, and at most one broken argument.
fn any_problem() -> impl Strategy<Value = Call> {
    let tables = (
        proptest::collection::vec(length(12), 0..=5),
        proptest::collection::vec(page_entry(), 0..=24),
        proptest::collection::vec(length(10), 0..=5),
        0usize..=12,
        (0usize..=2, 0usize..=2),
        0usize..=5,
        prop_oneof![6 => 0u32..4, 1 => any::<u32>()],
    );
    (sizes(), dtype(), dtype(), any::<u64>(), values(), entry(), flavour(), tweak(), tables).prop_map(
        |((b, s, k, hkv, d, q, ps, l), dt, cdt, seed, values, entry, flavour, tweak, tables)| {
            let (cache_lengths, lookup_table, valid_lengths, inner, guards, width, layer) = tables;
            let (const_weight, static_batch, static_seq, threads) = flavour;
            Call {
                seed,
                tier: if seed % 2 == 0 { CpuTier::Cranelift } else { CpuTier::Avx2 },
                dtype: dt,
                cache_dtype: cdt,
                batch: b,
                seq: s,
                k,
                num_kv_heads: hkv,
                head_size: d,
                q_dim: q,
                page_size: ps,
                num_layers: l,
                layer_idx: layer,
                inner_pages: inner,
                guard_pages: guards,
                max_pages_per_seq: width,
                cache_lengths,
                lookup_table,
                valid_lengths,
                values,
                tweak,
                const_weight,
                static_batch,
                static_seq,
                threads,
                entry,
            }
        },
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn valid_calls_match_the_reference_inside_guards(p in valid_problem()) {
        check(&p);
    }

    #[test]
    fn any_call_is_judged_like_the_model_and_rejected_calls_write_nothing(p in any_problem()) {
        check(&p);
    }
}

// ---------------------------------------------------------------------------
// Named cases (shrunk failures of the properties above go here)
// ---------------------------------------------------------------------------

/// The smallest valid call the generators make, as a base for named cases.
fn base() -> Call {
    Call {
        seed: 0,
        dtype: DType::F32,
        cache_dtype: DType::F32,
        batch: 1,
        seq: 1,
        k: 1,
        num_kv_heads: 1,
        head_size: 1,
        q_dim: 1,
        page_size: 1,
        num_layers: 1,
        layer_idx: 0,
        inner_pages: 1,
        guard_pages: (1, 1),
        max_pages_per_seq: 1,
        cache_lengths: vec![0],
        lookup_table: vec![Page::Inner(0)],
        valid_lengths: vec![1],
        values: Values::Uniform,
        tweak: Tweak::None,
        const_weight: false,
        static_batch: false,
        static_seq: false,
        threads: 1,
        entry: Entry::RunInto { front: 1, back: 1 },
        tier: CpuTier::Cranelift,
    }
}

#[test]
fn the_base_case_and_each_tweak_of_it() {
    for i in 0..Tweak::COUNT {
        for (axis, grow) in [(0, true), (1, false), (2, true)] {
            for entry in [Entry::RunInto { front: 3, back: 5 }, Entry::Run] {
                check(&Call {
                    batch: 2,
                    seq: 3,
                    k: 5,
                    inner_pages: 4,
                    max_pages_per_seq: 2,
                    page_size: 2,
                    cache_lengths: vec![1, 0],
                    valid_lengths: vec![3, 2],
                    lookup_table: vec![Page::Inner(0), Page::Inner(1), Page::Inner(2), Page::Unassigned],
                    tweak: Tweak::from_index(i, axis, grow),
                    entry,
                    ..base()
                });
            }
        }
    }
}

#[test]
fn special_values_propagate_alike_in_every_dtype_pair() {
    for dtype in DType::FLOATS {
        for cache_dtype in DType::FLOATS {
            for seed in 0..4 {
                check(&Call {
                    seed,
                    dtype,
                    cache_dtype,
                    batch: 2,
                    seq: 4,
                    k: 9,
                    num_kv_heads: 2,
                    head_size: 3,
                    q_dim: 5,
                    page_size: 3,
                    inner_pages: 4,
                    max_pages_per_seq: 2,
                    cache_lengths: vec![2, 0],
                    valid_lengths: vec![4, 3],
                    lookup_table: vec![Page::Inner(3), Page::Inner(1), Page::Inner(0), Page::Inner(2)],
                    values: Values::Special,
                    ..base()
                });
            }
        }
    }
}

#[test]
fn spec_tweaks_are_all_refused_by_the_jit() {
    // Every spec tweak is a mismatch for the base case (B = S = 1 static or not).
    for t in SpecTweak::ALL {
        check(&Call { tweak: Tweak::Spec(t), ..base() });
        check(&Call { tweak: Tweak::Spec(t), entry: Entry::Run, ..base() });
    }
}
