//! The op in a graph, registered as `Defined(GatherOp)`: a node infers
//! `[B, S, H]` in the table's dtype; a table that is not a graph constant,
//! and bad ids or tables, are refused when the node is added, in one line;
//! specialize gives the key holding the typed spec (`bany.sany` until B
//! and S are bound); CUDA is refused; both kernels build from the key and
//! agree bit for bit.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{ctx, expected_bytes, random_ids, random_table};
use kvjit_core::{Backend, CodeTier, DType, Target, Tensor};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry, TensorType, ValueType, specialize};
use kvjit_op::checks::StepDims;
use kvjit_op::{Defined, OpParams};
use kvjit_op_gather::{GatherOp, GatherParams, GatherSpec, gather};
use kvjit_runtime::{BuildOptions, KernelBuilder, KernelImpl};
use rand::SeedableRng;
use rand::rngs::SmallRng;

const CPU: Backend = Backend::Cpu(CodeTier::Cranelift);
const VOCAB: usize = 11;
const HIDDEN: usize = 24;

fn registry() -> OpRegistry {
    let mut registry = OpRegistry::new();
    registry.register(Arc::new(Defined(GatherOp))).unwrap();
    registry
}

/// A graph `output = gather(table, ids)`, `table: bf16[11, 24]` constant,
/// `ids: u32[batch, seq]`.
fn graph(registry: &OpRegistry, table: Tensor) -> kvjit_graph::Graph {
    let mut b = GraphBuilder::new("embed", registry);
    let table = b.constant("table", table).unwrap();
    let ids = b.input("ids", DType::U32, &[Dim::from("batch"), Dim::from("seq")]).unwrap();
    let y = gather(&mut b, table, ids).unwrap();
    b.output("y", y).unwrap();
    let graph = b.finish().unwrap();
    let want =
        ValueType::Tensor(TensorType::new(DType::BF16, [Dim::from("batch"), Dim::from("seq"), Dim::Static(HIDDEN)]));
    assert_eq!(graph.value(y).ty, want, "the node's inferred output");
    graph
}

#[test]
fn a_node_specializes_to_the_key_holding_its_spec() {
    let mut rng = SmallRng::seed_from_u64(81);
    let table = random_table(&mut rng, DType::BF16, VOCAB, HIDDEN);
    let registry = registry();
    let graph = graph(&registry, table.clone());
    let symbolic = specialize(&graph, &registry, CPU, &BTreeMap::new()).unwrap();
    assert_eq!(symbolic.kernel_keys()[0].to_string(), "gather.cpu.bf16.v11.h24.bany.sany");

    let bound = BTreeMap::from([("batch".to_string(), 2), ("seq".to_string(), 3)]);
    let specialized = specialize(&graph, &registry, CPU, &bound).unwrap();
    let key = &specialized.kernel_keys()[0];
    assert_eq!(key.to_string(), "gather.cpu.bf16.v11.h24.b2.s3");
    let want = GatherSpec {
        target: Target::Cpu,
        dtype: DType::BF16,
        table: DType::BF16,
        vocab: VOCAB,
        hidden: HIDDEN,
        step: StepDims::fixed(2, 3),
    };
    assert_eq!(key.spec::<GatherSpec>(), Some(&want));

    let ids = random_ids(&mut rng, VOCAB, 2, 3);
    let run = |implementation| {
        let options = BuildOptions { implementation, ..BuildOptions::default() };
        let kernel = Defined(GatherOp).build(key, &[None, None], &options).unwrap();
        assert_eq!(kernel.key(), key);
        let mut out = Tensor::zeros(DType::BF16, &[2, 3, HIDDEN]).unwrap();
        kvjit_testkit::poison(&mut out);
        kernel.run(&[&table, &ids], &mut [], std::slice::from_mut(&mut out), &ctx(2)).unwrap();
        (kernel.implementation(), out)
    };
    let ((jit, got), (reference, want)) = (run(KernelImpl::Fast), run(KernelImpl::Reference));
    assert_eq!((jit, reference), ("jit", "reference"));
    assert_eq!(got.as_bytes(), want.as_bytes(), "the two kernels built from the key");
    assert_eq!(got.as_bytes(), expected_bytes(&table, &ids));
}

#[test]
fn cuda_is_refused_at_specialize() {
    let registry = registry();
    let table = random_table(&mut SmallRng::seed_from_u64(82), DType::BF16, VOCAB, HIDDEN);
    let err = specialize(&graph(&registry, table), &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("no CUDA variant for op mo.gather yet"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_table_that_is_not_a_constant_and_bad_inputs_are_refused_in_one_line() {
    let registry = registry();
    let mut rng = SmallRng::seed_from_u64(83);
    let mut b = GraphBuilder::new("bad", &registry);
    let runtime_table = b.input("table", DType::F32, &[Dim::Static(VOCAB), Dim::Static(HIDDEN)]).unwrap();
    let ids = b.input("ids", DType::U32, &[Dim::Static(2), Dim::Static(3)]).unwrap();
    let one_line = |err: kvjit_graph::GraphError| {
        let text = err.to_string();
        assert_eq!(text.lines().count(), 1, "{text}");
        text
    };
    let err = one_line(gather(&mut b, runtime_table, ids).unwrap_err());
    assert!(err.contains("table") && err.contains("a graph constant"), "{err}");

    let table = b.constant("t", random_table(&mut rng, DType::F32, VOCAB, HIDDEN)).unwrap();
    let float_ids = b.input("float_ids", DType::F32, &[Dim::Static(2), Dim::Static(3)]).unwrap();
    let flat_ids = b.input("flat_ids", DType::U32, &[Dim::Static(6)]).unwrap();
    for bad in [float_ids, flat_ids] {
        let err = one_line(gather(&mut b, table, bad).unwrap_err());
        assert!(err.contains("ids") && err.contains("u32[B, S]"), "{err}");
    }
    let u32_table = b.constant("u", Tensor::from_vec(&[VOCAB, 2], vec![1u32; VOCAB * 2]).unwrap()).unwrap();
    let flat_table = b
        .constant("flat", random_table(&mut rng, DType::F32, VOCAB, HIDDEN).reshaped(&[VOCAB * HIDDEN]).unwrap())
        .unwrap();
    for bad in [u32_table, flat_table] {
        let err = one_line(gather(&mut b, bad, ids).unwrap_err());
        assert!(err.contains("table") && err.contains("f32, bf16 or f16 [V, H]"), "{err}");
    }
    gather(&mut b, table, ids).expect("the good node next to them");
}

#[test]
fn the_one_param_is_an_optional_output_dtype() {
    assert_eq!(GatherParams::SPECS.len(), 1);
    assert!(!GatherParams::SPECS[0].required);
    assert!(GatherParams { dtype: None }.to_params().is_empty());
    assert_eq!(GatherParams::read(&Default::default()).unwrap(), GatherParams { dtype: None });
}
