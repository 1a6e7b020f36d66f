//! The run-time argument check every target runs before writing anything.
//!
//! The JIT kernel indexes memory without bounds checks; this check is what
//! keeps it memory-safe: when it returns `Ok`, every key position a valid
//! query reads lies on a page that is inside the lookup table and the cache,
//! the layer exists, and `q`/`valid_lengths` have the shapes the kernel
//! indexes with.

use kvjit_core::{DType, Error, KvCacheParams, PagedKVCacheCollection, Result, Tensor, expect_arg, shape_mismatch};
use kvjit_op::checks::{self, StepArgs};

use crate::{AttentionError, Mask, MhaSpec};

/// What an attention call computes besides its tensors: mask, window, scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// The mask.
    pub mask: Mask,
    /// Sliding window size (keys `p > cache_length + s − window`), if any.
    pub window: Option<usize>,
    /// Softmax scale.
    pub scale: f32,
}

impl AttentionConfig {
    /// Key positions `[lo, hi)` query `s` of a sequence with `cache_length`
    /// cached and `valid_length` new tokens reads.
    pub fn key_range(&self, cache_length: usize, valid_length: usize, s: usize) -> (usize, usize) {
        let hi = match self.mask {
            Mask::Causal => cache_length + s + 1,
            Mask::Null => cache_length + valid_length,
        };
        let lo = self.window.map_or(0, |w| (cache_length + s + 1).saturating_sub(w));
        (lo, hi)
    }
}

impl From<&MhaSpec> for AttentionConfig {
    /// The mask, window and scale a spec bakes in.
    fn from(spec: &MhaSpec) -> Self {
        AttentionConfig { mask: spec.mask, window: spec.window, scale: spec.scale }
    }
}

/// The sizes of one validated call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallShape {
    /// Sequences B.
    pub batch: usize,
    /// Padded sequence length S.
    pub seq: usize,
    /// Query heads Hq.
    pub num_heads: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
    /// The layer read.
    pub layer: usize,
    /// Per sequence, the key positions `[lo, hi)` its valid queries read
    /// together (`(0, 0)` when it has none); every page they fall on was
    /// checked.
    pub key_ranges: Vec<(usize, usize)>,
}

impl CallShape {
    /// Shape of `q` and the output `[B, S, Hq, D]`.
    pub fn output_shape(&self) -> Vec<usize> {
        vec![self.batch, self.seq, self.num_heads, self.head_size]
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// Check every argument of a call against the op contract and each other;
/// writes nothing. In order: dtypes and contiguity, then
/// [`check_call_for`] the cache's own layout.
pub fn check_call(q: &Tensor, step: StepArgs<'_>, config: &AttentionConfig) -> Result<CallShape> {
    kvjit_op::expect_float_step("q", q, step.layer_idx, step.valid_lengths)?;
    check_call_for(step.kv_collection.params(), q, step, config)
}

/// Check a call whose dtypes were checked, for a kernel built for the
/// cache layout `built_for`; writes nothing. In order: `q [B, S, Hq, D]`
/// with D the layout's head size and Hq a multiple of Hkv, the step
/// ([`checks::check_step`]: the cache laid out as `built_for` with batch
/// B, `layer_idx < L`, `valid_lengths[b] ≤ S`, `cache_lengths[b] +
/// valid_lengths[b]` fits u32), and for every key position a valid query
/// reads that its logical page is inside the lookup table and its physical
/// page inside the cache (core's [`PagedKVCacheCollection::locate`]).
pub fn check_call_for(
    built_for: &KvCacheParams,
    q: &Tensor,
    step: StepArgs<'_>,
    config: &AttentionConfig,
) -> Result<CallShape> {
    let kv_collection = step.kv_collection;
    let &[batch, seq, num_heads, head_size] = q.shape() else {
        return Err(shape_mismatch("q", format!("[B, S, Hq, {}]", built_for.head_size), q));
    };
    if head_size != built_for.head_size || num_heads == 0 {
        return Err(shape_mismatch("q", format!("[B, S, Hq, {}] (D = the cache's head_size)", built_for.head_size), q));
    }
    if !num_heads.is_multiple_of(built_for.num_kv_heads) {
        return Err(AttentionError::HeadGroups { num_heads, num_kv_heads: built_for.num_kv_heads }.into());
    }
    let step = checks::check_step("q", [batch, seq], built_for, step)?;
    let page_size = built_for.page_size;
    let mut key_ranges = Vec::with_capacity(batch);
    for (b, &v) in step.valid.iter().enumerate() {
        let (v, cache_length) = (v as usize, kv_collection.cache_lengths()[b] as usize);
        if v == 0 {
            key_ranges.push((0, 0));
            continue;
        }
        // Query 0 has the lowest `lo`; every query's `hi` is at most cl + v.
        let (lo, _) = config.key_range(cache_length, v, 0);
        let hi = cache_length + v;
        for logical in lo / page_size..hi.div_ceil(page_size) {
            kv_collection.locate(b, (logical * page_size).max(lo))?;
        }
        key_ranges.push((lo, hi));
    }
    Ok(CallShape {
        batch,
        seq,
        num_heads,
        num_kv_heads: built_for.num_kv_heads,
        head_size,
        layer: step.layer,
        key_ranges,
    })
}

/// Check a caller-provided output against a validated call.
pub fn check_output(shape: &CallShape, dtype: DType, output: &Tensor) -> Result<()> {
    expect_arg("output", output, dtype)?;
    if output.shape() != shape.output_shape() {
        return Err(shape_mismatch("output", format!("{:?} ([B, S, Hq, D])", shape.output_shape()), output));
    }
    Ok(())
}

/// For every sequence b, the element offset in `blocks` of `[page, 0,
/// layer, slot, 0, 0]` (its K row; V is `L·page_size·Hkv·D` further) of each
/// key position p of its checked key range `[lo, hi)`, at index `b·stride +
/// p − lo` (`stride` ≥ every `hi − lo`: the table is sized by the keys read,
/// never by their positions), from one
/// [`locate`](PagedKVCacheCollection::locate) per page. Other entries are 0
/// (element 0 of the blocks: in bounds, never used). A table too large to
/// allocate is [`Error::OutOfMemory`].
pub fn key_row_offsets(shape: &CallShape, kv_collection: &PagedKVCacheCollection, stride: usize) -> Result<Vec<i64>> {
    let page_size = kv_collection.params().page_size;
    let kv_dim = kv_collection.params().kv_dim();
    let len = shape.batch.checked_mul(stride).ok_or_else(|| Error::ShapeOverflow(vec![shape.batch, stride]))?;
    let mut offsets = Vec::new();
    offsets.try_reserve_exact(len).map_err(|_| Error::OutOfMemory { bytes: len.saturating_mul(8) })?;
    offsets.resize(len, 0i64);
    for (b, &(lo, hi)) in shape.key_ranges.iter().enumerate() {
        let row = &mut offsets[b * stride..][..stride];
        let mut p = lo;
        while p < hi {
            let (page, slot) = kv_collection.locate(b, p)?;
            let base = kv_collection.element_offset(page as usize, 0, shape.layer, 0, 0, 0);
            let end = hi.min((p / page_size + 1) * page_size);
            for (i, offset) in row[p - lo..end - lo].iter_mut().enumerate() {
                *offset = (base + (slot + i) * kv_dim) as i64;
            }
            p = end;
        }
    }
    Ok(offsets)
}
