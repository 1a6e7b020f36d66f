//! The op in a graph, registered as `Defined(LastTokenOp)`: a node infers
//! `[B, H]` in `x`'s dtype; a `valid_lengths` whose batch disagrees with
//! `x`'s, and other bad inputs, are refused when the node is added, in one
//! line; specialize gives the key holding the typed spec; CUDA is refused;
//! both kernels build from the key and agree bit for bit.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{ctx, expected_bytes, lengths, random_x};
use kvjit_core::{Backend, CodeTier, DType, Target, Tensor};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry, TensorType, ValueType, specialize};
use kvjit_op::checks::StepDims;
use kvjit_op::{Defined, OpParams};
use kvjit_op_last_token::{LastTokenOp, LastTokenParams, LastTokenSpec, last_valid_token};
use kvjit_runtime::{BuildOptions, KernelBuilder, KernelImpl};
use rand::SeedableRng;
use rand::rngs::SmallRng;

const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);
const HIDDEN: usize = 20;

fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(LastTokenOp))).unwrap();
    registry
}

/// A graph `output = last_valid_token(x, valid_lengths)`, `x:
/// f32[batch, seq, 20]`, `valid_lengths: u32[batch]`.
fn graph(registry: &OpRegistry) -> kvjit_graph::Graph {
    let mut b = GraphBuilder::new("last", registry);
    let x = b.input("x", DType::F32, &[Dim::from("batch"), Dim::from("seq"), Dim::Static(HIDDEN)]).unwrap();
    let valid = b.input("valid_lengths", DType::U32, &[Dim::from("batch")]).unwrap();
    let y = last_valid_token(&mut b, x, valid).unwrap();
    b.output("y", y).unwrap();
    let graph = b.finish().unwrap();
    let want = ValueType::Tensor(TensorType::new(DType::F32, [Dim::from("batch"), Dim::Static(HIDDEN)]));
    assert_eq!(graph.value(y).ty, want, "the node's inferred output");
    graph
}

#[test]
fn a_node_specializes_to_the_key_holding_its_spec() {
    let registry = registry();
    let graph = graph(&registry);
    let symbolic = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    assert_eq!(symbolic.kernel_keys()[0].to_string(), "last_valid_token.cpu.f32.h20.bany.sany");
    let bound = BTreeMap::from([("batch".to_string(), 3), ("seq".to_string(), 4)]);
    let specialized = specialize(&graph, &registry, CPU, &bound).unwrap();
    let key = &specialized.kernel_keys()[0];
    assert_eq!(key.to_string(), "last_valid_token.cpu.f32.h20.b3.s4");
    let want = LastTokenSpec { target: Target::Cpu, dtype: DType::F32, hidden: HIDDEN, step: StepDims::fixed(3, 4) };
    assert_eq!(key.spec::<LastTokenSpec>(), Some(&want));

    let x = random_x(&mut SmallRng::seed_from_u64(111), DType::F32, &[3, 4, HIDDEN]);
    let valid = lengths(&[4, 0, 2]);
    let run = |implementation| {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        let kernel = Defined(LastTokenOp).build(key, &[None, None], &options).unwrap();
        assert_eq!(kernel.key(), key);
        let mut out = Tensor::zeros(DType::F32, &[3, HIDDEN]).unwrap();
        kvjit_testkit::poison(&mut out);
        kernel.run(&[&x, &valid], &mut [], std::slice::from_mut(&mut out), &ctx(2)).unwrap();
        (kernel.implementation(), out)
    };
    let ((jit, got), (reference, want)) = (run(KernelImpl::Fast), run(KernelImpl::Reference));
    assert_eq!((jit, reference), ("jit", "reference"));
    assert_eq!(got.as_bytes(), want.as_bytes(), "the two kernels built from the key");
    assert_eq!(got.as_bytes(), expected_bytes(&x, &valid));
}

#[test]
fn cuda_is_refused_at_specialize() {
    let registry = registry();
    let err = specialize(&graph(&registry), &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op kvjit.last_valid_token yet"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_batch_mismatch_and_bad_inputs_are_refused_in_one_line() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let dims = |d: &[usize]| d.iter().map(|&v| Dim::Static(v)).collect::<Vec<_>>();
    let x = b.input("x", DType::BF16, &dims(&[4, 6, 8])).unwrap();
    let one_line = |err: kvjit_graph::GraphError| {
        let text = err.to_string();
        assert_eq!(text.lines().count(), 1, "{text}");
        text
    };
    let other_batch = b.input("v3", DType::U32, &dims(&[3])).unwrap();
    let symbolic_batch = b.input("vb", DType::U32, &[Dim::from("batch")]).unwrap();
    let float_valid = b.input("vf", DType::F32, &dims(&[4])).unwrap();
    for bad in [other_batch, symbolic_batch, float_valid] {
        let err = one_line(last_valid_token(&mut b, x, bad).unwrap_err());
        assert!(err.contains("valid_lengths") && err.contains("u32[4] (B from x)"), "{err}");
    }
    let valid = b.input("valid", DType::U32, &dims(&[4])).unwrap();
    let flat = b.input("flat", DType::BF16, &dims(&[4, 48])).unwrap();
    let ids = b.input("ids", DType::U32, &dims(&[4, 6, 8])).unwrap();
    let open_h = b.input("open_h", DType::BF16, &[Dim::Static(4), Dim::Static(6), Dim::from("h")]).unwrap();
    for bad in [flat, ids, open_h] {
        let err = one_line(last_valid_token(&mut b, bad, valid).unwrap_err());
        assert!(err.contains("x") && err.contains("f32, bf16 or f16 [B, S, H] with H static"), "{err}");
    }
    last_valid_token(&mut b, x, valid).expect("the good node next to them");
}

#[test]
fn params_are_none() {
    assert!(LastTokenParams::SPECS.is_empty());
    assert!(LastTokenParams {}.to_params().is_empty());
    assert_eq!(LastTokenParams::read(&Default::default()).unwrap(), LastTokenParams {});
}
