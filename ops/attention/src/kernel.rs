//! The op's kernels behind the runtime's [`Kernel`] interface, and the
//! check every kernel of a key runs.

use kvjit_core::{Error, KernelKey, PagedKVCacheCollection, Result, Tensor};
use kvjit_runtime::{DeviceContextPtr, Kernel, OutputSpec};

use crate::call::{AttentionConfig, CallShape, check_call, check_output};
use crate::{MhaSpec, reference};

/// Check a call's arguments (tensors `q`, `layer_idx`, `valid_lengths`; one
/// cache) against the contract and against what `spec` baked in (dtypes,
/// Hq, the cache layout, static B and S).
pub(crate) fn check_against_spec(
    spec: &MhaSpec,
    inputs: &[&Tensor],
    caches: &[&PagedKVCacheCollection],
) -> Result<CallShape> {
    let ([q, layer_idx, valid_lengths], [cache]) = (inputs, caches) else {
        return Err(Error::KernelArguments {
            expected: "3 tensors (q, layer_idx, valid_lengths) and 1 KV cache",
            got: vec![inputs.len(), caches.len()],
        });
    };
    if q.dtype() != spec.dtype {
        return Err(Error::DTypeMismatch { arg: "q".into(), expected: spec.dtype, got: q.dtype() });
    }
    cache.params().expect_built_for(&spec.cache_params())?;
    let shape = check_call(q, cache, layer_idx, valid_lengths, &AttentionConfig::from(spec))?;
    let dim_ok = |baked: Option<usize>, got: usize| baked.is_none_or(|b| b == got);
    if shape.num_heads != spec.num_heads || !dim_ok(spec.batch, shape.batch) || !dim_ok(spec.seq, shape.seq) {
        let dim = |d: Option<usize>, name: &str| d.map_or(name.to_string(), |v| v.to_string());
        return Err(Error::NotBuiltFor {
            arg: "q",
            expected: format!(
                "[{}, {}, {}, {}] (baked into {})",
                dim(spec.batch, "B"),
                dim(spec.seq, "S"),
                spec.num_heads,
                spec.head_size,
                spec.kernel_key()
            ),
            got: q.shape().to_vec(),
        });
    }
    Ok(shape)
}

/// A `Kernel::run` call's arguments, unpacked and checked (output included).
pub(crate) struct CheckedCall<'a> {
    pub shape: CallShape,
    pub q: &'a Tensor,
    pub layer_idx: &'a Tensor,
    pub valid_lengths: &'a Tensor,
    pub cache: &'a PagedKVCacheCollection,
    pub output: &'a mut Tensor,
}

/// Unpack and check a `Kernel::run` call: 3 tensors, 1 cache, 1 output, all
/// valid for `spec`. Writes nothing.
pub(crate) fn checked_call<'a>(
    spec: &MhaSpec,
    inputs: &[&'a Tensor],
    caches: &'a mut [&mut PagedKVCacheCollection],
    outputs: &'a mut [Tensor],
) -> Result<CheckedCall<'a>> {
    let counts = vec![inputs.len(), caches.len(), outputs.len()];
    let (&[q, layer_idx, valid_lengths], [cache], [output]) = (inputs, caches, outputs) else {
        return Err(Error::KernelArguments {
            expected: "3 tensors (q, layer_idx, valid_lengths), 1 KV cache and 1 output",
            got: counts,
        });
    };
    let cache: &PagedKVCacheCollection = cache;
    let shape = check_against_spec(spec, inputs, &[cache])?;
    check_output(&shape, spec.dtype, output)?;
    Ok(CheckedCall { shape, q, layer_idx, valid_lengths, cache, output })
}

/// The reference implementation as a CPU kernel, for one kernel key.
///
/// Tensor inputs, in order: `q`, `layer_idx`, `valid_lengths`; one cache;
/// one output.
pub struct ReferenceKernel {
    spec: MhaSpec,
    key: KernelKey,
}

impl ReferenceKernel {
    /// The reference kernel for `spec`.
    pub fn new(spec: MhaSpec) -> Self {
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
        reference::mha(
            call.q,
            call.cache,
            call.layer_idx,
            call.valid_lengths,
            &AttentionConfig::from(&self.spec),
            call.output,
        )?;
        Ok(())
    }
}
