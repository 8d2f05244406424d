//! Disk images: their formats and how they are copied.
//!
//! A guest is root on its own disk and can write any bytes anywhere in it, including a qcow2, VMDK or VHDX
//! header at offset 0 that names a host file as its backing store or extent. So the host never guesses a disk's
//! format from its bytes: every image is opened with its format named, and that format comes from hearth's own
//! records ([`DiskFormat`]: raw for template images and Firecracker disks, qcow2 only for the overlays hearth
//! created with `qemu-img create`). Before a qcow2 image hearth did not create in this very call is used as a
//! backing file (a checkpoint's disk copy, when forking), [`check_qcow2_chain`] reads its backing chain without
//! opening it and refuses anything but plain absolute paths to raw or qcow2 images.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The format of a disk image, as hearth recorded it when it wrote the image.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum DiskFormat {
    /// Plain bytes: template images (built by images/build.sh or flattened from a checkpoint) and every
    /// Firecracker disk.
    Raw,
    /// A qcow2 overlay that hearth created over a backing image of a recorded format (QEMU sandbox disks and
    /// their checkpoint copies).
    Qcow2,
}

impl DiskFormat {
    /// The name QEMU's tools use (`-f`, `-F`, `-O`, `format=`).
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }
}

/// How deep a backing chain may be (a fork of a fork of ... adds one level per generation).
pub const MAX_CHAIN_DEPTH: usize = 64;

/// Checks the backing chain of a qcow2 image before anything opens the chain: each level is read with
/// `qemu-img info -f qcow2` (which does not open backing files) and must name its backing file by a plain
/// absolute path (no `json:` or protocol filename) to an existing regular file, with its format recorded as
/// `raw` or `qcow2`. Returns the chain from `path` down to the raw image at its bottom.
pub async fn check_qcow2_chain(qemu_img: &Path, path: &Path) -> Result<Vec<(PathBuf, DiskFormat)>, String> {
    let mut chain = vec![(path.to_path_buf(), DiskFormat::Qcow2)];
    let mut current = path.to_path_buf();
    for _ in 0..MAX_CHAIN_DEPTH {
        let info = qcow2_info(qemu_img, &current).await?;
        let Some(backing) = info.backing else {
            return Ok(chain);
        };
        let format = info.backing_format.ok_or_else(|| {
            format!(
                "{}: backing file {backing:?} has no recorded format",
                current.display()
            )
        })?;
        let next = plain_backing_path(&current, &backing)?;
        chain.push((next.clone(), format));
        if format == DiskFormat::Raw {
            return Ok(chain);
        }
        current = next;
    }
    Err(format!(
        "{}: backing chain deeper than {MAX_CHAIN_DEPTH}",
        path.display()
    ))
}

/// What `qemu-img info` says about one qcow2 image.
struct Qcow2Info {
    backing: Option<String>,
    backing_format: Option<DiskFormat>,
}

async fn qcow2_info(qemu_img: &Path, path: &Path) -> Result<Qcow2Info, String> {
    // `-U`: the image may be a backing file that running VMs hold a shared lock on.
    let out = tokio::process::Command::new(qemu_img)
        .args(["info", "-U", "-f", "qcow2", "--output=json", "--"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| format!("{}: {e}", qemu_img.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} is not a usable qcow2 image: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("qemu-img info {}: {e}", path.display()))?;
    if v.get("format").and_then(|f| f.as_str()) != Some("qcow2") {
        return Err(format!("{} is not read as qcow2", path.display()));
    }
    let backing = v
        .get("backing-filename")
        .and_then(|b| b.as_str())
        .map(str::to_owned);
    let backing_format = match v.get("backing-filename-format").and_then(|f| f.as_str()) {
        None => None,
        Some("raw") => Some(DiskFormat::Raw),
        Some("qcow2") => Some(DiskFormat::Qcow2),
        Some(other) => {
            return Err(format!(
                "{}: backing format {other:?} is not one hearth writes",
                path.display()
            ));
        }
    };
    Ok(Qcow2Info {
        backing,
        backing_format,
    })
}

/// A backing file name as hearth writes them: an absolute path (never `json:{...}`, a protocol such as
/// `nbd:` or `http://`, or a path relative to the image) to an existing regular file.
fn plain_backing_path(image: &Path, name: &str) -> Result<PathBuf, String> {
    let bad = |why: &str| format!("{}: backing file {name:?} refused: {why}", image.display());
    if !name.starts_with('/') {
        return Err(bad(
            "not an absolute path (json: and protocol names are never followed)",
        ));
    }
    if name.bytes().any(|b| b == 0 || b == b'\n') {
        return Err(bad("control characters"));
    }
    let path = PathBuf::from(name);
    let meta = std::fs::metadata(&path).map_err(|e| bad(&e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file"));
    }
    Ok(path)
}

/// Copies `src` into a new file `dest` (mode 0600; it must not exist) and fsyncs it: a reflink (`FICLONE`)
/// where the file system shares extents, else only the data extents (`SEEK_DATA`/`SEEK_HOLE` with
/// `copy_file_range`), so holes stay holes. Blocking: call it from a blocking thread. On error `dest` is removed.
pub fn copy_sparse(src: &Path, dest: &Path) -> io::Result<()> {
    copy_sparse_unsynced(src, dest)?;
    let synced = File::open(dest).and_then(|f| f.sync_all());
    if synced.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    synced
}

/// [`copy_sparse`] without the fsync: for copies taken while a VM waits, made durable once it runs again.
pub fn copy_sparse_unsynced(src: &Path, dest: &Path) -> io::Result<()> {
    copy_unsynced(src, dest).map(|_| ())
}

/// How a copy was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyMethod {
    /// The file system shares the extents (`FICLONE`): no data was copied.
    Reflink,
    /// Only the data extents were copied; holes stay holes.
    Sparse,
}

/// [`copy_sparse_unsynced`], saying whether the file system could share the extents.
pub fn copy_unsynced(src: &Path, dest: &Path) -> io::Result<CopyMethod> {
    let from = File::open(src)?;
    let to = File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)?;
    let copied = clone_or_copy(&from, &to);
    if copied.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    copied
}

/// The part of [`crate::Vmm::capture_disk`] every driver shares, called once the driver has stopped the vCPUs
/// (at `stopped_at`): copies `disk` to `dest` ([`copy_unsynced`], on a blocking thread), awaits `resume` (the
/// driver's continue) whether or not the copy worked, then makes the copy durable. Any failure removes `dest`.
pub async fn capture_while_stopped(
    disk: &Path,
    dest: &Path,
    format: crate::DiskFormat,
    stopped_at: std::time::Instant,
    resume: impl std::future::Future<Output = Result<(), crate::VmmError>>,
) -> Result<crate::DiskCapture, crate::VmmError> {
    let err = |detail: String| crate::VmmError::Snapshot {
        path: dest.to_path_buf(),
        detail,
    };
    let (from, to) = (disk.to_path_buf(), dest.to_path_buf());
    let copied = tokio::task::spawn_blocking(move || copy_unsynced(&from, &to))
        .await
        .map_err(|e| err(format!("copy task: {e}")))
        .and_then(|r| r.map_err(|e| err(format!("copying {}: {e}", disk.display()))));
    let resumed = resume.await;
    let stopped = stopped_at.elapsed();
    let method = copied?;
    let to = dest.to_path_buf();
    let durable = match resumed {
        Ok(()) => tokio::task::spawn_blocking(move || File::open(&to).and_then(|f| f.sync_all()))
            .await
            .map_err(|e| err(format!("fsync task: {e}")))
            .and_then(|r| r.map_err(|e| err(format!("fsync: {e}")))),
        Err(e) => Err(e),
    };
    if let Err(e) = durable {
        let _ = std::fs::remove_file(dest);
        return Err(e);
    }
    Ok(crate::DiskCapture {
        stopped,
        method,
        format,
    })
}

/// [`copy_sparse`] on a blocking thread, with the driver's error type.
pub async fn copy_raw(src: &Path, dest: &Path) -> Result<(), crate::VmmError> {
    let (from, to) = (src.to_path_buf(), dest.to_path_buf());
    let disk_err = |detail: String| crate::VmmError::Disk {
        path: dest.to_path_buf(),
        detail,
    };
    tokio::task::spawn_blocking(move || copy_sparse(&from, &to))
        .await
        .map_err(|e| disk_err(format!("copy task: {e}")))?
        .map_err(|e| disk_err(format!("copying {}: {e}", src.display())))
}

/// Copies all of `from` into `to` (which must be empty): a reflink where the file system shares extents, else
/// only the data extents, so holes stay holes. Blocking.
pub(crate) fn clone_or_copy(from: &File, to: &File) -> io::Result<CopyMethod> {
    // SAFETY: FICLONE takes the source descriptor as its argument; both descriptors are open for the call.
    let cloned = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONE, from.as_raw_fd()) };
    if cloned == 0 {
        return Ok(CopyMethod::Reflink);
    }
    let len = from.metadata()?.len();
    to.set_len(len)?;
    overlay_data(from, to, len)?;
    Ok(CopyMethod::Sparse)
}

/// Whether no open file description anywhere on the host can write to `file`'s inode: a descriptor of any
/// process, a shared mapping (which keeps its file open after the descriptor is closed), one passed to
/// another process or registered with io_uring. Asked of the kernel by taking a read lease, which it refuses
/// while the inode is open for writing (`F_SETLEASE`, `F_RDLCK`: fcntl(2)), and released at once. `file` must
/// be open read-only and the caller must own it or have `CAP_LEASE`. Any error (leases disabled, a file
/// system without them) answers no. Blocking only for the two calls.
pub(crate) fn no_writer_anywhere(file: &File) -> bool {
    // SAFETY: F_SETLEASE takes an int argument and has no memory effects.
    let leased = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) } == 0;
    if leased {
        // SAFETY: as above.
        unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
    }
    leased
}

/// Writes every data extent of `from` (found with `SEEK_DATA`/`SEEK_HOLE`) below `limit` into `to` at the same
/// offset, leaving the rest of `to` as it was; returns the bytes written. A sparse file of changed pages laid
/// over a whole image this way gives the changed image. Blocking.
pub fn overlay_data(from: &File, to: &File, limit: u64) -> io::Result<u64> {
    let end = i64::try_from(limit).map_err(|_| io::Error::other("file too large"))?;
    let mut pos: i64 = 0;
    let mut written = 0u64;
    while pos < end {
        let Some(data) = seek(from, pos, libc::SEEK_DATA)? else {
            break; // only a hole is left
        };
        if data >= end {
            break;
        }
        let hole = seek(from, data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        copy_range(from, to, data, hole)?;
        written += u64::try_from(hole - data).unwrap_or(0);
        pos = hole;
    }
    Ok(written)
}

/// `lseek` with `SEEK_DATA`/`SEEK_HOLE`; `None` when there is no more data (ENXIO).
fn seek(f: &File, offset: i64, whence: libc::c_int) -> io::Result<Option<i64>> {
    // SAFETY: lseek on an open descriptor has no memory effects.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset, whence) };
    if r >= 0 {
        return Ok(Some(r));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        _ => Err(e),
    }
}

fn copy_range(from: &File, to: &File, start: i64, end: i64) -> io::Result<()> {
    let (mut off_in, mut off_out) = (start, start);
    while off_in < end {
        let want = usize::try_from(end - off_in).unwrap_or(usize::MAX).min(1 << 30);
        // SAFETY: both descriptors are open; the offsets are valid pointers to local i64s that the kernel
        // advances by the bytes copied.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        match n {
            n if n > 0 => {}
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "source shrank while copying",
                ));
            }
            _ => return Err(io::Error::last_os_error()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn a_writer_anywhere_is_seen_descriptor_mapping_or_another_process() {
        use std::os::unix::io::AsRawFd;
        let dir = tempfile::tempdir().expect("test file operation");
        let path = dir.path().join("mem");
        std::fs::write(&path, vec![7u8; 8192]).expect("test file operation");
        let reader = File::open(&path).expect("test file operation");
        assert!(super::no_writer_anywhere(&reader), "only a reader");
        // A descriptor open for writing, here.
        let w = File::options()
            .write(true)
            .open(&path)
            .expect("test file operation");
        assert!(!super::no_writer_anywhere(&reader), "a writable descriptor");
        drop(w);
        assert!(super::no_writer_anywhere(&reader), "the writer closed");
        // A shared writable mapping outlives its descriptor.
        let rw = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .expect("test file operation");
        // SAFETY: a fresh mapping of 8 KiB of a file of that length; unmapped below, never dereferenced.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                rw.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        drop(rw);
        assert!(!super::no_writer_anywhere(&reader), "a shared writable mapping");
        // SAFETY: the mapping made above, of that length.
        assert_eq!(unsafe { libc::munmap(map, 8192) }, 0);
        assert!(super::no_writer_anywhere(&reader), "unmapped");
        // Another process holding it open for appending (`sleep` replaces the shell: no child keeps fd 3).
        let mut holder = std::process::Command::new("sh")
            .args(["-c", "exec 3>>\"$0\"; echo held; exec sleep 60"])
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("test file operation");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.as_mut().expect("test file operation")),
            &mut line,
        )
        .expect("test file operation");
        assert_eq!(line, "held\n");
        assert!(
            !super::no_writer_anywhere(&reader),
            "another process's descriptor"
        );
        holder.kill().expect("test file operation");
        holder.wait().expect("test file operation");
        assert!(super::no_writer_anywhere(&reader), "that process gone");
    }

    #[test]
    fn copy_keeps_bytes_and_holes() {
        let dir = tempfile::tempdir().expect("test step");
        let src = dir.path().join("src");
        let mut f = File::create(&src).expect("test step");
        f.set_len(64 << 20).expect("test step");
        f.write_all(b"head").expect("test step");
        f.seek(SeekFrom::Start(32 << 20)).expect("test step");
        f.write_all(&[7u8; 8192]).expect("test step");
        drop(f);
        let dest = dir.path().join("dest");
        copy_sparse(&src, &dest).expect("test step");
        assert_eq!(
            std::fs::read(&src).expect("test step"),
            std::fs::read(&dest).expect("test step")
        );
        let meta = std::fs::metadata(&dest).expect("test step");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(meta.mode() & 0o777, 0o600);
        // Holes stay holes (or extents are shared): far less than the apparent 64 MiB is allocated.
        assert!(meta.blocks() * 512 < 4 << 20, "{} blocks", meta.blocks());
        // The destination must be new.
        assert_eq!(
            copy_sparse(&src, &dest).expect_err("must fail").kind(),
            io::ErrorKind::AlreadyExists
        );
    }

    #[test]
    fn overlay_writes_the_data_extents_and_leaves_the_rest() {
        // A base image of 8 MiB of 0x11, and a sparse diff of the same size with pages at 1 MiB (two) and at
        // 7 MiB (one, all zeros: written data, not a hole), as a diff snapshot writes dirty pages.
        let dir = tempfile::tempdir().expect("test step");
        let mut image = vec![0x11u8; 8 << 20];
        std::fs::write(dir.path().join("base"), &image).expect("test step");
        let diff_path = dir.path().join("diff");
        let mut d = File::create(&diff_path).expect("test step");
        d.set_len(8 << 20).expect("test step");
        d.seek(SeekFrom::Start(1 << 20)).expect("test step");
        d.write_all(&[0xAAu8; 8192]).expect("test step");
        d.seek(SeekFrom::Start(7 << 20)).expect("test step");
        d.write_all(&[0u8; 4096]).expect("test step");
        drop(d);
        let diff = File::open(&diff_path).expect("test step");
        let base = File::options()
            .read(true)
            .write(true)
            .open(dir.path().join("base"))
            .expect("test step");
        let written = overlay_data(&diff, &base, 8 << 20).expect("overlay");
        // The file system may allocate whole blocks around the data: at least the 12 KiB, far less than 8 MiB.
        assert!((12 << 10..1 << 20).contains(&written), "{written} bytes");
        image[1 << 20..(1 << 20) + 8192].fill(0xAA);
        image[7 << 20..(7 << 20) + 4096].fill(0);
        assert_eq!(std::fs::read(dir.path().join("base")).expect("test step"), image);
        // A limit below the extents writes nothing.
        assert_eq!(overlay_data(&diff, &base, 1 << 20).expect("overlay"), 0);
    }

    #[test]
    fn backing_names_hearth_never_writes_are_refused() {
        let dir = tempfile::tempdir().expect("test step");
        let img = dir.path().join("img");
        let real = dir.path().join("base.raw");
        File::create(&real).expect("test step");
        for name in [
            "json:{\"driver\":\"raw\",\"file\":{\"filename\":\"/etc/shadow\"}}",
            "nbd:127.0.0.1:10809",
            "http://127.0.0.1/x",
            "relative/base.raw",
            "/nonexistent/base.raw",
            "/dev/null",
            "/",
        ] {
            assert!(plain_backing_path(&img, name).is_err(), "{name}");
        }
        assert_eq!(
            plain_backing_path(&img, real.to_str().expect("utf-8 path")).expect("test step"),
            real
        );
    }
}
