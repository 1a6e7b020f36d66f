//! The `mo.silu` arithmetic on one `F32X4` vector ([`silu_f32x4`]); the
//! platform's elementwise map ([`kvjit_op::elementwise::compile_map`])
//! loads each vector from the dtype and rounds it once on the store.

use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::FunctionBuilder;
use kvjit_jit::ir::math::exp_f32x4;
use kvjit_jit::ir::splat_f32;
use kvjit_jit::{cranelift_codegen, cranelift_frontend};

/// Emit `silu(x)` on the four lanes of an `F32X4`, computed from
/// `e = e^−|x|` so that nothing overflows:
///
/// - `x ≥ 0`: `x / (1 + e)`; `x < 0`: `x·e / (1 + e)`.
/// - Where `|x| > 64`, `e^−|x|` would leave the normal range (subnormal
///   below −87.3, which would cost `x·e` its precision): `e' = e^(−|x| + 64)`
///   is computed instead (`−|x| + 64` is exact for `|x| ≤ 128`; beyond, the
///   result underflows anyway), `1 + e` is 1 (`e < 2^−92`), and a negative
///   `x` gives `(x·e') · e^−64`, rounded once more where the result is
///   tiny (subnormal results are thus correctly rounded within an ulp).
/// - `x = −∞` gives −0 (`x` is clamped to −200 before `x·e`, where `e` is
///   already 0), `+∞` gives `+∞`, NaN gives NaN (every step propagates it).
///
/// About 45 instructions on x86-64 with AVX2, of which `exp` is 25.
pub(crate) fn silu_f32x4(b: &mut FunctionBuilder, x: Value) -> Value {
    let as_float = |b: &mut FunctionBuilder, mask: Value| b.ins().bitcast(types::F32X4, MemFlagsData::new(), mask);
    let (zero, one) = (splat_f32(b, 0.0), splat_f32(b, 1.0));

    let magnitude = b.ins().fabs(x);
    let minus_abs = b.ins().fneg(magnitude);
    let limit = splat_f32(b, -64.0);
    let far = b.ins().fcmp(FloatCC::LessThan, minus_abs, limit);
    let far = as_float(b, far);
    let shift = splat_f32(b, 64.0);
    let shift = b.ins().bitselect(far, shift, zero);
    let exponent = b.ins().fadd(minus_abs, shift);
    let e = exp_f32x4(b, exponent);

    let e_near = b.ins().bitselect(far, zero, e);
    let denominator = b.ins().fadd(one, e_near);

    let negative = b.ins().fcmp(FloatCC::LessThan, x, zero);
    let negative = as_float(b, negative);
    let floor = splat_f32(b, -200.0);
    let below = b.ins().fcmp(FloatCC::LessThan, x, floor);
    let below = as_float(b, below);
    let clamped = b.ins().bitselect(below, floor, x);
    let x_e = b.ins().fmul(clamped, e);
    let numerator = b.ins().bitselect(negative, x_e, x);
    let quotient = b.ins().fdiv(numerator, denominator);

    let rescale = b.ins().band(negative, far);
    let e_minus_64 = splat_f32(b, (-64f64).exp() as f32);
    let factor = b.ins().bitselect(rescale, e_minus_64, one);
    b.ins().fmul(quotient, factor)
}
