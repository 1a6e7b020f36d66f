//! The op's kernels behind the runtime's [`Kernel`] interface.

use kvjit_core::{Error, KernelKey, PagedKVCacheCollection, Result, Tensor};
use kvjit_runtime::{DeviceContextPtr, Kernel, OutputSpec};

use crate::call::{WeightArg, check_call_with, check_output};
use crate::{CallShape, FusedQkvSpec, reference};

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
    check_against_spec_with(spec, inputs, caches, None)
}

/// [`check_against_spec`] for a kernel holding a prepared weight: a call
/// whose weight is that very tensor passes it as `[N, K]`.
pub(crate) fn check_against_spec_with(
    spec: &FusedQkvSpec,
    inputs: &[&Tensor],
    caches: &[&PagedKVCacheCollection],
    prepared_weight: Option<&Tensor>,
) -> Result<CallShape> {
    let ([hidden, weight, layer_idx, valid_lengths], [cache]) = (inputs, caches) else {
        return Err(Error::KernelArguments {
            expected: "4 tensors (hidden_state, weight, layer_idx, valid_lengths) and 1 KV cache",
            got: vec![inputs.len(), caches.len()],
        });
    };
    if hidden.dtype() != spec.dtype {
        return Err(Error::DTypeMismatch { arg: "hidden_state".into(), expected: spec.dtype, got: hidden.dtype() });
    }
    cache.params().expect_built_for(&spec.cache_params())?;
    let weight_arg = match prepared_weight {
        Some(prepared) if same_data(prepared, weight) => WeightArg::Prepared { n: spec.n(), k: spec.k },
        _ => WeightArg::Tensor(weight),
    };
    let shape = check_call_with(hidden, weight_arg, cache, layer_idx, valid_lengths)?;
    let dim_ok = |baked: Option<usize>, got: usize| baked.is_none_or(|b| b == got);
    if shape.k != spec.k || !dim_ok(spec.batch, shape.batch) || !dim_ok(spec.seq, shape.seq) {
        let dim = |d: Option<usize>, name: &str| d.map_or(name.to_string(), |v| v.to_string());
        return Err(Error::NotBuiltFor {
            arg: "hidden_state",
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
        return Err(Error::NotBuiltFor {
            arg: "weight",
            expected: format!("[{}, {}]", spec.n(), spec.k),
            got: vec![shape.n, shape.k],
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
        let call = checked_call(&self.spec, inputs, caches, outputs)?;
        reference::fused_qkv_matmul(
            call.hidden,
            call.weight,
            call.cache,
            call.layer_idx,
            call.valid_lengths,
            call.output,
        )?;
        Ok(())
    }
}

/// Whether `given` is the very tensor a kernel was built with (the same
/// allocation, dtype and shape), so a copy made from the constant at build —
/// packed panels, a device upload — may stand in for it. Equal contents in
/// another allocation do not count: a caller may change its own tensor
/// between calls.
pub(crate) fn same_data(constant: &Tensor, given: &Tensor) -> bool {
    constant.dtype() == given.dtype()
        && constant.shape() == given.shape()
        && std::ptr::eq(constant.as_bytes(), given.as_bytes())
}

/// A kernel call's arguments, unpacked, checked against the spec and each
/// other (including the output): where every target's `run` starts.
pub(crate) struct CheckedCall<'a> {
    pub shape: CallShape,
    pub hidden: &'a Tensor,
    pub weight: &'a Tensor,
    pub layer_idx: &'a Tensor,
    pub valid_lengths: &'a Tensor,
    pub cache: &'a mut PagedKVCacheCollection,
    pub output: &'a mut Tensor,
}

/// Unpack and check a `Kernel::run` call: 4 tensors, 1 cache, 1 output, all
/// valid for `spec`. Writes nothing.
pub(crate) fn checked_call<'a>(
    spec: &FusedQkvSpec,
    inputs: &[&'a Tensor],
    caches: &'a mut [&mut PagedKVCacheCollection],
    outputs: &'a mut [Tensor],
) -> Result<CheckedCall<'a>> {
    checked_call_with(spec, inputs, caches, outputs, None)
}

/// [`checked_call`] for a kernel holding a prepared weight.
pub(crate) fn checked_call_with<'a>(
    spec: &FusedQkvSpec,
    inputs: &[&'a Tensor],
    caches: &'a mut [&mut PagedKVCacheCollection],
    outputs: &'a mut [Tensor],
    prepared_weight: Option<&Tensor>,
) -> Result<CheckedCall<'a>> {
    let counts = vec![inputs.len(), caches.len(), outputs.len()];
    let (&[hidden, weight, layer_idx, valid_lengths], [cache], [output]) = (inputs, caches, outputs) else {
        return Err(Error::KernelArguments {
            expected: "4 tensors (hidden_state, weight, layer_idx, valid_lengths), 1 KV cache and 1 output",
            got: counts,
        });
    };
    let shape = check_against_spec_with(spec, inputs, &[&**cache], prepared_weight)?;
    check_output(&shape, spec.dtype, output)?;
    Ok(CheckedCall { shape, hidden, weight, layer_idx, valid_lengths, cache, output })
}
