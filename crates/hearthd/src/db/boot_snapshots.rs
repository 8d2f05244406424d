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

/// When each boot snapshot was last restored (NULL: never; its creation counts).
pub const USED_AT_MIGRATION: &str = "ALTER TABLE boot_snapshots ADD COLUMN used_at INTEGER;";

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

    /// Records that boot snapshot `snapshot_id` was restored at `now_ms`. To the minute: a use within a minute
    /// of the recorded one writes nothing (a burst of warm creates is not a burst of database writes; the
    /// least-recently-used order [`Self::retire_boot_snapshots_beyond`] needs is not finer than that).
    pub fn boot_snapshot_used(&self, snapshot_id: &str, now_ms: i64) -> Result<(), DbError> {
        self.lock().execute(
            "UPDATE boot_snapshots SET used_at = ?2
             WHERE snapshot_id = ?1 AND (used_at IS NULL OR used_at <= ?2 - 60000)",
            params![snapshot_id, now_ms],
        )?;
        Ok(())
    }

    /// Retires the live boot snapshots beyond the `max` most recently restored (or made, if never restored);
    /// returns their ids.
    pub fn retire_boot_snapshots_beyond(&self, max: usize) -> Result<Vec<String>, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let ids = {
            let mut stmt = tx.prepare(
                "SELECT snapshot_id FROM boot_snapshots WHERE key IS NOT NULL
                 ORDER BY COALESCE(used_at, created_at) DESC, created_at DESC, snapshot_id LIMIT -1 OFFSET ?1",
            )?;
            stmt.query_map(params![i64::try_from(max).unwrap_or(i64::MAX)], |r| {
                r.get::<_, String>(0)
            })?
            .collect::<Result<Vec<_>, _>>()?
        };
        for id in &ids {
            tx.execute(
                "UPDATE boot_snapshots SET key = NULL WHERE snapshot_id = ?1",
                params![id],
            )?;
        }
        tx.commit()?;
        Ok(ids)
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

    /// Records as retired every snapshot taken from no sandbox (a boot snapshot's row, `sandbox_id` empty)
    /// that has no boot snapshot record: one whose save was cut off (a crash) between its snapshot row and
    /// its record. Returns how many. Run at start-up, before any save can be between the two.
    pub fn adopt_unrecorded_boot_snapshots(&self) -> Result<usize, DbError> {
        Ok(self.lock().execute(
            "INSERT INTO boot_snapshots (snapshot_id, key, template, vcpus, memory_mib, created_at)
             SELECT id, NULL, template, vcpus, memory_mib, created_at FROM snapshots
             WHERE sandbox_id = '' AND id NOT IN (SELECT snapshot_id FROM boot_snapshots)",
            [],
        )?)
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

    #[test]
    fn a_boot_snapshot_cut_off_before_its_record_is_adopted_as_retired() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        db.record_boot_snapshot(&row("snp_live", "k1", 256))?;
        let snap = |id: &str, sandbox: &str| crate::db::snapshots::SnapshotRow {
            id: id.into(),
            sandbox_id: sandbox.into(),
            created_at_ms: 5,
            size_bytes: 1,
            template: "minimal".into(),
            vcpus: 1,
            memory_mib: 256,
            env: Default::default(),
        };
        db.insert_snapshot(&snap("snp_live", ""))?;
        db.insert_snapshot(&snap("snp_cut", ""))?;
        db.insert_snapshot(&snap("snp_user", "sbx_1"))?;
        assert_eq!(db.adopt_unrecorded_boot_snapshots()?, 1);
        assert_eq!(db.adopt_unrecorded_boot_snapshots()?, 0, "once");
        let rows = db.list_boot_snapshots()?;
        let ids: Vec<(&str, bool)> = rows
            .iter()
            .map(|r| (r.snapshot_id.as_str(), r.key.is_some()))
            .collect();
        assert_eq!(
            ids,
            vec![("snp_live", true), ("snp_cut", false)],
            "a user's snapshot is not adopted"
        );
        assert_eq!(
            db.boot_snapshot_for("k1")?.as_deref(),
            Some("snp_live"),
            "the live one of its shape kept"
        );
        assert!(db.delete_retired_boot_snapshot("snp_cut")?);
        assert!(db.get_snapshot("snp_cut")?.is_none());
        Ok(())
    }

    #[test]
    fn the_least_recently_restored_go_beyond_the_limit() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        for (id, key, mib, made) in [
            ("snp_a", "k1", 256, 1),
            ("snp_b", "k2", 512, 2),
            ("snp_c", "k3", 1024, 3),
        ] {
            db.record_boot_snapshot(&BootSnapshotRow {
                created_at_ms: made,
                ..row(id, key, mib)
            })?;
        }
        assert!(db.retire_boot_snapshots_beyond(3)?.is_empty());
        // a was restored last, c was made last: b goes.
        db.boot_snapshot_used("snp_a", 10)?;
        assert_eq!(db.retire_boot_snapshots_beyond(2)?, vec!["snp_b".to_string()]);
        // Uses within a minute of the recorded one are not written; a later one is.
        let used_at = |db: &Db| -> rusqlite::Result<Option<i64>> {
            db.lock().query_row(
                "SELECT used_at FROM boot_snapshots WHERE snapshot_id = 'snp_a'",
                [],
                |r| r.get(0),
            )
        };
        db.boot_snapshot_used("snp_a", 59_000)?;
        assert_eq!(used_at(&db)?, Some(10));
        db.boot_snapshot_used("snp_a", 60_010)?;
        assert_eq!(used_at(&db)?, Some(60_010));
        assert_eq!(db.boot_snapshot_for("k2")?, None);
        assert_eq!(db.retire_boot_snapshots_beyond(1)?, vec!["snp_c".to_string()]);
        assert_eq!(db.boot_snapshot_for("k1")?.as_deref(), Some("snp_a"));
        assert!(
            db.retire_boot_snapshots_beyond(1)?.is_empty(),
            "retired ones do not count"
        );
        Ok(())
    }
}
