//! Snapshot integrity off the hot path.
//!
//! Small files of a snapshot (device state: ~100 KB with guest RAM in its own file) are hashed when the
//! snapshot is sealed and verified before every restore, as before. Large files (guest memory, disk copies,
//! a RAM-carrying migration stream) would cost their size on every pause and resume, so they get a
//! [`Fingerprint`] instead: device, inode, size and modification time, taken when the snapshot is sealed. Any
//! write through the file system changes the modification time, so an altered, truncated or replaced file no
//! longer matches and is refused before a VMM sees it; checking costs one `stat`. The change time is recorded
//! but not compared: linking a snapshot file into a Firecracker jail (a restore, each child of a fork, each
//! create from a memory template) changes it without touching a byte. Putting the modification time back after
//! a write needs the file's owner or root (snapshot files are root's and read-only), and the host's root is
//! trusted (SECURITY.md).
//!
//! After the snapshot is committed, a low-priority background task hashes its large files by content (SHA-256
//! over the non-zero 4 KiB pages, reading only allocated extents: the cost follows the memory the guest
//! touched, not its size) into `hashes.json`, keeping a result only if the file did not change while it was
//! read. A file whose fingerprint no longer matches (restored from a backup, or written and put right again)
//! is then hashed once more and accepted if the content is the same.
//!
//! What this does not catch: bytes changed beneath the file system (a failing disk) in a file whose metadata
//! did not change. Snapshots fetched from object storage are verified chunk by chunk when they arrive.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Files up to this size are hashed when a snapshot is sealed and on every verify.
pub const HASH_AT_SEAL_MAX: u64 = 8 << 20;
/// Content hashes of a snapshot's large files, written by the background task.
pub const HASHES: &str = "hashes.json";
const PAGE: usize = 4096;

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Fingerprint {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl Fingerprint {
    /// Whether `self` and `other` are the same version of one file: same device, inode, size and modification
    /// time (the change time moves with links and ownership, not only with content).
    pub fn same_version(&self, other: &Fingerprint) -> bool {
        (self.dev, self.ino, self.size, self.mtime_ns) == (other.dev, other.ino, other.size, other.mtime_ns)
    }

    pub fn of(meta: &std::fs::Metadata) -> Fingerprint {
        let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
        Fingerprint {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// SHA-256 over `(page index, page)` of every 4 KiB page that is not all zeros, reading only the file's data
/// extents: the same content gives the same hash whether zeros are holes or written.
pub fn content_hash(path: &Path) -> std::io::Result<String> {
    let mut f = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = f.metadata()?.len();
    let end = i64::try_from(len).map_err(|_| std::io::Error::other("file too large"))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut pos: i64 = 0;
    while pos < end {
        let Some(data) = seek(&f, pos, libc::SEEK_DATA)? else {
            break;
        };
        let hole = seek(&f, data, libc::SEEK_HOLE)?.unwrap_or(end);
        // Whole pages: extents start and end on block boundaries.
        let mut at = u64::try_from(data).unwrap_or(0) / PAGE as u64 * PAGE as u64;
        let stop = u64::try_from(hole).unwrap_or(0);
        f.seek(SeekFrom::Start(at))?;
        while at < stop {
            let want = usize::try_from((stop - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = read_full(&mut f, &mut buf[..want])?;
            if n == 0 {
                break;
            }
            for (i, page) in buf[..n].chunks(PAGE).enumerate() {
                if page.iter().any(|b| *b != 0) {
                    let index = at / PAGE as u64 + i as u64;
                    hasher.update(index.to_le_bytes());
                    hasher.update(page);
                }
            }
            at += n as u64;
        }
        pos = hole;
    }
    hasher.update(len.to_le_bytes());
    Ok(hex::encode(hasher.finalize()))
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn seek(f: &File, offset: i64, whence: libc::c_int) -> std::io::Result<Option<i64>> {
    // SAFETY: lseek on an open descriptor has no memory effects.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset, whence) };
    if r >= 0 {
        return Ok(Some(r));
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        _ => Err(e),
    }
}

/// `hashes.json`: file name -> content hash, for files whose fingerprint was as sealed while they were read.
pub fn read_hashes(dir: &Path) -> BTreeMap<String, String> {
    let Ok(f) = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dir.join(HASHES))
    else {
        return BTreeMap::new();
    };
    let mut raw = Vec::new();
    if f.take(1 << 20).read_to_end(&mut raw).is_err() {
        return BTreeMap::new();
    }
    serde_json::from_slice(&raw).unwrap_or_default()
}

pub(crate) fn write_hashes(dir: &Path, hashes: &BTreeMap<String, String>) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{HASHES}.tmp"));
    let mut f = File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&serde_json::to_vec(hashes).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(HASHES))?;
    File::open(dir)?.sync_all()
}

/// Hashes the fingerprinted files of the snapshot in `dir` on a low-priority thread and records the results
/// in `hashes.json`. `files` are the (name, fingerprint) pairs from its manifest.
pub fn hash_in_background(dir: PathBuf, files: Vec<(String, Fingerprint)>) {
    if files.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("snapshot-hash".into())
        .spawn(move || {
            // SAFETY: setpriority on the calling thread (who = 0 is this thread on Linux) touches no memory.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 15) };
            let mut hashes = read_hashes(&dir);
            for (name, sealed) in files {
                let path = dir.join(&name);
                let unchanged = || {
                    std::fs::symlink_metadata(&path).is_ok_and(|m| Fingerprint::of(&m).same_version(&sealed))
                };
                if !unchanged() {
                    continue;
                }
                match content_hash(&path) {
                    Ok(h) if unchanged() => {
                        hashes.insert(name, h);
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!(path = %path.display(), error = %e, "hashing a snapshot file"),
                }
            }
            if dir.is_dir()
                && let Err(e) = write_hashes(&dir, &hashes)
            {
                tracing::debug!(dir = %dir.display(), error = %e, "writing snapshot hashes");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the snapshot hashing thread");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_hash_ignores_how_zeros_are_stored() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let sparse = dir.path().join("sparse");
        let dense = dir.path().join("dense");
        let mut f = File::create(&sparse)?;
        f.set_len(8 << 20)?;
        f.seek(SeekFrom::Start(3 << 20))?;
        f.write_all(b"guest page")?;
        drop(f);
        let mut d = vec![0u8; 8 << 20];
        d[3 << 20..(3 << 20) + 10].copy_from_slice(b"guest page");
        std::fs::write(&dense, &d)?;
        assert_eq!(content_hash(&sparse)?, content_hash(&dense)?);
        d[5 << 20] = 1;
        std::fs::write(&dense, &d)?;
        assert_ne!(content_hash(&sparse)?, content_hash(&dense)?);
        // Length counts: trailing zeros beyond the old end make another file.
        let f = File::options().write(true).open(&sparse)?;
        f.set_len(9 << 20)?;
        assert_ne!(content_hash(&sparse)?, content_hash(&dense)?);
        Ok(())
    }

    #[test]
    fn fingerprints_change_with_any_write() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let p = dir.path().join("f");
        std::fs::write(&p, b"abc")?;
        let before = Fingerprint::of(&std::fs::metadata(&p)?);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&p, b"abc")?;
        assert!(!before.same_version(&Fingerprint::of(&std::fs::metadata(&p)?)));
        Ok(())
    }

    #[test]
    fn a_link_into_a_jail_is_not_a_new_version() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let p = dir.path().join("vm.mem");
        std::fs::write(&p, b"memory")?;
        let sealed = Fingerprint::of(&std::fs::metadata(&p)?);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::hard_link(&p, dir.path().join("jailed"))?;
        let linked = Fingerprint::of(&std::fs::metadata(&p)?);
        assert_ne!(sealed.ctime_ns, linked.ctime_ns, "a link changes the change time");
        assert!(sealed.same_version(&linked));
        std::fs::remove_file(dir.path().join("jailed"))?;
        assert!(sealed.same_version(&Fingerprint::of(&std::fs::metadata(&p)?)));
        Ok(())
    }
}
