//! The 512-bit integer GEMV tiles of [`super`] (AVX512-F, AVX512-BW and
//! AVX512-VNNI), one for every block format:
//! a panel's 16 columns in one zmm register instead of two ymm halves, so
//! each activation dword is broadcast, each weight vector unpacked and each
//! `vpdpbusd`, scale conversion and FMA issued once per 16 columns instead
//! of twice.
//!
//! Why: on the Intel Xeon these tiles were written on (Emerald Rapids, two
//! vCPUs), the ymm tiles of the 4-bit formats run their ALU work at about
//! twice the rate a core streams from DRAM (Q4_1 ~29 GB/s in L2 against
//! ~15.7 GB/s per core), and that half-busy core reads DRAM at 75–79 % of
//! the read roof where bf16's lighter GEMV reads at 94–98 %. Halving the
//! instructions per weight is what lets the stream run at the roof.
//!
//! Each k-group's vector `g` joins half 0's vector (columns 0–7) and half
//! 1's (8–15) of the packed panel ([`crate::quant`]'s layout, unchanged):
//! lane `c` is column `c`. The arithmetic is the ymm tiles' lane for lane —
//! the same exact integer sums, then the same f32 operations in the same
//! order (`add16` mirrors each format's `add`) — so a zmm tile's output is
//! bit for bit the ymm tiles' (tested). Two integer shortcuts, both exact:
//! a Q4 vector's high nibbles multiply in place (`v & 0xF0`, 16·q) and
//! their i32 sum is shifted right by 4 (every product is a multiple of
//! 16); `254·hi` is two shifts and a subtraction.

use std::arch::x86_64::*;

use kvjit_core::DType;

use super::{
    Activations, GemvFormat, IQ4_LEVELS_BIASED, Iq4Nl, PREFETCH_BYTES, Q4_0, Q4_1, Q4K, Q4K_D, Q4K_DMIN, Q5, Q5_D,
    Q5_M, Q5K, Q6K, Q6K_D, Q6K_SCALES, Q8_0, Q8_ACTIVATION_BLOCK_BYTES, Q8KMIN_DMIN, Q8KMIN_MINS, Q8KMIN_SCALES,
    Q8KMin, Q8Min, Quants,
};
use crate::microkernel::GemmTile;

/// A block's activation quants as the zmm tiles read them: `[hi, lo]`,
/// each the block's 8 dwords of i8 quants broadcast to all 16 lanes.
type Xs16 = [[__m512i; 8]; 2];

/// A GEMV format with a zmm tile: the f32 step of a whole 32-k sub-group
/// (both halves of the panel at once).
trait ZmmFormat: GemvFormat {
    /// `acc += Σ x·w` for sub-group `s` of the k-group at `w` (its unpacked
    /// `scales`) from the 16 columns' exact integer sums `dots` (`[Σ, _]`,
    /// or the two 16-k halves' of Q6_K and q8_kmin) against the activation
    /// block `x`: [`GemvFormat::add`]'s operations, lane for lane.
    ///
    /// # Safety
    /// `w` readable for `GROUP_BYTES`; the CPU has AVX512-F, AVX512-BW and AVX512-VNNI.
    unsafe fn add16(
        w: *const u8,
        scales: &Self::Scales,
        s: usize,
        dots: [__m512i; 2],
        x: &Activations,
        acc: &mut __m512,
    );
}

/// The 16 f16 at `p` as f32.
///
/// # Safety
/// `p` readable for 32 bytes; AVX512-F.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn f16x16(p: *const u8) -> __m512 {
    // SAFETY: the caller's 32 bytes.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// [`super::add_scaled`] for 16 columns: `acc += s_x·d·dot` (and
/// `+ m·(s_x·ΣQ)` with the 16 f16 `m` at `m_at`).
///
/// # Safety
/// `w` readable for the 16 f16 `d` at `d_at` (and `m` at `m_at`); AVX512-F.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn add_scaled16(
    w: *const u8,
    d_at: usize,
    m_at: Option<usize>,
    dot: __m512i,
    x: &Activations,
    acc: &mut __m512,
) {
    // SAFETY: the caller's 32 bytes at d_at.
    let scale = _mm512_mul_ps(unsafe { f16x16(w.add(d_at)) }, _mm512_set1_ps(x.dx));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
    if let Some(m_at) = m_at {
        // SAFETY: the caller's 32 bytes at m_at.
        let m = unsafe { f16x16(w.add(m_at)) };
        *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum), *acc);
    }
}

impl ZmmFormat for Q4_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), _s: usize, [dot, _]: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // value = d·(q − 8): Σ Q·(q_w − 8) = Σ Q·q_w − 8·ΣQ.
        let dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * x.sum));
        // SAFETY: the group's 16 scales.
        unsafe { add_scaled16(w, 256, None, dot, x, acc) }
    }
}

impl ZmmFormat for Q4_1 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), _s: usize, [dot, _]: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // SAFETY: the group's 16 scales and 16 minimums.
        unsafe { add_scaled16(w, 256, Some(288), dot, x, acc) }
    }
}

impl ZmmFormat for Q8_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), _s: usize, [dot, _]: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // SAFETY: the group's 16 scales.
        unsafe { add_scaled16(w, 512, None, dot, x, acc) }
    }
}

impl ZmmFormat for Q8Min {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), _s: usize, [dot, _]: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // As Q8Min's `add`: the 128·ΣQ the i8 quants leave out added back.
        let dot = _mm512_add_epi32(dot, _mm512_set1_epi32(128 * x.sum));
        // SAFETY: the group's 16 scales and 16 minimums.
        unsafe { add_scaled16(w, 512, Some(544), dot, x, acc) }
    }
}

impl ZmmFormat for Q4K {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(
        w: *const u8,
        scales: &[u8; 256],
        s: usize,
        [dot, _]: [__m512i; 2],
        x: &Activations,
        acc: &mut __m512,
    ) {
        // As Q4K's `add`: value = (d·sc)·q − dmin·m.
        // SAFETY: the group's 16 d and 16 dmin, and row s of the unpacked
        // scales and minimums.
        let (d, dmin, sc, m) = unsafe {
            let p = scales.as_ptr().add(16 * s);
            (
                f16x16(w.add(Q4K_D)),
                f16x16(w.add(Q4K_DMIN)),
                _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())),
                _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(128).cast())),
            )
        };
        let scale = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), _mm512_set1_ps(x.dx));
        let min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
        *acc = _mm512_fnmadd_ps(min, _mm512_set1_ps(x.dx * x.sum as f32), *acc);
    }
}

impl<const MIN: bool> ZmmFormat for Q5<MIN> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), _s: usize, [dot, _]: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // As Q5's `add`: Q5_0 takes 16·ΣQ off.
        let dot = match MIN {
            true => dot,
            false => _mm512_sub_epi32(dot, _mm512_set1_epi32(16 * x.sum)),
        };
        // SAFETY: the group's 16 scales (and 16 minimums).
        unsafe { add_scaled16(w, Q5_D, MIN.then_some(Q5_M), dot, x, acc) }
    }
}

impl ZmmFormat for Iq4Nl {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), _s: usize, [dot, _]: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // SAFETY: the group's 16 scales.
        unsafe { add_scaled16(w, 256, None, dot, x, acc) }
    }
}

impl ZmmFormat for Q5K {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, scales: &[u8; 256], s: usize, dots: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // SAFETY: Q4_K's d, dmin and scale rows, at the same place.
        unsafe { Q4K::add16(w, scales, s, dots, x, acc) }
    }
}

impl ZmmFormat for Q6K {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), s: usize, dots: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // As Q6K's `add`: (d·sc)·(q − 32) per 16 k.
        let sums = [x.first16, x.sum - x.first16];
        // SAFETY: the group's 16 d.
        let d = unsafe { f16x16(w.add(Q6K_D)) };
        let dx = _mm512_set1_ps(x.dx);
        for t in 0..2 {
            // SAFETY: scale row 2s + t < 16 of the group (16 i8).
            let sc = unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(w.add(Q6K_SCALES + 16 * (2 * s + t)).cast())) };
            let scale = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), dx);
            let dot = _mm512_sub_epi32(dots[t], _mm512_set1_epi32(32 * sums[t]));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
        }
    }
}

impl ZmmFormat for Q8KMin {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn add16(w: *const u8, _: &(), s: usize, dots: [__m512i; 2], x: &Activations, acc: &mut __m512) {
        // As Q8KMin's `add`: S·(v + 128) − M per 16 k.
        let sums = [x.first16, x.sum - x.first16];
        // SAFETY: the group's 16 d and 16 dmin.
        let (d, dmin) = unsafe { (f16x16(w), f16x16(w.add(Q8KMIN_DMIN))) };
        let dx = _mm512_set1_ps(x.dx);
        for t in 0..2 {
            let row = 16 * (2 * s + t);
            // SAFETY: row 2s + t < 16 of the group's scales (16 i8) and
            // minimums (16 i16).
            let (sc, m) = unsafe {
                (
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(w.add(Q8KMIN_SCALES + row).cast())),
                    _mm512_cvtepi16_epi32(_mm256_loadu_si256(w.add(Q8KMIN_MINS + 2 * row).cast())),
                )
            };
            let scale = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), dx);
            let min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
            let dot = _mm512_add_epi32(dots[t], _mm512_set1_epi32(128 * sums[t]));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
            *acc = _mm512_fnmadd_ps(min, _mm512_set1_ps(x.dx * sums[t] as f32), *acc);
        }
    }
}

/// The 32 bytes at `low` (columns 0–7) and the 32 at `high` (8–15) as one
/// vector.
///
/// # Safety
/// Both readable for 32 bytes; AVX512-F.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn both_halves(low: *const u8, high: *const u8) -> __m512i {
    // SAFETY: the caller's bytes.
    unsafe {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(low.cast())), _mm256_loadu_si256(high.cast()))
    }
}

/// `254·hi + lo` in i32 lanes (exact: the callers' |hi| ≤ 32·255·127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn combine16(hi: __m512i, lo: __m512i) -> __m512i {
    _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32::<8>(hi), _mm512_slli_epi32::<1>(hi)), lo)
}

/// A Q4 sub-group's `Σ_k q_w·Q` for the 16 columns: the 4 quant vectors
/// of half 0 at `q0` and of half 1 at `q1` against `xs`. The high nibbles
/// multiply as `16·q` (`v & 0xF0`, ≤ 240, each `vpdpbusd` adding at most
/// 4·240·127 a lane) and their sum is divided by 16 exactly.
///
/// # Safety
/// `q0` and `q1` readable for 128 bytes; AVX512-F, AVX512-BW and AVX512-VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn q4(q0: *const u8, q1: *const u8, xs: &Xs16) -> __m512i {
    let (low_mask, high_mask) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0xf0u8 as i8));
    // [part][nibble]
    let mut sums = [[_mm512_setzero_si512(); 2]; 2];
    for g in 0..4 {
        // SAFETY: vector g < 4 of each half's 128 bytes.
        let v = unsafe { both_halves(q0.add(32 * g), q1.add(32 * g)) };
        let (low, high16) = (_mm512_and_si512(v, low_mask), _mm512_and_si512(v, high_mask));
        for (sums, xs) in sums.iter_mut().zip(xs) {
            sums[0] = _mm512_dpbusd_epi32(sums[0], low, xs[2 * g]);
            sums[1] = _mm512_dpbusd_epi32(sums[1], high16, xs[2 * g + 1]);
        }
    }
    let [hi, lo] = sums.map(|s| _mm512_add_epi32(s[0], _mm512_srai_epi32::<4>(s[1])));
    combine16(hi, lo)
}

/// A Q8 sub-group's `Σ_k q_w·Q` for the 16 columns (the i8 quants biased
/// to unsigned, `128·ΣQ` taken off as in the ymm tiles): the 8 quant
/// vectors of half 0 at `q0` and of half 1 at `q1` against `xs`, whose
/// `Q` sum to `sum`.
///
/// # Safety
/// `q0` and `q1` readable for 256 bytes; AVX512-F, AVX512-BW and AVX512-VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn q8(q0: *const u8, q1: *const u8, xs: &Xs16, sum: i32) -> __m512i {
    let bias = _mm512_set1_epi8(i8::MIN);
    // [part][vector parity]: four independent chains.
    let mut sums = [[_mm512_setzero_si512(); 2]; 2];
    for g in 0..8 {
        // SAFETY: vector g < 8 of each half's 256 bytes.
        let v = _mm512_xor_si512(unsafe { both_halves(q0.add(32 * g), q1.add(32 * g)) }, bias);
        for (sums, xs) in sums.iter_mut().zip(xs) {
            sums[g % 2] = _mm512_dpbusd_epi32(sums[g % 2], v, xs[g]);
        }
    }
    let [hi, lo] = sums.map(|s| _mm512_add_epi32(s[0], s[1]));
    _mm512_sub_epi32(combine16(hi, lo), _mm512_set1_epi32(128 * sum))
}

/// A Q8 sub-group's sums per 16-k half (q8_kmin): [`q8`] with vectors
/// 0–3 and 4–7 summed apart, `128·ΣQ` of each half taken off.
///
/// # Safety
/// As for [`q8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn q8_halves(q0: *const u8, q1: *const u8, xs: &Xs16, sums: [i32; 2]) -> [__m512i; 2] {
    let bias = _mm512_set1_epi8(i8::MIN);
    // [16-k half][part]
    let mut parts = [[_mm512_setzero_si512(); 2]; 2];
    for g in 0..8 {
        // SAFETY: vector g < 8 of each half's 256 bytes.
        let v = _mm512_xor_si512(unsafe { both_halves(q0.add(32 * g), q1.add(32 * g)) }, bias);
        for (part, xs) in parts[g / 4].iter_mut().zip(xs) {
            *part = _mm512_dpbusd_epi32(*part, v, xs[g]);
        }
    }
    std::array::from_fn(|t| _mm512_sub_epi32(combine16(parts[t][0], parts[t][1]), _mm512_set1_epi32(128 * sums[t])))
}

/// Multiply a sub-group's quant bytes `quants` (`[g][0]` for k = 8g + j,
/// `[g][1]` for 8g + 4 + j, column dword byte j, lane c column c: as
/// [`super::q5_quants`] lays a half out) with `xs`: `[hi, lo]` sums per
/// 16-k half (vectors 0–1 and 2–3) with `HALVES`, else all in `[0]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn dot_bytes<const HALVES: bool>(quants: &[[__m512i; 2]; 4], xs: &Xs16) -> [[__m512i; 2]; 2] {
    // [16-k half][part]
    let mut sums = [[_mm512_setzero_si512(); 2]; 2];
    for (g, &[low, high]) in quants.iter().enumerate() {
        let t = if HALVES { g / 2 } else { 0 };
        for (sum, xs) in sums[t].iter_mut().zip(xs) {
            *sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*sum, low, xs[2 * g]), high, xs[2 * g + 1]);
        }
    }
    sums
}

/// A Q5 sub-group's `Σ_k q_w·Q` for the 16 columns: the nibbles of half 0
/// at `q0` and half 1 at `q1`, their fifth bits at `b0` and `b1` (each
/// byte's bits 2g and 2g + 1 moved to bit 4 by 16-bit shifts, as
/// [`super::q5_quants`] does).
///
/// # Safety
/// `q0`, `q1` readable for 128 bytes, `b0`, `b1` for 32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn q5(q0: *const u8, q1: *const u8, b0: *const u8, b1: *const u8, xs: &Xs16) -> __m512i {
    let (nibble, fifth) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x10));
    // SAFETY: the caller's bytes.
    let bits = unsafe { both_halves(b0, b1) };
    let moved = [
        [_mm512_slli_epi16::<4>(bits), _mm512_slli_epi16::<3>(bits)],
        [_mm512_slli_epi16::<2>(bits), _mm512_slli_epi16::<1>(bits)],
        [bits, _mm512_srli_epi16::<1>(bits)],
        [_mm512_srli_epi16::<2>(bits), _mm512_srli_epi16::<3>(bits)],
    ];
    let mut quants = [[_mm512_setzero_si512(); 2]; 4];
    for (g, pair) in quants.iter_mut().enumerate() {
        // SAFETY: vector g < 4 of each half's 128 bytes.
        let v = unsafe { both_halves(q0.add(32 * g), q1.add(32 * g)) };
        let low = _mm512_or_si512(_mm512_and_si512(v, nibble), _mm512_and_si512(moved[g][0], fifth));
        let high = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
        *pair = [low, _mm512_or_si512(high, _mm512_and_si512(moved[g][1], fifth))];
    }
    let [[hi, lo], _] = dot_bytes::<false>(&quants, xs);
    combine16(hi, lo)
}

/// An IQ4_NL sub-group's `Σ_k q_w·Q` for the 16 columns: each code of
/// half 0 at `q0` and half 1 at `q1` looked up (`vpshufb`) as its level
/// plus 128 (unsigned), `128·ΣQ` taken off.
///
/// # Safety
/// `q0`, `q1` readable for 128 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn iq4(q0: *const u8, q1: *const u8, xs: &Xs16, sum: i32) -> __m512i {
    // SAFETY: the table's first 16 bytes (its 16 levels), in every 128-bit
    // lane.
    let table = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_LEVELS_BIASED.as_ptr().cast())) };
    let nibble = _mm512_set1_epi8(0x0f);
    let mut levels = [[_mm512_setzero_si512(); 2]; 4];
    for (g, pair) in levels.iter_mut().enumerate() {
        // SAFETY: vector g < 4 of each half's 128 bytes.
        let v = unsafe { both_halves(q0.add(32 * g), q1.add(32 * g)) };
        let (low, high) = (_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble));
        *pair = [_mm512_shuffle_epi8(table, low), _mm512_shuffle_epi8(table, high)];
    }
    let [[hi, lo], _] = dot_bytes::<false>(&levels, xs);
    _mm512_sub_epi32(combine16(hi, lo), _mm512_set1_epi32(128 * sum))
}

/// A Q6_K sub-group's sums per 16-k half for the 16 columns: nibbles of
/// half 0 at `q0` and half 1 at `q1`, high bits at `h0` and `h1`, joined
/// as [`super::q6_quants_ternlog`] does (fields split once into even and
/// odd, one bit-select a byte vector).
///
/// # Safety
/// `q0`, `q1` readable for 128 bytes, `h0`, `h1` for 64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn q6(q0: *const u8, q1: *const u8, h0: *const u8, h1: *const u8, xs: &Xs16) -> [__m512i; 2] {
    // `c ? a : b` per bit, c the nibble mask.
    const SELECT: i32 = 0xe4;
    let nibbles = _mm512_set1_epi8(0x0f);
    // SAFETY: the caller's 64 bytes at h0 and h1.
    let highs = unsafe { [both_halves(h0, h1), both_halves(h0.add(32), h1.add(32))] };
    let fields = highs.map(|high| {
        let (even, odd) =
            (_mm512_and_si512(high, _mm512_set1_epi8(0x33)), _mm512_and_si512(high, _mm512_set1_epi8(0xcc_u8 as i8)));
        // Fields 0, 1, 2, 3 at bits 4–5.
        [_mm512_slli_epi16::<4>(even), _mm512_slli_epi16::<2>(odd), even, _mm512_srli_epi16::<2>(odd)]
    });
    let mut quants = [[_mm512_setzero_si512(); 2]; 4];
    for (g, pair) in quants.iter_mut().enumerate() {
        // SAFETY: vector g < 4 of each half's 128 bytes.
        let v = unsafe { both_halves(q0.add(32 * g), q1.add(32 * g)) };
        let field = &fields[g / 2][2 * (g % 2)..];
        *pair = [
            _mm512_ternarylogic_epi32::<SELECT>(v, field[0], nibbles),
            _mm512_ternarylogic_epi32::<SELECT>(_mm512_srli_epi16::<4>(v), field[1], nibbles),
        ];
    }
    dot_bytes::<true>(&quants, xs).map(|[hi, lo]| combine16(hi, lo))
}

/// The zmm integer GEMV tile of format `F` read in `S` streams: the ymm
/// tiles' schedule (`gemv_body` in [`super`]: the same streams, prefetches
/// and order of sums) with both halves of the panel in one register.
///
/// # Safety
/// `x` readable for K/32 quantized activation blocks (cast), `w` for a
/// packed panel of `F` over `k` (a multiple of `F`'s k-group), `c` readable
/// and writable for 16 f32; the CPU has AVX512-F, AVX512-BW and AVX512-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe extern "C" fn gemv_kernel_zmm<F: ZmmFormat, const S: usize>(
    x: *const f32,
    _x_step: usize,
    w: *const u8,
    k: usize,
    c: *mut f32,
) {
    let x = x.cast::<u8>();
    let subs = F::GROUP_K / 32;
    let part = F::GROUP_BYTES / subs;
    let groups = k / F::GROUP_K;
    let span = groups / S;
    let mut acc = [_mm512_setzero_ps(); S];
    let (stream_bytes, panel_bytes) = (span * F::GROUP_BYTES, groups * F::GROUP_BYTES);
    // Where stream s prefetches while it reads its j-th k-group.
    let ahead = |s: usize, j: usize| {
        let at = j * F::GROUP_BYTES;
        w.wrapping_add(crate::microkernel::stream_prefetch_offset(s, at, PREFETCH_BYTES, stream_bytes, panel_bytes))
    };
    // SAFETY: as the ymm tiles': stream s reads k-groups s·span + j for
    // j < span, the tail streams·span..groups — every k-group < K /
    // GROUP_K of the panel and every 32-k activation block (the quant
    // dwords at 0..64, the scale at 64, the sums at 68 and 72, s·ΣQ at 76),
    // as the caller vouches; prefetches use `wrapping_add` and never fault;
    // the kernel has the features of every function it calls.
    let group = |acc: &mut __m512, g: usize, prefetch_at: *const u8| unsafe {
        let w = w.add(g * F::GROUP_BYTES);
        let scales = F::scales(w);
        for s in 0..subs {
            for line in (s * part..(s + 1) * part).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(prefetch_at.wrapping_add(line).cast());
            }
            let at = x.add((g * subs + s) * Q8_ACTIVATION_BLOCK_BYTES);
            let xs: Xs16 = std::array::from_fn(|part| {
                std::array::from_fn(|i| _mm512_set1_epi32(at.add(32 * part + 4 * i).cast::<i32>().read_unaligned()))
            });
            let block = Activations::read(at);
            let (q0, q1) = (w.add(F::quants(s, 0)), w.add(F::quants(s, 1)));
            let (h0, h1) = (w.add(F::high(s, 0)), w.add(F::high(s, 1)));
            let zero = _mm512_setzero_si512();
            let dots = match F::QUANTS {
                Quants::Q4 => [q4(q0, q1, &xs), zero],
                Quants::Q5 => [q5(q0, q1, h0, h1, &xs), zero],
                Quants::Q8 => [q8(q0, q1, &xs, block.sum), zero],
                Quants::Iq4 => [iq4(q0, q1, &xs, block.sum), zero],
                Quants::Q8Halves => q8_halves(q0, q1, &xs, [block.first16, block.sum - block.first16]),
                Quants::Q6 => q6(q0, q1, h0, h1, &xs),
            };
            F::add16(w, &scales, s, dots, &block, acc);
        }
    };
    for j in 0..span {
        for (s, stream) in acc.iter_mut().enumerate() {
            group(stream, s * span + j, ahead(s, j));
        }
    }
    for g in S * span..groups {
        let prefetch_at = w.wrapping_add(g * F::GROUP_BYTES + PREFETCH_BYTES);
        group(&mut acc[0], g, prefetch_at);
    }
    let mut sum = acc[0];
    for stream in &acc[1..] {
        sum = _mm512_add_ps(sum, *stream);
    }
    // SAFETY: c holds 16 f32.
    unsafe { _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), sum)) };
}

/// The zmm tile of `format` read in `streams` (1, 2 or 4) streams; `None`
/// for other dtypes or counts. The caller checked the CPU has AVX512-F,
/// AVX512-BW and AVX512-VNNI.
pub(super) fn gemv(format: DType, streams: usize) -> Option<GemmTile> {
    macro_rules! pick {
        ($f:ty) => {
            match streams {
                1 => gemv_kernel_zmm::<$f, 1> as GemmTile,
                2 => gemv_kernel_zmm::<$f, 2>,
                4 => gemv_kernel_zmm::<$f, 4>,
                _ => return None,
            }
        };
    }
    Some(match format {
        DType::Q4_0 => pick!(Q4_0),
        DType::Q4_1 => pick!(Q4_1),
        DType::Q8_0 => pick!(Q8_0),
        DType::Q8Min => pick!(Q8Min),
        DType::Q4K => pick!(Q4K),
        DType::Q5_0 => pick!(Q5<false>),
        DType::Q5_1 => pick!(Q5<true>),
        DType::Iq4Nl => pick!(Iq4Nl),
        DType::Q5K => pick!(Q5K),
        DType::Q6K => pick!(Q6K),
        DType::Q8KMin => pick!(Q8KMin),
        _ => return None,
    })
}
