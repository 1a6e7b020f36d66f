//! The test op the graph crate's tests share.

use std::sync::Arc;

use kvjit_core::{Backend, KernelKey};
use kvjit_graph::{ArgSpec, GraphError, OpDef, OpRegistry, ParamSpec, Params, TensorType, ValueType, tensor_input};

/// `lookup(table, x)`: its table must be a constant; the output is `x`'s type.
pub struct Lookup;

impl OpDef for Lookup {
    fn name(&self) -> &'static str {
        "test.lookup"
    }
    fn params(&self) -> &'static [ParamSpec] {
        &[]
    }
    fn inputs(&self) -> &'static [ArgSpec] {
        const INPUTS: &[ArgSpec] = &[ArgSpec::constant("table"), ArgSpec::tensor("x")];
        INPUTS
    }
    fn outputs(&self) -> &'static [&'static str] {
        &["output"]
    }
    fn infer(&self, _: &Params, inputs: &[&ValueType]) -> kvjit_graph::Result<Vec<TensorType>> {
        Ok(vec![tensor_input(inputs, 1).clone()])
    }
    fn kernel_key(&self, _: &Params, _: &[&ValueType], _: Backend) -> kvjit_graph::Result<KernelKey> {
        Err(GraphError::Unsupported("a test op has no kernels".into()))
    }
}

/// A registry holding [`Lookup`] only.
pub fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Lookup)).unwrap();
    registry
}
