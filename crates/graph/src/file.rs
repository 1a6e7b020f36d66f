//! Graph files: versioned JSON for the graph, safetensors (or GGUF) for the
//! weights.
//!
//! A file is checked in this order: JSON syntax, the `format`/`version`
//! marker (so a future version is reported as such, not as a parse error),
//! the schema (unknown fields are errors; each constant's `init` fields are
//! read by the registry's recipes), ids and references, a topological
//! sort (cycles are reported with the nodes on them), and finally the graph is
//! rebuilt through [`GraphBuilder`] and the same validator a built graph
//! passes. Node order in the file does not matter; ids are renumbered in
//! execution order on load.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use kvjit_core::{DType, Tensor, WeightLoad, load_safetensors, write_safetensors};
use serde::{Deserialize, Serialize};

use crate::{
    ConstantInit, Dim, Graph, GraphBuilder, GraphError, KvCacheType, NodeId, OpRegistry, Params, Result, ValueDef,
    ValueId, ValueType,
};

/// The `format` marker of a graph file.
pub const FORMAT_NAME: &str = "kvjit-graph";
/// The graph file version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes a file may make kvjit allocate on its own say when the caller set
/// no budget: what a graph file's `init` recipes generate, all together
/// ([`load_graph`], [`graph_from_json`]; raise it with [`load_graph_within`]
/// or [`graph_from_json_within`]), and the KV caches the example scenario
/// makes for a graph's `kv_cache` declarations (`kvjit run` without
/// `--inputs`). 1 GiB: ten times the largest recipe of the examples.
pub const DEFAULT_MEMORY_LIMIT: u64 = 1 << 30;

/// A graph file. `Init` is what a constant's `init` is: its JSON fields
/// when a file is read (the registry decides which recipe they are,
/// [`OpRegistry::read_recipe`]), the recipe when one is written.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GraphFile<Init> {
    format: String,
    version: u32,
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    weights: Option<String>,
    values: Vec<ValueEntry<Init>>,
    nodes: Vec<NodeEntry>,
    #[serde(default)]
    outputs: Vec<OutputEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
#[serde(bound(deserialize = "Init: Deserialize<'de>"))]
enum ValueEntry<Init> {
    Input {
        id: ValueId,
        name: String,
        dtype: DType,
        shape: Vec<Dim>,
    },
    Constant {
        id: ValueId,
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        init: Option<Init>,
    },
    KvCache {
        id: ValueId,
        name: String,
        dtype: DType,
        num_layers: usize,
        page_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale_granularity: Option<usize>,
        num_pages: Dim,
        batch: Dim,
        max_pages_per_seq: Dim,
    },
}

impl<Init> ValueEntry<Init> {
    fn id(&self) -> ValueId {
        match self {
            ValueEntry::Input { id, .. } | ValueEntry::Constant { id, .. } | ValueEntry::KvCache { id, .. } => *id,
        }
    }

    fn name(&self) -> &str {
        match self {
            ValueEntry::Input { name, .. } | ValueEntry::Constant { name, .. } | ValueEntry::KvCache { name, .. } => {
                name
            }
        }
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeEntry {
    id: NodeId,
    op: String,
    #[serde(default)]
    params: Params,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputEntry {
    name: String,
    value: ValueId,
}

/// Value ids as files spell them: declared values (inputs, constants,
/// caches) first, then node outputs in node order — the order a loader
/// creates them in, so saving a loaded file reproduces it exactly.
fn file_ids(graph: &Graph) -> Vec<ValueId> {
    let mut ids = vec![ValueId(0); graph.values().len()];
    let declared = graph.values().iter().enumerate().filter(|(_, v)| !matches!(v.def, ValueDef::NodeOutput { .. }));
    let produced = graph.nodes().iter().flat_map(|n| n.outputs.iter().map(|o| o.index()));
    for (next, i) in declared.map(|(i, _)| i).chain(produced).enumerate() {
        ids[i] = ValueId(next as u32);
    }
    ids
}

/// The graph as graph-file JSON. Constants with a recipe ([`ConstantInit`]) are saved
/// as their recipe; other constants are expected in the safetensors file
/// named `weights_file` (relative to the graph file).
pub fn graph_to_json(graph: &Graph, weights_file: Option<&str>) -> String {
    let ids = file_ids(graph);
    let renumber = |values: &[ValueId]| values.iter().map(|v| ids[v.index()]).collect::<Vec<_>>();
    let values = graph
        .values()
        .iter()
        .enumerate()
        .filter_map(|(i, v)| {
            let id = ids[i];
            let name = v.name.clone().unwrap_or_default();
            match (&v.def, &v.ty) {
                (ValueDef::Input, ValueType::Tensor(t)) => {
                    Some(ValueEntry::Input { id, name, dtype: t.dtype, shape: t.shape.clone() })
                }
                (ValueDef::Constant { data, init }, _) => Some(ValueEntry::Constant {
                    id,
                    name,
                    dtype: data.dtype(),
                    shape: data.shape().to_vec(),
                    init: init.clone(),
                }),
                (ValueDef::Prepared { .. }, ValueType::Tensor(t)) => Some(ValueEntry::Constant {
                    id,
                    name,
                    dtype: t.dtype,
                    shape: t.shape.iter().map(|d| d.as_static().unwrap_or(0)).collect(),
                    init: None,
                }),
                (ValueDef::KvCache, ValueType::KvCache(c)) => Some(ValueEntry::KvCache {
                    id,
                    name,
                    dtype: c.dtype,
                    num_layers: c.num_layers,
                    page_size: c.page_size,
                    num_kv_heads: c.num_kv_heads,
                    head_size: c.head_size,
                    scale_granularity: c.scale_granularity,
                    num_pages: c.num_pages.clone(),
                    batch: c.batch.clone(),
                    max_pages_per_seq: c.max_pages_per_seq.clone(),
                }),
                _ => None,
            }
        })
        .collect();
    let file = GraphFile::<ConstantInit> {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        name: graph.name().into(),
        weights: weights_file.map(str::to_string),
        values,
        nodes: graph
            .nodes()
            .iter()
            .map(|n| NodeEntry {
                id: n.id,
                op: n.op.clone(),
                params: n.params.clone(),
                inputs: renumber(&n.inputs),
                outputs: renumber(&n.outputs),
            })
            .collect(),
        outputs: graph
            .outputs()
            .iter()
            .map(|o| OutputEntry { name: o.name.clone(), value: ids[o.value.index()] })
            .collect(),
    };
    serde_json::to_string_pretty(&file).expect("graph files serialize infallibly") + "\n"
}

fn check_marker(json: &serde_json::Value) -> Result<()> {
    let format = json.get("format").and_then(|f| f.as_str());
    if format != Some(FORMAT_NAME) {
        return Err(GraphError::NotAGraphFile { found: format.map(str::to_string), expected: FORMAT_NAME });
    }
    match json.get("version") {
        Some(v) if v.as_u64() == Some(FORMAT_VERSION as u64) => Ok(()),
        other => Err(GraphError::UnsupportedVersion {
            found: other.map_or_else(|| "(missing)".to_string(), |v| v.to_string()),
            supported: FORMAT_VERSION,
        }),
    }
}

/// Node indices of `nodes` in an order where every node comes after the
/// producers of its inputs.
fn topological_order(nodes: &[NodeEntry], declared: &HashSet<ValueId>) -> Result<Vec<usize>> {
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    let mut node_ids = HashSet::new();
    for (i, node) in nodes.iter().enumerate() {
        if !node_ids.insert(node.id) {
            return Err(GraphError::DuplicateId { id: node.id.to_string() });
        }
        for &out in &node.outputs {
            if declared.contains(&out) || producer.insert(out, i).is_some() {
                return Err(GraphError::DuplicateId { id: out.to_string() });
            }
        }
    }
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    let mut pending = vec![0usize; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        for &input in &node.inputs {
            if let Some(&p) = producer.get(&input) {
                dependents[p].push(i);
                pending[i] += 1;
            } else if !declared.contains(&input) {
                return Err(GraphError::DanglingValue { place: format!("node {}", node.id), value: input });
            }
        }
    }
    let mut ready: Vec<usize> = (0..nodes.len()).rev().filter(|&i| pending[i] == 0).collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(i) = ready.pop() {
        order.push(i);
        for &d in dependents[i].iter().rev() {
            pending[d] -= 1;
            if pending[d] == 0 {
                ready.push(d);
            }
        }
    }
    if order.len() < nodes.len() {
        // Nodes left over lie on a cycle or downstream of one; peel off those
        // whose outputs no other leftover node reads, until only cycles remain.
        let mut on_cycle: Vec<bool> = pending.iter().map(|&p| p > 0).collect();
        loop {
            let downstream_only: Vec<usize> =
                (0..nodes.len()).filter(|&i| on_cycle[i] && !dependents[i].iter().any(|&d| on_cycle[d])).collect();
            if downstream_only.is_empty() {
                break;
            }
            for i in downstream_only {
                on_cycle[i] = false;
            }
        }
        let stuck: Vec<String> = (0..nodes.len()).filter(|&i| on_cycle[i]).map(|i| nodes[i].id.to_string()).collect();
        return Err(GraphError::Cycle(stuck.join(", ")));
    }
    Ok(order)
}

/// Parse graph-file JSON. Constants without a recipe take their data from
/// `weights` by name. Recipes may generate [`DEFAULT_MEMORY_LIMIT`] bytes
/// in all ([`graph_from_json_within`] sets another budget).
pub fn graph_from_json(text: &str, registry: &OpRegistry, weights: Option<&BTreeMap<String, Tensor>>) -> Result<Graph> {
    graph_from_json_within(text, registry, weights, DEFAULT_MEMORY_LIMIT)
}

/// [`graph_from_json`] whose `init` recipes may generate `recipe_budget`
/// bytes in all: the recipe that would take them past it is refused
/// ([`GraphError::RecipeBudget`]) before it generates anything.
pub fn graph_from_json_within(
    text: &str,
    registry: &OpRegistry,
    weights: Option<&BTreeMap<String, Tensor>>,
    recipe_budget: u64,
) -> Result<Graph> {
    parse_graph(text, registry, weights, &BTreeMap::new(), recipe_budget)
}

/// [`graph_from_json`] where the constants named in `prepared` take that
/// kernel-prepared data (a compiled artifact's) instead of plain weights.
pub fn graph_from_json_prepared(
    text: &str,
    registry: &OpRegistry,
    weights: Option<&BTreeMap<String, Tensor>>,
    prepared: &BTreeMap<String, kvjit_core::PreparedConstant>,
) -> Result<Graph> {
    parse_graph(text, registry, weights, prepared, DEFAULT_MEMORY_LIMIT)
}

fn parse_graph(
    text: &str,
    registry: &OpRegistry,
    weights: Option<&BTreeMap<String, Tensor>>,
    prepared: &BTreeMap<String, kvjit_core::PreparedConstant>,
    recipe_budget: u64,
) -> Result<Graph> {
    let json = kvjit_core::json::parse_strict(text.as_bytes())?;
    check_marker(&json)?;
    let file: GraphFile<serde_json::Value> = serde_json::from_value(json)?;
    // A recipe's fields are schema too: the registry reads them (which
    // recipe, unknown fields) before ids are checked.
    let inits = file
        .values
        .iter()
        .map(|value| match value {
            ValueEntry::Constant { init: Some(fields), .. } => registry.read_recipe(fields.clone()).map(Some),
            _ => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;

    // Names are printed in messages and listings: a control character (an
    // escape sequence, a NUL) from a crafted file would reach the terminal.
    let mut names = std::iter::once(file.name.as_str())
        .chain(file.values.iter().map(ValueEntry::name))
        .chain(file.outputs.iter().map(|o| o.name.as_str()));
    if let Some(bad) = names.find(|n| n.chars().any(char::is_control)) {
        let problem = format!("the name {bad:?} holds a control character");
        return Err(GraphError::Json(<serde_json::Error as serde::de::Error>::custom(problem)));
    }
    let mut declared = HashSet::new();
    for value in &file.values {
        if !declared.insert(value.id()) {
            return Err(GraphError::DuplicateId { id: value.id().to_string() });
        }
    }
    let order = topological_order(&file.nodes, &declared)?;

    let mut builder = GraphBuilder::new(&file.name, registry);
    let mut ids: HashMap<ValueId, ValueId> = HashMap::new();
    let mut recipe_bytes = 0u64;
    for (value, init) in file.values.iter().zip(inits) {
        let new_id = match (value, init) {
            (ValueEntry::Input { name, dtype, shape, .. }, _) => builder.input(name, *dtype, shape)?,
            (ValueEntry::Constant { name, dtype, shape, .. }, Some(init)) => {
                if weights.is_some_and(|w| w.contains_key(name)) {
                    return Err(GraphError::AmbiguousConstant { name: name.clone() });
                }
                // Sized by the recipe before it is generated; a size that
                // overflows is over any budget.
                let bytes = init.bytes(&crate::TensorType::new(*dtype, shape.iter().map(|&d| Dim::Static(d))));
                recipe_bytes = recipe_bytes.saturating_add(bytes);
                if recipe_bytes > recipe_budget {
                    return Err(GraphError::RecipeBudget {
                        name: name.clone(),
                        bytes,
                        total: recipe_bytes,
                        budget: recipe_budget,
                    });
                }
                builder.recipe_constant(name, *dtype, shape, init)?
            }
            (ValueEntry::Constant { name, dtype, shape, .. }, None) if prepared.contains_key(name) => {
                let ty = crate::TensorType::new(*dtype, shape.iter().map(|&d| Dim::Static(d)));
                builder.prepared_constant(name, ty, prepared[name].clone())?
            }
            (ValueEntry::Constant { name, dtype, shape, .. }, None) => {
                let data = weights.and_then(|w| w.get(name)).ok_or_else(|| {
                    GraphError::Tensor(kvjit_core::Error::MissingTensor {
                        name: name.clone(),
                        context: match weights {
                            Some(_) => " in the weights file".into(),
                            None => " (the graph file names no weights file)".into(),
                        },
                    })
                })?;
                if data.dtype() != *dtype || data.shape() != shape.as_slice() {
                    return Err(GraphError::ConstantMismatch {
                        name: name.clone(),
                        declared: format!("{dtype}{shape:?}"),
                        dtype: data.dtype(),
                        shape: data.shape().to_vec(),
                    });
                }
                builder.constant(name, data.clone())?
            }
            (
                ValueEntry::KvCache {
                    name,
                    dtype,
                    num_layers,
                    page_size,
                    num_kv_heads,
                    head_size,
                    scale_granularity,
                    num_pages,
                    batch,
                    max_pages_per_seq,
                    ..
                },
                _,
            ) => builder.kv_cache(
                name,
                KvCacheType {
                    dtype: *dtype,
                    num_layers: *num_layers,
                    page_size: *page_size,
                    num_kv_heads: *num_kv_heads,
                    head_size: *head_size,
                    scale_granularity: *scale_granularity,
                    num_pages: num_pages.clone(),
                    batch: batch.clone(),
                    max_pages_per_seq: max_pages_per_seq.clone(),
                },
            )?,
        };
        ids.insert(value.id(), new_id);
    }
    for i in order {
        let node = &file.nodes[i];
        let inputs: Vec<ValueId> = node.inputs.iter().map(|v| ids[v]).collect();
        let outputs = builder.node(&node.op, node.params.clone(), &inputs).map_err(|e| match e {
            GraphError::InNode { source, op, .. } => GraphError::InNode { node: node.id, op, source },
            other => other,
        })?;
        if outputs.len() != node.outputs.len() {
            return Err(GraphError::ArgCount {
                op: node.op.clone(),
                what: "outputs",
                expected: outputs.len(),
                got: node.outputs.len(),
            }
            .in_node(node.id, &node.op));
        }
        ids.extend(node.outputs.iter().copied().zip(outputs));
    }
    for out in &file.outputs {
        let value = *ids
            .get(&out.value)
            .ok_or(GraphError::DanglingValue { place: format!("output '{}'", out.name), value: out.value })?;
        builder.output(&out.name, value)?;
    }
    builder.finish()
}

/// Save a graph to `path` (JSON). Constants without a recipe go to a
/// safetensors file beside it, `path` with extension `.safetensors`.
pub fn save_graph(graph: &Graph, path: &Path) -> Result<()> {
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Err(GraphError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a graph file needs a name other than *.safetensors (its weights file takes that name)",
            ),
        });
    }
    if let Some((_, v)) = graph.constants().find(|(_, v)| matches!(v.def, ValueDef::Prepared { .. })) {
        return Err(GraphError::PreparedConstant(v.name.clone().unwrap_or_default()));
    }
    let stored: Vec<(&str, &Tensor)> = graph
        .constants()
        .filter_map(|(_, v)| match &v.def {
            ValueDef::Constant { data, init: None } => Some((v.name.as_deref().unwrap_or_default(), data.as_ref())),
            _ => None,
        })
        .collect();
    let weights_path = path.with_extension("safetensors");
    let weights_name = weights_path.file_name().and_then(|n| n.to_str()).map(str::to_string);
    if !stored.is_empty() {
        write_safetensors(&weights_path, stored)?;
    }
    let json = graph_to_json(graph, weights_name.as_deref().filter(|_| graph_needs_weights(graph)));
    std::fs::write(path, json).map_err(|source| GraphError::Io { path: path.to_path_buf(), source })
}

fn graph_needs_weights(graph: &Graph) -> bool {
    graph.constants().any(|(_, v)| matches!(v.def, ValueDef::Constant { init: None, .. }))
}

/// Load a graph file, and the weights file it names (safetensors, or GGUF
/// when the name ends in `.gguf`: constants are looked up by tensor name,
/// borrowed when stored in their declared dtype, otherwise converted or
/// dequantized into it); its `init` recipes
/// may generate [`DEFAULT_MEMORY_LIMIT`] bytes in all
/// ([`load_graph_within`] sets another budget).
///
/// The graph file may come from anywhere, so the weights path it names is
/// confined before anything is opened: it must be a relative path of plain
/// names (no root, no `..`), it must resolve — after symlinks — inside the
/// graph file's folder, and it must be a regular file (not a device or a
/// FIFO). Each refusal is a [`GraphError::WeightsPath`]. The weights are
/// memory-mapped ([`WeightLoad::Map`]); see [`load_graph_with`].
pub fn load_graph(path: &Path, registry: &OpRegistry) -> Result<Graph> {
    load_graph_with(path, registry, WeightLoad::Map)
}

/// [`load_graph`], loading the weights file as `weights` says: mapped
/// (zero-copy, the default) or copied into huge-page memory.
pub fn load_graph_with(path: &Path, registry: &OpRegistry, weights: WeightLoad) -> Result<Graph> {
    load_graph_within(path, registry, weights, DEFAULT_MEMORY_LIMIT)
}

/// [`load_graph_with`] whose `init` recipes may generate `recipe_budget`
/// bytes in all: the recipe that would take them past it is refused
/// ([`GraphError::RecipeBudget`]) before it generates anything.
pub fn load_graph_within(path: &Path, registry: &OpRegistry, weights: WeightLoad, recipe_budget: u64) -> Result<Graph> {
    let mode = weights;
    let io = |source| GraphError::Io { path: path.to_path_buf(), source };
    let bytes = kvjit_core::read_regular_file(path).map_err(|e| match e {
        kvjit_core::Error::Io { source, .. } => io(source),
        other => GraphError::Tensor(other),
    })?;
    let text = String::from_utf8(bytes)
        .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error())))?;
    let json = kvjit_core::json::parse_strict(text.as_bytes())?;
    check_marker(&json)?;
    let weights = match json.get("weights").and_then(|w| w.as_str()) {
        Some(name) if is_gguf_name(name) => {
            Some(load_gguf_constants(&json, &confined_weights_path(path, name)?, mode)?)
        }
        Some(name) => {
            let loaded = load_safetensors(&confined_weights_path(path, name)?, mode)?;
            tracing::debug!(
                mapped_bytes = loaded.mapped_bytes,
                copied_bytes = loaded.copied_bytes,
                "loaded weights file {name}"
            );
            Some(loaded.tensors)
        }
        None => None,
    };
    graph_from_json_within(&text, registry, weights.as_ref(), recipe_budget)
}

/// Whether a graph file's `weights` names a GGUF file (extension `.gguf`,
/// any case).
fn is_gguf_name(name: &str) -> bool {
    Path::new(name).extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The constants of graph-file `json` that the GGUF file at `path` holds,
/// each as its declared dtype: data stored in that dtype (F32, F16, BF16)
/// is borrowed from the mapping, anything else is converted or dequantized
/// ([`kvjit_gguf::Gguf::load_tensor`]). A tensor whose row-major shape
/// differs from the constant's is refused naming both; a constant with an
/// `init` recipe that the file also holds is ambiguous, as with
/// safetensors. Tensors no constant names are not read.
fn load_gguf_constants(json: &serde_json::Value, path: &Path, mode: WeightLoad) -> Result<BTreeMap<String, Tensor>> {
    let gguf = kvjit_gguf::Gguf::open_with(path, mode)?;
    let file: GraphFile<serde_json::Value> = serde_json::from_value(json.clone())?;
    let mismatch = |name: &str, what: String, dtype: DType, shape: &[usize]| {
        GraphError::Tensor(kvjit_core::Error::GgufTensor {
            path: path.into(),
            name: name.into(),
            problem: format!("it is {what}, but the graph's constant '{name}' is {dtype}{shape:?}").into(),
        })
    };
    let mut wanted = Vec::new();
    let mut fused = BTreeMap::new();
    for value in &file.values {
        let ValueEntry::Constant { name, dtype, shape, init, .. } = value else { continue };
        let Some(info) = gguf.tensor_info(name) else {
            if let Some(parts) = qkv_parts(&gguf, name) {
                if init.is_some() {
                    return Err(GraphError::AmbiguousConstant { name: name.clone() });
                }
                fused.insert(name.clone(), load_rows_of(&gguf, &parts, *dtype, shape, path)?);
            }
            continue;
        };
        if init.is_some() {
            return Err(GraphError::AmbiguousConstant { name: name.clone() });
        }
        if info.shape() != *shape {
            let what = format!("{}{:?} (GGUF dims {:?}, innermost first)", info.ggml_type(), info.shape(), info.ne());
            return Err(mismatch(name, what, *dtype, shape));
        }
        wanted.push((name.as_str(), *dtype));
    }
    let mut loaded = gguf.load_tensors(wanted)?;
    tracing::debug!(
        mapped_bytes = loaded.mapped_bytes,
        copied_bytes = loaded.copied_bytes,
        "loaded GGUF weights {}",
        path.display()
    );
    loaded.tensors.extend(fused);
    Ok(loaded.tensors)
}

/// A fused QKV weight the file stores in parts: llama.cpp names a fused
/// projection `blk.N.attn_qkv.weight`; a file without it but with
/// `blk.N.attn_q.weight`, `attn_k` and `attn_v` (every Llama converted by
/// llama.cpp) holds it as those three, stacked row-wise in that order.
fn qkv_parts(gguf: &kvjit_gguf::Gguf, name: &str) -> Option<[String; 3]> {
    let prefix = name.strip_suffix("attn_qkv.weight")?;
    let parts = ["attn_q", "attn_k", "attn_v"].map(|p| format!("{prefix}{p}.weight"));
    parts.iter().all(|p| gguf.tensor_info(p).is_some()).then_some(parts)
}

/// The `parts` (each `[rows_i, K]`) stacked row-wise into one `[Σ rows_i,
/// K]` tensor of `dtype`, refused naming the parts unless that is `shape`.
fn load_rows_of(
    gguf: &kvjit_gguf::Gguf,
    parts: &[String; 3],
    dtype: DType,
    shape: &[usize],
    path: &Path,
) -> Result<Tensor> {
    let shapes: Vec<Vec<usize>> =
        parts.iter().map(|p| gguf.tensor_info(p).expect("qkv_parts checked every part").shape()).collect();
    let rows: usize = shapes.iter().map(|s| s.first().copied().unwrap_or(0)).sum();
    let stacked = shapes.iter().all(|s| s.len() == 2 && s[1] == shape.get(1).copied().unwrap_or(usize::MAX));
    if !stacked || [rows, shapes[0][1]] != *shape {
        return Err(GraphError::Tensor(kvjit_core::Error::GgufTensor {
            path: path.into(),
            name: parts.join(" + ").into(),
            problem: format!("parts of shapes {shapes:?} do not stack into the constant's {dtype}{shape:?}").into(),
        }));
    }
    let tensors = parts.iter().map(|p| gguf.tensor(p, dtype)).collect::<kvjit_core::Result<Vec<Tensor>>>()?;
    Ok(Tensor::anonymous(dtype, shape, |out| {
        let mut at = 0;
        for t in &tensors {
            let bytes = t.as_bytes();
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        }
    })?)
}

/// A graph from graph-file text whose constants come from the GGUF file at
/// `gguf` (named by the caller, so not confined to a folder: the CLI's
/// `kvjit generate MODEL.gguf` builds its graph in memory), loaded as
/// [`load_graph_with`] loads a graph file's GGUF weights.
pub fn graph_from_json_with_gguf(text: &str, registry: &OpRegistry, gguf: &Path, mode: WeightLoad) -> Result<Graph> {
    let json = kvjit_core::json::parse_strict(text.as_bytes())?;
    check_marker(&json)?;
    let weights = load_gguf_constants(&json, gguf, mode)?;
    graph_from_json(text, registry, Some(&weights))
}

/// The weights file `name` of the graph file at `graph`, checked to be a
/// relative path inside the graph file's folder (after symlinks) that names
/// a regular file.
pub fn confined_weights_path(graph: &Path, name: &str) -> Result<PathBuf> {
    let refuse = |problem: &str| GraphError::WeightsPath { name: name.to_string(), problem: problem.to_string() };
    let relative = Path::new(name);
    if name.is_empty() || !relative.components().all(|c| matches!(c, std::path::Component::Normal(_))) {
        return Err(refuse("must be a relative path of plain names inside the graph file's folder (no root, no '..')"));
    }
    let folder = graph.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let io = |source| GraphError::Tensor(kvjit_core::Error::Io { path: folder.join(relative), source });
    let folder = folder.canonicalize().map_err(|source| GraphError::Io { path: folder.to_path_buf(), source })?;
    let resolved = folder.join(relative).canonicalize().map_err(io)?;
    if !resolved.starts_with(&folder) {
        return Err(refuse(&format!(
            "resolves to {}, outside the graph file's folder {}",
            resolved.display(),
            folder.display()
        )));
    }
    if !std::fs::metadata(&resolved).map_err(io)?.is_file() {
        return Err(refuse("is not a regular file"));
    }
    Ok(resolved)
}
