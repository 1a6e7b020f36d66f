//! What the tests share: kernels for a spec, random padded batches (random
//! bit patterns: NaNs, infinities and subnormals included) and valid
//! lengths, and runs of both kernels with the output NaN-poisoned (between
//! canary guards for the JIT).

#![allow(dead_code, reason = "each test file uses a part of the common module")]

use kvjit_core::{DType, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_last_token::{JitKernel, LastTokenSpec, ReferenceKernel};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::{Guarded, nan_bytes, poison};
use rand::Rng;

/// Canary bytes on each side of a JIT output.
pub const GUARD: usize = 64;

pub fn spec(dtype: DType, hidden: usize, step: StepDims) -> LastTokenSpec {
    LastTokenSpec { target: Target::Cpu, dtype, hidden, step }
}

pub fn jit(spec: LastTokenSpec) -> JitKernel {
    JitKernel::new(spec, CaptureText::default()).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
}

pub fn ctx(threads: usize) -> DeviceContextPtr {
    DeviceContextPtr::cpu(threads).unwrap()
}

/// A `shape` tensor of random bit patterns.
pub fn random_x(rng: &mut impl Rng, dtype: DType, shape: &[usize]) -> Tensor {
    let bytes: Vec<u8> = (0..shape.iter().product::<usize>() * dtype.size_bytes()).map(|_| rng.r#gen()).collect();
    Tensor::from_le_bytes(dtype, shape, &bytes).unwrap()
}

/// `values` as u32 `[len]`.
pub fn lengths(values: &[u32]) -> Tensor {
    Tensor::from_vec(&[values.len()], values.to_vec()).unwrap()
}

/// The JIT's output `[B, H]`, written into a NaN-poisoned buffer between
/// canary guards (checked).
pub fn run_jit(kernel: &JitKernel, x: &Tensor, valid: &Tensor, threads: usize) -> Tensor {
    let shape = [x.shape()[0], x.shape()[2]];
    let mut out = Guarded::new(GUARD, &nan_bytes(x.dtype(), shape[0] * shape[1]), GUARD);
    kernel.run_into(&[x, valid], &mut [], out.body_mut(), &ctx(threads)).unwrap_or_else(|e| panic!("JIT: {e}"));
    out.assert_guards(&format!("last_valid_token {} {:?}, {threads} threads", x.dtype(), x.shape()));
    Tensor::from_le_bytes(x.dtype(), &shape, out.body()).unwrap()
}

/// The reference's output through the platform's `Kernel` (output
/// poisoned first).
pub fn run_reference(spec: LastTokenSpec, x: &Tensor, valid: &Tensor) -> Tensor {
    let kernel = Compiled::new(ReferenceKernel::new(spec));
    let mut out = Tensor::zeros(x.dtype(), &[x.shape()[0], x.shape()[2]]).unwrap();
    poison(&mut out);
    kernel.run(&[x, valid], &mut [], std::slice::from_mut(&mut out), &ctx(1)).unwrap();
    out
}

/// What the output must be, indexed here: row b is `x[b, v − 1]` for
/// `v = valid[b] > 0`, else zero bytes.
pub fn expected_bytes(x: &Tensor, valid: &Tensor) -> Vec<u8> {
    let (seq, row) = (x.shape()[1], x.shape()[2] * x.dtype().size_bytes());
    let bytes = x.as_bytes();
    let mut out = Vec::new();
    for (b, &v) in valid.as_slice::<u32>().unwrap().iter().enumerate() {
        match v as usize {
            0 => out.extend(std::iter::repeat_n(0u8, row)),
            v => out.extend_from_slice(&bytes[(b * seq + v - 1) * row..(b * seq + v) * row]),
        }
    }
    out
}
