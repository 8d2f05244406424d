//! READ: ranged GETs in blocks of [`BLOCK`] bytes through a small cache shared by the export's files, with the
//! next block fetched ahead while a file is read in order. A block is fetched once however many READs wait for
//! it; the cache holds at most [`CACHE_BLOCKS`] blocks (least recently used go first).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::OnceCell;

use super::{Export, FsResult, Kind, Status, add};

/// Size of a cached block.
pub const BLOCK: u64 = 2 << 20;
/// Blocks kept per export (32 MiB).
pub const CACHE_BLOCKS: usize = 16;

struct Slot {
    data: OnceCell<Bytes>,
    used: AtomicU64,
}

#[derive(Default)]
pub struct BlockCache {
    slots: Mutex<HashMap<(u64, u64), Arc<Slot>>>,
    clock: AtomicU64,
}

impl BlockCache {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<(u64, u64), Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, id: u64, block: u64) -> Arc<Slot> {
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut slots = self.slots();
        let slot = slots
            .entry((id, block))
            .or_insert_with(|| {
                Arc::new(Slot {
                    data: OnceCell::new(),
                    used: AtomicU64::new(now),
                })
            })
            .clone();
        slot.used.store(now, Ordering::Relaxed);
        while slots.len() > CACHE_BLOCKS {
            let oldest = slots
                .iter()
                .filter(|(k, _)| **k != (id, block))
                .min_by_key(|(_, s)| s.used.load(Ordering::Relaxed))
                .map(|(k, _)| *k);
            match oldest {
                Some(k) => slots.remove(&k),
                None => break,
            };
        }
        slot
    }

    fn cached(&self, id: u64, block: u64) -> bool {
        self.slots()
            .get(&(id, block))
            .is_some_and(|s| s.data.initialized())
    }

    /// Drops every block of file `id` (it changed).
    pub fn forget(&self, id: u64) {
        self.slots().retain(|(f, _), _| *f != id);
    }

    /// Number of blocks held (tests).
    pub fn len(&self) -> usize {
        self.slots().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Export {
    /// READ: up to `count` bytes at `offset`, and whether the end of the file was reached.
    pub async fn read(self: &Arc<Self>, id: u64, offset: u64, count: u32) -> FsResult<(Bytes, bool)> {
        if let Some(r) = self.dirty.read(id, offset, count).await {
            let (data, eof) = r?;
            add(&self.counters.bytes_read, data.len());
            return Ok((data, eof));
        }
        let attr = self.getattr(id).await?;
        if attr.kind == Kind::Dir {
            return Err(Status::IsDir);
        }
        let size = attr.size;
        if offset >= size {
            return Ok((Bytes::new(), true));
        }
        let end = offset.saturating_add(u64::from(count)).min(size);
        let path = self.path_of(id)?;
        let key = self.key(&path);
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut at = offset;
        while at < end {
            let b = at / BLOCK;
            let data = self.block(id, &key, b, size).await?;
            let from = (at - b * BLOCK) as usize;
            let to = ((end - b * BLOCK) as usize).min(data.len());
            if from >= to {
                // The object shrank under us: what is there is all there is.
                break;
            }
            out.extend_from_slice(&data[from..to]);
            at = b * BLOCK + to as u64;
        }
        let next = end.div_ceil(BLOCK);
        if next * BLOCK < size && !self.cache.cached(id, next) {
            let this = self.clone();
            tokio::spawn(async move {
                let _ = this.block(id, &key, next, size).await;
            });
        }
        add(&self.counters.bytes_read, out.len());
        let eof = offset + out.len() as u64 >= size;
        Ok((Bytes::from(out), eof))
    }

    async fn block(&self, id: u64, key: &str, b: u64, size: u64) -> FsResult<Bytes> {
        let slot = self.cache.slot(id, b);
        let range = b * BLOCK..((b + 1) * BLOCK).min(size);
        let data = slot
            .data
            .get_or_try_init(|| async {
                let (data, meta) = self.bucket.get_range(key, range).await?;
                if meta.size != size {
                    // Replaced since its attributes were read: take the new attributes (drops stale blocks).
                    self.cache_file(id, &meta);
                }
                Ok::<_, Status>(data)
            })
            .await?;
        Ok(data.clone())
    }
}
