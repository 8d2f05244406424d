//! hearth-agent: the guest side of the agent channel, and PID 1 of every sandbox.
//!
//! # Layout
//! - [`Agent`]: the state shared by all connections (the process table); [`Agent::serve`] serves one
//!   connection (any byte stream), so the whole protocol is testable on the host over a socket pair.
//! - `conn`: one session: frame loop, `Hello` handling, per-connection stream table, process requests.
//! - `procs`: spawning (own session/process group, base env, cwd), output pumps with flow control, timeouts,
//!   bounded output tails, exit statuses.
//! - [`contain`]: every program in a cgroup of its own under one limited parent (memory, pids, CPU weight),
//!   killed as a whole; the agent in its own protected cgroup.
//! - `pty`: programs on a pseudo-terminal (session leader with a controlling terminal, resize, signals,
//!   hang-up when the stream is abandoned).
//! - `files`: file requests (read/write streamed, stat, list, mkdir, remove, rename) with typed errors.
//! - `watch`: `WatchDir`: inotify on a directory (optionally recursive), events in bounded, flow-controlled
//!   batches.
//! - `restore`: snapshot support: `Sync` (flush every file system) and `PostRestore` (clock, RNG reseed,
//!   hostname, machine-id), configured by [`SystemConfig`].
//! - `reaper`: the single process-wide SIGCHLD-style reaper that hands exit statuses to their waiters and
//!   reaps orphans (PID 1 duty).
//! - `mounts`: `Mount`/`Unmount`: NFS mounts of the host's mount service (mount(2) with text options).
//! - [`init`]: PID 1 setup (mounts, hostname, `lo`, kernel command line, logging to the console).
//! - [`net`]: the guest's NIC (address, default route, resolver) from `hearth.net=` on the command line.
//! - [`transport`]: serial (virtio-serial port) and vsock listeners, and [`transport::FdStream`].
//!
//! The binary (`main.rs`) runs [`init::setup`] then serves the chosen transport forever.

mod conn;
pub mod contain;
mod files;
pub mod init;
mod mounts;
pub mod net;
mod procs;
mod pty;
mod reaper;
mod restore;
pub mod transport;
mod watch;

use std::sync::Arc;

use hearth_proto::ErrorKind;
use tokio::io::{AsyncRead, AsyncWrite};

pub use procs::DEFAULT_PATH;
pub use restore::SystemConfig;

/// A failed request, answered with `Error{kind, message}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct AgentError {
    pub kind: ErrorKind,
    pub message: String,
}

pub(crate) fn fail(kind: ErrorKind, message: impl Into<String>) -> AgentError {
    AgentError {
        kind,
        message: message.into(),
    }
}

/// Log a line for the guest's console (the kernel log when running as PID 1, stderr otherwise).
pub fn log(msg: &str) {
    init::log(msg);
}

/// The agent: processes outlive connections, so they live here rather than in a session.
#[derive(Clone, Default)]
pub struct Agent {
    pub(crate) procs: Arc<procs::ProcTable>,
    pub(crate) sys: Arc<SystemConfig>,
    /// Connections, and the restores that close the older ones (see `conn::Sessions`).
    pub(crate) sessions: Arc<conn::Sessions>,
}

impl Agent {
    /// An agent that changes the real system on `PostRestore` (what PID 1 in the guest uses).
    pub fn new() -> Self {
        Self::default()
    }

    /// An agent whose `PostRestore` only touches what `sys` allows (tests on a host).
    pub fn with_system(sys: SystemConfig) -> Self {
        Agent {
            procs: Arc::default(),
            sys: Arc::new(sys),
            sessions: Arc::default(),
        }
    }

    /// Serve one connection until the host disconnects. Must run inside a tokio runtime with time and I/O.
    pub async fn serve<S>(&self, stream: S) -> std::io::Result<()>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        conn::serve_conn(self.clone(), stream).await
    }
}
