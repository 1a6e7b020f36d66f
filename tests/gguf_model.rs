//! A tiny Llama-family GGUF file written here (2 layers, hidden 64, 4 query
//! heads and 2 KV heads of 16, FFN 256, a 262-token byte-level BPE
//! vocabulary with ChatML control tokens), its tensors spread over every
//! type the writer quantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K;
//! the others kvjit reads are checked against gguf-py in `kvjit-gguf`), run by
//! kvjit from the file and checked against a naive f64 model written here
//! over the same weights read back from the file: `load_model` and
//! `generate::Model` (prefill and greedy decode steps, f32 and bf16, tied
//! and untied LM head), `import` then `load_graph` of its model.json, the
//! `kvjit import` / `kvjit generate` commands end to end, and what a bad
//! file or request gets from the command: one line on stderr, exit 1.
//!
//! The naive model is independent of kvjit's graph: plain loops over the
//! file's tensors as stored (dequantized by the GGUF reader). llama.cpp's
//! converter stores Q and K rows permuted for pairwise RoPE, so RoPE here
//! rotates adjacent pairs (2j, 2j+1) of the rows as the file holds them, at
//! frequency θ^(−2j/D).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvjit::generate::{GenerateOptions, Generation, Model, Sampling};
use kvjit::gguf::writer::{GgufWriter, MetaValue};
use kvjit::gguf::{GgmlType, Gguf};
use kvjit::models::gguf::{ImportOptions, import, load_model, tokenizer, weight_notes};
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Executor, Graph, WeightLoad, compile, load_graph, read_safetensors,
    standard_registry,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LAYERS: usize = 2;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD: usize = 16;
const FFN: usize = 256;
const THETA: f64 = 10000.0;
const EPS: f64 = 1e-5;
/// Merged tokens after the 256 byte tokens: (left, right) and the result.
const MERGES: [(&str, &str); 4] = [("h", "i"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he")];
const IM_START: u32 = 256 + MERGES.len() as u32;
const IM_END: u32 = IM_START + 1;
const VOCAB: usize = IM_END as usize + 1;
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The tensor types of each layer's projections, in the order attn_q,
/// attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down (ffn_down reads
/// 256 inputs: one K-quant super-block per row).
const LAYER_TYPES: [[GgmlType; 7]; LAYERS] = [
    [GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F32, GgmlType::Q4K],
    [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q6K],
];

/// GPT-2's `bytes_to_unicode`: the printable bytes stand for themselves,
/// every other byte for U+0100 + its rank among the others.
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 0;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap()
            }
        })
        .collect()
}

/// What to vary in the tiny file.
#[derive(Clone, Copy)]
struct Variant {
    /// No `output.weight`: the LM head is the embedding.
    tied: bool,
    /// `general.architecture`.
    arch: &'static str,
    /// A metadata key left out.
    without: Option<&'static str>,
    /// RoPE frequency divisors: a `rope_freqs.weight` tensor (Llama 3.1 as
    /// llama.cpp converts it), and linear scaling by this factor.
    rope_freqs: bool,
    linear_rope: Option<f32>,
    /// Each layer's projection types ([`LAYER_TYPES`]).
    layer_types: &'static [[GgmlType; 7]; LAYERS],
    /// A SentencePiece (`llama`) vocabulary of the same size in place of
    /// the byte-level BPE one ([`SPM_PIECES`]).
    sentencepiece: bool,
}

const TIED: Variant = Variant {
    tied: true,
    arch: "llama",
    without: None,
    rope_freqs: false,
    linear_rope: None,
    layer_types: &LAYER_TYPES,
    sentencepiece: false,
};
/// The SentencePiece variant's pieces after `<unk>`, `<s>`, `</s>` and the
/// 256 byte tokens, with their scores: "hi" is "▁h" "i".
const SPM_PIECES: [(&str, f32); 3] = [("▁", -3.0), ("▁h", -1.0), ("i", -2.0)];
/// The divisors the `rope_freqs` variant stores, one per pair of the head.
const ROPE_FREQS: [f32; HEAD / 2] = [1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0];
const UNTIED: Variant = Variant { tied: false, ..TIED };

/// `n` values uniform in ±`scale`.
fn uniform(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

/// The tiny model's file (seeded: every variant has the same weights).
fn tiny_gguf(variant: Variant) -> GgufWriter {
    let mut w = GgufWriter::new();
    let mut kv = |key: &str, value: MetaValue| {
        if variant.without != Some(key) {
            w.kv(key, value);
        }
    };
    kv("general.architecture", variant.arch.into());
    kv("general.name", "tiny test model".into());
    kv("llama.context_length", 256u32.into());
    kv("llama.embedding_length", (HIDDEN as u32).into());
    kv("llama.block_count", (LAYERS as u32).into());
    kv("llama.feed_forward_length", (FFN as u32).into());
    kv("llama.attention.head_count", (HEADS as u32).into());
    kv("llama.attention.head_count_kv", (KV_HEADS as u32).into());
    if !variant.tied {
        // The tied file derives the head size from hidden / heads.
        kv("llama.attention.key_length", (HEAD as u32).into());
        kv("llama.attention.value_length", (HEAD as u32).into());
    }
    kv("llama.rope.dimension_count", (HEAD as u32).into());
    kv("llama.rope.freq_base", (THETA as f32).into());
    if let Some(factor) = variant.linear_rope {
        kv("llama.rope.scaling.type", "linear".into());
        kv("llama.rope.scaling.factor", factor.into());
    }
    kv("llama.attention.layer_norm_rms_epsilon", (EPS as f32).into());
    let bytes = byte_chars();
    let mut tokens: Vec<String> = bytes.iter().map(char::to_string).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.extend(["<|im_start|>".to_string(), "<|im_end|>".to_string()]);
    let mut types = vec![1; VOCAB];
    types[IM_START as usize] = 3;
    types[IM_END as usize] = 3;
    if variant.sentencepiece {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        tokens.extend(SPM_PIECES.iter().map(|(piece, _)| piece.to_string()));
        let types: Vec<i32> = [2, 3, 3].into_iter().chain([6; 256]).chain([1; SPM_PIECES.len()]).collect();
        let scores: Vec<f32> = [0.0; 259].into_iter().chain(SPM_PIECES.iter().map(|&(_, s)| s)).collect();
        assert_eq!(tokens.len(), VOCAB);
        kv("tokenizer.ggml.model", "llama".into());
        kv("tokenizer.ggml.tokens", MetaValue::strings(&tokens));
        kv("tokenizer.ggml.token_type", MetaValue::i32s(types));
        kv("tokenizer.ggml.scores", MetaValue::f32s(scores));
        kv("tokenizer.ggml.bos_token_id", 1u32.into());
        kv("tokenizer.ggml.eos_token_id", 2u32.into());
    } else {
        kv("tokenizer.ggml.model", "gpt2".into());
        kv("tokenizer.ggml.pre", "smollm".into());
        kv("tokenizer.ggml.tokens", MetaValue::strings(&tokens));
        kv("tokenizer.ggml.token_type", MetaValue::i32s(types));
        kv("tokenizer.ggml.merges", MetaValue::strings(MERGES.iter().map(|(a, b)| format!("{a} {b}"))));
        kv("tokenizer.ggml.bos_token_id", IM_START.into());
        kv("tokenizer.ggml.eos_token_id", IM_END.into());
        kv("tokenizer.ggml.add_bos_token", false.into());
    }
    kv("tokenizer.chat_template", CHATML.into());

    let mut rng = StdRng::seed_from_u64(23);
    let mut embedding = uniform(&mut rng, VOCAB * HIDDEN, 1.0);
    // The control tokens' rows are zero, so with the tied head their logits
    // are 0 and never the largest: greedy generation never stops early.
    embedding[IM_START as usize * HIDDEN..].fill(0.0);
    w.tensor("token_embd.weight", GgmlType::Q8_0, &[VOCAB, HIDDEN], &embedding);
    let (q_dim, kv_dim) = (HEADS * HEAD, KV_HEADS * HEAD);
    for (l, types) in variant.layer_types.iter().enumerate() {
        let norm = |rng: &mut StdRng| uniform(rng, HIDDEN, 0.3).iter().map(|v| 1.0 + v).collect::<Vec<_>>();
        let norm_type = if l == 0 { GgmlType::F32 } else { GgmlType::BF16 };
        w.tensor(&format!("blk.{l}.attn_norm.weight"), GgmlType::F32, &[HIDDEN], &norm(&mut rng));
        let shapes = [
            ("attn_q", q_dim, HIDDEN),
            ("attn_k", kv_dim, HIDDEN),
            ("attn_v", kv_dim, HIDDEN),
            ("attn_output", HIDDEN, q_dim),
            ("ffn_gate", FFN, HIDDEN),
            ("ffn_up", FFN, HIDDEN),
            ("ffn_down", HIDDEN, FFN),
        ];
        for ((name, n, k), &ty) in shapes.into_iter().zip(types) {
            // Unit-variance outputs for unit-variance inputs; Q and K a bit
            // larger so attention is not uniform.
            let gain = if name == "attn_q" || name == "attn_k" { 2.0 } else { 1.0 };
            let values = uniform(&mut rng, n * k, gain * (3.0 / k as f32).sqrt());
            w.tensor(&format!("blk.{l}.{name}.weight"), ty, &[n, k], &values);
            if name == "attn_output" {
                w.tensor(&format!("blk.{l}.ffn_norm.weight"), norm_type, &[HIDDEN], &norm(&mut rng));
            }
        }
    }
    if variant.rope_freqs {
        w.tensor("rope_freqs.weight", GgmlType::F32, &[HEAD / 2], &ROPE_FREQS);
    }
    let final_norm: Vec<f32> = uniform(&mut rng, HIDDEN, 0.3).iter().map(|v| 1.0 + v).collect();
    w.tensor("output_norm.weight", GgmlType::F32, &[HIDDEN], &final_norm);
    if !variant.tied {
        let mut head = uniform(&mut rng, VOCAB * HIDDEN, 0.5);
        head[IM_START as usize * HIDDEN..].fill(0.0);
        w.tensor("output.weight", GgmlType::F16, &[VOCAB, HIDDEN], &head);
    }
    w
}

/// A folder with the variant's file written as `tiny.gguf`.
fn written(variant: Variant) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    tiny_gguf(variant).write(&path).unwrap();
    (dir, path)
}

// ---------------------------------------------------------------- naive f64

/// `x · wᵀ` for `w` `[N, K]` row-major.
fn linear(x: &[f64], w: &[f64]) -> Vec<f64> {
    assert_eq!(w.len() % x.len(), 0);
    w.chunks_exact(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms_norm(x: &[f64], weight: &[f64]) -> Vec<f64> {
    let inverse = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * inverse * w).collect()
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

/// Rotate every head's adjacent pairs (2j, 2j+1) by position · θ^(−2j/D)
/// / `divisors[j]`.
fn rope_pairwise(x: &mut [f64], position: usize, divisors: &[f64]) {
    for head in x.chunks_exact_mut(HEAD) {
        for j in 0..HEAD / 2 {
            let angle = position as f64 * THETA.powf(-2.0 * j as f64 / HEAD as f64) / divisors[j];
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[2 * j], head[2 * j + 1]);
            head[2 * j] = a * cos - b * sin;
            head[2 * j + 1] = b * cos + a * sin;
        }
    }
}

/// The naive model over the file's tensors read back as `dtype` (the
/// rounding kvjit's weights get), with its own K/V history per layer.
struct Naive {
    weights: std::collections::HashMap<String, Vec<f64>>,
    history: Vec<Vec<(Vec<f64>, Vec<f64>)>>,
    /// The RoPE frequencies' divisors: `rope_freqs.weight` times the linear
    /// scaling factor (1 without either).
    rope_divisors: Vec<f64>,
}

impl Naive {
    fn new(path: &Path, dtype: DType) -> Self {
        let gguf = Gguf::open(path).unwrap();
        let weights = gguf
            .tensors()
            .iter()
            .map(|info| {
                let tensor = gguf.tensor(info.name(), dtype).unwrap();
                (info.name().to_string(), tensor.to_f32_vec().unwrap().into_iter().map(f64::from).collect())
            })
            .collect();
        let mut rope_divisors = vec![1.0; HEAD / 2];
        if gguf.tensor_info("rope_freqs.weight").is_some() {
            let stored = gguf.tensor("rope_freqs.weight", DType::F32).unwrap().to_f32_vec().unwrap();
            rope_divisors = stored.into_iter().map(f64::from).collect();
        }
        if gguf.get_str_opt("llama.rope.scaling.type").unwrap() == Some("linear") {
            let factor = f64::from(gguf.get_f32("llama.rope.scaling.factor").unwrap());
            rope_divisors.iter_mut().for_each(|d| *d *= factor);
        }
        Self { weights, history: vec![Vec::new(); LAYERS], rope_divisors }
    }

    fn weight(&self, name: &str) -> &[f64] {
        &self.weights[name]
    }

    /// The next token's logits.
    fn step(&mut self, token: u32) -> Vec<f64> {
        let mut x = self.weight("token_embd.weight")[token as usize * HIDDEN..][..HIDDEN].to_vec();
        for l in 0..LAYERS {
            let w = |name: &str| &self.weights[&format!("blk.{l}.{name}.weight")];
            let normed = rms_norm(&x, w("attn_norm"));
            let (mut q, mut k, v) =
                (linear(&normed, w("attn_q")), linear(&normed, w("attn_k")), linear(&normed, w("attn_v")));
            let position = self.history[l].len();
            rope_pairwise(&mut q, position, &self.rope_divisors);
            rope_pairwise(&mut k, position, &self.rope_divisors);
            self.history[l].push((k, v));
            let history = &self.history[l];
            let mut attention = vec![0.0; HEADS * HEAD];
            for h in 0..HEADS {
                let g = h / (HEADS / KV_HEADS);
                let qh = &q[h * HEAD..][..HEAD];
                let scores: Vec<f64> = history
                    .iter()
                    .map(|(key, _)| qh.iter().zip(&key[g * HEAD..][..HEAD]).map(|(a, b)| a * b).sum::<f64>())
                    .map(|s| s / (HEAD as f64).sqrt())
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (weight, (_, value)) in weights.iter().zip(history) {
                    for i in 0..HEAD {
                        attention[h * HEAD + i] += weight / total * value[g * HEAD + i];
                    }
                }
            }
            x = add(&x, &linear(&attention, w("attn_output")));
            let normed = rms_norm(&x, w("ffn_norm"));
            let (gate, up) = (linear(&normed, w("ffn_gate")), linear(&normed, w("ffn_up")));
            let activation: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            x = add(&x, &linear(&activation, w("ffn_down")));
        }
        let head = if self.weights.contains_key("output.weight") { "output.weight" } else { "token_embd.weight" };
        linear(&rms_norm(&x, self.weight("output_norm.weight")), self.weight(head))
    }
}

/// Largest |got − want| over the largest |want|.
fn normalized_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    assert!(scale > 0.1, "the logits are not trivially small ({scale})");
    got.iter().zip(want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max) / scale
}

fn argmax(row: &[f64]) -> u32 {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as u32
}

// ------------------------------------------------------------------- kvjit

fn options(dtype: DType) -> ImportOptions {
    ImportOptions { dtype, dequantize: true, context: 128, max_batch: 2, page_size: 16, cache_dtype: None }
}

/// Compile `graph` and generate `max_tokens` greedy tokens (no stop token)
/// after `prompt`, keeping the logits.
fn generate(graph: &Graph, prompt: &[u32], max_tokens: usize) -> Generation {
    let registry = standard_registry();
    let exe = compile(graph, &registry, &CompileOptions::default()).unwrap();
    let model = Model::new(graph, &registry, exe, Executor::new(DeviceContextPtr::cpu(2).unwrap())).unwrap();
    let options = GenerateOptions { max_tokens, sampling: Sampling::greedy(), stop: Vec::new(), keep_logits: true };
    model.generate(&[prompt.to_vec()], &options, &mut |_, _| {}).unwrap()
}

/// The prompt of the numeric checks, tokenized by the file's vocabulary.
fn prompt(path: &Path) -> Vec<u32> {
    let gguf = Gguf::open(path).unwrap();
    let vocab = gguf.tensor_info("token_embd.weight").unwrap().shape()[0];
    let tokenizer = tokenizer(&gguf, vocab).unwrap();
    let ids = tokenizer.encode("hi the cat, hi!", false).unwrap();
    // "hi" and "Ġthe" are merged tokens; the rest are bytes.
    let (hi, the) = (256, 259);
    let space = u32::from(b' ');
    assert_eq!(ids, [hi, the, space, 99, 97, 116, 44, space, hi, 33], "{ids:?}");
    ids
}

/// The prompt's logits and `steps` greedy decode steps from kvjit's `graph`
/// against the naive model's over the same tokens; gives the largest
/// normalized error.
fn check_against_naive(graph: &Graph, path: &Path, dtype: DType, steps: usize) -> f64 {
    let prompt = prompt(path);
    let out = generate(graph, &prompt, steps + 1);
    let generated = &out.tokens[0];
    assert_eq!(generated.len(), steps + 1);
    let mut naive = Naive::new(path, dtype);
    let mut want = Vec::new();
    for &token in &prompt {
        want = naive.step(token);
    }
    let mut worst = 0f64;
    for (i, (&token, got)) in generated.iter().zip(&out.logits[0]).enumerate() {
        worst = worst.max(normalized_error(got, &want));
        let best = argmax(&want);
        if dtype == DType::F32 {
            assert_eq!(token, best, "step {i}: kvjit picked {token}, the naive model {best}");
        } else {
            // Rounded activations may break a near tie the other way: the
            // pick must be within the tolerance of the best.
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            let gap = want[best as usize] - want[token as usize];
            assert!(
                gap <= 2.0 * tolerance(dtype) * scale,
                "{dtype} step {i}: kvjit picked {token}, {gap} below {best}"
            );
        }
        // Both go on from kvjit's pick.
        want = naive.step(token);
    }
    worst
}

/// The largest normalized logits error kvjit may have against the naive
/// model over the same weights (the file's tensors dequantized to f32, or
/// rounded once more to bf16, on both sides).
///
/// f32: the two compute in a different order only (f32 accumulation
/// against f64) over two layers of dot products of K ≤ 256 (seen: 5.0e-7
/// tied, 1.2e-6 untied), so 1e-5 leaves room without hiding a real
/// difference (a wrong RoPE pair layout or a swapped tensor is off by
/// order 1).
///
/// bf16: every activation, cached K/V and logit is rounded to 8 bits (2⁻⁹
/// relative; a logit of 17 alone moves by 0.03) and the errors add up over
/// the layers and the sharp attention of this model (seen: 5.8e-3 to
/// 1.6e-2 per step, RMS 2e-3 to 6e-3 of the largest logit), so 1/32; a
/// wrong layout is off by order 1 here too.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::BF16 => 1.0 / 32.0,
        other => panic!("no tolerance for {other}"),
    }
}

#[test]
fn the_tiny_files_tensors_cover_every_type_kvjit_reads() {
    let (_dir, path) = written(UNTIED);
    let gguf = Gguf::open(&path).unwrap();
    let types: std::collections::BTreeSet<&str> = gguf.tensors().iter().map(|t| t.ggml_type().name()).collect();
    for ty in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"] {
        assert!(types.contains(ty), "no {ty} tensor: {types:?}");
    }
}

#[test]
fn f32_logits_and_greedy_tokens_match_the_naive_model_tied_and_untied() {
    for variant in [TIED, UNTIED] {
        let (_dir, path) = written(variant);
        let registry = standard_registry();
        let graph = load_model(&path, registry.ops(), &options(DType::F32), WeightLoad::Map).unwrap();
        let error = check_against_naive(&graph, &path, DType::F32, 3);
        eprintln!("f32, tied {}: largest normalized logits error {error:.2e}", variant.tied);
        assert!(error < tolerance(DType::F32), "tied {}: {error}", variant.tied);
    }
}

/// RoPE frequency divisors — a `rope_freqs.weight` tensor, linear scaling,
/// both — are honoured: the logits match the naive model that divides each
/// frequency the same way, and differ from the plain file's.
#[test]
fn rope_frequency_factors_and_linear_scaling_match_the_naive_model() {
    let registry = standard_registry();
    let logits = |variant: Variant| {
        let (_dir, path) = written(variant);
        let graph = load_model(&path, registry.ops(), &options(DType::F32), WeightLoad::Map).unwrap();
        let error = check_against_naive(&graph, &path, DType::F32, 2);
        assert!(
            error < tolerance(DType::F32),
            "rope_freqs {}, linear {:?}: {error}",
            variant.rope_freqs,
            variant.linear_rope
        );
        generate(&graph, &prompt(&path), 1).logits[0][0].clone()
    };
    let plain = logits(TIED);
    for variant in [
        Variant { rope_freqs: true, ..TIED },
        Variant { linear_rope: Some(4.0), ..TIED },
        Variant { rope_freqs: true, linear_rope: Some(2.0), ..TIED },
    ] {
        let scaled = logits(variant);
        let moved = plain.iter().zip(&scaled).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(moved > 1e-2, "the divisors change the logits (moved {moved})");
    }
}

/// The file's block weights kept as blocks (every projection stored in a
/// format kvjit decodes, and the Q8_0 embedding): the kernels' keys name
/// the formats, and the logits stay within the block tolerance of the
/// naive model over the dequantized weights. The prompt's rows and each
/// decode step's go through the integer GEMV on the 256-bit tier, one per
/// row (longer prompts multiply the dequantized blocks in f32), its
/// activations rounded to 16-bit
/// integers per block of 32: up to half a step (max|x|/32258) per product,
/// which through two layers measured 3.6e-5 to 4.9e-5 of the largest logit
/// (8-bit activations measured 7e-3 to 9e-3); 2e-4 leaves 4× while a wrong
/// decode (a nibble order, a scale) is off by order 1.
#[test]
fn block_weights_stay_blocks_and_match_the_naive_model() {
    for variant in [TIED, UNTIED] {
        let (_dir, path) = written(variant);
        let registry = standard_registry();
        let options = ImportOptions { dequantize: false, ..options(DType::F32) };
        let graph = load_model(&path, registry.ops(), &options, WeightLoad::Map).unwrap();
        let kept: Vec<String> = graph
            .constants()
            .filter(|(_, v)| v.ty.as_tensor().is_some_and(|t| t.dtype.is_block_format()))
            .map(|(_, v)| format!("{} {}", v.name.as_deref().unwrap_or("-"), v.ty))
            .collect();
        for want in ["token_embd.weight q8_0", "blk.0.attn_output.weight q4_0", "blk.1.ffn_down.weight q6_k"] {
            assert!(kept.iter().any(|k| k.starts_with(want)), "{want} not kept: {kept:?}");
        }
        // QKV parts of different formats cannot stack as blocks: dequantized.
        assert!(!kept.iter().any(|k| k.contains("attn_qkv")), "{kept:?}");
        let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
        let keys: Vec<String> = exe.steps().iter().map(|s| s.kernel.key().to_string()).collect();
        for format in ["wq8_0", "wq4_0", "wq4_1", "wq4_k", "wq6_k"] {
            assert!(keys.iter().any(|k| k.ends_with(format)), "no kernel reads {format}: {keys:?}");
        }
        let error = check_against_naive(&graph, &path, DType::F32, 3);
        eprintln!("blocks, tied {}: largest normalized logits error {error:.2e}", variant.tied);
        assert!(error < 2e-4, "tied {}: {error}", variant.tied);
    }
}

/// A matrix stored as IQ4_NL — here the tiny file's Q4_0 `attn_output`
/// retagged (the same 18-byte blocks of 32, now read through IQ4_NL's
/// levels) — stays in its blocks: the kernel that reads it is an iq4_nl
/// one, and the logits match the naive model over the file's dequantized
/// weights (which reads the bytes as IQ4_NL).
#[test]
fn an_iq4_nl_matrix_stays_in_its_blocks_and_matches_the_naive_model() {
    let (dir, path) = written(TIED);
    let retagged = dir.path().join("iq4_nl.gguf");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&retagged, with_type_id(&bytes, "blk.0.attn_output.weight", GgmlType::Iq4Nl.id())).unwrap();
    let registry = standard_registry();
    let options = ImportOptions { dequantize: false, ..options(DType::F32) };
    let graph = load_model(&retagged, registry.ops(), &options, WeightLoad::Map).unwrap();
    let held = graph
        .constants()
        .find(|(_, v)| v.name.as_deref() == Some("blk.0.attn_output.weight"))
        .map(|(_, v)| v.ty.to_string())
        .unwrap();
    assert!(held.starts_with("iq4_nl"), "{held}");
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let iq4_kernels = exe.steps().iter().filter(|s| s.kernel.key().to_string().contains("wiq4_nl")).count();
    assert!(iq4_kernels >= 1, "{iq4_kernels} kernels read iq4_nl");
    let error = check_against_naive(&graph, &retagged, DType::F32, 3);
    eprintln!("iq4_nl kept: largest normalized logits error {error:.2e}");
    assert!(error < 2e-4, "{error}");
}

/// Layers whose Q, K and V are stored in different 32-blocks types, not
/// all exact in Q8_0 (Q4_1 among them), as llama.cpp's Q5_K_M mix stores
/// a 576-wide model's Q5_1 Q and K beside a Q8_0 V.
const MIXED_QKV_TYPES: [[GgmlType; 7]; LAYERS] = [
    [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::F32, GgmlType::Q4K],
    [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::BF16, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q6K],
];

/// A fused QKV weight whose parts are stored in Q4_1, Q8_0 and Q4_0 is held
/// as the q8_min blocks of exactly their values: the kernel that reads it is
/// a q8_min one, the load says so, and the logits match the naive model
/// over the file's dequantized weights.
#[test]
fn a_qkv_weight_of_mixed_block_types_is_held_as_q8_min_and_matches_the_naive_model() {
    let (_dir, path) = written(Variant { layer_types: &MIXED_QKV_TYPES, ..TIED });
    let registry = standard_registry();
    let options = ImportOptions { dequantize: false, ..options(DType::F32) };
    let graph = load_model(&path, registry.ops(), &options, WeightLoad::Map).unwrap();
    for l in 0..LAYERS {
        let name = format!("blk.{l}.attn_qkv.weight");
        let held = graph.constants().find(|(_, v)| v.name.as_deref() == Some(&name)).map(|(_, v)| v.ty.to_string());
        assert!(held.as_deref().is_some_and(|t| t.starts_with("q8_min")), "{name}: {held:?}");
    }
    let notes = weight_notes(&Gguf::open(&path).unwrap(), &options);
    let want = [
        "note: 1 fused QKV weights of parts in Q4_0 + Q4_1 + Q8_0 load as the q8_min blocks of the same values (1.125 bytes a weight)",
        "note: 1 fused QKV weights of parts in Q4_1 + Q8_0 load as the q8_min blocks of the same values (1.125 bytes a weight)",
    ];
    assert_eq!(notes, want);
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let kernels = exe.steps().iter().filter(|s| s.kernel.key().to_string().contains("wq8_min")).count();
    assert!(kernels >= LAYERS, "{kernels} kernels read q8_min");
    let error = check_against_naive(&graph, &path, DType::F32, 3);
    eprintln!("mixed QKV held as q8_min: largest normalized logits error {error:.2e}");
    assert!(error < 2e-4, "{error}");
}

/// What loading says of matrices the kernels do not read in their own
/// blocks: Q3_K held as q8_kmin, a Q3_K matrix with a NaN scale
/// dequantized into the dtype (with its bytes a weight); nothing for
/// matrices kept as they are (Q5_0, Q5_1, Q5_K and IQ4_NL among them), for
/// vectors, or when `--dequantize` asked for the dtype throughout.
#[test]
fn weight_notes_name_the_matrices_held_as_q8_kmin_and_those_dequantized() {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", MetaValue::from("llama"));
    let raw = |w: &mut GgufWriter, name: &str, ty: GgmlType, rows: usize| {
        let bytes = rows * 256 / ty.block_size() * ty.type_size();
        w.tensor_raw(name, ty, &[rows, 256], vec![0; bytes]);
    };
    raw(&mut w, "a", GgmlType::Q5_0, 2);
    raw(&mut w, "b", GgmlType::Q5_0, 2);
    raw(&mut w, "c", GgmlType::Iq4Nl, 2);
    raw(&mut w, "d", GgmlType::Q5_1, 2);
    raw(&mut w, "e", GgmlType::Q3K, 2);
    raw(&mut w, "g", GgmlType::Q5K, 2);
    // A Q3_K matrix whose d (its last 2 bytes) is NaN.
    w.tensor_raw("h", GgmlType::Q3K, &[1, 256], [vec![0; 108], vec![0xff; 2]].concat());
    raw(&mut w, "f", GgmlType::Q4K, 2);
    w.tensor_raw("v", GgmlType::Q5_1, &[256], vec![0; 8 * 24]);
    let gguf = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    let notes = weight_notes(&gguf, &ImportOptions::default());
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes[0].contains("1 Q3_K matrices held as the q8_kmin blocks of the same values"), "{notes:?}");
    assert!(notes[1].contains("1 Q3_K matrices dequantized to f32 at load, 4 bytes a weight"), "{notes:?}");
    let bf16 = weight_notes(&gguf, &ImportOptions { dtype: DType::BF16, ..ImportOptions::default() });
    assert!(bf16[1].contains("to bf16 at load, 2 bytes a weight;"), "{bf16:?}");
    assert!(weight_notes(&gguf, &ImportOptions { dequantize: true, ..ImportOptions::default() }).is_empty());
    let (_dir, path) = written(TIED);
    assert!(weight_notes(&Gguf::open(&path).unwrap(), &ImportOptions::default()).is_empty());
}

/// What loading says of fused QKV weights whose parts the file stores in
/// different quantized types: held as q8_kmin (K-quants), as q8_min (32
/// blocks), or dequantized (a part in a type no common format holds: a
/// Q4_0 beside K-quants); nothing for parts of one type, or with a float
/// part.
#[test]
fn weight_notes_say_how_qkv_weights_of_mixed_types_load() {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", MetaValue::from("llama"));
    let raw = |w: &mut GgufWriter, name: &str, ty: GgmlType, rows: usize| {
        let bytes = rows * 256 / ty.block_size() * ty.type_size();
        w.tensor_raw(name, ty, &[rows, 256], vec![0; bytes]);
    };
    let layers = [
        [GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K],
        [GgmlType::Q5K, GgmlType::Q4K, GgmlType::Q6K],
        [GgmlType::Q5_1, GgmlType::Q5_1, GgmlType::Q8_0],
        [GgmlType::Q4K, GgmlType::Q3K, GgmlType::Q4K],
        [GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q4K],
        [GgmlType::Q4K, GgmlType::F16, GgmlType::Q6K],
        [GgmlType::Q4K, GgmlType::Q4_0, GgmlType::Q6K],
    ];
    for (l, types) in layers.iter().enumerate() {
        for (part, &ty) in ["attn_q", "attn_k", "attn_v"].iter().zip(types) {
            raw(&mut w, &format!("blk.{l}.{part}.weight"), ty, 2);
        }
    }
    let gguf = Gguf::from_bytes("m.gguf", &w.to_bytes()).unwrap();
    let notes = weight_notes(&gguf, &ImportOptions::default());
    let mixed: Vec<&String> = notes.iter().filter(|n| n.contains("fused QKV")).collect();
    assert_eq!(
        mixed,
        [
            "note: 1 fused QKV weights of parts in Q3_K + Q4_K load as the q8_kmin blocks of the same values \
             (1.203125 bytes a weight)",
            "note: 1 fused QKV weights of parts in Q4_0 + Q4_K + Q6_K load dequantized to f32 (4 bytes a weight)",
            "note: 1 fused QKV weights of parts in Q4_K + Q5_K + Q6_K load as the q8_kmin blocks of the same values \
             (1.203125 bytes a weight)",
            "note: 1 fused QKV weights of parts in Q4_K + Q6_K load as the q8_kmin blocks of the same values \
             (1.203125 bytes a weight)",
            "note: 1 fused QKV weights of parts in Q5_1 + Q8_0 load as the q8_min blocks of the same values \
             (1.125 bytes a weight)",
        ],
        "{notes:?}"
    );
}

/// A batch of block-weight decodes gives every prompt what it gets alone:
/// up to `gemv_rows` rows the matmuls run the integer GEMV once per row,
/// each row on its own quantized activations (a row reading another's
/// would be off by order 1). Not bit for bit: attention's split of the
/// keys depends on the batch, and the GEMV's per-block rounding of the
/// activations amplifies such last-bit differences to ~1e-5 of the largest
/// logit; 2e-4 is the block tolerance of the naive-model test.
#[test]
fn a_batch_of_block_weight_decodes_matches_each_prompt_alone() {
    if !kvjit::op::gemm::gemv_per_row(kvjit::CodeTier::Avx2, DType::Q4_0, 2) {
        eprintln!("skipped: this CPU has no integer GEMV (the 256-bit tier)");
        return;
    }
    let (_dir, path) = written(UNTIED);
    let registry = standard_registry();
    let options = ImportOptions { dequantize: false, ..options(DType::F32) };
    let graph = load_model(&path, registry.ops(), &options, WeightLoad::Map).unwrap();
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let model = Model::new(&graph, &registry, exe, Executor::new(DeviceContextPtr::cpu(2).unwrap())).unwrap();
    let options = GenerateOptions { max_tokens: 4, sampling: Sampling::greedy(), stop: Vec::new(), keep_logits: true };
    let ids = prompt(&path);
    let prompts = [ids[..6].to_vec(), ids[3..].to_vec()];
    let together = model.generate(&prompts, &options, &mut |_, _| {}).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let alone = model.generate(std::slice::from_ref(p), &options, &mut |_, _| {}).unwrap();
        assert_eq!(together.tokens[i], alone.tokens[0], "prompt {i}");
        for (step, (got, want)) in together.logits[i].iter().zip(&alone.logits[0]).enumerate() {
            let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            let error = normalized_error(got, &want);
            assert!(error < 2e-4, "prompt {i} step {step}: {error:e}");
        }
    }
}

#[test]
fn bf16_logits_and_greedy_tokens_match_the_naive_model() {
    let (_dir, path) = written(TIED);
    let registry = standard_registry();
    let graph = load_model(&path, registry.ops(), &options(DType::BF16), WeightLoad::Map).unwrap();
    let error = check_against_naive(&graph, &path, DType::BF16, 3);
    eprintln!("bf16: largest normalized logits error {error:.2e}");
    assert!(error < tolerance(DType::BF16), "{error}");
}

#[test]
fn an_imported_model_json_runs_as_the_model_built_in_memory_does() {
    let (dir, path) = written(UNTIED);
    let registry = standard_registry();
    let out_dir = dir.path().join("imported");
    let (graph_path, weights) = import(&path, &out_dir, registry.ops(), &options(DType::F32)).unwrap();
    assert_eq!(graph_path, out_dir.join("model.json"));
    assert_eq!(weights, out_dir.join("tiny.gguf"));
    let from_file = load_graph(&graph_path, registry.ops()).unwrap();
    let in_memory = load_model(&path, registry.ops(), &options(DType::F32), WeightLoad::Map).unwrap();
    let prompt = prompt(&path);
    let (a, b) = (generate(&from_file, &prompt, 4), generate(&in_memory, &prompt, 4));
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.logits, b.logits, "the same graph and weights give the same bits");
}

// --------------------------------------------------------------------- CLI

fn kvjit(args: &[impl AsRef<std::ffi::OsStr>]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvjit")).args(args).output().unwrap()
}

fn succeeds(args: &[&str]) -> Output {
    let out = kvjit(args);
    assert!(
        out.status.success(),
        "kvjit {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `kvjit args` exits 1 with one line on stderr, `error: …`, which
/// contains `needle`.
fn refused(args: &[&str], needle: &str) -> String {
    let out = kvjit(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "kvjit {args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "kvjit {args:?} panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with("error: "),
        "kvjit {args:?}: one line 'error: …' on stderr, got: {stderr}"
    );
    assert!(lines[0].contains(needle), "kvjit {args:?}: '{needle}' not in: {}", lines[0]);
    lines[0].to_string()
}

fn str(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn import_then_generate_writes_tokens_and_the_logits_that_chose_them() {
    let (dir, path) = written(TIED);
    let out_dir = dir.path().join("model");
    succeeds(&["import", str(&path), "-o", str(&out_dir), "--context", "128"]);
    let logits_path = dir.path().join("out.safetensors");
    let model_json = out_dir.join("model.json");
    let args = ["generate", str(&model_json), "--prompt", "hi", "--max-tokens", "5", "--logits", str(&logits_path)];
    let out = succeeds(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("hi"), "the prompt then the text: {stdout}");
    let tensors = read_safetensors(&logits_path).unwrap();
    let tokens = tensors["tokens"].to_u32_vec().unwrap();
    let logits = &tensors["logits"];
    assert_eq!(tensors["tokens"].dtype(), DType::U32);
    assert_eq!(logits.dtype(), DType::F32);
    assert_eq!(tokens.len(), 1 + 5, "'hi' is one token, then 5 generated (no EOS: its logit is 0)");
    assert_eq!(tokens[0], 256);
    assert_eq!(logits.shape(), [5, VOCAB]);
    let rows = logits.to_f32_vec().unwrap();
    for (i, row) in rows.chunks_exact(VOCAB).enumerate() {
        let row: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
        assert_eq!(argmax(&row), tokens[1 + i], "row {i} chose generated token {i} (greedy)");
    }
    // The same run from the GGUF directly gives the same tokens.
    let direct_path = dir.path().join("direct.safetensors");
    succeeds(&["generate", str(&path), "--prompt", "hi", "--max-tokens", "5", "--logits", str(&direct_path)]);
    assert_eq!(read_safetensors(&direct_path).unwrap()["tokens"].to_u32_vec().unwrap(), tokens);
}

/// `kvjit tokenize` prints the ids `generate` feeds the model, a line
/// each with its text, from the GGUF or from an imported model.json.
#[test]
fn tokenize_shows_the_ids_generate_feeds_the_model() {
    let (dir, path) = written(TIED);
    let ids_of = |out: &Output| -> Vec<u32> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
            .collect()
    };
    let out = succeeds(&["tokenize", str(&path), "--prompt", "hi the cat, hi!"]);
    assert_eq!(ids_of(&out), prompt(&path));
    assert!(String::from_utf8_lossy(&out.stdout).lines().next().unwrap().ends_with("\"hi\""), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("10 tokens"), "{out:?}");
    // The chat template's control tokens are parsed whole, as in generate.
    let chat = ids_of(&succeeds(&["tokenize", str(&path), "--prompt", "hi", "--chat"]));
    assert_eq!(chat[0], IM_START);
    assert!(chat.contains(&IM_END));
    // From an imported model.json: its GGUF's tokenizer.
    let imported = dir.path().join("imported");
    succeeds(&["import", str(&path), "-o", str(&imported)]);
    let again = succeeds(&["tokenize", str(&imported.join("model.json")), "--prompt", "hi the cat, hi!"]);
    assert_eq!(ids_of(&again), prompt(&path));
}

/// A model with a SentencePiece vocabulary generates from its GGUF: the
/// prompt is BOS and the score-merged pieces, and the text comes back.
#[test]
fn a_sentencepiece_vocabulary_generates() {
    let (dir, path) = written(Variant { sentencepiece: true, ..TIED });
    let logits = dir.path().join("spm.safetensors");
    let out = succeeds(&["generate", str(&path), "--prompt", "hi", "--max-tokens", "3", "--logits", str(&logits)]);
    let tokens = read_safetensors(&logits).unwrap()["tokens"].to_u32_vec().unwrap();
    let (bos, spaced_h, i) = (1, 259 + 1, 259 + 2);
    assert_eq!(tokens[..3], [bos, spaced_h, i], "{tokens:?}");
    assert_eq!(tokens.len(), 3 + 3);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("hi"), "{out:?}");
}

/// `kvjit import` keeps block weights by default (`--dequantize` opts out),
/// and `kvjit inspect` shows each constant's bytes per weight.
#[test]
fn imported_block_weights_show_their_bytes_per_weight() {
    let (dir, path) = written(TIED);
    let kept = dir.path().join("kept");
    succeeds(&["import", str(&path), "-o", str(&kept), "--context", "128"]);
    let out = succeeds(&["inspect", str(&kept.join("model.json"))]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = |name: &str| stdout.lines().find(|l| l.contains(name)).unwrap_or_else(|| panic!("{name}: {stdout}"));
    // Q4_1: 20 bytes per 32 weights; Q8_0: 34 per 32; an f32 norm: 4.
    assert!(
        line("blk.0.ffn_gate.weight").contains("q4_1[")
            && line("blk.0.ffn_gate.weight").contains("0.6250 bytes/weight")
    );
    assert!(line("token_embd.weight").contains("q8_0[") && line("token_embd.weight").contains("1.0625 bytes/weight"));
    assert!(line("blk.0.attn_norm.weight").contains("4.0000 bytes/weight"));
    assert!(stdout.contains(".wq4_1 "), "a kernel key names the format: {stdout}");
    // Importing again into the same folder (here with other options)
    // finds its own link to the GGUF there and rewrites model.json; another
    // file under the GGUF's name is refused.
    succeeds(&["import", str(&path), "-o", str(&kept), "--context", "128", "--dequantize"]);
    let again = String::from_utf8_lossy(&succeeds(&["inspect", str(&kept.join("model.json"))]).stdout).into_owned();
    assert!(!again.contains("q4_1["), "the second import's options: {again}");
    // A copy with the same bytes (what import makes where it cannot link)
    // counts as the same file too.
    let copied = dir.path().join("copied");
    std::fs::create_dir(&copied).unwrap();
    std::fs::copy(&path, copied.join(path.file_name().unwrap())).unwrap();
    succeeds(&["import", str(&path), "-o", str(&copied), "--context", "128"]);
    let clash = dir.path().join("clash");
    std::fs::create_dir(&clash).unwrap();
    std::fs::write(clash.join(path.file_name().unwrap()), b"another file").unwrap();
    refused(&["import", str(&path), "-o", str(&clash)], "exists and is another file");
    let dequantized = dir.path().join("dequantized");
    succeeds(&["import", str(&path), "-o", str(&dequantized), "--context", "128", "--dequantize"]);
    let out = succeeds(&["inspect", str(&dequantized.join("model.json"))]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("q4_1[") && !stdout.contains(".wq"), "{stdout}");
}

/// A model whose block weights are packed into block panels compiles to an
/// artifact that stores them packed and runs to the same logits.
#[test]
fn block_weights_travel_in_artifacts() {
    let (dir, path) = written(UNTIED);
    let kept = dir.path().join("kept");
    succeeds(&["import", str(&path), "-o", str(&kept), "--context", "128"]);
    let model_json = kept.join("model.json");
    let artifact = kept.join("model.kvjit");
    let out = succeeds(&["compile", str(&model_json), "-o", str(&artifact)]);
    let wrote = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(wrote.contains("in kernel layout"), "{wrote}");
    let checksum = |model: &Path| {
        let out = succeeds(&["run", str(model), "--batch", "1", "--seq", "6"]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout.lines().find(|l| l.starts_with("output 'logits'")).unwrap_or_else(|| panic!("{stdout}")).to_string()
    };
    assert_eq!(checksum(&artifact), checksum(&model_json));
    // `generate` starts from the artifact too (the tokenizer from the GGUF
    // its source graph names) and chooses the same tokens from the same
    // logits.
    let logits = |model: &Path, name: &str| {
        let path = dir.path().join(name);
        succeeds(&["generate", str(model), "--prompt", "hi", "--max-tokens", "4", "--logits", str(&path)]);
        read_safetensors(&path).unwrap()
    };
    let (from_artifact, from_json) =
        (logits(&artifact, "artifact.safetensors"), logits(&model_json, "json.safetensors"));
    assert_eq!(from_artifact["tokens"].to_u32_vec().unwrap(), from_json["tokens"].to_u32_vec().unwrap());
    assert_eq!(from_artifact["logits"].to_f32_vec().unwrap(), from_json["logits"].to_f32_vec().unwrap());
    // An artifact away from its graph file has no tokenizer: one line.
    let moved = dir.path().join("elsewhere");
    std::fs::create_dir(&moved).unwrap();
    std::fs::copy(&artifact, moved.join("model.kvjit")).unwrap();
    refused(&["generate", str(&moved.join("model.kvjit")), "--prompt", "hi"], "no tokenizer");
    // Options that would rebuild the model are refused for a model.json or
    // an artifact (import fixed them), naming each, not silently ignored.
    refused(
        &["generate", str(&model_json), "--prompt", "hi", "--dtype", "bf16", "--context", "64"],
        "fixed what --dtype, --context would set",
    );
    // A fused artifact cannot run unfused: said so (it once failed as a
    // stale artifact listing every kernel key).
    refused(&["generate", str(&artifact), "--prompt", "hi", "--no-fuse"], "compiled with its nodes fused");
    refused(&["run", str(&artifact), "--no-fuse"], "compile it again with --no-fuse");
    refused(&["generate", str(&artifact), "--prompt", "hi", "--kv-cache-dtype", "bf16"], "--kv-cache-dtype");
}

#[test]
fn chat_wraps_the_prompt_in_the_template() {
    let (dir, path) = written(TIED);
    let logits_path = dir.path().join("chat.safetensors");
    succeeds(&["generate", str(&path), "--chat", "--prompt", "hi", "--max-tokens", "2", "--logits", str(&logits_path)]);
    let tokens = read_safetensors(&logits_path).unwrap()["tokens"].to_u32_vec().unwrap();
    // <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n, the control
    // tokens matched whole, then 2 generated.
    let newline = byte_chars().iter().position(|&c| c == 'Ċ').unwrap() as u32;
    let mut want = vec![IM_START];
    want.extend(b"user".map(u32::from));
    want.extend([newline, 256, IM_END, newline, IM_START]);
    want.extend(b"assistant".map(u32::from));
    want.push(newline);
    assert_eq!(tokens[..want.len()], want, "{tokens:?}");
    assert_eq!(tokens.len(), want.len() + 2);
}

/// The tiny file with the type id of `tensor` replaced by `id`.
fn with_type_id(bytes: &[u8], tensor: &str, id: u32) -> Vec<u8> {
    let mut bytes = bytes.to_vec();
    let mut entry = (tensor.len() as u64).to_le_bytes().to_vec();
    entry.extend_from_slice(tensor.as_bytes());
    let at = bytes.windows(entry.len()).position(|w| w == entry).unwrap() + entry.len();
    let dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let type_at = at + 4 + 8 * dims;
    bytes[type_at..type_at + 4].copy_from_slice(&id.to_le_bytes());
    bytes
}

#[test]
fn bad_files_and_requests_are_refused_in_one_line() {
    let (dir, path) = written(TIED);
    let bytes = std::fs::read(&path).unwrap();
    let out = dir.path().join("out");
    let bad = |name: &str, contents: &[u8]| {
        let at = dir.path().join(name);
        std::fs::write(&at, contents).unwrap();
        at
    };
    // Truncated: in the header, in the metadata, in the tensor table, in
    // the data.
    let table = bytes.windows(17).position(|w| w == b"token_embd.weight").unwrap();
    for cut in [3, 20, 200, 2000, table + 4, bytes.len() / 2, bytes.len() - 1] {
        let file = bad(&format!("cut{cut}.gguf"), &bytes[..cut]);
        refused(&["import", str(&file), "-o", str(&out)], "");
        refused(&["generate", str(&file), "--prompt", "hi"], "");
    }
    // Corrupted: the magic, and a tensor's data offset past the end.
    let mut magic = bytes.clone();
    magic[3] = b'X';
    let file = bad("magic.gguf", &magic);
    refused(&["generate", str(&file), "--prompt", "hi"], "");
    let mut offset = bytes.clone();
    let entry = table + 17 + 4 + 8 * 2 + 4;
    offset[entry..entry + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let file = bad("offset.gguf", &offset);
    refused(&["generate", str(&file), "--prompt", "hi"], "token_embd.weight");
    // An unknown tensor type id, and a known type kvjit does not read.
    let file = bad("unknown.gguf", &with_type_id(&bytes, "blk.0.attn_v.weight", 99));
    refused(&["generate", str(&file), "--prompt", "hi"], "");
    refused(&["import", str(&file), "-o", str(&out)], "");
    // I16 elements are F16's size, so the file stays well formed; kvjit
    // does not read I16 weights.
    let file = bad("i16.gguf", &with_type_id(&bytes, "blk.0.attn_q.weight", GgmlType::I16.id()));
    refused(&["generate", str(&file), "--prompt", "hi"], "GGML type I16 is not one kvjit reads");
    // A missing hyper-parameter, named.
    let file = dir.path().join("no_blocks.gguf");
    tiny_gguf(Variant { without: Some("llama.block_count"), ..TIED }).write(&file).unwrap();
    refused(&["import", str(&file), "-o", str(&out)], "llama.block_count");
    refused(&["generate", str(&file), "--prompt", "hi"], "llama.block_count");
    // A layer count past the file's layers, however large: refused naming
    // the first missing layer, before anything is built per layer (2³² − 1
    // once spun building layers).
    for count in [LAYERS as u32 + 1, 100_000, u32::MAX] {
        let mut blocks = tiny_gguf(Variant { without: Some("llama.block_count"), ..TIED });
        blocks.kv("llama.block_count", count);
        blocks.write(&file).unwrap();
        let missing = format!("the file has no layer {LAYERS} (tensor 'blk.{LAYERS}.attn_norm.weight' not found)");
        refused(&["import", str(&file), "-o", str(&out)], &missing);
        refused(&["generate", str(&file), "--prompt", "hi"], &missing);
    }
    // A RoPE base that is not a positive number, and a rotary dimension
    // other than the head's: named, at import (a NaN base once reached
    // the model.json as null).
    for base in [f32::NAN, f32::INFINITY, 0.0] {
        let mut rope = tiny_gguf(Variant { without: Some("llama.rope.freq_base"), ..TIED });
        rope.kv("llama.rope.freq_base", base);
        rope.write(&file).unwrap();
        refused(&["import", str(&file), "-o", str(&out)], "llama.rope.freq_base");
    }
    let mut partial = tiny_gguf(Variant { without: Some("llama.rope.dimension_count"), ..TIED });
    partial.kv("llama.rope.dimension_count", HEAD as u32 / 2);
    partial.write(&file).unwrap();
    refused(&["generate", str(&file), "--prompt", "hi"], "llama.rope.dimension_count");
    // A vocabulary of another size than the model's rows: refused before
    // generating (a shorter one once dropped the text of the ids past its
    // end without a word).
    let short_vocab = {
        let mut short = tiny_gguf(Variant { without: Some("tokenizer.ggml.tokens"), ..TIED });
        let tokens: Vec<String> = byte_chars().iter().map(char::to_string).collect();
        short.kv("tokenizer.ggml.tokens", MetaValue::strings(&tokens));
        short
    };
    short_vocab.write(&file).unwrap();
    refused(&["generate", str(&file), "--prompt", "hi"], &format!("holds 256 tokens, but the model scores {VOCAB}"));
    // A model.json whose RoPE table has fewer positions than the
    // sequence needs: refused before generating (it once failed part-way
    // through the stream).
    succeeds(&["import", str(&path), "-o", str(&out)]);
    let model_json = out.join("model.json");
    let mut graph: serde_json::Value = serde_json::from_slice(&std::fs::read(&model_json).unwrap()).unwrap();
    let table = graph["values"].as_array_mut().unwrap().iter_mut().find(|v| v["name"] == "freqs_cis").unwrap();
    table["shape"][0] = 4.into();
    std::fs::write(&model_json, serde_json::to_vec(&graph).unwrap()).unwrap();
    refused(
        &["generate", str(&model_json), "--prompt", "hi the cat", "--max-tokens", "8"],
        "past the 4 positions of the model's RoPE table",
    );
    // Neither a GGUF file, an artifact nor a model.json: said so.
    for (name, contents) in [("notes.txt", &b"# notes"[..]), ("blob.bin", &[0xff, 0xfe, 0x00, 0x01][..])] {
        let file = bad(name, contents);
        refused(&["generate", str(&file), "--prompt", "hi"], "not a GGUF file, a compiled artifact or a model.json");
    }
    // A --logits file that cannot be written: refused before generating
    // (so nothing is printed but the error).
    let nowhere = dir.path().join("no_such_dir").join("l.safetensors");
    refused(&["generate", str(&path), "--prompt", "hi", "--logits", str(&nowhere)], "--logits");
    // Nor anything but a regular file: a FIFO (the check once blocked on
    // it), a device, a link to nothing (once written through, the link
    // replaced) — and the link and its target are left alone.
    #[cfg(unix)]
    {
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let dangling = dir.path().join("dangling");
        let target = dir.path().join("target.safetensors");
        std::os::unix::fs::symlink(&target, &dangling).unwrap();
        for logits in [fifo.as_path(), Path::new("/dev/full"), dangling.as_path()] {
            refused(&["generate", str(&path), "--prompt", "hi", "--logits", str(logits)], "--logits");
        }
        assert!(std::fs::symlink_metadata(&dangling).unwrap().file_type().is_symlink());
        assert!(!target.exists());
    }
    // The commands that take graph files say what to do with a GGUF.
    for command in ["run", "inspect", "validate"] {
        refused(&[command, str(&path)], "is a GGUF model file, not a graph file: kvjit generate runs it");
    }
    // A GGUF file under another name is read as one (by its magic).
    let renamed = dir.path().join("model.bin");
    std::fs::copy(&path, &renamed).unwrap();
    let ran = succeeds(&["generate", str(&renamed), "--prompt", "hi", "--max-tokens", "2"]);
    assert!(String::from_utf8_lossy(&ran.stderr).contains("generated: "), "{ran:?}");
    // One token is the prefill's pick: no decode rate is made up for it.
    let one = succeeds(&["generate", str(&path), "--prompt", "hi", "--max-tokens", "1"]);
    let last = String::from_utf8_lossy(&one.stderr).lines().last().unwrap_or_default().to_string();
    assert!(last.starts_with("prompt: 1 token, ") && last.ends_with("generated: 1 token, no decode step"), "{last}");
    // Query heads that are not a multiple of the KV heads.
    let mut three_kv = tiny_gguf(Variant { without: Some("llama.attention.head_count_kv"), ..TIED });
    three_kv.kv("llama.attention.head_count_kv", 3u32);
    three_kv.write(&file).unwrap();
    refused(&["generate", str(&file), "--prompt", "hi"], "4 attention heads are not a multiple of 3 KV heads");
    // Another architecture, named.
    let file = dir.path().join("gpt2.gguf");
    tiny_gguf(Variant { arch: "gpt2", ..TIED }).write(&file).unwrap();
    refused(&["import", str(&file), "-o", str(&out)], "'gpt2'");
    refused(&["generate", str(&file), "--prompt", "hi"], "'gpt2'");
    // RoPE scaling kvjit does not read, and frequency factors that do not
    // fit the head: named.
    let mut yarn = tiny_gguf(TIED);
    yarn.kv("llama.rope.scaling.type", "yarn");
    yarn.write(&file).unwrap();
    refused(&["generate", str(&file), "--prompt", "hi"], "'yarn'");
    for (shape, values) in [(3, vec![1.0f32; 3]), (HEAD / 2, vec![0.0; HEAD / 2])] {
        let mut freqs = tiny_gguf(TIED);
        freqs.tensor("rope_freqs.weight", GgmlType::F32, &[shape], &values);
        freqs.write(&file).unwrap();
        refused(&["generate", str(&file), "--prompt", "hi"], "rope_freqs.weight");
    }
    // A prompt past the context, and nothing to generate: refused, exit 1,
    // no panic (one line: see the ignored test below).
    for (args, needle) in requests_that_cannot_run(&path) {
        let out = kvjit(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "kvjit {args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "kvjit {args:?} panicked: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
        assert!(errors.len() == 1 && errors[0].contains(needle), "kvjit {args:?}: {stderr}");
        assert_eq!(stderr.lines().last(), Some(errors[0]), "kvjit {args:?}: the error is the last line");
    }
}

/// A prompt past the context (`--context 64`, 80 prompt tokens),
/// `--max-tokens 0` and caches kvjit cannot build, with what their error
/// line names.
fn requests_that_cannot_run(path: &Path) -> Vec<(Vec<String>, &'static str)> {
    let path = str(path).to_string();
    let args = |rest: &[&str]| {
        let mut args = vec!["generate".to_string(), path.clone()];
        args.extend(rest.iter().map(|a| a.to_string()));
        args
    };
    let long = "hi ".repeat(40);
    let mut requests = vec![
        (args(&["--context", "64", "--prompt", &long, "--max-tokens", "8"]), "past the context length 64"),
        (args(&["--prompt", "hi", "--max-tokens", "0"]), "--max-tokens must be at least 1"),
        // A cache that is not whole pages, or holds no sequence: each cause
        // named, with the sizes that would do.
        (
            args(&["--context", "20", "--prompt", "hi"]),
            "--context 20 is not a whole number of 16-token cache pages (take 16 or 32)",
        ),
        (
            args(&["--context", "0", "--prompt", "hi"]),
            "--context 0 is not a whole number of 16-token cache pages (take 16)",
        ),
        (args(&["--max-batch", "0", "--prompt", "hi"]), "--max-batch must be at least 1"),
        // Negative sampling settings reach the sampler's check (not clap's
        // "unexpected argument").
        (args(&["--prompt", "hi", "--temperature", "-1"]), "--temperature must be finite and ≥ 0, got -1"),
        (args(&["--prompt", "hi", "--temperature", "1", "--top-p", "-0.5"]), "--top-p must be in (0, 1]"),
        // Dtypes the model cannot compute or cache in, named by their flag.
        (args(&["--prompt", "hi", "--dtype", "f8e4m3"]), "--dtype f8e4m3: the model computes in f32, bf16 or f16"),
        (args(&["--prompt", "hi", "--kv-cache-dtype", "q4_0"]), "--kv-cache-dtype q4_0: the KV cache holds"),
        // A page count past usize.
        (args(&["--max-batch", "18446744073709551615", "--prompt", "hi"]), "more cache pages than can be counted"),
        // A --max-tokens whose sum with the prompt would wrap usize (it
        // once passed the context check as 1 token).
        (args(&["--prompt", "hi", "--max-tokens", "18446744073709551615"]), "past the context length"),
    ];
    if cfg!(target_os = "linux") {
        // A cache larger than the machine's memory (known from
        // /proc/meminfo): refused before it is allocated (it once failed
        // after compiling, naming no cause).
        requests.push((args(&["--max-batch", "1000000000000", "--prompt", "hi"]), "more than this machine's"));
        // A --context of 10⁸ tokens: refused before the graph, whose RoPE
        // table alone has that many rows, is built (it once asked for a
        // 25.6 GB tensor first).
        requests.push((args(&["--context", "100000000", "--prompt", "hi"]), "more than this machine's"));
    }
    requests
}

#[test]
fn requests_that_cannot_run_are_refused_in_one_line() {
    let (_dir, path) = written(TIED);
    for (args, needle) in requests_that_cannot_run(&path) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, needle);
    }
}
