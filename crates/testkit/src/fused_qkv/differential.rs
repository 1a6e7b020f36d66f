//! One fused-QKV call, described as data ([`Call`]), checked three ways
//! at once: against an independent model of the contract's validity rules,
//! through the reference implementation, and through the JIT kernel.
//!
//! A call may be valid or not: any shapes, lengths and page tables, plus
//! at most one [`Tweak`] that breaks a shape, a dtype, contiguity or what the
//! JIT kernel's spec baked in. [`check`] builds the buffers and asserts:
//!
//! - **Verdicts.** The reference accepts exactly the calls the model
//!   ([`model_call`], written from DESIGN.md, sharing no code with
//!   `check_call`) calls valid; the JIT kernel accepts exactly those whose
//!   spec also matches the arguments and whose output fits.
//! - **Rejected calls write nothing.** Output (with its guard regions), the
//!   whole cache (blocks, lengths, page table, MAX scalars) and the inputs are
//!   byte-identical afterwards.
//! - **Accepted calls write exactly the contract.** The JIT's output and the
//!   K/V elements the model says are written match a reference run within
//!   [`Tolerance::RelativeToScale`] ([`Tolerance::Exact`] for
//!   [`Values::Dyadic`]); every other cache byte — the poisoned (NaN)
//!   unwritten slots, the other layers, and the guard pages at both ends of
//!   the cache, filled with [`canary`] bytes and named by no page-table
//!   entry — is unchanged, and so are the guard regions around the output.
//!   Outputs are poisoned (NaN) before each run.
//!
//! Inputs are only read; they are compared byte for byte after each run
//! (an out-of-bounds *read* cannot be seen by a canary).
//!
//! Used by the op's `tests/proptest_jit.rs` (proptest strategies) and by the
//! `op_call` fuzz target (`fuzz/fuzz_targets/op_call.rs`, `arbitrary`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use kvjit_core::{
    Backend, CacheElement, CodeTier, CpuTier, DType, KvCacheParams, PagedKVCacheCollection, Tensor, UNASSIGNED_PAGE,
};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{FusedQkvSpec, JitKernel, QkvArgs, ReferenceKernel, Sizes, reference};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::layout::{block_index, strided_view, unravel};
use crate::poison::{Guarded, canary, nan_bytes, poison};
use crate::snapshot::Snapshot;
use crate::tolerance::Tolerance;
use crate::values::{dyadic, max_abs_finite, uniform, with_specials};

/// How input values are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Values {
    /// Uniform in [-1, 1): compared within the tolerances.
    Uniform,
    /// Multiples of 1/4 (hidden) and 1/8 (weight) in [-1, 1]: every product
    /// and partial sum is exact in f32, so JIT and reference agree bit for bit.
    Dyadic,
    /// Uniform, with some elements replaced by NaN, ±inf, −0 and subnormals:
    /// non-finite results must be non-finite on both sides (NaN where the
    /// reference has NaN, the same infinity where it has one).
    Special,
}

/// A lookup-table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Page {
    /// The i-th page the table may name (guard pages are never named).
    Inner(usize),
    /// [`UNASSIGNED_PAGE`].
    Unassigned,
    /// `P + v` (saturating): never a page of the cache.
    Past(u32),
}

/// Which JIT entry point runs the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `JitKernel::run_into`, output bytes between guards of these sizes.
    RunInto {
        /// Front guard bytes.
        front: usize,
        /// Back guard bytes.
        back: usize,
    },
    /// `Kernel::check` then `Kernel::run` of the JIT and the reference
    /// kernel, with an output tensor.
    Run,
}

/// A change to what the JIT kernel's spec bakes in, against the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpecTweak {
    /// The activation dtype.
    DType,
    /// The cache dtype.
    CacheDType,
    /// K + 1.
    K,
    /// q_dim + 1.
    QDim,
    /// Hkv + 1.
    Heads,
    /// D + 1.
    HeadSize,
    /// page_size + 1.
    PageSize,
    /// L + 1.
    Layers,
    /// A static batch of B + 1.
    Batch,
    /// A static seq of S + 1.
    Seq,
}

impl SpecTweak {
    /// Every spec tweak.
    pub const ALL: [SpecTweak; 10] = [
        SpecTweak::DType,
        SpecTweak::CacheDType,
        SpecTweak::K,
        SpecTweak::QDim,
        SpecTweak::Heads,
        SpecTweak::HeadSize,
        SpecTweak::PageSize,
        SpecTweak::Layers,
        SpecTweak::Batch,
        SpecTweak::Seq,
    ];
}

/// At most one thing wrong with a call besides its lengths and page table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tweak {
    /// Nothing.
    None,
    /// One dim of `hidden_state` one larger (or smaller).
    HiddenDim {
        /// Axis (mod 3).
        axis: usize,
        /// Larger, or smaller (saturating at 0).
        grow: bool,
    },
    /// `hidden_state` of rank 4 (`[1, B, S, K]`) or 2 (`[B·S, K]`).
    HiddenRank {
        /// Rank 4 rather than 2.
        grow: bool,
    },
    /// `hidden_state` of u32.
    HiddenInts,
    /// `hidden_state` as a strided view.
    HiddenStrided,
    /// One dim of `weight` one larger (or smaller).
    WeightDim {
        /// Axis (mod 2).
        axis: usize,
        /// Larger, or smaller.
        grow: bool,
    },
    /// `weight` of rank 3 or 1.
    WeightRank {
        /// Rank 3 rather than 1.
        grow: bool,
    },
    /// `weight` in another float dtype.
    WeightDType,
    /// `weight` as a strided view.
    WeightStrided,
    /// `valid_lengths` one longer (or shorter).
    ValidLen {
        /// Longer, or shorter.
        grow: bool,
    },
    /// `valid_lengths` as f32.
    ValidFloats,
    /// `layer_idx` of shape `[2]`.
    LayerShape,
    /// `layer_idx` as f32.
    LayerFloat,
    /// One dim of the output one larger (or smaller).
    OutputDim {
        /// Axis (mod 3).
        axis: usize,
        /// Larger, or smaller.
        grow: bool,
    },
    /// The output in another float dtype.
    OutputDType,
    /// A cache for one more (or one fewer) sequence.
    CacheBatch {
        /// More, or fewer.
        grow: bool,
    },
    /// The JIT kernel built for a different spec.
    Spec(SpecTweak),
}

impl Tweak {
    /// How many tweaks [`from_index`](Self::from_index) tells apart.
    pub const COUNT: usize = 26;

    /// Tweak number `i % COUNT` (0 is [`Tweak::None`]; generators shrink
    /// towards it), with `axis` and `grow` where the tweak takes them.
    pub fn from_index(i: usize, axis: usize, grow: bool) -> Self {
        match i % Self::COUNT {
            0 => Tweak::None,
            1 => Tweak::HiddenDim { axis, grow },
            2 => Tweak::HiddenRank { grow },
            3 => Tweak::HiddenInts,
            4 => Tweak::HiddenStrided,
            5 => Tweak::WeightDim { axis, grow },
            6 => Tweak::WeightRank { grow },
            7 => Tweak::WeightDType,
            8 => Tweak::WeightStrided,
            9 => Tweak::ValidLen { grow },
            10 => Tweak::ValidFloats,
            11 => Tweak::LayerShape,
            12 => Tweak::LayerFloat,
            13 => Tweak::OutputDim { axis, grow },
            14 => Tweak::OutputDType,
            15 => Tweak::CacheBatch { grow },
            i => Tweak::Spec(SpecTweak::ALL[i - 16]),
        }
    }
}

/// One call, as data.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Call {
    /// Seed of the tensor values.
    pub seed: u64,
    /// Activation dtype (hidden state, weight, output).
    pub dtype: DType,
    /// Cache dtype.
    pub cache_dtype: DType,
    /// Sequences B.
    pub batch: usize,
    /// Padded length S.
    pub seq: usize,
    /// Hidden size K.
    pub k: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Q columns (weight rows N = q_dim + 2·Hkv·D).
    pub q_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers L.
    pub num_layers: usize,
    /// The layer written (may be out of range).
    pub layer_idx: u32,
    /// Pages the table may name.
    pub inner_pages: usize,
    /// Canary-filled pages before and after them, named by no entry.
    pub guard_pages: (usize, usize),
    /// Width of the lookup table.
    pub max_pages_per_seq: usize,
    /// Per sequence of the cache (cycled to the cache's batch; 0 if empty).
    pub cache_lengths: Vec<u32>,
    /// Row-major entries (cycled to `batch × max_pages_per_seq`; unassigned if empty).
    pub lookup_table: Vec<Page>,
    /// Per sequence (cycled to B; 0 if empty).
    pub valid_lengths: Vec<u32>,
    /// How values are drawn.
    pub values: Values,
    /// At most one thing made wrong on purpose.
    pub tweak: Tweak,
    /// Give the JIT kernel the weight at build (packed once) or not.
    pub const_weight: bool,
    /// Bake B into the spec.
    pub static_batch: bool,
    /// Bake S into the spec.
    pub static_seq: bool,
    /// Worker threads (1..=3).
    pub threads: usize,
    /// The JIT entry point.
    pub entry: Entry,
    /// The CPU tier the JIT kernel is built for (`Auto`: the widest this
    /// CPU runs; `Avx2` becomes `Auto` on a CPU without it, see
    /// [`runnable_tier`]).
    pub tier: CpuTier,
}

/// `tier` resolved, or the widest this CPU runs where it cannot run
/// `tier` (so generated calls stay runnable on every machine).
pub fn runnable_tier(tier: CpuTier) -> CodeTier {
    let tier = match tier {
        CpuTier::Avx2 if !kvjit_jit::microkernel::avx2_available() => CpuTier::Auto,
        tier => tier,
    };
    kvjit_jit::microkernel::resolve_tier(tier).expect("a runnable tier resolves")
}

impl Call {
    fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_size
    }

    fn num_pages(&self) -> usize {
        self.guard_pages.0 + self.inner_pages + self.guard_pages.1
    }

    /// The spec the JIT kernel is built for: the call's, unless tweaked.
    pub fn spec(&self) -> FusedQkvSpec {
        let cache = KvCacheParams {
            element: CacheElement::new(self.cache_dtype, None).expect("the problem's caches are float caches"),
            num_layers: self.num_layers,
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
        };
        let spec = FusedQkvSpec {
            backend: Backend::Cpu(runnable_tier(self.tier)),
            dtype: self.dtype,
            weights: self.dtype,
            cache,
            k: self.k,
            q_dim: self.q_dim,
            step: StepDims { batch: self.static_batch.then_some(self.batch), seq: self.static_seq.then_some(self.seq) },
            sizes: Sizes::Baked,
        };
        let Tweak::Spec(t) = self.tweak else { return spec };
        let with_cache = |cache| FusedQkvSpec { cache, ..spec };
        match t {
            SpecTweak::DType => FusedQkvSpec { dtype: other_float(self.dtype), ..spec },
            SpecTweak::CacheDType => {
                let element = CacheElement::new(other_float(self.cache_dtype), None).expect("a float cache");
                with_cache(KvCacheParams { element, ..cache })
            }
            SpecTweak::K => FusedQkvSpec { k: self.k + 1, ..spec },
            SpecTweak::QDim => FusedQkvSpec { q_dim: self.q_dim + 1, ..spec },
            SpecTweak::Heads => with_cache(KvCacheParams { num_kv_heads: self.num_kv_heads + 1, ..cache }),
            SpecTweak::HeadSize => with_cache(KvCacheParams { head_size: self.head_size + 1, ..cache }),
            SpecTweak::PageSize => with_cache(KvCacheParams { page_size: self.page_size + 1, ..cache }),
            SpecTweak::Layers => with_cache(KvCacheParams { num_layers: self.num_layers + 1, ..cache }),
            SpecTweak::Batch => FusedQkvSpec { step: StepDims { batch: Some(self.batch + 1), ..spec.step }, ..spec },
            SpecTweak::Seq => FusedQkvSpec { step: StepDims { seq: Some(self.seq + 1), ..spec.step }, ..spec },
        }
    }
}

/// Another float dtype than `d` (bf16 ↔ f16 keeps the element size).
fn other_float(d: DType) -> DType {
    match d {
        DType::F32 => DType::BF16,
        DType::BF16 => DType::F16,
        _ => DType::BF16,
    }
}

fn bump(v: usize, grow: bool) -> usize {
    if grow { v + 1 } else { v.saturating_sub(1) }
}

fn cycled<T: Copy>(values: &[T], len: usize, default: T) -> Vec<T> {
    (0..len).map(|i| if values.is_empty() { default } else { values[i % values.len()] }).collect()
}

fn float_tensor(rng: &mut StdRng, dtype: DType, shape: &[usize], values: Values, denominator: i32) -> Tensor {
    match values {
        Values::Uniform => uniform(rng, dtype, shape),
        Values::Dyadic => dyadic(rng, dtype, shape, denominator),
        Values::Special => with_specials(rng, dtype, shape),
    }
}

/// A call's buffers, before any call.
pub struct Built {
    /// `hidden_state`.
    pub hidden: Tensor,
    /// `weight`.
    pub weight: Arc<Tensor>,
    /// `layer_idx`.
    pub layer_idx: Tensor,
    /// `valid_lengths`.
    pub valid: Tensor,
    /// Inner pages poisoned with NaN, guard pages filled with canary bytes.
    pub cache: PagedKVCacheCollection,
    /// Dtype and shape of the output handed to the kernels (tweakable).
    pub output: (DType, Vec<usize>),
    /// Guard pages (indices).
    pub guard_pages: Vec<usize>,
}

impl Built {
    /// Build the buffers of `p`.
    pub fn new(p: &Call) -> Self {
        let mut rng = StdRng::seed_from_u64(p.seed);
        let kv_dim = p.kv_dim();
        let n = p.q_dim + 2 * kv_dim;
        let (b, s, k) = (p.batch, p.seq, p.k);

        let mut hidden_shape = vec![b, s, k];
        match p.tweak {
            Tweak::HiddenDim { axis, grow } => hidden_shape[axis % 3] = bump(hidden_shape[axis % 3], grow),
            Tweak::HiddenRank { grow: true } => hidden_shape.insert(0, 1),
            Tweak::HiddenRank { grow: false } => hidden_shape = vec![b * s, k],
            _ => {}
        }
        let mut hidden = float_tensor(&mut rng, p.dtype, &hidden_shape, p.values, 4);
        match p.tweak {
            Tweak::HiddenInts => hidden = Tensor::from_vec(&hidden_shape, vec![1u32; hidden.numel()]).unwrap(),
            Tweak::HiddenStrided if b > 1 && s > 1 && k > 0 => {
                hidden = strided_view(&hidden, &[1, 0, 2]);
            }
            _ => {}
        }

        let mut weight_shape = vec![n, k];
        let mut weight_dtype = p.dtype;
        match p.tweak {
            Tweak::WeightDim { axis, grow } => weight_shape[axis % 2] = bump(weight_shape[axis % 2], grow),
            Tweak::WeightRank { grow: true } => weight_shape.insert(0, 1),
            Tweak::WeightRank { grow: false } => weight_shape = vec![n * k],
            Tweak::WeightDType => weight_dtype = other_float(p.dtype),
            _ => {}
        }
        let mut weight = float_tensor(&mut rng, weight_dtype, &weight_shape, p.values, 8);
        if p.tweak == Tweak::WeightStrided && n > 1 && k > 1 {
            weight = strided_view(&weight, &[1, 0]);
        }

        let layer_idx = match p.tweak {
            Tweak::LayerShape => Tensor::from_vec(&[2], vec![p.layer_idx; 2]).unwrap(),
            Tweak::LayerFloat => Tensor::from_f32(DType::F32, &[], &[p.layer_idx as f32]).unwrap(),
            _ => Tensor::scalar_u32(p.layer_idx),
        };
        let valid_len = match p.tweak {
            Tweak::ValidLen { grow } => bump(b, grow),
            _ => b,
        };
        let valid_values = cycled(&p.valid_lengths, valid_len, 0);
        let valid = if p.tweak == Tweak::ValidFloats {
            let floats: Vec<f32> = valid_values.iter().map(|&v| v as f32).collect();
            Tensor::from_f32(DType::F32, &[valid_len], &floats).unwrap()
        } else {
            Tensor::from_vec(&[valid_len], valid_values).unwrap()
        };

        let cache_batch = match p.tweak {
            Tweak::CacheBatch { grow } => bump(b, grow),
            _ => b,
        };
        let num_pages = p.num_pages();
        let (front, _) = p.guard_pages;
        let table: Vec<u32> = cycled(&p.lookup_table, cache_batch * p.max_pages_per_seq, Page::Unassigned)
            .into_iter()
            .map(|e| match e {
                Page::Inner(i) if p.inner_pages > 0 => (front + i % p.inner_pages) as u32,
                Page::Inner(_) | Page::Unassigned => UNASSIGNED_PAGE,
                Page::Past(v) => (num_pages as u32).saturating_add(v),
            })
            .collect();
        let shape = [num_pages, 2, p.num_layers, p.page_size, p.num_kv_heads, p.head_size];
        let mut blocks = Tensor::zeros(p.cache_dtype, &shape).unwrap();
        poison(&mut blocks);
        let page_bytes = shape[1..].iter().product::<usize>() * p.cache_dtype.size_bytes();
        let guard_pages: Vec<usize> = (0..front).chain(front + p.inner_pages..num_pages).collect();
        for &g in &guard_pages {
            for (i, byte) in blocks.as_bytes_mut()[g * page_bytes..(g + 1) * page_bytes].iter_mut().enumerate() {
                *byte = canary(g * page_bytes + i);
            }
        }
        let lengths = cycled(&p.cache_lengths, cache_batch, 0);
        let mut cache = PagedKVCacheCollection::from_parts(blocks, lengths, table, p.max_pages_per_seq).unwrap();
        cache.max_seq_length = p.seq as u32;
        cache.max_cache_length = 7;

        let mut output = (p.dtype, vec![b, s, p.q_dim]);
        match p.tweak {
            Tweak::OutputDim { axis, grow } => output.1[axis % 3] = bump(output.1[axis % 3], grow),
            Tweak::OutputDType => output.0 = other_float(p.dtype),
            _ => {}
        }
        Self { hidden, weight: Arc::new(weight), layer_idx, valid, cache, output, guard_pages }
    }

    fn inputs(&self) -> [&Tensor; 4] {
        [&self.hidden, &*self.weight, &self.layer_idx, &self.valid]
    }

    fn input_bytes(&self) -> Vec<Vec<u8>> {
        self.inputs().iter().map(|t| t.as_bytes().to_vec()).collect()
    }

    fn poisoned_output(&self) -> Tensor {
        let mut t = Tensor::zeros(self.output.0, &self.output.1).unwrap();
        poison(&mut t);
        t
    }
}

/// What the model says a valid call does.
#[derive(Clone, Debug)]
pub struct ModelCall {
    /// `[B, S, q_dim]`.
    pub output_shape: Vec<usize>,
    /// Blocks elements the call writes (by row-major index).
    pub written: Vec<usize>,
}

/// The contract's validity rules (DESIGN.md "The op contract"), written out
/// independently of `check_call`: `Ok` with what a valid call writes, or why
/// it is invalid. Output arguments are not part of it.
pub fn model_call(
    hidden: &Tensor,
    weight: &Tensor,
    cache: &PagedKVCacheCollection,
    layer_idx: &Tensor,
    valid: &Tensor,
) -> Result<ModelCall, String> {
    let dtype = hidden.dtype();
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err("hidden_state is not float".into());
    }
    let contiguous = |t: &Tensor| t.is_contiguous();
    if !contiguous(hidden) || !contiguous(weight) || !contiguous(valid) || !contiguous(layer_idx) {
        return Err("an argument is strided".into());
    }
    if weight.dtype() != dtype || layer_idx.dtype() != DType::U32 || valid.dtype() != DType::U32 {
        return Err("dtype".into());
    }
    let [b, s, k] = hidden.shape() else { return Err("hidden_state rank".into()) };
    let [n, wk] = weight.shape() else { return Err("weight rank".into()) };
    let params = cache.params();
    let kv_dim = params.num_kv_heads * params.head_size;
    if wk != k || *n <= 2 * kv_dim {
        return Err("weight shape".into());
    }
    if !(layer_idx.shape().is_empty() || layer_idx.shape() == [1]) {
        return Err("layer_idx shape".into());
    }
    if valid.shape() != [*b] || cache.cache_lengths().len() != *b {
        return Err("batch".into());
    }
    let layer = layer_idx.to_u32_vec().unwrap()[0] as usize;
    if layer >= params.num_layers {
        return Err("layer".into());
    }
    let valid = valid.to_u32_vec().unwrap();
    if valid.iter().any(|&v| v as usize > *s) {
        return Err("valid length".into());
    }
    let shape = cache.blocks().shape().to_vec();
    let (ps, width, pages) = (params.page_size, cache.max_pages_per_seq(), shape[0]);
    let mut owner: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
    let mut written = Vec::new();
    for (bi, &v) in valid.iter().enumerate() {
        for t in 0..v as usize {
            let pos = cache.cache_lengths()[bi] as usize + t;
            if pos / ps >= width {
                return Err(format!("({bi}, {t}): logical page {} beyond the table", pos / ps));
            }
            let page = cache.lookup_table()[bi * width + pos / ps] as usize;
            if page >= pages {
                return Err(format!("({bi}, {t}): page {page} not in the cache"));
            }
            if let Some(first) = owner.insert((page, pos % ps), (bi, t)) {
                return Err(format!("({bi}, {t}) collides with {first:?}"));
            }
            for kv in 0..2 {
                for h in 0..params.num_kv_heads {
                    for d in 0..params.head_size {
                        written.push(block_index(&shape, [page, kv, layer, pos % ps, h, d]));
                    }
                }
            }
        }
    }
    Ok(ModelCall { output_shape: vec![*b, *s, n - 2 * kv_dim], written })
}

/// Whether `spec` matches the call's arguments in everything it bakes in.
fn spec_matches(spec: &FusedQkvSpec, b: &Built) -> bool {
    let params = b.cache.params();
    let dims_ok = match (b.hidden.shape(), b.weight.shape()) {
        ([bb, s, k], [n, _]) => {
            spec.k == *k
                && spec.step.batch.is_none_or(|x| x == *bb)
                && spec.step.seq.is_none_or(|x| x == *s)
                && n.checked_sub(2 * params.num_kv_heads * params.head_size) == Some(spec.q_dim)
        }
        _ => false,
    };
    dims_ok
        && spec.dtype == b.hidden.dtype()
        && spec.cache.dtype() == params.dtype()
        && spec.cache.num_kv_heads == params.num_kv_heads
        && spec.cache.head_size == params.head_size
        && spec.cache.page_size == params.page_size
        && spec.cache.num_layers == params.num_layers
}

// ---------------------------------------------------------------------------
// Kernels and contexts
// ---------------------------------------------------------------------------

static CONTEXTS: LazyLock<Vec<DeviceContextPtr>> =
    LazyLock::new(|| (1..=3).map(|t| DeviceContextPtr::cpu(t).expect("a CPU pool")).collect());

/// A CPU context with 1, 2 or 3 workers.
pub fn cpu(threads: usize) -> &'static DeviceContextPtr {
    &CONTEXTS[threads.clamp(1, 3) - 1]
}

/// Kernels kept alive so their code stays in the process-wide kernel cache
/// between cases (a fresh `JitKernel` for a live key costs no compile).
type Kept = VecDeque<(FusedQkvSpec, Arc<Compiled<JitKernel>>)>;
static KEPT: LazyLock<Mutex<Kept>> = LazyLock::new(Default::default);
/// How many kernels [`KEPT`] holds (see [`keep_kernels`]).
static KEEP: AtomicUsize = AtomicUsize::new(64);

/// Keep up to `n` kernels alive between cases (the fuzz target, which sees
/// each spec many times, keeps more than the property tests).
pub fn keep_kernels(n: usize) {
    KEEP.store(n.max(1), Ordering::Relaxed);
}

/// The JIT kernel for `spec` (on the tier it names), with `weight` packed
/// at build when given.
pub fn jit_kernel(spec: FusedQkvSpec, weight: Option<Arc<Tensor>>) -> Arc<Compiled<JitKernel>> {
    let build =
        |weight| Compiled::new(JitKernel::new(spec, weight, CaptureText::default()).expect("small specs compile"));
    let generic = {
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        match kept.iter().find(|(s, _)| *s == spec) {
            Some((_, k)) => k.clone(),
            None => {
                let k = Arc::new(build(None));
                while kept.len() >= KEEP.load(Ordering::Relaxed) {
                    kept.pop_front();
                }
                kept.push_back((spec, k.clone()));
                k
            }
        }
    };
    match weight {
        Some(w) => Arc::new(build(Some(w))),
        None => generic,
    }
}

// ---------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------

/// JIT value `got` against reference value `want`, both of `dtype`: bit for
/// bit when `exact`, else within [`Tolerance::RelativeToScale`].
fn close(dtype: DType, k: usize, scale: f64, exact: bool, got: f32, want: f32) -> bool {
    let tolerance = if exact { Tolerance::Exact } else { Tolerance::RelativeToScale { dtype, k, scale } };
    tolerance.allows(f64::from(got), f64::from(want))
}

fn widen(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    Tensor::from_le_bytes(dtype, &[bytes.len() / dtype.size_bytes()], bytes).unwrap().to_f32_vec().unwrap()
}

// ---------------------------------------------------------------------------
// The check
// ---------------------------------------------------------------------------

/// Build `p`, run it through the model, the reference and the JIT kernel,
/// and assert everything the module docs list. Panics with the problem and
/// what went wrong.
pub fn check(p: &Call) {
    let built = Built::new(p);
    let inputs_before = built.input_bytes();
    let model = model_call(&built.hidden, &built.weight, &built.cache, &built.layer_idx, &built.valid);
    let spec = p.spec();
    let spec_ok = spec_matches(&spec, &built);
    let output_tensor_ok =
        model.as_ref().is_ok_and(|m| built.output.0 == built.hidden.dtype() && built.output.1 == m.output_shape);

    // The reference, with the (possibly tweaked) output tensor.
    let mut ref_cache = built.cache.clone();
    let mut ref_output = built.poisoned_output();
    let before = Snapshot::take(&ref_output, &ref_cache);
    let verdict = reference::fused_qkv_matmul(
        &built.hidden,
        &built.weight,
        &mut ref_cache,
        &built.layer_idx,
        &built.valid,
        &mut ref_output,
    );
    assert_eq!(
        verdict.is_ok(),
        output_tensor_ok,
        "{p:?}: the reference says {verdict:?}, the model {:?} (output {:?})",
        model.as_ref().map(|m| &m.output_shape),
        built.output
    );
    if verdict.is_err() {
        before.assert_unchanged(&ref_output, &ref_cache, &format!("{p:?}: reference"));
    }

    // The expected result of a valid call: the reference with a right output.
    let expected = model.as_ref().ok().map(|m| {
        let mut cache = built.cache.clone();
        let mut output = Tensor::zeros(built.hidden.dtype(), &m.output_shape).unwrap();
        poison(&mut output);
        reference::fused_qkv_matmul(
            &built.hidden,
            &built.weight,
            &mut cache,
            &built.layer_idx,
            &built.valid,
            &mut output,
        )
        .unwrap_or_else(|e| panic!("{p:?}: the reference rejected a valid call: {e}"));
        (output, cache)
    });
    if let (Some((output, cache)), Ok(m)) = (&expected, &model) {
        assert_writes_only(p, &built, cache, m, "reference");
        let unwritten = output.to_f32_vec().unwrap().iter().any(|v| v.is_nan());
        assert!(!unwritten || p.values == Values::Special, "{p:?}: the reference left output elements unwritten");
    }

    let kernel = jit_kernel(spec, p.const_weight.then(|| built.weight.clone()));
    let ctx = cpu(p.threads);
    match p.entry {
        Entry::RunInto { front, back } => {
            let (out_dtype, out_shape) = &built.output;
            let body = nan_bytes(*out_dtype, out_shape.iter().product());
            let want_bytes =
                model.as_ref().ok().map(|m| m.output_shape.iter().product::<usize>() * p.dtype.size_bytes());
            let accept = spec_ok && want_bytes == Some(body.len());
            let mut buffer = Guarded::new(front, &body, back);
            let mut cache = built.cache.clone();
            let verdict = kernel.kernel().run_into(
                QkvArgs {
                    hidden_state: &built.hidden,
                    weight: &built.weight,
                    kv_collection: &mut cache,
                    layer_idx: &built.layer_idx,
                    valid_lengths: &built.valid,
                },
                buffer.body_mut(),
                ctx,
            );
            assert_eq!(verdict.is_ok(), accept, "{p:?}: run_into says {verdict:?}; spec ok {spec_ok}, model {model:?}");
            buffer.assert_guards(&format!("{p:?}: run_into"));
            if verdict.is_ok() {
                let (want_out, want_cache) = expected.as_ref().unwrap();
                assert_same_result(
                    p,
                    &built,
                    &model.as_ref().unwrap().written,
                    buffer.body(),
                    &cache,
                    want_out,
                    want_cache,
                );
            } else {
                assert!(buffer == Guarded::new(front, &body, back), "{p:?}: a rejected run_into wrote its output");
                Snapshot::take(&built.poisoned_output(), &built.cache).assert_unchanged(
                    &built.poisoned_output(),
                    &cache,
                    &format!("{p:?}: rejected run_into"),
                );
            }
        }
        Entry::Run => {
            let reference_kernel = Compiled::new(ReferenceKernel::new(spec));
            let kernels: [(&str, &dyn Kernel); 2] = [("jit", kernel.as_ref()), ("reference kernel", &reference_kernel)];
            for (name, kernel) in kernels {
                let checked = kernel.check(&built.inputs(), &[&built.cache]);
                assert_eq!(checked.is_ok(), model.is_ok() && spec_ok, "{p:?}: {name} check says {checked:?}");
                let mut cache = built.cache.clone();
                let mut outputs = [built.poisoned_output()];
                let before = Snapshot::take(&outputs[0], &cache);
                let verdict = kernel.run(&built.inputs(), &mut [&mut cache], &mut outputs, ctx);
                assert_eq!(
                    verdict.is_ok(),
                    output_tensor_ok && spec_ok,
                    "{p:?}: {name} run says {verdict:?}; spec ok {spec_ok}, model {model:?}"
                );
                if verdict.is_ok() {
                    let (want_out, want_cache) = expected.as_ref().unwrap();
                    let written = &model.as_ref().unwrap().written;
                    assert_same_result(p, &built, written, outputs[0].as_bytes(), &cache, want_out, want_cache);
                } else {
                    before.assert_unchanged(&outputs[0], &cache, &format!("{p:?}: rejected {name} run"));
                }
            }
        }
    }
    let inputs_after = built.input_bytes();
    assert!(inputs_after == inputs_before, "{p:?}: an input changed");
}

/// The reference's cache differs from the prepared one exactly at elements
/// the model says are written (or, where it wrote the poison value back,
/// nowhere else), and its lengths, table and scalars are unchanged.
fn assert_writes_only(p: &Call, built: &Built, cache: &PagedKVCacheCollection, m: &ModelCall, who: &str) {
    let size = p.cache_dtype.size_bytes();
    let (now, was) = (cache.blocks().as_bytes(), built.cache.blocks().as_bytes());
    let mut written = vec![false; now.len() / size];
    for &i in &m.written {
        written[i] = true;
    }
    for (i, w) in written.iter().enumerate() {
        if !w && now[i * size..(i + 1) * size] != was[i * size..(i + 1) * size] {
            panic!(
                "{p:?}: {who} wrote blocks{:?}, which the contract leaves alone",
                unravel(cache.blocks().shape(), i)
            );
        }
    }
    assert_eq!(cache.cache_lengths(), built.cache.cache_lengths(), "{p:?}: {who} changed cache_lengths");
    assert_eq!(cache.lookup_table(), built.cache.lookup_table(), "{p:?}: {who} changed the lookup table");
    assert_eq!(
        (cache.max_seq_length, cache.max_cache_length),
        (built.cache.max_seq_length, built.cache.max_cache_length),
        "{p:?}: {who} changed the MAX scalars"
    );
}

/// A JIT run's output bytes and cache against the reference's.
fn assert_same_result(
    p: &Call,
    built: &Built,
    written: &[usize],
    output: &[u8],
    cache: &PagedKVCacheCollection,
    want_output: &Tensor,
    want_cache: &PagedKVCacheCollection,
) {
    let k = built.hidden.shape()[2];
    let scale = max_abs_finite(&built.hidden) * max_abs_finite(&built.weight);
    let exact = p.values == Values::Dyadic;
    let q_dim = want_output.shape()[2].max(1);
    let (got, want) = (widen(p.dtype, output), want_output.to_f32_vec().unwrap());
    assert_eq!(got.len(), want.len(), "{p:?}: output length");
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert!(
            close(p.dtype, k, scale, exact, g, w),
            "{p:?}: output[row {}, col {}] = {g} ({:#x}), reference {w} ({:#x})",
            i / q_dim,
            i % q_dim,
            g.to_bits(),
            w.to_bits()
        );
    }
    assert_writes_only(p, built, cache, &ModelCall { output_shape: vec![], written: written.to_vec() }, "the JIT");
    let (got, want) = (cache.blocks().to_f32_vec().unwrap(), want_cache.blocks().to_f32_vec().unwrap());
    for &i in written {
        assert!(
            close(p.cache_dtype, k, scale, exact, got[i], want[i]),
            "{p:?}: blocks{:?} = {}, reference {}",
            unravel(cache.blocks().shape(), i),
            got[i],
            want[i]
        );
    }
    let page_bytes = cache.blocks().as_bytes().len() / cache.num_pages().max(1);
    for &g in &built.guard_pages {
        let range = g * page_bytes..(g + 1) * page_bytes;
        assert!(
            cache.blocks().as_bytes()[range.clone()] == built.cache.blocks().as_bytes()[range],
            "{p:?}: guard page {g} was written"
        );
    }
}
