//! The compile step: `Graph` → `SpecializedGraph` → `Executable`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvjit_core::{Target, Tensor};
use kvjit_graph::{ArgKind, Dim, Graph, ValueDef, ValueId, specialize};
use kvjit_runtime::{BuildOptions, CacheSpec, Executable, InputSpec, ShapeDim, Slot, Step, cuda_availability};

use crate::{Registry, Result};

/// How to compile a graph.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// The target every node runs on.
    pub target: Target,
    /// Symbols to bind to sizes now (the rest stay symbolic: their kernels
    /// take those dims at run time).
    pub bindings: BTreeMap<String, usize>,
    /// Which kernels to build and what to keep of their code.
    pub build: BuildOptions,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self { target: Target::Cpu, bindings: BTreeMap::new(), build: BuildOptions::default() }
    }
}

fn shape_dim(dim: &Dim) -> ShapeDim {
    match dim {
        Dim::Static(v) => ShapeDim::Static(*v),
        Dim::Symbolic(s) => ShapeDim::Symbol(s.clone()),
    }
}

/// Compile `graph`: check the target is available, specialize every node
/// (bind symbols, re-validate, derive kernel keys; unsupported combinations
/// are refused here), then build each node's kernel and lay out the calls.
pub fn compile(graph: &Graph, registry: &Registry, options: &CompileOptions) -> Result<Executable> {
    if options.target == Target::Cuda {
        cuda_availability()?;
    }
    let specialized = specialize(graph, registry.ops(), options.target, &options.bindings)?;
    let graph = specialized.graph();

    let mut slots: HashMap<ValueId, Slot> = HashMap::new();
    let mut inputs = Vec::new();
    for (id, value) in graph.inputs() {
        let ty = value.ty.as_tensor().expect("graph inputs are tensors");
        slots.insert(id, Slot::Input(inputs.len()));
        inputs.push(InputSpec {
            name: value.name.clone().unwrap_or_default(),
            dtype: ty.dtype,
            shape: ty.shape.iter().map(shape_dim).collect(),
        });
    }
    let mut constants: Vec<Arc<Tensor>> = Vec::new();
    for (id, value) in graph.constants() {
        if let ValueDef::Constant { data, .. } = &value.def {
            slots.insert(id, Slot::Constant(constants.len()));
            constants.push(data.clone());
        }
    }
    let mut cache_index: HashMap<ValueId, usize> = HashMap::new();
    let mut caches = Vec::new();
    for (id, value) in graph.kv_caches() {
        let ty = value.ty.as_kv_cache().expect("cache values are caches");
        cache_index.insert(id, caches.len());
        caches.push(CacheSpec {
            name: value.name.clone().unwrap_or_default(),
            params: ty.params(),
            num_pages: shape_dim(&ty.num_pages),
            batch: shape_dim(&ty.batch),
            max_pages_per_seq: shape_dim(&ty.max_pages_per_seq),
        });
    }

    let mut steps = Vec::with_capacity(graph.nodes().len());
    for (node, key) in graph.nodes().iter().zip(specialized.kernel_keys()) {
        let op = registry.ops().get(&node.op)?;
        let mut tensor_slots = Vec::new();
        let mut tensor_constants = Vec::new();
        let mut cache_args = Vec::new();
        for (spec, &value) in op.inputs().iter().zip(&node.inputs) {
            match spec.kind {
                ArgKind::Tensor => {
                    tensor_slots.push(slots[&value]);
                    tensor_constants.push(match &graph.value(value).def {
                        ValueDef::Constant { data, .. } => Some(data.clone()),
                        _ => None,
                    });
                }
                ArgKind::KvCache => cache_args.push(cache_index[&value]),
            }
        }
        let kernel = registry.kernel_builder(op.name())?.build(key, &tensor_constants, &options.build)?;
        for (output, &value) in node.outputs.iter().enumerate() {
            slots.insert(value, Slot::StepOutput { step: steps.len(), output });
        }
        steps.push(Step { label: node.id.to_string(), kernel, inputs: tensor_slots, caches: cache_args });
    }
    let outputs = graph.outputs().iter().map(|o| (o.name.clone(), slots[&o.value])).collect();
    Ok(Executable::new(inputs, caches, constants, steps, outputs)?)
}
