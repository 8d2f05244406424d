//! Pause, resume, snapshot and restore of Firecracker VMs.
//!
//! A snapshot is two files: the device/vCPU state and the guest memory. Firecracker records the paths the VM
//! was configured with (disk, vsock socket) in the state file and reopens them on load:
//! - without the jailer they are relative to the run directory (Firecracker's working directory): the drive
//!   is `rootfs.disk`, a symlink to the VM's disk, and the vsock socket `vsock.sock`, so a snapshot restores
//!   in any run directory with that directory's disk;
//! - with the jailer they are paths inside the chroot (`/disk.ext4`, `/run/vsock.sock`), so a snapshot can be
//!   restored into any sandbox's jail, which is what forking needs.
//!
//! [`FirecrackerVmm::create_snapshot`] and [`FirecrackerVmm::load_snapshot_files`] are the building blocks;
//! the [`crate::Vmm`] trait's `snapshot` and `restore` (in `snapshot_dir`) use them with a snapshot
//! directory: `vm.state`, `vm.mem`, and `disk.ext4` for a checkpoint, all fsynced. Committing a snapshot
//! (manifest, checksums, rename) is the caller's business (SECURITY.md promise 8).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::{FirecrackerVmm, api, api_error, jailer};
use crate::{VmHandle, VmSpec, VmmError};

/// The two files of a full snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFiles {
    /// Device and vCPU state (small).
    pub state: PathBuf,
    /// Guest memory (as large as the guest's RAM, sparse where the guest never wrote).
    pub memory: PathBuf,
}

/// Mode of the snapshot files taken out of a jail: root's and read-only for everyone. Nobody but root can
/// change them (a snapshot is immutable once written, and the daemon keeps it in its private data
/// directory); being readable lets a restore hard-link them into the new VM's jail instead of copying the
/// guest's whole memory (see `jailer::link_readable`).
pub const SNAPSHOT_FILE_MODE: u32 = 0o444;

/// Where a jailed Firecracker reads a snapshot it restores, inside its chroot. A restored VM's memory stays
/// backed by that memory file (mapped copy-on-write), so the snapshots it writes later go elsewhere.
const JAILED_STATE: &str = "/snapshot.state";
const JAILED_MEMORY: &str = "/snapshot.mem";
/// Where a jailed Firecracker writes a snapshot, inside its chroot (taken out at once).
const JAILED_STATE_OUT: &str = "/snapshot-out.state";
const JAILED_MEMORY_OUT: &str = "/snapshot-out.mem";

impl FirecrackerVmm {
    pub(super) fn vm_api_error(vm: &VmHandle, e: &api::ApiError) -> VmmError {
        api_error(&vm.run_dir.display().to_string(), e)
    }

    /// Pauses the vCPUs (`PATCH /vm {state: Paused}`).
    pub async fn pause(&self, vm: &VmHandle) -> Result<(), VmmError> {
        self.api(&vm.run_dir)
            .pause()
            .await
            .map_err(|e| Self::vm_api_error(vm, &e))
    }

    /// Resumes a paused VM.
    pub async fn resume(&self, vm: &VmHandle) -> Result<(), VmmError> {
        self.api(&vm.run_dir)
            .resume()
            .await
            .map_err(|e| Self::vm_api_error(vm, &e))
    }

    /// Writes a full snapshot of a paused VM to `files`.
    pub async fn create_snapshot(&self, vm: &VmHandle, files: &SnapshotFiles) -> Result<(), VmmError> {
        let api = self.api(&vm.run_dir);
        let Some(jail_root) = self.jail_root(&vm.run_dir) else {
            let req = api::SnapshotCreate {
                snapshot_type: api::SnapshotType::Full,
                snapshot_path: files.state.clone(),
                mem_file_path: files.memory.clone(),
            };
            return api
                .create_snapshot(req)
                .await
                .map_err(|e| Self::vm_api_error(vm, &e));
        };
        // The jailed process can only write inside its chroot: write there, then move the files out.
        let req = api::SnapshotCreate {
            snapshot_type: api::SnapshotType::Full,
            snapshot_path: JAILED_STATE_OUT.into(),
            mem_file_path: JAILED_MEMORY_OUT.into(),
        };
        let inner_state = jail_root.join(&JAILED_STATE_OUT[1..]);
        let inner_memory = jail_root.join(&JAILED_MEMORY_OUT[1..]);
        let result = match api.create_snapshot(req).await {
            Ok(()) => take_out(&jail_root, &JAILED_STATE_OUT[1..], &files.state)
                .and_then(|()| take_out(&jail_root, &JAILED_MEMORY_OUT[1..], &files.memory)),
            Err(e) => Err(Self::vm_api_error(vm, &e)),
        };
        // Unlinking names inside the chroot never follows a symlink; the chroot directory itself belongs to
        // root-owned parents, so it cannot be swapped.
        let _ = std::fs::remove_file(&inner_state);
        let _ = std::fs::remove_file(&inner_memory);
        if result.is_err() {
            let _ = std::fs::remove_file(&files.state);
            let _ = std::fs::remove_file(&files.memory);
        }
        result
    }

    /// Starts a fresh Firecracker process for `spec` and loads `files` into it instead of booting. The disk
    /// must be at the path the snapshot recorded (see the module doc). With `resume` the vCPUs run at once;
    /// otherwise the VM stays paused until [`FirecrackerVmm::resume`].
    pub async fn load_snapshot_files(
        &self,
        spec: &VmSpec,
        files: &SnapshotFiles,
        resume: bool,
    ) -> Result<VmHandle, VmmError> {
        let launched = self.launch(spec).await?;
        let (state, memory) = match self.jail_root(&spec.run_dir) {
            None => (files.state.clone(), files.memory.clone()),
            Some(root) => {
                let linked = jailer::link_readable(&files.state, &root.join(&JAILED_STATE[1..]))
                    .and_then(|()| jailer::link_readable(&files.memory, &root.join(&JAILED_MEMORY[1..])));
                if let Err(e) = linked {
                    let err = VmmError::StartFailed {
                        id: spec.id.clone(),
                        detail: format!("putting the snapshot into the jail: {e}"),
                    };
                    return Err(self.abort(spec, launched.proc_id, err).await);
                }
                (JAILED_STATE.into(), JAILED_MEMORY.into())
            }
        };
        let load = api::SnapshotLoad {
            snapshot_path: state,
            mem_backend: api::MemBackend {
                backend_type: api::MemBackendType::File,
                backend_path: memory,
            },
            enable_diff_snapshots: None,
            resume_vm: resume,
        };
        if let Err(e) = launched.api.load_snapshot(load).await {
            return Err(self.abort(spec, launched.proc_id, api_error(&spec.id, &e)).await);
        }
        // The snapshot carries the reset of the source VM's vsock connections, not yet seen by the guest.
        Self::mark_vsock_reset(&spec.run_dir);
        self.finish(spec, &launched, "restored").await
    }

    /// The chroot of a jailed VM in `run_dir`, if this driver jails.
    fn jail_root(&self, run_dir: &Path) -> Option<PathBuf> {
        self.jailer.as_ref()?;
        let iid = super::jailed_instance_id(run_dir, &self.binary)?;
        Some(jailer::Jail::new(run_dir, &self.binary, &iid).root)
    }
}

/// Takes a snapshot file the jailed Firecracker wrote (`name` in the chroot `root`) out to `dest`.
///
/// The jailed process owns the chroot, so the file is opened without following symlinks and must be a
/// regular file with a single link; then exactly that inode is linked to `dest` (copied when `dest` is on
/// another filesystem) and handed to root with [`SNAPSHOT_FILE_MODE`]. A Firecracker that keeps running after the snapshot
/// could still write through descriptors it holds: stop it (or copy) before committing the snapshot.
fn take_out(root: &Path, name: &str, dest: &Path) -> Result<(), VmmError> {
    use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
    use nix::unistd::linkat;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    let src = root.join(name);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source: std::io::Error| VmmError::Io { path, source }
    };
    let dirfd = std::fs::File::open(root).map_err(io(root))?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let file = std::fs::File::from(openat2(&dirfd, name, how).map_err(|e| io(&src)(e.into()))?);
    let meta = file.metadata().map_err(io(&src))?;
    if !meta.is_file() || meta.nlink() != 1 {
        return Err(VmmError::Disk {
            path: src,
            detail: "snapshot output is not a private regular file".into(),
        });
    }
    let magic = format!("/proc/self/fd/{}", file.as_raw_fd());
    match linkat(
        nix::fcntl::AT_FDCWD,
        magic.as_str(),
        nix::fcntl::AT_FDCWD,
        dest,
        AtFlags::AT_SYMLINK_FOLLOW,
    ) {
        Ok(()) => {
            std::os::unix::fs::fchown(&file, Some(0), Some(0)).map_err(io(dest))?;
            file.set_permissions(std::fs::Permissions::from_mode(SNAPSHOT_FILE_MODE))
                .map_err(io(dest))
        }
        Err(nix::Error::EXDEV) => {
            let mut out = std::fs::File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dest)
                .map_err(io(dest))?;
            std::io::copy(&mut &file, &mut out).map_err(io(dest))?;
            out.set_permissions(std::fs::Permissions::from_mode(SNAPSHOT_FILE_MODE))
                .map_err(io(dest))
        }
        Err(e) => Err(io(dest)(e.into())),
    }
}
