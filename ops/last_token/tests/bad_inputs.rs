//! Every bad call is refused with its typed error before a byte of the
//! output is written, by the JIT and the reference alike: a valid length
//! past S (late in the batch), wrong dtypes, shapes other than those baked
//! in, a `valid_lengths` of another batch, the wrong arity, and (for
//! `run_into`) a buffer of the wrong length.

mod common;

use std::sync::Arc;

use common::{ctx, jit, lengths, random_x, spec};
use kvjit_core::{DType, Error, Tensor};
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_last_token::{LastTokenSpec, ReferenceKernel};
use kvjit_runtime::Kernel;
use kvjit_testkit::calls::{Check, poisoned, refused};
use kvjit_testkit::{Guarded, nan_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn kernels(spec: LastTokenSpec) -> [Arc<dyn Kernel>; 2] {
    [Arc::new(Compiled::new(jit(spec))), Arc::new(Compiled::new(ReferenceKernel::new(spec)))]
}

#[test]
fn a_valid_length_past_s_late_in_the_batch_is_refused() {
    let mut rng = SmallRng::seed_from_u64(101);
    let x = random_x(&mut rng, DType::BF16, &[4, 6, 10]);
    let valid = lengths(&[1, 6, 0, 7]);
    for kernel in kernels(spec(DType::BF16, 10, StepDims::ANY)) {
        let err = refused(&*kernel, &[&x, &valid], vec![poisoned(DType::BF16, &[4, 10])], Check::Refuses);
        assert!(matches!(err, Error::ValidLengthTooLong { batch: 3, valid_length: 7, seq_len: 6 }), "{err}");
    }
    let mut out = Guarded::new(16, &nan_bytes(DType::BF16, 40), 16);
    let before = out.clone();
    let err = jit(spec(DType::BF16, 10, StepDims::ANY)).run_into(&[&x, &valid], &mut [], out.body_mut(), &ctx(3));
    assert!(err.is_err() && out == before, "run_into refused but wrote");
}

#[test]
fn wrong_dtypes_and_shapes_are_refused() {
    let mut rng = SmallRng::seed_from_u64(102);
    let x = random_x(&mut rng, DType::F16, &[2, 3, 8]);
    let valid = lengths(&[1, 3]);
    for kernel in kernels(spec(DType::F16, 8, StepDims::fixed(2, 3))) {
        let out = || vec![poisoned(DType::F16, &[2, 8])];
        let f32_x = random_x(&mut rng, DType::F32, &[2, 3, 8]);
        let err = refused(&*kernel, &[&f32_x, &valid], out(), Check::Refuses);
        assert!(matches!(&err, Error::DTypeMismatch { arg, expected: DType::F16, .. } if arg == "x"), "{err}");
        let float_valid = Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
        let err = refused(&*kernel, &[&x, &float_valid], out(), Check::Refuses);
        assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == "valid_lengths"), "{err}");
        for shape in [&[2, 3, 9][..], &[2, 4, 8], &[3, 3, 8], &[6, 8]] {
            let other = random_x(&mut rng, DType::F16, shape);
            let err = refused(&*kernel, &[&other, &valid], out(), Check::Refuses);
            assert!(matches!(err, Error::NotBuiltFor { arg: "x", .. }), "{shape:?}: {err}");
            assert!(err.to_string().contains("last_valid_token.cpu.f16.h8.b2.s3"), "{err}");
        }
        for other in [lengths(&[1, 2, 3]), lengths(&[1]), Tensor::from_vec(&[2, 1], vec![1u32, 1]).unwrap()] {
            let err = refused(&*kernel, &[&x, &other], out(), Check::Refuses);
            assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "valid_lengths"), "{err}");
        }
    }
}

#[test]
fn wrong_arity_and_outputs_are_refused() {
    let mut rng = SmallRng::seed_from_u64(103);
    let x = random_x(&mut rng, DType::F32, &[2, 2, 5]);
    let valid = lengths(&[2, 0]);
    for kernel in kernels(spec(DType::F32, 5, StepDims::ANY)) {
        let out = || poisoned(DType::F32, &[2, 5]);
        for (tensors, outputs) in
            [(vec![&x], vec![out()]), (vec![&x, &valid, &valid], vec![out()]), (vec![&x, &valid], vec![out(), out()])]
        {
            let err = refused(&*kernel, &tensors, outputs, Check::Skip);
            assert!(matches!(err, Error::KernelArguments { .. }), "{err}");
            assert!(err.to_string().contains("2 tensors (x, valid_lengths)"), "{err}");
        }
        let err = refused(&*kernel, &[&x, &valid], vec![poisoned(DType::BF16, &[2, 5])], Check::Skip);
        assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == "output"), "{err}");
        let err = refused(&*kernel, &[&x, &valid], vec![poisoned(DType::F32, &[2, 2, 5])], Check::Skip);
        assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "output"), "{err}");
    }
    let kernel = jit(spec(DType::F32, 5, StepDims::ANY));
    for len in [9, 11] {
        let mut out = Guarded::new(16, &nan_bytes(DType::F32, len), 16);
        let before = out.clone();
        let err = kernel.run_into(&[&x, &valid], &mut [], out.body_mut(), &ctx(2)).unwrap_err();
        assert!(matches!(err, Error::ByteCount { .. }) && out == before, "{err}");
    }
}
