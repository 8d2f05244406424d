//! Snapshot and restore for QEMU: the migration stream into a file, and back.
//!
//! A snapshot directory holds `vmstate` (QEMU's migration stream: device state and all guest RAM, zero pages
//! skipped) and, for a checkpoint, `disk.qcow2` (a copy of the VM's disk overlay taken while the VM was stopped,
//! so memory and disk agree). QEMU runs chrooted and unprivileged, so the driver opens these files itself and
//! passes the descriptors over QMP (`add-fd`, then `file:/dev/fdset/<id>`); QEMU never sees a host path.
//!
//! Snapshot: `stop`, `migrate` to the descriptor, wait for `completed`, fsync; then a checkpoint copies the disk
//! and `cont`s, a pause quits QEMU. A failed migration `cont`s the VM again, so a failed snapshot leaves it
//! running. Restore: a new QEMU with the same devices and `-incoming defer`, `migrate-incoming` from the
//! descriptor, wait, `cont` (see `QemuVmm::launch`). The snapshot files are only read, so several VMs may
//! restore from one snapshot at once.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use super::QemuVmm;
use super::qmp::Qmp;
use crate::{SnapshotInfo, SnapshotMode, VmHandle, VmSpec, Vmm, VmmError, VmmKind};

/// The migration stream's file name in a snapshot directory.
pub const VMSTATE: &str = "vmstate";
/// The disk copy's file name in a checkpoint.
pub const DISK_COPY: &str = "disk.qcow2";
/// Saving or loading the state of a large guest under TCG on a loaded host.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);

impl QemuVmm {
    pub(super) async fn snapshot_to(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, VmmError> {
        let err = |detail: String| VmmError::Snapshot {
            path: dest.to_path_buf(),
            detail,
        };
        if !self.is_alive(vm) {
            return Err(err("the VM is not running".to_string()));
        }
        let mut q = self.qmp(vm).await?;
        let (memory_mib, vcpus) = shape(&mut q).await.map_err(err)?;
        let state_path = dest.join(VMSTATE);
        let state = File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&state_path)
            .map_err(|e| io(&state_path, e))?;

        q.execute("stop", None).await.map_err(|e| err(e.to_string()))?;
        let saved = async {
            let set = q.add_fd(state.as_fd()).await?;
            let uri = format!("file:/dev/fdset/{set}");
            q.execute("migrate", Some(json!({ "uri": uri }))).await?;
            let done = q.wait_migration(MIGRATION_TIMEOUT).await;
            let _ = q.execute("remove-fd", Some(json!({ "fdset-id": set }))).await;
            done
        }
        .await;
        if let Err(e) = saved {
            // The VM goes on; the caller removes the half-written directory.
            let _ = q.execute("cont", None).await;
            return Err(err(format!("saving the state: {e}")));
        }
        state.sync_all().map_err(|e| io(&state_path, e))?;
        drop(state);

        let mut files = vec![VMSTATE.to_string()];
        let mut disk_copy = None;
        match mode {
            SnapshotMode::Checkpoint => {
                // The VM is stopped and its block devices flushed and inactive: the overlay is consistent.
                let copy = dest.join(DISK_COPY);
                let copied = copy_synced(disk, &copy).await;
                let resumed = q.execute("cont", None).await;
                copied?;
                resumed.map_err(|e| err(format!("continuing after the checkpoint: {e}")))?;
                files.push(DISK_COPY.to_string());
                disk_copy = Some(DISK_COPY.to_string());
            }
            SnapshotMode::Pause => {
                drop(q);
                self.stop(vm).await?;
            }
        }
        File::open(dest)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(dest, e))?;
        Ok(SnapshotInfo {
            kind: VmmKind::Qemu,
            vmm_version: self.version(),
            files,
            disk_format: disk_copy.as_ref().map(|_| crate::DiskFormat::Qcow2),
            disk: disk_copy,
            memory_mib,
            vcpus,
        })
    }

    pub(super) async fn restore_from(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        let err = |detail: String| VmmError::Snapshot {
            path: snapshot.to_path_buf(),
            detail,
        };
        if info.kind != VmmKind::Qemu {
            return Err(err(format!("written by {}, not qemu", info.kind.as_str())));
        }
        if info.vmm_version != self.version() {
            return Err(err(format!(
                "written by {}, this host runs {}",
                info.vmm_version,
                self.version()
            )));
        }
        if (spec.memory_mib, spec.vcpus) != (info.memory_mib, info.vcpus) {
            return Err(err(format!(
                "needs {} MiB and {} vCPUs, the spec asks for {} MiB and {}",
                info.memory_mib, info.vcpus, spec.memory_mib, spec.vcpus
            )));
        }
        let path = snapshot.join(VMSTATE);
        let state = File::open(&path).map_err(|e| err(format!("{VMSTATE}: {e}")))?;
        self.launch(spec, super::Boot::Incoming(state)).await
    }
}

/// Loads the migration stream in `state` into a QEMU started with `-incoming defer`.
pub(super) async fn load_incoming(q: &mut Qmp, state: &File) -> Result<(), String> {
    let set = q
        .add_fd(state.as_fd())
        .await
        .map_err(|e| format!("passing the state file: {e}"))?;
    let uri = format!("file:/dev/fdset/{set}");
    q.execute("migrate-incoming", Some(json!({ "uri": uri })))
        .await
        .map_err(|e| format!("loading the state: {e}"))?;
    let done = q
        .wait_migration(MIGRATION_TIMEOUT)
        .await
        .map_err(|e| format!("loading the state: {e}"));
    let _ = q.execute("remove-fd", Some(json!({ "fdset-id": set }))).await;
    done
}

/// Guest memory (MiB) and vCPU count of a running VM.
async fn shape(q: &mut Qmp) -> Result<(u32, u32), String> {
    let mem = q
        .execute("query-memory-size-summary", None)
        .await
        .map_err(|e| e.to_string())?;
    let bytes = mem
        .get("base-memory")
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("query-memory-size-summary: no base-memory in {mem}"))?;
    let cpus = q
        .execute("query-cpus-fast", None)
        .await
        .map_err(|e| e.to_string())?;
    let vcpus = cpus
        .as_array()
        .map(Vec::len)
        .ok_or_else(|| format!("query-cpus-fast: not a list: {cpus}"))?;
    let mib = u32::try_from(bytes >> 20).map_err(|_| format!("memory size {bytes} out of range"))?;
    let vcpus = u32::try_from(vcpus).map_err(|_| format!("vcpu count {vcpus} out of range"))?;
    Ok((mib, vcpus))
}

/// Copies the VM's qcow2 overlay (hearth created it; the guest writes only inside it) into the checkpoint.
async fn copy_synced(from: &Path, to: &Path) -> Result<(), VmmError> {
    let dest = to.to_path_buf();
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    tokio::task::spawn_blocking(move || crate::disk::copy_sparse(&from, &to).map_err(|e| io(&to, e)))
        .await
        .map_err(|e| VmmError::Snapshot {
            path: dest,
            detail: format!("disk copy: {e}"),
        })?
}

fn io(path: &Path, source: std::io::Error) -> VmmError {
    VmmError::Io {
        path: path.to_path_buf(),
        source,
    }
}
