//! `GET /v1/sandboxes/{id}/pty`: an interactive terminal over WebSocket.
//!
//! Frames: binary frames are terminal bytes both ways (client -> server: input, `0x03` is Ctrl-C;
//! server -> client: output). Text frames are JSON control messages: from the client
//! `{"type":"resize","rows":R,"cols":C}` and `{"type":"signal","signal":N}`; from the server, once the
//! program ended, `{"type":"exit","exit_code":N}` (`128 + signal` when killed by a signal, with `signal`),
//! followed by a normal close. A failure after the upgrade closes with code 1011 and the reason. Closing the
//! socket hangs the terminal up (SIGHUP, then SIGTERM and SIGKILL to its process group).
//!
//! Authentication: the `Authorization: Bearer <key>` header like every route, or, for browsers (which cannot
//! set headers on a WebSocket), the subprotocol entry `hearth.key.<key>` in `Sec-WebSocket-Protocol`, accepted on
//! WebSocket upgrades only (`crate::tenancy::presented_key`). Never in the URL: keys in URLs end up in logs and
//! browser histories. The server
//! selects the subprotocol [`PROTOCOL`] when the client offers it (browsers require a selected protocol when
//! they offered any), never the key entry.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use hearth_api::{ErrorBody, ErrorCode};
use hearth_proto::client::{PtyEvent, PtyHandle, PtyInput};
use serde::Deserialize;

use super::AppState;
use super::error::{ApiError, ApiQuery, SandboxId};
use crate::service::exec::exit_code;
use crate::service::pty::PtyOptions;

/// The subprotocol the server selects.
pub const PROTOCOL: &str = "hearth.pty.v1";
/// Prefix of the `Sec-WebSocket-Protocol` entry that carries the API key.
pub const KEY_PROTOCOL_PREFIX: &str = crate::tenancy::KEY_PROTOCOL_PREFIX;
/// Largest WebSocket message accepted from the client.
const MAX_MESSAGE: usize = 1024 * 1024;
/// How often the server pings the client.
const PING_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PtyQuery {
    /// Shell command line to run (`/bin/sh -c`). Default: `/bin/bash -l` if the guest has it, else `/bin/sh`.
    pub cmd: Option<String>,
    /// Terminal rows at start (1-4096, default 24).
    pub rows: Option<u16>,
    /// Terminal columns at start (1-4096, default 80).
    pub cols: Option<u16>,
    /// Absolute working directory (default `/root`, else `/`).
    pub cwd: Option<String>,
    /// Extra environment as a JSON object (`{"NAME":"value"}`); `TERM` defaults to `xterm-256color`.
    pub env: Option<String>,
}

/// A control message from the client.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ClientControl {
    Resize { rows: u16, cols: u16 },
    Signal { signal: i32 },
}

/// Open an interactive terminal (WebSocket). See the module documentation of the frames.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/pty", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), PtyQuery),
    responses(
        (status = 101, description = "Switching to the WebSocket protocol (subprotocol `hearth.pty.v1`). Binary \
            frames carry terminal bytes both ways; text frames carry JSON control messages: from the client \
            `{\"type\":\"resize\",\"rows\":R,\"cols\":C}` and `{\"type\":\"signal\",\"signal\":N}`, from the \
            server `{\"type\":\"exit\",\"exit_code\":N}` before it closes. Authentication: the Authorization \
            header, or the subprotocol entry `hearth.key.<key>`."),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The agent is unreachable", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn pty(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<PtyQuery>,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let env: BTreeMap<String, String> = match &q.env {
        None => BTreeMap::new(),
        Some(s) => serde_json::from_str(s).map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidArgument,
                format!("env must be a JSON object of strings: {e}"),
            )
        })?,
    };
    let opts = PtyOptions {
        cmd: q.cmd,
        rows: q.rows.unwrap_or(24),
        cols: q.cols.unwrap_or(80),
        cwd: q.cwd,
        env,
    };
    // Start first, so that a bad request or a missing sandbox is an HTTP error rather than a closed socket.
    let handle = st.sandboxes.open_pty(&id, opts).await?;
    Ok(ws
        .protocols([PROTOCOL])
        .max_message_size(MAX_MESSAGE)
        .on_upgrade(move |socket| bridge(socket, handle)))
}

/// Carries bytes and control messages between the socket and the guest until either side ends.
async fn bridge(socket: WebSocket, mut handle: PtyHandle) {
    let (mut tx, mut rx) = socket.split();
    let input = handle.input();
    let to_client = async {
        // Pings keep idle sessions alive through proxies and notice clients that vanished without a close.
        let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
        loop {
            let ev = tokio::select! {
                ev = handle.next_event() => ev,
                _ = ping.tick() => {
                    if tx.send(Message::Ping(Default::default())).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let Some(ev) = ev else { return };
            match ev {
                PtyEvent::Output(data) => {
                    if tx.send(Message::Binary(data)).await.is_err() {
                        return;
                    }
                }
                PtyEvent::Exited { code, signal } => {
                    let exit = serde_json::json!({
                        "type": "exit",
                        "exit_code": exit_code(code, signal),
                        "signal": signal,
                    });
                    let _ = tx.send(Message::Text(exit.to_string().into())).await;
                    let _ = tx.send(close(1000, "exited")).await;
                    return;
                }
                PtyEvent::Error(e) => {
                    let _ = tx.send(close(1011, &e.to_string())).await;
                    return;
                }
            }
        }
    };
    let from_client = async {
        while let Some(Ok(msg)) = rx.next().await {
            match msg {
                Message::Binary(data) => {
                    if input.send(data).await.is_err() {
                        // The session ended: its exit is on the way to the client.
                        std::future::pending::<()>().await;
                    }
                }
                Message::Text(text) => control(&input, text.as_str()),
                Message::Close(_) => break,
                Message::Ping(_) | Message::Pong(_) => {}
            }
        }
    };
    // The session ends with the exit (or an error) reported to the client; a client that goes away first
    // ends it too, by dropping the handle (the terminal is hung up).
    tokio::select! {
        () = to_client => {}
        () = from_client => {}
    }
}

fn control(input: &PtyInput, text: &str) {
    match serde_json::from_str::<ClientControl>(text) {
        Ok(ClientControl::Resize { rows, cols }) => {
            let _ = input.resize(rows, cols);
        }
        Ok(ClientControl::Signal { signal }) if (1..=64).contains(&signal) => {
            let _ = input.signal(signal);
        }
        // Unknown or malformed control messages are ignored (a newer client may send more kinds).
        _ => tracing::debug!("ignoring pty control message"),
    }
}

fn close(code: u16, reason: &str) -> Message {
    let mut reason = reason.to_owned();
    // A close frame's reason is at most 123 bytes.
    reason.truncate(reason.floor_char_boundary(120));
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}
