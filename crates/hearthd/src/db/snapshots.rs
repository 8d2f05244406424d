//! Snapshot objects: rows of the `snapshots` table. A snapshot row is inserted only after its directory was
//! written durably and renamed into place; it is removed before its directory is.

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};

use super::{Db, DbError, to_json};

/// One snapshot as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: String,
    pub sandbox_id: String,
    pub created_at_ms: i64,
    pub size_bytes: u64,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub env: BTreeMap<String, String>,
}

type Raw = (String, String, i64, i64, String, u32, u32, String);

fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<Raw> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
    ))
}

fn parse(raw: Raw) -> Result<SnapshotRow, DbError> {
    let (id, sandbox_id, created_at_ms, size, template, vcpus, memory_mib, env) = raw;
    let env = serde_json::from_str(&env).map_err(|e| DbError::Corrupt {
        id: id.clone(),
        column: "snapshots.env",
        detail: e.to_string(),
    })?;
    Ok(SnapshotRow {
        id,
        sandbox_id,
        created_at_ms,
        size_bytes: u64::try_from(size).unwrap_or(0),
        template,
        vcpus,
        memory_mib,
        env,
    })
}

const SELECT: &str =
    "SELECT id, sandbox_id, created_at, size_bytes, template, vcpus, memory_mib, env FROM snapshots";

impl Db {
    pub fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO snapshots (id, sandbox_id, created_at, size_bytes, template, vcpus, memory_mib, env)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                s.id,
                s.sandbox_id,
                s.created_at_ms,
                i64::try_from(s.size_bytes).unwrap_or(i64::MAX),
                s.template,
                s.vcpus,
                s.memory_mib,
                to_json(&s.env),
            ],
        )?;
        Ok(())
    }

    pub fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRow>, DbError> {
        let conn = self.lock();
        let raw = conn
            .query_row(&format!("{SELECT} WHERE id = ?1"), params![id], read)
            .optional()?;
        raw.map(parse).transpose()
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!("{SELECT} ORDER BY created_at, id"))?;
        let raws = stmt.query_map([], read)?.collect::<Result<Vec<_>, _>>()?;
        raws.into_iter().map(parse).collect()
    }

    /// Deletes snapshot `id` unless a sandbox row still uses it (its disk is an overlay on the snapshot's
    /// disk). Returns the ids of the sandboxes that use it (nothing deleted then), or an empty list.
    pub fn delete_snapshot_unless_used(&self, id: &str) -> Result<Vec<String>, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let users = {
            let mut stmt =
                tx.prepare_cached("SELECT id FROM sandboxes WHERE snapshot_id = ?1 ORDER BY id")?;
            stmt.query_map(params![id], |r| r.get(0))?
                .collect::<Result<Vec<String>, _>>()?
        };
        if users.is_empty() {
            tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id])?;
        }
        tx.commit()?;
        Ok(users)
    }
}

/// A template saved from a sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateRow {
    pub name: String,
    pub from_sandbox: String,
    pub snapshot_id: Option<String>,
    pub created_at_ms: i64,
    pub size_bytes: u64,
}

impl Db {
    pub fn insert_template(&self, t: &TemplateRow) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO templates (name, from_sandbox, snapshot_id, created_at, size_bytes)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                t.name,
                t.from_sandbox,
                t.snapshot_id,
                t.created_at_ms,
                i64::try_from(t.size_bytes).unwrap_or(i64::MAX)
            ],
        )?;
        Ok(())
    }

    pub fn list_templates(&self) -> Result<Vec<TemplateRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT name, from_sandbox, snapshot_id, created_at, size_bytes FROM templates ORDER BY name",
        )?;
        let rows = stmt
            .query_map([], |r| {
                Ok(TemplateRow {
                    name: r.get(0)?,
                    from_sandbox: r.get(1)?,
                    snapshot_id: r.get(2)?,
                    created_at_ms: r.get(3)?,
                    size_bytes: u64::try_from(r.get::<_, i64>(4)?).unwrap_or(0),
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    pub fn get_template(&self, name: &str) -> Result<Option<TemplateRow>, DbError> {
        Ok(self.list_templates()?.into_iter().find(|t| t.name == name))
    }

    /// Deletes template `name` unless a sandbox row uses it; returns the users (nothing deleted then).
    pub fn delete_template_unless_used(&self, name: &str) -> Result<Vec<String>, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let users = {
            let mut stmt = tx.prepare_cached("SELECT id FROM sandboxes WHERE template = ?1 ORDER BY id")?;
            stmt.query_map(params![name], |r| r.get(0))?
                .collect::<Result<Vec<String>, _>>()?
        };
        if users.is_empty() {
            tx.execute("DELETE FROM templates WHERE name = ?1", params![name])?;
        }
        tx.commit()?;
        Ok(users)
    }
}
