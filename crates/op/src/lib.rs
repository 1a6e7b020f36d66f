//! The op platform: what every kvjit op is built on, so an op is its
//! parameters, spec, shape rules, argument contract and kernel bodies —
//! nothing copied.
//!
//! - [`params!`]: the node parameters, declared once as a typed struct;
//!   the [`ParamSpec`](kvjit_graph::ParamSpec) table and the graph-file
//!   conversions are generated ([`OpParams`]).
//! - [`Op`] + [`Defined`]: an op's definition; `Defined(op)` is its graph
//!   [`OpDef`](kvjit_graph::OpDef) and runtime
//!   [`KernelBuilder`](kvjit_runtime::KernelBuilder) at once, with the
//!   typed spec ([`KernelSpec`](kvjit_core::KernelSpec)) flowing from
//!   [`Op::specialize`] to the builder inside the key, targets the op does
//!   not serve refused by default.
//! - [`CallContract`] + [`OpKernel`] + [`Compiled`]: a call's check,
//!   declared once per op and shared by its kernels; the one
//!   [`Kernel`](kvjit_runtime::Kernel) impl does the arity, dtype,
//!   contiguity and output checks and runs nothing before every check
//!   passed.
//! - [`checks`]: the checks several ops make (baked dims, a paged step,
//!   the cache rows a step writes); [`expect_float_step`]: a spec-less
//!   step's dtypes.
//! - [`elementwise`]: what elementwise ops check and run alike (the
//!   dtype from the input, operands of one type, the baked element count,
//!   and the kernel: a map over `F32X4` vectors whose arithmetic is all
//!   an op writes).
//! - [`gemm`]: the GEMM driver of every matmul-shaped kernel (packed
//!   weight panels, the tiers' schedules and micro-kernels, an op's
//!   epilogue called with each finished row).
//! - [`rows`]: row-wise inputs `[..., H]` (H baked in, rows static or
//!   not), and what ops that copy whole rows share (`mo.gather`,
//!   `kvjit.last_valid_token`): the row emitters and the reference.
//! - [`store_f64`]: a reference kernel's f64 results, rounded once to the
//!   output's dtype.
//! - [`kernel_args!`]: a JIT kernel's `#[repr(C)]` argument struct of
//!   u64 words and its `KernelArgs` impl, declared once.
//! - [`op_error!`]: an op's own error enum as a `kvjit_core::Error`.

pub mod checks;
mod def;
pub mod elementwise;
pub mod gemm;
mod jit;
mod kernel;
mod kernel_args;
mod op_error;
mod params;
mod rounding;
pub mod rows;
mod step_args;

pub use def::{
    BoxError, Built, Constants, CpuBuild, CpuKernel, Defined, Op, Specialized, add_node, built, compile_error, spec_of,
};
pub use jit::{Jit, JitSpec, Launch};
pub use kernel::{
    ArgDType, Call, CallContract, Compiled, KV_COLLECTION, OpKernel, Reference, TensorArg, check_dtypes,
    check_signature,
};
pub use params::{Choice, OpParams, Param};
pub use rounding::{round_bf16, round_f16, store_f64};
pub use step_args::expect_float_step;

#[doc(hidden)]
pub use kvjit_core as core;
#[doc(hidden)]
pub use kvjit_graph as graph;
#[doc(hidden)]
pub use kvjit_jit as jit_crate;

#[doc(hidden)]
pub use params::spec_of as param_spec;

/// The tensor arguments of a paged op's call ([`CallContract::TENSORS`]):
/// the named tensors in the compute dtype, then the step's
/// [`LAYER_IDX`](TensorArg::LAYER_IDX) and
/// [`VALID_LENGTHS`](TensorArg::VALID_LENGTHS), MAX's order.
/// `paged_tensors!["q_proj", "freqs_cis"]`.
#[macro_export]
macro_rules! paged_tensors {
    ($($name:literal),+ $(,)?) => {
        &[$($crate::TensorArg::compute($name),)+ $crate::TensorArg::LAYER_IDX, $crate::TensorArg::VALID_LENGTHS]
    };
}
