//! Download: fetch the manifest, fetch and verify chunks in parallel, write them into sparse files in a
//! temporary directory beside the destination, fsync, then rename it into place. Nothing appears at the
//! destination unless every chunk was verified.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::{StreamExt, TryStreamExt};
use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};

use crate::crypto::ChunkId;
use crate::error::StoreError;
use crate::manifest::Manifest;
use crate::name::ObjectName;
use crate::{Progress, ProgressFn, Store};

/// Granularity at which zeros inside a stored chunk are left as holes on restore (the page size).
const HOLE_BLOCK: usize = 4096;

/// What a download did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GetStats {
    /// The object's size.
    pub total_bytes: u64,
    /// Bytes of the chunks fetched (plaintext).
    pub downloaded_bytes: u64,
    /// Chunks fetched.
    pub chunks: u64,
    /// Bytes left as holes (all-zero chunks).
    pub zero_bytes: u64,
}

/// One chunk to fetch: which file, where, which id, how long.
struct Job {
    file: usize,
    offset: u64,
    len: usize,
    id: ChunkId,
}

impl Store {
    /// Restores the object `name` into the new directory `dest` (one file per file of the object; all-zero
    /// ranges stay holes). `dest` must not exist; its parent must. On any error (a missing or corrupted chunk
    /// is [`StoreError::ChunkMissing`] / [`StoreError::ChunkCorrupt`] naming the object and the chunk) nothing
    /// is left at `dest` or beside it.
    pub async fn get_object(
        &self,
        name: &str,
        dest: &Path,
        progress: Option<ProgressFn>,
    ) -> Result<GetStats, StoreError> {
        self.get_object_pinned(name, dest, progress, None).await
    }

    /// [`Store::get_object`], accepting only the version whose manifest digest is `pinned`
    /// ([`crate::PutStats::manifest_digest`]). Chunks are named by their content, so a pinned manifest pins
    /// every byte: whoever can write the bucket (without the encryption key) cannot substitute another
    /// version or forged files. Another digest is [`StoreError::ManifestCorrupt`].
    pub async fn get_object_pinned(
        &self,
        name: &str,
        dest: &Path,
        progress: Option<ProgressFn>,
        pinned: Option<&str>,
    ) -> Result<GetStats, StoreError> {
        let name = ObjectName::new(name)?;
        let (manifest, digest) = self.read_manifest_with_digest(&name).await?;
        if let Some(want) = pinned
            && !want.eq_ignore_ascii_case(&digest)
        {
            return Err(StoreError::ManifestCorrupt {
                object: name.to_string(),
                reason: format!(
                    "its manifest is not the version this host committed (sha256 {digest}, expected {want})"
                ),
            });
        }
        if tokio::fs::symlink_metadata(dest).await.is_ok() {
            return Err(StoreError::DestinationExists(dest.to_owned()));
        }
        let staging = Staging::create(dest).await?;
        let files = {
            let (dir, manifest) = (staging.dir.clone(), manifest.clone());
            blocking(move || create_files(&dir, &manifest)).await?
        };
        let stats = self
            .fetch_chunks(&name, &manifest, &files, &staging.dir, progress)
            .await?;
        let dir = staging.dir.clone();
        let dest_owned = dest.to_owned();
        blocking(move || {
            for f in files.iter() {
                f.sync_all().map_err(|e| StoreError::io(&dir, e))?;
            }
            sync_dir(&dir)?;
            // RENAME_NOREPLACE: never replace a destination that appeared meanwhile.
            renameat2(
                AT_FDCWD,
                &dir,
                AT_FDCWD,
                &dest_owned,
                RenameFlags::RENAME_NOREPLACE,
            )
            .map_err(|e| StoreError::io(&dest_owned, e.into()))?;
            sync_dir(parent_of(&dest_owned))
        })
        .await?;
        staging.disarm();
        Ok(stats)
    }

    async fn fetch_chunks(
        &self,
        name: &ObjectName,
        manifest: &Manifest,
        files: &Arc<Vec<File>>,
        dir: &Path,
        progress: Option<ProgressFn>,
    ) -> Result<GetStats, StoreError> {
        let chunk_size = manifest.chunk_size;
        let mut stats = GetStats {
            total_bytes: manifest.total_bytes,
            ..GetStats::default()
        };
        let mut jobs = Vec::new();
        for (file, entry) in manifest.files.iter().enumerate() {
            for (i, chunk) in entry.chunks.iter().enumerate() {
                let offset = i as u64 * chunk_size;
                let len = chunk_size.min(entry.size - offset);
                match chunk.as_deref().and_then(ChunkId::parse) {
                    Some(id) => jobs.push(Job {
                        file,
                        offset,
                        len: len as usize,
                        id,
                    }),
                    None => stats.zero_bytes += len,
                }
            }
        }
        let done = AtomicU64::new(stats.zero_bytes);
        let report = |bytes: u64| {
            let d = done.fetch_add(bytes, Ordering::Relaxed) + bytes;
            if let Some(f) = &progress {
                f(Progress {
                    done_bytes: d,
                    total_bytes: manifest.total_bytes,
                });
            }
        };
        report(0);
        let concurrency = self.inner.config.concurrency.max(1);
        let mut fetched = futures::stream::iter(jobs)
            .map(|job| self.fetch_one(name, job, files, dir))
            .buffer_unordered(concurrency);
        while let Some(len) = fetched.try_next().await? {
            stats.downloaded_bytes += len as u64;
            stats.chunks += 1;
            report(len as u64);
        }
        Ok(stats)
    }

    async fn fetch_one(
        &self,
        name: &ObjectName,
        job: Job,
        files: &Arc<Vec<File>>,
        dir: &Path,
    ) -> Result<usize, StoreError> {
        let remote = &self.inner.remote;
        let stored =
            remote
                .get(&remote.chunk_key(&job.id))
                .await?
                .ok_or_else(|| StoreError::ChunkMissing {
                    object: name.to_string(),
                    chunk: job.id.to_hex(),
                })?;
        let (inner, files, dir) = (self.inner.clone(), files.clone(), dir.to_owned());
        let object = name.to_string();
        blocking(move || {
            let plain = inner
                .codec
                .decode_chunk(&job.id, stored, job.len)
                .map_err(|reason| StoreError::ChunkCorrupt {
                    object,
                    chunk: job.id.to_hex(),
                    reason,
                })?;
            write_sparse(&files[job.file], job.offset, &plain).map_err(|e| StoreError::io(&dir, e))?;
            Ok(job.len)
        })
        .await
    }
}

/// Creates the object's files at their full size (sparse: nothing allocated yet).
fn create_files(dir: &Path, manifest: &Manifest) -> Result<Arc<Vec<File>>, StoreError> {
    let mut files = Vec::with_capacity(manifest.files.len());
    for entry in &manifest.files {
        // `entry.name` was checked by `Manifest::validate`: one plain segment.
        let path = dir.join(&entry.name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| StoreError::io(&path, e))?;
        file.set_len(entry.size).map_err(|e| StoreError::io(&path, e))?;
        files.push(file);
    }
    Ok(Arc::new(files))
}

/// Writes `data` at `offset`, skipping all-zero pages so they stay holes.
fn write_sparse(file: &File, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let mut start = 0;
    while start < data.len() {
        // Skip zero pages, then write the following run of non-zero pages in one call.
        while start < data.len() && crate::upload::is_zero(&data[start..(start + HOLE_BLOCK).min(data.len())])
        {
            start += HOLE_BLOCK;
        }
        let mut end = start;
        while end < data.len() && !crate::upload::is_zero(&data[end..(end + HOLE_BLOCK).min(data.len())]) {
            end += HOLE_BLOCK;
        }
        let end = end.min(data.len());
        if start < end {
            file.write_all_at(&data[start..end], offset + start as u64)?;
        }
        start = end;
    }
    Ok(())
}

/// The directory holding `path` (`.` for a bare relative name).
fn parent_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(dir, e))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .expect("file work does not panic")
}

/// The temporary directory a download fills, beside the destination; removed on drop unless disarmed.
struct Staging {
    dir: PathBuf,
    armed: bool,
}

impl Staging {
    async fn create(dest: &Path) -> Result<Staging, StoreError> {
        let parent = parent_of(dest);
        let leaf = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let dir = parent.join(format!(".{leaf}.partial-{:016x}", rand::random::<u64>()));
        tokio::fs::create_dir(&dir)
            .await
            .map_err(|e| StoreError::io(&dir, e))?;
        Ok(Staging { dir, armed: true })
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
