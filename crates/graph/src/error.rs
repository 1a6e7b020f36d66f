//! The graph crate's error enum.

use std::path::PathBuf;

use crate::{NodeId, ValueId};

/// Result alias for this crate.
pub type Result<T, E = GraphError> = std::result::Result<T, E>;

/// Everything that can be wrong with a graph or a graph file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// The file is not valid JSON, or not the shape of a graph file.
    #[error("malformed graph file: {0}")]
    Json(#[from] serde_json::Error),
    /// The JSON is not a kvjit graph file.
    #[error("not a kvjit graph file: \"format\" is {found:?}, expected \"{expected}\"")]
    NotAGraphFile {
        /// The format field found.
        found: Option<String>,
        /// The format field expected.
        expected: &'static str,
    },
    /// A format version this build cannot read.
    #[error("graph file version {found} is not supported: this kvjit reads version {supported}")]
    UnsupportedVersion {
        /// The version in the file.
        found: String,
        /// The version this build reads.
        supported: u32,
    },
    /// An op name no registered op answers to.
    #[error("unknown op '{name}': known ops are {known}")]
    UnknownOp {
        /// The name asked for.
        name: String,
        /// Registered op names.
        known: String,
    },
    /// Two ops registered under one name.
    #[error("op name '{0}' is registered twice")]
    DuplicateOp(String),
    /// A recipe registered under a name or marker field another recipe has.
    #[error("recipe '{name}' (marked by \"{marker}\") clashes with the registered recipe '{registered}'")]
    DuplicateRecipe {
        /// The recipe being registered.
        name: &'static str,
        /// Its marker field.
        marker: &'static str,
        /// The recipe it clashes with.
        registered: &'static str,
    },
    /// A graph built for a graph file asked to be finished as a graph to
    /// run ([`GraphBuilder::finish`](crate::GraphBuilder::finish)).
    #[error(
        "graph '{graph}' was built for a graph file (GraphBuilder::for_graph_file): its recipe constants hold no data, so it can only be written (finish_to_json)"
    )]
    DeferredRecipes {
        /// The graph's name.
        graph: String,
    },
    /// A constant given a recipe the builder's registry does not know (a
    /// file saving it could not be loaded with that registry).
    #[error("recipe '{name}' is not registered: known recipes are {known}")]
    UnknownRecipe {
        /// The recipe's name.
        name: &'static str,
        /// Registered recipe names.
        known: String,
    },
    /// A reference to a value that does not exist.
    #[error("{place} refers to {value}, which is not defined")]
    DanglingValue {
        /// Where the reference is.
        place: String,
        /// The missing value.
        value: ValueId,
    },
    /// A fusion that would drop a value something else still reads.
    #[error("fusing {nodes} would drop {value}, which {reader} still reads")]
    FusionDropsValue {
        /// The nodes the fusion absorbs.
        nodes: String,
        /// The value it would drop.
        value: ValueId,
        /// What reads it (a node or a graph output).
        reader: String,
    },
    /// An id defined twice.
    #[error("{id} is defined twice")]
    DuplicateId {
        /// The id.
        id: String,
    },
    /// Two graph inputs, constants, caches or outputs with one name.
    #[error("name '{0}' is used twice")]
    DuplicateName(String),
    /// Nodes that depend on each other in a loop.
    #[error("the graph has a cycle through nodes {0}")]
    Cycle(String),
    /// An op given the wrong number of inputs or outputs.
    #[error("op {op} takes {expected} {what}, got {got}")]
    ArgCount {
        /// The op.
        op: String,
        /// "inputs" or "outputs".
        what: &'static str,
        /// How many it takes.
        expected: usize,
        /// How many it got.
        got: usize,
    },
    /// A tensor where a cache is needed, or the other way round.
    #[error("argument '{arg}' must be a {expected}")]
    ArgKind {
        /// Argument name.
        arg: String,
        /// "tensor" or "KV cache".
        expected: &'static str,
    },
    /// An input whose type the op does not accept.
    #[error("argument '{arg}': expected {expected}, got {got}")]
    InputType {
        /// Argument name.
        arg: String,
        /// What the op accepts.
        expected: String,
        /// What it got.
        got: String,
    },
    /// A node parameter that is missing, unknown or out of range.
    #[error("parameter '{param}' {problem}")]
    Param {
        /// Parameter name.
        param: String,
        /// What is wrong.
        problem: String,
    },
    /// A problem inside one node, with the node named.
    #[error("node {node} ({op}): {source}")]
    InNode {
        /// The node.
        node: NodeId,
        /// Its op.
        op: String,
        /// The problem.
        source: Box<GraphError>,
    },
    /// A value's recorded type differs from what its op infers (files that
    /// were edited by hand, or IR corrupted by a bug).
    #[error("{value}: recorded type {recorded} differs from inferred type {inferred}")]
    TypeDrift {
        /// The value.
        value: ValueId,
        /// The type stored in the graph.
        recorded: String,
        /// The type its op infers.
        inferred: String,
    },
    /// A graph file's `weights` path that kvjit will not open.
    #[error("weights file '{name}' {problem}")]
    WeightsPath {
        /// The path as the graph file spells it.
        name: String,
        /// Why it is refused.
        problem: String,
    },
    /// A constant with both an `init` recipe and data in the weights file:
    /// which one is meant cannot be told.
    #[error(
        "constant '{name}' has both an \"init\" recipe and a tensor in the weights file: keep one (remove the recipe to use the file's data)"
    )]
    AmbiguousConstant {
        /// Constant name.
        name: String,
    },
    /// A graph file whose `init` recipes would generate more bytes than the
    /// load's budget; refused before the recipe generates anything.
    #[error(
        "constant '{name}': its init recipe makes {bytes} bytes, which brings the graph's recipes to {total} bytes, more than the recipe budget of {budget} bytes"
    )]
    RecipeBudget {
        /// The constant whose recipe crosses the budget.
        name: String,
        /// Bytes that recipe would make.
        bytes: u64,
        /// Bytes of every recipe up to and including it.
        total: u64,
        /// The budget.
        budget: u64,
    },
    /// Constant data that does not match its declared type.
    #[error("constant '{name}': declared {declared}, but its data is {dtype}{shape:?}")]
    ConstantMismatch {
        /// Constant name.
        name: String,
        /// Declared type.
        declared: String,
        /// Data dtype.
        dtype: kvjit_core::DType,
        /// Data shape.
        shape: Vec<usize>,
    },
    /// A graph with kernel-prepared constants (from a compiled artifact)
    /// saved as a graph file, which stores plain data only.
    #[error("constant '{0}' holds data in a kernel's layout (from a compiled artifact); a graph file cannot store it")]
    PreparedConstant(String),
    /// A symbol bound to a size where the graph needs a different one, or an
    /// invalid binding.
    #[error("symbol '{symbol}': {problem}")]
    Binding {
        /// The symbol.
        symbol: String,
        /// What is wrong.
        problem: String,
    },
    /// An op/target/dtype combination no kernel serves.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor-level problem (weights file, constant data).
    #[error(transparent)]
    Tensor(#[from] kvjit_core::Error),
    /// A graph file that could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
}

impl GraphError {
    /// Wrap an op's complaint with the node it came from.
    pub fn in_node(self, node: NodeId, op: &str) -> Self {
        GraphError::InNode { node, op: op.to_string(), source: Box::new(self) }
    }
}
