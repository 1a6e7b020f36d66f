//! Helpers shared by the integration tests: the registry and the graphs the
//! tests run, and a reference interpreter for graphs of any registered ops
//! (the "expected" side of every numeric check). The byte-level comparisons of
//! outputs and caches, and the `Tensors` / `Caches` maps, are the test kit's
//! (`kvjit_testkit::snapshot`).
//!
//! Numeric checks here are bit-exact on purpose: the CPU kernel and the
//! reference accumulate in the same order today, and a graph file round trip
//! must not change a single bit of a weight.

// Each test binary includes this module and uses a different subset of it.
#![allow(dead_code, reason = "each test binary uses a different part of these helpers")]

use std::collections::{BTreeMap, HashMap};

use kvjit::fused_qkv::OP_NAME;
use kvjit::models::llama::LayerConfig;
use kvjit::{
    BuildOptions, CompileOptions, DType, DeviceContextPtr, Dim, Executable, Executor, Graph, GraphBuilder, KernelImpl,
    PagedKVCacheCollection, Registry, RunOutput, Tensor, ValueId, compile, specialize,
};
use kvjit_graph::{ArgKind, ValueDef};
use kvjit_testkit::{Caches, Tensors};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// A CPU executor with two workers.
pub fn executor() -> Executor {
    Executor::new(DeviceContextPtr::cpu(2).expect("a CPU context starts"))
}

/// The small two-layer example graph (random-init weights).
pub fn small_graph(registry: &Registry) -> Graph {
    kvjit::models::llama::qkv_layer_graph(&LayerConfig::small(), registry.ops()).expect("small graph builds")
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
    let cache = b.kv_cache("kv_cache", config.cache_type()).unwrap();
    let layer0 = b.input("layer_idx", DType::U32, &[]).unwrap();
    let w0 = Tensor::random(dtype, &[config.n(), config.hidden_size], &mut rng, -0.2, 0.2).unwrap();
    let w0 = b.constant("layers.0.qkv_weight", w0).unwrap();
    let q0 = b.node(OP_NAME, config.qkv_params().to_params(), &[hidden, w0, cache, layer0, valid]).unwrap();
    let w1 = Tensor::random(dtype, &[config.n(), config.hidden_size], &mut rng, -0.2, 0.2).unwrap();
    let w1 = b.constant("layers.1.qkv_weight", w1).unwrap();
    let layer1 = if layer1_idx_input {
        b.input("layers.1.layer_idx", DType::U32, &[]).unwrap()
    } else {
        b.constant("layers.1.layer_idx", Tensor::scalar_u32(1)).unwrap()
    };
    let q1 = b.node(OP_NAME, config.qkv_params().to_params(), &[q0[0], w1, cache, layer1, valid]).unwrap();
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

/// Run a graph of any registered ops with their plain reference
/// implementations, node by node in graph order (views made by reshaping),
/// writing `caches` in place: the expected side of every numeric check. The
/// ops' signatures say which inputs are tensors and which are caches.
pub fn reference_run(graph: &Graph, inputs: &Tensors, caches: &mut Caches) -> Tensors {
    let registry = kvjit::standard_registry();
    let specialized =
        specialize(graph, registry.ops(), kvjit::cpu_backend(), &BTreeMap::new()).expect("the graph specializes");
    let options = BuildOptions { implementation: KernelImpl::Reference, ..BuildOptions::default() };
    let ctx = DeviceContextPtr::cpu(1).expect("a CPU context starts");
    let mut produced: HashMap<ValueId, Tensor> = HashMap::new();
    let tensor = |id: ValueId, produced: &HashMap<ValueId, Tensor>| -> Tensor {
        let value = graph.value(id);
        match &value.def {
            ValueDef::Input => {
                let name = value.name.as_deref().expect("inputs are named");
                inputs.get(name).unwrap_or_else(|| panic!("no input '{name}'")).clone()
            }
            ValueDef::Constant { data, .. } => (**data).clone(),
            ValueDef::Prepared { .. } => panic!("{id} is in a kernel's layout; the reference cannot read it"),
            ValueDef::NodeOutput { .. } => produced[&id].clone(),
            ValueDef::KvCache => panic!("{id} is a cache, not a tensor"),
        }
    };
    for (node, key) in graph.nodes().iter().zip(specialized.kernel_keys()) {
        let op = registry.ops().get(&node.op).expect("a registered op");
        let kernel = registry.kernel_builder(op.name()).unwrap().build(key, &[], &options).expect("a reference kernel");
        let mut args = Vec::new();
        let mut cache_names = Vec::new();
        for (spec, &value) in op.inputs().iter().zip(&node.inputs) {
            match spec.kind {
                ArgKind::Tensor => args.push(tensor(value, &produced)),
                ArgKind::KvCache => cache_names.push(graph.value(value).name.clone().expect("caches are named")),
            }
        }
        let mut node_caches: Vec<PagedKVCacheCollection> =
            cache_names.iter().map(|name| caches.remove(name).unwrap_or_else(|| panic!("no cache '{name}'"))).collect();
        let arg_refs: Vec<&Tensor> = args.iter().collect();
        let specs = kernel
            .check(&arg_refs, &node_caches.iter().collect::<Vec<_>>())
            .unwrap_or_else(|e| panic!("reference rejected node {}: {e}", node.id));
        let outputs = if kernel.is_view() {
            vec![args[0].reshaped(&specs[0].1).expect("a checked view")]
        } else {
            let mut outputs: Vec<Tensor> = specs.iter().map(|(d, s)| Tensor::zeros(*d, s).unwrap()).collect();
            let mut cache_refs: Vec<&mut PagedKVCacheCollection> = node_caches.iter_mut().collect();
            kernel
                .run(&arg_refs, &mut cache_refs, &mut outputs, &ctx)
                .unwrap_or_else(|e| panic!("reference rejected node {}: {e}", node.id));
            outputs
        };
        for (name, cache) in cache_names.into_iter().zip(node_caches) {
            caches.insert(name, cache);
        }
        for (&value, output) in node.outputs.iter().zip(outputs) {
            produced.insert(value, output);
        }
    }
    graph.outputs().iter().map(|o| (o.name.clone(), tensor(o.value, &produced))).collect()
}
