//! The [`crate::Vmm`] snapshot seam for Firecracker: a snapshot directory and its [`SnapshotInfo`].
//!
//! `snapshot`: `PATCH /vm Paused` → `PUT /snapshot/create` (Full) → for a checkpoint, a copy of the disk
//! while the vCPUs are stopped, then `Resumed`; for a pause, the process is stopped. A jailed checkpoint
//! replaces the state and memory files by copies, since the jailed process that wrote them runs on. Every file written is
//! fsynced, and the directory too. On failure the VM keeps running (resumed) and the files are removed.
//!
//! `restore`: checks the directory against its [`SnapshotInfo`] (same VMM, same machine shape, the memory
//! file exactly the guest's RAM size: a truncated one would make the guest fault on first touch), then a
//! fresh process loads it with the `File` memory backend and resumes. Firecracker maps that file
//! `MAP_PRIVATE` (copy-on-write: the guest's writes never reach it) and only reads the state file, so one
//! snapshot serves any number of restores; `tests/firecracker_snapshot.rs` checks the files' hashes. A
//! `resume` (the sandbox's own pause, which the daemon removes afterwards) is the exception: its next pause
//! lays a diff snapshot over that memory file (`snapshot.rs`).

use std::path::Path;

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
        let written = self.write_paused(vm, disk, dest, &files, mode).await;
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
    ) -> Result<(), VmmError> {
        let started = std::time::Instant::now();
        // Uses the VM's diff base up (the snapshot resets the dirty-page bitmap a later diff would rely on).
        let diffed = match mode {
            SnapshotMode::Pause => self.create_pause_snapshot(vm, files).await.map(|()| false)?,
            SnapshotMode::Checkpoint => self.create_checkpoint_snapshot(vm, files).await?,
        };
        let created = started.elapsed();
        if mode == SnapshotMode::Checkpoint {
            if self.jailer.is_some() {
                // The jailed process wrote these inodes and runs on: a descriptor it kept could change them
                // later. Replace each with a copy only root ever had open.
                for f in [&files.state, &files.memory] {
                    replace_with_copy(f).await?;
                }
            }
            if diffed {
                // Only now: the copy, never the inode the jailed process may still write through.
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
        self.load_files(spec, &files, true, own).await
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
