//! Paged rotary position embedding: Modular MAX's
//! `mo.fused_qk_rope.padded.paged`.
//!
//! For every valid token (`s < valid_lengths[b]`) at position
//! `pos = cache_lengths[b] + s` — the cache lengths *before* this step, as
//! the fused QKV op used them when it wrote K/V — Q (`q_proj [B, S, Hq, D]`)
//! is rotated into the output, and the K of every KV head is rotated **in
//! place in the paged cache** at (`layer_idx`, page of pos, slot of pos).
//! `freqs_cis [max_seq, D]` holds `cos(pos·θ_j), sin(pos·θ_j)` interleaved
//! per pair j < D/2. `interleaved = true` rotates `(x[2j], x[2j+1])` (GGUF),
//! `false` rotates `(x[j], x[j + D/2])` (Hugging Face `rotate_half`):
//! `a' = a·cos − b·sin`, `b' = b·cos + a·sin`. V is never touched. Rows of
//! padded tokens are **zero** in the output (MAX leaves them undefined).
//! The cache dtype may differ from the activation dtype: K is read in the
//! cache dtype, rotated in f32 and rounded once back. On an FP8 (`f8e4m3`)
//! cache each K head is dequantized (`code · scale`), rotated, and every
//! g-block requantized with a fresh scale (`max|y| / 448` over its finite
//! values; a rotation overflowing to ±∞ stores ±448): the codes and
//! scales of exactly the rotated tokens' K heads change.
//!
//! Everything about the op lives here: its IR definition ([`RopeOp`],
//! parameters, shape rules, kernel spec [`RopeSpec`] with its call
//! contract), the run-time argument check every kernel shares
//! ([`check_call`]: nothing is written unless the whole call is valid), the f64 reference ([`reference`](mod@reference)),
//! and the Cranelift kernel ([`cpu_jit`]). There is no CUDA variant yet:
//! `supports` refuses CUDA keys, so specializing a graph for CUDA fails with
//! a clear error.

mod call;
pub mod cpu_jit;
mod def;
mod error;
mod kernel;
mod recipe;
pub mod reference;
mod spec;

pub use call::{CallShape, RowPlan, check_call, check_output};
pub use cpu_jit::JitKernel;
pub use def::{FREQS_CIS, MAX_JIT_HEAD_SIZE, OP_NAME, RopeOp, RopeParams, fused_qk_rope};
pub use error::RopeError;
pub use kernel::ReferenceKernel;
pub use recipe::{Llama3Scaling, RopeInit};
pub use spec::{KERNEL_NAME, RopeSpec};
