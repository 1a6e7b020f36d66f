//! Single-thread GEMV over quantized weights: the integer GEMV tiles of
//! `kvjit_jit::quant` against the bf16 GEMV tile over the same N×K, the
//! decode-to-f32 route (a panel's blocks decoded into an L2 or L1 buffer,
//! then the f32 tile), and the core's read-bandwidth roof.
//!
//! Every timed call is one whole GEMV (all N/16 panels; the quantized
//! routes include quantizing the activations). "DRAM" rows rotate over
//! copies of the weight filling ≥ 1 GiB (more than this class of host's
//! L3), so each call reads its weights from memory; "warm" rows reuse one
//! copy (from the last-level cache when it fits there). Medians of the
//! reps; GB/s counts the weight bytes as stored (quantized bytes for the
//! block formats). The "in L2" table times the integer tiles alone on a
//! weight small enough for the core's L2 (K = 4096, N = 256): their ALU
//! headroom over the DRAM rows. A second argument (`q4_k`, …) runs only that format's
//! rows (and bf16's).
//!
//! ```text
//! cargo run --release -p kvjit-jit --example quant_gemv [reps] [format]
//! ```

use std::hint::black_box;
use std::time::Instant;

use kvjit_core::DType;
use kvjit_jit::microkernel::{GemmTile, TILE_COLUMNS, WidenBlock, avx2_available, gemm_tile, widen_block};
use kvjit_jit::quant::{
    Q8_ACTIVATION_BLOCK_BYTES, dequantize_block, panel_bytes, quant_gemv, quant_gemv_avx2, quantize_activations,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{bf16_matrix, quant_matrix};

/// Bytes the DRAM rows spread their copies of a weight over.
const ROTATE_BYTES: usize = 1 << 30;

fn main() {
    if !avx2_available() {
        eprintln!("this CPU has no AVX2/FMA/F16C: nothing to measure");
        return;
    }
    let reps: usize = std::env::args().nth(1).map_or(15, |r| r.parse().expect("reps: a number"));
    let only = std::env::args().nth(2).unwrap_or_default();
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let dot = kvjit_jit::quant::quant_dot();
    println!("host: {model}; quant_gemv multiplies as {dot:?}; single thread; {reps} reps, medians");
    if only.is_empty() {
        roof(reps);
        quantize_time(reps);
        decode_table(reps);
    }
    l2_table(reps, &only);
    for (k, n, what) in [(4096, 4096, "QKV-ish"), (4096, 14336, "FFN")] {
        println!("\nK = {k}, N = {n} ({what}), {} panels", n / TILE_COLUMNS);
        println!(
            "{:<34} {:>10} {:>9} {:>10} {:>9} {:>9}",
            "route", "MB", "DRAM GB/s", "ns/panel", "warm GB/s", "ns/panel"
        );
        let mut rng = SmallRng::seed_from_u64(1);
        let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let bf16 = bf16_matrix(k, n, &mut rng);
        let bf16_time =
            bench_row("bf16 gemm_tile(BF16, 1)", &bf16, n, reps, |w, c| gemv_f(&x, w, k, n, DType::BF16, c));
        drop(bf16);
        for format in [DType::Q4_1, DType::Q4_0, DType::Q8_0, DType::Q4K, DType::Q6K] {
            if !format.to_string().contains(&only) {
                continue;
            }
            let packed = quant_matrix(format, k, n, &mut rng);
            let (name, tile) = ("quant_gemv", quant_gemv(format, k));
            for (name, tile) in [(name, tile), ("quant_gemv_avx2", quant_gemv_avx2(format, k))] {
                let Some(tile) = tile else { continue };
                let mut xq = vec![0u8; k / 32 * Q8_ACTIVATION_BLOCK_BYTES];
                let t = bench_row(&format!("{format} {name}"), &packed, n, reps, |w, c| {
                    gemv_q(&x, &mut xq, w, k, n, format, tile, c)
                });
                println!("{:<34} {:>10.2}x the bf16 GEMV (DRAM)", "", bf16_time / t);
            }
            for kc in [k, 256] {
                let mut buffer = vec![0f32; kc * TILE_COLUMNS];
                let name = format!("{format} decode {kc}k + gemm_tile(F32, 1)");
                bench_row(&name, &packed, n, reps, |w, c| gemv_decoded(&x, &mut buffer, w, k, n, kc, format, c));
            }
        }
    }
    prefill_table(reps, &only);
}

/// The integer GEMV tiles with their weights in L2: K = 4096, N = 256
/// (0.6–1.1 MB of weights), one copy reused and the activations quantized
/// once outside the timing, so the time is the tile's own work (its ALU
/// headroom over the DRAM rows): GB/s of weight bytes and ns per panel.
/// bf16 at N = 128 (1 MB) for scale.
fn l2_table(reps: usize, only: &str) {
    let k = 4096;
    let mut rng = SmallRng::seed_from_u64(5);
    let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect();
    println!("\nin L2: K = {k}, one copy reused, tiles only (ALU headroom)");
    println!("{:<34} {:>10} {:>9} {:>10}", "route", "MB", "GB/s", "ns/panel");
    let time = |name: &str, bytes: usize, n: usize, gemv: &mut dyn FnMut(&mut [f32])| {
        let mut c = vec![0f32; n];
        gemv(&mut c);
        let mut times: Vec<f64> = (0..reps.max(5) * 40)
            .map(|_| {
                let start = Instant::now();
                gemv(&mut c);
                black_box(&c);
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let t = times[times.len() / 2];
        let panels = (n / TILE_COLUMNS) as f64;
        println!("{name:<34} {:>10.2} {:>9.1} {:>10.0}", bytes as f64 / 1e6, bytes as f64 / t / 1e9, t / panels * 1e9);
    };
    let bf16 = bf16_matrix(k, 128, &mut rng);
    time("bf16 gemm_tile(BF16, 1), N = 128", bf16.len(), 128, &mut |c| gemv_f(&x, &bf16, k, 128, DType::BF16, c));
    let n = 256;
    let mut xq = vec![0u8; k / 32 * Q8_ACTIVATION_BLOCK_BYTES];
    quantize_activations(&x, &mut xq);
    for format in DType::BLOCK_FORMATS {
        if !format.to_string().contains(only) {
            continue;
        }
        let packed = quant_matrix(format, k, n, &mut rng);
        let panel = panel_bytes(format, k);
        let (name, tile) = ("quant_gemv", quant_gemv(format, k));
        for (name, tile) in [(name, tile), ("quant_gemv_avx2", quant_gemv_avx2(format, k))] {
            let Some(tile) = tile else { continue };
            time(&format!("{format} {name}"), packed.len(), n, &mut |c| {
                for p in 0..n / TILE_COLUMNS {
                    // SAFETY: xq holds K/32 activation blocks, the panel
                    // covers K, c holds 16 f32 at p·16.
                    unsafe {
                        tile(xq.as_ptr().cast(), 1, packed[p * panel..].as_ptr(), k, c[p * TILE_COLUMNS..].as_mut_ptr())
                    };
                }
            });
        }
    }
}

/// The prefill shape of the 256-bit tier's GEMM on one thread, as its
/// driver runs it: per panel and k-block of 256, the block decoded (or
/// bf16 widened) into an L1 buffer once, then every 6-row f32 tile of the
/// M rows over it. K = 4096, N = 4096; weights from DRAM (rotating
/// copies). Time per panel against bf16's.
fn prefill_table(reps: usize, only: &str) {
    let (k, n, kc) = (4096, 4096, 256);
    let mut rng = SmallRng::seed_from_u64(4);
    let bf16 = bf16_matrix(k, n, &mut rng);
    let formats: Vec<DType> = DType::BLOCK_FORMATS.into_iter().filter(|f| f.to_string().contains(only)).collect();
    let packed: Vec<Vec<u8>> = formats.iter().map(|&f| quant_matrix(f, k, n, &mut rng)).collect();
    for m in [16usize, 64] {
        println!(
            "\nprefill M = {m}, K = {k}, N = {n}: decode (or widen) 256 k x 16, then {} f32 tiles of <= 6 rows",
            m.div_ceil(6)
        );
        let tiles: Vec<(usize, Vec<f32>)> = (0..m)
            .step_by(6)
            .map(|r| ((m - r).min(6), (0..k * 6).map(|_| rng.gen_range(-1.0..1.0)).collect()))
            .collect();
        let mut buffer = vec![0f32; kc * TILE_COLUMNS];
        let mut acc = vec![0f32; m * TILE_COLUMNS];
        let mut run = |w: &[u8], panel: usize, decode: WidenBlock, k_bytes: &dyn Fn(usize) -> usize| {
            for p in 0..n / TILE_COLUMNS {
                acc.fill(0.0);
                for kb in (0..k).step_by(kc) {
                    // SAFETY: k-block kb..kb + kc of panel p into the buffer
                    // of kc·16 f32; each tile reads kc k of its x (step 6)
                    // and adds into its rows of acc.
                    unsafe {
                        decode(w[p * panel + k_bytes(kb)..].as_ptr(), kc * TILE_COLUMNS, buffer.as_mut_ptr());
                        for (t, (rows, x)) in tiles.iter().enumerate() {
                            let tile = gemm_tile(DType::F32, *rows).expect("a tile of up to 6 rows");
                            let c = acc[6 * t * TILE_COLUMNS..].as_mut_ptr();
                            tile(x[kb * 6..].as_ptr(), 6, buffer.as_ptr().cast(), kc, c);
                        }
                    }
                }
                black_box(&acc);
            }
        };
        let bf16_panel = k * TILE_COLUMNS * 2;
        let widen = widen_block(DType::BF16).expect("bf16 widens");
        let base = bench_row("bf16 widen + tiles", &bf16, n, reps, |w, _| run(w, bf16_panel, widen, &|kb| kb * 32));
        for (&format, matrix) in formats.iter().zip(&packed) {
            let decode = dequantize_block(format).expect("decodes");
            let panel = panel_bytes(format, k);
            let t = bench_row(&format!("{format} decode + tiles"), matrix, n, reps, |w, _| {
                run(w, panel, decode, &|kb| panel_bytes(format, kb))
            });
            println!("{:<34} {:>10.2}x bf16's time", "", t / base);
        }
    }
}

/// What quantizing one row of activations costs (once per GEMV call).
fn quantize_time(reps: usize) {
    let mut rng = SmallRng::seed_from_u64(3);
    for k in [4096, 14336] {
        let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut out = vec![0u8; k / 32 * Q8_ACTIVATION_BLOCK_BYTES];
        let mut times: Vec<f64> = (0..reps.max(5) * 100)
            .map(|_| {
                let start = Instant::now();
                quantize_activations(black_box(&x), &mut out);
                black_box(&out);
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        println!("quantize_activations, K = {k}: {:.2} us", times[times.len() / 2] * 1e6);
    }
}

/// The prefill path's decode alone: one k-block of 256 k × 16 columns
/// decoded (or, for bf16, widened) into an L1 buffer, the source in cache,
/// in ns per block and f32 outputs per ns.
fn decode_table(reps: usize) {
    let (k, blocks) = (256, 64);
    let mut rng = SmallRng::seed_from_u64(2);
    let mut out = vec![0f32; k * TILE_COLUMNS];
    println!("\ndecode to f32, 256 k x 16 columns per block, source in L1/L2:");
    let mut row = |name: String, source: &[u8], block_bytes: usize, decode: WidenBlock| {
        let mut times: Vec<f64> = (0..reps.max(5))
            .map(|_| {
                let start = Instant::now();
                for b in 0..blocks {
                    // SAFETY: block b of the source, whole k-groups over 256 k;
                    // out holds 256·16 f32.
                    unsafe { decode(source[b * block_bytes..].as_ptr(), k * TILE_COLUMNS, out.as_mut_ptr()) };
                    black_box(&out);
                }
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let t = times[times.len() / 2] / blocks as f64;
        println!("{name:<34} {:>8.0} ns/block {:>6.2} values/ns", t * 1e9, (k * TILE_COLUMNS) as f64 / t / 1e9);
    };
    let bf16 = bf16_matrix(k, blocks * TILE_COLUMNS, &mut rng);
    row("bf16 widen_block".into(), &bf16, k * TILE_COLUMNS * 2, widen_block(DType::BF16).expect("bf16 widens"));
    for format in DType::BLOCK_FORMATS {
        let packed = quant_matrix(format, k, blocks * TILE_COLUMNS, &mut rng);
        row(
            format!("{format} dequantize_block"),
            &packed,
            panel_bytes(format, k),
            dequantize_block(format).expect("decodes"),
        );
    }
}

/// One route's row: DRAM (rotating copies) and warm (one copy) medians;
/// returns the DRAM median in seconds.
fn bench_row(name: &str, one: &[u8], n: usize, reps: usize, mut gemv: impl FnMut(&[u8], &mut [f32])) -> f64 {
    let bytes = one.len();
    let copies = ROTATE_BYTES.div_ceil(bytes).max(2);
    let mut all = Vec::with_capacity(copies * bytes);
    for _ in 0..copies {
        all.extend_from_slice(one);
    }
    let mut c = vec![0f32; n];
    gemv(one, &mut c); // warm up
    let mut time = |rotate: bool| {
        let mut times: Vec<f64> = (0..reps.max(copies))
            .map(|r| {
                let w = if rotate { &all[r % copies * bytes..][..bytes] } else { one };
                let start = Instant::now();
                gemv(w, &mut c);
                let t = start.elapsed().as_secs_f64();
                black_box(&c);
                t
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let dram = time(true);
    let warm = time(false);
    let panels = (n / TILE_COLUMNS) as f64;
    println!(
        "{name:<34} {:>10.1} {:>9.1} {:>10.0} {:>9.1} {:>9.0}",
        bytes as f64 / 1e6,
        bytes as f64 / dram / 1e9,
        dram / panels * 1e9,
        bytes as f64 / warm / 1e9,
        warm / panels * 1e9
    );
    dram
}

/// The bf16 GEMV: the one-row f32-activation tile over every panel.
fn gemv_f(x: &[f32], w: &[u8], k: usize, n: usize, dtype: DType, c: &mut [f32]) {
    let tile = gemm_tile(dtype, 1).expect("a one-row tile");
    let panel = k * TILE_COLUMNS * dtype.size_bytes();
    c.fill(0.0);
    for p in 0..n / TILE_COLUMNS {
        // SAFETY: x holds k f32, the panel k·16 elements, c 16 f32 at p·16.
        unsafe { tile(x.as_ptr(), 1, w[p * panel..].as_ptr(), k, c[p * TILE_COLUMNS..].as_mut_ptr()) };
    }
}

/// The integer GEMV: quantize x once, then the tile over every panel.
#[allow(clippy::too_many_arguments, reason = "a benchmark's plumbing")]
fn gemv_q(x: &[f32], xq: &mut [u8], w: &[u8], k: usize, n: usize, format: DType, tile: GemmTile, c: &mut [f32]) {
    quantize_activations(x, xq);
    let panel = panel_bytes(format, k);
    c.fill(0.0);
    for p in 0..n / TILE_COLUMNS {
        // SAFETY: xq holds K/32 activation blocks, the panel covers K, c
        // holds 16 f32 at p·16.
        unsafe { tile(xq.as_ptr().cast(), 1, w[p * panel..].as_ptr(), k, c[p * TILE_COLUMNS..].as_mut_ptr()) };
    }
}

/// The decode route: per panel, k-blocks of `kc` decoded to f32, then the
/// f32 one-row tile over each.
#[allow(clippy::too_many_arguments, reason = "a benchmark's plumbing")]
fn gemv_decoded(x: &[f32], buffer: &mut [f32], w: &[u8], k: usize, n: usize, kc: usize, format: DType, c: &mut [f32]) {
    let decode = dequantize_block(format).expect("a decoder");
    let tile = gemm_tile(DType::F32, 1).expect("a one-row tile");
    let panel = panel_bytes(format, k);
    c.fill(0.0);
    for p in 0..n / TILE_COLUMNS {
        for kb in (0..k).step_by(kc) {
            // SAFETY: k-block kb..kb + kc of panel p (whole k-groups) into
            // the buffer of kc·16 f32; x from kb holds kc f32; c 16 f32.
            unsafe {
                decode(w[p * panel + panel_bytes(format, kb)..].as_ptr(), kc * TILE_COLUMNS, buffer.as_mut_ptr());
                tile(x[kb..].as_ptr(), 1, buffer.as_ptr().cast(), kc, c[p * TILE_COLUMNS..].as_mut_ptr());
            }
        }
    }
}

/// The core's read bandwidth: a sum over 1 GiB, as one sequential stream
/// and as four side by side (the GEMV tiles' pattern), each without and
/// with software prefetch 2 KiB ahead; the roof is the fastest.
fn roof(reps: usize) {
    let buffer: Vec<u8> = (0..ROTATE_BYTES).map(|i| ((i * 131) >> 7) as u8).collect();
    let mut best = 0f64;
    for (streams, prefetch) in [(1, false), (4, false), (1, true), (4, true)] {
        let mut times: Vec<f64> = (0..reps.min(7))
            .map(|_| {
                let start = Instant::now();
                // SAFETY: the CPU has AVX2 (checked in main).
                black_box(unsafe { sum(&buffer, streams, prefetch) });
                start.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let rate = buffer.len() as f64 / times[times.len() / 2] / 1e9;
        best = best.max(rate);
        println!(
            "read, {streams} stream(s), prefetch {prefetch}: {rate:.1} GB/s (sum over {} MiB)",
            buffer.len() >> 20
        );
    }
    println!("read roof: {best:.1} GB/s");
}

/// The u64 lanes' sum of `buffer` (a multiple of 128 bytes · streams),
/// read as `streams` contiguous ranges side by side, optionally
/// prefetching 2 KiB ahead in each.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn sum(buffer: &[u8], streams: usize, prefetch: bool) -> u64 {
    use std::arch::x86_64::*;
    let span = buffer.len() / streams;
    let mut acc = [_mm256_setzero_si256(); 8];
    for at in (0..span).step_by(128) {
        for s in 0..streams {
            let p = buffer[s * span + at..][..128].as_ptr();
            if prefetch {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2048).cast());
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2048 + 64).cast());
            }
            for (i, a) in acc[(s % 2) * 4..][..4].iter_mut().enumerate() {
                // SAFETY: 4 × 32 bytes inside the 128-byte slice at p.
                *a = _mm256_add_epi64(*a, unsafe { _mm256_loadu_si256(p.add(32 * i).cast()) });
            }
        }
    }
    let mut lanes = [0u64; 4];
    let total = acc.iter().fold(_mm256_setzero_si256(), |s, &a| _mm256_add_epi64(s, a));
    // SAFETY: 4 u64 of storage.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), total) };
    lanes.iter().sum()
}
