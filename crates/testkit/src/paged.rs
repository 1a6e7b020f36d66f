//! The hand-drawn paged step every paged op's bad-input tests start from:
//! three sequences, drawn so that each has history, an empty one has none,
//! pages are scattered and unassigned ones trail each table.
//!
//! - sequence 0: 1 cached + 3 valid tokens → positions 1..=3, logical
//!   pages 0, 1 (physical 4, 7);
//! - sequence 1: 0 cached + 2 valid → positions 0, 1, logical page 0
//!   (physical 2);
//! - sequence 2: 3 cached + 4 valid → positions 3..=6, logical pages 1, 2,
//!   3 (physical 0, 5, 3).
//!
//! Page size 2, [`LAYERS`] layers, [`PAGES`] physical pages (1, 6 and 8
//! unused), [`MAX_PAGES`] pages per sequence; the step pads every sequence
//! to [`S`] tokens. An op adds its own heads and head size.

use kvjit_core::{CacheElement, DType, KvCacheParams, PagedKVCacheCollection, Tensor, UNASSIGNED_PAGE};
use rand::rngs::StdRng;

use crate::layout::blocks_shape;
use crate::values::{uniform, uniform_in};

/// Sequences B.
pub const B: usize = 3;
/// Padded tokens per sequence S.
pub const S: usize = 4;
/// Cache layers L.
pub const LAYERS: usize = 2;
/// Tokens per page.
pub const PAGE_SIZE: usize = 2;
/// Physical pages P.
pub const PAGES: usize = 10;
/// Logical pages per sequence.
pub const MAX_PAGES: usize = 4;
/// Tokens each sequence has cached before the step.
pub const CACHE_LENGTHS: [u32; B] = [1, 0, 3];
/// Tokens of the step each sequence has (the rest is padding).
pub const VALID: [u32; B] = [3, 2, 4];
/// The layer the step reads or writes.
pub const LAYER: u32 = 1;

const U: u32 = UNASSIGNED_PAGE;
/// Each sequence's page table, row by row.
#[rustfmt::skip]
pub const TABLE: [u32; B * MAX_PAGES] = [
    4, 7, U, U,
    2, U, U, U,
    9, 0, 5, 3,
];

/// The blocks shape `[P, 2, L, page_size, Hkv, D]` of the fixture's cache.
pub fn blocks(num_kv_heads: usize, head_size: usize) -> [usize; 6] {
    blocks_shape(PAGES, LAYERS, PAGE_SIZE, num_kv_heads, head_size)
}

/// The layout of the fixture's cache in `dtype` (`granularity`: an FP8
/// cache's values per scale).
///
/// # Panics
///
/// If `granularity` is not given exactly for `f8e4m3`.
pub fn params(dtype: DType, num_kv_heads: usize, head_size: usize, granularity: Option<usize>) -> KvCacheParams {
    KvCacheParams {
        element: CacheElement::new(dtype, granularity).expect("a cache element"),
        num_layers: LAYERS,
        page_size: PAGE_SIZE,
        num_kv_heads,
        head_size,
    }
}

/// The fixture's cache holding random (non-NaN) values in every element —
/// for an FP8 cache (`granularity` given) random finite codes and random
/// scales in [0.5, 2) — so an element written by a refused call stands out.
///
/// # Panics
///
/// If `granularity` does not divide `head_size`.
pub fn cache(
    rng: &mut StdRng,
    dtype: DType,
    num_kv_heads: usize,
    head_size: usize,
    granularity: Option<usize>,
) -> PagedKVCacheCollection {
    let shape = blocks(num_kv_heads, head_size);
    let blocks = uniform(rng, dtype, &shape);
    let scales = granularity.map(|g| {
        let scales_shape = [PAGES, 2, LAYERS, PAGE_SIZE, num_kv_heads, head_size / g];
        uniform_in(rng, DType::F32, &scales_shape, 0.5, 2.0)
    });
    let cache = PagedKVCacheCollection::from_parts_with_scales(
        blocks,
        scales,
        CACHE_LENGTHS.to_vec(),
        TABLE.to_vec(),
        MAX_PAGES,
    )
    .expect("the fixture's parts make a cache");
    assert_eq!(*cache.params(), params(dtype, num_kv_heads, head_size, granularity), "the fixture's layout");
    cache
}

/// The step's `valid_lengths` tensor (u32 `[B]`).
pub fn valid_lengths() -> Tensor {
    crate::u32s(&VALID)
}

/// The step's `layer_idx` tensor (a u32 scalar).
pub fn layer_idx() -> Tensor {
    Tensor::scalar_u32(LAYER)
}

#[cfg(test)]
mod tests {
    use kvjit_core::fp8::e4m3_to_f32;
    use rand::SeedableRng;

    use super::*;
    use crate::problem::cache_values;

    #[test]
    fn an_fp8_fixture_cache_values_are_codes_times_their_block_scale() {
        let (hkv, d, g) = (2, 8, 4);
        let fp8 = super::cache(&mut StdRng::seed_from_u64(3), DType::F8E4M3, hkv, d, Some(g));
        let (codes, scales) = (fp8.blocks().as_bytes(), fp8.scales().unwrap().as_slice::<f32>().unwrap());
        let values = cache_values(&fp8);
        assert_eq!(values.len(), codes.len());
        for (i, &code) in codes.iter().enumerate() {
            // Element i sits in head i / d; its block is (i % d) / g of that head.
            let scale = scales[(i / d) * (d / g) + (i % d) / g];
            assert_eq!(values[i], f64::from(e4m3_to_f32(code)) * f64::from(scale), "element {i}");
        }
        assert!(scales.iter().all(|&s| (0.5..2.0).contains(&s)));
        let plain = super::cache(&mut StdRng::seed_from_u64(3), DType::BF16, hkv, d, None);
        assert!(plain.scales().is_none());
        assert_eq!(
            cache_values(&plain),
            plain.blocks().to_f32_vec().unwrap().iter().map(|&v| f64::from(v)).collect::<Vec<_>>()
        );
    }
}
