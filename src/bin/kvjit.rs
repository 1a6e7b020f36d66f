//! The `kvjit` command line: run, inspect and validate op graphs.
//!
//! Every failure prints one line, `error: …`, and exits with status 1.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use kvjit::models::llama::{LlamaConfig, decoder_layer_graph};
use kvjit::scenario::Scenario;
use kvjit::{
    BuildOptions, CompileOptions, CpuTier, DType, DeviceContextPtr, Error, Executor, Graph, KernelImpl, Registry,
    Result, Target, Tensor, ValueDef, WeightLoad, compile, compiled_graph, load_graph_within, read_safetensors,
    specialize, standard_registry, write_artifact, write_safetensors,
};

#[derive(Parser)]
#[command(name = "kvjit", version, about = "Build, specialize and run graphs of LLM inference ops")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile and run a graph file (default: a built-in Llama-3-8B
    /// decoder layer: RMSNorm → fused QKV → RoPE → attention on the paged
    /// cache → o_proj + residual → RMSNorm → SwiGLU MLP + residual).
    Run(RunArgs),
    /// Show a graph's inputs, nodes, shapes and kernel keys.
    Inspect {
        /// Graph file (JSON).
        graph: PathBuf,
        /// Target whose kernel keys to show.
        #[arg(long, default_value = "cpu")]
        target: Target,
        /// Bind a symbol to a size (repeatable), e.g. --bind batch=4.
        #[arg(long = "bind", value_parser = parse_binding)]
        bindings: Vec<(String, usize)>,
        /// Compile every kernel and print its Cranelift IR.
        #[arg(long)]
        dump_clif: bool,
        /// Compile every kernel and print its machine code.
        #[arg(long)]
        disasm: bool,
        /// CPU code tier of the JIT kernels: auto (the widest this CPU
        /// runs), cranelift (pure Cranelift vectors) or avx2 (Cranelift
        /// driver + 256-bit micro-kernels).
        #[arg(long, default_value = "auto")]
        cpu_tier: CpuTier,
        /// Compile every node as its own kernel: no matmul epilogue or
        /// SwiGLU sibling fusion.
        #[arg(long)]
        no_fuse: bool,
    },
    /// Compare two safetensors files of named tensors (e.g. `run --output`
    /// from two targets); exit 1 naming the first tensor that differs.
    Compare {
        /// First file (the one compared).
        a: PathBuf,
        /// Second file (the one compared against: errors are normalized by
        /// its largest magnitude).
        b: PathBuf,
        /// Normalized max error allowed for every float dtype (default: f32
        /// 1e-4, bf16 2^-6, f16 2^-9): finite and ≥ 0.
        #[arg(long, value_parser = parse_tolerance)]
        tolerance: Option<f64>,
    },
    /// Load and validate a graph file (reading only the header of its
    /// weights file) or a compiled artifact, and nothing else.
    Validate {
        /// Graph file (JSON) or compiled artifact.
        graph: PathBuf,
    },
    /// Compile a graph file into an artifact that `kvjit run` starts from
    /// without packing or copying weights: the specialized graph, its
    /// kernel keys, and every constant in its kernel's layout.
    Compile {
        /// Graph file (JSON).
        graph: PathBuf,
        /// Where to write the artifact (e.g. model.kvjit).
        #[arg(short, long)]
        output: PathBuf,
        /// Target the kernels are built for.
        #[arg(long, default_value = "cpu")]
        target: Target,
        /// Bind a symbol to a size (repeatable), e.g. --bind batch=4.
        #[arg(long = "bind", value_parser = parse_binding)]
        bindings: Vec<(String, usize)>,
        /// Which kernels the artifact is built for.
        #[arg(long, value_enum, default_value = "jit")]
        kernel: KernelChoice,
        /// CPU code tier of the JIT kernels: auto (the widest this CPU
        /// runs), cranelift (pure Cranelift vectors) or avx2 (Cranelift
        /// driver + 256-bit micro-kernels).
        #[arg(long, default_value = "auto")]
        cpu_tier: CpuTier,
        /// Refuse graphs whose buffers need more than this many bytes
        /// (suffixes K, M, G: powers of 1024); also what the graph file's
        /// init recipes may generate (default 1G).
        #[arg(long, value_parser = parse_bytes)]
        memory_budget: Option<u64>,
        /// Compile every node as its own kernel: no matmul epilogue or
        /// SwiGLU sibling fusion.
        #[arg(long)]
        no_fuse: bool,
    },
    /// Time the fused QKV kernels (specialized, generic) against the
    /// reference and GEMM-library peers, on this machine's roofs; print a
    /// Markdown table.
    Bench(Box<kvjit_bench::cli::BenchArgs>),
    /// Write DIR/model.json: the whole model graph of a GGUF file (a
    /// Llama-family model), referring to the file for its weights.
    Import {
        /// The GGUF file.
        model: PathBuf,
        /// The folder to write model.json into (the GGUF is linked there
        /// when it lies elsewhere).
        #[arg(short, long)]
        output: PathBuf,
        #[command(flatten)]
        shape: ModelShape,
    },
    /// Generate text with a model: a GGUF file, a model.json written by
    /// `kvjit import`, or an artifact compiled from one. The prompt runs as one prefill, then one decode step
    /// per token on the same compiled model and paged KV cache; text is
    /// streamed as it is produced.
    Generate(GenerateArgs),
    /// Show the token ids `generate` feeds a model for a prompt (BOS as the
    /// vocabulary asks, control tokens written in the text parsed whole),
    /// each with the text it stands for.
    Tokenize {
        /// A GGUF file, or a model.json `kvjit import` wrote or an artifact
        /// compiled from one (the tokenizer of the GGUF it names).
        model: PathBuf,
        /// The text.
        #[arg(long)]
        prompt: String,
        /// Wrap it in the model's chat template as a user message, as
        /// `generate --chat` does.
        #[arg(long)]
        chat: bool,
    },
}

/// How an imported model is compiled: dtype, weights and cache size. Each
/// is `None` unless given, so `generate` can refuse them for a model whose
/// import or compile already fixed them.
#[derive(clap::Args, Clone, Copy)]
struct ModelShape {
    /// Activation dtype (and the weights' that the file does not store in a
    /// block format kvjit decodes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
    /// Q4_K, Q5_K, Q6_K, and Q2_K, Q3_K, IQ4_XS held as q8_kmin) [default:
    /// f32].
    #[arg(long)]
    dtype: Option<DType>,
    /// Dequantize block-format weights into --dtype at load, instead of
    /// keeping their blocks (which the kernels decode as they read).
    #[arg(long)]
    dequantize: bool,
    /// Tokens a sequence may hold: prompt plus generated [default: 2048].
    #[arg(long)]
    context: Option<usize>,
    /// Sequences the KV cache holds at that context [default: 4].
    #[arg(long)]
    max_batch: Option<usize>,
    /// The KV cache's dtype (default: --dtype's): f32, bf16, or f8e4m3
    /// (FP8 codes with a scale per block of the head).
    #[arg(long)]
    kv_cache_dtype: Option<DType>,
}

impl ModelShape {
    fn options(self) -> kvjit::models::gguf::ImportOptions {
        let defaults = kvjit::models::gguf::ImportOptions::default();
        kvjit::models::gguf::ImportOptions {
            dtype: self.dtype.unwrap_or(defaults.dtype),
            dequantize: self.dequantize,
            context: self.context.unwrap_or(defaults.context),
            max_batch: self.max_batch.unwrap_or(defaults.max_batch),
            cache_dtype: self.kv_cache_dtype,
            ..defaults
        }
    }

    /// The options given on the command line, by flag.
    fn given(self) -> Vec<&'static str> {
        [
            ("--dtype", self.dtype.is_some()),
            ("--dequantize", self.dequantize),
            ("--context", self.context.is_some()),
            ("--max-batch", self.max_batch.is_some()),
            ("--kv-cache-dtype", self.kv_cache_dtype.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A GGUF file, a model.json written by `kvjit import`, or an artifact
    /// `kvjit compile` made of one (in the same folder; it runs with the
    /// options it was compiled with).
    model: PathBuf,
    /// The prompt (repeat it to run several prompts side by side).
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Wrap each prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate per prompt, at most.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 (default): greedy; otherwise sample at this temperature.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample from the k most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the most likely tokens whose probabilities sum to p.
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the tokens (u32 [prompt + generated]) and the logits each
    /// generated token was picked from (f32 [generated, vocab]) to this
    /// safetensors file (names suffixed `.N` for prompt N when there are
    /// several).
    #[arg(long)]
    logits: Option<PathBuf>,
    /// CPU worker threads (0: one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = kvjit::parse_threads)]
    threads: usize,
    /// Compile every node as its own kernel.
    #[arg(long)]
    no_fuse: bool,
    #[command(flatten)]
    shape: ModelShape,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Graph file (JSON) or compiled artifact (`kvjit compile`); without
    /// it, the built-in Llama-3-8B decoder layer runs
    /// (`examples/llama3_8b_decoder_layer.json`).
    graph: Option<PathBuf>,
    /// How weights (a graph file's weights file, an artifact's packed
    /// weights) come into memory: `map` borrows them from the page cache
    /// (zero-copy); `copy` reads them into memory advised to use huge pages.
    #[arg(long, default_value = "map")]
    weights: WeightLoad,
    /// Safetensors file with graph inputs and caches by name
    /// (`<cache>.blocks`, `.cache_lengths`, `.lookup_table`, and an FP8
    /// cache's `.scales`) for the first step.
    #[arg(long)]
    inputs: Option<PathBuf>,
    /// Write every graph output and the updated caches to this safetensors file.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Where kernels run.
    #[arg(long, default_value = "cpu")]
    target: Target,
    /// Seed of the random inputs and cache history.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Decode steps after the first step; each adds a token per sequence.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Sequences in the generated first step [default: 4, or what --bind
    /// batch=N binds].
    #[arg(long)]
    batch: Option<usize>,
    /// Padded tokens per sequence in the generated first step [default: 8,
    /// or what --bind seq=N binds].
    #[arg(long)]
    seq: Option<usize>,
    /// CPU worker threads (0: one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = kvjit::parse_threads)]
    threads: usize,
    /// Bind a symbol at compile time (repeatable), e.g. --bind batch=4.
    #[arg(long = "bind", value_parser = parse_binding)]
    bindings: Vec<(String, usize)>,
    /// Which kernels run: the JIT-compiled fast path or the plain reference.
    #[arg(long, value_enum, default_value = "jit")]
    kernel: KernelChoice,
    /// Where batch/seq are symbolic, compile a kernel for each shape seen at
    /// run time (instead of running the generic kernel).
    #[arg(long)]
    specialize_shapes: bool,
    /// CPU code tier of the JIT kernels: auto (the widest this CPU runs),
    /// cranelift (pure Cranelift vectors) or avx2 (Cranelift driver +
    /// 256-bit micro-kernels). An artifact runs on the tier it was compiled
    /// for.
    #[arg(long, default_value = "auto")]
    cpu_tier: CpuTier,
    /// Refuse graphs whose buffers need more than this many bytes (suffixes
    /// K, M, G: powers of 1024), before allocating them; also what a graph
    /// file's init recipes may generate and the example scenario's caches
    /// may take (default for those two: 1G).
    #[arg(long, value_parser = parse_bytes)]
    memory_budget: Option<u64>,
    /// The built-in graph's KV cache dtype: bf16 (default) or f8e4m3 (an
    /// FP8 cache with one scale per 128 values). A graph file names its own.
    #[arg(long, conflicts_with = "graph")]
    kv_cache_dtype: Option<DType>,
    /// Compile every node as its own kernel: no matmul epilogue or SwiGLU
    /// sibling fusion (also for an artifact compiled with fusion; one
    /// compiled with --no-fuse runs unfused either way).
    #[arg(long)]
    no_fuse: bool,
}

/// The example scenario's sequences and padded tokens per sequence in its
/// first step, unless `--batch`/`--seq` or a `--bind` say otherwise.
const EXAMPLE_BATCH: usize = 4;
const EXAMPLE_SEQ: usize = 8;

impl RunArgs {
    /// The example scenario's `batch` or `seq` (`symbol`): `--batch`/`--seq`
    /// (`given`), else what `--bind` binds the symbol to, else `default`;
    /// refused when the two are given and disagree.
    fn scenario_size(&self, symbol: &str, given: Option<usize>, default: usize) -> Result<usize> {
        let bound = self.bindings.iter().rev().find(|(name, _)| name == symbol).map(|&(_, size)| size);
        match (given, bound) {
            (Some(given), Some(bound)) if given != bound => Err(Error::Usage(format!(
                "--{symbol} {given} disagrees with --bind {symbol}={bound} (give one, or the same size)"
            ))),
            (given, bound) => Ok(given.or(bound).unwrap_or(default)),
        }
    }
}

fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let (digits, scale) = match text.as_bytes().last() {
        Some(b'K' | b'k') => (&text[..text.len() - 1], 1 << 10),
        Some(b'M' | b'm') => (&text[..text.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|v| v.checked_mul(scale))
        .ok_or_else(|| format!("'{text}' is not a byte count (e.g. 512M, 8G)"))
}

/// `--kernel` values.
#[derive(Clone, Copy, clap::ValueEnum)]
enum KernelChoice {
    /// Machine code generated for each kernel key (the fast path).
    Jit,
    /// The plain Rust reference implementation.
    Reference,
}

impl KernelChoice {
    fn implementation(self) -> KernelImpl {
        match self {
            KernelChoice::Jit => KernelImpl::Fast,
            KernelChoice::Reference => KernelImpl::Reference,
        }
    }
}

/// The `--bind`s as a map; a symbol bound twice to different sizes is
/// refused (the last one silently won).
fn binding_map(bindings: &[(String, usize)]) -> Result<std::collections::BTreeMap<String, usize>> {
    let mut map = std::collections::BTreeMap::new();
    for (symbol, size) in bindings {
        if let Some(earlier) = map.insert(symbol.clone(), *size).filter(|earlier| earlier != size) {
            return Err(Error::Usage(format!("--bind {symbol}={earlier} and --bind {symbol}={size} disagree")));
        }
    }
    Ok(map)
}

fn parse_binding(text: &str) -> std::result::Result<(String, usize), String> {
    let (name, size) = text.split_once('=').ok_or_else(|| format!("'{text}' is not SYMBOL=SIZE"))?;
    let size = size.parse().map_err(|_| format!("'{size}' is not a size"))?;
    Ok((name.to_string(), size))
}

/// Exit as a Unix tool does when its reader goes away (`kvjit run | head`):
/// quietly, with the status a death by SIGPIPE reports (128 + 13), instead
/// of the panic that `print!` raises on a closed stdout. Other panics keep
/// the default report.
fn exit_quietly_on_a_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        report(info);
    }));
}

fn main() -> ExitCode {
    exit_quietly_on_a_closed_stdout();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) => {
            print!("{e}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap's first paragraph in one line: the error and what it
            // lists (the missing arguments), without the usage and tips.
            let text = e.to_string();
            let first: Vec<&str> = text.lines().map(str::trim).take_while(|line| !line.is_empty()).collect();
            let first = if first.is_empty() { "bad arguments".to_string() } else { first.join(" ") };
            eprintln!("{first} (see kvjit --help)");
            return ExitCode::FAILURE;
        }
    };
    let registry = standard_registry();
    let result = match cli.command {
        Command::Run(args) => run(&registry, &args),
        Command::Inspect { graph, target, bindings, dump_clif, disasm, cpu_tier, no_fuse } => {
            let build = BuildOptions { keep_ir: dump_clif, keep_disasm: disasm, cpu_tier, ..BuildOptions::default() };
            binding_map(&bindings).and_then(|bindings| {
                let options = CompileOptions { target, bindings, build, memory_budget: None, fuse: !no_fuse };
                inspect(&registry, &graph, &options)
            })
        }
        Command::Validate { graph } => validate(&registry, &graph),
        Command::Compile { graph, output, target, bindings, kernel, cpu_tier, memory_budget, no_fuse } => {
            let build = BuildOptions { implementation: kernel.implementation(), cpu_tier, ..BuildOptions::default() };
            binding_map(&bindings).and_then(|bindings| {
                let options = CompileOptions { target, bindings, build, memory_budget, fuse: !no_fuse };
                compile_artifact(&registry, &graph, &output, &options)
            })
        }
        Command::Compare { a, b, tolerance } => compare_files(&a, &b, tolerance),
        Command::Bench(args) => kvjit_bench::cli::run_bench(&args).map_err(bench_error),
        Command::Import { model, output, shape } => {
            kvjit::models::gguf::import(&model, &output, registry.ops(), &shape.options()).map(|(graph, gguf)| {
                println!("wrote {} (weights: {})", graph.display(), gguf.display());
                if let Ok(file) = kvjit::gguf::Gguf::open(&gguf) {
                    kvjit::models::gguf::weight_notes(&file, &shape.options()).iter().for_each(|n| println!("{n}"));
                }
            })
        }
        Command::Generate(args) => generate(&registry, &args),
        Command::Tokenize { model, prompt, chat } => tokenize(&model, &prompt, chat),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// `kvjit bench`'s error as the CLI's: a kvjit error as it is, the
/// benchmark's own (a bad option, a failed child process, …) by its message.
fn bench_error(e: kvjit_bench::BenchError) -> Error {
    match e {
        kvjit_bench::BenchError::Kvjit(e) => e,
        e => Error::Usage(e.to_string()),
    }
}

/// Load a graph file whose init recipes may generate `memory_budget` bytes
/// (the default limit when none is given).
fn load(registry: &Registry, path: &Path, weights: WeightLoad, memory_budget: Option<u64>) -> Result<Graph> {
    if kvjit::models::gguf::is_gguf(path) {
        return Err(Error::Usage(format!(
            "{} is a GGUF model file, not a graph file: kvjit generate runs it, and kvjit import -o DIR writes the \
             graph file (DIR/model.json) that run, inspect, validate and compile take",
            path.display()
        )));
    }
    let recipe_budget = memory_budget.unwrap_or(kvjit::DEFAULT_MEMORY_LIMIT);
    Ok(load_graph_within(path, registry.ops(), weights, recipe_budget)?)
}

/// `--tolerance`: a finite normalized error of at least 0 (NaN or a
/// negative one would call identical tensors a mismatch).
fn parse_tolerance(text: &str) -> std::result::Result<f64, String> {
    let value: f64 = text.parse().map_err(|e| format!("{e}"))?;
    match value.is_finite() && value >= 0.0 {
        true => Ok(value),
        false => Err(format!("must be finite and ≥ 0, got {text}")),
    }
}

/// The most characters of an error message printed: names and values from
/// a file are echoed in messages, and a file may hold a 100 MB one.
const MESSAGE_CHARS: usize = 2000;

/// `message` as one printable line: newlines as spaces, other control
/// characters escaped (a file's names and values must not drive the
/// terminal), cut after [`MESSAGE_CHARS`] characters.
fn one_line(message: &str) -> String {
    let mut line = String::new();
    for (count, c) in message.chars().enumerate() {
        if count == MESSAGE_CHARS {
            line.push_str(&format!("… ({} more characters)", message.chars().count() - count));
            break;
        }
        match c {
            '\n' => line.push(' '),
            c if c.is_control() => line.extend(c.escape_debug()),
            c => line.push(c),
        }
    }
    line
}

fn compare_files(a: &Path, b: &Path, tolerance: Option<f64>) -> Result<()> {
    use kvjit::compare::{Tolerance, compare_sets};
    let tolerance = tolerance.map_or_else(Tolerance::default, Tolerance::uniform);
    let results = compare_sets(&read_safetensors(a)?, &read_safetensors(b)?, &tolerance);
    for c in &results {
        println!("{} {c}", if c.matches() { "ok      " } else { "MISMATCH" });
    }
    let differ: Vec<_> = results.iter().filter(|c| !c.matches()).collect();
    match differ.first() {
        None => {
            println!("ok: {} tensors match ({} vs {})", results.len(), a.display(), b.display());
            Ok(())
        }
        Some(first) => Err(Error::Mismatch { count: differ.len(), total: results.len(), first: first.to_string() }),
    }
}

fn compile_artifact(registry: &Registry, graph_path: &Path, output: &Path, options: &CompileOptions) -> Result<()> {
    let started = Instant::now();
    let graph = load(registry, graph_path, WeightLoad::Map, options.memory_budget)?;
    let summary = write_artifact(&graph, registry, options, output, Some(graph_path))?;
    println!(
        "wrote {} ({} bytes: {} constant(s) in kernel layout, {} plain) in {}",
        output.display(),
        summary.bytes,
        summary.prepared,
        summary.plain,
        format_duration(started.elapsed())
    );
    Ok(())
}

/// A graph file or artifact, ready to compile: the graph and, for an
/// artifact, the options it was made with.
struct Loaded {
    graph: Graph,
    artifact: Option<kvjit::LoadedArtifact>,
}

/// Load `path` as an artifact (by its magic) or a graph file (see [`load`]
/// for `memory_budget`). A stale artifact whose source graph file lies
/// beside it is rebuilt from that file (and said so); without one it is an
/// error.
fn load_any(registry: &Registry, path: &Path, weights: WeightLoad, memory_budget: Option<u64>) -> Result<Loaded> {
    if !kvjit::is_artifact(path) {
        return Ok(Loaded { graph: load(registry, path, weights, memory_budget)?, artifact: None });
    }
    match kvjit::load_artifact_with(path, registry, weights) {
        Ok(artifact) => Ok(Loaded { graph: artifact.graph.clone(), artifact: Some(artifact) }),
        Err(Error::Artifact(stale @ kvjit::ArtifactError::Stale { .. })) => {
            let source = kvjit::artifact::source_graph_beside(path).ok_or(Error::Artifact(stale))?;
            eprintln!("note: {}: stale artifact; building from {} instead", path.display(), source.display());
            Ok(Loaded { graph: load(registry, &source, weights, memory_budget)?, artifact: None })
        }
        Err(e) => Err(e),
    }
}

fn validate(registry: &Registry, path: &Path) -> Result<()> {
    let graph = load_any(registry, path, WeightLoad::Map, None)?.graph;
    println!(
        "ok: graph '{}' is valid ({} nodes, {} outputs)",
        graph.name(),
        graph.nodes().len(),
        graph.outputs().len()
    );
    Ok(())
}

fn inspect(registry: &Registry, path: &Path, options: &CompileOptions) -> Result<()> {
    let target = options.target;
    let graph = load_any(registry, path, WeightLoad::Map, None)?.graph;
    let specialized = specialize(&graph, registry.ops(), options.backend()?, &options.bindings)?;
    let fused = compiled_graph(&graph, registry, options)?;
    let exe = compile(&graph, registry, options)?;
    let graph = specialized.graph();
    println!("graph '{}': {} nodes, symbols [{}]", graph.name(), graph.nodes().len(), graph.symbols().join(", "));
    println!("values:");
    let (mut weight_bytes, mut weights) = (0usize, 0usize);
    for (i, value) in graph.values().iter().enumerate() {
        let kind = match value.def {
            ValueDef::Input => "input",
            ValueDef::Constant { init: Some(_), .. } => "constant (recipe)",
            ValueDef::Constant { .. } => "constant",
            ValueDef::Prepared { .. } => "constant (kernel layout)",
            ValueDef::KvCache => "kv cache",
            ValueDef::NodeOutput { .. } => "node output",
        };
        // A constant's storage: its bytes and bytes per weight (a block
        // format's blocks over their weights; packed panels keep them).
        let stored = match &value.def {
            ValueDef::Constant { data, .. } => Some(data),
            ValueDef::Prepared { data } => Some(&data.data),
            _ => None,
        };
        let storage = match stored {
            Some(data) => {
                let bytes = data.as_bytes().len();
                let logical = value.ty.as_tensor().and_then(|t| t.static_shape()).map_or(0, |s| s.iter().product());
                (weight_bytes, weights) = (weight_bytes + bytes, weights + logical);
                format!("  {bytes} B, {:.4} bytes/weight", bytes as f64 / logical.max(1) as f64)
            }
            None => String::new(),
        };
        println!("  v{i:<3} {:<28} {:<24} {}{storage}", value.name.as_deref().unwrap_or("-"), kind, value.ty);
    }
    if weights > 0 {
        println!(
            "constants: {weight_bytes} B for {weights} weights, {:.4} bytes/weight",
            weight_bytes as f64 / weights as f64
        );
    }
    println!("nodes ({target}):");
    for (node, key) in graph.nodes().iter().zip(specialized.kernel_keys()) {
        let list = |ids: &[kvjit::ValueId]| ids.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ");
        println!("  {}  {}({}) -> {}", node.id, node.op, list(&node.inputs), list(&node.outputs));
        let params: Vec<String> = node.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("      params: {}", params.join(" "));
        println!("      kernel: {key}{}", if key.is_fully_static() { "" } else { "  (generic in the 'any' dims)" });
    }
    println!("outputs:");
    for out in graph.outputs() {
        println!("  {} = {}  {}", out.name, out.value, graph.value(out.value).ty);
    }
    let fused_nodes: Vec<_> = fused.fused().collect();
    match (options.fuse, fused_nodes.is_empty()) {
        (false, _) => println!("fused kernels: none (--no-fuse)"),
        (true, true) => println!("fused kernels: none (nothing to fuse)"),
        (true, false) => println!("fused kernels ({}):", fused_nodes.len()),
    }
    for (node, absorbed) in &fused_nodes {
        let absorbed: Vec<String> = absorbed.iter().map(|&n| format!("{n} {}", graph.nodes()[n.index()].op)).collect();
        let params: Vec<String> = node.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("  {}({}) absorbs {}", node.op, params.join(" "), absorbed.join(", "));
    }
    println!("kernels:");
    for step in exe.steps() {
        let info = step.kernel.code_info();
        println!(
            "  {:<4} {} [{}] compiled in {}, {} bytes of code",
            step.label,
            step.kernel.key(),
            step.kernel.implementation(),
            format_duration(info.compile_time),
            info.code_size
        );
    }
    print_compile_log();
    for step in exe.steps() {
        let info = step.kernel.code_info();
        if let Some(ir) = info.ir {
            println!("\n;; Cranelift IR of {} ({})\n{ir}", step.label, step.kernel.key());
        }
        if let Some(disasm) = info.disasm {
            println!("\n;; machine code of {} ({})\n{disasm}", step.label, step.kernel.key());
        }
    }
    Ok(())
}

/// Every JIT compile this process made, with its cause.
fn print_compile_log() {
    let log = kvjit::compile_log();
    if log.is_empty() {
        return;
    }
    println!("JIT compile log:");
    for record in log {
        println!(
            "  {:>10}  {:>6} B  {}  ({})",
            format_duration(record.duration),
            record.code_size,
            record.key,
            record.cause
        );
    }
}

/// Sum and sum of magnitudes of a float tensor, as a quick fingerprint.
fn checksum(t: &Tensor) -> Result<(f64, f64)> {
    let values = t.to_f32_vec()?;
    Ok(values.iter().fold((0.0, 0.0), |(s, a), &v| (s + v as f64, a + (v as f64).abs())))
}

/// This process's peak resident set (Linux: `VmHWM`), mapped file pages
/// included.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn format_duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs >= 1.0 { format!("{secs:.2} s") } else { format!("{:.3} ms", secs * 1e3) }
}

fn run(registry: &Registry, args: &RunArgs) -> Result<()> {
    let loaded = match &args.graph {
        Some(path) => load_any(registry, path, args.weights, args.memory_budget)?,
        None => {
            let mut config = LlamaConfig::llama3_8b_decoder_layer();
            config.layer.cache_dtype = args.kv_cache_dtype;
            Loaded { graph: decoder_layer_graph(&config, registry.ops())?, artifact: None }
        }
    };
    let graph = loaded.graph;
    let options = CompileOptions {
        target: args.target,
        bindings: binding_map(&args.bindings)?,
        build: BuildOptions {
            implementation: args.kernel.implementation(),
            specialize_shapes: args.specialize_shapes,
            cpu_tier: args.cpu_tier,
            ..BuildOptions::default()
        },
        memory_budget: args.memory_budget,
        fuse: !args.no_fuse,
    };
    let compile_start = Instant::now();
    let exe = match loaded.artifact {
        Some(mut artifact) => {
            if artifact.options.target != options.target {
                return Err(Error::Usage(format!(
                    "the artifact was compiled for the {} target; run it with --target {} or compile it again",
                    artifact.options.target, artifact.options.target
                )));
            }
            if artifact.options.build.implementation != options.build.implementation {
                return Err(Error::Usage(
                    "the artifact was compiled for the other --kernel choice; compile it again with that choice".into(),
                ));
            }
            let compiled_for = artifact.options.build.cpu_tier;
            if args.cpu_tier != CpuTier::Auto && args.cpu_tier != compiled_for {
                return Err(Error::Usage(format!(
                    "the artifact was compiled for --cpu-tier {compiled_for}; run it without --cpu-tier or compile it again with --cpu-tier {}",
                    args.cpu_tier
                )));
            }
            if args.no_fuse && artifact.options.fuse {
                return Err(unfused_artifact(&artifact.path));
            }
            artifact.options.memory_budget = args.memory_budget;
            artifact.compile(registry)?
        }
        None => compile(&graph, registry, &options)?,
    };
    let compile_time = compile_start.elapsed();
    let ctx = DeviceContextPtr::for_target(args.target, args.threads)?;
    let threads = ctx.cpu_context().map_or(0, |c| c.threads());
    let executor = Executor::new(ctx);

    let mut scenario = match &args.inputs {
        Some(path) => Scenario::from_tensors(&graph, read_safetensors(path)?, args.seed)?,
        None => {
            let budget = args.memory_budget.unwrap_or(kvjit::DEFAULT_MEMORY_LIMIT);
            let (batch, seq) = (
                args.scenario_size("batch", args.batch, EXAMPLE_BATCH)?,
                args.scenario_size("seq", args.seq, EXAMPLE_SEQ)?,
            );
            Scenario::prefill_within(&graph, args.seed, batch, seq, budget)?
        }
    };

    if let Some(path) = &args.output {
        check_writable(path).map_err(|e| Error::Usage(format!("--output {}: {e}", path.display())))?;
    }
    if args.steps > 0 {
        // Refused before the first step runs, not after it.
        scenario.check_decode_steps()?;
    }
    println!(
        "graph '{}': {} node(s), target {}, {} threads, seed {}",
        graph.name(),
        graph.nodes().len(),
        args.target,
        threads,
        args.seed
    );
    println!("compiled {} kernel(s) in {}", exe.steps().len(), format_duration(compile_time));
    let label_width = exe.steps().iter().map(|s| s.label.len()).max().unwrap_or(0);
    for step in exe.steps() {
        println!("  {:<label_width$} {} [{}]", step.label, step.kernel.key(), step.kernel.implementation());
    }
    println!();
    println!(
        "{:<5} {:<8} {:<24} {:<28} {:>8} {:>12}",
        "step", "kind", "valid lengths", "cache lengths before", "tokens", "time"
    );

    let mut node_time: Vec<Duration> = vec![Duration::ZERO; exe.steps().len()];
    let mut total_tokens = 0usize;
    let mut last = None;
    for step in 0..=args.steps {
        if step > 0 {
            scenario.next_decode_step()?;
        }
        let cache_lengths = scenario.caches.values().next().map(|c| c.cache_lengths().to_vec()).unwrap_or_default();
        let tokens = scenario.tokens_this_step();
        let started = Instant::now();
        let out = executor.run(&exe, &scenario.inputs, &mut scenario.caches)?;
        let elapsed = started.elapsed();
        for (total, timing) in node_time.iter_mut().zip(&out.timings) {
            *total += timing.elapsed;
        }
        scenario.advance()?;
        total_tokens += tokens;
        let kind = if step == 0 { if args.inputs.is_some() { "given" } else { "prefill" } } else { "decode" };
        println!(
            "{step:<5} {kind:<8} {:<24} {:<28} {tokens:>8} {:>12}",
            format!("{:?}", scenario.valid_lengths().unwrap_or_default()),
            format!("{cache_lengths:?}"),
            format_duration(elapsed)
        );
        last = Some(out);
    }
    let out = last.expect("at least one step runs");

    println!();
    println!("time per node (mean of {} steps):", args.steps + 1);
    for (step, total) in exe.steps().iter().zip(&node_time) {
        println!(
            "  {:<label_width$} {:>12}  {}",
            step.label,
            format_duration(*total / (args.steps as u32 + 1)),
            step.kernel.key()
        );
    }
    for (name, cache) in &scenario.caches {
        println!("cache '{name}': {total_tokens} tokens written, lengths now {:?}", cache.cache_lengths());
    }
    print_compile_log();
    for (name, tensor) in &out.outputs {
        let (sum, abs) = checksum(tensor)?;
        println!("output '{name}': {}{:?} checksum sum={sum:.6} abs_sum={abs:.6}", tensor.dtype(), tensor.shape());
    }

    if let Some(peak) = peak_rss_bytes() {
        println!("peak RSS: {:.1} MB", peak as f64 / 1e6);
    }

    if let Some(path) = &args.output {
        let mut named: Vec<(String, Tensor)> = out.outputs.into_iter().collect();
        for (name, cache) in &scenario.caches {
            named.extend(cache.to_tensors(name)?);
        }
        if let Some((dup, _)) = named.iter().enumerate().find(|(i, (n, _))| named[..*i].iter().any(|(m, _)| m == n)) {
            return Err(Error::Usage(format!("output name '{}' clashes with a cache tensor name", named[dup].0)));
        }
        write_safetensors(path, named.iter().map(|(n, t)| (n.as_str(), t)))?;
        println!("wrote {} tensors to {}", named.len(), path.display());
    }
    Ok(())
}

/// `--no-fuse` for an artifact compiled fused: its kernels (and packed
/// sibling weights) are the fused ones, so it cannot run unfused.
fn unfused_artifact(path: &Path) -> Error {
    Error::Usage(format!(
        "{} was compiled with its nodes fused, so --no-fuse cannot apply to it (compile it again with --no-fuse)",
        path.display()
    ))
}

/// Whether a file can be written at `path` (checked before a long run, not
/// after it): a regular file (or a link to one) is opened for appending,
/// so it is left as it is; where nothing is, a file is made and removed
/// again. Anything else is refused: a FIFO would block the check, a
/// device (`/dev/full`) fail only after the run, and a link to nothing
/// would be written through.
fn check_writable(path: &Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    match std::fs::symlink_metadata(path) {
        Ok(_) => {
            let target = std::fs::metadata(path)
                .map_err(|e| Error::new(e.kind(), format!("a symbolic link to nothing that can be read ({e})")))?;
            if !target.is_file() {
                return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
            }
            std::fs::OpenOptions::new().append(true).open(path)?;
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            // create_new does not follow a link: nothing is made elsewhere.
            std::fs::OpenOptions::new().write(true).create_new(true).open(path)?;
            std::fs::remove_file(path)?;
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// The ids of a prompt as the model is fed it: BOS as the vocabulary asks
/// and control tokens parsed whole, wrapped in the chat template as a user
/// message with `chat`.
fn prompt_ids(tokenizer: &kvjit::tokenizer::Tokenizer, text: &str, chat: bool) -> Result<Vec<u32>> {
    let ids = if chat {
        let messages = [kvjit::tokenizer::ChatMessage::new("user", text)];
        let formatted = tokenizer.apply_chat_template(&messages, true).map_err(|e| Error::Usage(e.to_string()))?;
        let parse = kvjit::tokenizer::EncodeOptions { add_special: true, parse_special: true };
        tokenizer.encode_with(&formatted, parse)
    } else {
        tokenizer.encode(text, true)
    };
    ids.map_err(|e| Error::Usage(format!("tokenizer: {e}")))
}

/// The GGUF file whose tokenizer `model` uses: the file itself, or the one
/// the model.json names (for an artifact, the model.json it was compiled
/// from, beside it).
fn tokenizer_gguf(model: &Path) -> Result<PathBuf> {
    if kvjit::models::gguf::is_gguf(model) {
        return Ok(model.to_path_buf());
    }
    if kvjit::artifact::is_artifact(model) {
        let source = kvjit::artifact::source_graph_beside(model).ok_or_else(|| {
            Error::Usage(format!(
                "{}: the artifact names no graph file beside it, so there is no tokenizer (compile it from the \
                 model.json kvjit import wrote, into the same folder)",
                model.display()
            ))
        })?;
        return kvjit::models::gguf::gguf_of_graph_file(&source);
    }
    kvjit::models::gguf::gguf_of_graph_file(model)
}

/// `kvjit tokenize`: the prompt's ids, a line each with the text each
/// stands for (escaped), then their count.
fn tokenize(model: &Path, prompt: &str, chat: bool) -> Result<()> {
    let gguf = kvjit::gguf::Gguf::open(&tokenizer_gguf(model)?)?;
    let tokenizer = kvjit::models::gguf::vocabulary_tokenizer(&gguf)?;
    let ids = prompt_ids(&tokenizer, prompt, chat)?;
    for &id in &ids {
        // A piece that is not whole UTF-8 (part of an emoji) as its bytes.
        let bytes = tokenizer.token_bytes(id).unwrap_or_default();
        match std::str::from_utf8(bytes) {
            Ok(text) => println!("{id:>7} {text:?}"),
            Err(_) => println!("{id:>7} b\"{}\"", bytes.escape_ascii()),
        }
    }
    eprintln!("{}", kvjit::generate::count_tokens(ids.len()));
    Ok(())
}

/// `kvjit generate`: load the model (a GGUF, or a graph file naming one)
/// and its tokenizer, compile, run the prompts, stream the text.
fn generate(registry: &Registry, args: &GenerateArgs) -> Result<()> {
    use std::io::Write as _;

    use kvjit::generate::{GenerateOptions, Model, Sampling};
    use kvjit::models::gguf::{load_model, tokenizer};

    let is_gguf = kvjit::models::gguf::is_gguf(&args.model);
    let is_artifact = !is_gguf && kvjit::artifact::is_artifact(&args.model);
    // A model.json or an artifact fixed its dtype and cache at import:
    // flags that would change them are refused, not ignored.
    let fixed = if is_gguf { Vec::new() } else { args.shape.given() };
    if !fixed.is_empty() {
        return Err(Error::Usage(format!(
            "{} was built by kvjit import, which fixed what {} would set (pass them there, or give the .gguf)",
            args.model.display(),
            fixed.join(", ")
        )));
    }
    let started = Instant::now();
    let options = CompileOptions { fuse: !args.no_fuse, ..CompileOptions::default() };
    let (graph, exe, gguf_path) = if is_gguf {
        let graph = load_model(&args.model, registry.ops(), &args.shape.options(), WeightLoad::Map)?;
        let exe = compile(&graph, registry, &options)?;
        (graph, exe, args.model.clone())
    } else if is_artifact {
        // The tokenizer is the GGUF's that the artifact's source graph
        // (a model.json beside it) names.
        let gguf_path = tokenizer_gguf(&args.model)?;
        let loaded = kvjit::artifact::load_artifact(&args.model, registry)?;
        if args.no_fuse && loaded.options.fuse {
            return Err(unfused_artifact(&loaded.path));
        }
        let exe = loaded.compile(registry)?;
        (loaded.graph, exe, gguf_path)
    } else {
        let gguf_path = tokenizer_gguf(&args.model)?;
        let graph = load(registry, &args.model, WeightLoad::Map, None)?;
        let exe = compile(&graph, registry, &options)?;
        (graph, exe, gguf_path)
    };
    let gguf_file = kvjit::gguf::Gguf::open(&gguf_path)?;
    let ctx = DeviceContextPtr::for_target(Target::Cpu, args.threads)?;
    let model = Model::new(&graph, registry, exe, Executor::new(ctx))?;
    let tokenizer = tokenizer(&gguf_file, model.vocab_size())?;
    let compile_time = started.elapsed();

    let prompts = args.prompt.iter().map(|text| prompt_ids(&tokenizer, text, args.chat)).collect::<Result<Vec<_>>>()?;
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed };
    let generate_options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        stop: tokenizer.eog_ids().to_vec(),
        keep_logits: args.logits.is_some(),
    };
    model.check(&prompts, &generate_options)?;
    if let Some(path) = &args.logits {
        check_writable(path).map_err(|e| Error::Usage(format!("--logits {}: {e}", path.display())))?;
    }
    eprintln!("model '{}': {} prompt(s), compiled in {}", graph.name(), prompts.len(), format_duration(compile_time));
    if is_gguf {
        kvjit::models::gguf::weight_notes(&gguf_file, &args.shape.options()).iter().for_each(|n| eprintln!("{n}"));
    }
    let streaming = prompts.len() == 1;
    let mut decoders: Vec<_> = prompts.iter().map(|_| tokenizer.decoder().skip_special(true)).collect();
    let mut texts = vec![String::new(); prompts.len()];
    let mut stdout = std::io::stdout();
    if streaming && !args.chat {
        print!("{}", args.prompt[0]);
    }
    // The tokenizer covers every id the model scores (checked above), so
    // a decoding error is a bug to report, not a piece to drop.
    let mut decode_error = None;
    let out = model.generate(&prompts, &generate_options, &mut |p, token| {
        let piece = match decoders[p].push(token) {
            Ok(piece) => piece,
            Err(e) => {
                decode_error.get_or_insert(e);
                String::new()
            }
        };
        if streaming {
            print!("{piece}");
            let _ = stdout.flush();
        } else {
            texts[p].push_str(&piece);
        }
    })?;
    if let Some(e) = decode_error {
        return Err(Error::Usage(format!("decoding the generated tokens: {e}")));
    }
    for (p, decoder) in decoders.iter_mut().enumerate() {
        let rest = decoder.finish();
        if streaming {
            println!("{rest}");
        } else {
            texts[p].push_str(&rest);
            println!(
                "--- prompt {p}: {}\n{}{}",
                args.prompt[p],
                if args.chat { "" } else { &args.prompt[p] },
                texts[p]
            );
        }
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let generated: usize = out.tokens.iter().map(Vec::len).sum();
    let rate = |tokens: usize, time: Duration| tokens as f64 / time.as_secs_f64().max(1e-9);
    // The prefill picks each prompt's first token; decode steps the rest.
    let decoded = generated.saturating_sub(prompts.len());
    let decode = if decoded == 0 {
        "no decode step".to_string()
    } else {
        format!("decode {:.1} tok/s", rate(decoded, out.decode))
    };
    eprintln!(
        "prompt: {}, prefill {:.1} tok/s; generated: {}, {decode}",
        kvjit::generate::count_tokens(prompt_tokens),
        rate(prompt_tokens, out.prefill),
        kvjit::generate::count_tokens(generated),
    );
    if let Some(path) = &args.logits {
        let mut named: Vec<(String, Tensor)> = Vec::new();
        for (p, prompt) in prompts.iter().enumerate() {
            let suffix = if prompts.len() == 1 { String::new() } else { format!(".{p}") };
            let tokens: Vec<u32> = prompt.iter().chain(&out.tokens[p]).copied().collect();
            named.push((format!("tokens{suffix}"), Tensor::from_vec(&[tokens.len()], tokens)?));
            let rows = &out.logits[p];
            let vocab = rows.first().map_or(0, Vec::len);
            let flat: Vec<f32> = rows.iter().flatten().copied().collect();
            named.push((format!("logits{suffix}"), Tensor::from_vec(&[rows.len(), vocab], flat)?));
        }
        write_safetensors(path, named.iter().map(|(n, t)| (n.as_str(), t)))?;
        eprintln!("wrote tokens and logits to {}", path.display());
    }
    Ok(())
}
