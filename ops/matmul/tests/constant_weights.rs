//! The weight's three ways into a kernel give the same bytes: the graph
//! constant packed once at build (a call passes that very tensor), a
//! weight packed per call (another allocation of equal contents, to a
//! kernel with or without a constant), and the packed panels themselves
//! (the prepared constant a compiled artifact stores: `prepared_constants`
//! of one kernel, `with_prepared` into another, or passed as the call's
//! weight). A prepared weight of another layout, dtype or length is
//! refused, naming both layouts.

mod common;

use std::sync::Arc;

use common::{
    DTYPES, EPILOGUES, Inputs, Jit, ORIENTATIONS, assert_close, assert_same_bytes, run_jit, run_reference, spec, tiers,
};
use kvjit_core::{CodeTier, DType, Error, PreparedConstant, Tensor};
use kvjit_op::gemm::WeightOrientation;
use kvjit_op_matmul::{Epilogue, MatmulError, MatmulSpec, layout};
use kvjit_testkit::Guarded;
use kvjit_testkit::nan_bytes;
use rand::SeedableRng;
use rand::rngs::SmallRng;

/// A copy of `t` in another allocation (equal bytes).
fn copy(t: &Tensor) -> Tensor {
    let copy = Tensor::from_le_bytes(t.dtype(), t.shape(), t.as_bytes()).unwrap();
    assert!(!copy.shares_storage_with(t) && copy == *t);
    copy
}

/// The call's tensors with `weights` in place of the inputs' own.
fn with_weights<'t>(inputs: &'t Inputs, weights: &[&'t Tensor]) -> Vec<&'t Tensor> {
    let mut t = vec![&inputs.a];
    t.extend(weights);
    t.extend(&inputs.other);
    t
}

#[test]
fn a_constant_packed_at_build_a_weight_packed_per_call_and_prepared_panels_agree() {
    let mut rng = SmallRng::seed_from_u64(31);
    for tier in tiers() {
        for dtype in DTYPES {
            for orientation in ORIENTATIONS {
                for epilogue in EPILOGUES {
                    for m in [1, 7] {
                        let spec = spec(epilogue, dtype, tier, orientation, (33, 37), None);
                        let inputs = common::inputs(&mut rng, &spec, &[m]);
                        let shape = inputs.output_shape(&spec);
                        let what = format!("{} on {m} rows", common::name(&spec));

                        let constants: Vec<Arc<Tensor>> = inputs.weights.iter().map(|w| Arc::new(w.clone())).collect();
                        let copies: Vec<Tensor> = inputs.weights.iter().map(copy).collect();
                        let constant_refs: Vec<&Tensor> = constants.iter().map(|w| &**w).collect();
                        let copy_refs: Vec<&Tensor> = copies.iter().collect();

                        let constant = Jit::new(spec, Some(constants.clone()));
                        let per_call = Jit::new(spec, None);
                        let packed_at_build = run_jit(&constant, &with_weights(&inputs, &constant_refs), &shape, 2);
                        let want = run_reference(spec, &inputs.tensors(), &shape);
                        assert_close(&spec, &inputs, &packed_at_build, &want, &what);
                        let packed_per_call = run_jit(&per_call, &with_weights(&inputs, &copy_refs), &shape, 2);
                        assert_same_bytes(&packed_per_call, &packed_at_build, &format!("{what}: packed per call"));
                        let other_allocation = run_jit(&constant, &with_weights(&inputs, &copy_refs), &shape, 1);
                        assert_same_bytes(&other_allocation, &packed_at_build, &format!("{what}: equal copies"));

                        let prepared = constant.prepared_constants();
                        if epilogue == Epilogue::SwiGlu {
                            // Two siblings share one packed tensor: an artifact stores them plain.
                            assert!(prepared.is_empty(), "{what}: a SwiGLU kernel offered {prepared:?}");
                            assert!(per_call.prepared_constants().is_empty());
                            continue;
                        }
                        assert!(per_call.prepared_constants().is_empty(), "{what}: prepared without a constant");
                        let [(index, prepared)] = <[_; 1]>::try_from(prepared).unwrap();
                        assert_eq!(index, 1, "{what}: the weight is input 1");
                        assert_eq!(prepared.layout, layout(&spec, tier).id(dtype));
                        let panels = layout(&spec, tier).packed_len();
                        assert_eq!((prepared.data.dtype(), prepared.data.shape()), (dtype, &[panels][..]));

                        let from_artifact = Jit::with_prepared(spec, &prepared).unwrap();
                        for (kernel, by) in
                            [(&from_artifact, "the prepared kernel"), (&constant, "the constant kernel")]
                        {
                            let got = run_jit(kernel, &with_weights(&inputs, &[&prepared.data]), &shape, 3);
                            assert_same_bytes(&got, &packed_at_build, &format!("{what}: {by} given the panels"));
                        }
                        let got = run_jit(&from_artifact, &with_weights(&inputs, &copy_refs), &shape, 1);
                        assert_same_bytes(&got, &packed_at_build, &format!("{what}: the prepared kernel, plain"));
                        // Panels are what their own kernel holds: a kernel without them
                        // takes them for a weight of the wrong shape.
                        let mut out = Guarded::new(8, &nan_bytes(dtype, shape.iter().product()), 8);
                        let before = out.clone();
                        let err = per_call
                            .run_into(&with_weights(&inputs, &[&prepared.data]), out.body_mut(), &common::ctx(1))
                            .unwrap_err();
                        assert!(matches!(err, Error::NotBuiltFor { arg: "b", .. }), "{what}: {err}");
                        assert!(out == before, "{what}: refused ({err}) but written");
                    }
                }
            }
        }
    }
}

/// A prepared weight made for another tier (panel width), orientation (a
/// square weight: same length), dtype or length, or under another layout
/// name, is refused when the kernel is made from it, naming what it takes
/// and what it got.
#[test]
fn a_prepared_weight_in_another_layout_is_refused() {
    let mut rng = SmallRng::seed_from_u64(32);
    let square = |tier, orientation, dtype| spec(Epilogue::None, dtype, tier, orientation, (24, 24), None);
    let prepared_of = |spec: MatmulSpec, rng: &mut SmallRng| -> PreparedConstant {
        let weight = common::random(rng, spec.dtype, &spec.weight_shape());
        let kernel = Jit::new(spec, Some(vec![Arc::new(weight)]));
        kernel.prepared_constants().pop().unwrap().1
    };
    let refused = |spec: MatmulSpec, prepared: &PreparedConstant, what: &str| {
        let err = match Jit::with_prepared(spec, prepared) {
            Ok(_) => panic!("{what}: accepted"),
            Err(err) => err,
        };
        let typed = err.op_error::<MatmulError>();
        assert!(matches!(typed, Some(MatmulError::PreparedWeight { .. })), "{what}: {err}");
        assert!(matches!(err, Error::Op { op: "mo.matmul", .. }), "{what}: {err}");
        let (err, expected) = (err.to_string(), layout(&spec, spec.tier().unwrap()).id(spec.dtype));
        assert!(err.contains("prepared weight"), "{what}: {err}");
        assert!(err.contains(&expected) && err.contains(&prepared.layout), "{what}: {err}");
    };
    let tier = *tiers().last().unwrap();
    let nk = square(tier, WeightOrientation::NK, DType::BF16);
    let kn = square(tier, WeightOrientation::KN, DType::BF16);
    let prepared = prepared_of(nk, &mut rng);
    assert!(Jit::with_prepared(nk, &prepared).is_ok(), "its own kernel takes it");
    assert_eq!(prepared.data.numel(), layout(&kn, tier).packed_len(), "the square weights pack to one length");
    refused(kn, &prepared, "[N, K] panels for a [K, N] kernel");

    let f16 = square(tier, WeightOrientation::NK, DType::F16);
    refused(f16, &prepared, "bf16 panels for an f16 kernel");
    let relabelled = PreparedConstant { layout: layout(&f16, tier).id(DType::F16), data: prepared.data.clone() };
    refused(f16, &relabelled, "bf16 panels under the f16 layout's name");

    let short =
        Tensor::from_le_bytes(DType::BF16, &[prepared.data.numel() - 1], &prepared.data.as_bytes()[2..]).unwrap();
    refused(nk, &PreparedConstant { layout: prepared.layout.clone(), data: Arc::new(short) }, "one element short");
    let renamed = PreparedConstant { layout: format!("{}x", prepared.layout), data: prepared.data.clone() };
    refused(nk, &renamed, "another layout name");

    let wider = spec(Epilogue::None, DType::BF16, tier, WeightOrientation::NK, (24, 25), None);
    refused(wider, &prepared, "panels of 24 columns for a kernel of 25");

    if tiers().len() == 2 {
        let cranelift = prepared_of(square(CodeTier::Cranelift, WeightOrientation::NK, DType::BF16), &mut rng);
        refused(nk, &cranelift, "8-column panels for the avx2 tier");
        refused(square(CodeTier::Cranelift, WeightOrientation::NK, DType::BF16), &prepared, "16-column panels");
    }
}

/// A constant the kernel cannot pack (a strided view; another dtype or
/// shape) is not packed — the kernel is still made, holds no panels, and
/// runs calls with weights of its own (a strided weight in a call is
/// refused, naming it).
#[test]
fn a_constant_that_cannot_be_packed_is_left_to_the_calls() {
    let mut rng = SmallRng::seed_from_u64(33);
    for tier in tiers() {
        for epilogue in [Epilogue::None, Epilogue::SwiGlu] {
            let spec = spec(epilogue, DType::F32, tier, WeightOrientation::NK, (12, 10), None);
            let inputs = common::inputs(&mut rng, &spec, &[3]);
            let want = run_reference(spec, &inputs.tensors(), &[3, 10]);
            let transposed = common::random(&mut rng, DType::F32, &[12, 10]);
            let strided = Arc::new(transposed.permuted(&[1, 0]).unwrap());
            assert!(strided.shape() == spec.weight_shape() && !strided.is_contiguous());
            let bf16 = Arc::new(common::random(&mut rng, DType::BF16, &spec.weight_shape()));
            let wide = Arc::new(common::random(&mut rng, DType::F32, &[11, 12]));
            for bad in [strided.clone(), bf16, wide] {
                let constants = vec![bad; epilogue.weights()];
                let what = format!("{}, constant {:?}", common::name(&spec), constants[0].shape());
                let kernel = Jit::new(spec, Some(constants));
                assert!(kernel.prepared_constants().is_empty(), "{what}: panels of an unpackable constant");
                let got = run_jit(&kernel, &inputs.tensors(), &[3, 10], 2);
                assert_close(&spec, &inputs, &got, &want, &what);
            }
            let mut tensors = inputs.tensors();
            tensors[1] = &strided;
            let mut out = Guarded::new(8, &nan_bytes(DType::F32, 30), 8);
            let err = Jit::new(spec, None).run_into(&tensors, out.body_mut(), &common::ctx(1)).unwrap_err();
            let names_b = matches!(&err, Error::NotContiguous { arg } if arg == if epilogue.weights() == 2 { "gate" } else { "b" });
            assert!(names_b && out.body() == nan_bytes(DType::F32, 30), "{err}");
        }
    }
}
