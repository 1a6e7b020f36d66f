//! [`RopeSpec`]: everything this op's kernels bake in, its canonical name,
//! and the call contract every kernel of the op checks.

use kvjit_core::{DType, KernelKey, KernelSpec, KeyField, KvCacheParams, PagedKVCacheCollection, Result, Tensor};
use kvjit_op::checks::{StepArgs, StepDims, expect_baked, with_cache_fields};
use kvjit_op::{Call, CallContract, KV_COLLECTION, TensorArg};
use kvjit_runtime::OutputSpec;

use crate::{CallShape, check_call, reference};

/// Short op name used in kernel keys and symbols.
pub const KERNEL_NAME: &str = "fused_qk_rope_paged";

/// Everything a kernel for this op may bake in. `batch`/`seq` are `None`
/// when symbolic. The JIT's machine code depends on neither (its work items
/// are token rows), so every (B, S) of one layout shares one compiled body;
/// they stay in the key so a kernel built for static dims refuses others.
///
/// The freqs table's length (`max_seq`) is not part of the key: the kernel
/// reads rows of it at positions the host checked against its run-time
/// shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RopeSpec {
    /// Target.
    pub target: kvjit_core::Target,
    /// Dtype of `q_proj`, `freqs_cis` and the output.
    pub dtype: DType,
    /// The cache layout (K is read in its dtype, rotated in f32 and rounded
    /// back to it).
    pub cache: KvCacheParams,
    /// Pairs are `(x[2j], x[2j+1])` (GGUF) rather than `(x[j], x[j + D/2])`.
    pub interleaved: bool,
    /// Query heads Hq (a multiple of Hkv).
    pub num_q_heads: usize,
    /// B and S, if static.
    pub step: StepDims,
}

impl RopeSpec {
    /// Head size D.
    pub fn head_size(&self) -> usize {
        self.cache.head_size
    }

    /// The same spec with B and S symbolic: the key the JIT compiles (and
    /// caches) the machine code under, shared by every (B, S).
    pub fn generic(&self) -> Self {
        Self { step: StepDims::ANY, ..*self }
    }
}

impl KernelSpec for RopeSpec {
    /// E.g. `fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvbf16.il0.bany.s1`.
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new(KERNEL_NAME, self.target, self.dtype).with("hq", KeyField::size(self.num_q_heads));
        self.step.named(with_cache_fields(key, &self.cache).with("il", KeyField::Static(u64::from(self.interleaved))))
    }
}

impl CallContract for RopeSpec {
    type Checked = CallShape;
    const TENSORS: &'static [TensorArg] = kvjit_op::paged_tensors!["q_proj", "freqs_cis"];
    const CACHES: &'static [&'static str] = KV_COLLECTION;

    /// The contract ([`check_call`]) against the cache layout, Hq, D and
    /// the static B and S this spec baked in.
    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<CallShape> {
        let (&[q_proj, freqs_cis, layer_idx, valid_lengths], [cache]) = (tensors, caches) else {
            unreachable!("the arity was checked against the signature")
        };
        cache.params().expect_built_for(&self.cache)?;
        let shape = check_call(q_proj, freqs_cis, StepArgs { kv_collection: cache, layer_idx, valid_lengths })?;
        let [b, s] = self.step.baked();
        expect_baked(
            "q_proj",
            q_proj,
            &[b, s, ("Hq", Some(self.num_q_heads)), ("D", Some(self.cache.head_size))],
            self,
        )?;
        Ok(shape)
    }

    fn outputs(&self, shape: &CallShape) -> Vec<OutputSpec> {
        vec![(self.dtype, shape.output_shape())]
    }

    fn reference(&self, _: CallShape, call: Call<'_, '_>) -> Result<()> {
        let [q_proj, freqs_cis, layer_idx, valid_lengths] = call.tensors();
        let (cache, output) = (&mut *call.caches[0], &mut call.outputs[0]);
        reference::fused_qk_rope(q_proj, cache, freqs_cis, layer_idx, valid_lengths, self.interleaved, output)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvjit_core::Target;

    use kvjit_core::CacheElement;

    use super::*;

    #[test]
    fn the_key_holds_the_spec_and_names_it() {
        let cache = KvCacheParams {
            element: CacheElement::F32,
            num_layers: 32,
            page_size: 16,
            num_kv_heads: 8,
            head_size: 128,
        };
        let spec = RopeSpec {
            target: Target::Cpu,
            dtype: DType::BF16,
            cache,
            interleaved: false,
            num_q_heads: 32,
            step: StepDims { batch: None, seq: Some(1) },
        };
        let key = spec.key();
        assert_eq!(key.to_string(), "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvf32.il0.bany.s1");
        assert_eq!(key.spec::<RopeSpec>(), Some(&spec));
        let interleaved = RopeSpec { interleaved: true, ..spec };
        assert_ne!(interleaved.key(), key);
        assert_eq!(
            spec.generic().key().to_string(),
            "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvf32.il0.bany.sany"
        );
        let other = KernelKey::new("reshape", Target::Cpu, DType::F32);
        assert_eq!(other.spec::<RopeSpec>(), None);
    }
}
