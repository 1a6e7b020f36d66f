//! The fused op writing an FP8 (`f8e4m3`) cache: the JIT kernel against
//! the reference, on every CPU tier, specialized, generic and
//! unspecialized, with any thread count.
//!
//! Every run starts from a poisoned cache (every code the NaN code 0x7f,
//! every scale NaN) whose first and last pages are never handed out, and
//! writes its output between guard regions. Afterwards the guards are
//! intact, and exactly the codes and scales of the valid tokens' K/V
//! changed: every other byte and scale still holds its poison.
//!
//! - **Dyadic inputs** make every matmul sum exact in f32 whatever the
//!   order, so the JIT and the reference quantize the same values: codes,
//!   scales and output must be identical bit for bit.
//! - **Uniform inputs** check accuracy against f64: every dequantized K/V
//!   element is within half an E4M3 step of its block's scale of the exact
//!   value, plus the f32 accumulation error (twice: once in the value, once
//!   through the scale it was divided by).

use std::collections::HashSet;
use std::sync::LazyLock;

use kvjit_core::fp8::{E4M3_MAX, e4m3_from_f32, e4m3_to_f32};
use kvjit_core::{Backend, CacheElement, CpuTier, DType, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_jit::CaptureText;
use kvjit_jit::microkernel::resolve_tier;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{FusedQkvSpec, JitKernel, QkvArgs, Sizes, reference};
use kvjit_runtime::DeviceContextPtr;
use kvjit_testkit::values::{dyadic, uniform_nonzero};
use kvjit_testkit::{Guarded, nan_bytes, poison};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const THREADS: [usize; 2] = [1, 3];

static CONTEXTS: LazyLock<Vec<DeviceContextPtr>> =
    LazyLock::new(|| THREADS.iter().map(|&t| DeviceContextPtr::cpu(t).unwrap()).collect());

/// Which kernel a case builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    /// B and S baked in.
    Specialized,
    /// B and S read at run time.
    Generic,
    /// Only the dtypes baked in (avx2 tier).
    Unspecialized,
}

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    dtype: DType,
    tier: CpuTier,
    build: Build,
    threads: usize,
    batch: usize,
    seq: usize,
    k: usize,
    q_dim: usize,
    num_kv_heads: usize,
    head_size: usize,
    granularity: usize,
    page_size: usize,
    num_layers: usize,
    layer: u32,
    history: Vec<u32>,
    valid: Vec<u32>,
    /// Dyadic inputs (exact sums) rather than uniform ones.
    exact: bool,
}

impl Case {
    fn spec(&self) -> FusedQkvSpec {
        let static_dims = self.build == Build::Specialized;
        FusedQkvSpec {
            backend: Backend::Cpu(resolve_tier(self.tier).unwrap()),
            dtype: self.dtype,
            weights: self.dtype,
            cache: KvCacheParams {
                element: CacheElement::F8E4M3 { scale_granularity: self.granularity },
                num_layers: self.num_layers,
                page_size: self.page_size,
                num_kv_heads: self.num_kv_heads,
                head_size: self.head_size,
            },
            k: self.k,
            q_dim: self.q_dim,
            step: StepDims { batch: static_dims.then_some(self.batch), seq: static_dims.then_some(self.seq) },
            sizes: Sizes::Baked,
        }
    }

    fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_size
    }

    fn n(&self) -> usize {
        self.q_dim + 2 * self.kv_dim()
    }
}

/// The inputs and the poisoned cache of a case.
struct Prepared {
    hidden: Tensor,
    weight: Tensor,
    layer: Tensor,
    valid: Tensor,
    cache: PagedKVCacheCollection,
}

fn prepare(case: &Case) -> Prepared {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let (x_shape, w_shape) = ([case.batch, case.seq, case.k], [case.n(), case.k]);
    let (hidden, weight) = if case.exact {
        (dyadic(&mut rng, case.dtype, &x_shape, 8), dyadic(&mut rng, case.dtype, &w_shape, 8))
    } else {
        (uniform_nonzero(&mut rng, case.dtype, &x_shape, 1e-3), uniform_nonzero(&mut rng, case.dtype, &w_shape, 1e-3))
    };
    let params = KvCacheParams {
        element: CacheElement::F8E4M3 { scale_granularity: case.granularity },
        num_layers: case.num_layers,
        page_size: case.page_size,
        num_kv_heads: case.num_kv_heads,
        head_size: case.head_size,
    };
    let pages_per_seq = (case.seq + 2 * case.page_size).div_ceil(case.page_size) + 1;
    // Two guard pages (first and last) that are never handed out.
    let num_pages = case.batch * pages_per_seq + 2;
    let mut cache = PagedKVCacheCollection::new(params, num_pages, case.batch, pages_per_seq).unwrap();
    let mut order: Vec<u32> = (1..num_pages as u32 - 1).collect();
    order.shuffle(&mut rng);
    order.extend([0, num_pages as u32 - 1]);
    cache.set_allocation_order(order).unwrap();
    cache.reserve(&case.history).unwrap();
    cache.advance(&case.history).unwrap();
    cache.reserve(&case.valid).unwrap();
    cache.fill_blocks_f32(f32::NAN).unwrap();
    cache.fill_scales(f32::NAN).unwrap();
    Prepared {
        hidden,
        weight,
        layer: Tensor::scalar_u32(case.layer),
        valid: Tensor::from_vec(&[case.batch], case.valid.clone()).unwrap(),
        cache,
    }
}

/// The cache after the call, and the output's bytes.
struct Ran {
    cache: PagedKVCacheCollection,
    output: Vec<u8>,
}

fn run_reference(prep: &Prepared) -> Ran {
    let mut cache = prep.cache.clone();
    let shape = [prep.hidden.shape()[0], prep.hidden.shape()[1], 0];
    let q_dim = prep.weight.shape()[0] - 2 * cache.params().kv_dim();
    let mut output = Tensor::zeros(prep.hidden.dtype(), &[shape[0], shape[1], q_dim]).unwrap();
    poison(&mut output);
    reference::fused_qkv_matmul(&prep.hidden, &prep.weight, &mut cache, &prep.layer, &prep.valid, &mut output).unwrap();
    Ran { cache, output: output.as_bytes().to_vec() }
}

fn kernel(case: &Case, weight: &Tensor) -> JitKernel {
    let weight = Some(std::sync::Arc::new(weight.clone()));
    match case.build {
        Build::Unspecialized => JitKernel::unspecialized(case.spec(), weight).unwrap(),
        _ => JitKernel::new(case.spec(), weight, CaptureText::default()).unwrap(),
    }
}

fn run_jit(case: &Case, prep: &Prepared) -> Ran {
    let kernel = kernel(case, &prep.weight);
    let mut cache = prep.cache.clone();
    let bytes = case.batch * case.seq * case.q_dim * case.dtype.size_bytes();
    let mut output = Guarded::new(64, &nan_bytes(case.dtype, bytes / case.dtype.size_bytes()), 64);
    let ctx = &CONTEXTS[THREADS.iter().position(|&t| t == case.threads).unwrap()];
    let args = QkvArgs {
        hidden_state: &prep.hidden,
        weight: &prep.weight,
        kv_collection: &mut cache,
        layer_idx: &prep.layer,
        valid_lengths: &prep.valid,
    };
    kernel.run_into(args, output.body_mut(), ctx).unwrap();
    output.assert_guards(&format!("{case:?}"));
    Ran { cache, output: output.body().to_vec() }
}

fn scales_of(cache: &PagedKVCacheCollection) -> Vec<f32> {
    cache.scales().unwrap().as_slice::<f32>().unwrap().to_vec()
}

/// Indices of the codes and scales a call must write: every valid token's K
/// and V, all heads, at its page slot.
fn written(case: &Case, cache: &PagedKVCacheCollection) -> (HashSet<usize>, HashSet<usize>) {
    let (mut codes, mut scales) = (HashSet::new(), HashSet::new());
    for (b, &v) in case.valid.iter().enumerate() {
        for t in 0..v as usize {
            let (page, slot) = cache.locate(b, case.history[b] as usize + t).unwrap();
            for kv in 0..2 {
                for head in 0..case.num_kv_heads {
                    for d in 0..case.head_size {
                        codes.insert(cache.element_offset(page as usize, kv, case.layer as usize, slot, head, d));
                    }
                    for block in 0..case.head_size / case.granularity {
                        scales.insert(cache.scale_offset(page as usize, kv, case.layer as usize, slot, head, block));
                    }
                }
            }
        }
    }
    (codes, scales)
}

/// Exactly the written codes and scales changed from their poison (NaN
/// code 0x7f, NaN scale); the written ones hold no NaN (finite inputs).
fn assert_only_written_changed(case: &Case, before: &PagedKVCacheCollection, after: &Ran, what: &str) {
    let (codes, scales) = written(case, before);
    for (i, &code) in after.cache.blocks().as_bytes().iter().enumerate() {
        let poisoned = before.blocks().as_bytes()[i];
        assert_eq!(poisoned, 0x7f, "the cache was poisoned");
        if codes.contains(&i) {
            assert_ne!(code & 0x7f, 0x7f, "{what}: code {i} was not written (or is NaN) in {case:?}");
        } else {
            assert_eq!(code, poisoned, "{what}: code {i} outside the written slots changed in {case:?}");
        }
    }
    for (i, &scale) in scales_of(&after.cache).iter().enumerate() {
        if scales.contains(&i) {
            assert!(scale.is_finite() && scale >= 0.0, "{what}: scale {i} = {scale} in {case:?}");
        } else {
            assert!(scale.is_nan(), "{what}: scale {i} outside the written slots changed to {scale} in {case:?}");
        }
    }
}

/// Exact f64 K/V of every written token, by code index.
fn exact_kv(case: &Case, prep: &Prepared) -> Vec<(usize, f64, usize)> {
    let x = prep.hidden.to_f32_vec().unwrap();
    let w = prep.weight.to_f32_vec().unwrap();
    let cache = &prep.cache;
    let mut out = Vec::new();
    for (b, &v) in case.valid.iter().enumerate() {
        for t in 0..v as usize {
            let r = b * case.seq + t;
            let (page, slot) = cache.locate(b, case.history[b] as usize + t).unwrap();
            for j in 0..2 * case.kv_dim() {
                let col = case.q_dim + j;
                let exact: f64 =
                    (0..case.k).map(|kk| f64::from(x[r * case.k + kk]) * f64::from(w[col * case.k + kk])).sum();
                let (kv, head, d) = (j / case.kv_dim(), (j % case.kv_dim()) / case.head_size, j % case.head_size);
                let at = cache.element_offset(page as usize, kv, case.layer as usize, slot, head, d);
                let scale_at =
                    cache.scale_offset(page as usize, kv, case.layer as usize, slot, head, d / case.granularity);
                out.push((at, exact, scale_at));
            }
        }
    }
    out
}

/// The spacing of E4M3 values around `|q|` (a scaled value, ≤ 448 give or
/// take rounding): from the code below to the code above.
fn e4m3_step(q: f64) -> f64 {
    let code = e4m3_from_f32(q.abs().min(f64::from(E4M3_MAX)) as f32) & 0x7f;
    let up = if code >= 0x7e { 32.0 } else { f64::from(e4m3_to_f32(code + 1) - e4m3_to_f32(code)) };
    let down = if code == 0 { up } else { f64::from(e4m3_to_f32(code) - e4m3_to_f32(code - 1)) };
    up.max(down)
}

fn check(case: &Case) {
    let prep = prepare(case);
    let reference = run_reference(&prep);
    let jit = run_jit(case, &prep);
    assert_only_written_changed(case, &prep.cache, &reference, "reference");
    assert_only_written_changed(case, &prep.cache, &jit, "jit");
    let (jit_scales, ref_scales) = (scales_of(&jit.cache), scales_of(&reference.cache));
    if case.exact {
        assert_eq!(jit.output, reference.output, "Q output of {case:?}");
        assert_eq!(jit.cache.blocks().as_bytes(), reference.cache.blocks().as_bytes(), "codes of {case:?}");
        let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&jit_scales), bits(&ref_scales), "scales of {case:?}");
        return;
    }
    // Accuracy against f64, for the JIT and the reference alike.
    let x_max = prep.hidden.to_f32_vec().unwrap().iter().fold(0f32, |m, v| m.max(v.abs()));
    let w_max = prep.weight.to_f32_vec().unwrap().iter().fold(0f32, |m, v| m.max(v.abs()));
    let accumulation = case.k as f64 * f64::from(x_max * w_max) * 2f64.powi(-22);
    for (ran, what) in [(&jit, "jit"), (&reference, "reference")] {
        let codes = ran.cache.blocks().as_bytes();
        let scales = scales_of(&ran.cache);
        for &(at, exact, scale_at) in &exact_kv(case, &prep) {
            let scale = f64::from(scales[scale_at]);
            let got = f64::from(e4m3_to_f32(codes[at])) * scale;
            let bound = 0.5 * e4m3_step(exact / scale) * scale + 2.0 * accumulation + 1e-30;
            assert!(
                (got - exact).abs() <= bound,
                "{what}: code {at}: {got} vs exact {exact} (scale {scale}, bound {bound}) in {case:?}"
            );
        }
    }
}

fn tiers() -> Vec<CpuTier> {
    let mut tiers = vec![CpuTier::Cranelift];
    if kvjit_jit::microkernel::avx2_available() {
        tiers.push(CpuTier::Avx2);
    }
    tiers
}

/// A random case: head sizes and granularities from 1 to 128 (g = D, g
/// a proper divisor, odd g), rows past the 256-bit tier's 6-row tile and
/// 192-row block, K past its 256-value k block.
fn draw(seed: u64, exact: bool) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let tiers = tiers();
    let tier = *tiers.choose(&mut rng).unwrap();
    let build = match (tier, rng.gen_range(0..3)) {
        (CpuTier::Avx2, 0) => Build::Unspecialized,
        (_, 1) => Build::Generic,
        _ => Build::Specialized,
    };
    let (head_size, granularity) =
        *[(1, 1), (3, 3), (8, 4), (8, 8), (12, 3), (16, 16), (32, 8), (64, 16), (64, 64), (128, 32), (128, 128)]
            .choose(&mut rng)
            .unwrap();
    let batch = rng.gen_range(1..=3);
    let seq = *[1, 1, 2, 5, 9, 70, 200].choose(&mut rng).unwrap();
    let page_size = *[1, 2, 3, 4, 16].choose(&mut rng).unwrap();
    let num_layers = rng.gen_range(1..=2);
    let valid = (0..batch).map(|_| if rng.gen_bool(0.2) { 0 } else { rng.gen_range(1..=seq as u32) }).collect();
    Case {
        seed,
        dtype: *DType::FLOATS.choose(&mut rng).unwrap(),
        tier,
        build,
        threads: *THREADS.choose(&mut rng).unwrap(),
        batch,
        seq,
        k: *[1, 3, 8, 17, 64, 300].choose(&mut rng).unwrap(),
        q_dim: rng.gen_range(1..=24),
        num_kv_heads: rng.gen_range(1..=3),
        head_size,
        granularity,
        page_size,
        num_layers,
        layer: rng.gen_range(0..num_layers as u32),
        history: (0..batch).map(|_| rng.gen_range(0..=2 * page_size as u32)).collect(),
        valid,
        exact,
    }
}

#[test]
fn exact_sums_give_the_references_codes_scales_and_output_bit_for_bit() {
    for seed in 0..60 {
        check(&draw(0xf8_0000 + seed, true));
    }
}

#[test]
fn every_stored_element_is_within_half_a_step_of_the_exact_value() {
    for seed in 0..40 {
        check(&draw(0xf8_1000 + seed, false));
    }
}

/// The decode and prefill shapes of Llama 3 8B's KV heads (D = 128, g =
/// 128 and 64), smaller K, on every tier.
#[test]
fn llama_shaped_heads_on_every_tier() {
    for tier in tiers() {
        for (seq, granularity, exact) in [(1, 128, true), (1, 64, false), (13, 128, false), (13, 64, true)] {
            let case = Case {
                seed: 7,
                dtype: DType::BF16,
                tier,
                build: Build::Specialized,
                threads: 3,
                batch: 2,
                seq,
                k: 256,
                q_dim: 512,
                num_kv_heads: 2,
                head_size: 128,
                granularity,
                page_size: 16,
                num_layers: 2,
                layer: 1,
                history: vec![5, 17],
                valid: vec![seq as u32, seq as u32 - seq as u32 / 2],
                exact,
            };
            check(&case);
        }
    }
}

/// A kernel built for one granularity refuses a cache of another (and a
/// bf16 cache), writing nothing: cache and output stay as they were.
#[test]
fn a_cache_of_another_granularity_or_dtype_is_refused_with_nothing_written() {
    let case = draw(0xf8_2000, true);
    let case = Case { head_size: 16, granularity: 8, ..case };
    let prep = prepare(&case);
    let kernel = kernel(&case, &prep.weight);
    for (dtype, granularity) in [(DType::F8E4M3, Some(16)), (DType::F8E4M3, Some(4)), (DType::BF16, None)] {
        let element = CacheElement::new(dtype, granularity).unwrap();
        let params = KvCacheParams { element, ..*prep.cache.params() };
        let mut other =
            PagedKVCacheCollection::new(params, prep.cache.num_pages(), case.batch, prep.cache.max_pages_per_seq())
                .unwrap();
        other.reserve(&case.valid).unwrap();
        other.fill_blocks_f32(0.5).unwrap();
        other.fill_scales(0.25).unwrap();
        let before = other.clone();
        let mut output = vec![0xa5u8; case.batch * case.seq * case.q_dim * case.dtype.size_bytes()];
        let args = QkvArgs {
            hidden_state: &prep.hidden,
            weight: &prep.weight,
            kv_collection: &mut other,
            layer_idx: &prep.layer,
            valid_lengths: &prep.valid,
        };
        let err = kernel.run_into(args, &mut output, &CONTEXTS[0]).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(if dtype == DType::BF16 { "dtype" } else { "scale_granularity" }), "{message}");
        assert_eq!(other, before, "the refused call wrote the cache");
        assert!(output.iter().all(|&b| b == 0xa5), "the refused call wrote the output");
    }
}

/// A K and a V column made infinite (an infinite weight, activations
/// nonzero where it multiplies): the g-blocks holding them keep a finite
/// scale from their finite values (0 when there are none, g = 1), the
/// infinite elements store ±448 (0x7e / 0xfe) and every finite element its
/// own code, no NaN anywhere; JIT and reference identical bit for bit
/// (dyadic inputs: exact sums).
#[test]
fn an_infinite_k_or_v_value_saturates_and_leaves_its_g_block_finite() {
    for (i, (head_size, granularity)) in [(1, 1), (8, 4), (12, 3), (16, 16), (64, 16), (8, 4)].into_iter().enumerate() {
        let mut case = Case { head_size, granularity, ..draw(0xf8_3000 + i as u64, true) };
        case.valid[0] = case.valid[0].max(1);
        let mut prep = prepare(&case);
        let (k, n) = (case.k, case.n());
        let mut x = prep.hidden.to_f32_vec().unwrap();
        let mut rng = StdRng::seed_from_u64(i as u64);
        x.chunks_exact_mut(k).for_each(|row| row[0] = if rng.gen_bool(0.5) { 1.0 } else { -1.0 });
        prep.hidden = Tensor::from_f32(case.dtype, prep.hidden.shape(), &x).unwrap();
        let mut w = prep.weight.to_f32_vec().unwrap();
        for col in [case.q_dim, n - 1] {
            w[col * k] = f32::INFINITY; // the first K value of head 0 and the last V value
        }
        prep.weight = Tensor::from_f32(case.dtype, &[n, k], &w).unwrap();

        let reference = run_reference(&prep);
        let jit = run_jit(&case, &prep);
        assert_only_written_changed(&case, &prep.cache, &reference, "reference");
        assert_only_written_changed(&case, &prep.cache, &jit, "jit");
        assert_eq!(jit.output, reference.output, "Q output of {case:?}");
        assert_eq!(jit.cache.blocks().as_bytes(), reference.cache.blocks().as_bytes(), "codes of {case:?}");
        let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scales_of(&jit.cache)), bits(&scales_of(&reference.cache)), "scales of {case:?}");

        // The rule, from the exact values (dyadic: exact in f32 too).
        let codes = reference.cache.blocks().as_bytes();
        let scales = scales_of(&reference.cache);
        let exact = exact_kv(&case, &prep);
        let mut finite_max = std::collections::HashMap::<usize, f64>::new();
        for &(_, value, scale_at) in &exact {
            let max = finite_max.entry(scale_at).or_default();
            if value.is_finite() {
                *max = max.max(value.abs());
            }
        }
        let mut infinities = 0;
        for &(at, value, scale_at) in &exact {
            let scale = scales[scale_at];
            assert_eq!(scale, finite_max[&scale_at] as f32 / E4M3_MAX, "scale {scale_at} of {case:?}");
            let want = if value.is_infinite() {
                infinities += 1;
                if value > 0.0 { 0x7e } else { 0xfe }
            } else if scale == 0.0 {
                e4m3_from_f32(value as f32 * 0.0)
            } else {
                e4m3_from_f32(value as f32 / scale)
            };
            assert_eq!(codes[at], want, "code {at} (of {value}, scale {scale}) in {case:?}");
        }
        let valid: u32 = case.valid.iter().sum();
        assert_eq!(infinities, 2 * valid, "two infinite values per valid token in {case:?}");
    }
}
