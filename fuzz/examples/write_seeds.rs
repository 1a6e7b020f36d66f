//! Writes the committed seed corpora of the `graph_file`,
//! `safetensors_inputs`, `artifact` and `gguf` targets (the `op_call` seeds are libFuzzer's own
//! minimized finds). Run from the repository root:
//!
//! ```sh
//! cargo run --manifest-path fuzz/Cargo.toml --example write_seeds
//! cargo run --manifest-path fuzz/Cargo.toml --example write_seeds -- --replay   # run them, no libFuzzer
//! ```

use std::path::Path;

use kvjit::models::llama::{LayerConfig, qkv_layer_graph};
use kvjit::scenario::Scenario;
use kvjit::{
    DType, KvCacheParams, PagedKVCacheCollection, Tensor, graph_to_json, standard_registry, tensors_to_safetensors,
};
use kvjit_fuzz::{TINY_ATTENTION_DTYPES, TINY_DTYPES, tiny_attention_graph, tiny_graph};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
    println!("{} ({} bytes)", dir.join(name).display(), bytes.len());
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--replay") {
        replay();
        return;
    }
    let registry = standard_registry();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    write_gguf_seeds(&root);

    // graph_file: the tiny chain (random-init weights), a small layer with a
    // data constant followed by its weights file, and the two-layer example.
    let graphs = root.join("graph_file");
    let tiny = tiny_graph(&registry, DType::BF16, DType::F16);
    write(&graphs, "tiny_chain.json", graph_to_json(&tiny, None).as_bytes());
    let small = qkv_layer_graph(
        &LayerConfig {
            hidden_size: 8,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_size: 4,
            num_pages: 6,
            max_pages_per_seq: 3,
            num_layers: 1,
            ..LayerConfig::small()
        },
        registry.ops(),
    )
    .unwrap();
    write(&graphs, "one_layer.json", graph_to_json(&small, None).as_bytes());
    let mut b = kvjit::GraphBuilder::new("data_weight", registry.ops());
    let hidden = b.input("hidden_state", DType::F32, &["batch".into(), "seq".into(), 4.into()]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, &["batch".into()]).unwrap();
    let idx = b.input("layer_idx", DType::U32, &[]).unwrap();
    let cache = b
        .kv_cache(
            "kv_cache",
            kvjit::KvCacheType {
                dtype: DType::F32,
                num_layers: 1,
                page_size: 2,
                num_kv_heads: 1,
                head_size: 2,
                scale_granularity: None,
                num_pages: 6.into(),
                batch: "batch".into(),
                max_pages_per_seq: 3.into(),
            },
        )
        .unwrap();
    let weight =
        Tensor::from_f32(DType::F32, &[6, 4], &(0..24).map(|i| i as f32 / 24.0 - 0.5).collect::<Vec<_>>()).unwrap();
    let w = b.constant("qkv_weight", weight.clone()).unwrap();
    let params: kvjit::Params = [
        ("dtype", kvjit::ParamValue::from(DType::F32)),
        ("num_kv_heads", 1usize.into()),
        ("head_size", 2usize.into()),
        ("page_size", 2usize.into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let q = b.node("mo.fused_qkv_matmul.padded.paged", params, &[hidden, w, cache, idx, valid]).unwrap();
    b.output("q", q[0]).unwrap();
    let graph = b.finish().unwrap();
    let mut bytes = graph_to_json(&graph, Some("w.safetensors")).into_bytes();
    bytes.push(0);
    bytes.extend(tensors_to_safetensors([("qkv_weight", &weight)]).unwrap());
    write(&graphs, "data_weight.bin", &bytes);
    // The tiny attention steps: every op of the step, and an FP8 cache.
    for (dtype, cache_dtype) in [(DType::F32, DType::F32), (DType::BF16, DType::F8E4M3)] {
        let graph = tiny_attention_graph(&registry, dtype, cache_dtype);
        write(&graphs, &format!("{}.json", graph.name()), graph_to_json(&graph, None).as_bytes());
    }

    // artifact: the tiny chain compiled on each CPU tier (weights in that
    // tier's packed layout). An artifact records what its kernels need of
    // the CPU, not the writer's CPU: the cranelift seeds load on any
    // x86-64, the avx2 seeds on any with AVX2, FMA and F16C (AVX-512 or
    // not). The avx2 seeds need such a machine to write them.
    let artifacts = root.join("artifact");
    for old in std::fs::read_dir(&artifacts).into_iter().flatten() {
        std::fs::remove_file(old.unwrap().path()).unwrap();
    }
    std::fs::create_dir_all(&artifacts).unwrap();
    for tier in [kvjit::CpuTier::Cranelift, kvjit::CpuTier::Avx2] {
        let options = kvjit::CompileOptions {
            build: kvjit::BuildOptions { cpu_tier: tier, ..Default::default() },
            ..Default::default()
        };
        for (dtype, cache_dtype) in TINY_DTYPES {
            let graph = tiny_graph(&registry, dtype, cache_dtype);
            let path = artifacts.join(format!("tiny_{dtype}_{cache_dtype}_{tier}.kvjit"));
            kvjit::write_artifact(&graph, &registry, &options, &path, None).unwrap();
            println!("{}", path.display());
        }
        // The whole attention step on an FP8 cache (its RoPE table stored
        // as data, as every artifact constant is).
        let graph = tiny_attention_graph(&registry, DType::BF16, DType::F8E4M3);
        let path = artifacts.join(format!("{}_{tier}.kvjit", graph.name()));
        kvjit::write_artifact(&graph, &registry, &options, &path, None).unwrap();
        println!("{}", path.display());
    }

    // safetensors_inputs: a prefill step of the tiny chain per dtype pair:
    // 2 sequences padded to 3 tokens, 1 and 2 tokens of history, pages
    // handed out out of order.
    let inputs = root.join("safetensors_inputs");
    let mut rng = StdRng::seed_from_u64(5);
    for (dtype, cache_dtype) in TINY_DTYPES {
        let params = KvCacheParams {
            element: kvjit::CacheElement::new(cache_dtype, None).unwrap(),
            num_layers: 2,
            page_size: 2,
            num_kv_heads: 1,
            head_size: 2,
        };
        let mut cache = PagedKVCacheCollection::new(params, 6, 2, 3).unwrap();
        cache.set_allocation_order(vec![4, 1, 5, 0, 3, 2]).unwrap();
        cache.set_blocks(Tensor::random(cache_dtype, cache.blocks().shape(), &mut rng, -1.0, 1.0).unwrap()).unwrap();
        cache.reserve(&[1, 2]).unwrap();
        cache.advance(&[1, 2]).unwrap();
        cache.reserve(&[3, 2]).unwrap();
        let mut named: Vec<(String, Tensor)> = vec![
            ("hidden_state".into(), Tensor::random(dtype, &[2, 3, 4], &mut rng, -1.0, 1.0).unwrap()),
            ("valid_lengths".into(), Tensor::from_vec(&[2], vec![3u32, 2]).unwrap()),
            ("layer_idx".into(), Tensor::scalar_u32(0)),
            ("layers.1.layer_idx".into(), Tensor::scalar_u32(1)),
        ];
        named.extend(cache.to_tensors("kv_cache").unwrap());
        let bytes = tensors_to_safetensors(named.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
        write(&inputs, &format!("prefill_{dtype}_{cache_dtype}.safetensors"), &bytes);
    }
    // The tiny attention steps: a prefill of 2 sequences with history, and
    // a batch of no sequences (a server whose batch drained).
    for (dtype, cache_dtype) in TINY_ATTENTION_DTYPES {
        let graph = tiny_attention_graph(&registry, dtype, cache_dtype);
        let scenario = Scenario::prefill_with(&graph, 6, 2, 3).unwrap();
        let mut named: Vec<(String, Tensor)> = scenario.inputs.clone().into_iter().collect();
        named.extend(scenario.caches["kv_cache"].to_tensors("kv_cache").unwrap());
        let bytes = tensors_to_safetensors(named.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
        write(&inputs, &format!("attention_prefill_{dtype}_{cache_dtype}.safetensors"), &bytes);

        let params = graph.kv_caches().next().unwrap().1.ty.as_kv_cache().unwrap().params();
        let empty_cache = PagedKVCacheCollection::new(params, 12, 0, 4).unwrap();
        let mut named: Vec<(String, Tensor)> = scenario
            .inputs
            .iter()
            .map(|(name, t)| {
                let mut shape = t.shape().to_vec();
                if let Some(batch) = shape.first_mut() {
                    *batch = 0;
                }
                (name.clone(), Tensor::zeros(t.dtype(), &shape).unwrap())
            })
            .collect();
        named.extend(empty_cache.to_tensors("kv_cache").unwrap());
        let bytes = tensors_to_safetensors(named.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
        write(&inputs, &format!("attention_no_sequences_{dtype}_{cache_dtype}.safetensors"), &bytes);
    }
}

/// gguf: a tiny Llama-like file (metadata of the kinds a model carries, a
/// tensor of every type kvjit reads), a file of a type it does not read,
/// and a version-2 file with a non-default alignment.
fn write_gguf_seeds(root: &Path) {
    use kvjit_gguf::GgmlType;
    use kvjit_gguf::writer::{GgufWriter, MetaValue};
    let dir = root.join("gguf");
    // Multiples of 1/64 in [-1, 1): exact in every type, and the same on
    // every host (a libm `sin` is not, and a one-ulp change moved a quant).
    let values = |n: usize, seed: f32| -> Vec<f32> {
        (0..n).map(|i| ((i * 37 + seed as usize * 11) % 128) as f32 / 64.0 - 1.0).collect()
    };
    let mut w = GgufWriter::new();
    w.kv("general.architecture", "llama")
        .kv("llama.block_count", 1u32)
        .kv("llama.embedding_length", 32u32)
        .kv("llama.attention.head_count", 2u32)
        .kv("llama.rope.freq_base", 10000.0f32)
        .kv("tokenizer.ggml.model", "gpt2")
        .kv("tokenizer.ggml.tokens", MetaValue::strings(["a", "b", "ab", "<0x0A>"]))
        .kv("tokenizer.ggml.token_type", MetaValue::i32s([1, 1, 1, 6]))
        .kv("tokenizer.ggml.merges", MetaValue::strings(["a b"]))
        .kv("tokenizer.ggml.bos_token_id", 0u32)
        .tensor("token_embd.weight", GgmlType::Q8_0, &[4, 32], &values(128, 0.0))
        .tensor("blk.0.attn_norm.weight", GgmlType::F32, &[32], &values(32, 1.0))
        .tensor("blk.0.attn_q.weight", GgmlType::Q4_0, &[2, 32], &values(64, 2.0))
        .tensor("blk.0.attn_k.weight", GgmlType::Q4_1, &[2, 32], &values(64, 3.0))
        .tensor("blk.0.ffn_up.weight", GgmlType::Q4K, &[1, 256], &values(256, 4.0))
        .tensor("blk.0.ffn_down.weight", GgmlType::Q6K, &[1, 256], &values(256, 5.0))
        .tensor("blk.0.f16", GgmlType::F16, &[2, 3], &values(6, 6.0))
        .tensor("blk.0.bf16", GgmlType::BF16, &[3, 2], &values(6, 7.0));
    write(&dir, "tiny_llama.gguf", &w.to_bytes());
    let mut w = GgufWriter::new();
    w.kv("general.architecture", "gpt2").tensor_raw("q5", GgmlType::Q5K, &[256], vec![0x55; 176]);
    write(&dir, "unsupported_type.gguf", &w.to_bytes());
    let mut w = GgufWriter::new();
    w.version = 2;
    w.alignment = 8;
    w.kv("flag", true).kv("big", MetaValue::U64(1 << 40)).tensor("x", GgmlType::F32, &[3], &[1.0, -0.0, f32::NAN]);
    write(&dir, "v2_align8.gguf", &w.to_bytes());
}

/// Run every committed seed through its target's harness (no libFuzzer).
fn replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, harness) in [
        ("graph_file", kvjit_fuzz::graph_file as fn(&[u8])),
        ("safetensors_inputs", kvjit_fuzz::safetensors_inputs),
        ("artifact", kvjit_fuzz::artifact_file),
        ("gguf", kvjit_fuzz::gguf_file),
    ] {
        for entry in std::fs::read_dir(root.join(target)).unwrap() {
            let path = entry.unwrap().path();
            println!("{}", path.display());
            harness(&std::fs::read(&path).unwrap());
        }
    }
}
