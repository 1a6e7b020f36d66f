//! The op's IR definition: parameters, signature, shape rules, kernel key,
//! and the kernels it builds per target.

use std::sync::Arc;

use kvjit_core::{DType, KernelKey, Target};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, GraphError, OpDef, PagedParams, ParamKind, ParamSpec, ParamValue, Params, RecipeKind,
    TensorType, ValueId, ValueType, input_error, paged_cache_input, param_bool, param_dtype, param_usize, step_inputs,
    tensor_input,
};
use kvjit_jit::CaptureText;
use kvjit_runtime::{BuildOptions, ConstantInput, Kernel, KernelBuilder, KernelImpl, RuntimeError};

use crate::{JitKernel, ReferenceKernel, RopeSpec};

/// The op's name in graphs (MAX's).
pub const OP_NAME: &str = "mo.fused_qk_rope.padded.paged";

/// The parameters of a RoPE node, for [`fused_qk_rope`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeParams {
    /// Dtype of `q_proj`, `freqs_cis` and the output.
    pub dtype: DType,
    /// Rotate `(x[2j], x[2j+1])` (GGUF) rather than `(x[j], x[j + D/2])`
    /// (Hugging Face `rotate_half`).
    pub interleaved: bool,
    /// KV heads Hkv of the cache.
    pub num_kv_heads: usize,
    /// Head size D (of Q and of the cache).
    pub head_size: usize,
    /// Tokens per cache page.
    pub page_size: usize,
}

impl RopeParams {
    /// The node parameters as a graph file spells them.
    pub fn to_params(&self) -> Params {
        Params::from([
            ("dtype".to_string(), ParamValue::from(self.dtype)),
            ("interleaved".to_string(), ParamValue::from(self.interleaved)),
            ("num_kv_heads".to_string(), ParamValue::from(self.num_kv_heads)),
            ("head_size".to_string(), ParamValue::from(self.head_size)),
            ("page_size".to_string(), ParamValue::from(self.page_size)),
        ])
    }
}

/// Add a RoPE node to `b`: Q (`q_proj [B, S, Hq, D]`) rotated by position
/// into the returned value (`[B, S, Hq, D]`), and the K of this step's valid
/// tokens rotated in place in `kv_collection` at layer `layer_idx`. The
/// typed form of
/// `b.node(OP_NAME, params, &[q_proj, kv_collection, freqs_cis, layer_idx, valid_lengths])`.
pub fn fused_qk_rope(
    b: &mut GraphBuilder<'_>,
    [q_proj, kv_collection, freqs_cis, layer_idx, valid_lengths]: [ValueId; 5],
    params: RopeParams,
) -> Result<ValueId, GraphError> {
    Ok(b.node(OP_NAME, params.to_params(), &[q_proj, kv_collection, freqs_cis, layer_idx, valid_lengths])?[0])
}

/// The paged RoPE op. Parameters: `dtype` (f32, bf16, f16), `interleaved`,
/// `num_kv_heads`, `head_size` (even), `page_size`. Inputs:
/// `q_proj [B, S, Hq, D]`, `kv_collection`, `freqs_cis [max_seq, D]`,
/// `layer_idx` (u32 scalar), `valid_lengths [B]` (u32). Output:
/// `output [B, S, Hq, D]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeOp;

const INPUTS: &[ArgSpec] = &[
    ArgSpec::tensor("q_proj"),
    ArgSpec::cache("kv_collection"),
    ArgSpec::tensor("freqs_cis"),
    ArgSpec::layer_index("layer_idx"),
    ArgSpec::valid_lengths("valid_lengths"),
];

/// Largest head size the CPU kernel serves (its per-row cos/sin table lives
/// on the stack: `8·D` bytes, and for an FP8 cache a dequantized K head,
/// `4·D` more).
pub const MAX_JIT_HEAD_SIZE: usize = 1024;

impl RopeOp {
    /// Check params and inputs; return the kernel spec (with `target`).
    fn spec(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<RopeSpec, GraphError> {
        let dtype = param_dtype(params, "dtype")?;
        if !dtype.is_compute_float() {
            return Err(GraphError::Param {
                param: "dtype".into(),
                problem: format!("must be f32, bf16 or f16, got {dtype}"),
            });
        }
        let interleaved = param_bool(params, "interleaved", false)?;
        let num_kv_heads = param_usize(params, "num_kv_heads")?;
        let head_size = param_usize(params, "head_size")?;
        let page_size = param_usize(params, "page_size")?;
        if !head_size.is_multiple_of(2) {
            return Err(GraphError::Param {
                param: "head_size".into(),
                problem: format!("must be even (RoPE rotates pairs of elements), got {head_size}"),
            });
        }

        let q = tensor_input(inputs, 0);
        let expected_q = || format!("{dtype}[B, S, Hq, {head_size}] with Hq a multiple of {num_kv_heads}");
        let (batch, seq, num_q_heads) = match q.shape.as_slice() {
            [b, s, Dim::Static(hq), Dim::Static(d)]
                if q.dtype == dtype && *d == head_size && *hq > 0 && hq.is_multiple_of(num_kv_heads) =>
            {
                (b, s, *hq)
            }
            _ => return Err(input_error("q_proj", expected_q(), q)),
        };
        let paged = PagedParams { num_kv_heads, head_size, page_size };
        let cache = paged_cache_input(inputs, 1, paged, batch)?;
        let freqs = tensor_input(inputs, 2);
        if freqs.dtype != dtype || !matches!(freqs.shape.as_slice(), [_, Dim::Static(d)] if *d == head_size) {
            return Err(input_error("freqs_cis", format!("{dtype}[max_seq, {head_size}]"), freqs));
        }
        step_inputs(inputs, [3, 4], batch)?;
        Ok(RopeSpec {
            target,
            dtype,
            cache_dtype: cache.dtype,
            scale_granularity: cache.scale_granularity,
            interleaved,
            num_q_heads,
            num_kv_heads,
            head_size,
            page_size,
            num_layers: cache.num_layers,
            batch: batch.as_static(),
            seq: seq.as_static(),
        })
    }
}

impl OpDef for RopeOp {
    fn name(&self) -> &'static str {
        OP_NAME
    }

    fn params(&self) -> &'static [ParamSpec] {
        const PARAMS: &[ParamSpec] = &[
            ParamSpec::required("dtype", ParamKind::DType),
            ParamSpec::required("interleaved", ParamKind::Bool),
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
        Ok(vec![TensorType::new(spec.dtype, tensor_input(inputs, 0).shape.clone())])
    }

    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<KernelKey, GraphError> {
        Ok(self.spec(params, inputs, target)?.kernel_key())
    }

    /// CPU: head sizes the generated code handles (a multiple of 8, at most
    /// [`MAX_JIT_HEAD_SIZE`]), for an FP8 cache scale granularities that are
    /// multiples of 4, and offsets it can form; CUDA: none yet.
    fn supports(&self, key: &KernelKey) -> Result<(), String> {
        let spec = RopeSpec::from_kernel_key(key).ok_or_else(|| format!("{key} is not a key of {OP_NAME}"))?;
        match spec.target {
            Target::Cpu => crate::cpu_jit::supported(&spec).map_err(|e| e.to_string()),
            Target::Cuda => Err(format!("no CUDA variant for op {OP_NAME} yet")),
        }
    }

    /// Its `freqs_cis` table ([`RopeInit`](crate::RopeInit)).
    fn recipes(&self) -> &'static [RecipeKind] {
        const RECIPES: &[RecipeKind] = &[RecipeKind::of::<crate::RopeInit>()];
        RECIPES
    }
}

impl KernelBuilder for RopeOp {
    fn build(
        &self,
        key: &KernelKey,
        _constants: &[Option<ConstantInput>],
        options: &BuildOptions,
    ) -> kvjit_runtime::Result<Arc<dyn Kernel>> {
        let spec = RopeSpec::from_kernel_key(key)
            .ok_or_else(|| RuntimeError::Plan(format!("{key} is not a key of {OP_NAME}")))?;
        match (spec.target, options.implementation) {
            (Target::Cpu, KernelImpl::Reference) => Ok(Arc::new(ReferenceKernel::new(spec))),
            (Target::Cpu, KernelImpl::Fast) => {
                let capture = CaptureText { clif: options.keep_ir, disasm: options.keep_disasm };
                let kernel = JitKernel::new(spec, capture)
                    .map_err(|e| RuntimeError::Compile { key: key.to_string(), source: Box::new(e) })?;
                Ok(Arc::new(kernel))
            }
            (Target::Cuda, _) => Err(RuntimeError::NoImplementation {
                key: key.to_string(),
                reason: format!("no CUDA variant for op {OP_NAME} yet"),
            }),
        }
    }
}
