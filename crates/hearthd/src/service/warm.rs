//! Warm creates: a create from a template restores a snapshot of that template booted at the same shape,
//! instead of booting a kernel (`--warm-creates`, on by default).
//!
//! The first create of a template at a shape (vCPUs, memory) boots as always; once its agent answers, and while
//! the sandbox is still `creating` (no command, file or PTY request can reach it: those need a running
//! sandbox), the booted guest is checkpointed into a *boot snapshot*, then the sandbox is handed out and runs
//! on. Later creates of that template and shape restore the boot snapshot: a copy-on-write disk over its disk
//! copy, guest memory faulted in from its file as the guest touches it, and, before any user code, the
//! post-restore setup forks get (a new hostname and machine-id, the host's clock, fresh entropy reseeding the
//! kernel RNG). What a boot snapshot holds is the guest as it booted: no command ran, no environment variable
//! (a sandbox's environment is sent with each command), no bucket mount (a create with mounts never saves one;
//! it may restore one, then mounts its buckets as a booted guest does); so one project's create may restore a
//! boot snapshot another project's create saved.
//!
//! A boot snapshot is keyed by a fingerprint of everything the guest booted from: the template image and the
//! kernel images (path, inode, size, mtime), the shape, the VMM, and the network device the daemon gives
//! sandboxes. When one of them changes (a rebuilt image, a saved template replaced, a daemon restarted with
//! other flags), the key changes: the next create boots and saves a new one, and the old one is retired and
//! deleted once no sandbox's disk builds on it ([`Sandboxes::sweep_boot_snapshots`]); so is the least recently
//! restored one when a save makes more than `--boot-snapshots-max`. A restore that fails (a
//! corrupted or truncated snapshot is refused by its manifest check before the VMM runs) retires the boot
//! snapshot and the create boots instead: a warm create never fails where a cold one would succeed.
//!
//! Boot snapshots are the platform's, not a project's: snapshot lists and lookups do not show them, a
//! sandbox restored from one shows no `snapshot_id`, and their disk is not counted against a project's quota
//! (like the built-in templates they are made from).

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hearth_api::CreateSandboxRequest;
use sha2::{Digest, Sha256};

use super::Sandboxes;
use super::agent::Live;
use super::lifecycle::{DEFAULT_MEMORY_MIB, DEFAULT_VCPUS, MEMORY_MIB, VCPUS};
use crate::db::Db;
use crate::db::boot_snapshots::BootSnapshotRow;

/// The hostname a guest boots with when it is to become a boot snapshot: nothing of the sandbox that boots it
/// may be in the snapshot (its kernel command line is in guest memory).
pub(crate) const BOOT_SNAPSHOT_HOSTNAME: &str = "sandbox";

/// Part of every key: bumped when what a boot snapshot holds changes meaning, so older ones are retired.
const KEY_VERSION: &str = "hearth-boot-snapshot-1";

/// The daemon's boot snapshots as far as requests need them: their ids, and the keys being saved.
pub struct WarmState {
    ids: Mutex<HashSet<String>>,
    saving: Arc<Mutex<HashSet<String>>>,
}

impl WarmState {
    /// The boot snapshots recorded in `db`.
    /// A boot snapshot whose save was cut off between its snapshot row and its record is adopted as retired
    /// (and deleted by the start-up sweep).
    pub(crate) fn load(db: &Db) -> Self {
        match db.adopt_unrecorded_boot_snapshots() {
            Ok(0) => {}
            Ok(n) => tracing::warn!(count = n, "boot snapshots whose save was cut off are retired"),
            Err(e) => tracing::warn!(error = %e, "adopting boot snapshots"),
        }
        let ids = db
            .list_boot_snapshots()
            .map(|rows| rows.into_iter().map(|r| r.snapshot_id).collect())
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "reading boot snapshots");
                HashSet::new()
            });
        WarmState {
            ids: Mutex::new(ids),
            saving: Arc::default(),
        }
    }

    /// Whether snapshot `id` is a boot snapshot (live, retired, or being saved): the one test of it (lists,
    /// lookups, deletes, a sandbox's `snapshot_id`).
    pub(crate) fn is_boot(&self, id: &str) -> bool {
        self.ids.lock().unwrap_or_else(|p| p.into_inner()).contains(id)
    }

    fn set_boot(&self, id: &str, boot: bool) {
        let mut ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        if boot {
            ids.insert(id.to_string());
        } else {
            ids.remove(id);
        }
    }
}

/// What a create does about boot snapshots ([`Sandboxes::warm_plan`]).
pub(crate) enum Warm {
    /// The request now names boot snapshot `snapshot`: the create restores it.
    Restore { snapshot: String },
    /// The create boots, then saves the booted guest as the boot snapshot of the ticket's key.
    Save(SaveTicket),
}

/// The right to save one key's boot snapshot: one create at a time holds it (a second create of the same
/// template and shape meanwhile boots without saving). Released on drop.
pub(crate) struct SaveTicket {
    key: String,
    template: String,
    vcpus: u32,
    memory_mib: u32,
    saving: Arc<Mutex<HashSet<String>>>,
}

impl Drop for SaveTicket {
    fn drop(&mut self) {
        self.saving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

/// What identifies the file at `path` as it is now: where it resolves, its inode, size and mtime. `-` when
/// there is no such file (a boot image a VMM does not use may be missing).
fn file_identity(path: &Path) -> String {
    let Ok(canon) = std::fs::canonicalize(path) else {
        return "-".into();
    };
    match std::fs::metadata(&canon) {
        Ok(m) => format!(
            "{}:{}:{}:{}:{}.{}",
            canon.display(),
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime(),
            m.mtime_nsec()
        ),
        Err(_) => "-".into(),
    }
}

impl Sandboxes {
    /// The key of template `template`'s boot snapshot at a shape, from what a guest would boot from now;
    /// `None` when the template has no image.
    pub(crate) fn warm_key(&self, template: &str, vcpus: u32, memory_mib: u32) -> Option<String> {
        let base = self.settings.paths.template_base(template)?;
        let images = self.settings.paths.boot_images();
        let (nic, ipv6) = self.nic_shape();
        let shape = format!("vcpus={vcpus} memory_mib={memory_mib} nic={nic} ipv6={ipv6}");
        let mut h = Sha256::new();
        for part in [
            KEY_VERSION.to_string(),
            self.vmm.kind().as_str().to_string(),
            template.to_string(),
            file_identity(&base),
            file_identity(&images.vmlinux),
            file_identity(&images.vmlinuz),
            file_identity(&images.initramfs),
            shape,
        ] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        Some(hex::encode(h.finalize()))
    }

    /// Decides what create `req` does about boot snapshots. With warm creates on, a request for a template
    /// (not a snapshot, a synced disk or a memory template) restores the template's boot snapshot at its shape
    /// when there is one and `may_restore` (`req` then names it), or gets the ticket to save one when no other
    /// create holds it. A create with bucket mounts may restore (its mounts are made after the restore) but
    /// never saves: its guest has mounted them before a save could run.
    pub(crate) fn warm_plan(&self, req: &mut CreateSandboxRequest, may_restore: bool) -> Option<Warm> {
        if !self.settings.warm_creates || req.snapshot.is_some() || req.from_sync.is_some() {
            return None;
        }
        let template = req
            .template
            .clone()
            .unwrap_or_else(|| self.settings.default_template.clone());
        if !hearth_api::is_valid_template_name(&template) {
            return None;
        }
        // A template saved with memory restores its own snapshot.
        match self.db.get_template(&template) {
            Ok(Some(t)) if t.snapshot_id.is_some() => return None,
            Err(_) => return None,
            Ok(_) => {}
        }
        let vcpus = req.vcpus.unwrap_or(DEFAULT_VCPUS);
        let memory_mib = req.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if !VCPUS.contains(&vcpus) || !MEMORY_MIB.contains(&memory_mib) {
            return None;
        }
        let key = self.warm_key(&template, vcpus, memory_mib)?;
        if may_restore && let Ok(Some(snap)) = self.db.boot_snapshot_for(&key) {
            // One evicted from the local cache comes back from the storage bucket, as any snapshot does.
            let present = self.db.get_snapshot(&snap).ok().flatten().is_some()
                && (self.settings.paths.snapshot_dir(&snap).is_dir() || self.evicted_to_storage(&snap));
            if present {
                if let Err(e) = self.db.boot_snapshot_used(&snap, super::now_ms()) {
                    tracing::warn!(snapshot = %snap, error = %e, "recording a boot snapshot's use");
                }
                req.template = Some(template);
                req.snapshot = Some(snap.clone());
                return Some(Warm::Restore { snapshot: snap });
            }
            tracing::warn!(snapshot = %snap, "boot snapshot is gone; booting to save a new one");
            self.retire_boot_snapshot(&snap);
        }
        if !req.mounts.is_empty() {
            return None;
        }
        let mut saving = self.warm.saving.lock().unwrap_or_else(|p| p.into_inner());
        if !saving.insert(key.clone()) {
            return None;
        }
        Some(Warm::Save(SaveTicket {
            key,
            template,
            vcpus,
            memory_mib,
            saving: self.warm.saving.clone(),
        }))
    }

    /// Whether snapshot `id`'s local copy was evicted while the storage bucket holds it (a create fetches it).
    fn evicted_to_storage(&self, id: &str) -> bool {
        self.storage().is_some()
            && self
                .db
                .remote_get(&super::remote::Kind::Snapshot.object(id))
                .ok()
                .flatten()
                .is_some_and(|r| r.evicted_at_ms.is_some() && r.manifest_digest.is_some())
    }

    /// No create restores boot snapshot `id` any more; it is deleted by the next sweep no sandbox's disk
    /// builds on.
    pub(crate) fn retire_boot_snapshot(&self, id: &str) {
        if let Err(e) = self.db.retire_boot_snapshot(id) {
            tracing::warn!(snapshot = %id, error = %e, "retiring a boot snapshot");
        }
    }

    /// Saves the guest of sandbox `id`, booted (with [`BOOT_SNAPSHOT_HOSTNAME`]) and still `creating`, as the
    /// boot snapshot of `ticket`'s key; then gives the sandbox its own identity as a restore gets it: hostname,
    /// machine-id, and fresh entropy reseeding its kernel RNG (whose state until then is in the snapshot, which
    /// other projects' sandboxes restore). A failed save leaves the sandbox to run on (the create succeeds
    /// without a boot snapshot); a guest that cannot take its identity fails the create.
    pub(crate) async fn save_boot_snapshot(
        &self,
        id: &str,
        live: &Live,
        ticket: &SaveTicket,
    ) -> Result<(), String> {
        self.save_boot_snapshot_files(id, live, ticket).await;
        let client = self
            .ensure_connected(live, Duration::from_secs(10))
            .await
            .map_err(|e| format!("guest agent after the boot snapshot: {e}"))?;
        let machine_id = {
            use rand::RngCore;
            let mut b = [0u8; 16];
            rand::rng().fill_bytes(&mut b);
            hex::encode(b)
        };
        let hostname = id.replace('_', "-");
        super::pause::guest_after_restore(&client, id, Some((&hostname, &machine_id)))
            .await
            .map_err(|e| format!("setting the identity after the boot snapshot: {e}"))
    }

    /// The save of [`Self::save_boot_snapshot`]; a failure is logged.
    async fn save_boot_snapshot_files(&self, id: &str, live: &Live, ticket: &SaveTicket) {
        let Ok(Some(row)) = self.db.get(id) else {
            tracing::warn!(sandbox = %id, "no row to save a boot snapshot of");
            return;
        };
        let (Some(handle), Some(disk)) = (row.handle.clone(), row.disk.clone()) else {
            tracing::warn!(sandbox = %id, "no VM handle or disk recorded to save a boot snapshot of");
            return;
        };
        let started = Instant::now();
        let snap_id = match self.fresh_snapshot_id() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "no boot snapshot id; the sandbox runs on without one");
                return;
            }
        };
        // A boot snapshot from before its row exists: never shown as a user's snapshot, not even while saved.
        self.warm.set_boot(&snap_id, true);
        let saved = self
            .write_checkpoint(
                &row,
                (&handle, &disk),
                Some(live),
                (&snap_id, ""),
                BTreeMap::new(),
            )
            .await;
        let snap = match saved {
            Ok(snap) => snap,
            Err(e) => {
                self.warm.set_boot(&snap_id, false);
                tracing::warn!(sandbox = %id, template = %ticket.template, error = %e,
                    "saving the boot snapshot failed; the sandbox runs on without one");
                return;
            }
        };
        let record = BootSnapshotRow {
            snapshot_id: snap.id.clone(),
            key: Some(ticket.key.clone()),
            template: ticket.template.clone(),
            vcpus: ticket.vcpus,
            memory_mib: ticket.memory_mib,
            created_at_ms: snap.created_at_ms,
        };
        if let Err(e) = self.db.record_boot_snapshot(&record) {
            tracing::warn!(snapshot = %snap.id, error = %e, "recording the boot snapshot failed; removing it");
            let _ = self.db.delete_snapshot_unless_used(&snap.id);
            self.remove_snapshot_dir(&snap.id).await;
            self.storage_deleted(super::remote::Kind::Snapshot, &snap.id);
            self.warm.set_boot(&snap.id, false);
            return;
        }
        tracing::info!(sandbox = %id, snapshot = %snap.id, template = %ticket.template, vcpus = ticket.vcpus,
            memory_mib = ticket.memory_mib, bytes = snap.size_bytes, secs = started.elapsed().as_secs_f64(),
            "boot snapshot saved");
        match self
            .db
            .retire_boot_snapshots_beyond(self.settings.boot_snapshots_max)
        {
            Ok(gone) if !gone.is_empty() => tracing::info!(snapshots = ?gone,
                max = self.settings.boot_snapshots_max, "least recently restored boot snapshots retired"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retiring boot snapshots beyond the limit"),
        }
        self.sweep_boot_snapshots().await;
    }

    /// Retires the boot snapshots whose template is gone or whose inputs changed, and deletes the retired ones
    /// no sandbox's disk builds on. Runs at start-up, after a boot snapshot is saved, after a sandbox restored
    /// from one is destroyed and after a template is deleted.
    pub async fn sweep_boot_snapshots(&self) {
        let rows = match self.db.list_boot_snapshots() {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "listing boot snapshots");
                return;
            }
        };
        for r in rows {
            if let Some(key) = &r.key {
                if self.warm_key(&r.template, r.vcpus, r.memory_mib).as_ref() == Some(key) {
                    continue;
                }
                self.retire_boot_snapshot(&r.snapshot_id);
            }
            match self.db.delete_retired_boot_snapshot(&r.snapshot_id) {
                Ok(true) => {
                    self.remove_snapshot_dir(&r.snapshot_id).await;
                    self.warm.set_boot(&r.snapshot_id, false);
                    self.storage_deleted(super::remote::Kind::Snapshot, &r.snapshot_id);
                    tracing::info!(snapshot = %r.snapshot_id, template = %r.template, "retired boot snapshot deleted");
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(snapshot = %r.snapshot_id, error = %e, "deleting a boot snapshot"),
            }
        }
    }
}
