//! Interactive terminals: `GET /v1/sandboxes/{id}/pty` over WebSocket.
//!
//! [`Client::open_pty`] starts a program on a terminal in the guest and returns a [`PtySession`]; split it
//! into a [`PtyWriter`] (input bytes, resize, signal) and a [`PtyReader`] (output, then the exit) to use both
//! at once. Dropping the session (or closing it) hangs the terminal up in the guest.

use std::collections::BTreeMap;

use bytes::Bytes;
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message};

use crate::{Client, Error};

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// What to start on the terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtyOptions {
    /// Shell command line (`/bin/sh -c`); `None` starts the guest's shell (bash if present, else sh).
    pub cmd: Option<String>,
    pub rows: u16,
    pub cols: u16,
    /// Absolute working directory in the guest.
    pub cwd: Option<String>,
    /// Extra environment (`TERM` defaults to `xterm-256color`).
    pub env: BTreeMap<String, String>,
}

impl Default for PtyOptions {
    fn default() -> Self {
        PtyOptions {
            cmd: None,
            rows: 24,
            cols: 80,
            cwd: None,
            env: BTreeMap::new(),
        }
    }
}

/// What the terminal sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtyEvent {
    /// Bytes the terminal printed.
    Output(Bytes),
    /// The program ended: its exit code (`128 + signal` when killed by one). Nothing follows.
    Exit { exit_code: i32, signal: Option<i32> },
}

/// An open terminal.
pub struct PtySession {
    ws: Ws,
}

impl PtySession {
    /// Separate halves for writing and reading at the same time.
    pub fn split(self) -> (PtyWriter, PtyReader) {
        let (sink, stream) = self.ws.split();
        (
            PtyWriter { sink },
            PtyReader {
                stream,
                exited: false,
            },
        )
    }
}

/// Sends input, size changes and signals.
pub struct PtyWriter {
    sink: SplitSink<Ws, Message>,
}

impl PtyWriter {
    /// Types `data` into the terminal (`0x03` is Ctrl-C).
    pub async fn send(&mut self, data: &[u8]) -> Result<(), Error> {
        self.sink
            .send(Message::Binary(Bytes::copy_from_slice(data)))
            .await
            .map_err(ws_error)
    }

    /// Changes the terminal size (the program gets SIGWINCH).
    pub async fn resize(&mut self, rows: u16, cols: u16) -> Result<(), Error> {
        self.control(serde_json::json!({"type": "resize", "rows": rows, "cols": cols}))
            .await
    }

    /// Sends `signal` to the terminal's process group.
    pub async fn signal(&mut self, signal: i32) -> Result<(), Error> {
        self.control(serde_json::json!({"type": "signal", "signal": signal}))
            .await
    }

    /// Closes the connection (the terminal is hung up if the program still runs).
    pub async fn close(&mut self) -> Result<(), Error> {
        self.sink.close().await.map_err(ws_error)
    }

    async fn control(&mut self, v: serde_json::Value) -> Result<(), Error> {
        self.sink
            .send(Message::Text(v.to_string().into()))
            .await
            .map_err(ws_error)
    }
}

/// Receives output and the exit.
pub struct PtyReader {
    stream: SplitStream<Ws>,
    exited: bool,
}

impl PtyReader {
    /// The next event; `None` once the exit was delivered and the connection closed.
    pub async fn next(&mut self) -> Option<Result<PtyEvent, Error>> {
        loop {
            let msg = match self.stream.next().await {
                None => return self.ended_without_exit(),
                Some(Err(e)) => {
                    if self.exited {
                        return None;
                    }
                    return Some(Err(ws_error(e)));
                }
                Some(Ok(m)) => m,
            };
            match msg {
                Message::Binary(data) => return Some(Ok(PtyEvent::Output(data))),
                Message::Text(text) => {
                    if let Some(ev) = parse_exit(text.as_str()) {
                        self.exited = true;
                        return Some(Ok(ev));
                    }
                }
                Message::Close(frame) => {
                    if self.exited {
                        return None;
                    }
                    let why = frame.filter(|f| f.code != CloseCode::Normal).map_or_else(
                        || "closed before the program's exit".to_owned(),
                        |f| f.reason.to_string(),
                    );
                    return Some(Err(Error::Terminal(why)));
                }
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
            }
        }
    }

    fn ended_without_exit(&mut self) -> Option<Result<PtyEvent, Error>> {
        if self.exited {
            None
        } else {
            self.exited = true;
            Some(Err(Error::Terminal(
                "connection lost before the program's exit".into(),
            )))
        }
    }
}

fn parse_exit(text: &str) -> Option<PtyEvent> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    if v["type"] != "exit" {
        return None;
    }
    Some(PtyEvent::Exit {
        exit_code: i32::try_from(v["exit_code"].as_i64()?).ok()?,
        signal: v["signal"].as_i64().and_then(|s| i32::try_from(s).ok()),
    })
}

fn ws_error(e: tungstenite::Error) -> Error {
    match e {
        tungstenite::Error::Http(resp) => {
            let status = resp.status().as_u16();
            Error::from_response_body(status, resp.body().as_deref().unwrap_or_default())
        }
        other => Error::Terminal(other.to_string()),
    }
}

impl Client {
    /// `GET /v1/sandboxes/{id}/pty`: starts a program on a terminal in the sandbox (resuming it if paused).
    pub async fn open_pty(&self, id: &str, opts: &PtyOptions) -> Result<PtySession, Error> {
        let mut url = self.url(&["v1", "sandboxes", id, "pty"]);
        let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
        url.set_scheme(scheme)
            .map_err(|()| Error::Terminal(format!("cannot use {scheme} for {url}")))?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("rows", &opts.rows.to_string())
                .append_pair("cols", &opts.cols.to_string());
            if let Some(cmd) = &opts.cmd {
                q.append_pair("cmd", cmd);
            }
            if let Some(cwd) = &opts.cwd {
                q.append_pair("cwd", cwd);
            }
            if !opts.env.is_empty() {
                let env = serde_json::to_string(&opts.env).map_err(|e| Error::Decode(e.to_string()))?;
                q.append_pair("env", &env);
            }
        }
        let mut req = url.as_str().into_client_request().map_err(ws_error)?;
        req.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static("hearth.pty.v1"),
        );
        if let Some(key) = self.api_key() {
            let v = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| Error::InvalidApiKey)?;
            req.headers_mut().insert("authorization", v);
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await.map_err(ws_error)?;
        Ok(PtySession { ws })
    }
}
