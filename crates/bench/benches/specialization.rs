//! What shape specialization buys: the fused QKV + paged KV write, 2 threads,
//! on the three model shapes (1B-class K=2048, 32 q / 8 kv heads of 64;
//! Llama-3-8B K=4096, 32/8 heads of 128; MHA K=4096, 32/32 heads of 128),
//! M = 1 … 2048, page sizes 16 and 128, f32 and bf16. Each criterion group is
//! one shape, dtype and page size, named by its generic kernel key (e.g.
//! `fused_qkv_bshd_paged.cpu.bf16.k4096.q4096.hkv8.d128.p16.l1.kvbf16.bany.sany`);
//! ids inside are `<implementation>/<M>`, all in the same group so they are
//! compared in the same run:
//!
//! - `specialized`: the JIT kernel compiled for this call's B and S;
//! - `generic`: the JIT kernel of the symbolic key (reads M at run time);
//! - `reference`: the plain Rust reference, one thread (M ≤ 16 only: it is
//!   ~100× slower);
//! - `gemm_scatter` / `matrixmultiply_scatter`: the op as a GEMM-library user
//!   writes it — `gemm` crate / `matrixmultiply::sgemm` into an `[M, N]` f32
//!   buffer, Q copied out, K/V scattered through the page table. The
//!   libraries are f32-only: for bf16 the peers multiply an f32 copy of the
//!   weight made at load time (so they stream twice the bytes).
//!
//! Every call cycles through 128 MiB of weight copies (as a model's layers),
//! so the weight comes from DRAM, not from the cache the previous call left.
//!
//! The `roofline` group runs first: `read_2threads` is this machine's
//! 2-thread read bandwidth (throughput in bytes/s), `fma128_2threads` its
//! 2-thread F32X4 FMA rate (elements/s = FLOP/s), the JIT-compiled loop of
//! `kvjit_bench::roofline`.
//!
//! How to read: criterion's throughput shows elements/s = **FLOP/s** (2·M·N·K
//! per call) and bytes/s = **weight bytes/s**. At small M compare the bytes/s
//! with `roofline/read_2threads` (the call streams the weight once); at large
//! M compare the FLOP/s with `roofline/fma128_2threads` (the peers use 256-bit
//! FMAs and may pass it). Compare implementations only within one run: the
//! machine is shared and noisy. `kvjit bench` prints the same comparison as
//! one table with ratios.
//!
//! The whole suite takes the better part of an hour; pick with a filter, e.g.
//! `cargo bench -p kvjit-bench --bench specialization -- 'bf16.k4096.q4096.hkv8.*p16'` or
//! `-- roofline`.

use std::cell::OnceCell;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use kvjit::{DType, DeviceContextPtr, KernelSpec};
use kvjit_bench::{
    ALL_MS, FmaProbe, Implementation, LayerKernels, ModelShape, Point, Problem, ReadProbe, Runner, Weights,
    generic_kernels,
};

const THREADS: usize = 2;
const SEED: u64 = 7;
/// Bytes of weight copies each benchmark cycles through.
const WORKING_SET: usize = 128 << 20;
/// The reference runs up to this M.
const REFERENCE_MAX_M: usize = 16;

fn roofline(c: &mut Criterion) {
    let ctx = DeviceContextPtr::cpu(THREADS).unwrap();
    let mut group = c.benchmark_group("roofline");
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    let read = ReadProbe::new(256 << 20);
    group.throughput(Throughput::Bytes(read.bytes() as u64));
    group.bench_function(format!("read_{THREADS}threads"), |b| b.iter(|| read.run(&ctx).unwrap()));
    let fma = FmaProbe::new(1 << 20).unwrap();
    group.throughput(Throughput::Elements((fma.flops_per_thread() * THREADS as f64) as u64));
    group.bench_function(format!("fma128_{THREADS}threads"), |b| b.iter(|| fma.run(&ctx).unwrap()));
    group.finish();
}

fn specialization(c: &mut Criterion) {
    let ctx = DeviceContextPtr::cpu(THREADS).unwrap();
    for shape in ModelShape::standard() {
        for dtype in [DType::F32, DType::BF16] {
            // Made on first use, so benchmarks a filter skips cost nothing.
            let weights_cell: OnceCell<Arc<Weights>> = OnceCell::new();
            let weights = || {
                weights_cell.get_or_init(|| Arc::new(Weights::new(&shape, dtype, SEED, WORKING_SET).unwrap())).clone()
            };
            for page_size in [16, 128] {
                let generic: OnceCell<LayerKernels> = OnceCell::new();
                let mut group = c.benchmark_group(shape.spec(dtype, page_size, None).key().to_string());
                group
                    .sample_size(10)
                    .sampling_mode(SamplingMode::Flat)
                    .warm_up_time(Duration::from_millis(300))
                    .measurement_time(Duration::from_secs(2));
                for m in ALL_MS {
                    let point = Point { shape: shape.clone(), dtype, page_size, m };
                    group.throughput(Throughput::ElementsAndBytes {
                        elements: point.flops() as u64,
                        bytes: point.weight_bytes() as u64,
                    });
                    for implementation in Implementation::ALL.into_iter().filter(|i| i.available()) {
                        if implementation == Implementation::Reference && m > REFERENCE_MAX_M {
                            continue;
                        }
                        let mut state: Option<(Problem, Runner)> = None;
                        group.bench_function(BenchmarkId::new(implementation.id(), m), |b| {
                            let (problem, runner) = state.get_or_insert_with(|| {
                                let problem = Problem::new(point.clone(), weights(), SEED).unwrap();
                                let generic = generic.get_or_init(|| {
                                    generic_kernels(&shape, dtype, page_size, &problem.weights).unwrap()
                                });
                                let runner = Runner::new(implementation, &problem, Some(generic)).unwrap();
                                (problem, runner)
                            });
                            b.iter(|| runner.run(problem, &ctx).unwrap())
                        });
                    }
                }
                group.finish();
            }
        }
    }
}

criterion_group!(benches, roofline, specialization);
criterion_main!(benches);
