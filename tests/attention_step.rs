//! A whole attention step as one graph — fused QKV → reshape → paged RoPE →
//! paged flash attention → reshape, layers chained — against a naive model
//! written here in f64: it gathers each sequence's keys and values from the
//! cache into plain vectors, projects, rotates and attends with no paging,
//! flash formulation or JIT in sight. Over a prefill and several decode
//! steps, the graph's output and the K/V it leaves in the cache must match.

use std::collections::BTreeMap;

use kvjit::models::llama::{LayerConfig, LlamaConfig, attention_step_graph};
use kvjit::scenario::Scenario;
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Executor, Graph, PagedKVCacheCollection, Tensor, ValueDef, compile,
    standard_registry,
};

fn constant(graph: &Graph, name: &str) -> Vec<f64> {
    let (_, value) = graph.constants().find(|(_, v)| v.name.as_deref() == Some(name)).expect("constant exists");
    match &value.def {
        ValueDef::Constant { data, .. } => data.to_f32_vec().unwrap().into_iter().map(f64::from).collect(),
        _ => panic!("{name} is not a plain constant"),
    }
}

/// Rotate head vector `x` (length D) at `pos` the Hugging Face way:
/// pairs (j, j + D/2) by the angle whose cos/sin the table holds at 2j, 2j+1.
fn rotate(x: &mut [f64], freqs: &[f64], pos: usize) {
    let d = x.len();
    for j in 0..d / 2 {
        let (c, s) = (freqs[pos * d + 2 * j], freqs[pos * d + 2 * j + 1]);
        let (a, b) = (x[j], x[j + d / 2]);
        x[j] = a * c - b * s;
        x[j + d / 2] = b * c + a * s;
    }
}

/// A token's rotated K and its V, by (layer, sequence, position).
type TokenKv = BTreeMap<(usize, usize, usize), (Vec<f64>, Vec<f64>)>;

/// The naive model of one step: the output `[B, S, Hq·D]` and the K and V
/// of every valid token.
struct NaiveStep {
    output: Vec<f64>,
    new_kv: TokenKv,
}

fn naive_step(
    config: &LayerConfig,
    graph: &Graph,
    cache: &PagedKVCacheCollection,
    hidden: &Tensor,
    valid: &[u32],
) -> NaiveStep {
    let (batch, seq, k) = (hidden.shape()[0], hidden.shape()[1], config.hidden_size);
    let (hq, hkv, d) = (config.num_q_heads, config.num_kv_heads, config.head_size);
    let (q_dim, kv_dim) = (hq * d, hkv * d);
    let freqs = constant(graph, "freqs_cis");
    let mut x: Vec<f64> = hidden.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
    let mut new_kv = BTreeMap::new();
    for layer in 0..config.num_layers {
        let prefix = if config.num_layers == 1 { String::new() } else { format!("layers.{layer}.") };
        let w = constant(graph, &format!("{prefix}qkv_weight"));
        let mut out = vec![0.0; batch * seq * q_dim];
        for b in 0..batch {
            let start = cache.cache_lengths()[b] as usize;
            let v_len = valid[b] as usize;
            // This step's tokens: project, rotate Q and K.
            let mut queries = Vec::new();
            let mut keys: Vec<Vec<f64>> = Vec::new();
            let mut values: Vec<Vec<f64>> = Vec::new();
            // History first, gathered from the cache as it was before the step.
            for p in 0..start {
                let (page, slot) = cache.locate(b, p).unwrap();
                let read = |kv| -> Vec<f64> {
                    cache.read_slot(page as usize, kv, layer, slot).unwrap().into_iter().map(f64::from).collect()
                };
                keys.push(read(0));
                values.push(read(1));
            }
            for s in 0..v_len {
                let row = &x[(b * seq + s) * k..][..k];
                let proj: Vec<f64> =
                    (0..q_dim + 2 * kv_dim).map(|n| (0..k).map(|kk| w[n * k + kk] * row[kk]).sum()).collect();
                let pos = start + s;
                let mut q = proj[..q_dim].to_vec();
                let mut key = proj[q_dim..q_dim + kv_dim].to_vec();
                for h in 0..hq {
                    rotate(&mut q[h * d..(h + 1) * d], &freqs, pos);
                }
                for h in 0..hkv {
                    rotate(&mut key[h * d..(h + 1) * d], &freqs, pos);
                }
                let value = proj[q_dim + kv_dim..].to_vec();
                new_kv.insert((layer, b, pos), (key.clone(), value.clone()));
                queries.push(q);
                keys.push(key);
                values.push(value);
            }
            // Causal attention of each valid query over keys 0..=pos.
            let scale = 1.0 / (d as f64).sqrt();
            for (s, q) in queries.iter().enumerate() {
                let pos = start + s;
                for h in 0..hq {
                    let g = h / (hq / hkv);
                    let qh = &q[h * d..(h + 1) * d];
                    let scores: Vec<f64> =
                        (0..=pos).map(|p| scale * (0..d).map(|i| qh[i] * keys[p][g * d + i]).sum::<f64>()).collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for i in 0..d {
                        out[(b * seq + s) * q_dim + h * d + i] =
                            (0..=pos).map(|p| weights[p] * values[p][g * d + i]).sum::<f64>() / total;
                    }
                }
            }
        }
        x = out;
    }
    NaiveStep { output: x, new_kv }
}

/// Largest |got − want| over the largest |want|.
fn normalized_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max) / scale
}

fn check_steps(config: LlamaConfig, steps: usize, tolerance: f64) {
    let registry = standard_registry();
    let graph = attention_step_graph(&config, registry.ops()).unwrap();
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    let executor = Executor::new(DeviceContextPtr::cpu(2).unwrap());
    let mut scenario = Scenario::prefill_with(&graph, 3, 3, 5).unwrap();
    for step in 0..=steps {
        if step > 0 {
            scenario.next_decode_step().unwrap();
        }
        let before = scenario.caches["kv_cache"].clone();
        let valid = scenario.inputs["valid_lengths"].to_u32_vec().unwrap();
        let naive = naive_step(&config.layer, &graph, &before, &scenario.inputs["hidden_state"], &valid);
        let out = executor.run(&exe, &scenario.inputs, &mut scenario.caches).unwrap();
        let got: Vec<f64> = out.outputs["attention"].to_f32_vec().unwrap().into_iter().map(f64::from).collect();
        let error = normalized_error(&got, &naive.output);
        assert!(error <= tolerance, "{} step {step}: output error {error:e} > {tolerance:e}", config.layer.name);
        // Padded query rows are zero, exactly.
        let seq = scenario.inputs["hidden_state"].shape()[1];
        let q_dim = config.layer.q_dim();
        for (b, &v) in valid.iter().enumerate() {
            for s in v as usize..seq {
                assert!(got[(b * seq + s) * q_dim..][..q_dim].iter().all(|&x| x == 0.0), "padded row ({b}, {s})");
            }
        }
        // The cache holds this step's rotated K and its V.
        let cache = &scenario.caches["kv_cache"];
        for ((layer, b, pos), (key, value)) in &naive.new_kv {
            let (page, slot) = cache.locate(*b, *pos).unwrap();
            for (kv, want) in [(0, key), (1, value)] {
                let stored: Vec<f64> =
                    cache.read_slot(page as usize, kv, *layer, slot).unwrap().into_iter().map(f64::from).collect();
                let error = normalized_error(&stored, want);
                assert!(error <= tolerance, "step {step}: layer {layer} ({b}, {pos}) kv {kv}: error {error:e}");
            }
        }
        scenario.advance().unwrap();
    }
}

#[test]
fn a_small_f32_attention_step_matches_the_naive_model_over_decode_steps() {
    // f32 everywhere: the error is accumulation order (seen: 2.6e-7).
    check_steps(LlamaConfig::small(), 4, 2e-6);
}

#[test]
fn a_bf16_step_with_wider_head_groups_matches_within_bf16_rounding() {
    let mut config = LlamaConfig::small();
    config.layer = LayerConfig {
        name: "small_gqa4".into(),
        dtype: DType::BF16,
        hidden_size: 128,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_size: 16,
        page_size: 3,
        ..config.layer
    };
    config.rope_theta = 500000.0;
    config.llama3_scaling = Some(kvjit::Llama3Scaling::LLAMA_3_1);
    // bf16 rounds every stored activation and cache entry (2^-8 relative);
    // chained over two layers the output error stays within 2^-6 (seen: 2.5e-3).
    check_steps(config, 3, 1.0 / 64.0);
}

/// The same step over an FP8 cache (g = D = 16): the fused QKV node
/// quantizes each K/V head block, RoPE requantizes the rotated K, attention
/// reads codes × scales. The naive model reads the cache dequantized and
/// projects in f64, so the error is the quantization's: each cached element
/// within half an E4M3 step of its block's scale (at most 2⁻⁴ of the
/// block's largest magnitude), which the softmax average keeps at that
/// order in the output (seen: 1.1e-2 output, 3.1e-2 cache over two layers).
#[test]
fn an_fp8_cache_step_matches_the_naive_model_within_fp8_rounding() {
    let mut config = LlamaConfig::small();
    config.layer = LayerConfig { name: "small_fp8".into(), cache_dtype: Some(DType::F8E4M3), ..config.layer };
    let registry = standard_registry();
    let graph = attention_step_graph(&config, registry.ops()).unwrap();
    let keys = kvjit::specialize(&graph, registry.ops(), kvjit::cpu_backend(), &Default::default()).unwrap();
    let keys: Vec<String> = keys.kernel_keys().iter().map(|k| k.to_string()).collect();
    assert!(keys.iter().filter(|k| k.contains("kvf8e4m3.g16")).count() >= 3, "{keys:?}");
    check_steps(config, 3, 1.0 / 16.0);
}

#[test]
fn the_cuda_target_refuses_rope_and_attention_at_specialize_naming_the_op() {
    let registry = standard_registry();
    let graph = attention_step_graph(&LlamaConfig::small(), registry.ops()).unwrap();
    let err = kvjit::specialize(&graph, registry.ops(), kvjit::Backend::Cuda, &BTreeMap::new()).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("no cuda kernel for op mo.fused_qk_rope.padded.paged"), "{message}");
    assert!(message.contains("no CUDA variant for op mo.fused_qk_rope.padded.paged yet"), "{message}");
    // Without RoPE, attention is refused the same way.
    let mut b = kvjit::GraphBuilder::new("mha_only", registry.ops());
    let layer = &LlamaConfig::small().layer;
    let q = b.input("q", DType::F32, &["batch".into(), "seq".into(), 4.into(), 16.into()]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, &["batch".into()]).unwrap();
    let idx = b.input("layer_idx", DType::U32, &[]).unwrap();
    let cache = b.kv_cache("kv_cache", layer.cache_type()).unwrap();
    let params = kvjit::ops::MhaParams {
        dtype: DType::F32,
        mask: kvjit::ops::Mask::Causal,
        scale: None,
        local_window_size: None,
        num_kv_heads: layer.num_kv_heads,
        head_size: layer.head_size,
        page_size: layer.page_size,
    };
    let out = kvjit::ops::mha(&mut b, [q, cache, idx, valid], params).unwrap();
    b.output("out", out).unwrap();
    let graph = b.finish().unwrap();
    let message =
        kvjit::specialize(&graph, registry.ops(), kvjit::Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(message.contains("no CUDA variant for op mo.mha.padded.paged yet"), "{message}");
}

#[test]
fn binding_batch_and_seq_at_compile_gives_the_same_step_bit_for_bit() {
    // The reshapes name `batch` and `seq` in their target shape: binding
    // them must bind those too (it once left them dangling).
    let registry = standard_registry();
    let graph = attention_step_graph(&LlamaConfig::small(), registry.ops()).unwrap();
    let scenario = Scenario::prefill_with(&graph, 9, 3, 5).unwrap();
    let bound = CompileOptions {
        bindings: [("batch".to_string(), 3), ("seq".to_string(), 5)].into(),
        ..CompileOptions::default()
    };
    let executor = Executor::new(DeviceContextPtr::cpu(2).unwrap());
    let mut runs = Vec::new();
    for options in [CompileOptions::default(), bound] {
        let exe = compile(&graph, &registry, &options).unwrap();
        let mut caches = scenario.caches.clone();
        let out = executor.run(&exe, &scenario.inputs, &mut caches).unwrap();
        runs.push((out.outputs["attention"].clone(), caches["kv_cache"].blocks().clone()));
    }
    assert_eq!(runs[0].0.as_bytes(), runs[1].0.as_bytes(), "outputs differ");
    assert_eq!(runs[0].1.as_bytes(), runs[1].1.as_bytes(), "caches differ");
}
