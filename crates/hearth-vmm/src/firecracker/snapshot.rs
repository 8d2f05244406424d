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
//!
//! Re-pauses write what changed: a jailed VM resumed from its own paused state (`Vmm::resume`, not a fork or
//! template restore) is loaded with dirty-page tracking, and the memory file it maps copy-on-write is then
//! its alone (the daemon removes the pause once the resume succeeded; the jail's link is the file's only
//! name). Its next pause asks Firecracker for a diff snapshot into that very file: Firecracker writes only
//! the pages dirtied since the load (which its private mapping has already copied, so its own view of the
//! file does not change), and the file becomes the new pause's `vm.mem`: the cost is the memory the guest
//! wrote, not its size. The file is checked first (the inode recorded at the load from the snapshot's path
//! outside the jail, a regular root-owned file whose only name is the jail's, opened beneath the jail
//! without following symlinks); it belongs to the jail's uid only for the snapshot call. Anything else, and
//! any failure on the way, gives a full snapshot into a new file as before.
//!
//! The first pause after a cold boot writes what was written since the boot: a jailed VM boots with
//! dirty-page tracking (`track_dirty_pages`), and right after its start the driver puts an empty root-owned
//! file at the jail's memory file name and records it as the diff base. Its guest memory is anonymous and
//! starts as zeros, and Firecracker's dirty bitmap covers both the guest's writes (KVM's dirty log) and its
//! own (the kernel and initramfs it loads, boot tables, virtio rings), so the diff of everything since the
//! boot laid over an empty file of guest memory's size (sparse: holes read as zeros) is the whole memory, as
//! Firecracker's snapshot documentation describes for a fresh microVM. A 2 GiB guest that touched 150 MiB
//! pauses by writing 150 MiB, not 2 GiB.
//!
//! A checkpoint (fork, template) of a VM with a diff base (laid at the boot, or recorded at its resume) is a
//! diff too, laid over a sparse copy of the base (its data extents only) at the jail's output name, then
//! taken out like a full snapshot: it writes the memory the guest touched, never all of it. The snapshot
//! resets Firecracker's dirty bitmap, so the checkpoint's own memory file (root's, read-only, shared with
//! what is made from it) becomes the VM's base, linked in its run directory: its next pause or checkpoint is
//! a diff laid over a copy of it in turn.
//!
//! A VM restored from a checkpoint (a fork's child, a sandbox of a memory template) starts the same way: it
//! is loaded with dirty-page tracking and the checkpoint's memory file (root's, read-only, whose contents are
//! the VM's memory at the load) is linked in its run directory as that base. Its first pause or checkpoint
//! is a diff over a copy of it, instead of a full snapshot that reads every page of its private mapping
//! (every hole of the sparse file a page the kernel allocates and zeroes).
//!
//! Every base is checked before it is used: its length is guest memory's exactly (or 0 for the boot's),
//! so a file grown or cut by anyone never makes the host copy more than a guest's memory.

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
/// In the run directory of a VM resumed from its own paused state: device and inode number of the memory file
/// it maps (`JAILED_MEMORY`), the base its next pause lays a diff snapshot over (see the module doc). Removed
/// by every load and every checkpoint (a snapshot resets the dirty-page bitmap, which must cover everything
/// since that file's contents).
const DIFF_BASE_MARK: &str = "diff-base";
/// In the run directory of a jailed VM whose last snapshot was a diff checkpoint: a link to that checkpoint's
/// memory file (root's, read-only, the VM's memory at the instant the checkpoint reset the dirty-page bitmap),
/// which the VM's next snapshot lays its diff over a copy of. The run directory is root's and out of the
/// jail's reach. Removed by every load, every snapshot and the boot's record.
const CHECKPOINT_BASE: &str = "checkpoint-base.mem";

/// What the memory file a VM is restored from is to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    /// Its own paused state, which the caller gives up: the file becomes the VM's own diff base.
    Own,
    /// A checkpoint (immutable, shared): linked as the VM's checkpoint base ([`CHECKPOINT_BASE`]).
    Checkpoint,
    /// No dirty-page tracking; the first snapshot is full.
    Untracked,
}

/// A memory file a diff snapshot of a VM may be laid over.
enum DiffBase {
    /// The VM's own memory file in its jail (the boot's empty file, or the file it resumed from): a pause
    /// writes the diff into it.
    Own(std::fs::File),
    /// The memory file of the VM's last checkpoint ([`CHECKPOINT_BASE`]): shared with what was made from the
    /// checkpoint, so every diff is laid over a copy.
    Checkpoint(std::fs::File),
}

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

    /// Writes the snapshot of a pause (the VM is paused) to `files`: a diff laid over the VM's own memory file
    /// when it has one (see the module doc), otherwise a full snapshot.
    pub(super) async fn create_pause_snapshot(
        &self,
        vm: &VmHandle,
        files: &SnapshotFiles,
        guest_bytes: u64,
    ) -> Result<(), VmmError> {
        if let Some(base) = self.take_diff_base(vm, guest_bytes) {
            let started = std::time::Instant::now();
            let (written, over) = match base {
                // An empty base is the one laid at the boot (see the module doc).
                DiffBase::Own(base) if base.metadata().is_ok_and(|m| m.len() == 0) => (
                    self.create_diff_snapshot(vm, files, base, JAILED_MEMORY).await,
                    "of the memory written since the boot",
                ),
                DiffBase::Own(base) => (
                    self.create_diff_snapshot(vm, files, base, JAILED_MEMORY).await,
                    "laid over the memory file the VM resumed from",
                ),
                DiffBase::Checkpoint(base) => (
                    self.create_diff_over_copy(vm, files, base).await,
                    "laid over a copy of the VM's last checkpoint",
                ),
            };
            match written {
                Ok(allocated) => {
                    tracing::info!(vm = %vm.run_dir.display(), allocated_bytes = allocated, ms = started.elapsed().as_millis() as u64,
                        "firecracker pause: diff snapshot {over}");
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(vm = %vm.run_dir.display(), error = %e, "diff snapshot failed; writing a full one");
                }
            }
        }
        self.create_snapshot(vm, files).await
    }

    /// Lays the diff base of a jailed VM that has just booted with dirty-page tracking (see the module doc): an
    /// empty root-owned file at the jail's memory file name, created beneath the jail without following
    /// anything (a name the jailed process made first makes it fail), and recorded in [`DIFF_BASE_MARK`]. If
    /// that fails, the first pause writes a full snapshot.
    pub(super) fn record_boot_diff_base(&self, run_dir: &Path) {
        use std::os::unix::fs::MetadataExt;
        Self::forget_diff_base(run_dir);
        let Some(root) = self.jail_root(run_dir) else {
            return;
        };
        let recorded = create_empty_beneath(&root, &JAILED_MEMORY[1..]).and_then(|file| {
            let meta = file.metadata().map_err(io_at(&root))?;
            let mark = run_dir.join(DIFF_BASE_MARK);
            std::fs::write(&mark, format!("{} {}\n", meta.dev(), meta.ino())).map_err(io_at(&mark))
        });
        if let Err(e) = recorded {
            tracing::warn!(vm = %run_dir.display(), error = %e, "no diff base laid at the boot: the first pause writes all of memory");
        }
    }

    /// Forgets the diff base of the VM in `run_dir` ([`DIFF_BASE_MARK`], [`CHECKPOINT_BASE`]).
    pub(super) fn forget_diff_base(run_dir: &Path) {
        let _ = std::fs::remove_file(run_dir.join(DIFF_BASE_MARK));
        let _ = std::fs::remove_file(run_dir.join(CHECKPOINT_BASE));
    }

    /// The file the next snapshot of `vm` (whose guest memory is `guest_bytes`) may lay a diff over: its last
    /// checkpoint's memory (see [`checkpoint_base_in`]) or its own memory file (see [`diff_base_in`]), if its
    /// length is right ([`base_length_fits`]). Used up whatever it returns.
    fn take_diff_base(&self, vm: &VmHandle, guest_bytes: u64) -> Option<DiffBase> {
        let Some(root) = self.jail_root(&vm.run_dir) else {
            Self::forget_diff_base(&vm.run_dir);
            return None;
        };
        let base = checkpoint_base_in(&vm.run_dir)
            .map(DiffBase::Checkpoint)
            .or_else(|| diff_base_in(&vm.run_dir, &root).map(DiffBase::Own));
        Self::forget_diff_base(&vm.run_dir);
        match base {
            None => {
                tracing::debug!(vm = %vm.run_dir.display(), "no diff base (or no longer the VM's own): full snapshot");
                None
            }
            Some(base) if !base_length_fits(&base, guest_bytes) => {
                tracing::warn!(vm = %vm.run_dir.display(), guest_bytes, "the diff base is not guest memory's length: full snapshot");
                None
            }
            base => base,
        }
    }

    /// Keeps the memory file of the diff checkpoint just written (`memory`: sealed, root's and read-only, no
    /// writer left anywhere, or a copy only root ever had open) as the base of the VM's next snapshot: the
    /// checkpoint reset Firecracker's dirty-page bitmap at that very state. A file that cannot be linked
    /// (another file system) leaves the next snapshot full.
    pub(super) fn record_checkpoint_base(run_dir: &Path, memory: &Path) {
        Self::forget_diff_base(run_dir);
        if let Err(e) = std::fs::hard_link(memory, run_dir.join(CHECKPOINT_BASE)) {
            tracing::debug!(vm = %run_dir.display(), error = %e, "checkpoint not kept as a diff base: the next snapshot is full");
        }
    }

    /// `PUT /snapshot/create` of type Diff inside the jail, written by Firecracker into `target`, the file at
    /// `name` in the jail: the VM's diff base itself for a pause (the file its guest memory maps: Firecracker
    /// merges a diff into an existing memory file of the right size, writing only the dirty pages, which its
    /// private mapping has already copied), a sparse copy of it for a checkpoint. For that call the file
    /// belongs to the jail's uid; then it is root's and read-only again, and linked to `files.memory`; the
    /// state file is taken out to `files.state`. Returns the memory file's allocated bytes.
    async fn create_diff_snapshot(
        &self,
        vm: &VmHandle,
        files: &SnapshotFiles,
        target: std::fs::File,
        name: &str,
    ) -> Result<u64, VmmError> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = self.diff_jail_root(vm)?;
        let (uid, gid) = jail_owner(&root)?;
        let target_path = root.join(&name[1..]);
        let give_back = |file: &std::fs::File| {
            std::os::unix::fs::fchown(file, Some(0), Some(0))
                .and_then(|()| file.set_permissions(std::fs::Permissions::from_mode(SNAPSHOT_FILE_MODE)))
                .map_err(io_at(&target_path))
        };
        let handed = std::os::unix::fs::fchown(&target, Some(uid), Some(gid))
            .and_then(|()| target.set_permissions(std::fs::Permissions::from_mode(0o600)));
        if let Err(e) = handed {
            give_back(&target)?;
            return Err(io_at(&target_path)(e));
        }
        let req = api::SnapshotCreate {
            snapshot_type: api::SnapshotType::Diff,
            snapshot_path: JAILED_STATE_OUT.into(),
            mem_file_path: name.into(),
        };
        let created = self
            .api(&vm.run_dir)
            .create_snapshot(req)
            .await
            .map_err(|e| Self::vm_api_error(vm, &e));
        let result = give_back(&target)
            .and(created)
            .and_then(|()| take_out(&root, &JAILED_STATE_OUT[1..], &files.state))
            .and_then(|()| {
                let meta = target.metadata().map_err(io_at(&target_path))?;
                if meta.nlink() != 1 {
                    return Err(VmmError::Snapshot {
                        path: target_path.clone(),
                        detail: "the memory file got another name during the snapshot".into(),
                    });
                }
                link_out(&target, &files.memory)?;
                Ok(meta.blocks() * 512)
            });
        let _ = std::fs::remove_file(root.join(&JAILED_STATE_OUT[1..]));
        if result.is_err() {
            let _ = std::fs::remove_file(&files.state);
            let _ = std::fs::remove_file(&files.memory);
        }
        result
    }

    /// Writes the snapshot of a checkpoint (the VM is paused, and runs on afterwards) to `files`. A VM with a
    /// diff base gets a diff laid over a sparse copy of that base (the boot's empty file, the memory file it
    /// resumed from, or its last checkpoint's; only the data extents are copied): the checkpoint costs the
    /// memory the guest touched, not its size, and never reads the holes of its memory. Returns whether it
    /// was a diff: the snapshot reset Firecracker's dirty-page bitmap, so once the caller has made the
    /// checkpoint's files root's own ([`Self::record_checkpoint_base`]), its memory file can be the base of
    /// the VM's next snapshot. Without a base, or if the diff fails, a full snapshot (and the next one is
    /// full too).
    pub(super) async fn create_checkpoint_snapshot(
        &self,
        vm: &VmHandle,
        files: &SnapshotFiles,
        guest_bytes: u64,
    ) -> Result<bool, VmmError> {
        let base = self.take_diff_base(vm, guest_bytes);
        let off = crate::feature_off(super::FEATURES_OFF_VAR, super::FEATURE_CHECKPOINT_DIFF);
        if let Some(DiffBase::Own(base) | DiffBase::Checkpoint(base)) = base.filter(|_| !off) {
            let started = std::time::Instant::now();
            match self.create_diff_over_copy(vm, files, base).await {
                Ok(allocated) => {
                    tracing::info!(vm = %vm.run_dir.display(), allocated_bytes = allocated, ms = started.elapsed().as_millis() as u64,
                        "firecracker checkpoint: diff snapshot laid over a copy of the VM's diff base");
                    return Ok(true);
                }
                Err(e) => {
                    tracing::warn!(vm = %vm.run_dir.display(), error = %e, "diff checkpoint failed; writing a full one");
                }
            }
        }
        self.create_snapshot(vm, files).await.map(|()| false)
    }

    /// A diff snapshot laid over a copy of `base`: copies its data extents into a new root-owned file at the
    /// jail's snapshot output name, then lays the diff over that copy. Returns its allocated bytes.
    async fn create_diff_over_copy(
        &self,
        vm: &VmHandle,
        files: &SnapshotFiles,
        base: std::fs::File,
    ) -> Result<u64, VmmError> {
        let root = self.diff_jail_root(vm)?;
        let out_path = root.join(&JAILED_MEMORY_OUT[1..]);
        // Left by an interrupted attempt (unlinking a name in the chroot never follows a symlink).
        let _ = std::fs::remove_file(&out_path);
        let out = create_empty_beneath(&root, &JAILED_MEMORY_OUT[1..])?;
        let copy_to = out.try_clone().map_err(io_at(&out_path))?;
        let copied = tokio::task::spawn_blocking(move || crate::disk::clone_or_copy(&base, &copy_to))
            .await
            .map_err(|e| VmmError::Snapshot {
                path: out_path.clone(),
                detail: format!("copy task: {e}"),
            })
            .and_then(|r| r.map_err(io_at(&out_path)));
        let result = match copied {
            Ok(_) => self.create_diff_snapshot(vm, files, out, JAILED_MEMORY_OUT).await,
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_file(&out_path);
        result
    }

    /// The jail of `vm`, for a diff snapshot.
    fn diff_jail_root(&self, vm: &VmHandle) -> Result<PathBuf, VmmError> {
        self.jail_root(&vm.run_dir).ok_or_else(|| VmmError::Snapshot {
            path: vm.run_dir.clone(),
            detail: "diff snapshots need the jail".into(),
        })
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
        self.load_files(spec, files, resume, Origin::Untracked).await
    }

    /// [`Self::load_snapshot_files`]; unless `origin` is [`Origin::Untracked`], a jailed VM tracks dirty pages
    /// and records the memory file as the base of its next snapshot's diff: as its own file
    /// ([`DIFF_BASE_MARK`]), or as a checkpoint's ([`CHECKPOINT_BASE`]).
    pub(super) async fn load_files(
        &self,
        spec: &VmSpec,
        files: &SnapshotFiles,
        resume: bool,
        origin: Origin,
    ) -> Result<VmHandle, VmmError> {
        Self::forget_diff_base(&spec.run_dir);
        let track = origin != Origin::Untracked && self.jailer.is_some();
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
            enable_diff_snapshots: track.then_some(true),
            resume_vm: resume,
        };
        if let Err(e) = launched.api.load_snapshot(load).await {
            return Err(self.abort(spec, launched.proc_id, api_error(&spec.id, &e)).await);
        }
        // The snapshot carries the reset of the source VM's vsock connections, not yet seen by the guest.
        Self::mark_vsock_reset(&spec.run_dir);
        let vm = self.finish(spec, &launched, "restored").await?;
        if track && origin == Origin::Checkpoint {
            // The checkpoint's file is root's and read-only (the restore checked its length): shared, so the
            // VM's first snapshot is laid over a copy of it.
            Self::record_checkpoint_base(&spec.run_dir, &files.memory);
        } else if track {
            use std::os::unix::fs::MetadataExt;
            // The inode of the snapshot's own file (a path outside the jail): the jail's link is that inode
            // unless it had to be copied, and a file the jailed process put in its place never matches.
            let recorded = std::fs::metadata(&files.memory).and_then(|m| {
                std::fs::write(
                    spec.run_dir.join(DIFF_BASE_MARK),
                    format!("{} {}\n", m.dev(), m.ino()),
                )
            });
            if let Err(e) = recorded {
                tracing::warn!(vm = %spec.run_dir.display(), error = %e, "no diff base recorded: the next pause writes all of memory");
            }
        }
        Ok(vm)
    }

    /// The chroot of a jailed VM in `run_dir`, if this driver jails.
    fn jail_root(&self, run_dir: &Path) -> Option<PathBuf> {
        self.jailer.as_ref()?;
        let iid = super::jailed_instance_id(run_dir, &self.binary)?;
        Some(jailer::Jail::new(run_dir, &self.binary, &iid).root)
    }
}

/// The memory file a VM with run directory `run_dir` and jail `root` was resumed from, opened for writing, if
/// it may take a diff: recorded at the load ([`DIFF_BASE_MARK`]), still the same inode, a regular root-owned
/// file whose only name is the jail's, opened beneath the jail without following symlinks. The record is used
/// once: whatever happens next, a later pause without a new load writes a full snapshot.
fn diff_base_in(run_dir: &Path, root: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let recorded = std::fs::read_to_string(run_dir.join(DIFF_BASE_MARK)).ok()?;
    FirecrackerVmm::forget_diff_base(run_dir);
    let mut words = recorded.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(dev)), Some(Ok(ino))) = (words.next(), words.next()) else {
        return None;
    };
    let file = open_beneath(root, &JAILED_MEMORY[1..], nix::fcntl::OFlag::O_RDWR).ok()?;
    let meta = file.metadata().ok()?;
    let ok = meta.is_file() && meta.dev() == dev && meta.ino() == ino && meta.nlink() == 1 && meta.uid() == 0;
    ok.then_some(file)
}

/// Whether `base` may be the base of a diff snapshot of a guest with `guest_bytes` of memory: exactly that
/// long, or empty for the VM's own file (the one laid at the boot). Anything else (a file the jailed process
/// grew or cut while it was its uid's) is not copied or written into.
fn base_length_fits(base: &DiffBase, guest_bytes: u64) -> bool {
    let (file, empty_ok) = match base {
        DiffBase::Own(f) => (f, true),
        DiffBase::Checkpoint(f) => (f, false),
    };
    file.metadata()
        .is_ok_and(|m| m.len() == guest_bytes || (empty_ok && m.len() == 0))
}

/// The memory file of the last checkpoint of the VM with run directory `run_dir` ([`CHECKPOINT_BASE`]), opened
/// for reading without following a symlink, if it is a regular root-owned file.
fn checkpoint_base_in(run_dir: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(run_dir.join(CHECKPOINT_BASE))
        .ok()?;
    let meta = file.metadata().ok()?;
    (meta.is_file() && meta.uid() == 0).then_some(file)
}

/// Takes a snapshot file the jailed Firecracker wrote (`name` in the chroot `root`) out to `dest`.
///
/// The jailed process owns the chroot, so the file is opened without following symlinks and must be a
/// regular file with a single link; then exactly that inode is linked to `dest` (copied when `dest` is on
/// another filesystem) and handed to root with [`SNAPSHOT_FILE_MODE`]. A Firecracker that keeps running after the snapshot
/// could still write through descriptors it holds: stop it (or seal or copy the file, `snapshot_dir`) before
/// committing the snapshot.
fn take_out(root: &Path, name: &str, dest: &Path) -> Result<(), VmmError> {
    let file = open_private(root, name, nix::fcntl::OFlag::O_RDONLY)?;
    link_out(&file, dest)
}

/// The uid and gid of the jail `root`: those its `run/` directory was made for (never root's).
fn jail_owner(root: &Path) -> Result<(u32, u32), VmmError> {
    use std::os::unix::fs::MetadataExt;
    let run = root.join("run");
    let owner = std::fs::symlink_metadata(&run).map_err(io_at(&run))?;
    if owner.uid() == 0 || !owner.is_dir() {
        return Err(VmmError::Snapshot {
            path: run,
            detail: "the jail's run directory does not belong to the jail's uid".into(),
        });
    }
    Ok((owner.uid(), owner.gid()))
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> VmmError + '_ {
    move |source| VmmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Opens `name` beneath `root` (a jail the jailed process owns) without following any symlink.
fn open_beneath(root: &Path, name: &str, access: nix::fcntl::OFlag) -> Result<std::fs::File, VmmError> {
    use nix::fcntl::OFlag;
    // O_NONBLOCK: a FIFO put there does not block the open (it then fails the regular-file checks).
    let flags = access | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    openat_beneath(root, name, flags, nix::sys::stat::Mode::empty())
}

/// Creates the empty file `name` beneath `root` (a jail the jailed process owns), read-only
/// ([`SNAPSHOT_FILE_MODE`]) and the daemon's (root's); fails if anything is at that name already, a symlink
/// included.
fn create_empty_beneath(root: &Path, name: &str) -> Result<std::fs::File, VmmError> {
    use nix::fcntl::OFlag;
    let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    openat_beneath(
        root,
        name,
        flags,
        nix::sys::stat::Mode::from_bits_truncate(SNAPSHOT_FILE_MODE),
    )
}

/// `openat2(root, name)` resolved beneath `root`, following no symlink on the way.
fn openat_beneath(
    root: &Path,
    name: &str,
    flags: nix::fcntl::OFlag,
    mode: nix::sys::stat::Mode,
) -> Result<std::fs::File, VmmError> {
    use nix::fcntl::{OpenHow, ResolveFlag, openat2};
    let dirfd = std::fs::File::open(root).map_err(io_at(root))?;
    let how = OpenHow::new()
        .flags(flags)
        .mode(mode)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let fd = openat2(&dirfd, name, how).map_err(|e| io_at(&root.join(name))(e.into()))?;
    Ok(std::fs::File::from(fd))
}

/// [`open_beneath`], and the file must be a regular file with a single link.
fn open_private(root: &Path, name: &str, access: nix::fcntl::OFlag) -> Result<std::fs::File, VmmError> {
    use std::os::unix::fs::MetadataExt;
    let src = root.join(name);
    let file = open_beneath(root, name, access)?;
    let meta = file.metadata().map_err(io_at(&src))?;
    if !meta.is_file() || meta.nlink() != 1 {
        return Err(VmmError::Disk {
            path: src,
            detail: "snapshot output is not a private regular file".into(),
        });
    }
    Ok(file)
}

/// Links the open `file` to `dest` (copied when `dest` is on another filesystem) and hands it to root with
/// [`SNAPSHOT_FILE_MODE`].
fn link_out(file: &std::fs::File, dest: &Path) -> Result<(), VmmError> {
    use nix::fcntl::AtFlags;
    use nix::unistd::linkat;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;

    let magic = format!("/proc/self/fd/{}", file.as_raw_fd());
    match linkat(
        nix::fcntl::AT_FDCWD,
        magic.as_str(),
        nix::fcntl::AT_FDCWD,
        dest,
        AtFlags::AT_SYMLINK_FOLLOW,
    ) {
        Ok(()) => {
            std::os::unix::fs::fchown(file, Some(0), Some(0)).map_err(io_at(dest))?;
            file.set_permissions(std::fs::Permissions::from_mode(SNAPSHOT_FILE_MODE))
                .map_err(io_at(dest))
        }
        Err(nix::Error::EXDEV) => {
            let mut out = std::fs::File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dest)
                .map_err(io_at(dest))?;
            let mut from = file;
            std::io::copy(&mut from, &mut out).map_err(io_at(dest))?;
            out.set_permissions(std::fs::Permissions::from_mode(SNAPSHOT_FILE_MODE))
                .map_err(io_at(dest))
        }
        Err(e) => Err(io_at(dest)(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::fcntl::OFlag;

    /// What the jailed process could leave at a name the driver opens in its chroot: only a regular file
    /// with a single link is taken, a symlink is never followed (not even to a file inside the jail), and a
    /// FIFO does not block the open.
    #[test]
    fn jail_files_are_opened_beneath_without_following_anything() {
        let dir = tempfile::tempdir().expect("test step");
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("test step");
        let outside = dir.path().join("host-file");
        std::fs::write(&outside, b"host").expect("test step");
        std::fs::write(root.join("mem"), b"guest").expect("test step");
        assert!(open_private(&root, "mem", OFlag::O_RDWR).is_ok());

        std::os::unix::fs::symlink(&outside, root.join("abs")).expect("test step");
        std::os::unix::fs::symlink("mem", root.join("rel")).expect("test step");
        std::os::unix::fs::symlink("../host-file", root.join("up")).expect("test step");
        for name in ["abs", "rel", "up", "../host-file"] {
            assert!(open_beneath(&root, name, OFlag::O_RDONLY).is_err(), "{name}");
        }
        std::fs::hard_link(root.join("mem"), root.join("second-name")).expect("test step");
        assert!(open_private(&root, "mem", OFlag::O_RDONLY).is_err(), "two links");

        nix::unistd::mkfifo(
            &root.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .expect("test step");
        let started = std::time::Instant::now();
        assert!(open_private(&root, "fifo", OFlag::O_RDONLY).is_err());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "the open blocked"
        );
        std::fs::create_dir(root.join("dir")).expect("test step");
        assert!(open_private(&root, "dir", OFlag::O_RDONLY).is_err());
    }

    /// The base laid at a boot is a new empty file, read-only, that a diff may use; whatever the jailed
    /// process put at that name first (a file, a symlink to a host file, a directory) makes it fail instead
    /// of being taken over or followed.
    #[test]
    fn the_boot_diff_base_is_a_new_empty_file_nothing_else() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().expect("test step");
        let root = dir.path().join("root");
        let run = dir.path().join("run");
        std::fs::create_dir(&root).expect("test step");
        std::fs::create_dir(&run).expect("test step");
        let name = &JAILED_MEMORY[1..];
        let file = create_empty_beneath(&root, name).expect("an empty base");
        let meta = file.metadata().expect("test step");
        assert_eq!((meta.len(), meta.nlink()), (0, 1));
        assert_eq!(meta.permissions().mode() & 0o777, SNAPSHOT_FILE_MODE);
        std::fs::write(
            run.join(DIFF_BASE_MARK),
            format!("{} {}\n", meta.dev(), meta.ino()),
        )
        .expect("test step");
        if nix::unistd::geteuid().is_root() {
            let base = diff_base_in(&run, &root).expect("the laid base is taken");
            assert_eq!(base.metadata().expect("test step").len(), 0);
        }
        assert!(create_empty_beneath(&root, name).is_err(), "a file is there");
        std::fs::remove_file(root.join(name)).expect("test step");

        let host = dir.path().join("host-file");
        std::fs::write(&host, b"host").expect("test step");
        std::os::unix::fs::symlink(&host, root.join(name)).expect("test step");
        assert!(create_empty_beneath(&root, name).is_err(), "a symlink is there");
        assert_eq!(std::fs::read(&host).expect("test step"), b"host");
        std::fs::remove_file(root.join(name)).expect("test step");
        std::fs::create_dir(root.join(name)).expect("test step");
        assert!(create_empty_beneath(&root, name).is_err(), "a directory is there");
    }

    /// A checkpoint's memory kept as a diff base is taken only as a regular root-owned file at the run
    /// directory's name: a symlink there (to a host file) or a directory is refused, not followed.
    #[test]
    fn a_diff_base_must_be_guest_memory_long_or_the_boots_empty_file() {
        let dir = tempfile::tempdir().expect("test file operation");
        let guest: u64 = 4 << 20;
        let file = |name: &str, len: u64| {
            let f = std::fs::File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(dir.path().join(name))
                .expect("test file operation");
            f.set_len(len).expect("test file operation");
            f
        };
        for (len, own, checkpoint) in [
            (0, true, false),
            (guest, true, true),
            (guest - 4096, false, false),
            (guest + 4096, false, false),
            (64 << 30, false, false),
        ] {
            let o = DiffBase::Own(file(&format!("own-{len}"), len));
            let c = DiffBase::Checkpoint(file(&format!("ck-{len}"), len));
            assert_eq!(base_length_fits(&o, guest), own, "own base of {len} bytes");
            assert_eq!(
                base_length_fits(&c, guest),
                checkpoint,
                "checkpoint base of {len} bytes"
            );
        }
    }

    #[test]
    fn a_checkpoint_base_is_a_regular_root_file_never_a_symlink() {
        let dir = tempfile::tempdir().expect("test step");
        let run = dir.path().join("run");
        std::fs::create_dir(&run).expect("test step");
        let base = run.join(CHECKPOINT_BASE);
        assert!(checkpoint_base_in(&run).is_none(), "none kept");

        let host = dir.path().join("host-file");
        std::fs::write(&host, b"host").expect("test step");
        std::os::unix::fs::symlink(&host, &base).expect("test step");
        assert!(checkpoint_base_in(&run).is_none(), "symlink");
        std::fs::remove_file(&base).expect("test step");
        std::fs::create_dir(&base).expect("test step");
        assert!(checkpoint_base_in(&run).is_none(), "directory");
        std::fs::remove_dir(&base).expect("test step");

        if nix::unistd::geteuid().is_root() {
            std::fs::hard_link(&host, &base).expect("test step");
            let mut kept = String::new();
            std::io::Read::read_to_string(&mut checkpoint_base_in(&run).expect("a root file"), &mut kept)
                .expect("test step");
            assert_eq!(kept, "host");
            std::os::unix::fs::chown(&host, Some(1234), Some(1234)).expect("test step");
            assert!(checkpoint_base_in(&run).is_none(), "not root's");
        }
    }

    /// A diff snapshot is laid only over the very file the VM was resumed from, and only once: no record, a
    /// garbled one, another inode at the name, a second name (a link the jail made), a symlink or a directory
    /// in its place all refuse (the pause then writes a full snapshot), and every attempt uses the record up.
    #[test]
    fn a_diff_base_is_the_recorded_private_file_and_is_taken_once() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("test step");
        let run = dir.path().join("run");
        let root = dir.path().join("root");
        std::fs::create_dir(&run).expect("test step");
        std::fs::create_dir(&root).expect("test step");
        let mem = root.join(&JAILED_MEMORY[1..]);
        let mark = run.join(DIFF_BASE_MARK);
        let record = |path: &Path| {
            let m = std::fs::metadata(path).expect("test step");
            std::fs::write(&mark, format!("{} {}\n", m.dev(), m.ino())).expect("test step");
        };
        std::fs::write(&mem, b"guest memory").expect("test step");

        assert!(diff_base_in(&run, &root).is_none(), "no record");
        record(&mem);
        assert!(diff_base_in(&run, &root).is_some(), "the recorded file");
        assert!(!mark.exists(), "the record is used up");
        assert!(
            diff_base_in(&run, &root).is_none(),
            "a second pause without a load"
        );

        std::fs::write(&mark, "not numbers").expect("test step");
        assert!(diff_base_in(&run, &root).is_none(), "garbled record");
        assert!(!mark.exists());

        record(&mem);
        let other = root.join("other");
        std::fs::write(&other, b"x").expect("test step");
        std::fs::rename(&other, &mem).expect("test step");
        assert!(diff_base_in(&run, &root).is_none(), "another inode at the name");
        assert!(!mark.exists());

        record(&mem);
        std::fs::hard_link(&mem, root.join("second-name")).expect("test step");
        assert!(diff_base_in(&run, &root).is_none(), "two names");
        std::fs::remove_file(root.join("second-name")).expect("test step");

        // A symlink at the name to the recorded file itself: never followed.
        let moved = dir.path().join("moved.mem");
        std::fs::rename(&mem, &moved).expect("test step");
        std::os::unix::fs::symlink(&moved, &mem).expect("test step");
        record(&moved);
        assert!(diff_base_in(&run, &root).is_none(), "symlink");
        std::fs::remove_file(&mem).expect("test step");

        std::fs::create_dir(&mem).expect("test step");
        record(&mem);
        assert!(diff_base_in(&run, &root).is_none(), "directory");
    }
}
