//! Timing harness for the JIT attention kernel (not a check): decode at
//! several contexts (B 1 and 8; bf16, FP8 E4M3 with g = 128, and f32
//! caches) and causal prefill, on
//! Llama-3-8B heads (Hq 32, Hkv 8, D 128, page 16), with the machine's
//! measured read bandwidth for comparison.
//!
//! `cargo run --release -p kvjit-op-attention --example attention_bench [-- THREADS [FILTER]]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use common::{Case, jit};
use kvjit_core::{DType, Tensor};
use kvjit_op_attention::Mask;
use kvjit_runtime::DeviceContextPtr;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of a plain sum over a 1 GiB buffer split over `threads`, median of 7.
fn read_bandwidth(threads: usize) -> f64 {
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut runs = Vec::new();
    for _ in 0..7 {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = buf
                .chunks(words.div_ceil(threads))
                .map(|part| s.spawn(move || part.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        runs.push((words * 8) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    median(runs)
}

fn case(cache_dtype: DType, batch: usize, seq: usize, context: usize) -> Case {
    Case {
        dtype: DType::BF16,
        cache_dtype,
        batch,
        seq,
        num_heads: 32,
        num_kv_heads: 8,
        head_size: 128,
        page_size: 16,
        num_layers: 1,
        layer: 0,
        scale_granularity: (cache_dtype == DType::F8E4M3).then_some(128),
        cache_lengths: vec![(context - seq) as u32; batch],
        valid_lengths: vec![seq as u32; batch],
        mask: Mask::Causal,
        window: None,
        scale: 1.0 / 128f32.sqrt(),
        seed: 9,
    }
}

/// This process's CPU time (user + system, all threads), in seconds, from
/// `/proc/self/stat` (clock ticks of 10 ms; 0 where it cannot be read).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which ends with ')'): utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Median wall seconds per call, and CPU seconds per call (all threads).
fn time_case(case: &Case, threads: usize) -> (f64, f64) {
    let kernel = jit(case);
    let (inputs, cache) = case.inputs();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut out = vec![0u8; case.batch * case.seq * case.num_heads * case.head_size * 2];
    let ctx = DeviceContextPtr::cpu(threads).unwrap();
    kernel.run_into(&refs, &cache, &mut out, &ctx).unwrap();
    let mut runs = Vec::new();
    let deadline = Instant::now();
    let cpu = cpu_seconds();
    while runs.len() < 5 || (runs.len() < 41 && deadline.elapsed().as_secs_f64() < 2.0) {
        let start = Instant::now();
        kernel.run_into(&refs, &cache, &mut out, &ctx).unwrap();
        runs.push(start.elapsed().as_secs_f64());
    }
    let cpu = (cpu_seconds() - cpu) / runs.len() as f64;
    (median(runs), cpu)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().map_or(2, |t| t.parse().expect("THREADS"));
    let filter = args.next().unwrap_or_default();
    let bw = read_bandwidth(threads);
    println!("read bandwidth ({threads} threads, 1 GiB sum, median of 7): {bw:.2} GB/s");
    let mut rows = Vec::new();
    for cache_dtype in [DType::BF16, DType::F8E4M3, DType::F32] {
        for batch in [1, 8] {
            for context in [512, 2048, 8192] {
                rows.push((
                    format!("decode {cache_dtype} B{batch} ctx{context}"),
                    case(cache_dtype, batch, 1, context),
                ));
            }
        }
        for tokens in [512, 2048] {
            rows.push((format!("prefill {cache_dtype} B1 S{tokens}"), case(cache_dtype, 1, tokens, tokens)));
        }
    }
    println!("(cpu ms: CPU time per call over all threads; ms / cpu ms show how much other load took the cores)");
    let mut times = std::collections::HashMap::new();
    for (name, case) in rows.iter().filter(|(n, _)| n.contains(&filter)) {
        let (secs, cpu) = time_case(case, threads);
        times.insert(name.clone(), secs);
        let keys: usize = case.cache_lengths.iter().zip(&case.valid_lengths).map(|(c, v)| (c + v) as usize).sum();
        // K/V bytes read, an FP8 cache's scales included.
        let bytes = (keys * case.cache_params().bytes_per_token()) as f64;
        let gbs = bytes / secs / 1e9;
        let rate = if case.seq == 1 {
            format!("{gbs:>7.2} GB/s K/V {:>5.1}% of bw", 100.0 * gbs / bw)
        } else {
            // Causal: query s reads cache_length + s + 1 keys; 4·D flops per (query head, key).
            let pairs: usize = (0..case.seq).map(|s| case.cache_lengths[0] as usize + s + 1).sum();
            let flops = (case.batch * pairs * case.num_heads * 4 * case.head_size) as f64;
            format!("{:>7.2} GFLOP/s", flops / secs / 1e9)
        };
        println!("{name:<28} {:>9.3} ms (cpu {:>8.3} ms) {rate}", secs * 1e3, cpu * 1e3);
    }
    // The FP8 cache's speed-up over bf16, same run (target: ≥ 1.6× at context ≥ 2048).
    for (name, _) in rows.iter().filter(|(n, _)| n.contains("bf16")) {
        let fp8 = name.replace("bf16", "f8e4m3");
        if let (Some(bf16), Some(f8)) = (times.get(name), times.get(&fp8)) {
            println!("{:<28} f8e4m3 {:.2}× faster than bf16", name.replace("bf16 ", ""), bf16 / f8);
        }
    }
}
