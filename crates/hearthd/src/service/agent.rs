//! The agent connection of each running sandbox: first connect (with retries until the readiness deadline),
//! lookup for requests, and reconnect after the channel dropped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hearth_api::SandboxState;
use hearth_proto::client::{AgentClient, ClientError};
use hearth_proto::{PostRestore, PostRestoreReport};
use hearth_vmm::VmHandle;
use tokio::time::Instant;

use super::{Sandboxes, ServiceError};

/// How long the first handshake attempt may take (later ones double up to [`HANDSHAKE_TRY`]).
const FIRST_HANDSHAKE_TRY: Duration = Duration::from_millis(500);
/// How long one handshake attempt may take at most. A guest that is still booting does not answer at all, so attempts
/// must be short for readiness to be noticed quickly.
const HANDSHAKE_TRY: Duration = Duration::from_secs(2);
/// Pause between connection attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Each handshake attempt right after a restore (it includes the post-restore setup).
const RESTORED_HANDSHAKE_TRY: Duration = Duration::from_secs(5);
/// How long a request waits for a dropped channel to come back before it fails.
pub(crate) const RECONNECT_WINDOW: Duration = Duration::from_secs(5);

/// A running sandbox as the daemon holds it in memory.
pub struct Live {
    pub id: String,
    pub handle: VmHandle,
    /// Environment every command of the sandbox starts with.
    pub env: BTreeMap<String, String>,
    client: tokio::sync::Mutex<Option<AgentClient>>,
    /// Since when the agent has failed every health ping (`None` while it answers).
    silent_since: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Live {
    pub fn new(
        id: String,
        handle: VmHandle,
        env: BTreeMap<String, String>,
        client: Option<AgentClient>,
    ) -> Self {
        Live {
            id,
            handle,
            env,
            client: tokio::sync::Mutex::new(client),
            silent_since: std::sync::Mutex::new(None),
        }
    }

    /// Records a failed health ping; returns how long the agent has been silent.
    pub fn note_silence(&self) -> Duration {
        let mut since = self.silent_since.lock().unwrap_or_else(|p| p.into_inner());
        since.get_or_insert_with(std::time::Instant::now).elapsed()
    }

    /// The agent answered (or the VM was stopped on purpose): start counting afresh.
    pub fn clear_silence(&self) {
        *self.silent_since.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The current connection if it is open (does not wait for a reconnect in progress).
    pub fn current(&self) -> Option<AgentClient> {
        self.client
            .try_lock()
            .ok()
            .and_then(|c| c.as_ref().filter(|c| !c.is_closed()).cloned())
    }

    /// Closes the connection (the VM is going away).
    pub async fn close(&self) {
        if let Some(c) = self.client.lock().await.take() {
            c.close();
        }
    }
}

impl Sandboxes {
    /// Connects to the agent of `vm`, retrying until `deadline`. Gives up early when the VM process is gone.
    pub(crate) async fn connect_agent_until(
        &self,
        vm: &VmHandle,
        deadline: Instant,
    ) -> Result<AgentClient, String> {
        Ok(self.connect_agent_with(vm, deadline, None).await?.0)
    }

    /// [`Self::connect_agent_until`] right after a restore: the post-restore setup (clock and entropy, with
    /// `identity` also hostname and machine-id) rides in the handshake, one round trip for both. Returns its
    /// outcome for [`super::pause::finish_post_restore`] (`None`: an agent from before this, which needs the
    /// setup as a request of its own).
    pub(crate) async fn connect_restored_agent_until(
        &self,
        vm: &VmHandle,
        deadline: Instant,
        identity: Option<(&str, &str)>,
    ) -> Result<(AgentClient, Option<Result<PostRestoreReport, ClientError>>), String> {
        let make = || super::pause::post_restore_request(identity);
        self.connect_agent_with(vm, deadline, Some(&make)).await
    }

    async fn connect_agent_with(
        &self,
        vm: &VmHandle,
        deadline: Instant,
        after_restore: Option<&(dyn Fn() -> PostRestore + Send + Sync)>,
    ) -> Result<(AgentClient, Option<Result<PostRestoreReport, ClientError>>), String> {
        let started = Instant::now();
        // A restored guest is up at once, but its handshake carries the post-restore setup: give the first
        // attempt time for that instead of giving up on it and starting another.
        let mut try_timeout = match after_restore {
            Some(_) => RESTORED_HANDSHAKE_TRY,
            None => FIRST_HANDSHAKE_TRY,
        };
        for attempt in 1.. {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let last = match self.vmm.connect_agent(vm).await {
                Ok(stream) => {
                    let timeout = try_timeout.min(remaining.max(RETRY_PAUSE));
                    let connected = match after_restore {
                        None => AgentClient::connect(stream, timeout).await.map(|c| (c, None)),
                        Some(make) => AgentClient::connect_after_restore(stream, timeout, make).await,
                    };
                    match connected {
                        Ok(client) => {
                            tracing::debug!(
                                pid = vm.pid,
                                attempt,
                                ms = started.elapsed().as_millis() as u64,
                                "agent handshake done"
                            );
                            return Ok(client);
                        }
                        Err(e) => format!("handshake: {e}"),
                    }
                }
                Err(e) => e.to_string(),
            };
            tracing::debug!(pid = vm.pid, attempt, error = %last, "agent not reachable yet");
            // A guest still booting does not answer at all; one that is up answers in milliseconds, but a loaded
            // host can be slow, so later attempts wait longer.
            try_timeout = (try_timeout * 2).min(HANDSHAKE_TRY).max(try_timeout);
            if !self.vmm.is_alive(vm) {
                return Err(format!(
                    "VM process exited ({last}); its log: {}",
                    self.vmm.exit_log(vm)
                ));
            }
            if Instant::now() + RETRY_PAUSE >= deadline {
                return Err(last);
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        Err("no connection attempt".into())
    }

    /// The live record of a running sandbox (for its env and handle), without touching the agent.
    pub(crate) fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    pub(crate) fn set_live(&self, live: Arc<Live>) {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(live.id.clone(), live);
    }

    pub(crate) fn take_live(&self, id: &str) -> Option<Arc<Live>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).remove(id)
    }

    /// The agent connection of running sandbox `id`, reconnecting once if the channel dropped.
    pub(crate) async fn agent(&self, id: &str) -> Result<(Arc<Live>, AgentClient), ServiceError> {
        if !hearth_api::is_valid_sandbox_id(id) {
            return Err(ServiceError::no_sandbox(id));
        }
        let mut row = self.db.get(id)?.ok_or_else(|| ServiceError::no_sandbox(id))?;
        if row.state != SandboxState::Running {
            self.wake(&row).await?;
            row = self.db.get(id)?.ok_or_else(|| ServiceError::no_sandbox(id))?;
        }
        if row.state != SandboxState::Running {
            let why = row.error.map(|e| format!(": {e}")).unwrap_or_default();
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is {}{why}",
                row.state.as_str()
            )));
        }
        let live = self
            .live(id)
            .ok_or_else(|| ServiceError::AgentUnavailable(format!("sandbox {id} has no agent connection")))?;
        let client = self.ensure_connected(&live, RECONNECT_WINDOW).await?;
        Ok((live, client))
    }

    /// After a snapshot that made the guest drop its end of the agent channel
    /// ([`hearth_vmm::Vmm::snapshot_resets_agent_channel`]): replaces the connection before any request goes
    /// out on one about to be reset. Failures are logged: the next request reconnects by itself.
    pub(crate) async fn reconnect_after_reset(&self, live: &Live) {
        let started = Instant::now();
        live.close().await;
        match self.ensure_connected(live, RECONNECT_WINDOW).await {
            Ok(_) => tracing::debug!(sandbox = %live.id, ms = started.elapsed().as_millis() as u64,
                "agent channel re-established after the VMM's reset"),
            Err(e) => tracing::warn!(sandbox = %live.id, error = %e, "reconnecting after the VMM's reset"),
        }
    }

    /// Returns the open connection of `live`, or opens a new one within `window`.
    pub(crate) async fn ensure_connected(
        &self,
        live: &Live,
        window: Duration,
    ) -> Result<AgentClient, ServiceError> {
        let mut guard = live.client.lock().await;
        if let Some(c) = guard.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let old_reason = guard.as_ref().and_then(|c| c.close_reason());
        *guard = None;
        match self
            .connect_agent_until(&live.handle, Instant::now() + window)
            .await
        {
            Ok(c) => {
                tracing::info!(sandbox = %live.id, "agent channel re-established");
                *guard = Some(c.clone());
                Ok(c)
            }
            Err(e) => {
                let prev = old_reason.map(|r| format!(" after {r}")).unwrap_or_default();
                Err(ServiceError::AgentUnavailable(format!(
                    "agent channel of {} lost{prev}: {e}",
                    live.id
                )))
            }
        }
    }
}
