//! The AVX2 kernels of [`super`]: the integer GEMV tiles and the decoders
//! of packed panels to f32 (layouts in the parent's docs).

use std::arch::x86_64::*;

use kvjit_core::DType;

use super::Q8_ACTIVATION_BLOCK_BYTES;
use crate::microkernel::{GemmTile, TILE_COLUMNS, WidenBlock};

/// Independent k ranges a GEMV tile reads its panel in (each with its own
/// accumulators): more line fills in flight per core than one stream, and
/// ≥ 4 independent FMA chains (measured: 4 streams beat 1, 2 and 8).
const STREAMS: usize = 4;
/// How far ahead of its loads each stream of a GEMV tile prefetches
/// (measured: 2 KiB per stream reads DRAM at ~1.3× the rate of no software
/// prefetch, within ~8% of the core's read roof; 1 KiB and 4 KiB less).
const PREFETCH_BYTES: usize = 2048;

/// How a GEMV tile multiplies 8-bit quants: 8 columns' `Σ_k q_w·q_x` over
/// one k-group half as 8 i32 lanes, exactly.
trait Dot {
    /// A Q4 half: the 4 quant vectors at `q` against the block's 8
    /// activation dwords `xs` (each broadcast).
    ///
    /// # Safety
    /// `q` readable for 128 bytes; the CPU has this `Dot`'s features.
    unsafe fn q4(q: *const u8, xs: &[__m256i; 8]) -> __m256i;
    /// A Q8_0 half: the 8 quant vectors at `q` against `xs`, whose quants
    /// sum to `sum`.
    ///
    /// # Safety
    /// `q` readable for 256 bytes; the CPU has this `Dot`'s features.
    unsafe fn q8(q: *const u8, xs: &[__m256i; 8], sum: i32) -> __m256i;
}

/// AVX2: `vpmaddubsw` to i16 pairs, `vpmaddwd` with ones to i32.
struct Avx2;
/// AVX-VNNI: `vpdpbusd`, four u8·i8 products straight into i32 lanes.
struct Vnni;

impl Dot for Avx2 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4(q: *const u8, xs: &[__m256i; 8]) -> __m256i {
        let mask = _mm256_set1_epi8(0x0f);
        let mut sums = [_mm256_setzero_si256(); 2];
        for g in 0..4 {
            // SAFETY: vector g < 4 of the caller's 128 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            let low = _mm256_and_si256(v, mask);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
            // An i16 lane of a `vpmaddubsw`: two u4·i8 products
            // (≤ 2·15·128); the 8 of the half sum to ≤ 30720 < 32767.
            let p = _mm256_add_epi16(_mm256_maddubs_epi16(low, xs[2 * g]), _mm256_maddubs_epi16(high, xs[2 * g + 1]));
            sums[g % 2] = _mm256_add_epi16(sums[g % 2], p);
        }
        _mm256_madd_epi16(_mm256_add_epi16(sums[0], sums[1]), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8(q: *const u8, xs: &[__m256i; 8], _sum: i32) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let mut sums = [_mm256_setzero_si256(); 2];
        for (g, x) in xs.iter().enumerate() {
            // SAFETY: vector g < 8 of the caller's 256 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            // |w| (128 for −128, read unsigned) times x with w's sign: two
            // products per i16 lane, ≤ 2·128·127 = 32512, so widen each
            // `vpmaddubsw` at once.
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(*x, v));
            sums[g % 2] = _mm256_add_epi32(sums[g % 2], _mm256_madd_epi16(p, ones));
        }
        _mm256_add_epi32(sums[0], sums[1])
    }
}

impl Dot for Vnni {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn q4(q: *const u8, xs: &[__m256i; 8]) -> __m256i {
        let mask = _mm256_set1_epi8(0x0f);
        let mut sums = [_mm256_setzero_si256(); 2];
        for g in 0..4 {
            // SAFETY: vector g < 4 of the caller's 128 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            let low = _mm256_and_si256(v, mask);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
            sums[0] = _mm256_dpbusd_avx_epi32(sums[0], low, xs[2 * g]);
            sums[1] = _mm256_dpbusd_avx_epi32(sums[1], high, xs[2 * g + 1]);
        }
        _mm256_add_epi32(sums[0], sums[1])
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn q8(q: *const u8, xs: &[__m256i; 8], sum: i32) -> __m256i {
        // (w + 128) is unsigned: Σ (w + 128)·x = Σ w·x + 128·Σx, exact in
        // i32 (≤ 32·255·128).
        let bias = _mm256_set1_epi8(i8::MIN);
        let mut sums = [_mm256_setzero_si256(); 2];
        for (g, x) in xs.iter().enumerate() {
            // SAFETY: vector g < 8 of the caller's 256 bytes.
            let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
            sums[g % 2] = _mm256_dpbusd_avx_epi32(sums[g % 2], _mm256_xor_si256(v, bias), *x);
        }
        _mm256_sub_epi32(_mm256_add_epi32(sums[0], sums[1]), _mm256_set1_epi32(128 * sum))
    }
}

/// A GEMV panel format: where a k-group's parts lie and how its integer
/// sums become f32.
trait GemvFormat {
    /// Bytes of a k-group of the packed panel.
    const GROUP_BYTES: usize;
    /// Whether the quants are Q8_0's (else Q4's).
    const Q8: bool;
    /// `acc += d_w·d_x·dot` (and the format's offset or minimum term) for
    /// the half `h` of the k-group at `w`, whose integer sums are `dot`,
    /// with activations scaled by `dx` whose quants sum to `sx`.
    ///
    /// # Safety
    /// `w` readable for `GROUP_BYTES`; AVX2, FMA, F16C.
    unsafe fn add(w: *const u8, h: usize, dot: __m256i, dx: f32, sx: i32, acc: &mut __m256);
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

struct Q4_0;
struct Q4_1;
struct Q8_0;

impl GemvFormat for Q4_0 {
    const GROUP_BYTES: usize = 288;
    const Q8: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, h: usize, dot: __m256i, dx: f32, sx: i32, acc: &mut __m256) {
        // value = d·(q − 8): Σ q_x·(q_w − 8) = Σ q_x·q_w − 8·Σq_x.
        let dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * sx));
        // SAFETY: the half's 8 scales inside the caller's group.
        let scale = _mm256_mul_ps(unsafe { f16x8(w.add(256 + 16 * h)) }, _mm256_set1_ps(dx));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
    }
}

impl GemvFormat for Q4_1 {
    const GROUP_BYTES: usize = 320;
    const Q8: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, h: usize, dot: __m256i, dx: f32, sx: i32, acc: &mut __m256) {
        // value = d·q + m: Σ x·w = d_x·d·Σ q_x·q + m·(d_x·Σq_x).
        // SAFETY: the half's 8 scales and 8 minimums inside the caller's
        // group.
        let (d, m) = unsafe { (f16x8(w.add(256 + 16 * h)), f16x8(w.add(288 + 16 * h))) };
        let scale = _mm256_mul_ps(d, _mm256_set1_ps(dx));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
        *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * sx as f32), *acc);
    }
}

impl GemvFormat for Q8_0 {
    const GROUP_BYTES: usize = 544;
    const Q8: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(w: *const u8, h: usize, dot: __m256i, dx: f32, _sx: i32, acc: &mut __m256) {
        // SAFETY: the half's 8 scales inside the caller's group.
        let scale = _mm256_mul_ps(unsafe { f16x8(w.add(512 + 16 * h)) }, _mm256_set1_ps(dx));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
    }
}

/// The body of an integer GEMV tile of format `$format` multiplying with
/// `$dot` (the [`GemmTile`] ABI as [`super::quant_gemv`] reads it): the
/// panel's k-groups in [`STREAMS`] contiguous ranges side by side, each
/// with its own accumulators and prefetching [`PREFETCH_BYTES`] ahead of
/// itself. A macro, not a function: `#[inline]` functions with target
/// features inline only into callers with at least theirs, so each kernel
/// holds the body whose `$dot` calls its features allow.
macro_rules! gemv_body {
    ($format:ty, $dot:ty, $x:ident, $w:ident, $k:ident, $c:ident) => {{
        let x = $x.cast::<u8>();
        let groups = $k / 32;
        let span = groups / STREAMS;
        let mut acc = [[_mm256_setzero_ps(); 2]; STREAMS];
        // SAFETY: stream s reads k-groups s·span + j for j < span, the
        // tail STREAMS·span..groups: every k-group < K/32 of the panel and
        // of the activations (40 bytes each: 8 quant dwords, the scale at
        // 32, the sum at 36), as the caller vouches; prefetches form their
        // addresses with `wrapping_add` and never fault; the kernel has
        // the features of `$dot` and the format's `add`.
        let group = |acc: &mut [__m256; 2], g: usize| unsafe {
            let w = $w.add(g * <$format>::GROUP_BYTES);
            for line in (0..<$format>::GROUP_BYTES).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(PREFETCH_BYTES + line).cast());
            }
            let x = x.add(g * Q8_ACTIVATION_BLOCK_BYTES);
            let xs: [__m256i; 8] =
                std::array::from_fn(|i| _mm256_set1_epi32(x.add(4 * i).cast::<i32>().read_unaligned()));
            let (dx, sx) = (x.add(32).cast::<f32>().read_unaligned(), x.add(36).cast::<i32>().read_unaligned());
            for (h, acc) in acc.iter_mut().enumerate() {
                let dot =
                    if <$format>::Q8 { <$dot>::q8(w.add(256 * h), &xs, sx) } else { <$dot>::q4(w.add(128 * h), &xs) };
                <$format>::add(w, h, dot, dx, sx, acc);
            }
        };
        for j in 0..span {
            for (s, stream) in acc.iter_mut().enumerate() {
                group(stream, s * span + j);
            }
        }
        for g in STREAMS * span..groups {
            group(&mut acc[0], g);
        }
        let mut sum = acc[0];
        for stream in &acc[1..] {
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
/// packed panel of `F` over `k` (a multiple of 32), `c` readable and
/// writable for 16 f32; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn gemv_kernel<F: GemvFormat>(x: *const f32, _x_step: usize, w: *const u8, k: usize, c: *mut f32) {
    gemv_body!(F, Avx2, x, w, k, c)
}

/// The integer GEMV tile of format `F` with AVX-VNNI ([`gemv_body`]);
/// measured ~14% faster than [`gemv_kernel`] on a panel in L2, the same
/// from DRAM.
///
/// # Safety
/// As for [`gemv_kernel`], and the CPU has AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe extern "C" fn gemv_kernel_vnni<F: GemvFormat>(
    x: *const f32,
    _x_step: usize,
    w: *const u8,
    k: usize,
    c: *mut f32,
) {
    gemv_body!(F, Vnni, x, w, k, c)
}

/// Whether this CPU has AVX-VNNI (the 256-bit `vpdpbusd`).
pub(super) fn vnni_available() -> bool {
    std::arch::is_x86_feature_detected!("avxvnni")
}

/// The integer GEMV tile of `format`: with AVX-VNNI when `vnni` (the
/// caller checked [`vnni_available`]), else AVX2.
pub(super) fn gemv_tier(format: DType, vnni: bool) -> Option<GemmTile> {
    Some(match (format, vnni) {
        (DType::Q4_0, false) => gemv_kernel::<Q4_0>,
        (DType::Q4_1, false) => gemv_kernel::<Q4_1>,
        (DType::Q8_0, false) => gemv_kernel::<Q8_0>,
        (DType::Q4_0, true) => gemv_kernel_vnni::<Q4_0>,
        (DType::Q4_1, true) => gemv_kernel_vnni::<Q4_1>,
        (DType::Q8_0, true) => gemv_kernel_vnni::<Q8_0>,
        _ => return None,
    })
}

pub(super) fn gemv(format: DType) -> Option<GemmTile> {
    gemv_tier(format, vnni_available())
}

/// The 8 columns' u4 quant at byte `SHIFT / 8`, nibble `SHIFT % 8 / 4` of
/// their dwords in `v`, as i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibble<const SHIFT: i32>(v: __m256i) -> __m256i {
    _mm256_and_si256(_mm256_srli_epi32::<SHIFT>(v), _mm256_set1_epi32(0x0f))
}

/// The 8 columns' i8 quant at byte `(24 − LEFT) / 8` of their dwords in `v`,
/// sign-extended to i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_byte<const LEFT: i32>(v: __m256i) -> __m256i {
    _mm256_srai_epi32::<24>(_mm256_slli_epi32::<LEFT>(v))
}

/// Decode `count / 16` k of a Q4_0 (`MIN = false`) or Q4_1 panel at `w` to
/// `out` (`[k][16]` f32), as `kvjit_core::quant` does: `d·(q − 8)` or
/// `d·q + m`, the product rounded before the sum.
///
/// # Safety
/// `w` readable for the panel's k-groups over `count / 16` k (a multiple of
/// 32), `out` writable for `count` f32; AVX2, FMA, F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_q4<const MIN: bool>(w: *const u8, count: usize, out: *mut f32) {
    let group_bytes = if MIN { 320 } else { 288 };
    let eight = _mm256_set1_epi32(8);
    for g in 0..count / (32 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 512 of the panel and its 512 outputs.
        unsafe {
            let w = w.add(g * group_bytes);
            let out = out.add(g * 32 * TILE_COLUMNS);
            for h in 0..2 {
                let d = f16x8(w.add(256 + 16 * h));
                let m = if MIN { f16x8(w.add(288 + 16 * h)) } else { _mm256_setzero_ps() };
                let decode = |q: __m256i| {
                    if MIN {
                        _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m)
                    } else {
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)))
                    }
                };
                for v in 0..4 {
                    let q = _mm256_loadu_si256(w.add(128 * h + 32 * v).cast());
                    // k = 8v + j at byte j's low nibble, 8v + 4 + j at its high.
                    let row = |k: usize| out.add((8 * v + k) * TILE_COLUMNS + 8 * h);
                    _mm256_storeu_ps(row(0), decode(nibble::<0>(q)));
                    _mm256_storeu_ps(row(1), decode(nibble::<8>(q)));
                    _mm256_storeu_ps(row(2), decode(nibble::<16>(q)));
                    _mm256_storeu_ps(row(3), decode(nibble::<24>(q)));
                    _mm256_storeu_ps(row(4), decode(nibble::<4>(q)));
                    _mm256_storeu_ps(row(5), decode(nibble::<12>(q)));
                    _mm256_storeu_ps(row(6), decode(nibble::<20>(q)));
                    _mm256_storeu_ps(row(7), decode(_mm256_srli_epi32::<28>(q)));
                }
            }
        }
    }
}

/// Decode `count / 16` k of a Q8_0 panel at `w` to `out` (`[k][16]` f32):
/// `q·d`.
///
/// # Safety
/// As for [`dequantize_q4`], for a Q8_0 panel.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_q8_0(w: *const u8, count: usize, out: *mut f32) {
    for g in 0..count / (32 * TILE_COLUMNS) {
        // SAFETY: k-group g < count / 512 of the panel and its 512 outputs.
        unsafe {
            let w = w.add(g * 544);
            let out = out.add(g * 32 * TILE_COLUMNS);
            for h in 0..2 {
                let d = f16x8(w.add(512 + 16 * h));
                let decode = |q: __m256i| _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
                for v in 0..8 {
                    let q = _mm256_loadu_si256(w.add(256 * h + 32 * v).cast());
                    let row = |k: usize| out.add((4 * v + k) * TILE_COLUMNS + 8 * h);
                    _mm256_storeu_ps(row(0), decode(signed_byte::<24>(q)));
                    _mm256_storeu_ps(row(1), decode(signed_byte::<16>(q)));
                    _mm256_storeu_ps(row(2), decode(signed_byte::<8>(q)));
                    _mm256_storeu_ps(row(3), decode(_mm256_srai_epi32::<24>(q)));
                }
            }
        }
    }
}

/// Decode `count / 16` k of a Q4_K (`Q6 = false`) or Q6_K panel at `w`:
/// each column's super-block through
/// `kvjit_core::quant::dequantize`, then scattered to `[k][16]`.
///
/// # Safety
/// As for [`dequantize_q4`], for a Q4_K / Q6_K panel.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn dequantize_k<const Q6: bool>(w: *const u8, count: usize, out: *mut f32) {
    let format = if Q6 { DType::Q6K } else { DType::Q4K };
    let (block, size) = format.block();
    let mut column = [0f32; 256];
    for g in 0..count / (block * TILE_COLUMNS) {
        for c in 0..TILE_COLUMNS {
            // SAFETY: column c's super-block of k-group g lies inside the
            // caller's panel; its 256 outputs inside `out`.
            unsafe {
                let bytes = std::slice::from_raw_parts(w.add((g * TILE_COLUMNS + c) * size), size);
                kvjit_core::quant::dequantize(format, bytes, &mut column).expect("one whole super-block");
                let out = out.add(g * block * TILE_COLUMNS + c);
                for (k, &v) in column.iter().enumerate() {
                    *out.add(k * TILE_COLUMNS) = v;
                }
            }
        }
    }
}

pub(super) fn dequantize(format: DType) -> Option<WidenBlock> {
    Some(match format {
        DType::Q4_0 => dequantize_q4::<false>,
        DType::Q4_1 => dequantize_q4::<true>,
        DType::Q8_0 => dequantize_q8_0,
        DType::Q4K => dequantize_k::<false>,
        DType::Q6K => dequantize_k::<true>,
        _ => return None,
    })
}
