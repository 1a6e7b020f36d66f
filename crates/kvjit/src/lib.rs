//! kvjit: build graphs of LLM inference ops, compile every node for its
//! exact shapes, and run them on the CPU (or, later, NVIDIA GPUs).
//!
//! This facade crate ties the pieces together and is where to start:
//! - [`standard_registry`] lists every op kvjit ships;
//! - [`GraphBuilder`] builds a graph in Rust, [`load_graph`] reads a graph file;
//! - [`compile`] specializes a graph for a target and lowers it to an
//!   [`Executable`];
//! - [`Executor::run`] runs it with named inputs and KV caches;
//! - [`models`] builds model graphs from a typed config (Llama's QKV layers,
//!   attention step, whole decoder layers and a whole model from token ids
//!   to logits: the example graphs);
//! - [`scenario`] makes seeded, valid inputs and KV caches for any graph;
//! - the benchmarks (`kvjit bench`, `cargo bench -p kvjit-bench`) are the
//!   `kvjit-bench` crate.
//!
//! ```no_run
//! use kvjit::models::llama::{LayerConfig, qkv_layer_graph};
//! use kvjit::scenario::Scenario;
//! use kvjit::{CompileOptions, DeviceContextPtr, Executor, compile, standard_registry};
//!
//! let registry = standard_registry();
//! let config = LayerConfig::small();
//! let graph = qkv_layer_graph(&config, registry.ops()).unwrap();
//! let exe = compile(&graph, &registry, &CompileOptions::default()).unwrap();
//! let mut scenario = Scenario::prefill(&graph, 7).unwrap();
//! let out = Executor::new(DeviceContextPtr::cpu(2).unwrap())
//!     .run(&exe, &scenario.inputs, &mut scenario.caches)
//!     .unwrap();
//! println!("{:?}", out.outputs["q"].shape());
//! ```

pub mod artifact;
pub mod compare;
mod compile;
mod error;
pub mod fuse;
pub mod generate;
pub mod models;
mod registry;
pub mod scenario;

pub use artifact::{ArtifactError, LoadedArtifact, is_artifact, load_artifact, load_artifact_with, write_artifact};
pub use compile::{CompileOptions, MemoryEstimate, compile, compiled_graph};
pub use error::{Error, Result};
pub use fuse::{FusedGraph, fuse};
pub use registry::{Registry, standard_registry};

pub use kvjit_core::Error as CoreError;
pub use kvjit_core::fp8;
pub use kvjit_core::{
    Backend, CacheElement, CodeTier, CpuTier, DType, Element, F8E4M3, KernelKey, KernelSpec, KeyField, KvCacheParams,
    LoadedTensors, PagedKVCacheCollection, PreparedConstant, Target, Tensor, TensorData, UNASSIGNED_PAGE, WeightLoad,
    bf16, f16, load_safetensors, read_safetensors, read_safetensors_header, tensors_from_safetensors,
    tensors_to_safetensors, write_safetensors,
};
/// GGUF files (`kvjit-gguf`): the reader, metadata and dequantization.
pub use kvjit_gguf as gguf;
pub use kvjit_graph::{
    ConstantInit, DEFAULT_MEMORY_LIMIT, Dim, Graph, GraphBuilder, GraphError, KvCacheType, OpRegistry, ParamValue,
    Params, RandomInit, SpecializedGraph, TensorType, ValueDef, ValueId, graph_from_json, graph_from_json_within,
    graph_to_json, load_graph, load_graph_with, load_graph_within, save_graph, specialize,
};
pub use kvjit_jit::{CompileCause, CompileRecord, compile_log};
pub use kvjit_op_rope::{Llama3Scaling, RopeInit};
/// The tokenizer from a GGUF's vocabulary (`kvjit-tokenizer`).
pub use kvjit_tokenizer as tokenizer;

/// The CPU tier `CpuTier::Auto` resolves to on this machine (`Avx2` on an
/// x86-64 CPU with AVX2, FMA and F16C, else `Cranelift`): the tier JIT
/// kernels' keys name (`…cpu-avx2…`) unless a build asks for another.
pub fn widest_cpu_tier() -> CodeTier {
    kvjit_jit::microkernel::resolve_tier(CpuTier::Auto).unwrap_or(CodeTier::Cranelift)
}

/// The CPU backend with the widest tier this machine runs: what
/// [`specialize`] takes to name the keys [`compile`] builds by default.
pub fn cpu_backend() -> Backend {
    Backend::Cpu(widest_cpu_tier())
}
pub use kvjit_op as op;
pub use kvjit_op_attention as attention;
pub use kvjit_op_binary as binary;
pub use kvjit_op_fused_qkv as fused_qkv;
pub use kvjit_op_gather as gather;
pub use kvjit_op_last_token as last_token;
pub use kvjit_op_reshape as reshape;
pub use kvjit_op_rms_norm as rms_norm;
pub use kvjit_op_rope as rope;
pub use kvjit_op_silu as silu;

/// Typed builder functions, one per op, on top of
/// [`GraphBuilder::node`](GraphBuilder::node) (which graph files use): a
/// graph reads like the model.
///
/// ```no_run
/// use kvjit::ops::{FusedQkvParams, fused_qkv_matmul, reshape};
/// use kvjit::{DType, Dim, GraphBuilder, KvCacheType, standard_registry};
///
/// let registry = standard_registry();
/// let mut b = GraphBuilder::new("step", registry.ops());
/// let (batch, seq) = (Dim::from("batch"), Dim::from("seq"));
/// let x = b.input("hidden_state", DType::BF16, &[batch.clone(), seq.clone(), 4096.into()]).unwrap();
/// # let (w, kv, layer, valid) = (x, x, x, x);
/// let q = fused_qkv_matmul(
///     &mut b,
///     [x, w, kv, layer, valid],
///     FusedQkvParams { dtype: DType::BF16, num_kv_heads: 8, head_size: 128, page_size: 16 },
/// )
/// .unwrap();
/// let q_heads = reshape(&mut b, q, &[batch, seq, 32.into(), 128.into()]).unwrap();
/// ```
pub mod ops {
    pub use kvjit_op_attention::{Mask, MhaParams, mha};
    pub use kvjit_op_binary::{add, mul};
    pub use kvjit_op_fused_qkv::{FusedQkvParams, fused_qkv_matmul};
    pub use kvjit_op_gather::gather;
    pub use kvjit_op_last_token::last_valid_token;
    pub use kvjit_op_matmul::{MatmulParams, matmul};
    pub use kvjit_op_reshape::reshape;
    pub use kvjit_op_rms_norm::{RmsNormParams, rms_norm};
    pub use kvjit_op_rope::{RopeParams, fused_qk_rope};
    pub use kvjit_op_silu::silu;
}
pub use kvjit_runtime::{
    BuildOptions, CodeInfo, DeviceContextPtr, Executable, Executor, KernelImpl, MAX_WORKER_THREADS, RELEASE_DEAD_ABOVE,
    RunOutput, RuntimeError, cuda_availability, parse_threads,
};
