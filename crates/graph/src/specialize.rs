//! Specialization: bind symbolic dims, re-validate, and give every node its
//! [`KernelKey`].
//!
//! Specializing never mutates the caller's graph: it returns a new graph with
//! the bound symbols replaced by numbers, validated again, so a binding that
//! contradicts the graph is caught here rather than by a kernel.

use std::collections::BTreeMap;

use kvjit_core::{Backend, KernelKey, Target};

use crate::{Dim, Graph, GraphError, OpRegistry, Result, validate};

/// A graph whose nodes carry kernel keys for one backend.
#[derive(Clone, Debug)]
pub struct SpecializedGraph {
    graph: Graph,
    backend: Backend,
    kernel_keys: Vec<KernelKey>,
}

impl SpecializedGraph {
    /// The graph with bound symbols replaced by their sizes.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The target every node was specialized for.
    pub fn target(&self) -> Target {
        self.backend.target()
    }

    /// The backend (target and CPU code tier) every node was specialized for.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// One kernel key per node, in node order.
    pub fn kernel_keys(&self) -> &[KernelKey] {
        &self.kernel_keys
    }
}

/// Specialize `graph` for `backend`, binding the symbols in `bindings` (the
/// rest stay symbolic and their kernels take those dims at run time). Every
/// node's key holds its op's typed spec, and names the CPU code tier where
/// the op's code depends on it.
pub fn specialize(
    graph: &Graph,
    registry: &OpRegistry,
    backend: Backend,
    bindings: &BTreeMap<String, usize>,
) -> Result<SpecializedGraph> {
    let symbols = graph.symbols();
    for (symbol, &size) in bindings {
        if !symbols.contains(symbol) {
            return Err(GraphError::Binding {
                symbol: symbol.clone(),
                problem: format!("is not a symbol of this graph (its symbols: {})", symbols.join(", ")),
            });
        }
        if size == 0 {
            return Err(GraphError::Binding { symbol: symbol.clone(), problem: "must be bound to at least 1".into() });
        }
    }
    let mut bound = graph.clone();
    for value in &mut bound.values {
        for dim in value.ty.dims_mut() {
            if let Dim::Symbolic(s) = dim
                && let Some(&size) = bindings.get(s.as_str())
            {
                *dim = Dim::Static(size);
            }
        }
    }
    // Dims in node parameters (a reshape's target shape) name the same
    // symbols: bind them alike, or the node would refer to a symbol its
    // bound inputs no longer carry.
    for node in &mut bound.nodes {
        for value in node.params.values_mut() {
            if let crate::ParamValue::Dims(dims) = value {
                for dim in dims {
                    if let Dim::Symbolic(s) = dim
                        && let Some(&size) = bindings.get(s.as_str())
                    {
                        *dim = Dim::Static(size);
                    }
                }
            }
        }
    }
    validate(&bound, registry)?;
    let kernel_keys = bound
        .nodes
        .iter()
        .map(|node| {
            let op = registry.get(&node.op)?;
            let inputs: Vec<_> = node.inputs.iter().map(|&v| &bound.value(v).ty).collect();
            let key = op.kernel_key(&node.params, &inputs, backend).map_err(|e| e.in_node(node.id, &node.op))?;
            op.supports(&key).map_err(|reason| {
                GraphError::Unsupported(format!(
                    "no {} kernel for op {} with key {key}: {reason}",
                    backend.target(),
                    op.name()
                ))
                .in_node(node.id, &node.op)
            })?;
            Ok(key)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(SpecializedGraph { graph: bound, backend, kernel_keys })
}
