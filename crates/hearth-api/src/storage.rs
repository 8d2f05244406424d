use serde::{Deserialize, Serialize};

/// Body of `GET /v1/storage`: the storage bucket (`hearthd --storage`), its health and what it holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct StorageStatus {
    /// `s3://BUCKET/PREFIX`.
    pub url: String,
    /// The endpoint when not AWS (MinIO, R2, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Chunks are encrypted client-side (`--storage-key`).
    pub encrypted: bool,
    /// `ok` when the last bucket request succeeded, `unavailable` after a failed one.
    pub health: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Objects whose newest local version is not in the bucket yet.
    pub pending_uploads: u32,
    /// Objects deleted locally whose remote copy is still to be removed.
    pub pending_deletes: u32,
    /// Bytes sent to and fetched from the bucket since the daemon started.
    pub bytes_uploaded: u64,
    pub bytes_downloaded: u64,
    /// The local cache of what the bucket holds (`hearthd --cache-size`).
    #[serde(default)]
    pub cache: CacheStatus,
    pub objects: Vec<StoredObject>,
}

/// Local disk as a cache of the bucket: the local copies of paused sandboxes, snapshots and templates.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CacheStatus {
    /// Bytes the local copies take on disk (allocated blocks).
    pub used_bytes: u64,
    /// `--cache-size`: above it, least recently used copies that the bucket holds are removed locally.
    /// Absent: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// Local copies removed since the daemon started.
    pub evictions: u64,
}

/// One paused sandbox, snapshot or template and where it lives.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct StoredObject {
    /// Its name in the bucket (`sandboxes/<id>/pause`, `snapshots/<id>`, `templates/<name>`).
    pub name: String,
    /// `pause`, `snapshot` or `template`.
    pub kind: String,
    /// The sandbox id, snapshot id or template name.
    pub owner: String,
    /// `pending`, `synced` or `deleting`.
    pub sync: String,
    /// `local`, `remote` or `both`.
    pub location: String,
    pub size_bytes: u64,
    /// Bytes the last upload actually sent (chunks the bucket did not have yet).
    pub sent_bytes: u64,
    /// RFC 3339, when the bucket got this version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synced_at: Option<String>,
    pub attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Bytes its local copy takes on disk (0 when it is only in the bucket).
    #[serde(default)]
    pub local_bytes: u64,
    /// RFC 3339, when it was last committed or used (resume, create from, fork from): the cache's LRU order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_used_at: Option<String>,
}

/// Where a paused sandbox's state, a snapshot or a template lives (`storage` in their `GET` answers; only with
/// `hearthd --storage`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ObjectStorage {
    /// `local` (not in the bucket yet), `remote` (only in the bucket: fetched on next use) or `both`.
    pub location: String,
    /// Its size (logical bytes of its files).
    pub bytes: u64,
    /// `pending` (the bucket does not hold this version yet) or `synced`.
    pub sync: String,
    /// RFC 3339, when the bucket got this version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synced_at: Option<String>,
    /// While a resume or create fetches it from the bucket (its local copy was gone): how far it got.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetch: Option<FetchProgress>,
}

/// Progress of a fetch from the storage bucket (chunks downloaded and verified, or holes).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct FetchProgress {
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// Shortest `disk_sync_interval_s` a create may ask for: each sync stops the guest for a moment and reads its
/// whole disk overlay.
pub const MIN_DISK_SYNC_INTERVAL_S: u64 = 60;

/// Body of `POST /v1/sandboxes/{id}/sync`: the disk image just captured from the running sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct DiskSync {
    pub sandbox_id: String,
    /// Its name in the bucket (`sandboxes/<id>/sync`); each sync replaces the previous version, uploading only
    /// the chunks that changed.
    pub object: String,
    /// This version (the capture time in Unix milliseconds).
    pub version: i64,
    /// RFC 3339 capture time.
    pub captured_at: String,
    /// Logical size of the captured disk file.
    pub size_bytes: u64,
    /// How long the guest's vCPUs were stopped for the capture, in milliseconds.
    pub stopped_ms: f64,
    /// How the disk was copied while stopped: `reflink` (the file system shares extents) or `sparse`.
    pub copy: String,
    /// `pending` (uploading in the background; `GET /v1/storage` shows progress) or `synced`.
    pub upload: String,
}

/// Body of `POST /v1/storage/gc`: one garbage-collection pass over the bucket.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct StorageGcReport {
    pub objects: u64,
    pub chunks: u64,
    pub referenced: u64,
    pub deleted: u64,
    pub deleted_bytes: u64,
    /// Unreferenced chunks kept because they are younger than the grace period.
    pub kept_young: u64,
    /// Chunks in the bucket after the pass and the bytes they hold.
    pub chunks_after: u64,
    pub chunk_bytes_after: u64,
}
