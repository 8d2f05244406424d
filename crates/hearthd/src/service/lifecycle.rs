//! Sandbox lifecycle: create, look up, list, destroy, TTL changes, failure marking, and the system report.
//!
//! Create and destroy run in their own tasks so that a client hanging up (or a request timeout) cannot stop
//! them half way: the intent row is always finished or rolled back.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::time::Duration;

use hearth_api::{Capacity, CreateSandboxRequest, ErrorCode, OnTimeout, Sandbox, SandboxState, SystemInfo};
use hearth_vmm::{DiskFormat, VmHandle, VmSpec};
use rand::RngCore;
use tokio::time::Instant;

use super::console::console_tail;
use super::warm::{SaveTicket, Warm};
use super::{Live, Sandboxes, ServiceError, clip, now_ms};
use crate::db::SandboxRow;
use crate::db::usage::UsageKind;
use crate::metrics;

pub const VCPUS: std::ops::RangeInclusive<u32> = 1..=16;
pub const MEMORY_MIB: std::ops::RangeInclusive<u32> = 128..=16384;
pub const TIMEOUT_S: std::ops::RangeInclusive<u64> = 1..=86400;
pub const DEFAULT_VCPUS: u32 = 1;
pub const DEFAULT_MEMORY_MIB: u32 = 512;
const DEFAULT_TIMEOUT_S: u64 = 300;
/// Limits on env and metadata, so that everything fits in one protocol header with room to spare.
const MAX_ENV_BYTES: usize = 32 * 1024;
const MAX_METADATA_ENTRIES: usize = 64;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// A verified snapshot to restore instead of booting: its directory and what its driver wrote.
type Restore = (std::path::PathBuf, hearth_vmm::SnapshotInfo);

/// A validated create request.
struct CreatePlan {
    template: String,
    vcpus: u32,
    memory_mib: u32,
    timeout_s: u64,
    env: BTreeMap<String, String>,
    metadata: BTreeMap<String, String>,
    auto_resume: bool,
    on_timeout: OnTimeout,
    snapshot: Option<String>,
    net: super::network::NetPlan,
    disk_sync_interval_s: Option<u64>,
}

/// Checks environment variable names (`[A-Za-z_][A-Za-z0-9_]*`) and values (no NUL), and the total size.
pub fn validate_env(env: &BTreeMap<String, String>) -> Result<(), ServiceError> {
    let mut total = 0;
    for (k, v) in env {
        let ok_name = k
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok_name {
            return Err(ServiceError::InvalidArgument(format!(
                "invalid environment variable name {:?}",
                clip(k, 64)
            )));
        }
        if v.contains('\0') {
            return Err(ServiceError::InvalidArgument(format!(
                "environment variable {k} contains NUL"
            )));
        }
        total += k.len() + v.len() + 2;
    }
    if total > MAX_ENV_BYTES {
        return Err(ServiceError::InvalidArgument(format!(
            "environment larger than {MAX_ENV_BYTES} bytes"
        )));
    }
    Ok(())
}

fn validate_metadata(metadata: &BTreeMap<String, String>) -> Result<(), ServiceError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(ServiceError::InvalidArgument(format!(
            "more than {MAX_METADATA_ENTRIES} metadata entries"
        )));
    }
    for (k, v) in metadata {
        let ok_key = !k.is_empty()
            && k.len() <= MAX_METADATA_KEY
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/'));
        if !ok_key {
            return Err(ServiceError::InvalidArgument(format!(
                "invalid metadata key {:?}",
                clip(k, 64)
            )));
        }
        if v.len() > MAX_METADATA_VALUE || v.contains('\0') {
            return Err(ServiceError::InvalidArgument(format!(
                "metadata value of {k} is too long or has NUL"
            )));
        }
    }
    Ok(())
}

pub fn validate_timeout(timeout_s: u64) -> Result<(), ServiceError> {
    if !TIMEOUT_S.contains(&timeout_s) {
        return Err(ServiceError::InvalidArgument(format!(
            "timeout_s must be between {} and {}",
            TIMEOUT_S.start(),
            TIMEOUT_S.end()
        )));
    }
    Ok(())
}

/// A fresh sandbox id: `sbx_` + 16 random hex digits.
pub fn new_sandbox_id() -> String {
    let mut bytes = [0u8; 8];
    rand::rng().fill_bytes(&mut bytes);
    format!("sbx_{}", hex::encode(bytes))
}

/// RFC 3339 form of a unix-milliseconds time.
pub fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

impl Sandboxes {
    fn plan(&self, mut req: CreateSandboxRequest) -> Result<CreatePlan, ServiceError> {
        // A template saved with memory starts by restoring its snapshot.
        let mut label = None;
        if req.snapshot.is_none()
            && req.from_sync.is_none()
            && let Some(t) = &req.template
            && hearth_api::is_valid_template_name(t)
            && let Some(row) = self.db.get_template(t)?
            && let Some(snap) = row.snapshot_id
        {
            label = req.template.take();
            req.snapshot = Some(snap);
        }
        if let Some(snap) = &req.snapshot {
            // The snapshot fixes the template and the shape; its environment is inherited.
            if !hearth_api::is_valid_snapshot_id(snap) {
                return Err(ServiceError::NotFound(format!(
                    "snapshot {} not found",
                    clip(snap, 32)
                )));
            }
            let s = self
                .db
                .get_snapshot(snap)?
                .ok_or_else(|| ServiceError::NotFound(format!("snapshot {snap} not found")))?;
            let differs = |asked: Option<u32>, have: u32| asked.is_some_and(|a| a != have);
            if req.template.as_ref().is_some_and(|t| *t != s.template)
                || differs(req.vcpus, s.vcpus)
                || differs(req.memory_mib, s.memory_mib)
            {
                return Err(ServiceError::InvalidArgument(format!(
                    "snapshot {snap} fixes template {}, {} vCPUs and {} MiB",
                    s.template, s.vcpus, s.memory_mib
                )));
            }
            req.template = Some(s.template);
            req.vcpus = Some(s.vcpus);
            req.memory_mib = Some(s.memory_mib);
            let mut env = s.env;
            env.append(&mut req.env);
            req.env = env;
        }
        let template = req
            .template
            .unwrap_or_else(|| self.settings.default_template.clone());
        if !hearth_api::is_valid_template_name(&template) {
            return Err(ServiceError::InvalidArgument(format!(
                "invalid template name {:?} (expected [a-z0-9-], 1-63 characters)",
                clip(&template, 64)
            )));
        }
        let vcpus = req.vcpus.unwrap_or(DEFAULT_VCPUS);
        if !VCPUS.contains(&vcpus) {
            return Err(ServiceError::InvalidArgument(format!(
                "vcpus must be between {} and {}",
                VCPUS.start(),
                VCPUS.end()
            )));
        }
        let memory_mib = req.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if !MEMORY_MIB.contains(&memory_mib) {
            return Err(ServiceError::InvalidArgument(format!(
                "memory_mib must be between {} and {}",
                MEMORY_MIB.start(),
                MEMORY_MIB.end()
            )));
        }
        let timeout_s = req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        validate_timeout(timeout_s)?;
        validate_env(&req.env)?;
        validate_metadata(&req.metadata)?;
        self.validate_sync_interval(req.disk_sync_interval_s)?;
        if self.settings.paths.template_base(&template).is_none() {
            return Err(ServiceError::NotFound(format!("template {template} not found")));
        }
        let mut net = self.plan_network(req.network.as_ref(), &req.networks, req.name.as_deref())?;
        // A boot snapshot has no mounts of its own: a warm create gets the ones it asks for, made after the
        // restore like a cold create's after its boot.
        let inherit_from = req.snapshot.as_deref().filter(|s| !self.warm.is_boot(s));
        net.mounts = self.plan_mounts(&req.mounts, inherit_from)?;
        Ok(CreatePlan {
            template: label.unwrap_or(template),
            vcpus,
            memory_mib,
            timeout_s,
            env: req.env,
            metadata: req.metadata,
            auto_resume: req.auto_resume.unwrap_or(true),
            on_timeout: req.on_timeout.unwrap_or_default(),
            snapshot: req.snapshot,
            net,
            disk_sync_interval_s: req.disk_sync_interval_s,
        })
    }

    /// Creates a sandbox and returns once its agent answers.
    pub async fn create(
        self: &std::sync::Arc<Self>,
        req: CreateSandboxRequest,
    ) -> Result<Sandbox, ServiceError> {
        self.create_child(req, None).await
    }

    /// [`Self::create`], recording `parent` as the new sandbox's parent (forks). A create from a template
    /// restores its boot snapshot when there is one ([`super::warm`]); if that restore fails, the boot
    /// snapshot is retired and the create boots (and saves a new one); if the storage bucket does not answer
    /// the fetch of an evicted one, the create boots and the boot snapshot stays for later creates.
    pub(crate) async fn create_child(
        self: &std::sync::Arc<Self>,
        req: CreateSandboxRequest,
        parent: Option<String>,
    ) -> Result<Sandbox, ServiceError> {
        let mut warm_req = req.clone();
        match self.warm_plan(&mut warm_req, true) {
            Some(Warm::Restore { snapshot }) => {
                match self.create_attempt(warm_req, parent.clone(), None).await {
                    Err(
                        e @ (ServiceError::VmmFailed(_)
                        | ServiceError::SnapshotCorrupt(_)
                        | ServiceError::Typed(ErrorCode::StorageCorrupt, _)),
                    ) => {
                        tracing::warn!(snapshot = %snapshot, error = %e,
                        "restoring the boot snapshot failed; retiring it and booting");
                        self.retire_boot_snapshot(&snapshot);
                        let mut req = req;
                        let save = match self.warm_plan(&mut req, false) {
                            Some(Warm::Save(ticket)) => Some(ticket),
                            _ => None,
                        };
                        self.create_attempt(req, parent, save).await
                    }
                    Err(e @ ServiceError::Typed(ErrorCode::StorageUnavailable, _)) => {
                        tracing::warn!(snapshot = %snapshot, error = %e,
                        "the boot snapshot could not be fetched from the storage bucket; booting");
                        self.create_attempt(req, parent, None).await
                    }
                    done => done,
                }
            }
            Some(Warm::Save(ticket)) => self.create_attempt(warm_req, parent, Some(ticket)).await,
            None => self.create_attempt(warm_req, parent, None).await,
        }
    }

    /// One try of [`Self::create_child`]; with `save`, the booted guest becomes its template's boot snapshot.
    async fn create_attempt(
        self: &std::sync::Arc<Self>,
        mut req: CreateSandboxRequest,
        parent: Option<String>,
        save: Option<SaveTicket>,
    ) -> Result<Sandbox, ServiceError> {
        // A recreate from a synced disk takes the source's template and shape, and brings the image here (kept
        // in the local cache from before its fetch until the new sandbox runs on it).
        let _sync_pin = self.cache_pin(&self.sync_source_objects(&req));
        let synced = self.sync_source(&mut req).await?;
        // A snapshot or saved template whose local copy is gone comes back from the storage bucket; it stays in
        // the local cache while this create uses it (a pin; then the running sandbox depends on it).
        let _pin = self.cache_pin(&self.base_chain(req.template.as_deref(), req.snapshot.as_deref()));
        self.storage_fetch_for_create(&req).await?;
        let plan = self.plan(req)?;
        let admission = self.admit(plan.vcpus, plan.memory_mib)?;
        // A snapshot is checked against its manifest before anything is created from it.
        let restore = match &plan.snapshot {
            Some(snap) => {
                let dir = self.settings.paths.snapshot_dir(snap);
                let kind = self.vmm.kind();
                let d = dir.clone();
                let manifest = tokio::task::spawn_blocking(move || super::snapshot::verify(&d, kind))
                    .await
                    .map_err(|e| ServiceError::Internal(format!("verify task: {e}")))??;
                if manifest.info.disk.is_none() {
                    return Err(ServiceError::SnapshotCorrupt(format!(
                        "snapshot {snap} has no disk copy"
                    )));
                }
                Some((dir, manifest.info))
            }
            None => None,
        };
        let started = Instant::now();
        let now = now_ms();
        let mut id = new_sandbox_id();
        while self.db.get(&id)?.is_some() {
            id = new_sandbox_id();
        }
        let row = SandboxRow {
            id: id.clone(),
            state: SandboxState::Creating,
            template: plan.template.clone(),
            vcpus: plan.vcpus,
            memory_mib: plan.memory_mib,
            created_at_ms: now,
            end_at_ms: now.saturating_add(i64::try_from(plan.timeout_s * 1000).unwrap_or(i64::MAX)),
            env: plan.env.clone(),
            metadata: plan.metadata,
            vmm: self.vmm.kind(),
            handle: None,
            error: None,
            auto_resume: plan.auto_resume,
            on_timeout: plan.on_timeout,
            timeout_s: plan.timeout_s,
            parent_id: parent,
            // From a synced disk: the snapshot the copied disk builds on.
            snapshot_id: plan
                .snapshot
                .clone()
                .or_else(|| synced.as_ref().and_then(|s| s.base_snapshot.clone())),
            paused: None,
            disk: None,
        };
        // The intent goes to disk before anything is started; from here the row holds the VM's share.
        self.db.insert(&row)?;
        if let Some(interval) = plan.disk_sync_interval_s {
            self.db.sync_set_interval(&id, interval)?;
        }
        drop(admission);
        let this = self.clone();
        let net = plan.net;
        let task = tokio::spawn(async move { this.boot(row, (restore, synced), net, save).await });
        let result = match task.await {
            Ok(r) => r,
            Err(e) => {
                // The boot task died (a panic in a driver): roll back what it may have left.
                let handle = self.db.get(&id).ok().flatten().and_then(|r| r.handle);
                self.teardown(&id, handle.as_ref()).await;
                let _ = self.db.delete(&id);
                Err(ServiceError::Internal(format!("create task failed: {e}")))
            }
        };
        metrics::sandbox_created(result.is_ok(), started.elapsed());
        match &result {
            Ok(_) => tracing::info!(sandbox = %id, secs = started.elapsed().as_secs_f64(), "sandbox running"),
            Err(e) => tracing::warn!(sandbox = %id, error = %e, "sandbox create failed"),
        }
        result
    }

    /// Boots the VM of a `creating` row; on failure everything of it is removed again.
    /// With `save`, the booted guest is saved as a boot snapshot before the sandbox leaves `creating`.
    async fn boot(
        &self,
        row: SandboxRow,
        from: (Option<Restore>, Option<super::sync::SyncedDisk>),
        net: super::network::NetPlan,
        save: Option<SaveTicket>,
    ) -> Result<Sandbox, ServiceError> {
        let lock = self.op_lock(&row.id);
        let _guard = lock.lock().await;
        let dir = self.settings.paths.sandbox_dir(&row.id);
        let mut handle = None;
        let booted = match self
            .boot_steps(&row, &dir, from, &net, (&mut handle, save.is_some()))
            .await
        {
            Ok(live) => match &save {
                Some(ticket) => self
                    .save_boot_snapshot(&row.id, &live, ticket)
                    .await
                    .map(|()| live),
                None => Ok(live),
            },
            Err(e) => Err(e),
        };
        drop(save);
        match booted {
            Ok(live) => {
                if !self
                    .db
                    .transition(&row.id, SandboxState::Creating, SandboxState::Running)?
                {
                    live.close().await;
                    self.teardown(&row.id, handle.as_ref()).await;
                    let _ = self.db.delete(&row.id);
                    return Err(ServiceError::Conflict(format!(
                        "sandbox {} was removed while starting",
                        row.id
                    )));
                }
                self.set_live(live);
                // Booting counts as running time.
                self.db.usage_switch(
                    &row.id,
                    Some(UsageKind::Running),
                    row.created_at_ms,
                    row.vcpus,
                    row.memory_mib,
                )?;
                let row = self
                    .db
                    .get(&row.id)?
                    .ok_or_else(|| ServiceError::no_sandbox(&row.id))?;
                Ok(self.to_api(&row))
            }
            Err(reason) => {
                let console = console_tail(&dir)
                    .map(|c| format!(" (console: {c})"))
                    .unwrap_or_default();
                self.teardown(&row.id, handle.as_ref()).await;
                self.db.delete(&row.id)?;
                Err(ServiceError::VmmFailed(format!("{reason}{console}")))
            }
        }
    }

    async fn boot_steps(
        &self,
        row: &SandboxRow,
        dir: &Path,
        (restore, synced): (Option<Restore>, Option<super::sync::SyncedDisk>),
        net: &super::network::NetPlan,
        (handle, for_boot_snapshot): (&mut Option<VmHandle>, bool),
    ) -> Result<std::sync::Arc<Live>, String> {
        let io = |what: &str, e: std::io::Error| format!("{what} {}: {e}", dir.display());
        std::fs::create_dir_all(self.settings.paths.sandboxes_dir()).map_err(|e| io("create", e))?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|e| io("create", e))?;
        // The base's format comes from hearth's records (the snapshot manifest; template images are always raw),
        // never from its bytes: a guest wrote them.
        let (base, format) = match &restore {
            // A restored VM continues with a copy-on-write disk over the snapshot's disk copy.
            Some((snap, info)) => (
                snap.join(info.disk.as_deref().unwrap_or_default()),
                info.disk_format(),
            ),
            None => (
                self.settings
                    .paths
                    .template_base(&row.template)
                    .ok_or_else(|| format!("template {} is gone", row.template))?,
                DiskFormat::Raw,
            ),
        };
        let disk = match &synced {
            Some(s) => super::sync::place_image(s, dir).await?,
            None => self
                .vmm
                .prepare_disk(&base, format, dir)
                .await
                .map_err(|e| format!("preparing the disk: {e}"))?,
        };
        self.db.set_disk(&row.id, &disk).map_err(|e| e.to_string())?;
        let net = self
            .attach_network(&row.id, net)
            .await
            .map_err(|e| format!("setting up the network: {e}"))?;
        let spec = VmSpec {
            id: row.id.clone(),
            vcpus: row.vcpus,
            memory_mib: row.memory_mib,
            images: self.settings.paths.boot_images(),
            disk,
            run_dir: dir.to_path_buf(),
            // A guest booted to become a boot snapshot has nothing of this sandbox in its memory (the kernel
            // command line is): its identity is set after the save ([`Self::save_boot_snapshot`]).
            hostname: if for_boot_snapshot {
                super::warm::BOOT_SNAPSHOT_HOSTNAME.to_string()
            } else {
                row.id.replace('_', "-")
            },
            net,
        };
        // A warm create's VM lives on as a booted one would: the driver may give it its own memory.
        let from_boot_snapshot = row.snapshot_id.as_deref().is_some_and(|s| self.warm.is_boot(s));
        let vm = match &restore {
            Some((snap, info)) if from_boot_snapshot => self
                .vmm
                .restore_as_own(&spec, snap, info)
                .await
                .map_err(|e| format!("restoring the VM: {e}"))?,
            Some((snap, info)) => self
                .vmm
                .restore(&spec, snap, info)
                .await
                .map_err(|e| format!("restoring the VM: {e}"))?,
            None => self
                .vmm
                .start(&spec)
                .await
                .map_err(|e| format!("starting the VM: {e}"))?,
        };
        *handle = Some(vm.clone());
        // Recorded at once so that a restart finds (and stops) this VM even if we die right now.
        self.db.set_handle(&row.id, &vm).map_err(|e| e.to_string())?;
        let timeout = self.settings.ready_timeout;
        // Every restore of a shared snapshot gets its own identity and fresh entropy before user code: in the
        // handshake, where the agent can do it.
        let machine_id = restore.is_some().then(|| {
            let mut b = [0u8; 16];
            rand::rng().fill_bytes(&mut b);
            b[0] |= 1;
            hex::encode(b)
        });
        let identity = machine_id.as_deref().map(|m| (spec.hostname.as_str(), m));
        let deadline = Instant::now() + timeout;
        let connected = match identity {
            Some(_) => self
                .connect_restored_agent_until(&vm, deadline, identity)
                .await
                .map(|(c, outcome)| (c, Some(outcome))),
            None => self.connect_agent_until(&vm, deadline).await.map(|c| (c, None)),
        };
        let (client, post_restore) = connected.map_err(|e| {
            if e.starts_with("VM process exited") {
                e
            } else {
                format!("guest agent not ready after {} s: {e}", timeout.as_secs())
            }
        })?;
        // The handshake proves the agent serves requests; a ping round trip proves the channel carries them (a
        // post-restore setup done in the handshake was such a round trip already).
        if !matches!(post_restore, Some(Some(Ok(_)))) {
            tokio::time::timeout(Duration::from_secs(10), client.ping())
                .await
                .map_err(|_| "guest agent did not answer a ping".to_string())?
                .map_err(|e| format!("guest agent ping: {e}"))?;
        }
        if let Some(outcome) = post_restore {
            super::pause::finish_post_restore(&client, &row.id, identity, outcome)
                .await
                .map_err(|e| format!("post-restore setup: {e}"))?;
        }
        // A restored guest has its mounts already (they are in its memory), except one restored from a boot
        // snapshot, which has none (mounted after its clock and entropy are the sandbox's own).
        if restore.is_none() || from_boot_snapshot {
            self.mount_in_guest(&row.id, &client)
                .await
                .map_err(|e| format!("mounting buckets: {e}"))?;
        }
        Ok(std::sync::Arc::new(Live::new(
            row.id.clone(),
            vm,
            row.env.clone(),
            Some(client),
        )))
    }

    /// Stops the VM (if any) and removes the sandbox's files. Never fails: what cannot be removed is logged.
    pub(crate) async fn teardown(&self, id: &str, handle: Option<&VmHandle>) {
        let dir = self.settings.paths.sandbox_dir(id);
        if let Some(h) = handle {
            if h.kind == self.vmm.kind()
                && let Err(e) = self.vmm.stop(h).await
            {
                tracing::warn!(sandbox = %id, error = %e, "stopping the VM failed; killing it");
            }
            crate::adopt::kill_vm_process(h);
        }
        crate::adopt::kill_dir_processes(&dir);
        self.detach_network(id).await;
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(sandbox = %id, error = %e, "removing the sandbox directory failed");
        }
    }

    /// Destroys a sandbox: `stopping` → stop the VM → remove its files → delete the row.
    pub async fn destroy(
        self: &std::sync::Arc<Self>,
        id: &str,
        reason: &'static str,
    ) -> Result<(), ServiceError> {
        let row = self.row(id)?;
        if row.state == SandboxState::Creating {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is still being created"
            )));
        }
        let this = self.clone();
        let id = id.to_string();
        tokio::spawn(async move { this.destroy_now(&id, reason).await })
            .await
            .unwrap_or_else(|e| Err(ServiceError::Internal(format!("destroy task: {e}"))))
    }

    async fn destroy_now(&self, id: &str, reason: &'static str) -> Result<(), ServiceError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        // Someone else may have destroyed it while we waited: that is what was asked.
        let Some(row) = self.db.get(id)? else {
            return Ok(());
        };
        if row.state == SandboxState::Creating {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is still being created"
            )));
        }
        self.db
            .set_state(id, SandboxState::Stopping, row.error.as_deref())?;
        if let Some(live) = self.take_live(id) {
            live.close().await;
        }
        // Peers must forget it; a sandbox on no private network changes no other sandbox's rules.
        let had_peers = self.networking().is_some() && !self.network_ids_of(id)?.is_empty();
        self.teardown(id, row.handle.as_ref()).await;
        self.db.delete(id)?;
        self.storage_deleted(super::remote::Kind::Pause, id);
        self.sync_forget(id);
        if had_peers {
            self.network_gone().await;
        }
        self.db
            .usage_switch(id, None, now_ms(), row.vcpus, row.memory_mib)?;
        if row.snapshot_id.as_deref().is_some_and(|s| self.warm.is_boot(s)) {
            self.sweep_boot_snapshots().await;
        }
        metrics::sandbox_destroyed(reason);
        tracing::info!(sandbox = %id, reason, "sandbox destroyed");
        Ok(())
    }

    /// Marks a running sandbox `failed` with `reason`, stops what is left of its VM and removes its files. The
    /// row stays (with the reason) until it is deleted or its TTL passes.
    pub async fn fail(&self, id: &str, reason: &str) -> Result<(), ServiceError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        self.fail_locked(id, reason).await
    }

    /// [`Self::fail`] for a caller that holds the sandbox's lifecycle lock.
    pub(crate) async fn fail_locked(&self, id: &str, reason: &str) -> Result<(), ServiceError> {
        let Some(row) = self.db.get(id)? else {
            return Ok(());
        };
        if row.state != SandboxState::Running {
            return Ok(());
        }
        let dir = self.settings.paths.sandbox_dir(id);
        let console = console_tail(&dir)
            .map(|c| format!(" (console: {c})"))
            .unwrap_or_default();
        let reason = format!("{reason}{console}");
        self.db.set_state(id, SandboxState::Failed, Some(&reason))?;
        self.db
            .usage_switch(id, None, now_ms(), row.vcpus, row.memory_mib)?;
        tracing::warn!(sandbox = %id, reason = %reason, "sandbox failed");
        if let Some(live) = self.take_live(id) {
            live.close().await;
        }
        self.teardown(id, row.handle.as_ref()).await;
        metrics::sandbox_failed();
        Ok(())
    }

    /// The row of `id`, or `not_found` (also for ids that are not well-formed).
    pub(crate) fn row(&self, id: &str) -> Result<SandboxRow, ServiceError> {
        if !hearth_api::is_valid_sandbox_id(id) {
            return Err(ServiceError::no_sandbox(id));
        }
        self.db.get(id)?.ok_or_else(|| ServiceError::no_sandbox(id))
    }

    pub fn get(&self, id: &str) -> Result<Sandbox, ServiceError> {
        Ok(self.to_api(&self.row(id)?))
    }

    /// One page of the sandboxes matching `filters` (`state`, `metadata.<key>`) and, when given, owned by
    /// `project`, in id order: at most `limit` (1-1000, default 1000) after `cursor` (the last id of the
    /// previous page). Returns the page and the cursor of the next one when more match. The project is a
    /// filter like the others, applied before the page is cut, so a page is never short of what matches.
    pub fn list(
        &self,
        filters: &[(String, String)],
        project: Option<&str>,
    ) -> Result<(Vec<Sandbox>, Option<String>), ServiceError> {
        let mut state = None;
        let mut meta = Vec::new();
        let mut limit = hearth_api::MAX_LIST_LIMIT;
        let mut cursor: Option<&str> = None;
        for (k, v) in filters {
            if k == "state" {
                state = Some(SandboxState::parse(v).ok_or_else(|| {
                    ServiceError::InvalidArgument(format!("unknown state {:?}", clip(v, 32)))
                })?);
            } else if k == "limit" {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=hearth_api::MAX_LIST_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ServiceError::InvalidArgument(format!(
                            "limit must be between 1 and {}",
                            hearth_api::MAX_LIST_LIMIT
                        ))
                    })?;
            } else if k == "cursor" {
                if !hearth_api::is_valid_sandbox_id(v) {
                    return Err(ServiceError::InvalidArgument(format!(
                        "cursor {:?} is not one this daemon returned",
                        clip(v, 64)
                    )));
                }
                cursor = Some(v);
            } else if let Some(key) = k.strip_prefix("metadata.") {
                meta.push((key, v.as_str()));
            } else {
                return Err(ServiceError::InvalidArgument(format!(
                    "unknown filter {:?}",
                    clip(k, 64)
                )));
            }
        }
        let mut rows = self.db.list_page(&crate::db::ListFilter {
            after: cursor,
            state: state.map(SandboxState::as_str),
            project,
            metadata: &meta,
            limit: limit + 1,
        })?;
        let next = (rows.len() > limit).then(|| rows[limit - 1].id.clone());
        rows.truncate(limit);
        Ok((rows.iter().map(|r| self.to_api(r)).collect(), next))
    }

    /// Resets the TTL to `timeout_s` from now.
    pub fn set_timeout(&self, id: &str, timeout_s: u64) -> Result<Sandbox, ServiceError> {
        validate_timeout(timeout_s)?;
        let row = self.row(id)?;
        if row.state == SandboxState::Stopping {
            return Err(ServiceError::Conflict(format!("sandbox {id} is being destroyed")));
        }
        let end = now_ms().saturating_add(i64::try_from(timeout_s * 1000).unwrap_or(i64::MAX));
        if !self.db.set_end_at(id, end)? {
            return Err(ServiceError::no_sandbox(id));
        }
        self.get(id)
    }

    pub(crate) fn to_api(&self, row: &SandboxRow) -> Sandbox {
        Sandbox {
            id: row.id.clone(),
            state: row.state,
            template: row.template.clone(),
            vcpus: row.vcpus,
            memory_mib: row.memory_mib,
            created_at: rfc3339(row.created_at_ms),
            end_at: rfc3339(row.end_at_ms),
            metadata: row.metadata.clone(),
            vmm: row.vmm.as_str().to_string(),
            error: row.error.clone(),
            auto_resume: row.auto_resume,
            on_timeout: row.on_timeout,
            parent_id: row.parent_id.clone(),
            // A boot snapshot is the platform's, not something the sandbox was created from by name.
            snapshot_id: row.snapshot_id.clone().filter(|s| !self.warm.is_boot(s)),
            disk_sync_interval_s: self
                .db
                .sync_get(&row.id)
                .ok()
                .flatten()
                .and_then(|s| s.interval_s),
            // A paused sandbox's state: on this host, in the bucket or both (and a resume's fetch progress).
            storage: match row.state {
                SandboxState::Paused | SandboxState::Resuming => {
                    self.object_storage(super::remote::Kind::Pause, &row.id)
                }
                _ => None,
            },
        }
    }

    /// The host report of `GET /v1/system`.
    pub fn system(&self) -> Result<SystemInfo, ServiceError> {
        let rows = self.db.list()?;
        let active = rows.iter().filter(|r| holds_vm(r.state));
        let (mut n, mut vcpus, mut mem) = (0u32, 0u32, 0u64);
        for r in active {
            n += 1;
            vcpus += r.vcpus;
            mem += u64::from(r.memory_mib);
        }
        Ok(SystemInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            vmm: self.vmm.kind().as_str().to_string(),
            accel: self.vmm.accel().as_str().to_string(),
            vmm_reason: self.info.reason.clone(),
            checks: self
                .info
                .checks
                .iter()
                .cloned()
                .chain(self.storage_check())
                .collect(),
            capacity: Capacity {
                host_cpus: u32::try_from(self.host.cpus).unwrap_or(u32::MAX),
                host_memory_mib: self.host.memory_mib,
                sandboxes_running: n,
                vcpus_allocated: vcpus,
                memory_mib_allocated: mem,
            },
            templates: self.list_templates()?.into_iter().map(|t| t.name).collect(),
            default_template: self.settings.default_template.clone(),
        })
    }
}

/// True in the states where a VM process exists (or is about to), holding its memory.
pub(crate) fn holds_vm(state: SandboxState) -> bool {
    matches!(
        state,
        SandboxState::Creating | SandboxState::Running | SandboxState::Pausing | SandboxState::Resuming
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_valid_and_distinct() {
        let a = new_sandbox_id();
        assert!(hearth_api::is_valid_sandbox_id(&a), "{a}");
        assert_ne!(a, new_sandbox_id());
    }

    #[test]
    fn env_names_are_checked() {
        let ok = BTreeMap::from([
            ("A_1".to_string(), "x y".to_string()),
            ("_b".into(), String::new()),
        ]);
        assert!(validate_env(&ok).is_ok());
        for bad in ["", "1A", "A-B", "A=B", "Ä"] {
            assert!(
                validate_env(&BTreeMap::from([(bad.to_string(), "v".to_string())])).is_err(),
                "{bad}"
            );
        }
        assert!(validate_env(&BTreeMap::from([("A".to_string(), "a\0b".to_string())])).is_err());
    }

    #[test]
    fn rfc3339_formats_millis() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_500), "1970-01-01T00:00:01.5Z");
    }
}
