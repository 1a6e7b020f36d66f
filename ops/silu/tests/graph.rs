//! The op in a graph, registered as `Defined(SiluOp)`: a node infers its
//! output type, bad parameters and inputs are refused when the node is
//! added, specialize gives the key that holds the typed spec (baked count
//! when every dim is bound, `nany` otherwise; one name for both CPU tiers),
//! CUDA is refused with the platform's reason, and both kernels build from
//! the key and agree.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{ctx, random_x};
use kvjit_core::{Backend, CodeTier, DType, Target, Tensor};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry, TensorType, ValueType, specialize};
use kvjit_op::{Defined, OpParams};
use kvjit_op_silu::{SiluOp, SiluParams, SiluSpec, silu};
use kvjit_runtime::{BuildOptions, KernelBuilder, KernelImpl};
use kvjit_testkit::{Tolerance, compare_tensors};
use rand::SeedableRng;
use rand::rngs::SmallRng;

fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(SiluOp))).unwrap();
    registry
}

const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);

/// A graph `output = silu(x)`, `x: bf16[batch, 3, 5]`.
fn graph(registry: &OpRegistry) -> kvjit_graph::Graph {
    let mut b = GraphBuilder::new("silu", registry);
    let x = b.input("x", DType::BF16, &[Dim::from("batch"), Dim::Static(3), Dim::Static(5)]).unwrap();
    let y = silu(&mut b, x).unwrap();
    b.output("y", y).unwrap();
    let graph = b.finish().unwrap();
    let want = ValueType::Tensor(TensorType::new(DType::BF16, [Dim::from("batch"), Dim::Static(3), Dim::Static(5)]));
    assert_eq!(graph.value(y).ty, want, "the node's inferred output");
    graph
}

#[test]
fn a_node_specializes_to_the_key_holding_its_spec() {
    let registry = registry();
    let graph = graph(&registry);
    let symbolic = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    let key = &symbolic.kernel_keys()[0];
    assert_eq!(key.to_string(), "silu.cpu.bf16.nany");
    assert_eq!(key.spec::<SiluSpec>(), Some(&SiluSpec { target: Target::Cpu, dtype: DType::BF16, elements: None }));

    let bound = BTreeMap::from([("batch".to_string(), 4)]);
    let avx2 = specialize(&graph, &registry, Backend::Cpu(CodeTier::Avx2), &bound).unwrap();
    let cranelift = specialize(&graph, &registry, CPU, &bound).unwrap();
    let key = &cranelift.kernel_keys()[0];
    assert_eq!(key.to_string(), "silu.cpu.bf16.n60");
    assert_eq!(key.spec::<SiluSpec>().unwrap().elements, Some(60));
    assert_eq!(avx2.kernel_keys(), cranelift.kernel_keys(), "one name whatever the tier: the code is the same");

    let mut rng = SmallRng::seed_from_u64(41);
    let x = random_x(&mut rng, DType::BF16, &[4, 3, 5], 10.0);
    let run = |implementation| {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        let kernel = Defined(SiluOp).build(key, &[None], &options).unwrap();
        assert_eq!(kernel.key(), key);
        let mut out = Tensor::zeros(DType::BF16, &[4, 3, 5]).unwrap();
        kvjit_testkit::poison(&mut out);
        kernel.run(&[&x], &mut [], std::slice::from_mut(&mut out), &ctx(2)).unwrap();
        (kernel.implementation(), out)
    };
    let ((jit, got), (reference, want)) = (run(KernelImpl::Fast), run(KernelImpl::Reference));
    assert_eq!((jit, reference), ("jit", "reference"));
    compare_tensors(Tolerance::Ulps { dtype: DType::BF16, units: 1.0 }, &got, &want).assert_ok("built from the key");
}

#[test]
fn cuda_is_refused_at_specialize() {
    let registry = registry();
    let err = specialize(&graph(&registry), &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op mo.silu yet"), "{err}");
}

#[test]
fn bad_inputs_are_refused_when_the_node_is_added() {
    let registry = registry();
    let mut b = GraphBuilder::new("bad", &registry);
    let ids = b.input("ids", DType::U32, &[Dim::Static(8)]).unwrap();
    let err = silu(&mut b, ids).unwrap_err().to_string();
    assert!(err.contains("argument 'x': expected an f32, bf16 or f16 tensor (any shape), got u32[8]"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// The op takes no parameters (MAX's `mo.silu`): a node gives none, and
/// one that gives a `dtype` is refused as an unknown parameter.
#[test]
fn a_node_takes_no_parameters() {
    assert!(SiluParams::SPECS.is_empty());
    assert!(SiluParams {}.to_params().is_empty());
    assert_eq!(SiluParams::read(&Default::default()).unwrap(), SiluParams {});
    let registry = registry();
    let mut b = GraphBuilder::new("params", &registry);
    let x = b.input("x", DType::F32, &[Dim::Static(8)]).unwrap();
    b.node("mo.silu", Default::default(), &[x]).unwrap();
    let mut dtype = kvjit_graph::Params::new();
    dtype.insert("dtype".into(), DType::F32.into());
    let err = b.node("mo.silu", dtype, &[x]).unwrap_err().to_string();
    assert!(err.contains("dtype"), "{err}");
}
