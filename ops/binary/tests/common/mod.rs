//! What the tests share: kernels for a spec, runs of them with the output
//! NaN-poisoned (between canary guards for the JIT), random operands, and
//! a bit-for-bit comparison.

#![allow(dead_code, reason = "each test file uses a part of the common module")]

use kvjit_core::{DType, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op_binary::{BinaryOperation, BinarySpec, JitKernel, ReferenceKernel};
use kvjit_runtime::DeviceContextPtr;
use kvjit_testkit::calls::run_poisoned;
use kvjit_testkit::values::signed_magnitudes;
use kvjit_testkit::{Guarded, nan_bytes};
use rand::Rng;

/// Canary bytes on each side of a JIT output.
pub const GUARD: usize = 64;

/// Both operations.
pub const OPERATIONS: [BinaryOperation; 2] = [BinaryOperation::Add, BinaryOperation::Mul];

/// Every dtype the ops take.
pub const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

pub fn spec(operation: BinaryOperation, dtype: DType, elements: Option<usize>) -> BinarySpec {
    BinarySpec { target: Target::Cpu, operation, dtype, elements }
}

pub fn jit(spec: BinarySpec) -> JitKernel {
    JitKernel::new(spec, CaptureText::default()).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
}

pub fn ctx(threads: usize) -> DeviceContextPtr {
    DeviceContextPtr::cpu(threads).unwrap()
}

/// The JIT's output for `a`, `b`, written into a NaN-poisoned buffer
/// between canary guards (checked).
pub fn run_jit(kernel: &JitKernel, a: &Tensor, b: &Tensor, threads: usize) -> Tensor {
    let mut out = Guarded::new(GUARD, &nan_bytes(a.dtype(), a.numel()), GUARD);
    kernel.run_into(&[a, b], &mut [], out.body_mut(), &ctx(threads)).unwrap_or_else(|e| panic!("the JIT refused: {e}"));
    out.assert_guards(&format!("{:?} {} {:?}, {threads} threads", kernel_operation(kernel), a.dtype(), a.shape()));
    Tensor::from_le_bytes(a.dtype(), a.shape(), out.body()).unwrap()
}

fn kernel_operation(kernel: &JitKernel) -> BinaryOperation {
    kvjit_op::OpKernel::spec(kernel).operation
}

/// The reference's output for `a`, `b`, through the platform's `Kernel`
/// (output poisoned first).
pub fn run_reference(operation: BinaryOperation, a: &Tensor, b: &Tensor) -> Tensor {
    let kernel = Compiled::new(ReferenceKernel::new(spec(operation, a.dtype(), None)));
    run_poisoned(&kernel, &[a, b], a.dtype(), a.shape(), 1)
}

/// Uniform in ±`range`, never closer to zero than 1/64, rounded to `dtype`.
pub fn random(rng: &mut impl Rng, dtype: DType, shape: &[usize], range: f32) -> Tensor {
    signed_magnitudes(rng, dtype, shape, 1.0 / 64.0, range)
}

/// Elements of `got` and `want` whose bits differ (two NaNs are alike),
/// with the first such pair.
pub fn differing(got: &Tensor, want: &Tensor) -> (usize, Option<(usize, f32, f32)>) {
    assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()));
    let (got, want) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    let mut off = got
        .iter()
        .zip(&want)
        .enumerate()
        .filter(|(_, (g, w))| g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()));
    let first = off.next().map(|(i, (g, w))| (i, *g, *w));
    (first.map_or(0, |_| 1 + off.count()), first)
}

/// Assert `got` equals `want` bit for bit (NaNs alike).
pub fn assert_bits(what: &str, got: &Tensor, want: &Tensor) {
    let (count, first) = differing(got, want);
    assert_eq!(count, 0, "{what}: {count} elements differ, first (index, got, want) {first:?}");
}
