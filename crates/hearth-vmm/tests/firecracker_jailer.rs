//! Firecracker under its jailer (SECURITY.md promise 1), against the real `jailer` and `firecracker`:
//! chroot with only the VM's files, own uid/gid, own mount namespace, cgroup settings applied, seccomp on.

mod firecracker_common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use firecracker_common::{KillOnDrop, Sandbox, images, processes_mentioning, running, seccomp_modes, vmm};
use hearth_vmm::firecracker::{CgroupVersion, FirecrackerVmm, JailerConfig, SnapshotFiles};
use hearth_vmm::{Vmm, VmmError};

/// An unprivileged uid/gid no account on the machine uses.
const JAIL_ID: u32 = 47_311;

/// A cgroup setting that works on this host's hierarchy, and the file where it shows up.
fn cgroup_setting(iid: &str) -> (CgroupVersion, String, PathBuf, String) {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        let file = Path::new("/sys/fs/cgroup/firecracker").join(iid).join("pids.max");
        (CgroupVersion::V2, "pids.max=512".into(), file, "512".into())
    } else {
        let file = Path::new("/sys/fs/cgroup/cpu/firecracker")
            .join(iid)
            .join("cpu.shares");
        (CgroupVersion::V1, "cpu.shares=512".into(), file, "512".into())
    }
}

fn jailed_vmm(iid: &str) -> (FirecrackerVmm, PathBuf, String) {
    let (version, setting, file, value) = cgroup_setting(iid);
    let mut cfg = JailerConfig::new(JAIL_ID, JAIL_ID);
    cfg.cgroup_version = version;
    cfg.cgroups = vec![setting];
    (vmm().with_jailer(cfg), file, value)
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[tokio::test]
async fn jailed_vm_runs_confined_and_stops_cleanly() {
    let images = images();
    let sbx = Sandbox::new();
    let iid = sbx.instance_id();
    let (vmm, cgroup_file, cgroup_value) = jailed_vmm(&iid);
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk.clone());

    let t = Instant::now();
    let vm = vmm.start(&spec).await.expect("jailed start");
    let start_time = t.elapsed();
    let guard = KillOnDrop(vm.clone());
    assert!(vmm.is_alive(&vm));
    // A driver configured without the jailer (a daemon restarted with another setting) still recognises
    // the jailed VM as Firecracker's, so it can stop it.
    assert!(firecracker_common::vmm().is_alive(&vm));

    // Own uid/gid (real, effective, saved, fs), no capabilities.
    let id = JAIL_ID.to_string();
    assert_eq!(status_field(vm.pid, "Uid:"), [id.as_str(); 4].join(" "));
    assert_eq!(status_field(vm.pid, "Gid:"), [id.as_str(); 4].join(" "));
    assert_eq!(status_field(vm.pid, "CapEff:"), "0000000000000000");
    // Own mount namespace, and a root that holds only the VM's files.
    assert_ne!(
        std::fs::read_link(format!("/proc/{}/ns/mnt", vm.pid)).expect("mnt ns"),
        std::fs::read_link("/proc/self/ns/mnt").expect("own mnt ns")
    );
    let root = PathBuf::from(format!("/proc/{}/root", vm.pid));
    let mut seen: Vec<String> = std::fs::read_dir(&root)
        .expect("jail root")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    seen.sort();
    for name in &seen {
        assert!(
            [
                "dev",
                "disk.ext4",
                "firecracker",
                "firecracker.pid",
                "initramfs.cpio.gz",
                "run",
                // The base the first pause lays its diff over: empty, root's, read-only (checked below).
                "snapshot.mem",
                "vmlinux"
            ]
            .contains(&name.as_str()),
            "unexpected {name} in the jail: {seen:?}"
        );
    }
    {
        use std::os::unix::fs::MetadataExt;
        let base = std::fs::symlink_metadata(root.join("snapshot.mem")).expect("the boot's diff base");
        assert!(base.is_file(), "{base:?}");
        assert_eq!((base.len(), base.uid(), base.mode() & 0o777), (0, 0, 0o444));
    }
    assert!(!root.join("etc").exists() && !root.join("proc").exists());
    // The guest writes the sandbox's own disk: same inode, handed to the jail's uid.
    let (jailed, host) = (
        std::fs::metadata(root.join("disk.ext4")).expect("jailed disk"),
        std::fs::metadata(&disk).expect("disk"),
    );
    assert_eq!(jailed.ino(), host.ino());
    assert_eq!(host.uid(), JAIL_ID);
    // The shared kernel image is not handed over.
    assert_eq!(std::fs::metadata(&images.vmlinux).expect("kernel").uid(), 0);

    // Seccomp on every thread, and the cgroup setting applied.
    let modes = seccomp_modes(vm.pid);
    assert!(modes.iter().all(|(_, m)| *m == 2), "{modes:?}");
    assert_eq!(
        std::fs::read_to_string(&cgroup_file).expect("cgroup file").trim(),
        cgroup_value
    );

    // The API and vsock sockets are reachable at the usual run-dir paths; Firecracker sees jail paths.
    let api = vmm.api(&vm.run_dir);
    assert_eq!(api.describe().await.expect("describe").state, "Running");
    let cfg = api.vm_config().await.expect("config");
    assert_eq!(cfg["boot-source"]["kernel_image_path"], "/vmlinux");
    assert_eq!(cfg["drives"][0]["path_on_host"], "/disk.ext4");
    assert_eq!(cfg["vsock"]["uds_path"], "/run/vsock.sock");
    let t = Instant::now();
    let err = vmm.connect_agent(&vm).await.expect_err("no agent");
    assert!(matches!(err, VmmError::AgentChannel { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(4));

    vmm.stop(&vm).await.expect("stop");
    assert!(!running(vm.pid, vm.start_ticks));
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert!(
        !cgroup_file.parent().expect("cgroup dir").exists(),
        "cgroup left behind"
    );
    // The jail (device nodes, links) goes with the process; the sandbox's disk and log stay.
    assert_eq!(
        sbx.entries(),
        vec!["disk.ext4".to_string(), "firecracker.log".to_string()]
    );
    vmm.stop(&vm).await.expect("second stop");
    drop(guard);
    eprintln!("jailed start (jail setup + jailer + configure + InstanceStart): {start_time:?}");
}

#[tokio::test]
async fn jailed_failure_reports_the_fault_and_removes_the_jail() {
    let images = images();
    let sbx = Sandbox::new();
    let iid = sbx.instance_id();
    let (vmm, cgroup_file, _) = jailed_vmm(&iid);
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let mut spec = sbx.spec(&images, disk);
    // Not an ELF: copied into the jail fine, refused by Firecracker at InstanceStart.
    let junk = sbx.tmp.path().join("junk-kernel");
    std::fs::write(&junk, b"not a kernel").expect("junk");
    spec.images.vmlinux = junk;
    let err = vmm.start(&spec).await.expect_err("junk kernel");
    assert!(matches!(err, VmmError::Api { .. }), "{err}");
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert_eq!(sbx.entries(), vec!["disk.ext4".to_string()]);
    assert!(!cgroup_file.parent().expect("cgroup dir").exists());

    // A disk on another filesystem cannot be hard-linked into the jail: a clear error, nothing left.
    let shm = tempfile::tempdir_in("/dev/shm").expect("tmpfs dir");
    let other_fs_disk = shm.path().join("disk.ext4");
    std::fs::copy(&images.rootfs, &other_fs_disk).expect("copy");
    let spec = sbx.spec(&images, other_fs_disk);
    let err = vmm.start(&spec).await.expect_err("cross-fs disk");
    assert!(err.to_string().contains("same filesystem"), "{err}");
    assert_eq!(sbx.entries(), vec!["disk.ext4".to_string()]);
}

#[tokio::test]
async fn jailed_snapshot_restores_into_a_fresh_jail() {
    let images = images();
    let sbx = Sandbox::new();
    let iid = sbx.instance_id();
    let (vmm, _, _) = jailed_vmm(&iid);
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
    vmm.create_snapshot(&vm, &files).await.expect("jailed snapshot");
    for f in [&files.state, &files.memory] {
        // Taken out of the jail and handed to root, read-only for everyone: no jailed uid can change it, and a
        // restore links it into the new jail instead of copying it.
        let meta = std::fs::symlink_metadata(f).expect("snapshot file");
        assert!(meta.is_file());
        assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o444), "{}", f.display());
    }
    vmm.stop(&vm).await.expect("stop");
    drop(guard);

    let restored = vmm
        .load_snapshot_files(&spec, &files, true)
        .await
        .expect("jailed restore");
    let _guard = KillOnDrop(restored.clone());
    assert!(vmm.is_alive(&restored));
    assert_eq!(
        vmm.api(&restored.run_dir)
            .describe()
            .await
            .expect("describe")
            .state,
        "Running"
    );
    // A restored VM's memory stays backed by the snapshot it came from: it snapshots again elsewhere
    // (regression: the second pause of a resumed sandbox failed with EACCES on that file).
    vmm.pause(&restored).await.expect("pause restored");
    let again = SnapshotFiles {
        state: sbx.tmp.path().join("vm2.state"),
        memory: sbx.tmp.path().join("vm2.mem"),
    };
    vmm.create_snapshot(&restored, &again)
        .await
        .expect("snapshot of a restored VM");
    assert!(
        std::fs::metadata(&again.memory)
            .expect("second memory file")
            .len()
            > 0
    );
    vmm.stop(&restored).await.expect("stop restored");
    assert!(processes_mentioning(&sbx.dir).is_empty());
}

#[tokio::test]
async fn jailed_checkpoint_forks_into_another_jail_through_the_trait() {
    use hearth_vmm::SnapshotMode;
    let images = images();
    let sbx = Sandbox::new();
    let (vmm, _, _) = jailed_vmm(&sbx.instance_id());
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk.clone());
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = KillOnDrop(vm.clone());
    let dir = sbx.tmp.path().join("ck");
    std::fs::create_dir(&dir).expect("snapshot dir");
    let info = vmm
        .snapshot(&vm, &disk, &dir, SnapshotMode::Checkpoint)
        .await
        .expect("jailed checkpoint");
    assert!(vmm.is_alive(&vm), "the original runs on");
    // The files are root's, read-only, and none is an inode the still-running jailed process has open.
    let held: Vec<(u64, u64)> = std::fs::read_dir(format!("/proc/{}/fd", vm.pid))
        .expect("fds")
        .filter_map(|e| std::fs::metadata(e.ok()?.path()).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    for f in &info.files {
        let meta = std::fs::symlink_metadata(dir.join(f)).expect("snapshot file");
        assert!(meta.is_file(), "{f}");
        // The memory and state are read-only (restores link them into their jails); the disk copy is
        // private (a fork copies it).
        let mode = if info.disk.as_deref() == Some(f.as_str()) {
            0o600
        } else {
            0o444
        };
        // The memory file has one more name: the VM's root-owned run directory (out of the jail) keeps it as
        // the base its next snapshot lays a diff over (the checkpoint was a diff: the VM booted with
        // dirty-page tracking). It is this sealed copy, never an inode the jailed process had open.
        let links = if f == "vm.mem" {
            let kept = std::fs::symlink_metadata(vm.run_dir.join("checkpoint-base.mem"))
                .expect("the checkpoint kept as the next diff base");
            assert_eq!((kept.dev(), kept.ino()), (meta.dev(), meta.ino()), "{f}");
            2
        } else {
            1
        };
        assert_eq!(
            (meta.uid(), meta.mode() & 0o777, meta.nlink()),
            (0, mode, links),
            "{f}"
        );
        assert!(
            !held.contains(&(meta.dev(), meta.ino())),
            "{f} is open in the VMM"
        );
    }
    // The fork: another sandbox, its own jail and disk; the state names jail paths, so it loads there.
    let fsbx = Sandbox::new();
    let (fvmm, _, _) = jailed_vmm(&fsbx.instance_id());
    let fdisk = fvmm
        .prepare_disk(
            &dir.join(info.disk.as_deref().expect("disk copy")),
            hearth_vmm::DiskFormat::Raw,
            &fsbx.dir,
        )
        .await
        .expect("fork disk");
    let fork = fvmm
        .restore(&fsbx.spec(&images, fdisk), &dir, &info)
        .await
        .expect("jailed fork");
    let _fguard = KillOnDrop(fork.clone());
    assert!(fvmm.is_alive(&fork));
    // The fork restored with dirty-page tracking: the checkpoint's memory file (the same sealed inode, root's,
    // read-only) is the base its first snapshot lays a diff over a copy of.
    let sealed = std::fs::metadata(dir.join("vm.mem")).expect("checkpoint memory");
    let base = std::fs::symlink_metadata(fork.run_dir.join("checkpoint-base.mem"))
        .expect("the fork keeps the checkpoint as its diff base");
    assert_eq!(
        (base.dev(), base.ino(), base.uid(), base.mode() & 0o777),
        (sealed.dev(), sealed.ino(), 0, 0o444)
    );
    assert_eq!(
        fvmm.api(&fork.run_dir).describe().await.expect("describe").state,
        "Running"
    );
    fvmm.stop(&fork).await.expect("stop fork");
    vmm.stop(&vm).await.expect("stop");
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert!(processes_mentioning(&fsbx.dir).is_empty());
}

/// A network namespace made (and removed) by the test.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Self {
        let name = format!("hearth-fct-{tag}-{}", std::process::id());
        let ok = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("ip netns add");
        assert!(ok.success(), "ip netns add {name}");
        Self(name)
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.0)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

#[tokio::test]
async fn jailed_vm_joins_the_given_network_namespace() {
    let images = images();
    let sbx = Sandbox::new();
    let netns = Netns::new("join");
    let mut cfg = JailerConfig::new(JAIL_ID, JAIL_ID);
    cfg.netns = Some(netns.path());
    let vmm = vmm().with_jailer(cfg);
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let vm = vmm.start(&sbx.spec(&images, disk)).await.expect("start in netns");
    let _guard = KillOnDrop(vm.clone());
    let ns_ino = std::fs::metadata(netns.path()).expect("netns").ino();
    assert_eq!(
        std::fs::read_link(format!("/proc/{}/ns/net", vm.pid)).expect("net ns"),
        PathBuf::from(format!("net:[{ns_ino}]"))
    );
    assert_ne!(
        std::fs::read_link("/proc/self/ns/net").expect("own ns"),
        PathBuf::from(format!("net:[{ns_ino}]"))
    );
    vmm.stop(&vm).await.expect("stop");
    assert!(!running(vm.pid, vm.start_ticks));
}

#[tokio::test]
async fn symlinks_planted_in_the_jail_do_not_redirect_the_driver() {
    // What a compromised (jailed) Firecracker could do: it owns its chroot, so it can replace its sockets
    // with symlinks to host sockets. The driver must not follow them into the host.
    let images = images();
    let sbx = Sandbox::new();
    let iid = sbx.instance_id();
    let (vmm, _, _) = jailed_vmm(&iid);
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let vm = vmm.start(&sbx.spec(&images, disk)).await.expect("start");
    let _guard = KillOnDrop(vm.clone());

    let host = tempfile::tempdir().expect("host dir");
    let host_sock = host.path().join("daemon.sock");
    let listener = std::os::unix::net::UnixListener::bind(&host_sock).expect("host socket");
    listener.set_nonblocking(true).expect("nonblocking");
    let run = sbx.dir.join("jail/firecracker").join(&iid).join("root/run");
    for name in ["vsock.sock", "fc.sock"] {
        std::fs::remove_file(run.join(name)).expect("remove jailed socket");
        std::os::unix::fs::symlink(&host_sock, run.join(name)).expect("plant symlink");
    }
    assert!(matches!(
        vmm.connect_agent(&vm).await,
        Err(VmmError::AgentChannel { .. })
    ));
    assert!(vmm.api(&vm.run_dir).describe().await.is_err());
    // The same with a symlinked directory instead.
    std::fs::remove_dir_all(&run).expect("remove run dir");
    std::os::unix::fs::symlink(host.path(), &run).expect("plant dir symlink");
    std::fs::rename(&host_sock, host.path().join("vsock.sock")).expect("rename");
    assert!(vmm.connect_agent(&vm).await.is_err());
    assert!(
        listener.accept().is_err(),
        "the driver connected to a host socket through a planted symlink"
    );
    vmm.stop(&vm).await.expect("stop");
    assert!(!running(vm.pid, vm.start_ticks));
    assert!(
        host.path().join("vsock.sock").exists(),
        "stop removed a file outside the jail"
    );
}
