//! Helpers shared by the integration tests: the registry and the graphs the
//! tests run, and a reference interpreter for graphs of fused-QKV nodes (the
//! "expected" side of every numeric check). The byte-level comparisons of
//! outputs and caches, and the `Tensors` / `Caches` maps, are the test kit's
//! (`kvjit_testkit::snapshot`).
//!
//! Numeric checks here are bit-exact on purpose: the CPU kernel and the
//! reference accumulate in the same order today, and a graph file round trip
//! must not change a single bit of a weight.

// Each test binary includes this module and uses a different subset of it.
#![allow(dead_code)]

use std::collections::HashMap;

use kvjit::demo::LayerConfig;
use kvjit::fused_qkv::OP_NAME;
use kvjit::fused_qkv::reference::fused_qkv_matmul;
use kvjit::{
    CompileOptions, DType, DeviceContextPtr, Dim, Executable, Executor, Graph, GraphBuilder, KvCacheType, ParamValue,
    Params, Registry, RunOutput, Tensor, ValueId, compile,
};
use kvjit_graph::ValueDef;
use kvjit_testkit::{Caches, Tensors};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// A CPU executor with two workers.
pub fn executor() -> Executor {
    Executor::new(DeviceContextPtr::cpu(2).expect("a CPU context starts"))
}

/// The small two-layer example graph (random-init weights).
pub fn small_graph(registry: &Registry) -> Graph {
    kvjit::demo::layer_graph(&LayerConfig::small(), registry.ops()).expect("small graph builds")
}

/// Compile for the CPU with no bindings.
pub fn compile_cpu(graph: &Graph, registry: &Registry) -> Executable {
    compile(graph, registry, &reference_options()).expect("graph compiles for the CPU")
}

/// CPU compile options with reference kernels: these tests pin graph and
/// executor semantics bit for bit against direct reference calls (the JIT
/// kernels are tested against the reference, with tolerances, in the op crate).
pub fn reference_options() -> CompileOptions {
    CompileOptions {
        build: kvjit::BuildOptions { implementation: kvjit::KernelImpl::Reference, ..Default::default() },
        ..CompileOptions::default()
    }
}

/// Run once, panicking with the error's message on failure.
pub fn run_ok(exe: &Executable, inputs: &Tensors, caches: &mut Caches) -> RunOutput {
    executor().run(exe, inputs, caches).unwrap_or_else(|e| panic!("run failed: {e}"))
}

/// The fused-QKV parameters of a layer config.
pub fn qkv_params(config: &LayerConfig) -> Params {
    [
        ("dtype", ParamValue::from(config.dtype)),
        ("num_kv_heads", config.num_kv_heads.into()),
        ("head_size", config.head_size.into()),
        ("page_size", config.page_size.into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The cache type of a layer config, with `batch` symbolic.
pub fn cache_type(config: &LayerConfig) -> KvCacheType {
    KvCacheType {
        dtype: config.dtype,
        num_layers: config.num_layers,
        page_size: config.page_size,
        num_kv_heads: config.num_kv_heads,
        head_size: config.head_size,
        num_pages: Dim::from(config.num_pages),
        batch: Dim::from("batch"),
        max_pages_per_seq: Dim::from(config.max_pages_per_seq),
    }
}

/// A two-node chain over the small config in `dtype`, built with data
/// constants ([`GraphBuilder::constant`]): layer 1 reads layer 0's Q output
/// as its hidden state (the small config has q_dim == hidden size), so node
/// order matters; layer 1's `layer_idx` is a u32 constant. Saving it writes
/// a safetensors weights file.
pub fn chain_graph(registry: &Registry, dtype: DType) -> Graph {
    chain_graph_with(registry, dtype, false)
}

/// [`chain_graph`], with layer 1's `layer_idx` a graph input named
/// `layers.1.layer_idx` instead of a constant when `layer1_idx_input` is set
/// (the demo scenario cannot fill that input; add it by hand).
pub fn chain_graph_with(registry: &Registry, dtype: DType, layer1_idx_input: bool) -> Graph {
    let config = LayerConfig { name: "small_chain".into(), dtype, ..LayerConfig::small() };
    assert_eq!(config.q_dim(), config.hidden_size, "the chain needs q_dim == K");
    let mut rng = StdRng::seed_from_u64(99);
    let mut b = GraphBuilder::new(&config.name, registry.ops());
    let hidden =
        b.input("hidden_state", dtype, &[Dim::from("batch"), Dim::from("seq"), Dim::from(config.hidden_size)]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, &[Dim::from("batch")]).unwrap();
    let cache = b.kv_cache("kv_cache", cache_type(&config)).unwrap();
    let layer0 = b.input("layer_idx", DType::U32, &[]).unwrap();
    let w0 = Tensor::random(dtype, &[config.n(), config.hidden_size], &mut rng, -0.2, 0.2).unwrap();
    let w0 = b.constant("layers.0.qkv_weight", w0).unwrap();
    let q0 = b.node(OP_NAME, qkv_params(&config), &[hidden, w0, cache, layer0, valid]).unwrap();
    let w1 = Tensor::random(dtype, &[config.n(), config.hidden_size], &mut rng, -0.2, 0.2).unwrap();
    let w1 = b.constant("layers.1.qkv_weight", w1).unwrap();
    let layer1 = if layer1_idx_input {
        b.input("layers.1.layer_idx", DType::U32, &[]).unwrap()
    } else {
        b.constant("layers.1.layer_idx", Tensor::scalar_u32(1)).unwrap()
    };
    let q1 = b.node(OP_NAME, qkv_params(&config), &[q0[0], w1, cache, layer1, valid]).unwrap();
    b.output("layers.0.q", q0[0]).unwrap();
    b.output("layers.1.q", q1[0]).unwrap();
    b.finish().expect("chain graph validates")
}

/// The data of a constant by name.
pub fn constant_data(graph: &Graph, name: &str) -> Tensor {
    let (_, value) = graph
        .constants()
        .find(|(_, v)| v.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("graph has no constant '{name}'"));
    match &value.def {
        ValueDef::Constant { data, .. } => (**data).clone(),
        _ => unreachable!("constants() yields constants"),
    }
}

/// Run a graph of fused-QKV nodes with the plain reference implementation,
/// node by node in graph order, writing `caches` in place: the expected side
/// of every numeric check.
pub fn reference_run(graph: &Graph, inputs: &Tensors, caches: &mut Caches) -> Tensors {
    let mut produced: HashMap<ValueId, Tensor> = HashMap::new();
    let tensor = |id: ValueId, produced: &HashMap<ValueId, Tensor>| -> Tensor {
        let value = graph.value(id);
        match &value.def {
            ValueDef::Input => {
                let name = value.name.as_deref().expect("inputs are named");
                inputs.get(name).unwrap_or_else(|| panic!("no input '{name}'")).clone()
            }
            ValueDef::Constant { data, .. } => (**data).clone(),
            ValueDef::NodeOutput { .. } => produced[&id].clone(),
            ValueDef::KvCache => panic!("{id} is a cache, not a tensor"),
        }
    };
    for node in graph.nodes() {
        assert_eq!(node.op, OP_NAME, "the reference interpreter runs fused-QKV nodes only");
        let [hidden, weight, cache, layer_idx, valid] = node.inputs[..] else {
            panic!("node {} has {} inputs", node.id, node.inputs.len());
        };
        let hidden = tensor(hidden, &produced);
        let weight = tensor(weight, &produced);
        let layer_idx = tensor(layer_idx, &produced);
        let valid = tensor(valid, &produced);
        let cache_name = graph.value(cache).name.clone().expect("caches are named");
        let cache = caches.get_mut(&cache_name).unwrap_or_else(|| panic!("no cache '{cache_name}'"));
        let q_dim = weight.shape()[0] - 2 * cache.params().kv_dim();
        let mut output = Tensor::zeros(hidden.dtype(), &[hidden.shape()[0], hidden.shape()[1], q_dim]).unwrap();
        fused_qkv_matmul(&hidden, &weight, cache, &layer_idx, &valid, &mut output)
            .unwrap_or_else(|e| panic!("reference rejected node {}: {e}", node.id));
        produced.insert(node.outputs[0], output);
    }
    graph.outputs().iter().map(|o| (o.name.clone(), tensor(o.value, &produced))).collect()
}
