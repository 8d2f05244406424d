//! Pause, snapshot to files, and restore in a fresh Firecracker process, against the real binary.
//! (Under PVM the guest kernel does not come up, but the whole snapshot API works; ENVIRONMENT.md.)

mod firecracker_common;

use std::time::Instant;

use firecracker_common::{KillOnDrop, MEM_MIB, Sandbox, images, processes_mentioning, running, vmm};
use hearth_vmm::firecracker::SnapshotFiles;
use hearth_vmm::{Vmm, VmmError};

#[tokio::test]
async fn pause_snapshot_and_restore_in_a_fresh_process() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk);
    let vm = vmm.start(&spec).await.expect("start");
    let guard = KillOnDrop(vm.clone());
    let api = vmm.api(&vm.run_dir);

    let t = Instant::now();
    vmm.pause(&vm).await.expect("pause");
    let pause_time = t.elapsed();
    assert_eq!(api.describe().await.expect("describe").state, "Paused");

    let snap_dir = sbx.tmp.path().join("snap");
    std::fs::create_dir(&snap_dir).expect("snap dir");
    let files = SnapshotFiles {
        state: snap_dir.join("vm.state"),
        memory: snap_dir.join("vm.mem"),
    };
    let t = Instant::now();
    vmm.create_snapshot(&vm, &files).await.expect("snapshot");
    let snap_time = t.elapsed();
    let state_len = std::fs::metadata(&files.state).expect("state file").len();
    let mem_len = std::fs::metadata(&files.memory).expect("memory file").len();
    assert!(state_len > 0);
    assert_eq!(mem_len, u64::from(MEM_MIB) * 1024 * 1024);

    // Resume works on the original too, then it goes away.
    vmm.resume(&vm).await.expect("resume");
    assert_eq!(api.describe().await.expect("describe").state, "Running");
    vmm.stop(&vm).await.expect("stop");
    assert!(!running(vm.pid, vm.start_ticks));
    drop(guard);

    // A fresh process loads the snapshot, paused; then resumes.
    let t = Instant::now();
    let restored = vmm
        .load_snapshot_files(&spec, &files, false)
        .await
        .expect("restore");
    let restore_time = t.elapsed();
    let guard = KillOnDrop(restored.clone());
    assert_ne!(restored.pid, vm.pid);
    assert!(vmm.is_alive(&restored));
    let info = api.describe().await.expect("describe restored");
    assert_eq!(info.state, "Paused");
    let cfg = api.vm_config().await.expect("config");
    assert_eq!(cfg["machine-config"]["mem_size_mib"], MEM_MIB);
    vmm.resume(&restored).await.expect("resume restored");
    assert_eq!(api.describe().await.expect("describe").state, "Running");
    assert!(
        sbx.dir.join("vsock.sock").exists(),
        "vsock socket recreated on load"
    );
    vmm.stop(&restored).await.expect("stop restored");
    drop(guard);

    // Loading a snapshot into a process that already runs a VM is refused by Firecracker.
    let vm2 = vmm.start(&spec).await.expect("start again");
    let _guard2 = KillOnDrop(vm2.clone());
    let err = api
        .load_snapshot(hearth_vmm::firecracker::api::SnapshotLoad {
            snapshot_path: files.state.clone(),
            mem_backend: hearth_vmm::firecracker::api::MemBackend {
                backend_type: hearth_vmm::firecracker::api::MemBackendType::File,
                backend_path: files.memory.clone(),
            },
            enable_diff_snapshots: None,
            resume_vm: true,
        })
        .await
        .expect_err("load after start");
    assert!(err.to_string().contains("PUT /snapshot/load"), "{err}");
    vmm.stop(&vm2).await.expect("stop");

    eprintln!(
        "pause: {pause_time:?}; snapshot/create ({MEM_MIB} MiB guest, state {state_len} B): {snap_time:?}; \
         restore in a fresh process: {restore_time:?}"
    );
}

#[tokio::test]
async fn a_damaged_snapshot_is_refused_and_nothing_is_left() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk);
    let vm = vmm.start(&spec).await.expect("start");
    let guard = KillOnDrop(vm.clone());
    vmm.pause(&vm).await.expect("pause");
    let files = SnapshotFiles {
        state: sbx.tmp.path().join("vm.state"),
        memory: sbx.tmp.path().join("vm.mem"),
    };
    vmm.create_snapshot(&vm, &files).await.expect("snapshot");
    vmm.stop(&vm).await.expect("stop");
    drop(guard);

    // Truncated state file: Firecracker's fault message, no process, no sockets.
    let state = std::fs::read(&files.state).expect("state");
    std::fs::write(&files.state, &state[..state.len() / 2]).expect("truncate");
    let err = vmm
        .load_snapshot_files(&spec, &files, true)
        .await
        .expect_err("truncated state");
    match &err {
        VmmError::Api { endpoint, detail, .. } => {
            assert_eq!(endpoint, "PUT /snapshot/load");
            assert!(detail.contains("HTTP 400"), "{detail}");
        }
        other => panic!("expected an Api error, got {other}"),
    }
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert_eq!(sbx.entries(), vec!["disk.ext4".to_string()]);

    // Snapshot of a VM that is not paused: refused with Firecracker's reason.
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = KillOnDrop(vm.clone());
    let err = vmm.create_snapshot(&vm, &files).await.expect_err("not paused");
    assert!(err.to_string().contains("PUT /snapshot/create"), "{err}");
    vmm.stop(&vm).await.expect("stop");
}
