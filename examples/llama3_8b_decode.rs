//! Build one Llama-3-8B layer's fused QKV projection with the builder API,
//! save it as a graph file, load it back, and run a prefill and a few decode
//! steps that grow its paged KV cache.
//!
//! ```text
//! cargo run --release --example llama3_8b_decode [OUT_DIR]
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvjit::ops::{FusedQkvParams, fused_qkv_matmul};
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Dim, Executor, GraphBuilder, KvCacheType, PagedKVCacheCollection,
    RandomInit, Tensor, compile, load_graph, save_graph, standard_registry,
};
use rand::SeedableRng;

fn main() -> kvjit::Result<()> {
    let (hidden, q_heads, kv_heads, head, page) = (4096, 32, 8, 128, 16);
    let n = (q_heads + 2 * kv_heads) * head;
    let registry = standard_registry();

    // 1. Build: batch and seq stay symbolic; everything else is fixed.
    let mut b = GraphBuilder::new("llama3_8b_layer", registry.ops());
    let x = b.input("hidden_state", DType::F32, &["batch".into(), "seq".into(), hidden.into()])?;
    let valid = b.input("valid_lengths", DType::U32, &["batch".into()])?;
    let layer = b.input("layer_idx", DType::U32, &[])?;
    let bound = 1.0 / (hidden as f32).sqrt();
    let w =
        b.random_constant("qkv_weight", DType::F32, &[n, hidden], RandomInit { seed: 8, low: -bound, high: bound })?;
    let cache_type = KvCacheType {
        dtype: DType::F32,
        num_layers: 1,
        page_size: page,
        num_kv_heads: kv_heads,
        head_size: head,
        scale_granularity: None,
        num_pages: Dim::from(64),
        batch: "batch".into(),
        max_pages_per_seq: Dim::from(16),
    };
    let kv = b.kv_cache("kv_cache", cache_type.clone())?;
    let params = FusedQkvParams { dtype: DType::F32, num_kv_heads: kv_heads, head_size: head, page_size: page };
    let q = fused_qkv_matmul(&mut b, [x, w, kv, layer, valid], params)?;
    b.output("q", q)?;
    let graph = b.finish()?;

    // 2. Save and load back: the loaded graph passes the same validator.
    let dir = std::env::args().nth(1).map_or_else(std::env::temp_dir, PathBuf::from);
    let path = dir.join("llama3_8b_layer.json");
    save_graph(&graph, &path)?;
    let graph = load_graph(&path, registry.ops())?;
    println!("saved and reloaded {}", path.display());

    // 3. Compile for the CPU and make a cache for 3 sequences.
    let exe = compile(&graph, &registry, &CompileOptions::default())?;
    println!("kernel: {}", exe.steps()[0].kernel.key());
    let executor = Executor::new(DeviceContextPtr::cpu(0)?);
    let mut cache = PagedKVCacheCollection::new(cache_type.params(), 64, 3, 16)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);

    // 4. Prefill prompts of 5, 3 and 7 tokens (padded to 7), then decode.
    let mut prompt = vec![5u32, 3, 7];
    for step in 0..4 {
        let seq = *prompt.iter().max().unwrap() as usize;
        cache.reserve(&prompt)?;
        let inputs = BTreeMap::from([
            ("hidden_state".to_string(), Tensor::random(DType::F32, &[3, seq, hidden], &mut rng, -1.0, 1.0)?),
            ("valid_lengths".to_string(), Tensor::from_vec(&[3], prompt.clone())?),
            ("layer_idx".to_string(), Tensor::scalar_u32(0)),
        ]);
        // The cache stays in this function's variable: the run borrows it.
        let out = executor.run_with_caches(&exe, &inputs, &mut [("kv_cache", &mut cache)])?;
        cache.advance(&prompt)?;
        println!(
            "step {step}: q {:?} in {:.1} ms, cache lengths now {:?}",
            out.outputs["q"].shape(),
            out.timings[0].elapsed.as_secs_f64() * 1e3,
            cache.cache_lengths()
        );
        prompt = vec![1; 3];
    }

    // 5. Read back the newest token of sequence 2.
    let last = cache.cache_lengths()[2] as usize - 1;
    let (k, v) = cache.read_token(0, 2, last)?;
    println!("sequence 2, position {last}: k[0..4] = {:?}, v[0..4] = {:?}", &k[..4], &v[..4]);
    Ok(())
}
