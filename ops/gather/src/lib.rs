//! `mo.gather`: `output[b, s, :] = table[ids[b, s], :]`, the embedding
//! lookup. `table` `[V, H]` is a graph constant of f32, bf16 or f16; `ids`
//! is u32 `[B, S]` (B and S may be symbolic); the output `[B, S, H]` has the
//! table's dtype and each of its rows is a table row, copied bit for bit.
//! An id ≥ V is refused ([`GatherError::IdOutOfRange`], naming the id, its
//! position and V) before anything is written.
//!
//! [`GatherOp`] and its spec [`GatherSpec`] (with the call contract both
//! kernels share) are here; the reference copies rows in plain Rust
//! ([`kvjit_op::rows::copy_rows`]); [`JitKernel`] runs Cranelift code, one
//! work item per output row. No CUDA variant yet.

mod cpu_jit;

use kvjit_core::{Backend, DType, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Target, Tensor};
use kvjit_graph::{ArgSpec, Dim, GraphBuilder, GraphError, TensorType, ValueId, ValueType, input_error, tensor_input};
use kvjit_op::checks::{StepDims, expect_baked};
use kvjit_op::{Call, CallContract, Op, Specialized, TensorArg, add_node, rows};
use kvjit_runtime::OutputSpec;

pub use cpu_jit::JitKernel;

/// The reference kernel of a spec: rows copied in plain Rust.
pub type ReferenceKernel = kvjit_op::Reference<GatherSpec>;

kvjit_op::params! {
    /// The parameters of a `mo.gather` node: none (the dtype is the table's).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct GatherParams {}
}

/// The `mo.gather` op: inputs `table` (a graph constant) and `ids`, output
/// `output`. Register it as `registry.register(kvjit_op::Defined(GatherOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GatherOp;

/// Add a `mo.gather` node to `b` (`table` must be a graph constant);
/// returns its output.
pub fn gather(b: &mut GraphBuilder<'_>, table: ValueId, ids: ValueId) -> Result<ValueId, GraphError> {
    Ok(add_node::<GatherOp, 2>(b, &GatherParams {}, [table, ids])?[0])
}

/// An id past the table, found when a call is checked (nothing written).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GatherError {
    /// `ids[batch, position]` names a row the table does not have.
    #[error("ids[{batch}, {position}] = {id} is out of range: the table has {vocab} rows")]
    IdOutOfRange {
        /// The id.
        id: u32,
        /// Its sequence b.
        batch: usize,
        /// Its position s in the sequence.
        position: usize,
        /// Rows of the table, V.
        vocab: usize,
    },
}

kvjit_op::op_error!(GatherError, GatherOp::NAME);

impl Op for GatherOp {
    const NAME: &'static str = "mo.gather";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::constant("table"), ArgSpec::tensor("ids")];
    type Params = GatherParams;
    type Spec = GatherSpec;
    type Cpu = JitKernel;

    fn specialize(&self, _: &GatherParams, inputs: &[&ValueType], backend: Backend) -> Specialized<GatherSpec> {
        let table = tensor_input(inputs, 0);
        let (dtype, hidden) = rows::float_rows("table", table, &["V", "H"])?;
        let Some(vocab) = table.shape[0].as_static() else {
            return Err(input_error("table", "a table [V, H] of static V".into(), table));
        };
        let [batch, seq] = ids_dims(tensor_input(inputs, 1))?;
        Ok(GatherSpec { target: backend.target(), dtype, vocab, hidden, step: StepDims::of(batch, seq) })
    }

    /// `[B, S, H]` in the table's dtype.
    fn infer(&self, spec: &GatherSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        let [batch, seq] = ids_dims(tensor_input(inputs, 1)).expect("specialize checked ids");
        vec![TensorType::new(spec.dtype, [batch.clone(), seq.clone(), Dim::Static(spec.hidden)])]
    }
}

/// `ids` as u32 `[B, S]`: its two dims.
fn ids_dims(ids: &TensorType) -> Result<[&Dim; 2], GraphError> {
    match ids.shape.as_slice() {
        [batch, seq] if ids.dtype == DType::U32 => Ok([batch, seq]),
        _ => Err(input_error("ids", "u32[B, S]".into(), ids)),
    }
}

/// Everything a `mo.gather` kernel bakes in: target, the table's dtype and
/// shape `[V, H]`, and B and S of `ids` when static (the code does not
/// depend on them: one work item per output row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GatherSpec {
    /// Target.
    pub target: Target,
    /// Dtype of the table and the output.
    pub dtype: DType,
    /// Rows of the table, V.
    pub vocab: usize,
    /// Elements per row, H.
    pub hidden: usize,
    /// B and S of `ids`, where static.
    pub step: StepDims,
}

impl KernelSpec for GatherSpec {
    /// `gather.cpu.bf16.v32000.h4096.b1.sany`.
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new("gather", self.target, self.dtype)
            .with("v", KeyField::size(self.vocab))
            .with("h", KeyField::size(self.hidden));
        self.step.named(key)
    }
}

impl CallContract for GatherSpec {
    /// B and S of the call's `ids`.
    type Checked = [usize; 2];
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("table"), TensorArg::u32("ids")];

    /// `table` is `[V, H]`, `ids` `[B, S]` (as baked), every id below V.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<[usize; 2]> {
        let [table, ids] = [tensors[0], tensors[1]];
        expect_baked("table", table, &[("V", Some(self.vocab)), ("H", Some(self.hidden))], self)?;
        expect_baked("ids", ids, &self.step.baked(), self)?;
        let [batch, seq] = [ids.shape()[0], ids.shape()[1]];
        if let Some((at, &id)) = ids.as_slice::<u32>()?.iter().enumerate().find(|(_, id)| **id as usize >= self.vocab) {
            let (batch, position) = (at / seq, at % seq);
            return Err(GatherError::IdOutOfRange { id, batch, position, vocab: self.vocab }.into());
        }
        Ok([batch, seq])
    }

    fn outputs(&self, &[batch, seq]: &[usize; 2]) -> Vec<OutputSpec> {
        vec![(self.dtype, vec![batch, seq, self.hidden])]
    }

    /// Each output row the table's row `ids[b, s]`, copied.
    fn reference(&self, _: [usize; 2], call: Call<'_, '_>) -> Result<()> {
        let [table, ids] = call.tensors();
        let sources: Vec<Option<usize>> = ids.as_slice::<u32>()?.iter().map(|&id| Some(id as usize)).collect();
        rows::copy_rows(table, &sources, &mut call.outputs[0])
    }
}
