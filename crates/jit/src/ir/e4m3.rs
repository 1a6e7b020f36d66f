//! FP8 (E4M3) codes in Cranelift IR: codes re-encoded as the bf16 words of
//! their values, exactly ([`ToBf16`]).
//!
//! Every E4M3 value (3 mantissa bits, exponents 2⁻⁹ … 2⁸, NaN) is exactly
//! a bf16 value, so a kernel reading an FP8 cache can turn each code into
//! the bf16 bits of its **unscaled** value, 16 codes at a time with byte
//! operations only (no float arithmetic, no table in memory), and read the
//! result exactly as a bf16 cache's rows (a zero-extending load and a shift
//! per 4 elements), applying the block scales in registers (the attention
//! kernel's gather does). Per 16 codes ([`ToBf16::words`]):
//!
//! - normal codes (exponent field e ≥ 1): the bf16 bits are `sign << 15 |
//!   (e + 120) << 7 | m << 4`, i.e. high byte `sign | 0x3C + (code >> 4 & 7)`
//!   and low byte `code << 4 & 0xF0` (two byte vectors, each one shift, one
//!   mask, one add);
//! - subnormal codes (e = 0, magnitudes 0‥7) need normalising: a 16-entry
//!   table of corrections per byte, looked up with the magnitude as index
//!   (`swizzle`: indices ≥ 16 give 0, so only magnitudes < 16 are touched,
//!   and the entries 8‥15 are 0), added to both bytes;
//! - the NaN magnitude 0x7f: the high byte gets all exponent bits (`0x7F`);
//!   the low byte is already `0xF0`, so the word is a quiet NaN;
//! - the sign is ORed into the high byte, and the two byte vectors are
//!   interleaved into 16 little-endian words (`punpcklbw`/`punpckhbw`).

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{InstBuilder, Value, types};
use cranelift_frontend::FunctionBuilder;

use super::{little, mem};

/// Subnormal corrections of the high byte, by magnitude: the bf16 high byte
/// of `m · 2⁻⁹` minus the normal formula's `0x3C`, wrapping
/// (0 → 0x00, 1‥3 → 0x3B, 4‥7 → 0x3C). Entries 8‥15 (exponent 1) are 0.
const DELTA_HI: [u8; 16] = [0xC4, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// Subnormal corrections of the low byte: the bf16 low byte of `m · 2⁻⁹`
/// (0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60) minus the normal
/// formula's `m << 4`, wrapping.
const DELTA_LO: [u8; 16] = [0x00, 0xF0, 0x60, 0x90, 0xC0, 0xD0, 0xE0, 0xF0, 0, 0, 0, 0, 0, 0, 0, 0];

/// The E4M3 → bf16 re-encoding (see the module docs), with its constants
/// made once outside the loops (the kernels compile without Cranelift's
/// optimiser, which would otherwise rematerialise them per use).
#[derive(Clone, Copy, Debug)]
pub struct ToBf16 {
    k7f: Value,
    k80: Value,
    k07: Value,
    k3c: Value,
    kf0: Value,
    delta_hi: Value,
    delta_lo: Value,
}

fn bytes_const(b: &mut FunctionBuilder, bytes: [u8; 16]) -> Value {
    let c = b.func.dfg.constants.insert(bytes.to_vec().into());
    b.ins().vconst(types::I8X16, c)
}

impl ToBf16 {
    /// Emit the constants (at a point that dominates every use).
    pub fn new(b: &mut FunctionBuilder) -> Self {
        Self {
            k7f: bytes_const(b, [0x7f; 16]),
            k80: bytes_const(b, [0x80; 16]),
            k07: bytes_const(b, [0x07; 16]),
            k3c: bytes_const(b, [0x3c; 16]),
            kf0: bytes_const(b, [0xf0; 16]),
            delta_hi: bytes_const(b, DELTA_HI),
            delta_lo: bytes_const(b, DELTA_LO),
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
        src_off: i32,
        dst: Value,
        dst_off: i32,
        count: usize,
    ) {
        assert!(count.is_multiple_of(4), "whole groups of 4 codes, got {count}");
        let mut o = 0;
        while o < count {
            let (s, d) = (src_off + o as i32, dst_off + 2 * o as i32);
            match count - o {
                16.. => {
                    let codes = b.ins().load(types::I8X16, mem(), src, s);
                    let (w0, w1) = self.words(b, codes);
                    b.ins().store(mem(), w0, dst, d);
                    b.ins().store(mem(), w1, dst, d + 16);
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

#[cfg(test)]
mod tests {
    use kvjit_core::fp8::e4m3_to_f32;
    use kvjit_core::{DType, KernelKey, Target};
    use kvjit_runtime::DeviceContextPtr;

    use super::*;
    use crate::{CaptureText, compile_kernel};

    /// The bf16 words the emitted code makes from `codes` (`count` at a time).
    fn convert(codes: &[u8], count: usize) -> Vec<u16> {
        let key = KernelKey::new(&format!("test_e4m3_to_bf16_{count}"), Target::Cpu, DType::F32);
        let code = compile_kernel(&key, CaptureText::default(), |b, params| {
            let src = params.arg(b, 0);
            let dst = params.arg(b, 1);
            let conv = ToBf16::new(b);
            conv.convert_row(b, src, 0, dst, 0, count);
        })
        .unwrap();
        let mut out = Vec::new();
        for chunk in codes.chunks(count) {
            let mut src = chunk.to_vec();
            src.resize(count, 0);
            // Guard bytes after the words catch a store past the row.
            let mut dst = vec![0xA5A5u16; count + 8];
            let args = [src.as_ptr() as u64, dst.as_mut_ptr() as u64];
            // SAFETY: the kernel reads `count` bytes at args[0] (`src` has
            // `count`) and writes `2·count` bytes at args[1] (`dst` has
            // `2·count + 16`); both outlive the call.
            unsafe { crate::launch(&code, &args, 1, &DeviceContextPtr::cpu(1).unwrap()) };
            assert!(dst[count..].iter().all(|&w| w == 0xA5A5), "wrote past the row");
            out.extend_from_slice(&dst[..chunk.len()]);
        }
        out
    }

    #[test]
    fn every_code_becomes_its_exact_bf16() {
        let codes: Vec<u8> = (0..=255).collect();
        // 16 at a time, and the 8- and 4-code tails.
        for (count, codes) in [(256, codes.clone()), (12, codes.clone()), (4, codes.clone())] {
            let words = convert(&codes, count);
            for (&code, &word) in codes.iter().zip(&words) {
                let value = e4m3_to_f32(code);
                let widened = f32::from_bits(u32::from(word) << 16);
                if value.is_nan() {
                    assert!(widened.is_nan(), "code {code:#04x} (count {count}): NaN, got {word:#06x}");
                    assert_eq!(word >> 15, u16::from(code >> 7), "code {code:#04x}: NaN keeps its sign");
                } else {
                    assert_eq!(value.to_bits() & 0xffff, 0, "E4M3 values fit bf16");
                    assert_eq!(
                        widened.to_bits(),
                        value.to_bits(),
                        "code {code:#04x} (count {count}): want {value} ({:#010x}), got {word:#06x}",
                        value.to_bits()
                    );
                }
            }
        }
    }
}
