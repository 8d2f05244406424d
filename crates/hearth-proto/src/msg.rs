//! The typed messages carried in frame headers.
//!
//! A header is `{"stream": u32, "msg": {"type": "...", ...}}`. [`HostMsg`] flows host -> guest, [`GuestMsg`]
//! guest -> host. Messages whose [`HostMsg::carries_data`] / [`GuestMsg::carries_data`] is true carry their
//! payload in the frame's raw data section (never in JSON) and count against the stream's credit window.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::watch::WatchRequest;

/// The program to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// Program and arguments, run directly (`argv[0]` is looked up in `PATH`).
    Argv(Vec<String>),
    /// A shell command line, run as `/bin/sh -c <line>`.
    Shell(String),
}

impl Command {
    /// A short human-readable form (argv joined by spaces, or the shell line).
    pub fn display(&self) -> String {
        match self {
            Command::Argv(argv) => argv.join(" "),
            Command::Shell(line) => line.clone(),
        }
    }
}

/// Everything the agent needs to start a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub command: Command,
    /// Added to the agent's base environment (`PATH`, `HOME=/root`); these win on conflict.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Absolute working directory; default `/root` if it exists, else `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// When true the process gets a stdin pipe fed by the host; when false, `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Kill the whole process group with SIGKILL after this many milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Background processes outlive the request and are tracked in the agent's process table.
    #[serde(default)]
    pub background: bool,
}

impl ExecRequest {
    /// Run `argv` directly.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// Run `line` with `/bin/sh -c`.
    pub fn shell(line: impl Into<String>) -> Self {
        Self::new(Command::Shell(line.into()))
    }

    fn new(command: Command) -> Self {
        ExecRequest {
            command,
            env: BTreeMap::new(),
            cwd: None,
            stdin: false,
            timeout_ms: None,
            background: false,
        }
    }

    /// Add one environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Set the working directory.
    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    /// Give the process a stdin pipe.
    pub fn with_stdin(mut self) -> Self {
        self.stdin = true;
        self
    }

    /// Kill the process group after `timeout`.
    pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        self
    }
}

/// Everything the agent needs to start a program on a new pseudo-terminal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtyRequest {
    pub command: Command,
    /// Added to the agent's base environment; `TERM` defaults to [`DEFAULT_TERM`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Absolute working directory; default `/root` if it exists, else `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Terminal size at start (1..=[`MAX_PTY_DIM`] each).
    pub rows: u16,
    pub cols: u16,
}

/// `TERM` of a PTY session whose request does not set one.
pub const DEFAULT_TERM: &str = "xterm-256color";
/// Largest number of rows or columns a terminal may have.
pub const MAX_PTY_DIM: u16 = 4096;

/// Checks a terminal size.
pub fn valid_pty_size(rows: u16, cols: u16) -> bool {
    (1..=MAX_PTY_DIM).contains(&rows) && (1..=MAX_PTY_DIM).contains(&cols)
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code when the process exited normally.
    pub code: Option<i32>,
    /// Signal number when the process was killed by a signal.
    pub signal: Option<i32>,
    /// True when the agent killed it because its timeout expired.
    pub timed_out: bool,
}

/// One entry of the agent's process table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    pub pid: u32,
    /// The command as started (cut to a bounded length).
    pub cmd: String,
    pub background: bool,
    /// Milliseconds since the Unix epoch when the process started.
    pub started_ms: u64,
    /// Set once the process has exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitStatus>,
}

/// Kind of a file-system entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// Metadata of a file in the guest (not following a final symlink, except for `read_file`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Base name of the entry (`/` for the root).
    pub name: String,
    /// Absolute path in the guest.
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (e.g. 0o644), without the file-type bits.
    pub mode: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

/// errno-like class of a failed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    NotFound,
    PermissionDenied,
    AlreadyExists,
    NotADirectory,
    IsADirectory,
    DirectoryNotEmpty,
    /// A path that is relative, empty, contains NUL or is too long.
    InvalidPath,
    /// A request that is malformed for another reason (empty argv, NUL in env, oversize header, ...).
    InvalidRequest,
    /// The peers speak different protocol versions.
    VersionMismatch,
    /// Anything else, including kinds a newer peer knows and this one does not.
    #[serde(other)]
    Other,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::NotADirectory => "not a directory",
            ErrorKind::IsADirectory => "is a directory",
            ErrorKind::DirectoryNotEmpty => "directory not empty",
            ErrorKind::InvalidPath => "invalid path",
            ErrorKind::InvalidRequest => "invalid request",
            ErrorKind::VersionMismatch => "protocol version mismatch",
            ErrorKind::Other => "error",
        };
        f.write_str(s)
    }
}

/// Length of [`PostRestore::entropy`]: 64 bytes (512 bits) from the host's RNG.
pub const POST_RESTORE_ENTROPY_LEN: usize = 64;

/// What the guest must change right after it was resumed or forked from a snapshot, before it runs anything
/// else: a restored guest believes it is still the moment of the snapshot, and every fork of one snapshot
/// starts with the same RNG state, hostname and machine id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PostRestore {
    /// The host's wall clock, nanoseconds since the Unix epoch (set with `clock_settime(CLOCK_REALTIME)`).
    pub unix_time_ns: i64,
    /// Exactly [`POST_RESTORE_ENTROPY_LEN`] bytes from the host's RNG, mixed into the guest kernel's pool and
    /// credited (`RNDADDENTROPY`), then the CRNG is reseeded (`RNDRESEEDCRNG`).
    pub entropy: Vec<u8>,
    /// New hostname (`sethostname`, and `/etc/hostname` when writable): 1-64 of `[A-Za-z0-9-]`, not
    /// starting or ending with `-`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// New `/etc/machine-id`: exactly 32 lowercase hex digits, not all zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_id: Option<String>,
}

impl PostRestore {
    /// Check every field; the agent refuses a request that fails this (`Error{invalid_request}`) before
    /// changing anything.
    pub fn validate(&self) -> Result<(), String> {
        if self.entropy.len() != POST_RESTORE_ENTROPY_LEN {
            return Err(format!(
                "entropy must be exactly {POST_RESTORE_ENTROPY_LEN} bytes, got {}",
                self.entropy.len()
            ));
        }
        if self.unix_time_ns <= 0 {
            return Err(format!(
                "unix_time_ns {} is not after the epoch",
                self.unix_time_ns
            ));
        }
        if let Some(h) = &self.hostname
            && !valid_hostname(h)
        {
            return Err("hostname must be 1-64 of [A-Za-z0-9-], not starting or ending with '-'".into());
        }
        if let Some(m) = &self.machine_id
            && !valid_machine_id(m)
        {
            return Err("machine_id must be 32 lowercase hex digits, not all zero".into());
        }
        Ok(())
    }
}

/// A single DNS label: what `sethostname` and `/etc/hostname` get.
pub fn valid_hostname(h: &str) -> bool {
    (1..=64).contains(&h.len())
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !h.starts_with('-')
        && !h.ends_with('-')
}

/// The `machine-id(5)` format: 32 lowercase hex digits (all zero is not a valid id).
pub fn valid_machine_id(m: &str) -> bool {
    m.len() == 32 && m.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) && m.bytes().any(|b| b != b'0')
}

/// What the agent did for a [`PostRestore`] (all of it, or the request fails with an error instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PostRestoreReport {
    /// The wall clock was set.
    pub clock_set: bool,
    /// Bits of entropy credited to the kernel pool by `RNDADDENTROPY`.
    pub entropy_bits_credited: u32,
    /// `RNDRESEEDCRNG` succeeded (the CRNG was reseeded from the pool immediately).
    pub crng_reseeded: bool,
    pub hostname_set: bool,
    /// `/etc/machine-id` was written (fsynced).
    pub machine_id_written: bool,
}

/// The answer to a `post_restore` carried by a `Hello` (in its `HelloOk`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum PostRestoreOutcome {
    Done(PostRestoreReport),
    Failed { kind: ErrorKind, message: String },
}

/// An NFS mount the agent makes in the guest (`HostMsg::Mount`). The server is the host's mount service on
/// the sandbox's gateway; the guest only ever learns its address, port and export name (no credentials).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountRequest {
    /// Absolute, normalised path in the guest (created if missing).
    pub path: String,
    /// IPv4 address of the NFS server (the gateway).
    pub server: std::net::Ipv4Addr,
    /// TCP port of NFS and MOUNT (one port serves both).
    pub port: u16,
    /// Export path on the server (`/` + 16 hex digits).
    pub export: String,
    /// Mount read-only in the guest too (the server enforces it either way).
    #[serde(default)]
    pub read_only: bool,
}

impl MountRequest {
    /// Checks the request; the agent refuses one that fails this (`Error{invalid_request}`).
    pub fn validate(&self) -> Result<(), String> {
        if !valid_guest_path(&self.path) || self.path == "/" {
            return Err("mount path must be absolute and normalised, not /".into());
        }
        let hex = self.export.strip_prefix('/').unwrap_or_default();
        if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("export must be / and 16 hex digits".into());
        }
        if self.port == 0 {
            return Err("port must not be 0".into());
        }
        Ok(())
    }
}

/// An absolute path without empty, `.` or `..` segments, NUL or a trailing `/`, at most 4096 bytes.
pub fn valid_guest_path(p: &str) -> bool {
    p.starts_with('/')
        && p.len() <= 4096
        && !p.contains('\0')
        && (p == "/" || p[1..].split('/').all(|s| !s.is_empty() && s != "." && s != ".."))
}

/// Messages from the host to the guest agent.
///
/// Requests open a stream (a fresh odd id chosen by the host); the guest ends every stream with exactly one
/// terminal [`GuestMsg`] (see [`GuestMsg::is_terminal`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HostMsg {
    /// First message of every connection, on stream 0. Answered by [`GuestMsg::HelloOk`].
    Hello {
        version: u32,
        nonce: u64,
        /// Right after a restore: the agent does this [`HostMsg::PostRestore`] before it answers, and its
        /// `HelloOk` carries the outcome, one round trip instead of two while the restored guest is slowest.
        /// An agent from before this field ignores it (its `HelloOk` has no outcome: send `PostRestore`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        post_restore: Option<PostRestore>,
    },
    /// Answered by [`GuestMsg::Pong`].
    Ping,
    /// Start a process. Foreground: `Started`, `Stdout`/`Stderr` data, then `Exited`. Background: `Started`.
    Exec(ExecRequest),
    /// Data (in the frame's data section) for the stdin of the process started on this stream.
    Stdin,
    /// Close the stdin of the process started on this stream.
    StdinEof,
    /// The host stops caring about this stream: the agent sends nothing more on it. A foreground process
    /// started on it is stopped (its process group gets SIGHUP and SIGTERM, then SIGKILL after a short grace)
    /// and stays waitable in the process table until then. (A connection that is merely lost does not kill
    /// anything: its foreground processes keep running and stay waitable.)
    Abandon,
    /// Grant the guest `bytes` more data bytes on this stream.
    Credit { bytes: u64 },
    /// List the process table. Answered by `Procs` batches then `Ok`.
    ListProcs,
    /// Wait until `pid` exits (at most `timeout_ms` if set). Answered by the output tails as `Stdout`/`Stderr`
    /// data, then `Exited`; or `StillRunning` when the timeout expired first.
    WaitProc {
        pid: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
    },
    /// Send `signal` to the process group of `pid`. Answered by `Ok`.
    KillProc { pid: u32, signal: i32 },
    /// Write the frame's data to the stdin of `pid` (a process started with `stdin: true`), then close it if
    /// `eof`. Answered by `Ok`.
    ProcStdin { pid: u32, eof: bool },
    /// Read a file: `ReadStart`, `FileData` data frames, then `ReadDone`.
    ReadFile { path: String },
    /// Write a file: the host then sends `FileData` data frames and `FileEnd`; answered by `Written`.
    WriteFile {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
    },
    /// A chunk of file content (in the data section), on a `WriteFile` stream.
    FileData,
    /// End of the content of a `WriteFile` stream.
    FileEnd,
    /// Metadata of one path (not following a final symlink). Answered by `Stat`.
    Stat { path: String },
    /// List a directory: `Entries` batches then `Ok`.
    ListDir { path: String },
    /// Create a directory. Answered by `Ok`.
    Mkdir { path: String, parents: bool },
    /// Remove a file, symlink or (empty, or any with `recursive`) directory. Answered by `Ok`.
    Remove { path: String, recursive: bool },
    /// Rename a path. Answered by `Ok`.
    Rename { from: String, to: String },
    /// Flush every guest file system (`sync(2)`, then `syncfs` on each mount) before a snapshot. Answered by
    /// `Ok` once done (protocol version 2).
    Sync,
    /// Start a program on a new pseudo-terminal (its session leader, with the terminal as controlling
    /// terminal). Answered by `Started`, then the terminal's output as `Stdout` data, then `Exited`. Input is
    /// `Stdin` data on the same stream (Ctrl-C is the byte 0x03: the terminal turns it into SIGINT);
    /// `PtyResize` and `PtySignal` act on it; `Abandon` (or a lost connection) hangs it up: SIGHUP and
    /// SIGTERM to its process group, SIGKILL after a short grace. PTY programs are not in the process table.
    /// Agents that predate it answer `Error{invalid_request}`.
    Pty(PtyRequest),
    /// Resize the terminal of the PTY session on this stream (the program gets SIGWINCH). No answer.
    PtyResize { rows: u16, cols: u16 },
    /// Send `signal` to the process group of the PTY session on this stream. No answer.
    PtySignal { signal: i32 },
    /// Fix up the guest after a resume or fork (clock, RNG, identity). Answered by `PostRestored`, or by
    /// `Error{invalid_request}` for malformed values, before anything was changed (protocol version 2).
    PostRestore(PostRestore),
    /// Watch a directory: `Watching`, then `WatchEvents` data frames until `Abandon` (or `Ok` once the
    /// directory itself is gone). See [`crate::watch`].
    WatchDir(WatchRequest),
    /// Mount an NFS export of the host at a path (made if missing). Answered by `Ok`; agents that predate it
    /// answer `Error{invalid_request}` ("unknown or malformed request").
    Mount(MountRequest),
    /// Unmount what is mounted at `path` (lazily if it is busy). Answered by `Ok`, or `Error{not_found}` when
    /// nothing is mounted there.
    Unmount { path: String },
}

impl HostMsg {
    /// True for messages whose payload is the frame's data section (counted by flow control).
    pub fn carries_data(&self) -> bool {
        matches!(
            self,
            HostMsg::Stdin | HostMsg::FileData | HostMsg::ProcStdin { .. }
        )
    }

    /// True for messages that are flow-controlled (`ProcStdin` is a single bounded request frame, not).
    pub fn is_flow_controlled(&self) -> bool {
        matches!(self, HostMsg::Stdin | HostMsg::FileData)
    }
}

/// Messages from the guest agent to the host. Everything here is untrusted input for the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GuestMsg {
    /// Answer to `Hello`, on stream 0.
    HelloOk {
        version: u32,
        agent_version: String,
        nonce: u64,
        /// What became of the `Hello`'s `post_restore`, when it had one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        post_restore: Option<PostRestoreOutcome>,
    },
    /// Answer to `Ping` (terminal).
    Pong,
    /// The process started (terminal for a background exec).
    Started { pid: u32 },
    /// Data from the process' stdout (in the data section).
    Stdout,
    /// Data from the process' stderr (in the data section).
    Stderr,
    /// The process ended (terminal).
    Exited(ExitStatus),
    /// `WaitProc` timed out while the process still runs (terminal).
    StillRunning,
    /// Grant the host `bytes` more data bytes on this stream.
    Credit { bytes: u64 },
    /// A batch of process-table entries.
    Procs { procs: Vec<ProcInfo> },
    /// A batch of directory entries.
    Entries { entries: Vec<FileInfo> },
    /// Metadata answer to `Stat` (terminal).
    Stat { info: FileInfo },
    /// First answer to `ReadFile`: what is about to be streamed.
    ReadStart { info: FileInfo },
    /// A chunk of file content (in the data section).
    FileData,
    /// Content of a `ReadFile` fully sent (terminal).
    ReadDone { bytes: u64 },
    /// A `WriteFile` completed (terminal).
    Written { bytes: u64 },
    /// Answer to `PostRestore` (terminal).
    PostRestored(PostRestoreReport),
    /// The watch of a `WatchDir` is in place; events follow.
    Watching,
    /// A JSON array of [`crate::watch::WatchEvent`]s (in the data section).
    WatchEvents,
    /// Generic success (terminal).
    Ok,
    /// Failure (terminal).
    Error { kind: ErrorKind, message: String },
}

impl GuestMsg {
    /// True for messages whose payload is the frame's data section (all flow-controlled).
    pub fn carries_data(&self) -> bool {
        matches!(
            self,
            GuestMsg::Stdout | GuestMsg::Stderr | GuestMsg::FileData | GuestMsg::WatchEvents
        )
    }

    /// True for the messages that end a stream.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            GuestMsg::Pong
                | GuestMsg::Exited(_)
                | GuestMsg::StillRunning
                | GuestMsg::Stat { .. }
                | GuestMsg::ReadDone { .. }
                | GuestMsg::Written { .. }
                | GuestMsg::PostRestored(_)
                | GuestMsg::Ok
                | GuestMsg::Error { .. }
        )
    }

    /// Shorthand for an error message.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        GuestMsg::Error {
            kind,
            message: message.into(),
        }
    }
}

/// The JSON header of a frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header<M> {
    pub stream: u32,
    pub msg: M,
}
