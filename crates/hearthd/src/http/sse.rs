//! Server-sent events for streamed commands: `event: start|stdout|stderr|exit|error`, `data:` one JSON
//! [`CommandEvent`].
//!
//! Chunks pass through as the agent delivers them: the stream pulls the next event only when the HTTP body
//! wants more, and the agent client returns flow-control credit only as events are consumed, so a slow client
//! slows its own command and nothing is buffered without bound.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use base64::Engine;
use futures::Stream;
use hearth_api::{CommandEvent, ErrorCode};
use hearth_proto::client::ExecEvent;

use crate::service::exec::{RunningCommand, exit_code};
use crate::service::{Sandboxes, ServiceError};

enum Phase {
    Start(RunningCommand),
    Running(RunningCommand),
    Done,
}

fn event(ev: &CommandEvent) -> Event {
    let name = match ev {
        CommandEvent::Start { .. } => "start",
        CommandEvent::Stdout { .. } => "stdout",
        CommandEvent::Stderr { .. } => "stderr",
        CommandEvent::Exit { .. } => "exit",
        CommandEvent::Error { .. } => "error",
    };
    // A derived Serialize of strings and integers does not fail.
    let data = serde_json::to_string(ev).unwrap_or_else(|_| "{}".to_string());
    Event::default().event(name).data(data)
}

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// The SSE response of a started command.
pub fn command_events(
    svc: Arc<Sandboxes>,
    id: String,
    cmd: RunningCommand,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let stream = futures::stream::unfold(Phase::Start(cmd), move |phase| {
        let svc = svc.clone();
        let id = id.clone();
        async move {
            match phase {
                Phase::Done => None,
                Phase::Start(cmd) => {
                    let ev = CommandEvent::Start { pid: cmd.pid };
                    Some((Ok(event(&ev)), Phase::Running(cmd)))
                }
                Phase::Running(mut cmd) => {
                    let next = tokio::time::timeout_at(cmd.deadline, cmd.handle.next_event()).await;
                    let (ev, more) = match next {
                        Ok(Some(ExecEvent::Stdout(b))) => (CommandEvent::Stdout { data_b64: b64(&b) }, true),
                        Ok(Some(ExecEvent::Stderr(b))) => (CommandEvent::Stderr { data_b64: b64(&b) }, true),
                        Ok(Some(ExecEvent::Exited {
                            code,
                            signal,
                            timed_out,
                        })) => (
                            CommandEvent::Exit {
                                exit_code: exit_code(code, signal),
                                signal,
                                timed_out,
                            },
                            false,
                        ),
                        Ok(Some(ExecEvent::Error(e))) => {
                            let e = ServiceError::from(e);
                            (
                                CommandEvent::Error {
                                    code: e.code(),
                                    message: e.to_string(),
                                },
                                false,
                            )
                        }
                        Ok(None) => (
                            CommandEvent::Error {
                                code: ErrorCode::AgentUnavailable,
                                message: "command stream ended without exit".into(),
                            },
                            false,
                        ),
                        Err(_) => {
                            svc.kill_after_host_timeout(&id, cmd.pid).await;
                            (
                                CommandEvent::Error {
                                    code: ErrorCode::AgentUnavailable,
                                    message: format!(
                                        "agent did not report the end of process {} in time",
                                        cmd.pid
                                    ),
                                },
                                false,
                            )
                        }
                    };
                    Some((
                        Ok(event(&ev)),
                        if more { Phase::Running(cmd) } else { Phase::Done },
                    ))
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}
