//! The process table: spawning, output pumps with flow control, timeouts, exit statuses and output tails.
//!
//! Every process (foreground or background) is owned by a supervisor task that does not depend on any
//! connection. A foreground process has a [`Sink`]: the stream its output and exit go to. When that stream
//! is abandoned or its connection lost, the sink is dropped, output is only kept in the tails, and the
//! process stays in the table so it can still be waited for after a reconnect.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hearth_proto::io::{CreditWindow, Outbox};
use hearth_proto::{Command, ErrorKind, ExecRequest, ExitStatus, GuestMsg, ProcInfo, TAIL_MAX};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;

use crate::conn::Streams;
use crate::reaper::{self, RawExit};
use crate::{AgentError, fail};

/// Base `PATH` of every process.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// After the main process exited, a pipe read that waits longer than this ends the output (a grandchild
/// may hold the pipe open forever).
const DRAIN_GRACE: Duration = Duration::from_millis(250);
/// Finished processes kept for `wait` before the oldest are forgotten.
const MAX_FINISHED: usize = 256;
/// Longest command string kept in the table.
const MAX_CMD_LEN: usize = 1024;
/// Pipe read size.
const READ_CHUNK: usize = 64 * 1024;

/// Where a foreground process' output goes.
#[derive(Clone)]
pub struct Sink {
    pub stream: u32,
    pub out: Outbox,
    pub window: Arc<CreditWindow>,
    /// The connection's stream table, to forget the stream once `Exited` is sent.
    pub streams: Arc<Streams>,
}

/// Last bytes of one output stream.
#[derive(Default)]
struct Tail(VecDeque<u8>);

impl Tail {
    fn push(&mut self, data: &[u8]) {
        self.0.extend(data);
        if self.0.len() > TAIL_MAX {
            let cut = self.0.len() - TAIL_MAX;
            self.0.drain(..cut);
        }
    }

    fn snapshot(&self) -> Bytes {
        let (a, b) = self.0.as_slices();
        let mut v = Vec::with_capacity(a.len() + b.len());
        v.extend_from_slice(a);
        v.extend_from_slice(b);
        Bytes::from(v)
    }
}

#[derive(Default)]
struct ProcState {
    stdout: Tail,
    stderr: Tail,
    sink: Option<Sink>,
}

/// One process in the table.
pub struct Proc {
    pub pid: u32,
    cmd: String,
    background: bool,
    started_ms: u64,
    state: Mutex<ProcState>,
    exit: watch::Sender<Option<ExitStatus>>,
    stdin: tokio::sync::Mutex<Option<pipe::Sender>>,
    /// The cgroup the process and all it starts live in (`None` when containment is off).
    cgroup: Option<crate::contain::Cgroup>,
}

impl Proc {
    fn state(&self) -> MutexGuard<'_, ProcState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The exit status, once the process has ended.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }

    /// Wait for the exit status.
    pub async fn wait(&self) -> ExitStatus {
        let mut rx = self.exit.subscribe();
        loop {
            if let Some(st) = *rx.borrow_and_update() {
                return st;
            }
            if rx.changed().await.is_err() {
                // The sender lives in `self`, so this cannot happen; report an unknown ending.
                return ExitStatus {
                    code: None,
                    signal: None,
                    timed_out: false,
                };
            }
        }
    }

    /// Copies of the output tails.
    pub fn tails(&self) -> (Bytes, Bytes) {
        let st = self.state();
        (st.stdout.snapshot(), st.stderr.snapshot())
    }

    pub fn info(&self) -> ProcInfo {
        ProcInfo {
            pid: self.pid,
            cmd: self.cmd.clone(),
            background: self.background,
            started_ms: self.started_ms,
            exit: self.exit_status(),
        }
    }

    /// Stop sending output to `stream` (it was abandoned or its connection lost).
    pub fn detach(&self, stream: u32) {
        let mut st = self.state();
        if st.sink.as_ref().is_some_and(|s| s.stream == stream) {
            st.sink = None;
        }
    }

    /// Stop the process the polite way first: SIGHUP and SIGTERM to its group now; then, once it exited or
    /// `grace` passed, SIGKILL to whatever is left of it (its whole cgroup: descendants in other sessions
    /// too). Returns at once (a task does the waiting).
    pub fn stop_with_grace(self: &Arc<Self>, grace: Duration) {
        if self.exit_status().is_some() {
            return;
        }
        let _ = self.kill(libc::SIGHUP);
        let _ = self.kill(libc::SIGTERM);
        let me = self.clone();
        tokio::spawn(async move {
            let exited = tokio::time::timeout(grace, me.wait()).await.is_ok();
            match &me.cgroup {
                Some(cg) => cg.kill(),
                None if !exited => {
                    let _ = me.kill(libc::SIGKILL);
                }
                None => {}
            }
        });
    }

    /// Write to the process' stdin pipe.
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), AgentError> {
        let mut stdin = self.stdin.lock().await;
        let Some(pipe) = stdin.as_mut() else {
            return Err(fail(ErrorKind::InvalidRequest, "the process has no open stdin"));
        };
        pipe.write_all(data)
            .await
            .map_err(|e| fail(ErrorKind::Other, format!("writing stdin: {e}")))
    }

    /// Close the process' stdin (idempotent).
    pub async fn close_stdin(&self) {
        self.stdin.lock().await.take();
    }

    /// Send `signal` to the process group (falling back to the process itself). After the leader exited,
    /// the rest of its group may live on, so the group is still signalled; a group that is gone is not an error.
    /// SIGKILL also kills the process' whole cgroup: descendants that left the group (`setsid`) die too.
    pub fn kill(&self, signal: i32) -> Result<(), AgentError> {
        if signal == libc::SIGKILL
            && let Some(cg) = &self.cgroup
        {
            cg.kill();
        }
        let pid = self.pid as libc::pid_t;
        // SAFETY: kill has no memory-safety preconditions.
        if unsafe { libc::kill(-pid, signal) } == 0 || self.exit_status().is_some() {
            return Ok(());
        }
        // SAFETY: as above.
        if unsafe { libc::kill(pid, signal) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        Err(fail(ErrorKind::Other, format!("kill: {err}")))
    }
}

/// All processes started by the agent, shared by every connection.
#[derive(Default)]
pub struct ProcTable {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl ProcTable {
    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Arc<Proc>>> {
        self.procs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, pid: u32) -> Result<Arc<Proc>, AgentError> {
        self.lock()
            .get(&pid)
            .cloned()
            .ok_or_else(|| fail(ErrorKind::NotFound, format!("no process {pid}")))
    }

    pub fn list(&self) -> Vec<ProcInfo> {
        let mut v: Vec<ProcInfo> = self.lock().values().map(|p| p.info()).collect();
        v.sort_by_key(|p| (p.started_ms, p.pid));
        v
    }

    /// Start a process. For a foreground one, `Started` is sent on `sink` before any output.
    pub fn spawn(self: &Arc<Self>, req: ExecRequest, sink: Option<Sink>) -> Result<Arc<Proc>, AgentError> {
        let mut cmd = build_command(&req)?;
        let cgroup = crate::contain::enter_on_exec(&mut cmd)
            .map_err(|e| fail(ErrorKind::Other, format!("cannot make the command's cgroup: {e}")))?;
        let (mut child, exit_rx) = reaper::spawn(&mut cmd).map_err(|e| {
            let kind = crate::files::errno_kind(&e);
            fail(
                kind,
                format!("cannot start {}: {e}", short(&req.command.display(), 200)),
            )
        })?;
        let pid = child.id();
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        let stdin = child
            .stdin
            .take()
            .map(OwnedFd::from)
            .and_then(|fd| pipe::Sender::from_owned_fd(fd).ok());
        drop(child);

        let started_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let proc = Arc::new(Proc {
            pid,
            cmd: short(&req.command.display(), MAX_CMD_LEN),
            background: req.background,
            started_ms,
            state: Mutex::new(ProcState {
                sink: sink.clone(),
                ..ProcState::default()
            }),
            exit: watch::Sender::new(None),
            stdin: tokio::sync::Mutex::new(stdin),
            cgroup,
        });
        self.lock().insert(pid, proc.clone());
        if let Some(s) = &sink {
            let _ = s.out.send(s.stream, &GuestMsg::Started { pid }, Bytes::new());
        }
        let (exited_tx, exited_rx) = watch::channel(false);
        let pumps = [(stdout, GuestMsg::Stdout), (stderr, GuestMsg::Stderr)].map(|(fd, msg)| {
            let proc = proc.clone();
            let exited = exited_rx.clone();
            tokio::spawn(async move {
                if let Some(rx) = fd.and_then(|fd| pipe::Receiver::from_owned_fd(fd).ok()) {
                    pump(proc, rx, msg, exited).await;
                }
            })
        });
        let timeout = req.timeout_ms.map(Duration::from_millis);
        tokio::spawn(supervise(
            self.clone(),
            proc.clone(),
            exit_rx,
            timeout,
            pumps,
            exited_tx,
        ));
        Ok(proc)
    }

    /// Forget the oldest finished processes beyond [`MAX_FINISHED`].
    fn evict(&self) {
        let mut procs = self.lock();
        let mut finished: Vec<(u64, u32)> = procs
            .values()
            .filter(|p| p.exit_status().is_some())
            .map(|p| (p.started_ms, p.pid))
            .collect();
        if finished.len() <= MAX_FINISHED {
            return;
        }
        finished.sort_unstable();
        for (_, pid) in &finished[..finished.len() - MAX_FINISHED] {
            procs.remove(pid);
        }
    }
}

fn short(s: &str, max: usize) -> String {
    let mut s = s.to_owned();
    s.truncate(s.floor_char_boundary(max));
    s
}

pub(crate) fn build_command(req: &ExecRequest) -> Result<std::process::Command, AgentError> {
    let bad = |what: &str| fail(ErrorKind::InvalidRequest, what.to_owned());
    let mut cmd = match &req.command {
        Command::Argv(argv) => {
            let Some((prog, args)) = argv.split_first() else {
                return Err(bad("empty argv"));
            };
            if prog.is_empty() || argv.iter().any(|a| a.contains('\0')) {
                return Err(bad("argv must be non-empty strings without NUL"));
            }
            let mut c = std::process::Command::new(prog);
            c.args(args);
            c
        }
        Command::Shell(line) => {
            if line.contains('\0') {
                return Err(bad("shell command contains NUL"));
            }
            let mut c = std::process::Command::new("/bin/sh");
            c.arg("-c").arg(line);
            c
        }
    };
    cmd.env_clear().env("PATH", DEFAULT_PATH).env("HOME", "/root");
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(bad(
                "environment names must be non-empty without '=' or NUL, values without NUL",
            ));
        }
        cmd.env(k, v);
    }
    let cwd = match &req.cwd {
        Some(c) => crate::files::check_path(c)?.to_owned(),
        None if std::path::Path::new("/root").is_dir() => "/root".into(),
        None => "/".into(),
    };
    cmd.current_dir(cwd);
    cmd.stdin(if req.stdin { Stdio::piped() } else { Stdio::null() });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: the closure only calls async-signal-safe functions (setsid, sigprocmask, signal).
    unsafe {
        cmd.pre_exec(|| {
            // Own session and process group, so a kill of the group reaches every descendant.
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // PID 1 ignores some signals and may block others: give the program the defaults.
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            for sig in [
                libc::SIGTERM,
                libc::SIGINT,
                libc::SIGHUP,
                libc::SIGQUIT,
                libc::SIGPIPE,
            ] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// Copy one output pipe into the tail and, while a sink is attached, to the host with flow control.
async fn pump(proc: Arc<Proc>, mut rx: pipe::Receiver, msg: GuestMsg, mut exited: watch::Receiver<bool>) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let n = if *exited.borrow() {
            match tokio::time::timeout(DRAIN_GRACE, rx.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                Ok(Err(_)) | Err(_) => 0,
            }
        } else {
            tokio::select! {
                r = rx.read(&mut buf) => r.unwrap_or(0),
                _ = exited.changed() => continue,
            }
        };
        if n == 0 {
            return;
        }
        let chunk = Bytes::copy_from_slice(&buf[..n]);
        let sink = {
            let mut st = proc.state();
            match msg {
                GuestMsg::Stdout => st.stdout.push(&chunk),
                _ => st.stderr.push(&chunk),
            }
            st.sink.clone()
        };
        if let Some(s) = sink {
            let sent = s.window.acquire(hearth_proto::data_cost(n)).await.is_ok()
                && s.out.send(s.stream, &msg, chunk).is_ok();
            if !sent {
                proc.detach(s.stream);
            }
        }
    }
}

async fn supervise(
    table: Arc<ProcTable>,
    proc: Arc<Proc>,
    mut exit_rx: tokio::sync::oneshot::Receiver<RawExit>,
    timeout: Option<Duration>,
    pumps: [tokio::task::JoinHandle<()>; 2],
    exited_tx: watch::Sender<bool>,
) {
    let mut timed_out = false;
    let raw = match timeout {
        None => (&mut exit_rx).await.ok(),
        Some(t) => tokio::select! {
            r = &mut exit_rx => r.ok(),
            _ = tokio::time::sleep(t) => {
                timed_out = true;
                let _ = proc.kill(libc::SIGKILL);
                exit_rx.await.ok()
            }
        },
    };
    let _ = exited_tx.send(true);
    for p in pumps {
        let _ = p.await;
    }
    let status = match raw {
        Some(RawExit::Code(c)) => ExitStatus {
            code: Some(c),
            signal: None,
            timed_out,
        },
        Some(RawExit::Signal(s)) => ExitStatus {
            code: None,
            signal: Some(s),
            timed_out,
        },
        None => ExitStatus {
            code: None,
            signal: None,
            timed_out,
        },
    };
    // Release the stdin pipe, unless a write is blocked on it (a descendant may still hold the read end):
    // that write fails or finishes on its own, and waiting for it here would delay `Exited` forever.
    if let Ok(mut stdin) = proc.stdin.try_lock() {
        stdin.take();
    }
    let sink = proc.state().sink.take();
    proc.exit.send_replace(Some(status));
    match sink {
        Some(s)
            if s.out
                .send(s.stream, &GuestMsg::Exited(status), Bytes::new())
                .is_ok() =>
        {
            s.streams.remove(s.stream);
            // The host got the whole story: a foreground process leaves the table.
            if !proc.background {
                table.lock().remove(&proc.pid);
            }
        }
        _ => {}
    }
    table.evict();
}
