//! Pause to zero and resume.
//!
//! Pause: `running` → `pausing` (recorded before acting) → guest file systems flushed → the driver saves memory
//! and device state into a durable snapshot directory `<sandbox>/paused` ([`super::snapshot`]) and its process
//! ends → `paused` committed with the snapshot's description, the VM handle cleared. If the capture fails and
//! the VM still runs, the sandbox goes back to `running`; if the VM is gone too, it is `failed`.
//!
//! Resume: `paused` → `resuming` (recorded) → the snapshot is verified against its manifest → a fresh VMM
//! process restores it with the sandbox's own disk → agent reconnected → guest clock set, RNG reseeded →
//! `running` committed (new TTL from the create-time `timeout_s`) → the snapshot directory is removed. Any
//! failure before the commit stops the new process and returns to `paused`, snapshot untouched.
//!
//! A restart in the middle is finished or rolled back by [`crate::adopt`].

use std::sync::Arc;
use std::time::Duration;

use hearth_api::{Sandbox, SandboxState};
use hearth_proto::client::{AgentClient, ClientError};
use hearth_proto::msg::{ErrorKind, ExecRequest, PostRestore};
use hearth_vmm::{SnapshotMode, VmHandle, VmSpec};
use tokio::time::Instant;

use super::snapshot::{self, SnapshotError, SnapshotMeta};
use super::{Live, Sandboxes, ServiceError, now_ms};
use crate::db::usage::UsageKind;
use crate::db::{PausedState, SandboxRow};

/// Directory (under the sandbox directory) of a paused sandbox's state.
pub const PAUSED_DIR: &str = "paused";
/// How long the guest has to flush its file systems before a snapshot.
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a restored guest's agent has to answer.
const RESTORE_CONNECT: Duration = Duration::from_secs(60);

impl From<SnapshotError> for ServiceError {
    fn from(e: SnapshotError) -> Self {
        match e {
            SnapshotError::Corrupt { .. } => ServiceError::SnapshotCorrupt(e.to_string()),
            SnapshotError::Incompatible { .. } => ServiceError::Conflict(e.to_string()),
            SnapshotError::Write { .. } => ServiceError::VmmFailed(e.to_string()),
        }
    }
}

/// Runs a short shell command in the guest and returns its exit code and combined output.
pub(crate) async fn guest_shell(
    client: &AgentClient,
    line: &str,
    timeout: Duration,
) -> Result<(i32, String), ServiceError> {
    use hearth_proto::client::ExecEvent;
    let mut req = ExecRequest::shell(line);
    req.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
    let deadline = Instant::now() + timeout + Duration::from_secs(5);
    let mut handle = tokio::time::timeout_at(deadline, client.exec(req))
        .await
        .map_err(|_| ServiceError::AgentUnavailable("guest did not start the command in time".into()))??;
    let mut out = Vec::new();
    loop {
        let ev = tokio::time::timeout_at(deadline, handle.next_event())
            .await
            .map_err(|_| ServiceError::AgentUnavailable("guest command did not finish in time".into()))?;
        match ev {
            Some(ExecEvent::Stdout(b)) | Some(ExecEvent::Stderr(b)) => {
                if out.len() < 64 * 1024 {
                    out.extend_from_slice(&b);
                }
            }
            Some(ExecEvent::Exited { code, signal, .. }) => {
                let code = code.unwrap_or(128 + signal.unwrap_or(0));
                return Ok((code, String::from_utf8_lossy(&out).into_owned()));
            }
            Some(ExecEvent::Error(e)) => return Err(e.into()),
            None => {
                return Err(ServiceError::AgentUnavailable(
                    "guest command stream ended".into(),
                ));
            }
        }
    }
}

/// Flushes the guest's file systems so that the disk holds everything written before a snapshot. Uses the
/// agent's `Sync` (protocol v2); an older agent gets `sync` run as a command.
pub(crate) async fn guest_sync(client: &AgentClient) -> Result<(), ServiceError> {
    match tokio::time::timeout(SYNC_TIMEOUT, client.sync()).await {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(ClientError::Guest { kind, message })) => {
            tracing::debug!(%kind, message = %super::clip(&message, 256), "agent Sync refused; running sync");
        }
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            return Err(ServiceError::AgentUnavailable(
                "guest did not flush its disks in time".into(),
            ));
        }
    }
    let (code, out) = guest_shell(client, "sync", SYNC_TIMEOUT).await?;
    if code != 0 {
        return Err(ServiceError::Guest(format!(
            "sync exited with {code}: {}",
            super::clip(&out, 512)
        )));
    }
    Ok(())
}

/// The post-restore setup as of now: the host's wall clock, fresh entropy, and `identity` (hostname,
/// machine-id) when given.
pub(crate) fn post_restore_request(identity: Option<(&str, &str)>) -> PostRestore {
    use rand::RngCore;
    let mut entropy = vec![0u8; hearth_proto::POST_RESTORE_ENTROPY_LEN];
    rand::rng().fill_bytes(&mut entropy);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    PostRestore {
        unix_time_ns: i64::try_from(now.as_nanos()).unwrap_or(i64::MAX),
        entropy,
        hostname: identity.map(|(h, _)| h.to_string()),
        machine_id: identity.map(|(_, m)| m.to_string()),
    }
}

/// Ends the post-restore setup begun in the handshake ([`Sandboxes::connect_restored_agent_until`]): nothing
/// more when the agent did it there; otherwise (an older agent, or a refusal) [`guest_after_restore`], which
/// asks again as a request and falls back to a shell where that is refused.
pub(crate) async fn finish_post_restore(
    client: &AgentClient,
    id: &str,
    identity: Option<(&str, &str)>,
    outcome: Option<Result<hearth_proto::PostRestoreReport, ClientError>>,
) -> Result<(), ServiceError> {
    match outcome {
        Some(Ok(report)) => {
            tracing::debug!(sandbox = %id, ?report, "post-restore done in the handshake");
            Ok(())
        }
        Some(Err(e)) => {
            tracing::debug!(sandbox = %id, error = %e, "post-restore in the handshake failed; asking again");
            guest_after_restore(client, id, identity).await
        }
        None => guest_after_restore(client, id, identity).await,
    }
}

/// After a restore, before anything else runs: sets the guest's wall clock to the host's, credits fresh host
/// entropy to the kernel RNG and reseeds it and, when given, sets a new hostname and machine-id (forks).
/// Uses the agent's `PostRestore` (protocol v2); an older agent gets the clock and entropy through a shell
/// command (best effort, with a warning).
pub(crate) async fn guest_after_restore(
    client: &AgentClient,
    id: &str,
    identity: Option<(&str, &str)>,
) -> Result<(), ServiceError> {
    let req = post_restore_request(identity);
    let (unix_time_ns, entropy) = (req.unix_time_ns, req.entropy.clone());
    match tokio::time::timeout(Duration::from_secs(30), client.post_restore(req)).await {
        Ok(Ok(report)) => {
            tracing::debug!(sandbox = %id, ?report, "post-restore done");
            return Ok(());
        }
        Ok(Err(ClientError::Guest { kind, message }))
            if matches!(kind, ErrorKind::InvalidRequest | ErrorKind::VersionMismatch) =>
        {
            tracing::warn!(sandbox = %id, %kind, message = %super::clip(&message, 256), "agent PostRestore refused; using a shell");
        }
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            return Err(ServiceError::AgentUnavailable(
                "guest did not finish its post-restore setup in time".into(),
            ));
        }
    }
    let mut line = format!(
        "date -u -s @{} >/dev/null 2>&1; printf '%s' {} > /dev/urandom",
        unix_time_ns / 1_000_000_000,
        hex::encode(&entropy)
    );
    if let Some((hostname, machine_id)) = identity {
        // Both are generated by the daemon ([a-z0-9-] and 32 hex digits): safe inside single quotes.
        line.push_str(&format!(
            "; hostname '{hostname}'; echo '{hostname}' > /etc/hostname; echo '{machine_id}' > /etc/machine-id"
        ));
    }
    let (code, out) = guest_shell(client, &line, Duration::from_secs(30)).await?;
    if code != 0 {
        tracing::warn!(sandbox = %id, code, output = %super::clip(&out, 512), "post-restore guest setup");
    }
    Ok(())
}

impl Sandboxes {
    /// Pauses a running sandbox to zero: its state is saved to disk and its VM process ends.
    pub async fn pause(&self, id: &str) -> Result<Sandbox, ServiceError> {
        self.row(id)?;
        let this = self.arc()?;
        let id = id.to_string();
        tokio::spawn(async move { this.pause_now(&id).await })
            .await
            .unwrap_or_else(|e| Err(ServiceError::Internal(format!("pause task: {e}"))))
    }

    /// Resumes a paused sandbox into a fresh VM process.
    pub async fn resume(&self, id: &str) -> Result<Sandbox, ServiceError> {
        self.row(id)?;
        let this = self.arc()?;
        let id = id.to_string();
        tokio::spawn(async move { this.resume_now(&id).await })
            .await
            .unwrap_or_else(|e| Err(ServiceError::Internal(format!("resume task: {e}"))))
    }

    /// The pause itself, in the caller's task (recovery calls it to redo an interrupted pause).
    pub(crate) async fn pause_now(&self, id: &str) -> Result<Sandbox, ServiceError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let row = self.row(id)?;
        match row.state {
            SandboxState::Paused => return Ok(self.to_api(&row)),
            SandboxState::Running => {}
            other => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {id} is {}, only a running sandbox can be paused",
                    other.as_str()
                )));
            }
        }
        let (Some(handle), Some(disk)) = (row.handle.clone(), row.disk.clone()) else {
            return Err(ServiceError::Internal(format!(
                "sandbox {id} has no VM handle or disk recorded"
            )));
        };
        let started = Instant::now();
        // Flush while the sandbox is still `running` (a failure here changes nothing).
        if let Some(live) = self.live(id) {
            let client = self.ensure_connected(&live, Duration::from_secs(5)).await?;
            guest_sync(&client).await?;
        }
        if !self
            .db
            .transition(id, SandboxState::Running, SandboxState::Pausing)?
        {
            return Err(ServiceError::Conflict(format!("sandbox {id} changed state")));
        }
        let dir = self.settings.paths.sandbox_dir(id);
        snapshot::remove_temporaries(&dir);
        let stale = dir.join(PAUSED_DIR);
        if stale.exists() {
            // A running sandbox's old paused state is garbage (its resume was committed).
            let _ = std::fs::remove_dir_all(&stale);
        }
        let meta = SnapshotMeta {
            template: &row.template,
            kernel_release: snapshot::kernel_release(&self.settings.paths.images_dir),
            mode: SnapshotMode::Pause,
            created_at: now_ms(),
        };
        match snapshot::write(self.vmm.as_ref(), &handle, &disk, &dir, PAUSED_DIR, meta).await {
            Ok(manifest) => {
                // The driver ended the process; make sure (a paused sandbox holds no process).
                if let Err(e) = self.vmm.stop(&handle).await {
                    tracing::warn!(sandbox = %id, error = %e, "stopping the paused VM");
                }
                crate::adopt::kill_vm_process(&handle);
                let large_files = manifest.fingerprinted();
                let paused = PausedState {
                    dir: PAUSED_DIR.to_string(),
                    size_bytes: manifest.size_bytes(),
                    info: manifest.info,
                };
                self.db.commit_pause(id, &paused)?;
                super::integrity::hash_in_background(dir.join(PAUSED_DIR), large_files);
                self.storage_committed(super::remote::Kind::Pause, id, now_ms(), paused.size_bytes);
                self.db
                    .usage_switch(id, Some(UsageKind::Paused), now_ms(), row.vcpus, row.memory_mib)?;
                if let Some(live) = self.take_live(id) {
                    live.close().await;
                }
                crate::metrics::sandbox_paused(started.elapsed());
                tracing::info!(sandbox = %id, secs = started.elapsed().as_secs_f64(), bytes = paused.size_bytes, "sandbox paused");
                self.get(id)
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "pause failed");
                if self.vmm.is_alive(&handle) {
                    self.db
                        .transition(id, SandboxState::Pausing, SandboxState::Running)?;
                    Err(ServiceError::VmmFailed(format!(
                        "pause failed, the sandbox keeps running: {e}"
                    )))
                } else {
                    self.db
                        .transition(id, SandboxState::Pausing, SandboxState::Running)?;
                    self.fail_locked(id, &format!("VM lost while pausing: {e}"))
                        .await?;
                    Err(ServiceError::VmmFailed(format!(
                        "pause failed and the VM is gone: {e}"
                    )))
                }
            }
        }
    }

    async fn resume_now(&self, id: &str) -> Result<Sandbox, ServiceError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let row = self.row(id)?;
        // Its paused state and what its disk stands on stay in the local cache (or come back) for the resume.
        let mut objects = self.base_chain(Some(&row.template), row.snapshot_id.as_deref());
        objects.push((super::remote::Kind::Pause, id.to_string()));
        let _pin = self.cache_pin(&objects);
        match row.state {
            SandboxState::Running => return Ok(self.to_api(&row)),
            SandboxState::Paused => {}
            other => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {id} is {}, only a paused sandbox can be resumed",
                    other.as_str()
                )));
            }
        }
        let (Some(paused), Some(disk)) = (row.paused.clone(), row.disk.clone()) else {
            return Err(ServiceError::Internal(format!(
                "sandbox {id} has no paused state recorded"
            )));
        };
        let admission = self.admit(row.vcpus, row.memory_mib)?;
        let started = Instant::now();
        if !self
            .db
            .transition(id, SandboxState::Paused, SandboxState::Resuming)?
        {
            return Err(ServiceError::Conflict(format!("sandbox {id} changed state")));
        }
        drop(admission);
        // With a storage bucket: no upload reads the paused state any more, and a missing one is fetched.
        if let Err(e) = self.storage_fetch_pause(id, &paused.dir).await {
            self.db
                .transition(id, SandboxState::Resuming, SandboxState::Paused)?;
            return Err(e);
        }
        let mut handle = None;
        match self.restore_steps(&row, &paused, disk, &mut handle).await {
            Ok((vm, client)) => {
                let end = now_ms().saturating_add(i64::try_from(row.timeout_s * 1000).unwrap_or(i64::MAX));
                self.db.commit_resume(id, &vm, end)?;
                self.db
                    .usage_switch(id, Some(UsageKind::Running), now_ms(), row.vcpus, row.memory_mib)?;
                self.set_live(Arc::new(Live::new(
                    id.to_string(),
                    vm,
                    row.env.clone(),
                    Some(client),
                )));
                let dir = self.settings.paths.sandbox_dir(id).join(&paused.dir);
                let sandbox = id.to_string();
                tokio::task::spawn_blocking(move || {
                    if let Err(e) = std::fs::remove_dir_all(&dir) {
                        tracing::warn!(sandbox = %sandbox, error = %e, "removing the resumed snapshot");
                    }
                });
                crate::metrics::sandbox_resumed(started.elapsed());
                tracing::info!(sandbox = %id, secs = started.elapsed().as_secs_f64(), "sandbox resumed");
                self.get(id)
            }
            Err(e) if handle.is_some() && paused.info.resume_consumes() => {
                // The guest ran on its memory file again: there is no paused state to go back to.
                tracing::warn!(sandbox = %id, error = %e, "resume failed after the guest ran; the sandbox fails");
                self.db
                    .transition(id, SandboxState::Resuming, SandboxState::Running)?;
                self.fail_locked(id, &format!("resume failed after the guest started: {e}"))
                    .await?;
                Err(e)
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "resume failed; the sandbox stays paused");
                if let Some(vm) = handle {
                    let _ = self.vmm.stop(&vm).await;
                    crate::adopt::kill_vm_process(&vm);
                }
                self.db.clear_handle(id)?;
                self.db
                    .transition(id, SandboxState::Resuming, SandboxState::Paused)?;
                Err(e)
            }
        }
    }

    /// Verifies the paused state, restores it and reconnects the agent.
    async fn restore_steps(
        &self,
        row: &SandboxRow,
        paused: &PausedState,
        disk: std::path::PathBuf,
        handle: &mut Option<VmHandle>,
    ) -> Result<(VmHandle, AgentClient), ServiceError> {
        let run_dir = self.settings.paths.sandbox_dir(&row.id);
        let snap = run_dir.join(&paused.dir);
        let kind = self.vmm.kind();
        let snap2 = snap.clone();
        let manifest = tokio::task::spawn_blocking(move || snapshot::verify(&snap2, kind))
            .await
            .map_err(|e| ServiceError::Internal(format!("verify task: {e}")))??;
        // The namespace and tap were kept while paused (made again if the host lost them).
        let net = self
            .network_for_resume(&row.id)
            .await
            .map_err(|e| ServiceError::Internal(format!("network for the resume: {e}")))?;
        let spec = VmSpec {
            id: row.id.clone(),
            vcpus: row.vcpus,
            memory_mib: row.memory_mib,
            images: self.settings.paths.boot_images(),
            disk,
            run_dir,
            hostname: row.id.replace('_', "-"),
            net,
        };
        let vm = self
            .vmm
            .resume(&spec, &snap, &manifest.info)
            .await
            .map_err(|e| ServiceError::VmmFailed(format!("restoring the VM: {e}")))?;
        *handle = Some(vm.clone());
        // Recorded at once so that a restart finds this process.
        self.db.set_handle(&row.id, &vm)?;
        let (client, outcome) = self
            .connect_restored_agent_until(&vm, Instant::now() + RESTORE_CONNECT, None)
            .await
            .map_err(|e| ServiceError::VmmFailed(format!("restored guest's agent did not answer: {e}")))?;
        finish_post_restore(&client, &row.id, None, outcome).await?;
        Ok((vm, client))
    }

    /// For calls that need the guest: resumes a paused (or pausing) sandbox when it allows it.
    pub(crate) async fn wake(&self, row: &SandboxRow) -> Result<(), ServiceError> {
        if !matches!(
            row.state,
            SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming
        ) {
            return Ok(());
        }
        if !row.auto_resume {
            return Err(ServiceError::Conflict(format!(
                "sandbox {} is {} and was created with auto_resume false: resume it first (POST /v1/sandboxes/{}/resume)",
                row.id,
                row.state.as_str(),
                row.id
            )));
        }
        // A pausing or resuming sandbox is still counted as running; a paused one is not, so its owner's
        // quota must have room for it, as for an explicit resume.
        let _reservation = match self.db.owner("sandbox", &row.id)? {
            Some(project) if row.state == SandboxState::Paused => Some(self.reserve_quota(
                &project,
                super::quota::Want {
                    sandboxes: 1,
                    vcpus: row.vcpus.into(),
                    memory_mib: row.memory_mib.into(),
                    creates: false,
                    disk: false,
                },
            )?),
            _ => None,
        };
        self.resume(&row.id).await.map(|_| ())
    }
}
