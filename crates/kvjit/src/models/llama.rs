//! Llama-family graphs: the typed config and the graph builders.
//!
//! [`LlamaConfig`] is a Llama model as kvjit builds it: the Hugging Face
//! `config.json` numbers (hidden size, heads, KV heads, head size, FFN
//! size, RoPE θ and Llama-3.1 scaling, RMSNorm ε, vocabulary, tied
//! embeddings) plus how kvjit holds it (dtypes, the paged KV cache).
//! Its [`layer`](LlamaConfig::layer) ([`LayerConfig`]) is what every
//! decoder layer's attention shares, and all the QKV projection needs.
//!
//! Four graphs are built from them: [`qkv_layer_graph`], the fused QKV
//! projection of each layer writing K and V into the cache;
//! [`attention_step_graph`], a whole attention step (fused QKV → reshape →
//! paged RoPE → paged flash attention, per layer); [`decoder_layer_graph`],
//! whole decoder layers (RMSNorm → attention → output projection +
//! residual → RMSNorm → SwiGLU MLP + residual); and [`model_graph`], a whole
//! model from token ids to the last valid token's logits. Their presets
//! ([`LlamaConfig::llama3_8b`], [`LlamaConfig::llama3_8b_decoder_layer`],
//! [`LlamaConfig::small`], [`LlamaConfig::tiny`] and the [`LayerConfig`]
//! ones) make the example graphs under `examples/`.
//!
//! Every weight is a seeded random constant (graph files keep the recipe,
//! not the data): the projections uniform in ±1/√fan_in, the RMSNorm
//! weights uniform in [0.5, 1.5], the embedding uniform in ±1.
//! [`LayerWeight`] and [`ModelWeight`] name each, with its shape and init.

use kvjit_core::DType;
use kvjit_graph::{Dim, Graph, GraphBuilder, KvCacheType, OpRegistry, RandomInit, ValueId};
use kvjit_op_attention::{Mask, MhaParams, mha};
use kvjit_op_binary::{add, mul};
use kvjit_op_fused_qkv::{FusedQkvParams, fused_qkv_matmul};
use kvjit_op_gather::gather_as;
use kvjit_op_last_token::last_valid_token;
use kvjit_op_matmul::{MatmulParams, matmul};
use kvjit_op_reshape::reshape;
use kvjit_op_rms_norm::{RmsNormParams, rms_norm};
use kvjit_op_rope::{Llama3Scaling, RopeInit, RopeParams, fused_qk_rope};
use kvjit_op_silu::silu;

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

/// The prefix of layer `layer`'s names (its weights, its `layer_idx`
/// input): none for one layer, `layers.{layer}.` for more.
pub fn layer_prefix(config: &LayerConfig, layer: usize) -> String {
    if config.num_layers == 1 { String::new() } else { format!("layers.{layer}.") }
}

/// The weights of one decoder layer, in the order the layer uses them. Each
/// is a seeded random constant (see [`LayerWeight::shape`] and
/// [`LayerWeight::init`]) named [`weight_name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerWeight {
    /// RMSNorm weight before attention, `[hidden]`.
    AttentionNorm,
    /// Fused Q, K and V projection, `[q_dim + 2·Hkv·D, hidden]`.
    Qkv,
    /// Attention output projection (`o_proj`), `[hidden, q_dim]`.
    OutputProjection,
    /// RMSNorm weight before the MLP, `[hidden]`.
    FfnNorm,
    /// MLP gate projection, `[ffn, hidden]`.
    Gate,
    /// MLP up projection, `[ffn, hidden]`.
    Up,
    /// MLP down projection, `[hidden, ffn]`.
    Down,
}

impl LayerWeight {
    /// Every layer weight, in the order the layer uses them.
    pub const ALL: [Self; 7] =
        [Self::AttentionNorm, Self::Qkv, Self::OutputProjection, Self::FfnNorm, Self::Gate, Self::Up, Self::Down];

    /// The constant's name within its layer (see [`weight_name`]).
    pub fn name(self) -> &'static str {
        match self {
            Self::AttentionNorm => "attn_norm",
            Self::Qkv => "qkv_weight",
            Self::OutputProjection => "o_proj",
            Self::FfnNorm => "ffn_norm",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The weight's shape: `[N, K]` (output features, input features; the
    /// projections multiply by its transpose) or `[hidden]` for a norm.
    /// `ffn_size` is the MLP's hidden size (only the MLP weights use it).
    pub fn shape(self, config: &LayerConfig, ffn_size: usize) -> Vec<usize> {
        let (hidden, q_dim) = (config.hidden_size, config.q_dim());
        match self {
            Self::AttentionNorm | Self::FfnNorm => vec![hidden],
            Self::Qkv => vec![config.n(), hidden],
            Self::OutputProjection => vec![hidden, q_dim],
            Self::Gate | Self::Up => vec![ffn_size, hidden],
            Self::Down => vec![hidden, ffn_size],
        }
    }

    /// Layer `layer`'s random init: projections uniform in ±1/√K (K their
    /// input features), norms uniform in [0.5, 1.5]; seeded
    /// `weight_seed + layer + 1000·i`, i the weight's place in
    /// [`ALL`](Self::ALL) counted from the QKV weight (0, the seed
    /// [`qkv_layer_graph`] has always used).
    pub fn init(self, config: &LayerConfig, layer: usize, ffn_size: usize) -> RandomInit {
        let offset = match self {
            Self::Qkv => 0,
            Self::AttentionNorm => 1,
            Self::OutputProjection => 2,
            Self::FfnNorm => 3,
            Self::Gate => 4,
            Self::Up => 5,
            Self::Down => 6,
        };
        let seed = config.weight_seed + layer as u64 + 1000 * offset;
        match self.shape(config, ffn_size).as_slice() {
            [_, fan_in] => {
                let bound = 1.0 / (*fan_in as f32).sqrt();
                RandomInit { seed, low: -bound, high: bound }
            }
            _ => RandomInit { seed, low: 0.5, high: 1.5 },
        }
    }
}

/// The name of layer `layer`'s `weight` constant: [`layer_prefix`] then
/// [`LayerWeight::name`] (`o_proj`, `layers.1.gate_proj`, …).
pub fn weight_name(config: &LayerConfig, layer: usize, weight: LayerWeight) -> String {
    format!("{}{}", layer_prefix(config, layer), weight.name())
}

/// Declare layer `layer`'s `weight` as its seeded random constant
/// (`ffn_size` sizes the MLP weights; the others ignore it).
fn layer_weight(
    b: &mut GraphBuilder,
    config: &LayerConfig,
    ffn_size: usize,
    layer: usize,
    weight: LayerWeight,
) -> Result<ValueId> {
    let name = weight_name(config, layer, weight);
    let shape = weight.shape(config, ffn_size);
    Ok(b.random_constant(&name, config.dtype, &shape, weight.init(config, layer, ffn_size))?)
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
    let weight = layer_weight(b, config, 0, layer, LayerWeight::Qkv)?;
    let layer_idx = b.input(&format!("{}layer_idx", layer_prefix(config, layer)), DType::U32, &[])?;
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
    /// A divisor per RoPE frequency (`head_size / 2` of them), if any: a
    /// GGUF file's `rope_freqs.weight`, or linear scaling's factor.
    pub rope_freq_factors: Option<Vec<f64>>,
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
            rope_freq_factors: None,
            rope_interleaved: false,
            rms_norm_eps: 1e-5,
            vocab_size: 128256,
            tie_word_embeddings: false,
        }
    }

    /// [`llama3_8b`](Self::llama3_8b) named for one whole decoder layer:
    /// the example `llama3_8b_decoder_layer.json` ([`decoder_layer_graph`]).
    pub fn llama3_8b_decoder_layer() -> Self {
        let mut config = Self::llama3_8b();
        config.layer.name = "llama3_8b_decoder_layer".into();
        config
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
            rope_freq_factors: None,
            rope_interleaved: false,
            rms_norm_eps: 1e-5,
            vocab_size: 512,
            tie_word_embeddings: true,
        }
    }

    /// A whole model small enough for tests: two layers of hidden 64 (4 q
    /// heads, 2 KV heads of 16), FFN 128, vocabulary 96, tied embeddings,
    /// θ = 10000, page 4, f32 — the example `tiny_llama.json`
    /// ([`model_graph`]).
    pub fn tiny() -> Self {
        Self {
            layer: LayerConfig { name: "tiny_llama".into(), ..LayerConfig::small() },
            ffn_size: 128,
            vocab_size: 96,
            ..Self::small()
        }
    }

    /// Rows of the RoPE table: every position a sequence's lookup table can
    /// address.
    pub fn max_positions(&self) -> usize {
        self.layer.max_pages_per_seq * self.layer.page_size
    }

    /// The RMSNorm nodes' parameters (ε as f32, no weight offset).
    pub fn rms_norm_params(&self) -> RmsNormParams {
        RmsNormParams { epsilon: self.rms_norm_eps as f32, weight_offset: None }
    }
}

/// The weights of [`model_graph`] outside its layers. Each is a seeded
/// random constant named [`ModelWeight::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelWeight {
    /// The embedding table `[vocab, hidden]` (also the LM head when the
    /// embeddings are tied), uniform in ±1.
    Embedding,
    /// The final RMSNorm weight `[hidden]`, uniform in [0.5, 1.5].
    FinalNorm,
    /// The separate LM head `[vocab, hidden]` (untied embeddings only),
    /// uniform in ±1/√hidden.
    LmHead,
}

impl ModelWeight {
    /// The constant's name: `embed_tokens`, `final_norm`, `lm_head`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Embedding => "embed_tokens",
            Self::FinalNorm => "final_norm",
            Self::LmHead => "lm_head",
        }
    }

    /// The weight's shape.
    pub fn shape(self, config: &LlamaConfig) -> Vec<usize> {
        match self {
            Self::Embedding | Self::LmHead => vec![config.vocab_size, config.layer.hidden_size],
            Self::FinalNorm => vec![config.layer.hidden_size],
        }
    }

    /// The weight's random init, seeded `weight_seed + 100000 + i` (i = 0,
    /// 1, 2 for the embedding, the final norm, the LM head).
    pub fn init(self, config: &LlamaConfig) -> RandomInit {
        let seed = config.layer.weight_seed + 100_000;
        let bound = 1.0 / (config.layer.hidden_size as f32).sqrt();
        match self {
            Self::Embedding => RandomInit { seed, low: -1.0, high: 1.0 },
            Self::FinalNorm => RandomInit { seed: seed + 1, low: 0.5, high: 1.5 },
            Self::LmHead => RandomInit { seed: seed + 2, low: -bound, high: bound },
        }
    }

    /// Declare the weight in `b`.
    fn declare(self, b: &mut GraphBuilder, config: &LlamaConfig) -> Result<ValueId> {
        Ok(b.random_constant(self.name(), config.layer.dtype, &self.shape(config), self.init(config))?)
    }
}

/// [`model_graph`]'s input: token ids, u32 `[batch, seq]`.
pub const TOKEN_IDS: &str = "ids";
/// [`model_graph`]'s output: the last valid token's logits `[batch, vocab]`.
pub const LOGITS: &str = "logits";
/// [`decoder_layer_graph`]'s output: the last layer's hidden state
/// `[batch, seq, hidden]`.
pub const HIDDEN_STATE_OUT: &str = "hidden_state_out";

/// What every layer of a step shares: the valid lengths, the paged KV
/// cache, the RoPE table, and the RoPE and attention nodes' parameters.
struct StepValues {
    valid: ValueId,
    cache: ValueId,
    freqs: ValueId,
    rope: RopeParams,
    mha: MhaParams,
}

impl StepValues {
    /// Declare the input `valid_lengths [batch]`, the cache `kv_cache` and
    /// the RoPE table `freqs_cis` (a recipe constant), in that order.
    fn declare(b: &mut GraphBuilder, config: &LlamaConfig) -> Result<Self> {
        let layer = &config.layer;
        let valid = b.input("valid_lengths", DType::U32, &[Dim::from("batch")])?;
        let cache = b.kv_cache("kv_cache", layer.cache_type())?;
        let rope = RopeInit {
            rope_theta: config.rope_theta,
            llama3_scaling: config.llama3_scaling,
            freq_factors: config.rope_freq_factors.clone(),
        };
        let freqs =
            b.recipe_constant("freqs_cis", layer.dtype, &[config.max_positions(), layer.head_size], rope.into())?;
        let rope = RopeParams {
            dtype: layer.dtype,
            interleaved: config.rope_interleaved,
            num_kv_heads: layer.num_kv_heads,
            head_size: layer.head_size,
            page_size: layer.page_size,
        };
        let mha = MhaParams {
            dtype: layer.dtype,
            mask: Mask::Causal,
            scale: None,
            local_window_size: None,
            num_kv_heads: layer.num_kv_heads,
            head_size: layer.head_size,
            page_size: layer.page_size,
        };
        Ok(Self { valid, cache, freqs, rope, mha })
    }
}

/// `[batch, seq, width]`, batch and seq symbolic.
fn step_shape(width: usize) -> [Dim; 3] {
    [Dim::from("batch"), Dim::from("seq"), Dim::from(width)]
}

/// Layer `layer`'s attention of `x` `[batch, seq, hidden]`: the fused QKV
/// projection (K and V into the cache), a reshape to heads, paged RoPE and
/// paged causal attention, reshaped back to `[batch, seq, q_dim]`.
fn attention_block(
    b: &mut GraphBuilder,
    config: &LayerConfig,
    layer: usize,
    x: ValueId,
    step: &StepValues,
) -> Result<ValueId> {
    let (q, layer_idx) = qkv_projection(b, config, layer, [x, step.cache, step.valid])?;
    let heads = [Dim::from("batch"), Dim::from("seq"), Dim::from(config.num_q_heads), Dim::from(config.head_size)];
    let q = reshape(b, q, &heads)?;
    let q = fused_qk_rope(b, [q, step.cache, step.freqs, layer_idx, step.valid], step.rope)?;
    let attention = mha(b, [q, step.cache, layer_idx, step.valid], step.mha)?;
    Ok(reshape(b, attention, &step_shape(config.q_dim()))?)
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
    let mut x = b.input("hidden_state", layer.dtype, &step_shape(layer.hidden_size))?;
    let step = StepValues::declare(&mut b, config)?;
    for l in 0..layer.num_layers {
        x = attention_block(&mut b, layer, l, x, &step)?;
    }
    b.output("attention", x)?;
    Ok(b.finish()?)
}

/// `x · weightᵀ` for a constant `weight` `[N, K]` (a `mo.matmul` with
/// `transpose_b`): every projection of the model.
fn project(b: &mut GraphBuilder, x: ValueId, weight: ValueId) -> Result<ValueId> {
    Ok(matmul(b, x, weight, MatmulParams { transpose_b: true })?)
}

/// Layer `layer` of the model on `x` `[batch, seq, hidden]`:
/// `h = x + o_proj(attention(rms_norm(x)))`, then
/// `h + down(silu(gate(n)) ⊙ up(n))` with `n = rms_norm(h)`.
fn decoder_layer(
    b: &mut GraphBuilder,
    config: &LlamaConfig,
    layer: usize,
    x: ValueId,
    step: &StepValues,
) -> Result<ValueId> {
    let (shapes, ffn) = (&config.layer, config.ffn_size);
    let weight = |b: &mut GraphBuilder, which| layer_weight(b, shapes, ffn, layer, which);
    let attention_norm = weight(b, LayerWeight::AttentionNorm)?;
    let normed = rms_norm(b, x, attention_norm, config.rms_norm_params())?;
    let attention = attention_block(b, shapes, layer, normed, step)?;
    let o_proj = weight(b, LayerWeight::OutputProjection)?;
    let projected = project(b, attention, o_proj)?;
    let h = add(b, projected, x)?;
    let ffn_norm = weight(b, LayerWeight::FfnNorm)?;
    let normed = rms_norm(b, h, ffn_norm, config.rms_norm_params())?;
    let gate_proj = weight(b, LayerWeight::Gate)?;
    let gate = project(b, normed, gate_proj)?;
    let gate = silu(b, gate)?;
    let up_proj = weight(b, LayerWeight::Up)?;
    let up = project(b, normed, up_proj)?;
    let activation = mul(b, gate, up)?;
    let down_proj = weight(b, LayerWeight::Down)?;
    let down = project(b, activation, down_proj)?;
    Ok(add(b, down, h)?)
}

/// Build `config.layer.num_layers` whole Llama decoder layers, chained:
/// each `x → rms_norm → attention (fused QKV into the paged cache, RoPE,
/// causal GQA) → o_proj + x → rms_norm → down(silu(gate) ⊙ up) + residual`,
/// with the [`LayerWeight`]s as seeded random constants. Inputs
/// `hidden_state [batch, seq, hidden]`, `valid_lengths [batch]` and a
/// `layer_idx` per layer; the cache `kv_cache`; the RoPE table `freqs_cis`;
/// the output [`HIDDEN_STATE_OUT`] `[batch, seq, hidden]`. Rows past a
/// sequence's valid length are padding: whatever they hold means nothing.
pub fn decoder_layer_graph(config: &LlamaConfig, ops: &OpRegistry) -> Result<Graph> {
    let layer = &config.layer;
    let mut b = GraphBuilder::new(&layer.name, ops);
    let mut x = b.input("hidden_state", layer.dtype, &step_shape(layer.hidden_size))?;
    let step = StepValues::declare(&mut b, config)?;
    for l in 0..layer.num_layers {
        x = decoder_layer(&mut b, config, l, x, &step)?;
    }
    b.output(HIDDEN_STATE_OUT, x)?;
    Ok(b.finish()?)
}

/// Build a whole model step: token ids [`TOKEN_IDS`] u32 `[batch, seq]` →
/// the embedding ([`ModelWeight::Embedding`], `mo.gather`) → the decoder
/// layers of [`decoder_layer_graph`] → the final RMSNorm
/// ([`ModelWeight::FinalNorm`]) → each sequence's last valid token
/// (`kvjit.last_valid_token`) → the logits [`LOGITS`] `[batch, vocab]`: the
/// token times the transposed embedding when the embeddings are tied (one
/// constant feeding both nodes), else times the transposed
/// [`ModelWeight::LmHead`]. Other inputs: `valid_lengths [batch]` and a
/// `layer_idx` per layer; the cache `kv_cache`; the RoPE table
/// `freqs_cis`. A sequence of valid length 0 gets zero logits.
pub fn model_graph(config: &LlamaConfig, ops: &OpRegistry) -> Result<Graph> {
    let mut b = GraphBuilder::new(&config.layer.name, ops);
    declare_model(&mut b, config)?;
    Ok(b.finish()?)
}

/// [`model_graph`]'s graph file (JSON, no weights file), its random weights
/// kept as their recipes and never drawn ([`GraphBuilder::for_graph_file`]).
pub fn model_graph_file(config: &LlamaConfig, ops: &OpRegistry) -> Result<String> {
    let mut b = GraphBuilder::for_graph_file(&config.layer.name, ops);
    declare_model(&mut b, config)?;
    Ok(b.finish_to_json()?)
}

/// Declare [`model_graph`]'s inputs, nodes and output in `b`.
fn declare_model(b: &mut GraphBuilder, config: &LlamaConfig) -> Result<()> {
    let layer = &config.layer;
    let ids = b.input(TOKEN_IDS, DType::U32, &[Dim::from("batch"), Dim::from("seq")])?;
    let step = StepValues::declare(b, config)?;
    let embedding = ModelWeight::Embedding.declare(b, config)?;
    // The output's dtype named, so that a table kept in a weight block
    // format (a GGUF model's) decodes to the model's dtype.
    let mut x = gather_as(b, embedding, ids, Some(layer.dtype))?;
    for l in 0..layer.num_layers {
        x = decoder_layer(b, config, l, x, &step)?;
    }
    let final_norm = ModelWeight::FinalNorm.declare(b, config)?;
    let x = rms_norm(b, x, final_norm, config.rms_norm_params())?;
    let last = last_valid_token(b, x, step.valid)?;
    let head = match config.tie_word_embeddings {
        true => embedding,
        false => ModelWeight::LmHead.declare(b, config)?,
    };
    let logits = project(b, last, head)?;
    b.output(LOGITS, logits)?;
    Ok(())
}
