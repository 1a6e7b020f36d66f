//! FP8 (E4M3) codes in Cranelift IR, bit for bit as [`kvjit_core::fp8`]:
//! codes widened to f32 lanes ([`load_codes`], [`widen_i32x4`]), f32 lanes
//! rounded to codes ([`narrow_i32x4`], [`store_codes`], [`store_code_lane`]),
//! a block quantized with its scale ([`quantize_block`]), and codes
//! re-encoded as the bf16 words of their values ([`ToBf16`]), which is
//! exact.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::FunctionBuilder;

use super::addr::{Displacements, element};
use super::{band_const, counted_loop, little, mem, splat_f32, splat_u32};

/// Load 4 FP8 codes at `ptr + offset` (one 32-bit load) as the low bytes of
/// an `I32X4`'s lanes.
pub fn load_codes(b: &mut FunctionBuilder, ptr: Value, offset: i32) -> Value {
    let word = b.ins().load(types::I32, mem(), ptr, offset);
    let bytes = b.ins().scalar_to_vector(types::I32X4, word);
    let bytes = b.ins().bitcast(types::I8X16, little(), bytes);
    let halves = b.ins().uwiden_low(bytes);
    b.ins().uwiden_low(halves)
}

/// The values of E4M3 codes (the low byte of each `I32X4` lane), exactly
/// as [`kvjit_core::fp8::e4m3_to_f32`]: the 7 magnitude bits placed at
/// f32's exponent/mantissa boundary (`m << 20`) read as an f32 that is the
/// value times 2⁻¹²⁰ (an E4M3 subnormal lands on an f32 subnormal), one
/// exact multiply by 2¹²⁰; the NaN code becomes f32's quiet NaN; the sign is
/// ORed back last. Relies on subnormals not being flushed (no DAZ/FTZ), the
/// state Rust programs run in.
pub fn widen_i32x4(b: &mut FunctionBuilder, codes: Value) -> Value {
    let magnitude = band_const(b, codes, 0x7f);
    let placed = b.ins().ishl_imm_u(magnitude, 20);
    let placed = b.ins().bitcast(types::F32X4, MemFlagsData::new(), placed);
    let rebias = splat_f32(b, f32::from_bits((127 + 120) << 23));
    let value = b.ins().fmul(placed, rebias);
    let value = b.ins().bitcast(types::I32X4, MemFlagsData::new(), value);
    let nan_code = splat_u32(b, u32::from(kvjit_core::fp8::E4M3_NAN));
    let is_nan = b.ins().icmp(IntCC::Equal, magnitude, nan_code);
    let nan = splat_u32(b, f32::NAN.to_bits());
    let value = b.ins().bitselect(is_nan, nan, value);
    let sign = b.ins().ishl_imm_u(codes, 24);
    let sign = band_const(b, sign, 0x8000_0000);
    let value = b.ins().bor(value, sign);
    b.ins().bitcast(types::F32X4, MemFlagsData::new(), value)
}

/// Round an `F32X4` to E4M3 codes (in the low byte of each `I32X4` lane),
/// bit for bit as [`kvjit_core::fp8::e4m3_from_f32`]: to nearest, ties to
/// even; past ±448 (±∞ included) saturated to ±448; NaN to the NaN code
/// with its sign; −0 to −0.
///
/// - `|x| ≥ 2⁻⁶` (normal): the f32 mantissa rounded to 3 bits on the bits
///   (`(a + 0x7ffff + lsb) >> 20`), rebiased by `(127 − 7) << 3`.
/// - `|x| < 2⁻⁶` (subnormal or zero): `|x| · 2⁹` (exact) rounded to an
///   integer, ties to even (`nearest`), 0..=8 — 8 being the smallest
///   normal's code.
pub fn narrow_i32x4(b: &mut FunctionBuilder, value: Value) -> Value {
    let x = b.ins().bitcast(types::I32X4, MemFlagsData::new(), value);
    let a = band_const(b, x, 0x7fff_ffff);
    let sign = b.ins().ushr_imm_u(x, 24);
    let sign = band_const(b, sign, 0x80);
    let t = b.ins().ushr_imm_u(a, 20);
    let lsb = band_const(b, t, 1);
    let r = b.ins().iadd(a, lsb);
    let bias = splat_u32(b, 0x7_ffff);
    let r = b.ins().iadd(r, bias);
    let r = b.ins().ushr_imm_u(r, 20);
    let rebias = splat_u32(b, (127 - 7) << 3);
    let normal = b.ins().isub(r, rebias);
    let af = b.ins().bitcast(types::F32X4, MemFlagsData::new(), a);
    let steps = splat_f32(b, 512.0);
    let sub = b.ins().fmul(af, steps);
    let sub = b.ins().nearest(sub);
    let sub = b.ins().fcvt_to_sint_sat(types::I32X4, sub);
    let min_normal = splat_u32(b, 0x3c80_0000);
    let is_sub = b.ins().icmp(IntCC::SignedLessThan, a, min_normal);
    let code = b.ins().bitselect(is_sub, sub, normal);
    let max_bits = splat_u32(b, kvjit_core::fp8::E4M3_MAX.to_bits());
    let saturates = b.ins().icmp(IntCC::SignedGreaterThanOrEqual, a, max_bits);
    let max_code = splat_u32(b, 0x7e);
    let code = b.ins().bitselect(saturates, max_code, code);
    let is_nan = b.ins().fcmp(FloatCC::Unordered, value, value);
    let nan_code = splat_u32(b, u32::from(kvjit_core::fp8::E4M3_NAN));
    let code = b.ins().bitselect(is_nan, nan_code, code);
    b.ins().bor(code, sign)
}

/// Store the 4 codes of an `I32X4` (low byte of each lane, as
/// [`narrow_i32x4`] makes them) at `ptr + offset`: one 32-bit store.
pub fn store_codes(b: &mut FunctionBuilder, codes: Value, ptr: Value, offset: i32) {
    // Every lane is ≤ 0xff, so both unsigned saturating packs are exact.
    let halves = b.ins().unarrow(codes, codes);
    let bytes = b.ins().unarrow(halves, halves);
    let words = b.ins().bitcast(types::I32X4, little(), bytes);
    let word = b.ins().extractlane(words, 0);
    b.ins().store(mem(), word, ptr, offset);
}

/// Quantize one FP8 block, exactly as [`kvjit_core::fp8::quantize_block`]:
/// the `count` f32 values at `src` (an `I64` count, any value ≥ 1) become
/// `count` E4M3 codes at `codes` and one f32 scale at `scale_at`.
///
/// Two passes over the block, 4 values at a time and then one by one for
/// the rest: the largest finite magnitude (±∞ and NaN lanes count as 0),
/// `scale = max / 448` (one f32 division); then each value divided by the
/// scale (±∞ saturating to ±448) — or, when the scale is 0, each finite
/// value multiplied by 0 (a zero block stores zeros) — converted by
/// [`narrow_i32x4`].
pub fn quantize_block(b: &mut FunctionBuilder, src: Value, count: Value, codes: Value, scale_at: Value) {
    let whole = b.ins().band_imm_s(count, !3);
    let zero = b.ins().iconst(types::I64, 0);
    let infinity = splat_f32(b, f32::INFINITY);
    // All ones in the lanes of `v` that are finite (|v| < ∞ is false for ±∞ and NaN), as I32X4.
    let finite = |b: &mut FunctionBuilder, v: Value| {
        let a = b.ins().fabs(v);
        b.ins().fcmp(FloatCC::LessThan, a, infinity)
    };
    let magnitude = |b: &mut FunctionBuilder, v: Value| {
        let a = b.ins().fabs(v);
        let is_finite = finite(b, v);
        let a = b.ins().bitcast(types::I32X4, MemFlagsData::new(), a);
        let a = b.ins().band(a, is_finite);
        b.ins().bitcast(types::F32X4, MemFlagsData::new(), a)
    };
    let start = splat_f32(b, 0.0);
    let max = counted_loop(b, zero, whole, 4, &[start], |b, i, carried| {
        let at = element(b, src, i, 4);
        let v = b.ins().load(types::F32X4, mem(), at, 0);
        let a = magnitude(b, v);
        vec![b.ins().fmax(carried[0], a)]
    })[0];
    let max = counted_loop(b, whole, count, 1, &[max], |b, i, carried| {
        let at = element(b, src, i, 4);
        let x = b.ins().load(types::F32, mem(), at, 0);
        let v = b.ins().splat(types::F32X4, x);
        let a = magnitude(b, v);
        vec![b.ins().fmax(carried[0], a)]
    })[0];
    let lanes: Vec<Value> = (0..4).map(|lane| b.ins().extractlane(max, lane)).collect();
    let low = b.ins().fmax(lanes[0], lanes[1]);
    let high = b.ins().fmax(lanes[2], lanes[3]);
    let max = b.ins().fmax(low, high);
    let limit = b.ins().f32const(kvjit_core::fp8::E4M3_MAX);
    let scale = b.ins().fdiv(max, limit);
    b.ins().store(mem(), scale, scale_at, 0);
    // x / scale, or x · 0 for a finite x and a zero scale: selected
    // lane-wise by a mask.
    let scale = b.ins().splat(types::F32X4, scale);
    let zeros = splat_f32(b, 0.0);
    let zero_scale = b.ins().fcmp(FloatCC::Equal, scale, zeros);
    let quotient = |b: &mut FunctionBuilder, v: Value| {
        let divided = b.ins().fdiv(v, scale);
        let zeroed = b.ins().fmul(v, zeros);
        let is_finite = finite(b, v);
        let use_zeroed = b.ins().band(zero_scale, is_finite);
        let use_zeroed = b.ins().bitcast(types::F32X4, MemFlagsData::new(), use_zeroed);
        let q = b.ins().bitselect(use_zeroed, zeroed, divided);
        narrow_i32x4(b, q)
    };
    counted_loop(b, zero, whole, 4, &[], |b, i, _| {
        let at = element(b, src, i, 4);
        let v = b.ins().load(types::F32X4, mem(), at, 0);
        let c = quotient(b, v);
        let out = b.ins().iadd(codes, i);
        store_codes(b, c, out, 0);
        Vec::new()
    });
    counted_loop(b, whole, count, 1, &[], |b, i, _| {
        let at = element(b, src, i, 4);
        let x = b.ins().load(types::F32, mem(), at, 0);
        let v = b.ins().splat(types::F32X4, x);
        let c = quotient(b, v);
        let out = b.ins().iadd(codes, i);
        store_code_lane(b, c, 0, out, 0);
        Vec::new()
    });
}

/// Store lane `lane`'s code of an `I32X4` alone at `ptr + offset`.
pub fn store_code_lane(b: &mut FunctionBuilder, codes: Value, lane: u8, ptr: Value, offset: i32) {
    let code = b.ins().extractlane(codes, lane);
    b.ins().istore8(mem(), code, ptr, offset);
}

/// Subnormal corrections of the high byte, by magnitude: the bf16 high byte
/// of `m · 2⁻⁹` minus the normal formula's `0x3C`, wrapping
/// (0 → 0x00, 1‥3 → 0x3B, 4‥7 → 0x3C). Entries 8‥15 (exponent 1) are 0.
const DELTA_HI: [u8; 16] = [0xC4, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// Subnormal corrections of the low byte: the bf16 low byte of `m · 2⁻⁹`
/// (0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60) minus the normal
/// formula's `m << 4`, wrapping.
const DELTA_LO: [u8; 16] = [0x00, 0xF0, 0x60, 0x90, 0xC0, 0xD0, 0xE0, 0xF0, 0, 0, 0, 0, 0, 0, 0, 0];

/// Re-encodes E4M3 codes as the bf16 words of their **unscaled** values,
/// exactly: every E4M3 value (3 mantissa bits, exponents 2⁻⁹ … 2⁸, NaN) is
/// a bf16 value. A kernel reading an FP8 cache can so copy its codes into a
/// bf16 buffer and read that with the bf16 loads (a zero-extending load and
/// a shift per 4 elements), applying the block scales in registers (the
/// attention kernel's gather does). 16 codes at a time with byte operations
/// only (no float arithmetic, no table in memory). Per 16 codes
/// ([`ToBf16::words`]):
///
/// - normal codes (exponent field e ≥ 1): the bf16 bits are `sign << 15 |
///   (e + 120) << 7 | m << 4`, i.e. high byte `sign | 0x3C + (code >> 4 & 7)`
///   and low byte `code << 4 & 0xF0` (two byte vectors, each one shift, one
///   mask, one add);
/// - subnormal codes (e = 0, magnitudes 0‥7) need normalising: a 16-entry
///   table of corrections per byte, looked up with the magnitude as index
///   (`swizzle`: indices ≥ 16 give 0, so only magnitudes < 16 are touched,
///   and the entries 8‥15 are 0), added to both bytes;
/// - the NaN magnitude 0x7f: the high byte gets all exponent bits (`0x7F`);
///   the low byte is already `0xF0`, so the word is a quiet NaN;
/// - the sign is ORed into the high byte, and the two byte vectors are
///   interleaved into 16 little-endian words (`punpcklbw`/`punpckhbw`).
///
/// Holds the conversion's constants, made once outside the loops (the
/// kernels compile without Cranelift's optimiser, which would otherwise
/// rematerialise them per use).
#[derive(Clone, Copy, Debug)]
pub struct ToBf16 {
    k7f: Value,
    k80: Value,
    k07: Value,
    k3c: Value,
    kf0: Value,
    delta_hi: Value,
    delta_lo: Value,
    /// The kernel's displacements, which bound the offsets of
    /// [`convert_row`](Self::convert_row).
    displacements: Displacements,
}

fn bytes_const(b: &mut FunctionBuilder, bytes: [u8; 16]) -> Value {
    let c = b.func.dfg.constants.insert(bytes.to_vec().into());
    b.ins().vconst(types::I8X16, c)
}

impl ToBf16 {
    /// Emit the constants (at a point that dominates every use), for a
    /// kernel whose displacements are `displacements`.
    pub fn new(b: &mut FunctionBuilder, displacements: Displacements) -> Self {
        Self {
            k7f: bytes_const(b, [0x7f; 16]),
            k80: bytes_const(b, [0x80; 16]),
            k07: bytes_const(b, [0x07; 16]),
            k3c: bytes_const(b, [0x3c; 16]),
            kf0: bytes_const(b, [0xf0; 16]),
            delta_hi: bytes_const(b, DELTA_HI),
            delta_lo: bytes_const(b, DELTA_LO),
            displacements,
        }
    }

    /// The bf16 words of the 16 codes of an `I8X16`: words of codes 0‥8
    /// and of codes 8‥16, each 16 bytes (as `I8X16`).
    pub fn words(&self, b: &mut FunctionBuilder, codes: Value) -> (Value, Value) {
        let mag = b.ins().band(codes, self.k7f);
        let sign = b.ins().band(codes, self.k80);
        let halves = b.ins().bitcast(types::I16X8, little(), codes);
        // Per byte `code >> 4 & 7` (the bits shifted in from the next byte
        // land in bits 4‥7 and are masked off).
        let high = b.ins().ushr_imm_u(halves, 4);
        let high = b.ins().bitcast(types::I8X16, little(), high);
        let high = b.ins().band(high, self.k07);
        let high = b.ins().iadd(high, self.k3c);
        // Per byte `code << 4 & 0xF0`.
        let low = b.ins().ishl_imm_u(halves, 4);
        let low = b.ins().bitcast(types::I8X16, little(), low);
        let low = b.ins().band(low, self.kf0);
        let dh = b.ins().swizzle(self.delta_hi, mag);
        let dl = b.ins().swizzle(self.delta_lo, mag);
        let high = b.ins().iadd(high, dh);
        let low = b.ins().iadd(low, dl);
        let nan = b.ins().icmp(IntCC::Equal, mag, self.k7f);
        let nan = b.ins().band(nan, self.k7f);
        let high = b.ins().bor(high, nan);
        let high = b.ins().bor(high, sign);
        let first = interleave(b, low, high, 0);
        let second = interleave(b, low, high, 8);
        (first, second)
    }

    /// Convert the `count` codes at `src + src_off` (`count` a multiple of
    /// 4) to `2·count` bytes of bf16 words at `dst + dst_off`: 16 codes per
    /// step (one 16-byte load, two 16-byte stores), then 8 and 4.
    pub fn convert_row(
        &self,
        b: &mut FunctionBuilder,
        src: Value,
        src_off: usize,
        dst: Value,
        dst_off: usize,
        count: usize,
    ) {
        assert!(count.is_multiple_of(4), "whole groups of 4 codes, got {count}");
        let at = |bytes: usize| self.displacements.of(bytes);
        let mut o = 0;
        while o < count {
            let (s, d) = (at(src_off + o), at(dst_off + 2 * o));
            match count - o {
                16.. => {
                    let codes = b.ins().load(types::I8X16, mem(), src, s);
                    let (w0, w1) = self.words(b, codes);
                    b.ins().store(mem(), w0, dst, d);
                    b.ins().store(mem(), w1, dst, at(dst_off + 2 * o + 16));
                    o += 16;
                }
                8.. => {
                    let x = b.ins().load(types::I64, mem(), src, s);
                    let v = b.ins().scalar_to_vector(types::I64X2, x);
                    let codes = b.ins().bitcast(types::I8X16, little(), v);
                    let (w0, _) = self.words(b, codes);
                    b.ins().store(mem(), w0, dst, d);
                    o += 8;
                }
                _ => {
                    let x = b.ins().load(types::I32, mem(), src, s);
                    let v = b.ins().scalar_to_vector(types::I32X4, x);
                    let codes = b.ins().bitcast(types::I8X16, little(), v);
                    let (w0, _) = self.words(b, codes);
                    let w0 = b.ins().bitcast(types::I64X2, little(), w0);
                    let w0 = b.ins().extractlane(w0, 0);
                    b.ins().store(mem(), w0, dst, d);
                    o += 4;
                }
            }
        }
    }
}

/// Bytes `from‥from+8` of `low` and `high` interleaved (`low[i], high[i]`):
/// 8 little-endian 16-bit words.
fn interleave(b: &mut FunctionBuilder, low: Value, high: Value, from: u8) -> Value {
    let lanes: Vec<u8> = (from..from + 8).flat_map(|i| [i, 16 + i]).collect();
    let mask = b.func.dfg.immediates.push(lanes.into());
    b.ins().shuffle(low, high, mask)
}
