//! Calls of a tensor-only kernel (no caches) that tests make again and
//! again: a poisoned output, and a call that must be refused with nothing
//! written.

use kvjit_core::{DType, Error, Tensor};
use kvjit_runtime::{DeviceContextPtr, Kernel};

use crate::poison::poison;

/// A tensor of `dtype` and `shape` full of NaN poison: any element a kernel
/// leaves unwritten stands out.
///
/// # Panics
///
/// If the tensor cannot be allocated.
pub fn poisoned(dtype: DType, shape: &[usize]) -> Tensor {
    let mut t = Tensor::zeros(dtype, shape).expect("a tensor");
    poison(&mut t);
    t
}

/// Run `kernel` on `tensors` (no caches) on `threads` threads into one
/// poisoned output of `dtype` and `shape`, which it returns.
///
/// # Panics
///
/// If the kernel refuses the call.
pub fn run_poisoned(kernel: &dyn Kernel, tensors: &[&Tensor], dtype: DType, shape: &[usize], threads: usize) -> Tensor {
    let mut out = poisoned(dtype, shape);
    let ctx = DeviceContextPtr::cpu(threads).expect("a CPU context");
    let name = kernel.implementation();
    kernel.run(tensors, &mut [], std::slice::from_mut(&mut out), &ctx).unwrap_or_else(|e| panic!("{name}: {e}"));
    out
}

/// What [`refused`] asserts of `Kernel::check`, which sees the inputs but
/// not the outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// The inputs are bad: `check` refuses them too.
    Refuses,
    /// Only the outputs are bad: `check` accepts the inputs.
    Accepts,
    /// Not asserted.
    Skip,
}

/// Run `kernel` on `tensors` (no caches) into `outputs` on two threads, a
/// call that must be refused: asserts it is, that no output byte changed,
/// and what `check` says of the inputs. Returns the error.
///
/// # Panics
///
/// Naming the kernel's implementation, on any of those.
pub fn refused(kernel: &dyn Kernel, tensors: &[&Tensor], mut outputs: Vec<Tensor>, check: Check) -> Error {
    let before = outputs.clone();
    let ctx = DeviceContextPtr::cpu(2).expect("a CPU context");
    let err = kernel.run(tensors, &mut [], &mut outputs, &ctx).expect_err("a bad call must be refused");
    let name = kernel.implementation();
    assert_eq!(outputs, before, "{name}: refused ({err}) but wrote its output");
    match check {
        Check::Refuses => {
            assert!(kernel.check(tensors, &[]).is_err(), "{name}: check accepted what run refused ({err})")
        }
        Check::Accepts => assert!(kernel.check(tensors, &[]).is_ok(), "{name}: check refused good inputs ({err})"),
        Check::Skip => {}
    }
    err
}
