//! Paged flash attention: Modular MAX's `mo.mha.padded.paged`.
//!
//! For each valid query `(b, s)` (`s < valid_lengths[b]`) and query head
//! `h`: `out = softmax(scale · q·Kᵀ) · V` over the cache entries of sequence
//! b at positions `p < cache_lengths[b] + valid_lengths[b]` (this step's
//! tokens were already written by the QKV op), with `p ≤ cache_lengths[b] +
//! s` under the `causal` mask and `p > cache_lengths[b] + s − window` with a
//! sliding window; query head h reads KV head `h / (Hq / Hkv)`. Padded query
//! rows are zero. The exact contract is in [`reference`](mod@reference).
//!
//! - [`MhaOp`]: definition (params, signature, shape rules, spec) on the
//!   op platform (register `kvjit_op::Defined(MhaOp)`); [`mha`]: the typed
//!   builder.
//! - [`MhaSpec`]: what a kernel bakes in, its canonical key name, and the
//!   call check every kernel runs first (its
//!   [`CallContract`](kvjit_op::CallContract); [`check_call`] for callers
//!   without a spec).
//! - [`reference`](mod@reference): plain Rust in f64, the ground truth;
//!   [`ReferenceKernel`] runs it as a kernel.
//! - [`cpu_jit`]: the Cranelift kernel (split-KV flash decoding, tiled
//!   prefill) reading K/V in place through the page table; an FP8 (E4M3)
//!   cache's codes are re-encoded exactly as bf16 while gathered and
//!   scaled by their block scales in the score and P·V loops
//!   ([`jit_kernel`] builds it, [`run_into`](kvjit_op::Jit::run_into) runs it into caller-owned
//!   bytes). On the `cpu-avx2` tier decode calls the AVX2 micro-kernel
//!   `kvjit_jit::attention_kernel` per KV head, reading K/V (FP8 widened in
//!   registers) in place from the pages.

mod call;
pub mod cpu_jit;
mod def;
mod error;
mod kernel;
pub mod reference;
mod spec;

pub use call::{AttentionConfig, CallShape, check_call, check_call_for, check_output, key_row_offsets};
pub use cpu_jit::{JitKernel, MAX_JIT_HEAD_SIZE, jit_kernel};
pub use def::{MhaOp, MhaParams, OP_NAME, mha};
pub use error::AttentionError;
pub use kernel::ReferenceKernel;
pub use spec::{KERNEL_NAME, Mask, MhaSpec};
