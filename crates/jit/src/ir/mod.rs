//! The emitter kit: counted loops and branches ([`counted_loop`], [`when`],
//! [`if_else`]), and vector loads/stores that convert between a tensor's
//! dtype and f32 lanes.
//!
//! Everything computes in `F32X4` (x86-64 Cranelift lowers 128-bit vectors
//! only). bf16 widens by integer widen + shift; f16 by integer bit
//! manipulation and one multiply; narrowing rounds to nearest, ties to even.
//! Both directions match the `half` crate bit for bit, NaN payloads and
//! quieting included (the `_raw` loads skip bf16 NaN quieting, for lanes
//! that only feed arithmetic).
//!
//! The submodules hold the rest of the kit every emitter shares:
//!
//! - [`addr`]: address arithmetic — indexed elements, constant
//!   displacements checked at kernel build, sizes baked in or read at run
//!   time.
//! - [`e4m3`]: FP8 (E4M3) codes to and from f32 lanes, a block quantized
//!   with its scale, codes re-encoded as bf16.
//! - [`math`]: `exp` on F32X4.
//! - [`shuffle`]: lanes picked from two F32X4, the 4×4 transpose-add.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{self, InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_core::DType;

pub mod addr;
mod control;
pub mod e4m3;
pub mod math;
pub mod shuffle;

pub use control::{counted_loop, if_else, match_cases, when};

/// Flags for loads and stores the caller has proven in bounds and aligned
/// enough for unaligned vector moves.
pub fn mem() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Load 4 consecutive elements of `dtype` at `ptr + offset` bytes, widened to
/// an `F32X4`, bit for bit as `half`'s `to_f32` (NaNs included; see
/// [`widen_i32x4`]).
///
/// On x86-64 bf16 takes 4 instructions (`vpmovzxwd` from memory, `vpslld`,
/// a zeroing `vxorps`, `vsubps` to quiet signalling NaNs as `half` does);
/// [`load_f32x4_raw`] skips the quieting (2 instructions) where every lane
/// only feeds arithmetic. f16 takes 14 (5 of them constant-pool loads).
pub fn load_f32x4(b: &mut FunctionBuilder, dtype: DType, ptr: Value, offset: i32) -> Value {
    match dtype {
        DType::F32 => b.ins().load(types::F32X4, mem(), ptr, offset),
        DType::BF16 => {
            let t = load_f32x4_raw(b, dtype, ptr, offset);
            quiet_nan(b, t)
        }
        DType::F16 => {
            let h = b.ins().uload16x4(mem(), ptr, offset);
            widen_i32x4(b, dtype, h)
        }
        DType::F8E4M3 => {
            let codes = e4m3::load_codes(b, ptr, offset);
            e4m3::widen_i32x4(b, codes)
        }
        // U32 and the weight block formats.
        _ => no_float_lanes(dtype),
    }
}

/// [`load_f32x4`] without quieting bf16 signalling NaNs: bf16 is just
/// `h << 16` (`vpmovzxwd` from memory and `vpslld` on x86-64). It differs
/// from `half`'s `to_f32` only for the 126 bf16 signalling-NaN patterns,
/// which stay signalling; any float arithmetic on them (`fma`, `fmul`,
/// `fadd`) quiets them exactly as [`load_f32x4`] would have, so use it in
/// inner loops whose loaded lanes only feed arithmetic. f32 and f16 are
/// the same as [`load_f32x4`] (the f16 widening quiets for free).
pub fn load_f32x4_raw(b: &mut FunctionBuilder, dtype: DType, ptr: Value, offset: i32) -> Value {
    match dtype {
        DType::BF16 => {
            let h = b.ins().uload16x4(mem(), ptr, offset);
            let t = b.ins().ishl_imm_u(h, 16);
            b.ins().bitcast(types::F32X4, MemFlagsData::new(), t)
        }
        _ => load_f32x4(b, dtype, ptr, offset),
    }
}

/// Load one element of `dtype` at `ptr + offset`, widened to f32 and splat
/// to all four lanes, bit for bit as `half`'s `to_f32`.
///
/// On x86-64 bf16 takes 4 instructions (`vpbroadcastw` from memory,
/// `vpslld`, and the NaN quieting of [`load_f32x4`]); f16 16. If the
/// result is used more than once, Cranelift will not fold the load into
/// `vpbroadcastw` (it never sinks a load whose value reaches several uses),
/// and bf16 costs 2 more (`movzwl`, `vmovd`).
pub fn load_splat_f32x4(b: &mut FunctionBuilder, dtype: DType, ptr: Value, offset: i32) -> Value {
    match dtype {
        DType::F32 => {
            let x = b.ins().load(types::F32, mem(), ptr, offset);
            b.ins().splat(types::F32X4, x)
        }
        DType::BF16 => {
            let t = load_splat_f32x4_raw(b, dtype, ptr, offset);
            quiet_nan(b, t)
        }
        DType::F16 => {
            // A zero-extending scalar load and `vpbroadcastd` (the widening
            // uses `h` twice, so a `vpbroadcastw` could not take the load as
            // its memory operand anyway).
            let h = b.ins().uload16(types::I32, mem(), ptr, offset);
            let h = b.ins().splat(types::I32X4, h);
            widen_i32x4(b, dtype, h)
        }
        DType::F8E4M3 => {
            let code = b.ins().uload8(types::I32, mem(), ptr, offset);
            let code = b.ins().splat(types::I32X4, code);
            e4m3::widen_i32x4(b, code)
        }
        // U32 and the weight block formats.
        _ => no_float_lanes(dtype),
    }
}

/// [`load_splat_f32x4`] without quieting bf16 signalling NaNs (2
/// instructions on x86-64); see [`load_f32x4_raw`] for when that is safe.
pub fn load_splat_f32x4_raw(b: &mut FunctionBuilder, dtype: DType, ptr: Value, offset: i32) -> Value {
    match dtype {
        DType::BF16 => {
            // Every 32-bit lane of the broadcast holds `h | h << 16`.
            let h = splat_u16_pairs(b, ptr, offset);
            let t = b.ins().ishl_imm_u(h, 16);
            b.ins().bitcast(types::F32X4, MemFlagsData::new(), t)
        }
        _ => load_splat_f32x4(b, dtype, ptr, offset),
    }
}

/// Broadcast the 16-bit value at `ptr + offset` to all 8 halves
/// (`vpbroadcastw` from memory with AVX2), viewed as `I32X4`.
fn splat_u16_pairs(b: &mut FunctionBuilder, ptr: Value, offset: i32) -> Value {
    let h = b.ins().load(types::I16, mem(), ptr, offset);
    let h = b.ins().splat(types::I16X8, h);
    b.ins().bitcast(types::I32X4, little(), h)
}

/// Round an `F32X4` to `dtype` and store its 4 lanes at `ptr + offset`.
///
/// Rounds to nearest, ties to even, exactly as `half`'s `from_f32` does,
/// NaN payloads included (see [`narrow_i32x4`]).
pub fn store_f32x4(b: &mut FunctionBuilder, dtype: DType, value: Value, ptr: Value, offset: i32) {
    match dtype {
        DType::F32 => {
            b.ins().store(mem(), value, ptr, offset);
        }
        DType::BF16 | DType::F16 => {
            let n = narrow_i32x4(b, dtype, value);
            // Every lane is ≤ 0xffff, so the unsigned saturating pack is exact.
            let packed = b.ins().unarrow(n, n);
            // The low 8 bytes hold the 4 elements: store them as one f64
            // (`vmovsd`; lane 0 of a float vector needs no extraction).
            let pair = b.ins().bitcast(types::F64X2, little(), packed);
            let low = b.ins().extractlane(pair, 0);
            b.ins().store(mem(), low, ptr, offset);
        }
        DType::F8E4M3 => no_scale(dtype),
        // U32 and the weight block formats.
        _ => no_float_lanes(dtype),
    }
}

/// Round lane `lane` of an `F32X4` to `dtype` and store it alone at
/// `ptr + offset` (tails narrower than a vector).
pub fn store_lane(b: &mut FunctionBuilder, dtype: DType, value: Value, lane: u8, ptr: Value, offset: i32) {
    match dtype {
        DType::F32 => {
            let x = b.ins().extractlane(value, lane);
            b.ins().store(mem(), x, ptr, offset);
        }
        DType::BF16 | DType::F16 => {
            assert!(lane < 4, "an F32X4 has lanes 0..4, not {lane}");
            let n = narrow_i32x4(b, dtype, value);
            let halves = b.ins().bitcast(types::I16X8, little(), n);
            // Little-endian: lane `lane`'s low 16 bits are 16-bit lane 2·lane.
            let x = b.ins().extractlane(halves, 2 * lane);
            b.ins().store(mem(), x, ptr, offset);
        }
        DType::F8E4M3 => no_scale(dtype),
        // U32 and the weight block formats.
        _ => no_float_lanes(dtype),
    }
}

/// Widen an `I32X4` whose lanes hold zero-extended 16-bit `dtype` patterns
/// (bf16 or f16) to `F32X4`, bit for bit as `half`'s `to_f32`.
///
/// Both formats leave NaNs to one float operation, which quiets a signalling
/// NaN (sets mantissa bit 22) and keeps its payload, as `half` does; every
/// other input passes through it exactly. This relies on the IEEE 754
/// recommended NaN propagation x86-64 SSE/AVX and AArch64 (FPCR.DN = 0, the
/// Linux default) implement, on round-to-nearest, and on subnormal inputs
/// not being flushed (no DAZ) — the state Rust programs run in. The
/// exhaustive tests in `tests/convert.rs` check all 65536 patterns.
///
/// - bf16: `h << 16`, then `- 0.0` to quiet NaNs.
/// - f16: place sign, exponent and mantissa at their f32 positions
///   (`(h << 16) >> 3` arithmetic, masked), so the value is `x · 2^-112`;
///   where the exponent is all ones (inf/NaN) set the f32 exponent to all
///   ones; one multiply by 2^112 then rebiases normals, normalises
///   subnormals exactly, keeps ±0 and ±inf and quiets NaNs.
///
/// # Panics
/// For dtypes other than bf16 and f16.
pub fn widen_i32x4(b: &mut FunctionBuilder, dtype: DType, h: Value) -> Value {
    let t = b.ins().ishl_imm_u(h, 16);
    match dtype {
        DType::BF16 => {
            let t = b.ins().bitcast(types::F32X4, MemFlagsData::new(), t);
            quiet_nan(b, t)
        }
        DType::F16 => {
            // Sign to bit 31 (and 30..28, masked off), exponent to 27..23,
            // mantissa to 22..13.
            let s = b.ins().sshr_imm_u(t, 3);
            let v = band_const(b, s, 0x8fff_e000);
            let m = band_const(b, h, 0x7fff);
            let limit = splat_u32(b, 0x7bff);
            let inf_or_nan = b.ins().icmp(IntCC::SignedGreaterThan, m, limit);
            let exp = band_const(b, inf_or_nan, 0x7f80_0000);
            let v = b.ins().bor(v, exp);
            let v = b.ins().bitcast(types::F32X4, MemFlagsData::new(), v);
            let scale = splat_f32(b, f32::from_bits((127 + 112) << 23));
            b.ins().fmul(v, scale)
        }
        other => panic!("widen_i32x4 converts bf16 and f16, not {other}"),
    }
}

/// Round an `F32X4` to `dtype` (bf16 or f16) to nearest, ties to even,
/// bit for bit as `half`'s `from_f32`; returns an `I32X4` whose lanes hold
/// the 16-bit patterns, zero-extended.
///
/// - bf16: `(x + 0x7fff + lsb) >> 16`; NaN lanes (found with an unordered
///   compare) become `(x >> 16) | 0x0040`.
/// - f16, on `a = |x|` bits: normal results round by integer add of the
///   rebias, `0xfff` and the result's lowest bit, then shift; `smin` with
///   `0x7c00` turns overflow (and inf/NaN) into inf; NaN lanes become
///   `0x7e00 | (mantissa >> 13)`; results below 2^-14 come from adding
///   0.5 in floating point, whose ulp (2^-24) is the f16 subnormal step, so
///   the FPU rounds to nearest even, and subtracting 0.5's bits. The sign
///   is ORed back last.
///
/// # Panics
/// For dtypes other than bf16 and f16.
pub fn narrow_i32x4(b: &mut FunctionBuilder, dtype: DType, value: Value) -> Value {
    let x = b.ins().bitcast(types::I32X4, MemFlagsData::new(), value);
    match dtype {
        DType::BF16 => {
            let hi = b.ins().ushr_imm_u(x, 16);
            let lsb = band_const(b, hi, 1);
            let r = b.ins().iadd(x, lsb);
            let bias = splat_u32(b, 0x7fff);
            let r = b.ins().iadd(r, bias);
            let r = b.ins().ushr_imm_u(r, 16);
            let nan = bor_const(b, hi, 0x0040);
            let is_nan = b.ins().fcmp(FloatCC::Unordered, value, value);
            b.ins().bitselect(is_nan, nan, r)
        }
        DType::F16 => {
            let a = band_const(b, x, 0x7fff_ffff);
            let sign = b.ins().bxor(x, a);
            let sign = b.ins().ushr_imm_u(sign, 16);
            // Normal range: rebias (-112 << 23), add 0xfff + lsb, shift.
            let t = b.ins().ushr_imm_u(a, 13);
            let lsb = band_const(b, t, 1);
            let r = b.ins().iadd(a, lsb);
            let bias = splat_u32(b, 0x0fff_u32.wrapping_sub(112 << 23));
            let r = b.ins().iadd(r, bias);
            let r = b.ins().ushr_imm_u(r, 13);
            let inf = splat_u32(b, 0x7c00);
            let r = b.ins().smin(r, inf);
            // NaN: t = 0x3fc00 | mantissa >> 13; want 0x7e00 | mantissa >> 13
            // (the quiet bit 0x200 may already be set, so OR it first).
            let nan = bor_const(b, t, 0x0200);
            let nan_bias = splat_u32(b, 0x7c00_u32.wrapping_sub(0x3fc00));
            let nan = b.ins().iadd(nan, nan_bias);
            let is_nan = b.ins().fcmp(FloatCC::Unordered, value, value);
            let r = b.ins().bitselect(is_nan, nan, r);
            // Subnormal or zero result: |x| < 2^-14.
            let af = b.ins().bitcast(types::F32X4, MemFlagsData::new(), a);
            let half = splat_f32(b, 0.5);
            let sub = b.ins().fadd(af, half);
            let sub = b.ins().bitcast(types::I32X4, MemFlagsData::new(), sub);
            let half_bits = splat_u32(b, 0.5f32.to_bits());
            let sub = b.ins().isub(sub, half_bits);
            let min_normal = splat_u32(b, 113 << 23);
            let is_sub = b.ins().icmp(IntCC::SignedLessThan, a, min_normal);
            let r = b.ins().bitselect(is_sub, sub, r);
            b.ins().bor(r, sign)
        }
        other => panic!("narrow_i32x4 converts bf16 and f16, not {other}"),
    }
}

fn no_scale(dtype: DType) -> ! {
    panic!("{dtype} values are stored with a block scale: quantize with e4m3::narrow_i32x4 and e4m3::store_codes")
}

fn no_float_lanes(dtype: DType) -> ! {
    panic!("{dtype} elements never convert to or from f32 lanes (integers, or weight blocks their own kernels decode)")
}

/// Byte order for bitcasts that change the lane count (kvjit's hosts are
/// little-endian; every emitter uses this one).
pub fn little() -> MemFlagsData {
    MemFlagsData::new().with_endianness(ir::Endianness::Little)
}

/// `x - (+0.0)`: exact for every non-NaN `x` (including ±0 and subnormals,
/// under round-to-nearest) and quiets signalling NaNs, keeping the payload.
/// The zero is a register-zeroing idiom rather than a constant-pool load.
fn quiet_nan(b: &mut FunctionBuilder, x: Value) -> Value {
    let zero = splat_f32(b, 0.0);
    b.ins().fsub(x, zero)
}

/// An `I32X4` constant with `v` in every lane.
pub fn splat_u32(b: &mut FunctionBuilder, v: u32) -> Value {
    let c = b.func.dfg.constants.insert(v.to_le_bytes().repeat(4).into());
    b.ins().vconst(types::I32X4, c)
}

/// An `F32X4` constant with `v` in every lane.
pub fn splat_f32(b: &mut FunctionBuilder, v: f32) -> Value {
    let c = b.func.dfg.constants.insert(v.to_bits().to_le_bytes().repeat(4).into());
    b.ins().vconst(types::F32X4, c)
}

fn band_const(b: &mut FunctionBuilder, x: Value, v: u32) -> Value {
    let c = splat_u32(b, v);
    b.ins().band(x, c)
}

fn bor_const(b: &mut FunctionBuilder, x: Value, v: u32) -> Value {
    let c = splat_u32(b, v);
    b.ins().bor(x, c)
}

/// Call the native function at `address` (an `extern "C"` function of the
/// host's calling convention, taking `args` by their IR types and returning
/// nothing): its address is baked into the code as a constant.
pub fn call_native(b: &mut FunctionBuilder, address: usize, args: &[Value]) {
    let callee = b.ins().iconst(crate::pointer_type(), address as i64);
    call_native_at(b, callee, args);
}

/// [`call_native`] of the function whose address is the IR value `callee`
/// (one of several baked-in addresses, chosen at run time).
pub fn call_native_at(b: &mut FunctionBuilder, callee: Value, args: &[Value]) {
    let mut signature = ir::Signature::new(b.func.signature.call_conv);
    for &arg in args {
        signature.params.push(ir::AbiParam::new(b.func.dfg.value_type(arg)));
    }
    let signature = b.import_signature(signature);
    b.ins().call_indirect(signature, callee, args);
}
