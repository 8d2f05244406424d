//! Disk syncs (`POST /v1/sandboxes/{id}/sync`, `disk_sync_interval_s`): one row per sandbox that asked for a
//! periodic sync or was synced, with the last captured image. The image itself is a file under the data
//! directory and an object in the storage bucket (its upload state is the `remote_objects` row); the row goes
//! with its sandbox.

use rusqlite::{OptionalExtension, params};

use super::{Db, DbError};

/// Migration 9 (listed in [`super::MIGRATIONS`]).
pub const MIGRATION: &str = "CREATE TABLE disk_syncs (
        sandbox_id  TEXT PRIMARY KEY NOT NULL,
        interval_s  INTEGER,           -- periodic sync every this many seconds; NULL: none
        version     INTEGER,           -- the last captured image (its capture time, ms); NULL: none yet
        size_bytes  INTEGER NOT NULL DEFAULT 0,
        format      TEXT,              -- the image's format as the VMM driver wrote it (qcow2 | raw)
        stopped_us  INTEGER            -- how long the guest was stopped for that capture
    );";

/// One sandbox's sync record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSyncRow {
    pub sandbox_id: String,
    pub interval_s: Option<u64>,
    /// The last captured image, if any.
    pub image: Option<SyncedImage>,
}

/// A captured disk image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncedImage {
    pub version: i64,
    pub size_bytes: u64,
    pub format: String,
    pub stopped_us: u64,
}

const SELECT: &str = "SELECT sandbox_id, interval_s, version, size_bytes, format, stopped_us FROM disk_syncs";

fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<DiskSyncRow> {
    let interval: Option<i64> = r.get(1)?;
    let version: Option<i64> = r.get(2)?;
    let size: i64 = r.get(3)?;
    let format: Option<String> = r.get(4)?;
    let stopped: Option<i64> = r.get(5)?;
    let image = match (version, format) {
        (Some(version), Some(format)) => Some(SyncedImage {
            version,
            size_bytes: u64::try_from(size).unwrap_or(0),
            format,
            stopped_us: stopped.and_then(|s| u64::try_from(s).ok()).unwrap_or(0),
        }),
        _ => None,
    };
    Ok(DiskSyncRow {
        sandbox_id: r.get(0)?,
        interval_s: interval.and_then(|i| u64::try_from(i).ok()),
        image,
    })
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Db {
    /// Records a new sandbox's periodic sync interval.
    pub fn sync_set_interval(&self, id: &str, interval_s: u64) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO disk_syncs (sandbox_id, interval_s) VALUES (?1, ?2)
             ON CONFLICT (sandbox_id) DO UPDATE SET interval_s = ?2",
            params![id, i64_of(interval_s)],
        )?;
        Ok(())
    }

    /// Records a captured image of `id`'s disk.
    pub fn sync_captured(&self, id: &str, image: &SyncedImage) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO disk_syncs (sandbox_id, interval_s, version, size_bytes, format, stopped_us)
             VALUES (?1, NULL, ?2, ?3, ?4, ?5)
             ON CONFLICT (sandbox_id) DO UPDATE SET version = ?2, size_bytes = ?3, format = ?4, stopped_us = ?5",
            params![
                id,
                image.version,
                i64_of(image.size_bytes),
                image.format,
                i64_of(image.stopped_us)
            ],
        )?;
        Ok(())
    }

    pub fn sync_get(&self, id: &str) -> Result<Option<DiskSyncRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!("{SELECT} WHERE sandbox_id = ?1"))?;
        Ok(stmt.query_row(params![id], read).optional()?)
    }

    /// Sandboxes with a periodic sync.
    pub fn sync_periodic(&self) -> Result<Vec<DiskSyncRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!(
            "{SELECT} WHERE interval_s IS NOT NULL ORDER BY sandbox_id"
        ))?;
        let rows = stmt.query_map([], read)?.collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_and_images_are_kept_and_go_with_the_sandbox() -> Result<(), DbError> {
        let db = Db::open_in_memory()?;
        db.sync_set_interval("sbx_a", 60)?;
        assert_eq!(db.sync_get("sbx_a")?.and_then(|r| r.image), None);
        let image = SyncedImage {
            version: 10,
            size_bytes: 4096,
            format: "qcow2".into(),
            stopped_us: 1500,
        };
        db.sync_captured("sbx_a", &image)?;
        db.sync_captured("sbx_b", &image)?;
        let a = db.sync_get("sbx_a")?.expect("row");
        assert_eq!((a.interval_s, a.image), (Some(60), Some(image.clone())));
        assert_eq!(db.sync_get("sbx_b")?.and_then(|r| r.interval_s), None);
        assert_eq!(db.sync_periodic()?.len(), 1);
        db.delete("sbx_a")?;
        assert_eq!(db.sync_get("sbx_a")?, None);
        Ok(())
    }
}
