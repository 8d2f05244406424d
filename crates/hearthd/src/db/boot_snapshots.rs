//! Boot snapshots of warm creates (service/warm.rs): which snapshot holds a template booted at a shape.
//!
//! A boot snapshot is an ordinary row of `snapshots` (its source `sandbox_id` empty, owned by no project) plus a
//! row here naming it. `key` is the fingerprint of what the guest booted from (template image, kernel, shape,
//! VMM, network device); creates that compute the same key restore it. A boot snapshot whose inputs changed is
//! *retired* (`key` NULL): no create picks it again, and it is deleted once no sandbox's disk builds on it.

use rusqlite::{OptionalExtension, params};

use super::{Db, DbError};

/// Migration 12.
pub const MIGRATION: &str = "CREATE TABLE boot_snapshots (
        snapshot_id TEXT PRIMARY KEY NOT NULL,
        key         TEXT UNIQUE,           -- NULL once retired
        template    TEXT NOT NULL,
        vcpus       INTEGER NOT NULL,
        memory_mib  INTEGER NOT NULL,
        created_at  INTEGER NOT NULL       -- unix milliseconds
    );";

/// One boot snapshot as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootSnapshotRow {
    pub snapshot_id: String,
    /// `None` once retired.
    pub key: Option<String>,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub created_at_ms: i64,
}

impl Db {
    /// The boot snapshot recorded for `key`, if any.
    pub fn boot_snapshot_for(&self, key: &str) -> Result<Option<String>, DbError> {
        Ok(self
            .lock()
            .query_row(
                "SELECT snapshot_id FROM boot_snapshots WHERE key = ?1",
                params![key],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Records `row` (its snapshot row already inserted) and retires every other boot snapshot of the same
    /// template and shape: they were booted from inputs that have changed since, or lost a race to this one.
    pub fn record_boot_snapshot(&self, row: &BootSnapshotRow) -> Result<(), DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute(
            "UPDATE boot_snapshots SET key = NULL
             WHERE key = ?1 OR (template = ?2 AND vcpus = ?3 AND memory_mib = ?4)",
            params![row.key, row.template, row.vcpus, row.memory_mib],
        )?;
        tx.execute(
            "INSERT INTO boot_snapshots (snapshot_id, key, template, vcpus, memory_mib, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                row.snapshot_id,
                row.key,
                row.template,
                row.vcpus,
                row.memory_mib,
                row.created_at_ms
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Retires boot snapshot `snapshot_id`: no create restores it any more.
    pub fn retire_boot_snapshot(&self, snapshot_id: &str) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE boot_snapshots SET key = NULL WHERE snapshot_id = ?1",
            params![snapshot_id],
        )?;
        Ok(())
    }

    /// Every boot snapshot, live and retired, oldest first.
    pub fn list_boot_snapshots(&self) -> Result<Vec<BootSnapshotRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT snapshot_id, key, template, vcpus, memory_mib, created_at FROM boot_snapshots
             ORDER BY created_at, snapshot_id",
        )?;
        let rows = stmt
            .query_map([], |r| {
                Ok(BootSnapshotRow {
                    snapshot_id: r.get(0)?,
                    key: r.get(1)?,
                    template: r.get(2)?,
                    vcpus: r.get(3)?,
                    memory_mib: r.get(4)?,
                    created_at_ms: r.get(5)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Deletes retired boot snapshot `snapshot_id` (its row here and its `snapshots` row) unless a sandbox's
    /// disk builds on it or it is not retired. Returns whether it was deleted.
    pub fn delete_retired_boot_snapshot(&self, snapshot_id: &str) -> Result<bool, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let used: bool = tx.query_row(
            "SELECT EXISTS (SELECT 1 FROM sandboxes WHERE snapshot_id = ?1)
                 OR EXISTS (SELECT 1 FROM boot_snapshots WHERE snapshot_id = ?1 AND key IS NOT NULL)",
            params![snapshot_id],
            |r| r.get(0),
        )?;
        if !used {
            tx.execute("DELETE FROM snapshots WHERE id = ?1", params![snapshot_id])?;
            tx.execute(
                "DELETE FROM boot_snapshots WHERE snapshot_id = ?1",
                params![snapshot_id],
            )?;
        }
        tx.commit()?;
        Ok(!used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, key: &str, memory_mib: u32) -> BootSnapshotRow {
        BootSnapshotRow {
            snapshot_id: id.into(),
            key: Some(key.into()),
            template: "minimal".into(),
            vcpus: 1,
            memory_mib,
            created_at_ms: 1,
        }
    }

    #[test]
    fn a_new_boot_snapshot_retires_the_old_one_of_its_shape_only() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        db.record_boot_snapshot(&row("snp_a", "k1", 256))?;
        db.record_boot_snapshot(&row("snp_b", "k2", 512))?;
        assert_eq!(db.boot_snapshot_for("k1")?.as_deref(), Some("snp_a"));
        // The template image changed: same shape, new key.
        db.record_boot_snapshot(&row("snp_c", "k3", 256))?;
        assert_eq!(db.boot_snapshot_for("k1")?, None);
        assert_eq!(db.boot_snapshot_for("k3")?.as_deref(), Some("snp_c"));
        assert_eq!(
            db.boot_snapshot_for("k2")?.as_deref(),
            Some("snp_b"),
            "other shape kept"
        );
        let retired: Vec<_> = db
            .list_boot_snapshots()?
            .into_iter()
            .filter(|r| r.key.is_none())
            .map(|r| r.snapshot_id)
            .collect();
        assert_eq!(retired, vec!["snp_a".to_string()]);
        Ok(())
    }

    #[test]
    fn only_a_retired_unused_boot_snapshot_is_deleted() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        db.record_boot_snapshot(&row("snp_a", "k1", 256))?;
        assert!(!db.delete_retired_boot_snapshot("snp_a")?, "live: kept");
        db.retire_boot_snapshot("snp_a")?;
        let mut sandbox = super::super::tests::row("sbx_1");
        sandbox.snapshot_id = Some("snp_a".into());
        db.insert(&sandbox)?;
        assert!(
            !db.delete_retired_boot_snapshot("snp_a")?,
            "a disk builds on it: kept"
        );
        db.delete("sbx_1")?;
        assert!(db.delete_retired_boot_snapshot("snp_a")?);
        assert!(db.list_boot_snapshots()?.is_empty());
        Ok(())
    }
}
