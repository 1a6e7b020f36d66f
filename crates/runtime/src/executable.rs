//! [`Executable`]: a compiled graph as the runtime sees it — named inputs
//! and caches with their expected types, constants, and an ordered list of
//! kernel calls over slots.

use std::fmt;
use std::sync::Arc;

use kvjit_core::{DType, KvCacheParams, Tensor};

use crate::{Kernel, Result, RuntimeError};

/// A dim the executor checks an input against: a number, or a symbol that
/// must be the same size wherever it appears.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeDim {
    /// A fixed size.
    Static(usize),
    /// A size bound by the inputs of each run.
    Symbol(String),
}

impl fmt::Display for ShapeDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShapeDim::Static(v) => write!(f, "{v}"),
            ShapeDim::Symbol(s) => f.write_str(s),
        }
    }
}

pub(crate) fn shape_string(dims: &[ShapeDim]) -> String {
    format!("[{}]", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

/// A named graph input.
#[derive(Clone, Debug)]
pub struct InputSpec {
    /// Name callers supply it by.
    pub name: String,
    /// Expected dtype.
    pub dtype: DType,
    /// Expected dims.
    pub shape: Vec<ShapeDim>,
}

/// A named KV cache.
#[derive(Clone, Debug)]
pub struct CacheSpec {
    /// Name callers supply it by.
    pub name: String,
    /// Expected layout.
    pub params: KvCacheParams,
    /// Physical pages.
    pub num_pages: ShapeDim,
    /// Sequences.
    pub batch: ShapeDim,
    /// Width of the lookup table.
    pub max_pages_per_seq: ShapeDim,
}

/// Where a kernel argument comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Graph input `i` (in [`Executable::inputs`] order).
    Input(usize),
    /// Constant `i`.
    Constant(usize),
    /// Output `output` of step `step`.
    StepOutput {
        /// Producing step.
        step: usize,
        /// Which output.
        output: usize,
    },
}

/// One kernel call.
pub struct Step {
    /// Label for reports and errors (the node id, e.g. `n0`).
    pub label: String,
    /// The kernel.
    pub kernel: Arc<dyn Kernel>,
    /// Tensor arguments.
    pub inputs: Vec<Slot>,
    /// Cache arguments (indices into [`Executable::caches`]).
    pub caches: Vec<usize>,
}

/// A compiled graph, ready for [`Executor::run`](crate::Executor::run). One
/// executable runs any number of steps against the same caches.
pub struct Executable {
    inputs: Vec<InputSpec>,
    caches: Vec<CacheSpec>,
    constants: Vec<Arc<Tensor>>,
    steps: Vec<Step>,
    outputs: Vec<(String, Slot)>,
}

impl Executable {
    /// Assemble an executable, checking that every slot refers to something
    /// defined earlier.
    pub fn new(
        inputs: Vec<InputSpec>,
        caches: Vec<CacheSpec>,
        constants: Vec<Arc<Tensor>>,
        steps: Vec<Step>,
        outputs: Vec<(String, Slot)>,
    ) -> Result<Self> {
        let exe = Self { inputs, caches, constants, steps, outputs };
        for (i, step) in exe.steps.iter().enumerate() {
            for slot in &step.inputs {
                exe.check_slot(*slot, i)?;
            }
            if let Some(&c) = step.caches.iter().find(|&&c| c >= exe.caches.len()) {
                return Err(RuntimeError::Plan(format!("step {} uses cache {c}, which does not exist", step.label)));
            }
        }
        for (_, slot) in &exe.outputs {
            exe.check_slot(*slot, exe.steps.len())?;
        }
        Ok(exe)
    }

    fn check_slot(&self, slot: Slot, before_step: usize) -> Result<()> {
        let ok = match slot {
            Slot::Input(i) => i < self.inputs.len(),
            Slot::Constant(i) => i < self.constants.len(),
            Slot::StepOutput { step, .. } => step < before_step,
        };
        if !ok {
            return Err(RuntimeError::Plan(format!("slot {slot:?} is not defined before it is used")));
        }
        Ok(())
    }

    /// The inputs callers supply.
    pub fn inputs(&self) -> &[InputSpec] {
        &self.inputs
    }

    /// The caches callers supply.
    pub fn caches(&self) -> &[CacheSpec] {
        &self.caches
    }

    /// The kernel calls, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Named outputs.
    pub fn outputs(&self) -> &[(String, Slot)] {
        &self.outputs
    }

    /// The constants, in [`Slot::Constant`] order.
    pub fn constants(&self) -> &[Arc<Tensor>] {
        &self.constants
    }

    pub(crate) fn constant(&self, i: usize) -> &Tensor {
        &self.constants[i]
    }
}
