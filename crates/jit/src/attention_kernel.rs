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
//! (`R` = 1, 2 or 3 rows: all of G ≤ 3, tiles of 4 otherwise):
//!
//! ```text
//! S[r][j] = q_r · K_j          (R rows × KN keys of 256-bit FMA chains along D — KN = 8,
//!                               4, 2, 2 for R = 1 … 4 —, q read from L1, K widened in
//!                               registers; an 8-way hadd tree gives the R·KN (row, key)
//!                               scores in one vector)
//! m' = max(m, max_j S[r][j])   (a row with no key yet uses 0 in place of -inf)
//! P[r][j] = exp(S[r][j] − m'), α = exp(m − m')   (vector polynomial exp)
//! l = α·l + Σ_j P[r][j]
//! acc[r] = α·acc[r] + Σ_j P[r][j]·V_j   (slices of 8·SV values of D in R·SV registers —
//!                                        SV = KN —, keys inner, V widened in registers)
//! ```
//!
//! The next block's K and V slots are software-prefetched through the
//! offsets table, each head's call a part: for 1- and 2-byte elements the
//! next block's rows of its own head (the rows that head's next call reads
//! first: Llama-3-8B's bf16 heads read ~11 % faster from DRAM than with
//! whole slots), for f32 a share of the whole slots (every head's, in
//! address order; f32 read ~10 % slower head-major). K lines are spread
//! over the score passes and, at 512 bits, V lines over the P·V keys, so
//! the prefetches are issued at an even pace,
//! not in a burst the line-fill buffers cannot take (the burst — K and V
//! both during the scores — read 10–15 % slower from DRAM on a Xeon:
//! `decode_kernel_stream`, bf16 50.5–52.6 → 46.8–49.5 ns per key-head,
//! f32 88–95 → 78–80, FP8 38.5–42 → 37.4–38; the 256-bit P·V loop, short
//! of registers, ran 5–10 % slower in L2 with the steps and no faster from
//! DRAM, so it keeps the burst). One block ahead measured best: two or
//! three blocks ahead, or the slots interleaved across pages, read slower
//! from DRAM. A call's last block prefetches the first block of the keys
//! its caller reads next (`ahead`: the op's next key chunk, which
//! the same thread takes next), so a chunk does not start on a cold block.
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
//!
//! **512-bit width.** On a CPU with AVX-512F, BW and VBMI, with D a
//! multiple of 16 (and an FP8 cache's g equal to D or a multiple of 16),
//! the scores and P·V of each row tile and block run on 512-bit vectors,
//! 16 elements of D per FMA ([`DecodeWidth::Zmm`], picked by
//! [`decode_width`]). Elements widen 32 at a time (FP8: the f16 route on
//! 16-bit lanes, NaN codes through a mask register) and, where a lane
//! order of their own takes fewer instructions, in that order, q and `acc`
//! kept in it between the call's entry and exit: bf16 with D a multiple of
//! 32 as even and odd elements (a mask or a shift of the loaded words, 1
//! instruction per 16), FP8 with g = D and D a multiple of 64 through byte
//! tables (`vpermt2b` into bf16, about 9 instructions per 64 codes);
//! `KVJIT_ATTENTION_REORDERED=off` keeps the natural order. The block
//! loop and the prefetches are the 256-bit kernel's; the online softmax
//! is on 512-bit vectors too (a row's 32 scores two vectors, its keys a
//! mask register), and the scores' horizontal sums a 16-way
//! transpose-and-add tree. Both widths leave the same state layout. Set
//! `KVJIT_ATTENTION_AVX512=off` to run the 256-bit width on such a CPU (to
//! time one against the other).
//!
//! **f16 products.** With AVX512-FP16 as well, an FP8 cache with g = D and
//! D a multiple of 64 takes [`DecodeWidth::ZmmHalf`]: codes widened to f16,
//! scores and P·V as 32-lane f16 FMAs with per-row power-of-two scales,
//! folded and flushed into the f32 state per block (the arithmetic and its
//! error bound: `x86/half.rs`). `KVJIT_ATTENTION_FP16=off` keeps the f32
//! products.

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
/// - `ahead`: entries `keys .. keys + ahead` of `key_offsets` are readable
///   too: the keys the caller reads next (the next key chunk of the same
///   sequence), whose slots the call's last block prefetches so the next
///   call does not start on a cold block. They are only prefetched (which
///   never faults), so any value is sound;
/// - `scales` (FP8 only, else unused): f32 scales, the scale of the
///   `granularity` elements at element offset `o` at `scales[o /
///   granularity]`; the key offsets and `kv_stride` are multiples of
///   `granularity` (as a cache's are: g divides D), so a row's scales are
///   found without a division per head;
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
    ahead: usize,
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

/// The vector width of the decode micro-kernel's products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeWidth {
    /// 256-bit vectors (AVX2 + FMA + F16C): every cache it serves.
    Ymm,
    /// 512-bit vectors (AVX-512F, BW and VBMI) for the scores and P·V, where
    /// [`zmm_serves`] says so.
    Zmm,
    /// 512-bit vectors of 32 f16 products (AVX512-FP16) for an FP8 cache
    /// with one scale per head row, where [`half_serves`] says so: half the
    /// instructions of [`DecodeWidth::Zmm`] per product, at f16 rounding
    /// (the bound is in the module docs of the kernel).
    ZmmHalf,
}

/// Whether the f16-product width ([`DecodeWidth::ZmmHalf`]) serves this
/// cache on this CPU: an FP8 (E4M3) cache with g = D, D a multiple of 64,
/// where the 512-bit width serves, on a CPU with AVX512-FP16 (Sapphire
/// Rapids and later), unless `KVJIT_ATTENTION_FP16` is `off` (read once:
/// to time the f32 products against it).
pub fn half_serves(cache: DType, head_size: usize, granularity: Option<usize>) -> bool {
    cache == DType::F8E4M3
        && granularity == Some(head_size)
        && head_size.is_multiple_of(64)
        && zmm_serves(cache, head_size, granularity)
        && half_available()
}

/// Whether this CPU has AVX512-FP16 and `KVJIT_ATTENTION_FP16` is not `off`.
fn half_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let cpu = std::arch::is_x86_feature_detected!("avx512fp16");
        #[cfg(not(target_arch = "x86_64"))]
        let cpu = false;
        cpu && std::env::var("KVJIT_ATTENTION_FP16").map_or(true, |v| v != "off")
    })
}

/// Whether the 512-bit width serves a cache of `cache` elements with head
/// size `head_size` (and an FP8 cache's granularity) on this CPU: AVX-512F,
/// BW and VBMI, D a multiple of 16 and, FP8 with g < D, g a multiple of 16.
pub fn zmm_serves(cache: DType, head_size: usize, granularity: Option<usize>) -> bool {
    let scales = cache != DType::F8E4M3 || granularity.is_some_and(|g| g == head_size || g.is_multiple_of(16));
    decode_supported(cache, head_size, granularity) && avx512_available() && head_size.is_multiple_of(16) && scales
}

/// Whether this CPU has AVX-512F, BW and VBMI (the FP8 widenings' 16-bit
/// lanes, masks and byte tables: Ice Lake and later, Zen 4; Skylake-SP and
/// Cascade Lake run the 256-bit width) and `KVJIT_ATTENTION_AVX512` is not
/// `off` (read once: it makes such a CPU run the 256-bit kernel, to measure
/// one against the other).
fn avx512_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let cpu = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vbmi");
        #[cfg(not(target_arch = "x86_64"))]
        let cpu = false;
        cpu && std::env::var("KVJIT_ATTENTION_AVX512").map_or(true, |v| v != "off")
    })
}

/// The width the decode micro-kernel runs at for this cache: f16 products
/// where [`half_serves`], 512-bit where [`zmm_serves`], else 256-bit.
pub fn decode_width(cache: DType, head_size: usize, granularity: Option<usize>) -> DecodeWidth {
    if half_serves(cache, head_size, granularity) {
        DecodeWidth::ZmmHalf
    } else if zmm_serves(cache, head_size, granularity) {
        DecodeWidth::Zmm
    } else {
        DecodeWidth::Ymm
    }
}

/// The decode micro-kernel for a cache of `cache` elements (an FP8 cache's
/// scale granularity), `rows` query rows per KV head and head size
/// `head_size`, at [`decode_width`]; `None` when [`decode_supported`]
/// refuses the element type on this CPU (checked again by the caller with
/// its D and g).
pub fn decode_kernel(cache: DType, rows: usize, head_size: usize, granularity: Option<usize>) -> Option<DecodeKernel> {
    decode_kernel_at(decode_width(cache, head_size, granularity), cache, rows, head_size, granularity)
}

/// The prefill kernel of the 256-bit tier (the [`DecodeKernel`] ABI, for
/// a query block's rows): whole blocks of keys through 6 × 16 register
/// tiles, no horizontal sums; for f32, bf16, f16 and FP8 caches (an FP8
/// cache's g a multiple of 8 dividing D) with D a multiple of 16 on a CPU
/// with AVX2, FMA and F16C, else `None` (the caller keeps the decode
/// kernel's 4-row tiles).
pub fn prefill_kernel(cache: DType, head_size: usize, granularity: Option<usize>) -> Option<DecodeKernel> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::prefill::kernel(cache, head_size, granularity)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cache, head_size, granularity);
        None
    }
}

/// The decode micro-kernel at `width` (bf16 at 256 bits with D a multiple
/// of 16 takes the 16-element widening); `None` when this CPU lacks the
/// width's features or the cache type is not served, and for
/// [`DecodeWidth::Zmm`] where [`zmm_serves`] refuses the cache.
pub fn decode_kernel_at(
    width: DecodeWidth,
    cache: DType,
    rows: usize,
    head_size: usize,
    granularity: Option<usize>,
) -> Option<DecodeKernel> {
    let served = match width {
        DecodeWidth::Ymm => true,
        DecodeWidth::Zmm => zmm_serves(cache, head_size, granularity),
        DecodeWidth::ZmmHalf => half_serves(cache, head_size, granularity),
    };
    if !avx2_available() || rows == 0 || !served {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match width {
            DecodeWidth::Ymm => x86::kernel(cache, rows, head_size),
            DecodeWidth::Zmm => x86::kernel_zmm(cache, rows, head_size, granularity),
            DecodeWidth::ZmmHalf => Some(x86::kernel_half(rows)),
        }
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

    /// A method of a reordered element type that is its natural type's
    /// (the same elements, widened in their natural order): `load8`,
    /// `load16` ([`Weights`]) or `widen16` ([`Elem`]) of `$natural`.
    macro_rules! natural {
        (load8 of $natural:ty) => {
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn load8(p: *const u8) -> __m256 {
                // SAFETY: the caller guarantees 8 readable elements at `p`.
                unsafe { <$natural>::load8(p) }
            }
        };
        (load16 of $natural:ty) => {
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn load16(p: *const u8) -> [__m256; 2] {
                // SAFETY: the caller guarantees 16 readable elements at `p`.
                unsafe { <$natural>::load16(p) }
            }
        };
        (widen16 of $natural:ty) => {
            #[inline]
            #[target_feature(enable = "avx512f,avx2,fma,f16c")]
            unsafe fn widen16(p: *const u8) -> __m512 {
                // SAFETY: the caller guarantees 16 readable elements at `p`.
                unsafe { <$natural>::widen16(p) }
            }
        };
    }

    mod half;
    pub(super) mod prefill;

    /// A cache element type, widened to f32 in registers: the GEMM tiles'
    /// element types ([`Weights`]: `BYTES`, `load8`, `load16`, unscaled),
    /// and FP8.
    trait Elem: Weights {
        /// Whether values carry a per-block scale (FP8).
        const SCALED: bool;
        /// Whether elements widen 16 at a time ([`Weights::load16`]; D a
        /// multiple of 16).
        const PAIRED: bool = false;
        /// Whether the widened vectors hold the elements in an order of the
        /// type's own ([`Elem::permute`]: for a `PAIRED` type `[0..4,
        /// 8..12]`, `[4..8, 12..16]`, [`Weights::PERMUTED16`]): the kernel
        /// then permutes q and the state's `acc` the same way on entry, and
        /// `acc` back on exit.
        const PERMUTED: bool = Self::PAIRED && Self::PERMUTED16;
        /// Elements of D the [`Zmm`] width widens together, in an order of
        /// their own for a `PERMUTED` type: 16, or 32 ([`Elem::widen32`])
        /// or 64 ([`Elem::widen64`]) for a type whose wider widening takes
        /// fewer instructions in a lane order; D is then a multiple of it,
        /// and the scores and P·V take every `GRANULE` elements that way.
        const GRANULE: usize = 16;

        /// The `PERMUTED` order of `values` from their natural order
        /// (`back`: the reverse), on every 16 or `GRANULE` values.
        fn permute(values: &mut [f32], _back: bool) {
            swap_middle_quads(values);
        }

        /// Sixteen consecutive elements at `p` widened to f32 in one
        /// 512-bit vector, in their order (the [`Zmm`] width; FP8 codes
        /// times 2⁻⁸ as [`E4m3::load8`]'s).
        ///
        /// # Safety
        /// `p` readable for 16 elements; AVX-512F, AVX2, FMA, F16C.
        unsafe fn widen16(p: *const u8) -> __m512;

        /// Thirty-two consecutive elements at `p` widened as
        /// [`Elem::widen16`]'s, in two vectors: one `widen16` each, unless
        /// the type widens 32 at once for fewer instructions (FP8; bf16 in
        /// its `PERMUTED` order, a `GRANULE` of 32).
        ///
        /// # Safety
        /// `p` readable for 32 elements; AVX-512F and BW, AVX2, FMA, F16C.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn widen32(p: *const u8) -> [__m512; 2] {
            // SAFETY: the caller guarantees 32 readable elements at `p`.
            unsafe { [Self::widen16(p), Self::widen16(p.add(16 * Self::BYTES))] }
        }

        /// Sixty-four consecutive elements at `p` widened in four vectors,
        /// in the type's `PERMUTED` order for a `GRANULE` of 64 (else two
        /// [`Elem::widen32`]).
        ///
        /// # Safety
        /// `p` readable for 64 elements; AVX-512F, BW and VBMI; AVX2, FMA,
        /// F16C.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
        unsafe fn widen64(p: *const u8) -> [__m512; 4] {
            // SAFETY: the caller guarantees 64 readable elements at `p`.
            let ([a, b], [c, d]) = unsafe { (Self::widen32(p), Self::widen32(p.add(32 * Self::BYTES))) };
            [a, b, c, d]
        }
    }

    /// bf16 widened 16 at a time ([`Bf16`]'s `load16`: an unpack with zero
    /// per 8 on the shuffle port, leaving the two FMA ports to the FMAs),
    /// in the `PERMUTED` order.
    struct Bf16Pairs;

    impl Weights for Bf16Pairs {
        const BYTES: usize = 2;
        const PERMUTED16: bool = Bf16::PERMUTED16;
        natural!(load8 of Bf16);
        natural!(load16 of Bf16);
    }

    impl Elem for Bf16Pairs {
        const SCALED: bool = false;
        const PAIRED: bool = true;
        natural!(widen16 of Bf16);
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
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        unsafe fn widen16(p: *const u8) -> __m512 {
            // SAFETY: the caller guarantees 16 readable f32 at `p`.
            unsafe { _mm512_loadu_ps(p.cast()) }
        }
    }

    impl Elem for Bf16 {
        const SCALED: bool = false;
        /// A bf16 is the top half of an f32: widen and shift up.
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        unsafe fn widen16(p: *const u8) -> __m512 {
            // SAFETY: the caller guarantees 16 readable bf16 (32 bytes) at `p`.
            let h = unsafe { _mm256_loadu_si256(p.cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    impl Elem for F16 {
        const SCALED: bool = false;
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        unsafe fn widen16(p: *const u8) -> __m512 {
            // SAFETY: the caller guarantees 16 readable f16 (32 bytes) at `p`.
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
        }
    }

    impl Elem for E4m3 {
        const SCALED: bool = true;
        /// [`e4m3_halves16`]'s f16 patterns, widened by one 512-bit F16C
        /// conversion.
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        unsafe fn widen16(p: *const u8) -> __m512 {
            // SAFETY: the caller guarantees 16 readable codes at `p`.
            _mm512_cvtph_ps(unsafe { e4m3_halves16(p) })
        }

        /// [`E4m3::load8`]'s f16 route on 32 codes in the 16-bit lanes of
        /// one 512-bit vector, NaN codes set through a mask register:
        /// about 11 instructions for 32 codes, against 18 for two
        /// [`E4m3::widen16`] (every one of them on the two ports the FMAs
        /// use while 512-bit instructions run).
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn widen32(p: *const u8) -> [__m512; 2] {
            // SAFETY: the caller guarantees 32 readable codes at `p`.
            let codes = _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(p.cast()) });
            let half = _mm512_srai_epi16::<1>(_mm512_slli_epi16::<8>(codes));
            let half = _mm512_and_si512(half, _mm512_set1_epi16(0xbfff_u16 as i16));
            let magnitude = _mm512_and_si512(codes, _mm512_set1_epi16(0x7f));
            let nan = _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7f));
            let half = _mm512_mask_mov_epi16(half, nan, _mm512_set1_epi16(-1));
            [_mm512_cvtph_ps(_mm512_castsi512_si256(half)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(half))]
        }
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
        natural!(widen16 of E4m3);
    }

    /// Sixteen E4M3 codes at `p` as the f16 bit patterns of
    /// [`E4m3::load8`] (2⁻⁸ × each code's value, NaN codes all-ones).
    ///
    /// # Safety
    /// `p` readable for 16 bytes; AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn e4m3_halves16(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let codes = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(p.cast()) });
        let high = _mm256_slli_epi16::<8>(codes);
        let half = _mm256_and_si256(_mm256_srai_epi16::<1>(high), _mm256_set1_epi16(0xbfff_u16 as i16));
        let magnitude = _mm256_and_si256(codes, _mm256_set1_epi16(0x7f));
        let nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f));
        _mm256_or_si256(half, nan)
    }

    impl Weights for E4m3Pairs {
        const BYTES: usize = 1;
        natural!(load8 of E4m3);

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load16(p: *const u8) -> [__m256; 2] {
            // SAFETY: the caller guarantees 16 readable bytes at `p`.
            let halves = unsafe { e4m3_halves16(p) };
            [_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves))]
        }
    }

    /// bf16 widened 32 at a time on the [`Zmm`] width, D a multiple of 32:
    /// one 512-bit load holds 32 bf16 in 16 words of 32 bits, each word an
    /// even element in its low half and the next (odd) one in its high
    /// half; the odd elements are the words masked (`vpandd`), the even
    /// ones the words shifted up by 16 (`vpslld`): 1 instruction per 16
    /// elements instead of a widening load and a shift. q and `acc` are kept in that
    /// order ([`deinterleave32`]).
    struct Bf16EvenOdd;

    impl Weights for Bf16EvenOdd {
        const BYTES: usize = 2;
        natural!(load8 of Bf16);
    }

    impl Elem for Bf16EvenOdd {
        const SCALED: bool = false;
        const PERMUTED: bool = true;
        const GRANULE: usize = 32;

        fn permute(values: &mut [f32], back: bool) {
            deinterleave32(values, back);
        }

        // Natural order (never called: D is a multiple of 32).
        natural!(widen16 of Bf16);

        /// `[even elements, odd elements]` of the 32 at `p`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn widen32(p: *const u8) -> [__m512; 2] {
            // SAFETY: the caller guarantees 32 readable bf16 (64 bytes) at `p`.
            let words = unsafe { _mm512_loadu_si512(p.cast()) };
            let odd = _mm512_and_si512(words, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(words)), _mm512_castsi512_ps(odd)]
        }
    }

    /// Within every 32 values, the even-indexed ones then the odd ones
    /// ([`Bf16EvenOdd`]'s order); `back`: the reverse. Two 512-bit
    /// two-source permutes per 32 values (a call permutes q and `acc`:
    /// scalar moves cost the kernel ~10 % at 128 keys a call).
    fn deinterleave32(values: &mut [f32], back: bool) {
        assert!(super::avx512_available(), "the 512-bit width runs only where AVX-512 is available");
        // SAFETY: AVX-512F, checked above.
        unsafe { deinterleave32_zmm(values, back) }
    }

    /// [`deinterleave32`] on 512-bit vectors.
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn deinterleave32_zmm(values: &mut [f32], back: bool) {
        // Lane i of the result takes lane idx[i] of (a, b), b's lanes 16..32.
        let (first, second): ([i32; 16], [i32; 16]) = match back {
            // Evens, odds.
            false => (std::array::from_fn(|i| 2 * i as i32), std::array::from_fn(|i| 2 * i as i32 + 1)),
            // Interleave the halves back: i/2 of evens (a) or odds (b).
            true => (
                std::array::from_fn(|i| (i / 2 + 16 * (i % 2)) as i32),
                std::array::from_fn(|i| ((i + 16) / 2 + 16 * (i % 2)) as i32),
            ),
        };
        // SAFETY: each array holds 16 i32.
        let (first, second) =
            unsafe { (_mm512_loadu_si512(first.as_ptr().cast()), _mm512_loadu_si512(second.as_ptr().cast())) };
        for group in values.chunks_exact_mut(32) {
            let at = group.as_mut_ptr();
            // SAFETY: the group holds 32 f32.
            unsafe {
                let (a, b) = (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)));
                _mm512_storeu_ps(at, _mm512_permutex2var_ps(a, first, b));
                _mm512_storeu_ps(at.add(16), _mm512_permutex2var_ps(a, second, b));
            }
        }
    }

    /// E4M3 widened 64 codes at a time through byte tables (AVX-512 VBMI),
    /// for FP8 caches with one scale per head row (g = D) and D a multiple
    /// of 64 on the [`Zmm`] width: each code's 7 magnitude bits index two
    /// 128-byte tables (`vpermt2b`) holding the high and low bytes of the
    /// bf16 of 2⁻⁸ × its value ([`E4m3::load8`]'s values: exact, subnormal
    /// codes included, the NaN codes a bf16 NaN); the sign is OR-ed in and
    /// two rounds of unpacks put each bf16 in the top half of an f32. About
    /// 9 instructions per 64 codes, against 22 for two [`E4m3::widen32`];
    /// the unpacks work within 128-bit lanes, so the vectors hold the
    /// elements in the order [`transpose_quads64`] gives (q and `acc` are
    /// kept in it).
    struct E4m3Lut;

    /// The bf16 bit patterns of 2⁻⁸ × each E4M3 magnitude `0..128` (0x7f,
    /// NaN, a quiet bf16 NaN), split into their high and low bytes.
    static E4M3_BF16_BYTES: [[u8; 128]; 2] = {
        let mut bytes = [[0u8; 128]; 2];
        let mut m = 0;
        while m < 128 {
            let bits = e4m3_bf16_bits(m as u8);
            bytes[0][m] = (bits >> 8) as u8;
            bytes[1][m] = bits as u8;
            m += 1;
        }
        bytes
    };

    /// The bf16 bits of 2⁻⁸ × the value of the E4M3 magnitude `m < 128`
    /// (exponent bias 7, 3 mantissa bits; 0x7f NaN), exactly: a normal
    /// code `eeee mmm` is `2^(e − 15)·1.mmm`, bf16 exponent e + 112; a
    /// subnormal `0000 f` is `f·2⁻¹⁷`, normalized.
    const fn e4m3_bf16_bits(m: u8) -> u16 {
        let (e, f) = ((m >> 3) as u16, (m & 7) as u16);
        if m == 0x7f {
            0x7fc0
        } else if e != 0 {
            ((e + 112) << 7) | (f << 4)
        } else if f == 0 {
            0
        } else {
            // f = 2^p·(1 + r), p = ⌊log₂ f⌋: (1 + r)·2^(p − 17).
            let p = 15 - f.leading_zeros() as u16;
            ((p + 110) << 7) | (((f << 7) >> p) - 128)
        }
    }

    /// Within every 64 values, swap the index of the 16-value group and
    /// that of the 4-value quad inside it (value `16g + 4k + i` ↔ `16k +
    /// 4g + i`): natural order ↔ [`E4m3Lut`]'s (an involution).
    fn transpose_quads64(values: &mut [f32]) {
        for group in values.chunks_exact_mut(64) {
            // Whole quads moved (16-byte copies, not 4 scalar swaps each).
            let (quads, _) = group.as_chunks_mut::<4>();
            for g in 0..4 {
                for k in g + 1..4 {
                    quads.swap(4 * g + k, 4 * k + g);
                }
            }
        }
    }

    impl Weights for E4m3Lut {
        const BYTES: usize = 1;
        natural!(load8 of E4m3);
    }

    impl Elem for E4m3Lut {
        const SCALED: bool = true;
        const PERMUTED: bool = true;
        const GRANULE: usize = 64;

        fn permute(values: &mut [f32], _back: bool) {
            transpose_quads64(values);
        }

        // Natural order (the 64-element steps never call it: D is a
        // multiple of 64).
        natural!(widen16 of E4m3);

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
        unsafe fn widen64(p: *const u8) -> [__m512; 4] {
            let [high_bytes, low_bytes] = &E4M3_BF16_BYTES;
            // SAFETY: each table is 128 bytes; the caller guarantees 64
            // readable codes at `p`.
            let (high_table, low_table, codes) = unsafe {
                (
                    [
                        _mm512_loadu_si512(high_bytes.as_ptr().cast()),
                        _mm512_loadu_si512(high_bytes[64..].as_ptr().cast()),
                    ],
                    [
                        _mm512_loadu_si512(low_bytes.as_ptr().cast()),
                        _mm512_loadu_si512(low_bytes[64..].as_ptr().cast()),
                    ],
                    _mm512_loadu_si512(p.cast()),
                )
            };
            // The index's bit 7 (the sign) is ignored: 7 bits, 128 entries.
            let high = _mm512_permutex2var_epi8(high_table[0], codes, high_table[1]);
            // high | (codes & 0x80): the sign into the bf16's top bit.
            let high = _mm512_ternarylogic_epi32::<0xf8>(high, codes, _mm512_set1_epi8(0x80_u8 as i8));
            let low = _mm512_permutex2var_epi8(low_table[0], codes, low_table[1]);
            let (words_low, words_high) = (_mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high));
            let zero = _mm512_setzero_si512();
            [
                _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, words_low)),
                _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, words_low)),
                _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, words_high)),
                _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, words_high)),
            ]
        }
    }

    /// Cephes' `e^r` polynomial for `x` reduced by `fx` multiples of ln 2,
    /// on either width's vectors (its intrinsics passed in): the one body of
    /// [`exp8`] and [`exp16`].
    macro_rules! exp_polynomial {
        ($x:expr, $fx:expr, $set1:ident, $fmadd:ident, $fnmadd:ident, $mul:ident, $add:ident) => {{
            let r = $fnmadd($fx, $set1(0.693_359_4), $x);
            let r = $fnmadd($fx, $set1(-2.121_944_4e-4), r);
            let mut y = $set1(1.987_569_1e-4);
            for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
                y = $fmadd(y, r, $set1(c));
            }
            $fmadd(y, $mul(r, r), $add(r, $set1(1.0)))
        }};
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
        let y = exp_polynomial!(x, fx, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, _mm256_add_ps);
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

    /// K and V slots to prefetch in address order, so the L2 streamer
    /// follows: `slot_bytes` from `base` bytes into each of `slots` (whole
    /// slots — every head of a key: contiguous, consecutive keys of a page
    /// adjacent — or one head's rows); `k` and `v` are cursors (key, byte)
    /// spread over the score and P·V loops.
    struct Ahead<'a> {
        slots: &'a [*const u8],
        base: usize,
        slot_bytes: usize,
        v_offset: usize,
        k: (usize, usize),
        v: (usize, usize),
    }

    impl<'a> Ahead<'a> {
        /// `slot_bytes` of each of `slots` from `base` on, both cursors at
        /// the start.
        fn new(slots: &'a [*const u8], base: usize, slot_bytes: usize, v_offset: usize) -> Self {
            Ahead { slots, base, slot_bytes, v_offset, k: (0, 0), v: (0, 0) }
        }

        /// Lines of one stream (K or V) of this share.
        fn lines(&self) -> usize {
            self.slots.len() * self.slot_bytes.div_ceil(64)
        }

        /// Lines of one stream to prefetch at each of `visits` steps so the
        /// stream is done by the last (`visits` at most the steps taken).
        fn per_visit(&self, visits: usize) -> usize {
            self.lines().div_ceil(visits.max(1))
        }

        /// Prefetch the next `lines` lines of the K (`v` false) or V stream:
        /// a tight loop over each slot's lines, the cursor moved once per
        /// slot (moved per line, it cost the kernel in L2 10–20 %: bf16
        /// 39.4–40.1 → 35.3–35.6 ns per key-head, f32 49–70 → 42–60).
        /// Always inlined and free of target features: a call from the
        /// score or P·V loops would spill their vector registers (the P·V
        /// loop of FP8 ran 1.8× slower from DRAM with `step` a call).
        #[inline(always)]
        fn step(&mut self, v: bool, mut lines: usize) {
            let (cursor, offset) = if v { (&mut self.v, self.base + self.v_offset) } else { (&mut self.k, self.base) };
            let (mut key, mut at) = *cursor;
            while lines > 0 && key < self.slots.len() {
                let slot = self.slots[key].wrapping_add(offset);
                let end = self.slot_bytes.min(at + 64 * lines);
                lines -= (end - at).div_ceil(64);
                while at < end {
                    // SAFETY: SSE (every x86-64); a prefetch never faults.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(slot.wrapping_add(at).cast()) };
                    at += 64;
                }
                if at >= self.slot_bytes {
                    (key, at) = (key + 1, 0);
                }
            }
            *cursor = (key, at);
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

    /// One block's K and V rows (and FP8 scale rows) of one head, `KB` of
    /// each; keys past the block's count repeat its last key. The pointers
    /// are head 0's K rows (and scale rows), set once per block; a head's
    /// rows are `head` bytes (`head_scales` f32) on, V's `v_offset` bytes
    /// (`v_scales` f32) after K's. Pointers only (wrapping): the kernel's
    /// contract makes every row it reads a row of the cache.
    struct Rows {
        k0: [*const u8; KB],
        ks0: [*const f32; KB],
        head: usize,
        head_scales: usize,
        v_offset: usize,
        v_scales: usize,
    }

    impl Rows {
        /// Key j's K row.
        #[inline(always)]
        fn k(&self, j: usize) -> *const u8 {
            self.k0[j].wrapping_add(self.head)
        }

        /// Key j's V row.
        #[inline(always)]
        fn v(&self, j: usize) -> *const u8 {
            self.k0[j].wrapping_add(self.head + self.v_offset)
        }

        /// Key j's K scale row (FP8).
        #[inline(always)]
        fn ks(&self, j: usize) -> *const f32 {
            self.ks0[j].wrapping_add(self.head_scales)
        }

        /// Key j's V scale row (FP8).
        #[inline(always)]
        fn vs(&self, j: usize) -> *const f32 {
            self.ks0[j].wrapping_add(self.head_scales + self.v_scales)
        }
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
        let per_group = ahead.per_visit(KB / KN);
        let mut j0 = 0;
        while j0 < n {
            // Both streams here: a prefetch step in the 256-bit P·V loop
            // costs it registers it has not got (the 512-bit width spreads
            // V over its P·V).
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
            // SAFETY: j0 + KN ≤ KB; the block's scale rows (the caller's).
            unsafe { store_scores::<E, R, KN>(flat, rows, j0, sh, out) };
            j0 += KN;
        }
    }

    /// The scores of rows `r < R` against keys `j0 .. j0 + KN` from their
    /// vectors of partial sums (`flat[r·KN + kk]`), into `out` (an FP8
    /// cache's whole-row K scales applied).
    ///
    /// # Safety
    /// `j0 + KN ≤ KB`; with FP8 and g = D, the keys' K scale rows readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_scores<E: Elem, const R: usize, const KN: usize>(
        flat: [__m256; 8],
        rows: &Rows,
        j0: usize,
        sh: Shape,
        out: &mut [[f32; KB]; R],
    ) {
        let mut sums = [0f32; 8];
        let mut scores = hsum8(flat);
        if E::SCALED && sh.whole_rows {
            // Lane r·KN + kk times key j0 + kk's K scale (one per row: g = D),
            // all rows in one multiply.
            // SAFETY: the keys' K scale rows (the caller's).
            let scale: [f32; KN] = std::array::from_fn(|kk| unsafe { *rows.ks(j0 + kk) } * E4M3_UNIT);
            let lanes: [f32; 8] = std::array::from_fn(|lane| scale[lane % KN]);
            // SAFETY: lanes holds 8 f32.
            scores = _mm256_mul_ps(scores, unsafe { _mm256_loadu_ps(lanes.as_ptr()) });
        }
        // SAFETY: sums holds 8 f32.
        unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), scores) };
        for r in 0..R {
            for kk in 0..KN {
                out[r][j0 + kk] = sums[r * KN + kk];
            }
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
            // SAFETY: j0 + kk < KB (j0 a multiple of KN, KB of 8); rows.k(j)
            // holds D elements (the caller).
            unsafe {
                *kv = E::load8(rows.k(j0 + kk).add(d * E::BYTES));
                if E::SCALED && !sh.whole_rows {
                    let s = _mm256_broadcast_ss(&*rows.ks(j0 + kk).add(blk));
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
            // SAFETY: j0 + kk < KB; rows.k(j) holds D elements (the caller).
            unsafe {
                *kv = E::load16(rows.k(j0 + kk).add(d * E::BYTES));
                if E::SCALED && !sh.whole_rows {
                    for (half, &blk) in kv.iter_mut().zip(&blks) {
                        let s = _mm256_broadcast_ss(&*rows.ks(j0 + kk).add(blk));
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
        // A counted loop, as in the f16 P·V (an iterator adaptor left the
        // accumulators in memory in some builds).
        #[allow(clippy::needless_range_loop, reason = "a counted loop keeps the accumulators in registers")]
        for j in 0..n {
            let (v_row, v_scales) = (rows.v(j), rows.vs(j));
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

    /// The online softmax of one row tile over one block, row by row on
    /// 256-bit vectors ([`Width::softmax`]'s contract).
    ///
    /// # Safety
    /// As [`Width::softmax`]'s.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn softmax_ymm<const R: usize>(
        s: &mut [[f32; KB]; R],
        state: *mut f32,
        (n, pos0): (usize, i64),
        v_scales: Option<&[f32; KB]>,
    ) -> [f32; R] {
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
            if let Some(v_scales) = v_scales {
                // P·V multiplies P[j] by V_j's scale in place of every
                // widened vector of V_j (`l` summed the unscaled P).
                for (p, scale) in row.chunks_exact_mut(8).zip(v_scales.chunks_exact(8)) {
                    // SAFETY: 8 f32 of the row and of the scales.
                    unsafe {
                        let scaled = _mm256_mul_ps(_mm256_loadu_ps(p.as_ptr()), _mm256_loadu_ps(scale.as_ptr()));
                        _mm256_storeu_ps(p.as_mut_ptr(), scaled);
                    }
                }
            }
        }
        alpha
    }

    /// [`softmax_ymm`] on 512-bit vectors: a row's block is two vectors,
    /// its keys a mask register, its max and sum one reduction each.
    ///
    /// # Safety
    /// As [`Width::softmax`]'s; AVX-512F.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn softmax_zmm<const R: usize>(
        s: &mut [[f32; KB]; R],
        state: *mut f32,
        (n, pos0): (usize, i64),
        v_scales: Option<&[f32; KB]>,
    ) -> [f32; R] {
        const { assert!(KB == 32, "a block is two 512-bit vectors of scores") };
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        // Each row's masked scores and its new max.
        let mut x = [[ninf; 2]; R];
        let (mut m_old, mut m_use) = ([0f32; 16], [0f32; 16]);
        for (r, row) in s.iter().enumerate() {
            // SAFETY: the tile's lo and hi words (state holds a whole tile).
            let (lo, hi) = unsafe {
                let words = state.cast::<i32>();
                (i64::from(*words.add(STATE_LO + r)), i64::from(*words.add(STATE_HI + r)))
            };
            let from = (lo - pos0).clamp(0, n as i64) as u32;
            let to = (hi - pos0).clamp(i64::from(from), n as i64) as u32;
            // Keys [from, to) of the block, bit j for key j (to ≤ 32).
            let keys = ((1u64 << to) - 1) & !((1u64 << from) - 1);
            let at = row.as_ptr();
            // SAFETY: the row's 32 f32; masked lanes read nothing.
            x[r] = unsafe {
                [
                    _mm512_mask_loadu_ps(ninf, keys as __mmask16, at),
                    _mm512_mask_loadu_ps(ninf, (keys >> 16) as __mmask16, at.add(16)),
                ]
            };
            let [x0, x1] = x[r];
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x0, x0) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x1, x1);
            let block_max = if nan != 0 { f32::NAN } else { _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)) };
            // SAFETY: the tile's m lane (state holds a whole tile).
            m_old[r] = unsafe { *state.add(r) };
            // NaN-propagating max (f32::max drops a NaN).
            let m_new = if m_old[r].is_nan() || block_max.is_nan() { f32::NAN } else { m_old[r].max(block_max) };
            m_use[r] = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
            // SAFETY: as above.
            unsafe { *state.add(r) = m_new };
        }
        // Every row's α = e^(m_old − m_use) in one vector.
        // SAFETY: both hold 16 f32.
        let alpha_v = unsafe { exp16(_mm512_sub_ps(_mm512_loadu_ps(m_old.as_ptr()), _mm512_loadu_ps(m_use.as_ptr()))) };
        let mut alpha_lanes = [0f32; 16];
        // SAFETY: alpha_lanes holds 16 f32.
        unsafe { _mm512_storeu_ps(alpha_lanes.as_mut_ptr(), alpha_v) };
        for (r, row) in s.iter_mut().enumerate() {
            let m_v = _mm512_set1_ps(m_use[r]);
            let mut p = x[r].map(|x| exp16(_mm512_sub_ps(x, m_v)));
            let total = _mm512_reduce_add_ps(_mm512_add_ps(p[0], p[1]));
            // SAFETY: the tile's l lane (state holds a whole tile).
            unsafe {
                let l_at = state.add(4 + r);
                *l_at = alpha_lanes[r] * *l_at + total;
            }
            if let Some(v_scales) = v_scales {
                for (i, p) in p.iter_mut().enumerate() {
                    // SAFETY: 16 f32 of the scales.
                    *p = _mm512_mul_ps(*p, unsafe { _mm512_loadu_ps(v_scales.as_ptr().add(16 * i)) });
                }
            }
            let at = row.as_mut_ptr();
            // SAFETY: the row's 32 f32.
            unsafe {
                _mm512_storeu_ps(at, p[0]);
                _mm512_storeu_ps(at.add(16), p[1]);
            }
        }
        std::array::from_fn(|r| alpha_lanes[r])
    }

    /// [`exp8`] on 512-bit vectors: the same polynomial, lane for lane
    /// the same results.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn exp16(x: __m512) -> __m512 {
        let x = _mm512_min_ps(_mm512_set1_ps(88.376_26), x);
        let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(-87.336_54));
        let fx = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let y = exp_polynomial!(x, fx, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, _mm512_add_ps);
        let n = _mm512_cvtps_epi32(fx);
        let pow2n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127))));
        _mm512_maskz_mul_ps(kept, y, pow2n)
    }

    /// One row tile (R rows, state tile at `state`) over one block.
    ///
    /// # Safety
    /// As [`decode`]'s, for this tile's q rows and state.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_block<W: Width, E: Elem, const R: usize, const KN: usize, const SV: usize>(
        q: *const f32,
        state: *mut f32,
        (rows, n, pos0): (&Rows, usize, i64),
        sh: Shape,
        ahead: &mut Ahead,
    ) {
        let mut s = [[f32::NEG_INFINITY; KB]; R];
        // SAFETY: the caller's bounds on q and the rows.
        unsafe { W::scores::<E, R, KN>(q, rows, n, sh, &mut s, ahead) };
        // The block's V scales (FP8, one per row), read once for the R rows;
        // keys past n scale a probability of 0.
        let mut v_scales = [0f32; KB];
        if E::SCALED && sh.whole_rows {
            for (j, scale) in v_scales.iter_mut().enumerate().take(n) {
                // SAFETY: the key's V scale row (one scale: g = D).
                *scale = unsafe { *rows.vs(j) } * E4M3_UNIT;
            }
        }
        let scaled = (E::SCALED && sh.whole_rows).then_some(&v_scales);
        // SAFETY: state holds a whole tile (the caller's).
        let alpha = unsafe { W::softmax::<R>(&mut s, state, (n, pos0), scaled) };
        // SAFETY: acc of the tile: R rows of D f32; the block's V rows.
        unsafe { W::pv::<E, R, SV>(state.add(STATE_ACC), rows, n, sh, (&s, alpha), ahead) };
    }

    /// The vector width of a call's inner loops (the scores and P·V of one
    /// row tile over one block); the online softmax between them is the
    /// same for both.
    trait Width {
        /// Rewrite a call's q tiles (4 rows of `head_size` f32 each, in the
        /// element type's order) as this width's scores read them; as they
        /// are, unless the width says otherwise ([`half::Half`]).
        fn prepare_q(_q: &mut [f32], _head_size: usize) {}

        /// The online softmax of one row tile over one block: each row's
        /// scores `s[r]` outside its keys (the tile's lo/hi against the
        /// block's first position `pos0`, and from `n` on) masked, its
        /// running max `m` and sum `l` updated in the tile, `s[r]` turned
        /// into the block's probabilities (times `v_scales`: FP8 with g =
        /// D; `l` sums the unscaled ones). Returns each row's rescale α of
        /// its `acc`.
        ///
        /// # Safety
        /// `state` holds a whole tile; the width's CPU features.
        unsafe fn softmax<const R: usize>(
            s: &mut [[f32; KB]; R],
            state: *mut f32,
            block: (usize, i64),
            v_scales: Option<&[f32; KB]>,
        ) -> [f32; R];

        /// [`scores`]'s contract.
        ///
        /// # Safety
        /// As [`scores`]'s (and the width's CPU features).
        unsafe fn scores<E: Elem, const R: usize, const KN: usize>(
            q: *const f32,
            rows: &Rows,
            n: usize,
            sh: Shape,
            out: &mut [[f32; KB]; R],
            ahead: &mut Ahead,
        );

        /// `acc[r][..D] = α_r·acc[r][..D] + Σ_{j<n} p[r][j]·V_j` for the R
        /// rows of one state tile (`SV`: the 256-bit width's vectors per
        /// slice of D); the 512-bit width prefetches `ahead`'s V stream
        /// along the way.
        ///
        /// # Safety
        /// As [`pv_slice`]'s for all of D (and the width's CPU features).
        unsafe fn pv<E: Elem, const R: usize, const SV: usize>(
            acc: *mut f32,
            rows: &Rows,
            n: usize,
            sh: Shape,
            p: (&[[f32; KB]; R], [f32; R]),
            ahead: &mut Ahead,
        );
    }

    /// 256-bit vectors: AVX2 + FMA + F16C.
    pub(super) struct Ymm;

    impl Width for Ymm {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn softmax<const R: usize>(
            s: &mut [[f32; KB]; R],
            state: *mut f32,
            block: (usize, i64),
            v_scales: Option<&[f32; KB]>,
        ) -> [f32; R] {
            // SAFETY: the caller's.
            unsafe { softmax_ymm::<R>(s, state, block, v_scales) }
        }

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
            // SAFETY: the caller's.
            unsafe { scores::<E, R, KN>(q, rows, n, sh, out, ahead) }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn pv<E: Elem, const R: usize, const SV: usize>(
            acc: *mut f32,
            rows: &Rows,
            n: usize,
            sh: Shape,
            (s, alpha): (&[[f32; KB]; R], [f32; R]),
            _ahead: &mut Ahead,
        ) {
            let slice = 8 * SV;
            let mut d0 = 0;
            while d0 + slice <= sh.d {
                // SAFETY: d0 + 8·SV ≤ D.
                unsafe { pv_slice::<E, R, SV>(acc, d0, rows, n, sh, (s, alpha)) };
                d0 += slice;
            }
            while d0 < sh.d {
                if E::PAIRED {
                    // SAFETY: D is a multiple of 16 (PAIRED), d0 of 16.
                    unsafe { pv_slice::<E, R, 2>(acc, d0, rows, n, sh, (s, alpha)) };
                    d0 += 16;
                } else {
                    // SAFETY: D is a multiple of 8.
                    unsafe { pv_slice::<E, R, 1>(acc, d0, rows, n, sh, (s, alpha)) };
                    d0 += 8;
                }
            }
        }
    }

    /// 512-bit vectors (AVX-512F, BW and VBMI) for the FMAs and the
    /// widening, 16 elements of D a vector: half the instructions of
    /// [`Ymm`] for the same products. Serves D a multiple of 16 and, FP8
    /// with g < D, g a multiple of 16 ([`super::zmm_serves`]). Its scores,
    /// softmax and P·V are real calls from the 256-bit driver (a
    /// target-feature boundary), one each per row tile and block of 32 keys.
    pub(super) struct Zmm;

    impl Width for Zmm {
        #[inline]
        unsafe fn softmax<const R: usize>(
            s: &mut [[f32; KB]; R],
            state: *mut f32,
            block: (usize, i64),
            v_scales: Option<&[f32; KB]>,
        ) -> [f32; R] {
            // SAFETY: the caller's; AVX-512F (the caller picked this width).
            unsafe { softmax_zmm::<R>(s, state, block, v_scales) }
        }

        #[inline]
        unsafe fn scores<E: Elem, const R: usize, const KN: usize>(
            q: *const f32,
            rows: &Rows,
            n: usize,
            sh: Shape,
            out: &mut [[f32; KB]; R],
            ahead: &mut Ahead,
        ) {
            // SAFETY: the caller's bounds; the caller picked this width on
            // a CPU with AVX-512F, BW and VBMI and a D (and g) it serves.
            unsafe { scores_zmm::<E, R, KN>(q, rows, n, sh, out, ahead) }
        }

        #[inline]
        unsafe fn pv<E: Elem, const R: usize, const SV: usize>(
            acc: *mut f32,
            rows: &Rows,
            n: usize,
            sh: Shape,
            p: (&[[f32; KB]; R], [f32; R]),
            ahead: &mut Ahead,
        ) {
            // SAFETY: as for `scores`. Slices of 64 elements (16 vector
            // accumulators for 4 rows), 128 for one or two rows.
            unsafe {
                match R {
                    1 | 2 => pv_zmm::<E, R, 8>(acc, rows, n, sh, p, ahead),
                    _ => pv_zmm::<E, R, 4>(acc, rows, n, sh, p, ahead),
                }
            }
        }
    }

    /// [`scores`] on 512-bit vectors: 16 elements of D a step.
    ///
    /// # Safety
    /// As [`scores`]'s, with D a multiple of 16 (and FP8 g < D a multiple
    /// of 16); AVX-512F, BW and VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
    unsafe fn scores_zmm<E: Elem, const R: usize, const KN: usize>(
        q: *const f32,
        rows: &Rows,
        n: usize,
        sh: Shape,
        out: &mut [[f32; KB]; R],
        ahead: &mut Ahead,
    ) {
        // Keys per pass: two score groups of KN where the registers allow
        // (R·2KN accumulators and 2KN widened K vectors of 32), so each q
        // vector loaded feeds 2KN FMAs; one group for R = 1 (KN = 8).
        let groups = if R == 1 { 1 } else { 2 };
        let keys = KN * groups;
        let per_pass = ahead.per_visit(KB / keys);
        let mut j0 = 0;
        while j0 < n {
            ahead.step(false, per_pass);
            let mut acc = [[_mm512_setzero_ps(); 8]; R];
            // The scale block of d (FP8 with g < D), without a division per step.
            let (mut blk, mut blk_end) = (0, sh.g);
            let blocked = E::SCALED && !sh.whole_rows;
            let mut d = 0;
            while d < sh.d {
                while blocked && d >= blk_end {
                    blk += 1;
                    blk_end += sh.g;
                }
                if E::GRANULE == 64 {
                    // 64 elements of d a step (D a multiple of 64; one
                    // scale per row): q, in the type's order, read by the
                    // FMAs from memory (its registers would spill).
                    for kk in 0..keys {
                        // SAFETY: j0 + kk < KB; rows.k(j) holds D elements,
                        // d + 64 ≤ D.
                        let k = unsafe { E::widen64(rows.k(j0 + kk).add(d * E::BYTES)) };
                        for (r, row) in acc.iter_mut().enumerate() {
                            for (i, kv) in k.iter().enumerate() {
                                // SAFETY: q holds R rows of D f32, d + 64 ≤ D.
                                let qv = unsafe { _mm512_loadu_ps(q.add(r * sh.d + d + 16 * i)) };
                                row[kk] = _mm512_fmadd_ps(qv, *kv, row[kk]);
                            }
                        }
                    }
                    d += 64;
                    continue;
                }
                if d + 32 <= sh.d {
                    // 32 elements of d a step: the R rows' q in registers,
                    // each key's 32 widened at once ([`Elem::widen32`]).
                    // SAFETY: q holds R rows of D f32, d + 32 ≤ D.
                    let qv: [[__m512; 2]; R] = std::array::from_fn(|r| unsafe {
                        let at = q.add(r * sh.d + d);
                        [_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16))]
                    });
                    // The second half's scale block (g a multiple of 16).
                    let blk_high = if blocked && d + 16 >= blk_end { blk + 1 } else { blk };
                    for kk in 0..keys {
                        // SAFETY: j0 + kk < KB; rows.k(j) holds D elements,
                        // d + 32 ≤ D (and, FP8, its D/g scales).
                        let [mut low, mut high] = unsafe { E::widen32(rows.k(j0 + kk).add(d * E::BYTES)) };
                        if blocked {
                            // SAFETY: as above.
                            unsafe {
                                let scales = rows.ks(j0 + kk);
                                low = _mm512_mul_ps(low, _mm512_set1_ps(*scales.add(blk) * E4M3_UNIT));
                                high = _mm512_mul_ps(high, _mm512_set1_ps(*scales.add(blk_high) * E4M3_UNIT));
                            }
                        }
                        for (row, [q_low, q_high]) in acc.iter_mut().zip(&qv) {
                            row[kk] = _mm512_fmadd_ps(*q_high, high, _mm512_fmadd_ps(*q_low, low, row[kk]));
                        }
                    }
                    d += 32;
                    continue;
                }
                let mut k = [_mm512_setzero_ps(); 8];
                for (kk, kv) in k.iter_mut().enumerate().take(keys) {
                    // SAFETY: j0 + kk < KB (KB a multiple of 2KN); rows.k(j)
                    // holds D elements, d + 16 ≤ D.
                    unsafe {
                        *kv = E::widen16(rows.k(j0 + kk).add(d * E::BYTES));
                        if blocked {
                            *kv = _mm512_mul_ps(*kv, _mm512_set1_ps(*rows.ks(j0 + kk).add(blk) * E4M3_UNIT));
                        }
                    }
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: q holds R rows of D f32.
                    let qv = unsafe { _mm512_loadu_ps(q.add(r * sh.d + d)) };
                    for (a, kv) in row.iter_mut().zip(&k).take(keys) {
                        *a = _mm512_fmadd_ps(qv, *kv, *a);
                    }
                }
                d += 16;
            }
            // R·keys ≤ 16 sums (lane r·keys + kk: row r, key j0 + kk).
            let mut flat = [_mm512_setzero_ps(); 16];
            for (r, row) in acc.iter().enumerate() {
                flat[r * keys..(r + 1) * keys].copy_from_slice(&row[..keys]);
            }
            let mut sums = reduce16(flat);
            if E::SCALED && sh.whole_rows {
                // Lane r·keys + kk times key j0 + kk's K scale (one per row:
                // g = D), all rows in one multiply.
                // SAFETY: the keys' K scale rows (the caller's).
                let scale: [f32; 16] = std::array::from_fn(|lane| unsafe { *rows.ks(j0 + lane % keys) } * E4M3_UNIT);
                // SAFETY: scale holds 16 f32.
                sums = _mm512_mul_ps(sums, unsafe { _mm512_loadu_ps(scale.as_ptr()) });
            }
            let mut lanes = [0f32; 16];
            // SAFETY: lanes holds 16 f32.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
            for (r, row) in out.iter_mut().enumerate() {
                row[j0..j0 + keys].copy_from_slice(&lanes[r * keys..(r + 1) * keys]);
            }
            j0 += keys;
        }
    }

    /// The 16 horizontal sums of `v[0..16]` as the lanes of one vector
    /// (lane i: the sum of `v[i]`), by a transpose-and-add tree: 45
    /// instructions for 16 sums.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn reduce16(v: [__m512; 16]) -> __m512 {
        // Pairs interleaved within each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3].
        let w: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
        });
        // Each 128-bit lane: one quarter's sums of four vectors, in order.
        let u: [__m512; 4] = std::array::from_fn(|i| {
            let (x, y) = (w[2 * i], w[2 * i + 1]);
            _mm512_add_ps(_mm512_shuffle_ps::<0x44>(x, y), _mm512_shuffle_ps::<0xEE>(x, y))
        });
        // Quarters 0+2 and 1+3 of two such vectors.
        let z: [__m512; 2] = std::array::from_fn(|i| {
            let (x, y) = (u[2 * i], u[2 * i + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y))
        });
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(z[0], z[1]), _mm512_shuffle_f32x4::<0xDD>(z[0], z[1]))
    }

    /// [`Width::pv`] on 512-bit vectors: slices of `16·SV` elements of D,
    /// then single vectors.
    ///
    /// # Safety
    /// As [`pv_slice`]'s for all of D, D a multiple of 16 (and FP8 g < D a
    /// multiple of 16); AVX-512F, BW and VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
    unsafe fn pv_zmm<E: Elem, const R: usize, const SV: usize>(
        acc: *mut f32,
        rows: &Rows,
        n: usize,
        sh: Shape,
        p: (&[[f32; KB]; R], [f32; R]),
        ahead: &mut Ahead,
    ) {
        // The V stream, a share at each key of each slice (the whole
        // slices and the tail's).
        let slices = sh.d / (16 * SV) + sh.d % (16 * SV) / E::GRANULE;
        let per_key = ahead.per_visit(n * slices);
        let mut d0 = 0;
        while d0 + 16 * SV <= sh.d {
            // SAFETY: d0 + 16·SV ≤ D.
            unsafe { pv_slice_zmm::<E, R, SV>(acc, d0, rows, n, sh, p, (ahead, per_key)) };
            d0 += 16 * SV;
        }
        while d0 < sh.d {
            // SAFETY: D and d0 multiples of 16 (of the type's GRANULE).
            unsafe {
                match E::GRANULE {
                    64 => pv_slice_zmm::<E, R, 4>(acc, d0, rows, n, sh, p, (ahead, per_key)),
                    32 => pv_slice_zmm::<E, R, 2>(acc, d0, rows, n, sh, p, (ahead, per_key)),
                    _ => pv_slice_zmm::<E, R, 1>(acc, d0, rows, n, sh, p, (ahead, per_key)),
                }
            }
            d0 += E::GRANULE;
        }
    }

    /// [`pv_slice`] on 512-bit vectors: `acc[r][d0 .. d0 + 16·SV]`.
    ///
    /// # Safety
    /// As [`pv_slice`]'s with `d0 + 16·SV ≤ D`; AVX-512F, BW and VBMI.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
    unsafe fn pv_slice_zmm<E: Elem, const R: usize, const SV: usize>(
        acc: *mut f32,
        d0: usize,
        rows: &Rows,
        n: usize,
        sh: Shape,
        (p, alpha): (&[[f32; KB]; R], [f32; R]),
        (ahead, per_key): (&mut Ahead, usize),
    ) {
        let mut a = [[_mm512_setzero_ps(); SV]; R];
        for (r, row) in a.iter_mut().enumerate() {
            let al = _mm512_set1_ps(alpha[r]);
            for (i, x) in row.iter_mut().enumerate() {
                // SAFETY: row r of acc, d0 + 16i + 16 ≤ D.
                *x = _mm512_mul_ps(al, unsafe { _mm512_loadu_ps(acc.add(r * sh.d + d0 + 16 * i)) });
            }
        }
        // Each vector's scale block (FP8 with g < D; g a multiple of 16).
        let blk: [usize; SV] = std::array::from_fn(|i| (d0 + 16 * i) / sh.g);
        // A counted loop, as in the f16 P·V (an iterator adaptor left the
        // accumulators in memory in some builds).
        #[allow(clippy::needless_range_loop, reason = "a counted loop keeps the accumulators in registers")]
        for j in 0..n {
            let (v_row, v_scales) = (rows.v(j), rows.vs(j));
            ahead.step(true, per_key);
            let mut v = [_mm512_setzero_ps(); SV];
            // Fours (a GRANULE of 64: SV a multiple of 4) or pairs of
            // vectors widened at once ([`Elem::widen64`], [`Elem::widen32`];
            // SV even for a GRANULE of 32), an odd last one alone.
            let step = if E::GRANULE == 64 { 4 } else { 2 };
            for i in (0..SV).step_by(step) {
                // SAFETY: j < n ≤ KB; the row holds D elements, d0 + 16·SV ≤ D.
                unsafe {
                    let at = v_row.add((d0 + 16 * i) * E::BYTES);
                    if E::GRANULE == 64 {
                        [v[i], v[i + 1], v[i + 2], v[i + 3]] = E::widen64(at);
                    } else if i + 1 < SV {
                        [v[i], v[i + 1]] = E::widen32(at);
                    } else {
                        v[i] = E::widen16(at);
                    }
                }
            }
            if E::SCALED && !sh.whole_rows {
                for (x, &blk) in v.iter_mut().zip(&blk) {
                    // SAFETY: the row's D/g scales.
                    *x = _mm512_mul_ps(*x, _mm512_set1_ps(unsafe { *v_scales.add(blk) } * E4M3_UNIT));
                }
            }
            for (r, row) in a.iter_mut().enumerate() {
                let pb = _mm512_set1_ps(p[r][j]);
                for (x, vv) in row.iter_mut().zip(&v) {
                    *x = _mm512_fmadd_ps(pb, *vv, *x);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (i, x) in row.iter().enumerate() {
                // SAFETY: as the loads above.
                unsafe { _mm512_storeu_ps(acc.add(r * sh.d + d0 + 16 * i), *x) };
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
    /// f32 inside `scales`; `key_offsets` readable for `keys + ahead`
    /// entries (those past `keys` only prefetched); q holds
    /// `heads·ceil(rows / 4)·4` rows of `head_size` f32 and `state` `heads·ceil(rows / 4)` tiles of
    /// `tile_floats ≥ 16 + 4·head_size` f32; head_size a multiple of 8,
    /// granularity (FP8) a multiple of 8 dividing it; AVX2, FMA, F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe extern "C" fn decode<W: Width, E: Elem, const R: usize, const KN: usize, const SV: usize>(
        q: *const f32,
        blocks: *const u8,
        key_offsets: *const i64,
        keys: usize,
        ahead: usize,
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
                E::permute(&mut copy, false);
                W::prepare_q(&mut copy, head_size);
                permuted_q = copy;
                permuted_q.as_ptr()
            }
        };
        // Element offset of key j's K row of head 0 (relative to the call).
        // SAFETY: j < keys + ahead (the caller's table).
        let offset = |j: usize| unsafe { *key_offsets.add(j) } as usize;
        let slot_bytes = heads * head_size * E::BYTES;
        let v_offset = sh.kv_stride * E::BYTES;
        // An FP8 key's K and V scales (every head's: contiguous f32): the
        // scales of head h's rows are h·D/g on from its key's, the V rows'
        // kv_stride/g on from the K rows' (offsets are multiples of g).
        let head_scales = head_size / sh.g;
        let v_scales = sh.kv_stride / sh.g;
        let mut rows_of = Rows {
            k0: [std::ptr::null(); KB],
            ks0: [std::ptr::null(); KB],
            head: 0,
            head_scales: 0,
            v_offset,
            v_scales,
        };
        // The slots of the first block (then of each next block): key j's
        // K row of head 0.
        let mut next_slots = [std::ptr::null::<u8>(); KB];
        let first_keys = keys.min(KB);
        for (j, slot) in next_slots.iter_mut().enumerate().take(first_keys) {
            *slot = blocks.wrapping_add(offset(j) * E::BYTES);
        }
        // The first block's slots, all at once (the loops prefetch the
        // next block's, a share per head).
        let mut first = Ahead::new(&next_slots[..first_keys], 0, slot_bytes, v_offset);
        let lines = first.lines();
        first.step(false, lines);
        first.step(true, lines);
        let scale_bytes = heads * head_scales * 4;
        let prefetch_scales = |o: usize| {
            if E::SCALED {
                let at = o / sh.g;
                for at in [at, at + v_scales] {
                    prefetch(scales.wrapping_add(at).cast(), scale_bytes);
                }
            }
        };
        for j in 0..first_keys {
            prefetch_scales(offset(j));
        }
        let permute_acc = |back: bool| {
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
                    E::permute(acc, back);
                }
            }
        };
        permute_acc(false);
        // Each head's call prefetches the next block's rows of its own
        // head (the rows the next block's call for that head reads first)
        // for 1- and 2-byte elements; for f32, a share of the next block's
        // whole slots in address order. Measured with `decode_kernel_stream`
        // (one thread from DRAM, seven alternated runs, ns per key-head):
        // Llama-3-8B's bf16 heads 51.0–52.9 → 45.5–47.5 head-major, f32
        // 80–85 → 86–91 (so f32 keeps whole slots), FP8 39.1–39.6 →
        // 39.7–41.1; SmolLM2's bf16 27.2–28.6 → 26.6–27.0, FP8 25.7–26.1 →
        // 24.8–25.0.
        let head_major = E::BYTES <= 2;
        let share = KB.div_ceil(heads);
        let mut p0 = 0;
        while p0 < keys {
            let n = (keys - p0).min(KB);
            // The next block's keys to prefetch: this call's next block or,
            // from its last block on, the caller's next keys (`ahead`).
            let next_from = (p0 + KB).min(keys);
            let next_n = (keys + ahead - next_from).min(KB);
            for (j, (k, ks)) in rows_of.k0.iter_mut().zip(&mut rows_of.ks0).enumerate() {
                let o = offset(p0 + j.min(n - 1));
                // Rows of the cache (the caller's contract); pointers only.
                *k = blocks.wrapping_add(o * E::BYTES);
                if E::SCALED {
                    *ks = scales.wrapping_add(o / sh.g);
                }
            }
            // The next block's slots, for every head's share of them.
            for (j, slot) in next_slots.iter_mut().enumerate().take(next_n) {
                let o = offset(next_from + j);
                *slot = blocks.wrapping_add(o * E::BYTES);
                if head_major {
                    prefetch_scales(o);
                }
            }
            for h in 0..heads {
                rows_of.head = h * head_size * E::BYTES;
                rows_of.head_scales = h * head_scales;
                // What this head prefetches of the next block: its own
                // rows (head-major) or a share of the whole slots.
                let mut ahead = if head_major {
                    Ahead::new(&next_slots[..next_n], rows_of.head, head_size * E::BYTES, v_offset)
                } else {
                    let (from, to) = ((h * share).min(next_n), ((h + 1) * share).min(next_n));
                    for j in from..to {
                        prefetch_scales(offset(next_from + j));
                    }
                    Ahead::new(&next_slots[from..to], 0, slot_bytes, v_offset)
                };
                for t in 0..tiles {
                    let tile = h * head_tiles + t;
                    // SAFETY: tile < heads·ceil(rows/4): its q rows and state
                    // are the caller's; the block's rows are rows of the
                    // cache (the contract).
                    unsafe {
                        tile_block::<W, E, R, KN, SV>(
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
        permute_acc(true);
    }

    /// The kernel for `rows` query rows per KV head: a tile of exactly
    /// that many up to 3 (a GQA group of 3, SmolLM2's, measured 8–12 %
    /// faster at context 2048 than a 4-row tile with a padded row), 4-row
    /// tiles beyond.
    fn for_rows<W: Width, E: Elem>(rows: usize) -> DecodeKernel {
        match rows {
            1 => decode::<W, E, 1, 8, 8>,
            2 => decode::<W, E, 2, 4, 4>,
            3 => decode::<W, E, 3, 2, 2>,
            _ => decode::<W, E, 4, 2, 2>,
        }
    }

    /// The 256-bit kernel for the cache's element type.
    pub(super) fn kernel(cache: DType, rows: usize, head_size: usize) -> Option<DecodeKernel> {
        Some(match cache {
            DType::F32 => for_rows::<Ymm, F32>(rows),
            DType::BF16 if head_size.is_multiple_of(16) => for_rows::<Ymm, Bf16Pairs>(rows),
            DType::BF16 => for_rows::<Ymm, Bf16>(rows),
            DType::F16 => for_rows::<Ymm, F16>(rows),
            DType::F8E4M3 if head_size.is_multiple_of(16) => for_rows::<Ymm, E4m3Pairs>(rows),
            DType::F8E4M3 => for_rows::<Ymm, E4m3>(rows),
            _ => return None,
        })
    }

    /// The 512-bit kernel for the cache's element type (the caller checked
    /// [`super::zmm_serves`]): elements in their order, except where
    /// [`reordered`] picks bf16's even/odd split ([`Bf16EvenOdd`]) and
    /// FP8's byte tables ([`E4m3Lut`]).
    pub(super) fn kernel_zmm(
        cache: DType,
        rows: usize,
        head_size: usize,
        granularity: Option<usize>,
    ) -> Option<DecodeKernel> {
        Some(match cache {
            DType::F32 => for_rows::<Zmm, F32>(rows),
            DType::BF16 if reordered() && head_size.is_multiple_of(32) => for_rows::<Zmm, Bf16EvenOdd>(rows),
            DType::BF16 => for_rows::<Zmm, Bf16>(rows),
            DType::F16 => for_rows::<Zmm, F16>(rows),
            DType::F8E4M3 if reordered() && granularity == Some(head_size) && head_size.is_multiple_of(64) => {
                for_rows::<Zmm, E4m3Lut>(rows)
            }
            DType::F8E4M3 => for_rows::<Zmm, E4m3>(rows),
            _ => return None,
        })
    }

    /// The f16-product kernel (the caller checked [`super::half_serves`]).
    pub(super) fn kernel_half(rows: usize) -> DecodeKernel {
        for_rows::<half::Half, half::E4m3Half>(rows)
    }

    /// Whether the [`Zmm`] width widens in a lane order of its own where
    /// that takes fewer instructions ([`Bf16EvenOdd`], D a multiple of 32;
    /// [`E4m3Lut`], g = D a multiple of 64): unless
    /// `KVJIT_ATTENTION_REORDERED` is `off` (read once: to time them against
    /// the natural-order widenings).
    fn reordered() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("KVJIT_ATTENTION_REORDERED").map_or(true, |v| v != "off"))
    }

    #[cfg(test)]
    pub(super) fn widen_e4m3(codes: &[u8; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: 8 readable bytes; the test checked avx2_available().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), E4m3::load8(codes.as_ptr())) };
        out
    }

    /// The 64 codes widened by [`E4m3Lut`], in their natural order; `None`
    /// where the 512-bit width is not available.
    #[cfg(test)]
    pub(super) fn widen_e4m3_tables(codes: &[u8; 64]) -> Option<[f32; 64]> {
        if !super::avx512_available() {
            return None;
        }
        let mut out = [0f32; 64];
        // SAFETY: 64 readable codes, 64 writable f32; AVX-512F, BW and VBMI
        // checked above.
        unsafe {
            for (i, v) in E4m3Lut::widen64(codes.as_ptr()).into_iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), v);
            }
        }
        transpose_quads64(&mut out);
        Some(out)
    }

    #[cfg(test)]
    pub(super) fn exp_lanes(x: [f32; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: 8 f32 each; the test checked avx2_available().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp8(_mm256_loadu_ps(x.as_ptr()))) };
        out
    }

    /// [`exp16`] of 16 values; `None` where the 512-bit width is not
    /// available.
    #[cfg(test)]
    pub(super) fn exp_lanes16(x: [f32; 16]) -> Option<[f32; 16]> {
        if !super::avx512_available() {
            return None;
        }
        let mut out = [0f32; 16];
        // SAFETY: 16 f32 each; AVX-512F checked above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp16(_mm512_loadu_ps(x.as_ptr()))) };
        Some(out)
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
    fn e4m3_tables_widen_exactly() {
        for first in (0..256).step_by(64) {
            let codes: [u8; 64] = std::array::from_fn(|i| (first + i) as u8);
            let Some(got) = x86::widen_e4m3_tables(&codes) else {
                eprintln!("skipped: this CPU has no AVX-512 VBMI");
                return;
            };
            for (code, value) in codes.iter().zip(got) {
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

    /// The 512-bit exp gives the 256-bit one's bits in every lane, the
    /// special values included.
    #[test]
    fn exp_widths_agree_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(11);
        for round in 0..2000 {
            let mut xs: [f32; 16] = std::array::from_fn(|_| rng.gen_range(-95.0f32..90.0));
            if round == 0 {
                xs[..8].copy_from_slice(&[f32::NEG_INFINITY, -100.0, f32::NAN, 0.0, -0.0, 1.0, -1e-8, 88.5]);
            }
            let Some(wide) = x86::exp_lanes16(xs) else {
                eprintln!("skipped: this CPU has no AVX-512F/BW/VBMI");
                return;
            };
            for half in 0..2 {
                let narrow = x86::exp_lanes(std::array::from_fn(|i| xs[8 * half + i]));
                for (i, want) in narrow.iter().enumerate() {
                    let got = wide[8 * half + i];
                    assert_eq!(got.to_bits(), want.to_bits(), "exp({}) = {got}, want {want}", xs[8 * half + i]);
                }
            }
        }
    }

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// KV heads and slots per page of [`Call`]'s cache.
    const HEADS: usize = 2;
    const PAGE: usize = 7;
    /// Floats of poison after each state tile and after the whole state.
    const GUARD: usize = 5;
    /// Entries of [`Call`]'s offsets table past its keys (the caller's next
    /// keys, prefetched only).
    const AHEAD: usize = 19;

    /// One call of the decode kernel on a random paged cache `[pages, K|V,
    /// PAGE, HEADS·D]` with its pages shuffled, random q rows, random
    /// per-row key ranges and half the rows resuming a random partial
    /// state; the cache's values decoded to f32 (FP8 times its scales)
    /// for the reference.
    struct Call {
        d: usize,
        g: usize,
        rows: usize,
        keys: usize,
        first_key: i64,
        bytes: Vec<u8>,
        values: Vec<f32>,
        scales: Vec<f32>,
        offsets: Vec<i64>,
        q: Vec<f32>,
        state: Vec<f32>,
    }

    impl Call {
        fn tiles(&self) -> usize {
            self.rows.div_ceil(STATE_TILE_ROWS)
        }

        fn tile_floats(&self) -> usize {
            STATE_ACC + STATE_TILE_ROWS * self.d + GUARD
        }

        fn kv_stride(&self) -> usize {
            PAGE * HEADS * self.d
        }

        fn new(dtype: DType, d: usize, g: usize, rows: usize, keys: usize, seed: u64) -> Call {
            let mut rng = StdRng::seed_from_u64(seed);
            let pages = keys.div_ceil(PAGE) + 2;
            let elements = pages * 2 * PAGE * HEADS * d;
            let scales: Vec<f32> = (0..elements / g).map(|_| rng.gen_range(0.001..0.004)).collect();
            let mut bytes = Vec::new();
            let mut values = Vec::with_capacity(elements);
            for e in 0..elements {
                let v: f32 = rng.gen_range(-1.0..1.0);
                let decoded = match dtype {
                    DType::F32 => {
                        bytes.extend(v.to_le_bytes());
                        v
                    }
                    DType::BF16 => {
                        let h = half::bf16::from_f32(v);
                        bytes.extend(h.to_le_bytes());
                        h.to_f32()
                    }
                    DType::F16 => {
                        let h = half::f16::from_f32(v);
                        bytes.extend(h.to_le_bytes());
                        h.to_f32()
                    }
                    _ => {
                        let code = kvjit_core::fp8::e4m3_from_f32(v / scales[e / g] / 4.0);
                        bytes.push(code);
                        kvjit_core::fp8::e4m3_to_f32(code) * scales[e / g]
                    }
                };
                values.push(decoded);
            }
            let mut order: Vec<usize> = (0..pages).collect();
            for i in (1..pages).rev() {
                order.swap(i, rng.gen_range(0..=i));
            }
            let slot = HEADS * d;
            // The keys, then `AHEAD` entries the kernel may only prefetch:
            // offsets far outside the cache, which a load would fault on.
            let offsets = (0..keys)
                .map(|j| ((order[j / PAGE] * 2 * PAGE + j % PAGE) * slot) as i64)
                .chain((0..AHEAD as i64).map(|j| (1 << 46) + j * 977))
                .collect();
            let mut call = Call {
                d,
                g,
                rows,
                keys,
                first_key: 500,
                bytes,
                values,
                scales,
                offsets,
                q: Vec::new(),
                state: Vec::new(),
            };
            let padded = call.tiles() * STATE_TILE_ROWS;
            call.q = (0..HEADS * padded * d)
                .map(|i| if (i / d) % padded < rows { rng.gen_range(-1.0..1.0) } else { 0.0 })
                .collect();
            call.state = vec![f32::NAN; HEADS * call.tiles() * call.tile_floats() + GUARD];
            for h in 0..HEADS {
                for t in 0..call.tiles() {
                    let base = (h * call.tiles() + t) * call.tile_floats();
                    for lane in 0..STATE_TILE_ROWS {
                        let row = t * STATE_TILE_ROWS + lane;
                        let (lo, hi, resume) = match row < rows {
                            true => {
                                let lo = rng.gen_range(0..=keys / 3) as i64;
                                let hi = rng.gen_range(lo as usize..=keys) as i64;
                                (lo, hi, rng.gen_bool(0.5))
                            }
                            false => (0, 0, false),
                        };
                        let tile = &mut call.state[base..];
                        tile[STATE_LO + lane] = f32::from_bits((call.first_key + lo) as u32);
                        tile[STATE_HI + lane] = f32::from_bits((call.first_key + hi) as u32);
                        tile[lane] = if resume { rng.gen_range(-1.0..1.0) } else { f32::NEG_INFINITY };
                        tile[4 + lane] = if resume { rng.gen_range(0.5..2.0) } else { 0.0 };
                        for x in 0..d {
                            tile[STATE_ACC + lane * d + x] = if resume { rng.gen_range(-1.0..1.0) } else { 0.0 };
                        }
                    }
                }
            }
            call
        }

        /// The call with every FP8 code an integer in −3..=3 and every q
        /// element a quarter in −3/4..=3/4: each product q·(2⁻⁸·code) is a
        /// multiple of 2⁻¹⁰ and every partial sum of a score at most
        /// 9·D/4·2⁻⁸ < 2 (D ≤ 192), so f16 products and sums are exact and
        /// the scores of [`DecodeWidth::ZmmHalf`] are the f32 kernels'.
        fn dyadic(mut self, seed: u64) -> Call {
            assert!(self.d <= 192, "partial sums stay below 2");
            let mut rng = StdRng::seed_from_u64(seed);
            for (e, (byte, value)) in self.bytes.iter_mut().zip(&mut self.values).enumerate() {
                let v = rng.gen_range(-3..=3) as f32;
                *byte = kvjit_core::fp8::e4m3_from_f32(v);
                *value = v * self.scales[e / self.g];
            }
            let padded = self.tiles() * STATE_TILE_ROWS;
            for (i, x) in self.q.iter_mut().enumerate() {
                if (i / self.d) % padded < self.rows {
                    *x = rng.gen_range(-3..=3) as f32 / 4.0;
                }
            }
            self
        }

        /// Run `kernel` on a copy of the state and return it.
        fn run(&self, kernel: DecodeKernel) -> Vec<f32> {
            let mut state = self.state.clone();
            // SAFETY: every offset of the call's keys (the AHEAD past them
            // are only prefetched) is a K slot of a page of `bytes`, its V
            // slot kv_stride on in the same page, HEADS·D elements each;
            // scales cover every g elements; q and state are sized for
            // HEADS × tiles() tiles of tile_floats() ≥ 16 + 4·D; the
            // kernel exists, so this CPU has its features.
            unsafe {
                kernel(
                    self.q.as_ptr(),
                    self.bytes.as_ptr(),
                    self.offsets.as_ptr(),
                    self.keys,
                    AHEAD,
                    self.first_key,
                    HEADS,
                    self.scales.as_ptr(),
                    state.as_mut_ptr(),
                    self.rows,
                    self.d,
                    self.kv_stride(),
                    self.g,
                    self.tile_floats(),
                )
            };
            state
        }

        /// Query row `row` of head h before the call: its state tile (from
        /// the tile's start), lane, key range (call-relative) and q.
        fn row(&self, h: usize, row: usize) -> (&[f32], usize, (usize, usize), &[f32]) {
            let tile = &self.state[(h * self.tiles() + row / 4) * self.tile_floats()..];
            let lane = row % 4;
            let key = |word: usize| (tile[word + lane].to_bits() as i64 - self.first_key) as usize;
            let q = &self.q[((h * self.tiles() * 4) + row) * self.d..][..self.d];
            (tile, lane, (key(STATE_LO), key(STATE_HI)), q)
        }

        /// The state after the call in f64 (`(m, l, acc)` per head and
        /// row), from the state before it: flash attention's update by
        /// each key of the row's range.
        fn reference(&self) -> Vec<(f64, f64, Vec<f64>)> {
            let mut out = Vec::new();
            for h in 0..HEADS {
                for row in 0..self.rows {
                    let (tile, lane, (lo, hi), q) = self.row(h, row);
                    let scores: Vec<f64> = (lo..hi)
                        .map(|j| {
                            let k = &self.values[self.offsets[j] as usize + h * self.d..][..self.d];
                            q.iter().zip(k).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
                        })
                        .collect();
                    let m0 = f64::from(tile[lane]);
                    let m = scores.iter().copied().fold(m0, f64::max);
                    let alpha = if m0 == f64::NEG_INFINITY { 0.0 } else { (m0 - m).exp() };
                    let mut l = alpha * f64::from(tile[4 + lane]);
                    let mut acc: Vec<f64> =
                        (0..self.d).map(|x| alpha * f64::from(tile[STATE_ACC + lane * self.d + x])).collect();
                    for (j, s) in (lo..hi).zip(&scores) {
                        let p = (s - m).exp();
                        l += p;
                        let v = &self.values[self.offsets[j] as usize + self.kv_stride() + h * self.d..][..self.d];
                        for (a, &x) in acc.iter_mut().zip(v) {
                            *a += p * f64::from(x);
                        }
                    }
                    out.push((m, l, acc));
                }
            }
            out
        }

        /// What f16 products ([`DecodeWidth::ZmmHalf`]) may add to each
        /// row's `m + ln l` and `acc / l` (per head and row), from the
        /// bound in the f16 kernel's docs: with u = 2⁻¹¹, a score is off by
        /// at most δ = (D/16 + 6)·u·Σ|q_i·k_i| plus 2⁻²⁵ at each of the
        /// 16·(D/16 + 5) roundings (f16 subnormals) in units of
        /// 2·max|q|·2⁸·s_K; a block's
        /// P·V by 34·u·Σ p_j·|v_j|. So `m + ln l` moves by at most δ, and
        /// `acc / l` — a weighted mean of the values and of the resumed
        /// `acc / l` whose weights move by e^{±δ} — by (e^{2δ} − 1)·W +
        /// 34·u·W, W the largest magnitude averaged.
        ///
        /// With `exact_scores` (a [`Call::dyadic`] call) only the P·V term.
        fn half_bounds(&self, exact_scores: bool) -> Vec<(f64, f64)> {
            let u = 2f64.powi(-11);
            let mut out = Vec::new();
            for h in 0..HEADS {
                for row in 0..self.rows {
                    let (tile, lane, (lo, hi), q) = self.row(h, row);
                    let q_max = q.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
                    let (mut score, mut w) = (0f64, 0f64);
                    for j in lo..hi {
                        let at = self.offsets[j] as usize + h * self.d;
                        let k = &self.values[at..][..self.d];
                        let k_scale = f64::from(self.scales[at / self.g]);
                        let sum: f64 = q.iter().zip(k).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
                        let subnormal = (self.d + 80) as f64 * 2f64.powi(-25) * 2.0 * q_max * 256.0 * k_scale;
                        if !exact_scores {
                            score = score.max((self.d as f64 / 16.0 + 6.0) * u * sum + subnormal);
                        }
                        let v = &self.values[at + self.kv_stride()..][..self.d];
                        w = v.iter().fold(w, |m, &x| m.max(f64::from(x).abs()));
                    }
                    if tile[lane] != f32::NEG_INFINITY {
                        let l0 = f64::from(tile[4 + lane]);
                        let acc0 = &tile[STATE_ACC + lane * self.d..][..self.d];
                        w = acc0.iter().fold(w, |m, &x| m.max(f64::from(x).abs() / l0));
                    }
                    out.push((score, ((2.0 * score).exp() - 1.0) * w + 34.0 * u * w));
                }
            }
            out
        }

        /// `got` (a run's state) against the reference: each row's
        /// `m + ln l` and `acc / l` (within `extra`'s bound per head and
        /// row more, for f16 products), the `lo`/`hi` and padded rows left
        /// alone, the guards still NaN.
        fn check(&self, got: &[f32], what: &str, extra: Option<&[(f64, f64)]>) {
            let want = self.reference();
            for h in 0..HEADS {
                for t in 0..self.tiles() {
                    let base = (h * self.tiles() + t) * self.tile_floats();
                    let before = &self.state[base..base + self.tile_floats()];
                    let after = &got[base..base + self.tile_floats()];
                    for lane in 0..STATE_TILE_ROWS {
                        let row = t * STATE_TILE_ROWS + lane;
                        for word in [STATE_LO + lane, STATE_HI + lane] {
                            assert_eq!(after[word].to_bits(), before[word].to_bits(), "{what}: lo/hi of row {row}");
                        }
                        if row >= self.rows {
                            continue;
                        }
                        let (m, l, acc) = &want[h * self.rows + row];
                        if *l == 0.0 {
                            assert_eq!(f64::from(after[4 + lane]), 0.0, "{what}: head {h} row {row} read no key");
                            continue;
                        }
                        let (gm, gl) = (f64::from(after[lane]), f64::from(after[4 + lane]));
                        let lse = gm + gl.ln();
                        let (score_extra, acc_extra) = extra.map_or((0.0, 0.0), |e| e[h * self.rows + row]);
                        assert!(
                            (lse - (m + l.ln())).abs() < 1e-4 + score_extra,
                            "{what}: head {h} row {row}: m + ln l {lse}"
                        );
                        for (x, a) in acc.iter().enumerate() {
                            let g = f64::from(after[STATE_ACC + lane * self.d + x]) / gl;
                            assert!(
                                (g - a / l).abs() < 2e-5 + 1e-4 * (a / l).abs() + acc_extra,
                                "{what}: head {h} row {row} acc[{x}]: {g} vs {}",
                                a / l
                            );
                        }
                    }
                    assert!(after[STATE_ACC + 4 * self.d..].iter().all(|x| x.is_nan()), "{what}: tile guard");
                }
            }
            assert!(got[got.len() - GUARD..].iter().all(|x| x.is_nan()), "{what}: state guard");
        }
    }

    /// Both widths of the decode kernel against the f64 reference on
    /// every cache type (FP8 with g = D and g-blocks of 8, 16 and 32),
    /// GQA groups 1–8, head sizes multiples of 16 and not (the 512-bit
    /// width refuses those), whole and partial key blocks, masked ranges
    /// and resumed states.
    #[test]
    fn decode_widths_match_the_reference() {
        if !avx2_available() {
            eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
            return;
        }
        let mut seed = 0;
        let (mut zmm_runs, mut half_runs) = (0, 0);
        for (dtype, d, g) in [
            (DType::F32, 64usize, None),
            (DType::F32, 40, None),
            (DType::BF16, 128, None),
            (DType::BF16, 48, None),
            (DType::BF16, 24, None),
            (DType::F16, 64, None),
            (DType::F8E4M3, 64, Some(64)),
            (DType::F8E4M3, 128, Some(128)),
            (DType::F8E4M3, 192, Some(192)),
            (DType::F8E4M3, 128, Some(32)),
            (DType::F8E4M3, 48, Some(16)),
            (DType::F8E4M3, 64, Some(8)),
            (DType::F8E4M3, 40, Some(40)),
        ] {
            if !d.is_multiple_of(16) || g == Some(8) {
                assert!(!zmm_serves(dtype, d, g), "{dtype} D {d} g {g:?}");
            }
            for rows in [1, 2, 3, 4, 5, 8] {
                for keys in [5, 32, 77] {
                    seed += 1;
                    let call = Call::new(dtype, d, g.unwrap_or(d), rows, keys, seed);
                    for width in [DecodeWidth::Ymm, DecodeWidth::Zmm, DecodeWidth::ZmmHalf] {
                        let served = match width {
                            DecodeWidth::Ymm => true,
                            DecodeWidth::Zmm => zmm_serves(dtype, d, g),
                            DecodeWidth::ZmmHalf => half_serves(dtype, d, g),
                        };
                        if !served {
                            continue;
                        }
                        zmm_runs += usize::from(width == DecodeWidth::Zmm);
                        half_runs += usize::from(width == DecodeWidth::ZmmHalf);
                        let kernel = decode_kernel_at(width, dtype, rows, d, g).expect("the CPU and type are served");
                        let got = call.run(kernel);
                        let extra = (width == DecodeWidth::ZmmHalf).then(|| call.half_bounds(false));
                        let what = format!("{width:?} {dtype} D {d} g {g:?} G {rows} keys {keys}");
                        call.check(&got, &what, extra.as_deref());
                    }
                }
            }
        }
        if zmm_runs == 0 {
            eprintln!("the 512-bit width was not tested: this CPU has no AVX-512F, BW and VBMI");
        }
        if half_runs == 0 {
            eprintln!("the f16 products were not tested: this CPU has no AVX512-FP16");
        }
    }
    /// The f16 products ([`DecodeWidth::ZmmHalf`]) on calls whose scores
    /// f16 computes exactly ([`Call::dyadic`]): `m + ln l` within the f32
    /// kernels' tolerance, `acc / l` within it plus the f16 P·V bound
    /// alone; D 64–192, GQA groups 1–8, partial blocks, masked ranges,
    /// resumed states.
    #[test]
    fn half_products_score_exactly_on_dyadic_calls() {
        if !half_serves(DType::F8E4M3, 64, Some(64)) {
            eprintln!("skipped: this CPU has no AVX512-FP16 (or KVJIT_ATTENTION_FP16=off)");
            return;
        }
        let mut seed = 2000;
        for d in [64, 128, 192] {
            for rows in [1, 2, 3, 4, 5, 8] {
                for keys in [5, 32, 77] {
                    seed += 1;
                    let call = Call::new(DType::F8E4M3, d, d, rows, keys, seed).dyadic(seed);
                    let kernel = decode_kernel_at(DecodeWidth::ZmmHalf, DType::F8E4M3, rows, d, Some(d)).unwrap();
                    let got = call.run(kernel);
                    let what = format!("f16 products, dyadic, D {d} G {rows} keys {keys}");
                    call.check(&got, &what, Some(&call.half_bounds(true)));
                }
            }
        }
    }

    /// The prefill kernel against the f64 reference: f32, bf16, f16 and
    /// FP8 caches (g = D and g-blocks of 8 and 32), head sizes 16–128, query blocks of 1 to 32 rows (partial
    /// row and key tiles), key runs shorter and longer than a block,
    /// masked ranges and resumed states; D not a multiple of 16 and an FP8
    /// g not a multiple of 8 refused.
    #[test]
    fn prefill_kernel_matches_the_reference() {
        if !avx2_available() {
            eprintln!("skipped: this CPU has no AVX2/FMA/F16C");
            return;
        }
        assert!(prefill_kernel(DType::F32, 40, None).is_none());
        assert!(prefill_kernel(DType::F8E4M3, 64, Some(4)).is_none());
        assert!(prefill_kernel(DType::F8E4M3, 64, None).is_none());
        let mut seed = 1000;
        for (dtype, d, g) in [
            (DType::F32, 64usize, None),
            (DType::BF16, 128, None),
            (DType::BF16, 16, None),
            (DType::F16, 48, None),
            (DType::F8E4M3, 64, Some(64)),
            (DType::F8E4M3, 128, Some(32)),
            (DType::F8E4M3, 48, Some(8)),
        ] {
            let kernel = prefill_kernel(dtype, d, g).expect("the CPU and type are served");
            for rows in [1, 3, 4, 7, 24, 32] {
                for keys in [5, 64, 77, 150] {
                    seed += 1;
                    let call = Call::new(dtype, d, g.unwrap_or(d), rows, keys, seed);
                    let got = call.run(kernel);
                    call.check(&got, &format!("prefill {dtype} D {d} rows {rows} keys {keys}"), None);
                }
            }
        }
    }
}

/// Timings of the decode micro-kernel, Llama-3-8B heads (8 KV heads of
/// 128, 4 query rows each; `SHAPE=smollm2` for SmolLM2-135M's), 128 keys
/// a call, FP8 with g = D: `cargo test --release -p kvjit-jit --
/// --ignored decode_kernel --nocapture` (`DT=bf16` etc. for one cache
/// type, `ITERS` calls a sample).
#[cfg(all(test, target_arch = "x86_64"))]
mod timing {
    use super::*;
    use std::arch::x86_64::*;

    /// Whether `SHAPE=smollm2` asks for SmolLM2-135M's heads (3 KV heads
    /// of 64, 3 query rows each) in place of Llama-3-8B's (read once: a
    /// `getenv` per call was 1.5 % of the timed loop).
    fn smollm2() -> bool {
        static SMOLLM2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *SMOLLM2.get_or_init(|| std::env::var("SHAPE").is_ok_and(|v| v == "smollm2"))
    }
    /// KV heads of a call.
    fn heads() -> usize {
        if smollm2() { 3 } else { 8 }
    }
    /// Query rows per KV head.
    fn rows() -> usize {
        if smollm2() { 3 } else { 4 }
    }
    /// Head size D.
    fn d() -> usize {
        if smollm2() { 64 } else { 128 }
    }
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
        fn tile_floats() -> usize {
            STATE_ACC + 4 * d()
        }

        fn new(dtype: DType) -> Self {
            let kernel = decode_kernel(dtype, rows(), d(), Some(d())).expect("AVX2 checked by the caller");
            Caller { kernel, q: vec![0.01; heads() * 4 * d()], state: vec![0.0; heads() * Self::tile_floats()] }
        }

        /// Reset the state and run the kernel over the first `KEYS` keys at
        /// `offsets` (those after them are the next call's, which its last
        /// block prefetches, as an op's next key chunk).
        ///
        /// # Safety
        /// Every `offsets[j]`, j < KEYS, plus h·D (h below the KV heads, and
        /// plus `kv_stride`) is a whole row of D elements inside `blocks`, and
        /// `scales` covers every such offset / D.
        unsafe fn call(&mut self, blocks: &[u8], offsets: &[i64], scales: &[f32], kv_stride: usize) {
            for t in 0..heads() {
                let tile = &mut self.state[t * Self::tile_floats()..];
                tile[..4].fill(f32::NEG_INFINITY);
                // Every row reads every key: [0, KEYS).
                tile[STATE_LO..STATE_LO + 4].fill(f32::from_bits(0));
                tile[STATE_HI..STATE_HI + 4].fill(f32::from_bits(KEYS as u32));
            }
            // SAFETY: the caller's bounds on the rows and scales; q and state
            // are sized for one tile a KV head; AVX2 (the kernel exists).
            unsafe {
                (self.kernel)(
                    self.q.as_ptr(),
                    blocks.as_ptr(),
                    offsets.as_ptr(),
                    KEYS,
                    offsets.len() - KEYS,
                    0,
                    heads(),
                    scales.as_ptr(),
                    self.state.as_mut_ptr(),
                    rows(),
                    d(),
                    kv_stride,
                    d(),
                    Self::tile_floats(),
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
            let slot = heads() * d();
            let kv_stride = KEYS * slot;
            let blocks = encoded(dtype, 2 * kv_stride);
            let scales = vec![FP8_SCALE; 2 * kv_stride / d()];
            let offsets: Vec<i64> = (0..KEYS as i64).map(|j| j * slot as i64).collect();
            let mut caller = Caller::new(dtype);
            let iters: usize = std::env::var("ITERS").map_or(500, |v| v.parse().unwrap());
            let mut best = f64::MAX;
            for _ in 0..7 {
                let start = std::time::Instant::now();
                for _ in 0..iters {
                    // SAFETY: key j's slot is at j·slot, its V rows kv_stride
                    // on, all inside the 2·kv_stride elements of `blocks`;
                    // scales cover blocks/D.
                    unsafe { caller.call(&blocks, &offsets, &scales, kv_stride) };
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            println!("{dtype}: {:.1} ns per key-head", best / (iters * KEYS * heads()) as f64 * 1e9);
        }
    }

    /// Prefill: a query block of 8 positions (Llama-3-8B: 32 rows a KV
    /// head; SmolLM2: 24) against 512 keys (FP8 with g = D), the decode kernel's 4-row
    /// tiles (what prefill ran before) against [`prefill_kernel`],
    /// alternated; GFLOP/s of the scores and P·V (4·D a row and key).
    #[test]
    #[ignore = "a timing, not a test"]
    fn prefill_kernel_speed() {
        if !avx2_available() {
            return;
        }
        const PREFILL_KEYS: usize = 512;
        let rows = 8 * rows();
        let tiles = rows.div_ceil(STATE_TILE_ROWS);
        let tile_floats = STATE_ACC + 4 * d();
        for dtype in dtypes() {
            let slot = heads() * d();
            let kv_stride = PREFILL_KEYS * slot;
            let blocks = encoded(dtype, 2 * kv_stride);
            let scales = vec![FP8_SCALE; 2 * kv_stride / d()];
            let offsets: Vec<i64> =
                (0..PREFILL_KEYS as i64 + 64).map(|j| j.min(PREFILL_KEYS as i64 - 1) * slot as i64).collect();
            let q = vec![0.01f32; heads() * tiles * 4 * d()];
            let kernels = [
                ("4-row tiles", decode_kernel(dtype, 4, d(), Some(d())).expect("AVX2 checked")),
                ("GEMM tiles", prefill_kernel(dtype, d(), Some(d())).expect("D a multiple of 16")),
            ];
            let mut best = [f64::MAX; 2];
            for _ in 0..7 {
                for (i, (_, kernel)) in kernels.iter().enumerate() {
                    let mut state = vec![0f32; heads() * tiles * tile_floats];
                    let start = std::time::Instant::now();
                    for _ in 0..20 {
                        for t in 0..heads() * tiles {
                            let tile = &mut state[t * tile_floats..];
                            tile[..4].fill(f32::NEG_INFINITY);
                            tile[4..8].fill(0.0);
                            tile[STATE_LO..STATE_LO + 4].fill(f32::from_bits(0));
                            tile[STATE_HI..STATE_HI + 4].fill(f32::from_bits(PREFILL_KEYS as u32));
                        }
                        // SAFETY: key j's slot at j·slot (the table's tail
                        // repeats the last key), V rows kv_stride on, inside
                        // `blocks`; q and state sized for `tiles` tiles a
                        // head; scales cover blocks / D.
                        unsafe {
                            kernel(
                                q.as_ptr(),
                                blocks.as_ptr(),
                                offsets.as_ptr(),
                                PREFILL_KEYS,
                                64,
                                0,
                                heads(),
                                scales.as_ptr(),
                                state.as_mut_ptr(),
                                rows,
                                d(),
                                kv_stride,
                                d(),
                                tile_floats,
                            )
                        };
                    }
                    best[i] = best[i].min(start.elapsed().as_secs_f64() / 20.0);
                }
            }
            let flops = (4 * d() * rows * PREFILL_KEYS * heads()) as f64;
            for ((name, _), t) in kernels.iter().zip(best) {
                println!("{dtype} {name}: {:.1} µs a call, {:.1} GFLOP/s", t * 1e6, flops / t / 1e9);
            }
        }
    }

    /// `bytes` copied into memory advised for huge pages, as a cache's
    /// blocks are.
    fn in_huge_pages(bytes: &[u8]) -> kvjit_core::Tensor {
        let mut storage = kvjit_core::Tensor::zeros_in_huge_pages(DType::F32, &[bytes.len().div_ceil(4)]).unwrap();
        storage.as_bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        storage
    }

    /// How [`read_pages`] walks the pages, a block of 32 keys at a time.
    #[derive(Clone, Copy, Debug)]
    enum ReadPattern {
        /// Each key's whole K slot, then its V slot; no software prefetch.
        Slots,
        /// Head by head, each head's 32 K rows then its 32 V rows (the
        /// kernel's order); no software prefetch.
        HeadMajor,
        /// `Slots`, the next block's K and V lines prefetched (T1) at the
        /// block's start (the 512-bit kernel before it paced its V lines).
        Burst,
        /// `Slots`, the next block's K lines prefetched at the block's start
        /// and a V slot at each key.
        Paced,
    }

    /// Sum every 32-byte word of K and V of the keys at `offsets` (element
    /// offsets of bf16 slots of `slot_bytes`, V `v_offset` bytes on) in
    /// `pattern`'s order.
    ///
    /// # Safety
    /// Each offset's K and V slots are inside `blocks`; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn read_pages(
        blocks: &[u8],
        offsets: &[i64],
        (heads, slot_bytes, v_offset): (usize, usize, usize),
        pattern: ReadPattern,
    ) -> u64 {
        let base = blocks.as_ptr();
        // The caller's bounds: a key's slot (plus v_offset) is inside blocks.
        let slot_at = |j: usize| base.wrapping_add(offsets[j] as usize * 2);
        let prefetch = |p: *const u8, bytes: usize| {
            for line in (0..bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(line).cast());
            }
        };
        let mut acc = _mm256_setzero_si256();
        let mut sum = |p: *const u8, bytes: usize| {
            for at in (0..bytes).step_by(32) {
                // SAFETY: the caller's bounds.
                acc = _mm256_add_epi32(acc, unsafe { _mm256_loadu_si256(p.add(at).cast()) });
            }
        };
        let keys = offsets.len();
        for j0 in (0..keys).step_by(32) {
            let block = j0..(j0 + 32).min(keys);
            let next = (j0 + 32).min(keys)..(j0 + 64).min(keys);
            match pattern {
                ReadPattern::HeadMajor => {
                    let row = slot_bytes / heads;
                    for h in 0..heads {
                        for half in [0, v_offset] {
                            for j in block.clone() {
                                sum(slot_at(j).wrapping_add(half + h * row), row);
                            }
                        }
                    }
                    continue;
                }
                ReadPattern::Burst | ReadPattern::Paced => {
                    for j in next.clone() {
                        prefetch(slot_at(j), slot_bytes);
                        if matches!(pattern, ReadPattern::Burst) {
                            prefetch(slot_at(j).wrapping_add(v_offset), slot_bytes);
                        }
                    }
                }
                ReadPattern::Slots => {}
            }
            for j in block {
                if matches!(pattern, ReadPattern::Paced) && j + 32 < keys {
                    prefetch(slot_at(j + 32).wrapping_add(v_offset), slot_bytes);
                }
                sum(slot_at(j), slot_bytes);
                sum(slot_at(j).wrapping_add(v_offset), slot_bytes);
            }
        }
        let mut words = [0u32; 8];
        // SAFETY: words holds 8 u32.
        unsafe { _mm256_storeu_si256(words.as_mut_ptr().cast(), acc) };
        words.iter().map(|&w| u64::from(w)).sum()
    }

    /// From DRAM: pages of 16 keys in huge pages, as a cache's blocks are,
    /// visited in a shuffled order — at least 4096 pages and 768 MiB of K
    /// and V for each cache type, so that no large last-level cache holds
    /// them (SmolLM2's heads in 4096 pages were 50 MB, inside this Xeon's
    /// 260 MB L3: those figures were L3's) —; beside pure readers of the
    /// same pages in each [`ReadPattern`] and one thread's plain read
    /// bandwidth over the same size. (On a Xeon, Emerald Rapids: `Slots` and
    /// `HeadMajor` read 13.2–13.7 GB/s on the hardware prefetchers alone,
    /// `Paced` 12.6–12.7, `Burst` 10.5: a T1 prefetch holds a line-fill
    /// buffer for the whole trip to DRAM. The kernel itself, whose demand
    /// loads come too slowly for the hardware prefetchers, read 6.8–6.9
    /// GB/s with no software prefetch at all, 9.6–10.0 paced.)
    #[test]
    #[ignore = "a timing, not a test"]
    fn decode_kernel_stream() {
        if !avx2_available() {
            return;
        }
        let page = 16usize;
        let slot = heads() * d();
        let kv_stride = page * slot;
        // Pages of a cache of `bytes`-byte elements, [pages, 2, page, slot],
        // and the element offsets of their keys' slots in a shuffled order.
        let layout = |bytes: usize| {
            let pages = (768usize << 20).div_ceil(2 * page * slot * bytes).max(4096);
            let mut order: Vec<usize> = (0..pages).collect();
            let mut s = 12345u64;
            for i in (1..pages).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (s >> 33) as usize % (i + 1));
            }
            let offsets: Vec<i64> =
                (0..pages * page).map(|j| (order[j / page] * 2 * page * slot + (j % page) * slot) as i64).collect();
            (pages, offsets)
        };
        for dtype in dtypes() {
            let (pages, offsets) = layout(dtype.size_bytes());
            let total = pages * 2 * page * slot;
            let scales = vec![FP8_SCALE; total / d() + 1];
            let storage = in_huge_pages(&encoded(dtype, total));
            let blocks = storage.as_bytes();
            let mut caller = Caller::new(dtype);
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = std::time::Instant::now();
                for call in 0..pages * page / KEYS {
                    // SAFETY: each offset is a slot of a page's K half, its V
                    // row kv_stride on in the same page's V half, all inside
                    // `blocks`; scales cover blocks/D.
                    unsafe { caller.call(blocks, &offsets[call * KEYS..], &scales, kv_stride) };
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            let read = (pages * page * heads() * 2 * d() * dtype.size_bytes()) as f64;
            let per_key_head = best / (pages * page * heads()) as f64;
            println!("{dtype}: {:.1} ns per key-head, {:.1} GB/s", per_key_head * 1e9, read / best / 1e9);
        }
        // Pure readers of the same pages (bf16 sizes, no arithmetic): what
        // the access pattern alone reads at, beside the kernel.
        let (pages, offsets) = layout(2);
        let total = pages * 2 * page * slot;
        let storage = in_huge_pages(&encoded(DType::BF16, total));
        for pattern in [ReadPattern::Slots, ReadPattern::HeadMajor, ReadPattern::Burst, ReadPattern::Paced] {
            let mut best = f64::MAX;
            let mut sink = 0u64;
            for _ in 0..3 {
                let start = std::time::Instant::now();
                // SAFETY: every offset plus a slot (and plus kv_stride) is
                // inside the pages, as for the kernel above; AVX2 checked.
                sink = sink.wrapping_add(unsafe {
                    read_pages(storage.as_bytes(), &offsets, (heads(), slot * 2, kv_stride * 2), pattern)
                });
                best = best.min(start.elapsed().as_secs_f64());
            }
            let read = (pages * page * slot * 2 * 2) as f64;
            println!("reader {pattern:?}: {:.1} GB/s ({sink})", read / best / 1e9);
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
