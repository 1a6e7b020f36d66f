//! What the op platform guarantees every op: parameters checked against the
//! op's declared kinds and ranges when a node is added, keys no kernel can
//! serve refused at specialize, op errors carried with their type.

use std::collections::BTreeMap;

use kvjit::ops::{FusedQkvParams, fused_qkv_matmul};
use kvjit::{
    DType, Dim, GraphBuilder, GraphError, KvCacheType, ParamValue, Params, RandomInit, specialize, standard_registry,
};

/// A fused QKV graph with hidden size `k`.
fn fused_graph(k: usize) -> kvjit::Graph {
    let registry = standard_registry();
    let mut b = GraphBuilder::new("g", registry.ops());
    let x = b.input("x", DType::BF16, &["batch".into(), "seq".into(), k.into()]).unwrap();
    let w = b.random_constant("w", DType::BF16, &[32, k], RandomInit { seed: 1, low: -1.0, high: 1.0 }).unwrap();
    let cache = KvCacheType {
        dtype: DType::BF16,
        num_layers: 1,
        page_size: 4,
        num_kv_heads: 1,
        head_size: 8,
        scale_granularity: None,
        num_pages: 8.into(),
        batch: "batch".into(),
        max_pages_per_seq: 2.into(),
    };
    let kv = b.kv_cache("kv", cache).unwrap();
    let layer = b.input("layer", DType::U32, &[]).unwrap();
    let valid = b.input("valid", DType::U32, &[Dim::from("batch")]).unwrap();
    let params = FusedQkvParams { dtype: DType::BF16, num_kv_heads: 1, head_size: 8, page_size: 4 };
    let q = fused_qkv_matmul(&mut b, [x, w, kv, layer, valid], params).unwrap();
    b.output("q", q).unwrap();
    b.finish().unwrap()
}

/// `kvjit inspect --target cuda` must never show a key that cannot be
/// built: the CUDA kernels need K % 8 == 0, so K = 30 is refused when the
/// graph is specialized, naming op, key and reason; the CPU serves it.
#[test]
fn a_key_no_kernel_serves_is_refused_at_specialize_with_op_key_and_reason() {
    let registry = standard_registry();
    let graph = fused_graph(30);
    assert!(specialize(&graph, registry.ops(), kvjit::cpu_backend(), &BTreeMap::new()).is_ok());
    let err = specialize(&graph, registry.ops(), kvjit::Backend::Cuda, &BTreeMap::new()).unwrap_err();
    let GraphError::InNode { source, .. } = &err else { panic!("{err:?}") };
    assert!(matches!(**source, GraphError::Unsupported(_)), "{err:?}");
    let message = err.to_string();
    for part in [
        "no cuda kernel for op generic_fused_qkv_matmul_kv_cache_bshd_paged",
        "fused_qkv_bshd_paged.cuda.bf16.k30",
        "need K % 8 == 0, got K = 30",
    ] {
        assert!(message.contains(part), "{message}");
    }
    assert!(specialize(&fused_graph(32), registry.ops(), kvjit::Backend::Cuda, &BTreeMap::new()).is_ok());
}

/// Parameters are checked against the op's declared kinds and ranges before
/// its shape rules run: unknown names, missing ones, and values of the wrong
/// kind (a bool, a float, a list of dims where a size is due).
#[test]
fn parameters_of_the_wrong_kind_are_refused_naming_the_parameter() {
    let registry = standard_registry();
    let good = FusedQkvParams { dtype: DType::F32, num_kv_heads: 1, head_size: 8, page_size: 4 }.to_params();
    let with = |name: &str, value: ParamValue| {
        let mut params: Params = good.clone();
        params.insert(name.into(), value);
        params
    };
    let cases = [
        (with("page_size", ParamValue::Bool(true)), "parameter 'page_size' must be an integer in 1..=4294967295"),
        (with("head_size", ParamValue::Float(8.5)), "parameter 'head_size' must be an integer"),
        (with("num_kv_heads", ParamValue::Dims(vec![1.into()])), "parameter 'num_kv_heads' must be an integer"),
        (with("dtype", ParamValue::Float(1.0)), "parameter 'dtype' must be a dtype name"),
        (with("scale", ParamValue::Float(0.5)), "parameter 'scale' is not a parameter of this op"),
    ];
    for (params, expected) in cases {
        let mut b = GraphBuilder::new("g", registry.ops());
        let x = b.input("x", DType::F32, &[1.into(), 1.into(), 8.into()]).unwrap();
        let err = b.node("mo.fused_qkv_matmul.padded.paged", params, &[x, x, x, x, x]).unwrap_err();
        assert!(err.to_string().contains(expected), "{err}");
    }
}

/// Bools, floats and dims round-trip through graph-file JSON as themselves.
#[test]
fn param_values_of_every_kind_round_trip_through_json() {
    for value in [
        ParamValue::Bool(true),
        ParamValue::Int(16),
        ParamValue::Float(0.125),
        ParamValue::Float(-1.0),
        ParamValue::Float(1.0),
        ParamValue::Str("bf16".into()),
        ParamValue::Dims(vec!["batch".into(), 32.into()]),
    ] {
        let text = serde_json::to_string(&value).unwrap();
        let back: ParamValue = serde_json::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
    }
}
