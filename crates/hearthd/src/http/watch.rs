//! `GET /v1/sandboxes/{id}/files/watch`: a directory's changes as server-sent events.
//!
//! The watch lives as long as the response: a client that disconnects drops the stream, which stops the watch
//! in the guest. Events are pulled from the agent only as the body is sent, so a slow client leaves them
//! queued in the guest (bounded there; an `overflow` event reports what was dropped).

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use hearth_api::{ErrorBody, WatchEvent};
use hearth_proto::client::DirWatcher;
use serde::Deserialize;

use super::AppState;
use super::error::{ApiError, ApiQuery, SandboxId};
use crate::service::ServiceError;
use crate::service::watch::to_api;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    /// Absolute path of a directory in the guest.
    pub path: String,
    /// Also watch every subdirectory, including ones created while watching.
    #[serde(default)]
    pub recursive: bool,
}

/// Watch a directory: server-sent events (`event:` is the type, `data:` the JSON), starting with `ready` once
/// the watch is in place, then `create`, `write`, `remove`, `rename`, `chmod` with paths relative to the
/// directory, `overflow` when events were dropped for a slow reader, and `end` when the directory itself goes
/// away (`error` if the watch fails). Lasts until the client disconnects.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/watch", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), WatchQuery),
    responses(
        (status = 200, description = "The event stream", content_type = "text/event-stream", body = WatchEvent),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "Not a directory, or the sandbox is not running", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn watch(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<WatchQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let watcher = st.sandboxes.watch_dir(&id, &q.path, q.recursive).await?;
    let ready = WatchEvent::Ready {
        path: q.path,
        recursive: q.recursive,
    };
    Ok(Sse::new(events(watcher, ready)).keep_alive(KeepAlive::default()))
}

fn sse_event(ev: &WatchEvent) -> Event {
    // A derived Serialize of strings, booleans and enums does not fail.
    let data = serde_json::to_string(ev).unwrap_or_else(|_| "{}".to_string());
    Event::default().event(ev.name()).data(data)
}

struct WatchState {
    watcher: DirWatcher,
    queue: VecDeque<WatchEvent>,
    done: bool,
}

fn events(watcher: DirWatcher, ready: WatchEvent) -> impl Stream<Item = Result<Event, Infallible>> {
    let state = WatchState {
        watcher,
        queue: VecDeque::from([ready]),
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.queue.pop_front() {
                return Some((Ok(sse_event(&ev)), st));
            }
            if st.done {
                return None;
            }
            match st.watcher.next_batch().await {
                Some(Ok(batch)) => st.queue.extend(batch.into_iter().filter_map(to_api)),
                None => {
                    st.queue.push_back(WatchEvent::End);
                    st.done = true;
                }
                Some(Err(e)) => {
                    let e = ServiceError::from(e);
                    st.queue.push_back(WatchEvent::Error {
                        code: e.code(),
                        message: e.to_string(),
                    });
                    st.done = true;
                }
            }
        }
    })
}
