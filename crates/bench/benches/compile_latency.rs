//! Compile latency: how long from a graph to runnable kernels, and from a
//! graph file to the first output, bf16, page 16, 2 threads. Ids are
//! `compile_latency/<case>/<kernel key>`:
//!
//! - `graph_1_node`: build a one-node graph with the builder (weight
//!   constant), specialize it for decode (B = S = 1), JIT-compile it and
//!   pack its weight — on the 1B-class and Llama-3-8B shapes;
//! - `graph_32_layers`: the same with 32 nodes, one per layer of a 32-layer
//!   cache, all with one kernel key (1B-class shape): the kernel cache
//!   compiles once, so compare with `graph_1_node` — the difference is 31
//!   weight packs, not 31 compiles;
//! - `file_to_first_output`: load a graph file and its safetensors weights
//!   from disk, compile, and run the first decode step — what a user waits
//!   for before the first token.
//!
//! How to read: the time is the whole latency of one run, from nothing
//! compiled (every kernel is freed between runs, so each run JIT-compiles).
//! `kvjit bench` reports the same cases with the JIT's share from its compile
//! log.
//!
//! `cargo bench -p kvjit-bench --bench compile_latency`.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvjit::{DType, DeviceContextPtr};
use kvjit_bench::{CompileBench, CompileCase, ModelShape};

const THREADS: usize = 2;
const SEED: u64 = 7;
const LAYERS: usize = 32;

fn compile_latency(c: &mut Criterion) {
    let ctx = DeviceContextPtr::cpu(THREADS).unwrap();
    let mut group = c.benchmark_group("compile_latency");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    for shape in [ModelShape::llama_1b(), ModelShape::llama3_8b()] {
        let bench = CompileBench::new(&shape, DType::BF16, 16, &ctx, SEED).unwrap();
        let mut cases = vec![CompileCase::OneNode, CompileCase::FileToFirstOutput];
        if shape == ModelShape::llama_1b() {
            // 32 packed copies of the 8B weight would need 1.6 GB.
            cases.insert(1, CompileCase::Layers(LAYERS));
        }
        for case in cases {
            group.bench_function(BenchmarkId::new(case.id(), bench.kernel_key(case)), |b| {
                b.iter(|| bench.run(case).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, compile_latency);
criterion_main!(benches);
