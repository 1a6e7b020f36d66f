//! The op interface and the registry that lists ops by name.
//!
//! An op's IR-level definition — name, parameters, signature, shape rules,
//! kernel key — is an [`OpDef`]. Kernels are not part of it: they live with
//! the op in its `ops/` crate and are reached by the compile step, so this
//! crate never depends on a backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvjit_core::{DType, KernelKey, Target};
use serde::{Deserialize, Serialize};

use crate::{GraphError, Result, TensorType, ValueType};

/// A node parameter value as graph files spell it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ParamValue {
    /// A non-negative integer (sizes, counts).
    Int(u64),
    /// A name (dtypes and other enumerations).
    Str(String),
}

impl From<usize> for ParamValue {
    fn from(v: usize) -> Self {
        ParamValue::Int(v as u64)
    }
}

impl From<&str> for ParamValue {
    fn from(s: &str) -> Self {
        ParamValue::Str(s.to_string())
    }
}

impl From<DType> for ParamValue {
    fn from(d: DType) -> Self {
        ParamValue::Str(d.name().to_string())
    }
}

/// A node's parameters, by name.
pub type Params = BTreeMap<String, ParamValue>;

fn param<'p>(params: &'p Params, name: &str) -> Result<&'p ParamValue> {
    params.get(name).ok_or_else(|| GraphError::Param { param: name.to_string(), problem: "is missing".into() })
}

/// A required positive-integer parameter.
pub fn param_usize(params: &Params, name: &str) -> Result<usize> {
    match param(params, name)? {
        ParamValue::Int(v) if *v > 0 && *v <= u32::MAX as u64 => Ok(*v as usize),
        other => Err(GraphError::Param {
            param: name.to_string(),
            problem: format!("must be an integer in 1..=4294967295, got {other:?}"),
        }),
    }
}

/// A required dtype parameter.
pub fn param_dtype(params: &Params, name: &str) -> Result<DType> {
    match param(params, name)? {
        ParamValue::Str(s) => s
            .parse()
            .map_err(|e: kvjit_core::Error| GraphError::Param { param: name.to_string(), problem: e.to_string() }),
        other => {
            Err(GraphError::Param { param: name.to_string(), problem: format!("must be a dtype name, got {other:?}") })
        }
    }
}

/// What kind of value an op argument takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// A tensor.
    Tensor,
    /// A paged KV cache (written in place).
    KvCache,
}

/// One input of an op's signature.
#[derive(Clone, Copy, Debug)]
pub struct ArgSpec {
    /// Argument name, as in the op's documentation.
    pub name: &'static str,
    /// What kind of value it takes.
    pub kind: ArgKind,
}

/// The IR-level definition of an op: one per op, registered in an
/// [`OpRegistry`].
pub trait OpDef: Send + Sync {
    /// Canonical name, as graph files write it.
    fn name(&self) -> &'static str;
    /// Other names the op answers to.
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// Names of the parameters the op takes (all required).
    fn param_names(&self) -> &'static [&'static str];
    /// Input signature, in order.
    fn inputs(&self) -> &'static [ArgSpec];
    /// Output names, in order.
    fn outputs(&self) -> &'static [&'static str];
    /// Check the parameters and input types and infer the output types.
    fn infer(&self, params: &Params, inputs: &[&ValueType]) -> Result<Vec<TensorType>>;
    /// The kernel key for these (already inferred) inputs on `target`; refuses
    /// combinations no kernel serves.
    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<KernelKey>;
}

/// Every op a graph may use, found by name or alias.
#[derive(Clone, Default)]
pub struct OpRegistry {
    ops: Vec<Arc<dyn OpDef>>,
}

impl OpRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add an op; its names must not clash with one already registered.
    pub fn register(&mut self, op: Arc<dyn OpDef>) -> Result<()> {
        for name in std::iter::once(op.name()).chain(op.aliases().iter().copied()) {
            if self.find(name).is_some() {
                return Err(GraphError::DuplicateOp(name.to_string()));
            }
        }
        self.ops.push(op);
        Ok(())
    }

    fn find(&self, name: &str) -> Option<&Arc<dyn OpDef>> {
        self.ops.iter().find(|op| op.name() == name || op.aliases().contains(&name))
    }

    /// The op with this name or alias.
    pub fn get(&self, name: &str) -> Result<&Arc<dyn OpDef>> {
        self.find(name).ok_or_else(|| GraphError::UnknownOp {
            name: name.to_string(),
            known: self.ops.iter().map(|op| op.name()).collect::<Vec<_>>().join(", "),
        })
    }

    /// Every registered op.
    pub fn ops(&self) -> impl Iterator<Item = &Arc<dyn OpDef>> {
        self.ops.iter()
    }
}
