//! kvjit's Cranelift plumbing, shared by every op's CPU emitter.
//!
//! - [`host_isa`]: the host's ISA with the features `cranelift_native` detects
//!   (AVX2/FMA on x86-64; without them an F32X4 `fma` would become libcalls).
//! - [`compile_function`]: build one function with a [`FunctionBuilder`](cranelift_frontend::FunctionBuilder)
//!   closure and JIT it into its own module; the returned [`JitFunction`] owns
//!   the machine code and frees it when dropped.
//! - [`ir`]: the emitter kit every op's kernels are written with — counted
//!   loops and branches, dtype-converting vector loads and stores (bf16/f16
//!   ↔ f32 by integer bit manipulation), element addresses and checked
//!   displacements, sizes baked in or read at run time, shuffles, `exp`,
//!   FP8 (E4M3) codes.
//! - [`compile_kernel`] / [`launch`]: the one ABI every CPU kernel has
//!   (`fn(args: *const u64, begin, end)`) and the one typed, documented
//!   `unsafe` entry that splits a kernel's work items over the worker pool
//!   of a `DeviceContextPtr`.
//! - [`microkernel`]: the 256-bit tier — AVX2/FMA tile micro-kernels compiled
//!   ahead of time, which Cranelift-emitted drivers call once per register
//!   tile; [`microkernel::resolve_tier`] picks the tier a kernel is built for.
//! - [`quant`]: GGML weight blocks in that tier — the packed panel layout of
//!   Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/q8_min/Q4_K/Q5_K/Q6_K, the integer GEMV tiles over 8-bit quantized
//!   activations, and the kernels that decode a block of a panel to f32.
//! - [`kernels`]: the process-wide [`KernelCache`] — compile once per
//!   [`KernelKey`](kvjit_core::KernelKey), share across nodes, graphs and
//!   threads, free when the last user drops, and log every compile with its
//!   cause ([`compile_log`]); [`compile_or_fetch`], the call every op's
//!   kernel makes to it; [`SeenShapes`], the policy that specializes a
//!   generic kernel for the shapes it runs with.
//! - [`attention_kernel`]: the 256-bit tier of paged decode attention — an
//!   AVX2/FMA flash-decoding micro-kernel over a run of keys for every KV
//!   head's query rows, reading K/V (f32, bf16, f16, FP8 E4M3) in place
//!   from the cache pages.
//!
//! Cranelift runs at `opt_level=none`: it keeps the IR order the emitters
//! choose (the egraph at `speed` hoists every load of an unrolled body and
//! spills) and compiles several times faster. Its IR verifier runs only in
//! builds with debug assertions (every `cargo test`) or with
//! `KVJIT_JIT_VERIFY=1` (see [`host_isa`]).

pub mod attention_kernel;
mod cache;
mod function;
pub mod ir;
mod kernel;
pub mod microkernel;
pub mod quant;

pub use cache::{CompileCause, CompileRecord, CompiledArtifact, KernelCache};
pub use cranelift_codegen;
pub use cranelift_frontend;
pub use function::{CaptureText, JitFunction, c_call_conv, compile_function, host_isa, live_code_bytes, pointer_type};
pub use kernel::{
    KernelArgs, KernelParams, MAX_SEEN_SHAPES, SeenShapes, UNEVEN_PARTS_PER_THREAD, compile_kernel, compile_log,
    compile_or_fetch, kernels, launch, launch_uneven,
};

/// What can go wrong turning IR into machine code.
#[derive(Debug, thiserror::Error)]
pub enum JitError {
    /// The host ISA could not be set up.
    #[error("cannot set up the host ISA for JIT compilation: {0}")]
    Isa(String),
    /// A CPU tier this CPU cannot run was asked for.
    #[error("the {tier} CPU tier needs {needs}; this {arch} CPU lacks them (build for the cranelift or auto tier)")]
    TierUnavailable {
        /// The tier asked for.
        tier: kvjit_core::CpuTier,
        /// The CPU features it needs.
        needs: &'static str,
        /// This CPU's architecture.
        arch: &'static str,
    },
    /// A kernel whose sizes the generated code cannot address.
    #[error("cannot generate code for {key}: {reason}")]
    Unsupported {
        /// The kernel key.
        key: String,
        /// Which size is out of range.
        reason: String,
    },
    /// Cranelift rejected the function (a bug in an emitter).
    #[error("Cranelift could not compile {name}: {message}")]
    Codegen {
        /// Function name.
        name: String,
        /// Cranelift's message.
        message: String,
    },
}
