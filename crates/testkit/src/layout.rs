//! The paged cache's layout, written out independently of the library (so a
//! wrong offset in the library cannot hide in the test), and checks of a
//! whole blocks tensor against per-element expectations.

use std::collections::HashMap;

use kvjit_core::{DType, PagedKVCacheCollection, Tensor};

/// The contract's blocks shape `[P, 2, L, page_size, Hkv, D]`.
pub fn blocks_shape(num_pages: usize, layers: usize, page_size: usize, hkv: usize, d: usize) -> [usize; 6] {
    [num_pages, 2, layers, page_size, hkv, d]
}

/// A zeroed cache assembled from an explicit page table and cache lengths.
///
/// # Panics
///
/// If the parts do not make a cache.
pub fn cache_from_table(
    cache_dtype: DType,
    shape: [usize; 6],
    cache_lengths: &[u32],
    table: &[u32],
    max_pages_per_seq: usize,
) -> PagedKVCacheCollection {
    let blocks = Tensor::zeros(cache_dtype, &shape).expect("a blocks tensor");
    PagedKVCacheCollection::from_parts(blocks, cache_lengths.to_vec(), table.to_vec(), max_pages_per_seq)
        .expect("the parts make a cache")
}

/// Row-major index of `[page, kv, layer, slot, head, d]` in blocks of `shape`
/// (written out here, independently of the library's `element_offset`).
///
/// # Panics
///
/// If `shape` is not of rank 6 or the index is outside it.
pub fn block_index(shape: &[usize], idx: [usize; 6]) -> usize {
    assert_eq!(shape.len(), 6);
    shape.iter().zip(idx).fold(0, |acc, (&dim, i)| {
        assert!(i < dim, "index {idx:?} outside blocks {shape:?}");
        acc * dim + i
    })
}

/// The inverse of a row-major index ([`block_index`]), for failure messages.
pub fn unravel(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (axis, &dim) in shape.iter().enumerate().rev() {
        idx[axis] = flat % dim;
        flat /= dim;
    }
    idx
}

/// `t` with the same shape and values, stored with its axes reordered by
/// `perm` (which must be its own inverse), so the view is strided.
///
/// # Panics
///
/// If `perm` is not a permutation of `t`'s axes or the view comes out
/// contiguous (a size-1 axis).
pub fn strided_view(t: &Tensor, perm: &[usize]) -> Tensor {
    let stored = t.permuted(perm).expect("a permutation").to_contiguous();
    let view = stored.permuted(perm).expect("a permutation");
    assert_eq!(view.shape(), t.shape());
    assert!(!view.is_contiguous());
    view
}

/// What one cache element must hold after a call.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// The value.
    pub value: f64,
    /// The largest allowed `|got − value|`.
    pub tol: f64,
}

impl Expect {
    /// Exactly `value`.
    pub fn exact(value: f64) -> Self {
        Self { value, tol: 0.0 }
    }
}

/// Check the whole blocks tensor: every element in `expected` (keyed by
/// [`block_index`]) is finite and holds its value within its tolerance, and
/// every other element is byte-identical to `before` (the blocks' bytes
/// before the call).
///
/// # Panics
///
/// On the first element that breaks this (named by `ctx` and its index).
pub fn assert_cache(blocks: &Tensor, before: &[u8], expected: &HashMap<usize, Expect>, ctx: &str) {
    let shape = blocks.shape();
    let size = blocks.dtype().size_bytes();
    let now_bytes = blocks.as_bytes();
    assert_eq!(now_bytes.len(), before.len(), "{ctx}: blocks size changed");
    let values = blocks.to_f32_vec().expect("a float cache");
    for (i, &got) in values.iter().enumerate() {
        let bytes = i * size..(i + 1) * size;
        match expected.get(&i) {
            Some(e) => {
                let err = (got as f64 - e.value).abs();
                assert!(
                    got.is_finite() && err <= e.tol,
                    "{ctx}: blocks{:?} = {got}, expected {} (tol {}, err {err})",
                    unravel(shape, i),
                    e.value,
                    e.tol
                );
            }
            None => assert!(
                now_bytes[bytes.clone()] == before[bytes],
                "{ctx}: blocks{:?} = {got} was written, but the contract writes nothing there",
                unravel(shape, i)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_index_and_unravel_are_inverse() {
        let shape = blocks_shape(3, 2, 4, 2, 5);
        for flat in [0, 1, 17, 239] {
            let idx: [usize; 6] = unravel(&shape, flat).try_into().unwrap();
            assert_eq!(block_index(&shape, idx), flat);
        }
    }
}
