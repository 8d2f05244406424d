//! One connection (session) of the agent channel: the frame loop, the per-connection stream table, and the
//! process request handlers. File handlers are in [`crate::files`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use hearth_proto::io::{CreditWindow, FrameReader, Outbox, RecvWindow, WindowClosed, write_loop};
use hearth_proto::{
    CONTROL_STREAM, DATA_CHUNK, ErrorKind, ExecRequest, GuestMsg, Header, HostMsg, PROTOCOL_VERSION,
    PostRestoreOutcome,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::procs::Sink;
use crate::{Agent, AgentError, fail, log};

/// How long an abandoned foreground process has between SIGTERM and SIGKILL.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(2);

/// Largest JSON batch of list entries, well under the 64 KiB header limit.
pub(crate) const BATCH_BYTES: usize = 32 * 1024;

/// Data the host sends on a stream after its request.
pub(crate) enum Inbound {
    Data(Bytes),
    End,
    /// A control message for the running request (`PtyResize`, `PtySignal`).
    Control(HostMsg),
}

struct StreamEntry {
    window: Arc<CreditWindow>,
    recv: Arc<RecvWindow>,
    inbound: mpsc::UnboundedSender<Inbound>,
    task: Option<AbortHandle>,
    /// The foreground process whose output goes to this stream.
    pid: Option<u32>,
}

/// The streams open on one connection.
#[derive(Default)]
pub struct Streams {
    map: Mutex<HashMap<u32, StreamEntry>>,
    /// The connection's number ([`Sessions::open`]).
    conn: u64,
}

/// The agent's connections and the restores that outdate them.
///
/// After a restore (`PostRestore`), every other connection belongs to the host of before the snapshot, which
/// is gone. Over serial there is one connection at a time, and the port's reopening ends the old session. Over
/// vsock the restored guest may never learn that its old connections died (Firecracker 1.12 leaves the vsock
/// transport reset of the snapshot pending, and a restored guest does not always act on it), and a session
/// kept open that way keeps its terminals and streams running. So the other connections are closed as if their
/// host had disconnected.
pub(crate) struct Sessions {
    next: std::sync::atomic::AtomicU64,
    /// The connection that last completed a `PostRestore` (0: none yet).
    restored_by: tokio::sync::watch::Sender<u64>,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            next: std::sync::atomic::AtomicU64::new(0),
            restored_by: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Sessions {
    /// A number for a new connection, and the notifications of later restores.
    fn open(&self) -> (u64, tokio::sync::watch::Receiver<u64>) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        (id, self.restored_by.subscribe())
    }

    /// Connection `conn` completed a `PostRestore`: every older one is from before the snapshot (connection
    /// numbers only grow, and a snapshot keeps the counter). An older connection completing one later (a
    /// handshake the host gave up on, answered late) changes nothing: the newest stays.
    pub(crate) fn restored(&self, conn: u64) {
        self.restored_by.send_if_modified(|newest| {
            let newer = conn > *newest;
            if newer {
                *newest = conn;
            }
            newer
        });
    }

    /// Whether a newer connection than `conn` completed a `PostRestore`.
    fn superseded(&self, conn: u64) -> bool {
        *self.restored_by.borrow() > conn
    }
}

impl Streams {
    fn on(conn: u64) -> Self {
        Streams {
            map: Mutex::default(),
            conn,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u32, StreamEntry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forget a finished stream (its task, if any, is ending by itself).
    pub fn remove(&self, id: u32) {
        if let Some(e) = self.lock().remove(&id) {
            e.window.close();
        }
    }

    /// The host no longer wants this stream: stop its task and detach its process; with `stop`, also stop
    /// that process (an explicit `Abandon`; a lost connection does not stop anything).
    fn abandon(&self, id: u32, agent: &Agent, stop: bool) {
        let entry = self.lock().remove(&id);
        if let Some(e) = entry {
            e.window.close();
            if let Some(t) = e.task {
                t.abort();
            }
            if let Some(pid) = e.pid
                && let Ok(p) = agent.procs.get(pid)
            {
                p.detach(id);
                if stop {
                    p.stop_with_grace(STOP_GRACE);
                }
            }
        }
    }

    fn abandon_all(&self, agent: &Agent) {
        let ids: Vec<u32> = self.lock().keys().copied().collect();
        for id in ids {
            self.abandon(id, agent, false);
        }
    }
}

/// What a request handler works with.
pub(crate) struct Ctx {
    pub agent: Agent,
    pub out: Outbox,
    pub streams: Arc<Streams>,
    pub stream: u32,
    pub window: Arc<CreditWindow>,
    pub recv: Arc<RecvWindow>,
}

impl Ctx {
    /// Send a non-data message on this stream.
    pub fn reply(&self, msg: GuestMsg) {
        // A failure means the connection is gone; nothing to tell anyone.
        let _ = self.out.send(self.stream, &msg, Bytes::new());
    }

    /// Send `data` as `msg` data frames, waiting for the host's credit before each chunk.
    pub async fn send_data(&self, msg: &GuestMsg, mut data: Bytes) -> Result<(), WindowClosed> {
        while !data.is_empty() {
            let chunk = data.split_to(data.len().min(DATA_CHUNK));
            self.window.acquire(hearth_proto::data_cost(chunk.len())).await?;
            self.out.send(self.stream, msg, chunk).map_err(|_| WindowClosed)?;
        }
        Ok(())
    }

    /// A data frame of `len` bytes from the host was consumed: return its credit.
    pub fn credit(&self, len: usize) {
        let cost = hearth_proto::data_cost(len);
        self.recv.on_consume(cost);
        self.reply(GuestMsg::Credit { bytes: cost });
    }

    /// Send `items` in batches whose JSON stays under [`BATCH_BYTES`], then `Ok`.
    pub fn reply_batches<T: serde::Serialize>(&self, items: Vec<T>, wrap: impl Fn(Vec<T>) -> GuestMsg) {
        let mut batch = Vec::new();
        let mut size = 0;
        for item in items {
            let n = serde_json::to_vec(&item).map_or(0, |v| v.len());
            if !batch.is_empty() && size + n > BATCH_BYTES {
                self.reply(wrap(std::mem::take(&mut batch)));
                size = 0;
            }
            size += n;
            batch.push(item);
        }
        if !batch.is_empty() {
            self.reply(wrap(batch));
        }
        self.reply(GuestMsg::Ok);
    }
}

/// Whether a handler's stream is over when it returns.
pub(crate) enum After {
    Done,
    /// Something else (the process supervisor) ends the stream.
    KeepOpen,
}

/// Serve one connection until the peer disconnects.
pub async fn serve_conn<S>(agent: Agent, stream: S) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    let (out, out_rx) = Outbox::new();
    let writer = tokio::spawn(write_loop(wr, out_rx));
    let mut reader = FrameReader::new(rd);
    let (conn, mut restores) = agent.sessions.open();
    let mut streams = Arc::new(Streams::on(conn));
    let mut hello = false;
    let result = loop {
        // `FrameReader::next` is cancel-safe (what it read stays in its buffer).
        let next = tokio::select! {
            next = reader.next() => next,
            Ok(()) = restores.changed() => {
                if *restores.borrow_and_update() > conn {
                    log("closing a connection from before a restore");
                    break Ok(());
                }
                continue;
            }
        };
        let frame = match next {
            Ok(Some(Ok(f))) => f,
            // Garbage or an oversize frame (e.g. left over from an earlier session): resynchronise.
            Ok(Some(Err(_))) => continue,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let Ok(Header { stream, msg }) = frame.parse::<HostMsg>() else {
            // A request this agent does not know (a newer host) or a malformed one: answer it, so the
            // host does not wait forever.
            if hello
                && let Ok(Header { stream, .. }) = frame.parse::<serde::de::IgnoredAny>()
                && stream != CONTROL_STREAM
                && stream % 2 == 1
                && !streams.lock().contains_key(&stream)
            {
                let msg = GuestMsg::error(ErrorKind::InvalidRequest, "unknown or malformed request");
                let _ = out.send(stream, &msg, Bytes::new());
            }
            continue;
        };
        if let HostMsg::Hello {
            version,
            nonce,
            post_restore,
        } = msg
        {
            if version != PROTOCOL_VERSION {
                let message = format!("host speaks {version}, agent speaks {PROTOCOL_VERSION}");
                let _ = out.send(
                    CONTROL_STREAM,
                    &GuestMsg::error(ErrorKind::VersionMismatch, message),
                    Bytes::new(),
                );
                continue;
            }
            // A new session on the same channel: forget the old streams, keep the processes.
            streams.abandon_all(&agent);
            streams = Arc::new(Streams::on(conn));
            hello = true;
            // Right after a restore the host puts its PostRestore here: done before the answer, like the
            // request (and, like it, it makes this the connection that survives the restore). A handshake of
            // a connection a newer one has superseded is stale: the host gave up on it.
            if post_restore.is_some() && agent.sessions.superseded(conn) {
                log("closing a connection from before a restore");
                break Ok(());
            }
            let post_restore = match post_restore {
                Some(req) => Some(match crate::restore::post_restore(&agent.sys, req).await {
                    Ok(report) => {
                        agent.sessions.restored(conn);
                        PostRestoreOutcome::Done(report)
                    }
                    Err(e) => PostRestoreOutcome::Failed {
                        kind: e.kind,
                        message: e.message,
                    },
                }),
                None => None,
            };
            let ok = GuestMsg::HelloOk {
                version: PROTOCOL_VERSION,
                agent_version: env!("CARGO_PKG_VERSION").to_owned(),
                nonce,
                post_restore,
            };
            let _ = out.send(CONTROL_STREAM, &ok, Bytes::new());
            continue;
        }
        if !hello || stream == CONTROL_STREAM {
            continue;
        }
        if let Err(e) = route(&agent, &out, &streams, stream, msg, frame.data) {
            log(&format!("closing the connection: {e}"));
            break Ok(());
        }
    };
    streams.abandon_all(&agent);
    writer.abort();
    result
}

/// Handle one message of an established session; an `Err` closes the connection.
fn route(
    agent: &Agent,
    out: &Outbox,
    streams: &Arc<Streams>,
    stream: u32,
    msg: HostMsg,
    data: Bytes,
) -> Result<(), String> {
    match msg {
        HostMsg::Credit { bytes } => {
            if let Some(e) = streams.lock().get(&stream) {
                e.window.grant(bytes);
            }
        }
        HostMsg::Stdin | HostMsg::FileData | HostMsg::StdinEof | HostMsg::FileEnd => {
            let map = streams.lock();
            let Some(e) = map.get(&stream) else { return Ok(()) };
            let item = if msg.carries_data() {
                e.recv
                    .on_receive(hearth_proto::data_cost(data.len()))
                    .map_err(|err| format!("stream {stream}: {err}"))?;
                Inbound::Data(data)
            } else {
                Inbound::End
            };
            let _ = e.inbound.send(item);
        }
        HostMsg::PtyResize { .. } | HostMsg::PtySignal { .. } => {
            if let Some(e) = streams.lock().get(&stream) {
                let _ = e.inbound.send(Inbound::Control(msg));
            }
        }
        HostMsg::Abandon => streams.abandon(stream, agent, true),
        HostMsg::Hello { .. } => {}
        request => {
            if streams.lock().contains_key(&stream) {
                return Ok(());
            }
            start_request(agent, out, streams, stream, request, data);
        }
    }
    Ok(())
}

fn start_request(
    agent: &Agent,
    out: &Outbox,
    streams: &Arc<Streams>,
    stream: u32,
    req: HostMsg,
    data: Bytes,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let ctx = Ctx {
        agent: agent.clone(),
        out: out.clone(),
        streams: streams.clone(),
        stream,
        window: Arc::new(CreditWindow::new()),
        recv: Arc::new(RecvWindow::new()),
    };
    let entry = StreamEntry {
        window: ctx.window.clone(),
        recv: ctx.recv.clone(),
        inbound: tx,
        task: None,
        pid: None,
    };
    streams.lock().insert(stream, entry);
    let task = tokio::spawn(async move {
        match handle(&ctx, req, data, rx).await {
            Ok(After::Done) => ctx.streams.remove(ctx.stream),
            Ok(After::KeepOpen) => {}
            Err(e) => {
                ctx.reply(GuestMsg::Error {
                    kind: e.kind,
                    message: e.message,
                });
                ctx.streams.remove(ctx.stream);
            }
        }
    });
    if let Some(e) = streams.lock().get_mut(&stream) {
        e.task = Some(task.abort_handle());
    }
}

async fn handle(
    ctx: &Ctx,
    req: HostMsg,
    data: Bytes,
    inbound: mpsc::UnboundedReceiver<Inbound>,
) -> Result<After, AgentError> {
    let procs = &ctx.agent.procs;
    match req {
        HostMsg::Ping => ctx.reply(GuestMsg::Pong),
        HostMsg::Exec(req) => return exec(ctx, req, inbound).await,
        HostMsg::Pty(req) => return crate::pty::run(ctx, req, inbound).await,
        HostMsg::ListProcs => ctx.reply_batches(procs.list(), |procs| GuestMsg::Procs { procs }),
        HostMsg::WaitProc { pid, timeout_ms } => wait(ctx, pid, timeout_ms).await?,
        HostMsg::KillProc { pid, signal } => {
            if !(0..=64).contains(&signal) {
                return Err(fail(
                    ErrorKind::InvalidRequest,
                    format!("invalid signal {signal}"),
                ));
            }
            procs.get(pid)?.kill(signal)?;
            ctx.reply(GuestMsg::Ok);
        }
        HostMsg::Sync => {
            crate::restore::sync_all().await?;
            ctx.reply(GuestMsg::Ok);
        }
        HostMsg::PostRestore(req) => {
            let report = crate::restore::post_restore(&ctx.agent.sys, req).await?;
            ctx.agent.sessions.restored(ctx.streams.conn);
            ctx.reply(GuestMsg::PostRestored(report));
        }
        HostMsg::ProcStdin { pid, eof } => {
            let p = procs.get(pid)?;
            if !data.is_empty() {
                p.write_stdin(&data).await?;
            }
            if eof {
                p.close_stdin().await;
            }
            ctx.reply(GuestMsg::Ok);
        }
        HostMsg::WatchDir(req) => return crate::watch::run(ctx, req).await,
        HostMsg::Mount(req) => {
            crate::mounts::mount_nfs(req).await?;
            ctx.reply(GuestMsg::Ok);
        }
        HostMsg::Unmount { path } => {
            crate::mounts::unmount(path).await?;
            ctx.reply(GuestMsg::Ok);
        }
        other => return crate::files::handle(ctx, other, inbound).await,
    }
    Ok(After::Done)
}

async fn exec(
    ctx: &Ctx,
    req: ExecRequest,
    mut inbound: mpsc::UnboundedReceiver<Inbound>,
) -> Result<After, AgentError> {
    let procs = &ctx.agent.procs;
    if req.background {
        let p = procs.spawn(req, None)?;
        ctx.reply(GuestMsg::Started { pid: p.pid });
        return Ok(After::Done);
    }
    let wants_stdin = req.stdin;
    let sink = Sink {
        stream: ctx.stream,
        out: ctx.out.clone(),
        window: ctx.window.clone(),
        streams: ctx.streams.clone(),
    };
    let p = procs.spawn(req, Some(sink))?;
    match ctx.streams.lock().get_mut(&ctx.stream) {
        Some(e) => e.pid = Some(p.pid),
        // Abandoned while it was starting.
        None => {
            p.detach(ctx.stream);
            p.stop_with_grace(STOP_GRACE);
        }
    }
    // Feed stdin until the host says EOF (or the stream ends); output and exit are the supervisor's job.
    let mut stdin_ok = wants_stdin;
    while let Some(item) = inbound.recv().await {
        match item {
            Inbound::Data(d) => {
                if stdin_ok && p.write_stdin(&d).await.is_err() {
                    // The process closed its stdin: discard the rest, but keep returning credit.
                    stdin_ok = false;
                }
                ctx.credit(d.len());
            }
            Inbound::End => {
                p.close_stdin().await;
                break;
            }
            Inbound::Control(_) => {}
        }
    }
    Ok(After::KeepOpen)
}

async fn wait(ctx: &Ctx, pid: u32, timeout_ms: Option<u64>) -> Result<(), AgentError> {
    let p = ctx.agent.procs.get(pid)?;
    let status = match timeout_ms {
        None => p.wait().await,
        Some(ms) => match tokio::time::timeout(Duration::from_millis(ms), p.wait()).await {
            Ok(st) => st,
            Err(_) => {
                ctx.reply(GuestMsg::StillRunning);
                return Ok(());
            }
        },
    };
    let (out, err) = p.tails();
    if ctx.send_data(&GuestMsg::Stdout, out).await.is_err()
        || ctx.send_data(&GuestMsg::Stderr, err).await.is_err()
    {
        return Ok(());
    }
    ctx.reply(GuestMsg::Exited(status));
    Ok(())
}
