//! The paged KV cache, laid out as in MAX's `PagedKVCacheCollection`.
//!
//! `blocks` is one tensor `[P, 2, L, page_size, Hkv, D]`: P physical pages,
//! index 1 picks K (0) or V (1), L layers. A batch of B sequences sees the
//! cache through `cache_lengths[B]` (tokens already cached) and
//! `lookup_table[B, max_pages_per_seq]` (logical page → physical page;
//! [`UNASSIGNED_PAGE`] where none is assigned yet).
//!
//! An FP8 cache (dtype `f8e4m3`) stores beside the blocks one f32 scale per
//! `g` values of a token's head: `scales [P, 2, L, page_size, Hkv, D / g]`,
//! where `g` is the cache's [`KvCacheParams::scale_granularity`]; element
//! `d` of a head uses scale `d / g` and reads as `code · scale`
//! ([`crate::fp8::quantize_block`] says how a block is written).
//!
//! The ops write K/V but never change `cache_lengths`: the caller reserves
//! pages before a step ([`PagedKVCacheCollection::reserve`]) and advances the
//! lengths after it ([`PagedKVCacheCollection::advance`]). Free pages are not
//! stored separately: a page is free when no lookup-table entry names it, so
//! the table stays the single source of truth even when users edit it.

use std::collections::BTreeMap;

use crate::{DType, Element, Error, Result, Tensor, TensorData};

/// Lookup-table entry of a logical page that has no physical page yet.
pub const UNASSIGNED_PAGE: u32 = u32::MAX;

/// What one element of a paged cache holds: a float of a compute dtype, or
/// an FP8 (E4M3) code with one f32 scale per `scale_granularity` values of
/// a head. One value for the pairing, so an FP8 cache without scales, or
/// scales on a float cache, cannot be written down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheElement {
    /// f32 values.
    F32,
    /// bf16 values.
    BF16,
    /// f16 values.
    F16,
    /// E4M3 codes, `code · scale` with a scale per g-block of a head.
    F8E4M3 {
        /// Values per scale, g (dividing the head size).
        scale_granularity: usize,
    },
}

impl CacheElement {
    /// The element of a cache of `dtype` with `scale_granularity` values
    /// per scale: given exactly for `f8e4m3` (and at least 1), else
    /// [`Error::InvalidCacheParams`] saying what is wrong.
    pub fn new(dtype: DType, scale_granularity: Option<usize>) -> Result<Self> {
        match (dtype, scale_granularity) {
            (DType::F32, None) => Ok(CacheElement::F32),
            (DType::BF16, None) => Ok(CacheElement::BF16),
            (DType::F16, None) => Ok(CacheElement::F16),
            (DType::F8E4M3, Some(g)) if g > 0 => Ok(CacheElement::F8E4M3 { scale_granularity: g }),
            (DType::F8E4M3, Some(g)) => {
                Err(Error::InvalidCacheParams(format!("scale_granularity must be at least 1, got {g}")))
            }
            (DType::F8E4M3, None) => Err(Error::InvalidCacheParams(format!(
                "a {dtype} cache needs a scale_granularity (values per scale, dividing head_size)"
            ))),
            (_, Some(g)) if dtype.is_float() => Err(Error::InvalidCacheParams(format!(
                "scale_granularity ({g}) applies to f8e4m3 caches only, not {dtype}"
            ))),
            // U32 and the weight block formats.
            _ => Err(Error::InvalidCacheParams(format!("dtype must be a float type, got {dtype}"))),
        }
    }

    /// The dtype of the blocks.
    pub fn dtype(self) -> DType {
        match self {
            CacheElement::F32 => DType::F32,
            CacheElement::BF16 => DType::BF16,
            CacheElement::F16 => DType::F16,
            CacheElement::F8E4M3 { .. } => DType::F8E4M3,
        }
    }

    /// Values per scale of an FP8 cache; `None` for float caches.
    pub fn scale_granularity(self) -> Option<usize> {
        match self {
            CacheElement::F8E4M3 { scale_granularity } => Some(scale_granularity),
            _ => None,
        }
    }
}

/// The layout parameters of a paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvCacheParams {
    /// What the cached K/V elements are (their dtype, and an FP8 cache's
    /// scale granularity).
    pub element: CacheElement,
    /// Layers L.
    pub num_layers: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Head size D.
    pub head_size: usize,
}

/// A scale granularity as errors name it: `g`, or `none` (no scales).
fn granularity(g: Option<usize>) -> String {
    g.map_or_else(|| "none".into(), |g| g.to_string())
}

impl KvCacheParams {
    /// Element type of the cached K/V.
    pub fn dtype(&self) -> DType {
        self.element.dtype()
    }

    /// Values per scale of an FP8 cache (`g`, dividing D); `None` for float
    /// caches. Graph files call it `scale_granularity`.
    pub fn scale_granularity(&self) -> Option<usize> {
        self.element.scale_granularity()
    }

    /// Check that a cache of these params is one a kernel built for
    /// `built_for` may use: every field equal, else
    /// [`Error::CacheLayout`] naming the first that differs.
    pub fn expect_built_for(&self, built_for: &KvCacheParams) -> Result<()> {
        // The fields below are the whole struct: equal params need no
        // message (kernels check this on every call).
        if self == built_for {
            return Ok(());
        }
        for (what, expected, got) in [
            ("dtype", built_for.dtype().to_string(), self.dtype().to_string()),
            ("num_layers", built_for.num_layers.to_string(), self.num_layers.to_string()),
            ("page_size", built_for.page_size.to_string(), self.page_size.to_string()),
            ("num_kv_heads", built_for.num_kv_heads.to_string(), self.num_kv_heads.to_string()),
            ("head_size", built_for.head_size.to_string(), self.head_size.to_string()),
            ("scale_granularity", granularity(built_for.scale_granularity()), granularity(self.scale_granularity())),
        ] {
            if expected != got {
                return Err(Error::CacheLayout { what, expected, got });
            }
        }
        Ok(())
    }

    /// Elements of K (or V) per token: Hkv·D.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_size
    }

    /// Scales per token and head of an FP8 cache (D / g; 0 when the cache
    /// has no scales).
    pub fn scales_per_head(&self) -> usize {
        self.scale_granularity().map_or(0, |g| self.head_size / g)
    }

    /// Bytes one cached token takes in one layer, K and V, scales included.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_kv_heads * (self.head_size * self.dtype().size_bytes() + self.scales_per_head() * 4)
    }

    /// Bytes of `num_pages` pages of a cache of these params, as
    /// [`PagedKVCacheCollection::new`] allocates them: the blocks, an FP8
    /// cache's scales and the page allocation order (a u32 per page);
    /// `None` when that overflows a u64.
    pub fn page_bytes(&self, num_pages: usize) -> Option<u64> {
        let head_bytes = (self.head_size as u64)
            .checked_mul(self.dtype().size_bytes() as u64)?
            .checked_add(self.scales_per_head() as u64 * 4)?;
        [num_pages, 2, self.num_layers, self.page_size, self.num_kv_heads]
            .iter()
            .try_fold(head_bytes, |acc, &n| acc.checked_mul(n as u64))?
            .checked_add((num_pages as u64).checked_mul(4)?)
    }

    /// Bytes of the page table of `batch` sequences of up to
    /// `max_pages_per_seq` pages each, as [`PagedKVCacheCollection::new`]
    /// allocates it: the lookup table and the cache lengths (u32s); `None`
    /// when that overflows a u64.
    pub fn table_bytes(batch: usize, max_pages_per_seq: usize) -> Option<u64> {
        (batch as u64).checked_mul((max_pages_per_seq as u64).checked_add(1)?)?.checked_mul(4)
    }

    /// Every byte [`PagedKVCacheCollection::new`] allocates for a cache of
    /// these params: [`page_bytes`](Self::page_bytes) plus
    /// [`table_bytes`](Self::table_bytes); `None` when that overflows a u64.
    pub fn cache_bytes(&self, num_pages: usize, batch: usize, max_pages_per_seq: usize) -> Option<u64> {
        self.page_bytes(num_pages)?.checked_add(Self::table_bytes(batch, max_pages_per_seq)?)
    }

    /// Check the params describe a cache kvjit can hold: every size at
    /// least 1, and an FP8 cache's scale granularity dividing the head size
    /// ([`Error::InvalidCacheParams`] saying which). The dtype and
    /// granularity pair is valid by construction ([`CacheElement`]).
    pub fn validate(&self) -> Result<()> {
        if let Some(g) = self.scale_granularity()
            && !self.head_size.is_multiple_of(g)
        {
            return Err(Error::InvalidCacheParams(format!(
                "scale_granularity must divide head_size {}, got {g}",
                self.head_size
            )));
        }
        for (name, v) in [
            ("num_layers", self.num_layers),
            ("page_size", self.page_size),
            ("num_kv_heads", self.num_kv_heads),
            ("head_size", self.head_size),
        ] {
            if v == 0 {
                return Err(Error::InvalidCacheParams(format!("{name} must be at least 1")));
            }
        }
        // Layer indices are u32 inputs of the paged ops.
        if u32::try_from(self.num_layers).is_err() {
            return Err(Error::InvalidCacheParams(format!(
                "num_layers must be at most {} (layer indices are u32), got {}",
                u32::MAX,
                self.num_layers
            )));
        }
        Ok(())
    }
}

/// Which blocks a cache holds and how often they were handed out for
/// writing: what a device mirror of the blocks (the CUDA target keeps one)
/// compares to know whether its copy is current. A clone is a new cache: it
/// gets a new id. Not part of a cache's value (equality ignores it).
#[derive(Debug)]
struct BlocksVersion {
    /// Unique in the process, per cache instance.
    id: u64,
    /// Bumped every time the blocks are borrowed mutably or replaced.
    generation: u64,
}

impl BlocksVersion {
    fn new() -> Self {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self { id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed), generation: 0 }
    }
}

impl Clone for BlocksVersion {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl PartialEq for BlocksVersion {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A paged KV cache and the page table of the batch that uses it.
#[derive(Clone, Debug, PartialEq)]
pub struct PagedKVCacheCollection {
    params: KvCacheParams,
    blocks: Tensor,
    /// The f32 scales of an FP8 cache, `[P, 2, L, page_size, Hkv, D / g]`.
    scales: Option<Tensor>,
    cache_lengths: Vec<u32>,
    lookup_table: Vec<u32>,
    max_pages_per_seq: usize,
    /// Longest sequence length of the current step (as in MAX).
    pub max_seq_length: u32,
    /// Longest cached length in the batch (as in MAX).
    pub max_cache_length: u32,
    allocation_order: Vec<u32>,
    version: BlocksVersion,
}

impl PagedKVCacheCollection {
    /// A process-unique id of this cache's blocks (a clone has its own).
    pub fn blocks_id(&self) -> u64 {
        self.version.id
    }

    /// How many times the blocks were borrowed mutably or replaced so far:
    /// a device copy made at generation `g` is current while this is `g`.
    pub fn blocks_generation(&self) -> u64 {
        self.version.generation
    }

    fn blocks_written(&mut self) {
        self.version.generation += 1;
    }

    /// Allocate a zeroed cache of `num_pages` pages for `batch_size` sequences,
    /// each able to hold `max_pages_per_seq` pages. No page is assigned yet.
    pub fn new(params: KvCacheParams, num_pages: usize, batch_size: usize, max_pages_per_seq: usize) -> Result<Self> {
        params.validate()?;
        if num_pages == 0 || num_pages >= UNASSIGNED_PAGE as usize {
            return Err(Error::InvalidCacheParams(format!(
                "num_pages must be in 1..{UNASSIGNED_PAGE}, got {num_pages}"
            )));
        }
        let lookup_len = batch_size
            .checked_mul(max_pages_per_seq)
            .ok_or_else(|| Error::ShapeOverflow(vec![batch_size, max_pages_per_seq]))?;
        let shape = Self::shape_of(&params, num_pages);
        let scales = match params.scale_granularity() {
            Some(_) => Some(Tensor::zeros_in_huge_pages(DType::F32, &Self::scales_shape_of(&params, num_pages))?),
            None => None,
        };
        Ok(Self {
            params,
            blocks: Tensor::zeros_in_huge_pages(params.dtype(), &shape)?,
            scales,
            cache_lengths: vec![0; batch_size],
            lookup_table: {
                let mut table = Vec::new();
                table
                    .try_reserve_exact(lookup_len)
                    .map_err(|_| Error::OutOfMemory { bytes: lookup_len.saturating_mul(4) })?;
                table.resize(lookup_len, UNASSIGNED_PAGE);
                table
            },
            max_pages_per_seq,
            max_seq_length: 0,
            max_cache_length: 0,
            allocation_order: (0..num_pages as u32).collect(),
            version: BlocksVersion::new(),
        })
    }

    /// Assemble a cache from its tensors. The layout parameters come from the
    /// blocks' shape `[P, 2, L, page_size, Hkv, D]`; lookup-table entries are
    /// not checked here (ops check the entries they use, before writing). An
    /// FP8 cache needs its scales: [`from_parts_with_scales`](Self::from_parts_with_scales).
    pub fn from_parts(
        blocks: Tensor,
        cache_lengths: Vec<u32>,
        lookup_table: Vec<u32>,
        max_pages_per_seq: usize,
    ) -> Result<Self> {
        Self::from_parts_with_scales(blocks, None, cache_lengths, lookup_table, max_pages_per_seq)
    }

    /// [`from_parts`](Self::from_parts) with the f32 scales of an FP8 cache,
    /// `[P, 2, L, page_size, Hkv, D / g]` (`None` for other dtypes); the
    /// granularity g comes from their last dim.
    pub fn from_parts_with_scales(
        blocks: Tensor,
        scales: Option<Tensor>,
        cache_lengths: Vec<u32>,
        lookup_table: Vec<u32>,
        max_pages_per_seq: usize,
    ) -> Result<Self> {
        let shape = blocks.shape().to_vec();
        if shape.len() != 6 || shape[1] != 2 {
            return Err(Error::ShapeMismatch {
                arg: "kv_collection.blocks".into(),
                expected: "[P, 2, L, page_size, Hkv, D]".into(),
                got: shape,
            });
        }
        if !blocks.is_contiguous() {
            return Err(Error::NotContiguous { arg: "kv_collection.blocks".into() });
        }
        let scale_granularity = match &scales {
            None => None,
            Some(scales) => {
                let got = scales.shape();
                let head_scales = got.get(5).copied().unwrap_or(0);
                if got.len() != 6 || got[..5] != shape[..5] || head_scales == 0 || !shape[5].is_multiple_of(head_scales)
                {
                    return Err(Error::ShapeMismatch {
                        arg: "kv_collection.scales".into(),
                        expected: format!(
                            "[{}, 2, {}, {}, {}, D / g] with g dividing D = {}",
                            shape[0], shape[2], shape[3], shape[4], shape[5]
                        ),
                        got: got.to_vec(),
                    });
                }
                crate::expect_arg("kv_collection.scales", scales, DType::F32)?;
                Some(shape[5] / head_scales)
            }
        };
        let params = KvCacheParams {
            element: CacheElement::new(blocks.dtype(), scale_granularity)?,
            num_layers: shape[2],
            page_size: shape[3],
            num_kv_heads: shape[4],
            head_size: shape[5],
        };
        params.validate()?;
        let batch_size = cache_lengths.len();
        if lookup_table.len() != batch_size * max_pages_per_seq {
            return Err(Error::ShapeMismatch {
                arg: "kv_collection.lookup_table".into(),
                expected: format!("[{batch_size}, {max_pages_per_seq}]"),
                got: vec![lookup_table.len()],
            });
        }
        let max_cache_length = cache_lengths.iter().copied().max().unwrap_or(0);
        Ok(Self {
            params,
            allocation_order: (0..shape[0] as u32).collect(),
            blocks,
            scales,
            cache_lengths,
            lookup_table,
            max_pages_per_seq,
            max_seq_length: 0,
            max_cache_length,
            version: BlocksVersion::new(),
        })
    }

    fn shape_of(params: &KvCacheParams, num_pages: usize) -> [usize; 6] {
        [num_pages, 2, params.num_layers, params.page_size, params.num_kv_heads, params.head_size]
    }

    fn scales_shape_of(params: &KvCacheParams, num_pages: usize) -> [usize; 6] {
        [num_pages, 2, params.num_layers, params.page_size, params.num_kv_heads, params.scales_per_head()]
    }

    /// The layout parameters.
    pub fn params(&self) -> &KvCacheParams {
        &self.params
    }

    /// Physical pages P.
    pub fn num_pages(&self) -> usize {
        self.blocks.shape()[0]
    }

    /// Sequences B in the batch.
    pub fn batch_size(&self) -> usize {
        self.cache_lengths.len()
    }

    /// Width of the lookup table.
    pub fn max_pages_per_seq(&self) -> usize {
        self.max_pages_per_seq
    }

    /// The blocks tensor `[P, 2, L, page_size, Hkv, D]`.
    pub fn blocks(&self) -> &Tensor {
        &self.blocks
    }

    /// Replace the blocks' contents (copied into the cache's storage). The new tensor must have exactly the
    /// cache's shape `[P, 2, L, page_size, Hkv, D]` and dtype, contiguous, so
    /// the layout kernels rely on can never change under them.
    pub fn set_blocks(&mut self, blocks: Tensor) -> Result<()> {
        let expected = Self::shape_of(&self.params, self.num_pages());
        if blocks.shape() != expected {
            return Err(Error::ShapeMismatch {
                arg: "kv_collection.blocks".into(),
                expected: format!("{expected:?}"),
                got: blocks.shape().to_vec(),
            });
        }
        if blocks.dtype() != self.params.dtype() {
            return Err(Error::DTypeMismatch {
                arg: "kv_collection.blocks".into(),
                expected: self.params.dtype(),
                got: blocks.dtype(),
            });
        }
        if !blocks.is_contiguous() {
            return Err(Error::NotContiguous { arg: "kv_collection.blocks".into() });
        }
        // Copied into the cache's own storage, which stays (huge pages,
        // where the system gives them).
        self.blocks.as_bytes_mut().copy_from_slice(blocks.as_bytes());
        self.blocks_written();
        Ok(())
    }

    /// The scales of an FP8 cache, `[P, 2, L, page_size, Hkv, D / g]` f32
    /// (`None` for other dtypes).
    pub fn scales(&self) -> Option<&Tensor> {
        self.scales.as_ref()
    }

    /// Replace the scales of an FP8 cache (copied into the cache's
    /// storage): exactly its scales' shape, f32, contiguous.
    pub fn set_scales(&mut self, scales: Tensor) -> Result<()> {
        let expected = Self::scales_shape_of(&self.params, self.num_pages());
        if self.scales.is_none() {
            return Err(Error::InvalidCacheParams(format!("a {} cache has no scales", self.params.dtype())));
        }
        if scales.shape() != expected {
            return Err(Error::ShapeMismatch {
                arg: "kv_collection.scales".into(),
                expected: format!("{expected:?}"),
                got: scales.shape().to_vec(),
            });
        }
        crate::expect_arg("kv_collection.scales", &scales, DType::F32)?;
        if let Some(own) = &mut self.scales {
            own.as_bytes_mut().copy_from_slice(scales.as_bytes());
        }
        self.blocks_written();
        Ok(())
    }

    /// The blocks' raw bytes and the scales (FP8 caches), both writable:
    /// what a kernel storing quantized K/V writes.
    pub fn blocks_and_scales_mut(&mut self) -> (&mut [u8], Option<&mut [f32]>) {
        self.blocks_written();
        let scales = self.scales.as_mut().map(|s| s.as_mut_slice::<f32>().expect("scales are f32, checked when set"));
        (self.blocks.as_bytes_mut(), scales)
    }

    /// Set every scale to `value` (tests poison them with NaN); nothing for
    /// a cache without scales.
    pub fn fill_scales(&mut self, value: f32) -> Result<()> {
        self.blocks_written();
        match &mut self.scales {
            Some(scales) => scales.fill_f32(value),
            None => Ok(()),
        }
    }

    /// Index into the scales' storage of scale `[page, kv, layer, slot,
    /// head, block]` (block = d / g).
    pub fn scale_offset(&self, page: usize, kv: usize, layer: usize, slot: usize, head: usize, block: usize) -> usize {
        let p = &self.params;
        ((((page * 2 + kv) * p.num_layers + layer) * p.page_size + slot) * p.num_kv_heads + head) * p.scales_per_head()
            + block
    }

    /// The blocks' elements, writable (kernels write K/V through this); fails
    /// if `T` is not the cache dtype. The shape and layout stay fixed.
    pub fn blocks_slice_mut<T: crate::tensor::Storable>(&mut self) -> Result<&mut [T]> {
        self.blocks_written();
        self.blocks.as_mut_slice()
    }

    /// The blocks' raw bytes, writable.
    pub fn blocks_bytes_mut(&mut self) -> &mut [u8] {
        self.blocks_written();
        self.blocks.as_bytes_mut()
    }

    /// Set every block element to `value` rounded to the cache dtype (tests
    /// poison caches with NaN this way).
    pub fn fill_blocks_f32(&mut self, value: f32) -> Result<()> {
        self.blocks_written();
        self.blocks.fill_f32(value)
    }

    /// Tokens already cached per sequence.
    pub fn cache_lengths(&self) -> &[u32] {
        &self.cache_lengths
    }

    /// Tokens already cached per sequence, writable (for callers that manage
    /// lengths themselves).
    pub fn cache_lengths_mut(&mut self) -> &mut [u32] {
        &mut self.cache_lengths
    }

    /// The page table, row-major `[B, max_pages_per_seq]`.
    pub fn lookup_table(&self) -> &[u32] {
        &self.lookup_table
    }

    /// The page table, writable (for callers that manage pages themselves).
    pub fn lookup_table_mut(&mut self) -> &mut [u32] {
        &mut self.lookup_table
    }

    /// Index into `blocks`' storage of element `[page, kv, layer, slot, head, d]`.
    /// This is the one place the blocks layout is spelled out.
    pub fn element_offset(&self, page: usize, kv: usize, layer: usize, slot: usize, head: usize, d: usize) -> usize {
        let p = &self.params;
        ((((page * 2 + kv) * p.num_layers + layer) * p.page_size + slot) * p.num_kv_heads + head) * p.head_size + d
    }

    /// The order in which free pages are handed out (a permutation of
    /// `0..P`). The default is ascending; a shuffled order gives scattered
    /// page tables, as a long-running server has.
    pub fn set_allocation_order(&mut self, order: Vec<u32>) -> Result<()> {
        let mut sorted = order.clone();
        sorted.sort_unstable();
        if sorted != (0..self.num_pages() as u32).collect::<Vec<_>>() {
            return Err(Error::InvalidCacheParams(format!(
                "allocation order must be a permutation of 0..{}",
                self.num_pages()
            )));
        }
        self.allocation_order = order;
        Ok(())
    }

    /// Pages no sequence holds.
    pub fn free_pages(&self) -> Vec<u32> {
        let used = self.used_pages();
        self.allocation_order.iter().copied().filter(|&p| !used[p as usize]).collect()
    }

    fn used_pages(&self) -> Vec<bool> {
        let mut used = vec![false; self.num_pages()];
        for &p in &self.lookup_table {
            if let Some(u) = used.get_mut(p as usize) {
                *u = true;
            }
        }
        used
    }

    fn check_batch(&self, batch: usize) -> Result<()> {
        if batch >= self.batch_size() {
            return Err(Error::SequenceOutOfRange { batch, batch_size: self.batch_size() });
        }
        Ok(())
    }

    fn pages_for(&self, batch: usize, tokens: u64) -> Result<usize> {
        let pages = tokens.div_ceil(self.params.page_size as u64);
        if pages > self.max_pages_per_seq as u64 {
            return Err(Error::SequenceTooLong {
                batch,
                tokens,
                max_pages_per_seq: self.max_pages_per_seq,
                page_size: self.params.page_size,
            });
        }
        Ok(pages as usize)
    }

    /// Logical pages of `batch` that need a physical page to hold `tokens`.
    fn missing_pages(&self, batch: usize, tokens: u64) -> Result<Vec<usize>> {
        let pages = self.pages_for(batch, tokens)?;
        let row = &self.lookup_table[batch * self.max_pages_per_seq..][..pages];
        Ok((0..pages).filter(|&i| row[i] == UNASSIGNED_PAGE).collect())
    }

    /// Make sure sequences can hold `cache_lengths[b] + new_tokens[b]` tokens,
    /// assigning free pages where needed, and record the step's
    /// `max_seq_length`. All or nothing: on error no page is assigned.
    pub fn reserve(&mut self, new_tokens: &[u32]) -> Result<()> {
        self.check_lengths_arg("new_tokens", new_tokens)?;
        let mut plan = Vec::new();
        for (b, &n) in new_tokens.iter().enumerate() {
            let total = self.cache_lengths[b] as u64 + n as u64;
            plan.push((b, self.missing_pages(b, total)?));
        }
        let mut free = self.free_pages().into_iter();
        let free_count = free.len();
        let needed: usize = plan.iter().map(|(_, m)| m.len()).sum();
        if needed > free_count {
            let batch = plan.iter().find(|(_, m)| !m.is_empty()).map_or(0, |(b, _)| *b);
            return Err(Error::OutOfPages { batch, needed, free: free_count });
        }
        for (b, missing) in plan {
            for logical in missing {
                let page = free.next().expect("free pages counted above");
                self.lookup_table[b * self.max_pages_per_seq + logical] = page;
            }
        }
        self.max_seq_length = new_tokens.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    /// Add each sequence's newly written tokens to its cache length (the step
    /// after running an op). Fails, changing nothing, if a length overflows.
    pub fn advance(&mut self, new_tokens: &[u32]) -> Result<()> {
        self.check_lengths_arg("new_tokens", new_tokens)?;
        let new_lengths = self
            .cache_lengths
            .iter()
            .zip(new_tokens)
            .enumerate()
            .map(|(b, (&c, &n))| {
                c.checked_add(n).ok_or(Error::SequenceTooLong {
                    batch: b,
                    tokens: c as u64 + n as u64,
                    max_pages_per_seq: self.max_pages_per_seq,
                    page_size: self.params.page_size,
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        self.cache_lengths = new_lengths;
        self.max_cache_length = self.cache_lengths.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    /// End a sequence: its pages become free and its length 0.
    pub fn release(&mut self, batch: usize) -> Result<()> {
        self.check_batch(batch)?;
        self.lookup_table[batch * self.max_pages_per_seq..][..self.max_pages_per_seq].fill(UNASSIGNED_PAGE);
        self.cache_lengths[batch] = 0;
        self.max_cache_length = self.cache_lengths.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    fn check_lengths_arg(&self, arg: &str, lengths: &[u32]) -> Result<()> {
        if lengths.len() != self.batch_size() {
            return Err(Error::ShapeMismatch {
                arg: arg.into(),
                expected: format!("[{}] (one per sequence)", self.batch_size()),
                got: vec![lengths.len()],
            });
        }
        Ok(())
    }

    /// Check one step's valid lengths against its padded length `seq` and
    /// this cache, in sequence order: `valid[b] ≤ seq`
    /// ([`Error::ValidLengthTooLong`]) and `cache_lengths[b] + valid[b]`
    /// representable ([`Error::SequenceTooLong`]). Every paged op runs this
    /// before it locates a single token.
    pub fn check_step_lengths(&self, valid: &[u32], seq: usize) -> Result<()> {
        for (b, (&v, &start)) in valid.iter().zip(&self.cache_lengths).enumerate() {
            if v as usize > seq {
                return Err(Error::ValidLengthTooLong { batch: b, valid_length: v, seq_len: seq });
            }
            if start.checked_add(v).is_none() {
                return Err(Error::SequenceTooLong {
                    batch: b,
                    tokens: u64::from(start) + u64::from(v),
                    max_pages_per_seq: self.max_pages_per_seq,
                    page_size: self.params.page_size,
                });
            }
        }
        Ok(())
    }

    /// Physical page and slot of token `position` of sequence `batch`.
    pub fn locate(&self, batch: usize, position: usize) -> Result<(u32, usize)> {
        self.check_batch(batch)?;
        let page_size = self.params.page_size;
        let logical = position / page_size;
        if logical >= self.max_pages_per_seq {
            return Err(Error::LogicalPageOutOfRange {
                batch,
                position: position as u64,
                logical_page: logical as u64,
                max_pages_per_seq: self.max_pages_per_seq,
            });
        }
        let page = self.lookup_table[batch * self.max_pages_per_seq + logical];
        if page as usize >= self.num_pages() {
            return Err(Error::PhysicalPageOutOfRange {
                batch,
                logical_page: logical,
                physical_page: page,
                num_pages: self.num_pages(),
            });
        }
        Ok((page, position % page_size))
    }

    /// The cached K and V of one token (each `Hkv·D` values, head-major),
    /// widened to f32. The position must be below the sequence's cache length.
    pub fn read_token(&self, layer: usize, batch: usize, position: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_batch(batch)?;
        if layer >= self.params.num_layers {
            return Err(Error::LayerOutOfRange { layer_idx: layer as u32, num_layers: self.params.num_layers });
        }
        if position >= self.cache_lengths[batch] as usize {
            return Err(Error::PositionNotCached { batch, position, cache_length: self.cache_lengths[batch] });
        }
        let (page, slot) = self.locate(batch, position)?;
        Ok((self.read_slot(page as usize, 0, layer, slot)?, self.read_slot(page as usize, 1, layer, slot)?))
    }

    /// The `Hkv·D` values at `[page, kv, layer, slot, :, :]`, widened to f32
    /// (an FP8 cache's dequantized: `code · scale`).
    pub fn read_slot(&self, page: usize, kv: usize, layer: usize, slot: usize) -> Result<Vec<f32>> {
        fn widen<T: Element>(values: &[T]) -> Vec<f32> {
            values.iter().map(|v| v.to_f32()).collect()
        }
        let start = self.element_offset(page, kv, layer, slot, 0, 0);
        let range = start..start + self.params.kv_dim();
        Ok(match self.blocks.data() {
            TensorData::F32(v) => widen(&v[range]),
            TensorData::BF16(v) => widen(&v[range]),
            TensorData::F16(v) => widen(&v[range]),
            TensorData::F8E4M3(v) => {
                let g = self.params.scale_granularity().expect("an f8e4m3 cache has a granularity, checked at build");
                let scales = self.scales.as_ref().expect("an f8e4m3 cache has scales, checked at build");
                let scales = &scales.as_slice::<f32>()?[start / g..][..self.params.kv_dim() / g];
                let mut values = vec![0f32; range.len()];
                for ((out, codes), &scale) in values.chunks_exact_mut(g).zip(v[range].chunks_exact(g)).zip(scales) {
                    let codes: &[u8] = bytemuck::cast_slice(codes);
                    crate::fp8::dequantize_block(codes, scale, out);
                }
                values
            }
            TensorData::U32(_) | TensorData::Blocks(..) => {
                return Err(Error::NotFloat { what: "read_slot".into(), dtype: self.blocks.dtype() });
            }
        })
    }

    /// The cache as named tensors, `{prefix}.blocks` (and `.scales` for FP8), `.cache_lengths`,
    /// `.lookup_table`, `.max_seq_length`, `.max_cache_length` (the last two
    /// u32 scalars), for saving to a safetensors file.
    pub fn to_tensors(&self, prefix: &str) -> Result<Vec<(String, Tensor)>> {
        let b = self.batch_size();
        let scales = self.scales.iter().map(|s| (format!("{prefix}.scales"), s.clone()));
        Ok(std::iter::once((format!("{prefix}.blocks"), self.blocks.clone()))
            .chain(scales)
            .chain([
                (format!("{prefix}.cache_lengths"), Tensor::from_vec(&[b], self.cache_lengths.clone())?),
                (
                    format!("{prefix}.lookup_table"),
                    Tensor::from_vec(&[b, self.max_pages_per_seq], self.lookup_table.clone())?,
                ),
                (format!("{prefix}.max_seq_length"), Tensor::scalar_u32(self.max_seq_length)),
                (format!("{prefix}.max_cache_length"), Tensor::scalar_u32(self.max_cache_length)),
            ])
            .collect())
    }

    /// Rebuild a cache from the tensors [`to_tensors`](Self::to_tensors)
    /// names, taking them out of `tensors`. The scalar lengths are optional
    /// (derived when absent).
    pub fn from_tensors(prefix: &str, tensors: &mut BTreeMap<String, Tensor>) -> Result<Self> {
        let mut take = |suffix: &str| {
            let name = format!("{prefix}.{suffix}");
            tensors.remove(&name).ok_or(Error::MissingTensor { name, context: String::new() })
        };
        let blocks = take("blocks")?;
        let scales = if blocks.dtype().is_quantized() { Some(take("scales")?) } else { None };
        let cache_lengths = take("cache_lengths")?;
        let lookup_table = take("lookup_table")?;
        let scalars = [take("max_seq_length").ok(), take("max_cache_length").ok()];
        let lengths_shape = cache_lengths.shape().to_vec();
        if lengths_shape.len() != 1 {
            return Err(Error::ShapeMismatch {
                arg: format!("{prefix}.cache_lengths"),
                expected: "[B]".into(),
                got: lengths_shape,
            });
        }
        let table_shape = lookup_table.shape().to_vec();
        if table_shape.len() != 2 || table_shape[0] != lengths_shape[0] {
            return Err(Error::ShapeMismatch {
                arg: format!("{prefix}.lookup_table"),
                expected: format!("[{}, max_pages_per_seq]", lengths_shape[0]),
                got: table_shape,
            });
        }
        let mut cache = Self::from_parts_with_scales(
            blocks,
            scales,
            cache_lengths.to_u32_vec()?,
            lookup_table.to_u32_vec()?,
            table_shape[1],
        )?;
        for (name, scalar) in ["max_seq_length", "max_cache_length"].iter().zip(&scalars) {
            if let Some(t) = scalar.as_ref().filter(|t| t.numel() != 1) {
                return Err(Error::ShapeMismatch {
                    arg: format!("{prefix}.{name}"),
                    expected: "[] (one u32)".into(),
                    got: t.shape().to_vec(),
                });
            }
        }
        if let [Some(seq), Some(cached)] = scalars {
            cache.max_seq_length = seq.to_u32_vec()?[0];
            cache.max_cache_length = cached.to_u32_vec()?[0];
        }
        Ok(cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> KvCacheParams {
        KvCacheParams { element: CacheElement::F32, num_layers: 2, page_size: 4, num_kv_heads: 2, head_size: 3 }
    }

    #[test]
    fn blocks_versions_tell_caches_and_writes_apart() {
        let params =
            KvCacheParams { element: CacheElement::F32, num_layers: 1, page_size: 2, num_kv_heads: 1, head_size: 2 };
        let mut cache = PagedKVCacheCollection::new(params, 4, 1, 2).unwrap();
        let (id, generation) = (cache.blocks_id(), cache.blocks_generation());
        let copy = cache.clone();
        assert_ne!(copy.blocks_id(), id, "a clone is another cache");
        assert_eq!(copy, cache, "the version is not part of the value");
        let _ = cache.blocks();
        assert_eq!(cache.blocks_generation(), generation, "reading changes nothing");
        cache.blocks_bytes_mut()[0] = 1;
        cache.fill_blocks_f32(2.0).unwrap();
        cache.blocks_slice_mut::<f32>().unwrap()[0] = 3.0;
        cache.set_blocks(copy.blocks().clone()).unwrap();
        assert_eq!(cache.blocks_generation(), generation + 4);
        assert_eq!(cache.blocks_id(), id);
    }

    #[test]
    fn reserve_assigns_pages_in_allocation_order_and_advance_grows() {
        let mut cache = PagedKVCacheCollection::new(params(), 6, 2, 3).unwrap();
        cache.set_allocation_order(vec![5, 3, 1, 0, 2, 4]).unwrap();
        cache.reserve(&[5, 1]).unwrap();
        // Sequence 0 needs 2 pages (5 tokens of 4), sequence 1 one page.
        assert_eq!(cache.lookup_table(), &[5, 3, UNASSIGNED_PAGE, 1, UNASSIGNED_PAGE, UNASSIGNED_PAGE]);
        assert_eq!(cache.max_seq_length, 5);
        cache.advance(&[5, 1]).unwrap();
        assert_eq!(cache.cache_lengths(), &[5, 1]);
        assert_eq!(cache.max_cache_length, 5);
        assert_eq!(cache.free_pages(), vec![0, 2, 4]);
        cache.release(0).unwrap();
        assert_eq!(cache.free_pages(), vec![5, 3, 0, 2, 4]);
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let mut cache = PagedKVCacheCollection::new(params(), 2, 2, 3).unwrap();
        let before = cache.clone();
        let refused = cache.reserve(&[4, 5]).unwrap_err();
        assert!(matches!(refused, Error::OutOfPages { batch: 0, needed: 3, free: 2 }), "{refused:?}");
        // The count is the step's, not the first sequence's (which needs 1).
        assert!(refused.to_string().starts_with("the step needs 3 more cache pages in all (sequence 0"), "{refused}");
        assert!(matches!(cache.reserve(&[13, 0]), Err(Error::SequenceTooLong { .. })));
        assert_eq!(cache, before);
    }

    #[test]
    fn read_token_returns_what_was_stored() {
        let mut cache = PagedKVCacheCollection::new(params(), 3, 1, 2).unwrap();
        cache.reserve(&[6]).unwrap();
        cache.advance(&[6]).unwrap();
        let (page, slot) = cache.locate(0, 5).unwrap();
        assert_eq!((page, slot), (1, 1));
        for h in 0..2 {
            for d in 0..3 {
                let off = cache.element_offset(page as usize, 1, 1, slot, h, d);
                cache.blocks_slice_mut::<f32>().unwrap()[off] = (10 * h + d) as f32;
            }
        }
        let (k, v) = cache.read_token(1, 0, 5).unwrap();
        assert_eq!(k, vec![0.0; 6]);
        assert_eq!(v, vec![0.0, 1.0, 2.0, 10.0, 11.0, 12.0]);
        assert!(matches!(cache.read_token(1, 0, 6), Err(Error::PositionNotCached { .. })));
        assert!(matches!(cache.read_token(2, 0, 0), Err(Error::LayerOutOfRange { .. })));
    }

    #[test]
    fn tensors_round_trip() {
        let mut cache = PagedKVCacheCollection::new(params(), 4, 2, 2).unwrap();
        cache.reserve(&[3, 7]).unwrap();
        cache.advance(&[3, 7]).unwrap();
        let mut map: BTreeMap<String, Tensor> = cache.to_tensors("kv").unwrap().into_iter().collect();
        let back = PagedKVCacheCollection::from_tensors("kv", &mut map).unwrap();
        assert_eq!(back.blocks(), cache.blocks());
        assert_eq!(back.cache_lengths(), cache.cache_lengths());
        assert_eq!(back.lookup_table(), cache.lookup_table());
        assert_eq!((back.max_seq_length, back.max_cache_length), (7, 7));
        assert!(map.is_empty());
        // A length scalar of another shape is refused, naming it (any shape
        // was taken, its first element used).
        let mut map: BTreeMap<String, Tensor> = cache.to_tensors("kv").unwrap().into_iter().collect();
        map.insert("kv.max_seq_length".into(), Tensor::from_vec(&[2], vec![7u32, 9]).unwrap());
        let err = PagedKVCacheCollection::from_tensors("kv", &mut map).unwrap_err();
        assert!(
            matches!(&err, Error::ShapeMismatch { arg, got, .. } if arg == "kv.max_seq_length" && got == &[2]),
            "{err:?}"
        );
    }

    fn fp8_params(head_size: usize, g: usize) -> KvCacheParams {
        KvCacheParams {
            element: CacheElement::F8E4M3 { scale_granularity: g },
            num_layers: 2,
            page_size: 3,
            num_kv_heads: 2,
            head_size,
        }
    }

    #[test]
    fn fp8_caches_hold_scales_and_read_back_dequantized() {
        let mut cache = PagedKVCacheCollection::new(fp8_params(8, 4), 3, 1, 3).unwrap();
        assert_eq!(cache.scales().unwrap().shape(), &[3, 2, 2, 3, 2, 2]);
        assert_eq!(cache.params().bytes_per_token(), 2 * 2 * (8 + 2 * 4));
        cache.reserve(&[2]).unwrap();
        cache.advance(&[2]).unwrap();
        let (page, slot) = cache.locate(0, 1).unwrap();
        let values: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.3).collect();
        for (block, chunk) in values.chunks(4).enumerate() {
            let mut codes = [0u8; 4];
            let scale = crate::fp8::quantize_block(chunk, &mut codes);
            let (head, first) = (block / 2, (block % 2) * 4);
            let at = cache.element_offset(page as usize, 1, 1, slot, head, first);
            let scale_at = cache.scale_offset(page as usize, 1, 1, slot, head, first / 4);
            let (blocks, scales) = cache.blocks_and_scales_mut();
            blocks[at..at + 4].copy_from_slice(&codes);
            scales.unwrap()[scale_at] = scale;
        }
        let (_, v) = cache.read_token(1, 0, 1).unwrap();
        for (got, want) in v.iter().zip(&values) {
            // Half an E4M3 step at the block's scale: at most 16 (half the step
            // at 448) times the scale max|x| / 448, and 2^-4 relative.
            assert!((got - want).abs() <= 2.25 / 28.0, "{got} vs {want}");
            assert!((got - want).abs() <= want.abs() / 16.0 + 1e-6, "{got} vs {want}");
        }
        // Saved and loaded with its scales.
        let mut map: BTreeMap<String, Tensor> = cache.to_tensors("kv").unwrap().into_iter().collect();
        assert!(map.contains_key("kv.scales"));
        let back = PagedKVCacheCollection::from_tensors("kv", &mut map).unwrap();
        assert_eq!(back.params(), cache.params());
        assert_eq!(back.scales(), cache.scales());
        assert_eq!(back.read_token(1, 0, 1).unwrap(), cache.read_token(1, 0, 1).unwrap());
    }

    #[test]
    fn bad_fp8_layouts_and_scales_are_refused() {
        let refused = |params: KvCacheParams| PagedKVCacheCollection::new(params, 2, 1, 2).unwrap_err().to_string();
        assert!(refused(fp8_params(8, 3)).contains("scale_granularity must divide head_size 8, got 3"));
        assert!(refused(fp8_params(8, 0)).contains("must divide"));
        // The dtype and granularity pairing is one value: the impossible
        // pairs cannot be made.
        let element = |dtype, g| CacheElement::new(dtype, g).unwrap_err().to_string();
        assert!(element(DType::F8E4M3, None).contains("needs a scale_granularity"));
        assert!(element(DType::BF16, Some(8)).contains("f8e4m3 caches only"));
        assert!(element(DType::F8E4M3, Some(0)).contains("at least 1"));
        assert!(element(DType::U32, None).contains("must be a float type"));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let float = CacheElement::new(dtype, None).unwrap();
            assert_eq!((float.dtype(), float.scale_granularity()), (dtype, None));
        }
        let fp8 = CacheElement::new(DType::F8E4M3, Some(16)).unwrap();
        assert_eq!((fp8.dtype(), fp8.scale_granularity()), (DType::F8E4M3, Some(16)));

        let cache = PagedKVCacheCollection::new(fp8_params(8, 4), 2, 1, 2).unwrap();
        let blocks = cache.blocks().clone();
        let parts = |scales: Option<Tensor>| {
            PagedKVCacheCollection::from_parts_with_scales(blocks.clone(), scales, vec![0], vec![0, 1], 2)
        };
        let good = cache.scales().unwrap().clone();
        assert_eq!(parts(Some(good.clone())).unwrap().params(), cache.params());
        let missing = parts(None).unwrap_err().to_string();
        assert!(missing.contains("needs a scale_granularity"), "{missing}");
        for shape in [[2, 2, 2, 3, 2, 3], [2, 2, 2, 3, 1, 2], [2, 2, 2, 3, 2, 0]] {
            let err = parts(Some(Tensor::zeros(DType::F32, &shape).unwrap())).unwrap_err().to_string();
            assert!(err.contains("kv_collection.scales"), "{shape:?}: {err}");
        }
        let wrong_dtype = parts(Some(Tensor::zeros(DType::BF16, good.shape()).unwrap())).unwrap_err();
        assert!(matches!(wrong_dtype, Error::DTypeMismatch { .. }), "{wrong_dtype}");

        let mut cache = cache;
        let before = cache.clone();
        assert!(cache.set_scales(Tensor::zeros(DType::F32, &[2, 2, 2, 3, 2, 4]).unwrap()).is_err());
        assert!(cache.set_scales(Tensor::zeros(DType::F16, good.shape()).unwrap()).is_err());
        assert_eq!(cache, before, "a refused set_scales changed nothing");
    }
}
