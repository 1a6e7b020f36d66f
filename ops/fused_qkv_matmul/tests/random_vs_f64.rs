//! Random cases against an independent naive f64 reference written here,
//! straight from the op contract: `C = X·Wᵀ` in f64 from the (already
//! rounded) inputs, then Q to `output` for every row and K/V scattered into
//! the paged cache for valid tokens only.
//!
//! Before each call the output and the whole cache are poisoned with NaN.
//! Afterwards every output element must be finite and close to the
//! reference (within [`Tolerance::AgainstExact`]), every cache element the
//! contract writes must be close to the reference, and every other cache
//! byte must still be the poisoned byte.

use std::collections::HashMap;

use kvjit_core::{Backend, CacheElement, CodeTier, DType, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{FusedQkvSpec, ReferenceKernel, Sizes, reference::fused_qkv_matmul};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::tolerance::to_f64;
use kvjit_testkit::values::uniform_nonzero;
use kvjit_testkit::{Expect, Tolerance, assert_cache, block_index, poison_all, u32s};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Random cases per activation dtype (cache dtypes cycle through all three).
const CASES_PER_DTYPE: u64 = 300;

const DIMS_K: &[usize] = &[1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33, 48];
const DIMS_D: &[usize] = &[1, 3, 8, 16];
const PAGE_SIZES: &[usize] = &[1, 2, 3, 4, 5, 6, 7, 8, 16];

/// The drawn shape of one random case.
#[derive(Clone, Debug)]
struct Draw {
    seed: u64,
    dtype: DType,
    cache_dtype: DType,
    batch: usize,
    seq: usize,
    k: usize,
    q_dim: usize,
    hkv: usize,
    d: usize,
    page_size: usize,
    layers: usize,
    layer: usize,
    num_pages: usize,
    max_pages: usize,
    cache_lengths: Vec<u32>,
    valid: Vec<u32>,
    /// Tokens reserved per sequence for this step (valid or the full S).
    reserved: Vec<u32>,
    via_kernel: bool,
}

impl Draw {
    fn new(seed: u64, dtype: DType, cache_dtype: DType) -> (Self, StdRng) {
        let mut rng = StdRng::seed_from_u64(seed);
        let batch = rng.gen_range(1..=4);
        let seq = rng.gen_range(1..=9);
        let hkv = rng.gen_range(1..=4);
        let d = *DIMS_D.choose(&mut rng).unwrap();
        let q_heads = hkv * rng.gen_range(1..=3);
        let page_size = *PAGE_SIZES.choose(&mut rng).unwrap();
        let layers = rng.gen_range(1..=3);
        let cache_lengths: Vec<u32> = (0..batch).map(|_| rng.gen_range(0..=20)).collect();
        // Valid lengths anywhere in 0..=S, with 0 and S each drawn often.
        let valid: Vec<u32> = (0..batch)
            .map(|_| match rng.gen_range(0..4) {
                0 => 0,
                1 => seq as u32,
                _ => rng.gen_range(0..=seq as u32),
            })
            .collect();
        let reserve_padded = rng.gen_bool(0.5);
        let reserved = if reserve_padded { vec![seq as u32; batch] } else { valid.clone() };
        let longest = cache_lengths.iter().map(|&c| c as usize).max().unwrap() + seq;
        let max_pages = longest.div_ceil(page_size) + rng.gen_range(0..=1);
        let pages_needed: usize = cache_lengths
            .iter()
            .zip(&reserved)
            .map(|(&c, &r)| (c + r) as usize)
            .map(|tokens| tokens.div_ceil(page_size))
            .sum();
        let draw = Self {
            seed,
            dtype,
            cache_dtype,
            batch,
            seq,
            k: *DIMS_K.choose(&mut rng).unwrap(),
            q_dim: q_heads * d,
            hkv,
            d,
            page_size,
            layers,
            layer: rng.gen_range(0..layers),
            num_pages: (pages_needed + rng.gen_range(0..=3)).max(1),
            max_pages,
            cache_lengths,
            valid,
            reserved,
            via_kernel: rng.gen_bool(0.5),
        };
        (draw, rng)
    }

    fn kv_dim(&self) -> usize {
        self.hkv * self.d
    }

    fn n(&self) -> usize {
        self.q_dim + 2 * self.kv_dim()
    }

    fn blocks_shape(&self) -> [usize; 6] {
        [self.num_pages, 2, self.layers, self.page_size, self.hkv, self.d]
    }

    /// A cache whose pages are handed out in a shuffled order: first the
    /// already-cached tokens, then this step's reservation, so page tables
    /// are scattered and interleaved across sequences.
    fn cache(&self, rng: &mut StdRng) -> PagedKVCacheCollection {
        let params = KvCacheParams {
            element: CacheElement::new(self.cache_dtype, None).unwrap(),
            num_layers: self.layers,
            page_size: self.page_size,
            num_kv_heads: self.hkv,
            head_size: self.d,
        };
        let mut cache = PagedKVCacheCollection::new(params, self.num_pages, self.batch, self.max_pages).unwrap();
        let mut order: Vec<u32> = (0..self.num_pages as u32).collect();
        order.shuffle(rng);
        cache.set_allocation_order(order).unwrap();
        cache.reserve(&self.cache_lengths).unwrap();
        cache.advance(&self.cache_lengths).unwrap();
        cache.reserve(&self.reserved).unwrap();
        cache
    }
}

/// `C = X·Wᵀ` in f64 (`[rows, N]`) and `Σ_k |x·w|` per element, the scale of
/// the f32 accumulation error.
fn reference_c(x: &[f64], w: &[f64], k: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / k.max(1);
    let n = w.len() / k.max(1);
    let mut c = vec![0.0; rows * n];
    let mut abs = vec![0.0; rows * n];
    for r in 0..rows {
        for col in 0..n {
            for i in 0..k {
                let p = x[r * k + i] * w[col * k + i];
                c[r * n + col] += p;
                abs[r * n + col] += p.abs();
            }
        }
    }
    (c, abs)
}

fn run_case(seed: u64, dtype: DType, cache_dtype: DType) {
    let (draw, mut rng) = Draw::new(seed, dtype, cache_dtype);
    let ctx = format!("seed {:#x} ({} activations): {draw:?}", draw.seed, draw.dtype);
    let (b, s, k, n, q_dim) = (draw.batch, draw.seq, draw.k, draw.n(), draw.q_dim);
    let hidden = uniform_nonzero(&mut rng, dtype, &[b, s, k], 1e-3);
    let weight = uniform_nonzero(&mut rng, dtype, &[n, k], 1e-3);
    let mut cache = draw.cache(&mut rng);
    let mut output = Tensor::zeros(dtype, &[b, s, q_dim]).unwrap();
    let poisoned = poison_all(&mut output, &mut cache);
    let (lengths, table) = (cache.cache_lengths().to_vec(), cache.lookup_table().to_vec());
    let layer_idx = Tensor::scalar_u32(draw.layer as u32);
    let valid = u32s(&draw.valid);

    if draw.via_kernel {
        let spec = FusedQkvSpec {
            backend: Backend::Cpu(CodeTier::Cranelift),
            dtype,
            weights: dtype,
            cache: *cache.params(),
            k,
            q_dim,
            step: StepDims { batch: rng.gen_bool(0.5).then_some(b), seq: rng.gen_bool(0.5).then_some(s) },
            sizes: Sizes::Baked,
        };
        let kernel = Compiled::new(ReferenceKernel::new(spec));
        let inputs = [&hidden, &weight, &layer_idx, &valid];
        let specs = kernel.check(&inputs, &[&cache]).unwrap();
        assert_eq!(specs, vec![(dtype, vec![b, s, q_dim])], "{ctx}");
        let mut outputs = [output];
        let ctx_ptr = DeviceContextPtr::cpu(1).unwrap();
        kernel.run(&inputs, &mut [&mut cache], &mut outputs, &ctx_ptr).unwrap();
        [output] = outputs;
    } else {
        let shape = fused_qkv_matmul(&hidden, &weight, &mut cache, &layer_idx, &valid, &mut output).unwrap();
        let valid_sum: u32 = draw.valid.iter().sum();
        assert_eq!(shape.cache_tokens, valid_sum as usize, "{ctx}");
        assert_eq!(shape.output_shape(), vec![b, s, q_dim], "{ctx}");
    }
    assert_eq!(cache.cache_lengths(), lengths, "{ctx}: cache_lengths changed");
    assert_eq!(cache.lookup_table(), table, "{ctx}: lookup table changed");

    let (c, abs) = reference_c(&to_f64(&hidden), &to_f64(&weight), k);

    // Q: every row, padded or not.
    let out = output.to_f32_vec().unwrap();
    for r in 0..b * s {
        for col in 0..q_dim {
            let (want, got) = (c[r * n + col], out[r * q_dim + col]);
            let tol = Tolerance::AgainstExact { dtype, k, abs_sum: abs[r * n + col] }.bound(got.into(), want);
            assert!(
                got.is_finite() && (got as f64 - want).abs() <= tol,
                "{ctx}: output[row {r}, {col}] = {got}, want {want} ± {tol}"
            );
        }
    }

    // K/V: valid tokens only, at cache_lengths[b] + t through the page table.
    let shape = draw.blocks_shape();
    let mut expected = HashMap::new();
    for bi in 0..b {
        for t in 0..draw.valid[bi] as usize {
            let r = bi * s + t;
            let pos = lengths[bi] as usize + t;
            let page = table[bi * draw.max_pages + pos / draw.page_size] as usize;
            let slot = pos % draw.page_size;
            for kv in 0..2 {
                for h in 0..draw.hkv {
                    for d in 0..draw.d {
                        let col = q_dim + kv * draw.kv_dim() + h * draw.d + d;
                        let want = c[r * n + col];
                        let rule = Tolerance::AgainstExact { dtype: cache_dtype, k, abs_sum: abs[r * n + col] };
                        let tol = rule.bound(want, want);
                        let idx = block_index(&shape, [page, kv, draw.layer, slot, h, d]);
                        let dup = expected.insert(idx, Expect { value: want, tol });
                        assert!(dup.is_none(), "{ctx}: the test's page table collides");
                    }
                }
            }
        }
    }
    assert_cache(cache.blocks(), &poisoned, &expected, &ctx);
}

fn run_many(dtype: DType, base_seed: u64) {
    for i in 0..CASES_PER_DTYPE {
        let cache_dtype = DType::FLOATS[i as usize % 3];
        run_case(base_seed + i, dtype, cache_dtype);
    }
}

#[test]
fn random_f32_cases_match_the_f64_reference() {
    run_many(DType::F32, 0x0f32_0000);
}

#[test]
fn random_bf16_cases_match_the_f64_reference() {
    run_many(DType::BF16, 0xbf16_0000);
}

#[test]
fn random_f16_cases_match_the_f64_reference() {
    run_many(DType::F16, 0x0f16_0000);
}

#[test]
fn tolerances_are_tight_enough_to_tell_the_dtypes_apart() {
    // A value of 1 after one product: bf16 may be off by 2^-8, f16 by 2^-11
    // (plus the subnormal floor), f32 by 4·2^-24 only.
    let tol = |dtype| Tolerance::AgainstExact { dtype, k: 1, abs_sum: 1.0 }.bound(1.0, 1.0);
    assert!(tol(DType::F32) < 3e-7);
    assert!(tol(DType::F16) < 5e-4 && tol(DType::F16) > tol(DType::F32));
    assert!(tol(DType::BF16) < 4e-3 && tol(DType::BF16) > tol(DType::F16));
}
