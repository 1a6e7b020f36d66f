//! Helpers shared by the fused-QKV integration tests: building caches and
//! small tensors, poisoning buffers, snapshotting them, and checking a cache
//! element by element against an expectation (with every element that is not
//! expected to change compared byte for byte against its poisoned copy).
//!
//! Every test file uses a different subset of these helpers.
#![allow(dead_code)]

use std::collections::HashMap;

use kvjit_core::{DType, PagedKVCacheCollection, Tensor};

/// A `[len]` u32 tensor (valid lengths and friends).
pub fn u32s(values: &[u32]) -> Tensor {
    Tensor::from_vec(&[values.len()], values.to_vec()).unwrap()
}

/// The contract's blocks shape `[P, 2, L, page_size, Hkv, D]`.
pub fn blocks_shape(num_pages: usize, layers: usize, page_size: usize, hkv: usize, d: usize) -> [usize; 6] {
    [num_pages, 2, layers, page_size, hkv, d]
}

/// A zeroed cache assembled from an explicit page table and cache lengths.
pub fn cache_from_table(
    cache_dtype: DType,
    shape: [usize; 6],
    cache_lengths: &[u32],
    table: &[u32],
    max_pages_per_seq: usize,
) -> PagedKVCacheCollection {
    let blocks = Tensor::zeros(cache_dtype, &shape).unwrap();
    PagedKVCacheCollection::from_parts(blocks, cache_lengths.to_vec(), table.to_vec(), max_pages_per_seq).unwrap()
}

/// Row-major index of `[page, kv, layer, slot, head, d]` in blocks of `shape`
/// (written out here, independently of the library's `element_offset`).
pub fn block_index(shape: &[usize], idx: [usize; 6]) -> usize {
    assert_eq!(shape.len(), 6);
    shape.iter().zip(idx).fold(0, |acc, (&dim, i)| {
        assert!(i < dim, "index {idx:?} outside blocks {shape:?}");
        acc * dim + i
    })
}

/// The inverse of [`block_index`], for failure messages.
pub fn unravel(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (axis, &dim) in shape.iter().enumerate().rev() {
        idx[axis] = flat % dim;
        flat /= dim;
    }
    idx
}

/// Fill every element of a float tensor with NaN.
pub fn poison(t: &mut Tensor) {
    t.fill_f32(f32::NAN).unwrap();
}

/// Fill the output and the whole cache with NaN; return the poisoned cache
/// bytes (what every untouched cache byte must still be afterwards).
pub fn poison_all(output: &mut Tensor, cache: &mut PagedKVCacheCollection) -> Vec<u8> {
    poison(output);
    cache.fill_blocks_f32(f32::NAN).unwrap();
    cache.blocks().as_bytes().to_vec()
}

/// Everything a call may not change when it is rejected.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub output: Vec<u8>,
    pub blocks: Vec<u8>,
    pub cache_lengths: Vec<u32>,
    pub lookup_table: Vec<u32>,
    pub max_seq_length: u32,
    pub max_cache_length: u32,
}

impl Snapshot {
    pub fn take(output: &Tensor, cache: &PagedKVCacheCollection) -> Self {
        Self {
            output: output.as_bytes().to_vec(),
            blocks: cache.blocks().as_bytes().to_vec(),
            cache_lengths: cache.cache_lengths().to_vec(),
            lookup_table: cache.lookup_table().to_vec(),
            max_seq_length: cache.max_seq_length,
            max_cache_length: cache.max_cache_length,
        }
    }

    /// Panics (naming `what`) unless output and cache are byte-identical to
    /// the snapshot.
    pub fn assert_unchanged(&self, output: &Tensor, cache: &PagedKVCacheCollection, what: &str) {
        let now = Self::take(output, cache);
        assert!(now.output == self.output, "{what}: output bytes changed by a rejected call");
        assert!(now.blocks == self.blocks, "{what}: cache blocks changed by a rejected call");
        assert_eq!(now.cache_lengths, self.cache_lengths, "{what}: cache_lengths");
        assert_eq!(now.lookup_table, self.lookup_table, "{what}: lookup_table");
        assert_eq!(now.max_seq_length, self.max_seq_length, "{what}: max_seq_length");
        assert_eq!(now.max_cache_length, self.max_cache_length, "{what}: max_cache_length");
    }
}

/// What one cache element must hold after a call.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    pub value: f64,
    pub tol: f64,
}

impl Expect {
    pub fn exact(value: f64) -> Self {
        Self { value, tol: 0.0 }
    }
}

/// Check the whole blocks tensor: every element in `expected` (keyed by
/// [`block_index`]) holds its value within its tolerance, and every other
/// element is byte-identical to `before` (the blocks' bytes before the call).
pub fn assert_cache(blocks: &Tensor, before: &[u8], expected: &HashMap<usize, Expect>, ctx: &str) {
    let shape = blocks.shape();
    let size = blocks.dtype().size_bytes();
    let now_bytes = blocks.as_bytes();
    assert_eq!(now_bytes.len(), before.len(), "{ctx}: blocks size changed");
    let values = blocks.to_f32_vec().unwrap();
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

/// The canary byte at position `i` of a guard region: position-dependent,
/// so a shifted or partial copy into a guard is caught too.
pub fn canary(i: usize) -> u8 {
    (i as u8).wrapping_mul(151).wrapping_add(0x3d)
}

/// `count` elements of `dtype` holding the quiet NaN `fill_f32(NaN)` writes.
pub fn nan_bytes(dtype: DType, count: usize) -> Vec<u8> {
    let mut t = Tensor::zeros(dtype, &[count]).unwrap();
    poison(&mut t);
    t.as_bytes().to_vec()
}

/// A byte buffer laid out `[front guard | body | back guard]`, the guards
/// filled with [`canary`] bytes: hand [`body_mut`](Self::body_mut) to a
/// kernel as its output, then [`assert_guards`](Self::assert_guards).
#[derive(Clone, Debug, PartialEq)]
pub struct Guarded {
    bytes: Vec<u8>,
    front: usize,
    body: usize,
}

impl Guarded {
    /// `front` canary bytes, a copy of `body`, `back` canary bytes.
    pub fn new(front: usize, body: &[u8], back: usize) -> Self {
        let mut bytes: Vec<u8> = (0..front + body.len() + back).map(canary).collect();
        bytes[front..front + body.len()].copy_from_slice(body);
        Self { bytes, front, body: body.len() }
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.bytes[self.front..self.front + self.body]
    }

    /// The body, writable.
    pub fn body_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.front..self.front + self.body]
    }

    /// Guards and body together.
    pub fn all(&self) -> &[u8] {
        &self.bytes
    }

    /// Panics (naming `what` and the first touched byte) unless both guards
    /// still hold their canary bytes.
    pub fn assert_guards(&self, what: &str) {
        let end = self.front + self.body;
        for (i, &byte) in self.bytes.iter().enumerate() {
            if (i < self.front || i >= end) && byte != canary(i) {
                let (side, at) = if i < self.front {
                    ("front", i as isize - self.front as isize)
                } else {
                    ("back", (i - end) as isize)
                };
                panic!("{what}: {side} guard byte at {at:+} from the output's edge was overwritten ({byte:#04x})");
            }
        }
    }
}

/// `t` with the same shape and values, stored with its axes reordered by
/// `perm` (which must be its own inverse), so the view is strided.
pub fn strided_view(t: &Tensor, perm: &[usize]) -> Tensor {
    let stored = t.permuted(perm).unwrap().to_contiguous();
    let view = stored.permuted(perm).unwrap();
    assert_eq!(view.shape(), t.shape());
    assert!(!view.is_contiguous());
    view
}
