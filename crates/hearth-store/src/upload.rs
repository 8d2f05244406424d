//! Upload: read files in fixed-size chunks (holes found with `SEEK_DATA` are not even read), hash them, skip
//! zero chunks and chunks already in the bucket, upload the rest with bounded concurrency, then write the
//! manifest: the commit.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use nix::unistd::{Whence, lseek};
use tokio::sync::mpsc;

use crate::crypto::ChunkId;
use crate::error::StoreError;
use crate::manifest::{FileEntry, MANIFEST_VERSION, Manifest};
use crate::name::{ObjectName, check_file_name};
use crate::pins::PinGuard;
use crate::{Inner, Progress, ProgressFn, Store};

/// One file to upload: its name inside the object and where to read it.
#[derive(Clone, Debug)]
pub struct FileSource {
    /// The file's name in the object (`[a-z0-9_-.]`, one segment).
    pub name: String,
    /// The local path to read.
    pub path: PathBuf,
}

impl FileSource {
    /// A file named `name` in the object, read from `path`.
    pub fn new(name: impl Into<String>, path: impl Into<PathBuf>) -> FileSource {
        FileSource {
            name: name.into(),
            path: path.into(),
        }
    }
}

/// Options of [`Store::put_object`].
#[derive(Clone, Default)]
pub struct PutOptions {
    /// Stored in the manifest as is.
    pub metadata: Option<serde_json::Value>,
    /// Called after each chunk.
    pub progress: Option<ProgressFn>,
}

/// What an upload did. Bytes are plaintext bytes of the files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutStats {
    /// The object's size (sum of its files).
    pub total_bytes: u64,
    /// Bytes of the chunks uploaded.
    pub uploaded_bytes: u64,
    /// Bytes of the chunks already in the bucket (not uploaded again).
    pub duplicate_bytes: u64,
    /// Bytes in all-zero chunks (never stored).
    pub zero_bytes: u64,
    /// Chunks uploaded.
    pub chunks_uploaded: u64,
    /// Chunks found in the bucket (or in this process's index of known chunks).
    pub chunk_hits: u64,
    /// All-zero chunks.
    pub zero_chunks: u64,
    /// Size of the manifest as stored.
    pub manifest_bytes: u64,
    /// SHA-256 (hex) of the committed manifest's plaintext: keep it where the bucket cannot change it and
    /// pass it to [`Store::get_object_pinned`] to accept only this version back.
    pub manifest_digest: String,
}

/// A chunk as read: its index in the file, its length and its id and bytes (`None` when all zero).
struct ReadChunk {
    index: usize,
    len: u64,
    content: Option<(ChunkId, Bytes)>,
}

enum Outcome {
    Zero,
    Hit,
    Uploaded,
}

impl Store {
    /// Uploads `files` as the object `name` and commits it by writing its manifest last; an existing object
    /// of that name is replaced only at that moment. If this fails or the future is dropped, the previous
    /// manifest (or none) stays committed, and calling again sends only the chunks still missing. A retryable
    /// error ([`StoreError::is_retryable`]) means the bucket is unreachable or failing: keep the upload pending.
    pub async fn put_object(
        &self,
        name: &str,
        files: &[FileSource],
        options: PutOptions,
    ) -> Result<PutStats, StoreError> {
        let name = ObjectName::new(name)?;
        let mut sizes = Vec::with_capacity(files.len());
        for (i, f) in files.iter().enumerate() {
            check_file_name(name.as_str(), &f.name)?;
            if files[..i].iter().any(|g| g.name == f.name) {
                return Err(StoreError::DuplicateFileName {
                    object: name.to_string(),
                    name: f.name.clone(),
                });
            }
            let meta = tokio::fs::metadata(&f.path)
                .await
                .map_err(|e| StoreError::io(&f.path, e))?;
            if !meta.is_file() {
                let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
                return Err(StoreError::io(&f.path, e));
            }
            sizes.push(meta.len());
        }
        let total_bytes = sizes.iter().sum();
        let guard = PinGuard::new(self.inner.pins.clone());
        let progress = ProgressState {
            done: AtomicU64::new(0),
            total: total_bytes,
            callback: options.progress.clone(),
        };
        let mut stats = PutStats {
            total_bytes,
            ..PutStats::default()
        };
        let mut entries = Vec::with_capacity(files.len());
        for (file, size) in files.iter().zip(sizes) {
            let chunks = self.put_file(file, size, &guard, &progress, &mut stats).await?;
            entries.push(FileEntry {
                name: file.name.clone(),
                size,
                chunks,
            });
        }
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            name: name.to_string(),
            created: now_rfc3339(),
            chunk_size: self.inner.config.chunk_size as u64,
            total_bytes,
            files: entries,
            metadata: options.metadata,
        };
        let json = serde_json::to_vec(&manifest).expect("a manifest serializes");
        stats.manifest_digest = crate::manifest::digest_hex(&json);
        let stored = self.inner.codec.encode_manifest(name.as_str(), json);
        stats.manifest_bytes = stored.len() as u64;
        // The commit: one PUT, atomic in S3. Pins are released only after it (when `guard` drops).
        self.inner
            .remote
            .put(&self.inner.remote.manifest_key(&name), Bytes::from(stored))
            .await?;
        drop(guard);
        Ok(stats)
    }

    async fn put_file(
        &self,
        file: &FileSource,
        size: u64,
        guard: &PinGuard,
        progress: &ProgressState,
        stats: &mut PutStats,
    ) -> Result<Vec<Option<String>>, StoreError> {
        let chunk_size = self.inner.config.chunk_size as u64;
        let concurrency = self.inner.config.concurrency.max(1);
        let count = usize::try_from(size.div_ceil(chunk_size)).expect("chunk count fits in memory");
        let (tx, mut rx) = mpsc::channel(concurrency);
        let reader = {
            let (inner, path) = (self.inner.clone(), file.path.clone());
            tokio::task::spawn_blocking(move || read_chunks(&inner, &path, size, chunk_size, &tx))
        };
        let chunks = futures::stream::poll_fn(|cx| rx.poll_recv(cx));
        let mut ids: Vec<Option<String>> = vec![None; count];
        let mut results = chunks
            .map(|read: Result<ReadChunk, StoreError>| async move {
                let read = read?;
                let id = read.content.as_ref().map(|(id, _)| *id);
                let outcome = self.put_chunk(read.content, guard).await?;
                progress.advance(read.len);
                Ok::<_, StoreError>((read.index, read.len, id, outcome))
            })
            .buffer_unordered(concurrency);
        while let Some((index, len, id, outcome)) = results.try_next().await? {
            let (bytes, chunks) = match outcome {
                Outcome::Zero => (&mut stats.zero_bytes, &mut stats.zero_chunks),
                Outcome::Hit => (&mut stats.duplicate_bytes, &mut stats.chunk_hits),
                Outcome::Uploaded => (&mut stats.uploaded_bytes, &mut stats.chunks_uploaded),
            };
            *bytes += len;
            *chunks += 1;
            if let Some(slot) = ids.get_mut(index) {
                *slot = id.map(|id| id.to_hex());
            }
        }
        drop(results);
        reader.await.expect("the chunk reader does not panic");
        Ok(ids)
    }

    async fn put_chunk(
        &self,
        content: Option<(ChunkId, Bytes)>,
        guard: &PinGuard,
    ) -> Result<Outcome, StoreError> {
        let Some((id, data)) = content else {
            return Ok(Outcome::Zero);
        };
        // Pin first: from here on, GC in this process will not delete the chunk.
        if guard.pin(id).await {
            return Ok(Outcome::Hit);
        }
        let remote = &self.inner.remote;
        let key = remote.chunk_key(&id);
        // A chunk of the wrong size (a server that kept a partial write) counts as missing and is rewritten.
        let stored_len = self.inner.codec.stored_len(data.len());
        if remote
            .head(&key)
            .await?
            .is_some_and(|meta| meta.size == stored_len)
        {
            self.inner.pins.mark_known(id);
            return Ok(Outcome::Hit);
        }
        let body = if self.inner.codec.encrypted() {
            let inner = self.inner.clone();
            tokio::task::spawn_blocking(move || inner.codec.encode_chunk(&id, data))
                .await
                .expect("sealing does not panic")
        } else {
            data
        };
        remote.put(&key, body).await?;
        self.inner.pins.mark_known(id);
        Ok(Outcome::Uploaded)
    }
}

struct ProgressState {
    done: AtomicU64,
    total: u64,
    callback: Option<ProgressFn>,
}

impl ProgressState {
    fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if let Some(f) = &self.callback {
            f(Progress {
                done_bytes: done,
                total_bytes: self.total,
            });
        }
    }
}

/// Reads `path` chunk by chunk on a blocking thread and sends each (hashed, or marked zero) to `tx`. Stops
/// early when the receiver is gone (the upload failed or was dropped).
fn read_chunks(
    inner: &Inner,
    path: &Path,
    size: u64,
    chunk_size: u64,
    tx: &mpsc::Sender<Result<ReadChunk, StoreError>>,
) {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => {
            let _ = tx.blocking_send(Err(StoreError::io(path, e)));
            return;
        }
    };
    let mut next_data = 0u64;
    for (index, offset) in (0..size).step_by(chunk_size as usize).enumerate() {
        let len = chunk_size.min(size - offset);
        if next_data < offset {
            next_data = seek_data(&file, offset, size);
        }
        let content = if next_data >= offset + len {
            None // the whole chunk is a hole
        } else {
            let mut buf = vec![0u8; len as usize];
            if let Err(e) = file.read_exact_at(&mut buf, offset) {
                let _ = tx.blocking_send(Err(StoreError::io(path, e)));
                return;
            }
            (!is_zero(&buf)).then(|| (inner.codec.chunk_id(&buf), Bytes::from(buf)))
        };
        if tx.blocking_send(Ok(ReadChunk { index, len, content })).is_err() {
            return;
        }
    }
}

/// The first offset at or after `offset` that holds data (`size` if none); `offset` itself when the file
/// system cannot tell.
fn seek_data(file: &File, offset: u64, size: u64) -> u64 {
    let Ok(start) = i64::try_from(offset) else {
        return offset;
    };
    match lseek(file, start, Whence::SeekData) {
        Ok(pos) => u64::try_from(pos).unwrap_or(offset),
        Err(nix::errno::Errno::ENXIO) => size,
        Err(_) => offset,
    }
}

/// Whether every byte is zero (in 64-byte blocks, which the compiler vectorises).
pub(crate) fn is_zero(buf: &[u8]) -> bool {
    buf.chunks(64)
        .all(|block| block.iter().fold(0u8, |acc, b| acc | b) == 0)
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}
