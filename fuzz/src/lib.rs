//! What the `graph_file`, `safetensors_inputs` and `gguf` fuzz targets do with their
//! bytes, and the tiny graphs they run (the `op_call` target lives in its own
//! file: it runs the test kit's differential checker,
//! `kvjit_testkit::fused_qkv::differential`, which the property tests share).
//!
//! Properties asserted (a violation panics, which libFuzzer reports as a crash):
//!
//! - no input makes a loader, the compile step, the demo scenario or the
//!   executor panic: every failure is a typed error whose message formats;
//! - a graph that loads saves to JSON that loads again and saves to the same
//!   text (`graph_to_json` ∘ `graph_from_json` is a fixed point);
//! - tensors that parse serialize and parse back to the same tensors, and a
//!   cache that assembles from them round-trips through `to_tensors`;
//! - a run the executor refuses leaves every cache byte-identical, with the
//!   JIT kernels and with the reference kernels, and both refuse with the same
//!   message; a run both accept gives close outputs and caches.
//!
//! Memory: the graph-file target loads with a recipe budget of
//! [`RECIPE_BUDGET`] bytes (the loader sizes every `init` recipe before it
//! generates anything and refuses past the budget), and runs a loaded graph
//! only when its compiled buffers fit [`RUN_BUDGET`] bytes.

use std::cell::RefCell;
use std::collections::BTreeMap;

use kvjit::models::llama::{LayerConfig, LlamaConfig, attention_step_graph};
use kvjit::scenario::Scenario;
use kvjit::{
    BuildOptions, CompileOptions, DType, DeviceContextPtr, Dim, Executable, Executor, Graph, GraphBuilder, KernelImpl,
    KvCacheType, PagedKVCacheCollection, ParamValue, Params, RandomInit, Registry, Tensor, ValueDef, compile,
    graph_from_json, graph_from_json_within, graph_to_json, standard_registry, tensors_from_safetensors,
    tensors_to_safetensors,
};
use kvjit_testkit::values::max_abs_finite;
use kvjit_testkit::{CacheSnapshot, Tolerance, caches_identical, compare};

/// Bytes the `init` recipes of one graph file may generate (the loader
/// refuses the recipe that would pass it before generating anything).
pub const RECIPE_BUDGET: u64 = 4 << 20;
/// Largest graph (bytes of constants, outputs and caches, as
/// `MemoryEstimate` counts them) the graph-file target runs.
pub const RUN_BUDGET: u64 = 8 << 20;

pub use kvjit_testkit::Caches;

thread_local! {
    static REGISTRY: Registry = standard_registry();
    static EXECUTOR: Executor = Executor::new(DeviceContextPtr::cpu(2).expect("a CPU pool"));
    static TINY: RefCell<Vec<Tiny>> = const { RefCell::new(Vec::new()) };
}

fn options(implementation: KernelImpl, bindings: BTreeMap<String, usize>, budget: u64) -> CompileOptions {
    CompileOptions {
        bindings,
        build: BuildOptions { implementation, ..BuildOptions::default() },
        memory_budget: Some(budget),
        ..CompileOptions::default()
    }
}

// ---------------------------------------------------------------------------
// Running a graph with both kernel implementations
// ---------------------------------------------------------------------------

/// What one run left: its outputs (or error message) and the caches, and
/// whether its inputs were [`moderate`].
struct Ran {
    result: Result<BTreeMap<String, Tensor>, String>,
    caches: Caches,
    moderate: bool,
}

/// Run on clones of `caches`; a refused run must leave them byte-identical.
fn run(exe: &Executable, inputs: &BTreeMap<String, Tensor>, caches: &Caches, what: &str) -> Ran {
    let mut after = caches.clone();
    let result = EXECUTOR.with(|e| e.run(exe, inputs, &mut after)).map(|o| o.outputs).map_err(|e| e.to_string());
    if let Err(message) = &result {
        assert!(caches_identical(&after, caches), "{what}: a refused run ({message}) changed a cache");
    }
    Ran { result, caches: after, moderate: moderate(inputs, caches) }
}

/// `got` close to `want` where `want` is finite and moderate: within 2% of
/// the tensor's largest magnitude (the executor-level check; the op-level
/// target compares element by element with exact tolerances).
fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()), "{what}: dtype and shape");
    let (Ok(g), Ok(w)) = (got.to_f32_vec(), want.to_f32_vec()) else { return };
    if w.iter().any(|v| !v.is_finite() || v.abs() > 1e6) {
        return;
    }
    let tolerance = Tolerance::AbsRel { abs: 0.02 * (1.0 + max_abs_finite(want)), rel: 0.0 };
    let widen = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    compare(tolerance, &widen(g), &widen(w)).assert_ok(what);
}

/// What a cache holds: its blocks, or for an FP8 cache the values its codes
/// and scales stand for (comparing raw codes would call two encodings of one
/// value different, and miss values too large to compare).
fn cache_values(cache: &PagedKVCacheCollection) -> Tensor {
    if cache.scales().is_none() {
        return cache.blocks().clone();
    }
    let p = *cache.params();
    let mut values = Vec::with_capacity(cache.blocks().numel());
    for page in 0..cache.num_pages() {
        for kv in 0..2 {
            for layer in 0..p.num_layers {
                for slot in 0..p.page_size {
                    values.extend(cache.read_slot(page, kv, layer, slot).expect("every slot of the cache reads"));
                }
            }
        }
    }
    Tensor::from_vec(cache.blocks().shape(), values).expect("one value per element")
}

/// Largest magnitude of a value the runs' results are compared for: past
/// it, products in the kernels' f32 arithmetic (attention scores of two
/// layers' worth of growth) can overflow where the f64 reference does not,
/// and an f32 softmax over an infinite score is NaN by its contract.
const MODERATE: f32 = 1e15;

/// Whether every float input and every cache value is finite and at most
/// [`MODERATE`] in magnitude: only then are two runs' values compared.
fn moderate(inputs: &BTreeMap<String, Tensor>, caches: &Caches) -> bool {
    let small = |t: &Tensor| t.to_f32_vec().is_ok_and(|v| v.iter().all(|x| x.abs() <= MODERATE));
    inputs.values().filter(|t| t.dtype() != DType::U32).all(small) && caches.values().all(|c| small(&cache_values(c)))
}

/// Compare a JIT run with a reference run of the same inputs: the same
/// verdict always, close values where the inputs are [`moderate`].
fn assert_same_runs(jit: &Ran, reference: &Ran, what: &str) {
    match (&jit.result, &reference.result) {
        // Both kernels of a node have the key `specialize` made (the CPU
        // tier named, whichever implementation runs): the messages agree
        // word for word, key included.
        (Err(a), Err(b)) => assert_eq!(a, b, "{what}: JIT and reference kernels refuse differently"),
        (Ok(a), Ok(b)) => {
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: output names");
            if !reference.moderate {
                return;
            }
            for (name, t) in b {
                assert_close(&format!("{what}: output '{name}'"), &a[name], t);
            }
            for (name, c) in &reference.caches {
                let (got, want) = (cache_values(&jit.caches[name]), cache_values(c));
                assert_close(&format!("{what}: cache '{name}'"), &got, &want);
            }
        }
        (a, b) => panic!(
            "{what}: the JIT run gives {a:?}, the reference run {b:?}",
            a = a.as_ref().err(),
            b = b.as_ref().err()
        ),
    }
}

// ---------------------------------------------------------------------------
// graph_file
// ---------------------------------------------------------------------------

/// The `graph_file` target: graph-file JSON, optionally followed by a NUL
/// byte and the bytes of a safetensors weights file.
pub fn graph_file(data: &[u8]) {
    let (text, weights) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let Ok(text) = std::str::from_utf8(text) else { return };
    let weights = match weights.map(tensors_from_safetensors) {
        Some(Ok(w)) => Some(w),
        Some(Err(e)) => {
            let _ = e.to_string();
            None
        }
        None => None,
    };
    REGISTRY.with(|registry| {
        let graph = match graph_from_json_within(text, registry.ops(), weights.as_ref(), RECIPE_BUDGET) {
            Ok(graph) => graph,
            Err(e) => {
                let _ = e.to_string();
                return;
            }
        };
        round_trip(&graph, registry);
        compile_and_run(&graph, registry);
    });
}

/// Save → load → save gives the same text.
fn round_trip(graph: &Graph, registry: &Registry) {
    let saved = graph_to_json(graph, Some("weights.safetensors"));
    let stored: BTreeMap<String, Tensor> = graph
        .constants()
        .filter_map(|(_, v)| match &v.def {
            ValueDef::Constant { data, init: None } => Some((v.name.clone().unwrap_or_default(), (**data).clone())),
            _ => None,
        })
        .collect();
    let again = graph_from_json(&saved, registry.ops(), Some(&stored))
        .unwrap_or_else(|e| panic!("a saved graph does not load again: {e}\n{saved}"));
    assert_eq!(graph_to_json(&again, Some("weights.safetensors")), saved, "save → load → save changed the file");
}

/// Compile with both implementations (under a budget); where the graph
/// runs with the demo scenario (`kvjit run GRAPH`), run both and compare.
fn compile_and_run(graph: &Graph, registry: &Registry) {
    for implementation in [KernelImpl::Reference, KernelImpl::Fast] {
        if let Err(e) = compile(graph, registry, &options(implementation, BTreeMap::new(), 64 << 20)) {
            let _ = e.to_string();
        }
    }
    let symbols = graph.symbols();
    let bindings: BTreeMap<String, usize> = [("batch", 2), ("seq", 3)]
        .into_iter()
        .filter(|(s, _)| symbols.iter().any(|x| x == s))
        .map(|(s, v)| (s.into(), v))
        .collect();
    let compiled = [KernelImpl::Reference, KernelImpl::Fast]
        .map(|i| compile(graph, registry, &options(i, bindings.clone(), RUN_BUDGET)));
    let [Ok(reference), Ok(jit)] = compiled else { return };
    let Ok(scenario) = Scenario::prefill_with(graph, 1, 2, 3) else { return };
    let mut want = run(&reference, &scenario.inputs, &scenario.caches, "graph file, reference");
    want.moderate &= graph.constants().all(|(_, v)| match &v.def {
        ValueDef::Constant { data, .. } => data.to_f32_vec().is_ok_and(|d| d.iter().all(|x| x.abs() <= MODERATE)),
        _ => true,
    });
    let got = run(&jit, &scenario.inputs, &scenario.caches, "graph file, JIT");
    assert_same_runs(&got, &want, "graph file");
    run_empty_steps(graph, registry, &scenario.caches);
}

/// A batch of no sequences and a step of no tokens through the generic
/// kernels of both implementations: the same verdict from both, and a run
/// that is accepted writes nothing and outputs nothing. `caches` are the
/// demo scenario's (2 sequences with history).
fn run_empty_steps(graph: &Graph, registry: &Registry, caches: &Caches) {
    let symbols = graph.symbols();
    if symbols.iter().any(|s| s != "batch" && s != "seq") {
        return;
    }
    let compiled = [KernelImpl::Reference, KernelImpl::Fast]
        .map(|i| compile(graph, registry, &options(i, BTreeMap::new(), RUN_BUDGET)));
    let [Ok(reference), Ok(jit)] = compiled else { return };
    let no_sequences: Option<Caches> = graph
        .kv_caches()
        .map(|(_, value)| {
            let ty = value.ty.as_kv_cache()?;
            let size = |dim: &Dim| match dim {
                Dim::Static(v) => *v,
                Dim::Symbolic(_) => 0,
            };
            let cache = PagedKVCacheCollection::new(ty.params(), size(&ty.num_pages), 0, size(&ty.max_pages_per_seq));
            Some((value.name.clone().unwrap_or_default(), cache.ok()?))
        })
        .collect();
    let steps = [(0, 3, no_sequences), (2, 0, Some(caches.clone()))];
    for (batch, seq, caches) in steps {
        let (Some(caches), Some(inputs)) = (caches, inputs_of_no_tokens(graph, batch, seq)) else { continue };
        let what = format!("graph file, B = {batch}, S = {seq}");
        let want = run(&reference, &inputs, &caches, &format!("{what}, reference"));
        let got = run(&jit, &inputs, &caches, &format!("{what}, JIT"));
        assert_same_runs(&got, &want, &what);
        if let Ok(outputs) = &want.result {
            // What a node computed is empty (an output may also name an
            // input or a constant, which is what it is).
            for output in graph.outputs() {
                if matches!(graph.value(output.value).def, ValueDef::NodeOutput { .. }) {
                    let numel = outputs[&output.name].numel();
                    assert_eq!(numel, 0, "{what}: an empty step output {numel} values as '{}'", output.name);
                }
            }
            assert!(caches_identical(&want.caches, &caches), "{what}: an empty step wrote a cache");
        }
    }
}

/// Inputs of `batch` sequences padded to `seq` tokens, with every u32 input
/// zero (no valid tokens, layer 0); `None` if a dim is neither static nor
/// `batch`/`seq`.
fn inputs_of_no_tokens(graph: &Graph, batch: usize, seq: usize) -> Option<BTreeMap<String, Tensor>> {
    let mut inputs = BTreeMap::new();
    for (_, value) in graph.inputs() {
        let ty = value.ty.as_tensor()?;
        let shape = ty
            .shape
            .iter()
            .map(|dim| match dim {
                Dim::Static(v) => Some(*v),
                Dim::Symbolic(s) if s == "batch" => Some(batch),
                Dim::Symbolic(s) if s == "seq" => Some(seq),
                Dim::Symbolic(_) => None,
            })
            .collect::<Option<Vec<usize>>>()?;
        let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).filter(|&n| n <= 1 << 16)?;
        let tensor = if ty.dtype == DType::U32 {
            Tensor::from_vec(&shape, vec![0u32; numel]).ok()?
        } else {
            Tensor::from_f32(ty.dtype, &shape, &vec![0.5; numel]).ok()?
        };
        inputs.insert(value.name.clone()?, tensor);
    }
    Some(inputs)
}

// ---------------------------------------------------------------------------
// artifact
// ---------------------------------------------------------------------------

/// The `artifact` target: the bytes of a compiled artifact (`kvjit run
/// model.kvjit`). It is written to a file (the reader maps files) and
/// loaded; one that loads and fits [`RUN_BUDGET`] is compiled and, when
/// the demo scenario fits it, run, with the JIT kernels taking its prepared
/// weights; every failure must be a typed error.
pub fn artifact_file(data: &[u8]) {
    let path = std::env::temp_dir().join(format!("kvjit-fuzz-{}.kvjit", std::process::id()));
    std::fs::write(&path, data).expect("the fuzz artifact file is written");
    REGISTRY.with(|registry| {
        let loaded = match kvjit::load_artifact(&path, registry) {
            Ok(loaded) => loaded,
            Err(e) => {
                let _ = e.to_string();
                return;
            }
        };
        let estimate = kvjit::MemoryEstimate::of(&loaded.graph, registry, loaded.options.target, &loaded.options.build);
        if estimate.total() > RUN_BUDGET || !estimate.unknown.is_empty() {
            return;
        }
        let exe = match loaded.compile(registry) {
            Ok(exe) => exe,
            Err(e) => {
                let _ = e.to_string();
                return;
            }
        };
        let Ok(scenario) = Scenario::prefill_with(&loaded.graph, 1, 2, 3) else { return };
        let mut caches = scenario.caches.clone();
        let executor = Executor::new(DeviceContextPtr::cpu(1).expect("a CPU context starts"));
        if let Err(e) = executor.run(&exe, &scenario.inputs, &mut caches) {
            let _ = e.to_string();
        }
    });
}

// ---------------------------------------------------------------------------
// safetensors_inputs
// ---------------------------------------------------------------------------

/// A tiny two-layer chain in one dtype pair: layer 1 reads layer 0's Q
/// (K = q_dim = 4; Hkv = 1, D = 2, page size 2, L = 2), both write one cache
/// whose page count and table width are symbols too, so an inputs file may
/// choose them.
pub struct Tiny {
    /// Activation dtype.
    pub dtype: DType,
    /// The graph.
    pub graph: Graph,
    reference: Executable,
    jit: Executable,
}

/// Activation and cache dtype of the tiny graphs.
pub const TINY_DTYPES: [(DType, DType); 3] =
    [(DType::F32, DType::F32), (DType::BF16, DType::F16), (DType::F16, DType::BF16)];

/// Build the tiny graph for one dtype pair.
pub fn tiny_graph(registry: &Registry, dtype: DType, cache_dtype: DType) -> Graph {
    let mut b = GraphBuilder::new("tiny_chain", registry.ops());
    let batch = Dim::from("batch");
    let hidden = b.input("hidden_state", dtype, &[batch.clone(), Dim::from("seq"), Dim::from(4)]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch)).unwrap();
    let cache = b
        .kv_cache(
            "kv_cache",
            KvCacheType {
                dtype: cache_dtype,
                num_layers: 2,
                page_size: 2,
                num_kv_heads: 1,
                head_size: 2,
                scale_granularity: None,
                num_pages: Dim::from("pages"),
                batch,
                max_pages_per_seq: Dim::from("width"),
            },
        )
        .unwrap();
    let params: Params = [
        ("dtype", ParamValue::from(dtype)),
        ("num_kv_heads", 1usize.into()),
        ("head_size", 2usize.into()),
        ("page_size", 2usize.into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut x = hidden;
    for layer in 0..2 {
        let w = b
            .random_constant(
                &format!("layers.{layer}.qkv_weight"),
                dtype,
                &[8, 4],
                RandomInit { seed: layer, low: -0.5, high: 0.5 },
            )
            .unwrap();
        let name = if layer == 0 { "layer_idx".to_string() } else { "layers.1.layer_idx".to_string() };
        let idx = b.input(&name, DType::U32, &[]).unwrap();
        x = b.node(kvjit::fused_qkv::OP_NAME, params.clone(), &[x, w, cache, idx, valid]).unwrap()[0];
        b.output(&format!("layers.{layer}.q"), x).unwrap();
    }
    b.finish().unwrap()
}

/// Activation and cache dtype of the tiny attention steps.
pub const TINY_ATTENTION_DTYPES: [(DType, DType); 3] =
    [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::BF16, DType::F8E4M3)];

/// A tiny whole attention step (fused QKV → reshape → RoPE → attention →
/// reshape, two layers; hidden 16, 2 query heads, 1 KV head of 8, page 2,
/// 12 pages, 4 a sequence; an FP8 cache has one scale per head, g = 8).
pub fn tiny_attention_graph(registry: &Registry, dtype: DType, cache_dtype: DType) -> Graph {
    let layer = LayerConfig {
        name: format!("tiny_attention_{dtype}_{cache_dtype}"),
        dtype,
        cache_dtype: (cache_dtype != dtype).then_some(cache_dtype),
        hidden_size: 16,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_size: 8,
        page_size: 2,
        num_layers: 2,
        num_pages: 12,
        max_pages_per_seq: 4,
        weight_seed: 3,
    };
    let config = LlamaConfig { layer, ..LlamaConfig::small() };
    attention_step_graph(&config, registry.ops()).expect("the tiny attention step builds")
}

/// Every tiny graph the `safetensors_inputs` target runs an inputs file
/// against, compiled once with both kernel implementations.
fn with_tiny<R>(f: impl FnOnce(&[Tiny]) -> R) -> R {
    TINY.with(|tiny| {
        let mut tiny = tiny.borrow_mut();
        if tiny.is_empty() {
            REGISTRY.with(|registry| {
                let chains = TINY_DTYPES.map(|(d, c)| (d, tiny_graph(registry, d, c)));
                let steps = TINY_ATTENTION_DTYPES.map(|(d, c)| (d, tiny_attention_graph(registry, d, c)));
                for (dtype, graph) in chains.into_iter().chain(steps) {
                    let [reference, jit] = [KernelImpl::Reference, KernelImpl::Fast]
                        .map(|i| compile(&graph, registry, &options(i, BTreeMap::new(), 1 << 20)).unwrap());
                    tiny.push(Tiny { dtype, graph, reference, jit });
                }
            });
        }
        f(&tiny)
    })
}

/// Elements of one tensor the `gguf` target dequantizes (bigger ones are
/// only checked for their size: a file of n bytes can declare a Q4_0 tensor
/// of about 1.8·n elements, so this bounds memory, not correctness).
pub const GGUF_MAX_ELEMENTS: usize = 1 << 22;

/// The `gguf` target: the bytes of a GGUF file. A file the reader refuses
/// is one line; one it accepts has every metadata value readable (arrays
/// walked at their declared width, typed getters erroring, never
/// panicking) and every tensor's stored bytes exactly its declared size,
/// and a tensor kvjit reads dequantizes to f32, bf16 and f16 alike (each
/// the f32 values rounded once).
pub fn gguf_file(data: &[u8]) {
    use kvjit::{bf16, f16};
    use kvjit_gguf::{Gguf, Value};
    let gguf = match Gguf::from_bytes("fuzz.gguf", data) {
        Ok(g) => g,
        Err(e) => {
            let message = e.to_string();
            assert!(!message.contains('\n'), "a refusal is one line: {message}");
            return;
        }
    };
    for key in gguf.keys() {
        match gguf.get(key).expect("a listed key has a value") {
            Value::Array(array) => {
                assert_eq!(array.iter().count(), array.len(), "{key}: an array yields its length");
                for v in array.iter() {
                    let _ = (v.as_integer(), v.as_f32(), v.as_str());
                }
            }
            v => {
                let _ = (v.as_integer(), v.as_f32(), v.as_str());
            }
        }
        let _ = gguf.get_u32(key).map_err(|e| e.to_string());
        let _ = gguf.get_u64(key).map_err(|e| e.to_string());
        let _ = gguf.get_f32(key).map_err(|e| e.to_string());
        let _ = gguf.get_bool(key).map_err(|e| e.to_string());
        let _ = gguf.get_str(key).map_err(|e| e.to_string());
        let _ = gguf.get_str_array(key).map_err(|e| e.to_string());
        let _ = gguf.get_i32_array(key).map_err(|e| e.to_string());
        let _ = gguf.get_u32_array(key).map_err(|e| e.to_string());
        let _ = gguf.get_f32_array(key).map_err(|e| e.to_string());
    }
    let _ = gguf.architecture().map_err(|e| e.to_string());
    for info in gguf.tensors() {
        let name = info.name();
        let stored = gguf.tensor_data(name).expect("a listed tensor has data");
        assert_eq!(stored.len(), info.byte_size(), "{name}: stored bytes");
        let ty = info.ggml_type();
        assert_eq!(info.numel() / ty.block_size() * ty.type_size(), info.byte_size(), "{name}: whole blocks of {ty}");
        if info.numel() > GGUF_MAX_ELEMENTS {
            continue;
        }
        let f32s = match gguf.tensor(name, DType::F32) {
            Ok(t) => t,
            Err(e) => {
                assert!(!ty.is_supported(), "{name}: a {ty} tensor refused: {e}");
                continue;
            }
        };
        assert_eq!(f32s.shape(), &info.shape()[..], "{name}: shape");
        let values = f32s.to_f32_vec().unwrap();
        let bf16s = gguf.tensor(name, DType::BF16).expect("f32 loads, so bf16 does");
        let f16s = gguf.tensor(name, DType::F16).expect("f32 loads, so f16 does");
        let want_bf16: Vec<u16> = values.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        assert_eq!(le_u16s(bf16s.as_bytes()), want_bf16, "{name}: bf16 is the f32 values rounded once");
        let want_f16: Vec<u16> = values.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        assert_eq!(le_u16s(f16s.as_bytes()), want_f16, "{name}: f16 is the f32 values rounded once");
    }
}

fn le_u16s(bytes: &[u8]) -> Vec<u16> {
    bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
}

/// The `safetensors_inputs` target: the bytes of a `kvjit run --inputs`
/// file.
pub fn safetensors_inputs(data: &[u8]) {
    let tensors = match tensors_from_safetensors(data) {
        Ok(t) => t,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let bytes = tensors_to_safetensors(tensors.iter().map(|(n, t)| (n.as_str(), t))).expect("parsed tensors serialize");
    let back = tensors_from_safetensors(&bytes).expect("serialized tensors parse");
    assert!(
        back.len() == tensors.len()
            && back.iter().zip(&tensors).all(|((na, a), (nb, b))| na == nb
                && a.dtype() == b.dtype()
                && a.shape() == b.shape()
                && a.as_bytes() == b.as_bytes()),
        "tensors changed in a safetensors round trip"
    );

    match PagedKVCacheCollection::from_tensors("kv_cache", &mut tensors.clone()) {
        Ok(cache) => exercise_cache(&cache),
        Err(e) => {
            let _ = e.to_string();
        }
    }

    // Against every tiny graph of the file's activation dtype: the chain
    // and the attention steps (their caches' dtypes differ, so a cache that
    // assembles fits at most one or two of them).
    let dtype = tensors.get("hidden_state").map_or(DType::F32, Tensor::dtype);
    with_tiny(|tiny| {
        for tiny in tiny.iter().filter(|t| t.dtype == dtype) {
            let scenario = match Scenario::from_tensors(&tiny.graph, tensors.clone(), 0) {
                Ok(s) => s,
                Err(e) => {
                    let _ = e.to_string();
                    continue;
                }
            };
            let what = format!("inputs file, {}", tiny.graph.name());
            let want = run(&tiny.reference, &scenario.inputs, &scenario.caches, &format!("{what}, reference"));
            let got = run(&tiny.jit, &scenario.inputs, &scenario.caches, &format!("{what}, JIT"));
            assert_same_runs(&got, &want, &what);
        }
    });
}

/// Cache helpers on a cache assembled from arbitrary tensors: no panics,
/// all-or-nothing updates, and a `to_tensors` round trip.
fn exercise_cache(cache: &PagedKVCacheCollection) {
    let mut map: BTreeMap<String, Tensor> = cache.to_tensors("kv_cache").unwrap().into_iter().collect();
    let back = PagedKVCacheCollection::from_tensors("kv_cache", &mut map).expect("a cache's own tensors assemble");
    assert!(
        CacheSnapshot::take(&back) == CacheSnapshot::take(cache) && back.params() == cache.params(),
        "cache round trip"
    );

    let b = cache.batch_size();
    for new_tokens in [vec![1u32; b], vec![u32::MAX; b], vec![0; b + 1]] {
        let mut c = cache.clone();
        if c.reserve(&new_tokens).is_err() {
            assert!(CacheSnapshot::take(&c) == CacheSnapshot::take(cache), "a failed reserve changed the cache");
        }
        let mut c = cache.clone();
        if c.advance(&new_tokens).is_err() {
            assert!(CacheSnapshot::take(&c) == CacheSnapshot::take(cache), "a failed advance changed the cache");
        }
    }
    for batch in 0..b.min(4) + 1 {
        let length = cache.cache_lengths().get(batch).copied().unwrap_or(0) as usize;
        for position in [0, length.saturating_sub(1), length, usize::MAX / 2] {
            let _ = cache.locate(batch, position);
            for layer in [0, 1, cache.params().num_layers] {
                let _ = cache.read_token(layer, batch, position);
            }
        }
    }
    let mut c = cache.clone();
    if b > 0 {
        c.release(b - 1).expect("release of a sequence in range");
    }
    let _ = c.release(b);
    let _ = c.free_pages();
}
