//! `mo.reduce.rms_norm` (MAX's name): per row of `x` `[..., H]`,
//! `y = x · 1/sqrt(mean(x²) + epsilon) · (weight + weight_offset)`, with
//! `weight` `[H]` a graph constant of `x`'s dtype (f32, bf16 or f16; the
//! leading dims may be symbolic, H is static). The output has `x`'s dtype
//! and shape; everything is computed in f32 and rounded once.
//!
//! [`RmsNormOp`] checks a node and makes its [`RmsNormSpec`], whose call
//! contract both kernels share; [`reference`](mod@reference) computes in
//! f64 and rounds once; [`JitKernel`] runs Cranelift code (emitted by
//! `emit.rs`), a block of whole rows per work item, over the worker pool.
//! The JIT's sum of squares does not overflow or underflow for any finite
//! f32 input (rows past the f32 range are summed again scaled by 2^∓100),
//! and its result is within [`F32_ULPS`] (6) ulps of the reference in f32
//! (H ≤ 8192) and one step in bf16 and f16. No CUDA variant yet.

mod cpu_jit;
mod emit;
pub mod reference;

use kvjit_core::{Backend, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Target, Tensor};
use kvjit_graph::{ArgSpec, GraphBuilder, GraphError, ValueId, ValueType, input_error, tensor_input};
use kvjit_op::rows::{self, Rows};
use kvjit_op::{Call, CallContract, Op, Specialized, TensorArg, add_node};
use kvjit_runtime::OutputSpec;

pub use cpu_jit::{JitKernel, ROW_ELEMENTS_PER_ITEM};
pub use reference::ReferenceKernel;

/// The most f32 ulps the JIT is from the reference for H ≤ 8192: the
/// worst measured (`tests/jit_vs_reference.rs`, x over six decades) is 2–3
/// for H ≤ 257, 4 at H = 1000 and 5 at H = 8192 (the f32 sum of squares
/// grows its error with H), plus one in reserve. bf16 and f16 results are
/// within one step (most are exact).
pub const F32_ULPS: f64 = 6.0;

kvjit_op::params! {
    /// The parameters of a `mo.reduce.rms_norm` node.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct RmsNormParams {
        /// Added to the mean of squares: finite and ≥ 0.
        epsilon: f32,
        /// Added to every weight (Gemma's `1 + weight`); absent is 0.
        weight_offset: Option<f32>,
    }
}

/// The `mo.reduce.rms_norm` op: inputs `x` `[..., H]` and `weight` `[H]`
/// (a graph constant, `x`'s dtype), output `output` (`x`'s dtype and
/// shape). Register it as `registry.register(kvjit_op::Defined(RmsNormOp))`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RmsNormOp;

/// Add a `mo.reduce.rms_norm` node to `b`; returns its output.
pub fn rms_norm(
    b: &mut GraphBuilder<'_>,
    x: ValueId,
    weight: ValueId,
    params: RmsNormParams,
) -> Result<ValueId, GraphError> {
    Ok(add_node::<RmsNormOp, 2>(b, &params, [x, weight])?[0])
}

impl Op for RmsNormOp {
    const NAME: &'static str = "mo.reduce.rms_norm";
    const INPUTS: &'static [ArgSpec] = &[ArgSpec::tensor("x"), ArgSpec::constant("weight")];
    type Params = RmsNormParams;
    type Spec = RmsNormSpec;
    type Cpu = JitKernel;

    fn specialize(&self, params: &RmsNormParams, inputs: &[&ValueType], backend: Backend) -> Specialized<RmsNormSpec> {
        let (x, rows) = rows::input(inputs, 0, "x")?;
        let weight = tensor_input(inputs, 1);
        let width = rows.width;
        if weight.dtype != x.dtype || weight.static_shape().as_deref() != Some(&[width][..]) {
            return Err(input_error("weight", format!("{}[{width}] (H of x)", x.dtype), weight));
        }
        let epsilon = params.epsilon;
        if !(epsilon.is_finite() && epsilon >= 0.0) {
            let problem = format!("must be finite and ≥ 0, got {epsilon}");
            return Err(GraphError::Param { param: "epsilon".into(), problem });
        }
        // `+ 0.0` makes −0 +0: one kernel, one key.
        let (epsilon, weight_offset) = (epsilon + 0.0, params.weight_offset.unwrap_or(0.0) + 0.0);
        Ok(RmsNormSpec { target: backend.target(), dtype: x.dtype, rows, epsilon, weight_offset })
    }
}

/// Everything a `mo.reduce.rms_norm` kernel bakes in: target, dtype, row
/// width H and (when every leading dim of `x` is static) the row count,
/// epsilon and the weight offset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormSpec {
    /// Target.
    pub target: Target,
    /// Dtype of `x`, `weight` and the output.
    pub dtype: kvjit_core::DType,
    /// Row width H and, if static, the row count.
    pub rows: Rows,
    /// Added to the mean of squares (finite, ≥ 0).
    pub epsilon: f32,
    /// Added to every weight (finite).
    pub weight_offset: f32,
}

impl KernelSpec for RmsNormSpec {
    /// `rms_norm.cpu.bf16.h4096.rowsany.eps<bits>.wo<bits>`: epsilon and
    /// the offset as their f32 bit patterns. No CPU tier: both tiers run
    /// the same Cranelift code.
    fn key_name(&self) -> KernelKey {
        KernelKey::new("rms_norm", self.target, self.dtype)
            .with("h", KeyField::size(self.rows.width))
            .with("rows", KeyField::dim(self.rows.rows))
            .with("eps", KeyField::Static(u64::from(self.epsilon.to_bits())))
            .with("wo", KeyField::Static(u64::from(self.weight_offset.to_bits())))
    }
}

impl CallContract for RmsNormSpec {
    /// The shape of `x` (and of the output), and its row count.
    type Checked = (Vec<usize>, usize);
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("x"), TensorArg::compute("weight")];

    /// `x` is `[..., H]` with the baked row count, if any; `weight` is `[H]`.
    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<(Vec<usize>, usize)> {
        let [x, weight] = [tensors[0], tensors[1]];
        let rows = rows::expect_rows("x", x, self.rows, self)?;
        if weight.shape() != [self.rows.width] {
            return Err(kvjit_core::shape_mismatch("weight", format!("[{}] (H of x)", self.rows.width), weight));
        }
        Ok((x.shape().to_vec(), rows))
    }

    fn outputs(&self, (shape, _): &(Vec<usize>, usize)) -> Vec<OutputSpec> {
        vec![(self.dtype, shape.clone())]
    }

    /// [`reference::rms_norm_row`] of every row in f64, rounded once.
    fn reference(&self, _: (Vec<usize>, usize), call: Call<'_, '_>) -> Result<()> {
        let [x, weight] = call.tensors();
        let weight: Vec<f64> = weight.to_f32_vec()?.into_iter().map(f64::from).collect();
        let mut y = Vec::with_capacity(x.numel());
        for row in x.to_f32_vec()?.chunks(self.rows.width) {
            y.extend(reference::rms_norm_row(row, &weight, self.epsilon, self.weight_offset));
        }
        kvjit_op::store_f64(&mut call.outputs[0], &y)
    }
}
