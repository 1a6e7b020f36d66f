//! GGML weight blocks in the 256-bit tier: the packed panel layout of the
//! block formats ([`DType::BLOCK_FORMATS`]), activations quantized to two
//! 8-bit parts for the integer GEMV, the integer GEMV micro-kernels
//! ([`quant_gemv`]) and the kernels that decode a block of a packed panel
//! to f32 for the multi-row tiles ([`dequantize_block`]).
//!
//! # The packed panel
//!
//! A panel holds [`TILE_COLUMNS`](crate::microkernel::TILE_COLUMNS) (16) columns of C — 16 weight rows of K
//! values each — in groups of one block of K (a "k-group": 32 k for Q8_0,
//! Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and q8_min, 256 for Q4_K, Q5_K, Q6_K and q8_kmin), k-groups in order. A k-group
//! holds the 16 columns' blocks of that range of K whole in content (the
//! same bytes as the GGML blocks: [`panel_bytes`] = K / block × block
//! bytes × 16), rearranged for the kernels:
//!
//! - **Q4_0 / Q4_1 / IQ4_NL** (288 / 320 / 288 bytes): first the quants
//!   (IQ4_NL's 4-bit codes, each looked up with `vpshufb` in the table of
//!   its 16 levels), as two halves
//!   (columns 0–7, then 8–15) of 4 × 32 bytes. Vector `g` (0..4) of a half
//!   holds one little-endian dword per column of the half (column `c` at
//!   bytes `4c..4c + 4`), whose byte `j` (0..4) holds the weight at
//!   k = 8g + j in its low nibble and k = 8g + 4 + j in its high nibble. So
//!   `v & 0x0F` is, per column dword, the quants of k = 8g..8g + 3 — four
//!   bytes that line up with a dword of the activations for `vpmaddubsw` —
//!   and `(v >> 4) & 0x0F` those of 8g + 4..8g + 7; `(v >> 8j) & 0x0F` as
//!   32-bit lanes is the eight columns' quant at k = 8g + j, the row a
//!   decoded f32 panel wants. Then the 16 f16 scales `d` (32 bytes), then
//!   (Q4_1 only) the 16 f16 minimums `m` (32 bytes).
//! - **Q5_0 / Q5_1** (352 / 384 bytes): Q4_0's quant halves (the low 4
//!   bits), then per half the 8 columns' fifth bits as one dword per column
//!   (32 bytes a half), whose byte `j` holds in bit `2g` the fifth bit of
//!   k = 8g + j and in bit `2g + 1` that of k = 8g + 4 + j — so for vector
//!   `g` one 16-bit shift and a mask put each byte's two bits at bit 4 of
//!   the nibble they belong to —, then the 16 f16 `d` (and the 16 f16 `m`
//!   of Q5_1).
//! - **Q8_0** (544 bytes): two halves of 8 × 32 bytes; vector `g` (0..8)
//!   of a half holds per column a dword of the 4 i8 weights at
//!   k = 4g..4g + 3. Then the 16 f16 scales.
//! - **q8_min** (576 bytes): Q8_0's arrangement of the quants, each byte
//!   stored as `q − 128` (an i8, so Q8_0's dot products serve it; the
//!   128·ΣQ they leave out is added back with the scale), then the 16 f16
//!   `d`, then the 16 f16 `m`.
//! - **Q4_K** (2304 = 16 × 144 bytes): the 16 f16 `d`, the 16 f16 `dmin`,
//!   then the 12 bytes of 6-bit scales and minimums byte-sliced (byte `b`
//!   of column `c` at `64 + 16b + c`, so 8 columns' byte `b` widen in one
//!   load); then at 256 the 8 sub-blocks of 32 k, each as 256 bytes of
//!   quants in the Q4 layout above (sub-block `s` at `256 + 256s`: k =
//!   32s + 8g + j and 32s + 8g + 4 + j).
//! - **Q5_K** (2816 = 16 × 176 bytes): Q4_K's k-group of the blocks'
//!   scales and nibbles, then per sub-block `s` (at `2304 + 64s`) two
//!   halves of 32 bytes of fifth bits in Q5_0's arrangement (bit `2g` of
//!   column dword byte `j`: k = 32s + 8g + j; bit `2g + 1`: 32s + 8g + 4 +
//!   j).
//! - **Q6_K** (3360 = 16 × 210 bytes): the 16 i8 scales of 16 k
//!   byte-sliced (scale `i` of column `c` at `16i + c`), the 16 f16 `d` (at
//!   256), then at 288 per 32-k sub-group `s` (at `288 + 384s`) the low 4
//!   bits of the quants as 256 bytes in the Q4 layout, then their high 2
//!   bits as two halves of 2 × 32 bytes: vector `t` holds per column a
//!   dword whose byte `j` has in bits `2f..2f + 2` the high bits of
//!   k = 32s + 16t + 4f + j (f = 0..4; fields 0/1 pair with the nibbles of
//!   Q4 vector `2t`, fields 2/3 with those of `2t + 1`).
//!
//! - **q8_kmin** (4928 = 16 × 308 bytes): the 16 f16 `d`, the 16 f16
//!   `dmin`, then the 16 i8 scales of 16 k byte-sliced (scale `i` of
//!   column `c` at `64 + 16i + c`), the 16 i16 minimums the same way (at
//!   `320 + 2·(16i + c)`), then at 832 per 32-k sub-group `s` (at `832 +
//!   512s`) Q8_0's arrangement of its quants, stored as `q − 128` as
//!   q8_min's.
//!
//! The K-quants are rearranged (not kept whole per column) so that their
//! 32-k sub-blocks decode and multiply like Q4_1's blocks: one shift and
//! mask per 8 columns' quant instead of a gather or a transpose (measured:
//! a 256 × 16 block decodes 7–9× faster than through per-column scalar
//! decoding, as fast as Q4_1), and an integer GEMV serves them as it does
//! Q4_0/Q4_1 ([`quant_gemv`]). Scales come first in a k-group: a stream reads each group
//! in address order, so the prefetches ahead of it cover them.
//!
//! # The integer GEMV
//!
//! One row of activations (decode) is quantized once per call with
//! [`quantize_activations`] to 16-bit integers held as two 8-bit parts:
//! per 32 values an f32 scale `s = max|x| / 32258` (32258 = 127·254),
//! `Q = round(x / s)` (half away from zero, |Q| ≤ 32258), and
//! `Q = 254·q_hi + q_lo` with `q_hi = round(Q / 254)` (GGML's Q8_0 quant
//! `round(x / d)` for `d = 254·s = max|x| / 127`, up to ties) and the
//! residual `q_lo ∈ [−127, 127]` — so `x ≈ d·q_hi + d_lo·q_lo` with
//! `d_lo = d / 254 = s`. [`quant_gemv`]'s tiles then multiply 8-bit
//! integers: per k-group and half panel, each weight vector is loaded and
//! unpacked once and multiplied with both parts — `vpmaddubsw` of the
//! (unsigned) weight quants against an activation dword of `q_hi`, then
//! of `q_lo`, broadcast to all eight columns, i16 partial sums where they
//! cannot overflow, `vpmaddwd` with 254 (hi) and 1 (lo) to 8 i32 lanes
//! (one per column) of `Σ q_w·Q` exactly — then one f32 FMA with
//! `d_w · s` per k-group and half (Q4_0 subtracts `8·ΣQ` from the integer
//! sum first; Q4_1 adds `m · (s·ΣQ)` with a second FMA). The K-quants'
//! tiles: Q4_K is Q4_1 per 32-k
//! sub-block with scale `d·sc` and minimum `−dmin·m`; Q6_K multiplies its
//! unsigned 6-bit quants and subtracts `32·ΣQ` per 16-k scale block (the
//! block stores `ΣQ` over its first 16 values too). No horizontal sums:
//! the 16 columns of a panel are the lanes. With `vpdpbusd` (AVX-VNNI, or
//! AVX512-VNNI with AVX512-VL on 256-bit registers) the products go
//! straight to i32 lanes, one accumulator per part,
//! combined as `254·hi + lo` per k-group half; with AVX512-BW too the
//! tiles run on 512-bit registers, both halves of the panel in one (the
//! same sums and f32 steps lane for lane, so the same results bit for
//! bit).
//!
//! Why `d_lo = d / 254` exactly rather than a residual's own scale
//! (`max|r| / 127` per block): the two parts are then one integer `Q`, so
//! the tiles combine their sums in i32 (exact: every sum is below 2³¹)
//! and keep the f32 work of 8-bit activations — one conversion and one
//! FMA per k-group and half, offsets and minimums exact integer sums — and
//! the residual is exact (integer `Q − 254·q_hi`, not `x − d·q_hi` in
//! f32). A residual scale would gain almost nothing (`max|r|` of 32
//! values is close to its bound `d / 2`) for a second scale per block and
//! twice the f32 work.
//!
//! **Accuracy.** The integer products and sums are exact; the result
//! differs from the exact product of `x` with the dequantized weights by the
//! activation rounding, at most `Σ_blocks (s / 2) · Σ_{k in block} |w_k|`
//! (`s = d_lo = max|x_b| / 32258`: each `x_k` moves by at most half a
//! step of `Q`; 254× below the bound of 8-bit activations,
//! `Σ_blocks (max|x_b| / 254) · Σ|w_k|`), plus the f32 rounding of the
//! division `x / s` (`u·Σ|x_k·w_k|`, `u = 2⁻²⁴`) and of the f32
//! accumulation (the roundings of the integer sum's conversion, of the
//! scale products and of ≤ 2 FMAs per 32 k, the chains summed: at most
//! `(2·K/32 + 8)·u` times the sum of the magnitudes of the terms). (For
//! blocks whose `max|x|` is subnormal, below ~4·10⁻³⁴, `s` loses
//! precision and `Q` is clamped to ±32258; such activations do not occur
//! in a model's forward pass.)
//!
//! # Decoding to f32
//!
//! [`dequantize_block`] decodes whole k-groups of a panel to the f32
//! `[k][16]` panel the f32 tiles read, bit for bit as
//! [`kvjit_core::quant::dequantize`] does (products and sums rounded
//! separately, never fused), so prefill's GEMM with many rows reads each
//! decoded block from L1 for all its row tiles.

use kvjit_core::DType;

use crate::microkernel::{GemmTile, WidenBlock, avx2_available};

mod pack;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use pack::{pack_panel, panel_bytes};

/// Bytes of one block of quantized activations ([`quantize_activations`]):
/// 32 × i8 `q_hi`, 32 × i8 `q_lo`, the f32 scale, the i32 sums of the
/// 16-bit quants over the block and over its first 16 values, 4 zero bytes.
pub const Q8_ACTIVATION_BLOCK_BYTES: usize = 80;

/// The largest |Q| of [`quantize_activations`]' 16-bit quants: 127·254, so
/// `q_hi = round(Q / 254)` and `q_lo = Q − 254·q_hi` fit in i8 (±127).
const Q_MAX: i32 = 127 * 254;

/// The text of the block panels' packing code ([`pack_panel`], in
/// `quant/pack.rs`): the GEMM's packed layout version hashes it, so a
/// packed weight stored by a build that packed blocks otherwise is refused
/// (the kernels that read the panels, and these docs, can change without
/// retiring artifacts).
pub const PACKING_SOURCE: &str = include_str!("quant/pack.rs");

/// Activation values per block of [`quantize_activations`].
pub const Q8_ACTIVATION_BLOCK: usize = 32;

/// Quantize a row of activations for [`quant_gemv`]: per 32 values `x`
/// (`x.len()` a multiple of 32), [`Q8_ACTIVATION_BLOCK_BYTES`] bytes of
/// `out` (little-endian): the f32 scale `s = max|x| / 32258` at 64, the
/// 16-bit quants `Q = round(x / s)` (half away from zero, as llama.cpp's
/// `roundf`; clamped to ±32258, which only a subnormal `max|x|` reaches;
/// `s = 0` gives all `Q = 0`) as two i8 parts `Q = 254·q_hi + q_lo`,
/// `q_hi = round(Q / 254)` at 0..32 and `q_lo ∈ [−127, 127]` at 32..64,
/// the i32 `ΣQ` at 68, `ΣQ` over the first 16 values at 72 and the f32
/// `s·ΣQ` at 76 (the block's Σx̂, which Q4_1's minimums multiply). The
/// block represents `x̂ = s·Q = d·q_hi + d_lo·q_lo` (`d = 254·s`,
/// `d_lo = s`), within `s / 2` (and the division's rounding) of `x`. `x`
/// is finite (a NaN or infinity gives unspecified quants). With AVX2
/// (when the CPU has it), bit for bit the plain Rust blocks: ~0.9 ns per
/// value, 3.7 µs for K = 4096, measured (twice the 8-bit quantizer's
/// time, well under 1% of a K = 4096 GEMV's).
///
/// # Panics
/// If `x.len()` is not a multiple of 32 or `out` does not hold exactly its
/// blocks.
pub fn quantize_activations(x: &[f32], out: &mut [u8]) {
    assert!(x.len().is_multiple_of(Q8_ACTIVATION_BLOCK), "{} activations are not whole blocks of 32", x.len());
    assert_eq!(out.len(), x.len() / Q8_ACTIVATION_BLOCK * Q8_ACTIVATION_BLOCK_BYTES, "quantized activations' bytes");
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above); x
        // and out hold the same number of blocks (asserted above).
        unsafe { x86::quantize_activations(x, out) };
        return;
    }
    quantize_blocks(x, out);
}

/// The blocks of [`quantize_activations`], in plain Rust (the reference
/// the AVX2 version is tested against, and the path without AVX2).
fn quantize_blocks(x: &[f32], out: &mut [u8]) {
    for (x, out) in x.chunks_exact(Q8_ACTIVATION_BLOCK).zip(out.chunks_exact_mut(Q8_ACTIVATION_BLOCK_BYTES)) {
        let x: &[f32; 32] = x.try_into().expect("chunks of 32");
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = amax / Q_MAX as f32;
        let mut q = [0i32; 32];
        if s != 0.0 {
            for (q, &v) in q.iter_mut().zip(x) {
                *q = round_half_away(v / s).clamp(-Q_MAX, Q_MAX);
            }
        }
        for (i, &q) in q.iter().enumerate() {
            // round(Q / 254), half away from zero, in integers.
            let hi = (q + 127 * q.signum()) / 254;
            out[i] = hi as i8 as u8;
            out[32 + i] = (q - 254 * hi) as i8 as u8;
        }
        let first16: i32 = q[..16].iter().sum();
        let sum = first16 + q[16..].iter().sum::<i32>();
        out[64..68].copy_from_slice(&s.to_le_bytes());
        out[68..72].copy_from_slice(&sum.to_le_bytes());
        out[72..76].copy_from_slice(&first16.to_le_bytes());
        out[76..80].copy_from_slice(&(s * sum as f32).to_le_bytes());
    }
}

/// `roundf(v)` for |v| < 2³¹ (half away from zero), without a libm call:
/// truncate, then step away from zero when the (exact) remainder is at
/// least a half.
#[inline(always)]
fn round_half_away(v: f32) -> i32 {
    let t = v as i32;
    let rest = v - t as f32;
    t + i32::from(rest >= 0.5) - i32::from(rest <= -0.5)
}

/// The integer GEMV tile for panels of a block `format` over `k` (the tile
/// reads a panel in as many streams as its length pays for), with the
/// [`GemmTile`] ABI read this way: `x` points at the row's quantized
/// activations ([`quantize_activations`]' blocks, cast), `x_step` is
/// ignored, `w` at a packed panel, `k` is K (a multiple of the block), and
/// `c[j] += Σ_k x[k]·w[k][j]` for the 16 columns (within the accuracy in the
/// module docs). On a CPU with AVX-VNNI, or AVX512-VNNI and AVX512-VL
/// (AMD Zen 4, Intel's AVX-512 servers), the tile multiplies with
/// `vpdpbusd` (the same sums exactly; [`quant_gemv_avx2`] is the AVX2 one),
/// on 512-bit registers where the CPU has AVX512-BW too.
/// Measured from DRAM against the bf16 GEMV: Q4_0/Q4_1 3.1–3.8×, Q4_K
/// 2.5–3.4×, Q8_0 2.2×, Q6_K 1.7–2.1× (against ~1× for decoding each
/// k-block to f32 first). `None` for other dtypes or when this CPU lacks
/// the tier.
pub fn quant_gemv(format: DType, k: usize) -> Option<GemmTile> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::gemv(format, k)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, k);
        None
    }
}

/// Whether this CPU has an integer GEMV tile ([`quant_gemv`]) for `format`.
pub fn has_quant_gemv(format: DType) -> bool {
    quant_gemv(format, format.block().0).is_some()
}

/// The `vpdpbusd` GEMV tile of `format` reading each panel in `streams`
/// (1, 2 or 4) side-by-side k ranges instead of the tuned count, for
/// measuring that choice (`examples/gemv_threads.rs`). `None` for other
/// dtypes or stream counts, or when this CPU has neither AVX-VNNI nor
/// AVX512-VNNI with AVX512-VL.
#[doc(hidden)]
pub fn quant_gemv_with_streams(format: DType, streams: usize) -> Option<GemmTile> {
    #[cfg(target_arch = "x86_64")]
    {
        if !avx2_available() {
            return None;
        }
        x86::gemv_with_streams(format, streams)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, streams);
        None
    }
}

/// How [`quant_gemv`]'s tiles multiply on this CPU: the row counts up to
/// which a per-row GEMV pays depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantDot {
    /// `vpmaddubsw` and `vpmaddwd` (AVX2 alone, `KVJIT_QUANT_DOT=avx2`,
    /// or no integer tiles at all).
    Avx2,
    /// `vpdpbusd` on 256-bit registers (AVX-VNNI, or AVX512-VNNI with
    /// AVX512-VL): 8 columns a register.
    Vnni256,
    /// `vpdpbusd` on 512-bit registers (AVX512-F, BW, VL and VNNI): a
    /// panel's 16 columns a register.
    Vnni512,
}

/// This CPU's [`QuantDot`] (as `KVJIT_QUANT_DOT` picks it).
pub fn quant_dot() -> QuantDot {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        return match x86::DotTier::best() {
            x86::DotTier::Avx2 => QuantDot::Avx2,
            x86::DotTier::AvxVnni | x86::DotTier::Avx512Vnni => QuantDot::Vnni256,
            x86::DotTier::Avx512Zmm => QuantDot::Vnni512,
        };
    }
    QuantDot::Avx2
}

/// The AVX2 integer GEMV tile of any block format, even on a CPU with
/// `vpdpbusd` (where [`quant_gemv`] returns the
/// `vpdpbusd` tile, the same sums exactly): for tests and measurements.
/// `None` for other dtypes or when this CPU lacks the tier.
pub fn quant_gemv_avx2(format: DType, k: usize) -> Option<GemmTile> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::gemv_tier(format, k, x86::DotTier::Avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, k);
        None
    }
}

/// The kernel that decodes a block of a packed panel of `format` (any block
/// format) to f32, with the [`WidenBlock`] ABI read this way: `w` points at
/// a packed panel at a k-group boundary, `count` is kc × 16 with kc a
/// multiple of the format's block, and `out[k·16 + j]` (k < kc) receives
/// weight (k, column j), bit for bit as [`kvjit_core::quant::dequantize`].
/// `None` for other dtypes or when this CPU lacks the tier.
pub fn dequantize_block(format: DType) -> Option<WidenBlock> {
    if !avx2_available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::dequantize(format)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = format;
        None
    }
}

#[cfg(test)]
mod tests;
