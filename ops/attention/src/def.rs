//! The op's IR definition: parameters, signature, shape rules, kernel key,
//! and the kernels it builds per target.

use std::sync::Arc;

use kvjit_core::{DType, KernelKey, Target};
use kvjit_graph::{
    ArgSpec, Dim, GraphBuilder, GraphError, OpDef, PagedParams, ParamKind, ParamSpec, ParamValue, Params, TensorType,
    ValueId, ValueType, input_error, paged_cache_input, param_choice, param_dtype, param_f64_opt, param_usize,
    param_usize_opt, step_inputs, tensor_input,
};
use kvjit_jit::CaptureText;
use kvjit_runtime::{BuildOptions, ConstantInput, Kernel, KernelBuilder, KernelImpl, RuntimeError};

use crate::{JitKernel, Mask, MhaSpec, ReferenceKernel};

/// The op's name in graphs (MAX's).
pub const OP_NAME: &str = "mo.mha.padded.paged";

/// What `supports` answers for every CUDA key.
pub const NO_CUDA: &str = "no CUDA variant for op mo.mha.padded.paged yet";

/// The parameters of an attention node, for [`mha`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MhaParams {
    /// Dtype of `q` and the output.
    pub dtype: DType,
    /// The mask.
    pub mask: Mask,
    /// Softmax scale; `None` writes no `scale` param (default 1/√D).
    pub scale: Option<f32>,
    /// Sliding window size, if any.
    pub local_window_size: Option<usize>,
    /// KV heads Hkv (the cache's).
    pub num_kv_heads: usize,
    /// Head size D (the cache's).
    pub head_size: usize,
    /// Tokens per cache page.
    pub page_size: usize,
}

impl MhaParams {
    /// The node parameters as a graph file spells them.
    pub fn to_params(&self) -> Params {
        let mut params = Params::from([
            ("dtype".to_string(), ParamValue::from(self.dtype)),
            ("mask".to_string(), ParamValue::from(self.mask.name())),
            ("num_kv_heads".to_string(), ParamValue::from(self.num_kv_heads)),
            ("head_size".to_string(), ParamValue::from(self.head_size)),
            ("page_size".to_string(), ParamValue::from(self.page_size)),
        ]);
        if let Some(scale) = self.scale {
            params.insert("scale".into(), ParamValue::Float(f64::from(scale)));
        }
        if let Some(window) = self.local_window_size {
            params.insert("local_window_size".into(), ParamValue::from(window));
        }
        params
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
    Ok(b.node(OP_NAME, params.to_params(), &[q, kv, layer, valid])?[0])
}

/// Paged multi-head attention, `mo.mha.padded.paged`. Parameters: `dtype`,
/// `mask` (`causal` | `null`), optional `scale` (default 1/√D), optional
/// `local_window_size`, `num_kv_heads`, `head_size`, `page_size`. Inputs:
/// `q [B, S, Hq, D]`, `kv_collection`, `layer_idx` (u32 scalar),
/// `valid_lengths [B]` (u32). Output `[B, S, Hq, D]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MhaOp;

const INPUTS: &[ArgSpec] = &[
    ArgSpec::tensor("q"),
    ArgSpec::cache("kv_collection"),
    ArgSpec::layer_index("layer_idx"),
    ArgSpec::valid_lengths("valid_lengths"),
];

impl MhaOp {
    /// Check params and inputs; return the kernel spec (with `target`).
    fn spec(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<MhaSpec, GraphError> {
        let dtype = param_dtype(params, "dtype")?;
        if !dtype.is_compute_float() {
            return Err(GraphError::Param {
                param: "dtype".into(),
                problem: format!("must be f32, bf16 or f16, got {dtype}"),
            });
        }
        let mask = Mask::from_name(param_choice(params, "mask", Mask::NAMES)?).expect("a listed choice");
        let num_kv_heads = param_usize(params, "num_kv_heads")?;
        let head_size = param_usize(params, "head_size")?;
        let page_size = param_usize(params, "page_size")?;
        let window = param_usize_opt(params, "local_window_size")?;
        let scale = match param_f64_opt(params, "scale")? {
            Some(scale) => scale as f32,
            None => 1.0 / (head_size as f32).sqrt(),
        };
        if !scale.is_finite() {
            return Err(GraphError::Param { param: "scale".into(), problem: "must be a finite f32".into() });
        }

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
            target,
            dtype,
            cache_dtype: cache.dtype,
            scale_granularity: cache.scale_granularity,
            num_heads,
            num_kv_heads,
            head_size,
            page_size,
            num_layers: cache.num_layers,
            mask,
            window,
            scale,
            batch: batch.as_static(),
            seq: seq.as_static(),
        })
    }
}

impl OpDef for MhaOp {
    fn name(&self) -> &'static str {
        OP_NAME
    }

    fn params(&self) -> &'static [ParamSpec] {
        const F32_MAX: f64 = f32::MAX as f64;
        const PARAMS: &[ParamSpec] = &[
            ParamSpec::required("dtype", ParamKind::DType),
            ParamSpec::required("mask", ParamKind::Choice(Mask::NAMES)),
            ParamSpec::optional("scale", ParamKind::Float { min: -F32_MAX, max: F32_MAX }),
            ParamSpec::optional("local_window_size", ParamKind::SIZE),
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
        let q = tensor_input(inputs, 0);
        let shape: Vec<Dim> = q.shape.clone();
        Ok(vec![TensorType::new(spec.dtype, shape)])
    }

    fn kernel_key(&self, params: &Params, inputs: &[&ValueType], target: Target) -> Result<KernelKey, GraphError> {
        Ok(self.spec(params, inputs, target)?.kernel_key())
    }

    /// CPU: head sizes (a multiple of 4, at most [`MAX_JIT_HEAD_SIZE`](crate::MAX_JIT_HEAD_SIZE))
    /// and offsets the generated code handles; CUDA: none yet.
    fn supports(&self, key: &KernelKey) -> Result<(), String> {
        let spec = MhaSpec::from_kernel_key(key).ok_or_else(|| format!("{key} is not a key of {OP_NAME}"))?;
        match spec.target {
            Target::Cpu => crate::cpu_jit::supported(&spec).map_err(|e| e.to_string()),
            Target::Cuda => Err(NO_CUDA.into()),
        }
    }
}

impl KernelBuilder for MhaOp {
    fn build(
        &self,
        key: &KernelKey,
        _constants: &[Option<ConstantInput>],
        options: &BuildOptions,
    ) -> kvjit_runtime::Result<Arc<dyn Kernel>> {
        let spec = MhaSpec::from_kernel_key(key)
            .ok_or_else(|| RuntimeError::Plan(format!("{key} is not a key of {OP_NAME}")))?;
        match (spec.target, options.implementation) {
            (Target::Cpu, KernelImpl::Reference) => Ok(Arc::new(ReferenceKernel::new(spec))),
            (Target::Cpu, KernelImpl::Fast) => {
                let capture = CaptureText { clif: options.keep_ir, disasm: options.keep_disasm };
                let kernel = JitKernel::new(spec, capture)
                    .map_err(|e| RuntimeError::Compile { key: key.to_string(), source: Box::new(e) })?;
                Ok(Arc::new(kernel))
            }
            (Target::Cuda, _) => Err(RuntimeError::NoImplementation { key: key.to_string(), reason: NO_CUDA.into() }),
        }
    }
}
