//! Buckets (`buckets`: named credentials, the secret sealed), mounts of running sandboxes (`mounts`, deleted
//! with the sandbox by [`Db::delete`]), the mounts a snapshot restores (`snapshot_mounts`) and the bytes moved
//! through mounts per sandbox (`mount_usage`, kept after the sandbox like its usage intervals).

use rusqlite::{OptionalExtension, params};

use super::{Db, DbError};

/// A bucket as stored (the credentials only sealed).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketRow {
    pub name: String,
    pub bucket: String,
    pub prefix: String,
    pub endpoint: Option<String>,
    pub region: String,
    pub path_style: bool,
    pub key_hint: String,
    pub sealed: Vec<u8>,
    pub created_at_ms: i64,
}

/// A mount (of a sandbox, or recorded in a snapshot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRow {
    /// Sandbox id (or snapshot id for snapshot mounts).
    pub owner: String,
    pub path: String,
    pub bucket: String,
    pub prefix: String,
    pub read_only: bool,
    pub export_key: u64,
}

fn bucket_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<BucketRow> {
    Ok(BucketRow {
        name: r.get(0)?,
        bucket: r.get(1)?,
        prefix: r.get(2)?,
        endpoint: r.get(3)?,
        region: r.get(4)?,
        path_style: r.get(5)?,
        key_hint: r.get(6)?,
        sealed: r.get(7)?,
        created_at_ms: r.get(8)?,
    })
}

fn mount_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<MountRow> {
    Ok(MountRow {
        owner: r.get(0)?,
        path: r.get(1)?,
        bucket: r.get(2)?,
        prefix: r.get(3)?,
        read_only: r.get(4)?,
        // Stored as the signed 64-bit integer SQLite has; the bits are the key.
        export_key: r.get::<_, i64>(5)? as u64,
    })
}

const BUCKET_COLS: &str = "name, bucket, prefix, endpoint, region, path_style, key_hint, sealed, created_at";

impl Db {
    /// Inserts a bucket; `Ok(false)` when the name is taken.
    pub fn insert_bucket(&self, b: &BucketRow) -> Result<bool, DbError> {
        let n = self.lock().execute(
            &format!(
                "INSERT OR IGNORE INTO buckets ({BUCKET_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
            ),
            params![
                b.name,
                b.bucket,
                b.prefix,
                b.endpoint,
                b.region,
                b.path_style,
                b.key_hint,
                b.sealed,
                b.created_at_ms
            ],
        )?;
        Ok(n == 1)
    }

    pub fn get_bucket(&self, name: &str) -> Result<Option<BucketRow>, DbError> {
        Ok(self
            .lock()
            .query_row(
                &format!("SELECT {BUCKET_COLS} FROM buckets WHERE name = ?1"),
                params![name],
                bucket_row,
            )
            .optional()?)
    }

    pub fn list_buckets(&self) -> Result<Vec<BucketRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!("SELECT {BUCKET_COLS} FROM buckets ORDER BY name"))?;
        let rows = stmt.query_map([], bucket_row)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Deletes a bucket unless a sandbox mounts it or a snapshot would mount it again; returns who does (empty
    /// when it was deleted or did not exist).
    pub fn delete_bucket_if_unused(&self, name: &str) -> Result<Vec<String>, DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let users: Vec<String> = {
            let mut stmt = tx.prepare(
                "SELECT sandbox_id FROM mounts WHERE bucket = ?1
                 UNION SELECT snapshot_id FROM snapshot_mounts WHERE bucket = ?1 ORDER BY 1",
            )?;
            stmt.query_map(params![name], |r| r.get(0))?
                .collect::<Result<_, _>>()?
        };
        if users.is_empty() {
            tx.execute("DELETE FROM buckets WHERE name = ?1", params![name])?;
        }
        tx.commit()?;
        Ok(users)
    }

    /// Records a sandbox's mount; `Ok(false)` when the path is taken.
    pub fn insert_mount(&self, m: &MountRow) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "INSERT OR IGNORE INTO mounts (sandbox_id, path, bucket, prefix, read_only, export_key)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                m.owner,
                m.path,
                m.bucket,
                m.prefix,
                m.read_only,
                m.export_key as i64
            ],
        )?;
        Ok(n == 1)
    }

    pub fn delete_mount(&self, sandbox: &str, path: &str) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "DELETE FROM mounts WHERE sandbox_id = ?1 AND path = ?2",
            params![sandbox, path],
        )?;
        Ok(n == 1)
    }

    /// Mounts of a sandbox (`Some(id)`) or of every sandbox, by path.
    pub fn list_mounts(&self, sandbox: Option<&str>) -> Result<Vec<MountRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT sandbox_id, path, bucket, prefix, read_only, export_key FROM mounts
             WHERE ?1 IS NULL OR sandbox_id = ?1 ORDER BY sandbox_id, path",
        )?;
        let rows = stmt
            .query_map(params![sandbox], mount_row)?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Copies a sandbox's mounts into a snapshot's record.
    pub fn snapshot_mounts(&self, sandbox: &str, snapshot: &str) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT OR IGNORE INTO snapshot_mounts (snapshot_id, path, bucket, prefix, read_only, export_key)
             SELECT ?2, path, bucket, prefix, read_only, export_key FROM mounts WHERE sandbox_id = ?1",
            params![sandbox, snapshot],
        )?;
        Ok(())
    }

    /// The mounts a snapshot's restores get.
    pub fn list_snapshot_mounts(&self, snapshot: &str) -> Result<Vec<MountRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT snapshot_id, path, bucket, prefix, read_only, export_key FROM snapshot_mounts
             WHERE snapshot_id = ?1 ORDER BY path",
        )?;
        let rows = stmt
            .query_map(params![snapshot], mount_row)?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Forgets the mounts of snapshots that no longer exist.
    pub fn prune_snapshot_mounts(&self) -> Result<usize, DbError> {
        Ok(self.lock().execute(
            "DELETE FROM snapshot_mounts WHERE snapshot_id NOT IN (SELECT id FROM snapshots)",
            [],
        )?)
    }

    /// Adds to a sandbox's mount byte counts.
    pub fn add_mount_usage(&self, sandbox: &str, read: u64, written: u64) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO mount_usage (sandbox_id, bytes_read, bytes_written) VALUES (?1, ?2, ?3)
             ON CONFLICT (sandbox_id) DO UPDATE SET bytes_read = bytes_read + excluded.bytes_read,
                                                    bytes_written = bytes_written + excluded.bytes_written",
            params![sandbox, read as i64, written as i64],
        )?;
        Ok(())
    }

    /// A sandbox's recorded mount byte counts (read, written).
    pub fn mount_usage(&self, sandbox: &str) -> Result<(u64, u64), DbError> {
        let row: Option<(i64, i64)> = self
            .lock()
            .query_row(
                "SELECT bytes_read, bytes_written FROM mount_usage WHERE sandbox_id = ?1",
                params![sandbox],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        Ok(row.map_or((0, 0), |(r, w)| (r.max(0) as u64, w.max(0) as u64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(owner: &str, path: &str) -> MountRow {
        MountRow {
            owner: owner.into(),
            path: path.into(),
            bucket: "b".into(),
            prefix: "p".into(),
            read_only: true,
            export_key: u64::MAX - 5,
        }
    }

    #[test]
    fn buckets_mounts_and_snapshots() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        let b = BucketRow {
            name: "b".into(),
            bucket: "bkt".into(),
            prefix: String::new(),
            endpoint: None,
            region: "us-east-1".into(),
            path_style: false,
            key_hint: "WXYZ".into(),
            sealed: vec![1, 2, 3],
            created_at_ms: 5,
        };
        assert!(db.insert_bucket(&b)?);
        assert!(!db.insert_bucket(&b)?, "names are unique");
        assert!(db.insert_mount(&mount("sbx_1", "/mnt/a"))?);
        assert!(!db.insert_mount(&mount("sbx_1", "/mnt/a"))?, "one mount per path");
        assert_eq!(
            db.list_mounts(Some("sbx_1"))?,
            vec![mount("sbx_1", "/mnt/a")],
            "keys round-trip"
        );
        assert_eq!(db.delete_bucket_if_unused("b")?, vec!["sbx_1".to_string()]);
        db.snapshot_mounts("sbx_1", "snp_1")?;
        assert_eq!(db.list_snapshot_mounts("snp_1")?[0].path, "/mnt/a");
        assert!(db.delete_mount("sbx_1", "/mnt/a")?);
        assert_eq!(
            db.delete_bucket_if_unused("b")?,
            vec!["snp_1".to_string()],
            "a snapshot holds it"
        );
        assert_eq!(db.prune_snapshot_mounts()?, 1);
        assert!(db.delete_bucket_if_unused("b")?.is_empty());
        assert!(db.get_bucket("b")?.is_none());
        db.add_mount_usage("sbx_1", 10, 1)?;
        db.add_mount_usage("sbx_1", 5, 2)?;
        assert_eq!(db.mount_usage("sbx_1")?, (15, 3));
        Ok(())
    }
}
