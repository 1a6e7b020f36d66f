//! The run-time argument check every target runs before writing anything.
//!
//! The JIT-compiled kernel indexes memory without bounds checks, so this
//! function is what keeps it memory-safe: when it returns `Ok`, every row
//! of `q_proj` and `output` holds `Hq·D` elements, every valid token's
//! position has a row in `freqs_cis`, and every valid token's K lies inside
//! `blocks` at a (page, slot) no other token of the call rotates (a slot
//! rotated twice would be wrong, and from two threads a data race).

use std::collections::HashMap;

use kvjit_core::{DType, Error, PagedKVCacheCollection, Result, Tensor, expect_arg, shape_mismatch};

use crate::RopeError;

/// The op's arguments for one call, by name (what
/// [`JitKernel::run_into`](crate::JitKernel::run_into) takes; `Kernel::run`
/// takes the tensors as a slice in the order `q_proj`, `freqs_cis`,
/// `layer_idx`, `valid_lengths`, and the cache apart).
pub struct RopeArgs<'a> {
    /// `[B, S, Hq, D]`, the activation dtype.
    pub q_proj: &'a Tensor,
    /// The paged cache whose K is rotated in place.
    pub kv_collection: &'a mut PagedKVCacheCollection,
    /// `[max_seq, D]`, the activation dtype: `cos, sin` interleaved per pair.
    pub freqs_cis: &'a Tensor,
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
    /// Query heads Hq.
    pub num_q_heads: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// Rows of `freqs_cis`.
    pub max_seq: usize,
    /// The layer whose K is rotated.
    pub layer: usize,
    /// Tokens whose K is rotated (sum of valid lengths).
    pub cache_tokens: usize,
}

impl CallShape {
    /// Shape of the output `[B, S, Hq, D]` (that of `q_proj`).
    pub fn output_shape(&self) -> Vec<usize> {
        vec![self.batch, self.seq, self.num_q_heads, self.head_size]
    }

    /// Token rows B·S.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// Check every argument of a call against the op contract and against each
/// other; writes nothing. Checks, in order: dtypes and contiguity; shapes
/// (`q_proj [B, S, Hq, D]` with `D` the cache's head size, even, and `Hq` a
/// positive multiple of Hkv; `freqs_cis [max_seq, D]`; `valid_lengths [B]`;
/// the cache's batch B); `layer_idx < L`; `valid_lengths[b] ≤ S`; per
/// sequence with valid tokens, `cache_lengths[b] + valid_lengths[b]` within
/// u32 and its last position inside `freqs_cis`; and for every valid token
/// that its logical page is inside the lookup table, its physical page is a
/// page of the cache, and no two tokens share a (page, slot).
pub fn check_call(
    q_proj: &Tensor,
    kv_collection: &PagedKVCacheCollection,
    freqs_cis: &Tensor,
    layer_idx: &Tensor,
    valid_lengths: &Tensor,
) -> Result<CallShape> {
    let dtype = q_proj.dtype();
    if !dtype.is_compute_float() {
        return Err(Error::NotFloat { what: "q_proj".into(), dtype });
    }
    expect_arg("q_proj", q_proj, dtype)?;
    expect_arg("freqs_cis", freqs_cis, dtype)?;
    expect_arg("layer_idx", layer_idx, DType::U32)?;
    expect_arg("valid_lengths", valid_lengths, DType::U32)?;

    let params = kv_collection.params();
    let (hkv, d) = (params.num_kv_heads, params.head_size);
    if !d.is_multiple_of(2) {
        return Err(RopeError::OddHeadSize { head_size: d }.into());
    }
    let &[batch, seq, num_q_heads, q_d] = q_proj.shape() else {
        return Err(shape_mismatch("q_proj", format!("[B, S, Hq, {d}]"), q_proj));
    };
    if q_d != d || num_q_heads == 0 || !num_q_heads.is_multiple_of(hkv) {
        return Err(shape_mismatch(
            "q_proj",
            format!(
                "[B, S, Hq, {d}] with Hq a positive multiple of {hkv} (D = head_size, Hkv = num_kv_heads of the cache)"
            ),
            q_proj,
        ));
    }
    let max_seq = match *freqs_cis.shape() {
        [max_seq, freqs_d] if freqs_d == d => max_seq,
        _ => return Err(shape_mismatch("freqs_cis", format!("[max_seq, {d}] (D = head_size)"), freqs_cis)),
    };
    if !matches!(layer_idx.shape(), [] | [1]) {
        return Err(shape_mismatch("layer_idx", "[] (a scalar)".into(), layer_idx));
    }
    if valid_lengths.shape() != [batch] {
        return Err(shape_mismatch("valid_lengths", format!("[{batch}] (B from q_proj)"), valid_lengths));
    }
    if kv_collection.batch_size() != batch {
        return Err(Error::ShapeMismatch {
            arg: "kv_collection.cache_lengths".into(),
            expected: format!("[{batch}] (B from q_proj)"),
            got: vec![kv_collection.batch_size()],
        });
    }

    let layer = layer_idx.as_slice::<u32>()?[0];
    if layer as usize >= params.num_layers {
        return Err(Error::LayerOutOfRange { layer_idx: layer, num_layers: params.num_layers });
    }
    let valid = valid_lengths.as_slice::<u32>()?;
    kv_collection.check_step_lengths(valid, seq)?;
    let cache_lengths = kv_collection.cache_lengths();
    for (b, (&v, &start)) in valid.iter().zip(cache_lengths).enumerate() {
        if v == 0 {
            continue;
        }
        let last = u64::from(start) + u64::from(v) - 1;
        if last >= max_seq as u64 {
            // The first token past the table.
            let token = (max_seq as u64).saturating_sub(u64::from(start)) as usize;
            return Err(RopeError::PositionOutOfRange {
                batch: b,
                position: u64::from(start) + token as u64,
                cache_length: start,
                token,
                max_seq,
            }
            .into());
        }
    }

    let mut writers: HashMap<(u32, usize), (usize, usize)> = HashMap::new();
    for (b, &v) in valid.iter().enumerate() {
        let start = cache_lengths[b] as usize;
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
        num_q_heads,
        num_kv_heads: hkv,
        head_size: d,
        max_seq,
        layer: layer as usize,
        cache_tokens: writers.len(),
    })
}

/// What the kernel needs to know about one token row `r = b·S + s` of a
/// validated call; the machine code does no page lookups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct RowPlan {
    /// Element offset of the row's cos/sin in `freqs_cis` (`pos · D`), or
    /// -1 for a padded row (its output is zeroed; its K is not touched).
    pub freqs_offset: i64,
    /// Element offset in `blocks` of `[page, 0, layer, slot, 0, 0]`, where
    /// the row's K heads start (0 for padded rows, never read).
    pub k_offset: i64,
}

/// The [`RowPlan`] of every row of a validated call (`shape` came from
/// [`check_call`] on these arguments).
pub fn row_plans(
    shape: &CallShape,
    kv_collection: &PagedKVCacheCollection,
    valid_lengths: &Tensor,
) -> Result<Vec<RowPlan>> {
    let valid = valid_lengths.as_slice::<u32>()?;
    let mut plans = vec![RowPlan { freqs_offset: -1, k_offset: 0 }; shape.rows()];
    for (b, &v) in valid.iter().enumerate() {
        let start = kv_collection.cache_lengths()[b] as usize;
        for t in 0..v as usize {
            let position = start + t;
            let (page, slot) = kv_collection.locate(b, position)?;
            let k_offset = kv_collection.element_offset(page as usize, 0, shape.layer, slot, 0, 0);
            plans[b * shape.seq + t] =
                RowPlan { freqs_offset: (position * shape.head_size) as i64, k_offset: k_offset as i64 };
        }
    }
    Ok(plans)
}

/// Check a caller-provided output tensor against a validated call.
pub fn check_output(shape: &CallShape, dtype: DType, output: &Tensor) -> Result<()> {
    expect_arg("output", output, dtype)?;
    if output.shape() != shape.output_shape() {
        return Err(shape_mismatch("output", format!("{:?} ([B, S, Hq, D])", shape.output_shape()), output));
    }
    Ok(())
}
