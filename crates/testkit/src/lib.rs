//! kvjit's test kit (dev-only): what every op's tests need, in one place
//! instead of a copy per test file.
//!
//! - [`Problem`] ([`problem`]): an op's random valid call — generate inputs,
//!   run the reference, run on a target, compare with a named tolerance —
//!   checked by [`check_on`] / [`check_random`].
//! - [`Tolerance`] ([`tolerance`]): the named rules (`Exact`, `Ulps`,
//!   `AbsRel`, `RelativeToScale`, `RelativeToTerms`, `AgainstExact`), the
//!   constants behind them, and [`compare`], which reports the worst
//!   element.
//! - [`targets`] ([`target`]): CPU JIT, CPU reference, and CUDA when a
//!   device exists (else `skipped: no CUDA device (<reason>)`;
//!   `KVJIT_REQUIRE_CUDA=1` makes that a panic).
//! - [`blocks`]: random weights in the block formats, and the bound of
//!   the integer GEMV's activation rounding.
//! - [`calls`]: a poisoned output and a call that must be refused with
//!   nothing written, for tensor-only kernels.
//! - [`mod@poison`]: NaN poison and canary guard regions ([`Guarded`]);
//!   [`snapshot`]: byte snapshots ([`Snapshot`], [`CacheSnapshot`]) and
//!   byte-for-byte comparisons of tensors and caches; [`layout`]: the
//!   paged cache's layout written out independently of the library, and
//!   per-element cache expectations; [`paged`]: the hand-drawn paged step
//!   (three sequences, scattered pages) every paged op's bad-input tests
//!   start from; [`values`]: random tensor values (uniform, dyadic,
//!   special).
//! - `fused_qkv` (feature `fused-qkv`, off by default: the fused op's tests and the fuzz harness turn it on): the fused QKV op's
//!   [`Problem`] and its differential checker (an independent model of the
//!   op's validity rules), shared by its property tests and the `op_call`
//!   fuzz target.
//!
//! Without the `fused-qkv` feature the kit depends on no op crate.

use std::collections::BTreeMap;

use kvjit_core::{PagedKVCacheCollection, Tensor};

pub mod blocks;
pub mod calls;
#[cfg(feature = "fused-qkv")]
pub mod fused_qkv;
pub mod layout;
pub mod paged;
pub mod poison;
pub mod problem;
pub mod snapshot;
pub mod target;
pub mod tolerance;
pub mod values;

pub use layout::{Expect, assert_cache, block_index, blocks_shape, cache_from_table, strided_view, unravel};
pub use poison::{Guarded, canary, nan_bytes, poison, poison_all};
pub use problem::{Args, Checked, Problem, RunResult, check_on, check_random, named};
pub use snapshot::{
    CacheSnapshot, Snapshot, assert_caches_identical, assert_outputs_identical, assert_tensors_identical,
    caches_identical, first_difference,
};
pub use target::{OnTarget, Target, cuda_or_skip, cuda_required, targets};
pub use tolerance::{Comparison, Element, Tolerance, compare, compare_tensors};
pub use values::u32s;

/// Tensors by name (a call's or a graph's inputs and outputs).
pub type Tensors = BTreeMap<String, Tensor>;
/// KV caches by name.
pub type Caches = BTreeMap<String, PagedKVCacheCollection>;
