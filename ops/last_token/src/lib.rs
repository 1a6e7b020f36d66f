//! `kvjit.last_valid_token`: from a padded batch `x` `[B, S, H]` (f32, bf16
//! or f16; B and S may be symbolic, H static) and u32 `valid_lengths`
//! `[B]`, the output `[B, H]` whose row b is `x[b, valid_lengths[b] − 1]`,
//! copied bit for bit, or zeros where `valid_lengths[b] = 0` (what the
//! logits of a step are computed from). A valid length above S is refused
//! ([`kvjit_core::Error::ValidLengthTooLong`]) before anything is written.
//!
//! [`LastTokenOp`] and its spec [`LastTokenSpec`] (with the call contract
//! both kernels share) are here; the reference copies rows in plain Rust
//! ([`kvjit_op::rows::copy_rows`]); [`JitKernel`] runs Cranelift code, one
//! work item per sequence. No CUDA variant yet.

mod cpu_jit;

use kvjit_core::{
    Backend, DType, Error, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Target, Tensor,
    shape_mismatch,
};
use kvjit_graph::{ArgSpec, Dim, GraphBuilder, GraphError, TensorType, ValueId, ValueType, input_error, tensor_input};
use kvjit_op::checks::{StepDims, expect_baked};
use kvjit_op::{Call, CallContract, Op, Specialized, TensorArg, add_node, rows};
use kvjit_runtime::OutputSpec;

pub use cpu_jit::JitKernel;

/// The reference kernel of a spec: rows copied in plain Rust.
pub type ReferenceKernel = kvjit_op::Reference<LastTokenSpec>;

kvjit_op::params! {
    /// The parameters of a `kvjit.last_valid_token` node: none (the dtype
    /// is `x`'s).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct LastTokenParams {}
}

/// The `kvjit.last_valid_token` op: inputs `x` and `valid_lengths`, output
/// `output`. Register it as
/// `registry.register(kvjit_op::Defined(LastTokenOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LastTokenOp;

/// Add a `kvjit.last_valid_token` node to `b`; returns its output.
pub fn last_valid_token(b: &mut GraphBuilder<'_>, x: ValueId, valid_lengths: ValueId) -> Result<ValueId, GraphError> {
    Ok(add_node::<LastTokenOp, 2>(b, &LastTokenParams {}, [x, valid_lengths])?[0])
}

impl Op for LastTokenOp {
    const NAME: &'static str = "kvjit.last_valid_token";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("x"), ArgSpec::VALID_LENGTHS];
    type Params = LastTokenParams;
    type Spec = LastTokenSpec;
    type Cpu = JitKernel;

    /// `x` `[B, S, H]` with H static, `valid_lengths` u32 `[B]` of the same
    /// B (refused in one line otherwise).
    fn specialize(&self, _: &LastTokenParams, inputs: &[&ValueType], backend: Backend) -> Specialized<LastTokenSpec> {
        let x = tensor_input(inputs, 0);
        let (dtype, hidden) = rows::float_rows("x", x, &["B", "S", "H"])?;
        let (batch, seq) = (&x.shape[0], &x.shape[1]);
        let valid_lengths = tensor_input(inputs, 1);
        if valid_lengths.dtype != DType::U32
            || !matches!(valid_lengths.shape.as_slice(), [b] if kvjit_graph::same_dim(b, batch))
        {
            return Err(input_error("valid_lengths", format!("u32[{batch}] (B from x)"), valid_lengths));
        }
        Ok(LastTokenSpec { target: backend.target(), dtype, hidden, step: StepDims::of(batch, seq) })
    }

    /// `[B, H]` in `x`'s dtype.
    fn infer(&self, spec: &LastTokenSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        let batch = tensor_input(inputs, 0).shape[0].clone();
        vec![TensorType::new(spec.dtype, [batch, Dim::Static(spec.hidden)])]
    }
}

/// Everything a `kvjit.last_valid_token` kernel bakes in: target, `x`'s
/// dtype and row length H, and B and S when static (S is baked into the
/// code's row addresses; `None` reads it from each call).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LastTokenSpec {
    /// Target.
    pub target: Target,
    /// Dtype of `x` and the output.
    pub dtype: DType,
    /// Elements per row, H.
    pub hidden: usize,
    /// B and S of `x`, where static.
    pub step: StepDims,
}

impl KernelSpec for LastTokenSpec {
    /// `last_valid_token.cpu.bf16.h4096.b8.sany`.
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new("last_valid_token", self.target, self.dtype).with("h", KeyField::size(self.hidden));
        self.step.named(key)
    }
}

impl CallContract for LastTokenSpec {
    /// B and S of the call's `x`.
    type Checked = [usize; 2];
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("x"), TensorArg::VALID_LENGTHS];

    /// `x` is `[B, S, H]` (as baked), `valid_lengths` `[B]`, each `≤ S`.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<[usize; 2]> {
        let [x, valid_lengths] = [tensors[0], tensors[1]];
        let [batch, seq] = self.step.baked();
        expect_baked("x", x, &[batch, seq, ("H", Some(self.hidden))], self)?;
        let [batch, seq] = [x.shape()[0], x.shape()[1]];
        if valid_lengths.shape() != [batch] {
            return Err(shape_mismatch("valid_lengths", format!("[{batch}] (B from x)"), valid_lengths));
        }
        let valid = valid_lengths.as_slice::<u32>()?;
        if let Some((b, &valid_length)) = valid.iter().enumerate().find(|(_, v)| **v as usize > seq) {
            return Err(Error::ValidLengthTooLong { batch: b, valid_length, seq_len: seq });
        }
        Ok([batch, seq])
    }

    fn outputs(&self, &[batch, _]: &[usize; 2]) -> Vec<OutputSpec> {
        vec![(self.dtype, vec![batch, self.hidden])]
    }

    /// Row b: `x[b, valid_lengths[b] − 1]`, or zeros for an empty sequence.
    fn reference(&self, [_, seq]: [usize; 2], call: Call<'_, '_>) -> Result<()> {
        let [x, valid_lengths] = call.tensors();
        let valid = valid_lengths.as_slice::<u32>()?;
        let sources: Vec<Option<usize>> =
            valid.iter().enumerate().map(|(b, &v)| (v as usize).checked_sub(1).map(|t| b * seq + t)).collect();
        rows::copy_rows(x, &sources, &mut call.outputs[0])
    }
}
