//! What the tests share: kernels for a spec, random tables (random bit
//! patterns: NaNs, infinities and subnormals included) and ids, and runs
//! of both kernels with the output NaN-poisoned (between canary guards for
//! the JIT).

#![allow(dead_code, reason = "each test file uses a part of the common module")]

use kvjit_core::{DType, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_gather::{GatherSpec, JitKernel, ReferenceKernel};
use kvjit_runtime::{DeviceContextPtr, Kernel};
use kvjit_testkit::{Guarded, nan_bytes, poison};
use rand::Rng;

/// Canary bytes on each side of a JIT output.
pub const GUARD: usize = 64;

pub fn spec(dtype: DType, vocab: usize, hidden: usize, step: StepDims) -> GatherSpec {
    GatherSpec { target: Target::Cpu, dtype, table: dtype, vocab, hidden, step }
}

pub fn jit(spec: GatherSpec) -> JitKernel {
    JitKernel::new(spec, CaptureText::default()).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
}

pub fn ctx(threads: usize) -> DeviceContextPtr {
    DeviceContextPtr::cpu(threads).unwrap()
}

/// A `[vocab, hidden]` table of random bit patterns.
pub fn random_table(rng: &mut impl Rng, dtype: DType, vocab: usize, hidden: usize) -> Tensor {
    let bytes: Vec<u8> = (0..vocab * hidden * dtype.size_bytes()).map(|_| rng.r#gen()).collect();
    Tensor::from_le_bytes(dtype, &[vocab, hidden], &bytes).unwrap()
}

/// `[batch, seq]` ids, each below `vocab`.
pub fn random_ids(rng: &mut impl Rng, vocab: usize, batch: usize, seq: usize) -> Tensor {
    let ids: Vec<u32> = (0..batch * seq).map(|_| rng.gen_range(0..vocab as u32)).collect();
    Tensor::from_vec(&[batch, seq], ids).unwrap()
}

/// The output shape of a call.
pub fn out_shape(table: &Tensor, ids: &Tensor) -> Vec<usize> {
    vec![ids.shape()[0], ids.shape()[1], table.shape()[1]]
}

/// The JIT's output, written into a NaN-poisoned buffer between canary
/// guards (checked).
pub fn run_jit(kernel: &JitKernel, table: &Tensor, ids: &Tensor, threads: usize) -> Tensor {
    let shape = out_shape(table, ids);
    let mut out = Guarded::new(GUARD, &nan_bytes(table.dtype(), shape.iter().product()), GUARD);
    kernel.run_into(&[table, ids], &mut [], out.body_mut(), &ctx(threads)).unwrap_or_else(|e| panic!("JIT: {e}"));
    out.assert_guards(&format!("gather {} {shape:?}, {threads} threads", table.dtype()));
    Tensor::from_le_bytes(table.dtype(), &shape, out.body()).unwrap()
}

/// The reference's output through the platform's `Kernel` (output
/// poisoned first).
pub fn run_reference(spec: GatherSpec, table: &Tensor, ids: &Tensor) -> Tensor {
    let kernel = Compiled::new(ReferenceKernel::new(spec));
    let mut out = Tensor::zeros(table.dtype(), &out_shape(table, ids)).unwrap();
    poison(&mut out);
    kernel.run(&[table, ids], &mut [], std::slice::from_mut(&mut out), &ctx(1)).unwrap();
    out
}

/// What the output must be, indexed here: row r is the table's row
/// `ids[r]`, byte for byte.
pub fn expected_bytes(table: &Tensor, ids: &Tensor) -> Vec<u8> {
    let row = table.shape()[1] * table.dtype().size_bytes();
    let bytes = table.as_bytes();
    ids.as_slice::<u32>()
        .unwrap()
        .iter()
        .flat_map(|&id| &bytes[id as usize * row..(id as usize + 1) * row])
        .copied()
        .collect()
}
