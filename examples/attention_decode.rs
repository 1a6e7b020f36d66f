//! One Llama-3-8B attention step written with the builder API — fused QKV
//! (K and V into the paged cache) → reshape to heads → paged RoPE (Q out, K
//! rotated in the cache) → paged causal flash attention → reshape back —
//! compiled once, then run as a prefill and a few decode steps over a paged
//! cache that grows by one token per sequence each step.
//!
//! ```text
//! cargo run --release --example attention_decode
//! ```

use std::collections::BTreeMap;

use kvjit::ops::{FusedQkvParams, Mask, MhaParams, RopeParams, fused_qk_rope, fused_qkv_matmul, mha, reshape};
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Dim, Executor, GraphBuilder, KvCacheType, Llama3Scaling,
    PagedKVCacheCollection, RandomInit, RopeInit, Tensor, compile, standard_registry,
};
use rand::{Rng, SeedableRng};

fn main() -> kvjit::Result<()> {
    let (hidden, q_heads, kv_heads, head, page) = (4096, 32, 8, 128, 16);
    let (pages_per_seq, batch) = (64, 4);
    let dtype = DType::BF16;
    let registry = standard_registry();

    // Build: batch and seq symbolic, everything else fixed.
    let mut b = GraphBuilder::new("llama3_8b_attention", registry.ops());
    let (bs, ss) = (Dim::from("batch"), Dim::from("seq"));
    let x = b.input("hidden_state", dtype, &[bs.clone(), ss.clone(), hidden.into()])?;
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&bs))?;
    let layer = b.input("layer_idx", DType::U32, &[])?;
    let cache = b.kv_cache(
        "kv_cache",
        KvCacheType {
            dtype,
            num_layers: 1,
            page_size: page,
            num_kv_heads: kv_heads,
            head_size: head,
            scale_granularity: None,
            num_pages: (batch * pages_per_seq).into(),
            batch: bs.clone(),
            max_pages_per_seq: pages_per_seq.into(),
        },
    )?;
    let bound = 1.0 / (hidden as f32).sqrt();
    let n = (q_heads + 2 * kv_heads) * head;
    let w = b.random_constant("qkv_weight", dtype, &[n, hidden], RandomInit { seed: 8, low: -bound, high: bound })?;
    let rope = RopeInit { llama3_scaling: Some(Llama3Scaling::LLAMA_3_1), ..RopeInit::plain(500000.0) };
    let freqs = b.recipe_constant("freqs_cis", dtype, &[pages_per_seq * page, head], rope.into())?;

    let q = fused_qkv_matmul(
        &mut b,
        [x, w, cache, layer, valid],
        FusedQkvParams { dtype, num_kv_heads: kv_heads, head_size: head, page_size: page },
    )?;
    let q = reshape(&mut b, q, &[bs.clone(), ss.clone(), q_heads.into(), head.into()])?;
    let rope_params =
        RopeParams { dtype, interleaved: false, num_kv_heads: kv_heads, head_size: head, page_size: page };
    let q = fused_qk_rope(&mut b, [q, cache, freqs, layer, valid], rope_params)?;
    let mha_params = MhaParams {
        dtype,
        mask: Mask::Causal,
        scale: None,
        local_window_size: None,
        num_kv_heads: kv_heads,
        head_size: head,
        page_size: page,
    };
    let attention = mha(&mut b, [q, cache, layer, valid], mha_params)?;
    let out = reshape(&mut b, attention, &[bs, ss, (q_heads * head).into()])?;
    b.output("attention", out)?;
    let graph = b.finish()?;

    // Compile once: every node's kernel is machine code for its key.
    let exe = compile(&graph, &registry, &CompileOptions::default())?;
    for step in exe.steps() {
        println!("{:<4} {} [{}]", step.label, step.kernel.key(), step.kernel.implementation());
    }

    // A cache whose sequences start empty; pages are reserved per step.
    let params = graph.kv_caches().next().and_then(|(_, v)| v.ty.as_kv_cache()).expect("one cache").params();
    let mut caches = BTreeMap::from([(
        "kv_cache".to_string(),
        PagedKVCacheCollection::new(params, batch * pages_per_seq, batch, pages_per_seq)?,
    )]);
    let executor = Executor::new(DeviceContextPtr::cpu(0)?);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let prompt: Vec<u32> = (0..batch).map(|_| rng.gen_range(16..=64)).collect();
    for step in 0..6 {
        // Step 0 is the prompt (padded to its longest); then one token each.
        let valid_lengths = if step == 0 { prompt.clone() } else { vec![1; batch] };
        let seq = *valid_lengths.iter().max().expect("batch > 0") as usize;
        let hidden_state = Tensor::random(dtype, &[batch, seq, hidden], &mut rng, -1.0, 1.0)?;
        caches.get_mut("kv_cache").expect("cache").reserve(&valid_lengths)?;
        let inputs = BTreeMap::from([
            ("hidden_state".to_string(), hidden_state),
            ("valid_lengths".to_string(), Tensor::from_vec(&[batch], valid_lengths.clone())?),
            ("layer_idx".to_string(), Tensor::scalar_u32(0)),
        ]);
        let started = std::time::Instant::now();
        let run = executor.run(&exe, &inputs, &mut caches)?;
        let elapsed = started.elapsed();
        let cache = caches.get_mut("kv_cache").expect("cache");
        let before = cache.cache_lengths().to_vec();
        cache.advance(&valid_lengths)?;
        let checksum: f64 = run.outputs["attention"].to_f32_vec()?.iter().map(|&v| v as f64).sum();
        println!(
            "step {step}: {} tokens over context {before:?} in {:.2} ms, attention checksum {checksum:.4}",
            valid_lengths.iter().sum::<u32>(),
            elapsed.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
