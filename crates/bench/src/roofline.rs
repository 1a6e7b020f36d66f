//! The machine's roofs, measured in the same run as the kernels, so every
//! result can be read as a fraction of what this machine can do right now.
//!
//! Every probe runs on the kernels' own worker pool, as the kernels' parts
//! do, never on a second pool, so a probe timed between kernels shares no core
//! with a worker still spinning for the next kernel.
//!
//! - [`ReadProbe`]: read bandwidth with the benchmark's thread count — a
//!   buffer far larger than the caches, in huge-page memory (few TLB
//!   misses), the threads summing contiguous parts of it (a few per
//!   thread), each as four independent streams with 256-bit integer adds
//!   (AVX2 where the CPU has it): the best streaming read we found, so the
//!   rate is what DRAM delivers (on the Intel host the f32 GEMV, the
//!   fastest reader among the kernels, reads 1.02–1.05× it).
//! - [`FmaProbe`]: the 128-bit FMA rate with the benchmark's thread count —
//!   a Cranelift-compiled loop of F32X4 `fma`s on 12 independent
//!   accumulators (enough to cover the FMA latency on two pipes), the same
//!   instruction width and compiler the kernels use.
//! - [`Fma256Probe`]: the 256-bit FMA rate (AVX2 + FMA `vfmadd` on 12
//!   independent ymm accumulators), where the CPU has it: the width the
//!   GEMM-library peers use, so their roof.
//!
//! [`Roof::attainable`] combines them into the roofline model: a call of
//! `F` FLOPs that must move at least `B` bytes cannot beat
//! `min(FMA rate, bandwidth · F/B)`. Small M is bandwidth-bound (the weight
//! dominates the bytes), large M FMA-bound. It uses the 128-bit rate;
//! [`Roof::attainable_256`] is the same bound on the 256-bit rate.

use kvjit_core::{DType, KernelKey, Target, Tensor};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, types};
use kvjit_jit::ir::{mem, splat_f32};
use kvjit_jit::{CaptureText, JitFunction, compile_kernel};
use kvjit_runtime::{DeviceContextPtr, WorkerPool};
use std::sync::{Arc, Mutex, PoisonError};

use super::timing::{Plan, Stats, measure_interleaved};
use crate::{BenchError, Result};

/// Independent F32X4 accumulators of the FMA probe.
pub const FMA_ACCUMULATORS: usize = 12;
/// Times the accumulator set is updated per loop iteration (both FMA probes).
pub const FMA_UNROLL: usize = 4;
/// Independent 256-bit (8 × f32) accumulators of the 256-bit FMA probe.
pub const FMA256_ACCUMULATORS: usize = 12;
/// Independent streams each part of the read probe reads its share as.
pub const READ_STREAMS: usize = 4;
/// Contiguous parts of the read probe's buffer per thread (at 256 MiB, 32
/// MiB each): claimed as they come, so a worker that wakes late costs the
/// probe its lateness, not a whole share run after the caller's.
pub const READ_PARTS_PER_THREAD: usize = 4;
/// The FMA probes' recurrence, `acc ← acc·m + c`: it stays bounded (m < 1)
/// and never denormal.
const FMA_M: f32 = 0.999_999;
const FMA_C: f32 = 1e-6;

/// The pool the probes run on: the kernels' own workers, so a probe timed
/// between kernels never competes with a worker still spinning for the
/// next kernel (on a 2-core host, a probe on a second pool of threads
/// shared a core with that worker and read as little as half the rate).
fn workers_of(ctx: &DeviceContextPtr) -> Result<&WorkerPool> {
    Ok(ctx.cpu_context().ok_or(BenchError::NotCpu { what: "the roofline probes" })?.workers())
}

/// Run `part(i, parts)` for `i < parts_per_thread · threads` on the
/// kernels' workers (claimed as kernels' parts are: a worker slow to wake
/// leaves its parts to the others rather than doubling the call), and
/// collect what each returns in part order.
fn on_workers<T: Send + 'static>(
    ctx: &DeviceContextPtr,
    parts_per_thread: usize,
    part: impl Fn(usize, usize) -> T + Send + Sync + 'static,
) -> Result<Vec<T>> {
    let workers = workers_of(ctx)?;
    let parts = workers.threads() * parts_per_thread.max(1);
    let results: Arc<Vec<Mutex<Option<T>>>> = Arc::new((0..parts).map(|_| Mutex::new(None)).collect());
    let slots = results.clone();
    workers.run(parts, move |i| {
        let value = part(i, parts);
        *slots[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(value);
    });
    // `run` returned, so every part has stored its value (a worker may
    // still hold the job, and with it `slots`, until it sees the next one).
    Ok(results
        .iter()
        .map(|slot| slot.lock().unwrap_or_else(PoisonError::into_inner).take().expect("every part ran"))
        .collect())
}

/// Reads a large buffer with every thread of a CPU context.
pub struct ReadProbe {
    /// u32 words in anonymous memory advised to use huge pages (shared with
    /// the worker threads that read it).
    buffer: Arc<Tensor>,
}

/// Word `i` of the read probe's buffer (a hash, so a word read twice or
/// skipped changes the sum).
pub fn read_probe_word(i: usize) -> u32 {
    let x = (i as u32).wrapping_mul(0x9e37_79b1);
    x ^ (x >> 15)
}

impl ReadProbe {
    /// A probe reading `bytes` (rounded down to 1 MiB, at least 1 MiB).
    ///
    /// # Panics
    ///
    /// If the buffer cannot be mapped; [`ReadProbe::try_new`] returns the
    /// error instead.
    pub fn new(bytes: usize) -> Self {
        Self::try_new(bytes).expect("mapping the read probe's buffer")
    }

    /// A probe reading `bytes` (rounded down to 1 MiB, at least 1 MiB).
    pub fn try_new(bytes: usize) -> Result<Self> {
        let words = (bytes >> 20).max(1) << 18;
        let buffer = Tensor::anonymous(DType::U32, &[words], |b| {
            for (i, w) in b.chunks_exact_mut(4).enumerate() {
                w.copy_from_slice(&read_probe_word(i).to_le_bytes());
            }
        })?;
        Ok(Self { buffer: Arc::new(buffer) })
    }

    /// Bytes read per call.
    pub fn bytes(&self) -> usize {
        self.buffer.as_bytes().len()
    }

    /// The buffer's words.
    pub fn words(&self) -> &[u32] {
        self.buffer.as_slice().expect("the buffer is u32")
    }

    /// The part of the buffer backed by huge pages, 0 to 1 (the
    /// `AnonHugePages` of its mapping in `/proc/self/smaps`); `None` where
    /// that cannot be read.
    pub fn huge_page_fraction(&self) -> Option<f64> {
        let words = self.words();
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let huge = anon_huge_bytes(&smaps, words.as_ptr() as usize)?;
        Some(huge.min(self.bytes()) as f64 / self.bytes() as f64)
    }

    /// Read the whole buffer once on the kernels' pool, in
    /// [`READ_PARTS_PER_THREAD`] contiguous parts per thread: the wrapping
    /// sum of its words.
    pub fn run(&self, ctx: &DeviceContextPtr) -> Result<u64> {
        let buffer = self.buffer.clone();
        let sums = on_workers(ctx, READ_PARTS_PER_THREAD, move |i, parts| {
            let words: &[u32] = buffer.as_slice().expect("the buffer is u32");
            sum_words(&words[share(words.len(), parts, i)])
        })?;
        Ok(u64::from(sums.into_iter().fold(0u32, u32::wrapping_add)))
    }
}

/// Part `i` of `parts`' share of `len` words: contiguous, split at 4 KiB
/// boundaries (the last share takes the rest).
fn share(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    const BLOCK: usize = 1024;
    let blocks = len / BLOCK;
    let start = blocks * i / parts * BLOCK;
    let end = if i + 1 == parts { len } else { blocks * (i + 1) / parts * BLOCK };
    start..end
}

/// The wrapping sum of `words`, the fastest way this CPU allows.
fn sum_words(words: &[u32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { sum_words_avx2(words) };
    }
    sum_words_portable(words)
}

fn sum_words_portable(words: &[u32]) -> u32 {
    words.iter().fold(0u32, |a, &w| a.wrapping_add(w))
}

/// [`READ_STREAMS`] streams at equal distances in `words`, each loading one
/// 64-byte line (two 256-bit loads into two accumulators) per iteration,
/// so several lines are in flight at once and the hardware prefetchers
/// follow every stream. (Software prefetch 256 B to 2 KiB ahead measured no
/// better, and worse from 1 KiB on: the hardware prefetchers already cover
/// sequential streams.)
///
/// # Safety
///
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u32]) -> u32 {
    use std::arch::x86_64::{__m256i, _mm256_add_epi32, _mm256_loadu_si256, _mm256_setzero_si256, _mm256_storeu_si256};
    /// u32 words per 64-byte line.
    const LINE: usize = 16;
    let stream_len = (words.len() / READ_STREAMS) & !(LINE - 1);
    let mut acc = [[_mm256_setzero_si256(); 2]; READ_STREAMS];
    let base = words.as_ptr();
    let mut at = 0;
    while at < stream_len {
        for (s, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `s·stream_len + at + LINE ≤ READ_STREAMS·stream_len ≤
            // words.len()` (as `at + LINE ≤ stream_len`, both multiples of
            // LINE), so both unaligned 32-byte loads read inside `words`.
            unsafe {
                let p = base.add(s * stream_len + at);
                acc[0] = _mm256_add_epi32(acc[0], _mm256_loadu_si256(p.cast::<__m256i>()));
                acc[1] = _mm256_add_epi32(acc[1], _mm256_loadu_si256(p.add(8).cast::<__m256i>()));
            }
        }
        at += LINE;
    }
    let total = acc.iter().flatten().fold(_mm256_setzero_si256(), |t, &a| _mm256_add_epi32(t, a));
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 32 writable bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), total) };
    let sum = sum_words_portable(&lanes);
    sum.wrapping_add(sum_words_portable(&words[READ_STREAMS * stream_len..]))
}

/// `AnonHugePages` of the mapping holding `address` in `smaps` (the text of
/// `/proc/<pid>/smaps`), in bytes.
fn anon_huge_bytes(smaps: &str, address: usize) -> Option<usize> {
    let mut inside = false;
    for line in smaps.lines() {
        // A mapping starts with `lo-hi perms ...`; its fields follow.
        let range = line.split_once(' ').and_then(|(range, _)| range.split_once('-'));
        if let Some((lo, hi)) = range
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = (lo..hi).contains(&address);
            continue;
        }
        if inside && let Some(kib) = line.strip_prefix("AnonHugePages:") {
            return kib.trim().strip_suffix("kB")?.trim().parse::<usize>().ok().map(|k| k << 10);
        }
    }
    None
}

/// The transparent-huge-page mode (`always`, `madvise`, `never`): the
/// bracketed word of `/sys/kernel/mm/transparent_hugepage/enabled`, or
/// `unknown` where it cannot be read.
pub fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|text| bracketed(&text).map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// The word in brackets in `text`, as in `always [madvise] never`.
fn bracketed(text: &str) -> Option<&str> {
    let (_, rest) = text.split_once('[')?;
    let (word, _) = rest.split_once(']')?;
    Some(word).filter(|w| !w.is_empty())
}

/// A JIT-compiled F32X4 FMA loop run on every thread of a CPU context.
pub struct FmaProbe {
    code: JitFunction,
    iterations: i64,
}

impl FmaProbe {
    /// Compile the loop; each thread runs `iterations` iterations per call.
    /// It is a kernel of the common ABI (argument words: iterations, the
    /// output address; one work item per thread, each storing one F32X4).
    pub fn new(iterations: usize) -> Result<Self> {
        let key = KernelKey::new("bench_fma_probe", Target::Cpu, DType::F32);
        let code = compile_kernel(&key, CaptureText::default(), |b, params| {
            let iterations = params.arg(b, 0);
            let out = params.arg(b, 1);
            kvjit_jit::ir::counted_loop(b, params.begin, params.end, 1, &[], |b, item, _| {
                // acc ← acc·m + c stays bounded (m < 1) and never denormal.
                let m = splat_f32(b, FMA_M);
                let c = splat_f32(b, FMA_C);
                let accs: Vec<_> = (0..FMA_ACCUMULATORS).map(|i| splat_f32(b, 1.0 + i as f32 * 1e-3)).collect();
                let zero = b.ins().iconst(types::I64, 0);
                let accs = kvjit_jit::ir::counted_loop(b, zero, iterations, 1, &accs, |b, _, carried| {
                    let mut accs = carried.to_vec();
                    for _ in 0..FMA_UNROLL {
                        for acc in &mut accs {
                            *acc = b.ins().fma(*acc, m, c);
                        }
                    }
                    accs
                });
                let total = accs.into_iter().reduce(|a, v| b.ins().fadd(a, v)).expect("at least one accumulator");
                let offset = b.ins().imul_imm_s(item, 16);
                let at = b.ins().iadd(out, offset);
                b.ins().store(mem(), total, at, 0);
                Vec::new()
            });
        })
        .map_err(|source| BenchError::Compile { key: key.to_string(), source })?;
        Ok(Self { code, iterations: iterations.max(1) as i64 })
    }

    /// FLOPs per call and thread (an FMA is 2 FLOPs per lane).
    pub fn flops_per_thread(&self) -> f64 {
        (self.iterations as usize * FMA_UNROLL * FMA_ACCUMULATORS * 4 * 2) as f64
    }

    /// Run the loop once on every thread of the pool, concurrently.
    pub fn run(&self, ctx: &DeviceContextPtr) -> Result<f32> {
        let threads = workers_of(ctx)?.threads();
        let mut out = vec![0f32; 4 * threads];
        let args = [self.iterations as u64, out.as_mut_ptr() as u64];
        // SAFETY: the probe was compiled with the kernel ABI reading
        // (iterations, out) and stores one F32X4 at `out + 16·item` for each
        // item of its range; items are 0..threads and `out` holds 4·threads
        // floats, so ranges write disjoint, in-bounds memory.
        unsafe { kvjit_jit::launch(&self.code, &args, threads, ctx) };
        Ok(out.iter().sum())
    }
}

/// A 256-bit FMA loop (AVX2 + FMA intrinsics) run on every thread of a CPU
/// context: the instruction width of the GEMM-library peers.
pub struct Fma256Probe {
    iterations: usize,
}

/// The 256-bit probe's accumulators after its loop: `[accumulator][lane]`.
pub type Fma256Lanes = [[f32; 8]; FMA256_ACCUMULATORS];

/// Lane `l` of accumulator `a` of the 256-bit probe before its loop.
pub fn fma256_start(a: usize, l: usize) -> f32 {
    1.0 + (a * 8 + l) as f32 * 1e-3
}

impl Fma256Probe {
    /// The probe, where this CPU has AVX2 and FMA (`None` elsewhere); each
    /// thread runs `iterations` iterations per call.
    pub fn new(iterations: usize) -> Option<Self> {
        fma256_supported().then_some(Self { iterations: iterations.max(1) })
    }

    /// FLOPs per call and thread (an FMA is 2 FLOPs per lane).
    pub fn flops_per_thread(&self) -> f64 {
        (self.iterations * FMA_UNROLL * FMA256_ACCUMULATORS * 8 * 2) as f64
    }

    /// Run the loop once on every thread of the pool, concurrently: the sum
    /// of every thread's accumulators.
    pub fn run(&self, ctx: &DeviceContextPtr) -> Result<f32> {
        let iterations = self.iterations;
        let lanes = on_workers(ctx, 1, move |_, _| fma256_lanes(iterations, FMA_M, FMA_C))?;
        Ok(lanes.into_iter().flatten().flatten().flatten().sum())
    }
}

/// Whether this CPU runs the 256-bit FMA probe.
pub fn fma256_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return true;
    }
    false
}

/// The 256-bit probe's loop: `iterations · FMA_UNROLL` times `acc ← acc·m +
/// c` (fused) on every accumulator from [`fma256_start`]; `None` where the
/// CPU lacks AVX2 or FMA.
pub fn fma256_lanes(iterations: usize, m: f32, c: f32) -> Option<Fma256Lanes> {
    #[cfg(target_arch = "x86_64")]
    if fma256_supported() {
        // SAFETY: fma256_supported detected AVX2 and FMA.
        return Some(unsafe { fma256_loop(iterations, m, c) });
    }
    let _ = (iterations, m, c);
    None
}

/// # Safety
///
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma256_loop(iterations: usize, m: f32, c: f32) -> Fma256Lanes {
    use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_storeu_ps};
    let (m, c) = (_mm256_set1_ps(m), _mm256_set1_ps(c));
    let mut out: Fma256Lanes = std::array::from_fn(|a| std::array::from_fn(|l| fma256_start(a, l)));
    // SAFETY: each row of `out` is 8 readable f32s (32 bytes).
    let mut acc: [__m256; FMA256_ACCUMULATORS] = std::array::from_fn(|a| unsafe { _mm256_loadu_ps(out[a].as_ptr()) });
    for _ in 0..iterations {
        for _ in 0..FMA_UNROLL {
            for acc in &mut acc {
                *acc = _mm256_fmadd_ps(*acc, m, c);
            }
        }
    }
    for (row, acc) in out.iter_mut().zip(acc) {
        // SAFETY: each row of `out` is 8 writable f32s (32 bytes).
        unsafe { _mm256_storeu_ps(row.as_mut_ptr(), acc) };
    }
    out
}

/// Which roof limits a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Read bandwidth × arithmetic intensity.
    Bandwidth,
    /// The FMA rate (128-bit for [`Roof::attainable`], 256-bit for
    /// [`Roof::attainable_256`]).
    Fma,
}

impl Bound {
    /// `bandwidth` or `fma`.
    pub fn id(self) -> &'static str {
        match self {
            Bound::Bandwidth => "bandwidth",
            Bound::Fma => "fma",
        }
    }
}

/// The measured roofs.
#[derive(Clone, Debug)]
pub struct Roof {
    /// Threads the probes ran on.
    pub threads: usize,
    /// Read bandwidth, bytes per second (samples of the start and the end
    /// of the run together).
    pub read_bytes_per_s: Stats,
    /// 128-bit FMA rate, FLOP per second.
    pub fma_flops_per_s: Stats,
    /// 256-bit FMA rate, FLOP per second (`None` without AVX2 and FMA).
    pub fma256_flops_per_s: Option<Stats>,
    /// The least part of a read-probe buffer that was in huge pages, 0 to
    /// 1 (`None` where `/proc/self/smaps` could not tell).
    pub read_huge_page_fraction: Option<f64>,
}

/// Sizes of the roofline probes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoofPlan {
    /// Buffer the read probe streams.
    pub read_bytes: usize,
    /// FMA loop iterations per thread and call (both FMA probes).
    pub fma_iterations: usize,
    /// Timing of the probes.
    pub timing: Plan,
}

impl RoofPlan {
    /// The probes of a full suite: a 256 MiB read buffer, 2²⁰ FMA
    /// iterations, 10 to 20 samples within 2 s.
    pub fn full() -> Self {
        Self {
            read_bytes: 256 << 20,
            fma_iterations: 1 << 20,
            timing: Plan {
                min_samples: 10,
                max_samples: 20,
                sample_time: std::time::Duration::ZERO,
                budget: std::time::Duration::from_secs(2),
            },
        }
    }
}

/// Raw per-call samples of the probes.
#[derive(Clone, Debug, Default)]
pub struct RoofSamples {
    /// Bytes per second, per sample.
    pub read: Vec<f64>,
    /// 128-bit FMA FLOP per second, per sample.
    pub fma: Vec<f64>,
    /// 256-bit FMA FLOP per second, per sample (none without AVX2 and FMA).
    pub fma256: Vec<f64>,
    /// The least huge-page fraction of the read-probe buffers measured.
    pub read_huge_page_fraction: Option<f64>,
}

impl RoofSamples {
    /// Measure every probe (interleaved) and add their samples.
    pub fn measure(&mut self, ctx: &DeviceContextPtr, plan: &RoofPlan) -> Result<()> {
        let read = ReadProbe::try_new(plan.read_bytes)?;
        if let Some(f) = read.huge_page_fraction() {
            self.read_huge_page_fraction = Some(self.read_huge_page_fraction.map_or(f, |g| g.min(f)));
        }
        let fma = FmaProbe::new(plan.fma_iterations)?;
        let fma256 = Fma256Probe::new(plan.fma_iterations);
        let threads = workers_of(ctx)?.threads();
        let probes = if fma256.is_some() { 3 } else { 2 };
        let measured = measure_interleaved(probes, &plan.timing, |i| {
            match (i, &fma256) {
                (0, _) => std::hint::black_box(read.run(ctx)?),
                (1, _) => std::hint::black_box(fma.run(ctx)?) as u64,
                (_, Some(fma256)) => std::hint::black_box(fma256.run(ctx)?) as u64,
                (_, None) => unreachable!("two probes without the 256-bit one"),
            };
            Ok(())
        })?;
        self.read.extend(measured[0].samples.iter().map(|t| read.bytes() as f64 / t));
        let flops = fma.flops_per_thread() * threads as f64;
        self.fma.extend(measured[1].samples.iter().map(|t| flops / t));
        if let (Some(fma256), Some(m)) = (&fma256, measured.get(2)) {
            let flops = fma256.flops_per_thread() * threads as f64;
            self.fma256.extend(m.samples.iter().map(|t| flops / t));
        }
        Ok(())
    }

    /// The roofs from every sample taken.
    pub fn roof(&self, threads: usize) -> Roof {
        Roof {
            threads,
            read_bytes_per_s: Stats::from_samples(&self.read),
            fma_flops_per_s: Stats::from_samples(&self.fma),
            fma256_flops_per_s: (!self.fma256.is_empty()).then(|| Stats::from_samples(&self.fma256)),
            read_huge_page_fraction: self.read_huge_page_fraction,
        }
    }
}

impl Roof {
    /// Measure the roofs once.
    pub fn measure(ctx: &DeviceContextPtr, plan: &RoofPlan) -> Result<Self> {
        let mut samples = RoofSamples::default();
        samples.measure(ctx, plan)?;
        Ok(samples.roof(ctx.cpu_context().map_or(1, |c| c.threads())))
    }

    /// The roofline bound for `flops` FLOPs moving at least `bytes` bytes:
    /// which roof binds, and the FLOP/s it allows (medians). The FMA roof is
    /// the 128-bit rate.
    pub fn attainable(&self, flops: f64, bytes: f64) -> (Bound, f64) {
        bound(self.read_bytes_per_s.median * flops / bytes, self.fma_flops_per_s.median)
    }

    /// [`Roof::attainable`] on the 256-bit FMA rate (the GEMM-library
    /// peers' width); `None` where it was not measured.
    pub fn attainable_256(&self, flops: f64, bytes: f64) -> Option<(Bound, f64)> {
        let fma = self.fma256_flops_per_s?.median;
        Some(bound(self.read_bytes_per_s.median * flops / bytes, fma))
    }
}

fn bound(bandwidth: f64, fma: f64) -> (Bound, f64) {
    if bandwidth < fma { (Bound::Bandwidth, bandwidth) } else { (Bound::Fma, fma) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_probe_sums_every_word_once() {
        for mib in [1, 3] {
            let probe = ReadProbe::new(mib << 20);
            assert_eq!(probe.bytes(), mib << 20);
            let known = (0..probe.words().len()).fold(0u32, |a, i| a.wrapping_add(read_probe_word(i)));
            for threads in [1, 2, 3] {
                let ctx = DeviceContextPtr::cpu(threads).unwrap();
                assert_eq!(probe.run(&ctx).unwrap(), u64::from(known), "{mib} MiB, {threads} threads");
            }
            if let Some(f) = probe.huge_page_fraction() {
                assert!((0.0..=1.0).contains(&f), "{f}");
            }
        }
    }

    #[test]
    fn read_shares_and_streams_cover_every_word() {
        for len in [0, 5, 1023, 1024, 4097, 1 << 16, (1 << 16) + 77] {
            for threads in 1..=5 {
                let shares: Vec<_> = (0..threads).map(|i| share(len, threads, i)).collect();
                assert_eq!(shares[0].start, 0);
                assert_eq!(shares[threads - 1].end, len);
                assert!(shares.windows(2).all(|w| w[0].end == w[1].start), "{len} {threads}: {shares:?}");
            }
        }
        // Odd lengths and starts: the streams' tails and unaligned loads.
        let words: Vec<u32> = (0..10_000).map(read_probe_word).collect();
        for (start, end) in [(0, 0), (0, 63), (0, 64), (1, 65), (3, 10_000), (17, 9_999)] {
            let slice = &words[start..end];
            let known = slice.iter().fold(0u32, |a, &w| a.wrapping_add(w));
            assert_eq!(sum_words(slice), known, "{start}..{end}");
        }
    }

    /// The scalar recurrence of one lane: `steps` fused `a·m + c`.
    fn scalar(start: f32, steps: usize, m: f32, c: f32, fused: bool) -> f32 {
        (0..steps).fold(start, |a, _| if fused { a.mul_add(m, c) } else { a * m + c })
    }

    #[test]
    fn fma256_probe_computes_its_recurrence() {
        let Some(_) = Fma256Probe::new(1) else {
            eprintln!("no AVX2 + FMA: the 256-bit probe does not run here");
            assert!(fma256_lanes(1, 1.0, 1.0).is_none());
            return;
        };
        let mut unfused_differs = false;
        for (m, c) in [(FMA_M, FMA_C), (1.0, 1.0), (0.9, 0.1 + 1e-4), (-0.7, 0.37)] {
            for iterations in [1, 2, 7, 300] {
                let lanes = fma256_lanes(iterations, m, c).unwrap();
                for (a, row) in lanes.iter().enumerate() {
                    for (l, &got) in row.iter().enumerate() {
                        let steps = iterations * FMA_UNROLL;
                        let want = scalar(fma256_start(a, l), steps, m, c, true);
                        assert_eq!(got.to_bits(), want.to_bits(), "m {m} c {c} × {iterations}: [{a}][{l}]");
                        unfused_differs |= got != scalar(fma256_start(a, l), steps, m, c, false);
                    }
                }
            }
        }
        assert!(unfused_differs, "the cases cannot tell a fused from an unfused multiply-add");
        let probe = Fma256Probe::new(5).unwrap();
        assert_eq!(probe.flops_per_thread(), (5 * FMA_UNROLL * FMA256_ACCUMULATORS * 16) as f64);
        let ctx = DeviceContextPtr::cpu(2).unwrap();
        let one = fma256_lanes(5, FMA_M, FMA_C).unwrap();
        // Thread by thread, accumulator by accumulator, lane by lane.
        let want: f32 = [one, one].iter().flatten().flatten().sum();
        assert_eq!(probe.run(&ctx).unwrap(), want);
    }

    #[test]
    fn thp_mode_and_smaps_parse() {
        assert_eq!(bracketed("always [madvise] never\n"), Some("madvise"));
        assert_eq!(bracketed("[always] madvise never"), Some("always"));
        assert_eq!(bracketed("always madvise never"), None);
        assert!(!thp_mode().is_empty());
        let smaps = "\
7f0000000000-7f0000200000 rw-p 00000000 00:00 0 \n\
Size:               2048 kB\n\
AnonHugePages:         0 kB\n\
7f1000000000-7f1010000000 r--p 00000000 00:00 0 \n\
Size:             262144 kB\n\
AnonHugePages:    260096 kB\n\
7f2000000000-7f2000001000 rw-p 00000000 00:00 0                          [stack]\n\
AnonHugePages:         0 kB\n";
        assert_eq!(anon_huge_bytes(smaps, 0x7f10_0000_0000), Some(260_096 << 10));
        assert_eq!(anon_huge_bytes(smaps, 0x7f10_0fff_ffff), Some(260_096 << 10));
        assert_eq!(anon_huge_bytes(smaps, 0x7f00_0000_1000), Some(0));
        assert_eq!(anon_huge_bytes(smaps, 0x7f10_1000_0000), None);
    }
}
