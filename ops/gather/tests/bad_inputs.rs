//! Every bad call is refused with its typed error before a byte of the
//! output is written, by the JIT and the reference alike: an id past the
//! table (late in the batch), wrong dtypes, shapes other than those baked
//! in, the wrong arity, and (for `run_into`) a buffer of the wrong length.

mod common;

use std::sync::Arc;

use common::{ctx, jit, random_ids, random_table, spec};
use kvjit_core::{DType, Error, Tensor};
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_op_gather::{GatherError, GatherSpec, ReferenceKernel};
use kvjit_runtime::Kernel;
use kvjit_testkit::calls::{Check, poisoned, refused};
use kvjit_testkit::{Guarded, nan_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn kernels(spec: GatherSpec) -> [Arc<dyn Kernel>; 2] {
    [Arc::new(Compiled::new(jit(spec))), Arc::new(Compiled::new(ReferenceKernel::new(spec)))]
}

#[test]
fn an_id_past_the_table_late_in_the_batch_is_refused_naming_it() {
    let mut rng = SmallRng::seed_from_u64(71);
    let (vocab, hidden) = (10, 12);
    let table = random_table(&mut rng, DType::BF16, vocab, hidden);
    for (bad, id) in [((2, 4), 10u32), ((0, 1), u32::MAX), ((2, 3), 11)] {
        let ids = random_ids(&mut rng, vocab, 3, 5);
        let mut values = ids.as_slice::<u32>().unwrap().to_vec();
        values[bad.0 * 5 + bad.1] = id;
        let ids = Tensor::from_vec(&[3, 5], values).unwrap();
        for kernel in kernels(spec(DType::BF16, vocab, hidden, StepDims::ANY)) {
            let err = refused(&*kernel, &[&table, &ids], vec![poisoned(DType::BF16, &[3, 5, hidden])], Check::Refuses);
            let op = err.op_error::<GatherError>().unwrap_or_else(|| panic!("not a gather error: {err}"));
            assert_eq!(*op, GatherError::IdOutOfRange { id, batch: bad.0, position: bad.1, vocab });
            let text = err.to_string();
            assert!(text.contains(&format!("ids[{}, {}] = {id}", bad.0, bad.1)) && text.contains("10 rows"), "{text}");
        }
        // run_into, the JIT's own entry: the guarded buffer stays poisoned.
        let mut out = Guarded::new(16, &nan_bytes(DType::BF16, 3 * 5 * hidden), 16);
        let before = out.clone();
        let kernel = jit(spec(DType::BF16, vocab, hidden, StepDims::ANY));
        assert!(kernel.run_into(&[&table, &ids], &mut [], out.body_mut(), &ctx(3)).is_err());
        assert!(out == before, "run_into refused an id but wrote");
    }
}

#[test]
fn wrong_dtypes_and_shapes_are_refused() {
    let mut rng = SmallRng::seed_from_u64(72);
    let (vocab, hidden) = (6, 8);
    let table = random_table(&mut rng, DType::F16, vocab, hidden);
    let ids = random_ids(&mut rng, vocab, 2, 3);
    for kernel in kernels(spec(DType::F16, vocab, hidden, StepDims::fixed(2, 3))) {
        let out = || vec![poisoned(DType::F16, &[2, 3, hidden])];
        let f32_table = random_table(&mut rng, DType::F32, vocab, hidden);
        let err = refused(&*kernel, &[&f32_table, &ids], out(), Check::Refuses);
        assert!(matches!(&err, Error::DTypeMismatch { arg, expected: DType::F16, got: DType::F32 } if arg == "table"));
        let float_ids = Tensor::from_f32(DType::F32, &[2, 3], &[1.0; 6]).unwrap();
        let err = refused(&*kernel, &[&table, &float_ids], out(), Check::Refuses);
        assert!(matches!(&err, Error::DTypeMismatch { arg, expected: DType::U32, .. } if arg == "ids"), "{err}");
        for (other, arg) in [
            (random_table(&mut rng, DType::F16, vocab + 1, hidden), "table"),
            (random_table(&mut rng, DType::F16, vocab, hidden + 1), "table"),
        ] {
            let err = refused(&*kernel, &[&other, &ids], out(), Check::Refuses);
            assert!(matches!(err, Error::NotBuiltFor { arg: a, .. } if a == arg), "{err}");
            assert!(err.to_string().contains("gather.cpu.f16.v6.h8.b2.s3"), "{err}");
        }
        for shape in [&[3, 3][..], &[2, 4], &[6], &[2, 3, 1]] {
            let other = Tensor::from_vec(shape, vec![0u32; shape.iter().product()]).unwrap();
            let err = refused(&*kernel, &[&table, &other], out(), Check::Refuses);
            assert!(matches!(err, Error::NotBuiltFor { arg: "ids", .. }), "{shape:?}: {err}");
        }
        let strided = table.permuted(&[1, 0]).unwrap();
        assert!(matches!(
            refused(&*kernel, &[&strided, &ids], out(), Check::Refuses),
            Error::NotContiguous { .. } | Error::NotBuiltFor { .. }
        ));
    }
}

#[test]
fn wrong_arity_and_outputs_are_refused() {
    let mut rng = SmallRng::seed_from_u64(73);
    let table = random_table(&mut rng, DType::F32, 4, 5);
    let ids = random_ids(&mut rng, 4, 1, 2);
    for kernel in kernels(spec(DType::F32, 4, 5, StepDims::ANY)) {
        let out = || poisoned(DType::F32, &[1, 2, 5]);
        for (tensors, outputs) in [
            (vec![&table], vec![out()]),
            (vec![&table, &ids, &ids], vec![out()]),
            (vec![&table, &ids], vec![out(), out()]),
        ] {
            let before = outputs.clone();
            let mut outputs = outputs;
            let err = kernel.run(&tensors, &mut [], &mut outputs, &ctx(1)).unwrap_err();
            assert!(matches!(err, Error::KernelArguments { .. }) && outputs == before, "{err}");
            assert!(err.to_string().contains("2 tensors (table, ids)"), "{err}");
        }
        let err = refused_run_only(&*kernel, &[&table, &ids], vec![poisoned(DType::BF16, &[1, 2, 5])]);
        assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == "output"), "{err}");
        let err = refused_run_only(&*kernel, &[&table, &ids], vec![poisoned(DType::F32, &[2, 5])]);
        assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "output"), "{err}");
    }
    let kernel = jit(spec(DType::F32, 4, 5, StepDims::ANY));
    for len in [9, 11] {
        let mut out = Guarded::new(16, &nan_bytes(DType::F32, len), 16);
        let before = out.clone();
        let err = kernel.run_into(&[&table, &ids], &mut [], out.body_mut(), &ctx(2)).unwrap_err();
        assert!(matches!(err, Error::ByteCount { .. }) && out == before, "{err}");
    }
}

/// Like `refused`, for calls whose inputs are fine (only the outputs are bad).
fn refused_run_only(kernel: &dyn Kernel, tensors: &[&Tensor], mut outputs: Vec<Tensor>) -> Error {
    let before = outputs.clone();
    let err = kernel.run(tensors, &mut [], &mut outputs, &ctx(2)).expect_err("a bad call must be refused");
    assert_eq!(outputs, before, "refused ({err}) but wrote its output");
    err
}
