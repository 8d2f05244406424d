//! Remote copies in the storage bucket (`--storage`): one row per object the daemon keeps there (a paused
//! sandbox's state, a snapshot, a saved template), with its sync state. A row is written `pending` after the
//! local copy is committed, becomes `synced` when the bucket holds that version, and `deleting` when the local
//! thing is gone and the remote object must go too; the row disappears once the bucket no longer holds it.

use rusqlite::{OptionalExtension, params};

use super::{Db, DbError};

/// The migration that creates the table (listed in [`super::MIGRATIONS`]).
pub const MIGRATION: &str = "CREATE TABLE remote_objects (
        name        TEXT PRIMARY KEY NOT NULL, -- object name in the store
        kind        TEXT NOT NULL,             -- pause | snapshot | template
        owner       TEXT NOT NULL,             -- sandbox id, snapshot id or template name
        state       TEXT NOT NULL,             -- pending | synced | deleting
        version     INTEGER NOT NULL,          -- which local copy (its commit time, ms)
        size_bytes  INTEGER NOT NULL,          -- logical size of the local copy
        sent_bytes  INTEGER NOT NULL,          -- bytes the last upload sent
        synced_at   INTEGER,                   -- ms, when the bucket got this version
        attempts    INTEGER NOT NULL,
        last_error  TEXT,
        updated_at  INTEGER NOT NULL,
        manifest_digest TEXT                   -- sha256 of the synced version's manifest: fetches accept only it
    );";

/// The migration that records the local cache's use of each object (`hearthd --cache-size`): when it was last
/// used, and when its local copy was evicted (it is fetched back on the next use).
pub const CACHE_MIGRATION: &str = "ALTER TABLE remote_objects ADD COLUMN last_used INTEGER; -- ms
    ALTER TABLE remote_objects ADD COLUMN evicted_at INTEGER; -- ms, local copy removed (NULL: local)";

/// What a remote row says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteState {
    /// The local copy is newer than the bucket's (uploading, or waiting for the bucket to come back).
    Pending,
    /// The bucket holds this version.
    Synced,
    /// The local thing is gone; its remote object is being removed.
    Deleting,
}

impl RemoteState {
    pub fn as_str(self) -> &'static str {
        match self {
            RemoteState::Pending => "pending",
            RemoteState::Synced => "synced",
            RemoteState::Deleting => "deleting",
        }
    }

    fn parse(s: &str) -> RemoteState {
        match s {
            "synced" => RemoteState::Synced,
            "deleting" => RemoteState::Deleting,
            _ => RemoteState::Pending,
        }
    }
}

/// One row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRow {
    pub name: String,
    pub kind: String,
    pub owner: String,
    pub state: RemoteState,
    pub version: i64,
    pub size_bytes: u64,
    pub sent_bytes: u64,
    pub synced_at_ms: Option<i64>,
    pub attempts: u32,
    pub last_error: Option<String>,
    /// The synced version's manifest digest: the bucket's copy is accepted back only if it matches.
    pub manifest_digest: Option<String>,
    /// When the object was last committed or used (ms): the local cache evicts the least recently used first.
    pub last_used_ms: i64,
    /// When its local copy was evicted (ms), until it is fetched or committed again.
    pub evicted_at_ms: Option<i64>,
}

const SELECT: &str = "SELECT name, kind, owner, state, version, size_bytes, sent_bytes, synced_at, attempts, \
                      last_error, manifest_digest, COALESCE(last_used, version), evicted_at FROM remote_objects";

fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<RemoteRow> {
    let state: String = r.get(3)?;
    let size: i64 = r.get(5)?;
    let sent: i64 = r.get(6)?;
    Ok(RemoteRow {
        name: r.get(0)?,
        kind: r.get(1)?,
        owner: r.get(2)?,
        state: RemoteState::parse(&state),
        version: r.get(4)?,
        size_bytes: u64::try_from(size).unwrap_or(0),
        sent_bytes: u64::try_from(sent).unwrap_or(0),
        synced_at_ms: r.get(7)?,
        attempts: r.get(8)?,
        last_error: r.get(9)?,
        manifest_digest: r.get(10)?,
        last_used_ms: r.get(11)?,
        evicted_at_ms: r.get(12)?,
    })
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Db {
    /// Records a new local version of `name` that the bucket does not hold yet.
    pub fn remote_pending(
        &self,
        name: &str,
        kind: &str,
        owner: &str,
        version: i64,
        size_bytes: u64,
        now: i64,
    ) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO remote_objects (name, kind, owner, state, version, size_bytes, sent_bytes, synced_at,
                                         attempts, last_error, updated_at)
             VALUES (?1, ?2, ?3, 'pending', ?4, ?5, 0, NULL, 0, NULL, ?6)
             ON CONFLICT (name) DO UPDATE SET kind = ?2, owner = ?3, state = 'pending', version = ?4,
                size_bytes = ?5, sent_bytes = 0, synced_at = NULL, attempts = 0, last_error = NULL, updated_at = ?6,
                last_used = ?6, evicted_at = NULL",
            params![name, kind, owner, version, i64_of(size_bytes), now],
        )?;
        Ok(())
    }

    /// Marks `name` synced, if the row still asks for `version` (a newer pause may have replaced it).
    pub fn remote_synced(
        &self,
        name: &str,
        version: i64,
        sent: u64,
        digest: &str,
        now: i64,
    ) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE remote_objects SET state = 'synced', sent_bytes = ?3, synced_at = ?4, last_error = NULL,
                updated_at = ?4, manifest_digest = ?5 WHERE name = ?1 AND version = ?2 AND state = 'pending'",
            params![name, version, i64_of(sent), now, digest],
        )?;
        Ok(n > 0)
    }

    /// Records a failed attempt (the row stays in its state and is tried again).
    pub fn remote_failed(&self, name: &str, error: &str, now: i64) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE remote_objects SET attempts = attempts + 1, last_error = ?2, updated_at = ?3 WHERE name = ?1",
            params![name, error, now],
        )?;
        Ok(())
    }

    /// Asks for the remote object `name` to be removed (kept as a row until the bucket confirms).
    pub fn remote_deleting(&self, name: &str, kind: &str, owner: &str, now: i64) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO remote_objects (name, kind, owner, state, version, size_bytes, sent_bytes, synced_at,
                                         attempts, last_error, updated_at)
             VALUES (?1, ?2, ?3, 'deleting', 0, 0, 0, NULL, 0, NULL, ?4)
             ON CONFLICT (name) DO UPDATE SET state = 'deleting', attempts = 0, last_error = NULL, updated_at = ?4",
            params![name, kind, owner, now],
        )?;
        Ok(())
    }

    /// Forgets `name` if it is (still) in `state`.
    pub fn remote_forget(&self, name: &str, state: RemoteState) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "DELETE FROM remote_objects WHERE name = ?1 AND state = ?2",
            params![name, state.as_str()],
        )?;
        Ok(n > 0)
    }

    /// Records a use of `name` (resume, create from, fork from) for the cache's LRU order.
    pub fn remote_touch(&self, name: &str, now: i64) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE remote_objects SET last_used = ?2 WHERE name = ?1",
            params![name, now],
        )?;
        Ok(())
    }

    /// Records whether `name`'s local copy is gone (`Some`: evicted at that time) or back (`None`: fetched).
    pub fn remote_set_evicted(&self, name: &str, at: Option<i64>) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE remote_objects SET evicted_at = ?2 WHERE name = ?1",
            params![name, at],
        )?;
        Ok(())
    }

    pub fn remote_get(&self, name: &str) -> Result<Option<RemoteRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!("{SELECT} WHERE name = ?1"))?;
        Ok(stmt.query_row(params![name], read).optional()?)
    }

    pub fn remote_list(&self) -> Result<Vec<RemoteRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!("{SELECT} ORDER BY name"))?;
        let rows = stmt.query_map([], read)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_pending_synced_deleting() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        db.remote_pending("sandboxes/a/pause", "pause", "a", 10, 100, 1)?;
        // A newer version replaced it while the older one uploaded: the older upload does not mark it synced.
        db.remote_pending("sandboxes/a/pause", "pause", "a", 11, 120, 2)?;
        assert!(!db.remote_synced("sandboxes/a/pause", 10, 5, "d10", 3)?);
        db.remote_failed("sandboxes/a/pause", "endpoint unreachable", 3)?;
        let row = db.remote_get("sandboxes/a/pause")?.expect("row");
        assert_eq!(
            (row.state, row.attempts, row.version),
            (RemoteState::Pending, 1, 11)
        );
        assert!(db.remote_synced("sandboxes/a/pause", 11, 7, "d11", 4)?);
        let row = db.remote_get("sandboxes/a/pause")?.expect("row");
        assert_eq!(
            (
                row.state,
                row.sent_bytes,
                row.synced_at_ms,
                row.manifest_digest.as_deref()
            ),
            (RemoteState::Synced, 7, Some(4), Some("d11"))
        );
        db.remote_deleting("sandboxes/a/pause", "pause", "a", 5)?;
        assert!(!db.remote_forget("sandboxes/a/pause", RemoteState::Synced)?);
        assert!(db.remote_forget("sandboxes/a/pause", RemoteState::Deleting)?);
        assert!(db.remote_list()?.is_empty());
        Ok(())
    }

    #[test]
    fn last_use_and_eviction_are_recorded() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        db.remote_pending("snapshots/s", "snapshot", "s", 10, 100, 11)?;
        // Never touched: the commit is the last use.
        assert_eq!(db.remote_get("snapshots/s")?.expect("row").last_used_ms, 10);
        db.remote_touch("snapshots/s", 50)?;
        db.remote_set_evicted("snapshots/s", Some(60))?;
        let row = db.remote_get("snapshots/s")?.expect("row");
        assert_eq!((row.last_used_ms, row.evicted_at_ms), (50, Some(60)));
        db.remote_set_evicted("snapshots/s", None)?;
        // A new version is local again and used now.
        db.remote_set_evicted("snapshots/s", Some(70))?;
        db.remote_pending("snapshots/s", "snapshot", "s", 80, 100, 81)?;
        let row = db.remote_get("snapshots/s")?.expect("row");
        assert_eq!((row.last_used_ms, row.evicted_at_ms), (81, None));
        Ok(())
    }
}
