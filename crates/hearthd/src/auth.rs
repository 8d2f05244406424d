//! The API key: created on first start, kept in plain text only in `<data-dir>/api-key` (mode 0600) for local
//! clients; the database stores its SHA-256, and requests are checked in constant time. The key is never logged.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::db::{Db, DbError};

const PREFIX: &str = "hk_";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("api key file {path}: {source}")]
    File { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Verifies presented keys against the stored hash.
#[derive(Clone)]
pub struct KeyCheck {
    hash: [u8; 32],
}

impl std::fmt::Debug for KeyCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyCheck(..)")
    }
}

impl KeyCheck {
    pub fn from_hash(hash: [u8; 32]) -> Self {
        KeyCheck { hash }
    }

    /// True when `presented` is the key. Runs in time independent of where the hashes differ.
    pub fn verify(&self, presented: &str) -> bool {
        let h = hash_key(presented);
        h.ct_eq(&self.hash).into()
    }

    /// Checks an `Authorization` header value (`Bearer <key>`).
    pub fn verify_header(&self, value: &[u8]) -> bool {
        let Ok(value) = std::str::from_utf8(value) else {
            return false;
        };
        let Some((scheme, key)) = value.split_once(' ') else {
            return false;
        };
        scheme.eq_ignore_ascii_case("bearer") && self.verify(key.trim())
    }
}

pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A fresh key: `hk_` + 32 random bytes in hex.
pub fn generate_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{PREFIX}{}", hex::encode(bytes))
}

fn well_formed(key: &str) -> bool {
    key.strip_prefix(PREFIX)
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Makes sure a key exists: reuses the key file when it matches the stored hash (or the database has none yet),
/// else issues a new key, writes the file (0600) and stores its hash. Returns the checker.
pub fn ensure_key(db: &Db, key_file: &Path, now_ms: i64) -> Result<KeyCheck, AuthError> {
    let stored = db.api_key_hash()?;
    let on_disk = match std::fs::read_to_string(key_file) {
        Ok(s) => Some(s.trim().to_string()).filter(|k| well_formed(k)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(AuthError::File {
                path: key_file.to_path_buf(),
                source,
            });
        }
    };
    if let Some(key) = on_disk {
        let hash = hash_key(&key);
        match stored {
            Some(s) if bool::from(s.ct_eq(&hash)) => {
                tighten_mode(key_file)?;
                return Ok(KeyCheck::from_hash(s));
            }
            None => {
                tighten_mode(key_file)?;
                db.set_api_key_hash(&hash, now_ms)?;
                tracing::info!(path = %key_file.display(), "api key taken from the existing key file");
                return Ok(KeyCheck::from_hash(hash));
            }
            Some(_) => tracing::warn!(path = %key_file.display(), "api key file does not match the database"),
        }
    }
    let key = generate_key();
    write_key_file(key_file, &key)?;
    let hash = hash_key(&key);
    db.set_api_key_hash(&hash, now_ms)?;
    tracing::info!(path = %key_file.display(), "issued a new api key");
    Ok(KeyCheck::from_hash(hash))
}

fn tighten_mode(path: &Path) -> Result<(), AuthError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|source| AuthError::File {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes the key to a temporary file created 0600, then renames it into place (never world-readable).
fn write_key_file(path: &Path, key: &str) -> Result<(), AuthError> {
    let err = |source| AuthError::File {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(format!("{key}\n").as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn first_start_writes_0600_file_and_stores_only_the_hash() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let db = Db::open(&dir.path().join("state.db"))?;
        let file = dir.path().join("api-key");
        let check = ensure_key(&db, &file, 1)?;
        let key = std::fs::read_to_string(&file)?.trim().to_string();
        assert!(well_formed(&key), "{key}");
        assert_eq!(std::fs::metadata(&file)?.mode() & 0o777, 0o600);
        assert!(check.verify(&key));
        assert!(!check.verify("hk_wrong"));
        assert!(check.verify_header(format!("Bearer {key}").as_bytes()));
        assert!(!check.verify_header(key.as_bytes()));
        assert_eq!(db.api_key_hash()?, Some(hash_key(&key)));
        drop(db);
        // The plain key appears nowhere in the database files.
        for entry in std::fs::read_dir(dir.path())? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with("state.db") {
                let bytes = std::fs::read(entry.path())?;
                assert!(!bytes.windows(key.len()).any(|w| w == key.as_bytes()));
            }
        }
        Ok(())
    }

    #[test]
    fn restart_keeps_the_key_and_a_mismatch_rotates_it() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let db = Db::open(&dir.path().join("state.db"))?;
        let file = dir.path().join("api-key");
        ensure_key(&db, &file, 1)?;
        let key1 = std::fs::read_to_string(&file)?;
        let check = ensure_key(&db, &file, 2)?;
        assert_eq!(std::fs::read_to_string(&file)?, key1);
        assert!(check.verify(key1.trim()));
        std::fs::write(&file, format!("{}\n", generate_key()))?;
        db.set_api_key_hash(&[0u8; 32], 3)?;
        let check = ensure_key(&db, &file, 4)?;
        let key3 = std::fs::read_to_string(&file)?;
        assert!(check.verify(key3.trim()));
        assert!(!check.verify(key1.trim()));
        Ok(())
    }
}
