//! The service layer: everything the HTTP handlers ask of the daemon, as methods of [`Sandboxes`] returning
//! typed [`ServiceError`]s. Nothing here knows about HTTP.
//!
//! - [`lifecycle`]: create, get, list, destroy, TTL, failure marking, system report.
//! - [`agent`]: the live agent connection of each running sandbox (connect, reconnect).
//! - [`exec`]: commands (buffered, streamed, background) and the process table.
//! - [`files`]: file content and metadata in the guest.
//! - [`fork`]: snapshot objects (checkpoints), creating from them, forks.
//! - [`console`]: the tail of a VM console log for error messages.
//! - [`buckets`]: buckets as named credentials (sealed secrets, probe) and their S3 clients.
//! - [`mounts`]: buckets mounted in sandboxes (one NFS server per sandbox on its gateway, lifecycle hooks).
//! - [`network`]: sandbox networks (namespaces, egress policy, resolver, proxy), private networks, audit log.
//! - [`pause`]: pause to zero, resume, and waking a paused sandbox for a call that needs the guest.
//! - [`snapshot`]: durable snapshot directories (manifest, checksums, fsync, rename) and their verification.
//! - [`remote`]: the storage bucket (`--storage`): background uploads, fetches of missing local copies, GC.
//! - [`cache`]: local disk as a cache of the bucket (`--cache-size`): LRU eviction of what the bucket holds.
//! - [`remote_status`]: what `GET /v1/storage`, the doctor and `GET` answers show of the bucket and the cache.
//! - [`sync`]: disk syncs of running sandboxes to the storage bucket, periodic syncs, recreating from them.
//! - [`templates`]: templates saved from sandboxes (flattened disk, optional memory), listing, deletion.
//! - [`usage`]: usage reports from the recorded intervals.
//! - [`watch`]: directory watches in the guest.

pub mod admission;
pub mod agent;
pub mod boundary;
pub mod buckets;
pub mod cache;
pub mod console;
pub mod disk_use;
pub mod exec;
pub mod files;
pub mod fork;
pub mod integrity;
pub mod lifecycle;
pub mod mounts;
pub mod network;
pub mod pause;
pub mod pty;
pub mod quota;
pub mod remote;
pub mod remote_status;
pub mod snapshot;
pub mod sync;
pub mod templates;
pub mod usage;
pub mod warm;
pub mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use hearth_api::{Check, ErrorCode};
use hearth_proto::client::ClientError;
use hearth_proto::msg::ErrorKind;
use hearth_vmm::{Accel, Vmm};

use crate::config::Paths;
use crate::db::{Db, DbError};

pub use agent::Live;

/// Longest guest-provided message copied into an API error (the guest is untrusted and could send megabytes).
const MAX_GUEST_MESSAGE: usize = 1024;

/// Errors of service operations; each maps to one stable [`ErrorCode`].
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    CapacityExceeded(String),
    #[error("{0}")]
    VmmFailed(String),
    #[error("{0}")]
    AgentUnavailable(String),
    /// The guest refused or failed the operation.
    #[error("{0}")]
    Guest(String),
    /// A snapshot's files do not match its manifest.
    #[error("{0}")]
    SnapshotCorrupt(String),
    /// An error with its own stable code (buckets, mounts).
    #[error("{1}")]
    Typed(ErrorCode, String),
    #[error("{0}")]
    Internal(String),
}

impl ServiceError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ServiceError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            ServiceError::NotFound(_) => ErrorCode::NotFound,
            ServiceError::Conflict(_) => ErrorCode::Conflict,
            ServiceError::PayloadTooLarge(_) => ErrorCode::PayloadTooLarge,
            ServiceError::CapacityExceeded(_) => ErrorCode::CapacityExceeded,
            ServiceError::VmmFailed(_) => ErrorCode::VmmFailed,
            ServiceError::AgentUnavailable(_) => ErrorCode::AgentUnavailable,
            ServiceError::Guest(_) => ErrorCode::GuestError,
            ServiceError::SnapshotCorrupt(_) => ErrorCode::SnapshotCorrupt,
            ServiceError::Typed(code, _) => *code,
            ServiceError::Internal(_) => ErrorCode::Internal,
        }
    }

    pub(crate) fn no_sandbox(id: &str) -> Self {
        ServiceError::NotFound(format!("sandbox {id} not found"))
    }
}

impl From<DbError> for ServiceError {
    fn from(e: DbError) -> Self {
        tracing::error!(error = %e, "state database");
        ServiceError::Internal("state database error".into())
    }
}

impl From<ClientError> for ServiceError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Guest { kind, message } => {
                let message = format!("{kind}: {}", clip(&message, MAX_GUEST_MESSAGE));
                match kind {
                    ErrorKind::NotFound => ServiceError::NotFound(message),
                    ErrorKind::AlreadyExists
                    | ErrorKind::NotADirectory
                    | ErrorKind::IsADirectory
                    | ErrorKind::DirectoryNotEmpty => ServiceError::Conflict(message),
                    ErrorKind::InvalidPath | ErrorKind::InvalidRequest => {
                        ServiceError::InvalidArgument(message)
                    }
                    ErrorKind::PermissionDenied | ErrorKind::VersionMismatch | ErrorKind::Other => {
                        ServiceError::Guest(message)
                    }
                }
            }
            e @ ClientError::TooManyStreams(_) => ServiceError::CapacityExceeded(e.to_string()),
            ClientError::RequestTooLarge(m) => {
                ServiceError::InvalidArgument(format!("request too large: {m}"))
            }
            ClientError::StreamEnded => ServiceError::Conflict("the process no longer accepts input".into()),
            ClientError::Body(m) => ServiceError::InvalidArgument(format!("request body: {m}")),
            other => ServiceError::AgentUnavailable(clip(&other.to_string(), MAX_GUEST_MESSAGE)),
        }
    }
}

/// Cuts `s` to at most `max` bytes on a char boundary.
pub(crate) fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Which VMM the daemon uses and why (served by `GET /v1/system`).
#[derive(Debug, Clone)]
pub struct VmmInfo {
    pub reason: String,
    pub checks: Vec<Check>,
}

/// Settings of the service.
#[derive(Debug, Clone)]
pub struct Settings {
    pub paths: Paths,
    pub default_template: String,
    /// How long a new sandbox's agent has to answer.
    pub ready_timeout: Duration,
    /// How long a running sandbox's agent may fail the health watcher's pings before it is marked failed.
    pub agent_unresponsive: Duration,
    /// Snapshots one sandbox may have at once (`--max-snapshots-per-sandbox`).
    pub max_snapshots_per_sandbox: usize,
    /// Creates from a template restore its boot snapshot at the create's shape ([`warm`], `--warm-creates`).
    pub warm_creates: bool,
    /// Boot snapshots kept at once, the least recently restored retired first (`--boot-snapshots-max`).
    pub boot_snapshots_max: usize,
    /// What a running second costs against a project's budget ([`quota::CreditPrices`]).
    pub credit_prices: quota::CreditPrices,
}

/// The sandboxes of this daemon: the state database, the VMM driver and the live agent connections.
pub struct Sandboxes {
    pub(crate) db: Db,
    pub(crate) vmm: Arc<dyn Vmm>,
    pub(crate) info: VmmInfo,
    pub(crate) settings: Settings,
    /// Agent connection of each running sandbox.
    pub(crate) live: Mutex<HashMap<String, Arc<Live>>>,
    /// Serialises lifecycle operations (create, destroy, fail) per sandbox.
    pub(crate) op_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Sandbox networking, when enabled ([`Sandboxes::enable_networking`]).
    pub(crate) net: std::sync::OnceLock<Arc<network::Networking>>,
    /// The host's capacity and what admitted creates and resumes reserved ([`admission`]).
    pub(crate) host: admission::Host,
    pub(crate) admission: Mutex<admission::Pending>,
    /// Per-project quota reservations of creates, forks and resumes in flight ([`quota`]).
    pub(crate) quotas: quota::Admission,
    /// Bucket secrets' key and clients ([`Sandboxes::enable_buckets`], or made on first use).
    pub(crate) buckets: std::sync::OnceLock<buckets::BucketKeys>,
    /// The mount servers of sandboxes with mounted buckets.
    pub(crate) mounts: mounts::MountRuntime,
    /// The storage bucket, when `--storage` is given ([`Sandboxes::enable_storage`]).
    pub(crate) storage: std::sync::OnceLock<Arc<remote::Storage>>,
    /// Boot snapshots of warm creates: their ids and the keys being saved ([`warm`]).
    pub(crate) warm: warm::WarmState,
    /// This service itself, for operations that run in their own task.
    me: Weak<Sandboxes>,
}

impl Sandboxes {
    pub fn new(db: Db, vmm: Arc<dyn Vmm>, info: VmmInfo, settings: Settings) -> Arc<Self> {
        let warm = warm::WarmState::load(&db);
        Arc::new_cyclic(|me| Sandboxes {
            db,
            vmm,
            info,
            settings,
            live: Mutex::new(HashMap::new()),
            op_locks: Mutex::new(HashMap::new()),
            net: std::sync::OnceLock::new(),
            host: admission::Host::probe(),
            admission: Mutex::new(admission::Pending::default()),
            quotas: quota::Admission::default(),
            buckets: std::sync::OnceLock::new(),
            mounts: mounts::MountRuntime::default(),
            storage: std::sync::OnceLock::new(),
            warm,
            me: me.clone(),
        })
    }

    /// A strong reference to this service (for work spawned into its own task).
    pub(crate) fn arc(&self) -> Result<Arc<Sandboxes>, ServiceError> {
        self.me
            .upgrade()
            .ok_or_else(|| ServiceError::Internal("the daemon is shutting down".into()))
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn accel(&self) -> Accel {
        self.vmm.accel()
    }

    /// The lifecycle lock of sandbox `id`.
    pub(crate) fn op_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.op_locks.lock().unwrap_or_else(|p| p.into_inner());
        // Forget locks nobody holds or waits for, so the map does not grow with every sandbox ever made.
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        locks.entry(id.to_string()).or_default().clone()
    }
}

/// Milliseconds since the Unix epoch.
/// Removes directory `dir` and everything in it, off the async runtime (a snapshot or template is gigabytes
/// of files); one already gone is no error. A failure is logged as removing `what`.
pub(crate) async fn remove_dir_off_runtime(dir: std::path::PathBuf, what: &str) {
    let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await;
    match removed {
        Ok(Err(e)) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!(error = %e, "removing {what} failed");
        }
        Err(e) => tracing::warn!(error = %e, "removing {what}: task failed"),
        Ok(_) => {}
    }
}

pub fn now_ms() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_errors_map_to_codes() {
        let e = |kind| {
            ServiceError::from(ClientError::Guest {
                kind,
                message: "x".repeat(5000),
            })
        };
        assert_eq!(e(ErrorKind::NotFound).code(), ErrorCode::NotFound);
        assert_eq!(e(ErrorKind::AlreadyExists).code(), ErrorCode::Conflict);
        assert_eq!(e(ErrorKind::InvalidPath).code(), ErrorCode::InvalidArgument);
        assert_eq!(e(ErrorKind::PermissionDenied).code(), ErrorCode::GuestError);
        assert!(e(ErrorKind::Other).to_string().len() < 1100);
        assert_eq!(
            ServiceError::from(ClientError::Closed).code(),
            ErrorCode::AgentUnavailable
        );
    }

    #[test]
    fn clip_respects_char_boundaries() {
        assert_eq!(clip("héllo", 2), "h...");
        assert_eq!(clip("abc", 3), "abc");
    }
}
