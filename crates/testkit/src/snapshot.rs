//! Byte snapshots and byte-for-byte comparisons: what a rejected call must
//! leave exactly as it was, and what two runs that must agree bit for bit
//! left behind. NaN poison compares equal to itself here (bytes, not values).

use kvjit_core::{PagedKVCacheCollection, Tensor};

use crate::{Caches, Tensors};

/// Everything a call may change in one cache, as bytes: blocks, an FP8
/// cache's scales, cache lengths, page table and the MAX scalars.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheSnapshot {
    /// The blocks' bytes.
    pub blocks: Vec<u8>,
    /// The scales' bytes (empty without scales).
    pub scales: Vec<u8>,
    /// Per-sequence cache lengths.
    pub cache_lengths: Vec<u32>,
    /// The page table.
    pub lookup_table: Vec<u32>,
    /// MAX's `max_seq_length`.
    pub max_seq_length: u32,
    /// MAX's `max_cache_length`.
    pub max_cache_length: u32,
}

impl CacheSnapshot {
    /// The cache as it is now.
    pub fn take(cache: &PagedKVCacheCollection) -> Self {
        Self {
            blocks: cache.blocks().as_bytes().to_vec(),
            scales: cache.scales().map(|s| s.as_bytes().to_vec()).unwrap_or_default(),
            cache_lengths: cache.cache_lengths().to_vec(),
            lookup_table: cache.lookup_table().to_vec(),
            max_seq_length: cache.max_seq_length,
            max_cache_length: cache.max_cache_length,
        }
    }

    /// Panics (naming `what` and the part that changed) unless `cache` is
    /// byte-identical to the snapshot.
    pub fn assert_unchanged(&self, cache: &PagedKVCacheCollection, what: &str) {
        let now = Self::take(cache);
        assert!(now.blocks == self.blocks, "{what}: cache blocks changed by a rejected call");
        assert!(now.scales == self.scales, "{what}: cache scales changed by a rejected call");
        assert_eq!(now.cache_lengths, self.cache_lengths, "{what}: cache_lengths");
        assert_eq!(now.lookup_table, self.lookup_table, "{what}: lookup_table");
        assert_eq!(now.max_seq_length, self.max_seq_length, "{what}: max_seq_length");
        assert_eq!(now.max_cache_length, self.max_cache_length, "{what}: max_cache_length");
    }
}

/// Everything a call with one output and one cache may not change when it
/// is rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The output's bytes.
    pub output: Vec<u8>,
    /// The cache.
    pub cache: CacheSnapshot,
}

impl Snapshot {
    /// Output and cache as they are now.
    pub fn take(output: &Tensor, cache: &PagedKVCacheCollection) -> Self {
        Self { output: output.as_bytes().to_vec(), cache: CacheSnapshot::take(cache) }
    }

    /// Panics (naming `what`) unless output and cache are byte-identical to
    /// the snapshot.
    pub fn assert_unchanged(&self, output: &Tensor, cache: &PagedKVCacheCollection, what: &str) {
        assert!(output.as_bytes() == self.output, "{what}: output bytes changed by a rejected call");
        self.cache.assert_unchanged(cache, what);
    }
}

/// Index of the first differing byte (or the shorter length), if any.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

/// Panics (naming `what`) unless `got` has `want`'s dtype, shape and bytes.
pub fn assert_tensors_identical(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (got, want) = (got.to_contiguous(), want.to_contiguous());
    if let Some(i) = first_difference(got.as_bytes(), want.as_bytes()) {
        panic!("{what}: bytes differ, first at byte {i}");
    }
}

/// Same names, each tensor byte-identical.
pub fn assert_outputs_identical(got: &Tensors, want: &Tensors) {
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "output names");
    for (name, tensor) in want {
        assert_tensors_identical(&format!("output '{name}'"), &got[name], tensor);
    }
}

/// Same cache names; each cache byte-identical: layout, blocks, lengths,
/// page table and the MAX scalars.
pub fn assert_caches_identical(got: &Caches, want: &Caches) {
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "cache names");
    for (name, want) in want {
        let got = &got[name];
        assert_eq!(got.params(), want.params(), "cache '{name}': layout");
        assert_tensors_identical(&format!("cache '{name}' blocks"), got.blocks(), want.blocks());
        if let (Some(got), Some(want)) = (got.scales(), want.scales()) {
            assert_tensors_identical(&format!("cache '{name}' scales"), got, want);
        }
        assert_eq!(got.cache_lengths(), want.cache_lengths(), "cache '{name}': cache_lengths");
        assert_eq!(got.lookup_table(), want.lookup_table(), "cache '{name}': lookup_table");
        assert_eq!(
            (got.max_seq_length, got.max_cache_length),
            (want.max_seq_length, want.max_cache_length),
            "cache '{name}': max_seq_length, max_cache_length"
        );
    }
}

/// Whether two sets of caches have the same names and byte-identical
/// contents ([`CacheSnapshot`]s), without panicking.
pub fn caches_identical(a: &Caches, b: &Caches) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|((na, ca), (nb, cb))| na == nb && CacheSnapshot::take(ca) == CacheSnapshot::take(cb))
}

#[cfg(test)]
mod tests {
    use kvjit_core::{DType, KvCacheParams};

    use kvjit_core::CacheElement;

    use super::*;

    fn cache() -> PagedKVCacheCollection {
        let params =
            KvCacheParams { element: CacheElement::F16, num_layers: 1, page_size: 2, num_kv_heads: 1, head_size: 2 };
        PagedKVCacheCollection::new(params, 4, 2, 2).unwrap()
    }

    #[test]
    fn snapshots_see_every_part_of_a_cache() {
        let (output, c) = (Tensor::zeros(DType::F32, &[2]).unwrap(), cache());
        let before = Snapshot::take(&output, &c);
        before.assert_unchanged(&output, &c, "untouched");
        let mut nan = c.clone();
        nan.fill_blocks_f32(f32::NAN).unwrap();
        assert_ne!(CacheSnapshot::take(&nan), before.cache);
        assert_eq!(CacheSnapshot::take(&nan), CacheSnapshot::take(&nan.clone()), "NaN bytes equal themselves");
        let mut longer = c.clone();
        longer.max_cache_length += 1;
        assert!(std::panic::catch_unwind(|| before.assert_unchanged(&output, &longer, "t")).is_err());
        let named = |c: &PagedKVCacheCollection| Caches::from([("kv".to_string(), c.clone())]);
        assert!(caches_identical(&named(&nan), &named(&nan)));
        assert!(!caches_identical(&named(&nan), &named(&c)));
    }

    #[test]
    fn first_difference_covers_lengths() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
    }
}
