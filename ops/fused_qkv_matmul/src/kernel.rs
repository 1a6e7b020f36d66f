//! The op's kernels behind the runtime's [`Kernel`] interface.

use kvjit_core::{Error, KernelKey, PagedKVCacheCollection, Result, Tensor};
use kvjit_runtime::{DeviceContextPtr, Kernel, OutputSpec};

use crate::{CallShape, FusedQkvSpec, check_call, reference};

/// The reference implementation as a CPU kernel, for one kernel key.
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct ReferenceKernel {
    spec: FusedQkvSpec,
    key: KernelKey,
}

impl ReferenceKernel {
    /// The reference kernel for `spec`.
    pub fn new(spec: FusedQkvSpec) -> Self {
        Self { key: spec.kernel_key(), spec }
    }
}

/// Check a call's arguments against the contract and against what `spec`
/// baked in (dtypes, K, q_dim, the cache layout, static B and S).
pub(crate) fn check_against_spec(
    spec: &FusedQkvSpec,
    inputs: &[&Tensor],
    caches: &[&PagedKVCacheCollection],
) -> Result<CallShape> {
    let ([hidden, weight, layer_idx, valid_lengths], [cache]) = (inputs, caches) else {
        return Err(Error::ShapeMismatch {
            arg: "arguments".into(),
            expected: "4 tensors (hidden_state, weight, layer_idx, valid_lengths) and 1 KV cache".into(),
            got: vec![inputs.len(), caches.len()],
        });
    };
    if hidden.dtype() != spec.dtype {
        return Err(Error::DTypeMismatch { arg: "hidden_state".into(), expected: spec.dtype, got: hidden.dtype() });
    }
    let params = cache.params();
    for (what, expected, got) in [
        ("dtype", spec.cache_dtype.to_string(), params.dtype.to_string()),
        ("num_layers", spec.num_layers.to_string(), params.num_layers.to_string()),
        ("page_size", spec.page_size.to_string(), params.page_size.to_string()),
        ("num_kv_heads", spec.num_kv_heads.to_string(), params.num_kv_heads.to_string()),
        ("head_size", spec.head_size.to_string(), params.head_size.to_string()),
    ] {
        if expected != got {
            return Err(Error::CacheParamsMismatch { what, expected, got });
        }
    }
    let shape = check_call(hidden, weight, cache, layer_idx, valid_lengths)?;
    let dim_ok = |baked: Option<usize>, got: usize| baked.is_none_or(|b| b == got);
    if shape.k != spec.k || !dim_ok(spec.batch, shape.batch) || !dim_ok(spec.seq, shape.seq) {
        let dim = |d: Option<usize>, name: &str| d.map_or(name.to_string(), |v| v.to_string());
        return Err(Error::ShapeMismatch {
            arg: "hidden_state".into(),
            expected: format!(
                "[{}, {}, {}] (baked into {})",
                dim(spec.batch, "B"),
                dim(spec.seq, "S"),
                spec.k,
                spec.kernel_key()
            ),
            got: hidden.shape().to_vec(),
        });
    }
    if shape.q_dim != spec.q_dim {
        return Err(Error::ShapeMismatch {
            arg: "weight".into(),
            expected: format!("[{}, {}]", spec.n(), spec.k),
            got: weight.shape().to_vec(),
        });
    }
    Ok(shape)
}

impl Kernel for ReferenceKernel {
    fn key(&self) -> &KernelKey {
        &self.key
    }

    fn implementation(&self) -> &'static str {
        "reference"
    }

    fn check(&self, inputs: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<Vec<OutputSpec>> {
        let shape = check_against_spec(&self.spec, inputs, caches)?;
        Ok(vec![(self.spec.dtype, shape.output_shape())])
    }

    fn run(
        &self,
        inputs: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        _ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let shared: Vec<&PagedKVCacheCollection> = caches.iter().map(|c| &**c).collect();
        check_against_spec(&self.spec, inputs, &shared)?;
        let output_count = outputs.len();
        let ([hidden, weight, layer_idx, valid_lengths], [cache], [output]) = (inputs, caches, outputs) else {
            return Err(Error::ShapeMismatch {
                arg: "outputs".into(),
                expected: "1 output tensor".into(),
                got: vec![output_count],
            });
        };
        reference::fused_qkv_matmul(hidden, weight, cache, layer_idx, valid_lengths, output)?;
        Ok(())
    }
}
