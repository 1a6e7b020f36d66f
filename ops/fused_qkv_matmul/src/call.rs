//! The run-time argument check every target runs before writing anything.
//!
//! JIT-compiled and CUDA kernels index memory without bounds checks, so this
//! check is what keeps them memory-safe: when it passes, every row reads
//! inside `hidden_state`/`weight`, every Q store lands inside `output`, and
//! every K/V store lands inside `blocks` at a distinct (page, slot).

use kvjit_core::{Error, KvCacheParams, PagedKVCacheCollection, Result, Tensor, expect_arg, shape_mismatch};
use kvjit_op::checks::{StepArgs, check_step, write_rows};

/// The op's arguments for one call, by name (what [`JitKernel::run_into`]
/// takes; `Kernel::run` takes the tensors as a slice in this order, the
/// cache apart).
///
/// [`JitKernel::run_into`]: crate::JitKernel::run_into
pub struct QkvArgs<'a> {
    /// `[B, S, K]`, the compute dtype.
    pub hidden_state: &'a Tensor,
    /// `[N, K]`, the compute dtype or a weight block format.
    pub weight: &'a Tensor,
    /// The paged cache K and V are written into.
    pub kv_collection: &'a mut PagedKVCacheCollection,
    /// u32 scalar.
    pub layer_idx: &'a Tensor,
    /// u32 `[B]`.
    pub valid_lengths: &'a Tensor,
}

/// The sizes of one validated call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallShape {
    /// Sequences B.
    pub batch: usize,
    /// Padded sequence length S.
    pub seq: usize,
    /// Hidden size K.
    pub k: usize,
    /// Weight rows N.
    pub n: usize,
    /// Q columns.
    pub q_dim: usize,
    /// K (or V) columns, Hkv·D.
    pub kv_dim: usize,
    /// The layer written.
    pub layer: usize,
    /// Tokens written to the cache (sum of valid lengths).
    pub cache_tokens: usize,
}

impl CallShape {
    /// Shape of the Q output `[B, S, q_dim]`.
    pub fn output_shape(&self) -> Vec<usize> {
        vec![self.batch, self.seq, self.q_dim]
    }
}

/// A call's weight as the checks see it.
#[derive(Clone, Copy)]
pub(crate) enum WeightArg<'a> {
    /// A `[N, K]` tensor, checked like any argument.
    Tensor(&'a Tensor),
    /// The kernel's own prepared (packed) weight of `[n, k]`, whose dtype
    /// and layout were checked when the kernel took it.
    Prepared {
        /// Rows.
        n: usize,
        /// Columns.
        k: usize,
    },
}

/// A call that passed the check: its sizes, and the cache row each token
/// writes ([`write_rows`]: for row `b·S + t` the element offset of its K in
/// the blocks, -1 for a padded row).
#[derive(Clone, Debug)]
pub struct CheckedCall {
    /// The call's sizes.
    pub shape: CallShape,
    /// Per row, where its K goes in the cache's blocks (-1: nowhere).
    pub row_offsets: Vec<i64>,
}

/// Check every argument of a call against the op contract and against each
/// other; writes nothing. Checks, in order: dtypes and contiguity, shapes,
/// `layer_idx < L`, `valid_lengths[b] ≤ S`, and for every valid token that its
/// logical page is inside the lookup table, its physical page is a page of
/// the cache, and no two tokens share a (page, slot). Returns the call's
/// sizes and the cache row each token writes.
pub fn check_call(hidden_state: &Tensor, weight: &Tensor, step: StepArgs<'_>) -> Result<CheckedCall> {
    let dtype = kvjit_op::expect_float_step("hidden_state", hidden_state, step.layer_idx, step.valid_lengths)?;
    let weights = if weight.dtype().is_block_format() { weight.dtype() } else { dtype };
    expect_arg("weight", weight, weights)?;
    check_shapes(hidden_state, WeightArg::Tensor(weight), step, step.kv_collection.params())
}

/// The shape part of the check (the dtypes checked already): the cache laid
/// out as `built_for`, the step's arguments, the weight against the hidden
/// state and the cache, and the cache rows the step writes.
pub(crate) fn check_shapes(
    hidden_state: &Tensor,
    weight: WeightArg<'_>,
    step: StepArgs<'_>,
    built_for: &KvCacheParams,
) -> Result<CheckedCall> {
    let kv_collection = step.kv_collection;
    let &[batch, seq, k] = hidden_state.shape() else {
        return Err(shape_mismatch("hidden_state", "[B, S, K]".into(), hidden_state));
    };
    let kv_dim = built_for.kv_dim();
    let (n, weight_k) = match weight {
        WeightArg::Tensor(weight) => match *weight.shape() {
            [n, weight_k] => (n, weight_k),
            _ => return Err(shape_mismatch("weight", format!("[N, {k}]"), weight)),
        },
        WeightArg::Prepared { n, k } => (n, k),
    };
    let step = check_step("hidden_state", [batch, seq], built_for, step)?;
    if weight_k != k || n <= 2 * kv_dim {
        return Err(Error::ShapeMismatch {
            arg: "weight".into(),
            expected: format!(
                "[q_dim + 2*{kv_dim}, {k}] with q_dim >= 1 (K = {k} from hidden_state, kv_dim = Hkv*D = {kv_dim})"
            ),
            got: vec![n, weight_k],
        });
    }
    let row_offsets = write_rows(kv_collection, &step)?;
    let shape = CallShape {
        batch,
        seq,
        k,
        n,
        q_dim: n - 2 * kv_dim,
        kv_dim,
        layer: step.layer,
        cache_tokens: row_offsets.iter().filter(|&&o| o >= 0).count(),
    };
    Ok(CheckedCall { shape, row_offsets })
}
