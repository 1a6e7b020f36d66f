//! Graph rewriting for compilers: replace groups of nodes by one node that
//! computes the same value ([`Graph::fuse_nodes`]), the new graph
//! validated like any other.

use std::collections::{HashMap, HashSet};

use crate::{Graph, GraphError, GraphOutput, Node, NodeId, OpRegistry, Params, Result, ValueDef, ValueId, validate};

/// A group of nodes replaced by one: the new node takes the place of the
/// last absorbed node in execution order and defines `output` (an output
/// of one absorbed node); every other output of the absorbed nodes must be
/// read by absorbed nodes only, and disappears.
#[derive(Clone, Debug)]
pub struct NodeFusion {
    /// The nodes replaced.
    pub absorbed: Vec<NodeId>,
    /// The new node's op (canonical name).
    pub op: String,
    /// Its parameters.
    pub params: Params,
    /// Its inputs, values of the original graph defined before the last
    /// absorbed node.
    pub inputs: Vec<ValueId>,
    /// The value it defines, with the type it had.
    pub output: ValueId,
}

impl Graph {
    /// The graph with each fusion's nodes replaced by its node, validated
    /// against `registry` (so a fused node whose op infers another type
    /// than the value it replaces is refused), and for each node of the new
    /// graph the nodes of this one it stands for (one, or the absorbed
    /// ones in order).
    pub fn fuse_nodes(&self, registry: &OpRegistry, fusions: &[NodeFusion]) -> Result<(Graph, Vec<Vec<NodeId>>)> {
        let mut fusion_of: HashMap<NodeId, usize> = HashMap::new();
        for (f, fusion) in fusions.iter().enumerate() {
            for &node in &fusion.absorbed {
                if fusion_of.insert(node, f).is_some() {
                    return Err(GraphError::DuplicateId { id: node.to_string() });
                }
            }
        }
        let anchor = |fusion: &NodeFusion| fusion.absorbed.iter().max().copied();
        // The values that disappear: outputs of absorbed nodes other than
        // the fused node's own, which nothing outside the fusion may read.
        let mut dropped: HashSet<ValueId> = HashSet::new();
        for fusion in fusions {
            for &node in &fusion.absorbed {
                dropped.extend(self.nodes[node.index()].outputs.iter().filter(|&&v| v != fusion.output));
            }
        }
        let describe = |fusion: &NodeFusion| {
            fusion.absorbed.iter().map(|n| format!("{n} ({})", self.nodes[n.index()].op)).collect::<Vec<_>>().join(", ")
        };
        for node in &self.nodes {
            let own = fusion_of.get(&node.id).map(|&f| &fusions[f]);
            for &input in &node.inputs {
                if dropped.contains(&input) && own.is_none_or(|f| !self.defined_by(input, &f.absorbed)) {
                    let fusion = fusions.iter().find(|f| self.defined_by(input, &f.absorbed)).expect("dropped");
                    let reader = format!("node {} ({})", node.id, node.op);
                    return Err(GraphError::FusionDropsValue { nodes: describe(fusion), value: input, reader });
                }
            }
        }
        for fusion in fusions {
            if let Some(&input) = fusion.inputs.iter().find(|v| dropped.contains(v)) {
                let reader = format!("the fused {}", fusion.op);
                return Err(GraphError::FusionDropsValue { nodes: describe(fusion), value: input, reader });
            }
        }
        if let Some(out) = self.outputs.iter().find(|o| dropped.contains(&o.value)) {
            let fusion = fusions.iter().find(|f| self.defined_by(out.value, &f.absorbed)).expect("dropped");
            let reader = format!("graph output '{}'", out.name);
            return Err(GraphError::FusionDropsValue { nodes: describe(fusion), value: out.value, reader });
        }

        let mut value_map: Vec<Option<ValueId>> = vec![None; self.values.len()];
        let mut values = Vec::with_capacity(self.values.len() - dropped.len());
        for (i, value) in self.values.iter().enumerate() {
            if !dropped.contains(&ValueId(i as u32)) {
                value_map[i] = Some(ValueId(values.len() as u32));
                values.push(value.clone());
            }
        }
        let map = |v: ValueId| value_map[v.index()].expect("kept values are mapped");
        let mut nodes: Vec<Node> = Vec::with_capacity(self.nodes.len());
        let mut origins = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let new = match fusion_of.get(&node.id).map(|&f| &fusions[f]) {
                Some(fusion) if anchor(fusion) == Some(node.id) => {
                    let mut absorbed = fusion.absorbed.clone();
                    absorbed.sort();
                    origins.push(absorbed);
                    Node {
                        id: NodeId(nodes.len() as u32),
                        op: fusion.op.clone(),
                        params: fusion.params.clone(),
                        inputs: fusion.inputs.iter().map(|&v| map(v)).collect(),
                        outputs: vec![map(fusion.output)],
                    }
                }
                Some(_) => continue,
                None => {
                    origins.push(vec![node.id]);
                    Node {
                        id: NodeId(nodes.len() as u32),
                        op: node.op.clone(),
                        params: node.params.clone(),
                        inputs: node.inputs.iter().map(|&v| map(v)).collect(),
                        outputs: node.outputs.iter().map(|&v| map(v)).collect(),
                    }
                }
            };
            for (index, &out) in new.outputs.iter().enumerate() {
                values[out.index()].def = ValueDef::NodeOutput { node: new.id, index };
            }
            nodes.push(new);
        }
        let outputs = self.outputs.iter().map(|o| GraphOutput { name: o.name.clone(), value: map(o.value) }).collect();
        let graph = Graph { name: self.name.clone(), values, nodes, outputs };
        validate(&graph, registry)?;
        Ok((graph, origins))
    }

    /// Whether `value` is an output of one of `nodes`.
    fn defined_by(&self, value: ValueId, nodes: &[NodeId]) -> bool {
        matches!(self.values[value.index()].def, ValueDef::NodeOutput { node, .. } if nodes.contains(&node))
    }
}
