//! The graph itself: a table of values and a list of nodes in topological
//! order.
//!
//! Values and nodes are stored in `Vec`s indexed by their handles; a node may
//! only read values defined before it, so the node list is always a valid
//! execution order and cycles cannot be represented (files are sorted, and
//! cycles reported, when they are loaded).

use std::sync::Arc;

use kvjit_core::Tensor;

use crate::{ConstantInit, NodeId, Params, ValueId, ValueType};

/// How a value comes to be.
#[derive(Clone, Debug)]
pub enum ValueDef {
    /// Supplied by the caller at run time.
    Input,
    /// Fixed data baked into the graph.
    Constant {
        /// The data.
        data: Arc<Tensor>,
        /// How the data was generated, if it was (saved instead of the data).
        init: Option<ConstantInit>,
    },
    /// A constant whose data a kernel prepared in its own layout (a weight
    /// in packed panels, from a compiled artifact). The value's type is
    /// the constant's logical type; only kernels that take this layout can
    /// consume it, and it cannot be saved to a graph file.
    Prepared {
        /// The data, in the kernel's layout.
        data: kvjit_core::PreparedConstant,
    },
    /// A paged KV cache supplied by the caller and written in place.
    KvCache,
    /// Output `index` of a node.
    NodeOutput {
        /// The producing node.
        node: NodeId,
        /// Which of its outputs.
        index: usize,
    },
}

impl ValueDef {
    /// Whether the value is a graph constant (plain or prepared data).
    pub fn is_constant(&self) -> bool {
        matches!(self, ValueDef::Constant { .. } | ValueDef::Prepared { .. })
    }
}

/// A value: its type, how it is defined, and a name for inputs, constants and
/// caches.
#[derive(Clone, Debug)]
pub struct Value {
    /// Name (inputs, constants, caches); node outputs have none.
    pub name: Option<String>,
    /// Type.
    pub ty: ValueType,
    /// Definition.
    pub def: ValueDef,
}

/// An op applied to values.
#[derive(Clone, Debug)]
pub struct Node {
    /// This node's handle.
    pub id: NodeId,
    /// Canonical op name.
    pub op: String,
    /// Op parameters.
    pub params: Params,
    /// Input values, in the op's signature order.
    pub inputs: Vec<ValueId>,
    /// Output values.
    pub outputs: Vec<ValueId>,
}

/// A named graph output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphOutput {
    /// Name callers fetch it by.
    pub name: String,
    /// The value.
    pub value: ValueId,
}

/// An op graph. Build one with [`GraphBuilder`](crate::GraphBuilder) or load
/// one with [`load_graph`](crate::load_graph); either way it has passed
/// [`validate`](crate::validate).
#[derive(Clone, Debug)]
pub struct Graph {
    pub(crate) name: String,
    pub(crate) values: Vec<Value>,
    pub(crate) nodes: Vec<Node>,
    pub(crate) outputs: Vec<GraphOutput>,
}

impl Graph {
    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Every value, indexed by [`ValueId`].
    pub fn values(&self) -> &[Value] {
        &self.values
    }

    /// One value.
    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.index()]
    }

    /// Nodes in execution order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Named outputs.
    pub fn outputs(&self) -> &[GraphOutput] {
        &self.outputs
    }

    /// Values with handles, filtered to graph inputs.
    pub fn inputs(&self) -> impl Iterator<Item = (ValueId, &Value)> {
        self.enumerate().filter(|(_, v)| matches!(v.def, ValueDef::Input))
    }

    /// Values with handles, filtered to KV caches.
    pub fn kv_caches(&self) -> impl Iterator<Item = (ValueId, &Value)> {
        self.enumerate().filter(|(_, v)| matches!(v.def, ValueDef::KvCache))
    }

    /// Values with handles, filtered to constants.
    pub fn constants(&self) -> impl Iterator<Item = (ValueId, &Value)> {
        self.enumerate().filter(|(_, v)| matches!(v.def, ValueDef::Constant { .. } | ValueDef::Prepared { .. }))
    }

    fn enumerate(&self) -> impl Iterator<Item = (ValueId, &Value)> {
        self.values.iter().enumerate().map(|(i, v)| (ValueId(i as u32), v))
    }

    /// Symbols used anywhere in the graph's types, sorted.
    pub fn symbols(&self) -> Vec<String> {
        let mut symbols: Vec<String> = self
            .values
            .iter()
            .flat_map(|v| v.ty.clone().dims_mut().into_iter().map(|d| d.clone()).collect::<Vec<_>>())
            .filter_map(|d| match d {
                crate::Dim::Symbolic(s) => Some(s),
                crate::Dim::Static(_) => None,
            })
            .collect();
        symbols.sort();
        symbols.dedup();
        symbols
    }
}
