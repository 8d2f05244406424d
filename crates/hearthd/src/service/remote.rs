//! The storage bucket (`hearthd --storage s3://BUCKET/PREFIX`): the durable home of paused sandboxes, snapshots
//! and saved templates, with local disk as the working copy. Chunking, verification, GC and encryption are
//! hearth-store's; this module decides what goes there and when.
//!
//! - Start: [`open`] probes the bucket (list, write, read, list, delete) and opens the store; the daemon refuses
//!   to start when that fails, naming the step and the reason (no such bucket, access denied, unreachable).
//! - Upload: a committed pause (`sandboxes/<id>/pause`: the `paused` directory as written, plus the sandbox's
//!   own disk as `sandbox-disk`), checkpoint (`snapshots/<id>`: its directory) or template
//!   (`templates/<name>`: its directory) gets a `pending` row in `remote_objects` ([`crate::db::remote`]);
//!   [`worker`] uploads pending rows in the background ([`UPLOADS`] at a time), retrying failures with growing
//!   waits, and marks them `synced`. Rows survive restarts, so uploads resume. Nothing waits for the bucket:
//!   a pause commits locally first, and an outage leaves rows `pending` until the bucket answers again.
//!   Large snapshot files are uploaded with their content hashes (`hashes.json`) so a fetched copy verifies.
//! - Fetch: a resume, a create from a snapshot or a template whose local directory is gone fetches it
//!   ([`Sandboxes::storage_fetch_pause`], [`Sandboxes::storage_fetch_for_create`]); hearth-store checks every
//!   chunk, and a bad one is a `storage_corrupt` error naming the object, with nothing written locally.
//! - Delete: destroying a sandbox, deleting a snapshot or template turns its row `deleting`; the worker removes
//!   the manifest, and the periodic GC pass ([`gc_loop`]) removes chunks no manifest references any more.
//!
//! - Cache: with `--cache-size`, [`super::cache`] evicts least recently used local copies the bucket holds (the
//!   worker runs a pass after every round); what the bucket, the cache and each object show is
//!   [`super::remote_status`]'s. A fetch in flight reports its progress there (`storage.fetch`).
//!
//! A resume may write into its paused memory file, so it first cancels an upload of that pause in flight (the
//! manifest is written last: a cancelled upload commits nothing) and a later upload finds the sandbox running
//! and drops the row.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_api::{ErrorCode, SandboxState, StorageGcReport};
use hearth_store::{FileSource, GcOptions, PutOptions, Store, StoreConfig, StoreError, StoreKey};
use tokio::time::Instant;

use super::integrity;
use super::snapshot;
use super::{Sandboxes, ServiceError, now_ms};
use crate::db::remote::{RemoteRow, RemoteState};

/// Uploads (and remote deletes) in flight at once; each keeps hearth-store's own requests in flight.
pub const UPLOADS: usize = 2;
/// Requests in flight within one upload or download (2-core hosts; the bucket is usually remote).
const CONCURRENCY: usize = 8;
/// Longest wait between two attempts at one object.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often the worker looks for due rows without being woken.
const TICK: Duration = Duration::from_secs(2);
/// How long an upload waits for the background hashing of a snapshot's large files before hashing them itself.
const HASH_WAIT: Duration = Duration::from_secs(30);
/// The sandbox's own disk inside a pause object.
const SANDBOX_DISK: &str = "sandbox-disk";

/// What kind of local thing an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Pause,
    Snapshot,
    Template,
    /// A running sandbox's synced disk ([`super::sync`]).
    Sync,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Pause => "pause",
            Kind::Snapshot => "snapshot",
            Kind::Template => "template",
            Kind::Sync => "sync",
        }
    }

    pub(super) fn parse(s: &str) -> Option<Kind> {
        match s {
            "pause" => Some(Kind::Pause),
            "snapshot" => Some(Kind::Snapshot),
            "template" => Some(Kind::Template),
            "sync" => Some(Kind::Sync),
            _ => None,
        }
    }

    /// The object's name in the store (owners are validated ids and template names: `[a-z0-9_-]`).
    pub(super) fn object(self, owner: &str) -> String {
        match self {
            Kind::Pause => format!("sandboxes/{owner}/pause"),
            Kind::Snapshot => format!("snapshots/{owner}"),
            Kind::Template => format!("templates/{owner}"),
            Kind::Sync => format!("sandboxes/{owner}/sync"),
        }
    }
}

/// Storage settings from the flags.
#[derive(Debug, Clone)]
pub struct StorageSettings {
    pub url: String,
    pub key_file: Option<PathBuf>,
    pub gc_interval: Duration,
    pub gc_grace: Duration,
    /// `--cache-size`: the local copies' limit ([`super::cache`]); `None` is unbounded.
    pub cache_size: Option<u64>,
}

/// Why the storage could not be opened at start.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("--storage: {0}")]
    Config(#[from] hearth_store::ConfigError),
    #[error("--storage {url}: the bucket check failed at step {step:?}: {kind}: {detail}")]
    Probe {
        url: String,
        step: hearth_store::ProbeStep,
        kind: &'static str,
        detail: hearth_store::RemoteError,
    },
    #[error("--storage {url}: {source}")]
    Open { url: String, source: StoreError },
}

/// The open storage and the worker's bookkeeping.
pub struct Storage {
    pub(super) store: Store,
    pub(super) url: String,
    pub(super) settings: StorageSettings,
    wake: tokio::sync::Notify,
    /// Uploads and deletes in flight, by object name.
    running: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// When an object that failed may be tried again.
    backoff: Mutex<HashMap<String, Instant>>,
    /// Serialises fetches of one object (forks of one snapshot start together).
    fetching: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(super) last_error: Mutex<Option<String>>,
    pub(super) bytes_up: AtomicU64,
    pub(super) bytes_down: AtomicU64,
    /// Fetches in flight and how far they got, by object name (shown in `GET` answers while they run).
    pub(super) fetches: Arc<Mutex<HashMap<String, hearth_api::FetchProgress>>>,
    /// Local disk as a cache of the bucket.
    pub(super) cache: super::cache::Cache,
}

fn kind_name(kind: hearth_store::RemoteErrorKind) -> &'static str {
    use hearth_store::RemoteErrorKind as K;
    match kind {
        K::NoSuchBucket => "no such bucket",
        K::AccessDenied => "access denied",
        K::Unreachable => "endpoint unreachable",
        K::ClockSkew => "clock skew",
        K::Unavailable => "server unavailable",
        K::Other => "request failed",
    }
}

/// Probes the bucket and opens the store. Any failure stops the daemon's start with the reason.
pub async fn open(settings: StorageSettings) -> Result<Storage, OpenError> {
    let mut config = StoreConfig::from_url(&settings.url)?;
    if let Some(path) = &settings.key_file {
        config.key = Some(StoreKey::from_file(path)?);
    }
    config.concurrency = CONCURRENCY;
    config.max_retries = 3;
    config.retry_timeout = Duration::from_secs(20);
    let url = settings.url.clone();
    hearth_store::probe(&config).await.map_err(|e| OpenError::Probe {
        url: url.clone(),
        step: e.step,
        kind: kind_name(e.kind()),
        detail: e.source,
    })?;
    let store = Store::open(config).await.map_err(|source| OpenError::Open {
        url: url.clone(),
        source,
    })?;
    tracing::info!(storage = %url, encrypted = settings.key_file.is_some(), "storage bucket checked");
    Ok(Storage {
        store,
        url,
        wake: tokio::sync::Notify::new(),
        running: Mutex::default(),
        backoff: Mutex::default(),
        fetching: Mutex::default(),
        last_error: Mutex::default(),
        bytes_up: AtomicU64::new(0),
        bytes_down: AtomicU64::new(0),
        fetches: Arc::default(),
        cache: super::cache::Cache::new(settings.cache_size),
        settings,
    })
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Storage {
    fn healthy(&self) {
        *lock(&self.last_error) = None;
    }

    fn unhealthy(&self, e: &StoreError) {
        if e.is_retryable() || matches!(e, StoreError::Remote(_)) {
            *lock(&self.last_error) = Some(e.to_string());
        }
    }

    pub(super) fn is_running(&self, name: &str) -> bool {
        lock(&self.running).get(name).is_some_and(|h| !h.is_finished())
    }

    /// Stops an upload or delete of `name` in flight and waits (briefly) until its task is gone.
    pub(super) async fn cancel(&self, name: &str) {
        let handle = lock(&self.running).remove(name);
        if let Some(h) = handle {
            h.abort();
            let deadline = Instant::now() + Duration::from_secs(5);
            while !h.is_finished() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tracing::debug!(object = %name, "storage upload cancelled");
        }
    }

    fn fetch_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = lock(&self.fetching);
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        locks.entry(name.to_string()).or_default().clone()
    }
}

/// A store error as the API shows it: the object is named by hearth-store's message.
fn fetch_error(e: StoreError) -> ServiceError {
    match e {
        StoreError::ChunkMissing { .. }
        | StoreError::ChunkCorrupt { .. }
        | StoreError::ManifestCorrupt { .. }
        | StoreError::NotFound(_)
        | StoreError::InvalidFileName { .. } => ServiceError::Typed(ErrorCode::StorageCorrupt, e.to_string()),
        StoreError::Remote(_) => ServiceError::Typed(ErrorCode::StorageUnavailable, e.to_string()),
        other => ServiceError::Internal(format!("storage: {other}")),
    }
}

/// The regular files of `dir` (not temporaries), as upload sources named after themselves.
fn dir_files(dir: &Path) -> std::io::Result<Vec<FileSource>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !entry.file_type()?.is_file() {
            continue;
        }
        files.push(FileSource::new(name, entry.path()));
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(files)
}

/// Makes sure `hashes.json` covers every fingerprinted file of the snapshot in `dir`, so that a copy fetched
/// into new inodes still verifies: waits for the background hashing, then hashes what is left itself.
async fn complete_hashes(dir: PathBuf) -> std::io::Result<()> {
    let raw = match std::fs::read(dir.join(snapshot::MANIFEST)) {
        Ok(raw) => raw,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let manifest: snapshot::Manifest = serde_json::from_slice(&raw).map_err(std::io::Error::other)?;
    let wanted = manifest.fingerprinted();
    let deadline = Instant::now() + HASH_WAIT;
    loop {
        let have = integrity::read_hashes(&dir);
        if wanted.iter().all(|(n, _)| have.contains_key(n)) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::task::spawn_blocking(move || {
        let mut hashes = integrity::read_hashes(&dir);
        for (name, sealed) in wanted {
            if hashes.contains_key(&name) {
                continue;
            }
            let path = dir.join(&name);
            let unchanged = || {
                std::fs::symlink_metadata(&path)
                    .is_ok_and(|m| integrity::Fingerprint::of(&m).same_version(&sealed))
            };
            if !unchanged() {
                return Err(std::io::Error::other(format!(
                    "{name} changed since the snapshot was sealed"
                )));
            }
            let h = integrity::content_hash(&path)?;
            if !unchanged() {
                return Err(std::io::Error::other(format!(
                    "{name} changed while it was hashed"
                )));
            }
            hashes.insert(name, h);
        }
        integrity::write_hashes(&dir, &hashes)
    })
    .await
    .map_err(std::io::Error::other)?
}

/// What one attempt at a row came to.
enum Outcome {
    /// The bucket holds the version (upload) or no longer holds the object (delete).
    Done { sent: u64, digest: String },
    /// The local copy is gone or replaced (resumed, destroyed): nothing to upload, and an older remote
    /// version is stale.
    Gone,
}

impl Sandboxes {
    /// Turns the storage bucket on (before recovery, so that what recovery does is recorded).
    pub fn enable_storage(&self, storage: Storage) {
        if self.storage.set(Arc::new(storage)).is_err() {
            tracing::warn!("storage enabled twice; keeping the first");
        }
    }

    pub(crate) fn storage(&self) -> Option<&Arc<Storage>> {
        self.storage.get()
    }

    /// Records that `owner`'s local copy of `kind` was committed (`version`: its commit time) and wakes the
    /// uploader. Never fails the caller: the worst case is a copy that stays local only, with a log line.
    pub(crate) fn storage_committed(&self, kind: Kind, owner: &str, version: i64, size_bytes: u64) {
        let Some(st) = self.storage() else { return };
        let name = kind.object(owner);
        match self
            .db
            .remote_pending(&name, kind.as_str(), owner, version, size_bytes, now_ms())
        {
            Ok(()) => {
                lock(&st.backoff).remove(&name);
                st.wake.notify_one();
            }
            Err(e) => tracing::error!(object = %name, error = %e, "recording a pending upload"),
        }
    }

    /// Records that `owner`'s `kind` is gone locally: its remote object is removed in the background.
    pub(crate) fn storage_deleted(&self, kind: Kind, owner: &str) {
        let Some(st) = self.storage().cloned() else { return };
        let name = kind.object(owner);
        // No row: the bucket never got (or already lost) this object.
        if !matches!(self.db.remote_get(&name), Ok(Some(_))) {
            return;
        }
        if let Some(h) = lock(&st.running).remove(&name) {
            h.abort();
        }
        match self.db.remote_deleting(&name, kind.as_str(), owner, now_ms()) {
            Ok(()) => {
                lock(&st.backoff).remove(&name);
                st.wake.notify_one();
            }
            Err(e) => tracing::error!(object = %name, error = %e, "recording a remote delete"),
        }
    }

    /// Before a resume: stops an upload of this pause in flight (the resumed guest may write into the memory
    /// file), and fetches the paused state from the bucket when its local copy is gone.
    pub(crate) async fn storage_fetch_pause(&self, id: &str, paused_dir: &str) -> Result<(), ServiceError> {
        let Some(st) = self.storage().cloned() else {
            return Ok(());
        };
        let name = Kind::Pause.object(id);
        st.cancel(&name).await;
        // The disk's base (a snapshot's disk copy, a saved template's image) may be gone too.
        let row = self.row(id)?;
        let bases = hearth_api::CreateSandboxRequest {
            template: Some(row.template.clone()),
            snapshot: row.snapshot_id.clone(),
            ..Default::default()
        };
        self.storage_fetch_for_create(&bases).await?;
        let sandbox_dir = self.settings.paths.sandbox_dir(id);
        let dest = sandbox_dir.join(paused_dir);
        if dest.exists() {
            return Ok(());
        }
        let synced = self
            .db
            .remote_get(&name)?
            .is_some_and(|r| r.state == RemoteState::Synced);
        if !synced {
            return Err(ServiceError::Typed(
                ErrorCode::StorageUnavailable,
                format!(
                    "the paused state of sandbox {id} is not on this host and was not uploaded (sync pending)"
                ),
            ));
        }
        let disk = row
            .disk
            .ok_or_else(|| ServiceError::Internal(format!("sandbox {id} has no disk recorded")))?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .create(&sandbox_dir)
            .map_err(|e| ServiceError::Internal(format!("creating {}: {e}", sandbox_dir.display())))?;
        let tmp = sandbox_dir.join(".fetch-pause");
        let _ = std::fs::remove_dir_all(&tmp);
        self.fetch_into(&st, &name, &tmp).await?;
        let moved = (|| {
            let fetched_disk = tmp.join(SANDBOX_DISK);
            if fetched_disk.exists() {
                if let Some(parent) = disk.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::rename(&fetched_disk, &disk)?;
            }
            std::fs::rename(&tmp, &dest)?;
            std::fs::File::open(&sandbox_dir)?.sync_all()
        })();
        if let Err(e) = moved {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(ServiceError::Internal(format!(
                "placing the fetched pause of {id}: {e}"
            )));
        }
        Ok(())
    }

    /// Before a create: fetches the snapshot or saved template it starts from when the local copy is gone, and
    /// the ones those were made from ([`Sandboxes::base_chain`]: a snapshot's disk copy is an overlay).
    pub(crate) async fn storage_fetch_for_create(
        &self,
        req: &hearth_api::CreateSandboxRequest,
    ) -> Result<(), ServiceError> {
        let Some(st) = self.storage().cloned() else {
            return Ok(());
        };
        let paths = &self.settings.paths;
        for (kind, owner) in self.base_chain(req.template.as_deref(), req.snapshot.as_deref()) {
            let (parent, dir) = match kind {
                Kind::Template => (
                    paths.user_templates_dir(),
                    paths.user_templates_dir().join(&owner),
                ),
                Kind::Snapshot => (paths.snapshots_dir(), paths.snapshot_dir(&owner)),
                Kind::Pause | Kind::Sync => continue,
            };
            if !dir.exists() {
                std::fs::create_dir_all(&parent)
                    .map_err(|e| ServiceError::Internal(format!("{}: {e}", parent.display())))?;
                self.fetch_once(&st, kind, &owner, &dir).await?;
            }
        }
        Ok(())
    }

    /// Fetches `owner`'s `kind` into `dest` unless a concurrent fetch already did.
    async fn fetch_once(
        &self,
        st: &Arc<Storage>,
        kind: Kind,
        owner: &str,
        dest: &Path,
    ) -> Result<(), ServiceError> {
        let name = kind.object(owner);
        let lock = st.fetch_lock(&name);
        let _guard = lock.lock().await;
        if dest.exists() {
            return Ok(());
        }
        self.fetch_into(st, &name, dest).await
    }

    pub(super) async fn fetch_into(&self, st: &Storage, name: &str, dest: &Path) -> Result<(), ServiceError> {
        let started = Instant::now();
        // Only the version this host (or another sharing its state database) committed comes back: the bucket
        // may be writable by others, and these files are handed to a VMM (a qcow2 header names files to open).
        let pinned = self.db.remote_get(name)?.and_then(|r| r.manifest_digest);
        let Some(pinned) = pinned else {
            return Err(ServiceError::Typed(
                ErrorCode::StorageUnavailable,
                format!("{name} has no committed version recorded on this host; it is not fetched"),
            ));
        };
        // Progress for `GET` answers (and the CLI's bar) while the fetch runs.
        lock(&st.fetches).insert(name.to_string(), hearth_api::FetchProgress::default());
        let fetches = st.fetches.clone();
        let key = name.to_string();
        let progress: hearth_store::ProgressFn = Arc::new(move |p: hearth_store::Progress| {
            if let Some(e) = lock(&fetches).get_mut(&key) {
                *e = hearth_api::FetchProgress {
                    done_bytes: p.done_bytes,
                    total_bytes: p.total_bytes,
                };
            }
        });
        let fetched = st
            .store
            .get_object_pinned(name, dest, Some(progress), Some(&pinned))
            .await;
        lock(&st.fetches).remove(name);
        match fetched {
            Ok(stats) => {
                st.healthy();
                if let Err(e) = self.db.remote_set_evicted(name, None) {
                    tracing::warn!(object = %name, error = %e, "recording a fetch");
                }
                st.bytes_down.fetch_add(stats.downloaded_bytes, Ordering::Relaxed);
                metrics::counter!("hearth_storage_bytes_downloaded_total").increment(stats.downloaded_bytes);
                tracing::info!(object = %name, bytes = stats.total_bytes, downloaded = stats.downloaded_bytes,
                    secs = started.elapsed().as_secs_f64(), "fetched from the storage bucket");
                Ok(())
            }
            Err(e) => {
                st.unhealthy(&e);
                tracing::warn!(object = %name, error = %e, "fetch from the storage bucket failed");
                Err(fetch_error(e))
            }
        }
    }

    /// One attempt at a pending or deleting row.
    async fn storage_attempt(&self, st: &Storage, row: &RemoteRow) -> Result<Outcome, StoreError> {
        if row.state == RemoteState::Deleting {
            st.store.delete_object(&row.name).await?;
            return Ok(Outcome::Done {
                sent: 0,
                digest: String::new(),
            });
        }
        let Some(kind) = Kind::parse(&row.kind) else {
            return Ok(Outcome::Gone);
        };
        let io = |path: &Path, e: std::io::Error| StoreError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let (dir, extra) = match kind {
            Kind::Pause => {
                let Ok(Some(sbx)) = self.db.get(&row.owner) else {
                    return Ok(Outcome::Gone);
                };
                let Some(paused) = sbx.paused.filter(|_| sbx.state == SandboxState::Paused) else {
                    return Ok(Outcome::Gone);
                };
                let disk = sbx.disk.map(|d| FileSource::new(SANDBOX_DISK, d));
                (self.settings.paths.sandbox_dir(&row.owner).join(paused.dir), disk)
            }
            Kind::Snapshot => (self.settings.paths.snapshot_dir(&row.owner), None),
            Kind::Template => (self.settings.paths.user_templates_dir().join(&row.owner), None),
            // A lost local image never removes the bucket's copy (it is what a recreate needs).
            Kind::Sync => match self.db.get(&row.owner) {
                Ok(Some(_)) => {
                    let dir = super::sync::image_dir(&self.settings.paths, &row.owner);
                    std::fs::metadata(&dir).map_err(|e| io(&dir, e))?;
                    (dir, None)
                }
                _ => return Ok(Outcome::Gone),
            },
        };
        if !dir.is_dir() {
            return Ok(Outcome::Gone);
        }
        complete_hashes(dir.clone()).await.map_err(|e| io(&dir, e))?;
        let mut files = dir_files(&dir).map_err(|e| io(&dir, e))?;
        files.extend(extra);
        let metadata = serde_json::json!({"kind": row.kind, "owner": row.owner, "version": row.version});
        let opts = PutOptions {
            metadata: Some(metadata),
            progress: None,
        };
        let stats = st.store.put_object(&row.name, &files, opts).await?;
        metrics::counter!("hearth_storage_chunks_uploaded_total").increment(stats.chunks_uploaded);
        metrics::counter!("hearth_storage_chunk_hits_total").increment(stats.chunk_hits);
        tracing::info!(object = %row.name, total = stats.total_bytes, uploaded = stats.uploaded_bytes,
            chunks_uploaded = stats.chunks_uploaded, chunk_hits = stats.chunk_hits, "uploaded to the storage bucket");
        Ok(Outcome::Done {
            sent: stats.uploaded_bytes,
            digest: stats.manifest_digest,
        })
    }

    async fn storage_run(&self, st: &Storage, row: RemoteRow) {
        let result = self.storage_attempt(st, &row).await;
        let now = now_ms();
        let recorded = match (result, row.state) {
            (Ok(Outcome::Done { .. }), RemoteState::Deleting) => {
                st.healthy();
                tracing::info!(object = %row.name, "removed from the storage bucket");
                self.db
                    .remote_forget(&row.name, RemoteState::Deleting)
                    .map(|_| ())
            }
            (Ok(Outcome::Done { sent, digest }), _) => {
                st.healthy();
                st.bytes_up.fetch_add(sent, Ordering::Relaxed);
                metrics::counter!("hearth_storage_bytes_uploaded_total").increment(sent);
                self.db
                    .remote_synced(&row.name, row.version, sent, &digest, now)
                    .map(|_| ())
            }
            // The local copy was consumed (resumed) or removed: an older remote version is stale, remove it too.
            (Ok(Outcome::Gone), _) => self.db.remote_deleting(&row.name, &row.kind, &row.owner, now),
            (Err(e), _) => {
                st.unhealthy(&e);
                metrics::counter!("hearth_storage_errors_total").increment(1);
                let wait = MAX_BACKOFF.min(Duration::from_millis(500) * 2u32.pow(row.attempts.min(6)));
                tracing::warn!(object = %row.name, error = %e, retry_in_s = wait.as_secs_f64(),
                    "storage bucket: will try again");
                lock(&st.backoff).insert(row.name.clone(), Instant::now() + wait);
                self.db.remote_failed(&row.name, &e.to_string(), now)
            }
        };
        if let Err(e) = recorded {
            tracing::error!(object = %row.name, error = %e, "recording a storage result");
        }
    }

    /// Starts the rows that are due, up to [`UPLOADS`] at a time.
    fn storage_start_due(&self, st: &Arc<Storage>) -> Result<(), ServiceError> {
        let rows = self.db.remote_list()?;
        let waiting = rows.iter().filter(|r| r.state != RemoteState::Synced).count();
        metrics::gauge!("hearth_storage_pending_objects").set(waiting as f64);
        let now = Instant::now();
        for row in rows {
            if row.state == RemoteState::Synced || st.is_running(&row.name) {
                continue;
            }
            if lock(&st.running).values().filter(|h| !h.is_finished()).count() >= UPLOADS {
                break;
            }
            if lock(&st.backoff).get(&row.name).is_some_and(|t| *t > now) {
                continue;
            }
            // A pause being resumed is left alone (the resume cancelled its upload, and may consume it).
            if row.kind == Kind::Pause.as_str()
                && row.state == RemoteState::Pending
                && self
                    .db
                    .get(&row.owner)?
                    .is_some_and(|s| s.state == SandboxState::Resuming)
            {
                continue;
            }
            let this = self.arc()?;
            let st2 = st.clone();
            let name = row.name.clone();
            let task = tokio::spawn(async move {
                this.storage_run(&st2, row).await;
                st2.wake.notify_one();
            });
            lock(&st.running).insert(name, task.abort_handle());
        }
        lock(&st.running).retain(|_, h| !h.is_finished());
        Ok(())
    }

    /// One GC pass now (also `POST /v1/storage/gc`).
    pub async fn storage_gc(&self, grace: Option<Duration>) -> Result<StorageGcReport, ServiceError> {
        let st = self.storage_required()?;
        let opts = GcOptions {
            grace: grace.unwrap_or(st.settings.gc_grace),
            ..GcOptions::default()
        };
        // hearth-store's GC future is not `Send` for every lifetime (a closure over listed metadata), so the pass
        // runs on a blocking thread driving it on this runtime.
        let store = st.store.clone();
        let runtime = tokio::runtime::Handle::current();
        let pass = tokio::task::spawn_blocking(move || {
            runtime.block_on(async {
                let report = store.gc(&opts).await?;
                let usage = store.usage().await?;
                Ok::<_, StoreError>((report, usage))
            })
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("storage GC task: {e}")))?;
        let (report, usage) = pass.map_err(|e| {
            st.unhealthy(&e);
            fetch_error(e)
        })?;
        tracing::info!(
            deleted = report.deleted,
            bytes = report.deleted_bytes,
            kept_young = report.kept_young,
            chunks_after = usage.chunks,
            "storage GC pass"
        );
        let n = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        Ok(StorageGcReport {
            objects: n(report.objects),
            chunks: n(report.chunks),
            referenced: n(report.referenced),
            deleted: n(report.deleted),
            deleted_bytes: report.deleted_bytes,
            kept_young: n(report.kept_young),
            chunks_after: n(usage.chunks),
            chunk_bytes_after: usage.chunk_bytes,
        })
    }
}

/// Uploads and removes objects in the background for as long as the daemon runs; resumes whatever the database
/// still lists as pending after a restart.
pub async fn worker(svc: Arc<Sandboxes>) {
    let Some(st) = svc.storage().cloned() else { return };
    loop {
        if let Err(e) = svc.storage_start_due(&st) {
            tracing::warn!(error = %e, "storage worker");
        }
        // Synced objects may leave the local cache now (a no-op without --cache-size).
        let evict = svc.clone();
        match tokio::task::spawn_blocking(move || evict.cache_evict()).await {
            Ok(Err(e)) => tracing::warn!(error = %e, "cache eviction"),
            Err(e) => tracing::warn!(error = %e, "cache eviction task"),
            Ok(Ok(_)) => {}
        }
        tokio::select! {
            _ = st.wake.notified() => {}
            _ = tokio::time::sleep(TICK) => {}
        }
    }
}

/// Runs a GC pass every `gc_interval`.
pub async fn gc_loop(svc: Arc<Sandboxes>) {
    let Some(interval) = svc.storage().map(|s| s.settings.gc_interval) else {
        return;
    };
    loop {
        tokio::time::sleep(interval.max(Duration::from_secs(1))).await;
        if let Err(e) = svc.storage_gc(None).await {
            tracing::warn!(error = %e, "storage GC pass failed");
        }
    }
}
