//! File ids and the table that turns them back into paths.
//!
//! A file's id is a keyed hash of its path relative to the export root (SHA-256 of the export key and the
//! path, 64 bits), so every server of one export (after a daemon restart, in a fork) gives a path the same id
//! and the guest's cached file handles stay valid. The table remembers every id the server has handed out; a
//! handle whose id it does not know is stale. The table only ever holds paths under the export's root, so a
//! forged handle can name nothing outside it.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// The id of the export's root directory.
pub const ROOT_ID: u64 = 1;
/// Ids below this are reserved (root, READDIR's `.` and `..` cookies).
const FIRST_ID: u64 = 16;
/// Longest path a table accepts (S3 keys are at most 1024 bytes).
pub const MAX_PATH: usize = 1024;

/// The id of `path` (relative to the export root, `""` for the root) in the export keyed `key`.
pub fn file_id(key: u64, path: &str) -> u64 {
    if path.is_empty() {
        return ROOT_ID;
    }
    let mut h = Sha256::new();
    h.update(key.to_be_bytes());
    h.update(path.as_bytes());
    let d = h.finalize();
    let id = u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
    if id < FIRST_ID { id + FIRST_ID } else { id }
}

/// Two paths with one id (astronomically unlikely; the second path is refused with EIO).
#[derive(Debug, thiserror::Error)]
#[error("file id collision")]
pub struct Collision;

/// Remembers which path each handed-out id stands for.
pub trait HandleTable: Send + Sync {
    fn get(&self, id: u64) -> Option<String>;
    /// Records `id` → `path`; idempotent.
    fn insert(&self, id: u64, path: &str) -> Result<(), Collision>;
}

/// A table in memory only (tests; exports whose handles need not outlive the process).
#[derive(Default)]
pub struct MemoryTable {
    map: Mutex<HashMap<u64, String>>,
}

impl HandleTable for MemoryTable {
    fn get(&self, id: u64) -> Option<String> {
        if id == ROOT_ID {
            return Some(String::new());
        }
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    fn insert(&self, id: u64, path: &str) -> Result<(), Collision> {
        insert_into(&mut self.map.lock().unwrap_or_else(|p| p.into_inner()), id, path).map(drop)
    }
}

fn insert_into(map: &mut HashMap<u64, String>, id: u64, path: &str) -> Result<bool, Collision> {
    if id == ROOT_ID {
        return Ok(false);
    }
    match map.get(&id) {
        Some(p) if p == path => Ok(false),
        Some(_) => Err(Collision),
        None => {
            map.insert(id, path.to_owned());
            Ok(true)
        }
    }
}

/// A table kept in memory and appended to a log file (mode 0600), read back on open: handles survive a
/// restart of the server. Records: `u64 id` | `u16 len` | path bytes (big-endian); a torn last record
/// (a crash mid-append) is ignored.
pub struct LogTable {
    path: PathBuf,
    state: Mutex<(HashMap<u64, String>, std::fs::File)>,
}

impl LogTable {
    pub fn open(path: &Path) -> std::io::Result<LogTable> {
        let mut map = HashMap::new();
        match std::fs::read(path) {
            Ok(bytes) => {
                let mut at = 0;
                while at + 10 <= bytes.len() {
                    let id = u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
                    let len = usize::from(u16::from_be_bytes([bytes[at + 8], bytes[at + 9]]));
                    let end = at + 10 + len;
                    if end > bytes.len() {
                        break;
                    }
                    if let Ok(p) = std::str::from_utf8(&bytes[at + 10..end]) {
                        let _ = insert_into(&mut map, id, p);
                    }
                    at = end;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)?;
        Ok(LogTable {
            path: path.to_owned(),
            state: Mutex::new((map, file)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl HandleTable for LogTable {
    fn get(&self, id: u64) -> Option<String> {
        if id == ROOT_ID {
            return Some(String::new());
        }
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .get(&id)
            .cloned()
    }

    fn insert(&self, id: u64, path: &str) -> Result<(), Collision> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let len = u16::try_from(path.len()).map_err(|_| Collision)?;
        if insert_into(&mut st.0, id, path)? {
            let mut rec = Vec::with_capacity(10 + path.len());
            rec.extend_from_slice(&id.to_be_bytes());
            rec.extend_from_slice(&len.to_be_bytes());
            rec.extend_from_slice(path.as_bytes());
            // A failed append only costs this handle its life across a restart (it turns stale then).
            if let Err(e) = st.1.write_all(&rec) {
                tracing::warn!(error = %e, "appending to a mount's handle table failed");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_keyed_and_avoid_reserved_values() {
        assert_eq!(file_id(7, ""), ROOT_ID);
        assert_eq!(file_id(7, "a/b"), file_id(7, "a/b"));
        assert_ne!(file_id(7, "a/b"), file_id(8, "a/b"));
        assert_ne!(file_id(7, "a/b"), file_id(7, "a/c"));
        assert!(file_id(7, "x") >= FIRST_ID);
    }

    #[test]
    fn log_table_survives_reopen_and_ignores_a_torn_tail() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let p = dir.path().join("handles");
        {
            let t = LogTable::open(&p)?;
            t.insert(100, "a/b").map_err(std::io::Error::other)?;
            t.insert(100, "a/b").map_err(std::io::Error::other)?;
            assert!(t.insert(100, "other").is_err());
            t.insert(200, "c").map_err(std::io::Error::other)?;
        }
        // A torn record at the end.
        let mut f = std::fs::OpenOptions::new().append(true).open(&p)?;
        f.write_all(&[0, 0, 0, 0, 0, 0, 1, 44, 0, 50, b'x'])?;
        let t = LogTable::open(&p)?;
        assert_eq!(t.get(100).as_deref(), Some("a/b"));
        assert_eq!(t.get(200).as_deref(), Some("c"));
        assert_eq!(t.get(300), None);
        assert_eq!(t.get(ROOT_ID).as_deref(), Some(""));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&p)?.permissions().mode() & 0o777, 0o600);
        Ok(())
    }
}
