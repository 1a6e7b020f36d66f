//! The machine's roofs, measured in the same run as the kernels, so every
//! result can be read as a fraction of what this machine can do right now.
//!
//! - [`ReadProbe`]: read bandwidth with the benchmark's thread count — a
//!   buffer far larger than the caches, summed with integer adds (they
//!   vectorize and never limit the loop), so the rate is what DRAM delivers.
//! - [`FmaProbe`]: the 128-bit FMA rate with the benchmark's thread count —
//!   a Cranelift-compiled loop of F32X4 `fma`s on 12 independent
//!   accumulators (enough to cover the FMA latency on two pipes), the same
//!   instruction width and compiler the kernels use.
//!
//! [`Roof::attainable`] combines them into the roofline model: a call of
//! `F` FLOPs that must move at least `B` bytes cannot beat
//! `min(FMA rate, bandwidth · F/B)`. Small M is bandwidth-bound (the weight
//! dominates the bytes), large M FMA-bound.

use kvjit_core::{DType, KernelKey, Target};
use kvjit_jit::cranelift_codegen::ir::{InstBuilder, types};
use kvjit_jit::ir::{mem, splat_f32};
use kvjit_jit::{CaptureText, JitFunction, compile_kernel};
use kvjit_runtime::{DeviceContextPtr, RuntimeError};
use rayon::prelude::*;

use super::timing::{Plan, Stats, measure_interleaved};
use crate::{Error, Result};

/// Independent F32X4 accumulators of the FMA probe.
pub const FMA_ACCUMULATORS: usize = 12;
/// Times the accumulator set is updated per loop iteration.
pub const FMA_UNROLL: usize = 4;

fn pool_of(ctx: &DeviceContextPtr) -> Result<&rayon::ThreadPool> {
    ctx.cpu_context().map(|c| c.pool()).ok_or_else(|| Error::Usage("the roofline probes run on a CPU context".into()))
}

/// Reads a large buffer with every thread of a CPU context.
pub struct ReadProbe {
    buffer: Vec<u64>,
}

impl ReadProbe {
    /// A probe reading `bytes` (rounded down to 1 MiB, at least 1 MiB).
    pub fn new(bytes: usize) -> Self {
        let words = (bytes >> 20).max(1) << 17;
        Self { buffer: (0..words as u64).collect() }
    }

    /// Bytes read per call.
    pub fn bytes(&self) -> usize {
        self.buffer.len() * std::mem::size_of::<u64>()
    }

    /// Read the whole buffer once, split in 1 MiB chunks over the pool.
    pub fn run(&self, ctx: &DeviceContextPtr) -> Result<u64> {
        let sum = |chunk: &[u64]| chunk.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        Ok(pool_of(ctx)?.install(|| self.buffer.par_chunks(1 << 17).map(sum).reduce(|| 0, u64::wrapping_add)))
    }
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
                let m = splat_f32(b, 0.999_999);
                let c = splat_f32(b, 1e-6);
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
        .map_err(|e| Error::Runtime(RuntimeError::Compile { key: key.to_string(), source: Box::new(e) }))?;
        Ok(Self { code, iterations: iterations.max(1) as i64 })
    }

    /// FLOPs per call and thread (an FMA is 2 FLOPs per lane).
    pub fn flops_per_thread(&self) -> f64 {
        (self.iterations as usize * FMA_UNROLL * FMA_ACCUMULATORS * 4 * 2) as f64
    }

    /// Run the loop once on every thread of the pool, concurrently.
    pub fn run(&self, ctx: &DeviceContextPtr) -> Result<f32> {
        let threads = pool_of(ctx)?.current_num_threads();
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

/// Which roof limits a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Read bandwidth × arithmetic intensity.
    Bandwidth,
    /// The 128-bit FMA rate.
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
}

/// Sizes of the roofline probes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoofPlan {
    /// Buffer the read probe streams.
    pub read_bytes: usize,
    /// FMA loop iterations per thread and call.
    pub fma_iterations: usize,
    /// Timing of both probes.
    pub timing: Plan,
}

/// Raw per-call samples of the two probes.
#[derive(Clone, Debug, Default)]
pub struct RoofSamples {
    /// Bytes per second, per sample.
    pub read: Vec<f64>,
    /// FLOP per second, per sample.
    pub fma: Vec<f64>,
}

impl RoofSamples {
    /// Measure both probes (interleaved) and add their samples.
    pub fn measure(&mut self, ctx: &DeviceContextPtr, plan: &RoofPlan) -> Result<()> {
        let read = ReadProbe::new(plan.read_bytes);
        let fma = FmaProbe::new(plan.fma_iterations)?;
        let threads = pool_of(ctx)?.current_num_threads();
        let measured = measure_interleaved(2, &plan.timing, |i| {
            match i {
                0 => std::hint::black_box(read.run(ctx)?),
                _ => std::hint::black_box(fma.run(ctx)?) as u64,
            };
            Ok(())
        })?;
        self.read.extend(measured[0].samples.iter().map(|t| read.bytes() as f64 / t));
        let flops = fma.flops_per_thread() * threads as f64;
        self.fma.extend(measured[1].samples.iter().map(|t| flops / t));
        Ok(())
    }

    /// The roofs from every sample taken.
    pub fn roof(&self, threads: usize) -> Roof {
        Roof {
            threads,
            read_bytes_per_s: Stats::from_samples(&self.read),
            fma_flops_per_s: Stats::from_samples(&self.fma),
        }
    }
}

impl Roof {
    /// Measure both roofs once.
    pub fn measure(ctx: &DeviceContextPtr, plan: &RoofPlan) -> Result<Self> {
        let mut samples = RoofSamples::default();
        samples.measure(ctx, plan)?;
        Ok(samples.roof(ctx.cpu_context().map_or(1, |c| c.threads())))
    }

    /// The roofline bound for `flops` FLOPs moving at least `bytes` bytes:
    /// which roof binds, and the FLOP/s it allows (medians).
    pub fn attainable(&self, flops: f64, bytes: f64) -> (Bound, f64) {
        let bandwidth = self.read_bytes_per_s.median * flops / bytes;
        let fma = self.fma_flops_per_s.median;
        if bandwidth < fma { (Bound::Bandwidth, bandwidth) } else { (Bound::Fma, fma) }
    }
}
