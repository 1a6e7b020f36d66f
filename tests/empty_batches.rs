//! A batch of no sequences (B = 0: a server whose batch drained) and a step
//! of no tokens (S = 0) are no-ops for every op, every CPU tier and every
//! kernel flavour: the run succeeds, every output is empty and no byte of any
//! cache changes. Checked on whole graphs through the executor, so a kernel
//! that divides by the batch or the token count anywhere on its path fails.

use std::collections::BTreeMap;

use kvjit::models::llama::{LayerConfig, LlamaConfig, attention_step_graph, qkv_layer_graph};
use kvjit::scenario::Scenario;
use kvjit::{
    BuildOptions, CompileOptions, CpuTier, DType, Dim, Graph, KernelImpl, PagedKVCacheCollection, Tensor, compile,
    standard_registry,
};
use kvjit_testkit::{Caches, Tensors, assert_caches_identical};

mod common;

fn graphs() -> Vec<Graph> {
    let ops = standard_registry();
    let mut bf16 = LlamaConfig::small();
    bf16.layer.dtype = DType::BF16;
    vec![
        qkv_layer_graph(&LayerConfig::small(), ops.ops()).unwrap(),
        attention_step_graph(&LlamaConfig::small(), ops.ops()).unwrap(),
        attention_step_graph(&bf16, ops.ops()).unwrap(),
    ]
}

/// Every way a CPU kernel of these graphs can be built.
fn build_options() -> Vec<(String, CompileOptions)> {
    let mut all = Vec::new();
    let tiers = if kvjit::widest_cpu_tier() == kvjit::CodeTier::Avx2 {
        vec![CpuTier::Cranelift, CpuTier::Avx2]
    } else {
        vec![CpuTier::Cranelift]
    };
    for tier in tiers {
        for specialize_shapes in [false, true] {
            let build = BuildOptions { cpu_tier: tier, specialize_shapes, ..Default::default() };
            all.push((
                format!("{tier:?} jit, specialize_shapes {specialize_shapes}"),
                CompileOptions { build, ..Default::default() },
            ));
        }
    }
    let reference = BuildOptions { implementation: KernelImpl::Reference, ..Default::default() };
    all.push(("reference".into(), CompileOptions { build: reference, ..Default::default() }));
    all
}

/// Inputs of `batch` sequences of `seq` tokens, none of them valid (random
/// hidden states: only their shape says there is nothing to do).
fn empty_inputs(graph: &Graph, batch: usize, seq: usize) -> Tensors {
    let mut inputs = BTreeMap::new();
    for (_, value) in graph.inputs() {
        let ty = value.ty.as_tensor().expect("inputs are tensors");
        let shape: Vec<usize> = ty
            .shape
            .iter()
            .map(|dim| match dim {
                Dim::Static(v) => *v,
                Dim::Symbolic(s) if s == "batch" => batch,
                Dim::Symbolic(s) if s == "seq" => seq,
                Dim::Symbolic(s) => panic!("unexpected symbol {s}"),
            })
            .collect();
        let name = value.name.clone().unwrap();
        let numel = shape.iter().product::<usize>();
        let tensor = if ty.dtype == DType::U32 {
            Tensor::from_vec(&shape, vec![0u32; numel]).unwrap()
        } else {
            let values: Vec<f32> = (0..numel).map(|i| 1.0 + i as f32 * 0.25).collect();
            Tensor::from_f32(ty.dtype, &shape, &values).unwrap()
        };
        inputs.insert(name, tensor);
    }
    inputs
}

/// Caches of no sequences, with the pages the graph declares.
fn caches_of_no_sequences(graph: &Graph) -> Caches {
    graph
        .kv_caches()
        .map(|(_, value)| {
            let ty = value.ty.as_kv_cache().unwrap();
            let size = |dim: &Dim| match dim {
                Dim::Static(v) => *v,
                Dim::Symbolic(_) => 0,
            };
            let cache =
                PagedKVCacheCollection::new(ty.params(), size(&ty.num_pages), 0, size(&ty.max_pages_per_seq)).unwrap();
            (value.name.clone().unwrap(), cache)
        })
        .collect()
}

fn run_and_check_nothing_changed(
    what: &str,
    graph: &Graph,
    options: &CompileOptions,
    inputs: &Tensors,
    caches: &Caches,
) {
    let registry = standard_registry();
    let exe = compile(graph, &registry, options).unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    let mut after = caches.clone();
    let out = common::executor().run(&exe, inputs, &mut after).unwrap_or_else(|e| panic!("{what}: run: {e}"));
    assert!(!out.outputs.is_empty(), "{what}: the graph has outputs");
    for (name, tensor) in &out.outputs {
        assert_eq!(tensor.shape().iter().product::<usize>(), 0, "{what}: output {name} {:?}", tensor.shape());
    }
    assert_caches_identical(&after, caches);
}

#[test]
fn a_batch_of_no_sequences_is_a_no_op() {
    for graph in graphs() {
        let caches = caches_of_no_sequences(&graph);
        for seq in [1, 3] {
            let inputs = empty_inputs(&graph, 0, seq);
            for (how, options) in build_options() {
                let what = format!("{} B=0 S={seq} {how}", graph.name());
                run_and_check_nothing_changed(&what, &graph, &options, &inputs, &caches);
            }
        }
    }
}

#[test]
fn a_step_of_no_tokens_is_a_no_op() {
    for graph in graphs() {
        // Two sequences with history in the cache, and a step of no tokens.
        let caches = Scenario::prefill_with(&graph, 7, 2, 3).unwrap().caches;
        assert!(caches.values().all(|c| c.cache_lengths().iter().any(|&l| l > 0)), "the caches hold history");
        let inputs = empty_inputs(&graph, 2, 0);
        for (how, options) in build_options() {
            let what = format!("{} B=2 S=0 {how}", graph.name());
            run_and_check_nothing_changed(&what, &graph, &options, &inputs, &caches);
        }
    }
}

/// The reproduction: `kvjit run examples/small_attention.json
/// --inputs FILE` with a batch of no sequences (it exited 101 on the
/// attention kernel's division by zero).
#[test]
fn the_cli_runs_a_batch_of_no_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let graph_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/small_attention.json");
    let graph = kvjit::load_graph(&graph_path, standard_registry().ops()).unwrap();
    let mut tensors: Vec<(String, Tensor)> = empty_inputs(&graph, 0, 1).into_iter().collect();
    let caches = caches_of_no_sequences(&graph);
    tensors.extend(caches["kv_cache"].to_tensors("kv_cache").unwrap());
    let inputs = dir.path().join("inputs.safetensors");
    kvjit::write_safetensors(&inputs, tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    for kernel in ["jit", "reference"] {
        let output = dir.path().join(format!("out-{kernel}.safetensors"));
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_kvjit"))
            .args(["run", graph_path.to_str().unwrap(), "--inputs", inputs.to_str().unwrap()])
            .args(["--output", output.to_str().unwrap(), "--steps", "0", "--kernel", kernel])
            .output()
            .unwrap();
        assert!(run.status.success(), "{kernel}: {}", String::from_utf8_lossy(&run.stderr));
        let written = kvjit::read_safetensors(&output).unwrap();
        assert_eq!(written["attention"].shape(), &[0, 1, 64], "{kernel}");
        for (name, tensor) in caches["kv_cache"].to_tensors("kv_cache").unwrap() {
            assert_eq!(written[name.as_str()].as_bytes(), tensor.as_bytes(), "{kernel}: {name}");
        }
    }
}
