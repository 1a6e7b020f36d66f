//! The op in a graph: parameters and shape rules checked when the node is
//! added, the kernel key the specialize step gives, CUDA refused at
//! specialize with a clear reason, CPU head sizes (and FP8 scale
//! granularities) the JIT cannot serve refused likewise, and kernels built
//! through `KernelBuilder`.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvjit_core::{Backend, CodeTier, DType, KernelSpec, Target};
use kvjit_graph::{Dim, GraphBuilder, KvCacheType, OpDef, OpRegistry, ValueId, specialize};
use kvjit_op::Defined;
use kvjit_op_rope::{OP_NAME, RopeOp, RopeParams, RopeSpec, fused_qk_rope};
use kvjit_runtime::{BuildOptions, KernelBuilder, KernelImpl};

/// The plain CPU tier (RoPE's code does not depend on the tier).
const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);

fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(RopeOp))).unwrap();
    registry
}

fn cache_type(dtype: DType, head_size: usize) -> KvCacheType {
    KvCacheType {
        dtype,
        num_layers: 2,
        page_size: 16,
        num_kv_heads: 8,
        head_size,
        scale_granularity: None,
        num_pages: Dim::Static(64),
        batch: Dim::from("batch"),
        max_pages_per_seq: Dim::Static(8),
    }
}

fn params(head_size: usize) -> RopeParams {
    RopeParams { dtype: DType::BF16, interleaved: true, num_kv_heads: 8, head_size, page_size: 16 }
}

/// Inputs q `[batch, seq, hq, d]`, cache, freqs `[4096, d]`, layer, valid.
fn inputs(b: &mut GraphBuilder<'_>, hq: usize, d: usize, cache_dtype: DType) -> [ValueId; 5] {
    inputs_with_cache(b, hq, d, cache_type(cache_dtype, d))
}

/// [`inputs`] with the cache of type `cache`.
fn inputs_with_cache(b: &mut GraphBuilder<'_>, hq: usize, d: usize, cache: KvCacheType) -> [ValueId; 5] {
    [
        b.input("q_proj", DType::BF16, &[Dim::from("batch"), Dim::from("seq"), Dim::Static(hq), Dim::Static(d)])
            .unwrap(),
        b.kv_cache("kv_cache", cache).unwrap(),
        b.input("freqs_cis", DType::BF16, &[Dim::Static(4096), Dim::Static(d)]).unwrap(),
        b.input("layer_idx", DType::U32, &[]).unwrap(),
        b.input("valid_lengths", DType::U32, &[Dim::from("batch")]).unwrap(),
    ]
}

#[test]
fn a_node_infers_its_output_and_specializes_to_its_key() {
    let registry = registry();
    let mut b = GraphBuilder::new("rope", &registry);
    let args = inputs(&mut b, 32, 128, DType::F32);
    let out = fused_qk_rope(&mut b, args, params(128)).unwrap();
    b.output("q_rotated", out).unwrap();
    let graph = b.finish().unwrap();
    let bindings = BTreeMap::from([("seq".to_string(), 1)]);
    let specialized = specialize(&graph, &registry, CPU, &bindings).unwrap();
    let key = &specialized.kernel_keys()[0];
    assert_eq!(key.to_string(), "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l2.kvf32.il1.bany.s1");
    let spec = key.spec::<RopeSpec>().unwrap();
    for implementation in [KernelImpl::Fast, KernelImpl::Reference] {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        let kernel = Defined(RopeOp).build(key, &[None, None, None, None], &options).unwrap();
        assert_eq!(kernel.key(), key);
        assert_eq!(kernel.implementation(), if implementation == KernelImpl::Fast { "jit" } else { "reference" });
    }
    assert_eq!(spec.step.seq, Some(1));
    assert_eq!(spec.step.batch, None);
}

#[test]
fn an_fp8_cache_keys_its_granularity_and_builds_both_kernels() {
    let registry = registry();
    let mut b = GraphBuilder::new("rope", &registry);
    let cache = KvCacheType { scale_granularity: Some(32), ..cache_type(DType::F8E4M3, 128) };
    let args = inputs_with_cache(&mut b, 32, 128, cache);
    let out = fused_qk_rope(&mut b, args, params(128)).unwrap();
    b.output("q_rotated", out).unwrap();
    let graph = b.finish().unwrap();
    let specialized = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    let key = &specialized.kernel_keys()[0];
    assert_eq!(key.to_string(), "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l2.kvf8e4m3.g32.il1.bany.sany");
    assert_eq!(key.spec::<RopeSpec>().unwrap().cache.scale_granularity(), Some(32));
    for implementation in [KernelImpl::Fast, KernelImpl::Reference] {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        Defined(RopeOp).build(key, &[None, None, None, None], &options).unwrap();
    }
}

#[test]
fn fp8_granularities_the_jit_cannot_serve_are_refused_at_specialize() {
    let registry = registry();
    let mut b = GraphBuilder::new("rope", &registry);
    let cache = KvCacheType { scale_granularity: Some(6), ..cache_type(DType::F8E4M3, 24) };
    let args = inputs_with_cache(&mut b, 8, 24, cache);
    let out = fused_qk_rope(&mut b, args, params(24)).unwrap();
    b.output("q_rotated", out).unwrap();
    let graph = b.finish().unwrap();
    let err = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("scale_granularity to be a multiple of 4"), "{err}");
}

#[test]
fn cuda_is_refused_at_specialize_with_a_reason() {
    let registry = registry();
    let mut b = GraphBuilder::new("rope", &registry);
    let args = inputs(&mut b, 8, 64, DType::BF16);
    let out = fused_qk_rope(&mut b, args, params(64)).unwrap();
    b.output("q_rotated", out).unwrap();
    let graph = b.finish().unwrap();
    let err = specialize(&graph, &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op mo.fused_qk_rope.padded.paged yet"), "{err}");
    let specialized = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    let spec = specialized.kernel_keys()[0].spec::<RopeSpec>().copied().unwrap();
    let key = RopeSpec { target: Target::Cuda, ..spec }.key();
    assert!(Defined(RopeOp).build(&key, &[], &BuildOptions::default()).is_err());
}

#[test]
fn head_sizes_the_jit_cannot_serve_are_refused_at_specialize() {
    let registry = registry();
    let mut b = GraphBuilder::new("rope", &registry);
    let args = inputs(&mut b, 8, 12, DType::BF16);
    let out = fused_qk_rope(&mut b, args, params(12)).unwrap();
    b.output("q_rotated", out).unwrap();
    let graph = b.finish().unwrap();
    let err = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("multiple of 8"), "{err}");
}

#[test]
fn bad_nodes_are_refused_when_added() {
    let registry = registry();
    let node_error = |hq: usize, d: usize, p: RopeParams, edit: &dyn Fn(&mut kvjit_graph::Params)| {
        let mut b = GraphBuilder::new("rope", &registry);
        let args = inputs(&mut b, hq, d, DType::BF16);
        let mut params = p.to_params();
        edit(&mut params);
        b.node(OP_NAME, params, &args).unwrap_err()
    };
    // Hq = 12 is not a multiple of Hkv = 8.
    let err = node_error(12, 64, params(64), &|_| {});
    assert!(err.to_string().contains("q_proj"), "{err}");
    // head_size param differs from the tensors' D.
    let err = node_error(8, 64, params(128), &|_| {}).to_string();
    assert!(err.contains("q_proj") || err.contains("kv_collection"), "{err}");
    // An odd head size.
    let err = node_error(8, 63, params(63), &|_| {}).to_string();
    assert!(err.contains("head_size") && err.contains("even"), "{err}");
    // interleaved is required.
    let err = node_error(8, 64, params(64), &|p| {
        p.remove("interleaved");
    })
    .to_string();
    assert!(err.contains("interleaved") && err.contains("missing"), "{err}");
    // A u32 dtype.
    let err = node_error(8, 64, params(64), &|p| {
        p.insert("dtype".into(), "u32".into());
    })
    .to_string();
    assert!(err.contains("dtype"), "{err}");
}

#[test]
fn the_definition_names_its_signature() {
    assert_eq!(Defined(RopeOp).name(), "mo.fused_qk_rope.padded.paged");
    let names: Vec<&str> = Defined(RopeOp).inputs().iter().map(|a| a.name).collect();
    assert_eq!(names, ["q_proj", "kv_collection", "freqs_cis", "layer_idx", "valid_lengths"]);
    let params: Vec<&str> = Defined(RopeOp).params().iter().map(|p| p.name).collect();
    assert_eq!(params, ["dtype", "interleaved", "num_kv_heads", "head_size", "page_size"]);
    assert_eq!(Defined(RopeOp).outputs(), ["output"]);
}
