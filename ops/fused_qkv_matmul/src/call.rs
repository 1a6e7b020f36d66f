//! The run-time argument check every target runs before writing anything.
//!
//! JIT-compiled and CUDA kernels index memory without bounds checks, so this
//! function is what keeps them memory-safe: when it returns `Ok`, every row
//! reads inside `hidden_state`/`weight`, every Q store lands inside `output`,
//! and every K/V store lands inside `blocks` at a distinct (page, slot).

use std::collections::HashMap;

use kvjit_core::{DType, Error, PagedKVCacheCollection, Result, Tensor, expect_arg, shape_mismatch};

/// The op's arguments for one call, by name (what [`JitKernel::run_into`]
/// takes; `Kernel::run` takes them as slices in this order).
///
/// [`JitKernel::run_into`]: crate::JitKernel::run_into
pub struct QkvArgs<'a> {
    /// `[B, S, K]`, the compute dtype.
    pub hidden_state: &'a Tensor,
    /// `[N, K]`, the compute dtype.
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

/// Check every argument of a call against the op contract and against each
/// other; writes nothing. Checks, in order: dtypes and contiguity, shapes,
/// `layer_idx < L`, `valid_lengths[b] ≤ S`, and for every valid token that its
/// logical page is inside the lookup table, its physical page is a page of
/// the cache, and no two tokens share a (page, slot).
pub fn check_call(
    hidden_state: &Tensor,
    weight: &Tensor,
    kv_collection: &PagedKVCacheCollection,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
) -> Result<CallShape> {
    check_call_with(hidden_state, WeightArg::Tensor(weight), kv_collection, layer_idx, valid_lengths)
}

/// [`check_call`] with the weight possibly a kernel's prepared one.
pub(crate) fn check_call_with(
    hidden_state: &Tensor,
    weight: WeightArg<'_>,
    kv_collection: &PagedKVCacheCollection,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
) -> Result<CallShape> {
    let dtype = hidden_state.dtype();
    if !dtype.is_compute_float() {
        return Err(Error::NotFloat { what: "hidden_state".into(), dtype });
    }
    expect_arg("hidden_state", hidden_state, dtype)?;
    if let WeightArg::Tensor(weight) = weight {
        expect_arg("weight", weight, dtype)?;
    }
    expect_arg("layer_idx", layer_idx, DType::U32)?;
    expect_arg("valid_lengths", valid_lengths, DType::U32)?;

    let &[batch, seq, k] = hidden_state.shape() else {
        return Err(shape_mismatch("hidden_state", "[B, S, K]".into(), hidden_state));
    };
    let params = kv_collection.params();
    let kv_dim = params.kv_dim();
    let (n, weight_k) = match weight {
        WeightArg::Tensor(weight) => match *weight.shape() {
            [n, weight_k] => (n, weight_k),
            _ => return Err(shape_mismatch("weight", format!("[N, {k}]"), weight)),
        },
        WeightArg::Prepared { n, k } => (n, k),
    };
    if weight_k != k || n <= 2 * kv_dim {
        return Err(Error::ShapeMismatch {
            arg: "weight".into(),
            expected: format!(
                "[q_dim + 2*{kv_dim}, {k}] with q_dim >= 1 (K = {k} from hidden_state, kv_dim = Hkv*D = {kv_dim})"
            ),
            got: vec![n, weight_k],
        });
    }
    if !matches!(layer_idx.shape(), [] | [1]) {
        return Err(shape_mismatch("layer_idx", "[] (a scalar)".into(), layer_idx));
    }
    if valid_lengths.shape() != [batch] {
        return Err(shape_mismatch("valid_lengths", format!("[{batch}] (B from hidden_state)"), valid_lengths));
    }
    if kv_collection.batch_size() != batch {
        return Err(Error::ShapeMismatch {
            arg: "kv_collection.cache_lengths".into(),
            expected: format!("[{batch}] (B from hidden_state)"),
            got: vec![kv_collection.batch_size()],
        });
    }

    let layer = layer_idx.as_slice::<u32>()?[0];
    if layer as usize >= params.num_layers {
        return Err(Error::LayerOutOfRange { layer_idx: layer, num_layers: params.num_layers });
    }
    let valid = valid_lengths.as_slice::<u32>()?;
    for (b, &v) in valid.iter().enumerate() {
        if v as usize > seq {
            return Err(Error::ValidLengthTooLong { batch: b, valid_length: v, seq_len: seq });
        }
    }

    let mut writers: HashMap<(u32, usize), (usize, usize)> = HashMap::new();
    for (b, &v) in valid.iter().enumerate() {
        let start = kv_collection.cache_lengths()[b] as usize;
        for t in 0..v as usize {
            let (page, slot) = kv_collection.locate(b, start + t)?;
            if let Some((first_batch, first_t)) = writers.insert((page, slot), (b, t)) {
                return Err(Error::SlotCollision { first_batch, first_t, second_batch: b, second_t: t, page, slot });
            }
        }
    }

    Ok(CallShape {
        batch,
        seq,
        k,
        n,
        q_dim: n - 2 * kv_dim,
        kv_dim,
        layer: layer as usize,
        cache_tokens: writers.len(),
    })
}

/// For each row `r = b·S + t` of a validated call, the element offset in
/// `blocks` of `[page, 0, layer, slot, 0, 0]` where row r's K goes (its V is
/// one K/V stride further), or -1 for padded rows that write no cache.
pub fn cache_row_offsets(
    shape: &CallShape,
    kv_collection: &PagedKVCacheCollection,
    valid_lengths: &Tensor,
) -> Result<Vec<i64>> {
    let valid = valid_lengths.as_slice::<u32>()?;
    let mut offsets = vec![-1i64; shape.batch * shape.seq];
    for (b, &v) in valid.iter().enumerate() {
        let start = kv_collection.cache_lengths()[b] as usize;
        for t in 0..v as usize {
            let (page, slot) = kv_collection.locate(b, start + t)?;
            let offset = kv_collection.element_offset(page as usize, 0, shape.layer, slot, 0, 0);
            offsets[b * shape.seq + t] = offset as i64;
        }
    }
    Ok(offsets)
}

/// Check a caller-provided output buffer against a validated call.
pub fn check_output(shape: &CallShape, dtype: DType, output: &Tensor) -> Result<()> {
    expect_arg("output", output, dtype)?;
    if output.shape() != shape.output_shape() {
        return Err(shape_mismatch("output", format!("{:?} ([B, S, q_dim])", shape.output_shape()), output));
    }
    Ok(())
}
