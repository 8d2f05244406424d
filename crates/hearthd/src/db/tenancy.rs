//! Tenancy rows: projects, scoped API keys (hashed), which project owns each object (`owners`), and the
//! append-only audit log (`audit`, a hash chain; UPDATE and DELETE are refused by triggers).
//!
//! Ownership is kept beside the objects' own tables instead of in them: an object is named by its kind and the
//! key its routes use (a network by both its id and its name; `object` groups those rows). Rows are written
//! when a create answers and removed when a delete does; a stale row of a gone object is harmless (ids are
//! random, and names are freed by the delete that removes the row).

use hearth_api::{AUDIT_GENESIS, AuditEntry, Quota, Role};
use rusqlite::{OptionalExtension, params};

use super::{Db, DbError};

/// Migration 7 (see `MIGRATIONS` in `db.rs`): every existing object goes to project `default`.
pub const MIGRATION: &str = "CREATE TABLE projects (
        name        TEXT PRIMARY KEY NOT NULL,
        created_at  INTEGER NOT NULL,
        quota       TEXT NOT NULL DEFAULT '{}'  -- JSON hearth_api::Quota
    );
    INSERT INTO projects (name, created_at) VALUES ('default', 0);
    CREATE TABLE api_keys (
        id           TEXT PRIMARY KEY NOT NULL,
        sha256       BLOB NOT NULL UNIQUE,
        project      TEXT NOT NULL REFERENCES projects (name),
        role         TEXT NOT NULL,
        name         TEXT,
        created_at   INTEGER NOT NULL,
        expires_at   INTEGER,
        last_used_at INTEGER,
        revoked_at   INTEGER
    );
    CREATE TABLE owners (
        kind     TEXT NOT NULL,  -- sandbox | snapshot | template | network | bucket
        key      TEXT NOT NULL,  -- what the routes name it by
        object   TEXT NOT NULL,  -- the object's canonical id (groups a network's id and name rows)
        project  TEXT NOT NULL,
        PRIMARY KEY (kind, key)
    );
    CREATE INDEX owners_by_project ON owners (project, kind);
    INSERT INTO owners SELECT 'sandbox', id, id, 'default' FROM sandboxes;
    INSERT INTO owners SELECT 'snapshot', id, id, 'default' FROM snapshots;
    INSERT INTO owners SELECT 'template', name, name, 'default' FROM templates;
    INSERT INTO owners SELECT 'network', id, id, 'default' FROM networks;
    INSERT INTO owners SELECT 'network', name, id, 'default' FROM networks;
    INSERT INTO owners SELECT 'bucket', name, name, 'default' FROM buckets;
    CREATE TABLE audit (
        seq         INTEGER PRIMARY KEY NOT NULL,
        at_ms       INTEGER NOT NULL,
        key_id      TEXT NOT NULL,
        project     TEXT NOT NULL,
        role        TEXT NOT NULL,
        action      TEXT NOT NULL,
        target      TEXT NOT NULL,
        status      INTEGER NOT NULL,
        source      TEXT NOT NULL,
        request_id  TEXT NOT NULL,
        prev_hash   TEXT NOT NULL,
        hash        TEXT NOT NULL
    );
    CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
    CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;";

/// A key as stored (never the key itself).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRow {
    pub id: String,
    pub project: String,
    pub role: Role,
    pub name: Option<String>,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub last_used_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
}

/// A project as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectRow {
    pub name: String,
    pub created_at_ms: i64,
    pub quota: Quota,
}

/// What a project's sandboxes hold now (creating, running, pausing or resuming).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub running: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
}

/// Filters of [`Db::audit_page`].
#[derive(Debug, Clone, Default)]
pub struct AuditFilter {
    pub after: u64,
    pub limit: u32,
    pub project: Option<String>,
    pub key_id: Option<String>,
    pub since_ms: Option<i64>,
}

const KEY_COLUMNS: &str = "id, project, role, name, created_at, expires_at, last_used_at, revoked_at";

fn key_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRow> {
    let role: String = r.get(2)?;
    Ok(KeyRow {
        id: r.get(0)?,
        project: r.get(1)?,
        // A role this build does not know reads as the least privileged.
        role: Role::parse(&role).unwrap_or(Role::Viewer),
        name: r.get(3)?,
        created_at_ms: r.get(4)?,
        expires_at_ms: r.get(5)?,
        last_used_at_ms: r.get(6)?,
        revoked_at_ms: r.get(7)?,
    })
}

fn audit_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<AuditEntry> {
    Ok(AuditEntry {
        seq: r.get::<_, i64>(0)? as u64,
        at_ms: r.get(1)?,
        key_id: r.get(2)?,
        project: r.get(3)?,
        role: r.get(4)?,
        action: r.get(5)?,
        target: r.get(6)?,
        status: r.get::<_, i64>(7)? as u16,
        source: r.get(8)?,
        request_id: r.get(9)?,
        prev_hash: r.get(10)?,
        hash: r.get(11)?,
    })
}

impl Db {
    pub fn create_project(&self, name: &str, quota: &Quota, now_ms: i64) -> Result<bool, DbError> {
        let quota = super::to_json(quota);
        let n = self.lock().execute(
            "INSERT INTO projects (name, created_at, quota) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            params![name, now_ms, quota],
        )?;
        Ok(n == 1)
    }

    pub fn set_quota(&self, name: &str, quota: &Quota) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE projects SET quota = ?2 WHERE name = ?1",
            params![name, super::to_json(quota)],
        )?;
        Ok(n == 1)
    }

    pub fn projects(&self) -> Result<Vec<ProjectRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT name, created_at, quota FROM projects ORDER BY name")?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get(1)?, r.get::<_, String>(2)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter()
            .map(|(name, created_at_ms, quota)| {
                let quota = serde_json::from_str(&quota).map_err(|e| DbError::Corrupt {
                    id: name.clone(),
                    column: "quota",
                    detail: e.to_string(),
                })?;
                Ok(ProjectRow {
                    name,
                    created_at_ms,
                    quota,
                })
            })
            .collect()
    }

    pub fn project(&self, name: &str) -> Result<Option<ProjectRow>, DbError> {
        Ok(self.projects()?.into_iter().find(|p| p.name == name))
    }

    pub fn insert_key(&self, row: &KeyRow, sha256: &[u8; 32]) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO api_keys (id, sha256, project, role, name, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                row.id,
                sha256.as_slice(),
                row.project,
                row.role.as_str(),
                row.name,
                row.created_at_ms,
                row.expires_at_ms
            ],
        )?;
        Ok(())
    }

    /// The key whose hash is `sha256`, if any (revoked and expired ones too: the caller decides).
    pub fn key_by_hash(&self, sha256: &[u8; 32]) -> Result<Option<KeyRow>, DbError> {
        let sql = format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE sha256 = ?1");
        Ok(self
            .lock()
            .query_row(&sql, params![sha256.as_slice()], key_row)
            .optional()?)
    }

    /// The key with id `id`, if any (revoked and expired ones too: the caller decides).
    pub fn key_by_id(&self, id: &str) -> Result<Option<KeyRow>, DbError> {
        let sql = format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = ?1");
        Ok(self.lock().query_row(&sql, params![id], key_row).optional()?)
    }

    pub fn keys(&self) -> Result<Vec<KeyRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"
        ))?;
        let rows = stmt.query_map([], key_row)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Revokes a key; false when there is no such key or it was revoked before.
    pub fn revoke_key(&self, id: &str, now_ms: i64) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
            params![id, now_ms],
        )?;
        Ok(n == 1)
    }

    /// Records a use, at most once a minute per key (a write per request would serialise every request).
    pub fn touch_key(&self, id: &str, now_ms: i64) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE api_keys SET last_used_at = ?2
             WHERE id = ?1 AND (last_used_at IS NULL OR last_used_at < ?2 - 60000)",
            params![id, now_ms],
        )?;
        Ok(())
    }

    /// The project owning `kind`/`key`, if it is recorded.
    pub fn owner(&self, kind: &str, key: &str) -> Result<Option<String>, DbError> {
        Ok(self
            .lock()
            .query_row(
                "SELECT project FROM owners WHERE kind = ?1 AND key = ?2",
                params![kind, key],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Records that `project` owns the object `object`, named `keys` in routes (replacing stale rows).
    pub fn set_owner(&self, kind: &str, object: &str, keys: &[&str], project: &str) -> Result<(), DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        for key in keys {
            tx.execute(
                "INSERT INTO owners (kind, key, object, project) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (kind, key) DO UPDATE SET object = excluded.object, project = excluded.project",
                params![kind, key, object, project],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The keys (route names) of the `kind` objects `project` owns, live or not.
    pub fn owned_keys(&self, project: &str, kind: &str) -> Result<Vec<String>, DbError> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare("SELECT key FROM owners WHERE project = ?1 AND kind = ?2 ORDER BY key")?;
        let keys = stmt
            .query_map(params![project, kind], |r| r.get(0))?
            .collect::<Result<Vec<String>, _>>()?;
        Ok(keys)
    }

    /// Forgets the object named `key` (and its other names).
    pub fn remove_owner(&self, kind: &str, key: &str) -> Result<(), DbError> {
        self.lock().execute(
            "DELETE FROM owners WHERE kind = ?1
             AND object = (SELECT object FROM owners WHERE kind = ?1 AND key = ?2)",
            params![kind, key],
        )?;
        Ok(())
    }

    /// Whether the templates table has `name` (a saved template, as opposed to a built-in one).
    pub fn is_saved_template(&self, name: &str) -> Result<bool, DbError> {
        Ok(self
            .lock()
            .query_row("SELECT 1 FROM templates WHERE name = ?1", params![name], |_| {
                Ok(())
            })
            .optional()?
            .is_some())
    }

    /// What `project`'s live sandboxes hold.
    pub fn held(&self, project: &str) -> Result<Held, DbError> {
        let (running, vcpus, memory_mib): (i64, i64, i64) = self.lock().query_row(
            "SELECT count(*), coalesce(sum(s.vcpus), 0), coalesce(sum(s.memory_mib), 0)
             FROM sandboxes s JOIN owners o ON o.kind = 'sandbox' AND o.key = s.id
             WHERE o.project = ?1 AND s.state IN ('creating', 'running', 'pausing', 'resuming')",
            params![project],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        Ok(Held {
            running: running.max(0) as u64,
            vcpus: vcpus.max(0) as u64,
            memory_mib: memory_mib.max(0) as u64,
        })
    }

    /// Credits `project`'s sandboxes have spent up to `now_ms`: every running interval of every sandbox it
    /// owns or owned (owner rows of destroyed sandboxes are kept for this), at `per_vcpu_s` per vCPU-second
    /// and `per_gib_s` per GiB-second.
    pub fn spent_credits(
        &self,
        project: &str,
        per_vcpu_s: f64,
        per_gib_s: f64,
        now_ms: i64,
    ) -> Result<f64, DbError> {
        Ok(self.lock().query_row(
            "SELECT coalesce(sum(max(coalesce(u.end_at, ?4) - u.start_at, 0) / 1000.0
                                 * (u.vcpus * ?2 + u.memory_mib / 1024.0 * ?3)), 0.0)
             FROM usage u JOIN owners o ON o.kind = 'sandbox' AND o.key = u.sandbox_id
             WHERE o.project = ?1 AND u.kind = 'running'",
            params![project, per_vcpu_s, per_gib_s, now_ms],
            |r| r.get(0),
        )?)
    }

    /// Ids of `project`'s sandboxes in any of `states`.
    pub fn project_sandboxes(&self, project: &str, states: &[&str]) -> Result<Vec<String>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT s.id, s.state FROM sandboxes s JOIN owners o ON o.kind = 'sandbox' AND o.key = s.id
             WHERE o.project = ?1 ORDER BY s.id",
        )?;
        let rows = stmt.query_map(params![project], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })?;
        let mut ids = Vec::new();
        for row in rows {
            let (id, state) = row?;
            if states.contains(&state.as_str()) {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// Appends one entry to the audit chain (sequence, previous hash and hash filled in here, under the lock,
    /// so concurrent appends cannot fork the chain). Returns the entry as stored.
    pub fn append_audit(&self, mut e: AuditEntry) -> Result<AuditEntry, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let last: Option<(i64, String)> = tx
            .query_row("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        let (seq, prev) = last.map_or((1, AUDIT_GENESIS.to_string()), |(s, h)| (s + 1, h));
        e.seq = seq as u64;
        e.prev_hash = prev;
        e.hash = hearth_api::audit_hash(&e);
        tx.execute(
            "INSERT INTO audit (seq, at_ms, key_id, project, role, action, target, status, source, request_id,
                                prev_hash, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            params![
                seq,
                e.at_ms,
                e.key_id,
                e.project,
                e.role,
                e.action,
                e.target,
                e.status,
                e.source,
                e.request_id,
                e.prev_hash,
                e.hash
            ],
        )?;
        tx.commit()?;
        Ok(e)
    }

    /// Entries after `after` in order, filtered.
    pub fn audit_page(&self, f: &AuditFilter) -> Result<Vec<AuditEntry>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT seq, at_ms, key_id, project, role, action, target, status, source, request_id, prev_hash,
                    hash
             FROM audit
             WHERE seq > ?1 AND (?2 IS NULL OR project = ?2) AND (?3 IS NULL OR key_id = ?3)
               AND (?4 IS NULL OR at_ms >= ?4)
             ORDER BY seq LIMIT ?5",
        )?;
        let rows = stmt
            .query_map(
                params![f.after as i64, f.project, f.key_id, f.since_ms, f.limit],
                audit_row,
            )?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: &str) -> AuditEntry {
        AuditEntry {
            seq: 0,
            at_ms: 7,
            key_id: "bootstrap".into(),
            project: "default".into(),
            role: "admin".into(),
            action: action.into(),
            target: "/v1/x".into(),
            status: 200,
            source: "127.0.0.1:1".into(),
            request_id: "req_1".into(),
            prev_hash: String::new(),
            hash: String::new(),
        }
    }

    #[test]
    fn audit_appends_a_chain_and_refuses_updates() -> Result<(), Box<dyn std::error::Error>> {
        let db = Db::open_in_memory()?;
        for i in 0..5 {
            db.append_audit(entry(&format!("POST /v1/{i}")))?;
        }
        let all = db.audit_page(&AuditFilter {
            limit: 100,
            ..Default::default()
        })?;
        assert_eq!(all.len(), 5);
        hearth_api::verify_audit_chain(AUDIT_GENESIS, &all)?;
        let err = db
            .lock()
            .execute("UPDATE audit SET status = 500 WHERE seq = 2", []);
        assert!(err.is_err(), "the trigger refuses updates");
        assert!(db.lock().execute("DELETE FROM audit", []).is_err());
        Ok(())
    }

    #[test]
    fn existing_objects_belong_to_default_and_owners_follow_names() -> Result<(), Box<dyn std::error::Error>>
    {
        let db = Db::open_in_memory()?;
        assert!(db.project("default")?.is_some());
        db.create_project("a", &Quota::default(), 1)?;
        db.set_owner("network", "net_1", &["net_1", "web"], "a")?;
        assert_eq!(db.owner("network", "web")?.as_deref(), Some("a"));
        db.remove_owner("network", "web")?;
        assert_eq!(db.owner("network", "net_1")?, None);
        Ok(())
    }
}
