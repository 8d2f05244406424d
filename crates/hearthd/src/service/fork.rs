//! Snapshot objects and forks.
//!
//! A checkpoint (`POST /v1/sandboxes/{id}/snapshots`) flushes the guest's disks, then the driver stops the VM
//! only while it saves memory, device state and a copy of the disk into a durable snapshot directory
//! `<data>/snapshots/<snp_id>` ([`super::snapshot`]); the source continues. The row is inserted after the
//! directory is in place. `POST /v1/sandboxes {snapshot}` restores a new sandbox from it with its own
//! copy-on-write disk over the snapshot's disk copy, a new hostname and machine-id and fresh entropy.
//!
//! A fork of `count` is one checkpoint of the parent and `count` such restores, each recording the parent.
//!
//! Deleting a snapshot whose disk copy backs a sandbox's disk is refused (409) until those sandboxes are
//! destroyed: copying the disk on delete would cost the size of the template per sandbox. Snapshots never
//! expire and never touch their source.

use hearth_api::{CreateSandboxRequest, ForkResponse, SandboxState, SnapshotObject};
use hearth_vmm::SnapshotMode;
use rand::RngCore;

use super::lifecycle::rfc3339;
use super::snapshot::{self, SnapshotMeta};
use super::{Sandboxes, ServiceError, now_ms};
use crate::db::snapshots::SnapshotRow;

/// Children one fork may create.
pub const FORK_COUNT: std::ops::RangeInclusive<u32> = 1..=16;

fn new_snapshot_id() -> String {
    let mut bytes = [0u8; 8];
    rand::rng().fill_bytes(&mut bytes);
    format!("snp_{}", hex::encode(bytes))
}

impl Sandboxes {
    /// An id no snapshot has.
    pub(crate) fn fresh_snapshot_id(&self) -> Result<String, ServiceError> {
        let mut id = new_snapshot_id();
        while self.db.get_snapshot(&id)?.is_some() {
            id = new_snapshot_id();
        }
        Ok(id)
    }

    /// Whether `s` is shown as a snapshot object: a boot snapshot of warm creates ([`super::warm`]) is not (nor
    /// deletable through the API).
    fn is_users(&self, s: &SnapshotRow) -> bool {
        !self.warm.is_boot(&s.id)
    }

    /// Removes snapshot `id`'s directory (its row is gone), off the async runtime.
    pub(crate) async fn remove_snapshot_dir(&self, id: &str) {
        let dir = self.settings.paths.snapshot_dir(id);
        super::remove_dir_off_runtime(dir, &format!("snapshot directory {id}")).await;
    }

    fn snapshot_api(&self, s: &SnapshotRow) -> SnapshotObject {
        SnapshotObject {
            id: s.id.clone(),
            sandbox_id: s.sandbox_id.clone(),
            created_at: rfc3339(s.created_at_ms),
            size_bytes: s.size_bytes,
            template: s.template.clone(),
            vcpus: s.vcpus,
            memory_mib: s.memory_mib,
            storage: self.object_storage(super::remote::Kind::Snapshot, &s.id),
        }
    }
}

impl Sandboxes {
    /// Checkpoints running sandbox `id` into a new snapshot object; the sandbox continues.
    pub async fn checkpoint(&self, id: &str) -> Result<SnapshotObject, ServiceError> {
        let row = self.row(id)?;
        self.wake(&row).await?;
        let this = self.arc()?;
        let id = id.to_string();
        tokio::spawn(async move { this.checkpoint_now(&id).await })
            .await
            .unwrap_or_else(|e| Err(ServiceError::Internal(format!("checkpoint task: {e}"))))
    }

    async fn checkpoint_now(&self, id: &str) -> Result<SnapshotObject, ServiceError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let row = self.row(id)?;
        if row.state != SandboxState::Running {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is {}, only a running sandbox can be snapshotted",
                row.state.as_str()
            )));
        }
        let (Some(handle), Some(disk)) = (row.handle.clone(), row.disk.clone()) else {
            return Err(ServiceError::Internal(format!(
                "sandbox {id} has no VM handle or disk recorded"
            )));
        };
        let max = self.settings.max_snapshots_per_sandbox;
        let held = self
            .db
            .list_snapshots()?
            .iter()
            .filter(|s| s.sandbox_id == id)
            .count();
        if held >= max {
            return Err(ServiceError::CapacityExceeded(format!(
                "sandbox {id} has {held} snapshots, the most one sandbox may hold (each is a copy of its memory \
                 and disk); delete some (DELETE /v1/snapshots/{{id}}) or raise --max-snapshots-per-sandbox"
            )));
        }
        let live = self.live(id);
        let snap_id = self.fresh_snapshot_id()?;
        let snap = self
            .write_checkpoint(
                &row,
                (&handle, &disk),
                live.as_deref(),
                (&snap_id, id),
                row.env.clone(),
            )
            .await?;
        // Its restores (forks) mount the same buckets again, with the same export keys.
        self.db.snapshot_mounts(id, &snap.id)?;
        tracing::info!(sandbox = %id, snapshot = %snap.id, bytes = snap.size_bytes, "checkpoint taken");
        Ok(self.snapshot_api(&snap))
    }

    /// Writes a checkpoint of the VM `handle` of sandbox `row` (its disk `disk`) into new snapshot directory
    /// `snap_id` and inserts its row with `source` as its sandbox and `env` as what its restores inherit: the guest's
    /// file systems are flushed first (through `live`'s agent, when connected), the agent channel is
    /// re-established if the VMM reset it, the snapshot is hashed in the background and offered to the
    /// storage bucket.
    pub(crate) async fn write_checkpoint(
        &self,
        row: &crate::db::SandboxRow,
        (handle, disk): (&hearth_vmm::VmHandle, &std::path::Path),
        live: Option<&super::agent::Live>,
        (snap_id, source): (&str, &str),
        env: std::collections::BTreeMap<String, String>,
    ) -> Result<SnapshotRow, ServiceError> {
        if let Some(live) = live {
            let client = self
                .ensure_connected(live, std::time::Duration::from_secs(5))
                .await?;
            super::pause::guest_sync(&client).await?;
        }
        let parent = self.settings.paths.snapshots_dir();
        std::fs::create_dir_all(&parent)
            .map_err(|e| ServiceError::Internal(format!("creating {}: {e}", parent.display())))?;
        let created = now_ms();
        let meta = SnapshotMeta {
            template: &row.template,
            kernel_release: snapshot::kernel_release(&self.settings.paths.images_dir),
            mode: SnapshotMode::Checkpoint,
            created_at: created,
        };
        let written = snapshot::write(self.vmm.as_ref(), handle, disk, &parent, snap_id, meta).await;
        if self.vmm.snapshot_resets_agent_channel()
            && let Some(live) = live
        {
            self.reconnect_after_reset(live).await;
        }
        let manifest = written?;
        if manifest.info.disk.is_none() {
            self.remove_snapshot_dir(snap_id).await;
            return Err(ServiceError::VmmFailed(
                "the driver's checkpoint has no disk copy".into(),
            ));
        }
        let snap = SnapshotRow {
            id: snap_id.to_string(),
            sandbox_id: source.to_string(),
            created_at_ms: created,
            size_bytes: manifest.size_bytes(),
            template: row.template.clone(),
            vcpus: row.vcpus,
            memory_mib: row.memory_mib,
            env,
        };
        if let Err(e) = self.db.insert_snapshot(&snap) {
            self.remove_snapshot_dir(snap_id).await;
            return Err(e.into());
        }
        super::integrity::hash_in_background(parent.join(snap_id), manifest.fingerprinted());
        self.storage_committed(super::remote::Kind::Snapshot, snap_id, created, snap.size_bytes);
        Ok(snap)
    }

    /// Forks running sandbox `id` into `count` children that continue its state; the parent keeps running.
    pub async fn fork(&self, id: &str, count: u32) -> Result<ForkResponse, ServiceError> {
        if !FORK_COUNT.contains(&count) {
            return Err(ServiceError::InvalidArgument(format!(
                "count must be between {} and {}",
                FORK_COUNT.start(),
                FORK_COUNT.end()
            )));
        }
        let parent = self.row(id)?;
        let this = self.arc()?;
        // Children inherit the parent's egress policy and private networks (each gets its own address).
        let (network, networks) = match self.db.get_sandbox_net(id)? {
            Some(n) if self.networking().is_some() => (
                Some(hearth_api::NetworkPolicy { egress: n.policy }),
                self.network_ids_of(id)?,
            ),
            _ => (None, Vec::new()),
        };
        let snap = self.checkpoint(id).await?;
        // Kept in the local cache until every child runs on it (then it is a base they depend on).
        let _pin = self.cache_pin(&[(super::remote::Kind::Snapshot, snap.id.clone())]);
        // The children restore side by side: each maps the snapshot's memory copy-on-write.
        let creates = (0..count).map(|_| {
            let req = CreateSandboxRequest {
                network: network.clone(),
                networks: networks.clone(),
                snapshot: Some(snap.id.clone()),
                timeout_s: Some(parent.timeout_s),
                metadata: parent.metadata.clone(),
                auto_resume: Some(parent.auto_resume),
                on_timeout: Some(parent.on_timeout),
                ..Default::default()
            };
            let this = this.clone();
            let parent_id = id.to_string();
            async move { this.create_child(req, Some(parent_id)).await }
        });
        let results = futures::future::join_all(creates).await;
        let mut children = Vec::new();
        let mut failure = None;
        for r in results {
            match r {
                Ok(child) => children.push(child),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        if let Some(e) = failure {
            // All or nothing: the children made go, and so does the snapshot.
            for c in &children {
                let _ = this.destroy(&c.id, "fork-failed").await;
            }
            let _ = self.delete_snapshot(&snap.id).await;
            return Err(e);
        }
        Ok(ForkResponse {
            snapshot_id: snap.id,
            sandboxes: children,
        })
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotObject>, ServiceError> {
        Ok(self
            .db
            .list_snapshots()?
            .iter()
            .filter(|s| self.is_users(s))
            .map(|s| self.snapshot_api(s))
            .collect())
    }

    pub fn get_snapshot(&self, id: &str) -> Result<SnapshotObject, ServiceError> {
        let not_found = || ServiceError::NotFound(format!("snapshot {} not found", super::clip(id, 32)));
        if !hearth_api::is_valid_snapshot_id(id) {
            return Err(not_found());
        }
        let row = self
            .db
            .get_snapshot(id)?
            .filter(|s| self.is_users(s))
            .ok_or_else(not_found)?;
        Ok(self.snapshot_api(&row))
    }

    /// Deletes a snapshot nobody's disk depends on.
    pub async fn delete_snapshot(&self, id: &str) -> Result<(), ServiceError> {
        self.get_snapshot(id)?;
        let users = self.db.delete_snapshot_unless_used(id)?;
        if !users.is_empty() {
            return Err(ServiceError::Conflict(format!(
                "snapshot {id} backs the disks of {}: destroy them first",
                users.join(", ")
            )));
        }
        self.storage_deleted(super::remote::Kind::Snapshot, id);
        // Started before the first await: a caller that goes away (a closed connection) does not stop it.
        self.remove_snapshot_dir(id).await;
        Ok(())
    }
}
