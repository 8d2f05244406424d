//! Garbage collection: mark and sweep without persistent state. One pass lists every chunk, then every
//! manifest (in that order), reads the manifests to mark what is referenced, and deletes at most
//! `max_deletions` unreferenced chunks that are older than the grace period and not pinned by an upload of this
//! process. Any manifest that cannot be read stops the pass before it deletes anything. The README gives the
//! concurrency argument.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use futures::{StreamExt, TryStreamExt};

use crate::Store;
use crate::crypto::ChunkId;
use crate::error::StoreError;

/// Limits of one [`Store::gc`] pass.
#[derive(Clone, Debug)]
pub struct GcOptions {
    /// At most this many chunks deleted per pass (the rest are reported in [`GcReport::remaining`]).
    pub max_deletions: usize,
    /// Chunks younger than this (by the server's last-modified time) are kept even when unreferenced: they
    /// may belong to an upload of another process whose manifest is not written yet.
    pub grace: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            max_deletions: 10_000,
            grace: Duration::from_secs(24 * 3600),
        }
    }
}

/// What a GC pass saw and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Committed objects (manifests read).
    pub objects: usize,
    /// Chunks in the bucket at the start of the pass.
    pub chunks: usize,
    /// Distinct chunks referenced by some manifest.
    pub referenced: usize,
    /// Chunks deleted by this pass.
    pub deleted: usize,
    /// Stored bytes of the deleted chunks.
    pub deleted_bytes: u64,
    /// Unreferenced chunks kept because they are younger than the grace period.
    pub kept_young: usize,
    /// Unreferenced chunks kept because an upload of this process relies on them.
    pub kept_pinned: usize,
    /// Unreferenced, deletable chunks left for the next pass (the deletion budget ran out).
    pub remaining: usize,
}

impl Store {
    /// Runs one GC pass (see the module documentation). Call it periodically, and again while
    /// [`GcReport::remaining`] is non-zero.
    pub async fn gc(&self, options: &GcOptions) -> Result<GcReport, StoreError> {
        let remote = &self.inner.remote;
        // Chunks first: a chunk uploaded after this listing is not a candidate of this pass at all.
        let chunks = remote.list_chunks().await?;
        // From here on, chunks unpinned by committing uploads stay protected until the pass ends.
        let _pass = self.inner.pins.gc_begin();
        let manifests = remote.list_manifests(None).await?;
        let referenced = self
            .referenced(
                manifests
                    .iter()
                    .filter_map(|m| remote.name_of_manifest(&m.location)),
            )
            .await?;
        let mut report = GcReport {
            objects: manifests.len(),
            chunks: chunks.len(),
            referenced: referenced.len(),
            ..GcReport::default()
        };
        let now = SystemTime::now();
        for chunk in chunks {
            if referenced.contains(&chunk.id) {
                continue;
            }
            let age = now.duration_since(chunk.last_modified).unwrap_or_default();
            if age < options.grace {
                report.kept_young += 1;
                continue;
            }
            if report.deleted >= options.max_deletions {
                report.remaining += 1;
                continue;
            }
            if !self.inner.pins.claim_for_delete(chunk.id) {
                report.kept_pinned += 1;
                continue;
            }
            let result = remote.delete(&remote.chunk_key(&chunk.id)).await;
            self.inner.pins.release_delete(&chunk.id);
            result?;
            report.deleted += 1;
            report.deleted_bytes += chunk.size;
        }
        tracing::debug!(?report, "gc pass");
        Ok(report)
    }

    /// The chunk ids referenced by these objects' manifests. An object deleted meanwhile is skipped; any other
    /// failure to read a manifest fails the pass.
    async fn referenced(
        &self,
        names: impl Iterator<Item = crate::ObjectName>,
    ) -> Result<HashSet<ChunkId>, StoreError> {
        let concurrency = self.inner.config.concurrency.max(1);
        let mut manifests = futures::stream::iter(names)
            .map(|name| async move {
                match self.read_manifest(&name).await {
                    Ok(m) => Ok(Some(m)),
                    Err(StoreError::NotFound(_)) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(concurrency);
        let mut referenced = HashSet::new();
        while let Some(manifest) = manifests.try_next().await? {
            referenced.extend(manifest.iter().flat_map(|m| m.chunk_ids()));
        }
        Ok(referenced)
    }
}
