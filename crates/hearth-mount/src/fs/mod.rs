//! The file system of one export: a prefix of a bucket seen as directories and files.
//!
//! - A file is an object `<prefix>/<path>`; a directory is a key prefix `<prefix>/<path>/` with objects under
//!   it or its marker object `<prefix>/<path>/` (what `mkdir` creates).
//! - Reads are ranged GETs through a bounded block cache ([`read`]); writes go to a local temporary file and
//!   reach the bucket as one whole object when the client commits (close, fsync) ([`write`]).
//! - Metadata is cached briefly (attributes and listings for [`Limits::attr_ttl`]), so that what another
//!   writer changed is seen within about that time; a directory's mtime changes whenever its listing does, so
//!   the guest's directory cache is dropped then.
//!
//! Every name from the guest is checked by [`valid_name`] and every key is built as `prefix/` + checked names,
//! so nothing outside the prefix can be named.

pub mod handles;
pub mod read;
pub mod write;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::s3::{Bucket, ObjMeta, S3Error};
use handles::{HandleTable, ROOT_ID, file_id};

/// NFSv3 status codes the file system answers with (RFC 1813 `nfsstat3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    Perm = 1,
    NoEnt = 2,
    Io = 5,
    Acces = 13,
    Exist = 17,
    XDev = 18,
    NotDir = 20,
    IsDir = 21,
    Inval = 22,
    FBig = 27,
    NoSpc = 28,
    RoFs = 30,
    NameTooLong = 63,
    NotEmpty = 66,
    Stale = 70,
    BadHandle = 10001,
    BadCookie = 10003,
    NotSupp = 10004,
    TooSmall = 10005,
    ServerFault = 10006,
}

impl From<S3Error> for Status {
    fn from(e: S3Error) -> Status {
        match e {
            S3Error::NotFound => Status::NoEnt,
            S3Error::Exists => Status::Exist,
            e if e.is_denied() => {
                tracing::warn!(error = %e, "bucket refused a mount request");
                Status::Acces
            }
            e => {
                tracing::warn!(error = %e, "bucket request failed");
                Status::Io
            }
        }
    }
}

pub type FsResult<T> = Result<T, Status>;

/// File or directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// What GETATTR answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub kind: Kind,
    pub fileid: u64,
    pub size: u64,
    pub mtime: SystemTime,
}

/// Bounds and timings of an export.
#[derive(Debug, Clone)]
pub struct Limits {
    /// How long attributes and listings are reused.
    pub attr_ttl: Duration,
    /// Largest existing object that may be modified in place (it is downloaded first); larger ones: EFBIG.
    pub modify_max: u64,
    /// Upload part size (objects up to it are one PUT).
    pub part_size: usize,
    /// Directory holding the temporary files of files being written.
    pub tmp_dir: PathBuf,
}

impl Limits {
    pub fn new(tmp_dir: PathBuf) -> Limits {
        Limits {
            attr_ttl: Duration::from_secs(1),
            modify_max: 1 << 30,
            part_size: 8 << 20,
            tmp_dir,
        }
    }
}

/// Bytes moved through an export (what usage reports).
#[derive(Debug, Default)]
pub struct Counters {
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
}

/// What a key is.
#[derive(Debug, Clone)]
pub enum Stat {
    File(ObjMeta),
    Dir,
}

/// One directory entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub kind: Kind,
    pub meta: Option<ObjMeta>,
}

struct DirCache {
    entries: Arc<Vec<Entry>>,
    fetched: Instant,
    digest: u64,
    mtime: SystemTime,
}

struct AttrCache {
    attr: Attr,
    etag: Option<String>,
    fetched: Instant,
}

#[derive(Default)]
struct State {
    attrs: HashMap<u64, AttrCache>,
    dirs: HashMap<String, DirCache>,
}

/// The settings of an export.
#[derive(Debug, Clone)]
pub struct ExportSpec {
    /// Random, fixed for the export's life and inherited by its forks: keys file ids and names the export.
    pub key: u64,
    /// The root's key prefix in the bucket (validated names joined by `/`; `""` for the whole bucket).
    pub prefix: String,
    pub read_only: bool,
}

/// One export: the file system over `bucket`/`prefix`.
pub struct Export {
    pub spec: ExportSpec,
    pub(crate) bucket: Bucket,
    pub(crate) handles: Arc<dyn HandleTable>,
    pub counters: Arc<Counters>,
    pub(crate) limits: Limits,
    state: Mutex<State>,
    pub(crate) dirty: write::DirtyFiles,
    pub(crate) cache: read::BlockCache,
    /// The instance's write verifier: changes when the server restarts, so clients resend unstable writes.
    pub(crate) verifier: [u8; 8],
}

/// Checks a name from the guest: 1-255 bytes of UTF-8, no `/`, NUL or other control characters, not `.`
/// or `..`.
pub fn valid_name(name: &[u8]) -> FsResult<&str> {
    if name.len() > 255 {
        return Err(Status::NameTooLong);
    }
    let s = std::str::from_utf8(name).map_err(|_| Status::Inval)?;
    if s.is_empty() || s == "." || s == ".." || s.chars().any(|c| c == '/' || c.is_control()) {
        return Err(Status::Inval);
    }
    Ok(s)
}

/// Checks a key prefix given by the host (`a/b/c`, each segment a [`valid_name`]; `""` allowed).
pub fn valid_prefix(prefix: &str) -> bool {
    prefix.is_empty()
        || (prefix.len() <= 512 && prefix.split('/').all(|seg| valid_name(seg.as_bytes()).is_ok()))
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(p, _)| p)
}

impl Export {
    pub fn new(spec: ExportSpec, bucket: Bucket, handles: Arc<dyn HandleTable>, limits: Limits) -> Export {
        let verifier = rand::random::<u64>().to_be_bytes();
        Export {
            spec,
            bucket,
            handles,
            counters: Arc::new(Counters::default()),
            dirty: write::DirtyFiles::default(),
            cache: read::BlockCache::default(),
            limits,
            state: Mutex::new(State::default()),
            verifier,
        }
    }

    /// Replaces the counters (so usage keeps counting across a server restart).
    pub fn with_counters(mut self, counters: Arc<Counters>) -> Export {
        self.counters = counters;
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bucket key of `path` (relative to the export root).
    pub(crate) fn key(&self, path: &str) -> String {
        match (self.spec.prefix.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => self.spec.prefix.clone(),
            (false, false) => format!("{}/{path}", self.spec.prefix),
        }
    }

    /// The path of a file id; stale if this export never handed it out.
    pub fn path_of(&self, id: u64) -> FsResult<String> {
        self.handles.get(id).ok_or(Status::Stale)
    }

    /// Records (and returns) the id of `path`.
    pub(crate) fn remember(&self, path: &str) -> FsResult<u64> {
        let id = file_id(self.spec.key, path);
        self.handles.insert(id, path).map_err(|_| {
            tracing::error!(export = self.spec.key, "file id collision");
            Status::Io
        })?;
        Ok(id)
    }

    fn dir_attr(&self, id: u64, mtime: SystemTime) -> Attr {
        Attr {
            kind: Kind::Dir,
            fileid: id,
            size: 4096,
            mtime,
        }
    }

    pub(crate) fn cache_file(&self, id: u64, meta: &ObjMeta) -> Attr {
        let attr = Attr {
            kind: Kind::File,
            fileid: id,
            size: meta.size,
            mtime: meta.modified,
        };
        let mut st = self.state();
        if let Some(old) = st.attrs.get(&id)
            && old.etag != meta.etag
        {
            self.cache.forget(id);
        }
        st.attrs.insert(
            id,
            AttrCache {
                attr,
                etag: meta.etag.clone(),
                fetched: Instant::now(),
            },
        );
        attr
    }

    /// Forgets what is cached about `path` and its directory (after a change made here).
    pub(crate) fn invalidate(&self, path: &str) {
        let id = file_id(self.spec.key, path);
        let mut st = self.state();
        st.attrs.remove(&id);
        st.dirs.remove(parent(path));
        st.dirs.remove(path);
        drop(st);
        self.cache.forget(id);
    }

    /// The entries of directory `path`, from the cache when fresh. A listing that differs from the last one
    /// moves the directory's mtime to now.
    pub(crate) async fn list(&self, path: &str) -> FsResult<(Arc<Vec<Entry>>, SystemTime, bool)> {
        if let Some(d) = self.state().dirs.get(path)
            && d.fetched.elapsed() < self.limits.attr_ttl
        {
            return Ok((d.entries.clone(), d.mtime, true));
        }
        let key = self.key(path);
        let listing = self.bucket.list_dir(&key).await?;
        let exists =
            path.is_empty() || listing.marker || !listing.files.is_empty() || !listing.dirs.is_empty();
        let mut entries: Vec<Entry> = listing
            .dirs
            .into_iter()
            .filter(|n| valid_name(n.as_bytes()).is_ok())
            .map(|name| Entry {
                name,
                kind: Kind::Dir,
                meta: None,
            })
            .collect();
        for (name, meta) in listing.files {
            // A name that is both an object and a prefix shows as the directory.
            if valid_name(name.as_bytes()).is_ok() && !entries.iter().any(|e| e.name == name) {
                entries.push(Entry {
                    name,
                    kind: Kind::File,
                    meta: Some(meta),
                });
            }
        }
        // Files still being written here exist before the bucket has them.
        for name in self.dirty.names_in(path) {
            if !entries.iter().any(|e| e.name == name) {
                entries.push(Entry {
                    name,
                    kind: Kind::File,
                    meta: None,
                });
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let digest = digest(&entries);
        let mut st = self.state();
        let mtime = match st.dirs.get(path) {
            Some(old) if old.digest == digest => old.mtime,
            _ => SystemTime::now(),
        };
        let entries = Arc::new(entries);
        st.dirs.insert(
            path.to_owned(),
            DirCache {
                entries: entries.clone(),
                fetched: Instant::now(),
                digest,
                mtime,
            },
        );
        Ok((entries, mtime, exists))
    }

    /// LOOKUP: the id and attributes of `name` in directory `dir`.
    pub async fn lookup(&self, dir: u64, name: &[u8]) -> FsResult<Attr> {
        let dir_path = self.path_of(dir)?;
        if name == b"." {
            return self.getattr(dir).await;
        }
        if name == b".." {
            let p = parent(&dir_path).to_owned();
            let id = self.remember(&p)?;
            return self.getattr(id).await;
        }
        let name = valid_name(name)?;
        let path = join(&dir_path, name);
        if self.key(&path).len() > handles::MAX_PATH {
            return Err(Status::NameTooLong);
        }
        if let Some(attr) = self.dirty_attr(&path).await {
            self.remember(&path)?;
            return Ok(attr);
        }
        // A fresh listing of the directory answers a name it holds without another request (a name it lacks is
        // asked for: another writer may have made it since, and "written elsewhere, not here yet" must not last).
        let cached = self.state().dirs.get(&dir_path).and_then(|d| {
            (d.fetched.elapsed() < self.limits.attr_ttl)
                .then(|| d.entries.iter().find(|e| e.name == name).cloned())
        });
        match cached {
            Some(None) | None => {}
            Some(Some(e)) => {
                let id = self.remember(&path)?;
                return Ok(match (e.kind, &e.meta) {
                    (Kind::File, Some(m)) => self.cache_file(id, m),
                    _ => self.getattr(id).await?,
                });
            }
        }
        match self.stat_key(&self.key(&path)).await? {
            Some(Stat::File(meta)) => {
                let id = self.remember(&path)?;
                Ok(self.cache_file(id, &meta))
            }
            Some(Stat::Dir) => {
                let id = self.remember(&path)?;
                self.getattr(id).await
            }
            None => Err(Status::NoEnt),
        }
    }

    /// Whether `key` is an object (with its metadata), a directory, or nothing. A HEAD that fails with a server
    /// error is retried as a directory check before it counts (some servers answer HEAD of a prefix with 500).
    pub(crate) async fn stat_key(&self, key: &str) -> FsResult<Option<Stat>> {
        let head = self.bucket.head(key).await;
        match head {
            Ok(Some(meta)) => return Ok(Some(Stat::File(meta))),
            Ok(None) => {}
            Err(S3Error::Remote(ref r))
                if matches!(
                    r.kind,
                    hearth_store::RemoteErrorKind::Unavailable | hearth_store::RemoteErrorKind::Other
                ) => {}
            Err(e) => return Err(e.into()),
        }
        if self.bucket.dir_exists(key).await? {
            return Ok(Some(Stat::Dir));
        }
        match head {
            Err(e) => Err(e.into()),
            Ok(_) => Ok(None),
        }
    }

    async fn dirty_attr(&self, path: &str) -> Option<Attr> {
        let id = file_id(self.spec.key, path);
        self.dirty.attr(id).await
    }

    /// GETATTR.
    pub async fn getattr(&self, id: u64) -> FsResult<Attr> {
        let path = self.path_of(id)?;
        if let Some(a) = self.dirty.attr(id).await {
            return Ok(a);
        }
        let cached = self.state().attrs.get(&id).and_then(|c| {
            (c.attr.kind == Kind::File && c.fetched.elapsed() < self.limits.attr_ttl).then_some(c.attr)
        });
        if let Some(a) = cached {
            return Ok(a);
        }
        if path.is_empty() {
            let (_, mtime, _) = self.list("").await?;
            return Ok(self.dir_attr(id, mtime));
        }
        let key = self.key(&path);
        if !self.state().dirs.contains_key(&path)
            && let Some(Stat::File(meta)) = self.stat_key(&key).await?
        {
            return Ok(self.cache_file(id, &meta));
        }
        let (_, mtime, exists) = self.list(&path).await?;
        if exists {
            return Ok(self.dir_attr(id, mtime));
        }
        if let Some(meta) = self.bucket.head(&key).await? {
            self.state().dirs.remove(&path);
            return Ok(self.cache_file(id, &meta));
        }
        // Gone: the guest drops its handle.
        self.state().dirs.remove(&path);
        Err(Status::Stale)
    }

    /// Whether `path` is known as a directory (root included), without a request.
    pub(crate) fn is_cached_dir(&self, path: &str) -> bool {
        path.is_empty() || self.state().dirs.contains_key(path)
    }

    /// The directory at `id`, or NOTDIR.
    pub(crate) async fn dir_path(&self, id: u64) -> FsResult<String> {
        let a = self.getattr(id).await?;
        if a.kind != Kind::Dir {
            return Err(Status::NotDir);
        }
        self.path_of(id)
    }

    /// READDIR / READDIRPLUS: entries after `cookie` (0: from the start; else the id of the last entry
    /// returned), each with its id and (for PLUS) attributes, until `fits` says no more; and whether the end
    /// was reached.
    pub async fn readdir(
        &self,
        dir: u64,
        cookie: u64,
        mut fits: impl FnMut(&str) -> bool,
    ) -> FsResult<(Vec<(Entry, Attr)>, bool)> {
        let path = self.dir_path(dir).await?;
        let (entries, _, _) = self.list(&path).await?;
        let start = if cookie == 0 {
            0
        } else {
            let after = self.path_of(cookie).map_err(|_| Status::BadCookie)?;
            let name = after.rsplit_once('/').map_or(after.as_str(), |(_, n)| n);
            entries.partition_point(|e| e.name.as_str() <= name)
        };
        let mut out = Vec::new();
        for e in &entries[start..] {
            if !fits(&e.name) {
                return Ok((out, false));
            }
            let child = join(&path, &e.name);
            let id = self.remember(&child)?;
            let attr = match (e.kind, &e.meta) {
                (Kind::File, Some(m)) => self.cache_file(id, m),
                (Kind::File, None) => self.dirty.attr(id).await.unwrap_or(Attr {
                    kind: Kind::File,
                    fileid: id,
                    size: 0,
                    mtime: SystemTime::now(),
                }),
                (Kind::Dir, _) => {
                    let mtime = self
                        .state()
                        .dirs
                        .get(&child)
                        .map_or(SystemTime::UNIX_EPOCH, |d| d.mtime);
                    self.dir_attr(id, mtime)
                }
            };
            out.push((e.clone(), attr));
        }
        Ok((out, true))
    }

    /// Forgets cached attributes and listings nobody used for a while (the maps would otherwise grow with every
    /// name a client ever saw; a dropped entry costs one request when it is needed again).
    pub(crate) fn prune(&self) {
        let mut st = self.state();
        let keep = self.limits.attr_ttl * 30;
        st.attrs.retain(|_, a| a.fetched.elapsed() < keep);
        st.dirs.retain(|_, d| d.fetched.elapsed() < keep * 2);
    }

    pub fn read_only(&self) -> bool {
        self.spec.read_only
    }

    pub(crate) fn writable(&self) -> FsResult<()> {
        if self.spec.read_only {
            Err(Status::RoFs)
        } else {
            Ok(())
        }
    }

    /// Root id, for MOUNT.
    pub fn root(&self) -> u64 {
        ROOT_ID
    }
}

fn digest(entries: &[Entry]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for e in entries {
        e.name.hash(&mut h);
        (e.kind == Kind::Dir).hash(&mut h);
        if let Some(m) = &e.meta {
            m.size.hash(&mut h);
            m.etag.hash(&mut h);
        }
    }
    h.finish()
}

pub(crate) fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_prefixes() {
        assert_eq!(valid_name(b"a.txt"), Ok("a.txt"));
        for bad in [&b""[..], b".", b"..", b"a/b", b"a\0", b"\n", &[0xff, 0xfe]] {
            assert!(valid_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(valid_name(&[b'x'; 256]), Err(Status::NameTooLong));
        assert!(valid_prefix("") && valid_prefix("runs/42") && valid_prefix("Data Set/é"));
        for bad in ["/x", "x/", "a//b", "a/../b", "..", "a/./b"] {
            assert!(!valid_prefix(bad), "{bad}");
        }
        assert_eq!(parent("a/b/c"), "a/b");
        assert_eq!(parent("a"), "");
        assert_eq!(join("", "x"), "x");
    }
}
