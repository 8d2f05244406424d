//! Streaming operations of [`AgentClient`]: processes and file content.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_core::Stream;

use super::{AgentClient, ClientError, StreamRx, into_result, unexpected};
use crate::frame::MAX_DATA_LEN;
use crate::io::CreditWindow;
use crate::msg::{ExecRequest, ExitStatus, FileInfo, GuestMsg, HostMsg, ProcInfo};
use crate::{DATA_CHUNK, TAIL_MAX};

/// Most entries accepted in one listing (a guest could otherwise stream batches forever).
const MAX_LIST_ENTRIES: usize = 200_000;
/// Most bytes of names, paths and command lines one listing may hold in the daemon's memory, whatever the
/// entry count (200,000 entries of 64 KiB each would be gigabytes).
const MAX_LIST_BYTES: usize = 32 << 20;
/// Longest path, name, link target or command line accepted in an entry (Linux's `PATH_MAX`).
const MAX_ENTRY_STRING: usize = 4096;
/// What one entry costs beyond its strings (fixed fields, allocation overhead).
const ENTRY_OVERHEAD: usize = 64;

/// Counts what a listing holds and refuses it once it is larger than the daemon keeps for a guest.
#[derive(Default)]
struct ListBudget {
    entries: usize,
    bytes: usize,
}

impl ListBudget {
    fn take(&mut self, what: &str, strings: &[&str]) -> Result<(), ClientError> {
        if let Some(long) = strings.iter().find(|s| s.len() > MAX_ENTRY_STRING) {
            return Err(ClientError::Protocol(format!(
                "{what}: an entry holds a string of {} bytes (at most {MAX_ENTRY_STRING})",
                long.len()
            )));
        }
        self.entries += 1;
        self.bytes += ENTRY_OVERHEAD + strings.iter().map(|s| s.len()).sum::<usize>();
        if self.entries > MAX_LIST_ENTRIES || self.bytes > MAX_LIST_BYTES {
            return Err(ClientError::Protocol(format!(
                "{what} too long (more than {MAX_LIST_ENTRIES} entries or {} MiB)",
                MAX_LIST_BYTES >> 20
            )));
        }
        Ok(())
    }
}

/// One event of a foreground exec.
#[derive(Debug)]
pub enum ExecEvent {
    Stdout(Bytes),
    Stderr(Bytes),
    /// The process ended; no events follow.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
    },
    /// The exec failed after it started (agent error or connection lost); no events follow.
    Error(ClientError),
}

/// A running foreground exec. Dropping it before `Exited` abandons the stream: the agent stops the process
/// (SIGHUP and SIGTERM to its process group, SIGKILL after a short grace); it stays waitable by pid until it
/// is gone. (If the connection is lost instead, the process keeps running and stays waitable.)
pub struct ExecHandle {
    pub pid: u32,
    rx: StreamRx,
    ended: bool,
}

impl ExecHandle {
    /// The next event; `None` after `Exited` or `Error`.
    pub async fn next_event(&mut self) -> Option<ExecEvent> {
        if self.ended {
            return None;
        }
        let ev = match self.rx.recv().await {
            Ok((GuestMsg::Stdout, data)) => ExecEvent::Stdout(data),
            Ok((GuestMsg::Stderr, data)) => ExecEvent::Stderr(data),
            Ok((GuestMsg::Exited(st), _)) => ExecEvent::Exited {
                code: st.code,
                signal: st.signal,
                timed_out: st.timed_out,
            },
            Ok((msg, _)) => ExecEvent::Error(
                into_result(msg)
                    .err()
                    .unwrap_or_else(|| ClientError::Protocol("unexpected message on an exec stream".into())),
            ),
            Err(e) => ExecEvent::Error(e),
        };
        if matches!(ev, ExecEvent::Exited { .. } | ExecEvent::Error(_)) {
            self.ended = true;
        }
        Some(ev)
    }

    /// Writer for the process' stdin (the exec must have been started with `stdin: true`).
    pub fn stdin(&self) -> StdinWriter {
        StdinWriter {
            client: self.rx.client().clone(),
            stream: self.rx.id(),
            window: self.rx.send_window().clone(),
        }
    }
}

/// Sends stdin data on a foreground exec stream, respecting the agent's credit.
#[derive(Clone)]
pub struct StdinWriter {
    client: AgentClient,
    stream: u32,
    window: Arc<CreditWindow>,
}

impl StdinWriter {
    /// Send `data` (any size; chunked and flow-controlled).
    pub async fn send(&self, data: Bytes) -> Result<(), ClientError> {
        send_chunks(&self.client, self.stream, &self.window, &HostMsg::Stdin, data).await
    }

    /// Close the process' stdin.
    pub async fn close(&self) -> Result<(), ClientError> {
        if self.window.is_closed() {
            return Err(ClientError::StreamEnded);
        }
        self.client
            .shared
            .out
            .send(self.stream, &HostMsg::StdinEof, Bytes::new())
            .map_err(|_| ClientError::Closed)
    }
}

/// Send `data` as `msg` data frames on `stream`, waiting for credit before each chunk.
pub(super) async fn send_chunks(
    client: &AgentClient,
    stream: u32,
    window: &CreditWindow,
    msg: &HostMsg,
    mut data: Bytes,
) -> Result<(), ClientError> {
    while !data.is_empty() {
        let chunk = data.split_to(data.len().min(DATA_CHUNK));
        window.acquire(crate::data_cost(chunk.len())).await.map_err(|_| {
            if client.is_closed() {
                client.shared.closed_error()
            } else {
                ClientError::StreamEnded
            }
        })?;
        client
            .shared
            .out
            .send(stream, msg, chunk)
            .map_err(|_| client.shared.closed_error())?;
    }
    Ok(())
}

/// Exit status and output tails of a process, as returned by `wait_process`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcExit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// Last (at most 1 MiB) bytes of stdout.
    pub stdout_tail: Bytes,
    /// Last (at most 1 MiB) bytes of stderr.
    pub stderr_tail: Bytes,
}

/// Append to a tail buffer, keeping only the last [`TAIL_MAX`] bytes.
fn push_tail(tail: &mut BytesMut, data: &[u8]) {
    tail.extend_from_slice(data);
    if tail.len() > TAIL_MAX {
        let cut = tail.len() - TAIL_MAX;
        let _ = tail.split_to(cut);
    }
}

impl AgentClient {
    /// Start a foreground process; its output arrives as [`ExecEvent`]s.
    pub async fn exec(&self, mut req: ExecRequest) -> Result<ExecHandle, ClientError> {
        req.background = false;
        let mut rx = self.open(&HostMsg::Exec(req), Bytes::new())?;
        let (msg, _) = rx.recv().await?;
        match into_result(msg)? {
            GuestMsg::Started { pid } => Ok(ExecHandle {
                pid,
                rx,
                ended: false,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Start a background process and return its pid; it outlives this call and reconnects.
    pub async fn spawn_background(&self, mut req: ExecRequest) -> Result<u32, ClientError> {
        req.background = true;
        let mut rx = self.open(&HostMsg::Exec(req), Bytes::new())?;
        let (msg, _) = rx.recv().await?;
        rx.finish();
        match into_result(msg)? {
            GuestMsg::Started { pid } => Ok(pid),
            other => Err(unexpected(&other)),
        }
    }

    /// The agent's process table (background processes, and foreground ones whose stream was lost).
    pub async fn list_processes(&self) -> Result<Vec<ProcInfo>, ClientError> {
        let mut rx = self.open(&HostMsg::ListProcs, Bytes::new())?;
        let mut all = Vec::new();
        let mut budget = ListBudget::default();
        loop {
            let (msg, _) = rx.recv().await?;
            match into_result(msg)? {
                GuestMsg::Procs { procs } => {
                    for p in procs {
                        budget.take("process list", &[&p.cmd])?;
                        all.push(p);
                    }
                }
                GuestMsg::Ok => return Ok(all),
                other => return Err(unexpected(&other)),
            }
        }
    }

    /// Wait until `pid` exits and return its status and output tails.
    pub async fn wait_process(&self, pid: u32) -> Result<ProcExit, ClientError> {
        match self.wait_inner(pid, None).await? {
            Some(exit) => Ok(exit),
            None => Err(ClientError::Protocol(
                "agent reported a timeout for a wait without one".into(),
            )),
        }
    }

    /// Like [`AgentClient::wait_process`], but gives up after `timeout` with `Ok(None)` (process still runs).
    pub async fn wait_process_timeout(
        &self,
        pid: u32,
        timeout: Duration,
    ) -> Result<Option<ProcExit>, ClientError> {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self.wait_inner(pid, Some(ms)).await
    }

    async fn wait_inner(&self, pid: u32, timeout_ms: Option<u64>) -> Result<Option<ProcExit>, ClientError> {
        let mut rx = self.open(&HostMsg::WaitProc { pid, timeout_ms }, Bytes::new())?;
        let mut out = BytesMut::new();
        let mut err = BytesMut::new();
        loop {
            let (msg, data) = rx.recv().await?;
            match into_result(msg)? {
                GuestMsg::Stdout => push_tail(&mut out, &data),
                GuestMsg::Stderr => push_tail(&mut err, &data),
                GuestMsg::Exited(ExitStatus {
                    code,
                    signal,
                    timed_out,
                }) => {
                    return Ok(Some(ProcExit {
                        code,
                        signal,
                        timed_out,
                        stdout_tail: out.freeze(),
                        stderr_tail: err.freeze(),
                    }));
                }
                GuestMsg::StillRunning => return Ok(None),
                other => return Err(unexpected(&other)),
            }
        }
    }

    /// Write `data` to the stdin of background process `pid` (started with `stdin: true`); close it after
    /// when `eof`.
    pub async fn write_stdin(&self, pid: u32, mut data: Bytes, eof: bool) -> Result<(), ClientError> {
        loop {
            let chunk = data.split_to(data.len().min(MAX_DATA_LEN));
            let last = data.is_empty();
            match self
                .call(
                    &HostMsg::ProcStdin {
                        pid,
                        eof: eof && last,
                    },
                    chunk,
                )
                .await?
            {
                GuestMsg::Ok => {}
                other => return Err(unexpected(&other)),
            }
            if last {
                return Ok(());
            }
        }
    }

    /// Open a file for reading: its metadata, then its content as a stream of chunks.
    pub async fn read_file(&self, path: &str) -> Result<(FileInfo, FileReader), ClientError> {
        let mut rx = self.open(
            &HostMsg::ReadFile {
                path: path.to_owned(),
            },
            Bytes::new(),
        )?;
        let (msg, _) = rx.recv().await?;
        match into_result(msg)? {
            GuestMsg::ReadStart { info } => Ok((
                info,
                FileReader {
                    rx,
                    received: 0,
                    ended: false,
                },
            )),
            other => Err(unexpected(&other)),
        }
    }

    /// Create or truncate `path` with the content of `body`; returns the number of bytes written. The parent
    /// directory must exist. `mode` defaults to the existing file's mode, else 0o644.
    pub async fn write_file<S, E>(&self, path: &str, mode: Option<u32>, body: S) -> Result<u64, ClientError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let mut rx = self.open(
            &HostMsg::WriteFile {
                path: path.to_owned(),
                mode,
            },
            Bytes::new(),
        )?;
        let window = rx.send_window().clone();
        let mut body = std::pin::pin!(body);
        while let Some(item) = std::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
            let data = item.map_err(|e| ClientError::Body(e.to_string()))?;
            if let Err(e) = send_chunks(self, rx.id(), &window, &HostMsg::FileData, data).await {
                // An early answer (e.g. the parent does not exist) ends the stream: report it.
                if matches!(e, ClientError::StreamEnded) {
                    let (msg, _) = rx.recv().await?;
                    into_result(msg)?;
                }
                return Err(e);
            }
        }
        self.shared
            .out
            .send(rx.id(), &HostMsg::FileEnd, Bytes::new())
            .map_err(|_| self.shared.closed_error())?;
        let (msg, _) = rx.recv().await?;
        match into_result(msg)? {
            GuestMsg::Written { bytes } => Ok(bytes),
            other => Err(unexpected(&other)),
        }
    }

    /// Entries of a directory (not following symlinks), sorted by name.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<FileInfo>, ClientError> {
        let mut rx = self.open(
            &HostMsg::ListDir {
                path: path.to_owned(),
            },
            Bytes::new(),
        )?;
        let mut all = Vec::new();
        let mut budget = ListBudget::default();
        loop {
            let (msg, _) = rx.recv().await?;
            match into_result(msg)? {
                GuestMsg::Entries { entries } => {
                    for e in entries {
                        let link = e.link_target.as_deref().unwrap_or_default();
                        budget.take("directory listing", &[&e.name, &e.path, link])?;
                        all.push(e);
                    }
                }
                GuestMsg::Ok => return Ok(all),
                other => return Err(unexpected(&other)),
            }
        }
    }
}

/// Content of a file being read, chunk by chunk. Dropping it early abandons the read.
pub struct FileReader {
    rx: StreamRx,
    received: u64,
    ended: bool,
}

impl Stream for FileReader {
    type Item = Result<Bytes, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let res = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r,
        };
        let item = match res.and_then(|(msg, data)| Ok((into_result(msg)?, data))) {
            Ok((GuestMsg::FileData, data)) => {
                self.received += data.len() as u64;
                return Poll::Ready(Some(Ok(data)));
            }
            Ok((GuestMsg::ReadDone { bytes }, _)) if bytes == self.received => None,
            Ok((GuestMsg::ReadDone { bytes }, _)) => Some(Err(ClientError::Protocol(format!(
                "agent announced {bytes} bytes but sent {}",
                self.received
            )))),
            Ok((other, _)) => Some(Err(unexpected(&other))),
            Err(e) => Some(Err(e)),
        };
        self.ended = true;
        Poll::Ready(item)
    }
}

impl FileReader {
    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// True once the whole file has been delivered (or the read failed).
    pub fn is_finished(&self) -> bool {
        self.ended || self.rx.is_done()
    }
}

impl std::fmt::Debug for ExecHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHandle")
            .field("pid", &self.pid)
            .field("ended", &self.ended)
            .finish()
    }
}

impl std::fmt::Debug for StdinWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StdinWriter")
            .field("stream", &self.stream)
            .finish()
    }
}

impl std::fmt::Debug for FileReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileReader")
            .field("received", &self.received)
            .field("ended", &self.ended)
            .finish()
    }
}
