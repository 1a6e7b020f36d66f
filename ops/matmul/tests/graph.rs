//! The four ops in a graph, registered as `Defined(…)`: nodes infer
//! `[..., N]` in `a`'s dtype, specialize gives keys holding the typed spec
//! (baked rows when every leading dim is bound, `rowsany` otherwise; the
//! CPU tier in the name, since the code depends on it), CUDA is refused
//! with the platform's reason, and the kernels built from each key — the
//! JIT with the graph's constant weights or with the panels a first build
//! prepared, and the reference — agree. The parameters round-trip through
//! a graph file's spelling.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{Inputs, assert_close, assert_same_bytes, random, registry, tiers};
use kvjit_core::{Backend, CodeTier, DType, KernelKey, Tensor};
use kvjit_graph::{Dim, GraphBuilder, OpRegistry, TensorType, ValueType, specialize};
use kvjit_op::gemm::WeightOrientation;
use kvjit_op::rows::Rows;
use kvjit_op::{Defined, OpParams};
use kvjit_op_matmul::{
    BinaryEpilogue, Epilogue, EpilogueMatmulSpec, EpilogueParams, MatmulEpilogueOp, MatmulOp, MatmulParams,
    MatmulSiluOp, MatmulSpec, SwigluMatmulOp, SwigluMatmulSpec, matmul,
};
use kvjit_runtime::{BuildOptions, ConstantInput, KernelBuilder, KernelImpl};
use kvjit_testkit::calls::run_poisoned;
use rand::SeedableRng;
use rand::rngs::SmallRng;

const K: usize = 16;
const N: usize = 8;

/// The graph's constants and its `residual` input.
struct Weights {
    w: Tensor,
    w_kn: Tensor,
    gate: Tensor,
    up: Tensor,
}

fn x_shape() -> [Dim; 3] {
    [Dim::from("batch"), Dim::Static(3), Dim::Static(K)]
}

fn y_shape() -> [Dim; 3] {
    [Dim::from("batch"), Dim::Static(3), Dim::Static(N)]
}

/// `x: bf16[batch, 3, 16]`, `residual: bf16[batch, 3, 8]`; nodes in order
/// `matmul(x, w)`, `matmul(x, w_kn)` (`[K, N]`), `matmul_silu(x, w)`,
/// `matmul_epilogue(x, w, residual)` (add), `swiglu_matmul(x, gate, up)`.
fn graph(registry: &OpRegistry, weights: &Weights) -> kvjit_graph::Graph {
    let mut b = GraphBuilder::new("matmuls", registry);
    let x = b.input("x", DType::BF16, &x_shape()).unwrap();
    let residual = b.input("residual", DType::BF16, &y_shape()).unwrap();
    let w = b.constant("w", weights.w.clone()).unwrap();
    let w_kn = b.constant("w_kn", weights.w_kn.clone()).unwrap();
    let gate = b.constant("gate", weights.gate.clone()).unwrap();
    let up = b.constant("up", weights.up.clone()).unwrap();
    let nk = MatmulParams { transpose_b: true };
    let outputs = [
        matmul(&mut b, x, w, nk).unwrap(),
        matmul(&mut b, x, w_kn, MatmulParams { transpose_b: false }).unwrap(),
        kvjit_op::add_node::<MatmulSiluOp, 2>(&mut b, &nk, [x, w]).unwrap()[0],
        kvjit_op::add_node::<MatmulEpilogueOp, 3>(
            &mut b,
            &EpilogueParams { transpose_b: true, epilogue: BinaryEpilogue::Add },
            [x, w, residual],
        )
        .unwrap()[0],
        kvjit_op::add_node::<SwigluMatmulOp, 3>(&mut b, &nk, [x, gate, up]).unwrap()[0],
    ];
    for (i, &y) in outputs.iter().enumerate() {
        b.output(&format!("y{i}"), y).unwrap();
    }
    let graph = b.finish().unwrap();
    for y in outputs {
        assert_eq!(
            graph.value(y).ty,
            ValueType::Tensor(TensorType::new(DType::BF16, y_shape())),
            "the inferred output"
        );
    }
    graph
}

fn weights(rng: &mut SmallRng) -> Weights {
    Weights {
        w: random(rng, DType::BF16, &[N, K]),
        w_kn: random(rng, DType::BF16, &[K, N]),
        gate: random(rng, DType::BF16, &[N, K]),
        up: random(rng, DType::BF16, &[N, K]),
    }
}

/// The GEMM spec of node `node` of the graph, on `backend`, rows `rows`.
fn expected_spec(node: usize, backend: Backend, rows: Option<usize>) -> MatmulSpec {
    let (orientation, epilogue) = match node {
        0 => (WeightOrientation::NK, Epilogue::None),
        1 => (WeightOrientation::KN, Epilogue::None),
        2 => (WeightOrientation::NK, Epilogue::Silu),
        3 => (WeightOrientation::NK, Epilogue::Add),
        _ => (WeightOrientation::NK, Epilogue::SwiGlu),
    };
    MatmulSpec {
        backend,
        dtype: DType::BF16,
        weights: DType::BF16,
        rows: Rows { width: K, rows },
        n: N,
        orientation,
        epilogue,
    }
}

/// The GEMM spec a key holds, whichever of the three spec types it is.
fn spec_in(key: &KernelKey) -> MatmulSpec {
    key.spec::<MatmulSpec>()
        .copied()
        .or_else(|| key.spec::<EpilogueMatmulSpec>().map(|s| s.0))
        .or_else(|| key.spec::<SwigluMatmulSpec>().map(|s| s.0))
        .unwrap_or_else(|| panic!("{key} holds no matmul spec"))
}

fn builder(node: usize) -> Box<dyn KernelBuilder> {
    match node {
        0 | 1 => Box::new(Defined(MatmulOp)),
        2 => Box::new(Defined(MatmulSiluOp)),
        3 => Box::new(Defined(MatmulEpilogueOp)),
        _ => Box::new(Defined(SwigluMatmulOp)),
    }
}

#[test]
fn nodes_specialize_to_keys_holding_their_specs() {
    let registry = registry();
    let mut rng = SmallRng::seed_from_u64(71);
    let graph = graph(&registry, &weights(&mut rng));
    let names = ["matmul", "matmul", "matmul_silu", "matmul_add", "swiglu_matmul"];
    let bound = BTreeMap::from([("batch".to_string(), 2)]);
    for tier in [CodeTier::Cranelift, CodeTier::Avx2] {
        let backend = Backend::Cpu(tier);
        for (bindings, rows) in [(BTreeMap::new(), None), (bound.clone(), Some(6))] {
            let specialized = specialize(&graph, &registry, backend, &bindings).unwrap();
            let keys = specialized.kernel_keys();
            assert_eq!(keys.len(), 5);
            for (node, key) in keys.iter().enumerate() {
                let tb = if node == 1 { 0 } else { 1 };
                let rows_name = rows.map_or("rowsany".to_string(), |r| format!("rows{r}"));
                let name = format!("{}.cpu-{}.bf16.k{K}.n{N}.{rows_name}.tb{tb}", names[node], tier.name());
                assert_eq!(key.to_string(), name, "node {node}");
                assert_eq!(spec_in(key), expected_spec(node, backend, rows), "node {node}");
            }
        }
    }
    let err = specialize(&graph, &registry, Backend::Cuda, &BTreeMap::new()).unwrap_err();
    assert!(err.to_string().contains("no CUDA variant for op mo.matmul yet"), "{err}");
}

/// The call of node `node`: `x`, its weights, and `residual` for the
/// epilogue node.
fn node_inputs(node: usize, x: &Tensor, residual: &Tensor, weights: &Weights) -> Inputs {
    let w = match node {
        1 => vec![weights.w_kn.clone()],
        4 => vec![weights.gate.clone(), weights.up.clone()],
        _ => vec![weights.w.clone()],
    };
    Inputs { a: x.clone(), weights: w, other: (node == 3).then(|| residual.clone()) }
}

/// Every node's kernel built from its key: the JIT with the graph's
/// constants (the call passing them) against the reference; the JIT with
/// the panels it prepared, rebuilt from them, gives the same bytes (called
/// with the plain weight or with the panels); a prepared weight of another
/// kernel is refused when building.
#[test]
fn kernels_built_from_the_keys_agree_and_take_their_prepared_weights() {
    let registry = registry();
    let mut rng = SmallRng::seed_from_u64(72);
    let weights = weights(&mut rng);
    let graph = graph(&registry, &weights);
    let fast = BuildOptions { implementation: KernelImpl::Fast, ..BuildOptions::default() };
    let slow = BuildOptions { implementation: KernelImpl::Reference, ..BuildOptions::default() };
    for tier in tiers() {
        for (batch, bindings) in [(2, BTreeMap::from([("batch".to_string(), 2)])), (3, BTreeMap::new())] {
            let specialized = specialize(&graph, &registry, Backend::Cpu(tier), &bindings).unwrap();
            let x = random(&mut rng, DType::BF16, &[batch, 3, K]);
            let residual = random(&mut rng, DType::BF16, &[batch, 3, N]);
            let shape = [batch, 3, N];
            for (node, key) in specialized.kernel_keys().iter().enumerate() {
                let inputs = node_inputs(node, &x, &residual, &weights);
                let plain: Vec<Arc<Tensor>> = inputs.weights.iter().map(|w| Arc::new(w.clone())).collect();
                let mut constants: Vec<Option<ConstantInput>> = vec![None];
                constants.extend(plain.iter().map(|w| Some(ConstantInput::Plain(w.clone()))));
                if node == 3 {
                    constants.push(None);
                }
                let jit = builder(node).build(key, &constants, &fast).unwrap();
                let reference = builder(node).build(key, &constants, &slow).unwrap();
                assert_eq!((jit.key(), jit.implementation()), (key, "jit"));
                assert_eq!((reference.key(), reference.implementation()), (key, "reference"));
                // The call passes the graph's constants themselves.
                let mut tensors = vec![&x];
                tensors.extend(plain.iter().map(|w| &**w));
                tensors.extend(inputs.other.as_ref());
                let got = run_poisoned(&*jit, &tensors, DType::BF16, &shape, 2);
                let want = run_poisoned(&*reference, &tensors, DType::BF16, &shape, 1);
                assert_close(&spec_in(key), &inputs, &got, &want, &format!("{key} built from its key"));

                let prepared = jit.prepared_constants();
                if node == 4 {
                    assert!(prepared.is_empty(), "{key}: SwiGLU's siblings are stored plain");
                    continue;
                }
                let [(1, prepared)] = <[_; 1]>::try_from(prepared).unwrap() else { panic!("{key}: input 1") };
                let mut from_artifact = constants.clone();
                from_artifact[1] = Some(ConstantInput::Prepared(prepared.clone()));
                let rebuilt = builder(node).build(key, &from_artifact, &fast).unwrap();
                let again = run_poisoned(&*rebuilt, &tensors, DType::BF16, &shape, 3);
                assert_same_bytes(&again, &got, &format!("{key}: rebuilt from its prepared weight"));
                let mut with_panels = tensors.clone();
                with_panels[1] = &prepared.data;
                let again = run_poisoned(&*rebuilt, &with_panels, DType::BF16, &shape, 1);
                assert_same_bytes(&again, &got, &format!("{key}: called with the panels"));

                // Panels of the [K, N] node's weight for the [N, K] one (and back).
                let other_node = if node == 1 { 0 } else { 1 };
                let other_key = &specialized.kernel_keys()[other_node];
                let err = match builder(other_node).build(other_key, &from_artifact[..2], &fast) {
                    Ok(_) => panic!("{other_key} took {key}'s panels"),
                    Err(err) => err.to_string(),
                };
                assert!(err.contains("prepared weight") && err.contains(&prepared.layout), "{err}");
            }
        }
    }
}

#[test]
fn params_round_trip_through_a_graph_file_spelling() {
    for transpose_b in [true, false] {
        let params = MatmulParams { transpose_b };
        assert_eq!(MatmulParams::read(&params.to_params()).unwrap(), params);
        for epilogue in [BinaryEpilogue::Add, BinaryEpilogue::Mul, BinaryEpilogue::SiluMul] {
            let params = EpilogueParams { transpose_b, epilogue };
            assert_eq!(EpilogueParams::read(&params.to_params()).unwrap(), params);
            assert_eq!(Epilogue::from(epilogue).kernel_name(), format!("matmul_{}", kvjit_op::Choice::name(epilogue)));
        }
    }
    let specs: Vec<(&str, bool)> = EpilogueParams::SPECS.iter().map(|s| (s.name, s.required)).collect();
    assert_eq!(specs, [("transpose_b", true), ("epilogue", true)]);
}
