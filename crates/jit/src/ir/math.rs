//! Transcendental functions for Cranelift IR (which has no such
//! instructions): a vectorized `exp`, [`exp_f32x4`], and `silu` on it,
//! [`silu_f32x4`] (`mo.silu`'s arithmetic, and the fused GEMM epilogues').

use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::{InstBuilder, MemFlagsData, Value, types};
use cranelift_frontend::FunctionBuilder;

use super::{splat_f32, splat_u32};

/// Largest relative error of [`exp_f32x4`] against the exact `e^x`
/// where the result is a normal f32 (`-87.33 ≤ x ≤ 88.72`), as asserted by
/// the sweep in `tests/exp.rs` (10^6 points over [-104, 89] plus special
/// values): 1.5·2^-24 ≈ 8.9e-8. Measured on x86-64 (AVX2/FMA): 1.27·2^-24
/// ≈ 7.6e-8, i.e. within about 1.3 units of f32 roundoff (a correctly
/// rounded exp would reach 0.5).
pub const EXP_MAX_REL_ERROR: f64 = 1.5 / (1u64 << 24) as f64;

/// Emit `e^x` for the four f32 lanes of `x` (an `F32X4`); returns an `F32X4`.
///
/// - Range reduction: `x = n·ln2 + r`, `n = round(x·log2 e)` by the
///   `1.5·2^23` magic-number trick (one FMA, round to nearest even; `n` as
///   an integer is the bit difference), `r = x − n·C1 − n·C2` with Cody and
///   Waite's split of ln 2 (C1 = 0.693359375 has 9 bits, so `n·C1` is exact),
///   `|r| ≤ ln2/2`.
/// - `e^r`: the degree-7 Taylor polynomial in Horner form with FMAs
///   (truncation error < 6e-9 relative on `|r| ≤ ln2/2`).
/// - Scaling by `2^n` in two exact steps: `n = n1 + n2`, `n1 = n >> 1` is
///   added into the exponent bits of `e^r` by an integer add, then one
///   multiply by `2^n2` (built from its exponent bits) rounds once — so
///   results in the subnormal range are correctly rounded from the
///   polynomial and overflow goes to +inf by itself.
/// - Special inputs: `x` is first clamped to [-104, 89]: every
///   `x ≤ -103.98` (including `-inf` from masking) gives exactly +0, every
///   `x ≥ 88.73` (including `+inf`) gives +inf; NaN lanes return NaN.
///
/// Accuracy: relative error at most [`EXP_MAX_REL_ERROR`] for normal
/// results; results below 2^-126 (`x < -87.34`) are within that relative
/// error plus half a subnormal step (2^-150) absolute.
///
/// On x86-64 this is about 25 instructions (3 compares/blends, 10 FMAs, a
/// handful of integer vector ops, 1 multiply) and needs AVX2/FMA, which
/// [`host_isa`](crate::host_isa) enables where the host has them.
pub fn exp_f32x4(b: &mut FunctionBuilder, x: Value) -> Value {
    let flags = MemFlagsData::new();
    let as_float = |b: &mut FunctionBuilder, v: Value| b.ins().bitcast(types::F32X4, flags, v);
    let as_int = |b: &mut FunctionBuilder, v: Value| b.ins().bitcast(types::I32X4, flags, v);

    // Clamp (NaN lanes compare false and pass through).
    let lo = splat_f32(b, -104.0);
    let hi = splat_f32(b, 89.0);
    let below = b.ins().fcmp(FloatCC::LessThan, x, lo);
    let below = as_float(b, below);
    let xc = b.ins().bitselect(below, lo, x);
    let above = b.ins().fcmp(FloatCC::GreaterThan, xc, hi);
    let above = as_float(b, above);
    let xc = b.ins().bitselect(above, hi, xc);

    // n = round(x·log2 e), as float and as integer.
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23
    let log2e = splat_f32(b, std::f32::consts::LOG2_E);
    let magic = splat_f32(b, MAGIC);
    let t = b.ins().fma(xc, log2e, magic);
    let n = b.ins().fsub(t, magic);
    let t_bits = as_int(b, t);
    let magic_bits = splat_u32(b, MAGIC.to_bits());
    let n_int = b.ins().isub(t_bits, magic_bits);

    // r = x − n·ln2 (Cody–Waite).
    let c1 = splat_f32(b, -0.693_359_4);
    let c2 = splat_f32(b, 2.121_944_4e-4);
    let r = b.ins().fma(n, c1, xc);
    let r = b.ins().fma(n, c2, r);

    // e^r ≈ Σ r^k / k!, k ≤ 7.
    let mut p = splat_f32(b, 1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        let c = splat_f32(b, c);
        p = b.ins().fma(p, r, c);
    }

    // p · 2^n1 · 2^n2.
    let n1 = b.ins().sshr_imm_u(n_int, 1);
    let n2 = b.ins().isub(n_int, n1);
    let n1_exp = b.ins().ishl_imm_u(n1, 23);
    let p_bits = as_int(b, p);
    let scaled = b.ins().iadd(p_bits, n1_exp);
    let scaled = as_float(b, scaled);
    let bias = splat_u32(b, 127);
    let n2_biased = b.ins().iadd(n2, bias);
    let two_n2 = b.ins().ishl_imm_u(n2_biased, 23);
    let two_n2 = as_float(b, two_n2);
    let result = b.ins().fmul(scaled, two_n2);

    // NaN in, NaN out (the exponent add above could have made it a number).
    let nan = b.ins().fcmp(FloatCC::Unordered, x, x);
    let nan = as_float(b, nan);
    b.ins().bitselect(nan, x, result)
}

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
pub fn silu_f32x4(b: &mut FunctionBuilder, x: Value) -> Value {
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
