//! Background tasks: the TTL reaper (destroys, or with `on_timeout: pause` pauses, sandboxes whose `end_at`
//! passed; `end_at` is persisted, so this works across restarts) and the health watcher (marks a sandbox
//! `failed` when its VM process died, its agent channel closed and could not be re-established, or its agent
//! stopped answering pings for `Settings::agent_unresponsive`, e.g. a guest so overloaded that nothing runs).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_api::OnTimeout;

use crate::service::agent::RECONNECT_WINDOW;
use crate::service::{Sandboxes, ServiceError, now_ms};

const REAP_EVERY: Duration = Duration::from_secs(1);
const WATCH_EVERY: Duration = Duration::from_secs(2);
/// One health ping may take this long before it counts as unanswered.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Ids with a task in flight, so that a slow destroy or reconnect is not started twice.
#[derive(Default, Clone)]
struct InFlight(Arc<Mutex<HashSet<String>>>);

impl InFlight {
    fn try_claim(&self, id: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string())
    }

    fn release(&self, id: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }
}

/// Runs the TTL reaper forever.
pub async fn reaper(svc: Arc<Sandboxes>) {
    let busy = InFlight::default();
    let mut tick = tokio::time::interval(REAP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let expired = match svc.db().expired(now_ms()) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::error!(error = %e, "reaper: listing expired sandboxes");
                continue;
            }
        };
        for (id, action) in expired {
            if !busy.try_claim(&id) {
                continue;
            }
            let (svc, busy) = (svc.clone(), busy.clone());
            tokio::spawn(async move {
                tracing::info!(sandbox = %id, action = action.as_str(), "TTL expired");
                match action {
                    OnTimeout::Kill => {
                        if let Err(e) = svc.destroy(&id, "ttl").await {
                            tracing::warn!(sandbox = %id, error = %e, "reaper: destroy failed");
                        }
                    }
                    OnTimeout::Pause => {
                        if let Err(e) = svc.pause(&id).await {
                            // A sandbox that cannot be paused is destroyed: the TTL must end its compute.
                            tracing::warn!(sandbox = %id, error = %e, "reaper: pause failed; destroying");
                            if let Err(e) = svc.destroy(&id, "ttl").await {
                                tracing::warn!(sandbox = %id, error = %e, "reaper: destroy failed");
                            }
                        }
                    }
                }
                busy.release(&id);
            });
        }
    }
}

/// Enforces the time limits of project quotas forever (budgets spent: pause; `max_lifetime_s` passed:
/// destroy), once a second ([`Sandboxes::quota_actions`]).
pub async fn quotas(svc: Arc<Sandboxes>) {
    let busy = InFlight::default();
    let mut tick = tokio::time::interval(REAP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let todo = match svc.quota_actions() {
            Ok(todo) => todo,
            Err(e) => {
                tracing::error!(error = %e, "quotas: listing what to enforce");
                continue;
            }
        };
        for (id, why) in todo {
            if !busy.try_claim(&id) {
                continue;
            }
            let (svc, busy) = (svc.clone(), busy.clone());
            tokio::spawn(async move {
                tracing::info!(sandbox = %id, limit = why, "project quota enforced");
                let result = if why == "budget" {
                    svc.pause(&id).await.map(|_| ())
                } else {
                    svc.destroy(&id, "max_lifetime_s").await
                };
                if let Err(e) = result {
                    tracing::warn!(sandbox = %id, limit = why, error = %e, "enforcing a project quota");
                }
                busy.release(&id);
            });
        }
    }
}

/// Runs the health watcher forever.
pub async fn watcher(svc: Arc<Sandboxes>) {
    let busy = InFlight::default();
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let lives: Vec<_> = svc
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for live in lives {
            if !busy.try_claim(&live.id) {
                continue;
            }
            let (svc, busy) = (svc.clone(), busy.clone());
            tokio::spawn(async move {
                check_one(&svc, &live).await;
                busy.release(&live.id);
            });
        }
    }
}

async fn check_one(svc: &Sandboxes, live: &crate::service::Live) {
    let exited = || format!("VM process exited; its log: {}", svc.vmm.exit_log(&live.handle));
    let result = if !svc.vmm.is_alive(&live.handle) {
        svc.fail(&live.id, &exited()).await
    } else if live.current().is_none() {
        match svc.ensure_connected(live, RECONNECT_WINDOW).await {
            Ok(_) => Ok(()),
            // Still gone after the window: nobody can use this sandbox any more.
            Err(e) => {
                if svc.vmm.is_alive(&live.handle) && still_live(svc, live) {
                    svc.fail(&live.id, &e.to_string()).await
                } else if still_live(svc, live) {
                    svc.fail(&live.id, &exited()).await
                } else {
                    Ok(())
                }
            }
        }
    } else {
        ping(svc, live).await
    };
    if let Err(e) = result {
        tracing::warn!(sandbox = %live.id, error = %e, "health watcher");
    }
}

/// Pings a connected agent; fails the sandbox once its agent has not answered for the configured time. An
/// operation that stops the VM on purpose (pause, checkpoint) holds the sandbox's lock: no ping then.
async fn ping(svc: &Sandboxes, live: &crate::service::Live) -> Result<(), ServiceError> {
    let Some(client) = live.current() else {
        return Ok(());
    };
    if svc.op_lock(&live.id).try_lock().is_err() {
        live.clear_silence();
        return Ok(());
    }
    let answered = tokio::time::timeout(PING_TIMEOUT, client.ping()).await;
    if matches!(answered, Ok(Ok(()))) {
        live.clear_silence();
        return Ok(());
    }
    let silent = live.note_silence();
    tracing::debug!(sandbox = %live.id, secs = silent.as_secs(), "agent did not answer a ping");
    if silent < svc.settings.agent_unresponsive || !still_live(svc, live) {
        return Ok(());
    }
    let reason = format!(
        "the guest agent has not answered for {} s (the guest is hung or overloaded)",
        silent.as_secs()
    );
    svc.fail(&live.id, &reason).await
}

/// True while `live` is still the registered live record (not destroyed meanwhile).
fn still_live(svc: &Sandboxes, live: &crate::service::Live) -> bool {
    svc.live(&live.id)
        .is_some_and(|l| std::ptr::eq(Arc::as_ptr(&l), live))
}
