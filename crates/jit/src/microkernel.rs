//! The 256-bit tier: small GEMM micro-kernels compiled ahead of time with
//! `std::arch` (AVX2 + FMA, F16C for f16 weights), which Cranelift-emitted
//! drivers call once per register tile.
//!
//! Cranelift 0.135 lowers only 128-bit vectors on x86-64 and never folds a
//! broadcast into `vfmadd231ps`, so the innermost loop of a GEMM is the one
//! place kvjit does not emit itself. Everything around it stays JIT code,
//! specialized per kernel key: the loops over row blocks, panels and row
//! tiles, the schedule, the fused epilogue (the tiles add into accumulators
//! in a buffer on the driver's stack) and the threading.
//!
//! A tile is `rows × 16` f32 accumulators, added into `c` (so a driver can
//! split k into blocks):
//!
//! ```text
//! c[i][j] += Σ_k x[k·x_step + i] · w[k·16 + j]      i < rows, j < 16
//! ```
//!
//! `x` is f32 activations with the rows of a tile interleaved (`x_step` =
//! the tile height the driver packed them in; 1 for a single row, which is
//! then just that row); `w` is one packed panel (`[K][16]`, k-major) of f32,
//! bf16 or f16 values, widened in registers. Tiles of 2–3 rows split k over
//! two accumulator sets, so every tile keeps ≥ 8 independent FMA chains in
//! flight (two 256-bit FMA pipes with a latency of 4 cycles), and prefetch
//! their panel [`PREFETCH_BYTES`] ahead of the loads. The one-row tile is a
//! GEMV ([`gemv_tile`]): it reads a long panel as four sequential streams
//! (k split in four contiguous ranges, one accumulator pair each), which
//! keeps more line fills in flight per core than one stream, and a short
//! one as one stream (`streams_for`).

use kvjit_core::{CodeTier, CpuTier, DType};

use crate::JitError;

/// Columns of a tile (two 256-bit vectors of f32): the panel width the
/// 256-bit tier packs weights in.
pub const TILE_COLUMNS: usize = 16;
/// Rows of the largest tile (6 × 2 accumulators + 2 weight vectors + 1
/// broadcast = 15 of the 16 ymm registers).
pub const MAX_TILE_ROWS: usize = 6;
/// How far ahead of its loads a tile prefetches a 16-bit weight panel: a
/// whole k block of a bf16 panel. A few rows (batched decode) read the
/// panel as stored at several bytes a cycle; 1 KiB ahead left them waiting
/// on it (the fused QKV at M = 2–8, Llama-3-8B: 1.2–1.6× faster with 8
/// KiB, 4 KiB in between, 16 KiB no better); M ≥ 64 reads a widened copy
/// from L1 and does not care.
pub const PREFETCH_BYTES: usize = 8192;
/// The same for an f32 panel: 8 KiB ahead made f32 M = 4 and 16 slower
/// (`bench --quick`: 0.79× and 1.46× the Cranelift tier, against 1.44×
/// and 1.82× at 1 KiB).
pub const F32_PREFETCH_BYTES: usize = 1024;

/// The shortest range, in bytes, a stream of a multi-stream GEMV tile
/// (this module's and [`crate::quant`]'s) reads per panel on an AMD CPU:
/// below it the panel is read as one stream ([`streams_for`]). Several
/// streams jump
/// between k ranges of each panel and restart at every panel; in short
/// ranges the jumps keep the hardware's stream prefetchers from running
/// ahead, where one stream runs on through consecutive panels. Measured
/// on AMD Zen 4, two threads from DRAM (`examples/gemv_threads.rs`, one
/// stream against the multi-stream count): bf16 1.77× at K = 576 (4.5 KiB
/// ranges), 1.58× at K = 1536, 1.22× at K = 4096, 1.13× at K = 14336; the
/// integer GEMV 1.5–1.8× at K = 576 to 2048 (11–20 KiB ranges) for the
/// 32-k formats, 1.17–1.21× at K = 4096 for Q4_0, Q4_1, Q4_K and Q6_K
/// (18–27 KiB), 0.93× for Q8_0 at K = 4096 (34 KiB), 1.0–1.14× at K =
/// 14336. Long panels keep the counts measured on an Intel Xeon
/// ([`crate::quant`]'s `STREAMS`), where more streams paid at K = 4096.
pub(crate) const AMD_MIN_STREAM_BYTES: usize = 32 << 10;

/// [`AMD_MIN_STREAM_BYTES`] on the other x86 CPUs (Intel's), whose
/// prefetchers follow several streams of short ranges: measured on an
/// Intel Xeon (Emerald Rapids, two vCPUs, `examples/gemv_threads.rs`, two
/// threads from DRAM), several streams read faster than one at every
/// length — bf16's four 1.20–1.25× one at K = 576, 1536 and 4096 (4.5 KiB
/// ranges and up); the integer GEMV's two 1.03–1.14× one for Q4_0, Q4_1,
/// Q8_0, Q4_K and Q6_K at K = 4096 and 14336 and for Q4_1 and Q8_0 at K =
/// 576 and 1536 (1.4–6 KiB ranges), Q4_K at K = 1536 within 1 % either
/// way. Ranges stay at least this long.
pub(crate) const INTEL_MIN_STREAM_BYTES: usize = 1 << 10;

/// The shortest range a stream of a multi-stream GEMV tile reads per panel
/// on this CPU: [`AMD_MIN_STREAM_BYTES`] on AMD (and Hygon) CPUs,
/// [`INTEL_MIN_STREAM_BYTES`] on the others. Read once per process.
pub(crate) fn min_stream_bytes() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| if cpu_is_amd() { AMD_MIN_STREAM_BYTES } else { INTEL_MIN_STREAM_BYTES })
}

/// Whether the CPU's vendor string (CPUID leaf 0) names AMD or Hygon (Zen
/// cores); `true` off x86-64, where no tile reads streams.
fn cpu_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf = std::arch::x86_64::__cpuid(0);
        let vendor = [leaf.ebx, leaf.edx, leaf.ecx].map(u32::to_le_bytes);
        matches!(vendor.as_flattened(), b"AuthenticAMD" | b"HygonGenuine")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// How many streams a GEMV tile that reads long panels in `streams`
/// streams reads a panel of `panel_bytes` in on this CPU: `streams` when
/// each would still cover [`min_stream_bytes`], else one.
pub(crate) fn streams_for(panel_bytes: usize, streams: usize) -> usize {
    streams_for_min(panel_bytes, streams, min_stream_bytes())
}

/// [`streams_for`] with ranges of at least `min_bytes`.
pub(crate) fn streams_for_min(panel_bytes: usize, streams: usize, min_bytes: usize) -> usize {
    if panel_bytes / streams >= min_bytes { streams } else { 1 }
}

/// Where, from the start of its panel, stream `s` of a GEMV tile prefetches
/// while it reads byte `at` of its own range (`stream_bytes` long, streams
/// one after another in a panel of `panel_bytes`): `ahead` bytes on, and
/// past the stream's end the same place of the next panel's stream `s` —
/// what the next call (the next 16 columns) starts on, so no call starts
/// its streams cold.
pub(crate) fn stream_prefetch_offset(
    s: usize,
    at: usize,
    ahead: usize,
    stream_bytes: usize,
    panel_bytes: usize,
) -> usize {
    let at = at + ahead;
    let at = if at >= stream_bytes { at - stream_bytes + panel_bytes } else { at };
    s * stream_bytes + at
}

/// The C ABI of a tile micro-kernel: `c[i·16 + j] += Σ_k x[k·x_step + i] ·
/// w[k·16 + j]` for `i < rows ≤ x_step`, `j < 16` (see the module docs).
pub type GemmTile = unsafe extern "C" fn(x: *const f32, x_step: usize, w: *const u8, k: usize, c: *mut f32);

/// The C ABI of a widening kernel: `out[i] = w[i]` as f32 for `i < count`
/// (`w` of bf16 or f16), so a driver can widen a block of a panel once and
/// let every row tile of the block read f32.
pub type WidenBlock = unsafe extern "C" fn(w: *const u8, count: usize, out: *mut f32);

/// The widening kernel for `weights` (bf16 or f16); `None` for f32 (nothing
/// to widen) or when this CPU lacks the tier.
pub fn widen_block(weights: DType) -> Option<WidenBlock> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::widen(weights)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = weights;
        None
    }
}

/// The CPU features the 256-bit tier's micro-kernels use, as
/// `is_x86_feature_detected!` names them ([`avx2_available`] checks these;
/// an artifact of that tier records them as what it needs of a CPU).
pub const AVX2_TIER_FEATURES: [&str; 3] = ["avx2", "fma", "f16c"];

/// Whether this CPU runs the 256-bit tier (x86-64 with AVX2, FMA and F16C).
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // The detection macro takes literals: these are AVX2_TIER_FEATURES
        // (a test keeps the two lists one).
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The tier a kernel is built for: `Auto` becomes the widest this CPU runs;
/// `Avx2` on a CPU without it is refused with a clear message.
pub fn resolve_tier(requested: CpuTier) -> Result<CodeTier, JitError> {
    match requested {
        CpuTier::Auto if avx2_available() => Ok(CodeTier::Avx2),
        CpuTier::Auto | CpuTier::Cranelift => Ok(CodeTier::Cranelift),
        CpuTier::Avx2 if avx2_available() => Ok(CodeTier::Avx2),
        CpuTier::Avx2 => Err(JitError::TierUnavailable {
            tier: CpuTier::Avx2,
            needs: "an x86-64 CPU with AVX2, FMA and F16C",
            arch: std::env::consts::ARCH,
        }),
    }
}

/// The tile micro-kernel for `rows` rows (1..=[`MAX_TILE_ROWS`]) of f32
/// activations against a panel of `weights`; `None` when this CPU lacks the
/// tier or no such tile exists.
pub fn gemm_tile(weights: DType, rows: usize) -> Option<GemmTile> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::tile(weights, rows)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (weights, rows);
        None
    }
}

/// The one-row tile (the GEMV) for panels of `weights` over `k`: the tile
/// [`gemm_tile`] gives for one row, reading a short panel as one stream
/// (`streams_for`); `None` when this CPU lacks the tier or the dtype has
/// no tile.
pub fn gemv_tile(weights: DType, k: usize) -> Option<GemmTile> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::gemv(weights, streams_for(k * TILE_COLUMNS * weights.size_bytes(), x86::GEMV_STREAMS))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (weights, k);
        None
    }
}

/// What [`gemv_tile`] picks from, for a K known only at run time: the
/// one-stream tile of `weights`, the multi-stream one, and the smallest K
/// that gets the latter.
pub fn gemv_tiles(weights: DType) -> Option<(GemmTile, GemmTile, usize)> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let streams = x86::GEMV_STREAMS;
        // streams_for(k·row, streams) > 1 ⇔ ⌊k·row / streams⌋ ≥ MIN ⇔
        // k·row ≥ streams·MIN.
        let min_k = (streams * min_stream_bytes()).div_ceil(TILE_COLUMNS * weights.size_bytes());
        Some((x86::gemv(weights, 1)?, x86::gemv(weights, streams)?, min_k))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = weights;
        None
    }
}

/// The one-row tile of `weights` read in `streams` (1 or 4) streams, for
/// measuring that choice (`examples/gemv_threads.rs`); `None` for other
/// counts or dtypes, or without the tier.
#[doc(hidden)]
pub fn gemv_tile_with_streams(weights: DType, streams: usize) -> Option<GemmTile> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::gemv(weights, streams)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (weights, streams);
        None
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use kvjit_core::DType;

    use super::{F32_PREFETCH_BYTES, GemmTile, PREFETCH_BYTES, TILE_COLUMNS, stream_prefetch_offset};

    /// k steps per iteration of the main loop.
    const UNROLL: usize = 4;

    /// A weight element type, widened to f32 in registers (also the
    /// decode attention kernel's cache elements).
    pub(crate) trait Weights {
        /// Bytes per element.
        const BYTES: usize;
        /// Eight consecutive elements at `p` as f32.
        ///
        /// # Safety
        /// `p` must be readable for 8 elements; the CPU must have AVX2, FMA
        /// and F16C.
        unsafe fn load8(p: *const u8) -> __m256;

        /// Whether [`Weights::load16`] gives its 16 elements in the order
        /// `[0..4, 8..12]`, `[4..8, 12..16]` (see [`unpermute_columns`]).
        const PERMUTED16: bool = false;

        /// Sixteen consecutive elements at `p` as two vectors: elements
        /// 0..8 and 8..16, or for a `PERMUTED16` type its order.
        ///
        /// # Safety
        /// `p` must be readable for 16 elements; AVX2, FMA and F16C.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const u8) -> [__m256; 2] {
            // SAFETY: the caller's bounds.
            unsafe { [Self::load8(p), Self::load8(p.add(8 * Self::BYTES))] }
        }
    }

    /// 16 bf16 at `p` widened without a shift: one 256-bit load and an
    /// unpack with zero per 8 (the shuffle port), leaving the two FMA
    /// ports to the FMAs; the unpacks give the elements in the order
    /// `[0..4, 8..12]`, `[4..8, 12..16]`.
    ///
    /// # Safety
    /// `p` readable for 16 bf16; AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn bf16_unpacked(p: *const u8) -> [__m256; 2] {
        // SAFETY: the caller guarantees 16 readable bf16 at `p`.
        let x = unsafe { _mm256_loadu_si256(p.cast()) };
        // A bf16 in the high half of a 32-bit lane is that f32.
        let zero = _mm256_setzero_si256();
        [_mm256_unpacklo_epi16(zero, x), _mm256_unpackhi_epi16(zero, x)].map(|v| _mm256_castsi256_ps(v))
    }

    /// A tile row's two accumulators back in column order from the
    /// `PERMUTED16` order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn unpermute_columns([a, b]: [__m256; 2]) -> [__m256; 2] {
        [_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b)]
    }

    pub(crate) struct F32;
    pub(crate) struct Bf16;
    pub(crate) struct F16;

    impl Weights for F32 {
        const BYTES: usize = 4;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 readable f32 at `p`.
            unsafe { _mm256_loadu_ps(p.cast()) }
        }
    }

    impl Weights for Bf16 {
        const BYTES: usize = 2;
        const PERMUTED16: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 readable bf16 (16 bytes) at `p`.
            let h = unsafe { _mm_loadu_si128(p.cast()) };
            // A bf16 is the top half of an f32: widen and shift up.
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const u8) -> [__m256; 2] {
            // SAFETY: the caller guarantees 16 readable bf16 at `p`.
            unsafe { bf16_unpacked(p) }
        }
    }

    impl Weights for F16 {
        const BYTES: usize = 2;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 readable f16 (16 bytes) at `p`.
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
        }
    }

    /// One tile: `MR` rows, `SETS` accumulator sets that k steps rotate over
    /// (summed at the end).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x` is readable for rows
    /// `x[k·x_step + i]` for `i < MR ≤ x_step` and k < `k`; `w` is readable for
    /// `k · 16` elements of `W`; `c` is readable and writable for `MR · 16`
    /// f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe extern "C" fn tile_kernel<W: Weights, const MR: usize, const SETS: usize>(
        x: *const f32,
        x_step: usize,
        w: *const u8,
        k: usize,
        c: *mut f32,
    ) {
        let row_bytes = TILE_COLUMNS * W::BYTES;
        let mut acc = [[[_mm256_setzero_ps(); 2]; MR]; SETS];
        // SAFETY (whole body): every k step reads w[kk·16 .. kk·16 + 16] and
        // x[kk·x_step + i] with kk < k and i < MR — inside the buffers the
        // caller vouches for; prefetches form their addresses with
        // `wrapping_add` and never fault.
        let step = |acc: &mut [[__m256; 2]; MR], kk: usize| unsafe {
            let [w0, w1] = W::load16(w.add(kk * row_bytes));
            for (i, row) in acc.iter_mut().enumerate() {
                let xb = _mm256_broadcast_ss(&*x.add(kk * x_step + i));
                row[0] = _mm256_fmadd_ps(xb, w0, row[0]);
                row[1] = _mm256_fmadd_ps(xb, w1, row[1]);
            }
        };
        let main = k - k % UNROLL;
        let mut kk = 0;
        while kk < main {
            let ahead =
                w.wrapping_add(kk * row_bytes + if W::BYTES == 4 { F32_PREFETCH_BYTES } else { PREFETCH_BYTES });
            for line in (0..UNROLL * row_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
            }
            for u in 0..UNROLL {
                step(&mut acc[u % SETS], kk + u);
            }
            kk += UNROLL;
        }
        while kk < k {
            step(&mut acc[0], kk);
            kk += 1;
        }
        let (first, rest) = acc.split_at_mut(1);
        for set in rest {
            for (sum, row) in first[0].iter_mut().zip(set.iter()) {
                sum[0] = _mm256_add_ps(sum[0], row[0]);
                sum[1] = _mm256_add_ps(sum[1], row[1]);
            }
        }
        let rows = if W::PERMUTED16 { first[0].map(|row| unpermute_columns(row)) } else { first[0] };
        // SAFETY: c holds MR·16 f32.
        unsafe { add_rows(c, &rows) };
    }

    /// `c[i·16 ..][..16] += rows[i]`.
    ///
    /// # Safety
    /// `c` is readable and writable for `rows.len() · 16` f32; AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add_rows(c: *mut f32, rows: &[[__m256; 2]]) {
        for (i, row) in rows.iter().enumerate() {
            // SAFETY: the caller's bound on c.
            unsafe {
                let at = c.add(i * TILE_COLUMNS);
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), row[0]));
                _mm256_storeu_ps(at.add(8), _mm256_add_ps(_mm256_loadu_ps(at.add(8)), row[1]));
            }
        }
    }

    /// Streams of the one-row tile (a GEMV over one panel) on a long panel.
    pub(super) const GEMV_STREAMS: usize = 4;
    /// How far ahead of its loads each stream of the one-row tile
    /// prefetches (the quantized GEMV's distance).
    const GEMV_PREFETCH_BYTES: usize = 2048;

    /// The one-row tile: a GEMV over one panel, read as `S` sequential
    /// streams (k split into that many contiguous ranges, each with its
    /// own accumulators; one stream takes [`GEMV_STREAMS`] accumulator
    /// pairs in turn, k by k, for as many independent FMA chains). Several
    /// streams per core keep more cache-line fills in flight than one on a
    /// long panel: the weight, read once, is all this tile's cost.
    ///
    /// # Safety
    /// As for [`tile_kernel`] with one row.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe extern "C" fn gemv_kernel<W: Weights, const S: usize>(
        x: *const f32,
        x_step: usize,
        w: *const u8,
        k: usize,
        c: *mut f32,
    ) {
        const { assert!(S == 1 || S == GEMV_STREAMS) };
        let row_bytes = TILE_COLUMNS * W::BYTES;
        let span = k / S;
        let mut acc = [[_mm256_setzero_ps(); 2]; GEMV_STREAMS];
        let (stream_bytes, panel_bytes) = (span * row_bytes, k * row_bytes);
        let ahead = |s: usize, j: usize| {
            w.wrapping_add(stream_prefetch_offset(s, j * row_bytes, GEMV_PREFETCH_BYTES, stream_bytes, panel_bytes))
        };
        let lines_per_row = 64 / row_bytes.min(64);
        // SAFETY (whole body): stream s reads k values s·span + j for
        // j < span, and the tail reads S·span ..< k: every k < k of x
        // (x[k·x_step]) and of the panel.
        let step = |acc: &mut [__m256; 2], kk: usize| unsafe {
            // Widened 8 at a time: the bf16 unpack of `load16` measured 4 %
            // slower here (a GEMV from DRAM, 2 threads, A/B), where the FMA
            // ports are idle anyway.
            let wp = w.add(kk * row_bytes);
            let xb = _mm256_broadcast_ss(&*x.add(kk * x_step));
            acc[0] = _mm256_fmadd_ps(xb, W::load8(wp), acc[0]);
            acc[1] = _mm256_fmadd_ps(xb, W::load8(wp.add(8 * W::BYTES)), acc[1]);
        };
        for j in 0..span {
            for s in 0..S {
                if j.is_multiple_of(lines_per_row) {
                    // Never faults (`wrapping_add` forms the address).
                    _mm_prefetch::<_MM_HINT_T0>(ahead(s, j).cast());
                }
                let pair = if S == 1 { j % GEMV_STREAMS } else { s };
                step(&mut acc[pair], s * span + j);
            }
        }
        for kk in S * span..k {
            step(&mut acc[0], kk);
        }
        let mut sum = acc[0];
        for pair in &acc[1..] {
            sum[0] = _mm256_add_ps(sum[0], pair[0]);
            sum[1] = _mm256_add_ps(sum[1], pair[1]);
        }
        // SAFETY: c holds 16 f32.
        unsafe { add_rows(c, &[sum]) };
    }

    fn tiles<W: Weights>(rows: usize) -> Option<GemmTile> {
        // Accumulator sets per tile height: ≥ 8 FMA chains, ≤ 12 accumulators.
        Some(match rows {
            1 => gemv_kernel::<W, GEMV_STREAMS> as GemmTile,
            2 => tile_kernel::<W, 2, 2>,
            3 => tile_kernel::<W, 3, 2>,
            4 => tile_kernel::<W, 4, 1>,
            5 => tile_kernel::<W, 5, 1>,
            6 => tile_kernel::<W, 6, 1>,
            _ => return None,
        })
    }

    /// Widen `count` elements of `W` at `w` to f32 at `out`.
    ///
    /// # Safety
    /// `w` readable for `count` elements, `out` writable for `count` f32;
    /// AVX2, FMA, F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe extern "C" fn widen_kernel<W: Weights>(w: *const u8, count: usize, out: *mut f32) {
        let whole = count - count % 8;
        // SAFETY: i + 8 ≤ count inside the loop; the tail goes through a
        // zero-padded copy of its < 8 elements.
        unsafe {
            for i in (0..whole).step_by(8) {
                _mm256_storeu_ps(out.add(i), W::load8(w.add(i * W::BYTES)));
            }
            if whole < count {
                let mut tail = [0u8; 8 * 4];
                std::ptr::copy_nonoverlapping(w.add(whole * W::BYTES), tail.as_mut_ptr(), (count - whole) * W::BYTES);
                let mut wide = [0f32; 8];
                _mm256_storeu_ps(wide.as_mut_ptr(), W::load8(tail.as_ptr()));
                std::ptr::copy_nonoverlapping(wide.as_ptr(), out.add(whole), count - whole);
            }
        }
    }

    pub(super) fn widen(weights: DType) -> Option<super::WidenBlock> {
        match weights {
            DType::BF16 => Some(widen_kernel::<Bf16>),
            DType::F16 => Some(widen_kernel::<F16>),
            _ => None,
        }
    }

    /// The one-row tile of `weights` in `streams` (1 or [`GEMV_STREAMS`]).
    pub(super) fn gemv(weights: DType, streams: usize) -> Option<GemmTile> {
        fn of<W: Weights>(streams: usize) -> Option<GemmTile> {
            match streams {
                1 => Some(gemv_kernel::<W, 1>),
                GEMV_STREAMS => Some(gemv_kernel::<W, GEMV_STREAMS>),
                _ => None,
            }
        }
        match weights {
            DType::F32 => of::<F32>(streams),
            DType::BF16 => of::<Bf16>(streams),
            DType::F16 => of::<F16>(streams),
            _ => None,
        }
    }

    pub(super) fn tile(weights: DType, rows: usize) -> Option<GemmTile> {
        match weights {
            DType::F32 => tiles::<F32>(rows),
            DType::BF16 => tiles::<Bf16>(rows),
            DType::F16 => tiles::<F16>(rows),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn the_tier_needs_exactly_the_features_it_checks() {
        #[cfg(target_arch = "x86_64")]
        {
            let detected = |f: &str| match f {
                "avx2" => std::arch::is_x86_feature_detected!("avx2"),
                "fma" => std::arch::is_x86_feature_detected!("fma"),
                "f16c" => std::arch::is_x86_feature_detected!("f16c"),
                other => panic!("{other} is not checked by avx2_available"),
            };
            assert_eq!(AVX2_TIER_FEATURES.iter().all(|f| detected(f)), avx2_available());
        }
    }

    #[test]
    fn an_unavailable_tier_is_refused_in_library_terms() {
        let refusal = JitError::TierUnavailable { tier: CpuTier::Avx2, needs: "AVX2", arch: "x86_64" }.to_string();
        assert_eq!(
            refusal,
            "the avx2 CPU tier needs AVX2; this x86_64 CPU lacks them (build for the cranelift or auto tier)"
        );
        match resolve_tier(CpuTier::Avx2) {
            Ok(tier) => assert!(avx2_available() && tier == CodeTier::Avx2),
            Err(e) => assert!(!avx2_available() && !e.to_string().contains("--"), "{e}"),
        }
        assert_eq!(resolve_tier(CpuTier::Cranelift).unwrap(), CodeTier::Cranelift);
    }

    #[test]
    fn gemv_tiles_switch_where_gemv_tile_does() {
        if !avx2_available() {
            return;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (_, _, min_k) = gemv_tiles(dtype).expect("float GEMV tiles");
            let row = TILE_COLUMNS * dtype.size_bytes();
            assert_eq!(streams_for((min_k - 1) * row, x86::GEMV_STREAMS), 1, "{dtype}");
            assert_eq!(streams_for(min_k * row, x86::GEMV_STREAMS), x86::GEMV_STREAMS, "{dtype}");
        }
    }

    #[test]
    fn short_panels_read_as_one_stream() {
        // On AMD: a bf16 panel of SmolLM2's K = 576 (18 KiB) and
        // Llama-3-8B's K = 4096 (128 KiB, four streams of 32 KiB).
        let amd = AMD_MIN_STREAM_BYTES;
        assert_eq!(streams_for_min(576 * TILE_COLUMNS * 2, 4, amd), 1);
        assert_eq!(streams_for_min(4096 * TILE_COLUMNS * 2, 4, amd), 4);
        assert_eq!(streams_for_min(4 * amd - 1, 4, amd), 1);
        assert_eq!(streams_for_min(2 * amd, 2, amd), 2);
        // Elsewhere K = 576 is four streams too, a 3 KiB panel one.
        let intel = INTEL_MIN_STREAM_BYTES;
        assert_eq!(streams_for_min(576 * TILE_COLUMNS * 2, 4, intel), 4);
        assert_eq!(streams_for_min(3 << 10, 4, intel), 1);
        assert_eq!(streams_for_min(4 * intel, 4, intel), 4);
        // And this CPU reads by its vendor's minimum.
        let host = min_stream_bytes();
        assert!(host == amd || host == intel);
        assert_eq!(streams_for(4 * host - 1, 4), 1);
        assert_eq!(streams_for(4 * host, 4), 4);
    }

    /// Every tile against an f64 sum on random data (added into random
    /// accumulators), with k not a multiple of the unroll and a guard after
    /// the tile's output.
    #[test]
    fn tiles_match_an_f64_sum() {
        if !avx2_available() {
            eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        // Every height's tile, and the one-row tile also in one stream
        // (what short panels get).
        let tiles = (1..=MAX_TILE_ROWS).map(|rows| (rows, None)).chain([(1, Some(1))]);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (rows, streams) in tiles.clone() {
                for k in [1, 3, 4, 7, 64, 129] {
                    let x_step = rows + (k % 2); // tiles may read fewer rows than were packed
                    let x: Vec<f32> = (0..k * x_step).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let w32: Vec<f32> = (0..k * TILE_COLUMNS).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let (w_bytes, w_exact): (Vec<u8>, Vec<f32>) = match dtype {
                        DType::F32 => (bytemuck_bytes(&w32), w32.clone()),
                        DType::BF16 => {
                            let h: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
                            (
                                h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                                h.iter().map(|v| v.to_f32()).collect(),
                            )
                        }
                        _ => {
                            let h: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
                            (
                                h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                                h.iter().map(|v| v.to_f32()).collect(),
                            )
                        }
                    };
                    let c0: Vec<f32> = (0..rows * TILE_COLUMNS).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let mut c = c0.clone();
                    c.extend([f32::NAN; 8]); // a guard after the tile
                    let tile = match streams {
                        None => gemm_tile(dtype, rows).expect("every height from 1 to 6 has a tile"),
                        Some(streams) => gemv_tile_with_streams(dtype, streams).expect("a one-stream GEMV"),
                    };
                    // SAFETY: x holds k·x_step f32 (rows ≤ x_step), w
                    // holds k·16 elements of dtype, c holds ≥ rows·16 f32;
                    // avx2_available() was checked above.
                    unsafe { tile(x.as_ptr(), x_step, w_bytes.as_ptr(), k, c.as_mut_ptr()) };
                    for i in 0..rows {
                        for j in 0..TILE_COLUMNS {
                            let exact: f64 = c0[i * TILE_COLUMNS + j] as f64
                                + (0..k)
                                    .map(|kk| x[kk * x_step + i] as f64 * w_exact[kk * TILE_COLUMNS + j] as f64)
                                    .sum::<f64>();
                            let got = c[i * TILE_COLUMNS + j] as f64;
                            let bound = 1e-6 * (k as f64).sqrt() * 4.0;
                            assert!(
                                (got - exact).abs() <= bound,
                                "{dtype} rows {rows} streams {streams:?} k {k} c[{i}][{j}] = {got}, f64 {exact}"
                            );
                        }
                    }
                    assert!(
                        c[rows * TILE_COLUMNS..].iter().all(|v| v.is_nan()),
                        "{dtype} rows {rows} k {k}: wrote past its tile"
                    );
                }
            }
        }
    }

    fn bytemuck_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Widening matches `half` on every bf16 and f16 bit pattern, with
    /// lengths that leave a tail, and writes nothing past `count`.
    #[test]
    fn widening_matches_half_on_every_pattern() {
        if !avx2_available() {
            eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
            return;
        }
        assert!(widen_block(DType::F32).is_none());
        for dtype in [DType::BF16, DType::F16] {
            let widen = widen_block(dtype).expect("bf16 and f16 widen");
            for count in [65536, 65533, 5] {
                let bits: Vec<u16> = (0..count as u32).map(|i| (i * 40503 % 65536) as u16).collect();
                let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
                let mut out = vec![-7.0f32; count + 3];
                // SAFETY: bytes holds count 2-byte elements, out ≥ count f32.
                unsafe { widen(bytes.as_ptr(), count, out.as_mut_ptr()) };
                for (i, &b) in bits.iter().enumerate() {
                    let want =
                        if dtype == DType::BF16 { bf16::from_bits(b).to_f32() } else { f16::from_bits(b).to_f32() };
                    assert!(
                        out[i].to_bits() == want.to_bits() || (out[i].is_nan() && want.is_nan()),
                        "{dtype} {b:#06x}: {} vs {want}",
                        out[i]
                    );
                }
                assert!(out[count..].iter().all(|&v| v == -7.0), "{dtype}: wrote past count");
            }
        }
    }

    #[test]
    fn tiers_resolve_to_what_the_cpu_runs() {
        assert_eq!(resolve_tier(CpuTier::Cranelift).unwrap(), CodeTier::Cranelift);
        let auto = resolve_tier(CpuTier::Auto).unwrap();
        assert_eq!(auto == CodeTier::Avx2, avx2_available());
        match resolve_tier(CpuTier::Avx2) {
            Ok(tier) => assert!(avx2_available() && tier == CodeTier::Avx2),
            Err(e) => assert!(!avx2_available() && e.to_string().contains("AVX2"), "{e}"),
        }
        assert!(gemm_tile(DType::F32, 0).is_none() && gemm_tile(DType::F32, MAX_TILE_ROWS + 1).is_none());
        assert!(gemm_tile(DType::U32, 1).is_none());
    }
}
