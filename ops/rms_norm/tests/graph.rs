//! The op in a graph, registered as `Defined(RmsNormOp)`: a node infers
//! its output type, a non-constant weight, a bad epsilon and bad inputs are
//! refused when the node is added (one line each), specialize gives the key
//! that holds the typed spec (baked rows when every leading dim is bound,
//! `rowsany` otherwise; one name for both CPU tiers), CUDA is refused with
//! the platform's reason, and both kernels build from the key and agree.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{allowed_ulps, ctx, random, ulps};
use kvjit_core::{Backend, CodeTier, DType, Target, Tensor};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry, Params, TensorType, ValueType, specialize};
use kvjit_op::rows::Rows;
use kvjit_op::{Defined, OpParams};
use kvjit_op_rms_norm::{RmsNormOp, RmsNormParams, RmsNormSpec, rms_norm};
use kvjit_runtime::{BuildOptions, KernelBuilder, KernelImpl};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(RmsNormOp))).unwrap();
    registry
}

const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);
const PARAMS: RmsNormParams = RmsNormParams { epsilon: 1e-5, weight_offset: Some(1.0) };

fn x_shape() -> [Dim; 3] {
    [Dim::from("batch"), Dim::Static(3), Dim::Static(16)]
}

/// A graph `y = rms_norm(x, weight)`, `x: bf16[batch, 3, 16]`, `weight` a
/// constant `bf16[16]`.
fn graph(registry: &OpRegistry, weight: &Tensor) -> kvjit_graph::Graph {
    let mut b = GraphBuilder::new("rms_norm", registry);
    let x = b.input("x", DType::BF16, &x_shape()).unwrap();
    let weight = b.constant("weight", weight.clone()).unwrap();
    let y = rms_norm(&mut b, x, weight, PARAMS).unwrap();
    b.output("y", y).unwrap();
    let graph = b.finish().unwrap();
    assert_eq!(graph.value(y).ty, ValueType::Tensor(TensorType::new(DType::BF16, x_shape())), "the inferred output");
    graph
}

#[test]
fn a_node_specializes_to_the_key_holding_its_spec() {
    let registry = registry();
    let mut rng = SmallRng::seed_from_u64(71);
    let weight = random(&mut rng, DType::BF16, &[16], (-0.5, 0.5));
    let graph = graph(&registry, &weight);
    let (eps, wo) = (1e-5f32.to_bits(), 1f32.to_bits());
    let symbolic = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    let key = &symbolic.kernel_keys()[0];
    assert_eq!(key.to_string(), format!("rms_norm.cpu.bf16.h16.rowsany.eps{eps}.wo{wo}"));
    let want = RmsNormSpec {
        target: Target::Cpu,
        dtype: DType::BF16,
        rows: Rows { width: 16, rows: None },
        epsilon: 1e-5,
        weight_offset: 1.0,
    };
    assert_eq!(key.spec::<RmsNormSpec>(), Some(&want));

    let bound = BTreeMap::from([("batch".to_string(), 4)]);
    let avx2 = specialize(&graph, &registry, Backend::Cpu(CodeTier::Avx2), &bound).unwrap();
    let cranelift = specialize(&graph, &registry, CPU, &bound).unwrap();
    let key = &cranelift.kernel_keys()[0];
    assert_eq!(key.to_string(), format!("rms_norm.cpu.bf16.h16.rows12.eps{eps}.wo{wo}"));
    assert_eq!(key.spec::<RmsNormSpec>().unwrap().rows, Rows { width: 16, rows: Some(12) });
    assert_eq!(avx2.kernel_keys(), cranelift.kernel_keys(), "one name whatever the tier: the code is the same");

    let x = random(&mut rng, DType::BF16, &[4, 3, 16], (-2.0, 2.0));
    let run = |implementation| {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        let kernel = Defined(RmsNormOp).build(key, &[None, None], &options).unwrap();
        assert_eq!(kernel.key(), key);
        let mut out = Tensor::zeros(DType::BF16, &[4, 3, 16]).unwrap();
        kvjit_testkit::poison(&mut out);
        kernel.run(&[&x, &weight], &mut [], std::slice::from_mut(&mut out), &ctx(2)).unwrap();
        (kernel.implementation(), out)
    };
    let ((jit, got), (reference, want)) = (run(KernelImpl::Fast), run(KernelImpl::Reference));
    assert_eq!((jit, reference), ("jit", "reference"));
    let error = ulps(&got, &want);
    assert!(error <= allowed_ulps(DType::BF16), "built from the key: {error} ulps");
}

#[test]
fn cuda_is_refused_at_specialize() {
    let registry = registry();
    let weight = Tensor::from_f32(DType::BF16, &[16], &[1.0; 16]).unwrap();
    let err = specialize(&graph(&registry, &weight), &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err();
    assert!(err.to_string().contains("no CUDA variant for op mo.reduce.rms_norm yet"), "{err}");
}

#[test]
fn bad_parameters_and_inputs_are_refused_when_the_node_is_added() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let x = b.input("x", DType::F32, &[Dim::from("n"), Dim::Static(8)]).unwrap();
    let weight = b.constant("weight", Tensor::from_f32(DType::F32, &[8], &[1.0; 8]).unwrap()).unwrap();
    let one_line = |err: kvjit_graph::GraphError| {
        let err = err.to_string();
        assert!(!err.contains('\n'), "one line: {err}");
        err
    };

    let not_constant = b.input("w", DType::F32, &[Dim::Static(8)]).unwrap();
    let err = one_line(rms_norm(&mut b, x, not_constant, PARAMS).unwrap_err());
    assert!(err.contains("weight") && err.contains("a graph constant"), "{err}");

    for epsilon in [-1e-5, 0.0f32.next_down()] {
        let err = one_line(rms_norm(&mut b, x, weight, RmsNormParams { epsilon, ..PARAMS }).unwrap_err());
        assert!(err.contains("epsilon") && err.contains("must be finite and ≥ 0"), "{epsilon}: {err}");
    }
    for epsilon in [f32::NAN, f32::INFINITY] {
        let err = one_line(rms_norm(&mut b, x, weight, RmsNormParams { epsilon, ..PARAMS }).unwrap_err());
        assert!(err.contains("epsilon"), "{epsilon}: {err}");
    }
    let err = one_line(b.node("mo.reduce.rms_norm", Params::new(), &[x, weight]).unwrap_err());
    assert!(err.contains("epsilon"), "a node without its epsilon: {err}");
    let zero = rms_norm(&mut b, x, weight, RmsNormParams { epsilon: 0.0, weight_offset: None });
    assert!(zero.is_ok(), "epsilon 0 is allowed: {zero:?}");

    let constant = |b: &mut GraphBuilder<'_>, name: &str, dtype: DType, len: usize| {
        b.constant(name, Tensor::from_f32(dtype, &[len], &vec![1.0; len]).unwrap()).unwrap()
    };
    let short = constant(&mut b, "short", DType::F32, 7);
    let err = one_line(rms_norm(&mut b, x, short, PARAMS).unwrap_err());
    assert!(err.contains("weight") && err.contains("f32[8] (H of x)") && err.contains("f32[7]"), "{err}");
    let bf16_weight = constant(&mut b, "bf16_weight", DType::BF16, 8);
    let err = one_line(rms_norm(&mut b, x, bf16_weight, PARAMS).unwrap_err());
    assert!(err.contains("weight") && err.contains("f32[8] (H of x)") && err.contains("bf16[8]"), "{err}");

    let ids = b.input("ids", DType::U32, &[Dim::Static(8)]).unwrap();
    let u32_weight = b.constant("u32_weight", Tensor::from_vec(&[8], vec![1u32; 8]).unwrap()).unwrap();
    let err = one_line(rms_norm(&mut b, ids, u32_weight, PARAMS).unwrap_err());
    assert!(err.contains("x") && err.contains("a float dtype"), "{err}");
    let symbolic_h = b.input("symbolic_h", DType::F32, &[Dim::Static(2), Dim::from("h")]).unwrap();
    let err = one_line(rms_norm(&mut b, symbolic_h, weight, PARAMS).unwrap_err());
    assert!(err.contains("x") && err.contains("H static"), "{err}");
}

/// −0 and +0 (epsilon, offset) are one kernel, with one key.
#[test]
fn negative_zeros_name_the_kernel_of_positive_zeros() {
    let registry = registry();
    let key = |epsilon: f32, weight_offset: f32| {
        let mut b = GraphBuilder::new("zeros", &registry);
        let x = b.input("x", DType::F32, &[Dim::Static(4)]).unwrap();
        let weight = b.constant("weight", Tensor::from_f32(DType::F32, &[4], &[1.0; 4]).unwrap()).unwrap();
        let y = rms_norm(&mut b, x, weight, RmsNormParams { epsilon, weight_offset: Some(weight_offset) }).unwrap();
        b.output("y", y).unwrap();
        let graph = b.finish().unwrap();
        specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap().kernel_keys()[0].to_string()
    };
    assert_eq!(key(-0.0, -0.0), "rms_norm.cpu.f32.h4.rows1.eps0.wo0");
    assert_eq!(key(-0.0, -0.0), key(0.0, 0.0));
}

#[test]
fn params_round_trip_through_a_graph_file_spelling() {
    for params in [PARAMS, RmsNormParams { epsilon: 1e-6, weight_offset: None }] {
        assert_eq!(RmsNormParams::read(&params.to_params()).unwrap(), params);
    }
    assert!(!RmsNormParams { epsilon: 1e-6, weight_offset: None }.to_params().contains_key("weight_offset"));
    let specs: Vec<(&str, bool)> = RmsNormParams::SPECS.iter().map(|s| (s.name, s.required)).collect();
    assert_eq!(specs, [("epsilon", true), ("weight_offset", false)]);
}
