//! The run-time argument check every target runs before writing anything.
//!
//! The JIT-compiled kernel indexes memory without bounds checks, so this
//! check is what keeps it memory-safe: when it returns `Ok`, every row
//! of `q_proj` and `output` holds `Hq·D` elements, every valid token's
//! position has a row in `freqs_cis`, and every valid token's K lies inside
//! `blocks` at a (page, slot) no other token of the call rotates (a slot
//! rotated twice would be wrong, and from two threads a data race).

use kvjit_core::{Result, Tensor, shape_mismatch};
use kvjit_op::checks::{StepArgs, check_step, write_rows};

use crate::RopeError;

/// The sizes of one validated call, and where each of its rows reads and
/// writes.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// Per token row `r = b·S + s`, what the kernel reads and writes.
    pub rows: Vec<RowPlan>,
}

impl CallShape {
    /// Shape of the output `[B, S, Hq, D]` (that of `q_proj`).
    pub fn output_shape(&self) -> Vec<usize> {
        vec![self.batch, self.seq, self.num_q_heads, self.head_size]
    }
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

/// Check every argument of a call against the op contract and against each
/// other; writes nothing. Checks, in order: shapes (`q_proj [B, S, Hq, D]`
/// with `D` the cache's head size, even, and `Hq` a positive multiple of
/// Hkv; `freqs_cis [max_seq, D]`); the step (`layer_idx < L`,
/// `valid_lengths [B]` each `≤ S`, B the cache's batch, lengths within
/// u32: [`check_step`]); per sequence with valid tokens its last position
/// inside `freqs_cis`; and for every valid token that its page is in the
/// cache and no two tokens share a (page, slot) ([`write_rows`]). Dtypes
/// and contiguity are the kernel signature's to check.
pub fn check_call(q_proj: &Tensor, freqs_cis: &Tensor, step: StepArgs<'_>) -> Result<CallShape> {
    let kv_collection = step.kv_collection;
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
    let step = check_step("q_proj", [batch, seq], params, step)?;
    let cache_lengths = kv_collection.cache_lengths();
    for (b, (&v, &start)) in step.valid.iter().zip(cache_lengths).enumerate() {
        let past_table = |position: u64| position >= max_seq as u64;
        if v > 0 && past_table(u64::from(start) + u64::from(v) - 1) {
            // The first token past the table.
            let token = (max_seq as u64).saturating_sub(u64::from(start)) as usize;
            let position = u64::from(start) + token as u64;
            return Err(
                RopeError::PositionOutOfRange { batch: b, position, cache_length: start, token, max_seq }.into()
            );
        }
    }
    let k_offsets = write_rows(kv_collection, &step)?;
    let rows = k_offsets
        .iter()
        .enumerate()
        .map(|(r, &k_offset)| match k_offset {
            -1 => RowPlan { freqs_offset: -1, k_offset: 0 },
            _ => {
                let position = cache_lengths[r / seq] as usize + r % seq;
                RowPlan { freqs_offset: (position * d) as i64, k_offset }
            }
        })
        .collect();
    let cache_tokens = step.valid.iter().map(|&v| v as usize).sum();
    Ok(CallShape {
        batch,
        seq,
        num_q_heads,
        num_kv_heads: hkv,
        head_size: d,
        max_seq,
        layer: step.layer,
        cache_tokens,
        rows,
    })
}

/// Check a caller-provided output tensor against a validated call.
pub fn check_output(shape: &CallShape, output: &Tensor) -> Result<()> {
    if output.shape() != shape.output_shape() {
        return Err(shape_mismatch("output", format!("{:?} ([B, S, Hq, D])", shape.output_shape()), output));
    }
    Ok(())
}
