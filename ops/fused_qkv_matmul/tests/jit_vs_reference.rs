//! The Cranelift-JIT CPU kernel ([`JitKernel`]) against the reference
//! implementation (`reference::fused_qkv_matmul`), on identically prepared
//! buffers.
//!
//! Every JIT call writes into poisoned memory: the output (all NaN) sits
//! between two guard regions of canary bytes, and the cache (all NaN) has
//! guard pages at both ends that no page-table entry names. Afterwards the
//! guards must be intact, every output element and every cache element the
//! contract writes must match the reference (within
//! [`Tolerance::RelativeToScale`], or bit for bit when the arithmetic is
//! exact), and every other cache byte must still be the poisoned byte.
//!
//! Also here: bit-identical results for any thread count and for generic
//! versus specialized kernels, validation parity with the reference kernel,
//! the panel packing, the kernel cache, and named regression cases.

use std::sync::{Arc, LazyLock};

use half::f16;
use kvjit_core::{
    Backend, CacheElement, CodeTier, CpuTier, DType, Error, KernelSpec, KvCacheParams, PagedKVCacheCollection, Result,
    Tensor, UNASSIGNED_PAGE,
};
use kvjit_jit::CaptureText;
use kvjit_jit::CompileCause;
use kvjit_jit::microkernel::resolve_tier;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op::gemm::WeightOrientation;
use kvjit_op_fused_qkv::cpu_jit::{self, MAX_SEEN_SHAPES, MC, NR, PanelLayout, Schedule};
use kvjit_op_fused_qkv::{FusedQkvSpec, JitKernel, QkvArgs, ReferenceKernel, Sizes, reference};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::paged;
use kvjit_testkit::values::{dyadic, dyadic_scaled, max_abs_finite, uniform};
use kvjit_testkit::{
    Guarded, Snapshot, Tolerance, block_index, cache_from_table, nan_bytes, poison, strided_view, u32s, unravel,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const U: u32 = UNASSIGNED_PAGE;

// ---------------------------------------------------------------------------
// Worker pools (built once: a pool per thread count)
// ---------------------------------------------------------------------------

const THREADS: [usize; 4] = [1, 2, 3, 8];

/// The CPU tiers this machine runs: the Cranelift tier everywhere, the
/// 256-bit tier where the CPU has AVX2/FMA/F16C.
fn tiers() -> Vec<CpuTier> {
    let mut tiers = vec![CpuTier::Cranelift];
    if kvjit_jit::microkernel::avx2_available() {
        tiers.push(CpuTier::Avx2);
    }
    tiers
}

static CONTEXTS: LazyLock<Vec<DeviceContextPtr>> =
    LazyLock::new(|| THREADS.iter().map(|&t| DeviceContextPtr::cpu(t).unwrap()).collect());

fn cpu(threads: usize) -> &'static DeviceContextPtr {
    let i = THREADS.iter().position(|&t| t == threads).expect("a pool of this size");
    &CONTEXTS[i]
}

// ---------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------

/// How inputs are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Values {
    /// Uniform in [-1, 1): compared within the tolerances.
    Uniform,
    /// Multiples of 1/4 (hidden) and 1/8 (weight) in [-1, 1]: every product
    /// and partial sum is exact in f32, so any summation order gives the same
    /// f32 result and JIT and reference must agree bit for bit, after
    /// rounding to bf16/f16 too.
    Dyadic,
    /// [`Dyadic`](Self::Dyadic) values scaled down (hidden by
    /// [`TINY_X`], weight by [`TINY_W`]): still exact in f32, with f16
    /// weights below f16's normal range and products finer than f16's
    /// subnormal step, so results round to f16 subnormals (ties included).
    Tiny,
}

/// Scale of [`Values::Tiny`] hidden states (multiples of 2^-8).
const TINY_X: f32 = 1.0 / 64.0;
/// Scale of [`Values::Tiny`] weights (multiples of 2^-17, f16 subnormals).
const TINY_W: f32 = 1.0 / 16384.0;

impl Values {
    /// Whether JIT and reference must agree bit for bit.
    fn exact(self) -> bool {
        self != Values::Uniform
    }
}

/// What the page table says for logical pages that only padded rows reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PaddedPages {
    /// No page.
    Unassigned,
    /// Pages of their own (which must stay untouched).
    Fresh,
    /// Pages valid tokens of some sequence write (padded rows write nothing,
    /// so this is no collision).
    Aliased,
}

/// Which JIT entry point a case calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// `run_into` with the output between guards of these many bytes (not
    /// always a multiple of the element size: the output may be unaligned).
    RunInto { front: usize, back: usize },
    /// `Kernel::check` then `Kernel::run` with an output tensor.
    Run,
}

/// One fully determined case: shapes, page-table recipe, data seed, kernel
/// flavour and call.
#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    dtype: DType,
    cache_dtype: DType,
    batch: usize,
    seq: usize,
    k: usize,
    hkv: usize,
    d: usize,
    /// Q heads per KV head (GQA ratio).
    ratio: usize,
    page_size: usize,
    layers: usize,
    layer: usize,
    cache_lengths: Vec<u32>,
    valid: Vec<u32>,
    padded_pages: PaddedPages,
    /// Unused lookup-table columns beyond the longest sequence.
    extra_table_pages: usize,
    /// Guard pages before and after the pages the table uses.
    guard_pages: (usize, usize),
    values: Values,
    /// Hand the weight to `JitKernel::new` (packed at build) or not (packed per run).
    const_weight: bool,
    static_batch: bool,
    static_seq: bool,
    threads: usize,
    call: Call,
    /// The CPU tier the JIT kernel is built for (`Auto` in [`check_case`]:
    /// every tier this CPU has).
    tier: CpuTier,
    /// Run the unspecialized kernel (sizes read at run time; avx2 tier).
    unspecialized: bool,
    /// A weight in a block format (random blocks) instead of the dtype.
    weights: Option<DType>,
}

impl Case {
    /// A small valid case to derive named cases from.
    fn base(dtype: DType) -> Self {
        Self {
            seed: 1,
            dtype,
            cache_dtype: dtype,
            batch: 1,
            seq: 1,
            k: 8,
            hkv: 1,
            d: 8,
            ratio: 1,
            page_size: 4,
            layers: 1,
            layer: 0,
            cache_lengths: vec![0],
            valid: vec![1],
            padded_pages: PaddedPages::Unassigned,
            extra_table_pages: 0,
            guard_pages: (1, 1),
            values: Values::Uniform,
            const_weight: false,
            static_batch: false,
            static_seq: false,
            threads: 1,
            call: Call::RunInto { front: 16, back: 16 },
            tier: CpuTier::Auto,
            unspecialized: false,
            weights: None,
        }
    }

    /// The case's tier, resolved (this CPU's widest for `Auto`).
    fn code_tier(&self) -> CodeTier {
        resolve_tier(self.tier).unwrap_or_else(|e| panic!("{self:?}: {e}"))
    }

    /// The schedule of the case's tier.
    fn schedule(&self) -> Schedule {
        Schedule::of(self.code_tier())
    }

    fn q_dim(&self) -> usize {
        self.ratio * self.hkv * self.d
    }

    fn kv_dim(&self) -> usize {
        self.hkv * self.d
    }

    fn n(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    fn spec(&self) -> FusedQkvSpec {
        FusedQkvSpec {
            backend: Backend::Cpu(self.code_tier()),
            dtype: self.dtype,
            weights: self.weights.unwrap_or(self.dtype),
            cache: KvCacheParams {
                element: CacheElement::new(self.cache_dtype, None).unwrap(),
                num_layers: self.layers,
                page_size: self.page_size,
                num_kv_heads: self.hkv,
                head_size: self.d,
            },
            k: self.k,
            q_dim: self.q_dim(),
            step: StepDims { batch: self.static_batch.then_some(self.batch), seq: self.static_seq.then_some(self.seq) },
            sizes: Sizes::Baked,
        }
    }

    /// Logical pages each sequence's valid tokens need (cached history included).
    fn needed_pages(&self) -> Vec<usize> {
        (0..self.batch)
            .map(|b| (self.cache_lengths[b] + self.valid[b]) as usize)
            .map(|t| t.div_ceil(self.page_size))
            .collect()
    }

    /// Logical pages each sequence's rows reach, padded rows included.
    fn spanned_pages(&self) -> Vec<usize> {
        (0..self.batch).map(|b| (self.cache_lengths[b] as usize + self.seq).div_ceil(self.page_size)).collect()
    }

    fn num_pages(&self) -> usize {
        let (need, span) = (self.needed_pages(), self.spanned_pages());
        let fresh: usize =
            if self.padded_pages == PaddedPages::Fresh { span.iter().zip(&need).map(|(s, n)| s - n).sum() } else { 0 };
        self.guard_pages.0 + need.iter().sum::<usize>() + fresh + self.guard_pages.1
    }

    fn cache_elements(&self) -> usize {
        self.num_pages() * 2 * self.layers * self.page_size * self.kv_dim()
    }

    /// Uniform values, or multiples of `1/denominator` in [-1, 1] (times
    /// `tiny` for [`Values::Tiny`]).
    fn tensor(&self, rng: &mut StdRng, shape: &[usize], denominator: i32, tiny: f32) -> Tensor {
        match self.values {
            Values::Uniform => uniform(rng, self.dtype, shape),
            Values::Dyadic => dyadic(rng, self.dtype, shape, denominator),
            Values::Tiny => dyadic_scaled(rng, self.dtype, shape, denominator, tiny),
        }
    }

    /// Inputs and a poisoned cache with an explicit, scattered page table.
    fn prepare(&self) -> Prepared {
        assert_eq!(self.cache_lengths.len(), self.batch, "case: cache_lengths per sequence");
        assert_eq!(self.valid.len(), self.batch, "case: valid lengths per sequence");
        let mut rng = StdRng::seed_from_u64(self.seed);
        let hidden = self.tensor(&mut rng, &[self.batch, self.seq, self.k], 4, TINY_X);
        let weight = match self.weights {
            Some(format) => kvjit_testkit::blocks::random_blocks(format, self.n(), self.k, &mut rng),
            None => self.tensor(&mut rng, &[self.n(), self.k], 8, TINY_W),
        };
        let scale = max_abs_finite(&hidden) * max_abs_finite(&weight);

        let (need, span) = (self.needed_pages(), self.spanned_pages());
        let max_pages = span.iter().copied().max().unwrap_or(0).max(1) + self.extra_table_pages;
        let num_pages = self.num_pages();
        let (front, back) = self.guard_pages;
        let mut pool: Vec<u32> = (front as u32..(num_pages - back) as u32).collect();
        pool.shuffle(&mut rng);
        let mut table = vec![U; self.batch * max_pages];
        // Hand out the pages valid tokens need in a random interleaving of
        // the sequences, so tables are scattered and interleaved.
        let mut order: Vec<(usize, usize)> = (0..self.batch).flat_map(|b| (0..need[b]).map(move |l| (b, l))).collect();
        order.shuffle(&mut rng);
        let mut assigned = Vec::new();
        for (b, l) in order {
            let page = pool.pop().expect("enough pages");
            table[b * max_pages + l] = page;
            assigned.push(page);
        }
        for b in 0..self.batch {
            for l in need[b]..span[b] {
                table[b * max_pages + l] = match self.padded_pages {
                    PaddedPages::Unassigned => U,
                    PaddedPages::Fresh => pool.pop().expect("enough pages"),
                    PaddedPages::Aliased => assigned.choose(&mut rng).copied().unwrap_or(U),
                };
            }
        }
        assert!(pool.is_empty(), "case: every non-guard page is in the table");

        let shape = [num_pages, 2, self.layers, self.page_size, self.hkv, self.d];
        let mut cache = cache_from_table(self.cache_dtype, shape, &self.cache_lengths, &table, max_pages);
        cache.fill_blocks_f32(f32::NAN).unwrap();
        let poisoned = cache.blocks().as_bytes().to_vec();

        // The elements the contract writes, worked out here from the table.
        let mut written = vec![false; shape.iter().product()];
        for b in 0..self.batch {
            for t in 0..self.valid[b] as usize {
                let pos = self.cache_lengths[b] as usize + t;
                let page = table[b * max_pages + pos / self.page_size] as usize;
                for kv in 0..2 {
                    for h in 0..self.hkv {
                        for d in 0..self.d {
                            let i = block_index(&shape, [page, kv, self.layer, pos % self.page_size, h, d]);
                            assert!(!written[i], "case: the test's page table collides");
                            written[i] = true;
                        }
                    }
                }
            }
        }
        let guard_pages = (0..front).chain(num_pages - back..num_pages).collect();
        Prepared {
            hidden,
            weight: Arc::new(weight),
            layer_idx: Tensor::scalar_u32(self.layer as u32),
            valid: u32s(&self.valid),
            cache,
            poisoned,
            shape,
            written,
            guard_pages,
            scale,
        }
    }

    fn kernel(&self, prep: &Prepared) -> Compiled<JitKernel> {
        let weight = self.const_weight.then(|| prep.weight.clone());
        let kernel = if self.unspecialized {
            JitKernel::unspecialized(self.spec(), weight)
        } else {
            JitKernel::new(self.spec(), weight, CaptureText::default())
        };
        Compiled::new(kernel.unwrap_or_else(|e| panic!("{self:?}: building the JIT kernel failed: {e}")))
    }
}

/// A case's buffers, before any call.
struct Prepared {
    hidden: Tensor,
    weight: Arc<Tensor>,
    layer_idx: Tensor,
    valid: Tensor,
    /// Poisoned with NaN; every call works on its own clone.
    cache: PagedKVCacheCollection,
    /// The poisoned blocks' bytes.
    poisoned: Vec<u8>,
    shape: [usize; 6],
    /// Per blocks element: whether the contract writes it.
    written: Vec<bool>,
    guard_pages: Vec<usize>,
    /// `max|x| · max|w|`.
    scale: f64,
}

/// Output bytes and the cache after one call.
struct Ran {
    output: Vec<u8>,
    cache: PagedKVCacheCollection,
}

fn run_reference(case: &Case, prep: &Prepared) -> Ran {
    let mut cache = prep.cache.clone();
    let mut output = Tensor::zeros(case.dtype, &[case.batch, case.seq, case.q_dim()]).unwrap();
    poison(&mut output);
    reference::fused_qkv_matmul(&prep.hidden, &prep.weight, &mut cache, &prep.layer_idx, &prep.valid, &mut output)
        .unwrap_or_else(|e| panic!("{case:?}: the reference rejected the case: {e}"));
    Ran { output: output.as_bytes().to_vec(), cache }
}

fn run_jit(case: &Case, prep: &Prepared, kernel: &Compiled<JitKernel>, ctx: &DeviceContextPtr) -> Ran {
    let mut cache = prep.cache.clone();
    let out_shape = [case.batch, case.seq, case.q_dim()];
    let output = match case.call {
        Call::RunInto { front, back } => {
            let mut buffer = Guarded::new(front, &nan_bytes(case.dtype, case.rows() * case.q_dim()), back);
            kernel
                .kernel()
                .run_into(
                    QkvArgs {
                        hidden_state: &prep.hidden,
                        weight: &prep.weight,
                        kv_collection: &mut cache,
                        layer_idx: &prep.layer_idx,
                        valid_lengths: &prep.valid,
                    },
                    buffer.body_mut(),
                    ctx,
                )
                .unwrap_or_else(|e| panic!("{case:?}: run_into failed: {e}"));
            buffer.assert_guards(&format!("{case:?}"));
            buffer.body().to_vec()
        }
        Call::Run => {
            let inputs = [&prep.hidden, &*prep.weight, &prep.layer_idx, &prep.valid];
            let specs = kernel.check(&inputs, &[&cache]).unwrap_or_else(|e| panic!("{case:?}: check failed: {e}"));
            assert_eq!(specs, vec![(case.dtype, out_shape.to_vec())], "{case:?}: check's output spec");
            let mut outputs = [Tensor::zeros(case.dtype, &out_shape).unwrap()];
            poison(&mut outputs[0]);
            kernel
                .run(&inputs, &mut [&mut cache], &mut outputs, ctx)
                .unwrap_or_else(|e| panic!("{case:?}: run failed: {e}"));
            outputs[0].as_bytes().to_vec()
        }
    };
    Ran { output, cache }
}

fn to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    Tensor::from_le_bytes(dtype, &[bytes.len() / dtype.size_bytes()], bytes).unwrap().to_f32_vec().unwrap()
}

/// `got` (JIT) against `want` (reference) for one element of `dtype`: bit
/// for bit when the case's arithmetic is exact, else within
/// [`Tolerance::RelativeToScale`] (f32 accumulation over K products of at
/// most `max|x|·max|w|`, plus an ulp of bf16/f16 rounding).
fn assert_close(case: &Case, prep: &Prepared, dtype: DType, got: f32, want: f32, what: impl Fn() -> String) {
    assert!(want.is_finite(), "{case:?}: the reference left {} = {want}", what());
    let rule = if case.values.exact() && case.weights.is_none() {
        Tolerance::Exact
    } else {
        Tolerance::RelativeToScale { dtype, k: case.k, scale: prep.scale }
    };
    // A few rows against block weights on the 256-bit tier take the
    // integer GEMV, one per row (`gemv_per_row`), on activations rounded to
    // 16-bit integers per block of 32: each of the K products moves by at
    // most half a step (max|x|/32258) times |w|.
    let integer_gemv = case.weights.is_some_and(|w| kvjit_op::gemm::gemv_per_row(case.code_tier(), w, case.rows()));
    let steps = kvjit_testkit::blocks::ACTIVATION_STEPS;
    let rounding = if integer_gemv { case.k as f64 * prep.scale / (2.0 * steps) * 1.01 } else { 0.0 };
    let (g, w) = (f64::from(got), f64::from(want));
    let (tol, err) = (rule.bound(g, w) + rounding, (g - w).abs());
    let ok = got.is_finite() && err <= tol;
    if !ok {
        let rule = if case.values.exact() {
            "exact arithmetic must agree bit for bit".to_string()
        } else {
            format!("tolerance {tol:e}, error {err:e}")
        };
        panic!("{case:?}: {} = {got} ({:#x}), reference {want} ({:#x}); {rule}", what(), got.to_bits(), want.to_bits());
    }
}

/// Compare a JIT run with the reference run of the same case.
fn assert_matches_reference(case: &Case, prep: &Prepared, jit: &Ran, reference: &Ran) {
    let (q_dim, cache_dtype) = (case.q_dim(), case.cache_dtype);
    assert_eq!(jit.cache.cache_lengths(), prep.cache.cache_lengths(), "{case:?}: cache_lengths changed");
    assert_eq!(jit.cache.lookup_table(), prep.cache.lookup_table(), "{case:?}: lookup table changed");

    // Q: every row, padded or not.
    let got = to_f32(case.dtype, &jit.output);
    let want = to_f32(case.dtype, &reference.output);
    assert_eq!(got.len(), case.rows() * q_dim);
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert_close(case, prep, case.dtype, g, w, || format!("output[row {}, col {}]", i / q_dim, i % q_dim));
    }

    // Guard pages: named by no table entry, so every byte stays poisoned.
    let size = cache_dtype.size_bytes();
    let page_bytes = prep.shape[1..].iter().product::<usize>() * size;
    let now = jit.cache.blocks().as_bytes();
    for &p in &prep.guard_pages {
        let bytes = p * page_bytes..(p + 1) * page_bytes;
        if now[bytes.clone()] != prep.poisoned[bytes.clone()] {
            let first = bytes.clone().find(|&i| now[i] != prep.poisoned[i]).unwrap() / size;
            panic!("{case:?}: guard page {p} was written, first at blocks{:?}", unravel(&prep.shape, first));
        }
    }

    // K/V: written elements close to the reference; all others untouched.
    let got = jit.cache.blocks().to_f32_vec().unwrap();
    let want = reference.cache.blocks().to_f32_vec().unwrap();
    let ref_bytes = reference.cache.blocks().as_bytes();
    for (i, &written) in prep.written.iter().enumerate() {
        let bytes = i * size..(i + 1) * size;
        if written {
            assert_close(case, prep, cache_dtype, got[i], want[i], || format!("blocks{:?}", unravel(&prep.shape, i)));
        } else {
            assert!(
                now[bytes.clone()] == prep.poisoned[bytes.clone()],
                "{case:?}: blocks{:?} = {} was written, but the contract writes nothing there",
                unravel(&prep.shape, i),
                got[i]
            );
            assert!(
                ref_bytes[bytes.clone()] == prep.poisoned[bytes],
                "{case:?}: the reference wrote outside the contract"
            );
        }
    }
}

/// Run a case through the JIT and the reference and compare.
/// Run `case` through the JIT kernel and the reference and compare; a case
/// of tier `Auto` runs on every tier this CPU has.
fn check_case(case: &Case) {
    if case.tier == CpuTier::Auto {
        for tier in tiers() {
            check_case(&Case { tier, ..case.clone() });
        }
        return;
    }
    let prep = case.prepare();
    let kernel = case.kernel(&prep);
    let reference = run_reference(case, &prep);
    let jit = run_jit(case, &prep, &kernel, cpu(case.threads));
    assert_matches_reference(case, &prep, &jit, &reference);
}

// ---------------------------------------------------------------------------
// 1. Random cases
// ---------------------------------------------------------------------------

/// Random cases per activation dtype.
const CASES_PER_DTYPE: u64 = 110;
/// Most multiply-adds (M·N·K) a random case may cost the reference.
const MAC_BUDGET: usize = 3_000_000;
/// Most cache elements a random case may poison and compare.
const CACHE_BUDGET: usize = 1_000_000;

const HEADS_SMALL: [usize; 4] = [1, 3, 5, 8];
const HEADS_REAL: [usize; 4] = [64, 80, 128, 256];
const RATIOS: [usize; 3] = [1, 4, 8];
/// K values: small ones, and ones around the 256-bit tier's k blocks (256
/// f32 or 512 bf16/f16 values) — one block and a tail, several blocks.
const DIMS_K: [usize; 21] = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64, 100, 129, 130, 256, 300, 515, 1030];
const PAGE_SIZES: [usize; 12] = [1, 2, 3, 4, 5, 7, 8, 16, 32, 64, 128, 256];

fn pick<T: Copy>(rng: &mut StdRng, items: &[T]) -> T {
    *items.choose(rng).unwrap()
}

fn draw(seed: u64, dtype: DType) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    loop {
        let real_heads = rng.gen_bool(0.5);
        let d = pick(&mut rng, if real_heads { &HEADS_REAL } else { &HEADS_SMALL });
        let hkv = rng.gen_range(1..=if real_heads { 2 } else { 4 });
        let (batch, seq) = match rng.gen_range(0..5) {
            0 => (rng.gen_range(1..=5), 1),                        // decode
            1 => (rng.gen_range(1..=3), rng.gen_range(1..=12)),    // short prefill
            2 => (rng.gen_range(1..=3), rng.gen_range(20..=75)),   // M around and past MC
            3 => (1, rng.gen_range(60..=150)),                     // one long row block run
            _ => (rng.gen_range(1..=2), rng.gen_range(100..=220)), // past the 256-bit tier's block
        };
        let page_size = pick(&mut rng, &PAGE_SIZES);
        let layers = rng.gen_range(1..=4);
        let cache_lengths = (0..batch).map(|_| rng.gen_range(0..=2 * page_size as u32 + 3)).collect();
        let valid = (0..batch)
            .map(|_| match rng.gen_range(0..4) {
                0 => 0,
                1 => seq as u32,
                _ => rng.gen_range(0..=seq as u32),
            })
            .collect();
        let cache_dtype = if rng.gen_bool(0.5) { dtype } else { pick(&mut rng, &DType::FLOATS) };
        let call = if rng.gen_bool(0.8) {
            Call::RunInto { front: rng.gen_range(1..=40), back: rng.gen_range(1..=40) }
        } else {
            Call::Run
        };
        let case = Case {
            seed,
            dtype,
            cache_dtype,
            batch,
            seq,
            k: pick(&mut rng, &DIMS_K),
            hkv,
            d,
            ratio: pick(&mut rng, &RATIOS),
            page_size,
            layers,
            layer: rng.gen_range(0..layers),
            cache_lengths,
            valid,
            padded_pages: pick(&mut rng, &[PaddedPages::Unassigned, PaddedPages::Fresh, PaddedPages::Aliased]),
            extra_table_pages: rng.gen_range(0..=2),
            guard_pages: (rng.gen_range(1..=2), rng.gen_range(1..=2)),
            values: match rng.gen_range(0..20) {
                0..=2 => Values::Dyadic,
                3..=4 => Values::Tiny,
                _ => Values::Uniform,
            },
            const_weight: rng.gen_bool(0.5),
            static_batch: rng.gen_bool(0.4),
            static_seq: rng.gen_bool(0.4),
            threads: pick(&mut rng, &[1, 2, 3]),
            call,
            tier: pick(&mut rng, &tiers()),
            unspecialized: false,
            weights: None,
        };
        // A third of the 256-bit cases run the unspecialized kernel.
        let case = Case { unspecialized: case.tier == CpuTier::Avx2 && rng.gen_bool(0.33), ..case };
        if case.rows() * case.n() * case.k <= MAC_BUDGET && case.cache_elements() <= CACHE_BUDGET {
            return case;
        }
    }
}

fn run_random(dtype: DType, base_seed: u64) {
    for i in 0..CASES_PER_DTYPE {
        check_case(&draw(base_seed + i, dtype));
    }
}

#[test]
fn random_f32_cases_match_the_reference() {
    run_random(DType::F32, 0x0f32_0000);
}

#[test]
fn random_bf16_cases_match_the_reference() {
    run_random(DType::BF16, 0xbf16_0000);
}

#[test]
fn random_f16_cases_match_the_reference() {
    run_random(DType::F16, 0x0f16_0000);
}

/// A named property of a case.
type Property<'a> = (&'a str, &'a dyn Fn(&Case) -> bool);

/// The random cases cover what they are meant to cover (so a change to
/// `draw` cannot quietly stop exercising a path).
#[test]
fn random_cases_cover_the_kernel_paths() {
    let cases: Vec<Case> = [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .zip([0x0f32_0000, 0xbf16_0000, 0x0f16_0000])
        .flat_map(|(dtype, base)| (0..CASES_PER_DTYPE).map(move |i| draw(base + i, dtype)))
        .collect();
    let count = |f: &dyn Fn(&Case) -> bool| cases.iter().filter(|c| f(c)).count();
    let checks: [Property; 23] = [
        ("M % tile rows != 0", &|c| !c.rows().is_multiple_of(c.schedule().tile_rows)),
        ("M > block rows", &|c| c.rows() > c.schedule().block_rows),
        ("M > 2·MC (Cranelift tier)", &|c| c.tier == CpuTier::Cranelift && c.rows() > 2 * MC),
        ("K % 4 != 0", &|c| !c.k.is_multiple_of(4)),
        ("K past a k block", &|c| c.k > (16 << 10) / (16 * c.dtype.size_bytes())),
        ("q_dim % panel columns != 0", &|c| !c.q_dim().is_multiple_of(c.schedule().panel_columns)),
        ("kv_dim % panel columns != 0", &|c| !c.kv_dim().is_multiple_of(c.schedule().panel_columns)),
        ("Cranelift tier", &|c| c.tier == CpuTier::Cranelift),
        ("unspecialized kernel (where the CPU has the 256-bit tier)", &|c| {
            c.unspecialized || !kvjit_jit::microkernel::avx2_available()
        }),
        ("256-bit tier (where the CPU has it)", &|c| c.tier == *tiers().last().unwrap()),
        ("head 256", &|c| c.d == 256),
        ("GQA 8", &|c| c.ratio == 8),
        ("page size 1", &|c| c.page_size == 1),
        ("page size 256", &|c| c.page_size == 256),
        ("a padded row", &|c| c.valid.iter().any(|&v| (v as usize) < c.seq)),
        ("a sequence with no valid row", &|c| c.valid.contains(&0)),
        ("page crossing", &|c| {
            (0..c.batch).any(|b| {
                let (first, last) = (c.cache_lengths[b], c.cache_lengths[b] + c.valid[b]);
                last > first && (first as usize) / c.page_size != (last as usize - 1) / c.page_size
            })
        }),
        ("layer_idx != 0", &|c| c.layer != 0),
        ("cache dtype differs", &|c| c.cache_dtype != c.dtype),
        ("const weight", &|c| c.const_weight),
        ("fully static", &|c| c.static_batch && c.static_seq),
        ("exact values", &|c| c.values == Values::Dyadic),
        ("tiny values", &|c| c.values == Values::Tiny),
    ];
    for (what, f) in checks {
        let n = count(f);
        assert!(n >= 5, "only {n} of {} random cases have {what}", cases.len());
    }
}

fn realistic(dtype: DType, cache_dtype: DType, batch: usize, seq: usize, valid: Vec<u32>) -> Case {
    Case {
        seed: 0x4096 + batch as u64 * 31 + seq as u64,
        dtype,
        cache_dtype,
        batch,
        seq,
        k: 4096,
        hkv: 8,
        d: 128,
        ratio: 4,
        page_size: 16,
        layers: 2,
        layer: 1,
        cache_lengths: (0..batch as u32).map(|b| 13 + 7 * b).collect(),
        valid,
        padded_pages: PaddedPages::Fresh,
        extra_table_pages: 1,
        guard_pages: (1, 1),
        values: Values::Uniform,
        const_weight: true,
        static_batch: false,
        static_seq: false,
        threads: 2,
        call: Call::RunInto { front: 64, back: 64 },
        tier: CpuTier::Auto,
        unspecialized: false,
        weights: None,
    }
}

/// Weights in every block format, on every tier: one decoded row (the
/// integer GEMV on the 256-bit tier for 32-weight blocks) and a prefill of
/// several row tiles, written into f32 and bf16 caches.
#[test]
fn block_weights_match_the_reference() {
    for (i, format) in DType::BLOCK_FORMATS.into_iter().enumerate() {
        for (batch, seq, valid) in [(1, 1, vec![1]), (2, 7, vec![7, 4])] {
            for cache_dtype in [DType::F32, DType::BF16] {
                let case = Case {
                    seed: 0xb10c + i as u64,
                    k: 512,
                    hkv: 2,
                    d: 16,
                    ratio: 2,
                    cache_lengths: vec![3; batch],
                    valid: valid.clone(),
                    batch,
                    seq,
                    cache_dtype,
                    weights: Some(format),
                    const_weight: seq > 1,
                    threads: 2,
                    ..Case::base(DType::F32)
                };
                check_case(&case);
            }
        }
    }
}

#[test]
fn realistic_f32_prefill_m16() {
    check_case(&realistic(DType::F32, DType::F32, 2, 8, vec![8, 5]));
}

#[test]
fn realistic_bf16_decode_m4() {
    let case =
        Case { static_batch: true, static_seq: true, ..realistic(DType::BF16, DType::BF16, 4, 1, vec![1, 1, 0, 1]) };
    check_case(&case);
}

#[test]
fn realistic_f16_decode_m1_f32_cache() {
    let case = Case { const_weight: false, ..realistic(DType::F16, DType::F32, 1, 1, vec![1]) };
    check_case(&case);
}

// ---------------------------------------------------------------------------
// Edge shapes
// ---------------------------------------------------------------------------

#[test]
fn k_zero_writes_zeros() {
    for dtype in DType::FLOATS {
        let case = Case { k: 0, batch: 2, seq: 3, cache_lengths: vec![1, 5], valid: vec![3, 1], ..Case::base(dtype) };
        check_case(&case);
        let prep = case.prepare();
        let ran = run_jit(&case, &prep, &case.kernel(&prep), cpu(2));
        assert!(to_f32(dtype, &ran.output).iter().all(|&v| v.to_bits() == 0), "{dtype}: K = 0 gives +0 everywhere");
    }
}

#[test]
fn empty_batch_and_empty_sequences() {
    // On every tier, specialized, generic and unspecialized kernels alike.
    for dtype in DType::FLOATS {
        check_case(&Case { batch: 0, seq: 3, cache_lengths: vec![], valid: vec![], threads: 2, ..Case::base(dtype) });
        check_case(&Case {
            batch: 2,
            seq: 0,
            cache_lengths: vec![3, 0],
            valid: vec![0, 0],
            threads: 3,
            ..Case::base(dtype)
        });
        let fully_static = Case {
            batch: 0,
            cache_lengths: vec![],
            valid: vec![],
            static_batch: true,
            static_seq: true,
            ..Case::base(dtype)
        };
        check_case(&fully_static);
        if tiers().contains(&CpuTier::Avx2) {
            let unspecialized = |case: Case| Case { tier: CpuTier::Avx2, unspecialized: true, ..case };
            check_case(&unspecialized(Case {
                batch: 0,
                seq: 2,
                cache_lengths: vec![],
                valid: vec![],
                ..Case::base(dtype)
            }));
            check_case(&unspecialized(Case {
                batch: 3,
                seq: 0,
                cache_lengths: vec![0, 2, 9],
                valid: vec![0, 0, 0],
                threads: 2,
                ..Case::base(dtype)
            }));
        }
    }
}

/// Every tile height the generic kernel dispatches on (every remainder of M
/// by the tile height, whole blocks plus each remainder) with a specialized
/// twin, one row count at a time, on every tier.
#[test]
fn every_row_count_up_to_two_blocks_plus_one() {
    for tier in tiers() {
        for m in 1..=2 * Schedule::of(resolve_tier(tier).unwrap()).block_rows + 1 {
            check_case(&row_count_case(m, tier));
        }
    }
}

fn row_count_case(m: usize, tier: CpuTier) -> Case {
    Case {
        seed: m as u64,
        batch: 1,
        seq: m,
        k: 3 + m % 5,
        hkv: 1,
        d: 3,
        ratio: 3,
        page_size: 5,
        cache_lengths: vec![m as u32 % 7],
        valid: vec![(m - m / 3) as u32],
        values: if m.is_multiple_of(2) { Values::Dyadic } else { Values::Uniform },
        static_batch: m % 4 == 1,
        static_seq: m % 4 == 1,
        threads: 1 + m % 3,
        tier,
        ..Case::base(DType::FLOATS[m % 3])
    }
}

// ---------------------------------------------------------------------------
// 2. Thread counts, 3. generic versus specialized
// ---------------------------------------------------------------------------

fn bitwise_cases() -> Vec<Case> {
    let base = |dtype, cache_dtype| Case { cache_dtype, layers: 3, layer: 2, ..Case::base(dtype) };
    vec![
        // M = 150 (two whole MC blocks and a 22-row one), tails everywhere.
        Case {
            batch: 3,
            seq: 50,
            k: 33,
            hkv: 2,
            d: 5,
            ratio: 4,
            page_size: 7,
            cache_lengths: vec![3, 0, 11],
            valid: vec![50, 17, 0],
            padded_pages: PaddedPages::Aliased,
            ..base(DType::F32, DType::BF16)
        },
        // Decode with many panels (160): threads split the weight.
        Case {
            batch: 3,
            seq: 1,
            k: 29,
            hkv: 2,
            d: 64,
            ratio: 8,
            page_size: 16,
            cache_lengths: vec![15, 16, 40],
            valid: vec![1, 1, 0],
            ..base(DType::BF16, DType::BF16)
        },
        // M = 67, 3-column tail panels, f16 into an f32 cache.
        Case {
            batch: 1,
            seq: 67,
            k: 17,
            hkv: 3,
            d: 3,
            ratio: 1,
            page_size: 3,
            cache_lengths: vec![2],
            valid: vec![60],
            padded_pages: PaddedPages::Fresh,
            ..base(DType::F16, DType::F32)
        },
        // Fewer panels (3) than threads (up to 8).
        Case {
            batch: 2,
            seq: 5,
            k: 7,
            hkv: 1,
            d: 1,
            ratio: 1,
            page_size: 2,
            cache_lengths: vec![1, 4],
            valid: vec![5, 2],
            ..base(DType::BF16, DType::F16)
        },
        // Q columns a multiple of NR, KV columns not.
        Case {
            batch: 2,
            seq: 3,
            k: 130,
            hkv: 1,
            d: 84,
            ratio: 8,
            page_size: 256,
            cache_lengths: vec![254, 0],
            valid: vec![3, 2],
            ..base(DType::F16, DType::F16)
        },
    ]
}

/// The bitwise cases on every tier.
fn bitwise_cases_on_every_tier() -> Vec<Case> {
    tiers().into_iter().flat_map(|tier| bitwise_cases().into_iter().map(move |c| Case { tier, ..c })).collect()
}

#[test]
fn any_thread_count_gives_identical_bytes() {
    for case in bitwise_cases_on_every_tier() {
        let prep = case.prepare();
        let kernel = case.kernel(&prep);
        let runs: Vec<Ran> = THREADS.iter().map(|&t| run_jit(&case, &prep, &kernel, cpu(t))).collect();
        for (threads, run) in THREADS.iter().zip(&runs).skip(1) {
            assert!(run.output == runs[0].output, "{case:?}: {threads} threads: output differs from 1 thread");
            assert!(
                run.cache.blocks().as_bytes() == runs[0].cache.blocks().as_bytes(),
                "{case:?}: {threads} threads: cache differs from 1 thread"
            );
        }
        assert_matches_reference(&case, &prep, &runs[0], &run_reference(&case, &prep));
    }
}

#[test]
fn generic_and_specialized_kernels_give_identical_bytes() {
    let mut cases = bitwise_cases_on_every_tier();
    for (m, s, tier) in tiers().into_iter().flat_map(|tier| {
        [(1, 1), (5, 5), (66, 22), (130, 65), (64, 64), (4, 1), (6, 6), (200, 100)].map(|(m, s)| (m, s, tier))
    }) {
        let batch = m / s;
        cases.push(Case {
            tier,
            seed: m as u64,
            batch,
            seq: s,
            k: 9,
            hkv: 2,
            d: 3,
            ratio: 4,
            page_size: 4,
            cache_lengths: (0..batch as u32).map(|b| b * 3).collect(),
            valid: (0..batch).map(|b| (s - b % 2) as u32).collect(),
            ..Case::base(DType::FLOATS[m % 3])
        });
    }
    for case in cases {
        let prep = case.prepare();
        let mut runs = Vec::new();
        for (static_batch, static_seq) in [(false, false), (true, false), (false, true), (true, true)] {
            for const_weight in [false, true] {
                let variant = Case { static_batch, static_seq, const_weight, ..case.clone() };
                runs.push((variant.clone(), run_jit(&variant, &prep, &variant.kernel(&prep), cpu(2))));
            }
        }
        let (first, first_run) = &runs[0];
        for (variant, run) in &runs[1..] {
            let what = format!(
                "batch {:?} seq {:?} const weight {} vs generic: {case:?}",
                variant.static_batch, variant.static_seq, variant.const_weight
            );
            assert!(run.output == first_run.output, "{what}: output differs");
            assert!(run.cache.blocks().as_bytes() == first_run.cache.blocks().as_bytes(), "{what}: cache differs");
        }
        assert_matches_reference(first, &prep, first_run, &run_reference(first, &prep));
    }
}

/// The unspecialized kernel (K, the column counts and the cache layout read
/// at run time) runs the same tiles in the same order as the generic one:
/// identical bytes; and one compiled kernel serves every spec of its dtypes.
#[test]
fn unspecialized_and_generic_kernels_give_identical_bytes() {
    if !kvjit_jit::microkernel::avx2_available() {
        let spec = Case { tier: CpuTier::Cranelift, ..Case::base(DType::F32) }.spec();
        let refused = JitKernel::unspecialized(spec, None);
        assert!(refused.is_err_and(|e| e.to_string().contains("avx2 tier only")));
        return;
    }
    let mut cases: Vec<Case> = bitwise_cases().into_iter().map(|c| Case { tier: CpuTier::Avx2, ..c }).collect();
    cases.extend((0..12).map(|i| Case { tier: CpuTier::Avx2, ..draw(0x5eed_0000 + i, DType::FLOATS[i as usize % 3]) }));
    for case in cases {
        let prep = case.prepare();
        let generic = Case { static_batch: false, static_seq: false, unspecialized: false, ..case.clone() };
        let unspecialized = Case { unspecialized: true, ..generic.clone() };
        let a = run_jit(&generic, &prep, &generic.kernel(&prep), cpu(2));
        let b = run_jit(&unspecialized, &prep, &unspecialized.kernel(&prep), cpu(2));
        assert!(a.output == b.output, "{case:?}: output differs");
        assert!(a.cache.blocks().as_bytes() == b.cache.blocks().as_bytes(), "{case:?}: cache differs");
        assert_matches_reference(&unspecialized, &prep, &b, &run_reference(&unspecialized, &prep));
    }
    // One key for every spec of the dtypes.
    let [x, y] = [Case::base(DType::BF16), Case { k: 77, hkv: 3, d: 5, ..Case::base(DType::BF16) }]
        .map(|c| Compiled::new(JitKernel::unspecialized(Case { tier: CpuTier::Avx2, ..c }.spec(), None).unwrap()));
    assert_eq!(kvjit_runtime::Kernel::key(&x), kvjit_runtime::Kernel::key(&y));
    let key = kvjit_runtime::Kernel::key(&x).to_string();
    assert!(key.contains(".cpu-avx2.bf16.kany.qany.hkvany.dany.pany.lany."), "{key}");
}

/// The seen-shape policy (a generic kernel compiling a specialized one per
/// (B, S) it runs with, up to [`MAX_SEEN_SHAPES`]) changes no bit, compiles
/// each shape once, and falls back to the generic code past the limit.
#[test]
fn seen_shape_specialization_gives_identical_bytes() {
    // A spec no other test uses, so the compile log counts only this test.
    let base = Case {
        k: 23,
        hkv: 3,
        d: 3,
        ratio: 2,
        page_size: 6,
        layers: 2,
        layer: 1,
        cache_dtype: DType::F16,
        ..Case::base(DType::BF16)
    };
    let spec = base.spec();
    let policy = Compiled::new(JitKernel::with_policy(spec, None, CaptureText::default(), true).unwrap());
    let plain = Compiled::new(JitKernel::new(spec, None, CaptureText::default()).unwrap());
    let seen_compiles = || {
        let generic = spec.key().to_string();
        cpu_jit::compile_log()
            .iter()
            .filter(|r| matches!(&r.cause, CompileCause::ShapeSeen(why) if why.ends_with(&format!(" for {generic}"))))
            .count()
    };
    assert_eq!(seen_compiles(), 0);
    let mut shapes: Vec<(usize, usize)> = (1..=MAX_SEEN_SHAPES + 3).map(|i| (1 + i % 3, i + 4 * (i % 2))).collect();
    shapes.insert(3, shapes[0]); // seen before: no new compile
    let mut distinct = std::collections::HashSet::new();
    for (i, &(batch, seq)) in shapes.iter().enumerate() {
        let case = Case {
            seed: i as u64,
            batch,
            seq,
            cache_lengths: (0..batch as u32).map(|b| 5 * b + 1).collect(),
            valid: (0..batch).map(|b| (seq - b % 2) as u32).collect(),
            threads: 1 + i % 3,
            ..base.clone()
        };
        let prep = case.prepare();
        let (a, b) = (run_jit(&case, &prep, &policy, cpu(case.threads)), run_jit(&case, &prep, &plain, cpu(1)));
        assert!(a.output == b.output, "B={batch}, S={seq}: output differs from the generic kernel's");
        assert!(a.cache.blocks().as_bytes() == b.cache.blocks().as_bytes(), "B={batch}, S={seq}: cache differs");
        assert_matches_reference(&case, &prep, &a, &run_reference(&case, &prep));
        distinct.insert((batch, seq));
        assert_eq!(seen_compiles(), distinct.len().min(MAX_SEEN_SHAPES), "after {} calls", i + 1);
    }
}

// ---------------------------------------------------------------------------
// 4. Validation parity
// ---------------------------------------------------------------------------

// The bad-input fixture of bad_inputs.rs: the test kit's paged step (B = 3,
// S = 4; L = 2, page size 2, P = 10, 4 pages per sequence) with K = 5,
// Hkv = 2, D = 2, q_dim = 4 (N = 12).
const PB: usize = paged::B;
const PS: usize = paged::S;
const PK: usize = 5;
const PHKV: usize = 2;
const PD: usize = 2;
const PQ: usize = 4;
const PN: usize = PQ + 2 * PHKV * PD;
const PL: usize = paged::LAYERS;
const PPAGE: usize = paged::PAGE_SIZE;
const PPAGES: usize = paged::PAGES;
const PMAX: usize = paged::MAX_PAGES;
const PBLOCKS: [usize; 6] = [PPAGES, 2, PL, PPAGE, PHKV, PD];

/// A valid call (exact dyadic inputs, so accepted calls agree bit for bit)
/// whose output and cache hold random finite bytes, and the spec of the
/// kernels that run it.
#[derive(Clone, Debug)]
struct Fixture {
    hidden: Tensor,
    weight: Arc<Tensor>,
    cache: PagedKVCacheCollection,
    layer_idx: Tensor,
    valid: Tensor,
    output: Tensor,
    spec: FusedQkvSpec,
}

impl Fixture {
    fn new(dtype: DType) -> Self {
        let mut rng = StdRng::seed_from_u64(11);
        let cache = paged::cache(&mut rng, dtype, PHKV, PD, None);
        Self {
            hidden: dyadic(&mut rng, dtype, &[PB, PS, PK], 8),
            weight: Arc::new(dyadic(&mut rng, dtype, &[PN, PK], 8)),
            cache,
            layer_idx: paged::layer_idx(),
            valid: paged::valid_lengths(),
            output: Tensor::random(dtype, &[PB, PS, PQ], &mut rng, -1.0, 1.0).unwrap(),
            spec: FusedQkvSpec {
                backend: Backend::Cpu(resolve_tier(CpuTier::Auto).unwrap()),
                dtype,
                weights: dtype,
                cache: KvCacheParams {
                    element: CacheElement::new(dtype, None).unwrap(),
                    num_layers: PL,
                    page_size: PPAGE,
                    num_kv_heads: PHKV,
                    head_size: PD,
                },
                k: PK,
                q_dim: PQ,
                step: StepDims { batch: None, seq: None },
                sizes: Sizes::Baked,
            },
        }
    }

    fn inputs(&self) -> [&Tensor; 4] {
        [&self.hidden, &*self.weight, &self.layer_idx, &self.valid]
    }

    /// `check` then `run` of any kernel; both verdicts.
    fn check_and_run(&mut self, kernel: &dyn Kernel) -> (Result<()>, Result<()>) {
        let checked = kernel.check(&self.inputs(), &[&self.cache]).map(|_| ());
        let inputs = [&self.hidden, &*self.weight, &self.layer_idx, &self.valid];
        let ran = kernel.run(&inputs, &mut [&mut self.cache], std::slice::from_mut(&mut self.output), cpu(2));
        (checked, ran)
    }

    /// `run_into` with the output's bytes between guards; the verdict and the
    /// buffer (guards included) afterwards.
    fn run_into(&mut self, kernel: &Compiled<JitKernel>) -> (Result<()>, Guarded) {
        let mut buffer = Guarded::new(5, self.output.as_bytes(), 7);
        let result = kernel.kernel().run_into(
            QkvArgs {
                hidden_state: &self.hidden,
                weight: &self.weight,
                kv_collection: &mut self.cache,
                layer_idx: &self.layer_idx,
                valid_lengths: &self.valid,
            },
            buffer.body_mut(),
            cpu(2),
        );
        (result, buffer)
    }
}

/// Which calls a mutation concerns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// Bad inputs or spec: `check`, `run` and `run_into` reject them.
    Inputs,
    /// A bad output tensor: `check` (which sees no output) accepts, `run` rejects.
    Output,
    /// Still a valid call: everything accepts, and the JIT writes what the reference writes.
    Accepted,
}

type Mutation = (&'static str, Scope, Box<dyn Fn(&mut Fixture)>);

fn mutations(dtype: DType) -> Vec<Mutation> {
    use Scope::{Accepted, Inputs, Output};
    let other = if dtype == DType::F32 { DType::BF16 } else { DType::F32 };
    let m = |name, scope, f: Box<dyn Fn(&mut Fixture)>| (name, scope, f);
    let zeros = move |shape: &[usize]| Tensor::zeros(dtype, shape).unwrap();
    let table = |i: usize, page: u32| -> Box<dyn Fn(&mut Fixture)> {
        Box::new(move |fx| fx.cache.lookup_table_mut()[i] = page)
    };
    let spec =
        |f: fn(FusedQkvSpec) -> FusedQkvSpec| -> Box<dyn Fn(&mut Fixture)> { Box::new(move |fx| fx.spec = f(fx.spec)) };
    let cache_spec = |f: fn(KvCacheParams) -> KvCacheParams| -> Box<dyn Fn(&mut Fixture)> {
        Box::new(move |fx| fx.spec.cache = f(fx.spec.cache))
    };
    vec![
        m("valid as built", Accepted, Box::new(|_| {})),
        m("padded rows aliasing another sequence's page", Accepted, table(PMAX + 1, 4)),
        m("static batch and seq that match", Accepted, spec(|s| FusedQkvSpec { step: StepDims::fixed(PB, PS), ..s })),
        m(
            "weight of another dtype",
            Inputs,
            Box::new(move |fx| fx.weight = Arc::new(Tensor::zeros(other, &[PN, PK]).unwrap())),
        ),
        m(
            "hidden state of another dtype",
            Inputs,
            Box::new(move |fx| fx.hidden = Tensor::zeros(other, &[PB, PS, PK]).unwrap()),
        ),
        m(
            "hidden state of integers",
            Inputs,
            Box::new(|fx| fx.hidden = Tensor::from_vec(&[PB, PS, PK], vec![1u32; PB * PS * PK]).unwrap()),
        ),
        m("weight K - 1", Inputs, Box::new(move |fx| fx.weight = Arc::new(zeros(&[PN, PK - 1])))),
        m("weight K + 1", Inputs, Box::new(move |fx| fx.weight = Arc::new(zeros(&[PN, PK + 1])))),
        m(
            "weight without Q columns",
            Inputs,
            Box::new(move |fx| {
                fx.weight = Arc::new(zeros(&[PN - PQ, PK]));
                fx.output = zeros(&[PB, PS, 0]);
            }),
        ),
        m("weight of rank 1", Inputs, Box::new(move |fx| fx.weight = Arc::new(zeros(&[PN * PK])))),
        m("weight of rank 3", Inputs, Box::new(move |fx| fx.weight = Arc::new(zeros(&[1, PN, PK])))),
        m("hidden state of rank 2", Inputs, Box::new(move |fx| fx.hidden = zeros(&[PB * PS, PK]))),
        m("hidden state of rank 4", Inputs, Box::new(move |fx| fx.hidden = zeros(&[1, PB, PS, PK]))),
        m("valid_lengths too short", Inputs, Box::new(|fx| fx.valid = u32s(&[3, 2]))),
        m("valid_lengths too long", Inputs, Box::new(|fx| fx.valid = u32s(&[3, 2, 4, 0]))),
        m("valid_lengths empty", Inputs, Box::new(|fx| fx.valid = u32s(&[]))),
        m(
            "valid_lengths [B, 1]",
            Inputs,
            Box::new(|fx| fx.valid = Tensor::from_vec(&[PB, 1], paged::VALID.to_vec()).unwrap()),
        ),
        m(
            "valid_lengths as floats",
            Inputs,
            Box::new(|fx| fx.valid = Tensor::from_f32(DType::F32, &[PB], &[3.0, 2.0, 4.0]).unwrap()),
        ),
        m("layer_idx [2]", Inputs, Box::new(|fx| fx.layer_idx = u32s(&[0, 0]))),
        m("layer_idx [1, 1]", Inputs, Box::new(|fx| fx.layer_idx = Tensor::from_vec(&[1, 1], vec![0u32]).unwrap())),
        m("layer_idx f32", Inputs, Box::new(|fx| fx.layer_idx = Tensor::from_f32(DType::F32, &[], &[0.0]).unwrap())),
        m("valid length > S", Inputs, Box::new(|fx| fx.valid = u32s(&[3, 2, 5]))),
        m("layer_idx = L", Inputs, Box::new(|fx| fx.layer_idx = Tensor::scalar_u32(PL as u32))),
        m("layer_idx = u32::MAX", Inputs, Box::new(|fx| fx.layer_idx = Tensor::scalar_u32(u32::MAX))),
        m("logical page beyond the table", Inputs, Box::new(|fx| fx.cache.cache_lengths_mut()[2] = 5)),
        m("cache length near u32::MAX", Inputs, Box::new(|fx| fx.cache.cache_lengths_mut()[2] = u32::MAX - 1)),
        m("physical page = P", Inputs, table(2 * PMAX + 3, PPAGES as u32)),
        m("physical page = u32::MAX - 1", Inputs, table(2 * PMAX + 1, u32::MAX - 1)),
        m("unassigned page for a valid token", Inputs, table(2 * PMAX + 2, U)),
        m("two sequences sharing a slot", Inputs, table(PMAX, 4)),
        m("one sequence mapping two logical pages to one page", Inputs, table(2 * PMAX + 2, 0)),
        m(
            "cache for B - 1 sequences",
            Inputs,
            Box::new(move |fx| fx.cache = cache_from_table(dtype, PBLOCKS, &[0; PB - 1], &[0; (PB - 1) * PMAX], PMAX)),
        ),
        m(
            "cache for B + 1 sequences",
            Inputs,
            Box::new(move |fx| fx.cache = cache_from_table(dtype, PBLOCKS, &[0; PB + 1], &[U; (PB + 1) * PMAX], PMAX)),
        ),
        m("hidden state not contiguous", Inputs, Box::new(|fx| fx.hidden = strided_view(&fx.hidden, &[1, 0, 2]))),
        m("weight not contiguous", Inputs, Box::new(|fx| fx.weight = Arc::new(strided_view(&fx.weight, &[1, 0])))),
        m(
            "spec: cache dtype",
            Inputs,
            Box::new(move |fx| fx.spec.cache.element = CacheElement::new(other, None).unwrap()),
        ),
        m("spec: num_layers", Inputs, cache_spec(|c| KvCacheParams { num_layers: PL + 1, ..c })),
        m("spec: page_size", Inputs, cache_spec(|c| KvCacheParams { page_size: 2 * PPAGE, ..c })),
        m("spec: num_kv_heads", Inputs, cache_spec(|c| KvCacheParams { num_kv_heads: 1, head_size: PHKV * PD, ..c })),
        m("spec: head_size", Inputs, cache_spec(|c| KvCacheParams { head_size: PD + 1, ..c })),
        m("spec: K", Inputs, spec(|s| FusedQkvSpec { k: PK + 1, ..s })),
        m(
            "spec: static batch",
            Inputs,
            spec(|s| FusedQkvSpec { step: StepDims { batch: Some(PB + 1), ..s.step }, ..s }),
        ),
        m("spec: static seq", Inputs, spec(|s| FusedQkvSpec { step: StepDims { seq: Some(PS - 1), ..s.step }, ..s })),
        m("spec: q_dim", Inputs, spec(|s| FusedQkvSpec { q_dim: PQ + 2, ..s })),
        m("spec: activation dtype", Inputs, Box::new(move |fx| fx.spec.dtype = other)),
        m(
            "output of another dtype",
            Output,
            Box::new(move |fx| fx.output = Tensor::zeros(other, &[PB, PS, PQ]).unwrap()),
        ),
        m("output [B, S, N]", Output, Box::new(move |fx| fx.output = zeros(&[PB, PS, PN]))),
        m("output [B, S, q_dim + 1]", Output, Box::new(move |fx| fx.output = zeros(&[PB, PS, PQ + 1]))),
        m("output [B, S - 1, q_dim]", Output, Box::new(move |fx| fx.output = zeros(&[PB, PS - 1, PQ]))),
        m("output [B + 1, S, q_dim]", Output, Box::new(move |fx| fx.output = zeros(&[PB + 1, PS, PQ]))),
        m("output [B·S, q_dim]", Output, Box::new(move |fx| fx.output = zeros(&[PB * PS, PQ]))),
        m("output [B, S, q_dim, 1]", Output, Box::new(move |fx| fx.output = zeros(&[PB, PS, PQ, 1]))),
        m("output not contiguous", Output, Box::new(|fx| fx.output = strided_view(&fx.output, &[1, 0, 2]))),
    ]
}

fn debug<T>(r: &Result<T>) -> String {
    format!("{:?}", r.as_ref().err())
}

fn check_parity(dtype: DType) {
    for (name, scope, mutate) in mutations(dtype) {
        let what = format!("{dtype} / {name}");
        let mut fx = Fixture::new(dtype);
        mutate(&mut fx);
        let spec = fx.spec;

        let mut reference_fx = fx.clone();
        let (ref_checked, ref_ran) = reference_fx.check_and_run(&Compiled::new(ReferenceKernel::new(spec)));
        match scope {
            Scope::Inputs => {
                assert!(ref_ran.is_err() && ref_checked.is_err(), "{what}: the reference accepted it");
                Snapshot::take(&fx.output, &fx.cache).assert_unchanged(
                    &reference_fx.output,
                    &reference_fx.cache,
                    &what,
                );
            }
            Scope::Output => assert!(ref_checked.is_ok() && ref_ran.is_err(), "{what}: reference {ref_ran:?}"),
            Scope::Accepted => assert!(ref_ran.is_ok(), "{what}: the reference rejected it: {ref_ran:?}"),
        }

        for const_weight in [false, true] {
            let what = format!("{what} (weight packed {})", if const_weight { "at build" } else { "per run" });
            let kernel = JitKernel::new(spec, const_weight.then(|| fx.weight.clone()), CaptureText::default())
                .map(Compiled::new)
                .unwrap_or_else(|e| panic!("{what}: {e}"));

            let mut jit_fx = fx.clone();
            let (checked, ran) = jit_fx.check_and_run(&kernel);
            assert_eq!(debug(&checked), debug(&ref_checked), "{what}: check differs from the reference kernel's");
            assert_eq!(debug(&ran), debug(&ref_ran), "{what}: run differs from the reference kernel's");
            if scope == Scope::Accepted {
                assert!(jit_fx.output.as_bytes() == reference_fx.output.as_bytes(), "{what}: run: output");
                assert!(
                    jit_fx.cache.blocks().as_bytes() == reference_fx.cache.blocks().as_bytes(),
                    "{what}: run: cache"
                );
            } else {
                Snapshot::take(&fx.output, &fx.cache).assert_unchanged(&jit_fx.output, &jit_fx.cache, &what);
            }

            if scope == Scope::Output {
                continue; // run_into takes no output tensor
            }
            let mut jit_fx = fx.clone();
            let (ran_into, buffer) = jit_fx.run_into(&kernel);
            assert_eq!(debug(&ran_into), debug(&ref_ran), "{what}: run_into differs from the reference kernel's run");
            buffer.assert_guards(&what);
            if scope == Scope::Accepted {
                assert!(buffer.body() == reference_fx.output.as_bytes(), "{what}: run_into: output");
                assert!(
                    jit_fx.cache.blocks().as_bytes() == reference_fx.cache.blocks().as_bytes(),
                    "{what}: run_into: cache"
                );
            } else {
                assert!(buffer == Guarded::new(5, fx.output.as_bytes(), 7), "{what}: run_into wrote its output");
                Snapshot::take(&fx.output, &fx.cache).assert_unchanged(&fx.output, &jit_fx.cache, &what);
            }
        }
    }
}

#[test]
fn validation_parity_f32() {
    check_parity(DType::F32);
}

#[test]
fn validation_parity_bf16() {
    check_parity(DType::BF16);
}

#[test]
fn validation_parity_f16() {
    check_parity(DType::F16);
}

#[test]
fn run_into_rejects_an_output_of_the_wrong_length() {
    for dtype in DType::FLOATS {
        let fx = Fixture::new(dtype);
        let kernel = JitKernel::new(fx.spec, None, CaptureText::default()).unwrap();
        let size = dtype.size_bytes();
        let expected = PB * PS * PQ * size;
        for len in [0, 1, size, expected - size, expected - 1, expected + 1, expected + size, 2 * expected] {
            let mut fx = fx.clone();
            let before = Snapshot::take(&fx.output, &fx.cache);
            let body = vec![0x5a; len];
            let mut buffer = Guarded::new(3, &body, 9);
            let result = kernel.run_into(
                QkvArgs {
                    hidden_state: &fx.hidden,
                    weight: &fx.weight,
                    kv_collection: &mut fx.cache,
                    layer_idx: &fx.layer_idx,
                    valid_lengths: &fx.valid,
                },
                buffer.body_mut(),
                cpu(2),
            );
            assert!(
                matches!(&result, Err(Error::ByteCount { dtype: d, shape, expected: e, got })
                    if *d == dtype && *shape == [PB, PS, PQ] && *e == expected && *got == len),
                "{dtype}, {len} bytes: {result:?}"
            );
            assert!(buffer == Guarded::new(3, &body, 9), "{dtype}, {len} bytes: the buffer was written");
            before.assert_unchanged(&fx.output, &fx.cache, &format!("{dtype}, {len} bytes"));
        }
    }
}

#[test]
fn run_rejects_the_wrong_number_of_arguments_like_the_reference() {
    let mut fx = Fixture::new(DType::F32);
    let jit = Compiled::new(JitKernel::new(fx.spec, None, CaptureText::default()).unwrap());
    let reference = Compiled::new(ReferenceKernel::new(fx.spec));
    let before = Snapshot::take(&fx.output, &fx.cache);
    let kernels: [&dyn Kernel; 2] = [&reference, &jit];
    let mut verdicts = Vec::new();
    for kernel in kernels {
        let three = [&fx.hidden, &*fx.weight, &fx.layer_idx];
        let a = kernel.run(&three, &mut [&mut fx.cache], std::slice::from_mut(&mut fx.output), cpu(1));
        let four = [&fx.hidden, &*fx.weight, &fx.layer_idx, &fx.valid];
        let mut other = fx.cache.clone();
        let b = kernel.run(&four, &mut [&mut fx.cache, &mut other], std::slice::from_mut(&mut fx.output), cpu(1));
        let b_none = kernel.run(&four, &mut [], std::slice::from_mut(&mut fx.output), cpu(1));
        let mut outputs = [fx.output.clone(), fx.output.clone()];
        let c = kernel.run(&four, &mut [&mut fx.cache], &mut outputs, cpu(1));
        assert!(
            outputs.iter().all(|o| o.as_bytes() == before.output),
            "{}: two outputs: written",
            kernel.implementation()
        );
        let d = kernel.run(&four, &mut [&mut fx.cache], &mut [], cpu(1));
        verdicts.push([a, b, b_none, c, d].map(|r| match r {
            Err(e) => std::mem::discriminant(&e),
            Ok(()) => panic!("{}: a call with the wrong argument count succeeded", kernel.implementation()),
        }));
        before.assert_unchanged(&fx.output, &fx.cache, kernel.implementation());
    }
    assert_eq!(verdicts[0], verdicts[1], "the JIT's error variants differ from the reference kernel's");
}

// ---------------------------------------------------------------------------
// 5. Packing
// ---------------------------------------------------------------------------

#[test]
fn packing_puts_every_weight_element_at_its_panel_position_and_pads_with_zero() {
    // q_dim 13 (a 5-column tail panel), kv_dim 5 (K and V each one 5-column
    // panel), K = 3; then a shape without tails.
    for (q_dim, hkv, d, k) in [(13, 1, 5, 3), (16, 2, 4, 2), (1, 1, 1, 1), (24, 3, 3, 7)] {
        let spec = FusedQkvSpec {
            backend: Backend::Cpu(CodeTier::Cranelift),
            dtype: DType::F32,
            weights: DType::F32,
            cache: KvCacheParams {
                element: CacheElement::F32,
                num_layers: 1,
                page_size: 1,
                num_kv_heads: hkv,
                head_size: d,
            },
            k,
            q_dim,
            step: StepDims { batch: None, seq: None },
            sizes: Sizes::Baked,
        };
        let kv_dim = hkv * d;
        let n = spec.n();
        for nr in [NR, Schedule::of(CodeTier::Avx2).panel_columns] {
            let panels = q_dim.div_ceil(nr) + 2 * kv_dim.div_ceil(nr);
            let layout = PanelLayout::new("fused_qkv", &[q_dim, kv_dim, kv_dim], k, nr, 1, WeightOrientation::NK);
            assert_eq!(layout.total_panels(), panels, "{spec:?}");
            assert_eq!(layout.packed_len(), panels * k * nr, "{spec:?}");
            // Distinct nonzero values (some round together in bf16).
            let values: Vec<f32> = (0..n * k).map(|i| (i + 1) as f32).collect();
            for dtype in DType::FLOATS {
                let weight = Tensor::from_f32(dtype, &[n, k], &values).unwrap();
                let values = weight.to_f32_vec().unwrap();
                let packed = layout.pack(&[&weight]).unwrap();
                assert_eq!(packed.dtype(), dtype, "packing keeps the dtype");
                assert_eq!(packed.shape(), [layout.packed_len()]);
                let packed = packed.to_f32_vec().unwrap();
                let mut filled = vec![false; packed.len()];
                for col in 0..n {
                    // Segment of the column: its first column and first panel.
                    let (first_col, first_panel) = if col < q_dim {
                        (0, 0)
                    } else if col < q_dim + kv_dim {
                        (q_dim, q_dim.div_ceil(nr))
                    } else {
                        (q_dim + kv_dim, q_dim.div_ceil(nr) + kv_dim.div_ceil(nr))
                    };
                    let j = col - first_col;
                    for kk in 0..k {
                        let at = (first_panel + j / nr) * k * nr + kk * nr + j % nr;
                        assert_eq!(packed[at], values[col * k + kk], "{dtype} {spec:?}: w[{col}, {kk}] at {at}");
                        assert!(!filled[at], "{dtype} {spec:?}: two elements packed at {at}");
                        filled[at] = true;
                    }
                }
                for (at, _) in filled.iter().enumerate().filter(|(_, f)| !**f) {
                    assert_eq!(packed[at].to_bits(), 0, "{dtype} {spec:?}: padding at {at} is not +0");
                }
                assert_eq!(filled.iter().filter(|f| **f).count(), n * k);
            }
            let ints = Tensor::from_vec(&[n, k], vec![1u32; n * k]).unwrap();
            assert!(matches!(layout.pack(&[&ints]), Err(Error::NotFloat { dtype: DType::U32, .. })));
        }
    }
}

// ---------------------------------------------------------------------------
// The kernel cache
// ---------------------------------------------------------------------------

#[test]
fn kernels_for_one_spec_share_their_code() {
    // A spec no other test uses, so parallel tests cannot compile it too.
    let tier = resolve_tier(CpuTier::Auto).unwrap();
    let spec = FusedQkvSpec {
        backend: Backend::Cpu(tier),
        dtype: DType::F16,
        weights: DType::F16,
        cache: KvCacheParams {
            element: CacheElement::BF16,
            num_layers: 7,
            page_size: 11,
            num_kv_heads: 3,
            head_size: 9,
        },
        k: 1013,
        q_dim: 27,
        step: StepDims { batch: None, seq: Some(3) },
        sizes: Sizes::Baked,
    };
    let key = spec.key().to_string();
    let compiles = || cpu_jit::compile_log().iter().filter(|r| r.key == key).count();
    assert_eq!(compiles(), 0, "{key} compiled before the test");
    let first = Compiled::new(JitKernel::new(spec, None, CaptureText::default()).unwrap());
    assert_eq!(compiles(), 1);
    let second = Compiled::new(JitKernel::new(spec, None, CaptureText::default()).unwrap());
    assert_eq!(compiles(), 1, "a second kernel for a live key compiled again");
    let (a, b) = (Kernel::code_info(&first), Kernel::code_info(&second));
    assert!(a.code_size > 0);
    assert_eq!(a.code_size, b.code_size);
    assert_eq!(a.ir, None, "no text without capture");
    // Kept texts bypass the cache: a fresh compile, not logged.
    let captured = Compiled::new(JitKernel::new(spec, None, CaptureText { clif: true, disasm: false }).unwrap());
    // The Cranelift tier's FMAs are in the IR; the 256-bit tier's tile is a
    // call to the micro-kernel.
    let tile = if tier == CodeTier::Avx2 { "call_indirect" } else { "fma" };
    assert!(Kernel::code_info(&captured).ir.is_some_and(|ir| ir.contains(tile)));
    assert_eq!(compiles(), 1, "a capturing compile entered the kernel cache");
    let record = cpu_jit::compile_log().into_iter().find(|r| r.key == key).unwrap();
    assert_eq!(record.code_size, a.code_size);
    assert_eq!(Kernel::key(&first).to_string(), key);
    assert!(key.contains(&format!(".cpu-{tier}.")), "{key} names its tier");
    assert_eq!(Kernel::implementation(&first), "jit");
    // Both kernels run (and agree).
    let case = Case {
        dtype: DType::F16,
        cache_dtype: DType::BF16,
        batch: 2,
        seq: 3,
        k: 1013,
        hkv: 3,
        d: 9,
        ratio: 1,
        page_size: 11,
        layers: 7,
        layer: 6,
        cache_lengths: vec![10, 0],
        valid: vec![3, 2],
        static_seq: true,
        ..Case::base(DType::F16)
    };
    assert_eq!(case.spec(), spec);
    let prep = case.prepare();
    let (x, y) = (run_jit(&case, &prep, &first, cpu(1)), run_jit(&case, &prep, &second, cpu(3)));
    assert!(x.output == y.output && x.cache.blocks().as_bytes() == y.cache.blocks().as_bytes());
    assert_matches_reference(&case, &prep, &x, &run_reference(&case, &prep));
}

/// Specs whose sizes the generated code could not address are refused with
/// a typed error (before any code is emitted), not miscompiled or panicking.
#[test]
fn absurd_specs_are_refused() {
    let spec = Case::base(DType::F32).spec();
    let huge = usize::MAX / 4;
    for (what, bad) in [
        ("K", FusedQkvSpec { k: huge, ..spec }),
        ("K·4·MR past i32", FusedQkvSpec { k: 1 << 31, ..spec }),
        ("q_dim", FusedQkvSpec { q_dim: huge, ..spec }),
        ("layers", FusedQkvSpec { cache: KvCacheParams { num_layers: huge, ..spec.cache }, ..spec }),
        ("page size", FusedQkvSpec { cache: KvCacheParams { page_size: huge, ..spec.cache }, ..spec }),
        ("head size", FusedQkvSpec { cache: KvCacheParams { head_size: huge, ..spec.cache }, ..spec }),
        ("static rows", FusedQkvSpec { step: StepDims::fixed(huge, huge), ..spec }),
    ] {
        let before = cpu_jit::compile_log().len();
        match JitKernel::new(bad, None, CaptureText::default()) {
            Err(kvjit_jit::JitError::Unsupported { key, .. }) => {
                assert_eq!(key, bad.key().to_string(), "{what}")
            }
            Err(e) => panic!("{what}: expected Unsupported, got {e}"),
            Ok(_) => panic!("{what}: a kernel was built for {bad:?}"),
        }
        assert!(
            cpu_jit::compile_log()[before..].iter().all(|r| {
                [CodeTier::Cranelift, CodeTier::Avx2]
                    .iter()
                    .all(|&t| r.key != FusedQkvSpec { backend: Backend::Cpu(t), ..bad }.key().to_string())
            }),
            "{what}: a refused spec entered the compile log"
        );
    }
}

// ---------------------------------------------------------------------------
// 6. Regressions (shrunk from failing random cases) and named corner cases
// ---------------------------------------------------------------------------

/// One row, one column per segment, page size 1: the smallest tails.
#[test]
fn corner_m1_k1_d1_page1() {
    for dtype in DType::FLOATS {
        check_case(&Case { k: 1, d: 1, page_size: 1, cache_lengths: vec![3], ..Case::base(dtype) });
    }
}

/// Output slices at every byte offset modulo 16 (unaligned stores).
#[test]
fn corner_unaligned_output() {
    for front in 1..=16 {
        let dtype = DType::FLOATS[front % 3];
        let case = Case {
            batch: 2,
            seq: 5,
            k: 5,
            hkv: 2,
            d: 5,
            ratio: 4,
            cache_lengths: vec![2, 7],
            valid: vec![5, 3],
            call: Call::RunInto { front, back: 17 - front },
            ..Case::base(dtype)
        };
        check_case(&case);
    }
}

/// Exact arithmetic where bf16/f16 rounding hits ties: results must round
/// to nearest even exactly as the reference does.
#[test]
fn corner_rounding_ties_are_bit_identical() {
    for (dtype, cache_dtype) in
        [(DType::F32, DType::BF16), (DType::F32, DType::F16), (DType::BF16, DType::BF16), (DType::F16, DType::F16)]
    {
        let case = Case {
            dtype,
            cache_dtype,
            batch: 2,
            seq: 9,
            k: 130,
            hkv: 2,
            d: 8,
            ratio: 4,
            page_size: 8,
            layers: 2,
            layer: 1,
            cache_lengths: vec![5, 0],
            valid: vec![9, 6],
            values: Values::Dyadic,
            ..Case::base(dtype)
        };
        check_case(&case);
    }
}

/// Exact arithmetic in f16's subnormal range (weights and results): the
/// JIT's f16 widening and narrowing must match `half` bit for bit there.
#[test]
fn corner_f16_subnormals_are_bit_identical() {
    // Products are multiples of 2^-25 of at most 2^-20 with random signs:
    // over K = 16384 of them the sums spread over f16's subnormals and its
    // lowest normal binades (still exact in f32: |C| < 2^-6).
    for (dtype, cache_dtype) in [(DType::F16, DType::F16), (DType::F32, DType::F16), (DType::BF16, DType::F16)] {
        let case = Case {
            dtype,
            cache_dtype,
            batch: 3,
            seq: 5,
            k: 16384,
            hkv: 2,
            d: 5,
            ratio: 4,
            page_size: 3,
            cache_lengths: vec![2, 0, 7],
            valid: vec![5, 4, 1],
            values: Values::Tiny,
            ..Case::base(dtype)
        };
        let prep = case.prepare();
        let reference = run_reference(&case, &prep);
        let kv = reference.cache.blocks().to_f32_vec().unwrap();
        let kv: Vec<f32> = kv.iter().zip(&prep.written).filter(|(_, w)| **w).map(|(v, _)| *v).collect();
        let min_normal = f16::MIN_POSITIVE.to_f32();
        let subnormal = kv.iter().filter(|v| v.abs() > 0.0 && v.abs() < min_normal).count();
        let low_normal = kv.iter().filter(|v| v.abs() >= min_normal && v.abs() < 4.0 * min_normal).count();
        assert!(
            subnormal > kv.len() / 5 && low_normal > kv.len() / 10,
            "{dtype}: the case must reach f16 subnormals ({subnormal}) and low normals ({low_normal}) of {}",
            kv.len()
        );
        check_case(&case);
    }
}

/// One kernel, called from several threads at once on different buffers
/// (each call splitting its work over a shared pool), gives what it gives
/// when called alone.
#[test]
fn one_kernel_runs_concurrently_from_several_threads() {
    let case = |seed| Case {
        seed,
        batch: 2,
        seq: 35,
        k: 19,
        hkv: 2,
        d: 5,
        ratio: 4,
        page_size: 8,
        cache_lengths: vec![3, 9],
        valid: vec![35, 20],
        const_weight: true,
        ..Case::base(DType::BF16)
    };
    let cases: Vec<Case> = (0..4).map(case).collect();
    let preps: Vec<Prepared> = cases.iter().map(Case::prepare).collect();
    // Constant weight: every seed must share the first one's weight.
    let preps: Vec<Prepared> = preps.into_iter().map(|p| Prepared { weight: cases[0].prepare().weight, ..p }).collect();
    let kernel = cases[0].kernel(&preps[0]);
    let alone: Vec<Ran> = cases.iter().zip(&preps).map(|(c, p)| run_jit(c, p, &kernel, cpu(2))).collect();
    let together: Vec<Ran> = std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .zip(&preps)
            .enumerate()
            .map(|(i, (c, p))| {
                let kernel = &kernel;
                s.spawn(move || run_jit(c, p, kernel, cpu([1, 2, 3, 8][i])))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert!(a.output == t.output, "call {i}: output differs when run concurrently");
        assert!(a.cache.blocks().as_bytes() == t.cache.blocks().as_bytes(), "call {i}: cache differs");
        assert_matches_reference(&cases[i], &preps[i], a, &run_reference(&cases[i], &preps[i]));
    }
}

/// A kernel built with a constant weight packs it once and uses that packed
/// copy only when a call's weight *is* the constant (the same allocation). A
/// call handed another weight of the same shape and dtype — different values,
/// or a copy of the constant — computes with the weight it was given, exactly
/// as the reference does. (Before the fix the kernel used the build-time
/// panels for every call of the right shape.)
#[test]
fn a_call_with_another_weight_computes_with_that_weight_not_the_build_constant() {
    for dtype in DType::FLOATS {
        let fx = Fixture::new(dtype);
        let kernel = Compiled::new(JitKernel::new(fx.spec, Some(fx.weight.clone()), CaptureText::default()).unwrap());
        let reference = Compiled::new(ReferenceKernel::new(fx.spec));
        let values = fx.weight.to_f32_vec().unwrap();
        let negated: Vec<f32> = values.iter().map(|v| -v - 0.125).collect();
        let others = [
            ("the constant itself", fx.weight.clone()),
            ("another weight", Arc::new(Tensor::from_f32(dtype, fx.weight.shape(), &negated).unwrap())),
            ("a copy of the constant", Arc::new((*fx.weight).clone())),
            ("the constant again after the other weights", fx.weight.clone()),
        ];
        for (what, weight) in others {
            let run = |kernel: &dyn Kernel| {
                let mut fx = fx.clone();
                let inputs = [&fx.hidden, &*weight, &fx.layer_idx, &fx.valid];
                kernel.run(&inputs, &mut [&mut fx.cache], std::slice::from_mut(&mut fx.output), cpu(2)).unwrap();
                (fx.output, fx.cache)
            };
            let (jit_out, jit_cache) = run(&kernel);
            let (ref_out, ref_cache) = run(&reference);
            assert_eq!(jit_out.as_bytes(), ref_out.as_bytes(), "{dtype}, {what}: output");
            assert_eq!(jit_cache.blocks().as_bytes(), ref_cache.blocks().as_bytes(), "{dtype}, {what}: cache");
        }
        // run_into goes through the same choice.
        let other = Arc::new(Tensor::from_f32(dtype, fx.weight.shape(), &negated).unwrap());
        let (mut a, mut b) = (fx.clone(), fx.clone());
        let mut bytes = vec![0u8; a.output.as_bytes().len()];
        kernel
            .kernel()
            .run_into(
                QkvArgs {
                    hidden_state: &a.hidden,
                    weight: &other,
                    kv_collection: &mut a.cache,
                    layer_idx: &a.layer_idx,
                    valid_lengths: &a.valid,
                },
                &mut bytes,
                cpu(1),
            )
            .unwrap();
        let inputs = [&b.hidden, &*other, &b.layer_idx, &b.valid];
        reference.run(&inputs, &mut [&mut b.cache], std::slice::from_mut(&mut b.output), cpu(1)).unwrap();
        assert_eq!(bytes, b.output.as_bytes(), "{dtype}: run_into with another weight");
        assert_eq!(a.cache.blocks().as_bytes(), b.cache.blocks().as_bytes(), "{dtype}: run_into cache");
    }
}
