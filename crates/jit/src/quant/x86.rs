//! The AVX2 kernels of [`super`]: the integer GEMV tiles and the decoders
//! of packed panels to f32 (layouts in the parent's docs).

use std::arch::x86_64::*;

use kvjit_core::DType;
use kvjit_core::quant::IQ4_NL_LEVELS;

use super::{Q_MAX, Q8_ACTIVATION_BLOCK_BYTES};
use crate::microkernel::{GemmTile, TILE_COLUMNS, WidenBlock};

mod zmm;

/// The independent k ranges ("streams") a GEMV tile reads a long panel
/// in, side by side, each with its own accumulators: more line fills in
/// flight per core than one stream. Measured with two threads streaming
/// Llama-3-8B QKV panels from DRAM in huge pages, where packed weights
/// live (`examples/gemv_threads.rs`), on an Intel Xeon: two streams read
/// 4–12 % faster than four for the 32-k formats and 1.3–1.4× for the
/// K-quants; one stream within ±5 % of two for Q4_1 and the K-quants but
/// 7–30 % slower for Q4_0 and Q8_0 (and, on an Emerald Rapids Xeon, two
/// 1.03–1.14× one for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K, see
/// [`crate::microkernel::INTEL_MIN_STREAM_BYTES`]). On AMD CPUs short
/// panels read as one stream ([`streams_for`]; on Zen 4 that is most of
/// K = 4096 too).
pub(super) const STREAMS: usize = 2;
/// How many streams a GEMV tile reads a panel of `panel_bytes` in
/// ([`crate::microkernel::streams_for`] of [`STREAMS`]).
pub(super) fn streams_for(panel_bytes: usize) -> usize {
    crate::microkernel::streams_for(panel_bytes, STREAMS)
}
/// How far ahead of its loads each stream of a GEMV tile prefetches
/// (measured: 2 KiB per stream reads DRAM at ~1.3× the rate of no software
/// prefetch, within ~8% of the core's read roof; 1 KiB and 4 KiB less).
const PREFETCH_BYTES: usize = 2048;

/// A block's activation quants as a `Dot` reads them: `[hi, lo]`, each
/// the block's 8 dwords of i8 quants (each broadcast), the 16-bit quant
/// `Q = 254·q_hi + q_lo` of [`super::quantize_activations`].
type Xs = [[__m256i; 8]; 2];

/// How a GEMV tile multiplies the weights' quants with a block's two-part
/// activation quants: 8 columns' `Σ_k q_w·Q = 254·Σ q_w·q_hi + Σ q_w·q_lo`
/// over one k-group half as 8 i32 lanes, exactly. Each weight vector is
/// loaded and unpacked once for both parts.
trait Dot {
    /// A Q4 half: the 4 quant vectors at `q` against the block's `xs`.
    ///
    /// # Safety
    /// `q` readable for 128 bytes; the CPU has this `Dot`'s features.
    unsafe fn q4(q: *const u8, xs: &Xs) -> __m256i;
    /// A Q8_0 half: the 8 quant vectors at `q` against `xs`, whose 16-bit
    /// quants `Q` sum to `sum`.
    ///
    /// # Safety
    /// `q` readable for 256 bytes; the CPU has this `Dot`'s features.
    unsafe fn q8(q: *const u8, xs: &Xs, sum: i32) -> __m256i;
    /// An IQ4_NL half: the 4 code vectors at `q` (Q4's layout), each code
    /// the level [`IQ4_NL_LEVELS`] it names, against `xs`, whose 16-bit
    /// quants `Q` sum to `sum`.
    ///
    /// # Safety
    /// `q` readable for 128 bytes; the CPU has this `Dot`'s features.
    unsafe fn iq4(q: *const u8, xs: &Xs, sum: i32) -> __m256i;
    /// [`Dot::q8`] over each 16-k half of the block apart (vectors 0–3 and
    /// 4–7), whose quants `Q` sum to `sums`.
    ///
    /// # Safety
    /// As for [`Dot::q8`].
    unsafe fn q8_halves(q: *const u8, xs: &Xs, sums: [i32; 2]) -> [__m256i; 2];
    /// A Q6_K half of a 32-k sub-group: the 4 low-nibble vectors at `low`
    /// and 2 high-bit vectors at `high` against `xs`; the unsigned quants'
    /// (0..64) sums over its two 16-k scale blocks.
    ///
    /// # Safety
    /// `low` readable for 128 bytes, `high` for 64; the CPU has this
    /// `Dot`'s features.
    unsafe fn q6(low: *const u8, high: *const u8, xs: &Xs) -> [__m256i; 2];
    /// A Q5 half: the 4 low-nibble vectors at `q` and the fifth-bit vector
    /// at `high` ([`q5_quants`]) against `xs`.
    ///
    /// # Safety
    /// `q` readable for 128 bytes, `high` for 32; the CPU has this `Dot`'s
    /// features.
    unsafe fn q5(q: *const u8, high: *const u8, xs: &Xs) -> __m256i;
}

/// A Q5 half's 5-bit quants as bytes (0..32), `[g][0]` for k = 8g + j and
/// `[g][1]` for 8g + 4 + j (column dword byte j) of Q4-layout vector `g`
/// (0..4): its nibbles with bit 4 from the fifth-bit vector `bits`, whose
/// byte j holds that of k = 8g + j in bit 2g and of 8g + 4 + j in bit
/// 2g + 1 — moved to bit 4 by a 16-bit shift (what crosses a byte lands
/// below bit 4 and is masked off). Three to four AVX2 operations a byte
/// vector.
///
/// # Safety
/// `q` readable for 128 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_quants(q: *const u8, bits: __m256i) -> [[__m256i; 2]; 4] {
    let (nibble, fifth) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x10));
    // Bits 2g and 2g + 1 of each byte, at bit 4.
    let moved = [
        [_mm256_slli_epi16::<4>(bits), _mm256_slli_epi16::<3>(bits)],
        [_mm256_slli_epi16::<2>(bits), _mm256_slli_epi16::<1>(bits)],
        [bits, _mm256_srli_epi16::<1>(bits)],
        [_mm256_srli_epi16::<2>(bits), _mm256_srli_epi16::<3>(bits)],
    ];
    std::array::from_fn(|g| {
        // SAFETY: vector g < 4 of the caller's 128 bytes.
        let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
        let low = _mm256_or_si256(_mm256_and_si256(v, nibble), _mm256_and_si256(moved[g][0], fifth));
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
        [low, _mm256_or_si256(high, _mm256_and_si256(moved[g][1], fifth))]
    })
}

/// `254·hi + lo` in i32 lanes (VNNI's two parts' sums; exact: every
/// caller's |hi| ≤ 32·255·127, so the result is below 2³¹).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn combine(hi: __m256i, lo: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_mullo_epi32(hi, _mm256_set1_epi32(254)), lo)
}

/// Q6_K's 6-bit quants of a sub-group half as bytes (0..64), `[g][0]`
/// for k = 8g + j and `[g][1]` for 8g + 4 + j (column dword byte j) of
/// Q4-layout vector `g` (0..4): its nibbles with the top 2 bits from
/// high-bit vector `g / 2`, whose byte j holds in bits 2f..2f + 2 those of
/// k = 16·(g / 2) + 4f + j — fields 0 and 1 for even g, 2 and 3 for odd
/// g — moved to bits 4–5 (16-bit shifts: what crosses a byte is masked
/// off). Three AVX2 operations a byte vector.
///
/// # Safety
/// `low` readable for 128 bytes, `high` for 64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_quants(low: *const u8, high: *const u8) -> [[__m256i; 2]; 4] {
    let nibbles = _mm256_set1_epi8(0x0f);
    let top = _mm256_set1_epi8(0x30);
    // SAFETY: the caller's 64 bytes at high.
    let highs = unsafe { [_mm256_loadu_si256(high.cast()), _mm256_loadu_si256(high.add(32).cast())] };
    std::array::from_fn(|g| {
        // SAFETY: vector g < 4 of the caller's 128 bytes at low.
        let v = unsafe { _mm256_loadu_si256(low.add(32 * g).cast()) };
        let high = highs[g / 2];
        let (with_low, with_high) = if g.is_multiple_of(2) {
            (_mm256_slli_epi16::<4>(high), _mm256_slli_epi16::<2>(high))
        } else {
            (high, _mm256_srli_epi16::<2>(high))
        };
        [
            _mm256_or_si256(_mm256_and_si256(v, nibbles), _mm256_and_si256(with_low, top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v), nibbles), _mm256_and_si256(with_high, top)),
        ]
    })
}

/// [`q6_quants`] with AVX512-VL's `vpternlogd`: each high-bit vector is
/// split once into its even fields (mask `0x33`) and odd fields (`0xcc`),
/// so that every shift moving a field to bits 4–5 leaves zeros in bits
/// 6–7 (the neighbouring field was masked off, or a 16-bit right shift
/// brings in a masked field of the next byte); then one bit-select per
/// byte vector takes bits 0–3 from the nibbles and bits 4–7 from the
/// field. 22 operations a sub-group half instead of 34.
///
/// # Safety
/// As for [`q6_quants`]; the CPU has AVX512-F and AVX512-VL.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn q6_quants_ternlog(low: *const u8, high: *const u8) -> [[__m256i; 2]; 4] {
    // `c ? a : b` per bit, c the nibble mask.
    const SELECT: i32 = 0xe4;
    let nibbles = _mm256_set1_epi8(0x0f);
    // SAFETY: the caller's 64 bytes at high.
    let highs = unsafe { [_mm256_loadu_si256(high.cast()), _mm256_loadu_si256(high.add(32).cast())] };
    let fields = highs.map(|high| {
        let (even, odd) =
            (_mm256_and_si256(high, _mm256_set1_epi8(0x33)), _mm256_and_si256(high, _mm256_set1_epi8(0xcc_u8 as i8)));
        // Fields 0, 1, 2, 3 at bits 4–5.
        [_mm256_slli_epi16::<4>(even), _mm256_slli_epi16::<2>(odd), even, _mm256_srli_epi16::<2>(odd)]
    });
    std::array::from_fn(|g| {
        // SAFETY: vector g < 4 of the caller's 128 bytes at low.
        let v = unsafe { _mm256_loadu_si256(low.add(32 * g).cast()) };
        let field = &fields[g / 2][2 * (g % 2)..];
        [
            _mm256_ternarylogic_epi32::<SELECT>(v, field[0], nibbles),
            _mm256_ternarylogic_epi32::<SELECT>(_mm256_srli_epi16::<4>(v), field[1], nibbles),
        ]
    })
}

/// The 16 IQ4_NL levels plus `bias` (wrapping) in both 128-bit lanes, for
/// `vpshufb`.
const fn iq4_table(bias: i8) -> [i8; 32] {
    let mut table = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        table[i] = IQ4_NL_LEVELS[i % 16].wrapping_add(bias);
        i += 1;
    }
    table
}

/// The levels as they are (signed) and plus 128 (unsigned: 1..=241).
const IQ4_LEVELS_SIGNED: [i8; 32] = iq4_table(0);
const IQ4_LEVELS_BIASED: [i8; 32] = iq4_table(i8::MIN);

/// An IQ4_NL half's levels (plus the table's bias) as bytes, laid out as
/// [`q4_quants`]' codes: each code looked up in `table`
/// ([`IQ4_LEVELS_SIGNED`] or [`IQ4_LEVELS_BIASED`]). (A loop, not
/// `array::map`: its closures kept the vectors in memory, 10× slower.)
///
/// # Safety
/// `q` readable for 128 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_levels(q: *const u8, table: &[i8; 32]) -> [[__m256i; 2]; 4] {
    // SAFETY: table holds 32 bytes.
    let table = unsafe { _mm256_loadu_si256(table.as_ptr().cast()) };
    let nibble = _mm256_set1_epi8(0x0f);
    let mut levels = [[_mm256_setzero_si256(); 2]; 4];
    for (g, pair) in levels.iter_mut().enumerate() {
        // SAFETY: vector g < 4 of the caller's 128 bytes.
        let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
        let low = _mm256_and_si256(v, nibble);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
        *pair = [_mm256_shuffle_epi8(table, low), _mm256_shuffle_epi8(table, high)];
    }
    levels
}

/// AVX2: `vpmaddubsw` to i16 pairs, `vpmaddwd` with ones to i32.
struct Avx2;
/// AVX-VNNI: `vpdpbusd` (VEX), four u8·i8 products straight into i32
/// lanes.
struct AvxVnni;
/// AVX512-VNNI with AVX512-VL: the same `vpdpbusd` on 256-bit registers
/// (EVEX), for the CPUs with AVX-512 but not AVX-VNNI (AMD Zen 4, Intel
/// Ice Lake and Cascade Lake servers).
struct Avx512Vnni;

impl Dot for Avx2 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4(q: *const u8, xs: &Xs) -> __m256i {
        let mask = _mm256_set1_epi8(0x0f);
        // [part][g % 2]
        let mut sums = [[_mm256_setzero_si256(); 2]; 2];
        for g in 0..4 {
            // SAFETY: vector g < 4 of the caller's 128 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            let low = _mm256_and_si256(v, mask);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
            for (sums, xs) in sums.iter_mut().zip(xs) {
                // An i16 lane of a `vpmaddubsw`: two u4·i8 products
                // (≤ 2·15·128); the 8 of the half sum to ≤ 30720 < 32767.
                let p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(low, xs[2 * g]), _mm256_maddubs_epi16(high, xs[2 * g + 1]));
                sums[g % 2] = _mm256_add_epi16(sums[g % 2], p);
            }
        }
        // `vpmaddwd` with 254 (hi) and 1 (lo): 254·2·30720 < 2³¹.
        let [hi, lo] = sums.map(|s| _mm256_add_epi16(s[0], s[1]));
        _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(254)), _mm256_madd_epi16(lo, _mm256_set1_epi16(1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8(q: *const u8, xs: &Xs, _sum: i32) -> __m256i {
        let factors = [_mm256_set1_epi16(254), _mm256_set1_epi16(1)];
        let mut sums = [_mm256_setzero_si256(); 2];
        for g in 0..8 {
            // SAFETY: vector g < 8 of the caller's 256 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            let magnitude = _mm256_abs_epi8(v);
            for (xs, factor) in xs.iter().zip(factors) {
                // |w| (128 for −128, read unsigned) times x with w's sign
                // (|q_x| ≤ 127 either part): two products per i16 lane,
                // ≤ 2·128·127 = 32512, so widen each `vpmaddubsw` at once,
                // times 254 for hi: ≤ 8·255·65024 < 2³¹ over the half.
                let p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs[g], v));
                sums[g % 2] = _mm256_add_epi32(sums[g % 2], _mm256_madd_epi16(p, factor));
            }
        }
        _mm256_add_epi32(sums[0], sums[1])
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_halves(q: *const u8, xs: &Xs, _sums: [i32; 2]) -> [__m256i; 2] {
        let factors = [_mm256_set1_epi16(254), _mm256_set1_epi16(1)];
        let mut sums = [_mm256_setzero_si256(); 2];
        for g in 0..8 {
            // SAFETY: vector g < 8 of the caller's 256 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            let magnitude = _mm256_abs_epi8(v);
            for (xs, factor) in xs.iter().zip(factors) {
                // As in `q8`, summed per 16 k (vectors 0–3, 4–7).
                let p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs[g], v));
                sums[g / 4] = _mm256_add_epi32(sums[g / 4], _mm256_madd_epi16(p, factor));
            }
        }
        sums
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4(q: *const u8, xs: &Xs, _sum: i32) -> __m256i {
        let factors = [_mm256_set1_epi16(254), _mm256_set1_epi16(1)];
        // SAFETY: the caller's 128 bytes.
        let levels = unsafe { iq4_levels(q, &IQ4_LEVELS_SIGNED) };
        let mut sums = [_mm256_setzero_si256(); 2];
        for (g, pair) in levels.iter().enumerate() {
            for (nibble, &w) in pair.iter().enumerate() {
                let magnitude = _mm256_abs_epi8(w);
                for (xs, factor) in xs.iter().zip(factors) {
                    // As in `q8`: |w| ≤ 127 times x with w's sign, two
                    // products per i16 lane (≤ 2·127·127), widened at once.
                    let p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs[2 * g + nibble], w));
                    sums[nibble] = _mm256_add_epi32(sums[nibble], _mm256_madd_epi16(p, factor));
                }
            }
        }
        _mm256_add_epi32(sums[0], sums[1])
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6(low: *const u8, high: *const u8, xs: &Xs) -> [__m256i; 2] {
        let factors = [_mm256_set1_epi16(254), _mm256_set1_epi16(1)];
        // SAFETY: the caller's 128 bytes at low and 64 at high.
        let quants = unsafe { q6_quants(low, high) };
        let mut sums = [_mm256_setzero_si256(); 2];
        for (g, &[lo, hi]) in quants.iter().enumerate() {
            for (xs, factor) in xs.iter().zip(factors) {
                // An i16 lane: four u6·i8 products (≤ 4·63·128 = 32256);
                // times 254 for hi: ≤ 2·254·2·32256 < 2³¹ per 16 k.
                let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xs[2 * g]), _mm256_maddubs_epi16(hi, xs[2 * g + 1]));
                sums[g / 2] = _mm256_add_epi32(sums[g / 2], _mm256_madd_epi16(p, factor));
            }
        }
        sums
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5(q: *const u8, high: *const u8, xs: &Xs) -> __m256i {
        // SAFETY: the caller's 128 bytes at q and 32 at high.
        let quants = unsafe { q5_quants(q, _mm256_loadu_si256(high.cast())) };
        // [part][g % 2]
        let mut sums = [[_mm256_setzero_si256(); 2]; 2];
        for (g, &[low, high]) in quants.iter().enumerate() {
            for (sums, xs) in sums.iter_mut().zip(xs) {
                // An i16 lane of a `vpmaddubsw`: two u5·i8 products
                // (≤ 2·31·127); the 8 of two vectors sum to ≤ 31496 < 32767
                // (16, Q4's count, would not fit: each pair widens apart).
                let p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(low, xs[2 * g]), _mm256_maddubs_epi16(high, xs[2 * g + 1]));
                sums[g % 2] = _mm256_add_epi16(sums[g % 2], p);
            }
        }
        // `vpmaddwd` with 254 (hi) and 1 (lo): 4·254·31496 < 2³¹.
        let widen = |s: [__m256i; 2], factor: i16| {
            let factor = _mm256_set1_epi16(factor);
            _mm256_add_epi32(_mm256_madd_epi16(s[0], factor), _mm256_madd_epi16(s[1], factor))
        };
        _mm256_add_epi32(widen(sums[0], 254), widen(sums[1], 1))
    }
}

/// The `Dot` of a `vpdpbusd` tier: `$dpbusd` is its encoding's intrinsic,
/// `$q6_quants` how it unpacks Q6_K's quants ([`q6_quants`] or
/// [`q6_quants_ternlog`]), `$features` what the kernels using it enable.
macro_rules! vnni_dot {
    ($dot:ty, $features:literal, $dpbusd:ident, $q6_quants:ident) => {
        impl Dot for $dot {
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q4(q: *const u8, xs: &Xs) -> __m256i {
                let mask = _mm256_set1_epi8(0x0f);
                // [part][nibble]
                let mut sums = [[_mm256_setzero_si256(); 2]; 2];
                for g in 0..4 {
                    // SAFETY: vector g < 4 of the caller's 128 bytes.
                    let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
                    let low = _mm256_and_si256(v, mask);
                    let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                    for (sums, xs) in sums.iter_mut().zip(xs) {
                        sums[0] = $dpbusd(sums[0], low, xs[2 * g]);
                        sums[1] = $dpbusd(sums[1], high, xs[2 * g + 1]);
                    }
                }
                let [hi, lo] = sums.map(|s| _mm256_add_epi32(s[0], s[1]));
                combine(hi, lo)
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q8(q: *const u8, xs: &Xs, sum: i32) -> __m256i {
                // (w + 128) is unsigned: Σ (w + 128)·Q = Σ w·Q + 128·ΣQ, exact in
                // i32 (each part ≤ 32·255·127, 254·that < 2³¹).
                let bias = _mm256_set1_epi8(i8::MIN);
                let mut sums = [_mm256_setzero_si256(); 2];
                for g in 0..8 {
                    // SAFETY: vector g < 8 of the caller's 256 bytes.
                    let v = _mm256_xor_si256(unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) }, bias);
                    for (sum, xs) in sums.iter_mut().zip(xs) {
                        *sum = $dpbusd(*sum, v, xs[g]);
                    }
                }
                _mm256_sub_epi32(combine(sums[0], sums[1]), _mm256_set1_epi32(128 * sum))
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q8_halves(q: *const u8, xs: &Xs, sums: [i32; 2]) -> [__m256i; 2] {
                // As in `q8`, summed per 16 k: [16-k half][part].
                let bias = _mm256_set1_epi8(i8::MIN);
                let mut parts = [[_mm256_setzero_si256(); 2]; 2];
                for g in 0..8 {
                    // SAFETY: vector g < 8 of the caller's 256 bytes.
                    let v = _mm256_xor_si256(unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) }, bias);
                    for (part, xs) in parts[g / 4].iter_mut().zip(xs) {
                        *part = $dpbusd(*part, v, xs[g]);
                    }
                }
                std::array::from_fn(|t| {
                    _mm256_sub_epi32(combine(parts[t][0], parts[t][1]), _mm256_set1_epi32(128 * sums[t]))
                })
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4(q: *const u8, xs: &Xs, sum: i32) -> __m256i {
                // The levels plus 128 (1..=241) are unsigned: Σ (w + 128)·Q
                // = Σ w·Q + 128·ΣQ, exact in i32 as in `q8`.
                // SAFETY: the caller's 128 bytes.
                let levels = unsafe { iq4_levels(q, &IQ4_LEVELS_BIASED) };
                let mut sums = [_mm256_setzero_si256(); 2];
                for (g, &[low, high]) in levels.iter().enumerate() {
                    for (sum, xs) in sums.iter_mut().zip(xs) {
                        *sum = $dpbusd($dpbusd(*sum, low, xs[2 * g]), high, xs[2 * g + 1]);
                    }
                }
                _mm256_sub_epi32(combine(sums[0], sums[1]), _mm256_set1_epi32(128 * sum))
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q6(low: *const u8, high: *const u8, xs: &Xs) -> [__m256i; 2] {
                // SAFETY: the caller's 128 bytes at low and 64 at high.
                let quants = unsafe { $q6_quants(low, high) };
                // [part][16-k half]
                let mut sums = [[_mm256_setzero_si256(); 2]; 2];
                for (g, &[lo, hi]) in quants.iter().enumerate() {
                    for (sums, xs) in sums.iter_mut().zip(xs) {
                        sums[g / 2] = $dpbusd($dpbusd(sums[g / 2], lo, xs[2 * g]), hi, xs[2 * g + 1]);
                    }
                }
                [combine(sums[0][0], sums[1][0]), combine(sums[0][1], sums[1][1])]
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q5(q: *const u8, high: *const u8, xs: &Xs) -> __m256i {
                // SAFETY: the caller's 128 bytes at q and 32 at high.
                let quants = unsafe { q5_quants(q, _mm256_loadu_si256(high.cast())) };
                // [part][nibble]
                let mut sums = [[_mm256_setzero_si256(); 2]; 2];
                for (g, &[low, high]) in quants.iter().enumerate() {
                    for (sums, xs) in sums.iter_mut().zip(xs) {
                        sums[0] = $dpbusd(sums[0], low, xs[2 * g]);
                        sums[1] = $dpbusd(sums[1], high, xs[2 * g + 1]);
                    }
                }
                let [hi, lo] = sums.map(|s| _mm256_add_epi32(s[0], s[1]));
                combine(hi, lo)
            }
        }
    };
}

/// Which kind of quants a GEMV format multiplies.
#[derive(PartialEq, Eq)]
enum Quants {
    /// Nibbles in the Q4 layout (Q4_0, Q4_1, Q4_K).
    Q4,
    /// Q4's nibbles and a vector of fifth bits (Q5_0, Q5_1).
    Q5,
    /// Q8_0's bytes (and q8_min's, stored as i8).
    Q8,
    /// q8_kmin's bytes (stored as i8), summed per 16 k.
    Q8Halves,
    /// IQ4_NL's codes in Q4's layout, each naming a level.
    Iq4,
    /// Q6_K's nibbles and high bits.
    Q6,
}

/// One 32-k block of quantized activations: the scale of its 16-bit
/// quants `Q` and their sums.
struct Activations {
    /// The scale `s_x` of `Q` (the block represents x̂ = s_x·Q).
    dx: f32,
    /// `ΣQ`.
    sum: i32,
    /// `ΣQ` over its first 16 values (Q6_K's first 16-k scale block).
    first16: i32,
    /// `s_x·ΣQ` (f32), the sum of the block's x̂: Q4_1's minimums multiply it.
    scaled_sum: f32,
}

impl Activations {
    /// The scalars of the activation block at `at` (laid out as
    /// [`super::quantize_activations`] writes it: the scale at 64, the sums
    /// at 68 and 72, `s_x·ΣQ` at 76).
    ///
    /// # Safety
    /// `at` readable for [`Q8_ACTIVATION_BLOCK_BYTES`].
    #[inline(always)]
    unsafe fn read(at: *const u8) -> Activations {
        // SAFETY: the caller's block.
        unsafe {
            Activations {
                dx: at.add(64).cast::<f32>().read_unaligned(),
                sum: at.add(68).cast::<i32>().read_unaligned(),
                first16: at.add(72).cast::<i32>().read_unaligned(),
                scaled_sum: at.add(76).cast::<f32>().read_unaligned(),
            }
        }
    }
}

/// A GEMV panel format: where a k-group's parts lie and how its integer
/// sums become f32.
trait GemvFormat {
    /// k per k-group (the format's block).
    const GROUP_K: usize;
    /// Bytes of a k-group of the packed panel.
    const GROUP_BYTES: usize;
    /// The quants' kind.
    const QUANTS: Quants;
    /// Where half `h` of 32-k sub-group `s` of a k-group has its quants
    /// (Q6_K: its nibbles).
    fn quants(s: usize, h: usize) -> usize;
    /// Q6_K: where half `h` of sub-group `s` has its high bits.
    fn high(_s: usize, _h: usize) -> usize {
        0
    }
    /// What a k-group's scales unpack to, once for all its sub-groups.
    type Scales;
    /// Unpack the scales of the k-group at `w` (Q4_K's 6-bit scales and
    /// minimums; nothing for the others).
    ///
    /// # Safety
    /// `w` readable for `GROUP_BYTES`; AVX2, FMA, F16C.
    unsafe fn scales(w: *const u8) -> Self::Scales;
    /// `acc += Σ x·w` for half `h` of sub-group `s` of the k-group at `w`
    /// (its unpacked `scales`), from its exact integer sums `dots` (`[Σ,
    /// _]`, or Q6_K's two 16-k halves) against the activation block `x`:
    /// scales, offsets and minimums applied in f32.
    ///
    /// # Safety
    /// `w` readable for `GROUP_BYTES`; AVX2, FMA, F16C.
    unsafe fn add(
        w: *const u8,
        scales: &Self::Scales,
        s: usize,
        h: usize,
        dots: [__m256i; 2],
        x: &Activations,
        acc: &mut __m256,
    );
}

/// The 8 f16 at `p` as f32.
///
/// # Safety
/// `p` readable for 16 bytes; F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    // SAFETY: the caller's 16 bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// The 8 u8 at `p` as i32 lanes.
///
/// # Safety
/// `p` readable for 8 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8x8(p: *const u8) -> __m256i {
    // SAFETY: the caller's 8 bytes.
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p.cast()) })
}

/// Q4_K's 6-bit scales and minimums of a k-group, unpacked as
/// `scale_min_k4` does from the byte-sliced 12 rows of 16 columns at `p`
/// (byte b of column c at `p + 16b + c`): scale of sub-block `s`, column
/// `c` at `16s + c`, its minimum at `128 + 16s + c`. Two rows per vector,
/// bytes shifted in 16-bit lanes (what crosses a byte is masked off).
///
/// # Safety
/// `p` readable for 192 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_scales(p: *const u8) -> [u8; 256] {
    // SAFETY: rows 2r, 2r + 1 < 12 of the caller's 192 bytes.
    let rows = |r: usize| unsafe { _mm256_loadu_si256(p.add(32 * r).cast()) };
    let (low6, low4, top2) = (_mm256_set1_epi8(63), _mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
    let mut out = [0u8; 256];
    for r in 0..2 {
        // Sub-blocks 2r, 2r + 1 (< 4): scale = q[j] & 63, minimum = q[j + 4] & 63.
        let (q_j, q_j4, q_j8) = (rows(r), rows(r + 2), rows(r + 4));
        let sc = _mm256_and_si256(q_j, low6);
        let m = _mm256_and_si256(q_j4, low6);
        // Sub-blocks 4 + 2r, 5 + 2r: scale = (q[j + 4] & 15) | (q[j − 4] >> 6) << 4,
        // minimum = (q[j + 4] >> 4) | (q[j] >> 6) << 4.
        let sc_high =
            _mm256_or_si256(_mm256_and_si256(q_j8, low4), _mm256_and_si256(_mm256_srli_epi16::<2>(q_j), top2));
        let m_high = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(q_j8), low4),
            _mm256_and_si256(_mm256_srli_epi16::<2>(q_j4), top2),
        );
        // SAFETY: 32-byte stores at 32r, 64 + 32r, 128 + 32r, 192 + 32r.
        unsafe {
            let o = out.as_mut_ptr();
            _mm256_storeu_si256(o.add(32 * r).cast(), sc);
            _mm256_storeu_si256(o.add(64 + 32 * r).cast(), sc_high);
            _mm256_storeu_si256(o.add(128 + 32 * r).cast(), m);
            _mm256_storeu_si256(o.add(192 + 32 * r).cast(), m_high);
        }
    }
    out
}

/// Where a Q4_K k-group keeps its parts (see the module docs).
const Q4K_D: usize = 0;
const Q4K_DMIN: usize = 32;
const Q4K_SCALES: usize = 64;
const Q4K_QUANTS: usize = 256;
/// Where a Q6_K k-group keeps its parts (see the module docs).
const Q6K_SCALES: usize = 0;
const Q6K_D: usize = 256;
const Q6K_QUANTS: usize = 288;
const Q6K_SUBGROUP: usize = 384;

/// Where a Q5_0 / Q5_1 k-group keeps its fifth bits, scales and
/// minimums (see the module docs).
const Q5_HIGH: usize = 256;
const Q5_D: usize = 320;
const Q5_M: usize = 352;

struct Q4_0;
struct Q4_1;
/// Q5_0 (`MIN = false`) or Q5_1.
struct Q5<const MIN: bool>;
struct Q8_0;
/// IQ4_NL: Q4_0's k-group, its codes naming levels.
struct Iq4Nl;
/// kvjit's q8_min: Q8_0's k-group with its quants stored as `q − 128` and
/// the minimums after the scales.
struct Q8Min;
struct Q4K;
/// Q4_K's k-group followed by the fifth bits of its 8 sub-blocks.
struct Q5K;
struct Q6K;
/// kvjit's q8_kmin: per 16 k an i8 scale and i16 minimum, quants stored as
/// `q − 128` in Q8_0's arrangement per 32-k sub-group.
struct Q8KMin;

/// Where a q8_kmin k-group keeps its parts (see the module docs).
const Q8KMIN_DMIN: usize = 32;
const Q8KMIN_SCALES: usize = 64;
const Q8KMIN_MINS: usize = 320;
const Q8KMIN_QUANTS: usize = 832;

/// The f32 step of a 32-k format's half (one scale per block, and a
/// minimum): `acc += s_x·d·dot`, and `+ m·(s_x·ΣQ)` with the 8 f16 `m` at
/// `m_at` — `value = d·q (+ m)`, so `Σ x̂·w = s_x·d·Σ Q·q + m·(s_x·ΣQ)`.
///
/// # Safety
/// `w` readable for the 8 f16 `d` at `d_at` (and `m` at `m_at`); AVX2,
/// FMA, F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_scaled(w: *const u8, d_at: usize, m_at: Option<usize>, dot: __m256i, x: &Activations, acc: &mut __m256) {
    // SAFETY: the caller's 16 bytes at d_at.
    let scale = _mm256_mul_ps(unsafe { f16x8(w.add(d_at)) }, _mm256_set1_ps(x.dx));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
    if let Some(m_at) = m_at {
        // SAFETY: the caller's 16 bytes at m_at.
        let m = unsafe { f16x8(w.add(m_at)) };
        *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum), *acc);
    }
}

impl GemvFormat for Q4_0 {
    const GROUP_K: usize = 32;
    const GROUP_BYTES: usize = 288;
    const QUANTS: Quants = Quants::Q4;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(_s: usize, h: usize) -> usize {
        128 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), _s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // value = d·(q − 8): Σ Q·(q_w − 8) = Σ Q·q_w − 8·ΣQ.
        let dot = _mm256_sub_epi32(dots[0], _mm256_set1_epi32(8 * x.sum));
        // SAFETY: the half's 8 scales inside the caller's group.
        unsafe { add_scaled(w, 256 + 16 * h, None, dot, x, acc) }
    }
}

impl GemvFormat for Q4_1 {
    const GROUP_K: usize = 32;
    const GROUP_BYTES: usize = 320;
    const QUANTS: Quants = Quants::Q4;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(_s: usize, h: usize) -> usize {
        128 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), _s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // SAFETY: the half's 8 scales and 8 minimums inside the caller's
        // group.
        unsafe { add_scaled(w, 256 + 16 * h, Some(288 + 16 * h), dots[0], x, acc) }
    }
}

impl<const MIN: bool> GemvFormat for Q5<MIN> {
    const GROUP_K: usize = 32;
    const GROUP_BYTES: usize = if MIN { 384 } else { 352 };
    const QUANTS: Quants = Quants::Q5;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(_s: usize, h: usize) -> usize {
        128 * h
    }
    fn high(_s: usize, h: usize) -> usize {
        Q5_HIGH + 32 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), _s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // Q5_1: d·q + m; Q5_0: d·(q − 16), Σ Q·(q_w − 16) = Σ Q·q_w − 16·ΣQ.
        let dot = match MIN {
            true => dots[0],
            false => _mm256_sub_epi32(dots[0], _mm256_set1_epi32(16 * x.sum)),
        };
        // SAFETY: the half's 8 scales (and 8 minimums) inside the caller's
        // group.
        unsafe { add_scaled(w, Q5_D + 16 * h, MIN.then_some(Q5_M + 16 * h), dot, x, acc) }
    }
}

impl GemvFormat for Q8_0 {
    const GROUP_K: usize = 32;
    const GROUP_BYTES: usize = 544;
    const QUANTS: Quants = Quants::Q8;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(_s: usize, h: usize) -> usize {
        256 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), _s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // SAFETY: the half's 8 scales inside the caller's group.
        unsafe { add_scaled(w, 512 + 16 * h, None, dots[0], x, acc) }
    }
}

impl GemvFormat for Iq4Nl {
    const GROUP_K: usize = 32;
    const GROUP_BYTES: usize = 288;
    const QUANTS: Quants = Quants::Iq4;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(_s: usize, h: usize) -> usize {
        128 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), _s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // value = d·T[code]: Σ x̂·w = s_x·d·Σ Q·T[code].
        // SAFETY: the half's 8 scales inside the caller's group.
        unsafe { add_scaled(w, 256 + 16 * h, None, dots[0], x, acc) }
    }
}

impl GemvFormat for Q8Min {
    const GROUP_K: usize = 32;
    const GROUP_BYTES: usize = 576;
    const QUANTS: Quants = Quants::Q8;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(_s: usize, h: usize) -> usize {
        256 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), _s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // value = d·q + m with q = v + 128 (v the stored i8): Σ x̂·w =
        // s_x·d·(Σ Q·v + 128·ΣQ) + m·(s_x·ΣQ); the sum is exact in i32
        // (each term ≤ 32·32258·128 < 2³⁰).
        let dot = _mm256_add_epi32(dots[0], _mm256_set1_epi32(128 * x.sum));
        // SAFETY: the half's 8 scales and 8 minimums inside the caller's
        // group.
        unsafe { add_scaled(w, 512 + 16 * h, Some(544 + 16 * h), dot, x, acc) }
    }
}

impl GemvFormat for Q4K {
    const GROUP_K: usize = 256;
    const GROUP_BYTES: usize = 2304;
    const QUANTS: Quants = Quants::Q4;
    type Scales = [u8; 256];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(w: *const u8) -> [u8; 256] {
        // SAFETY: the group's 12 rows of scale bytes.
        unsafe { k4_scales(w.add(Q4K_SCALES)) }
    }
    fn quants(s: usize, h: usize) -> usize {
        Q4K_QUANTS + 256 * s + 128 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(
        w: *const u8,
        scales: &[u8; 256],
        s: usize,
        h: usize,
        dots: [__m256i; 2],
        x: &Activations,
        acc: &mut __m256,
    ) {
        // value = (d·sc)·q − dmin·m: Σ x̂·w = s_x·(d·sc)·Σ Q·q − dmin·m·(s_x·ΣQ).
        // SAFETY: the half's 8 d, 8 dmin and scale rows inside the caller's
        // group.
        let (d, dmin, sc, m) = unsafe {
            let p = scales.as_ptr().add(16 * s + 8 * h);
            (f16x8(w.add(Q4K_D + 16 * h)), f16x8(w.add(Q4K_DMIN + 16 * h)), u8x8(p), u8x8(p.add(128)))
        };
        let scale = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)), _mm256_set1_ps(x.dx));
        let min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[0]), scale, *acc);
        *acc = _mm256_fnmadd_ps(min, _mm256_set1_ps(x.dx * x.sum as f32), *acc);
    }
}

impl GemvFormat for Q5K {
    const GROUP_K: usize = 256;
    const GROUP_BYTES: usize = Q4K::GROUP_BYTES + 8 * 64;
    const QUANTS: Quants = Quants::Q5;
    type Scales = [u8; 256];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(w: *const u8) -> [u8; 256] {
        // SAFETY: Q4_K's scale rows, at the same place.
        unsafe { Q4K::scales(w) }
    }
    fn quants(s: usize, h: usize) -> usize {
        Q4K::quants(s, h)
    }
    fn high(s: usize, h: usize) -> usize {
        Q4K::GROUP_BYTES + 64 * s + 32 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(
        w: *const u8,
        scales: &[u8; 256],
        s: usize,
        h: usize,
        dots: [__m256i; 2],
        x: &Activations,
        acc: &mut __m256,
    ) {
        // Q4_K's arithmetic on 5-bit quants.
        // SAFETY: Q4_K's d, dmin and scale rows, at the same place.
        unsafe { Q4K::add(w, scales, s, h, dots, x, acc) }
    }
}

impl GemvFormat for Q6K {
    const GROUP_K: usize = 256;
    const GROUP_BYTES: usize = 3360;
    const QUANTS: Quants = Quants::Q6;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(s: usize, h: usize) -> usize {
        Q6K_QUANTS + Q6K_SUBGROUP * s + 128 * h
    }
    fn high(s: usize, h: usize) -> usize {
        Q6K_QUANTS + Q6K_SUBGROUP * s + 256 + 64 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // value = (d·sc)·(q − 32) per 16 k: Σ Q·(q − 32) = Σ Q·q − 32·ΣQ
        // over each 16-k half of the block.
        let sums = [x.first16, x.sum - x.first16];
        // SAFETY: the half's 8 d and its sub-group's 2 scale rows inside
        // the caller's group.
        let d = unsafe { f16x8(w.add(Q6K_D + 16 * h)) };
        let dx = _mm256_set1_ps(x.dx);
        for t in 0..2 {
            // SAFETY: scale row 2s + t < 16 of the group.
            let sc =
                unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(w.add(Q6K_SCALES + 16 * (2 * s + t) + 8 * h).cast())) };
            let scale = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)), dx);
            let dot = _mm256_sub_epi32(dots[t], _mm256_set1_epi32(32 * sums[t]));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
        }
    }
}

impl GemvFormat for Q8KMin {
    const GROUP_K: usize = 256;
    const GROUP_BYTES: usize = 4928;
    const QUANTS: Quants = Quants::Q8Halves;
    type Scales = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_w: *const u8) {}
    fn quants(s: usize, h: usize) -> usize {
        Q8KMIN_QUANTS + 512 * s + 256 * h
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, _: &(), s: usize, h: usize, dots: [__m256i; 2], x: &Activations, acc: &mut __m256) {
        // value = S·q − M per 16 k (S = d·sc, M = dmin·m), q = v + 128 (v
        // the stored i8): Σ x̂·w = s_x·S·(Σ Q·v + 128·ΣQ) − M·(s_x·ΣQ) over
        // each 16-k half; the sum is exact in i32 (each term ≤ 16·32258·128).
        let sums = [x.first16, x.sum - x.first16];
        // SAFETY: the half's 8 d, 8 dmin, and its sub-group's 2 rows of
        // scales and minimums inside the caller's group.
        let (d, dmin) = unsafe { (f16x8(w.add(16 * h)), f16x8(w.add(Q8KMIN_DMIN + 16 * h))) };
        let dx = _mm256_set1_ps(x.dx);
        for t in 0..2 {
            let row = 16 * (2 * s + t) + 8 * h;
            // SAFETY: row 2s + t < 16 of the group's scales and minimums.
            let (sc, m) = unsafe {
                (
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(w.add(Q8KMIN_SCALES + row).cast())),
                    _mm256_cvtepi16_epi32(_mm_loadu_si128(w.add(Q8KMIN_MINS + 2 * row).cast())),
                )
            };
            let scale = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)), dx);
            let min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
            let dot = _mm256_add_epi32(dots[t], _mm256_set1_epi32(128 * sums[t]));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
            *acc = _mm256_fnmadd_ps(min, _mm256_set1_ps(x.dx * sums[t] as f32), *acc);
        }
    }
}

/// The body of an integer GEMV tile of format `$format` multiplying with
/// `$dot` (the [`GemmTile`] ABI as [`super::quant_gemv`] reads it): the
/// panel's k-groups in `STREAMS` contiguous ranges side by side, each
/// with its own accumulators and prefetching [`PREFETCH_BYTES`] ahead of
/// itself. A macro, not a function: `#[inline]` functions with target
/// features inline only into callers with at least theirs, so each kernel
/// holds the body whose `$dot` calls its features allow.
macro_rules! gemv_body {
    ($format:ty, $dot:ty, $streams:expr, $x:ident, $w:ident, $k:ident, $c:ident) => {{
        let x = $x.cast::<u8>();
        let subs = <$format>::GROUP_K / 32;
        let part = <$format>::GROUP_BYTES / subs;
        let groups = $k / <$format>::GROUP_K;
        let streams: usize = $streams;
        let span = groups / streams;
        let mut acc = [[_mm256_setzero_ps(); 2]; $streams];
        let (stream_bytes, panel_bytes) = (span * <$format>::GROUP_BYTES, groups * <$format>::GROUP_BYTES);
        // Where stream s prefetches while it reads its j-th k-group.
        let ahead = |s: usize, j: usize| {
            let at = j * <$format>::GROUP_BYTES;
            $w.wrapping_add(crate::microkernel::stream_prefetch_offset(
                s,
                at,
                PREFETCH_BYTES,
                stream_bytes,
                panel_bytes,
            ))
        };
        // SAFETY: stream s reads k-groups s·span + j for j < span, the
        // tail streams·span..groups: every k-group < K / GROUP_K of the
        // panel and every 32-k activation block (80 bytes: 8 + 8 quant
        // dwords, the scale at 64, the sums at 68 and 72), as the caller
        // vouches;
        // prefetches form their addresses with `wrapping_add` and never
        // fault; the kernel has the features of `$dot` and the format's
        // `add`.
        let group = |acc: &mut [__m256; 2], g: usize, prefetch_at: *const u8| unsafe {
            let w = $w.add(g * <$format>::GROUP_BYTES);
            let scales = <$format>::scales(w);
            for s in 0..subs {
                for line in (s * part..(s + 1) * part).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(prefetch_at.wrapping_add(line).cast());
                }
                let at = x.add((g * subs + s) * Q8_ACTIVATION_BLOCK_BYTES);
                let xs: Xs = std::array::from_fn(|part| {
                    std::array::from_fn(|i| _mm256_set1_epi32(at.add(32 * part + 4 * i).cast::<i32>().read_unaligned()))
                });
                let block = Activations::read(at);
                for (h, acc) in acc.iter_mut().enumerate() {
                    let q = w.add(<$format>::quants(s, h));
                    let dots = match <$format>::QUANTS {
                        Quants::Q4 => [<$dot>::q4(q, &xs), _mm256_setzero_si256()],
                        Quants::Q5 => [<$dot>::q5(q, w.add(<$format>::high(s, h)), &xs), _mm256_setzero_si256()],
                        Quants::Q8 => [<$dot>::q8(q, &xs, block.sum), _mm256_setzero_si256()],
                        Quants::Iq4 => [<$dot>::iq4(q, &xs, block.sum), _mm256_setzero_si256()],
                        Quants::Q8Halves => <$dot>::q8_halves(q, &xs, [block.first16, block.sum - block.first16]),
                        Quants::Q6 => <$dot>::q6(q, w.add(<$format>::high(s, h)), &xs),
                    };
                    <$format>::add(w, &scales, s, h, dots, &block, acc);
                }
            }
        };
        for j in 0..span {
            for (s, stream) in acc[..streams].iter_mut().enumerate() {
                group(stream, s * span + j, ahead(s, j));
            }
        }
        for g in streams * span..groups {
            let prefetch_at = $w.wrapping_add(g * <$format>::GROUP_BYTES + PREFETCH_BYTES);
            group(&mut acc[0], g, prefetch_at);
        }
        let mut sum = acc[0];
        for stream in &acc[1..streams] {
            sum[0] = _mm256_add_ps(sum[0], stream[0]);
            sum[1] = _mm256_add_ps(sum[1], stream[1]);
        }
        // SAFETY: c holds 16 f32.
        unsafe {
            _mm256_storeu_ps($c, _mm256_add_ps(_mm256_loadu_ps($c), sum[0]));
            _mm256_storeu_ps($c.add(8), _mm256_add_ps(_mm256_loadu_ps($c.add(8)), sum[1]));
        }
    }};
}

/// The integer GEMV tile of format `F` on AVX2 ([`gemv_body`]).
///
/// # Safety
/// `x` readable for K/32 quantized activation blocks (cast), `w` for a
/// packed panel of `F` over `k` (a multiple of `F`'s k-group), `c` readable and
/// writable for 16 f32; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn gemv_kernel<F: GemvFormat, const S: usize>(
    x: *const f32,
    _x_step: usize,
    w: *const u8,
    k: usize,
    c: *mut f32,
) {
    gemv_body!(F, Avx2, S, x, w, k, c)
}

/// A `vpdpbusd` tier: its `Dot` ([`vnni_dot`], the products by `$dpbusd`)
/// and its integer GEMV tile `$kernel::<F, S>` of format `F`
/// ([`gemv_body`]) reading each panel in `S` streams ([`STREAMS`]; other
/// counts for measuring that choice, [`gemv_with_streams`]), both compiled
/// with `$features`. Measured (AVX-VNNI) with two-part activations
/// 1.1–1.65× [`gemv_kernel`] on panels in L2 (Q4_1 and Q4_K ~1.1×, Q6_K
/// ~1.15×, Q4_0 ~1.35×, Q8_0 ~1.65×), 1.0–1.2× from DRAM (Q8_0 the most);
/// (AVX512-VNNI, AMD Zen 4, one core, `examples/quant_gemv.rs`) 1.2–1.9×
/// in L2 (Q4_1 1.18×, Q4_K 1.21×, Q4_0 1.35×, Q6_K 1.48×, Q8_0 1.93×),
/// even from DRAM.
macro_rules! vnni_tier {
    ($dot:ty, $kernel:ident, $features:literal, $dpbusd:ident, $q6_quants:ident) => {
        vnni_dot!($dot, $features, $dpbusd, $q6_quants);

        /// # Safety
        /// As for [`gemv_kernel`], and the CPU has this tier's features
        /// ([`DotTier::available`]).
        #[target_feature(enable = $features)]
        unsafe extern "C" fn $kernel<F: GemvFormat, const S: usize>(
            x: *const f32,
            _x_step: usize,
            w: *const u8,
            k: usize,
            c: *mut f32,
        ) {
            gemv_body!(F, $dot, S, x, w, k, c)
        }
    };
}

vnni_tier!(AvxVnni, gemv_kernel_avx_vnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32, q6_quants);
vnni_tier!(
    Avx512Vnni,
    gemv_kernel_avx512_vnni,
    "avx2,fma,f16c,avx512f,avx512vnni,avx512vl",
    _mm256_dpbusd_epi32,
    q6_quants_ternlog
);

/// How an integer GEMV tile multiplies the quants: the instructions its
/// `Dot` uses, and so the CPU features it needs. Every tier computes the
/// same sums exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DotTier {
    /// `vpmaddubsw` and `vpmaddwd` (AVX2).
    Avx2,
    /// `vpdpbusd`, VEX-encoded (AVX-VNNI).
    AvxVnni,
    /// `vpdpbusd` on 256-bit registers, EVEX-encoded (AVX512-VNNI and
    /// AVX512-VL).
    Avx512Vnni,
    /// `vpdpbusd` on 512-bit registers, a panel's 16 columns in one
    /// ([`zmm`]; AVX512-F, AVX512-BW, AVX512-VL and AVX512-VNNI).
    Avx512Zmm,
}

impl DotTier {
    /// Every tier, in the order [`DotTier::best`] prefers them: the zmm
    /// tiles first (measured on an Intel Xeon with AVX-512, see [`zmm`]),
    /// then the two ymm `vpdpbusd` encodings (the same µop).
    pub(super) const ALL: [DotTier; 4] = [DotTier::Avx512Zmm, DotTier::AvxVnni, DotTier::Avx512Vnni, DotTier::Avx2];

    /// Whether this CPU has the tier's features (AVX2, FMA and F16C
    /// checked by the caller).
    pub(super) fn available(self) -> bool {
        match self {
            DotTier::Avx2 => true,
            DotTier::AvxVnni => std::arch::is_x86_feature_detected!("avxvnni"),
            // AVX512-VL implies AVX512F to the compiler; checked too.
            DotTier::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            DotTier::Avx512Zmm => DotTier::Avx512Vnni.available() && std::arch::is_x86_feature_detected!("avx512bw"),
        }
    }

    /// The tier `KVJIT_QUANT_DOT` names: `avx2`, `avx-vnni`, `avx512-vnni`
    /// or `avx512-zmm`.
    fn named(name: &str) -> Option<DotTier> {
        match name {
            "avx2" => Some(DotTier::Avx2),
            "avx-vnni" => Some(DotTier::AvxVnni),
            "avx512-vnni" => Some(DotTier::Avx512Vnni),
            "avx512-zmm" => Some(DotTier::Avx512Zmm),
            _ => None,
        }
    }

    /// The fastest tier this CPU has: a `vpdpbusd` one where it can, unless
    /// `KVJIT_QUANT_DOT` names another tier the CPU has (to measure what a
    /// CPU without VNNI runs, on one with it: `avx2`; or one encoding
    /// against the other). Read once per process.
    pub(super) fn best() -> DotTier {
        static BEST: std::sync::OnceLock<DotTier> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let asked = std::env::var("KVJIT_QUANT_DOT").ok().and_then(|name| Self::named(&name));
            match asked {
                Some(tier) if tier.available() => tier,
                _ => Self::ALL.into_iter().find(|tier| tier.available()).unwrap_or(DotTier::Avx2),
            }
        })
    }
}

/// The integer GEMV tile of `format` on `tier` read in `streams` streams
/// (1, 2 or 4 for the `vpdpbusd` tiers, 1 or [`STREAMS`] for AVX2; the
/// caller checked [`DotTier::available`]).
pub(super) fn gemv_with_streams_on(format: DType, tier: DotTier, streams: usize) -> Option<GemmTile> {
    if tier == DotTier::Avx512Zmm {
        return zmm::gemv(format, streams);
    }
    macro_rules! pick {
        ($f:ty) => {
            match (tier, streams) {
                (DotTier::Avx2, 1) => gemv_kernel::<$f, 1> as GemmTile,
                (DotTier::Avx2, STREAMS) => gemv_kernel::<$f, STREAMS>,
                (DotTier::AvxVnni, 1) => gemv_kernel_avx_vnni::<$f, 1>,
                (DotTier::AvxVnni, 2) => gemv_kernel_avx_vnni::<$f, 2>,
                (DotTier::AvxVnni, 4) => gemv_kernel_avx_vnni::<$f, 4>,
                (DotTier::Avx512Vnni, 1) => gemv_kernel_avx512_vnni::<$f, 1>,
                (DotTier::Avx512Vnni, 2) => gemv_kernel_avx512_vnni::<$f, 2>,
                (DotTier::Avx512Vnni, 4) => gemv_kernel_avx512_vnni::<$f, 4>,
                _ => return None,
            }
        };
    }
    Some(match format {
        DType::Q4_0 => pick!(Q4_0),
        DType::Q4_1 => pick!(Q4_1),
        DType::Q5_0 => pick!(Q5<false>),
        DType::Q5_1 => pick!(Q5<true>),
        DType::Q8_0 => pick!(Q8_0),
        DType::Iq4Nl => pick!(Iq4Nl),
        DType::Q8Min => pick!(Q8Min),
        DType::Q4K => pick!(Q4K),
        DType::Q5K => pick!(Q5K),
        DType::Q6K => pick!(Q6K),
        DType::Q8KMin => pick!(Q8KMin),
        _ => return None,
    })
}

/// The tile of `format` on this CPU's best `vpdpbusd` tier read in
/// `streams` streams; `None` without one (or with `KVJIT_QUANT_DOT=avx2`).
pub(super) fn gemv_with_streams(format: DType, streams: usize) -> Option<GemmTile> {
    match DotTier::best() {
        DotTier::Avx2 => None,
        tier => gemv_with_streams_on(format, tier, streams),
    }
}

/// The integer GEMV tile of `format` on `tier` for panels of `k`, in
/// [`streams_for`] their bytes.
pub(super) fn gemv_tier(format: DType, k: usize, tier: DotTier) -> Option<GemmTile> {
    gemv_with_streams_on(format, tier, streams_for(super::panel_bytes(format, k)))
}

/// The integer GEMV tile of `format` on this CPU's best tier for panels
/// of `k`.
pub(super) fn gemv(format: DType, k: usize) -> Option<GemmTile> {
    gemv_tier(format, k, DotTier::best())
}

/// The 8 columns' 4 bytes in `v` (byte j of each column's dword at
/// `[j]`) as i32 lanes: sign-extended (`SIGNED`) or zero-extended.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dword_bytes<const SIGNED: bool>(v: __m256i) -> [__m256i; 4] {
    if SIGNED {
        [
            _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(v)),
            _mm256_srai_epi32::<24>(_mm256_slli_epi32::<16>(v)),
            _mm256_srai_epi32::<24>(_mm256_slli_epi32::<8>(v)),
            _mm256_srai_epi32::<24>(v),
        ]
    } else {
        let byte = _mm256_set1_epi32(0xff);
        [
            _mm256_and_si256(v, byte),
            _mm256_and_si256(_mm256_srli_epi32::<8>(v), byte),
            _mm256_and_si256(_mm256_srli_epi32::<16>(v), byte),
            _mm256_srli_epi32::<24>(v),
        ]
    }
}

/// A Q4 half's quants as bytes (0..16), laid out as [`q5_quants`]'.
///
/// # Safety
/// `q` readable for 128 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_quants(q: *const u8) -> [[__m256i; 2]; 4] {
    let nibble = _mm256_set1_epi8(0x0f);
    std::array::from_fn(|g| {
        // SAFETY: vector g < 4 of the caller's 128 bytes.
        let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
        [_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble)]
    })
}

/// A Q4 (`FIFTH = false`) or Q5 half's quants as bytes: [`q4_quants`] or
/// [`q5_quants`] of the 128 quant bytes at `q` and the fifth-bit vector at
/// `bits`.
///
/// # Safety
/// `q` readable for 128 bytes and, with `FIFTH`, `bits` for 32; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_quants<const FIFTH: bool>(q: *const u8, bits: *const u8) -> [[__m256i; 2]; 4] {
    // SAFETY: the caller's bytes.
    unsafe { if FIFTH { q5_quants(q, _mm256_loadu_si256(bits.cast())) } else { q4_quants(q) } }
}

/// Store the 16-wide rows `8g + k` (k = 0..8) of a decoded panel half `h`
/// at `out` (`[k][16]` f32) from a sub-group's quant bytes as [`q5_quants`]
/// lays them out, each lane `decode`d from its i32 quant: the byte, or
/// with `CENTRED` the byte less `centre` (which must fit an i8).
///
/// # Safety
/// `out` writable for the sub-group's 32 rows of 16 f32 at half `h`; AVX.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_sub_group<const CENTRED: bool>(
    quants: &[[__m256i; 2]; 4],
    centre: i8,
    out: *mut f32,
    h: usize,
    decode: impl Fn(usize, __m256i) -> __m256,
) {
    let centre = _mm256_set1_epi8(centre);
    for (g, &[low, high]) in quants.iter().enumerate() {
        for (half, bytes) in [low, high].into_iter().enumerate() {
            // Centred once a byte vector, then sign-extended.
            let bytes = if CENTRED { _mm256_sub_epi8(bytes, centre) } else { bytes };
            for (j, q) in dword_bytes::<CENTRED>(bytes).into_iter().enumerate() {
                let k = 8 * g + 4 * half + j;
                // SAFETY: row k < 32 of the caller's rows, 8 f32 at half h.
                unsafe { _mm256_storeu_ps(out.add(k * TILE_COLUMNS + 8 * h), decode(g, q)) };
            }
        }
    }
}

/// Decode `count / 16` k of a Q4_0 / Q4_1 (`FIFTH = false`) or Q5_0 /
/// Q5_1 panel at `w` to `out` (`[k][16]` f32), as `kvjit_core::quant`
/// does: `d·(q − offset)` (Q4_0: 8, Q5_0: 16) or, with `MIN`, `d·q + m`,
/// the product rounded before the sum.
///
/// # Safety
/// `w` readable for the panel's k-groups over `count / 16` k (a multiple of
/// 32), `out` writable for `count` f32; AVX2, FMA, F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_nibbles<const MIN: bool, const FIFTH: bool>(w: *const u8, count: usize, out: *mut f32) {
    // Where a k-group keeps its parts, and its bytes.
    let (d_at, m_at) = if FIFTH { (Q5_D, Q5_M) } else { (256, 288) };
    let group_bytes = if MIN { m_at + 32 } else { d_at + 32 };
    let offset = if FIFTH { 16 } else { 8 };
    for g in 0..count / (32 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 512 of the panel and its 512 outputs.
        unsafe {
            let w = w.add(g * group_bytes);
            let out = out.add(g * 32 * TILE_COLUMNS);
            for h in 0..2 {
                let d = f16x8(w.add(d_at + 16 * h));
                let quants = nibble_quants::<FIFTH>(w.add(128 * h), w.add(Q5_HIGH + 32 * h));
                if MIN {
                    let m = f16x8(w.add(m_at + 16 * h));
                    store_sub_group::<false>(&quants, 0, out, h, |_, q| {
                        _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m)
                    });
                } else {
                    store_sub_group::<true>(&quants, offset, out, h, |_, q| _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
                }
            }
        }
    }
}

/// Decode `count / 16` k of an IQ4_NL panel at `w` to `out` (`[k][16]`
/// f32), as `kvjit_core::quant` does: `d·T[code]`.
///
/// # Safety
/// As for [`dequantize_nibbles`], for an IQ4_NL panel.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_iq4nl(w: *const u8, count: usize, out: *mut f32) {
    for g in 0..count / (32 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 512 of the panel and its 512 outputs.
        unsafe {
            let w = w.add(g * Iq4Nl::GROUP_BYTES);
            let out = out.add(g * 32 * TILE_COLUMNS);
            for h in 0..2 {
                let d = f16x8(w.add(256 + 16 * h));
                let levels = iq4_levels(w.add(128 * h), &IQ4_LEVELS_SIGNED);
                store_sub_group::<true>(&levels, 0, out, h, |_, q| _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        }
    }
}

/// Decode `count / 16` k of a Q8_0 (`MIN = false`: `q·d`) or q8_min
/// (`d·(v + 128) + m`, `v` the stored i8, the product rounded before the
/// sum) panel at `w` to `out` (`[k][16]` f32).
///
/// # Safety
/// As for [`dequantize_nibbles`], for a Q8_0 or q8_min panel.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_q8<const MIN: bool>(w: *const u8, count: usize, out: *mut f32) {
    let group_bytes = if MIN { 576 } else { 544 };
    let bias = _mm256_set1_epi32(128);
    for g in 0..count / (32 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 512 of the panel and its 512 outputs.
        unsafe {
            let w = w.add(g * group_bytes);
            let out = out.add(g * 32 * TILE_COLUMNS);
            for h in 0..2 {
                let d = f16x8(w.add(512 + 16 * h));
                let m = if MIN { f16x8(w.add(544 + 16 * h)) } else { _mm256_setzero_ps() };
                for v in 0..8 {
                    let q = _mm256_loadu_si256(w.add(256 * h + 32 * v).cast());
                    for (j, q) in dword_bytes::<true>(q).into_iter().enumerate() {
                        let value = match MIN {
                            true => _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(q, bias))), m),
                            false => _mm256_mul_ps(_mm256_cvtepi32_ps(q), d),
                        };
                        _mm256_storeu_ps(out.add((4 * v + j) * TILE_COLUMNS + 8 * h), value);
                    }
                }
            }
        }
    }
}

/// Decode `count / 16` k of a Q4_K (`FIFTH = false`) or Q5_K panel at `w`
/// to `out` (`[k][16]` f32), as `kvjit_core::quant` does: per 32-k
/// sub-block `(d·sc)·q − dmin·m`, every product rounded before the
/// difference.
///
/// # Safety
/// As for [`dequantize_nibbles`], for a Q4_K or Q5_K panel (`count / 16` a
/// multiple of 256).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_k4<const FIFTH: bool>(w: *const u8, count: usize, out: *mut f32) {
    let group_bytes = if FIFTH { Q5K::GROUP_BYTES } else { Q4K::GROUP_BYTES };
    for g in 0..count / (256 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 4096 of the panel and its 4096
        // outputs.
        unsafe {
            let w = w.add(g * group_bytes);
            let out = out.add(g * 256 * TILE_COLUMNS);
            let scales = k4_scales(w.add(Q4K_SCALES));
            for h in 0..2 {
                let d = f16x8(w.add(Q4K_D + 16 * h));
                let dmin = f16x8(w.add(Q4K_DMIN + 16 * h));
                for s in 0..8 {
                    let (sc, m) =
                        (u8x8(scales.as_ptr().add(16 * s + 8 * h)), u8x8(scales.as_ptr().add(128 + 16 * s + 8 * h)));
                    let scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                    let min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
                    let high = if FIFTH { Q5K::high(s, h) } else { 0 };
                    let quants = nibble_quants::<FIFTH>(w.add(Q4K::quants(s, h)), w.add(high));
                    store_sub_group::<false>(&quants, 0, out.add(32 * s * TILE_COLUMNS), h, |_, q| {
                        _mm256_sub_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)), min)
                    });
                }
            }
        }
    }
}

/// Decode `count / 16` k of a Q6_K panel at `w` to `out` (`[k][16]` f32),
/// as `kvjit_core::quant` does: per 16-k block `(d·sc)·(q − 32)`.
///
/// # Safety
/// As for [`dequantize_nibbles`], for a Q6_K panel (`count / 16` a multiple of
/// 256).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_q6k(w: *const u8, count: usize, out: *mut f32) {
    for g in 0..count / (256 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 4096 of the panel and its 4096
        // outputs.
        unsafe {
            let w = w.add(g * Q6K::GROUP_BYTES);
            let out = out.add(g * 256 * TILE_COLUMNS);
            for h in 0..2 {
                let d = f16x8(w.add(Q6K_D + 16 * h));
                for s in 0..8 {
                    let quants = q6_quants(w.add(Q6K::quants(s, h)), w.add(Q6K::high(s, h)));
                    // Each 16-k block's scale: that of vectors 2b and 2b + 1.
                    let scales: [__m256; 2] = std::array::from_fn(|b| {
                        let sc =
                            _mm256_cvtepi8_epi32(_mm_loadl_epi64(w.add(Q6K_SCALES + 16 * (2 * s + b) + 8 * h).cast()));
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc))
                    });
                    store_sub_group::<true>(&quants, 32, out.add(32 * s * TILE_COLUMNS), h, |g, q| {
                        _mm256_mul_ps(scales[g / 2], _mm256_cvtepi32_ps(q))
                    });
                }
            }
        }
    }
}

/// Decode `count / 16` k of a q8_kmin panel at `w` to `out` (`[k][16]`
/// f32), as `kvjit_core::quant` does: per 16 k `S·(v + 128) − M` rounded
/// once (`S = d·sc`, `M = dmin·m`, `v` the stored i8).
///
/// # Safety
/// As for [`dequantize_nibbles`], for a q8_kmin panel (`count / 16` a
/// multiple of 256).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_q8kmin(w: *const u8, count: usize, out: *mut f32) {
    let bias = _mm256_set1_epi32(128);
    for g in 0..count / (256 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 4096 of the panel and its 4096
        // outputs.
        unsafe {
            let w = w.add(g * Q8KMin::GROUP_BYTES);
            let out = out.add(g * 256 * TILE_COLUMNS);
            for h in 0..2 {
                let (d, dmin) = (f16x8(w.add(16 * h)), f16x8(w.add(Q8KMIN_DMIN + 16 * h)));
                for i in 0..16 {
                    let row = 16 * i + 8 * h;
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(w.add(Q8KMIN_SCALES + row).cast()));
                    let m = _mm256_cvtepi16_epi32(_mm_loadu_si128(w.add(Q8KMIN_MINS + 2 * row).cast()));
                    let scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                    let min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
                    // 16 k: vectors 4·(i % 2) .. +4 of sub-group i / 2.
                    for v in 4 * (i % 2)..4 * (i % 2) + 4 {
                        let at = Q8KMIN_QUANTS + 512 * (i / 2) + 256 * h + 32 * v;
                        let q = _mm256_loadu_si256(w.add(at).cast());
                        for (j, q) in dword_bytes::<true>(q).into_iter().enumerate() {
                            let q = _mm256_cvtepi32_ps(_mm256_add_epi32(q, bias));
                            let k = 32 * (i / 2) + 4 * v + j;
                            _mm256_storeu_ps(out.add(k * TILE_COLUMNS + 8 * h), _mm256_fmsub_ps(scale, q, min));
                        }
                    }
                }
            }
        }
    }
}

pub(super) fn dequantize(format: DType) -> Option<WidenBlock> {
    Some(match format {
        DType::Q4_0 => dequantize_nibbles::<false, false>,
        DType::Q4_1 => dequantize_nibbles::<true, false>,
        DType::Q5_0 => dequantize_nibbles::<false, true>,
        DType::Q5_1 => dequantize_nibbles::<true, true>,
        DType::Q8_0 => dequantize_q8::<false>,
        DType::Iq4Nl => dequantize_iq4nl,
        DType::Q8Min => dequantize_q8::<true>,
        DType::Q4K => dequantize_k4::<false>,
        DType::Q5K => dequantize_k4::<true>,
        DType::Q6K => dequantize_q6k,
        DType::Q8KMin => dequantize_q8kmin,
        _ => return None,
    })
}

/// [`super::quantize_activations`] with AVX2: per block of 32, `max|x|`
/// across 4 vectors, `x / s` by `vdivps` (the same IEEE quotient as the
/// scalar code), rounded half away from zero (truncate, then a step away
/// from zero where the exact remainder is at least a half) and clamped to
/// ±32258 as `Q`; `q_hi = round(Q / 254)` the same way (exact: `Q / 254`
/// is either a tie, exact in f32, or at least 1/254 from one, far more
/// than the quotient's rounding), `q_lo = Q − 254·q_hi` (exact in f32);
/// both packed to i8.
///
/// # Safety
/// `out` holds [`Q8_ACTIVATION_BLOCK_BYTES`] per 32 values of `x`; the CPU
/// has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_activations(x: &[f32], out: &mut [u8]) {
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let round = |v: __m256| {
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let rest = _mm256_sub_ps(v, t);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(rest, half), one);
        let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(rest, _mm256_sub_ps(_mm256_setzero_ps(), half)), one);
        _mm256_sub_ps(_mm256_add_ps(t, up), down)
    };
    let (limit, step) = (_mm256_set1_ps(Q_MAX as f32), _mm256_set1_ps(254.0));
    // i32 → i16 → i8 packs interleave 128-bit lanes: dwords come out in
    // the order 0, 4, 1, 5, 2, 6, 3, 7.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let pack = |q: [__m256i; 4]| {
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_permutevar8x32_epi32(bytes, order)
    };
    let hsum = |v: __m256i| {
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
        _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32::<1>(v)))
    };
    for (x, out) in x.chunks_exact(32).zip(out.chunks_exact_mut(Q8_ACTIVATION_BLOCK_BYTES)) {
        // SAFETY: 4 × 8 f32 of the 32 in this chunk.
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
        let abs = v.map(|v| _mm256_and_ps(v, magnitude));
        let max = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let max = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps::<1>(max));
        let max = _mm_max_ps(max, _mm_movehl_ps(max, max));
        let amax = _mm_cvtss_f32(_mm_max_ss(max, _mm_shuffle_ps::<1>(max, max)));
        let scale = amax / Q_MAX as f32;
        let (q, hi, lo): ([__m256i; 4], [__m256i; 4], [__m256i; 4]) = if scale == 0.0 {
            let zero = [_mm256_setzero_si256(); 4];
            (zero, zero, zero)
        } else {
            let s = _mm256_set1_ps(scale);
            let q = v.map(|v| {
                let q = round(_mm256_div_ps(v, s));
                _mm256_max_ps(_mm256_min_ps(q, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit))
            });
            let hi = q.map(|q| round(_mm256_div_ps(q, step)));
            (
                q.map(|q| _mm256_cvtps_epi32(q)),
                hi.map(|h| _mm256_cvtps_epi32(h)),
                std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_fnmadd_ps(hi[i], step, q[i]))),
            )
        };
        let first16 = hsum(_mm256_add_epi32(q[0], q[1]));
        let sum = first16 + hsum(_mm256_add_epi32(q[2], q[3]));
        // SAFETY: 32 + 32 + 4 · 4 bytes of this chunk of out.
        unsafe {
            let o = out.as_mut_ptr();
            _mm256_storeu_si256(o.cast(), pack(hi));
            _mm256_storeu_si256(o.add(32).cast(), pack(lo));
            o.add(64).cast::<f32>().write_unaligned(scale);
            o.add(68).cast::<i32>().write_unaligned(sum);
            o.add(72).cast::<i32>().write_unaligned(first16);
            o.add(76).cast::<f32>().write_unaligned(scale * sum as f32);
        }
    }
}
