//! The `Vmm` trait's `snapshot` (checkpoint and pause) and `restore` for Firecracker, against the real binary.
//! The guest kernel cannot run on this host (PVM, see ENVIRONMENT.md), so this checks the VMM side: the
//! process states, the files and their contents, which disk a restored VM opened, and that the snapshot files
//! never change however many VMs restore from them.

mod firecracker_common;

use std::hash::{DefaultHasher, Hasher};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use firecracker_common::{KillOnDrop, MEM_MIB, Sandbox, images, processes_mentioning, running, vmm};
use hearth_vmm::firecracker::FirecrackerVmm;
use hearth_vmm::{SnapshotMode, VmHandle, Vmm, VmmError, VmmKind};

/// A content hash of a file (not cryptographic: it only has to notice a change).
fn hash(path: &Path) -> u64 {
    let mut f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut h = DefaultHasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).expect("read");
        if n == 0 {
            return h.finish();
        }
        h.write(&buf[..n]);
    }
}

/// Files the process `pid` has open (targets of `/proc/<pid>/fd/*`).
fn open_files(pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .collect()
        })
        .unwrap_or_default()
}

async fn describe(vmm: &FirecrackerVmm, vm: &VmHandle) -> String {
    vmm.api(&vm.run_dir).describe().await.expect("describe").state
}

fn snap_dir(sbx: &Sandbox, name: &str) -> PathBuf {
    let d = sbx.tmp.path().join(name);
    std::fs::create_dir(&d).expect("snapshot dir");
    d
}

#[tokio::test]
async fn checkpoint_keeps_running_and_restores_twice_next_to_it() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk.clone());
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = KillOnDrop(vm.clone());

    let dir = snap_dir(&sbx, "checkpoint");
    let t = Instant::now();
    let info = vmm
        .snapshot(&vm, &disk, &dir, SnapshotMode::Checkpoint)
        .await
        .expect("checkpoint");
    let checkpoint_time = t.elapsed();
    // The original goes on running, in the same process.
    assert!(vmm.is_alive(&vm));
    assert_eq!(describe(&vmm, &vm).await, "Running");
    assert_eq!(info.kind, VmmKind::Firecracker);
    assert_eq!(info.vmm_version, vmm.version());
    assert_eq!((info.memory_mib, info.vcpus), (MEM_MIB, 1));
    assert_eq!(info.disk.as_deref(), Some("disk.ext4"));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut listed = info.files.clone();
    listed.sort();
    assert_eq!(names, listed);
    assert_eq!(listed, vec!["disk.ext4", "vm.mem", "vm.state"]);
    let mem = dir.join("vm.mem");
    assert_eq!(
        std::fs::metadata(&mem).expect("mem").len(),
        u64::from(MEM_MIB) << 20
    );
    // The disk copy is the disk as it was (nothing wrote to it since: the guest never gets that far here).
    assert_eq!(hash(&dir.join("disk.ext4")), hash(&disk));
    let before = [
        hash(&dir.join("vm.state")),
        hash(&mem),
        hash(&dir.join("disk.ext4")),
    ];

    // Two forks from the one checkpoint, each with its own disk (a copy of the checkpoint's), next to the
    // running original.
    let mut forks = Vec::new();
    let mut restore_times = Vec::new();
    for _ in 0..2 {
        let fsbx = Sandbox::new();
        let fdisk = vmm
            .prepare_disk(&dir.join("disk.ext4"), hearth_vmm::DiskFormat::Raw, &fsbx.dir)
            .await
            .expect("fork disk");
        let fspec = fsbx.spec(&images, fdisk.clone());
        let t = Instant::now();
        let f = vmm.restore(&fspec, &dir, &info).await.expect("restore");
        restore_times.push(t.elapsed());
        let guard = KillOnDrop(f.clone());
        assert!(vmm.is_alive(&f));
        assert_ne!(f.pid, vm.pid);
        assert_eq!(describe(&vmm, &f).await, "Running");
        // It attached its own disk and its own vsock socket, not the original's.
        let open = open_files(f.pid);
        assert!(open.contains(&fdisk), "{open:?} lacks {}", fdisk.display());
        assert!(!open.contains(&disk), "fork opened the original's disk");
        assert!(fsbx.dir.join("vsock.sock").exists());
        // The memory file is mapped private (copy-on-write), so the guest's writes never reach it.
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", f.pid)).expect("maps");
        let mem_maps: Vec<&str> = maps.lines().filter(|l| l.ends_with("/vm.mem")).collect();
        assert!(!mem_maps.is_empty(), "vm.mem not mapped:\n{maps}");
        for l in &mem_maps {
            let perms = l.split(' ').nth(1).unwrap_or("");
            assert!(perms.ends_with('p'), "shared mapping of the snapshot memory: {l}");
        }
        forks.push((fsbx, f, guard));
    }
    assert!(vmm.is_alive(&vm), "the original survived its forks");
    for (_, f, _) in &forks {
        vmm.stop(f).await.expect("stop fork");
        assert!(!running(f.pid, f.start_ticks));
    }
    vmm.stop(&vm).await.expect("stop original");
    // Restoring (mapping the memory, running, stopping) changed none of the snapshot's files.
    let after = [
        hash(&dir.join("vm.state")),
        hash(&mem),
        hash(&dir.join("disk.ext4")),
    ];
    assert_eq!(before, after, "snapshot files changed by the restores");
    eprintln!(
        "checkpoint ({MEM_MIB} MiB guest, pause + snapshot/create + disk copy + fsync + resume): \
         {checkpoint_time:?}; restores in fresh processes: {restore_times:?}"
    );
}

#[tokio::test]
async fn pause_stops_the_process_and_resume_uses_the_same_disk() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk.clone());
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = KillOnDrop(vm.clone());

    let dir = snap_dir(&sbx, "paused");
    let t = Instant::now();
    let info = vmm
        .snapshot(&vm, &disk, &dir, SnapshotMode::Pause)
        .await
        .expect("pause");
    let pause_time = t.elapsed();
    assert!(!running(vm.pid, vm.start_ticks), "the process is gone");
    assert!(!vmm.is_alive(&vm));
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert_eq!(info.disk, None);
    assert_eq!(info.files, vec!["vm.state", "vm.mem"]);
    assert!(!dir.join("disk.ext4").exists());
    // The snapshot directory is not empty any more: a second snapshot into it is refused.
    let again = vmm.snapshot(&vm, &disk, &dir, SnapshotMode::Pause).await;
    assert!(matches!(again, Err(VmmError::Snapshot { .. })), "{again:?}");

    // Resume: a fresh process, same run directory, same disk.
    let t = Instant::now();
    let resumed = vmm.restore(&spec, &dir, &info).await.expect("resume");
    let resume_time = t.elapsed();
    let _guard2 = KillOnDrop(resumed.clone());
    assert_ne!(resumed.pid, vm.pid);
    assert_eq!(describe(&vmm, &resumed).await, "Running");
    assert!(open_files(resumed.pid).contains(&disk));
    vmm.stop(&resumed).await.expect("stop");

    // A resumed-then-paused-again VM snapshots again into a new directory.
    let resumed = vmm.restore(&spec, &dir, &info).await.expect("resume again");
    let _guard3 = KillOnDrop(resumed.clone());
    let dir2 = snap_dir(&sbx, "paused2");
    vmm.snapshot(&resumed, &disk, &dir2, SnapshotMode::Pause)
        .await
        .expect("pause again");
    assert!(!running(resumed.pid, resumed.start_ticks));
    eprintln!("pause to files + stop: {pause_time:?}; resume in a fresh process: {resume_time:?}");
}

#[tokio::test]
async fn damaged_or_mismatched_snapshots_are_refused_and_leave_nothing() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk.clone());
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = KillOnDrop(vm.clone());
    let dir = snap_dir(&sbx, "snap");
    let info = vmm
        .snapshot(&vm, &disk, &dir, SnapshotMode::Pause)
        .await
        .expect("pause");
    let entries_before = sbx.entries();

    // Truncated memory file: refused before any process starts.
    let mem = dir.join("vm.mem");
    let len = std::fs::metadata(&mem).expect("mem").len();
    std::fs::File::options()
        .write(true)
        .open(&mem)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    match vmm.restore(&spec, &dir, &info).await {
        Err(VmmError::Snapshot { path, detail }) => {
            assert_eq!(path, mem);
            assert!(detail.contains("memory file has"), "{detail}");
        }
        other => panic!("expected a snapshot error, got {other:?}"),
    }
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert_eq!(sbx.entries(), entries_before);

    // Another machine shape, or another VMM's snapshot: refused.
    let mut bigger = spec.clone();
    bigger.memory_mib *= 2;
    assert!(matches!(
        vmm.restore(&bigger, &dir, &info).await,
        Err(VmmError::Snapshot { .. })
    ));
    let mut qemu_info = info.clone();
    qemu_info.kind = VmmKind::Qemu;
    assert!(matches!(
        vmm.restore(&spec, &dir, &qemu_info).await,
        Err(VmmError::Snapshot { .. })
    ));
    // A missing state file.
    std::fs::remove_file(dir.join("vm.state")).expect("rm state");
    assert!(vmm.restore(&spec, &dir, &info).await.is_err());
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert_eq!(sbx.entries(), entries_before);
}

#[tokio::test]
async fn a_disk_named_like_the_link_is_never_removed() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let made = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let disk = sbx.dir.join("rootfs.disk");
    std::fs::rename(&made, &disk).expect("rename");
    let spec = sbx.spec(&images, disk.clone());
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = KillOnDrop(vm.clone());
    assert!(open_files(vm.pid).contains(&disk));
    let dir = snap_dir(&sbx, "snap");
    let info = vmm
        .snapshot(&vm, &disk, &dir, SnapshotMode::Pause)
        .await
        .expect("pause");
    assert!(disk.is_file(), "stop removed the disk");
    let resumed = vmm.restore(&spec, &dir, &info).await.expect("resume");
    let _guard2 = KillOnDrop(resumed.clone());
    vmm.stop(&resumed).await.expect("stop");
    let meta = std::fs::symlink_metadata(&disk).expect("disk still there");
    assert!(meta.is_file() && meta.len() > 0);
}
