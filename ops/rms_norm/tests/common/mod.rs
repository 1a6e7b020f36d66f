//! What the tests share: specs and kernels, random rows over a range of
//! magnitudes, and runs of both kernels with the output NaN-poisoned
//! (between canary guards for the JIT).

#![allow(dead_code, reason = "each test file uses a part of the common module")]

use kvjit_core::{DType, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::rows::Rows;
use kvjit_op_rms_norm::{F32_ULPS, JitKernel, ReferenceKernel, RmsNormSpec};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::tolerance::ulp;
use kvjit_testkit::{Guarded, nan_bytes, poison};
use rand::Rng;

/// Canary bytes on each side of a JIT output.
pub const GUARD: usize = 64;

/// Llama's epsilon.
pub const EPSILON: f32 = 1e-5;

pub fn spec(dtype: DType, width: usize, rows: Option<usize>) -> RmsNormSpec {
    RmsNormSpec { target: Target::Cpu, dtype, rows: Rows { width, rows }, epsilon: EPSILON, weight_offset: 0.0 }
}

pub fn jit(spec: RmsNormSpec) -> JitKernel {
    JitKernel::new(spec, CaptureText::default()).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
}

pub fn ctx(threads: usize) -> DeviceContextPtr {
    DeviceContextPtr::cpu(threads).unwrap()
}

/// The JIT's output, written into a NaN-poisoned buffer between canary
/// guards (checked).
pub fn run_jit(kernel: &JitKernel, x: &Tensor, weight: &Tensor, threads: usize) -> Tensor {
    let mut out = Guarded::new(GUARD, &nan_bytes(x.dtype(), x.numel()), GUARD);
    kernel
        .run_into(&[x, weight], &mut [], out.body_mut(), &ctx(threads))
        .unwrap_or_else(|e| panic!("the JIT refused: {e}"));
    out.assert_guards(&format!("rms_norm {} {:?}, {threads} threads", x.dtype(), x.shape()));
    Tensor::from_le_bytes(x.dtype(), x.shape(), out.body()).unwrap()
}

/// The reference's output, through the platform's `Kernel` (output
/// poisoned first).
pub fn run_reference(spec: RmsNormSpec, x: &Tensor, weight: &Tensor) -> Tensor {
    let kernel = Compiled::new(ReferenceKernel::new(RmsNormSpec { rows: Rows { rows: None, ..spec.rows }, ..spec }));
    let mut out = Tensor::zeros(x.dtype(), x.shape()).unwrap();
    poison(&mut out);
    kernel.run(&[x, weight], &mut [], std::slice::from_mut(&mut out), &ctx(1)).unwrap();
    out
}

/// Random signs and magnitudes `10^u`, `u` uniform in `decades` (never
/// zero), rounded to `dtype`.
pub fn random(rng: &mut impl Rng, dtype: DType, shape: &[usize], decades: (f32, f32)) -> Tensor {
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let magnitude = 10f32.powf(rng.gen_range(decades.0..decades.1));
            if rng.r#gen::<bool>() { magnitude } else { -magnitude }
        })
        .collect();
    Tensor::from_f32(dtype, shape, &values).unwrap()
}

/// The largest distance between `got` and `want`, in ulps of the output
/// dtype at the larger magnitude (0 where the bits agree or both are NaN;
/// ∞ where one is NaN).
pub fn ulps(got: &Tensor, want: &Tensor) -> f64 {
    let (g, w) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    g.iter()
        .zip(&w)
        .map(|(&g, &w)| {
            if g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()) {
                return 0.0;
            }
            let (g, w) = (f64::from(g), f64::from(w));
            let error = (g - w).abs() / ulp(got.dtype(), g.abs().max(w.abs()));
            if error.is_nan() { f64::INFINITY } else { error }
        })
        .fold(0.0, f64::max)
}

/// The tolerance in ulps of the output dtype ([`F32_ULPS`] for f32, one
/// step for bf16 and f16).
pub fn allowed_ulps(dtype: DType) -> f64 {
    if dtype == DType::F32 { F32_ULPS } else { 1.0 }
}
