//! The manifest: what an object is made of. Written last; its presence is the object's commit.

use serde::{Deserialize, Serialize};

use crate::crypto::ChunkId;
use crate::error::StoreError;
use crate::name::check_file_name;

/// The manifest format version written by this crate.
pub const MANIFEST_VERSION: u32 = 1;

/// An object's manifest (stored as JSON, sealed when the store is encrypted).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Format version ([`MANIFEST_VERSION`]).
    pub version: u32,
    /// The object's name (checked against the key it was read from).
    pub name: String,
    /// When the upload committed, RFC 3339 UTC.
    pub created: String,
    /// Chunk size of every file's chunk list (the last chunk of a file may be shorter).
    pub chunk_size: u64,
    /// Sum of the files' sizes.
    pub total_bytes: u64,
    /// The files, in upload order.
    pub files: Vec<FileEntry>,
    /// Whatever the caller attached (versions the object needs, its owner's ids...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
}

/// One file of an object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// The file's name inside the object (one path segment).
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// One entry per `chunk_size` bytes: the chunk's id in hex, or `null` for an all-zero range (a hole on
    /// restore).
    pub chunks: Vec<Option<String>>,
}

impl Manifest {
    /// Checks a manifest read from the bucket before anything is built from it: version, name, file names,
    /// chunk counts against sizes, chunk id syntax.
    pub(crate) fn validate(&self, object: &str) -> Result<(), StoreError> {
        let corrupt = |reason: String| StoreError::ManifestCorrupt {
            object: object.to_owned(),
            reason,
        };
        if self.version != MANIFEST_VERSION {
            return Err(corrupt(format!("unsupported version {}", self.version)));
        }
        if self.name != object {
            return Err(corrupt("names another object".to_owned()));
        }
        if self.chunk_size == 0 || self.chunk_size > 64 << 20 {
            return Err(corrupt("chunk size out of range".to_owned()));
        }
        let mut total = 0u64;
        for (i, f) in self.files.iter().enumerate() {
            check_file_name(object, &f.name)?;
            if self.files[..i].iter().any(|g| g.name == f.name) {
                return Err(corrupt(format!("file {} listed twice", f.name)));
            }
            if f.chunks.len() as u64 != f.size.div_ceil(self.chunk_size) {
                return Err(corrupt(format!(
                    "file {}: chunk count does not match its size",
                    f.name
                )));
            }
            if f.chunks.iter().flatten().any(|c| ChunkId::parse(c).is_none()) {
                return Err(corrupt(format!("file {}: malformed chunk id", f.name)));
            }
            total = total.saturating_add(f.size);
        }
        if total != self.total_bytes {
            return Err(corrupt("total_bytes does not match the files".to_owned()));
        }
        Ok(())
    }

    /// Every chunk id the manifest references (with repeats).
    pub fn chunk_ids(&self) -> impl Iterator<Item = ChunkId> + '_ {
        self.files
            .iter()
            .flat_map(|f| f.chunks.iter().flatten())
            .filter_map(|c| ChunkId::parse(c))
    }
}

/// SHA-256 of a manifest's plaintext JSON, in hex: what [`crate::PutStats::manifest_digest`] reports.
pub fn digest_hex(json: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(json)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            version: 1,
            name: "a/b".into(),
            created: "2026-12-01T00:00:00Z".into(),
            chunk_size: 4,
            total_bytes: 9,
            files: vec![FileEntry {
                name: "memory".into(),
                size: 9,
                chunks: vec![Some("ab".repeat(32)), None, Some("cd".repeat(32))],
            }],
            metadata: Some(serde_json::json!({"vmm": "qemu"})),
        }
    }

    #[test]
    fn validation() {
        let m = sample();
        m.validate("a/b").expect("valid");
        assert!(m.validate("a/c").is_err());
        let mut bad = sample();
        bad.files[0].chunks.pop();
        assert!(bad.validate("a/b").is_err());
        let mut bad = sample();
        bad.files[0].name = "../etc".into();
        assert!(matches!(
            bad.validate("a/b"),
            Err(StoreError::InvalidFileName { .. })
        ));
        let mut bad = sample();
        bad.files[0].chunks[0] = Some("zz".into());
        assert!(bad.validate("a/b").is_err());
        let json = serde_json::to_string(&m).expect("json");
        assert_eq!(serde_json::from_str::<Manifest>(&json).expect("parse"), m);
        assert!(
            serde_json::from_str::<Manifest>(&json.replace("\"version\"", "\"extra\":1,\"version\""))
                .is_err()
        );
    }
}
