//! Start-up benchmark (`kvjit bench --startup`): how long a fresh `kvjit`
//! process takes from files on disk to its first output, how much memory it
//! holds, how long its JIT compiles take, and how fast it decodes after.
//!
//! [`run_startup`] writes a Llama-3-8B-shaped QKV graph in bf16 with `L`
//! layers (hidden 4096, 32 query heads, 8 KV heads of 128, page 16: one
//! [6144, 4096] weight of 50.3 MB per layer) into a temporary directory —
//! `model.json` + `model.safetensors` (real weight data, not random-init
//! recipes) — and compiles it with `kvjit compile` into `model.kvjit`. Then
//! it times child processes of the `kvjit` binary, in interleaved rounds (one
//! unmeasured warm-up round first, so the page cache is warm):
//!
//! - `cat` of both files (the reference: reading the bytes from the page
//!   cache);
//! - `kvjit validate model.json`;
//! - `kvjit run … --steps 0 --batch 1 --seq 1` from the graph file
//!   (`--weights map` and `copy`) and from the artifact: the wall clock of
//!   the whole process, its peak RSS and its JIT compile log;
//! - `kvjit run … --steps 20 --batch 1 --seq 1` of each: the median time of
//!   its decode steps (pooled over the runs; no warm-up round, the files are
//!   warm by then).
//!
//! Every figure is a median over the runs; [`StartupReport`] renders them as
//! Markdown (with targets and pass/miss) and JSON.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvjit::models::llama::{LayerConfig, output_name};
use kvjit::ops::fused_qkv_matmul;
use kvjit::{DType, Dim, GraphBuilder, Tensor, bf16, save_graph, standard_registry};
use rayon::prelude::*;
use serde_json::{Value, json};

use crate::render::{format_time, pass_or_miss};
use crate::timing::Stats;
use crate::{BenchError, Progress, Result, Steps};

/// Target of `kvjit validate model.json`.
pub const VALIDATE_TARGET: Duration = Duration::from_millis(30);
/// Target of artifact → first output.
pub const ARTIFACT_START_TARGET: Duration = Duration::from_millis(150);
/// Target of graph file → first output, as a multiple of `cat model.safetensors`.
pub const GRAPH_START_VS_CAT: f64 = 2.0;
/// Target peak RSS from the artifact, as a multiple of weight + KV cache bytes.
pub const ARTIFACT_RSS_TARGET: f64 = 1.15;
/// Target peak RSS from the graph file, as a multiple of weight + KV cache bytes.
pub const GRAPH_RSS_TARGET: f64 = 2.1;
/// Target of a process's first JIT compile.
pub const FIRST_JIT_TARGET: Duration = Duration::from_millis(3);
/// Target of each further JIT compile.
pub const FURTHER_JIT_TARGET: Duration = Duration::from_millis(2);

/// What a start-up run measures.
#[derive(Clone, Debug, PartialEq)]
pub struct StartupConfig {
    /// Layers of the graph (32: Llama-3-8B).
    pub layers: usize,
    /// Measured runs of each process (after one warm-up run).
    pub runs: usize,
    /// Decode steps of the steady-state runs.
    pub decode_steps: usize,
    /// `--threads` of `kvjit run`, if given.
    pub threads: Option<usize>,
    /// The `kvjit` binary the child processes run.
    pub kvjit: PathBuf,
    /// Write the files here and keep them (default: a temporary directory,
    /// removed after the run).
    pub keep_dir: Option<PathBuf>,
}

impl StartupConfig {
    /// Llama-3-8B: 32 layers, 5 runs, 20 decode steps, with this binary.
    pub fn new(kvjit: PathBuf) -> Self {
        Self { layers: 32, runs: 5, decode_steps: 20, threads: None, kvjit, keep_dir: None }
    }

    /// The layer shape of the graph: Llama-3-8B in bf16 with `layers` layers.
    pub fn layer_config(&self) -> LayerConfig {
        LayerConfig {
            name: format!("llama3_8b_{}_layers", self.layers),
            dtype: DType::BF16,
            num_layers: self.layers,
            ..LayerConfig::llama3_8b()
        }
    }

    /// Refuse configurations that cannot run.
    pub fn check(&self) -> Result<()> {
        if self.layers == 0 {
            return Err(BenchError::Zero { what: "--startup-layers" });
        }
        if self.runs == 0 {
            return Err(BenchError::Zero { what: "--startup-runs" });
        }
        if self.decode_steps == 0 {
            return Err(BenchError::Zero { what: "decode steps" });
        }
        // The copy-mode runs hold every weight in memory (and the run
        // writes them twice: the weights file and the artifact).
        let layer = self.layer_config();
        let weight_bytes =
            (layer.num_layers as u64).saturating_mul((layer.n() * layer.hidden_size * layer.dtype.size_bytes()) as u64);
        if let Some(memory) = kvjit_runtime::physical_memory().filter(|&memory| weight_bytes > memory) {
            return Err(BenchError::TooLarge(format!(
                "--startup-layers {} takes {:.1} GB of weights (written twice, held in memory by the copy runs), \
                 more than this machine's {:.1} GB of memory",
                self.layers,
                weight_bytes as f64 / 1e9,
                memory as f64 / 1e9
            )));
        }
        Ok(())
    }
}

/// JIT compiles of one kind of process, from its compile log.
#[derive(Clone, Debug, PartialEq)]
pub struct JitFigures {
    /// Compiles per process (of the last run).
    pub compiles: usize,
    /// Seconds of the first compile (over the runs).
    pub first: Stats,
    /// Seconds of every further compile (pooled over the runs), if any.
    pub further: Option<Stats>,
}

/// One process, timed.
#[derive(Clone, Debug, PartialEq)]
pub struct Timed {
    /// The command line, as a person would type it.
    pub command: String,
    /// Seconds of wall clock, spawn to exit.
    pub wall: Stats,
    /// Peak RSS in bytes (`kvjit run` only).
    pub peak_rss: Option<Stats>,
    /// Its JIT compiles (`kvjit run` only, if it compiled).
    pub jit: Option<JitFigures>,
}

/// Steady-state decode of one way of starting.
#[derive(Clone, Debug, PartialEq)]
pub struct Decode {
    /// The command line.
    pub command: String,
    /// Seconds per decode step, pooled over the runs.
    pub step: Stats,
}

/// Everything one start-up run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct StartupReport {
    /// Layers of the graph.
    pub layers: usize,
    /// Measured runs of each process.
    pub runs: usize,
    /// `--threads` given to `kvjit run`.
    pub threads: Option<usize>,
    /// The CPU, as the OS names it.
    pub cpu: String,
    /// Bytes of weight data (bf16).
    pub weight_bytes: u64,
    /// Bytes of the KV cache `kvjit run` allocates (batch 1).
    pub kv_cache_bytes: u64,
    /// Size of model.safetensors.
    pub safetensors_bytes: u64,
    /// Size of model.kvjit.
    pub artifact_bytes: u64,
    /// Writing model.json + model.safetensors (generating the weights included).
    pub generate_time: Duration,
    /// `kvjit compile model.json -o model.kvjit`, one run.
    pub compile_time: Duration,
    /// `cat model.safetensors > /dev/null`.
    pub cat_weights: Timed,
    /// `cat model.kvjit > /dev/null`.
    pub cat_artifact: Timed,
    /// `kvjit validate model.json`.
    pub validate: Timed,
    /// Graph file → first output, weights mapped.
    pub start_map: Timed,
    /// Graph file → first output, weights copied.
    pub start_copy: Timed,
    /// Artifact → first output.
    pub start_artifact: Timed,
    /// Decode from the graph file, weights mapped.
    pub decode_map: Decode,
    /// Decode from the graph file, weights copied.
    pub decode_copy: Decode,
    /// Decode from the artifact.
    pub decode_artifact: Decode,
    /// Wall time of the whole run.
    pub duration: Duration,
}

/// Fill `values` with a cheap deterministic pattern, uniform-ish in
/// [-bound, bound): xorshift64*, four values per draw, chunks in parallel.
fn fill_weights(values: &mut [bf16], seed: u64, bound: f32) {
    const CHUNK: usize = 1 << 16;
    values.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        // splitmix64 of (seed, chunk): distinct, non-zero xorshift states.
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_add(0xD1B5_4A32_D192_ED03);
        state = (state ^ (state >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        state = (state ^ (state >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        state = (state ^ (state >> 31)) | 1;
        let scale = bound / 32768.0;
        for quad in chunk.chunks_mut(4) {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            for (j, v) in quad.iter_mut().enumerate() {
                *v = bf16::from_f32((bits >> (16 * j)) as u16 as i16 as f32 * scale);
            }
        }
    });
}

/// Write the graph of `config` (weights as data) to `dir/model.json` +
/// `dir/model.safetensors`.
fn write_model(config: &LayerConfig, dir: &Path) -> Result<PathBuf> {
    let registry = standard_registry();
    let mut b = GraphBuilder::new(&config.name, registry.ops());
    let batch = Dim::from("batch");
    let hidden =
        b.input("hidden_state", config.dtype, &[batch.clone(), Dim::from("seq"), Dim::from(config.hidden_size)])?;
    let valid = b.input("valid_lengths", DType::U32, std::slice::from_ref(&batch))?;
    let cache = b.kv_cache("kv_cache", config.cache_type())?;
    let bound = 1.0 / (config.hidden_size as f32).sqrt();
    for layer in 0..config.num_layers {
        let prefix = if config.num_layers == 1 { String::new() } else { format!("layers.{layer}.") };
        let shape = [config.n(), config.hidden_size];
        let mut values = vec![bf16::ZERO; shape[0] * shape[1]];
        fill_weights(&mut values, config.weight_seed + layer as u64, bound);
        let weight = b.constant(&format!("{prefix}qkv_weight"), Tensor::from_vec(&shape, values)?)?;
        let layer_idx = b.input(&format!("{prefix}layer_idx"), DType::U32, &[])?;
        let q = fused_qkv_matmul(&mut b, [hidden, weight, cache, layer_idx, valid], config.qkv_params())?;
        b.output(&output_name(config, layer), q)?;
    }
    let graph = b.finish()?;
    let path = dir.join("model.json");
    save_graph(&graph, &path)?;
    Ok(path)
}

/// What one child process gave back.
struct Sample {
    wall: f64,
    stdout: String,
}

/// A child process to time: the program, its arguments, and whether its
/// stdout is kept (else it goes to /dev/null).
#[derive(Clone)]
struct Child {
    program: PathBuf,
    args: Vec<String>,
    keep_stdout: bool,
}

impl Child {
    fn describe(&self) -> String {
        let name =
            self.program.file_name().map_or_else(|| self.program.display().to_string(), |n| n.to_string_lossy().into());
        let mut text = std::iter::once(name).chain(self.args.iter().cloned()).collect::<Vec<_>>().join(" ");
        if !self.keep_stdout {
            text.push_str(" > /dev/null");
        }
        text
    }

    fn run(&self, dir: &Path) -> Result<Sample> {
        let mut command = Command::new(&self.program);
        command.args(&self.args).current_dir(dir).stdin(Stdio::null()).stderr(Stdio::piped());
        command.stdout(if self.keep_stdout { Stdio::piped() } else { Stdio::null() });
        let started = Instant::now();
        let output = command.output().map_err(|source| BenchError::Spawn { command: self.describe(), source })?;
        let wall = started.elapsed().as_secs_f64();
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let first = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("(no output on stderr)");
            return Err(BenchError::ChildFailed {
                command: self.describe(),
                status: output.status,
                stderr: first.trim().to_string(),
            });
        }
        Ok(Sample { wall, stdout: String::from_utf8_lossy(&output.stdout).into_owned() })
    }
}

/// Parse a duration as the CLI prints it: `12.345 ms`, `1.23 s` (also µs, ns).
pub fn parse_duration(value: &str, unit: &str) -> Option<f64> {
    let value: f64 = value.parse().ok()?;
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" | "us" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    };
    Some(value * scale)
}

/// The figures `kvjit run` prints.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunFigures {
    /// `peak RSS: 123.4 MB`, in bytes.
    pub peak_rss: Option<f64>,
    /// Seconds of each JIT compile, in the log's order.
    pub jit: Vec<f64>,
    /// Seconds of each decode step.
    pub decode: Vec<f64>,
}

/// Read the peak RSS, JIT compile log and decode step times from `kvjit
/// run`'s output.
pub fn parse_run_output(text: &str) -> Result<RunFigures> {
    let bad = |line: &str, what: &'static str| BenchError::RunOutput { what, line: line.to_string() };
    let mut figures = RunFigures::default();
    let mut section = "";
    for line in text.lines() {
        if line.starts_with("step ") {
            section = "steps";
            continue;
        }
        if line == "JIT compile log:" {
            section = "jit";
            continue;
        }
        if let Some(rest) = line.strip_prefix("peak RSS:") {
            let mb = rest.trim().strip_suffix("MB").and_then(|v| v.trim().parse::<f64>().ok());
            figures.peak_rss = Some(mb.ok_or_else(|| bad(line, "the peak RSS"))? * 1e6);
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        match section {
            "steps" if fields.is_empty() => section = "",
            "steps" if fields.get(1) == Some(&"decode") => {
                let n = fields.len();
                let time = parse_duration(fields[n - 2], fields[n - 1]);
                figures.decode.push(time.ok_or_else(|| bad(line, "a step time"))?);
            }
            "jit" if line.starts_with("  ") && fields.len() >= 2 => {
                figures.jit.push(parse_duration(fields[0], fields[1]).ok_or_else(|| bad(line, "a compile time"))?);
            }
            "jit" => section = "",
            _ => {}
        }
    }
    Ok(figures)
}

/// Which figures a probe yields.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Wall clock only.
    Plain,
    /// `kvjit run --steps 0`: wall clock, peak RSS, JIT log.
    Start,
    /// `kvjit run --steps N`: decode step times.
    Decode,
}

struct Probe {
    child: Child,
    kind: Kind,
    samples: Vec<Sample>,
    figures: Vec<RunFigures>,
}

impl Probe {
    fn new(program: impl Into<PathBuf>, args: &[&str], kind: Kind) -> Self {
        let child = Child {
            program: program.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            keep_stdout: kind != Kind::Plain,
        };
        Self { child, kind, samples: Vec::new(), figures: Vec::new() }
    }

    /// Run once; keep the figures if `measured`.
    fn run(&mut self, dir: &Path, measured: bool) -> Result<()> {
        let sample = self.child.run(dir)?;
        let figures = if self.kind == Kind::Plain { RunFigures::default() } else { parse_run_output(&sample.stdout)? };
        if self.kind == Kind::Start && figures.peak_rss.is_none() {
            return Err(BenchError::MissingFigure { command: self.child.describe(), what: "'peak RSS' line" });
        }
        if self.kind == Kind::Decode && figures.decode.is_empty() {
            return Err(BenchError::MissingFigure { command: self.child.describe(), what: "decode steps" });
        }
        if measured {
            self.samples.push(sample);
            self.figures.push(figures);
        }
        Ok(())
    }

    fn timed(&self) -> Timed {
        let walls: Vec<f64> = self.samples.iter().map(|s| s.wall).collect();
        let rss: Vec<f64> = self.figures.iter().filter_map(|f| f.peak_rss).collect();
        let firsts: Vec<f64> = self.figures.iter().filter_map(|f| f.jit.first().copied()).collect();
        let further: Vec<f64> = self.figures.iter().flat_map(|f| f.jit.iter().skip(1).copied()).collect();
        Timed {
            command: self.child.describe(),
            wall: Stats::from_samples(&walls),
            peak_rss: (!rss.is_empty()).then(|| Stats::from_samples(&rss)),
            jit: (!firsts.is_empty()).then(|| JitFigures {
                compiles: self.figures.last().map_or(0, |f| f.jit.len()),
                first: Stats::from_samples(&firsts),
                further: (!further.is_empty()).then(|| Stats::from_samples(&further)),
            }),
        }
    }

    fn decode(&self) -> Decode {
        let steps: Vec<f64> = self.figures.iter().flat_map(|f| f.decode.iter().copied()).collect();
        Decode { command: self.child.describe(), step: Stats::from_samples(&steps) }
    }
}

/// Run the start-up benchmark of `config`, calling `progress` before every step.
pub fn run_startup(config: &StartupConfig, progress: &mut dyn FnMut(&Progress)) -> Result<StartupReport> {
    config.check()?;
    let layer = config.layer_config();
    let (start_probes, decode_probes) = (6, 3);
    let mut steps = Steps::new(2 + (config.runs + 1) * start_probes + config.runs * decode_probes, progress);

    // The temporary directory (if any) lives until the end of the run.
    let (_temporary, dir_path) = match &config.keep_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|source| BenchError::CreateDir { path: dir.clone(), source })?;
            (None, dir.clone())
        }
        None => {
            let tmp = std::env::temp_dir();
            let dir = tempfile::Builder::new()
                .prefix("kvjit-startup-")
                .tempdir_in(&tmp)
                .map_err(|source| BenchError::TempDir { parent: tmp.clone(), source })?;
            let path = dir.path().to_path_buf();
            (Some(dir), path)
        }
    };

    steps.start(format!("writing a {}-layer bf16 graph file and its weights", layer.num_layers));
    let t = Instant::now();
    write_model(&layer, &dir_path)?;
    let generate_time = t.elapsed();

    steps.start("kvjit compile model.json -o model.kvjit");
    let t = Instant::now();
    Probe::new(&config.kvjit, &["compile", "model.json", "-o", "model.kvjit"], Kind::Plain).run(&dir_path, false)?;
    let compile_time = t.elapsed();

    let size = |name: &str| {
        std::fs::metadata(dir_path.join(name))
            .map(|m| m.len())
            .map_err(|source| BenchError::Read { path: dir_path.join(name), source })
    };
    let safetensors_bytes = size("model.safetensors")?;
    let artifact_bytes = size("model.kvjit")?;

    let threads = config.threads.map(|t| t.to_string());
    let run_args = |file: &'static str, weights: Option<&'static str>, steps: usize| -> Vec<String> {
        let mut args: Vec<String> = ["run", file, "--steps", &steps.to_string(), "--batch", "1", "--seq", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if let Some(w) = weights {
            args.extend(["--weights".to_string(), w.to_string()]);
        }
        if let Some(t) = &threads {
            args.extend(["--threads".to_string(), t.clone()]);
        }
        args
    };
    let kvjit_run = |file: &'static str, weights: Option<&'static str>, steps: usize, kind: Kind| {
        let args = run_args(file, weights, steps);
        Probe::new(&config.kvjit, &args.iter().map(String::as_str).collect::<Vec<_>>(), kind)
    };

    let mut starts = [
        Probe::new("cat", &["model.safetensors"], Kind::Plain),
        Probe::new("cat", &["model.kvjit"], Kind::Plain),
        Probe::new(&config.kvjit, &["validate", "model.json"], Kind::Plain),
        kvjit_run("model.json", Some("map"), 0, Kind::Start),
        kvjit_run("model.json", Some("copy"), 0, Kind::Start),
        kvjit_run("model.kvjit", None, 0, Kind::Start),
    ];
    debug_assert_eq!(starts.len(), start_probes);
    // Round 0 is the warm-up; each round starts with a different probe, so
    // slow drifts of the machine hit all of them alike.
    for round in 0..=config.runs {
        for i in 0..starts.len() {
            let probe = &mut starts[(i + round) % start_probes];
            let label = if round == 0 { "warm-up".to_string() } else { format!("run {round}/{}", config.runs) };
            steps.start(format!("{label}: {}", probe.child.describe()));
            probe.run(&dir_path, round > 0)?;
        }
    }

    let decode_steps = config.decode_steps;
    let mut decodes = [
        kvjit_run("model.json", Some("map"), decode_steps, Kind::Decode),
        kvjit_run("model.json", Some("copy"), decode_steps, Kind::Decode),
        kvjit_run("model.kvjit", None, decode_steps, Kind::Decode),
    ];
    debug_assert_eq!(decodes.len(), decode_probes);
    for round in 1..=config.runs {
        for i in 0..decodes.len() {
            let probe = &mut decodes[(i + round) % decode_probes];
            steps.start(format!("decode run {round}/{}: {}", config.runs, probe.child.describe()));
            probe.run(&dir_path, true)?;
        }
    }

    let weight_bytes = (layer.num_layers * layer.n() * layer.hidden_size * layer.dtype.size_bytes()) as u64;
    // The cache `kvjit run` allocates: [pages, 2, L, page, Hkv, D] (its
    // page count is static in the graph, whatever the batch).
    let kv_cache_bytes = (layer.num_pages
        * 2
        * layer.num_layers
        * layer.page_size
        * layer.num_kv_heads
        * layer.head_size
        * layer.dtype.size_bytes()) as u64;
    let [cat_weights, cat_artifact, validate, start_map, start_copy, start_artifact] =
        [0, 1, 2, 3, 4, 5].map(|i| starts[i].timed());
    let [decode_map, decode_copy, decode_artifact] = [0, 1, 2].map(|i| decodes[i].decode());
    Ok(StartupReport {
        layers: layer.num_layers,
        runs: config.runs,
        threads: config.threads,
        cpu: crate::cpu_name(),
        weight_bytes,
        kv_cache_bytes,
        safetensors_bytes,
        artifact_bytes,
        generate_time,
        compile_time,
        cat_weights,
        cat_artifact,
        validate,
        start_map,
        start_copy,
        start_artifact,
        decode_map,
        decode_copy,
        decode_artifact,
        duration: steps.elapsed(),
    })
}

fn spread(s: &Stats, format: impl Fn(f64) -> String) -> String {
    format!("{}–{}", format(s.min), format(s.max))
}

fn megabytes(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1e6)
}

/// One row of the Markdown table.
struct Row {
    figure: String,
    median: String,
    spread: String,
    target: String,
    result: String,
}

impl StartupReport {
    /// Weight + KV cache bytes: what a run cannot do without.
    pub fn resident_floor(&self) -> f64 {
        (self.weight_bytes + self.kv_cache_bytes) as f64
    }

    /// The target of graph file → first output, in seconds.
    pub fn graph_start_target(&self) -> f64 {
        GRAPH_START_VS_CAT * self.cat_weights.wall.median
    }

    /// Decode step time with copied weights / with mapped weights.
    pub fn copy_vs_map(&self) -> f64 {
        self.decode_copy.step.median / self.decode_map.step.median
    }

    /// Decode step time from the artifact / with mapped weights.
    pub fn artifact_vs_map(&self) -> f64 {
        self.decode_artifact.step.median / self.decode_map.step.median
    }

    fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        let time_row = |figure: &str, t: &Timed, target: Option<f64>, target_text: String| Row {
            figure: figure.to_string(),
            median: format_time(t.wall.median),
            spread: spread(&t.wall, format_time),
            target: target_text,
            result: target.map_or_else(|| "—".into(), |limit| pass_or_miss(t.wall.median <= limit).into()),
        };
        let cat_target = self.graph_start_target();
        rows.push(time_row(
            &format!("`cat model.safetensors` ({:.2} GB): reference", self.safetensors_bytes as f64 / 1e9),
            &self.cat_weights,
            None,
            "—".into(),
        ));
        rows.push(time_row(
            &format!("`cat model.kvjit` ({:.2} GB)", self.artifact_bytes as f64 / 1e9),
            &self.cat_artifact,
            None,
            "—".into(),
        ));
        rows.push(time_row(
            "`kvjit validate model.json`",
            &self.validate,
            Some(VALIDATE_TARGET.as_secs_f64()),
            format!("≤ {}", format_time(VALIDATE_TARGET.as_secs_f64())),
        ));
        let graph_target = format!("≤ {GRAPH_START_VS_CAT}× cat = {}", format_time(cat_target));
        rows.push(time_row(
            "graph file → first output, `--weights map`",
            &self.start_map,
            Some(cat_target),
            graph_target.clone(),
        ));
        rows.push(time_row(
            "graph file → first output, `--weights copy`",
            &self.start_copy,
            Some(cat_target),
            graph_target,
        ));
        rows.push(time_row(
            "artifact → first output",
            &self.start_artifact,
            Some(ARTIFACT_START_TARGET.as_secs_f64()),
            format!("≤ {}", format_time(ARTIFACT_START_TARGET.as_secs_f64())),
        ));
        let floor = self.resident_floor();
        for (what, t, target) in [
            ("graph file, map", &self.start_map, GRAPH_RSS_TARGET),
            ("graph file, copy", &self.start_copy, GRAPH_RSS_TARGET),
            ("artifact", &self.start_artifact, ARTIFACT_RSS_TARGET),
        ] {
            if let Some(rss) = &t.peak_rss {
                let ratio = rss.median / floor;
                rows.push(Row {
                    figure: format!("peak RSS, {what}"),
                    median: format!("{} ({ratio:.2}×)", megabytes(rss.median)),
                    spread: spread(rss, megabytes),
                    target: format!("≤ {target}× = {}", megabytes(target * floor)),
                    result: pass_or_miss(ratio <= target).into(),
                });
            }
        }
        for (what, t) in [
            ("graph file, map", &self.start_map),
            ("graph file, copy", &self.start_copy),
            ("artifact", &self.start_artifact),
        ] {
            match &t.jit {
                Some(jit) => {
                    rows.push(Row {
                        figure: format!("first JIT compile, {what} ({} per process)", jit.compiles),
                        median: format_time(jit.first.median),
                        spread: spread(&jit.first, format_time),
                        target: format!("≤ {}", format_time(FIRST_JIT_TARGET.as_secs_f64())),
                        result: pass_or_miss(jit.first.median <= FIRST_JIT_TARGET.as_secs_f64()).into(),
                    });
                    if let Some(further) = &jit.further {
                        rows.push(Row {
                            figure: format!("further JIT compiles, {what} (each)"),
                            median: format_time(further.median),
                            spread: spread(further, format_time),
                            target: format!("≤ {}", format_time(FURTHER_JIT_TARGET.as_secs_f64())),
                            result: pass_or_miss(further.median <= FURTHER_JIT_TARGET.as_secs_f64()).into(),
                        });
                    }
                }
                None => rows.push(Row {
                    figure: format!("JIT compiles, {what}"),
                    median: "none".into(),
                    spread: "—".into(),
                    target: "—".into(),
                    result: "—".into(),
                }),
            }
        }
        for (what, d) in [
            ("graph file, map", &self.decode_map),
            ("graph file, copy", &self.decode_copy),
            ("artifact", &self.decode_artifact),
        ] {
            rows.push(Row {
                figure: format!("decode step, {what}"),
                median: format_time(d.step.median),
                spread: spread(&d.step, format_time),
                target: "—".into(),
                result: "—".into(),
            });
        }
        for (what, ratio) in [("copy / map", self.copy_vs_map()), ("artifact / map", self.artifact_vs_map())] {
            rows.push(Row {
                figure: format!("decode step time, {what}"),
                median: format!("{ratio:.2}×"),
                spread: "—".into(),
                target: "—".into(),
                result: "—".into(),
            });
        }
        rows
    }

    /// The Markdown report: one table of every figure with its target.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let threads = self.threads.map_or_else(|| "default threads".to_string(), |t| format!("{t} threads"));
        let _ = writeln!(s, "# kvjit bench --startup ({} layers, {} runs, {threads})\n", self.layers, self.runs);
        let _ = writeln!(
            s,
            "CPU: {}; kvjit {}; run took {:.0} s.\n",
            self.cpu,
            env!("CARGO_PKG_VERSION"),
            self.duration.as_secs_f64()
        );
        let _ = writeln!(
            s,
            "Llama-3-8B QKV projection in bf16, {} layers (hidden 4096, 32 q heads, 8 kv heads of 128, page 16): \
             weights {:.1} MB, KV cache {:.1} MB (batch 1). Writing the graph file and weights took {:.1} s; \
             `kvjit compile` took {:.1} s.\n",
            self.layers,
            self.weight_bytes as f64 / 1e6,
            self.kv_cache_bytes as f64 / 1e6,
            self.generate_time.as_secs_f64(),
            self.compile_time.as_secs_f64(),
        );
        s.push_str(
            "Each figure is the median over fresh `kvjit` processes (wall clock, spawn to exit), page cache warm \
             (one unmeasured warm-up run of each first). *First output* = `kvjit run FILE --steps 0 --batch 1 \
             --seq 1`; peak RSS is its `VmHWM` (mapped file pages included), × = of weight + KV cache bytes. JIT \
             times are from its compile log. Decode steps: `--steps 20`, the median of every run's decode steps.\n\n",
        );
        s.push_str("| figure | median | spread | target | result |\n|---|---:|---:|---|---|\n");
        for r in self.rows() {
            let _ = writeln!(s, "| {} | {} | {} | {} | {} |", r.figure, r.median, r.spread, r.target, r.result);
        }
        s
    }

    /// Every figure, in seconds and bytes.
    pub fn to_json(&self) -> Value {
        let timed = |t: &Timed| {
            json!({
                "command": t.command,
                "wall_s": t.wall.to_json(),
                "peak_rss_bytes": t.peak_rss.as_ref().map(Stats::to_json),
                "peak_rss_vs_weights_and_cache": t.peak_rss.as_ref().map(|r| r.median / self.resident_floor()),
                "jit": t.jit.as_ref().map(|j| json!({
                    "compiles": j.compiles,
                    "first_s": j.first.to_json(),
                    "further_s": j.further.as_ref().map(Stats::to_json),
                })),
            })
        };
        let decode = |d: &Decode| json!({ "command": d.command, "step_s": d.step.to_json() });
        json!({
            "mode": "startup",
            "layers": self.layers,
            "runs": self.runs,
            "threads": self.threads,
            "cpu": self.cpu,
            "duration_s": self.duration.as_secs_f64(),
            "weight_bytes": self.weight_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "safetensors_bytes": self.safetensors_bytes,
            "artifact_bytes": self.artifact_bytes,
            "generate_s": self.generate_time.as_secs_f64(),
            "compile_s": self.compile_time.as_secs_f64(),
            "cat_safetensors": timed(&self.cat_weights),
            "cat_artifact": timed(&self.cat_artifact),
            "validate": timed(&self.validate),
            "first_output_map": timed(&self.start_map),
            "first_output_copy": timed(&self.start_copy),
            "first_output_artifact": timed(&self.start_artifact),
            "decode_map": decode(&self.decode_map),
            "decode_copy": decode(&self.decode_copy),
            "decode_artifact": decode(&self.decode_artifact),
            "decode_copy_vs_map": self.copy_vs_map(),
            "decode_artifact_vs_map": self.artifact_vs_map(),
            "targets": {
                "validate_s": VALIDATE_TARGET.as_secs_f64(),
                "first_output_graph_s": self.graph_start_target(),
                "first_output_artifact_s": ARTIFACT_START_TARGET.as_secs_f64(),
                "peak_rss_graph_ratio": GRAPH_RSS_TARGET,
                "peak_rss_artifact_ratio": ARTIFACT_RSS_TARGET,
                "first_jit_s": FIRST_JIT_TARGET.as_secs_f64(),
                "further_jit_s": FURTHER_JIT_TARGET.as_secs_f64(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_output_parses() {
        let text = "\
graph 'g': 2 node(s), target cpu, 2 threads, seed 7
compiled 2 kernel(s) in 8.123 ms
  n0   key [jit]

step  kind     valid lengths            cache lengths before           tokens         time
0     prefill  [1]                      [17]                                1    40.100 ms
1     decode   [1]                      [18]                                1    12.500 ms
2     decode   [1]                      [19]                                1      1.25 s

time per node (mean of 3 steps):
  n0      1.000 ms  key
cache 'kv_cache': 3 tokens written, lengths now [20]
JIT compile log:
       5.734 ms    9000 B  fused_qkv[bf16]  (first use)
       1.500 ms     800 B  other key  (new shape)
output 'q': bf16[1, 1, 4096] checksum sum=1.0 abs_sum=2.0
peak RSS: 123.4 MB
";
        let f = parse_run_output(text).unwrap();
        assert_eq!(f.peak_rss, Some(123.4e6));
        assert_eq!(f.decode.len(), 2);
        assert!((f.decode[0] - 0.0125).abs() < 1e-12 && (f.decode[1] - 1.25).abs() < 1e-12);
        assert_eq!(f.jit.len(), 2);
        assert!((f.jit[0] - 5.734e-3).abs() < 1e-12);
        assert!(parse_run_output("peak RSS: lots").is_err());
        assert_eq!(parse_duration("3", "parsecs"), None);
    }

    #[test]
    fn weights_fill_deterministically_within_bounds() {
        let mut a = vec![bf16::ZERO; 100_003];
        let mut b = a.clone();
        fill_weights(&mut a, 5, 0.5);
        fill_weights(&mut b, 5, 0.5);
        assert_eq!(a, b);
        fill_weights(&mut b, 4, 0.5);
        assert_ne!(a[..4096], b[..4096], "seeds 4 and 5 fill differently");
        assert!(a.iter().all(|v| v.to_f32().abs() <= 0.5));
        let mean = a.iter().map(|v| v.to_f32() as f64).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!(a.iter().filter(|v| v.to_f32() == 0.0).count() < 100);
    }
}
