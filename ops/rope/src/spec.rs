//! [`RopeSpec`]: the typed form of this op's kernel key.

use kvjit_core::{DType, KernelKey, KeyField, Target};

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
    pub target: Target,
    /// Dtype of `q_proj`, `freqs_cis` and the output.
    pub dtype: DType,
    /// Dtype of the cache (K is read, rotated in f32 and rounded back to it).
    pub cache_dtype: DType,
    /// Values per scale of an FP8 cache (`Some` exactly for `f8e4m3`).
    pub scale_granularity: Option<usize>,
    /// Pairs are `(x[2j], x[2j+1])` (GGUF) rather than `(x[j], x[j + D/2])`.
    pub interleaved: bool,
    /// Query heads Hq (a multiple of Hkv).
    pub num_q_heads: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers in the cache.
    pub num_layers: usize,
    /// Batch B, if static.
    pub batch: Option<usize>,
    /// Padded sequence length S, if static.
    pub seq: Option<usize>,
}

impl RopeSpec {
    /// The cache layout the kernel is built for.
    pub fn cache_params(&self) -> kvjit_core::KvCacheParams {
        kvjit_core::KvCacheParams {
            dtype: self.cache_dtype,
            num_layers: self.num_layers,
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            head_size: self.head_size,
            scale_granularity: self.scale_granularity,
        }
    }

    /// The canonical kernel key (the one function that names this op's
    /// kernels), e.g.
    /// `fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvbf16.il0.bany.s1`.
    pub fn kernel_key(&self) -> KernelKey {
        KernelKey::new(KERNEL_NAME, self.target, self.dtype)
            .with("hq", KeyField::size(self.num_q_heads))
            .with("hkv", KeyField::size(self.num_kv_heads))
            .with("d", KeyField::size(self.head_size))
            .with("p", KeyField::size(self.page_size))
            .with("l", KeyField::size(self.num_layers))
            .with("kv", KeyField::DType(self.cache_dtype))
            .with_if("g", self.scale_granularity.map(KeyField::size))
            .with("il", KeyField::Static(u64::from(self.interleaved)))
            .with("b", KeyField::dim(self.batch))
            .with("s", KeyField::dim(self.seq))
    }

    /// Read a key made by [`kernel_key`](Self::kernel_key) back; `None` if it
    /// is not this op's.
    pub fn from_kernel_key(key: &KernelKey) -> Option<Self> {
        if key.op() != KERNEL_NAME {
            return None;
        }
        let spec = Self {
            target: key.target(),
            dtype: key.dtype(),
            cache_dtype: key.dtype_field("kv")?,
            scale_granularity: key.size("g"),
            interleaved: match key.size("il")? {
                0 => false,
                1 => true,
                _ => return None,
            },
            num_q_heads: key.size("hq")?,
            num_kv_heads: key.size("hkv")?,
            head_size: key.size("d")?,
            page_size: key.size("p")?,
            num_layers: key.size("l")?,
            batch: key.dim("b")?,
            seq: key.dim("s")?,
        };
        (spec.kernel_key() == *key).then_some(spec)
    }

    /// The same spec with B and S symbolic: the key the JIT compiles (and
    /// caches) the machine code under, shared by every (B, S).
    pub fn generic(&self) -> Self {
        Self { batch: None, seq: None, ..*self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trips_and_names_itself() {
        let spec = RopeSpec {
            target: Target::Cpu,
            dtype: DType::BF16,
            cache_dtype: DType::F32,
            scale_granularity: None,
            interleaved: false,
            num_q_heads: 32,
            num_kv_heads: 8,
            head_size: 128,
            page_size: 16,
            num_layers: 32,
            batch: None,
            seq: Some(1),
        };
        let key = spec.kernel_key();
        assert_eq!(key.to_string(), "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvf32.il0.bany.s1");
        assert_eq!(RopeSpec::from_kernel_key(&key), Some(spec));
        let interleaved = RopeSpec { interleaved: true, ..spec };
        assert_eq!(RopeSpec::from_kernel_key(&interleaved.kernel_key()), Some(interleaved));
        assert_eq!(
            spec.generic().kernel_key().to_string(),
            "fused_qk_rope_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvf32.il0.bany.sany"
        );
        let other = KernelKey::new("reshape", Target::Cpu, DType::F32);
        assert_eq!(RopeSpec::from_kernel_key(&other), None);
    }
}
