//! The op's IR definition: parameters, signature, shape rules, spec, and
//! the kernels it builds per target.

use kvjit_core::{Backend, DType};
use kvjit_graph::{
    ArgSpec, GraphBuilder, GraphError, PagedParams, ValueId, ValueType, input_error, paged_cache_input, step_inputs,
    tensor_input,
};
use kvjit_op::checks::StepDims;
use kvjit_op::{Op, Specialized, add_node};

use crate::{Mask, MhaSpec};

/// The op's name in graphs (MAX's).
pub const OP_NAME: &str = "mo.mha.padded.paged";

kvjit_op::params! {
    /// The parameters of an attention node, for [`mha`].
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct MhaParams {
        /// Dtype of `q` and the output.
        dtype: DType,
        /// The mask.
        mask: Mask,
        /// Softmax scale; `None` writes no `scale` param (default 1/√D).
        scale: Option<f32>,
        /// Sliding window size, if any.
        local_window_size: Option<usize>,
        /// KV heads Hkv (the cache's).
        num_kv_heads: usize,
        /// Head size D (the cache's).
        head_size: usize,
        /// Tokens per cache page.
        page_size: usize,
    }
}

/// Add an attention node to `b`: `softmax(scale · q·Kᵀ) · V` over the paged
/// cache `kv` at layer `layer` for the valid queries of `q [B, S, Hq, D]`.
/// Returns the output `[B, S, Hq, D]`. The typed form of
/// `b.node(OP_NAME, params.to_params(), &[q, kv, layer, valid])`.
pub fn mha(
    b: &mut GraphBuilder<'_>,
    [q, kv, layer, valid]: [ValueId; 4],
    params: MhaParams,
) -> Result<ValueId, GraphError> {
    Ok(add_node::<MhaOp, 4>(b, &params, [q, kv, layer, valid])?[0])
}

/// Paged multi-head attention, `mo.mha.padded.paged`. Parameters: `dtype`,
/// `mask` (`causal` | `null`), optional `scale` (default 1/√D), optional
/// `local_window_size`, `num_kv_heads`, `head_size`, `page_size`. Inputs:
/// `q [B, S, Hq, D]`, `kv_collection`, `layer_idx` (u32 scalar),
/// `valid_lengths [B]` (u32). Output `[B, S, Hq, D]`. CPU kernels only
/// (the reference and the JIT); CUDA is refused. Register it as
/// `kvjit_op::Defined(MhaOp)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MhaOp;

impl Op for MhaOp {
    const NAME: &'static str = OP_NAME;
    const INPUTS: &'static [ArgSpec] =
        &[ArgSpec::tensor("q"), ArgSpec::KV_COLLECTION, ArgSpec::LAYER_IDX, ArgSpec::VALID_LENGTHS];
    type Params = MhaParams;
    type Spec = MhaSpec;
    type Cpu = crate::JitKernel;

    fn specialize(&self, params: &MhaParams, inputs: &[&ValueType], backend: Backend) -> Specialized<MhaSpec> {
        let &MhaParams { dtype, mask, scale, local_window_size: window, num_kv_heads, head_size, page_size } = params;
        if !dtype.is_compute_float() {
            return Err(GraphError::Param {
                param: "dtype".into(),
                problem: format!("must be f32, bf16 or f16, got {dtype}"),
            });
        }
        let scale = scale.unwrap_or_else(|| 1.0 / (head_size as f32).sqrt());

        let q = tensor_input(inputs, 0);
        let [batch, seq, hq, d] = match q.shape.as_slice() {
            [b, s, h, d] if q.dtype == dtype => [b, s, h, d],
            _ => return Err(input_error("q", format!("{dtype}[B, S, Hq, {head_size}]"), q)),
        };
        let (Some(num_heads), Some(d)) = (hq.as_static(), d.as_static()) else {
            return Err(input_error("q", format!("{dtype}[B, S, Hq, {head_size}] with static Hq and D"), q));
        };
        if d != head_size || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(input_error(
                "q",
                format!("{dtype}[B, S, Hq, {head_size}] with Hq a multiple of num_kv_heads = {num_kv_heads}"),
                q,
            ));
        }
        let paged = PagedParams { num_kv_heads, head_size, page_size };
        let cache = paged_cache_input(inputs, 1, paged, batch)?;
        step_inputs(inputs, [2, 3], batch)?;
        Ok(MhaSpec {
            backend,
            dtype,
            cache: cache.params(),
            num_heads,
            mask,
            window,
            scale,
            step: StepDims::of(batch, seq),
        })
    }
}
