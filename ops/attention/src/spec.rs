//! [`MhaSpec`]: everything a kernel of the op bakes in — its canonical
//! name ([`KernelSpec`]) and how a call is checked against it
//! ([`CallContract`]).

use kvjit_core::{
    Backend, CodeTier, DType, KernelKey, KernelSpec, KeyField, KvCacheParams, PagedKVCacheCollection, Result, Tensor,
};
use kvjit_op::checks::{StepArgs, StepDims};
use kvjit_op::{Call, CallContract, Choice, KV_COLLECTION, TensorArg, checks};
use kvjit_runtime::OutputSpec;

use crate::call::{AttentionConfig, CallShape, check_call_for};

/// Short op name used in kernel keys and symbols.
pub const KERNEL_NAME: &str = "mha_padded_paged";

/// The attention mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mask {
    /// Query `s` sees key positions `p ≤ cache_length + s`.
    Causal,
    /// Every cached and new key of the sequence.
    Null,
}

/// Graph files spell a mask `causal` or `null`.
impl Choice for Mask {
    const NAMES: &'static [&'static str] = &["causal", "null"];

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "causal" => Some(Mask::Causal),
            "null" => Some(Mask::Null),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mask::Causal => "causal",
            Mask::Null => "null",
        }
    }
}

/// Everything a kernel for this op may bake in. `batch`/`seq` are `None`
/// when symbolic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MhaSpec {
    /// Target, and on the CPU the (resolved) code tier: `Cpu(Avx2)` runs
    /// decode through the AVX2 micro-kernel
    /// ([`kvjit_jit::attention_kernel`]), `Cpu(Cranelift)` is pure
    /// Cranelift code.
    pub backend: Backend,
    /// Dtype of `q` and the output.
    pub dtype: DType,
    /// The cache layout the kernel reads (Hkv, D, page size, layers, cache
    /// dtype and an FP8 cache's scale granularity).
    pub cache: KvCacheParams,
    /// Query heads Hq.
    pub num_heads: usize,
    /// The mask.
    pub mask: Mask,
    /// Sliding window: key positions `p > cache_length + s − window` only.
    pub window: Option<usize>,
    /// Softmax scale (finite).
    pub scale: f32,
    /// B and S, if static.
    pub step: StepDims,
}

impl MhaSpec {
    /// The code tier of a CPU spec (`None` for CUDA).
    pub fn tier(&self) -> Option<CodeTier> {
        self.backend.cpu_tier()
    }

    /// Head size D (the cache's).
    pub fn head_size(&self) -> usize {
        self.cache.head_size
    }

    /// KV heads Hkv (the cache's).
    pub fn num_kv_heads(&self) -> usize {
        self.cache.num_kv_heads
    }

    /// Query heads per KV head, Hq / Hkv.
    pub fn group(&self) -> usize {
        self.num_heads / self.cache.num_kv_heads
    }

    /// Whether the spec is one [`specialize`](kvjit_op::Op::specialize)
    /// could have made (the reason when not): a compute-float dtype, a
    /// finite scale, Hq ≥ 1 a multiple of Hkv, a valid cache layout.
    pub fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_compute_float() {
            return Err(format!("dtype must be f32, bf16 or f16, got {}", self.dtype));
        }
        if !self.scale.is_finite() {
            return Err(format!("the scale must be a finite f32, got {}", self.scale));
        }
        if let Err(e) = self.cache.validate() {
            return Err(format!("the cache layout is invalid: {e}"));
        }
        if self.num_heads == 0 || !self.num_heads.is_multiple_of(self.cache.num_kv_heads) {
            return Err(format!(
                "Hq = {} query heads must be a positive multiple of the cache's {} KV heads",
                self.num_heads, self.cache.num_kv_heads
            ));
        }
        Ok(())
    }
}

impl KernelSpec for MhaSpec {
    /// The canonical name, e.g.
    /// `mha_padded_paged.cpu-avx2.bf16.hq32.hkv8.d128.p16.l32.kvbf16.causal1.w0.sc1035098028.bany.s1`
    /// (the target names the CPU tier; `w0`: no window; `sc`: the f32 bit
    /// pattern of the scale).
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new(KERNEL_NAME, self.backend.target(), self.dtype);
        let key = match self.tier() {
            Some(tier) => key.with_variant(tier.name()),
            None => key,
        };
        let key = key.with("hq", KeyField::size(self.num_heads));
        let key = checks::with_cache_fields(key, &self.cache)
            .with("causal", KeyField::size(usize::from(self.mask == Mask::Causal)))
            .with("w", KeyField::size(self.window.unwrap_or(0)))
            .with("sc", KeyField::Static(u64::from(self.scale.to_bits())));
        self.step.named(key)
    }
}

/// Tensors `q [B, S, Hq, D]` (the dtype), `layer_idx` (u32 scalar),
/// `valid_lengths [B]` (u32); one cache; one output `[B, S, Hq, D]`.
impl CallContract for MhaSpec {
    type Checked = CallShape;
    const TENSORS: &'static [TensorArg] = kvjit_op::paged_tensors!["q"];
    const CACHES: &'static [&'static str] = KV_COLLECTION;

    /// The op's contract ([`check_call_for`] the spec's cache layout), then
    /// Hq and a static B or S against what the kernel baked in.
    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<CallShape> {
        let (&[q, layer_idx, valid_lengths], &[cache]) = (tensors, caches) else {
            unreachable!("the arity was checked against the signature")
        };
        let step = StepArgs { kv_collection: cache, layer_idx, valid_lengths };
        let shape = check_call_for(&self.cache, q, step, &AttentionConfig::from(self))?;
        let [b, s] = self.step.baked();
        let baked = [b, s, ("Hq", Some(self.num_heads)), ("D", Some(self.head_size()))];
        checks::expect_baked("q", q, &baked, self)?;
        Ok(shape)
    }

    fn outputs(&self, shape: &CallShape) -> Vec<OutputSpec> {
        vec![(self.dtype, shape.output_shape())]
    }

    fn reference(&self, _: CallShape, call: Call<'_, '_>) -> Result<()> {
        let [q, layer_idx, valid_lengths] = call.tensors();
        let config = AttentionConfig::from(self);
        crate::reference::mha(q, call.caches[0], layer_idx, valid_lengths, &config, &mut call.outputs[0])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvjit_core::CacheElement;

    use super::*;

    #[test]
    fn the_key_names_the_spec_and_holds_it() {
        let spec = MhaSpec {
            backend: Backend::Cpu(CodeTier::Cranelift),
            dtype: DType::BF16,
            cache: KvCacheParams {
                element: CacheElement::F16,
                num_layers: 32,
                page_size: 16,
                num_kv_heads: 8,
                head_size: 128,
            },
            num_heads: 32,
            mask: Mask::Causal,
            window: None,
            scale: 0.125,
            step: StepDims { batch: None, seq: Some(1) },
        };
        let key = spec.key();
        assert_eq!(
            key.to_string(),
            format!(
                "mha_padded_paged.cpu-cranelift.bf16.hq32.hkv8.d128.p16.l32.kvf16.causal1.w0.sc{}.bany.s1",
                0.125f32.to_bits()
            )
        );
        assert_eq!(key.spec::<MhaSpec>(), Some(&spec));
        spec.validate().unwrap();
        let windowed = MhaSpec { window: Some(64), mask: Mask::Null, ..spec };
        assert_eq!(windowed.key().spec::<MhaSpec>(), Some(&windowed));
        assert!(windowed.key().to_string().contains(".causal0.w64."), "{}", windowed.key());
        let bad = MhaSpec { num_heads: 30, ..spec };
        assert!(bad.validate().unwrap_err().contains("multiple"), "Hq % Hkv != 0");
        let not_float = MhaSpec { dtype: DType::U32, ..spec };
        assert!(not_float.validate().is_err());
        let infinite = MhaSpec { scale: f32::INFINITY, ..spec };
        let avx2 = MhaSpec { backend: Backend::Cpu(CodeTier::Avx2), ..spec };
        assert!(avx2.key().to_string().starts_with("mha_padded_paged.cpu-avx2.bf16."), "{}", avx2.key());
        assert_eq!(avx2.key().spec::<MhaSpec>(), Some(&avx2));
        assert_ne!(avx2.key(), spec.key());
        assert!(infinite.validate().is_err());
    }

    #[test]
    fn masks_are_spelled_as_graph_files_spell_them() {
        for mask in [Mask::Causal, Mask::Null] {
            assert_eq!(Mask::from_name(mask.name()), Some(mask));
        }
        assert_eq!(Mask::NAMES, ["causal", "null"]);
        assert_eq!(Mask::from_name("full"), None);
    }
}
