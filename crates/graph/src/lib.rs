//! The kvjit graph IR: values and nodes with typed handles, the op registry,
//! the builder that infers and checks shapes as nodes are added,
//! specialization to [`KernelKey`](kvjit_core::KernelKey)s, and graph files.
//!
//! Start with [`GraphBuilder`]: declare inputs, constants and KV caches, add
//! nodes by op name, mark outputs, then [`GraphBuilder::finish`]. Files go
//! through [`load_graph`] / [`save_graph`]; a loaded graph passes the same
//! validator as a built one. [`specialize`] turns a graph plus a target and
//! concrete dims into a [`SpecializedGraph`] whose nodes carry kernel keys.
//! The op definitions themselves live in the `ops/` crates; this crate knows
//! them only through the [`OpDef`] trait.

mod builder;
mod error;
mod file;
mod graph;
mod ids;
mod op;
mod recipe;
mod rewrite;
mod specialize;
mod types;
mod validate;

pub use builder::{DEFAULT_SCALE_GRANULARITY, GraphBuilder};
pub use error::{GraphError, Result};
pub use file::{
    DEFAULT_MEMORY_LIMIT, FORMAT_NAME, FORMAT_VERSION, confined_weights_path, graph_from_json,
    graph_from_json_prepared, graph_from_json_with_gguf, graph_from_json_within, graph_to_json, load_graph,
    load_graph_with, load_graph_within, save_graph,
};
pub use graph::{Graph, GraphOutput, Node, Value, ValueDef};
pub use ids::{NodeId, ValueId};
pub use op::{
    ArgKind, ArgRole, ArgSpec, OpDef, OpRegistry, PagedParams, ParamKind, ParamSpec, ParamValue, Params, input_error,
    paged_cache_input, param_bool, param_choice, param_dims, param_dtype, param_f64_opt, param_usize, param_usize_opt,
    step_inputs, tensor_input,
};
pub use recipe::{ConstantInit, RandomInit, Recipe, RecipeKind};
pub use rewrite::NodeFusion;
pub use specialize::{SpecializedGraph, specialize};
pub use types::{Dim, KvCacheType, TensorType, ValueType, same_dim};
pub use validate::validate;
