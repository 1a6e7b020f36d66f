//! The op's IR definition: parameters, signature, shape rules, kernel key,
//! and the kernels it builds per target.

use std::sync::Arc;

use kvjit_core::{DType, KernelKey, Target};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, GraphError, OpDef, PagedParams, ParamKind, ParamSpec, ParamValue, Params, TensorType,
    ValueId, ValueType, input_error, paged_cache_input, param_dtype, param_usize, same_dim, step_inputs, tensor_input,
};
use kvjit_jit::CaptureText;
use kvjit_runtime::{BuildOptions, ConstantInput, Kernel, KernelBuilder, KernelImpl, RuntimeError};

use crate::{FusedQkvSpec, JitKernel, ReferenceKernel};

/// Canonical op name (MAX's function name).
pub const OP_NAME: &str = "generic_fused_qkv_matmul_kv_cache_bshd_paged";
/// The name MAX graphs use for the same op.
pub const OP_ALIAS: &str = "mo.fused_qkv_matmul.padded.paged";

/// The parameters of a fused QKV node, for [`fused_qkv_matmul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedQkvParams {
    /// Dtype of hidden state, weight and output.
    pub dtype: DType,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per cache page.
    pub page_size: usize,
}

impl FusedQkvParams {
    /// The node parameters as a graph file spells them.
    pub fn to_params(&self) -> Params {
        Params::from([
            ("dtype".to_string(), ParamValue::from(self.dtype)),
            ("num_kv_heads".to_string(), ParamValue::from(self.num_kv_heads)),
            ("head_size".to_string(), ParamValue::from(self.head_size)),
            ("page_size".to_string(), ParamValue::from(self.page_size)),
        ])
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
    Ok(b.node(OP_NAME, params.to_params(), &[hidden_state, weight, kv_collection, layer_idx, valid_lengths])?[0])
}

/// The fused QKV matmul op. Parameters: `dtype` (f32, bf16, f16),
/// `num_kv_heads`, `head_size`, `page_size`. Inputs: `hidden_state [B, S, K]`,
/// `weight [N, K]`, `kv_collection`, `layer_idx` (u32 scalar),
/// `valid_lengths [B]` (u32). Output: `output [B, S, q_dim]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FusedQkvOp;

const INPUTS: &[ArgSpec] = &[
    ArgSpec::tensor("hidden_state"),
    ArgSpec::tensor("weight"),
    ArgSpec::cache("kv_collection"),
    ArgSpec::layer_index("layer_idx"),
    ArgSpec::valid_lengths("valid_lengths"),
];

impl FusedQkvOp {
    /// Check params and inputs; return the kernel spec (with `target`).
    fn spec(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<FusedQkvSpec, GraphError> {
        let dtype = param_dtype(params, "dtype")?;
        if !dtype.is_compute_float() {
            return Err(GraphError::Param {
                param: "dtype".into(),
                problem: format!("must be f32, bf16 or f16, got {dtype}"),
            });
        }
        let num_kv_heads = param_usize(params, "num_kv_heads")?;
        let head_size = param_usize(params, "head_size")?;
        let page_size = param_usize(params, "page_size")?;
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
            [Dim::Static(n), wk] if weight.dtype == dtype && same_dim(wk, k) && *n > 2 * kv_dim => *n,
            _ => {
                return Err(input_error(
                    "weight",
                    format!("{dtype}[q_dim + 2*{kv_dim}, {k}] with q_dim >= 1 (kv_dim = num_kv_heads*head_size)"),
                    weight,
                ));
            }
        };
        let paged = PagedParams { num_kv_heads, head_size, page_size };
        let cache = paged_cache_input(inputs, 2, paged, batch)?;
        step_inputs(inputs, [3, 4], batch)?;
        Ok(FusedQkvSpec {
            target,
            dtype,
            cache_dtype: cache.dtype,
            scale_granularity: cache.scale_granularity,
            k: k_static,
            q_dim: n - 2 * kv_dim,
            num_kv_heads,
            head_size,
            page_size,
            num_layers: cache.num_layers,
            batch: batch.as_static(),
            seq: seq.as_static(),
        })
    }
}

impl OpDef for FusedQkvOp {
    fn name(&self) -> &'static str {
        OP_NAME
    }

    fn aliases(&self) -> &'static [&'static str] {
        &[OP_ALIAS]
    }

    fn params(&self) -> &'static [ParamSpec] {
        const PARAMS: &[ParamSpec] = &[
            ParamSpec::required("dtype", ParamKind::DType),
            ParamSpec::required("num_kv_heads", ParamKind::SIZE),
            ParamSpec::required("head_size", ParamKind::SIZE),
            ParamSpec::required("page_size", ParamKind::SIZE),
        ];
        PARAMS
    }

    fn inputs(&self) -> &'static [ArgSpec] {
        INPUTS
    }

    fn outputs(&self) -> &'static [&'static str] {
        &["output"]
    }

    fn infer(&self, params: &Params, inputs: &[&ValueType]) -> Result<Vec<TensorType>, GraphError> {
        let spec = self.spec(params, inputs, Target::Cpu)?;
        let hidden = tensor_input(inputs, 0);
        let shape = vec![hidden.shape[0].clone(), hidden.shape[1].clone(), Dim::Static(spec.q_dim)];
        Ok(vec![TensorType::new(spec.dtype, shape)])
    }

    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<KernelKey, GraphError> {
        Ok(self.spec(params, inputs, target)?.kernel_key())
    }

    /// The JIT kernel packs a constant weight into panels at build.
    fn packed_constant_inputs(&self) -> &'static [usize] {
        &[1]
    }

    /// CPU: sizes the generated code can address; CUDA: a precompiled
    /// variant for the dtypes, K and row count.
    fn supports(&self, key: &KernelKey) -> Result<(), String> {
        let spec = FusedQkvSpec::from_kernel_key(key).ok_or_else(|| format!("{key} is not a key of {OP_NAME}"))?;
        match spec.target {
            Target::Cpu => crate::cpu_jit::addressable(&spec).map_err(|e| e.to_string()),
            Target::Cuda => crate::cuda_kernel::choose_variants(&spec).map(|_| ()),
        }
    }
}

impl KernelBuilder for FusedQkvOp {
    fn build(
        &self,
        key: &KernelKey,
        constants: &[Option<ConstantInput>],
        options: &BuildOptions,
    ) -> kvjit_runtime::Result<Arc<dyn Kernel>> {
        let spec = FusedQkvSpec::from_kernel_key(key)
            .ok_or_else(|| RuntimeError::Plan(format!("{key} is not a key of {OP_NAME}")))?;
        match (spec.target, options.implementation) {
            (Target::Cpu, KernelImpl::Reference) => Ok(Arc::new(ReferenceKernel::new(spec))),
            (Target::Cpu, KernelImpl::Fast) => {
                let capture = CaptureText { clif: options.keep_ir, disasm: options.keep_disasm };
                let compile_error = |e: Box<dyn std::error::Error + Send + Sync>| RuntimeError::Compile {
                    key: key.to_string(),
                    source: e,
                };
                let kernel = match constants.get(1).and_then(Option::as_ref) {
                    Some(ConstantInput::Prepared(prepared)) => JitKernel::with_prepared_weight(
                        spec,
                        prepared,
                        capture,
                        options.specialize_shapes,
                        options.cpu_tier,
                    )
                    .map_err(|e| compile_error(Box::new(e)))?,
                    weight => {
                        let weight = weight.and_then(ConstantInput::plain).cloned();
                        JitKernel::with_tier(spec, weight, capture, options.specialize_shapes, options.cpu_tier)
                            .map_err(|e| compile_error(Box::new(e)))?
                    }
                };
                Ok(Arc::new(kernel))
            }
            (Target::Cuda, KernelImpl::Reference) => Err(RuntimeError::NoImplementation {
                key: key.to_string(),
                reason: "the reference implementation runs on the CPU only (use the CPU target to check results)"
                    .into(),
            }),
            // Picks the precompiled variants for the key (refusing keys none
            // serves) without touching a GPU; the kernel loads them on the
            // device of the first context it runs on.
            (Target::Cuda, KernelImpl::Fast) => {
                let weight = constants.get(1).and_then(Option::as_ref).and_then(ConstantInput::plain).cloned();
                Ok(Arc::new(crate::CudaKernel::new(spec, weight)?))
            }
        }
    }
}
