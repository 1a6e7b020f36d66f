//! The device-side KV cache: a device copy of a host
//! [`PagedKVCacheCollection`]'s blocks (and, for an FP8 cache, its f32
//! scales: [`DeviceKvCache`]), kept across calls and steps, that every op's
//! CUDA kernels read and write ([`CudaDevice::with_kv_cache`]).
//!
//! **When the copy is current.** A copy is keyed by the host cache's
//! [`blocks_id`](PagedKVCacheCollection::blocks_id) (unique per cache
//! instance) and a layout tag the op picks, and remembers the host cache's
//! [`blocks_generation`](PagedKVCacheCollection::blocks_generation) it
//! matches. The host bumps the generation whenever its blocks are borrowed
//! for writing — the scales included (`set_scales`, `blocks_and_scales_mut`,
//! `fill_scales`) — so any host-side write (a CPU kernel, a caller's edit,
//! `set_blocks`) makes the copy stale, and the next use uploads the blocks
//! and scales again before the kernel runs. A CUDA kernel that wrote the device copy
//! and mirrored the same rows into the host calls
//! [`CudaDevice::kv_cache_synced`] afterwards, so its own write does not
//! count as a host edit. (The tracking is per cache, not per page: after a
//! host edit the whole cache is uploaded again, which is correct and, for
//! caches edited only by kernels, never happens.)
//!
//! **Failures.** A copy whose update failed half-way is dropped, so the next
//! call starts from the host again. At most
//! [`MAX_KV_CACHES`](CudaDevice::MAX_KV_CACHES) copies are kept per device;
//! the least recently used one is freed first.

use kvjit_core::PagedKVCacheCollection;

use crate::{CudaDevice, CudaError, DeviceBuffer, Result};

/// The device copy of one cache: its blocks, and the scales of an FP8 cache
/// (`[P, 2, L, page_size, Hkv, D / g]` f32, `None` for other dtypes), each
/// the whole host tensor's bytes.
#[derive(Debug)]
pub struct DeviceKvCache {
    /// The blocks `[P, 2, L, page_size, Hkv, D]`.
    pub blocks: DeviceBuffer,
    /// The scales of an FP8 cache.
    pub scales: Option<DeviceBuffer>,
}

/// The table of device copies (generic over the buffer so its bookkeeping is
/// tested without a GPU).
pub(crate) struct KvCacheTable<B> {
    entries: Vec<Entry<B>>,
    clock: u64,
    uploads: u64,
}

struct Entry<B> {
    cache_id: u64,
    tag: u64,
    generation: u64,
    buffer: B,
    last_used: u64,
}

impl<B> Default for KvCacheTable<B> {
    fn default() -> Self {
        Self { entries: Vec::new(), clock: 0, uploads: 0 }
    }
}

impl<B> KvCacheTable<B> {
    /// Run `f` on the copy of (`cache_id`, `tag`), first making it current
    /// for `generation`: `alloc` makes a buffer for a new copy (evicting the
    /// least recently used one beyond `capacity`), `upload` fills a new or
    /// stale one from the host. A failure anywhere drops the copy.
    pub(crate) fn with<R>(
        &mut self,
        (cache_id, tag, generation): (u64, u64, u64),
        capacity: usize,
        alloc: impl FnOnce() -> Result<B>,
        upload: impl FnOnce(&mut B) -> Result<()>,
        f: impl FnOnce(&mut B) -> Result<R>,
    ) -> Result<R> {
        self.clock += 1;
        let now = self.clock;
        let index = match self.entries.iter().position(|e| e.cache_id == cache_id && e.tag == tag) {
            Some(index) => index,
            None => {
                if self.entries.len() >= capacity {
                    let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("full");
                    self.entries.swap_remove(oldest);
                }
                let buffer = alloc()?;
                // u64::MAX: never current, so the upload below runs.
                self.entries.push(Entry { cache_id, tag, generation: u64::MAX, buffer, last_used: now });
                self.entries.len() - 1
            }
        };
        let entry = &mut self.entries[index];
        entry.last_used = now;
        if entry.generation != generation {
            self.uploads += 1;
            if let Err(e) = upload(&mut entry.buffer) {
                self.entries.swap_remove(index);
                return Err(e);
            }
            entry.generation = generation;
        }
        let result = f(&mut self.entries[index].buffer);
        if result.is_err() {
            self.entries.swap_remove(index);
        }
        result
    }

    /// Record that the copy of (`cache_id`, `tag`) matches the host at
    /// `generation` (after a kernel wrote both the same way).
    pub(crate) fn synced(&mut self, cache_id: u64, tag: u64, generation: u64) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.cache_id == cache_id && e.tag == tag) {
            e.generation = generation;
        }
    }

    /// Drop the copy of (`cache_id`, `tag`), if any.
    pub(crate) fn forget(&mut self, cache_id: u64, tag: u64) {
        self.entries.retain(|e| !(e.cache_id == cache_id && e.tag == tag));
    }
}

impl CudaDevice {
    /// Device copies of KV caches kept per device.
    pub const MAX_KV_CACHES: usize = 8;

    /// Run `f` on the device copy of `cache` (its blocks, and its scales if
    /// it is an FP8 cache) under layout `tag`, uploading both first when the
    /// copy is new or the host wrote them since (see the module docs). If
    /// `f` fails the copy is dropped.
    pub fn with_kv_cache<R>(
        &self,
        cache: &PagedKVCacheCollection,
        tag: u64,
        f: impl FnOnce(&mut DeviceKvCache) -> Result<R>,
    ) -> Result<R> {
        let host = cache.blocks().as_bytes();
        let host_scales = cache.scales().map(|s| s.as_bytes());
        let version = (cache.blocks_id(), tag, cache.blocks_generation());
        self.kv_caches().with(
            version,
            Self::MAX_KV_CACHES,
            || {
                Ok(DeviceKvCache {
                    blocks: self.alloc(host.len())?,
                    scales: host_scales.map(|s| self.alloc(s.len())).transpose()?,
                })
            },
            |copy| {
                self.upload(host, &mut copy.blocks)?;
                match (host_scales, copy.scales.as_mut()) {
                    (Some(host), Some(device)) => self.upload(host, device),
                    (None, None) => Ok(()),
                    // A cache keeps its dtype for life, and the tag names the layout.
                    _ => Err(CudaError::Unavailable(
                        "the device copy of a KV cache and the cache disagree on having scales".into(),
                    )),
                }
            },
            f,
        )
    }

    /// Record that the device copy of `cache` (layout `tag`) matches the host
    /// blocks as they are now: call it after a kernel wrote the device copy
    /// and the same rows were written into the host blocks.
    pub fn kv_cache_synced(&self, cache: &PagedKVCacheCollection, tag: u64) {
        self.kv_caches().synced(cache.blocks_id(), tag, cache.blocks_generation());
    }

    /// Drop the device copy of `cache` (layout `tag`), if any.
    pub fn forget_kv_cache(&self, cache: &PagedKVCacheCollection, tag: u64) {
        self.kv_caches().forget(cache.blocks_id(), tag);
    }

    /// Whole-cache uploads so far (new copies and stale ones), for tests and
    /// the GPU check.
    pub fn kv_cache_uploads(&self) -> u64 {
        self.kv_caches().uploads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CudaError;

    type Table = KvCacheTable<Vec<u8>>;

    /// One use of the table with a host of `host` bytes; returns what `f` saw.
    fn use_copy(table: &mut Table, key: (u64, u64, u64), host: &[u8]) -> Result<Vec<u8>> {
        table.with(
            key,
            2,
            || Ok(vec![0; host.len()]),
            |b| {
                b.copy_from_slice(host);
                Ok(())
            },
            |b| Ok(b.clone()),
        )
    }

    #[test]
    fn a_copy_is_uploaded_once_and_again_only_after_a_host_write() {
        let mut table = Table::default();
        assert_eq!(use_copy(&mut table, (1, 0, 0), &[1, 2]).unwrap(), [1, 2]);
        assert_eq!(use_copy(&mut table, (1, 0, 0), &[9, 9]).unwrap(), [1, 2], "current: no upload");
        assert_eq!(table.uploads, 1);
        assert_eq!(use_copy(&mut table, (1, 0, 1), &[3, 4]).unwrap(), [3, 4], "host wrote: uploaded again");
        // A kernel wrote both copies; the host's generation moved to 2.
        table
            .with(
                (1, 0, 1),
                2,
                || unreachable!(),
                |_| unreachable!(),
                |b| {
                    b[0] = 7;
                    Ok(())
                },
            )
            .unwrap();
        table.synced(1, 0, 2);
        assert_eq!(use_copy(&mut table, (1, 0, 2), &[0, 0]).unwrap(), [7, 4], "synced: the device copy stays");
        assert_eq!(table.uploads, 2);
    }

    #[test]
    fn caches_and_layouts_get_their_own_copies_and_the_oldest_is_evicted() {
        let mut table = Table::default();
        use_copy(&mut table, (1, 0, 0), &[1]).unwrap();
        use_copy(&mut table, (1, 5, 0), &[2]).unwrap();
        use_copy(&mut table, (1, 0, 0), &[0]).unwrap(); // (1, 5) is now the oldest
        use_copy(&mut table, (2, 0, 0), &[3]).unwrap();
        assert_eq!(table.entries.len(), 2);
        assert!(table.entries.iter().all(|e| (e.cache_id, e.tag) != (1, 5)));
        assert_eq!(table.uploads, 3);
    }

    #[test]
    fn a_failed_use_drops_the_copy() {
        let mut table = Table::default();
        use_copy(&mut table, (1, 0, 0), &[1]).unwrap();
        let failed: Result<()> = table.with(
            (1, 0, 0),
            2,
            || unreachable!(),
            |_| unreachable!(),
            |_| Err(CudaError::Unavailable("x".into())),
        );
        assert!(failed.is_err());
        assert!(table.entries.is_empty());
        let failed: Result<()> =
            table.with((1, 0, 0), 2, || Ok(vec![0]), |_| Err(CudaError::Unavailable("upload".into())), |_| Ok(()));
        assert!(failed.is_err() && table.entries.is_empty(), "a failed upload keeps nothing");
    }
}
