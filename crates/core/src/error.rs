//! The error enum of kvjit's core: tensors, caches, files, devices, and the
//! argument checks every paged op shares.
//!
//! What lives here is about tensors and the paged cache: a tensor argument of
//! the wrong dtype or shape, a layer the cache does not have, a page table
//! that points outside the cache, two tokens writing one slot. Every op that
//! reads or writes the cache (and every target: reference, JIT, CUDA) checks
//! these the same way, through the same functions of this crate, before
//! writing a byte. What only one op checks is that op's own error type,
//! carried as [`Error::Op`]; a device failure keeps its typed source in
//! [`Error::Device`].

use std::path::PathBuf;

use crate::DType;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can be wrong with a tensor, a cache, a tensor file or an
/// op call's arguments.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A dtype name that kvjit does not know.
    #[error("unknown dtype '{0}': expected one of {names}", names = crate::DType::names())]
    UnknownDType(String),
    /// A target name that kvjit does not know.
    #[error("unknown target '{0}': expected cpu or cuda")]
    UnknownTarget(String),
    /// A CPU tier name that kvjit does not know.
    #[error("unknown CPU tier '{0}': expected auto, cranelift or avx2")]
    UnknownCpuTier(String),
    /// A shape whose element count overflows usize.
    #[error("shape {0:?} has more elements than fit in memory")]
    ShapeOverflow(Vec<usize>),
    /// The system could not provide memory for a tensor.
    #[error("cannot allocate {bytes} bytes for a tensor")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
    },
    /// Storage length does not match the shape.
    #[error("shape {shape:?} needs {expected} elements, got {got}")]
    ElementCount {
        /// The shape asked for.
        shape: Vec<usize>,
        /// Its element count.
        expected: usize,
        /// The element count supplied.
        got: usize,
    },
    /// Byte length does not match dtype and shape.
    #[error("{dtype} tensor of shape {shape:?} needs {expected} bytes, got {got}")]
    ByteCount {
        /// Element type.
        dtype: DType,
        /// Shape.
        shape: Vec<usize>,
        /// Bytes needed.
        expected: usize,
        /// Bytes supplied.
        got: usize,
    },
    /// A block-format tensor whose rows are not whole blocks.
    #[error("a {dtype} tensor's last dim must be a multiple of its {block}-element block; got shape {shape:?}")]
    BlockShape {
        /// The block format.
        dtype: DType,
        /// Elements per block.
        block: usize,
        /// The shape.
        shape: Vec<usize>,
    },
    /// A floating-only operation on an integer tensor.
    #[error("{what} needs a floating tensor, got {dtype}")]
    NotFloat {
        /// The operation.
        what: String,
        /// The tensor's dtype.
        dtype: DType,
    },
    /// Typed access with the wrong element type.
    #[error("tensor holds {got}, accessed as {expected}")]
    WrongDType {
        /// The type asked for.
        expected: DType,
        /// The type held.
        got: DType,
    },
    /// Not a permutation of the tensor's axes.
    #[error("{perm:?} is not a permutation of {rank} axes")]
    BadPermutation {
        /// Tensor rank.
        rank: usize,
        /// The bad permutation.
        perm: Vec<usize>,
    },

    // ---- op-call validation (checked before anything is written) ----
    /// An argument's shape does not match what the op expects.
    #[error("{arg}: expected shape {expected}, got {got:?}")]
    ShapeMismatch {
        /// Argument name.
        arg: String,
        /// The expected shape, spelled with dim names.
        expected: String,
        /// The actual shape.
        got: Vec<usize>,
    },
    /// An argument's dtype does not match what the op expects.
    #[error("{arg}: expected dtype {expected}, got {got}")]
    DTypeMismatch {
        /// Argument name.
        arg: String,
        /// Expected dtype.
        expected: DType,
        /// Actual dtype.
        got: DType,
    },
    /// A strided (non-contiguous) tensor where a contiguous one is needed.
    #[error("{arg}: must be contiguous row-major (use Tensor::to_contiguous)")]
    NotContiguous {
        /// Argument name.
        arg: String,
    },
    /// A sequence claims more valid tokens than the padded length.
    #[error("valid_lengths[{batch}] = {valid_length} exceeds the padded seq_len {seq_len}")]
    ValidLengthTooLong {
        /// Sequence index.
        batch: usize,
        /// Its valid length.
        valid_length: u32,
        /// The padded sequence length S.
        seq_len: usize,
    },
    /// `layer_idx` names a layer the cache does not have.
    #[error("layer_idx {layer_idx} out of range: cache has {num_layers} layers")]
    LayerOutOfRange {
        /// The requested layer.
        layer_idx: u32,
        /// Layers in the cache.
        num_layers: usize,
    },
    /// A token's position needs a logical page beyond the page table's width.
    #[error(
        "sequence {batch}: position {position} needs logical page {logical_page}, \
         but the lookup table has {max_pages_per_seq} pages per sequence"
    )]
    LogicalPageOutOfRange {
        /// Sequence index.
        batch: usize,
        /// Token position (cache_length + t).
        position: u64,
        /// Logical page it falls in.
        logical_page: u64,
        /// Width of the lookup table.
        max_pages_per_seq: usize,
    },
    /// The page table points past the cache's physical pages.
    #[error(
        "sequence {batch}: lookup_table[{batch}, {logical_page}] = {physical_page} \
         is not a page of this cache (it has {num_pages} pages)"
    )]
    PhysicalPageOutOfRange {
        /// Sequence index.
        batch: usize,
        /// Logical page.
        logical_page: usize,
        /// The physical page found.
        physical_page: u32,
        /// Pages in the cache.
        num_pages: usize,
    },
    /// Two tokens of one call would write the same cache slot.
    #[error(
        "tokens (batch {first_batch}, t {first_t}) and (batch {second_batch}, t {second_t}) \
         would both write page {page} slot {slot}"
    )]
    SlotCollision {
        /// First writer's sequence.
        first_batch: usize,
        /// First writer's token.
        first_t: usize,
        /// Second writer's sequence.
        second_batch: usize,
        /// Second writer's token.
        second_t: usize,
        /// Physical page.
        page: u32,
        /// Slot within the page.
        slot: usize,
    },

    // ---- cache helpers ----
    /// Invalid parameters for a new cache.
    #[error("invalid KV cache parameters: {0}")]
    InvalidCacheParams(String),
    /// A sequence index beyond the cache's batch.
    #[error("sequence {batch} out of range: the cache holds {batch_size} sequences")]
    SequenceOutOfRange {
        /// Requested sequence.
        batch: usize,
        /// Sequences in the cache.
        batch_size: usize,
    },
    /// Not enough free pages to grow the step's sequences.
    #[error(
        "the step needs {needed} more cache pages in all (sequence {batch} the first to grow) but only {free} are free"
    )]
    OutOfPages {
        /// The first sequence that needs pages.
        batch: usize,
        /// Pages the step needs, all sequences together.
        needed: usize,
        /// Pages free.
        free: usize,
    },
    /// A sequence would need more logical pages than the table has.
    #[error("sequence {batch} would hold {tokens} tokens, more than {max_pages_per_seq} pages of {page_size}")]
    SequenceTooLong {
        /// Sequence index.
        batch: usize,
        /// Tokens it would hold.
        tokens: u64,
        /// Width of the lookup table.
        max_pages_per_seq: usize,
        /// Tokens per page.
        page_size: usize,
    },
    /// Reading a position that is not cached.
    #[error("sequence {batch} has {cache_length} cached tokens; position {position} is not one of them")]
    PositionNotCached {
        /// Sequence index.
        batch: usize,
        /// Requested position.
        position: usize,
        /// Tokens cached.
        cache_length: u32,
    },

    // ---- ops and devices ----
    /// An op's own contract error (its crate defines the type; downcast with
    /// [`Error::op_error`]). Displays as the source.
    #[error("{source}")]
    Op {
        /// The op's canonical name.
        op: &'static str,
        /// The op's error.
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A device (GPU) operation failed while running a kernel.
    #[error("device error: {backend}: {source}")]
    Device {
        /// The backend, e.g. `CUDA`.
        backend: &'static str,
        /// The backend's typed error (e.g. `kvjit_cuda::CudaError`).
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },

    // ---- tensor files ----
    /// A tensor file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A path that is not a regular file (a device, a FIFO, a folder).
    #[error("{}: not a regular file (kvjit reads tensors from regular files only)", path.display())]
    NotARegularFile {
        /// The path.
        path: PathBuf,
    },
    /// A safetensors file is malformed or truncated.
    #[error("malformed safetensors data: {0}")]
    Safetensors(String),
    /// A kernel handed another number of tensors, caches or outputs than
    /// its op takes.
    #[error("arguments: expected {expected}, got {got:?}")]
    KernelArguments {
        /// What the kernel takes.
        expected: String,
        /// Tensors, caches (and outputs) it was handed.
        got: Vec<usize>,
    },
    /// A cache whose layout is not the one the kernel was built for.
    #[error("kv_collection: {what} is {got}, but the op was built for {expected}")]
    CacheLayout {
        /// Which parameter.
        what: &'static str,
        /// The kernel's value.
        expected: String,
        /// The cache's value.
        got: String,
    },
    /// A dim the kernel's key baked in that differs in this call.
    #[error("{arg}: expected shape {expected}, got {got:?}")]
    NotBuiltFor {
        /// Argument name.
        arg: &'static str,
        /// The shape the kernel was built for.
        expected: String,
        /// The call's shape.
        got: Vec<usize>,
    },
    /// A tensor file whose header does not fit the file: refused before
    /// anything is mapped or allocated for its data.
    #[error("{}: not a valid {format} file: {problem}", path.display())]
    BadTensorFile {
        /// The file.
        path: PathBuf,
        /// The format it was read as (`safetensors`, `kvjit artifact`).
        format: &'static str,
        /// What does not fit.
        problem: String,
    },
    /// A safetensors tensor in a dtype kvjit does not handle.
    #[error(
        "tensor '{name}' has dtype {dtype}, which kvjit does not support (F32, BF16, F16, F8_E4M3, U32; U8 when its metadata names weight blocks)"
    )]
    UnsupportedFileDType {
        /// Tensor name.
        name: String,
        /// Its dtype as the file spells it.
        dtype: String,
    },
    /// A GGUF file's metadata lacks a key a caller needs, or holds it in
    /// a type that cannot serve (the file itself is well-formed).
    #[error("{}: {problem}", path.display())]
    GgufMetadata {
        /// The file.
        path: Box<std::path::Path>,
        /// The metadata key, e.g. `llama.block_count`.
        key: Box<str>,
        /// What is wrong, naming the key.
        problem: Box<str>,
    },
    /// A GGUF tensor that cannot become what was asked: a GGML type kvjit
    /// cannot dequantize, or a dtype it cannot be converted into.
    #[error("{}: tensor '{name}': {problem}", path.display())]
    GgufTensor {
        /// The file.
        path: Box<std::path::Path>,
        /// The tensor's name.
        name: Box<str>,
        /// What is wrong.
        problem: Box<str>,
    },
    /// A needed tensor is not in the file.
    #[error("tensor '{name}' not found{context}")]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// Where it was looked for (may be empty).
        context: String,
    },
}

impl Error {
    /// Wrap `error`, an op's own contract error, for op `op`.
    pub fn op(op: &'static str, error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Op { op, source: Box::new(error) }
    }

    /// A device failure with its typed source.
    pub fn device(backend: &'static str, error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Device { backend, source: Box::new(error) }
    }

    /// The op's own error, if this is an [`Error::Op`] carrying an `E`.
    pub fn op_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Error::Op { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }

    /// The device's own error, if this is an [`Error::Device`] carrying an `E`.
    pub fn device_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Error::Device { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}
