//! [`AgentClient::watch_dir`]: a directory watch as a stream of event batches.

use bytes::Bytes;

use super::{AgentClient, ClientError, StreamRx, into_result, unexpected};
use crate::msg::{GuestMsg, HostMsg};
use crate::watch::{WatchEvent, WatchRequest};

/// Longest path accepted in an event from the guest (longer ones are a protocol error).
const MAX_EVENT_PATH: usize = 4096;

/// A directory watch in the guest. Dropping it stops the watch (the agent gets `Abandon`).
pub struct DirWatcher {
    rx: StreamRx,
    ended: bool,
}

impl std::fmt::Debug for DirWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWatcher").field("ended", &self.ended).finish()
    }
}

impl AgentClient {
    /// Start watching the directory `path` (and its subdirectories with `recursive`). Returns once the watch
    /// is in place, so changes made after this returns are reported; a missing path or a file fails here.
    pub async fn watch_dir(&self, path: &str, recursive: bool) -> Result<DirWatcher, ClientError> {
        let req = WatchRequest {
            path: path.to_owned(),
            recursive,
        };
        let mut rx = self.open(&HostMsg::WatchDir(req), Bytes::new())?;
        let (msg, _) = rx.recv().await?;
        match into_result(msg)? {
            GuestMsg::Watching => Ok(DirWatcher { rx, ended: false }),
            other => Err(unexpected(&other)),
        }
    }
}

impl DirWatcher {
    /// The next batch of events, in the order they happened; `None` once the watched directory is gone (or
    /// after an error). A batch is never empty.
    pub async fn next_batch(&mut self) -> Option<Result<Vec<WatchEvent>, ClientError>> {
        loop {
            if self.ended {
                return None;
            }
            let item = match self.rx.recv().await {
                Ok((GuestMsg::WatchEvents, data)) => match parse_batch(&data) {
                    Ok(events) if events.is_empty() => continue,
                    other => other,
                },
                Ok((GuestMsg::Ok, _)) => {
                    self.ended = true;
                    return None;
                }
                Ok((msg, _)) => Err(into_result(msg)
                    .err()
                    .unwrap_or_else(|| ClientError::Protocol("unexpected message on a watch stream".into()))),
                Err(e) => Err(e),
            };
            if item.is_err() {
                self.ended = true;
            }
            return Some(item);
        }
    }
}

/// Decode one `WatchEvents` data section (untrusted).
fn parse_batch(data: &[u8]) -> Result<Vec<WatchEvent>, ClientError> {
    let events: Vec<WatchEvent> = serde_json::from_slice(data)
        .map_err(|e| ClientError::Protocol(format!("malformed watch events: {e}")))?;
    let too_long = |p: &str| p.len() > MAX_EVENT_PATH;
    if events
        .iter()
        .any(|e| too_long(&e.path) || e.new_path.as_deref().is_some_and(too_long))
    {
        return Err(ClientError::Protocol("watch event path too long".into()));
    }
    Ok(events)
}
