//! `kvjit bench --ops layer`: one whole Llama decoder layer
//! ([`decoder_layer_graph`]: RMSNorm → fused QKV → RoPE → attention →
//! o_proj + residual → RMSNorm → SwiGLU MLP + residual), compiled twice
//! from the same graph and weights with [`kvjit::compile`] — fused (the
//! default) and unfused (`CompileOptions::fuse = false`) — and timed side
//! by side (`Executor::run` of a whole step, interleaved) on decode and
//! prefill workloads, against the sum of its ops' roofs.
//!
//! - **Workloads**: decode steps (S = 1) of `batch` sequences with
//!   `history` cached tokens each (random K/V behind them, scattered page
//!   tables), and a prefill of `seq` tokens (batch 1, empty cache). A step
//!   rewrites the same cache positions every run (the caller never
//!   advances), so every run does the same work.
//! - **Roofs**: the sum over the layer's ops of max(bytes / read bandwidth,
//!   FLOPs / FMA rate): the five matmuls (QKV, o, gate, up, down: bytes =
//!   their weights, FLOPs = 2·tokens·N·K) and attention (bytes = the K/V it
//!   reads, FLOPs = 4·Hq·D per (query, key) pair), the FLOPs on the FMA
//!   rate of the kernels' code tier (the 256-bit one on the avx2 tier, where
//!   the matmuls and attention both run micro-kernels of that width, as the
//!   attention suite's step counts). RoPE, RMSNorm, the residual adds and SwiGLU's
//!   elementwise work move well under 1 % of those bytes and count nothing.
//! - **Where the time goes**: the executor's per-step timings
//!   (`RunOutput::timings`), each step mapped back to the graph's nodes it
//!   computes (a fused kernel's step stands for every node it absorbed),
//!   grouped into the five matmuls (the fused kernels that contain them:
//!   their epilogues' residual adds and SwiGLU are inside and cannot be
//!   separated), attention (RoPE + mha) and "RMSNorm + residuals + SwiGLU"
//!   (in the fused graph: the RMSNorm steps; unfused: the RMSNorm, add,
//!   SiLU and mul steps).
//!
//! Every workload is validated once before it is timed: the fused and the
//! unfused layer's outputs from the same inputs and cache must agree
//! (normalized max error ≤ 2⁻⁶ for 16-bit dtypes, 1e-4 for f32), otherwise
//! the row shows the error and no figure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvjit::models::llama::{HIDDEN_STATE_OUT, LayerWeight, LlamaConfig, decoder_layer_graph, weight_name};
use kvjit::{CodeTier, CompileOptions, Graph, compile, compiled_graph, standard_registry};
use kvjit_core::{DType, PagedKVCacheCollection, Tensor};
use kvjit_runtime::{DeviceContextPtr, Executable, Executor, RunOutput};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::attention::{normalized_error, tolerance};
use crate::render::{format_rate, format_time, pass_or_miss};
use crate::roofline::{Roof, RoofPlan, RoofSamples};
use crate::timing::{Plan, Stats, measure_interleaved};
use crate::workload::{Heads, step_inputs};
use crate::{BenchError, Progress, Result, Steps};

/// Decode at batch 1: the five matmuls' steps at most this many times their
/// read roof (their weight bytes over the read bandwidth).
pub const MATMUL_ROOF_TARGET: f64 = 1.15;
/// Every workload: the fused layer at least this many times as fast as the
/// unfused one.
pub const FUSED_SPEEDUP_TARGET: f64 = 1.0;
/// The prefill: the fused layer at least this many times as fast.
pub const PREFILL_SPEEDUP_TARGET: f64 = 1.25;
/// Decode: RMSNorm, residuals and SwiGLU at most this share of a fused step.
pub const GLUE_SHARE_TARGET: f64 = 0.03;

/// Decode or prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// One new token per sequence, after a history.
    Decode,
    /// Many new tokens, empty cache.
    Prefill,
}

/// One step shape the layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Decode or prefill.
    pub phase: Phase,
    /// Sequences.
    pub batch: usize,
    /// Cached tokens per sequence before the step.
    pub history: usize,
    /// New tokens per sequence this step.
    pub seq: usize,
}

impl Workload {
    /// A decode step: `batch` sequences of `history` cached tokens, one new each.
    pub fn decode(batch: usize, history: usize) -> Self {
        Self { phase: Phase::Decode, batch, history, seq: 1 }
    }

    /// A prefill of `seq` tokens: batch 1, empty cache.
    pub fn prefill(seq: usize) -> Self {
        Self { phase: Phase::Prefill, batch: 1, history: 0, seq }
    }

    /// How the report names it.
    pub fn name(&self) -> String {
        match self.phase {
            Phase::Decode => format!("decode B={} history {}", self.batch, self.history),
            Phase::Prefill => format!("prefill {} tokens (B={})", self.seq, self.batch),
        }
    }

    /// Rows every matmul multiplies: batch × new tokens.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Tokens a sequence holds after the step.
    pub fn context(&self) -> usize {
        self.history + self.seq
    }
}

/// What `kvjit bench --ops layer` covers and how long it measures.
#[derive(Clone, Debug)]
pub struct LayerBenchConfig {
    /// Name of the preset.
    pub mode: String,
    /// The model whose decoder layer is built: one layer of it, its cache
    /// sized for the workloads ([`graph_config`](Self::graph_config)).
    pub model: LlamaConfig,
    /// The steps timed.
    pub workloads: Vec<Workload>,
    /// Time only the unfused layer (`--no-fuse`): no side-by-side figures.
    pub unfused_only: bool,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Seed of the inputs and caches (the weights are the model's recipe).
    pub seed: u64,
    /// Timing of a decode workload.
    pub timing: Plan,
    /// Timing of a prefill workload.
    pub prefill_timing: Plan,
    /// Roofline probes.
    pub roof: RoofPlan,
}

impl LayerBenchConfig {
    /// One Llama-3-8B decoder layer in bf16: decode at batch 1 and 8 with a
    /// history of 2048, and a 512-token prefill (about a minute on 2 cores,
    /// most of it the prefill: ~220 GFLOP a run).
    pub fn full() -> Self {
        let quick_roof = crate::BenchConfig::quick().roof;
        Self {
            mode: "full".into(),
            model: LlamaConfig::llama3_8b_decoder_layer(),
            workloads: vec![Workload::decode(1, 2048), Workload::decode(8, 2048), Workload::prefill(512)],
            unfused_only: false,
            threads: 2,
            seed: 7,
            timing: Plan {
                min_samples: 5,
                max_samples: 20,
                sample_time: Duration::from_millis(50),
                budget: Duration::from_secs(4),
            },
            prefill_timing: Plan {
                min_samples: 5,
                max_samples: 9,
                sample_time: Duration::ZERO,
                budget: Duration::from_secs(30),
            },
            roof: RoofPlan {
                timing: Plan { min_samples: 10, max_samples: 20, budget: Duration::from_secs(2), ..quick_roof.timing },
                ..quick_roof
            },
        }
    }

    /// The same layer and workloads, fewer samples.
    pub fn quick() -> Self {
        let full = Self::full();
        Self {
            mode: "quick".into(),
            timing: Plan { min_samples: 3, max_samples: 8, budget: Duration::from_millis(1500), ..full.timing },
            prefill_timing: Plan { min_samples: 2, max_samples: 2, budget: Duration::ZERO, ..full.prefill_timing },
            roof: crate::BenchConfig::quick().roof,
            ..full
        }
    }

    /// A toy layer (`LlamaConfig::tiny`'s shapes, one layer, bf16) on toy
    /// workloads, for tests of the plumbing, well under a second (the
    /// numbers mean nothing).
    pub fn tiny() -> Self {
        let short = Plan { min_samples: 2, max_samples: 3, sample_time: Duration::ZERO, budget: Duration::ZERO };
        let mut model = LlamaConfig::tiny();
        model.layer.name = "tiny_decoder_layer".into();
        model.layer.dtype = DType::BF16;
        Self {
            mode: "tiny".into(),
            model,
            workloads: vec![Workload::decode(1, 40), Workload::decode(3, 40), Workload::prefill(12)],
            unfused_only: false,
            threads: 2,
            seed: 7,
            timing: short,
            prefill_timing: short,
            roof: RoofPlan { read_bytes: 1 << 20, fma_iterations: 1 << 10, timing: short },
        }
    }

    /// Refuse configurations that cannot run.
    pub fn check(&self) -> Result<()> {
        if self.workloads.is_empty() {
            return Err(BenchError::NoValues { option: "workloads" });
        }
        if self.workloads.iter().any(|w| w.batch == 0 || w.seq == 0) {
            return Err(BenchError::Zero { what: "batches and prefill lengths" });
        }
        if !self.model.layer.dtype.is_compute_float() {
            return Err(BenchError::NotComputeFloat { dtype: self.model.layer.dtype });
        }
        Ok(())
    }

    /// The model as the graph is built: one layer, its cache just large
    /// enough for every workload (pages for the largest batch × context,
    /// a table as wide as the longest context).
    pub fn graph_config(&self) -> LlamaConfig {
        let mut model = self.model.clone();
        let layer = &mut model.layer;
        layer.num_layers = 1;
        let pages = |w: &Workload| w.context().div_ceil(layer.page_size).max(1);
        layer.max_pages_per_seq = self.workloads.iter().map(pages).max().unwrap_or(1);
        layer.num_pages = self.workloads.iter().map(|w| w.batch * pages(w)).max().unwrap_or(1);
        model
    }

    /// The graphs timed: fused then unfused, or only unfused.
    pub fn graphs(&self) -> Vec<bool> {
        if self.unfused_only { vec![false] } else { vec![true, false] }
    }

    /// Steps the progress callback counts.
    pub fn step_count(&self) -> usize {
        2 + 1 + self.graphs().len() + self.workloads.len()
    }
}

/// A projection of the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projection {
    /// The fused Q, K, V projection (K and V stored into the cache).
    Qkv,
    /// Attention output.
    O,
    /// MLP gate.
    Gate,
    /// MLP up.
    Up,
    /// MLP down.
    Down,
}

impl Projection {
    /// All five, in layer order.
    pub const ALL: [Self; 5] = [Self::Qkv, Self::O, Self::Gate, Self::Up, Self::Down];

    /// Its weight.
    pub fn weight(self) -> LayerWeight {
        match self {
            Self::Qkv => LayerWeight::Qkv,
            Self::O => LayerWeight::OutputProjection,
            Self::Gate => LayerWeight::Gate,
            Self::Up => LayerWeight::Up,
            Self::Down => LayerWeight::Down,
        }
    }

    /// The name reports give it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qkv => "QKV",
            Self::O => "o_proj",
            Self::Gate => "gate",
            Self::Up => "up",
            Self::Down => "down",
        }
    }
}

/// What one node of the (unfused) layer graph does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// One of the five matmuls.
    Matmul(Projection),
    /// Paged RoPE.
    Rope,
    /// Paged flash attention.
    Attention,
    /// An RMSNorm.
    RmsNorm,
    /// A residual add.
    Residual,
    /// SwiGLU's SiLU.
    Silu,
    /// SwiGLU's product.
    Mul,
    /// A reshape (a view: no kernel work).
    View,
    /// Anything else.
    Other,
}

impl Role {
    /// The name reports give it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Matmul(p) => p.name(),
            Self::Rope => "RoPE",
            Self::Attention => "mha",
            Self::RmsNorm => "RMSNorm",
            Self::Residual => "residual add",
            Self::Silu => "SiLU",
            Self::Mul => "mul",
            Self::View => "reshape",
            Self::Other => "other",
        }
    }
}

/// The groups the step time is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    /// The five matmuls (with whatever epilogues fused into them).
    Matmuls,
    /// RoPE and mha.
    Attention,
    /// RMSNorm, the residual adds, SiLU and mul — as far as they are
    /// steps of their own.
    Glue,
    /// Views and anything else.
    Other,
}

impl Group {
    /// All groups, in report order.
    pub const ALL: [Self; 4] = [Self::Matmuls, Self::Attention, Self::Glue, Self::Other];

    /// The name reports give it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Matmuls => "matmuls",
            Self::Attention => "attention",
            Self::Glue => "RMSNorm + residuals + SwiGLU",
            Self::Other => "other",
        }
    }

    /// The JSON key.
    pub fn id(self) -> &'static str {
        match self {
            Self::Matmuls => "matmuls",
            Self::Attention => "attention",
            Self::Glue => "rmsnorm_residuals_swiglu",
            Self::Other => "other",
        }
    }

    /// The group of a step computing nodes of `roles`: a matmul makes it a
    /// matmul step (a fused epilogue is part of the GEMM's kernel), else
    /// RoPE or mha an attention step, else any RMSNorm or elementwise node
    /// a glue step.
    pub fn of(roles: &[Role]) -> Self {
        if roles.iter().any(|r| matches!(r, Role::Matmul(_))) {
            Self::Matmuls
        } else if roles.iter().any(|r| matches!(r, Role::Rope | Role::Attention)) {
            Self::Attention
        } else if roles.iter().any(|r| matches!(r, Role::RmsNorm | Role::Residual | Role::Silu | Role::Mul)) {
            Self::Glue
        } else {
            Self::Other
        }
    }
}

/// The roles of `graph`'s nodes (a decoder layer built from `model`), in
/// node order.
pub fn node_roles(graph: &Graph, model: &LlamaConfig) -> Vec<Role> {
    let weight_of = |value: kvjit::ValueId| graph.value(value).name.clone().unwrap_or_default();
    let projection = |name: &str| {
        Projection::ALL
            .into_iter()
            .find(|p| (0..model.layer.num_layers).any(|l| weight_name(&model.layer, l, p.weight()) == name))
    };
    graph
        .nodes()
        .iter()
        .map(|node| match node.op.as_str() {
            kvjit::fused_qkv::OP_NAME | kvjit::fused_qkv::OP_ALIAS => Role::Matmul(Projection::Qkv),
            "mo.matmul" => match node.inputs.get(1).map(|&v| weight_of(v)).as_deref().and_then(projection) {
                Some(p) => Role::Matmul(p),
                None => Role::Other,
            },
            kvjit::rope::OP_NAME => Role::Rope,
            kvjit::attention::OP_NAME => Role::Attention,
            "mo.reduce.rms_norm" => Role::RmsNorm,
            "mo.add" => Role::Residual,
            "mo.silu" => Role::Silu,
            "mo.mul" => Role::Mul,
            kvjit::reshape::OP_NAME => Role::View,
            _ => Role::Other,
        })
        .collect()
}

/// The work one op does in a workload, for its roof.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpWork {
    /// What it is.
    pub role: Role,
    /// Bytes it must read: a matmul's weight, attention's K/V.
    pub bytes: f64,
    /// FLOPs (at the FMA rate of the layer's code tier).
    pub flops: f64,
}

/// The roof work of the node of `role` in `workload` (none for the ops
/// the roof does not count).
pub fn op_work(model: &LlamaConfig, workload: &Workload, role: Role) -> Option<OpWork> {
    let layer = &model.layer;
    let e = layer.dtype.size_bytes() as f64;
    match role {
        Role::Matmul(p) => {
            let shape = p.weight().shape(layer, model.ffn_size);
            let (n, k) = (shape[0] as f64, shape[1] as f64);
            Some(OpWork { role, bytes: n * k * e, flops: 2.0 * workload.tokens() as f64 * n * k })
        }
        Role::Attention => {
            let heads = heads_of(model);
            let cache_dtype = layer.cache_dtype.unwrap_or(layer.dtype);
            let bytes = workload.batch as f64 * heads.kv_bytes(workload.context(), cache_dtype);
            // Query t (0-based) of a sequence attends to history + t + 1 keys.
            let (s, h) = (workload.seq as f64, workload.history as f64);
            let pairs = workload.batch as f64 * (s * h + s * (s + 1.0) / 2.0);
            let flops = 4.0 * (layer.num_q_heads * layer.head_size) as f64 * pairs;
            Some(OpWork { role, bytes, flops })
        }
        _ => None,
    }
}

/// The attention heads of `model`.
fn heads_of(model: &LlamaConfig) -> Heads {
    let l = &model.layer;
    Heads { num_heads: l.num_q_heads, num_kv_heads: l.num_kv_heads, head_size: l.head_size, page_size: l.page_size }
}

/// One step of a compiled layer in one workload.
#[derive(Clone, Debug)]
pub struct StepResult {
    /// The executable's label (`n7`, or `n7+n8` for a fused kernel).
    pub label: String,
    /// The nodes it computes.
    pub roles: Vec<Role>,
    /// Its kernel key.
    pub key: String,
    /// Seconds per run.
    pub time: Stats,
    /// The roof work of the ops it computes.
    pub work: Vec<OpWork>,
}

impl StepResult {
    /// Its group.
    pub fn group(&self) -> Group {
        Group::of(&self.roles)
    }

    /// What it computes: its nodes' names joined by ` + `.
    pub fn what(&self) -> String {
        self.roles.iter().map(|r| r.name()).collect::<Vec<_>>().join(" + ")
    }
}

/// One compiled layer (fused or not) in one workload.
#[derive(Clone, Debug)]
pub struct GraphResult {
    /// Fused (the default compile) or not.
    pub fused: bool,
    /// Seconds per `Executor::run`.
    pub time: Stats,
    /// Seconds per run in each group (the sum of its steps' timings in each
    /// run, then the median over runs), in [`Group::ALL`] order.
    pub groups: Vec<(Group, Stats)>,
    /// Seconds per run outside the steps' kernel calls (argument checks,
    /// output allocation): `Executor::run`'s wall time − its steps' sum.
    pub overhead: Stats,
    /// Per step, in execution order.
    pub steps: Vec<StepResult>,
}

impl GraphResult {
    /// The time of `group`.
    pub fn group(&self, group: Group) -> f64 {
        self.groups.iter().find(|(g, _)| *g == group).map_or(0.0, |(_, s)| s.median)
    }

    /// The roof work of the steps of `group`.
    pub fn work_of(&self, group: Group) -> impl Iterator<Item = &OpWork> {
        self.steps.iter().filter(move |s| s.group() == group).flat_map(|s| &s.work)
    }

    /// Which graph: `fused` or `unfused`.
    pub fn name(&self) -> &'static str {
        if self.fused { "fused" } else { "unfused" }
    }
}

/// One workload: both layers, or why it has no figures.
#[derive(Clone, Debug)]
pub struct WorkloadResult {
    /// The step shape.
    pub workload: Workload,
    /// The roof work of the layer's ops.
    pub work: Vec<OpWork>,
    /// Normalized max error of the fused output against the unfused one
    /// (NaN with `--no-fuse`).
    pub error: f64,
    /// The graphs timed (fused first), or the reason there are no figures.
    pub outcome: std::result::Result<Vec<GraphResult>, String>,
}

impl WorkloadResult {
    /// The result of the fused (`true`) or unfused graph, if timed.
    pub fn graph(&self, fused: bool) -> Option<&GraphResult> {
        self.outcome.as_ref().ok()?.iter().find(|g| g.fused == fused)
    }

    /// Unfused median / fused median.
    pub fn speedup(&self) -> Option<f64> {
        Some(self.graph(false)?.time.median / self.graph(true)?.time.median)
    }

    /// Unfused fastest run / fused fastest run: less sensitive than the
    /// medians to other work on a shared machine (the targets use the
    /// medians).
    pub fn fastest_speedup(&self) -> Option<f64> {
        Some(self.graph(false)?.time.min / self.graph(true)?.time.min)
    }
}

/// Everything one `kvjit bench --ops layer` run measured.
#[derive(Clone, Debug)]
pub struct LayerReport {
    /// The preset.
    pub mode: String,
    /// Worker threads.
    pub threads: usize,
    /// The CPU.
    pub cpu: String,
    /// Wall time of the run.
    pub duration: Duration,
    /// The model of the layer (its graph's config).
    pub model: LlamaConfig,
    /// Bytes of the layer's weights.
    pub weight_bytes: f64,
    /// Nodes of the unfused and of the fused graph.
    pub nodes: (usize, Option<usize>),
    /// The CPU code tier the kernels were built for.
    pub tier: CodeTier,
    /// Seconds `compile` took, per graph timed (fused first).
    pub compile_times: Vec<(bool, f64)>,
    /// The roofs, measured at the start and the end.
    pub roof: Roof,
    /// Per workload.
    pub workloads: Vec<WorkloadResult>,
}

/// Per-step samples of runs of one graph.
struct Samples {
    /// Per step, seconds per run.
    steps: Vec<Vec<f64>>,
    /// Per group, seconds per run.
    groups: Vec<Vec<f64>>,
    /// Seconds per run outside the steps.
    overhead: Vec<f64>,
}

impl Samples {
    fn new(steps: usize) -> Self {
        Self { steps: vec![Vec::new(); steps], groups: vec![Vec::new(); Group::ALL.len()], overhead: Vec::new() }
    }

    /// Record one run of `wall` seconds whose steps' groups are `groups`.
    fn record(&mut self, out: &RunOutput, groups: &[Group], wall: f64) {
        let mut sums = vec![0.0; Group::ALL.len()];
        let mut total = 0.0;
        for ((t, samples), group) in out.timings.iter().zip(&mut self.steps).zip(groups) {
            let s = t.elapsed.as_secs_f64();
            samples.push(s);
            sums[Group::ALL.iter().position(|g| g == group).expect("every group is listed")] += s;
            total += s;
        }
        for (samples, s) in self.groups.iter_mut().zip(sums) {
            samples.push(s);
        }
        self.overhead.push((wall - total).max(0.0));
    }
}

/// A compiled layer and how its steps map to the graph's nodes.
struct CompiledLayer {
    fused: bool,
    exe: Executable,
    /// Per step, the roles of the nodes it computes.
    roles: Vec<Vec<Role>>,
}

impl CompiledLayer {
    fn new(graph: &Graph, model: &LlamaConfig, fused: bool) -> Result<Self> {
        let registry = standard_registry();
        let options = CompileOptions { fuse: fused, ..CompileOptions::default() };
        let exe = compile(graph, &registry, &options)?;
        let node_roles = node_roles(graph, model);
        let origins = compiled_graph(graph, &registry, &options)?.origins;
        let roles: Vec<Vec<Role>> =
            origins.iter().map(|nodes| nodes.iter().map(|n| node_roles[n.index()]).collect()).collect();
        assert_eq!(roles.len(), exe.steps().len(), "one step per node of the compiled graph");
        Ok(Self { fused, exe, roles })
    }

    fn groups(&self) -> Vec<Group> {
        self.roles.iter().map(|r| Group::of(r)).collect()
    }
}

/// Validate and time the layers on one workload.
fn run_workload(
    model: &LlamaConfig,
    layers: &[CompiledLayer],
    workload: &Workload,
    plan: &Plan,
    ctx: &DeviceContextPtr,
    rng: &mut SmallRng,
) -> Result<WorkloadResult> {
    let Workload { batch, history, seq, .. } = *workload;
    let work = [Role::Attention].into_iter().chain(Projection::ALL.map(Role::Matmul)).collect::<Vec<_>>();
    let work = work.into_iter().filter_map(|r| op_work(model, workload, r)).collect();
    let mut result = WorkloadResult { workload: *workload, work, error: f64::NAN, outcome: Err(String::new()) };
    let (inputs, caches) = step_inputs(&model.layer, batch, history, seq, rng)?;
    let mut caches: Vec<BTreeMap<String, PagedKVCacheCollection>> = layers.iter().map(|_| caches.clone()).collect();
    let executor = Executor::new(ctx.clone());

    // Validate: each layer once on the same inputs and cache.
    let mut outputs: Vec<Tensor> = Vec::new();
    for (layer, caches) in layers.iter().zip(&mut caches) {
        let graph = if layer.fused { "fused" } else { "unfused" };
        let out = match executor.run(&layer.exe, &inputs, caches) {
            Ok(mut out) => out.outputs.remove(HIDDEN_STATE_OUT),
            Err(e) => {
                result.outcome = Err(format!("the {graph} layer's validation run failed: {e}"));
                return Ok(result);
            }
        };
        let Some(out) = out else {
            result.outcome = Err(format!("the {graph} layer has no output {HIDDEN_STATE_OUT}"));
            return Ok(result);
        };
        if out.to_f32_vec()?.iter().any(|v| !v.is_finite()) {
            result.outcome = Err(format!("the {graph} layer's output is not finite"));
            return Ok(result);
        }
        outputs.push(out);
    }
    if let [fused, unfused] = outputs.as_slice() {
        let error = normalized_error(&fused.to_f32_vec()?, &unfused.to_f32_vec()?);
        result.error = error;
        let tolerance = tolerance(model.layer.dtype);
        if error.is_nan() || error > tolerance {
            result.outcome =
                Err(format!("fused and unfused layers disagree: normalized max error {error:.3e} > {tolerance:.3e}"));
            return Ok(result);
        }
    }

    // Time: every layer's runs interleaved; per-step timings of every run
    // after each layer's warm-up run.
    let groups: Vec<Vec<Group>> = layers.iter().map(CompiledLayer::groups).collect();
    let mut samples: Vec<Samples> = layers.iter().map(|l| Samples::new(l.exe.steps().len())).collect();
    let mut warm = vec![false; layers.len()];
    let measured = measure_interleaved(layers.len(), plan, |i| {
        let started = Instant::now();
        let out = executor.run(&layers[i].exe, &inputs, &mut caches[i])?;
        let wall = started.elapsed().as_secs_f64();
        if warm[i] {
            samples[i].record(&out, &groups[i], wall);
        }
        warm[i] = true;
        Ok(())
    })?;
    let graphs = layers
        .iter()
        .zip(measured)
        .zip(samples)
        .map(|((layer, m), s)| {
            let steps = layer
                .exe
                .steps()
                .iter()
                .zip(&layer.roles)
                .zip(&s.steps)
                .map(|((step, roles), times)| StepResult {
                    label: step.label.clone(),
                    roles: roles.clone(),
                    key: step.kernel.key().to_string(),
                    time: Stats::from_samples(times),
                    work: roles.iter().filter_map(|&r| op_work(model, workload, r)).collect(),
                })
                .collect();
            GraphResult {
                fused: layer.fused,
                time: m.time,
                groups: Group::ALL.into_iter().zip(s.groups.iter().map(|v| Stats::from_samples(v))).collect(),
                overhead: Stats::from_samples(&s.overhead),
                steps,
            }
        })
        .collect();
    result.outcome = Ok(graphs);
    Ok(result)
}

/// Run `config`, calling `progress` before every step.
pub fn run_layer(config: &LayerBenchConfig, progress: &mut dyn FnMut(&Progress)) -> Result<LayerReport> {
    config.check()?;
    let ctx = DeviceContextPtr::cpu(config.threads)?;
    let threads = ctx.cpu_context().map_or(1, |c| c.threads());
    let mut steps = Steps::new(config.step_count(), progress);
    let mut rng = SmallRng::seed_from_u64(config.seed);
    let model = config.graph_config();

    let mut roof_samples = RoofSamples::default();
    steps.start("roofline probes");
    roof_samples.measure(&ctx, &config.roof)?;

    steps.start(format!("build the decoder layer graph ({})", model.layer.name));
    let registry = standard_registry();
    let graph = decoder_layer_graph(&model, registry.ops())?;
    let mut layers = Vec::new();
    let mut compile_times = Vec::new();
    for fused in config.graphs() {
        steps.start(format!("compile the {} layer", if fused { "fused" } else { "unfused" }));
        let started = Instant::now();
        layers.push(CompiledLayer::new(&graph, &model, fused)?);
        compile_times.push((fused, started.elapsed().as_secs_f64()));
    }
    let fused_nodes = layers.iter().find(|l| l.fused).map(|l| l.exe.steps().len());

    let mut workloads = Vec::new();
    for workload in &config.workloads {
        steps.start(workload.name());
        let plan = match workload.phase {
            Phase::Decode => &config.timing,
            Phase::Prefill => &config.prefill_timing,
        };
        workloads.push(run_workload(&model, &layers, workload, plan, &ctx, &mut rng)?);
    }
    drop(layers);

    steps.start("roofline probes (again)");
    roof_samples.measure(&ctx, &config.roof)?;
    let weight_bytes = Projection::ALL
        .iter()
        .map(|p| p.weight().shape(&model.layer, model.ffn_size).iter().product::<usize>())
        .sum::<usize>() as f64
        * model.layer.dtype.size_bytes() as f64;
    Ok(LayerReport {
        mode: config.mode.clone(),
        threads,
        cpu: crate::cpu_name(),
        duration: steps.elapsed(),
        weight_bytes,
        nodes: (graph.nodes().len(), fused_nodes),
        tier: kvjit::widest_cpu_tier(),
        compile_times,
        model,
        roof: roof_samples.roof(threads),
        workloads,
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
    /// Met; `None` when the workload has no figure (validation failed) or
    /// the row only reports.
    pub met: Option<bool>,
}

impl LayerReport {
    /// The FMA rate the layer's kernels run at: the 256-bit one on the avx2
    /// tier (where it was measured), else the 128-bit one.
    pub fn tier_fma(&self) -> f64 {
        match (self.tier, self.roof.fma256_flops_per_s) {
            (CodeTier::Avx2, Some(fma256)) => fma256.median,
            _ => self.roof.fma_flops_per_s.median,
        }
    }

    /// Whether the roofs use the 256-bit FMA rate.
    pub fn tier_fma_is_256(&self) -> bool {
        self.tier == CodeTier::Avx2 && self.roof.fma256_flops_per_s.is_some()
    }

    /// An op's roof seconds: max(bytes / read bandwidth, FLOPs / FMA rate).
    pub fn roof_time(&self, w: &OpWork) -> f64 {
        self.read_roof_time(w).max(self.fma_roof_time(w))
    }

    /// Seconds of the FMA roof alone of `w`.
    pub fn fma_roof_time(&self, w: &OpWork) -> f64 {
        w.flops / self.tier_fma()
    }

    /// Seconds of the read roof alone of `w`.
    pub fn read_roof_time(&self, w: &OpWork) -> f64 {
        w.bytes / self.roof.read_bytes_per_s.median
    }

    /// Sum of the roofs of `work`.
    pub fn roofs<'a>(&self, work: impl IntoIterator<Item = &'a OpWork>) -> f64 {
        work.into_iter().map(|w| self.roof_time(w)).sum()
    }

    /// What bounds `work` in sum: `bandwidth` when its read roofs add up
    /// to at least its FMA roofs, else `fma`.
    fn bound(&self, work: &[OpWork]) -> &'static str {
        let read: f64 = work.iter().map(|w| self.read_roof_time(w)).sum();
        let fma: f64 = work.iter().map(|w| self.fma_roof_time(w)).sum();
        if read >= fma { "bandwidth" } else { "fma" }
    }

    /// Every target, checked.
    pub fn targets(&self) -> Vec<TargetCheck> {
        let mut checks = Vec::new();
        for r in &self.workloads {
            let w = &r.workload;
            if w.phase == Phase::Decode && w.batch == 1 {
                let value = r.graph(true).map(|g| {
                    let read: f64 = g.work_of(Group::Matmuls).map(|o| self.read_roof_time(o)).sum();
                    g.group(Group::Matmuls) / read
                });
                checks.push(TargetCheck {
                    what: format!("{}: matmul steps (fused) vs their read roof", w.name()),
                    value: value.map_or("–".into(), |v| format!("{v:.2}×")),
                    goal: format!("≤ {MATMUL_ROOF_TARGET:.2}×"),
                    met: value.map(|v| v <= MATMUL_ROOF_TARGET),
                });
            }
        }
        for r in &self.workloads {
            let w = &r.workload;
            let goal = if w.phase == Phase::Prefill { PREFILL_SPEEDUP_TARGET } else { FUSED_SPEEDUP_TARGET };
            let speedup = r.speedup();
            checks.push(TargetCheck {
                what: format!("{}: fused vs unfused", w.name()),
                value: speedup.map_or("–".into(), |v| format!("{v:.2}×")),
                goal: format!("≥ {goal:.2}×"),
                met: speedup.map(|v| v >= goal),
            });
        }
        for r in self.workloads.iter().filter(|r| r.workload.phase == Phase::Decode) {
            let share = r.graph(true).map(|g| g.group(Group::Glue) / g.time.median);
            checks.push(TargetCheck {
                what: format!("{}: RMSNorm + residuals + SwiGLU share of the fused step", r.workload.name()),
                value: share.map_or("–".into(), |v| format!("{:.1}%", v * 100.0)),
                goal: format!("≤ {:.0}%", GLUE_SHARE_TARGET * 100.0),
                met: share.map(|v| v <= GLUE_SHARE_TARGET),
            });
        }
        checks
    }

    /// Workloads whose validation failed.
    pub fn failures(&self) -> Vec<String> {
        self.workloads
            .iter()
            .filter_map(|r| r.outcome.as_ref().err().map(|e| format!("{}: {e}", r.workload.name())))
            .collect()
    }

    /// The Markdown report.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let roof = &self.roof;
        let l = &self.model.layer;
        let bw = roof.read_bytes_per_s.median;
        let _ = writeln!(s, "# kvjit bench --ops layer ({}, {} threads)\n", self.mode, self.threads);
        let _ = writeln!(
            s,
            "CPU: {}; kvjit {}; run took {:.0} s. Layer: `{}`, one decoder layer (hidden {}, {} q / {} kv heads of \
             {}, FFN {}), {} weights ({:.0} MB in the five matmuls), page {}; {} nodes, {} steps fused; code tier \
             {}. Compiled twice from one graph with `kvjit::compile`: fused (default) and unfused (`fuse: false`){}.\n",
            self.cpu,
            env!("CARGO_PKG_VERSION"),
            self.duration.as_secs_f64(),
            l.name,
            l.hidden_size,
            l.num_q_heads,
            l.num_kv_heads,
            l.head_size,
            self.model.ffn_size,
            l.dtype,
            self.weight_bytes / 1e6,
            l.page_size,
            self.nodes.0,
            self.nodes.1.map_or("–".into(), |n| n.to_string()),
            self.tier.name(),
            self.compile_times
                .iter()
                .map(|(f, t)| format!("; compile {} {}", if *f { "fused" } else { "unfused" }, format_time(*t)))
                .collect::<String>(),
        );
        let fma256 = roof.fma256_flops_per_s.map_or(String::new(), |f| {
            format!("; 256-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1})", f.median / 1e9, f.min / 1e9, f.max / 1e9)
        });
        let _ = writeln!(
            s,
            "Roofs, {} threads, at the start and end of this run (median, min–max): read bandwidth **{:.1} GB/s** \
             ({:.1}–{:.1}); 128-bit FMA **{:.1} GFLOP/s** ({:.1}–{:.1}){fma256}.\n",
            roof.threads,
            bw / 1e9,
            roof.read_bytes_per_s.min / 1e9,
            roof.read_bytes_per_s.max / 1e9,
            roof.fma_flops_per_s.median / 1e9,
            roof.fma_flops_per_s.min / 1e9,
            roof.fma_flops_per_s.max / 1e9,
        );
        let _ = writeln!(
            s,
            "*roof* = Σ over the layer's ops of max(bytes / read bandwidth, FLOPs / FMA rate): the five matmuls \
             (bytes = their weights, FLOPs = 2·tokens·N·K) and attention (bytes = the K/V it reads, FLOPs = \
             4·Hq·D per query–key pair), the FLOPs at the {} FMA rate of the kernels' tier; RoPE, RMSNorm, \
             residuals and SwiGLU \
             count nothing. Medians of interleaved samples; *err* = normalized max error of the fused output \
             against the unfused one, checked before timing.\n",
            if self.tier_fma_is_256() { "256-bit" } else { "128-bit" },
        );

        s.push_str(
            "## The layer step (`Executor::run`), fused vs unfused\n\n\
             | workload | tokens | K/V MB | roof | bound | fused (min–max) | × roof | unfused (min–max) | × roof | \
             fused speed-up | fastest runs | err |\n\
             |---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.workloads {
            let w = &r.workload;
            let rt = self.roofs(&r.work);
            let kv: f64 = r.work.iter().filter(|o| o.role == Role::Attention).map(|o| o.bytes).sum();
            let _ = write!(
                s,
                "| {} | {} | {:.1} | {} | {} |",
                w.name(),
                w.tokens(),
                kv / 1e6,
                format_time(rt),
                self.bound(&r.work)
            );
            let cell = |g: Option<&GraphResult>| {
                g.map_or(" – | – |".to_string(), |g| {
                    let t = &g.time;
                    let spread = format!("{}–{}", format_time(t.min), format_time(t.max));
                    format!(" {} ({spread}) | {:.2} |", format_time(t.median), t.median / rt)
                })
            };
            match &r.outcome {
                Ok(_) => {
                    let _ = writeln!(
                        s,
                        "{}{} {} | {} | {} |",
                        cell(r.graph(true)),
                        cell(r.graph(false)),
                        r.speedup().map_or("–".into(), |v| format!("{v:.2}×")),
                        r.fastest_speedup().map_or("–".into(), |v| format!("{v:.2}×")),
                        if r.error.is_nan() { "–".into() } else { format!("{:.1e}", r.error) }
                    );
                }
                Err(_) => {
                    let _ = writeln!(s, " **error** (see Errors){} |", " | –".repeat(6));
                }
            }
        }

        s.push_str(
            "\n## Where the time goes (per-step executor timings, summed per group in each run; medians)\n\n\
             *matmuls* = the five projections' steps (fused: the kernels that contain them, epilogues included); \
             *attention* = RoPE + mha; *glue* = RMSNorm + residuals + SwiGLU as steps of their own (fused: the \
             RMSNorm steps only — the fused epilogues' share is inside the matmuls); *other* = views and \
             `Executor::run` outside the kernels.\n\n\
             | workload | graph | step | matmuls | GB/s | GFLOP/s | × roof | attention | × roof | glue | share | other |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.workloads {
            for g in r.outcome.iter().flatten() {
                let mm = g.group(Group::Matmuls);
                let mm_bytes: f64 = g.work_of(Group::Matmuls).map(|o| o.bytes).sum();
                let mm_flops: f64 = g.work_of(Group::Matmuls).map(|o| o.flops).sum();
                let mm_roof = self.roofs(g.work_of(Group::Matmuls));
                let at = g.group(Group::Attention);
                let at_roof = self.roofs(g.work_of(Group::Attention));
                let glue = g.group(Group::Glue);
                let other = g.group(Group::Other) + g.overhead.median;
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {:.2} | {} | {:.2} | {} | {:.1}% | {} |",
                    r.workload.name(),
                    g.name(),
                    format_time(g.time.median),
                    format_time(mm),
                    format_rate(mm_bytes / mm / 1e9),
                    format_rate(mm_flops / mm / 1e9),
                    mm / mm_roof,
                    format_time(at),
                    at / at_roof,
                    format_time(glue),
                    glue / g.time.median * 100.0,
                    format_time(other),
                );
            }
        }

        for r in &self.workloads {
            let Ok(graphs) = &r.outcome else { continue };
            let _ = writeln!(s, "\n## Steps: {}\n", r.workload.name());
            s.push_str(
                "| graph | step | computes | median | share | roof | × roof |\n|---|---|---|---:|---:|---:|---:|\n",
            );
            for g in graphs {
                for st in g.steps.iter().filter(|st| !st.roles.iter().all(|r| *r == Role::View)) {
                    let rt = self.roofs(&st.work);
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {:.1}% | {} | {} |",
                        g.name(),
                        st.label,
                        st.what(),
                        format_time(st.time.median),
                        st.time.median / g.time.median * 100.0,
                        if rt > 0.0 { format_time(rt) } else { "–".into() },
                        if rt > 0.0 { format!("{:.2}", st.time.median / rt) } else { "–".into() },
                    );
                }
            }
        }

        s.push_str("\n## Targets\n\n| target | this run | goal | |\n|---|---:|---:|---|\n");
        for t in self.targets() {
            let verdict = match t.met {
                Some(met) => pass_or_miss(met),
                None if self.failures().is_empty() => "–",
                None => "**error**",
            };
            let _ = writeln!(s, "| {} | {} | {} | {} |", t.what, t.value, t.goal, verdict);
        }
        let attention: Vec<String> = self
            .workloads
            .iter()
            .filter_map(|r| {
                let g = r.graph(true).or_else(|| r.graph(false))?;
                let at = g.group(Group::Attention);
                Some(format!(
                    "{} {} ({:.1}% of the {} step, {:.2}× its roof)",
                    r.workload.name(),
                    format_time(at),
                    at / g.time.median * 100.0,
                    g.name(),
                    at / self.roofs(g.work_of(Group::Attention)),
                ))
            })
            .collect();
        if !attention.is_empty() {
            let _ = writeln!(s, "\nAttention (RoPE + mha; no target here): {}.", attention.join("; "));
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
        let l = &self.model.layer;
        let work = |w: &OpWork| {
            json!({
                "op": w.role.name(), "bytes": w.bytes, "flops": w.flops, "roof_time_s": self.roof_time(w),
            })
        };
        let graph = |g: &GraphResult| {
            json!({
                "time": g.time.to_json(),
                "groups": Group::ALL.iter().zip(&g.groups).map(|(group, (_, stats))| {
                    let roof = self.roofs(g.work_of(*group));
                    (group.id().to_string(), json!({
                        "time": stats.to_json(),
                        "share": stats.median / g.time.median,
                        "roof_time_s": roof,
                        "of_roof": if roof > 0.0 { json!(stats.median / roof) } else { Value::Null },
                    }))
                }).collect::<serde_json::Map<_, _>>(),
                "overhead": g.overhead.to_json(),
                "steps": g.steps.iter().map(|st| json!({
                    "label": st.label,
                    "computes": st.roles.iter().map(|r| r.name()).collect::<Vec<_>>(),
                    "group": st.group().id(),
                    "kernel_key": st.key,
                    "time": st.time.to_json(),
                    "roof_time_s": self.roofs(&st.work),
                })).collect::<Vec<_>>(),
            })
        };
        json!({
            "ops": "layer",
            "mode": self.mode,
            "threads": self.threads,
            "cpu": self.cpu,
            "kvjit_version": env!("CARGO_PKG_VERSION"),
            "duration_s": self.duration.as_secs_f64(),
            "layer": {
                "name": l.name, "dtype": l.dtype.to_string(), "hidden_size": l.hidden_size,
                "num_q_heads": l.num_q_heads, "num_kv_heads": l.num_kv_heads, "head_size": l.head_size,
                "ffn_size": self.model.ffn_size, "page_size": l.page_size, "weight_bytes": self.weight_bytes,
                "nodes": self.nodes.0, "fused_nodes": self.nodes.1,
            },
            "tier": self.tier.name(),
            "compile_s": self.compile_times.iter().map(|(f, t)| {
                (if *f { "fused" } else { "unfused" }.to_string(), json!(t))
            }).collect::<serde_json::Map<_, _>>(),
            "roof": {
                "threads": self.roof.threads,
                "read_bytes_per_s": self.roof.read_bytes_per_s.to_json(),
                "fma_flops_per_s": self.roof.fma_flops_per_s.to_json(),
                "fma256_flops_per_s": self.roof.fma256_flops_per_s.map(|f| f.to_json()),
                "tier_fma_flops_per_s": self.tier_fma(),
            },
            "workloads": self.workloads.iter().map(|r| {
                let w = &r.workload;
                let rt = self.roofs(&r.work);
                let mut v = json!({
                    "name": w.name(),
                    "phase": match w.phase { Phase::Decode => "decode", Phase::Prefill => "prefill" },
                    "batch": w.batch, "history": w.history, "seq": w.seq,
                    "ops": r.work.iter().map(work).collect::<Vec<_>>(),
                    "roof_time_s": rt,
                    "normalized_error": if r.error.is_finite() { json!(r.error) } else { Value::Null },
                });
                match &r.outcome {
                    Ok(graphs) => {
                        for g in graphs {
                            let mut gv = graph(g);
                            gv["of_roof"] = json!(g.time.median / rt);
                            v[g.name()] = gv;
                        }
                        v["fused_speedup"] = json!(r.speedup());
                        v["fused_speedup_fastest"] = json!(r.fastest_speedup());
                    }
                    Err(e) => v["error"] = json!(e),
                }
                v
            }).collect::<Vec<_>>(),
            "targets": self.targets().iter().map(|t| json!({
                "what": t.what, "value": t.value, "goal": t.goal, "met": t.met,
            })).collect::<Vec<_>>(),
            "errors": self.failures(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_size_the_cache_for_every_workload() {
        for config in [LayerBenchConfig::full(), LayerBenchConfig::quick(), LayerBenchConfig::tiny()] {
            config.check().unwrap();
        }
        let model = LayerBenchConfig::full().graph_config();
        let l = &model.layer;
        assert_eq!((l.num_layers, l.max_pages_per_seq, l.num_pages), (1, 129, 8 * 129));
        let weights: usize =
            Projection::ALL.iter().map(|p| p.weight().shape(l, model.ffn_size).iter().product::<usize>()).sum();
        assert_eq!(weights, 6144 * 4096 + 4096 * 4096 + 3 * 14336 * 4096);
        let prefill = op_work(&model, &Workload::prefill(512), Role::Matmul(Projection::Gate)).unwrap();
        assert_eq!(prefill.flops, 2.0 * 512.0 * 14336.0 * 4096.0);
        let decode = op_work(&model, &Workload::decode(8, 2048), Role::Attention).unwrap();
        assert_eq!(decode.bytes, 8.0 * 2049.0 * 2.0 * 8.0 * 128.0 * 2.0);
        assert_eq!(decode.flops, 4.0 * 4096.0 * 8.0 * 2049.0);
        let attention = op_work(&model, &Workload::prefill(4), Role::Attention).unwrap();
        assert_eq!(attention.flops, heads_of(&model).prefill_flops(4));
    }

    #[test]
    fn every_node_of_the_layer_has_its_role() {
        let config = LayerBenchConfig::tiny();
        let model = config.graph_config();
        let registry = standard_registry();
        let graph = decoder_layer_graph(&model, registry.ops()).unwrap();
        let roles = node_roles(&graph, &model);
        assert!(!roles.contains(&Role::Other), "{roles:?}");
        for p in Projection::ALL {
            assert_eq!(roles.iter().filter(|r| **r == Role::Matmul(p)).count(), 1, "{p:?}: {roles:?}");
        }
        let count = |role| roles.iter().filter(|r| **r == role).count();
        assert_eq!((count(Role::RmsNorm), count(Role::Residual), count(Role::Silu), count(Role::Mul)), (2, 2, 1, 1));
        assert_eq!((count(Role::Rope), count(Role::Attention)), (1, 1));
    }

    #[test]
    fn tiny_run_validates_and_reports_every_figure() {
        let started = Instant::now();
        let report = run_layer(&LayerBenchConfig::tiny(), &mut |_| {}).unwrap();
        assert!(report.failures().is_empty(), "{:?}", report.failures());
        assert_eq!(report.workloads.len(), 3);
        for r in &report.workloads {
            assert!(r.error <= tolerance(DType::BF16), "{}: {}", r.workload.name(), r.error);
            let (fused, unfused) = (r.graph(true).unwrap(), r.graph(false).unwrap());
            assert!(fused.steps.len() < unfused.steps.len(), "fusion merged steps");
            // The fused graph's matmul steps hold all five projections, its
            // glue steps only the two RMSNorms.
            let computes = |g: &GraphResult, group| -> Vec<Role> {
                g.steps.iter().filter(|s| s.group() == group).flat_map(|s| s.roles.clone()).collect()
            };
            let mm = computes(fused, Group::Matmuls);
            assert!(Projection::ALL.iter().all(|p| mm.contains(&Role::Matmul(*p))), "{mm:?}");
            assert_eq!(computes(fused, Group::Glue), [Role::RmsNorm, Role::RmsNorm]);
            assert_eq!(computes(unfused, Group::Glue).len(), 6);
            assert!(fused.steps.iter().any(|s| s.label.contains('+')), "fused steps are labelled n7+n8");
            assert_eq!(r.work.len(), 6, "five matmuls and attention");
        }
        let targets = report.targets();
        assert_eq!(targets.len(), 1 + 3 + 2, "{targets:?}");
        assert!(targets.iter().all(|t| t.met.is_some()), "{targets:?}");
        let markdown = report.to_markdown();
        for heading in ["## The layer step", "## Where the time goes", "## Steps: prefill 12 tokens", "## Targets"] {
            assert!(markdown.contains(heading), "'{heading}' missing: {markdown}");
        }
        assert!(!markdown.contains("## Errors") && !markdown.contains("**error**"), "{markdown}");
        let json = report.to_json();
        assert_eq!(json["workloads"].as_array().unwrap().len(), 3);
        assert!(json["workloads"][2]["fused_speedup"].as_f64().unwrap() > 0.0);
        assert!(json["workloads"][0]["fused"]["groups"]["matmuls"]["time"]["median"].as_f64().unwrap() > 0.0);
        assert!(started.elapsed() < Duration::from_secs(20), "tiny took {:?}", started.elapsed());
    }

    #[test]
    fn no_fuse_times_the_unfused_layer_alone() {
        let config = LayerBenchConfig {
            unfused_only: true,
            workloads: vec![Workload::decode(2, 9)],
            ..LayerBenchConfig::tiny()
        };
        let report = run_layer(&config, &mut |_| {}).unwrap();
        let r = &report.workloads[0];
        assert!(r.graph(true).is_none() && r.graph(false).is_some() && r.error.is_nan());
        assert!(report.targets().iter().all(|t| t.met.is_none()), "{:?}", report.targets());
        assert!(report.to_markdown().contains("| – |"));
    }
}
