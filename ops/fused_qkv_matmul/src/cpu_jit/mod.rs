//! The CPU kernel: machine code Cranelift emits for one [`FusedQkvSpec`] on
//! one CPU tier.
//!
//! Everything the spec fixes is a constant in the code: K, the Q/K/V column
//! ranges, the K→V stride of the cache, dtypes, and — for a fully specialized
//! key — the row count M. The weight is packed once (at graph build when it
//! is a constant) into panels of the tier's width (8 columns on the
//! Cranelift tier, 16 on the 256-bit tier), k-major (`[K][width]`), one run
//! of panels per Q, K and V segment, each zero-padded to a whole panel.
//!
//! The driver — the loops, the schedule, the fused epilogue, the threading —
//! is always Cranelift-emitted code specialized for the key. Only the
//! innermost tile differs between the tiers ([`Schedule::of`]):
//!
//! ```text
//! for each block of block_rows rows:            (X block stays in cache across panels)
//!   for each panel p in the thread's range:     (a weight panel, read from DRAM once per block)
//!     Cranelift tier: for each group of 4 rows: a 4×8 tile of F32X4 fmas in registers over all of K
//!     256-bit tier:   for each k block (L1-sized; all of K when M = 1):
//!                       for each group of 6 rows: call the AVX2 micro-kernel for the tile,
//!                       adding into the block's accumulators on the stack
//!     epilogue: Q columns → output[r, col]; K/V columns → blocks[row_offset[r] + col]
//!               (skipped for padded rows: row_offset = -1), rounded to the dtype
//! ```
//!
//! The 256-bit tier reads activations packed per 6-row tile
//! (`pack_activations`: one sequential stream per tile); one row (decode)
//! is a GEMV that streams each panel as four sequential streams. A generic
//! kernel (M read at run time) picks between the GEMV and the blocked
//! schedule per call.
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
//! With M ≤ block_rows (decode) every weight panel is read from memory
//! exactly once for all rows, and the panels are split between the worker
//! threads: the kernel streams the weight once. Each output element is
//! computed by one call with the same code whatever the thread count, so
//! results are bit-identical for any number of threads.
//!
//! The code, by concern: [`Schedule`] and the tiers' loop-nest sizes
//! (`schedule.rs`); the emitter of the kernel and the checks of what it can
//! address (`emit.rs`); the FP8 store kernel (`fp8_store.rs`); and
//! [`JitKernel`], which packs, compiles and launches them (`launch.rs`).
//! The packed weight layout is [`PanelLayout`] (`panels.rs`).

mod emit;
mod fp8_store;
mod launch;
mod schedule;

use kvjit_core::{CodeTier, CpuTier, DType, KernelSpec};
use kvjit_jit::{JitError, microkernel};

pub(crate) use emit::addressable;
pub use emit::compile;
pub use launch::JitKernel;
pub use schedule::{AVX2_BLOCK_BYTES, AVX2_BLOCK_ROWS, K_UNROLL, MC, MR, NR, Schedule};

use crate::FusedQkvSpec;
pub use crate::panels::PanelLayout;

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
    match spec.tier() {
        Some(CodeTier::Avx2) if !microkernel::avx2_available() => Err(JitError::TierUnavailable {
            tier: CpuTier::Avx2,
            needs: "an x86-64 CPU with AVX2, FMA and F16C",
            arch: std::env::consts::ARCH,
        }),
        Some(tier) => Ok(tier),
        None => Err(JitError::Unsupported { key: spec.key().to_string(), reason: "not a CPU spec".into() }),
    }
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
