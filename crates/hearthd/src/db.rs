//! The state database (SQLite in WAL mode): sandbox rows and the API key hash.
//!
//! Every mutating operation of the daemon writes its intent here before acting (a `creating` or `stopping` row),
//! so that a restart can finish or roll back whatever was in flight. Migrations are numbered by SQLite's
//! `user_version`. Usage intervals live in [`usage`].

pub mod boot_snapshots;
pub mod disk_sync;
pub mod mounts;
pub mod network;
pub mod remote;
pub mod snapshots;
pub mod tenancy;
pub mod usage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hearth_api::{OnTimeout, SandboxState};
use hearth_vmm::{SnapshotInfo, VmHandle, VmmKind};
use rusqlite::{Connection, OptionalExtension, params};

/// Schema migrations; `MIGRATIONS[i]` upgrades from `user_version` i to i + 1.
const MIGRATIONS: &[&str] = &[
    // 1: sandboxes and the API key hash.
    "CREATE TABLE sandboxes (
        id          TEXT PRIMARY KEY NOT NULL,
        state       TEXT NOT NULL,
        template    TEXT NOT NULL,
        vcpus       INTEGER NOT NULL,
        memory_mib  INTEGER NOT NULL,
        created_at  INTEGER NOT NULL,  -- unix milliseconds
        end_at      INTEGER NOT NULL,  -- unix milliseconds
        env         TEXT NOT NULL,     -- JSON object
        metadata    TEXT NOT NULL,     -- JSON object
        vmm         TEXT NOT NULL,
        handle      TEXT,              -- JSON hearth_vmm::VmHandle once started
        error       TEXT
    );
    CREATE TABLE api_key (
        id          INTEGER PRIMARY KEY CHECK (id = 1),
        sha256      BLOB NOT NULL,
        created_at  INTEGER NOT NULL
    );",
    // 2: pause/resume, lineage, usage intervals.
    "ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill';
    ALTER TABLE sandboxes ADD COLUMN timeout_s INTEGER NOT NULL DEFAULT 300;
    ALTER TABLE sandboxes ADD COLUMN parent_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN snapshot_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN paused TEXT;  -- JSON PausedState once a pause is committed
    ALTER TABLE sandboxes ADD COLUMN disk TEXT;    -- the sandbox's disk as prepare_disk returned it
    CREATE TABLE usage (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id  TEXT NOT NULL,
        kind        TEXT NOT NULL,     -- 'running' | 'paused'
        start_at    INTEGER NOT NULL,  -- unix milliseconds
        end_at      INTEGER,           -- NULL while open
        vcpus       INTEGER NOT NULL,
        memory_mib  INTEGER NOT NULL
    );
    CREATE INDEX usage_by_sandbox ON usage (sandbox_id, start_at);
    CREATE INDEX usage_by_time ON usage (start_at);",
    // 3: snapshot objects (checkpoints of running sandboxes; forks restore from them).
    "CREATE TABLE snapshots (
        id          TEXT PRIMARY KEY NOT NULL,
        sandbox_id  TEXT NOT NULL,
        created_at  INTEGER NOT NULL,  -- unix milliseconds
        size_bytes  INTEGER NOT NULL,
        template    TEXT NOT NULL,
        vcpus       INTEGER NOT NULL,
        memory_mib  INTEGER NOT NULL,
        env         TEXT NOT NULL      -- JSON object: the source's environment, inherited by its restores
    );",
    // 4: templates saved from sandboxes.
    "CREATE TABLE templates (
        name         TEXT PRIMARY KEY NOT NULL,
        from_sandbox TEXT NOT NULL,
        snapshot_id  TEXT,              -- with memory: the snapshot its sandboxes restore from
        created_at   INTEGER NOT NULL,
        size_bytes   INTEGER NOT NULL
    );",
    // 5: sandbox networking: each sandbox's address, name and egress policy; private networks.
    "CREATE TABLE sandbox_net (
        sandbox_id  TEXT PRIMARY KEY NOT NULL,
        address     TEXT NOT NULL UNIQUE,  -- the sandbox's address in the sandbox range
        name        TEXT UNIQUE,           -- optional DNS name among its private-network peers
        policy      TEXT NOT NULL          -- JSON hearth_api::EgressPolicy
    );
    CREATE TABLE networks (
        id          TEXT PRIMARY KEY NOT NULL,
        name        TEXT NOT NULL UNIQUE,
        created_at  INTEGER NOT NULL
    );
    CREATE TABLE network_members (
        network_id  TEXT NOT NULL REFERENCES networks (id),
        sandbox_id  TEXT NOT NULL,
        PRIMARY KEY (network_id, sandbox_id)
    );
    CREATE INDEX members_by_sandbox ON network_members (sandbox_id);",
    // 6: buckets (named credentials, secret sealed under the daemon's key) and the mounts of them.
    "CREATE TABLE buckets (
        name        TEXT PRIMARY KEY NOT NULL,
        bucket      TEXT NOT NULL,
        prefix      TEXT NOT NULL,     -- '' for the whole bucket
        endpoint    TEXT,
        region      TEXT NOT NULL,
        path_style  INTEGER NOT NULL,
        key_hint    TEXT NOT NULL,     -- last four characters of the access key id
        sealed      BLOB NOT NULL,     -- nonce | XChaCha20-Poly1305(credentials JSON), AAD = name
        created_at  INTEGER NOT NULL
    );
    CREATE TABLE mounts (
        sandbox_id  TEXT NOT NULL,
        path        TEXT NOT NULL,
        bucket      TEXT NOT NULL,
        prefix      TEXT NOT NULL,     -- under the bucket's prefix
        read_only   INTEGER NOT NULL,
        export_key  INTEGER NOT NULL,  -- names the export and keys its file ids; forks keep it
        PRIMARY KEY (sandbox_id, path)
    );
    CREATE TABLE snapshot_mounts (
        snapshot_id TEXT NOT NULL,
        path        TEXT NOT NULL,
        bucket      TEXT NOT NULL,
        prefix      TEXT NOT NULL,
        read_only   INTEGER NOT NULL,
        export_key  INTEGER NOT NULL,
        PRIMARY KEY (snapshot_id, path)
    );
    CREATE TABLE mount_usage (
        sandbox_id    TEXT PRIMARY KEY NOT NULL,
        bytes_read    INTEGER NOT NULL,
        bytes_written INTEGER NOT NULL
    );",
    // 7: where paused states, snapshots and templates are in the storage bucket (`--storage`).
    remote::MIGRATION,
    // 8: projects, scoped keys, object owners, the audit chain (db/tenancy.rs).
    tenancy::MIGRATION,
    // 9: disk syncs of running sandboxes to the storage bucket (db/disk_sync.rs).
    disk_sync::MIGRATION,
    // 10: the generation of each exposed port's tokens (bumped to revoke them: db/network.rs).
    network::PORT_TOKENS_MIGRATION,
    // 11: the local cache's last use and evictions of stored objects (db/remote.rs, `--cache-size`).
    remote::CACHE_MIGRATION,
    // 12: boot snapshots of warm creates (db/boot_snapshots.rs).
    boot_snapshots::MIGRATION,
    // 13: when each boot snapshot was last restored (`--boot-snapshots-max` retires the least recent).
    boot_snapshots::USED_AT_MIGRATION,
];

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("database migration to version {version}: {source}")]
    Migrate { version: usize, source: rusqlite::Error },
    #[error("database schema version {found} is newer than this hearthd understands ({known})")]
    TooNew { found: i64, known: usize },
    #[error("database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("database row {id}: bad {column}: {detail}")]
    Corrupt {
        id: String,
        column: &'static str,
        detail: String,
    },
}

/// One sandbox as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    pub state: SandboxState,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub created_at_ms: i64,
    pub end_at_ms: i64,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub vmm: VmmKind,
    pub handle: Option<VmHandle>,
    pub error: Option<String>,
    pub auto_resume: bool,
    pub on_timeout: OnTimeout,
    /// The TTL asked at create time, applied again on every resume.
    pub timeout_s: u64,
    pub parent_id: Option<String>,
    pub snapshot_id: Option<String>,
    /// The committed paused state (set while `paused` or `resuming`).
    pub paused: Option<PausedState>,
    /// The sandbox's own disk (set once prepared).
    pub disk: Option<PathBuf>,
}

/// A committed pause: where its files are and what the driver wrote.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PausedState {
    /// Directory name under the sandbox directory.
    pub dir: String,
    pub info: SnapshotInfo,
    pub size_bytes: u64,
}

/// The database. Statements are short; one connection behind a mutex is enough.
pub struct Db {
    conn: Mutex<Connection>,
}

impl Db {
    /// Opens (creating if needed) and migrates the database at `path`.
    pub fn open(path: &Path) -> Result<Db, DbError> {
        let conn = Connection::open(path).map_err(|source| DbError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Self::init(conn)
    }

    /// An in-memory database (tests).
    pub fn open_in_memory() -> Result<Db, DbError> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(mut conn: Connection) -> Result<Db, DbError> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        migrate(&mut conn)?;
        Ok(Db {
            conn: Mutex::new(conn),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite in a torn state (statements are atomic).
        self.conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn schema_version(&self) -> Result<i64, DbError> {
        Ok(self.lock().query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    pub fn api_key_hash(&self) -> Result<Option<[u8; 32]>, DbError> {
        let blob: Option<Vec<u8>> = self
            .lock()
            .query_row("SELECT sha256 FROM api_key WHERE id = 1", [], |r| r.get(0))
            .optional()?;
        Ok(blob.and_then(|b| <[u8; 32]>::try_from(b.as_slice()).ok()))
    }

    pub fn set_api_key_hash(&self, hash: &[u8; 32], now_ms: i64) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO api_key (id, sha256, created_at) VALUES (1, ?1, ?2)
             ON CONFLICT (id) DO UPDATE SET sha256 = excluded.sha256, created_at = excluded.created_at",
            params![hash.as_slice(), now_ms],
        )?;
        Ok(())
    }

    pub fn insert(&self, row: &SandboxRow) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO sandboxes (id, state, template, vcpus, memory_mib, created_at, end_at, env, metadata, vmm,
                                    handle, error, auto_resume, on_timeout, timeout_s, parent_id, snapshot_id, paused, disk)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
            params![
                row.id,
                row.state.as_str(),
                row.template,
                row.vcpus,
                row.memory_mib,
                row.created_at_ms,
                row.end_at_ms,
                to_json(&row.env),
                to_json(&row.metadata),
                row.vmm.as_str(),
                row.handle.as_ref().map(to_json),
                row.error,
                row.auto_resume,
                row.on_timeout.as_str(),
                i64::try_from(row.timeout_s).unwrap_or(i64::MAX),
                row.parent_id,
                row.snapshot_id,
                row.paused.as_ref().map(to_json),
                row.disk.as_ref().map(|d| d.to_string_lossy().into_owned()),
            ],
        )?;
        Ok(())
    }

    pub fn get(&self, id: &str) -> Result<Option<SandboxRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!("{SELECT} WHERE id = ?1"))?;
        let raw = stmt.query_row(params![id], RawRow::read).optional()?;
        raw.map(RawRow::parse).transpose()
    }

    pub fn list(&self) -> Result<Vec<SandboxRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!("{SELECT} ORDER BY created_at, id"))?;
        let raws = stmt.query_map([], RawRow::read)?.collect::<Result<Vec<_>, _>>()?;
        raws.into_iter().map(RawRow::parse).collect()
    }

    /// One page of sandboxes in id order, filtered in SQL so that a page costs what it returns, not what the
    /// host holds: ids after `f.after`, in `f.state`, owned by `f.project`, whose metadata has every pair of
    /// `f.metadata`; at most `f.limit` rows.
    pub fn list_page(&self, f: &ListFilter<'_>) -> Result<Vec<SandboxRow>, DbError> {
        use rusqlite::types::Value as V;
        let mut sql = format!("{SELECT} WHERE id > ?1");
        let mut args: Vec<V> = vec![V::Text(f.after.unwrap_or("").to_string())];
        if let Some(state) = f.state {
            args.push(V::Text(state.to_string()));
            sql += &format!(" AND state = ?{}", args.len());
        }
        if let Some(project) = f.project {
            args.push(V::Text(project.to_string()));
            sql += &format!(
                " AND id IN (SELECT key FROM owners WHERE kind = 'sandbox' AND project = ?{})",
                args.len()
            );
        }
        for (k, v) in f.metadata {
            args.push(V::Text((*k).to_string()));
            args.push(V::Text((*v).to_string()));
            let (ki, vi) = (args.len() - 1, args.len());
            sql += &format!(
                " AND EXISTS (SELECT 1 FROM json_each(sandboxes.metadata) m WHERE m.key = ?{ki} AND m.value = ?{vi})"
            );
        }
        args.push(V::Integer(i64::try_from(f.limit).unwrap_or(i64::MAX)));
        sql += &format!(" ORDER BY id LIMIT ?{}", args.len());
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&sql)?;
        let raws = stmt
            .query_map(rusqlite::params_from_iter(args), RawRow::read)?
            .collect::<Result<Vec<_>, _>>()?;
        raws.into_iter().map(RawRow::parse).collect()
    }

    /// Sets the state (and the error, cleared when `None`). Returns false when the row does not exist.
    pub fn set_state(&self, id: &str, state: SandboxState, error: Option<&str>) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE sandboxes SET state = ?2, error = ?3 WHERE id = ?1",
            params![id, state.as_str(), error],
        )?;
        Ok(n == 1)
    }

    /// Moves a row from `from` to `to` only if it is in `from`. Returns whether it moved.
    pub fn transition(&self, id: &str, from: SandboxState, to: SandboxState) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE sandboxes SET state = ?3 WHERE id = ?1 AND state = ?2",
            params![id, from.as_str(), to.as_str()],
        )?;
        Ok(n == 1)
    }

    pub fn set_handle(&self, id: &str, handle: &VmHandle) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE sandboxes SET handle = ?2 WHERE id = ?1",
            params![id, to_json(handle)],
        )?;
        Ok(())
    }

    /// Commits a pause: state `paused`, the paused state recorded, the VM handle cleared (no process is left).
    pub fn commit_pause(&self, id: &str, paused: &PausedState) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE sandboxes SET state = 'paused', paused = ?2, handle = NULL, error = NULL WHERE id = ?1",
            params![id, to_json(paused)],
        )?;
        Ok(n == 1)
    }

    /// Commits a resume: state `running`, the new VM handle, the paused state cleared, a new `end_at`.
    pub fn commit_resume(&self, id: &str, handle: &VmHandle, end_at_ms: i64) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE sandboxes SET state = 'running', paused = NULL, handle = ?2, end_at = ?3, error = NULL
             WHERE id = ?1",
            params![id, to_json(handle), end_at_ms],
        )?;
        Ok(n == 1)
    }

    pub fn set_disk(&self, id: &str, disk: &Path) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE sandboxes SET disk = ?2 WHERE id = ?1",
            params![id, disk.to_string_lossy()],
        )?;
        Ok(())
    }

    /// Clears the VM handle (the process is known to be gone).
    pub fn clear_handle(&self, id: &str) -> Result<(), DbError> {
        self.lock()
            .execute("UPDATE sandboxes SET handle = NULL WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Sets `end_at`. Returns false when the row does not exist.
    pub fn set_end_at(&self, id: &str, end_at_ms: i64) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE sandboxes SET end_at = ?2 WHERE id = ?1",
            params![id, end_at_ms],
        )?;
        Ok(n == 1)
    }

    pub fn delete(&self, id: &str) -> Result<bool, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        // The sandbox's network identity and memberships go with it.
        tx.execute("DELETE FROM sandbox_net WHERE sandbox_id = ?1", params![id])?;
        tx.execute("DELETE FROM network_members WHERE sandbox_id = ?1", params![id])?;
        tx.execute("DELETE FROM mounts WHERE sandbox_id = ?1", params![id])?;
        tx.execute("DELETE FROM disk_syncs WHERE sandbox_id = ?1", params![id])?;
        tx.execute("DELETE FROM port_tokens WHERE sandbox_id = ?1", params![id])?;
        let n = tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        tx.commit()?;
        Ok(n == 1)
    }

    /// Sandboxes whose TTL has passed at `now_ms`, with what the TTL does to each: running ones per their
    /// `on_timeout`, failed ones are destroyed. Paused sandboxes do not expire (they use no compute; a resume
    /// starts a new TTL). A `creating` row belongs to its create task, a `stopping`, `pausing` or `resuming` one
    /// to the operation in flight.
    pub fn expired(&self, now_ms: i64) -> Result<Vec<(String, OnTimeout)>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT id, state, on_timeout FROM sandboxes WHERE end_at <= ?1
             AND state IN ('running', 'failed') ORDER BY end_at",
        )?;
        let rows = stmt
            .query_map(params![now_ms], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows
            .into_iter()
            .map(|(id, state, on)| {
                let action = match (state.as_str(), OnTimeout::parse(&on)) {
                    ("running", Some(OnTimeout::Pause)) => OnTimeout::Pause,
                    _ => OnTimeout::Kill,
                };
                (id, action)
            })
            .collect())
    }
}

const SELECT: &str = "SELECT id, state, template, vcpus, memory_mib, created_at, end_at, env, metadata, vmm, handle, \
                      error, auto_resume, on_timeout, timeout_s, parent_id, snapshot_id, paused, disk FROM sandboxes";

/// Filters of [`Db::list_page`].
#[derive(Debug, Default)]
pub struct ListFilter<'a> {
    pub after: Option<&'a str>,
    pub state: Option<&'a str>,
    pub project: Option<&'a str>,
    pub metadata: &'a [(&'a str, &'a str)],
    pub limit: usize,
}

/// A row as SQLite returns it, before the JSON and enum columns are parsed.
struct RawRow {
    id: String,
    state: String,
    template: String,
    vcpus: u32,
    memory_mib: u32,
    created_at_ms: i64,
    end_at_ms: i64,
    env: String,
    metadata: String,
    vmm: String,
    handle: Option<String>,
    error: Option<String>,
    auto_resume: bool,
    on_timeout: String,
    timeout_s: i64,
    parent_id: Option<String>,
    snapshot_id: Option<String>,
    paused: Option<String>,
    disk: Option<String>,
}

impl RawRow {
    fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
        Ok(RawRow {
            id: r.get(0)?,
            state: r.get(1)?,
            template: r.get(2)?,
            vcpus: r.get(3)?,
            memory_mib: r.get(4)?,
            created_at_ms: r.get(5)?,
            end_at_ms: r.get(6)?,
            env: r.get(7)?,
            metadata: r.get(8)?,
            vmm: r.get(9)?,
            handle: r.get(10)?,
            error: r.get(11)?,
            auto_resume: r.get(12)?,
            on_timeout: r.get(13)?,
            timeout_s: r.get(14)?,
            parent_id: r.get(15)?,
            snapshot_id: r.get(16)?,
            paused: r.get(17)?,
            disk: r.get(18)?,
        })
    }

    fn parse(self) -> Result<SandboxRow, DbError> {
        let id = self.id;
        let corrupt = |column, detail: String| DbError::Corrupt {
            id: id.clone(),
            column,
            detail,
        };
        let state = SandboxState::parse(&self.state).ok_or_else(|| corrupt("state", self.state.clone()))?;
        let vmm = serde_json::from_value(serde_json::Value::String(self.vmm.clone()))
            .map_err(|e| corrupt("vmm", e.to_string()))?;
        let env = serde_json::from_str(&self.env).map_err(|e| corrupt("env", e.to_string()))?;
        let metadata =
            serde_json::from_str(&self.metadata).map_err(|e| corrupt("metadata", e.to_string()))?;
        let handle = match self.handle {
            Some(h) => Some(serde_json::from_str(&h).map_err(|e| corrupt("handle", e.to_string()))?),
            None => None,
        };
        let on_timeout = OnTimeout::parse(&self.on_timeout)
            .ok_or_else(|| corrupt("on_timeout", self.on_timeout.clone()))?;
        let paused = match self.paused {
            Some(p) => Some(serde_json::from_str(&p).map_err(|e| corrupt("paused", e.to_string()))?),
            None => None,
        };
        Ok(SandboxRow {
            id: id.clone(),
            state,
            template: self.template,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            created_at_ms: self.created_at_ms,
            end_at_ms: self.end_at_ms,
            env,
            metadata,
            vmm,
            handle,
            error: self.error,
            auto_resume: self.auto_resume,
            on_timeout,
            timeout_s: u64::try_from(self.timeout_s).unwrap_or(0),
            parent_id: self.parent_id,
            snapshot_id: self.snapshot_id,
            paused,
            disk: self.disk.map(PathBuf::from),
        })
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    // Maps of strings and plain structs always serialize.
    serde_json::to_string(value).unwrap_or_else(|_| "null".to_string())
}

fn migrate(conn: &mut Connection) -> Result<(), DbError> {
    let found: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if found < 0 || found as usize > MIGRATIONS.len() {
        return Err(DbError::TooNew {
            found,
            known: MIGRATIONS.len(),
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let version = i + 1;
        let tx = conn
            .transaction()
            .map_err(|source| DbError::Migrate { version, source })?;
        tx.execute_batch(sql)
            .map_err(|source| DbError::Migrate { version, source })?;
        tx.pragma_update(None, "user_version", version as i64)
            .map_err(|source| DbError::Migrate { version, source })?;
        tx.commit()
            .map_err(|source| DbError::Migrate { version, source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn row(id: &str) -> SandboxRow {
        SandboxRow {
            id: id.to_string(),
            state: SandboxState::Creating,
            template: "minimal".into(),
            vcpus: 1,
            memory_mib: 256,
            created_at_ms: 1_000,
            end_at_ms: 5_000,
            env: BTreeMap::from([("A".into(), "1".into())]),
            metadata: BTreeMap::from([("k".into(), "v".into())]),
            vmm: VmmKind::Qemu,
            handle: None,
            error: None,
            auto_resume: true,
            on_timeout: OnTimeout::Kill,
            timeout_s: 4,
            parent_id: None,
            snapshot_id: None,
            paused: None,
            disk: None,
        }
    }

    #[test]
    fn migrates_to_latest_and_reopens() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.db");
        {
            let db = Db::open(&path)?;
            assert_eq!(db.schema_version()?, MIGRATIONS.len() as i64);
            db.insert(&row("sbx_0000000000000001"))?;
        }
        let db = Db::open(&path)?;
        assert_eq!(db.schema_version()?, MIGRATIONS.len() as i64);
        assert_eq!(db.list()?.len(), 1);
        let mode: String = db.lock().query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        assert_eq!(mode, "wal");
        Ok(())
    }

    #[test]
    fn refuses_a_newer_schema() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.db");
        {
            let conn = Connection::open(&path)?;
            conn.pragma_update(None, "user_version", 99)?;
        }
        assert!(matches!(Db::open(&path), Err(DbError::TooNew { found: 99, .. })));
        Ok(())
    }

    #[test]
    fn row_round_trip_and_state_changes() -> Result<(), Box<dyn std::error::Error>> {
        let db = Db::open_in_memory()?;
        let mut r = row("sbx_00000000000000aa");
        db.insert(&r)?;
        let handle = VmHandle {
            kind: VmmKind::Qemu,
            pid: 42,
            start_ticks: 7,
            run_dir: PathBuf::from("/tmp/x"),
        };
        db.set_handle(&r.id, &handle)?;
        assert!(db.transition(&r.id, SandboxState::Creating, SandboxState::Running)?);
        assert!(!db.transition(&r.id, SandboxState::Creating, SandboxState::Running)?);
        r.handle = Some(handle);
        r.state = SandboxState::Running;
        assert_eq!(db.get(&r.id)?, Some(r.clone()));
        assert!(db.expired(4_999)?.is_empty());
        assert_eq!(db.expired(5_000)?, vec![(r.id.clone(), OnTimeout::Kill)]);
        db.insert(&row("sbx_00000000000000bb"))?;
        assert_eq!(
            db.expired(9_000)?,
            vec![(r.id.clone(), OnTimeout::Kill)],
            "creating rows are not reaped"
        );
        assert!(db.set_state(&r.id, SandboxState::Failed, Some("boom"))?);
        assert_eq!(db.get(&r.id)?.and_then(|r| r.error), Some("boom".into()));
        assert!(db.delete(&r.id)?);
        assert_eq!(db.get(&r.id)?, None);
        Ok(())
    }

    #[test]
    fn api_key_hash_is_stored_alone() -> Result<(), Box<dyn std::error::Error>> {
        let db = Db::open_in_memory()?;
        assert_eq!(db.api_key_hash()?, None);
        db.set_api_key_hash(&[7u8; 32], 1)?;
        db.set_api_key_hash(&[8u8; 32], 2)?;
        assert_eq!(db.api_key_hash()?, Some([8u8; 32]));
        Ok(())
    }
}
