//! `mo.gather`: `output[b, s, :] = table[ids[b, s], :]`, the embedding
//! lookup. `table` `[V, H]` is a graph constant of f32, bf16 or f16; `ids`
//! is u32 `[B, S]` (B and S may be symbolic); the output `[B, S, H]` has the
//! table's dtype and each of its rows is a table row, copied bit for bit.
//! A table in a weight block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, q8_min, Q4_K, Q5_K, Q6_K; H a
//! multiple of its block) stays quantized: each gathered row is decoded
//! (exactly as [`kvjit_core::quant::dequantize`]) into the output, of the
//! node's `dtype` (f32 unless it names bf16 or f16, rounded once).
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
    /// The parameters of a `mo.gather` node.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct GatherParams {
        /// The output's dtype: a float table's own (the default), or, for a
        /// table in a weight block format, the float its rows decode to
        /// (default f32).
        dtype: Option<DType>,
    }
}

/// The `mo.gather` op: inputs `table` (a graph constant) and `ids`, output
/// `output`. Register it as `registry.register(kvjit_op::Defined(GatherOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GatherOp;

/// Add a `mo.gather` node to `b` (`table` must be a graph constant);
/// returns its output.
pub fn gather(b: &mut GraphBuilder<'_>, table: ValueId, ids: ValueId) -> Result<ValueId, GraphError> {
    gather_as(b, table, ids, None)
}

/// [`gather`] with the output's dtype named (`dtype`: what a block-format
/// table's rows decode to; a float table's own, or `None`).
pub fn gather_as(
    b: &mut GraphBuilder<'_>,
    table: ValueId,
    ids: ValueId,
    dtype: Option<DType>,
) -> Result<ValueId, GraphError> {
    Ok(add_node::<GatherOp, 2>(b, &GatherParams { dtype }, [table, ids])?[0])
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

    fn specialize(&self, params: &GatherParams, inputs: &[&ValueType], backend: Backend) -> Specialized<GatherSpec> {
        let table = tensor_input(inputs, 0);
        let (dtype, hidden) = match table.dtype.is_block_format() {
            true => block_rows(table, params.dtype)?,
            false => {
                let (dtype, hidden) = rows::float_rows("table", table, &["V", "H"])?;
                if params.dtype.is_some_and(|d| d != dtype) {
                    return Err(input_error("table", format!("a table of the output's dtype {dtype}"), table));
                }
                (dtype, hidden)
            }
        };
        let Some(vocab) = table.shape[0].as_static() else {
            return Err(input_error("table", "a table [V, H] of static V".into(), table));
        };
        let [batch, seq] = ids_dims(tensor_input(inputs, 1))?;
        let step = StepDims::of(batch, seq);
        Ok(GatherSpec { target: backend.target(), dtype, table: table.dtype, vocab, hidden, step })
    }

    /// `[B, S, H]` in the table's dtype.
    fn infer(&self, spec: &GatherSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        let [batch, seq] = ids_dims(tensor_input(inputs, 1)).expect("specialize checked ids");
        vec![TensorType::new(spec.dtype, [batch.clone(), seq.clone(), Dim::Static(spec.hidden)])]
    }
}

/// A block-format table `[V, H]` (H static, whole blocks) and the output
/// dtype its rows decode to (`dtype`, default f32; a compute float).
fn block_rows(table: &TensorType, dtype: Option<DType>) -> Result<(DType, usize), GraphError> {
    let block = table.dtype.block().0;
    let hidden = match table.shape.as_slice() {
        [_, h] => h.as_static().filter(|&h| h > 0 && h.is_multiple_of(block)),
        _ => None,
    };
    let dtype = dtype.unwrap_or(DType::F32);
    match hidden {
        Some(hidden) if dtype.is_compute_float() => Ok((dtype, hidden)),
        _ => Err(input_error(
            "table",
            format!(
                "{}[V, H] with H static, a multiple of its {block}-weight block, decoded to f32, bf16 or f16",
                table.dtype
            ),
            table,
        )),
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
    /// Dtype of the output (and of a float table).
    pub dtype: DType,
    /// The table's dtype: `dtype`, or a weight block format decoded on
    /// gather.
    pub table: DType,
    /// Rows of the table, V.
    pub vocab: usize,
    /// Elements per row, H.
    pub hidden: usize,
    /// B and S of `ids`, where static.
    pub step: StepDims,
}

impl KernelSpec for GatherSpec {
    /// `gather.cpu.bf16.v32000.h4096.b1.sany` (a block table's format
    /// last: `…sany.wq8_0`).
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new("gather", self.target, self.dtype)
            .with("v", KeyField::size(self.vocab))
            .with("h", KeyField::size(self.hidden));
        let key = self.step.named(key);
        match self.table == self.dtype {
            true => key,
            false => key.with("w", KeyField::DType(self.table)),
        }
    }
}

impl CallContract for GatherSpec {
    /// B and S of the call's `ids`.
    type Checked = [usize; 2];
    const TENSORS: &'static [TensorArg] = &[TensorArg::checked("table"), TensorArg::u32("ids")];

    /// `table` is `[V, H]` of the spec's table dtype, `ids` `[B, S]` (as
    /// baked), every id below V.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<[usize; 2]> {
        let [table, ids] = [tensors[0], tensors[1]];
        kvjit_core::expect_arg("table", table, self.table)?;
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

    /// Each output row the table's row `ids[b, s]`, copied (a block
    /// table's dequantized, rounded once to the output's dtype).
    fn reference(&self, _: [usize; 2], call: Call<'_, '_>) -> Result<()> {
        let [table, ids] = call.tensors();
        if self.table.is_block_format() {
            let row_bytes = self.table.storage_bytes(self.hidden).expect("H is whole blocks");
            let mut row = vec![0f32; self.hidden];
            let mut values = Vec::with_capacity(ids.numel() * self.hidden);
            for &id in ids.as_slice::<u32>()? {
                kvjit_core::quant::dequantize(
                    self.table,
                    &table.as_bytes()[id as usize * row_bytes..][..row_bytes],
                    &mut row,
                )?;
                values.extend(row.iter().map(|&v| f64::from(v)));
            }
            return kvjit_op::store_f64(&mut call.outputs[0], &values);
        }
        let sources: Vec<Option<usize>> = ids.as_slice::<u32>()?.iter().map(|&id| Some(id as usize)).collect();
        rows::copy_rows(table, &sources, &mut call.outputs[0])
    }
}
