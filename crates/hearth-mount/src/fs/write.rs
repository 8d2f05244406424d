//! Writes and namespace changes.
//!
//! A file being written lives in a local temporary file (unlinked, under [`super::Limits::tmp_dir`]); WRITEs
//! land there at any offset and are answered UNSTABLE. COMMIT (the client sends it on close and fsync) uploads
//! the whole file as one object (one PUT, or a multipart upload for large files) and answers only once the
//! bucket has it, so a `close()` that succeeds means the object is there. Writing into an object that exists
//! already downloads it first (up to [`super::Limits::modify_max`]; larger: EFBIG), so appends and in-place
//! edits work as whole-object rewrites. A temporary file is dropped once clean and idle; uncommitted data of a
//! client that went away is dropped too. What all temporary files of an export may hold is bounded
//! ([`MAX_DIRTY`]; beyond: ENOSPC).
//!
//! Renames of files are a copy and a delete; renaming a directory that holds anything answers EXDEV (`mv`
//! then copies and deletes itself). Symlinks, hard links and device nodes: EPERM (what POSIX says for a file
//! system that cannot make them).

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use super::handles::file_id;
use super::{Attr, Export, FsResult, Kind, Status, add, join, parent, valid_name};

/// Most bytes the temporary files of one export may hold together.
pub const MAX_DIRTY: u64 = 8 << 30;
/// A clean temporary file is dropped after this long without use.
const IDLE_CLEAN: Duration = Duration::from_secs(30);
/// Uncommitted data nobody touched for this long is dropped (its writer is gone).
const IDLE_ABANDONED: Duration = Duration::from_secs(600);

/// A file being written.
pub struct Dirty {
    path: String,
    file: std::fs::File,
    size: u64,
    /// Written since the last upload.
    changed: bool,
    mtime: SystemTime,
    used: Instant,
}

type Slot = Arc<tokio::sync::Mutex<Option<Dirty>>>;

#[derive(Default)]
pub struct DirtyFiles {
    map: Mutex<HashMap<u64, (String, Slot)>>,
    bytes: AtomicU64,
}

/// How CREATE treats an existing name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateMode {
    /// Existing files are kept (or truncated when the attributes set size 0).
    Unchecked { truncate: bool },
    /// Fails with EXIST if the name exists.
    Guarded,
    /// Atomic create-if-absent (a conditional PUT).
    Exclusive,
}

impl DirtyFiles {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (String, Slot)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: u64) -> Option<Slot> {
        self.map().get(&id).map(|(_, s)| s.clone())
    }

    pub async fn attr(&self, id: u64) -> Option<Attr> {
        let slot = self.get(id)?;
        let d = slot.lock().await;
        let d = d.as_ref()?;
        Some(Attr {
            kind: Kind::File,
            fileid: id,
            size: d.size,
            mtime: d.mtime,
        })
    }

    pub async fn read(&self, id: u64, offset: u64, count: u32) -> Option<FsResult<(Bytes, bool)>> {
        let slot = self.get(id)?;
        let mut d = slot.lock().await;
        let d = d.as_mut()?;
        d.used = Instant::now();
        if offset >= d.size {
            return Some(Ok((Bytes::new(), true)));
        }
        let len = (d.size - offset).min(u64::from(count)) as usize;
        let mut buf = vec![0u8; len];
        Some(match d.file.read_exact_at(&mut buf, offset) {
            Ok(()) => Ok((Bytes::from(buf), offset + len as u64 >= d.size)),
            Err(e) => {
                tracing::warn!(error = %e, "reading a mount's temporary file");
                Err(Status::Io)
            }
        })
    }

    /// Names of the files being written directly in directory `dir`.
    pub fn names_in(&self, dir: &str) -> Vec<String> {
        self.map()
            .values()
            .filter(|(p, _)| parent(p) == dir)
            .map(|(p, _)| p.rsplit('/').next().unwrap_or(p).to_owned())
            .collect()
    }

    fn remove(&self, id: u64) -> Option<Slot> {
        self.map().remove(&id).map(|(_, s)| s)
    }

    fn release(&self, d: &Dirty) {
        self.bytes
            .fetch_sub(d.size.min(self.bytes.load(Ordering::Relaxed)), Ordering::Relaxed);
    }

    /// Number of temporary files (tests, metrics).
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Export {
    /// The temporary file of `id`, made (and filled with the object's bytes unless `empty`) if needed.
    async fn open_dirty(&self, id: u64, path: &str, empty: bool) -> FsResult<Slot> {
        let slot = {
            let mut map = self.dirty.map();
            map.entry(id)
                .or_insert_with(|| (path.to_owned(), Arc::new(tokio::sync::Mutex::new(None))))
                .1
                .clone()
        };
        let mut guard = slot.lock().await;
        if guard.is_none() {
            match self.fill(path, empty).await {
                Ok(d) => {
                    self.dirty.bytes.fetch_add(d.size, Ordering::Relaxed);
                    *guard = Some(d);
                }
                Err(e) => {
                    drop(guard);
                    self.dirty.remove(id);
                    return Err(e);
                }
            }
        }
        drop(guard);
        Ok(slot)
    }

    async fn fill(&self, path: &str, empty: bool) -> FsResult<Dirty> {
        let file = tempfile::tempfile_in(&self.limits.tmp_dir).map_err(|e| {
            tracing::warn!(error = %e, dir = %self.limits.tmp_dir.display(), "creating a mount's temporary file");
            Status::Io
        })?;
        let mut size = 0;
        if !empty {
            let key = self.key(path);
            match self.bucket.head(&key).await? {
                Some(m) if m.size > self.limits.modify_max => return Err(Status::FBig),
                Some(m) if m.size + self.dirty.bytes.load(Ordering::Relaxed) > MAX_DIRTY => {
                    return Err(Status::NoSpc);
                }
                Some(m) if m.size > 0 => {
                    size = self.bucket.get_into(&key, &file, self.limits.modify_max).await?;
                }
                _ => {}
            }
        }
        Ok(Dirty {
            path: path.to_owned(),
            file,
            size,
            changed: false,
            mtime: SystemTime::now(),
            used: Instant::now(),
        })
    }

    /// WRITE: `data` at `offset` into the file's temporary copy.
    pub async fn write(&self, id: u64, offset: u64, data: &[u8]) -> FsResult<Attr> {
        self.writable()?;
        let path = self.path_of(id)?;
        if self.is_cached_dir(&path) {
            return Err(Status::IsDir);
        }
        let end = offset.checked_add(data.len() as u64).ok_or(Status::FBig)?;
        let slot = self.open_dirty(id, &path, false).await?;
        let mut guard = slot.lock().await;
        let d = guard.as_mut().ok_or(Status::Stale)?;
        if end > d.size {
            let grow = end - d.size;
            if self.dirty.bytes.load(Ordering::Relaxed) + grow > MAX_DIRTY {
                return Err(Status::NoSpc);
            }
        }
        d.file.write_all_at(data, offset).map_err(|e| {
            tracing::warn!(error = %e, "writing a mount's temporary file");
            if e.raw_os_error() == Some(libc::ENOSPC) {
                Status::NoSpc
            } else {
                Status::Io
            }
        })?;
        if end > d.size {
            self.dirty.bytes.fetch_add(end - d.size, Ordering::Relaxed);
            d.size = end;
        }
        d.changed = true;
        d.mtime = SystemTime::now();
        d.used = Instant::now();
        add(&self.counters.bytes_written, data.len());
        Ok(Attr {
            kind: Kind::File,
            fileid: id,
            size: d.size,
            mtime: d.mtime,
        })
    }

    /// COMMIT: uploads the file if it changed since the last upload.
    pub async fn commit(&self, id: u64) -> FsResult<()> {
        let Some(slot) = self.dirty.get(id) else {
            return Ok(());
        };
        let mut guard = slot.lock().await;
        let Some(d) = guard.as_mut() else {
            return Ok(());
        };
        d.used = Instant::now();
        if !d.changed {
            return Ok(());
        }
        let key = self.key(&d.path);
        self.bucket
            .put_file(&key, &d.file, d.size, self.limits.part_size)
            .await?;
        d.changed = false;
        let path = d.path.clone();
        drop(guard);
        self.invalidate(&path);
        Ok(())
    }

    /// Drops clean temporary files nobody used for a while, abandoned uncommitted ones, and stale cache entries.
    pub async fn sweep(&self) {
        self.prune();
        let slots: Vec<(u64, Slot)> = self
            .dirty
            .map()
            .iter()
            .map(|(id, (_, s))| (*id, s.clone()))
            .collect();
        for (id, slot) in slots {
            let Ok(mut guard) = slot.try_lock() else { continue };
            let drop_it = match guard.as_ref() {
                None => true,
                Some(d) if !d.changed => d.used.elapsed() > IDLE_CLEAN,
                Some(d) => {
                    let gone = d.used.elapsed() > IDLE_ABANDONED;
                    if gone {
                        tracing::warn!(
                            export = self.spec.key,
                            bytes = d.size,
                            "dropping uncommitted writes of a client that went away"
                        );
                    }
                    gone
                }
            };
            if drop_it {
                if let Some(d) = guard.take() {
                    self.dirty.release(&d);
                }
                drop(guard);
                self.dirty.remove(id);
            }
        }
    }

    /// Forgets the temporary file of `id` (the file was removed).
    async fn discard(&self, id: u64) {
        if let Some(slot) = self.dirty.remove(id)
            && let Some(d) = slot.lock().await.take()
        {
            self.dirty.release(&d);
        }
    }

    /// SETATTR: only the size has an effect (mode, owner and times are accepted and ignored: objects have none).
    pub async fn setattr(&self, id: u64, size: Option<u64>, anything: bool) -> FsResult<Attr> {
        if anything || size.is_some() {
            self.writable()?;
        }
        let attr = self.getattr(id).await?;
        let Some(size) = size else {
            return Ok(attr);
        };
        if attr.kind == Kind::Dir {
            return Err(Status::IsDir);
        }
        let path = self.path_of(id)?;
        if self.dirty.get(id).is_none() {
            if size == attr.size {
                return Ok(attr);
            }
            if size == 0 {
                self.bucket.put(&self.key(&path), Bytes::new()).await?;
                self.invalidate(&path);
                return self.getattr(id).await;
            }
        }
        let slot = self.open_dirty(id, &path, size == 0).await?;
        let mut guard = slot.lock().await;
        let d = guard.as_mut().ok_or(Status::Stale)?;
        if size > d.size && self.dirty.bytes.load(Ordering::Relaxed) + (size - d.size) > MAX_DIRTY {
            return Err(Status::NoSpc);
        }
        d.file.set_len(size).map_err(|_| Status::Io)?;
        if size > d.size {
            self.dirty.bytes.fetch_add(size - d.size, Ordering::Relaxed);
        } else {
            self.dirty.bytes.fetch_sub(
                (d.size - size).min(self.dirty.bytes.load(Ordering::Relaxed)),
                Ordering::Relaxed,
            );
        }
        d.size = size;
        d.changed = true;
        d.mtime = SystemTime::now();
        Ok(Attr {
            kind: Kind::File,
            fileid: id,
            size,
            mtime: d.mtime,
        })
    }

    /// What `name` in `dir` is now: a file, a directory, or nothing.
    async fn kind_of(&self, path: &str) -> FsResult<Option<Kind>> {
        if self.dirty.get(file_id(self.spec.key, path)).is_some() {
            return Ok(Some(Kind::File));
        }
        Ok(match self.stat_key(&self.key(path)).await? {
            Some(super::Stat::File(_)) => Some(Kind::File),
            Some(super::Stat::Dir) => Some(Kind::Dir),
            None => None,
        })
    }

    async fn child(&self, dir: u64, name: &[u8]) -> FsResult<String> {
        let dir_path = self.dir_path(dir).await?;
        let name = valid_name(name)?;
        let path = join(&dir_path, name);
        if self.key(&path).len() > super::handles::MAX_PATH {
            return Err(Status::NameTooLong);
        }
        Ok(path)
    }

    /// CREATE: an empty object (so that the name exists at once, e.g. for `touch`).
    pub async fn create(&self, dir: u64, name: &[u8], mode: CreateMode) -> FsResult<Attr> {
        self.writable()?;
        let path = self.child(dir, name).await?;
        let key = self.key(&path);
        let id = self.remember(&path)?;
        match (self.kind_of(&path).await?, mode) {
            (Some(Kind::Dir), _) => return Err(Status::Exist),
            (Some(Kind::File), CreateMode::Unchecked { truncate: false }) => return self.getattr(id).await,
            (Some(Kind::File), CreateMode::Unchecked { truncate: true }) => {
                return self.setattr(id, Some(0), true).await;
            }
            (Some(Kind::File), _) => return Err(Status::Exist),
            (None, CreateMode::Unchecked { .. }) => self.bucket.put(&key, Bytes::new()).await?,
            (None, _) => self.bucket.put_new(&key, Bytes::new()).await?,
        }
        self.invalidate(&path);
        self.getattr(id).await
    }

    /// MKDIR: the directory's marker object.
    pub async fn mkdir(&self, dir: u64, name: &[u8]) -> FsResult<Attr> {
        self.writable()?;
        let path = self.child(dir, name).await?;
        if self.kind_of(&path).await?.is_some() {
            return Err(Status::Exist);
        }
        self.bucket.put_marker(&self.key(&path)).await?;
        let id = self.remember(&path)?;
        self.invalidate(&path);
        self.getattr(id).await
    }

    /// REMOVE (files).
    pub async fn remove(&self, dir: u64, name: &[u8]) -> FsResult<()> {
        self.writable()?;
        let path = self.child(dir, name).await?;
        match self.kind_of(&path).await? {
            None => return Err(Status::NoEnt),
            Some(Kind::Dir) => return Err(Status::IsDir),
            Some(Kind::File) => {}
        }
        let id = file_id(self.spec.key, &path);
        self.discard(id).await;
        self.bucket.delete(&self.key(&path)).await?;
        self.invalidate(&path);
        Ok(())
    }

    /// RMDIR (empty directories).
    pub async fn rmdir(&self, dir: u64, name: &[u8]) -> FsResult<()> {
        self.writable()?;
        let path = self.child(dir, name).await?;
        let key = self.key(&path);
        let listing = self.bucket.list_dir(&key).await?;
        if !listing.files.is_empty() || !listing.dirs.is_empty() || !self.dirty.names_in(&path).is_empty() {
            return Err(Status::NotEmpty);
        }
        if !listing.marker {
            return Err(match self.kind_of(&path).await? {
                Some(Kind::File) => Status::NotDir,
                _ => Status::NoEnt,
            });
        }
        self.bucket.delete_marker(&key).await?;
        self.invalidate(&path);
        Ok(())
    }

    /// RENAME: files by copy and delete (a file being written is uploaded under its new name); empty
    /// directories by moving the marker; other directories: EXDEV.
    pub async fn rename(&self, from_dir: u64, from: &[u8], to_dir: u64, to: &[u8]) -> FsResult<()> {
        self.writable()?;
        let src = self.child(from_dir, from).await?;
        let dst = self.child(to_dir, to).await?;
        if src == dst {
            return Ok(());
        }
        let src_kind = self.kind_of(&src).await?.ok_or(Status::NoEnt)?;
        let dst_kind = self.kind_of(&dst).await?;
        match (src_kind, dst_kind) {
            (Kind::File, Some(Kind::Dir)) => return Err(Status::IsDir),
            (Kind::Dir, Some(Kind::File)) => return Err(Status::NotDir),
            (Kind::Dir, Some(Kind::Dir)) => return Err(Status::Exist),
            _ => {}
        }
        if dst.starts_with(&format!("{src}/")) {
            return Err(Status::Inval);
        }
        let (src_key, dst_key) = (self.key(&src), self.key(&dst));
        if src_kind == Kind::Dir {
            let listing = self.bucket.list_dir(&src_key).await?;
            if !listing.files.is_empty() || !listing.dirs.is_empty() || !self.dirty.names_in(&src).is_empty()
            {
                return Err(Status::XDev);
            }
            self.bucket.put_marker(&dst_key).await?;
            self.bucket.delete_marker(&src_key).await?;
        } else {
            let src_id = file_id(self.spec.key, &src);
            let dst_id = self.remember(&dst)?;
            self.discard(dst_id).await;
            match self.dirty.remove(src_id) {
                Some(slot) => {
                    let mut guard = slot.lock().await;
                    if let Some(d) = guard.as_mut() {
                        self.bucket
                            .put_file(&dst_key, &d.file, d.size, self.limits.part_size)
                            .await?;
                        d.changed = false;
                        d.path = dst.clone();
                    }
                    drop(guard);
                    self.dirty.map().insert(dst_id, (dst.clone(), slot));
                }
                None => self.bucket.copy(&src_key, &dst_key).await?,
            }
            self.bucket.delete(&src_key).await?;
        }
        self.invalidate(&src);
        self.invalidate(&dst);
        Ok(())
    }
}
