//! Argument checks more than one op makes, written once: a tensor against
//! the dims a kernel baked in, a paged op's cache layout and step
//! arguments, and the cache rows a step writes.

use std::collections::HashMap;

use kvjit_core::{Error, KernelSpec, KeyField, KvCacheParams, PagedKVCacheCollection, Result, Tensor, shape_mismatch};

/// The batch B and padded sequence length S a paged kernel bakes in
/// (`None`: read from each call) — the last two fields of every paged op's
/// key, `b` and `s`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StepDims {
    /// Batch B, if static.
    pub batch: Option<usize>,
    /// Padded sequence length S, if static.
    pub seq: Option<usize>,
}

impl StepDims {
    /// Both left to run time (a generic kernel's).
    pub const ANY: Self = Self { batch: None, seq: None };

    /// Both baked in.
    pub fn fixed(batch: usize, seq: usize) -> Self {
        Self { batch: Some(batch), seq: Some(seq) }
    }

    /// The dims of a graph's `[B, S, …]` input: static ones baked in.
    pub fn of(batch: &kvjit_graph::Dim, seq: &kvjit_graph::Dim) -> Self {
        Self { batch: batch.as_static(), seq: seq.as_static() }
    }

    /// Append them to a key as `b` and `s` (`bany` when left to run time).
    pub fn named(self, key: kvjit_core::KernelKey) -> kvjit_core::KernelKey {
        key.with("b", KeyField::dim(self.batch)).with("s", KeyField::dim(self.seq))
    }

    /// The leading dims of a `[B, S, …]` tensor as [`expect_baked`] takes
    /// them.
    pub fn baked(self) -> [BakedDim; 2] {
        [("B", self.batch), ("S", self.seq)]
    }
}

/// One dim of a tensor as a kernel baked it in: its size, or `None` (read
/// at run time), with the letter that names it in errors (`B`, `S`).
pub type BakedDim = (&'static str, Option<usize>);

/// Check `tensor`'s shape against the dims `spec` baked in:
/// [`Error::NotBuiltFor`] (naming the key) when its rank differs or a baked
/// dim does not match.
pub fn expect_baked(arg: &'static str, tensor: &Tensor, dims: &[BakedDim], spec: &impl KernelSpec) -> Result<()> {
    let shape = tensor.shape();
    let fits =
        shape.len() == dims.len() && dims.iter().zip(shape).all(|((_, baked), &got)| baked.is_none_or(|b| b == got));
    if fits {
        return Ok(());
    }
    let dims: Vec<String> = dims.iter().map(|(name, d)| d.map_or(name.to_string(), |v| v.to_string())).collect();
    Err(Error::NotBuiltFor {
        arg,
        expected: format!("[{}] (baked into {})", dims.join(", "), spec.key()),
        got: shape.to_vec(),
    })
}

/// Append the labelled fields of a cache layout to a key: `hkv`, `d`, `p`,
/// `l`, `kv` (its dtype) and, for an FP8 cache, `g` (its scale granularity).
pub fn with_cache_fields(key: kvjit_core::KernelKey, cache: &KvCacheParams) -> kvjit_core::KernelKey {
    with_cache_fields_as(key, cache, KeyField::size)
}

/// [`with_cache_fields`] with each size written as `size` says (a kernel
/// that reads the layout at run time writes [`KeyField::Dynamic`]).
pub fn with_cache_fields_as(
    key: kvjit_core::KernelKey,
    cache: &KvCacheParams,
    size: impl Fn(usize) -> KeyField,
) -> kvjit_core::KernelKey {
    key.with("hkv", size(cache.num_kv_heads))
        .with("d", size(cache.head_size))
        .with("p", size(cache.page_size))
        .with("l", size(cache.num_layers))
        .with("kv", KeyField::DType(cache.dtype()))
        .with_if("g", cache.scale_granularity().map(&size))
}

/// The step arguments of a paged op's call, checked.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    /// Sequences B.
    pub batch: usize,
    /// Padded tokens per sequence S.
    pub seq: usize,
    /// The cache layer the step reads or writes.
    pub layer: usize,
    /// Valid tokens per sequence (each `≤ S`).
    pub valid: &'a [u32],
}

impl Step<'_> {
    /// Tokens a step of this call covers, padded: B·S.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// A paged op's step arguments, which travel together: the cache, the
/// layer the step reads or writes, and each sequence's valid tokens.
#[derive(Clone, Copy, Debug)]
pub struct StepArgs<'a> {
    /// The paged cache.
    pub kv_collection: &'a PagedKVCacheCollection,
    /// u32 scalar.
    pub layer_idx: &'a Tensor,
    /// u32 `[B]`.
    pub valid_lengths: &'a Tensor,
}

/// Check a paged op's step: the cache laid out as the kernel was built for
/// (`built_for`), `layer_idx` a u32 scalar `< L`, `valid_lengths` u32
/// `[B]` with B the cache's batch and each `≤ S`, and every sequence's
/// `cache_length + valid_length` representable. `batch` and `seq` come
/// from the op's main tensor, named `primary` in errors. (The dtypes of
/// `layer_idx` and `valid_lengths` are the signature's to check.)
pub fn check_step<'a>(
    primary: &str,
    [batch, seq]: [usize; 2],
    built_for: &KvCacheParams,
    args: StepArgs<'a>,
) -> Result<Step<'a>> {
    let StepArgs { kv_collection: cache, layer_idx, valid_lengths } = args;
    cache.params().expect_built_for(built_for)?;
    if !matches!(layer_idx.shape(), [] | [1]) {
        return Err(shape_mismatch("layer_idx", "[] (a scalar)".into(), layer_idx));
    }
    if valid_lengths.shape() != [batch] {
        return Err(shape_mismatch("valid_lengths", format!("[{batch}] (B from {primary})"), valid_lengths));
    }
    if cache.batch_size() != batch {
        return Err(Error::ShapeMismatch {
            arg: "kv_collection.cache_lengths".into(),
            expected: format!("[{batch}] (B from {primary})"),
            got: vec![cache.batch_size()],
        });
    }
    let layer = layer_idx.as_slice::<u32>()?[0];
    if layer as usize >= built_for.num_layers {
        return Err(Error::LayerOutOfRange { layer_idx: layer, num_layers: built_for.num_layers });
    }
    let valid = valid_lengths.as_slice::<u32>()?;
    cache.check_step_lengths(valid, seq)?;
    Ok(Step { batch, seq, layer: layer as usize, valid })
}

/// The cache row every token of a step writes, checked: for each row
/// `r = b·S + t`, the element offset in `blocks` of `[page, 0, layer, slot,
/// 0, 0]` where a valid token's K goes (its V is one K/V stride further),
/// or -1 for a padded row. Every valid token's logical page must be inside
/// the lookup table and its physical page a page of the cache, and no two
/// tokens may share a (page, slot) ([`Error::SlotCollision`]): a slot
/// written twice would be wrong, and from two threads a data race.
pub fn write_rows(cache: &PagedKVCacheCollection, step: &Step<'_>) -> Result<Vec<i64>> {
    let mut offsets = vec![-1i64; step.rows()];
    let mut writers: HashMap<(u32, usize), (usize, usize)> = HashMap::new();
    for (b, &v) in step.valid.iter().enumerate() {
        let start = cache.cache_lengths()[b] as usize;
        for t in 0..v as usize {
            let (page, slot) = cache.locate(b, start + t)?;
            if let Some((first_batch, first_t)) = writers.insert((page, slot), (b, t)) {
                return Err(Error::SlotCollision { first_batch, first_t, second_batch: b, second_t: t, page, slot });
            }
            offsets[b * step.seq + t] = cache.element_offset(page as usize, 0, step.layer, slot, 0, 0) as i64;
        }
    }
    Ok(offsets)
}
