//! `kvjit bench --ops fp8`: what an FP8 (`f8e4m3`, g = 128) KV cache costs
//! and buys against a bf16 cache, every pair measured side by side in one
//! run (interleaved samples):
//!
//! - **store**: the fused QKV kernel (Llama-3-8B shape, bf16 activations and
//!   weights) writing a bf16 cache vs quantizing into an FP8 cache, M rows;
//! - **decode attention**: the paged attention kernel reading a bf16 vs an
//!   FP8 cache at each context, with the K/V bytes each call reads (scales
//!   included) and the working set cycled through layers larger than the
//!   last-level cache;
//! - **step**: the whole attention-step graph (fused QKV → RoPE →
//!   attention → output projection), one decode token per sequence;
//! - **bytes per token**: what one token's K and V take in each cache.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use kvjit::attention::jit_kernel as mha_kernel;
use kvjit::fused_qkv::{FusedQkvSpec, JitKernel as QkvKernel, QkvArgs, Sizes};
use kvjit::models::llama::LlamaConfig;
use kvjit_core::{Backend, CacheElement, DType, KernelSpec, KvCacheParams, Tensor};
use kvjit_jit::CaptureText;
use kvjit_op::checks::StepDims;
use kvjit_runtime::{DeviceContextPtr, Executor};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::problem::ModelShape;
use crate::timing::{Plan, Stats, measure_interleaved};
use crate::workload::{
    FP8_GRANULARITY, Heads, StepShape, cache_params, check_finite, compile_step, make_cache, size_step_cache,
    step_inputs,
};
use crate::{BenchError, Progress, Result, Steps};
/// The decode-attention target: FP8 at least this much faster than bf16.
pub const ATTENTION_TARGET: f64 = 1.6;
/// The store target: the FP8 store at most this much slower (M ≥ 16).
pub const STORE_TARGET: f64 = 1.10;
/// The cache-size target: FP8 bytes per token at most this share of bf16's.
pub const BYTES_TARGET: f64 = 0.52;

/// What `kvjit bench --ops fp8` measures.
#[derive(Clone, Debug)]
pub struct Fp8BenchConfig {
    /// Name of the preset.
    pub mode: String,
    /// Shape of the fused QKV runs.
    pub shape: ModelShape,
    /// Rows M of the store runs.
    pub ms: Vec<usize>,
    /// The attention heads.
    pub heads: Heads,
    /// Decode contexts.
    pub contexts: Vec<usize>,
    /// Decode batch.
    pub batch: usize,
    /// Bytes of bf16 K/V each decode pair cycles through (layers).
    pub working_set: usize,
    /// Worker threads.
    pub threads: usize,
    /// Timing of each pair.
    pub timing: Plan,
    /// The step graph: decode batch and history, if run.
    pub step: Option<(usize, usize)>,
}

impl Fp8BenchConfig {
    /// The full comparison (a few minutes on 2 cores).
    pub fn full() -> Self {
        Self {
            mode: "full".into(),
            shape: ModelShape::llama3_8b(),
            ms: vec![1, 16, 64, 256],
            heads: Heads::llama3_8b(),
            contexts: vec![2048, 8192],
            batch: 1,
            working_set: 256 << 20,
            threads: 2,
            timing: Plan {
                min_samples: 7,
                max_samples: 21,
                sample_time: Duration::from_millis(40),
                budget: Duration::from_secs(3),
            },
            step: Some((8, 2048)),
        }
    }

    /// Fewer samples.
    pub fn quick() -> Self {
        Self {
            mode: "quick".into(),
            timing: Plan {
                min_samples: 5,
                max_samples: 11,
                sample_time: Duration::from_millis(30),
                budget: Duration::from_secs(1),
            },
            ..Self::full()
        }
    }

    /// Toy sizes, to test the plumbing (the numbers mean nothing).
    pub fn tiny() -> Self {
        Self {
            mode: "tiny".into(),
            shape: ModelShape::parse("256/4/2/128").expect("a valid shape"),
            ms: vec![1, 16],
            heads: Heads { num_heads: 4, num_kv_heads: 2, head_size: 128, page_size: 4 },
            contexts: vec![40],
            batch: 2,
            working_set: 1 << 20,
            threads: 2,
            timing: Plan { min_samples: 2, max_samples: 3, sample_time: Duration::ZERO, budget: Duration::ZERO },
            step: Some((2, 20)),
        }
    }

    /// Steps the progress callback counts: the store runs, the decode
    /// contexts and the step graph.
    pub fn step_count(&self) -> usize {
        self.ms.len() + self.contexts.len() + usize::from(self.step.is_some())
    }
}

/// One pair of medians and spreads: bf16 cache, FP8 cache.
#[derive(Clone, Debug)]
pub struct Pair {
    /// With the bf16 cache.
    pub bf16: Stats,
    /// With the FP8 cache.
    pub fp8: Stats,
}

impl Pair {
    /// bf16 time over FP8 time (> 1: FP8 faster).
    pub fn speedup(&self) -> f64 {
        self.bf16.median / self.fp8.median
    }
}

/// A store run.
#[derive(Clone, Debug)]
pub struct StoreResult {
    /// Rows.
    pub m: usize,
    /// Times per call.
    pub time: Pair,
}

/// A decode-attention run.
#[derive(Clone, Debug)]
pub struct AttentionResult {
    /// Tokens each query attends to.
    pub context: usize,
    /// Sequences.
    pub batch: usize,
    /// Layers cycled through.
    pub layers: usize,
    /// K/V bytes one call reads, bf16 cache.
    pub bf16_bytes: f64,
    /// K/V bytes one call reads, FP8 cache (scales included).
    pub fp8_bytes: f64,
    /// Largest |FP8 output − bf16 output| over max |bf16 output| (the two
    /// caches hold the same values, the FP8 one quantized).
    pub error: f64,
    /// Times per call.
    pub time: Pair,
}

/// The report of `kvjit bench --ops fp8`.
#[derive(Clone, Debug)]
pub struct Fp8Report {
    /// The preset.
    pub mode: String,
    /// Worker threads.
    pub threads: usize,
    /// K and V bytes of one token and layer: bf16, FP8 with scales.
    pub bytes_per_token: (usize, usize),
    /// Store runs.
    pub store: Vec<StoreResult>,
    /// Decode-attention runs.
    pub attention: Vec<AttentionResult>,
    /// The step graph per decode step: (batch, history, times).
    pub step: Option<(usize, usize, Pair)>,
}

fn store_pair(
    config: &Fp8BenchConfig,
    m: usize,
    weight: &Arc<Tensor>,
    ctx: &DeviceContextPtr,
    rng: &mut SmallRng,
) -> Result<StoreResult> {
    let shape = &config.shape;
    let heads =
        Heads { num_heads: shape.q_heads, num_kv_heads: shape.kv_heads, head_size: shape.head_size, page_size: 16 };
    let hidden = Tensor::random(DType::BF16, &[1, m, shape.k], rng, -1.0, 1.0)?;
    let layer = Tensor::scalar_u32(0);
    let valid = Tensor::from_vec(&[1], vec![m as u32])?;
    let mut kernels = Vec::new();
    let mut caches = Vec::new();
    for dtype in [DType::BF16, DType::F8E4M3] {
        let spec = FusedQkvSpec {
            backend: Backend::Cpu(crate::problem::widest_tier()),
            dtype: DType::BF16,
            weights: DType::BF16,
            cache: KvCacheParams {
                element: CacheElement::new(
                    dtype,
                    dtype.is_quantized().then_some(FP8_GRANULARITY.min(heads.head_size)),
                )?,
                num_layers: 1,
                page_size: heads.page_size,
                num_kv_heads: shape.kv_heads,
                head_size: shape.head_size,
            },
            k: shape.k,
            q_dim: shape.q_dim(),
            step: StepDims { batch: Some(1), seq: Some(m) },
            sizes: Sizes::Baked,
        };
        let kernel = QkvKernel::new(spec, Some(weight.clone()), CaptureText::default())
            .map_err(|source| BenchError::Compile { key: spec.key().to_string(), source })?;
        kernels.push(kernel);
        caches.push(make_cache(&heads, dtype, 1, StepShape { batch: 1, history: 0, new_tokens: m }, false, rng)?);
    }
    let mut outputs = vec![vec![0u8; m * shape.q_dim() * 2]; 2];
    let measured = measure_interleaved(2, &config.timing, |i| {
        let args = QkvArgs {
            hidden_state: &hidden,
            weight,
            kv_collection: &mut caches[i],
            layer_idx: &layer,
            valid_lengths: &valid,
        };
        Ok(kernels[i].run_into(args, &mut outputs[i], ctx)?)
    })?;
    if outputs[0] != outputs[1] {
        return Err(BenchError::OutputsDiffer { m });
    }
    Ok(StoreResult { m, time: Pair { bf16: measured[0].time, fp8: measured[1].time } })
}

fn attention_pair(
    config: &Fp8BenchConfig,
    context: usize,
    ctx: &DeviceContextPtr,
    rng: &mut SmallRng,
) -> Result<AttentionResult> {
    let heads = &config.heads;
    let batch = config.batch;
    let bf16_bytes = batch as f64 * heads.kv_bytes(context, DType::BF16);
    let layers = ((config.working_set as f64 / bf16_bytes).ceil() as usize).max(1);
    // The same K/V in both caches: random bf16 values, and those values
    // quantized per g-block into the FP8 cache.
    let mut bf16 =
        make_cache(heads, DType::BF16, layers, StepShape { batch, history: context - 1, new_tokens: 1 }, true, rng)?;
    let mut fp8 =
        make_cache(heads, DType::F8E4M3, layers, StepShape { batch, history: context - 1, new_tokens: 1 }, false, rng)?;
    let g = fp8.params().scale_granularity().expect("an FP8 cache has a granularity");
    fp8.lookup_table_mut().copy_from_slice(bf16.lookup_table());
    {
        let values = bf16.blocks().to_f32_vec()?;
        let (codes, scales) = fp8.blocks_and_scales_mut();
        let scales = scales.expect("an FP8 cache has scales");
        for ((block, codes), scale) in values.chunks_exact(g).zip(codes.chunks_exact_mut(g)).zip(scales) {
            *scale = kvjit_core::fp8::quantize_block(block, codes);
        }
    }
    let q = Tensor::random(DType::BF16, &[batch, 1, heads.num_heads, heads.head_size], rng, -1.0, 1.0)?;
    let valid = Tensor::from_vec(&[batch], vec![1u32; batch])?;
    let layer_tensors: Vec<Tensor> = (0..layers as u32).map(Tensor::scalar_u32).collect();
    let mut kernels = Vec::new();
    for dtype in [DType::BF16, DType::F8E4M3] {
        let mut spec = heads.spec(DType::BF16, layers, batch, 1);
        spec.cache.element = CacheElement::new(dtype, dtype.is_quantized().then_some(g))?;
        let key = spec.key().to_string();
        kernels.push(mha_kernel(spec, CaptureText::default()).map_err(|source| BenchError::Compile { key, source })?);
    }
    let fp8_bytes = (batch * context * fp8.params().bytes_per_token()) as f64;
    let mut caches = [&mut bf16, &mut fp8];
    let mut outputs = [Tensor::zeros(DType::BF16, q.shape())?, Tensor::zeros(DType::BF16, q.shape())?];
    for i in 0..2 {
        kernels[i].kernel().run_into(
            &[&q, &layer_tensors[0], &valid],
            &mut [&mut *caches[i]],
            outputs[i].as_bytes_mut(),
            ctx,
        )?;
    }
    let (want, got) = (outputs[0].to_f32_vec()?, outputs[1].to_f32_vec()?);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let error = want.iter().zip(&got).fold(0f64, |m, (a, b)| m.max(f64::from((a - b).abs() / scale)));
    let mut next = [0usize; 2];
    let measured = measure_interleaved(2, &config.timing, |i| {
        let l = next[i] % layers;
        next[i] = l + 1;
        let tensors = [&q, &layer_tensors[l], &valid];
        Ok(kernels[i].kernel().run_into(&tensors, &mut [&mut *caches[i]], outputs[i].as_bytes_mut(), ctx)?)
    })?;
    Ok(AttentionResult {
        context,
        batch,
        layers,
        bf16_bytes,
        fp8_bytes,
        error,
        time: Pair { bf16: measured[0].time, fp8: measured[1].time },
    })
}

fn step_pair(batch: usize, history: usize, ctx: &DeviceContextPtr, rng: &mut SmallRng, plan: &Plan) -> Result<Pair> {
    let mut graphs = Vec::new();
    for cache_dtype in [None, Some(DType::F8E4M3)] {
        let mut config = LlamaConfig::llama3_8b();
        size_step_cache(&mut config.layer, batch, history);
        config.layer.cache_dtype = cache_dtype;
        let exe = compile_step(&config)?;
        let (inputs, caches) = step_inputs(&config.layer, batch, history, 1, rng)?;
        graphs.push((exe, inputs, caches));
    }
    let executor = Executor::new(ctx.clone());
    for (exe, inputs, caches) in &mut graphs {
        check_finite(executor.run(exe, inputs, caches)?.outputs.values())?;
    }
    let measured = measure_interleaved(2, plan, |i| {
        let (exe, inputs, caches) = &mut graphs[i];
        executor.run(exe, inputs, caches).map(|_| ()).map_err(Into::into)
    })?;
    Ok(Pair { bf16: measured[0].time, fp8: measured[1].time })
}

/// Run the comparison, calling `progress` before every step.
pub fn run_fp8(config: &Fp8BenchConfig, progress: &mut dyn FnMut(&Progress)) -> Result<Fp8Report> {
    let mut steps = Steps::new(config.step_count(), progress);
    let ctx = DeviceContextPtr::cpu(config.threads)?;
    let mut rng = SmallRng::seed_from_u64(14);
    let shape = &config.shape;
    let weight = Arc::new(Tensor::random(DType::BF16, &[shape.n(), shape.k], &mut rng, -0.05, 0.05)?);
    let mut store = Vec::new();
    for &m in &config.ms {
        steps.start(format!("fused QKV store, M = {m}"));
        store.push(store_pair(config, m, &weight, &ctx, &mut rng)?);
    }
    drop(weight);
    let mut attention = Vec::new();
    for &context in &config.contexts {
        steps.start(format!("decode attention, context {context}"));
        attention.push(attention_pair(config, context, &ctx, &mut rng)?);
    }
    let step = match config.step {
        Some((batch, history)) => {
            steps.start(format!("attention step graph, batch {batch}, history {history}"));
            let plan = Plan { budget: config.timing.budget * 2, ..config.timing };
            Some((batch, history, step_pair(batch, history, &ctx, &mut rng, &plan)?))
        }
        None => None,
    };
    let bytes = |dtype| cache_params(&config.heads, dtype, 1).bytes_per_token();
    Ok(Fp8Report {
        mode: config.mode.clone(),
        threads: config.threads,
        bytes_per_token: (bytes(DType::BF16), bytes(DType::F8E4M3)),
        store,
        attention,
        step,
    })
}

fn ms(seconds: f64) -> String {
    if seconds >= 1e-3 { format!("{:.2} ms", seconds * 1e3) } else { format!("{:.1} µs", seconds * 1e6) }
}

fn spread(s: &Stats) -> String {
    format!("{} ({}–{})", ms(s.median), ms(s.q1), ms(s.q3))
}

impl Fp8Report {
    /// The report as Markdown.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# kvjit bench --ops fp8 ({}, {} threads)\n", self.mode, self.threads);
        let _ = writeln!(out, "Medians with quartiles; each pair measured interleaved in this run.\n");
        let (bf16, fp8) = self.bytes_per_token;
        let ratio = fp8 as f64 / bf16 as f64;
        let _ = writeln!(
            out,
            "Cache bytes per token and layer (K and V, Llama-3-8B heads): bf16 {bf16}, f8e4m3 g={FP8_GRANULARITY} {fp8} (scales included) = {ratio:.4}× (target ≤ {BYTES_TARGET}: {})\n",
            verdict(ratio <= BYTES_TARGET)
        );
        let _ = writeln!(out, "## Fused QKV store (bf16 activations)\n");
        let _ = writeln!(out, "| M | bf16 cache | f8e4m3 cache | FP8 / bf16 | target (M ≥ 16: ≤ {STORE_TARGET}) |");
        let _ = writeln!(out, "| ---: | ---: | ---: | ---: | --- |");
        for r in &self.store {
            let cost = r.time.fp8.median / r.time.bf16.median;
            let target = if r.m >= 16 { verdict(cost <= STORE_TARGET) } else { "—" };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {cost:.3} | {target} |",
                r.m,
                spread(&r.time.bf16),
                spread(&r.time.fp8)
            );
        }
        let _ = writeln!(out, "\n## Decode attention (bf16 queries)\n");
        let _ = writeln!(
            out,
            "| context | batch | layers | bf16 cache | f8e4m3 cache | speedup (target ≥ {ATTENTION_TARGET}) | bytes read bf16 / FP8 | FP8 output error |"
        );
        let _ = writeln!(out, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for r in &self.attention {
            let speedup = r.time.speedup();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {speedup:.2}× {} | {:.2} / {:.2} MB | {:.2e} |",
                r.context,
                r.batch,
                r.layers,
                spread(&r.time.bf16),
                spread(&r.time.fp8),
                verdict(speedup >= ATTENTION_TARGET),
                r.bf16_bytes / 1e6,
                r.fp8_bytes / 1e6,
                r.error
            );
        }
        if let Some((batch, history, time)) = &self.step {
            let _ = writeln!(out, "\n## Attention-step graph, one decode token per sequence\n");
            let _ = writeln!(out, "| batch | history | bf16 cache | f8e4m3 cache | speedup | per token bf16 / FP8 |");
            let _ = writeln!(out, "| ---: | ---: | ---: | ---: | ---: | ---: |");
            let _ = writeln!(
                out,
                "| {batch} | {history} | {} | {} | {:.2}× | {} / {} |",
                spread(&time.bf16),
                spread(&time.fp8),
                time.speedup(),
                ms(time.bf16.median / *batch as f64),
                ms(time.fp8.median / *batch as f64)
            );
        }
        out
    }

    /// Every figure as JSON.
    pub fn to_json(&self) -> Value {
        let pair = |p: &Pair| json!({"bf16": p.bf16.to_json(), "f8e4m3": p.fp8.to_json()});
        json!({
            "mode": self.mode,
            "threads": self.threads,
            "granularity": FP8_GRANULARITY,
            "bytes_per_token": {"bf16": self.bytes_per_token.0, "f8e4m3": self.bytes_per_token.1},
            "store": self.store.iter().map(|r| json!({"m": r.m, "time": pair(&r.time)})).collect::<Vec<_>>(),
            "attention": self.attention.iter().map(|r| json!({
                "context": r.context, "batch": r.batch, "layers": r.layers,
                "bytes": {"bf16": r.bf16_bytes, "f8e4m3": r.fp8_bytes},
                "error": r.error, "time": pair(&r.time),
            })).collect::<Vec<_>>(),
            "step": self.step.as_ref().map(|(batch, history, time)| json!({"batch": batch, "history": history, "time": pair(time)})),
        })
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**missed**" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_comparison_runs_every_pair_and_reports_the_cache_sizes() {
        let report = run_fp8(&Fp8BenchConfig::tiny(), &mut |_| {}).unwrap();
        assert_eq!(report.store.len(), 2);
        assert_eq!(report.attention.len(), 1);
        // D = 128, Hkv = 8, g = 128: bf16 2·8·128·2 bytes, FP8 2·8·(128 + 4).
        assert_eq!(report.bytes_per_token, (2 * 2 * 128 * 2, 2 * 2 * (128 + 4)));
        let r = &report.attention[0];
        assert!(r.fp8_bytes < 0.52 * r.bf16_bytes, "{} vs {}", r.fp8_bytes, r.bf16_bytes);
        // Quantizing K and V to 3 mantissa bits moves the output by a few
        // percent of its largest value at most.
        assert!(r.error > 0.0 && r.error < 0.1, "{}", r.error);
        let text = report.to_markdown();
        assert!(text.contains("f8e4m3 cache") && text.contains("Decode attention"), "{text}");
        assert!(report.to_json()["store"][1]["time"]["f8e4m3"]["median"].as_f64().unwrap() > 0.0);
    }
}
