//! The op's definition: parameters, signature, shape rules, the spec of
//! its kernels, and the kernels it builds per target.

use kvjit_core::{Backend, DType};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, GraphError, PagedParams, TensorType, ValueId, ValueType, input_error,
    paged_cache_input, same_dim, step_inputs, tensor_input,
};
use kvjit_op::checks::StepDims;
use kvjit_op::{Built, Constants, Op, Specialized, add_node, built};
use kvjit_runtime::ConstantInput;

use crate::{CudaKernel, FusedQkvSpec, JitKernel, Sizes};

/// Canonical op name (MAX's function name).
pub const OP_NAME: &str = "generic_fused_qkv_matmul_kv_cache_bshd_paged";
/// The name MAX graphs use for the same op.
pub const OP_ALIAS: &str = "mo.fused_qkv_matmul.padded.paged";

kvjit_op::params! {
    /// The parameters of a fused QKV node, for [`fused_qkv_matmul`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct FusedQkvParams {
        /// Dtype of hidden state, weight and output.
        dtype: DType,
        /// KV heads Hkv.
        num_kv_heads: usize,
        /// Head size D.
        head_size: usize,
        /// Tokens per cache page.
        page_size: usize,
    }
}

/// Add a fused QKV node to `b`: `Q = (hidden_state · weightᵀ)[:, :q_dim]`
/// out, K and V into `kv_collection` at layer `layer_idx` for the valid
/// tokens. Returns Q (`[B, S, q_dim]`). The typed form of
/// `b.node(OP_NAME, params, &[hidden_state, weight, kv_collection, layer_idx, valid_lengths])`.
pub fn fused_qkv_matmul(
    b: &mut GraphBuilder<'_>,
    [hidden_state, weight, kv_collection, layer_idx, valid_lengths]: [ValueId; 5],
    params: FusedQkvParams,
) -> Result<ValueId, GraphError> {
    Ok(add_node::<FusedQkvOp, 5>(b, &params, [hidden_state, weight, kv_collection, layer_idx, valid_lengths])?[0])
}

/// The fused QKV matmul op. Parameters: `dtype` (f32, bf16, f16),
/// `num_kv_heads`, `head_size`, `page_size`. Inputs: `hidden_state [B, S, K]`,
/// `weight [N, K]`, `kv_collection`, `layer_idx` (u32 scalar),
/// `valid_lengths [B]` (u32). Output: `output [B, S, q_dim]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FusedQkvOp;

impl Op for FusedQkvOp {
    const NAME: &'static str = OP_NAME;
    const ALIASES: &'static [&'static str] = &[OP_ALIAS];
    const INPUTS: &'static [ArgSpec] = &[
        ArgSpec::tensor("hidden_state"),
        ArgSpec::tensor("weight"),
        ArgSpec::KV_COLLECTION,
        ArgSpec::LAYER_IDX,
        ArgSpec::VALID_LENGTHS,
    ];
    type Params = FusedQkvParams;
    type Spec = FusedQkvSpec;
    type Cpu = JitKernel;

    fn specialize(
        &self,
        params: &FusedQkvParams,
        inputs: &[&ValueType],
        backend: Backend,
    ) -> Specialized<FusedQkvSpec> {
        let &FusedQkvParams { dtype, num_kv_heads, head_size, page_size } = params;
        if !dtype.is_compute_float() {
            return Err(GraphError::Param {
                param: "dtype".into(),
                problem: format!("must be f32, bf16 or f16, got {dtype}"),
            });
        }
        let kv_dim = num_kv_heads.checked_mul(head_size).filter(|kv| kv.checked_mul(2).is_some()).ok_or_else(|| {
            GraphError::Param {
                param: "num_kv_heads".into(),
                problem: format!("times head_size ({num_kv_heads} * {head_size}) is too large"),
            }
        })?;

        let hidden = tensor_input(inputs, 0);
        let [batch, seq, k] = match hidden.shape.as_slice() {
            [b, s, k] if hidden.dtype == dtype => [b, s, k],
            _ => {
                return Err(input_error("hidden_state", format!("{dtype}[B, S, K]"), hidden));
            }
        };
        let Some(k_static) = k.as_static() else {
            return Err(input_error("hidden_state", format!("{dtype}[B, S, K] with a static K"), hidden));
        };
        let weight = tensor_input(inputs, 1);
        let n = match weight.shape.as_slice() {
            [Dim::Static(n), wk]
                if (weight.dtype == dtype || weight.dtype.is_block_format())
                    && same_dim(wk, k)
                    && k_static.is_multiple_of(weight.dtype.block().0)
                    && *n > 2 * kv_dim =>
            {
                *n
            }
            _ => {
                return Err(input_error(
                    "weight",
                    format!(
                        "{dtype}[q_dim + 2*{kv_dim}, {k}] with q_dim >= 1 (kv_dim = num_kv_heads*head_size; \
                         or that shape in a weight block format, K a multiple of its block)"
                    ),
                    weight,
                ));
            }
        };
        let paged = PagedParams { num_kv_heads, head_size, page_size };
        let cache = paged_cache_input(inputs, 2, paged, batch)?.params();
        step_inputs(inputs, [3, 4], batch)?;
        Ok(FusedQkvSpec {
            backend,
            dtype,
            weights: weight.dtype,
            cache,
            k: k_static,
            q_dim: n - 2 * kv_dim,
            step: StepDims::of(batch, seq),
            sizes: Sizes::Baked,
        })
    }

    fn infer(&self, spec: &FusedQkvSpec, inputs: &[&ValueType]) -> Vec<TensorType> {
        let hidden = tensor_input(inputs, 0);
        let shape = vec![hidden.shape[0].clone(), hidden.shape[1].clone(), Dim::Static(spec.q_dim)];
        vec![TensorType::new(spec.dtype, shape)]
    }

    /// A precompiled variant for the dtypes, K and row count.
    fn supports_cuda(&self, spec: &FusedQkvSpec) -> Result<(), String> {
        crate::cuda_kernel::choose_variants(spec).map(drop)
    }

    /// Picks the precompiled variants for the spec (refusing specs none
    /// serves) without touching a GPU; the kernel loads them on the device
    /// of the first context it runs on.
    fn build_cuda(&self, spec: &FusedQkvSpec, constants: &Constants) -> Built {
        let weight = constants.get(1).and_then(Option::as_ref).and_then(ConstantInput::plain).cloned();
        built(CudaKernel::new(*spec, weight)?)
    }

    /// The JIT kernel packs a constant weight into panels at build.
    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[1]
    }
}
