//! The [`crate::Vmm`] snapshot seam for Firecracker: a snapshot directory and its [`SnapshotInfo`].
//!
//! `snapshot`: `PATCH /vm Paused` → `PUT /snapshot/create` (Full) → for a checkpoint, a copy of the disk
//! while the vCPUs are stopped, then `Resumed`; for a pause, the process is stopped. The jailed process that
//! wrote a checkpoint's state and memory files runs on: each is kept only once the kernel says no open file
//! description anywhere can write to it (a read lease; the file is root's and read-only by then, so none can
//! be opened again), otherwise replaced by a copy. Every file written is fsynced, and the directory too. On failure the VM keeps running (resumed) and the files are removed.
//!
//! `restore`: checks the directory against its [`SnapshotInfo`] (same VMM, same machine shape, the memory
//! file exactly the guest's RAM size: a truncated one would make the guest fault on first touch), then a
//! fresh process loads it with the `File` memory backend and resumes. Firecracker maps that file
//! `MAP_PRIVATE` (copy-on-write: the guest's writes never reach it) and only reads the state file, so one
//! snapshot serves any number of restores; `tests/firecracker_snapshot.rs` checks the files' hashes. A
//! `resume` (the sandbox's own pause, which the daemon removes afterwards) is the exception: its next pause
//! lays a diff snapshot over that memory file (`snapshot.rs`). Any other restore of a jailed VM keeps the
//! snapshot's memory file (a link, never written) as the base its first snapshot's diff is laid over a copy of.

use std::path::Path;

use super::snapshot::Origin;
use super::{FirecrackerVmm, SnapshotFiles};
use crate::{SnapshotInfo, SnapshotMode, VmHandle, VmSpec, VmmError, VmmKind};

/// File names in a snapshot directory.
pub const STATE_FILE: &str = "vm.state";
pub const MEMORY_FILE: &str = "vm.mem";
pub const DISK_FILE: &str = "disk.ext4";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> VmmError + '_ {
    move |source| VmmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn snap_err(path: &Path, detail: impl Into<String>) -> VmmError {
    VmmError::Snapshot {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// fsync a file (opened read-only: fsync needs no write access) or a directory.
fn fsync(path: &Path) -> Result<(), VmmError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// The files of the snapshot in `dir`.
pub fn files_in(dir: &Path) -> SnapshotFiles {
    SnapshotFiles {
        state: dir.join(STATE_FILE),
        memory: dir.join(MEMORY_FILE),
    }
}

impl FirecrackerVmm {
    /// [`crate::Vmm::snapshot`] for Firecracker.
    pub(super) async fn snapshot_to_dir(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, VmmError> {
        if std::fs::read_dir(dest).map_err(io(dest))?.next().is_some() {
            return Err(snap_err(dest, "the snapshot directory is not empty"));
        }
        let api = self.api(&vm.run_dir);
        // The machine shape first, while nothing has changed yet.
        let cfg = api.vm_config().await.map_err(|e| Self::vm_api_error(vm, &e))?;
        let shape = |key: &str| {
            cfg["machine-config"][key]
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| snap_err(dest, format!("GET /vm/config has no machine-config.{key}")))
        };
        let (memory_mib, vcpus) = (shape("mem_size_mib")?, shape("vcpu_count")?);
        let started = std::time::Instant::now();
        self.pause(vm).await?;
        let paused = started.elapsed();
        let files = files_in(dest);
        let guest_bytes = u64::from(memory_mib) << 20;
        let written = self.write_paused(vm, disk, dest, &files, mode, guest_bytes).await;
        let saved = started.elapsed();
        let result = match written {
            Ok(()) => match mode {
                SnapshotMode::Checkpoint => {
                    // Writing the snapshot reset the running guest's vsock connections (pending until it sees it).
                    Self::mark_vsock_reset(&vm.run_dir);
                    self.resume(vm).await
                }
                // The state is saved (Firecracker fsynced it): the process has nothing left to do, and a
                // jailed one is PID 1 of its namespace, which ignores the SIGTERM of a plain stop (3 s of grace).
                SnapshotMode::Pause => self.stop_within(vm, std::time::Duration::ZERO).await,
            },
            Err(e) => {
                // A failed snapshot must not leave the sandbox frozen.
                if let Err(r) = self.resume(vm).await {
                    tracing::error!(vm = %vm.run_dir.display(), error = %r, "cannot resume after a failed snapshot");
                }
                Err(e)
            }
        };
        if let Err(e) = result {
            for name in [STATE_FILE, MEMORY_FILE, DISK_FILE] {
                let _ = std::fs::remove_file(dest.join(name));
            }
            return Err(e);
        }
        tracing::info!(vm = %vm.run_dir.display(), ?mode, pause_ms = paused.as_millis() as u64,
            save_ms = (saved - paused).as_millis() as u64, after_ms = (started.elapsed() - saved).as_millis() as u64,
            "firecracker snapshot");
        let mut names = vec![STATE_FILE.to_string(), MEMORY_FILE.to_string()];
        let disk_copy = (mode == SnapshotMode::Checkpoint).then(|| DISK_FILE.to_string());
        names.extend(disk_copy.clone());
        Ok(SnapshotInfo {
            kind: VmmKind::Firecracker,
            vmm_version: self.version.clone(),
            files: names,
            disk_format: disk_copy.as_ref().map(|_| crate::DiskFormat::Raw),
            disk: disk_copy,
            memory_mib,
            vcpus,
            memory_file: None,
            features: Vec::new(),
        })
    }

    /// While the VM is paused: state and memory, the disk copy for a checkpoint, all fsynced.
    async fn write_paused(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
        files: &SnapshotFiles,
        mode: SnapshotMode,
        guest_bytes: u64,
    ) -> Result<(), VmmError> {
        let started = std::time::Instant::now();
        // Uses the VM's diff base up (the snapshot resets the dirty-page bitmap a later diff would rely on).
        let diffed = match mode {
            SnapshotMode::Pause => self
                .create_pause_snapshot(vm, files, guest_bytes)
                .await
                .map(|()| false)?,
            SnapshotMode::Checkpoint => self.create_checkpoint_snapshot(vm, files, guest_bytes).await?,
        };
        let created = started.elapsed();
        if mode == SnapshotMode::Checkpoint {
            if self.jailer.is_some() {
                // The jailed process wrote these inodes and runs on: a descriptor or mapping it kept could
                // change them later. Each is kept only if nothing anywhere can write to it any more, else
                // replaced with a copy only root ever had open.
                for f in [&files.state, &files.memory] {
                    seal_or_copy(f).await?;
                }
            }
            if diffed {
                // Only now: a sealed file or the copy, never an inode the jailed process may still write through.
                Self::record_checkpoint_base(&vm.run_dir, &files.memory);
            }
            copy_disk(disk, &dest.join(DISK_FILE)).await?;
        }
        let (state, memory, dir) = (files.state.clone(), files.memory.clone(), dest.to_path_buf());
        let copy = (mode == SnapshotMode::Checkpoint).then(|| dest.join(DISK_FILE));
        let copied = started.elapsed();
        let synced = tokio::task::spawn_blocking(move || {
            for f in [Some(state), Some(memory), copy].into_iter().flatten() {
                fsync(&f)?;
            }
            fsync(&dir)
        })
        .await
        .map_err(|e| snap_err(dest, format!("fsync task: {e}")))?;
        tracing::debug!(vm = %vm.run_dir.display(), create_ms = created.as_millis() as u64,
            copy_ms = (copied - created).as_millis() as u64, fsync_ms = (started.elapsed() - copied).as_millis() as u64,
            "firecracker snapshot files");
        synced
    }

    /// [`crate::Vmm::restore`] for Firecracker, and with `own` [`crate::Vmm::resume`]: the sandbox's own paused
    /// state, whose memory file the resumed VM then takes over as the base of its next pause's diff (see
    /// `snapshot.rs`).
    pub(super) async fn restore_from_dir(
        &self,
        spec: &VmSpec,
        dir: &Path,
        info: &SnapshotInfo,
        own: bool,
    ) -> Result<VmHandle, VmmError> {
        if info.kind != VmmKind::Firecracker {
            return Err(snap_err(
                dir,
                format!("taken by {}, not firecracker", info.kind.as_str()),
            ));
        }
        if info.vmm_version != self.version {
            // Firecracker refuses state files of another snapshot version itself; say which binaries.
            tracing::warn!(snapshot = %dir.display(), taken_by = %info.vmm_version, restoring_with = %self.version,
                "restoring a snapshot taken by another Firecracker version");
        }
        if (info.memory_mib, info.vcpus) != (spec.memory_mib, spec.vcpus) {
            return Err(snap_err(
                dir,
                format!(
                    "taken with {} MiB and {} vCPUs, restore asks for {} MiB and {} vCPUs",
                    info.memory_mib, info.vcpus, spec.memory_mib, spec.vcpus
                ),
            ));
        }
        let files = files_in(dir);
        let state = std::fs::metadata(&files.state).map_err(io(&files.state))?;
        let memory = std::fs::metadata(&files.memory).map_err(io(&files.memory))?;
        if !state.is_file() || state.len() == 0 {
            return Err(snap_err(&files.state, "state file missing or empty"));
        }
        let want = u64::from(info.memory_mib) * 1024 * 1024;
        if !memory.is_file() || memory.len() != want {
            return Err(snap_err(
                &files.memory,
                format!("memory file has {} bytes, the guest has {want}", memory.len()),
            ));
        }
        let origin = if own {
            Origin::Own
        } else if crate::feature_off(super::FEATURES_OFF_VAR, super::FEATURE_RESTORE_DIFF) {
            Origin::Untracked
        } else {
            Origin::Checkpoint
        };
        self.load_files(spec, &files, true, origin).await
    }
}

impl FirecrackerVmm {
    /// [`crate::Vmm::capture_disk`] for Firecracker: `PATCH /vm Paused`, copy the disk, `Resumed`, fsync.
    pub(super) async fn capture_disk_to(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
    ) -> Result<crate::DiskCapture, VmmError> {
        let started = std::time::Instant::now();
        self.pause(vm).await?;
        crate::disk::capture_while_stopped(disk, dest, crate::DiskFormat::Raw, started, self.resume(vm)).await
    }
}

/// Makes sure the snapshot file at `path`, written by a jailed process that runs on, can never change again:
/// kept as it is if it is a regular root-owned file nobody may write (mode), with no other name, and no open
/// file description anywhere can write to it (`disk::no_writer_anywhere`: a descriptor or shared mapping the
/// process kept, or passed on). Nothing can then open it for writing again: only root may. Otherwise it is
/// replaced by a copy ([`replace_with_copy`]). Returns whether it was copied.
async fn seal_or_copy(path: &Path) -> Result<bool, VmmError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let p = path.to_path_buf();
    let sealed = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&p)
            .ok()?;
        let meta = file.metadata().ok()?;
        let private = meta.is_file() && meta.uid() == 0 && meta.mode() & 0o7222 == 0 && meta.nlink() == 1;
        Some(private && crate::disk::no_writer_anywhere(&file))
    })
    .await
    .ok()
    .flatten()
    .unwrap_or(false);
    if sealed && !crate::feature_off(super::FEATURES_OFF_VAR, super::FEATURE_SEAL_IN_PLACE) {
        return Ok(false);
    }
    tracing::debug!(file = %path.display(), "a snapshot file may still be written by its VMM: copied");
    replace_with_copy(path).await.map(|()| true)
}

/// Replaces `path` by a fresh copy of itself (a new inode, root's, [`super::snapshot::SNAPSHOT_FILE_MODE`]).
async fn replace_with_copy(path: &Path) -> Result<(), VmmError> {
    let tmp = path.with_extension("copy");
    let _ = std::fs::remove_file(&tmp); // left by an interrupted attempt
    copy_disk(path, &tmp).await?;
    let done = std::fs::set_permissions(
        &tmp,
        std::os::unix::fs::PermissionsExt::from_mode(super::snapshot::SNAPSHOT_FILE_MODE),
    )
    .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    Ok(())
}

/// Copies the disk (reflink when the file system can, sparse otherwise) and fsyncs the copy.
async fn copy_disk(src: &Path, dest: &Path) -> Result<(), VmmError> {
    crate::disk::copy_raw(src, dest).await
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A snapshot file (root's, read-only) with `links` names and an open writer or not: kept or copied.
    #[tokio::test]
    async fn a_checkpoint_file_is_kept_only_when_nothing_can_write_it() {
        let dir = tempfile::tempdir().expect("test file operation");
        let make = |name: &str, mode: u32| {
            let path = dir.path().join(name);
            std::fs::write(&path, b"guest memory").expect("test file operation");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .expect("test file operation");
            (
                path.clone(),
                std::fs::metadata(&path).expect("test file operation").ino(),
            )
        };
        let kept = |path: &std::path::Path, ino: u64| {
            let meta = std::fs::metadata(path).expect("test file operation");
            assert_eq!(std::fs::read(path).expect("test file operation"), b"guest memory");
            meta.ino() == ino
        };
        // Nothing holds it: kept as it is.
        let (path, ino) = make("free", 0o444);
        assert!(!super::seal_or_copy(&path).await.expect("test file operation"));
        assert!(kept(&path, ino));
        // A writable descriptor opened before it was made read-only (as a jailed process may keep one).
        let (path, ino) = make("held", 0o600);
        let writer = std::fs::File::options()
            .write(true)
            .open(&path)
            .expect("test file operation");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).expect("test file operation");
        assert!(super::seal_or_copy(&path).await.expect("test file operation"));
        assert!(!kept(&path, ino), "copied: the writer holds the old inode");
        let copy = std::fs::metadata(&path).expect("test file operation");
        assert_eq!((copy.uid(), copy.mode() & 0o777), (0, 0o444));
        drop(writer);
        // Writable by its mode, or with a second name: copied.
        let (path, ino) = make("writable", 0o644);
        assert!(super::seal_or_copy(&path).await.expect("test file operation"));
        assert!(!kept(&path, ino));
        let (path, ino) = make("linked", 0o444);
        std::fs::hard_link(&path, dir.path().join("second-name")).expect("test file operation");
        assert!(super::seal_or_copy(&path).await.expect("test file operation"));
        assert!(!kept(&path, ino));
    }
}
