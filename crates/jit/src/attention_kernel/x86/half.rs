//! FP8 decode on f16 products ([`Half`], AVX512-FP16): for an E4M3 cache
//! with one scale per head row (g = D) and D a multiple of 64.
//!
//! Why: the f32 kernel ([`super::Zmm`] with [`super::E4m3Lut`]) widens
//! every code to f32 and spends two 512-bit FMAs per 32 products; on an
//! Intel Xeon (Emerald Rapids) it computes a Llama-3-8B key-head in ~35 ns
//! with its data in L2 and ~38 ns from DRAM, so FP8 decoded only ~1.2× as
//! fast as bf16 although it reads half the bytes. Here a code widens to an
//! f16 (one byte-table lookup, 32 codes a vector instead of 16) and one
//! `vfmadd231ph` does 32 products.
//!
//! **Arithmetic.** Each code widens exactly to the f16 of 2⁻⁸ × its value
//! (`m << 7` for its magnitude `m`, subnormal codes included; the NaN codes
//! an f16 NaN). Each query row is scaled by a power of two into (−1, 1)
//! and rounded to f16 once per call ([`Width::prepare_q`]); each score is
//! 16 lanes of f16 FMA chains of D/16 products each (two keys share an
//! accumulator, one in each 256-bit half), folded in f16 by a
//! transpose-and-add tree of 4 levels, then widened to f32 and scaled back
//! (the row's power of two, the key's scale, 2⁸). Each block's probabilities (times
//! the keys' V scales) are scaled per row by a power of two into [0, 1),
//! rounded to f16 and accumulated in f16 over the block's ≤ 32 keys, then
//! added into the row's f32 `acc`. No f16 value can overflow: the scaled
//! q and p are below 1 (below 4 for magnitudes from 2¹²⁶ on, where the
//! power of two is clamped) and |code·2⁻⁸| ≤ 1.75, so a score's partial
//! sums stay below 7·D and a block's P·V sums below 224. With u = 2⁻¹¹ (f16's unit roundoff), each
//! product of a score passes through at most D/16 + 4 roundings (its lane's
//! FMA chain, the tree) after q's own, so a score is off by at most
//! (D/16 + 6)·u·Σ|q_i·k_i| (one u to spare for the f32 steps), plus up to
//! 2⁻²⁵ (half an f16 subnormal step) at each of the 16·(D/16 + 5) roundings
//! when partial sums are that small; a block's P·V by (n + 2)·u·Σ p_j·|v_j|
//! ≤ 34·u·Σ p_j·|v_j| (p's rounding, the n-key chain). A few parts in a
//! thousand, below the E4M3 rounding of the values themselves (up to 2⁻⁴
//! each).

use std::arch::x86_64::*;

use super::{Ahead, E4M3_UNIT, E4m3, Elem, KB, Rows, Shape, Weights, Width, softmax_zmm};

/// E4M3 codes widened to f16 64 at a time for the [`Half`] width; a
/// vector of 32 holds elements `[0..8, 16..24, 32..40, 48..56]` or `[8..16,
/// 24..32, 40..48, 56..64]` of each 64 (the byte unpacks' order), so q and
/// `acc` are kept in that order ([`half_order64`]). Its f32 widenings (the
/// [`Elem`] and [`Weights`] methods) are [`E4m3`]'s, for the trait; the
/// [`Half`] width never calls them.
pub(super) struct E4m3Half;

impl Weights for E4m3Half {
    const BYTES: usize = 1;
    natural!(load8 of E4m3);
}

impl Elem for E4m3Half {
    const SCALED: bool = true;
    const PERMUTED: bool = true;
    const GRANULE: usize = 64;

    fn permute(values: &mut [f32], back: bool) {
        half_order64(values, back);
    }

    natural!(widen16 of E4m3);
}

/// Every 64 values from their natural order into [`E4m3Half`]'s (`back`:
/// the reverse): 8-value runs exchanged between the four vectors of 16.
fn half_order64(values: &mut [f32], back: bool) {
    // SAFETY: the callers run on a CPU with AVX-512F (this width's).
    unsafe { half_order64_zmm(values, back) }
}

/// [`half_order64`]: per 64 values, vectors (a, b, c, d) of 16 become
/// (a.lo b.lo, c.lo d.lo, a.hi b.hi, c.hi d.hi), 8-value halves; back,
/// (w, x, y, z) become (w.lo y.lo, w.hi y.hi, x.lo z.lo, x.hi z.hi).
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn half_order64_zmm(values: &mut [f32], back: bool) {
    let low: [i32; 16] = std::array::from_fn(|i| if i < 8 { i as i32 } else { i as i32 + 8 });
    let high: [i32; 16] = std::array::from_fn(|i| if i < 8 { i as i32 + 8 } else { i as i32 + 16 });
    // SAFETY: each array holds 16 i32.
    let (low, high) = unsafe { (_mm512_loadu_si512(low.as_ptr().cast()), _mm512_loadu_si512(high.as_ptr().cast())) };
    // Which input vectors each output vector joins, and which halves.
    let plan = match back {
        false => [(0, 1, low), (2, 3, low), (0, 1, high), (2, 3, high)],
        true => [(0, 2, low), (0, 2, high), (1, 3, low), (1, 3, high)],
    };
    for group in values.chunks_exact_mut(64) {
        let at = group.as_mut_ptr();
        // SAFETY: the group holds 64 f32.
        unsafe {
            let v: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(at.add(16 * i)));
            for (o, &(a, b, halves)) in plan.iter().enumerate() {
                _mm512_storeu_ps(at.add(16 * o), _mm512_permutex2var_ps(v[a], halves, v[b]));
            }
        }
    }
}

/// The high bytes of the f16 bit patterns of 2⁻⁸ × each E4M3 magnitude
/// `m < 128`: `m << 7` has high byte `m >> 1`; 0x7f (NaN) gives 0x7e, an
/// f16 NaN whatever the low byte.
static E4M3_F16_HIGH: [u8; 128] = {
    let mut bytes = [0u8; 128];
    let mut m = 0;
    while m < 128 {
        bytes[m] = if m == 0x7f { 0x7e } else { (m >> 1) as u8 };
        m += 1;
    }
    bytes
};

/// The two 64-byte halves of [`E4M3_F16_HIGH`] (a `vpermt2b` table).
#[inline]
#[target_feature(enable = "avx512f")]
fn f16_high_table() -> [__m512i; 2] {
    // SAFETY: the table holds 128 bytes.
    unsafe {
        [_mm512_loadu_si512(E4M3_F16_HIGH.as_ptr().cast()), _mm512_loadu_si512(E4M3_F16_HIGH[64..].as_ptr().cast())]
    }
}

/// The 64 codes at `p` as 2⁻⁸ × their values in f16, in [`E4m3Half`]'s
/// order ([`widen_codes`]).
///
/// # Safety
/// `p` readable for 64 bytes; AVX-512F, BW, VBMI and FP16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512fp16")]
unsafe fn widen64(p: *const u8, table: [__m512i; 2]) -> [__m512h; 2] {
    // SAFETY: the caller guarantees 64 readable codes at `p`.
    widen_codes(unsafe { _mm512_loadu_si512(p.cast()) }, table)
}

/// 64 codes as 2⁻⁸ × their values in f16, each 128-bit lane's 16 codes as
/// its low 8 (first vector) and high 8 (second): the high byte from the
/// table (`vpermt2b` on the 7 magnitude bits) with the sign OR-ed in, the
/// low byte the magnitude's bit 0 at bit 7, joined by the byte unpacks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512fp16")]
fn widen_codes(codes: __m512i, [t0, t1]: [__m512i; 2]) -> [__m512h; 2] {
    let sign = _mm512_set1_epi8(0x80_u8 as i8);
    let high = _mm512_ternarylogic_epi32::<0xf8>(_mm512_permutex2var_epi8(t0, codes, t1), codes, sign);
    // Bit 0 of each byte to its bit 7 (what a 16-bit shift carries into
    // an odd byte's low bits is masked off).
    let low = _mm512_and_si512(_mm512_slli_epi16::<7>(codes), sign);
    [_mm512_castsi512_ph(_mm512_unpacklo_epi8(low, high)), _mm512_castsi512_ph(_mm512_unpackhi_epi8(low, high))]
}

/// The power of two `c` that scales values of largest magnitude `max`
/// into [0.5, 1) (`max` finite and nonzero; else 1), clamped so c and 1/c
/// are normal f32: from 2¹²⁶ on `max·c` lands in [0.5, 4), which f16 holds
/// as well.
fn unit_scale(max: f32) -> f32 {
    if !max.is_finite() || max == 0.0 {
        return 1.0;
    }
    // max ∈ [2^e, 2^(e+1)): c = 2^−(e+1), e from the exponent field
    // (subnormals as 2^−126).
    let e = ((max.to_bits() >> 23) & 0xff).max(1) as i32 - 127;
    let shift = -(e + 1).clamp(-126, 126);
    f32::from_bits(((shift + 127) as u32) << 23)
}

/// The f16 products' width: the [`super::Zmm`] softmax between scores and
/// P·V on f16 vectors of 32 (see the module docs). Serves [`E4m3Half`]
/// only (FP8, g = D, D a multiple of 64), on a CPU with AVX-512F, BW,
/// VBMI and FP16.
pub(super) struct Half;

impl Width for Half {
    fn prepare_q(q: &mut [f32], head_size: usize) {
        // SAFETY: the caller picked this width on a CPU with AVX-512F and
        // FP16 (`super::super::half_available`).
        unsafe { prepare_q(q, head_size) }
    }

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
        // PERMUTED: the driver copies q (and so calls `prepare_q`) only
        // for a type in an order of its own.
        const {
            assert!(
                E::SCALED && E::GRANULE == 64 && E::PERMUTED,
                "the f16 width reads FP8 codes, 64 a step, q prepared"
            )
        };
        // SAFETY: the caller's bounds, q prepared by `prepare_q`; the
        // caller picked this width on a CPU with its features.
        unsafe { scores_half::<R>(q, rows, n, sh, out, ahead) }
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
        const { assert!(E::SCALED && E::GRANULE == 64, "the f16 width reads FP8 codes, 64 a step") };
        // SAFETY: as for `scores`.
        unsafe { pv_half::<R>(acc, rows, n, sh, p, ahead) }
    }
}

/// Each tile of 4 query rows of `head_size` f32 (in [`E4m3Half`]'s order)
/// rewritten in place as the [`Half`] scores read it: row r's values
/// times its [`unit_scale`] `c_r`, in f16, at bytes `2·D·r ..`, and the
/// four `1/c_r` as f32 at bytes `8·D ..` (f32 index `2·D + r`).
///
/// # Safety
/// `q` holds whole tiles; D a multiple of 16; AVX-512F and FP16.
#[target_feature(enable = "avx512f,avx512bw,avx512fp16,avx2,fma,f16c")]
unsafe fn prepare_q(q: &mut [f32], head_size: usize) {
    let d = head_size;
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    for tile in q.chunks_exact_mut(4 * d) {
        let at = tile.as_mut_ptr();
        let mut unscale = [1f32; 4];
        for (r, back) in unscale.iter_mut().enumerate() {
            // The row's largest magnitude (NaN lanes left out: `max`
            // returns its second operand on a NaN).
            let mut max = _mm512_setzero_ps();
            for i in 0..d / 16 {
                // SAFETY: 16 f32 of row r.
                let v = unsafe { _mm512_loadu_ps(at.add(d * r + 16 * i)) };
                max = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude)), max);
            }
            let c = unit_scale(_mm512_reduce_max_ps(max));
            *back = 1.0 / c;
            // In place: f16 chunk i (bytes 4·d·r + 32i ..) only covers f32
            // already read (row r's own chunks ≤ i, or earlier rows).
            let out = at.cast::<u16>();
            for i in 0..d / 16 {
                // SAFETY: 16 f32 in row r, 16 f16 out inside the tile.
                unsafe {
                    let v = _mm512_mul_ps(_mm512_loadu_ps(at.add(d * r + 16 * i)), _mm512_set1_ps(c));
                    let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                    _mm256_storeu_si256(out.add(d * r + 16 * i).cast(), h);
                }
            }
        }
        // f32 index 2·d + r: inside row 2, read above.
        tile[2 * d..2 * d + 4].copy_from_slice(&unscale);
    }
}

/// Keys per score pass for R rows: 16 accumulators of two keys each
/// ([`reduce32_half`]), R·keys ≤ 32 (R = 3: 24 of them).
const fn keys_per_pass(rows: usize) -> usize {
    match rows {
        1 => 32,
        2 => 16,
        _ => 8,
    }
}

/// The sum [`reduce32_half`] leaves in lane i of vector m for its input
/// sum `s` (vector s / 2, 256-bit half s % 2), as a logical index
/// `16m + i`: the tree's transpose, so each accumulator is assigned the
/// two logical sums that come out in order.
const fn logical_sum(s: usize) -> usize {
    16 * (s / 16) + 4 * (s % 4) + (s % 16) / 4
}

/// Which accumulator takes row r's key pair p — keys `(key, key + 4)`,
/// `key = 8·(p / 4) + p % 4` — with `keys` keys a pass: the one whose
/// first half [`logical_sum`] maps to `r·keys + key` (its second half is
/// then `r·keys + key + 4`). Indexed `[r][p]`; a constant table, so the
/// unrolled loops index registers.
const fn accumulators(keys: usize) -> [[usize; 16]; 4] {
    let mut table = [[0; 16]; 4];
    let mut vec = 0;
    while vec < 16 {
        let logical = logical_sum(2 * vec);
        let (r, key) = (logical / keys, logical % keys);
        if r < 4 {
            table[r][4 * (key / 8) + key % 8] = vec;
        }
        vec += 1;
    }
    table
}

/// For each of [`reduce32_half`]'s two output vectors, the row of each
/// lane's logical sum (`(16m + i) / keys`) and which lanes are live (below
/// R·keys).
const fn lane_rows(keys: usize, rows: usize) -> [([i32; 16], u16); 2] {
    let mut out = [([0; 16], 0); 2];
    let mut m = 0;
    while m < 2 {
        let mut i = 0;
        while i < 16 {
            let logical = 16 * m + i;
            if logical < rows * keys {
                out[m].0[i] = (logical / keys) as i32;
                out[m].1 |= 1 << i;
            }
            i += 1;
        }
        m += 1;
    }
    out
}

/// [`Width::scores`] on f16 products: per pass `keys` keys × R rows, each
/// accumulator two keys' 32-lane f16 FMA chains side by side (the 32 codes
/// of a 32-element piece of D of keys j and j + 4 in one vector, q's piece
/// broadcast to both halves), the R·keys sums by [`reduce32_half`], scaled
/// back to f32.
///
/// # Safety
/// As [`super::scores`]'s, with q a tile prepared by [`prepare_q`], the
/// rows FP8 codes with one scale each (g = D), D a multiple of 64;
/// AVX-512F, BW, VBMI and FP16.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512fp16,avx2,fma,f16c")]
unsafe fn scores_half<const R: usize>(
    q: *const f32,
    rows: &Rows,
    n: usize,
    sh: Shape,
    out: &mut [[f32; KB]; R],
    ahead: &mut Ahead,
) {
    let keys = keys_per_pass(R);
    let accumulator = const { accumulators(keys_per_pass(R)) };
    let table = f16_high_table();
    let q16 = q.cast::<u16>();
    // Logical sum L = r·keys + key (lane L % 16 of vector L / 16): row r's
    // factor back (the prepared tile's four f32 at index 2·D) times 2⁸;
    // lanes past R·keys 0.
    // SAFETY: the prepared tile's row factors.
    let factors = _mm512_castps128_ps512(_mm_mul_ps(unsafe { _mm_loadu_ps(q.add(2 * sh.d)) }, _mm_set1_ps(E4M3_UNIT)));
    let row_factors: [__m512; 2] = std::array::from_fn(|m| {
        let (rows, live) = const { lane_rows(keys_per_pass(R), R) }[m];
        // SAFETY: 16 i32 lane indices < 4.
        _mm512_maskz_permutexvar_ps(live, unsafe { _mm512_loadu_si512(rows.as_ptr().cast()) }, factors)
    });
    // The block's K scales (one per key: g = D); keys past n repeat the last.
    // SAFETY: each key's K scale row.
    let k_scales: [f32; KB] = std::array::from_fn(|j| unsafe { *rows.ks(j) });
    let per_pass = ahead.per_visit(KB / keys);
    let mut j0 = 0;
    while j0 < n {
        ahead.step(false, per_pass);
        let mut acc = [_mm512_setzero_ph(); 16];
        for piece in 0..sh.d / 32 {
            // q's 16 f16 of this piece in each half: the low and high
            // unpack's elements ([`E4m3Half`]'s order: vector p / 32 of its
            // 64-group, 256-bit half p % 2).
            let at = 64 * (piece / 2) + 16 * (piece % 2);
            let mut qv = [[_mm512_setzero_ph(); 2]; R];
            for (r, halves) in qv.iter_mut().enumerate() {
                for (h, half) in halves.iter_mut().enumerate() {
                    // SAFETY: row r's f16 at at + 32h .. at + 32h + 16 < D.
                    *half = _mm512_castsi512_ph(_mm512_broadcast_i64x4(unsafe {
                        _mm256_loadu_si256(q16.add(sh.d * r + at + 32 * h).cast())
                    }));
                }
            }
            for pair in 0..keys / 2 {
                // Keys (key, key + 4) with key % 8 < 4.
                let key = 8 * (pair / 4) + pair % 4;
                // SAFETY: j0 + key + 4 < KB (KB a multiple of keys); each
                // row holds D codes, 32·piece + 32 ≤ D.
                let [low, high] = unsafe {
                    let (a, b) = (rows.k(j0 + key).add(32 * piece), rows.k(j0 + key + 4).add(32 * piece));
                    let codes = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(a.cast())),
                        _mm256_loadu_si256(b.cast()),
                    );
                    widen_codes(codes, table)
                };
                for (r, [q_low, q_high]) in qv.iter().enumerate() {
                    let a = &mut acc[accumulator[r][pair]];
                    *a = _mm512_fmadd_ph(*q_high, high, _mm512_fmadd_ph(*q_low, low, *a));
                }
            }
        }
        let sums = reduce32_half(&acc);
        let mut lanes = [0f32; 32];
        for (m, (sum, factor)) in sums.into_iter().zip(row_factors).enumerate() {
            // Lane i of vector m: key (16m + i) % keys.
            // SAFETY: k_scales[j0 .. j0 + keys], j0 + keys ≤ KB; 16 f32 out.
            unsafe {
                let at = k_scales.as_ptr().add(j0);
                let key_scales = match keys {
                    8 => _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(at.cast()))),
                    16 => _mm512_loadu_ps(at),
                    _ => _mm512_loadu_ps(at.add(16 * m)),
                };
                _mm512_storeu_ps(lanes.as_mut_ptr().add(16 * m), _mm512_mul_ps(sum, _mm512_mul_ps(factor, key_scales)));
            }
        }
        for (r, row) in out.iter_mut().enumerate() {
            row[j0..j0 + keys].copy_from_slice(&lanes[r * keys..(r + 1) * keys]);
        }
        j0 += keys;
    }
}

/// The 32 sums of the 16-lane halves (256 bits) of each `v[i]` — sum
/// `s = 2i + half` — as the f32 lanes of two vectors: lane i of vector m
/// holds sum `16m + 4·(i % 4) + i / 4` (see [`logical_sum`]). A
/// transpose-and-add tree in f16 (128-bit quarters, 64- and 32-bit
/// pieces, then the two halves of each 32-bit piece), widened at the end.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
fn reduce32_half(v: &[__m512h; 16]) -> [__m512; 2] {
    let add =
        |a: __m512i, b: __m512i| _mm512_castph_si512(_mm512_add_ph(_mm512_castsi512_ph(a), _mm512_castsi512_ph(b)));
    let t = |k: usize| _mm512_castph_si512(v[k]);
    // Quarter t of w[i]: sum 4i + t folded to 8 lanes.
    let w: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (t(2 * i), t(2 * i + 1));
        add(_mm512_shuffle_i64x2::<0x88>(a, b), _mm512_shuffle_i64x2::<0xdd>(a, b))
    });
    // Quarter t of z[k]: sums 8k + t and 8k + 4 + t, 4 lanes each.
    let z: [__m512i; 4] = std::array::from_fn(|k| {
        let (a, b) = (w[2 * k], w[2 * k + 1]);
        add(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    });
    // 32-bit piece c of quarter t of vector m: sum 16m + 4c + t, 2 lanes.
    std::array::from_fn(|m| {
        let (z0, z1) = (_mm512_castsi512_ps(z[2 * m]), _mm512_castsi512_ps(z[2 * m + 1]));
        let pairs = add(
            _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(z0, z1)),
            _mm512_castps_si512(_mm512_shuffle_ps::<0xdd>(z0, z1)),
        );
        let sums = add(pairs, _mm512_srli_epi32::<16>(pairs));
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sums))
    })
}

/// [`Width::pv`] on f16 products: each row's block probabilities scaled
/// by a power of two into [0, 1) and rounded to f16; per slice of D (128
/// elements for 3–4 rows, 256 for 1–2: R·slice/32 f16 accumulators; 64
/// for what is left) the block's keys accumulated in f16, then `acc = α·acc
/// + Σ / c` in f32.
///
/// # Safety
/// As [`super::pv_slice`]'s for all of D, the rows FP8 codes, D a
/// multiple of 64; AVX-512F, BW, VBMI and FP16.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512fp16,avx2,fma,f16c")]
unsafe fn pv_half<const R: usize>(
    acc: *mut f32,
    rows: &Rows,
    n: usize,
    sh: Shape,
    (p, alpha): (&[[f32; KB]; R], [f32; R]),
    ahead: &mut Ahead,
) {
    // Each f16 twice in a 32-bit word: a `vpbroadcastd` from memory is a
    // load alone, a `vpbroadcastw` a load and a shuffle-port µop.
    let mut p16 = [[0u32; KB]; R];
    let mut unscale = [1f32; R];
    for r in 0..R {
        // SAFETY: the row's 32 f32 (keys from n on hold 0).
        let (low, high) = unsafe { (_mm512_loadu_ps(p[r].as_ptr()), _mm512_loadu_ps(p[r].as_ptr().add(16))) };
        // NaN lanes left out (`max` returns its second operand on a NaN).
        let max = _mm512_reduce_max_ps(_mm512_max_ps(high, _mm512_max_ps(low, _mm512_setzero_ps())));
        let scale = unit_scale(max);
        unscale[r] = 1.0 / scale;
        let c = _mm512_set1_ps(scale);
        for (h, v) in [low, high].into_iter().enumerate() {
            let half = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(v, c));
            let words = _mm512_cvtepu16_epi32(half);
            let twice = _mm512_or_si512(words, _mm512_slli_epi32::<16>(words));
            // SAFETY: 16 u32 of the row's 32.
            unsafe { _mm512_storeu_si512(p16[r].as_mut_ptr().add(16 * h).cast(), twice) };
        }
    }
    let block = (&p16, alpha, unscale);
    let wide = if R <= 2 { 256 } else { 128 };
    let slices = sh.d / wide + (sh.d % wide) / 64;
    let per_key = (ahead.per_visit(n * slices), n);
    let mut d0 = 0;
    while d0 < sh.d {
        let step = if sh.d - d0 >= wide { wide } else { 64 };
        // SAFETY: d0 + step ≤ D (D a multiple of 64).
        unsafe {
            match step {
                256 => pv_slice_half::<R, 8>(acc, d0, rows, sh, block, (ahead, per_key)),
                128 => pv_slice_half::<R, 4>(acc, d0, rows, sh, block, (ahead, per_key)),
                _ => pv_slice_half::<R, 2>(acc, d0, rows, sh, block, (ahead, per_key)),
            }
        }
        d0 += step;
    }
}

/// One slice of [`pv_half`]: `acc[r][d0 .. d0 + 32·V]` for the R rows,
/// the block's `n` keys (`per_key.1`) accumulated in `V` f16 vectors a row.
///
/// # Safety
/// As [`pv_half`]'s, with `d0 + 32·V ≤ D`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512fp16,avx2,fma,f16c")]
unsafe fn pv_slice_half<const R: usize, const V: usize>(
    acc: *mut f32,
    d0: usize,
    rows: &Rows,
    sh: Shape,
    (p16, alpha, unscale): (&[[u32; KB]; R], [f32; R], [f32; R]),
    (ahead, (per_key, n)): (&mut Ahead, (usize, usize)),
) {
    let table = f16_high_table();
    let mut a = [[_mm512_setzero_ph(); V]; R];
    // A counted loop: written as an iterator adaptor (`(0..n).map(..)`),
    // LLVM kept the accumulators in memory in some builds (the kvjit binary
    // read FP8 ~1.4× slower), not in registers.
    #[allow(clippy::needless_range_loop, reason = "a counted loop keeps the accumulators in registers")]
    for j in 0..n {
        let v_row = rows.v(j);
        ahead.step(true, per_key);
        let mut v = [_mm512_setzero_ph(); V];
        for i in (0..V).step_by(2) {
            // SAFETY: j < n ≤ KB; the row holds D codes, d0 + 32i + 64 ≤ D.
            [v[i], v[i + 1]] = unsafe { widen64(v_row.add(d0 + 32 * i), table) };
        }
        for (r, row) in a.iter_mut().enumerate() {
            let pb = _mm512_castsi512_ph(_mm512_set1_epi32(p16[r][j] as i32));
            for (x, vv) in row.iter_mut().zip(&v) {
                *x = _mm512_fmadd_ph(pb, *vv, *x);
            }
        }
    }
    for (r, row) in a.iter().enumerate() {
        let (al, back) = (_mm512_set1_ps(alpha[r]), _mm512_set1_ps(unscale[r]));
        for (i, x) in row.iter().enumerate() {
            let bits = _mm512_castph_si512(*x);
            let halves = [_mm512_castsi512_si256(bits), _mm512_extracti64x4_epi64::<1>(bits)];
            for (h, half) in halves.into_iter().enumerate() {
                // SAFETY: row r of acc, d0 + 32i + 16h + 16 ≤ D.
                unsafe {
                    let at = acc.add(r * sh.d + d0 + 32 * i + 16 * h);
                    let sum = _mm512_mul_ps(al, _mm512_loadu_ps(at));
                    _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_cvtph_ps(half), back, sum));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_order_is_the_unpacks_and_round_trips() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let natural: Vec<f32> = (0..128).map(|i| i as f32).collect();
        let mut v = natural.clone();
        half_order64(&mut v, false);
        // Position p of each 64: vector p / 32 (low or high unpack), its
        // 128-bit lane (p % 32) / 8, byte p % 8 of that lane's half.
        let want: Vec<f32> =
            (0..128).map(|p| (64 * (p / 64) + 16 * ((p % 32) / 8) + 8 * ((p % 64) / 32) + p % 8) as f32).collect();
        assert_eq!(v, want);
        half_order64(&mut v, true);
        assert_eq!(v, natural);
    }

    /// Every code (each at every position of a vector of 64) widens to
    /// the f16 of 2⁻⁸ × its value, NaN codes to NaN, in [`E4m3Half`]'s order.
    #[test]
    fn e4m3_codes_widen_to_f16_exactly() {
        if !(std::arch::is_x86_feature_detected!("avx512fp16") && std::arch::is_x86_feature_detected!("avx512vbmi")) {
            eprintln!("skipped: this CPU has no AVX512-FP16 and VBMI");
            return;
        }
        for start in (0..256).step_by(64) {
            for rotate in [0, 17] {
                let codes: [u8; 64] = std::array::from_fn(|i| ((start + i + rotate) % 256) as u8);
                let mut bits = [0u16; 64];
                // SAFETY: 64 readable codes, 64 writable u16; the CPU has
                // the features (checked above).
                unsafe {
                    let [low, high] = widen64(codes.as_ptr(), f16_high_table());
                    _mm512_storeu_si512(bits.as_mut_ptr().cast(), _mm512_castph_si512(low));
                    _mm512_storeu_si512(bits.as_mut_ptr().add(32).cast(), _mm512_castph_si512(high));
                }
                let mut order: Vec<f32> = (0..64).map(|i| i as f32).collect();
                half_order64(&mut order, false);
                for (p, &element) in order.iter().enumerate() {
                    let code = codes[element as usize];
                    let got = half::f16::from_bits(bits[p]).to_f64();
                    let want = f64::from(kvjit_core::fp8::e4m3_to_f32(code)) / 256.0;
                    match want.is_nan() {
                        true => assert!(got.is_nan(), "code {code:#04x}: {got}"),
                        false => assert_eq!(got, want, "code {code:#04x}"),
                    }
                }
            }
        }
    }

    /// Rows of every magnitude (f32 subnormals to 10³⁰, a zero row, a NaN)
    /// come back from [`prepare_q`] as f16 that, times their row's factor,
    /// are the values within f16's rounding (2⁻¹¹ of the row's largest).
    #[test]
    fn prepared_q_rows_keep_their_values() {
        if !std::arch::is_x86_feature_detected!("avx512fp16") {
            eprintln!("skipped: this CPU has no AVX512-FP16");
            return;
        }
        let d = 64;
        for (tile, magnitudes) in [[1e-40f32, 1e-20, 1.0, 3e4], [1e30, 0.0, 7.5, f32::NAN]].into_iter().enumerate() {
            let rows: Vec<f32> = magnitudes
                .iter()
                .flat_map(|&m| (0..d).map(move |i| m * (((i * 37 + tile * 11) % 29) as f32 - 14.0) / 14.0))
                .collect();
            let mut q = rows.clone();
            // SAFETY: one whole tile of 4 rows of 64; the CPU has AVX512-FP16
            // (checked above), so AVX-512F.
            unsafe { prepare_q(&mut q, d) };
            let bits: Vec<u16> = q.iter().flat_map(|x| [x.to_bits() as u16, (x.to_bits() >> 16) as u16]).collect();
            for (r, &m) in magnitudes.iter().enumerate() {
                let back = f64::from(q[2 * d + r]);
                let row = &rows[r * d..(r + 1) * d];
                let max = row.iter().fold(0f64, |a, &x| a.max(f64::from(x).abs()));
                for (i, &x) in row.iter().enumerate() {
                    let got = half::f16::from_bits(bits[d * r + i]).to_f64() * back;
                    if m.is_nan() {
                        assert!(got.is_nan(), "row {r} [{i}]: NaN came back {got}");
                        continue;
                    }
                    let err = (got - f64::from(x)).abs();
                    assert!(err <= max * 2f64.powi(-11), "row {r} [{i}]: {x} came back {got}");
                }
            }
        }
    }

    #[test]
    fn unit_scales_are_powers_of_two_into_half_to_one() {
        for max in [1e-30f32, 1e-3, 0.5, 0.75, 1.0, 3.0, 6e4, 1e30, f32::MAX, 1e-40] {
            let c = unit_scale(max);
            assert_eq!(c.to_bits() & 0x7f_ffff, 0, "{max}: {c} a power of two");
            assert!((1.0 / c).is_finite(), "{max}");
            if (1e-37..1e37).contains(&max) {
                assert!((0.5..1.0).contains(&(max * c)), "{max} · {c}");
            } else {
                assert!(max * c < 4.0, "{max} · {c}");
            }
        }
        assert_eq!(unit_scale(0.0), 1.0);
        assert_eq!(unit_scale(f32::NAN), 1.0);
        assert_eq!(unit_scale(f32::INFINITY), 1.0);
    }
}
