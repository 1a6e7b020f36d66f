//! The 256-bit tier of paged decode attention: an AVX2 + FMA (+ F16C)
//! micro-kernel, compiled ahead of time, that the attention op's Cranelift
//! driver calls once per (work item, KV head).
//!
//! One call runs flash attention for the `G` query rows that share one KV
//! head over a contiguous run of key positions of one sequence, reading K
//! and V **directly from the cache's pages** through the per-position table
//! of row offsets (no gather into a buffer), and leaves the rows' online
//! softmax state `(m, l, acc[D])` in the driver's tile layout, so the
//! driver's split-KV partials and host merge are those of the Cranelift
//! tier. Each row reads only the keys of its own range (the tile's `lo`,
//! `hi`): a prefill block's rows go through the same call, the causal
//! diagonal and a window's edge masked per row (their scores set to −inf
//! before the softmax), so no key needs the Cranelift path.
//!
//! Keys go in blocks of [`DECODE_BLOCK_KEYS`]; per block and row tile
//! (`R` = 1, 2 or 4 rows: all of G = 1 or 2, tiles of 4 otherwise):
//!
//! ```text
//! S[r][j] = q_r · K_j          (R rows × 8/R keys of 256-bit FMA chains along D, q read
//!                               from L1, K widened in registers; an 8-way hadd tree
//!                               gives the 8 (row, key) scores in one vector)
//! m' = max(m, max_j S[r][j])   (a row with no key yet uses 0 in place of -inf)
//! P[r][j] = exp(S[r][j] − m'), α = exp(m − m')   (vector polynomial exp)
//! l = α·l + Σ_j P[r][j]
//! acc[r] = α·acc[r] + Σ_j P[r][j]·V_j   (slices of 64/R values of D in R·8/R registers,
//!                                        keys inner, V widened in registers)
//! ```
//!
//! While a block's K rows are scored, the next block's whole K and V slots
//! (every head's, in address order) are software-prefetched through the
//! offsets table; P·V issues no prefetch (one block ahead measured best:
//! two or three blocks ahead, or the slots interleaved across pages, read
//! slower from DRAM).
//!
//! **bf16** with D a multiple of 16 widens 16 elements per 256-bit load,
//! one unpack with zero per 8 (the shuffle port) instead of a widening
//! load and a shift per 8 (the shift competes with the FMAs for their two
//! ports); the unpacks give each 16 elements in the order `[0..4, 8..12]`,
//! `[4..8, 12..16]`, so the kernel reads q from a copy in that order and
//! keeps `acc` permuted the same way between its entry and its exit.
//!
//! **FP8 (E4M3).** Codes are widened in registers through f16 (each code
//! shifted into an f16's bit pattern, 2⁻⁸ × its value, subnormal codes
//! included, NaN codes 0x7f/0xff to NaN; F16C widens the halves), and
//! scaled per key, shared by all the rows: with one scale per head row (g =
//! D) a key's 8 scores are multiplied by its K scale after the dot
//! products, and its probabilities by its V scale before P·V (`l` sums the
//! unscaled ones), so the inner loops are bf16's plus the widening; with
//! g < D each widened vector of 8 is multiplied by its g-block's scale (g a
//! multiple of 8). The 2⁸ rides in those scales. No dequantized copy, one
//! byte read per element.

use kvjit_core::DType;

use crate::microkernel::avx2_available;

/// Keys per block of the decode micro-kernel (its scores and
/// probabilities live on its stack).
pub const DECODE_BLOCK_KEYS: usize = 32;

/// Query rows per tile of the caller's state layout (the lanes of one
/// 128-bit vector of `m`, `l`).
pub const STATE_TILE_ROWS: usize = 4;

/// The C ABI of the decode micro-kernel. For `heads` KV heads, `rows` (G)
/// query rows per head and `keys` key positions:
///
/// - `q`: f32 query rows, pre-scaled, per head `ceil(rows / 4)·4` rows of
///   `head_size` (rows past `rows` zero), head after head;
/// - `blocks`: the cache's element bytes; `key_offsets[j]`, `j < keys`:
///   the element offset of key j's K row of KV head 0; head h's K row is
///   `h·head_size` elements on, its V row `kv_stride` elements after that;
/// - `scales` (FP8 only, else unused): f32 scales, the scale of the
///   `granularity` elements at element offset `o` at `scales[o / granularity]`;
/// - `first_key`: the position of key 0 of the call, in the coordinates of
///   the tiles' key ranges;
/// - `state`: per head `ceil(rows / 4)` tiles of `tile_floats` f32, each
///   `[m: 4, l: 4, lo: 4 i32, hi: 4 i32, acc: 4 × head_size]`: row r reads
///   only the keys whose position is in `[lo[r], hi[r])` (the others are
///   masked: a causal diagonal, a window's edge, a padded row's empty
///   range); `m`, `l` and `acc` are updated in place (flash attention's
///   online softmax), `lo`/`hi` left alone.
///
/// Keys go in blocks, every head of a block before the next block, so the
/// block's K and V slots (all heads contiguous in a page) are read as a
/// whole while they are in cache.
pub type DecodeKernel = unsafe extern "C" fn(
    q: *const f32,
    blocks: *const u8,
    key_offsets: *const i64,
    keys: usize,
    first_key: i64,
    heads: usize,
    scales: *const f32,
    state: *mut f32,
    rows: usize,
    head_size: usize,
    kv_stride: usize,
    granularity: usize,
    tile_floats: usize,
);

/// Offset (f32) of `acc` within a state tile.
pub const STATE_ACC: usize = 16;
/// Offset (32-bit words) of the rows' first key positions (`lo`, i32)
/// within a state tile; their ends (`hi`) follow.
pub const STATE_LO: usize = 8;
/// Offset (32-bit words) of the rows' key range ends (`hi`, i32).
pub const STATE_HI: usize = 12;

/// Whether the decode micro-kernel serves a cache of `cache` elements with
/// head size `head_size` (and an FP8 cache's scale granularity): the CPU
/// runs the 256-bit tier, the element type is f32, bf16, f16 or f8e4m3, D
/// is a multiple of 8, and g a multiple of 8 dividing D.
pub fn decode_supported(cache: DType, head_size: usize, granularity: Option<usize>) -> bool {
    let element = matches!(cache, DType::F32 | DType::BF16 | DType::F16)
        || (cache == DType::F8E4M3
            && granularity.is_some_and(|g| g > 0 && g.is_multiple_of(8) && head_size.is_multiple_of(g)));
    avx2_available() && element && head_size > 0 && head_size.is_multiple_of(8)
}

/// The decode micro-kernel for a cache of `cache` elements, `rows` query
/// rows per KV head and head size `head_size` (bf16 with D a multiple of
/// 16 takes the 16-element widening); `None` when [`decode_supported`]
/// refuses the element type on this CPU (checked again by the caller with
/// its D and g).
pub fn decode_kernel(cache: DType, rows: usize, head_size: usize) -> Option<DecodeKernel> {
    if !avx2_available() || rows == 0 {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::kernel(cache, rows, head_size)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cache, rows, head_size);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use kvjit_core::DType;

    use super::{DECODE_BLOCK_KEYS as KB, DecodeKernel, STATE_ACC, STATE_HI, STATE_LO, STATE_TILE_ROWS};
    use crate::microkernel::x86::{Bf16, F16, F32, Weights};

    /// A cache element type, widened to f32 in registers: the GEMM tiles'
    /// element types ([`Weights`]: `BYTES`, `load8`, `load16`, unscaled),
    /// and FP8.
    trait Elem: Weights {
        /// Whether values carry a per-block scale (FP8).
        const SCALED: bool;
        /// Whether elements widen 16 at a time ([`Weights::load16`]; D a
        /// multiple of 16).
        const PAIRED: bool = false;
        /// Whether those 16 come in the order `[0..4, 8..12]`, `[4..8,
        /// 12..16]` ([`Weights::PERMUTED16`]): the kernel then permutes q
        /// and the state's `acc` the same way on entry, and `acc` back on
        /// exit.
        const PERMUTED: bool = Self::PAIRED && Self::PERMUTED16;
    }

    /// bf16 widened 16 at a time ([`Bf16`]'s `load16`: an unpack with zero
    /// per 8 on the shuffle port, leaving the two FMA ports to the FMAs),
    /// in the `PERMUTED` order.
    struct Bf16Pairs;

    impl Weights for Bf16Pairs {
        const BYTES: usize = 2;
        const PERMUTED16: bool = Bf16::PERMUTED16;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 readable bf16 at `p`.
            unsafe { Bf16::load8(p) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const u8) -> [__m256; 2] {
            // SAFETY: the caller guarantees 16 readable bf16 at `p`.
            unsafe { Bf16::load16(p) }
        }
    }

    impl Elem for Bf16Pairs {
        const SCALED: bool = false;
        const PAIRED: bool = true;
    }

    /// Swap the middle quads of every 16 values of `values` (an involution:
    /// natural order ↔ the `PAIRED` order).
    fn swap_middle_quads(values: &mut [f32]) {
        for group in values.chunks_exact_mut(16) {
            let (low, high) = group.split_at_mut(8);
            low[4..8].swap_with_slice(&mut high[..4]);
        }
    }

    struct E4m3;

    impl Elem for F32 {
        const SCALED: bool = false;
    }

    impl Elem for Bf16 {
        const SCALED: bool = false;
    }

    impl Elem for F16 {
        const SCALED: bool = false;
    }

    impl Elem for E4m3 {
        const SCALED: bool = true;
    }

    impl Weights for E4m3 {
        const BYTES: usize = 1;
        /// The codes' values times 2⁻⁸ ([`E4M3_UNIT`] is the factor back),
        /// through f16: a code `s eeee mmm` shifted into the top byte of a
        /// 16-bit word and arithmetic-shifted right by one (its sign bit
        /// cleared from bit 14) is the f16 `s 0eeee mmm0000000`: exponent
        /// bias 15 instead of 7, so 2⁻⁸ × the code's value, subnormal codes
        /// included (f16 subnormals widen exactly, without the microcode
        /// assists an f32 subnormal operand costs); NaN codes 0x7f/0xff
        /// become all-ones (an f16 NaN). F16C widens the 8 halves.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 readable bytes at `p`.
            let codes = unsafe { _mm_loadl_epi64(p.cast()) };
            let high = _mm_unpacklo_epi8(_mm_setzero_si128(), codes);
            let half = _mm_and_si128(_mm_srai_epi16::<1>(high), _mm_set1_epi16(0xbfff_u16 as i16));
            let magnitude = _mm_and_si128(high, _mm_set1_epi16(0x7f00));
            let nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f00));
            _mm256_cvtph_ps(_mm_or_si128(half, nan))
        }
    }

    /// What [`E4m3::load8`]'s values are multiplied by to be the codes'
    /// values (folded into the scales).
    pub(super) const E4M3_UNIT: f32 = 256.0;

    /// E4M3 widened 16 codes at a time (the f16 route of [`E4m3::load8`]
    /// on 16-bit lanes of a 256-bit vector, F16C on each half): half the
    /// bit operations per code.
    struct E4m3Pairs;

    impl Elem for E4m3Pairs {
        const SCALED: bool = true;
        const PAIRED: bool = true;
    }

    impl Weights for E4m3Pairs {
        const BYTES: usize = 1;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 readable bytes at `p`.
            unsafe { E4m3::load8(p) }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const u8) -> [__m256; 2] {
            // SAFETY: the caller guarantees 16 readable bytes at `p`.
            let codes = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(p.cast()) });
            let high = _mm256_slli_epi16::<8>(codes);
            let half = _mm256_and_si256(_mm256_srai_epi16::<1>(high), _mm256_set1_epi16(0xbfff_u16 as i16));
            let magnitude = _mm256_and_si256(codes, _mm256_set1_epi16(0x7f));
            let nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f));
            let halves = _mm256_or_si256(half, nan);
            [_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves))]
        }
    }

    /// `e^x` in every lane: Cephes' degree-6 polynomial after a range
    /// reduction by ln 2 (≤ 2 ulp); `x < −87.33` (−inf included) gives 0,
    /// NaN stays NaN.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn exp8(x: __m256) -> __m256 {
        // min(c, x) returns x when x is NaN.
        let x = _mm256_min_ps(_mm256_set1_ps(88.376_26), x);
        let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.336_54));
        let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_fmadd_ps(y, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let n = _mm256_cvtps_epi32(fx);
        let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127))));
        _mm256_andnot_ps(underflow, _mm256_mul_ps(y, pow2n))
    }

    /// The 8 horizontal sums of `a[0..8]` as the lanes of one vector.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum8(a: [__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(a[4], a[5]);
        let t3 = _mm256_hadd_ps(a[6], a[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        // u0 = [a0lo a1lo a2lo a3lo | a0hi a1hi a2hi a3hi], u1 the same for a4..a7.
        let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
        let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
        _mm256_add_ps(lo, hi)
    }

    /// Prefetch the `bytes` bytes at `p` into L2 (never faults).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn prefetch(p: *const u8, bytes: usize) {
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o).cast());
            o += 64;
        }
    }

    /// Whole K and V slots (every head of a key: contiguous, consecutive
    /// keys of a page adjacent) to prefetch in address order, so the L2
    /// streamer follows; `k` and `v` are cursors (key, byte) spread over the
    /// score and P·V loops.
    struct Ahead {
        slots: [*const u8; KB],
        keys: usize,
        slot_bytes: usize,
        v_offset: usize,
        k: (usize, usize),
        v: (usize, usize),
    }

    impl Ahead {
        /// Lines of one stream (K or V) left to prefetch.
        fn lines(&self) -> usize {
            self.keys * self.slot_bytes.div_ceil(64)
        }

        /// Prefetch the next `lines` lines of the K (`v` false) or V stream.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn step(&mut self, v: bool, mut lines: usize) {
            let (cursor, offset) = if v { (&mut self.v, self.v_offset) } else { (&mut self.k, 0) };
            while lines > 0 && cursor.0 < self.keys {
                _mm_prefetch::<_MM_HINT_T1>(self.slots[cursor.0].wrapping_add(offset + cursor.1).cast());
                cursor.1 += 64;
                if cursor.1 >= self.slot_bytes {
                    *cursor = (cursor.0 + 1, 0);
                }
                lines -= 1;
            }
        }
    }

    /// The sizes of one call.
    #[derive(Clone, Copy)]
    struct Shape {
        d: usize,
        /// One scale per head row (FP8, g = D): applied to a key's scores
        /// and probabilities, not to every widened vector.
        whole_rows: bool,
        kv_stride: usize,
        g: usize,
        tile_floats: usize,
    }

    /// One block's K and V rows (and FP8 scale rows), `KB` of each; keys
    /// past the block's count repeat its last key.
    struct Rows {
        k: [*const u8; KB],
        v: [*const u8; KB],
        ks: [*const f32; KB],
        vs: [*const f32; KB],
    }

    /// Scores `out[r][j]` (r < R, j < n rounded up to 8/R) of the R query
    /// rows at `q` against the block's K rows.
    ///
    /// # Safety
    /// `q` readable for R rows of `d` f32; the block's rows (and scale rows)
    /// readable as [`Rows`] promises; AVX2, FMA, F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores<E: Elem, const R: usize, const KN: usize>(
        q: *const f32,
        rows: &Rows,
        n: usize,
        sh: Shape,
        out: &mut [[f32; KB]; R],
        ahead: &mut Ahead,
    ) {
        let per_group = ahead.lines().div_ceil(KB / KN);
        let mut j0 = 0;
        while j0 < n {
            ahead.step(false, per_group);
            ahead.step(true, per_group);
            let mut acc = [[_mm256_setzero_ps(); KN]; R];
            // The scale block of d (FP8), without a division per step.
            let (mut blk, mut blk_end) = (0, sh.g);
            let mut d = 0;
            while d < sh.d {
                if d == blk_end {
                    blk += 1;
                    blk_end += sh.g;
                }
                if E::PAIRED {
                    // The scale block of d + 8 (g a multiple of 8).
                    let blk_hi = if d + 8 == blk_end { blk + 1 } else { blk };
                    // SAFETY: d + 16 ≤ D (D a multiple of 16 for a PAIRED type).
                    unsafe { score_pair::<E, R, KN>(q, rows, j0, d, ([blk, blk_hi], sh), &mut acc) };
                    if blk_hi != blk {
                        blk = blk_hi;
                        blk_end += sh.g;
                    }
                    d += 16;
                } else {
                    // SAFETY: d + 8 ≤ D.
                    unsafe { score_step::<E, R, KN>(q, rows, j0, d, (blk, sh), &mut acc) };
                    d += 8;
                }
            }
            let mut flat = [_mm256_setzero_ps(); 8];
            for r in 0..R {
                for kk in 0..KN {
                    flat[r * KN + kk] = acc[r][kk];
                }
            }
            let mut sums = [0f32; 8];
            // SAFETY: sums holds 8 f32.
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), hsum8(flat)) };
            for r in 0..R {
                for kk in 0..KN {
                    out[r][j0 + kk] = sums[r * KN + kk];
                    if E::SCALED && sh.whole_rows {
                        // SAFETY: the key's K scale row (one scale: g = D).
                        out[r][j0 + kk] *= unsafe { *rows.ks[j0 + kk] } * E4M3_UNIT;
                    }
                }
            }
            j0 += KN;
        }
    }

    /// One vector step of [`scores`]: keys `j0 .. j0 + KN`, K's 8 elements
    /// at `d` against q's; `blk` is d's scale block.
    ///
    /// # Safety
    /// As [`scores`]'s, with `d + 8 ≤ D`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn score_step<E: Elem, const R: usize, const KN: usize>(
        q: *const f32,
        rows: &Rows,
        j0: usize,
        d: usize,
        (blk, sh): (usize, Shape),
        acc: &mut [[__m256; KN]; R],
    ) {
        let mut k = [_mm256_setzero_ps(); KN];
        for (kk, kv) in k.iter_mut().enumerate() {
            // SAFETY: j0 + kk < KB (j0 a multiple of KN, KB of 8); rows.k[j]
            // holds D elements (the caller).
            unsafe {
                *kv = E::load8(rows.k[j0 + kk].add(d * E::BYTES));
                if E::SCALED && !sh.whole_rows {
                    let s = _mm256_broadcast_ss(&*rows.ks[j0 + kk].add(blk));
                    *kv = _mm256_mul_ps(*kv, _mm256_mul_ps(s, _mm256_set1_ps(E4M3_UNIT)));
                }
            }
        }
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: q holds R rows of D f32.
            let qv = unsafe { _mm256_loadu_ps(q.add(r * sh.d + d)) };
            for (a, kv) in row.iter_mut().zip(&k) {
                *a = _mm256_fmadd_ps(qv, *kv, *a);
            }
        }
    }

    /// Two vector steps of [`scores`] for a PAIRED type: keys `j0 .. j0 +
    /// KN`, K's 16 elements at `d` (halves in scale blocks `blks`) against
    /// q's 16 values at `d`, each key's pair widened once.
    ///
    /// # Safety
    /// As [`scores`]'s, with `d + 16 ≤ D`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn score_pair<E: Elem, const R: usize, const KN: usize>(
        q: *const f32,
        rows: &Rows,
        j0: usize,
        d: usize,
        (blks, sh): ([usize; 2], Shape),
        acc: &mut [[__m256; KN]; R],
    ) {
        let mut k = [[_mm256_setzero_ps(); 2]; KN];
        for (kk, kv) in k.iter_mut().enumerate() {
            // SAFETY: j0 + kk < KB; rows.k[j] holds D elements (the caller).
            unsafe {
                *kv = E::load16(rows.k[j0 + kk].add(d * E::BYTES));
                if E::SCALED && !sh.whole_rows {
                    for (half, &blk) in kv.iter_mut().zip(&blks) {
                        let s = _mm256_broadcast_ss(&*rows.ks[j0 + kk].add(blk));
                        *half = _mm256_mul_ps(*half, _mm256_mul_ps(s, _mm256_set1_ps(E4M3_UNIT)));
                    }
                }
            }
        }
        for half in 0..2 {
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: q holds R rows of D f32.
                let qv = unsafe { _mm256_loadu_ps(q.add(r * sh.d + d + 8 * half)) };
                for (a, kv) in row.iter_mut().zip(&k) {
                    *a = _mm256_fmadd_ps(qv, kv[half], *a);
                }
            }
        }
    }

    /// `acc[r][d0 .. d0 + 8·SV] = α_r·acc[r][..] + Σ_{j<n} p[r][j]·V_j[..]`
    /// for the R rows of one state tile.
    ///
    /// # Safety
    /// `acc` readable and writable for R rows of D f32 (`d` apart), d0 +
    /// 8·SV ≤ D; the block's V rows as [`Rows`] promises; AVX2, FMA, F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pv_slice<E: Elem, const R: usize, const SV: usize>(
        acc: *mut f32,
        d0: usize,
        rows: &Rows,
        n: usize,
        sh: Shape,
        (p, alpha): (&[[f32; KB]; R], [f32; R]),
    ) {
        let mut a = [[_mm256_setzero_ps(); SV]; R];
        for (r, row) in a.iter_mut().enumerate() {
            let al = _mm256_set1_ps(alpha[r]);
            for (i, x) in row.iter_mut().enumerate() {
                // SAFETY: row r of acc, d0 + 8i + 8 ≤ D.
                *x = _mm256_mul_ps(al, unsafe { _mm256_loadu_ps(acc.add(r * sh.d + d0 + 8 * i)) });
            }
        }
        // Each vector's scale block (FP8; g a multiple of 8).
        let blk: [usize; SV] = std::array::from_fn(|i| (d0 + 8 * i) / sh.g);
        for (j, (&v_row, &v_scales)) in rows.v.iter().zip(&rows.vs).enumerate().take(n) {
            let mut v = [_mm256_setzero_ps(); SV];
            let mut pair = [_mm256_setzero_ps(); 2];
            for (i, x) in v.iter_mut().enumerate() {
                let d = d0 + 8 * i;
                // SAFETY: j < n ≤ KB; the row holds D elements (and, FP8,
                // its D/g scales).
                unsafe {
                    *x = match (E::PAIRED, i % 2 == 1) {
                        (false, _) => E::load8(v_row.add(d * E::BYTES)),
                        (true, false) => {
                            pair = E::load16(v_row.add(d * E::BYTES));
                            pair[0]
                        }
                        (true, true) => pair[1],
                    };
                    if E::SCALED && !sh.whole_rows {
                        let s = _mm256_broadcast_ss(&*v_scales.add(blk[i]));
                        *x = _mm256_mul_ps(*x, _mm256_mul_ps(s, _mm256_set1_ps(E4M3_UNIT)));
                    }
                }
            }
            for (r, row) in a.iter_mut().enumerate() {
                let pb = _mm256_set1_ps(p[r][j]);
                for (x, vv) in row.iter_mut().zip(&v) {
                    *x = _mm256_fmadd_ps(pb, *vv, *x);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (i, x) in row.iter().enumerate() {
                // SAFETY: as the loads above.
                unsafe { _mm256_storeu_ps(acc.add(r * sh.d + d0 + 8 * i), *x) };
            }
        }
    }

    /// One row tile (R rows, state tile at `state`) over one block.
    ///
    /// # Safety
    /// As [`decode`]'s, for this tile's q rows and state.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_block<E: Elem, const R: usize, const KN: usize, const SV: usize>(
        q: *const f32,
        state: *mut f32,
        (rows, n, pos0): (&Rows, usize, i64),
        sh: Shape,
        ahead: &mut Ahead,
    ) {
        let mut s = [[f32::NEG_INFINITY; KB]; R];
        // SAFETY: the caller's bounds on q and the rows.
        unsafe { scores::<E, R, KN>(q, rows, n, sh, &mut s, ahead) };
        let mut alpha = [0f32; R];
        for r in 0..R {
            let row = &mut s[r];
            // The row's keys of this block (the block's key j is at
            // position pos0 + j): the rest masked, past n too.
            // SAFETY: the tile's lo and hi words (state holds a whole tile).
            let (lo, hi) = unsafe {
                let words = state.cast::<i32>();
                (i64::from(*words.add(STATE_LO + r)), i64::from(*words.add(STATE_HI + r)))
            };
            let from = (lo - pos0).clamp(0, n as i64) as usize;
            let to = (hi - pos0).clamp(from as i64, n as i64) as usize;
            row[..from].fill(f32::NEG_INFINITY);
            row[to..].fill(f32::NEG_INFINITY);
            // SAFETY: the tile's m and l lanes (state holds a whole tile).
            let (m_at, l_at) = unsafe { (state.add(r), state.add(4 + r)) };
            // SAFETY: as above.
            let (m_old, l_old) = unsafe { (*m_at, *l_at) };
            let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut nan = _mm256_setzero_ps();
            for c in row.chunks_exact(8) {
                // SAFETY: 8 f32 of the row.
                let x = unsafe { _mm256_loadu_ps(c.as_ptr()) };
                mx = _mm256_max_ps(mx, x);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            }
            let mut lanes = [0f32; 8];
            // SAFETY: lanes holds 8 f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mx) };
            let block_max = if _mm256_movemask_ps(nan) != 0 {
                f32::NAN
            } else {
                lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            };
            // NaN-propagating max (f32::max drops a NaN).
            let m_new = if m_old.is_nan() || block_max.is_nan() { f32::NAN } else { m_old.max(block_max) };
            let m_use = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
            let m_v = _mm256_set1_ps(m_use);
            let mut sum = _mm256_setzero_ps();
            for c in row.chunks_exact_mut(8) {
                // SAFETY: 8 f32 of the row.
                unsafe {
                    let pr = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m_v));
                    _mm256_storeu_ps(c.as_mut_ptr(), pr);
                    sum = _mm256_add_ps(sum, pr);
                }
            }
            // SAFETY: lanes holds 8 f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
            let total =
                ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            let a = (m_old - m_use).exp();
            alpha[r] = a;
            // SAFETY: as above.
            unsafe {
                *m_at = m_new;
                *l_at = a * l_old + total;
            }
            if E::SCALED && sh.whole_rows {
                // P·V multiplies P[j] by V_j's scale in place of every
                // widened vector of V_j (`l` summed the unscaled P).
                for (p, &scale) in row.iter_mut().zip(&rows.vs).take(n) {
                    // SAFETY: the key's V scale row (one scale: g = D).
                    *p *= unsafe { *scale } * E4M3_UNIT;
                }
            }
        }
        // SAFETY: acc of the tile: R rows of D f32.
        let acc = unsafe { state.add(STATE_ACC) };
        let slice = 8 * SV;
        let mut d0 = 0;
        while d0 + slice <= sh.d {
            // SAFETY: d0 + 8·SV ≤ D.
            unsafe { pv_slice::<E, R, SV>(acc, d0, rows, n, sh, (&s, alpha)) };
            d0 += slice;
        }
        while d0 < sh.d {
            if E::PAIRED {
                // SAFETY: D is a multiple of 16 (PAIRED), d0 of 16.
                unsafe { pv_slice::<E, R, 2>(acc, d0, rows, n, sh, (&s, alpha)) };
                d0 += 16;
            } else {
                // SAFETY: D is a multiple of 8.
                unsafe { pv_slice::<E, R, 1>(acc, d0, rows, n, sh, (&s, alpha)) };
                d0 += 8;
            }
        }
    }

    /// The kernel: R rows per tile, `8/R` keys per score tile (2 for R = 3:
    /// 6 of the horizontal sum's 8 lanes), `SV` vectors of D per P·V slice.
    ///
    /// # Safety
    /// The [`DecodeKernel`] contract: every `key_offsets[j]`, j < keys, plus
    /// `h·head_size` for h < heads (and plus `kv_stride`) is the element
    /// offset of a whole row of `head_size` elements inside `blocks`; for
    /// FP8, that offset / `granularity` indexes `head_size / granularity`
    /// f32 inside `scales`; q holds `heads·ceil(rows / 4)·4` rows of
    /// `head_size` f32 and `state` `heads·ceil(rows / 4)` tiles of
    /// `tile_floats ≥ 16 + 4·head_size` f32; head_size a multiple of 8,
    /// granularity (FP8) a multiple of 8 dividing it; AVX2, FMA, F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe extern "C" fn decode<E: Elem, const R: usize, const KN: usize, const SV: usize>(
        q: *const f32,
        blocks: *const u8,
        key_offsets: *const i64,
        keys: usize,
        first_key: i64,
        heads: usize,
        scales: *const f32,
        state: *mut f32,
        rows: usize,
        head_size: usize,
        kv_stride: usize,
        granularity: usize,
        tile_floats: usize,
    ) {
        let g = granularity.max(1);
        let sh = Shape { d: head_size, whole_rows: g == head_size, kv_stride, g, tile_floats };
        // State tiles (and 4-row q tiles) per head; R < 4 only for rows ≤ R.
        let head_tiles = rows.div_ceil(STATE_TILE_ROWS);
        let tiles = if R == STATE_TILE_ROWS { head_tiles } else { 1 };
        // A PAIRED type reads q and acc in its order within each 16 values
        // of D: q from a permuted copy, acc permuted in place until the end.
        let q_tiles = heads * head_tiles;
        let permuted_q: Vec<f32>;
        let q = match E::PERMUTED {
            false => q,
            true => {
                // SAFETY: q holds heads·ceil(rows/4)·4 rows of D f32 (the contract).
                let mut copy = unsafe { std::slice::from_raw_parts(q, q_tiles * STATE_TILE_ROWS * head_size) }.to_vec();
                swap_middle_quads(&mut copy);
                permuted_q = copy;
                permuted_q.as_ptr()
            }
        };
        // Element offset of key j's K row of head 0 (relative to the call).
        // SAFETY: j < keys (the caller's table).
        let offset = |j: usize| unsafe { *key_offsets.add(j) } as usize;
        let mut rows_of = Rows {
            k: [std::ptr::null(); KB],
            v: [std::ptr::null(); KB],
            ks: [std::ptr::null(); KB],
            vs: [std::ptr::null(); KB],
        };
        let slot_bytes = heads * head_size * E::BYTES;
        let v_offset = sh.kv_stride * E::BYTES;
        let empty = || Ahead { slots: [std::ptr::null(); KB], keys: 0, slot_bytes, v_offset, k: (0, 0), v: (0, 0) };
        // The first block's slots, all at once (the loops prefetch the
        // next block's, a share per head).
        let mut first = empty();
        first.keys = keys.min(KB);
        for (j, slot) in first.slots.iter_mut().enumerate().take(first.keys) {
            *slot = blocks.wrapping_add(offset(j) * E::BYTES);
        }
        let lines = first.lines();
        first.step(false, lines);
        first.step(true, lines);
        // An FP8 key's K and V scales (every head's: contiguous f32).
        let scale_bytes = heads * (head_size / sh.g) * 4;
        let prefetch_scales = |o: usize| {
            if E::SCALED {
                for at in [o / sh.g, (o + sh.kv_stride) / sh.g] {
                    prefetch(scales.wrapping_add(at).cast(), scale_bytes);
                }
            }
        };
        for j in 0..first.keys {
            prefetch_scales(offset(j));
        }
        let permute_acc = || {
            if E::PERMUTED {
                for tile in 0..q_tiles {
                    // SAFETY: state holds heads·ceil(rows/4) tiles of
                    // tile_floats ≥ 16 + 4·D f32 (the contract).
                    let acc = unsafe {
                        std::slice::from_raw_parts_mut(
                            state.add(tile * tile_floats + STATE_ACC),
                            STATE_TILE_ROWS * head_size,
                        )
                    };
                    swap_middle_quads(acc);
                }
            }
        };
        permute_acc();
        let share = KB.div_ceil(heads);
        let mut slot = [0usize; KB];
        let mut p0 = 0;
        while p0 < keys {
            let n = (keys - p0).min(KB);
            let next_n = keys.saturating_sub(p0 + KB).min(KB);
            for (j, o) in slot.iter_mut().enumerate() {
                *o = offset(p0 + j.min(n - 1));
            }
            for h in 0..heads {
                let head = h * head_size;
                for (j, &slot) in slot.iter().enumerate() {
                    let o = slot + head;
                    // Rows of the cache (the caller's contract); pointers only.
                    let k = blocks.wrapping_add(o * E::BYTES);
                    rows_of.k[j] = k;
                    rows_of.v[j] = k.wrapping_add(v_offset);
                    if E::SCALED {
                        rows_of.ks[j] = scales.wrapping_add(o / sh.g);
                        rows_of.vs[j] = scales.wrapping_add((o + sh.kv_stride) / sh.g);
                    }
                }
                // This head's share of the next block's whole slots.
                let mut ahead = empty();
                let from = (h * share).min(next_n);
                ahead.keys = ((h + 1) * share).min(next_n) - from;
                for (j, slot) in ahead.slots.iter_mut().enumerate().take(ahead.keys) {
                    let o = offset(p0 + KB + from + j);
                    *slot = blocks.wrapping_add(o * E::BYTES);
                    prefetch_scales(o);
                }
                for t in 0..tiles {
                    let tile = h * head_tiles + t;
                    // SAFETY: tile < heads·ceil(rows/4): its q rows and state
                    // are the caller's; the block's rows are rows of the
                    // cache (the contract).
                    unsafe {
                        tile_block::<E, R, KN, SV>(
                            q.add(tile * STATE_TILE_ROWS * head_size),
                            state.add(tile * sh.tile_floats),
                            (&rows_of, n, first_key + p0 as i64),
                            sh,
                            &mut ahead,
                        )
                    };
                }
            }
            p0 += KB;
        }
        permute_acc();
    }

    /// The kernel for `rows` query rows per KV head: a tile of exactly
    /// that many up to 3 (a GQA group of 3, SmolLM2's, measured 8–12 %
    /// faster at context 2048 than a 4-row tile with a padded row), 4-row
    /// tiles beyond.
    fn for_rows<E: Elem>(rows: usize) -> DecodeKernel {
        match rows {
            1 => decode::<E, 1, 8, 8>,
            2 => decode::<E, 2, 4, 4>,
            3 => decode::<E, 3, 2, 2>,
            _ => decode::<E, 4, 2, 2>,
        }
    }

    pub(super) fn kernel(cache: DType, rows: usize, head_size: usize) -> Option<DecodeKernel> {
        Some(match cache {
            DType::F32 => for_rows::<F32>(rows),
            DType::BF16 if head_size.is_multiple_of(16) => for_rows::<Bf16Pairs>(rows),
            DType::BF16 => for_rows::<Bf16>(rows),
            DType::F16 => for_rows::<F16>(rows),
            DType::F8E4M3 if head_size.is_multiple_of(16) => for_rows::<E4m3Pairs>(rows),
            DType::F8E4M3 => for_rows::<E4m3>(rows),
            _ => return None,
        })
    }

    #[cfg(test)]
    pub(super) fn widen_e4m3(codes: &[u8; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: 8 readable bytes; the test checked avx2_available().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), E4m3::load8(codes.as_ptr())) };
        out
    }

    #[cfg(test)]
    pub(super) fn exp_lanes(x: [f32; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: 8 f32 each; the test checked avx2_available().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp8(_mm256_loadu_ps(x.as_ptr()))) };
        out
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_widen_exactly() {
        if !avx2_available() {
            eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
            return;
        }
        for first in (0..256).step_by(8) {
            let codes: [u8; 8] = std::array::from_fn(|i| (first + i) as u8);
            let got = x86::widen_e4m3(&codes);
            for (code, value) in codes.iter().zip(got) {
                // Every value is 2⁻⁸ × the code's, exactly.
                let want = kvjit_core::fp8::e4m3_to_f32(*code) / x86::E4M3_UNIT;
                assert!(
                    value.to_bits() == want.to_bits() || (value.is_nan() && want.is_nan()),
                    "{code:#04x}: {value} vs {want}"
                );
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp() {
        if !avx2_available() {
            eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
            return;
        }
        let mut x = -87.0f32;
        while x <= 0.0 {
            let xs: [f32; 8] = std::array::from_fn(|i| x + i as f32 * 0.0013);
            for (xi, got) in xs.iter().zip(x86::exp_lanes(xs)) {
                let want = (*xi as f64).exp();
                let ulp = (want as f32).to_bits().abs_diff(got.to_bits());
                assert!(ulp <= 2, "exp({xi}) = {got}, want {want}");
            }
            x += 0.0917;
        }
        let special = x86::exp_lanes([f32::NEG_INFINITY, -100.0, f32::NAN, 0.0, -0.0, 1.0, -1e-8, 80.0]);
        assert_eq!(special[0], 0.0);
        assert_eq!(special[1], 0.0);
        assert!(special[2].is_nan());
        assert_eq!(special[3], 1.0);
        assert_eq!(special[4], 1.0);
    }
}

/// Timings of the decode micro-kernel, Llama-3-8B heads (8 KV heads of
/// 128, 4 query rows each), 128 keys a call: `cargo test --release -p
/// kvjit-jit -- --ignored decode_kernel --nocapture` (`DT=bf16` etc. for
/// one cache type).
#[cfg(all(test, target_arch = "x86_64"))]
mod timing {
    use super::*;

    const HEADS: usize = 8;
    const ROWS: usize = 4;
    const D: usize = 128;
    const KEYS: usize = 128;
    /// FP8 codes hold 400× the values; their scale gives it back.
    const FP8_SCALE: f32 = 1.0 / 400.0;

    /// The cache types timed (all, or the one `DT` names).
    fn dtypes() -> impl Iterator<Item = DType> {
        [DType::F32, DType::BF16, DType::F8E4M3]
            .into_iter()
            .filter(|dtype| std::env::var("DT").map_or(true, |v| v == dtype.to_string()))
    }

    /// `n` normal values in (-0.9, 0.9) as `dtype`'s bytes (denormals
    /// would time microcode assists).
    fn encoded(dtype: DType, n: usize) -> Vec<u8> {
        let values = (0..n).map(|i| ((i * 7919 % 1999) as f32 / 1000.0 - 1.0) * 0.9);
        match dtype {
            DType::F32 => values.flat_map(|v| v.to_le_bytes()).collect(),
            DType::BF16 => values.flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect(),
            _ => values.map(|v| kvjit_core::fp8::e4m3_from_f32(v / FP8_SCALE)).collect(),
        }
    }

    /// One kernel with its q and state: calls over `KEYS` keys.
    struct Caller {
        kernel: DecodeKernel,
        q: Vec<f32>,
        state: Vec<f32>,
    }

    impl Caller {
        const TILE_FLOATS: usize = STATE_ACC + 4 * D;

        fn new(dtype: DType) -> Self {
            let kernel = decode_kernel(dtype, ROWS, D).expect("AVX2 checked by the caller");
            Caller { kernel, q: vec![0.01; HEADS * 4 * D], state: vec![0.0; HEADS * Self::TILE_FLOATS] }
        }

        /// Reset the state and run the kernel over the keys at `offsets`.
        ///
        /// # Safety
        /// Every `offsets[j]`, j < KEYS, plus h·D (h < HEADS, and plus
        /// `kv_stride`) is a whole row of D elements inside `blocks`, and
        /// `scales` covers every such offset / 128.
        unsafe fn call(&mut self, blocks: &[u8], offsets: &[i64], scales: &[f32], kv_stride: usize) {
            for t in 0..HEADS {
                let tile = &mut self.state[t * Self::TILE_FLOATS..];
                tile[..4].fill(f32::NEG_INFINITY);
                // Every row reads every key: [0, KEYS).
                tile[STATE_LO..STATE_LO + 4].fill(f32::from_bits(0));
                tile[STATE_HI..STATE_HI + 4].fill(f32::from_bits(KEYS as u32));
            }
            // SAFETY: the caller's bounds on the rows and scales; q and state
            // are sized for HEADS × 1 tile; AVX2 (the kernel exists).
            unsafe {
                (self.kernel)(
                    self.q.as_ptr(),
                    blocks.as_ptr(),
                    offsets.as_ptr(),
                    KEYS,
                    0,
                    HEADS,
                    scales.as_ptr(),
                    self.state.as_mut_ptr(),
                    ROWS,
                    D,
                    kv_stride,
                    128,
                    Self::TILE_FLOATS,
                )
            };
        }
    }

    /// Compute-bound: one call's K/V (512 KB for bf16) read again and again
    /// from L2.
    #[test]
    #[ignore = "a timing, not a test"]
    fn decode_kernel_speed() {
        if !avx2_available() {
            return;
        }
        for dtype in dtypes() {
            let slot = HEADS * D;
            let kv_stride = KEYS * slot;
            let blocks = encoded(dtype, 2 * kv_stride);
            let scales = vec![FP8_SCALE; 2 * kv_stride / 128];
            let offsets: Vec<i64> = (0..KEYS as i64).map(|j| j * slot as i64).collect();
            let mut caller = Caller::new(dtype);
            let iters = 500;
            let mut best = f64::MAX;
            for _ in 0..7 {
                let start = std::time::Instant::now();
                for _ in 0..iters {
                    // SAFETY: key j's slot is at j·slot, its V rows kv_stride
                    // on, all inside the 2·kv_stride elements of `blocks`;
                    // scales cover blocks/128.
                    unsafe { caller.call(&blocks, &offsets, &scales, kv_stride) };
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            println!("{dtype}: {:.1} ns per key-head", best / (iters * KEYS * HEADS) as f64 * 1e9);
        }
    }

    /// From DRAM: 4096 pages of 16 keys in huge pages, as a cache's blocks
    /// are, visited in a shuffled order; beside one thread's plain read
    /// bandwidth over the same size.
    #[test]
    #[ignore = "a timing, not a test"]
    fn decode_kernel_stream() {
        if !avx2_available() {
            return;
        }
        let (page, pages) = (16usize, 4096usize);
        let slot = HEADS * D;
        // [pages, 2, page, slot]
        let total = pages * 2 * page * slot;
        let kv_stride = page * slot;
        let mut order: Vec<usize> = (0..pages).collect();
        let mut s = 12345u64;
        for i in (1..pages).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        let offsets: Vec<i64> =
            (0..pages * page).map(|j| (order[j / page] * 2 * page * slot + (j % page) * slot) as i64).collect();
        let scales = vec![FP8_SCALE; total / 128 + 1];
        for dtype in dtypes() {
            let bytes = encoded(dtype, total);
            let mut storage = kvjit_core::Tensor::zeros_in_huge_pages(DType::F32, &[bytes.len().div_ceil(4)]).unwrap();
            storage.as_bytes_mut()[..bytes.len()].copy_from_slice(&bytes);
            let blocks = storage.as_bytes();
            let mut caller = Caller::new(dtype);
            let mut best = f64::MAX;
            for _ in 0..3 {
                let start = std::time::Instant::now();
                for call in 0..pages * page / KEYS {
                    // SAFETY: each offset is a slot of a page's K half, its V
                    // row kv_stride on in the same page's V half, all inside
                    // `blocks`; scales cover blocks/128.
                    unsafe { caller.call(blocks, &offsets[call * KEYS..], &scales, kv_stride) };
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            let read = (pages * page * HEADS * 2 * D * dtype.size_bytes()) as f64;
            let per_key_head = best / (pages * page * HEADS) as f64;
            println!("{dtype}: {:.1} ns per key-head, {:.1} GB/s", per_key_head * 1e9, read / best / 1e9);
        }
        // Plain read bandwidth of one thread over the same size.
        let v: Vec<f32> = (0..total).map(|i| i as f32).collect();
        let mut best = f64::MAX;
        let mut sink = 0f32;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            let mut acc = [0f32; 16];
            for c in v.chunks_exact(16) {
                for (a, x) in acc.iter_mut().zip(c) {
                    *a += x;
                }
            }
            sink += acc.iter().sum::<f32>();
            best = best.min(start.elapsed().as_secs_f64());
        }
        println!("read: {:.1} GB/s ({sink})", (v.len() * 4) as f64 / best / 1e9);
    }
}
