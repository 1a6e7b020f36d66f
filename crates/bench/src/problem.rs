//! Benchmark problems: the model shapes, and one fused-QKV call's inputs.
//!
//! A [`Point`] is one call shape (model shape, dtype, page size, rows M). Its
//! [`Problem`] holds everything a call needs: the hidden state, a cache with
//! pages reserved for the call (handed out in a shuffled order, so page tables
//! are scattered as in a long-running server, after 32 tokens of history per
//! sequence), and the output. Weights ([`Weights`]) are made once per model
//! shape and dtype, as several layers' worth, and shared by every point.
//!
//! M rows are `M` decode sequences of one token for M ≤ 16, else four
//! prompts of `M / 4` tokens (prefill). Every token is valid, so every row
//! writes K/V and the FLOP count is exactly `2·M·N·K`.

use std::fmt;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use kvjit_core::{Backend, CacheElement, CodeTier, DType, KvCacheParams, PagedKVCacheCollection, Tensor, TensorData};
use kvjit_op::checks::StepDims;
use kvjit_op_fused_qkv::{FusedQkvSpec, Sizes};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::{BenchError, Result};

/// Tokens already cached per sequence before the benchmarked call.
pub const HISTORY: u32 = 32;

/// The sizes of one attention layer's QKV projection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModelShape {
    /// Short name used on the command line and in reports (`1b`, `8b`, `mha`,
    /// or `K/QH/KVH/D` for a custom shape).
    pub label: String,
    /// What the shape is, for people.
    pub description: String,
    /// Hidden size K.
    pub k: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
}

impl ModelShape {
    /// A Llama-3.2-1B-class layer: K = 2048, 32 query and 8 KV heads of 64.
    pub fn llama_1b() -> Self {
        Self::named("1b", "1B-class", 2048, 32, 8, 64)
    }

    /// A Llama-3-8B layer: K = 4096, 32 query and 8 KV heads of 128.
    pub fn llama3_8b() -> Self {
        Self::named("8b", "Llama-3-8B", 4096, 32, 8, 128)
    }

    /// Multi-head attention at 8B size: K = 4096, 32 query and 32 KV heads of 128.
    pub fn mha_8b() -> Self {
        Self::named("mha", "MHA", 4096, 32, 32, 128)
    }

    /// The three shapes the suite covers, smallest first.
    pub fn standard() -> Vec<Self> {
        vec![Self::llama_1b(), Self::llama3_8b(), Self::mha_8b()]
    }

    fn named(label: &str, name: &str, k: usize, q_heads: usize, kv_heads: usize, head_size: usize) -> Self {
        let description = format!("{name} (K={k}, {q_heads} q / {kv_heads} kv heads of {head_size})");
        Self { label: label.into(), description, k, q_heads, kv_heads, head_size }
    }

    /// Parse `1b`, `8b`, `mha`, or a custom `K/QH/KVH/D` (e.g. `64/4/2/16`).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        if let Some(shape) = Self::standard().into_iter().find(|s| s.label == text) {
            return Ok(shape);
        }
        let parts: Vec<&str> = text.split('/').collect();
        let numbers: Option<Vec<usize>> = parts.iter().map(|p| p.parse().ok().filter(|&v| v > 0)).collect();
        match numbers.as_deref() {
            Some(&[k, q_heads, kv_heads, head_size]) => {
                Ok(Self::named(text, "custom", k, q_heads, kv_heads, head_size))
            }
            _ => Err(format!(
                "unknown shape '{text}': use 1b, 8b, mha, or K/QH/KVH/D with positive sizes (e.g. 64/4/2/16)"
            )),
        }
    }

    /// Q columns: query heads × head size.
    pub fn q_dim(&self) -> usize {
        self.q_heads * self.head_size
    }

    /// K (or V) columns: KV heads × head size.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_size
    }

    /// Weight rows N = q_dim + 2·kv_dim.
    pub fn n(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// The CPU kernel spec for this shape (cache dtype = `dtype`, one layer,
    /// the widest CPU tier); `rows` = `Some((B, S))` bakes B and S in, `None`
    /// leaves them symbolic.
    pub fn spec(&self, dtype: DType, page_size: usize, rows: Option<(usize, usize)>) -> FusedQkvSpec {
        FusedQkvSpec {
            backend: Backend::Cpu(widest_tier()),
            dtype,
            weights: dtype,
            cache: KvCacheParams {
                element: CacheElement::new(dtype, None).expect("a compute float"),
                num_layers: 1,
                page_size,
                num_kv_heads: self.kv_heads,
                head_size: self.head_size,
            },
            k: self.k,
            q_dim: self.q_dim(),
            step: StepDims { batch: rows.map(|r| r.0), seq: rows.map(|r| r.1) },
            sizes: Sizes::Baked,
        }
    }
}

/// The widest CPU tier this machine runs (what kvjit's graphs build on).
pub fn widest_tier() -> CodeTier {
    kvjit_jit::microkernel::resolve_tier(kvjit_core::CpuTier::Auto).expect("the automatic tier always resolves")
}

impl fmt::Display for ModelShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.description)
    }
}

/// One call shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Point {
    /// Model shape.
    pub shape: ModelShape,
    /// Activation, weight, output and cache dtype.
    pub dtype: DType,
    /// Tokens per cache page.
    pub page_size: usize,
    /// Rows M = B·S.
    pub m: usize,
}

impl Point {
    /// Sequences and padded length for M rows: M decode sequences of one
    /// token for M ≤ 16; beyond, four prompts of M/4 tokens (one prompt of M
    /// when M is not a multiple of 4).
    pub fn batch_and_seq(&self) -> (usize, usize) {
        match self.m {
            m if m <= 16 => (m, 1),
            m if m % 4 == 0 => (4, m / 4),
            m => (1, m),
        }
    }

    /// Floating-point operations of the matmul: 2·M·N·K.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.shape.n() as f64 * self.shape.k as f64
    }

    /// Bytes of the weight, N·K elements of the dtype.
    pub fn weight_bytes(&self) -> f64 {
        (self.shape.n() * self.shape.k * self.dtype.size_bytes()) as f64
    }

    /// The least memory traffic a call can have: the weight and X read once,
    /// Q and the new K/V written once.
    pub fn min_traffic_bytes(&self) -> f64 {
        let size = self.dtype.size_bytes() as f64;
        let m = self.m as f64;
        let s = &self.shape;
        self.weight_bytes() + m * size * (s.k + s.q_dim() + 2 * s.kv_dim()) as f64
    }

    /// FLOPs per byte of [`min_traffic_bytes`](Self::min_traffic_bytes).
    pub fn intensity(&self) -> f64 {
        self.flops() / self.min_traffic_bytes()
    }
}

/// The weights of one model shape in one dtype, as the layers of a model:
/// enough copies that together they exceed the working set asked for (say
/// 128 MiB, several times a last-level cache), so a benchmark that cycles
/// through them reads its weight from DRAM as a model's layers do, instead of
/// finding one small weight still in cache from the previous call.
///
/// The copies hold the same values in different memory (copied, not
/// regenerated). The GEMM peers multiply with an f32 copy of each when the
/// dtype is not f32: a user of an f32-only GEMM library converts the weights
/// once, when loading them.
pub struct Weights {
    /// `[N, K]` in the benchmark dtype, one per layer.
    pub layers: Vec<Arc<Tensor>>,
    /// The same as f32, for the peers; empty when the dtype is f32.
    f32_layers: Vec<Vec<f32>>,
}

impl Weights {
    /// Seeded uniform weights in `±1/√K`, copied until they span
    /// `working_set` bytes (at least one copy).
    pub fn new(shape: &ModelShape, dtype: DType, seed: u64, working_set: usize) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let bound = 1.0 / (shape.k as f32).sqrt();
        let weight = Tensor::random(dtype, &[shape.n(), shape.k], &mut rng, -bound, bound)?;
        let bytes = (shape.n() * shape.k * dtype.size_bytes()).max(1);
        let count = working_set.div_ceil(bytes).max(1);
        let f32_layers = match weight.data() {
            TensorData::F32(_) => Vec::new(),
            _ => vec![to_f32(&weight); count],
        };
        // Distinct memory per layer: a `Tensor` clone shares its storage, so
        // each copy is made from the bytes.
        let layers = (0..count)
            .map(|_| Tensor::from_le_bytes(dtype, weight.shape(), weight.as_bytes()).map(Arc::new))
            .collect::<kvjit_core::Result<Vec<_>>>()?;
        Ok(Self { layers, f32_layers })
    }

    /// Number of layers (copies).
    pub fn count(&self) -> usize {
        self.layers.len()
    }

    /// Layer `i`'s weight as f32 values, for the peers.
    pub fn as_f32(&self, i: usize) -> &[f32] {
        match (self.f32_layers.get(i), self.layers[i].data()) {
            (Some(copy), _) => copy,
            (None, TensorData::F32(w)) => w,
            (None, _) => unreachable!("non-f32 weights carry f32 copies"),
        }
    }
}

/// A float tensor's values as f32 (half's vectorized slice conversion).
pub(crate) fn to_f32(t: &Tensor) -> Vec<f32> {
    let mut out = vec![0f32; t.numel()];
    convert_to_f32(t, &mut out);
    out
}

/// Widen a float tensor into `out` (same length).
pub(crate) fn convert_to_f32(t: &Tensor, out: &mut [f32]) {
    match t.data() {
        TensorData::F32(v) => out.copy_from_slice(v),
        TensorData::BF16(v) => v.convert_to_f32_slice(out),
        TensorData::F16(v) => v.convert_to_f32_slice(out),
        TensorData::F8E4M3(v) => out.iter_mut().zip(v).for_each(|(o, v)| *o = v.to_f32()),
        TensorData::U32(_) | TensorData::Blocks(..) => unreachable!("benchmark tensors are floats"),
    }
}

/// One call's inputs, cache and output.
pub struct Problem {
    /// The call shape.
    pub point: Point,
    /// Sequences B.
    pub batch: usize,
    /// Padded tokens per sequence S.
    pub seq: usize,
    /// Shared weights of the shape (every runner cycles through the layers).
    pub weights: Arc<Weights>,
    /// `[B, S, K]`.
    pub hidden: Tensor,
    /// `[B]`, every token valid.
    pub valid: Tensor,
    /// Layer 0.
    pub layer: Tensor,
    /// A one-layer cache with the call's pages reserved.
    pub cache: PagedKVCacheCollection,
    /// `[B, S, q_dim]`.
    pub output: Tensor,
}

impl Problem {
    /// Inputs for `point` (seeded), on `weights` made for its shape and dtype.
    pub fn new(point: Point, weights: Arc<Weights>, seed: u64) -> Result<Self> {
        let shape = &point.shape;
        let w = &weights.layers[0];
        if w.shape() != [shape.n(), shape.k] || w.dtype() != point.dtype {
            return Err(BenchError::WeightsMismatch {
                weights_dtype: w.dtype(),
                weights_shape: w.shape().to_vec(),
                shape: shape.clone(),
                dtype: point.dtype,
            });
        }
        let mut rng = StdRng::seed_from_u64(seed ^ ((point.m as u64) << 20) ^ (point.page_size as u64));
        let (batch, seq) = point.batch_and_seq();
        let page = point.page_size;
        let pages_per_seq = (HISTORY as usize + seq).div_ceil(page) + 1;
        let params = KvCacheParams {
            element: CacheElement::new(point.dtype, None).expect("a compute float"),
            num_layers: 1,
            page_size: page,
            num_kv_heads: shape.kv_heads,
            head_size: shape.head_size,
        };
        let mut cache = PagedKVCacheCollection::new(params, batch * pages_per_seq, batch, pages_per_seq)?;
        let mut order: Vec<u32> = (0..cache.num_pages() as u32).collect();
        order.shuffle(&mut rng);
        cache.set_allocation_order(order)?;
        let history = vec![HISTORY; batch];
        cache.reserve(&history)?;
        cache.advance(&history)?;
        let valid = vec![seq as u32; batch];
        cache.reserve(&valid)?;
        Ok(Self {
            hidden: Tensor::random(point.dtype, &[batch, seq, shape.k], &mut rng, -1.0, 1.0)?,
            valid: Tensor::from_vec(&[batch], valid)?,
            layer: Tensor::scalar_u32(0),
            output: Tensor::zeros(point.dtype, &[batch, seq, shape.q_dim()])?,
            cache,
            weights,
            batch,
            seq,
            point,
        })
    }
}
