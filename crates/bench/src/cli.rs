//! The `kvjit bench` subcommand: its options ([`BenchArgs`], a clap
//! `Args` struct the `kvjit` binary embeds) and [`run_bench`], which turns
//! them into a [`BenchConfig`], runs it with a progress display on stderr,
//! prints the Markdown report and writes the JSON and SVG files; with
//! `--startup`, runs the start-up benchmark ([`crate::startup`]) instead.

use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use kvjit_core::DType;

use crate::attention::{AttentionBenchConfig, run_attention};
use crate::fp8::{Fp8BenchConfig, run_fp8};
use crate::startup::{StartupConfig, run_startup};
use crate::{BenchConfig, Error, Implementation, ModelShape, Progress, Result};

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
}

/// Options of `kvjit bench`.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// The suite: qkv (fused QKV kernels), or attention (paged attention,
    /// RoPE and the whole attention step; honours --quick, --threads,
    /// --dtypes of the decode runs, --json).
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
    /// Dtypes, comma-separated: f32, bf16, f16.
    #[arg(long, value_delimiter = ',')]
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
    /// Worker threads of kernels, peers and roof probes (0: one per core; default 2).
    #[arg(long)]
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
        "reference_max_m", "compile_shape", "no_compile", "svg",
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
}

impl BenchArgs {
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
        let qkv_only = [
            ("--shapes", self.shapes.is_some()),
            ("--pages", self.pages.is_some()),
            ("--ms", self.ms.is_some()),
            ("--impls", self.impls.is_some()),
            ("--reference-max-m", self.reference_max_m.is_some()),
            ("--compile-shape", self.compile_shape.is_some()),
            ("--no-compile", self.no_compile),
            ("--svg", self.svg.is_some()),
        ];
        if let Some((flag, _)) = qkv_only.iter().find(|(_, given)| *given) {
            return Err(Error::Usage(format!("{flag} applies to --ops qkv only")));
        }
        let mut config = if self.tiny {
            AttentionBenchConfig::tiny()
        } else if self.quick {
            AttentionBenchConfig::quick()
        } else {
            AttentionBenchConfig::full()
        };
        if let Some(v) = &self.dtypes {
            config.dtypes = v.clone();
        }
        if let Some(v) = self.threads {
            config.threads = v;
        }
        config.check()?;
        Ok(config)
    }

    /// The run these options ask for: a preset with the given overrides.
    pub fn config(&self) -> BenchConfig {
        let mut config = if self.tiny {
            BenchConfig::tiny()
        } else if self.quick {
            BenchConfig::quick()
        } else {
            BenchConfig::full()
        };
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
/// JSON and SVG files where `args` says.
pub fn run_bench(args: &BenchArgs) -> Result<()> {
    if args.startup {
        return run_startup_bench(args);
    }
    if args.ops == BenchOps::Attention {
        return run_attention_bench(args);
    }
    if args.ops == BenchOps::Fp8 {
        return run_fp8_bench(args);
    }
    let config = args.config();
    config.check()?;
    // Open the output files now, so a bad path fails before the run, not after.
    let svg_path = args.svg.clone().or_else(|| args.json.as_ref().map(|j| j.with_extension("svg")));
    if let (Some(json), Some(svg)) = (&args.json, &svg_path)
        && json == svg
    {
        return Err(Error::Usage(format!(
            "--json {} would be overwritten by the plot; name it *.json",
            json.display()
        )));
    }
    let create = |path: &PathBuf| {
        std::fs::File::create(path).map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))
    };
    let json_file = args.json.as_ref().map(create).transpose()?;
    let svg_file = svg_path.as_ref().map(create).transpose()?;

    let report = {
        let mut progress = ProgressDisplay::new(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let report = crate::run(&config, &mut |p| progress.show(p));
        progress.finish(report.is_ok());
        report
    };
    let report = report.inspect_err(|_| {
        // Leave no empty result files behind a failed run.
        for path in args.json.iter().chain(&svg_path) {
            let _ = std::fs::remove_file(path);
        }
    })?;
    print!("{}", report.to_markdown());
    let write = |file: Option<std::fs::File>, path: &Option<PathBuf>, text: String| -> Result<()> {
        if let (Some(mut file), Some(path)) = (file, path) {
            std::io::Write::write_all(&mut file, text.as_bytes())
                .map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))?;
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    };
    let json_text = serde_json::to_string_pretty(&report.to_json()).expect("JSON values serialize") + "\n";
    write(json_file, &args.json, json_text)?;
    write(svg_file, &svg_path, report.to_svg())?;
    Ok(())
}

/// Run `kvjit bench --startup`: this executable is the `kvjit` binary its
/// child processes run. Progress on stderr, the Markdown table on stdout,
/// the JSON file where `args` says.
fn run_startup_bench(args: &BenchArgs) -> Result<()> {
    let kvjit =
        std::env::current_exe().map_err(|e| Error::Usage(format!("cannot find the kvjit executable to run: {e}")))?;
    let config = args.startup_config(kvjit);
    config.check()?;
    let json_file = args
        .json
        .as_ref()
        .map(|path| {
            std::fs::File::create(path).map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))
        })
        .transpose()?;
    let report = {
        let mut progress = ProgressDisplay::new(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let report = run_startup(&config, &mut |p| progress.show(p));
        progress.finish(report.is_ok());
        report
    };
    let report = report.inspect_err(|_| {
        if let Some(path) = &args.json {
            let _ = std::fs::remove_file(path);
        }
    })?;
    print!("{}", report.to_markdown());
    if let (Some(mut file), Some(path)) = (json_file, &args.json) {
        let text = serde_json::to_string_pretty(&report.to_json()).expect("JSON values serialize") + "\n";
        std::io::Write::write_all(&mut file, text.as_bytes())
            .map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Run `kvjit bench --ops attention`: progress on stderr, the Markdown
/// report on stdout, the JSON file where `args` says. A configuration whose
/// JIT output and peer output disagree shows an error instead of figures,
/// and the command then fails.
fn run_attention_bench(args: &BenchArgs) -> Result<()> {
    let config = args.attention_config()?;
    let json_file = args
        .json
        .as_ref()
        .map(|path| {
            std::fs::File::create(path).map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))
        })
        .transpose()?;
    let report = {
        let mut progress = ProgressDisplay::new(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let report = run_attention(&config, &mut |p| progress.show(p));
        progress.finish(report.is_ok());
        report
    };
    let report = report.inspect_err(|_| {
        if let Some(path) = &args.json {
            let _ = std::fs::remove_file(path);
        }
    })?;
    print!("{}", report.to_markdown());
    if let (Some(mut file), Some(path)) = (json_file, &args.json) {
        let text = serde_json::to_string_pretty(&report.to_json()).expect("JSON values serialize") + "\n";
        std::io::Write::write_all(&mut file, text.as_bytes())
            .map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))?;
        eprintln!("wrote {}", path.display());
    }
    let failures = report.failures();
    if !failures.is_empty() {
        return Err(Error::Usage(format!(
            "{} attention configuration(s) failed validation: {}",
            failures.len(),
            failures.join("; ")
        )));
    }
    Ok(())
}

/// Run `kvjit bench --ops fp8`: a line per step on stderr, the Markdown
/// report on stdout, the JSON file where `args` says.
fn run_fp8_bench(args: &BenchArgs) -> Result<()> {
    let others = [
        ("--shapes", args.shapes.is_some()),
        ("--dtypes", args.dtypes.is_some()),
        ("--pages", args.pages.is_some()),
        ("--ms", args.ms.is_some()),
        ("--impls", args.impls.is_some()),
        ("--reference-max-m", args.reference_max_m.is_some()),
        ("--compile-shape", args.compile_shape.is_some()),
        ("--no-compile", args.no_compile),
        ("--svg", args.svg.is_some()),
    ];
    if let Some((flag, _)) = others.iter().find(|(_, given)| *given) {
        return Err(Error::Usage(format!("{flag} does not apply to --ops fp8")));
    }
    let mut config = if args.tiny {
        Fp8BenchConfig::tiny()
    } else if args.quick {
        Fp8BenchConfig::quick()
    } else {
        Fp8BenchConfig::full()
    };
    if let Some(threads) = args.threads {
        config.threads = threads;
    }
    let started = std::time::Instant::now();
    let report = run_fp8(&config, &mut |what| eprintln!("[{:>6.1}s] {what}", started.elapsed().as_secs_f64()))?;
    print!("{}", report.to_markdown());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report.to_json()).expect("JSON values serialize") + "\n";
        std::fs::write(path, text).map_err(|e| Error::Usage(format!("cannot write {}: {e}", path.display())))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
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
