//! Llama-family graphs: the typed config and the graph builders.
//!
//! [`LayerConfig::llama3_8b`] is one Llama-3-8B attention layer's QKV
//! projection (hidden 4096, 32 query heads, 8 KV heads of 128, page size 16);
//! [`LayerConfig::small`] is a two-layer toy that runs in microseconds.
//! [`attention_step_graph`] builds a whole attention step on top of it
//! (fused QKV → reshape → paged RoPE → paged flash attention, per layer).

use kvjit_core::DType;
use kvjit_graph::{Dim, Graph, GraphBuilder, KvCacheType, OpRegistry, RandomInit};
use kvjit_op_attention::{Mask, MhaParams, mha};
use kvjit_op_fused_qkv::{FusedQkvParams, fused_qkv_matmul};
use kvjit_op_reshape::reshape;
use kvjit_op_rope::{Llama3Scaling, RopeInit, RopeParams, fused_qk_rope};

use crate::{Error, Result};

/// The shape of an example attention layer's QKV projection.
#[derive(Clone, Debug)]
pub struct LayerConfig {
    /// Graph name.
    pub name: String,
    /// Activation and weight dtype (and the cache's, unless `cache_dtype`).
    pub dtype: DType,
    /// The cache's dtype when it differs: `f8e4m3` for an FP8 cache (its
    /// scale granularity 128, or D when 128 does not divide D).
    pub cache_dtype: Option<DType>,
    /// Hidden size K.
    pub hidden_size: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per cache page.
    pub page_size: usize,
    /// Layers (one node each, all writing one shared cache).
    pub num_layers: usize,
    /// Physical pages in the cache.
    pub num_pages: usize,
    /// Lookup-table width.
    pub max_pages_per_seq: usize,
    /// Seed of the first layer's weight (layer l uses seed + l).
    pub weight_seed: u64,
}

impl LayerConfig {
    /// One Llama-3-8B layer: hidden 4096, 32 q heads, 8 kv heads of 128, page 16.
    pub fn llama3_8b() -> Self {
        Self {
            name: "llama3_8b_layer".into(),
            dtype: DType::F32,
            hidden_size: 4096,
            num_q_heads: 32,
            num_kv_heads: 8,
            head_size: 128,
            page_size: 16,
            num_layers: 1,
            num_pages: 64,
            max_pages_per_seq: 16,
            weight_seed: 8,
            cache_dtype: None,
        }
    }

    /// A two-layer toy (hidden 64, 4 q heads, 2 kv heads of 16, page 4).
    pub fn small() -> Self {
        Self {
            name: "small_two_layers".into(),
            dtype: DType::F32,
            hidden_size: 64,
            num_q_heads: 4,
            num_kv_heads: 2,
            head_size: 16,
            page_size: 4,
            num_layers: 2,
            num_pages: 48,
            max_pages_per_seq: 16,
            weight_seed: 1,
            cache_dtype: None,
        }
    }

    /// Q columns: query heads × head size.
    pub fn q_dim(&self) -> usize {
        self.num_q_heads * self.head_size
    }

    /// Weight rows N = q_dim + 2·Hkv·D.
    pub fn n(&self) -> usize {
        self.q_dim() + 2 * self.num_kv_heads * self.head_size
    }

    /// The fused QKV node's parameters.
    pub fn qkv_params(&self) -> FusedQkvParams {
        FusedQkvParams {
            dtype: self.dtype,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
            page_size: self.page_size,
        }
    }

    /// The cache type, with `batch` symbolic.
    pub fn cache_type(&self) -> KvCacheType {
        let dtype = self.cache_dtype.unwrap_or(self.dtype);
        let granularity = match self.head_size % kvjit_graph::DEFAULT_SCALE_GRANULARITY {
            0 => kvjit_graph::DEFAULT_SCALE_GRANULARITY,
            _ => self.head_size,
        };
        KvCacheType {
            dtype,
            num_layers: self.num_layers,
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
            scale_granularity: dtype.is_quantized().then_some(granularity),
            num_pages: Dim::from(self.num_pages),
            batch: Dim::from("batch"),
            max_pages_per_seq: Dim::from(self.max_pages_per_seq),
        }
    }
}

/// Name of layer `l`'s output: `q` for one layer, `layers.{l}.q` for more.
pub fn output_name(config: &LayerConfig, layer: usize) -> String {
    if config.num_layers == 1 { "q".into() } else { format!("layers.{layer}.q") }
}

/// Build the example graph: symbolic `batch` and `seq`, one fused-QKV node
/// per layer (each with its own seeded random weight and `layer_idx` input),
/// all writing the cache `kv_cache`.
pub fn layer_graph(config: &LayerConfig, ops: &OpRegistry) -> Result<Graph> {
    let mut b = GraphBuilder::new(&config.name, ops);
    let batch = Dim::from("batch");
    let hidden =
        b.input("hidden_state", config.dtype, &[batch.clone(), Dim::from("seq"), Dim::from(config.hidden_size)])?;
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch))?;
    let cache = b.kv_cache("kv_cache", config.cache_type())?;
    let params = config.qkv_params();
    let bound = 1.0 / (config.hidden_size as f32).sqrt();
    for layer in 0..config.num_layers {
        let prefix = if config.num_layers == 1 { String::new() } else { format!("layers.{layer}.") };
        let weight = b.random_constant(
            &format!("{prefix}qkv_weight"),
            config.dtype,
            &[config.n(), config.hidden_size],
            RandomInit { seed: config.weight_seed + layer as u64, low: -bound, high: bound },
        )?;
        let layer_idx = b.input(&format!("{prefix}layer_idx"), DType::U32, &[])?;
        let q = fused_qkv_matmul(&mut b, [hidden, weight, cache, layer_idx, valid], params)?;
        b.output(&output_name(config, layer), q)?;
    }
    Ok(b.finish()?)
}

/// One attention step of a model: per layer, the fused QKV projection
/// (K and V into the paged cache), a reshape to heads, paged RoPE (Q out, K
/// rotated in the cache) and paged causal flash attention, the layers
/// chained (each layer's attention output is the next one's hidden state,
/// so `q_dim` must equal the hidden size).
#[derive(Clone, Debug)]
pub struct AttentionConfig {
    /// Shapes, dtype, cache and weights (as for the QKV graph).
    pub layer: LayerConfig,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Llama-3.1 frequency scaling of the RoPE table, if any.
    pub llama3_scaling: Option<Llama3Scaling>,
    /// RoPE pair layout (false: Hugging Face `rotate_half`, as Llama uses).
    pub interleaved: bool,
}

impl AttentionConfig {
    /// Llama-3-8B's attention (hidden 4096, 32 q heads, 8 KV heads of 128,
    /// θ = 500000 with Llama-3.1 scaling) in bf16, one layer, page 16.
    pub fn llama3_8b() -> Self {
        Self {
            layer: LayerConfig { name: "llama3_8b_attention".into(), dtype: DType::BF16, ..LayerConfig::llama3_8b() },
            rope_theta: 500000.0,
            llama3_scaling: Some(Llama3Scaling::LLAMA_3_1),
            interleaved: false,
        }
    }

    /// Two small layers (hidden 64, 4 q heads, 2 KV heads of 16, page 4), f32.
    pub fn small() -> Self {
        Self {
            layer: LayerConfig { name: "small_attention".into(), ..LayerConfig::small() },
            rope_theta: 10000.0,
            llama3_scaling: None,
            interleaved: false,
        }
    }

    /// Rows of the RoPE table: every position a sequence's lookup table can
    /// address.
    pub fn max_positions(&self) -> usize {
        self.layer.max_pages_per_seq * self.layer.page_size
    }
}

/// Build the attention-step graph of `config`: inputs `hidden_state [batch,
/// seq, K]`, `valid_lengths [batch]` and a `layer_idx` per layer; the cache
/// `kv_cache`; the RoPE table `freqs_cis` as a recipe constant; the output
/// `attention [batch, seq, Hq·D]` of the last layer.
pub fn attention_step_graph(config: &AttentionConfig, ops: &OpRegistry) -> Result<Graph> {
    let layer = &config.layer;
    if layer.q_dim() != layer.hidden_size {
        return Err(Error::Usage(format!(
            "an attention step chains its layers, so q_dim ({}) must equal the hidden size ({})",
            layer.q_dim(),
            layer.hidden_size
        )));
    }
    let mut b = GraphBuilder::new(&layer.name, ops);
    let (batch, seq) = (Dim::from("batch"), Dim::from("seq"));
    let mut x = b.input("hidden_state", layer.dtype, &[batch.clone(), seq.clone(), Dim::from(layer.hidden_size)])?;
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch))?;
    let cache = b.kv_cache("kv_cache", layer.cache_type())?;
    let rope = RopeInit { rope_theta: config.rope_theta, llama3_scaling: config.llama3_scaling };
    let freqs = b.recipe_constant("freqs_cis", layer.dtype, &[config.max_positions(), layer.head_size], rope.into())?;
    let rope_params = RopeParams {
        dtype: layer.dtype,
        interleaved: config.interleaved,
        num_kv_heads: layer.num_kv_heads,
        head_size: layer.head_size,
        page_size: layer.page_size,
    };
    let mha_params = MhaParams {
        dtype: layer.dtype,
        mask: Mask::Causal,
        scale: None,
        local_window_size: None,
        num_kv_heads: layer.num_kv_heads,
        head_size: layer.head_size,
        page_size: layer.page_size,
    };
    let heads = [batch.clone(), seq.clone(), Dim::from(layer.num_q_heads), Dim::from(layer.head_size)];
    let flat = [batch.clone(), seq.clone(), Dim::from(layer.q_dim())];
    let bound = 1.0 / (layer.hidden_size as f32).sqrt();
    for l in 0..layer.num_layers {
        let prefix = if layer.num_layers == 1 { String::new() } else { format!("layers.{l}.") };
        let weight = b.random_constant(
            &format!("{prefix}qkv_weight"),
            layer.dtype,
            &[layer.n(), layer.hidden_size],
            RandomInit { seed: layer.weight_seed + l as u64, low: -bound, high: bound },
        )?;
        let layer_idx = b.input(&format!("{prefix}layer_idx"), DType::U32, &[])?;
        let q = fused_qkv_matmul(&mut b, [x, weight, cache, layer_idx, valid], layer.qkv_params())?;
        let q = reshape(&mut b, q, &heads)?;
        let q = fused_qk_rope(&mut b, [q, cache, freqs, layer_idx, valid], rope_params)?;
        let attention = mha(&mut b, [q, cache, layer_idx, valid], mha_params)?;
        x = reshape(&mut b, attention, &flat)?;
    }
    b.output("attention", x)?;
    Ok(b.finish()?)
}
