//! The host side of the agent channel (feature `client`).
//!
//! [`AgentClient::connect`] performs the `Hello` handshake on any byte stream (the QEMU virtio-serial Unix
//! socket, or a Firecracker vsock socket after `CONNECT`), then runs two background tasks: a reader that
//! dispatches frames by stream id and a writer. The client is `Clone` (an `Arc` inside); the tasks stop when
//! the last clone and the last handle derived from it are dropped.
//!
//! Operations (each opens its own stream):
//! - [`AgentClient::ping`]
//! - [`AgentClient::exec`] -> [`ExecHandle`] (events: [`ExecEvent`]; stdin: [`StdinWriter`]);
//!   [`AgentClient::spawn_background`], [`AgentClient::list_processes`], [`AgentClient::wait_process`],
//!   [`AgentClient::wait_process_timeout`], [`AgentClient::kill_process`], [`AgentClient::write_stdin`]
//! - [`AgentClient::read_file`] -> ([`FileInfo`], [`FileReader`]), [`AgentClient::write_file`],
//!   [`AgentClient::stat`], [`AgentClient::list_dir`], [`AgentClient::mkdir`], [`AgentClient::remove`],
//!   [`AgentClient::rename`]
//! - [`AgentClient::watch_dir`] -> [`DirWatcher`] (batches of [`crate::watch::WatchEvent`]; dropping it stops
//!   the watch)
//! - [`AgentClient::pty`] -> [`PtyHandle`] (events: [`PtyEvent`]; input, resize, signal: [`PtyInput`])
//! - Snapshots (protocol version 2): [`AgentClient::sync`] before pausing or checkpointing a VM (flushes
//!   every guest file system; returns once done); [`AgentClient::post_restore`] right after a resume or fork
//!   and before any user command (sets the wall clock, mixes and credits 64 bytes of host entropy and
//!   reseeds the CRNG, optionally sets hostname and machine-id; malformed values are refused with
//!   `ClientError::Guest { kind: ErrorKind::InvalidRequest, .. }` before anything changes, see
//!   [`PostRestore::validate`]). Both can take a moment in a slow guest: give them a timeout.
//! - Dropping an [`ExecHandle`] before `Exited` sends `Abandon`: the agent stops the foreground process
//!   (SIGHUP + SIGTERM to its process group, SIGKILL after a short grace). Losing the connection instead
//!   leaves it running and waitable by pid.
//!
//! Everything from the guest is treated as hostile: frames are bounded by the decoder, frames for unknown
//! streams are ignored, a guest exceeding its credit, sending malformed headers or flooding a stream with
//! messages closes the connection with [`ClientError::Protocol`]; lists and tails are capped.

mod ops;
mod pty;
mod stream;
mod watch;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::task::AbortHandle;

pub use ops::{ExecEvent, ExecHandle, FileReader, ProcExit, StdinWriter};
pub use pty::{PtyEvent, PtyHandle, PtyInput};
pub use stream::StreamRx;
pub use watch::DirWatcher;

use crate::frame::{FrameError, encode};
use crate::io::{CreditWindow, FrameReader, Outbox, RecvWindow, write_loop};
use crate::msg::{
    ErrorKind, FileInfo, GuestMsg, Header, HostMsg, PostRestore, PostRestoreOutcome, PostRestoreReport,
};
use crate::{CONTROL_STREAM, PROTOCOL_VERSION};

/// How often `connect` repeats its `Hello` until answered.
const HELLO_RESEND: Duration = Duration::from_millis(500);

/// Most messages queued on one stream that its consumer has not taken yet: every data frame the window
/// allows (see [`crate::data_cost`]) plus room for the other replies.
const MAX_PENDING_MSGS: usize = (crate::WINDOW / crate::MIN_DATA_COST) as usize + 4096;
/// Most header bytes queued on one stream (batches of list entries are not flow-controlled).
const MAX_PENDING_HEADER_BYTES: usize = 16 << 20;
/// Streams (commands, terminals, file transfers, watches, requests) open at once on one connection, i.e. in
/// one sandbox. Each may hold up to [`crate::WINDOW`] of guest data the caller has not read yet, so this bounds
/// what one sandbox's callers can make the host hold (256 MiB), and the descriptors and tasks behind them.
pub const MAX_OPEN_STREAMS: usize = 256;

/// Errors of the host side of the agent channel.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection to the agent is gone.
    #[error("agent connection closed")]
    Closed,
    /// The handshake did not complete in time.
    #[error("agent did not answer in time")]
    Timeout,
    /// The guest broke the protocol; the connection was closed.
    #[error("agent protocol error: {0}")]
    Protocol(String),
    /// The agent speaks another protocol version.
    #[error("agent speaks protocol version {agent}, host speaks {host}")]
    VersionMismatch { host: u32, agent: u32 },
    /// The agent refused or failed the request.
    #[error("{kind}: {message}")]
    Guest { kind: ErrorKind, message: String },
    /// The request does not fit in a frame (e.g. an argv or env larger than 64 KiB of JSON).
    #[error("request too large: {0}")]
    RequestTooLarge(String),
    /// The stream ended before the data could be sent (e.g. the process exited, or its stdin is closed).
    #[error("stream ended")]
    StreamEnded,
    /// The body stream given to `write_file` failed.
    #[error("request body: {0}")]
    Body(String),
    /// [`MAX_OPEN_STREAMS`] streams are already open on this connection.
    #[error(
        "{0} commands, terminals, transfers and watches are already open in this sandbox; close some first"
    )]
    TooManyStreams(usize),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ClientError {
    /// The guest's error kind, if this is a guest-reported error.
    pub fn guest_kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Guest { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// Host handle on one agent connection. Cheap to clone.
#[derive(Clone)]
pub struct AgentClient {
    shared: Arc<Shared>,
    _tasks: Arc<Tasks>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("agent_version", &self.shared.agent_version)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// Aborts the reader and writer when the last client clone goes away.
struct Tasks {
    reader: AbortHandle,
    writer: AbortHandle,
}

impl Drop for Tasks {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

/// Where the reader task delivers a stream's messages.
pub(crate) struct Route {
    pub(crate) tx: tokio::sync::mpsc::UnboundedSender<Delivery>,
    pub(crate) recv: Arc<RecvWindow>,
    pub(crate) send: Arc<CreditWindow>,
    pub(crate) pending: Arc<Pending>,
}

/// A message delivered to a stream's consumer, with the size of its header (for [`Pending`]).
pub(crate) struct Delivery {
    pub(crate) msg: GuestMsg,
    pub(crate) data: Bytes,
    pub(crate) header_len: usize,
}

/// What a stream's consumer has not taken yet: bounded in count and header bytes, so a guest cannot make
/// the host queue without limit.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    state: Mutex<(usize, usize)>,
}

impl Pending {
    fn push(&self, header_len: usize) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.0 >= MAX_PENDING_MSGS || st.1 + header_len > MAX_PENDING_HEADER_BYTES {
            return Err(format!(
                "more than {MAX_PENDING_MSGS} unconsumed messages or 16 MiB of headers"
            ));
        }
        st.0 += 1;
        st.1 += header_len;
        Ok(())
    }

    pub(crate) fn pop(&self, header_len: usize) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.0 = st.0.saturating_sub(1);
        st.1 = st.1.saturating_sub(header_len);
    }
}

pub(crate) struct Shared {
    pub(crate) out: Outbox,
    routes: Mutex<HashMap<u32, Route>>,
    next_stream: AtomicU32,
    closed: AtomicBool,
    close_reason: Mutex<Option<String>>,
    writer: Mutex<Option<AbortHandle>>,
    agent_version: String,
}

impl Shared {
    fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Route>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Close the connection: fail every open stream, stop the writer.
    fn close(&self, reason: Option<String>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        *self.close_reason.lock().unwrap_or_else(|p| p.into_inner()) = reason;
        let routes: Vec<Route> = self.routes().drain().map(|(_, r)| r).collect();
        for r in routes {
            r.send.close();
        }
        if let Some(w) = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take() {
            w.abort();
        }
    }

    /// The error an operation reports once the connection is closed.
    pub(crate) fn closed_error(&self) -> ClientError {
        match self
            .close_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            Some(reason) => ClientError::Protocol(reason),
            None => ClientError::Closed,
        }
    }

    pub(crate) fn remove_route(&self, id: u32) {
        if let Some(r) = self.routes().remove(&id) {
            r.send.close();
        }
    }
}

fn new_nonce() -> u64 {
    // Unique per connection attempt; not a secret (it only tells our HelloOk from a stale one).
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
}

impl AgentClient {
    /// Say `Hello` on `stream` and wait (at most `timeout`) for the matching `HelloOk`.
    pub async fn connect<S>(stream: S, timeout: Duration) -> Result<Self, ClientError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        Ok(Self::handshake(stream, timeout, None).await?.0)
    }

    /// [`AgentClient::connect`] right after a restore, with the [`AgentClient::post_restore`] in the first
    /// `Hello` (one round trip for both; repeats of the `Hello` do not carry it). `make` builds the request
    /// as it is sent. The outcome is `None` when the agent did not do it (it predates this, or it missed that
    /// first `Hello`): send [`AgentClient::post_restore`] then.
    pub async fn connect_after_restore<S>(
        stream: S,
        timeout: Duration,
        make: &(dyn Fn() -> PostRestore + Send + Sync),
    ) -> Result<(Self, Option<Result<PostRestoreReport, ClientError>>), ClientError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (client, outcome) = Self::handshake(stream, timeout, Some(make)).await?;
        let outcome = outcome.map(|o| match o {
            PostRestoreOutcome::Done(report) => Ok(report),
            PostRestoreOutcome::Failed { kind, message } => Err(guest_error(kind, message)),
        });
        Ok((client, outcome))
    }

    async fn handshake<S>(
        stream: S,
        timeout: Duration,
        post_restore: Option<&(dyn Fn() -> PostRestore + Send + Sync)>,
    ) -> Result<(Self, Option<PostRestoreOutcome>), ClientError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (rd, mut wr) = tokio::io::split(stream);
        let mut reader = FrameReader::new(rd);
        let nonce = new_nonce();
        let (agent_version, outcome) = tokio::time::timeout(timeout, async {
            // Only the first Hello carries the post-restore setup: the agent runs it before answering, which
            // takes a moment in a restored guest, and repeats would queue more of it before any request.
            let mut first = true;
            let mut hello = || {
                let hello = HostMsg::Hello {
                    version: PROTOCOL_VERSION,
                    nonce,
                    post_restore: post_restore.filter(|_| first).map(|make| make()),
                };
                first = false;
                encode(CONTROL_STREAM, &hello, Bytes::new())
                    .map(|f| f.to_vec())
                    .map_err(|e| ClientError::Protocol(e.to_string()))
            };
            // Say Hello again now and then: a guest that opens its end of the channel late may have missed
            // it (a virtio port drops what arrives before the agent opens it). The agent answers every Hello
            // before any request sent after it, so repeats are harmless.
            let mut resend = tokio::time::interval(HELLO_RESEND);
            let reply = handshake_reply(&mut reader, nonce);
            tokio::pin!(reply);
            loop {
                tokio::select! {
                    r = &mut reply => return r,
                    _ = resend.tick() => {
                        wr.write_all(&hello()?).await?;
                        wr.flush().await?;
                    }
                }
            }
        })
        .await
        .map_err(|_| ClientError::Timeout)??;

        let (out, out_rx) = Outbox::new();
        let shared = Arc::new(Shared {
            out,
            routes: Mutex::new(HashMap::new()),
            next_stream: AtomicU32::new(1),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            writer: Mutex::new(None),
            agent_version,
        });
        let s = shared.clone();
        let writer = tokio::spawn(async move {
            // A write error means the transport is gone: the same as a clean close for the callers.
            let _ = write_loop(wr, out_rx).await;
            s.close(None);
        });
        *shared.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(writer.abort_handle());
        let s = shared.clone();
        let reader = tokio::spawn(async move { read_loop(reader, s).await });
        let tasks = Arc::new(Tasks {
            reader: reader.abort_handle(),
            writer: writer.abort_handle(),
        });
        Ok((
            AgentClient {
                shared,
                _tasks: tasks,
            },
            outcome,
        ))
    }

    /// The agent's self-reported version string (untrusted, for display).
    pub fn agent_version(&self) -> &str {
        &self.shared.agent_version
    }

    /// True once the connection is lost (reconnect with a new stream and [`AgentClient::connect`]).
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::SeqCst)
    }

    /// Why the connection was closed, when it was closed for a protocol violation.
    pub fn close_reason(&self) -> Option<String> {
        self.shared
            .close_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Close the connection now; open streams fail with [`ClientError::Closed`].
    pub fn close(&self) {
        self.shared.close(None);
    }

    /// Open a stream with a request; `data` is the request frame's data section.
    pub(crate) fn open(&self, msg: &HostMsg, data: Bytes) -> Result<StreamRx, ClientError> {
        if self.is_closed() {
            return Err(self.shared.closed_error());
        }
        let id = self.shared.next_stream.fetch_add(2, Ordering::SeqCst);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let route = Route {
            tx,
            recv: Arc::new(RecvWindow::new()),
            send: Arc::new(CreditWindow::new()),
            pending: Arc::new(Pending::default()),
        };
        let rx = StreamRx::new(self.clone(), id, rx, &route);
        {
            let mut routes = self.shared.routes();
            if routes.len() >= MAX_OPEN_STREAMS {
                drop(routes);
                // Never announced to the agent: nothing to abandon.
                rx.finish();
                return Err(ClientError::TooManyStreams(MAX_OPEN_STREAMS));
            }
            routes.insert(id, route);
        }
        if let Err(e) = self.shared.out.send(id, msg, data) {
            rx.finish();
            return Err(match e {
                crate::io::SendError::Closed(_) => self.shared.closed_error(),
                crate::io::SendError::Encode(e) => ClientError::RequestTooLarge(e.to_string()),
            });
        }
        Ok(rx)
    }
}

/// The agent's version and, for a `Hello` with a `post_restore`, its outcome (`None` from an older agent).
async fn handshake_reply<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    nonce: u64,
) -> Result<(String, Option<PostRestoreOutcome>), ClientError> {
    loop {
        let frame = match reader.next().await? {
            None => return Err(ClientError::Closed),
            // Leftovers of an earlier session on a reused channel: skip them.
            Some(Err(_)) => continue,
            Some(Ok(f)) => f,
        };
        let Ok(Header { stream, msg }) = frame.parse::<GuestMsg>() else {
            continue;
        };
        if stream != CONTROL_STREAM {
            continue;
        }
        match msg {
            GuestMsg::HelloOk {
                version,
                agent_version,
                nonce: n,
                post_restore,
            } if n == nonce => {
                if version != PROTOCOL_VERSION {
                    return Err(ClientError::VersionMismatch {
                        host: PROTOCOL_VERSION,
                        agent: version,
                    });
                }
                let mut v = agent_version;
                v.truncate(v.floor_char_boundary(128));
                return Ok((v, post_restore));
            }
            GuestMsg::Error {
                kind: ErrorKind::VersionMismatch,
                message,
            } => {
                let agent = parse_agent_version(&message).unwrap_or(0);
                return Err(ClientError::VersionMismatch {
                    host: PROTOCOL_VERSION,
                    agent,
                });
            }
            _ => continue,
        }
    }
}

/// The agent's version-mismatch message ends with `agent speaks N`.
fn parse_agent_version(message: &str) -> Option<u32> {
    message.rsplit(' ').next()?.parse().ok()
}

async fn read_loop<R: AsyncRead + Unpin>(mut reader: FrameReader<R>, shared: Arc<Shared>) {
    let reason = loop {
        let frame = match reader.next().await {
            Err(_) | Ok(None) => break None,
            Ok(Some(Err(FrameError::Garbage(_)))) => continue,
            Ok(Some(Err(e))) => break Some(e.to_string()),
            Ok(Some(Ok(f))) => f,
        };
        let Header { stream, msg } = match frame.parse::<GuestMsg>() {
            Ok(h) => h,
            Err(e) => break Some(format!("malformed frame header: {e}")),
        };
        if let Err(reason) = dispatch(&shared, stream, msg, frame.data, frame.header.len()) {
            break Some(reason);
        }
    };
    shared.close(reason);
}

/// Route one guest message; an `Err` is a protocol violation that closes the connection.
fn dispatch(
    shared: &Shared,
    stream: u32,
    msg: GuestMsg,
    data: Bytes,
    header_len: usize,
) -> Result<(), String> {
    if !data.is_empty() && !msg.carries_data() {
        return Err(format!(
            "stream {stream}: data attached to a message that carries none"
        ));
    }
    let mut routes = shared.routes();
    let Some(route) = routes.get(&stream) else {
        // Unknown or finished stream (abandoned requests, stale sessions): ignore.
        return Ok(());
    };
    if let GuestMsg::Credit { bytes } = msg {
        route.send.grant(bytes);
        return Ok(());
    }
    if msg.carries_data() {
        route
            .recv
            .on_receive(crate::data_cost(data.len()))
            .map_err(|e| format!("stream {stream}: {e}"))?;
    }
    route
        .pending
        .push(header_len)
        .map_err(|e| format!("stream {stream}: {e}"))?;
    let terminal = msg.is_terminal();
    let delivered = route
        .tx
        .send(Delivery {
            msg,
            data,
            header_len,
        })
        .is_ok();
    if (terminal || !delivered)
        && let Some(r) = routes.remove(&stream)
    {
        r.send.close();
    }
    Ok(())
}

impl AgentClient {
    /// Round trip to the agent.
    pub async fn ping(&self) -> Result<(), ClientError> {
        match self.call(&HostMsg::Ping, Bytes::new()).await? {
            GuestMsg::Pong => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Flush every file system of the guest (`sync(2)`, then `syncfs` on each mount); returns once the data
    /// is on the (virtual) disks, so a snapshot taken now loses nothing written before the call.
    pub async fn sync(&self) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::Sync).await
    }

    /// Right after a resume or fork, before any user command: set the guest's wall clock, mix in and credit
    /// the host's entropy (exactly [`crate::POST_RESTORE_ENTROPY_LEN`] bytes) and reseed the CRNG, and set
    /// the hostname / machine-id when given. Malformed values ([`PostRestore::validate`]) are refused with
    /// `ClientError::Guest { kind: ErrorKind::InvalidRequest, .. }` and nothing is changed.
    pub async fn post_restore(&self, req: PostRestore) -> Result<PostRestoreReport, ClientError> {
        match self.call(&HostMsg::PostRestore(req), Bytes::new()).await? {
            GuestMsg::PostRestored(report) => Ok(report),
            other => Err(unexpected(&other)),
        }
    }

    /// Mount the host's NFS export at `req.path` in the guest. An agent that predates mounts answers
    /// `ClientError::Guest { kind: ErrorKind::InvalidRequest, .. }`.
    pub async fn mount(&self, req: crate::MountRequest) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::Mount(req)).await
    }

    /// Unmount whatever is mounted at `path` in the guest (lazily when busy).
    pub async fn unmount(&self, path: &str) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::Unmount {
            path: path.to_owned(),
        })
        .await
    }

    /// Metadata of `path` (a final symlink is not followed).
    pub async fn stat(&self, path: &str) -> Result<FileInfo, ClientError> {
        match self
            .call(
                &HostMsg::Stat {
                    path: path.to_owned(),
                },
                Bytes::new(),
            )
            .await?
        {
            GuestMsg::Stat { info } => Ok(info),
            other => Err(unexpected(&other)),
        }
    }

    /// Create a directory (and its missing parents with `parents`).
    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::Mkdir {
            path: path.to_owned(),
            parents,
        })
        .await
    }

    /// Remove a file, symlink or directory (non-empty ones only with `recursive`).
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::Remove {
            path: path.to_owned(),
            recursive,
        })
        .await
    }

    /// Rename `from` to `to`.
    pub async fn rename(&self, from: &str, to: &str) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
        })
        .await
    }

    /// Send `signal` to the process group of `pid`.
    pub async fn kill_process(&self, pid: u32, signal: i32) -> Result<(), ClientError> {
        self.call_ok(&HostMsg::KillProc { pid, signal }).await
    }

    /// A request answered by one terminal message; guest errors become [`ClientError::Guest`].
    pub(crate) async fn call(&self, msg: &HostMsg, data: Bytes) -> Result<GuestMsg, ClientError> {
        let mut rx = self.open(msg, data)?;
        let (msg, _) = rx.recv().await?;
        rx.finish();
        into_result(msg)
    }

    async fn call_ok(&self, msg: &HostMsg) -> Result<(), ClientError> {
        match self.call(msg, Bytes::new()).await? {
            GuestMsg::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }
}

/// Turn a guest `Error` into [`ClientError::Guest`].
pub(crate) fn into_result(msg: GuestMsg) -> Result<GuestMsg, ClientError> {
    match msg {
        GuestMsg::Error { kind, message } => Err(guest_error(kind, message)),
        other => Ok(other),
    }
}

/// [`ClientError::Guest`] with the guest's message cut to 4 KiB.
fn guest_error(kind: ErrorKind, mut message: String) -> ClientError {
    message.truncate(message.floor_char_boundary(4096));
    ClientError::Guest { kind, message }
}

/// A well-formed message that makes no sense at this point of the stream.
pub(crate) fn unexpected(msg: &GuestMsg) -> ClientError {
    let mut s = format!("{msg:?}");
    s.truncate(s.floor_char_boundary(200));
    ClientError::Protocol(format!("unexpected message {s}"))
}
