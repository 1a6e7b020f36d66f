//! `mo.reshape` end to end: a zero-copy view between two nodes, graph files
//! with a dims parameter, and element counts refused when the node is added.

use std::collections::BTreeMap;

use kvjit::ops::{FusedQkvParams, fused_qkv_matmul, reshape};
use kvjit::{
    CacheElement, CompileOptions, DType, DeviceContextPtr, Dim, Executor, Graph, GraphBuilder, GraphError,
    KvCacheParams, KvCacheType, PagedKVCacheCollection, RandomInit, Tensor, compile, graph_from_json, graph_to_json,
    standard_registry,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

const K: usize = 64;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 16;

/// hidden [batch, seq, 64] → fused QKV → q [batch, seq, 64] → reshape
/// [batch, seq, 4, 16]; both q and the view are outputs.
fn attention_input_graph(registry: &kvjit::Registry) -> Graph {
    let mut b = GraphBuilder::new("reshape_q", registry.ops());
    let (batch, seq) = (Dim::from("batch"), Dim::from("seq"));
    let x = b.input("hidden_state", DType::F32, &[batch.clone(), seq.clone(), K.into()]).unwrap();
    let init = RandomInit { seed: 3, low: -0.5, high: 0.5 };
    let w = b.random_constant("w", DType::F32, &[HQ * D + 2 * HKV * D, K], init).unwrap();
    let cache = KvCacheType {
        dtype: DType::F32,
        num_layers: 1,
        page_size: 4,
        num_kv_heads: HKV,
        head_size: D,
        scale_granularity: None,
        num_pages: 16.into(),
        batch: batch.clone(),
        max_pages_per_seq: 4.into(),
    };
    let kv = b.kv_cache("kv_cache", cache).unwrap();
    let layer = b.input("layer_idx", DType::U32, &[]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch)).unwrap();
    let params = FusedQkvParams { dtype: DType::F32, num_kv_heads: HKV, head_size: D, page_size: 4 };
    let q = fused_qkv_matmul(&mut b, [x, w, kv, layer, valid], params).unwrap();
    let heads = reshape(&mut b, q, &[batch, seq, HQ.into(), D.into()]).unwrap();
    b.output("q", q).unwrap();
    b.output("q_heads", heads).unwrap();
    b.finish().unwrap()
}

#[test]
fn a_reshape_between_nodes_is_a_view_of_the_producers_output() {
    let registry = standard_registry();
    let graph = attention_input_graph(&registry);
    let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
    assert_eq!(exe.steps()[1].kernel.implementation(), "view");
    assert_eq!(exe.steps()[1].kernel.key().to_string(), "reshape.cpu.f32.o0in0.o1in1.o2x4.o3x16");

    let mut rng = StdRng::seed_from_u64(9);
    let params =
        KvCacheParams { element: CacheElement::F32, num_layers: 1, page_size: 4, num_kv_heads: HKV, head_size: D };
    let mut cache = PagedKVCacheCollection::new(params, 16, 2, 4).unwrap();
    cache.reserve(&[3, 2]).unwrap();
    let inputs = BTreeMap::from([
        ("hidden_state".to_string(), Tensor::random(DType::F32, &[2, 3, K], &mut rng, -1.0, 1.0).unwrap()),
        ("layer_idx".to_string(), Tensor::scalar_u32(0)),
        ("valid_lengths".to_string(), Tensor::from_vec(&[2], vec![3u32, 2]).unwrap()),
    ]);
    // The caller keeps its cache where it is; no map to move it into.
    let executor = Executor::new(DeviceContextPtr::cpu(2).unwrap());
    let out = executor.run_with_caches(&exe, &inputs, &mut [("kv_cache", &mut cache)]).unwrap();
    let (q, heads) = (&out.outputs["q"], &out.outputs["q_heads"]);
    assert_eq!(heads.shape(), [2, 3, HQ, D]);
    assert_eq!(heads.as_bytes(), q.as_bytes());
    assert!(heads.shares_storage_with(q), "the view copied the producer's output");
    assert!(q.to_f32_vec().unwrap().iter().any(|&v| v != 0.0));

    // Naming a cache twice, or one the graph does not take, is refused.
    let mut other = cache.clone();
    let err = executor.run_with_caches(&exe, &inputs, &mut [("kv_cache", &mut cache), ("kv_cache", &mut other)]);
    assert_eq!(err.unwrap_err().to_string(), "KV cache 'kv_cache' is given twice");
}

#[test]
fn a_reshape_round_trips_through_a_graph_file() {
    let registry = standard_registry();
    let graph = attention_input_graph(&registry);
    let text = graph_to_json(&graph, None);
    assert!(text.contains(r#""shape": ["#), "{text}");
    let loaded = graph_from_json(&text, registry.ops(), None).unwrap();
    assert_eq!(graph_to_json(&loaded, None), text);
}

#[test]
fn a_reshape_that_changes_the_element_count_is_refused_when_the_node_is_added() {
    let registry = standard_registry();
    let mut b = GraphBuilder::new("bad", registry.ops());
    let x = b.input("x", DType::F32, &["batch".into(), 64.into()]).unwrap();
    for (shape, why) in [
        (
            vec![Dim::from("batch"), 8.into(), 9.into()],
            "fixed dims hold 64 elements per symbol binding, the output's 72",
        ),
        (vec![Dim::from("seq"), 64.into()], "output dim 'seq' is not a dim of the input"),
        (vec![Dim::from(64)], "input dim 'batch' does not appear in the output"),
    ] {
        let err = reshape(&mut b, x, &shape).unwrap_err();
        assert!(matches!(&err, GraphError::InNode { .. }), "{err:?}");
        assert!(err.to_string().contains(why), "{shape:?}: {err}");
    }
    let zero = reshape(&mut b, x, &[Dim::from("batch"), 0.into(), 64.into()]).unwrap_err();
    assert!(zero.to_string().contains("parameter 'shape' must be a list of dims"), "{zero}");
}
