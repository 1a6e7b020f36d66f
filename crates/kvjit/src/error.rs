//! The facade's error: any layer's error, unchanged.

/// Result alias for the facade.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error from any part of kvjit. Each variant wraps the crate error that
/// says what went wrong; match on it to tell the cases apart.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Tensor, cache, tensor-file or op-argument problem.
    #[error(transparent)]
    Tensor(#[from] kvjit_core::Error),
    /// Graph, graph-file or specialization problem.
    #[error(transparent)]
    Graph(#[from] kvjit_graph::GraphError),
    /// Target, executable or run problem.
    #[error(transparent)]
    Runtime(#[from] kvjit_runtime::RuntimeError),
    /// A CPU code tier this machine cannot run (resolving `--cpu-tier`).
    #[error(transparent)]
    Jit(#[from] kvjit_jit::JitError),
    /// A compiled artifact that cannot be used.
    #[error(transparent)]
    Artifact(#[from] crate::artifact::ArtifactError),
    /// A graph whose buffers need more memory than the compile budget.
    #[error(
        "graph needs {needed} bytes ({} constants, {} outputs, {} KV caches), more than the memory budget of {budget} bytes",
        estimate.constants, estimate.outputs, estimate.caches
    )]
    MemoryBudget {
        /// Bytes needed (known part).
        needed: u64,
        /// The budget.
        budget: u64,
        /// The breakdown.
        estimate: crate::MemoryEstimate,
    },
    /// A constant stored in a kernel's layout (by a compiled artifact) that
    /// the kernel built for its consumer does not take.
    #[error(
        "constant '{constant}' is stored in the kernel layout {layout}, which the kernel {key} does not take (the artifact was made for other kernels or build options; compile it again)"
    )]
    PreparedNotTaken {
        /// The constant.
        constant: String,
        /// Its stored layout.
        layout: String,
        /// The kernel that refused it.
        key: String,
    },
    /// `kvjit compare`: tensors that differ beyond the tolerance.
    #[error("{count} of {total} tensors differ beyond the tolerance; first: {first}")]
    Mismatch {
        /// Tensors that differ.
        count: usize,
        /// Tensors compared.
        total: usize,
        /// The first that differs, with its max error.
        first: String,
    },
    /// A request the caller made that cannot be met (e.g. an example scenario
    /// for a graph it does not fit).
    #[error("{0}")]
    Usage(String),
}
