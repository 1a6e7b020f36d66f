//! The runtime's error enum.

use kvjit_core::{DType, Target};

/// Result alias for this crate.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Everything that can go wrong building or running an executable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// A target that cannot be used here.
    #[error("{} target unavailable: {reason}", target.name().to_uppercase())]
    TargetUnavailable {
        /// The target.
        target: Target,
        /// Why.
        reason: String,
    },
    /// The worker pool could not be started.
    #[error("cannot start the CPU worker pool: {0}")]
    ThreadPool(String),
    /// An executable whose parts do not fit together (a compiler bug, and
    /// only that).
    #[error("malformed executable: {0}")]
    Plan(String),
    /// A kernel's code could not be generated (e.g. the JIT refused it).
    #[error("cannot compile the kernel {key}: {source}")]
    Compile {
        /// The kernel key.
        key: String,
        /// The backend's typed error.
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A kernel implementation that does not exist for this key (e.g. the
    /// CPU-only reference asked for a CUDA key).
    #[error("{key}: {reason}")]
    NoImplementation {
        /// The kernel key.
        key: String,
        /// Why.
        reason: String,
    },
    /// A graph input the caller did not supply.
    #[error("missing input '{name}' ({expected})")]
    MissingInput {
        /// Input name.
        name: String,
        /// Its expected type.
        expected: String,
    },
    /// A KV cache named twice in one run.
    #[error("KV cache '{0}' is given twice")]
    DuplicateCache(String),
    /// A KV cache the caller did not supply.
    #[error("missing KV cache '{0}'")]
    MissingCache(String),
    /// A name the executable has no input or cache for.
    #[error("'{name}' is not an input or KV cache of this graph (it takes: {known})")]
    UnexpectedInput {
        /// The name supplied.
        name: String,
        /// The names it takes.
        known: String,
    },
    /// An input with the wrong dtype.
    #[error("input '{name}': expected dtype {expected}, got {got}")]
    InputDType {
        /// Input name.
        name: String,
        /// Expected dtype.
        expected: DType,
        /// Supplied dtype.
        got: DType,
    },
    /// An input with the wrong shape.
    #[error("input '{name}': expected shape {expected}, got {got:?}")]
    InputShape {
        /// Input name.
        name: String,
        /// Expected shape, symbols spelled out.
        expected: String,
        /// Supplied shape.
        got: Vec<usize>,
    },
    /// One symbol bound to two different sizes by the inputs.
    #[error("symbol '{symbol}' is {first} from {first_from} but {second} from {second_from}")]
    SymbolConflict {
        /// The symbol.
        symbol: String,
        /// First size seen.
        first: usize,
        /// Where.
        first_from: String,
        /// Conflicting size.
        second: usize,
        /// Where.
        second_from: String,
    },
    /// A KV cache whose layout differs from the graph's.
    #[error("KV cache '{name}': {problem}")]
    CacheMismatch {
        /// Cache name.
        name: String,
        /// What differs.
        problem: String,
    },
    /// A kernel refused its arguments (nothing was written).
    #[error("node {step} ({key}): {source}")]
    Kernel {
        /// The step (node) label.
        step: String,
        /// The kernel's key.
        key: String,
        /// Why.
        source: kvjit_core::Error,
    },
}
