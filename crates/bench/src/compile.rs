//! Compile latency: how long until a graph can run, and until it has run.
//!
//! Three cases, each timed from nothing compiled to done (every executable
//! and kernel is dropped between calls, so the process-wide kernel cache
//! starts empty for the key every time and each call JIT-compiles for real):
//!
//! - [`CompileCase::OneNode`]: build a one-node graph with the builder (the
//!   weight a constant), specialize it for a decode step (batch = seq = 1,
//!   so the kernel is fully static), JIT it and pack the weight;
//! - [`CompileCase::Layers`]: the same for a graph of `L` nodes, one per
//!   layer, all writing one `L`-layer cache — every node has the same kernel
//!   key, so the kernel cache compiles once and layers 2..L only pack their
//!   weights. (The nodes share one weight constant to keep the benchmark's
//!   memory at one weight; each node still packs its own copy, as it would
//!   from separate weights.)
//! - [`CompileCase::FileToFirstOutput`]: a graph file on disk (JSON, the
//!   weight in the safetensors file beside it) → load (parse, read weights,
//!   validate) → compile → inputs and cache → the first decode step's output.
//!
//! Each run also reports how many JIT compiles it made and their time, from
//! the JIT's compile log, so the rest (graph building, weight copies and
//! packing, I/O) can be told apart.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvjit::{CompileOptions, Registry, compile, standard_registry};
use kvjit_core::{CacheElement, DType, KernelSpec, KvCacheParams, PagedKVCacheCollection, Tensor};
use kvjit_graph::{Dim, Graph, GraphBuilder, KvCacheType, ParamValue, Params, load_graph, save_graph};
use kvjit_op_fused_qkv::{FusedQkvSpec, OP_NAME, cpu_jit};
use kvjit_runtime::{DeviceContextPtr, Executable, Executor};

use super::problem::{ModelShape, Weights};
use crate::{BenchError, Result};

/// Pages of the benchmark graphs' cache.
const NUM_PAGES: usize = 16;
/// Lookup-table width of the benchmark graphs' cache.
const MAX_PAGES_PER_SEQ: usize = 4;

/// What is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompileCase {
    /// Build + specialize + JIT a one-node graph.
    OneNode,
    /// Build + specialize + JIT a graph of this many layers (one node each,
    /// one kernel key).
    Layers(usize),
    /// Graph file on disk → first output.
    FileToFirstOutput,
}

impl CompileCase {
    /// The cases of the suite, with `layers` layers in the many-layer graph.
    pub fn all(layers: usize) -> [CompileCase; 3] {
        [CompileCase::OneNode, CompileCase::Layers(layers), CompileCase::FileToFirstOutput]
    }

    /// Identifier for benchmark ids and JSON.
    pub fn id(self) -> String {
        match self {
            CompileCase::OneNode => "graph_1_node".into(),
            CompileCase::Layers(l) => format!("graph_{l}_layers"),
            CompileCase::FileToFirstOutput => "file_to_first_output".into(),
        }
    }

    /// What the case covers, for tables.
    pub fn describe(self) -> String {
        match self {
            CompileCase::OneNode => "build + specialize + JIT, 1 node".into(),
            CompileCase::Layers(l) => format!("build + specialize + JIT, {l} layers (one key)"),
            CompileCase::FileToFirstOutput => "graph file + safetensors → first output".into(),
        }
    }
}

/// What one timed run did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompileRun {
    /// Kernels JIT-compiled.
    pub jit_compiles: usize,
    /// Their compile time.
    pub jit_time: Duration,
}

/// Everything the compile cases need, made once: the weight, and the graph
/// file (in a temporary directory removed on drop).
pub struct CompileBench {
    shape: ModelShape,
    dtype: DType,
    page_size: usize,
    weight: Tensor,
    registry: Registry,
    ctx: DeviceContextPtr,
    dir: PathBuf,
}

impl CompileBench {
    /// Set up for `shape` in `dtype` with pages of `page_size` tokens.
    pub fn new(shape: &ModelShape, dtype: DType, page_size: usize, ctx: &DeviceContextPtr, seed: u64) -> Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvjit-bench-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).map_err(|source| BenchError::CreateDir { path: dir.clone(), source })?;
        let bench = Self {
            weight: Arc::unwrap_or_clone(Weights::new(shape, dtype, seed, 0)?.layers.swap_remove(0)),
            shape: shape.clone(),
            dtype,
            page_size,
            registry: standard_registry(),
            ctx: ctx.clone(),
            dir,
        };
        save_graph(&bench.graph(1)?, &bench.graph_path())?;
        Ok(bench)
    }

    /// The model shape.
    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn graph_path(&self) -> PathBuf {
        self.dir.join("bench_layer.json")
    }

    /// A graph of `layers` fused-QKV nodes sharing the weight and one
    /// `layers`-layer cache; symbolic batch and seq.
    pub fn graph(&self, layers: usize) -> Result<Graph> {
        let ops = self.registry.ops();
        let mut b = GraphBuilder::new(&format!("bench_{}_layers", layers), ops);
        let batch = Dim::from("batch");
        let hidden =
            b.input("hidden_state", self.dtype, &[batch.clone(), Dim::from("seq"), Dim::from(self.shape.k)])?;
        let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch))?;
        let cache = b.kv_cache(
            "kv_cache",
            KvCacheType {
                dtype: self.dtype,
                num_layers: layers,
                page_size: self.page_size,
                num_kv_heads: self.shape.kv_heads,
                head_size: self.shape.head_size,
                scale_granularity: None,
                num_pages: Dim::from(NUM_PAGES),
                batch,
                max_pages_per_seq: Dim::from(MAX_PAGES_PER_SEQ),
            },
        )?;
        let weight = b.constant("qkv_weight", self.weight.clone())?;
        let params: Params = [
            ("dtype", ParamValue::from(self.dtype)),
            ("num_kv_heads", self.shape.kv_heads.into()),
            ("head_size", self.shape.head_size.into()),
            ("page_size", self.page_size.into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        for layer in 0..layers {
            let layer_idx = b.input(&format!("layers.{layer}.layer_idx"), DType::U32, &[])?;
            let q = b.node(OP_NAME, params.clone(), &[hidden, weight, cache, layer_idx, valid])?;
            b.output(&format!("layers.{layer}.q"), q[0])?;
        }
        Ok(b.finish()?)
    }

    fn compile_decode(&self, graph: &Graph) -> Result<Executable> {
        let options = CompileOptions {
            bindings: [("batch".to_string(), 1), ("seq".to_string(), 1)].into(),
            ..CompileOptions::default()
        };
        Ok(compile(graph, &self.registry, &options)?)
    }

    /// Run one case from scratch (what a benchmark times).
    pub fn run(&self, case: CompileCase) -> Result<CompileRun> {
        let log_before = cpu_jit::compile_log().len();
        match case {
            CompileCase::OneNode => drop(self.compile_decode(&self.graph(1)?)?),
            CompileCase::Layers(layers) => drop(self.compile_decode(&self.graph(layers.max(1))?)?),
            CompileCase::FileToFirstOutput => {
                let graph = load_graph(&self.graph_path(), self.registry.ops())?;
                let exe = self.compile_decode(&graph)?;
                let (inputs, mut caches) = self.decode_inputs()?;
                let out = Executor::new(self.ctx.clone()).run(&exe, &inputs, &mut caches)?;
                std::hint::black_box(&out.outputs);
            }
        }
        // Only this case's key: other threads of the process may compile too.
        let key = self.kernel_key(case);
        let log = cpu_jit::compile_log();
        let new: Vec<_> = log[log_before.min(log.len())..].iter().filter(|r| r.key == key).collect();
        Ok(CompileRun { jit_compiles: new.len(), jit_time: new.iter().map(|r| r.duration).sum() })
    }

    /// The kernel key every node of `case`'s graph gets (decode: B = S = 1).
    pub fn kernel_key(&self, case: CompileCase) -> String {
        let layers = match case {
            CompileCase::Layers(layers) => layers.max(1),
            _ => 1,
        };
        // The graphs build their kernels on the widest tier this CPU runs
        // (the spec's).
        let spec = self.shape.spec(self.dtype, self.page_size, Some((1, 1)));
        let spec = FusedQkvSpec { cache: KvCacheParams { num_layers: layers, ..spec.cache }, ..spec };
        spec.key().to_string()
    }

    /// One decode token for the one-layer graph: inputs and a cache.
    fn decode_inputs(&self) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, PagedKVCacheCollection>)> {
        let params = KvCacheParams {
            element: CacheElement::new(self.dtype, None).expect("a compute float"),
            num_layers: 1,
            page_size: self.page_size,
            num_kv_heads: self.shape.kv_heads,
            head_size: self.shape.head_size,
        };
        let mut cache = PagedKVCacheCollection::new(params, NUM_PAGES, 1, MAX_PAGES_PER_SEQ)?;
        cache.reserve(&[1])?;
        let hidden = Tensor::from_f32(self.dtype, &[1, 1, self.shape.k], &vec![0.5; self.shape.k])?;
        let inputs = [
            ("hidden_state".to_string(), hidden),
            ("valid_lengths".to_string(), Tensor::from_vec(&[1], vec![1u32])?),
            ("layers.0.layer_idx".to_string(), Tensor::scalar_u32(0)),
        ]
        .into();
        Ok((inputs, [("kv_cache".to_string(), cache)].into()))
    }
}

impl Drop for CompileBench {
    fn drop(&mut self) {
        // Best effort: a leftover temporary directory is harmless.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
