//! The AVX2 kernels of [`super`]: the integer GEMV tiles and the decoders
//! of packed panels to f32 (layouts in the parent's docs).

use std::arch::x86_64::*;

use kvjit_core::DType;

use super::Q8_ACTIVATION_BLOCK_BYTES;
use crate::microkernel::{GemmTile, TILE_COLUMNS, WidenBlock};

/// Independent k ranges a GEMV tile reads its panel in (each with its own
/// accumulators): more line fills in flight per core than one stream, and
/// ≥ 4 independent FMA chains.
const STREAMS: usize = 4;

/// 8 i32 lanes of 8 columns' `Σ_k q_w·q_x` over one Q4 k-group half: the
/// 4 quant vectors at `q` against the block's 8 activation dwords.
///
/// # Safety
/// `q` readable for 128 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_half_dot(q: *const u8, xs: &[__m256i; 8]) -> __m256i {
    let mask = _mm256_set1_epi8(0x0f);
    let mut sums = [_mm256_setzero_si256(); 2];
    for g in 0..4 {
        // SAFETY: g < 4 vectors of 32 bytes inside the caller's 128.
        let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
        let low = _mm256_and_si256(v, mask);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
        // Each i16 lane: two u4·i8 products (≤ 2·15·128); 4 of them summed
        // per accumulator, 8 once both are added: ≤ 30720 < 32767.
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(low, xs[2 * g]), _mm256_maddubs_epi16(high, xs[2 * g + 1]));
        sums[g % 2] = _mm256_add_epi16(sums[g % 2], p);
    }
    _mm256_madd_epi16(_mm256_add_epi16(sums[0], sums[1]), _mm256_set1_epi16(1))
}

/// 8 i32 lanes of 8 columns' `Σ_k q_w·q_x` over one Q8_0 k-group half: the
/// 8 quant vectors at `q` against the block's 8 activation dwords.
///
/// # Safety
/// `q` readable for 256 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_half_dot(q: *const u8, xs: &[__m256i; 8]) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let mut sums = [_mm256_setzero_si256(); 2];
    for (g, x) in xs.iter().enumerate() {
        // SAFETY: g < 8 vectors of 32 bytes inside the caller's 256.
        let v = unsafe { _mm256_loadu_si256(q.add(32 * g).cast()) };
        // |w| (128 for −128, read unsigned) times x with w's sign: two
        // products per i16 lane, ≤ 2·128·127 = 32512, so widen each.
        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(*x, v));
        sums[g % 2] = _mm256_add_epi32(sums[g % 2], _mm256_madd_epi16(p, ones));
    }
    _mm256_add_epi32(sums[0], sums[1])
}

/// A GEMV panel format: how one k-group of 16 columns adds into a pair of
/// accumulators.
trait GemvFormat {
    /// Bytes of a k-group of the packed panel.
    const GROUP_BYTES: usize;
    /// `acc[h] += Σ_k x_k·w_k[8h..8h + 8]` over the k-group at `w`, with
    /// the activations' block at `x`.
    ///
    /// # Safety
    /// `w` readable for `GROUP_BYTES`, `x` for a quantized activation
    /// block; AVX2, FMA, F16C.
    unsafe fn group(w: *const u8, x: *const u8, acc: &mut [__m256; 2]);
}

/// The 8 activation dwords of the block at `x`, each broadcast to every
/// lane, its scale and the sum of its quants.
///
/// # Safety
/// `x` readable for a quantized activation block; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn activations(x: *const u8) -> ([__m256i; 8], f32, i32) {
    // SAFETY: dwords 0..8 and the scale and sum at bytes 32 and 36 lie
    // inside the caller's block.
    unsafe {
        let xs = std::array::from_fn(|i| _mm256_set1_epi32(x.add(4 * i).cast::<i32>().read_unaligned()));
        (xs, x.add(32).cast::<f32>().read_unaligned(), x.add(36).cast::<i32>().read_unaligned())
    }
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
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(w: *const u8, x: *const u8, acc: &mut [__m256; 2]) {
        // SAFETY: the quants (256 bytes) and 16 scales of the caller's group;
        // the caller's activation block.
        unsafe {
            let (xs, dx, sx) = activations(x);
            // value = d·(q − 8): Σ q_x·(q_w − 8) = Σ q_x·q_w − 8·Σq_x.
            let offset = _mm256_set1_epi32(8 * sx);
            let dx = _mm256_set1_ps(dx);
            for (h, acc) in acc.iter_mut().enumerate() {
                let dot = _mm256_sub_epi32(q4_half_dot(w.add(128 * h), &xs), offset);
                let scale = _mm256_mul_ps(f16x8(w.add(256 + 16 * h)), dx);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
            }
        }
    }
}

impl GemvFormat for Q4_1 {
    const GROUP_BYTES: usize = 320;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(w: *const u8, x: *const u8, acc: &mut [__m256; 2]) {
        // SAFETY: the quants (256 bytes), 16 scales and 16 minimums of the
        // caller's group; the caller's activation block.
        unsafe {
            let (xs, dx, sx) = activations(x);
            // value = d·q + m: Σ x·w = d_x·d·Σ q_x·q + m·(d_x·Σq_x).
            let x_sum = _mm256_set1_ps(dx * sx as f32);
            let dx = _mm256_set1_ps(dx);
            for (h, acc) in acc.iter_mut().enumerate() {
                let dot = q4_half_dot(w.add(128 * h), &xs);
                let scale = _mm256_mul_ps(f16x8(w.add(256 + 16 * h)), dx);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
                *acc = _mm256_fmadd_ps(f16x8(w.add(288 + 16 * h)), x_sum, *acc);
            }
        }
    }
}

impl GemvFormat for Q8_0 {
    const GROUP_BYTES: usize = 544;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(w: *const u8, x: *const u8, acc: &mut [__m256; 2]) {
        // SAFETY: the quants (512 bytes) and 16 scales of the caller's
        // group; the caller's activation block.
        unsafe {
            let (xs, dx, _) = activations(x);
            let dx = _mm256_set1_ps(dx);
            for (h, acc) in acc.iter_mut().enumerate() {
                let dot = q8_half_dot(w.add(256 * h), &xs);
                let scale = _mm256_mul_ps(f16x8(w.add(512 + 16 * h)), dx);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
            }
        }
    }
}

/// The integer GEMV tile of format `F` (the [`GemmTile`] ABI as
/// [`super::quant_gemv`] reads it): the panel's k-groups in [`STREAMS`]
/// contiguous ranges, each with its own accumulators.
///
/// # Safety
/// `x` readable for K/32 quantized activation blocks (cast), `w` for a
/// packed panel of `F` over `k` (a multiple of 32), `c` readable and
/// writable for 16 f32; AVX2, FMA, F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe extern "C" fn gemv_kernel<F: GemvFormat>(x: *const f32, _x_step: usize, w: *const u8, k: usize, c: *mut f32) {
    let x = x.cast::<u8>();
    let groups = k / 32;
    let span = groups / STREAMS;
    let mut acc = [[_mm256_setzero_ps(); 2]; STREAMS];
    // SAFETY (whole body): stream s reads k-groups s·span + j for j < span,
    // the tail STREAMS·span..groups: every k-group < K/32 of the panel and
    // of the activations, as the caller vouches.
    let group = |acc: &mut [__m256; 2], g: usize| unsafe {
        F::group(w.add(g * F::GROUP_BYTES), x.add(g * Q8_ACTIVATION_BLOCK_BYTES), acc)
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
        _mm256_storeu_ps(c, _mm256_add_ps(_mm256_loadu_ps(c), sum[0]));
        _mm256_storeu_ps(c.add(8), _mm256_add_ps(_mm256_loadu_ps(c.add(8)), sum[1]));
    }
}

pub(super) fn gemv(format: DType) -> Option<GemmTile> {
    Some(match format {
        DType::Q4_0 => gemv_kernel::<Q4_0>,
        DType::Q4_1 => gemv_kernel::<Q4_1>,
        DType::Q8_0 => gemv_kernel::<Q8_0>,
        _ => return None,
    })
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
