//! The CPU kernel: machine code Cranelift emits for one [`FusedQkvSpec`] on
//! one CPU tier — the platform's GEMM driver ([`kvjit_op::gemm`]: packed
//! weight panels, the tiers' schedules and micro-kernels, one code path
//! with `mo.matmul`) with this op's epilogue, the paged store:
//!
//! ```text
//! epilogue: Q columns → output[r, col]; K/V columns → blocks[row_offset[r] + col]
//!           (skipped for padded rows: row_offset = -1), rounded to the dtype
//! ```
//!
//! Everything the spec fixes is a constant in the code: K, the Q/K/V column
//! ranges (the packed weight's three segments), the K→V stride of the
//! cache, dtypes, and — for a fully specialized key — the row count M. A
//! generic kernel (M read at run time) picks between the GEMV and the
//! blocked schedule per call.
//!
//! **FP8 caches.** With an `f8e4m3` cache the epilogue stores each row's
//! K/V columns as f32 into a staging buffer (`[M, 2·Hkv·D]`, a few KiB per
//! decode step, still in L1/L2 when read back), and a second Cranelift
//! kernel of the same launch sequence quantizes every valid row's g-blocks
//! into the cache, rows split between the threads
//! ([`kvjit_jit::ir::e4m3::quantize_block`]: absmax of the finite values,
//! scale, round to nearest even with saturation, exactly as the reference). A g-block spans several
//! panels, and panels are split between threads, so its absmax is only
//! known once every panel of the row is done: the staging is where the
//! epilogue hands the block over.
//!
//! The code, by concern: the epilogue and the checks of what it can
//! address (`emit.rs`); the FP8 store kernel (`fp8_store.rs`); and
//! [`JitKernel`], which packs, compiles and launches them (`launch.rs`).

mod emit;
mod fp8_store;
mod launch;

use kvjit_core::{CodeTier, DType, KernelSpec};
use kvjit_jit::JitError;
use kvjit_op::gemm::WeightOrientation;

pub(crate) use emit::addressable;
pub use emit::compile;
pub use kvjit_op::gemm::{AVX2_BLOCK_BYTES, AVX2_BLOCK_ROWS, K_UNROLL, MC, MR, NR, PanelLayout, Schedule};
pub use launch::JitKernel;

use crate::FusedQkvSpec;

/// Shapes a generic kernel specializes for, at most (the shared policy's
/// limit, [`kvjit_jit::MAX_SEEN_SHAPES`]).
pub use kvjit_jit::MAX_SEEN_SHAPES;
/// The compile log of the CPU JIT (every op's kernels: the registry is
/// shared), re-exported where this op's users look for it.
pub use kvjit_jit::compile_log;

/// The GEMM kernel's arguments ([`kvjit_jit::KernelParams::field`] reads
/// each at its `offset_of!`); the work items of a launch are weight panels.
#[repr(C)]
struct GemmArgs {
    /// Activations as f32 rows, `[M, K]`.
    x: u64,
    /// The packed weight.
    w: u64,
    /// The Q output, `[M, q_dim]`.
    out: u64,
    /// The cache's blocks (an FP8 cache's f32 staging rows).
    blocks: u64,
    /// Per row, the element offset of its K in `blocks` (-1: padded row).
    row_offsets: u64,
    /// Rows M (read when the key leaves B or S symbolic).
    m: u64,
    /// The 256-bit tier's activation layout: rows interleaved in tiles of
    /// this many (see `pack_activations`); 1 when X is one plain row.
    x_step: u64,
    /// K (read by an unspecialized kernel only, like the next three).
    k: u64,
    /// Q columns.
    q_dim: u64,
    /// K (and V) columns, Hkv·D.
    kv_dim: u64,
    /// Elements from a token's K to its V where the epilogue stores them.
    kv_stride: u64,
}

// SAFETY: `#[repr(C)]` and made of u64 words only.
unsafe impl kvjit_jit::KernelArgs for GemmArgs {}

/// The code tier `spec`'s CPU code runs on: the tier its backend names,
/// checked to run on this CPU (a 256-bit spec made on another machine is
/// refused, not run). A CUDA spec has none.
pub(crate) fn code_tier(spec: &FusedQkvSpec) -> Result<CodeTier, JitError> {
    kvjit_op::gemm::code_tier(spec.tier(), &spec.key())
}

/// The packed weight's layout for `spec` on `tier`: one `[N, K]` weight,
/// its columns in three segments (Q, K, V).
pub fn layout(spec: &FusedQkvSpec, tier: CodeTier) -> PanelLayout {
    let kv = spec.kv_dim();
    let columns = [spec.q_dim, kv, kv];
    PanelLayout::new("fused_qkv", &columns, spec.k, Schedule::of(tier).panel_columns, 1, WeightOrientation::NK)
}

/// The dtype the epilogue stores K/V in: the cache's, or f32 into the
/// staging buffer of an FP8 cache.
fn kv_store_dtype(spec: &FusedQkvSpec) -> DType {
    if spec.cache.dtype().is_quantized() { DType::F32 } else { spec.cache.dtype() }
}

/// Elements from a row's K to its V where the epilogue stores them: the
/// cache's K→V stride, or Hkv·D in an FP8 cache's staging rows.
fn kv_store_stride(spec: &FusedQkvSpec) -> usize {
    if spec.cache.dtype().is_quantized() { spec.kv_dim() } else { spec.kv_stride() }
}
