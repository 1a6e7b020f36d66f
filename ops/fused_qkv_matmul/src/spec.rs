//! [`FusedQkvSpec`]: the typed form of this op's kernel key.

use kvjit_core::{DType, KernelKey, KeyField, Target};

/// Short op name used in kernel keys, symbols and benchmark ids.
pub const KERNEL_NAME: &str = "fused_qkv_bshd_paged";

/// Everything a kernel for this op may bake in. `batch`/`seq` are `None`
/// when symbolic (the kernel reads them at run time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusedQkvSpec {
    /// Target.
    pub target: Target,
    /// Dtype of hidden state, weight and output.
    pub dtype: DType,
    /// Dtype of the cache.
    pub cache_dtype: DType,
    /// Values per scale of an FP8 cache (`Some` exactly for `f8e4m3`).
    pub scale_granularity: Option<usize>,
    /// Hidden size K.
    pub k: usize,
    /// Q columns.
    pub q_dim: usize,
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

impl FusedQkvSpec {
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

    /// K (or V) columns: Hkv·D.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_size
    }

    /// Elements from a token's K to its V in the cache's blocks:
    /// `L · page_size · Hkv · D`.
    pub fn kv_stride(&self) -> usize {
        self.num_layers * self.page_size * self.kv_dim()
    }

    /// All weight rows N = q_dim + 2·kv_dim.
    pub fn n(&self) -> usize {
        self.q_dim + 2 * self.kv_dim()
    }

    /// The canonical kernel key (the one function that names this op's kernels).
    pub fn kernel_key(&self) -> KernelKey {
        KernelKey::new(KERNEL_NAME, self.target, self.dtype)
            .with("k", KeyField::size(self.k))
            .with("q", KeyField::size(self.q_dim))
            .with("hkv", KeyField::size(self.num_kv_heads))
            .with("d", KeyField::size(self.head_size))
            .with("p", KeyField::size(self.page_size))
            .with("l", KeyField::size(self.num_layers))
            .with("kv", KeyField::DType(self.cache_dtype))
            .with_if("g", self.scale_granularity.map(KeyField::size))
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
            k: key.size("k")?,
            q_dim: key.size("q")?,
            num_kv_heads: key.size("hkv")?,
            head_size: key.size("d")?,
            page_size: key.size("p")?,
            num_layers: key.size("l")?,
            batch: key.dim("b")?,
            seq: key.dim("s")?,
        };
        (spec.kernel_key() == *key).then_some(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trips_and_names_itself() {
        let spec = FusedQkvSpec {
            target: Target::Cpu,
            dtype: DType::BF16,
            cache_dtype: DType::BF16,
            scale_granularity: None,
            k: 4096,
            q_dim: 4096,
            num_kv_heads: 8,
            head_size: 128,
            page_size: 16,
            num_layers: 32,
            batch: None,
            seq: Some(1),
        };
        let key = spec.kernel_key();
        assert_eq!(key.to_string(), "fused_qkv_bshd_paged.cpu.bf16.k4096.q4096.hkv8.d128.p16.l32.kvbf16.bany.s1");
        assert_eq!(FusedQkvSpec::from_kernel_key(&key), Some(spec));
        assert_eq!(spec.n(), 6144);
    }
}
