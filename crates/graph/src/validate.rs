//! The one validator every graph passes, whether built or loaded.

use std::collections::HashSet;
use std::sync::Arc;

use crate::{ArgKind, Graph, GraphError, OpDef, OpRegistry, Params, Result, TensorType, ValueDef, ValueId, ValueType};

/// Check one op application and infer its output types: the op exists, its
/// parameters are exactly the ones it takes, the inputs have the right count
/// and kinds (and are graph constants where the op requires one:
/// `constants[i]` says whether input `i` is), and the op's shape rules
/// accept them.
pub(crate) fn check_op(
    registry: &OpRegistry,
    op_name: &str,
    params: &Params,
    inputs: &[&ValueType],
    constants: &[bool],
) -> Result<(Arc<dyn OpDef>, Vec<TensorType>)> {
    let op = registry.get(op_name)?.clone();
    let specs = op.params();
    for (name, value) in params {
        let Some(spec) = specs.iter().find(|s| s.name == name) else {
            let names: Vec<&str> = specs.iter().map(|s| s.name).collect();
            return Err(GraphError::Param {
                param: name.clone(),
                problem: format!("is not a parameter of this op (it takes {})", names.join(", ")),
            });
        };
        spec.kind.check(value).map_err(|problem| GraphError::Param { param: name.clone(), problem })?;
    }
    if let Some(missing) = specs.iter().find(|s| s.required && !params.contains_key(s.name)) {
        return Err(GraphError::Param { param: missing.name.into(), problem: "is missing".into() });
    }
    if inputs.len() != op.inputs().len() {
        return Err(GraphError::ArgCount {
            op: op.name().into(),
            what: "inputs",
            expected: op.inputs().len(),
            got: inputs.len(),
        });
    }
    for (spec, ty) in op.inputs().iter().zip(inputs) {
        match (spec.kind, ty) {
            (ArgKind::Tensor, ValueType::Tensor(_)) | (ArgKind::KvCache, ValueType::KvCache(_)) => {}
            (ArgKind::Tensor, _) => {
                return Err(GraphError::ArgKind { arg: spec.name.into(), expected: "tensor" });
            }
            (ArgKind::KvCache, _) => {
                return Err(GraphError::ArgKind { arg: spec.name.into(), expected: "KV cache" });
            }
        }
    }
    for ((spec, ty), &constant) in op.inputs().iter().zip(inputs).zip(constants) {
        if spec.role == crate::ArgRole::Constant && !constant {
            return Err(GraphError::InputType {
                arg: spec.name.into(),
                expected: "a graph constant (a weight or table the kernel may prepare when it is built)".into(),
                got: format!("{ty}, a value supplied or computed at run time"),
            });
        }
    }
    let outputs = op.infer(params, inputs)?;
    debug_assert_eq!(outputs.len(), op.outputs().len());
    Ok((op, outputs))
}

/// Check a whole graph: names unique, every reference defined before use,
/// constants matching their types, every node accepted by its op with the
/// recorded output types, outputs naming tensor values.
pub fn validate(graph: &Graph, registry: &OpRegistry) -> Result<()> {
    let mut names = HashSet::new();
    for value in &graph.values {
        if let Some(name) = &value.name
            && !names.insert(name.as_str())
        {
            return Err(GraphError::DuplicateName(name.clone()));
        }
        if let ValueDef::Constant { data, .. } = &value.def {
            check_constant(value.name.as_deref().unwrap_or("?"), &value.ty, data)?;
        }
    }
    let mut defined = vec![false; graph.values.len()];
    for (i, value) in graph.values.iter().enumerate() {
        defined[i] = !matches!(value.def, ValueDef::NodeOutput { .. });
    }
    for (index, node) in graph.nodes.iter().enumerate() {
        let wrap = |e: GraphError| e.in_node(node.id, &node.op);
        if node.id.index() != index {
            return Err(GraphError::DuplicateId { id: node.id.to_string() });
        }
        let mut input_types = Vec::with_capacity(node.inputs.len());
        let mut constants = Vec::with_capacity(node.inputs.len());
        for &input in &node.inputs {
            if !defined.get(input.index()).copied().unwrap_or(false) {
                return Err(GraphError::DanglingValue { place: format!("node {}", node.id), value: input });
            }
            let value = &graph.values[input.index()];
            input_types.push(&value.ty);
            constants.push(value.def.is_constant());
        }
        let (op, inferred) = check_op(registry, &node.op, &node.params, &input_types, &constants).map_err(wrap)?;
        if node.op != op.name() {
            return Err(wrap(GraphError::UnknownOp { name: node.op.clone(), known: op.name().into() }));
        }
        if node.outputs.len() != inferred.len() {
            return Err(wrap(GraphError::ArgCount {
                op: node.op.clone(),
                what: "outputs",
                expected: inferred.len(),
                got: node.outputs.len(),
            }));
        }
        for (slot, (&out, ty)) in node.outputs.iter().zip(inferred).enumerate() {
            let value = graph
                .values
                .get(out.index())
                .ok_or(GraphError::DanglingValue { place: format!("node {}", node.id), value: out })?;
            let produced_here =
                matches!(value.def, ValueDef::NodeOutput { node: n, index } if n == node.id && index == slot);
            if !produced_here || defined[out.index()] {
                return Err(GraphError::DuplicateId { id: out.to_string() });
            }
            if value.ty != ValueType::Tensor(ty.clone()) {
                return Err(GraphError::TypeDrift {
                    value: out,
                    recorded: value.ty.to_string(),
                    inferred: ty.to_string(),
                });
            }
            defined[out.index()] = true;
        }
    }
    if let Some((i, _)) = defined.iter().enumerate().find(|(_, d)| !**d) {
        return Err(GraphError::DanglingValue { place: "the value table".into(), value: ValueId(i as u32) });
    }
    let mut output_names = HashSet::new();
    for out in &graph.outputs {
        if !output_names.insert(out.name.as_str()) {
            return Err(GraphError::DuplicateName(out.name.clone()));
        }
        let value = graph
            .values
            .get(out.value.index())
            .ok_or(GraphError::DanglingValue { place: format!("output '{}'", out.name), value: out.value })?;
        if value.ty.as_tensor().is_none() {
            return Err(GraphError::ArgKind { arg: format!("output '{}'", out.name), expected: "tensor" });
        }
    }
    Ok(())
}

fn check_constant(name: &str, ty: &ValueType, data: &kvjit_core::Tensor) -> Result<()> {
    let matches = ty
        .as_tensor()
        .and_then(|t| t.static_shape().map(|s| (t.dtype, s)))
        .is_some_and(|(dtype, shape)| dtype == data.dtype() && shape == data.shape());
    if !matches {
        return Err(GraphError::ConstantMismatch {
            name: name.into(),
            declared: ty.to_string(),
            dtype: data.dtype(),
            shape: data.shape().to_vec(),
        });
    }
    Ok(())
}
