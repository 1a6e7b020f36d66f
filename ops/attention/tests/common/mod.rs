//! Shared helpers: random valid calls (f32, bf16, f16 and FP8 caches), the
//! tolerance, running the JIT kernel into a guarded, NaN-poisoned output.

#![allow(dead_code, reason = "each test binary uses a different part of the fixtures")]

use kvjit_core::fp8::{E4M3_MAX, quantize_block};
use kvjit_core::{Backend, CacheElement, CodeTier, CpuTier, DType, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_attention::{AttentionConfig, JitKernel, Mask, MhaSpec, jit_kernel, reference};
use kvjit_runtime::DeviceContextPtr;
use kvjit_testkit::{Guarded, nan_bytes, u32s};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The CPU tier the tests build kernels for unless a test names one:
/// `KVJIT_TEST_CPU_TIER` (`auto`, `cranelift`, `avx2`; default `auto`, the
/// widest this CPU runs), resolved. Run the suite once per tier to cover
/// both (the random and decode tests cover both in every run).
pub fn default_tier() -> CodeTier {
    let requested = std::env::var("KVJIT_TEST_CPU_TIER").map_or(CpuTier::Auto, |t| t.parse().unwrap());
    kvjit_jit::microkernel::resolve_tier(requested).unwrap()
}

/// Every tier this CPU runs (Cranelift first).
pub fn tiers() -> Vec<CodeTier> {
    let mut tiers = vec![CodeTier::Cranelift];
    if kvjit_jit::microkernel::avx2_available() {
        tiers.push(CodeTier::Avx2);
    }
    tiers
}

/// One random valid call.
#[derive(Clone, Debug)]
pub struct Case {
    pub dtype: DType,
    pub cache_dtype: DType,
    pub batch: usize,
    pub seq: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub page_size: usize,
    pub num_layers: usize,
    pub layer: usize,
    /// Values per scale of an FP8 cache (`Some` exactly for `f8e4m3`).
    pub scale_granularity: Option<usize>,
    pub cache_lengths: Vec<u32>,
    pub valid_lengths: Vec<u32>,
    pub mask: Mask,
    pub window: Option<usize>,
    pub scale: f32,
    pub seed: u64,
    /// The CPU code tier the kernel is built for.
    pub tier: CodeTier,
}

impl Case {
    pub fn spec(&self) -> MhaSpec {
        MhaSpec {
            backend: Backend::Cpu(self.tier),
            dtype: self.dtype,
            cache: self.cache_params(),
            num_heads: self.num_heads,
            mask: self.mask,
            window: self.window,
            scale: self.scale,
            step: StepDims { batch: None, seq: None },
        }
    }

    pub fn config(&self) -> AttentionConfig {
        AttentionConfig { mask: self.mask, window: self.window, scale: self.scale }
    }

    /// The cache layout.
    pub fn cache_params(&self) -> KvCacheParams {
        KvCacheParams {
            element: CacheElement::new(self.cache_dtype, self.scale_granularity).unwrap(),
            num_layers: self.num_layers,
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
        }
    }

    /// q, layer_idx, valid_lengths and the cache. The cache is NaN except
    /// the K/V of positions `< cache_length + valid_length` of every
    /// sequence (all layers and heads): a kernel that used any other slot
    /// would produce NaN. Pages are handed out in a shuffled order.
    ///
    /// Cached values lie in [-1, 1]. An FP8 cache's g-blocks are, at
    /// random, random codes (every code but the NaNs 0x7f/0xff) with a
    /// random scale in [0.25, 1]/448, random values in [-1, 1) quantized
    /// with [`quantize_block`], or (1 in 20) zeros (scale 0); its unused
    /// slots hold NaN codes and NaN scales.
    pub fn inputs(&self) -> (Vec<Tensor>, PagedKVCacheCollection) {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let params = self.cache_params();
        let totals: Vec<u32> = self.cache_lengths.iter().zip(&self.valid_lengths).map(|(c, v)| c + v).collect();
        let pages: usize = totals.iter().map(|&t| (t as usize).div_ceil(self.page_size)).sum::<usize>() + 2;
        let max_pages = totals.iter().map(|&t| (t as usize).div_ceil(self.page_size)).max().unwrap_or(0) + 1;
        let mut cache = PagedKVCacheCollection::new(params, pages, self.batch, max_pages).unwrap();
        let mut order: Vec<u32> = (0..pages as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.gen_range(0..=i));
        }
        cache.set_allocation_order(order).unwrap();
        cache.reserve(&totals).unwrap();
        let ranges: Vec<(usize, usize)> = totals.iter().map(|&t| (0, t as usize)).collect();
        self.fill_ranges(&mut cache, &ranges, &mut rng);
        cache.cache_lengths_mut().copy_from_slice(&self.cache_lengths);
        self.finish_inputs(cache, &mut rng)
    }

    /// [`inputs`](Self::inputs) for contexts far beyond any real cache: a
    /// sliding window (needed) keeps what each sequence reads small. Only
    /// the pages holding the key positions `[lo, hi)` its valid queries read
    /// (`AttentionConfig::key_range`) are assigned — one physical page each,
    /// in order —, every other lookup-table entry is unassigned; the
    /// positions of `[lo, hi)` hold the random values, every other slot NaN.
    pub fn windowed_inputs(&self) -> (Vec<Tensor>, PagedKVCacheCollection) {
        assert!(self.window.is_some(), "windowed_inputs needs a window");
        let mut rng = StdRng::seed_from_u64(self.seed);
        let ranges: Vec<(usize, usize)> = (0..self.batch)
            .map(|b| {
                let (cl, v) = (self.cache_lengths[b] as usize, self.valid_lengths[b] as usize);
                if v == 0 { (0, 0) } else { (self.config().key_range(cl, v, 0).0, cl + v) }
            })
            .collect();
        let page_range = |&(lo, hi): &(usize, usize)| lo / self.page_size..hi.div_ceil(self.page_size);
        let pages = ranges.iter().map(|r| page_range(r).len()).sum::<usize>().max(1);
        let max_pages = ranges.iter().map(|r| page_range(r).end).max().unwrap_or(0);
        let mut cache = PagedKVCacheCollection::new(self.cache_params(), pages, self.batch, max_pages).unwrap();
        let mut next = 0;
        for (b, range) in ranges.iter().enumerate() {
            for logical in page_range(range) {
                cache.lookup_table_mut()[b * max_pages + logical] = next;
                next += 1;
            }
        }
        self.fill_ranges(&mut cache, &ranges, &mut rng);
        cache.cache_lengths_mut().copy_from_slice(&self.cache_lengths);
        self.finish_inputs(cache, &mut rng)
    }

    /// Random values (codes and scales for FP8) at the positions `ranges[b]`
    /// of every sequence b, NaN elsewhere.
    fn fill_ranges(&self, cache: &mut PagedKVCacheCollection, ranges: &[(usize, usize)], rng: &mut StdRng) {
        if self.cache_dtype == DType::F8E4M3 {
            self.fill_fp8(cache, ranges, rng);
        } else {
            self.fill(cache, ranges, rng);
        }
    }

    /// q, layer_idx and valid_lengths with `cache`.
    fn finish_inputs(&self, cache: PagedKVCacheCollection, rng: &mut StdRng) -> (Vec<Tensor>, PagedKVCacheCollection) {
        let q = Tensor::random(self.dtype, &[self.batch, self.seq, self.num_heads, self.head_size], rng, -2.0, 2.0)
            .unwrap();
        let layer = Tensor::scalar_u32(self.layer as u32);
        (vec![q, layer, u32s(&self.valid_lengths)], cache)
    }

    /// Random values in [-1, 1) at the positions `ranges[b]` of every
    /// sequence b, NaN elsewhere.
    fn fill(&self, cache: &mut PagedKVCacheCollection, ranges: &[(usize, usize)], rng: &mut StdRng) {
        let mut blocks = vec![f32::NAN; cache.blocks().numel()];
        for (b, &(lo, hi)) in ranges.iter().enumerate() {
            for p in lo..hi {
                let (page, slot) = cache.locate(b, p).unwrap();
                for layer in 0..self.num_layers {
                    for kv in 0..2 {
                        for h in 0..self.num_kv_heads {
                            for d in 0..self.head_size {
                                let at = cache.element_offset(page as usize, kv, layer, slot, h, d);
                                blocks[at] = rng.gen_range(-1.0f32..1.0);
                            }
                        }
                    }
                }
            }
        }
        let shape = cache.blocks().shape().to_vec();
        cache.set_blocks(Tensor::from_f32(self.cache_dtype, &shape, &blocks).unwrap()).unwrap();
    }

    /// [`fill`](Self::fill) for an FP8 cache: codes and scales per g-block
    /// (see [`inputs`](Self::inputs)).
    fn fill_fp8(&self, cache: &mut PagedKVCacheCollection, ranges: &[(usize, usize)], rng: &mut StdRng) {
        let g = self.scale_granularity.expect("an FP8 case has a granularity");
        let mut codes = vec![0x7fu8; cache.blocks().numel()];
        let mut scales = vec![f32::NAN; cache.blocks().numel() / g];
        let mut values = vec![0f32; g];
        for (b, &(lo, hi)) in ranges.iter().enumerate() {
            for p in lo..hi {
                let (page, slot) = cache.locate(b, p).unwrap();
                for layer in 0..self.num_layers {
                    for kv in 0..2 {
                        for h in 0..self.num_kv_heads {
                            for block in 0..self.head_size / g {
                                let at = cache.element_offset(page as usize, kv, layer, slot, h, block * g);
                                let dst = &mut codes[at..at + g];
                                let scale = &mut scales[cache.scale_offset(page as usize, kv, layer, slot, h, block)];
                                match rng.gen_range(0..20) {
                                    0 => {
                                        values.fill(0.0);
                                        *scale = quantize_block(&values, dst);
                                    }
                                    1..10 => {
                                        for code in dst.iter_mut() {
                                            let c: u8 = rng.gen_range(0..254);
                                            *code = if c < 0x7f { c } else { c + 1 };
                                        }
                                        *scale = rng.gen_range(0.25f32..=1.0) / E4M3_MAX;
                                    }
                                    _ => {
                                        values.iter_mut().for_each(|v| *v = rng.gen_range(-1.0f32..1.0));
                                        *scale = quantize_block(&values, dst);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        let shape = cache.blocks().shape().to_vec();
        cache.set_blocks(Tensor::from_le_bytes(DType::F8E4M3, &shape, &codes).unwrap()).unwrap();
        let shape = cache.scales().expect("an FP8 cache has scales").shape().to_vec();
        cache.set_scales(Tensor::from_f32(DType::F32, &shape, &scales).unwrap()).unwrap();
    }

    /// A random case; `decode` fixes S = 1.
    pub fn random(rng: &mut impl Rng, decode: bool) -> Self {
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        let head_size = [24, 64, 72, 80, 128, 256][rng.gen_range(0..6)];
        let group = [1, 4, 8][rng.gen_range(0..3)];
        let num_kv_heads = rng.gen_range(1..=2);
        let page_size = [1, 2, 3, 5, 16, 33, 64, 256][rng.gen_range(0..8)];
        let batch = rng.gen_range(1..=3);
        let seq = if decode { 1 } else { rng.gen_range(2..=19) };
        let long = rng.gen_bool(0.3);
        let cache_lengths: Vec<u32> = (0..batch)
            .map(|_| match rng.gen_range(0..4) {
                0 => 0,
                _ if long => rng.gen_range(200..700),
                _ => rng.gen_range(1..80),
            })
            .collect();
        let valid_lengths: Vec<u32> =
            (0..batch).map(|_| if rng.gen_bool(0.15) { 0 } else { rng.gen_range(1..=seq as u32) }).collect();
        let num_layers = rng.gen_range(1..=2);
        Case {
            dtype: dtypes[rng.gen_range(0..3)],
            cache_dtype: dtypes[rng.gen_range(0..3)],
            batch,
            seq,
            num_heads: num_kv_heads * group,
            num_kv_heads,
            head_size,
            page_size,
            num_layers,
            layer: rng.gen_range(0..num_layers),
            scale_granularity: None,
            cache_lengths,
            valid_lengths,
            mask: if rng.gen_bool(0.5) { Mask::Causal } else { Mask::Null },
            window: rng.gen_bool(0.3).then(|| rng.gen_range(1..40)),
            scale: if rng.gen_bool(0.5) { 1.0 / (head_size as f32).sqrt() } else { rng.gen_range(0.01..0.5) },
            seed: rng.r#gen(),
            tier: default_tier(),
        }
    }

    /// A random case with an FP8 cache: [`random`](Self::random)'s shapes,
    /// and g = D or (half the time) another multiple of 4 dividing D.
    pub fn random_fp8(rng: &mut impl Rng, decode: bool) -> Self {
        let mut case = Self::random(rng, decode);
        let d = case.head_size;
        let divisors: Vec<usize> = (4..d).step_by(4).filter(|g| d.is_multiple_of(*g)).collect();
        let g = if divisors.is_empty() || rng.gen_bool(0.5) { d } else { divisors[rng.gen_range(0..divisors.len())] };
        case.cache_dtype = DType::F8E4M3;
        case.scale_granularity = Some(g);
        case
    }
}

/// The bytes of a cache's scales (empty without).
pub fn scale_bytes(cache: &PagedKVCacheCollection) -> Vec<u8> {
    cache.scales().map_or(Vec::new(), |s| s.as_bytes().to_vec())
}

/// Run the JIT kernel into a NaN-poisoned output with guard regions on
/// both sides (and its reused launch scratch poisoned); check the guards
/// and that the cache was not touched.
pub fn run_jit(kernel: &Compiled<JitKernel>, case: &Case, threads: usize) -> Vec<f32> {
    let (inputs, cache) = case.inputs();
    run_jit_on(kernel, case, &inputs, &cache, threads)
}

/// [`run_jit`] on given inputs and cache (of `case`'s shapes).
pub fn run_jit_on(
    kernel: &Compiled<JitKernel>,
    case: &Case,
    inputs: &[Tensor],
    cache: &PagedKVCacheCollection,
    threads: usize,
) -> Vec<f32> {
    let before = cache.blocks().as_bytes().to_vec();
    let scales_before = scale_bytes(cache);
    let elements = case.batch * case.seq * case.num_heads * case.head_size;
    let mut out = Guarded::new(64, &nan_bytes(case.dtype, elements), 64);
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut run_on = cache.clone();
    let ctx = DeviceContextPtr::cpu(threads).unwrap();
    // The launch scratch this thread reuses, poisoned like the output.
    kvjit_op_attention::cpu_jit::poison_scratch();
    kernel.kernel().run_into(&refs, &mut [&mut run_on], out.body_mut(), &ctx).unwrap();
    out.assert_guards("attention output");
    assert!(run_on.blocks().as_bytes() == before.as_slice(), "the cache must be byte-identical after the call");
    assert!(scale_bytes(&run_on) == scales_before, "the cache's scales must be byte-identical after the call");
    Tensor::from_le_bytes(case.dtype, &[elements], out.body()).unwrap().to_f32_vec().unwrap()
}

/// Pool sizes the thread-count tests compare.
pub const POOL_SIZES: [usize; 4] = [1, 2, 3, 5];

/// Run the JIT kernel for `case` on pools of every size in [`POOL_SIZES`]
/// (each through [`run_jit_on`]: guarded, poisoned, cache checked) and
/// assert the outputs are bit-identical; returns the output.
pub fn assert_same_bits_on_every_pool(kernel: &Compiled<JitKernel>, case: &Case) -> Vec<f32> {
    let (inputs, cache) = case.inputs();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let first = run_jit_on(kernel, case, &inputs, &cache, POOL_SIZES[0]);
    for threads in &POOL_SIZES[1..] {
        let got = run_jit_on(kernel, case, &inputs, &cache, *threads);
        let differ = bits(&got).iter().zip(bits(&first)).filter(|(a, b)| **a != *b).count();
        assert_eq!(differ, 0, "{case:?}: {differ} of {} values differ between 1 and {threads} threads", got.len());
    }
    first
}

pub fn jit(case: &Case) -> Compiled<JitKernel> {
    jit_kernel(case.spec(), CaptureText::default()).unwrap()
}

/// The bound `|got − exact|` must meet, per element of a valid row:
///
/// `vmax · 2^-24 · (16 + 4·D·qk + 4·T)` for the f32 computation (score
/// rounding in D products each at most `qk = scale·max|q|·max|k|` — a
/// score error δ moves the output by at most 2·vmax·δ —, the exp's
/// 1.3 units, and T terms of f32 accumulation in the sum and in acc), plus
/// for bf16/f16 outputs one rounding: `unit_roundoff · |exact|` and half an
/// f16 subnormal step. vmax = 1 (cache values in [-1, 1)). Where the
/// kernel multiplies in f16 ([`half_products`]) the bound of those
/// products is added: a score off by δ = (D/16 + 6)·2⁻¹¹·D·qk (plus f16
/// subnormals' 2⁻²⁵ at each of 16·(D/16 + 5) roundings, in units of
/// 2·max|q|·2⁸/448), which moves
/// the output by at most (e^{2δ} − 1)·vmax, and P·V's 34·2⁻¹¹·vmax.
pub fn tolerance(case: &Case, keys: usize, exact: f64) -> f64 {
    let u = 2f64.powi(-24);
    let qk = f64::from(case.scale) * 2.0;
    let f32_part = u * (16.0 + 4.0 * case.head_size as f64 * qk + 4.0 * keys as f64);
    let rounding = match case.dtype {
        DType::F32 => 0.0,
        DType::BF16 => exact.abs() / 256.0,
        _ => exact.abs() / 2048.0 + 2f64.powi(-25),
    };
    let half = match half_products(case) {
        true => {
            let (d, u16) = (case.head_size as f64, 2f64.powi(-11));
            let subnormal = (d + 80.0) * 2f64.powi(-25) * 2.0 * qk * 256.0 / 448.0;
            let delta = (d / 16.0 + 6.0) * u16 * d * qk + subnormal;
            (2.0 * delta).exp() - 1.0 + 34.0 * u16
        }
        false => 0.0,
    };
    f32_part + rounding + half
}

/// Whether `case`'s kernel multiplies in f16: an FP8 cache on the 256-bit
/// tier where the decode micro-kernel takes f16 products
/// ([`kvjit_jit::attention_kernel::DecodeWidth::ZmmHalf`]).
pub fn half_products(case: &Case) -> bool {
    use kvjit_jit::attention_kernel::{DecodeWidth, decode_width};
    case.tier == CodeTier::Avx2
        && case.cache_dtype == DType::F8E4M3
        && decode_width(case.cache_dtype, case.head_size, case.scale_granularity) == DecodeWidth::ZmmHalf
}

/// Compare the JIT output with the exact reference: valid rows within
/// [`tolerance`] (NaN exactly where the reference is NaN), padded rows
/// exactly zero. Returns the worst error/bound.
pub fn check_against_reference(case: &Case, got: &[f32]) -> f64 {
    let (inputs, cache) = case.inputs();
    check_against_reference_on(case, &inputs, &cache, got)
}

/// [`check_against_reference`] on given inputs and cache.
pub fn check_against_reference_on(case: &Case, inputs: &[Tensor], cache: &PagedKVCacheCollection, got: &[f32]) -> f64 {
    let (_, exact) = reference::mha_f64(&inputs[0], cache, &inputs[1], &inputs[2], &case.config()).unwrap();
    let (hq, d) = (case.num_heads, case.head_size);
    let mut worst = 0f64;
    for b in 0..case.batch {
        let (cl, v) = (case.cache_lengths[b] as usize, case.valid_lengths[b] as usize);
        for s in 0..case.seq {
            let (lo, hi) = case.config().key_range(cl, v, s);
            for h in 0..hq {
                for i in 0..d {
                    let at = ((b * case.seq + s) * hq + h) * d + i;
                    let g = got[at];
                    if s >= v {
                        assert_eq!(g.to_bits(), 0, "{case:?}: padded row (b {b}, s {s}) must be +0, got {g}");
                        continue;
                    }
                    if exact[at].is_nan() {
                        assert!(g.is_nan(), "{case:?}: (b {b}, s {s}, h {h}, d {i}) got {g}, want NaN");
                        continue;
                    }
                    let bound = tolerance(case, hi - lo, exact[at]);
                    let err = (f64::from(g) - exact[at]).abs();
                    assert!(
                        err <= bound,
                        "{case:?}: (b {b}, s {s}, h {h}, d {i}) got {g}, want {}, error {err:e} > bound {bound:e}",
                        exact[at]
                    );
                    worst = worst.max(err / bound);
                }
            }
        }
    }
    worst
}
