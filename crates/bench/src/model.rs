//! `kvjit bench --ops model --gguf PATH`: a whole model from its GGUF file
//! (dequantized to bf16 and/or f32), compiled once, timed end to end.
//!
//! - prefill tokens/s for prompts of 128 and 512 tokens (random ids; the
//!   median of a few runs, each on a fresh cache);
//! - decode tokens/s at contexts 128 and 2048 (the cache filled by one
//!   prefill of that many tokens, then single-token steps timed);
//! - each decode step on the read roof: every weight byte its matmuls read
//!   (the LM head included) plus the K/V bytes at that context, over the
//!   measured read bandwidth ([`ReadProbe`]). The share
//!   of the roof is paired: after the timed steps, rounds of one read-probe
//!   sample, one step that refills the caches the probe flushed and one
//!   timed step, and the median of the rounds' ratios — so a spell of the
//!   shared machine that slows the memory slows both sides of a ratio (a
//!   roof measured at the start and the end put one step time at 77 % in
//!   one run and 90 % in the next);
//! - the executor's overhead per decode step: the step's wall time minus the
//!   sum of its kernels' times ([`RunOutput::timings`]), with the kernels
//!   per step, and where a decode step's time goes (per kind of step, and
//!   the slowest steps).
//!
//! The llama.cpp peer is optional and never built here: set
//! `KVJIT_LLAMA_CPP` to a `llama-bench` binary (run as `llama-bench -m GGUF
//! -t THREADS -p 128,512 -n 32 -o json`: its decode is at a short context),
//! or to `python:INTERPRETER` for an interpreter that imports the
//! `llama_cpp` module (a small script times the same prefill lengths, and
//! 32 decode steps after a prefill of each decode context). Without it the
//! report compares against the figures quoted in issue 23, measured by its
//! author on this host class with 2 threads, labelled "quoted, not measured
//! in this run".

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvjit::models::gguf::{ImportOptions, load_model};
use kvjit::{CompileOptions, Registry, compile, standard_registry};
use kvjit_core::{DType, KvCacheParams, PagedKVCacheCollection, Tensor, WeightLoad};
use kvjit_graph::Graph;
use kvjit_runtime::{DeviceContextPtr, Executable, Executor, RunOutput};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::render::{format_rate, format_time, pass_or_miss};
use crate::roofline::{ReadProbe, Roof, RoofPlan, RoofSamples};
use crate::timing::{Plan, Stats};
use crate::{BenchError, Progress, Result, Steps};

/// The environment variable naming the optional llama.cpp peer.
pub const LLAMA_CPP_ENV: &str = "KVJIT_LLAMA_CPP";

/// llama.cpp's figures quoted in issue 23 (2 threads, this host class):
/// prefill tokens/s (low, high) and decode tokens/s (low, high).
pub const QUOTED_LLAMA_CPP: Quoted = Quoted { prefill: (231.0, 297.0), decode: (80.0, 92.0) };

/// Targets: decode at least this share of the read roof; executor overhead
/// at most this share of a decode step; prefill at 512 tokens at least this
/// multiple of llama.cpp's.
pub const DECODE_ROOF_TARGET: f64 = 0.85;
/// See [`DECODE_ROOF_TARGET`].
pub const OVERHEAD_TARGET: f64 = 0.10;
/// See [`DECODE_ROOF_TARGET`].
pub const PREFILL_VS_LLAMA_TARGET: f64 = 1.5;
/// The quantized-weights issue's target: decode on the file's own blocks
/// at least this multiple of llama.cpp's, at each context.
pub const BLOCKS_DECODE_VS_LLAMA_TARGET: f64 = 1.5;

/// A peer's figures as quoted (ranges of tokens/s).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Quoted {
    /// Prefill tokens/s at 512 tokens, low and high.
    pub prefill: (f64, f64),
    /// Decode tokens/s, low and high.
    pub decode: (f64, f64),
}

/// What the model suite runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelBenchConfig {
    /// Name of the preset.
    pub mode: String,
    /// The GGUF file.
    pub gguf: PathBuf,
    /// Whether to run the file's block-format weights as stored (decoded by
    /// the kernels as they read; f32 activations), before the dtypes.
    pub blocks: bool,
    /// Dtypes the weights are dequantized to.
    pub dtypes: Vec<DType>,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Prompt lengths of the prefill runs.
    pub prefill_lens: Vec<usize>,
    /// Runs of each prefill (the median is reported), after one warm-up.
    pub prefill_runs: usize,
    /// Contexts of the decode runs.
    pub decode_contexts: Vec<usize>,
    /// Decode steps timed at each context, after two warm-up steps.
    pub decode_steps: usize,
    /// Cache page size.
    pub page_size: usize,
    /// Paired rounds (read probe, refill step, timed step) per decode
    /// context, for the share of the read roof.
    pub share_rounds: usize,
    /// Seed of the token ids.
    pub seed: u64,
    /// Roofline probes.
    pub roof: RoofPlan,
}

impl ModelBenchConfig {
    /// The whole suite: prefill 128 and 512 (5 runs), decode at 128 and
    /// 2048 (64 steps), bf16 and f32.
    pub fn full(gguf: PathBuf) -> Self {
        Self {
            mode: "full".into(),
            gguf,
            blocks: true,
            dtypes: vec![DType::BF16, DType::F32],
            threads: 2,
            prefill_lens: vec![128, 512],
            prefill_runs: 5,
            decode_contexts: vec![128, 2048],
            decode_steps: 64,
            page_size: 16,
            share_rounds: 16,
            seed: 7,
            roof: RoofPlan::full(),
        }
    }

    /// Fewer runs and steps: 3 prefill runs, 24 decode steps.
    pub fn quick(gguf: PathBuf) -> Self {
        let full = Self::full(gguf);
        Self {
            mode: "quick".into(),
            prefill_runs: 3,
            decode_steps: 24,
            share_rounds: 8,
            roof: RoofPlan {
                timing: Plan {
                    min_samples: 5,
                    max_samples: 10,
                    budget: Duration::from_millis(400),
                    ..full.roof.timing
                },
                ..full.roof
            },
            ..full
        }
    }

    /// Toy sizes for tests of the plumbing (the numbers mean nothing).
    pub fn tiny(gguf: PathBuf) -> Self {
        let short = Plan { min_samples: 2, max_samples: 3, sample_time: Duration::ZERO, budget: Duration::ZERO };
        Self {
            mode: "tiny".into(),
            blocks: false,
            dtypes: vec![DType::F32],
            prefill_lens: vec![8, 16],
            prefill_runs: 2,
            decode_contexts: vec![8, 32],
            decode_steps: 3,
            page_size: 4,
            share_rounds: 2,
            roof: RoofPlan { read_bytes: 1 << 20, fma_iterations: 1 << 10, timing: short },
            ..Self::full(gguf)
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
        for (what, zero) in [
            ("prefill lengths", self.prefill_lens.contains(&0) || self.prefill_lens.is_empty()),
            ("decode contexts", self.decode_contexts.contains(&0) || self.decode_contexts.is_empty()),
            ("prefill runs", self.prefill_runs == 0),
            ("decode steps", self.decode_steps == 0),
            ("paired rounds", self.share_rounds == 0),
            ("page size", self.page_size == 0),
        ] {
            if zero {
                return Err(BenchError::Zero { what });
            }
        }
        Ok(())
    }

    /// Tokens a sequence must hold: the longest prefill or decode context
    /// plus the warm-up, timed and paired decode steps, in whole pages.
    pub fn context(&self) -> usize {
        let longest = self.prefill_lens.iter().chain(&self.decode_contexts).copied().max().unwrap_or(1);
        (longest + self.decode_steps + DECODE_WARMUP + 2 * self.share_rounds).next_multiple_of(self.page_size)
    }

    fn step_count(&self) -> usize {
        2 + self.runs().len() * (1 + self.prefill_lens.len() + self.decode_contexts.len()) + 1
    }

    /// How the weights are held in each run, in order.
    pub fn runs(&self) -> Vec<WeightsAs> {
        let blocks = self.blocks.then_some(WeightsAs::Blocks);
        blocks.into_iter().chain(self.dtypes.iter().map(|&d| WeightsAs::Dequantized(d))).collect()
    }
}

/// How a run holds the model's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightsAs {
    /// The file's block formats as stored (f32 activations, a bf16 cache).
    Blocks,
    /// Dequantized to this dtype (activations in it too).
    Dequantized(DType),
}

impl WeightsAs {
    /// The import options of a run.
    fn options(self, context: usize, page_size: usize) -> ImportOptions {
        let (dtype, dequantize) = match self {
            WeightsAs::Blocks => (DType::F32, false),
            WeightsAs::Dequantized(dtype) => (dtype, true),
        };
        // The blocks run keeps a bf16 cache: the K/V bytes llama.cpp's
        // default f16 cache reads.
        let cache_dtype = matches!(self, WeightsAs::Blocks).then_some(DType::BF16);
        ImportOptions { dtype, dequantize, context, max_batch: 1, page_size, cache_dtype }
    }
}

impl std::fmt::Display for WeightsAs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightsAs::Blocks => f.write_str("blocks"),
            WeightsAs::Dequantized(dtype) => write!(f, "{dtype}"),
        }
    }
}

/// Untimed decode steps before the timed ones.
const DECODE_WARMUP: usize = 2;

/// A compiled model and the names of its inputs.
struct Compiled {
    exe: Executable,
    ids: String,
    valid: String,
    layer_idx: BTreeMap<String, u32>,
    cache: String,
    params: KvCacheParams,
    num_pages: usize,
    max_pages_per_seq: usize,
    /// Per step label, what it computes (the ops of its origin nodes).
    kinds: BTreeMap<String, String>,
}

impl Compiled {
    fn new(graph: &Graph, registry: &Registry) -> Result<Self> {
        let options = CompileOptions { fuse: true, ..CompileOptions::default() };
        let exe = compile(graph, registry, &options)?;
        let kinds = exe.steps().iter().map(|step| (step.label.clone(), step_kind(graph, &step.label))).collect();
        let mut layer_idx = BTreeMap::new();
        for (_, value) in graph.inputs() {
            let name = value.name.clone().unwrap_or_default();
            if name.ends_with("layer_idx") {
                let layer = name.strip_prefix("layers.").and_then(|r| r.split('.').next()).and_then(|l| l.parse().ok());
                layer_idx.insert(name, layer.unwrap_or(0));
            }
        }
        let (_, cache) = graph.kv_caches().next().ok_or(BenchError::NotFinite { what: "the model's KV cache" })?;
        let ty = cache.ty.as_kv_cache().expect("a cache value has a cache type");
        let (Some(num_pages), Some(max_pages_per_seq)) = (ty.num_pages.as_static(), ty.max_pages_per_seq.as_static())
        else {
            return Err(BenchError::Shape { what: "the model's cache", expected: "static pages", got: vec![] });
        };
        Ok(Self {
            exe,
            ids: kvjit::models::llama::TOKEN_IDS.into(),
            valid: "valid_lengths".into(),
            layer_idx,
            cache: cache.name.clone().unwrap_or_default(),
            params: ty.params(),
            num_pages,
            max_pages_per_seq,
            kinds,
        })
    }

    fn fresh_cache(&self) -> Result<BTreeMap<String, PagedKVCacheCollection>> {
        let cache = PagedKVCacheCollection::new(self.params, self.num_pages, 1, self.max_pages_per_seq)?;
        Ok(BTreeMap::from([(self.cache.clone(), cache)]))
    }

    /// One run of `ids` (one sequence), the cache reserved before and
    /// advanced after; returns the output and the executor's wall time.
    fn step(
        &self,
        executor: &Executor,
        caches: &mut BTreeMap<String, PagedKVCacheCollection>,
        ids: Vec<u32>,
    ) -> Result<(RunOutput, f64)> {
        let valid = [ids.len() as u32];
        let mut inputs = BTreeMap::from([
            (self.ids.clone(), Tensor::from_vec(&[1, ids.len()], ids)?),
            (self.valid.clone(), Tensor::from_vec(&[1], valid.to_vec())?),
        ]);
        for (name, &layer) in &self.layer_idx {
            inputs.insert(name.clone(), Tensor::scalar_u32(layer));
        }
        caches.get_mut(&self.cache).expect("the model's cache").reserve(&valid)?;
        let started = Instant::now();
        let out = executor.run(&self.exe, &inputs, caches)?;
        let wall = started.elapsed().as_secs_f64();
        caches.get_mut(&self.cache).expect("the model's cache").advance(&valid)?;
        Ok((out, wall))
    }

    fn kernels(&self) -> usize {
        self.exe.steps().iter().filter(|s| !s.kernel.is_view()).count()
    }
}

/// What the step labelled `label` (`n12`, or `n12+n13` for a fused
/// step) computes: its nodes' ops, each with the weight it reads
/// (`matmul(ffn_down)`), the layer prefix dropped.
fn step_kind(graph: &Graph, label: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    for id in label.split('+') {
        let Some(node) = id.strip_prefix('n').and_then(|i| i.parse::<usize>().ok()).and_then(|i| graph.nodes().get(i))
        else {
            return label.to_string();
        };
        let op = node.op.strip_prefix("mo.").unwrap_or(&node.op);
        let weights: Vec<String> = node
            .inputs
            .iter()
            .filter(|v| graph.constants().any(|(c, _)| c == **v))
            .filter_map(|v| graph.value(*v).name.clone())
            .filter(|n| !n.contains("freqs"))
            .map(|n| {
                let n = n.strip_suffix(".weight").unwrap_or(&n).to_string();
                match n.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
                    Some((_, rest)) => rest.to_string(),
                    None => n,
                }
            })
            .collect();
        let part = if weights.is_empty() { op.to_string() } else { format!("{op}({})", weights.join(",")) };
        if parts.last() != Some(&part) {
            parts.push(part);
        }
    }
    parts.join("+")
}

/// `mo.matmul` → `matmul`.
fn short_op(op: &str) -> &str {
    op.rsplit('.').next().unwrap_or(op)
}

/// Bytes of weights one decode step reads: every constant some node other
/// than a gather (the embedding rows) or RoPE (the table rows) reads.
fn weight_bytes(graph: &Graph) -> f64 {
    graph
        .constants()
        .filter(|(id, _)| {
            graph.nodes().iter().any(|n| {
                let op = short_op(&n.op);
                n.inputs.contains(id) && !op.contains("gather") && !op.contains("rope")
            })
        })
        .filter_map(|(_, v)| v.ty.as_tensor().and_then(|t| Some((t.dtype, t.static_shape()?))))
        .map(|(dtype, shape)| shape.iter().product::<usize>() as f64 * dtype.bytes_per_element())
        .sum()
}

/// One prefill length's figures.
#[derive(Clone, Debug)]
pub struct PrefillResult {
    /// Prompt tokens.
    pub tokens: usize,
    /// Seconds per prefill.
    pub time: Stats,
}

impl PrefillResult {
    /// Median tokens/s.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.time.median
    }
}

/// A step kind's or a single step's share of a decode step.
#[derive(Clone, Debug)]
pub struct StepShare {
    /// What (a kind of step, or a step label with its kind).
    pub what: String,
    /// Steps of it per decode step.
    pub count: usize,
    /// Median seconds per decode step.
    pub time: f64,
}

/// One decode context's figures.
#[derive(Clone, Debug)]
pub struct DecodeResult {
    /// Tokens in the cache before the timed steps.
    pub context: usize,
    /// Seconds per decode step (executor wall).
    pub time: Stats,
    /// Sum of the kernel times per step.
    pub kernel_time: Stats,
    /// Wall minus kernels, per step.
    pub overhead: Stats,
    /// Bytes a step reads: weights plus K/V at this context (the middle
    /// of the timed steps).
    pub bytes: f64,
    /// Per paired round, the share of the read roof: the bytes its timed
    /// step read at the round's probe rate, over the step's time.
    pub roof_shares: Vec<f64>,
    /// Per kind of step, largest first.
    pub kinds: Vec<StepShare>,
    /// The slowest single steps (at most 10).
    pub top: Vec<StepShare>,
}

impl DecodeResult {
    /// Median tokens/s.
    pub fn tokens_per_s(&self) -> f64 {
        1.0 / self.time.median
    }
    /// Seconds the step would take at the read roof.
    pub fn roof_time(&self, roof: &Roof) -> f64 {
        self.bytes / roof.read_bytes_per_s.median
    }
    /// Share of the read roof reached: the median of the paired rounds'
    /// (roof time at the round's probe rate / step time), with quartiles.
    pub fn roof_share(&self) -> Stats {
        Stats::from_samples(&self.roof_shares)
    }
    /// Overhead's share of the step.
    pub fn overhead_fraction(&self) -> f64 {
        self.overhead.median / self.time.median
    }
}

/// One run's results.
#[derive(Clone, Debug)]
pub struct DtypeResult {
    /// How the weights were held.
    pub dtype: WeightsAs,
    /// Seconds to load the graph from the GGUF.
    pub load_time: f64,
    /// Seconds to compile it.
    pub compile_time: f64,
    /// Weight bytes a decode step reads.
    pub weight_bytes: f64,
    /// K/V bytes per cached token (all layers).
    pub kv_bytes_per_token: f64,
    /// Kernels per step (views not counted) and steps in all.
    pub kernels: (usize, usize),
    /// Graph nodes before fusion.
    pub nodes: usize,
    /// Prefill results.
    pub prefill: Vec<PrefillResult>,
    /// Decode results.
    pub decode: Vec<DecodeResult>,
}

/// A peer's measured figures (tokens/s).
#[derive(Clone, Debug, Default)]
pub struct PeerResult {
    /// What ran.
    pub command: String,
    /// Prefill tokens/s by prompt length.
    pub prefill: BTreeMap<usize, f64>,
    /// Decode tokens/s by context (the Python peer: after a prefill of
    /// that many tokens), or at context 0 (llama-bench's `tg` test: a short
    /// context).
    pub decode: BTreeMap<usize, f64>,
}

impl PeerResult {
    /// Decode tokens/s at `context`, or at a short context where that is
    /// all the peer measured (and whether it was at `context`).
    pub fn decode_at(&self, context: usize) -> Option<(f64, bool)> {
        match self.decode.get(&context) {
            Some(&v) => Some((v, true)),
            None => self.decode.get(&0).map(|&v| (v, false)),
        }
    }
}

/// The llama.cpp peer: measured, or why not.
#[derive(Clone, Debug)]
pub enum Peer {
    /// `KVJIT_LLAMA_CPP` unset.
    NotInstalled,
    /// Set, but the run failed.
    Failed(String),
    /// Ran.
    Measured(PeerResult),
}

/// The model suite's results.
#[derive(Clone, Debug)]
pub struct ModelReport {
    /// The preset.
    pub mode: String,
    /// The GGUF file.
    pub gguf: PathBuf,
    /// Threads.
    pub threads: usize,
    /// CPU.
    pub cpu: String,
    /// Kernel code tier.
    pub tier: String,
    /// Whole run.
    pub duration: Duration,
    /// The measured roofs.
    pub roof: Roof,
    /// Per dtype.
    pub dtypes: Vec<DtypeResult>,
    /// llama.cpp.
    pub peer: Peer,
}

/// Run `config`, calling `progress` before every step.
pub fn run_model(config: &ModelBenchConfig, progress: &mut dyn FnMut(&Progress)) -> Result<ModelReport> {
    config.check()?;
    let ctx = DeviceContextPtr::cpu(config.threads)?;
    let threads = ctx.cpu_context().map_or(1, |c| c.threads());
    let mut steps = Steps::new(config.step_count(), progress);
    let mut rng = SmallRng::seed_from_u64(config.seed);
    let registry = standard_registry();
    let executor = Executor::new(ctx.clone());

    let mut roof_samples = RoofSamples::default();
    steps.start("roofline probes");
    roof_samples.measure(&ctx, &config.roof)?;
    // The paired rounds' probe: the roof probes' buffer size.
    let probe = ReadProbe::try_new(config.roof.read_bytes)?;

    let mut dtypes = Vec::new();
    for dtype in config.runs() {
        steps.start(format!("load and compile {} ({dtype})", config.gguf.display()));
        let options = dtype.options(config.context(), config.page_size);
        let started = Instant::now();
        let graph = load_model(&config.gguf, registry.ops(), &options, WeightLoad::Map)?;
        let load_time = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let model = Compiled::new(&graph, &registry)?;
        let compile_time = started.elapsed().as_secs_f64();
        let vocab = graph
            .nodes()
            .iter()
            .find(|n| short_op(&n.op).contains("gather"))
            .and_then(|n| graph.value(n.inputs[0]).ty.as_tensor()?.static_shape())
            .map_or(1, |s| s[0]) as u32;
        let mut ids = |n: usize| (0..n).map(|_| rng.gen_range(0..vocab)).collect::<Vec<u32>>();

        let mut prefill = Vec::new();
        for &tokens in &config.prefill_lens {
            steps.start(format!("{dtype} prefill {tokens}"));
            let mut times = Vec::new();
            for run in 0..=config.prefill_runs {
                let mut caches = model.fresh_cache()?;
                let (out, wall) = model.step(&executor, &mut caches, ids(tokens))?;
                check_finite(&out)?;
                if run > 0 {
                    times.push(wall);
                }
            }
            prefill.push(PrefillResult { tokens, time: Stats::from_samples(&times) });
        }

        let mut decode = Vec::new();
        for &context in &config.decode_contexts {
            steps.start(format!("{dtype} decode at context {context}"));
            let mut caches = model.fresh_cache()?;
            model.step(&executor, &mut caches, ids(context))?;
            let (mut walls, mut kernel_sums, mut overheads) = (Vec::new(), Vec::new(), Vec::new());
            let mut per_label: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            for step in 0..DECODE_WARMUP + config.decode_steps {
                let (out, wall) = model.step(&executor, &mut caches, vec![1])?;
                check_finite(&out)?;
                if step < DECODE_WARMUP {
                    continue;
                }
                let kernels: f64 = out.timings.iter().map(|t| t.elapsed.as_secs_f64()).sum();
                walls.push(wall);
                kernel_sums.push(kernels);
                overheads.push((wall - kernels).max(0.0));
                for t in &out.timings {
                    per_label.entry(model.exe.steps()[t.step].label.clone()).or_default().push(t.elapsed.as_secs_f64());
                }
            }
            let median = |v: &[f64]| Stats::from_samples(v).median;
            let mut by_kind: BTreeMap<String, (usize, f64)> = BTreeMap::new();
            let mut top = Vec::new();
            for (label, times) in &per_label {
                let kind = model.kinds.get(label).cloned().unwrap_or_else(|| "?".into());
                let t = median(times);
                let entry = by_kind.entry(kind.clone()).or_default();
                entry.0 += 1;
                entry.1 += t;
                top.push(StepShare { what: format!("{label} ({kind})"), count: 1, time: t });
            }
            let mut kinds: Vec<StepShare> =
                by_kind.into_iter().map(|(what, (count, time))| StepShare { what, count, time }).collect();
            kinds.sort_by(|a, b| b.time.total_cmp(&a.time));
            top.sort_by(|a, b| b.time.total_cmp(&a.time));
            top.truncate(10);
            let kv = (model.params.bytes_per_token() * model.params.num_layers) as f64;
            // Bytes a step reads with `cached` tokens in the cache.
            let bytes_at = |cached: usize| weight_bytes(&graph) + kv * cached as f64;
            // The paired rounds: a probe sample, a step that refills the
            // caches the probe flushed (a model that fits the last-level
            // cache is read from it in steady decode), then the timed step.
            let mut roof_shares = Vec::new();
            let mut cached = context + DECODE_WARMUP + config.decode_steps;
            for _ in 0..config.share_rounds {
                let started = Instant::now();
                std::hint::black_box(probe.run(&ctx)?);
                let rate = probe.bytes() as f64 / started.elapsed().as_secs_f64();
                for timed in [false, true] {
                    let (out, wall) = model.step(&executor, &mut caches, vec![1])?;
                    check_finite(&out)?;
                    cached += 1;
                    if timed {
                        roof_shares.push(bytes_at(cached) / rate / wall);
                    }
                }
            }
            decode.push(DecodeResult {
                context,
                time: Stats::from_samples(&walls),
                kernel_time: Stats::from_samples(&kernel_sums),
                overhead: Stats::from_samples(&overheads),
                bytes: bytes_at(context + DECODE_WARMUP + config.decode_steps / 2),
                roof_shares,
                kinds,
                top,
            });
        }
        dtypes.push(DtypeResult {
            dtype,
            load_time,
            compile_time,
            weight_bytes: weight_bytes(&graph),
            kv_bytes_per_token: (model.params.bytes_per_token() * model.params.num_layers) as f64,
            kernels: (model.kernels(), model.exe.steps().len()),
            nodes: graph.nodes().len(),
            prefill,
            decode,
        });
    }

    steps.start("roofline probes (again)");
    roof_samples.measure(&ctx, &config.roof)?;
    steps.start("llama.cpp peer");
    let peer = run_peer(&config.gguf, threads, &config.prefill_lens, &config.decode_contexts);
    Ok(ModelReport {
        mode: config.mode.clone(),
        gguf: config.gguf.clone(),
        threads,
        cpu: crate::cpu_name(),
        tier: format!("{:?}", kvjit::widest_cpu_tier()),
        duration: steps.elapsed(),
        roof: roof_samples.roof(threads),
        dtypes,
        peer,
    })
}

fn check_finite(out: &RunOutput) -> Result<()> {
    let logits = &out.outputs[kvjit::models::llama::LOGITS];
    if logits.to_f32_vec()?.iter().any(|v| !v.is_finite()) {
        return Err(BenchError::NotFinite { what: "the model's logits" });
    }
    Ok(())
}

/// The optional llama.cpp peer named by [`LLAMA_CPP_ENV`].
fn run_peer(gguf: &Path, threads: usize, prefill_lens: &[usize], contexts: &[usize]) -> Peer {
    let Some(value) = std::env::var_os(LLAMA_CPP_ENV).filter(|v| !v.is_empty()) else {
        return Peer::NotInstalled;
    };
    let value = value.to_string_lossy().into_owned();
    match peer_command(&value, gguf, threads, prefill_lens, contexts) {
        Ok(result) => Peer::Measured(result),
        Err(e) => Peer::Failed(e),
    }
}

/// The Python peer's script: argv = gguf, threads, prefill lengths,
/// decode contexts (comma-separated); prints JSON. Decode at context c: a
/// prefill of c random tokens, then 32 single-token steps timed.
const PY_PEER: &str = r#"
import json, random, sys, time
from llama_cpp import Llama
lens = [int(n) for n in sys.argv[3].split(",") if n]
contexts = [int(n) for n in sys.argv[4].split(",") if n]
m = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=max(lens + contexts) + 64, n_batch=512, verbose=False)
out = {"prefill": {}, "decode": {}}
for n in lens:
    ts = []
    for _ in range(4):
        m.reset()
        ids = [random.randrange(m.n_vocab()) for _ in range(n)]
        t = time.perf_counter(); m.eval(ids); ts.append(time.perf_counter() - t)
    out["prefill"][n] = n / sorted(ts[1:])[1]
for c in contexts:
    m.reset(); m.eval([random.randrange(m.n_vocab()) for _ in range(c)])
    m.eval([1]); m.eval([1])
    t = time.perf_counter()
    for _ in range(32):
        m.eval([1])
    out["decode"][c] = 32 / (time.perf_counter() - t)
print(json.dumps(out))
"#;

fn peer_command(
    value: &str,
    gguf: &Path,
    threads: usize,
    prefill_lens: &[usize],
    contexts: &[usize],
) -> std::result::Result<PeerResult, String> {
    let gguf_s = gguf.to_string_lossy().into_owned();
    let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let (program, args): (String, Vec<String>) = match value.strip_prefix("python:") {
        Some(python) => (
            python.into(),
            vec!["-c".into(), PY_PEER.into(), gguf_s, threads.to_string(), list(prefill_lens), list(contexts)],
        ),
        None => (
            value.into(),
            ["-m", &gguf_s, "-t", &threads.to_string(), "-p", "128,512", "-n", "32", "-o", "json"]
                .map(String::from)
                .to_vec(),
        ),
    };
    let command =
        format!("{program} {}", if value.starts_with("python:") { "-c <script>" } else { "llama-bench args" });
    let out = std::process::Command::new(&program).args(&args).output().map_err(|e| format!("{command}: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{command} failed ({}): {}", out.status, stderr.lines().last().unwrap_or("")));
    }
    parse_peer_output(command, &String::from_utf8_lossy(&out.stdout))
}

/// A peer's figures from its JSON output: llama-bench's rows (`n_prompt`,
/// `n_gen`, `avg_ts`; its `tg` test is decode at a short context, kept as
/// context 0) or the Python script's `{"prefill": {len: tok/s}, "decode":
/// {context: tok/s}}`.
fn parse_peer_output(command: String, text: &str) -> std::result::Result<PeerResult, String> {
    let json: Value = serde_json::from_str(text.trim()).map_err(|e| format!("{command}: output is not JSON: {e}"))?;
    let mut result = PeerResult { command, ..PeerResult::default() };
    if let Some(rows) = json.as_array() {
        // llama-bench: one row per test, `n_prompt`, `n_gen`, `avg_ts`.
        for row in rows {
            let get = |k: &str| row.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            match (get("n_prompt") as usize, get("n_gen") as usize) {
                (p, 0) if p > 0 => drop(result.prefill.insert(p, get("avg_ts"))),
                (0, g) if g > 0 => drop(result.decode.insert(0, get("avg_ts"))),
                _ => {}
            }
        }
    } else {
        if let Some(p) = json.get("prefill").and_then(Value::as_object) {
            for (n, v) in p {
                if let (Ok(n), Some(v)) = (n.parse(), v.as_f64()) {
                    result.prefill.insert(n, v);
                }
            }
        }
        if let Some(d) = json.get("decode").and_then(Value::as_object) {
            for (c, v) in d {
                if let (Ok(c), Some(v)) = (c.parse(), v.as_f64()) {
                    result.decode.insert(c, v);
                }
            }
        }
    }
    Ok(result)
}

/// One target's check.
#[derive(Clone, Debug)]
pub struct ModelTarget {
    /// What.
    pub what: String,
    /// Measured, as shown.
    pub value: String,
    /// Goal, as shown.
    pub goal: String,
    /// Met.
    pub met: bool,
}

impl ModelReport {
    /// llama.cpp's prefill tokens/s at 512 to compare with: measured (and
    /// `true`), or the high end of the quoted range (and `false`).
    pub fn llama_prefill_512(&self) -> (f64, bool) {
        match &self.peer {
            Peer::Measured(p) if p.prefill.contains_key(&512) => (p.prefill[&512], true),
            _ => (QUOTED_LLAMA_CPP.prefill.1, false),
        }
    }

    /// Every target, per dtype.
    pub fn targets(&self) -> Vec<ModelTarget> {
        let mut targets = Vec::new();
        let (llama, measured) = self.llama_prefill_512();
        let source = if measured { "measured" } else { "quoted, not measured in this run" };
        for d in &self.dtypes {
            for r in &d.decode {
                let share = r.roof_share();
                targets.push(ModelTarget {
                    what: format!("{} decode at context {}: share of the read roof (paired)", d.dtype, r.context),
                    value: format!(
                        "{:.0} % (quartiles {:.0}–{:.0})",
                        100.0 * share.median,
                        100.0 * share.q1,
                        100.0 * share.q3
                    ),
                    goal: format!("≥ {:.0} %", 100.0 * DECODE_ROOF_TARGET),
                    met: share.median >= DECODE_ROOF_TARGET,
                });
                let peer = match &self.peer {
                    Peer::Measured(p) => p.decode_at(r.context),
                    _ => None,
                };
                if let (WeightsAs::Blocks, Some((llama, same_context))) = (d.dtype, peer) {
                    let at = if same_context { "at the same context" } else { "at a short context" };
                    targets.push(ModelTarget {
                        what: format!(
                            "blocks decode at context {} vs llama.cpp ({at}: {} tok/s)",
                            r.context,
                            format_rate(llama)
                        ),
                        value: format!("{:.2}× ({} tok/s)", r.tokens_per_s() / llama, format_rate(r.tokens_per_s())),
                        goal: format!("≥ {BLOCKS_DECODE_VS_LLAMA_TARGET}×"),
                        met: r.tokens_per_s() >= BLOCKS_DECODE_VS_LLAMA_TARGET * llama,
                    });
                }
                targets.push(ModelTarget {
                    what: format!("{} decode at context {}: executor overhead", d.dtype, r.context),
                    value: format!("{:.1} % ({})", 100.0 * r.overhead_fraction(), format_time(r.overhead.median)),
                    goal: format!("≤ {:.0} %", 100.0 * OVERHEAD_TARGET),
                    met: r.overhead_fraction() <= OVERHEAD_TARGET,
                });
            }
            if let Some(p) = d.prefill.iter().find(|p| p.tokens == 512) {
                targets.push(ModelTarget {
                    what: format!("{} prefill 512 vs llama.cpp ({source}: {} tok/s)", d.dtype, format_rate(llama)),
                    value: format!("{:.2}× ({} tok/s)", p.tokens_per_s() / llama, format_rate(p.tokens_per_s())),
                    goal: format!("≥ {PREFILL_VS_LLAMA_TARGET}×"),
                    met: p.tokens_per_s() >= PREFILL_VS_LLAMA_TARGET * llama,
                });
            }
        }
        targets
    }

    /// The report for people.
    pub fn to_markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let roof = &self.roof;
        let _ = writeln!(s, "# kvjit model benchmark ({})\n", self.mode);
        let _ = writeln!(s, "- model: `{}`", self.gguf.display());
        let _ = writeln!(s, "- CPU: {}; {} threads; kernel tier {}", self.cpu, self.threads, self.tier);
        let _ = writeln!(
            s,
            "- read roof: {} GB/s (median of {} samples, {}–{})",
            format_rate(roof.read_bytes_per_s.median / 1e9),
            roof.read_bytes_per_s.samples,
            format_rate(roof.read_bytes_per_s.min / 1e9),
            format_rate(roof.read_bytes_per_s.max / 1e9)
        );
        let _ = writeln!(s, "- run took {}\n", format_time(self.duration.as_secs_f64()));

        let _ = writeln!(s, "## Model\n");
        let _ = writeln!(
            s,
            "| dtype | load | compile | graph nodes | steps (kernels) | weight bytes / decode step | K/V bytes / token |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for d in &self.dtypes {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} ({}) | {:.1} MB | {:.1} KB |",
                d.dtype,
                format_time(d.load_time),
                format_time(d.compile_time),
                d.nodes,
                d.kernels.1,
                d.kernels.0,
                d.weight_bytes / 1e6,
                d.kv_bytes_per_token / 1e3
            );
        }

        let _ = writeln!(s, "\n## Tokens per second\n");
        let mut header = String::from("| |");
        let mut rule = String::from("|---|");
        if let Some(d) = self.dtypes.first() {
            for p in &d.prefill {
                let _ = write!(header, " prefill {} |", p.tokens);
                rule.push_str("---|");
            }
            for r in &d.decode {
                let _ = write!(header, " decode @ {} |", r.context);
                rule.push_str("---|");
            }
        }
        let _ = writeln!(s, "{header}\n{rule}");
        for d in &self.dtypes {
            let mut row = format!("| kvjit {} |", d.dtype);
            for p in &d.prefill {
                let _ = write!(row, " {} |", format_rate(p.tokens_per_s()));
            }
            for r in &d.decode {
                let _ = write!(row, " {} |", format_rate(r.tokens_per_s()));
            }
            let _ = writeln!(s, "{row}");
        }
        let cols = self.dtypes.first().map_or((0, 0), |d| (d.prefill.len(), d.decode.len()));
        match &self.peer {
            Peer::Measured(p) => {
                let mut row = "| llama.cpp (measured, the same GGUF file) |".to_string();
                for d in self.dtypes.first().into_iter().flat_map(|d| &d.prefill) {
                    let _ = write!(row, " {} |", p.prefill.get(&d.tokens).map_or("–".into(), |v| format_rate(*v)));
                }
                for d in self.dtypes.first().into_iter().flat_map(|d| &d.decode) {
                    let cell = match p.decode_at(d.context) {
                        Some((v, true)) => format_rate(v),
                        Some((v, false)) => format!("{} (short context)", format_rate(v)),
                        None => "–".into(),
                    };
                    let _ = write!(row, " {cell} |");
                }
                let _ = writeln!(s, "{row}");
            }
            _ => {
                let q = QUOTED_LLAMA_CPP;
                let mut row = "| llama.cpp (quoted, not measured in this run) |".to_string();
                for _ in 0..cols.0 {
                    let _ = write!(row, " {:.0}–{:.0} |", q.prefill.0, q.prefill.1);
                }
                for _ in 0..cols.1 {
                    let _ = write!(row, " ~{:.0}–{:.0} |", q.decode.0, q.decode.1);
                }
                let _ = writeln!(s, "{row}");
            }
        }
        let _ = match &self.peer {
            Peer::NotInstalled => writeln!(
                s,
                "\nllama.cpp peer: not installed (set {LLAMA_CPP_ENV} to a llama-bench binary or python:INTERPRETER with llama_cpp). The llama.cpp row is the figure quoted in issue 23 (2 threads, this host class, prompt length not split), quoted, not measured in this run."
            ),
            Peer::Failed(e) => writeln!(s, "\nllama.cpp peer: failed: {e}; the quoted figures are used."),
            Peer::Measured(p) => writeln!(s, "\nllama.cpp peer: measured by `{}`.", p.command),
        };

        let _ = writeln!(s, "\n## Decode steps: read roof and executor overhead\n");
        let _ = writeln!(
            s,
            "| dtype | context | step | bytes read | roof time | % of roof, paired (quartiles) | kernels sum | overhead | overhead % |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        for d in &self.dtypes {
            for r in &d.decode {
                let share = r.roof_share();
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {:.1} MB | {} | {:.0} % ({:.0}–{:.0}) | {} | {} | {:.1} % |",
                    d.dtype,
                    r.context,
                    format_time(r.time.median),
                    r.bytes / 1e6,
                    format_time(r.roof_time(roof)),
                    100.0 * share.median,
                    100.0 * share.q1,
                    100.0 * share.q3,
                    format_time(r.kernel_time.median),
                    format_time(r.overhead.median),
                    100.0 * r.overhead_fraction()
                );
            }
        }
        let _ = writeln!(s, "\nKernels per decode step: {}.", kernel_counts(&self.dtypes));

        for d in &self.dtypes {
            for r in &d.decode {
                let _ = writeln!(s, "\n## Where a decode step goes: {} at context {}\n", d.dtype, r.context);
                let _ = writeln!(s, "| step kind | steps | median time / token | % of step |");
                let _ = writeln!(s, "|---|---|---|---|");
                for k in &r.kinds {
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {:.1} % |",
                        k.what,
                        k.count,
                        format_time(k.time),
                        100.0 * k.time / r.time.median
                    );
                }
                let _ = writeln!(
                    s,
                    "| executor overhead | – | {} | {:.1} % |",
                    format_time(r.overhead.median),
                    100.0 * r.overhead_fraction()
                );
                let _ = writeln!(s, "\nSlowest steps:\n\n| step | median time | % of step |\n|---|---|---|");
                for t in &r.top {
                    let _ = writeln!(
                        s,
                        "| {} | {} | {:.1} % |",
                        t.what,
                        format_time(t.time),
                        100.0 * t.time / r.time.median
                    );
                }
            }
        }

        let _ = writeln!(s, "\n## Targets\n\n| target | measured | goal | verdict |\n|---|---|---|---|");
        for t in self.targets() {
            let _ = writeln!(s, "| {} | {} | {} | {} |", t.what, t.value, t.goal, pass_or_miss(t.met));
        }
        s
    }

    /// Every figure, for tools.
    pub fn to_json(&self) -> Value {
        let stats = |s: &Stats| json!({"median": s.median, "min": s.min, "max": s.max, "q1": s.q1, "q3": s.q3, "samples": s.samples});
        let share = |v: &[StepShare]| {
            v.iter().map(|k| json!({"what": k.what, "count": k.count, "time_s": k.time})).collect::<Vec<_>>()
        };
        let roof = &self.roof;
        json!({
            "suite": "model",
            "mode": self.mode,
            "gguf": self.gguf.display().to_string(),
            "threads": self.threads,
            "cpu": self.cpu,
            "tier": self.tier,
            "duration_s": self.duration.as_secs_f64(),
            "read_bytes_per_s": stats(&roof.read_bytes_per_s),
            "dtypes": self.dtypes.iter().map(|d| json!({
                "dtype": d.dtype.to_string(),
                "load_s": d.load_time,
                "compile_s": d.compile_time,
                "graph_nodes": d.nodes,
                "steps": d.kernels.1,
                "kernels": d.kernels.0,
                "weight_bytes": d.weight_bytes,
                "kv_bytes_per_token": d.kv_bytes_per_token,
                "prefill": d.prefill.iter().map(|p| json!({
                    "tokens": p.tokens, "time_s": stats(&p.time), "tokens_per_s": p.tokens_per_s(),
                })).collect::<Vec<_>>(),
                "decode": d.decode.iter().map(|r| json!({
                    "context": r.context,
                    "time_s": stats(&r.time),
                    "tokens_per_s": r.tokens_per_s(),
                    "kernel_time_s": stats(&r.kernel_time),
                    "overhead_s": stats(&r.overhead),
                    "overhead_fraction": r.overhead_fraction(),
                    "bytes": r.bytes,
                    "roof_time_s": r.roof_time(roof),
                    "share_of_read_roof": stats(&r.roof_share()),
                    "kinds": share(&r.kinds),
                    "top_steps": share(&r.top),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "llama_cpp": match &self.peer {
                Peer::NotInstalled => json!({"status": "not installed", "quoted": {
                    "prefill_tokens_per_s": [QUOTED_LLAMA_CPP.prefill.0, QUOTED_LLAMA_CPP.prefill.1],
                    "decode_tokens_per_s": [QUOTED_LLAMA_CPP.decode.0, QUOTED_LLAMA_CPP.decode.1],
                    "source": "issue 23, quoted, not measured in this run",
                }}),
                Peer::Failed(e) => json!({"status": "failed", "error": e}),
                Peer::Measured(p) => json!({"status": "measured", "command": p.command,
                    "prefill_tokens_per_s": p.prefill.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
                    "decode_tokens_per_s": p.decode.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()}),
            },
            "targets": self.targets().iter().map(|t| json!({
                "what": t.what, "value": t.value, "goal": t.goal, "met": t.met,
            })).collect::<Vec<_>>(),
        })
    }
}

fn kernel_counts(dtypes: &[DtypeResult]) -> String {
    dtypes
        .iter()
        .map(|d| format!("{} {} kernels ({} steps with views)", d.dtype, d.kernels.0, d.kernels.1))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_python_peer_reports_decode_per_context() {
        let text = r#"{"prefill": {"128": 270.5, "512": 241.0}, "decode": {"128": 80.25, "2048": 51.5}}"#;
        let p = parse_peer_output("py".into(), text).unwrap();
        assert_eq!(p.prefill, BTreeMap::from([(128, 270.5), (512, 241.0)]));
        assert_eq!(p.decode_at(128), Some((80.25, true)));
        assert_eq!(p.decode_at(2048), Some((51.5, true)));
        // A context it did not run, and no short-context figure: none.
        assert_eq!(p.decode_at(4096), None);
    }

    #[test]
    fn llama_bench_rows_give_prefill_and_a_short_context_decode() {
        let text = r#"[{"n_prompt": 128, "n_gen": 0, "avg_ts": 260.0},
                       {"n_prompt": 512, "n_gen": 0, "avg_ts": 230.0},
                       {"n_prompt": 0, "n_gen": 32, "avg_ts": 90.0}]"#;
        let p = parse_peer_output("llama-bench".into(), text).unwrap();
        assert_eq!(p.prefill, BTreeMap::from([(128, 260.0), (512, 230.0)]));
        // Every context falls back to the short-context figure, marked so.
        assert_eq!(p.decode_at(2048), Some((90.0, false)));
        let err = parse_peer_output("llama-bench".into(), "not json").unwrap_err();
        assert!(err.contains("llama-bench: output is not JSON"), "{err}");
    }
}
