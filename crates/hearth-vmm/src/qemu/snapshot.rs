//! Snapshot and restore for QEMU: device state through a migration stream into a file, guest RAM in its own
//! file (see [`super::memory`]), and back.
//!
//! A snapshot directory holds `vmstate` (QEMU's migration stream), `memory` when the VM's RAM lives in a file
//! (then the stream was written with `x-ignore-shared` and carries no RAM pages: ~100 KB), and for a
//! checkpoint `disk.qcow2` (a copy of the VM's disk overlay taken while the VM was stopped, so memory and disk
//! agree). QEMU runs chrooted and unprivileged, so the driver opens the state file itself and passes the
//! descriptor over QMP (`add-fd`, then `file:/dev/fdset/<id>`); QEMU never sees a host path after it started.
//!
//! - Pause: `stop`, `migrate` the device state, quit QEMU, fsync the memory file and move it into the snapshot:
//!   no RAM is copied. (A VM whose RAM is a copy-on-write mapping of a base has no file of its own: its stream
//!   carries its RAM, written with `mapped-ram` so every page sits at its own offset, as in a memory file.)
//! - Checkpoint: `stop`, `migrate`, copy the memory file (reflink or its allocated extents) and the disk while
//!   stopped, `cont`, then fsync the copies. The VM goes on writing its own file; the snapshot never changes.
//! - Restore (fork, snapshot, memory template): a new QEMU maps the snapshot's memory file copy-on-write and
//!   loads the device state; the files are only read, so any number of VMs restore from one snapshot at once.
//! - Resume (the sandbox's own pause): a new QEMU maps the paused memory file as its own RAM again; once the
//!   guest runs the file belongs to it (moved back to `<run>/memory`), so a resume consumes its snapshot.
//!
//! A failed migration `cont`s the VM again, so a failed snapshot leaves it running.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use super::QemuVmm;
use super::memory::{FEATURE_MAPPED_RAM, MEMORY_FILE, Machine, Ram};
use super::qmp::Qmp;
use crate::{SnapshotInfo, SnapshotMode, VmHandle, VmSpec, Vmm, VmmError, VmmKind};

/// The migration stream's file name in a snapshot directory.
pub const VMSTATE: &str = "vmstate";
/// The disk copy's file name in a checkpoint.
pub const DISK_COPY: &str = "disk.qcow2";
/// Saving or loading the state of a large guest under TCG on a loaded host.
pub(crate) const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);

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
        let machine = running_machine(&mut q, &vm.run_dir).await.map_err(err)?;
        let state_path = dest.join(VMSTATE);
        let state = File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&state_path)
            .map_err(|e| io(&state_path, e))?;

        let caps = StreamCaps {
            ignore_shared: machine.ram_in_file(),
            mapped_ram: machine.maps_ram_in_stream(),
        };
        q.execute("stop", None).await.map_err(|e| err(e.to_string()))?;
        let saved = async {
            set_caps(&mut q, caps).await?;
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
        let mut files = vec![VMSTATE.to_string()];
        let mut memory_file = None;
        let mut disk_copy = None;
        match mode {
            SnapshotMode::Checkpoint => {
                // The VM is stopped and its block devices flushed and inactive: memory and disk agree. Copy
                // both now, let the VM go on, then make the copies durable.
                let mut copies = Vec::new();
                let copied = async {
                    if let Ram::Own(mem) = &machine.ram {
                        let to = dest.join(MEMORY_FILE);
                        copy_unsynced(mem, &to).await?;
                        copies.push(to);
                    }
                    let to = dest.join(DISK_COPY);
                    copy_unsynced(disk, &to).await?;
                    copies.push(to);
                    Ok::<(), VmmError>(())
                }
                .await;
                let resumed = q.execute("cont", None).await;
                copied?;
                resumed.map_err(|e| err(format!("continuing after the checkpoint: {e}")))?;
                for f in copies.iter().chain([&state_path]) {
                    fsync_path(f).await?;
                }
                if machine.ram_in_file() {
                    files.push(MEMORY_FILE.to_string());
                    memory_file = Some(MEMORY_FILE.to_string());
                    // Restores open it read-only; nobody may write it.
                    read_only(&dest.join(MEMORY_FILE))?;
                }
                files.push(DISK_COPY.to_string());
                disk_copy = Some(DISK_COPY.to_string());
            }
            SnapshotMode::Pause => {
                drop(q);
                self.stop(vm).await?;
                fsync_path(&state_path).await?;
                if let Ram::Own(mem) = &machine.ram {
                    // QEMU is gone: the guest's last writes are in the page cache; make them durable, then the
                    // file itself becomes the snapshot's memory.
                    fsync_path(mem).await?;
                    let to = dest.join(MEMORY_FILE);
                    std::fs::rename(mem, &to).map_err(|e| io(mem, e))?;
                    files.push(MEMORY_FILE.to_string());
                    memory_file = Some(MEMORY_FILE.to_string());
                }
            }
        }
        drop(state);
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
            memory_file,
            features: caps.record(machine.features()),
        })
    }

    /// `stop`, copy the disk overlay (QEMU drained and flushed it on `stop`), `cont`, fsync the copy.
    pub(super) async fn capture_disk_to(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
    ) -> Result<crate::DiskCapture, VmmError> {
        let err = |detail: String| VmmError::Snapshot {
            path: dest.to_path_buf(),
            detail,
        };
        if !self.is_alive(vm) {
            return Err(err("the VM is not running".to_string()));
        }
        let mut q = self.qmp(vm).await?;
        let started = std::time::Instant::now();
        q.execute("stop", None).await.map_err(|e| err(e.to_string()))?;
        let resume = async {
            q.execute("cont", None)
                .await
                .map(|_| ())
                .map_err(|e| err(format!("continuing after the disk capture: {e}")))
        };
        crate::disk::capture_while_stopped(disk, dest, crate::DiskFormat::Qcow2, started, resume).await
    }

    /// Checks that `snapshot` was written by this QEMU for a VM of `spec`'s shape.
    fn check_restorable(&self, spec: &VmSpec, snapshot: &Path, info: &SnapshotInfo) -> Result<(), VmmError> {
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
        Ok(())
    }

    /// A new VM from `snapshot`, which stays untouched (its memory file is mapped copy-on-write).
    pub(super) async fn restore_from(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.check_restorable(spec, snapshot, info)?;
        let ram = match &info.memory_file {
            Some(f) => Ram::Base(absolute(&snapshot.join(f))?),
            None => Ram::Own(fresh_memory_path(&spec.run_dir)?),
        };
        self.launch_incoming(spec, snapshot, info, Machine::of(info, ram))
            .await
    }

    /// A new VM from `snapshot` with a copy of its memory file as the VM's own (`<run>/memory`, shared: a reflink
    /// where the file system has them, else the file's data extents), so that the VM's pauses only flush that
    /// file, as a booted VM's do, instead of writing all of its RAM the way a copy-on-write mapping's first
    /// pause must. Costs the copy (a booted guest's memory file holds what it touched, ~100 MiB for `minimal`)
    /// and the page cache of it, not shared with other restores. `snapshot` stays untouched.
    pub(super) async fn restore_own_from(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        let Some(f) = &info.memory_file else {
            return self.restore_from(spec, snapshot, info).await;
        };
        self.check_restorable(spec, snapshot, info)?;
        // The copy goes into a new file (a leftover of an earlier attempt is removed first).
        let own = fresh_memory_path(&spec.run_dir)?;
        copy_unsynced(&snapshot.join(f), &own).await?;
        self.launch_incoming(spec, snapshot, info, Machine::of(info, Ram::Own(own)))
            .await
    }

    /// The sandbox's own paused state back: its memory file becomes the VM's RAM again and, once the guest
    /// runs, moves back to `<run>/memory`. Before the guest runs nothing in `snapshot` changes.
    pub(super) async fn resume_from(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        let Some(f) = &info.memory_file else {
            return self.restore_from(spec, snapshot, info).await;
        };
        self.check_restorable(spec, snapshot, info)?;
        let paused_memory = absolute(&snapshot.join(f))?;
        let machine = Machine::of(info, Ram::Own(paused_memory.clone()));
        let vm = self.launch_incoming(spec, snapshot, info, machine).await?;
        // The guest runs on that file now: it is the sandbox's memory, no longer the paused state.
        let own = spec.run_dir.join(MEMORY_FILE);
        if let Err(e) = std::fs::rename(&paused_memory, &own) {
            tracing::warn!(path = %paused_memory.display(), error = %e, "moving the resumed memory file");
        }
        Ok(vm)
    }

    async fn launch_incoming(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
        machine: Machine,
    ) -> Result<VmHandle, VmmError> {
        let path = snapshot.join(VMSTATE);
        let state = File::open(&path).map_err(|e| VmmError::Snapshot {
            path: snapshot.to_path_buf(),
            detail: format!("{VMSTATE}: {e}"),
        })?;
        let caps = StreamCaps::of(info);
        self.launch(spec, &machine, super::Boot::Incoming { state, caps })
            .await
    }
}

/// The path of a fresh memory file for a VM whose RAM comes from a migration stream or a copy: `<run>/memory`,
/// with whatever an earlier attempt left there removed.
fn fresh_memory_path(run_dir: &Path) -> Result<PathBuf, VmmError> {
    let path = run_dir.join(MEMORY_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&path, e)),
    }
    Ok(path)
}

fn absolute(p: &Path) -> Result<PathBuf, VmmError> {
    std::path::absolute(p).map_err(|e| io(p, e))
}

/// The migration capabilities a snapshot's stream is written and read with (both ends must agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StreamCaps {
    /// `x-ignore-shared`: RAM in a shared file stays out of the stream.
    pub ignore_shared: bool,
    /// `mapped-ram`: RAM pages at fixed offsets of the file ([`super::memory::FEATURE_MAPPED_RAM`]).
    pub mapped_ram: bool,
}

impl StreamCaps {
    /// The capabilities `info`'s stream was written with.
    pub fn of(info: &SnapshotInfo) -> StreamCaps {
        StreamCaps {
            ignore_shared: info.memory_file.is_some(),
            mapped_ram: info.features.iter().any(|f| f == FEATURE_MAPPED_RAM),
        }
    }

    /// `features` with the stream's format recorded.
    fn record(self, mut features: Vec<String>) -> Vec<String> {
        if self.mapped_ram {
            features.push(FEATURE_MAPPED_RAM.to_string());
        }
        features
    }
}

/// Loads the migration stream in `state` into a QEMU started with `-incoming defer`.
pub(super) async fn load_incoming(q: &mut Qmp, state: &File, caps: StreamCaps) -> Result<(), String> {
    set_caps(q, caps)
        .await
        .map_err(|e| format!("migration capabilities: {e}"))?;
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

/// Sets the stream's capabilities. `mapped-ram` stays on in a QEMU that loaded a `mapped-ram` stream (a child's
/// resume, whose RAM is then its own file): it is turned off again for that VM's later pauses and checkpoints
/// (with `x-ignore-shared` they carry no RAM). It is named only when on or when QEMU reports it on, so QEMUs
/// before 9.0 (no `mapped-ram`) keep working for machines that do not need it.
async fn set_caps(q: &mut Qmp, caps: StreamCaps) -> Result<(), super::qmp::QmpError> {
    let mut list = vec![json!({ "capability": "x-ignore-shared", "state": caps.ignore_shared })];
    if caps.mapped_ram || mapped_ram_on(q).await? {
        list.push(json!({ "capability": "mapped-ram", "state": caps.mapped_ram }));
    }
    q.execute("migrate-set-capabilities", Some(json!({ "capabilities": list })))
        .await
        .map(|_| ())
}

/// Whether this QEMU has the `mapped-ram` capability on.
async fn mapped_ram_on(q: &mut Qmp) -> Result<bool, super::qmp::QmpError> {
    let caps = q.execute("query-migrate-capabilities", None).await?;
    Ok(caps.as_array().is_some_and(|list| {
        list.iter()
            .any(|c| c["capability"] == "mapped-ram" && c["state"] == true)
    }))
}

/// How the running VM's RAM is mapped and which optional devices it has, asked of QEMU itself (the VM may have
/// been started by an earlier daemon).
async fn running_machine(q: &mut Qmp, run_dir: &Path) -> Result<Machine, String> {
    let prop = |property: &str| json!({ "path": "/objects/mem", "property": property });
    let ram = match q.execute("qom-get", Some(prop("share"))).await {
        // No memory backend object: anonymous RAM (a machine from before memory files).
        Err(super::qmp::QmpError::Command { .. }) => Ram::Anonymous,
        Err(e) => return Err(format!("qom-get share: {e}")),
        Ok(Value::Bool(true)) => {
            // A resumed VM keeps running on the file its resume moved to <run>/memory; QEMU still names the
            // path it opened.
            let own = run_dir.join(MEMORY_FILE);
            if std::fs::symlink_metadata(&own).is_ok_and(|m| m.file_type().is_file()) {
                Ram::Own(own)
            } else {
                let opened = q
                    .execute("qom-get", Some(prop("mem-path")))
                    .await
                    .map_err(|e| format!("qom-get mem-path: {e}"))?;
                let opened = opened.as_str().ok_or("mem-path is not a string")?;
                Ram::Own(own_memory_path(run_dir, opened)?)
            }
        }
        Ok(_) => Ram::Base(PathBuf::new()),
    };
    let balloon = q.execute("query-balloon", None).await.is_ok();
    let serial = json!({ "path": "/machine/peripheral/serial", "property": "max_ports" });
    let serial2 = match q.execute("qom-get", Some(serial)).await {
        Ok(ports) => ports.as_u64() == Some(2),
        // Machines from before `serial2` have no device of that id.
        Err(super::qmp::QmpError::Command { .. }) => false,
        Err(e) => return Err(format!("qom-get max_ports: {e}")),
    };
    Ok(Machine {
        ram,
        balloon,
        serial2,
    })
}

/// The memory file a VM's QEMU says it opened, accepted only as a regular file inside the VM's run directory:
/// the answer comes from the VMM process, which a guest that escaped into it would control, and the pause
/// then moves that file into the snapshot. No `..`, no symbolic link, nothing outside `run_dir`.
fn own_memory_path(run_dir: &Path, reported: &str) -> Result<PathBuf, String> {
    let path = run_dir.join(reported);
    let inside = path.starts_with(run_dir)
        && path.strip_prefix(run_dir).is_ok_and(|rest| {
            rest.components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
        });
    let regular = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file());
    if inside && regular {
        Ok(path)
    } else {
        Err(format!(
            "the VMM names its memory file {reported:?}, which is not a file of its run directory"
        ))
    }
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

/// Copies a file the VM owns (memory or disk overlay; hearth created both) into the snapshot, without
/// waiting for it to reach the disk (see [`fsync_path`]).
async fn copy_unsynced(from: &Path, to: &Path) -> Result<(), VmmError> {
    let dest = to.to_path_buf();
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    tokio::task::spawn_blocking(move || crate::disk::copy_sparse_unsynced(&from, &to).map_err(|e| io(&to, e)))
        .await
        .map_err(|e| VmmError::Snapshot {
            path: dest,
            detail: format!("copy task: {e}"),
        })?
}

async fn fsync_path(path: &Path) -> Result<(), VmmError> {
    let p = path.to_path_buf();
    tokio::task::spawn_blocking(move || File::open(&p).and_then(|f| f.sync_all()).map_err(|e| io(&p, e)))
        .await
        .map_err(|e| VmmError::Snapshot {
            path: path.to_path_buf(),
            detail: format!("fsync task: {e}"),
        })?
}

fn read_only(path: &Path) -> Result<(), VmmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)).map_err(|e| io(path, e))
}

fn io(path: &Path, source: std::io::Error) -> VmmError {
    VmmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::own_memory_path;

    #[test]
    fn a_memory_path_named_by_the_vmm_stays_in_the_run_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join("paused")).expect("dirs");
        std::fs::write(run.join("paused/memory"), b"m").expect("file");
        std::fs::write(dir.path().join("secret"), b"s").expect("file");
        std::os::unix::fs::symlink(dir.path().join("secret"), run.join("link")).expect("link");
        assert_eq!(
            own_memory_path(&run, "paused/memory").expect("inside"),
            run.join("paused/memory")
        );
        let abs = run.join("paused/memory");
        assert!(own_memory_path(&run, abs.to_str().expect("utf-8")).is_ok());
        let outside = dir.path().join("secret");
        for bad in [
            "../secret",
            "paused/../../secret",
            "link",
            "/etc/shadow",
            "missing",
        ] {
            assert!(own_memory_path(&run, bad).is_err(), "{bad}");
        }
        assert!(own_memory_path(&run, outside.to_str().expect("utf-8")).is_err());
    }
}
