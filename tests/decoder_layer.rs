//! Whole Llama decoder layers and a whole tiny model, built by
//! `kvjit::models::llama`, against a naive model written here in f64: plain
//! loops over the weights read back from the graph's constants (RMSNorm,
//! the QKV projection, RoPE in the `rotate_half` layout with its
//! frequencies computed here from θ, causal grouped-query attention over
//! the whole history, the output projection, residuals, the SwiGLU MLP, the
//! embedding lookup, the last valid token and the logits). The naive model
//! keeps its own K/V history: it reads the cache once, for the history the
//! scenario starts with, and from then on only appends what it computed.
//!
//! Each check runs a ragged prefill (padded sequences) and several decode
//! steps, in f32 and bf16, with the compiler fusing and not fusing, and
//! compares every valid row of every step with a tolerance relative to the
//! largest output magnitude; fused and unfused runs must also agree with
//! each other within that tolerance.

use kvjit::models::llama::{
    HIDDEN_STATE_OUT, LOGITS, LayerConfig, LayerWeight, LlamaConfig, ModelWeight, TOKEN_IDS, decoder_layer_graph,
    model_graph, weight_name,
};
use kvjit::scenario::Scenario;
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Executor, Graph, PagedKVCacheCollection, Tensor, ValueDef, compile,
    standard_registry,
};

/// Compile options with the graph compiler fusing (`true`) or not.
fn options(fuse: bool) -> CompileOptions {
    // TODO(merge main): `CompileOptions { fuse, ..CompileOptions::default() }` once `fuse` lands.
    let _ = fuse;
    CompileOptions::default()
}

/// The largest |got − want| over the largest |want| of a step's outputs,
/// for f32 and bf16 runs. f32 differs from the f64 model by accumulation
/// order alone (seen: 2.0e-7 over two layers and the logits). bf16 rounds
/// every activation and cached K/V to 8 bits (2⁻⁹ relative; the weights
/// are bf16 on both sides) and the errors add up over the layers (seen:
/// 7.3e-3).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2e-6,
        DType::BF16 => 1.0 / 64.0,
        other => panic!("no tolerance for {other}"),
    }
}

/// A constant of the graph, widened to f64 (bf16 values are exact in f64).
fn constant(graph: &Graph, name: &str) -> Vec<f64> {
    let (_, value) =
        graph.constants().find(|(_, v)| v.name.as_deref() == Some(name)).unwrap_or_else(|| panic!("no {name}"));
    match &value.def {
        ValueDef::Constant { data, .. } => to_f64(data),
        _ => panic!("{name} is not a plain constant"),
    }
}

fn to_f64(tensor: &Tensor) -> Vec<f64> {
    tensor.to_f32_vec().unwrap().into_iter().map(f64::from).collect()
}

/// `x · wᵀ` for `w` `[N, K]` row-major.
fn linear(x: &[f64], w: &[f64]) -> Vec<f64> {
    let k = x.len();
    assert_eq!(w.len() % k, 0);
    w.chunks_exact(k).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms_norm(x: &[f64], weight: &[f64], epsilon: f64) -> Vec<f64> {
    let mean_square = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inverse = 1.0 / (mean_square + epsilon).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * inverse * w).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// RoPE's angle per position of each pair j < D/2: θ^(−2j/D), with
/// Llama-3.1's frequency scaling where the config has it.
fn inverse_frequencies(config: &LlamaConfig) -> Vec<f64> {
    let d = config.layer.head_size;
    (0..d / 2)
        .map(|j| {
            let freq = config.rope_theta.powf(-2.0 * j as f64 / d as f64);
            let Some(s) = config.llama3_scaling else { return freq };
            let wavelength = 2.0 * std::f64::consts::PI / freq;
            if wavelength < s.original_max_positions / s.high_freq_factor {
                freq
            } else if wavelength > s.original_max_positions / s.low_freq_factor {
                freq / s.factor
            } else {
                let smooth = (s.original_max_positions / wavelength - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * freq / s.factor + smooth * freq
            }
        })
        .collect()
}

/// Rotate every head of `x` (heads of D) at `position`, Hugging Face's
/// `rotate_half` way: element j pairs with j + D/2.
fn rope(x: &mut [f64], head_size: usize, inverse_frequencies: &[f64], position: usize) {
    for head in x.chunks_exact_mut(head_size) {
        for (j, &freq) in inverse_frequencies.iter().enumerate() {
            let (sin, cos) = (position as f64 * freq).sin_cos();
            let (a, b) = (head[j], head[j + head_size / 2]);
            head[j] = a * cos - b * sin;
            head[j + head_size / 2] = b * cos + a * sin;
        }
    }
}

/// One layer's weights, read back from the graph.
struct LayerWeights {
    attention_norm: Vec<f64>,
    qkv: Vec<f64>,
    o_proj: Vec<f64>,
    ffn_norm: Vec<f64>,
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
}

/// A token's rotated K and its V.
type KeyValue = (Vec<f64>, Vec<f64>);

/// The naive model: weights from the graph, and its own K/V history per
/// layer and sequence (position p at index p).
struct NaiveModel {
    config: LlamaConfig,
    layers: Vec<LayerWeights>,
    inverse_frequencies: Vec<f64>,
    history: Vec<Vec<Vec<KeyValue>>>,
}

impl NaiveModel {
    /// The model of `graph`, with the history `cache` holds before the
    /// first step.
    fn new(config: &LlamaConfig, graph: &Graph, cache: &PagedKVCacheCollection) -> Self {
        let layer_config = &config.layer;
        let weight = |layer, which| constant(graph, &weight_name(layer_config, layer, which));
        let layers = (0..layer_config.num_layers)
            .map(|l| LayerWeights {
                attention_norm: weight(l, LayerWeight::AttentionNorm),
                qkv: weight(l, LayerWeight::Qkv),
                o_proj: weight(l, LayerWeight::OutputProjection),
                ffn_norm: weight(l, LayerWeight::FfnNorm),
                gate: weight(l, LayerWeight::Gate),
                up: weight(l, LayerWeight::Up),
                down: weight(l, LayerWeight::Down),
            })
            .collect();
        let history = (0..layer_config.num_layers)
            .map(|layer| {
                (0..cache.batch_size())
                    .map(|b| {
                        (0..cache.cache_lengths()[b] as usize)
                            .map(|position| {
                                let (page, slot) = cache.locate(b, position).unwrap();
                                let read = |kv| {
                                    let row = cache.read_slot(page as usize, kv, layer, slot).unwrap();
                                    row.into_iter().map(f64::from).collect::<Vec<_>>()
                                };
                                (read(0), read(1))
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Self { config: config.clone(), layers, inverse_frequencies: inverse_frequencies(config), history }
    }

    /// Layer `l` on the next token of sequence `b` (its position is the
    /// history's length): appends the token's K and V, gives the layer's
    /// output row.
    fn layer(&mut self, l: usize, b: usize, x: &[f64]) -> Vec<f64> {
        let LayerConfig { num_q_heads: hq, num_kv_heads: hkv, head_size: d, .. } = self.config.layer;
        let (q_dim, kv_dim) = (hq * d, hkv * d);
        let epsilon = self.config.rms_norm_eps;
        let w = &self.layers[l];
        let projected = linear(&rms_norm(x, &w.attention_norm, epsilon), &w.qkv);
        let position = self.history[l][b].len();
        let mut q = projected[..q_dim].to_vec();
        let mut k = projected[q_dim..q_dim + kv_dim].to_vec();
        rope(&mut q, d, &self.inverse_frequencies, position);
        rope(&mut k, d, &self.inverse_frequencies, position);
        self.history[l][b].push((k, projected[q_dim + kv_dim..].to_vec()));
        // Causal attention: the token sees every position up to its own.
        let history = &self.history[l][b];
        let scale = 1.0 / (d as f64).sqrt();
        let mut attention = vec![0.0; q_dim];
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qh = &q[h * d..][..d];
            let scores: Vec<f64> = history
                .iter()
                .map(|(key, _)| scale * qh.iter().zip(&key[g * d..][..d]).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (weight, (_, value)) in weights.iter().zip(history) {
                for i in 0..d {
                    attention[h * d + i] += weight * value[g * d + i] / total;
                }
            }
        }
        let h: Vec<f64> = linear(&attention, &w.o_proj).iter().zip(x).map(|(o, x)| o + x).collect();
        let normed = rms_norm(&h, &w.ffn_norm, epsilon);
        let gate = linear(&normed, &w.gate);
        let up = linear(&normed, &w.up);
        let activation: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        linear(&activation, &w.down).iter().zip(&h).map(|(d, h)| d + h).collect()
    }

    /// Every layer on `rows`, sequence `b`'s next tokens in order.
    fn layers(&mut self, b: usize, rows: &[Vec<f64>]) -> Vec<Vec<f64>> {
        rows.iter()
            .map(|row| (0..self.config.layer.num_layers).fold(row.clone(), |x, l| self.layer(l, b, &x)))
            .collect()
    }
}

/// Largest |got − want| over the largest |want|.
fn normalized_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max) / scale
}

/// Which graph a check builds.
#[derive(Clone, Copy, Debug)]
enum Built {
    /// [`decoder_layer_graph`]: hidden state in, hidden state out (valid rows).
    Layers,
    /// [`model_graph`]: token ids in, logits out.
    Model,
}

/// Run `decode_steps` decode steps after a ragged prefill (3 sequences
/// padded to 5), compile with and without fusion, and check every step's
/// valid outputs against the naive model. Gives each run's outputs (valid
/// values only, steps concatenated) for the fused/unfused comparison.
fn check(config: &LlamaConfig, built: Built, fuse: bool, decode_steps: usize) -> Vec<f64> {
    let registry = standard_registry();
    let graph = match built {
        Built::Layers => decoder_layer_graph(config, registry.ops()).unwrap(),
        Built::Model => model_graph(config, registry.ops()).unwrap(),
    };
    let tolerance = tolerance(config.layer.dtype);
    let exe = compile(&graph, &registry, &options(fuse)).unwrap();
    let executor = Executor::new(DeviceContextPtr::cpu(2).unwrap());
    let mut scenario = Scenario::prefill_with(&graph, 11, 3, 5).unwrap();
    let valid = scenario.valid_lengths().unwrap();
    assert!(valid.iter().any(|&v| v < 5), "the prefill is ragged: {valid:?}");
    let mut naive = NaiveModel::new(config, &graph, &scenario.caches["kv_cache"]);
    let embedding = matches!(built, Built::Model).then(|| constant(&graph, ModelWeight::Embedding.name()));
    let hidden = config.layer.hidden_size;
    let mut all_outputs = Vec::new();
    for step in 0..=decode_steps {
        if step > 0 {
            scenario.next_decode_step().unwrap();
        }
        let valid = scenario.valid_lengths().unwrap();
        // Each sequence's valid rows in, through the naive layers.
        let (rows, seq): (Vec<Vec<Vec<f64>>>, usize) = match built {
            Built::Layers => {
                let x = &scenario.inputs["hidden_state"];
                let seq = x.shape()[1];
                let x = to_f64(x);
                let rows = valid
                    .iter()
                    .enumerate()
                    .map(|(b, &v)| (0..v as usize).map(|s| x[(b * seq + s) * hidden..][..hidden].to_vec()).collect())
                    .collect();
                (rows, seq)
            }
            Built::Model => {
                let ids = &scenario.inputs[TOKEN_IDS];
                let seq = ids.shape()[1];
                let ids = ids.to_u32_vec().unwrap();
                let table = embedding.as_ref().unwrap();
                let rows = valid
                    .iter()
                    .enumerate()
                    .map(|(b, &v)| {
                        (0..v as usize)
                            .map(|s| table[ids[b * seq + s] as usize * hidden..][..hidden].to_vec())
                            .collect()
                    })
                    .collect();
                (rows, seq)
            }
        };
        let naive_out: Vec<Vec<Vec<f64>>> = rows.iter().enumerate().map(|(b, rows)| naive.layers(b, rows)).collect();
        let out = executor.run(&exe, &scenario.inputs, &mut scenario.caches).unwrap();
        let (got, want) = match built {
            Built::Layers => {
                let out = to_f64(&out.outputs[HIDDEN_STATE_OUT]);
                let mut got = Vec::new();
                for (b, &v) in valid.iter().enumerate() {
                    got.extend_from_slice(&out[b * seq * hidden..][..v as usize * hidden]);
                }
                (got, naive_out.concat().concat())
            }
            Built::Model => {
                let logits = naive_logits(config, &graph, &naive_out);
                (to_f64(&out.outputs[LOGITS]), logits)
            }
        };
        let error = normalized_error(&got, &want);
        let name = &config.layer.name;
        assert!(error <= tolerance, "{name} {built:?} fuse={fuse} step {step}: error {error:e} > {tolerance:e}");
        all_outputs.extend(got);
        scenario.advance().unwrap();
    }
    all_outputs
}

/// The logits of each sequence's last valid row: final RMSNorm, then times
/// the transposed LM head (the embedding when tied); zeros for a sequence
/// with no valid token.
fn naive_logits(config: &LlamaConfig, graph: &Graph, rows: &[Vec<Vec<f64>>]) -> Vec<f64> {
    let final_norm = constant(graph, ModelWeight::FinalNorm.name());
    let head = constant(
        graph,
        if config.tie_word_embeddings { ModelWeight::Embedding.name() } else { ModelWeight::LmHead.name() },
    );
    rows.iter()
        .flat_map(|rows| match rows.last() {
            Some(last) => linear(&rms_norm(last, &final_norm, config.rms_norm_eps), &head),
            None => vec![0.0; config.vocab_size],
        })
        .collect()
}

/// `config` in f32 and in bf16, fused and unfused, each against the naive
/// model; fused and unfused must agree with each other too.
fn check_dtypes_and_fusion(config: &LlamaConfig, built: Built, decode_steps: usize) {
    for dtype in [DType::F32, DType::BF16] {
        let mut config = config.clone();
        config.layer.dtype = dtype;
        let fused = check(&config, built, true, decode_steps);
        let unfused = check(&config, built, false, decode_steps);
        let error = normalized_error(&fused, &unfused);
        let tolerance = tolerance(dtype);
        assert!(error <= tolerance, "{dtype} {built:?}: fused vs unfused error {error:e} > {tolerance:e}");
    }
}

#[test]
fn tiny_decoder_layers_match_the_naive_model_over_a_prefill_and_decode_steps() {
    check_dtypes_and_fusion(&LlamaConfig::tiny(), Built::Layers, 3);
}

/// One layer whose attention is wider than the hidden state (8 q heads of
/// 16 = 128 over hidden 48, 4 q heads per KV head), with Llama-3.1's RoPE
/// scaling: the output projection maps q_dim back to hidden.
#[test]
fn a_layer_whose_attention_is_wider_than_its_hidden_state_matches_the_naive_model() {
    let mut config = LlamaConfig::tiny();
    config.layer = LayerConfig {
        name: "wide_attention_layer".into(),
        hidden_size: 48,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_size: 16,
        page_size: 3,
        num_layers: 1,
        ..config.layer
    };
    config.ffn_size = 96;
    config.rope_theta = 500000.0;
    config.llama3_scaling = Some(kvjit::Llama3Scaling::LLAMA_3_1);
    check_dtypes_and_fusion(&config, Built::Layers, 3);
}

#[test]
fn the_tiny_model_matches_the_naive_model_from_token_ids_to_logits() {
    check_dtypes_and_fusion(&LlamaConfig::tiny(), Built::Model, 3);
}

#[test]
fn a_tiny_model_with_a_separate_lm_head_matches_the_naive_model() {
    let config = LlamaConfig { tie_word_embeddings: false, ..LlamaConfig::tiny() };
    for fuse in [true, false] {
        check(&config, Built::Model, fuse, 2);
    }
}

/// Every (op, input index) that reads constant `name`.
fn readers(graph: &Graph, name: &str) -> Vec<(String, usize)> {
    let (id, _) = graph.constants().find(|(_, v)| v.name.as_deref() == Some(name)).unwrap();
    graph
        .nodes()
        .iter()
        .flat_map(|node| node.inputs.iter().enumerate().filter(|(_, v)| **v == id).map(|(i, _)| (node.op.clone(), i)))
        .collect()
}

#[test]
fn a_tied_embedding_is_one_constant_read_by_the_gather_and_the_logits_matmul() {
    let registry = standard_registry();
    let tied = model_graph(&LlamaConfig::tiny(), registry.ops()).unwrap();
    assert_eq!(
        readers(&tied, ModelWeight::Embedding.name()),
        [("mo.gather".to_string(), 0), ("mo.matmul".to_string(), 1)]
    );
    assert!(!tied.constants().any(|(_, v)| v.name.as_deref() == Some(ModelWeight::LmHead.name())));
    let config = LlamaConfig { tie_word_embeddings: false, ..LlamaConfig::tiny() };
    let untied = model_graph(&config, registry.ops()).unwrap();
    assert_eq!(readers(&untied, ModelWeight::Embedding.name()), [("mo.gather".to_string(), 0)]);
    assert_eq!(readers(&untied, ModelWeight::LmHead.name()), [("mo.matmul".to_string(), 1)]);
    // The logits are [batch, vocab].
    let logits = untied.outputs().iter().find(|o| o.name == LOGITS).unwrap();
    let shape = &untied.value(logits.value).ty.as_tensor().unwrap().shape;
    assert_eq!(shape, &[kvjit::Dim::from("batch"), kvjit::Dim::from(96)]);
}

#[test]
fn the_scenario_draws_token_ids_within_the_vocabulary_seeded_and_fresh_each_step() {
    let registry = standard_registry();
    let graph = model_graph(&LlamaConfig::tiny(), registry.ops()).unwrap();
    let ids = |scenario: &Scenario| scenario.inputs[TOKEN_IDS].to_u32_vec().unwrap();
    let mut scenario = Scenario::prefill_with(&graph, 5, 4, 50).unwrap();
    let first = ids(&scenario);
    assert_eq!(scenario.inputs[TOKEN_IDS].shape(), [4, 50]);
    assert!(first.iter().all(|&id| id < 96), "{first:?}");
    // 200 draws over 96 ids: both ends of the range come up.
    assert!(first.iter().any(|&id| id < 8) && first.iter().any(|&id| id >= 88), "{first:?}");
    assert_eq!(ids(&Scenario::prefill_with(&graph, 5, 4, 50).unwrap()), first, "seeded");
    assert_ne!(ids(&Scenario::prefill_with(&graph, 6, 4, 50).unwrap()), first, "another seed");
    scenario.advance().unwrap();
    scenario.next_decode_step().unwrap();
    assert_eq!(scenario.inputs[TOKEN_IDS].shape(), [4, 1]);
    assert!(ids(&scenario).iter().all(|&id| id < 96));
}

#[test]
fn kvjit_run_runs_the_tiny_model_file_with_no_inputs_given() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiny_llama.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvjit")).args(["run", path]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains(LOGITS), "{stdout}");
}
