//! Building graphs in Rust, with shapes inferred and checked as each node is
//! added.

use std::sync::Arc;

use kvjit_core::{DType, Tensor};

use crate::validate::check_op;
use crate::{
    ConstantInit, Dim, Graph, GraphError, GraphOutput, KvCacheType, Node, NodeId, OpRegistry, Params, RandomInit,
    Result, TensorType, Value, ValueDef, ValueId, ValueType, validate,
};

/// Values per scale of an `f8e4m3` cache whose type names none (as MAX's
/// `quantization_granularity` default).
pub const DEFAULT_SCALE_GRANULARITY: usize = 128;

/// Builds a [`Graph`] step by step. Every call checks what it adds, so a
/// mistake is reported at the line that made it.
///
/// ```
/// use kvjit_graph::{Dim, GraphBuilder, OpRegistry};
/// use kvjit_core::DType;
///
/// let registry = OpRegistry::new();
/// let mut b = GraphBuilder::new("empty", &registry);
/// let x = b.input("x", DType::F32, &[Dim::from("batch"), Dim::from(8)]).unwrap();
/// assert_eq!(x.to_string(), "v0");
/// assert!(b.input("x", DType::F32, &[]).is_err()); // names are unique
/// ```
pub struct GraphBuilder<'r> {
    registry: &'r OpRegistry,
    graph: Graph,
    /// Recipe constants are declared without computing their data
    /// ([`GraphBuilder::for_graph_file`]).
    deferred_recipes: bool,
    /// The values' names so far (a scan of the values per name made
    /// loading a file of 80,000 values take 23 s).
    names: std::collections::HashSet<String>,
}

impl<'r> GraphBuilder<'r> {
    /// Start an empty graph whose nodes may use the ops in `registry`.
    pub fn new(name: &str, registry: &'r OpRegistry) -> Self {
        Self {
            registry,
            graph: Graph { name: name.to_string(), values: Vec::new(), nodes: Vec::new(), outputs: Vec::new() },
            deferred_recipes: false,
            names: std::collections::HashSet::new(),
        }
    }

    /// Start an empty graph to be written as a graph file
    /// ([`GraphBuilder::finish_to_json`]), never run: recipe constants are
    /// declared without computing their data (a graph file keeps the
    /// recipe, so a model's hundred million random weights are not drawn
    /// only to be dropped). [`GraphBuilder::finish`] refuses such a graph.
    pub fn for_graph_file(name: &str, registry: &'r OpRegistry) -> Self {
        Self { deferred_recipes: true, ..Self::new(name, registry) }
    }

    fn add_value(&mut self, name: Option<&str>, ty: ValueType, def: ValueDef) -> Result<ValueId> {
        if let Some(name) = name
            && !self.names.insert(name.to_string())
        {
            return Err(GraphError::DuplicateName(name.to_string()));
        }
        let id = ValueId(self.graph.values.len() as u32);
        self.graph.values.push(Value { name: name.map(str::to_string), ty, def });
        Ok(id)
    }

    /// A tensor the caller supplies at run time; dims may be symbolic.
    pub fn input(&mut self, name: &str, dtype: DType, shape: &[Dim]) -> Result<ValueId> {
        let ty = ValueType::Tensor(TensorType::new(dtype, shape.iter().cloned()));
        self.add_value(Some(name), ty, ValueDef::Input)
    }

    /// A constant tensor (a weight) baked into the graph.
    pub fn constant(&mut self, name: &str, data: Tensor) -> Result<ValueId> {
        let data = data.to_contiguous();
        let ty = ValueType::Tensor(TensorType::new(data.dtype(), data.shape().iter().map(|&d| Dim::Static(d))));
        self.add_value(Some(name), ty, ValueDef::Constant { data: Arc::new(data), init: None })
    }

    /// A constant with deterministic random contents; graph files save the
    /// recipe instead of the data.
    pub fn random_constant(&mut self, name: &str, dtype: DType, shape: &[usize], init: RandomInit) -> Result<ValueId> {
        self.recipe_constant(name, dtype, shape, init.into())
    }

    /// A constant made by a recipe (random values, an op's table) the
    /// registry knows ([`OpRegistry::recipes`]); graph files save the
    /// recipe instead of the data.
    pub fn recipe_constant(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        init: ConstantInit,
    ) -> Result<ValueId> {
        let known = self.registry.recipes();
        if !known.iter().any(|k| k.name() == init.name()) {
            return Err(GraphError::UnknownRecipe {
                name: init.name(),
                known: known.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
            });
        }
        let ty = TensorType::new(dtype, shape.iter().map(|&d| Dim::Static(d)));
        // Deferred: zeros of the type (untouched zero pages) hold the place;
        // the graph is only ever written, which saves the recipe.
        let data = match self.deferred_recipes {
            true => Tensor::zeros(dtype, shape)?,
            false => init.materialize(&ty)?,
        };
        self.add_value(Some(name), ValueType::Tensor(ty), ValueDef::Constant { data: Arc::new(data), init: Some(init) })
    }

    /// A constant of type `ty` whose data a kernel prepared in its own
    /// layout (see [`ValueDef::Prepared`]).
    pub fn prepared_constant(
        &mut self,
        name: &str,
        ty: TensorType,
        data: kvjit_core::PreparedConstant,
    ) -> Result<ValueId> {
        self.add_value(Some(name), ValueType::Tensor(ty), ValueDef::Prepared { data })
    }

    /// A paged KV cache the caller supplies at run time and nodes write in
    /// place. An `f8e4m3` cache without a `scale_granularity` gets
    /// [`DEFAULT_SCALE_GRANULARITY`].
    pub fn kv_cache(&mut self, name: &str, mut ty: KvCacheType) -> Result<ValueId> {
        if ty.dtype.is_quantized() && ty.scale_granularity.is_none() {
            ty.scale_granularity = Some(DEFAULT_SCALE_GRANULARITY);
        }
        if !ty.dtype.is_float() {
            return Err(GraphError::InputType {
                arg: name.to_string(),
                expected: "a KV cache of f32, bf16, f16 or f8e4m3".into(),
                got: ty.to_string(),
            });
        }
        for (what, v) in [
            ("num_layers", ty.num_layers),
            ("page_size", ty.page_size),
            ("num_kv_heads", ty.num_kv_heads),
            ("head_size", ty.head_size),
        ] {
            if v == 0 {
                return Err(GraphError::Param {
                    param: what.into(),
                    problem: format!("of KV cache '{name}' must be at least 1"),
                });
            }
        }
        // A cache of no pages, or whose sequences may hold none, can never
        // take a token (given as static sizes; bound sizes are checked when
        // the cache is made).
        for (what, dim) in [("num_pages", &ty.num_pages), ("max_pages_per_seq", &ty.max_pages_per_seq)] {
            if dim.as_static() == Some(0) {
                return Err(GraphError::Param {
                    param: what.into(),
                    problem: format!("of KV cache '{name}' must be at least 1"),
                });
            }
        }
        // A sequence's page table row cannot name more pages than there
        // are (a row of 2³² entries once made `generate` fill 17 GB).
        if let (Some(pages), Some(per_seq)) = (ty.num_pages.as_static(), ty.max_pages_per_seq.as_static())
            && per_seq > pages
        {
            return Err(GraphError::Param {
                param: "max_pages_per_seq".into(),
                problem: format!("of KV cache '{name}' is {per_seq}, more than its {pages} pages"),
            });
        }
        // Layer indices are u32 inputs of the paged ops.
        if u32::try_from(ty.num_layers).is_err() {
            return Err(GraphError::Param {
                param: "num_layers".into(),
                problem: format!("of KV cache '{name}' must be at most {}, got {}", u32::MAX, ty.num_layers),
            });
        }
        if let Err(e) = ty.element().and_then(|_| ty.params().validate()) {
            return Err(GraphError::Param {
                param: "scale_granularity".into(),
                problem: format!("of KV cache '{name}': {e}"),
            });
        }
        self.add_value(Some(name), ValueType::KvCache(ty), ValueDef::KvCache)
    }

    /// Apply an op (by name or alias) to `inputs`; returns its outputs.
    /// Parameters and input types are checked and output types inferred now.
    pub fn node(&mut self, op: &str, params: Params, inputs: &[ValueId]) -> Result<Vec<ValueId>> {
        let node_id = NodeId(self.graph.nodes.len() as u32);
        let types = inputs
            .iter()
            .map(|&v| {
                self.graph
                    .values
                    .get(v.index())
                    .map(|value| &value.ty)
                    .ok_or(GraphError::DanglingValue { place: format!("node {node_id}"), value: v })
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.in_node(node_id, op))?;
        let constants: Vec<bool> = inputs
            .iter()
            .map(|&v| self.graph.values.get(v.index()).is_some_and(|value| value.def.is_constant()))
            .collect();
        let (def, output_types) =
            check_op(self.registry, op, &params, &types, &constants).map_err(|e| e.in_node(node_id, op))?;
        let outputs = output_types
            .into_iter()
            .enumerate()
            .map(|(index, ty)| {
                self.add_value(None, ValueType::Tensor(ty), ValueDef::NodeOutput { node: node_id, index })
            })
            .collect::<Result<Vec<_>>>()?;
        self.graph.nodes.push(Node {
            id: node_id,
            op: def.name().to_string(),
            params,
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
        });
        Ok(outputs)
    }

    /// Expose a tensor value as a named graph output.
    pub fn output(&mut self, name: &str, value: ValueId) -> Result<()> {
        if self.graph.outputs.iter().any(|o| o.name == name) {
            return Err(GraphError::DuplicateName(name.to_string()));
        }
        let ty = &self
            .graph
            .values
            .get(value.index())
            .ok_or(GraphError::DanglingValue { place: format!("output '{name}'"), value })?
            .ty;
        if ty.as_tensor().is_none() {
            return Err(GraphError::ArgKind { arg: format!("output '{name}'"), expected: "tensor" });
        }
        self.graph.outputs.push(GraphOutput { name: name.to_string(), value });
        Ok(())
    }

    /// Finish the graph, running the full validator once more. A builder
    /// made [`for_graph_file`](GraphBuilder::for_graph_file) is refused
    /// ([`GraphError::DeferredRecipes`]): its recipe constants hold no data.
    pub fn finish(self) -> Result<Graph> {
        if self.deferred_recipes {
            return Err(GraphError::DeferredRecipes { graph: self.graph.name });
        }
        validate(&self.graph, self.registry)?;
        Ok(self.graph)
    }

    /// Finish the graph and write it as a graph file's JSON (no weights
    /// file: every constant is a recipe or is named for the caller's
    /// weights), running the full validator once more.
    pub fn finish_to_json(self) -> Result<String> {
        validate(&self.graph, self.registry)?;
        Ok(crate::graph_to_json(&self.graph, None))
    }
}
