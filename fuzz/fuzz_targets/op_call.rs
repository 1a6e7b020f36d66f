//! Fuzz target: the fused-QKV op's argument check, fed arbitrary shapes,
//! lengths and page tables (and at most one broken argument or spec).
//!
//! The input is decoded with `arbitrary` into a small [`Call`], and
//! checked by the same differential checker the property tests use
//! (`kvjit_testkit::fused_qkv::differential`): the verdict must
//! match an independent model of the contract; whatever passes is run
//! through the reference and the JIT kernel (output between canary guards,
//! cache with canary guard pages and NaN-poisoned slots) and must agree
//! within tolerance and write nothing else; whatever fails must leave output
//! and cache byte-identical.
//!
//! Sizes: B, S, lengths, page counts and tables range freely (small); the
//! dims a kernel bakes in (dtypes, K, q_dim, Hkv, D, page size, L, and B
//! and S when static) come from one of [`FAMILIES`] fixed draws, so at most
//! `FAMILIES × 4 × 11` kernel keys exist (static B/S or not, ten spec
//! tweaks) and each is compiled once and kept: a Cranelift compile costs
//! more than a hundred executions under the fuzzer's instrumentation, and new
//! keys would otherwise keep rewarding the fuzzer with new coverage inside
//! Cranelift instead of inside kvjit. The property tests draw kernel specs
//! freely.
#![no_main]

use arbitrary::Arbitrary;
use kvjit_core::{CpuTier, DType};
use kvjit_testkit::fused_qkv::differential::{self, Call, Entry, Page, Tweak, Values};
use libfuzzer_sys::fuzz_target;

/// The raw draw; every field is folded into a small range below.
#[derive(Arbitrary, Debug)]
struct Raw {
    seed: u8,
    family: u8,
    batch: u8,
    seq: u8,
    layer_idx: u32,
    inner_pages: u8,
    guards: u8,
    width: u8,
    flags: u8,
    kernel: u8,
    tweak: u8,
    tweak_axis: u8,
    entry: u8,
    cache_lengths: Vec<u32>,
    valid_lengths: Vec<u32>,
    table: Vec<u8>,
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Kernel families: (dtype, cache dtype, K, Hkv, D, q_dim, page size, L,
/// static B, static S).
const FAMILIES: usize = 32;

/// Family `i`, drawn from the full small ranges by a fixed hash of `i`.
#[allow(clippy::type_complexity, reason = "one tuple, destructured right away")]
fn family(i: usize) -> (DType, DType, usize, usize, usize, usize, usize, usize, usize, usize) {
    let mut h = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = |n: u64| {
        h ^= h >> 29;
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 32;
        (h % n) as usize
    };
    (
        DTYPES[next(3)],
        DTYPES[next(3)],
        next(19),
        1 + next(3),
        1 + next(6),
        1 + next(12),
        1 + next(5),
        1 + next(3),
        next(5),
        next(8),
    )
}

/// Small values mostly, anything now and then.
fn length(v: u32, common: u32) -> u32 {
    if v >> 28 == 0xF { v } else { v % common }
}

impl Raw {
    fn call(&self) -> Call {
        let (dtype, cache_dtype, k, num_kv_heads, head_size, q_dim, page_size, num_layers, static_b, static_s) =
            family(self.family as usize % FAMILIES);
        let static_batch = self.kernel & 0x06 == 0x06;
        let static_seq = self.kernel & 0x18 == 0x18;
        let inner_pages = self.inner_pages as usize % 13;
        Call {
            seed: self.seed as u64,
            dtype,
            cache_dtype,
            batch: if static_batch { static_b } else { self.batch as usize % 5 },
            seq: if static_seq { static_s } else { self.seq as usize % 8 },
            k,
            num_kv_heads,
            head_size,
            q_dim,
            page_size,
            num_layers,
            layer_idx: length(self.layer_idx, 4),
            inner_pages,
            guard_pages: (self.guards as usize % 3, (self.guards / 3) as usize % 3),
            max_pages_per_seq: self.width as usize % 7,
            cache_lengths: self.cache_lengths.iter().map(|&v| length(v, 2 * page_size as u32 + 4)).collect(),
            valid_lengths: self.valid_lengths.iter().map(|&v| length(v, 10)).collect(),
            lookup_table: self
                .table
                .iter()
                .map(|&e| match e {
                    0..=229 => Page::Inner(e as usize),
                    230..=244 => Page::Unassigned,
                    245..=254 => Page::Past((e - 245) as u32),
                    255 => Page::Past(u32::MAX - 1),
                })
                .collect(),
            values: match self.flags % 8 {
                0..=4 => Values::Uniform,
                5 | 6 => Values::Dyadic,
                _ => Values::Special,
            },
            tweak: if self.tweak < 128 {
                Tweak::None
            } else {
                Tweak::from_index(self.tweak as usize, self.tweak_axis as usize, self.tweak_axis & 4 != 0)
            },
            const_weight: self.kernel & 1 != 0,
            tier: if self.kernel & 0x20 != 0 { CpuTier::Avx2 } else { CpuTier::Cranelift },
            static_batch,
            static_seq,
            threads: 1 + (self.flags >> 6) as usize % 3,
            entry: if self.entry < 192 {
                Entry::RunInto { front: 1 + self.entry as usize % 17, back: 1 + (self.entry / 17) as usize % 17 }
            } else {
                Entry::Run
            },
        }
    }
}

fuzz_target!(
    init: {
        differential::keep_kernels(2048);
    },
    |raw: Raw| {
        differential::check(&raw.call());
    }
);
