//! Fused QKV + paged KV write on the Llama-3-8B QKV shape (K = 4096,
//! N = 6144 = 4096 + 2·8·128, page size 16), 2 threads, side by side in one
//! criterion group per dtype:
//!
//! - `kvjit_jit`: the Cranelift kernel (weight packed at build, as for a graph
//!   constant), Q to the output, K/V straight into the cache;
//! - `gemm_scatter`: what candle's CPU path does — `gemm` crate matmul into a
//!   `[M, N]` buffer, then Q copied out and K/V scattered into their pages;
//! - `reference`: the plain Rust reference (M ≤ 16 only: it is ~100× slower);
//! - `roofline/read_2threads`: this machine's 2-thread read bandwidth, so the
//!   decode results (which stream the 100 MB weight once) can be read as a
//!   fraction of it.
//!
//! How to read: ids are `<dtype>/<impl>/M`. Criterion's throughput is the
//! weight bytes streamed per call (`GB/s` of weights — at M ≤ 16 this is the
//! number to compare with the roofline); GFLOP/s = 2·M·N·K / time. Compare
//! implementations only within one run: the machine is shared and noisy.
//!
//! `cargo bench --bench fused_qkv` (add `-- --quick` for a fast look).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvjit::fused_qkv::reference::fused_qkv_matmul;
use kvjit::fused_qkv::{FusedQkvSpec, JitKernel};
use kvjit::{DType, DeviceContextPtr, KvCacheParams, PagedKVCacheCollection, Target, Tensor};
use kvjit_jit::CaptureText;
use rand::SeedableRng;

const K: usize = 4096;
const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD: usize = 128;
const PAGE: usize = 16;
const THREADS: usize = 2;
const HISTORY: u32 = 32;

/// One benchmark problem: inputs, a cache with room for them, the JIT kernel.
struct Problem {
    m: usize,
    hidden: Tensor,
    weight: Tensor,
    valid: Tensor,
    layer: Tensor,
    cache: PagedKVCacheCollection,
    output: Tensor,
    kernel: JitKernel,
}

/// Sequences and padded length for M rows: decode batches for M ≤ 16, four
/// prompts beyond.
fn batch_and_seq(m: usize) -> (usize, usize) {
    if m <= 16 { (m, 1) } else { (4, m / 4) }
}

fn problem(m: usize, dtype: DType) -> Problem {
    let mut rng = rand::rngs::StdRng::seed_from_u64(m as u64);
    let (batch, seq) = batch_and_seq(m);
    let q_dim = Q_HEADS * HEAD;
    let n = q_dim + 2 * KV_HEADS * HEAD;
    let pages_per_seq = (HISTORY as usize + seq).div_ceil(PAGE) + 1;
    let params = KvCacheParams { dtype, num_layers: 1, page_size: PAGE, num_kv_heads: KV_HEADS, head_size: HEAD };
    let mut cache = PagedKVCacheCollection::new(params, batch * pages_per_seq, batch, pages_per_seq).unwrap();
    let history = vec![HISTORY; batch];
    cache.reserve(&history).unwrap();
    cache.advance(&history).unwrap();
    let valid = vec![seq as u32; batch];
    cache.reserve(&valid).unwrap();
    let bound = 1.0 / (K as f32).sqrt();
    let weight = Tensor::random(dtype, &[n, K], &mut rng, -bound, bound).unwrap();
    let spec = FusedQkvSpec {
        target: Target::Cpu,
        dtype,
        cache_dtype: dtype,
        k: K,
        q_dim,
        num_kv_heads: KV_HEADS,
        head_size: HEAD,
        page_size: PAGE,
        num_layers: 1,
        batch: Some(batch),
        seq: Some(seq),
    };
    Problem {
        m,
        hidden: Tensor::random(dtype, &[batch, seq, K], &mut rng, -1.0, 1.0).unwrap(),
        kernel: JitKernel::new(spec, Some(&weight), CaptureText::default()).unwrap(),
        weight,
        valid: Tensor::from_vec(&[batch], valid).unwrap(),
        layer: Tensor::scalar_u32(0),
        cache,
        output: Tensor::zeros(dtype, &[batch, seq, q_dim]).unwrap(),
    }
}

impl Problem {
    fn run_jit(&mut self, ctx: &DeviceContextPtr) {
        let out = self.output.as_bytes_mut();
        self.kernel.run_into(&self.hidden, &self.weight, &mut self.cache, &self.layer, &self.valid, out, ctx).unwrap();
    }

    fn run_reference(&mut self) {
        fused_qkv_matmul(&self.hidden, &self.weight, &mut self.cache, &self.layer, &self.valid, &mut self.output)
            .unwrap();
    }
}

/// The peer: `gemm` into a `[M, N]` f32 buffer, then copy Q and scatter K/V
/// through the page table, as a user of a GEMM library writes it.
struct GemmScatter {
    c: Vec<f32>,
}

impl GemmScatter {
    fn run(&mut self, p: &mut Problem) {
        let q_dim = Q_HEADS * HEAD;
        let kv_dim = KV_HEADS * HEAD;
        let n = q_dim + 2 * kv_dim;
        let m = p.m;
        let x = p.hidden.as_slice::<f32>().unwrap();
        let w = p.weight.as_slice::<f32>().unwrap();
        // SAFETY: x is [m, K], w is [n, K] (read as its transpose [K, n] via
        // column stride K), c is [m, n]; all row-major and fully allocated.
        unsafe {
            gemm::gemm(
                m,
                n,
                K,
                self.c.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                K as isize,
                w.as_ptr(),
                K as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(THREADS),
            );
        }
        let out = p.output.as_mut_slice::<f32>().unwrap();
        for r in 0..m {
            out[r * q_dim..(r + 1) * q_dim].copy_from_slice(&self.c[r * n..r * n + q_dim]);
        }
        let (batch, seq) = batch_and_seq(m);
        let valid = p.valid.as_slice::<u32>().unwrap().to_vec();
        let lengths = p.cache.cache_lengths().to_vec();
        for b in 0..batch {
            for t in 0..valid[b] as usize {
                let r = b * seq + t;
                let (page, slot) = p.cache.locate(b, lengths[b] as usize + t).unwrap();
                for kv in 0..2 {
                    let start = p.cache.element_offset(page as usize, kv, 0, slot, 0, 0);
                    let src = &self.c[r * n + q_dim + kv * kv_dim..][..kv_dim];
                    p.cache.blocks_slice_mut::<f32>().unwrap()[start..start + kv_dim].copy_from_slice(src);
                }
            }
        }
    }
}

fn read_bandwidth(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(THREADS).build().unwrap();
    let buffer: Vec<u64> = (0..32u64 << 20).collect(); // 256 MiB
    let mut group = c.benchmark_group("roofline");
    group.sample_size(10).measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Bytes((buffer.len() * 4) as u64));
    group.bench_function("read_2threads", |bench| {
        bench.iter(|| {
            pool.install(|| {
                use rayon::prelude::*;
                // Integer adds vectorize and never limit the loop: this is
                // the rate DRAM delivers to two threads.
                let sum = |chunk: &[u64]| chunk.iter().fold(0u64, |a, &b| a.wrapping_add(b));
                buffer.par_chunks(1 << 20).map(sum).reduce(|| 0, u64::wrapping_add)
            })
        })
    });
    group.finish();
}

fn f32_group(c: &mut Criterion) {
    let ctx = DeviceContextPtr::cpu(THREADS).unwrap();
    let mut group = c.benchmark_group("f32");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    for m in [1, 4, 16, 64, 256, 1024] {
        let mut p = problem(m, DType::F32);
        let n = Q_HEADS * HEAD + 2 * KV_HEADS * HEAD;
        group.throughput(Throughput::Bytes((n * K * 4) as u64));
        group.bench_with_input(BenchmarkId::new("kvjit_jit", m), &m, |bench, _| bench.iter(|| p.run_jit(&ctx)));
        let mut peer = GemmScatter { c: vec![0.0; m * n] };
        group.bench_with_input(BenchmarkId::new("gemm_scatter", m), &m, |bench, _| {
            bench.iter(|| peer.run(black_box(&mut p)))
        });
        if m <= 16 {
            group.bench_with_input(BenchmarkId::new("reference", m), &m, |bench, _| bench.iter(|| p.run_reference()));
        }
    }
    group.finish();
}

fn bf16_decode_group(c: &mut Criterion) {
    let ctx = DeviceContextPtr::cpu(THREADS).unwrap();
    let mut group = c.benchmark_group("decode_m1");
    group.sample_size(20).measurement_time(Duration::from_secs(3));
    let n = Q_HEADS * HEAD + 2 * KV_HEADS * HEAD;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut p = problem(1, dtype);
        group.throughput(Throughput::Bytes((n * K * dtype.size_bytes()) as u64));
        group.bench_function(BenchmarkId::new("kvjit_jit", dtype), |bench| bench.iter(|| p.run_jit(&ctx)));
    }
    group.finish();
}

criterion_group!(benches, read_bandwidth, bf16_decode_group, f32_group);
criterion_main!(benches);
