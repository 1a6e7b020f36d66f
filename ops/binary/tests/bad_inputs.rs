//! Every bad call is refused with its typed error before a byte of the
//! output is written: `b` of another shape (even of as many elements) or
//! dtype, a strided operand, an element count other than the one baked
//! in, the wrong arity, an output of the wrong dtype or shape, and (for
//! `run_into`) an output buffer of the wrong length — for the JIT and the
//! reference of both ops alike.

mod common;

use std::sync::Arc;

use common::{OPERATIONS, ctx, jit, random, spec};
use kvjit_core::{DType, Error, Tensor};
use kvjit_op::Compiled;
use kvjit_op_binary::{BinarySpec, ReferenceKernel};
use kvjit_runtime::Kernel;
use kvjit_testkit::calls::{Check, poisoned, refused};
use kvjit_testkit::{Guarded, nan_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn kernels(spec: BinarySpec) -> [Arc<dyn Kernel>; 2] {
    [Arc::new(Compiled::new(jit(spec))), Arc::new(Compiled::new(ReferenceKernel::new(spec)))]
}

#[test]
fn mismatched_operands_are_refused_naming_b() {
    let mut rng = SmallRng::seed_from_u64(61);
    let a = random(&mut rng, DType::BF16, &[4, 6], 8.0);
    for operation in OPERATIONS {
        for elements in [Some(24), None] {
            for kernel in kernels(spec(operation, DType::BF16, elements)) {
                let out = || vec![poisoned(DType::BF16, &[4, 6])];
                for shape in [&[6, 4][..], &[24], &[4, 6, 1], &[4, 5], &[4, 7]] {
                    let b = random(&mut rng, DType::BF16, shape, 8.0);
                    let err = refused(&*kernel, &[&a, &b], out(), Check::Refuses);
                    assert!(
                        matches!(&err, Error::ShapeMismatch { arg, got, .. } if arg == "b" && got == shape),
                        "{err}"
                    );
                    assert!(err.to_string().contains("[4, 6] (the shape of a)"), "{err}");
                }
                let f32_b = random(&mut rng, DType::F32, &[4, 6], 8.0);
                let err = refused(&*kernel, &[&a, &f32_b], out(), Check::Refuses);
                let named_b =
                    matches!(&err, Error::DTypeMismatch { arg, expected: DType::BF16, got: DType::F32 } if arg == "b");
                assert!(named_b, "{err}");
            }
        }
    }
}

#[test]
fn wrong_dtype_strided_operands_and_baked_count_are_refused() {
    let mut rng = SmallRng::seed_from_u64(62);
    let a = random(&mut rng, DType::F16, &[4, 6], 8.0);
    let b = random(&mut rng, DType::F16, &[4, 6], 8.0);
    for operation in OPERATIONS {
        for kernel in kernels(spec(operation, DType::F16, Some(24))) {
            let f32_a = random(&mut rng, DType::F32, &[4, 6], 8.0);
            let err = refused(&*kernel, &[&f32_a, &b], vec![poisoned(DType::F16, &[4, 6])], Check::Refuses);
            let named_a =
                matches!(&err, Error::DTypeMismatch { arg, expected: DType::F16, got: DType::F32 } if arg == "a");
            assert!(named_a, "{err}");

            let (strided_a, strided_b) = (a.permuted(&[1, 0]).unwrap(), b.permuted(&[1, 0]).unwrap());
            let contiguous_b = random(&mut rng, DType::F16, &[6, 4], 8.0);
            for pair in [[&strided_a, &contiguous_b], [&contiguous_b, &strided_b]] {
                let err = refused(&*kernel, &pair, vec![poisoned(DType::F16, &[6, 4])], Check::Refuses);
                assert!(matches!(err, Error::NotContiguous { .. }), "{err}");
            }

            let (other_a, other_b) =
                (random(&mut rng, DType::F16, &[5, 5], 8.0), random(&mut rng, DType::F16, &[5, 5], 8.0));
            let err = refused(&*kernel, &[&other_a, &other_b], vec![poisoned(DType::F16, &[5, 5])], Check::Refuses);
            assert!(matches!(err, Error::NotBuiltFor { .. }), "{err}");
            assert!(
                err.to_string().contains(&format!("24 elements (baked into {}.cpu.f16.n24)", operation.name())),
                "{err}"
            );
        }
    }
}

#[test]
fn wrong_arity_and_outputs_are_refused() {
    let mut rng = SmallRng::seed_from_u64(63);
    let (a, b) = (random(&mut rng, DType::F32, &[3, 3], 8.0), random(&mut rng, DType::F32, &[3, 3], 8.0));
    for operation in OPERATIONS {
        for kernel in kernels(spec(operation, DType::F32, None)) {
            for tensors in [&[&a][..], &[&a, &b, &b]] {
                let err = refused(&*kernel, tensors, vec![poisoned(DType::F32, &[3, 3])], Check::Refuses);
                assert!(matches!(err, Error::KernelArguments { .. }), "{err}");
                assert!(err.to_string().contains("2 tensors (a, b)"), "{err}");
            }
            let err = refused(&*kernel, &[&a, &b], vec![], Check::Accepts);
            assert!(matches!(err, Error::KernelArguments { .. }), "{err}");
            let err = refused(&*kernel, &[&a, &b], vec![poisoned(DType::F32, &[9])], Check::Accepts);
            assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "output"), "{err}");
            let err = refused(&*kernel, &[&a, &b], vec![poisoned(DType::BF16, &[3, 3])], Check::Accepts);
            assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
        }
    }
}

#[test]
fn run_into_refuses_a_buffer_of_the_wrong_length_or_bad_operands() {
    let mut rng = SmallRng::seed_from_u64(64);
    let (a, b) = (random(&mut rng, DType::F32, &[2, 7], 8.0), random(&mut rng, DType::F32, &[2, 7], 8.0));
    for operation in OPERATIONS {
        let kernel = jit(spec(operation, DType::F32, None));
        let other = random(&mut rng, DType::F32, &[7, 2], 8.0);
        let bf16_b = random(&mut rng, DType::BF16, &[2, 7], 8.0);
        let cases: [(&Tensor, &Tensor, usize); 4] = [(&a, &b, 13), (&a, &b, 15), (&a, &other, 14), (&a, &bf16_b, 14)];
        for (x, y, len) in cases {
            let mut out = Guarded::new(16, &nan_bytes(DType::F32, len), 16);
            let before = out.clone();
            let err = kernel.run_into(&[x, y], &mut [], out.body_mut(), &ctx(2)).unwrap_err();
            assert!(
                matches!(err, Error::ByteCount { .. } | Error::ShapeMismatch { .. } | Error::DTypeMismatch { .. }),
                "{err}"
            );
            assert!(out == before, "{operation:?}, {len} elements: refused ({err}) but written");
        }
    }
}
