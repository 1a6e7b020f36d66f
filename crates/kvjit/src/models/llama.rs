//! Llama-family graphs: the typed config and the graph builders.
//!
//! [`LlamaConfig`] is a Llama model as kvjit builds it: the Hugging Face
//! `config.json` numbers (hidden size, heads, KV heads, head size, FFN
//! size, RoPE θ and Llama-3.1 scaling, RMSNorm ε, vocabulary, tied
//! embeddings) plus how kvjit holds it (dtypes, the paged KV cache).
//! Its [`layer`](LlamaConfig::layer) ([`LayerConfig`]) is what every
//! decoder layer's attention shares, and all the QKV projection needs.
//!
//! Two graphs are built from them today: [`qkv_layer_graph`], the fused QKV
//! projection of each layer writing K and V into the cache, and
//! [`attention_step_graph`], a whole attention step (fused QKV → reshape →
//! paged RoPE → paged flash attention, per layer). Their presets
//! ([`LlamaConfig::llama3_8b`], [`LlamaConfig::small`] and the
//! [`LayerConfig`] ones) make the example graphs under `examples/`.

use kvjit_core::DType;
use kvjit_graph::{Dim, Graph, GraphBuilder, KvCacheType, OpRegistry, RandomInit, ValueId};
use kvjit_op_attention::{Mask, MhaParams, mha};
use kvjit_op_fused_qkv::{FusedQkvParams, fused_qkv_matmul};
use kvjit_op_reshape::reshape;
use kvjit_op_rope::{Llama3Scaling, RopeInit, RopeParams, fused_qk_rope};

use crate::{Error, Result};

/// The attention layers of a Llama model as a graph holds them: their
/// shapes and dtypes, the paged KV cache they share, and the seed of their
/// random weights — everything [`qkv_layer_graph`] needs (with the graph's
/// name).
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

/// Build the QKV-layer graph: symbolic `batch` and `seq`, one fused-QKV
/// node per layer (each with its own seeded random weight and `layer_idx`
/// input), all writing the cache `kv_cache`; layer `l`'s Q is the output
/// [`output_name`]`(config, l)`.
pub fn qkv_layer_graph(config: &LayerConfig, ops: &OpRegistry) -> Result<Graph> {
    let mut b = GraphBuilder::new(&config.name, ops);
    let batch = Dim::from("batch");
    let hidden =
        b.input("hidden_state", config.dtype, &[batch.clone(), Dim::from("seq"), Dim::from(config.hidden_size)])?;
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch))?;
    let cache = b.kv_cache("kv_cache", config.cache_type())?;
    for layer in 0..config.num_layers {
        let (q, _) = qkv_projection(&mut b, config, layer, [hidden, cache, valid])?;
        b.output(&output_name(config, layer), q)?;
    }
    Ok(b.finish()?)
}

/// Layer `layer`'s fused QKV node reading `x` and writing `cache` at
/// `valid`'s tokens, with its seeded random weight `[N, K]` (uniform in
/// ±1/√K) and its `layer_idx` input (names prefixed `layers.{layer}.` when
/// there are several layers). Gives the node's Q and the `layer_idx` input.
fn qkv_projection(
    b: &mut GraphBuilder,
    config: &LayerConfig,
    layer: usize,
    [x, cache, valid]: [ValueId; 3],
) -> Result<(ValueId, ValueId)> {
    let prefix = if config.num_layers == 1 { String::new() } else { format!("layers.{layer}.") };
    let bound = 1.0 / (config.hidden_size as f32).sqrt();
    let weight = b.random_constant(
        &format!("{prefix}qkv_weight"),
        config.dtype,
        &[config.n(), config.hidden_size],
        RandomInit { seed: config.weight_seed + layer as u64, low: -bound, high: bound },
    )?;
    let layer_idx = b.input(&format!("{prefix}layer_idx"), DType::U32, &[])?;
    let q = fused_qkv_matmul(b, [x, weight, cache, layer_idx, valid], config.qkv_params())?;
    Ok((q, layer_idx))
}

/// A Llama-family model as kvjit builds it: the decoder layers' attention
/// ([`layer`](Self::layer): shapes, dtypes, layer count, the paged KV
/// cache) and the rest of the Hugging Face `config.json`.
#[derive(Clone, Debug)]
pub struct LlamaConfig {
    /// The attention layers: hidden size, query and KV heads, head size,
    /// dtype and cache dtype, page size, layers, the cache's pages, the
    /// weights' seed, the graph's name.
    pub layer: LayerConfig,
    /// Hidden size of each layer's MLP (`intermediate_size`).
    pub ffn_size: usize,
    /// RoPE base θ (`rope_theta`).
    pub rope_theta: f64,
    /// Llama-3.1 frequency scaling of the RoPE table (`rope_scaling` of
    /// `rope_type: "llama3"`), if any.
    pub llama3_scaling: Option<Llama3Scaling>,
    /// RoPE pair layout: false rotates Hugging Face `rotate_half` halves
    /// (Llama's checkpoints), true GGUF's interleaved pairs.
    pub rope_interleaved: bool,
    /// RMSNorm ε (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// Whether the LM head is the embedding matrix (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// Llama-3.1-8B (hidden 4096, 32 q heads, 8 KV heads of 128, FFN 14336,
    /// θ = 500000 with Llama-3.1 scaling, vocabulary 128256) in bf16, page
    /// 16 — with one layer and a 64-page cache: the example step
    /// `llama3_8b_attention.json`.
    pub fn llama3_8b() -> Self {
        Self {
            layer: LayerConfig { name: "llama3_8b_attention".into(), dtype: DType::BF16, ..LayerConfig::llama3_8b() },
            ffn_size: 14336,
            rope_theta: 500000.0,
            llama3_scaling: Some(Llama3Scaling::LLAMA_3_1),
            rope_interleaved: false,
            rms_norm_eps: 1e-5,
            vocab_size: 128256,
            tie_word_embeddings: false,
        }
    }

    /// A toy of two small layers (hidden 64, 4 q heads, 2 KV heads of 16,
    /// FFN 256, vocabulary 512, tied embeddings, page 4), f32: the example
    /// step `small_attention.json`.
    pub fn small() -> Self {
        Self {
            layer: LayerConfig { name: "small_attention".into(), ..LayerConfig::small() },
            ffn_size: 256,
            rope_theta: 10000.0,
            llama3_scaling: None,
            rope_interleaved: false,
            rms_norm_eps: 1e-5,
            vocab_size: 512,
            tie_word_embeddings: true,
        }
    }

    /// Rows of the RoPE table: every position a sequence's lookup table can
    /// address.
    pub fn max_positions(&self) -> usize {
        self.layer.max_pages_per_seq * self.layer.page_size
    }
}

/// Build one attention step of `config`'s model: per layer, the fused QKV
/// projection (K and V into the paged cache), a reshape to heads, paged
/// RoPE (Q out, K rotated in the cache) and paged causal flash attention,
/// the layers chained (each layer's attention output is the next one's
/// hidden state, so `q_dim` must equal the hidden size). Inputs
/// `hidden_state [batch, seq, K]`, `valid_lengths [batch]` and a
/// `layer_idx` per layer; the cache `kv_cache`; the RoPE table `freqs_cis`
/// as a recipe constant; the output `attention [batch, seq, Hq·D]` of the
/// last layer.
pub fn attention_step_graph(config: &LlamaConfig, ops: &OpRegistry) -> Result<Graph> {
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
        interleaved: config.rope_interleaved,
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
    for l in 0..layer.num_layers {
        let (q, layer_idx) = qkv_projection(&mut b, layer, l, [x, cache, valid])?;
        let q = reshape(&mut b, q, &heads)?;
        let q = fused_qk_rope(&mut b, [q, cache, freqs, layer_idx, valid], rope_params)?;
        let attention = mha(&mut b, [q, cache, layer_idx, valid], mha_params)?;
        x = reshape(&mut b, attention, &flat)?;
    }
    b.output("attention", x)?;
    Ok(b.finish()?)
}
