//! Seeded, valid example inputs for any graph of registered ops: what
//! `kvjit run` feeds a graph file that comes without `--inputs`, and what
//! the tests, benches and fuzz targets run graphs on.
//!
//! [`Scenario`] makes inputs and KV caches for any graph of registered
//! ops — the ops' signatures ([`ArgRole`]) say which inputs are layer
//! indices and valid lengths, so a new op gets scenarios for free:
//! sequences with different cache and valid lengths, pages handed out
//! in a shuffled order (scattered page tables, as a long-running server has),
//! a cache pre-filled with random history, and decode steps that grow it.
//! Token ids (the u32 `ids` of a `mo.gather`) are random rows of its table.
//! The graphs themselves come from files or from the builders in
//! [`models`](crate::models).

use std::collections::{BTreeMap, BTreeSet};

use kvjit_core::{DType, PagedKVCacheCollection, Tensor};
use kvjit_graph::{ArgRole, Dim, Graph, OpRegistry, ValueDef, ValueId};
use kvjit_op::Op;
use kvjit_op_gather::GatherOp;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

/// Random K and V for every slot of the cached history (every layer, both
/// K and V), written through the page table; slots no sequence holds stay
/// zero. An FP8 cache gets random values quantized per block, with their
/// scales. A fast generator seeded from the scenario's keeps large caches
/// cheap.
fn fill_history(cache: &mut PagedKVCacheCollection, history: &[u32], rng: &mut StdRng) -> Result<()> {
    let params = *cache.params();
    let quantized = params.dtype().is_quantized();
    let drawn = if quantized { DType::F32 } else { params.dtype() };
    let elem = params.dtype().size_bytes();
    let row_bytes = params.kv_dim() * elem;
    let rows = history.iter().map(|&h| h as usize).sum::<usize>() * 2 * params.num_layers;
    let mut fast = rand::rngs::SmallRng::seed_from_u64(rng.r#gen());
    let values = Tensor::random(drawn, &[rows * params.kv_dim()], &mut fast, -1.0, 1.0)?;
    let mut offsets = Vec::with_capacity(rows);
    for (b, &h) in history.iter().enumerate() {
        for position in 0..h as usize {
            let (page, slot) = cache.locate(b, position)?;
            for kv in 0..2 {
                for layer in 0..params.num_layers {
                    offsets.push(cache.element_offset(page as usize, kv, layer, slot, 0, 0));
                }
            }
        }
    }
    let (blocks, scales) = cache.blocks_and_scales_mut();
    match (quantized, scales, params.scale_granularity()) {
        (true, Some(scales), Some(g)) => {
            let values = values.as_slice::<f32>()?;
            for (offset, row) in offsets.into_iter().zip(values.chunks_exact(params.kv_dim())) {
                let codes = blocks[offset..offset + params.kv_dim()].chunks_exact_mut(g);
                for ((codes, block), scale) in codes.zip(row.chunks_exact(g)).zip(&mut scales[offset / g..]) {
                    *scale = kvjit_core::fp8::quantize_block(block, codes);
                }
            }
        }
        _ => {
            for (offset, row) in offsets.into_iter().zip(values.as_bytes().chunks_exact(row_bytes)) {
                blocks[offset * elem..offset * elem + row_bytes].copy_from_slice(row);
            }
        }
    }
    Ok(())
}

/// What each graph input and cache is to the nodes that use it, read from
/// the ops' signatures ([`ArgRole`]), so any registered op gets valid example
/// inputs.
#[derive(Clone, Debug, Default)]
pub(crate) struct Roles {
    /// Padded activations `[B, S, …]`: the first data input of each node
    /// that takes valid lengths, and every graph input whose leading two
    /// dims are that input's B and S (a hidden state normalized before the
    /// node, token ids embedded before it).
    pub(crate) hidden: BTreeSet<String>,
    /// Token ids: u32 inputs read as a `mo.gather`'s `ids`, with the rows
    /// of its table (the fewest, where several gathers read one input).
    pub(crate) token_ids: BTreeMap<String, usize>,
    pub(crate) valid_lengths: BTreeSet<String>,
    /// layer_idx input → the layer it selects (order of first use modulo L).
    pub(crate) layer_idx: BTreeMap<String, u32>,
    /// cache → the valid_lengths input of the first node writing it.
    pub(crate) cache_lengths_from: BTreeMap<String, String>,
}

impl Roles {
    pub(crate) fn of(graph: &Graph, ops: &OpRegistry) -> Result<Self> {
        let mut roles = Roles::default();
        let input_name = |v: ValueId| match graph.value(v).def {
            ValueDef::Input => graph.value(v).name.clone(),
            _ => None,
        };
        // The [B, S] leading dims of every node taking valid lengths.
        let mut step_dims: Vec<(Dim, Dim)> = Vec::new();
        for node in graph.nodes() {
            let op = ops.get(&node.op)?;
            let with_role = |role: ArgRole| {
                op.inputs().iter().zip(&node.inputs).filter(move |(spec, _)| spec.role == role).map(|(_, &v)| v)
            };
            if node.op == GatherOp::NAME
                && let [table, ids] = node.inputs[..]
                && let Some(name) = input_name(ids)
                && let Some(vocab) = graph.value(table).ty.as_tensor().and_then(|t| t.shape.first()?.as_static())
                && vocab > 0
            {
                let rows = roles.token_ids.entry(name).or_insert(vocab);
                *rows = (*rows).min(vocab);
            }
            let cache = with_role(ArgRole::Cache).next();
            let num_layers = cache.and_then(|c| graph.value(c).ty.as_kv_cache()).map_or(1, |c| c.num_layers);
            for layer in with_role(ArgRole::LayerIndex).filter_map(input_name) {
                // num_layers ≤ u32::MAX (a cache's params are validated).
                let next = roles.layer_idx.len() % num_layers.max(1);
                roles.layer_idx.entry(layer).or_insert(next as u32);
            }
            let Some(valid) = with_role(ArgRole::ValidLengths).find_map(input_name) else { continue };
            if let Some(data) = with_role(ArgRole::Data).next() {
                if let Some([batch, seq, ..]) = graph.value(data).ty.as_tensor().map(|t| t.shape.as_slice()) {
                    step_dims.push((batch.clone(), seq.clone()));
                }
                roles.hidden.extend(input_name(data));
            }
            if let Some(cache) = cache.and_then(|c| graph.value(c).name.clone()) {
                roles.cache_lengths_from.entry(cache).or_insert_with(|| valid.clone());
            }
            roles.valid_lengths.insert(valid);
        }
        for (_, value) in graph.inputs() {
            if let (Some(name), Some([batch, seq, ..])) =
                (&value.name, value.ty.as_tensor().map(|t| t.shape.as_slice()))
                && step_dims.contains(&(batch.clone(), seq.clone()))
            {
                roles.hidden.insert(name.clone());
            }
        }
        if roles.hidden.is_empty() {
            return Err(Error::Usage(format!(
                "graph '{}' has no node taking valid lengths whose inputs are graph inputs; give its inputs with --inputs",
                graph.name()
            )));
        }
        Ok(roles)
    }
}

/// Seeded, valid inputs and caches for any graph of registered ops (the
/// ops' signatures say which inputs are layer indices and valid lengths),
/// stepped through a prefill and any number of decode steps.
pub struct Scenario {
    /// Graph inputs by name, for the current step.
    pub inputs: BTreeMap<String, Tensor>,
    /// KV caches by name.
    pub caches: BTreeMap<String, PagedKVCacheCollection>,
    graph: Graph,
    roles: Roles,
    rng: StdRng,
}

fn dim_size(dim: &Dim, bindings: &BTreeMap<String, usize>) -> Result<usize> {
    match dim {
        Dim::Static(v) => Ok(*v),
        Dim::Symbolic(s) => bindings
            .get(s)
            .copied()
            .ok_or_else(|| Error::Usage(format!("no size for symbol '{s}': the example scenario binds batch and seq"))),
    }
}

impl Scenario {
    /// A prefill step of 4 sequences padded to 8 tokens (where the graph
    /// leaves batch and seq symbolic).
    pub fn prefill(graph: &Graph, seed: u64) -> Result<Self> {
        Self::prefill_with(graph, seed, 4, 8)
    }

    /// A prefill step with `batch` sequences padded to `seq` tokens: the first
    /// sequence fills all `seq`, the others a random 1..=seq; each sequence
    /// starts with a random amount of cached history. The caches the
    /// graph's `kv_cache` declarations ask for may take
    /// [`DEFAULT_MEMORY_LIMIT`](kvjit_graph::DEFAULT_MEMORY_LIMIT) bytes
    /// ([`prefill_within`](Self::prefill_within) sets another budget).
    pub fn prefill_with(graph: &Graph, seed: u64, batch: usize, seq: usize) -> Result<Self> {
        Self::prefill_within(graph, seed, batch, seq, kvjit_graph::DEFAULT_MEMORY_LIMIT)
    }

    /// [`prefill_with`](Self::prefill_with) whose KV caches and inputs may
    /// take `memory_budget` bytes in all (every buffer of each cache:
    /// [`KvCacheParams::cache_bytes`](kvjit_core::KvCacheParams::cache_bytes));
    /// over it, or with a first sequence of `seq` tokens no cache can hold,
    /// it is refused, as [`Error::Usage`], before anything is allocated.
    pub fn prefill_within(graph: &Graph, seed: u64, batch: usize, seq: usize, memory_budget: u64) -> Result<Self> {
        if batch == 0 || seq == 0 {
            return Err(Error::Usage(format!(
                "the example scenario needs batch and seq of at least 1, got {batch} and {seq}"
            )));
        }
        let roles = Roles::of(graph, crate::standard_registry().ops())?;
        let mut rng = StdRng::seed_from_u64(seed);
        let bindings: BTreeMap<String, usize> = [("batch".to_string(), batch), ("seq".to_string(), seq)].into();
        // Every cache's size, checked against the budget before any is made.
        let mut sizes = Vec::new();
        let mut needed = 0u64;
        for (_, value) in graph.kv_caches() {
            let name = value.name.clone().unwrap_or_default();
            let ty = value.ty.as_kv_cache().expect("cache values are caches");
            let num_pages = dim_size(&ty.num_pages, &bindings)?;
            let batch = dim_size(&ty.batch, &bindings)?;
            let max_pages_per_seq = dim_size(&ty.max_pages_per_seq, &bindings)?;
            let bytes = ty.params().cache_bytes(num_pages, batch, max_pages_per_seq).unwrap_or(u64::MAX);
            needed = needed.saturating_add(bytes);
            if needed > memory_budget {
                return Err(Error::Usage(format!(
                    "the example scenario's KV caches need {needed} bytes (cache '{name}': {bytes} bytes), more than the memory budget of {memory_budget} bytes"
                )));
            }
            // The prefill writes seq tokens to its first sequence (the others
            // a random 1..=seq): refused here, before anything is made, when
            // the cache cannot hold that one (whether the others fit too
            // depends on the lengths drawn, checked when pages are reserved).
            let pages_first = seq.div_ceil(ty.page_size.max(1));
            if pages_first > max_pages_per_seq.min(num_pages) {
                return Err(Error::Usage(format!(
                    "the example scenario's prefill of {seq} tokens takes {pages_first} pages of {}, \
                     but cache '{name}' holds {max_pages_per_seq} a sequence and {num_pages} in all",
                    ty.page_size
                )));
            }
            sizes.push((name, ty, [num_pages, batch, max_pages_per_seq]));
        }
        // And the inputs (a hidden state of batch × seq rows), before any is made.
        for (_, value) in graph.inputs() {
            let Some(ty) = value.ty.as_tensor() else { continue };
            let shape = ty.shape.iter().map(|d| dim_size(d, &bindings)).collect::<Result<Vec<_>>>()?;
            let bytes = Tensor::storage_bytes(ty.dtype, &shape).map_or(u64::MAX, |b| b as u64);
            needed = needed.saturating_add(bytes);
            if needed > memory_budget {
                return Err(Error::Usage(format!(
                    "the example scenario's KV caches and inputs need {needed} bytes (input '{}': {bytes} bytes), more than the memory budget of {memory_budget} bytes",
                    value.name.as_deref().unwrap_or("?")
                )));
            }
        }
        let mut caches = BTreeMap::new();
        for (name, ty, [num_pages, batch, max_pages_per_seq]) in sizes {
            let mut cache = PagedKVCacheCollection::new(ty.params(), num_pages, batch, max_pages_per_seq)?;
            let mut order: Vec<u32> = (0..cache.num_pages() as u32).collect();
            order.shuffle(&mut rng);
            cache.set_allocation_order(order)?;
            let capacity = cache.max_pages_per_seq() * ty.page_size;
            let budget = (cache.num_pages() * ty.page_size / batch.max(1)).min(capacity);
            let max_history = budget.saturating_sub(seq + 2 * ty.page_size);
            let history: Vec<u32> = (0..batch).map(|_| rng.gen_range(0..=max_history) as u32).collect();
            cache.reserve(&history)?;
            fill_history(&mut cache, &history, &mut rng)?;
            cache.advance(&history)?;
            caches.insert(name, cache);
        }
        let mut scenario = Self { inputs: BTreeMap::new(), caches, graph: graph.clone(), roles, rng };
        scenario.make_inputs(&bindings, |rng, b| if b == 0 { seq as u32 } else { rng.gen_range(1..=seq as u32) })?;
        Ok(scenario)
    }

    /// A scenario that starts from given tensors: graph inputs by name and
    /// each cache as `<cache>.blocks`, `.cache_lengths`, `.lookup_table`
    /// (as [`PagedKVCacheCollection::to_tensors`] writes them). Pages are not
    /// reserved: the tensors say where tokens go.
    pub fn from_tensors(graph: &Graph, mut tensors: BTreeMap<String, Tensor>, seed: u64) -> Result<Self> {
        let mut caches = BTreeMap::new();
        for (_, value) in graph.kv_caches() {
            let name = value.name.clone().unwrap_or_default();
            let cache = PagedKVCacheCollection::from_tensors(&name, &mut tensors).map_err(|e| match e {
                kvjit_core::Error::MissingTensor { name, .. } => {
                    kvjit_core::Error::MissingTensor { name, context: " in the inputs file".into() }
                }
                other => other,
            })?;
            caches.insert(name, cache);
        }
        let roles = Roles::of(graph, crate::standard_registry().ops()).unwrap_or_default();
        Ok(Self { inputs: tensors, caches, graph: graph.clone(), roles, rng: StdRng::seed_from_u64(seed) })
    }

    /// The current step's valid lengths (of the first valid_lengths input).
    pub fn valid_lengths(&self) -> Option<Vec<u32>> {
        let name = self.roles.valid_lengths.iter().next()?;
        self.inputs.get(name)?.to_u32_vec().ok()
    }

    /// Tokens the current step writes to each cache (sum of valid lengths).
    pub fn tokens_this_step(&self) -> usize {
        self.roles
            .valid_lengths
            .iter()
            .filter_map(|name| self.inputs.get(name))
            .filter_map(|t| t.to_u32_vec().ok())
            .map(|v| v.iter().map(|&x| x as usize).sum::<usize>())
            .max()
            .unwrap_or(0)
    }

    /// After a step ran: advance every cache by the step's valid lengths.
    pub fn advance(&mut self) -> Result<()> {
        for (cache, valid) in &self.roles.cache_lengths_from {
            let lengths = self
                .inputs
                .get(valid)
                .ok_or_else(|| Error::Usage(format!("input '{valid}' is missing")))?
                .to_u32_vec()?;
            if let Some(c) = self.caches.get_mut(cache) {
                c.advance(&lengths)?;
            }
        }
        Ok(())
    }

    /// Whether [`Scenario::next_decode_step`] can make steps: the graph has
    /// a hidden-state input to size them by (a graph run from given inputs
    /// may have none).
    pub fn check_decode_steps(&self) -> Result<()> {
        match self.roles.hidden.is_empty() {
            false => Ok(()),
            true => Err(Error::Usage(format!(
                "graph '{}' has no hidden-state input (the data input of a node that takes valid lengths), \
                 so no decode step can follow the given inputs: run it with --steps 0",
                self.graph.name()
            ))),
        }
    }

    /// Make the next decode step: one new token per sequence (or, where the
    /// graph fixes seq, a random number of valid tokens), pages reserved.
    pub fn next_decode_step(&mut self) -> Result<()> {
        self.check_decode_steps()?;
        let hidden_name = self.roles.hidden.iter().next().expect("checked just above").clone();
        let (_, hidden_value) = self
            .graph
            .inputs()
            .find(|(_, v)| v.name.as_deref() == Some(hidden_name.as_str()))
            .expect("hidden is an input");
        let hidden_ty = hidden_value.ty.as_tensor().expect("hidden is a tensor").clone();
        let batch = self.inputs[&hidden_name].shape()[0];
        let seq = hidden_ty.shape[1].as_static().unwrap_or(1);
        let mut bindings = BTreeMap::new();
        for (dim, size) in hidden_ty.shape.iter().zip([batch, seq]) {
            if let Dim::Symbolic(s) = dim {
                bindings.insert(s.clone(), size);
            }
        }
        self.make_inputs(&bindings, |rng, _| if seq == 1 { 1 } else { rng.gen_range(1..=seq as u32) })
    }

    /// Fill every graph input for one step and reserve the pages it writes.
    fn make_inputs(
        &mut self,
        bindings: &BTreeMap<String, usize>,
        valid: impl Fn(&mut StdRng, usize) -> u32,
    ) -> Result<()> {
        let mut inputs = BTreeMap::new();
        let mut valid_values: Option<Vec<u32>> = None;
        for (_, value) in self.graph.inputs() {
            let name = value.name.clone().unwrap_or_default();
            let ty = value.ty.as_tensor().expect("graph inputs are tensors");
            let shape = ty.shape.iter().map(|d| dim_size(d, bindings)).collect::<Result<Vec<_>>>()?;
            let tensor = if self.roles.valid_lengths.contains(&name) {
                let values = valid_values
                    .get_or_insert_with(|| (0..shape[0]).map(|b| valid(&mut self.rng, b)).collect())
                    .clone();
                Tensor::from_vec(&shape, values)?
            } else if let Some(&layer) = self.roles.layer_idx.get(&name) {
                Tensor::from_vec(&shape, vec![layer; shape.iter().product()])?
            } else if let Some(&vocab) = self.roles.token_ids.get(&name) {
                let ids = (0..shape.iter().product()).map(|_| self.rng.gen_range(0..vocab as u32)).collect();
                Tensor::from_vec(&shape, ids)?
            } else if ty.dtype.is_float() {
                Tensor::random(ty.dtype, &shape, &mut self.rng, -1.0, 1.0)?
            } else {
                return Err(Error::Usage(format!(
                    "cannot make up a value for u32 input '{name}'; give it with --inputs"
                )));
            };
            inputs.insert(name, tensor);
        }
        for (cache, valid_name) in &self.roles.cache_lengths_from {
            let lengths = inputs[valid_name].to_u32_vec()?;
            if let Some(c) = self.caches.get_mut(cache) {
                c.reserve(&lengths)?;
            }
        }
        self.inputs = inputs;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvjit_graph::{GraphBuilder, RandomInit};

    use super::*;
    use crate::{CompileOptions, DeviceContextPtr, Executor, compile, standard_registry};

    const WIDTH: usize = 8;

    /// `ids` → `mo.gather` of a `[vocab, 8]` table → `kvjit.last_valid_token`:
    /// a graph whose only padded input is token ids.
    fn embedding_graph(vocab: usize) -> Graph {
        let registry = standard_registry();
        let mut b = GraphBuilder::new("embedding", registry.ops());
        let (batch, seq) = (Dim::from("batch"), Dim::from("seq"));
        let ids = b.input("ids", DType::U32, &[batch.clone(), seq]).unwrap();
        let valid = b.input("valid_lengths", DType::U32, &[batch]).unwrap();
        let table = b
            .random_constant("table", DType::F32, &[vocab, WIDTH], RandomInit { seed: 4, low: -1.0, high: 1.0 })
            .unwrap();
        let rows = crate::ops::gather(&mut b, table, ids).unwrap();
        let last = crate::ops::last_valid_token(&mut b, rows, valid).unwrap();
        b.output("last", last).unwrap();
        b.finish().unwrap()
    }

    /// Run the scenario's step; check each sequence's output is the table
    /// row of its last valid id.
    fn run_and_check(graph: &Graph, scenario: &mut Scenario) {
        let registry = standard_registry();
        let exe = compile(graph, &registry, &CompileOptions::default()).unwrap();
        let executor = Executor::new(DeviceContextPtr::cpu(1).unwrap());
        let out = executor.run(&exe, &scenario.inputs, &mut scenario.caches).unwrap();
        let table = match &graph.constants().next().unwrap().1.def {
            ValueDef::Constant { data, .. } => data.to_f32_vec().unwrap(),
            _ => unreachable!("the table is a plain constant"),
        };
        let ids = scenario.inputs["ids"].to_u32_vec().unwrap();
        let seq = scenario.inputs["ids"].shape()[1];
        let got = out.outputs["last"].to_f32_vec().unwrap();
        for (b, &valid) in scenario.valid_lengths().unwrap().iter().enumerate() {
            let id = ids[b * seq + valid as usize - 1] as usize;
            assert_eq!(got[b * WIDTH..][..WIDTH], table[id * WIDTH..][..WIDTH], "sequence {b}");
        }
    }

    #[test]
    fn token_ids_are_seeded_rows_of_the_gathers_table_and_the_graph_runs_on_them() {
        let graph = embedding_graph(5);
        let mut scenario = Scenario::prefill_with(&graph, 3, 4, 16).unwrap();
        let ids = scenario.inputs["ids"].to_u32_vec().unwrap();
        assert_eq!(scenario.inputs["ids"].shape(), [4, 16]);
        assert!(ids.iter().all(|&id| id < 5), "{ids:?}");
        assert!((0..5).all(|id| ids.contains(&id)), "64 draws cover 5 ids: {ids:?}");
        assert_eq!(Scenario::prefill_with(&graph, 3, 4, 16).unwrap().inputs["ids"].to_u32_vec().unwrap(), ids);
        assert_ne!(Scenario::prefill_with(&graph, 4, 4, 16).unwrap().inputs["ids"].to_u32_vec().unwrap(), ids);
        run_and_check(&graph, &mut scenario);
        // A decode step draws one fresh id per sequence.
        scenario.advance().unwrap();
        scenario.next_decode_step().unwrap();
        assert_eq!(scenario.inputs["ids"].shape(), [4, 1]);
        run_and_check(&graph, &mut scenario);
    }

    #[test]
    fn a_u32_input_no_gather_reads_as_ids_is_still_refused() {
        let registry = standard_registry();
        let mut b = GraphBuilder::new("ids_unused", registry.ops());
        let (batch, seq) = (Dim::from("batch"), Dim::from("seq"));
        let x = b.input("x", DType::F32, &[batch.clone(), seq.clone(), Dim::from(WIDTH)]).unwrap();
        b.input("other_ids", DType::U32, &[batch.clone(), seq]).unwrap();
        let valid = b.input("valid_lengths", DType::U32, &[batch]).unwrap();
        let last = crate::ops::last_valid_token(&mut b, x, valid).unwrap();
        b.output("last", last).unwrap();
        let graph = b.finish().unwrap();
        let message = Scenario::prefill(&graph, 1).err().expect("refused").to_string();
        assert!(message.contains("cannot make up a value for u32 input 'other_ids'"), "{message}");
    }
}
