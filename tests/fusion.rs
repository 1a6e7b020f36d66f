//! The compiler's fusion pass (`kvjit::fuse`) on an MLP block: which nodes
//! it fuses and which it must leave alone, and that fused and unfused
//! graphs compute the same outputs (bit for bit in f32, where the
//! arithmetic order is the same on both tiers; within the dtype's rounding
//! otherwise).

use std::collections::BTreeMap;

use kvjit::ops::{MatmulParams, RmsNormParams, add, matmul, mul, rms_norm, silu};
use kvjit::{
    BuildOptions, CompileOptions, CpuTier, DType, DeviceContextPtr, Dim, Executor, Graph, GraphBuilder, Registry,
    Tensor, ValueId, compile, compiled_graph, standard_registry,
};
use kvjit_graph::NodeFusion;
use rand::SeedableRng;
use rand::rngs::StdRng;

const HIDDEN: usize = 40;
const FFN: usize = 56;

/// What to make the MLP's intermediate values visible as (graph outputs),
/// which must stop the fusions that would drop them.
#[derive(Clone, Copy, Default)]
struct Expose {
    gate: bool,
    o_proj: bool,
}

/// `x + o_proj(x)` then a SwiGLU MLP with its residual: `h = x + x·Woᵀ`,
/// `y = h + down(silu(n·Wgᵀ) ⊙ n·Wuᵀ)`, `n = rms_norm(h)`.
fn mlp_graph(registry: &Registry, dtype: DType, expose: Expose) -> Graph {
    let mut rng = StdRng::seed_from_u64(5);
    let mut b = GraphBuilder::new("mlp", registry.ops());
    let x = b.input("x", dtype, &[Dim::from("batch"), Dim::from("seq"), Dim::from(HIDDEN)]).unwrap();
    let mut weight = |b: &mut GraphBuilder, name: &str, shape: [usize; 2]| -> ValueId {
        let bound = 1.0 / (shape[1] as f32).sqrt();
        b.constant(name, Tensor::random(dtype, &shape, &mut rng, -bound, bound).unwrap()).unwrap()
    };
    let t = MatmulParams { transpose_b: true };
    let wo = weight(&mut b, "o_proj", [HIDDEN, HIDDEN]);
    let wg = weight(&mut b, "gate", [FFN, HIDDEN]);
    let wu = weight(&mut b, "up", [FFN, HIDDEN]);
    let wd = weight(&mut b, "down", [HIDDEN, FFN]);
    let norm = b.constant("norm", Tensor::random(dtype, &[HIDDEN], &mut StdRng::seed_from_u64(6), 0.5, 1.5).unwrap());
    let norm = norm.unwrap();
    let o = matmul(&mut b, x, wo, t).unwrap();
    let h = add(&mut b, o, x).unwrap();
    let n = rms_norm(&mut b, h, norm, RmsNormParams { epsilon: 1e-5, weight_offset: None }).unwrap();
    let g = matmul(&mut b, n, wg, t).unwrap();
    let u = matmul(&mut b, n, wu, t).unwrap();
    let s = silu(&mut b, g).unwrap();
    let m = mul(&mut b, s, u).unwrap();
    let d = matmul(&mut b, m, wd, t).unwrap();
    let y = add(&mut b, h, d).unwrap();
    b.output("y", y).unwrap();
    if expose.gate {
        b.output("gate_out", g).unwrap();
    }
    if expose.o_proj {
        b.output("o_proj_out", o).unwrap();
    }
    b.finish().unwrap()
}

fn options(fuse: bool, tier: CpuTier) -> CompileOptions {
    CompileOptions { build: BuildOptions { cpu_tier: tier, ..BuildOptions::default() }, fuse, ..Default::default() }
}

/// Each fused node's op and the ops of the nodes it absorbed.
fn fusions(graph: &Graph, registry: &Registry, fuse: bool) -> Vec<(String, Vec<String>)> {
    let fused = compiled_graph(graph, registry, &options(fuse, CpuTier::Auto)).unwrap();
    let op_of = |n: &kvjit_graph::NodeId| graph.nodes()[n.index()].op.clone();
    fused.fused().map(|(node, absorbed)| (node.op.clone(), absorbed.iter().map(op_of).collect())).collect()
}

#[test]
fn the_mlp_block_fuses_its_residual_adds_and_its_swiglu_siblings() {
    let registry = standard_registry();
    let graph = mlp_graph(&registry, DType::F32, Expose::default());
    let got = fusions(&graph, &registry, true);
    let expected = [
        ("kvjit.swiglu_matmul", vec!["mo.matmul", "mo.matmul", "mo.silu", "mo.mul"]),
        ("kvjit.matmul_epilogue", vec!["mo.matmul", "mo.add"]),
        ("kvjit.matmul_epilogue", vec!["mo.matmul", "mo.add"]),
    ];
    let mut got_sorted = got.clone();
    got_sorted.sort();
    let mut expected: Vec<(String, Vec<String>)> =
        expected.iter().map(|(op, ops)| (op.to_string(), ops.iter().map(|s| s.to_string()).collect())).collect();
    expected.sort();
    assert_eq!(got_sorted, expected);
    // 9 nodes become 4: o_proj+add, rms_norm, swiglu, down+add.
    let fused = compiled_graph(&graph, &registry, &options(true, CpuTier::Auto)).unwrap();
    assert_eq!(fused.graph.nodes().len(), 4);
    assert!(fusions(&graph, &registry, false).is_empty(), "--no-fuse fuses nothing");
}

#[test]
fn values_read_elsewhere_are_never_fused_away() {
    let registry = standard_registry();
    // The gate's product is a graph output: no SwiGLU sibling fusion, and
    // no epilogue on the gate matmul; o_proj's result is an output: its
    // add stays unfused. What is left: `u · silu(g)` as the up matmul's mul
    // epilogue, and down + residual.
    let graph = mlp_graph(&registry, DType::F32, Expose { gate: true, o_proj: true });
    let got = fusions(&graph, &registry, true);
    assert!(got.iter().all(|(op, _)| op != "kvjit.swiglu_matmul"), "{got:?}");
    let epilogues: Vec<&Vec<String>> =
        got.iter().filter(|(op, _)| op == "kvjit.matmul_epilogue").map(|(_, a)| a).collect();
    assert_eq!(epilogues.len(), 2, "{got:?}");
    assert!(got.iter().any(|(_, a)| a == &["mo.matmul", "mo.mul"]), "up · silu(g) fuses as a mul epilogue: {got:?}");
    let exe = compile(&graph, &registry, &options(true, CpuTier::Auto)).unwrap();
    let out = run(&exe, DType::F32, 1);
    assert!(out.contains_key("gate_out") && out.contains_key("o_proj_out"));
}

#[test]
fn a_fusion_dropping_a_value_something_else_reads_is_refused() {
    let registry = standard_registry();
    let graph = mlp_graph(&registry, DType::F32, Expose { gate: false, o_proj: true });
    let matmul = graph.nodes().iter().find(|n| n.op == "mo.matmul").unwrap();
    let add = graph.nodes().iter().find(|n| n.op == "mo.add").unwrap();
    let fusion = NodeFusion {
        absorbed: vec![matmul.id, add.id],
        op: "kvjit.matmul_epilogue".into(),
        params: kvjit_op::OpParams::to_params(&kvjit_op_matmul::EpilogueParams {
            transpose_b: true,
            epilogue: kvjit_op_matmul::BinaryEpilogue::Add,
        }),
        inputs: vec![matmul.inputs[0], matmul.inputs[1], add.inputs[1]],
        output: add.outputs[0],
    };
    let error = graph.fuse_nodes(registry.ops(), &[fusion]).unwrap_err().to_string();
    assert!(error.contains("graph output 'o_proj_out'"), "{error}");
}

/// Run `exe` on seeded inputs (batch 2, seq 5).
fn run(exe: &kvjit::Executable, dtype: DType, threads: usize) -> BTreeMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(11);
    let x = Tensor::random(dtype, &[2, 5, HIDDEN], &mut rng, -2.0, 2.0).unwrap();
    let inputs = BTreeMap::from([("x".to_string(), x)]);
    let executor = Executor::new(DeviceContextPtr::cpu(threads).unwrap());
    let out = executor.run(exe, &inputs, &mut BTreeMap::new()).unwrap();
    out.outputs.into_iter().collect()
}

#[test]
fn fused_and_unfused_graphs_agree() {
    let registry = standard_registry();
    let mut tiers = vec![CpuTier::Cranelift];
    if kvjit_jit::microkernel::avx2_available() {
        tiers.push(CpuTier::Avx2);
    }
    for dtype in DType::FLOATS {
        let graph = mlp_graph(&registry, dtype, Expose::default());
        for &tier in &tiers {
            let fused = compile(&graph, &registry, &options(true, tier)).unwrap();
            let unfused = compile(&graph, &registry, &options(false, tier)).unwrap();
            assert!(fused.steps().len() < unfused.steps().len());
            assert!(fused.steps().iter().any(|s| s.label.contains('+')), "fused steps name what they absorbed");
            let f = run(&fused, dtype, 2)["y"].to_f32_vec().unwrap();
            let u = run(&unfused, dtype, 2)["y"].to_f32_vec().unwrap();
            let scale = u.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.1, "outputs are not trivially small");
            let worst = f.iter().zip(&u).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
            // The unfused graph rounds each intermediate to the dtype: a few
            // steps of the dtype's precision through two more layers.
            let tolerance = match dtype {
                DType::F32 => 0.0,
                DType::BF16 => 4.0 * 2f32.powi(-8),
                _ => 4.0 * 2f32.powi(-11),
            };
            assert!(worst <= tolerance, "{dtype} {tier:?}: fused vs unfused differ by {worst} (of max |y|)");
        }
    }
}
