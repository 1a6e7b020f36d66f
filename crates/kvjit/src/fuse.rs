//! The compiler's fusion pass: what a user would otherwise pay memory
//! traffic for, computed while a GEMM's tile is in registers.
//!
//! - **Siblings** (SwiGLU): `mo.mul(mo.silu(mo.matmul(x, gate)), mo.matmul(x,
//!   up))` — two matmuls of one input with constant weights of one type,
//!   each read only by the SwiGLU — becomes one `kvjit.swiglu_matmul`: one
//!   GEMM over both weights (their panels side by side), `silu(g)·u` in
//!   the epilogue. Neither product nor the SiLU is ever written.
//! - **Epilogues**: a `mo.matmul` whose result is read only by one
//!   elementwise node computes it in its epilogue: `mo.add` of another
//!   tensor (a residual) or `mo.mul` by one → `kvjit.matmul_epilogue`
//!   (`add`, `mul`); `mo.silu` → `kvjit.matmul_silu`, or, when the SiLU is
//!   itself read only by a `mo.mul`, `kvjit.matmul_epilogue` (`silu_mul`).
//!
//! A value that is a graph output, or is read by anything else, is never
//! fused away. RMSNorm is not fused into the next GEMM's activation
//! packing (see the README's layer benchmark for what it costs). The pass
//! runs at [`compile`](crate::compile) (graph
//! files keep the unfused ops); `CompileOptions::fuse = false` (the CLI's
//! `--no-fuse`) turns it off.

use std::collections::{HashMap, HashSet};

use kvjit_graph::{Graph, Node, NodeFusion, NodeId, ValueDef, ValueId};
use kvjit_op::{Op, OpParams};
use kvjit_op_matmul::{
    BinaryEpilogue, EpilogueParams, MatmulEpilogueOp, MatmulOp, MatmulParams, MatmulSiluOp, SwigluMatmulOp,
};

use crate::{Registry, Result};

/// A graph after fusion, and what each of its nodes stands for.
#[derive(Clone, Debug)]
pub struct FusedGraph {
    /// The graph with fused nodes.
    pub graph: Graph,
    /// For each node of `graph`, the nodes of the original graph it
    /// computes (one, or every node a fused kernel absorbed).
    pub origins: Vec<Vec<NodeId>>,
}

impl FusedGraph {
    /// The graph as it is, nothing fused.
    pub fn unfused(graph: &Graph) -> Self {
        Self { graph: graph.clone(), origins: graph.nodes().iter().map(|n| vec![n.id]).collect() }
    }

    /// A step label for node `i`: its original id (`n7`), or the ids it
    /// absorbed joined by `+` (`n7+n8`).
    pub fn label(&self, i: usize) -> String {
        self.origins[i].iter().map(|n| n.to_string()).collect::<Vec<_>>().join("+")
    }

    /// The fused nodes: (node of `graph`, the original nodes it absorbed).
    pub fn fused(&self) -> impl Iterator<Item = (&Node, &[NodeId])> {
        self.graph.nodes().iter().zip(&self.origins).filter(|(_, o)| o.len() > 1).map(|(n, o)| (n, o.as_slice()))
    }
}

const SILU: &str = "mo.silu";
const ADD: &str = "mo.add";
const MUL: &str = "mo.mul";

/// Fuse `graph` (see the module docs); the result is validated.
pub fn fuse(graph: &Graph, registry: &Registry) -> Result<FusedGraph> {
    let finder = Finder::new(graph);
    let mut taken: HashSet<NodeId> = HashSet::new();
    let mut fusions = Vec::new();
    for node in graph.nodes().iter().filter(|n| n.op == MUL) {
        if let Some(fusion) = finder.swiglu(node, &taken)? {
            taken.extend(&fusion.absorbed);
            fusions.push(fusion);
        }
    }
    for node in graph.nodes().iter().filter(|n| n.op == MatmulOp::NAME) {
        if let Some(fusion) = finder.epilogue(node, &taken)? {
            taken.extend(&fusion.absorbed);
            fusions.push(fusion);
        }
    }
    if fusions.is_empty() {
        return Ok(FusedGraph::unfused(graph));
    }
    let (graph, origins) = graph.fuse_nodes(registry.ops(), &fusions)?;
    Ok(FusedGraph { graph, origins })
}

/// Who reads what.
struct Finder<'g> {
    graph: &'g Graph,
    /// Each value's readers, once per read.
    readers: HashMap<ValueId, Vec<NodeId>>,
    outputs: HashSet<ValueId>,
}

impl<'g> Finder<'g> {
    fn new(graph: &'g Graph) -> Self {
        let mut readers: HashMap<ValueId, Vec<NodeId>> = HashMap::new();
        for node in graph.nodes() {
            for &input in &node.inputs {
                readers.entry(input).or_default().push(node.id);
            }
        }
        Self { graph, readers, outputs: graph.outputs().iter().map(|o| o.value).collect() }
    }

    /// The one node reading `value` once, when nothing else (no other
    /// node, no graph output) reads it.
    fn sole_reader(&self, value: ValueId) -> Option<&'g Node> {
        match self.readers.get(&value).map(Vec::as_slice) {
            Some(&[reader]) if !self.outputs.contains(&value) => Some(&self.graph.nodes()[reader.index()]),
            _ => None,
        }
    }

    /// The node of op `op` defining `value`, unless taken.
    fn producer(&self, value: ValueId, op: &str, taken: &HashSet<NodeId>) -> Option<&'g Node> {
        match self.graph.value(value).def {
            ValueDef::NodeOutput { node, .. } if !taken.contains(&node) => {
                Some(&self.graph.nodes()[node.index()]).filter(|n| n.op == op)
            }
            _ => None,
        }
    }

    /// `mul` as the end of a SwiGLU of two sibling matmuls.
    fn swiglu(&self, mul: &Node, taken: &HashSet<NodeId>) -> Result<Option<NodeFusion>> {
        if taken.contains(&mul.id) {
            return Ok(None);
        }
        for (s, u) in [(mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])] {
            let only_mul = |v: ValueId| self.sole_reader(v).is_some_and(|r| r.id == mul.id);
            if s == u || !only_mul(s) || !only_mul(u) {
                continue;
            }
            let Some(silu) = self.producer(s, SILU, taken) else { continue };
            let g = silu.inputs[0];
            let Some(gate) = self.producer(g, MatmulOp::NAME, taken) else { continue };
            let Some(up) = self.producer(u, MatmulOp::NAME, taken) else { continue };
            let only_silu = self.sole_reader(g).is_some_and(|r| r.id == silu.id);
            let same_input = gate.inputs[0] == up.inputs[0] && gate.params == up.params;
            let same_weights = self.graph.value(gate.inputs[1]).ty == self.graph.value(up.inputs[1]).ty;
            if !(only_silu && same_input && same_weights) || gate.id == up.id {
                continue;
            }
            let params = MatmulParams::read(&gate.params)?;
            return Ok(Some(NodeFusion {
                absorbed: vec![gate.id, up.id, silu.id, mul.id],
                op: SwigluMatmulOp::NAME.into(),
                params: params.to_params(),
                inputs: vec![gate.inputs[0], gate.inputs[1], up.inputs[1]],
                output: mul.outputs[0],
            }));
        }
        Ok(None)
    }

    /// `matmul` with the elementwise node reading its result.
    fn epilogue(&self, matmul: &Node, taken: &HashSet<NodeId>) -> Result<Option<NodeFusion>> {
        let c = matmul.outputs[0];
        let Some(reader) = self.sole_reader(c).filter(|r| !taken.contains(&r.id)) else { return Ok(None) };
        let MatmulParams { transpose_b } = MatmulParams::read(&matmul.params)?;
        let [a, b] = [matmul.inputs[0], matmul.inputs[1]];
        // The operand of a binary node besides `value` (none if it reads
        // `value` twice).
        let operand = |node: &Node, value: ValueId| match *node.inputs.as_slice() {
            [x, y] if x == value && y != value => Some(y),
            [x, y] if y == value && x != value => Some(x),
            _ => None,
        };
        let with_operand =
            |absorbed: Vec<NodeId>, epilogue: BinaryEpilogue, other: ValueId, output: ValueId| NodeFusion {
                absorbed,
                op: MatmulEpilogueOp::NAME.into(),
                params: EpilogueParams { transpose_b, epilogue }.to_params(),
                inputs: vec![a, b, other],
                output,
            };
        let fusion = match reader.op.as_str() {
            SILU => {
                let s = reader.outputs[0];
                let mul = self.sole_reader(s).filter(|m| m.op == MUL && !taken.contains(&m.id));
                match mul.and_then(|m| operand(m, s).map(|o| (m, o))) {
                    Some((mul, other)) => {
                        with_operand(vec![matmul.id, reader.id, mul.id], BinaryEpilogue::SiluMul, other, mul.outputs[0])
                    }
                    None => NodeFusion {
                        absorbed: vec![matmul.id, reader.id],
                        op: MatmulSiluOp::NAME.into(),
                        params: MatmulParams { transpose_b }.to_params(),
                        inputs: vec![a, b],
                        output: s,
                    },
                }
            }
            ADD | MUL => {
                let Some(other) = operand(reader, c) else { return Ok(None) };
                let epilogue = if reader.op == ADD { BinaryEpilogue::Add } else { BinaryEpilogue::Mul };
                with_operand(vec![matmul.id, reader.id], epilogue, other, reader.outputs[0])
            }
            _ => return Ok(None),
        };
        Ok(Some(fusion))
    }
}
