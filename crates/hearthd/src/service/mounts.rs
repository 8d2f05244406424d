//! Buckets mounted in sandboxes.
//!
//! Each sandbox with mounts has one NFS server (crate hearth-mount) in the daemon, listening on the
//! sandbox's gateway ([`hearth_net::GATEWAY`]:[`hearth_net::MOUNT_PORT`]) inside the sandbox's network
//! namespace, so it needs no egress from the guest (it works with every egress policy) and only that guest
//! can reach it. Each mount is one export of that server: the bucket's client (credentials stay in the
//! daemon), the prefix (the bucket's own plus the mount's), the read-only flag, and a random key that names
//! the export and keys its file ids. The agent mounts it with the kernel's NFS client.
//!
//! Lifecycle: the server starts with the sandbox's network (create, resume after a host reboot, daemon
//! start) and stops with it (destroy, failure); it keeps serving while the sandbox is paused, and a guest
//! resumed after a daemon restart reconnects to the new server, whose file ids are the same (the export key
//! and the table of handed-out ids, `<data>/mounts/handles/<key>`, outlive the process). A snapshot records
//! its sandbox's mounts; everything restored from it (forks included) gets them back with the same keys, so
//! the guest's open files keep working. Templates with memory are refused for sandboxes with mounts (the
//! guest's page cache holds bucket data); disk templates never hold bucket data (the mount is not on the
//! disk).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use hearth_api::{AttachMountRequest, ErrorCode, Mount, MountList, MountSpec, SandboxState};
use hearth_mount::{Counters, ExportSet, LogTable};
use hearth_proto::client::{AgentClient, ClientError};
use hearth_proto::msg::ErrorKind;

use super::{Sandboxes, ServiceError, clip};
use crate::db::mounts::MountRow;

/// Most mounts one sandbox may have.
pub const MAX_MOUNTS: usize = 8;
/// How long the guest has to mount or unmount.
const AGENT_TIMEOUT: Duration = Duration::from_secs(60);
/// Directories a mount may not cover (or sit under): the guest's system.
const SYSTEM_DIRS: &[&str] = &[
    "/proc", "/sys", "/dev", "/run", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr",
    "/boot",
];
/// Directories a mount may sit under but not replace.
const NOT_OVER: &[&str] = &["/root", "/home", "/tmp", "/var", "/opt"];

/// The mount servers of the daemon's sandboxes.
#[derive(Default)]
pub struct MountRuntime {
    servers: Mutex<HashMap<String, Server>>,
    tables: Mutex<HashMap<u64, Weak<LogTable>>>,
    counters: Mutex<HashMap<(String, String), Counted>>,
}

struct Server {
    exports: Arc<ExportSet>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A mount's live counters and how much of them is in the database already.
struct Counted {
    counters: Arc<Counters>,
    flushed: (u64, u64),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Checks a mount path: absolute, normalised, not `/`, not a system directory or under one.
pub fn validate_path(path: &str) -> Result<(), ServiceError> {
    let bad = |why: &str| ServiceError::InvalidArgument(format!("mount path {:?}: {why}", clip(path, 128)));
    if !hearth_proto::msg::valid_guest_path(path) || path.len() > 256 || path.chars().any(char::is_control) {
        return Err(bad(
            "must be absolute and normalised (no '.', '..', '//' or trailing '/'), at most 256 bytes",
        ));
    }
    if path == "/" || NOT_OVER.contains(&path) {
        return Err(bad(
            "would hide a whole system directory: mount below it (e.g. /mnt/data)",
        ));
    }
    if SYSTEM_DIRS
        .iter()
        .any(|d| path == *d || path.starts_with(&format!("{d}/")))
    {
        return Err(bad("is (or is under) a system directory"));
    }
    Ok(())
}

fn overlaps(a: &str, b: &str) -> bool {
    a == b || a.starts_with(&format!("{b}/")) || b.starts_with(&format!("{a}/"))
}

fn join_prefix(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_owned(),
        (false, true) => a.to_owned(),
        (false, false) => format!("{a}/{b}"),
    }
}

impl Sandboxes {
    fn mounts_dir(&self) -> PathBuf {
        self.settings.paths.data_dir.join("mounts")
    }

    /// Validates the mounts of a create request; a restore from a snapshot gets the snapshot's mounts.
    pub(crate) fn plan_mounts(
        &self,
        specs: &[MountSpec],
        snapshot: Option<&str>,
    ) -> Result<Vec<MountRow>, ServiceError> {
        let rows = match snapshot {
            Some(snap) => {
                if !specs.is_empty() {
                    return Err(ServiceError::InvalidArgument(
                        "mounts cannot be given with a snapshot: its restores get the snapshot's mounts"
                            .into(),
                    ));
                }
                self.db.list_snapshot_mounts(snap)?
            }
            None => {
                let mut rows: Vec<MountRow> = Vec::new();
                for s in specs {
                    let row = self.mount_row(&s.path, &s.bucket, s.prefix.as_deref(), s.read_only)?;
                    if rows.iter().any(|r| overlaps(&r.path, &row.path)) {
                        return Err(ServiceError::InvalidArgument(format!(
                            "mount path {} is given twice or inside another mount",
                            row.path
                        )));
                    }
                    rows.push(row);
                }
                if rows.len() > MAX_MOUNTS {
                    return Err(ServiceError::InvalidArgument(format!(
                        "at most {MAX_MOUNTS} mounts per sandbox"
                    )));
                }
                rows
            }
        };
        if !rows.is_empty() && self.networking().is_none() {
            return Err(network_required());
        }
        Ok(rows)
    }

    /// A new mount's row (no owner yet), validated.
    fn mount_row(
        &self,
        path: &str,
        bucket: &str,
        prefix: Option<&str>,
        ro: Option<bool>,
    ) -> Result<MountRow, ServiceError> {
        validate_path(path)?;
        let b = self.bucket_row_checked(bucket)?;
        let prefix = super::buckets::normalize_prefix(prefix.unwrap_or("").trim_start_matches('/'))
            .ok_or_else(|| {
                ServiceError::InvalidArgument(format!(
                    "prefix {:?}: path segments without '.', '..' or empty ones",
                    clip(prefix.unwrap_or(""), 128)
                ))
            })?;
        if join_prefix(&b, &prefix).len() > 512 {
            return Err(ServiceError::InvalidArgument("prefix too long".into()));
        }
        Ok(MountRow {
            owner: String::new(),
            path: path.to_owned(),
            bucket: bucket.to_owned(),
            prefix,
            read_only: ro.unwrap_or(false),
            export_key: rand::random::<u64>(),
        })
    }

    /// The bucket's own prefix; not found for an unknown name.
    fn bucket_row_checked(&self, name: &str) -> Result<String, ServiceError> {
        let not_found = || ServiceError::NotFound(format!("bucket {} not found", clip(name, 64)));
        if !hearth_api::is_valid_bucket_name(name) {
            return Err(not_found());
        }
        Ok(self.db.get_bucket(name)?.ok_or_else(not_found)?.prefix)
    }

    /// Records a new sandbox's mounts and starts serving them (its namespace exists). On error the caller's
    /// teardown removes what was made.
    pub(crate) async fn attach_mounts(&self, id: &str, rows: &[MountRow]) -> Result<(), ServiceError> {
        for r in rows {
            let row = MountRow {
                owner: id.to_owned(),
                ..r.clone()
            };
            if !self.db.insert_mount(&row)? {
                return Err(ServiceError::Conflict(format!("{} is mounted already", row.path)));
            }
            self.serve_export(id, &row).await?;
        }
        Ok(())
    }

    /// The sandbox's server (started if needed), inside its namespace.
    fn server(&self, id: &str) -> Result<Arc<ExportSet>, ServiceError> {
        let mut servers = lock(&self.mounts.servers);
        if let Some(s) = servers.get(id) {
            return Ok(s.exports.clone());
        }
        let ns = hearth_net::netns_path(id);
        let addr = SocketAddr::new(std::net::IpAddr::V4(hearth_net::GATEWAY), hearth_net::MOUNT_PORT);
        let std_listener = hearth_net::netns::tcp_listener(&ns, addr)
            .map_err(|e| ServiceError::Internal(format!("mount server of {id}: {e}")))?;
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .map_err(|e| ServiceError::Internal(format!("mount server of {id}: {e}")))?;
        let exports = Arc::new(ExportSet::default());
        let task = tokio::spawn(hearth_mount::serve(
            listener,
            exports.clone(),
            hearth_mount::ServerLimits::default(),
        ));
        servers.insert(
            id.to_owned(),
            Server {
                exports: exports.clone(),
                task,
            },
        );
        Ok(exports)
    }

    /// The handle table of export `key`, shared by every server of it (a sandbox and its forks).
    fn table(&self, key: u64) -> Result<Arc<LogTable>, ServiceError> {
        let mut tables = lock(&self.mounts.tables);
        if let Some(t) = tables.get(&key).and_then(Weak::upgrade) {
            return Ok(t);
        }
        let dir = self.mounts_dir().join("handles");
        private_dir(&dir)?;
        let t = Arc::new(
            LogTable::open(&dir.join(format!("{key:016x}")))
                .map_err(|e| ServiceError::Internal(format!("mount handle table: {e}")))?,
        );
        tables.retain(|_, w| w.strong_count() > 0);
        tables.insert(key, Arc::downgrade(&t));
        Ok(t)
    }

    /// Adds the export of `row` to the sandbox's server.
    async fn serve_export(&self, id: &str, row: &MountRow) -> Result<(), ServiceError> {
        let (bucket, brow) = self.bucket_client(&row.bucket).await?;
        let tmp = self.mounts_dir().join("tmp");
        private_dir(&tmp)?;
        let counters = lock(&self.mounts.counters)
            .entry((id.to_owned(), row.path.clone()))
            .or_insert_with(|| Counted {
                counters: Arc::default(),
                flushed: (0, 0),
            })
            .counters
            .clone();
        let export = hearth_mount::Export::new(
            hearth_mount::ExportSpec {
                key: row.export_key,
                prefix: join_prefix(&brow.prefix, &row.prefix),
                read_only: row.read_only,
            },
            bucket,
            self.table(row.export_key)?,
            hearth_mount::Limits::new(tmp),
        )
        .with_counters(counters);
        self.server(id)?.add(Arc::new(export));
        Ok(())
    }

    /// Makes the mounts in a freshly booted guest.
    pub(crate) async fn mount_in_guest(&self, id: &str, client: &AgentClient) -> Result<(), ServiceError> {
        for row in self.db.list_mounts(Some(id))? {
            guest_mount(client, &row).await?;
        }
        Ok(())
    }

    /// Serves the mounts of every sandbox that has some (daemon start), removes handle tables nobody uses and
    /// starts the usage flusher.
    pub async fn restore_mounts(&self) {
        let rows = self.db.list_mounts(None).unwrap_or_default();
        for row in &rows {
            if !hearth_net::netns_path(&row.owner).exists() {
                continue;
            }
            if let Err(e) = self.serve_export(&row.owner, row).await {
                tracing::warn!(sandbox = %row.owner, path = %row.path, error = %e, "restoring a mount failed");
            }
        }
        self.sweep_handle_tables();
        if let Ok(this) = self.arc() {
            let weak = Arc::downgrade(&this);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    let Some(svc) = weak.upgrade() else { return };
                    svc.flush_mount_usage(None);
                }
            });
        }
    }

    /// Starts a sandbox's mount server again if it is not running (resume into a rebuilt namespace).
    pub(crate) async fn ensure_mounts(&self, id: &str) -> Result<(), ServiceError> {
        if lock(&self.mounts.servers).contains_key(id) {
            return Ok(());
        }
        for row in self.db.list_mounts(Some(id))? {
            self.serve_export(id, &row).await?;
        }
        Ok(())
    }

    fn sweep_handle_tables(&self) {
        let mut keep: Vec<u64> = self
            .db
            .list_mounts(None)
            .unwrap_or_default()
            .iter()
            .map(|m| m.export_key)
            .collect();
        let _ = self.db.prune_snapshot_mounts();
        for s in self.db.list_snapshots().unwrap_or_default() {
            keep.extend(
                self.db
                    .list_snapshot_mounts(&s.id)
                    .unwrap_or_default()
                    .iter()
                    .map(|m| m.export_key),
            );
        }
        let Ok(dir) = std::fs::read_dir(self.mounts_dir().join("handles")) else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let used = name
                .to_str()
                .and_then(|n| u64::from_str_radix(n, 16).ok())
                .is_some_and(|k| keep.contains(&k));
            if !used {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Stops a sandbox's mount server and forgets its mounts (teardown: destroy, failure, failed create).
    pub(crate) async fn stop_mounts(&self, id: &str) {
        let server = lock(&self.mounts.servers).remove(id);
        drop(server);
        self.flush_mount_usage(Some(id));
        lock(&self.mounts.counters).retain(|(s, _), _| s != id);
        if let Ok(rows) = self.db.list_mounts(Some(id)) {
            for r in &rows {
                let _ = self.db.delete_mount(id, &r.path);
            }
            if !rows.is_empty() {
                self.sweep_handle_tables();
            }
        }
    }

    /// Moves what the live counters gained into the database (all sandboxes, or one).
    fn flush_mount_usage(&self, only: Option<&str>) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut counters = lock(&self.mounts.counters);
        let mut per: HashMap<String, (u64, u64)> = HashMap::new();
        for ((sandbox, _), c) in counters.iter_mut() {
            if only.is_some_and(|o| o != sandbox) {
                continue;
            }
            let now = (
                c.counters.bytes_read.load(Relaxed),
                c.counters.bytes_written.load(Relaxed),
            );
            let e = per.entry(sandbox.clone()).or_default();
            e.0 += now.0.saturating_sub(c.flushed.0);
            e.1 += now.1.saturating_sub(c.flushed.1);
            c.flushed = now;
        }
        drop(counters);
        for (sandbox, (r, w)) in per {
            if (r, w) != (0, 0)
                && let Err(e) = self.db.add_mount_usage(&sandbox, r, w)
            {
                tracing::warn!(sandbox = %sandbox, error = %e, "recording mount usage");
            }
        }
    }

    /// Bytes read from and written to mounted buckets by sandbox `id` since it was created.
    pub fn mount_bytes(&self, id: &str) -> (u64, u64) {
        self.flush_mount_usage(Some(id));
        self.db.mount_usage(id).unwrap_or_default()
    }

    /// `GET /v1/sandboxes/{id}/mounts`.
    pub fn list_mounts(&self, id: &str) -> Result<MountList, ServiceError> {
        use std::sync::atomic::Ordering::Relaxed;
        self.row(id)?;
        let counters = lock(&self.mounts.counters);
        let mounts = self
            .db
            .list_mounts(Some(id))?
            .into_iter()
            .map(|r| {
                let c = counters.get(&(id.to_owned(), r.path.clone()));
                Mount {
                    bytes_read: c.map_or(0, |c| c.counters.bytes_read.load(Relaxed)),
                    bytes_written: c.map_or(0, |c| c.counters.bytes_written.load(Relaxed)),
                    path: r.path,
                    bucket: r.bucket,
                    prefix: r.prefix,
                    read_only: r.read_only,
                }
            })
            .collect();
        Ok(MountList { mounts })
    }

    /// `PUT /v1/sandboxes/{id}/mounts?path=`: mounts a bucket in a running (or paused: resumed) sandbox.
    pub async fn attach_mount(
        &self,
        id: &str,
        path: &str,
        req: AttachMountRequest,
    ) -> Result<Mount, ServiceError> {
        let row = self.row(id)?;
        self.wake(&row).await?;
        let lock_ = self.op_lock(id);
        let _guard = lock_.lock().await;
        self.running(id)?;
        if self.networking().is_none() {
            return Err(network_required());
        }
        let mut new = self.mount_row(path, &req.bucket, req.prefix.as_deref(), req.read_only)?;
        new.owner = id.to_owned();
        let existing = self.db.list_mounts(Some(id))?;
        if let Some(o) = existing.iter().find(|m| overlaps(&m.path, path)) {
            return Err(ServiceError::Conflict(format!(
                "{} is mounted at {} already",
                clip(path, 128),
                o.path
            )));
        }
        if existing.len() >= MAX_MOUNTS {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} has {MAX_MOUNTS} mounts already"
            )));
        }
        let client = self.client_of(id).await?;
        if !self.db.insert_mount(&new)? {
            return Err(ServiceError::Conflict(format!("{path} is mounted already")));
        }
        let result = match self.serve_export(id, &new).await {
            Ok(()) => guest_mount(&client, &new).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            self.forget_export(id, &new);
            let _ = self.db.delete_mount(id, path);
            return Err(e);
        }
        tracing::info!(sandbox = %id, path = %path, bucket = %new.bucket, read_only = new.read_only, "bucket mounted");
        self.list_mounts(id)?
            .mounts
            .into_iter()
            .find(|m| m.path == path)
            .ok_or_else(|| ServiceError::Internal("the new mount is gone".into()))
    }

    /// `DELETE /v1/sandboxes/{id}/mounts?path=`: unmounts in the guest (written data is flushed first), then
    /// stops serving the export.
    pub async fn detach_mount(&self, id: &str, path: &str) -> Result<(), ServiceError> {
        let row = self.row(id)?;
        validate_path(path)?;
        self.wake(&row).await?;
        let lock_ = self.op_lock(id);
        let _guard = lock_.lock().await;
        self.running(id)?;
        let Some(m) = self
            .db
            .list_mounts(Some(id))?
            .into_iter()
            .find(|m| m.path == path)
        else {
            return Err(ServiceError::NotFound(format!(
                "nothing is mounted at {} in {id}",
                clip(path, 128)
            )));
        };
        let client = self.client_of(id).await?;
        match tokio::time::timeout(AGENT_TIMEOUT, client.unmount(path)).await {
            Err(_) => {
                return Err(ServiceError::AgentUnavailable(
                    "the guest did not unmount in time".into(),
                ));
            }
            Ok(Err(ClientError::Guest {
                kind: ErrorKind::NotFound,
                ..
            }))
            | Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(agent_error(e)),
        }
        self.flush_mount_usage(Some(id));
        self.forget_export(id, &m);
        self.db.delete_mount(id, path)?;
        tracing::info!(sandbox = %id, path = %path, "bucket unmounted");
        Ok(())
    }

    fn forget_export(&self, id: &str, row: &MountRow) {
        if let Some(s) = lock(&self.mounts.servers).get(id) {
            s.exports.remove(row.export_key);
        }
        self.flush_mount_usage(Some(id));
        lock(&self.mounts.counters).remove(&(id.to_owned(), row.path.clone()));
    }

    fn running(&self, id: &str) -> Result<(), ServiceError> {
        let row = self.row(id)?;
        if row.state != SandboxState::Running {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is {}",
                row.state.as_str()
            )));
        }
        Ok(())
    }

    async fn client_of(&self, id: &str) -> Result<AgentClient, ServiceError> {
        let live = self
            .live(id)
            .ok_or_else(|| ServiceError::AgentUnavailable(format!("sandbox {id} has no agent connection")))?;
        self.ensure_connected(&live, Duration::from_secs(10)).await
    }

    /// Refuses a memory template of a sandbox with mounts (its memory holds bucket data and live mounts).
    pub(crate) fn refuse_memory_with_mounts(&self, id: &str) -> Result<(), ServiceError> {
        if !self.db.list_mounts(Some(id))?.is_empty() {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} has mounted buckets: a template with memory would capture their data; unmount them or save the disk only"
            )));
        }
        Ok(())
    }
}

async fn guest_mount(client: &AgentClient, row: &MountRow) -> Result<(), ServiceError> {
    let req = hearth_proto::MountRequest {
        path: row.path.clone(),
        server: hearth_net::GATEWAY,
        port: hearth_net::MOUNT_PORT,
        export: hearth_mount::export_name(row.export_key),
        read_only: row.read_only,
    };
    match tokio::time::timeout(AGENT_TIMEOUT, client.mount(req)).await {
        Err(_) => Err(ServiceError::AgentUnavailable(format!(
            "the guest did not mount {} in time",
            row.path
        ))),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(agent_error(e)),
    }
}

/// An agent that does not know `Mount` answers "unknown or malformed request".
fn agent_error(e: ClientError) -> ServiceError {
    match e {
        ClientError::Guest {
            kind: ErrorKind::InvalidRequest,
            message,
        } if message.contains("unknown or malformed request") => ServiceError::Typed(
            ErrorCode::AgentTooOld,
            "the sandbox's agent predates mounts (it was started from an older image or snapshot)".into(),
        ),
        e => e.into(),
    }
}

fn network_required() -> ServiceError {
    ServiceError::Typed(
        ErrorCode::NetworkRequired,
        "mounts are served on the sandbox's network, and networking is off on this daemon (hearthd --network)".into(),
    )
}

fn private_dir(dir: &std::path::Path) -> Result<(), ServiceError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| ServiceError::Internal(format!("creating {}: {e}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths() {
        for ok in ["/mnt/data", "/data", "/root/out", "/home/u/x", "/tmp/m", "/mnt"] {
            assert!(validate_path(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "mnt/data",
            "/",
            "/proc",
            "/proc/x",
            "/sys",
            "/dev/shm",
            "/etc",
            "/usr/local/x",
            "/root",
            "/tmp",
            "/mnt/../etc",
            "/mnt//x",
            "/mnt/x/",
            "/mnt/./x",
            "/mnt/a\nb",
        ] {
            assert!(validate_path(bad).is_err(), "{bad:?}");
        }
        assert!(
            overlaps("/mnt/a", "/mnt/a/b") && overlaps("/mnt/a", "/mnt/a") && !overlaps("/mnt/a", "/mnt/ab")
        );
        assert_eq!(join_prefix("a", "b/c"), "a/b/c");
        assert_eq!(join_prefix("", "b"), "b");
        assert_eq!(join_prefix("a", ""), "a");
    }
}
