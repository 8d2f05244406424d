//! The Firecracker driver against the real `firecracker` binary: configuration over the API, InstanceStart,
//! the vsock handshake to a guest that never answers, stop, adoption checks and failure cleanup.
//! (This host's KVM is PVM: the guest kernel does not come up, so nothing here needs a running guest.)

mod firecracker_common;

use std::time::{Duration, Instant};

use firecracker_common::{KillOnDrop, Sandbox, images, processes_mentioning, running, seccomp_modes, vmm};
use hearth_vmm::firecracker::{API_SOCKET, LOG_FILE, PID_FILE, VSOCK_SOCKET};
use hearth_vmm::{Vmm, VmmError, VmmKind};

#[tokio::test]
async fn prepare_disk_makes_a_sparse_identical_copy() {
    let images = images();
    let sbx = Sandbox::new();
    let disk = vmm()
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("prepare_disk");
    assert_eq!(disk, sbx.dir.join("disk.ext4"));
    let (a, b) = (
        std::fs::read(&images.rootfs).expect("base"),
        std::fs::read(&disk).expect("copy"),
    );
    assert!(a == b, "copy differs from the template");
    use std::os::unix::fs::MetadataExt;
    let (ma, mb) = (
        std::fs::metadata(&images.rootfs).expect("base"),
        std::fs::metadata(&disk).expect("copy"),
    );
    // Sparse (or reflinked): no more blocks allocated than the template, never the full apparent size.
    assert!(
        mb.blocks() <= ma.blocks() + 8,
        "copy allocates {} blocks, base {}",
        mb.blocks(),
        ma.blocks()
    );
    assert!(mb.blocks() * 512 < mb.len(), "copy is not sparse");

    // A missing template is a Disk error naming the destination, and leaves no partial file.
    let err = vmm()
        .prepare_disk(
            &sbx.dir.join("absent.ext4"),
            hearth_vmm::DiskFormat::Raw,
            &sbx.dir,
        )
        .await
        .expect_err("missing base");
    assert!(matches!(err, VmmError::Disk { .. }), "{err}");
    assert!(!sbx.dir.join("disk.ext4").exists() || a.len() == b.len());
}

#[tokio::test]
async fn start_configures_runs_and_stop_leaves_nothing() {
    let images = images();
    let vmm = vmm();
    assert_eq!(vmm.kind(), VmmKind::Firecracker);
    assert!(vmm.version().starts_with("Firecracker v"), "{}", vmm.version());
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = sbx.spec(&images, disk.clone());

    let t0 = Instant::now();
    let vm = vmm.start(&spec).await.expect("start");
    let start_time = t0.elapsed();
    let guard = KillOnDrop(vm.clone());
    assert_eq!(vm.kind, VmmKind::Firecracker);
    assert_eq!(vm.run_dir, sbx.dir);
    assert!(vmm.is_alive(&vm));

    // Detached: Firecracker leads its own session, so the daemon's exit or kill does not take it along.
    let pid = nix::unistd::Pid::from_raw(vm.pid as i32);
    assert_eq!(nix::unistd::getsid(Some(pid)).expect("getsid"), pid);
    assert_eq!(
        std::fs::read_to_string(sbx.dir.join(PID_FILE))
            .expect("pid file")
            .trim(),
        vm.pid.to_string()
    );

    // InstanceStart was accepted and the configuration is what the spec asked for.
    let api = vmm.api(&vm.run_dir);
    let info = api.describe().await.expect("describe");
    assert_eq!(info.state, "Running");
    assert_eq!(info.id, sbx.instance_id());
    assert!(info.id.starts_with("sbx-"));
    let cfg = api.vm_config().await.expect("vm config");
    assert_eq!(cfg["machine-config"]["vcpu_count"], 1);
    assert_eq!(cfg["machine-config"]["mem_size_mib"], firecracker_common::MEM_MIB);
    let boot = &cfg["boot-source"];
    assert_eq!(
        boot["kernel_image_path"],
        images.vmlinux.to_string_lossy().as_ref()
    );
    assert_eq!(boot["initrd_path"], images.initramfs.to_string_lossy().as_ref());
    let args = boot["boot_args"].as_str().expect("boot args");
    for want in [
        "console=ttyS0",
        "hearth.transport=vsock",
        "hearth.vsock_port=1024",
        "hearth.hostname=fc-test",
    ] {
        assert!(args.split(' ').any(|a| a == want), "{want} missing from {args}");
    }
    let drive = &cfg["drives"][0];
    assert_eq!(drive["drive_id"], "rootfs");
    // Relative to the run directory (Firecracker's cwd), through a link to the disk: snapshots taken of this
    // VM then restore in any run directory.
    assert_eq!(drive["path_on_host"], "rootfs.disk");
    assert_eq!(
        std::fs::read_link(sbx.dir.join("rootfs.disk")).expect("disk link"),
        disk
    );
    assert_eq!(drive["is_root_device"], false);
    assert_eq!(drive["is_read_only"], false);
    assert_eq!(cfg["vsock"]["guest_cid"], 3);
    assert_eq!(cfg["vsock"]["uds_path"], VSOCK_SOCKET);
    assert!(cfg["entropy"].is_object(), "entropy device missing: {cfg}");

    // A second start in the same run directory is refused and leaves the running VM alone.
    match vmm.start(&spec).await {
        Err(VmmError::StartFailed { detail, .. }) => assert!(detail.contains("already running"), "{detail}"),
        other => panic!("second start: {other:?}"),
    }
    assert!(vmm.is_alive(&vm));
    assert_eq!(api.describe().await.expect("describe").state, "Running");

    // The log can be trimmed under a running Firecracker, which keeps appending at the new end (no hole).
    assert!(vmm.trim_log(&vm, 256).expect("trim"));
    api.describe().await.expect("describe after trim");
    let log = std::fs::read(sbx.dir.join(LOG_FILE)).expect("log");
    assert!(log.starts_with(b"[hearth: log trimmed,"));
    assert!(!log.contains(&0u8), "the writer left a hole: it does not append");
    assert!(String::from_utf8_lossy(&log).contains("The API server received a Get request"));

    // Seccomp stays on (Firecracker's default): every thread runs filtered once the VM started.
    let modes = seccomp_modes(vm.pid);
    assert!(modes.iter().any(|(c, _)| c.starts_with("fc_vcpu")), "{modes:?}");
    assert!(
        modes.iter().all(|(_, m)| *m == 2),
        "threads without seccomp: {modes:?}"
    );

    // The guest never answers on vsock: connect_agent fails, bounded by the handshake timeout.
    let t = Instant::now();
    let err = vmm.connect_agent(&vm).await.expect_err("no agent in this guest");
    let handshake = t.elapsed();
    assert!(matches!(err, VmmError::AgentChannel { .. }), "{err}");
    assert!(
        handshake < Duration::from_secs(4),
        "connect_agent took {handshake:?}"
    );

    let t = Instant::now();
    vmm.stop(&vm).await.expect("stop");
    let stop_time = t.elapsed();
    assert!(!running(vm.pid, vm.start_ticks), "firecracker still running");
    assert!(!vmm.is_alive(&vm));
    assert!(
        processes_mentioning(&sbx.dir).is_empty(),
        "{:?}",
        processes_mentioning(&sbx.dir)
    );
    // Only the disk and the log remain: no sockets, no pid file.
    assert_eq!(sbx.entries(), vec!["disk.ext4".to_string(), LOG_FILE.to_string()]);
    assert!(!sbx.dir.join(API_SOCKET).exists());
    // Idempotent.
    vmm.stop(&vm).await.expect("second stop");
    drop(guard);

    eprintln!(
        "firecracker start (spawn + API socket + configure + InstanceStart): {start_time:?}; \
         failed agent handshake: {handshake:?}; stop: {stop_time:?}"
    );
}

#[tokio::test]
async fn missing_kernel_fails_with_the_fault_message_and_leaves_nothing() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let mut spec = sbx.spec(&images, disk);
    spec.images.vmlinux = sbx.dir.join("no-such-vmlinux");

    let err = vmm.start(&spec).await.expect_err("a missing kernel cannot start");
    match &err {
        VmmError::Api { endpoint, detail, .. } => {
            assert_eq!(endpoint, "PUT /boot-source");
            // Firecracker's own words: "Boot source error: The kernel file cannot be opened: ...".
            assert!(detail.contains("kernel file cannot be opened"), "{detail}");
            assert!(detail.contains("No such file"), "{detail}");
        }
        other => panic!("expected an Api error, got {other}"),
    }
    assert!(
        processes_mentioning(&sbx.dir).is_empty(),
        "{:?}",
        processes_mentioning(&sbx.dir)
    );
    assert_eq!(sbx.entries(), vec!["disk.ext4".to_string()]);

    // A kernel that is not an ELF is refused at InstanceStart; same cleanup.
    std::fs::write(sbx.dir.join("junk-kernel"), b"not a kernel").expect("write");
    spec.images.vmlinux = sbx.dir.join("junk-kernel");
    let err = vmm.start(&spec).await.expect_err("junk kernel");
    match &err {
        VmmError::Api { endpoint, detail, .. } => {
            assert_eq!(endpoint, "PUT /actions", "{detail}");
            assert!(detail.contains("HTTP 400"), "{detail}");
        }
        other => panic!("expected an Api error, got {other}"),
    }
    assert!(processes_mentioning(&sbx.dir).is_empty());
    assert_eq!(
        sbx.entries(),
        vec!["disk.ext4".to_string(), "junk-kernel".to_string()]
    );
}

#[tokio::test]
async fn bad_specs_are_refused_before_spawning() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let mut spec = sbx.spec(&images, sbx.dir.join("disk.ext4"));
    spec.hostname = "x hearth.transport=serial".into();
    assert!(matches!(
        vmm.start(&spec).await,
        Err(VmmError::StartFailed { .. })
    ));
    let mut spec = sbx.spec(&images, sbx.dir.join("disk.ext4"));
    spec.run_dir = sbx.dir.join("missing");
    assert!(matches!(
        vmm.start(&spec).await,
        Err(VmmError::StartFailed { .. })
    ));
    // A disk that does not exist: Firecracker's fault message names the drive error.
    let spec = sbx.spec(&images, sbx.dir.join("disk.ext4"));
    match vmm.start(&spec).await {
        Err(VmmError::Api { endpoint, .. }) => assert_eq!(endpoint, "PUT /drives/rootfs"),
        other => panic!("expected a drive error, got {other:?}"),
    }
    assert!(sbx.entries().is_empty(), "{:?}", sbx.entries());
    assert!(processes_mentioning(&sbx.dir).is_empty());
}

#[tokio::test]
async fn adoption_checks_guard_against_pid_reuse_and_dead_vms() {
    let images = images();
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let vm = vmm.start(&sbx.spec(&images, disk)).await.expect("start");
    let _guard = KillOnDrop(vm.clone());

    // Same pid, other start time (a recycled pid): not alive, and stop must not touch the real process.
    let mut stale = vm.clone();
    stale.start_ticks += 1;
    assert!(!vmm.is_alive(&stale));
    vmm.stop(&stale).await.expect("stop of a stale handle");
    assert!(vmm.is_alive(&vm), "stop of a stale handle killed the live VM");
    let api = vmm.api(&vm.run_dir);
    assert_eq!(
        api.describe().await.expect("API still reachable").state,
        "Running"
    );
    assert!(
        sbx.dir.join(VSOCK_SOCKET).exists(),
        "stop of a stale handle removed the live VM's socket"
    );
    // A handle of the other kind is not ours either.
    let mut other = vm.clone();
    other.kind = VmmKind::Qemu;
    assert!(!vmm.is_alive(&other));
    // A process that is not Firecracker (this test) with its real start time is not alive for the driver.
    let me = std::process::id();
    let mut not_fc = vm.clone();
    not_fc.pid = me;
    not_fc.start_ticks = hearth_vmm::process_start_ticks(me).expect("self");
    assert!(!vmm.is_alive(&not_fc));

    // A VM that died behind the driver's back: not alive; stop is fine and cleans the sockets.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(vm.pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    let t = Instant::now();
    while vmm.is_alive(&vm) && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!vmm.is_alive(&vm));
    vmm.stop(&vm).await.expect("stop after death");
    assert!(!sbx.dir.join(API_SOCKET).exists() && !sbx.dir.join(VSOCK_SOCKET).exists());
    // connect_agent to a dead VM fails at once.
    let t = Instant::now();
    assert!(matches!(
        vmm.connect_agent(&vm).await,
        Err(VmmError::AgentChannel { .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn api_socket_ready_time() {
    // Measures spawn -> API socket accepting, and the full configure + InstanceStart, over a few runs.
    let images = images();
    let vmm = vmm();
    let mut starts = Vec::new();
    let mut sockets = Vec::new();
    for _ in 0..3 {
        let sbx = Sandbox::new();
        let disk = vmm
            .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
            .await
            .expect("disk");
        let t = Instant::now();
        let vm = vmm.start(&sbx.spec(&images, disk)).await.expect("start");
        starts.push(t.elapsed());
        let _guard = KillOnDrop(vm.clone());
        let log = std::fs::read_to_string(sbx.dir.join(LOG_FILE)).expect("log");
        assert!(log.contains("API server started"), "{log}");
        vmm.stop(&vm).await.expect("stop");

        // The socket alone: a bare process, no configuration.
        let sock = sbx.dir.join("bare.sock");
        let t = Instant::now();
        let mut child = std::process::Command::new(vmm.binary())
            .arg("--api-sock")
            .arg(&sock)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(t.elapsed() < Duration::from_secs(5), "api socket never came up");
            std::thread::sleep(Duration::from_millis(1));
        }
        sockets.push(t.elapsed());
        child.kill().expect("kill");
        child.wait().expect("wait");
    }
    eprintln!("api socket ready: {sockets:?}; start incl. configuration: {starts:?}");
    assert!(starts.iter().all(|d| *d < Duration::from_secs(5)));
}

/// Set in the child process of [`vm_survives_the_death_of_the_process_that_started_it`].
const DAEMON_ROLE: &str = "HEARTH_FC_TEST_DAEMON_DIR";

#[tokio::test]
async fn vm_survives_the_death_of_the_process_that_started_it() {
    if let Some(dir) = std::env::var_os(DAEMON_ROLE) {
        // Child role, "the daemon": start a VM, record its handle, die by SIGKILL (no cleanup at all).
        let dir = std::path::PathBuf::from(dir);
        let images = images();
        let run_dir = dir.join("sbx");
        std::fs::create_dir(&run_dir).expect("run dir");
        let vmm = vmm();
        let disk = vmm
            .prepare_disk(&images.rootfs, hearth_vmm::DiskFormat::Raw, &run_dir)
            .await
            .expect("disk");
        let spec = hearth_vmm::VmSpec {
            id: "sbx_00000000000000aa".into(),
            vcpus: 1,
            memory_mib: firecracker_common::MEM_MIB,
            images: images.boot(),
            disk,
            run_dir,
            hostname: "adopted".into(),
            net: None,
        };
        let vm = vmm.start(&spec).await.expect("start");
        let json = serde_json::to_vec(&vm).expect("handle json");
        std::fs::write(dir.join("handle.json"), json).expect("write handle");
        nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL).expect("suicide");
        unreachable!("SIGKILL is not survivable");
    }

    let tmp = tempfile::tempdir().expect("tempdir");
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "vm_survives_the_death_of_the_process_that_started_it",
            "--test-threads",
            "1",
        ])
        .env(DAEMON_ROLE, tmp.path())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run the daemon role");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(9),
        "the daemon role should die by SIGKILL: {status}"
    );

    let vm: hearth_vmm::VmHandle =
        serde_json::from_slice(&std::fs::read(tmp.path().join("handle.json")).expect("handle"))
            .expect("json");
    let guard = KillOnDrop(vm.clone());
    // A new driver instance (as after a daemon restart) adopts the VM: alive, API answering, channel there.
    let vmm = vmm();
    assert!(
        vmm.is_alive(&vm),
        "firecracker died with the process that started it"
    );
    assert_eq!(
        vmm.api(&vm.run_dir).describe().await.expect("describe").state,
        "Running"
    );
    assert!(matches!(
        vmm.connect_agent(&vm).await,
        Err(VmmError::AgentChannel { .. })
    ));
    assert!(vm.run_dir.join(VSOCK_SOCKET).exists());
    vmm.stop(&vm).await.expect("stop adopted VM");
    assert!(!running(vm.pid, vm.start_ticks));
    assert!(processes_mentioning(&vm.run_dir).is_empty());
    drop(guard);
}
