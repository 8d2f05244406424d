//! hearth's host<->guest agent protocol.
//!
//! # Layout
//! - [`frame`]: the wire format (`b"HRTH"` | u32 LE header_len | u32 LE data_len | JSON header | raw data),
//!   [`frame::encode`] and the allocation-bounded, resynchronising [`frame::FrameDecoder`].
//! - [`msg`]: the typed, versioned messages: [`HostMsg`] (host -> guest) and [`GuestMsg`] (guest -> host),
//!   plus the request and result types ([`ExecRequest`], [`FileInfo`], [`ProcInfo`], [`ErrorKind`], ...).
//! - [`watch`]: the request and events of a directory watch (`WatchDir`).
//! - `io` (feature `io`): async [`io::FrameReader`], the [`io::Outbox`] + [`io::write_loop`] writer, and the
//!   two halves of flow control, [`io::CreditWindow`] (sender) and [`io::RecvWindow`] (receiver).
//! - `client` (feature `client`): [`client::AgentClient`], the host side used by the daemon.
//! - `tests/`: codec, hostile-guest and in-test fuzz loops; `fuzz/` (its own workspace, nightly): cargo-fuzz
//!   targets for the decoder and the client's reader; `examples/agent_cli.rs`: talk to an agent socket by hand.
//!
//! # Protocol summary
//! - Every (re)connection starts with `Hello{version, nonce}` on stream 0, answered by `HelloOk` with the same
//!   nonce (frames before it are stale and ignored). A version mismatch is answered by `Error{kind:
//!   version_mismatch}` and surfaces as [`client::ClientError::VersionMismatch`].
//! - Each request opens a stream with a fresh odd id chosen by the host; the guest ends it with exactly one
//!   terminal message ([`GuestMsg::is_terminal`]; for a background exec, `Started` ends it).
//! - Data (stdout, stderr, stdin, file content) travels in the frames' data sections. Each direction of a
//!   stream may have at most [`WINDOW`] (1 MiB) unacknowledged data bytes in flight; the receiver returns
//!   `Credit{bytes}` as it consumes. A guest that sends more than its credit is a protocol error that closes
//!   the connection. Each data frame costs `max(len, 256)` credit bytes ([`data_cost`]), so at most 4096
//!   data frames are in flight per stream however small they are.
//! - Limits: header <= 64 KiB (so large lists come in batches), data <= 256 KiB per frame.

pub mod frame;
pub mod msg;
pub mod watch;

#[cfg(feature = "io")]
pub mod io;

#[cfg(feature = "client")]
pub mod client;

pub use frame::{EncodeError, EncodedFrame, FrameDecoder, FrameError, RawFrame};
pub use msg::{
    Command, ErrorKind, ExecRequest, ExitStatus, FileInfo, FileKind, GuestMsg, Header, HostMsg, MountRequest,
    POST_RESTORE_ENTROPY_LEN, PostRestore, PostRestoreOutcome, PostRestoreReport, ProcInfo, PtyRequest,
};

/// Version spoken by this crate; `Hello` and `HelloOk` carry it and must match.
///
/// - 1: processes and files.
/// - 2: `Sync`, `PostRestore`/`PostRestored`; `Abandon` on a foreground exec kills its process group. Later,
///   compatibly: `Hello` may carry a `post_restore`, answered in `HelloOk` (older agents ignore it).
pub const PROTOCOL_VERSION: u32 = 2;
/// Stream id of connection-level messages (`Hello`, `HelloOk`).
pub const CONTROL_STREAM: u32 = 0;
/// Most unacknowledged data bytes in flight per stream and direction.
pub const WINDOW: u64 = 1024 * 1024;
/// Size of the output tails the agent keeps for each process (stdout and stderr each).
pub const TAIL_MAX: usize = 1024 * 1024;
/// Least credit a data frame costs, whatever its length.
pub const MIN_DATA_COST: u64 = 256;

/// Credit consumed by a data frame of `len` bytes (both ends must agree on this).
pub fn data_cost(len: usize) -> u64 {
    (len as u64).max(MIN_DATA_COST)
}

/// Data chunk size senders use (below [`frame::MAX_DATA_LEN`], so a window holds several chunks).
pub const DATA_CHUNK: usize = 128 * 1024;
