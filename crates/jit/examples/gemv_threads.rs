//! Two-thread GEMV from DRAM: the bf16 GEMV tile read in 4 and 1 streams
//! per panel against each block format's integer GEMV tile read in 1, 2
//! and 4 (the counts chosen are `GEMV_STREAMS`/`min_stream_bytes` in
//! `microkernel.rs` and `STREAMS` in `quant/x86.rs`), interleaved call by
//! call in one process so every variant sees the same machine state.
//!
//! Each call is a whole M = 1 GEMV of an N×K matrix (by default
//! Llama-3-8B's QKV, K = 4096, N = 6144; SmolLM2-135M's are K = 576 and
//! 1536): the panels split in two halves, the calling
//! thread on one and a spinning worker on the other (as `WorkerPool`
//! runs a launch). Calls rotate over copies filling 768 MiB of memory
//! advised for transparent huge pages (where packed weights live), so each
//! reads DRAM. Medians; GB/s counts the bytes as stored.
//!
//! ```text
//! cargo run --release -p kvjit-jit --example gemv_threads [rounds] [format] [N] [K]
//! ```

use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kvjit_core::{DType, Tensor};
use kvjit_jit::microkernel::{GemmTile, TILE_COLUMNS, avx2_available, gemv_tile_with_streams};
use kvjit_jit::quant::{Q8_ACTIVATION_BLOCK_BYTES, panel_bytes, quant_gemv_with_streams, quantize_activations};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{bf16_matrix, quant_matrix};

/// Bytes of copies each matrix rotates over.
const ROTATE_BYTES: usize = 768 << 20;

/// One timed route: a tile over the copies of one matrix.
struct Route {
    name: String,
    tile: GemmTile,
    /// Whether the tile reads quantized activations.
    quantized: bool,
    panel_bytes: usize,
    matrix_bytes: usize,
    copies: std::sync::Arc<Tensor>,
}

fn main() {
    if !avx2_available() || quant_gemv_with_streams(DType::Q4_0, 1).is_none() {
        eprintln!(
            "this CPU lacks AVX2/FMA/F16C or vpdpbusd (AVX-VNNI, AVX512-VNNI), or KVJIT_QUANT_DOT=avx2: nothing to measure"
        );
        return;
    }
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(20, |r| r.parse().expect("rounds: a number"));
    let only = args.next().unwrap_or_default();
    let n: usize = args.next().map_or(6144, |n| n.parse().expect("N: a number"));
    assert!(n.is_multiple_of(2 * TILE_COLUMNS), "N: a multiple of 32");
    let k: usize = args.next().map_or(4096, |k| k.parse().expect("K: a number"));
    assert!(k.is_multiple_of(32), "K: a multiple of 32");
    let mut rng = SmallRng::seed_from_u64(1);
    let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut xq = vec![0u8; k / 32 * Q8_ACTIVATION_BLOCK_BYTES];
    quantize_activations(&x, &mut xq);
    println!("K = {k}, N = {n}, 2 threads, {rounds}×8 calls per route, medians");
    for format in DType::BLOCK_FORMATS {
        if !format.to_string().contains(&only) {
            continue;
        }
        let bf16 = bf16_matrix(k, n, &mut rng);
        let bf16_copies = std::sync::Arc::new(copies(&bf16));
        let mut routes: Vec<Route> = [4, 1]
            .map(|streams| Route {
                name: format!("bf16, {streams} stream(s)"),
                tile: gemv_tile_with_streams(DType::BF16, streams).expect("a one-row bf16 tile"),
                quantized: false,
                panel_bytes: k * TILE_COLUMNS * 2,
                matrix_bytes: bf16.len(),
                copies: bf16_copies.clone(),
            })
            .into();
        drop(bf16);
        let packed = quant_matrix(format, k, n, &mut rng);
        let packed_copies = std::sync::Arc::new(copies(&packed));
        for streams in [1, 2, 4] {
            routes.push(Route {
                name: format!("{format}, {streams} stream(s)"),
                tile: quant_gemv_with_streams(format, streams).expect("a VNNI tile"),
                quantized: true,
                panel_bytes: panel_bytes(format, k),
                matrix_bytes: packed.len(),
                copies: packed_copies.clone(),
            });
        }
        let times = time(&routes, n, k, rounds, &x, &xq);
        let bf16_time = times[0];
        for (route, t) in routes.iter().zip(times) {
            println!(
                "{:<24} {:>8.1} µs {:>6.1} GB/s {:>6.2}× bf16",
                route.name,
                t * 1e6,
                route.matrix_bytes as f64 / t / 1e9,
                bf16_time / t
            );
        }
    }
}

/// Median seconds per call of each route, calls interleaved across routes.
fn time(routes: &[Route], n: usize, k: usize, rounds: usize, x: &[f32], xq: &[u8]) -> Vec<f64> {
    let panels = n / TILE_COLUMNS;
    let run = |route: &Route, call: usize, range: std::ops::Range<usize>| {
        let bytes = route.copies.as_bytes();
        let copy = call % (bytes.len() / route.matrix_bytes);
        let w = &bytes[copy * route.matrix_bytes..][..route.matrix_bytes];
        let activations: *const f32 = if route.quantized { xq.as_ptr().cast() } else { x.as_ptr() };
        let mut c = [0f32; TILE_COLUMNS];
        for p in range {
            // SAFETY: x holds K f32 (xq K/32 activation blocks), panel p of
            // the matrix covers K, c holds 16 f32.
            unsafe { (route.tile)(activations, 1, w[p * route.panel_bytes..].as_ptr(), k, c.as_mut_ptr()) };
        }
        black_box(c);
    };
    // The worker spins on `job` (0: none yet, MAX: stop) and counts its
    // halves in `done`.
    let (job, done) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut times = vec![Vec::new(); routes.len()];
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut seen = 0;
            loop {
                let j = job.load(Ordering::Acquire);
                if j == seen {
                    std::hint::spin_loop();
                    continue;
                }
                if j == usize::MAX {
                    return;
                }
                seen = j;
                run(&routes[(j - 1) % routes.len()], j, panels / 2..panels);
                done.fetch_add(1, Ordering::AcqRel);
            }
        });
        let mut call = 0;
        for _ in 0..rounds * 8 {
            for (route, times) in routes.iter().zip(&mut times) {
                call += 1;
                let start = Instant::now();
                job.store(call, Ordering::Release);
                run(route, call, 0..panels / 2);
                while done.load(Ordering::Acquire) != call {
                    std::hint::spin_loop();
                }
                times.push(start.elapsed().as_secs_f64());
            }
        }
        job.store(usize::MAX, Ordering::Release);
    });
    times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect()
}

/// Copies of `matrix` filling [`ROTATE_BYTES`], in huge-page-advised memory.
fn copies(matrix: &[u8]) -> Tensor {
    let count = ROTATE_BYTES.div_ceil(matrix.len()).max(2);
    let mut all = Tensor::zeros_in_huge_pages(DType::F32, &[count * matrix.len() / 4]).expect("memory for the copies");
    for copy in all.as_bytes_mut().chunks_exact_mut(matrix.len()) {
        copy.copy_from_slice(matrix);
    }
    all
}
