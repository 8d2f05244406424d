//! Disk sync: a crash-consistent image of a RUNNING sandbox's disk in the storage bucket, taken while the
//! sandbox keeps running, and new sandboxes recreated from it.
//!
//! - Sync (`POST /v1/sandboxes/{id}/sync`, and every `disk_sync_interval_s` by [`sync_loop`]): under the
//!   sandbox's lifecycle lock (so a pause, destroy or a second sync waits), the guest agent flushes the guest's
//!   file systems (the same `Sync` a pause uses), then the VMM driver stops the vCPUs only while it copies the
//!   disk file ([`hearth_vmm::Vmm::capture_disk`]: QEMU `stop`/`cont`, Firecracker `PATCH /vm`; a reflink
//!   where the file system shares extents, else a sparse copy) into `<data>/syncs/<id>/.capture`. The copy
//!   replaces `<data>/syncs/<id>/disk` (a rename: a concurrent reader keeps the old file whole) and becomes
//!   version `<capture time>` of the object `sandboxes/<id>/sync`, uploaded by [`super::remote`]'s worker like
//!   a pause: content-addressed chunks, so a later sync sends only the chunks that changed, and the manifest
//!   last. An upload of the previous image still in flight is cancelled first (it commits nothing).
//! - A paused sandbox is refused with `conflict`: its pause (`sandboxes/<id>/pause`) already holds its disk.
//! - Recreate (`POST /v1/sandboxes {"from_sync": ID}`): a NEW sandbox, cold-booted with the source's template,
//!   vCPUs and memory, whose own disk is a copy of the last image: the local one, or the committed version
//!   fetched from the bucket (every chunk verified by hearth-store, only the version this host recorded
//!   accepted). The source may be running, failed (its host lost it) or paused; it must still exist (it is
//!   looked up in the caller's project like any sandbox), and its image goes when it is destroyed.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hearth_api::{CreateSandboxRequest, DiskSync, ErrorCode, MIN_DISK_SYNC_INTERVAL_S, SandboxState};
use tokio::time::Instant;

use super::lifecycle::rfc3339;
use super::remote::Kind;
use super::{Sandboxes, ServiceError, now_ms};
use crate::config::Paths;
use crate::db::disk_sync::SyncedImage;
use crate::db::remote::RemoteState;

/// The image's file name in its directory (and in the bucket object).
const IMAGE: &str = "disk";
/// Where a capture is written before it replaces the image (dot files are not uploaded).
const CAPTURE: &str = ".capture";
/// How often the periodic loop looks for sandboxes whose interval has passed.
const TICK: Duration = Duration::from_secs(5);
/// Longest interval accepted (a day), so that the arithmetic stays far from overflow.
const MAX_INTERVAL_S: u64 = 86_400;

/// The directory of a sandbox's synced image: `<data>/syncs/<id>`. `id` must be a validated sandbox id.
pub(crate) fn image_dir(paths: &Paths, id: &str) -> PathBuf {
    paths.data_dir.join("syncs").join(id)
}

/// A synced image a create starts from.
#[derive(Debug)]
pub(crate) struct SyncedDisk {
    /// The local image (copied, never used in place: later syncs replace it).
    pub image: PathBuf,
    /// The file name the new sandbox's disk gets (the source's, from the same VMM driver).
    pub file_name: std::ffi::OsString,
    /// The snapshot the source's disk builds on (its overlay's base, when it was created from a snapshot or a
    /// memory template): the new sandbox's copy builds on it too, so it records it as its own `snapshot_id`
    /// (the snapshot cannot be deleted or evicted from the cache while the new sandbox uses it).
    pub base_snapshot: Option<String>,
}

impl Sandboxes {
    /// Checks `disk_sync_interval_s` of a create: absent is off; otherwise between the minimum and a day, and
    /// only with a storage bucket.
    pub(crate) fn validate_sync_interval(&self, interval_s: Option<u64>) -> Result<(), ServiceError> {
        let Some(s) = interval_s else { return Ok(()) };
        if !(MIN_DISK_SYNC_INTERVAL_S..=MAX_INTERVAL_S).contains(&s) {
            return Err(ServiceError::InvalidArgument(format!(
                "disk_sync_interval_s must be between {MIN_DISK_SYNC_INTERVAL_S} and {MAX_INTERVAL_S} seconds"
            )));
        }
        self.storage_configured().map(|_| ())
    }

    fn storage_configured(&self) -> Result<Arc<super::remote::Storage>, ServiceError> {
        self.storage().cloned().ok_or_else(|| {
            ServiceError::Typed(
                ErrorCode::StorageNotConfigured,
                "disk sync needs a storage bucket: start hearthd with --storage s3://BUCKET/PREFIX".into(),
            )
        })
    }

    /// `POST /v1/sandboxes/{id}/sync`: captures the running sandbox's disk and queues its upload.
    pub async fn sync_disk(&self, id: &str) -> Result<DiskSync, ServiceError> {
        self.row(id)?;
        self.storage_configured()?;
        let this = self.arc()?;
        let id = id.to_string();
        // In its own task: a client that goes away must not cancel it between the VM's stop and continue.
        tokio::spawn(async move { this.sync_now(&id, None).await })
            .await
            .unwrap_or_else(|e| Err(ServiceError::Internal(format!("sync task: {e}"))))?
            .ok_or_else(|| ServiceError::Internal("sync skipped".into()))
    }

    /// The sync itself. With `due_after_ms`, only if the last image (or the creation) is at least that old
    /// once the lock is held (the periodic loop; `None` when skipped).
    pub(crate) async fn sync_now(
        &self,
        id: &str,
        due_after_ms: Option<i64>,
    ) -> Result<Option<DiskSync>, ServiceError> {
        let st = self.storage_configured()?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let row = self.row(id)?;
        if let Some(after) = due_after_ms {
            let last = self.db.sync_get(id)?.and_then(|r| r.image).map(|i| i.version);
            if row.state != SandboxState::Running
                || now_ms().saturating_sub(last.unwrap_or(row.created_at_ms)) < after
            {
                return Ok(None);
            }
        }
        match row.state {
            SandboxState::Running => {}
            SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {id} is paused: its pause already holds its disk (sandboxes/{id}/pause in the \
                     storage bucket); resume it to sync"
                )));
            }
            other => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {id} is {}, only a running sandbox's disk can be synced",
                    other.as_str()
                )));
            }
        }
        let (Some(handle), Some(disk)) = (row.handle.clone(), row.disk.clone()) else {
            return Err(ServiceError::Internal(format!(
                "sandbox {id} has no VM handle or disk recorded"
            )));
        };
        let live = self
            .live(id)
            .ok_or_else(|| ServiceError::AgentUnavailable(format!("sandbox {id} has no agent connection")))?;
        let client = self.ensure_connected(&live, Duration::from_secs(5)).await?;
        super::pause::guest_sync(&client).await?;

        let dir = image_dir(&self.settings.paths, id);
        let capture = dir.join(CAPTURE);
        let io =
            |what: &str, e: std::io::Error| ServiceError::Internal(format!("{what} {}: {e}", dir.display()));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io("creating", e))?;
        match std::fs::remove_file(&capture) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io("clearing", e)),
            _ => {}
        }
        let version = now_ms();
        let cap = self
            .vmm
            .capture_disk(&handle, &disk, &capture)
            .await
            .map_err(|e| ServiceError::VmmFailed(format!("capturing the disk of {id}: {e}")))?;
        let image = dir.join(IMAGE);
        std::fs::rename(&capture, &image)
            .and_then(|()| std::fs::File::open(&dir)?.sync_all())
            .map_err(|e| io("placing the image in", e))?;
        // An upload of the previous image reads the file just replaced: stop it (its manifest is written last,
        // so it commits nothing); the new version is uploaded instead.
        st.cancel(&Kind::Sync.object(id)).await;
        let size_bytes = std::fs::metadata(&image).map(|m| m.len()).unwrap_or(0);
        let stopped_us = u64::try_from(cap.stopped.as_micros()).unwrap_or(u64::MAX);
        let record = SyncedImage {
            version,
            size_bytes,
            format: cap.format.as_str().to_string(),
            stopped_us,
        };
        self.db.sync_captured(id, &record)?;
        self.storage_committed(Kind::Sync, id, version, size_bytes);
        metrics::histogram!("hearth_disk_sync_stopped_seconds").record(cap.stopped.as_secs_f64());
        let copy = match cap.method {
            hearth_vmm::CopyMethod::Reflink => "reflink",
            hearth_vmm::CopyMethod::Sparse => "sparse",
        };
        tracing::info!(sandbox = %id, version, bytes = size_bytes, stopped_ms = cap.stopped.as_secs_f64() * 1e3,
            copy, "disk captured for sync");
        let upload = self
            .db
            .remote_get(&Kind::Sync.object(id))?
            .filter(|r| r.version == version && r.state == RemoteState::Synced)
            .map_or("pending", |_| "synced");
        Ok(Some(DiskSync {
            sandbox_id: id.to_string(),
            object: Kind::Sync.object(id),
            version,
            captured_at: rfc3339(version),
            size_bytes,
            stopped_ms: cap.stopped.as_secs_f64() * 1e3,
            copy: copy.into(),
            upload: upload.into(),
        }))
    }

    /// Before a create with `from_sync`: checks it, makes the request the source's template and shape, and
    /// brings the last image (and the bases its disk builds on) to this host.
    pub(crate) async fn sync_source(
        &self,
        req: &mut CreateSandboxRequest,
    ) -> Result<Option<SyncedDisk>, ServiceError> {
        let Some(src) = req.from_sync.clone() else {
            return Ok(None);
        };
        if req.snapshot.is_some() {
            return Err(ServiceError::InvalidArgument(
                "from_sync and snapshot exclude each other".into(),
            ));
        }
        let row = self.row(&src)?;
        let Some(image) = self.db.sync_get(&src)?.and_then(|r| r.image) else {
            return Err(ServiceError::Typed(
                ErrorCode::NoDiskSync,
                format!("sandbox {src} has no synced disk (POST /v1/sandboxes/{src}/sync)"),
            ));
        };
        let differs = |asked: Option<u32>, have: u32| asked.is_some_and(|a| a != have);
        if req.template.as_ref().is_some_and(|t| *t != row.template)
            || differs(req.vcpus, row.vcpus)
            || differs(req.memory_mib, row.memory_mib)
        {
            return Err(ServiceError::InvalidArgument(format!(
                "from_sync {src} fixes template {}, {} vCPUs and {} MiB",
                row.template, row.vcpus, row.memory_mib
            )));
        }
        let file_name = row
            .disk
            .as_deref()
            .and_then(Path::file_name)
            .map(ToOwned::to_owned)
            .filter(|_| row.vmm == self.vmm.kind())
            .ok_or_else(|| {
                ServiceError::Conflict(format!(
                    "the synced disk of {src} was written by the {} driver; this daemon runs {}",
                    row.vmm.as_str(),
                    self.vmm.kind().as_str()
                ))
            })?;
        req.template = Some(row.template.clone());
        req.vcpus = Some(row.vcpus);
        req.memory_mib = Some(row.memory_mib);
        // The image may be an overlay over the source's base (a template image, a snapshot's disk copy).
        let bases = CreateSandboxRequest {
            template: Some(row.template.clone()),
            snapshot: row.snapshot_id.clone(),
            ..Default::default()
        };
        self.storage_fetch_for_create(&bases).await?;
        let image_path = self.sync_fetch_image(&src, image.version).await?;
        Ok(Some(SyncedDisk {
            image: image_path,
            file_name,
            base_snapshot: row.snapshot_id,
        }))
    }

    /// What a create with `from_sync` uses from the cache: the source's synced image and the snapshots and
    /// templates its disk builds on ([`Sandboxes::cache_pin`] keeps them local from before their fetch until
    /// the new sandbox runs; from then on its own `snapshot_id` and template keep them).
    pub(crate) fn sync_source_objects(&self, req: &CreateSandboxRequest) -> Vec<(Kind, String)> {
        let Some(src) = req.from_sync.as_deref() else {
            return Vec::new();
        };
        let Ok(Some(row)) = self.db.get(src) else {
            return Vec::new();
        };
        let mut out = vec![(Kind::Sync, src.to_string())];
        out.extend(self.base_chain(Some(&row.template), row.snapshot_id.as_deref()));
        out
    }

    /// The local image of `src`, fetched from the bucket (the version this host committed) when it is gone.
    async fn sync_fetch_image(&self, src: &str, version: i64) -> Result<PathBuf, ServiceError> {
        let dir = image_dir(&self.settings.paths, src);
        let image = dir.join(IMAGE);
        if image.is_file() {
            return Ok(image);
        }
        let st = self.storage_configured()?;
        let name = Kind::Sync.object(src);
        let synced = self.db.remote_get(&name)?.and_then(|r| r.manifest_digest);
        if synced.is_none() {
            return Err(ServiceError::Typed(
                ErrorCode::StorageUnavailable,
                format!(
                    "the synced disk of {src} (version {version}) is not on this host and was not uploaded yet"
                ),
            ));
        }
        let parent = self.settings.paths.data_dir.join("syncs");
        let tmp = parent.join(format!(".fetch-{src}"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&parent)
            .map_err(|e| ServiceError::Internal(format!("creating {}: {e}", parent.display())))?;
        self.fetch_into(&st, &name, &tmp).await?;
        let placed = (|| {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&tmp, &dir)?;
            std::fs::File::open(&parent)?.sync_all()
        })();
        if let Err(e) = placed {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(ServiceError::Internal(format!(
                "placing the fetched disk of {src}: {e}"
            )));
        }
        if !image.is_file() {
            return Err(ServiceError::Typed(
                ErrorCode::StorageCorrupt,
                format!("{name} holds no {IMAGE} file"),
            ));
        }
        Ok(image)
    }

    /// Destroying a sandbox: its local image goes, and its object in the bucket.
    pub(crate) fn sync_forget(&self, id: &str) {
        let dir = image_dir(&self.settings.paths, id);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(sandbox = %id, error = %e, "removing the synced disk");
        }
        self.storage_deleted(Kind::Sync, id);
    }
}

/// The new sandbox's own disk: a copy of the synced image in its directory (reflink or sparse), fsynced.
pub(crate) async fn place_image(synced: &SyncedDisk, dir: &Path) -> Result<PathBuf, String> {
    let dest = dir.join(&synced.file_name);
    hearth_vmm::disk::copy_raw(&synced.image, &dest)
        .await
        .map_err(|e| format!("copying the synced disk: {e}"))?;
    Ok(dest)
}

/// Syncs running sandboxes whose `disk_sync_interval_s` has passed since their last image (or their creation),
/// one at a time, for as long as the daemon runs with a storage bucket.
pub async fn sync_loop(svc: Arc<Sandboxes>) {
    if svc.storage().is_none() {
        return;
    }
    loop {
        tokio::time::sleep(TICK).await;
        let rows = match svc.db.sync_periodic() {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "disk sync loop");
                continue;
            }
        };
        for r in rows {
            let Some(interval) = r.interval_s else { continue };
            let after = i64::try_from(interval.saturating_mul(1000)).unwrap_or(i64::MAX);
            let last = r.image.as_ref().map(|i| i.version);
            let Ok(Some(sbx)) = svc.db.get(&r.sandbox_id) else {
                continue;
            };
            if sbx.state != SandboxState::Running
                || now_ms().saturating_sub(last.unwrap_or(sbx.created_at_ms)) < after
            {
                continue;
            }
            let started = Instant::now();
            match svc.sync_now(&r.sandbox_id, Some(after)).await {
                Ok(Some(s)) => tracing::info!(sandbox = %r.sandbox_id, version = s.version,
                    secs = started.elapsed().as_secs_f64(), "periodic disk sync"),
                Ok(None) => {}
                Err(e) => tracing::warn!(sandbox = %r.sandbox_id, error = %e, "periodic disk sync failed"),
            }
        }
    }
}
