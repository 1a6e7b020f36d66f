//! Every bad call is refused with its typed error before a byte of the
//! output is written: a wrong dtype of `x` or `weight`, a strided `x`, an
//! `x` whose last dim is not H or whose row count is not the baked one, a
//! `weight` that is not `[H]`, the wrong arity, an output of the wrong
//! dtype or shape, and (for `run_into`) an output buffer of the wrong
//! length — for the JIT and the reference alike.

mod common;

use std::sync::Arc;

use common::{ctx, jit, random, spec};
use kvjit_core::{DType, Error, Tensor};
use kvjit_op::Compiled;
use kvjit_op_rms_norm::{ReferenceKernel, RmsNormSpec};
use kvjit_runtime::Kernel;
use kvjit_testkit::calls::{Check, poisoned, refused};
use kvjit_testkit::{Guarded, nan_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn kernels(spec: RmsNormSpec) -> [Arc<dyn Kernel>; 2] {
    [Arc::new(Compiled::new(jit(spec))), Arc::new(Compiled::new(ReferenceKernel::new(spec)))]
}

#[test]
fn wrong_dtypes_and_a_strided_x_are_refused() {
    let mut rng = SmallRng::seed_from_u64(61);
    let x = random(&mut rng, DType::BF16, &[3, 8], (-1.0, 1.0));
    let weight = random(&mut rng, DType::BF16, &[8], (-0.5, 0.5));
    for kernel in kernels(spec(DType::BF16, 8, None)) {
        let f32_x = random(&mut rng, DType::F32, &[3, 8], (-1.0, 1.0));
        let err = refused(&*kernel, &[&f32_x, &weight], vec![poisoned(DType::BF16, &[3, 8])], Check::Skip);
        assert!(
            matches!(&err, Error::DTypeMismatch { arg, expected: DType::BF16, got: DType::F32 } if arg == "x"),
            "{err}"
        );
        assert!(kernel.check(&[&f32_x, &weight], &[]).is_err());

        let f16_weight = random(&mut rng, DType::F16, &[8], (-0.5, 0.5));
        let err = refused(&*kernel, &[&x, &f16_weight], vec![poisoned(DType::BF16, &[3, 8])], Check::Skip);
        assert!(matches!(&err, Error::DTypeMismatch { arg, got: DType::F16, .. } if arg == "weight"), "{err}");
        assert!(kernel.check(&[&x, &f16_weight], &[]).is_err());

        let square = random(&mut rng, DType::BF16, &[8, 8], (-1.0, 1.0));
        let strided = square.permuted(&[1, 0]).unwrap();
        let err = refused(&*kernel, &[&strided, &weight], vec![poisoned(DType::BF16, &[8, 8])], Check::Skip);
        assert!(matches!(err, Error::NotContiguous { .. }), "{err}");
        assert!(kernel.check(&[&strided, &weight], &[]).is_err());
    }
}

#[test]
fn wrong_shapes_of_x_and_weight_are_refused() {
    let mut rng = SmallRng::seed_from_u64(62);
    let weight = random(&mut rng, DType::F32, &[8], (-0.5, 0.5));
    for kernel in kernels(spec(DType::F32, 8, Some(6))) {
        for shape in [&[6, 7][..], &[5, 8], &[8], &[], &[2, 4, 8]] {
            let x = random(&mut rng, DType::F32, shape, (-1.0, 1.0));
            let err = refused(&*kernel, &[&x, &weight], vec![poisoned(DType::F32, shape)], Check::Skip);
            assert!(matches!(err, Error::NotBuiltFor { arg: "x", .. }), "{shape:?}: {err}");
            let key = "rms_norm.cpu.f32.h8.rows6.eps";
            assert!(err.to_string().contains(&format!("[..., 8] with 6 rows (baked into {key}")), "{err}");
            assert!(kernel.check(&[&x, &weight], &[]).is_err());
        }
        let x = random(&mut rng, DType::F32, &[2, 3, 8], (-1.0, 1.0));
        for shape in [&[9][..], &[1, 8], &[]] {
            let bad = random(&mut rng, DType::F32, shape, (-0.5, 0.5));
            let err = refused(&*kernel, &[&x, &bad], vec![poisoned(DType::F32, &[2, 3, 8])], Check::Skip);
            assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "weight"), "{shape:?}: {err}");
            assert!(err.to_string().contains("[8] (H of x)"), "{err}");
        }
        // Another leading shape of the baked rows is accepted.
        let mut out = vec![poisoned(DType::F32, &[2, 3, 8])];
        kernel.run(&[&x, &weight], &mut [], &mut out, &ctx(1)).unwrap();
        assert!(out[0].to_f32_vec().unwrap().iter().all(|v| v.is_finite()));
    }
}

#[test]
fn wrong_arity_and_outputs_are_refused() {
    let mut rng = SmallRng::seed_from_u64(63);
    let x = random(&mut rng, DType::F16, &[2, 5], (-1.0, 1.0));
    let weight = random(&mut rng, DType::F16, &[5], (-0.5, 0.5));
    for kernel in kernels(spec(DType::F16, 5, None)) {
        let out = || poisoned(DType::F16, &[2, 5]);
        let calls: [(Vec<&Tensor>, Vec<Tensor>); 4] = [
            (vec![&x], vec![out()]),
            (vec![], vec![out()]),
            (vec![&x, &weight, &weight], vec![out()]),
            (vec![&x, &weight], vec![out(), out()]),
        ];
        for (tensors, outputs) in calls {
            let err = refused(&*kernel, &tensors, outputs, Check::Skip);
            assert!(matches!(err, Error::KernelArguments { .. }), "{err}");
            assert!(err.to_string().contains("2 tensors (x, weight), 0 KV caches and 1 outputs"), "{err}");
        }
        let err = refused(&*kernel, &[&x, &weight], vec![poisoned(DType::F32, &[2, 5])], Check::Skip);
        assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == "output"), "{err}");
        let err = refused(&*kernel, &[&x, &weight], vec![poisoned(DType::F16, &[10])], Check::Skip);
        assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "output"), "{err}");
    }
}

#[test]
fn run_into_refuses_a_buffer_of_the_wrong_length_or_a_bad_input() {
    let mut rng = SmallRng::seed_from_u64(64);
    let x = random(&mut rng, DType::F32, &[3, 4], (-1.0, 1.0));
    let weight = random(&mut rng, DType::F32, &[4], (-0.5, 0.5));
    let kernel = jit(spec(DType::F32, 4, None));
    for len in [11, 13, 0] {
        let mut out = Guarded::new(16, &nan_bytes(DType::F32, len), 16);
        let before = out.clone();
        let err = kernel.run_into(&[&x, &weight], &mut [], out.body_mut(), &ctx(2)).unwrap_err();
        assert!(matches!(err, Error::ByteCount { .. }), "{err}");
        assert!(out == before, "{len} elements: refused ({err}) but written");
    }
    let mut out = Guarded::new(16, &nan_bytes(DType::F32, 12), 16);
    let short_weight = random(&mut rng, DType::F32, &[3], (-0.5, 0.5));
    let err = kernel.run_into(&[&x, &short_weight], &mut [], out.body_mut(), &ctx(1)).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }) && out.body() == nan_bytes(DType::F32, 12), "{err}");
    let bf16_x = random(&mut rng, DType::BF16, &[3, 4], (-1.0, 1.0));
    let err = kernel.run_into(&[&bf16_x, &weight], &mut [], out.body_mut(), &ctx(1)).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }) && out.body() == nan_bytes(DType::F32, 12), "{err}");
    out.assert_guards("refused calls");
}
