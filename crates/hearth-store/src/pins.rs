//! In-process coordination between uploads and garbage collection.
//!
//! An upload pins a chunk id *before* it asks whether the chunk exists, and keeps it pinned until its manifest
//! is written (or the upload fails or is dropped). GC claims a chunk for deletion only if nobody pins it, and
//! while a chunk is claimed a new pin waits for the deletion to finish (after which the upload sees the chunk
//! missing and uploads it again). So "exists, therefore I reuse it" can never race with "unreferenced,
//! therefore I delete it" inside one process.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::crypto::ChunkId;

/// Entries kept in the index of chunks known to be in the bucket before it is cleared (about 64 MiB).
const KNOWN_MAX: usize = 1 << 20;
/// How long "this chunk is in the bucket" is trusted without asking again: short, so that a chunk another
/// process's GC removed is soon noticed (see the README's GC rules).
const KNOWN_TTL: Duration = Duration::from_secs(600);

#[derive(Default)]
pub(crate) struct Pins {
    state: Mutex<PinState>,
    released: Notify,
}

#[derive(Default)]
struct PinState {
    counts: HashMap<ChunkId, usize>,
    deleting: HashSet<ChunkId>,
    /// Chunks this process saw in the bucket (uploaded or HEAD-found) and when, so re-saves skip the HEAD.
    known: HashMap<ChunkId, Instant>,
    /// GC passes running; while any runs, chunks unpinned since it began stay protected (their manifest may
    /// have been committed after the pass listed the manifests).
    gc_active: usize,
    released_during_gc: HashSet<ChunkId>,
}

impl Pins {
    fn lock(&self) -> MutexGuard<'_, PinState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Pins `id` (waiting while GC deletes it) and returns whether it is known to be in the bucket.
    pub(crate) async fn pin(&self, id: ChunkId) -> bool {
        loop {
            let released = self.released.notified();
            {
                let mut state = self.lock();
                if !state.deleting.contains(&id) {
                    *state.counts.entry(id).or_insert(0) += 1;
                    return state.known.get(&id).is_some_and(|t| t.elapsed() < KNOWN_TTL);
                }
            }
            released.await;
        }
    }

    pub(crate) fn unpin(&self, id: &ChunkId) {
        let mut state = self.lock();
        if let Some(n) = state.counts.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                state.counts.remove(id);
                if state.gc_active > 0 {
                    state.released_during_gc.insert(*id);
                }
            }
        }
    }

    pub(crate) fn mark_known(&self, id: ChunkId) {
        let mut state = self.lock();
        if state.known.len() >= KNOWN_MAX {
            state.known.clear();
        }
        state.known.insert(id, Instant::now());
    }

    /// Starts a GC pass; call before listing the manifests. The pass ends when the guard drops.
    pub(crate) fn gc_begin(self: &Arc<Self>) -> GcPass {
        self.lock().gc_active += 1;
        GcPass(self.clone())
    }

    /// Claims an unpinned chunk for deletion (and forgets it is known); `false` if some upload pins it.
    pub(crate) fn claim_for_delete(&self, id: ChunkId) -> bool {
        let mut state = self.lock();
        if state.counts.contains_key(&id) || state.released_during_gc.contains(&id) {
            return false;
        }
        state.known.remove(&id);
        state.deleting.insert(id);
        true
    }

    /// Ends a deletion claim (whether the DELETE succeeded or not) and wakes waiting pins.
    pub(crate) fn release_delete(&self, id: &ChunkId) {
        self.lock().deleting.remove(id);
        self.released.notify_waiters();
    }

    #[cfg(test)]
    fn pinned(&self, id: &ChunkId) -> bool {
        self.lock().counts.contains_key(id)
    }
}

/// A running GC pass (see [`Pins::gc_begin`]).
pub(crate) struct GcPass(Arc<Pins>);

impl Drop for GcPass {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.gc_active -= 1;
        if state.gc_active == 0 {
            state.released_during_gc.clear();
        }
    }
}

/// The pins of one upload, released on drop (commit, error or a dropped future alike).
pub(crate) struct PinGuard {
    pins: Arc<Pins>,
    ids: Mutex<Vec<ChunkId>>,
}

impl PinGuard {
    pub(crate) fn new(pins: Arc<Pins>) -> PinGuard {
        PinGuard {
            pins,
            ids: Mutex::new(Vec::new()),
        }
    }

    /// Pins `id` for the life of this guard; returns whether it is known to be in the bucket.
    pub(crate) async fn pin(&self, id: ChunkId) -> bool {
        let known = self.pins.pin(id).await;
        self.ids.lock().unwrap_or_else(PoisonError::into_inner).push(id);
        known
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut *self.ids.lock().unwrap_or_else(PoisonError::into_inner));
        for id in &ids {
            self.pins.unpin(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pins_block_deletion_and_deletion_delays_pins() {
        let pins = Arc::new(Pins::default());
        let a = ChunkId([1; 32]);
        {
            let guard = PinGuard::new(pins.clone());
            assert!(!guard.pin(a).await);
            assert!(!pins.claim_for_delete(a), "pinned chunks are not deleted");
        }
        assert!(!pins.pinned(&a), "the guard unpins on drop");
        pins.mark_known(a);
        assert!(pins.claim_for_delete(a));
        let waiter = {
            let pins = pins.clone();
            tokio::spawn(async move {
                let guard = PinGuard::new(pins);
                let known = guard.pin(a).await;
                (known, guard)
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "a pin waits while the chunk is being deleted"
        );
        pins.release_delete(&a);
        let (known, _guard) = waiter.await.expect("join");
        assert!(!known, "a deleted chunk is no longer known");
        assert!(pins.pinned(&a));
    }

    #[tokio::test]
    async fn a_chunk_unpinned_during_a_gc_pass_stays_protected() {
        let pins = Arc::new(Pins::default());
        let a = ChunkId([2; 32]);
        let guard = PinGuard::new(pins.clone());
        guard.pin(a).await;
        let pass = pins.gc_begin();
        drop(guard); // the upload commits its manifest after the pass listed the manifests
        assert!(!pins.claim_for_delete(a));
        drop(pass);
        assert!(
            pins.claim_for_delete(a),
            "the next pass sees the manifest, so the claim is safe to ask for"
        );
    }
}
