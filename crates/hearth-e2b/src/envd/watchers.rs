//! Directory watches on hearth's `GET .../files/watch` (SSE):
//! - `WatchDir`: a Connect stream (`start`, then `filesystem` events, keep-alives) for the JS SDK;
//! - `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`: the polled form the Python SDK uses. The adapter
//!   holds each watch and queues its events (at most [`MAX_QUEUED`], oldest dropped) until polled. A watcher
//!   nobody polled for [`IDLE`] is stopped; at most [`MAX_PER_SANDBOX`] per sandbox, [`MAX_TOTAL`] in all.
//!
//! Event names are paths relative to the watched directory; a rename becomes `RENAME` of the old name and
//! `CREATE` of the new one, as inotify-based envd reports it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::Response;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use hearth_api::WatchEvent;
use hearth_client::WatchStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::connect::{self, Code, Fault};
use super::filesystem::{entry, stat_path};
use super::proto::{WatchRequest, WatcherRequest};
use super::{Envd, code_for};

pub const MAX_QUEUED: usize = 10_000;
pub const MAX_PER_SANDBOX: usize = 64;
pub const MAX_TOTAL: usize = 1024;
pub const IDLE: Duration = Duration::from_secs(600);

/// hearth's agent writes a file through a temporary sibling (`.NAME.hearth-PID-SEQ.tmp`) renamed over it;
/// envd writes in place. Events of those temporaries are not the caller's business.
fn is_agent_temp(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    let Some(inner) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let Some((_, tail)) = inner.rsplit_once(".hearth-") else {
        return false;
    };
    let mut nums = tail.split('-');
    let digits = |s: Option<&str>| s.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    digits(nums.next()) && digits(nums.next()) && nums.next().is_none()
}

/// envd's events for one hearth watch event (`None`: the watch ended normally).
fn envd_events(ev: &WatchEvent) -> Result<Vec<(&'static str, String)>, Option<Fault>> {
    let temp = match ev {
        WatchEvent::Create { path, .. }
        | WatchEvent::Write { path }
        | WatchEvent::Remove { path, .. }
        | WatchEvent::Chmod { path, .. } => is_agent_temp(path),
        _ => false,
    };
    if temp {
        return Ok(Vec::new());
    }
    Ok(match ev {
        // A file written through hearth: the temporary renamed over its name.
        WatchEvent::Rename { path, new_path, .. } if is_agent_temp(path) => match new_path {
            Some(n) => vec![("EVENT_TYPE_CREATE", n.clone()), ("EVENT_TYPE_WRITE", n.clone())],
            None => Vec::new(),
        },
        WatchEvent::Create { path, .. } => vec![("EVENT_TYPE_CREATE", path.clone())],
        WatchEvent::Write { path } => vec![("EVENT_TYPE_WRITE", path.clone())],
        WatchEvent::Remove { path, .. } => vec![("EVENT_TYPE_REMOVE", path.clone())],
        WatchEvent::Rename { path, new_path, .. } => {
            let mut v = vec![("EVENT_TYPE_RENAME", path.clone())];
            if let Some(n) = new_path {
                v.push(("EVENT_TYPE_CREATE", n.clone()));
            }
            v
        }
        WatchEvent::Chmod { path, .. } => vec![("EVENT_TYPE_CHMOD", path.clone())],
        WatchEvent::Ready { .. } | WatchEvent::Overflow => Vec::new(),
        WatchEvent::End => return Err(None),
        WatchEvent::Error { code, message } => {
            return Err(Some(Fault::new(code_for(*code, 0), message.clone())));
        }
    })
}

/// `FilesystemEvent`s for one hearth event, with the entry's metadata when asked for (and still there).
async fn filesystem_events(
    envd: &Envd,
    dir: &str,
    include_entry: bool,
    ev: &WatchEvent,
) -> Result<Vec<serde_json::Value>, Option<Fault>> {
    let mut out = Vec::new();
    for (kind, name) in envd_events(ev)? {
        let mut v = serde_json::json!({ "name": name, "type": kind });
        if include_entry && kind != "EVENT_TYPE_REMOVE" && kind != "EVENT_TYPE_RENAME" {
            let full = format!("{}/{name}", dir.trim_end_matches('/'));
            if let Ok(info) = stat_path(envd, &full).await {
                v["entry"] = entry(&info);
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// Opens the hearth watch and consumes its `ready` event.
async fn open(envd: &Envd, req: &WatchRequest) -> Result<(String, WatchStream), Fault> {
    let dir = envd.resolve(&req.path)?;
    let mut ws = match envd.api.watch_dir(&envd.sandbox, &dir, req.recursive).await {
        Ok(ws) => ws,
        Err(e) => {
            let f = envd.fault(e).await;
            return Err(match f.code {
                Code::FailedPrecondition => Fault::invalid(format!("path is not a directory: {dir}")),
                _ => f,
            });
        }
    };
    match ws.next().await {
        Some(Ok(WatchEvent::Ready { .. })) => Ok((dir, ws)),
        Some(Ok(WatchEvent::Error { code, message })) => Err(Fault::new(code_for(code, 0), message)),
        Some(Err(e)) => Err(envd.fault(e).await),
        _ => Err(Fault::new(Code::Unavailable, "the watch did not start")),
    }
}

/// `WatchDir`.
pub async fn watch_dir(envd: &Envd, headers: &HeaderMap, body: &[u8]) -> Response {
    let started = async {
        let req: WatchRequest = connect::decode_stream_request(headers, body)?;
        let deadline = connect::timeout(headers)?.map(|d| Instant::now() + d);
        let (dir, ws) = open(envd, &req).await?;
        Ok::<_, Fault>((req, deadline, dir, ws))
    };
    match started.await {
        Ok((req, deadline, dir, ws)) => {
            let frames = watch_frames(
                envd.clone(),
                dir,
                req.include_entry,
                ws,
                connect::keepalive(headers),
                deadline,
            );
            connect::stream_response(frames)
        }
        Err(f) => connect::stream_error(&f),
    }
}

fn watch_frames(
    envd: Envd,
    dir: String,
    include_entry: bool,
    ws: WatchStream,
    keepalive: Duration,
    deadline: Option<Instant>,
) -> impl Stream<Item = Bytes> + Send + 'static {
    struct S {
        envd: Envd,
        dir: String,
        include_entry: bool,
        ws: WatchStream,
        ticker: tokio::time::Interval,
        deadline: Instant,
        pending: VecDeque<Bytes>,
        finished: bool,
    }
    let mut ticker = tokio::time::interval_at(Instant::now() + keepalive, keepalive);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = S {
        envd,
        dir,
        include_entry,
        ws,
        ticker,
        deadline: deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400)),
        pending: [connect::message(&serde_json::json!({ "start": {} }))].into(),
        finished: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(frame) = s.pending.pop_front() {
                return Some((frame, s));
            }
            if s.finished {
                return None;
            }
            let stop = s.envd.shared.stop.clone();
            tokio::select! {
                ev = s.ws.next() => {
                    let outcome = match ev {
                        Some(Ok(ev)) => filesystem_events(&s.envd, &s.dir, s.include_entry, &ev).await,
                        Some(Err(e)) => Err(Some(Fault::new(Code::Unavailable, e.to_string()))),
                        None => Err(Some(Fault::new(Code::Unavailable, "the watch stream ended"))),
                    };
                    match outcome {
                        Ok(evs) => s.pending.extend(evs.into_iter().map(|e| {
                            connect::message(&serde_json::json!({ "filesystem": e }))
                        })),
                        Err(f) => {
                            s.pending.push_back(connect::end_stream(f.as_ref()));
                            s.finished = true;
                        }
                    }
                }
                _ = s.ticker.tick() => s.pending.push_back(connect::message(&serde_json::json!({ "keepalive": {} }))),
                _ = tokio::time::sleep_until(s.deadline) => {
                    let f = Fault::new(Code::DeadlineExceeded, "the watch's deadline passed");
                    s.pending.push_back(connect::end_stream(Some(&f)));
                    s.finished = true;
                }
                _ = stop.cancelled() => {
                    let f = Fault::new(Code::Unavailable, "the daemon is shutting down");
                    s.pending.push_back(connect::end_stream(Some(&f)));
                    s.finished = true;
                }
            }
        }
    })
}

/// A polled watcher: the events queued since the last poll.
pub struct Watcher {
    state: Mutex<Queue>,
    cancel: CancellationToken,
}

#[derive(Default)]
struct Queue {
    events: VecDeque<serde_json::Value>,
    /// The watch ended with this error (reported once the queue is drained).
    failed: Option<Fault>,
    last_poll: Option<Instant>,
}

impl Watcher {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn idle(&self, now: Instant) -> bool {
        self.queue()
            .last_poll
            .is_some_and(|t| now.duration_since(t) > IDLE)
    }
}

/// Every polled watcher, by sandbox and id.
#[derive(Default)]
pub struct Registry {
    sandboxes: Mutex<HashMap<String, HashMap<String, Arc<Watcher>>>>,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, HashMap<String, Arc<Watcher>>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops and forgets watchers nobody polled for [`IDLE`].
    fn sweep(&self) {
        let now = Instant::now();
        let mut all = self.lock();
        for m in all.values_mut() {
            m.retain(|_, w| {
                let keep = !w.idle(now);
                if !keep {
                    w.cancel.cancel();
                }
                keep
            });
        }
        all.retain(|_, m| !m.is_empty());
    }

    fn insert(&self, sandbox: &str, id: String, w: Arc<Watcher>) -> Result<(), Fault> {
        let mut all = self.lock();
        let total: usize = all.values().map(HashMap::len).sum();
        let m = all.entry(sandbox.to_owned()).or_default();
        if m.len() >= MAX_PER_SANDBOX || total >= MAX_TOTAL {
            w.cancel.cancel();
            return Err(Fault::new(
                Code::ResourceExhausted,
                format!("too many watchers (at most {MAX_PER_SANDBOX} per sandbox): remove unused ones"),
            ));
        }
        m.insert(id, w);
        Ok(())
    }

    fn get(&self, sandbox: &str, id: &str) -> Option<Arc<Watcher>> {
        self.lock().get(sandbox)?.get(id).cloned()
    }

    fn take(&self, sandbox: &str, id: &str) -> Option<Arc<Watcher>> {
        let mut all = self.lock();
        let m = all.get_mut(sandbox)?;
        let w = m.remove(id);
        if m.is_empty() {
            all.remove(sandbox);
        }
        w
    }

    /// Stops the watchers of a destroyed sandbox.
    pub fn forget_sandbox(&self, sandbox: &str) {
        if let Some(m) = self.lock().remove(sandbox) {
            for w in m.values() {
                w.cancel.cancel();
            }
        }
    }
}

/// `CreateWatcher`: the watch is in place when this answers.
pub async fn create(envd: &Envd, req: WatchRequest) -> Result<serde_json::Value, Fault> {
    let reg = &envd.shared.watchers;
    reg.sweep();
    let (dir, mut ws) = open(envd, &req).await?;
    let watcher = Arc::new(Watcher {
        state: Mutex::new(Queue {
            last_poll: Some(Instant::now()),
            ..Queue::default()
        }),
        cancel: envd.shared.stop.child_token(),
    });
    let id = uuid::Uuid::new_v4().simple().to_string();
    reg.insert(&envd.sandbox, id.clone(), watcher.clone())?;
    let task_envd = envd.clone();
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                ev = ws.next() => ev,
                _ = watcher.cancel.cancelled() => return,
            };
            let outcome = match ev {
                Some(Ok(ev)) => filesystem_events(&task_envd, &dir, req.include_entry, &ev).await,
                Some(Err(e)) => Err(Some(Fault::new(Code::Unavailable, e.to_string()))),
                None => Err(Some(Fault::new(Code::Unavailable, "the watch stream ended"))),
            };
            let mut q = watcher.queue();
            match outcome {
                Ok(evs) => {
                    q.events.extend(evs);
                    let excess = q.events.len().saturating_sub(MAX_QUEUED);
                    q.events.drain(..excess);
                }
                Err(f) => {
                    q.failed = Some(
                        f.unwrap_or_else(|| Fault::new(Code::NotFound, "the watched directory is gone")),
                    );
                    return;
                }
            }
        }
    });
    Ok(serde_json::json!({ "watcherId": id }))
}

/// `GetWatcherEvents`: what happened since the last poll.
pub async fn events(envd: &Envd, req: WatcherRequest) -> Result<serde_json::Value, Fault> {
    envd.authorize().await?;
    let reg = &envd.shared.watchers;
    reg.sweep();
    let w = reg
        .get(&envd.sandbox, &req.watcher_id)
        .ok_or_else(|| Fault::new(Code::NotFound, format!("watcher {} not found", req.watcher_id)))?;
    let (events, failed) = {
        let mut q = w.queue();
        q.last_poll = Some(Instant::now());
        let events: Vec<serde_json::Value> = q.events.drain(..).collect();
        let failed = if events.is_empty() { q.failed.take() } else { None };
        (events, failed)
    };
    if let Some(f) = failed {
        reg.take(&envd.sandbox, &req.watcher_id);
        return Err(f);
    }
    Ok(serde_json::json!({ "events": events }))
}

/// `RemoveWatcher`.
pub async fn remove(envd: &Envd, req: WatcherRequest) -> Result<serde_json::Value, Fault> {
    envd.authorize().await?;
    let w = envd
        .shared
        .watchers
        .take(&envd.sandbox, &req.watcher_id)
        .ok_or_else(|| Fault::new(Code::NotFound, format!("watcher {} not found", req.watcher_id)))?;
    w.cancel.cancel();
    Ok(serde_json::json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hearth_events_become_envd_events() {
        let ev = |e: WatchEvent| envd_events(&e);
        assert_eq!(
            ev(WatchEvent::Create {
                path: "a.txt".into(),
                is_dir: false
            }),
            Ok(vec![("EVENT_TYPE_CREATE", "a.txt".to_string())])
        );
        assert_eq!(
            ev(WatchEvent::Rename {
                path: "a".into(),
                new_path: Some("b".into()),
                is_dir: false
            }),
            Ok(vec![
                ("EVENT_TYPE_RENAME", "a".to_string()),
                ("EVENT_TYPE_CREATE", "b".to_string())
            ])
        );
        assert_eq!(ev(WatchEvent::Overflow), Ok(vec![]));
        // A write through hearth's agent: only the final name shows.
        assert_eq!(
            ev(WatchEvent::Create {
                path: "sub/.a.txt.hearth-1-0.tmp".into(),
                is_dir: false
            }),
            Ok(vec![])
        );
        assert_eq!(
            ev(WatchEvent::Rename {
                path: ".a.txt.hearth-1-0.tmp".into(),
                new_path: Some("a.txt".into()),
                is_dir: false
            }),
            Ok(vec![
                ("EVENT_TYPE_CREATE", "a.txt".to_string()),
                ("EVENT_TYPE_WRITE", "a.txt".to_string())
            ])
        );
        assert!(!is_agent_temp(".a.hearth-x-1.tmp"));
        assert!(!is_agent_temp("a.hearth-1-2.tmp"));
        assert_eq!(ev(WatchEvent::End), Err(None));
        assert!(matches!(
            ev(WatchEvent::Error {
                code: hearth_api::ErrorCode::NotFound,
                message: "gone".into()
            }),
            Err(Some(f)) if f.code == Code::NotFound
        ));
    }

    #[tokio::test]
    async fn watchers_are_bounded_and_idle_ones_expire() {
        let reg = Registry::default();
        let w = || {
            Arc::new(Watcher {
                state: Mutex::new(Queue {
                    last_poll: Some(Instant::now()),
                    ..Queue::default()
                }),
                cancel: CancellationToken::new(),
            })
        };
        for i in 0..MAX_PER_SANDBOX {
            assert!(reg.insert("sbx_a", format!("w{i}"), w()).is_ok());
        }
        let extra = w();
        assert!(reg.insert("sbx_a", "x".into(), extra.clone()).is_err());
        assert!(extra.cancel.is_cancelled());
        let old = reg.get("sbx_a", "w0").unwrap_or_else(w);
        old.queue().last_poll = Instant::now().checked_sub(IDLE + Duration::from_secs(1));
        reg.sweep();
        assert!(reg.get("sbx_a", "w0").is_none());
        assert!(old.cancel.is_cancelled());
        assert!(reg.get("sbx_a", "w1").is_some());
        reg.forget_sandbox("sbx_a");
        assert!(reg.get("sbx_a", "w1").is_none());
    }
}
