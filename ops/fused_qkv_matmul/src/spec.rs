//! [`FusedQkvSpec`]: everything a kernel of this op bakes in, its one
//! canonical name, and the call contract every kernel of the op shares.

use kvjit_core::{
    Backend, CodeTier, DType, KernelKey, KernelSpec, KeyField, KvCacheParams, PagedKVCacheCollection, Result, Tensor,
};
use kvjit_op::checks::{StepArgs, StepDims, expect_baked, with_cache_fields_as};
use kvjit_op::{Call, CallContract, KV_COLLECTION, TensorArg};
use kvjit_runtime::OutputSpec;

use crate::call::{CheckedCall, WeightArg, check_shapes};

/// Short op name used in kernel keys, symbols and benchmark ids.
pub const KERNEL_NAME: &str = "fused_qkv_bshd_paged";

/// Which sizes a kernel's code bakes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Sizes {
    /// Every size of the spec (B and S when static): what `specialize`
    /// makes.
    #[default]
    Baked,
    /// None but the dtypes: the unspecialized baseline kernel, which reads
    /// K, the column counts and the cache's K→V stride at run time; one
    /// compiled kernel serves every spec of its dtypes, and its key says so
    /// (`…kany.qany.hkvany…`). Calls are still checked against every size
    /// of the spec.
    Runtime,
}

/// Everything a kernel for this op may bake in. `batch`/`seq` are `None`
/// when symbolic (the kernel reads them at run time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusedQkvSpec {
    /// Target, and on the CPU the (resolved) code tier.
    pub backend: Backend,
    /// Dtype of hidden state and output (and of a float weight).
    pub dtype: DType,
    /// The weight's dtype: `dtype`, or a weight block format
    /// ([`DType::BLOCK_FORMATS`], the CPU's 256-bit tier decoding it as it
    /// reads, the Cranelift tier from f32 panels).
    pub weights: DType,
    /// The layout of the cache K and V are written into.
    pub cache: KvCacheParams,
    /// Hidden size K.
    pub k: usize,
    /// Q columns.
    pub q_dim: usize,
    /// B and S, if static.
    pub step: StepDims,
    /// Which sizes the code bakes in.
    pub sizes: Sizes,
}

impl FusedQkvSpec {
    /// K (or V) columns: Hkv·D.
    pub fn kv_dim(&self) -> usize {
        self.cache.kv_dim()
    }

    /// Elements from a token's K to its V in the cache's blocks:
    /// `L · page_size · Hkv · D`.
    pub fn kv_stride(&self) -> usize {
        self.cache.num_layers * self.cache.page_size * self.kv_dim()
    }

    /// All weight rows N = q_dim + 2·kv_dim.
    pub fn n(&self) -> usize {
        self.q_dim + 2 * self.kv_dim()
    }

    /// The code tier of a CPU spec (`None` for CUDA).
    pub fn tier(&self) -> Option<CodeTier> {
        self.backend.cpu_tier()
    }

    /// The spec with B and S left to run time (a generic kernel's).
    pub fn generic(&self) -> Self {
        Self { step: StepDims::ANY, ..*self }
    }
}

impl KernelSpec for FusedQkvSpec {
    /// `fused_qkv_bshd_paged.cpu-avx2.bf16.k4096.q4096.hkv8.d128.p16.l32.kvbf16.bany.s1`:
    /// the CPU tier in the target, then K, q_dim, the cache layout, B and S
    /// (and a block weight's format: `…s1.wq4_1`).
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new(KERNEL_NAME, self.backend.target(), self.dtype);
        let key = match self.tier() {
            Some(tier) => key.with_variant(tier.name()),
            None => key,
        };
        let size = |n: usize| match self.sizes {
            Sizes::Baked => KeyField::size(n),
            Sizes::Runtime => KeyField::Dynamic,
        };
        let dim = |d: Option<usize>| match self.sizes {
            Sizes::Baked => KeyField::dim(d),
            Sizes::Runtime => KeyField::Dynamic,
        };
        let key = key.with("k", size(self.k)).with("q", size(self.q_dim));
        let key =
            with_cache_fields_as(key, &self.cache, size).with("b", dim(self.step.batch)).with("s", dim(self.step.seq));
        match self.weights == self.dtype {
            true => key,
            false => key.with("w", KeyField::DType(self.weights)),
        }
    }
}

impl CallContract for FusedQkvSpec {
    type Checked = CheckedCall;
    const TENSORS: &'static [TensorArg] = &[
        TensorArg::compute("hidden_state"),
        TensorArg::checked("weight"),
        TensorArg::LAYER_IDX,
        TensorArg::VALID_LENGTHS,
    ];
    const CACHES: &'static [&'static str] = KV_COLLECTION;

    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<CheckedCall> {
        check_against(self, tensors, caches, None)
    }

    fn outputs(&self, checked: &CheckedCall) -> Vec<OutputSpec> {
        vec![(self.dtype, checked.shape.output_shape())]
    }

    fn reference(&self, checked: CheckedCall, call: Call<'_, '_>) -> Result<()> {
        let [hidden, weight, _, valid_lengths] = call.tensors();
        crate::reference::write(&checked.shape, hidden, weight, call.caches[0], valid_lengths, &mut call.outputs[0])
    }
}

/// The spec's check, for a kernel that may hold a prepared weight: a call
/// whose weight is that very tensor passes it as `[N, K]`.
pub(crate) fn check_against(
    spec: &FusedQkvSpec,
    tensors: &[&Tensor],
    caches: &[&PagedKVCacheCollection],
    prepared_weight: Option<&Tensor>,
) -> Result<CheckedCall> {
    let (&[hidden, weight, layer_idx, valid_lengths], &[cache]) = (tensors, caches) else {
        unreachable!("the arity was checked against the signature")
    };
    let weight_arg = match prepared_weight {
        Some(prepared) if kvjit_op::gemm::same_data(prepared, weight) => WeightArg::Prepared { n: spec.n(), k: spec.k },
        _ => {
            kvjit_core::expect_arg("weight", weight, spec.weights)?;
            WeightArg::Tensor(weight)
        }
    };
    let checked =
        check_shapes(hidden, weight_arg, StepArgs { kv_collection: cache, layer_idx, valid_lengths }, &spec.cache)?;
    let [b, s] = spec.step.baked();
    expect_baked("hidden_state", hidden, &[b, s, ("K", Some(spec.k))], spec)?;
    let shape = &checked.shape;
    if shape.q_dim != spec.q_dim {
        return Err(kvjit_core::Error::NotBuiltFor {
            arg: "weight",
            expected: format!("[{}, {}]", spec.n(), spec.k),
            got: vec![shape.n, shape.k],
        });
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use kvjit_core::CacheElement;

    use super::*;

    fn spec() -> FusedQkvSpec {
        FusedQkvSpec {
            backend: Backend::Cpu(CodeTier::Avx2),
            dtype: DType::BF16,
            weights: DType::BF16,
            cache: KvCacheParams {
                element: CacheElement::BF16,
                num_layers: 32,
                page_size: 16,
                num_kv_heads: 8,
                head_size: 128,
            },
            k: 4096,
            q_dim: 4096,
            step: StepDims { batch: None, seq: Some(1) },
            sizes: Sizes::Baked,
        }
    }

    #[test]
    fn the_key_names_the_tier_and_holds_the_spec() {
        let spec = spec();
        let key = spec.key();
        assert_eq!(key.to_string(), "fused_qkv_bshd_paged.cpu-avx2.bf16.k4096.q4096.hkv8.d128.p16.l32.kvbf16.bany.s1");
        assert_eq!(key.spec::<FusedQkvSpec>(), Some(&spec));
        assert_eq!(spec.n(), 6144);
        let cuda = FusedQkvSpec { backend: Backend::Cuda, ..spec };
        assert_eq!(
            cuda.key().to_string(),
            "fused_qkv_bshd_paged.cuda.bf16.k4096.q4096.hkv8.d128.p16.l32.kvbf16.bany.s1"
        );
    }

    #[test]
    fn an_unspecialized_key_leaves_every_size_to_run_time() {
        let fp8 = KvCacheParams { element: CacheElement::F8E4M3 { scale_granularity: 32 }, ..spec().cache };
        let unspecialized = FusedQkvSpec { sizes: Sizes::Runtime, cache: fp8, ..spec() };
        assert_eq!(
            unspecialized.key().to_string(),
            "fused_qkv_bshd_paged.cpu-avx2.bf16.kany.qany.hkvany.dany.pany.lany.kvf8e4m3.gany.bany.sany"
        );
    }
}
