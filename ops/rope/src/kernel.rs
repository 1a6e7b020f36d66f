//! The op's kernels behind the runtime's [`Kernel`] interface: the argument
//! unpacking and spec checks every target shares, and the reference kernel.

use kvjit_core::{Error, KernelKey, PagedKVCacheCollection, Result, Tensor};
use kvjit_runtime::{DeviceContextPtr, Kernel, OutputSpec};

use crate::call::{check_call, check_output};
use crate::{CallShape, RopeSpec, reference};

/// Check a call's arguments against the contract and against what `spec`
/// baked in (dtypes, the cache layout, Hq, static B and S).
pub(crate) fn check_against_spec(
    spec: &RopeSpec,
    inputs: &[&Tensor],
    caches: &[&PagedKVCacheCollection],
) -> Result<CallShape> {
    let ([q_proj, freqs_cis, layer_idx, valid_lengths], [cache]) = (inputs, caches) else {
        return Err(Error::KernelArguments {
            expected: "4 tensors (q_proj, freqs_cis, layer_idx, valid_lengths) and 1 KV cache",
            got: vec![inputs.len(), caches.len()],
        });
    };
    if q_proj.dtype() != spec.dtype {
        return Err(Error::DTypeMismatch { arg: "q_proj".into(), expected: spec.dtype, got: q_proj.dtype() });
    }
    cache.params().expect_built_for(&spec.cache_params())?;
    let shape = check_call(q_proj, cache, freqs_cis, layer_idx, valid_lengths)?;
    let dim_ok = |baked: Option<usize>, got: usize| baked.is_none_or(|b| b == got);
    if shape.num_q_heads != spec.num_q_heads || !dim_ok(spec.batch, shape.batch) || !dim_ok(spec.seq, shape.seq) {
        let dim = |d: Option<usize>, name: &str| d.map_or(name.to_string(), |v| v.to_string());
        return Err(Error::NotBuiltFor {
            arg: "q_proj",
            expected: format!(
                "[{}, {}, {}, {}] (baked into {})",
                dim(spec.batch, "B"),
                dim(spec.seq, "S"),
                spec.num_q_heads,
                spec.head_size,
                spec.kernel_key()
            ),
            got: q_proj.shape().to_vec(),
        });
    }
    Ok(shape)
}

/// A kernel call's arguments, unpacked, checked against the spec and each
/// other (including the output): where every target's `run` starts.
pub(crate) struct CheckedCall<'a> {
    pub shape: CallShape,
    pub q_proj: &'a Tensor,
    pub freqs_cis: &'a Tensor,
    pub layer_idx: &'a Tensor,
    pub valid_lengths: &'a Tensor,
    pub cache: &'a mut PagedKVCacheCollection,
    pub output: &'a mut Tensor,
}

/// Unpack and check a `Kernel::run` call: 4 tensors, 1 cache, 1 output, all
/// valid for `spec`. Writes nothing.
pub(crate) fn checked_call<'a>(
    spec: &RopeSpec,
    inputs: &[&'a Tensor],
    caches: &'a mut [&mut PagedKVCacheCollection],
    outputs: &'a mut [Tensor],
) -> Result<CheckedCall<'a>> {
    let counts = vec![inputs.len(), caches.len(), outputs.len()];
    let (&[q_proj, freqs_cis, layer_idx, valid_lengths], [cache], [output]) = (inputs, caches, outputs) else {
        return Err(Error::KernelArguments {
            expected: "4 tensors (q_proj, freqs_cis, layer_idx, valid_lengths), 1 KV cache and 1 output",
            got: counts,
        });
    };
    let shape = check_against_spec(spec, inputs, &[&**cache])?;
    check_output(&shape, spec.dtype, output)?;
    Ok(CheckedCall { shape, q_proj, freqs_cis, layer_idx, valid_lengths, cache, output })
}

/// The reference implementation as a CPU kernel, for one kernel key.
///
/// Tensor inputs, in order: `q_proj`, `freqs_cis`, `layer_idx`,
/// `valid_lengths`; one cache; one output.
pub struct ReferenceKernel {
    spec: RopeSpec,
    key: KernelKey,
}

impl ReferenceKernel {
    /// The reference kernel for `spec`.
    pub fn new(spec: RopeSpec) -> Self {
        Self { key: spec.kernel_key(), spec }
    }
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
        reference::fused_qk_rope(
            call.q_proj,
            call.cache,
            call.freqs_cis,
            call.layer_idx,
            call.valid_lengths,
            self.spec.interleaved,
            call.output,
        )?;
        Ok(())
    }
}
