//! Async Rust client for hearthd's HTTP API.
//!
//! # Layout
//! - [`client`]: [`Client`] (construction, `from_env`, the request plumbing) and the sandbox routes.
//! - [`command`]: running commands (buffered, background, streamed as [`CommandStream`]) and processes.
//! - [`files`]: streamed upload/download and the other file routes.
//! - [`pty`]: interactive terminals over WebSocket ([`pty::PtySession`]).
//! - [`buckets`]: registered buckets and mounts ([`buckets::parse_mount`] reads `BUCKET[:PREFIX]:PATH[:ro]`).
//! - [`network`]: egress policy, audit log, private networks, port tokens.
//! - [`templates`]: template builds with their progress streamed ([`TemplateBuildStream`]).
//! - [`watch`]: directory watches streamed as [`WatchStream`].
//! - [`sse`]: the incremental `text/event-stream` parser behind [`CommandStream`] and [`TemplateBuildStream`].
//! - [`error`]: [`Error`], which keeps the daemon's stable [`hearth_api::ErrorCode`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), hearth_client::Error> {
//! use futures::StreamExt;
//! use hearth_api::{CommandEvent, CreateSandboxRequest, RunCommandRequest};
//!
//! let client = hearth_client::Client::from_env()?;
//! let sbx = client.create_sandbox(&CreateSandboxRequest::default()).await?;
//! let req = RunCommandRequest { cmd: Some("uname -r".into()), ..Default::default() };
//! let mut events = client.run_command_stream(&sbx.id, &req);
//! while let Some(event) = events.next().await {
//!     if let CommandEvent::Stdout { data_b64 } = event? {
//!         print!("{}", String::from_utf8_lossy(&hearth_client::decode_output(&data_b64)?));
//!     }
//! }
//! client.delete_sandbox(&sbx.id).await?;
//! # Ok(()) }
//! ```

pub mod buckets;
pub mod client;
pub mod command;
pub mod error;
pub mod files;
pub mod network;
pub mod pty;
pub mod sse;
pub mod start;
pub mod storage;
pub mod templates;
pub mod tenancy;
pub mod watch;

pub use client::{Client, DEFAULT_DATA_DIR, DEFAULT_URL, ListFilter, default_key_path, read_key_file};
pub use command::{CommandStream, decode_output};
pub use error::Error;
pub use hearth_api as api;
pub use start::SandboxStartStream;
pub use templates::TemplateBuildStream;
pub use watch::WatchStream;
