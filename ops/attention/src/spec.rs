//! [`MhaSpec`]: the typed form of this op's kernel key.

use kvjit_core::{DType, KernelKey, KeyField, Target};

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

impl Mask {
    /// The names graph files use, in [`ParamKind::Choice`](kvjit_graph::ParamKind::Choice) order.
    pub const NAMES: &'static [&'static str] = &["causal", "null"];

    /// The graph-file name.
    pub fn name(self) -> &'static str {
        match self {
            Mask::Causal => "causal",
            Mask::Null => "null",
        }
    }

    /// Parse a graph-file name.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "causal" => Some(Mask::Causal),
            "null" => Some(Mask::Null),
            _ => None,
        }
    }
}

/// Everything a kernel for this op may bake in. `batch`/`seq` are `None`
/// when symbolic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MhaSpec {
    /// Target.
    pub target: Target,
    /// Dtype of `q` and the output.
    pub dtype: DType,
    /// Dtype of the cache.
    pub cache_dtype: DType,
    /// Values per scale of an FP8 cache (`Some` exactly for `f8e4m3`).
    pub scale_granularity: Option<usize>,
    /// Query heads Hq.
    pub num_heads: usize,
    /// KV heads Hkv (divides Hq).
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers in the cache.
    pub num_layers: usize,
    /// The mask.
    pub mask: Mask,
    /// Sliding window: key positions `p > cache_length + s − window` only.
    pub window: Option<usize>,
    /// Softmax scale (finite).
    pub scale: f32,
    /// Batch B, if static.
    pub batch: Option<usize>,
    /// Padded sequence length S, if static.
    pub seq: Option<usize>,
}

impl MhaSpec {
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

    /// Query heads per KV head, Hq / Hkv.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The canonical kernel key, e.g.
    /// `mha_padded_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvbf16.causal1.w0.sc1035098028.bany.s1`
    /// (`w0`: no window; `sc`: the f32 bit pattern of the scale).
    pub fn kernel_key(&self) -> KernelKey {
        KernelKey::new(KERNEL_NAME, self.target, self.dtype)
            .with("hq", KeyField::size(self.num_heads))
            .with("hkv", KeyField::size(self.num_kv_heads))
            .with("d", KeyField::size(self.head_size))
            .with("p", KeyField::size(self.page_size))
            .with("l", KeyField::size(self.num_layers))
            .with("kv", KeyField::DType(self.cache_dtype))
            .with_if("g", self.scale_granularity.map(KeyField::size))
            .with("causal", KeyField::size(usize::from(self.mask == Mask::Causal)))
            .with("w", KeyField::size(self.window.unwrap_or(0)))
            .with("sc", KeyField::Static(u64::from(self.scale.to_bits())))
            .with("b", KeyField::dim(self.batch))
            .with("s", KeyField::dim(self.seq))
    }

    /// Read a key made by [`kernel_key`](Self::kernel_key) back; `None` if it
    /// is not this op's (or not a valid one).
    pub fn from_kernel_key(key: &KernelKey) -> Option<Self> {
        if key.op() != KERNEL_NAME {
            return None;
        }
        let spec = Self {
            target: key.target(),
            dtype: key.dtype(),
            cache_dtype: key.dtype_field("kv")?,
            scale_granularity: key.size("g"),
            num_heads: key.size("hq")?,
            num_kv_heads: key.size("hkv")?,
            head_size: key.size("d")?,
            page_size: key.size("p")?,
            num_layers: key.size("l")?,
            mask: match key.size("causal")? {
                1 => Mask::Causal,
                0 => Mask::Null,
                _ => return None,
            },
            window: Some(key.size("w")?).filter(|&w| w > 0),
            scale: f32::from_bits(u32::try_from(key.size("sc")?).ok()?),
            batch: key.dim("b")?,
            seq: key.dim("s")?,
        };
        let valid = spec.dtype.is_compute_float()
            && spec.cache_dtype.is_float()
            && spec.scale.is_finite()
            && [spec.num_heads, spec.num_kv_heads, spec.head_size, spec.page_size, spec.num_layers]
                .iter()
                .all(|&v| v > 0)
            && spec.num_heads.is_multiple_of(spec.num_kv_heads)
            && spec.cache_params().validate().is_ok();
        (valid && spec.kernel_key() == *key).then_some(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trips_and_names_itself() {
        let spec = MhaSpec {
            target: Target::Cpu,
            dtype: DType::BF16,
            cache_dtype: DType::F16,
            scale_granularity: None,
            num_heads: 32,
            num_kv_heads: 8,
            head_size: 128,
            page_size: 16,
            num_layers: 32,
            mask: Mask::Causal,
            window: None,
            scale: 0.125,
            batch: None,
            seq: Some(1),
        };
        let key = spec.kernel_key();
        assert_eq!(
            key.to_string(),
            format!(
                "mha_padded_paged.cpu.bf16.hq32.hkv8.d128.p16.l32.kvf16.causal1.w0.sc{}.bany.s1",
                0.125f32.to_bits()
            )
        );
        assert_eq!(MhaSpec::from_kernel_key(&key), Some(spec));
        let windowed = MhaSpec { window: Some(64), mask: Mask::Null, ..spec };
        assert_eq!(MhaSpec::from_kernel_key(&windowed.kernel_key()), Some(windowed));
        let bad = MhaSpec { num_heads: 30, ..spec };
        assert_eq!(MhaSpec::from_kernel_key(&bad.kernel_key()), None, "Hq % Hkv != 0");
    }
}
