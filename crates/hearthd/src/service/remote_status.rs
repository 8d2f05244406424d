//! What the storage bucket and the local cache show: `GET /v1/storage` (bucket, health, pending uploads, cache
//! use, where each paused sandbox, snapshot and template lives), the `storage` finding of `GET /v1/system` and
//! `hearth doctor`, and the `storage` field of sandbox, snapshot and template answers.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use hearth_api::{Check, ObjectStorage, StorageStatus, StoredObject};

use super::lifecycle::rfc3339;
use super::remote::{Kind, Storage, lock};
use super::{Sandboxes, ServiceError};
use crate::db::remote::{RemoteRow, RemoteState};

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

impl Sandboxes {
    pub(super) fn storage_required(&self) -> Result<Arc<Storage>, ServiceError> {
        self.storage().cloned().ok_or_else(|| {
            ServiceError::Conflict(
                "no storage bucket is configured (hearthd --storage s3://BUCKET/PREFIX)".into(),
            )
        })
    }

    /// `GET /v1/storage`.
    pub fn storage_status(&self) -> Result<StorageStatus, ServiceError> {
        let st = self.storage_required()?;
        let rows = self.db.remote_list()?;
        let objects = rows.iter().map(|r| self.stored_object(r)).collect();
        let count =
            |s: RemoteState| u32::try_from(rows.iter().filter(|r| r.state == s).count()).unwrap_or(u32::MAX);
        let last_error = lock(&st.last_error).clone();
        Ok(StorageStatus {
            url: st.url.clone(),
            endpoint: st.store.config().endpoint.clone(),
            encrypted: st.settings.key_file.is_some(),
            health: if last_error.is_some() { "unavailable" } else { "ok" }.into(),
            last_error,
            pending_uploads: count(RemoteState::Pending),
            pending_deletes: count(RemoteState::Deleting),
            bytes_uploaded: st.bytes_up.load(Ordering::Relaxed),
            bytes_downloaded: st.bytes_down.load(Ordering::Relaxed),
            cache: self.cache_status(&st, &rows),
            objects,
        })
    }

    /// Whether `r`'s local copy is on this host.
    fn is_local(&self, r: &RemoteRow) -> bool {
        Kind::parse(&r.kind).is_some_and(|kind| {
            self.local_paths(kind, &r.owner)
                .first()
                .is_some_and(|d| d.is_dir())
        })
    }

    fn location(&self, r: &RemoteRow) -> &'static str {
        match (self.is_local(r), r.state == RemoteState::Synced) {
            (true, true) => "both",
            (false, true) => "remote",
            _ => "local",
        }
    }

    fn stored_object(&self, r: &RemoteRow) -> StoredObject {
        let local_bytes = Kind::parse(&r.kind).map_or(0, |kind| self.local_bytes(kind, &r.owner));
        StoredObject {
            name: r.name.clone(),
            kind: r.kind.clone(),
            owner: r.owner.clone(),
            sync: r.state.as_str().into(),
            location: self.location(r).into(),
            size_bytes: r.size_bytes,
            sent_bytes: r.sent_bytes,
            synced_at: r.synced_at_ms.map(rfc3339),
            attempts: r.attempts,
            last_error: r.last_error.clone(),
            local_bytes,
            last_used_at: Some(rfc3339(r.last_used_ms)),
        }
    }

    /// Where a paused sandbox's state, a snapshot or a template lives, for its `GET` answer (`None` without a
    /// storage bucket, or when the bucket has no record of it).
    pub(crate) fn object_storage(&self, kind: Kind, owner: &str) -> Option<ObjectStorage> {
        let st = self.storage()?;
        let name = kind.object(owner);
        let r = self.db.remote_get(&name).ok()??;
        if r.state == RemoteState::Deleting {
            return None;
        }
        Some(ObjectStorage {
            location: self.location(&r).into(),
            bytes: r.size_bytes,
            sync: r.state.as_str().into(),
            synced_at: r.synced_at_ms.map(rfc3339),
            fetch: lock(&st.fetches).get(&name).copied(),
        })
    }

    /// The objects a create may fetch from the bucket (the snapshots and saved templates it starts from, a
    /// synced disk and its bases), by object name: what its event stream reports on.
    pub fn create_fetch_objects(&self, req: &hearth_api::CreateSandboxRequest) -> Vec<String> {
        let mut objects = self.base_chain(req.template.as_deref(), req.snapshot.as_deref());
        objects.extend(self.sync_source_objects(req));
        objects.iter().map(|(k, o)| k.object(o)).collect()
    }

    /// The objects a resume of `id` may fetch: its paused state and what its disk builds on.
    pub fn resume_fetch_objects(&self, id: &str) -> Vec<String> {
        let Ok(Some(row)) = self.db.get(id) else {
            return Vec::new();
        };
        let mut objects = vec![(Kind::Pause, id.to_string())];
        objects.extend(self.base_chain(Some(&row.template), row.snapshot_id.as_deref()));
        objects.iter().map(|(k, o)| k.object(o)).collect()
    }

    /// The fetches in flight among `objects` (names), with their progress.
    pub fn fetches_of(&self, objects: &[String]) -> Vec<(String, hearth_api::FetchProgress)> {
        let Some(st) = self.storage() else {
            return Vec::new();
        };
        let fetches = lock(&st.fetches);
        objects
            .iter()
            .filter_map(|o| fetches.get(o).map(|p| (o.clone(), *p)))
            .collect()
    }

    /// The `storage` finding of `GET /v1/system` (and `hearth doctor`), when a bucket is configured.
    pub(crate) fn storage_check(&self) -> Option<Check> {
        let st = self.storage()?;
        let rows = self.db.remote_list().unwrap_or_default();
        let pending = rows.iter().filter(|r| r.state != RemoteState::Synced).count();
        let cache = self.cache_status(st, &rows);
        let limit = match cache.limit_bytes {
            Some(l) => format!("of {}", gib(l)),
            None => "(unbounded)".into(),
        };
        let last_error = lock(&st.last_error).clone();
        let (status, health) = match &last_error {
            None => ("ok", "reachable".to_string()),
            Some(e) => ("warn", format!("unavailable ({e})")),
        };
        Some(Check {
            name: "storage".into(),
            status: status.into(),
            detail: format!(
                "{}{}: {health}; {pending} pending uploads/deletes; local cache {} {limit}, {} evicted",
                st.url,
                if st.settings.key_file.is_some() {
                    " (encrypted)"
                } else {
                    ""
                },
                gib(cache.used_bytes),
                cache.evictions
            ),
        })
    }
}
