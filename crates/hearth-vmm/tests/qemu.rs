//! Real-VM tests of the QEMU driver under TCG: boots the guest images built by `images/build.sh`.
//!
//! Images come from `HEARTH_IMAGES` (default `/var/lib/hearth/images`); a missing image fails the test with
//! the command that builds it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ClientError, ExecEvent};
use hearth_vmm::qemu::QemuVmm;
use hearth_vmm::{Accel, BootImages, VmHandle, VmSpec, Vmm, VmmError};

/// Under TCG on a loaded 2-core machine a cold boot takes ~5-15 s; leave room.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"))
}

fn require(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: build the guest images first with `bash images/build.sh` (as root) (HEARTH_IMAGES={})",
        path.display(),
        images_dir().display()
    );
    path
}

fn boot_images() -> BootImages {
    let dir = images_dir();
    BootImages {
        vmlinuz: require(dir.join("vmlinuz")),
        vmlinux: dir.join("vmlinux"),
        initramfs: require(dir.join("initramfs.cpio.gz")),
    }
}

/// The guest kernel release recorded by images/build.sh.
fn guest_kernel_release() -> String {
    let path = require(images_dir().join("manifest.json"));
    let text = std::fs::read_to_string(&path).expect("read manifest");
    let manifest: serde_json::Value = serde_json::from_str(&text).expect("manifest is json");
    manifest["kernel_release"]
        .as_str()
        .expect("manifest has kernel_release")
        .to_string()
}

fn spec(run: &Path, disk: PathBuf, hostname: &str) -> VmSpec {
    VmSpec {
        id: "sbx_00000000000000aa".to_string(),
        vcpus: 1,
        memory_mib: 256,
        images: boot_images(),
        disk,
        run_dir: run.to_path_buf(),
        hostname: hostname.to_string(),
        net: None,
    }
}

/// Stops the VM even when an assertion fails half-way.
struct Guard<'a> {
    vmm: &'a QemuVmm,
    vm: Option<VmHandle>,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if let Some(vm) = self.vm.take()
            && let Ok(pid) = i32::try_from(vm.pid)
            && self.vmm.is_alive(&vm)
        {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Connects and handshakes, retrying until the guest agent answers.
async fn wait_for_agent(vmm: &QemuVmm, vm: &VmHandle) -> AgentClient {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut last = String::new();
    while Instant::now() < deadline {
        assert!(
            vmm.is_alive(vm),
            "qemu exited while waiting for the agent; console:\n{}",
            console(vm)
        );
        match vmm.connect_agent(vm).await {
            Ok(stream) => match AgentClient::connect(stream, Duration::from_secs(3)).await {
                Ok(client) => return client,
                Err(ClientError::VersionMismatch { host, agent }) => panic!(
                    "the agent in {} speaks protocol {agent}, this build speaks {host}: the guest images are \
                     stale, rebuild them with `bash images/build.sh` (as root)",
                    images_dir().display()
                ),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "agent not ready after {READY_TIMEOUT:?} (last error: {last}); console:\n{}",
        console(vm)
    );
}

fn console(vm: &VmHandle) -> String {
    std::fs::read_to_string(vm.run_dir.join("console.log"))
        .unwrap_or_else(|e| format!("(no console log: {e})"))
}

async fn run_in_guest(client: &AgentClient, argv: &[&str]) -> (Option<i32>, String) {
    let mut exec = client
        .exec(ExecRequest::argv(argv.iter().copied()))
        .await
        .expect("exec");
    let mut out = Vec::new();
    loop {
        match exec.next_event().await.expect("event before the end") {
            ExecEvent::Stdout(d) => out.extend_from_slice(&d),
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exited { code, .. } => return (code, String::from_utf8_lossy(&out).into_owned()),
            ExecEvent::Error(e) => panic!("exec {argv:?}: {e}"),
        }
    }
}

fn host_kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .expect("host kernel release")
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boots_minimal_guest_runs_a_command_and_stops() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    assert_eq!(disk, run.path().join("disk.qcow2"));
    // A second prepare must not clobber the first disk.
    assert!(matches!(
        vmm.prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
            .await,
        Err(VmmError::Disk { .. })
    ));

    let t0 = Instant::now();
    let vm = vmm
        .start(&spec(run.path(), disk, "boot-test"))
        .await
        .expect("start");
    let started = t0.elapsed();
    let mut guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    assert!(vmm.is_alive(&vm));
    assert!(Path::new(&format!("/proc/{}", vm.pid)).exists());

    let client = wait_for_agent(&vmm, &vm).await;
    let ready = t0.elapsed();
    eprintln!("qemu tcg: process up in {started:?}, agent ready (cold boot) in {ready:?}");

    // Least privilege: QEMU runs under seccomp with no_new_privs and, when we are root, as the VM's own uid.
    let status = std::fs::read_to_string(format!("/proc/{}/status", vm.pid)).expect("qemu status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    assert_eq!(field("Seccomp:"), "2", "{status}");
    assert_eq!(field("NoNewPrivs:"), "1", "{status}");
    if nix::unistd::geteuid().is_root() {
        let uid = hearth_vmm::qemu::vm_uid(&spec(run.path(), PathBuf::new(), "x").id);
        assert_eq!(field("Uid:"), format!("{uid} {uid} {uid} {uid}"), "{status}");
        assert_eq!(field("CapEff:"), "0000000000000000", "{status}");
    }
    // Guest RAM is the memory file, mapped shared and without QEMU's huge-page advice (`hg`), which would make
    // the page cache dirty it in 2 MiB folios (hearth_vmm::qemu::small_pages).
    let flags = memory_file_vm_flags(vm.pid, &vm.run_dir.join("memory"));
    assert!(flags.contains(&"sh".to_owned()), "{flags:?}");
    assert!(!flags.contains(&"hg".to_owned()), "{flags:?}");

    let log = console(&vm);
    assert!(log.contains("hearth-init: started"), "console:\n{log}");
    assert!(log.contains("hearth-init: starting the agent"), "console:\n{log}");

    let (code, release) = run_in_guest(&client, &["uname", "-r"]).await;
    assert_eq!(code, Some(0));
    let release = release.trim();
    assert_eq!(release, guest_kernel_release());
    assert_ne!(
        release,
        host_kernel_release(),
        "uname ran on the host, not in the guest"
    );
    let (_, host) = run_in_guest(&client, &["cat", "/proc/sys/kernel/hostname"]).await;
    assert_eq!(host.trim(), "boot-test");
    // The agent is PID 1 and logged that it serves the virtio-serial port.
    let (_, dmesg) = run_in_guest(&client, &["dmesg"]).await;
    assert!(
        dmesg.contains("hearth-agent: serving hearth.agent"),
        "guest dmesg:\n{dmesg}"
    );

    // A console flood from the guest stays bounded on the host.
    let t = Instant::now();
    let (code, _) = run_in_guest(
        &client,
        &[
            "sh",
            "-c",
            "head -c 1200000 /dev/zero | tr '\\0' x > /dev/ttyS0; echo flood-end > /dev/ttyS0",
        ],
    )
    .await;
    assert_eq!(code, Some(0));
    let log_path = vm.run_dir.join("console.log");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !console(&vm).contains("flood-end") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("1.2 MB console flood took {:?}", t.elapsed());
    let len = std::fs::metadata(&log_path).expect("console.log").len();
    assert!(
        len <= hearth_vmm::qemu::console::CONSOLE_MAX,
        "console.log is {len} bytes"
    );
    assert!(console(&vm).contains("flood-end"), "the newest output is kept");

    // A different start time is another process (pid reuse): never "alive".
    let reused = VmHandle {
        start_ticks: vm.start_ticks + 1,
        ..vm.clone()
    };
    assert!(!vmm.is_alive(&reused));

    // A fresh driver (as after a daemon restart) recognises the VM and can stop it.
    let adopter = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    assert!(adopter.is_alive(&vm));

    drop(client);
    adopter.stop(&vm).await.expect("stop");
    assert!(!vmm.is_alive(&vm));
    // The driver reaps its child: the pid is gone, not a zombie.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Path::new(&format!("/proc/{}", vm.pid)).exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !Path::new(&format!("/proc/{}", vm.pid)).exists(),
        "pid {} still exists",
        vm.pid
    );
    vmm.stop(&vm).await.expect("stop is idempotent");
    guard.vm = None;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_init_failure_makes_qemu_exit() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    // A disk that is not ext4: /init cannot mount it, says so and powers off.
    let base = run.path().join("garbage.raw");
    std::fs::write(&base, vec![0xA5u8; 4 << 20]).expect("write base");
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    let vm = vmm
        .start(&spec(run.path(), disk, "fail-test"))
        .await
        .expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    while vmm.is_alive(&vm) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = console(&vm);
    assert!(!vmm.is_alive(&vm), "qemu still running; console:\n{log}");
    assert!(
        log.contains("hearth-init: FATAL: cannot mount /dev/vda"),
        "console:\n{log}"
    );
    // How QEMU ended is in its log, which the daemon reports when a VM exits under a sandbox: the reaper
    // notes it once the process is reaped.
    let note = format!("hearth: QEMU (pid {}) ended: exit status: 0", vm.pid);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !vmm.exit_log(&vm).contains(&note) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(vmm.exit_log(&vm).contains(&note), "{}", vmm.exit_log(&vm));
    vmm.stop(&vm).await.expect("stop of an exited vm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_failure_reports_qemu_stderr_and_leaves_nothing() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = run.path().join("base.raw");
    std::fs::write(&base, vec![0u8; 1 << 20]).expect("write base");
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    let mut s = spec(run.path(), disk, "x");
    // Without a PVH vmlinux the driver falls back to the bzImage, which QEMU then fails to open.
    s.images.vmlinux = run.path().join("no-such-elf-kernel");
    s.images.vmlinuz = run.path().join("no-such-kernel");
    let err = vmm.start(&s).await.expect_err("start must fail");
    let msg = err.to_string();
    assert!(matches!(err, VmmError::StartFailed { .. }), "{msg}");
    assert!(msg.contains("no-such"), "qemu's own message is reported: {msg}");
    // No QEMU of this run directory is left.
    let needle = run.path().to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc").expect("proc") {
        let Ok(entry) = entry else { continue };
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd);
            assert!(
                !(cmd.contains("qemu-system") && cmd.contains(&needle)),
                "leftover qemu {cmd}"
            );
        }
    }
    assert!(matches!(
        vmm.connect_agent(&VmHandle {
            kind: hearth_vmm::VmmKind::Qemu,
            pid: 0,
            start_ticks: 0,
            run_dir: run.path().to_path_buf(),
        })
        .await,
        Err(VmmError::AgentChannel { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_template_has_python_bash_procps_and_free_space() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/debian.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    let mut s = spec(run.path(), disk, "debian-test");
    s.memory_mib = 512;
    let vm = vmm.start(&s).await.expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    let client = wait_for_agent(&vmm, &vm).await;

    let (code, out) = run_in_guest(
        &client,
        &["python3", "-c", "import sys; print(sys.version_info[:2])"],
    )
    .await;
    assert_eq!((code, out.trim()), (Some(0), "(3, 13)"), "python3 from trixie");
    let (code, out) = run_in_guest(&client, &["bash", "-c", "echo $BASH_VERSION; ps -o pid= -p 1"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(out.lines().nth(1).map(str::trim), Some("1"), "{out}");
    let (code, out) = run_in_guest(
        &client,
        &["sh", "-c", "grep -c PRETTY_NAME=.*trixie /etc/os-release"],
    )
    .await;
    assert_eq!((code, out.trim()), (Some(0), "1"));
    // Generous free space on the root disk (2 GiB image).
    let (_, out) = run_in_guest(&client, &["df", "-Pm", "/"]).await;
    let avail: u64 = out
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("df output: {out}"));
    assert!(avail > 1200, "only {avail} MiB free on /");
    for dir in ["/run", "/tmp", "/root", "/proc", "/sys", "/dev"] {
        let (code, _) = run_in_guest(&client, &["test", "-d", dir]).await;
        assert_eq!(code, Some(0), "{dir} missing");
    }
    drop(client);
    vmm.stop(&vm).await.expect("stop");
    assert!(!vmm.is_alive(&vm));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_pause_resume_and_fork() {
    use hearth_vmm::SnapshotMode;
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    let s = spec(run.path(), disk.clone(), "snap-test");
    let vm = vmm.start(&s).await.expect("start");
    let mut guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    let client = wait_for_agent(&vmm, &vm).await;
    let (code, _) = run_in_guest(
        &client,
        &[
            "sh",
            "-c",
            "echo in-memory > /run/mark && echo on-disk > /root/mark && sync",
        ],
    )
    .await;
    assert_eq!(code, Some(0));

    // Checkpoint: state and a disk copy; the VM goes on.
    let snaps = tempfile::tempdir().expect("tempdir");
    let ck = snaps.path().join("checkpoint");
    std::fs::create_dir(&ck).expect("mkdir");
    let t = Instant::now();
    let info = vmm
        .snapshot(&vm, &disk, &ck, SnapshotMode::Checkpoint)
        .await
        .expect("checkpoint");
    eprintln!("checkpoint of a 256 MiB guest took {:?}", t.elapsed());
    assert_eq!(info.disk.as_deref(), Some("disk.qcow2"));
    assert_eq!((info.memory_mib, info.vcpus), (256, 1));
    for f in &info.files {
        assert!(ck.join(f).metadata().expect("snapshot file").len() > 0, "{f}");
    }
    assert!(vmm.is_alive(&vm));
    let (code, _) = run_in_guest(&client, &["sh", "-c", "echo after > /run/mark"]).await;
    assert_eq!(code, Some(0), "the VM runs on after a checkpoint");

    // Pause to zero: the process goes away.
    drop(client);
    let paused = snaps.path().join("pause");
    std::fs::create_dir(&paused).expect("mkdir");
    let pinfo = vmm
        .snapshot(&vm, &disk, &paused, SnapshotMode::Pause)
        .await
        .expect("pause");
    assert!(!vmm.is_alive(&vm));
    assert_eq!(pinfo.disk, None);

    // A snapshot for another shape is refused before anything starts.
    let mut wrong = s.clone();
    wrong.memory_mib = 512;
    assert!(matches!(
        vmm.restore(&wrong, &paused, &pinfo).await,
        Err(VmmError::Snapshot { .. })
    ));

    // Resume: same disk, same run directory, memory as it was.
    let t = Instant::now();
    let resumed = vmm.restore(&s, &paused, &pinfo).await.expect("resume");
    guard.vm = Some(resumed.clone());
    let client = wait_for_agent(&vmm, &resumed).await;
    eprintln!("resume to agent-ready took {:?}", t.elapsed());
    let (_, mark) = run_in_guest(&client, &["cat", "/run/mark"]).await;
    assert_eq!(mark, "after\n");

    // Fork from the checkpoint, next to the resumed VM: its own disk over the checkpoint's copy.
    let run_fork = tempfile::tempdir().expect("tempdir");
    let fork_disk = vmm
        .prepare_disk(
            &ck.join("disk.qcow2"),
            hearth_vmm::DiskFormat::Qcow2,
            run_fork.path(),
        )
        .await
        .expect("fork disk");
    let mut sf = spec(run_fork.path(), fork_disk, "fork-test");
    sf.id = "sbx_00000000000000bb".to_string();
    let fork = vmm.restore(&sf, &ck, &info).await.expect("fork");
    let mut fork_guard = Guard {
        vmm: &vmm,
        vm: Some(fork.clone()),
    };
    let fork_client = wait_for_agent(&vmm, &fork).await;
    let (_, mark) = run_in_guest(&fork_client, &["cat", "/run/mark", "/root/mark"]).await;
    assert_eq!(mark, "in-memory\non-disk\n");
    let (_, mark) = run_in_guest(&client, &["cat", "/run/mark"]).await;
    assert_eq!(mark, "after\n", "the resumed VM is unaffected by the fork");

    // The fork's RAM is a copy-on-write mapping of the checkpoint's memory file: its pause writes RAM into the
    // stream with `mapped-ram` (each page at its own offset), and the resume reads it back.
    let (code, _) = run_in_guest(&fork_client, &["sh", "-c", "echo fork-memory > /run/fork-mark"]).await;
    assert_eq!(code, Some(0));
    drop(fork_client);
    let fork_paused = snaps.path().join("fork-pause");
    std::fs::create_dir(&fork_paused).expect("mkdir");
    let t = std::time::Instant::now();
    let finfo = vmm
        .snapshot(&fork, &sf.disk, &fork_paused, SnapshotMode::Pause)
        .await
        .expect("pause the fork");
    let vmstate = std::fs::metadata(fork_paused.join("vmstate")).expect("vmstate");
    eprintln!(
        "fork pause (mapped-ram) took {:?}: vmstate {} bytes, {} allocated",
        t.elapsed(),
        vmstate.len(),
        std::os::unix::fs::MetadataExt::blocks(&vmstate) * 512
    );
    assert!(finfo.features.iter().any(|f| f == "mapped-ram"), "{finfo:?}");
    assert!(finfo.memory_file.is_none(), "{finfo:?}");
    let t = std::time::Instant::now();
    let fork = vmm
        .restore(&sf, &fork_paused, &finfo)
        .await
        .expect("resume the fork");
    fork_guard.vm = Some(fork.clone());
    let fork_client = wait_for_agent(&vmm, &fork).await;
    eprintln!("fork resume to agent-ready took {:?}", t.elapsed());
    let (_, mark) = run_in_guest(
        &fork_client,
        &["cat", "/run/fork-mark", "/run/mark", "/root/mark"],
    )
    .await;
    assert_eq!(mark, "fork-memory\nin-memory\non-disk\n");
    // Resumed, its RAM is its own file: the next pause carries no RAM (x-ignore-shared, mapped-ram off again in
    // the QEMU that loaded the mapped-ram stream), and resumes as any other.
    let (code, _) = run_in_guest(&fork_client, &["sh", "-c", "echo again > /run/fork-mark2"]).await;
    assert_eq!(code, Some(0));
    drop(fork_client);
    let fork_paused2 = snaps.path().join("fork-pause-2");
    std::fs::create_dir(&fork_paused2).expect("mkdir");
    let finfo2 = vmm
        .snapshot(&fork, &sf.disk, &fork_paused2, SnapshotMode::Pause)
        .await
        .expect("pause the resumed fork");
    assert!(!finfo2.features.iter().any(|f| f == "mapped-ram"), "{finfo2:?}");
    assert!(finfo2.memory_file.is_some(), "{finfo2:?}");
    let vmstate2 = std::fs::metadata(fork_paused2.join("vmstate")).expect("vmstate");
    assert!(
        vmstate2.len() < 4 << 20,
        "device state only: {} bytes",
        vmstate2.len()
    );
    let fork = vmm
        .restore(&sf, &fork_paused2, &finfo2)
        .await
        .expect("resume the fork again");
    fork_guard.vm = Some(fork.clone());
    let fork_client = wait_for_agent(&vmm, &fork).await;
    let (_, mark) = run_in_guest(&fork_client, &["cat", "/run/fork-mark", "/run/fork-mark2"]).await;
    assert_eq!(mark, "fork-memory\nagain\n");

    drop((client, fork_client));
    vmm.stop(&fork).await.expect("stop fork");
    vmm.stop(&resumed).await.expect("stop resumed");
    assert!(!vmm.is_alive(&fork) && !vmm.is_alive(&resumed));
    guard.vm = None;
    fork_guard.vm = None;
}

/// The boot protocol version the guest kernel saw: 2.12 is what its own PVH entry code fills in, a bzImage
/// loaded by QEMU's option ROM reports the kernel's header version (2.15 for 6.1).
async fn boot_protocol(client: &AgentClient) -> String {
    let (code, v) = run_in_guest(client, &["cat", "/sys/kernel/boot_params/version"]).await;
    assert_eq!(code, Some(0));
    v.trim().to_string()
}

/// Boots through the PVH entry when asked, and a snapshot moves between the two kernel images: one taken
/// after a bzImage boot (every snapshot made before PVH booting) resumes on a driver that boots vmlinux, and
/// back, with its memory intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pvh_and_bzimage_boots_share_snapshots() {
    use hearth_vmm::SnapshotMode;
    use hearth_vmm::qemu::KernelChoice;
    let located = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let bz = located.clone().with_kernel(KernelChoice::BzImage);
    let pvh = located.clone().with_kernel(KernelChoice::Pvh);
    assert!(
        hearth_vmm::qemu::has_pvh_entry(&images_dir().join("vmlinux")).expect("read vmlinux"),
        "the guest kernel has no PVH entry note"
    );
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = bz
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    let s = spec(run.path(), disk.clone(), "pvh-test");
    let snaps = tempfile::tempdir().expect("tempdir");

    // A PVH boot.
    let vm = pvh.start(&s).await.expect("start with vmlinux");
    let mut guard = Guard {
        vmm: &pvh,
        vm: Some(vm.clone()),
    };
    let client = wait_for_agent(&pvh, &vm).await;
    assert_eq!(boot_protocol(&client).await, "0x020c", "booted through PVH");
    drop(client);
    pvh.stop(&vm).await.expect("stop");
    guard.vm = None;

    // A bzImage boot, paused...
    let vm = bz.start(&s).await.expect("start with vmlinuz");
    guard.vm = Some(vm.clone());
    let client = wait_for_agent(&bz, &vm).await;
    let bz_protocol = boot_protocol(&client).await;
    assert_ne!(bz_protocol, "0x020c", "booted the bzImage");
    let (code, _) = run_in_guest(&client, &["sh", "-c", "echo from-bzimage > /run/mark"]).await;
    assert_eq!(code, Some(0));
    drop(client);
    let first = snaps.path().join("first");
    std::fs::create_dir(&first).expect("mkdir");
    let info = bz
        .snapshot(&vm, &disk, &first, SnapshotMode::Pause)
        .await
        .expect("pause");

    // ...resumes on the PVH driver (QEMU given vmlinux), still the bzImage-booted guest...
    let vm = pvh.restore(&s, &first, &info).await.expect("resume with vmlinux");
    guard.vm = Some(vm.clone());
    let client = wait_for_agent(&pvh, &vm).await;
    assert_eq!(boot_protocol(&client).await, bz_protocol);
    let (_, mark) = run_in_guest(&client, &["cat", "/run/mark"]).await;
    assert_eq!(mark, "from-bzimage\n");
    let (code, _) = run_in_guest(&client, &["sh", "-c", "echo from-pvh-driver >> /run/mark"]).await;
    assert_eq!(code, Some(0));
    drop(client);
    let second = snaps.path().join("second");
    std::fs::create_dir(&second).expect("mkdir");
    let info = pvh
        .snapshot(&vm, &disk, &second, SnapshotMode::Pause)
        .await
        .expect("pause again");

    // ...and back on the bzImage driver.
    let vm = bz.restore(&s, &second, &info).await.expect("resume with vmlinuz");
    guard.vm = Some(vm.clone());
    let client = wait_for_agent(&bz, &vm).await;
    let (_, mark) = run_in_guest(&client, &["cat", "/run/mark"]).await;
    assert_eq!(mark, "from-bzimage\nfrom-pvh-driver\n");
    drop(client);
    bz.stop(&vm).await.expect("stop");
    assert!(!bz.is_alive(&vm));
    guard.vm = None;
}

/// The `VmFlags` of process `pid`'s mapping of `file` (from `/proc/PID/smaps`).
fn memory_file_vm_flags(pid: u32, file: &Path) -> Vec<String> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
    let name = file.to_str().expect("utf-8 path");
    let mut lines = smaps.lines().skip_while(|l| !l.ends_with(name));
    assert!(lines.next().is_some(), "{name} is not mapped:\n{smaps}");
    lines
        .find_map(|l| l.strip_prefix("VmFlags:"))
        .expect("VmFlags")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}
