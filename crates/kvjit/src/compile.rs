//! The compile step: `Graph` → `SpecializedGraph` → `Executable`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvjit_core::{Backend, KvCacheParams, Target, Tensor};
use kvjit_graph::{ArgKind, Dim, Graph, ValueDef, ValueId, specialize};
use kvjit_runtime::{
    BuildOptions, CacheSpec, ConstantInput, Executable, InputSpec, ShapeDim, Slot, Step, cuda_availability,
};
use rayon::prelude::*;

use crate::fuse::FusedGraph;
use crate::{Error, Registry, Result};

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
    /// Refuse graphs whose buffers (see [`MemoryEstimate`]) need more bytes
    /// than this, before anything is allocated for them.
    pub memory_budget: Option<u64>,
    /// Fuse matmul epilogues and SwiGLU siblings ([`fuse`](crate::fuse::fuse)).
    pub fuse: bool,
}

impl CompileOptions {
    /// The backend kernels are specialized and built for: the target and,
    /// on the CPU, the code tier `build.cpu_tier` resolves to on this
    /// machine (`auto`: the widest it runs; a tier it cannot run is
    /// refused). Resolved here, once: every kernel key then names the tier
    /// its code was made for.
    pub fn backend(&self) -> Result<Backend> {
        Ok(match self.target {
            Target::Cpu => Backend::Cpu(kvjit_jit::microkernel::resolve_tier(self.build.cpu_tier)?),
            Target::Cuda => Backend::Cuda,
        })
    }
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            target: Target::Cpu,
            bindings: BTreeMap::new(),
            build: BuildOptions::default(),
            memory_budget: None,
            fuse: true,
        }
    }
}

/// The bytes a compiled graph's buffers take, as far as build time knows:
/// constants (and the packed copies JIT kernels keep of them), node outputs
/// (but not views) and the KV caches it declares (every buffer of each, an
/// FP8 cache's scales included: [`KvCacheParams::cache_bytes`]). Dims left symbolic
/// count as unknown and are named in `unknown`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Constant data, plus packed copies.
    pub constants: u64,
    /// Node outputs of static shape.
    pub outputs: u64,
    /// KV caches of static size: blocks, FP8 scales and page tables.
    pub caches: u64,
    /// Values whose size depends on symbols left unbound.
    pub unknown: Vec<String>,
}

impl MemoryEstimate {
    /// Everything known, in bytes.
    pub fn total(&self) -> u64 {
        self.constants.saturating_add(self.outputs).saturating_add(self.caches)
    }

    /// Estimate for a (specialized) graph built for `target` with `build`:
    /// constants once, plus once more for each node whose fast CPU kernel
    /// keeps a packed copy of it ([`OpDef::packed_constant_inputs`](kvjit_graph::OpDef::packed_constant_inputs)); outputs
    /// of view ops (a reshape) share their input's storage and count nothing.
    pub fn of(graph: &Graph, registry: &Registry, target: Target, build: &BuildOptions) -> Self {
        let packs = target == Target::Cpu && build.implementation == kvjit_runtime::KernelImpl::Fast;
        let bytes = |dims: &[Dim], elem: usize| -> Option<u64> {
            dims.iter().try_fold(elem as u64, |acc, d| d.as_static().and_then(|v| acc.checked_mul(v as u64)))
        };
        let op_of = |node: kvjit_graph::NodeId| registry.ops().get(&graph.nodes()[node.index()].op).ok();
        let mut packed_copies: HashMap<ValueId, u64> = HashMap::new();
        for node in graph.nodes().iter().filter(|_| packs) {
            let Ok(op) = registry.ops().get(&node.op) else { continue };
            for &input in op.packed_constant_inputs() {
                if let Some(&value) = node.inputs.get(input) {
                    *packed_copies.entry(value).or_default() += 1;
                }
            }
        }
        let mut estimate = MemoryEstimate::default();
        for (id, value) in graph.values().iter().enumerate() {
            let name = value.name.clone().unwrap_or_else(|| format!("v{id}"));
            match (&value.def, &value.ty) {
                (ValueDef::Constant { data, .. }, _) => {
                    let size = (data.numel() * data.dtype().size_bytes()) as u64;
                    let copies = 1 + packed_copies.get(&ValueId(id as u32)).copied().unwrap_or(0);
                    estimate.constants = estimate.constants.saturating_add(size.saturating_mul(copies));
                }
                (ValueDef::Prepared { data }, _) => {
                    estimate.constants = estimate.constants.saturating_add(data.data.as_bytes().len() as u64);
                }
                (ValueDef::NodeOutput { node, .. }, _) if op_of(*node).is_some_and(|op| op.is_view()) => {}
                (ValueDef::NodeOutput { .. }, kvjit_graph::ValueType::Tensor(t)) => {
                    match bytes(&t.shape, t.dtype.size_bytes()) {
                        Some(b) => estimate.outputs = estimate.outputs.saturating_add(b),
                        None => estimate.unknown.push(name),
                    }
                }
                (ValueDef::KvCache, kvjit_graph::ValueType::KvCache(c)) => {
                    // What `PagedKVCacheCollection::new` allocates: blocks,
                    // an FP8 cache's scales and the page order per page,
                    // the page table per sequence. A size that overflows
                    // counts as u64::MAX (no budget fits it).
                    match c.num_pages.as_static() {
                        Some(pages) => {
                            let bytes = c.params().page_bytes(pages).unwrap_or(u64::MAX);
                            estimate.caches = estimate.caches.saturating_add(bytes);
                        }
                        None => estimate.unknown.push(name.clone()),
                    }
                    match (c.batch.as_static(), c.max_pages_per_seq.as_static()) {
                        (Some(batch), Some(max_pages)) => {
                            let bytes = KvCacheParams::table_bytes(batch, max_pages).unwrap_or(u64::MAX);
                            estimate.caches = estimate.caches.saturating_add(bytes);
                        }
                        _ => estimate.unknown.push(format!("{name}.lookup_table")),
                    }
                }
                _ => {}
            }
        }
        estimate
    }
}

fn shape_dim(dim: &Dim) -> ShapeDim {
    match dim {
        Dim::Static(v) => ShapeDim::Static(*v),
        Dim::Symbolic(s) => ShapeDim::Symbol(s.clone()),
    }
}

/// The graph `compile` builds kernels for: `graph` fused
/// ([`fuse`](crate::fuse::fuse)) unless `options.fuse` is off.
pub fn compiled_graph(graph: &Graph, registry: &Registry, options: &CompileOptions) -> Result<FusedGraph> {
    match options.fuse {
        true => crate::fuse::fuse(graph, registry),
        false => Ok(FusedGraph::unfused(graph)),
    }
}

/// Compile `graph`: check the target is available, fuse what it can
/// ([`compiled_graph`]), specialize every node (bind symbols, re-validate,
/// derive kernel keys; unsupported combinations are refused here), then
/// build each node's kernel and lay out the calls. A fused kernel's step
/// is labelled with the nodes it absorbed (`n7+n8`).
pub fn compile(graph: &Graph, registry: &Registry, options: &CompileOptions) -> Result<Executable> {
    if options.target == Target::Cuda {
        cuda_availability()?;
    }
    let fused = compiled_graph(graph, registry, options)?;
    let specialized = specialize(&fused.graph, registry.ops(), options.backend()?, &options.bindings)?;
    let graph = specialized.graph();
    if let Some(budget) = options.memory_budget {
        let estimate = MemoryEstimate::of(graph, registry, options.target, &options.build);
        if estimate.total() > budget {
            return Err(Error::MemoryBudget { needed: estimate.total(), budget, estimate });
        }
    }

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
        let data = match &value.def {
            ValueDef::Constant { data, .. } => data.clone(),
            ValueDef::Prepared { data } => data.data.clone(),
            _ => continue,
        };
        slots.insert(id, Slot::Constant(constants.len()));
        constants.push(data);
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

    // Kernels are built in parallel (JIT compiles and weight packing are
    // independent per node; one key is compiled once however many nodes
    // share it), then laid out in node order.
    struct NodePlan {
        op: Arc<dyn kvjit_graph::OpDef>,
        tensor_constants: Vec<Option<ConstantInput>>,
        cache_args: Vec<usize>,
    }
    let mut plans = Vec::with_capacity(graph.nodes().len());
    for node in graph.nodes() {
        let op = registry.ops().get(&node.op)?.clone();
        let mut plan = NodePlan { op, tensor_constants: Vec::new(), cache_args: Vec::new() };
        for (spec, &value) in plan.op.inputs().iter().zip(&node.inputs) {
            match spec.kind {
                ArgKind::Tensor => {
                    plan.tensor_constants.push(match &graph.value(value).def {
                        ValueDef::Constant { data, .. } => Some(ConstantInput::Plain(data.clone())),
                        ValueDef::Prepared { data } => Some(ConstantInput::Prepared(data.clone())),
                        _ => None,
                    });
                }
                ArgKind::KvCache => plan.cache_args.push(cache_index[&value]),
            }
        }
        plans.push(plan);
    }
    let keys = specialized.kernel_keys();
    let kernels: Vec<Result<Arc<dyn kvjit_runtime::Kernel>>> = plans
        .par_iter()
        .zip(keys.par_iter())
        .map(|(plan, key)| {
            let kernel = registry.kernel_builder(plan.op.name())?.build(key, &plan.tensor_constants, &options.build)?;
            Ok(kernel)
        })
        .collect();

    let mut steps = Vec::with_capacity(graph.nodes().len());
    for (i, ((node, plan), kernel)) in graph.nodes().iter().zip(plans).zip(kernels).enumerate() {
        let kernel = kernel?;
        refuse_untaken_prepared(graph, node, &plan.tensor_constants, kernel.as_ref())?;
        let tensor_slots = plan
            .op
            .inputs()
            .iter()
            .zip(&node.inputs)
            .filter(|(spec, _)| spec.kind == ArgKind::Tensor)
            .map(|(_, value)| slots[value])
            .collect();
        for (output, &value) in node.outputs.iter().enumerate() {
            slots.insert(value, Slot::StepOutput { step: steps.len(), output });
        }
        steps.push(Step { label: fused.label(i), kernel, inputs: tensor_slots, caches: plan.cache_args });
    }
    let outputs = graph.outputs().iter().map(|o| (o.name.clone(), slots[&o.value])).collect();
    Ok(Executable::new(inputs, caches, constants, steps, outputs)?)
}

/// A prepared constant (from an artifact) may only go to a kernel that
/// takes it in that very layout; anything else is refused, never run.
fn refuse_untaken_prepared(
    graph: &Graph,
    node: &kvjit_graph::Node,
    constants: &[Option<ConstantInput>],
    kernel: &dyn kvjit_runtime::Kernel,
) -> Result<()> {
    let taken = kernel.prepared_constants();
    let tensor_inputs = node.inputs.iter().filter(|v| graph.value(**v).ty.as_tensor().is_some());
    for ((input, constant), &value) in constants.iter().enumerate().zip(tensor_inputs) {
        let Some(ConstantInput::Prepared(prepared)) = constant else { continue };
        if !taken.iter().any(|(i, p)| *i == input && p.layout == prepared.layout) {
            return Err(Error::PreparedNotTaken {
                constant: graph.value(value).name.clone().unwrap_or_default(),
                layout: prepared.layout.clone(),
                key: kernel.key().to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kvjit_core::{DType, PagedKVCacheCollection};
    use kvjit_graph::{GraphBuilder, KvCacheType};

    use super::*;

    /// The bytes a cache's buffers really take: blocks, an FP8 cache's
    /// scales, the lookup table, the cache lengths and the page allocation
    /// order (one u32 per page).
    fn allocated_bytes(cache: &PagedKVCacheCollection) -> u64 {
        let scales = cache.scales().map_or(0, |s| s.as_bytes().len());
        let tables = 4 * (cache.lookup_table().len() + cache.cache_lengths().len() + cache.num_pages());
        (cache.blocks().as_bytes().len() + scales + tables) as u64
    }

    #[test]
    fn the_estimate_counts_a_cache_as_the_bytes_its_buffers_take_fp8_scales_included() {
        let registry = crate::standard_registry();
        let cases =
            [(DType::F8E4M3, Some(1)), (DType::F8E4M3, Some(4)), (DType::F8E4M3, Some(128)), (DType::BF16, None)];
        for (dtype, scale_granularity) in cases {
            let ty = KvCacheType {
                dtype,
                num_layers: 2,
                page_size: 4,
                num_kv_heads: 2,
                head_size: 128,
                scale_granularity,
                num_pages: Dim::Static(6),
                batch: Dim::Static(3),
                max_pages_per_seq: Dim::Static(5),
            };
            let mut b = GraphBuilder::new("cache_only", registry.ops());
            b.kv_cache("kv", ty.clone()).unwrap();
            let graph = b.finish().unwrap();
            let estimate = MemoryEstimate::of(&graph, &registry, Target::Cpu, &BuildOptions::default());
            let cache = PagedKVCacheCollection::new(ty.params(), 6, 3, 5).unwrap();
            assert_eq!(estimate.caches, allocated_bytes(&cache), "{dtype} cache, g = {scale_granularity:?}");
            assert!(estimate.unknown.is_empty());
        }
    }
}
