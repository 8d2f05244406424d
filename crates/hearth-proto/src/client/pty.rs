//! PTY sessions: a program on a pseudo-terminal in the guest, its output, input, size and signals.

use std::sync::Arc;

use bytes::Bytes;

use super::ops::send_chunks;
use super::{AgentClient, ClientError, StreamRx, into_result, unexpected};
use crate::io::CreditWindow;
use crate::msg::{GuestMsg, HostMsg, PtyRequest};

/// One event of a PTY session.
#[derive(Debug)]
pub enum PtyEvent {
    /// Bytes the terminal printed.
    Output(Bytes),
    /// The program ended; no events follow.
    Exited { code: Option<i32>, signal: Option<i32> },
    /// The session failed (agent error or connection lost); no events follow.
    Error(ClientError),
}

/// A running PTY session. Dropping it before `Exited` hangs the terminal up (the agent sends SIGHUP and
/// SIGTERM to its process group, then SIGKILL after a short grace).
pub struct PtyHandle {
    pub pid: u32,
    rx: StreamRx,
    ended: bool,
}

impl PtyHandle {
    /// The next event; `None` after `Exited` or `Error`.
    pub async fn next_event(&mut self) -> Option<PtyEvent> {
        if self.ended {
            return None;
        }
        let ev = match self.rx.recv().await {
            Ok((GuestMsg::Stdout, data)) => PtyEvent::Output(data),
            Ok((GuestMsg::Exited(st), _)) => PtyEvent::Exited {
                code: st.code,
                signal: st.signal,
            },
            Ok((msg, _)) => PtyEvent::Error(
                into_result(msg)
                    .err()
                    .unwrap_or_else(|| ClientError::Protocol("unexpected message on a pty stream".into())),
            ),
            Err(e) => PtyEvent::Error(e),
        };
        if matches!(ev, PtyEvent::Exited { .. } | PtyEvent::Error(_)) {
            self.ended = true;
        }
        Some(ev)
    }

    /// Sender of input, size changes and signals (cheap to clone; usable while events are awaited).
    pub fn input(&self) -> PtyInput {
        PtyInput {
            client: self.rx.client().clone(),
            stream: self.rx.id(),
            window: self.rx.send_window().clone(),
        }
    }
}

/// Sends input, resizes and signals to a PTY session.
#[derive(Clone)]
pub struct PtyInput {
    client: AgentClient,
    stream: u32,
    window: Arc<CreditWindow>,
}

impl PtyInput {
    /// Type `data` into the terminal (any size; chunked and flow-controlled). The byte 0x03 is Ctrl-C.
    pub async fn send(&self, data: Bytes) -> Result<(), ClientError> {
        send_chunks(&self.client, self.stream, &self.window, &HostMsg::Stdin, data).await
    }

    /// Change the terminal size; the program gets SIGWINCH.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<(), ClientError> {
        if !crate::msg::valid_pty_size(rows, cols) {
            return Err(ClientError::Guest {
                kind: crate::ErrorKind::InvalidRequest,
                message: format!("invalid terminal size {rows}x{cols}"),
            });
        }
        self.control(&HostMsg::PtyResize { rows, cols })
    }

    /// Send `signal` to the session's process group.
    pub fn signal(&self, signal: i32) -> Result<(), ClientError> {
        self.control(&HostMsg::PtySignal { signal })
    }

    fn control(&self, msg: &HostMsg) -> Result<(), ClientError> {
        if self.window.is_closed() {
            return Err(ClientError::StreamEnded);
        }
        self.client
            .shared
            .out
            .send(self.stream, msg, Bytes::new())
            .map_err(|_| self.client.shared.closed_error())
    }
}

impl AgentClient {
    /// Start `req` on a new pseudo-terminal in the guest.
    pub async fn pty(&self, req: PtyRequest) -> Result<PtyHandle, ClientError> {
        let mut rx = self.open(&HostMsg::Pty(req), Bytes::new())?;
        let (msg, _) = rx.recv().await?;
        match into_result(msg)? {
            GuestMsg::Started { pid } => Ok(PtyHandle {
                pid,
                rx,
                ended: false,
            }),
            other => Err(unexpected(&other)),
        }
    }
}

impl std::fmt::Debug for PtyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PtyHandle")
            .field("pid", &self.pid)
            .field("ended", &self.ended)
            .finish()
    }
}

impl std::fmt::Debug for PtyInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PtyInput").field("stream", &self.stream).finish()
    }
}
