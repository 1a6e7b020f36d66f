//! Bad nodes are refused when they are added to a graph, in one line
//! naming the argument: a weight that is not a graph constant, K that
//! disagrees with `a` (either orientation), a weight of another dtype or
//! rank, an `other` of another shape or dtype, SwiGLU siblings of different
//! N, an `a` of rank 0, of u32 or with a symbolic K, a missing or unknown
//! parameter. Bad calls are refused with their typed error, naming the
//! argument, before a byte of the output is written — by the JIT and the
//! reference alike: `a` with another row count than the baked one or
//! another K, weights of another shape, `other` of another shape or dtype,
//! wrong dtypes, a strided `a`, the wrong arity, a bad output, and (for
//! `run_into`) a buffer of the wrong length.

mod common;

use std::sync::Arc;

use common::{Inputs, Jit, inputs, random, reference, registry, spec, tiers};
use kvjit_core::{DType, Error, Tensor};
use kvjit_graph::{Dim, GraphBuilder, GraphError, Params, ValueId};
use kvjit_op::gemm::WeightOrientation::{self, KN, NK};
use kvjit_op_matmul::{
    BinaryEpilogue, EpilogueParams, MatmulEpilogueOp, MatmulParams, MatmulSiluOp, MatmulSpec, SwigluMatmulOp, matmul,
};
use kvjit_runtime::Kernel;
use kvjit_testkit::calls::{Check, poisoned, refused};
use kvjit_testkit::{Guarded, nan_bytes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

/// The error as one line (asserted), to search.
fn one_line(err: GraphError) -> String {
    let err = err.to_string();
    assert!(!err.contains('\n'), "one line: {err}");
    err
}

fn constant(b: &mut GraphBuilder<'_>, name: &str, dtype: DType, shape: &[usize]) -> ValueId {
    let mut rng = SmallRng::seed_from_u64(shape.iter().sum::<usize>() as u64);
    b.constant(name, random(&mut rng, dtype, shape)).unwrap()
}

const NK_PARAMS: MatmulParams = MatmulParams { transpose_b: true };
const KN_PARAMS: MatmulParams = MatmulParams { transpose_b: false };

fn epilogue(
    b: &mut GraphBuilder<'_>,
    inputs: [ValueId; 3],
    transpose_b: bool,
    epilogue: BinaryEpilogue,
) -> Result<ValueId, GraphError> {
    Ok(kvjit_op::add_node::<MatmulEpilogueOp, 3>(b, &EpilogueParams { transpose_b, epilogue }, inputs)?[0])
}

fn swiglu(b: &mut GraphBuilder<'_>, inputs: [ValueId; 3], transpose_b: bool) -> Result<ValueId, GraphError> {
    Ok(kvjit_op::add_node::<SwigluMatmulOp, 3>(b, &MatmulParams { transpose_b }, inputs)?[0])
}

#[test]
fn a_weight_that_is_not_a_constant_is_refused() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let a = b.input("a", DType::F32, &[Dim::from("n"), Dim::Static(16)]).unwrap();
    let w = b.input("w", DType::F32, &[Dim::Static(8), Dim::Static(16)]).unwrap();
    let good = constant(&mut b, "good", DType::F32, &[8, 16]);
    let other = b.input("other", DType::F32, &[Dim::from("n"), Dim::Static(8)]).unwrap();
    let errors = [
        ("mo.matmul", "b", matmul(&mut b, a, w, NK_PARAMS).unwrap_err()),
        ("kvjit.matmul_silu", "b", kvjit_op::add_node::<MatmulSiluOp, 2>(&mut b, &NK_PARAMS, [a, w]).unwrap_err()),
        ("kvjit.matmul_epilogue", "b", epilogue(&mut b, [a, w, other], true, BinaryEpilogue::Add).unwrap_err()),
        ("kvjit.swiglu_matmul", "gate", swiglu(&mut b, [a, w, good], true).unwrap_err()),
        ("kvjit.swiglu_matmul", "up", swiglu(&mut b, [a, good, w], true).unwrap_err()),
    ];
    for (op, arg, err) in errors {
        let err = one_line(err);
        assert!(err.contains(&format!("({op}): argument '{arg}': expected a graph constant")), "{err}");
        assert!(err.contains("got f32[8, 16], a value supplied or computed at run time"), "{err}");
    }
    // The same node with constants is accepted.
    assert!(matmul(&mut b, a, good, NK_PARAMS).is_ok());
    assert!(swiglu(&mut b, [a, good, good], true).is_ok());
}

#[test]
fn a_weight_whose_k_dtype_or_rank_disagrees_with_a_is_refused() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let a = b.input("a", DType::F32, &[Dim::from("n"), Dim::Static(16)]).unwrap();
    let cases: [(&str, DType, &[usize], MatmulParams, &str); 8] = [
        ("nk_short_k", DType::F32, &[8, 15], NK_PARAMS, "f32[N, 16] (K of a, transpose_b = true"),
        ("nk_given_kn", DType::F32, &[16, 8], NK_PARAMS, "f32[N, 16] (K of a, transpose_b = true"),
        ("kn_short_k", DType::F32, &[15, 8], KN_PARAMS, "f32[16, N] (K of a, transpose_b = false)"),
        ("kn_given_nk", DType::F32, &[8, 16], KN_PARAMS, "f32[16, N] (K of a, transpose_b = false)"),
        ("bf16_weight", DType::BF16, &[8, 16], NK_PARAMS, "f32[N, 16]"),
        ("f16_weight", DType::F16, &[16, 8], KN_PARAMS, "f32[16, N]"),
        ("rank_one", DType::F32, &[16], NK_PARAMS, "f32[N, 16]"),
        ("rank_three", DType::F32, &[1, 8, 16], NK_PARAMS, "f32[N, 16]"),
    ];
    for (name, dtype, shape, params, expected) in cases {
        let w = constant(&mut b, name, dtype, shape);
        let err = one_line(matmul(&mut b, a, w, params).unwrap_err());
        let got = format!("{dtype}[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "));
        assert!(err.contains("argument 'b'") && err.contains(expected) && err.contains(&got), "{name}: {err}");
        let err = one_line(kvjit_op::add_node::<MatmulSiluOp, 2>(&mut b, &params, [a, w]).unwrap_err());
        assert!(err.contains(expected) && err.contains(&got), "{name} (silu): {err}");
    }
    let square = constant(&mut b, "square", DType::F32, &[16, 16]);
    for params in [NK_PARAMS, KN_PARAMS] {
        assert!(matmul(&mut b, a, square, params).is_ok(), "a square weight takes either orientation");
    }
}

#[test]
fn an_other_of_another_shape_or_dtype_is_refused() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let a = b.input("a", DType::BF16, &[Dim::from("n"), Dim::Static(16)]).unwrap();
    let w = constant(&mut b, "w", DType::BF16, &[8, 16]);
    let cases: [(&str, DType, Vec<Dim>, &str); 5] = [
        ("n9", DType::BF16, vec![Dim::from("n"), Dim::Static(9)], "bf16[n, 9]"),
        ("k", DType::BF16, vec![Dim::from("n"), Dim::Static(16)], "bf16[n, 16]"),
        ("m", DType::BF16, vec![Dim::from("m"), Dim::Static(8)], "bf16[m, 8]"),
        ("rank", DType::BF16, vec![Dim::Static(8)], "bf16[8]"),
        ("f32", DType::F32, vec![Dim::from("n"), Dim::Static(8)], "f32[n, 8]"),
    ];
    for (name, dtype, shape, got) in cases {
        let other = b.input(name, dtype, &shape).unwrap();
        for e in [BinaryEpilogue::Add, BinaryEpilogue::Mul, BinaryEpilogue::SiluMul] {
            let err = one_line(epilogue(&mut b, [a, w, other], true, e).unwrap_err());
            assert!(
                err.contains("argument 'other'") && err.contains("bf16[n, 8] (the matmul's result)"),
                "{name}: {err}"
            );
            assert!(err.contains(got), "{name}: {err}");
        }
    }
    let other = b.input("good", DType::BF16, &[Dim::from("n"), Dim::Static(8)]).unwrap();
    assert!(epilogue(&mut b, [a, w, other], true, BinaryEpilogue::Mul).is_ok());
}

#[test]
fn swiglu_siblings_of_another_n_or_dtype_are_refused() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let a = b.input("a", DType::F16, &[Dim::Static(3), Dim::Static(16)]).unwrap();
    let gate = constant(&mut b, "gate", DType::F16, &[8, 16]);
    let wide_up = constant(&mut b, "wide_up", DType::F16, &[9, 16]);
    let err = one_line(swiglu(&mut b, [a, gate, wide_up], true).unwrap_err());
    assert!(
        err.contains("argument 'up'")
            && err.contains("with N = 8, like the first weight's")
            && err.contains("f16[9, 16]"),
        "{err}"
    );
    let kn_gate = constant(&mut b, "kn_gate", DType::F16, &[16, 8]);
    let kn_up = constant(&mut b, "kn_up", DType::F16, &[16, 7]);
    let err = one_line(swiglu(&mut b, [a, kn_gate, kn_up], false).unwrap_err());
    assert!(err.contains("argument 'up'") && err.contains("with N = 8") && err.contains("f16[16, 7]"), "{err}");
    let bf16_up = constant(&mut b, "bf16_up", DType::BF16, &[8, 16]);
    let err = one_line(swiglu(&mut b, [a, gate, bf16_up], true).unwrap_err());
    assert!(err.contains("argument 'up'") && err.contains("f16[N, 16]") && err.contains("bf16[8, 16]"), "{err}");
    let short_gate = constant(&mut b, "short_gate", DType::F16, &[8, 15]);
    let up = constant(&mut b, "up", DType::F16, &[8, 16]);
    let err = one_line(swiglu(&mut b, [a, short_gate, up], true).unwrap_err());
    assert!(err.contains("argument 'gate'") && err.contains("f16[8, 15]"), "{err}");
    assert!(swiglu(&mut b, [a, gate, up], true).is_ok());
}

#[test]
fn an_a_of_rank_zero_u32_or_symbolic_k_and_bad_parameters_are_refused() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let w = constant(&mut b, "w", DType::F32, &[8, 16]);
    let scalar = b.input("scalar", DType::F32, &[]).unwrap();
    let err = one_line(matmul(&mut b, scalar, w, NK_PARAMS).unwrap_err());
    assert!(err.contains("argument 'a'") && err.contains("of rank ≥ 1"), "{err}");
    let ids = b.input("ids", DType::U32, &[Dim::Static(2), Dim::Static(16)]).unwrap();
    let u32_w = b.constant("u32_w", Tensor::from_vec(&[8, 16], vec![1u32; 128]).unwrap()).unwrap();
    let err = one_line(matmul(&mut b, ids, u32_w, NK_PARAMS).unwrap_err());
    assert!(err.contains("argument 'a'") && err.contains("a float dtype") && err.contains("u32[2, 16]"), "{err}");
    let symbolic_k = b.input("symbolic_k", DType::F32, &[Dim::Static(2), Dim::from("k")]).unwrap();
    let err = one_line(matmul(&mut b, symbolic_k, w, NK_PARAMS).unwrap_err());
    assert!(err.contains("argument 'a'") && err.contains("H static"), "{err}");

    let a = b.input("a", DType::F32, &[Dim::Static(2), Dim::Static(16)]).unwrap();
    let err = one_line(b.node("mo.matmul", Params::new(), &[a, w]).unwrap_err());
    assert!(err.contains("parameter 'transpose_b'"), "a node without transpose_b: {err}");
    let other = b.input("other", DType::F32, &[Dim::Static(2), Dim::Static(8)]).unwrap();
    let mut params = EpilogueParams { transpose_b: true, epilogue: BinaryEpilogue::Add }.to_params();
    params.insert("epilogue".into(), "sub".into());
    let err = one_line(b.node("kvjit.matmul_epilogue", params, &[a, w, other]).unwrap_err());
    assert!(err.contains("parameter 'epilogue'") && err.contains("sub"), "{err}");
    let err = one_line(b.node("mo.matmul", NK_PARAMS.to_params(), &[a]).unwrap_err());
    assert!(err.contains("inputs"), "one input: {err}");
}

/// Kernels of `spec` (the JIT, baked and with a constant, and the
/// reference), behind the runtime's interface.
fn kernels(spec: MatmulSpec, inputs: &Inputs) -> Vec<Arc<dyn Kernel>> {
    let constants = inputs.weights.iter().map(|w| Arc::new(w.clone())).collect();
    let jit = |weights| -> Arc<dyn Kernel> {
        match Jit::new(spec, weights) {
            Jit::Gemm(k) => Arc::new(k),
            Jit::Operand(k) => Arc::new(k),
            Jit::Swiglu(k) => Arc::new(k),
        }
    };
    vec![jit(None), jit(Some(constants)), reference(spec)]
}

/// Each tensor of `inputs` swapped for `bad` in turn: the arg named.
fn call_with<'t>(inputs: &'t Inputs, index: usize, bad: &'t Tensor) -> Vec<&'t Tensor> {
    let mut tensors = inputs.tensors();
    tensors[index] = bad;
    tensors
}

#[test]
fn calls_with_bad_rows_weights_or_other_are_refused_with_nothing_written() {
    let mut rng = SmallRng::seed_from_u64(41);
    for tier in tiers() {
        for orientation in [NK, KN] {
            for e in common::EPILOGUES {
                let spec = spec(e, DType::BF16, tier, orientation, (12, 10), Some(4));
                let good = inputs(&mut rng, &spec, &[2, 2]);
                let weight_names: &[&str] = if e.weights() == 2 { &["gate", "up"] } else { &["b"] };
                for kernel in kernels(spec, &good) {
                    let key = kernel.key().to_string();
                    let what = format!("{} {key}", kernel.implementation());
                    let baked_rows = kernel.implementation() == "jit";
                    // a: another row count (the JIT bakes 4), another K, rank 0.
                    for shape in [&[5, 12][..], &[4, 11], &[4, 13], &[12]] {
                        if !baked_rows && shape[shape.len() - 1] == 12 {
                            continue; // the reference takes any row count
                        }
                        let a = random(&mut rng, DType::BF16, shape);
                        let mut out = shape.to_vec();
                        *out.last_mut().unwrap() = 10;
                        let err = refused(
                            &*kernel,
                            &call_with(&good, 0, &a),
                            vec![poisoned(DType::BF16, &out)],
                            Check::Refuses,
                        );
                        assert!(matches!(err, Error::NotBuiltFor { arg: "a", .. }), "{what} a {shape:?}: {err}");
                        let rows = if baked_rows { "4" } else { "any number of" };
                        assert!(
                            err.to_string().contains(&format!("[..., 12] with {rows} rows (baked into {key}")),
                            "{what}: {err}"
                        );
                    }
                    // Each weight: transposed, one K short, one N more, flat.
                    let transposed = match orientation {
                        WeightOrientation::NK => [12, 10],
                        WeightOrientation::KN => [10, 12],
                    };
                    for (i, &name) in weight_names.iter().enumerate() {
                        for shape in [
                            &transposed[..],
                            &[spec.weight_shape()[0], spec.weight_shape()[1] - 1],
                            &[spec.weight_shape()[0] + 1, spec.weight_shape()[1]],
                            &[120],
                        ] {
                            let w = random(&mut rng, DType::BF16, shape);
                            let err = refused(
                                &*kernel,
                                &call_with(&good, 1 + i, &w),
                                vec![poisoned(DType::BF16, &[2, 2, 10])],
                                Check::Refuses,
                            );
                            assert!(
                                matches!(err, Error::NotBuiltFor { arg, .. } if arg == name),
                                "{what} {name} {shape:?}: {err}"
                            );
                            let want = format!("{:?} (baked into {key})", spec.weight_shape());
                            assert!(err.to_string().contains(&want), "{what}: {err}");
                        }
                    }
                    if e.has_operand() {
                        for shape in [&[2, 2, 9][..], &[4, 10], &[2, 2, 10, 1], &[2, 2, 12]] {
                            let other = random(&mut rng, DType::BF16, shape);
                            let err = refused(
                                &*kernel,
                                &call_with(&good, 2, &other),
                                vec![poisoned(DType::BF16, &[2, 2, 10])],
                                Check::Refuses,
                            );
                            assert!(
                                matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "other"),
                                "{what} other {shape:?}: {err}"
                            );
                            assert!(err.to_string().contains("[2, 2, 10] (the matmul's result)"), "{what}: {err}");
                        }
                        let f16_other = random(&mut rng, DType::F16, &[2, 2, 10]);
                        let err = refused(
                            &*kernel,
                            &call_with(&good, 2, &f16_other),
                            vec![poisoned(DType::BF16, &[2, 2, 10])],
                            Check::Refuses,
                        );
                        assert!(
                            matches!(&err, Error::DTypeMismatch { arg, got: DType::F16, .. } if arg == "other"),
                            "{what}: {err}"
                        );
                    }
                    // Dtypes of a and of each weight.
                    let f32_a = random(&mut rng, DType::F32, &[2, 2, 12]);
                    let err = refused(
                        &*kernel,
                        &call_with(&good, 0, &f32_a),
                        vec![poisoned(DType::BF16, &[2, 2, 10])],
                        Check::Refuses,
                    );
                    assert!(
                        matches!(&err, Error::DTypeMismatch { arg, expected: DType::BF16, got: DType::F32 } if arg == "a"),
                        "{what}: {err}"
                    );
                    for (i, &name) in weight_names.iter().enumerate() {
                        let f16_w = random(&mut rng, DType::F16, &spec.weight_shape());
                        let err = refused(
                            &*kernel,
                            &call_with(&good, 1 + i, &f16_w),
                            vec![poisoned(DType::BF16, &[2, 2, 10])],
                            Check::Refuses,
                        );
                        assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == name), "{what}: {err}");
                    }
                    // A strided a.
                    let square = random(&mut rng, DType::BF16, &[12, 12]);
                    let strided = square.permuted(&[1, 0]).unwrap();
                    let err = refused(
                        &*kernel,
                        &call_with(&good, 0, &strided),
                        vec![poisoned(DType::BF16, &[12, 10])],
                        Check::Refuses,
                    );
                    assert!(matches!(&err, Error::NotContiguous { arg } if arg == "a"), "{what}: {err}");
                }
            }
        }
    }
}

#[test]
fn wrong_arity_and_outputs_are_refused() {
    let mut rng = SmallRng::seed_from_u64(42);
    let tier = tiers()[0];
    for e in common::EPILOGUES {
        let spec = spec(e, DType::F32, tier, NK, (12, 10), None);
        let good = inputs(&mut rng, &spec, &[3]);
        let names = match e.weights() + usize::from(e.has_operand()) {
            1 => "2 tensors (a, b)",
            _ if e.has_operand() => "3 tensors (a, b, other)",
            _ => "3 tensors (a, gate, up)",
        };
        for kernel in kernels(spec, &good) {
            let what = format!("{} {}", kernel.implementation(), common::name(&spec));
            let tensors = good.tensors();
            let out = || poisoned(DType::F32, &[3, 10]);
            let mut longer = tensors.clone();
            longer.push(&good.a);
            let calls: [(Vec<&Tensor>, Vec<Tensor>); 4] = [
                (tensors[..tensors.len() - 1].to_vec(), vec![out()]),
                (vec![], vec![out()]),
                (longer, vec![out()]),
                (tensors.clone(), vec![out(), out()]),
            ];
            for (tensors, outputs) in calls {
                let err = refused(&*kernel, &tensors, outputs, Check::Skip);
                assert!(matches!(err, Error::KernelArguments { .. }), "{what}: {err}");
                assert!(err.to_string().contains(&format!("{names}, 0 KV caches and 1 outputs")), "{what}: {err}");
            }
            let err = refused(&*kernel, &tensors, vec![poisoned(DType::BF16, &[3, 10])], Check::Accepts);
            assert!(matches!(&err, Error::DTypeMismatch { arg, .. } if arg == "output"), "{what}: {err}");
            for shape in [&[30][..], &[3, 11], &[1, 3, 10]] {
                let err = refused(&*kernel, &tensors, vec![poisoned(DType::F32, shape)], Check::Accepts);
                assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "output"), "{what} {shape:?}: {err}");
            }
        }
    }
}

#[test]
fn run_into_refuses_a_buffer_of_the_wrong_length_or_a_bad_input() {
    let mut rng = SmallRng::seed_from_u64(43);
    for tier in tiers() {
        let spec = spec(common::EPILOGUES[2], DType::F16, tier, KN, (12, 10), None);
        let good = inputs(&mut rng, &spec, &[3]);
        let jit = Jit::new(spec, None);
        for len in [29, 31, 0] {
            let mut out = Guarded::new(16, &nan_bytes(DType::F16, len), 16);
            let before = out.clone();
            let err = jit.run_into(&good.tensors(), out.body_mut(), &common::ctx(2)).unwrap_err();
            assert!(matches!(err, Error::ByteCount { .. }), "{err}");
            assert!(out == before, "{len} elements: refused ({err}) but written");
        }
        let mut out = Guarded::new(16, &nan_bytes(DType::F16, 30), 16);
        let short = random(&mut rng, DType::F16, &[12, 9]);
        let err = jit.run_into(&call_with(&good, 1, &short), out.body_mut(), &common::ctx(1)).unwrap_err();
        assert!(matches!(err, Error::NotBuiltFor { arg: "b", .. }), "{err}");
        let bad_other = random(&mut rng, DType::F16, &[3, 9]);
        let err = jit.run_into(&call_with(&good, 2, &bad_other), out.body_mut(), &common::ctx(1)).unwrap_err();
        assert!(matches!(&err, Error::ShapeMismatch { arg, .. } if arg == "other"), "{err}");
        let err = jit.run_into(&good.tensors()[..2], out.body_mut(), &common::ctx(1)).unwrap_err();
        assert!(matches!(err, Error::KernelArguments { .. }), "{err}");
        assert!(out.body() == nan_bytes(DType::F16, 30), "refused calls wrote the output");
        out.assert_guards("refused calls");
    }
}
