//! The `kvjit bench` subcommand: its options ([`BenchArgs`], a clap
//! `Args` struct the `kvjit` binary embeds) and [`run_bench`], which turns
//! them into the configuration of a suite (the QKV [`BenchConfig`], `--ops
//! attention`, `--ops fp8`, `--ops layer`, or with `--startup` the start-up benchmark of
//! [`crate::startup`]) and runs it through one driver: a progress display on
//! stderr, the Markdown report on stdout, the JSON (and the QKV suite's SVG)
//! files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use kvjit_core::DType;
use serde_json::Value;

use crate::attention::{AttentionBenchConfig, AttentionReport, run_attention};
use crate::blocks::{BlocksBenchConfig, BlocksReport, run_blocks};
use crate::fp8::{Fp8BenchConfig, Fp8Report, run_fp8};
use crate::layer::{LayerBenchConfig, LayerReport, run_layer};
use crate::model::{ModelBenchConfig, ModelReport, run_model};
use crate::startup::{StartupConfig, StartupReport, run_startup};
use crate::{BenchConfig, BenchError, Implementation, ModelShape, Progress, Result};

/// Which suite `kvjit bench` runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchOps {
    /// The fused QKV projection against GEMM-library peers (the default).
    #[default]
    Qkv,
    /// Paged flash attention (decode and prefill) against gather + `gemm`,
    /// RoPE's share of a step, and the whole attention-step graph, on the
    /// roofs (Llama-3-8B heads).
    Attention,
    /// An FP8 (f8e4m3, g = 128) KV cache against a bf16 one: the fused
    /// store, decode attention at contexts 2048 and 8192, the whole step
    /// graph, bytes per token (honours --quick, --threads, --json).
    Fp8,
    /// One whole Llama-3-8B decoder layer (bf16), compiled fused and
    /// unfused and timed side by side: decode at batch 1 and 8 with a
    /// history of 2048, a 512-token prefill, against the sum of its ops'
    /// roofs, with the time per group of steps (honours --quick, --threads,
    /// --no-fuse, --json).
    Layer,
    /// A whole model from a GGUF file (--gguf PATH, dequantized to bf16
    /// and f32, or --dtypes): prefill tokens/s at 128 and 512 tokens,
    /// decode tokens/s at contexts 128 and 2048, decode on the read roof,
    /// the executor's overhead per decode step, against llama.cpp (set
    /// KVJIT_LLAMA_CPP; else its figures quoted in issue 23).
    Model,
    /// `mo.matmul` on weights in the GGUF block formats (Q8_0, Q4_0, Q4_1,
    /// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) against bf16 and f32, at Llama-3-8B shapes: the decode
    /// GEMV from DRAM on the read roof and the prefill GEMM (honours
    /// --quick, --threads, --json).
    Blocks,
}

impl std::fmt::Display for BenchOps {
    /// The value `--ops` takes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = clap::ValueEnum::to_possible_value(self).expect("no suite is skipped");
        f.write_str(value.get_name())
    }
}

/// Options of `kvjit bench`.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// The suite: qkv (fused QKV kernels), attention (paged attention,
    /// RoPE and the whole attention step; honours --quick, --threads,
    /// --dtypes of the decode runs, --json), fp8 (an FP8 KV cache against
    /// bf16), or layer (a whole Llama-3-8B decoder layer, fused vs
    /// unfused; honours --quick, --threads, --no-fuse, --json).
    #[arg(long, value_enum, default_value_t = BenchOps::Qkv, conflicts_with = "startup")]
    pub ops: BenchOps,
    /// About a minute: Llama-3-8B shape, f32 and bf16, page 16, M up to 1024
    /// (default: the full suite, tens of minutes).
    #[arg(long)]
    pub quick: bool,
    /// Toy sizes, to test the plumbing (the numbers mean nothing).
    #[arg(long, hide = true, conflicts_with = "quick")]
    pub tiny: bool,
    /// Model shapes, comma-separated: 1b, 8b, mha, or K/QH/KVH/D.
    #[arg(long, value_delimiter = ',', value_parser = ModelShape::parse)]
    pub shapes: Option<Vec<ModelShape>>,
    /// Dtypes, comma-separated: f32, bf16, f16 (with --ops blocks, the
    /// weight formats: those and q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k,
    /// q6_k).
    #[arg(long, visible_alias = "dtype", value_delimiter = ',')]
    pub dtypes: Option<Vec<DType>>,
    /// Cache page sizes, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub pages: Option<Vec<usize>>,
    /// Rows M (batch × tokens), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub ms: Option<Vec<usize>>,
    /// Implementations, comma-separated: specialized, generic,
    /// unspecialized (the widest CPU tier; unspecialized needs AVX2),
    /// specialized_cranelift, generic_cranelift (the pure
    /// Cranelift tier), reference, gemm_scatter, matrixmultiply_scatter,
    /// openblas_scatter (with the crate feature `openblas`).
    #[arg(long, value_delimiter = ',', value_parser = Implementation::parse)]
    pub impls: Option<Vec<Implementation>>,
    /// Worker threads of kernels, peers and roof probes (0: one per core; default 2; at most 1024).
    #[arg(long, value_parser = kvjit_runtime::parse_threads)]
    pub threads: Option<usize>,
    /// Run the reference only up to this M (it is ~100× slower).
    #[arg(long)]
    pub reference_max_m: Option<usize>,
    /// Model shape of the compile-latency graphs (default 1b; bf16).
    #[arg(long, value_parser = ModelShape::parse)]
    pub compile_shape: Option<ModelShape>,
    /// Skip compile latency.
    #[arg(long)]
    pub no_compile: bool,
    /// Write every figure (medians and spreads) to this JSON file, and the
    /// plot next to it (same name, .svg).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the plot here instead.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Instead of the kernel suite, time start-up: fresh `kvjit` processes
    /// from a Llama-3-8B bf16 graph file or compiled artifact to the first
    /// output (vs `cat` of the weights), `validate`, peak RSS, JIT compile
    /// times and decode speed with mapped vs copied weights.
    #[arg(long, conflicts_with_all = [
        "quick", "tiny", "shapes", "dtypes", "pages", "ms", "impls",
        "reference_max_m", "compile_shape", "no_compile", "svg", "no_fuse", "gguf",
    ])]
    pub startup: bool,
    /// Layers of the start-up graph (default 32: 1.61 GB of weights).
    #[arg(long, requires = "startup")]
    pub startup_layers: Option<usize>,
    /// Measured runs of each start-up process, after a warm-up run (default 5).
    #[arg(long, requires = "startup")]
    pub startup_runs: Option<usize>,
    /// Write the start-up files here and keep them (default: a temporary
    /// directory, removed after the run).
    #[arg(long, requires = "startup", hide = true)]
    pub startup_dir: Option<PathBuf>,
    /// With --ops layer: compile and time only the unfused layer
    /// (`fuse: false`), not both side by side.
    #[arg(long)]
    pub no_fuse: bool,
    /// With --ops model: the GGUF file of the model.
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// With --ops model: only the --dtypes runs (weights dequantized), not
    /// the file's block-format weights as stored.
    #[arg(long)]
    pub dequantized_only: bool,
}

impl BenchArgs {
    /// The options that pick what a suite measures, each with whether it was
    /// given and the suites that take it (`--threads`, `--quick` and
    /// `--json` apply to every suite).
    fn suite_options(&self) -> [(&'static str, bool, &'static [BenchOps]); 12] {
        use BenchOps::{Attention, Blocks, Layer, Model, Qkv};
        [
            ("--shapes", self.shapes.is_some(), &[Qkv]),
            ("--dtypes", self.dtypes.is_some(), &[Qkv, Attention, Model, Blocks]),
            ("--pages", self.pages.is_some(), &[Qkv]),
            ("--ms", self.ms.is_some(), &[Qkv]),
            ("--impls", self.impls.is_some(), &[Qkv]),
            ("--reference-max-m", self.reference_max_m.is_some(), &[Qkv]),
            ("--compile-shape", self.compile_shape.is_some(), &[Qkv]),
            ("--no-compile", self.no_compile, &[Qkv]),
            ("--svg", self.svg.is_some(), &[Qkv]),
            ("--no-fuse", self.no_fuse, &[Layer]),
            ("--gguf", self.gguf.is_some(), &[Model]),
            ("--dequantized-only", self.dequantized_only, &[Model]),
        ]
    }

    /// Refuse what the suite `ops` cannot run: an option of another suite,
    /// or a list naming a value twice (`--pages 16,16` ran every point
    /// twice).
    fn check_options_for(&self, ops: BenchOps) -> Result<()> {
        fn repeated<T: PartialEq>(
            option: &'static str,
            values: Option<&Vec<T>>,
            name: impl Fn(&T) -> String,
        ) -> Result<()> {
            let values = values.map_or(&[][..], Vec::as_slice);
            match values.iter().enumerate().find(|(i, v)| values[..*i].contains(v)) {
                Some((_, value)) => Err(BenchError::Repeated { option, value: name(value) }),
                None => Ok(()),
            }
        }
        repeated("--shapes", self.shapes.as_ref(), |s| s.label.clone())?;
        repeated("--dtypes", self.dtypes.as_ref(), DType::to_string)?;
        repeated("--pages", self.pages.as_ref(), usize::to_string)?;
        repeated("--ms", self.ms.as_ref(), usize::to_string)?;
        repeated("--impls", self.impls.as_ref(), |i| i.id().to_string())?;
        self.refuse_options_of_other_suites(ops)
    }

    /// Refuse the first option given that the suite `ops` does not take.
    fn refuse_options_of_other_suites(&self, ops: BenchOps) -> Result<()> {
        match self.suite_options().into_iter().find(|(_, given, takes)| *given && !takes.contains(&ops)) {
            Some((option, _, takes)) => Err(BenchError::OptionNotForOps { option, ops, takes }),
            None => Ok(()),
        }
    }

    /// The start-up run these options ask for, its children running `kvjit`.
    pub fn startup_config(&self, kvjit: PathBuf) -> StartupConfig {
        let mut config = StartupConfig::new(kvjit);
        if let Some(v) = self.startup_layers {
            config.layers = v;
        }
        if let Some(v) = self.startup_runs {
            config.runs = v;
        }
        config.threads = self.threads;
        config.keep_dir = self.startup_dir.clone();
        config
    }

    /// The `--ops attention` run these options ask for: a preset with the
    /// given overrides; options of the QKV suite are refused.
    pub fn attention_config(&self) -> Result<AttentionBenchConfig> {
        self.check_options_for(BenchOps::Attention)?;
        let mut config =
            self.preset(AttentionBenchConfig::tiny, AttentionBenchConfig::quick, AttentionBenchConfig::full);
        if let Some(v) = &self.dtypes {
            config.dtypes = v.clone();
        }
        if let Some(v) = self.threads {
            config.threads = v;
        }
        config.check()?;
        Ok(config)
    }

    /// The `--ops fp8` run these options ask for: a preset with the given
    /// thread count; options of the other suites are refused.
    pub fn fp8_config(&self) -> Result<Fp8BenchConfig> {
        self.check_options_for(BenchOps::Fp8)?;
        let mut config = self.preset(Fp8BenchConfig::tiny, Fp8BenchConfig::quick, Fp8BenchConfig::full);
        if let Some(threads) = self.threads {
            config.threads = threads;
        }
        Ok(config)
    }

    /// The `--ops layer` run these options ask for: a preset with the given
    /// thread count and `--no-fuse`; options of the other suites are refused.
    pub fn layer_config(&self) -> Result<LayerBenchConfig> {
        self.check_options_for(BenchOps::Layer)?;
        let mut config = self.preset(LayerBenchConfig::tiny, LayerBenchConfig::quick, LayerBenchConfig::full);
        if let Some(threads) = self.threads {
            config.threads = threads;
        }
        config.unfused_only = self.no_fuse;
        config.check()?;
        Ok(config)
    }

    /// The `--ops blocks` run these options ask for: a preset, the weight
    /// formats (`--dtypes`) and the thread count; options of the other
    /// suites are refused.
    pub fn blocks_config(&self) -> Result<BlocksBenchConfig> {
        self.check_options_for(BenchOps::Blocks)?;
        let mut config = self.preset(BlocksBenchConfig::tiny, BlocksBenchConfig::quick, BlocksBenchConfig::full);
        if let Some(formats) = &self.dtypes {
            config.formats = formats.clone();
        }
        if let Some(threads) = self.threads {
            config.threads = threads;
        }
        config.check()?;
        Ok(config)
    }

    /// The `--ops model` run these options ask for: a preset on the
    /// `--gguf` file with the given dtypes and thread count; options of the
    /// other suites are refused.
    pub fn model_config(&self) -> Result<ModelBenchConfig> {
        self.check_options_for(BenchOps::Model)?;
        let gguf = self.gguf.clone().ok_or(BenchError::NoValues { option: "--gguf" })?;
        let mut config = if self.tiny {
            ModelBenchConfig::tiny(gguf)
        } else if self.quick {
            ModelBenchConfig::quick(gguf)
        } else {
            ModelBenchConfig::full(gguf)
        };
        if let Some(v) = &self.dtypes {
            config.dtypes = v.clone();
        }
        config.blocks &= !self.dequantized_only;
        if let Some(threads) = self.threads {
            config.threads = threads;
        }
        config.check()?;
        Ok(config)
    }

    /// The preset of a suite that `--tiny`, `--quick` or neither (the full
    /// run) picks.
    fn preset<C>(&self, tiny: fn() -> C, quick: fn() -> C, full: fn() -> C) -> C {
        if self.tiny {
            tiny()
        } else if self.quick {
            quick()
        } else {
            full()
        }
    }

    /// Where the QKV suite's plot goes: `--svg`, else beside `--json` (same
    /// name, .svg); refused where it would overwrite the JSON.
    fn svg_path(&self) -> Result<Option<PathBuf>> {
        let svg = self.svg.clone().or_else(|| self.json.as_ref().map(|j| j.with_extension("svg")));
        if let (Some(json), Some(svg)) = (&self.json, &svg)
            && json == svg
        {
            return Err(BenchError::JsonIsPlot { path: json.clone() });
        }
        Ok(svg)
    }

    /// The run these options ask for: a preset with the given overrides.
    pub fn config(&self) -> BenchConfig {
        let mut config = self.preset(BenchConfig::tiny, BenchConfig::quick, BenchConfig::full);
        if let Some(v) = &self.shapes {
            config.shapes = v.clone();
        }
        if let Some(v) = &self.dtypes {
            config.dtypes = v.clone();
        }
        if let Some(v) = &self.pages {
            config.page_sizes = v.clone();
        }
        if let Some(v) = &self.ms {
            config.ms = v.clone();
        }
        if let Some(v) = &self.impls {
            config.implementations = v.clone();
            config.implementations.sort();
            config.implementations.dedup();
        }
        if let Some(v) = self.threads {
            config.threads = v;
        }
        if let Some(v) = self.reference_max_m {
            config.reference_max_m = v;
        }
        match (&mut config.compile, &self.compile_shape) {
            (_, _) if self.no_compile => config.compile = None,
            (Some(c), Some(shape)) => c.shape = shape.clone(),
            _ => {}
        }
        config
    }
}

/// Run `kvjit bench`: progress on stderr, the Markdown report on stdout, the
/// JSON file (and the QKV suite's plot) where `args` says. With `--ops
/// attention`, a configuration whose JIT output and peer output disagree
/// shows an error instead of figures, and the command then fails.
pub fn run_bench(args: &BenchArgs) -> Result<()> {
    let json = args.json.as_deref();
    if args.startup {
        // This executable is the `kvjit` binary the child processes run.
        let kvjit = std::env::current_exe().map_err(|source| BenchError::NoExecutable { source })?;
        let config = args.startup_config(kvjit);
        config.check()?;
        drive(json, None, |progress| run_startup(&config, progress))?;
        return Ok(());
    }
    match args.ops {
        BenchOps::Qkv => {
            args.check_options_for(BenchOps::Qkv)?;
            let config = args.config();
            config.check()?;
            let svg = args.svg_path()?;
            drive(json, svg.as_deref(), |progress| crate::run(&config, progress))?;
        }
        BenchOps::Attention => {
            let config = args.attention_config()?;
            let report = drive(json, None, |progress| run_attention(&config, progress))?;
            let failures = report.failures();
            if !failures.is_empty() {
                return Err(BenchError::ValidationFailed { what: "attention configuration(s)", failures });
            }
        }
        BenchOps::Fp8 => {
            let config = args.fp8_config()?;
            drive(json, None, |progress| run_fp8(&config, progress))?;
        }
        BenchOps::Layer => {
            let config = args.layer_config()?;
            let report = drive(json, None, |progress| run_layer(&config, progress))?;
            let failures = report.failures();
            if !failures.is_empty() {
                return Err(BenchError::ValidationFailed { what: "layer workload(s)", failures });
            }
        }
        BenchOps::Model => {
            let config = args.model_config()?;
            drive(json, None, |progress| run_model(&config, progress))?;
        }
        BenchOps::Blocks => {
            let config = args.blocks_config()?;
            drive(json, None, |progress| run_blocks(&config, progress))?;
        }
    }
    Ok(())
}

/// A finished run's report, as `kvjit bench` prints and writes it.
trait Rendered {
    /// The Markdown report, for people.
    fn markdown(&self) -> String;
    /// Every figure, for tools.
    fn json(&self) -> Value;
    /// The plot, for a suite that draws one.
    fn svg(&self) -> Option<String> {
        None
    }
}

impl Rendered for crate::Report {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
    fn svg(&self) -> Option<String> {
        Some(self.to_svg())
    }
}

impl Rendered for AttentionReport {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
}

impl Rendered for BlocksReport {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
}

impl Rendered for Fp8Report {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
}

impl Rendered for LayerReport {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
}

impl Rendered for ModelReport {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
}

impl Rendered for StartupReport {
    fn markdown(&self) -> String {
        self.to_markdown()
    }
    fn json(&self) -> Value {
        self.to_json()
    }
}

/// Run `measure` with progress on stderr, print its report's Markdown on
/// stdout, write its JSON to `json` and its plot to `svg`. Both files are
/// created before the run, so a bad path fails before it, not after; a
/// failed run leaves neither behind.
fn drive<R: Rendered>(
    json: Option<&Path>,
    svg: Option<&Path>,
    measure: impl FnOnce(&mut dyn FnMut(&Progress)) -> Result<R>,
) -> Result<R> {
    let create = |path: &Path| {
        std::fs::File::create(path).map_err(|source| BenchError::Write { path: path.to_path_buf(), source })
    };
    let json_file = json.map(create).transpose()?;
    let svg_file = svg.map(create).transpose()?;
    let report = {
        let mut progress = ProgressDisplay::new(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let report = measure(&mut |p| progress.show(p));
        progress.finish(report.is_ok());
        report
    };
    let report = report.inspect_err(|_| {
        for path in json.iter().chain(&svg) {
            let _ = std::fs::remove_file(path);
        }
    })?;
    print!("{}", report.markdown());
    let write = |file: std::fs::File, path: &Path, text: String| -> Result<()> {
        let mut file = file;
        std::io::Write::write_all(&mut file, text.as_bytes())
            .map_err(|source| BenchError::Write { path: path.to_path_buf(), source })?;
        eprintln!("wrote {}", path.display());
        Ok(())
    };
    if let (Some(file), Some(path)) = (json_file, json) {
        write(file, path, serde_json::to_string_pretty(&report.json()).expect("JSON values serialize") + "\n")?;
    }
    if let (Some(file), Some(path)) = (svg_file, svg) {
        write(file, path, report.svg().expect("only a suite that draws a plot is given an SVG path"))?;
    }
    Ok(report)
}

/// Progress on stderr: an `indicatif` bar redrawn in place on a terminal;
/// one line per step otherwise (logs, pipes), where a redrawn bar would be
/// hidden.
struct ProgressDisplay {
    bar: Option<ProgressBar>,
}

impl ProgressDisplay {
    fn new(tty: bool) -> Self {
        let bar = tty.then(|| {
            let style = ProgressStyle::with_template("[{bar:24}] {pos:>3}/{len} {elapsed_precise}  {wide_msg}")
                .expect("a valid progress template")
                .progress_chars("#.");
            let bar = ProgressBar::new(0).with_style(style);
            // The clock moves on during long steps too.
            bar.enable_steady_tick(Duration::from_millis(500));
            bar
        });
        Self { bar }
    }

    fn show(&mut self, p: &Progress) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(p.total as u64);
                bar.set_position(p.done as u64);
                bar.set_message(p.what.clone());
            }
            None => {
                const WIDTH: usize = 24;
                let filled = WIDTH * p.done / p.total.max(1);
                let secs = p.elapsed.as_secs();
                eprintln!(
                    "[{}{}] {:>3}/{} {:>3}:{:02}  {}",
                    "#".repeat(filled),
                    ".".repeat(WIDTH - filled),
                    p.done,
                    p.total,
                    secs / 60,
                    secs % 60,
                    p.what
                );
            }
        }
    }

    /// Leave the bar on the terminal: full if the run `completed`, else
    /// where it stopped.
    fn finish(self, completed: bool) {
        match self.bar {
            Some(bar) if completed => bar.finish(),
            Some(bar) => bar.abandon(),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn args(line: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("bench").chain(line.iter().copied())).unwrap().args
    }

    #[test]
    fn options_of_other_suites_and_a_json_file_named_like_the_plot_are_refused_typed() {
        let err = args(&["--ops", "attention", "--ms", "4"]).attention_config().unwrap_err();
        assert!(matches!(err, BenchError::OptionNotForOps { option: "--ms", ops: BenchOps::Attention, .. }), "{err:?}");
        assert_eq!(err.to_string(), "--ms applies to --ops qkv only, not to --ops attention");
        let err = args(&["--ops", "fp8", "--dtypes", "bf16"]).fp8_config().unwrap_err();
        assert!(
            matches!(
                err,
                BenchError::OptionNotForOps {
                    option: "--dtypes",
                    ops: BenchOps::Fp8,
                    takes: [BenchOps::Qkv, BenchOps::Attention, BenchOps::Model, BenchOps::Blocks]
                }
            ),
            "{err:?}"
        );
        assert_eq!(args(&["--ops", "attention", "--dtypes", "f32"]).attention_config().unwrap().dtypes, [DType::F32]);
        let blocks = args(&["--ops", "blocks", "--dtypes", "bf16,q8_kmin,iq4_nl"]).blocks_config().unwrap();
        assert_eq!(blocks.formats, [DType::BF16, DType::Q8KMin, DType::Iq4Nl]);
        let err = args(&["--ops", "blocks", "--dtypes", "f8e4m3"]).blocks_config().unwrap_err();
        assert!(matches!(err, BenchError::NotWeightFormat { dtype: DType::F8E4M3 }), "{err:?}");
        assert_eq!(args(&["--ops", "fp8", "--threads", "3"]).fp8_config().unwrap().threads, 3);
        let err = args(&["--ops", "attention", "--no-fuse"]).attention_config().unwrap_err();
        assert_eq!(err.to_string(), "--no-fuse applies to --ops layer only, not to --ops attention");
        let err = args(&["--ops", "layer", "--ms", "4"]).layer_config().unwrap_err();
        assert!(matches!(err, BenchError::OptionNotForOps { option: "--ms", ops: BenchOps::Layer, .. }), "{err:?}");
        let layer = args(&["--ops", "layer", "--quick", "--threads", "1", "--no-fuse"]).layer_config().unwrap();
        assert_eq!((layer.mode.as_str(), layer.threads, layer.unfused_only), ("quick", 1, true));
        assert!(!args(&["--ops", "layer"]).layer_config().unwrap().unfused_only);

        let err = args(&["--json", "out.svg"]).svg_path().unwrap_err();
        assert!(matches!(&err, BenchError::JsonIsPlot { path } if path == Path::new("out.svg")), "{err:?}");
        assert_eq!(args(&["--json", "out.json"]).svg_path().unwrap(), Some(PathBuf::from("out.svg")));
    }
}
