//! Element types and compile targets.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::Error;

/// The element type of a tensor.
///
/// Floating types are what activations, weights and caches hold (`F8E4M3`
/// only caches: ops compute in [`DType::FLOATS`]); `U32` is for index
/// tensors (cache lengths, page tables, valid lengths, layer indices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE-754 binary32.
    F32,
    /// bfloat16: the top 16 bits of an f32.
    BF16,
    /// IEEE-754 binary16.
    F16,
    /// Unsigned 32-bit integer (index tensors).
    U32,
    /// OCP FP8 E4M3FN ([`crate::fp8`]): a KV cache's element type, with a
    /// scale per block of values beside it.
    #[serde(rename = "f8e4m3")]
    F8E4M3,
    /// GGML's Q8_0 weight blocks ([`crate::quant`]): 32 weights, an f16
    /// scale and 32 × i8.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// GGML's Q4_0 weight blocks: 32 weights, an f16 scale, 32 nibbles.
    #[serde(rename = "q4_0")]
    Q4_0,
    /// GGML's Q4_1 weight blocks: 32 weights, an f16 scale and minimum, 32
    /// nibbles.
    #[serde(rename = "q4_1")]
    Q4_1,
    /// GGML's Q5_0 weight blocks: 32 weights, an f16 scale, 32 nibbles and
    /// a 32-bit word of their fifth bits.
    #[serde(rename = "q5_0")]
    Q5_0,
    /// GGML's Q5_1 weight blocks: Q5_0's with an f16 minimum.
    #[serde(rename = "q5_1")]
    Q5_1,
    /// GGML's IQ4_NL weight blocks: 32 weights, an f16 scale, 32 4-bit codes
    /// of 16 non-linear levels in −127..=113.
    #[serde(rename = "iq4_nl")]
    Iq4Nl,
    /// kvjit's own 8-bit blocks with a minimum ([`crate::quant`]): 32
    /// weights, an f16 scale `d` and minimum `m`, 32 × u8 `q`, worth
    /// `d·q + m` — Q4_1's arithmetic on bytes. Every Q8_0, Q4_0, Q4_1,
    /// Q5_0, Q5_1 and IQ4_NL block with a finite scale below 512 holds in
    /// one exactly, so parts of one constant stored in different ones of
    /// those (a fused QKV weight whose V llama.cpp kept in Q8_0 beside Q5_1
    /// Q and K) stack as one q8_min constant.
    #[serde(rename = "q8_min")]
    Q8Min,
    /// GGML's Q4_K super-blocks: 256 weights in 8 sub-blocks with 6-bit
    /// scales and minimums.
    #[serde(rename = "q4_k")]
    Q4K,
    /// GGML's Q5_K super-blocks: Q4_K's with a fifth bit per weight.
    #[serde(rename = "q5_k")]
    Q5K,
    /// GGML's Q6_K super-blocks: 256 weights in 16 sub-blocks with i8 scales.
    #[serde(rename = "q6_k")]
    Q6K,
    /// kvjit's own 8-bit super-blocks with a minimum ([`crate::quant`]): 256
    /// weights, an f16 `d` and `dmin`, per 16 an i8 scale `sc` and an i16
    /// minimum `m`, 256 × u8 `q`, worth `(d·sc)·q − dmin·m` with one
    /// rounding. Every Q4_K, Q5_K and Q6_K super-block with finite scales
    /// holds in one exactly, so parts of one constant stored in different
    /// ones of those (a fused QKV weight whose V llama.cpp kept in Q6_K
    /// beside Q4_K Q and K) stack as one q8_kmin constant.
    #[serde(rename = "q8_kmin")]
    Q8KMin,
}

impl DType {
    /// The element dtypes: the floats an op computes in, indices, and FP8.
    pub const ELEMENTS: [DType; 5] = [DType::F32, DType::BF16, DType::F16, DType::U32, DType::F8E4M3];

    /// Every dtype, in a fixed order: [`DType::ELEMENTS`], then
    /// [`DType::BLOCK_FORMATS`].
    pub const ALL: [DType; 16] = {
        let mut all = [DType::F32; 16];
        let mut i = 0;
        while i < all.len() {
            all[i] = match i < DType::ELEMENTS.len() {
                true => DType::ELEMENTS[i],
                false => DType::BLOCK_FORMATS[i - DType::ELEMENTS.len()],
            };
            i += 1;
        }
        all
    };
    /// The floating dtypes an op may compute in.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// The weight block formats a constant may hold ([`crate::quant`]).
    pub const BLOCK_FORMATS: [DType; 11] = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Iq4Nl,
        DType::Q8Min,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Q8KMin,
    ];

    /// Size of one storage unit in bytes: an element, or for a block
    /// format a byte of its blocks (their size is [`DType::block`]).
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3
            | DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Iq4Nl
            | DType::Q8Min
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
            | DType::Q8KMin => 1,
        }
    }

    /// Elements per block and bytes per block: `(1, size)` for an element
    /// dtype; for a block format, GGML's block geometry.
    pub fn block(self) -> (usize, usize) {
        match self {
            DType::Q8_0 => (32, 34),
            DType::Q4_0 => (32, 18),
            DType::Q4_1 => (32, 20),
            DType::Q5_0 => (32, 22),
            DType::Q5_1 => (32, 24),
            DType::Iq4Nl => (32, 18),
            DType::Q8Min => (32, 36),
            DType::Q4K => (256, 144),
            DType::Q5K => (256, 176),
            DType::Q6K => (256, 210),
            DType::Q8KMin => (256, 308),
            other => (1, other.size_bytes()),
        }
    }

    /// Whether this is a weight block format ([`DType::BLOCK_FORMATS`]).
    pub fn is_block_format(self) -> bool {
        DType::BLOCK_FORMATS.contains(&self)
    }

    /// Bytes that `numel` elements take (whole blocks for a block format:
    /// `None` when `numel` is not a whole number of blocks, or on overflow).
    pub fn storage_bytes(self, numel: usize) -> Option<usize> {
        let (elements, bytes) = self.block();
        numel.is_multiple_of(elements).then(|| (numel / elements).checked_mul(bytes)).flatten()
    }

    /// Elements that `bytes` bytes hold (rounded down to whole blocks or
    /// elements).
    pub fn elements_in(self, bytes: usize) -> usize {
        let (elements, size) = self.block();
        bytes / size * elements
    }

    /// Bytes per weight (a block format's bytes per block over its
    /// elements; an element dtype's size).
    pub fn bytes_per_element(self) -> f64 {
        let (elements, bytes) = self.block();
        bytes as f64 / elements as f64
    }

    /// Whether this is a floating-point element dtype (FP8 included; block
    /// formats are not elements).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16 | DType::F8E4M3)
    }

    /// Whether ops compute in this dtype: one of [`DType::FLOATS`] (FP8 is a
    /// storage type of KV caches only).
    pub fn is_compute_float(self) -> bool {
        DType::FLOATS.contains(&self)
    }

    /// Whether values of this dtype are stored with per-block scales (an FP8
    /// cache).
    pub fn is_quantized(self) -> bool {
        matches!(self, DType::F8E4M3)
    }

    /// Every dtype's [`name`](DType::name), comma-separated (what a wrong
    /// name is told to choose from).
    pub fn names() -> String {
        DType::ALL.map(DType::name).join(", ")
    }

    /// The lowercase name used in graph files and kernel keys.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
            DType::F8E4M3 => "f8e4m3",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Iq4Nl => "iq4_nl",
            DType::Q8Min => "q8_min",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
            DType::Q8KMin => "q8_kmin",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        DType::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| Error::UnknownDType(s.to_string()))
    }
}

/// Where a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU through CUDA.
    Cuda,
}

impl Target {
    /// The lowercase name used in graph files, kernel keys and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Target {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "cpu" => Ok(Target::Cpu),
            "cuda" => Ok(Target::Cuda),
            other => Err(Error::UnknownTarget(other.to_string())),
        }
    }
}

/// Which code the CPU target's JIT kernels run: Cranelift's own vectors
/// (128-bit on x86-64, NEON on aarch64; every machine), or the Cranelift
/// driver calling ahead-of-time AVX2+FMA micro-kernels for the innermost
/// tile (x86-64 with AVX2, FMA and F16C). `Auto` picks the widest the CPU runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuTier {
    /// The widest tier this CPU runs (resolved when a kernel is built).
    #[default]
    Auto,
    /// Pure Cranelift code.
    Cranelift,
    /// Cranelift driver + AVX2/FMA micro-kernels.
    Avx2,
}

impl CpuTier {
    /// Every tier name the CLI and graph files accept.
    pub const NAMES: [&'static str; 3] = ["auto", "cranelift", "avx2"];

    /// The lowercase name used in kernel keys (`cpu-avx2`) and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            CpuTier::Auto => "auto",
            CpuTier::Cranelift => "cranelift",
            CpuTier::Avx2 => "avx2",
        }
    }
}

/// The CPU code tier a kernel is built for, resolved: what
/// [`CpuTier::Auto`] became on this machine, or the tier asked for. Kernel
/// keys whose code depends on it name it (`cpu-avx2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CodeTier {
    /// Pure Cranelift code.
    Cranelift,
    /// Cranelift driver + AVX2/FMA micro-kernels.
    Avx2,
}

impl CodeTier {
    /// The lowercase name used in kernel keys (`cpu-avx2`) and the CLI.
    pub fn name(self) -> &'static str {
        self.requested().name()
    }

    /// The same tier as a request (never `Auto`).
    pub fn requested(self) -> CpuTier {
        match self {
            CodeTier::Cranelift => CpuTier::Cranelift,
            CodeTier::Avx2 => CpuTier::Avx2,
        }
    }
}

impl fmt::Display for CodeTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a graph is specialized and its kernels built for: the target and,
/// on the CPU, the resolved code tier. Made once at the build boundary
/// (`kvjit::compile` resolves [`CpuTier`] into it), so no kernel ever sees
/// `Auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// The host CPU, with the code tier its JIT kernels use.
    Cpu(CodeTier),
    /// An NVIDIA GPU through CUDA.
    Cuda,
}

impl Backend {
    /// The target.
    pub fn target(self) -> Target {
        match self {
            Backend::Cpu(_) => Target::Cpu,
            Backend::Cuda => Target::Cuda,
        }
    }

    /// The CPU code tier, on the CPU.
    pub fn cpu_tier(self) -> Option<CodeTier> {
        match self {
            Backend::Cpu(tier) => Some(tier),
            Backend::Cuda => None,
        }
    }
}

impl fmt::Display for Backend {
    /// `cpu-avx2`, `cpu-cranelift`, `cuda`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Cpu(tier) => write!(f, "cpu-{tier}"),
            Backend::Cuda => f.write_str("cuda"),
        }
    }
}

impl fmt::Display for CpuTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuTier {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "auto" => Ok(CpuTier::Auto),
            "cranelift" => Ok(CpuTier::Cranelift),
            "avx2" => Ok(CpuTier::Avx2),
            other => Err(Error::UnknownCpuTier(other.to_string())),
        }
    }
}

/// A floating element type that kernels convert to and from f32.
///
/// `from_f32` rounds to nearest, ties to even (what `half` does), so every
/// kernel rounds results the same way.
pub trait Element: crate::tensor::Storable {
    /// Widen to f32 (exact for every supported type).
    fn to_f32(self) -> f32;
    /// Round an f32 to this type (round to nearest, ties to even).
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Element for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

impl Element for crate::fp8::F8E4M3 {
    fn to_f32(self) -> f32 {
        crate::fp8::F8E4M3::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        crate::fp8::F8E4M3::from_f32(value)
    }
}

impl Element for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}
