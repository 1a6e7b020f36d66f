//! The attention workload `--ops attention` and `--ops fp8` both measure:
//! the heads, paged caches with scattered page tables and random K/V, and
//! the attention-step graph (fused QKV → reshape → RoPE → attention) with
//! its inputs.

use std::collections::BTreeMap;

use kvjit::attention::{Mask, MhaSpec};
use kvjit::models::llama::{LayerConfig, LlamaConfig, attention_step_graph};
use kvjit::{CompileOptions, compile, standard_registry};
use kvjit_core::{CacheElement, DType, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_op::checks::StepDims;
use kvjit_runtime::Executable;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;

use crate::{BenchError, Result};

/// Values per scale of the FP8 (`f8e4m3`) caches measured (at most the head
/// size).
pub const FP8_GRANULARITY: usize = 128;

/// The attention heads benchmarked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Heads {
    /// Query heads Hq.
    pub num_heads: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per cache page.
    pub page_size: usize,
}

impl Heads {
    /// Llama-3-8B: 32 query heads, 8 KV heads of 128, page 16.
    pub fn llama3_8b() -> Self {
        Self { num_heads: 32, num_kv_heads: 8, head_size: 128, page_size: 16 }
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The softmax scale, 1/√D.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_size as f32).sqrt()
    }

    /// Bytes of K and V of `tokens` tokens of one layer.
    pub fn kv_bytes(&self, tokens: usize, cache_dtype: DType) -> f64 {
        (tokens * 2 * self.num_kv_heads * self.head_size * cache_dtype.size_bytes()) as f64
    }

    /// Causal attention FLOPs of a prefill of `seq` tokens with an empty cache.
    pub fn prefill_flops(&self, seq: usize) -> f64 {
        2.0 * 2.0 * (self.num_heads * self.head_size) as f64 * (seq * (seq + 1) / 2) as f64
    }

    pub(crate) fn spec(&self, dtype: DType, layers: usize, batch: usize, seq: usize) -> MhaSpec {
        MhaSpec {
            backend: kvjit_core::Backend::Cpu(crate::attention::attention_tier()),
            dtype,
            cache: cache_params(self, dtype, layers),
            num_heads: self.num_heads,
            mask: Mask::Causal,
            window: None,
            scale: self.scale(),
            step: StepDims { batch: Some(batch), seq: Some(seq) },
        }
    }
}

/// The parameters of a cache of `layers` layers of `heads` in `dtype` (an
/// FP8 one with a scale per [`FP8_GRANULARITY`] values).
///
/// # Panics
///
/// For a dtype no cache holds (u32).
pub(crate) fn cache_params(heads: &Heads, dtype: DType, layers: usize) -> KvCacheParams {
    let granularity = dtype.is_quantized().then_some(FP8_GRANULARITY.min(heads.head_size));
    KvCacheParams {
        element: CacheElement::new(dtype, granularity).expect("a cache dtype"),
        num_layers: layers,
        page_size: heads.page_size,
        num_kv_heads: heads.num_kv_heads,
        head_size: heads.head_size,
    }
}

/// The shape of one step: `batch` sequences holding `history` cached
/// tokens each, and `new_tokens` more for each this step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens each already holds in the cache.
    pub history: usize,
    /// Tokens each gets this step.
    pub new_tokens: usize,
}

/// A cache of `layers` layers for `step`'s sequences, with pages reserved
/// for its new tokens; pages handed out in a shuffled order (scattered page
/// tables), blocks random when `fill`.
pub(crate) fn make_cache(
    heads: &Heads,
    dtype: DType,
    layers: usize,
    step: StepShape,
    fill: bool,
    rng: &mut SmallRng,
) -> Result<PagedKVCacheCollection> {
    let StepShape { batch, history, new_tokens } = step;
    let params = cache_params(heads, dtype, layers);
    let pages_per_seq = (history + new_tokens).div_ceil(heads.page_size).max(1);
    let mut cache = PagedKVCacheCollection::new(params, batch * pages_per_seq, batch, pages_per_seq)?;
    lay_out(&mut cache, history, new_tokens, fill, rng)?;
    Ok(cache)
}

/// Hand `cache`'s pages out in a shuffled order (scattered page tables),
/// give each of its sequences `history` cached tokens and pages for
/// `new_tokens` more, and fill the blocks with random K/V when `fill`.
fn lay_out(
    cache: &mut PagedKVCacheCollection,
    history: usize,
    new_tokens: usize,
    fill: bool,
    rng: &mut SmallRng,
) -> Result<()> {
    let batch = cache.batch_size();
    let mut order: Vec<u32> = (0..cache.num_pages() as u32).collect();
    order.shuffle(rng);
    cache.set_allocation_order(order)?;
    if history > 0 {
        cache.reserve(&vec![history as u32; batch])?;
        cache.advance(&vec![history as u32; batch])?;
    }
    cache.reserve(&vec![new_tokens as u32; batch])?;
    if fill {
        fill_random(cache, rng)?;
    }
    Ok(())
}

/// Random K/V in the whole cache: uniform in [-1, 1) rounded to the dtype;
/// an FP8 cache's codes random too (uniform values quantized as codes, never
/// NaN) with scales uniform in [0.5, 1.5)/448, so values span about ±1.5.
fn fill_random(cache: &mut PagedKVCacheCollection, rng: &mut SmallRng) -> Result<()> {
    let shape = cache.blocks().shape().to_vec();
    let dtype = cache.params().dtype();
    if dtype.is_quantized() {
        let codes = Tensor::random(dtype, &shape, rng, -448.0, 448.0)?;
        cache.set_blocks(codes)?;
        let scales_shape = cache.scales().expect("an FP8 cache has scales").shape().to_vec();
        let scales = Tensor::random(DType::F32, &scales_shape, rng, 0.5 / 448.0, 1.5 / 448.0)?;
        cache.set_scales(scales)?;
    } else {
        cache.set_blocks(Tensor::random(dtype, &shape, rng, -1.0, 1.0)?)?;
    }
    Ok(())
}

/// Size `layer`'s cache for one step of `batch` sequences of `history`
/// cached tokens and one new one: a single layer, just the pages they need.
pub(crate) fn size_step_cache(layer: &mut LayerConfig, batch: usize, history: usize) {
    layer.num_layers = 1;
    layer.max_pages_per_seq = (history + 1).div_ceil(layer.page_size);
    layer.num_pages = batch * layer.max_pages_per_seq;
}

/// Inputs and the cache of one run of the step graph.
pub(crate) fn step_inputs(
    config: &LayerConfig,
    batch: usize,
    history: usize,
    seq: usize,
    rng: &mut SmallRng,
) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, PagedKVCacheCollection>)> {
    let params = config.cache_type().params();
    // The graph fixes the cache's pages and table width.
    let mut cache = PagedKVCacheCollection::new(params, config.num_pages, batch, config.max_pages_per_seq)?;
    // Random K/V only behind a history (the blocks are drawn whole either way).
    lay_out(&mut cache, history, seq, history > 0, rng)?;
    let inputs = [
        ("hidden_state".to_string(), Tensor::random(config.dtype, &[batch, seq, config.hidden_size], rng, -1.0, 1.0)?),
        ("valid_lengths".to_string(), Tensor::from_vec(&[batch], vec![seq as u32; batch])?),
        ("layer_idx".to_string(), Tensor::scalar_u32(0)),
    ]
    .into();
    Ok((inputs, [("kv_cache".to_string(), cache)].into()))
}

/// Compile the step graph with `batch` and `seq` left symbolic, as `kvjit
/// run` does: binding them is refused today (the reshape's target dims stay
/// symbolic while its input's become static), so its kernels are the
/// generic ones, which read B and S at run time.
pub(crate) fn compile_step(config: &LlamaConfig) -> Result<Executable> {
    let registry = standard_registry();
    let graph = attention_step_graph(config, registry.ops())?;
    Ok(compile(&graph, &registry, &CompileOptions::default())?)
}

/// Refuse a step whose outputs hold a NaN or an infinity.
pub(crate) fn check_finite<'a>(outputs: impl IntoIterator<Item = &'a Tensor>) -> Result<()> {
    for t in outputs {
        if t.to_f32_vec()?.iter().any(|v| !v.is_finite()) {
            return Err(BenchError::NotFinite { what: "the attention step's output" });
        }
    }
    Ok(())
}
