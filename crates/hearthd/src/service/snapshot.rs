//! Durable snapshot directories (SECURITY.md promise 8).
//!
//! Writing: the driver fills a fresh temporary directory (`.tmp-<name>-<random>`, mode 0700) next to the final
//! place; every file is hashed and described in `manifest.json` (name, size, sha256; VMM kind and version,
//! kernel release, template, shape); the manifest and the directory are fsynced, the directory is renamed into
//! place and its parent fsynced. Only then does the caller commit the snapshot in the database. Any failure
//! (disk full, EIO, driver error) removes the temporary directory and leaves the previous state alone.
//!
//! Reading: [`verify`] checks the manifest and every file (regular file, not a symlink, size; sha256 for small
//! files, the fingerprint for large ones, see [`super::integrity`]) before the VMM is given the directory;
//! anything else is a [`SnapshotError::Corrupt`].

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hearth_vmm::{SnapshotInfo, SnapshotMode, VmHandle, Vmm, VmmKind};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::integrity::{self, Fingerprint};

/// Name of the manifest inside a snapshot directory.
pub const MANIFEST: &str = "manifest.json";
/// Largest manifest read back (it lists a handful of files).
const MAX_MANIFEST: u64 = 1024 * 1024;
const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The snapshot's files do not match its manifest, or the manifest is unreadable.
    #[error("snapshot {dir} is corrupt: {detail}")]
    Corrupt { dir: PathBuf, detail: String },
    /// The snapshot was written by another VMM (or shape) than the one asked to restore it.
    #[error("snapshot {dir} cannot be restored here: {detail}")]
    Incompatible { dir: PathBuf, detail: String },
    /// Writing the snapshot failed (the previous state is kept).
    #[error("writing snapshot {dir}: {detail}")]
    Write { dir: PathBuf, detail: String },
}

/// One file of a snapshot: small files carry their SHA-256, large ones (guest memory, disk copies) the
/// fingerprint they had when the snapshot was sealed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<Fingerprint>,
}

/// `manifest.json`: what a snapshot holds and what restoring it needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: u32,
    pub vmm: VmmKind,
    pub vmm_version: String,
    /// Guest kernel release (from the images manifest), empty when unknown.
    pub kernel_release: String,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub mode: SnapshotMode,
    /// Unix milliseconds.
    pub created_at: i64,
    pub files: Vec<FileEntry>,
    /// What the driver reported (handed back to `Vmm::restore`).
    pub info: SnapshotInfo,
}

impl Manifest {
    pub fn size_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// The large files, which [`integrity::hash_in_background`] hashes after the commit.
    pub fn fingerprinted(&self) -> Vec<(String, Fingerprint)> {
        self.files
            .iter()
            .filter_map(|f| f.fingerprint.map(|fp| (f.name.clone(), fp)))
            .collect()
    }
}

/// What the caller knows about the snapshot it asks for.
pub struct SnapshotMeta<'a> {
    pub template: &'a str,
    pub kernel_release: String,
    pub mode: SnapshotMode,
    pub created_at: i64,
}

/// A file name a driver may report: one plain path component.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name != MANIFEST
        && !name.contains('/')
        && !name.contains('\0')
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Opens `path` for reading without following a symlink, and checks it is a regular file.
fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(f)
}

fn hash_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut f = open_regular(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1024 * 1024];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hex::encode(hasher.finalize())))
}

/// Takes a snapshot of `vm` into `parent/name` durably and returns its manifest. `parent/name` must not exist
/// (the caller removes a stale one first).
pub async fn write(
    vmm: &dyn Vmm,
    vm: &VmHandle,
    disk: &Path,
    parent: &Path,
    name: &str,
    meta: SnapshotMeta<'_>,
) -> Result<Manifest, SnapshotError> {
    let dest = parent.join(name);
    let mut rnd = [0u8; 6];
    rand::rng().fill_bytes(&mut rnd);
    let tmp = parent.join(format!(".tmp-{name}-{}", hex::encode(rnd)));
    let meta = meta_owned(meta);
    let werr = |detail: String| SnapshotError::Write {
        dir: dest.clone(),
        detail,
    };
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp)
        .map_err(|e| werr(format!("creating {}: {e}", tmp.display())))?;
    let result = async {
        let started = std::time::Instant::now();
        let info = vmm
            .snapshot(vm, disk, &tmp, meta.mode)
            .await
            .map_err(|e| werr(e.to_string()))?;
        let captured = started.elapsed();
        let tmp2 = tmp.clone();
        let vmm_kind = vmm.kind();
        let manifest = tokio::task::spawn_blocking(move || seal(&tmp2, info, vmm_kind, meta))
            .await
            .map_err(|e| werr(format!("hashing task: {e}")))?
            .map_err(werr)?;
        std::fs::rename(&tmp, &dest).map_err(|e| werr(format!("rename into place: {e}")))?;
        fsync_dir(parent).map_err(|e| werr(format!("fsync {}: {e}", parent.display())))?;
        // Where a pause's time goes (the VMM's capture, then hashing every file for the manifest).
        tracing::info!(snapshot = %dest.display(), capture_ms = captured.as_millis() as u64,
            seal_ms = (started.elapsed() - captured).as_millis() as u64, bytes = manifest.size_bytes(),
            "snapshot written");
        Ok(manifest)
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

struct OwnedMeta {
    template: String,
    kernel_release: String,
    mode: SnapshotMode,
    created_at: i64,
}

fn meta_owned(m: SnapshotMeta<'_>) -> OwnedMeta {
    OwnedMeta {
        template: m.template.to_string(),
        kernel_release: m.kernel_release,
        mode: m.mode,
        created_at: m.created_at,
    }
}

/// Hashes the driver's files, writes and fsyncs the manifest and the directory.
fn seal(dir: &Path, info: SnapshotInfo, vmm: VmmKind, meta: OwnedMeta) -> Result<Manifest, String> {
    let mut files = Vec::new();
    for name in &info.files {
        if !plain_name(name) {
            return Err(format!("driver reported an invalid file name {name:?}"));
        }
        let path = dir.join(name);
        let meta = open_regular(&path)
            .and_then(|f| f.metadata())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // The driver fsynced its files. Small ones are hashed now (reading them back once); large ones are
        // fingerprinted, and hashed by content in the background once the snapshot is committed.
        let entry = if meta.len() <= integrity::HASH_AT_SEAL_MAX {
            let (size, sha256) = hash_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            FileEntry {
                name: name.clone(),
                size,
                sha256: Some(sha256),
                fingerprint: None,
            }
        } else {
            FileEntry {
                name: name.clone(),
                size: meta.len(),
                sha256: None,
                fingerprint: Some(Fingerprint::of(&meta)),
            }
        };
        files.push(entry);
    }
    if let Some(d) = &info.disk
        && !info.files.contains(d)
    {
        return Err(format!("driver's disk copy {d:?} is not among its files"));
    }
    let manifest = Manifest {
        format: FORMAT,
        vmm,
        vmm_version: info.vmm_version.clone(),
        kernel_release: meta.kernel_release,
        template: meta.template,
        vcpus: info.vcpus,
        memory_mib: info.memory_mib,
        mode: meta.mode,
        created_at: meta.created_at,
        files,
        info,
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| e.to_string())?;
    let path = dir.join(MANIFEST);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(&json)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))?;
    Ok(manifest)
}

/// Reads and checks the snapshot in `dir` (blocking: hashes small files, compares large files' fingerprints).
/// `vmm` is the driver that would restore it.
pub fn verify(dir: &Path, vmm: VmmKind) -> Result<Manifest, SnapshotError> {
    let started = std::time::Instant::now();
    let manifest = verify_files(dir, vmm)?;
    tracing::info!(snapshot = %dir.display(), ms = started.elapsed().as_millis() as u64,
        bytes = manifest.size_bytes(), "snapshot verified");
    Ok(manifest)
}

fn verify_files(dir: &Path, vmm: VmmKind) -> Result<Manifest, SnapshotError> {
    let corrupt = |detail: String| SnapshotError::Corrupt {
        dir: dir.to_path_buf(),
        detail,
    };
    let mut raw = Vec::new();
    open_regular(&dir.join(MANIFEST))
        .map_err(|e| corrupt(format!("{MANIFEST}: {e}")))?
        .take(MAX_MANIFEST + 1)
        .read_to_end(&mut raw)
        .map_err(|e| corrupt(format!("{MANIFEST}: {e}")))?;
    if raw.len() as u64 > MAX_MANIFEST {
        return Err(corrupt(format!("{MANIFEST} is too large")));
    }
    let manifest: Manifest =
        serde_json::from_slice(&raw).map_err(|e| corrupt(format!("{MANIFEST} does not parse: {e}")))?;
    if manifest.format != FORMAT {
        return Err(corrupt(format!("unknown manifest format {}", manifest.format)));
    }
    if manifest.vmm != vmm || manifest.info.kind != vmm {
        return Err(SnapshotError::Incompatible {
            dir: dir.to_path_buf(),
            detail: format!(
                "written by {}, this daemon runs {}",
                manifest.vmm.as_str(),
                vmm.as_str()
            ),
        });
    }
    // Every file the driver needs must be listed, and every listed file must match.
    for name in &manifest.info.files {
        if !manifest.files.iter().any(|f| &f.name == name) {
            return Err(corrupt(format!("{name} is not in the manifest")));
        }
    }
    for entry in &manifest.files {
        if !plain_name(&entry.name) {
            return Err(corrupt(format!("invalid file name {:?}", entry.name)));
        }
        let path = dir.join(&entry.name);
        let meta = std::fs::symlink_metadata(&path).map_err(|e| corrupt(format!("{}: {e}", entry.name)))?;
        if !meta.is_file() {
            return Err(corrupt(format!("{} is not a regular file", entry.name)));
        }
        if meta.len() != entry.size {
            return Err(corrupt(format!(
                "{} has {} bytes, the manifest says {}",
                entry.name,
                meta.len(),
                entry.size
            )));
        }
        match (&entry.sha256, &entry.fingerprint) {
            (_, Some(fp)) if Fingerprint::of(&meta).same_version(fp) => {}
            (Some(want), _) => {
                let (_, sha) = hash_file(&path).map_err(|e| corrupt(format!("{}: {e}", entry.name)))?;
                if sha != *want {
                    return Err(corrupt(format!("{} does not match its checksum", entry.name)));
                }
            }
            (None, Some(_)) => {
                // Changed since it was sealed: acceptable only with the content it had then.
                let hashes = integrity::read_hashes(dir);
                let Some(want) = hashes.get(&entry.name) else {
                    return Err(corrupt(format!(
                        "{} changed since the snapshot was written (and has no content checksum yet)",
                        entry.name
                    )));
                };
                let got =
                    integrity::content_hash(&path).map_err(|e| corrupt(format!("{}: {e}", entry.name)))?;
                if got != *want {
                    return Err(corrupt(format!("{} does not match its checksum", entry.name)));
                }
            }
            (None, None) => return Err(corrupt(format!("{} has no checksum", entry.name))),
        }
    }
    Ok(manifest)
}

/// Removes temporary snapshot directories (`.tmp-*`) left in `parent` by an interrupted write.
pub fn remove_temporaries(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".tmp-") {
            tracing::info!(path = %entry.path().display(), "removing an interrupted snapshot write");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Kernel release from the images manifest (`<images>/manifest.json`), empty when unknown.
pub fn kernel_release(images_dir: &Path) -> String {
    #[derive(Deserialize)]
    struct Images {
        kernel_release: String,
    }
    std::fs::read(images_dir.join("manifest.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Images>(&b).ok())
        .map(|m| m.kernel_release)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(files: &[&str]) -> SnapshotInfo {
        SnapshotInfo {
            kind: VmmKind::Qemu,
            vmm_version: "QEMU 0".into(),
            files: files.iter().map(|s| s.to_string()).collect(),
            disk: None,
            disk_format: None,
            memory_mib: 128,
            vcpus: 1,
            memory_file: None,
            features: Vec::new(),
        }
    }

    fn meta() -> OwnedMeta {
        OwnedMeta {
            template: "minimal".into(),
            kernel_release: "6.1".into(),
            mode: SnapshotMode::Pause,
            created_at: 1,
        }
    }

    #[test]
    fn sealed_snapshots_verify_and_tampering_is_caught() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("memory"), vec![7u8; 100_000])?;
        std::fs::write(dir.path().join("state"), b"device state")?;
        let m = seal(dir.path(), info(&["memory", "state"]), VmmKind::Qemu, meta())?;
        assert_eq!(m.size_bytes(), 100_012);
        assert_eq!(verify(dir.path(), VmmKind::Qemu)?, m);
        assert!(matches!(
            verify(dir.path(), VmmKind::Firecracker),
            Err(SnapshotError::Incompatible { .. })
        ));
        // Same size, one byte changed.
        let mut mem = vec![7u8; 100_000];
        mem[500] = 8;
        std::fs::write(dir.path().join("memory"), &mem)?;
        let e = verify(dir.path(), VmmKind::Qemu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("memory does not match its checksum"), "{e}");
        // Truncated.
        std::fs::write(dir.path().join("memory"), vec![7u8; 10])?;
        let e = verify(dir.path(), VmmKind::Qemu)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("has 10 bytes"), "{e}");
        // Missing, and replaced by a symlink.
        std::fs::remove_file(dir.path().join("memory"))?;
        assert!(matches!(
            verify(dir.path(), VmmKind::Qemu),
            Err(SnapshotError::Corrupt { .. })
        ));
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("memory"))?;
        assert!(matches!(
            verify(dir.path(), VmmKind::Qemu),
            Err(SnapshotError::Corrupt { .. })
        ));
        // A garbled manifest.
        std::fs::write(dir.path().join(MANIFEST), b"{not json")?;
        assert!(matches!(
            verify(dir.path(), VmmKind::Qemu),
            Err(SnapshotError::Corrupt { .. })
        ));
        Ok(())
    }

    #[test]
    fn driver_file_names_are_checked() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        for bad in ["../x", "", MANIFEST, "a/b"] {
            assert!(
                seal(dir.path(), info(&[bad]), VmmKind::Qemu, meta()).is_err(),
                "{bad}"
            );
        }
        Ok(())
    }
}
