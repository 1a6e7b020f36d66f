//! The ops in a graph, registered as `Defined(AddOp)` and `Defined(MulOp)`:
//! nodes infer their output type, operands of another type are refused
//! when the node is added (one line naming the argument), specialize gives
//! the keys that hold the typed spec (baked count when every dim is bound,
//! `nany` otherwise; one name for both CPU tiers), CUDA is refused with the
//! platform's reason, and both kernels build from each key and agree.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{assert_bits, ctx, random};
use kvjit_core::{Backend, CodeTier, DType, Target, Tensor};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry, Params, TensorType, ValueType, specialize};
use kvjit_op::{Defined, OpParams};
use kvjit_op_binary::{AddOp, BinaryOperation, BinaryParams, BinarySpec, MulOp, add, mul};
use kvjit_runtime::{BuildOptions, KernelBuilder, KernelImpl};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(AddOp))).unwrap();
    registry.register(Arc::new(Defined(MulOp))).unwrap();
    registry
}

const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);

fn dims() -> [Dim; 3] {
    [Dim::from("batch"), Dim::Static(3), Dim::Static(5)]
}

/// A graph `y = (a + b) · b`, `a`, `b`: bf16[batch, 3, 5].
fn graph(registry: &OpRegistry) -> kvjit_graph::Graph {
    let mut g = GraphBuilder::new("residual", registry);
    let a = g.input("a", DType::BF16, &dims()).unwrap();
    let b = g.input("b", DType::BF16, &dims()).unwrap();
    let sum = add(&mut g, a, b).unwrap();
    let y = mul(&mut g, sum, b).unwrap();
    g.output("y", y).unwrap();
    let graph = g.finish().unwrap();
    let want = ValueType::Tensor(TensorType::new(DType::BF16, dims()));
    assert_eq!((&graph.value(sum).ty, &graph.value(y).ty), (&want, &want), "the nodes' inferred outputs");
    graph
}

#[test]
fn nodes_specialize_to_the_keys_holding_their_specs() {
    let registry = registry();
    let graph = graph(&registry);
    let symbolic = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    let names: Vec<String> = symbolic.kernel_keys().iter().map(ToString::to_string).collect();
    assert_eq!(names, ["add.cpu.bf16.nany", "mul.cpu.bf16.nany"]);
    let spec = |operation, elements| BinarySpec { target: Target::Cpu, operation, dtype: DType::BF16, elements };
    assert_eq!(symbolic.kernel_keys()[0].spec::<BinarySpec>(), Some(&spec(BinaryOperation::Add, None)));
    assert_eq!(symbolic.kernel_keys()[1].spec::<BinarySpec>(), Some(&spec(BinaryOperation::Mul, None)));

    let bound = BTreeMap::from([("batch".to_string(), 4)]);
    let avx2 = specialize(&graph, &registry, Backend::Cpu(CodeTier::Avx2), &bound).unwrap();
    let cranelift = specialize(&graph, &registry, CPU, &bound).unwrap();
    let names: Vec<String> = cranelift.kernel_keys().iter().map(ToString::to_string).collect();
    assert_eq!(names, ["add.cpu.bf16.n60", "mul.cpu.bf16.n60"]);
    assert_eq!(cranelift.kernel_keys()[1].spec::<BinarySpec>(), Some(&spec(BinaryOperation::Mul, Some(60))));
    assert_eq!(avx2.kernel_keys(), cranelift.kernel_keys(), "one name whatever the tier: the code is the same");

    let mut rng = SmallRng::seed_from_u64(71);
    let (a, b) = (random(&mut rng, DType::BF16, &[4, 3, 5], 10.0), random(&mut rng, DType::BF16, &[4, 3, 5], 10.0));
    let builders: [&dyn KernelBuilder; 2] = [&Defined(AddOp), &Defined(MulOp)];
    for (key, builder) in cranelift.kernel_keys().iter().zip(builders) {
        let run = |implementation| {
            let options = BuildOptions { implementation, ..BuildOptions::default() };
            let kernel = builder.build(key, &[None, None], &options).unwrap();
            assert_eq!(kernel.key(), key);
            let mut out = Tensor::zeros(DType::BF16, &[4, 3, 5]).unwrap();
            kvjit_testkit::poison(&mut out);
            kernel.run(&[&a, &b], &mut [], std::slice::from_mut(&mut out), &ctx(2)).unwrap();
            (kernel.implementation(), out)
        };
        let ((jit, got), (reference, want)) = (run(KernelImpl::Fast), run(KernelImpl::Reference));
        assert_eq!((jit, reference), ("jit", "reference"));
        assert_bits(&format!("{key} built from the key"), &got, &want);
    }
}

#[test]
fn cuda_is_refused_at_specialize() {
    let registry = registry();
    let err = specialize(&graph(&registry), &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op mo.add yet"), "{err}");
    let mut g = GraphBuilder::new("mul", &registry);
    let a = g.input("a", DType::F32, &[Dim::Static(4)]).unwrap();
    let y = mul(&mut g, a, a).unwrap();
    g.output("y", y).unwrap();
    let err = specialize(&g.finish().unwrap(), &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op mo.mul yet"), "{err}");
}

#[test]
fn operands_of_another_type_are_refused_when_the_node_is_added() {
    let registry = registry();
    let mut g = GraphBuilder::new("bad", &registry);
    let a = g.input("a", DType::BF16, &dims()).unwrap();
    let other = |g: &mut GraphBuilder<'_>, name: &str, dtype, shape: &[Dim]| g.input(name, dtype, shape).unwrap();
    let f32_b = other(&mut g, "f32_b", DType::F32, &dims());
    let wide = other(&mut g, "wide", DType::BF16, &[Dim::from("batch"), Dim::Static(3), Dim::Static(6)]);
    let renamed = other(&mut g, "renamed", DType::BF16, &[Dim::from("seq"), Dim::Static(3), Dim::Static(5)]);
    let flat = other(&mut g, "flat", DType::BF16, &[Dim::from("batch"), Dim::Static(15)]);
    let ids = other(&mut g, "ids", DType::U32, &[Dim::Static(15)]);
    for build in [add, mul] {
        for b in [f32_b, wide, renamed, flat] {
            let err = build(&mut g, a, b).unwrap_err().to_string();
            assert!(err.contains("argument 'b': expected bf16[batch, 3, 5] (the type of a)"), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
        let err = build(&mut g, ids, ids).unwrap_err().to_string();
        assert!(err.contains("argument 'a': expected an f32, bf16 or f16 tensor (any shape), got u32[15]"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// The ops take no parameters (MAX's `mo.add`, `mo.mul`): a node gives
/// none, and one that gives any is refused naming it.
#[test]
fn nodes_take_no_parameters() {
    assert!(BinaryParams::SPECS.is_empty());
    assert!(BinaryParams {}.to_params().is_empty());
    assert_eq!(BinaryParams::read(&Params::new()).unwrap(), BinaryParams {});
    let registry = registry();
    let mut g = GraphBuilder::new("params", &registry);
    let x = g.input("x", DType::F32, &[Dim::Static(8)]).unwrap();
    for op in ["mo.add", "mo.mul"] {
        g.node(op, Params::new(), &[x, x]).unwrap();
        let mut dtype = Params::new();
        dtype.insert("dtype".into(), DType::F32.into());
        let err = g.node(op, dtype, &[x, x]).unwrap_err().to_string();
        assert!(err.contains("dtype"), "{op}: {err}");
    }
}
