//! The event-stream answer of a create or resume (`Accept: text/event-stream`): [`SandboxStartEvent`]s with the
//! progress of each fetch from the storage bucket, then `done` with the sandbox or `failed` with the error.
//!
//! The create or resume runs in its own task, so a caller that goes away does not stop it half-way. Until the
//! first event exists the handler waits: a request that fails before anything was fetched (a bad template, a
//! quota, a sandbox that is not paused) gets the same typed JSON error a JSON request gets, and the stream only
//! starts with something to say. Progress is sampled from the fetches in flight every [`TICK`].

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use hearth_api::{ErrorCode, FetchProgress, Sandbox, SandboxStartEvent};
use tokio::task::JoinHandle;

use super::error::ApiError;
use crate::service::{Sandboxes, ServiceError};

/// How often the fetches in flight are sampled.
const TICK: Duration = Duration::from_millis(200);

type Op = JoinHandle<Result<Sandbox, ServiceError>>;

/// Samples the fetches of one create or resume and turns changes into events.
struct Watch {
    svc: Arc<Sandboxes>,
    objects: Vec<String>,
    last: HashMap<String, FetchProgress>,
    /// Fetches that left the ones in flight, with their sizes.
    ended: Vec<(String, u64)>,
}

impl Watch {
    /// Events for fetches that started or advanced since the last sample; once the request succeeded
    /// (`finished_ok`), also one for each that ended (a fetch leaves the ones in flight whether it succeeded or
    /// not, so its end is told only then).
    fn sample(&mut self, finished_ok: bool) -> Vec<SandboxStartEvent> {
        let now: HashMap<String, FetchProgress> = self.svc.fetches_of(&self.objects).into_iter().collect();
        let mut events = Vec::new();
        for object in &self.objects {
            match (self.last.get(object), now.get(object)) {
                (b, Some(p)) if b != Some(p) => events.push(fetch_event(object, p.done_bytes, p.total_bytes)),
                (Some(b), None) => self.ended.push((object.clone(), b.total_bytes)),
                _ => {}
            }
        }
        self.last = now;
        if finished_ok {
            events.extend(
                self.ended
                    .drain(..)
                    .map(|(o, total)| fetch_event(&o, total, total)),
            );
        }
        events
    }
}

fn fetch_event(object: &str, done_bytes: u64, total_bytes: u64) -> SandboxStartEvent {
    SandboxStartEvent::Fetch {
        object: object.to_string(),
        done_bytes,
        total_bytes,
    }
}

fn last_event(result: Result<Result<Sandbox, ServiceError>, tokio::task::JoinError>) -> SandboxStartEvent {
    match result {
        Ok(Ok(sandbox)) => SandboxStartEvent::Done {
            sandbox: Box::new(sandbox),
        },
        Ok(Err(e)) => SandboxStartEvent::Failed {
            code: e.code(),
            message: e.to_string(),
        },
        Err(e) => SandboxStartEvent::Failed {
            code: ErrorCode::Internal,
            message: format!("task failed: {e}"),
        },
    }
}

fn sse_event(ev: &SandboxStartEvent) -> Event {
    // A derived Serialize of strings, integers and enums does not fail.
    let data = serde_json::to_string(ev).unwrap_or_else(|_| "{}".to_string());
    Event::default().event(ev.name()).data(data)
}

/// The answer of a create or resume asked for as an event stream; `op` is its task, `objects` the bucket
/// objects it may fetch.
pub(super) async fn start_events(svc: Arc<Sandboxes>, objects: Vec<String>, mut op: Op) -> Response {
    let mut watch = Watch {
        svc,
        objects,
        last: HashMap::new(),
        ended: Vec::new(),
    };
    // Until there is something to stream, an error is answered as JSON.
    let first = loop {
        tokio::select! {
            result = &mut op => {
                if let Ok(Err(e)) = result {
                    return ApiError::from(e).into_response();
                }
                let mut events = watch.sample(matches!(result, Ok(Ok(_))));
                events.push(last_event(result));
                break events;
            }
            () = tokio::time::sleep(TICK) => {
                let events = watch.sample(false);
                if !events.is_empty() {
                    break events;
                }
            }
        }
    };
    enum Phase {
        Running(Box<Watch>, Op),
        Done,
    }
    let done = first.last().is_some_and(SandboxStartEvent::is_terminal);
    let head = futures::stream::iter(first.into_iter().map(|e| Ok::<_, Infallible>(sse_event(&e))));
    let phase = if done {
        Phase::Done
    } else {
        Phase::Running(Box::new(watch), op)
    };
    let rest = futures::stream::unfold(phase, |phase| async move {
        let Phase::Running(mut watch, mut op) = phase else {
            return None;
        };
        loop {
            tokio::select! {
                result = &mut op => {
                    // Fetches that ended since the last sample, then the result.
                    let ok = matches!(result, Ok(Ok(_)));
                    let mut events: Vec<Event> = watch.sample(ok).iter().map(sse_event).collect();
                    events.push(sse_event(&last_event(result)));
                    let events: Vec<Result<Event, Infallible>> = events.into_iter().map(Ok).collect();
                    return Some((futures::stream::iter(events), Phase::Done));
                }
                () = tokio::time::sleep(TICK) => {
                    let events = watch.sample(false);
                    if !events.is_empty() {
                        let events: Vec<Result<Event, Infallible>> =
                            events.iter().map(|e| Ok(sse_event(e))).collect();
                        return Some((futures::stream::iter(events), Phase::Running(watch, op)));
                    }
                }
            }
        }
    });
    use futures::StreamExt;
    Sse::new(head.chain(rest.flatten()))
        .keep_alive(KeepAlive::default())
        .into_response()
}
