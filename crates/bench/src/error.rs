//! The benchmarks' error: a request that cannot run, a measurement that
//! cannot be trusted, a file or process that failed, or a kvjit error
//! underneath. Every message is one line (the `kvjit` binary prints it after
//! `error: `).

use std::path::PathBuf;
use std::process::ExitStatus;

use kvjit_core::DType;

use crate::cli::BenchOps;
use crate::problem::ModelShape;
use crate::workload::Heads;

/// Result alias of the benchmarks.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Why a benchmark could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A list option left empty.
    #[error("{option} needs at least one value")]
    NoValues {
        /// The option, as typed (`--ms`).
        option: &'static str,
    },
    /// A list option naming one value twice.
    #[error("{option} names {value} twice")]
    Repeated {
        /// The option, as typed (`--pages`).
        option: &'static str,
        /// The value named twice.
        value: String,
    },
    /// A run larger than this machine can hold.
    #[error("{0}")]
    TooLarge(String),
    /// A count or size of 0 where the run needs at least one.
    #[error("{what} must be at least 1")]
    Zero {
        /// What is 0 (an option or the quantity it sets).
        what: &'static str,
    },
    /// A dtype that is not a compute float where the run computes in it.
    #[error("dtype {dtype} is not a float type: use f32, bf16 or f16")]
    NotComputeFloat {
        /// The dtype given.
        dtype: DType,
    },
    /// A weight format the block-format suite cannot time.
    #[error(
        "weight format {dtype} is neither a float type (f32, bf16, f16) nor a block format ({})",
        block_format_names()
    )]
    NotWeightFormat {
        /// The dtype given.
        dtype: DType,
    },
    /// Attention heads no kernel takes (a zero size, query heads not a
    /// multiple of KV heads).
    #[error("invalid attention heads {heads:?}")]
    InvalidHeads {
        /// The heads.
        heads: Heads,
    },
    /// An option of another suite than the one chosen.
    #[error("{option} applies to --ops {} only, not to --ops {ops}", suites(takes))]
    OptionNotForOps {
        /// The option, as typed.
        option: &'static str,
        /// The suite chosen.
        ops: BenchOps,
        /// The suites that take it.
        takes: &'static [BenchOps],
    },
    /// `--json` naming the file the plot would be written to.
    #[error("--json {} would be overwritten by the plot; name it *.json", path.display())]
    JsonIsPlot {
        /// The path given.
        path: PathBuf,
    },
    /// Weights made for another shape or dtype than the call's.
    #[error(
        "benchmark weights are {weights_dtype}{weights_shape:?}, but {shape} in {dtype} needs [{}, {}]",
        shape.n(), shape.k
    )]
    WeightsMismatch {
        /// The weights' dtype.
        weights_dtype: DType,
        /// The weights' shape.
        weights_shape: Vec<usize>,
        /// The call's model shape.
        shape: ModelShape,
        /// The call's dtype.
        dtype: DType,
    },
    /// A peer asked to run a configuration it does not implement.
    #[error("the {peer} peer reads f32, bf16 and f16 caches, not {dtype}")]
    PeerUnavailable {
        /// The peer.
        peer: &'static str,
        /// The cache dtype it was given.
        dtype: DType,
    },
    /// An optional peer's system library could not be loaded.
    #[error("the {peer} peer is not available: {why}")]
    PeerNotLoaded {
        /// The peer.
        peer: &'static str,
        /// What the loader said, and how to install the library.
        why: String,
    },
    /// A tensor of a rank or shape the call cannot take.
    #[error("{what} must be {expected}, got {got:?}")]
    Shape {
        /// The tensor.
        what: &'static str,
        /// The shape it needs, in symbols.
        expected: &'static str,
        /// The shape it has.
        got: Vec<usize>,
    },
    /// A measurement that needs the CPU given another device's context.
    #[error("{what} run on a CPU context")]
    NotCpu {
        /// The measurement.
        what: &'static str,
    },
    /// A kernel the benchmark builds itself that the JIT refused.
    #[error("cannot compile the kernel {key}: {source}")]
    Compile {
        /// The kernel's key.
        key: String,
        /// The JIT's reason.
        source: kvjit_jit::JitError,
    },
    /// Two kernels that must write the same bytes did not.
    #[error("M = {m}: the two kernels' Q outputs differ")]
    OutputsDiffer {
        /// The call's rows.
        m: usize,
    },
    /// An output holding NaN or an infinity.
    #[error("{what} is not finite")]
    NotFinite {
        /// The output.
        what: &'static str,
    },
    /// Attention configurations whose kvjit and peer outputs disagreed, or
    /// layer workloads whose fused and unfused outputs did (the report shows
    /// them; the command fails after printing it).
    #[error("{} {what} failed validation: {}", failures.len(), failures.join("; "))]
    ValidationFailed {
        /// What failed: `attention configuration(s)`, `layer workload(s)`.
        what: &'static str,
        /// One line per configuration: which, and why.
        failures: Vec<String>,
    },
    /// A file that could not be created or written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The system's reason.
        source: std::io::Error,
    },
    /// A file that could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's reason.
        source: std::io::Error,
    },
    /// A directory that could not be made.
    #[error("cannot make {}: {source}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The system's reason.
        source: std::io::Error,
    },
    /// A temporary directory that could not be made.
    #[error("cannot make a temporary directory in {}: {source}", parent.display())]
    TempDir {
        /// The directory it would go in.
        parent: PathBuf,
        /// The system's reason.
        source: std::io::Error,
    },
    /// The running executable, which the start-up benchmark runs as `kvjit`,
    /// could not be found.
    #[error("cannot find the kvjit executable to run: {source}")]
    NoExecutable {
        /// The system's reason.
        source: std::io::Error,
    },
    /// A child process that could not be started.
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        /// Its command line.
        command: String,
        /// The system's reason.
        source: std::io::Error,
    },
    /// A child process that failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    ChildFailed {
        /// Its command line.
        command: String,
        /// How it ended.
        status: ExitStatus,
        /// The first line it wrote on stderr.
        stderr: String,
    },
    /// A line of `kvjit run`'s output that does not read as the figure it
    /// should hold.
    #[error("cannot read {what} in `kvjit run` output line '{line}'")]
    RunOutput {
        /// The figure.
        what: &'static str,
        /// The line.
        line: String,
    },
    /// A child process whose output lacks a figure the benchmark reads.
    #[error("`{command}` printed no {what}")]
    MissingFigure {
        /// Its command line.
        command: String,
        /// The figure.
        what: &'static str,
    },
    /// A suite that measures the 256-bit tier, on a CPU without it.
    #[error("--ops {suite} measures the avx2 tier, which this CPU lacks (it needs AVX2, FMA and F16C)")]
    NeedsAvx2 {
        /// The suite.
        suite: &'static str,
    },
    /// A kvjit error: a tensor, cache, graph, compile or run problem.
    #[error(transparent)]
    Kvjit(#[from] kvjit::Error),
}

/// `qkv and attention`.
fn suites(ops: &[BenchOps]) -> String {
    let names: Vec<String> = ops.iter().map(BenchOps::to_string).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

impl From<kvjit_core::Error> for BenchError {
    fn from(e: kvjit_core::Error) -> Self {
        Self::Kvjit(e.into())
    }
}

impl From<kvjit_graph::GraphError> for BenchError {
    fn from(e: kvjit_graph::GraphError) -> Self {
        Self::Kvjit(e.into())
    }
}

impl From<kvjit_runtime::RuntimeError> for BenchError {
    fn from(e: kvjit_runtime::RuntimeError) -> Self {
        Self::Kvjit(e.into())
    }
}

/// The block formats, comma-separated, for messages.
fn block_format_names() -> String {
    DType::BLOCK_FORMATS.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}
