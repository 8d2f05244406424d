//! A content-addressed chunk store over S3-compatible object storage (Amazon S3, MinIO, Cloudflare R2).
//!
//! It stores named *objects*, each a set of files, as fixed-size chunks plus a manifest, so that bytes shared by
//! several objects (a template and its forks, successive saves of one object) are uploaded and stored once and
//! a re-save uploads only the chunks that changed. It knows nothing of sandboxes: callers name objects and
//! attach their own metadata.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use hearth_store::{FileSource, PutOptions, Store, StoreConfig};
//! let config = StoreConfig::from_url("s3://my-bucket/hearth")?;
//! hearth_store::probe(&config).await?;
//! let store = Store::open(config).await?;
//! let files = [FileSource::new("memory", "/var/lib/x/memory"), FileSource::new("disk", "/var/lib/x/disk")];
//! let stats = store.put_object("sandboxes/sb-1/pause", &files, PutOptions::default()).await?;
//! store.get_object("sandboxes/sb-1/pause", "/var/lib/x/restored".as_ref(), None).await?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`config`]: [`StoreConfig`] (`s3://BUCKET/PREFIX`, AWS environment and shared credentials file),
//!   [`StoreKey`] (encryption key file), [`Secret`].
//! - [`name`]: [`ObjectName`] and file-name validation; no key or path is built from anything else.
//! - `remote`: the object_store S3 client, the key layout, error classification.
//! - `crypto`: chunk ids (SHA-256, or keyed HMAC-SHA256) and XChaCha20-Poly1305 sealing.
//! - [`manifest`]: the manifest format ([`Manifest`]).
//! - `upload` ([`Store::put_object`]), `download` ([`Store::get_object`]), `gc` ([`Store::gc`]),
//!   `probe` ([`probe`]); `pins`: the in-process upload/GC coordination.
//! - [`error`]: [`StoreError`], [`RemoteError`] and its [`RemoteErrorKind`], [`ProbeError`], [`ConfigError`].
//!
//! In the bucket, under the prefix: `hearth-store.json` (format marker and key check),
//! `chunks/<2 hex>/<64 hex>` (one object per distinct non-zero chunk), `manifests/<name>/MANIFEST` (one per
//! committed object), `probe/<random>` (transient). See the crate README for the rules.

pub mod config;
mod crypto;
mod download;
pub mod error;
mod gc;
pub mod manifest;
pub mod name;
mod pins;
mod probe;
mod remote;
mod upload;

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub use config::{Credentials, Secret, StoreConfig, StoreKey};
pub use crypto::ChunkId;
pub use download::GetStats;
pub use error::{ConfigError, ProbeError, ProbeStep, RemoteError, RemoteErrorKind, StoreError};
pub use gc::{GcOptions, GcReport};
pub use manifest::{FileEntry, Manifest};
pub use name::ObjectName;
pub use probe::probe;
pub use remote::{remote_error, s3_client};
pub use upload::{FileSource, PutOptions, PutStats};

/// Upload or download progress: bytes processed (uploaded, skipped as known or zero; downloaded or holes) out of
/// the object's total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Bytes done.
    pub done_bytes: u64,
    /// The object's total size.
    pub total_bytes: u64,
}

/// A progress callback; called from the runtime's threads, so keep it short (e.g. store into an atomic or send
/// on a channel).
pub type ProgressFn = Arc<dyn Fn(Progress) + Send + Sync>;

/// A committed object as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its name.
    pub name: ObjectName,
    /// When its manifest was written (the server's clock).
    pub committed_at: std::time::SystemTime,
}

/// What the bucket holds under the prefix (from one listing of the chunks and manifests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Committed objects.
    pub objects: usize,
    /// Chunk objects.
    pub chunks: usize,
    /// Bytes stored in chunk objects (ciphertext size when encrypted).
    pub chunk_bytes: u64,
    /// Bytes stored in manifests.
    pub manifest_bytes: u64,
}

/// An open store. Cheap to clone; all clones share one client, one pin set and one index of known chunks.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<StoreConfig>,
    remote: remote::Remote,
    codec: crypto::Codec,
    pins: Arc<pins::Pins>,
}

/// The store's format marker (`hearth-store.json`), plaintext.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Marker {
    format: String,
    version: u32,
    encryption: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_check: Option<String>,
}

const FORMAT: &str = "hearth-store";
const ENCRYPTION: &str = "xchacha20poly1305";

impl Store {
    /// Opens the store under `config`'s prefix, creating its marker on first use. Refuses a wrong key, a
    /// missing key for an encrypted store and a key for a plaintext one, before any object is touched.
    pub async fn open(config: StoreConfig) -> Result<Store, StoreError> {
        let config = Arc::new(config);
        let remote = remote::Remote::new(config.clone())?;
        let codec = crypto::Codec::new(config.key.as_ref());
        let store = Store {
            inner: Arc::new(Inner {
                config,
                remote,
                codec,
                pins: Arc::default(),
            }),
        };
        store.check_marker().await?;
        Ok(store)
    }

    async fn check_marker(&self) -> Result<(), StoreError> {
        let (remote, codec) = (&self.inner.remote, &self.inner.codec);
        // A LIST first: some servers answer a GET in a missing bucket with "no such key" and create the
        // bucket on the first PUT, which would hide a wrong bucket name.
        remote.list(&remote.prefix_path("probe")).await?;
        let key = remote.marker_key();
        let stored = match remote.get(&key).await? {
            Some(b) => b,
            None => {
                let marker = Marker {
                    format: FORMAT.to_owned(),
                    version: 1,
                    encryption: if codec.encrypted() { ENCRYPTION } else { "none" }.to_owned(),
                    key_check: codec.key_check().map(hex::encode),
                };
                let json = serde_json::to_vec_pretty(&marker).expect("the marker serializes");
                if remote.put_new(&key, Bytes::from(json.clone())).await? {
                    return Ok(());
                }
                // Another process created it first: check against theirs.
                remote.get(&key).await?.unwrap_or_else(|| Bytes::from(json))
            }
        };
        let marker: Marker =
            serde_json::from_slice(&stored).map_err(|e| StoreError::BadMarker(e.to_string()))?;
        if marker.format != FORMAT || marker.version != 1 {
            return Err(StoreError::BadMarker(format!(
                "format {} version {}",
                marker.format, marker.version
            )));
        }
        match (marker.encryption.as_str(), codec.encrypted()) {
            ("none", false) => Ok(()),
            ("none", true) => Err(StoreError::NotEncrypted),
            (ENCRYPTION, false) => Err(StoreError::KeyRequired),
            (ENCRYPTION, true) => {
                let check = marker
                    .key_check
                    .as_deref()
                    .and_then(|h| hex::decode(h).ok())
                    .unwrap_or_default();
                if codec.verify_key_check(&check) {
                    Ok(())
                } else {
                    Err(StoreError::WrongKey)
                }
            }
            (other, _) => Err(StoreError::BadMarker(format!("unknown encryption {other}"))),
        }
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    /// Reads and checks an object's manifest.
    pub async fn get_manifest(&self, name: &str) -> Result<Manifest, StoreError> {
        let name = ObjectName::new(name)?;
        self.read_manifest(&name).await
    }

    async fn read_manifest(&self, name: &ObjectName) -> Result<Manifest, StoreError> {
        Ok(self.read_manifest_with_digest(name).await?.0)
    }

    /// The manifest and the SHA-256 (hex) of its plaintext.
    async fn read_manifest_with_digest(&self, name: &ObjectName) -> Result<(Manifest, String), StoreError> {
        let key = self.inner.remote.manifest_key(name);
        let stored = self
            .inner
            .remote
            .get(&key)
            .await?
            .ok_or_else(|| StoreError::NotFound(name.to_string()))?;
        let corrupt = |reason: String| StoreError::ManifestCorrupt {
            object: name.to_string(),
            reason,
        };
        let json = self
            .inner
            .codec
            .decode_manifest(name.as_str(), &stored)
            .map_err(|r| corrupt(r.to_owned()))?;
        let manifest: Manifest = serde_json::from_slice(&json).map_err(|e| corrupt(e.to_string()))?;
        manifest.validate(name.as_str())?;
        Ok((manifest, manifest::digest_hex(&json)))
    }

    /// Committed objects whose names start with `prefix` by whole segments (`"templates"` lists
    /// `templates/a` and `templates/b/c`, not `templatesx`); `""` lists all. Sorted by name.
    pub async fn list_objects(&self, prefix: &str) -> Result<Vec<ObjectInfo>, StoreError> {
        let within = match prefix.trim_end_matches('/') {
            "" => None,
            p => Some(ObjectName::new(p)?),
        };
        let remote = &self.inner.remote;
        let mut out: Vec<ObjectInfo> = remote
            .list_manifests(within.as_ref())
            .await?
            .into_iter()
            .filter_map(|m| {
                Some(ObjectInfo {
                    name: remote.name_of_manifest(&m.location)?,
                    committed_at: m.last_modified.into(),
                })
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Counts what the bucket holds under the prefix.
    pub async fn usage(&self) -> Result<Usage, StoreError> {
        let remote = &self.inner.remote;
        let chunks = remote.list_chunks().await?;
        let manifests = remote.list_manifests(None).await?;
        Ok(Usage {
            objects: manifests.len(),
            chunks: chunks.len(),
            chunk_bytes: chunks.iter().map(|c| c.size).sum(),
            manifest_bytes: manifests.iter().map(|m| m.size).sum(),
        })
    }

    /// Deletes an object's manifest (its chunks go at the next [`Store::gc`] once nothing else references
    /// them). Returns whether the object existed.
    pub async fn delete_object(&self, name: &str) -> Result<bool, StoreError> {
        let name = ObjectName::new(name)?;
        let key = self.inner.remote.manifest_key(&name);
        let existed = self.inner.remote.head(&key).await?.is_some();
        self.inner.remote.delete(&key).await?;
        Ok(existed)
    }
}
