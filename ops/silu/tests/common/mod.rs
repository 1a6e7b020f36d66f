//! What the tests share: kernels for a spec, and runs of them with the
//! output NaN-poisoned (between canary guards for the JIT).

#![allow(dead_code, reason = "each test file uses a part of the common module")]

use kvjit_core::{DType, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op_silu::{JitKernel, ReferenceKernel, SiluSpec};
use kvjit_runtime::DeviceContextPtr;
use kvjit_testkit::calls::run_poisoned;
use kvjit_testkit::values::signed_magnitudes;
use kvjit_testkit::{Guarded, nan_bytes};
use rand::Rng;

/// Canary bytes on each side of a JIT output.
pub const GUARD: usize = 64;

pub fn spec(dtype: DType, elements: Option<usize>) -> SiluSpec {
    SiluSpec { target: Target::Cpu, dtype, elements }
}

pub fn jit(spec: SiluSpec) -> JitKernel {
    JitKernel::new(spec, CaptureText::default()).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
}

pub fn ctx(threads: usize) -> DeviceContextPtr {
    DeviceContextPtr::cpu(threads).unwrap()
}

/// The JIT's output for `x`, written into a NaN-poisoned buffer between
/// canary guards (checked).
pub fn run_jit(kernel: &JitKernel, x: &Tensor, threads: usize) -> Tensor {
    let mut out = Guarded::new(GUARD, &nan_bytes(x.dtype(), x.numel()), GUARD);
    kernel.run_into(&[x], &mut [], out.body_mut(), &ctx(threads)).unwrap_or_else(|e| panic!("the JIT refused: {e}"));
    out.assert_guards(&format!("silu {} {:?}, {threads} threads", x.dtype(), x.shape()));
    Tensor::from_le_bytes(x.dtype(), x.shape(), out.body()).unwrap()
}

/// The reference's output for `x`, through the platform's `Kernel` (output
/// poisoned first).
pub fn run_reference(x: &Tensor) -> Tensor {
    let kernel = Compiled::new(ReferenceKernel::new(spec(x.dtype(), None)));
    run_poisoned(&kernel, &[x], x.dtype(), x.shape(), 1)
}

/// Uniform in ±`range`, never closer to zero than 1/64, rounded to `dtype`.
pub fn random_x(rng: &mut impl Rng, dtype: DType, shape: &[usize], range: f32) -> Tensor {
    signed_magnitudes(rng, dtype, shape, 1.0 / 64.0, range)
}

/// `values` as a `[len]` tensor of `dtype` (each rounded to it).
pub fn tensor(dtype: DType, values: &[f32]) -> Tensor {
    Tensor::from_f32(dtype, &[values.len()], values).unwrap()
}
