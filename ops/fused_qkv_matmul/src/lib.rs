//! The fused QKV matmul with paged KV-cache write: Modular MAX's
//! `generic_fused_qkv_matmul_kv_cache_bshd_paged` (graph name
//! `mo.fused_qkv_matmul.padded.paged` also accepted).
//!
//! One matmul `C = X·Wᵀ` makes Q, K and V from the hidden state `X [B, S, K]`
//! and the weight `W [N, K]`, `N = q_dim + 2·Hkv·D`. Columns below `q_dim` go
//! to `output [B, S, q_dim]` for every row; the K and V columns are written
//! into the paged cache at each sequence's next positions
//! (`cache_lengths[b] + t`), only for valid tokens (`t < valid_lengths[b]`).
//!
//! Everything about the op lives here: its definition on the op platform
//! ([`FusedQkvOp`], parameters, shape rules), the spec of its kernels
//! ([`FusedQkvSpec`]: key and call contract), the run-time argument check
//! every target shares ([`check_call`]), the plain reference implementation
//! ([`reference`](mod@reference)), and its kernels.

mod call;
pub mod cpu_jit;
pub mod cuda_kernel;
mod def;
mod error;
mod kernel;
pub mod reference;
mod spec;

pub use call::{CallShape, CheckedCall, QkvArgs, check_call};
pub use cpu_jit::JitKernel;
pub use cuda_kernel::CudaKernel;
pub use def::{FusedQkvOp, FusedQkvParams, OP_ALIAS, OP_NAME, fused_qkv_matmul};
pub use error::FusedQkvError;
pub use kernel::ReferenceKernel;
pub use spec::{FusedQkvSpec, KERNEL_NAME, Sizes};
