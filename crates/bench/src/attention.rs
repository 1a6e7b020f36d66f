//! `kvjit bench --ops attention`: paged flash attention on Llama-3-8B heads
//! (32 query / 8 KV heads of 128, page 16, causal, scale 1/√D) against the
//! peer a user of a GEMM library writes and against the machine's roofs,
//! side by side in one run; RoPE's share of a step; and the whole attention
//! step graph per decode token against the sum of its ops' roofs.
//!
//! - **Decode** (S = 1, contexts × batches × cache dtypes): the JIT kernel
//!   built for the call's key, called with `run_into`, against
//!   *gather + gemm*: each sequence's K and V gathered from the pages into
//!   contiguous f32 buffers per KV head (timed), `gemm` for the group's
//!   query heads × context scores, a plain softmax, `gemm` for P·V. Each
//!   call reads the next layer of a many-layer cache (as a model's layers),
//!   so K/V comes from DRAM; the roof is the K/V bytes over the measured
//!   read bandwidth.
//! - **Prefill** (batch 1, empty cache, causal): the same two, against the
//!   128-bit FMA roof of the causal FLOPs `2·2·Hq·D·S(S+1)/2` (the peer
//!   computes the whole square and masks it, as such a user does).
//! - **RoPE**: the JIT kernel alone on the decode step and a prefill, and
//!   its share of the whole step.
//! - **Whole step**: `models::llama::attention_step_graph` (fused QKV → reshape →
//!   RoPE → attention) compiled with `kvjit::compile`, `Executor::run` of a
//!   decode step, against the sum of its ops' roof times.
//!
//! Every configuration is validated once before it is timed: the JIT output
//! and the peer's must agree (normalized max error ≤ 2⁻⁶ for 16-bit
//! dtypes, 1e-4 for f32), otherwise the row shows the error and no figure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use half::slice::HalfFloatSliceExt;
use kvjit::attention::{JitKernel as MhaKernel, jit_kernel as mha_kernel};
use kvjit::models::llama::LlamaConfig;
use kvjit::rope::{JitKernel as RopeKernel, RopeSpec};
use kvjit_core::{CodeTier, CpuTier, DType, KernelSpec, PagedKVCacheCollection, Target, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op::checks::StepDims;
use kvjit_runtime::{DeviceContextPtr, Executable, Executor};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rayon::prelude::*;
use serde_json::{Value, json};

use crate::render::{format_rate, format_time, pass_or_miss};
use crate::roofline::{ReadProbe, Roof, RoofPlan, RoofSamples};
use crate::timing::{Measurement, Plan, Stats, measure_interleaved};
use crate::workload::{
    Heads, StepShape, cache_params, check_finite, compile_step, make_cache, size_step_cache, step_inputs,
};
use crate::{BenchError, Progress, Result, Steps};

/// The fused QKV op's kernel name (the first field of its keys).
pub const QKV_KERNEL_NAME: &str = "fused_qkv_bshd_paged";

/// Decode: at least this fraction of the read roof (contexts ≥ the target
/// context).
pub const DECODE_ROOF_TARGET: f64 = 0.75;
/// Decode: at least this many times faster than the peer.
pub const DECODE_PEER_TARGET: f64 = 3.0;
/// Prefill: at least this many times faster than the peer.
pub const PREFILL_PEER_TARGET: f64 = 1.5;
/// Prefill: at least this share of the 256-bit FMA roof (where measured).
pub const PREFILL_FMA256_TARGET: f64 = 0.5;
/// RoPE: at most this share of its step.
pub const ROPE_SHARE_TARGET: f64 = 0.05;
/// Whole decode step: at most this many times the sum of its ops' roofs
/// (issue 25's goal).
pub const STEP_ROOF_TARGET: f64 = 1.5;

/// The whole attention-step graph's run.
#[derive(Clone, Debug)]
pub struct StepConfig {
    /// The graph (one layer; its cache sized for `batch × (history + 1)`).
    pub graph: LlamaConfig,
    /// Decode batch.
    pub batch: usize,
    /// Cached tokens per sequence before the decode step.
    pub history: usize,
    /// Also run a prefill of this many tokens (batch 1) through the graph,
    /// for RoPE's share of a prefill step.
    pub prefill: Option<usize>,
    /// Timing of the decode step.
    pub timing: Plan,
    /// Timing of the prefill step.
    pub prefill_timing: Plan,
}

impl StepConfig {
    /// Llama-3-8B's attention step, one layer, bf16, its cache sized for
    /// `batch` sequences of `history + 1` tokens.
    pub fn llama3_8b(batch: usize, history: usize) -> Self {
        let mut graph = LlamaConfig::llama3_8b();
        size_step_cache(&mut graph.layer, batch, history);
        Self {
            graph,
            batch,
            history,
            prefill: Some(2048),
            timing: Plan {
                min_samples: 5,
                max_samples: 20,
                sample_time: Duration::from_millis(40),
                budget: Duration::from_secs(2),
            },
            prefill_timing: Plan {
                min_samples: 2,
                max_samples: 3,
                sample_time: Duration::ZERO,
                budget: Duration::ZERO,
            },
        }
    }
}

/// What `kvjit bench --ops attention` covers and how long it measures.
#[derive(Clone, Debug)]
pub struct AttentionBenchConfig {
    /// Name of the preset.
    pub mode: String,
    /// The heads.
    pub heads: Heads,
    /// Decode contexts (keys each query attends to, this step's included).
    pub contexts: Vec<usize>,
    /// Decode batches.
    pub batches: Vec<usize>,
    /// Dtypes of decode (cache and activations alike).
    pub dtypes: Vec<DType>,
    /// Prefill lengths (batch 1, bf16).
    pub prefills: Vec<usize>,
    /// Dtype of the prefill and RoPE runs.
    pub prefill_dtype: DType,
    /// The decode targets apply from this context on.
    pub target_context: usize,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Seed of every input.
    pub seed: u64,
    /// Bytes of K/V each decode configuration cycles through (layers of
    /// its cache): several times the last-level cache.
    pub working_set: usize,
    /// Timing of a decode configuration.
    pub timing: Plan,
    /// Timing of a prefill configuration.
    pub prefill_timing: Plan,
    /// Roofline probes.
    pub roof: RoofPlan,
    /// The whole step graph, if run.
    pub step: Option<StepConfig>,
}

impl AttentionBenchConfig {
    /// The whole attention suite (a few minutes on 2 cores).
    pub fn full() -> Self {
        let quick_roof = crate::BenchConfig::quick().roof;
        Self {
            mode: "full".into(),
            heads: Heads::llama3_8b(),
            contexts: vec![512, 2048, 8192],
            batches: vec![1, 8],
            dtypes: vec![DType::BF16, DType::F32],
            prefills: vec![512, 2048],
            prefill_dtype: DType::BF16,
            target_context: 2048,
            threads: 2,
            seed: 7,
            working_set: 256 << 20,
            timing: Plan {
                min_samples: 5,
                max_samples: 15,
                sample_time: Duration::from_millis(30),
                budget: Duration::from_millis(1500),
            },
            prefill_timing: Plan {
                min_samples: 3,
                max_samples: 5,
                sample_time: Duration::ZERO,
                budget: Duration::from_secs(4),
            },
            roof: RoofPlan {
                timing: Plan { min_samples: 10, max_samples: 20, budget: Duration::from_secs(2), ..quick_roof.timing },
                ..quick_roof
            },
            step: Some(StepConfig::llama3_8b(8, 2048)),
        }
    }

    /// The same sizes, fewer samples.
    pub fn quick() -> Self {
        let full = Self::full();
        let step = full.step.clone().map(|s| StepConfig {
            timing: Plan { min_samples: 3, max_samples: 10, budget: Duration::from_millis(600), ..s.timing },
            prefill_timing: Plan { min_samples: 1, max_samples: 1, ..s.prefill_timing },
            ..s
        });
        Self {
            mode: "quick".into(),
            timing: Plan { min_samples: 3, max_samples: 8, budget: Duration::from_millis(500), ..full.timing },
            prefill_timing: Plan { min_samples: 2, max_samples: 3, budget: Duration::ZERO, ..full.prefill_timing },
            roof: crate::BenchConfig::quick().roof,
            step,
            ..full
        }
    }

    /// Toy sizes for tests of the plumbing, well under 2 s (the numbers mean
    /// nothing).
    pub fn tiny() -> Self {
        let short = Plan { min_samples: 2, max_samples: 3, sample_time: Duration::ZERO, budget: Duration::ZERO };
        let mut graph = LlamaConfig::small();
        let (batch, history) = (3, 40);
        size_step_cache(&mut graph.layer, batch, history);
        Self {
            mode: "tiny".into(),
            heads: Heads { num_heads: 4, num_kv_heads: 2, head_size: 16, page_size: 4 },
            contexts: vec![9, 40],
            batches: vec![1, 3],
            dtypes: vec![DType::BF16, DType::F32],
            prefills: vec![12],
            prefill_dtype: DType::BF16,
            target_context: 40,
            threads: 2,
            seed: 7,
            working_set: 1 << 20,
            timing: short,
            prefill_timing: short,
            roof: RoofPlan { read_bytes: 1 << 20, fma_iterations: 1 << 10, timing: short },
            step: Some(StepConfig { graph, batch, history, prefill: Some(12), timing: short, prefill_timing: short }),
        }
    }

    /// Refuse configurations that cannot run.
    pub fn check(&self) -> Result<()> {
        if self.dtypes.is_empty() {
            return Err(BenchError::NoValues { option: "--dtypes" });
        }
        if let Some(&dtype) = self.dtypes.iter().find(|d| !d.is_compute_float()) {
            return Err(BenchError::NotComputeFloat { dtype });
        }
        if self.contexts.contains(&0) || self.batches.contains(&0) || self.prefills.contains(&0) {
            return Err(BenchError::Zero { what: "contexts, batches and prefill lengths" });
        }
        let h = self.heads;
        if h.num_kv_heads == 0 || h.head_size == 0 || h.page_size == 0 || !h.num_heads.is_multiple_of(h.num_kv_heads) {
            return Err(BenchError::InvalidHeads { heads: h });
        }
        Ok(())
    }

    /// Steps the progress callback counts.
    pub fn step_count(&self) -> usize {
        let step = usize::from(self.step.is_some());
        2 + self.contexts.len() * self.batches.len() * self.dtypes.len() + self.prefills.len() + 1 + step
    }
}

/// The largest |got − want| over the largest |want|.
pub fn normalized_error(got: &[f32], want: &[f32]) -> f64 {
    let worst = got.iter().zip(want).map(|(g, w)| f64::from((g - w).abs())).fold(0.0, f64::max);
    let scale = want.iter().map(|w| f64::from(w.abs())).fold(0.0, f64::max);
    if got.len() != want.len() || got.iter().chain(want).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    if scale == 0.0 { worst } else { worst / scale }
}

/// The agreement the bench demands of the JIT kernel and the peer.
pub fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-4 } else { 1.0 / 64.0 }
}

/// Round `values` into `output` (a float tensor of the same length).
fn store(values: &[f32], output: &mut Tensor) -> Result<()> {
    match output.dtype() {
        DType::F32 => output.as_mut_slice::<f32>()?.copy_from_slice(values),
        DType::BF16 => output.as_mut_slice::<half::bf16>()?.convert_from_f32_slice(values),
        DType::F16 => output.as_mut_slice::<half::f16>()?.convert_from_f32_slice(values),
        _ => unreachable!("attention outputs are compute floats"),
    }
    Ok(())
}

/// Per-thread buffers of the peer, kept across calls (a user's workspace).
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    scores: Vec<f32>,
    out: Vec<f32>,
}

/// The attention a user of a GEMM library writes: per (sequence, KV head),
/// gather K and V from the pages into contiguous f32 buffers, `gemm` the
/// group's query rows against Kᵀ, a plain (causally masked) softmax, `gemm`
/// with V. The (sequence, KV head) items run in parallel on the context's
/// pool; each `gemm` is single-threaded.
pub struct GatherGemmPeer {
    heads: Heads,
    scratch: Vec<Mutex<Scratch>>,
    out: Vec<f32>,
}

/// `c[r, n] = alpha · a[r, k] · b`, `b` read with column stride `b_cs` and
/// row stride `b_rs`, single-threaded.
fn gemm_rows(r: usize, n: usize, k: usize, a: &[f32], b: (&[f32], isize, isize), c: &mut [f32], alpha: f32) {
    let (b, b_cs, b_rs) = b;
    let b_end = (n.saturating_sub(1) as isize * b_cs + k.saturating_sub(1) as isize * b_rs) as usize + 1;
    assert!(a.len() >= r * k && c.len() >= r * n && b.len() >= b_end, "gemm operands sized for the product");
    // SAFETY: the assert: a is [r, k] row-major, c is [r, n] row-major and
    // not aliased by a or b, and every element (i, j) of b (i < k, j < n) at
    // i·b_rs + j·b_cs lies inside b.
    unsafe {
        gemm::gemm(
            r,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The cache's blocks as a typed slice, to gather rows from.
enum Blocks<'a> {
    F32(&'a [f32]),
    BF16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

impl Blocks<'_> {
    fn of(cache: &PagedKVCacheCollection) -> Result<Blocks<'_>> {
        let blocks = cache.blocks();
        Ok(match blocks.dtype() {
            DType::F32 => Blocks::F32(blocks.as_slice()?),
            DType::BF16 => Blocks::BF16(blocks.as_slice()?),
            DType::F16 => Blocks::F16(blocks.as_slice()?),
            DType::F8E4M3 => return Err(BenchError::PeerUnavailable { peer: "gather+gemm", dtype: DType::F8E4M3 }),
            _ => unreachable!("caches hold floats"),
        })
    }

    /// Widen `dst.len()` elements from element offset `at` into `dst`.
    fn widen(&self, at: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            Blocks::F32(v) => dst.copy_from_slice(&v[at..at + n]),
            Blocks::BF16(v) => v[at..at + n].convert_to_f32_slice(dst),
            Blocks::F16(v) => v[at..at + n].convert_to_f32_slice(dst),
        }
    }
}

impl GatherGemmPeer {
    /// A peer for `heads`, with buffers for `threads` workers.
    pub fn new(heads: Heads, threads: usize) -> Self {
        Self { heads, scratch: (0..threads.max(1)).map(|_| Mutex::default()).collect(), out: Vec::new() }
    }

    /// Causal attention of `q [B, S, Hq, D]` over `cache` at `layer` for
    /// `valid[b]` new tokens per sequence (already in the cache), written
    /// into `output` (q's dtype).
    pub fn run(
        &mut self,
        q: &Tensor,
        cache: &PagedKVCacheCollection,
        layer: usize,
        valid: &[u32],
        output: &mut Tensor,
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let h = self.heads;
        let &[batch, seq, hq, d] = q.shape() else {
            return Err(BenchError::Shape { what: "q", expected: "[B, S, Hq, D]", got: q.shape().to_vec() });
        };
        let group = h.group();
        let q = q.to_f32_vec()?;
        let items: Vec<(usize, usize)> =
            (0..batch).filter(|&b| valid[b] > 0).flat_map(|b| (0..h.num_kv_heads).map(move |k| (b, k))).collect();
        let scratch = &self.scratch;
        let blocks = Blocks::of(cache)?;
        let blocks = &blocks;
        let item = |&(b, kvh): &(usize, usize)| -> Vec<f32> {
            let slot = rayon::current_thread_index().unwrap_or(0) % scratch.len();
            let mut guard = scratch[slot].lock().expect("no thread panicked holding scratch");
            let s = &mut *guard;
            let (cl, v) = (cache.cache_lengths()[b] as usize, valid[b] as usize);
            let n = cl + v;
            // Gather this head's K and V rows, page by page.
            s.k.resize(n * d, 0.0);
            s.v.resize(n * d, 0.0);
            let row = cache.max_pages_per_seq() * b;
            for logical in 0..n.div_ceil(h.page_size) {
                let page = cache.lookup_table()[row + logical] as usize;
                let first = logical * h.page_size;
                for slot in 0..h.page_size.min(n - first) {
                    let p = first + slot;
                    for (kv, dst) in [(0, &mut s.k), (1, &mut s.v)] {
                        blocks.widen(cache.element_offset(page, kv, layer, slot, kvh, 0), &mut dst[p * d..][..d]);
                    }
                }
            }
            // The group's query rows (g, s), head-major.
            let rows = group * v;
            s.q.resize(rows * d, 0.0);
            for g in 0..group {
                for t in 0..v {
                    let src = &q[((b * seq + t) * hq + kvh * group + g) * d..][..d];
                    s.q[(g * v + t) * d..][..d].copy_from_slice(src);
                }
            }
            s.out.resize(rows * d, 0.0);
            // Blocks of rows whose scores fit in ~8 MB.
            let block = ((1 << 21) / n).clamp(1, rows);
            s.scores.resize(block * n, 0.0);
            for r0 in (0..rows).step_by(block) {
                let r = block.min(rows - r0);
                let scores = &mut s.scores[..r * n];
                gemm_rows(r, n, d, &s.q[r0 * d..][..r * d], (&s.k, d as isize, 1), scores, h.scale());
                for (i, row) in scores.chunks_exact_mut(n).enumerate() {
                    let t = (r0 + i) % v;
                    let (live, masked) = row.split_at_mut(cl + t + 1);
                    let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut total = 0f32;
                    for x in live.iter_mut() {
                        *x = (*x - max).exp();
                        total += *x;
                    }
                    let inv = 1.0 / total;
                    live.iter_mut().for_each(|x| *x *= inv);
                    masked.fill(0.0);
                }
                gemm_rows(r, d, n, scores, (&s.v, 1, d as isize), &mut s.out[r0 * d..][..r * d], 1.0);
            }
            s.out[..rows * d].to_vec()
        };
        let outputs: Vec<Vec<f32>> = {
            let run = || items.par_iter().map(item).collect();
            match ctx.cpu_context() {
                Some(cpu) => cpu.rayon_pool().expect("starting the peer's rayon pool").install(run),
                None => run(),
            }
        };
        self.out.clear();
        self.out.resize(batch * seq * hq * d, 0.0);
        for (&(b, kvh), rows) in items.iter().zip(outputs) {
            let v = valid[b] as usize;
            for g in 0..group {
                for t in 0..v {
                    let dst = &mut self.out[((b * seq + t) * hq + kvh * group + g) * d..][..d];
                    dst.copy_from_slice(&rows[(g * v + t) * d..][..d]);
                }
            }
        }
        store(&self.out, output)
    }
}

/// A decode or prefill configuration: JIT kernel vs peer, or why it has no
/// figures.
#[derive(Clone, Debug)]
pub struct PairResult {
    /// Sequences.
    pub batch: usize,
    /// Keys per query (decode) or tokens (prefill).
    pub tokens: usize,
    /// Dtype of the cache and activations.
    pub dtype: DType,
    /// Layers the cache cycles through.
    pub layers: usize,
    /// The JIT kernel's key.
    pub kernel_key: String,
    /// Normalized max error of the JIT output against the peer's.
    pub error: f64,
    /// The kernel's and the peer's timings, or the reason there are no
    /// figures.
    pub outcome: std::result::Result<(Measurement, Measurement), String>,
    /// Decode: the read probe's rate (bytes/s) in each round of the
    /// interleaved timing, beside the kernel's sample of that round; empty
    /// for prefill.
    pub read_rates: Vec<f64>,
}

/// RoPE alone.
#[derive(Clone, Debug)]
pub struct RopeResult {
    /// `decode` or `prefill`.
    pub step: String,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Bytes it moves (Q and K read and written, table rows read).
    pub bytes: f64,
    /// Seconds per call.
    pub time: Stats,
    /// Median of the whole step it belongs to, if measured.
    pub step_median: Option<f64>,
}

/// One op of the whole step.
#[derive(Clone, Debug)]
pub struct OpTime {
    /// The op's kernel name (the key's first field).
    pub op: String,
    /// Median seconds in the step, per executor timing.
    pub median: f64,
    /// Bytes its roof counts.
    pub roof_bytes: f64,
    /// FLOPs its roof counts (the matmul's and attention's multiply-adds).
    pub flops: f64,
    /// Whether its kernel runs on the 256-bit tier (its key names
    /// `cpu-avx2`): its FLOPs count at the 256-bit FMA rate.
    pub avx2: bool,
}

/// The whole attention-step graph.
#[derive(Clone, Debug)]
pub struct StepResult {
    /// Decode batch.
    pub batch: usize,
    /// History per sequence.
    pub history: usize,
    /// Seconds per `Executor::run` of a decode step.
    pub time: Stats,
    /// Per op, in step order.
    pub ops: Vec<OpTime>,
    /// Seconds per `Executor::run` of the prefill step, if measured, and its length.
    pub prefill: Option<(usize, Stats)>,
}

impl StepResult {
    /// Sum of the ops' roof bytes.
    pub fn roof_bytes(&self) -> f64 {
        self.ops.iter().map(|o| o.roof_bytes).sum()
    }

    /// Sum of the ops' roof FLOPs.
    pub fn flops(&self) -> f64 {
        self.ops.iter().map(|o| o.flops).sum()
    }
}

/// Everything one `kvjit bench --ops attention` run measured.
#[derive(Clone, Debug)]
pub struct AttentionReport {
    /// The preset.
    pub mode: String,
    /// Worker threads.
    pub threads: usize,
    /// The CPU.
    pub cpu: String,
    /// Wall time of the run.
    pub duration: Duration,
    /// The heads.
    pub heads: Heads,
    /// Contexts from which the decode targets apply.
    pub target_context: usize,
    /// The roofs, measured at the start and the end.
    pub roof: Roof,
    /// Decode configurations.
    pub decode: Vec<PairResult>,
    /// Prefill configurations.
    pub prefill: Vec<PairResult>,
    /// RoPE alone.
    pub rope: Vec<RopeResult>,
    /// The whole step.
    pub step: Option<StepResult>,
}

/// Environment variable naming the CPU tier the benches' paged-attention
/// kernels (`--ops attention` decode and prefill rows, `--ops fp8` decode
/// attention) are built for: `auto` (default), `cranelift`, `avx2`. The
/// rows' kernel keys name it (`cpu-avx2`).
pub const ATTENTION_TIER_VAR: &str = "KVJIT_BENCH_ATTENTION_TIER";

/// The tier [`ATTENTION_TIER_VAR`] asks for, resolved; the widest this CPU
/// runs when it is unset, or (with a warning) names no tier this CPU runs.
pub fn attention_tier() -> CodeTier {
    let requested = match std::env::var(ATTENTION_TIER_VAR) {
        Ok(name) => match name.parse::<CpuTier>() {
            Ok(tier) => tier,
            Err(e) => {
                eprintln!("warning: {ATTENTION_TIER_VAR}: {e}; using the auto tier");
                CpuTier::Auto
            }
        },
        Err(_) => CpuTier::Auto,
    };
    kvjit_jit::microkernel::resolve_tier(requested).unwrap_or_else(|e| {
        eprintln!("warning: {ATTENTION_TIER_VAR}: {e}; using the auto tier");
        crate::problem::widest_tier()
    })
}

/// Run a JIT kernel and the peer once on the same call and compare.
fn validate(
    kernel: &Compiled<MhaKernel>,
    peer: &mut GatherGemmPeer,
    q: &Tensor,
    layer: &Tensor,
    valid: &Tensor,
    cache: &mut PagedKVCacheCollection,
    ctx: &DeviceContextPtr,
) -> Result<f64> {
    let mut jit = Tensor::zeros(q.dtype(), q.shape())?;
    kernel.kernel().run_into(&[q, layer, valid], &mut [&mut *cache], jit.as_bytes_mut(), ctx)?;
    let mut theirs = Tensor::zeros(q.dtype(), q.shape())?;
    peer.run(q, cache, layer.to_u32_vec()?[0] as usize, &valid.to_u32_vec()?, &mut theirs, ctx)?;
    Ok(normalized_error(&jit.to_f32_vec()?, &theirs.to_f32_vec()?))
}

/// One decode or prefill configuration: build, validate, time (with
/// `probe`, a read-probe sample in every round beside the kernel's).
fn run_pair(
    heads: &Heads,
    dtype: DType,
    step: StepShape,
    layers: usize,
    (plan, probe): (&Plan, Option<&ReadProbe>),
    ctx: &DeviceContextPtr,
    rng: &mut SmallRng,
) -> Result<PairResult> {
    let StepShape { batch, history, new_tokens: seq } = step;
    let threads = ctx.cpu_context().map_or(1, |c| c.threads());
    let mut cache = make_cache(heads, dtype, layers, step, true, rng)?;
    let spec = heads.spec(dtype, layers, batch, seq);
    let key = spec.key().to_string();
    let kernel =
        mha_kernel(spec, CaptureText::default()).map_err(|source| BenchError::Compile { key: key.clone(), source })?;
    let q = Tensor::random(dtype, &[batch, seq, heads.num_heads, heads.head_size], rng, -1.0, 1.0)?;
    let valid = Tensor::from_vec(&[batch], vec![seq as u32; batch])?;
    let layer_tensors: Vec<Tensor> = (0..layers as u32).map(Tensor::scalar_u32).collect();
    let mut peer = GatherGemmPeer::new(*heads, threads);
    let mut result = PairResult {
        batch,
        tokens: history + seq,
        dtype,
        layers,
        kernel_key: key,
        error: f64::NAN,
        outcome: Err(String::new()),
        read_rates: Vec::new(),
    };
    // Validate on the last layer (any layer would do).
    let error = match validate(&kernel, &mut peer, &q, &layer_tensors[layers - 1], &valid, &mut cache, ctx) {
        Ok(error) => error,
        Err(e) => {
            result.outcome = Err(format!("validation run failed: {e}"));
            return Ok(result);
        }
    };
    result.error = error;
    if error.is_nan() || error > tolerance(dtype) {
        result.outcome =
            Err(format!("kvjit and gather+gemm disagree: normalized max error {error:.3e} > {:.3e}", tolerance(dtype)));
        return Ok(result);
    }
    let mut jit_out = Tensor::zeros(dtype, q.shape())?;
    let mut peer_out = Tensor::zeros(dtype, q.shape())?;
    let valid_values = valid.to_u32_vec()?;
    let mut next = [0usize; 2];
    // The kernel, the peer and (decode) the read probe, one sample each a
    // round.
    let measured = measure_interleaved(2 + usize::from(probe.is_some()), plan, |i| {
        if let (2, Some(probe)) = (i, probe) {
            std::hint::black_box(probe.run(ctx)?);
            return Ok(());
        }
        let l = next[i] % layers;
        next[i] = l + 1;
        match i {
            0 => kernel.kernel().run_into(
                &[&q, &layer_tensors[l], &valid],
                &mut [&mut cache],
                jit_out.as_bytes_mut(),
                ctx,
            )?,
            _ => peer.run(&q, &cache, l, &valid_values, &mut peer_out, ctx)?,
        }
        Ok(())
    })?;
    if let (Some(probe), Some(m)) = (probe, measured.get(2)) {
        result.read_rates = m.samples.iter().map(|t| probe.bytes() as f64 / t).collect();
    }
    let mut measured = measured.into_iter();
    result.outcome = Ok((measured.next().expect("the kernel"), measured.next().expect("the peer")));
    Ok(result)
}

/// The RoPE table `[max_seq, D]`: `cos, sin` of `pos·θ^(−2j/D)` interleaved.
fn freqs_table(dtype: DType, max_seq: usize, head_size: usize) -> Result<Tensor> {
    let mut values = vec![0f32; max_seq * head_size];
    for pos in 0..max_seq {
        for j in 0..head_size / 2 {
            let angle = pos as f64 * 500000f64.powf(-2.0 * j as f64 / head_size as f64);
            values[pos * head_size + 2 * j] = angle.cos() as f32;
            values[pos * head_size + 2 * j + 1] = angle.sin() as f32;
        }
    }
    Ok(Tensor::from_f32(dtype, &[max_seq, head_size], &values)?)
}

/// RoPE alone on a step of `shape` (`step` names it in the report).
fn run_rope(
    heads: &Heads,
    dtype: DType,
    step: &str,
    shape: StepShape,
    plan: &Plan,
    ctx: &DeviceContextPtr,
    rng: &mut SmallRng,
) -> Result<RopeResult> {
    let StepShape { batch, history, new_tokens: seq } = shape;
    let mut cache = make_cache(heads, dtype, 1, shape, false, rng)?;
    let spec = RopeSpec {
        target: Target::Cpu,
        dtype,
        cache: cache_params(heads, dtype, 1),
        interleaved: false,
        num_q_heads: heads.num_heads,
        step: StepDims { batch: Some(batch), seq: Some(seq) },
    };
    let key = spec.key().to_string();
    let kernel = RopeKernel::new(spec, CaptureText::default()).map_err(|source| BenchError::Compile { key, source })?;
    let q = Tensor::random(dtype, &[batch, seq, heads.num_heads, heads.head_size], rng, -1.0, 1.0)?;
    let freqs = freqs_table(dtype, history + seq, heads.head_size)?;
    let layer = Tensor::scalar_u32(0);
    let valid = Tensor::from_vec(&[batch], vec![seq as u32; batch])?;
    let mut out = Tensor::zeros(dtype, q.shape())?;
    let measured = measure_interleaved(1, plan, |_| {
        let tensors = [&q, &freqs, &layer, &valid];
        kernel.run_into(&tensors, &mut [&mut cache], out.as_bytes_mut(), ctx)?;
        Ok(())
    })?;
    let rows = (batch * seq) as f64;
    let (hq, hkv, d, e) = (heads.num_heads, heads.num_kv_heads, heads.head_size, dtype.size_bytes());
    let bytes = rows * ((2 * hq * d * e) + (2 * hkv * d * e) + d * e) as f64;
    Ok(RopeResult { step: step.into(), batch, seq, bytes, time: measured[0].time, step_median: None })
}

/// An op of the step: its kernel name and whether it runs on the 256-bit
/// tier.
type StepOp = (String, bool);

/// The op a kernel key belongs to (its first field) and whether it runs
/// on the 256-bit tier (its second field).
fn op_of(key: &str) -> StepOp {
    let mut fields = key.split('.');
    let op = fields.next().unwrap_or(key).to_string();
    (op, fields.next() == Some("cpu-avx2"))
}

/// Time `Executor::run` of the step; per-op medians from its timings.
fn time_step(
    exe: &Executable,
    inputs: &BTreeMap<String, Tensor>,
    caches: &mut BTreeMap<String, PagedKVCacheCollection>,
    plan: &Plan,
    ctx: &DeviceContextPtr,
) -> Result<(Stats, Vec<(StepOp, Stats)>)> {
    let executor = Executor::new(ctx.clone());
    let mut per_op: Vec<(StepOp, Vec<f64>)> = Vec::new();
    let mut runs = 0;
    let measured = measure_interleaved(1, plan, |_| {
        let out = executor.run(exe, inputs, caches)?;
        runs += 1;
        if runs == 1 {
            return check_finite(out.outputs.values());
        }
        let mut times: Vec<(StepOp, f64)> = Vec::new();
        for t in &out.timings {
            let op = op_of(&exe.steps()[t.step].kernel.key().to_string());
            match times.iter_mut().find(|(o, _)| *o == op) {
                Some((_, s)) => *s += t.elapsed.as_secs_f64(),
                None => times.push((op, t.elapsed.as_secs_f64())),
            }
        }
        for (op, s) in times {
            match per_op.iter_mut().find(|(o, _)| *o == op) {
                Some((_, v)) => v.push(s),
                None => per_op.push((op, vec![s])),
            }
        }
        Ok(())
    })?;
    let ops = per_op.into_iter().map(|(op, v)| (op, Stats::from_samples(&v))).collect();
    Ok((measured[0].time, ops))
}

fn run_step(config: &StepConfig, ctx: &DeviceContextPtr, rng: &mut SmallRng) -> Result<StepResult> {
    let layer = &config.graph.layer;
    let exe = compile_step(&config.graph)?;
    let (inputs, mut caches) = step_inputs(layer, config.batch, config.history, 1, rng)?;
    let (time, ops) = time_step(&exe, &inputs, &mut caches, &config.timing, ctx)?;
    let e = layer.dtype.size_bytes() as f64;
    let heads = Heads {
        num_heads: layer.num_q_heads,
        num_kv_heads: layer.num_kv_heads,
        head_size: layer.head_size,
        page_size: layer.page_size,
    };
    let (b, d) = (config.batch as f64, layer.head_size as f64);
    let ops = ops
        .into_iter()
        .map(|((op, avx2), stats)| {
            let (roof_bytes, flops) = match op.as_str() {
                QKV_KERNEL_NAME => {
                    let weight = (layer.n() * layer.hidden_size) as f64;
                    (weight * e, 2.0 * b * weight)
                }
                kvjit::attention::KERNEL_NAME => {
                    // Each query head: q·K and P·V over history + 1 keys.
                    let keys = (config.history + 1) as f64;
                    let flops = 4.0 * b * (layer.num_q_heads * layer.head_size) as f64 * keys;
                    (b * heads.kv_bytes(config.history + 1, layer.dtype), flops)
                }
                kvjit::rope::KERNEL_NAME => {
                    (b * ((2 * layer.q_dim() + 2 * layer.num_kv_heads * layer.head_size) as f64 * e + d * e), 0.0)
                }
                _ => (0.0, 0.0),
            };
            OpTime { op, median: stats.median, roof_bytes, flops, avx2 }
        })
        .collect();
    drop(caches);
    let prefill = match config.prefill {
        Some(seq) => {
            let (inputs, mut caches) = step_inputs(layer, 1, 0, seq, rng)?;
            Some((seq, time_step(&exe, &inputs, &mut caches, &config.prefill_timing, ctx)?.0))
        }
        None => None,
    };
    Ok(StepResult { batch: config.batch, history: config.history, time, ops, prefill })
}

/// Run `config`, calling `progress` before every step.
pub fn run_attention(config: &AttentionBenchConfig, progress: &mut dyn FnMut(&Progress)) -> Result<AttentionReport> {
    config.check()?;
    let ctx = DeviceContextPtr::cpu(config.threads)?;
    let threads = ctx.cpu_context().map_or(1, |c| c.threads());
    let mut steps = Steps::new(config.step_count(), progress);
    let mut rng = SmallRng::seed_from_u64(config.seed);
    let heads = config.heads;

    let mut roof_samples = RoofSamples::default();
    steps.start("roofline probes");
    roof_samples.measure(&ctx, &config.roof)?;
    // Sampled in every decode timing round, beside the kernel.
    let probe = ReadProbe::try_new(config.roof.read_bytes)?;

    let mut decode = Vec::new();
    for &dtype in &config.dtypes {
        for &context in &config.contexts {
            for &batch in &config.batches {
                steps.start(format!("decode {dtype} context {context} batch {batch}"));
                let per_layer = batch as f64 * heads.kv_bytes(context, dtype);
                let layers = ((config.working_set as f64 / per_layer).ceil() as usize).clamp(1, 256);
                decode.push(run_pair(
                    &heads,
                    dtype,
                    StepShape { batch, history: context - 1, new_tokens: 1 },
                    layers,
                    (&config.timing, Some(&probe)),
                    &ctx,
                    &mut rng,
                )?);
            }
        }
    }
    let mut prefill = Vec::new();
    for &seq in &config.prefills {
        steps.start(format!("prefill {} {seq} tokens", config.prefill_dtype));
        prefill.push(run_pair(
            &heads,
            config.prefill_dtype,
            StepShape { batch: 1, history: 0, new_tokens: seq },
            1,
            (&config.prefill_timing, None),
            &ctx,
            &mut rng,
        )?);
    }
    let step_result = match &config.step {
        Some(s) => {
            steps.start(format!("attention step graph: decode batch {} history {}", s.batch, s.history));
            Some(run_step(s, &ctx, &mut rng)?)
        }
        None => None,
    };
    steps.start("RoPE");
    let mut rope = Vec::new();
    let dtype = config.prefill_dtype;
    let (rope_batch, rope_history) = config.step.as_ref().map_or((8, config.target_context), |s| (s.batch, s.history));
    let mut r = run_rope(
        &heads,
        dtype,
        "decode",
        StepShape { batch: rope_batch, history: rope_history, new_tokens: 1 },
        &config.timing,
        &ctx,
        &mut rng,
    )?;
    r.step_median = step_result.as_ref().map(|s| s.time.median);
    rope.push(r);
    if let Some((seq, time)) = step_result.as_ref().and_then(|s| s.prefill) {
        let mut r = run_rope(
            &heads,
            dtype,
            "prefill",
            StepShape { batch: 1, history: 0, new_tokens: seq },
            &config.timing,
            &ctx,
            &mut rng,
        )?;
        r.step_median = Some(time.median);
        rope.push(r);
    }

    steps.start("roofline probes (again)");
    roof_samples.measure(&ctx, &config.roof)?;
    Ok(AttentionReport {
        mode: config.mode.clone(),
        threads,
        cpu: crate::cpu_name(),
        duration: steps.elapsed(),
        heads,
        target_context: config.target_context,
        roof: roof_samples.roof(threads),
        decode,
        prefill,
        rope,
        step: step_result,
    })
}

/// One target, checked against this run.
#[derive(Clone, Debug)]
pub struct TargetCheck {
    /// What is measured.
    pub what: String,
    /// The measured value, as shown.
    pub value: String,
    /// The goal, as shown.
    pub goal: String,
    /// Met; `None` when the configuration has no figure (validation failed).
    pub met: Option<bool>,
}

impl AttentionReport {
    /// K/V bytes a decode configuration reads per call.
    fn decode_bytes(&self, r: &PairResult) -> f64 {
        r.batch as f64 * self.heads.kv_bytes(r.tokens, r.dtype)
    }

    /// Read-roof seconds of a decode configuration.
    pub fn decode_roof_time(&self, r: &PairResult) -> f64 {
        self.decode_bytes(r) / self.roof.read_bytes_per_s.median
    }

    /// kvjit's share of the read roof in a decode configuration, paired:
    /// per timing round, the K/V bytes at that round's read-probe rate over
    /// the kernel's time in it (a slow spell of the shared machine slows
    /// both); the median and quartiles of the rounds. `None` without
    /// figures or probe samples.
    pub fn decode_share(&self, r: &PairResult) -> Option<Stats> {
        let (jit, _) = r.outcome.as_ref().ok()?;
        if r.read_rates.is_empty() {
            return None;
        }
        Some(Stats::paired_roof_share(self.decode_bytes(r), &jit.samples, &r.read_rates))
    }

    /// FMA-roof seconds of a prefill configuration.
    pub fn prefill_roof_time(&self, r: &PairResult) -> f64 {
        self.heads.prefill_flops(r.tokens) / self.roof.fma_flops_per_s.median
    }

    /// An op of the step's roof seconds: the roofline, max(bytes / read
    /// bandwidth, FLOPs / FMA rate), the FMA rate of the op's tier (a
    /// batched decode's QKV matmul is FMA-bound, its attention read-bound).
    pub fn op_roof_time(&self, o: &OpTime) -> f64 {
        let fma = match (o.avx2, self.roof.fma256_flops_per_s) {
            (true, Some(fma256)) => fma256.median,
            _ => self.roof.fma_flops_per_s.median,
        };
        (o.roof_bytes / self.roof.read_bytes_per_s.median).max(o.flops / fma)
    }

    /// Sum of the whole step's ops' roof times.
    pub fn step_roof_time(&self, s: &StepResult) -> f64 {
        s.ops.iter().map(|o| self.op_roof_time(o)).sum()
    }

    /// Every target, checked.
    pub fn targets(&self) -> Vec<TargetCheck> {
        let mut checks = Vec::new();
        for r in self.decode.iter().filter(|r| r.tokens >= self.target_context) {
            let name = format!("decode {} ctx {} batch {}", r.dtype, r.tokens, r.batch);
            let (roof, peer) = match &r.outcome {
                Ok((jit, peer)) => {
                    let (jit, peer) = (&jit.time, &peer.time);
                    let of_roof = self.decode_share(r).map_or(self.decode_roof_time(r) / jit.median, |s| s.median);
                    let vs = peer.median / jit.median;
                    (Some((of_roof, of_roof >= DECODE_ROOF_TARGET)), Some((vs, vs >= DECODE_PEER_TARGET)))
                }
                Err(_) => (None, None),
            };
            checks.push(TargetCheck {
                what: format!("{name}: of read roof"),
                value: roof.map_or("error".into(), |(v, _)| format!("{:.0}%", v * 100.0)),
                goal: format!("≥ {:.0}%", DECODE_ROOF_TARGET * 100.0),
                met: roof.map(|(_, m)| m),
            });
            checks.push(TargetCheck {
                what: format!("{name}: vs gather+gemm"),
                value: peer.map_or("error".into(), |(v, _)| format!("{v:.2}×")),
                goal: format!("≥ {DECODE_PEER_TARGET:.1}×"),
                met: peer.map(|(_, m)| m),
            });
        }
        for r in &self.prefill {
            let vs = r.outcome.as_ref().ok().map(|(jit, peer)| peer.time.median / jit.time.median);
            checks.push(TargetCheck {
                what: format!("prefill {} {}: vs gather+gemm", r.dtype, r.tokens),
                value: vs.map_or("error".into(), |v| format!("{v:.2}×")),
                goal: format!("≥ {PREFILL_PEER_TARGET:.1}×"),
                met: vs.map(|v| v >= PREFILL_PEER_TARGET),
            });
            if let Some(fma256) = self.roof.fma256_flops_per_s {
                let share = r
                    .outcome
                    .as_ref()
                    .ok()
                    .map(|(jit, _)| self.heads.prefill_flops(r.tokens) / jit.time.median / fma256.median);
                checks.push(TargetCheck {
                    what: format!("prefill {} {}: of the 256-bit FMA roof", r.dtype, r.tokens),
                    value: share.map_or("error".into(), |v| format!("{:.0}%", v * 100.0)),
                    goal: format!("≥ {:.0}%", PREFILL_FMA256_TARGET * 100.0),
                    met: share.map(|v| v >= PREFILL_FMA256_TARGET),
                });
            }
        }
        for r in &self.rope {
            if let Some(step) = r.step_median {
                let share = r.time.median / step;
                checks.push(TargetCheck {
                    what: format!("RoPE share of the {} step (batch {}, S {})", r.step, r.batch, r.seq),
                    value: format!("{:.1}%", share * 100.0),
                    goal: format!("≤ {:.0}%", ROPE_SHARE_TARGET * 100.0),
                    met: Some(share <= ROPE_SHARE_TARGET),
                });
            }
        }
        if let Some(s) = &self.step {
            let ratio = s.time.median / self.step_roof_time(s);
            checks.push(TargetCheck {
                what: format!("whole decode step (batch {}, history {}) vs sum of roofs", s.batch, s.history),
                value: format!("{ratio:.2}×"),
                goal: format!("≤ {STEP_ROOF_TARGET:.1}×"),
                met: Some(ratio <= STEP_ROOF_TARGET),
            });
        }
        checks
    }

    /// Configurations whose validation failed.
    pub fn failures(&self) -> Vec<String> {
        self.decode
            .iter()
            .map(|r| (format!("decode {} ctx {} batch {}", r.dtype, r.tokens, r.batch), r))
            .chain(self.prefill.iter().map(|r| (format!("prefill {} {}", r.dtype, r.tokens), r)))
            .filter_map(|(name, r)| r.outcome.as_ref().err().map(|e| format!("{name}: {e}")))
            .collect()
    }

    /// The Markdown report.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let roof = &self.roof;
        let h = &self.heads;
        let bw = roof.read_bytes_per_s.median;
        let _ = writeln!(s, "# kvjit bench --ops attention ({}, {} threads)\n", self.mode, self.threads);
        let _ = writeln!(
            s,
            "CPU: {}; kvjit {}; run took {:.0} s. Heads: {} q / {} kv of {}, page {}, causal, scale 1/√{}.\n",
            self.cpu,
            env!("CARGO_PKG_VERSION"),
            self.duration.as_secs_f64(),
            h.num_heads,
            h.num_kv_heads,
            h.head_size,
            h.page_size,
            h.head_size,
        );
        let _ = writeln!(
            s,
            "Roofs, {} threads, at the start and end of this run (median, min–max): read bandwidth **{:.1} GB/s** \
             ({:.1}–{:.1}); 128-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1}){}.\n",
            roof.threads,
            bw / 1e9,
            roof.read_bytes_per_s.min / 1e9,
            roof.read_bytes_per_s.max / 1e9,
            roof.fma_flops_per_s.median / 1e9,
            roof.fma_flops_per_s.min / 1e9,
            roof.fma_flops_per_s.max / 1e9,
            roof.fma256_flops_per_s.map_or(String::new(), |f| format!(
                "; 256-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1})",
                f.median / 1e9,
                f.min / 1e9,
                f.max / 1e9
            )),
        );
        s.push_str(
            "Medians of interleaved samples. *peer* = gather+gemm: K/V gathered from the pages into f32 per \
             (sequence, KV head), `gemm` scores, plain softmax, `gemm` P·V (gather timed). *vs peer* = peer time / \
             kvjit time. Each agreed with kvjit before timing (normalized max error *err*).\n",
        );
        // The rest of a decode or prefill row: kvjit's and the peer's time,
        // rate (`work` per second, in G) and share of the roof time `rt`,
        // the speed-up and the error; or a pointer to the Errors section.
        // kvjit's share is `share` where given (decode: paired).
        let figures = |r: &PairResult, work: f64, rt: f64, share: Option<Stats>| {
            let cells = match r.outcome.as_ref().map(|(jit, peer)| (&jit.time, &peer.time)) {
                Ok((jit, peer)) => format!(
                    " {} | {} | {:.0}% | {} | {} | {:.0}% | {:.2}×",
                    format_time(jit.median),
                    format_rate(work / jit.median / 1e9),
                    share.map_or(rt / jit.median, |s| s.median) * 100.0,
                    format_time(peer.median),
                    format_rate(work / peer.median / 1e9),
                    rt / peer.median * 100.0,
                    peer.median / jit.median
                ),
                Err(_) => format!(" **error** (see Errors){}", " | –".repeat(6)),
            };
            format!("{cells} | {:.1e} |", r.error)
        };
        s.push_str(
            "\n## Decode (S = 1): roof = K/V bytes / read bandwidth; kvjit's *of roof* paired (the median of each timing round's ratio, a read-probe sample taken in every round)\n\n\
             | ctx | B | dtype | K/V MB | roof | kvjit | GB/s | of roof | peer | GB/s | of roof | vs peer | err |\n\
             |---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.decode {
            let bytes = self.decode_bytes(r);
            let rt = self.decode_roof_time(r);
            let _ =
                write!(s, "| {} | {} | {} | {:.1} | {} |", r.tokens, r.batch, r.dtype, bytes / 1e6, format_time(rt));
            let _ = writeln!(s, "{}", figures(r, bytes, rt, self.decode_share(r)));
        }
        s.push_str(
            "\n## Prefill (batch 1, empty cache, causal): roof = 2·2·Hq·D·S(S+1)/2 FLOPs / 128-bit FMA rate\n\n\
             | S | dtype | roof | kvjit | GFLOP/s | of roof | peer | GFLOP/s | of roof | vs peer | err |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.prefill {
            let flops = h.prefill_flops(r.tokens);
            let rt = self.prefill_roof_time(r);
            let _ = write!(s, "| {} | {} | {} |", r.tokens, r.dtype, format_time(rt));
            let _ = writeln!(s, "{}", figures(r, flops, rt, None));
        }
        s.push_str(
            "\n## RoPE alone (JIT kernel), share of its step (the step graph's median)\n\n\
             | step | B | S | RoPE | GB/s | step | share |\n|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rope {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                r.step,
                r.batch,
                r.seq,
                format_time(r.time.median),
                format_rate(r.bytes / r.time.median / 1e9),
                r.step_median.map_or("–".into(), format_time),
                r.step_median.map_or("–".into(), |t| format!("{:.1}%", r.time.median / t * 100.0)),
            );
        }
        if let Some(st) = &self.step {
            let _ = writeln!(
                s,
                "\n## Whole attention step graph (fused QKV → reshape → RoPE → attention), decode batch {}, \
                 history {}\n",
                st.batch, st.history
            );
            s.push_str(
                "Roof of an op: max(bytes / read bandwidth, FLOPs / FMA rate of its tier: 256-bit for `cpu-avx2` \
                 keys).\n\n| op | median | roof bytes MB | roof GFLOP | roof | bound | × roof |\n\
                 |---|---:|---:|---:|---:|---|---:|\n",
            );
            for o in &st.ops {
                let rt = self.op_roof_time(o);
                let bound = if o.flops == 0.0 && o.roof_bytes == 0.0 {
                    "–"
                } else if o.roof_bytes / bw >= rt {
                    "bandwidth"
                } else {
                    "fma"
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {:.1} | {:.2} | {} | {bound} | {} |",
                    o.op,
                    format_time(o.median),
                    o.roof_bytes / 1e6,
                    o.flops / 1e9,
                    if rt > 0.0 { format_time(rt) } else { "–".into() },
                    if rt > 0.0 { format!("{:.2}", o.median / rt) } else { "–".into() }
                );
            }
            let rt = self.step_roof_time(st);
            let _ = writeln!(
                s,
                "| **step** (`Executor::run`) | {} ({} per token) | {:.1} | {:.2} | {} | | {:.2} |",
                format_time(st.time.median),
                format_time(st.time.median / st.batch as f64),
                st.roof_bytes() / 1e6,
                st.flops() / 1e9,
                format_time(rt),
                st.time.median / rt
            );
            if let Some((seq, t)) = &st.prefill {
                let _ = writeln!(s, "\nPrefill step of {seq} tokens (batch 1): {}.", format_time(t.median));
            }
        }
        s.push_str("\n## Targets\n\n| target | this run | goal | |\n|---|---:|---:|---|\n");
        for t in self.targets() {
            let _ =
                writeln!(s, "| {} | {} | {} | {} |", t.what, t.value, t.goal, t.met.map_or("**error**", pass_or_miss));
        }
        let failures = self.failures();
        if !failures.is_empty() {
            s.push_str("\n## Errors\n\n");
            for f in failures {
                let _ = writeln!(s, "- error: {f}");
            }
        }
        s
    }

    /// Every figure as JSON.
    pub fn to_json(&self) -> Value {
        let pair = |r: &PairResult, roof_time: f64, work: f64| {
            let mut v = json!({
                "batch": r.batch,
                "tokens": r.tokens,
                "dtype": r.dtype.to_string(),
                "layers": r.layers,
                "kernel_key": r.kernel_key,
                "normalized_error": if r.error.is_finite() { json!(r.error) } else { Value::Null },
                "roof_time_s": roof_time,
            });
            match r.outcome.as_ref().map(|(jit, peer)| (&jit.time, &peer.time)) {
                Ok((jit, peer)) => {
                    v["kvjit"] = json!({
                        "time": jit.to_json(), "rate": work / jit.median, "of_roof": roof_time / jit.median,
                    });
                    v["gather_gemm"] = json!({
                        "time": peer.to_json(), "rate": work / peer.median, "of_roof": roof_time / peer.median,
                    });
                    v["speedup_vs_peer"] = json!(peer.median / jit.median);
                }
                Err(e) => v["error"] = json!(e),
            }
            v
        };
        let h = &self.heads;
        json!({
            "ops": "attention",
            "mode": self.mode,
            "threads": self.threads,
            "cpu": self.cpu,
            "kvjit_version": env!("CARGO_PKG_VERSION"),
            "duration_s": self.duration.as_secs_f64(),
            "heads": {
                "num_heads": h.num_heads, "num_kv_heads": h.num_kv_heads,
                "head_size": h.head_size, "page_size": h.page_size, "scale": h.scale(),
            },
            "roof": {
                "threads": self.roof.threads,
                "read_bytes_per_s": self.roof.read_bytes_per_s.to_json(),
                "fma_flops_per_s": self.roof.fma_flops_per_s.to_json(),
            },
            "decode": self.decode.iter().map(|r| {
                let mut v = pair(r, self.decode_roof_time(r), self.decode_bytes(r));
                v["kv_bytes"] = json!(self.decode_bytes(r));
                if let Some(share) = self.decode_share(r) {
                    v["kvjit"]["share_of_read_roof"] = share.to_json();
                    v["read_beside_bytes_per_s"] = Stats::from_samples(&r.read_rates).to_json();
                }
                v
            }).collect::<Vec<_>>(),
            "prefill": self.prefill.iter().map(|r| {
                let mut v = pair(r, self.prefill_roof_time(r), h.prefill_flops(r.tokens));
                v["flops"] = json!(h.prefill_flops(r.tokens));
                v
            }).collect::<Vec<_>>(),
            "rope": self.rope.iter().map(|r| json!({
                "step": r.step, "batch": r.batch, "seq": r.seq, "bytes": r.bytes,
                "time": r.time.to_json(), "step_median_s": r.step_median,
                "share": r.step_median.map(|t| r.time.median / t),
            })).collect::<Vec<_>>(),
            "step": self.step.as_ref().map(|st| json!({
                "batch": st.batch,
                "history": st.history,
                "time": st.time.to_json(),
                "per_token_s": st.time.median / st.batch as f64,
                "ops": st.ops.iter().map(|o| json!({
                    "op": o.op, "median_s": o.median, "roof_bytes": o.roof_bytes, "flops": o.flops,
                    "avx2": o.avx2, "roof_time_s": self.op_roof_time(o),
                })).collect::<Vec<_>>(),
                "roof_time_s": self.step_roof_time(st),
                "of_roofs": st.time.median / self.step_roof_time(st),
                "prefill": st.prefill.as_ref().map(|(seq, t)| json!({ "seq": seq, "time": t.to_json() })),
            })),
            "targets": self.targets().iter().map(|t| json!({
                "what": t.what, "value": t.value, "goal": t.goal, "met": t.met,
            })).collect::<Vec<_>>(),
            "errors": self.failures(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use kvjit::attention::{AttentionConfig as MhaConfig, Mask};

    /// The peer computes what the f64 reference computes: decode with
    /// history and a causal prefill, GQA groups, both dtypes.
    #[test]
    fn peer_agrees_with_the_reference() {
        let heads = Heads { num_heads: 6, num_kv_heads: 2, head_size: 8, page_size: 4 };
        let ctx = DeviceContextPtr::cpu(2).unwrap();
        let mut rng = SmallRng::seed_from_u64(5);
        for dtype in [DType::F32, DType::BF16] {
            for (batch, history, seq) in [(3, 13, 1), (1, 0, 9), (2, 5, 3)] {
                let cache = make_cache(&heads, dtype, 2, StepShape { batch, history, new_tokens: seq }, true, &mut rng)
                    .unwrap();
                let q = Tensor::random(dtype, &[batch, seq, 6, 8], &mut rng, -1.0, 1.0).unwrap();
                let valid = Tensor::from_vec(&[batch], vec![seq as u32; batch]).unwrap();
                let layer = Tensor::scalar_u32(1);
                let config = MhaConfig { mask: Mask::Causal, window: None, scale: heads.scale() };
                let mut want = Tensor::zeros(dtype, q.shape()).unwrap();
                kvjit::attention::reference::mha(&q, &cache, &layer, &valid, &config, &mut want).unwrap();
                let mut got = Tensor::zeros(dtype, q.shape()).unwrap();
                let mut peer = GatherGemmPeer::new(heads, 2);
                peer.run(&q, &cache, 1, &vec![seq as u32; batch], &mut got, &ctx).unwrap();
                let err = normalized_error(&got.to_f32_vec().unwrap(), &want.to_f32_vec().unwrap());
                assert!(err <= tolerance(dtype) / 4.0, "{dtype} b{batch} h{history} s{seq}: {err}");
            }
        }
    }

    #[test]
    fn tiny_run_reports_every_figure() {
        let started = Instant::now();
        let report = run_attention(&AttentionBenchConfig::tiny(), &mut |_| {}).unwrap();
        assert!(report.failures().is_empty(), "{:?}", report.failures());
        assert_eq!(report.decode.len(), 8);
        assert_eq!(report.prefill.len(), 1);
        assert_eq!(report.rope.len(), 2);
        let step = report.step.as_ref().unwrap();
        let ops: Vec<&str> = step.ops.iter().map(|o| o.op.as_str()).collect();
        for op in [QKV_KERNEL_NAME, kvjit::rope::KERNEL_NAME, kvjit::attention::KERNEL_NAME] {
            assert!(ops.contains(&op), "{ops:?}");
        }
        // Each op's roof is the roofline: never below its read or its FMA
        // time; the matmul and attention count FLOPs, RoPE none.
        let fma = report.roof.fma_flops_per_s.median.max(report.roof.fma256_flops_per_s.map_or(0.0, |f| f.median));
        for o in &step.ops {
            let roof = report.op_roof_time(o);
            assert!(roof >= o.roof_bytes / report.roof.read_bytes_per_s.median, "{o:?}");
            assert!(roof >= o.flops / fma, "{o:?}");
            assert_eq!(o.flops > 0.0, o.op != kvjit::rope::KERNEL_NAME && o.op != "reshape", "{o:?}");
        }
        let sum: f64 = step.ops.iter().map(|o| report.op_roof_time(o)).sum();
        assert_eq!(report.step_roof_time(step), sum);
        // Decode shares are paired: a probe rate per kernel sample, each
        // round's ratio positive; prefill has none.
        for r in &report.decode {
            let (jit, _) = r.outcome.as_ref().unwrap();
            assert_eq!(r.read_rates.len(), jit.samples.len(), "{r:?}");
            let share = report.decode_share(r).expect("a paired share");
            assert_eq!(share.samples, jit.samples.len());
            assert!(share.min > 0.0 && share.max.is_finite(), "{share:?}");
        }
        assert!(report.prefill.iter().all(|r| r.read_rates.is_empty() && report.decode_share(r).is_none()));
        let markdown = report.to_markdown();
        assert!(markdown.contains("## Decode (S = 1)") && markdown.contains("## Targets"), "{markdown}");
        assert!(!markdown.contains("## Errors") && !markdown.contains("**error**"), "{markdown}");
        let json = report.to_json();
        assert_eq!(json["decode"].as_array().unwrap().len(), 8);
        assert!(json["decode"][0]["speedup_vs_peer"].as_f64().unwrap() > 0.0);
        assert!(started.elapsed() < Duration::from_secs(20), "tiny took {:?}", started.elapsed());
    }

    /// One batch-1 decode call of the op, 2 threads, K/V from DRAM (the
    /// calls cycle through ~300 MB of layers): medians of 20 samples of
    /// 300 calls. `SHAPE=llama` for Llama-3-8B's heads (else SmolLM2's: 9
    /// query / 3 KV heads of 64), `CONTEXT` (default 128), `DTYPE` (bf16,
    /// f32 or f8e4m3), `THREADS` (default 2). What `MIN_ITEMS` and the
    /// decode launch were chosen with.
    #[test]
    #[ignore = "a timing, not a test"]
    fn decode_call_timing() {
        let var = |name: &str| std::env::var(name).ok();
        let heads = match var("SHAPE").as_deref() {
            Some("llama") => Heads::llama3_8b(),
            _ => Heads { num_heads: 9, num_kv_heads: 3, head_size: 64, page_size: 16 },
        };
        let context: usize = var("CONTEXT").map_or(128, |v| v.parse().expect("CONTEXT: a number"));
        let threads: usize = var("THREADS").map_or(2, |v| v.parse().expect("THREADS: a number"));
        let dtype: DType = var("DTYPE").map_or(DType::BF16, |v| v.parse().expect("DTYPE: a cache dtype"));
        let ctx = DeviceContextPtr::cpu(threads).unwrap();
        let mut rng = SmallRng::seed_from_u64(5);
        let layers = ((300usize << 20) as f64 / heads.kv_bytes(context, dtype)).ceil() as usize;
        let step = StepShape { batch: 1, history: context - 1, new_tokens: 1 };
        let mut cache = make_cache(&heads, dtype, layers, step, true, &mut rng).unwrap();
        // An FP8 cache's queries and output are bf16 (as in `--ops fp8`).
        let q_dtype = if dtype.is_quantized() { DType::BF16 } else { dtype };
        let spec = kvjit::attention::MhaSpec { dtype: q_dtype, ..heads.spec(dtype, layers, 1, 1) };
        let kernel = mha_kernel(spec, CaptureText::default()).unwrap();
        let q = Tensor::random(q_dtype, &[1, 1, heads.num_heads, heads.head_size], &mut rng, -1.0, 1.0).unwrap();
        let valid = Tensor::from_vec(&[1], vec![1u32]).unwrap();
        let layer_tensors: Vec<Tensor> = (0..layers as u32).map(Tensor::scalar_u32).collect();
        let mut out = Tensor::zeros(q_dtype, q.shape()).unwrap();
        let mut samples = Vec::new();
        for sample in 0..20 {
            let start = Instant::now();
            for call in 0..300 {
                let layer = &layer_tensors[(sample * 300 + call) % layers];
                kernel.kernel().run_into(&[&q, layer, &valid], &mut [&mut cache], out.as_bytes_mut(), &ctx).unwrap();
            }
            samples.push(start.elapsed().as_secs_f64() / 300.0);
        }
        samples.sort_by(f64::total_cmp);
        println!(
            "{} KV heads of {}, {dtype}, context {context}, {threads} threads, {layers} layers: median {:.2} µs (min {:.2})",
            heads.num_kv_heads,
            heads.head_size,
            samples[10] * 1e6,
            samples[0] * 1e6
        );
    }

    #[test]
    fn presets_are_valid() {
        for config in [AttentionBenchConfig::full(), AttentionBenchConfig::quick(), AttentionBenchConfig::tiny()] {
            config.check().unwrap();
        }
        let h = Heads::llama3_8b();
        assert_eq!(h.kv_bytes(2048, DType::BF16), (2048 * 2 * 8 * 128 * 2) as f64);
        assert_eq!(h.prefill_flops(2), 2.0 * 2.0 * 4096.0 * 3.0);
    }
}
